"""State of one generated sequence: tokens, logprobs, finish reason, text and stop strings."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Optional

from pd.engines.errors import EngineError
from pd.engines.protocol import SeqRequest

if TYPE_CHECKING:
    from pd.engines.handoff.bootstrap import Room
    from pd.engines.spec.decoder import SpecState

TokenLogprob = tuple  # (logprob: float | None, token_id: int)


class Sequence:
    """One sequence as it is generated; the HTTP layer reads it after each ``updated`` signal.

    Attributes:
        output_ids: generated token ids, the EOS/stop token included (SGLang does the same).
        output_logprobs: per output token ``(logprob, token_id)`` (raw log-softmax of the logits).
        output_top: per output token the ``top_logprobs_num`` best ``(logprob, token_id)``.
        input_logprobs: per prompt position from ``logprob_start_len``: ``(logprob|None, token_id)``
            (None for position 0, which has no prediction).
        input_top: per prompt position the top list, None for position 0.
        finish_reason: SGLang's shape: ``{"type": "length", "length": N}``,
            ``{"type": "stop", "matched": token_id | str}`` or ``{"type": "abort", "message": ...}``.
        error: set when the sequence failed; the HTTP layer answers with it.
    """

    def __init__(self, req: SeqRequest, eos_ids: set[int], decode_fn, context_length: int):
        self.req = req
        self.eos_ids = eos_ids
        self._decode = decode_fn
        self.context_length = context_length
        self.output_ids: list[int] = []
        self.output_logprobs: list[TokenLogprob] = []
        self.output_top: list[list[TokenLogprob]] = []
        self.input_logprobs: list[TokenLogprob] = []
        self.input_top: list[Optional[list[TokenLogprob]]] = []
        self.cached_tokens = 0
        self.finish_reason: Optional[dict] = None
        self.error: Optional[EngineError] = None
        self.cache = None
        self.task: Optional[asyncio.Task] = None
        self.room: Optional[Room] = None  # prefill side: the bootstrap room this sequence holds
        self.spec_state: Optional[SpecState] = None  # when the engine speculates
        self.spec_verify_ct = 0  # verify steps (SGLang's Req.spec_verify_ct)
        self.spec_correct_drafts = 0  # drafts accepted and emitted (SGLang's spec_num_correct_drafts)
        self.spec_draft_width = 0  # drafts proposed per verify step (num_draft_tokens - 1)
        self.abort_reason: Optional[str] = None
        self.arrival = time.perf_counter()
        self.first_token_time: Optional[float] = None
        self.last_token_time: Optional[float] = None
        self.finish_time: Optional[float] = None
        self.listener: Optional[asyncio.Queue] = None  # gets this sequence on every change
        self._stop_strings = req.params.stop_strings()
        self._stop_cut: Optional[int] = None
        self._text_cache: tuple[int, str] = (0, "")  # (tokens decoded, their text)

    # ---- progress -----------------------------------------------------------------------
    @property
    def done(self) -> bool:
        """True once the sequence has finished or failed."""
        return self.finish_reason is not None or self.error is not None

    def banned_tokens(self, step: int) -> list[int]:
        """Tokens that may not be sampled at output ``step`` (EOS and stop ids before
        ``min_new_tokens``)."""
        if step >= self.req.params.min_new_tokens:
            return []
        banned = set(self.req.params.stop_token_ids or [])
        if not self.req.params.ignore_eos:
            banned |= self.eos_ids
        return sorted(banned)

    def append(self, token: int, logprob: float, top: list[TokenLogprob]) -> None:
        """Add a sampled token, then apply SGLang's finish checks (Req.check_finished): nothing
        stops before ``min_new_tokens``; then stop token ids / EOS, stop strings, length."""
        now = time.perf_counter()
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now
        self.output_ids.append(token)
        self.output_logprobs.append((logprob, token))
        self.output_top.append(top)
        self._check_finished()
        self.signal()

    def _check_finished(self) -> None:
        p = self.req.params
        n = len(self.output_ids)
        if n >= p.min_new_tokens:
            last = self.output_ids[-1]
            if last in (p.stop_token_ids or []) or (not p.ignore_eos and last in self.eos_ids):
                self.finish_reason = {"type": "stop", "matched": last}
                return
            if self._stop_strings:
                text = self.raw_text()
                hits = [(text.find(s), s) for s in self._stop_strings if s in text]
                if hits:
                    pos, s = min(hits)
                    self._stop_cut = len(text) if p.no_stop_trim else pos
                    self.finish_reason = {"type": "stop", "matched": s}
                    return
        if p.max_new_tokens is not None and n >= p.max_new_tokens:
            self.finish_reason = {"type": "length", "length": p.max_new_tokens}
        elif len(self.req.prompt_ids) + n >= self.context_length:
            self.finish_reason = {"type": "length", "length": n}

    def finish(self, reason: Optional[dict]) -> None:
        """Mark finished with ``reason`` (the first reason wins; None keeps the current one) and wake the
        listener."""
        if self.finish_reason is None:
            self.finish_reason = reason
        self.finish_time = time.perf_counter()
        self.signal()

    def fail(self, error: EngineError) -> None:
        """Mark failed with ``error`` and wake the listener."""
        self.error = error
        self.finish_time = time.perf_counter()
        self.signal()

    def signal(self) -> None:
        """Wake the listener, if any, so it emits what is new."""
        if self.listener is not None:
            self.listener.put_nowait(self)

    # ---- text ---------------------------------------------------------------------------
    def raw_text(self) -> str:
        """Decoded output (once per new token: the stop check and every stream chunk ask for it)."""
        n, text = self._text_cache
        if n != len(self.output_ids):
            text = self._decode(self.output_ids, self.req.params.skip_special_tokens)
            self._text_cache = (len(self.output_ids), text)
        return text

    def text(self) -> str:
        """Output text; cut before a matched stop string (unless ``no_stop_trim``)."""
        text = self.raw_text()
        return text[: self._stop_cut] if self._stop_cut is not None else text

    def stable_text(self) -> str:
        """Text safe to stream now: while running, a tail that could still grow into a stop
        string is held back, so streamed chunks add up to the final text."""
        text = self.text()
        if self.done or not self._stop_strings:
            return text
        hold = 0
        for s in self._stop_strings:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        return text[: len(text) - hold]
