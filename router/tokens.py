"""Prompt and completion token counts of answered requests, read from the engines' answers
without parsing them (one regular-expression scan, C speed) for
``pdserve_router_{prompt,completion}_tokens_total``.

Where the counts are:

- /generate: every sequence's ``meta_info`` has ``prompt_tokens`` and ``completion_tokens``; in a
  stream they are cumulative, so only each sequence's final event (``finish_reason`` set) counts.
- OpenAI routes: ``usage``. Streams carry it only with ``stream_options.include_usage``; when the
  client did not ask for it the router asks the engine anyway and drops that usage-only chunk from
  the client's stream (``UsageTap``), so every stream is counted.
"""

from __future__ import annotations

import re
from typing import Optional

# cached_tokens (meta_info's, or usage.prompt_tokens_details') rides along in the same scan: the kv_aware
# policy compares it with its prediction
_COUNTS = re.compile(rb'"(prompt|completion|cached)_tokens"\s*:\s*(\d+)')
_FINISHED = re.compile(rb'"finish_reason"\s*:\s*\{')  # /generate: set only on a sequence's last event
_USAGE = re.compile(rb'"usage"\s*:\s*\{')
_NO_CHOICES = re.compile(rb'"choices"\s*:\s*\[\s*\]')


def count(raw: bytes) -> tuple[int, int]:
    """(prompt, completion) tokens: the sums of every ``prompt_tokens`` / ``completion_tokens``
    value in ``raw`` (a whole non-streaming answer, or one final stream event)."""
    prompt, completion, _ = count_all(raw)
    return prompt, completion


def count_all(raw: bytes) -> tuple[int, int, Optional[int]]:
    """(prompt, completion, cached) tokens: ``count``'s sums and that of every ``cached_tokens`` value
    (prompt tokens the prefill served from its prefix cache); cached is None when ``raw`` has none (an
    OpenAI usage without ``prompt_tokens_details``)."""
    prompt = completion = 0
    cached: Optional[int] = None
    for kind, value in _COUNTS.findall(raw):
        if kind == b"prompt":
            prompt += int(value)
        elif kind == b"completion":
            completion += int(value)
        else:
            cached = (cached or 0) + int(value)
    return prompt, completion, cached


def wants_usage_injected(body: dict) -> bool:
    """For an OpenAI streaming body: True when the client did not ask for the usage chunk, so the
    router asks for it (and drops it again). Sets ``stream_options.include_usage`` in ``body``."""
    opts = body.get("stream_options")
    if opts is None:
        body["stream_options"] = {"include_usage": True}
        return True
    if isinstance(opts, dict) and not opts.get("include_usage") and not opts.get("continuous_usage_stats"):
        body["stream_options"] = dict(opts, include_usage=True)
        return True
    return False


class UsageTap:
    """Reads token counts off a stream's events as they pass.

    Args:
        generate: the route is /generate (else an OpenAI route).
        drop_usage: drop the usage-only chunk (the client did not ask for it).
    """

    __slots__ = ("generate", "drop_usage", "prompt", "completion", "cached")

    def __init__(self, generate: bool, drop_usage: bool):
        self.generate = generate
        self.drop_usage = drop_usage
        self.prompt = self.completion = 0
        self.cached: Optional[int] = None

    def quiet(self, data: bytes) -> bool:
        """True when ``event`` would neither count nor drop any of the events in ``data`` (one or more): the
        same search as ``event``'s, once over all of them."""
        return (_FINISHED if self.generate else _USAGE).search(data) is None

    def event(self, event: bytes) -> bool:
        """Look at one SSE data event; False when it must not reach the client."""
        if self.generate:
            if _FINISHED.search(event):
                p, c, k = count_all(event)
                self.prompt += p
                self.completion += c
                if k is not None:
                    self.cached = (self.cached or 0) + k
            return True
        if _USAGE.search(event):
            # the last usage wins (continuous usage stats repeat it, cumulative)
            self.prompt, self.completion, self.cached = count_all(event)
            if self.drop_usage and _NO_CHOICES.search(event):
                return False
        return True
