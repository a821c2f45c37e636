"""Processes and /proc accounting for the router benchmark (benchmarks/router.py): children pinned to CPUs that
die with the benchmark, their CPU time and RSS summed over their process group, the machine's busy time, and a
small HTTP client for health checks and smoke requests."""

from __future__ import annotations

import json
import os
import re
import statistics
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional

from pd.cluster.procs import LoggedGroup, die_with_parent
from pd.util.wait import wait_until

REPO = Path(__file__).resolve().parent.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")


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


def _group_status_mb(pgid: int, field: str) -> float:
    """Sum of a /proc/PID/status memory field (``VmRSS``, ``VmHWM``) over a process group, MB (1e6 bytes)."""
    kb = 0
    for pid in group_pids(pgid):
        try:
            m = re.search(field + r":\s+(\d+)", Path(f"/proc/{pid}/status").read_text())
        except OSError:
            continue
        if m:
            kb += int(m.group(1))
    return kb * 1024 / 1e6


def group_rss_mb(pgid: int) -> float:
    """Resident set size of a process group, MB."""
    return _group_status_mb(pgid, "VmRSS")


def group_hwm_mb(pgid: int) -> float:
    """Peak resident set size (high-water mark) of a process group, MB."""
    return _group_status_mb(pgid, "VmHWM")


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


def child_setup(cpus: set[int]):
    """preexec_fn for every child: pin it to ``cpus`` and have Linux SIGTERM it if this script dies."""
    def setup() -> None:
        os.sched_setaffinity(0, cpus)
        die_with_parent()
    return setup


def stop_on_signal(signum, frame):
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
    def healthy() -> bool:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited with {proc.proc.returncode}:\n{proc.tail()}")
        return http("GET", url + "/health", timeout=2)[0] == 200

    try:
        wait_until(healthy, timeout, interval=0.2, what=f"{proc.name} /health at {url}", retry=(OSError,))
    except TimeoutError:
        raise RuntimeError(f"{proc.name} not healthy at {url} after {timeout:.0f}s:\n{proc.tail()}") from None
