"""pd.kernels.sparse_mla_decode on CPU: interpreter correctness vs the fp64 reference (subprocess, since
TRITON_INTERPRET must be set before triton decorates the kernels), input validation, reference layout, and
AOT compilation of every autotune config for sm_120a (mma.sync, no wgmma, <= 101376 B shared) and sm_90a."""

import json
import os
import subprocess
import sys

import pytest
import torch

from triton_aot import aot, assert_sm120_ok, compile_for

HERE = os.path.dirname(os.path.abspath(__file__))
# The issue asks 2e-3, but bf16 output rounding alone is ~1.6e-3 relative RMS and P is rounded to bf16 for the PV
# dot (as FlashMLA does): on the H200 ours lands at 2.04-2.26e-3 vs the fp64 reference and FlashMLA's sm_90 kernel
# at 2.07-2.24e-3 on the same inputs (benchmarks/results/sparse_mla_decode_2026-11-30-s3.md); these interpreter
# cases at 1.99-2.13e-3. 2.5e-3 catches anything worse than that rounding.
REL_TOL = 2.5e-3
LSE_TOL = 1e-3


@pytest.fixture(scope="module")
def interp_results():
    env = dict(os.environ, TRITON_INTERPRET="1", TRITON_DEFAULT_FP_FUSION="1")
    out = {}
    # the shared cases, then this file's c128-layout cases (its __main__ block, below)
    for script in ("sparse_mla_interp_cases.py", os.path.basename(__file__)):
        p = subprocess.run([sys.executable, os.path.join(HERE, script)], env=env, capture_output=True, text=True,
                           timeout=300)
        assert p.returncode == 0, p.stderr[-4000:]
        out.update((r["name"], r) for r in map(json.loads, filter(None, p.stdout.splitlines())))
    return out


CASE_NAMES = ["s1_h16", "s2_h32_holes_len", "s2_h16_len0_sink", "s1_h32_split3_sink", "s2_h16_extra_sink_split2",
              "s1_h16_extra_direct_len0", "s1_h16_page256_2d", "chunked_s2_h64_holes_len_sink",
              "chunked_s1_h32_extra_split2_len0", "pipelined_s2_h64_holes_len_sink_split2"]
# A c128 layer's call (DeepseekV4AttnBackend._forward_attention): the SWA cache (256-token pages, 128-wide window)
# plus the layer's compressed cache with 256 / 128 = 2 tokens per page, addressed as [pages, 2, 1, 584] views or
# (the 2-D form) a contiguous [pages, 1728] byte buffer; each of the three kernels reads the 2-token pages once.
C128_CASES = {
    # default path under the interpreter: 16-head programs -> the pipelined kernel
    "c128_pipelined_s1_h16_page2_holes_len_sink": dict(b=2, s=1, h=16, etopk=128, elens=[128, 37], splits=None,
                                                       block_h=None, config=None, view2d=False),
    # 32-head programs -> the plain kernel; the compressed cache as the 2-D byte buffer (page stride 1728)
    "c128_plain_s2_h32_page2_2d_split2": dict(b=2, s=2, h=32, etopk=64, elens=[64, 1], splits=2, block_h=32,
                                              config=None, view2d=True),
    # the chunked kernel, forced
    "c128_chunked_s1_h64_page2_direct": dict(b=1, s=1, h=64, etopk=80, elens=[77], splits=1, block_h=64,
                                             config={"BLOCK_N": 16, "num_warps": 4, "num_stages": 1,
                                                     "CHUNKED": True}, view2d=False),
}
CASE_NAMES += list(C128_CASES)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_interpreter_matches_reference(interp_results, name):
    r = interp_results[name]
    assert not r["nan"], r
    assert r["same_inf"] and r["empty_rows_zero"], r
    assert r["rel"] <= REL_TOL, r
    assert r["lse_err"] <= LSE_TOL, r


# ---------------------------------------------------------------- reference / layout

def test_reference_roundtrip_layout():
    from pd.kernels.sparse_mla_reference import dequantize_kv, page_stride_bytes, quantize_kv

    assert page_stride_bytes(64) == 37440 and page_stride_bytes(256) == 149760
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(128, 512, generator=g)
    kc = quantize_kv(kv, 64)
    assert kc.shape == (2, 37440) and kc.dtype == torch.uint8
    # token 5 of page 1: rope bytes are the bf16 values, scale bytes at page_size*576 + 5*8
    tok = 64 + 5
    rope = kc[1, 5 * 576 + 448: 5 * 576 + 576].view(torch.bfloat16)
    assert torch.equal(rope, kv[tok, 448:].bfloat16())
    sc = kc[1, 64 * 576 + 5 * 8: 64 * 576 + 5 * 8 + 8]
    assert sc[7] == 0
    deq = dequantize_kv(kc, 64)
    assert torch.allclose(deq[tok, :448], (kc[1, 5 * 576: 5 * 576 + 448].view(torch.float8_e4m3fn).float()
                                            * torch.pow(2.0, sc[:7].float() - 127).repeat_interleave(64)))
    # fp8 e4m3 keeps ~2^-4 relative precision
    assert ((deq[:, :448] - kv[:, :448]).norm() / kv[:, :448].norm()) < 0.05


# ---------------------------------------------------------------- validation

def _inputs(b=1, s=1, h=16, topk=8, ps=64):
    from pd.kernels.sparse_mla_reference import BYTES_PER_TOKEN, quantize_kv

    kc = quantize_kv(torch.randn(ps, 512), ps)
    return (torch.zeros(b, s, h, 512, dtype=torch.bfloat16), kc[:, : ps * BYTES_PER_TOKEN].view(1, ps, 1, 584),
            torch.zeros(b, s, topk, dtype=torch.int32))


@pytest.mark.parametrize("mutate, arg", [
    (lambda a: a.update(q=a["q"].float()), "q"),
    (lambda a: a.update(q=a["q"][..., :256]), "q"),
    (lambda a: a.update(q=torch.zeros(1, 1, 24, 512, dtype=torch.bfloat16)), "q"),
    (lambda a: a.update(q=torch.zeros(1, 1, 144, 512, dtype=torch.bfloat16)), "q"),
    (lambda a: a.update(k_cache=a["k_cache"].float()), "k_cache"),
    (lambda a: a.update(k_cache=torch.zeros(1, 64, 1, 576, dtype=torch.uint8)), "k_cache"),
    (lambda a: a.update(k_cache=torch.zeros(1, 32, 1, 584, dtype=torch.uint8)), "k_cache"),
    (lambda a: a.update(k_cache=torch.zeros(2, 37376, dtype=torch.uint8)), "k_cache"),
    (lambda a: a.update(indices=a["indices"].long()), "indices"),
    (lambda a: a.update(indices=torch.zeros(2, 1, 8, dtype=torch.int32)), "indices"),
    (lambda a: a.update(topk_length=torch.zeros(2, dtype=torch.int32)), "topk_length"),
    (lambda a: a.update(topk_length=torch.zeros(1, dtype=torch.int64)), "topk_length"),
    (lambda a: a.update(attn_sink=torch.zeros(8)), "attn_sink"),
    (lambda a: a.update(attn_sink=torch.zeros(16, dtype=torch.bfloat16)), "attn_sink"),
    (lambda a: a.update(softmax_scale=-1.0), "softmax_scale"),
    (lambda a: a.update(extra_indices=a["indices"]), "extra_indices"),
    (lambda a: a.update(extra_k_cache=a["k_cache"]), "extra_indices"),
    (lambda a: a.update(extra_k_cache=a["k_cache"], extra_indices=a["indices"][:, :, :4].long()), "extra_indices"),
])
def test_validation_errors_name_the_argument(mutate, arg):
    from pd.kernels.sparse_mla_decode import sparse_mla_decode

    q, kc, idx = _inputs()
    a = dict(q=q, k_cache=kc, indices=idx)
    mutate(a)
    with pytest.raises(ValueError, match=arg):
        sparse_mla_decode(**a)


def test_valid_cpu_tensors_outside_the_interpreter_are_refused_before_launch():
    from pd.kernels.sparse_mla_decode import sparse_mla_decode

    q, kc, idx = _inputs()
    with pytest.raises(ValueError, match="q is on cpu: the Triton kernel needs a CUDA device .*sparse_mla_reference"):
        sparse_mla_decode(q, kc, idx)


# ---------------------------------------------------------------- AOT compile (no GPU needed)

SIG = {"q_ptr": "*bf16", "kc8_ptr": "*u8", "kc16_ptr": "*i16", "idx_ptr": "*i32", "len_ptr": "*i32",
       "sink_ptr": "*fp32", "out_ptr": "*bf16", "lse_ptr": "*fp32", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32",
       "sm_scale_log2": "fp32", "page_stride": "i32", "S": "i32", "H": "i32", "TOPK": "i32", "chunk": "i32",
       "split_offset": "i32", "n_splits_total": "i32", "stride_qb": "i32", "stride_qs": "i32", "stride_qh": "i32",
       "grid_bucket": "i32"}


def _all_configs():
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    from pd.kernels.sparse_mla_decode import CONFIGS

    return [(bh, c) for bh, cfgs in CONFIGS.items() for c in cfgs]


# what the launcher's specialization sees at run time (16-byte aligned pointers, strides and page stride
# divisible by 16): the pipeliner's cp.async gathers, hence the real shared-memory use, depend on it
ALIGNED = ("q_ptr", "kc8_ptr", "kc16_ptr", "idx_ptr", "out_ptr", "part_o_ptr", "page_stride", "stride_qb",
           "stride_qs", "stride_qh", "TOPK")
SM90_SHARED_LIMIT = 232448  # bytes of shared memory per block on sm_90 (227 KiB)
SM90_SHARED_PER_SM = 233472  # bytes of shared memory per SM on sm_90 (228 KiB; each block also reserves 1 KiB)


def _compile(bh, cfg, cc, direct=False, chunked=False, pipeline=None, page_size=64):
    from pd.kernels.sparse_mla_decode import (
        _sparse_mla_fwd_chunked_kernel,
        _sparse_mla_fwd_kernel,
        _sparse_mla_fwd_pipelined_kernel,
    )

    const = dict(HAS_LEN=True, HAS_SINK=True, DIRECT=direct, PAGE_SIZE=page_size, BLOCK_H=bh, DOT_F32=False,
                 DOT_PREC="tf32", BLOCK_N=cfg.kwargs["BLOCK_N"])
    # split programs release the combine launch early (programmatic dependent launch), as the default path runs them
    const["PDL"] = not direct
    if pipeline:
        const["LOOP_STAGES"] = pipeline
        return compile_for(_sparse_mla_fwd_pipelined_kernel, SIG, const, cc, num_warps=cfg.num_warps,
                           num_stages=cfg.num_stages, aligned=ALIGNED)
    fn = _sparse_mla_fwd_chunked_kernel if chunked else _sparse_mla_fwd_kernel
    return compile_for(fn, SIG, const, cc, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _cfg(c):
    import triton

    return triton.Config({"BLOCK_N": c["BLOCK_N"]}, num_warps=c["num_warps"], num_stages=c["num_stages"])


@aot
@pytest.mark.parametrize("bh, cfg", _all_configs(), ids=lambda x: str(x).replace(" ", "").replace(",", "_")[:40])
def test_aot_sm120a_every_config(bh, cfg):
    assert_sm120_ok(_compile(bh, cfg, 120))


@aot
@pytest.mark.parametrize("bh", [16, 32, 64])
def test_aot_sm90a_and_combine(bh):
    from pd.kernels.sparse_mla_decode import CONFIGS, _combine_kernel

    for cfg in CONFIGS[bh]:
        k = _compile(bh, cfg, 90, direct=True)
        assert "mma" in k.asm["ptx"]
    if bh == 16:
        sig = {"part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "sink_ptr": "*fp32", "out_ptr": "*bf16",
               "lse_ptr": "*fp32", "S": "i32", "H": "i32", "n_splits": "i32"}
        for cc in (90, 120):
            for pdl in (False, True):  # plain launch, and programmatic dependent launch (the default on cc >= 9)
                k = compile_for(_combine_kernel, sig, dict(HAS_SINK=True, SPLITS_P2=8, ROUND=False, PDL=pdl), cc)
                assert ("griddepcontrol.wait" in k.asm["ptx"]) == pdl
                if cc == 120:
                    assert_sm120_ok(k, needs_mma=False)


@aot
@pytest.mark.parametrize("direct", [False, True])
def test_aot_sm90a_only_configs(direct):
    """sm_90-only configs: 64-head programs (chunked or pipelined) use wgmma on sm_90a, 16-head ones (64-token
    tiles) mma.sync; the pipelined ones gather with cp.async and fit sm_90's 227 KiB of shared memory. They are
    never selected on sm_120."""
    from pd.kernels.sparse_mla_decode import CONFIGS_SM90, DEFAULT_CONFIG_SM90

    assert DEFAULT_CONFIG_SM90[64] in CONFIGS_SM90[64] and DEFAULT_CONFIG_SM90[16] in CONFIGS_SM90[16]
    for bh, cfgs in CONFIGS_SM90.items():
        for c in cfgs:
            assert c.get("CHUNKED") or c.get("PIPELINE"), c
            k = _compile(bh, _cfg(c), 90, direct=direct, chunked=c.get("CHUNKED", False), pipeline=c.get("PIPELINE"))
            ptx = k.asm["ptx"]
            assert ("wgmma" in ptx) if bh == 64 else ("mma.sync" in ptx and "wgmma" not in ptx), (bh, c)
            if c.get("PIPELINE"):
                assert "cp.async" in ptx and k.metadata.shared <= SM90_SHARED_LIMIT, (c, k.metadata.shared)
                assert _sync_record_loads(k) == 0, c


def _sync_record_loads(kernel) -> int:
    """Plain (not cp.async) loads of cache bytes in the TTGIR: the pipelined kernel must have none (a regression
    to 7 per tile, one per nope chunk, made 16-head programs wait on HBM every tile; see _deq_scaled)."""
    return sum(1 for ln in kernel.asm["ttgir"].splitlines() if "tt.load " in ln and "!tt.ptr<i8>" in ln)


@aot
@pytest.mark.parametrize("i", range(2))
def test_aot_pipelined_configs_sm120a_and_sm90a(i):
    """Every pipelined config sm_120 may run: mma.sync, no wgmma, <= 99 KiB shared memory on sm_120a, every load
    of the tile (index list, records, scales, rope) pipelined as cp.async; also builds for sm_90a."""
    from pd.kernels.sparse_mla_decode import CONFIGS_PIPELINED

    cfgs = [(bh, c) for bh, cs in CONFIGS_PIPELINED.items() for c in cs]
    assert len(cfgs) == 2
    bh, c = cfgs[i]
    for cc in (120, 90):
        k = _compile(bh, _cfg(c), cc, direct=bool(i % 2), pipeline=c["PIPELINE"])
        assert "cp.async" in k.asm["ptx"] and _sync_record_loads(k) == 0, c
        assert ("griddepcontrol.launch_dependents" in k.asm["ptx"]) == (not i % 2), c
        if cc == 120:
            assert_sm120_ok(k)
        else:  # the programs per SM its default split count assumes fit the SM's shared memory
            need = c.get("PROGRAMS_PER_SM", 1) * (k.metadata.shared + 1024)
            assert need <= SM90_SHARED_PER_SM, (c, k.metadata.shared)


@aot
def test_aot_page2_sm120a():
    """The c128 layers' 2-token pages. PAGE_SIZE is a constexpr, so each page size is its own build; the
    enumerations above compile page 64 only (page 256, like page 2, differs in two integer constants). This
    compiles, for page 2 only, the two sm_120 programs a c128 layer's compressed cache runs by default: the 16-head
    pipelined two-per-SM config (H=16 at TP4, B >= 33) and the 32-head plain one (H=64): still cp.async-gathered,
    mma.sync, within sm_120's shared memory (4.7 s on a 2-core CI-like machine, instead of a second pass over
    every config)."""
    from pd.kernels.sparse_mla_decode import DEFAULT_CONFIG, TWO_PER_SM_CONFIG_16

    c = TWO_PER_SM_CONFIG_16
    k = _compile(16, _cfg(c), 120, pipeline=c["PIPELINE"], page_size=2)
    assert "cp.async" in k.asm["ptx"] and _sync_record_loads(k) == 0
    assert_sm120_ok(k)
    assert_sm120_ok(_compile(32, _cfg(DEFAULT_CONFIG[32]), 120, page_size=2))


def test_sm120_defaults_are_unchunked_and_sm90_only_picks_64():
    from pd.kernels.sparse_mla_decode import (
        DEFAULT_CONFIG,
        DEFAULT_CONFIG_SM90,
        TWO_PER_SM_CONFIG_16,
        _default_config,
        _pick_block_h,
    )

    assert not any(c.get("CHUNKED") for c in DEFAULT_CONFIG.values())
    assert _pick_block_h(16, 1, 64) == 32 and _pick_block_h(16, 1, 64, sm90=True) == 64
    assert _pick_block_h(1, 1, 64, sm90=True) == 16 and _pick_block_h(64, 1, 16, sm90=True) == 16
    # 16-head programs: the two-per-SM config once the grid has more than 32 rows, on both targets; below that
    # each target's own default (sm_90's 64-token tiles need more than sm_120's 99 KiB)
    for sm90 in (False, True):
        assert _default_config(16, 64, sm90) is TWO_PER_SM_CONFIG_16 is _default_config(16, 256, sm90)
    assert _default_config(16, 32, False) is DEFAULT_CONFIG[16]
    assert _default_config(16, 32, True) is DEFAULT_CONFIG_SM90[16]
    assert _default_config(64, 64, True)["PIPELINE"] and _default_config(64, 64, False) is DEFAULT_CONFIG[64]


def test_e4m3_bits_asm_is_exact_for_every_code_and_scale():
    """The pipelined kernel's inline-PTX dequantization (_E4M3_BITS_ASM, run by the PTX emulator): every e4m3 code
    but the NaNs, in each byte position of a word, times every UE8M0 scale byte, equals the exact product rounded
    once to bf16 (subnormal codes, bf16-subnormal results and scale bytes > 134 included)."""
    import numpy as np

    from pd.kernels.sparse_mla_decode import _E4M3_BITS_ASM
    from ptx_emu import run_ptx

    codes = np.array([c for c in range(256) if c not in (0x7F, 0xFF)], dtype=np.uint32)
    vals = np.stack([np.roll(codes, k) for k in range(4)], 1)  # each code in each byte position
    s = np.repeat(np.arange(256, dtype=np.uint32), len(codes))
    vals = np.tile(vals, (256, 1))
    word = vals[:, 0] | (vals[:, 1] << 8) | (vals[:, 2] << 16) | (vals[:, 3] << 24)
    f1 = (np.minimum(s, 134) + 120) << 7
    f2 = (np.maximum(s, 134) - 7) << 7
    o0, o1 = run_ptx(_E4M3_BITS_ASM.value, {2: word, 3: f1 | f1 << 16, 4: f1 | f1 << 16, 5: f2 | f2 << 16,
                                           6: f2 | f2 << 16}, 2)
    got = np.stack([o0 & 0xFFFF, o0 >> 16, o1 & 0xFFFF, o1 >> 16], 1).astype(np.uint16)
    exact = (torch.from_numpy(vals.astype(np.uint8)).view(torch.float8_e4m3fn).double()
             * torch.pow(2.0, torch.from_numpy(s.astype(np.int64) - 127).double())[:, None])
    want = exact.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(got, want), np.argwhere(got != want)[:5]


def test_default_configs_are_compile_tested_configs():
    """Every config the default path can launch is in a list the AOT tests compile."""
    from pd.kernels.sparse_mla_decode import (
        CONFIGS,
        CONFIGS_PIPELINED,
        CONFIGS_SM90,
        DEFAULT_CONFIG,
        DEFAULT_CONFIG_SM90,
        TWO_PER_SM_CONFIG_16,
    )

    defaults = [(bh, d) for bh, d in DEFAULT_CONFIG.items()] + [(bh, d) for bh, d in DEFAULT_CONFIG_SM90.items()]
    defaults.append((16, TWO_PER_SM_CONFIG_16))
    for bh, d in defaults:
        if d.get("PIPELINE"):
            assert d in CONFIGS_PIPELINED.get(bh, []) + CONFIGS_SM90.get(bh, []), (bh, d)
        elif d.get("CHUNKED"):
            assert d in CONFIGS_SM90.get(bh, []), (bh, d)
        else:
            assert any(c.kwargs["BLOCK_N"] == d["BLOCK_N"] and c.num_warps == d["num_warps"]
                       and c.num_stages == d["num_stages"] for c in CONFIGS[bh]), (bh, d)


# ---------------------------------------------------------------- c128-layout interpreter cases (subprocess)

def _c128_case(name, b, s, h, etopk, elens, splits, block_h, config, view2d, seed):
    """One c128-layer call in the interpreter vs the fp64 reference: main cache 256-token pages with a 128-token
    window (topk_length <= 128, -1 holes), compressed cache 2-token pages (64 pages; extra_topk_length per row,
    -1 past it and a few inside), sink. Returns the JSON row ``test_interpreter_matches_reference`` checks."""
    from pd.kernels.sparse_mla_decode import sparse_mla_decode
    from pd.kernels.sparse_mla_reference import BYTES_PER_TOKEN, quantize_kv, sparse_mla_decode_ref

    g = torch.Generator().manual_seed(seed)

    def cache(pages, ps):
        kc = quantize_kv(torch.randn(pages * ps, 512, generator=g) * 0.7, ps)
        return kc, kc[:, : ps * BYTES_PER_TOKEN].view(pages, ps, 1, BYTES_PER_TOKEN)

    kc, kc4 = cache(2, 256)
    ekc, ekc4 = cache(64, 2)
    q = torch.randn(b, s, h, 512, generator=g).to(torch.bfloat16)
    idx = torch.randint(0, 512, (b, s, 128), generator=g, dtype=torch.int32)
    idx[torch.rand(idx.shape, generator=g) < 0.1] = -1
    lens = torch.tensor([128] + [70] * (b - 1), dtype=torch.int32)
    eidx = torch.randint(0, 128, (b, s, etopk), generator=g, dtype=torch.int32)
    eidx[..., 5] = -1
    elen = torch.tensor(elens, dtype=torch.int32)
    eidx[(torch.arange(etopk).view(1, 1, -1) >= elen.view(b, 1, 1)).expand(b, s, etopk)] = -1  # SGLang: -1 pad
    sink = torch.randn(h, generator=g)
    kw = dict(topk_length=lens, attn_sink=sink, extra_indices=eidx, extra_topk_length=elen)
    out, lse = sparse_mla_decode(q, kc4, idx, extra_k_cache=ekc if view2d else ekc4, num_splits=splits,
                                 block_h=block_h, config=config, **kw)
    ro, rl = sparse_mla_decode_ref(q, kc, idx, extra_k_cache=ekc, page_size=256, extra_page_size=2, **kw)
    fin = torch.isfinite(rl)
    return dict(name=name, rel=((out.float() - ro).norm() / ro.norm()).item(),
                lse_err=(lse[fin] - rl[fin]).abs().max().item() if fin.any() else 0.0,
                same_inf=bool(torch.equal(torch.isinf(lse), torch.isinf(rl))), nan=bool(torch.isnan(out).any()),
                empty_rows_zero=bool((out.float()[torch.isinf(rl).transpose(1, 2)] == 0).all()))


if __name__ == "__main__":  # run by the interp_results fixture with TRITON_INTERPRET=1
    assert os.environ.get("TRITON_INTERPRET") == "1"
    for i, (case, kw) in enumerate(C128_CASES.items()):
        print(json.dumps(_c128_case(case, seed=100 + i, **kw)), flush=True)
