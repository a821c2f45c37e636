"""One DSA indexer decode step for Nsight Compute (the kernels' own counters, not timings).

Runs `--calls` eager calls at B = 16, 32K live, 128K max, fp8 query (the headline shape that misses its target) on
fresh pages per call, after `--warmup` calls that compile the kernels. Profile the last calls, e.g. on the device:

    ncu --clock-control none --kernel-name regex:"_index_scores_kernel|_select_topk_kernel" --launch-skip 6 \
        --launch-count 2 --section SpeedOfLight --section Occupancy --section WarpStateStats --csv \
        python3 benchmarks/kernels/indexer_profile.py
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import indexer as BI  # noqa: E402  (inputs and the kernel module of the main indexer benchmark)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--live", type=int, default=32768)
    ap.add_argument("--max-context", type=int, default=131072)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--calls", type=int, default=2)
    ap.add_argument("--config", default=None, help="score config name (benchmarks/kernels/indexer.py cfg_name); "
                                                   "default: the module's default for the shape")
    ap.add_argument("--picks-from", default=None,
                    help="indexer.json of an indexer.py run: use the score config and select switches it picked")
    args = ap.parse_args()
    if args.picks_from:
        BI.apply_picks(args.picks_from)
    kw = {}
    if args.config:
        by_name = {BI.cfg_name(c): c for c in BI.K.SCORE_CONFIGS}
        if args.config not in by_name:
            raise SystemExit(f"--config: unknown {args.config!r}; known: {sorted(by_name)}")
        kw["config"] = by_name[args.config]
    dev = torch.device("cuda")
    pool = BI.make_pool(BI.ROT * args.batch * args.live // BI.PS, dev, seed=99)
    st = BI.Setup(args.batch, 1, args.live, args.max_context, dev, pool, torch.Generator(device=dev).manual_seed(7),
                  fp8=True)
    calls = st.ours(**kw)
    for i in range(args.warmup + args.calls):
        calls[i % len(calls)]()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
