"""Worker health: periodic GET /health probes (feed the pairing policy and the
``pdserve_router_worker_healthy`` gauge) and the /health_generate fan-out."""

from __future__ import annotations

import asyncio
import logging
from typing import Optional

import aiohttp

from pd.router.workers import Worker, WorkerPool

log = logging.getLogger("pd.router")

PROBE_TIMEOUT = 5.0  # seconds for one GET /health
# seconds for one GET /health_generate; the engines give up after 20 s (SGLang's default)
HEALTH_GENERATE_TIMEOUT = 25.0


async def probe(session: aiohttp.ClientSession, worker: Worker, path: str, timeout: float) -> Optional[str]:
    """GET ``path`` on ``worker``; None when it answered 200, else what went wrong."""
    try:
        async with session.get(worker.url + path, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            await r.read()
            return None if r.status == 200 else f"HTTP {r.status}"
    except asyncio.TimeoutError:
        return f"no answer within {timeout:g}s"
    except (aiohttp.ClientError, OSError) as e:
        return str(e) or repr(e)


class HealthMonitor:
    """Probes every worker's /health every ``interval`` seconds (0 = never) and records the
    result on the worker (``Worker.set_healthy``).

    Args:
        pool: the workers.
        interval: seconds between probe rounds.
    """

    def __init__(self, pool: WorkerPool, interval: float):
        self.pool = pool
        self.interval = interval
        self.session: Optional[aiohttp.ClientSession] = None
        self._task: Optional[asyncio.Task] = None

    async def check_all(self, path: str = "/health", timeout: float = PROBE_TIMEOUT) -> list[dict]:
        """Probe every worker concurrently; returns the failures as
        ``[{"worker", "role", "error"}]`` (empty when all answered 200)."""
        workers = self.pool.all
        results = await asyncio.gather(*(probe(self.session, w, path, timeout) for w in workers))
        failed = []
        for w, err in zip(workers, results):
            if err is not None and w.healthy:
                log.warning("%s worker %s failed %s: %s", w.role, w.url, path, err)
            elif err is None and not w.healthy:
                log.info("%s worker %s is healthy again", w.role, w.url)
            w.set_healthy(err is None)
            if err is not None:
                failed.append({"worker": w.url, "role": w.role, "error": err})
        return failed

    async def health_generate(self) -> list[dict]:
        """Fan GET /health_generate out to every worker; the failures (see ``check_all``)."""
        return await self.check_all("/health_generate", HEALTH_GENERATE_TIMEOUT)

    def start(self, session: aiohttp.ClientSession) -> None:
        self.session = session
        if self.interval > 0:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.check_all()
            except Exception:  # a probe bug must not end health checking
                log.exception("health probe round failed")
