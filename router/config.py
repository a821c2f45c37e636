"""Configuration of the PD router (pydantic; unknown keys are errors).

``RouterSettings`` is everything but the workers: pd/config.py's ``router`` section is one, so a
cluster YAML and ``pdserve router``'s flags set the same things. ``RouterConfig`` adds the initial
prefill and decode workers (more can be added at runtime through the admin API).

Names follow ``sglang_router.launch_router``'s flags (``--retry-max-retries`` is
``retry.max_retries``, ``--cb-failure-threshold`` is ``circuit_breaker.failure_threshold``,
``--health-check-interval-secs`` is ``health_check.interval_secs``, ...).
"""

from __future__ import annotations

from typing import Literal, Optional
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# SGLang's default --disaggregation-bootstrap-port: a prefill given without one listens here.
DEFAULT_BOOTSTRAP_PORT = 8998
# Where `pdserve router` reads its keys when no flag gives them (``ps`` shows flags, not these).
API_KEY_ENV = "PDSERVE_ROUTER_API_KEY"
ADMIN_KEY_ENV = "PDSERVE_ROUTER_ADMIN_API_KEY"

PolicyName = Literal["round_robin", "random", "least_load", "power_of_two", "cache_aware"]
POLICY_NAMES: tuple[str, ...] = PolicyName.__args__


def normalize_url(url: str) -> str:
    """``http://host:port`` without a trailing slash.

    Raises:
        ValueError: not an http(s) URL with a host, or a port that is not a number in 1-65535.
    """
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"worker URL {url!r} is not an http(s) URL with a host")
    try:
        port = parts.port  # urlsplit checks the port only when asked
    except ValueError:
        port = -1
    if port is not None and not 1 <= port <= 65535:
        raise ValueError(f"worker URL {url!r} has no valid port (1-65535)")
    return url


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PrefillWorkerConfig(_Strict):
    """One prefill worker: its HTTP URL and the port of its bootstrap server (the decode
    registers its KV pages there)."""

    url: str
    bootstrap_port: int = Field(DEFAULT_BOOTSTRAP_PORT, ge=1, le=65535)

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        return normalize_url(v)

    @property
    def bootstrap_host(self) -> str:
        """The prefill's host as the decode must reach it: the host part of its URL."""
        return urlsplit(self.url).hostname


class RetryConfig(_Strict):
    """Retries of a request that failed before its first byte reached the client, each on a fresh
    (prefill, decode) pair with fresh bootstrap rooms (``--retry-*`` flags of sglang-router).

    Attributes:
        max_retries: attempts in all, the first included (sglang-router's meaning: 1 = no retry).
        initial_backoff_ms / max_backoff_ms: wait before the 2nd attempt, and its cap, in ms.
        backoff_multiplier: growth of the wait per attempt.
        jitter_factor: each wait is scaled by a uniform factor in [1 - j, 1 + j].
    """

    max_retries: int = Field(5, ge=1)
    initial_backoff_ms: float = Field(50, ge=0)
    max_backoff_ms: float = Field(30_000, ge=0)
    backoff_multiplier: float = Field(1.5, ge=1)
    jitter_factor: float = Field(0.2, ge=0, le=1)


class CircuitBreakerConfig(_Strict):
    """A circuit breaker per worker (``--cb-*`` flags of sglang-router).

    Attributes:
        enabled: False = never open (``--disable-circuit-breaker``).
        failure_threshold: consecutive failed requests (connection error, timeout, HTTP 5xx) that
            open the circuit; a success resets the count.
        success_threshold: consecutive successes in half-open state that close it again.
        timeout_duration_secs: seconds an open circuit waits before letting trial requests through
            (half-open).
        window_duration_secs: failures further apart than this do not add up.
    """

    enabled: bool = True
    failure_threshold: int = Field(10, ge=1)
    success_threshold: int = Field(3, ge=1)
    timeout_duration_secs: float = Field(60, gt=0)
    window_duration_secs: float = Field(120, gt=0)


class HealthCheckConfig(_Strict):
    """Active health checks: GET ``endpoint`` on every worker every ``interval_secs``; a worker
    failing ``failure_threshold`` probes in a row is taken out of routing, and put back after
    ``success_threshold`` passing probes in a row (``--health-*`` flags of sglang-router).
    ``interval_secs`` 0 turns active checks off (a worker is then never taken out by them)."""

    interval_secs: float = Field(10, ge=0)
    timeout_secs: float = Field(5, gt=0)
    failure_threshold: int = Field(3, ge=1)
    success_threshold: int = Field(2, ge=1)
    endpoint: str = "/health"

    @field_validator("endpoint")
    @classmethod
    def _path(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError(f"must be a path starting with '/', got {v!r}")
        return v


class TimeoutConfig(_Strict):
    """Per-stage timeouts in seconds (None = bounded only by ``request``).

    Attributes:
        connect: to open a connection to a worker.
        prefill: dispatch -> the prefill's response fully read.
        first_token: dispatch -> the first byte of decode's body for streams, its whole answer
            otherwise (the part of a request that may be retried).
        stream_idle: longest silence between two chunks of a decode stream.
        request: one upstream request in total, streams included.
    """

    connect: float = Field(10.0, gt=0)
    prefill: Optional[float] = Field(None, gt=0)
    first_token: Optional[float] = Field(None, gt=0)
    stream_idle: Optional[float] = Field(None, gt=0)
    request: float = Field(1800.0, gt=0)


class CacheAwareConfig(_Strict):
    """The ``cache_aware`` policy (sglang-router's flags of the same names).

    Attributes:
        cache_threshold: a worker whose tree matches at least this fraction of the prompt wins;
            below it the worker with the smallest tree (most free cache) is picked.
        balance_abs_threshold / balance_rel_threshold: when the busiest and idlest candidate differ
            by more than ``abs`` in-flight sequences AND by more than ``rel`` times, the least
            loaded worker is picked instead (cache affinity must not pile up load).
        eviction_interval_secs: how often each tree is trimmed to ``max_tree_size``.
        max_tree_size: characters kept per worker's tree (least recently used first out).
    """

    cache_threshold: float = Field(0.3, ge=0, le=1)
    balance_abs_threshold: int = Field(64, ge=0)
    balance_rel_threshold: float = Field(1.5, ge=1)
    eviction_interval_secs: float = Field(120, gt=0)
    max_tree_size: int = Field(2**26, ge=1)


class RouterSettings(_Strict):
    """Everything about a router except its workers.

    Attributes:
        host / port: where the router listens (port 0 = any free port).
        policy: the pairing policy of both sides, unless ``prefill_policy`` / ``decode_policy``
            set one side's (``round_robin``, ``random``, ``least_load``, ``power_of_two``,
            ``cache_aware``; see pd.router.policies).
        cache_aware: tuning of the ``cache_aware`` policy.
        retry / circuit_breaker / health_check / timeouts: failure handling.
        max_payload_size: largest request body in bytes (413 above it).
        max_connections: pooled upstream connections, all workers together, per client: the
            generation requests' client (pd.router.upstream) and the aiohttp client of health
            checks, aborts and info proxies each keep at most this many.
        api_key: clients must send ``Authorization: Bearer KEY`` on client routes (generation and
            info); the router sends the same key to the workers (SGLang's ``--api-key``).
        admin_api_key: key of the admin API (/workers); without it the admin API accepts the
            ``api_key``, and with neither only clients on a loopback address.
        request_id_headers: request headers a client's request id is taken from, first match wins;
            it is passed to both workers and returned as ``X-Request-Id``.
        log_level: Python logging level name.
    """

    host: str = "127.0.0.1"
    port: int = Field(30000, ge=0, le=65535)
    policy: PolicyName = "round_robin"
    prefill_policy: Optional[PolicyName] = None
    decode_policy: Optional[PolicyName] = None
    cache_aware: CacheAwareConfig = Field(default_factory=CacheAwareConfig)
    retry: RetryConfig = Field(default_factory=RetryConfig)
    circuit_breaker: CircuitBreakerConfig = Field(default_factory=CircuitBreakerConfig)
    health_check: HealthCheckConfig = Field(default_factory=HealthCheckConfig)
    timeouts: TimeoutConfig = Field(default_factory=TimeoutConfig)
    max_payload_size: int = Field(512 * 1024 * 1024, ge=1)
    max_connections: int = Field(1024, ge=1)
    api_key: Optional[str] = Field(None, repr=False)
    admin_api_key: Optional[str] = Field(None, repr=False)
    request_id_headers: tuple[str, ...] = ("x-request-id",)
    log_level: Literal["debug", "info", "warning", "error", "critical"] = "info"

    @field_validator("api_key", "admin_api_key")
    @classmethod
    def _key(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not v.strip():
            raise ValueError("must not be empty (leave it unset for no key)")
        return v

    @field_validator("request_id_headers")
    @classmethod
    def _headers(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if not v:
            raise ValueError("needs at least one header name")
        return tuple(h.strip().lower() for h in v)

    def side_policy(self, role: str) -> str:
        """The policy name of ``role`` (``prefill`` or ``decode``)."""
        own = self.prefill_policy if role == "prefill" else self.decode_policy
        return own or self.policy

    def cli_args(self) -> list[str]:
        """``pdserve router`` flags that reproduce these settings (host, port, policies, retries,
        breaker, health checks, timeouts, limits); keys are left out: pass them in the environment
        (``PDSERVE_ROUTER_API_KEY``, ``PDSERVE_ROUTER_ADMIN_API_KEY``), where ``ps`` does not show
        them. Used by the launcher."""
        argv = ["--host", self.host, "--port", str(self.port), "--policy", self.policy]
        if self.prefill_policy:
            argv += ["--prefill-policy", self.prefill_policy]
        if self.decode_policy:
            argv += ["--decode-policy", self.decode_policy]
        ca, r, cb, hc, t = self.cache_aware, self.retry, self.circuit_breaker, self.health_check, self.timeouts
        argv += ["--cache-threshold", str(ca.cache_threshold), "--balance-abs-threshold", str(ca.balance_abs_threshold),
                 "--balance-rel-threshold", str(ca.balance_rel_threshold),
                 "--eviction-interval-secs", str(ca.eviction_interval_secs), "--max-tree-size", str(ca.max_tree_size),
                 "--retry-max-retries", str(r.max_retries), "--retry-initial-backoff-ms", str(r.initial_backoff_ms),
                 "--retry-max-backoff-ms", str(r.max_backoff_ms), "--retry-backoff-multiplier", str(r.backoff_multiplier),
                 "--retry-jitter-factor", str(r.jitter_factor),
                 "--cb-failure-threshold", str(cb.failure_threshold), "--cb-success-threshold", str(cb.success_threshold),
                 "--cb-timeout-duration-secs", str(cb.timeout_duration_secs),
                 "--cb-window-duration-secs", str(cb.window_duration_secs),
                 "--health-check-interval-secs", str(hc.interval_secs), "--health-check-timeout-secs", str(hc.timeout_secs),
                 "--health-failure-threshold", str(hc.failure_threshold),
                 "--health-success-threshold", str(hc.success_threshold), "--health-check-endpoint", hc.endpoint,
                 "--connect-timeout-secs", str(t.connect), "--request-timeout-secs", str(t.request),
                 "--max-payload-size", str(self.max_payload_size), "--max-connections", str(self.max_connections),
                 "--request-id-headers", *self.request_id_headers, "--log-level", self.log_level]
        if not cb.enabled:
            argv.append("--disable-circuit-breaker")
        for flag, value in (("--prefill-timeout-secs", t.prefill), ("--first-token-timeout-secs", t.first_token),
                            ("--stream-idle-timeout-secs", t.stream_idle)):
            if value is not None:
                argv += [flag, str(value)]
        return argv


class RouterConfig(RouterSettings):
    """A router with its initial workers.

    Attributes:
        prefill: prefill workers (at least one).
        decode: decode worker URLs (at least one).
    """

    prefill: list[PrefillWorkerConfig] = Field(min_length=1)
    decode: list[str] = Field(min_length=1)

    @field_validator("decode")
    @classmethod
    def _decode_urls(cls, v: list[str]) -> list[str]:
        return [normalize_url(u) for u in v]

    @model_validator(mode="after")
    def _unique(self):
        urls = [p.url for p in self.prefill] + list(self.decode)
        dup = sorted({u for u in urls if urls.count(u) > 1})
        if dup:
            raise ValueError(f"worker URLs must be unique; repeated: {', '.join(dup)}")
        return self

    @classmethod
    def from_urls(cls, prefill: list[tuple[str, Optional[int]] | str], decode: list[str], **kw) -> "RouterConfig":
        """Convenience constructor: ``prefill`` items are ``url`` or ``(url, bootstrap_port)``
        (``None`` port = the default 8998)."""
        pre = []
        for item in prefill:
            url, bport = (item, None) if isinstance(item, str) else item
            pre.append(PrefillWorkerConfig(url=url) if bport is None else PrefillWorkerConfig(url=url, bootstrap_port=bport))
        return cls(prefill=pre, decode=list(decode), **kw)
