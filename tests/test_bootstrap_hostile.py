"""Hostile bodies on the prefill's bootstrap server (pd.engines.handoff.bootstrap): each is refused with a 4xx
whose JSON names the field (never a 500 or a traceback, never a long poll), a live room stays bound to its first
registration, a registration whose client left is dropped at once, and the engine still serves the same greedy
output afterwards."""

import asyncio
import json
import random
import time
import uuid

import httpx
import pytest

from conftest import AT_ONCE
from pd.engines.handoff.bootstrap import BootstrapServer
from pd.util.ports import free_port
from pd.util.wait import async_wait_until
from pdclient import add_rooms, pd_post

GREEDY = {"text": "the bootstrap survives", "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
PAGE_SIZE = 16  # the engines' --page-size (its default)
MAX_REASON_CHARS = 1024  # pd.engines.handoff.bootstrap.MAX_REASON_CHARS


def registration(**over) -> dict:
    """A well-formed registration of a fresh room (fake addresses: nothing is ever written there)."""
    reg = {"room": random.randrange(2**63), "session_id": "127.0.0.1:1", "page_addrs": [1 << 30],
           "page_bytes": 4096, "page_size": PAGE_SIZE, "layout": {"num_layers": 2, "dtype": "float32"},
           "num_tokens": 3}
    reg.update(over)
    return reg


def assert_refused(r: httpx.Response, status: int, param, *words: str) -> dict:
    """A refusal: ``status``, the engine's JSON error body naming ``param``, no traceback."""
    assert r.status_code == status, (r.status_code, r.text[:500])
    assert "Traceback" not in r.text and "File \"" not in r.text
    err = r.json()["error"]
    assert err["code"] == status and err["param"] == param, err
    for w in words:
        assert w in err["message"], err["message"]
    return err


async def greedy_pd(engines) -> list[int]:
    async with httpx.AsyncClient(timeout=60) as c:
        status, dec, (pstatus, pre) = await pd_post(c, engines["prefill"], engines["decode"], "/generate", GREEDY,
                                                    None)
    assert status == 200 and pstatus == 200, (dec, pre)
    return dec["output_ids"]


@pytest.fixture(scope="module")
def baseline(engines):
    return asyncio.run(greedy_pd(engines))


def bootstrap_url(engines, path: str) -> str:
    return f"http://127.0.0.1:{engines['prefill'].bootstrap_port}{path}"


async def bootstrap_rooms(engines) -> int:
    async with httpx.AsyncClient(timeout=10) as c:
        return (await c.get(bootstrap_url(engines, "/health"))).json()["rooms"]


# Each case: the registration's fields to change (None value = drop the field is not used), the field named.
CASES = {
    "list_room": ({"room": [1, 2]}, "room"),
    "string_room": ({"room": "12345"}, "room"),
    "float_room": ({"room": 7.5}, "room"),
    "integral_float_room": ({"room": 7.0}, "room"),
    "huge_room": ({"room": 2**200}, "room"),
    "room_2_63": ({"room": 2**63}, "room"),
    "negative_room": ({"room": -1}, "room"),
    "null_room": ({"room": None}, "room"),
    "bool_room": ({"room": True}, "room"),
    "string_pages": ({"page_addrs": "0x1000,0x2000"}, "page_addrs"),
    "string_page": ({"page_addrs": ["4096"]}, "page_addrs"),
    "bool_num_tokens": ({"num_tokens": True}, "num_tokens"),
    "unknown_field": ({"evil": 1}, "evil"),
    "long_session_id": ({"session_id": "h" * 5000}, "session_id"),
    "prompt_over_context": ({"num_tokens": 10**9}, "num_tokens"),
    "more_pages_than_the_prompt_needs": ({"page_addrs": [(1 << 30) + i * 4096 for i in range(50)]}, "page_addrs"),
    "repeated_page": ({"num_tokens": 20, "page_addrs": [1 << 30, 1 << 30]}, "page_addrs"),
    "other_page_size": ({"page_size": 1}, "page_size"),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_hostile_registration_is_refused_and_engine_still_serves(engines, baseline, case):
    change, param = CASES[case]
    body = registration(**change)
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(bootstrap_url(engines, "/pd/register"), json=body)
    assert time.monotonic() - t0 < AT_ONCE  # refused at once, not after the waiting timeout's long poll
    err = assert_refused(r, 400, param)
    assert r.json()["status"] == "failed" and r.json()["reason"] == err["message"]  # what the decode's client reads
    assert await bootstrap_rooms(engines) == 0  # nothing kept
    assert await greedy_pd(engines) == baseline


async def test_list_room_is_not_a_500(engines, baseline):
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(bootstrap_url(engines, "/pd/register"), json=registration(room=[[1]]))
        assert r.status_code < 500, r.text
        for raw in (b"[1, 2]", b"{not json", b"null", b"\xff\xfe"):
            r = await c.post(bootstrap_url(engines, "/pd/register"), content=raw)
            assert_refused(r, 400, None, "body")
    assert await greedy_pd(engines) == baseline


async def test_three_million_pages_are_refused_by_the_size_cap(engines, baseline):
    raw = json.dumps(registration(page_addrs=[4096] * 3_000_000)).encode()
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(bootstrap_url(engines, "/pd/register"), content=raw,
                         headers={"content-type": "application/json"})
    assert time.monotonic() - t0 < 5
    assert_refused(r, 413, None, "exceeds")
    assert await bootstrap_rooms(engines) == 0
    assert await greedy_pd(engines) == baseline


async def test_huge_abort_reason_is_refused_and_bad_aborts_name_the_field(engines, baseline):
    async with httpx.AsyncClient(timeout=30) as c:
        url = bootstrap_url(engines, "/pd/abort")
        t0 = time.monotonic()
        r = await c.post(url, json={"room": 5, "reason": "x" * (20 * 1024 * 1024)})
        assert time.monotonic() - t0 < 5
        assert_refused(r, 413, None, "exceeds")
        assert r.json()["ok"] is False
        for body, param in (({"room": "5"}, "room"), ({"room": True}, "room"), ({"room": [5]}, "room"),
                            ({"room": 2**64}, "room"), ({"room": 5, "reason": 7}, "reason"),
                            ({"room": 5, "evil": 1}, "evil")):
            assert_refused(await c.post(url, json=body), 400, param)
    assert await greedy_pd(engines) == baseline


async def test_duplicate_registration_of_a_live_room_is_refused_and_the_room_completes(engines, baseline):
    """A decode registered room R and waits for its KV; a second registration of R (the replay of an outsider)
    gets 409 naming the room, and the prefill still writes R's KV to the first decode: its output is the
    baseline."""
    body = add_rooms(dict(GREEDY, rid="victim-" + uuid.uuid4().hex), "127.0.0.1", engines["prefill"].bootstrap_port,
                     None)
    room = body["bootstrap_room"]
    async with httpx.AsyncClient(timeout=60) as c:
        victim = asyncio.create_task(c.post(engines["decode"].url + "/generate", json=body))
        await async_wait_until(lambda: bootstrap_rooms(engines), 30, interval=0.05, what="the decode registered")
        r = await c.post(bootstrap_url(engines, "/pd/register"), json=registration(room=room, num_tokens=4))
        assert_refused(r, 409, "room", str(room), "already has a decode")
        r = await c.post(bootstrap_url(engines, "/pd/register"), json=registration(room=room, page_size=1))
        assert_refused(r, 400, "page_size")  # an invalid one is refused before it can touch the room
        pre = await c.post(engines["prefill"].url + "/generate", json=body)
        dec = await victim
    assert pre.status_code == 200, pre.text
    assert dec.status_code == 200, dec.text
    assert dec.json()["output_ids"] == baseline


async def test_registration_that_disagrees_with_the_attached_prompt_is_refused(engines, baseline):
    """The prefill's request for the room is there (3 prompt tokens): a registration for another prompt length
    is refused at once and does not bind the room."""
    body = add_rooms({"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}, "rid": uuid.uuid4().hex},
                     "127.0.0.1", engines["prefill"].bootstrap_port, None)
    room = body["bootstrap_room"]
    async with httpx.AsyncClient(timeout=60) as c:
        pre = asyncio.create_task(c.post(engines["prefill"].url + "/generate", json=body))
        await async_wait_until(lambda: bootstrap_rooms(engines), 30, interval=0.05, what="the prefill attached")
        r = await c.post(bootstrap_url(engines, "/pd/register"),
                         json=registration(room=room, num_tokens=40, page_addrs=[4096 * (i + 1) for i in range(3)]))
        assert_refused(r, 400, "num_tokens", "prompt mismatch")
        assert (await c.post(bootstrap_url(engines, "/pd/abort"), json={"room": room, "reason": "test"})).json() \
            == {"ok": True}
        assert "aborted by the decode: test" in (await pre).text
    assert await greedy_pd(engines) == baseline


# ---- in-process: the server's own state --------------------------------------------------------------------
async def test_registration_whose_client_left_is_dropped_at_once():
    server = BootstrapServer("127.0.0.1", free_port(), waiting_timeout=300, tombstone_ttl=60)
    await server.start()
    try:
        reg = json.dumps(registration(room=11)).encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"POST /pd/register HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(reg), reg))
        await writer.drain()
        await async_wait_until(lambda: 11 in server.rooms, 10, interval=0.01, what="the registration held")
        writer.close()  # the decode leaves its long poll
        await async_wait_until(lambda: 11 not in server.rooms, 10, interval=0.01,
                               what="the registration dropped after its client left")
        assert "connection closed" in server.tombstone_reason(11)
        assert not server.draining
    finally:
        await server.stop()


async def test_long_abort_reason_is_truncated():
    server = BootstrapServer("127.0.0.1", free_port(), waiting_timeout=300, tombstone_ttl=60)
    await server.start()
    try:
        async with httpx.AsyncClient(timeout=10) as c:
            r = await c.post(f"http://127.0.0.1:{server.port}/pd/abort", json={"room": 9, "reason": "y" * 10_000})
        assert r.json() == {"ok": True}
        kept = server.tombstone_reason(9)
        assert kept.startswith("y" * MAX_REASON_CHARS) and len(kept) < MAX_REASON_CHARS + 64
        assert "truncated 8976 characters" in kept
    finally:
        await server.stop()
