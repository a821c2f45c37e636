"""The engine's model-thread work: prompt and decode forwards, sampling, logprobs, and the one-worker executor
they run on.

All model work runs on one thread, one sequence at a time (see pd.engines.models.model_runner): ``run_blocking``
is how the event loop hands it over, and ``ModelSteps`` is what runs there.
"""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable, Optional

import torch

from pd.engines.models.model_runner import ModelRunner
from pd.engines.sampling import sample
from pd.engines.sequence import Sequence

if TYPE_CHECKING:
    from pd.engines.handoff.kv_pool import KVPagePool
    from pd.engines.spec.decoder import SpecDecoder, StepResult

TokenChoice = tuple[int, float, list]  # (token id, its logprob, the top (logprob, token id) pairs)


async def run_blocking(executor: ThreadPoolExecutor, fn: Callable, *args):
    """Run ``fn`` on ``executor``. If the caller is cancelled while ``fn`` still waits in the executor's
    queue, ``fn`` never runs (an aborted request with many samples must not keep the model thread busy);
    if ``fn`` is already running, wait for it to finish before re-raising, so memory it touches (KV
    pages) is not released under it."""
    job = executor.submit(fn, *args)
    fut = asyncio.wrap_future(job)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        if job.cancel():  # not started: it never will
            raise
        while not fut.done():
            with contextlib.suppress(BaseException):
                await asyncio.shield(fut)
        raise


class ModelSteps:
    """One sequence's model work, called on the model thread.

    Args:
        runner: the loaded target model.
        spec: the speculative decoder (draft and settings), None when speculation is off.
    """

    def __init__(self, runner: ModelRunner, spec: Optional[SpecDecoder]):
        self.runner = runner
        self.spec = spec

    def select(self, seq: Sequence, logits: torch.Tensor, step: int) -> TokenChoice:
        """Sample output token ``step`` from ``logits`` [vocab] with the request's sampling settings."""
        req = seq.req
        token = sample(logits, req.params, req.seed, step, seq.banned_tokens(step), seq.output_ids)
        return self.logprob_entry(seq, logits, token)

    def logprob_entry(self, seq: Sequence, logits: torch.Tensor, token: int) -> TokenChoice:
        """``(token, logprob, top)`` of a chosen token: the raw log-softmax of ``logits`` [vocab] and, with
        ``top_logprobs_num``, its best entries."""
        req = seq.req
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        top = []
        if req.top_logprobs_num > 0:
            vals, ids = torch.topk(logprobs, min(req.top_logprobs_num, logprobs.numel()))
            top = [(float(v), int(i)) for v, i in zip(vals, ids)]
        return token, float(logprobs[token]), top

    def prefill_forward(self, seq: Sequence, kv: Optional[tuple[KVPagePool, list[int]]] = None,
                        draft_kv: Optional[tuple[KVPagePool, list[int]]] = None, cached: int = 0) -> TokenChoice:
        """Prompt forward (+ store its KV into ``kv``'s pool pages); returns the first token. With
        speculation the draft then runs on the prompt (draft extend) and its KV goes into ``draft_kv``'s pages.
        The prompt logprobs the request asked for are appended to ``seq.input_logprobs`` / ``input_top``.

        ``cached`` > 0 (a radix cache hit, whole pages, never with speculation): the first ``cached`` prompt
        tokens' KV is read from ``kv``'s first pages and only the rest of the prompt is computed; the logprobs
        asked for start at or after ``cached + 1`` (the cache match is limited so).
        """
        req = seq.req
        n = len(req.prompt_ids)
        if cached:
            assert kv is not None and self.spec is None and cached < n, "a hit reads pages, leaves a token to compute"
            page_size = kv[0].page_size
            seq.cache = self.runner.import_kv(kv[0].pages, kv[1], cached)
            logits, hidden = self.runner.forward_hidden(req.prompt_ids[cached:], seq.cache)
            self.runner.export_kv(seq.cache, kv[0].pages, kv[1], n, first_page=cached // page_size)
        else:
            seq.cache = self.runner.new_cache()
            logits, hidden = self.runner.forward_hidden(req.prompt_ids, seq.cache)
            if kv is not None:
                self.runner.export_kv(seq.cache, kv[0].pages, kv[1], n)
        first = self.select(seq, logits[-1], 0)
        if self.spec is not None:
            seq.spec_state = self.spec.extend_prompt(req.prompt_ids, hidden, first[0])
            if draft_kv is not None and draft_kv[1]:
                self.spec.draft.export_kv(seq.spec_state.draft_cache, draft_kv[0].pages, draft_kv[1],
                                          len(req.prompt_ids))
        if req.return_logprob and req.logprob_start_len >= 0:
            self._prompt_logprobs(seq, torch.log_softmax(logits, dim=-1), cached)
        return first

    @staticmethod
    def _prompt_logprobs(seq: Sequence, logprobs: torch.Tensor, cached: int) -> None:
        """Prompt logprobs from ``logprobs`` [prompt tokens - cached, vocab] (row i: position cached + i)."""
        req, ids = seq.req, seq.req.prompt_ids
        for pos in range(req.logprob_start_len, len(ids)):
            if pos == 0:
                seq.input_logprobs.append((None, ids[0]))
                seq.input_top.append(None)
                continue
            row = logprobs[pos - 1 - cached]
            seq.input_logprobs.append((float(row[ids[pos]]), ids[pos]))
            if req.top_logprobs_num > 0:
                vals, top_ids = torch.topk(row, min(req.top_logprobs_num, row.numel()))
                seq.input_top.append([(float(v), int(i)) for v, i in zip(vals, top_ids)])
            else:
                seq.input_top.append(None)

    def decode_forward(self, seq: Sequence) -> TokenChoice:
        """One decode step: the last output token through the model, then the next token sampled."""
        logits = self.runner.forward([seq.output_ids[-1]], seq.cache)
        return self.select(seq, logits[-1], len(seq.output_ids))

    def spec_step(self, seq: Sequence) -> StepResult:
        """One speculative draft/verify step (pd.engines.spec.decoder)."""
        assert self.spec is not None
        assert seq.spec_state is not None  # prefill_forward (a decode: pd_handoff.restore_state) set it
        return self.spec.step(seq, seq.spec_state, seq.cache, lambda row, tok: self.logprob_entry(seq, row, tok))

    def health_token(self) -> int:
        """One greedy token from the one-token prompt ``[0]`` (SGLang's /health_generate)."""
        logits = self.runner.forward([0], self.runner.new_cache())
        return int(torch.argmax(logits[-1]))
