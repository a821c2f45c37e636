"""pd.kernels.indexer on CPU: interpreter correctness vs the fp64 reference and torch.topk (subprocess, since
TRITON_INTERPRET must be set before triton decorates the kernels), the index-key layout against SGLang's own
writer, input validation, and AOT compilation of every score config for sm_120a (mma.sync, no wgmma,
<= 101376 B shared) and sm_90a, plus the select and group-max kernels."""

import json
import os
import subprocess
import sys

import pytest
import torch

from triton_aot import aot, assert_sm120_ok, compile_for

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def interp_results():
    env = dict(os.environ, TRITON_INTERPRET="1", TRITON_DEFAULT_FP_FUSION="1")
    p = subprocess.run([sys.executable, os.path.join(HERE, "indexer_interp_cases.py")], env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    return {r["name"]: r for r in map(json.loads, filter(None, p.stdout.splitlines()))}


INDEXER_CASES = ["decode_h64_p64", "mtp3_h16_p16_view4_out", "len2d_h32_p32_ws", "fp8q_qscale_h16",
                 "all_ties_fallback", "fp8_keys_tokens_m", "fp8_keys_heads_m_fp8q", "packed_no_prefetch",
                 "decode_select_split2_multi_tile", "mtp6_two_launches", "fp8_page_vector_p64_chunks",
                 "fp8_page_vector_p256_fp8q", "fp8_page_vector_p16_two_pages_a_tile",
                 "fp8_page_vector_p8_falls_back", "fp8_page_vector_pair_p16", "fp8_page_vector_pair_p16_epi1",
                 "fp8_page_vector_p64_epi1_fp8q"]
SELECT_CASES = ["select_randn", "select_few_values", "select_grid_ties", "select_constant", "select_wide_range",
                "select_grid_ties_radix", "select_wide_range_radix"]
# a unique answer: must equal torch.topk's set
DISTINCT_VALUES = {"select_randn", "select_wide_range", "select_wide_range_radix"}


@pytest.mark.parametrize("name", INDEXER_CASES + SELECT_CASES)
def test_interpreter_selection_is_exact_up_to_ties(interp_results, name):
    r = interp_results[name]
    assert all(v == 0 for v in r["bad"].values()), r
    if name in DISTINCT_VALUES:
        assert r["swaps_vs_torch_topk"] == 0, r
    if name.startswith("select"):
        assert r["ref_short_rows_equal"], r


def test_workspace_histograms_never_change_the_answer(interp_results):
    """A poisoned histogram costs one slow call, never a wrong one, and is zeroed by it; split stages (the
    benchmark's select-only timing) equal a full call; the streamed candidate path is exact."""
    r = interp_results["workspace_state"]
    assert all(v == 0 for v in r["bad"].values()), r
    assert r["hist_cleared"] and r["stale_equal"] and r["split_stages_equal"] and r["select_only_keeps_hist"], r
    assert r["streamed_equal"], r


def test_select_takes_the_bounded_path_on_distinct_scores(interp_results):
    """Random scores never reach the streamed fallbacks (the speed contract), for rows of more and of fewer groups
    than topk, from precomputed scores and through the scores kernel, and the fine search resolves their threshold
    bin without a radix pass; constant scores reach the fallback, and stay exact."""
    r = interp_results["select_paths"]
    assert r["randn_streamed_calls"] == 0 and r["randn_radix_calls"] == 0 and r["randn_exact"], r
    assert r["indexer_streamed_calls"] == 0 and r["indexer_radix_calls"] == 0 and r["indexer_exact"], r
    assert r["constant_streamed_calls"] >= 1 and r["constant_exact"], r


def test_select_switches_give_the_same_answer(interp_results):
    """The select's one-tile candidate read, exact-bin fast path and whole-slice score read change nothing but
    speed: flipping each (or all) from its default gives the same output bit for bit, and the streamed fallback
    (which would hide a broken path behind an exact answer) never runs on these scores."""
    r = interp_results["select_switches"]
    assert all(v == 0 for v in r["bad"].values()), r
    assert all(r["equal_when_flipped"].values()) and r["streamed_calls"] == 0, r


def test_page_vector_consts():
    """Page ids per chunk of the fp8pv path: up to 32 in one warp-wide vector, up to 64 in two, more is an error;
    pages smaller than half a tile have no page-vector path."""
    from pd.kernels.indexer import PV_TILES, page_vector_consts

    assert page_vector_consts(128, 64) == (PV_TILES, 32, False)  # 8 tiles of 2 pages + 1
    assert page_vector_consts(128, 64, 24) == (24, 32, True)  # 49 ids: two vectors of 32
    assert page_vector_consts(128, 256, 24) == (24, 16, False)  # 13 ids
    assert page_vector_consts(128, 32, 24) == (24, 0, False)
    with pytest.raises(ValueError, match="config"):
        page_vector_consts(128, 64, 40)  # 81 ids


def test_layout_matches_sglang_writer(interp_results):
    r = interp_results["sglang_writer_layout"]
    assert r["bytes_equal"] and r["same_selection"], r


# ---------------------------------------------------------------- reference

def test_reference_layout_and_causal_lengths():
    from pd.kernels.indexer_reference import cache_fp8_and_scales, dsa_indexer_topk_ref, live_lengths, quantize_index_k

    g = torch.Generator().manual_seed(0)
    k = torch.randn(128, 128, generator=g)
    kc = quantize_index_k(k, 64)
    assert kc.shape == (2, 64 * 132) and kc.dtype == torch.uint8
    # token 5 of page 1: fp8 bytes at 5 * 128, fp32 scale at 64 * 128 + 5 * 4
    scale = kc[1, 64 * 128 + 20: 64 * 128 + 24].view(torch.float32)
    assert torch.allclose(scale, k[69].abs().max() / 448)
    deq = kc[1, 5 * 128: 6 * 128].view(torch.float8_e4m3fn).float() * scale
    assert ((deq - k[69]).norm() / k[69].norm()) < 0.05
    k8, sc = cache_fp8_and_scales(kc, 64)
    assert torch.equal(k8[1, 5].view(torch.uint8), kc[1, 640: 768]) and sc[1, 5] == scale
    # MTP verify: token s of S sees seq_len - S + 1 + s positions, clamped to [0, max_len]
    assert live_lengths(torch.tensor([10, 2, 1, 500]), 3, 400).tolist() == [[8, 9, 10], [0, 1, 2], [0, 0, 1],
                                                                          [400, 400, 400]]
    assert live_lengths(torch.tensor([[7, 9]]), 2, 8).tolist() == [[7, 8]]
    # short rows: every live position then -1
    q = torch.randn(1, 2, 16, 128, generator=g).to(torch.bfloat16)
    out = dsa_indexer_topk_ref(q, torch.rand(1, 2, 16, generator=g), kc, torch.tensor([[1, 0]], dtype=torch.int32),
                               torch.tensor([5]), topk=8)
    assert out.tolist() == [[[0, 1, 2, 3, -1, -1, -1, -1], [0, 1, 2, 3, 4, -1, -1, -1]]]


# ---------------------------------------------------------------- validation

def _args(b=2, s=1, h=64, ps=64, pages=4, max_pages=3):
    from pd.kernels.indexer_reference import quantize_index_k

    return dict(q=torch.zeros(b, s, h, 128, dtype=torch.bfloat16), weights=torch.zeros(b, s, h),
                index_k_cache=quantize_index_k(torch.randn(pages * ps, 128), ps),
                block_table=torch.zeros(b, max_pages, dtype=torch.int32),
                seq_lens=torch.full((b,), 10, dtype=torch.int32), page_size=ps)


@pytest.mark.parametrize("mutate, arg", [
    (lambda a: a.update(q=a["q"].float()), "q"),
    (lambda a: a.update(q=a["q"][..., :64]), "q"),
    (lambda a: a.update(q=torch.zeros(2, 1, 48, 128, dtype=torch.bfloat16)), "q"),
    (lambda a: a.update(q=torch.zeros(2, 9, 64, 128, dtype=torch.bfloat16)), "q"),
    (lambda a: a.update(q=a["q"].transpose(2, 3).contiguous().transpose(2, 3)), "q"),
    (lambda a: a.update(weights=a["weights"].double()), "weights"),
    (lambda a: a.update(weights=a["weights"][:, :, :32]), "weights"),
    (lambda a: a.update(q_scale=torch.ones(2, 1, 64)), "q_scale"),  # bf16 q
    (lambda a: a.update(q=a["q"].to(torch.float8_e4m3fn), q_scale=torch.ones(2, 1, 64, dtype=torch.float16)),
     "q_scale"),
    (lambda a: a.update(index_k_cache=a["index_k_cache"].float()), "index_k_cache"),
    (lambda a: a.update(index_k_cache=a["index_k_cache"][:, :8000]), "index_k_cache"),
    (lambda a: a.update(index_k_cache=a["index_k_cache"].view(4, 64, 132)), "index_k_cache"),
    (lambda a: a.update(page_size=32), "index_k_cache"),  # cache rows are 64 * 132 bytes
    (lambda a: a.update(page_size=48), "page_size"),
    (lambda a: a.update(block_table=a["block_table"].long()), "block_table"),
    (lambda a: a.update(block_table=torch.zeros(3, 3, dtype=torch.int32)), "block_table"),
    (lambda a: a.update(block_table=torch.zeros(3, 2, dtype=torch.int32).t()), "block_table"),
    (lambda a: a.update(seq_lens=a["seq_lens"].float()), "seq_lens"),
    (lambda a: a.update(seq_lens=torch.zeros(3, dtype=torch.int32)), "seq_lens"),
    (lambda a: a.update(topk=0), "topk"),
    (lambda a: a.update(topk=4096), "topk"),
    (lambda a: a.update(out=torch.zeros(2, 1, 512, dtype=torch.int64)), "out"),
    (lambda a: a.update(out=torch.zeros(2, 1, 256, dtype=torch.int32)), "out"),
    (lambda a: a.update(workspace=torch.zeros(10, dtype=torch.int32)), "workspace"),
    (lambda a: a.update(config={"BLOCK_N": 32, "num_warps": 4}), "config"),
    (lambda a: a.update(select_warps=3), "select_warps"),
    (lambda a: a.update(n_split=0), "n_split"),
    (lambda a: a.update(select_split=17), "select_split"),
])
def test_validation_errors_name_the_argument(mutate, arg):
    from pd.kernels.indexer import dsa_indexer_topk

    a = _args()
    mutate(a)
    with pytest.raises(ValueError, match=arg):
        dsa_indexer_topk(**a)


@pytest.mark.parametrize("mutate, arg", [
    (lambda a: a.update(scores=a["scores"].double()), "scores"),
    (lambda a: a.update(scores=a["scores"].t()), "scores"),
    (lambda a: a.update(lengths=a["lengths"][:1]), "lengths"),
    (lambda a: a.update(topk=-1), "topk"),
])
def test_topk_from_scores_validation(mutate, arg):
    from pd.kernels.indexer import topk_from_scores

    a = dict(scores=torch.zeros(2, 100), lengths=torch.tensor([100, 5]), topk=16)
    mutate(a)
    with pytest.raises(ValueError, match=arg):
        topk_from_scores(**a)


def test_valid_cpu_tensors_outside_the_interpreter_are_refused_before_launch():
    from pd.kernels.indexer import dsa_indexer_topk, topk_from_scores

    with pytest.raises(ValueError, match="q is on cpu: the Triton kernel needs a CUDA device .*indexer_reference"):
        dsa_indexer_topk(**_args())
    with pytest.raises(ValueError, match="scores is on cpu: the Triton kernel needs a CUDA device"):
        topk_from_scores(torch.zeros(2, 100), torch.tensor([100, 5]), topk=16)


def test_workspace_size_and_capacity():
    from pd.kernels.indexer import FINE_BINS, HIST_BINS, candidate_capacity, indexer_workspace

    assert candidate_capacity(512) == 2048 and candidate_capacity(300) == 2048 and candidate_capacity(2048) == 4096
    ws = indexer_workspace(4, 2, 8192, 512, device="cpu")
    # scores + group maxima + histogram + ticket + fine histogram + per select slice (16) candidate positions, keys
    # and a count, per query token
    assert ws.dtype == torch.int32 and ws.numel() == 8 * (8192 + 1024 + HIST_BINS + 1 + FINE_BINS
                                                          + 16 * (2 * 2048 + 1))
    assert not ws.any()  # the histograms must start at zero


def test_default_configs_are_score_configs():
    from pd.kernels.indexer import DEFAULT_FP8Q_SCORE_CONFIGS, DEFAULT_SCORE_CONFIGS, SCORE_CONFIGS

    assert all(c in SCORE_CONFIGS for c in DEFAULT_SCORE_CONFIGS.values())
    assert all(c in SCORE_CONFIGS for c in DEFAULT_FP8Q_SCORE_CONFIGS.values())
    assert {k for k in DEFAULT_SCORE_CONFIGS} == {(sm90, s) for sm90 in (False, True) for s in (1, 2, 4)}


def test_score_split_one_wave_at_small_batch():
    """A WAVE config launches at most WAVE programs per SM in all (WAVE 3, B=16 on 132 SMs: 24 per request,
    384 <= 396; WAVE 6, the sm_90 fp8-query default: 49, 784 <= 792), unless that leaves fewer than MIN_WAVE_SPLIT per
    request (WAVE 3 at B=64: 6), where the oversubscribed split applies, as for configs without WAVE."""
    from pd.kernels.indexer import (
        DEFAULT_FP8Q_SCORE_CONFIGS,
        MIN_WAVE_SPLIT,
        PROGRAMS_PER_SM,
        SCORE_CONFIGS,
        score_split,
    )

    wave6 = DEFAULT_FP8Q_SCORE_CONFIGS[(True, 1)]
    wave3 = next(c for c in SCORE_CONFIGS if c.get("WAVE") == 3)
    plain = {k: v for k, v in wave3.items() if k != "WAVE"}
    assert wave6["WAVE"] == 6 and score_split(16, wave6, 132) == 49 and score_split(64, wave6, 132) == 12
    assert score_split(128, wave6, 132) == 9 and score_split(1, wave6, 132) == 64
    assert score_split(16, wave3, 132) == 24 and score_split(1, wave3, 132) == 64
    assert 3 * 132 // 64 < MIN_WAVE_SPLIT and score_split(64, wave3, 132) == score_split(64, plain, 132) == 17
    assert score_split(16, plain, 132) == min(64, -(-PROGRAMS_PER_SM * 132 // 16)) == 64
    assert score_split(4096, plain, 132) == 1


# ---------------------------------------------------------------- AOT compile (no GPU needed)

SCORE_SIG = {"q_ptr": "*bf16", "w_ptr": "*fp32", "qs_ptr": "*fp32", "kc32_ptr": "*i32", "k8_ptr": "*fp8e4nv",
             "ks_ptr": "*fp32", "bt_ptr": "*i32", "len_ptr": "*i32", "score_ptr": "*fp32", "gmax_ptr": "*fp32",
             "hist_ptr": "*i32", "stride_qb": "i32",
             "stride_qs": "i32", "stride_qh": "i32", "stride_wb": "i32", "stride_ws": "i32", "stride_bt": "i32",
             "max_len": "i32", "ng_buf": "i32", "n_split": "i32", "topk": "i32", "S_ALL": "i32", "s0": "i32"}


def _score_configs():
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    from pd.kernels.indexer import SCORE_CONFIGS

    return SCORE_CONFIGS


# pointers and strides the launcher specializes as 16-divisible at run time (so vector loads and asynchronous
# copies, hence the real shared-memory use, are what the GPU build gets)
SCORE_ALIGNED = ("q_ptr", "w_ptr", "qs_ptr", "kc32_ptr", "k8_ptr", "ks_ptr", "bt_ptr", "len_ptr", "score_ptr",
                 "gmax_ptr", "hist_ptr", "stride_qb", "stride_qs", "stride_qh", "stride_wb", "stride_bt", "max_len")


def _compile_scores(cfg, cc, s_p2=1, fp8=False):
    """The score kernel as the launcher builds it on sm_90 / sm_120 (both cc >= 9: with the PDL release when
    select_pdl is on)."""
    from pd.kernels.indexer import (
        DEFAULT_INDEXER_CONFIG,
        GROUP,
        HIST_BINS,
        HIST_SHIFT,
        MIN_TILES,
        _index_scores_kernel,
        page_vector_consts,
    )

    ch, npv, pair = page_vector_consts(cfg["BLOCK_N"], 64, cfg.get("PV", 0))
    const = dict(S=s_p2, S_P2=s_p2, H=64, PAGE=64, BLOCK_N=cfg["BLOCK_N"], G=GROUP, LEN_2D=False, HAS_QS=fp8,
                 Q_FP8=fp8, MIN_TILES=MIN_TILES, DOT_F32=False, TOKENS_M=cfg["TOKENS_M"], PREFETCH=cfg["PREFETCH"],
                 DOT_PREC="tf32", KEYS=cfg["KEYS"], NB=HIST_BINS, SHIFT=HIST_SHIFT,
                 PDL=DEFAULT_INDEXER_CONFIG.select_pdl, CH=ch, NPV=max(npv, 2), PAIR=pair,
                 EPI=cfg.get("EPI", 0) if s_p2 == 1 else 0)
    sig = dict(SCORE_SIG, q_ptr="*fp8e4nv" if fp8 else "*bf16")
    return compile_for(_index_scores_kernel, sig, const, cc, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                       aligned=SCORE_ALIGNED, maxnreg=cfg.get("MAXNREG"))


def _cfg_id(c):
    return (f"{c['KEYS']}_{'tokM' if c['TOKENS_M'] else 'headM'}_n{c['BLOCK_N']}_w{c['num_warps']}_s{c['num_stages']}"
            f"{'_pf' if c['PREFETCH'] else ''}{'_wave%d' % c['WAVE'] if c.get('WAVE') else ''}"
            f"{'_pv%d' % c['PV'] if c.get('PV') else ''}"
            f"{'_r%d' % c['MAXNREG'] if c.get('MAXNREG') not in (None, 128) else ''}"
            f"{'_epi%d' % c['EPI'] if c.get('EPI') else ''}")


@aot
@pytest.mark.parametrize("cfg", _score_configs(), ids=_cfg_id)
def test_aot_score_config_sm120a_and_sm90a(cfg):
    """Every score config: one bf16 query (decode) and 4 stacked verify tokens (the most shared memory) compile
    for sm_120a to mma.sync within 99 KiB; the decode build also compiles for sm_90a. fp8 key tiles with more
    than one stage are software-pipelined: their gathers are asynchronous copies (cp.async) on both targets."""
    builds = [_compile_scores(cfg, 120, s_p2=1), _compile_scores(cfg, 120, s_p2=4), _compile_scores(cfg, 90, s_p2=1)]
    assert_sm120_ok(builds[0])
    assert_sm120_ok(builds[1])
    assert "mma" in builds[2].asm["ptx"]
    assert all(("griddepcontrol.launch_dependents" in k.asm["ptx"]) == _select_pdl() for k in builds)
    if cfg["KEYS"] == "fp8" and cfg["num_stages"] > 1:
        assert all("cp.async" in k.asm["ptx"] for k in builds)


def _select_pdl():
    from pd.kernels.indexer import DEFAULT_INDEXER_CONFIG

    return DEFAULT_INDEXER_CONFIG.select_pdl


@aot
@pytest.mark.parametrize("sm90", [False, True])
def test_aot_default_configs_fp8_query(sm90):
    """fp8 x fp8 dots (fp8 query): the default configs of each arch compile (sm_120a: mma.sync e4m3)."""
    from pd.kernels.indexer import DEFAULT_FP8Q_SCORE_CONFIGS, DEFAULT_SCORE_CONFIGS

    for (is90, s_p2), cfg in list(DEFAULT_SCORE_CONFIGS.items()) + list(DEFAULT_FP8Q_SCORE_CONFIGS.items()):
        if is90 != sm90:
            continue
        k = _compile_scores(cfg, 90 if sm90 else 120, s_p2=s_p2, fp8=True)
        if not sm90:
            assert_sm120_ok(k)
            assert "e4m3" in k.asm["ptx"]


@aot
@pytest.mark.parametrize("topk", [512, 2048])
def test_aot_select_and_group_max(topk):
    """The select kernel has no dot (compares, reductions, scans: no tensor-core work to do), so sm_120a only
    needs no wgmma and <= 99 KiB of shared memory; every select warp count compiles for both targets."""
    from pd.kernels.indexer import (
        DEFAULT_INDEXER_CONFIG,
        DEFAULT_SELECT_WARPS,
        FINE_BINS,
        FINE_SHIFT,
        GROUP,
        HIST_BINS,
        HIST_SHIFT,
        MIN_TILES,
        RADIX_BITS,
        SELECT_SPLIT,
        SELECT_TGS,
        SELECT_WARPS,
        _group_max_kernel,
        _select_topk_kernel,
        candidate_capacity,
    )

    sig = {"score_ptr": "*fp32", "gmax_ptr": "*fp32", "hist_ptr": "*i32", "tick_ptr": "*i32", "fine_ptr": "*i32",
           "scr_ptr": "*i32",
           "len_ptr": "*i32", "out_ptr": "*i32", "S": "i32", "max_len": "i32", "stride_row": "i32", "ng_buf": "i32",
           "topk": "i32"}
    icfg = DEFAULT_INDEXER_CONFIG
    SELECT_PDL, SELECT_FAST_EXACT = icfg.select_pdl, icfg.select_fast_exact
    SELECT_READS_SCORES, SELECT_GATHER2D = icfg.select_reads_scores, icfg.select_gather2d
    cap = candidate_capacity(topk)
    const = dict(LEN_2D=False, G=GROUP, NB=HIST_BINS, SHIFT=HIST_SHIFT, NSEL=SELECT_SPLIT, CAP=cap, CAP_P=cap,
                 TGS=SELECT_TGS, TILE=1024, RADIX=RADIX_BITS, CLEAR_HIST=True, NBF=FINE_BINS,
                 FSHIFT=FINE_SHIFT, DROP_MAX=8, PDL=SELECT_PDL, FAST_EXACT=SELECT_FAST_EXACT,
                 READ_SCORES=SELECT_READS_SCORES)  # as launched on cc >= 9
    # the one-tile candidate read as launched for 16 select programs per row (B = 16), and for 4 (B = 64) with the
    # default warps
    g16 = 16 if SELECT_GATHER2D else 0
    for w in SELECT_WARPS:
        for cc in (120, 90):
            builds = [("radix", g16, SELECT_READS_SCORES), ("fine", g16, SELECT_READS_SCORES)]
            if w == DEFAULT_SELECT_WARPS:  # B = 64's one-tile read; the other way of reading the slices
                builds += [("fine", 4, SELECT_READS_SCORES)] if g16 else []
                builds += [("fine", g16, not SELECT_READS_SCORES)]
            for search, g, reads in builds:
                k = compile_for(_select_topk_kernel, sig, dict(const, SEARCH=search, GROWS=g, READ_SCORES=reads), cc,
                                num_warps=w, num_stages=1)
                assert ("griddepcontrol.wait" in k.asm["ptx"]) == SELECT_PDL
                if cc == 120:
                    assert_sm120_ok(k, needs_mma=False)
    if topk == 512:
        gsig = {"score_ptr": "*fp32", "gmax_ptr": "*fp32", "hist_ptr": "*i32", "len_ptr": "*i32", "stride_row": "i32",
                "ng_buf": "i32",
                "n_split": "i32", "max_len": "i32", "topk": "i32"}
        for cc in (120, 90):
            k = compile_for(_group_max_kernel, gsig, dict(G=GROUP, BLOCK=256, MIN_TILES=MIN_TILES, NB=HIST_BINS,
                                                          SHIFT=HIST_SHIFT), cc, num_warps=4)
            if cc == 120:
                assert_sm120_ok(k, needs_mma=False)
