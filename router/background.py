"""Background work that must outlive the client's request (prefill reads, aborts), tracked so the
router can wait for it at shutdown and tasks are never garbage-collected while running."""

from __future__ import annotations

import asyncio
from typing import Coroutine


class TaskSet:
    """Tasks the router started in the background."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, coro: Coroutine) -> asyncio.Task:
        """Run ``coro`` in a task referenced until it ends."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def drain(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the tasks (also those they start meanwhile), then
        cancel what is left."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._tasks:
            left = deadline - loop.time()
            if left <= 0:
                break
            await asyncio.wait(set(self._tasks), timeout=left)
        for t in list(self._tasks):
            t.cancel()
