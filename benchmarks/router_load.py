"""Load generation for the router benchmark (benchmarks/router.py): closed-loop ``wrk`` runs against each
contender, interleaved round-robin over (mode, concurrency) cells, with the CPU accounting of every process in the
run and the stub engines' dispatch check per cell; then the medians over rounds and the ratios to the references."""

from __future__ import annotations

import json
import resource
import shlex
import subprocess
import time
from pathlib import Path

from router_contenders import REFERENCES, Contender, Stubs, request_body
from router_procs import child_setup, group_cpu_seconds, machine_busy_seconds, median

WRK_LUA = """-- written by benchmarks/router.py
wrk.method = "POST"
wrk.body = [[%s]]
wrk.headers["Content-Type"] = "application/json"
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('WRKJSON {"requests": %%d, "duration_us": %%d, "bytes": %%d, "connect": %%d, "read": %%d, ' ..
    '"write": %%d, "status": %%d, "timeout": %%d, "p50_us": %%d, "p90_us": %%d, "p99_us": %%d, "max_us": %%d, ' ..
    '"mean_us": %%.1f}\\n', summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.status,
    e.timeout, latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max, latency.mean))
end
"""


def wrk_script(workdir: Path, mode: str) -> Path:
    path = workdir / f"{mode}.lua"
    path.write_text(WRK_LUA % json.dumps(request_body(mode == "stream")))
    return path


def run_wrk(url: str, script: Path, connections: int, duration: float, cpus: set[int]) -> dict:
    """One closed-loop wrk run; returns its summary (latencies in us) and its own CPU seconds."""
    argv = ["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(duration))}s", "--timeout", "30s", "-s", str(script),
            url + "/generate"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = subprocess.run(argv, capture_output=True, text=True, preexec_fn=child_setup(cpus),
                       timeout=duration + 60)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("WRKJSON ")), None)
    if r.returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed ({r.returncode}): {r.stdout[-500:]} {r.stderr[-500:]}")
    out = json.loads(line[len("WRKJSON "):])
    out["cpu_s"] = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return out


def measure(c: Contender, stubs: Stubs, mode: str, script: Path, connections: int, duration: float,
            load_cpus: set[int], own_pgid: int) -> dict:
    """One measurement cell: wrk against ``c``, plus CPU accounting and the stubs' counters."""
    s0, busy0 = stubs.stats(), machine_busy_seconds()
    cpu_c0, cpu_s0, cpu_own0 = c.cpu_seconds(), stubs.cpu_seconds(), group_cpu_seconds(own_pgid)
    t0 = time.perf_counter()
    w = run_wrk(c.url, script, connections, duration, load_cpus)
    wall = time.perf_counter() - t0
    cpu_c, cpu_s = c.cpu_seconds() - cpu_c0, stubs.cpu_seconds() - cpu_s0
    cpu_own = group_cpu_seconds(own_pgid) - cpu_own0
    busy1, s1 = machine_busy_seconds(), stubs.stats()
    dur = w["duration_us"] / 1e6
    d = {side: {k: s1[side][k] - s0[side][k] for k in ("requests", "with_bootstrap", "streams")}
         for side in ("prefill", "decode")}
    n_ok = w["requests"] - w["status"]
    errors = w["connect"] + w["read"] + w["write"] + w["status"] + w["timeout"]
    # Every answered request reached decode; through a router also prefill, with bootstrap fields.
    # (wrk may cut a few requests in flight at the end: allow the connection count as slack.)
    check_ok = d["decode"]["requests"] >= n_ok
    if c.name != "direct":
        check_ok = (check_ok and abs(d["prefill"]["requests"] - d["decode"]["requests"]) <= connections
                    and d["prefill"]["with_bootstrap"] == d["prefill"]["requests"]
                    and d["decode"]["with_bootstrap"] == d["decode"]["requests"])
    foreign = (busy1["cpu"] - busy0["cpu"]) - (cpu_c + cpu_s + w["cpu_s"] + cpu_own)
    return {
        "contender": c.name, "mode": mode, "concurrency": connections,
        "rps": w["requests"] / dur, "requests": w["requests"], "errors": errors,
        "p50_ms": w["p50_us"] / 1e3, "p90_ms": w["p90_us"] / 1e3, "p99_ms": w["p99_us"] / 1e3,
        "max_ms": w["max_us"] / 1e3, "mean_ms": w["mean_us"] / 1e3,
        "cpu_cores": {"contender": cpu_c / wall, "stubs": cpu_s / wall, "wrk": w["cpu_s"] / wall,
                      "foreign": max(0.0, foreign) / wall,
                      **{f"machine_{k}": (busy1[k] - busy0[k]) / wall for k in busy0}},
        "router_cpu_us_per_request": cpu_c / w["requests"] * 1e6 if w["requests"] and c.proc is not None else None,
        "stub_requests": d, "dispatch_check_ok": check_ok,
    }


def compare(args, workdir: Path, logdir: Path, own_pgid: int, profile_hook) -> dict:
    stubs = Stubs("", args.load_cpus, logdir)
    contenders: dict[str, Contender] = {}
    try:
        for name in args.contenders:
            contenders[name] = Contender(name, stubs, args.router_cpus, logdir, args.sglang_router_dir,
                                         pdserve_tree=args.pdserve_tree, custom=args.custom)
        for c in contenders.values():
            c.ready()
        scripts = {m: wrk_script(workdir, m) for m in args.modes}
        print(f"[router bench] contenders ready: {', '.join(contenders)}; warming up", flush=True)
        for c in contenders.values():
            for m in args.modes:
                run_wrk(c.url, scripts[m], max(args.concurrency), args.warmup, args.load_cpus)
        cells: list[dict] = []
        names = list(contenders)
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for mode in args.modes:
                for conc in args.concurrency:
                    for name in order:
                        cell = measure(contenders[name], stubs, mode, scripts[mode], conc, args.duration,
                                       args.load_cpus, own_pgid)
                        cell["round"] = r
                        cells.append(cell)
                        print(f"[router bench] round {r} {mode:8s} c={conc:<4d} {name:8s} {cell['rps']:9.1f} req/s "
                              f"p50 {cell['p50_ms']:7.2f} ms p99 {cell['p99_ms']:7.2f} ms errors {cell['errors']} "
                              f"cpu router {cell['cpu_cores']['contender']:.2f} load "
                              f"{cell['cpu_cores']['stubs'] + cell['cpu_cores']['wrk']:.2f} "
                              f"foreign {cell['cpu_cores']['foreign']:.2f}", flush=True)
        profile = profile_hook(contenders.get("pdserve"), scripts.get("generate")) if profile_hook else None
        commands = {n: (shlex.join(c.argv) if c.argv else f"(wrk -> {c.url}/generate)") for n, c in contenders.items()}
    finally:
        for c in contenders.values():
            c.stop()
        stubs.stop()
    return {"cells": cells, "summary": summarize(cells, args), "profile": profile, "commands": commands}


def summarize(cells: list[dict], args) -> list[dict]:
    """Per (mode, concurrency, contender): medians over rounds, added latency vs direct, ratios."""
    by = {(c["mode"], c["concurrency"], c["contender"], c["round"]): c for c in cells}
    rows = []
    for mode in args.modes:
        for conc in args.concurrency:
            for name in args.contenders:
                mine = [by[k] for k in sorted(by) if k[:3] == (mode, conc, name)]
                if not mine:
                    continue
                row = {"mode": mode, "concurrency": conc, "contender": name, "rounds": len(mine),
                       "rps": median([c["rps"] for c in mine]),
                       "p50_ms": median([c["p50_ms"] for c in mine]), "p99_ms": median([c["p99_ms"] for c in mine]),
                       "errors": sum(c["errors"] for c in mine),
                       "dispatch_check_ok": all(c["dispatch_check_ok"] for c in mine),
                       "cpu_contender": median([c["cpu_cores"]["contender"] for c in mine]),
                       "router_cpu_us_per_request": median([c["router_cpu_us_per_request"] for c in mine]),
                       "cpu_load": median([c["cpu_cores"]["stubs"] + c["cpu_cores"]["wrk"] for c in mine]),
                       "cpu_foreign": median([c["cpu_cores"]["foreign"] for c in mine])}
                for p in ("p50", "p99"):
                    diffs = [c[f"{p}_ms"] - by[(mode, conc, "direct", c["round"])][f"{p}_ms"]
                             for c in mine if (mode, conc, "direct", c["round"]) in by]
                    row[f"added_{p}_ms"] = median(diffs) if name != "direct" else 0.0
                rows.append(row)
    # Ratios of pdserve (and any --custom router) to the references in the same cell.
    for row in rows:
        if row["contender"] in ("direct", *REFERENCES):
            continue
        for other in REFERENCES:
            o = next((r for r in rows if (r["mode"], r["concurrency"], r["contender"]) ==
                      (row["mode"], row["concurrency"], other)), None)
            if o and o["rps"]:
                row[f"rps_vs_{other}"] = row["rps"] / o["rps"]
                row[f"p99_vs_{other}"] = row["p99_ms"] / o["p99_ms"] if o["p99_ms"] else None
                mine, theirs = row["router_cpu_us_per_request"], o["router_cpu_us_per_request"]
                row[f"cpu_per_request_vs_{other}"] = mine / theirs if mine and theirs else None
    return rows
