"""What our benchmark processes and everything else take of this shared machine's CPU, from /proc: the machine's
busy seconds (/proc/stat), a process's (/proc/PID/stat utime + stime), and what is left for the rest -- so a
benchmark can wait for a quiet machine and report the load its numbers were measured under."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def busy_seconds() -> float:
    """CPU seconds the whole machine has been busy (user + nice + system + irq + softirq + steal)."""
    f = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in f[:8])
    return (user + nice + system + irq + softirq + steal) / TICK


def proc_seconds(pid: int) -> float:
    """CPU seconds of process ``pid`` (all its threads), 0 once it is gone."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(f[11]) + int(f[12])) / TICK


class CpuMeter:
    """Cores used over an interval: by the whole machine, by the given processes (ours), by this process."""

    def __init__(self, pids: list[int]):
        self.pids = pids
        self.t0, self.m0 = time.monotonic(), busy_seconds()
        self.o0 = {p: proc_seconds(p) for p in pids}
        self.s0 = proc_seconds(os.getpid())

    def read(self) -> dict:
        dt_ = max(time.monotonic() - self.t0, 1e-6)
        total = (busy_seconds() - self.m0) / dt_
        ours = sum(proc_seconds(p) - self.o0[p] for p in self.pids) / dt_
        client = (proc_seconds(os.getpid()) - self.s0) / dt_
        return {"machine_cores": total, "engines_router_cores": ours, "client_cores": client,
                "others_cores": max(0.0, total - ours - client), "seconds": dt_}


def wait_quiet(pids: list[int], max_cores: float, max_wait: float) -> dict:
    """Wait until processes other than ours use under ``max_cores`` cores over 5 s, at most ``max_wait`` s;
    returns the last reading (with ``waited_s``)."""
    t0 = time.monotonic()
    while True:
        m = CpuMeter(pids)
        time.sleep(5)
        r = m.read()
        r["waited_s"] = time.monotonic() - t0
        if r["others_cores"] < max_cores or r["waited_s"] >= max_wait:
            return r
        print(f"  machine busy: others use {r['others_cores']:.2f} cores; waiting", flush=True)


def descendants(roots: set[int]) -> set[int]:
    """``roots`` and every process below them (by parent PID)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = set(), list(roots)
    while todo:
        pid = todo.pop()
        if pid not in out:
            out.add(pid)
            todo += children.get(pid, [])
    return out


class CpuSampler:
    """Every 2 s: the machine's busy CPU seconds and those of our processes (this one, the Ray head's and the
    launcher's trees); :meth:`mark` reads both, and :meth:`others` the cores the rest used between two marks."""

    def __init__(self, roots: set[int]):
        self.roots = set(roots) | {os.getpid()}
        self.ours, self.last, self.lock = 0.0, {}, threading.Lock()
        self._stop = threading.Event()
        self._sample()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        with self.lock:
            now = {pid: proc_seconds(pid) for pid in descendants(self.roots)}
            self.ours += sum(max(0.0, v - self.last[p]) for p, v in now.items() if p in self.last)
            self.last = now

    def _run(self) -> None:
        while not self._stop.wait(2.0):
            self._sample()

    def mark(self) -> tuple[float, float, float]:
        """(monotonic time, machine busy seconds, ours)."""
        self._sample()
        return time.monotonic(), busy_seconds(), self.ours

    @staticmethod
    def others(a: tuple, b: tuple) -> dict:
        """Cores between marks ``a`` and ``b``: the machine's, ours, and the rest's."""
        dt_ = max(b[0] - a[0], 1e-6)
        machine_, ours = (b[1] - a[1]) / dt_, (b[2] - a[2]) / dt_
        return {"machine_cores": machine_, "ours_cores": ours, "others_cores": max(0.0, machine_ - ours)}

    def wait_quiet(self, max_cores: float, max_wait: float) -> dict:
        """Wait until the rest use under ``max_cores`` cores over 10 s, ``max_wait`` s at most; the last reading."""
        t0 = time.monotonic()
        while True:
            a = self.mark()
            time.sleep(10)
            r = self.others(a, self.mark())
            r["waited_s"] = time.monotonic() - t0
            if r["others_cores"] < max_cores or r["waited_s"] >= max_wait:
                return r
            print(f"  machine busy: others use {r['others_cores']:.2f} cores; waiting", flush=True)

    def stop(self) -> None:
        self._stop.set()
