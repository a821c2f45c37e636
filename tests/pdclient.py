"""A minimal PD client for engine tests: what a router does, per the wire protocol of docs/design.md."""

from __future__ import annotations

import asyncio
import json
import random

import httpx


def add_rooms(body: dict, host: str, port: int, count: int | None) -> dict:
    """Bootstrap fields: one fresh room per generated sequence (``count`` None = scalar)."""
    b = dict(body, bootstrap_host=host, bootstrap_port=port)
    if count is None:
        b["bootstrap_room"] = random.randrange(2**63)
    else:
        b["bootstrap_room"] = [random.randrange(2**63) for _ in range(count)]
        b["bootstrap_host"] = [host] * count
        b["bootstrap_port"] = [port] * count
    return b


def parse_sse(raw: bytes) -> list:
    """``data:`` payloads of an SSE body; ``"[DONE]"`` kept as the string."""
    out = []
    for block in raw.decode().split("\n\n"):
        block = block.strip()
        if not block:
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def merge_logprobs(decode_obj, prefill_obj):
    """Prepend the prefill's input_token_logprobs (and input_top_logprobs) to decode's."""
    if isinstance(decode_obj, list):
        return [merge_logprobs(d, p) for d, p in zip(decode_obj, prefill_obj)]
    dm, pm = decode_obj.get("meta_info", {}), prefill_obj.get("meta_info", {})
    for key in ("input_token_logprobs", "input_top_logprobs"):
        if key in dm and key in pm:
            dm[key] = pm[key] + dm[key]
    return decode_obj


async def pd_post(client: httpx.AsyncClient, prefill, decode, route: str, body: dict, rooms: int | None):
    """POST to both sides concurrently. Returns (status, decode body (parsed JSON or SSE list),
    prefill body). The prefill response is read to the end."""
    b = add_rooms(body, "127.0.0.1", prefill.bootstrap_port, rooms)

    async def one(url):
        r = await client.post(url + route, json=b)
        return r.status_code, r.content

    (ps, pbody), (ds, dbody) = await asyncio.gather(one(prefill.url), one(decode.url))
    stream = body.get("stream", False)
    dparsed = parse_sse(dbody) if stream and ds == 200 else json.loads(dbody)
    pparsed = parse_sse(pbody) if stream and ps == 200 else json.loads(pbody)
    return ds, dparsed, (ps, pparsed)


VOLATILE = ("id", "e2e_latency", "created", "cached_tokens")


def strip_volatile(obj):
    """Drop fields that legitimately differ between two runs or two engines: ids, timings, and cached tokens
    (what each engine's radix cache holds from the requests it served before; the prefix cache tests check them)."""
    if isinstance(obj, list):
        return [strip_volatile(x) for x in obj]
    if isinstance(obj, dict):
        return {k: strip_volatile(v) for k, v in obj.items() if k not in VOLATILE}
    return obj


def final_generate_chunks(chunks):
    """Last cumulative chunk per index of a /generate stream."""
    assert chunks[-1] == "[DONE]"
    last = {}
    for c in chunks[:-1]:
        last[c.get("index", 0)] = c
    return [last[i] for i in sorted(last)]


async def stream_then_disconnect(client: httpx.AsyncClient, url: str, body: dict, chunks: int = 5) -> None:
    """Open an SSE stream, read ``chunks`` data events, then drop the connection (a client that
    goes away mid-stream)."""
    async with client.stream("POST", url, json=body) as r:
        assert r.status_code == 200
        seen = 0
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                seen += 1
                if seen == chunks:
                    return
