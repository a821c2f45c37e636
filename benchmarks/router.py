"""PD router throughput, added latency and memory: pdserve's router vs SGLang's Rust gateway vs
SGLang's Python mini_lb vs no router at all, on the same stub engines, in one run.

What is measured
----------------
* **Contenders** (same stub engines, same load, one at a time):
  ``direct``  - the load generator talks to the decode stub itself (no router; the baseline);
  ``pdserve`` - ``pdserve router --prefill URL BOOTSTRAP_PORT --decode URL`` (defaults, log level
  warning);
  ``gateway`` - SGLang's Rust gateway, ``python -m sglang_router.launch_router --pd-disaggregation
  --prefill URL BOOTSTRAP_PORT --decode URL --policy round_robin`` (PyPI ``sglang-router``; the
  same pairing policy as ours; log level warn);
  ``mini_lb`` - SGLang's Python PD balancer from the same package (``launch_router --mini-lb``,
  as shipped: random pairing, a new HTTP session per request, uvicorn access log on).
* **Stub engines** (``benchmarks/stub_engine.py``): one prefill and one decode process, uvloop +
  httptools, SGLang's /generate answers (non-streaming JSON; ``stream: true``: 64 ``data:`` SSE
  events, one socket write per token, then ``data: [DONE]``), /health; they accept and count the
  bootstrap fields. After every measurement the stubs' counters are checked: for a router, prefill
  and decode each got one request per client request, all with ``bootstrap_host/port/room``.
* **Load**: ``wrk`` (C, one thread, closed loop: each of C connections sends its next request when
  the previous answer is complete) POSTs ``/generate`` with ``max_new_tokens`` 64, non-streaming
  (``generate``) and streaming (``stream``; a request is complete at the stream's last byte), at
  each concurrency in ``--concurrency`` (32 = DESIGN.md's anchor). Latency percentiles are wrk's
  (microsecond histogram of complete-answer latency).
* **Interleaving**: contenders are measured round-robin (every (mode, concurrency) cell measures
  all contenders back to back, the order rotating per round); reported numbers are medians over
  rounds. **Added latency** of a contender = its pX latency minus direct's pX latency in the same
  round, mode and concurrency (then the median over rounds): what putting the router in the path
  costs a client at that load. In a closed loop latency ~= concurrency / throughput, so at
  C=32 it mostly reflects the router's capacity; at C=1 (``--concurrency 1,...``) it is the
  per-hop cost alone.
* **CPU pinning** (Linux affinity, stated in the result): the contender runs on ``--router-cpus``
  (default CPU 0); the stubs, wrk and this script on ``--load-cpus`` (default CPU 1). So every
  router gets the same single core and the load side cannot steal it. Per measurement the CPU time
  (cores busy) of the contender, the stubs and wrk is recorded, and the machine's total, so a
  load-side bottleneck (load core ~1.0 busy) or other users of the machine ("foreign" CPU) show.
  A run with foreign CPU above 0.1 core on average is marked ``preliminary``. The router's CPU
  time per request (``router_cpu_us_per_request``) is reported too: unlike req/s it hardly moves
  when other processes share the core, so it compares routers fairly on a busy machine.
* **Memory** (``--memory-streams``, default 1000): a fresh router of each of ``--memory-contenders``
  (default pdserve and gateway), fresh stubs whose decode emits one token every
  ``--memory-token-interval`` s (64 tokens: a ~16 s stream); after a warm-up, N streams are opened
  at once and read to ``[DONE]``, in ``--memory-waves`` (2) waves 10 s apart (a second wave that
  peaks where the first did shows memory reused, not leaked). The router's RSS (sum over its process group, /proc VmRSS) is
  read before, sampled every 50 ms while they run (peak; VmHWM too), and 1 s, 10 s and
  ``--memory-settle`` s (65: past the 60 s idle keep-alive of pooled upstream connections) after
  the last stream ended. The decode stub's count of concurrently open streams proves all N were open
  at once. Goal (issue #6): <= 150 MB added at peak, back near baseline after.
* **Profile** (``--profile``; on when ``py-spy`` is found in the venv, ``.bench/tools/bin`` or
  PATH): py-spy samples the pdserve router (200 Hz; it pauses the router per sample, so req/s
  while sampled is lower) under the non-streaming load at the first concurrency; the top functions
  by own and inclusive samples, and by package, go into the result (the collapsed stacks into
  ``<out>_pyspy.txt`` next to it).

Setup (not project dependencies: the contenders, the load generator and the profiler are installed
for the benchmark only; ``make bench-router`` does all of it)
--------------------------------------------------------------------------------------------------
    apt-get install -y wrk                                           # Debian's wrk 4.1
    .venv/bin/pip install --no-deps --target .bench/sglang-router sglang-router==0.3.2 setproctitle
    .venv/bin/pip install --no-deps --target .bench/tools py-spy     # optional: the profile
(``.bench/`` is git-ignored; the gateway and mini_lb run with ``PYTHONPATH=.bench/sglang-router``
on the venv's Python, which already has their runtime dependencies aiohttp, fastapi, uvicorn and
orjson.) The script stops with a message naming the missing piece when one is missing.

Reproduce
---------
    make bench-router                       # = .venv/bin/python benchmarks/router.py (~15 min)
    make bench-router ARGS="--quick"        # one short round (smoke test, ~3 min)
    .venv/bin/python benchmarks/router.py --pdserve-commit HEAD   # the router as committed, not
                                            # the working tree (while router/ is being edited)

The result goes to ``benchmarks/results/router_<date>.json`` and ``.md`` (``--out`` to change).
Run it on an otherwise idle machine: with two cores, anything else running shows up in the numbers
(the result records how much).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import re
import resource
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from importlib import metadata
from pathlib import Path
from typing import Optional

from pd.procs import LoggedGroup, die_with_parent

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
SGLANG_ROUTER_DIR = REPO / ".bench" / "sglang-router"
TOOLS_BIN = REPO / ".bench" / "tools" / "bin"  # py-spy when installed for the benchmark only
SGLANG_ROUTER_PIN = "sglang-router==0.3.2"
INSTALL_HINT = (f"install it for the benchmark only (not a project dependency): `make bench-router`, or\n"
                f"  .venv/bin/pip install --no-deps --target .bench/sglang-router {SGLANG_ROUTER_PIN} setproctitle")
CONTENDERS = ("direct", "pdserve", "gateway", "mini_lb")
MODES = ("generate", "stream")
TOKENS = 64
CLK_TCK = os.sysconf("SC_CLK_TCK")
FOREIGN_CPU_LIMIT = 0.1  # cores used by other processes on average, above which a run is preliminary
GOALS = {"rps_vs_gateway": 1.0, "rps_vs_mini_lb": 5.0, "p99_vs_gateway_max": 1.5, "memory_added_mb_max": 150.0}


# ---- small helpers -------------------------------------------------------------------------------
def free_port() -> int:
    """A currently free TCP port on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_cpus(text: str) -> set[int]:
    """``"0"``, ``"0,1"`` or ``"0-3"`` -> a set of CPU numbers (ValueError naming the argument)."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ValueError(f"CPU list {text!r} is not like 0 / 0,1 / 0-3") from None
    if not cpus or not cpus <= set(range(os.cpu_count() or 1)):
        raise ValueError(f"CPU list {text!r} names CPUs this machine does not have (0-{(os.cpu_count() or 1) - 1})")
    return cpus


def median(xs: list[float]) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def rnd(x: Optional[float], nd: int = 3) -> Optional[float]:
    return None if x is None else round(x, nd)


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
    try:
        out["sglang-router"] = metadata.version("sglang-router")  # only when installed into the venv
    except metadata.PackageNotFoundError:
        found = [d.version for d in metadata.distributions(path=[str(SGLANG_ROUTER_DIR)])
                 if d.metadata["Name"] == "sglang-router"]
        out["sglang-router"] = found[0] if found else None
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
    return out


# ---- /proc accounting ----------------------------------------------------------------------------
def _proc_stat(pid: int) -> Optional[list[str]]:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()  # fields from "state" on (comm may hold spaces)


def group_pids(pgid: int) -> list[int]:
    """Live processes of process group ``pgid``."""
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            f = _proc_stat(int(d))
            if f is not None and int(f[2]) == pgid:
                pids.append(int(d))
    return pids


def group_cpu_seconds(pgid: int) -> float:
    """utime + stime of the live processes of a process group, in seconds."""
    total = 0
    for pid in group_pids(pgid):
        f = _proc_stat(pid)
        if f is not None:
            total += int(f[11]) + int(f[12])  # utime, stime (fields 14, 15 of /proc/PID/stat)
    return total / CLK_TCK


def group_rss_mb(pgid: int) -> float:
    """Resident set size of a process group, MB (1e6 bytes), from /proc/PID/status VmRSS."""
    kb = 0
    for pid in group_pids(pgid):
        try:
            m = re.search(r"VmRSS:\s+(\d+)", Path(f"/proc/{pid}/status").read_text())
        except OSError:
            continue
        if m:
            kb += int(m.group(1))
    return kb * 1024 / 1e6


def group_hwm_mb(pgid: int) -> float:
    kb = 0
    for pid in group_pids(pgid):
        try:
            m = re.search(r"VmHWM:\s+(\d+)", Path(f"/proc/{pid}/status").read_text())
        except OSError:
            continue
        if m:
            kb += int(m.group(1))
    return kb * 1024 / 1e6


def machine_busy_seconds() -> dict[str, float]:
    """Busy CPU seconds per CPU line of /proc/stat (``cpu`` = all), idle and iowait excluded."""
    out = {}
    for line in Path("/proc/stat").read_text().splitlines():
        if not line.startswith("cpu"):
            break
        name, *vals = line.split()
        v = [int(x) for x in vals[:8]]  # user nice system idle iowait irq softirq steal
        out[name] = (sum(v) - v[3] - v[4]) / CLK_TCK
    return out


# ---- processes ----------------------------------------------------------------------------------
def child_setup(cpus: set[int]):
    """preexec_fn for every child: pin it to ``cpus`` and have Linux SIGTERM it if this script dies."""
    def setup() -> None:
        os.sched_setaffinity(0, cpus)
        die_with_parent()
    return setup


def _stop_on_signal(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")  # unwinds through the finally blocks that stop the children


class Proc(LoggedGroup):
    """A subprocess in its own process group, pinned to ``cpus``, logging to ``logdir/<name>.log``."""

    def __init__(self, name: str, argv: list[str], cpus: set[int], logdir: Path, env: Optional[dict] = None):
        super().__init__(name, argv, logdir / f"{name}.log", env, preexec_fn=child_setup(cpus))


def http(method: str, url: str, body: Optional[dict] = None, timeout: float = 10.0) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def wait_ready(proc: Proc, url: str, timeout: float) -> None:
    """Poll ``url`` + /health until 200; RuntimeError with the log tail if the process exits or
    the timeout passes."""
    deadline = time.monotonic() + timeout
    while True:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited with {proc.proc.returncode}:\n{proc.tail()}")
        try:
            if http("GET", url + "/health", timeout=2)[0] == 200:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{proc.name} not healthy at {url} after {timeout:.0f}s:\n{proc.tail()}")
        time.sleep(0.2)


def request_body(stream: bool, tokens: int = TOKENS) -> dict:
    return {"text": "The capital of France is", "sampling_params": {"max_new_tokens": tokens, "temperature": 0},
            "stream": stream}


def smoke(name: str, url: str) -> None:
    """One non-streaming and one streaming /generate through ``url``: the answers must be whole."""
    status, data = http("POST", url + "/generate", request_body(False), timeout=30)
    if status != 200 or json.loads(data).get("meta_info", {}).get("completion_tokens") != TOKENS:
        raise RuntimeError(f"{name}: /generate answered {status} {data[:300]!r}")
    status, data = http("POST", url + "/generate", request_body(True), timeout=30)
    events = [e for e in data.split(b"\n\n") if e.startswith(b"data:")]
    if status != 200 or len(events) != TOKENS + 1 or events[-1] != b"data: [DONE]":
        raise RuntimeError(f"{name}: streaming /generate answered {status} with {len(events)} events "
                           f"(want {TOKENS} + [DONE]): {data[-300:]!r}")


class Stubs:
    """The prefill and decode stub engines."""

    def __init__(self, tag: str, cpus: set[int], logdir: Path, token_interval: float = 0.0):
        self.bootstrap_port = free_port()  # nobody listens: the stubs only count the field
        self.prefill_url = f"http://127.0.0.1:{free_port()}"
        self.decode_url = f"http://127.0.0.1:{free_port()}"
        stub = str(REPO / "benchmarks" / "stub_engine.py")
        self.prefill = Proc(f"{tag}stub_prefill", [sys.executable, stub, "--role", "prefill", "--port",
                                                   self.prefill_url.rsplit(":", 1)[1]], cpus, logdir)
        self.decode = Proc(f"{tag}stub_decode", [sys.executable, stub, "--role", "decode", "--port",
                                                 self.decode_url.rsplit(":", 1)[1], "--token-interval",
                                                 str(token_interval)], cpus, logdir)
        wait_ready(self.prefill, self.prefill_url, 30)
        wait_ready(self.decode, self.decode_url, 30)

    def stats(self) -> dict:
        return {"prefill": json.loads(http("GET", self.prefill_url + "/stub_stats")[1]),
                "decode": json.loads(http("GET", self.decode_url + "/stub_stats")[1])}

    def cpu_seconds(self) -> float:
        return group_cpu_seconds(self.prefill.pid) + group_cpu_seconds(self.decode.pid)

    def stop(self) -> None:
        self.prefill.stop()
        self.decode.stop()


def pdserve_snapshot(rev: str, workdir: Path) -> Path:
    """``pd/`` and ``router/`` of commit ``rev`` extracted into ``workdir``/pdserve_REV, laid out as
    the installed package maps them (``pd.router`` = ``router/``), so that commit's router can be
    measured while the working tree changes. RuntimeError if git cannot resolve ``rev``."""
    r = subprocess.run(["git", "rev-parse", "--verify", rev + "^{commit}"], cwd=REPO, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"--pdserve-commit {rev!r}: {r.stderr.strip()}")
    sha = r.stdout.strip()
    dest = workdir / f"pdserve_{sha[:10]}"
    dest.mkdir()
    archive = subprocess.run(["git", "archive", sha, "pd", "router"], cwd=REPO, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    (dest / "pd" / "router").symlink_to("../router")
    return dest


def contender_argv(name: str, stubs: Stubs, port: int, sglang_router_dir: Path,
                   pdserve_tree: Optional[Path] = None, custom: Optional[dict[str, str]] = None,
                   ) -> tuple[list[str], Optional[dict]]:
    """Command line and environment that start contender ``name`` on ``port``."""
    if custom and name in custom:
        return shlex.split(custom[name].format(python=sys.executable, prefill_url=stubs.prefill_url,
                                               bootstrap_port=stubs.bootstrap_port, decode_url=stubs.decode_url,
                                               port=port)), None
    if name == "pdserve":
        flags = ["router", "--prefill", stubs.prefill_url, str(stubs.bootstrap_port), "--decode", stubs.decode_url,
                 "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
        if pdserve_tree is None:
            return [str(VENV_BIN / "pdserve"), *flags], None
        # -P: the snapshot on PYTHONPATH, not the working tree (cwd), is what gets imported.
        return ([sys.executable, "-P", "-c", "from pd.cli import main; main()", *flags],
                dict(os.environ, PYTHONPATH=str(pdserve_tree)))
    env = dict(os.environ, PYTHONPATH=str(sglang_router_dir))
    common = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation", "--prefill",
              stubs.prefill_url, str(stubs.bootstrap_port), "--decode", stubs.decode_url, "--host", "127.0.0.1",
              "--port", str(port)]
    if name == "gateway":
        return common + ["--policy", "round_robin", "--prometheus-port", str(free_port()), "--log-level", "warn"], env
    if name == "mini_lb":
        return common + ["--mini-lb"], env
    raise ValueError(f"unknown contender {name!r}")


class Contender:
    """One contender: a router process in front of the stubs, or ``direct`` (the decode stub)."""

    def __init__(self, name: str, stubs: Stubs, cpus: set[int], logdir: Path, sglang_router_dir: Path, tag: str = "",
                 pdserve_tree: Optional[Path] = None, custom: Optional[dict[str, str]] = None):
        self.name = name
        self.proc: Optional[Proc] = None
        self.argv: Optional[list[str]] = None
        if name == "direct":
            self.url = stubs.decode_url
            return
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.argv, env = contender_argv(name, stubs, port, sglang_router_dir, pdserve_tree, custom)
        self.proc = Proc(tag + name, self.argv, cpus, logdir, env)

    def ready(self, timeout: float = 120) -> None:
        if self.proc is not None:
            wait_ready(self.proc, self.url, timeout)
        # The gateway answers /health before its workers are registered: retry the first requests.
        deadline = time.monotonic() + timeout
        while True:
            try:
                smoke(self.name, self.url)
                return
            except (RuntimeError, OSError) as e:
                if time.monotonic() > deadline or (self.proc is not None and not self.proc.alive()):
                    raise RuntimeError(f"{e}\n{self.proc.tail() if self.proc else ''}") from None
                time.sleep(0.5)

    def cpu_seconds(self) -> float:
        return 0.0 if self.proc is None else group_cpu_seconds(self.proc.pid)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


# ---- load: wrk ----------------------------------------------------------------------------------
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
    line = next((l for l in r.stdout.splitlines() if l.startswith("WRKJSON ")), None)
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
    cpu_c, cpu_s, cpu_own = c.cpu_seconds() - cpu_c0, stubs.cpu_seconds() - cpu_s0, group_cpu_seconds(own_pgid) - cpu_own0
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


# ---- the main comparison ------------------------------------------------------------------------
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
        if row["contender"] in ("direct", "gateway", "mini_lb"):
            continue
        for other in ("gateway", "mini_lb"):
            o = next((r for r in rows if (r["mode"], r["concurrency"], r["contender"]) ==
                      (row["mode"], row["concurrency"], other)), None)
            if o and o["rps"]:
                row[f"rps_vs_{other}"] = row["rps"] / o["rps"]
                row[f"p99_vs_{other}"] = row["p99_ms"] / o["p99_ms"] if o["p99_ms"] else None
                mine, theirs = row["router_cpu_us_per_request"], o["router_cpu_us_per_request"]
                row[f"cpu_per_request_vs_{other}"] = mine / theirs if mine and theirs else None
    return rows


# ---- memory under many slow streams -------------------------------------------------------------
async def _slow_streams(url: str, n: int, tokens: int, pgid: int, samples: list[tuple[float, float]]) -> dict:
    import aiohttp

    stop = asyncio.Event()

    async def sample():
        t0 = time.perf_counter()
        while not stop.is_set():
            samples.append((time.perf_counter() - t0, group_rss_mb(pgid)))
            try:
                await asyncio.wait_for(stop.wait(), 0.05)
            except asyncio.TimeoutError:
                pass

    async def one(session) -> tuple[int, bool]:
        events, done = 0, False
        async with session.post(url + "/generate", json=request_body(True, tokens)) as r:
            if r.status != 200:
                return 0, False
            buf = b""
            async for chunk in r.content.iter_any():
                buf += chunk
                while (cut := buf.find(b"\n\n")) >= 0:
                    ev, buf = buf[:cut], buf[cut + 2:]
                    if ev == b"data: [DONE]":
                        done = True
                    elif ev.startswith(b"data:"):
                        events += 1
        return events, done

    sampler = asyncio.ensure_future(sample())
    t0 = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        results = await asyncio.gather(*(one(session) for _ in range(n)), return_exceptions=True)
    elapsed = time.perf_counter() - t0
    stop.set()
    await sampler
    whole = sum(1 for r in results if not isinstance(r, BaseException) and r == (tokens, True))
    failures = Counter(type(r).__name__ if isinstance(r, BaseException) else f"events={r[0]},done={r[1]}"
                       for r in results if isinstance(r, BaseException) or r != (tokens, True))
    return {"streams": n, "whole_streams": whole, "failures": dict(failures), "seconds": elapsed}


def memory(args, logdir: Path, name: str) -> dict:
    """RSS of a fresh ``name`` router before / during / after ``args.memory_waves`` waves of
    ``args.memory_streams`` concurrent slow streams (a second wave peaking where the first did shows
    memory reused, not leaked)."""
    stubs = Stubs("mem_", args.load_cpus, logdir, token_interval=args.memory_token_interval)
    c = Contender(name, stubs, args.router_cpus, logdir, args.sglang_router_dir, tag="mem_",
                  pdserve_tree=args.pdserve_tree, custom=args.custom)
    try:
        c.ready()
        # Warm-up: code paths, pools and caches the router keeps anyway.
        for _ in range(64):
            http("POST", c.url + "/generate", request_body(False), timeout=30)
        for _ in range(4):
            http("POST", c.url + "/generate", request_body(True, 2), timeout=30)
        time.sleep(1.0)
        pgid = c.proc.pid
        before = group_rss_mb(pgid)
        s0 = stubs.stats()
        samples: list[tuple[float, float]] = []
        waves = []
        for wave in range(args.memory_waves):
            if wave:
                time.sleep(10.0)  # between waves: what the first one left behind, then the same load again
            print(f"[router bench] memory: {args.memory_streams} slow streams through {name}, wave {wave + 1}/"
                  f"{args.memory_waves} (RSS {group_rss_mb(pgid):.1f} MB)", flush=True)
            wave_samples: list[tuple[float, float]] = []
            res = asyncio.run(_slow_streams(c.url, args.memory_streams, TOKENS, pgid, wave_samples))
            s1 = stubs.stats()
            res["max_concurrent_streams_at_decode"] = s1["decode"]["max_active_streams"]
            res["peak_mb"] = rnd(max(r for _, r in wave_samples), 1) if wave_samples else None
            res["rss_at_start_mb"] = rnd(wave_samples[0][1], 1) if wave_samples else None
            waves.append(res)
            t0 = samples[-1][0] + 10.0 if samples else 0.0
            samples += [(t0 + t, r) for t, r in wave_samples]
        time.sleep(1.0)
        after_1s = group_rss_mb(pgid)
        time.sleep(9.0)
        after_10s = group_rss_mb(pgid)
        time.sleep(max(0.0, args.memory_settle - 10.0))
        after_settle = group_rss_mb(pgid)
        peak = max(rss for _, rss in samples) if samples else None
        out = {
            "contender": name, "command": shlex.join(c.argv),
            "streams": args.memory_streams, "waves": args.memory_waves,
            "whole_streams": sum(w["whole_streams"] for w in waves),
            "failures": dict(sum((Counter(w["failures"]) for w in waves), Counter())),
            "token_interval_s": args.memory_token_interval, "tokens_per_stream": TOKENS,
            "max_concurrent_streams_at_decode": max(w["max_concurrent_streams_at_decode"] for w in waves),
            "prefill_requests": stubs.stats()["prefill"]["requests"] - s0["prefill"]["requests"],
            "per_wave": waves,
            "rss_mb": {"before": rnd(before, 1), "peak_sampled": rnd(peak, 1), "vm_hwm": rnd(group_hwm_mb(pgid), 1),
                       "after_1s": rnd(after_1s, 1), "after_10s": rnd(after_10s, 1),
                       f"after_{args.memory_settle:.0f}s": rnd(after_settle, 1)},
            "added_mb_peak": rnd(peak - before, 1) if peak else None,
            "added_mb_after_10s": rnd(after_10s - before, 1),
            "settle_s": args.memory_settle, "added_mb_after_settle": rnd(after_settle - before, 1),
            "rss_timeline_mb": [[round(t, 2), round(r, 1)] for t, r in samples[::10]],
        }
        print(f"[router bench] memory {name}: before {before:.1f} MB, peak per wave "
              f"{', '.join(str(w['peak_mb']) for w in waves)} MB, after 10 s {after_10s:.1f} MB, "
              f"after {args.memory_settle:.0f} s {after_settle:.1f} MB; {out['whole_streams']}/"
              f"{args.memory_streams * args.memory_waves} whole streams, max open at decode "
              f"{out['max_concurrent_streams_at_decode']}", flush=True)
        return out
    finally:
        c.stop()
        stubs.stop()


# ---- profile ------------------------------------------------------------------------------------
# A sample whose innermost Python frame is the event loop's run(): time inside the C event loop
# (uvloop: epoll, socket reads/writes, httptools parsing, scheduling callbacks).
EVENT_LOOP = "event loop (uvloop C code: I/O, HTTP parsing, scheduling)"
LOOP_RUN = re.compile(r"^(Runner\.run \(asyncio/runners\.py\)|run \(uvloop/__init__\.py\))$")


def _package(frame: str) -> str:
    """``func (path/file.py)`` -> ``pd.router``, ``aiohttp``, ``asyncio``, ``json``, ... (py-spy
    shortens paths to the part below site-packages or the source root)."""
    m = re.search(r"\(([^:)]+)\)?$", frame)
    path = m.group(1) if m else frame
    if re.match(r"(pd/)?router/", path):
        return "pd.router"
    top = path.split("/", 1)[0]
    return top.removesuffix(".py") if "/" in path or path.endswith(".py") else path


def analyze_profile(collapsed: str, top: int = 25) -> dict:
    """Where the router's CPU goes, from py-spy's collapsed stacks (``frame;frame;... count``
    lines, frames ``func (file:line)``): top functions by own samples (innermost frame) and by
    inclusive samples (anywhere in the stack, entry-point frames left out), and own and inclusive
    samples per package. Percentages are of all samples taken."""
    own, incl, pkg_own, pkg_incl = Counter(), Counter(), Counter(), Counter()
    total = 0
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";") if f]  # fold the lines of one function
        # The entry point down to the loop's run() is in every stack: only what runs above it is work.
        runs = [i for i, f in enumerate(frames) if LOOP_RUN.match(f)]
        work = frames[runs[-1] + 1:] if runs else frames
        leaf = work[-1] if work else EVENT_LOOP
        own[leaf] += n
        pkg_own[EVENT_LOOP if leaf == EVENT_LOOP else _package(leaf)] += n
        for f in set(work):
            incl[f] += n
        for p in {_package(f) for f in work}:
            pkg_incl[p] += n

    def pct(c: Counter, key: str):
        return [{key: f, "samples": n, "pct": round(100 * n / total, 1)} for f, n in c.most_common(top)]

    return {"samples": total, "top_own": pct(own, "frame"), "top_inclusive": pct(incl, "frame"),
            "by_package_own": pct(pkg_own, "package"), "by_package_inclusive": pct(pkg_incl, "package")}


def find_pyspy() -> Optional[str]:
    return shutil.which("py-spy", path=f"{VENV_BIN}:{TOOLS_BIN}") or shutil.which("py-spy")


PROFILE_RATE = 200  # samples/s; py-spy pauses the process per sample (whole stacks; --nonblocking tears them)


def make_profile_hook(args, workdir: Path, out_stacks: Path):
    if not args.profile:
        return None
    pyspy = find_pyspy()

    def hook(c: Optional[Contender], script: Optional[Path]) -> Optional[dict]:
        if c is None or script is None:
            return None
        conc = args.concurrency[0]
        raw = workdir / "pyspy.txt"
        print(f"[router bench] profiling pdserve router (py-spy, {args.profile_duration:.0f} s, c={conc})", flush=True)
        spy = subprocess.Popen([pyspy, "record", "--pid", str(c.proc.pid), "--duration", str(round(args.profile_duration)),
                                "--rate", str(PROFILE_RATE), "--format", "raw", "--output", str(raw)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               preexec_fn=child_setup(args.load_cpus))
        time.sleep(1.0)
        w = run_wrk(c.url, script, conc, args.profile_duration, args.load_cpus)
        spy_out = spy.communicate(timeout=120)[0].decode(errors="replace")
        if spy.returncode != 0 or not raw.exists():
            return {"error": f"py-spy failed ({spy.returncode}): {spy_out[-500:]}"}
        text = raw.read_text()
        out_stacks.write_text(text)
        res = analyze_profile(text)
        res.update({"rps_while_profiled": round(w["requests"] / (w["duration_us"] / 1e6), 1), "concurrency": conc,
                    "mode": "generate", "rate_hz": PROFILE_RATE, "seconds": args.profile_duration,
                    "collapsed_stacks": str(out_stacks.relative_to(REPO)) if out_stacks.is_relative_to(REPO)
                    else str(out_stacks)})
        return res

    return hook


# ---- report -------------------------------------------------------------------------------------
def fmt(x, nd=1, dash="-"):
    return dash if x is None else f"{x:.{nd}f}"


def markdown(result: dict) -> str:
    m, cfg = result["machine"], result["config"]
    lines = [f"# PD router benchmark ({result['date']}){' - PRELIMINARY' if result['preliminary'] else ''}", "",
             f"{m['cpu_model']}, {m['cpu_cores']} cores; sglang-router {result['versions'].get('sglang-router')}, "
             f"pdserve {result['versions'].get('pdserve_commit')}; contender on CPU {cfg['router_cpus']}, stubs + wrk on "
             f"CPU {cfg['load_cpus']}; {cfg['rounds']} interleaved rounds x {cfg['duration_s']:.0f} s, medians. "
             f"Stub engines, POST /generate max_new_tokens {TOKENS}; `stream` = {TOKENS}-event SSE streams "
             f"(req/s = streams/s). Added latency = contender minus direct at the same load and round. "
             f"CPU = cores busy (router / stubs+wrk / other processes on the machine); router CPU us/req = the "
             f"router process's CPU time per request.", "",
             f"Command: `{result['command']}`", ""]
    if result["preliminary"]:
        lines += [f"**Preliminary**: {result['preliminary_reason']}", ""]
    lines += ["| mode | conc | contender | req/s | p50 ms | p99 ms | added p50 ms | added p99 ms | router CPU us/req "
              "| CPU router | CPU load | CPU other | errors | PD check |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["summary"]:
        lines.append(f"| {r['mode']} | {r['concurrency']} | {r['contender']} | {fmt(r['rps'], 0)} | {fmt(r['p50_ms'], 2)} "
                     f"| {fmt(r['p99_ms'], 2)} | {fmt(r['added_p50_ms'], 2)} | {fmt(r['added_p99_ms'], 2)} "
                     f"| {fmt(r['router_cpu_us_per_request'], 0)} | {fmt(r['cpu_contender'], 2)} | {fmt(r['cpu_load'], 2)} | {fmt(r['cpu_foreign'], 2)} "
                     f"| {r['errors']} | {'ok' if r['dispatch_check_ok'] else 'FAIL'} |")
    lines += ["", "Ratios to the references (same cell): req/s ratio, p99 ratio; goals: >= 1.0x gateway req/s, >= 5x mini_lb, "
              "p99 <= 1.5x gateway. CPU/req = the router's CPU time per request relative to the gateway's (robust "
              "to other load on the machine: < 1 means cheaper).", "",
              "| router | mode | conc | req/s vs gateway | req/s vs mini_lb | p99 vs gateway | CPU/req vs gateway |",
              "|---|---|---|---|---|---|---|"]
    for r in result["summary"]:
        if "rps_vs_gateway" in r or "rps_vs_mini_lb" in r:
            x = lambda k: fmt(r.get(k), 2) + ("x" if r.get(k) is not None else "")  # noqa: E731
            lines.append(f"| {r['contender']} | {r['mode']} | {r['concurrency']} | {x('rps_vs_gateway')} "
                         f"| {x('rps_vs_mini_lb')} | {x('p99_vs_gateway')} | {x('cpu_per_request_vs_gateway')} |")
    if result.get("memory"):
        lines += ["", "Memory: N concurrent slow streams (one token per "
                  f"{cfg['memory_token_interval_s']} s, {TOKENS} tokens) through a fresh router; RSS in MB "
                  "(goal: <= 150 MB added, back near baseline).", "",
                  "| contender | streams x waves | whole | max open at decode | before | peak per wave | added at peak "
                  f"| after 1 s | after 10 s | after {cfg['memory_settle_s']:.0f} s |", "|---|---|---|---|---|---|---|---|---|---|"]
        settle_key = f"after_{cfg['memory_settle_s']:.0f}s"
        for mm in result["memory"]:
            if "error" in mm:
                lines.append(f"| {mm['contender']} | error: {mm['error'][:120]} |")
                continue
            r = mm["rss_mb"]
            lines.append(f"| {mm['contender']} | {mm['streams']} x {mm.get('waves', 1)} | {mm['whole_streams']} "
                         f"| {mm['max_concurrent_streams_at_decode']} | {fmt(r['before'])} "
                         f"| {' / '.join(fmt(w.get('peak_mb')) for w in mm.get('per_wave', [])) or fmt(r['peak_sampled'])} "
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


# ---- main ---------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contenders", default=",".join(CONTENDERS), help="comma list of %(default)s")
    p.add_argument("--modes", default=",".join(MODES), help="comma list of %(default)s")
    p.add_argument("--concurrency", default="32,128", help="comma list of wrk connection counts (default %(default)s)")
    p.add_argument("--duration", type=float, default=10.0, help="seconds per measurement (default %(default)s)")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds of warm-up load per contender and mode")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians are reported (default %(default)s)")
    p.add_argument("--router-cpus", default="0", help="CPUs of the contender (default %(default)s)")
    p.add_argument("--load-cpus", default="1", help="CPUs of the stubs, wrk and this script (default %(default)s)")
    p.add_argument("--memory-streams", type=int, default=1000, help="concurrent slow streams; 0 = skip (default %(default)s)")
    p.add_argument("--memory-token-interval", type=float, default=0.25, help="seconds between tokens of a slow stream")
    p.add_argument("--memory-waves", type=int, default=2,
                   help="waves of --memory-streams, 10 s apart (default %(default)s)")
    p.add_argument("--memory-settle", type=float, default=65.0,
                   help="seconds after the streams end for the last RSS reading (default %(default)s: past the "
                        "routers' 60 s idle keep-alive of pooled upstream connections)")
    p.add_argument("--memory-contenders", default="pdserve,gateway", help="routers measured for memory (default %(default)s)")
    p.add_argument("--profile", action=argparse.BooleanOptionalAction, default=None,
                   help="py-spy profile of the pdserve router (default: on when py-spy is installed)")
    p.add_argument("--profile-duration", type=float, default=10.0)
    p.add_argument("--sglang-router-dir", type=Path, default=SGLANG_ROUTER_DIR,
                   help="where sglang-router is installed with pip --target (default %(default)s)")
    p.add_argument("--pdserve-commit", default=None, metavar="REV",
                   help="measure the router of this git commit (extracted to a temp dir) instead of the working tree")
    p.add_argument("--custom", action="append", default=[], metavar="NAME=COMMAND",
                   help="an extra contender (e.g. a router prototype): NAME=COMMAND with placeholders {python} "
                        "{prefill_url} {bootstrap_port} {decode_url} {port}; it must serve GET /health and "
                        "POST /generate on {port}; add NAME to --contenders (repeatable)")
    p.add_argument("--quick", action="store_true", help="one short round at c=32, 200 memory streams (smoke test)")
    p.add_argument("--out", type=Path, default=None, help="result JSON path (default benchmarks/results/router_<date>.json)")
    args = p.parse_args(argv)
    if args.quick:
        args.duration, args.warmup, args.rounds, args.concurrency = 3.0, 1.0, 1, "32"
        args.memory_streams, args.profile_duration, args.memory_settle = min(args.memory_streams, 200), 5.0, 10.0
    args.contenders = [c for c in args.contenders.split(",") if c]
    custom = {}
    for spec in args.custom:
        name, sep, cmd = spec.partition("=")
        if not sep or not name or not cmd or name in CONTENDERS:
            p.error(f"--custom {spec!r}: want NAME=COMMAND with a NAME other than {', '.join(CONTENDERS)}")
        custom[name] = cmd
    args.custom = custom
    args.modes = [m for m in args.modes.split(",") if m]
    args.memory_contenders = [c for c in args.memory_contenders.split(",") if c] if args.memory_streams > 0 else []
    try:
        args.concurrency = [int(c) for c in str(args.concurrency).split(",") if c]
        args.router_cpus, args.load_cpus = parse_cpus(args.router_cpus), parse_cpus(args.load_cpus)
    except ValueError as e:
        p.error(str(e))
    for c in args.contenders + args.memory_contenders:
        if c not in CONTENDERS and c not in custom:
            p.error(f"unknown contender {c!r}; choose from {', '.join(CONTENDERS + tuple(custom))}")
    if "direct" not in args.contenders:
        p.error("--contenders must include direct (added latency is measured against it)")
    if "direct" in args.memory_contenders:
        p.error("--memory-contenders: direct has no router process to measure")
    for m in args.modes:
        if m not in MODES:
            p.error(f"unknown mode {m!r}; choose from {', '.join(MODES)}")
    if args.rounds < 1 or args.duration < 1 or args.memory_waves < 1 or any(c < 1 for c in args.concurrency):
        p.error("--rounds, --duration, --memory-waves and --concurrency must be >= 1")
    if args.router_cpus & args.load_cpus:
        print(f"[router bench] warning: router CPUs {sorted(args.router_cpus)} and load CPUs "
              f"{sorted(args.load_cpus)} overlap", file=sys.stderr)
    return args


def preflight(args) -> None:
    """Stop with a clear message when a tool the run needs is missing."""
    if shutil.which("wrk") is None:
        sys.exit("router bench: `wrk` (the load generator) is not installed: apt-get install -y wrk "
                 "(make bench-router does it)")
    if {"gateway", "mini_lb"} & set(args.contenders + args.memory_contenders):
        if not (args.sglang_router_dir / "sglang_router" / "launch_router.py").exists():
            sys.exit(f"router bench: SGLang's router (PyPI sglang-router) is not in {args.sglang_router_dir}; "
                     f"{INSTALL_HINT}")
        if not (args.sglang_router_dir / "setproctitle").exists():
            sys.exit(f"router bench: setproctitle (needed by sglang_router.launch_router) is not in "
                     f"{args.sglang_router_dir}; {INSTALL_HINT}")
    has_pyspy = find_pyspy() is not None
    if args.profile and not has_pyspy:
        sys.exit("router bench: --profile needs py-spy: `make bench-router` installs it into .bench/tools, or "
                 ".venv/bin/pip install py-spy")
    if args.profile is None:
        args.profile = has_pyspy and "pdserve" in args.contenders and "generate" in args.modes


def main(argv=None) -> None:
    args = parse_args(argv)
    preflight(args)
    # Stop the stubs and routers on Ctrl-C / SIGTERM, also when started in the background (where
    # a shell leaves SIGINT ignored).
    signal.signal(signal.SIGTERM, _stop_on_signal)
    signal.signal(signal.SIGINT, _stop_on_signal)
    # Many sockets: 1000 streams are 1000 client + up to 2000 upstream connections in the router.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    os.sched_setaffinity(0, args.load_cpus)  # this script (the memory client) runs with the load
    now = dt.datetime.now(dt.timezone.utc)
    out = args.out or REPO / "benchmarks" / "results" / f"router_{now.date().isoformat()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    own_pgid = os.getpgid(0)
    with tempfile.TemporaryDirectory(prefix="router_bench_") as tmp:
        workdir = Path(tmp)
        logdir = workdir / "logs"
        logdir.mkdir()
        loadavg_before = Path("/proc/loadavg").read_text().split()[:3]
        try:
            args.pdserve_tree = pdserve_snapshot(args.pdserve_commit, workdir) if args.pdserve_commit else None
            res = compare(args, workdir, logdir, own_pgid, make_profile_hook(args, workdir, out.with_name(out.stem + "_pyspy.txt")))
            mem = []
            for name in args.memory_contenders:
                try:
                    mem.append(memory(args, logdir, name))
                except RuntimeError as e:
                    mem.append({"contender": name, "error": str(e)[-2000:]})
        except RuntimeError as e:
            sys.exit(f"router bench failed: {e}\nlogs: " + "; ".join(
                f"{p.name}: {p.read_text(errors='replace')[-1500:]}" for p in sorted(logdir.glob("*.log"))))
    foreign = median([c["cpu_cores"]["foreign"] for c in res["cells"]]) or 0.0
    foreign_max = max((c["cpu_cores"]["foreign"] for c in res["cells"]), default=0.0)
    preliminary = foreign > FOREIGN_CPU_LIMIT
    result = {
        "benchmark": "router", "date": now.isoformat(timespec="seconds"),
        "command": shlex.join([Path(sys.executable).relative_to(REPO).as_posix() if Path(sys.executable).is_relative_to(REPO)
                               else sys.executable, "benchmarks/router.py", *(argv if argv is not None else sys.argv[1:])]),
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
        "goals": GOALS,
        "contender_commands": res["commands"], "custom_contenders": args.custom or None,
        "summary": [{k: (rnd(v) if isinstance(v, float) else v) for k, v in r.items()} for r in res["summary"]],
        "memory": mem, "profile": res["profile"],
        "cells": [{**c, "rps": rnd(c["rps"], 1), "cpu_cores": {k: rnd(v) for k, v in c["cpu_cores"].items()}}
                  for c in res["cells"]],
    }
    out.write_text(json.dumps(result, indent=1) + "\n")
    md = out.with_suffix(".md")
    md.write_text(markdown(result))
    print(markdown(result))
    print(f"[router bench] wrote {out.relative_to(REPO) if out.is_relative_to(REPO) else out} and {md.name}")


if __name__ == "__main__":
    main()
