"""KV pages kept out of their pool while a transfer may still touch them.

A prefill's pages stay held until an abandoned Mooncake write settles; a decode's, until its prefill confirms
no write into them is in flight (or SGLang's deferred KV release timeout passes). The request that held them
does not wait for that: it answers, and the pages go back on their own.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from pd.engines.handoff.kv_pool import KVPagePool

log = logging.getLogger(__name__)


class HeldPages:
    """Counts and releases held pages.

    Args:
        on_change: called with the number of pages held after every change (the
            ``pdserve_kv_pages_quarantined`` gauge and the pools' gauges).
    """

    def __init__(self, on_change: Callable[[int], None]):
        self.count = 0
        self._on_change = on_change
        self._tasks: set[asyncio.Task] = set()

    def hold(self, held: list[tuple[KVPagePool, list[int]]], until: Awaitable) -> asyncio.Task:
        """Keep each ``(pool, pages)`` of ``held`` out of its pool until the awaitable ``until`` ends, then free
        them whatever it raised. Returns the task that frees them."""
        count = sum(len(p) for _, p in held)
        self.count += count
        self._on_change(self.count)

        async def release() -> None:
            try:
                await until
            except Exception as e:  # the pages go back whatever happened (engine stopping: client closed)
                log.info("releasing %d held KV pages after %r", count, e)
            finally:
                for pool, pages in held:
                    pool.free(pages)
                self.count -= count
                self._on_change(self.count)

        task = asyncio.get_running_loop().create_task(release())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task
