"""Merging the prefill's prompt logprobs into decode's answer (/generate with ``return_logprob``).

In PD mode only the prefill runs the prompt, so only its answer carries
``meta_info.input_token_logprobs`` (and ``input_top_logprobs`` with ``top_logprobs_num``,
``input_token_ids_logprobs`` with ``token_ids_logprob``: SGLang's tokenizer_manager.py names); the decode's
lists are empty. The router prepends the prefill's lists to decode's, per sequence:
by position for a non-streaming batch (both sides answer in the same prompt-major order), by
``index`` for streams (each decode chunk carries the cumulative meta_info of its sequence).
"""

from __future__ import annotations

import json
from typing import Any, Optional

INPUT_KEYS = ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs")

SSE_DATA = b"data: "
SSE_DONE = b"data: [DONE]"


def wants_input_logprobs(route: str, body: dict) -> bool:
    """True when decode's answer needs the prefill's prompt logprobs prepended."""
    if route != "/generate":
        return False
    flag = body.get("return_logprob")
    return any(bool(x) for x in flag) if isinstance(flag, list) else bool(flag)


def sse_events(raw: bytes) -> list[bytes]:
    """Complete SSE events of a whole body (separator stripped, empty events dropped)."""
    return [e for e in (x.strip() for x in raw.split(b"\n\n")) if e]


def sse_json(event: bytes) -> Optional[Any]:
    """The JSON payload of a ``data: {...}`` event, or None for ``[DONE]``, comments and junk."""
    if not event.startswith(SSE_DATA) or event.startswith(SSE_DONE):
        return None
    try:
        return json.loads(event[len(SSE_DATA):])
    except ValueError:
        return None


def prefill_inputs(raw: bytes, stream: bool) -> dict[int, dict]:
    """The prefill's prompt-logprob lists per sequence index, from its whole response body.

    For a stream, each sequence's last data chunk (cumulative) wins; chunks without ``index``
    belong to sequence 0. Returns {} when the body has none (e.g. an error body).
    """
    out: dict[int, dict] = {}
    if stream:
        items = []
        for event in sse_events(raw):
            obj = sse_json(event)
            if isinstance(obj, dict) and "meta_info" in obj:
                items.append((obj.get("index", 0), obj))
    else:
        try:
            obj = json.loads(raw)
        except ValueError:
            return out
        items = list(enumerate(obj)) if isinstance(obj, list) else [(0, obj)]
    for index, obj in items:
        meta = obj.get("meta_info") if isinstance(obj, dict) else None
        if isinstance(meta, dict):
            out[index] = {k: meta[k] for k in INPUT_KEYS if isinstance(meta.get(k), list)}
    return out


def prepend(obj: Any, inputs: dict) -> None:
    """Prepend the prefill's lists of one sequence to ``obj["meta_info"]`` in place."""
    meta = obj.get("meta_info") if isinstance(obj, dict) else None
    if not isinstance(meta, dict):
        return
    for key, lst in inputs.items():
        meta[key] = lst + (meta.get(key) or [])


def merge_full(decode_raw: bytes, prefill: dict[int, dict]) -> bytes:
    """Decode's non-streaming /generate body (an object, or a list in prompt-major order) with
    the prefill's prompt logprobs prepended. Unparseable bodies pass through unchanged."""
    try:
        obj = json.loads(decode_raw)
    except ValueError:
        return decode_raw
    items = obj if isinstance(obj, list) else [obj]
    for i, item in enumerate(items):
        prepend(item, prefill.get(i, {}))
    return json.dumps(obj, ensure_ascii=False).encode()


def merge_event(event: bytes, prefill: dict[int, dict]) -> bytes:
    """One decode SSE event (without its trailing blank line) with the prefill's lists prepended;
    ``[DONE]``, error chunks and anything unparseable pass through unchanged."""
    obj = sse_json(event)
    if not isinstance(obj, dict) or "meta_info" not in obj:
        return event
    prepend(obj, prefill.get(obj.get("index", 0), {}))
    return SSE_DATA + json.dumps(obj, ensure_ascii=False).encode()
