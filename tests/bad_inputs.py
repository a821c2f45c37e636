"""Bad request inputs, generated from the request schemas of every route (tests/test_bad_inputs.py sends them).

The field lists are the engine's own pydantic models (pd.engines.protocol, pd.engines.sampling): per field,
values of every JSON type its annotation does not take (kept only where the model itself refuses them, so a
lax field's coercions, ``"5"`` for an int, are not counted as bad), non-finite numbers as JSON tokens
(``NaN``, ``Infinity``, ``-Infinity``, ``1e400``), a lone surrogate in every string, values deeper than a
parser takes, and the out-of-range values the engine's range checks name. Then what is bad about a body
as a whole: truncated, empty, not UTF-8, not an object, nested 100000 deep, over the size limit, sent as
another content type. The admin, abort and flush routes get theirs from their documented fields.

Every case must be answered 4xx with an OpenAI-style error body; ``Case.status`` pins the status where
only one is right (413, 415, 405, 404).
"""

from __future__ import annotations

import json
import types
import typing
from dataclasses import dataclass
from typing import Any, Optional, Union

import pydantic
from pydantic import BaseModel

from pd.engines.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest
from pd.engines.sampling import SamplingParams

JSON = "application/json"
DEEP = 100_000  # nesting levels: far past orjson's 1024 and the interpreter's recursion limit
BODY_LIMIT = 32 * 1024 * 1024  # bytes: the router's --max-payload-size and the engines' --max-body-bytes defaults

GOOD = {
    "/generate": {"text": "hi", "sampling_params": {"max_new_tokens": 2, "temperature": 0}},
    "/v1/completions": {"prompt": "hi", "max_tokens": 2, "temperature": 0},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 2,
                             "temperature": 0},
}
MODELS: dict[str, type[BaseModel]] = {
    "/generate": GenerateRequest, "/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
}
# Fields the router replaces with its own (rooms and ids): bad values there are only the engine's to refuse.
ROUTER_OWNED = frozenset({"rid", "bootstrap_host", "bootstrap_port", "bootstrap_room"})
# Out of range for the engine's checks (SamplingParams.validate_for, engine_core.validate, openai_api,
# protocol.check_logprobs), against builtin:tiny (384 tokens, a 2048-token context).
OUT_OF_RANGE: dict[str, list] = {
    "max_new_tokens": [0, -1, 10**30], "max_tokens": [0, -3, 10**30], "max_completion_tokens": [0, 10**30],
    "min_new_tokens": [-1, 5], "min_tokens": [-1, 5], "temperature": [-0.5], "top_p": [0, 1.5, -1],
    "top_k": [0, -2], "min_p": [-0.1, 1.5], "frequency_penalty": [2.5, -3], "presence_penalty": [3, -2.5],
    "repetition_penalty": [0, 2.5, -1], "n": [0, -1, 10**6, 10**30], "top_logprobs_num": [-1, 10**6],
    "logprobs": [-1, 10**6], "top_logprobs": [10**6], "logprob_start_len": [10**6],
    "stop_token_ids": [[-1], [10**9]],
    "logit_bias": [{"-5": 1.0}, {"x": 1.0}, {"99999": 1.0}, {"5": 1e308, "6": 1e308}],
    "input_ids": [[], [-1], [10**9], [[]], [0] * 5000], "bootstrap_room": [-1, 2**64],
    "model": ["no-such-model"],
}
# Sent with these fields so the checks named above run at all (top_logprobs_num needs return_logprob).
NEEDS = {"top_logprobs_num": {"return_logprob": True}, "logprob_start_len": {"return_logprob": True},
         "top_logprobs": {"logprobs": True}}
SURROGATE = "\ud800"


@dataclass(frozen=True)
class Case:
    """One bad request.

    Attributes:
        name: ``route/field/what`` (the pytest id).
        route: the path.
        body: the raw body bytes.
        content_type: the Content-Type header, None for none.
        method: HTTP method.
        status: the one right status, or None for any 4xx.
        router: send it through the router (False: its bad value sits in a field the router replaces).
        engine: send it to an engine directly.
        query: a query string (``timeout=...``), without the ``?``.
    """

    name: str
    route: str
    body: bytes
    content_type: Optional[str] = JSON
    method: str = "POST"
    status: Optional[int] = None
    router: bool = True
    engine: bool = True
    query: str = ""


def dumps(obj: Any) -> bytes:
    """JSON bytes as Python writes them: NaN/Infinity as tokens, lone surrogates as ``\\ud800`` escapes."""
    return json.dumps(obj, allow_nan=True).encode()


# ---- the JSON types a field's annotation takes -----------------------------------------------------
def json_kinds(annotation) -> set[str]:
    """The JSON kinds (``null int float bool str list dict``) that ``annotation`` admits at its top level."""
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        return set().union(*(json_kinds(a) for a in typing.get_args(annotation)))
    if annotation is type(None):
        return {"null"}
    if annotation is Any:
        return {"null", "int", "float", "bool", "str", "list", "dict"}
    if origin is list or annotation is list:
        return {"list"}
    if origin is dict or annotation is dict or (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
        return {"dict"}
    return {{int: "int", float: "float", bool: "bool", str: "str"}[annotation]}


# One value of each JSON kind, chosen so that no lax coercion turns it into a good value of another kind.
WRONG_TYPE = {"null": None, "int": 7, "float": 2.5, "bool": True, "str": "not-a-value", "list": [["x"], {"y": 1}],
              "dict": {"k": {"k": [1]}}}


def _refused(model: type[BaseModel], body: dict) -> bool:
    try:
        model.model_validate(body)
    except pydantic.ValidationError:
        return True
    return False


def _numeric(kinds: set[str]) -> bool:
    return bool(kinds & {"int", "float"})


def _with(base: dict, path: tuple[str, ...], value) -> dict:
    """A deep copy of ``base`` with ``path`` (field, or sampling_params then field) set to ``value``."""
    body = json.loads(json.dumps(base))
    target = body
    for key in path[:-1]:
        target = target.setdefault(key, {})
    target[path[-1]] = value
    return body


def _field_cases(route: str, model: type[BaseModel], path: tuple[str, ...], field: str, annotation,
                 validate) -> list[Case]:
    """Every bad value of one field: wrong types, non-finite numbers, lone surrogates, deep values, out of range."""
    kinds = json_kinds(annotation)
    name = f"{route}/{'.'.join(path)}"
    router = field not in ROUTER_OWNED
    base = dict(GOOD[route], **NEEDS.get(field, {}))
    if field == "input_ids":  # the other of the two prompt fields
        base = {k: v for k, v in base.items() if k != "text"}
    out: list[Case] = []

    def add(what: str, value, raw: Optional[bytes] = None) -> None:
        body = raw if raw is not None else dumps(_with(base, path, value))
        out.append(Case(f"{name}/{what}", route, body, router=router))

    for kind, value in WRONG_TYPE.items():
        if kind not in kinds and validate(_with(base, path, value)):
            add(f"type-{kind}", value)
    if _numeric(kinds):
        for token in ("NaN", "Infinity", "-Infinity", "1e400", "-1e400"):
            marker = "__NUMBER__"
            raw = dumps(_with(base, path, marker)).replace(f'"{marker}"'.encode(), token.encode())
            add(f"number-{token}", None, raw)
    if "str" in kinds:
        add("surrogate", SURROGATE + "x")
    if kinds & {"list", "dict"}:
        marker = "__DEEP__"
        raw = dumps(_with(base, path, marker)).replace(f'"{marker}"'.encode(), b"[" * DEEP + b"]" * DEEP)
        add("deep", None, raw)
    for i, value in enumerate(OUT_OF_RANGE.get(field, [])):
        add(f"range{i}-{str(value)[:12]}", value)
    return out


def schema_cases() -> list[Case]:
    """Per generation route and per field of its request model (and of SamplingParams for /generate's
    ``sampling_params``), every bad value of that field."""
    out: list[Case] = []
    for route, model in MODELS.items():
        def validate(body, model=model):
            return _refused(model, body)

        for field, info in model.model_fields.items():
            if field == "sampling_params":
                continue
            out += _field_cases(route, model, (field,), field, info.annotation, validate)
    for field, info in SamplingParams.model_fields.items():
        def validate(body):
            return _refused(SamplingParams, body["sampling_params"])

        out += _field_cases("/generate", SamplingParams, ("sampling_params", field), field, info.annotation, validate)
    # n is a sampling_params key the engine reads itself (SamplingParams has no field for it); strict, as SGLang's
    out += _field_cases("/generate", SamplingParams, ("sampling_params", "n"), "n", int,
                        lambda body: not isinstance(body["sampling_params"]["n"], int)
                        or isinstance(body["sampling_params"]["n"], bool))
    sp = GOOD["/generate"]["sampling_params"]
    for what, params in {"unknown-key": dict(sp, max_new_token=5), "unsupported-key": dict(sp, regex="a+"),
                         "list-length": [sp, sp], "n-disagree": [dict(sp, n=1), dict(sp, n=2)]}.items():
        body = dict(GOOD["/generate"], sampling_params=params)
        if what == "n-disagree":
            body["text"] = ["a", "b"]
        out.append(Case(f"/generate/sampling_params/{what}", "/generate", dumps(body)))
    out += _message_cases()
    return out


def _message_cases() -> list[Case]:
    """The chat messages' own fields: role, content (a string or text parts)."""
    route = "/v1/chat/completions"
    bad_messages = {
        "role-unknown": [{"role": "wizard", "content": "hi"}], "role-type": [{"role": 5, "content": "hi"}],
        "role-missing": [{"content": "hi"}], "content-type": [{"role": "user", "content": 5}],
        "part-image": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        "part-text-type": [{"role": "user", "content": [{"type": "text", "text": 5}]}],
        "part-text-list": [{"role": "user", "content": [{"type": "text", "text": ["a"]}]}],
        "part-not-object": [{"role": "user", "content": ["hi"]}], "message-not-object": ["hi"],
        "empty": [], "surrogate-content": [{"role": "user", "content": SURROGATE}],
        "surrogate-part": [{"role": "user", "content": [{"type": "text", "text": "a" + SURROGATE}]}],
        "surrogate-extra": [{"role": "user", "content": "hi", "name": SURROGATE}],
        "surrogate-key": [{"role": "user", "content": "hi", SURROGATE: 1}],
        "oversized": [{"role": "user", "content": "x" * 200_000}],
    }
    return [Case(f"{route}/messages/{what}", route, dumps(dict(GOOD[route], messages=m)))
            for what, m in bad_messages.items()]


def body_cases() -> list[Case]:
    """What is bad about a generation body as a whole, per route."""
    out: list[Case] = []
    for route, good in GOOD.items():
        raw = dumps(good)
        bad = {
            "empty": b"", "whitespace": b"  \n", "null": b"null", "array": b"[1, 2]", "string": b'"hi"', "number": b"5",
            "true": b"true", "garbage": b"hello", "trailing": raw + b" }", "two-objects": raw + raw,
            "single-quotes": raw.replace(b'"', b"'"), "invalid-utf8": raw[:-1] + b', "x": "\xff\xfe"}',
            "utf16": json.dumps(good).encode("utf-16"), "bom": b"\xef\xbb\xbf" + raw, "nul": b"\x00" + raw,
            "deep-arrays": b"[" * DEEP + b"]" * DEEP, "deep-objects": b'{"a":' * DEEP + b"1" + b"}" * DEEP,
            "deep-unclosed": b"[" * DEEP, "surrogate-key": dumps(dict(good, **{SURROGATE: 1})),
            "nan-extra-field": raw[:-1] + b', "unknown": NaN}',
            "big-exponent-extra-field": raw[:-1] + b', "u": 1e99999}',
        }
        for cut in sorted({1, 2, len(raw) // 3, len(raw) // 2, len(raw) - 2, len(raw) - 1}):
            bad[f"truncated-{cut}"] = raw[:cut]
        out += [Case(f"{route}/body/{what}", route, body) for what, body in bad.items()]
        for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                      "application/xml", "text/json", "application/jsonl", "image/png"):
            out.append(Case(f"{route}/content-type/{ctype.split(';')[0]}", route, raw, content_type=ctype, status=415))
        out.append(Case(f"{route}/method/GET", route, b"", method="GET", status=405))
        out.append(Case(f"{route}/method/PUT", route, raw, method="PUT", status=405))
    # one byte over the limit: the router and the engines both answer 413 (once: 32 MiB a send)
    raw = dumps(GOOD["/generate"])
    pad = BODY_LIMIT + 1 - len(raw) - len(b', "pad": ""')
    out.append(Case("/generate/body/over-limit", "/generate", raw[:-1] + b', "pad": "' + b"x" * pad + b'"}',
                    status=413))
    return out


def stream_cases(cases: list[Case]) -> list[Case]:
    """The out-of-range cases (refused after parsing, by the engine's checks) again with ``"stream": true``: the
    error must come before the 200 of a stream, as a plain 4xx, never a 200 whose first event is the error."""
    out = []
    for c in cases:
        if "/range" not in c.name:
            continue
        try:
            body = json.loads(c.body)
        except ValueError:
            continue
        body["stream"] = True
        out.append(Case(c.name + "+stream", c.route, dumps(body), router=c.router, engine=c.engine))
    return out


def other_route_cases() -> list[Case]:
    """The engine's /abort_request and /flush_cache, the router's /flush_cache and admin API."""
    out = []
    aborts = {"rid-int": {"rid": 5}, "rid-list-of-int": {"rid": ["a", 5]}, "abort_all-string": {"abort_all": "false"},
              "abort_all-int": {"abort_all": 1}, "array": [1], "surrogate": {"rid": SURROGATE}}
    for what, body in aborts.items():
        out.append(Case(f"/abort_request/{what}", "/abort_request", dumps(body), router=False))
    out.append(Case("/abort_request/deep", "/abort_request", b"[" * DEEP + b"]" * DEEP, router=False))
    out.append(Case("/abort_request/nan", "/abort_request", b'{"rid": NaN}', router=False))
    out.append(Case("/abort_request/text-plain", "/abort_request", b'{"rid": "x"}', "text/plain", status=415,
                    router=False))
    for value in ("soon", "nan", "-1", "inf", "-inf", "1e400"):
        out.append(Case(f"/flush_cache/timeout-{value}", "/flush_cache", b"", query=f"timeout={value}"))
    admin = {"/workers": ("url", "worker_type", "bootstrap_port"), "/workers/drain": ("url", "timeout_secs"),
             "/workers/activate": ("url",)}
    for route, fields in admin.items():
        # a prefill: its bootstrap_port is checked (a decode's is ignored, and this body would add a worker)
        good = {"url": "http://127.0.0.1:9", "worker_type": "prefill", "bootstrap_port": 9, "timeout_secs": 0}
        good = {k: v for k, v in good.items() if k in fields}
        for field in fields:
            for kind, value in WRONG_TYPE.items():
                if field == "timeout_secs" and kind in ("int", "float"):
                    continue
                if field == "bootstrap_port" and kind in ("int", "float", "bool"):
                    continue  # a port (a float or bool one is taken as int: not a case here)
                out.append(Case(f"{route}/{field}/type-{kind}", route, dumps(dict(good, **{field: value})),
                                engine=False))
            for token in ("NaN", "Infinity", "1e400"):
                raw = dumps(dict(good, **{field: "__N__"})).replace(b'"__N__"', token.encode())
                out.append(Case(f"{route}/{field}/number-{token}", route, raw, engine=False))
        for what, raw in {"empty-object": b"{}", "array": b"[]", "truncated": b'{"url": ', "deep": b"[" * DEEP,
                          "deep-closed": b"[" * DEEP + b"]" * DEEP, "not-utf8": b'{"url": "\xff"}',
                          "url-scheme": dumps(dict(good, url="ftp://127.0.0.1:9")),
                          "url-metadata": dumps(dict(good, url="http://169.254.169.254:80")),
                          "url-credentials": dumps(dict(good, url="http://user:pw@127.0.0.1:9")),
                          "url-surrogate": dumps(dict(good, url="http://" + SURROGATE))}.items():
            out.append(Case(f"{route}/body/{what}", route, raw, engine=False))
    out.append(Case("/workers/delete-unknown", "/workers", b"", method="DELETE", query="url=http://127.0.0.1:9",
                    engine=False))
    out.append(Case("/workers/delete-no-url", "/workers", b"", method="DELETE", engine=False))
    out.append(Case("/no-such-route", "/no/such/route", b"{}", status=404))
    return out


def all_cases() -> list[Case]:
    """Every generated case (several hundred), names unique."""
    schema = schema_cases()
    cases = schema + stream_cases(schema) + body_cases() + other_route_cases()
    names = [c.name for c in cases]
    assert len(names) == len(set(names)), [n for n in names if names.count(n) > 1]
    return cases
