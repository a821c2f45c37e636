"""What the prefill's bootstrap server accepts: strict models of its bodies and the caps a registration must fit.

Validation (everything the port receives is untrusted input): a body is refused over a size cap
before it is parsed (413; ``RegistrationLimits.max_body_bytes``, derived from the longest legitimate
registration, and ``MAX_ABORT_BODY_BYTES``), then parsed by strict pydantic models (``RegisterBody``,
``AbortBody``: no coercion, bool is not an int, unknown fields refused): rooms are ints in [0, 2^63),
page addresses ints in [1, 2^64), strings and dicts bounded. A registration must also fit the
prefill's engine: its ``page_size``, ``num_tokens`` within the context length, a ``decode_prefix_len`` (the
whole pages the decode already holds: a multiple of the page size below ``num_tokens``) and exactly the pages a
decode allocates for the rest of ``num_tokens`` (plus its speculative verify window, at most); once the
prefill's own request for the room is there, ``num_tokens`` must equal its prompt length (checked
again when the request comes after the registration: the room then fails with the reason). An abort
reason is kept to ``MAX_REASON_CHARS`` characters (longer ones are truncated with a marker). A
refusal is a 4xx with the engine's error body ``{"error": {"message", "type", "param", "code"}}``
(``param`` names the field; null for a body over the size cap) plus, as before, ``"status":
"failed", "reason"`` on ``/pd/register`` and ``"ok": false, "reason"`` on ``/pd/abort``; never a 500.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Optional, TypeVar, Union

import pydantic
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StringConstraints

if TYPE_CHECKING:
    from pd.engines.handoff.bootstrap import Registration

ROOM_LIMIT = 2**63  # rooms are ints in [0, 2^63): what the router (and SGLang's) draws
ADDR_LIMIT = 2**64  # page addresses are the decode's uint64 virtual addresses
# Page lists may cover the prompt plus a speculative verify window of at most this many tokens (SGLang's
# --speculative-num-draft-tokens is a handful; the bound only keeps the page-count cap finite).
MAX_SPEC_WINDOW = 1024
# JSON bytes per page address: up to 20 digits (a uint64) and ", ".
ADDR_JSON_BYTES = 22
# Everything of a registration but its two page lists (session id, layouts, speculative settings, keys, spaces).
REGISTRATION_OVERHEAD_BYTES = 16 * 1024
MAX_ABORT_BODY_BYTES = 16 * 1024  # {room, reason}; a reason is kept to MAX_REASON_CHARS anyway
MAX_REASON_CHARS = 1024  # an abort reason longer than this is truncated (with a marker) before it is kept


@dataclass(frozen=True)
class RegistrationLimits:
    """What a registration may ask of this prefill (its engine's settings).

    Attributes:
        max_tokens: the longest prompt (the model's context length).
        page_size: tokens per KV page (``--page-size``; the decode must use the same).
        extra_tokens: the verify window the decode allocates past the prompt with speculative decoding
            (``--speculative-num-draft-tokens``; 0 without).
    """

    max_tokens: int = 131072
    page_size: int = 16
    extra_tokens: int = 0

    def pages_for(self, num_tokens: int) -> int:
        """KV pages for ``num_tokens`` tokens (at least one), as pd.engines.handoff.kv_pool.KVPagePool.pages_for."""
        return max(1, -(-num_tokens // self.page_size))

    @property
    def max_pages(self) -> int:
        """The most pages one legitimate page list has: the longest prompt plus the largest verify window."""
        return self.pages_for(self.max_tokens + max(self.extra_tokens, MAX_SPEC_WINDOW))

    @property
    def max_body_bytes(self) -> int:
        """The body cap of /pd/register: the largest legitimate registration, i.e. both page lists (target's and
        draft's) at ``max_pages`` addresses of ``ADDR_JSON_BYTES`` each, plus ``REGISTRATION_OVERHEAD_BYTES``
        for the rest. The defaults (a 128K-token context at 16-token pages) give 2 x 8256 x 22 + 16 KiB, about
        380 KB; the smallest page size (1 token) at that context would be 5.8 MB, which this cap then allows."""
        return 2 * self.max_pages * ADDR_JSON_BYTES + REGISTRATION_OVERHEAD_BYTES


RoomId = Annotated[StrictInt, Field(ge=0, lt=ROOM_LIMIT)]
_Addr = Annotated[StrictInt, Field(ge=1, lt=ADDR_LIMIT)]
_Count = Annotated[StrictInt, Field(ge=1, lt=ADDR_LIMIT)]
# a value of a layout or of the speculative settings (a flag such as --speculative-adaptive is a bool)
_Scalar = Union[StrictBool, Annotated[StrictInt, Field(ge=-ROOM_LIMIT, lt=ROOM_LIMIT)],
                Annotated[str, StringConstraints(max_length=256)], None]
_SmallDict = Annotated[dict[Annotated[str, StringConstraints(max_length=64)], _Scalar], Field(max_length=32)]


class RegisterBody(BaseModel):
    """The body of ``POST /pd/register`` (the decode's Registration), strictly typed; unknown fields are refused."""

    model_config = ConfigDict(extra="forbid", strict=True)

    room: RoomId
    session_id: Annotated[str, StringConstraints(min_length=1, max_length=256)]  # Mooncake's "host:rpc_port"
    page_addrs: list[_Addr]
    page_bytes: _Count
    page_size: _Count
    layout: _SmallDict
    num_tokens: _Count
    decode_prefix_len: Annotated[StrictInt, Field(ge=0, lt=ADDR_LIMIT)] = 0
    draft_page_addrs: list[_Addr] = []
    draft_page_bytes: Annotated[StrictInt, Field(ge=0, lt=ADDR_LIMIT)] = 0
    draft_layout: Optional[_SmallDict] = None
    speculative: Optional[_SmallDict] = None


class AbortBody(BaseModel):
    """The body of ``POST /pd/abort``, strictly typed; unknown fields are refused."""

    model_config = ConfigDict(extra="forbid", strict=True)

    room: RoomId
    reason: str = "aborted by decode"


class BadBody(Exception):
    """A refused bootstrap request: HTTP ``status``, the reason, and the field at fault (None: the body as a whole)."""

    def __init__(self, status: int, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


M = TypeVar("M", bound=BaseModel)


def parse_body(model: type[M], raw: bytes) -> M:
    """``raw`` (JSON) validated strictly by ``model``.

    Raises:
        BadBody: 400 naming the first bad field (its top-level name), or the body when it is no JSON object.
    """
    try:
        return model.model_validate_json(raw)
    except pydantic.ValidationError as e:
        err = e.errors(include_url=False, include_input=False)[0]
        loc = err.get("loc") or ()
        if err["type"] == "json_invalid":
            raise BadBody(400, f"the body is not valid JSON: {err['msg']}") from None
        if not loc:
            raise BadBody(400, f"the body must be a JSON object ({err['msg']})") from None
        where = ".".join(str(x) for x in loc)
        msg = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
        raise BadBody(400, f"{where}: {msg}", str(loc[0])) from None


def truncate_reason(reason: str) -> str:
    """``reason`` cut to ``MAX_REASON_CHARS`` characters, with a marker saying how much was dropped."""
    if len(reason) <= MAX_REASON_CHARS:
        return reason
    return reason[:MAX_REASON_CHARS] + f"... [truncated {len(reason) - MAX_REASON_CHARS} characters]"


def check_registration(body: RegisterBody, limits: RegistrationLimits) -> None:
    """A registration must fit this prefill: its page size, a prompt within the context length, a cached prefix
    (``decode_prefix_len``: prompt tokens the decode already holds) of whole pages short of the whole prompt, and
    the page lists a decode allocates for the rest of that prompt (no fewer pages than it needs, no more than it
    plus the verify window), with distinct addresses.

    Raises:
        BadBody: 400 naming the field.
    """
    if body.page_size != limits.page_size:
        raise BadBody(400, f"page_size: the decode has {body.page_size}, this prefill {limits.page_size} "
                           "(--page-size must match on both sides)", "page_size")
    if body.num_tokens > limits.max_tokens:
        raise BadBody(400, f"num_tokens: {body.num_tokens} is over the context length of {limits.max_tokens}",
                      "num_tokens")
    cached = body.decode_prefix_len
    if cached % limits.page_size:
        raise BadBody(400, f"decode_prefix_len: {cached} is not a multiple of the page size {limits.page_size} (a "
                           "decode caches whole pages)", "decode_prefix_len")
    if cached >= body.num_tokens:
        raise BadBody(400, f"decode_prefix_len: {cached} must be less than num_tokens {body.num_tokens} (the prefill "
                           "computes at least the prompt's last token)", "decode_prefix_len")
    declared = (body.speculative or {}).get("num_draft_tokens")
    window = declared if isinstance(declared, int) and 0 <= declared <= MAX_SPEC_WINDOW else 0
    # the decode registers pages only past the prefix it already holds
    lo = limits.pages_for(body.num_tokens) - cached // limits.page_size
    hi = limits.pages_for(body.num_tokens + max(window, limits.extra_tokens)) - cached // limits.page_size
    lists = [("page_addrs", body.page_addrs)]
    if body.speculative is not None:
        lists.append(("draft_page_addrs", body.draft_page_addrs))
    elif body.draft_page_addrs:
        raise BadBody(400, "draft_page_addrs: given without speculative settings", "draft_page_addrs")
    for name, addrs in lists:
        if not lo <= len(addrs) <= hi:
            raise BadBody(400, f"{name}: {len(addrs)} pages for {body.num_tokens} tokens past a cached prefix of "
                               f"{cached}; a decode registers {lo}..{hi} (pages of {limits.page_size} tokens)", name)
        if len(set(addrs)) != len(addrs):
            raise BadBody(400, f"{name}: a page address repeats", name)


def check_prompt(reg: "Registration", prompt_tokens: int) -> Optional[str]:
    """Why a room's registration does not match the prefill request's prompt of ``prompt_tokens`` tokens, or None."""
    if reg.num_tokens != prompt_tokens:
        return (f"prompt mismatch: the decode registered {reg.num_tokens} tokens, the prefill tokenized "
                f"{prompt_tokens} (were both sides sent the same request?)")
    return None
