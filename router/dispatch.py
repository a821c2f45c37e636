"""PD request handling: one request in, the same body to a prefill and a decode worker, decode's
answer out.

Per request (docs/design.md, "The PD wire protocol"):

1. Check the API key, read the body (413 over ``max_payload_size``), parse it (400 if malformed),
   check the admission caps (400 over ``max_n``, ``max_batch_size``, ``max_sequences_per_request`` or
   ``max_total_tokens_per_request``), then take an in-flight slot, waiting in the queue when all
   ``max_concurrent_requests`` are taken (429 with ``Retry-After`` when the queue is full or the wait
   ends; pd.router.admission). The slot is held until the answer's last byte.
2. Pick a (prefill, decode) pair with the side policies, stamp the bootstrap fields (one fresh
   room per generated sequence) and request ids (pd.router.rooms).
3. POST the same bytes to the same route on both workers concurrently, over the pooled client,
   with the client's ``X-Request-Id`` (or a new one, returned to the client too).
4. The client gets decode's status and body; a stream is relayed as it arrives
   (pd.router.stream). With ``return_logprob`` on /generate the prefill's prompt logprobs are
   prepended. The prefill's response is always read to the end in a task of its own (closing it
   early makes the engine abort the room).

Failures before the first byte reaches the client (a side unreachable, timed out, answering
408/429/5xx, or a stream whose first event is an error) are retried with exponential backoff on a
fresh pair with fresh rooms, up to ``retry.max_retries`` attempts in all (pd.router.retry: the
rules and the loop; pd.router.attempt: one attempt; here: building them); the side that did not
fail is aborted at once (pd.router.aborts). A non-retryable answer (e.g. the prefill's 400 for a
prompt over the context length) goes to the client as the worker sent it, after the other side
was aborted. Sequences one side ends as aborted (finish reason ``abort``) are aborted on the
other side too. Connection errors, timeouts and 5xx count against the worker's circuit breaker.
A non-stream answer is bounded by ``timeouts.first_token`` only until the decode accepted it (the
prefill answered 2xx), then by ``timeouts.request``: passing that is a 504 that is neither retried
nor counted against the breaker (pd.router.attempt).
A client that goes away before the answer starts gets both sides aborted (pd.router.disconnect
notices it); after it started, see pd.router.stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Optional

from pd.router import admission, fanout, jsonio, logprobs, unsupported
from pd.router.aborts import Aborter
from pd.router.admission import FLAG as ADMISSION_FLAG
from pd.router.admission import InFlightLimit
from pd.router.attempt import AttemptRunner
from pd.router.auth import Auth
from pd.router.background import TaskSet
from pd.router.config import RouterSettings
from pd.router.disconnect import DisconnectWatch
from pd.router.errors import error_json
from pd.router.exchange import CLIENT_CLOSED, Exchange, record_outcome
from pd.router.front import (
    BodyTimeout,
    ClientGone,
    Receive,
    Scope,
    Send,
    json_content_type,
    read_body,
    request_headers,
    send_whole,
)
from pd.router.metrics import EndpointMetrics, RouterMetrics
from pd.router.policies import routing_key
from pd.router.retry import Answer, Failure, Retrier, no_worker
from pd.router.rooms import assign_rids, client_request_id, new_rid, request_shape, stamp
from pd.router.stream import Relay
from pd.router.tokens import wants_usage_injected
from pd.router.upstream import UpstreamClient, header_block
from pd.router.workers import WorkerPool

if TYPE_CHECKING:
    import httpx

log = logging.getLogger("pd.router")


class PDDispatcher:
    """Handles /generate, /v1/completions and /v1/chat/completions in PD mode.

    Args:
        pool: the workers and the pairing policies.
        metrics: where to record stage latencies and outcomes.
        settings: retries, timeouts, limits.
        auth: API keys.

    Each attempt runs in ``runner`` (pd.router.attempt). The two generation requests go through the
    pooled ``UpstreamClient`` (pd.router.upstream), aborts through the shared ``httpx.AsyncClient``
    (pd.router.client); both must be set with ``bind`` before the first request.
    """

    def __init__(self, pool: WorkerPool, metrics: RouterMetrics, settings: RouterSettings, auth: Auth):
        self.pool = pool
        self.metrics = metrics
        self.settings = settings
        self.auth = auth
        self.tasks = TaskSet()
        self.aborter = Aborter(self.tasks, {})
        self.runner = AttemptRunner(settings, self.tasks, self.aborter)
        self.retrier = Retrier(settings.retry)
        self.limit = settings.max_payload_size
        self.body_timeout = settings.timeouts.body_read
        self.body_min_rate = settings.timeouts.body_read_min_rate  # bytes/s, once body_grace s have passed
        self.body_grace = settings.timeouts.body_read_grace
        self.id_headers = [h.lower().encode("latin-1") for h in settings.request_id_headers]
        # each worker's own key is added per call (Worker.auth_line): a key goes only where it was given
        self.worker_headers = header_block({"Content-Type": "application/json"})
        self.admission = InFlightLimit(settings.max_concurrent_requests, settings.queue_size,
                                       settings.queue_timeout_secs, metrics.queued)

    def bind(self, http: httpx.AsyncClient, client: UpstreamClient) -> None:
        """Attach the secondary-traffic client (aborts) and the upstream client once the event loop runs."""
        self.aborter.client = http
        self.runner.client = client

    # ---- the request path --------------------------------------------------------------------
    async def handle(self, scope: Scope, receive: Receive, send: Send, route: str) -> None:
        """Serve one generation request (an ASGI ``http`` scope) in PD mode: decode's answer
        (streamed for ``stream: true``), a worker's own error, or a router error (400 malformed or over a cap,
        401 key, 408 body too slow, 413 too large, 429 no in-flight slot, 502 unreachable, 503 no worker,
        504 timed out), always with
        ``X-Request-Id``. A client that left gets nothing (recorded as 499)."""
        arrival = time.perf_counter()
        em = self.metrics.endpoint(route)
        in_flight = self.metrics.in_flight
        in_flight.inc()
        try:
            await self._serve(scope, receive, send, route, em, arrival)
        finally:
            in_flight.dec()

    async def _reject(self, send: Send, em: EndpointMetrics, arrival: float, status: int, kind: str, msg: str,
                      rid_header: tuple[bytes, bytes], param: Optional[str] = None,
                      *extra: tuple[bytes, bytes]) -> None:
        record_outcome(em, arrival, status, kind)
        await send_whole(send, status, error_json(status, msg, param), extra=(rid_header, *extra))

    async def _refuse_busy(self, send: Send, em: EndpointMetrics, arrival: float, why: str, req_id: str,
                           rid_header: tuple[bytes, bytes]) -> None:
        """429 for a request that got no in-flight slot (``why``: ``queue_full`` or ``queue_timeout``)."""
        a, s = self.admission, self.settings
        wait = a.retry_after()
        if why == "queue_full":
            msg = (f"the router is at its limit of {s.max_concurrent_requests} requests in flight "
                   f"({ADMISSION_FLAG['max_concurrent_requests']}) and {a.waiting} waiting "
                   f"({ADMISSION_FLAG['queue_size']})")
        else:
            msg = (f"no in-flight slot within {s.queue_timeout_secs:g} s ({ADMISSION_FLAG['queue_timeout_secs']}) "
                   f"with {s.max_concurrent_requests} requests in flight "
                   f"({ADMISSION_FLAG['max_concurrent_requests']})")
        await self._reject(send, em, arrival, 429, why, f"{msg}; retry after {wait} s (request id {req_id})",
                           rid_header, None, (b"retry-after", str(wait).encode()))

    async def _serve(self, scope: Scope, receive: Receive, send: Send, route: str, em: EndpointMetrics,
                     arrival: float) -> None:
        headers = request_headers(scope)
        req_id = None
        for h in self.id_headers:
            value = headers.get(h)
            if value:
                req_id = client_request_id(value)
                break
        if req_id is None:
            req_id = new_rid()
        rid_header = (b"x-request-id", req_id.encode("latin-1"))
        if not self.auth.client_header_ok(headers.get(b"authorization")):
            return await self._reject(send, em, arrival, 401, "unauthorized", "missing or invalid API key "
                                      "(send 'Authorization: Bearer KEY')", rid_header)
        ctype = headers.get(b"content-type")
        if ctype is not None and not json_content_type(ctype):  # no Content-Type at all passes
            return await self._reject(send, em, arrival, 415, "invalid_request", f"Content-Type "
                                      f"{ctype.decode('latin-1')!r} is not JSON; send 'Content-Type: application/json'",
                                      rid_header)
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._reject(send, em, arrival, 413, "payload_too_large",
                                      f"request body of {declared.decode()} bytes exceeds the limit of {self.limit} "
                                      f"bytes (--max-payload-size)", rid_header)
        try:
            raw = await read_body(receive, self.limit, self.body_timeout, self.body_min_rate, self.body_grace)
        except ClientGone:
            record_outcome(em, arrival, CLIENT_CLOSED, "client_disconnect")
            return
        except BodyTimeout as e:
            return await self._reject(send, em, arrival, 408, "body_timeout", e.message, rid_header)
        if raw is None:
            return await self._reject(send, em, arrival, 413, "payload_too_large", f"request body exceeds the limit "
                                      f"of {self.limit} bytes (--max-payload-size)", rid_header)
        try:
            body, fast_json = jsonio.parse(raw)
        except ValueError as e:  # UnicodeDecodeError is one; jsonio's BadJSON names the field
            return await self._reject(send, em, arrival, 400, "invalid_request", f"malformed JSON body: {e}",
                                      rid_header, getattr(e, "path", None) or None)
        if not isinstance(body, dict):
            return await self._reject(send, em, arrival, 400, "invalid_request",
                                      "the request body must be a JSON object", rid_header)

        shape = request_shape(route, body)
        over = admission.check(route, shape, self.settings, body)
        if over is not None:  # before any worker is touched, and never retried
            return await self._reject(send, em, arrival, 400, "over_limit", over.message, rid_header, over.param)
        refused = unsupported.check(route, body)
        if refused is not None:
            return await self._reject(send, em, arrival, 400, "invalid_request", refused.message, rid_header,
                                      refused.param)
        count, batch, n = shape.sequences, shape.batch, shape.n
        key = routing_key(route, body) if self.pool.needs_key else None
        stream = jsonio.truthy(body.get("stream", False))
        merge = logprobs.wants_input_logprobs(route, body)
        drop_usage = stream and route != "/generate" and wants_usage_injected(body)
        upstream_headers = b"%sX-Request-Id: %s\r\n" % (self.worker_headers, rid_header[1])

        # Until the answer has ended, watch for the client leaving (uvicorn's send() drops the
        # bytes of a gone client silently): a decode would otherwise run to the end for nobody.
        watch = DisconnectWatch(receive)
        ex: Optional[Exchange] = None
        relay: Optional[Relay | fanout.Merged] = None

        def attempts_of(sub: dict, sub_count: int, sub_batch: bool, sub_n: int, sample: Optional[fanout.SampleMetrics]):
            """The attempt function of request body ``sub``: the request's own (``sample`` None; kept in ``ex``
            for aborting when the client leaves) or one fanned-out sample's (it aborts its own; its metrics
            are ``sample``)."""
            m = em if sample is None else sample

            async def attempt(number: int):
                """Attempt ``number`` (1-based) on a fresh pair with fresh rooms: a Failure or a committed answer."""
                nonlocal ex
                prefill = self.pool.pick_prefill(key)
                decode = self.pool.pick_decode(key) if prefill is not None else None
                if prefill is None or decode is None:
                    return no_worker(self.pool.unavailable_reason("prefill" if prefill is None else "decode"))
                rids = assign_rids(sub, sub_count, sub_batch, sub_n)
                stamp(sub, sub_count, sub_batch, prefill)
                payload = jsonio.encode(sub, fast_json)
                x = Exchange(route, m, prefill, decode, rids, sub_count, stream, merge, drop_usage, payload,
                             upstream_headers, arrival)
                plan = key.kv if key is not None else None
                if plan is not None and plan.worker is prefill:  # kv_aware's plan for this very decision
                    x.blocks, x.kv_predicted = plan.blocks, plan.predicted
                if sample is None:
                    ex = x
                if number == 1:
                    m.queue.observe(x.dispatched - arrival)
                result = await self.runner.run(x)
                if isinstance(result, Failure):
                    result.pair = f"{prefill.url} -> {decode.url}"
                    if sample is None:
                        ex = None  # both sides are done with (answered, or aborted)
                return result

            return attempt

        def retrying(number: int, failure: Failure) -> None:
            em.retries.inc()
            log.warning("request %s attempt %d on %s failed (%s %s: %s); retrying on a fresh pair", req_id, number,
                        failure.pair or "no pair", failure.status, failure.kind, failure.body[:200])

        admitted = 0.0  # when an in-flight slot became this request's (0: it has none)
        try:
            limit = self.admission
            if not limit.enter():
                busy = await limit.wait()  # the disconnect watch is on: a client leaving leaves the queue
                if busy is not None:
                    watch.disarm()
                    return await self._refuse_busy(send, em, arrival, busy, req_id, rid_header)
            admitted = time.perf_counter()
            if fanout.applies(route, body, shape):  # one single-sample request per sample, merged
                samples_em = fanout.SampleMetrics(em)

                def run_sample(sub: dict):
                    return self.retrier.run(attempts_of(sub, shape.prompts, batch, 1, samples_em), retrying)

                def record(status: int, kind: Optional[str]) -> None:
                    record_outcome(em, arrival, status, kind)

                result, attempts = await fanout.run(route, shape, fanout.split(route, body, shape), run_sample,
                                                    record)
            else:
                result, attempts = await self.retrier.run(attempts_of(body, count, batch, n, None), retrying)
            if isinstance(result, (Relay, fanout.Merged)):
                relay = result
                try:
                    await relay.run(send, rid_header)
                finally:
                    relay.close(finished=False)  # no-op when the stream ran to its end
                return
            if isinstance(result, Answer):
                watch.disarm()
                await send_whole(send, result.status, result.body, result.content_type, (rid_header,))
                return
            record_outcome(em, arrival, result.status, result.kind)
            if attempts > 1:
                log.warning("request %s failed after %d attempts: %s %s", req_id, attempts, result.status,
                            result.body[:300])
            watch.disarm()
            await send_whole(send, result.status, result.body, result.content_type, (rid_header,))
        except asyncio.CancelledError:
            if not watch.client_left():
                raise  # not the client leaving (e.g. shutdown)
            watch.task.uncancel()  # the watch's task is this one
            if relay is None:  # a relay records its own end
                if ex is not None:
                    self.runner.abort_both(ex)
                record_outcome(em, arrival, CLIENT_CLOSED, "client_disconnect")
        finally:
            watch.stop()
            if admitted:
                self.admission.release(time.perf_counter() - admitted)
