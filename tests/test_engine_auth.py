"""The reference engine's --api-key (SGLang's semantics) on its HTTP server and its bootstrap server."""

import asyncio

import httpx
import pytest

from engines import free_port, start_engine, wait_ready
from pd.engines.handoff.bootstrap import BootstrapServer, abort_on_prefill, make_client
from pd.engines.settings import API_KEY_ENV

KEY = "engine-test-key-1f2e3d"
GEN = {"text": "hello", "sampling_params": {"max_new_tokens": 2, "temperature": 0}}


@pytest.fixture(scope="module")
def keyed_engine(model_cache, tmp_path_factory):
    """A null-mode engine that got its key from the environment, as the launcher gives it."""
    mp = pytest.MonkeyPatch()
    mp.setenv(API_KEY_ENV, KEY)
    try:
        eng = start_engine("null", str(tmp_path_factory.mktemp("keyed")))
    finally:
        mp.undo()
    try:
        wait_ready([eng])
        yield eng
    finally:
        eng.stop()


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                                     {"Authorization": f"Basic {KEY}"}], ids=["none", "wrong", "no-scheme", "basic"])
@pytest.mark.parametrize("method,path,body", [("POST", "/generate", GEN), ("GET", "/v1/models", None),
                                              ("POST", "/abort_request", {"rid": "x"}),
                                              ("GET", "/get_server_info", None), ("POST", "/flush_cache", None)])
def test_engine_refuses_requests_without_the_key(keyed_engine, headers, method, path, body):
    r = httpx.request(method, keyed_engine.url + path, json=body, headers=headers, timeout=30)
    assert r.status_code == 401, r.text
    assert r.json() == {"error": "Unauthorized"}  # SGLang's body (sglang/srt/utils/auth.py)


def test_engine_serves_with_the_key_and_keeps_probes_open(keyed_engine):
    auth = {"Authorization": f"bearer {KEY}"}  # the scheme is case-insensitive, as in SGLang
    r = httpx.post(keyed_engine.url + "/generate", json=GEN, headers=auth, timeout=60)
    assert r.status_code == 200, r.text
    info = httpx.get(keyed_engine.url + "/get_server_info", headers=auth, timeout=10).json()
    assert KEY not in str(info)  # the key is never echoed back
    for path in ("/health", "/health_generate", "/metrics"):  # probes and Prometheus scrape without a secret
        assert httpx.get(keyed_engine.url + path, timeout=30).status_code == 200, path


def test_engine_key_is_not_on_its_command_line(keyed_engine):
    with open(f"/proc/{keyed_engine.proc.pid}/cmdline", "rb") as f:
        assert KEY.encode() not in f.read()


async def test_bootstrap_server_refuses_unauthenticated_calls():
    server = BootstrapServer("127.0.0.1", free_port(), waiting_timeout=5, tombstone_ttl=60, api_key=KEY)
    await server.start()
    base = f"http://127.0.0.1:{server.port}"
    reg = {"room": 7, "session_id": "127.0.0.1:1", "page_addrs": [0], "page_bytes": 1, "page_size": 1,
           "layout": {}, "num_tokens": 1}
    try:
        async with httpx.AsyncClient(timeout=10) as c:
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                r = await c.post(base + "/pd/register", json=reg, headers=headers)
                assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}
                r = await c.post(base + "/pd/abort", json={"room": 7}, headers=headers)
                assert r.status_code == 401
            assert not server.rooms and server.tombstone_reason(7) is None  # nothing reached the rooms
            assert (await c.get(base + "/health")).status_code == 200
        # the decode's client carries the key: its abort is taken
        async with make_client(KEY) as peer:
            await asyncio.wait_for(abort_on_prefill(peer, "127.0.0.1", server.port, 7, "test"), 10)
        assert server.tombstone_reason(7) == "test"
    finally:
        await server.stop()
