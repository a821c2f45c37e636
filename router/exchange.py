"""The state of one attempt of a PD request while it is in flight (``Exchange``), how its prefill
side ended (``PrefillOutcome``), and the recording of a request's outcome in the endpoint metrics.

An attempt is one (prefill, decode) pair with fresh rooms (pd.router.attempt runs it); a request has
one or more (pd.router.retry).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from pd.router.fanout import SampleMetrics
    from pd.router.metrics import EndpointMetrics
    from pd.router.upstream import Response as UpstreamResponse
    from pd.router.workers import Worker


CLIENT_CLOSED = 499  # nginx's status for "client closed the request": recorded in metrics, never sent


def is_2xx(status: Optional[int]) -> bool:
    """True for a 2xx HTTP status; False for any other and for None (no HTTP answer)."""
    return status is not None and 200 <= status < 300


def record_outcome(em: EndpointMetrics | SampleMetrics, arrival: float, status: int,
                   kind: Optional[str] = None) -> None:
    """Count one answered request: its end-to-end latency since ``arrival`` (``time.perf_counter()``
    seconds), its HTTP ``status`` and, if not None, its failure ``kind``."""
    em.e2e.observe(time.perf_counter() - arrival)
    em.request(status)
    if kind is not None:
        em.error(kind)


def report_cached(ex: Exchange, cached: Optional[int]) -> None:
    """Count the cached prompt tokens an answer reported (None: it reported none) against those the
    ``kv_aware`` policy predicted for its prefill (single-sequence requests only: a batch's answer sums
    its prompts, the policy predicts the first's)."""
    counters = ex.prefill.kv_counters
    if ex.kv_predicted is not None and cached is not None and counters is not None and ex.seqs == 1:
        counters[0].inc(ex.kv_predicted)
        counters[1].inc(cached)


class PrefillOutcome:
    """How the prefill side of one attempt ended.

    Attributes:
        status: HTTP status, None when there was no HTTP answer.
        body: the whole body when it is needed (an error, logprobs to merge), else b"".
        content_type: the answer's content type.
        failure: ``connect`` or ``timeout`` when there was no HTTP answer.
        detail: what went wrong, for the error message.
    """

    __slots__ = ("status", "body", "content_type", "failure", "detail")

    def __init__(self, status: Optional[int], body: bytes = b"", content_type: str = "application/json",
                 failure: Optional[str] = None, detail: str = ""):
        self.status, self.body, self.content_type = status, body, content_type
        self.failure, self.detail = failure, detail

    @property
    def ok(self) -> bool:
        """True when prefill answered with a 2xx status."""
        return is_2xx(self.status)


class Exchange:
    """One attempt of one request while it is in flight."""

    __slots__ = ("route", "em", "prefill", "decode", "rids", "seqs", "stream", "merge", "drop_usage", "payload",
                 "headers", "arrival", "dispatched", "prefill_task", "decode_task", "prefill_aborted",
                 "decode_aborted", "accepted", "_decode_open", "blocks", "kv_predicted")

    def __init__(self, route: str, em: EndpointMetrics | SampleMetrics, prefill: Worker, decode: Worker,
                 rids: list[str], seqs: int, stream: bool, merge: bool, drop_usage: bool, payload: bytes,
                 headers: bytes, arrival: float):
        self.route, self.em = route, em
        self.prefill, self.decode = prefill, decode
        self.rids, self.seqs = rids, seqs
        self.stream, self.merge, self.drop_usage = stream, merge, drop_usage
        self.payload, self.headers = payload, headers
        self.arrival = arrival
        self.dispatched = time.perf_counter()
        # set together when the attempt starts (AttemptRunner.run), before anything else sees the exchange
        self.prefill_task: Optional[asyncio.Task[PrefillOutcome]] = None
        self.decode_task: Optional[asyncio.Task[UpstreamResponse]] = None
        self.prefill_aborted = self.decode_aborted = False
        # a non-stream answer the decode accepted (the prefill answered 2xx: its KV reached the decode,
        # which is generating): bounded by timeouts.request only, and not retried when that passes
        self.accepted = False
        self._decode_open = False
        # the kv_aware policy's plan: prompt KV pages counted in flight on the prefill, and the cached
        # tokens it predicted there (None: no prediction to compare with the answer's cached_tokens)
        self.blocks = 0
        self.kv_predicted: Optional[int] = None

    def decode_begin(self) -> None:
        """The decode side started: its sequences count as load on the decode worker until decode_end()."""
        self._decode_open = True
        self.decode.begin(self.seqs)

    def decode_end(self) -> None:
        """Idempotent: the decode side is over (its load counted down once)."""
        if self._decode_open:
            self._decode_open = False
            self.decode.end(self.seqs)

    def release_decode(self, task: asyncio.Future[UpstreamResponse]) -> None:
        """Close the response of an aborted decode request nobody will read."""
        if not task.cancelled() and task.exception() is None:
            task.result().close()
        self.decode_end()

