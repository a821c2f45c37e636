"""Checks of request bodies that JSON syntax alone lets through, shared by the router and the engines.

Python's ``json`` (and so FastAPI and SGLang) accepts three things that are not JSON text a model can
serve (RFC 8259, sections 6 and 8.2): the literals ``NaN``/``Infinity``/``-Infinity`` and numbers beyond
the float range (``1e400`` parses as ``inf``), and ``\\ud800``-style escapes of lone UTF-16 surrogates,
which make a Python string that cannot be encoded as UTF-8 (a tokenizer raises on it, and so does
encoding an answer that echoes it). Such a body must be a 400 naming the field, not a 500 from
wherever the value ends up. It also parses JSON nested deeper than the interpreter's recursion limit
into a ``RecursionError``; ``loads`` makes that a ``ValueError`` like any other malformed body.

The walk is iterative (a deep body that did parse must not overflow the stack here) and runs only when
the parse saw a non-finite number or the raw bytes contain a surrogate escape, so a well-formed body
costs one regular-expression scan.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Optional

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


class BadJSON(ValueError):
    """A body that parsed but carries a value no field can take.

    Attributes:
        path: the value's place in the body (``sampling_params.temperature``, ``messages.0.content``;
            ``""`` for the whole body).
    """

    def __init__(self, message: str, path: str):
        super().__init__(message)
        self.path = path


def loads(raw: bytes) -> Any:
    """``raw`` (UTF-8, as RFC 8259 requires between systems) as JSON, refusing what ``first_invalid`` finds.

    Raises:
        BadJSON: a non-finite number or a lone surrogate (names the field).
        ValueError: not UTF-8 (``UnicodeDecodeError``), not JSON, or nested too deeply to parse.
    """
    seen = []

    def number(token: str) -> float:  # NaN, Infinity, -Infinity, and every float literal (1e400 is inf)
        value = float(token)
        if not math.isfinite(value):
            seen.append(token)
        return value

    # Decoded here, strictly: json.loads(bytes) would also take UTF-16/32, whose surrogates need no escape.
    text = raw.decode("utf-8")
    try:
        obj = json.loads(text, parse_constant=number, parse_float=number)
    except RecursionError:
        raise ValueError("the JSON body is nested too deeply") from None
    strings = _SURROGATE_ESCAPE.search(raw) is not None
    if seen or strings:
        check(obj, strings)
    return obj


def check(obj: Any, strings: bool = True) -> None:
    """Raise BadJSON for the first non-finite number or (``strings``) lone surrogate in a parsed ``obj``."""
    found = first_invalid(obj, strings)
    if found is not None:
        path, reason = found
        raise BadJSON(f"{path or 'the body'}: {reason}", path)


def first_invalid(obj: Any, strings: bool = True) -> Optional[tuple[str, str]]:
    """(dotted path, reason) of the first non-finite float, or (``strings``) string or object key with a
    lone surrogate, in a parsed JSON value; None when there is none. Iterative, any depth."""
    stack: list[tuple[Any, str]] = [(obj, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, float):
            if not math.isfinite(value):
                return path, f"{value!r} is not a finite number (JSON has no NaN or Infinity)"
        elif isinstance(value, str):
            if strings and not _utf8(value):
                return path, "the string has a lone UTF-16 surrogate (\\ud800-\\udfff), which is not Unicode text"
        elif isinstance(value, dict):
            items = list(value.items())
            for key, item in reversed(items):
                sub = f"{path}.{key}" if path else str(key)
                if strings and not _utf8(key):
                    return path, "an object key has a lone UTF-16 surrogate (\\ud800-\\udfff): not Unicode text"
                stack.append((item, sub))
        elif isinstance(value, list):
            for i in range(len(value) - 1, -1, -1):
                stack.append((value[i], f"{path}.{i}" if path else str(i)))
    return None


def _utf8(s: str) -> bool:
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False
