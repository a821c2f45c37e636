"""The router benchmark's result (benchmarks/router.py): the JSON record (machine, versions, commit, command,
config, every cell) and the Markdown page rendered from it."""

from __future__ import annotations

import os
import platform
import re
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from router_contenders import GATEWAYS, SGLANG_ROUTER_DIR, SMG_DIR, TOKENS, request_body
from router_procs import REPO, median, rnd

FOREIGN_CPU_LIMIT = 0.1  # cores used by other processes on average, above which a run is preliminary
GOALS = {"rps_vs_gateway": 1.0, "rps_vs_smg": 1.0, "rps_vs_mini_lb": 5.0, "p99_vs_gateway_max": 1.5,
         "memory_added_mb_max": 150.0}


def machine() -> dict:
    cpu = "unknown"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem_kb = int(re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1))
    return {"cpu_model": cpu, "cpu_cores": os.cpu_count(), "mem_gib": round(mem_kb / 2**20, 1),
            "os": platform.platform(), "python": platform.python_version()}


def versions() -> dict:
    out = {}
    for dist in ("aiohttp", "fastapi", "starlette", "uvicorn", "uvloop", "httptools", "orjson", "pydantic",
                 "prometheus-client", "py-spy"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    for dist, where in (("sglang-router", SGLANG_ROUTER_DIR), ("smg", SMG_DIR)):
        try:
            out[dist] = metadata.version(dist)  # only when installed into the venv
        except metadata.PackageNotFoundError:
            found = [d.version for d in metadata.distributions(path=[str(where)]) if d.metadata["Name"] == dist]
            out[dist] = found[0] if found else None
    try:
        out["wrk"] = subprocess.run(["wrk", "-v"], capture_output=True, text=True).stdout.split("[")[0].strip()
    except OSError:
        out["wrk"] = None

    def git(*a):
        r = subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else None

    out["pdserve_commit"] = git("rev-parse", "--short", "HEAD")
    out["pdserve_router_last_commit"] = git("log", "-1", "--format=%h %cI", "--", "router")
    out["pdserve_router_uncommitted_changes"] = bool(git("status", "--porcelain", "--", "router"))
    # every tracked file that differs from the commit (what "commit X with the working-tree changes" means), the
    # benchmark results themselves (outputs) aside
    changed = git("diff", "--name-only", "HEAD")
    out["pdserve_working_tree_changes"] = sorted(
        f for f in changed.splitlines() if not f.startswith("benchmarks/results/")) if changed else []
    return out


def targets(summary: list[dict]) -> dict:
    """One target per (gateway, mode, concurrency): pdserve's req/s over that gateway's in the same cell, >= 1.0x."""
    out = {}
    for r in summary:
        if r["contender"] != "pdserve":
            continue
        for gw in GATEWAYS:
            x = r.get(f"rps_vs_{gw}")
            if x is not None:
                out[f"pdserve_rps_vs_{gw}_{r['mode']}_c{r['concurrency']}"] = {
                    "value": rnd(x), "goal": f">= {GOALS['rps_vs_' + gw]:.1f}x", "met": x >= GOALS["rps_vs_" + gw]}
    return out


def build_result(args, argv: list[str], now, res: dict, mem: list[dict], loadavg_before: list[str]) -> dict:
    """The JSON record of one run: when, where, which commit and command, the config, the summary rows, the memory
    and profile sections and every measured cell. A run whose measurements shared the machine with other processes
    (median above FOREIGN_CPU_LIMIT cores) is marked preliminary."""
    foreign = median([c["cpu_cores"]["foreign"] for c in res["cells"]]) or 0.0
    foreign_max = max((c["cpu_cores"]["foreign"] for c in res["cells"]), default=0.0)
    preliminary = foreign > FOREIGN_CPU_LIMIT
    python = Path(sys.executable)
    return {
        "benchmark": "router", "date": now.isoformat(timespec="seconds"),
        "command": shlex.join([python.relative_to(REPO).as_posix() if python.is_relative_to(REPO) else str(python),
                               "benchmarks/router.py", *argv]),
        "preliminary": preliminary,
        "preliminary_reason": (f"other processes used a median {foreign:.2f} (max {foreign_max:.2f}) CPU cores during "
                               f"the measurements (limit {FOREIGN_CPU_LIMIT}); rerun on an idle machine")
        if preliminary else None,
        "machine": machine(), "versions": {**versions(), "pdserve_router_measured": (
            f"commit {args.pdserve_tree.name.split('_', 1)[1]} (--pdserve-commit {args.pdserve_commit})"
            if args.pdserve_commit else "working tree")},
        "loadavg_before": loadavg_before, "loadavg_after": Path("/proc/loadavg").read_text().split()[:3],
        "config": {"contenders": args.contenders, "modes": args.modes, "concurrency": args.concurrency,
                   "duration_s": args.duration, "warmup_s": args.warmup, "rounds": args.rounds,
                   "router_cpus": sorted(args.router_cpus), "load_cpus": sorted(args.load_cpus),
                   "tokens_per_request": TOKENS, "request_body": {m: request_body(m == "stream") for m in args.modes},
                   "load_generator": "wrk -t1 -cC -dD --timeout 30s (closed loop, keep-alive)",
                   "memory_streams": args.memory_streams, "memory_token_interval_s": args.memory_token_interval,
                   "memory_settle_s": args.memory_settle,
                   "memory_waves": args.memory_waves},
        "goals": GOALS, "targets": targets(res["summary"]),
        "contender_commands": res["commands"], "custom_contenders": args.custom or None,
        "summary": [{k: (rnd(v) if isinstance(v, float) else v) for k, v in r.items()} for r in res["summary"]],
        "memory": mem, "profile": res["profile"],
        "cells": [{**c, "rps": rnd(c["rps"], 1), "cpu_cores": {k: rnd(v) for k, v in c["cpu_cores"].items()}}
                  for c in res["cells"]],
    }


def fmt(x, nd=1, dash="-"):
    return dash if x is None else f"{x:.{nd}f}"


def headline(result: dict) -> str:
    """One line: pdserve's req/s and p99 against each Rust gateway per mode, and the memory added at peak."""
    def span(xs: list[float]) -> str:
        lo, hi = f"{min(xs):.2f}", f"{max(xs):.2f}"
        return lo if lo == hi else f"{lo}-{hi}"

    parts = []
    for mode in result["config"]["modes"]:
        for gw in GATEWAYS:
            rows = [r for r in result["summary"] if r["contender"] == "pdserve" and r["mode"] == mode
                    and r.get(f"rps_vs_{gw}") is not None]
            if rows:
                rps = [r[f"rps_vs_{gw}"] for r in rows]
                p99 = [r[f"p99_vs_{gw}"] for r in rows if r.get(f"p99_vs_{gw}") is not None]
                parts.append(f"{mode}: pdserve {span(rps)}x {gw}'s req/s" + (f", p99 {span(p99)}x" if p99 else ""))
    for mm in result.get("memory") or []:
        if mm.get("added_mb_peak") is not None:
            parts.append(f"{mm['contender']} +{mm['added_mb_peak']:.1f} MB at peak under {mm['streams']} slow streams")
    return "; ".join(parts) or "no pdserve / gateway pair measured"


def markdown(result: dict) -> str:
    m, cfg, v = result["machine"], result["config"], result["versions"]
    lines = [f"# PD router benchmark{' - PRELIMINARY' if result['preliminary'] else ''}", "",
             f"- Device: {m['cpu_model']}, {m['cpu_cores']} cores, {m['mem_gib']} GiB; contender on CPU "
             f"{cfg['router_cpus']}, stubs + wrk on CPU {cfg['load_cpus']}",
             f"- Date: {result['date']}",
             f"- Measured at commit {v.get('pdserve_commit')}"
             + (f" with the working-tree changes listed: {', '.join(v['pdserve_working_tree_changes'])}"
                if v.get("pdserve_working_tree_changes") else "")
             + f" (router measured: {v.get('pdserve_router_measured')})",
             f"- Command: `{result['command']}`",
             f"- Anchors, same run: no router (`direct`), SGLang's Rust gateway (`gateway`) and its Python mini_lb "
             f"(sglang-router {v.get('sglang-router')}), the Shepherd Model Gateway (`smg`, smg {v.get('smg')}; the "
             f"Rust gateway's successor, same launch_router flags), on the same stub engines",
             f"- Load: wrk, closed loop, POST /generate max_new_tokens {TOKENS}; `stream` = {TOKENS}-event SSE "
             f"streams (req/s = streams/s); {cfg['rounds']} interleaved rounds x {cfg['duration_s']:.0f} s, medians",
             "", f"Headline: {headline(result)}.", "",
             "Added latency = contender minus direct at the same load and round. CPU = cores busy (router / "
             "stubs+wrk / other processes on the machine); router CPU us/req = the router process's CPU time per "
             "request. Reproduce: `make bench-router` (= `.venv/bin/python benchmarks/router.py`, ~15 min, on an "
             "otherwise idle machine).", ""]
    if result["preliminary"]:
        lines += [f"**Preliminary**: {result['preliminary_reason']}", ""]
    lines += ["| mode | conc | contender | req/s | p50 ms | p99 ms | added p50 ms | added p99 ms | router CPU us/req "
              "| CPU router | CPU load | CPU other | errors | PD check |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["summary"]:
        lines.append(f"| {r['mode']} | {r['concurrency']} | {r['contender']} | {fmt(r['rps'], 0)} "
                     f"| {fmt(r['p50_ms'], 2)} "
                     f"| {fmt(r['p99_ms'], 2)} | {fmt(r['added_p50_ms'], 2)} | {fmt(r['added_p99_ms'], 2)} "
                     f"| {fmt(r['router_cpu_us_per_request'], 0)} | {fmt(r['cpu_contender'], 2)} "
                     f"| {fmt(r['cpu_load'], 2)} | {fmt(r['cpu_foreign'], 2)} "
                     f"| {r['errors']} | {'ok' if r['dispatch_check_ok'] else 'FAIL'} |")
    lines += ["", "Ratios to the references (same cell): req/s ratio, p99 ratio; goals: >= 1.0x the req/s of both Rust "
              "gateways (`gateway` = sglang-router 0.3.2, `smg`), >= 5x mini_lb, p99 <= 1.5x gateway. CPU/req = the "
              "router's CPU time per request relative to that gateway's (robust to other load on the machine: < 1 "
              "means cheaper).", "",
              "| router | mode | conc | req/s vs gateway | req/s vs smg | req/s vs mini_lb | p99 vs gateway "
              "| p99 vs smg | CPU/req vs gateway | CPU/req vs smg |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["summary"]:
        if any(f"rps_vs_{o}" in r for o in (*GATEWAYS, "mini_lb")):
            x = lambda k: fmt(r.get(k), 2) + ("x" if r.get(k) is not None else "")  # noqa: E731
            lines.append(f"| {r['contender']} | {r['mode']} | {r['concurrency']} | {x('rps_vs_gateway')} "
                         f"| {x('rps_vs_smg')} | {x('rps_vs_mini_lb')} | {x('p99_vs_gateway')} | {x('p99_vs_smg')} "
                         f"| {x('cpu_per_request_vs_gateway')} | {x('cpu_per_request_vs_smg')} |")
    if result.get("targets"):
        met = [k for k, t in result["targets"].items() if t["met"]]
        lines += ["", f"Targets (pdserve req/s >= 1.0x each gateway, every cell): {len(met)} of "
                  f"{len(result['targets'])} met" + (": missed " + ", ".join(
                      f"{k} {t['value']:.2f}x" for k, t in result["targets"].items() if not t["met"])
                      if len(met) < len(result["targets"]) else "") + "."]
    if result.get("memory"):
        lines += ["", "Memory: N concurrent slow streams (one token per "
                  f"{cfg['memory_token_interval_s']} s, {TOKENS} tokens) through a fresh router; RSS in MB "
                  "(goal: <= 150 MB added, back near baseline).", "",
                  "| contender | streams x waves | whole | max open at decode | before | peak per wave | added at peak "
                  f"| after 1 s | after 10 s | after {cfg['memory_settle_s']:.0f} s |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        settle_key = f"after_{cfg['memory_settle_s']:.0f}s"
        for mm in result["memory"]:
            if "error" in mm:
                lines.append(f"| {mm['contender']} | error: {mm['error'][:120]} |")
                continue
            r = mm["rss_mb"]
            peaks = " / ".join(fmt(w.get("peak_mb")) for w in mm.get("per_wave", []))
            lines.append(f"| {mm['contender']} | {mm['streams']} x {mm.get('waves', 1)} | {mm['whole_streams']} "
                         f"| {mm['max_concurrent_streams_at_decode']} | {fmt(r['before'])} "
                         f"| {peaks or fmt(r['peak_sampled'])} "
                         f"| {fmt(mm['added_mb_peak'])} | {fmt(r['after_1s'])} | {fmt(r['after_10s'])} "
                         f"| {fmt(r.get(settle_key))} |")
    prof = result.get("profile")
    if prof and "top_own" in prof:
        lines += ["", f"Profile of the pdserve router (py-spy, {prof['seconds']:.0f} s at {prof['rate_hz']} Hz, "
                  f"{prof['mode']} c={prof['concurrency']}, {prof['rps_while_profiled']:.0f} req/s while sampled; "
                  f"stacks: `{prof['collapsed_stacks']}`). Inclusive share by package: "
                  + ", ".join(f"{p['package']} {p['pct']}%" for p in prof["by_package_inclusive"][:10]) + ".", "",
                  "| own % | function |", "|---|---|"]
        lines += [f"| {t['pct']} | `{t['frame']}` |" for t in prof["top_own"][:15]]
    return "\n".join(lines) + "\n"
