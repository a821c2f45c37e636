"""Active health checks of every worker (they take failing workers out of routing and put them
back once they pass again) and the /health_generate fan-out.

A worker is taken out after ``failure_threshold`` failed probes in a row and put back after
``success_threshold`` passed probes in a row (sglang-router's ``--health-*`` semantics). The
result feeds ``Worker.healthy``, the policies' filter and ``pdserve_router_worker_healthy``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Optional

import httpx

from pd.router.client import fetch, started
from pd.router.config import HealthCheckConfig
from pd.router.errors import TIMEOUT_ERRORS, UPSTREAM_ERRORS
from pd.router.workers import Worker, WorkerPool

log = logging.getLogger("pd.router")

# seconds for one GET /health_generate; the engines give up after 20 s (SGLang's default)
HEALTH_GENERATE_TIMEOUT = 25.0


async def probe(client: httpx.AsyncClient, worker: Worker, path: str, timeout: float,
                headers: Optional[dict] = None) -> Optional[str]:
    """GET ``path`` on ``worker`` within ``timeout`` seconds in all; None when it answered 200,
    else what went wrong."""
    try:
        r = await fetch(client, "GET", worker.url + path, timeout, headers=headers)
        return None if r.status_code == 200 else f"HTTP {r.status_code}"
    except TIMEOUT_ERRORS:
        return f"no answer within {timeout:g}s"
    except UPSTREAM_ERRORS as e:
        return str(e) or repr(e)


class HealthMonitor:
    """Probes every worker's health endpoint every ``interval_secs`` (0 = never).

    Args:
        pool: the workers.
        config: interval, timeout, thresholds, endpoint.
        headers: headers of every probe, besides each worker's own (``Worker.headers``: its key).
    """

    def __init__(self, pool: WorkerPool, config: HealthCheckConfig, headers: Optional[dict] = None):
        self.pool = pool
        self.cfg = config
        self.headers = headers
        self.client: Optional[httpx.AsyncClient] = None
        self._task: Optional[asyncio.Task] = None

    def record(self, w: Worker, err: Optional[str]) -> None:
        """Count one probe result and take the worker out / put it back at the thresholds."""
        if err is None:
            w.health_failures = 0
            w.health_successes += 1
            w.breaker.probe_passed()
            if not w.healthy and w.health_successes >= self.cfg.success_threshold:
                log.warning("%s worker %s passes its health checks again: back in routing", w.role, w.url)
                w.set_healthy(True)
        else:
            w.health_successes = 0
            w.health_failures += 1
            if w.healthy and w.health_failures >= self.cfg.failure_threshold:
                log.warning("%s worker %s failed %d health checks in a row (%s): taken out of routing", w.role, w.url,
                            w.health_failures, err)
                w.set_healthy(False)

    async def check_all(self) -> None:
        """One probe round over every worker, concurrently."""
        workers = self.pool.all
        results = await asyncio.gather(*(probe(started(self.client, "HealthMonitor"), w, self.cfg.endpoint,
                                               self.cfg.timeout_secs, {**(self.headers or {}), **w.headers})
                                         for w in workers))
        for w, err in zip(workers, results):
            self.record(w, err)

    async def health_generate(self) -> list[dict]:
        """GET /health_generate on every worker concurrently; the failures as
        ``[{"worker", "role", "error"}]`` (empty when all answered 200). Does not change routing."""
        workers = self.pool.all
        results = await asyncio.gather(*(probe(started(self.client, "HealthMonitor"), w, "/health_generate",
                                               HEALTH_GENERATE_TIMEOUT, {**(self.headers or {}), **w.headers})
                                         for w in workers))
        return [{"worker": w.url, "role": w.role, "error": err} for w, err in zip(workers, results) if err is not None]

    def start(self, client: httpx.AsyncClient) -> None:
        """Start the periodic health-check loop on ``client`` (none when interval_secs is 0)."""
        self.client = client
        if self.cfg.interval_secs > 0:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        """Cancel the health-check loop and wait for it to end."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def _loop(self) -> None:
        while True:
            try:
                await self.check_all()
            except Exception:  # a probe bug must not end health checking
                log.exception("health probe round failed")
            await asyncio.sleep(self.cfg.interval_secs)
