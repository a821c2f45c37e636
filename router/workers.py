"""Workers as the router sees them, and the pairing policy that picks one prefill and one decode
per request (round-robin, separately per side, skipping workers that failed their last probe)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Optional

from prometheus_client import Gauge

from pd.router.config import RouterConfig


@dataclass(eq=False)
class Worker:
    """One upstream engine.

    Attributes:
        url: ``http://host:port``.
        role: ``prefill`` or ``decode``.
        bootstrap_port: a prefill's bootstrap server port (None on a decode).
        bootstrap_host: a prefill's host as the decode reaches it (None on a decode).
        healthy: False after a failed probe or connection error, until a probe passes again.
        probed: whether background probes run (only then may a connection error mark the worker
            unhealthy: nothing else would ever mark it healthy again).
    """

    url: str
    role: str
    bootstrap_port: Optional[int] = None
    bootstrap_host: Optional[str] = None
    healthy: bool = True
    probed: bool = True
    _inflight: Optional[Gauge] = field(default=None, repr=False)
    _healthy: Optional[Gauge] = field(default=None, repr=False)

    def bind_metrics(self, inflight: Gauge, healthy: Gauge) -> None:
        """Attach the per-worker gauges (labels worker=url, role)."""
        self._inflight = inflight.labels(worker=self.url, role=self.role)
        self._healthy = healthy.labels(worker=self.url, role=self.role)
        self._healthy.set(1 if self.healthy else 0)

    def set_healthy(self, ok: bool) -> None:
        self.healthy = ok
        if self._healthy is not None:
            self._healthy.set(1 if ok else 0)

    def mark_unreachable(self) -> None:
        """A connection to this worker failed: skip it until the next probe passes."""
        if self.probed and self.healthy:
            self.set_healthy(False)

    def begin(self) -> None:
        """A request to this worker started (in-flight gauge +1)."""
        if self._inflight is not None:
            self._inflight.inc()

    def end(self) -> None:
        """A request to this worker finished (in-flight gauge -1)."""
        if self._inflight is not None:
            self._inflight.dec()


class RoundRobin:
    """Round-robin over a fixed list, preferring healthy workers; if none is healthy it still
    returns one (the request then fails with that worker's error instead of a router guess)."""

    def __init__(self, workers: list[Worker]):
        if not workers:
            raise ValueError("RoundRobin needs at least one worker")
        self.workers = workers
        self._next = itertools.count()

    def pick(self) -> Worker:
        n = len(self.workers)
        start = next(self._next)
        for k in range(n):
            w = self.workers[(start + k) % n]
            if w.healthy:
                return w
        return self.workers[start % n]


@dataclass(frozen=True)
class Pair:
    """The (prefill, decode) pair serving one request."""

    prefill: Worker
    decode: Worker


class WorkerPool:
    """All workers of a router and the pairing policy.

    Args:
        config: the router config (workers and policy).
    """

    def __init__(self, config: RouterConfig):
        self.prefill = [Worker(p.url, "prefill", p.bootstrap_port, p.bootstrap_host) for p in config.prefill]
        self.decode = [Worker(u, "decode") for u in config.decode]
        for w in self.all:
            w.probed = config.health_check_interval > 0
        if config.policy != "round_robin":  # the config validator already restricts this
            raise ValueError(f"unknown policy {config.policy!r}")
        self._prefill_policy = RoundRobin(self.prefill)
        self._decode_policy = RoundRobin(self.decode)

    @property
    def all(self) -> list[Worker]:
        return self.prefill + self.decode

    def bind_metrics(self, inflight: Gauge, healthy: Gauge) -> None:
        for w in self.all:
            w.bind_metrics(inflight, healthy)

    def pick(self) -> Pair:
        """The next (prefill, decode) pair; each side advances its own round-robin cursor."""
        return Pair(self._prefill_policy.pick(), self._decode_policy.pick())
