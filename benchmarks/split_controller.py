"""The P:D split controller against static splits on the embedded default (reference engines, builtin:tiny).

What is done
------------
One Ray head with 3 logical GPUs (3 slots); for each configuration the launcher (``python -m pd.launch``, the
Ray job entrypoint, run as a driver of that head) brings the cluster up, ``pdserve bench`` (pd.bench.run_bench)
drives the phases back to back -- prefill-heavy, decode-heavy, prefill-heavy -- and the launcher is stopped:

- ``static-2P1D`` and ``static-1P2D``: ``planner.mode: advise`` (the controller decides and logs what it would do,
  never moves a worker: the same scraping load as the controller's);
- ``controller``: ``planner.mode: act``, starting at 2P1D.

The configurations run in the order ABC then CBA (``--orders``), so a slow drift of this shared machine's speed
weighs on each alike; each configuration's phase goodput is the mean of its runs.

Per phase: goodput as ``sglang.bench_serving`` defines it (requests meeting both the TTFT and TPOT objectives per
second of the run: first request sent to last answered), attainment, failed requests (pdserve bench's), and the
router's retries and errors over the phase (``pdserve_router_retries_total``, ``pdserve_router_errors_total``).
Per move: the time from the shift (the phase's first request) to the decision, to the move's log line and to the
router routing to the new split (``GET /workers`` polled every second), the move's own report (drain and settle,
engine start), and what the cluster holds once the traffic has ended (every engine's running and queued requests,
KV pages held and the prefills' bootstrap rooms: pd.cluster.split_mover.engine_holdings, polled until 0 with a
deadline).

The DeepSeek-V4 replay (benchmarks/split_controller_replay.py) runs the same phase sequence through the controller
on the planner's simulator with the DeepSeek-V4 profile.

Targets (results JSON ``targets``): the controller reaches >= 90% of the best static split's goodput in every phase;
every static split misses that in at least one phase; 0 requests failed during the moves; nothing held after a move.

Reproduce
---------
    .venv/bin/python benchmarks/split_controller.py              # writes benchmarks/results/split_controller.*
    .venv/bin/python benchmarks/split_controller.py --calibrate --phase-secs 60   # static splits over a sweep of
                                                                                  # rates, no phases
About 50 minutes for one order on the idle 2-core machine; the default runs ABC then CBA.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import yaml
from cpu_share import CpuSampler
from kv_transfer import git_commit, machine
from prometheus_client.parser import text_string_to_metric_families
from split_controller_replay import replays
from split_controller_report import markdown, summarize

from pd.bench import BenchConfig, run_bench
from pd.cluster.procs import LoggedGroup
from pd.cluster.split_mover import bootstrap_url, engine_holdings
from pd.util.ports import free_ports
from pd.util.wait import wait_until

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
ATTAINMENT = 0.9
SLO_TTFT_MS, SLO_TPOT_MS = 300.0, 40.0
# Rates from --calibrate on the idle machine (60 s per rate): at 23 prefill-heavy req/s 2P1D met 98% of requests and
# 1P2D 45%; at 4.5 decode-heavy req/s 2P1D met 14% and 1P2D 100% (3.8: both 100%).
WORKLOADS = {
    # long prompts, a few output tokens: the prefills are the bottleneck
    "prefill-heavy": {"random_input_len": 1900, "random_output_len": 2, "random_range_ratio": 0.8, "rate": 22.0},
    # short prompts, long outputs: the decodes are
    "decode-heavy": {"random_input_len": 128, "random_output_len": 192, "random_range_ratio": 0.5, "rate": 4.5},
}
PHASES = ("prefill-heavy", "decode-heavy", "prefill-heavy")
# The controller's settings: decisions every 2 s from 10 s of metrics; a step proposed for 4 s (at least half the
# measured engine start, ~9 s here) is taken, then 30 s (at least one engine start) of cooldown.
PLANNER = {"interval_secs": 2, "window_secs": 10, "slo_ttft_ms": SLO_TTFT_MS, "slo_tpot_ms": SLO_TPOT_MS,
           "slo_attainment": ATTAINMENT, "min_requests": 10, "hold_secs": 4, "hold_restarts": 0.5,
           "cooldown_secs": 30, "cooldown_restarts": 1.0, "settle_timeout_secs": 60}
CONFIGS = {"static-2P1D": (2, 1, "advise"), "static-1P2D": (1, 2, "advise"), "controller": (2, 1, "act")}
SEP = re.compile(r"pdserve: planner \((?:act|advise)\): (\d)P(\d)D -> (\d)P(\d)D: (does|would) (\w+) \((\w+)\)")


# ---- the Ray head and one deployment ---------------------------------------------------------------------------

class RayHead:
    """``ray start --head --block`` on 127.0.0.1 with ``num_gpus`` logical GPUs and no dashboard (this machine's
    two cores are the engines'); stopped by its process group."""

    def __init__(self, num_gpus: int, logs: Path):
        (self.port,) = free_ports(1)
        self.tmp = tempfile.mkdtemp(prefix="pds-", dir="/tmp")  # short: Ray puts sockets under it
        self.env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
        if Path("~/.ray/auth_token").expanduser().exists():
            self.env["RAY_AUTH_MODE"] = "token"
        argv = [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port",
                str(self.port), "--include-dashboard=false", "--num-cpus", "4", "--num-gpus", str(num_gpus),
                "--temp-dir", self.tmp, "--disable-usage-stats"]
        self.proc = LoggedGroup("ray-head", argv, logs / "ray-head.log", env=self.env)
        self.address = f"127.0.0.1:{self.port}"

        def up() -> bool:
            if not self.proc.alive():
                raise RuntimeError(f"the Ray head exited:\n{self.proc.tail()}")
            return "Ray runtime started" in self.proc.tail(200) or "--block" in self.proc.tail(200)

        wait_until(up, 180, interval=0.5, what="the Ray head started", retry=())

    def stop(self) -> None:
        self.proc.stop(grace=30)
        shutil.rmtree(self.tmp, ignore_errors=True)


class Deployment:
    """One configuration: the launcher as a driver of ``head``, its log stamped line by line (monotonic time), and
    the router's worker list polled every second.

    Args:
        head: the Ray head.
        prefill, decode: replicas at the start.
        mode: the planner's mode (``advise`` or ``act``).
        logs: the folder for the launcher's log and config.
    """

    def __init__(self, head: RayHead, prefill: int, decode: int, mode: str, logs: Path, tag: str):
        cfg = yaml.safe_load((REPO / "deploy" / "local.yaml").read_text())
        (port,) = free_ports(1)
        cfg["cluster"]["num_gpus"] = prefill + decode
        cfg["prefill"]["replicas"], cfg["decode"]["replicas"] = prefill, decode
        cfg["router"]["port"] = port
        cfg["planner"] = {"mode": mode, **PLANNER}
        self.config = cfg
        path = logs / f"{tag}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        env = dict(head.env, RAY_ADDRESS=head.address, PYTHONUNBUFFERED="1")
        self.proc = LoggedGroup("launcher", [sys.executable, "-m", "pd.launch", str(path)], logs / f"{tag}.log",
                                env=env)
        self.lines: list[tuple[float, str]] = []
        self.splits: list[tuple[float, int, int]] = []  # (t, prefill, decode) the router routes to
        self._stop = threading.Event()
        self._log_thread = threading.Thread(target=self._follow_log, daemon=True)
        self._log_thread.start()
        self.url = self.wait_line(r"pdserve: router ready at (\S+)", 300).group(1)
        admin, key_file = self.wait_line(r"admin API at (\S+)/workers; its key is in (\S+) ", 60).groups()
        self.admin, self.headers = admin, {"Authorization": f"Bearer {Path(key_file).read_text().strip()}"}
        self.wait_line(r"pdserve: planner: (act|advise) every", 60)
        self._poll_thread = threading.Thread(target=self._poll_workers, daemon=True)
        self._poll_thread.start()

    def _follow_log(self) -> None:
        pos, partial = 0, ""
        while not self._stop.is_set():
            try:
                with open(self.proc.log_path, errors="replace") as f:
                    f.seek(pos)
                    chunk = f.read()
                    pos = f.tell()
            except OSError:
                chunk = ""
            if chunk:
                now = time.monotonic()
                *done, partial = (partial + chunk).split("\n")
                self.lines += [(now, line) for line in done]
            self._stop.wait(0.25)

    def _poll_workers(self) -> None:
        with httpx.Client(timeout=5, headers=self.headers) as c:
            while not self._stop.is_set():
                try:
                    ws = c.get(self.admin + "/workers").json()["workers"]
                    live = [w for w in ws if w["is_healthy"] and not w["draining"]]
                    split = (sum(w["worker_type"] == "prefill" for w in live),
                             sum(w["worker_type"] == "decode" for w in live))
                    if not self.splits or self.splits[-1][1:] != split:
                        self.splits.append((time.monotonic(), *split))
                except (httpx.HTTPError, ValueError, KeyError):
                    pass
                self._stop.wait(1.0)

    def wait_line(self, pattern: str, timeout: float, since: float = 0.0) -> re.Match:
        """The first log line (stamped at or after ``since``) matching ``pattern``.

        Raises:
            RuntimeError: the launcher exited or printed a traceback. TimeoutError: no match within ``timeout``.
        """
        rx = re.compile(pattern)

        def found():
            for t, line in list(self.lines):
                if t >= since and (m := rx.search(line)):
                    return m
            if not self.proc.alive() or any("Traceback" in line for _, line in self.lines):
                raise RuntimeError(f"the launcher failed:\n{self.proc.tail(60)}")
            return None

        return wait_until(found, timeout, interval=0.5, what=f"{pattern!r} in the launcher's log", retry=())

    def workers(self) -> list[dict]:
        return httpx.get(self.admin + "/workers", headers=self.headers, timeout=10).json()["workers"]

    def router_counters(self) -> dict:
        """The router's retries and errors so far (summed over labels)."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out = {"retries": 0.0, "errors": 0.0}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == "pdserve_router_retries_total":
                    out["retries"] += s.value
                elif s.name == "pdserve_router_errors_total":
                    out["errors"] += s.value
        return out

    def holdings(self, timeout: float = 60) -> dict:
        """Every serving engine's holdings once they reach 0 (``{url: {}}``), or what is still held at the deadline."""
        held: dict = {}

        def clear() -> bool:
            held.clear()
            with httpx.Client(timeout=5) as c:
                for w in self.workers():
                    info = {"role": w["worker_type"], "host": "127.0.0.1", "bootstrap_port": w.get("bootstrap_port")}
                    held[w["url"]] = engine_holdings(w["url"], bootstrap_url(info), c)
            return not any(held.values())

        try:
            wait_until(clear, timeout, interval=0.5, what="every engine holding nothing", retry=(httpx.HTTPError,))
        except TimeoutError:
            pass
        return dict(held)

    def stop(self) -> None:
        self._stop.set()
        self.proc.stop(grace=90)  # the launcher drains the router and removes its actors and placement groups
        self._log_thread.join(5)
        self._poll_thread.join(5)


# ---- phases -----------------------------------------------------------------------------------------------------

def bench_config(url: str, workload: str, rate: float, seconds: float, seed: int, warmup: int) -> BenchConfig:
    """One phase: ``workload`` at ``rate`` req/s (Poisson) for ``seconds``, streamed through the router."""
    w = WORKLOADS[workload]
    return BenchConfig(base_url=url, backend="sglang", dataset_name="random", tokenize_prompt=True,
                       random_input_len=w["random_input_len"], random_output_len=w["random_output_len"],
                       random_range_ratio=w["random_range_ratio"], num_prompts=max(1, round(rate * seconds)),
                       request_rate=(rate,), seed=seed, slo_ttft_ms=SLO_TTFT_MS, slo_tpot_ms=SLO_TPOT_MS,
                       slo_attainment_target=ATTAINMENT, disable_tqdm=True, request_timeout_secs=300.0,
                       warmup_requests=warmup, output_details=True, disable_stage_breakdown=True)


def per_request(run: dict, t_start: float) -> list[dict]:
    """The run's requests: send time on the monotonic clock, TTFT and TPOT (ms), success."""
    out = []
    for arr, ttft, e2e, n, ok in zip(run["arrival_times"], run["ttfts"], run["e2e_latencies"], run["output_lens"],
                                     run["successes"]):
        tpot = (e2e - ttft) / (n - 1) * 1e3 if ok and n > 1 else None
        out.append({"t": t_start + arr, "end": t_start + arr + e2e, "ttft_ms": ttft * 1e3 if ok else None,
                    "tpot_ms": tpot, "ok": ok})
    return out


def good(r: dict) -> bool:
    return r["ok"] and r["ttft_ms"] <= SLO_TTFT_MS and (r["tpot_ms"] is None or r["tpot_ms"] <= SLO_TPOT_MS)


def timeline(reqs: list[dict], t0: float, step: float = 10.0) -> list[dict]:
    """Per ``step`` seconds of sends from ``t0``: requests sent and the fraction of them meeting both objectives."""
    buckets: dict[int, list] = {}
    for r in reqs:
        buckets.setdefault(int((r["t"] - t0) // step), []).append(good(r))
    return [{"from_s": k * step, "sent": len(v), "attainment": sum(v) / len(v)} for k, v in sorted(buckets.items())]


def run_phase(dep: Deployment, cpu: CpuSampler, workload: str, seconds: float, seed: int, warmup: int) -> dict:
    rate = WORKLOADS[workload]["rate"]
    before, mark = dep.router_counters(), cpu.mark()
    res = run_bench(bench_config(dep.url, workload, rate, seconds, seed, warmup), quiet=True)
    t_end = time.monotonic()
    after, load = dep.router_counters(), cpu.others(mark, cpu.mark())
    run = res["runs"][0]
    t_start = t_end - run["duration"]  # the run's first send, within the few ms its summary takes
    reqs = per_request(run, t_start)
    return {"workload": workload, "request_rate": rate, "t_start": t_start, "t_end": t_end,
            "duration_s": run["duration"], "completed": run["completed"], "failed": run["failed"],
            "request_goodput": run["request_goodput"], "slo_attainment": run["slo_attainment"],
            "slo_attainment_by_metric": run["slo_attainment_by_metric"], "p90_ttft_ms": run["p90_ttft_ms"],
            "p90_tpot_ms": run["p90_tpot_ms"], "median_tpot_ms": run["median_tpot_ms"],
            "error_samples": run.get("error_samples"),
            "router_retries": after["retries"] - before["retries"], "router_errors": after["errors"] - before["errors"],
            "cpu": load, "timeline": timeline(reqs, t_start), "_requests": reqs}


def moves(dep: Deployment, phases: list[dict]) -> list[dict]:
    """Each move the launcher made: when it was decided and done relative to the shift it followed, its report, and
    the requests failed while it ran."""
    out = []
    decided = [(t, m) for t, line in dep.lines if (m := SEP.search(line)) and m.group(5) == "does"
               and m.group(6) != "hold"]
    done = [(t, line) for t, line in dep.lines if "pdserve: planner: moved:" in line or
            re.search(r"pdserve: planner: (rolled_back|failed|drain_timeout|settle_timeout):", line)]
    settled = [(t, line) for t, line in dep.lines if "drained and settled in" in line]
    for t_dec, m in decided:
        phase = max((p for p in phases if p["t_start"] <= t_dec), key=lambda p: p["t_start"], default=None)
        t_done, line = next(((t, ln) for t, ln in done if t >= t_dec), (None, ""))
        target = (int(m.group(3)), int(m.group(4)))
        t_routed = next((t for t, p, d in dep.splits if t >= t_dec and (p, d) == target), None)
        end = t_done or time.monotonic()
        during = [r for p in phases for r in p["_requests"] if r["t"] <= end and r["end"] >= t_dec]
        rep = re.search(r"in ([\d.]+)s \(engine start ([\d.]+)s\)", line)
        st = next((ln for t, ln in settled if t_dec <= t <= end), "")
        s = re.search(r"drained and settled in ([\d.]+)s", st)
        shift = phase["t_start"] if phase else None
        out.append({"action": m.group(6), "reason": m.group(7), "from": f"{m.group(1)}P{m.group(2)}D",
                    "to": f"{target[0]}P{target[1]}D", "phase": phase["workload"] if phase else None,
                    "phase_index": phases.index(phase) if phase else None,
                    "shift_to_decision_s": t_dec - shift if shift else None,
                    "shift_to_moved_s": t_done - shift if shift and t_done else None,
                    "shift_to_routed_s": t_routed - shift if shift and t_routed else None,
                    "move_s": float(rep.group(1)) if rep else None, "engine_start_s": float(rep.group(2)) if rep
                    else None, "drain_settle_s": float(s.group(1)) if s else None,
                    "outcome": line.split("pdserve: planner: ", 1)[-1].split(":", 1)[0] if line else "unfinished",
                    "log": line.split("pdserve: ", 1)[-1],
                    "requests_overlapping": len(during), "failed_overlapping": sum(not r["ok"] for r in during)})
    return out


def run_config(head: RayHead, cpu: CpuSampler, name: str, args, logs: Path, seed: int) -> dict:
    p, d, mode = CONFIGS[name]
    print(f"{name}: starting {p}P{d}D ({mode})", flush=True)
    t0 = time.monotonic()
    dep = Deployment(head, p, d, mode, logs, f"{name}-{seed}")
    cpu.roots.add(dep.proc.pid)
    try:
        started = time.monotonic() - t0
        quiet = cpu.wait_quiet(args.quiet_cores, args.quiet_wait)
        phases = []
        for i, w in enumerate(PHASES):
            ph = run_phase(dep, cpu, w, args.phase_secs[i % len(args.phase_secs)], seed * 10 + i, 2 if i == 0 else 0)
            phases.append(ph)
            print(f"  {name} phase {i} {w}: goodput {ph['request_goodput']:.2f} req/s, attainment "
                  f"{100 * ph['slo_attainment']:.0f}%, failed {ph['failed']}, split now "
                  f"{dep.splits[-1][1]}P{dep.splits[-1][2]}D; others used {ph['cpu']['others_cores']:.2f} cores",
                  flush=True)
        held = dep.holdings()
        mv = moves(dep, phases)
        log = [line for _, line in dep.lines if "pdserve: planner" in line]
    finally:
        dep.stop()
    t_base = phases[0]["t_start"] if phases else t0
    return {"config": name, "start_split": f"{p}P{d}D", "mode": mode, "startup_s": started, "quiet_check": quiet,
            "phases": phases,
            "moves": mv, "held_after": held, "splits": [{"t_s": t - t_base, "split": f"{a}P{b}D"}
                                                          for t, a, b in dep.splits],
            "planner_log": log}


# ---- the run ----------------------------------------------------------------------------------------------------

def calibrate(head: RayHead, cpu: CpuSampler, args, logs: Path) -> dict:
    """Static splits over a sweep of rates per workload (``--calibrate``): where the splits differ."""
    out: dict = {}
    for name in ("static-2P1D", "static-1P2D"):
        p, d, _ = CONFIGS[name]
        dep = Deployment(head, p, d, "advise", logs, f"calibrate-{name}")
        cpu.roots.add(dep.proc.pid)
        try:
            for w, rates in (("prefill-heavy", args.prefill_rates), ("decode-heavy", args.decode_rates)):
                for k, rate in enumerate(rates):
                    WORKLOADS[w]["rate"] = rate
                    cpu.wait_quiet(args.quiet_cores, args.quiet_wait)
                    ph = run_phase(dep, cpu, w, args.phase_secs[0], args.seed + k, 2)
                    reqs = ph.pop("_requests")  # kept for other objectives: latencies, ms (None: failed)
                    ph["ttfts_ms"], ph["tpots_ms"] = [r["ttft_ms"] for r in reqs], [r["tpot_ms"] for r in reqs]
                    out.setdefault(name, {}).setdefault(w, []).append(ph)
                    print(f"  {name} {w} {rate:g} req/s: goodput {ph['request_goodput']:.2f}, attainment "
                          f"{100 * ph['slo_attainment']:.0f}% {ph['slo_attainment_by_metric']}, p90 TTFT "
                          f"{ph['p90_ttft_ms']:.0f} ms, p90 TPOT {ph['p90_tpot_ms']:.1f} ms; others "
                          f"{ph['cpu']['others_cores']:.2f} cores", flush=True)
        finally:
            dep.stop()
    return out


def main(args) -> dict:
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    t0 = time.perf_counter()
    logs = Path(tempfile.mkdtemp(prefix="pdserve-split-controller-"))
    print(f"logs in {logs}", flush=True)
    head = RayHead(3, logs)
    cpu = CpuSampler({head.proc.pid})
    try:
        if args.calibrate:
            return {"calibration": calibrate(head, cpu, args, logs), "logs": str(logs)}
        runs = []
        for k, order in enumerate(args.orders):
            for letter in order:
                runs.append(run_config(head, cpu, {"A": "static-2P1D", "B": "static-1P2D", "C": "controller"}[letter],
                                       args, logs, args.seed + k))
    finally:
        cpu.stop()
        head.stop()
    for r in runs:
        base = r["phases"][0]["t_start"]
        for ph in r["phases"]:
            ph.pop("_requests")
            ph["t_start_s"], ph["t_end_s"] = ph.pop("t_start") - base, ph.pop("t_end") - base
    summary = summarize(runs, len(PHASES))
    print("replaying the phases on the DeepSeek-V4 profile", flush=True)
    rp = replays(args.replay_phase_secs, args.replay_restart_secs)
    return {"benchmark": "split_controller", "started_utc": started, "wall_s": time.perf_counter() - t0,
            "commit": git_commit(), "machine": machine(),
            "command": " ".join([".venv/bin/python benchmarks/split_controller.py", *sys.argv[1:]]),
            "slo": {"ttft_ms": SLO_TTFT_MS, "tpot_ms": SLO_TPOT_MS, "attainment": ATTAINMENT},
            "workloads": WORKLOADS, "phases": list(PHASES), "phase_secs": args.phase_secs, "planner": PLANNER,
            "orders": args.orders, "runs": runs, **summary, "replay": rp, "logs": str(logs)}


def floats(text: str) -> list[float]:
    """``"1,2.5"`` -> [1.0, 2.5] (empty: none)."""
    return [float(x) for x in text.split(",") if x]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results", help="where the results go")
    p.add_argument("--phase-secs", type=floats, default=[120.0, 360.0, 360.0],
                   help="seconds of arrivals per phase (one value for all, or one per phase)")
    p.add_argument("--orders", nargs="+", default=["ABC", "CBA"],
                   help="configuration orders (A static-2P1D, B static-1P2D, C controller), run in turn")
    p.add_argument("--prefill-rate", type=float, default=None, help="the prefill-heavy phases' req/s")
    p.add_argument("--decode-rate", type=float, default=None, help="the decode-heavy phase's req/s")
    p.add_argument("--seed", type=int, default=1, help="workload seed")
    p.add_argument("--calibrate", action="store_true", help="sweep rates on the static splits (no phases)")
    p.add_argument("--prefill-rates", type=floats, default=[16.0, 19.0, 23.0, 27.0],
                   help="--calibrate's prefill-heavy rates, req/s")
    p.add_argument("--decode-rates", type=floats, default=[3.8, 4.5, 5.2],
                   help="--calibrate's decode-heavy rates, req/s")
    p.add_argument("--quiet-cores", type=float, default=0.3, help="start a configuration's phases once others use less")
    p.add_argument("--quiet-wait", type=float, default=600.0, help="seconds to wait for that at most")
    p.add_argument("--replay-phase-secs", type=float, default=3600.0, help="the replay's seconds per phase")
    p.add_argument("--replay-restart-secs", type=float, default=300.0,
                   help="the replay's engine restart, seconds (DeepSeek-V4 on SGLang: assumed)")
    p.add_argument("--replay-only", action="store_true",
                   help="measure nothing: run the replay again into --out's split_controller.json")
    p.add_argument("--notes", default="", help="the reading of the results, stored with them")
    return p.parse_args(argv)


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # SIGTERM too stops the launcher and the Ray head (main's finally) before exiting


if __name__ == "__main__":
    signal.signal(signal.SIGINT, _interrupt)  # a background shell starts this with SIGINT ignored
    signal.signal(signal.SIGTERM, _interrupt)
    a = parse_args()
    if a.prefill_rate:
        WORKLOADS["prefill-heavy"]["rate"] = a.prefill_rate
    if a.decode_rate:
        WORKLOADS["decode-heavy"]["rate"] = a.decode_rate
    if a.replay_only:  # the live runs as they are, the replay again
        report = json.loads((a.out / "split_controller.json").read_text())
        report["replay"] = replays(a.replay_phase_secs, a.replay_restart_secs)
    else:
        report = main(a)
    if a.calibrate:
        path = Path(report["logs"]) / "calibration.json"
        path.write_text(json.dumps(report, indent=1) + "\n")
        print(f"calibration in {path}")
    else:
        report["notes"] = a.notes or report.get("notes", "")
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "split_controller.json").write_text(json.dumps(report, indent=1) + "\n")
        (a.out / "split_controller.md").write_text(markdown(report))
        print(json.dumps(report["targets"], indent=1))
