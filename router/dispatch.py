"""PD request handling: one request in, the same body to a prefill and a decode worker, decode's
answer out.

Per request (DESIGN.md, "The PD wire protocol"):

1. Parse the JSON body (400 if malformed), pick a (prefill, decode) pair, stamp the bootstrap
   fields (one fresh bootstrap room per generated sequence) and a ``rid``.
2. POST the same bytes to the same route on both workers concurrently, over the shared pool.
3. The client gets decode's status and body; a stream is relayed SSE event by SSE event as it
   arrives. With ``return_logprob`` on /generate the prefill's prompt logprobs are prepended.
4. The prefill's response is always read to the end, in a task of its own that outlives the
   client's request: closing it early makes the engine abort the bootstrap room.

Failures: a prefill that answers non-2xx before decode answered ends the request at once with
the prefill's status and body, and the decode side is settled in the background (aborted by
POST /abort_request with the rid unless it ends by itself within a short grace); a decode non-2xx
is returned as is (the prefill is settled likewise, so it does not wait out its bootstrap
timeout); an unreachable worker gives 502, an upstream timeout 504, both with an OpenAI-style
error body naming the worker. A client that goes away aborts the decode side.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator, Optional

import aiohttp
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from pd.router import logprobs
from pd.router.client import JSON_HEADERS
from pd.router.errors import error_body, error_response
from pd.router.metrics import RouterMetrics
from pd.router.rooms import stamp
from pd.router.workers import Pair, Worker, WorkerPool

log = logging.getLogger("pd.router")

ABORT_TIMEOUT = 5.0  # seconds for one /abort_request; best effort, it must never block a reply
ABORT_GRACE = 0.2  # seconds a side gets to end by itself after its peer failed, before it is aborted
ABORT_BACKOFF = (1.0, 2.0, 4.0)  # seconds to wait after each /abort_request for the request to end
PREFILL_VERDICT_WAIT = 0.5  # seconds a decode error waits for the prefill's outcome (the likelier root cause)
DISCONNECT_POLL = 0.5  # seconds between checks that the client is still there (before replying)
CLIENT_CLOSED = 499  # nginx's status for "client closed the request" (only ever seen in metrics)
UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


def _ok(status: Optional[int]) -> bool:
    return status is not None and 200 <= status < 300


def _truthy(value) -> bool:
    if isinstance(value, str):  # pydantic (the engines) accepts "true"/"false" strings
        return value.strip().lower() in ("1", "true", "yes", "on", "t", "y")
    return bool(value)


@dataclass
class PrefillOutcome:
    """How the prefill side of one request ended.

    Attributes:
        status: HTTP status, None when there was no HTTP answer.
        body: the whole body when it is needed (an error, or logprobs to merge), else b"".
        content_type: the answer's content type.
        failure: ``connect`` or ``timeout`` when there was no HTTP answer.
        detail: what went wrong, for the error message.
    """

    status: Optional[int]
    body: bytes = b""
    content_type: str = "application/json"
    failure: Optional[str] = None
    detail: str = ""

    @property
    def ok(self) -> bool:
        return _ok(self.status)


class Exchange:
    """The state of one PD request while it is in flight."""

    def __init__(self, route: str, pair: Pair, rids: list[str], stream: bool, merge: bool, payload: bytes,
                 arrival: float, dispatched: float):
        self.route = route
        self.pair = pair
        self.rids = rids
        self.stream = stream
        self.merge = merge
        self.payload = payload
        self.arrival = arrival
        self.dispatched = dispatched
        self.prefill_task: Optional[asyncio.Task] = None
        self.decode_task: Optional[asyncio.Future] = None
        self._decode_open = False

    def decode_begin(self) -> None:
        self._decode_open = True
        self.pair.decode.begin()

    def decode_end(self) -> None:
        """Idempotent: the decode side is over (in-flight gauge -1 once)."""
        if self._decode_open:
            self._decode_open = False
            self.pair.decode.end()

    def release_decode(self, task: asyncio.Future) -> None:
        """Close the response of a finished decode request nobody will read (it was aborted)."""
        if not task.cancelled() and task.exception() is None:
            task.result().close()
        self.decode_end()


class RelayResponse(StreamingResponse):
    """A StreamingResponse over a ``Relay`` that always closes it: Starlette leaves an async
    generator unclosed when the client disconnects, and the cleanup (close decode's connection,
    abort its sequences) must run then, not at garbage collection."""

    def __init__(self, relay: "Relay", **kw):
        super().__init__(relay.events(), **kw)
        self.relay = relay

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            self.relay.close(finished=False)  # no-op when the stream ran to its end


class PDDispatcher:
    """Handles /generate, /v1/completions and /v1/chat/completions in PD mode.

    Args:
        pool: the workers and the pairing policy.
        metrics: where to record stage latencies and outcomes.

    ``session`` (the shared ``aiohttp.ClientSession``) must be set before the first request.
    """

    def __init__(self, pool: WorkerPool, metrics: RouterMetrics):
        self.pool = pool
        self.metrics = metrics
        self.session: Optional[aiohttp.ClientSession] = None
        self._background: set[asyncio.Task] = set()

    # ---- background work that must outlive the client's request ----------------------------
    def spawn(self, coro) -> asyncio.Task:
        """Run ``coro`` in a task the dispatcher keeps a reference to until it ends."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def drain(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for background work (prefill reads, aborts), then
        cancel what is left. Called at shutdown."""
        if self._background:
            _, pending = await asyncio.wait(set(self._background), timeout=timeout)
            for t in pending:
                t.cancel()

    def abort(self, worker: Worker, rids: list[str]) -> None:
        """Fire-and-forget POST /abort_request for each rid (the engine aborts by rid prefix,
        which reaches the ``rid_i`` items of a batch)."""
        self.spawn(self._abort(worker, rids))

    async def _abort(self, worker: Worker, rids: list[str]) -> None:
        for rid in rids:
            try:
                async with self.session.post(worker.url + "/abort_request", json={"rid": rid},
                                             timeout=aiohttp.ClientTimeout(total=ABORT_TIMEOUT)) as r:
                    await r.read()
            except UPSTREAM_ERRORS as e:
                log.warning("abort of rid %s on %s %s failed: %r", rid, worker.role, worker.url, e)

    def settle(self, worker: Worker, rids: list[str], task: asyncio.Future, on_done=None,
               grace: float = ABORT_GRACE) -> None:
        """In the background: give ``worker``'s request ``task`` ``grace`` seconds to end by
        itself, then abort ``rids`` there, repeating with backoff while it has not ended (one
        /abort_request can overtake the request it aborts, and the engine only aborts sequences
        it already has). ``on_done(task)`` runs once the task ended (e.g. to release its response).

        Why not abort at once: a peer failure usually ends the other side within milliseconds
        anyway (the engines tell each other through the bootstrap channel), and an unneeded abort
        costs the engine a lookup per rid."""
        self.spawn(self._settle(worker, rids, task, on_done, grace))

    async def _settle(self, worker: Worker, rids: list[str], task: asyncio.Future, on_done, grace: float) -> None:
        if grace > 0:
            await asyncio.wait({task}, timeout=grace)
        for wait in ABORT_BACKOFF:
            if task.done():
                break
            await self._abort(worker, rids)
            await asyncio.wait({task}, timeout=wait)
        if not task.done():
            log.warning("%s %s has not ended %gs after aborting rid %s; waiting for it", worker.role, worker.url,
                        sum(ABORT_BACKOFF), rids)
            await asyncio.wait({task})
        if on_done is not None:
            on_done(task)

    # ---- bookkeeping ------------------------------------------------------------------------
    def _finish(self, ex_route: str, arrival: float, status: int, kind: Optional[str] = None) -> None:
        m = self.metrics
        m.e2e.labels(ex_route).observe(time.perf_counter() - arrival)
        m.requests.labels(ex_route, str(status)).inc()
        if kind is not None:
            m.errors.labels(ex_route, kind).inc()

    def _upstream_error(self, ex: Exchange, worker: Worker, exc: BaseException) -> Response:
        """502 (unreachable, connection broken) or 504 (timed out) naming ``worker``."""
        if isinstance(exc, asyncio.TimeoutError):
            status, kind = 504, f"{worker.role}_timeout"
            msg = f"{worker.role} worker {worker.url} timed out on {ex.route}"
        else:
            status, kind = 502, f"{worker.role}_connect"
            if isinstance(exc, aiohttp.ClientConnectorError):
                worker.mark_unreachable()  # skipped by the pairing policy until a probe passes
            msg = f"{worker.role} worker {worker.url} is unreachable or broke the connection on {ex.route}: {exc}"
        log.warning("%s", msg)
        self._finish(ex.route, ex.arrival, status, kind)
        return error_response(status, msg)

    # ---- the request path --------------------------------------------------------------------
    async def handle(self, request: Request, route: str) -> Response:
        """Serve one generation request in PD mode.

        Returns decode's response (streamed for ``stream: true``), or the prefill's error, or a
        router error: 400 malformed JSON, 502 worker unreachable, 504 worker timed out.
        """
        arrival = time.perf_counter()
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            self._finish(route, arrival, 400, "invalid_request")
            return error_response(400, f"malformed JSON body: {e}")
        if not isinstance(body, dict):
            self._finish(route, arrival, 400, "invalid_request")
            return error_response(400, "the request body must be a JSON object")
        pair = self.pool.pick()
        rids = stamp(route, body, pair.prefill)
        payload = json.dumps(body, ensure_ascii=False).encode()
        dispatched = time.perf_counter()
        self.metrics.queue.labels(route).observe(dispatched - arrival)
        ex = Exchange(route, pair, rids, _truthy(body.get("stream", False)),
                      logprobs.wants_input_logprobs(route, body), payload, arrival, dispatched)
        ex.prefill_task = self.spawn(self._read_prefill(ex))

        # Until the answer starts, watch for the client leaving (Starlette only notices once
        # it sends): a waiting decode would otherwise run to the end for nobody.
        core = asyncio.ensure_future(self._respond(ex))
        watch = asyncio.ensure_future(self._watch_disconnect(request))
        try:
            await asyncio.wait({core, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not core.done():
                core.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await core
        if not core.cancelled():
            return core.result()
        if ex.decode_task is not None and not ex.decode_task.done():
            self.settle(pair.decode, rids, ex.decode_task, ex.release_decode, grace=0)
        else:
            self.abort(pair.decode, rids)
        self._finish(route, arrival, CLIENT_CLOSED, "client_disconnect")
        return Response(status_code=CLIENT_CLOSED)

    @staticmethod
    async def _watch_disconnect(request: Request) -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL)

    async def _read_prefill(self, ex: Exchange) -> PrefillOutcome:
        """POST to the prefill and read its answer to the end; never raises."""
        w = ex.pair.prefill
        w.begin()
        try:
            async with self.session.post(w.url + ex.route, data=ex.payload, headers=JSON_HEADERS) as resp:
                keep = ex.merge or not _ok(resp.status)
                chunks = []
                async for chunk in resp.content.iter_any():
                    if keep:
                        chunks.append(chunk)
                return PrefillOutcome(resp.status, b"".join(chunks), resp.content_type)
        except asyncio.TimeoutError as e:
            return PrefillOutcome(None, failure="timeout", detail=repr(e))
        except UPSTREAM_ERRORS as e:
            if isinstance(e, aiohttp.ClientConnectorError):
                w.mark_unreachable()
            return PrefillOutcome(None, failure="connect", detail=str(e) or repr(e))
        finally:
            w.end()
            self.metrics.prefill.labels(ex.route).observe(time.perf_counter() - ex.dispatched)

    async def _open_decode(self, ex: Exchange) -> aiohttp.ClientResponse:
        ex.decode_begin()
        try:
            return await self.session.post(ex.pair.decode.url + ex.route, data=ex.payload, headers=JSON_HEADERS)
        except BaseException:
            ex.decode_end()
            raise

    def _prefill_failed(self, ex: Exchange, pre: PrefillOutcome) -> Response:
        """The client gets the prefill's own error (its status and body), or 502/504."""
        w = ex.pair.prefill
        if pre.status is None:
            status, kind = (504, "prefill_timeout") if pre.failure == "timeout" else (502, "prefill_connect")
            what = "timed out" if pre.failure == "timeout" else "is unreachable or broke the connection"
            msg = f"prefill worker {w.url} {what} on {ex.route}: {pre.detail}"
            log.warning("%s", msg)
            self._finish(ex.route, ex.arrival, status, kind)
            return error_response(status, msg)
        self._finish(ex.route, ex.arrival, pre.status, "prefill_status")
        return Response(pre.body, status_code=pre.status, media_type=pre.content_type)

    async def _respond(self, ex: Exchange) -> Response:
        # Not awaited directly: if this coroutine is cancelled (client gone) the decode request
        # stays open until its abort lands (see handle / settle).
        decode_task = ex.decode_task = asyncio.ensure_future(self._open_decode(ex))
        done, _ = await asyncio.wait({ex.prefill_task, decode_task}, return_when=asyncio.FIRST_COMPLETED)
        if decode_task not in done:
            pre = ex.prefill_task.result()
            if not pre.ok:
                # Decode has produced nothing yet: answer now, abort and release decode's side.
                self.settle(ex.pair.decode, ex.rids, decode_task, ex.release_decode)
                return self._prefill_failed(ex, pre)
            await asyncio.wait({decode_task})
        try:
            resp = decode_task.result()
        except UPSTREAM_ERRORS as e:
            self.settle(ex.pair.prefill, ex.rids, ex.prefill_task)
            return self._upstream_error(ex, ex.pair.decode, e)
        return await self._decode_answer(ex, resp)

    async def _decode_answer(self, ex: Exchange, resp: aiohttp.ClientResponse) -> Response:
        """Decode answered (headers in): relay its status and body."""
        if not _ok(resp.status):
            try:
                data = await resp.read()
            except UPSTREAM_ERRORS as e:
                data = json.dumps(error_body(resp.status, f"decode worker {ex.pair.decode.url}: {e}")).encode()
            finally:
                resp.release()
                ex.decode_end()
            # A decode error is often only the echo of a failed prefill (its bootstrap server is
            # gone): give the prefill's outcome a moment, so the client gets the root cause.
            await asyncio.wait({ex.prefill_task}, timeout=PREFILL_VERDICT_WAIT)
            # The prefill would otherwise wait for this decode until its bootstrap timeout.
            self.settle(ex.pair.prefill, ex.rids, ex.prefill_task)
            pre = ex.prefill_task.result() if ex.prefill_task.done() else None
            if pre is not None and pre.status is not None and not pre.ok:
                return self._prefill_failed(ex, pre)  # the root cause, when it is already known
            self._finish(ex.route, ex.arrival, resp.status, "decode_status")
            return Response(data, status_code=resp.status, media_type=resp.content_type)
        if ex.stream:
            return RelayResponse(Relay(self, ex, resp), status_code=resp.status, media_type=resp.content_type,
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            data = await resp.read()
        except UPSTREAM_ERRORS as e:
            resp.close()
            return self._upstream_error(ex, ex.pair.decode, e)
        except asyncio.CancelledError:
            resp.close()
            raise
        finally:
            ex.decode_end()
        self.metrics.ttft.labels(ex.route).observe(time.perf_counter() - ex.arrival)
        if ex.merge:
            pre = await asyncio.shield(ex.prefill_task)  # being cancelled must not cancel the prefill read
            if pre.ok:
                data = logprobs.merge_full(data, logprobs.prefill_inputs(pre.body, stream=False))
        self._finish(ex.route, ex.arrival, resp.status)
        return Response(data, status_code=resp.status, media_type=resp.content_type)


class Relay:
    """Relays decode's SSE stream for one request, event by event as it arrives (prompt logprobs
    merged in when asked); on a broken upstream it ends with an error chunk and ``[DONE]`` like
    the engines do. ``close()`` releases everything exactly once, whether the stream ended or
    the client left (or never read a byte)."""

    def __init__(self, dispatcher: "PDDispatcher", ex: Exchange, resp: aiohttp.ClientResponse):
        self.d = dispatcher
        self.ex = ex
        self.resp = resp
        self.kind: Optional[str] = None
        self._closed = False

    async def events(self) -> AsyncIterator[bytes]:
        ex, m, route = self.ex, self.d.metrics, self.ex.route
        first, last_event = True, None
        inputs: Optional[dict] = None
        buf = b""
        try:
            async for chunk in self.resp.content.iter_any():
                now = time.perf_counter()
                if first:
                    m.ttft.labels(route).observe(now - ex.arrival)
                    first = False
                buf += chunk
                while (cut := buf.find(b"\n\n")) >= 0:
                    event, buf = buf[:cut], buf[cut + 2:]
                    if event.startswith(logprobs.SSE_DATA) and not event.startswith(logprobs.SSE_DONE):
                        if last_event is not None:
                            m.itl.labels(route).observe(now - last_event)
                        last_event = now
                        if ex.merge:
                            if inputs is None:
                                # shield: being cancelled here must not cancel the prefill read
                                pre = await asyncio.shield(ex.prefill_task)
                                inputs = logprobs.prefill_inputs(pre.body, stream=True) if pre.ok else {}
                            event = logprobs.merge_event(event, inputs)
                    yield event + b"\n\n"
            if buf.strip():
                yield buf
        except UPSTREAM_ERRORS as e:
            self.kind = "decode_timeout" if isinstance(e, asyncio.TimeoutError) else "decode_stream"
            msg = f"decode worker {ex.pair.decode.url} broke the stream on {route}: {e!r}"
            log.warning("%s", msg)
            yield b"data: " + json.dumps(error_body(502, msg)).encode() + b"\n\n" + logprobs.SSE_DONE + b"\n\n"
        self.close(finished=True)

    def close(self, finished: bool) -> None:
        """Release decode's connection and record the outcome; idempotent. ``finished`` False
        means the client left early: drop the connection and abort decode's sequences."""
        if self._closed:
            return
        self._closed = True
        ex = self.ex
        status = self.resp.status
        if finished:
            self.resp.release()
        else:
            self.resp.close()
            self.d.abort(ex.pair.decode, ex.rids)
            status, self.kind = CLIENT_CLOSED, "client_disconnect"
        ex.decode_end()
        self.d._finish(ex.route, ex.arrival, status, self.kind)
