"""Sampling parameters (SGLang's names) and the token sampler of the reference engine.

Sampling is counter-based: output token ``i`` of a request with seed ``s`` is drawn with a
generator seeded from ``(s, i)``. The draw therefore does not depend on which process makes it,
so a prefill that samples token 0 and a decode that samples tokens 1.. reproduce exactly what a
single (``null`` mode) engine samples with the same seed.
"""

from __future__ import annotations

import hashlib
from typing import Optional, Sequence, Union

import torch
from pydantic import BaseModel, ConfigDict, Field

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default for /generate
# SGLang's accepted sampling_seed range (sglang/srt/sampling/sampling_params.py verify): a signed 64-bit integer
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1

# Every key SGLang 0.5.23's /generate accepts in ``sampling_params`` (the API fields of
# sglang/srt/sampling/sampling_params.py; its JSON contract, sglang/api/v1, rejects any other key with a
# 400). The reference engine honours the fields of SamplingParams below (see UNSUPPORTED_SAMPLING_KEYS for
# the rest), and an unknown key is refused as SGLang refuses it, so a misspelt ``max_new_token`` is not
# silently replaced by the default.
SGLANG_SAMPLING_KEYS = frozenset({
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema",
    "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
    "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width",
    "watermark", "choice",
})


# SGLang keys whose meaning the reference engine does not implement (constrained decoding, beam search,
# custom logit processors, watermarking): a request that sets one gets a 400 naming it rather than output
# that silently ignores it. The remaining keys it does not model (stream_interval,
# spaces_between_special_tokens) only shape how text is streamed or joined and are ignored.
UNSUPPORTED_SAMPLING_KEYS = frozenset({
    "json_schema", "regex", "ebnf", "structural_tag", "stop_regex", "choice", "beam_width", "custom_params",
    "watermark",
})


class SamplingParams(BaseModel):
    """The subset of SGLang's ``sampling_params`` the reference engine honours.

    Field names, defaults and ranges follow sglang/srt/sampling/sampling_params.py. ``top_k = -1``,
    ``top_p = 1`` and ``min_p = 0`` disable those filters; ``temperature = 0`` is greedy. The penalties
    count the request's output tokens only, as SGLang's penalizers (sglang/srt/sampling/penaltylib) do;
    ``logit_bias`` maps token ids (JSON object keys) to values added to their logits.
    """

    # strict: JSON types as SGLang's /generate contract checks them ("5" is not an int, 1 not a bool)
    model_config = ConfigDict(extra="ignore", strict=True)

    max_new_tokens: Optional[int] = DEFAULT_MAX_NEW_TOKENS
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Optional[dict[str, float]] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: Optional[int] = Field(default=None)

    def stop_strings(self) -> list[str]:
        """``stop`` as a list of non-empty strings."""
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return [s for s in stops if s]

    def validate_for(self, vocab_size: int) -> None:
        """Check ranges (SGLang's SamplingParams.verify).

        Raises:
            EngineError: 400 naming the first bad field.
        """
        from pd.engines.errors import bad_request

        if self.max_new_tokens is not None and self.max_new_tokens <= 0:
            raise bad_request("max_new_tokens must be positive (at least 1)", "max_new_tokens")
        if self.min_new_tokens < 0:
            raise bad_request("min_new_tokens must be >= 0", "min_new_tokens")
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            raise bad_request("min_new_tokens must be <= max_new_tokens", "min_new_tokens")
        if self.temperature < 0:
            raise bad_request("temperature must be >= 0", "temperature")
        if not 0 < self.top_p <= 1:
            raise bad_request("top_p must be in (0, 1]", "top_p")
        if self.top_k < -1 or self.top_k == 0:
            raise bad_request("top_k must be -1 (disabled) or >= 1", "top_k")
        if not 0 <= self.min_p <= 1:
            raise bad_request("min_p must be in [0, 1]", "min_p")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise bad_request(f"{name} must be in [-2, 2]", name)
        if not 0 < self.repetition_penalty <= 2:
            raise bad_request("repetition_penalty must be in (0, 2] (1 = no penalty)", "repetition_penalty")
        for key, bias in (self.logit_bias or {}).items():
            if not key.strip().lstrip("-").isdigit() or not 0 <= int(key) < vocab_size:
                raise bad_request(f"logit_bias: key {key!r} is not a token id in [0, {vocab_size})", "logit_bias")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:  # NaN too
                raise bad_request(f"logit_bias: the value of {key!r} must be within +-{MAX_LOGIT_BIAS:g}, got {bias!r}",
                                  "logit_bias")
        if self.sampling_seed is not None and not SEED_MIN <= self.sampling_seed <= SEED_MAX:
            raise bad_request(f"sampling_seed must be in [-2**63, 2**63 - 1], got {self.sampling_seed}.",
                              "sampling_seed")
        for t in self.stop_token_ids or []:
            if not 0 <= t < vocab_size:
                raise bad_request(f"stop_token_ids: {t} is outside the vocabulary [0, {vocab_size})", "stop_token_ids")


def processed_logits(logits: torch.Tensor, params: SamplingParams, banned: list[int],
                     output_ids: Sequence[int] = ()) -> torch.Tensor:
    """The logits after the request's logit processors, as SGLang applies them in order: penalties
    (frequency: minus penalty x count; presence: minus penalty if present; repetition: logit / penalty if
    positive, x penalty if negative), then ``logit_bias``, then ``-inf`` on ``banned``.

    Args:
        logits: [vocab] logits of one position.
        banned: token ids that must not be produced now (EOS and stop ids before min_new_tokens).
        output_ids: the tokens this request has generated so far (the penalties count them).

    Returns:
        [vocab] float32, a new tensor.
    """
    logits = logits.float().clone()
    if output_ids and (params.frequency_penalty or params.presence_penalty or params.repetition_penalty != 1):
        counts = torch.bincount(torch.tensor(list(output_ids), dtype=torch.long), minlength=logits.numel())
        seen = counts > 0
        logits -= params.frequency_penalty * counts.float() + params.presence_penalty * seen.float()
        if params.repetition_penalty != 1:
            rp = params.repetition_penalty
            logits = torch.where(seen, torch.where(logits < 0, logits * rp, logits / rp), logits)
    for key, bias in (params.logit_bias or {}).items():
        logits[int(key)] += bias
    if banned:
        logits[banned] = float("-inf")
    return logits


# Largest logit_bias magnitude: the logits are float32 (max 3.4e38), and a bias of 1e30 divided by the smallest
# temperature that is not greedy (SAMPLING_EPS) stays finite; 1e308 became inf, and two of them a NaN softmax.
MAX_LOGIT_BIAS = 1e30

# SGLang's _SAMPLING_EPS (sglang/srt/sampling/sampling_params.py): a temperature below it samples greedily. Dividing
# the logits by a smaller one (1e-300) makes them infinite, and the softmax NaN, which torch.multinomial refuses.
SAMPLING_EPS = 1e-6


def is_greedy(params: SamplingParams) -> bool:
    """True when sampling is an argmax (``temperature < SAMPLING_EPS``, as SGLang rounds it, or ``top_k == 1``)."""
    return params.temperature < SAMPLING_EPS or params.top_k == 1


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy draw samples from: temperature, top-k, top-p (the smallest prefix
    whose mass reaches top_p, the first token always kept) and min-p (probabilities below min_p x the
    largest dropped) over already-processed ``logits`` [vocab]. Returns [vocab] float32, unnormalised
    after top-p / min-p (``torch.multinomial`` normalises)."""
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits[logits < kth] = float("-inf")
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cutoff = torch.cumsum(sorted_probs, 0) - sorted_probs >= params.top_p
        sorted_probs[cutoff] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    if params.min_p > 0:
        probs[probs < probs.max() * params.min_p] = 0.0
    return probs


def step_seed(seed: int, step: int, stream: int = 0) -> int:
    """The 64-bit seed of one (request seed, output step, stream): a BLAKE2b hash of all three, so every bit
    of the request's seed counts (an affine map folded modulo 2^32 made 0, 2^32, 2^63 and -2^63 one stream:
    the CPU generator's Mersenne Twister keeps only the low 32 bits of what it is seeded with)."""
    key = seed.to_bytes(16, "little", signed=True) + step.to_bytes(8, "little") + stream.to_bytes(1, "little")
    digest = hashlib.blake2b(key, digest_size=8, person=b"pd.sampling").digest()
    # the low 32 bits seed the generator: fold the high half in so the whole digest counts
    value = int.from_bytes(digest, "little")
    return (value ^ (value >> 32)) & 0xFFFFFFFF


def step_generator(seed: int, step: int, stream: int = 0) -> torch.Generator:
    """The generator of output ``step``'s draws (counter-based, see the module docstring), seeded by
    :func:`step_seed`. ``stream`` 0 is the plain sampler's; speculative decoding draws its draft, accept and
    residual samples from streams 1-3 so they never reuse one another's numbers."""
    return torch.Generator().manual_seed(step_seed(seed, step, stream))


def sample(logits: torch.Tensor, params: SamplingParams, seed: int, step: int, banned: list[int],
           output_ids: Sequence[int] = ()) -> int:
    """Pick the next token.

    Args:
        logits: [vocab] float32 logits of the last position.
        params: the request's sampling parameters.
        seed: the request's sampling seed (any int).
        step: index of the output token being sampled (0 = first token).
        banned: token ids that must not be produced now (EOS and stop ids before min_new_tokens).
        output_ids: the tokens this request has generated so far (the penalties count them).

    Returns:
        The token id: :func:`processed_logits`, then greedy argmax (``is_greedy``;
        ties break to the lowest id, as ``torch.argmax`` does) or a seeded draw from :func:`sampling_probs`.
    """
    logits = processed_logits(logits, params, banned, output_ids)
    if is_greedy(params):
        return int(torch.argmax(logits))
    return int(torch.multinomial(sampling_probs(logits, params), 1, generator=step_generator(seed, step)))
