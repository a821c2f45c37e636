"""One attempt of a PD request: the same body to a prefill and a decode worker at once, and what
comes of it: a committed answer for the client (a whole ``Answer``, or a stream's ``Relay``), or a
``Failure`` that pd.router.retry may retry on a fresh pair (pd.router.dispatch builds the attempts).

The prefill's response is always read to the end in a task of its own (closing it early makes the
engine abort the room). Until the first token, an attempt is bounded by ``timeouts.first_token``;
a non-stream answer is bounded by it only until the decode accepted it (the prefill answered 2xx),
then by ``timeouts.request``: passing that is a 504 that is neither retried nor counted against the
breaker (``AttemptRunner._exchange``). When one side fails, the other is aborted at once
(pd.router.aborts); sequences one side ends as aborted are aborted on the other side too.
Connection errors, timeouts and 5xx count against the worker's circuit breaker.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Awaitable, Callable, Optional, Union

from pd.router import logprobs
from pd.router.aborts import Aborter, aborted_indexes
from pd.router.background import TaskSet
from pd.router.config import RouterSettings
from pd.router.deadline import Deadline
from pd.router.errors import TIMEOUT_ERRORS, UPSTREAM_ERRORS, error_body
from pd.router.exchange import Exchange, PrefillOutcome, is_2xx, record_outcome, report_cached
from pd.router.retry import Answer, Failure, answered, no_answer, stream_start
from pd.router.stream import Relay
from pd.router.tokens import count_all as count_tokens
from pd.router.upstream import Response as UpstreamResponse
from pd.router.upstream import UpstreamClient

log = logging.getLogger("pd.router")

PREFILL_VERDICT_WAIT = 0.25  # seconds a decode error waits for the prefill's outcome (the likelier root cause)


class AttemptRunner:
    """Runs the attempts of PD requests (``run``), and aborts their sides.

    Args:
        settings: the timeouts.
        tasks: where the prefill reads run (drained at shutdown).
        aborter: sends the aborts.

    ``client``, the pooled upstream client of the two generation requests, must be set before the
    first attempt (``PDDispatcher.bind``).
    """

    def __init__(self, settings: RouterSettings, tasks: TaskSet, aborter: Aborter):
        self.tasks = tasks
        self.aborter = aborter
        self.client: Optional[UpstreamClient] = None
        t = settings.timeouts
        self.prefill_timeout = t.prefill or t.request  # seconds, the whole prefill request
        self.request_timeout = t.request  # seconds, the whole decode request (streams included)
        self.first_token_timeout = t.first_token
        self.stream_idle_timeout = t.stream_idle

    def _upstream(self) -> UpstreamClient:
        """The upstream client. Raises RuntimeError before ``PDDispatcher.bind`` set it."""
        client = self.client
        if client is None:
            raise RuntimeError("no upstream client: PDDispatcher.bind() must run before the first request")
        return client

    # ---- one attempt -------------------------------------------------------------------------
    async def run(self, ex: Exchange) -> Union[Answer, Relay, Failure]:
        """Run one attempt: an Answer or a Relay for the client (committed), or a Failure."""
        prefill_task = ex.prefill_task = self.tasks.spawn(self._read_prefill(ex))
        decode_task = ex.decode_task = asyncio.get_running_loop().create_task(self._open_decode(ex))
        try:
            async with Deadline(self.first_token_timeout) as deadline:  # None: no deadline
                return await self._exchange(ex, prefill_task, decode_task, deadline)
        except TimeoutError:
            # the first-token deadline passed: blame the side still working
            side = ex.prefill if not prefill_task.done() else ex.decode
            self.abort_both(ex)
            side.breaker.record_failure()
            return no_answer(side.role, True, f"{side.role} worker {side.url} gave no first token within "
                                              f"{self.first_token_timeout:g}s on {ex.route} (timeouts.first_token)")
        except asyncio.CancelledError:
            self.abort_both(ex)
            raise

    async def _exchange(self, ex: Exchange, prefill_task: asyncio.Task[PrefillOutcome],
                        decode_task: asyncio.Task[UpstreamResponse],
                        deadline: Deadline) -> Union[Answer, Relay, Failure]:
        """The attempt (its sides' tasks, ``ex``'s own) under ``deadline`` (timeouts.first_token): a committed
        answer or a Failure.

        A non-stream answer is accepted by the decode once the prefill answered 2xx while the decode
        request still runs: SGLang's prefill answers only after its KV reached the decode, which needs
        the decode to hold the request (it registered the room and allocated the KV), so the decode is
        generating. SGLang sends a non-stream answer's headers only with its last byte, so nothing
        the decode sends tells this earlier. From then on ``deadline`` is lifted: the answer is bounded
        by timeouts.request (the decode request's own limit) and that passing is not retried.
        """
        await _first_done(prefill_task, decode_task)
        if not decode_task.done():
            pre = prefill_task.result()
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
        if not is_2xx(resp.status):
            return await self._decode_status(ex, resp)
        if ex.stream:
            return await self._decode_stream(ex, resp)
        data = await self._read_decode(ex, resp, resp.read)
        if isinstance(data, Failure):
            return data
        resp.release()
        ex.decode_end()
        ex.decode.breaker.record_success()
        if not prefill_task.done() and b"abort" in data:
            self.abort_prefill_sequences(ex, aborted_indexes(ex.route, data, False))
        em = ex.em
        em.ttft.observe(time.perf_counter() - ex.arrival)
        if ex.merge:
            pre = await asyncio.shield(prefill_task)  # being cancelled must not cancel the prefill read
            if pre.ok:
                data = logprobs.merge_full(data, logprobs.prefill_inputs(pre.body, stream=False))
        p, c, cached = count_tokens(data)
        report_cached(ex, cached)
        em.prompt_tokens.inc(p)
        em.completion_tokens.inc(c)
        record_outcome(em, ex.arrival, resp.status)
        return Answer(resp.status, data, resp.content_type)

    async def _read_prefill(self, ex: Exchange) -> PrefillOutcome:
        """POST to the prefill and read its answer to the end; never raises. Sequences the
        prefill reports as aborted get their decode sides aborted too."""
        w = ex.prefill
        w.begin(ex.seqs, ex.blocks)
        out: PrefillOutcome
        try:
            resp = await self._upstream().post(w.url, ex.route, ex.payload, ex.headers + w.auth_line,
                                               self.prefill_timeout)
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
            w.end(ex.seqs, ex.blocks)
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
            return await self._upstream().post(ex.decode.url, ex.route, ex.payload, ex.headers + ex.decode.auth_line,
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
        if not indexes or ex.prefill_aborted or ex.prefill_task is None or ex.prefill_task.done():
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

    def abort_both(self, ex: Exchange) -> None:
        """Abort both sides of the attempt (the client left, or the attempt was cancelled)."""
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
        assert task is not None  # started with the decode request (run)
        if not task.done():
            await asyncio.wait((task,), timeout=PREFILL_VERDICT_WAIT)
        if task.done() and not task.cancelled():
            pre = task.result()
            # an error status is the prefill's own answer; no answer at all counts only when it
            # was not our abort that cut the connection
            if not pre.ok and (pre.status is not None or not ex.prefill_aborted):
                return self._prefill_failure(ex, pre)
        return answered("decode", ex.decode.url, resp.status, data, resp.content_type)

    async def _read_decode(self, ex: Exchange, resp: UpstreamResponse,
                           read: Callable[[], Awaitable[bytes]]) -> Union[bytes, Failure]:
        """``await read()`` on decode's 2xx response -> the bytes. On an upstream error the decode
        side is closed and released, the prefill aborted and the decode's breaker told -> the
        failure to answer with. Anything else (cancellation) closes it and propagates."""
        try:
            return await read()
        except UPSTREAM_ERRORS as e:
            resp.close()
            ex.decode_end()
            self._abort_prefill(ex)
            return self._decode_failed(ex, e)
        except BaseException:
            resp.close()
            ex.decode_end()
            raise

    async def _decode_stream(self, ex: Exchange, resp: UpstreamResponse) -> Union[Relay, Failure]:
        """Decode answered a stream with 2xx: read its first chunk before committing, so a stream
        that starts with an error is still retried."""
        first = await self._read_decode(ex, resp, resp.readany)
        if isinstance(first, Failure):
            return first
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
