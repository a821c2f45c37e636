"""Stamping a request body with the PD bootstrap fields: one fresh bootstrap room per generated
sequence, the chosen prefill's bootstrap host and port, and request ids the router can abort by.

How many sequences a body generates (SGLang's expansion, which the reference engine follows:
P prompts x ``n`` samples, prompt-major, lists of length P*n indexed by ``p * n + s``):

- ``/generate``: P = len(text) for a list of strings, len(input_ids) for a list of token-id lists,
  else 1 (not a batch); ``n`` from ``sampling_params.n`` (a dict, or a list of dicts that must agree).
- ``/v1/completions``: P = len(prompt) for a list of strings or of token-id lists; a string or one
  flat list of ints is one prompt (not a batch); times ``n``.
- ``/v1/chat/completions``: one prompt, ``n`` samples.

The same shape is what the router's admission caps check (pd.router.admission).

A single sequence of a non-batch request gets scalar fields; anything else gets lists of length
P*n. Client-supplied bootstrap fields are always replaced (a client must not pick rooms).

Request ids: the router owns them. SGLang's /abort_request finds a request by its exact id first
(tokenizer manager), so the router must know every sequence's id, and it also aborts every request
whose id starts with the given one, so a client that picked its own ``rid`` could name a prefix of
other clients' ids (``"p"`` matches every ``pdr-...``) and have the router abort them all when it
disconnects. So a client's ``rid`` is replaced like its bootstrap fields, and the router sends one id
per sequence: ``pdr-<hex>`` (128 random bits) for a single sequence, a list ``pdr-<hex>-<i>`` for a
batch with ``n`` 1 (``i`` zero-padded to one width: no id is a prefix of another, so a
prefix-matching abort of one never hits a sibling). The router never sends ``n > 1``: it fans such a
request out into ``n`` single-sample requests (pd.router.fanout), because SGLang gives every sample
of a prompt that prompt's one room and renames the samples' ids; so every sequence sent has its own
room and an id the router can abort. (Called with ``n > 1``, ``assign_rids`` sends a scalar
``pdr-<hex>``, which both engines expand to ``pdr-<hex>_<i>``.) The client's request id is the
``X-Request-Id`` header (``--request-id-headers``), which reaches both workers.
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional

from pd.router.workers import Worker

ROOM_LIMIT = 2**63  # rooms are drawn from [0, 2^63): they fit a signed 64-bit int everywhere
_POOL_BYTES = 4096  # one getrandom() per 4 KiB: ~170 single-sequence requests (a room and an id each)


class _Entropy:
    """Bytes of the OS's CSPRNG (``os.urandom``), read 4 KiB at a time and handed out once each.

    Rooms and ids must be unguessable: a room a third party predicts can be registered first on a
    prefill's bootstrap server (SGLang's takes no key), and ids come back to every client in
    ``X-Request-Id``. With a Mersenne Twister, 156 ids revealed its state and so every later room and
    id. Bytes of a CSPRNG reveal nothing of the others. One syscall per 4 KiB keeps the cost off the hot
    path (a ``secrets`` call per draw is a syscall each, several per request). A forked child drops the
    buffer its parent holds, so the two never hand out the same bytes.
    """

    __slots__ = ("buf", "pos")

    def __init__(self) -> None:
        self.buf = b""
        self.pos = 0

    def take(self, n: int) -> bytes:
        """``n`` (<= 4096) fresh bytes."""
        if self.pos + n > len(self.buf):
            self.buf, self.pos = os.urandom(_POOL_BYTES), 0
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def drop(self) -> None:
        self.buf, self.pos = b"", 0


_entropy = _Entropy()
os.register_at_fork(after_in_child=_entropy.drop)


def new_room() -> int:
    """A fresh bootstrap room in [0, 2^63) from the OS's CSPRNG."""
    return int.from_bytes(_entropy.take(8), "little") >> 1


def new_rid() -> str:
    """A router-generated request id: ``pdr-`` and 32 hex digits (128 bits of the OS's CSPRNG)."""
    return "pdr-" + _entropy.take(16).hex()


MAX_REQUEST_ID = 128  # characters of a client's X-Request-Id the router keeps (longer: a fresh id)


def client_request_id(value: Optional[bytes]) -> Optional[str]:
    """A client's ``X-Request-Id`` header value as the id to echo and forward, or None (then the router makes
    one): kept only up to ``MAX_REQUEST_ID`` characters of visible ASCII, since it is echoed in every answer
    and sent to both workers."""
    if not value or len(value) > MAX_REQUEST_ID:
        return None
    text = value.decode("latin-1")
    return text if text.isascii() and text.isprintable() else None


def _as_n(value) -> Optional[int]:
    """``n`` as an int when it is one the engines take as one: an int, an integral float or a string of
    digits (the OpenAI routes' pydantic models coerce those), else None (a bool, ``"three"``, ``0``: left
    for the engine to reject with a proper 400)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    elif isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    return value if isinstance(value, int) and value >= 1 else None


class Shape(NamedTuple):
    """What a generation body asks for.

    Attributes:
        prompts: prompts in the request (1 unless it is a batch).
        n: samples per prompt.
        batch: whether the request is a batch (list-valued fields), even of one prompt.
    """

    prompts: int
    n: int
    batch: bool

    @property
    def sequences(self) -> int:
        """Sequences generated: prompts x n."""
        return self.prompts * self.n


def _generate_shape(body: dict) -> Shape:
    text, ids = body.get("text"), body.get("input_ids")
    if isinstance(text, list):
        prompts, batch = len(text), True
    elif text is None and isinstance(ids, list) and ids and isinstance(ids[0], list):
        prompts, batch = len(ids), True
    else:
        prompts, batch = 1, False
    sp = body.get("sampling_params")
    # A list must agree on n (the engines reject one that does not); the largest is what a cap must see.
    params = sp if isinstance(sp, list) else [sp]
    n = max(((_as_n(p.get("n", 1)) if isinstance(p, dict) else 1) or 1 for p in params), default=1)
    return Shape(prompts, n, batch)


def _completion_shape(body: dict) -> Shape:
    prompt = body.get("prompt")
    n = _as_n(body.get("n", 1)) or 1
    if isinstance(prompt, list) and prompt and not all(isinstance(x, int) for x in prompt):
        return Shape(len(prompt), n, True)  # list of strings or of token-id lists
    return Shape(1, n, False)


def _chat_shape(body: dict) -> Shape:
    return Shape(1, _as_n(body.get("n", 1)) or 1, False)


SHAPES = {
    "/generate": _generate_shape,
    "/v1/completions": _completion_shape,
    "/v1/chat/completions": _chat_shape,
}


def request_shape(route: str, body: dict) -> Shape:
    """The prompts, samples per prompt and batchness of a body sent to ``route``.

    Raises:
        KeyError: ``route`` is not a generation route.
    """
    return SHAPES[route](body)


def sequence_count(route: str, body: dict) -> tuple[int, bool, int]:
    """(number of generated sequences, is the request a batch, samples per prompt ``n``) for a
    body sent to ``route``.

    Raises:
        KeyError: ``route`` is not a generation route.
    """
    shape = SHAPES[route](body)
    return shape.sequences, shape.batch, shape.n


def assign_rids(body: dict, count: int, batch: bool, n: int) -> list[str]:
    """Set ``body["rid"]`` to fresh router ids for one attempt, replacing any client ``rid``, and return
    every sequence's id, in sequence order."""
    base = new_rid()
    if count == 1 and not batch:
        body["rid"] = base
        return [base]
    if n > 1:
        body["rid"] = base
        return [f"{base}_{i}" for i in range(count)]
    width = len(str(count - 1))
    rids = [f"{base}-{i:0{width}d}" for i in range(count)]
    body["rid"] = rids
    return rids


def stamp(body: dict, count: int, batch: bool, prefill: Worker) -> None:
    """Add bootstrap_host/port/room to ``body`` in place: one fresh room per generated sequence."""
    if count == 1 and not batch:
        body["bootstrap_host"] = prefill.bootstrap_host
        body["bootstrap_port"] = prefill.bootstrap_port
        body["bootstrap_room"] = new_room()
    else:
        body["bootstrap_host"] = [prefill.bootstrap_host] * count
        body["bootstrap_port"] = [prefill.bootstrap_port] * count
        body["bootstrap_room"] = [new_room() for _ in range(count)]
