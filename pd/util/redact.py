"""Keeping secrets out of logs and answers: one set of rules for engine log lines and for JSON an engine
returns (SGLang's ``/server_info`` carries ``api_key``, ``admin_api_key`` and ``launch_command``).

What counts as a secret:

- a field whose name ends in ``api_key``, ``token``, ``secret`` or ``password`` (``-`` and ``_`` alike, any
  case): ``api_key='k'`` (a ``ServerArgs`` repr), ``'api_key': 'k'`` (a dict repr), ``"api_key": "k"``
  (JSON), ``API_KEY=k``; its value unless it is None/null, a boolean or a number (``max_total_tokens``
  does not end in ``token``; ``bucket_time_to_first_token=[0.1]`` keeps its numbers);
- the value of such a flag: ``--api-key K``, ``--api-key=K``, ``--admin-api-key K``, also as the next
  item of an argv list (``['--api-key', 'K']``, ``["--api-key", "K"]``);
- ``Bearer K`` (an ``Authorization`` header);
- the literal value of each key the caller names, wherever it appears (also in its repr/JSON escaped form).

Each secret becomes ``<redacted>`` (quoted as the original was).
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterable

REDACTED = "<redacted>"

_NAME = r"(?:api[_-]?key|token|secret|password)"
_SECRET_NAME = re.compile(rf"{_NAME}$", re.IGNORECASE)
_SECRET_FLAG = re.compile(rf"^--(?:[\w-]*-)?{_NAME.replace('[_-]?', '-')}$", re.IGNORECASE)
_KEEP = re.compile(r"^(?:None|null|True|False|true|false|-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)$")

# name, separator (with the name's closing quote), value: quoted (repr/JSON) or bare
_FIELD = re.compile(
    rf"""(?P<name>(?<![\w-])[\w.-]*?{_NAME})(?P<sep>['"]?\s*[:=]\s*)"""
    r"""(?P<val>'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"|[^\s,;)}\]'"\[({<][^\s,;)}\]'"]*)""",
    re.IGNORECASE)
# --flag VALUE / --flag=VALUE in a command line, and '--flag', 'VALUE' in a repr'd or JSON list
_FLAG = re.compile(
    rf"""(?P<flag>--(?:[\w-]*-)?{_NAME.replace('[_-]?', '-')})"""
    r"""(?:(?P<sep>=|\s+)(?P<val>[^\s'"]+)|(?P<lsep>(?P<q>['"])\s*,\s*)(?P<lval>'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"))""",
    re.IGNORECASE)
_BEARER = re.compile(r"(?P<pre>\bBearer\s+)(?P<val>[^\s'\",]+)", re.IGNORECASE)


def secret_name(name: str) -> bool:
    """Whether a field or option called ``name`` holds a secret (ends in api_key/token/secret/password)."""
    return bool(_SECRET_NAME.search(name.strip().lstrip("-")))


def _keep(value: str) -> bool:
    return bool(_KEEP.match(value))


def _quoted(value: str) -> str:
    """``<redacted>`` in the quotes ``value`` had (none if it had none)."""
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[0] + REDACTED + value[0]
    return REDACTED


def _literal_forms(secrets: Iterable[str | None]) -> list[str]:
    forms = set()
    for s in secrets:
        if s:
            forms.update({s, repr(s)[1:-1], json.dumps(s)[1:-1]})
    return sorted(forms, key=len, reverse=True)


def redact_text(text: str, secrets: Iterable[str | None] = ()) -> str:
    """``text`` (a log line, a command line, any string) with every secret replaced by ``<redacted>``
    (the rules are the module's); ``secrets`` are literal values to remove wherever they appear."""
    for form in _literal_forms(secrets):
        text = text.replace(form, REDACTED)

    def field(m: re.Match) -> str:
        val = m["val"]
        if _keep(val) or val.strip("'\"") == REDACTED:
            return m[0]
        return m["name"] + m["sep"] + _quoted(val)

    def flag(m: re.Match) -> str:
        if m["val"] is not None:
            return m[0] if _keep(m["val"]) else m["flag"] + m["sep"] + REDACTED
        return m["flag"] + m["lsep"] + _quoted(m["lval"])

    text = _FLAG.sub(flag, text)
    text = _FIELD.sub(field, text)
    return _BEARER.sub(lambda m: m["pre"] + REDACTED, text)


def _secret_value(value: Any) -> bool:
    """Whether a value under a secret name is worth hiding: not None, a boolean, a number or numbers."""
    if value is None or isinstance(value, (bool, int, float)):
        return False
    if isinstance(value, (list, tuple)):
        return any(_secret_value(v) for v in value)
    return True


def _scrub_argv(items: list, secrets: Iterable[str | None]) -> list:
    out, hide_next = [], False
    for item in items:
        if hide_next and isinstance(item, str):
            out.append(REDACTED)
            hide_next = False
            continue
        hide_next = False
        if isinstance(item, str) and item.startswith("--"):
            flag, eq, _ = item.partition("=")
            if _SECRET_FLAG.match(flag):
                out.append(flag + "=" + REDACTED if eq else item)
                hide_next = not eq
                continue
        out.append(scrub(item, secrets))
    return out


def scrub(value: Any, secrets: Iterable[str | None] = ()) -> Any:
    """A copy of JSON-like ``value`` without secrets, recursively: a dict's secret-named fields become
    ``<redacted>`` (unless None, booleans or numbers), the item after a secret flag in a list
    (``["--api-key", "K"]``) and ``--api-key=K`` items too, and every string goes through
    :func:`redact_text` (so a ``launch_command`` string loses its ``--api-key K``)."""
    secrets = list(secrets)
    if isinstance(value, dict):
        return {k: (REDACTED if isinstance(k, str) and secret_name(k) and _secret_value(v) else scrub(v, secrets))
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return _scrub_argv(list(value), secrets)
    if isinstance(value, str):
        return redact_text(value, secrets)
    return value
