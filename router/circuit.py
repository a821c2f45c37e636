"""A circuit breaker per worker: after repeated failures the worker gets no requests for a while,
then a few trial requests decide whether it is back.

States (the value of ``pdserve_router_worker_circuit_state``): 0 closed (normal), 1 half-open
(trial requests pass; one failure re-opens, ``success_threshold`` successes in a row close it),
2 open (no requests until ``timeout_duration_secs`` have passed since it opened, or until a health
probe passes: pd.router.health).
"""

from __future__ import annotations

import time
from typing import Callable, Optional

from pd.router.config import CircuitBreakerConfig

CLOSED, HALF_OPEN, OPEN = 0, 1, 2
STATE_NAMES = {CLOSED: "closed", HALF_OPEN: "half_open", OPEN: "open"}


class CircuitBreaker:
    """Counts a worker's request outcomes and says whether it may get requests.

    Args:
        config: thresholds and durations (seconds).
        on_change: called with the new state (an int above) on every transition.
        clock: monotonic seconds; tests pass a fake one.
    """

    __slots__ = ("cfg", "state", "_failures", "_first_failure", "_successes", "_opened_at", "_on_change", "_clock")

    def __init__(self, config: CircuitBreakerConfig, on_change: Optional[Callable[[int], None]] = None,
                 clock: Callable[[], float] = time.monotonic):
        self.cfg = config
        self.state = CLOSED
        self._failures = 0
        self._first_failure = 0.0
        self._successes = 0
        self._opened_at = 0.0
        self._on_change = on_change
        self._clock = clock

    def allows(self) -> bool:
        """Whether a request may go to the worker now (an open circuit turns half-open once its
        timeout has passed)."""
        if self.state == CLOSED:
            return True
        if self.state == OPEN:
            if self._clock() - self._opened_at < self.cfg.timeout_duration_secs:
                return False
            self._set(HALF_OPEN)
            self._successes = 0
        return True

    def record_success(self) -> None:
        """A request to the worker succeeded."""
        if self.state == CLOSED:
            self._failures = 0
        elif self.state == HALF_OPEN:
            self._successes += 1
            if self._successes >= self.cfg.success_threshold:
                self._failures = 0
                self._set(CLOSED)

    def record_failure(self) -> None:
        """A request to the worker failed (no connection, timeout, HTTP 5xx)."""
        if not self.cfg.enabled:
            return
        now = self._clock()
        if self.state == HALF_OPEN:
            self._open(now)
            return
        if self.state == OPEN:
            return
        if self._failures == 0 or now - self._first_failure > self.cfg.window_duration_secs:
            self._failures, self._first_failure = 0, now
        self._failures += 1
        if self._failures >= self.cfg.failure_threshold:
            self._open(now)

    def probe_passed(self) -> None:
        """A health probe of the worker passed: an open circuit turns half-open now, so trial requests
        decide at once whether the worker is back (a worker that came back would otherwise stay out for
        the rest of ``timeout_duration_secs`` while it already answers its health checks)."""
        if self.state == OPEN:
            self._set(HALF_OPEN)
            self._successes = 0

    def reset(self) -> None:
        """Close the circuit (e.g. an operator put the worker back)."""
        self._failures = self._successes = 0
        if self.state != CLOSED:
            self._set(CLOSED)

    def _open(self, now: float) -> None:
        self._opened_at = now
        self._failures = self._successes = 0
        self._set(OPEN)

    def _set(self, state: int) -> None:
        self.state = state
        if self._on_change is not None:
            self._on_change(state)
