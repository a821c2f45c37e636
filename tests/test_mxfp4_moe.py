"""pd.kernels.mxfp4_moe on CPU: interpreter correctness vs the fp64 reference (subprocess, since
TRITON_INTERPRET must be set before triton decorates the kernels), the reference's layout, input validation, and
AOT compilation of every tile config for sm_120a (mma.sync, no wgmma, <= 101376 B shared) and sm_90a."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from triton_aot import aot, assert_sm120_ok, compile_for

HERE = os.path.dirname(os.path.abspath(__file__))
# The output is rounded to bf16 once (~1.6e-3 relative RMS); the interpreter runs land at 1.5e-3 to 2e-3.
REL_TOL = 4e-3


@pytest.fixture(scope="module")
def interp_results():
    env = dict(os.environ, TRITON_INTERPRET="1", TRITON_DEFAULT_FP_FUSION="1")
    p = subprocess.run([sys.executable, os.path.join(HERE, "mxfp4_moe_interp_cases.py")], env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    return {r["name"]: r for r in map(json.loads, filter(None, p.stdout.splitlines()))}


def _case_names():
    sys.path.insert(0, HERE)
    from mxfp4_moe_interp_cases import CASES

    return [name for name, _ in CASES]


@pytest.mark.parametrize("name", _case_names())
def test_interpreter_matches_reference(interp_results, name):
    r = interp_results[name]
    assert not r["nan"], r  # the output buffer was NaN-poisoned: every element written
    assert r["same_buffer"], r
    assert r["repeat_equal"], r  # a second call (fold: tickets reset by the first) gives the same bits
    assert r["rel"] <= REL_TOL, r
    if "clamp_effect" in r:  # the case's data exercise the SwiGLU clamp (so a missing clamp would fail)
        assert r["clamp_effect"] > 50 * REL_TOL, r
    if "workspace_zero" in r:
        assert r["workspace_zero"], r
    if "all_skipped_row_zero" in r:
        assert r["all_skipped_row_zero"], r


# ---------------------------------------------------------------------------------------------------- reference

def test_dequantize_layout_low_nibble_first_and_scale():
    from pd.kernels.mxfp4_moe_reference import dequantize_mxfp4

    packed = torch.zeros(1, 16, dtype=torch.uint8)
    packed[0, 0] = 0x2F  # low nibble 0xF = -6 (column 0), high nibble 0x2 = 1.0 (column 1)
    packed[0, 1] = 0x91  # column 2: 0x1 = 0.5, column 3: 0x9 = -0.5
    scale = torch.tensor([[129]], dtype=torch.uint8)  # 2 ** 2
    w = dequantize_mxfp4(packed, scale)
    assert w.shape == (1, 32)
    assert w[0, :4].tolist() == [-24.0, 4.0, 2.0, -2.0]
    assert (w[0, 4:] == 0).all()
    # float8_e8m0fnu scales are the same bytes
    if hasattr(torch, "float8_e8m0fnu"):
        assert torch.equal(dequantize_mxfp4(packed, scale.view(torch.float8_e8m0fnu)), w)


def test_quantize_roundtrip_is_exact_on_e2m1_grid():
    from pd.kernels.mxfp4_moe_reference import E2M1_VALUES, dequantize_mxfp4, quantize_mxfp4

    g = torch.Generator().manual_seed(0)
    grid = torch.tensor(E2M1_VALUES)
    vals = grid[torch.randint(0, 16, (8, 64), generator=g)]
    vals[:, 0::32] = 6.0  # group amax 6 -> scale 2**0, so the values are exactly representable
    w = vals * torch.exp2(torch.randint(-5, 5, (8, 2), generator=g).float()).repeat_interleave(32, dim=1)
    packed, scale = quantize_mxfp4(w)
    assert packed.shape == (8, 32) and scale.shape == (8, 2) and packed.dtype == scale.dtype == torch.uint8
    assert torch.equal(dequantize_mxfp4(packed, scale), w)
    # arbitrary values: within half an e2m1 step of the group's scale * 6 range
    x = torch.randn(4, 64, generator=g)
    err = (dequantize_mxfp4(*quantize_mxfp4(x)) - x).abs().max()
    assert err <= x.abs().max() / 6 * 1.0 + 1e-6


def test_reference_gate_up_order_and_clamp():
    """up_first swaps the halves; the clamp follows DSv4 (gate only from above, up both ways)."""
    from pd.kernels.mxfp4_moe_reference import fused_moe_mxfp4_reference, swiglu_clamped

    g = torch.tensor([20.0, -20.0, 3.0])
    u = torch.tensor([-30.0, 5.0, 30.0])
    got = swiglu_clamped(g, u, 10.0)
    want = torch.tensor([10.0, -20.0, 3.0]) * torch.sigmoid(torch.tensor([10.0, -20.0, 3.0])) \
        * torch.tensor([-10.0, 5.0, 10.0])
    assert torch.allclose(got, want)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 64, generator=gen).bfloat16()
    w13 = torch.randint(0, 256, (2, 64, 32), generator=gen, dtype=torch.uint8)
    s13 = torch.full((2, 64, 2), 124, dtype=torch.uint8)
    w2 = torch.randint(0, 256, (2, 64, 16), generator=gen, dtype=torch.uint8)
    s2 = torch.full((2, 64, 1), 124, dtype=torch.uint8)
    ids = torch.tensor([[0, 1], [1, -1]], dtype=torch.int32)
    wts = torch.rand(2, 2, generator=gen)
    a = fused_moe_mxfp4_reference(x, w13, s13, w2, s2, wts, ids)
    swapped = torch.cat([w13[:, 32:], w13[:, :32]], 1)
    b = fused_moe_mxfp4_reference(x, swapped, s13, w2, s2, wts, ids, up_first=True)
    assert torch.allclose(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dequantized_reference_is_bit_identical_to_the_packed_one(dtype):
    """Experts dequantized once (what the built-in draft keeps) give exactly the reference's output."""
    from pd.kernels.mxfp4_moe_reference import (
        dequantize_mxfp4,
        fused_moe_dequantized_reference,
        fused_moe_mxfp4_reference,
        quantize_mxfp4,
    )

    gen = torch.Generator().manual_seed(3)
    w13, s13 = quantize_mxfp4(torch.randn(4, 256, 64, generator=gen) * 0.2)
    w2, s2 = quantize_mxfp4(torch.randn(4, 64, 128, generator=gen) * 0.2)
    x = torch.randn(5, 64, generator=gen)
    ids = torch.tensor([[0, 2], [3, 1], [2, 2], [1, -1], [0, 3]], dtype=torch.int32)
    wts = torch.rand(5, 2, generator=gen)
    want = fused_moe_mxfp4_reference(x, w13, s13, w2, s2, wts, ids, swiglu_limit=10.0, routed_scaling_factor=1.5,
                                     dtype=dtype)
    got = fused_moe_dequantized_reference(x, dequantize_mxfp4(w13, s13, dtype), dequantize_mxfp4(w2, s2, dtype),
                                          wts, ids, swiglu_limit=10.0, routed_scaling_factor=1.5)
    assert got.dtype == dtype and torch.equal(got, want)


def test_as_ue8m0():
    from pd.kernels.mxfp4_moe import as_ue8m0

    u8 = torch.tensor([[0, 127, 254]], dtype=torch.uint8)
    assert as_ue8m0(u8).data_ptr() == u8.data_ptr()
    f = torch.tensor([[2.0 ** -127, 1.0, 2.0 ** 127]])
    assert torch.equal(as_ue8m0(f), u8)
    with pytest.raises(ValueError, match="power"):
        as_ue8m0(torch.tensor([3.0]))
    with pytest.raises(ValueError, match="scale"):
        as_ue8m0(torch.tensor([1], dtype=torch.int32))


def test_max_sorted_blocks_bounds_any_routing():
    from pd.kernels.mxfp4_moe import max_sorted_blocks

    g = torch.Generator().manual_seed(0)
    for p, e, bm in [(6, 256, 16), (768, 256, 16), (40, 3, 16), (1000, 8, 64), (5, 2, 32)]:
        for _ in range(20):
            ids = torch.randint(0, e, (p,), generator=g)
            need = sum(-(-int(c) // bm) for c in torch.bincount(ids, minlength=e) if c > 0)
            assert need <= max_sorted_blocks(p, e, bm)
    assert max_sorted_blocks(6, 256, 16) == 6


def test_default_configs_are_valid_and_cover_all_sizes():
    from pd.kernels.mxfp4_moe import (
        DEFAULT_CONFIGS,
        DEFAULT_CONFIGS_SM90_BITS,
        TILE_CONFIGS,
        MoETile,
        _check_config,
        default_config,
    )

    for _, cfg in DEFAULT_CONFIGS + DEFAULT_CONFIGS_SM90_BITS:
        _check_config(cfg, 4096, 2048)
        _check_config(cfg, 4096, 256)  # DSv4 at TP 8
        for part in ("gate_up", "down"):
            assert getattr(cfg, part) in TILE_CONFIGS, (part, getattr(cfg, part))
    for p in (1, 6, 96, 768, 10 ** 6):
        assert default_config(p).path in ("pair_token", "pair", "sorted")
        assert default_config(p, "sm90_bits").path == default_config(p).path
    assert default_config(96, "sm90_bits").gate_up == MoETile(BN=64, BK=256, num_warps=2, num_stages=3)
    assert default_config(96, "sm90_bits").BM == 8
    assert default_config(6, "sm90_bits").BM == 1 and default_config(6, "sm90_bits").fold
    t1 = default_config(6, "sm90_bits")  # 16 weight rows per warp, the down launch a PDL dependent
    assert t1.pdl and all(getattr(t1, p).BN == 16 * getattr(t1, p).num_warps for p in ("gate_up", "down"))
    assert default_config(48, "sm90_bits") == t1 and default_config(49, "sm90_bits").path == "sorted"


# ---------------------------------------------------------------------------------------------------- validation

def _inputs(t=2, h=128, inter=128, e=3, k=2):
    return dict(hidden_states=torch.zeros(t, h, dtype=torch.bfloat16),
                w13=torch.zeros(e, 2 * inter, h // 2, dtype=torch.uint8),
                w13_scale=torch.zeros(e, 2 * inter, h // 32, dtype=torch.uint8),
                w2=torch.zeros(e, h, inter // 2, dtype=torch.uint8),
                w2_scale=torch.zeros(e, h, inter // 32, dtype=torch.uint8),
                topk_weights=torch.zeros(t, k), topk_ids=torch.zeros(t, k, dtype=torch.int32))


@pytest.mark.parametrize("mutate, arg", [
    (lambda a: a.update(hidden_states=a["hidden_states"].float()), "hidden_states"),
    (lambda a: a.update(hidden_states=torch.zeros(2, 96, dtype=torch.bfloat16)), "hidden_states"),
    (lambda a: a.update(hidden_states=torch.zeros(128, 2, dtype=torch.bfloat16).t()), "hidden_states"),
    (lambda a: a.update(w13=a["w13"].float()), "w13"),
    (lambda a: a.update(w13=torch.zeros(3, 256, 32, dtype=torch.uint8)), "w13"),
    (lambda a: a.update(w13=torch.zeros(3, 200, 64, dtype=torch.uint8)), "w13"),
    (lambda a: a.update(w13=torch.zeros(3, 64, 256, dtype=torch.uint8).transpose(1, 2)), "w13"),
    (lambda a: a.update(w13_scale=a["w13_scale"].float()), "w13_scale"),
    (lambda a: a.update(w13_scale=torch.zeros(3, 256, 8, dtype=torch.uint8)), "w13_scale"),
    (lambda a: a.update(w2=torch.zeros(3, 128, 128, dtype=torch.uint8)), "w2"),
    (lambda a: a.update(w2=torch.zeros(2, 128, 64, dtype=torch.uint8)), "w2"),
    (lambda a: a.update(w2_scale=torch.zeros(3, 128, 2, dtype=torch.int8)), "w2_scale"),
    (lambda a: a.update(topk_ids=a["topk_ids"].float()), "topk_ids"),
    (lambda a: a.update(topk_ids=torch.zeros(3, 2, dtype=torch.int32)), "topk_ids"),
    (lambda a: a.update(topk_ids=torch.zeros(2, 4, dtype=torch.int32)[:, ::2]), "topk_ids"),
    (lambda a: a.update(topk_weights=torch.zeros(2, 3)), "topk_weights"),
    (lambda a: a.update(topk_weights=torch.zeros(2, 2, dtype=torch.float64)), "topk_weights"),
    (lambda a: a.update(swiglu_limit=-1.0), "swiglu_limit"),
    (lambda a: a.update(swiglu_limit=float("inf")), "swiglu_limit"),
    (lambda a: a.update(routed_scaling_factor=float("nan")), "routed_scaling_factor"),
    (lambda a: a.update(out=torch.zeros(2, 128)), "out"),
    (lambda a: a.update(out=torch.zeros(3, 128, dtype=torch.bfloat16)), "out"),
    (lambda a: a.update(config=dict(path="magic")), "config"),
    (lambda a: a.update(config=dict(path="pair", gate_up=dict(BN=48, BK=256, num_warps=2, num_stages=3),
                                    down=dict(BN=32, BK=256, num_warps=2, num_stages=3))), "config"),
    (lambda a: a.update(config=dict(path="pair", split_down=3, gate_up=dict(BN=32, BK=256, num_warps=2,
                                                                            num_stages=3),
                                    down=dict(BN=32, BK=256, num_warps=2, num_stages=3))), "config"),
    (lambda a: a.update(config=dict(path="pair_token", split_down=2, gate_up=dict(BN=32, BK=256, num_warps=2,
                                                                                  num_stages=3),
                                    down=dict(BN=32, BK=256, num_warps=2, num_stages=3))), "config"),
    (lambda a: a.update(config=dict(path="pair", gate_up=dict(BN=32, BK=128, BK_DOT=256, num_warps=2, num_stages=3),
                                    down=dict(BN=32, BK=256, num_warps=2, num_stages=3))), "BK_DOT"),
    (lambda a: a.update(config=dict(path="pair", gate_up=dict(BN=32, BK=256, num_warps=2, num_stages=3),
                                    down=dict(BN=32, BK=256, BK_DOT=96, num_warps=2, num_stages=3))), "BK_DOT"),
])
def test_validation_errors_name_the_argument(mutate, arg):
    from pd.kernels.mxfp4_moe import fused_moe_mxfp4

    a = _inputs()
    mutate(a)
    with pytest.raises(ValueError, match=arg):
        fused_moe_mxfp4(**a)


def test_valid_cpu_tensors_outside_the_interpreter_are_refused_before_launch():
    from pd.kernels.mxfp4_moe import fused_moe_mxfp4

    with pytest.raises(ValueError, match="hidden_states is on cpu: the Triton kernel needs a CUDA device .*reference"):
        fused_moe_mxfp4(**_inputs())


def test_empty_batch_returns_empty_output():
    from pd.kernels.mxfp4_moe import fused_moe_mxfp4

    a = _inputs(t=0)
    out = fused_moe_mxfp4(**a)
    assert out.shape == (0, 128) and out.dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------------- AOT compile

DIMS = dict(H=4096, I=2048, TOPK=6, ROUND=False)  # DeepSeek-V4-Flash
NO_FOLD = dict(PF=0, FOLD=False, PDL=False, XS=0)  # the options' defaults (an AOT build gets no launcher defaults)


def _aligned(sig, stride):  # what the launcher specializes for 16-byte-aligned tensors and a 4096 stride
    return tuple(n for n, ty in sig.items() if ty.startswith("*")) + (stride,)


def _gate_up(tile, cc, bm=16, sorted_=True, split=1, halves=False, deq=0, wl=0, fold=False, pdl=False, xs=0):
    """_gate_up_kernel built for ``cc`` with the MoETile ``tile`` and the given constexprs."""
    from pd.kernels.mxfp4_moe import GATE_UP_SIGNATURE, _gate_up_kernel

    const = dict(DIMS, SORTED=sorted_, HAS_LIMIT=True, UP_FIRST=False, SPLIT=split, HALVES=halves, BM=bm,
                 BN=tile.BN, BK=tile.BK, BKD=tile.bk_dot, DEQ=deq, WL=wl, **dict(NO_FOLD, FOLD=fold, PDL=pdl, XS=xs))
    return compile_for(_gate_up_kernel, GATE_UP_SIGNATURE, const, cc, tile.num_warps, tile.num_stages,
                       aligned=_aligned(GATE_UP_SIGNATURE, "stride_xt"), maxnreg=tile.maxnreg)


def _down(tile, cc, bm=16, mode=0, split=1, deq=0, wl=0, fold=False, pdl=False, xs=0):
    """_down_kernel built for ``cc`` with the MoETile ``tile`` and the given constexprs."""
    from pd.kernels.mxfp4_moe import DOWN_SIGNATURE, _down_kernel

    const = dict(DIMS, MODE=mode, SPLIT=split, BM=bm, BN=tile.BN, BK=tile.BK, BKD=tile.bk_dot, DEQ=deq, WL=wl,
                 **dict(NO_FOLD, FOLD=fold, PDL=pdl, XS=xs))
    return compile_for(_down_kernel, DOWN_SIGNATURE, const, cc, tile.num_warps, tile.num_stages,
                       aligned=_aligned(DOWN_SIGNATURE, "stride_ot"), maxnreg=tile.maxnreg)


def _tile(**kw):
    from pd.kernels.mxfp4_moe import MoETile

    return MoETile(**kw)


def _tile_configs():
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    from pd.kernels.mxfp4_moe import TILE_CONFIGS

    return TILE_CONFIGS


def _tile_id(c):
    return f"n{c.BN}k{c.BK}w{c.num_warps}s{c.num_stages}"


@aot
@pytest.mark.parametrize("cfg", _tile_configs(), ids=_tile_id)
def test_aot_sm120a_every_tile_config(cfg):
    """Both GEMM kernels, 16-row blocks (draft) and 64-row blocks (the sorted path's largest), for sm_120a."""
    assert_sm120_ok(_gate_up(cfg, 120))
    assert_sm120_ok(_gate_up(cfg, 120, halves=True))
    assert_sm120_ok(_down(cfg, 120))
    big = dataclasses.replace(cfg, BK=128, BK_DOT=min(cfg.bk_dot, 128))  # what _plan runs with BM > 16
    assert_sm120_ok(_gate_up(big, 120, bm=64))
    assert_sm120_ok(_down(big, 120, bm=64))


@aot
def test_aot_sm120a_every_mode_and_split():
    from pd.kernels.mxfp4_moe import DEFAULT_CONFIGS

    cfg = DEFAULT_CONFIGS[0][1].gate_up
    assert_sm120_ok(_gate_up(cfg, 120, sorted_=False, split=4))
    assert_sm120_ok(_down(cfg, 120, mode=1, split=4))
    assert_sm120_ok(_down(cfg, 120, mode=2))


@aot
def test_aot_small_kernels_sm120a():
    from pd.kernels.mxfp4_moe import _align_kernel, _swiglu_kernel, _topk_sum_kernel

    k = compile_for(_align_kernel, {"ids_ptr": "*i32", "sorted_ptr": "*i32", "blk_exp_ptr": "*i32",
                                    "nblk_ptr": "*i32", "cursor_ptr": "*i32", "P": "i32", "max_rows": "i32",
                                    "E": "i32"}, dict(E_BINS=512, BM=16, CHUNK=1024), 120)
    assert_sm120_ok(k, needs_mma=False)
    k = compile_for(_swiglu_kernel, {"part_ptr": "*fp32", "ids_ptr": "*i32", "h_ptr": "*bf16", "limit": "fp32",
                                     "P": "i32", "E": "i32"},
                    dict(I=2048, SPLIT=4, HAS_LIMIT=True, ROUND=False, BLOCK=1024), 120)
    assert_sm120_ok(k, needs_mma=False)
    k = compile_for(_topk_sum_kernel, {"y_ptr": "*fp32", "ids_ptr": "*i32", "out_ptr": "*bf16",
                                       "stride_ot": "i32", "P": "i32", "E": "i32"},
                    dict(H=4096, TOPK=6, SPLIT=4, ROUND=False, BLOCK=1024), 120)
    assert_sm120_ok(k, needs_mma=False)


@aot
def test_aot_sm90a_default_configs():
    """The configs the H200 benchmark runs by default compile for sm_90a (tensor-core ops present), with either
    dequantization."""
    from pd.kernels.mxfp4_moe import DEFAULT_CONFIGS

    for _, c in DEFAULT_CONFIGS:
        bm = c.BM
        halves, split_gu = c.gate_up_halves, c.split_gate_up
        mode = {"sorted": 0, "pair": 1, "pair_token": 2}[c.path]
        for deq in (0, 1):
            assert "mma" in _gate_up(c.gate_up, 90, bm=bm, sorted_=mode == 0, halves=halves, split=split_gu,
                                     deq=deq).asm["ptx"]
            assert "mma" in _down(c.down, 90, bm=bm, mode=mode, split=c.split_down, deq=deq).asm["ptx"]


@aot
@pytest.mark.parametrize("cfg", _tile_configs(), ids=_tile_id)
def test_aot_sm90a_bits_every_tile_config(cfg):
    """The bits dequantization (the H200 path) for every tile config: the inline PTX is in, tensor-core ops, and
    16-row blocks stay on mma.sync (wgmma would need the converted weights in shared memory)."""
    for k in (_gate_up(cfg, 90, deq=1), _gate_up(cfg, 90, halves=True, deq=1), _down(cfg, 90, deq=1)):
        ptx = k.asm["ptx"]
        assert "mul.rn.bf16x2" in ptx and "min.u16x2" in ptx and "mma.sync" in ptx and "wgmma" not in ptx
        assert k.metadata.shared <= 232448
    big = dataclasses.replace(cfg, BK=128, BK_DOT=min(cfg.bk_dot, 128))
    for k in (_gate_up(big, 90, bm=64, deq=1), _down(big, 90, bm=64, deq=1)):
        assert "mma" in k.asm["ptx"] and k.metadata.shared <= 232448


def _main_loop_sass_per_weight(kernel, weights_per_step: int, num_warps: int) -> float:
    """SASS instructions of the kernel's K loop (its longest loop) per weight per thread."""
    from sass_stats import longest_loop

    n, _ = longest_loop(kernel.asm["cubin"])
    assert n > 0, "no loop found"
    return n / (weights_per_step / (32 * num_warps))


@aot
def test_sm90a_bits_path_issues_fewer_instructions_than_dot_scaled():
    """The K loop of both GEMM kernels (the T >= 16 default tiles) on the bits path stays within 5.0 SASS
    instructions per weight and within 1.05x what tl.dot_scaled's emulation needs. With triton 3.9 the bits path
    needed 3.2-3.6 against 5.0 (0.7x); with triton 3.8.0, the locks' and SGLang 0.5.23's (torch 2.14.1 pins it), both
    land at 4.75-4.9: the sm_90 bits path has lost its edge there (benchmarks/kernels/mxfp4_moe_sass.py measures it).
    """
    from pd.kernels.mxfp4_moe import DEFAULT_CONFIGS

    c = DEFAULT_CONFIGS[1][1]
    gu, dn = c.gate_up, c.down
    halves = c.gate_up_halves
    gu_w = (1 if halves else 2) * gu.BN * gu.BK
    per_w = {deq: (_main_loop_sass_per_weight(_gate_up(gu, 90, halves=halves, deq=deq), gu_w, gu.num_warps),
                   _main_loop_sass_per_weight(_down(dn, 90, deq=deq), dn.BN * dn.BK, dn.num_warps))
             for deq in (0, 1)}
    for j in range(2):
        assert per_w[1][j] <= 5.0, per_w
        assert per_w[1][j] <= 1.05 * per_w[0][j], per_w


# ---------------------------------------------------------------------------------------------------- bits dequant

def _asm(name):
    import pd.kernels.mxfp4_moe as mx

    v = getattr(mx, name)
    return getattr(v, "value", v)  # a tl.constexpr


def _bf16_of(bits):
    import numpy as np

    return torch.from_numpy((bits & 0xFFFF).astype(np.int32)).to(torch.int16).view(torch.bfloat16).double()


def test_ue8m0_factor_asm_is_two_to_the_s_minus_1_and_inf_past_128():
    """The PTX that turns 4 scale bytes into bf16 factors 2**(s - 1), run by tests/ptx_emu.py on every byte in every
    lane position; bytes > 128 (2**(s - 1) not a normal bf16) give +inf."""
    import numpy as np

    from ptx_emu import run_ptx

    s = np.arange(256, dtype=np.uint32)
    lanes = [s, (s + 77) % 256, (s + 151) % 256, (s + 203) % 256]  # every byte value in every position
    word = lanes[0] | (lanes[1] << 8) | (lanes[2] << 16) | (lanes[3] << 24)
    f01, f23 = run_ptx(_asm("_UE8M0_FACTOR_ASM"), {2: word}, 2)
    for reg, (lo, hi) in ((f01, (0, 1)), (f23, (2, 3))):
        for half, lane in ((reg, lo), (reg >> 16, hi)):
            got = _bf16_of(half)
            sb = torch.from_numpy(lanes[lane].astype(np.int64))
            ok = sb <= 128
            assert torch.equal(got[ok], torch.exp2(sb[ok].double() - 1))
            assert torch.isinf(got[~ok]).all() and (got[~ok] > 0).all()


@pytest.mark.parametrize("scales", [(0, 1), (1, 127), (113, 121), (124, 128)])
def test_e2m1_bits_asm_matches_the_reference_dequantization(scales):
    """The PTX that turns 4 packed bytes into even / odd bf16 pairs (times their factors), run by tests/ptx_emu.py
    on all 65536 (b0, b1) pairs in both byte halves of the word, against dequantize_mxfp4: exact, subnormal
    results (scale bytes 0, 1) included; the sign of -0 kept."""
    import numpy as np

    from pd.kernels.mxfp4_moe_reference import dequantize_mxfp4
    from ptx_emu import run_ptx

    b = np.arange(65536, dtype=np.uint32)
    byte = [b & 0xFF, b >> 8, b >> 8, b & 0xFF]
    word = byte[0] | (byte[1] << 8) | (byte[2] << 16) | (byte[3] << 24)
    fac = [(s + 126) << 7 for s in scales]  # 2 ** (s - 1) as bf16 bits (what the factor asm makes)
    f01 = np.full_like(word, fac[0] | (fac[0] << 16))
    f23 = np.full_like(word, fac[1] | (fac[1] << 16))
    e01, e23, o01, o23 = run_ptx(_asm("_E2M1_BITS_ASM"), {4: word, 5: f01, 6: f23}, 4)
    for j in range(4):
        sc = scales[j // 2]
        packed = torch.from_numpy(byte[j].astype(np.uint8)).view(-1, 1).repeat(1, 16)
        want = dequantize_mxfp4(packed, torch.full((packed.shape[0], 1), sc, dtype=torch.uint8), torch.float64)
        even_reg, odd_reg = (e01, o01) if j < 2 else (e23, o23)
        shift = 16 * (j % 2)
        for reg, col in ((even_reg, 0), (odd_reg, 1)):
            got = _bf16_of(reg >> shift)
            assert torch.equal(got, want[:, col]), (j, col, sc)
            assert torch.equal(torch.signbit(got), torch.signbit(want[:, col]))


def test_e2m1_bits_asm_with_a_scale_past_128_is_never_finite():
    import numpy as np

    from ptx_emu import run_ptx

    b = np.arange(256, dtype=np.uint32)
    word = b | (b << 8) | (b << 16) | (b << 24)
    inf = np.full_like(word, 0x7F807F80)  # the factor asm's answer for s > 128
    for reg in run_ptx(_asm("_E2M1_BITS_ASM"), {4: word, 5: inf, 6: inf}, 4):
        assert not torch.isfinite(_bf16_of(reg)).any() and not torch.isfinite(_bf16_of(reg >> 16)).any()


def test_ptx_emulator_refuses_unknown_instructions():
    import numpy as np

    from ptx_emu import run_ptx

    with pytest.raises(ValueError, match="not emulated"):
        run_ptx("cvt.rn.bf16x2.f32 $0, $1, $2;", {1: np.zeros(1), 2: np.zeros(1)}, 1)


def test_mxfp4_max_scale_byte():
    from pd.kernels.mxfp4_moe import mxfp4_max_scale_byte

    a = torch.tensor([[3, 120]], dtype=torch.uint8)
    b = torch.tensor([129, 7], dtype=torch.uint8)
    assert mxfp4_max_scale_byte(a) == 120 and mxfp4_max_scale_byte(a, b) == 129
    if hasattr(torch, "float8_e8m0fnu"):
        assert mxfp4_max_scale_byte(a.view(torch.float8_e8m0fnu)) == 120
    with pytest.raises(ValueError, match="scales"):
        mxfp4_max_scale_byte(torch.ones(2))
    with pytest.raises(ValueError, match="scales"):
        mxfp4_max_scale_byte()


def test_dequant_choice(monkeypatch):
    """auto: bits only on sm_90 with max_scale_byte <= 128; dot_scaled otherwise (sm_120 has the e2m1 cvt);
    bits requested without a fitting max_scale_byte is an error."""
    import pd.kernels.mxfp4_moe as mx
    import pd.kernels.mxfp4_moe.launch as launch  # the module whose _INTERPRET _dequant_mode reads

    monkeypatch.setattr(launch, "_INTERPRET", False)
    cc = {"cap": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: cc["cap"])
    cuda = torch.device("cuda")
    assert mx._dequant_mode("auto", 128, cuda) == mx.DEQ_BITS_ASM
    assert mx._dequant_mode("auto", 129, cuda) == mx.DEQ_DOT_SCALED
    assert mx._dequant_mode("auto", None, cuda) == mx.DEQ_DOT_SCALED
    assert mx._dequant_mode("dot_scaled", 120, cuda) == mx.DEQ_DOT_SCALED
    cc["cap"] = (12, 0)
    assert mx._dequant_mode("auto", 120, cuda) == mx.DEQ_DOT_SCALED
    assert mx._dequant_mode("bits", 120, cuda) == mx.DEQ_BITS_ASM
    for bad in (None, 129):
        with pytest.raises(ValueError, match="max_scale_byte"):
            mx._dequant_mode("bits", bad, cuda)
    monkeypatch.setattr(launch, "_INTERPRET", True)
    assert mx._dequant_mode("bits", 120, torch.device("cpu")) == mx.DEQ_BITS_TL


@pytest.mark.parametrize("kw, arg", [
    (dict(max_scale_byte=255), "max_scale_byte"),
    (dict(max_scale_byte=-1), "max_scale_byte"),
    (dict(max_scale_byte=True), "max_scale_byte"),
    (dict(max_scale_byte=120.0), "max_scale_byte"),
    (dict(config=dict(path="pair", dequant="magic", gate_up=dict(BN=32, BK=256, num_warps=2, num_stages=3),
                      down=dict(BN=32, BK=256, num_warps=2, num_stages=3))), "dequant"),
    (dict(config=dict(path="pair", dequant="bits", gate_up=dict(BN=32, BK=256, num_warps=2, num_stages=3),
                      down=dict(BN=32, BK=256, num_warps=2, num_stages=3)), max_scale_byte=130), "max_scale_byte"),
])
def test_bits_options_are_validated(kw, arg):
    from pd.kernels.mxfp4_moe import fused_moe_mxfp4

    with pytest.raises(ValueError, match=arg):
        fused_moe_mxfp4(**_inputs(), **kw)


# ------------------------------------------------------------------------------- prepared sm_90 layout (sm90_bits)

def _prep_codes(el):
    """The four 4-bit codes of prepared 16-bit elements (prepare_mxfp4_weights_sm90's docstring layout)."""
    bit = lambda k: (el >> k) & 1  # noqa: E731
    return [bit(6) | bit(7) << 1 | bit(8) << 2 | bit(15) << 3, bit(3) | bit(4) << 1 | bit(5) << 2 | bit(12) << 3,
            bit(0) | bit(1) << 1 | bit(2) << 2 | bit(9) << 3, bit(13) | bit(14) << 1 | bit(10) << 2 | bit(11) << 3]


@pytest.mark.parametrize("scale", [0, 1, 113, 127, 128])
def test_e2m1_prep_asm_matches_the_reference_dequantization(scale):
    """The PTX that turns two prepared 16-bit elements into four bf16 pairs (value c of each element, times the
    factor), run by tests/ptx_emu.py on all 65536 elements in both lanes, against dequantize_mxfp4 of the codes the
    documented layout puts there: exact, subnormal results (scale bytes 0, 1) and the sign of -0 included."""
    import numpy as np

    from pd.kernels.mxfp4_moe_reference import dequantize_mxfp4
    from ptx_emu import run_ptx

    e = np.arange(65536, dtype=np.uint32)
    lanes = [e, (e * 40503 + 17) & 0xFFFF]  # every element in both lanes, paired with varied neighbours
    fac = (scale + 126) << 7
    outs = run_ptx(_asm("_E2M1_PREP_ASM"), {4: lanes[0] | (lanes[1] << 16), 5: np.full_like(e, fac | fac << 16)}, 4)
    for lane in range(2):
        codes = _prep_codes(lanes[lane].astype(np.int64))
        for c in range(4):
            packed = torch.from_numpy(codes[c].astype(np.uint8)).view(-1, 1).repeat(1, 16)  # low nibble = code
            want = dequantize_mxfp4(packed, torch.full((packed.shape[0], 1), scale, dtype=torch.uint8),
                                    torch.float64)[:, 0]
            got = _bf16_of(outs[c] >> (16 * lane))
            assert torch.equal(got, want), (lane, c)
            assert torch.equal(torch.signbit(got), torch.signbit(want)), (lane, c)


def test_e2m1_prep_asm_with_a_scale_past_128_is_never_finite():
    import numpy as np

    from ptx_emu import run_ptx

    e = np.arange(65536, dtype=np.uint32)
    for reg in run_ptx(_asm("_E2M1_PREP_ASM"), {4: e | (e << 16), 5: np.full_like(e, 0x7F807F80)}, 4):
        assert not torch.isfinite(_bf16_of(reg)).any() and not torch.isfinite(_bf16_of(reg >> 16)).any()


def test_prepare_mxfp4_weights_sm90_layout():
    """Element 8 g + i of a prepared row holds K = 32 g + 8 c + i as value c (bits as documented), for both
    tensors; the inputs are untouched unless inplace; chunking does not change the result; bad input is refused."""
    from pd.kernels.mxfp4_moe import prepare_mxfp4_weights_sm90

    g = torch.Generator().manual_seed(3)
    w13 = torch.randint(0, 256, (3, 6, 64), generator=g, dtype=torch.uint8)
    w2 = torch.randint(0, 256, (3, 4, 32), generator=g, dtype=torch.uint8).view(torch.int8)
    keep13, keep2 = w13.clone(), w2.clone()
    p13, p2 = prepare_mxfp4_weights_sm90(w13, w2, chunk_bytes=1)
    assert torch.equal(w13, keep13) and torch.equal(w2, keep2)
    assert p13.dtype == torch.uint8 and p2.dtype == torch.int8 and p13.shape == w13.shape and p2.shape == w2.shape
    for src, prep in ((w13, p13), (w2, p2)):
        b = src.view(torch.uint8).reshape(-1, src.shape[-1]).long()
        vals = torch.stack((b & 15, b >> 4), -1).reshape(b.shape[0], -1)  # K values in order
        pb = prep.view(torch.uint8).reshape(b.shape[0], -1, 2).long()
        codes = _prep_codes(pb[..., 0] | (pb[..., 1] << 8))
        m = torch.arange(src.shape[-1] // 2)
        for c in range(4):
            assert torch.equal(codes[c], vals[:, (m // 8) * 32 + 8 * c + m % 8])
    q13, q2 = prepare_mxfp4_weights_sm90(w13.clone(), w2.clone())
    assert torch.equal(q13, p13) and torch.equal(q2, p2)
    i13, i2 = keep13.clone(), keep2.clone()
    r13, r2 = prepare_mxfp4_weights_sm90(i13, i2, inplace=True, chunk_bytes=200)
    assert r13 is i13 and r2 is i2 and torch.equal(i13, p13) and torch.equal(i2, p2)
    with pytest.raises(ValueError, match="w13"):
        prepare_mxfp4_weights_sm90(w13.float(), w2)
    with pytest.raises(ValueError, match="w2"):
        prepare_mxfp4_weights_sm90(w13, w2[:, :, :24])
    with pytest.raises(ValueError, match="w2"):
        prepare_mxfp4_weights_sm90(w13, w2.transpose(1, 2))


@pytest.mark.parametrize("kw, arg", [
    (dict(weight_layout="marlin", max_scale_byte=120), "weight_layout"),
    (dict(weight_layout="sm90_bits"), "max_scale_byte"),
    (dict(weight_layout="sm90_bits", max_scale_byte=130), "max_scale_byte"),
    (dict(weight_layout="sm90_bits", max_scale_byte=120,
          config=dict(path="pair", dequant="dot_scaled", gate_up=dict(BN=32, BK=256, num_warps=2, num_stages=3),
                      down=dict(BN=32, BK=256, num_warps=2, num_stages=3))), "dot_scaled"),
])
def test_weight_layout_options_are_validated(kw, arg):
    from pd.kernels.mxfp4_moe import fused_moe_mxfp4

    with pytest.raises(ValueError, match=arg):
        fused_moe_mxfp4(**_inputs(), **kw)


@aot
def test_aot_sm90a_prepared_layout_default_configs_cut_the_loop():
    """The prepared layout (WL 1) compiles for every plan of its default table on sm_90a (the new PTX; mma.sync
    for 16-row blocks, where the converted weights stay in registers) and
    sm_120a, and on the same tiles its K loop issues at most 0.92x the SASS instructions of the SGLang layout's
    bits path per weight (triton 3.9, the SGLang-layout T >= 16 tiles: gate/up 775 vs 884, down 771 vs 888; the
    integer-pipe work about halves)."""
    from pd.kernels.mxfp4_moe import DEFAULT_CONFIGS, DEFAULT_CONFIGS_SM90_BITS

    for _, c in DEFAULT_CONFIGS_SM90_BITS:
        bm = c.BM
        halves, split_gu = c.gate_up_halves, c.split_gate_up
        mode = {"sorted": 0, "pair": 1, "pair_token": 2}[c.path]
        fold, pdl, xs = c.fold, c.pdl, c.stage_loads
        for k in (_gate_up(c.gate_up, 90, bm=bm, sorted_=mode == 0, halves=halves, split=split_gu, deq=1, wl=1,
                           fold=fold, pdl=pdl, xs=xs),
                  _down(c.down, 90, bm=bm, mode=mode, split=c.split_down, deq=1, wl=1, fold=fold, pdl=pdl,
                        xs=xs)):
            ptx = k.asm["ptx"]
            assert "mma" in ptx and "mad.lo.u32" in ptx and "mul.rn.bf16x2" in ptx
            assert k.metadata.shared <= 232448 and ("atom." in ptx) == fold  # sm_90's 227 KiB; the fold's tickets
            assert ("griddepcontrol" in ptx) == pdl  # the T <= 8 plan's release (gate/up) and wait (down)
            assert bm > 16 or ("mma.sync" in ptx and "wgmma" not in ptx)  # 64-row blocks may take wgmma
    t1 = DEFAULT_CONFIGS_SM90_BITS[0][1]  # the prepared T <= 8 plan builds for sm_120a too (mma.sync, <= 99 KiB)
    assert_sm120_ok(_gate_up(t1.gate_up, 120, bm=1, sorted_=False, halves=True, split=t1.split_gate_up, deq=1,
                             wl=1, fold=True, pdl=t1.pdl, xs=t1.stage_loads))
    assert_sm120_ok(_down(t1.down, 120, bm=1, mode=1, split=t1.split_down, deq=1, wl=1, fold=True, pdl=t1.pdl,
                          xs=t1.stage_loads))
    c = DEFAULT_CONFIGS[1][1]
    gu, dn = c.gate_up, c.down
    assert_sm120_ok(_gate_up(gu, 120, halves=True, deq=1, wl=1))
    assert_sm120_ok(_down(dn, 120, deq=1, wl=1))
    per_w = {wl: (_main_loop_sass_per_weight(_gate_up(gu, 90, halves=True, deq=1, wl=wl), gu.BN * gu.BK,
                                             gu.num_warps),
                  _main_loop_sass_per_weight(_down(dn, 90, deq=1, wl=wl), dn.BN * dn.BK, dn.num_warps))
             for wl in (0, 1)}
    for j in range(2):
        assert per_w[1][j] <= 0.92 * per_w[0][j], per_w


# ---------------------------------------------------------------------------- tiled prepared layout (sm90_tiled)

def _tiled_index(rows, row_len, tile_len):
    """Flat index, in tile_len-element units of a tiled tensor, of element m of row r: [rows, row_len]."""
    r, m = torch.arange(rows)[:, None], torch.arange(row_len)[None, :]
    return ((r // 32) * (row_len // tile_len) + m // tile_len) * (32 * tile_len) + (r % 32) * tile_len + m % tile_len


def test_prepare_tiled_and_tile_scales_layout():
    """tiled=True stores the sm90_bits 16-bit elements of each 32-row band as K / 256 consecutive [32 x 64 element]
    tiles and tile_mxfp4_scales the scale bytes as [32 x 8] tiles, at the documented offsets (dtypes kept);
    inplace and chunking give the same bytes; shapes that are not whole tiles are refused naming the tensor."""
    from pd.kernels.mxfp4_moe import prepare_mxfp4_weights_sm90, tile_mxfp4_scales

    g = torch.Generator().manual_seed(5)
    w13 = torch.randint(0, 256, (2, 64, 256), generator=g, dtype=torch.uint8)  # K 512: 2 tiles per row
    w2 = torch.randint(0, 256, (2, 32, 384), generator=g, dtype=torch.uint8).view(torch.int8)  # K 768: 3 tiles
    p13, p2 = prepare_mxfp4_weights_sm90(w13, w2)
    t13, t2 = prepare_mxfp4_weights_sm90(w13, w2, tiled=True, chunk_bytes=1)
    assert t13.dtype == torch.uint8 and t2.dtype == torch.int8 and t2.shape == w2.shape
    for prep, til in ((p13, t13), (p2, t2)):
        e, rows, n_bytes = prep.shape
        idx = _tiled_index(rows, n_bytes // 2, 64).reshape(-1)
        el = til.view(torch.uint8).reshape(e, -1, 2)[:, idx]  # 16-bit elements as byte pairs
        assert torch.equal(el.reshape(prep.shape), prep.view(torch.uint8))
    i13, i2 = w13.clone(), w2.clone()
    r13, r2 = prepare_mxfp4_weights_sm90(i13, i2, inplace=True, tiled=True, chunk_bytes=20000)
    assert r13 is i13 and r2 is i2 and torch.equal(i13, t13) and torch.equal(i2, t2)
    e8m0 = getattr(torch, "float8_e8m0fnu", torch.uint8)
    s13 = torch.randint(0, 256, (2, 64, 16), generator=g, dtype=torch.uint8)
    s2 = torch.randint(0, 256, (2, 32, 24), generator=g, dtype=torch.uint8).view(e8m0)
    q13, q2 = tile_mxfp4_scales(s13, s2)
    assert q2.dtype == e8m0 and q2.shape == s2.shape
    for sc, q in ((s13, q13), (s2, q2)):
        idx = _tiled_index(sc.shape[1], sc.shape[2], 8).reshape(-1)
        assert torch.equal(q.view(torch.uint8).reshape(sc.shape[0], -1)[:, idx].reshape(sc.shape), sc.view(torch.uint8))
    with pytest.raises(ValueError, match="w13"):
        prepare_mxfp4_weights_sm90(w13[:, :48].contiguous(), w2, tiled=True)  # 48 rows
    with pytest.raises(ValueError, match="w2"):
        prepare_mxfp4_weights_sm90(w13, w2[:, :, :64].contiguous(), tiled=True)  # K 128
    with pytest.raises(ValueError, match="w13_scale"):
        tile_mxfp4_scales(s13[:, :, :4].contiguous(), s2)
    with pytest.raises(ValueError, match="w2_scale"):
        tile_mxfp4_scales(s13, s2.view(torch.uint8).float())


def test_tiled_layout_plans_and_validation():
    """sm90_tiled takes the sm90_bits plans except gate/up unsplit at T <= 8 (faster on the H200); it refuses H or I
    that are not whole tiles and the prefetch options; an earlier name of the layout is unknown now."""
    from pd.kernels.mxfp4_moe import default_config, fused_moe_mxfp4

    for p in (1, 6, 48):
        assert default_config(p, "sm90_tiled") == dataclasses.replace(default_config(p, "sm90_bits"), split_gate_up=1)
    for p in (49, 96, 768, 10 ** 6):
        assert default_config(p, "sm90_tiled") == default_config(p, "sm90_bits")
    with pytest.raises(ValueError, match="multiples of 256"):  # H = I = 128: no whole tile
        fused_moe_mxfp4(**_inputs(), weight_layout="sm90_tiled", max_scale_byte=120)
    cfg = dict(_PAIR, fold=True, prefetch_down=2)
    with pytest.raises(ValueError, match="prefetch"):
        fused_moe_mxfp4(**_inputs(h=256, inter=256), weight_layout="sm90_tiled", max_scale_byte=120, config=cfg)
    with pytest.raises(ValueError, match="weight_layout must be one of"):
        fused_moe_mxfp4(**_inputs(h=256, inter=256), weight_layout="sm90_tiled_scales", max_scale_byte=120)


@aot
def test_aot_tiled_layout_keeps_the_k_loop_copies():
    """The tiled layout's default T <= 8 plan and sorted T >= 16 plan (WL 2: weights and scales tiled) build for
    sm_90a with the K loop of sm90_bits's plans: the same cp.async copies (16-byte weight copies included: the tile
    addressing keeps the alignment Triton vectorizes on) and at most 5% more SASS (tile offsets; triton 3.9: 384-393
    vs 377-379 at T <= 8); the T <= 8 plan also for sm_120a."""
    from pd.kernels.mxfp4_moe import DEFAULT_CONFIGS_SM90_BITS, DEFAULT_CONFIGS_SM90_TILED
    from sass_stats import longest_loop

    bits_loops = {}
    for wl, table in ((1, DEFAULT_CONFIGS_SM90_BITS), (2, DEFAULT_CONFIGS_SM90_TILED)):
        for n_plan, (_, c) in enumerate(table[:2]):
            mode = {"sorted": 0, "pair": 1}[c.path]
            kw = dict(fold=c.fold, pdl=c.pdl, xs=c.stage_loads, deq=1, bm=c.BM, wl=wl)
            gu = _gate_up(c.gate_up, 90, sorted_=mode == 0, halves=c.gate_up_halves, split=c.split_gate_up, **kw)
            dn = _down(c.down, 90, mode=mode, split=c.split_down, **kw)
            assert all("mma.sync" in k.asm["ptx"] for k in (gu, dn))
            loops = [longest_loop(k.asm["cubin"]) for k in (gu, dn)]
            if wl == 1:
                bits_loops[n_plan] = loops
                continue
            for (n, ops), (n1, ops1) in zip(loops, bits_loops[n_plan]):
                copies = {o: v for o, v in ops.items() if o.startswith("LDGSTS")}
                assert copies == {o: v for o, v in ops1.items() if o.startswith("LDGSTS")}, (n_plan, copies)
                assert any(o.endswith(".128") for o in copies) and n <= 1.05 * n1, (n_plan, n, n1)
    t1 = DEFAULT_CONFIGS_SM90_TILED[0][1]
    kw = dict(bm=1, fold=True, pdl=t1.pdl, xs=t1.stage_loads, deq=1, wl=2)
    assert_sm120_ok(_gate_up(t1.gate_up, 120, sorted_=False, halves=True, split=t1.split_gate_up, **kw))
    assert_sm120_ok(_down(t1.down, 120, mode=1, split=t1.split_down, **kw))


# ------------------------------------------------------------------------------------- fold / PDL / L2 prefetch

_PAIR = dict(path="pair", split_gate_up=2, split_down=2, gate_up_halves=True,
             gate_up=dict(BN=32, BK=128, num_warps=2, num_stages=3), down=dict(BN=32, BK=128, num_warps=2,
                                                                                num_stages=3))


@pytest.mark.parametrize("kw, arg", [
    (dict(config=dict(_PAIR, fold=1)), "fold"),
    (dict(config=dict(_PAIR, path="sorted", fold=True)), "fold"),
    (dict(config=dict(_PAIR, path="pair_token", split_down=1, fold=True)), "fold"),
    (dict(config=dict(_PAIR, pdl=True)), "pdl"),
    (dict(config=dict(_PAIR, prefetch_gate_up=3)), "prefetch_gate_up"),
    (dict(config=dict(_PAIR, path="sorted", prefetch_gate_up=2)), "prefetch_gate_up"),
    (dict(config=dict(_PAIR, prefetch_down=3)), "prefetch_down"),
    (dict(config=dict(_PAIR, fold=True, pdl=True, pdl_release="end")), "pdl_release"),
    (dict(config=dict(_PAIR, fold=True, pdl_release="start")), "pdl_release"),  # without pdl
    (dict(config=dict(_PAIR, fold=True), workspace=torch.zeros(4096, dtype=torch.int64)), "workspace"),
    (dict(config=dict(_PAIR, fold=True), workspace=torch.zeros(8, dtype=torch.int32)), "workspace"),
])
def test_fold_options_are_validated(kw, arg):
    from pd.kernels.mxfp4_moe import fused_moe_mxfp4

    with pytest.raises(ValueError, match=arg):
        fused_moe_mxfp4(**_inputs(), **kw)


def test_mxfp4_moe_workspace_size_and_errors():
    from pd.kernels.mxfp4_moe import mxfp4_moe_workspace

    ws = mxfp4_moe_workspace(8, 6, 4096, 2048, device="cpu")
    # one ticket per (pair, 16 intermediate columns) and per (token, 16 hidden columns): the smallest BN
    assert ws.dtype == torch.int32 and ws.numel() == 8 * 6 * 2048 // 16 + 8 * 4096 // 16 and not ws.any()
    for bad in (dict(max_tokens=0), dict(topk=1.5), dict(hidden=True)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            mxfp4_moe_workspace(**dict(dict(max_tokens=1, topk=6, hidden=128, intermediate=128), **bad))


@aot
@pytest.mark.parametrize("cc, wl", [(90, 1), (120, 0)])
def test_aot_fold_pdl_prefetch_variants(cc, wl):
    """The T = 1 options compile on both targets (sm_120a: mma.sync, no wgmma, <= 99 KiB) and are really in the
    code only when asked for: L2 prefetches (evict_last for the down slice, and for down's own rows with
    prefetch_down 2), the gate/up release of programmatic dependent launch (after the K loop's loads, or with
    pdl_release "start" before them) and the down wait, the acq_rel tickets of the fold."""
    deq = 1 if cc == 90 else 0
    tile = _tile(BN=64, BK=256, BK_DOT=128, num_warps=2, num_stages=3)
    const = dict(DIMS, SORTED=False, HAS_LIMIT=True, UP_FIRST=False, SPLIT=4, HALVES=True, BM=16, BN=64, BK=256,
                 BKD=128, DEQ=deq, WL=wl, **NO_FOLD)
    from pd.kernels.mxfp4_moe import DOWN_SIGNATURE, GATE_UP_SIGNATURE, _down_kernel, _gate_up_kernel

    def build(fn, sig, c, stride):
        k = compile_for(fn, sig, c, cc, tile.num_warps, tile.num_stages, aligned=_aligned(sig, stride))
        if cc == 120:
            assert_sm120_ok(k)
        else:
            assert "mma" in k.asm["ptx"] and k.metadata.shared <= 232448
        return k.asm["ptx"]

    plain = build(_gate_up_kernel, GATE_UP_SIGNATURE, const, "stride_xt")
    gu = build(_gate_up_kernel, GATE_UP_SIGNATURE, dict(const, PF=2, FOLD=True, PDL=True), "stride_xt")
    dconst = dict(DIMS, MODE=1, SPLIT=2, BM=16, BN=64, BK=128, BKD=128, DEQ=deq, WL=wl, **NO_FOLD)
    dplain = build(_down_kernel, DOWN_SIGNATURE, dconst, "stride_ot")
    dn = build(_down_kernel, DOWN_SIGNATURE, dict(dconst, PF=1, FOLD=True, PDL=True), "stride_ot")
    gu_start = build(_gate_up_kernel, GATE_UP_SIGNATURE, dict(const, FOLD=True, PDL=2), "stride_xt")
    dn_last = build(_down_kernel, DOWN_SIGNATURE, dict(dconst, PF=2, FOLD=True, PDL=2), "stride_ot")
    for ptx in (plain, dplain):
        assert "prefetch.global" not in ptx and "griddepcontrol" not in ptx and "atom." not in ptx
    assert "prefetch.global.L2::evict_last" in gu and "prefetch.global.L2 " in gu
    assert "griddepcontrol.launch_dependents" in gu and "griddepcontrol.wait" not in gu
    assert "prefetch.global.L2 " in dn and "griddepcontrol.wait" in dn and "evict_last" not in dn
    assert "prefetch.global.L2::evict_last" in dn_last and "prefetch.global.L2 " not in dn_last
    assert dn_last.index("prefetch.global") < dn_last.index("griddepcontrol.wait") < dn_last.index("cp.async")
    # the release: after every weight load of the K loop (1), or before the first one (2: "start")
    rel = {k: ptx.index("griddepcontrol.launch_dependents") for k, ptx in (("loop", gu), ("start", gu_start))}
    assert gu.count("griddepcontrol.launch_dependents") == gu_start.count("griddepcontrol.launch_dependents") == 1
    assert rel["loop"] > gu.rindex("cp.async.") and rel["start"] < gu_start.index("cp.async.")
    for ptx in (gu, dn):
        atoms = [ln for ln in ptx.splitlines() if "atom." in ln]
        assert atoms and all("acq_rel" in ln and ".gpu" in ln and ".add" in ln for ln in atoms), atoms


# ------------------------------------------------------------------------ register cap (maxnreg) for one-wave grids

@pytest.mark.parametrize("tile_kw", [dict(maxnreg=31), dict(maxnreg=256), dict(maxnreg=True), dict(maxnreg=40.0),
                                     dict(maxnreg=None)])
def test_maxnreg_is_validated(tile_kw):
    from pd.kernels.mxfp4_moe import fused_moe_mxfp4

    cfg = dict(_PAIR, gate_up=dict(_PAIR["gate_up"], **tile_kw))
    with pytest.raises(ValueError, match="maxnreg"):
        fused_moe_mxfp4(**_inputs(), config=cfg)


@aot
def test_aot_register_cap_is_honoured_on_both_targets():
    """A tile's maxnreg reaches ptxas: of the T = 1 candidates with 4 K splits (gate/up 64 columns x 4 warps, down 32 x
    2, BK_DOT 64) at least one uses more than 40 registers uncapped on sm_90a (gate/up 44 with triton 3.9; down 48
    with 3.8.0), and both at most 40 with maxnreg=40, so 12 / 25 blocks fit an SM and their 1536 / 3072 programs one
    wave. The capped tiles also build for
    sm_120a (mma.sync, no wgmma, <= 99 KiB) with the SGLang layout's dot_scaled."""
    from sass_stats import registers

    gu = _tile(BN=64, BK=256, BK_DOT=64, num_warps=4, num_stages=3)
    dn = _tile(BN=32, BK=128, BK_DOT=64, num_warps=2, num_stages=3)
    kw = dict(bm=1, deq=1, wl=1, fold=True)
    free = (registers(_gate_up(gu, 90, sorted_=False, halves=True, split=4, **kw).asm["cubin"]),
            registers(_down(dn, 90, mode=1, split=4, **kw).asm["cubin"]))
    capped = (_gate_up(dataclasses.replace(gu, maxnreg=40), 90, sorted_=False, halves=True, split=4, **kw),
              _down(dataclasses.replace(dn, maxnreg=40), 90, mode=1, split=4, **kw))
    regs = tuple(registers(k.asm["cubin"]) for k in capped)
    assert max(free) > 40 and max(regs) <= 40, (free, regs)
    for k in capped:
        ptx = k.asm["ptx"]
        assert ".maxnreg 40" in ptx and "mma.sync" in ptx and "wgmma" not in ptx and "atom." in ptx
    assert_sm120_ok(_gate_up(dataclasses.replace(gu, maxnreg=40), 120, sorted_=False, halves=True, split=4, bm=1,
                             fold=True))
    assert_sm120_ok(_down(dataclasses.replace(dn, maxnreg=40), 120, mode=1, split=4, bm=1, fold=True))


# ------------------------------------------------------------- stage_loads: activation rows and scales through cp.async

@pytest.mark.parametrize("kw, arg", [
    (dict(config=dict(_PAIR, BM=1, stage_loads=4)), "stage_loads"),
    (dict(config=dict(_PAIR, BM=1, stage_loads=True)), "stage_loads"),
    (dict(config=dict(_PAIR, BM=1, stage_loads="3")), "stage_loads"),
    (dict(config=dict(_PAIR, BM=2, stage_loads=1)), "stage_loads"),
    (dict(config=dict(_PAIR, BM=1, stage_loads=2, gate_up=dict(BN=32, BK=512, BK_DOT=128, num_warps=2,
                                                              num_stages=3))), "stage_loads"),
    (dict(config=dict(_PAIR, BM=1, stage_loads=1)), "stage_loads"),  # the SGLang layout
])
def test_stage_loads_is_validated(kw, arg):
    from pd.kernels.mxfp4_moe import fused_moe_mxfp4

    with pytest.raises(ValueError, match=arg):
        fused_moe_mxfp4(**_inputs(), max_scale_byte=127, **kw)


@aot
def test_aot_stage_loads_take_the_activation_and_scales_off_the_k_loop():
    """With the T <= 8 plan's tiles (gate/up 32 x 2 warps, down 64 x 4, BK 256 in two BK_DOT 128 steps) the K loops
    read x / h with plain 64-bit loads in the step that uses them (16 LDG.E.64 in gate/up) and the scales with 2-byte
    loads; stage_loads=3 makes both part of the cp.async pipeline: no plain global load is left in either K loop
    (sm_90a SASS, triton 3.9: gate/up 54 registers instead of 62). Both build for sm_120a (mma.sync, no wgmma,
    <= 99 KiB)."""
    from pd.kernels.mxfp4_moe import DEFAULT_CONFIGS_SM90_BITS
    from sass_stats import longest_loop

    t1 = DEFAULT_CONFIGS_SM90_BITS[0][1]
    gu_kw = dict(bm=1, sorted_=False, halves=True, split=t1.split_gate_up, deq=1, wl=1, fold=True, pdl=True)
    dn_kw = dict(bm=1, mode=1, split=t1.split_down, deq=1, wl=1, fold=True, pdl=True)

    def loop_loads(k):
        _, ops = longest_loop(k.asm["cubin"])
        return (sum(c for o, c in ops.items() if o.startswith("LDG.")),
                sum(c for o, c in ops.items() if o.startswith("LDGSTS")))

    base = (loop_loads(_gate_up(t1.gate_up, 90, **gu_kw)), loop_loads(_down(t1.down, 90, **dn_kw)))
    staged = (_gate_up(t1.gate_up, 90, xs=3, **gu_kw), _down(t1.down, 90, xs=3, **dn_kw))
    for (plain0, async0), (plain, asyncs) in zip(base, map(loop_loads, staged)):
        assert plain0 >= 4 and plain == 0 and asyncs > async0, (base, plain, asyncs)
    assert_sm120_ok(_gate_up(t1.gate_up, 120, xs=3, **gu_kw))
    assert_sm120_ok(_down(t1.down, 120, xs=3, **dn_kw))
