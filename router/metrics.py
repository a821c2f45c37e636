"""Prometheus metrics of the router (base units, ``_seconds`` / ``_total``, one private registry
per router so several routers can live in one process, e.g. in tests).

Per-request stages, all labelled by ``endpoint`` (the route, e.g. ``/generate``):

- queue: arrival -> dispatch to the workers (body read, parsed, pair picked, rooms stamped);
- prefill: dispatch -> the prefill's response fully read;
- TTFT: arrival -> first byte of decode's body (streams) or the full response (non-streaming);
- ITL (inter-token latency): between consecutive decode SSE data chunks;
- E2E: arrival -> the last byte handed to the client.
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


class RouterMetrics:
    """All router metrics, in a private ``CollectorRegistry``.

    Error ``kind`` values: ``invalid_request`` (malformed body), ``{prefill,decode}_status``
    (the worker answered non-2xx), ``{prefill,decode}_connect`` (could not reach it),
    ``{prefill,decode}_timeout``, ``decode_stream`` (decode's stream broke after HTTP 200),
    ``client_disconnect``.
    """

    def __init__(self) -> None:
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
        self.inflight = Gauge("pdserve_router_worker_inflight", "Requests in flight to a worker.",
                              ["worker", "role"], registry=r)
        self.healthy = Gauge("pdserve_router_worker_healthy", "1 if the worker's last health probe passed, else 0.",
                             ["worker", "role"], registry=r)

    def render(self) -> bytes:
        """The Prometheus text exposition of every router metric."""
        return generate_latest(self.registry)
