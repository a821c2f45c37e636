"""Device benchmark for pd.kernels.indexer (DSA lightning-indexer decode step: scores + top-512).

  python benchmarks/kernels/indexer.py [--out DIR] [--quick] [--skip-correctness] [--skip-sweep] [--skip-grid]
      [--query fp8|bf16] [--baseline PATH] [--full-sweep] [--sweep-first] [--deadline S]
      [--pick-fp8q-config NAME,NAME,...] [--pick-select]
  TRITON_INTERPRET=1 python benchmarks/kernels/indexer.py --smoke   # CPU: tiny shapes, checks the script only

1. correctness at real shapes against the fp64 torch reference (pd.kernels.indexer_reference): bf16 and fp8
   queries, S = 1/2/4/6, topk 512 and 2048, page 64 and 128, live lengths from 0 to 100K (the streamed group-max
   path), every score config, mass ties; the selection must be exact up to ties (a swap with an unselected
   position is allowed only when the two reference scores differ by less than their fp32 error bounds), and
   ``topk_from_scores`` must return exactly torch.topk's values; a CUDA-graph capture replayed on fresh inputs must
   equal an eager call;
2. decode step time (H = 64, S = 1, topk 512, page 64; query dtype --query, default fp8: what SGLang's DSv4 decode
   passes, see SGLANG_QUERY_NOTE) at actual length 512, 4K, 32K with the block table sized for max context 8K,
   128K, 1M, B = 16 and 64: ours and the naive torch indexer of the anchor in docs/design.md
   (``indexer_reference.dsa_indexer_topk_naive``: one max-context key buffer dequantized to bf16 per call,
   [B*64, 128] x [128, max] bf16 matmul, head weights by a bf16 bmm, masked, torch.topk), each captured in one
   torch.cuda.CUDAGraph (ours: 4 input sets cycled inside the graph so the keys are not served from L2) and timed as
   the median of replays; byte floor = keys read (B * L * 132 B) + logits written and read (B * L * 8 B) at
   4.8 TB/s; the naive numbers are listed next to the anchor's (docs/design.md, actual length 512);
3. a sweep at 32K (max 128K): score configs, splits, select warps / programs per row / threshold search, the two
   kernels timed apart, the other query dtype, MTP verify (S = 2, 4); with --baseline,
   the same main rows for another version of the kernel module (e.g. the committed one) in the same run; with
   --pick-fp8q-config, the named score configs are timed first and the fastest is the fp8-query default of the run,
   and with --pick-select the select switches likewise (SELECT_KNOBS);
4. writes indexer.json (device, date, commit, command, all numbers) and indexer.md to --out, the names of
   benchmarks/results/.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import statistics
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_modules import kernel_module  # noqa: E402  (pd.kernels installed or not)
from results_io import md_header, run_info, write_result  # noqa: E402  (this folder, put on the path above)

K = kernel_module("indexer")
R = kernel_module("indexer_reference")

HBM_BPS = 4.8e12
# which query dtype the headline uses, and why (checked against the pinned SGLang source)
SGLANG_QUERY_NOTE = (
    "Query dtype: SGLang 0.5.23's DeepSeek-V4 decode hands the C4 indexer an fp8 e4m3 query: "
    "`C4Indexer.compute_q` (srt/layers/attention/dsv4/indexer.py) returns `fused_q_indexer_rope_hadamard_quant` "
    "(kernels/ops/attention/dsv4/norm_rope.py: q float8_e4m3fn [T, 64, 128] and fp32 weights [T, 64, 1] that carry "
    "the query's dequantization scale), and `C4IndexerBackendMixin.forward_c4_indexer` passes that q to "
    "`fp8_paged_mqa_logits` (fp8 index-K cache; the FP4 cache path quantizes q to fp4 instead). So the headline "
    "grid uses an fp8 query (weights carry the scale, no separate q_scale); the bf16 query is a variant row.")
H, D, PS, TOPK = 64, 128, 64, 512
ROT = 4
# docs/design.md's naive torch indexer anchor on this H200 (actual length 512): (B, max context) -> us
NAIVE_ANCHOR_US = {(64, 8192): 165, (64, 131072): 1743, (64, 1 << 20): 13257,
                   (16, 8192): 92, (16, 131072): 523, (16, 1 << 20): 3461}


# ------------------------------------------------------------------------------------------------ inputs

def make_pool(n_pages, dev, seed, ps=PS):
    """A random index-key cache of n_pages pages (gaussian keys with per-token magnitude, quantized as SGLang
    does), generated in chunks to bound temporaries."""
    g = torch.Generator(device=dev).manual_seed(seed)
    out = torch.empty(n_pages, ps * R.BYTES_PER_TOKEN, dtype=torch.uint8, device=dev)
    step = max(1, (1 << 20) // ps)
    for p0 in range(0, n_pages, step):
        n = min(step, n_pages - p0)
        k = torch.randn(n * ps, D, device=dev, generator=g) * (0.5 + torch.rand(n * ps, 1, device=dev, generator=g))
        out[p0: p0 + n] = R.quantize_index_k(k, ps)
    return out


def make_tables(b, live, max_ctx, n_pages, dev, gen, ps=PS, sets=1, distinct_offset=0):
    """`sets` block tables [b, max_ctx / ps]: live pages distinct across requests and sets (after
    distinct_offset), the rest point at random pages (never read by our kernel, scanned by the naive one)."""
    max_pages = max_ctx // ps
    live_pages = triton.cdiv(live, ps)
    tabs = []
    for r in range(sets):
        t = torch.randint(0, n_pages, (b, max_pages), device=dev, generator=gen, dtype=torch.int32)
        base = distinct_offset + r * b * live_pages
        t[:, :live_pages] = (base + torch.randperm(b * live_pages, device=dev, generator=gen)
                             .view(b, live_pages)).to(torch.int32)
        tabs.append(t)
    return tabs


def make_queries(b, s, dev, gen, fp8=False, sets=1):
    out = []
    for _ in range(sets):
        q = torch.randn(b, s, H, D, device=dev, generator=gen)
        q = (q * 40).to(torch.float8_e4m3fn) if fp8 else q.to(torch.bfloat16)
        w = torch.randn(b, s, H, device=dev, generator=gen) * H ** -0.5 * D ** -0.5
        out.append((q, w))
    return out


# ------------------------------------------------------------------------------------------------ checks

def check(out, ref, bound, lens, topk):
    """Vectorized version of tests/indexer_interp_cases.check_rows on [R, W] reference scores."""
    out = out.reshape(-1, topk).long()
    r_, w_ = out.shape[0], ref.shape[-1]
    ref = ref.reshape(r_, w_)
    bound = bound.reshape(r_, w_) if bound is not None else torch.zeros_like(ref)
    lens = lens.reshape(-1).long()
    ar = torch.arange(topk, device=out.device)
    short = lens <= topk
    bad = {}
    want_short = torch.where(ar[None, :] < lens[:, None], ar[None, :], -1)
    bad["short"] = int((short & (out != want_short).any(1)).sum())
    long_ = ~short
    o = torch.where(long_[:, None], out, 0)
    bad["range"] = int((long_ & ((o < 0) | (o >= lens[:, None])).any(1)).sum())
    bad["order"] = int((long_ & (o[:, 1:] <= o[:, :-1]).any(1)).sum())  # ascending => distinct
    o = o.clamp(0, w_ - 1)
    sel = torch.zeros(r_, w_, dtype=torch.bool, device=out.device).scatter_(1, o, True)
    live = torch.arange(w_, device=out.device)[None, :] < lens[:, None]
    inf = torch.tensor(float("inf"), dtype=ref.dtype, device=ref.device)
    lo_sel = torch.where(sel & live, ref + bound, inf).amin(1)
    hi_rest = torch.where(~sel & live, ref - bound, -inf).amax(1)
    bad["tie"] = int((long_ & (lo_sel < hi_rest)).sum())
    masked = torch.where(live, ref, -inf)
    kk = min(topk, w_)
    ref_top = masked.topk(kk, dim=1)
    ref_sel = torch.zeros_like(sel).scatter_(1, ref_top.indices, True)
    swaps = int(((ref_sel & ~sel & live).sum(1) * long_).sum())
    return bad, swaps


def _ref_scores(q, w, kc, bt, seq, ps, qs, topk):
    """fp64 reference scores / bounds over the live part of the block table only (the rest is -inf)."""
    s = q.shape[1]
    lens = R.live_lengths(seq, s, bt.shape[1] * ps)
    need = max(1, triton.cdiv(int(lens.max()), ps))
    ref = R.index_scores_ref(q, w, kc, bt[:, :need], seq, ps, qs, torch.float64, chunk=8192)
    bound = R.score_error_bound(q, w, kc, bt[:, :need], ps, qs)
    return ref, bound, lens


class Deadline:
    """Stops optional work past a wall-clock budget so one bounded device call always returns its numbers."""

    def __init__(self, seconds):
        self.end = time.time() + seconds
        self.skipped = []

    def ok(self, what):
        if time.time() < self.end:
            return True
        self.skipped.append(what)
        print("deadline: skipped", what, flush=True)
        return False


def correctness(dev, smoke, part, deadline):
    """part "core" (decode / MTP / fp8 / ties / select-only) or "more" (every config, topk 2048, page 128, S=6,
    per-token lengths)."""
    cases = []
    g = torch.Generator(device=dev).manual_seed(1 if part == "core" else 2)

    def run(name, b, s, lens, max_ctx, topk=TOPK, ps=PS, fp8=False, qscale=False, zero_q=False, config=None):
        if not deadline.ok("correctness " + name):
            return
        n_pages = b * triton.cdiv(max_ctx, ps)
        kc = make_pool(n_pages, dev, seed=len(cases), ps=ps)
        bt = make_tables(b, max_ctx, max_ctx, n_pages, dev, g, ps=ps)[0]
        (q, w), = make_queries(b, s, dev, g, fp8=fp8)
        if zero_q:
            q = torch.zeros_like(q)
        qs = (torch.rand(b, s, H, device=dev, generator=g) + 0.5) if qscale else None
        seq = torch.tensor(lens, dtype=torch.int32, device=dev)
        out = torch.full((b, s, topk), -7, dtype=torch.int32, device=dev)  # poisoned
        K.dsa_indexer_topk(q, w, kc, bt, seq, topk=topk, page_size=ps, out=out, q_scale=qs, config=config)
        torch.cuda.synchronize() if dev.type == "cuda" else None
        ref, bound, ln = _ref_scores(q, w, kc, bt, seq, ps, qs, topk)
        bad, swaps = check(out, ref, bound, ln, topk)
        c = dict(name=name, B=b, S=s, topk=topk, page_size=ps, fp8=fp8, config=config, max_len=int(ln.max()),
                 bad=bad, swaps_vs_torch_topk=swaps, ok=all(v == 0 for v in bad.values()))
        cases.append(c)
        print("correct", c, flush=True)

    if smoke:
        run("smoke", 2, 2, [100, 30], 256, topk=16)
        return cases
    if part == "more":
        for cfg in K.SCORE_CONFIGS:
            run("config_" + cfg_name(cfg), 4, 1,
                [513, 9000, 33333, 70000], 131072, config=cfg)
        run("mtp_s6_two_launches", 4, 6, [600, 5000, 12345, 30000], 32768)
        run("per_token_lengths_2d", 2, 2, [[1000, 999999], [513, 512]], 32768)  # seq_lens [B, S]
        run("page128", 4, 1, [600, 9000, 40000, 1000], 65536, ps=128)
        run("topk2048", 4, 1, [2048, 2049, 50000, 100000], 131072, topk=2048)
        return cases
    lens16 = [0, 1, 511, 512, 513, 700, 4096, 8191, 32768, 65536, 70000, 100000, 131072, 3000, 20000, 50000]
    run("decode_b16_mixed_lengths", 16, 1, lens16, 131072)
    run("mtp_s2", 8, 2, [2, 513, 514, 1000, 9000, 40000, 40001, 77777], 131072)
    run("mtp_s4_fp8_qscale", 4, 4, [515, 3000, 20000, 66000], 131072, fp8=True, qscale=True)
    run("all_ties_zero_q", 2, 1, [40000, 600], 65536, zero_q=True)
    if deadline.ok("correctness graph_replay"):
        # captured in a CUDA graph (the select's programmatic dependent launch becomes a graph edge), replayed on
        # fresh inputs: the same selection as an eager call on those inputs
        b, mc = 16, 65536
        kc = make_pool(b * mc // PS, dev, seed=77)
        bt = make_tables(b, mc, mc, kc.shape[0], dev, g)[0]
        seq = torch.randint(1, mc + 1, (b,), device=dev, generator=g, dtype=torch.int32)
        (q, w), = make_queries(b, 1, dev, g, fp8=True)
        ws = K.indexer_workspace(b, 1, mc, TOPK, device=dev)
        out = torch.empty(b, 1, TOPK, dtype=torch.int32, device=dev)
        K.dsa_indexer_topk(q, w, kc, bt, seq, topk=TOPK, out=out, workspace=ws)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            K.dsa_indexer_topk(q, w, kc, bt, seq, topk=TOPK, out=out, workspace=ws)
        (q2, w2), = make_queries(b, 1, dev, g, fp8=True)
        q.copy_(q2)
        w.copy_(w2)
        seq.copy_(torch.randint(1, mc + 1, (b,), device=dev, generator=g, dtype=torch.int32))
        out.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        eager = K.dsa_indexer_topk(q, w, kc, bt, seq, topk=TOPK, workspace=ws)
        c = dict(name="graph_replay_fresh_inputs", equal_to_eager=bool(torch.equal(out, eager)),
                 ok=bool(torch.equal(out, eager)))
        cases.append(c)
        print("correct", c, flush=True)
        del graph, kc
    if deadline.ok("correctness topk_from_scores_randn"):
        # the select stage alone on exact values: must return torch.topk's values exactly
        sc = torch.randn(64, 50000, device=dev, generator=g)
        ln = torch.randint(0, 50001, (64,), device=dev, generator=g, dtype=torch.int32)
        ln[0], ln[1] = 512, 50000
        out = K.topk_from_scores(sc, ln, TOPK)
        bad, swaps = check(out, sc.double(), None, ln, TOPK)
        vals_ok = True
        for r in range(64):
            L = int(ln[r])
            if L > TOPK:
                vals_ok &= torch.equal(sc[r, out[r].long()].sort().values, sc[r, :L].topk(TOPK).values.sort().values)
        c = dict(name="topk_from_scores_randn", bad=bad, swaps_vs_torch_topk=swaps, values_equal=bool(vals_ok),
                 ok=all(v == 0 for v in bad.values()) and swaps == 0 and bool(vals_ok))
        cases.append(c)
        print("correct", c, flush=True)
    return cases


def naive_check(dev, smoke):
    """The naive baseline computes the indexer (bf16 logits, so near-threshold swaps): on a shared key buffer (block
    table = identity, what the naive one reads) its selection vs the fp64 reference; informational."""
    g = torch.Generator(device=dev).manual_seed(5)
    b, max_ctx, lens = (4, 8192, [600, 3000, 8192, 100]) if not smoke else (2, 256, [200, 20])
    topk = TOPK if not smoke else 16
    kc = make_pool(max_ctx // PS, dev, seed=3)
    bt = torch.arange(max_ctx // PS, device=dev, dtype=torch.int32)[None, :].repeat(b, 1).contiguous()
    (q, w), = make_queries(b, 1, dev, g)
    seq = torch.tensor(lens, dtype=torch.int32, device=dev)
    got = R.dsa_indexer_topk_naive(q, w, kc, seq, topk=topk)
    ours = K.dsa_indexer_topk(q, w, kc, bt, seq, topk=topk)
    ref = R.dsa_indexer_topk_ref(q, w, kc, bt, seq, topk=topk, chunk=4096)
    over = []
    for r in range(b):
        if lens[r] > topk:
            ref_set = set(ref[r, 0].tolist())
            over.append((len(ref_set & set(got[r, 0].tolist())) / topk, len(ref_set & set(ours[r, 0].tolist())) / topk))
    c = dict(naive_overlap_with_fp64_topk=min(o[0] for o in over), ours_overlap_with_fp64_topk=min(o[1] for o in over),
             short_rows_equal=bool(torch.equal(got[seq <= topk], ref[seq <= topk])))
    print("naive check", c, flush=True)
    return c


# ------------------------------------------------------------------------------------------------ timing

def time_graph(calls, reps, smoke):
    """Median microseconds per call: the list of callables is captured in one CUDA graph (warmed up first, so
    compiles happen outside), replayed `reps` times, each replay timed with events; divided by len(calls)."""
    for f in calls:
        f()
    if smoke:
        t0 = time.perf_counter()
        for f in calls:
            f()
        return (time.perf_counter() - t0) * 1e6 / len(calls)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in calls:
            f()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    del graph
    return statistics.median(ts) / len(calls)


def floor_us(b, live):
    return b * live * (R.BYTES_PER_TOKEN + 8) / HBM_BPS * 1e6


class Setup:
    """ROT input sets for one (B, S, live, max_ctx): distinct live pages per set and request."""

    def __init__(self, b, s, live, max_ctx, dev, pool, gen, fp8=False):
        self.b, self.s, self.live, self.max_ctx = b, s, live, max_ctx
        self.kc = pool
        n_pages = pool.shape[0]
        assert ROT * b * triton.cdiv(live, PS) <= n_pages, "pool too small"
        self.tabs = make_tables(b, live, max_ctx, n_pages, dev, gen, sets=ROT)
        self.qw = make_queries(b, s, dev, gen, fp8=fp8, sets=ROT)
        self.seq = torch.full((b,), live, dtype=torch.int32, device=dev)
        self.ws = K.indexer_workspace(b, s, max_ctx, TOPK, device=dev)
        self.out = torch.empty(b, s, TOPK, dtype=torch.int32, device=dev)
        self.base_ws = {}

    def ours(self, mod=None, **kw):
        """ROT calls of dsa_indexer_topk of `mod` (default: the kernel under test; a baseline module gets its own
        workspace, since workspace layouts differ between versions)."""
        mod = mod or K
        if mod is not K and "workspace" not in kw:
            if mod not in self.base_ws:
                self.base_ws[mod] = mod.indexer_workspace(self.b, self.s, self.max_ctx, TOPK, device=self.out.device)
            kw["workspace"] = self.base_ws[mod]
        kw.setdefault("workspace", self.ws)
        if mod is K:
            kw.setdefault("indexer_config", ICFG)
        return [lambda i=i: mod.dsa_indexer_topk(self.qw[i][0], self.qw[i][1], self.kc, self.tabs[i], self.seq,
                                                 topk=TOPK, out=self.out, **kw)
                for i in range(ROT)]

    def naive(self):
        buf = self.kc[: self.max_ctx // PS]  # one key buffer of max-context tokens (the anchor's setup)
        return [lambda: R.dsa_indexer_topk_naive(self.qw[0][0], self.qw[0][1], buf, self.seq, topk=TOPK)]


def _pick_best(dev, pool, smoke, seed, variants, ref):
    """Time the full step (fp8 query, S = 1, 32K live / 128K max, B = 16 and 64) of each variant, in two interleaved
    rounds (the smaller time of each): ``variants`` maps a name to a function of a ``Setup`` giving its calls. A
    variant that fails to build or run gets inf. Returns (best, times): the least t16 + t64 / 4 among the variants
    whose B=64 time is within 1% of variant ``ref``'s (so B=64 does not regress), and times[name][str(B)] in us."""
    g = torch.Generator(device=dev).manual_seed(seed)
    live, max_ctx = (32768, 131072) if not smoke else (300, 512)
    times = {n: {} for n in variants}
    for b in ((16, 64) if not smoke else (2,)):
        st = Setup(b, 1, live, max_ctx, dev, pool, g, fp8=True)
        for _ in range(2):
            for n, calls_of in variants.items():
                try:
                    t = time_graph(calls_of(st), 50, smoke)
                except Exception as e:  # noqa: BLE001  (a variant that fails to build or run loses)
                    print("pick: variant failed", n, repr(e)[:300], flush=True)
                    t = float("inf")
                times[n][str(b)] = min(times[n].get(str(b), t), t)
        del st
    if smoke:
        for n in variants:
            times[n]["16"] = times[n]["64"] = times[n]["2"]
    ok = [n for n in variants if times[n]["64"] <= 1.01 * times[ref]["64"]]
    return min(ok, key=lambda n: times[n]["16"] + times[n]["64"] / 4), times


def pick_fp8q_config(dev, pool, smoke, names):
    """Time the full step with each named score config (``_pick_best``; the first named is the committed default)
    and make the best the module's sm_90 fp8-query default for the rest of the run."""
    by_name = {cfg_name(c): c for c in K.SCORE_CONFIGS}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise SystemExit(f"--pick-fp8q-config: unknown config(s) {unknown}; known: {sorted(by_name)}")
    best, times = _pick_best(dev, pool, smoke, 13, {n: (lambda st, c=by_name[n]: st.ours(config=c)) for n in names},
                             names[0])
    global ICFG
    ICFG = knobbed(fp8q_score_configs={**ICFG.fp8q_score_configs, (True, 1): by_name[best]})
    print("pick", best, times, flush=True)
    return dict(picked=best, times=times)


# IndexerConfig select switches that --pick-select times against each other (all on first; each one off; all off)
SELECT_KNOBS = ("select_gather2d", "select_fast_exact", "select_reads_scores")
# this run's indexer settings, passed to every call of Setup.ours(): the shipped default until a pick replaces it
ICFG = K.DEFAULT_INDEXER_CONFIG


def knobbed(**fields):
    """This run's IndexerConfig with ``fields`` replaced."""
    return dataclasses.replace(ICFG, **fields)


def pick_select(dev, pool, smoke):
    """Time the full step (``_pick_best``; the run's score default) with every select switch on, with each one off,
    and with all off (the reference), and keep the best as the module's setting for the rest of the run."""
    variants = {"all_on": {k: True for k in SELECT_KNOBS}}
    for k in SELECT_KNOBS:
        variants[k.lower() + "_off"] = dict(variants["all_on"], **{k: False})
    variants["all_off"] = {k: False for k in SELECT_KNOBS}
    best, times = _pick_best(dev, pool, smoke, 17, {n: (lambda st, k=knobs: st.ours(indexer_config=knobbed(**k)))
                                                    for n, knobs in variants.items()}, "all_off")
    global ICFG
    ICFG = knobbed(**variants[best])
    print("pick select", best, times, flush=True)
    return dict(picked=best, knobs=variants[best], times=times)


def apply_picks(path):
    """Set the score config and select switches an earlier run picked (its indexer.json) as this process's
    defaults, so a second script (indexer_max_context.py) times what the first one's grid timed."""
    global ICFG
    res = json.load(open(path))
    if res.get("pick"):
        by_name = {cfg_name(c): c for c in K.SCORE_CONFIGS}
        ICFG = knobbed(fp8q_score_configs={**ICFG.fp8q_score_configs, (True, 1): by_name[res["pick"]["picked"]]})
    ICFG = knobbed(**(res.get("pick_select") or {}).get("knobs", {}))
    return {"score_config": (res.get("pick") or {}).get("picked"), **(res.get("pick_select") or {}).get("knobs", {})}


def timing(dev, pool, smoke, quick, deadline, fp8, base=None):
    """The headline grid (query dtype `fp8`: SGLang's DSv4 decode path) for ours, the `base` module (e.g. the committed
    kernel) when given, and the naive torch indexer."""
    g = torch.Generator(device=dev).manual_seed(7)
    rows = []
    grid = [(512, 8192), (512, 131072), (512, 1 << 20), (4096, 8192), (4096, 131072), (4096, 1 << 20),
            (32768, 131072), (32768, 1 << 20)]
    batches = (16, 64)
    if smoke:
        grid, batches = [(20, 256), (300, 512)], (2,)
    for b in batches:
        for live, max_ctx in grid:
            if not deadline.ok(f"timing B={b} live={live} max={max_ctx}"):
                continue
            st = Setup(b, 1, live, max_ctx, dev, pool, g, fp8=fp8)
            row = dict(B=b, live=live, max_ctx=max_ctx, floor_us=floor_us(b, live), query="fp8" if fp8 else "bf16")
            row["ours_us"] = time_graph(st.ours(), 30 if quick else 100, smoke)
            if base is not None:
                row["base_us"] = time_graph(st.ours(base), 30 if quick else 100, smoke)
            if not smoke:
                row["naive_us"] = time_graph(st.naive(), 10, smoke)
            row["ours_over_floor"] = row["ours_us"] / row["floor_us"]
            rows.append(row)
            print("time", row, flush=True)
            del st
    return rows


def cfg_name(c):
    return f"{c['KEYS']}_{'tokM' if c['TOKENS_M'] else 'headM'}_n{c['BLOCK_N']}_w{c['num_warps']}_s{c['num_stages']}" \
        + ("_pf" if c["PREFETCH"] else "") + (f"_wave{c['WAVE']}" if c.get("WAVE") else "") \
        + (f"_pv{c['PV']}" if c.get("PV") else "") \
        + (f"_r{c['MAXNREG']}" if c.get("MAXNREG") not in (None, 128) else "") \
        + (f"_epi{c['EPI']}" if c.get("EPI") else "")


def sweep(dev, pool, smoke, deadline, fp8, base=None, full=False, base_label="base"):
    """At live 32K / max 128K (smoke: tiny), B = 16 and 64: for the headline query dtype (`fp8`) the default, the
    score configs of that dtype's kind (every config with `full`), score splits, select warps, the two kernels timed
    apart; the other query dtype's default and stages; MTP S = 2 / 4; the same rows for the `base` module (the
    committed kernel), side by side."""
    g = torch.Generator(device=dev).manual_seed(11)
    live, max_ctx, batches = (32768, 131072, (16, 64)) if not smoke else (300, 512, (2,))
    res = []
    head, other = ("fp8", "bf16") if fp8 else ("bf16", "fp8")

    def timed(st, name, calls):
        if not deadline.ok(f"sweep B={st.b} S={st.s} {name}"):
            return
        try:
            t = time_graph(calls, 50, smoke)
        except Exception as e:  # noqa: BLE001
            print("variant failed", name, repr(e)[:300], flush=True)
            return
        r = dict(B=st.b, S=st.s, live=live, max_ctx=max_ctx, variant=name, us=t,
                 floor_us=floor_us(st.b, live) + st.b * live * 8 * (st.s - 1) / HBM_BPS * 1e6)
        res.append(r)
        print("sweep", r, flush=True)

    def stages(st, prefix, mod=None):
        # the kernels apart, each on its own workspace: scores-only calls leave their histograms, and a select-only
        # call keeps the histograms of one scores-only call made before it
        mod = mod or K
        ws_s = mod.indexer_workspace(st.b, st.s, max_ctx, TOPK, device=dev)
        timed(st, prefix + "scores_only", st.ours(mod, stages=("scores",), workspace=ws_s))
        ws_t = mod.indexer_workspace(st.b, st.s, max_ctx, TOPK, device=dev)
        st.ours(mod, stages=("scores",), workspace=ws_t)[0]()
        timed(st, prefix + "select_only", st.ours(mod, stages=("select",), workspace=ws_t))

    mods = [("", K)] + ([(base_label + "_", base)] if base is not None else [])
    # first, at both batches, the rows that compare the default with the baseline and its closest alternatives (so a
    # deadline cuts only the exploratory rows after them)
    for b in batches:
        st = Setup(b, 1, live, max_ctx, dev, pool, g, fp8=fp8)
        for pre, mod in mods:
            timed(st, pre + "default", st.ours(mod))
            stages(st, pre, mod)
        # the final select step reading the slices' candidate lists as one tile with their counts
        timed(st, f"select_gather2d_{'off' if ICFG.select_gather2d else 'on'}",
              st.ours(indexer_config=knobbed(select_gather2d=not ICFG.select_gather2d)))
        # the select slices reading their scores whole instead of gathering through the group maxima
        timed(st, f"select_reads_scores_{'off' if ICFG.select_reads_scores else 'on'}",
              st.ours(indexer_config=knobbed(select_reads_scores=not ICFG.select_reads_scores)))
        cfg = ICFG.score_config(True, 1, fp8)
        base_split = K.score_split(b, cfg, K.num_sms(dev))
        # the config's one-wave split also where the default does not use it (B=64)
        one_wave = {max(1, cfg["WAVE"] * K.num_sms(dev) // b)} if cfg.get("WAVE") else set()
        for ns in sorted(({max(1, base_split // 2), max(1, base_split - 2), base_split + 2, base_split * 2}
                          | one_wave) - {base_split}):
            timed(st, f"n_split_{ns}", st.ours(n_split=ns))
        del st
    for b in batches:
        st = Setup(b, 1, live, max_ctx, dev, pool, g, fp8=fp8)
        for c in K.SCORE_CONFIGS:
            if full or c["KEYS"].startswith("fp8") == fp8:
                timed(st, "cfg_" + cfg_name(c), st.ours(config=c))
        for w in K.SELECT_WARPS:
            timed(st, f"select_warps_{w}", st.ours(select_warps=w))
        for ns in range(0, 5):
            timed(st, f"select_split_{1 << ns}", st.ours(select_split=1 << ns))
        # the select's alternatives to the default (fine-histogram search, programmatic dependent launch)
        timed(st, "select_search_radix", st.ours(indexer_config=knobbed(select_search="radix")))
        timed(st, "select_pdl_off", st.ours(indexer_config=knobbed(select_pdl=False)))
        st = Setup(b, 1, live, max_ctx, dev, pool, g, fp8=not fp8)
        for pre, mod in mods:
            timed(st, f"{pre}{other}_query", st.ours(mod))
        stages(st, f"{other}_query_")
        del st
        for s_ in (2, 4):
            st = Setup(b, s_, live, max_ctx, dev, pool, g, fp8=fp8)
            for pre, mod in mods:
                timed(st, f"{pre}mtp_S{s_}", st.ours(mod))
            del st
    return res


# ------------------------------------------------------------------------------------------------ report

def to_markdown(res):
    lines = md_header("DSA indexer decode step", res)
    lines += [f"torch {res['torch']}, triton {res['triton']}. Copy bandwidth measured in this run: "
             f"{res.get('copy_GBps', 0):.0f} GB/s; byte floor = keys read (132 B/position) + logits written and "
             "read (8 B/position) at "
             f"{HBM_BPS / 1e12:.1f} TB/s. H = 64, S = 1, topk 512, page 64, {res.get('query', 'bf16')} query; each "
             "time is the median of CUDA-graph replays (4 input sets per graph for ours).", "",
             SGLANG_QUERY_NOTE, ""]
    has_base = any("base_us" in r for r in res.get("timing", []))
    base_col = f" {res.get('baseline_label', 'base')} (same run) us |" if has_base else ""
    lines += ["| B | actual length | max context | ours us |" + base_col
              + " naive torch us | naive / ours | floor us | ours / floor |",
              "|---|---|---|---|" + ("---|" if has_base else "") + "---|---|---|---|"]
    for r in res.get("timing", []):
        n = r.get("naive_us", float("nan"))
        bc = f" {r.get('base_us', float('nan')):.1f} |" if has_base else ""
        lines.append(f"| {r['B']} | {r['live']} | {r['max_ctx']} | {r['ours_us']:.1f} |{bc} {n:.1f} | "
                     f"{n / r['ours_us']:.1f}x | {r['floor_us']:.1f} | {r['ours_over_floor']:.2f} |")
    naive = [r for r in res.get("timing", []) if "naive_us" in r and (r["B"], r["max_ctx"]) in NAIVE_ANCHOR_US
             and r["live"] == 512]
    if naive:
        lines += ["", "Naive baseline next to docs/design.md's anchor (same method, same H200 kind; actual length "
                  "512):", "",
                  "| B | max context | naive here us | anchor us | here / anchor |", "|---|---|---|---|---|"]
        for r in naive:
            a = NAIVE_ANCHOR_US[(r["B"], r["max_ctx"])]
            lines.append(f"| {r['B']} | {r['max_ctx']} | {r['naive_us']:.0f} | {a} | {r['naive_us'] / a:.2f} |")
    if res.get("naive_check"):
        c = res["naive_check"]
        lines += ["", f"Naive sanity (shared 8K key buffer, 512 of up to 8192): its top-512 overlaps the fp64 "
                      f"reference's by >= {c['naive_overlap_with_fp64_topk']:.3f} (bf16 logits), ours by >= "
                      f"{c['ours_overlap_with_fp64_topk']:.3f}; short rows equal: {c['short_rows_equal']}."]
    lines += ["", "Targets (issue 8):", ""]
    for (b, live, mc), t in sorted({(r["B"], r["live"], r["max_ctx"]): r for r in res.get("timing", [])}.items()):
        if live == 32768 and mc == 131072:
            lines.append(f"- B={b}, actual 32K: {t['ours_us']:.1f} us = {t['ours_over_floor']:.2f}x the byte floor "
                         f"(target <= 2x: {2 * t['floor_us']:.1f} us) -> "
                         f"{'met' if t['ours_over_floor'] <= 2 else 'NOT met'}")
    lines += ["", "Max-context independence (ours, equal actual length; target t(1M) / t(8K) <= 1.05):", ""]
    by = {(r["B"], r["live"], r["max_ctx"]): r["ours_us"] for r in res.get("timing", [])}
    for (b, live, mc), t in sorted(by.items()):
        if mc == 1 << 20:
            base = by.get((b, live, 8192)) or by.get((b, live, 131072))
            base_mc = 8192 if (b, live, 8192) in by else 131072
            if base:
                lines.append(f"- B={b}, actual {live}: t(1M) / t({base_mc // 1024}K) = {t / base:.3f}")
    if res.get("sweep"):
        lines += ["", f"Variants at actual 32K, max 128K ({res.get('query', 'bf16')} query unless the name says "
                  f"otherwise; {res.get('baseline_label', 'base')}_*: the --baseline kernel in the same run; "
                  "default score configs, bf16 query: "
                  + ", ".join(f"{'sm90' if k[0] else 'sm120'} S{k[1]} {cfg_name(c)}"
                              for k, c in ICFG.score_configs.items()) + "; fp8 query: "
                  + ", ".join(f"{'sm90' if k[0] else 'sm120'} S{k[1]} {cfg_name(c)}"
                              for k, c in ICFG.fp8q_score_configs.items()) + "):", "",
                  "| B | S | variant | us | floor us |", "|---|---|---|---|---|"]
        for r in res["sweep"]:
            lines.append(f"| {r['B']} | {r['S']} | {r['variant']} | {r['us']:.1f} | {r['floor_us']:.1f} |")
    if res.get("pick"):
        p = res["pick"]
        lines += ["", f"fp8-query score config (sm_90, S = 1) picked in this run before the grid (full step at 32K / "
                      f"128K; the least B=16 time + B=64 time / 4 among those within 1% of the first at B=64): "
                      f"**{p['picked']}**", "", "| config | B=16 us | B=64 us |", "|---|---|---|"]
        for name, t in p["times"].items():
            lines.append(f"| {name} | {t['16']:.1f} | {t['64']:.1f} |")
    if res.get("pick_select"):
        p = res["pick_select"]
        lines += ["", f"Select switches ({', '.join(SELECT_KNOBS)}) picked in this run before the grid (same rule, "
                      f"against all off): **{p['picked']}**", "", "| variant | B=16 us | B=64 us |",
                  "|---|---|---|"]
        for name, t in p["times"].items():
            lines.append(f"| {name} | {t['16']:.1f} | {t['64']:.1f} |")
    if res.get("correctness"):
        ok = sum(c["ok"] for c in res["correctness"])
        lines += ["", f"Correctness: {ok}/{len(res['correctness'])} cases exact up to ties (fp64 reference)."]
    return lines


def copy_gbps(dev) -> float:
    """Device-to-device copy bandwidth of a 1 GiB buffer, GB/s (read + write)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() / (ms * 1e-3) / 1e9


def load_baseline(path):
    """Another version of kernels/indexer (the package folder, or the single file of older trees), loaded as a
    sibling of the kernel package (its relative imports resolve to the same package)."""
    pkg = K.__name__.rsplit(".", 1)[0]
    name = pkg + "._indexer_baseline"
    if os.path.isdir(path):
        spec = importlib.util.spec_from_file_location(name, os.path.join(path, "__init__.py"),
                                                      submodule_search_locations=[path])
    else:
        spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    ap.add_argument("--skip-correctness", action="store_true")
    ap.add_argument("--skip-sweep", action="store_true")
    ap.add_argument("--skip-grid", action="store_true", help="no headline grid (exploration runs)")
    ap.add_argument("--pick-select", action="store_true",
                    help="after any score-config pick, time the select switches (SELECT_KNOBS) and keep the best")
    ap.add_argument("--sweep-first", action="store_true", help="run the config sweep before the timing grid")
    ap.add_argument("--deadline", type=float, default=1e9, help="seconds of wall time for optional work")
    ap.add_argument("--query", choices=("fp8", "bf16"), default="fp8",
                    help="query dtype of the headline grid (fp8: what SGLang's DSv4 decode passes)")
    ap.add_argument("--baseline", default=None,
                    help="another version of kernels/indexer (the package folder, or the single file of older "
                         "trees; e.g. the committed one) timed side by side")
    ap.add_argument("--full-sweep", action="store_true", help="every score config, not only the query dtype's kind")
    ap.add_argument("--pick-fp8q-config", default=None,
                    help="comma-separated score config names (cfg_name; the committed default first): time them "
                         "first and use the fastest as the sm_90 fp8-query default for the whole run")
    args = ap.parse_args()
    deadline = Deadline(args.deadline)
    smoke = args.smoke
    dev = torch.device("cpu" if smoke else "cuda")
    t0 = time.time()
    res = dict(run_info(device=None if not smoke else "cpu (interpreter smoke run)"), torch=torch.__version__,
               triton=triton.__version__, hbm_floor_bps=HBM_BPS, query=args.query)
    if not smoke:
        res["copy_GBps"] = copy_gbps(dev)

    def save():  # after every section, so a run cut short still returns what it measured
        res["wall_s"] = time.time() - t0
        res["skipped_by_deadline"] = deadline.skipped
        if "correctness" in res:
            res["correct_all_ok"] = all(c["ok"] for c in res["correctness"])
        write_result(args.out, "indexer", res, to_markdown(res))

    # one pool for all timings: 4 sets x B=64 x 32K live tokens of distinct pages (1.1 GB); the naive baseline reads
    # its first max-context tokens as its key buffer
    pool = make_pool(ROT * 64 * 32768 // PS if not smoke else 64, dev, seed=99)
    fp8 = args.query == "fp8"
    base = load_baseline(args.baseline) if args.baseline else None
    base_label = "base"
    if base is not None:
        res["baseline"] = args.baseline
        base_label = os.path.basename(args.baseline).replace("_indexer_", "").replace(".py", "").strip("_") or "base"
        res["baseline_label"] = base_label
    if args.pick_fp8q_config:  # first, so the correctness cases below check the picked default
        res["pick"] = pick_fp8q_config(dev, pool, smoke, args.pick_fp8q_config.split(","))
        save()
    if args.pick_select:
        res["pick_select"] = pick_select(dev, pool, smoke)
        save()
    if not args.skip_correctness:
        res["correctness"] = correctness(dev, smoke, "core", deadline)
        res["naive_check"] = naive_check(dev, smoke)
        save()
    if not smoke:
        torch.cuda.empty_cache()
    if args.sweep_first and not args.skip_sweep:
        res["sweep"] = sweep(dev, pool, smoke, deadline, fp8, base, args.full_sweep, base_label)
        save()
    if not args.skip_grid:
        res["timing"] = timing(dev, pool, smoke, args.quick, deadline, fp8, base)
        save()
    if not args.skip_sweep and not args.sweep_first:
        res["sweep"] = sweep(dev, pool, smoke, deadline, fp8, base, args.full_sweep, base_label)
        save()
    if not args.skip_correctness and not smoke:
        del pool
        torch.cuda.empty_cache()
        res["correctness"] += correctness(dev, smoke, "more", deadline)
    save()
    print("\n".join(to_markdown(res)))
    print("correctness ok:", res.get("correct_all_ok"), " wall", round(res["wall_s"]), "s; wrote",
          os.path.join(args.out, "indexer.{json,md}"))


if __name__ == "__main__":
    main()
