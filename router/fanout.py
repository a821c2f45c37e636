"""Requests with ``n > 1``: fanned out into ``n`` single-sample requests, answered as one.

SGLang cannot serve ``n > 1`` in PD mode: its tokenizer manager gives the prefix warm-up request and
every sample of prompt ``i`` a copy of prompt ``i``'s request, so all of them carry the one room
``bootstrap_room[i]`` (a list of rooms is repeated ``n`` times, never split), and the KV transfers,
keyed by room on both sides, collide. It also renames the samples' request ids, so an abort by the
router's ids finds nothing. So the router never sends ``n > 1``: sample ``s`` (0-based) of a request
is the same body with ``n`` 1, sent as a normal PD request (its own pair, rooms, request ids,
retries), and the ``n`` answers are merged into what SGLang answers for the whole request:

- order: sequence ``p * n + s`` is sample ``s`` of prompt ``p`` (SGLang's prompt-major expansion).
  ``/generate`` answers a list in that order (a non-batch prompt with ``n > 1`` too); OpenAI choices
  get ``index`` ``p * n + s``; stream events of ``/generate`` get ``"index": p * n + s`` as SGLang's
  batch streams do.
- usage (OpenAI): ``completion_tokens`` summed over samples, ``prompt_tokens`` (and
  ``prompt_tokens_details``) counted once per prompt, which is sample 0's (SGLang's
  ``UsageProcessor.calculate_response_usage`` reads sample 0 of each prompt), ``total_tokens`` their
  sum; a stream's usage chunk is sent once, after every sample ended, followed by one ``[DONE]``.
- chunks and answers keep the ``id``/``created``/``model`` of sample 0 (a stream's of the first chunk).
- seeds: a seeded request's sample ``s`` gets seed ``seed + s`` (wrapped into the signed 64-bit range
  SGLang accepts), so samples differ and a request is reproducible; this is what the reference engine
  does for its own ``n > 1``. (SGLang copies one ``sampling_seed`` to every sample, which makes the
  samples of a seeded request identical under deterministic sampling.)

A stream is committed only once every sample's stream started; a sample that fails before that
(after its retries) fails the whole request, the other samples are aborted.
"""

from __future__ import annotations

import asyncio
import copy
import json
from typing import TYPE_CHECKING, Optional

from pd.router import jsonio
from pd.router.exchange import CLIENT_CLOSED
from pd.router.retry import Answer, Failure
from pd.router.rooms import Shape

if TYPE_CHECKING:
    from pd.router.front import Send
    from pd.router.stream import Relay

_DATA = b"data: "
_DONE = b"data: [DONE]"
_I64 = 2**63


def _seed(seed, s: int, lax: bool = False):
    """``seed + s`` in [-2^63, 2^63), or ``seed`` itself when it is not an int (the engine rejects it).
    ``lax``: also an integral float or a string of digits, as the OpenAI routes' pydantic models take them."""
    if lax and isinstance(seed, float) and seed.is_integer():
        seed = int(seed)
    elif lax and isinstance(seed, str) and seed.strip().lstrip("-").isdigit():
        seed = int(seed.strip())
    if isinstance(seed, bool) or not isinstance(seed, int):
        return seed
    return (seed + s + _I64) % (2 * _I64) - _I64


def split(route: str, body: dict, shape: Shape) -> list[dict]:
    """The ``shape.n`` single-sample bodies of ``body``, sample ``s`` at index ``s``: ``n`` set to 1 and
    a seed, if any, to ``seed + s``. ``body`` is not changed; the copies share its prompts."""
    out = []
    for s in range(shape.n):
        sub = dict(body)
        if route == "/generate":
            sp = body.get("sampling_params")
            params = [copy.copy(p) if isinstance(p, dict) else p for p in sp] if isinstance(sp, list) \
                else [dict(sp) if isinstance(sp, dict) else {}]
            for p in params:
                if isinstance(p, dict):
                    p["n"] = 1
                    if p.get("sampling_seed") is not None:
                        p["sampling_seed"] = _seed(p["sampling_seed"], s)
            sub["sampling_params"] = params if isinstance(sp, list) else params[0]
        else:
            sub["n"] = 1
            if sub.get("seed") is not None:
                sub["seed"] = _seed(sub["seed"], s, lax=True)
        out.append(sub)
    return out


def applies(route: str, body: dict, shape: Shape) -> bool:
    """Whether a request is fanned out: ``n > 1`` given as the engines accept it. A ``/generate`` ``n``
    must be an int (SGLang's check is strict) and the same in every ``sampling_params`` of a list;
    anything else goes to the engines as sent, for them to reject with their own 400."""
    if shape.n < 2:
        return False
    if route != "/generate":
        return True
    sp = body.get("sampling_params")
    ns = [p.get("n", 1) if isinstance(p, dict) else None for p in (sp if isinstance(sp, list) else [sp])]
    return all(type(x) is int for x in ns) and len(set(ns)) == 1


def _merge_usage(usages: list[Optional[dict]]) -> Optional[dict]:
    """One usage for all samples: prompt side from sample 0, completion side summed."""
    if not usages or not isinstance(usages[0], dict):
        return usages[0] if usages else None
    merged = dict(usages[0])
    completion = sum(int(u.get("completion_tokens") or 0) for u in usages if isinstance(u, dict))
    merged["completion_tokens"] = completion
    merged["total_tokens"] = int(merged.get("prompt_tokens") or 0) + completion
    details = [u.get("completion_tokens_details") for u in usages if isinstance(u, dict)]
    if isinstance(details[0], dict):
        d = dict(details[0])
        for key, value in d.items():
            if isinstance(value, int) and not isinstance(value, bool):
                d[key] = sum(int((x or {}).get(key) or 0) for x in details if isinstance(x, dict))
        merged["completion_tokens_details"] = d
    return merged


def merge_whole(route: str, n: int, bodies: list[bytes]) -> bytes:
    """The whole answer of an ``n``-sample request from its samples' answers (sample ``s`` at ``s``)."""
    docs = [json.loads(b) for b in bodies]
    if route == "/generate":
        items = [d if isinstance(d, list) else [d] for d in docs]
        prompts = len(items[0])
        return jsonio.encode([items[s][p] for p in range(prompts) for s in range(n)])
    out = dict(docs[0])
    choices = []
    for s, d in enumerate(docs):
        for c in d.get("choices") or []:
            c = dict(c)
            c["index"] = int(c.get("index") or 0) * n + s
            choices.append(c)
    choices.sort(key=lambda c: c["index"])
    out["choices"] = choices
    if "usage" in out:
        out["usage"] = _merge_usage([d.get("usage") for d in docs])
    return jsonio.encode(out)


class _Once:
    """A histogram child that observes only its first value (None: none at all)."""

    __slots__ = ("_hist", "_done")

    def __init__(self, hist):
        self._hist, self._done = hist, hist is None

    def observe(self, value: float) -> None:
        """Observe ``value`` if nothing was observed yet."""
        if not self._done:
            self._done = True
            self._hist.observe(value)


class SampleMetrics:
    """The endpoint metrics the samples of one request share: the request counts once. Its queue time
    and TTFT are the first sample's, its outcome (status, errors, end-to-end latency) is recorded once
    by the fan-out; token counts, prefill and inter-token latencies, retries are every sample's.

    Args:
        em: the endpoint's metrics (pd.router.metrics.EndpointMetrics).
    """

    def __init__(self, em):
        self._em = em
        self.queue = _Once(em.queue)
        self.ttft = _Once(em.ttft)
        self.e2e = _Once(None)

    def __getattr__(self, name: str):
        return getattr(self._em, name)

    def request(self, status: int) -> None:
        """Not counted per sample (the fan-out counts the request)."""

    def error(self, kind: str) -> None:
        """Not counted per sample (the fan-out counts the request's outcome)."""


class Merged:
    """Relays the ``n`` committed sample streams of one request to the client as one stream.

    Each sample's Relay runs as usual (logprob merge, usage counting, aborts, idle timeout, metrics)
    but sends into this object, which renumbers its events, holds back usage-only chunks and
    ``[DONE]``, and passes the rest on as they arrive. Has Relay's ``run``/``close`` interface.

    Args:
        route: the generation route.
        n: samples per prompt.
        relays: the samples' relays, sample ``s`` at index ``s``.
        record: ``record(status, kind)`` counts the request's outcome once (at ``close``).
    """

    def __init__(self, route: str, n: int, relays: list["Relay"], record):
        self.route, self.n, self.relays, self.record = route, n, relays, record
        self._closed = False
        self.generate = route == "/generate"
        self.usages: list[Optional[dict]] = [None] * n
        self.usage_chunk: Optional[dict] = None
        self.common: Optional[dict] = None  # id/created/model of the first OpenAI chunk
        self._started = False
        self._lock = asyncio.Lock()

    def _event(self, s: int, event: bytes) -> Optional[bytes]:
        """Sample ``s``'s event as the merged stream carries it, or None to hold it back."""
        if not event.startswith(_DATA):
            return event if event.strip() else None
        if event.startswith(_DONE):
            return None
        try:
            obj = json.loads(event[len(_DATA):])
        except ValueError:
            return event
        if not isinstance(obj, dict) or "error" in obj:
            return event
        if self.generate:
            obj["index"] = int(obj.get("index") or 0) * self.n + s
        else:
            choices = obj.get("choices")
            if not choices and "usage" in obj:
                self.usages[s] = obj["usage"]
                if s == 0 or self.usage_chunk is None:
                    self.usage_chunk = obj
                return None
            if self.common is None:
                self.common = {k: obj[k] for k in ("id", "created", "model") if k in obj}
            obj.update(self.common)
            for c in choices or []:
                if isinstance(c, dict):
                    c["index"] = int(c.get("index") or 0) * self.n + s
        return _DATA + jsonio.encode(obj)

    def _sender(self, s: int, send: "Send"):
        async def sample_send(message: dict) -> None:
            async with self._lock:
                if message["type"] == "http.response.start":
                    if not self._started:
                        self._started = True
                        await send(message)
                    return
                out = []
                for event in message.get("body", b"").split(b"\n\n"):
                    e = self._event(s, event)
                    if e is not None:
                        out.append(e + b"\n\n")
                if out:
                    await send({"type": "http.response.body", "body": b"".join(out), "more_body": True})
        return sample_send

    async def run(self, send: "Send", rid_header: tuple[bytes, bytes]) -> None:
        """Relay every sample's stream to its end, then the merged usage chunk (if the samples sent
        one) and one ``[DONE]``. The caller must ``close(finished=False)`` afterwards (a no-op when the
        streams ran to their end), also when this is cancelled."""
        tasks = [asyncio.ensure_future(r.run(self._sender(s, send), rid_header)) for s, r in enumerate(self.relays)]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        tail = b""
        if self.usage_chunk is not None:
            chunk = dict(self.usage_chunk)
            chunk.update(self.common or {})
            chunk["usage"] = _merge_usage(self.usages) if all(u is not None for u in self.usages) \
                else self.usage_chunk["usage"]
            tail = _DATA + jsonio.encode(chunk) + b"\n\n"
        await send({"type": "http.response.body", "body": tail + _DONE + b"\n\n", "more_body": False})
        self.close(finished=True)

    def close(self, finished: bool) -> None:
        """Close every sample's relay (``finished`` False: the client left, abort them all) and count the
        request's outcome once; idempotent."""
        if self._closed:
            return
        self._closed = True
        for r in self.relays:
            r.close(finished)
        kind = next((r.kind for r in self.relays if r.kind is not None), None)
        self.record(self.relays[0].resp.status if finished else CLIENT_CLOSED, kind)


async def run(route: str, shape: Shape, bodies: list[dict], run_one, record):
    """Run the samples' requests concurrently (``run_one(body)`` -> (outcome, attempts) with retries,
    on SampleMetrics) and merge them: an Answer, a Merged stream, or the first sample's Failure (the
    other samples' committed streams are closed and aborted). ``record(status, kind)`` counts a merged
    answer's outcome once (a Failure is the caller's to count). Returns (outcome, most attempts any
    sample made)."""
    from pd.router.stream import Relay

    tasks = [asyncio.ensure_future(run_one(b)) for b in bodies]
    try:
        results = await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        done = await asyncio.gather(*tasks, return_exceptions=True)
        for r in done:
            if isinstance(r, tuple) and isinstance(r[0], Relay):
                r[0].close(finished=False)
        raise
    outcomes = [r[0] for r in results]
    attempts = max(r[1] for r in results)
    failure = next((o for o in outcomes if isinstance(o, Failure)), None)
    if failure is not None:
        for o in outcomes:
            if isinstance(o, Relay):
                o.close(finished=False)
        return failure, attempts
    if all(isinstance(o, Answer) for o in outcomes):
        first = outcomes[0]
        data = merge_whole(route, shape.n, [o.body for o in outcomes])
        record(first.status, None)
        return Answer(first.status, data, first.content_type), attempts
    return Merged(route, shape.n, outcomes, record), attempts

