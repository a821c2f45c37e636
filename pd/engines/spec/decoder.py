"""EAGLE/MTP speculative decoding in the reference engine: chain drafting, one-forward verify, acceptance.

The loop follows SGLang's EAGLE worker (sglang/srt/speculative/eagle_worker.py) with ``--speculative-eagle-topk
1`` (a chain, no tree). Per sequence the state between steps is the target's KV cache, the draft's KV cache (one
entry per target position: draft entry ``i`` is the pair (token ``x[i+1]``, target hidden ``h[i]``)), the last
emitted token ``x`` (not yet in the target's cache), and the draft's output at its last entry: its hidden state
``g`` and its logits, which propose the token after ``x``. One step:

1. draft: ``d[1]`` from the draft logits; ``d[k+1]`` from the draft run on ``(d[k], g)`` (``num_steps - 1``
   forwards, each appending to the draft cache);
2. verify: one target forward over ``[x, d[1], ..., d[s]]`` (a causal window after the cached prefix) gives
   ``s + 1`` logits rows and hidden states;
3. accept: the longest prefix of drafts the target agrees with, plus the target's own token after it (the bonus
   token): at temperature 0 the target's greedy token, else Leviathan et al. 2023 / Chen et al. 2023 speculative
   sampling (accept ``d`` with probability ``min(1, p(d) / q(d))``, on a rejection draw from ``max(0, p - q)``
   renormalised), which leaves the output distributed exactly as the target's;
4. roll back: both caches are cropped to the accepted prefix (the rejected window positions are dropped);
5. draft extend: the draft runs on the accepted pairs ``(d[1], H[0]) ... (bonus, H[j])`` with the target's
   verify hidden states, which leaves it ready to propose the token after the bonus.

With the draft cache holding one entry per target position, both caches always have the same length between
steps, whatever the depth: a step of depth 0 (``--speculative-adaptive`` turns drafting off at large batch sizes)
verifies ``[x]`` alone, a plain decode step, and still runs the draft extend on its token (as SGLang's EAGLE worker
does at ``speculative_num_steps == 0``), so the next step can draft again at any depth. The depth is the settings'
``num_steps``, or with adaptive the one pd.engines.spec.adaptive picks for the step.

The logit processors (penalties, logit_bias, min_new_tokens' banned ids) are applied to every window row with the
history that row would have had in a one-token step, so stop ids, penalties and min_new_tokens behave as without
speculation.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from pd.engines.sampling import (
    SamplingParams,
    is_greedy,
    processed_logits,
    sampling_probs,
    step_generator,
)
from pd.engines.spec.adaptive import AdaptiveSpeculativeParams, DecodeRounds
from pd.engines.spec.config import SpecConfig
from pd.engines.spec.draft_model import crop_cache

# Random-number streams of sampling.step_generator used by speculative sampling.
DRAFT_STREAM, ACCEPT_STREAM, RESIDUAL_STREAM = 1, 2, 3


# ---- acceptance ----------------------------------------------------------------------------------------------
def draft_token(logits: torch.Tensor, params: SamplingParams, seed: int, step: int, banned: list[int],
                history: list[int]) -> tuple[int, Optional[torch.Tensor]]:
    """The draft's proposal for output ``step`` from its logits [vocab].

    Returns:
        (token, q): greedy requests get the argmax of the processed logits and ``q = None``; sampled requests a
        draw from the draft's distribution ``q`` [vocab] (normalised), processed with the request's own
        parameters, which the acceptance rule needs.
    """
    z = processed_logits(logits, params, banned, history)
    if is_greedy(params):
        return int(torch.argmax(z)), None
    q = sampling_probs(z, params)
    q = q / q.sum()
    return int(torch.multinomial(q, 1, generator=step_generator(seed, step, DRAFT_STREAM))), q


def accept_drafts(target_logits: torch.Tensor, drafts: list[int], draft_probs: list[Optional[torch.Tensor]],
                  params: SamplingParams, seed: int, first_step: int, banned: Callable[[int], list[int]],
                  history: list[int]) -> tuple[int, int]:
    """Decide how many drafts the target accepts and its bonus token.

    Args:
        target_logits: [s + 1, vocab] verify logits; row ``k`` predicts the token after window position ``k``
            (row 0 follows the last emitted token).
        drafts: the ``s`` drafted tokens; ``draft_probs`` their draft distributions (None entries when greedy).
        first_step: the output index of ``drafts[0]``.
        banned: output index -> token ids banned there (min_new_tokens).
        history: the output ids so far (the penalties count them).

    Returns:
        (j, bonus): drafts ``[:j]`` are accepted and ``bonus`` follows them.

    The rule: greedy requests accept a draft when it equals the target's greedy token with the same history;
    sampled ones accept ``d`` with probability ``min(1, p(d) / q(d))`` and otherwise draw the bonus from
    ``max(0, p - q)`` renormalised (Leviathan et al. 2023, algorithm 1; Chen et al. 2023), so every emitted
    token is distributed as the target's own draw. All accepted, the bonus is the target's draw from the last row.
    """
    hist = list(history)
    for k, d in enumerate(drafts):
        step = first_step + k
        z = processed_logits(target_logits[k], params, banned(step), hist)
        if is_greedy(params):
            tok = int(torch.argmax(z))
            if tok != d:
                return k, tok
        else:
            p = sampling_probs(z, params)
            p = p / p.sum()
            q = draft_probs[k]
            assert q is not None  # a sampled request's draft keeps its distribution (None only when greedy)
            u = float(torch.rand((), generator=step_generator(seed, step, ACCEPT_STREAM)))
            if u * float(q[d]) >= float(p[d]):  # reject: u >= p(d) / q(d)
                residual = (p - q).clamp_min(0)
                if float(residual.sum()) <= 0:  # p == q up to rounding: any draw from p is right
                    residual = p
                tok = int(torch.multinomial(residual, 1, generator=step_generator(seed, step, RESIDUAL_STREAM)))
                return k, tok
        hist.append(d)
    step = first_step + len(drafts)
    z = processed_logits(target_logits[len(drafts)], params, banned(step), hist)
    if is_greedy(params):
        return len(drafts), int(torch.argmax(z))
    return len(drafts), int(torch.multinomial(sampling_probs(z, params), 1, generator=step_generator(seed, step)))


# ---- per-sequence state and the step --------------------------------------------------------------------------
@dataclass
class SpecState:
    """A sequence's speculative state between verify steps.

    Attributes:
        draft_cache: the draft's KV cache, as long as the target's.
        hidden: [hidden_size] float32, the draft's output hidden state at its last entry (the ``g`` the next
            chain step reads; SGLang's ``EagleDraftInput.hidden_states``, what a prefill ships in its aux buffer).
        logits: [vocab] float32, the draft's logits at its last entry (they propose the next draft token).
    """

    draft_cache: object
    hidden: torch.Tensor
    logits: torch.Tensor


@dataclass
class StepResult:
    """What one verify step produced: the tokens to emit in order, each ``(token, logprob, top)`` as
    EngineCore._emit takes them, how many of them were drafts, the phase times in seconds, and the depth it drafted
    (``num_steps``: drafts proposed, 0 for a step without drafting)."""

    tokens: list[tuple[int, float, list]]
    accepted_drafts: int
    draft_s: float
    verify_s: float
    extend_s: float
    num_steps: int


class SpecDecoder:
    """Runs the draft next to a target ModelRunner (all on the engine's model thread).

    Args:
        runner: the target (``pd.engines.models.model_runner.ModelRunner``).
        draft: the draft (``pd.engines.spec.draft_model.DraftModel``).
        config: the resolved settings.
    """

    def __init__(self, runner, draft, config: SpecConfig):
        self.runner = runner
        self.draft = draft
        self.config = config
        self.rounds: Optional[DecodeRounds] = None  # the adaptive depth's batches, None at a fixed depth
        if config.adaptive:
            assert config.adaptive_config is not None  # resolve_speculative loads it with adaptive
            self.rounds = DecodeRounds(AdaptiveSpeculativeParams(config.num_steps, config.adaptive_config))
        # The sequences decoding here (id -> weak reference): the decode's batch size. Weak, so that a finished
        # sequence is never kept; touched on the model thread only.
        self._decoding: dict[int, weakref.ref] = {}

    def _depth(self, seq) -> int:
        """The depth of ``seq``'s next step: ``num_steps``, or with adaptive its round's (pd.engines.spec.adaptive)
        from the number of sequences decoding now (those that have stepped and neither finished nor were
        released: the engine clears ``spec_state`` when it lets a sequence go)."""
        if self.rounds is None:
            return self.config.num_steps
        self._decoding[id(seq)] = weakref.ref(seq)
        live = {}
        for key, ref in self._decoding.items():
            s = ref()
            if s is not None and not s.done and s.spec_state is not None:
                live[key] = ref
        self._decoding = live
        return self.rounds.begin(id(seq), live.keys())

    def topk(self, state: SpecState) -> tuple[list[float], list[int]]:
        """The draft's top-``eagle_topk`` probabilities and token ids at its last entry (the ``topk_p`` /
        ``topk_index`` SGLang's PD prefill puts in its aux buffer, sglang/srt/disaggregation/utils.py)."""
        vals, ids = torch.topk(torch.softmax(state.logits, -1), self.config.eagle_topk)
        return [float(v) for v in vals], [int(i) for i in ids]

    def extend_prompt(self, prompt_ids: list[int], hidden: torch.Tensor, first_token: int) -> SpecState:
        """The draft's prefill ("draft extend"): pairs ``(x[i+1], h[i])`` for every prompt position, the first
        output token closing the last pair.

        Args:
            hidden: [len(prompt_ids), hidden_size] the target's prompt hidden states.
        """
        cache = self.draft.new_cache()
        logits, g = self.draft.forward(list(prompt_ids[1:]) + [first_token], hidden, cache)
        return SpecState(cache, g[-1], logits[-1])

    def restore(self, draft_cache, hidden: list[float], topk_index: list[int]) -> SpecState:
        """Rebuild the state a prefill shipped (draft KV already in ``draft_cache``, its last hidden state and
        top-k ids from the aux metadata). The draft's logits are recomputed from the hidden state through the
        draft's LM head and checked against the shipped top-1 id.

        Raises:
            ValueError: the shipped hidden state does not give the shipped top-1 token (the two sides run
                different drafts, or the metadata is corrupt).
        """
        g = torch.tensor(hidden, dtype=torch.float32)
        # The draft's logits are its LM head (the target's, shared) on exactly this hidden state.
        logits = self.draft.lm_head(g.unsqueeze(0).to(self.draft.lm_head.weight.dtype)).float()[0]
        if topk_index and int(torch.argmax(logits)) != int(topk_index[0]):
            raise ValueError(f"speculative metadata mismatch: the shipped hidden state proposes token "
                             f"{int(torch.argmax(logits))}, the prefill's draft proposed {topk_index[0]}")
        return SpecState(draft_cache, g, logits)

    def step(self, seq, state: SpecState, cache, select: Callable[[torch.Tensor, int], tuple],
             num_steps: Optional[int] = None) -> StepResult:
        """One draft -> verify -> accept -> roll back -> draft-extend step for ``seq``.

        Args:
            seq: the pd.engines.sequence.Sequence (its output_ids end with the last emitted token).
            cache: the target's KV cache (everything before the last emitted token).
            select: (logits row [vocab], token) -> (token, logprob, top): the logprob entries of a token already
                chosen, from the request's logprob settings (EngineCore._logprob_entry).
            num_steps: the depth to draft (>= 0); None: the settings' depth, or with adaptive the one chosen for
                this step (which is then fed the step's acceptance).
        """
        chosen = num_steps is None
        depth = self._depth(seq) if num_steps is None else num_steps
        spec, params = seq.req, seq.req.params
        out = seq.output_ids
        base = cache.get_seq_length()
        step0 = len(out)
        t0 = time.perf_counter()
        drafts: list[int] = []
        qs: list[Optional[torch.Tensor]] = []
        logits, g = state.logits, state.hidden
        for k in range(depth):
            tok, q = draft_token(logits, params, spec.seed, step0 + k, seq.banned_tokens(step0 + k),
                                 out + drafts)
            drafts.append(tok)
            qs.append(q)
            if k + 1 < depth:
                lg, hs = self.draft.forward([tok], g.unsqueeze(0), state.draft_cache)
                logits, g = lg[-1], hs[-1]
        t1 = time.perf_counter()
        vlogits, vhidden = self.runner.forward_hidden([out[-1]] + drafts, cache)
        j, bonus = accept_drafts(vlogits, drafts, qs, params, spec.seed, step0, seq.banned_tokens, list(out))
        t2 = time.perf_counter()
        crop_cache(cache, base + 1 + j)  # keeps x, d[1..j]; the bonus is the next step's x
        crop_cache(state.draft_cache, base)
        accepted = drafts[:j] + [bonus]
        lg, hs = self.draft.forward(accepted, vhidden[: j + 1], state.draft_cache)
        state.logits, state.hidden = lg[-1], hs[-1]
        t3 = time.perf_counter()
        tokens = [select(vlogits[k], tok) for k, tok in enumerate(accepted)]
        if chosen and self.rounds is not None:
            self.rounds.end(j)
        return StepResult(tokens, j, t1 - t0, t2 - t1, t3 - t2, depth)
