"""Interpreter correctness cases for pd.kernels.indexer, run in a subprocess by tests/test_indexer.py
(TRITON_INTERPRET must be set before triton decorates the kernels). Prints one JSON line per case.

Under the interpreter the select kernel keeps only 64 group maxima in registers (PD_INDEXER_INTERP_TILE_G), so
live lengths > 512 take the streamed group-max path at these tiny shapes."""

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from pd.kernels.indexer import dsa_indexer_topk, indexer_workspace, topk_from_scores  # noqa: E402
from pd.kernels.indexer_reference import (  # noqa: E402
    index_scores_ref,
    live_lengths,
    quantize_index_k,
    score_error_bound,
    topk_from_scores_ref,
)


def check_rows(out, ref_scores, lengths, topk, bound=None):
    """Compare selections row by row. Returns a dict of failure counts (all zero = pass).

    Long rows (L > topk): exactly topk distinct live positions, ascending, and no tie-breaking beyond the
    tolerance: min over selected of (score + bound) >= max over unselected live of (score - bound). With
    bound None (exact scores) the selected values must also equal torch.topk's values as a multiset.
    Short rows: exactly 0 .. L-1 then -1."""
    out = out.reshape(-1, topk).long()
    sc = ref_scores.reshape(out.shape[0], -1)
    bd = bound.reshape(out.shape[0], -1) if bound is not None else torch.zeros_like(sc)
    lens = lengths.reshape(-1).long()
    bad = dict(short=0, range=0, dup=0, order=0, tie=0, values=0)
    swaps = 0
    for r in range(out.shape[0]):
        L = int(lens[r])
        o = out[r]
        if L <= topk:
            want = torch.where(torch.arange(topk) < L, torch.arange(topk), -1)
            bad["short"] += int(not torch.equal(o, want))
            continue
        if (o < 0).any() or (o >= L).any():
            bad["range"] += 1
            continue
        if o.unique().numel() != topk:
            bad["dup"] += 1
        if not bool((o[1:] > o[:-1]).all()):
            bad["order"] += 1
        live = sc[r, :L]
        sel = torch.zeros(L, dtype=torch.bool)
        sel[o] = True
        lo_sel = (live[sel] + bd[r, :L][sel]).min()
        if (~sel).any():
            hi_rest = (live[~sel] - bd[r, :L][~sel]).max()
            bad["tie"] += int(bool(lo_sel < hi_rest))
        ref_set = set(live.topk(topk).indices.tolist())
        swaps += len(ref_set - set(o.tolist()))
        if bound is None:
            got = live[o].sort().values
            want_v = live.topk(topk).values.sort().values
            bad["values"] += int(not torch.equal(got, want_v))
    return dict(bad=bad, swaps_vs_torch_topk=swaps)


def _inputs(b, s, h, ps, pool_pages, max_pages, g, q_fp8=False):
    k = torch.randn(pool_pages * ps, 128, generator=g) * (0.5 + torch.rand(pool_pages * ps, 1, generator=g))
    kc = quantize_index_k(k, ps)
    bt = torch.stack([torch.randperm(pool_pages, generator=g)[:max_pages] for _ in range(b)]).to(torch.int32)
    q = torch.randn(b, s, h, 128, generator=g)
    if q_fp8:
        q = (q * 40).to(torch.float8_e4m3fn)
    else:
        q = q.to(torch.bfloat16)
    w = torch.randn(b, s, h, generator=g) * 0.1
    return q, w, kc, bt


def run_indexer(name, b, s, h, ps, topk, lens, max_pages, pool_pages=None, *, q_fp8=False, qscale=False,
                view4=False, zero_q=False, use_out=False, use_ws=False, seed=0, config=None, select_split=None,
                n_split=None):
    g = torch.Generator().manual_seed(seed)
    q, w, kc, bt = _inputs(b, s, h, ps, pool_pages or max_pages * b, max_pages, g, q_fp8)
    if zero_q:
        q = torch.zeros_like(q)  # every score 0: mass ties, the streamed fallback
    qs = torch.rand(b, s, h, generator=g) + 0.5 if qscale else None
    seq = torch.tensor(lens, dtype=torch.int32)
    cache = kc.view(kc.shape[0], ps, 1, 132) if view4 else kc
    kw = dict(topk=topk, page_size=ps, q_scale=qs)
    if use_out:
        buf = torch.full((b + 1, s, topk), 7, dtype=torch.int32)  # last batch row: guard
        kw["out"] = buf[:b]
    if use_ws:
        kw["workspace"] = indexer_workspace(b, s, max_pages * ps, topk, device="cpu")
    if config:
        kw["config"] = config
    if select_split:
        kw["select_split"] = select_split
    if n_split:
        kw["n_split"] = n_split
    out = dsa_indexer_topk(q, w, cache, bt, seq, **kw)
    if use_out:
        assert out.data_ptr() == kw["out"].data_ptr()
    ref = index_scores_ref(q, w, kc, bt, seq, ps, qs)
    bound = score_error_bound(q, w, kc, bt, ps, qs)
    lengths = live_lengths(seq, s, max_pages * ps)
    res = check_rows(out, ref, lengths, topk, bound)
    if use_out:
        res["bad"]["guard"] = int(not bool((buf[b] == 7).all()))
    res.update(name=name, lengths=lengths.tolist())
    return res


def run_select(name, rows, width, topk, lens, kind, seed=0, search=None):
    import pd.kernels.indexer as K

    g = torch.Generator().manual_seed(seed)
    if kind == "randn":
        sc = torch.randn(rows, width, generator=g)
    elif kind == "few_values":  # heavy ties: 5 distinct values incl. -inf and negative zero
        vals = torch.tensor([-2.5, -0.0, 0.0, 1.25, float("-inf")])
        sc = vals[torch.randint(0, 5, (rows, width), generator=g)]
    elif kind == "grid":  # values on a 1/8 grid: ties at the threshold inside the register candidate path
        sc = torch.round(torch.randn(rows, width, generator=g) * 8) / 8
    elif kind == "constant":
        sc = torch.full((rows, width), 3.0)
    elif kind == "wide_range":  # magnitudes over 60 binades, both signs
        exps = torch.randint(-30, 30, (rows, width), generator=g).float()
        sc = torch.randn(rows, width, generator=g) * torch.pow(2.0, exps)
    else:
        raise ValueError(kind)
    lengths = torch.tensor(lens, dtype=torch.int32)
    buf = torch.full((rows + 1, topk), -7, dtype=torch.int32)  # last row: guard against writes past the output
    # the final threshold search: fine (default) or radix
    icfg = K.IndexerConfig(select_search=search or K.DEFAULT_INDEXER_CONFIG.select_search)
    out = topk_from_scores(sc, lengths, topk, out=buf[:rows], indexer_config=icfg)
    res = check_rows(out, sc.double(), lengths.clamp(0, width), topk, None)
    res["bad"]["guard"] = int(not bool((buf[rows] == -7).all()))
    ref = topk_from_scores_ref(sc, lengths.clamp(0, width), topk)
    res.update(name=name, ref_short_rows_equal=bool(torch.equal(out[lengths <= topk], ref[lengths <= topk])))
    return res


def run_sglang_writer_layout(seed=0):
    """Layout contract: SGLang 0.5.23's own index-key writer (``_set_k_and_s_triton``, interpreted) fills a
    buffer byte-identical to ``quantize_index_k``'s, and our kernel reads it back to the same selection."""
    import types

    # the writer module imports a DSA utils module whose import chain needs GPU-only packages; it only uses two
    # names from it, for ROCm's preshuffled layout (off on CUDA)
    stub = types.ModuleType("sglang.srt.layers.attention.dsa.utils")
    stub.INDEXER_K_CACHE_PRESHUFFLE_TILE = 16
    stub.aiter_can_use_preshuffle_paged_mqa = lambda: False
    sys.modules.setdefault(stub.__name__, stub)
    from sglang.kernels.ops.kvcache.dsa_index_k_cache import _set_k_and_s_triton

    g = torch.Generator().manual_seed(seed)
    ps, pages = 64, 4
    ours = quantize_index_k(torch.randn(pages * ps, 128, generator=g), ps)
    k8 = ours[:, : ps * 128].reshape(pages * ps, 128).view(torch.float8_e4m3fn)
    scale = ours[:, ps * 128:].contiguous().view(torch.float32).reshape(pages * ps, 1)
    theirs = torch.zeros_like(ours)
    loc = torch.randperm(pages * ps, generator=g)  # token slots written in random order
    _set_k_and_s_triton(buf=theirs, loc=loc, index_k=k8.view(torch.uint8)[loc].view(torch.float8_e4m3fn),
                        index_k_scale=scale[loc].contiguous(), page_size=ps)
    q = torch.randn(1, 1, 16, 128, generator=g).to(torch.bfloat16)
    w = torch.rand(1, 1, 16, generator=g)
    bt = torch.tensor([[2, 0, 3, 1]], dtype=torch.int32)
    seq = torch.tensor([200], dtype=torch.int32)
    same_sel = torch.equal(dsa_indexer_topk(q, w, theirs, bt, seq, topk=32),
                           dsa_indexer_topk(q, w, ours, bt, seq, topk=32))
    return dict(name="sglang_writer_layout", bytes_equal=bool(torch.equal(theirs, ours)), same_selection=same_sel)


def run_select_switches(seed=0):
    """Each select switch of pd.kernels.indexer's IndexerConfig (select_gather2d, select_fast_exact,
    select_reads_scores) flipped, and
    all flipped, gives the same output as the defaults, bit for bit (same candidates, same order), on the scores
    kernel's output with several group-max (score) tiles per select slice and on precomputed scores with ties."""
    import pd.kernels.indexer as K

    knobs = ("SELECT_GATHER2D", "SELECT_FAST_EXACT", "SELECT_READS_SCORES")  # IndexerConfig fields, upper case
    g = torch.Generator().manual_seed(seed)
    b, s, h, ps, topk, max_pages = 2, 1, 16, 64, 24, 14
    q, w, kc, bt = _inputs(b, s, h, ps, max_pages * b, max_pages, g)
    seq = torch.tensor([890, 400], dtype=torch.int32)
    sc = torch.round(torch.randn(3, 600, generator=g) * 8) / 8  # ties on a 1/8 grid
    lens = torch.tensor([600, 300, 100], dtype=torch.int32)

    def run(icfg=K.DEFAULT_INDEXER_CONFIG):
        return (dsa_indexer_topk(q, w, kc, bt, seq, topk=topk, page_size=ps, select_split=2, indexer_config=icfg),
                topk_from_scores(sc, lens, 32, indexer_config=icfg))

    default = {k: getattr(K.DEFAULT_INDEXER_CONFIG, k.lower()) for k in knobs}
    streamed = []  # the streamed fallback would hide a broken path: on these scores it must never run
    real = K._select_streamed
    K._select_topk_kernel.fn.__globals__["_select_streamed"] = Counting(real, streamed)
    want = run()
    ref = index_scores_ref(q, w, kc, bt, seq, ps)
    bound = score_error_bound(q, w, kc, bt, ps)
    bad = check_rows(want[0], ref, live_lengths(seq, s, max_pages * ps), topk, bound)["bad"]
    bad.update({f"scores_{k}": v for k, v in check_rows(want[1], sc.double(), lens, 32)["bad"].items()})
    equal = {}
    try:
        for name, flip in [(k, (k,)) for k in knobs] + [("all", knobs)]:
            got = run(K.IndexerConfig(**{k.lower(): default[k] != (k in flip) for k in knobs}))
            equal[name] = all(torch.equal(x, y) for x, y in zip(got, want))
    finally:
        K._select_topk_kernel.fn.__globals__["_select_streamed"] = real
    return dict(name="select_switches", bad=bad, defaults=default, equal_when_flipped=equal,
                streamed_calls=len(streamed))


def run_workspace_state(seed=0):
    """The workspace's group-max histograms: a stale (poisoned) histogram still gives the exact answer (through the
    fallback) and is left zeroed; a scores-only then select-only pair (the benchmark's stage timing) equals a full
    call and keeps the histogram; the streamed candidate path (register tile smaller than the candidates) is exact."""
    from pd.kernels.indexer import HIST_BINS, _workspace_layout

    g = torch.Generator().manual_seed(seed)
    b, s, h, ps, topk, max_pages = 2, 1, 16, 64, 16, 12
    q, w, kc, bt = _inputs(b, s, h, ps, max_pages * b, max_pages, g)
    seq = torch.tensor([700, 300], dtype=torch.int32)
    ng, _, _, _ = _workspace_layout(b * s, max_pages * ps, topk)
    h0 = b * s * (max_pages * ps + ng)
    ws = indexer_workspace(b, s, max_pages * ps, topk, device="cpu")
    hist = ws[h0: h0 + b * s * HIST_BINS].view(b * s, HIST_BINS)
    ref = index_scores_ref(q, w, kc, bt, seq, ps)
    bound = score_error_bound(q, w, kc, bt, ps)
    lengths = live_lengths(seq, s, max_pages * ps)
    bad = {}

    def check(name, out):
        for k, v in check_rows(out, ref, lengths, topk, bound)["bad"].items():
            bad[f"{name}_{k}"] = v

    hist[:, HIST_BINS - 1] = 10 ** 6  # every bound above the real scores: no candidates reach topk
    out_stale = dsa_indexer_topk(q, w, kc, bt, seq, topk=topk, page_size=ps, workspace=ws)
    check("stale", out_stale)
    cleared = bool((hist == 0).all())
    out_clean = dsa_indexer_topk(q, w, kc, bt, seq, topk=topk, page_size=ps, workspace=ws)
    check("clean", out_clean)
    ws2 = indexer_workspace(b, s, max_pages * ps, topk, device="cpu")
    dsa_indexer_topk(q, w, kc, bt, seq, topk=topk, page_size=ps, workspace=ws2, stages=("scores",))
    out_split = dsa_indexer_topk(q, w, kc, bt, seq, topk=topk, page_size=ps, workspace=ws2, stages=("select",))
    kept = bool((ws2[h0: h0 + b * s * HIST_BINS] != 0).any())
    os.environ["PD_INDEXER_INTERP_TILE_P"] = "16"  # < candidates: the streamed threshold over the candidate list
    try:
        out_streamed = dsa_indexer_topk(q, w, kc, bt, seq, topk=topk, page_size=ps)
    finally:
        del os.environ["PD_INDEXER_INTERP_TILE_P"]
    check("streamed", out_streamed)
    return dict(name="workspace_state", bad=bad, hist_cleared=cleared,
                split_stages_equal=torch.equal(out_split, out_clean),
                select_only_keeps_hist=kept, stale_equal=torch.equal(out_stale, out_clean),
                streamed_equal=torch.equal(out_streamed, out_clean))


class Counting:
    """Wraps a jit helper the select kernel calls and logs each call (the interpreter resolves the helper from the
    module's globals at call time)."""

    def __init__(self, fn, log):
        self.fn, self.log = fn, log

    def __call__(self, *args, **kw):
        self.log.append(1)
        return self.fn(*args, **kw)


def run_select_paths(seed=0):
    """Which select path runs: the streamed fallbacks are counted by wrapping the jit helper the select kernel calls
    (the interpreter resolves it from the module's globals at call time)."""
    import pd.kernels.indexer as K

    calls, radix_calls = [], []
    real, real_radix = K._select_streamed, K._kth_largest_radix
    g = torch.Generator().manual_seed(seed)
    K._select_topk_kernel.fn.__globals__["_select_streamed"] = Counting(real, calls)
    K._select_topk_kernel.fn.__globals__["_kth_largest_radix"] = Counting(real_radix, radix_calls)
    try:
        res = {}
        # rows of more and of fewer groups than topk (group-max and score histograms)
        for kind, sc in (("randn", torch.randn(4, 3000, generator=g)), ("constant", torch.full((1, 3000), 2.0))):
            lengths = torch.tensor([3000, 2500, 1000, 200][: sc.shape[0]], dtype=torch.int32)
            calls.clear()
            radix_calls.clear()
            out = topk_from_scores(sc, lengths, 32)
            res[f"{kind}_streamed_calls"] = len(calls)
            res[f"{kind}_radix_calls"] = len(radix_calls)  # fine search: the threshold bin resolved without radix
            res[f"{kind}_exact"] = all(v == 0 for v in check_rows(out, sc.double(), lengths, 32)["bad"].values())
        # the same through the scores kernel's histograms
        q, w, kc, bt = _inputs(2, 1, 16, 64, 24, 12, g)
        seq = torch.tensor([700, 200], dtype=torch.int32)
        calls.clear()
        radix_calls.clear()
        out = dsa_indexer_topk(q, w, kc, bt, seq, topk=32)
        res["indexer_streamed_calls"] = len(calls)
        res["indexer_radix_calls"] = len(radix_calls)
        res["indexer_exact"] = all(v == 0 for v in check_rows(out, index_scores_ref(q, w, kc, bt, seq), live_lengths(
            seq, 1, 12 * 64), 32, score_error_bound(q, w, kc, bt))["bad"].values())
    finally:
        K._select_topk_kernel.fn.__globals__["_select_streamed"] = real
        K._select_topk_kernel.fn.__globals__["_kth_largest_radix"] = real_radix
    return dict(name="select_paths", **res)


INDEXER_CASES = [
    # decode, H 64, page 64: short rows (<= topk), all-groups-candidate rows, rows past the register tile
    ("decode_h64_p64", dict(b=3, s=1, h=64, ps=64, topk=32, lens=[700, 20, 200], max_pages=12)),
    # MTP verify S=3 with request lengths (causal per token), page 16 < tile, 4-D cache view, out= given
    ("mtp3_h16_p16_view4_out", dict(b=2, s=3, h=16, ps=16, topk=24, lens=[90, 26], max_pages=8, view4=True,
                                    use_out=True)),
    # per-token lengths [B, S], workspace given, length past the block table (clamped)
    ("len2d_h32_p32_ws", dict(b=2, s=2, h=32, ps=32, topk=16, lens=[[100, 5000], [17, 16]], max_pages=5,
                              use_ws=True)),
    # fp8 query with per-head scales
    ("fp8q_qscale_h16", dict(b=2, s=1, h=16, ps=64, topk=40, lens=[300, 41], max_pages=6, q_fp8=True,
                             qscale=True)),
    # every score equal: more candidate groups than the register capacity -> streamed exact fallback
    ("all_ties_fallback", dict(b=1, s=2, h=16, ps=64, topk=16, lens=[600], max_pages=10, zero_q=True)),
    # fp8 key tiles (software-pipelined loads), keys on M and heads on M, and packed tiles without the prefetch
    ("fp8_keys_tokens_m", dict(b=2, s=2, h=16, ps=32, topk=20, lens=[333, 150], max_pages=12,
                               config=dict(BLOCK_N=64, num_warps=4, num_stages=3, TOKENS_M=True, PREFETCH=False,
                                           KEYS="fp8"))),
    ("fp8_keys_heads_m_fp8q", dict(b=2, s=1, h=16, ps=64, topk=24, lens=[400, 90], max_pages=7, q_fp8=True,
                                   config=dict(BLOCK_N=64, num_warps=4, num_stages=3, TOKENS_M=False,
                                               PREFETCH=False, KEYS="fp8"))),
    # fp8 tiles with the page ids of 8 tiles at a time in registers (interpreter tiles: 32 positions): one score
    # program per request walks several chunks (page 64 and 256: tiles inside a page; page 16: two pages a tile;
    # page 8: more than two pages a tile, the per-position fp8 path instead)
    ("fp8_page_vector_p64_chunks", dict(b=2, s=2, h=16, ps=64, topk=20, lens=[700, 150], max_pages=12, n_split=1,
                                        config=dict(BLOCK_N=128, num_warps=4, num_stages=3, TOKENS_M=True,
                                                    PREFETCH=False, KEYS="fp8pv"))),
    ("fp8_page_vector_p256_fp8q", dict(b=2, s=1, h=16, ps=256, topk=24, lens=[1000, 90], max_pages=4, n_split=1,
                                       q_fp8=True, config=dict(BLOCK_N=128, num_warps=4, num_stages=3,
                                                               TOKENS_M=True, PREFETCH=False, KEYS="fp8pv"))),
    ("fp8_page_vector_p16_two_pages_a_tile", dict(b=2, s=1, h=16, ps=16, topk=24, lens=[300, 200], max_pages=20,
                                                  n_split=1, config=dict(BLOCK_N=128, num_warps=4, num_stages=3,
                                                                         TOKENS_M=True, PREFETCH=False,
                                                                         KEYS="fp8pv"))),
    ("fp8_page_vector_p8_falls_back", dict(b=1, s=1, h=16, ps=8, topk=24, lens=[300], max_pages=40,
                                           config=dict(BLOCK_N=128, num_warps=4, num_stages=3, TOKENS_M=True,
                                                        PREFETCH=False, KEYS="fp8pv"))),
    # chunks of 24 tiles (PV): 49 page ids at page 16, in two register vectors (PAIR); tiles whose pages straddle
    # the two vectors, three chunks for one program
    ("fp8_page_vector_pair_p16", dict(b=2, s=1, h=16, ps=16, topk=24, lens=[1700, 800], max_pages=110, n_split=1,
                                      q_fp8=True, config=dict(BLOCK_N=128, num_warps=4, num_stages=3, TOKENS_M=True,
                                                              PREFETCH=False, KEYS="fp8pv", WAVE=3, MAXNREG=128,
                                                              PV=24))),
    # the one-query epilogue (EPI 1: token sums kept 1-D in the dot's row layout, scalar histogram switches) on the
    # same pair-vector chunks, bf16 and fp8 query; a short row (<= topk groups: its scores go into the histogram)
    ("fp8_page_vector_pair_p16_epi1", dict(b=2, s=1, h=16, ps=16, topk=24, lens=[1700, 150], max_pages=110, n_split=1,
                                           config=dict(BLOCK_N=128, num_warps=4, num_stages=3, TOKENS_M=True,
                                                       PREFETCH=False, KEYS="fp8pv", WAVE=3, MAXNREG=128, PV=24,
                                                       EPI=1))),
    ("fp8_page_vector_p64_epi1_fp8q", dict(b=3, s=1, h=64, ps=64, topk=32, lens=[900, 300, 20], max_pages=12,
                                           q_fp8=True, qscale=True,
                                           config=dict(BLOCK_N=128, num_warps=4, num_stages=3, TOKENS_M=True,
                                                       PREFETCH=False, KEYS="fp8pv", WAVE=3, MAXNREG=128, PV=24,
                                                       EPI=1))),
    ("packed_no_prefetch", dict(b=1, s=2, h=16, ps=64, topk=20, lens=[333], max_pages=6,
                                config=dict(BLOCK_N=64, num_warps=4, num_stages=1, TOKENS_M=True, PREFETCH=False,
                                            KEYS="packed"))),
    # two select programs per row: each walks several tiles of group maxima, the later one finishes the row
    ("decode_select_split2_multi_tile", dict(b=2, s=1, h=16, ps=64, topk=24, lens=[760, 300], max_pages=12,
                                             select_split=2)),
    # S = 6 verify tokens: two score launches (4 + 2 stacked tokens)
    ("mtp6_two_launches", dict(b=2, s=6, h=16, ps=64, topk=24, lens=[130, 40], max_pages=3)),
]

SELECT_CASES = [
    ("select_randn", dict(rows=4, width=900, topk=32, lens=[900, 31, 32, 33], kind="randn")),
    ("select_few_values", dict(rows=3, width=700, topk=40, lens=[700, 300, 0], kind="few_values")),
    ("select_grid_ties", dict(rows=3, width=400, topk=32, lens=[400, 250, 400], kind="grid")),
    ("select_constant", dict(rows=2, width=400, topk=16, lens=[400, 17], kind="constant")),
    ("select_wide_range", dict(rows=2, width=1000, topk=64, lens=[1000, 2000], kind="wide_range")),
    # radix select over all candidates (the non-default SELECT_SEARCH, s3's) on ties and on 60 binades
    ("select_grid_ties_radix", dict(rows=3, width=400, topk=32, lens=[400, 250, 400], kind="grid", search="radix")),
    ("select_wide_range_radix", dict(rows=2, width=1000, topk=64, lens=[1000, 2000], kind="wide_range",
                                     search="radix")),
]

if __name__ == "__main__":
    names = sys.argv[1:]
    for i, (name, kw) in enumerate(INDEXER_CASES):
        if not names or name in names:
            print(json.dumps(run_indexer(name, seed=i, **kw)), flush=True)
    for i, (name, kw) in enumerate(SELECT_CASES):
        if not names or name in names:
            print(json.dumps(run_select(name, seed=100 + i, **kw)), flush=True)
    if not names or "select_paths" in names:
        print(json.dumps(run_select_paths()), flush=True)
    if not names or "select_switches" in names:
        print(json.dumps(run_select_switches()), flush=True)
    if not names or "workspace_state" in names:
        print(json.dumps(run_workspace_state()), flush=True)
    if not names or "sglang_writer_layout" in names:
        print(json.dumps(run_sglang_writer_layout()), flush=True)
