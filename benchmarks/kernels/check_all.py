"""Device correctness of every kernel's shipped default path at real shapes, in one run (tier 5 of docs/design.md's
testing tiers; run on the GPU machine, not in CI). It times nothing: the per-kernel benchmarks do that.

  python3 benchmarks/kernels/check_all.py --out DIR [--only mxfp4_moe,indexer,sparse_mla] [--deadline SECONDS]

- MXFP4 MoE: the default plans of both prepared sm_90 layouts (the SGLang adapter's choice on sm_90: sm90_tiled, or
  sm90_bits when H or I is not a multiple of 256) at T = 1, 4, 8, 16, 64, 128, 256 against the torch reference,
  int32 and int64 ids, a -1 slot, NaN-poisoned output, each called twice (fold tickets reset), and captured in a
  CUDA graph replayed on fresh inputs, bitwise equal to eager calls (``mxfp4_moe_ab.full_check``); the SGLang
  layout's default plan (sm_120's path) at the same T.
- DSA indexer: ``indexer.correctness`` "core" (decode, MTP, fp8 query, ties, graph replay, select alone) and
  "more" (every score config, MTP S=6, per-token lengths, page 128, topk 2048).
- Sparse-MLA decode: ``sparse_mla_decode.correctness`` (every case: topk 512 / 2048, H 16 / 64 / 128, S 1 / 2 / 4,
  page 64 / 256, -1 indices, topk_length, attn sink, extra cache) and its CUDA-graph replay check.

Writes check_all.json (device, date, commit, versions, command, every case, ok per kernel) and exits 1 when a case
of a shipped path fails (forced non-default candidates of the sparse-MLA benchmark are reported, not counted).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results_io import run_info, write_result  # noqa: E402  (this folder, put on the path above)

KERNELS = ("mxfp4_moe", "indexer", "sparse_mla")
MOE_TS = (1, 4, 8, 16, 64, 128, 256)


def check_mxfp4_moe(dev: torch.device) -> list[dict]:
    """Prepared-layout default plans (full checks) and the SGLang-layout default plan, per T of MOE_TS."""
    import mxfp4_moe as bm
    import mxfp4_moe_ab as ab

    mx = bm.mx
    W = ab.Weights(dev)
    torch.backends.cuda.matmul.allow_tf32 = False
    cases = []
    for t in MOE_TS:
        for lk in ("tiled", "bits"):  # the SGLang adapter's sm_90 layout, and its fallback (H or I not % 256)
            layout = ab.LAYOUTS[lk]
            cases += ab.full_check(W, f"{layout}_default_T{t}", mx, lk, mx.default_config(t * bm.K, layout), ts=(t,))
        x, ids, wts = bm.make_routing(t, dev, seed=3000 + t)
        ids[0, -1] = -1
        ref = bm.fused_moe_mxfp4_reference(x, W.w13, W.s13, W.w2, W.s2, wts, ids, swiglu_limit=bm.LIMIT,
                                           dtype=torch.float32)
        out = torch.full((t, bm.H), float("nan"), dtype=torch.bfloat16, device=dev)
        mx.fused_moe_mxfp4(x, W.w13, W.s13, W.w2, W.s2, wts, ids, swiglu_limit=bm.LIMIT, out=out,
                           max_scale_byte=W.msb)
        torch.cuda.synchronize()
        c = dict(T=t, plan="sglang_layout_default", rel_err=bm.rel(out, ref), nan=bool(torch.isnan(out).any()))
        c["ok"] = c["rel_err"] <= 4e-3 and not c["nan"]
        cases.append(c)
    for c in cases:
        print("mxfp4_moe", c, flush=True)
    return cases


def check_indexer(dev: torch.device, deadline: float) -> list[dict]:
    """The indexer benchmark's "core" and "more" correctness parts (cases past the deadline are skipped)."""
    import indexer as bi

    dl = bi.Deadline(max(1.0, deadline - time.time()))
    return bi.correctness(dev, False, "core", dl) + bi.correctness(dev, False, "more", dl)


def check_sparse_mla(dev: torch.device) -> list[dict]:
    """Every sparse-MLA correctness case and the graph-replay check (FlashMLA not compared here)."""
    import sparse_mla_decode as bs

    return bs.correctness(dev) + [dict(c, name="graph_replay") for c in bs.graph_replay_check(dev)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--only", default=",".join(KERNELS), help="comma-separated subset of " + ", ".join(KERNELS))
    ap.add_argument("--deadline", type=float, default=1e9,
                    help="seconds of wall time; the indexer skips its remaining cases past it")
    args = ap.parse_args()
    only = [k.strip() for k in args.only.split(",") if k.strip()]
    unknown = set(only) - set(KERNELS)
    if unknown:
        ap.error(f"--only: unknown kernel(s) {sorted(unknown)}; known: {', '.join(KERNELS)}")
    t0 = time.time()
    dev = torch.device("cuda")
    res = dict(run_info(), torch=torch.__version__, triton=triton.__version__, cases={}, ok={})
    path = ""
    for k in only:
        t = time.time()
        if k == "mxfp4_moe":
            cases = check_mxfp4_moe(dev)
        elif k == "indexer":
            cases = check_indexer(dev, t0 + args.deadline)
        else:
            cases = check_sparse_mla(dev)
        res["cases"][k] = cases
        res["ok"][k] = bool(cases) and all(c["ok"] for c in cases if not c.get("candidate"))
        res[f"{k}_s"] = round(time.time() - t, 1)
        res["wall_s"] = round(time.time() - t0, 1)
        path = write_result(args.out, "check_all", res)  # after each kernel: a run stopped at its limit keeps it
        print(f"{k}: {len(cases)} cases, ok={res['ok'][k]}, {res[f'{k}_s']} s", flush=True)
    print("all ok:", all(res["ok"].values()), "wrote", path)
    return 0 if all(res["ok"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
