"""The split controller benchmark's summary and page: per configuration and phase the mean goodput of its runs, the
targets, and the markdown beside the JSON (benchmarks/split_controller.py)."""

from __future__ import annotations

import statistics

GOAL = 0.9  # the controller's share of the best static split's goodput, in every phase


def summarize(runs: list[dict], n_phases: int) -> dict:
    """Per configuration and phase: the mean goodput of its runs (and each run's); the targets."""
    per: dict = {}
    for r in runs:
        for i, ph in enumerate(r["phases"]):
            per.setdefault(r["config"], {}).setdefault(i, []).append(ph["request_goodput"])
    table = {c: [statistics.mean(per[c][i]) for i in range(n_phases)] for c in per}
    statics = [c for c in table if c.startswith("static-")]
    best = [max(table[c][i] for c in statics) for i in range(n_phases)]
    ratio = {c: [table[c][i] / best[i] if best[i] else None for i in range(n_phases)] for c in table}
    ctl = ratio.get("controller", [])
    ctl_min = min((x for x in ctl if x is not None), default=None)
    static_worst = {c: min(x for x in ratio[c] if x is not None) for c in statics}
    move_list = [m for r in runs for m in r["moves"]]
    failed = sum(m["failed_overlapping"] for m in move_list)
    held = {f"{r['config']}#{k}": r["held_after"] for k, r in enumerate(runs) if any(r["held_after"].values())}
    targets = {
        "controller_vs_best_static_every_phase": {"value": ctl_min, "goal": f">= {GOAL}",
                                                  "met": ctl_min is not None and ctl_min >= GOAL},
        "every_static_misses_a_phase": {"value": static_worst, "goal": f"each < {GOAL} in some phase",
                                        "met": bool(static_worst) and all(v < GOAL for v in static_worst.values())},
        "failed_during_moves": {"value": failed, "goal": 0, "met": failed == 0 and bool(move_list)},
        "held_after_moves": {"value": held, "goal": "nothing held", "met": not held},
    }
    return {"goodput_mean": table, "best_static": best, "ratio_to_best_static": ratio,
            "goodput_runs": {c: {str(i): v for i, v in per[c].items()} for c in per}, "targets": targets}


def _f(x, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def markdown(report: dict) -> str:
    """The results page (benchmarks/results/split_controller.md)."""
    m, slo = report["machine"], report["slo"]
    phases, secs = report["phases"], report["phase_secs"]
    lines = ["# P:D split controller vs static splits (embedded default: reference engines, builtin:tiny, 3 slots)", "",
             f"- Device: {m['cpu_model']}, {m['cpu_cores']} cores, {m['mem_gib']} GiB, no GPU; other work's load in"
             " each phase: the Runs table's others' cores",
             f"- Date: {report['started_utc']} ({report['wall_s']:.0f} s)",
             f"- Commit: {report['commit']}",
             f"- Command: `{report['command']}`",
             f"- SLO: TTFT <= {slo['ttft_ms']:g} ms and TPOT <= {slo['tpot_ms']:g} ms (goodput: requests meeting both "
             "per second, sglang.bench_serving's definition)",
             "- Phases, back to back: " + ", ".join(
                 f"{p} ({report['workloads'][p]['rate']:g} req/s, {secs[i % len(secs)]:g} s of arrivals)"
                 for i, p in enumerate(phases)),
             "- Workloads (pdserve bench, random, Poisson): " + "; ".join(
                 f"{k}: input [{int(w['random_input_len'] * w['random_range_ratio'])}, {w['random_input_len']}], "
                 f"output [{int(w['random_output_len'] * w['random_range_ratio'])}, {w['random_output_len']}] tokens"
                 for k, w in report["workloads"].items()),
             f"- Controller: `planner:` {report['planner']}",
             f"- Orders: {', '.join(report['orders'])} (A static-2P1D, B static-1P2D, C controller)", ""]
    t = report["targets"]
    lines += ["## Targets", "", "| target | value | goal | met |", "|---|---|---|---|"]
    for k, v in t.items():
        val = v["value"]
        if isinstance(val, dict):
            val = ", ".join(f"{a}: {_f(b) if not isinstance(b, dict) else b}" for a, b in val.items()) or "none"
        elif isinstance(val, float):
            val = f"{val:.3f}"
        lines.append(f"| {k} | {val} | {v['goal']} | {'yes' if v['met'] else 'NO'} |")
    head = "| configuration | " + " | ".join(f"{i}: {p}" for i, p in enumerate(phases)) + " |"
    lines += ["", "## Goodput per phase", "", "Requests/s; the mean of the runs, each run in brackets; in parentheses "
              "the ratio to the best static split.", "", head,
              "|---|" + "---|" * len(phases)]
    for c, vals in report["goodput_mean"].items():
        cells = [f"{vals[i]:.2f} [{', '.join(f'{x:.2f}' for x in report['goodput_runs'][c][str(i)])}] "
                 f"({_f(report['ratio_to_best_static'][c][i])})" for i in range(len(phases))]
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    lines += ["", "## Runs", "", "| # | configuration | phase | goodput | attainment (TTFT, TPOT) | failed | router "
              "retries / errors | others' cores | split at the end |", "|---|---|---|---|---|---|---|---|---|"]
    for k, r in enumerate(report["runs"]):
        for i, ph in enumerate(r["phases"]):
            by = ph["slo_attainment_by_metric"]
            end = next((s["split"] for s in reversed(r["splits"]) if s["t_s"] <= ph["t_end_s"]), r["start_split"])
            lines.append(f"| {k} | {r['config']} | {i}: {ph['workload']} | {ph['request_goodput']:.2f} | "
                         f"{100 * ph['slo_attainment']:.0f}% ({100 * by['ttft']:.0f}%, {100 * by['tpot']:.0f}%) | "
                         f"{ph['failed']} | {ph['router_retries']:g} / {ph['router_errors']:g} | "
                         f"{ph['cpu']['others_cores']:.2f} | {end} |")
    lines += ["", "## Moves (controller runs)", "", "| run | phase | move | reason | shift -> decision s | shift -> "
              "moved s | shift -> routed s | drain + settle s | engine start s | move s | outcome | requests in "
              "flight meanwhile (failed) |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for k, r in enumerate(report["runs"]):
        for mv in r["moves"]:
            lines.append(f"| {k} | {mv['phase_index']}: {mv['phase']} | {mv['from']} -> {mv['to']} | {mv['reason']} | "
                         f"{_f(mv['shift_to_decision_s'], '.1f')} | {_f(mv['shift_to_moved_s'], '.1f')} | "
                         f"{_f(mv['shift_to_routed_s'], '.1f')} | {_f(mv['drain_settle_s'], '.1f')} | "
                         f"{_f(mv['engine_start_s'], '.1f')} | {_f(mv['move_s'], '.1f')} | {mv['outcome']} | "
                         f"{mv['requests_overlapping']} ({mv['failed_overlapping']}) |")
    held = [f"run {k} ({r['config']}): " + (", ".join(f"{u}: {h}" for u, h in r["held_after"].items() if h) or "0")
            for k, r in enumerate(report["runs"])]
    lines += ["", "Held after the traffic ended (requests, KV pages, bootstrap rooms per engine): " + "; ".join(held)]
    for rp in report.get("replay") or []:
        lines += replay_lines(rp)
    lines += ["", "## Reading it", "", report.get("notes") or "", ""]
    return "\n".join(lines)


def replay_lines(rp: dict) -> list[str]:
    """The DeepSeek-V4 replay's section (benchmarks/split_controller_replay.py)."""
    lines = ["", f"## DeepSeek-V4 replay, {rp['policy_name']} (planner simulator, 8x RTX PRO 6000, TP 2: 4 slots)", "",
             f"Profile {rp['profile']} (a model, benchmarks/dsv4_profile.py); SLO TTFT <= {rp['slo']['ttft_ms']:g} ms, "
             f"TPOT <= {rp['slo']['tpot_ms']:g} ms; {rp['phase_s']:g} s per phase: " + ", ".join(
                 f"{p} ({rp['workloads'][p]['rate']:g} req/s, input <= {rp['workloads'][p]['random_input_len']}, "
                 f"output <= {rp['workloads'][p]['random_output_len']})" for p in rp["phases"])
             + f"; engine restart {rp['restart_s']:g} s (assumed); hold {rp['hold_s']:g} s, cooldown "
             f"{rp['cooldown_s']:g} s; start {rp['start_split']}.", "",
             "| configuration | " + " | ".join(f"{i}: {p}" for i, p in enumerate(rp["phases"])) + " |",
             "|---|" + "---|" * len(rp["phases"])]
    for c, vals in rp["goodput"].items():
        lines.append(f"| {c} | " + " | ".join(f"{v:.2f} ({_f(rp['ratio_to_best_static'][c][i])})"
                                              for i, v in enumerate(vals)) + " |")
    lines += ["", "Moves: " + ("; ".join(
        f"{mv['from']} -> {mv['to']} ({mv['reason']}) decided {mv['since_shift_s']:.0f} s after the shift, drain "
        f"{mv['drain_s']:.0f} s + restart {mv['restart_s']:.0f} s, new split serving "
        f"{_f(mv.get('shift_to_new_split_s'), '.0f')} s after the shift" for mv in rp["moves"]) or "none"), "",
        "Decisions (each change of decision):", ""]
    lines += [f"- {d['t_s']:.0f} s ({d['phase']}): {d['current']} -> {d['target']} {d['action']} ({d['reason']})"
              for d in rp["decisions"]]
    return lines
