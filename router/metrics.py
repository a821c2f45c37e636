"""Prometheus metrics of the router (base units, ``_seconds`` / ``_total``, one private registry
per router so several routers can live in one process, e.g. in tests).

Per-request stages, all labelled by ``endpoint`` (the route, e.g. ``/generate``):

- queue: arrival -> dispatch to the workers (body read, parsed, a wait for an in-flight slot, pair
  picked, rooms stamped);
- prefill: dispatch -> the prefill's response fully read;
- TTFT: arrival -> first byte of decode's body (streams) or the full response (non-streaming);
- ITL (inter-token latency): between consecutive decode SSE data chunks;
- E2E: arrival -> the last byte handed to the client.

Series of every generation endpoint, every error kind and every worker exist from the start (at 0),
so dashboards and rate() see stable label sets; a removed worker's series are dropped.

Names (a dashboard contract; keep them): ``pdserve_router_{queue,prefill,ttft,inter_token,e2e}_seconds``,
``pdserve_router_requests_total{endpoint,status}``, ``pdserve_router_errors_total{endpoint,kind}``,
``pdserve_router_retries_total{endpoint}``, ``pdserve_router_requests_in_flight``,
``pdserve_router_requests_queued`` (waiting for an in-flight slot: pd.router.admission),
``pdserve_router_prompt_tokens_total{endpoint}``, ``pdserve_router_completion_tokens_total{endpoint}``,
``pdserve_router_worker_inflight{worker,role}``, ``pdserve_router_worker_healthy{worker,role}``,
``pdserve_router_worker_circuit_state{worker,role}`` (0 closed, 1 half-open, 2 open),
``pdserve_router_policy_decisions_total{role,policy,worker}``; of the ``kv_aware`` policy (pd.router.kv_aware):
``pdserve_router_kv_{predicted,reported}_cached_tokens_total{worker}``,
``pdserve_router_kv_events_lag_seconds{worker}``, ``pdserve_router_kv_index_blocks{worker}``,
``pdserve_router_kv_fallbacks_total{reason}``, ``pdserve_router_kv_tokenizer_ready``.

Updates are plain Python arithmetic on per-process values (no lock, no label lookup per update):
the router runs on one event-loop thread, and prometheus_client's locked values cost 4-5% of its
CPU per request in the 2026-11-30 profile. A custom ``prometheus_client`` collector turns them into
the usual families at scrape time, with the same names, types, labels, buckets and ``_created``
samples as prometheus_client's own Counter/Gauge/Histogram. Not thread-safe: update and render
on the router's event-loop thread.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from typing import Any, Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from pd.util.connection_guard import REASONS as CONNECTION_REFUSALS

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
    "over_limit",           # over --max-n, --max-batch-size, --max-sequences-per-request or
                            # --max-total-tokens-per-request (400)
    "queue_full",           # --max-concurrent-requests in flight and --queue-size waiting (429)
    "queue_timeout",        # waited --queue-timeout-secs for an in-flight slot (429)
    "payload_too_large",    # body over --max-payload-size (413)
    "body_timeout",         # the body did not arrive within --body-read-timeout-secs (408)
    "unauthorized",         # missing or wrong API key (401)
    "no_worker",            # no available prefill or decode worker (503)
    "prefill_status", "decode_status",    # the worker answered non-2xx
    "prefill_connect", "decode_connect",  # could not reach it, or it broke the connection
    "prefill_timeout", "decode_timeout",  # a stage timeout passed
    "decode_stream",        # decode's stream broke after the first byte reached the client
    "client_disconnect",    # the client went away before the answer ended
)



class CounterValue:
    """One counter series."""

    __slots__ = ("value", "created")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1) -> None:
        """Add ``amount`` (>= 0).

        Raises:
            ValueError: ``amount`` is negative (counters only go up).
        """
        if amount < 0:
            raise ValueError(f"counters can only be incremented by non-negative amounts, got {amount}")
        self.value += amount


class GaugeValue:
    """One gauge series."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1) -> None:
        """Add ``amount``."""
        self.value += amount

    def dec(self, amount: float = 1) -> None:
        """Subtract ``amount``."""
        self.value -= amount

    def set(self, value: float) -> None:
        """Set to ``value``."""
        self.value = float(value)


class HistogramValue:
    """One histogram series: a count per bucket (``le`` inclusive, as Prometheus defines it)."""

    __slots__ = ("upper", "counts", "sum", "created")

    def __init__(self, upper: tuple[float, ...]) -> None:
        self.upper = upper  # bucket upper bounds, the last one +Inf
        self.counts = [0] * len(upper)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, value: float) -> None:
        """Count one observation of ``value`` (seconds)."""
        self.counts[bisect_left(self.upper, value)] += 1
        self.sum += value

    def observe_repeated(self, value: float, times: int) -> None:
        """Count ``times`` observations of ``value`` at once (as many ``observe`` calls; the sum may round
        differently unless ``value`` is 0)."""
        self.counts[bisect_left(self.upper, value)] += times
        self.sum += value * times


class Family:
    """A metric and its series by label values (in creation order, as prometheus_client lists them).

    Args:
        kind: ``counter``, ``gauge`` or ``histogram``.
        name: the metric name (a counter's without ``_total``).
        doc: its help text.
        labelnames: its label names (none: the family is its one series' value too).
        buckets: a histogram's finite upper bounds in seconds, ascending (+Inf is added).
    """

    # An unlabeled family is its one series too: __init__ binds that series' methods here (those its kind has).
    inc: Callable[..., None]
    dec: Callable[..., None]
    set: Callable[[float], None]
    observe: Callable[[float], None]

    def __init__(self, kind: str, name: str, doc: str, labelnames: Sequence[str] = (),
                 buckets: Sequence[float] = ()):
        if kind not in ("counter", "gauge", "histogram"):
            raise ValueError(f"kind must be counter, gauge or histogram, got {kind!r}")
        self.kind, self.name, self.doc, self.labelnames = kind, name, doc, tuple(labelnames)
        self.upper = tuple(float(b) for b in buckets) + (float("inf"),)
        # CounterValue, GaugeValue or HistogramValue by kind (labels() makes them)
        self.series: dict[tuple[str, ...], Any] = {}
        if not self.labelnames:
            self._only = self.labels()
            for op in ("inc", "dec", "set", "observe"):
                if hasattr(self._only, op):
                    setattr(self, op, getattr(self._only, op))

    def labels(self, *values):
        """The series of these label values (created at 0 on first use).

        Raises:
            ValueError: not one value per label name.
        """
        key = tuple(str(v) for v in values)
        series = self.series.get(key)
        if series is None:
            if len(key) != len(self.labelnames):
                raise ValueError(f"{self.name}: want values for {self.labelnames}, got {values}")
            if self.kind == "counter":
                series = CounterValue()
            elif self.kind == "gauge":
                series = GaugeValue()
            else:
                series = HistogramValue(self.upper)
            self.series[key] = series
        return series

    def remove(self, *values) -> None:
        """Drop a series.

        Raises:
            KeyError: no series has these label values.
        """
        del self.series[tuple(str(v) for v in values)]

    def family(self) -> Metric:
        """The prometheus_client family of the current values (for the collector)."""
        names = list(self.labelnames)
        if self.kind == "counter":
            counter = CounterMetricFamily(self.name, self.doc, labels=names)
            for key, s in self.series.items():
                counter.add_metric(key, s.value, created=s.created)
            return counter
        if self.kind == "gauge":
            gauge = GaugeMetricFamily(self.name, self.doc, labels=names)
            for key, s in self.series.items():
                gauge.add_metric(key, s.value)
            return gauge
        hist = HistogramMetricFamily(self.name, self.doc, labels=names)
        bounds = [floatToGoString(b) for b in self.upper]
        for key, s in self.series.items():
            cumulative: list[tuple[str, float]] = []
            acc = 0
            for bound, c in zip(bounds, s.counts):
                acc += c
                cumulative.append((bound, acc))
            hist.add_metric(key, cumulative, s.sum)
            hist.samples.append(Sample(self.name + "_created", dict(zip(names, key)), s.created))
        return hist


class _Collector:
    """Exposes families to a CollectorRegistry."""

    def __init__(self, families: list[Family]):
        self.families = families

    def collect(self) -> Iterator[Metric]:
        for f in self.families:
            yield f.family()


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
        ep = ["endpoint"]
        self.queue = Family("histogram", "pdserve_router_queue_seconds",
                            "Router queue time: arrival to dispatch to the workers.", ep, QUEUE_BUCKETS)
        self.prefill = Family("histogram", "pdserve_router_prefill_seconds",
                              "Dispatch to the prefill worker's response fully read.", ep, PREFILL_BUCKETS)
        self.ttft = Family("histogram", "pdserve_router_ttft_seconds",
                           "Time to first token at the router: arrival to the first decode body byte "
                           "(streams) or the full response (non-streaming).", ep, TTFT_BUCKETS)
        self.itl = Family("histogram", "pdserve_router_inter_token_seconds",
                          "Time between consecutive decode SSE data chunks.", ep, ITL_BUCKETS)
        self.e2e = Family("histogram", "pdserve_router_e2e_seconds",
                          "End-to-end latency at the router: arrival to the last byte.", ep, E2E_BUCKETS)
        self.requests = Family("counter", "pdserve_router_requests", "Requests answered, by endpoint and HTTP status.",
                               ["endpoint", "status"])
        self.errors = Family("counter", "pdserve_router_errors", "Failed requests, by endpoint and failure kind.",
                             ["endpoint", "kind"])
        self.retries = Family("counter", "pdserve_router_retries", "Requests sent again to a fresh (prefill, decode) "
                              "pair after a failure before the first byte reached the client.", ep)
        self.prompt_tokens = Family("counter", "pdserve_router_prompt_tokens", "Prompt tokens of answered requests, "
                                    "as the engines reported them.", ep)
        self.completion_tokens = Family("counter", "pdserve_router_completion_tokens", "Generated tokens of answered "
                                        "requests, as the engines reported them.", ep)
        self.in_flight = Family("gauge", "pdserve_router_requests_in_flight",
                                "Client requests the router is serving now.")
        self.queued = Family("gauge", "pdserve_router_requests_queued",
                             "Generation requests waiting for an in-flight slot (--max-concurrent-requests).")
        wl = ["worker", "role"]
        self.inflight = Family("gauge", "pdserve_router_worker_inflight", "Requests in flight to a worker.", wl)
        self.healthy = Family("gauge", "pdserve_router_worker_healthy",
                              "1 while the worker passes its health checks, else 0.", wl)
        self.circuit = Family("gauge", "pdserve_router_worker_circuit_state",
                              "Circuit breaker of the worker: 0 closed, 1 half-open, 2 open.", wl)
        self.decisions = Family("counter", "pdserve_router_policy_decisions", "Workers picked by the pairing policy.",
                                ["role", "policy", "worker"])
        self.client_connections = Family("gauge", "pdserve_router_client_connections",
                                         "Client connections open now (--client-max-connections).")
        self.connections_refused = Family("counter", "pdserve_router_client_connections_refused",
                                          "Client connections closed by a connection limit, by reason: total, "
                                          "per_address, header_timeout, header_too_large, too_many_headers.",
                                          ["reason"])
        kv = ["worker"]
        self.kv_predicted = Family("counter", "pdserve_router_kv_predicted_cached_tokens",
                                   "Prompt tokens the kv_aware policy expected the prefill to serve from its cache "
                                   "(single-sequence requests answered).", kv)
        self.kv_reported = Family("counter", "pdserve_router_kv_reported_cached_tokens",
                                  "Prompt tokens the answers of those requests reported cached (cached_tokens).", kv)
        self.kv_events_lag = Family("gauge", "pdserve_router_kv_events_lag_seconds",
                                    "Seconds since the prefill's last KV event batch arrived (-1: none yet).", kv)
        self.kv_index_blocks = Family("gauge", "pdserve_router_kv_index_blocks",
                                      "KV pages the router's index says the prefill holds.", kv)
        self.kv_fallbacks = Family("counter", "pdserve_router_kv_fallbacks",
                                   "kv_aware decisions or workers estimated as cache_aware does, by reason: "
                                   "no_token_ids, no_live_events, worker_events_stale.", ["reason"])
        self.kv_tokenizer_ready = Family("gauge", "pdserve_router_kv_tokenizer_ready",
                                         "1 once the kv_aware policy can tokenize text prompts, else 0.")
        # called before each scrape (gauges computed from live state)
        self.refreshers: list[Callable[[], None]] = []
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # process_cpu_seconds_total: the planner's per-request CPU
        self.registry.register(_Collector([self.queue, self.prefill, self.ttft, self.itl, self.e2e, self.requests,
                                           self.errors, self.retries, self.prompt_tokens, self.completion_tokens,
                                           self.in_flight, self.queued, self.inflight, self.healthy, self.circuit,
                                           self.decisions, self.client_connections, self.connections_refused,
                                           self.kv_predicted, self.kv_reported, self.kv_events_lag,
                                           self.kv_index_blocks, self.kv_fallbacks, self.kv_tokenizer_ready]))
        self.client_connections.labels()
        for reason in CONNECTION_REFUSALS:
            self.connections_refused.labels(reason)
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
        for refresh in self.refreshers:
            refresh()
        return generate_latest(self.registry)
