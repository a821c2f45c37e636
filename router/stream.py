"""Relaying decode's SSE stream to the client once the answer has started (no retries from here).

Chunks are passed on as they arrive, cut at event boundaries (``\\n\\n``); per data event the
inter-token latency is observed, the token counts are read (pd.router.tokens), and with
``return_logprob`` on /generate the prefill's prompt logprobs are prepended. A decode stream that
breaks or stays silent longer than ``timeouts.stream_idle`` ends with an error chunk and
``data: [DONE]``, as the engines end their own failed streams. A client that leaves mid-stream
gets both sides aborted (pd.router.aborts) and the decode connection dropped; sequences the
decode ends as aborted are aborted on the prefill too if it still works on them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import TYPE_CHECKING, Optional

from pd.router import logprobs
from pd.router.aborts import aborted_indexes
from pd.router.errors import UPSTREAM_ERRORS, error_body
from pd.router.exchange import CLIENT_CLOSED, Exchange, record_outcome, report_cached
from pd.router.front import Send, response_headers
from pd.router.tokens import UsageTap

if TYPE_CHECKING:
    from pd.router.attempt import AttemptRunner
    from pd.router.upstream import Response as UpstreamResponse

log = logging.getLogger("pd.router")

_DATA = logprobs.SSE_DATA
_DONE = logprobs.SSE_DONE
_STREAM_HEADERS = ((b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no"))


class Relay:
    """Relays decode's stream for one request with direct ASGI sends. ``close()`` releases
    everything exactly once, whether the stream ended or the client left (or never read a byte).

    Args:
        runner: the attempt's runner (aborts, timeouts).
        ex: the attempt being answered.
        resp: decode's open response.
        first: the first chunk of its body, already read.
    """

    def __init__(self, runner: "AttemptRunner", ex: Exchange, resp: "UpstreamResponse", first: bytes):
        self.runner = runner
        self.ex = ex
        self.resp = resp
        self.first = first
        self.kind: Optional[str] = None
        self.tap = UsageTap(ex.route == "/generate", ex.drop_usage)
        self._closed = False

    async def run(self, send: Send, rid_header: tuple[bytes, bytes]) -> None:
        """Send the response (status and headers of decode's, plus ``rid_header``) and relay the
        stream to its end with plain ASGI messages. The caller must ``close(finished=False)``
        afterwards (a no-op when the stream ended here), also when this is cancelled."""
        ex, em, tap = self.ex, self.ex.em, self.tap
        prefill_task = ex.prefill_task
        assert prefill_task is not None  # a relay answers an attempt whose sides started
        idle = self.runner.stream_idle_timeout
        resp = self.resp
        readany = resp.readany
        now = time.perf_counter()
        em.ttft.observe(now - ex.arrival)
        await send({"type": "http.response.start", "status": self.resp.status,
                    "headers": response_headers(self.resp.content_type, _STREAM_HEADERS + (rid_header,))})
        inputs: Optional[dict] = None
        last_event: Optional[float] = None
        buf = self.first
        try:
            while True:
                out = []
                # The events are the parts before each "\n\n", cut left to right (split's rule); the rest waits
                # for more bytes. Most chunks need nothing but the inter-token latencies: no event the usage tap
                # counts or drops, none aborted, no logprobs to merge (the searches run over the whole chunk: a
                # match anywhere sends it through the per-event path). They are then passed on as they came.
                parts = buf.split(b"\n\n")
                if len(parts) > 1:
                    rest = parts.pop()
                    if ex.merge or b'"abort"' in buf or not tap.quiet(buf):
                        for event in parts:
                            if event.startswith(_DATA) and not event.startswith(_DONE):
                                if last_event is not None:
                                    em.itl.observe(now - last_event)
                                last_event = now
                                if not tap.event(event):
                                    continue
                                if b'"abort"' in event and not prefill_task.done():
                                    self.runner.abort_prefill_sequences(ex, aborted_indexes(ex.route, event + b"\n\n",
                                                                                       True))
                                if ex.merge:
                                    if inputs is None:
                                        # shield: being cancelled here must not cancel the prefill read
                                        pre = await asyncio.shield(prefill_task)
                                        inputs = logprobs.prefill_inputs(pre.body, stream=True) if pre.ok else {}
                                    event = logprobs.merge_event(event, inputs)
                            out.append(event)
                            out.append(b"\n\n")
                    else:
                        data = 0
                        for event in parts:
                            if event.startswith(_DATA) and not event.startswith(_DONE):
                                data += 1
                        if data:  # the first against the previous event, the others 0 s after it
                            if last_event is not None:
                                em.itl.observe(now - last_event)
                            if data > 1:
                                em.itl.observe_repeated(0.0, data - 1)
                            last_event = now
                        out.append(buf[:len(buf) - len(rest)])
                    buf = rest
                if resp.at_eof:
                    # decode's stream has ended and all of it is here: its last events and the
                    # end of the response go out in one message (one write, not two)
                    if buf.strip():
                        out.append(buf)
                    buf = b""
                    break
                if out:
                    await send({"type": "http.response.body", "body": b"".join(out), "more_body": True})
                    out = []
                chunk = await readany(idle)  # TimeoutError after ``idle`` s without bytes
                if not chunk:
                    break
                now = time.perf_counter()
                buf += chunk
            tail = b"".join(out) if out else (buf if buf.strip() else b"")
        except UPSTREAM_ERRORS as e:
            if isinstance(e, TimeoutError) and idle is not None:
                self.kind = "decode_timeout"
                msg = f"decode worker {ex.decode.url} sent nothing for {idle:g}s on {ex.route} (timeouts.stream_idle)"
            else:
                self.kind = "decode_timeout" if isinstance(e, asyncio.TimeoutError) else "decode_stream"
                msg = f"decode worker {ex.decode.url} broke the stream on {ex.route}: {e!r}"
            log.warning("%s", msg)
            ex.decode.breaker.record_failure()
            self.runner.abort_after_break(ex, self.resp)
            tail = b"data: " + json.dumps(error_body(502, msg)).encode() + b"\n\n" + _DONE + b"\n\n"
        await send({"type": "http.response.body", "body": tail, "more_body": False})
        self.close(finished=True)

    def close(self, finished: bool) -> None:
        """Release decode's connection and record the outcome; idempotent. ``finished`` False
        means the client left early: drop the connection and abort both sides."""
        if self._closed:
            return
        self._closed = True
        ex, em = self.ex, self.ex.em
        status = self.resp.status
        if finished:
            self.resp.release()
        else:
            self.resp.close()
            status, self.kind = CLIENT_CLOSED, "client_disconnect"
            self.runner.abort_after_break(ex, self.resp)
        ex.decode_end()
        if self.tap.prompt:
            em.prompt_tokens.inc(self.tap.prompt)
        if self.tap.completion:
            em.completion_tokens.inc(self.tap.completion)
        if finished:
            report_cached(ex, self.tap.cached)
        record_outcome(em, ex.arrival, status, self.kind)
