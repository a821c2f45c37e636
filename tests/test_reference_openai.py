"""OpenAI-API details of the reference engine (null mode): stream shapes, logprob entries."""

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
