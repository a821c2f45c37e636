"""OpenAI-API details of the reference engine (null mode): stream shapes, logprob entries."""

import re

import httpx
import pytest

from pdclient import parse_sse


async def post(engine, route, body):
    async with httpx.AsyncClient(timeout=60) as c:
        r = await c.post(engine.url + route, json=body)
    assert r.status_code == 200, r.text
    return parse_sse(r.content) if body.get("stream") else r.json()


def openai_body(route, **extra):
    if route == "/v1/completions":
        body = {"prompt": ["Once upon a time", "def main():"]}
    else:
        body = {"messages": [{"role": "user", "content": "Once upon a time"}]}
    return {"model": "builtin:tiny", "max_tokens": 6, "temperature": 0, "n": 2, "stream": True, **body, **extra}


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
async def test_stream_with_include_usage_has_null_usage_until_the_usage_chunk(engines, route):
    """OpenAI: with ``stream_options.include_usage`` every chunk but the last carries ``"usage": null``;
    the last has the usage and empty ``choices``."""
    chunks = await post(engines["null"], route, openai_body(route, stream_options={"include_usage": True}))
    assert chunks[-1] == "[DONE]"
    *body, last = chunks[:-1]
    assert body and all("usage" in c and c["usage"] is None for c in body), body
    assert all(c["choices"] for c in body)
    assert last["choices"] == [] and last["usage"]["completion_tokens"] > 0
    assert last["usage"]["total_tokens"] == last["usage"]["prompt_tokens"] + last["usage"]["completion_tokens"]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("options", [None, {"include_usage": False}])
async def test_stream_without_include_usage_has_no_usage_key(engines, route, options):
    chunks = await post(engines["null"], route, openai_body(route, stream_options=options))
    assert chunks[-1] == "[DONE]" and len(chunks) > 2
    assert all("usage" not in c and c["choices"] for c in chunks[:-1]), chunks


SPECIAL = re.compile(r"<(extra_id_\d+|pad|/s|unk)>")


def expected_bytes(token: str) -> list[int]:
    """The bytes a logprob token string names: ``bytes:\\xHH...`` escapes, else the text's UTF-8."""
    if token.startswith("bytes:"):
        hexes = token.removeprefix("bytes:").split("\\x")
        assert hexes[0] == "" and all(len(h) == 2 for h in hexes[1:]), token
        return [int(h, 16) for h in hexes[1:]]
    return list(token.encode("utf-8"))


async def test_completion_logprobs_of_byte_tokens_have_distinct_keys(engines):
    """The built-in model's bytes 0x80-0xFF are not text alone: each is ``bytes:\\xHH``, so the
    top_logprobs keys stay distinct and the greedy (top-1) token keeps its own entry."""
    body = {"model": "builtin:tiny", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "logprobs": 5}
    lp = (await post(engines["null"], "/v1/completions", body))["choices"][0]["logprobs"]
    byte_keys = set()
    for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert len(top) == 5, top  # no two entries share a key
        assert top[token] == value  # the greedy token is the top-1 entry, under its own key
        byte_keys |= {k for k in top if k.startswith("bytes:")}
    assert byte_keys and all(len(expected_bytes(k)) == 1 and expected_bytes(k)[0] >= 0x80 for k in byte_keys)
    assert any(t.startswith("bytes:") for t in lp["tokens"]), lp["tokens"]


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_logprobs_of_byte_tokens_carry_their_bytes(engines, stream):
    """Chat logprob entries of bytes 0x80-0xFF carry ``bytes: [0xHH]`` and distinct token strings; the
    chosen tokens' bytes make up the message. 12 tokens: builtin:tiny's greedy answer has its first high bytes
    at tokens 10 and 11."""
    body = {"model": "builtin:tiny", "messages": [{"role": "user", "content": "Once upon a time"}],
            "max_tokens": 12, "temperature": 0, "logprobs": True, "top_logprobs": 5, "stream": stream}
    out = await post(engines["null"], "/v1/chat/completions", body)
    if stream:
        content = [e for c in out[:-1] for ch in c["choices"] if ch["logprobs"] for e in ch["logprobs"]["content"]]
        text = "".join(ch["delta"].get("content") or "" for c in out[:-1] for ch in c["choices"])
    else:
        content, text = out["choices"][0]["logprobs"]["content"], out["choices"][0]["message"]["content"]
    assert len(content) == 12
    high = 0
    for e in content:
        assert e["bytes"] == expected_bytes(e["token"])
        tops = e["top_logprobs"]
        assert len({t["token"] for t in tops}) == 5, tops
        assert {"token": e["token"], "logprob": e["logprob"], "bytes": e["bytes"]} in tops
        for t in tops:
            assert t["bytes"] == expected_bytes(t["token"])
            high += t["token"].startswith("bytes:") and t["bytes"][0] >= 0x80
    assert high >= 2
    chosen = b"".join(bytes(e["bytes"]) for e in content if not SPECIAL.fullmatch(e["token"]))
    assert chosen.decode("utf-8", errors="ignore") == text
    assert any(e["token"].startswith("bytes:") for e in content)
