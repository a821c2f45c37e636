"""Start and stop reference engines as real subprocesses for tests (by PID / process group only)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ManagedProcess:
    """A server subprocess a test started (own process group, log in a file)."""

    port: int
    proc: subprocess.Popen
    log_path: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        from pd.cluster.procs import stop_group

        if self.proc.poll() is None:
            stop_group(self.proc.pid, grace=15)
            self.proc.wait(5)


def spawn(args: list[str], log_path: str) -> subprocess.Popen:
    """Start ``args`` from the repo root in a new process group, output to ``log_path``."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log_path, "wb") as logf:
        return subprocess.Popen(args, stdout=logf, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)


@dataclass
class Engine(ManagedProcess):
    mode: str
    port: int
    bootstrap_port: int | None
    proc: subprocess.Popen
    log_path: str
    args: list = field(default_factory=list)


def start_engine(mode: str, log_dir: str, *extra: str) -> Engine:
    """Start ``pdserve engine`` in ``mode`` on free ports; returns without waiting for readiness."""
    port = free_port()
    bport = free_port() if mode == "prefill" else None
    args = [sys.executable, "-m", "pd.cli", "engine", "--port", str(port), "--disaggregation-mode", mode, *extra]
    if bport is not None:
        args += ["--disaggregation-bootstrap-port", str(bport)]
    log_path = os.path.join(log_dir, f"{mode}-{port}.log")
    return Engine(mode, port, bport, spawn(args, log_path), log_path, args)


def wait_ready(engines: list[Engine], timeout: float = 180) -> None:
    deadline = time.time() + timeout
    pending = list(engines)
    while pending:
        for e in list(pending):
            if e.proc.poll() is not None:
                raise RuntimeError(f"{e.mode} engine exited with {e.proc.returncode}:\n{e.log()[-3000:]}")
            try:
                if httpx.get(e.url + "/health", timeout=2).status_code == 200:
                    pending.remove(e)
            except httpx.HTTPError:
                pass
        if time.time() > deadline:
            raise RuntimeError(f"engines not ready in {timeout}s: {[e.mode for e in pending]}")
        time.sleep(0.3)


def metric(engine: Engine, name: str, **labels) -> float:
    """Sum of the samples of ``name`` on the engine's /metrics whose labels include ``labels``."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    text = httpx.get(engine.url + "/metrics", timeout=10).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total
