"""The P:D planner checked against measurements on the embedded default (reference engines, builtin:tiny).

What is done
------------
1. Profile once (``pdserve profile``, the user's path): at TP 1 and TP 2 -- a reference engine with
   ``--cpu-threads 1`` / ``2``, the analogue of a GPU count on this CPU machine -- a null engine for prefill and
   decode costs and a prefill + decode pair behind ``pdserve router`` for the KV transfer and the decode's KV
   load; ``--host-cores 2``: every engine of a deployment shares this machine's two cores.
2. For two workloads (prefill-heavy: long prompts, a few output tokens; decode-heavy: short prompts, long
   outputs) and every split of a 3-"GPU" budget (2P1D, 1P2D, 1P(TP2)1D, 1P1D(TP2)): predict with the
   simulator (pd.planner.simulate) and measure with ``pdserve bench`` (pd.bench.run_bench) through a router
   over that split's engines, started directly (``pdserve engine`` + ``pdserve router``, no Ray), at a sweep of
   request rates centred on the predicted goodput (extended until the measured attainment crosses the target).
3. Goodput, DistServe's: the highest request rate whose SLO attainment (TTFT and TPOT both met) is >= 90%.
   Measured and predicted alike are read off the same sweep rates, interpolating linearly between the two rates
   that straddle the target (pdserve bench's own ``max_request_rate_meeting_slo``, which takes the highest
   passing rate as it is, is kept too); the planner's own rate search is reported beside them.

The machine is shared with other work, which takes cores the engines would have. Each rate's run records the
cores that processes other than its engines and router used (others, and this script's own load generator); the
prediction the targets are checked on gives the model that reading as ``host.background_cores`` -- an input the
model takes, measured by the CPU counters, not from the goodput. The prediction for an idle machine is reported
beside it.

Targets: the planner ranks the splits as measured (per workload), and predicted goodput is within 25% of
measured for every split.

The machine is shared: before each measurement the script waits (up to ``--quiet-wait`` s) until other
processes use under ``--quiet-cores`` cores, and it records the CPU that others, its engines and router, and
its own client used during each sweep.

Reproduce
---------
    .venv/bin/python benchmarks/plan_split_validation.py           # writes benchmarks/results/plan_split_*.{json,md}
    .venv/bin/python benchmarks/plan_split_validation.py --quick   # fewer requests and rates
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from cpu_share import CpuMeter, wait_quiet
from kv_transfer import git_commit, machine

from pd.bench import BenchConfig, run_bench
from pd.cluster.procs import LoggedGroup
from pd.planner.profile import load_profile
from pd.planner.simulate import SLO, Split, max_goodput_rate, simulate
from pd.planner.workload import Workload
from pd.util.ports import free_ports
from pd.util.wait import wait_until

REPO = Path(__file__).resolve().parent.parent
TARGET_ERR = 0.25
ATTAINMENT = 0.9
SPLITS = [Split(2, 1, 1, 1), Split(1, 1, 2, 1), Split(1, 2, 1, 1), Split(1, 1, 1, 2)]
WORKLOADS = {
    # long prompts, a few output tokens: prefill-bound
    "prefill-heavy": {"random_input_len": 1536, "random_output_len": 8, "random_range_ratio": 0.5,
                      "slo_ttft_ms": 250.0, "slo_tpot_ms": 40.0, "num_prompts": 200},
    # short prompts, long outputs: decode-bound
    "decode-heavy": {"random_input_len": 128, "random_output_len": 192, "random_range_ratio": 0.5,
                     "slo_ttft_ms": 250.0, "slo_tpot_ms": 30.0, "num_prompts": 100},
}
SWEEP = (0.6, 0.8, 1.0, 1.2, 1.45)  # x the predicted goodput


# ---- engines ------------------------------------------------------------------------------------------------------

class Stack:
    """Reference engines of a split (``--cpu-threads`` = TP size) behind one ``pdserve router``; optionally a
    null engine too (profiling). Every process is ours, stopped by its process group."""

    def __init__(self, split: Split, logs: Path, null_tp: int | None = None):
        py = [sys.executable, "-m", "pd.cli"]
        self.procs: list[LoggedGroup] = []
        self.prefill_urls, self.decode_urls = [], []
        router_args = []
        for i in range(split.prefill_replicas):
            port, bport = free_ports(2)
            self._start(f"prefill{i}", [*py, "engine", "--disaggregation-mode", "prefill", "--port", str(port),
                                        "--disaggregation-bootstrap-port", str(bport), "--cpu-threads",
                                        str(split.prefill_tp)], logs)
            self.prefill_urls.append(f"http://127.0.0.1:{port}")
            router_args += ["--prefill", self.prefill_urls[-1], str(bport)]
        for i in range(split.decode_replicas):
            (port,) = free_ports(1)
            self._start(f"decode{i}", [*py, "engine", "--disaggregation-mode", "decode", "--port", str(port),
                                       "--cpu-threads", str(split.decode_tp)], logs)
            self.decode_urls.append(f"http://127.0.0.1:{port}")
            router_args += ["--decode", self.decode_urls[-1]]
        self.null_url = None
        if null_tp is not None:
            (port,) = free_ports(1)
            self._start("null", [*py, "engine", "--port", str(port), "--cpu-threads", str(null_tp)], logs)
            self.null_url = f"http://127.0.0.1:{port}"
        (port,) = free_ports(1)
        self._start("router", [*py, "router", "--port", str(port), "--policy", "round_robin", *router_args], logs)
        self.url = f"http://127.0.0.1:{port}"

    def _start(self, name: str, argv: list[str], logs: Path) -> None:
        env = dict(os.environ, MC_FORCE_TCP="1", PYTHONUNBUFFERED="1")
        self.procs.append(LoggedGroup(name, argv, logs / f"{name}-{len(self.procs)}.log", env=env))

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def ready(self, timeout: float = 240) -> None:
        urls = [self.url, *self.prefill_urls, *self.decode_urls] + ([self.null_url] if self.null_url else [])

        def up() -> bool:
            for p in self.procs:
                if not p.alive():
                    raise RuntimeError(f"{p.name} exited:\n{p.tail()}")
            return all(httpx.get(u + "/health", timeout=5, trust_env=False).status_code == 200 for u in urls)

        wait_until(up, timeout, interval=0.5, what="every engine and the router healthy", retry=(httpx.HTTPError,))

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()


# ---- goodput from a sweep ------------------------------------------------------------------------------------------

def crossing(rates: list[float], attainments: list[float], target: float = ATTAINMENT) -> dict:
    """The rate where attainment falls through ``target``, interpolated linearly between the highest passing rate
    and the next (failing) one: ``{"rate", "bracketed"}``; ``bracketed`` False when the sweep does not straddle
    it (rate = the highest passing rate, or 0 when none passes)."""
    pts = sorted(zip(rates, attainments))
    passing = [i for i, (_, a) in enumerate(pts) if a >= target]
    if not passing:
        return {"rate": 0.0, "bracketed": False}
    i = max(passing)
    if i == len(pts) - 1:
        return {"rate": pts[i][0], "bracketed": False}
    (r0, a0), (r1, a1) = pts[i], pts[i + 1]
    return {"rate": r0 + (a0 - target) * (r1 - r0) / (a0 - a1), "bracketed": True}


def predict_sweep(profile, split: Split, w: Workload, slo: SLO, rates: list[float],
                  background: list[float] | None = None) -> list[dict]:
    """Simulated results at each rate; ``background``: the cores others took during each measured run, given to
    the model as ``host.background_cores`` (None: an otherwise idle machine)."""
    out = []
    for i, r in enumerate(rates):
        prof = profile
        if background is not None and profile.host is not None:
            prof = profile.model_copy(update={"host": profile.host.model_copy(
                update={"background_cores": background[i]})})
        s = simulate(prof, split, w.at_rate(r)).summary(slo)
        out.append({"request_rate": r, "slo_attainment": s["slo_attainment"], "request_goodput": s["request_goodput"],
                    "median_ttft_ms": s["median_ttft_ms"], "p90_ttft_ms": s["p90_ttft_ms"],
                    "median_tpot_ms": s["median_tpot_ms"], "p90_tpot_ms": s["p90_tpot_ms"],
                    "stages_ms": s["stages_ms"]})
    return out


def measure_sweep(url: str, wl: dict, rates: list[float], seed: int) -> dict:
    cfg = BenchConfig(base_url=url, backend="sglang", dataset_name="random", tokenize_prompt=True,
                      random_input_len=wl["random_input_len"], random_output_len=wl["random_output_len"],
                      random_range_ratio=wl["random_range_ratio"], num_prompts=wl["num_prompts"],
                      request_rate=tuple(rates), seed=seed, slo_ttft_ms=wl["slo_ttft_ms"],
                      slo_tpot_ms=wl["slo_tpot_ms"], slo_attainment_target=ATTAINMENT, disable_tqdm=True,
                      request_timeout_secs=300.0, warmup_requests=2)
    return run_bench(cfg, quiet=True)


KEEP = ("request_rate", "completed", "failed", "duration", "request_throughput", "request_goodput", "slo_attainment",
        "slo_attainment_by_metric", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p90_tpot_ms",
        "p99_tpot_ms", "median_itl_ms", "stages")


def validate_split(profile, split: Split, name: str, wl: dict, args, logs: Path) -> dict:
    w = Workload(1.0, wl["num_prompts"], wl["random_input_len"], wl["random_output_len"], wl["random_range_ratio"],
                 seed=args.seed)
    slo = SLO(wl["slo_ttft_ms"] / 1e3, wl["slo_tpot_ms"] / 1e3)
    planner_rate = max_goodput_rate(profile, split, w, slo, ATTAINMENT)
    rates = [round(planner_rate * f, 3) for f in args.sweep]
    stack = Stack(split, logs)
    runs = []
    try:
        stack.ready()
        quiet = wait_quiet(stack.pids, args.quiet_cores, args.quiet_wait)
        for _ in range(3):
            for rate in rates:  # one bench run per rate, so each has its own CPU reading
                meter = CpuMeter(stack.pids)
                res = measure_sweep(stack.url, wl, [rate], args.seed)
                run = {k: res["runs"][0].get(k) for k in KEEP}
                run["cpu"] = meter.read()
                runs.append(run)
            att = {r["request_rate"]: r["slo_attainment"] for r in runs}
            top, low = max(att), min(att)
            if att[top] >= ATTAINMENT:  # not yet past the knee: go higher
                rates = [round(top * 1.3, 3), round(top * 1.7, 3)]
            elif att[low] < ATTAINMENT:  # even the lowest misses: go lower
                rates = [round(low * 0.6, 3), round(low * 0.35, 3)]
            else:
                break
            print(f"  {split.label}: extending the sweep to {rates}", flush=True)
    finally:
        stack.stop()
    return score_split(profile, split, name, wl, runs, quiet, args.seed)


def score_split(profile, split: Split, name: str, wl: dict, runs: list[dict], quiet: dict, seed: int) -> dict:
    """Predictions for the measured rates of ``runs`` and the comparison (module docstring, step 3)."""
    w = Workload(1.0, wl["num_prompts"], wl["random_input_len"], wl["random_output_len"], wl["random_range_ratio"],
                 seed=seed)
    slo = SLO(wl["slo_ttft_ms"] / 1e3, wl["slo_tpot_ms"] / 1e3)
    planner_rate = max_goodput_rate(profile, split, w, slo, ATTAINMENT)
    runs.sort(key=lambda r: r["request_rate"])
    rates = [r["request_rate"] for r in runs]
    # what others (and this script's own client) took of the machine during each run
    background = [r["cpu"]["others_cores"] + r["cpu"]["client_cores"] for r in runs]
    pred = predict_sweep(profile, split, w, slo, rates, background)
    nominal = predict_sweep(profile, split, w, slo, rates)
    meas_x = crossing(rates, [r["slo_attainment"] for r in runs])
    pred_x = crossing(rates, [p["slo_attainment"] for p in pred])
    nom_x = crossing(rates, [p["slo_attainment"] for p in nominal])
    passing = [r["request_rate"] for r in runs if r["slo_attainment"] >= ATTAINMENT]

    def rel(x: dict) -> float | None:
        return (x["rate"] - meas_x["rate"]) / meas_x["rate"] if meas_x["rate"] > 0 else None

    err = rel(pred_x)
    print(f"  {name} {split.label}: measured {meas_x['rate']:.2f} req/s, predicted {pred_x['rate']:.2f} with the "
          f"measured background load, {nom_x['rate']:.2f} on an idle machine (planner search {planner_rate:.2f})",
          flush=True)
    return {"split": split.label, "prefill": [split.prefill_replicas, split.prefill_tp],
            "decode": [split.decode_replicas, split.decode_tp], "planner_max_rate": planner_rate,
            "measured_goodput": meas_x, "predicted_goodput": pred_x, "error": err,
            "predicted_goodput_idle_machine": nom_x, "error_idle_machine": rel(nom_x),
            "bench_max_request_rate_meeting_slo": max(passing) if passing else None,
            "background_cores": background, "measured": runs, "predicted": pred, "predicted_idle_machine": nominal,
            "quiet_check": quiet}


def profile_once(args, logs: Path, out: Path) -> Path:
    """Run ``pdserve profile`` at TP 1 and 2 into ``out`` (module docstring, step 1)."""
    if out.exists():
        out.unlink()
    for tp in (1, 2):
        stack = Stack(Split(1, tp, 1, tp), logs, null_tp=tp)
        try:
            stack.ready()
            q = wait_quiet(stack.pids, args.quiet_cores, args.quiet_wait)
            print(f"profiling TP {tp} (others using {q['others_cores']:.2f} cores)", flush=True)
            cmd = [sys.executable, "-m", "pd.cli", "profile", "--url", stack.null_url, "--tp-size", str(tp),
                   "--pd-url", stack.url, "--prefill-url", stack.prefill_urls[0], "--decode-url", stack.decode_urls[0],
                   "--host-cores", "2", "--output", str(out), "--repeats", str(args.profile_repeats),
                   "--prompt-lens", "16,128,512,1024,1536", "--decode-contexts", "16,128,512",
                   "--decode-batch-sizes", "1,2,4,8,16", "--decode-steps", "64",
                   "--name", "builtin:tiny, reference engines, --cpu-threads = TP size",
                   "--hardware", f"{machine()['cpu_model']}, {machine()['cpu_cores']} cores, shared"]
            subprocess.run(cmd, check=True, timeout=900)
        finally:
            stack.stop()
    return out


def ranks(entries: list[dict], key) -> list[str]:
    return [e["split"] for e in sorted(entries, key=key, reverse=True)]


def concordance(entries: list[dict], tie: float) -> dict:
    """Pairs of splits the planner orders as measured; a pair whose measured goodputs are within ``tie``
    (relative) of each other is a tie either order matches."""
    agree = disagree = ties = 0
    bad = []
    for i, a in enumerate(entries):
        for b in entries[i + 1:]:
            ma, mb = a["measured_goodput"]["rate"], b["measured_goodput"]["rate"]
            pa, pb = a["predicted_goodput"]["rate"], b["predicted_goodput"]["rate"]
            if abs(ma - mb) <= tie * max(ma, mb):
                ties += 1
            elif (ma - mb) * (pa - pb) > 0:
                agree += 1
            else:
                disagree += 1
                bad.append(f"{a['split']} vs {b['split']}")
    return {"agree": agree, "disagree": disagree, "ties": ties, "tie_tolerance": tie, "discordant": bad}


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = ["# P:D planner vs measurement (embedded default: reference engines, builtin:tiny)", "",
             f"- Device: {m['cpu_model']}, {m['cpu_cores']} cores, {m['mem_gib']} GiB, no GPU; shared with other work",
             f"- Date: {report['started_utc']} ({report['wall_s']:.0f} s)",
             f"- Measured at commit {report['commit']}",
             f"- Command: `{report['command']}`",
             "- Profile: [plan_split_profile.json](plan_split_profile.json) (`pdserve profile`, TP 1 and 2 = "
             "`--cpu-threads` 1 and 2, `--host-cores 2`)",
             "- Budget: 3 \"GPUs\" (engine threads); measured with `pdserve bench` through `pdserve router` "
             "(round_robin), predicted with `pd.planner.simulate` on the same rates", "",
             f"Headline: {report['headline']}", ""]
    for name, wl in report["workloads"].items():
        s = wl["settings"]
        lines += [f"## {name}: input uniform [{int(s['random_input_len'] * s['random_range_ratio'])}, "
                  f"{s['random_input_len']}], output [{int(s['random_output_len'] * s['random_range_ratio'])}, "
                  f"{s['random_output_len']}] tokens, {s['num_prompts']} requests per rate; SLO TTFT <= "
                  f"{s['slo_ttft_ms']:g} ms, TPOT <= {s['slo_tpot_ms']:g} ms, {100 * ATTAINMENT:g}% attainment", "",
                  "| split | measured goodput req/s | predicted (same rates, measured background) | error | planner "
                  "search | bench max passing rate | rates measured | background cores (others + client) | "
                  "predicted on an idle machine |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for e in wl["splits"]:
            err = f"{100 * e['error']:+.1f}%" if e["error"] is not None else "-"
            bg = e["background_cores"]
            mk = "" if e["measured_goodput"]["bracketed"] else " (not bracketed)"
            swept = ", ".join(f"{r['request_rate']:g}" for r in e["measured"])
            lines.append(f"| {e['split']} | {e['measured_goodput']['rate']:.2f}{mk} | "
                         f"{e['predicted_goodput']['rate']:.2f} | {err} | {e['planner_max_rate']:.2f} | "
                         f"{e['bench_max_request_rate_meeting_slo']} | {swept} | "
                         f"{min(bg):.2f}-{max(bg):.2f} | {e['predicted_goodput_idle_machine']['rate']:.2f} |")
        c = wl["concordance"]
        lines += ["", f"Ranking measured: {' > '.join(wl['rank_measured'])}; predicted: "
                      f"{' > '.join(wl['rank_predicted'])}; pairs ordered alike {c['agree']}, opposite "
                      f"{c['disagree']}{' (' + ', '.join(c['discordant']) + ')' if c['discordant'] else ''}, "
                      f"ties (measured within {100 * c['tie_tolerance']:g}%) {c['ties']}.", "",
                  "Per rate (measured / predicted attainment, p90 TTFT ms, p90 TPOT ms):", ""]
        for e in wl["splits"]:
            cells = [f"{m_['request_rate']:g}: {100 * m_['slo_attainment']:.0f}/{100 * p['slo_attainment']:.0f}%, "
                     f"{m_['p90_ttft_ms']:.0f}/{p['p90_ttft_ms']:.0f}, {m_['p90_tpot_ms']:.1f}/{p['p90_tpot_ms']:.1f}"
                     for m_, p in zip(e["measured"], e["predicted"])]
            lines.append(f"- {e['split']}: " + "; ".join(cells))
        lines.append("")
    lines += ["## Reading it", "", report["notes"], ""]
    return "\n".join(lines)


def main(args) -> dict:
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    t0 = time.perf_counter()
    logs = Path(tempfile.mkdtemp(prefix="pdserve-plan-validation-"))
    prof_path = args.out / "plan_split_profile.json"
    if not args.reuse_profile and not args.repredict:
        profile_once(args, logs, prof_path)
    profile = load_profile(prof_path)
    old = json.loads((args.out / "plan_split_validation.json").read_text()) if args.repredict else None
    workloads = {}
    for name, wl in WORKLOADS.items():
        if args.workloads and name not in args.workloads:
            continue
        wl = dict(wl)
        if args.quick:
            wl["num_prompts"] = max(30, wl["num_prompts"] // 3)
        print(f"workload {name}", flush=True)
        if old is not None:  # the same measurements, predicted again by the model as it is now
            wl = old["workloads"][name]["settings"]
            by_label = {e["split"]: e for e in old["workloads"][name]["splits"]}
            entries = [score_split(profile, s, name, wl, by_label[s.label]["measured"],
                                   by_label[s.label]["quiet_check"], args.seed) for s in SPLITS if s.label in by_label]
        else:
            entries = [validate_split(profile, s, name, wl, args, logs) for s in SPLITS
                       if not args.splits or s.label in args.splits]
        workloads[name] = {
            "settings": wl, "splits": entries,
            "rank_measured": ranks(entries, lambda e: e["measured_goodput"]["rate"]),
            "rank_predicted": ranks(entries, lambda e: e["predicted_goodput"]["rate"]),
            "concordance": concordance(entries, args.tie),
        }
    errs = [abs(e["error"]) for w in workloads.values() for e in w["splits"] if e["error"] is not None]
    within = sum(x <= TARGET_ERR for x in errs)
    rank_ok = all(w["concordance"]["disagree"] == 0 for w in workloads.values())
    headline = (f"ranking {'as measured' if rank_ok else 'NOT as measured'} in both workloads (ties within "
                f"{100 * args.tie:g}% aside); predicted goodput within {100 * TARGET_ERR:g}% of measured for "
                f"{within}/{len(errs)} splits (largest error {100 * max(errs, default=0):.0f}%)")
    return {"benchmark": "plan_split_validation", "started_utc": started, "wall_s": time.perf_counter() - t0,
            "commit": git_commit(), "machine": machine(),
            "command": " ".join(["benchmarks/plan_split_validation.py", *sys.argv[1:]]),
            "profile": str(prof_path.relative_to(REPO)) if prof_path.is_relative_to(REPO) else str(prof_path),
            "attainment_target": ATTAINMENT, "target_error": TARGET_ERR, "workloads": workloads,
            "measured_utc": old["started_utc"] if old else started, "repredicted": bool(old),
            "headline": headline, "targets_met": rank_ok and within == len(errs), "notes": args.notes}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results", help="where the results go")
    p.add_argument("--quick", action="store_true", help="a third of the requests per rate")
    p.add_argument("--reuse-profile", action="store_true", help="keep the profile already in --out")
    p.add_argument("--profile-repeats", type=int, default=3, help="runs per profile point (median)")
    p.add_argument("--sweep", type=lambda s: tuple(float(x) for x in s.split(",")), default=SWEEP,
                   help="request rates as multiples of the predicted goodput (default 0.6,0.8,1,1.2,1.45)")
    p.add_argument("--seed", type=int, default=1, help="workload seed")
    p.add_argument("--tie", type=float, default=0.10, help="measured goodputs this close rank as a tie")
    p.add_argument("--quiet-cores", type=float, default=0.3, help="start a measurement once others use less")
    p.add_argument("--quiet-wait", type=float, default=300.0, help="seconds to wait for that at most")
    p.add_argument("--notes", default="", help="the reading of the results, stored with them")
    p.add_argument("--workloads", nargs="*", default=None, help="only these workloads (smoke runs)")
    p.add_argument("--repredict", action="store_true",
                   help="measure nothing: predict the measurements in --out's plan_split_validation.json again")
    p.add_argument("--splits", nargs="*", default=None, help="only these splits, e.g. 2P1D (smoke runs)")
    return p.parse_args(argv)


if __name__ == "__main__":
    a = parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    report = main(a)
    (a.out / "plan_split_validation.json").write_text(json.dumps(report, indent=1) + "\n")
    (a.out / "plan_split_validation.md").write_text(markdown(report))
    print(report["headline"])
