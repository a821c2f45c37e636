"""Stamping a request body with the PD bootstrap fields: one fresh bootstrap room per generated
sequence, plus the chosen prefill's bootstrap host and port, plus a router request id.

How many sequences a body generates (SGLang's expansion, which the reference engine follows:
P prompts x ``n`` samples, prompt-major, a room list of length P*n indexed by ``p * n + s``):

- ``/generate``: P = len(text) for a list of strings, len(input_ids) for a list of token-id lists,
  else 1 (not a batch); ``n`` from ``sampling_params.n`` (a dict, or a list of dicts that must agree).
- ``/v1/completions``: P = len(prompt) for a list of strings or of token-id lists; a string or one
  flat list of ints is one prompt (not a batch); times ``n``.
- ``/v1/chat/completions``: one prompt, ``n`` samples.

A single sequence of a non-batch request gets scalar fields; anything else gets lists of length
P*n. Client-supplied bootstrap fields are always replaced (a client must not pick rooms).
"""

from __future__ import annotations

import random
import uuid
from typing import Optional

from pd.router.workers import Worker

ROOM_LIMIT = 2**63  # rooms are drawn from [0, 2^63): they fit a signed 64-bit int everywhere

_rng = random.SystemRandom()  # rooms must not repeat across router processes started together


def new_room() -> int:
    """A fresh random bootstrap room in [0, 2^63)."""
    return _rng.randrange(ROOM_LIMIT)


def new_rid() -> str:
    """A router-generated request id (the engines expand it to ``rid_i`` for batch items)."""
    return "pdr-" + uuid.uuid4().hex


def _as_n(value) -> Optional[int]:
    # Anything odd (a string, a bool) is left for the engine to reject with a proper 400.
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


def _generate_shape(body: dict) -> tuple[int, bool]:
    text, ids = body.get("text"), body.get("input_ids")
    if isinstance(text, list):
        prompts, batch = len(text), True
    elif text is None and isinstance(ids, list) and ids and isinstance(ids[0], list):
        prompts, batch = len(ids), True
    else:
        prompts, batch = 1, False
    sp = body.get("sampling_params")
    if isinstance(sp, list):
        sp = sp[0] if sp else None
    n = _as_n(sp.get("n", 1)) if isinstance(sp, dict) else 1
    return prompts * (n or 1), batch


def _completion_shape(body: dict) -> tuple[int, bool]:
    prompt = body.get("prompt")
    n = _as_n(body.get("n", 1)) or 1
    if isinstance(prompt, list) and prompt and not all(isinstance(x, int) for x in prompt):
        return len(prompt) * n, True  # list of strings or of token-id lists
    return n, False


def _chat_shape(body: dict) -> tuple[int, bool]:
    return _as_n(body.get("n", 1)) or 1, False


SHAPES = {
    "/generate": _generate_shape,
    "/v1/completions": _completion_shape,
    "/v1/chat/completions": _chat_shape,
}


def sequence_count(route: str, body: dict) -> tuple[int, bool]:
    """(number of generated sequences, is the request a batch) for a body sent to ``route``.

    Raises:
        KeyError: ``route`` is not a generation route.
    """
    return SHAPES[route](body)


def stamp(route: str, body: dict, prefill: Worker) -> list[str]:
    """Add bootstrap_host/port/room (one room per generated sequence) and a ``rid`` to ``body``
    in place.

    Returns:
        The rid prefixes that /abort_request needs to reach every sequence of this request (the
        client's own rid(s) when given, else the router's).
    """
    count, batch = sequence_count(route, body)
    if count == 1 and not batch:
        body["bootstrap_host"] = prefill.bootstrap_host
        body["bootstrap_port"] = prefill.bootstrap_port
        body["bootstrap_room"] = new_room()
    else:
        body["bootstrap_host"] = [prefill.bootstrap_host] * count
        body["bootstrap_port"] = [prefill.bootstrap_port] * count
        body["bootstrap_room"] = [new_room() for _ in range(count)]
    rid = body.get("rid")
    if rid is None:
        rid = body["rid"] = new_rid()
    if isinstance(rid, list):
        return [r for r in rid if isinstance(r, str) and r]
    return [rid] if isinstance(rid, str) and rid else []
