"""``pdserve plan-split``: the split of a GPU budget between prefill and decode that serves a workload best.

    pdserve plan-split --profile deploy/profiles/dsv4-flash-rtxpro6000.json --num-gpus 8 --tp-sizes 1,2,4 \\
        --request-rate 2 --random-input-len 8192 --random-output-len 512 --slo-ttft-ms 3000 --slo-tpot-ms 50 \\
        --output-config split.yaml

Prints one row per candidate split (pd.planner.search), best first, and the pick; ``--output-config`` writes the
pick as a cluster config (``pdserve up FILE``), the other keys taken from ``--base-config`` (default: the
embedded default for a reference-engine profile). Workload flags are ``sglang.bench_serving``'s, so the same
numbers drive ``pdserve bench`` against the deployment the plan picks.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

import yaml

from pd.config import DEFAULT_CONFIG, ConfigError, parse_config
from pd.planner.profile import Profile, ProfileError, load_profile
from pd.planner.search import Candidate, rank_splits
from pd.planner.simulate import SLO, Split
from pd.planner.workload import Workload


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve plan-split", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", required=True, help="a profile JSON (pdserve profile, or written by hand)")
    p.add_argument("--num-gpus", type=int, required=True, help="GPUs to divide between prefill and decode")
    p.add_argument("--tp-sizes", default=None,
                   help="TP sizes to consider, comma-separated (e.g. 1,2,4). Default: every one the profile has.")
    p.add_argument("--request-rate", type=float, required=True, help="requests per second to serve")
    p.add_argument("--num-prompts", type=int, default=500, help="requests per simulated run. Default: 500.")
    p.add_argument("--random-input-len", type=int, default=1024, help="longest prompt, tokens. Default: 1024.")
    p.add_argument("--random-output-len", type=int, default=128, help="longest output, tokens. Default: 128.")
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths are uniform in [len x ratio, len] (bench_serving's random dataset). Default: 0.0.")
    p.add_argument("--random-input-dist", choices=["uniform", "fixed", "lognormal"], default="uniform",
                   help="input lengths: uniform (bench_serving's), fixed, or lognormal of mean --random-input-len "
                        "(as pdserve bench). Default: uniform.")
    p.add_argument("--random-output-dist", choices=["uniform", "fixed", "lognormal"], default="uniform",
                   help="output lengths, as --random-input-dist. Default: uniform.")
    p.add_argument("--random-lognormal-sigma", type=float, default=1.0, help="sigma of lognormal lengths")
    p.add_argument("--arrival-process", choices=["poisson", "constant"], default="poisson",
                   help="arrivals at --request-rate (pdserve bench's flag). Default: poisson (bench_serving's).")
    p.add_argument("--slo-ttft-ms", type=float, required=True, help="TTFT objective per request, ms")
    p.add_argument("--slo-tpot-ms", type=float, required=True, help="TPOT objective per request, ms")
    p.add_argument("--slo-attainment", type=float, default=0.9,
                   help="fraction of requests that must meet both objectives (DistServe's 90%%). Default: 0.9.")
    p.add_argument("--policy", choices=["round_robin", "least_load"], default="round_robin",
                   help="the router's policy for both roles. Default: round_robin (the router's default).")
    p.add_argument("--seed", type=int, default=0, help="seed of the simulated requests. Default: 0.")
    p.add_argument("--output-config", default=None, help="write the picked split as a cluster config YAML here")
    p.add_argument("--base-config", default=None,
                   help="the config whose other keys the written one keeps. Default: the embedded default "
                        "(reference-engine profiles) or SGLang defaults with the profile's model.")
    p.add_argument("--model-path", default=None, help="model_path of the written config. Default: the base "
                   "config's for a reference profile, the profile's model otherwise.")
    p.add_argument("--output-file", default=None, help="write the whole plan (every candidate) as JSON here")
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")
    return p


def _tp_sizes(text: Optional[str], profile: Profile) -> list[int]:
    if text is None:
        return profile.tp_sizes()
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--tp-sizes {text!r}: give comma-separated integers, e.g. 1,2,4") from None
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--tp-sizes {text!r}: every TP size must be >= 1")
    return sizes


def split_config(split: Split, profile: Profile, num_gpus: int, base: Optional[str] = None,
                 model_path: Optional[str] = None) -> dict:
    """The cluster config mapping of ``split``: the base config's keys with both groups' replicas, tp_size and
    the profile's engine_args (after the base group's own), explicit GPU lists renumbered when the base had them.

    Raises:
        ConfigError: the base config cannot be read, or the result is not a valid config.
    """
    if base is None and profile.engine == "reference":
        base = str(DEFAULT_CONFIG)
    if base is not None:
        try:
            data = yaml.safe_load(Path(base).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"{base}: cannot read the base config: {e}") from None
    else:
        data = {"model_path": profile.model, "engine": profile.engine}
    if model_path:
        data["model_path"] = model_path
    data["engine"] = profile.engine
    data.setdefault("cluster", {})["num_gpus"] = num_gpus
    data["cluster"].setdefault("gpus_per_node", max(8, split.prefill_tp, split.decode_tp))
    next_gpu = 0
    for role, replicas, tp in (("prefill", split.prefill_replicas, split.prefill_tp),
                               ("decode", split.decode_replicas, split.decode_tp)):
        group = dict(data.get(role) or {})
        group["replicas"], group["tp_size"] = replicas, tp
        extra = list(group.get("extra_args") or []) + list(profile.entry(tp).engine_args)
        if extra:
            group["extra_args"] = extra
        if group.get("gpus") is not None:  # the base pinned GPUs: keep pinning, one contiguous block per replica
            group["gpus"] = [list(range(next_gpu + i * tp, next_gpu + (i + 1) * tp)) for i in range(replicas)]
        next_gpu += replicas * tp
        data[role] = group
    parse_config(data, "the planned config")  # what load_config will accept
    return data


def render(ranked: list[Candidate], workload: Workload, slo: SLO, attainment: float) -> str:
    """The candidates as a table, best first, then the pick."""
    w = workload
    lines = [f"workload: {w.request_rate:g} req/s {w.arrival_process}, input {w.random_input_dist} "
             f"{w.random_input_len}, output {w.random_output_dist} {w.random_output_len} tokens "
             f"(range ratio {w.random_range_ratio:g}), "
             f"{workload.num_prompts} requests; SLO TTFT <= {1e3 * slo.ttft_s:g} ms, TPOT <= {1e3 * slo.tpot_s:g} ms "
             f"for {100 * attainment:g}% of requests",
             "goodput = highest rate meeting the SLO attainment (DistServe); 'at rate' columns: at the requested rate",
             "",
             f"{'#':>3} {'split':<18} {'GPUs':>4} {'goodput r/s':>11} {'per GPU':>8} {'attain':>7} "
             f"{'good r/s':>8} {'p90 TTFT ms':>11} {'p90 TPOT ms':>11}  serves rate"]
    for i, c in enumerate(ranked, 1):
        s = c.at_rate
        lines.append(f"{i:>3} {c.split.label:<18} {c.split.num_gpus:>4} {c.max_rate:>11.2f} {c.per_gpu:>8.3f} "
                     f"{100 * s['slo_attainment']:>6.1f}% {s['request_goodput']:>8.2f} {s['p90_ttft_ms']:>11.1f} "
                     f"{s['p90_tpot_ms']:>11.2f}  {'yes' if c.meets_rate else 'no'}")
    best = ranked[0]
    verdict = ("serves the requested rate" if best.meets_rate else
               "NO split serves the requested rate at the SLO attainment target: this is the best per GPU")
    lines += ["", f"pick: {best.split.label} ({best.split.num_gpus} GPUs: prefill {best.split.prefill_replicas} x "
                  f"TP{best.split.prefill_tp}, decode {best.split.decode_replicas} x TP{best.split.decode_tp}); "
                  f"goodput {best.max_rate:.2f} req/s, {best.per_gpu:.3f} per GPU; {verdict}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run ``pdserve plan-split``; returns the exit status (2 for bad input, with a message naming the flag)."""
    args = parser().parse_args(argv)
    try:
        profile = load_profile(args.profile)
    except ProfileError as e:
        print(f"pdserve plan-split: --profile: {e}", file=sys.stderr)
        return 2
    if args.num_gpus < 2:
        print("pdserve plan-split: --num-gpus must be >= 2 (one prefill and one decode replica)", file=sys.stderr)
        return 2
    for flag in ("slo_ttft_ms", "slo_tpot_ms"):
        if not getattr(args, flag) > 0:
            print(f"pdserve plan-split: --{flag.replace('_', '-')} must be > 0", file=sys.stderr)
            return 2
    try:
        workload = Workload(args.request_rate, args.num_prompts, args.random_input_len, args.random_output_len,
                            args.random_range_ratio, args.arrival_process, args.seed, args.random_input_dist,
                            args.random_output_dist, args.random_lognormal_sigma)
        slo = SLO(args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
        ranked = rank_splits(profile, args.num_gpus, _tp_sizes(args.tp_sizes, profile), workload, slo,
                             args.slo_attainment, args.policy)
    except (ValueError, ProfileError) as e:
        print(f"pdserve plan-split: {e}", file=sys.stderr)
        return 2
    plan = {"profile": args.profile, "profile_name": profile.name, "num_gpus": args.num_gpus,
            "workload": vars(workload), "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms,
                                                "attainment": args.slo_attainment},
            "policy": args.policy, "pick": ranked[0].row(), "candidates": [c.row() for c in ranked]}
    if args.output_config:
        try:
            cfg = split_config(ranked[0].split, profile, args.num_gpus, args.base_config, args.model_path)
        except ConfigError as e:
            print(f"pdserve plan-split: --output-config: {e}", file=sys.stderr)
            return 2
        best = ranked[0]
        header = (f"# Written by pdserve plan-split from {args.profile} ({profile.name}).\n"
                  f"# Split {best.split.label}: predicted goodput {best.max_rate:.2f} req/s at "
                  f"{100 * args.slo_attainment:g}% SLO attainment (TTFT <= {args.slo_ttft_ms:g} ms, TPOT <= "
                  f"{args.slo_tpot_ms:g} ms) for {args.request_rate:g} req/s, input {args.random_input_dist} "
                  f"{args.random_input_len}, output {args.random_output_dist} {args.random_output_len} tokens.\n")
        Path(args.output_config).write_text(header + yaml.safe_dump(cfg, sort_keys=False))
        plan["output_config"] = args.output_config
    if args.output_file:
        Path(args.output_file).write_text(json.dumps(plan, indent=1) + "\n")
    print(json.dumps(plan, indent=1) if args.json else render(ranked, workload, slo, args.slo_attainment))
    if args.output_config and not args.json:
        print(f"wrote {args.output_config}")
    return 0
