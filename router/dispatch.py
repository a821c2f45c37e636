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
rules and the loop; here: the attempts); the side that did not fail is aborted at once
(pd.router.aborts). A non-retryable answer (e.g. the prefill's 400 for a
prompt over the context length) goes to the client as the worker sent it, after the other side
was aborted. Sequences one side ends as aborted (finish reason ``abort``) are aborted on the
other side too. Connection errors, timeouts and 5xx count against the worker's circuit breaker.
A non-stream answer is bounded by ``timeouts.first_token`` only until the decode accepted it (the
prefill answered 2xx), then by ``timeouts.request``: passing that is a 504 that is neither retried
nor counted against the breaker (``PDDispatcher._exchange``).
A client that goes away before the answer starts gets both sides aborted; after it started, see
pd.router.stream.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import TYPE_CHECKING, Optional

from pd.router import admission, fanout, jsonio, logprobs, unsupported
from pd.router.aborts import Aborter, aborted_indexes
from pd.router.admission import FLAG as ADMISSION_FLAG
from pd.router.admission import InFlightLimit
from pd.router.auth import Auth
from pd.router.background import TaskSet
from pd.router.config import RouterSettings
from pd.router.errors import TIMEOUT_ERRORS, UPSTREAM_ERRORS, error_body, error_json
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
from pd.router.retry import Answer, Failure, Retrier, answered, no_answer, no_worker, stream_start
from pd.router.rooms import assign_rids, client_request_id, new_rid, request_shape, stamp
from pd.router.stream import Relay
from pd.router.tokens import count as count_tokens
from pd.router.tokens import wants_usage_injected
from pd.router.upstream import Response as UpstreamResponse
from pd.router.upstream import UpstreamClient, header_block
from pd.router.workers import Worker, WorkerPool

if TYPE_CHECKING:
    import httpx

log = logging.getLogger("pd.router")

PREFILL_VERDICT_WAIT = 0.25  # seconds a decode error waits for the prefill's outcome (the likelier root cause)
CLIENT_CLOSED = 499  # nginx's status for "client closed the request" (only ever seen in metrics)
WATCH_DELAY = 0.05  # seconds into a request (after its body) from which a client leaving is watched for


def _ok(status: Optional[int]) -> bool:
    return status is not None and 200 <= status < 300


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
        return _ok(self.status)


class Exchange:
    """One attempt of one request while it is in flight."""

    __slots__ = ("route", "em", "prefill", "decode", "rids", "seqs", "stream", "merge", "drop_usage", "payload",
                 "headers", "arrival", "dispatched", "prefill_task", "decode_task", "prefill_aborted",
                 "decode_aborted", "accepted", "_decode_open")

    def __init__(self, route: str, em: EndpointMetrics, prefill: Worker, decode: Worker, rids: list[str], seqs: int,
                 stream: bool, merge: bool, drop_usage: bool, payload: bytes, headers: dict, arrival: float):
        self.route, self.em = route, em
        self.prefill, self.decode = prefill, decode
        self.rids, self.seqs = rids, seqs
        self.stream, self.merge, self.drop_usage = stream, merge, drop_usage
        self.payload, self.headers = payload, headers
        self.arrival = arrival
        self.dispatched = time.perf_counter()
        self.prefill_task: Optional[asyncio.Task] = None
        self.decode_task: Optional[asyncio.Task] = None
        self.prefill_aborted = self.decode_aborted = False
        # a non-stream answer the decode accepted (the prefill answered 2xx: its KV reached the decode,
        # which is generating): bounded by timeouts.request only, and not retried when that passes
        self.accepted = False
        self._decode_open = False

    def decode_begin(self) -> None:
        """The decode side started: its sequences count as load on the decode worker until decode_end()."""
        self._decode_open = True
        self.decode.begin(self.seqs)

    def decode_end(self) -> None:
        """Idempotent: the decode side is over (its load counted down once)."""
        if self._decode_open:
            self._decode_open = False
            self.decode.end(self.seqs)

    def release_decode(self, task: asyncio.Future) -> None:
        """Close the response of an aborted decode request nobody will read."""
        if not task.cancelled() and task.exception() is None:
            task.result().close()
        self.decode_end()


class PDDispatcher:
    """Handles /generate, /v1/completions and /v1/chat/completions in PD mode.

    Args:
        pool: the workers and the pairing policies.
        metrics: where to record stage latencies and outcomes.
        settings: retries, timeouts, limits.
        auth: API keys.

    The two generation requests go through the pooled ``UpstreamClient`` (pd.router.upstream),
    aborts through the shared ``httpx.AsyncClient`` (pd.router.client); both must be set with
    ``bind`` before the first request.
    """

    def __init__(self, pool: WorkerPool, metrics: RouterMetrics, settings: RouterSettings, auth: Auth):
        self.pool = pool
        self.metrics = metrics
        self.settings = settings
        self.auth = auth
        self.tasks = TaskSet()
        self.aborter = Aborter(self.tasks, {})
        self.client: Optional[UpstreamClient] = None
        t = settings.timeouts
        self.prefill_timeout = t.prefill or t.request  # seconds, the whole prefill request
        self.request_timeout = t.request  # seconds, the whole decode request (streams included)
        self.first_token_timeout = t.first_token
        self.stream_idle_timeout = t.stream_idle
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
        self.client = client

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

    def record(self, em: EndpointMetrics, arrival: float, status: int, kind: Optional[str] = None) -> None:
        """Count one answered request: E2E latency, status, failure kind."""
        em.e2e.observe(time.perf_counter() - arrival)
        em.request(status)
        if kind is not None:
            em.error(kind)

    async def _reject(self, send: Send, em: EndpointMetrics, arrival: float, status: int, kind: str, msg: str,
                      rid_header: tuple[bytes, bytes], param: Optional[str] = None,
                      *extra: tuple[bytes, bytes]) -> None:
        self.record(em, arrival, status, kind)
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
        if not json_content_type(ctype):
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
            self.record(em, arrival, CLIENT_CLOSED, "client_disconnect")
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
                if sample is None:
                    ex = x
                if number == 1:
                    m.queue.observe(x.dispatched - arrival)
                result = await self._attempt(x)
                if sample is None and isinstance(result, Failure):
                    ex = None  # both sides are done with (answered, or aborted)
                return result

            return attempt

        def retrying(number: int, failure: Failure) -> None:
            em.retries.inc()
            log.warning("request %s attempt %d failed (%s %s: %s); retrying on a fresh pair", req_id, number,
                        failure.status, failure.kind, failure.body[:200])

        admitted = 0.0  # when an in-flight slot became this request's (0: it has none)
        try:
            limit = self.admission
            if not limit.enter():
                refused = await limit.wait()  # the disconnect watch is on: a client leaving leaves the queue
                if refused is not None:
                    watch.disarm()
                    return await self._refuse_busy(send, em, arrival, refused, req_id, rid_header)
            admitted = time.perf_counter()
            if fanout.applies(route, body, shape):  # one single-sample request per sample, merged
                samples_em = fanout.SampleMetrics(em)

                def run_sample(sub: dict):
                    return self.retrier.run(attempts_of(sub, shape.prompts, batch, 1, samples_em), retrying)

                def record(status: int, kind: Optional[str]) -> None:
                    self.record(em, arrival, status, kind)

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
            self.record(em, arrival, result.status, result.kind)
            if attempts > 1:
                log.warning("request %s failed after %d attempts: %s %s", req_id, attempts, result.status,
                            result.body[:300])
            watch.disarm()
            await send_whole(send, result.status, result.body, result.content_type, (rid_header,))
        except asyncio.CancelledError:
            if not watch.client_left():
                raise  # not the client leaving (e.g. shutdown)
            asyncio.current_task().uncancel()
            if relay is None:  # a relay records its own end
                if ex is not None:
                    self._abort_both(ex)
                self.record(em, arrival, CLIENT_CLOSED, "client_disconnect")
        finally:
            watch.stop()
            if admitted:
                self.admission.release(time.perf_counter() - admitted)

    # ---- one attempt -------------------------------------------------------------------------
    async def _attempt(self, ex: Exchange):
        """Run one attempt: an Answer or a Relay for the client (committed), or a Failure."""
        ex.prefill_task = self.tasks.spawn(self._read_prefill(ex))
        ex.decode_task = asyncio.get_running_loop().create_task(self._open_decode(ex))
        try:
            async with _Deadline(self.first_token_timeout) as deadline:  # None: no deadline
                return await self._exchange(ex, deadline)
        except TimeoutError:
            # the first-token deadline passed: blame the side still working
            side = ex.prefill if not ex.prefill_task.done() else ex.decode
            self._abort_both(ex)
            side.breaker.record_failure()
            return no_answer(side.role, True, f"{side.role} worker {side.url} gave no first token within "
                                              f"{self.first_token_timeout:g}s on {ex.route} (timeouts.first_token)")
        except asyncio.CancelledError:
            self._abort_both(ex)
            raise

    async def _exchange(self, ex: Exchange, deadline: "_Deadline"):
        """The attempt under ``deadline`` (timeouts.first_token): a committed answer or a Failure.

        A non-stream answer is accepted by the decode once the prefill answered 2xx while the decode
        request still runs: SGLang's prefill answers only after its KV reached the decode, which needs
        the decode to hold the request (it registered the room and allocated the KV), so the decode is
        generating. SGLang sends a non-stream answer's headers only with its last byte, so nothing
        the decode sends tells this earlier. From then on ``deadline`` is lifted: the answer is bounded
        by timeouts.request (the decode request's own limit) and that passing is not retried.
        """
        decode_task = ex.decode_task
        await _first_done(ex.prefill_task, decode_task)
        if not decode_task.done():
            pre = ex.prefill_task.result()
            if not pre.ok:
                # Decode has produced nothing yet: abort it, answer with the prefill's failure.
                self._abort_decode(ex)
                return self._prefill_failure(ex, pre)
            if not ex.stream:
                ex.accepted = True
                deadline.reschedule(None)
            await _first_done(decode_task, decode_task)
        try:
            resp = decode_task.result()
        except UPSTREAM_ERRORS as e:
            self._abort_prefill(ex)
            return self._decode_failed(ex, e)
        if not _ok(resp.status):
            return await self._decode_status(ex, resp)
        if ex.stream:
            return await self._decode_stream(ex, resp)
        data, failure = await self._read_decode(ex, resp, resp.read)
        if failure is not None:
            return failure
        resp.release()
        ex.decode_end()
        ex.decode.breaker.record_success()
        if not ex.prefill_task.done() and b"abort" in data:
            self.abort_prefill_sequences(ex, aborted_indexes(ex.route, data, False))
        em = ex.em
        em.ttft.observe(time.perf_counter() - ex.arrival)
        if ex.merge:
            pre = await asyncio.shield(ex.prefill_task)  # being cancelled must not cancel the prefill read
            if pre.ok:
                data = logprobs.merge_full(data, logprobs.prefill_inputs(pre.body, stream=False))
        p, c = count_tokens(data)
        em.prompt_tokens.inc(p)
        em.completion_tokens.inc(c)
        self.record(em, ex.arrival, resp.status)
        return Answer(resp.status, data, resp.content_type)

    async def _read_prefill(self, ex: Exchange) -> PrefillOutcome:
        """POST to the prefill and read its answer to the end; never raises. Sequences the
        prefill reports as aborted get their decode sides aborted too."""
        w = ex.prefill
        w.begin(ex.seqs)
        out: PrefillOutcome
        try:
            resp = await self.client.post(w.url, ex.route, ex.payload, ex.headers + w.auth_line, self.prefill_timeout)
            try:
                raw = await resp.read()
            except BaseException:
                resp.close()
                raise
            resp.release()
            out = PrefillOutcome(resp.status, raw, resp.content_type)
        except asyncio.TimeoutError as e:
            out = PrefillOutcome(None, failure="timeout", detail=repr(e))
        except UPSTREAM_ERRORS as e:
            out = PrefillOutcome(None, failure="connect", detail=str(e) or repr(e))
        finally:
            w.end(ex.seqs)
            ex.em.prefill.observe(time.perf_counter() - ex.dispatched)
        if not ex.prefill_aborted:
            if out.ok:
                w.breaker.record_success()
                aborted = aborted_indexes(ex.route, out.body, ex.stream)
                if aborted and not ex.decode_aborted:
                    rids = [ex.rids[i] for i in sorted(aborted) if i < len(ex.rids)]
                    log.info("prefill %s aborted %d of %d sequences; aborting them on decode %s", w.url, len(aborted),
                             ex.seqs, ex.decode.url)
                    self.aborter.abort(ex.decode, rids)
            elif out.status is None or out.status >= 500:
                w.breaker.record_failure()
        if out.ok and not ex.merge:
            out.body = b""  # not needed any more
        return out

    async def _open_decode(self, ex: Exchange) -> UpstreamResponse:
        ex.decode_begin()
        try:
            return await self.client.post(ex.decode.url, ex.route, ex.payload, ex.headers + ex.decode.auth_line,
                                          self.request_timeout)
        except BaseException:
            ex.decode_end()
            raise

    # ---- aborting ----------------------------------------------------------------------------
    def _abort_prefill(self, ex: Exchange) -> None:
        """Abort the prefill side if its request still runs (it would wait for a decode that
        will not come until its bootstrap timeout)."""
        if ex.prefill_aborted or ex.prefill_task is None or ex.prefill_task.done():
            return
        ex.prefill_aborted = True
        self.aborter.abort(ex.prefill, ex.rids, ex.prefill_task)

    def _abort_decode(self, ex: Exchange) -> None:
        """Abort the decode side and release its response once its request ended."""
        if ex.decode_aborted:
            return
        ex.decode_aborted = True
        task = ex.decode_task
        if task is None:
            return
        if task.done():
            if not task.cancelled() and task.exception() is None:
                task.result().close()  # dropping the connection aborts it on the engine too
                ex.decode_end()
                self.aborter.abort(ex.decode, ex.rids)
            return
        self.aborter.abort(ex.decode, ex.rids, task, ex.release_decode)

    def abort_prefill_sequences(self, ex: Exchange, indexes: set[int]) -> None:
        """Decode ended these sequences as aborted: if the prefill still works on the request,
        abort them there too (it would hold their KV until its bootstrap timeout)."""
        if not indexes or ex.prefill_aborted or ex.prefill_task.done():
            return
        if len(indexes) >= ex.seqs:
            self._abort_prefill(ex)
        else:
            self.aborter.abort(ex.prefill, [ex.rids[i] for i in sorted(indexes) if i < len(ex.rids)])

    def abort_after_break(self, ex: Exchange, resp: UpstreamResponse) -> None:
        """Decode's stream broke or the client left mid-stream: drop decode's connection, abort
        its sequences, and the prefill's if its request still runs."""
        if not ex.decode_aborted:
            ex.decode_aborted = True
            resp.close()
            self.aborter.abort(ex.decode, ex.rids)
        self._abort_prefill(ex)

    def _abort_both(self, ex: Exchange) -> None:
        self._abort_decode(ex)
        self._abort_prefill(ex)

    # ---- failures ----------------------------------------------------------------------------
    def _prefill_failure(self, ex: Exchange, pre: PrefillOutcome) -> Failure:
        """The prefill's own error (its status and body), or 502/504 when it gave no answer."""
        w = ex.prefill
        if pre.status is None:
            timeout = pre.failure == "timeout"
            what = "timed out (timeouts.prefill)" if timeout else "is unreachable or broke the connection"
            msg = f"prefill worker {w.url} {what} on {ex.route}: {pre.detail}"
            log.warning("%s", msg)
            return no_answer("prefill", timeout, msg)
        return answered("prefill", ex.prefill.url, pre.status, pre.body, pre.content_type)

    def _decode_failed(self, ex: Exchange, exc: BaseException) -> Failure:
        """The decode request raised ``exc`` (no answer, or its body broke off): the Failure to answer with.

        A non-stream answer the decode accepted (``Exchange.accepted``) that ran past timeouts.request
        gets a 504 that is not retried (a retry would redo the whole generation, past the bound the
        client was promised) and does not count against the decode's circuit breaker (a long answer
        is no sign of a broken worker); the decode's sequences are aborted. Any other error counts
        against the breaker and is retried as usual (502 unreachable or broken, 504 timed out).
        """
        if ex.accepted and isinstance(exc, TIMEOUT_ERRORS):
            w = ex.decode
            if not ex.decode_aborted:
                ex.decode_aborted = True
                self.aborter.abort(w, ex.rids)
            msg = (f"decode worker {w.url} did not finish its answer on {ex.route} within {self.request_timeout:g}s "
                   f"(timeouts.request); not retried: the decode had accepted the request")
            log.warning("%s", msg)
            return Failure.router(504, msg, "decode_timeout", False)
        ex.decode.breaker.record_failure()
        return self._decode_error(ex, exc)

    def _decode_error(self, ex: Exchange, exc: BaseException) -> Failure:
        """502 (unreachable, connection broken) or 504 (timed out) naming the decode worker."""
        w = ex.decode
        if isinstance(exc, asyncio.TimeoutError):
            msg = f"decode worker {w.url} timed out on {ex.route}"
            log.warning("%s", msg)
            return no_answer("decode", True, msg)
        msg = f"decode worker {w.url} is unreachable or broke the connection on {ex.route}: {exc}"
        log.warning("%s", msg)
        return no_answer("decode", False, msg)

    async def _decode_status(self, ex: Exchange, resp: UpstreamResponse) -> Failure:
        """Decode answered non-2xx: its error, or the prefill's when that is the root cause."""
        try:
            data = await resp.read()
        except UPSTREAM_ERRORS as e:
            data = json.dumps(error_body(resp.status, f"decode worker {ex.decode.url}: {e}")).encode()
        finally:
            resp.release()
            ex.decode_end()
        if resp.status >= 500:
            ex.decode.breaker.record_failure()
        self._abort_prefill(ex)  # at once: it would wait for this decode until its bootstrap timeout
        # A decode error is often only the echo of a failed prefill (its bootstrap server is gone):
        # give the prefill's answer a moment, so the client gets the root cause.
        task = ex.prefill_task
        if not task.done():
            await asyncio.wait((task,), timeout=PREFILL_VERDICT_WAIT)
        if task.done() and not task.cancelled():
            pre = task.result()
            # an error status is the prefill's own answer; no answer at all counts only when it
            # was not our abort that cut the connection
            if not pre.ok and (pre.status is not None or not ex.prefill_aborted):
                return self._prefill_failure(ex, pre)
        return answered("decode", ex.decode.url, resp.status, data, resp.content_type)

    async def _read_decode(self, ex: Exchange, resp: UpstreamResponse, read):
        """``await read()`` on decode's 2xx response -> (bytes, None). On an upstream error the decode
        side is closed and released, the prefill aborted and the decode's breaker told -> (None, the
        failure to answer with). Anything else (cancellation) closes it and propagates."""
        try:
            return await read(), None
        except UPSTREAM_ERRORS as e:
            resp.close()
            ex.decode_end()
            self._abort_prefill(ex)
            return None, self._decode_failed(ex, e)
        except BaseException:
            resp.close()
            ex.decode_end()
            raise

    async def _decode_stream(self, ex: Exchange, resp: UpstreamResponse):
        """Decode answered a stream with 2xx: read its first chunk before committing, so a stream
        that starts with an error is still retried."""
        first, failure = await self._read_decode(ex, resp, resp.readany)
        if failure is not None:
            return failure
        failure = stream_start(first)
        if failure is not None:
            if failure.status >= 500:
                ex.decode.breaker.record_failure()
            resp.close()
            ex.decode_end()
            self._abort_prefill(ex)
            return failure
        ex.decode.breaker.record_success()
        return Relay(self, ex, resp, first)


class _Deadline:
    """``asyncio.timeout(delay)`` for an attempt, as asyncio 3.11-3.13's ``Timeout`` behaves (the task is cancelled
    at the deadline and the CancelledError leaving the block becomes TimeoutError, unless another cancel came too;
    ``reschedule(None)`` lifts it), with less bookkeeping per request: no state machine, no second loop lookup.
    ``delay`` None: no deadline."""

    __slots__ = ("delay", "task", "handle", "expired", "cancelling")

    def __init__(self, delay: Optional[float]):
        self.delay = delay
        self.handle: Optional[asyncio.TimerHandle] = None
        self.expired = False

    async def __aenter__(self) -> "_Deadline":
        task = self.task = asyncio.current_task()
        self.cancelling = task.cancelling()
        if self.delay is not None:
            loop = task.get_loop()
            when = loop.time() + self.delay
            self.handle = loop.call_soon(self._expire) if self.delay <= 0 else loop.call_at(when, self._expire)
        return self

    def reschedule(self, when: None) -> None:
        """Lift the deadline (the only rescheduling an attempt does)."""
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None

    def _expire(self) -> None:
        self.handle = None
        self.expired = True
        self.task.cancel()

    async def __aexit__(self, exc_type, exc_val, exc_tb) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None
        if self.expired and self.task.uncancel() <= self.cancelling and exc_type is asyncio.CancelledError:
            raise TimeoutError from exc_val


async def _first_done(a: asyncio.Future, b: asyncio.Future) -> None:
    """Return once ``a`` or ``b`` is done, cancelling neither (``asyncio.wait(FIRST_COMPLETED)``
    without its per-call set, generator and type checks: this runs for every request)."""
    if a.done() or b.done():
        return
    waiter = a.get_loop().create_future()

    def wake(_: asyncio.Future) -> None:
        if not waiter.done():
            waiter.set_result(None)

    a.add_done_callback(wake)
    b.add_done_callback(wake)
    try:
        await waiter
    finally:
        a.remove_done_callback(wake)
        b.remove_done_callback(wake)


class DisconnectWatch:
    """Cancels the current task (a request's) when its client goes away, once armed for
    ``WATCH_DELAY`` seconds: the watching task is started only for requests that last that long
    (a task per request cost ~10% of the router's CPU on short ones; a client leaving is then
    noticed at most ``WATCH_DELAY`` late).

    Args:
        receive: the request's ASGI receive, its body already read.
    """

    __slots__ = ("task", "receive", "armed", "gone", "_timer")

    def __init__(self, receive: Receive):
        self.task = asyncio.current_task()
        self.receive = receive
        self.armed = True
        self.gone: Optional[asyncio.Task] = None
        self._timer: Optional[asyncio.TimerHandle] = self.task.get_loop().call_later(WATCH_DELAY, self._start)

    def _start(self) -> None:
        self._timer = None
        if self.armed:
            self.gone = self.task.get_loop().create_task(_wait_disconnect(self.receive))
            self.gone.add_done_callback(self._on_gone)

    def _on_gone(self, t: asyncio.Task) -> None:
        if self.armed and not t.cancelled():
            self.task.cancel()

    def client_left(self) -> bool:
        """Whether the client went away (a cancellation of the task came from here)."""
        return self.gone is not None and self.gone.done() and not self.gone.cancelled()

    def disarm(self) -> None:
        """From now on a client leaving cancels nothing (a whole answer is being sent)."""
        self.armed = False

    def stop(self) -> None:
        """Stop watching (the request is over)."""
        self.armed = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.gone is not None:
            self.gone.cancel()


async def _wait_disconnect(receive: Receive) -> None:
    """Returns when the client has gone away (the ASGI server's ``http.disconnect``)."""
    while (await receive())["type"] != "http.disconnect":
        pass
