"""Prometheus metrics of the router (base units, ``_seconds`` / ``_total``, one private registry
per router so several routers can live in one process, e.g. in tests).

Per-request stages, all labelled by ``endpoint`` (the route, e.g. ``/generate``):

- queue: arrival -> dispatch to the workers (body read, parsed, pair picked, rooms stamped);
- prefill: dispatch -> the prefill's response fully read;
- TTFT: arrival -> first byte of decode's body (streams) or the full response (non-streaming);
- ITL (inter-token latency): between consecutive decode SSE data chunks;
- E2E: arrival -> the last byte handed to the client.

Series of every generation endpoint, every error kind and every worker exist from the start (at 0),
so dashboards and rate() see stable label sets; a removed worker's series are dropped.

Names (a dashboard contract; keep them): ``pdserve_router_{queue,prefill,ttft,inter_token,e2e}_seconds``,
``pdserve_router_requests_total{endpoint,status}``, ``pdserve_router_errors_total{endpoint,kind}``,
``pdserve_router_retries_total{endpoint}``, ``pdserve_router_requests_in_flight``,
``pdserve_router_prompt_tokens_total{endpoint}``, ``pdserve_router_completion_tokens_total{endpoint}``,
``pdserve_router_worker_inflight{worker,role}``, ``pdserve_router_worker_healthy{worker,role}``,
``pdserve_router_worker_circuit_state{worker,role}`` (0 closed, 1 half-open, 2 open),
``pdserve_router_policy_decisions_total{role,policy,worker}``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Seconds. The router's own work is sub-millisecond, so queue buckets start at 50 us.
QUEUE_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
# Prefill and TTFT span a tiny CPU model (ms) up to long prompts on a loaded cluster (minutes).
PREFILL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 120, 300)
TTFT_BUCKETS = PREFILL_BUCKETS
ITL_BUCKETS = (0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.06, 0.08,
               0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 8)
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 120, 300, 600, 1200, 1800)

# Values of the ``kind`` label of pdserve_router_errors_total.
ERROR_KINDS = (
    "invalid_request",      # malformed body (400)
    "payload_too_large",    # body over --max-payload-size (413)
    "unauthorized",         # missing or wrong API key (401)
    "no_worker",            # no available prefill or decode worker (503)
    "prefill_status", "decode_status",    # the worker answered non-2xx
    "prefill_connect", "decode_connect",  # could not reach it, or it broke the connection
    "prefill_timeout", "decode_timeout",  # a stage timeout passed
    "decode_stream",        # decode's stream broke after the first byte reached the client
    "client_disconnect",    # the client went away before the answer ended
)


class EndpointMetrics:
    """The per-request series of one endpoint, bound once (no label lookups on the hot path)."""

    __slots__ = ("endpoint", "queue", "prefill", "ttft", "itl", "e2e", "retries", "prompt_tokens",
                 "completion_tokens", "_requests", "_errors", "_owner")

    def __init__(self, owner: "RouterMetrics", endpoint: str):
        self._owner = owner
        self.endpoint = endpoint
        self.queue = owner.queue.labels(endpoint)
        self.prefill = owner.prefill.labels(endpoint)
        self.ttft = owner.ttft.labels(endpoint)
        self.itl = owner.itl.labels(endpoint)
        self.e2e = owner.e2e.labels(endpoint)
        self.retries = owner.retries.labels(endpoint)
        self.prompt_tokens = owner.prompt_tokens.labels(endpoint)
        self.completion_tokens = owner.completion_tokens.labels(endpoint)
        self._requests = {"200": owner.requests.labels(endpoint, "200")}
        self._errors = {k: owner.errors.labels(endpoint, k) for k in ERROR_KINDS}

    def request(self, status: int) -> None:
        """Count one answered request with HTTP ``status``."""
        key = str(status)
        child = self._requests.get(key)
        if child is None:
            child = self._requests[key] = self._owner.requests.labels(self.endpoint, key)
        child.inc()

    def error(self, kind: str) -> None:
        """Count one failure of ``kind`` (one of ERROR_KINDS)."""
        child = self._errors.get(kind)
        if child is None:
            child = self._errors[kind] = self._owner.errors.labels(self.endpoint, kind)
        child.inc()


class RouterMetrics:
    """All router metrics, in a private ``CollectorRegistry``.

    Args:
        endpoints: the routes whose series are created up front.
    """

    def __init__(self, endpoints: tuple[str, ...] = ()) -> None:
        r = self.registry = CollectorRegistry()
        ep = ["endpoint"]
        self.queue = Histogram("pdserve_router_queue_seconds", "Router queue time: arrival to dispatch to the workers.",
                               ep, buckets=QUEUE_BUCKETS, registry=r)
        self.prefill = Histogram("pdserve_router_prefill_seconds",
                                 "Dispatch to the prefill worker's response fully read.", ep, buckets=PREFILL_BUCKETS,
                                 registry=r)
        self.ttft = Histogram("pdserve_router_ttft_seconds",
                              "Time to first token at the router: arrival to the first decode body byte "
                              "(streams) or the full response (non-streaming).", ep, buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("pdserve_router_inter_token_seconds", "Time between consecutive decode SSE data chunks.",
                             ep, buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve_router_e2e_seconds", "End-to-end latency at the router: arrival to the last byte.",
                             ep, buckets=E2E_BUCKETS, registry=r)
        self.requests = Counter("pdserve_router_requests", "Requests answered, by endpoint and HTTP status.",
                                ["endpoint", "status"], registry=r)
        self.errors = Counter("pdserve_router_errors", "Failed requests, by endpoint and failure kind.",
                              ["endpoint", "kind"], registry=r)
        self.retries = Counter("pdserve_router_retries", "Requests sent again to a fresh (prefill, decode) pair "
                               "after a failure before the first byte reached the client.", ep, registry=r)
        self.prompt_tokens = Counter("pdserve_router_prompt_tokens", "Prompt tokens of answered requests, as the "
                                     "engines reported them.", ep, registry=r)
        self.completion_tokens = Counter("pdserve_router_completion_tokens", "Generated tokens of answered requests, "
                                         "as the engines reported them.", ep, registry=r)
        self.in_flight = Gauge("pdserve_router_requests_in_flight", "Client requests the router is serving now.",
                               registry=r)
        wl = ["worker", "role"]
        self.inflight = Gauge("pdserve_router_worker_inflight", "Requests in flight to a worker.", wl, registry=r)
        self.healthy = Gauge("pdserve_router_worker_healthy", "1 while the worker passes its health checks, else 0.",
                             wl, registry=r)
        self.circuit = Gauge("pdserve_router_worker_circuit_state",
                             "Circuit breaker of the worker: 0 closed, 1 half-open, 2 open.", wl, registry=r)
        self.decisions = Counter("pdserve_router_policy_decisions", "Workers picked by the pairing policy.",
                                 ["role", "policy", "worker"], registry=r)
        self.endpoints = {e: EndpointMetrics(self, e) for e in endpoints}

    def endpoint(self, endpoint: str) -> EndpointMetrics:
        """The bound series of ``endpoint`` (created on first use for routes not known up front)."""
        m = self.endpoints.get(endpoint)
        if m is None:
            m = self.endpoints[endpoint] = EndpointMetrics(self, endpoint)
        return m

    def drop_worker(self, url: str, role: str, policy: str) -> None:
        """Remove a worker's series (it left the pool)."""
        for g in (self.inflight, self.healthy, self.circuit):
            try:
                g.remove(url, role)
            except KeyError:
                pass
        try:
            self.decisions.remove(role, policy, url)
        except KeyError:
            pass

    def render(self) -> bytes:
        """The Prometheus text exposition of every router metric."""
        return generate_latest(self.registry)
