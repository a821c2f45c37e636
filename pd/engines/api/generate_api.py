"""SGLang's native /generate: request expansion and response shapes.

Response (sglang/srt/managers/tokenizer_manager.py): ``{"text", "output_ids", "meta_info"}`` per
sequence, a JSON list for a batch or ``n > 1``. Streaming chunks carry the *cumulative* text,
output_ids and logprob lists (SGLang's default, ``--incremental-streaming-output`` off), plus
``"index"`` in a batch; the stream ends with ``data: [DONE]``. Logprob entries are
``[logprob, token_id, text | null]``; a decode in PD mode returns no input logprobs (the prefill
does; a router prepends them).
"""

from __future__ import annotations

import reprlib
from typing import Any, Optional, cast

from pydantic import ValidationError

from pd.engines.errors import bad_request
from pd.engines.models.model_runner import ModelRunner
from pd.engines.protocol import GenerateRequest, SeqRequest, check_logprobs, expand, per_item
from pd.engines.sampling import SGLANG_SAMPLING_KEYS, UNSUPPORTED_SAMPLING_KEYS, SamplingParams
from pd.engines.sequence import Sequence


def requests_from_generate(req: GenerateRequest, runner: ModelRunner) -> tuple[list[SeqRequest], bool]:
    """Expand a /generate body into sequences.

    Returns:
        (reqs, is_single): ``is_single`` when the answer is one object rather than a list.

    Raises:
        EngineError: 400 for a body with neither or both of text/input_ids, mismatched list
            lengths, inconsistent ``n``, a ``sampling_params`` key SGLang does not know, or bad
            sampling values.
    """
    if (req.text is None) == (req.input_ids is None):
        raise bad_request("exactly one of text or input_ids must be given", "text")
    if req.text is not None:
        is_batch = isinstance(req.text, list)
        texts = req.text if isinstance(req.text, list) else [req.text]
        if not all(isinstance(t, str) for t in texts):
            raise bad_request("text must be a string or a list of strings", "text")
        prompts = [runner.encode(t) for t in texts]
    else:
        ids = req.input_ids
        assert ids is not None  # exactly one of text and input_ids, checked above
        is_batch = bool(ids) and isinstance(ids[0], list)
        # validated as list[int] | list[list[int]] (strict): the first item tells which
        prompts = [list(x) for x in cast(list[list[int]], ids)] if is_batch else [list(cast(list[int], ids))]
    if is_batch and not prompts:
        raise bad_request("the batch is empty", "text" if req.text is not None else "input_ids")
    count = len(prompts)
    raw = req.sampling_params if req.sampling_params is not None else {}
    raw_list = per_item(raw, count, "sampling_params")
    for sp in raw_list:
        unknown = sorted(set(sp) - SGLANG_SAMPLING_KEYS)
        if unknown:
            raise bad_request(f"sampling_params: unknown field `{unknown[0]}`, expected one of "
                              f"{', '.join(sorted(SGLANG_SAMPLING_KEYS))}", "sampling_params")
        unsupported = sorted(k for k in set(sp) & UNSUPPORTED_SAMPLING_KEYS if sp[k] is not None)
        if unsupported:
            raise bad_request(f"sampling_params: `{unsupported[0]}` is not supported by the pdserve reference engine "
                              "(SGLang serves it)", f"sampling_params.{unsupported[0]}")
    ns = [sp.get("n", 1) for sp in raw_list]
    bad_n = [n for n in ns if not isinstance(n, int) or isinstance(n, bool)]
    if bad_n:
        raise bad_request(f"sampling_params: n must be an integer, got {bad_n[0]!r}", "n")
    if len(set(ns)) != 1:
        raise bad_request("sampling_params: n must be the same for every prompt of a batch", "sampling_params")
    n = ns[0]
    try:
        params = [SamplingParams(**sp) for sp in raw_list]
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(["sampling_params", *(str(x) for x in err["loc"])])
        raise bad_request(f"{field}: {err['msg']}, got {reprlib.repr(err['input'])}", field) from None
    reqs = expand(
        prompts, n, params, req, req.rid,
        return_logprob=[bool(x) for x in per_item(req.return_logprob or False, count, "return_logprob")],
        logprob_start_len=[int(x) for x in per_item(-1 if req.logprob_start_len is None else req.logprob_start_len,
                                                    count, "logprob_start_len")],
        top_logprobs_num=[int(x) for x in per_item(req.top_logprobs_num or 0, count, "top_logprobs_num")],
        stream=req.stream,
    )
    check_logprobs(reqs, runner.vocab_size)
    return reqs, not is_batch and n == 1


def _lp_entries(entries, runner: ModelRunner, with_text: bool) -> list:
    return [[lp, tid, runner.token_text(tid) if with_text else None] for lp, tid in entries]


def _top_entries(tops, runner: ModelRunner, with_text: bool) -> list:
    return [None if t is None else _lp_entries(t, runner, with_text) for t in tops]


def spec_meta_info(seq: Sequence) -> dict:
    """SGLang's per-request speculative counts (TokenizerManager._calculate_spec_decoding_metrics):
    accept rate = accepted drafts / proposed drafts (no bonus), accept length = completion tokens / verify
    steps (the bonus included), proposed = verify steps x (num_draft_tokens - 1)."""
    proposed = seq.spec_verify_ct * seq.spec_draft_width
    return {
        "spec_accept_rate": seq.spec_correct_drafts / proposed if proposed else 0.0,
        "spec_accept_length": len(seq.output_ids) / seq.spec_verify_ct,
        "spec_num_correct_drafts": seq.spec_correct_drafts,
        "spec_num_proposed_drafts": proposed,
        "spec_verify_ct": seq.spec_verify_ct,
    }


def generate_result(seq: Sequence, runner: ModelRunner, with_text: bool, text: Optional[str] = None) -> dict:
    """One sequence as SGLang's /generate result object (cumulative; ``text`` overrides the text,
    e.g. the stop-safe prefix while streaming)."""
    meta: dict[str, Any] = {
        "id": seq.req.rid,
        "finish_reason": seq.finish_reason if seq.done else None,
        "prompt_tokens": len(seq.req.prompt_ids),
        "completion_tokens": len(seq.output_ids),
        "cached_tokens": seq.cached_tokens,
        "weight_version": "default",
    }
    if seq.done and seq.finish_time is not None:
        meta["e2e_latency"] = seq.finish_time - seq.arrival
    if seq.spec_verify_ct > 0:
        meta.update(spec_meta_info(seq))
    if seq.req.return_logprob:
        meta["input_token_logprobs"] = _lp_entries(seq.input_logprobs, runner, with_text)
        meta["output_token_logprobs"] = _lp_entries(seq.output_logprobs, runner, with_text)
        if seq.req.top_logprobs_num > 0:
            meta["input_top_logprobs"] = _top_entries(seq.input_top, runner, with_text)
            meta["output_top_logprobs"] = _top_entries(seq.output_top, runner, with_text)
    return {
        "text": seq.text() if text is None else text,
        "output_ids": list(seq.output_ids),
        "meta_info": meta,
    }
