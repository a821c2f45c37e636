"""Max-context independence of the DSA indexer decode step, measured interleaved.

The headline grid of benchmarks/kernels/indexer.py times each (B, max context) once, so at a 4 us step
(actual length 512) one replay hiccup, or the ~0.5 us resolution of CUDA events on a 4-call graph, moves
t(1M)/t(8K) by 5-10%. This script captures `--calls` calls per graph and times the same shapes in `--rounds`
interleaved rounds (every max context once per round, ours and optionally a baseline version of
kernels/indexer.py), and reports per-round and median ratios. fp8 query (SGLang's DSv4 decode path).

Run on the device from the repository root:
    python3 benchmarks/kernels/indexer_max_context.py [--live 512] [--baseline OLD_INDEXER] [--out DIR]
        [--picks-from JSON]

Writes indexer_max_context_<live>.json (device, date, commit, command, every number) to --out, the name of
benchmarks/results/.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
import indexer as BI  # noqa: E402  (the main indexer benchmark: inputs, graph timing, baseline loader)
from results_io import run_info, write_result  # noqa: E402  (this folder, put on the path above)

CONTEXTS = (8192, 131072, 1 << 20)


def cycle(calls: list, n: int) -> list:
    """n calls taken round-robin from `calls` (the input sets of the headline grid, same order)."""
    return [calls[i % len(calls)] for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=64, help="calls captured per CUDA graph (cycling the input sets)")
    ap.add_argument("--live", type=int, default=512, help="actual length of every request (tokens)")
    ap.add_argument("--baseline", default=None,
                    help="another version of kernels/indexer (package folder or single file) to time side by side")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--picks-from", default=None,
                    help="indexer.json of an indexer.py run: use the score config and select switches it picked")
    args = ap.parse_args()
    picks = BI.apply_picks(args.picks_from) if args.picks_from else None
    dev = torch.device("cuda")
    mods = {"ours": None}
    if args.baseline:
        mods["baseline"] = BI.load_baseline(args.baseline)
    pool = BI.make_pool(max(8192, BI.ROT * 64 * triton.cdiv(args.live, BI.PS)), dev, 1)  # ROT input sets at B = 64
    gen = torch.Generator(device=dev).manual_seed(3)
    setups = {(b, m): BI.Setup(b, 1, args.live, m, dev, pool, gen, fp8=True) for b in (16, 64) for m in CONTEXTS}
    times: dict[tuple, list[float]] = {}
    for _ in range(args.rounds):
        for (b, m), st in setups.items():
            for name, mod in mods.items():
                times.setdefault((b, m, name), []).append(BI.time_graph(cycle(st.ours(mod), args.calls), 50, False))
    rows = []
    for b in (16, 64):
        for name in mods:
            med = {m: statistics.median(times[(b, m, name)]) for m in CONTEXTS}
            per_round = [x / y for x, y in zip(times[(b, 1 << 20, name)], times[(b, 8192, name)])]
            rows.append(dict(B=b, kernel=name, live=args.live, median_us={str(m): v for m, v in med.items()},
                             ratio_1m_8k_per_round=per_round, ratio_1m_8k_median=med[1 << 20] / med[8192]))
            print(f"B={b} {name}: " + " ".join(f"{m}: {v:.2f} us" for m, v in med.items())
                  + f"; t(1M)/t(8K) median {med[1 << 20] / med[8192]:.3f}, per round "
                  + str([round(r, 3) for r in per_round]), flush=True)
    if args.out:
        res = dict(run_info(), torch=torch.__version__, triton=triton.__version__, rounds=args.rounds,
                   calls_per_graph=args.calls, picks=picks, rows=rows)
        print("wrote", write_result(args.out, f"indexer_max_context_{args.live}", res))


if __name__ == "__main__":
    main()
