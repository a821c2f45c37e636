"""Configuration of the PD router (pydantic; unknown keys are errors).

``RouterSettings`` is everything but the workers: pd/config.py's ``router`` section is one, so a
cluster YAML and ``pdserve router``'s flags set the same things. ``RouterConfig`` adds the initial
prefill and decode workers (more can be added at runtime through the admin API).

The models are the one description of every setting: a field's type, default and constraints,
its documentation (the docstring under it, also its flag's ``--help``) and its flag.
pd.util.settings_flags derives ``pdserve router``'s flags from them: a field of a section is named by the
section's ``FLAG`` rule (``RetryConfig.FLAG = "--retry-{}"``: ``retry.max_retries`` is
``--retry-max-retries``), or by ``flag(...)`` metadata where sglang-router's name differs
(``health_check.failure_threshold`` is ``--health-failure-threshold``). Names follow
``sglang_router.launch_router``'s flags; pdserve's own settings follow the same patterns.
"""

from __future__ import annotations

import ipaddress
from typing import ClassVar, Literal, Optional, get_args
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pd.router.kv_config import KvAwareConfig
from pd.util import request_caps as caps
from pd.util.settings_flags import flag

# SGLang's default --disaggregation-bootstrap-port: a prefill given without one listens here.
DEFAULT_BOOTSTRAP_PORT = 8998
# Where `pdserve router` reads its keys when no flag gives them (``ps`` shows flags, not these).
API_KEY_ENV = "PDSERVE_ROUTER_API_KEY"
ADMIN_KEY_ENV = "PDSERVE_ROUTER_ADMIN_API_KEY"
WORKER_KEY_ENV = "PDSERVE_ROUTER_WORKER_API_KEY"
# Settings as JSON (a RouterConfig's keys; the workers may be left to --prefill / --decode): how the
# launcher hands a router its settings. Flags given on the command line override it (pd.router.cli).
CONFIG_ENV = "PDSERVE_ROUTER_CONFIG"

PolicyName = Literal["round_robin", "random", "least_load", "power_of_two", "cache_aware", "kv_aware"]
POLICY_NAMES: tuple[str, ...] = get_args(PolicyName)


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def normalize_url(url: str) -> str:
    """``http://host:port`` without a trailing slash.

    A worker URL is only a scheme, a host and a port: the router appends the routes itself, and it sends
    the client API key to every worker, so credentials, paths, queries and fragments are refused rather than
    carried along.

    Raises:
        ValueError: not an http(s) URL with a host; user info, a path, a query or a fragment; a port that is
            not a number in 1-65535.
    """
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"worker URL {url!r} is not an http(s) URL with a host")
    if parts.username is not None or parts.password is not None:
        raise ValueError(f"worker URL {url!r} carries credentials: give only http(s)://host:port")
    if parts.path or parts.query or parts.fragment:
        raise ValueError(f"worker URL {url!r} has a path, query or fragment: give only http(s)://host:port")
    try:
        port = parts.port  # urlsplit checks the port only when asked
    except ValueError:
        port = -1
    if port is not None and not 1 <= port <= 65535:
        raise ValueError(f"worker URL {url!r} has no valid port (1-65535)")
    return url


class _Strict(BaseModel):
    # The docstring under a field is its description: the key's documentation here and its flag's --help.
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)
    # How a field's flag is named from its key (``{}`` = the key with ``-`` for ``_``).
    FLAG: ClassVar[str] = "--{}"


class PrefillWorkerConfig(_Strict):
    """One prefill worker: its HTTP URL and the port of its bootstrap server (the decode
    registers its KV pages there)."""

    url: str
    bootstrap_port: int = Field(default=DEFAULT_BOOTSTRAP_PORT, ge=1, le=65535)

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        return normalize_url(v)

    @property
    def bootstrap_host(self) -> str:
        """The prefill's host as the decode must reach it: the host part of its URL."""
        host = urlsplit(self.url).hostname
        assert host is not None  # the url validator (normalize_url) refuses a URL without a host
        return host


class ClientConnectionConfig(_Strict):
    """Limits on client connections, enforced before uvicorn parses a byte (pd.util.connection_guard): a
    client that holds connections or trickles headers cannot use up the router's file descriptors."""

    FLAG: ClassVar[str] = "--client-{}"

    max_connections: int = Field(default=0, ge=0)
    """open client connections in all; over it a new connection is reset at once. 0 = the open-file limit
    (raised to its hard limit at start) less 1024, at most 65,536."""
    max_connections_per_address: int = Field(default=0, ge=0)
    """open client connections from one source address, so one address cannot take them all; 0 = half of
    ``max_connections``. A load balancer in front of the router is one address: raise it there."""
    header_timeout_secs: float = Field(default=10.0, gt=0)
    """seconds for a request's header block, from the connection's opening (or the request's first byte on a
    reused connection); then 408 and close. A connection that sends nothing is closed after it too."""
    max_header_bytes: int = Field(default=64 * 1024, ge=1024)
    """bytes of a request's header block, request line included; 431 and close above it."""
    max_headers: int = Field(default=100, ge=8)
    """header fields of a request; 431 and close above it."""
    keep_alive_timeout_secs: float = Field(default=5.0, gt=0)
    """seconds an idle connection (no request in flight) is kept open between requests."""

    def limits(self):
        """These settings as pd.util.connection_guard.ConnectionLimits, the automatic caps resolved."""
        from pd.util.connection_guard import ConnectionLimits

        return ConnectionLimits.auto(self.max_connections, self.max_connections_per_address,
                                     header_timeout=self.header_timeout_secs, max_header_bytes=self.max_header_bytes,
                                     max_headers=self.max_headers, keep_alive_timeout=self.keep_alive_timeout_secs)


class RetryConfig(_Strict):
    """Retries of a request that failed before its first byte reached the client, each on a fresh
    (prefill, decode) pair with fresh bootstrap rooms (``--retry-*`` flags of sglang-router)."""

    FLAG: ClassVar[str] = "--retry-{}"

    max_retries: int = Field(default=5, ge=1, json_schema_extra=flag(switch=("--disable-retries", 1)))
    """attempts in all, the first included (sglang-router's meaning: 1 = no retry;
    ``--disable-retries`` sets 1)."""
    initial_backoff_ms: float = Field(default=50, ge=0)
    """wait before the 2nd attempt, in ms."""
    max_backoff_ms: float = Field(default=30_000, ge=0)
    """cap of the wait between two attempts, in ms."""
    backoff_multiplier: float = Field(default=1.5, ge=1)
    """growth of the wait per attempt."""
    jitter_factor: float = Field(default=0.2, ge=0, le=1)
    """each wait is scaled by a uniform factor in [1 - j, 1 + j]."""


class CircuitBreakerConfig(_Strict):
    """A circuit breaker per worker (``--cb-*`` flags of sglang-router)."""

    FLAG: ClassVar[str] = "--cb-{}"

    enabled: bool = Field(default=True, json_schema_extra=flag(switch=("--disable-circuit-breaker", False),
                                                                takes_value=False))
    """whether a worker's circuit opens at all; False = never."""
    failure_threshold: int = Field(default=10, ge=1)
    """consecutive failed requests (connection error, timeout, HTTP 5xx) that open the circuit; a
    success resets the count."""
    success_threshold: int = Field(default=3, ge=1)
    """consecutive successes in half-open state that close it again."""
    timeout_duration_secs: float = Field(default=60, gt=0)
    """seconds an open circuit waits before letting trial requests through (half-open)."""
    window_duration_secs: float = Field(default=120, gt=0)
    """failures further apart than this (seconds) do not add up."""


class HealthCheckConfig(_Strict):
    """Active health checks: GET ``endpoint`` on every worker every ``interval_secs``; a worker
    failing ``failure_threshold`` probes in a row is taken out of routing, and put back after
    ``success_threshold`` passing probes in a row (``--health-*`` flags of sglang-router)."""

    FLAG: ClassVar[str] = "--health-check-{}"

    interval_secs: float = Field(default=10, ge=0, json_schema_extra=flag("--health-check-interval-secs",
                                                                  "--health-check-interval"))
    """seconds between probe rounds; 0 turns active checks off (a worker is then never taken out
    by them)."""
    timeout_secs: float = Field(default=5, gt=0)
    """seconds one probe may take."""
    failure_threshold: int = Field(default=3, ge=1, json_schema_extra=flag("--health-failure-threshold"))
    """failed probes in a row that take a worker out of routing."""
    success_threshold: int = Field(default=2, ge=1, json_schema_extra=flag("--health-success-threshold"))
    """passed probes in a row that put it back."""
    endpoint: str = "/health"
    """the path probed on every worker."""

    @field_validator("endpoint")
    @classmethod
    def _path(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError(f"must be a path starting with '/', got {v!r}")
        return v


class TimeoutConfig(_Strict):
    """Per-stage timeouts in seconds (None = bounded only by ``request``). Every stage of a request is
    bounded by default: a hung engine ends its requests instead of holding them and their KV pages."""

    FLAG: ClassVar[str] = "--{}-timeout-secs"

    connect: float = Field(default=10.0, gt=0, json_schema_extra=flag("--connect-timeout-secs", "--connect-timeout"))
    """to open a connection to a worker."""
    body_read: float = Field(default=30.0, gt=0)
    """to receive a client's whole request body (a client that declares more than it sends, or sends
    it byte by byte, gets a 408 instead of holding a connection)."""
    body_read_min_rate: float = Field(default=500.0, ge=0, json_schema_extra=flag("--body-read-min-rate"))
    """bytes per second a request body must keep up once ``body_read_grace`` has passed, or the
    client gets a 408 before ``body_read`` (Apache mod_reqtimeout's ``MinRate``, 500 there too: the
    deadline starts at the grace and each byte received extends it by 1/rate s); 0 turns it off."""
    body_read_grace: float = Field(default=5.0, gt=0, json_schema_extra=flag("--body-read-grace-secs"))
    """seconds a request body may take before the ``body_read_min_rate`` rule applies."""
    prefill: Optional[float] = Field(default=None, gt=0)
    """dispatch -> the prefill's response fully read."""
    first_token: Optional[float] = Field(default=300.0, gt=0)
    """dispatch -> the first byte of decode's body for streams; for a non-stream answer, dispatch ->
    the decode accepted it (the prefill answered 2xx: its KV reached the decode, which is generating;
    SGLang sends a non-stream answer's headers only with its last byte). Passing it is a worker failure,
    retried. The rest of a non-stream answer is bounded by ``request`` only, and that passing is a 504
    that is not retried and does not count against the decode's circuit breaker (a long answer is no
    broken worker). The default is SGLang's PD waiting timeout (SGLANG_DISAGGREGATION_WAITING_TIMEOUT,
    300 s): a decode that has not started by then has failed."""
    stream_idle: Optional[float] = Field(default=60.0, gt=0)
    """longest silence between two chunks of a decode stream (a healthy stream's longest gap is one
    decode step under load: well under a second)."""
    request: float = Field(default=1800.0, gt=0, json_schema_extra=flag("--request-timeout-secs", "--request-timeout"))
    """one upstream request in total, streams included: the bound of a long non-stream answer."""


class CacheAwareConfig(_Strict):
    """The ``cache_aware`` policy (sglang-router's flags of the same names)."""

    cache_threshold: float = Field(default=0.3, ge=0, le=1)
    """a worker whose tree matches at least this fraction of the prompt wins; below it the worker
    with the smallest tree (most free cache) is picked."""
    balance_abs_threshold: int = Field(default=64, ge=0)
    """when the busiest and idlest candidate differ by more than this many in-flight sequences AND
    by more than ``balance_rel_threshold`` times, the least loaded worker is picked instead (cache
    affinity must not pile up load)."""
    balance_rel_threshold: float = Field(default=1.5, ge=1)
    """the ratio half of that rule."""
    eviction_interval_secs: float = Field(default=120, gt=0)
    """how often (seconds) each tree is trimmed to ``max_tree_size``."""
    max_tree_size: int = Field(default=2**26, ge=1)
    """characters kept per worker's tree (least recently used first out)."""


class RouterSettings(_Strict):
    """Everything about a router except its workers. Each key is one ``pdserve router`` flag
    (pd.util.settings_flags derives them from the fields: name, type, default, help)."""

    host: str = "127.0.0.1"
    """address the router listens on."""
    port: int = Field(default=30000, ge=0, le=65535)
    """port the router listens on (0 = any free port)."""
    policy: PolicyName = "round_robin"
    """the pairing policy of both sides unless ``prefill_policy`` / ``decode_policy`` set one side's
    (see pd.router.policies)."""
    prefill_policy: Optional[PolicyName] = None
    """the policy of the prefill side."""
    decode_policy: Optional[PolicyName] = None
    """the policy of the decode side."""
    cache_aware: CacheAwareConfig = Field(default_factory=CacheAwareConfig)
    """tuning of the ``cache_aware`` policy."""
    kv_aware: KvAwareConfig = Field(default_factory=KvAwareConfig)
    """tuning of the ``kv_aware`` policy (prefill side only)."""
    retry: RetryConfig = Field(default_factory=RetryConfig)
    """retries (before the first byte reaches the client, each on a fresh pair)."""
    circuit_breaker: CircuitBreakerConfig = Field(default_factory=CircuitBreakerConfig)
    """circuit breaker (per worker)."""
    health_check: HealthCheckConfig = Field(default_factory=HealthCheckConfig)
    """active health checks."""
    timeouts: TimeoutConfig = Field(default_factory=TimeoutConfig)
    """timeouts (seconds)."""
    client: ClientConnectionConfig = Field(default_factory=ClientConnectionConfig)
    """limits on client connections."""
    max_payload_size: int = Field(default=caps.MAX_BODY_BYTES, ge=1)
    """largest request body in bytes (413 above it). The default, 32 MiB, is the reference engine's
    own limit (``--max-body-bytes``): a larger body would pass the router only to get a 413 from both
    workers. sglang-router's 512 MiB is larger than any engine here accepts; SGLang's HTTP server
    documents no limit of its own."""
    max_n: int = Field(default=caps.MAX_N, ge=1)
    """largest ``n`` (samples per prompt: ``n`` of the OpenAI routes, ``sampling_params.n`` of
    /generate); a request over it gets 400 before any worker sees it. 16 covers best-of-n and
    self-consistency sampling while one request stays a small share of a DeepSeek-V4 decode's batch."""
    max_batch_size: int = Field(default=caps.MAX_BATCH_SIZE, ge=1)
    """most prompts in one batch request (a list ``text`` / ``input_ids`` of /generate, a list
    ``prompt`` of /v1/completions); 400 above it, before any worker sees it."""
    max_sequences_per_request: int = Field(default=caps.MAX_SEQUENCES_PER_REQUEST, ge=1)
    """most sequences one request generates (prompts x n): each is a bootstrap room, a KV
    allocation on both sides and an abort per side when it fails; 400 above it, before any worker
    sees it. 512 is about one DeepSeek-V4 decode instance's running batch."""
    max_total_tokens_per_request: int = Field(default=1 << 20, ge=1)
    """most tokens one request may hold in flight: prompt tokens + ``max_new_tokens`` summed over its
    sequences (each sequence holds its prompt's KV and its own output's); 400 above it, before any
    worker sees it. The router does not tokenize: a token-id prompt counts its ids, a text prompt its
    UTF-8 bytes (a byte-level BPE token covers at least one byte, so this never counts fewer tokens
    than the engine will), a chat request the bytes of its message texts; an unset ``max_new_tokens``
    counts SGLang's default (128 on /generate, 16 on /v1/completions, 0 on chat, whose length the
    engine bounds by the context). 2^20 = 16 samples (``max_n``) of the DeepSeek-V4 profile's whole
    64K-token context."""
    max_concurrent_requests: int = Field(default=512, ge=-1)
    """generation requests in flight at once (a stream until its last byte); more wait in a FIFO
    queue of ``queue_size`` for up to ``queue_timeout_secs``, and get 429 with ``Retry-After`` when it
    is full or the wait ends. -1 or 0 = no limit (sgl-model-gateway's flag and meaning). 512 is one
    DeepSeek-V4 decode instance's running batch: the engines queue more themselves, holding the
    client's connection and KV it waits for."""
    queue_size: int = Field(default=1024, ge=0)
    """requests that may wait for an in-flight slot (0 = none wait: 429 at once when all are taken).
    A waiting request's body is held in memory, so this times ``max_payload_size`` bounds the queue's
    memory."""
    queue_timeout_secs: float = Field(default=60.0, gt=0)
    """longest wait in the queue, in seconds, then 429 (sgl-model-gateway answers 408 here; 429 tells
    clients and the OpenAI SDK to come back, which is what a full router means)."""
    max_connections: int = Field(default=1024, ge=1)
    """pooled upstream connections, all workers together, per client: the generation requests'
    client (pd.router.upstream) and the client of health checks, aborts and info proxies each
    keep at most this many."""
    api_key: Optional[str] = Field(default=None, repr=False, json_schema_extra=flag(env=API_KEY_ENV))
    """key clients must send as ``Authorization: Bearer KEY`` on client routes (generation and
    info); unless ``worker_api_key`` is set, the router also sends it to the workers it starts with
    (SGLang's ``--api-key``, as sglang-router does), never to a worker added through the admin API."""
    admin_api_key: Optional[str] = Field(default=None, repr=False, json_schema_extra=flag(env=ADMIN_KEY_ENV))
    """key of the admin API (/workers); without it the admin API accepts the ``api_key``, and with
    neither only clients on a loopback address."""
    worker_api_key: Optional[str] = Field(default=None, repr=False, json_schema_extra=flag(env=WORKER_KEY_ENV))
    """key the router sends (``Authorization: Bearer KEY``) to the workers it starts with, in health
    checks, generation, abort and info calls: the engines' ``--api-key`` (a launched cluster's
    generated key). Unset: ``api_key``. A worker added through the admin API gets only the
    ``api_key`` its ``POST /workers`` names (none without one)."""
    allowed_worker_hosts: tuple[str, ...] = ()
    """hosts the admin API may add workers on besides the cluster's own nodes (the hosts of the
    workers the router starts with): host names, IP addresses or networks (``10.0.0.0/24``), or
    ``*`` for any host. Empty: only the cluster's nodes."""
    request_id_headers: tuple[str, ...] = ("x-request-id",)
    """request headers a client's request id is taken from, first match wins; it is passed to both
    workers and returned as ``X-Request-Id``. A value over 128 characters or with anything but visible ASCII
    is replaced by a fresh id."""
    log_level: Literal["debug", "info", "warning", "error", "critical"] = "info"
    """Python logging level name."""

    @field_validator("api_key", "admin_api_key", "worker_api_key")
    @classmethod
    def _key(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not v.strip():
            raise ValueError("must not be empty (leave it unset for no key)")
        return v

    @field_validator("allowed_worker_hosts")
    @classmethod
    def _hosts(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        out = []
        for h in v:
            h = h.strip().lower().strip("[]")
            if "/" in h:
                try:
                    ipaddress.ip_network(h, strict=False)
                except ValueError:
                    raise ValueError(f"{h!r} is not an IP network (e.g. 10.0.0.0/24)") from None
            elif not h or any(c in h for c in " @:?#") and not _is_ip(h):
                raise ValueError(f"{h!r} is not a host name, an IP address, a network or *")
            out.append(h)
        return tuple(out)

    @field_validator("request_id_headers")
    @classmethod
    def _headers(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if not v:
            raise ValueError("needs at least one header name")
        return tuple(h.strip().lower() for h in v)

    @model_validator(mode="after")
    def _kv_aware_side(self):
        # a decode imports the prompt's KV from the prefill: its own cache saves no prefill work
        if self.decode_policy == "kv_aware":
            raise ValueError("--decode-policy (decode_policy) kv_aware: kv_aware ranks prefill workers by the "
                             "prompt pages their KV cache holds; use it as --prefill-policy (or --policy, which "
                             "gives the decode side cache_aware)")
        return self

    def side_policy(self, role: str) -> str:
        """The policy name of ``role`` (``prefill`` or ``decode``); ``kv_aware`` through ``policy`` is
        ``cache_aware`` on the decode side (kv_aware needs a prefill's KV events)."""
        own = self.prefill_policy if role == "prefill" else self.decode_policy
        name = own or self.policy
        return "cache_aware" if role == "decode" and name == "kv_aware" else name


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
            kw_port = {} if bport is None else {"bootstrap_port": bport}
            pre.append(PrefillWorkerConfig(url=url, **kw_port))
        return cls(prefill=pre, decode=list(decode), **kw)
