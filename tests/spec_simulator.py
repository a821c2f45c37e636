"""Tests only: greedy chain speculation over a target and its draft, offline (no engine): the accept length the
pair gives, and a check that speculation leaves greedy output unchanged.

One verify step, as SGLang's EAGLE worker runs it with ``speculative_eagle_topk = 1``
(``srt/speculative/eagle_worker.py``): the draft proposes ``num_steps`` tokens d_1..d_s (d_1 from its
forward over the last accepted pairs, then chained: step k+1 reads (d_k, its own hidden)); the target runs
once over [last token, d_1..d_s]; the longest prefix of d equal to the target's greedy tokens is accepted
plus the target's next token (the bonus); both caches are cropped to the accepted tokens and the draft is
re-run over the accepted (token, target hidden) pairs, whose last output proposes the next d_1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pd.engines.spec.draft_model import crop_cache


@dataclass
class SpecResult:
    """One prompt's speculative greedy decode: the output ids and the tokens each verify step emitted
    (accepted drafts + the bonus token; SGLang's accept length per step)."""

    output_ids: list[int]
    accepted_per_step: list[int]


def greedy_decode(target, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Plain one-token-a-step greedy decoding by ``target`` (a ModelRunner): the reference output."""
    cache = target.new_cache()
    logits = target.forward(prompt_ids, cache)
    out = [int(logits[-1].argmax())]
    while len(out) < max_new_tokens:
        out.append(int(target.forward([out[-1]], cache)[-1].argmax()))
    return out


@torch.inference_mode()
def speculative_greedy(target, draft, prompt_ids: list[int], max_new_tokens: int, num_steps: int = 3) -> SpecResult:
    """Greedy decoding of ``prompt_ids`` with chain speculation (module docstring).

    Args:
        target: ModelRunner (``forward_hidden``); draft: DraftModel bound to it.
        num_steps: draft tokens per verify step (SGLang ``speculative_num_steps``; num_draft_tokens =
            num_steps + 1 with topk 1).
    Returns:
        SpecResult; ``output_ids`` equals :func:`greedy_decode` (up to fp ties), the first token coming from
        the prefill, not a verify step.
    """
    tcache, dcache = target.new_cache(), draft.new_cache()
    logits, hidden = target.forward_hidden(prompt_ids, tcache)
    out = [int(logits[-1].argmax())]
    # draft extend over the prompt: position i reads (x_{i+1}, h_i)
    dlogits, dhidden = draft.forward(prompt_ids[1:] + out, hidden, dcache)
    steps = []
    while len(out) < max_new_tokens:
        committed = tcache.get_seq_length()  # tokens before out[-1]; the draft cache holds as many
        proposal = [int(dlogits[-1].argmax())]
        g = dhidden[-1:]
        for _ in range(num_steps - 1):
            dl, g = draft.forward([proposal[-1]], g, dcache)
            proposal.append(int(dl[-1].argmax()))
        vlogits, vhidden = target.forward_hidden([out[-1]] + proposal, tcache)
        greedy = vlogits.argmax(-1).tolist()
        n = 0
        while n < num_steps and proposal[n] == greedy[n]:
            n += 1
        emitted = proposal[:n] + [greedy[n]]
        steps.append(len(emitted))
        crop_cache(tcache, committed + 1 + n)  # out[-1] and the accepted drafts; the bonus is not run yet
        crop_cache(dcache, committed)
        # re-run the draft over the accepted pairs: (d_1, h(out[-1])), ..., (bonus, h(d_n))
        dlogits, dhidden = draft.forward(emitted, vhidden[: n + 1], dcache)
        out += emitted
    return SpecResult(out[:max_new_tokens], steps)


def random_prompts(count: int, vocab_size: int, seed: int, lengths: tuple[int, int] = (8, 64)) -> list[list[int]]:
    """``count`` seeded random byte-token prompts of ``lengths[0]..lengths[1]`` tokens (ids 3.., no
    pad / EOS / UNK)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(count)]


def mean_accept_length(target, draft, prompts: list[list[int]], max_new_tokens: int = 32, num_steps: int = 3) -> float:
    """Tokens emitted per verify step over all ``prompts`` (total emitted / total verify steps; SGLang's
    ``spec_accept_length`` without the prefill's first token)."""
    steps = [s for p in prompts for s in speculative_greedy(target, draft, p, max_new_tokens, num_steps)
             .accepted_per_step]
    return sum(steps) / len(steps)
