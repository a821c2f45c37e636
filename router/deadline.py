"""The first-token deadline of one attempt of a PD request (pd.router.attempt)."""

from __future__ import annotations

import asyncio
from typing import Optional


class Deadline:
    """``asyncio.timeout(delay)`` for an attempt, as asyncio 3.11-3.13's ``Timeout`` behaves (the task is cancelled
    at the deadline and the CancelledError leaving the block becomes TimeoutError, unless another cancel came too;
    ``reschedule(None)`` lifts it), with less bookkeeping per request: no state machine, no second loop lookup.
    ``delay`` None: no deadline."""

    __slots__ = ("delay", "task", "handle", "expired", "cancelling")

    task: asyncio.Task  # the task in the block (set on entering)
    cancelling: int  # its cancel requests on entering

    def __init__(self, delay: Optional[float]):
        self.delay = delay
        self.handle: Optional[asyncio.Handle] = None
        self.expired = False

    async def __aenter__(self) -> "Deadline":
        """Arm the deadline for the current task.

        Raises:
            RuntimeError: not entered inside a task (as ``asyncio.timeout``).
        """
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("Deadline must be used inside a task")
        self.task = task
        self.cancelling = task.cancelling()
        if self.delay is not None:
            loop = task.get_loop()
            when = loop.time() + self.delay
            self.handle = loop.call_soon(self._expire) if self.delay <= 0 else loop.call_at(when, self._expire)
        return self

    def reschedule(self, when: None) -> None:
        """Lift the deadline (the only rescheduling an attempt does)."""
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None

    def _expire(self) -> None:
        self.handle = None
        self.expired = True
        self.task.cancel()

    async def __aexit__(self, exc_type, exc_val, exc_tb) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None
        if self.expired and self.task.uncancel() <= self.cancelling and exc_type is asyncio.CancelledError:
            raise TimeoutError from exc_val
