"""Workers as the router sees them, and the pool that pairs one prefill with one decode per request.

A worker gets requests only while it is *available*: its active health checks pass (``healthy``),
its circuit breaker allows it (pd.router.circuit) and it is not draining. The pool's membership
changes at runtime (admin API): lists are replaced, never mutated, so a request iterating one is
never disturbed.
"""

from __future__ import annotations

import asyncio
import ipaddress
from typing import TYPE_CHECKING, Optional
from urllib.parse import urlsplit

from pd.router.auth import worker_auth_headers
from pd.router.circuit import OPEN, STATE_NAMES, CircuitBreaker
from pd.router.config import CircuitBreakerConfig, RouterConfig, normalize_url
from pd.router.kv_aware import KvAware
from pd.router.policies import POLICIES, Policy, make_policy
from pd.router.upstream import header_block

if TYPE_CHECKING:
    from pd.router.metrics import CounterValue, GaugeValue, RouterMetrics

ROLES = ("prefill", "decode")
assert POLICIES.get(KvAware.name) is KvAware  # kv_aware builds on pd.router.policies and registers itself
DEFAULT_PORTS = {"http": 80, "https": 443}


def canonical_url(url: str) -> str:
    """One spelling per endpoint: ``normalize_url``'s checks, then the scheme and host in lower case, an IP
    literal in its standard form (``[::0001]`` is ``[::1]``), a host's trailing dot dropped, the port as a
    plain number (``:031002`` is ``:31002``) and left out when it is the scheme's default (``http://h:80`` is
    ``http://h``). Two spellings of one worker therefore compare equal (the pool keys workers by it).

    Raises:
        ValueError: what ``normalize_url`` refuses.
    """
    parts = urlsplit(normalize_url(url))
    scheme = parts.scheme.lower()
    host = (parts.hostname or "").lower().rstrip(".")  # hostname: lower case, IPv6 without brackets
    try:
        host = str(ipaddress.ip_address(host))
    except ValueError:
        pass  # a name
    if ":" in host:
        host = f"[{host}]"
    port = parts.port
    return f"{scheme}://{host}" if port is None or port == DEFAULT_PORTS[scheme] else f"{scheme}://{host}:{port}"


class Worker:
    """One upstream engine.

    Attributes:
        url: ``http://host:port``.
        role: ``prefill`` or ``decode``.
        bootstrap_port / bootstrap_host: a prefill's bootstrap server (None on a decode).
        healthy: False while active health checks fail (see pd.router.health).
        draining: True once an operator drains it: no new requests, in-flight ones finish.
        breaker: its circuit breaker.
        headers: what the router adds to every call to it: ``Authorization: Bearer KEY`` with the key this
            worker was given (pd.router.auth), else nothing; ``auth_line`` is the same, encoded for
            pd.router.upstream.
        inflight: requests in flight to it.
        load: generated sequences in flight to it (a batch of 33 counts 33), the policies' load.
        prompt_blocks: KV pages of the prompts in flight to it that the ``kv_aware`` policy counted (0 under
            other policies).
        kv_counters: (predicted, reported) cached-token counters of the ``kv_aware`` policy, else None.
    """

    __slots__ = ("url", "role", "bootstrap_port", "bootstrap_host", "healthy", "draining", "breaker", "inflight",
                 "load", "health_failures", "health_successes", "_g_inflight", "_g_healthy", "_g_circuit",
                 "decisions", "_idle", "headers", "auth_line", "prompt_blocks", "kv_counters")

    def __init__(self, url: str, role: str, bootstrap_port: Optional[int] = None, bootstrap_host: Optional[str] = None,
                 breaker: Optional[CircuitBreakerConfig] = None, api_key: Optional[str] = None):
        if role not in ROLES:
            raise ValueError(f"worker role must be one of {ROLES}, got {role!r}")
        self.headers = worker_auth_headers(api_key)
        self.auth_line = header_block(self.headers)
        self.url = url
        self.role = role
        self.bootstrap_port = bootstrap_port
        self.bootstrap_host = bootstrap_host
        self.healthy = True
        self.draining = False
        self.breaker = CircuitBreaker(breaker or CircuitBreakerConfig(), self._circuit_changed)
        self.inflight = 0
        self.load = 0
        self.prompt_blocks = 0
        self.kv_counters: Optional[tuple[CounterValue, CounterValue]] = None
        self.health_failures = 0  # consecutive failed probes
        self.health_successes = 0  # consecutive passed probes
        # this worker's series, once bind_metrics attached them
        self._g_inflight: Optional[GaugeValue] = None
        self._g_healthy: Optional[GaugeValue] = None
        self._g_circuit: Optional[GaugeValue] = None
        self.decisions: Optional[CounterValue] = None
        self._idle: Optional[asyncio.Future] = None

    def __repr__(self) -> str:
        return f"Worker({self.role} {self.url})"

    def available(self) -> bool:
        """May this worker get a new request now?"""
        return self.healthy and not self.draining and self.breaker.allows()

    def state(self) -> str:
        """Why the worker is (not) available, in one word, for errors and the admin API."""
        if self.draining:
            return "draining"
        if not self.healthy:
            return "unhealthy"
        if self.breaker.state == OPEN:
            return "circuit_open"
        return "available"

    # ---- metrics --------------------------------------------------------------------------------
    def bind_metrics(self, metrics: "RouterMetrics", policy: str) -> None:
        """Attach this worker's series (labels worker=url, role); they exist from now on."""
        inflight: GaugeValue = metrics.inflight.labels(self.url, self.role)
        healthy: GaugeValue = metrics.healthy.labels(self.url, self.role)
        circuit: GaugeValue = metrics.circuit.labels(self.url, self.role)
        self._g_inflight, self._g_healthy, self._g_circuit = inflight, healthy, circuit
        self.decisions = metrics.decisions.labels(self.role, policy, self.url)
        inflight.set(self.inflight)
        healthy.set(1 if self.healthy else 0)
        circuit.set(self.breaker.state)

    def _circuit_changed(self, state: int) -> None:
        if self._g_circuit is not None:
            self._g_circuit.set(state)

    def set_healthy(self, ok: bool) -> None:
        """Record the health-check verdict and export it as the worker's health gauge."""
        self.healthy = ok
        if self._g_healthy is not None:
            self._g_healthy.set(1 if ok else 0)

    # ---- load -----------------------------------------------------------------------------------
    def begin(self, seqs: int, blocks: int = 0) -> None:
        """A request for ``seqs`` sequences (``blocks`` prompt KV pages, where counted) to this worker started."""
        self.inflight += 1
        self.load += seqs
        self.prompt_blocks += blocks
        if self._g_inflight is not None:
            self._g_inflight.inc()

    def end(self, seqs: int, blocks: int = 0) -> None:
        """A request started with ``begin(seqs, blocks)`` finished."""
        self.inflight -= 1
        self.load -= seqs
        self.prompt_blocks -= blocks
        if self._g_inflight is not None:
            self._g_inflight.dec()
        if self.inflight == 0 and self._idle is not None and not self._idle.done():
            self._idle.set_result(None)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until nothing is in flight; True if it got there."""
        if self.inflight == 0:
            return True
        if self._idle is None or self._idle.done():
            self._idle = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(asyncio.shield(self._idle), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def describe(self) -> dict:
        """The worker as the admin API lists it."""
        return {
            "url": self.url, "worker_type": self.role, "bootstrap_port": self.bootstrap_port,
            "bootstrap_host": self.bootstrap_host, "state": self.state(), "is_healthy": self.healthy,
            "draining": self.draining, "circuit": STATE_NAMES[self.breaker.state],
            "inflight": self.inflight, "load": self.load, "api_key": bool(self.headers),  # whether, never which
        }


class WorkerPool:
    """All workers of a router and one pairing policy per side.

    Args:
        config: the router config (initial workers, policies, breaker settings).
        metrics: where per-worker series live (None in unit tests).
    """

    def __init__(self, config: RouterConfig, metrics: Optional["RouterMetrics"] = None):
        self.config = config
        self.metrics = metrics
        self.policies: dict[str, Policy] = {role: make_policy(config.side_policy(role), role, config) for role in ROLES}
        if metrics is not None:
            for policy in self.policies.values():
                policy.bind(metrics)
        self.prefill: list[Worker] = []
        self.decode: list[Worker] = []
        # The workers the router starts with are the operator's (or the launcher's): they get the worker key.
        key = config.worker_api_key or config.api_key
        for p in config.prefill:
            self.add(p.url, "prefill", p.bootstrap_port, key)
        for url in config.decode:
            self.add(url, "decode", api_key=key)

    @property
    def all(self) -> list[Worker]:
        """Every worker, prefill first."""
        return self.prefill + self.decode

    @property
    def needs_key(self) -> bool:
        """Whether a policy looks at the prompt (only then is a routing key computed)."""
        return any(p.uses_key for p in self.policies.values())

    def get(self, url: str) -> Optional[Worker]:
        """The worker with this URL (any spelling of it, ``canonical_url``), or None."""
        url = canonical_url(url)
        for w in self.prefill + self.decode:
            if w.url == url:
                return w
        return None

    def add(self, url: str, role: str, bootstrap_port: Optional[int] = None, api_key: Optional[str] = None) -> Worker:
        """Add a worker; it gets requests at once (until health checks or its breaker say otherwise).
        ``api_key``: the key every call to it carries (none without one).

        Raises:
            ValueError: bad URL or role, a prefill without a bootstrap port, or the URL (in any
                spelling, ``canonical_url``) is already a worker.
        """
        url = canonical_url(url)
        if role not in ROLES:
            raise ValueError(f"worker_type must be one of {ROLES}, got {role!r}")
        if self.get(url) is not None:
            raise ValueError(f"{url} is already a worker")
        if role == "prefill":
            if bootstrap_port is None or not 1 <= int(bootstrap_port) <= 65535:
                raise ValueError(f"a prefill worker needs a bootstrap_port in 1..65535, got {bootstrap_port!r}")
            w = Worker(url, role, int(bootstrap_port), urlsplit(url).hostname, self.config.circuit_breaker, api_key)
        else:
            w = Worker(url, role, breaker=self.config.circuit_breaker, api_key=api_key)
        if self.metrics is not None:
            w.bind_metrics(self.metrics, self.policies[role].name)
        if role == "prefill":
            self.prefill = self.prefill + [w]
        else:
            self.decode = self.decode + [w]
        self.policies[role].joined(w)
        return w

    def remove(self, url: str) -> Worker:
        """Take a worker out for good (requests in flight to it finish on their own connections).

        Raises:
            KeyError: no such worker.
        """
        w = self.get(url)
        if w is None:
            raise KeyError(url)
        if w.role == "prefill":
            self.prefill = [x for x in self.prefill if x is not w]
        else:
            self.decode = [x for x in self.decode if x is not w]
        self.policies[w.role].forget(w)
        if self.metrics is not None:
            self.metrics.drop_worker(w.url, w.role, self.policies[w.role].name)
        return w

    def pick_prefill(self, key: Optional[str]) -> Optional[Worker]:
        """A prefill worker for a request with routing key ``key``; None when none is available."""
        return self.policies["prefill"].select(self.prefill, key)

    def pick_decode(self, key: Optional[str]) -> Optional[Worker]:
        """A decode worker for a request with routing key ``key``; None when none is available."""
        return self.policies["decode"].select(self.decode, key)

    def unavailable_reason(self, role: str) -> str:
        """Why no ``role`` worker can take a request, naming each one's state."""
        workers = self.prefill if role == "prefill" else self.decode
        if not workers:
            return f"no {role} workers are registered"
        return f"no {role} worker can take requests: " + ", ".join(f"{w.url} ({w.state()})" for w in workers)
