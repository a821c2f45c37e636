"""Start and stop ``pdserve router`` as a real subprocess for tests (by process group only)."""

from __future__ import annotations

import os
import sys

import httpx

from engines import ManagedProcess, free_port, spawn
from pd.util.wait import wait_until


class RouterProc(ManagedProcess):
    """``python -m pd.cli router`` on a free port with ``args`` (workers, policies, keys, ...)."""

    def __init__(self, args: list[str], log_dir: str):
        self.port = free_port()
        self.log_path = os.path.join(log_dir, f"router-{self.port}.log")
        self.proc = spawn([sys.executable, "-m", "pd.cli", "router", *args, "--port", str(self.port)],
                          self.log_path)

    def wait_ready(self, timeout: float = 60) -> None:
        """Poll /health until it answers 200.

        Raises:
            RuntimeError: the router exited. TimeoutError: no 200 within ``timeout`` s.
            Both messages carry the end of its log.
        """
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            return httpx.get(self.url + "/health", timeout=2).status_code == 200

        try:
            wait_until(ready, timeout, interval=0.2, what=f"router {self.url}/health answering 200",
                       retry=(httpx.HTTPError,))
        except TimeoutError as e:
            raise TimeoutError(f"{e}\n{self.log()[-3000:]}") from e


def pd_router(prefill_url: str, bootstrap_port: int, decode_url: str, log_dir: str, *extra: str) -> RouterProc:
    """A router over one prefill and one decode, health checks off."""
    return RouterProc(["--prefill", prefill_url, str(bootstrap_port), "--decode", decode_url,
                       "--health-check-interval", "0", *extra], log_dir)
