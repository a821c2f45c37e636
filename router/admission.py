"""Admission: the caps on one request and the global in-flight limit with its queue, both decided
before any worker is touched.

Caps (400, at once, never retried): a request asking for more than the router's limits allow is
refused, so one small request cannot hold the cluster (every sequence is a bootstrap room, a KV
allocation on both sides and, when it fails, an abort per side). The request's shape (prompts, ``n``)
is pd.router.rooms's, the same that stamps its rooms; the limits are ``max_n``, ``max_batch_size``,
``max_sequences_per_request`` and ``max_total_tokens_per_request`` of pd.router.config.

In-flight limit (429 + ``Retry-After``): at most ``max_concurrent_requests`` generation requests run
at once; more wait in a FIFO queue of ``queue_size`` for ``queue_timeout_secs`` (sgl-model-gateway's
settings of the same names), a streaming request holding its slot until its stream ends.
"""

from __future__ import annotations

import asyncio
import math
import sys
from collections import deque
from typing import NamedTuple, Optional

from pydantic import TypeAdapter, ValidationError

from pd.router.config import RouterSettings
from pd.router.rooms import Shape
from pd.util.settings_flags import SettingsFlags

_FLAGS = SettingsFlags(RouterSettings)
FLAG = {key: _FLAGS.flag_of(key) for key in ("max_n", "max_batch_size", "max_sequences_per_request",
                                             "max_total_tokens_per_request", "max_concurrent_requests",
                                             "queue_size", "queue_timeout_secs")}

# SGLang's defaults for an unset output length (sglang/srt/sampling/sampling_params.py max_new_tokens=128;
# sglang/srt/entrypoints/openai/protocol.py CompletionRequest.max_tokens=16); chat has none (the context bounds it).
DEFAULT_MAX_NEW = {"/generate": 128, "/v1/completions": 16, "/v1/chat/completions": 0}
RETRY_AFTER_MAX = 60  # seconds: the most Retry-After ever says (the OpenAI SDK honours up to 60)


class OverLimit(NamedTuple):
    """Why a request is refused: the client's message (naming the cap and its flag) and the request
    field it is about (None for the sequence count, which two fields make)."""

    message: str
    param: Optional[str]


def _text_tokens(text: str) -> int:
    """An upper bound on a text's tokens: its UTF-8 bytes (a byte-level BPE token covers >= 1 byte)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def _prompt_tokens(prompt) -> int:
    """Tokens of one prompt: a string's bound, a token-id list's length; 0 for what the engine rejects."""
    if isinstance(prompt, str):
        return _text_tokens(prompt)
    return len(prompt) if isinstance(prompt, list) else 0


_INT = TypeAdapter(int)


def parsed_int(value, strict: bool) -> Optional[int]:
    """``value`` as the engines' pydantic models read an int field, or None where they refuse it.

    The OpenAI routes' models (SGLang's CompletionRequest / ChatCompletionRequest and the reference
    engine's) are lax: ``"40"``, ``" +40 "``, ``"40.0"``, ``"1_000"``, ``40.0`` and ``true`` are ints there
    (40, 40, 40, 1000, 40, 1), so the router counts them as those numbers; /generate's ``sampling_params``
    (SGLang's JSON contract, the reference engine's strict SamplingParams) takes only a JSON integer.
    The same pydantic the engines run decides, so the two can never read one value differently."""
    if value is None or isinstance(value, (dict, list)):
        return None
    try:
        return _INT.validate_python(value, strict=strict)
    except (ValidationError, TypeError, ValueError):
        return None


def _length(value, strict: bool = False) -> int:
    """An output length as the engines read it (``parsed_int``); None (up to the context) and anything the
    engine rejects (not an int, <= 0: the engine answers 400 and generates nothing) count 0."""
    n = parsed_int(value, strict)
    return n if n is not None and n > 0 else 0


def _openai_length(body: dict, key: str, default: int) -> int:
    """``body[key]`` counted as the OpenAI models read it; absent or null is the route's default (the
    reference engine reads a null ``max_tokens`` as unset)."""
    value = body.get(key)
    return default if value is None else _length(value)


def _chat_prompt_tokens(messages) -> int:
    total = 0
    for m in messages if isinstance(messages, list) else ():
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            total += _text_tokens(content)
        elif isinstance(content, list):
            total += sum(_text_tokens(p["text"]) for p in content
                         if isinstance(p, dict) and isinstance(p.get("text"), str))
    return total


def request_tokens(route: str, body: dict, shape: Shape) -> int:
    """Tokens a request may hold in flight: prompt + output length, summed over its sequences
    (P prompts x ``n``). Prompt tokens are counted without a tokenizer: token ids by number, text by
    UTF-8 bytes (never fewer than the engine's count); an unset output length is SGLang's default
    (``DEFAULT_MAX_NEW``)."""
    default = DEFAULT_MAX_NEW[route]
    n = shape.n
    if route == "/generate":
        text, ids = body.get("text"), body.get("input_ids")
        prompts = text if text is not None else ids
        if not shape.batch:
            prompts = [prompts]
        elif not isinstance(prompts, list):
            prompts = []
        sp = body.get("sampling_params")
        params = sp if isinstance(sp, list) else [sp] * len(prompts)
        total = 0
        for i, prompt in enumerate(prompts):
            p = params[i] if i < len(params) else None
            new = _length(p.get("max_new_tokens", default), strict=True) if isinstance(p, dict) else default
            total += _prompt_tokens(prompt) + new
        return total * n
    if route == "/v1/completions":
        prompt = body.get("prompt")
        batch = prompt if shape.batch and isinstance(prompt, list) else [prompt]  # a batch: always a list
        new = _openai_length(body, "max_tokens", default)
        return sum(_prompt_tokens(p) + new for p in batch) * n
    # SGLang: ``max_completion_tokens or max_tokens`` (a 0 falls back to max_tokens; the reference engine
    # refuses a max_completion_tokens <= 0, so counting max_tokens then only ever counts more)
    new = _length(body.get("max_completion_tokens")) or _openai_length(body, "max_tokens", default)
    return (_chat_prompt_tokens(body.get("messages")) + new) * n


def _n_mismatch(route: str, body: dict, shape: Shape) -> Optional[OverLimit]:
    """A refusal when the OpenAI models read ``n`` as a number other than the shape's (``"+3"``, ``"3.0"``,
    ``"1_0"``: pydantic takes them, pd.router.rooms counts 1): the caps and the rooms would count fewer
    sequences than the engine makes."""
    if route == "/generate":
        return None  # sampling_params.n: the engines take a JSON integer only, rooms reads those exactly
    value = body.get("n")
    n = parsed_int(value, strict=False)
    if n is not None and n >= 1 and n != shape.n:
        return OverLimit(f"n = {value!r}: give n as a JSON integer", "n")
    return None


def check(route: str, shape: Shape, settings: RouterSettings, body: Optional[dict] = None) -> Optional[OverLimit]:
    """None when the request is within every cap of ``settings``, else the first cap it is over
    (``n``, then the batch size, then prompts x n, then its tokens when ``body`` is given)."""
    mismatch = _n_mismatch(route, body, shape) if body is not None else None
    if mismatch is not None:
        return mismatch
    if shape.n > settings.max_n:
        param = "sampling_params.n" if route == "/generate" else "n"
        return OverLimit(f"{param} = {shape.n} is over the router's limit of {settings.max_n} ({FLAG['max_n']})",
                         param)
    if shape.prompts > settings.max_batch_size:
        return OverLimit(f"a batch of {shape.prompts} prompts is over the router's limit of "
                         f"{settings.max_batch_size} ({FLAG['max_batch_size']})", None)
    if shape.sequences > settings.max_sequences_per_request:
        return OverLimit(f"{shape.prompts} prompts x n = {shape.n} make {shape.sequences} sequences, over the "
                         f"router's limit of {settings.max_sequences_per_request} "
                         f"({FLAG['max_sequences_per_request']})", None)
    if body is not None:
        cap = settings.max_total_tokens_per_request
        tokens = request_tokens(route, body, shape)
        if tokens > cap:
            return OverLimit(f"the request's {shape.sequences} sequence(s) may hold up to {tokens} tokens (prompt "
                             f"tokens, text counted as UTF-8 bytes, + the output length, per sequence), over the "
                             f"router's limit of {cap} ({FLAG['max_total_tokens_per_request']})", None)
    return None


class InFlightLimit:
    """At most ``limit`` requests in flight; the next ``queue_size`` wait their turn in arrival order.

    ``enter()`` takes a slot when one is free and nobody waits (the hot path: no await); otherwise
    ``wait()`` queues. ``release()`` hands the slot to the oldest waiter (so the queue is FIFO and a
    newcomer never overtakes it) or frees it. Single-threaded: call on the router's event loop.

    Args:
        limit: slots; <= 0 = unlimited (no request ever waits).
        queue_size: most waiting requests.
        timeout: longest wait, in seconds.
        depth: a gauge set to the number of waiting requests.
    """

    __slots__ = ("limit", "queue_size", "timeout", "depth", "active", "_waiters", "_hold")

    HOLD_WEIGHT = 0.05  # EWMA weight of one request's slot time in the Retry-After estimate

    def __init__(self, limit: int, queue_size: int, timeout: float, depth) -> None:
        self.limit = limit if limit > 0 else sys.maxsize
        self.queue_size = queue_size
        self.timeout = timeout
        self.depth = depth
        self.active = 0  # slots taken
        self._waiters: deque[asyncio.Future] = deque()
        self._hold = 1.0  # seconds a request holds its slot, moving average

    @property
    def waiting(self) -> int:
        """Requests in the queue."""
        return len(self._waiters)

    def enter(self) -> bool:
        """Take a slot if one is free and nobody waits for one."""
        if self.active < self.limit and not self._waiters:
            self.active += 1
            return True
        return False

    async def wait(self) -> Optional[str]:
        """Wait in the queue for a slot: None once it is ours, ``"queue_full"`` (nobody more may wait) or
        ``"queue_timeout"`` (``timeout`` passed). Cancelled (the client left), it leaves the queue, and a
        slot handed over in that instant goes to the next in line."""
        if len(self._waiters) >= self.queue_size:
            return "queue_full"
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self.depth.set(len(self._waiters))
        try:
            async with asyncio.timeout(self.timeout):
                await fut
            return None
        except TimeoutError:
            if fut.done() and not fut.cancelled():
                return None  # the slot came as the wait ended: take it
            return "queue_timeout"
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release(0.0)
            raise
        finally:
            if not fut.done():
                fut.cancel()
            try:
                self._waiters.remove(fut)
            except ValueError:  # release() took it out
                pass
            self.depth.set(len(self._waiters))

    def release(self, held: float) -> None:
        """Give back a slot held for ``held`` seconds: to the oldest waiter, else free it."""
        self._hold += self.HOLD_WEIGHT * (held - self._hold)
        waiters = self._waiters
        while waiters:
            fut = waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot changes hands; ``active`` stays
                self.depth.set(len(waiters))
                return
        self.active -= 1

    def retry_after(self) -> int:
        """Seconds a refused client should wait (``Retry-After``): about the time the requests ahead of it
        need to move through the slots (queue length / slots x a slot's mean hold), 1 to RETRY_AFTER_MAX."""
        if self.limit == sys.maxsize:
            return 1
        ahead = (len(self._waiters) + 1) / self.limit
        return max(1, min(RETRY_AFTER_MAX, math.ceil(ahead * self._hold)))
