"""OpenAI-compatible /v1/completions and /v1/chat/completions on top of the engine core.

Shapes follow the OpenAI API reference and SGLang's serving_completions.py / serving_chat.py:
choices are prompt-major (``index = prompt * n + sample``), finish reasons ``stop`` / ``length``
/ ``abort`` with SGLang's ``matched_stop``; streams send text deltas, one final chunk per choice
with its finish reason, an optional usage chunk (``choices: []``) and ``data: [DONE]``. With
``stream_options.include_usage`` every chunk before the usage chunk carries ``"usage": null``, as OpenAI's do.
"""

from __future__ import annotations

import time
import uuid
from typing import Optional, TypeGuard, TypeVar, cast

from pd.engines.errors import EngineError, bad_request
from pd.engines.models.model_runner import ModelRunner
from pd.engines.protocol import ChatCompletionRequest, CompletionRequest, SeqRequest, check_logprobs, expand
from pd.engines.sampling import SEED_MAX, SEED_MIN
from pd.engines.sequence import Sequence

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's and SGLang's default for /v1/completions

T = TypeVar("T")


def _list_of(items: list, kind: type[T]) -> TypeGuard[list[T]]:
    """Whether every item of ``items`` is a ``kind`` (true of an empty list)."""
    return all(isinstance(x, kind) for x in items)


def check_model(requested: Optional[str], served: set[str]) -> None:
    """Raises EngineError 404 (OpenAI's ``model_not_found``) for a model this engine does not serve."""
    if requested and requested not in served:
        raise EngineError(404, f"The model `{requested}` does not exist; this server serves {sorted(served)[0]!r}",
                          "model")


def _check_common(req) -> None:
    if req.max_tokens is not None and req.max_tokens <= 0:
        raise bad_request(f"max_tokens must be at least 1, got {req.max_tokens}", "max_tokens")
    if req.n < 1:
        raise bad_request(f"n must be at least 1, got {req.n}", "n")
    if req.seed is not None and not SEED_MIN <= req.seed <= SEED_MAX:  # SGLang's sampling_seed check
        raise bad_request(f"seed must be in [-2**63, 2**63 - 1], got {req.seed}", "seed")


def requests_from_completion(req: CompletionRequest, runner: ModelRunner) -> list[SeqRequest]:
    """Raises EngineError 400 for an empty prompt list, max_tokens <= 0, n < 1, logprobs < 0, or echo
    with logprobs."""
    _check_common(req)
    p = req.prompt
    if isinstance(p, str):
        prompts = [runner.encode(p)]
    elif p and _list_of(p, int):
        prompts = [list(p)]
    elif p and _list_of(p, str):
        prompts = [runner.encode(x) for x in p]
    elif p and _list_of(p, list):
        prompts = [list(x) for x in p]
    else:
        raise bad_request("prompt must be a string, a list of strings, or token ids", "prompt")
    if req.logprobs is not None and req.logprobs < 0:
        raise bad_request("logprobs must be >= 0", "logprobs")
    if req.echo and req.logprobs is not None:
        # SGLang warns "Echo is not compatible with logprobs" and points to /generate for prompt logprobs
        raise bad_request("echo with logprobs is not supported: for the prompt's logprobs use /generate with "
                          "return_logprob and logprob_start_len 0", "echo")
    params = req.sampling(COMPLETIONS_DEFAULT_MAX_TOKENS)
    count = len(prompts)
    reqs = expand(
        prompts, req.n, [params] * count, req, req.rid,
        return_logprob=[req.logprobs is not None] * count, logprob_start_len=[-1] * count,
        top_logprobs_num=[req.logprobs or 0] * count, stream=req.stream,
    )
    check_logprobs(reqs, runner.vocab_size, "logprobs")
    return reqs


def _message_text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") != "text":
            raise bad_request(f"messages: content part type {part.get('type')!r} is not supported (text only)",
                              "messages")
        text = part.get("text", "")
        if not isinstance(text, str):
            raise bad_request(f"messages: a text content part's text must be a string, got {type(text).__name__}",
                              "messages")
        parts.append(text)
    return "".join(parts)


def requests_from_chat(req: ChatCompletionRequest, runner: ModelRunner) -> list[SeqRequest]:
    """Raises EngineError 400 for no messages, max_tokens <= 0, n < 1, non-text content."""
    if req.max_completion_tokens is not None:
        # SGLang reads ``max_completion_tokens or max_tokens`` (a router counts the same): the newer field wins.
        # A different max_tokens beside it would be silently ignored, so it is refused instead.
        if req.max_tokens is not None and req.max_tokens != req.max_completion_tokens:
            raise bad_request(f"max_tokens = {req.max_tokens} and max_completion_tokens = {req.max_completion_tokens}"
                              " disagree: give max_completion_tokens only (max_tokens is its deprecated name)",
                              "max_tokens")
        if req.max_completion_tokens <= 0:
            raise bad_request(f"max_completion_tokens must be at least 1, got {req.max_completion_tokens}",
                              "max_completion_tokens")
        req.max_tokens = req.max_completion_tokens
    _check_common(req)
    if not req.messages:
        raise bad_request("messages must not be empty", "messages")
    messages = [{"role": m.role, "content": _message_text(m.content)} for m in req.messages]
    prompt = runner.apply_chat_template(messages)
    top = req.top_logprobs or 0
    if top and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    reqs = expand(
        [prompt], req.n, [req.sampling(None)], req, req.rid,
        return_logprob=[req.logprobs], logprob_start_len=[-1], top_logprobs_num=[top], stream=req.stream,
    )
    check_logprobs(reqs, runner.vocab_size, "top_logprobs")
    return reqs


def finish_fields(seq: Sequence) -> tuple[Optional[str], object]:
    """(OpenAI finish_reason, SGLang matched_stop) of a finished sequence."""
    fr = seq.finish_reason
    if fr is None:
        return None, None
    return fr["type"], fr.get("matched") if fr["type"] == "stop" else None


def echo_texts(req: CompletionRequest, runner: ModelRunner) -> Optional[list[str]]:
    """With ``echo``: the text each prompt's choices start with, by prompt index (the prompt string
    itself, or token-id prompts decoded without special tokens, as SGLang echoes them); else None."""
    if not req.echo:
        return None
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if _list_of(p, str):
        return list(p)
    if _list_of(p, int):
        return [runner.decode(list(p))]
    # lists of token ids: requests_from_completion refused any other prompt before this runs
    return [runner.decode(list(x)) for x in cast(list[list[int]], p)]


def usage(seqs: list[Sequence], n: int, cache_report: bool = False) -> dict:
    """Token usage; the prompt counts once per prompt, not per sample (SGLang's UsageProcessor), and so do its
    cached tokens, reported in ``prompt_tokens_details`` with ``cache_report`` (``--enable-cache-report``)."""
    first = [s for s in seqs if s.req.sample_index == 0]
    prompt = sum(len(s.req.prompt_ids) for s in first)
    completion = sum(len(s.output_ids) for s in seqs)
    out: dict = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if cache_report:
        out["prompt_tokens_details"] = {"cached_tokens": sum(s.cached_tokens for s in first)}
    return out


# ---- logprobs -------------------------------------------------------------------------------
def completion_logprobs(seq: Sequence, runner: ModelRunner, start: int) -> dict:
    """OpenAI completions ``logprobs`` for output tokens [start:].

    ``text_offset[i]`` is where token i starts in the completion's text: the length of the decoded
    prefix before it, decoded as the text is (``skip_special_tokens``), so a special token that
    the text leaves out adds nothing and slicing the text by offsets gives each token's share.
    """
    tokens, lps, tops, offsets = [], [], [], []
    skip = seq.req.params.skip_special_tokens
    for k, ((lp, tid), top) in enumerate(zip(seq.output_logprobs[start:], seq.output_top[start:])):
        tokens.append(runner.logprob_token(tid)[0])
        lps.append(lp)
        tops.append({runner.logprob_token(i)[0]: v for v, i in top} if seq.req.top_logprobs_num else None)
        offsets.append(len(runner.decode(seq.output_ids[:start + k], skip_special_tokens=skip)))
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(seq: Sequence, runner: ModelRunner, start: int) -> dict:
    """OpenAI chat ``logprobs`` (``{"content": [...]}``) for output tokens [start:]."""
    def entry(tid: int, lp: float) -> dict:
        token, raw = runner.logprob_token(tid)
        return {"token": token, "logprob": lp, "bytes": list(raw)}

    content = []
    for (lp, tid), top in zip(seq.output_logprobs[start:], seq.output_top[start:]):
        content.append({**entry(tid, lp), "top_logprobs": [entry(i, v) for v, i in top]})
    return {"content": content}


# ---- responses ------------------------------------------------------------------------------
class OpenAIResponder:
    """Builds the response objects of one OpenAI request.

    Args:
        kind: ``completion`` or ``chat``.
        model: the model name to report.
        runner: for token texts in logprobs.
        n: samples per prompt (for usage).
        echo: completions with ``echo``: the prompt text each choice starts with, by prompt index
            (``echo_texts``); None otherwise.
        include_usage: the stream ends with a usage chunk (``stream_options.include_usage``), so every
            chunk before it carries ``"usage": null``.
        cache_report: usage reports the prompts' cached tokens (``--enable-cache-report``).
    """

    def __init__(self, kind: str, model: str, runner: ModelRunner, n: int, echo: Optional[list[str]] = None,
                 include_usage: bool = False, cache_report: bool = False):
        self.kind = kind
        self.cache_report = cache_report
        self.include_usage = include_usage
        self.echo = echo
        self.model = model
        self.runner = runner
        self.n = n
        self.id = ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "text_completion" if kind == "completion" else "chat.completion"

    def full(self, seqs: list[Sequence]) -> dict:
        """The whole non-streaming response object (one choice per sequence, usage included)."""
        choices = []
        for seq in seqs:
            reason, matched = finish_fields(seq)
            choice = {"index": seq.req.index, "finish_reason": reason, "matched_stop": matched}
            if self.kind == "completion":
                choice["text"] = self._echo(seq) + seq.text()
                choice["logprobs"] = completion_logprobs(seq, self.runner, 0) if seq.req.return_logprob else None
            else:
                choice["message"] = {"role": "assistant", "content": seq.text()}
                choice["logprobs"] = chat_logprobs(seq, self.runner, 0) if seq.req.return_logprob else None
            choices.append(choice)
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": usage(seqs, self.n, self.cache_report)}

    def _echo(self, seq: Sequence) -> str:
        return self.echo[seq.req.prompt_index] if self.echo else ""

    def chunk(self, choices: list[dict], usage_info: Optional[dict] = None) -> dict:
        """One streaming chunk object with ``choices`` and ``usage``: ``usage_info`` when given, else null
        when the stream includes usage, else no ``usage`` key."""
        obj = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if usage_info is not None or self.include_usage:
            out["usage"] = usage_info
        return out

    def delta_choice(self, seq: Sequence, text_delta: str, lp_start: int,
                     first: bool, final: bool) -> dict:
        """One streamed choice: ``text_delta`` and the logprobs of tokens [lp_start:]."""
        reason, matched = finish_fields(seq) if final else (None, None)
        choice: dict = {"index": seq.req.index, "finish_reason": reason, "matched_stop": matched}
        has_lp = seq.req.return_logprob and lp_start < len(seq.output_ids)
        if self.kind == "completion":
            choice["text"] = (self._echo(seq) if first else "") + text_delta
            choice["logprobs"] = completion_logprobs(seq, self.runner, lp_start) if has_lp else None
        else:
            delta: dict = {"role": "assistant", "content": text_delta} if first else {}
            if not first and text_delta:
                delta["content"] = text_delta
            choice["delta"] = delta
            choice["logprobs"] = chat_logprobs(seq, self.runner, lp_start) if has_lp else None
        return choice
