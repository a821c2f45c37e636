"""JSON of request bodies on the hot path: orjson (about 5x the standard library's speed on the
router's bodies), with the standard library as the fallback for what orjson refuses.

orjson refuses ``NaN``/``Infinity`` literals, numbers beyond the float range and lone UTF-16
surrogates when parsing, and integers beyond 64 bits when encoding. The fallback
(pd.util.jsonbody, shared with the engines) refuses the first three too, naming the field, so they
are a 400 at the router and never reach a worker; it also turns a nesting too deep to parse into a
``ValueError``. One difference stays: orjson parses an integer literal beyond 64 bits as a float.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

from pd.util import jsonbody


def parse(raw: bytes) -> tuple[Any, bool]:
    """(the JSON value of ``raw``, whether orjson may encode it again).

    Raises:
        ValueError: ``raw`` is not JSON (``UnicodeDecodeError`` for bytes that are not UTF-8, a
            ``jsonbody.BadJSON`` naming the field for a non-finite number or a lone surrogate).
    """
    try:
        return orjson.loads(raw), True
    except orjson.JSONDecodeError:
        return jsonbody.loads(raw), False  # big integers, or a real error


def encode(obj: Any, fast: bool = True) -> bytes:
    """``obj`` as compact UTF-8 JSON bytes; ``fast`` False (or an integer beyond 64 bits) takes
    the standard library (``NaN`` stays ``NaN``, surrogates are escaped)."""
    if fast:
        try:
            return orjson.dumps(obj)
        except TypeError:
            pass
    return json.dumps(obj, separators=(",", ":")).encode()


def truthy(value) -> bool:
    """A request field's truth as the engines' pydantic models read it: ``"true"``/``"false"`` strings
    included (``bool("false")`` would be True)."""
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on", "t", "y")
    return bool(value)
