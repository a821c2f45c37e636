"""Start and stop reference engines as real subprocesses for tests (by PID / process group only)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field

import httpx

from pd.util.ports import free_port
from pd.util.wait import wait_until

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    """Start ``args`` from the repo root in a new process group, output to ``log_path``; the child gets SIGTERM
    when the test process dies (a killed test run leaves no engine, router or Prometheus behind)."""
    from pd.cluster.procs import die_with_parent

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log_path, "wb") as logf:
        return subprocess.Popen(args, stdout=logf, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True,
                                preexec_fn=die_with_parent)


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


def wait_until_ready(proc: ManagedProcess, path: str = "/health", timeout: float = 60) -> None:
    """Poll ``proc``'s ``path`` until it answers 200.

    Raises:
        RuntimeError: the process exited (the message carries the end of its log).
        TimeoutError: no 200 within ``timeout`` s.
    """
    def ready() -> bool:
        if proc.proc.poll() is not None:
            raise RuntimeError(f"{proc.log_path}: process exited with {proc.proc.returncode}:\n{proc.log()[-3000:]}")
        return httpx.get(proc.url + path, timeout=2).status_code == 200

    wait_until(ready, timeout, interval=0.2, what=f"{proc.url}{path} answering 200", retry=(httpx.HTTPError,))


def wait_ready(engines: list[Engine], timeout: float = 180) -> None:
    """Wait until every engine's /health answers 200, all within one ``timeout`` (s).

    Raises:
        RuntimeError: an engine exited. TimeoutError: not all ready in time.
    """
    pending = list(engines)

    def all_ready() -> bool:
        for e in list(pending):
            if e.proc.poll() is not None:
                raise RuntimeError(f"{e.mode} engine exited with {e.proc.returncode}:\n{e.log()[-3000:]}")
            try:
                if httpx.get(e.url + "/health", timeout=2).status_code == 200:
                    pending.remove(e)
            except httpx.HTTPError:
                pass
        return not pending

    try:
        wait_until(all_ready, timeout, interval=0.3, what="every engine's /health answering 200", retry=())
    except TimeoutError as e:
        raise TimeoutError(f"engines not ready in {timeout}s: {[p.mode for p in pending]}") from e


def _metric_sum(text: str, name: str, labels: dict) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def metric(engine: Engine, name: str, **labels) -> float:
    """Sum of the samples of ``name`` on the engine's /metrics whose labels include ``labels``."""
    return _metric_sum(httpx.get(engine.url + "/metrics", timeout=10).text, name, labels)


async def async_metric(engine: Engine, name: str, **labels) -> float:
    """``metric`` without blocking the event loop (for tests whose own requests run in it)."""
    async with httpx.AsyncClient(timeout=10) as c:
        return _metric_sum((await c.get(engine.url + "/metrics")).text, name, labels)
