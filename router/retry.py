"""Retries of a PD request: which failures retry, the wait between attempts, and the loop.

sglang-router's rules (its ``--retry-*`` flags, pd.router.config.RetryConfig):

- ``max_retries`` attempts in all, the first included (1 = no retry, ``--disable-retries``);
- only before the first byte of the answer reached the client: an attempt either ends in a
  ``Failure`` (nothing was sent; another attempt may follow) or commits an answer (a whole answer
  or a stream being relayed), and a committed answer is never retried, whatever happens next;
- retryable failures: no HTTP answer (connection refused or broken: 502; timed out: 504), a 408,
  429, 500, 502, 503 or 504 answer, a stream whose first event is such an error, no worker
  available (503); a worker's other answers (e.g. 400 for a prompt over the context length)
  reach the client as they are;
- the wait after failed attempt ``k`` (1-based) is ``min(initial_backoff_ms * backoff_multiplier
  ** (k - 1), max_backoff_ms)`` scaled by a uniform factor in ``[1 - jitter_factor, 1 +
  jitter_factor]`` (the cap applies before the jitter).

Each retry runs on a fresh (prefill, decode) pair with fresh bootstrap rooms (pd.router.dispatch
builds the attempts).
"""

from __future__ import annotations

import asyncio
import json
import random
from typing import Awaitable, Callable, Optional, TypeVar, Union

from pd.router.config import RetryConfig
from pd.router.errors import error_body

RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})  # sglang-router's retryable statuses
_ERROR_EVENT = b'data: {"error"'
_SSE_DATA = b"data: "

T = TypeVar("T")


class Answer:
    """A whole (non-streaming) answer for the client."""

    __slots__ = ("status", "body", "content_type")

    def __init__(self, status: int, body: bytes, content_type: str):
        self.status, self.body, self.content_type = status, body, content_type


class Failure:
    """An attempt that ended without an answer for the client: what it would get, and whether
    another attempt may fix it.

    Attributes:
        status: the HTTP status the client gets if this is the last attempt.
        body: the body it gets (a worker's own error, or an OpenAI-style one from the router).
        kind: the metric's error kind (``decode_timeout``, ``prefill_status``, ``no_worker``, ...).
        retryable: whether another attempt may succeed.
        content_type: of ``body``.
        pair: the attempt's workers, ``"<prefill url> -> <decode url>"`` (empty when none was picked), for the log.
    """

    __slots__ = ("status", "body", "content_type", "kind", "retryable", "pair")

    def __init__(self, status: int, body: bytes, kind: str, retryable: bool, content_type: str = "application/json"):
        self.status, self.body, self.kind = status, body, kind
        self.retryable, self.content_type = retryable, content_type
        self.pair = ""

    @classmethod
    def router(cls, status: int, message: str, kind: str, retryable: bool) -> "Failure":
        """A failure described by the router (an OpenAI-style error body)."""
        return cls(status, json.dumps(error_body(status, message)).encode(), kind, retryable)


def no_answer(side: str, timed_out: bool, message: str) -> Failure:
    """``side`` (``prefill`` / ``decode``) gave no HTTP answer: 504 ``{side}_timeout`` when it
    timed out, else 502 ``{side}_connect`` (unreachable, connection broken); both retryable."""
    if timed_out:
        return Failure.router(504, message, f"{side}_timeout", True)
    return Failure.router(502, message, f"{side}_connect", True)


def answered(side: str, url: str, status: int, body: bytes, content_type: str) -> Failure:
    """``side``'s own non-2xx answer, kind ``{side}_status``: retryable for 408, 429 and 5xx but 501. A 3xx is
    no answer to relay: the router follows no redirect from a worker (one could point it, or the client, at
    any host), so it is a retryable 502 naming the worker."""
    if 300 <= status < 400:
        return Failure.router(502, f"{side} worker {url} answered {status}, a redirect; the router follows no "
                              f"redirect from a worker", f"{side}_status", True)
    return Failure(status, body, f"{side}_status", status in RETRYABLE_STATUS, content_type)


def no_worker(reason: str) -> Failure:
    """No worker of a side can take the request (503, retryable: one may come back)."""
    return Failure.router(503, reason, "no_worker", True)


def stream_start(first: bytes) -> Optional[Failure]:
    """A decode stream's first chunk ``first`` -> a Failure when its first event is an engine error
    (``data: {"error": {...}}``, before any token), else None. The status is the error's ``code``
    when that is an HTTP error status, else 500."""
    if not first.startswith(_ERROR_EVENT):
        return None
    event = first.split(b"\n\n", 1)[0]
    try:
        err = json.loads(event[len(_SSE_DATA):]).get("error")
    except (ValueError, AttributeError):
        return None
    if not isinstance(err, dict):
        return None
    code = err.get("code")
    status = code if isinstance(code, int) and 400 <= code < 600 else 500
    return Failure(status, json.dumps({"error": err}).encode(), "decode_status", status in RETRYABLE_STATUS)


class Retrier:
    """Runs the attempts of one request under a RetryConfig.

    Args:
        config: attempts and backoff.
        rng: the jitter's random source (``uniform``); default one seeded from the OS.
        sleep: how to wait between attempts (``asyncio.sleep``).
    """

    def __init__(self, config: RetryConfig, rng: Optional[random.Random] = None,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep):
        self.cfg = config
        self.rng = rng or random.Random()
        self.sleep = sleep

    def base_delay(self, attempt: int) -> float:
        """Milliseconds to wait after failed attempt number ``attempt`` (1-based), before jitter."""
        c = self.cfg
        return min(c.initial_backoff_ms * c.backoff_multiplier ** (attempt - 1), c.max_backoff_ms)

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (1-based), jitter included."""
        j = self.cfg.jitter_factor
        return self.base_delay(attempt) * self.rng.uniform(1 - j, 1 + j) / 1000.0

    def should_retry(self, failure: Failure, attempt: int) -> bool:
        """Whether attempt number ``attempt`` (1-based), which ended in ``failure``, gets another."""
        return failure.retryable and attempt < self.cfg.max_retries

    async def run(self, attempt: Callable[[int], Awaitable[Union[Failure, T]]],
                  on_retry: Optional[Callable[[int, Failure], None]] = None) -> tuple[Union[Failure, T], int]:
        """Call ``attempt(1)``, ``attempt(2)``, ... until one commits an answer (returns anything but
        a Failure: returned at once, never retried), fails for good, or the attempts are used up;
        ``on_retry(k, failure)`` runs before the wait after failed attempt ``k``.

        Returns:
            (the last attempt's outcome, the number of attempts made).
        """
        k = 0
        while True:
            k += 1
            outcome = await attempt(k)
            if not isinstance(outcome, Failure) or not self.should_retry(outcome, k):
                return outcome, k
            if on_retry is not None:
                on_retry(k, outcome)
            await self.sleep(self.delay(k))
