"""pd.router.client: the router's one httpx client for health checks, aborts and info proxies
(bounded pool, the config's timeouts, a total deadline per call, bodies as the worker sent them)."""

import asyncio
import time
from types import SimpleNamespace

import httpx
import pytest

from pd.router.client import content_type, fetch, make_client
from pd.router.config import RouterConfig
from pd.router.errors import TIMEOUT_ERRORS, UPSTREAM_ERRORS
from pd.router.health import probe
from pd.util.wait import async_wait_until


async def serve(handler):
    """A TCP server on a free port running ``handler(reader, writer)``; (server, base URL)."""
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def test_pool_and_timeouts_come_from_the_config():
    cfg = RouterConfig.from_urls(["http://a:1"], ["http://d:1"], max_connections=7, timeouts={"connect": 2})
    client = make_client(cfg)
    try:
        pool = client._transport._pool
        assert pool._max_connections == 7 and pool._max_keepalive_connections == 7
        assert client.timeout.connect == 2 and client.timeout.read == cfg.timeouts.request
        assert "user-agent" not in client.headers and "accept-encoding" not in client.headers
    finally:
        await client.aclose()


async def test_the_request_sent_and_the_body_as_the_worker_sent_it():
    seen = []

    async def handler(reader, writer):
        seen.append(await reader.readuntil(b"\r\n\r\n"))
        body = b'{"ok": true}'
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: Application/JSON; charset=utf-8\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        writer.close()

    server, url = await serve(handler)
    async with server, make_client(RouterConfig.from_urls(["http://a:1"], ["http://d:1"])) as client:
        r = await fetch(client, "GET", url + "/get_model_info", 5, headers={"Authorization": "Bearer k"})
        assert r.status_code == 200 and r.content == b'{"ok": true}' and content_type(r) == "application/json"
    head = seen[0].decode().lower()
    assert head.startswith("get /get_model_info http/1.1") and "authorization: bearer k" in head
    assert "user-agent" not in head and "accept-encoding" not in head


async def test_fetch_is_bounded_in_total_and_errors_are_upstream_errors():
    done = asyncio.Event()
    opened, closed = [], []

    async def silent(reader, writer):  # accepts, reads, answers nothing until the test is done
        opened.append(1)
        await reader.read(100)
        await done.wait()
        writer.close()
        closed.append(1)

    server, url = await serve(silent)
    # the client's own timeouts (60 s) are far above fetch's total: the bound shows which one fired
    async with server, httpx.AsyncClient(timeout=60) as client:
        t0 = time.monotonic()
        with pytest.raises(TIMEOUT_ERRORS) as info:
            await fetch(client, "GET", url + "/health", 0.3)
        assert 0.25 < time.monotonic() - t0 < 10 and isinstance(info.value, UPSTREAM_ERRORS)
        worker = SimpleNamespace(url=url)
        assert await probe(client, worker, "/health", 0.3) == "no answer within 0.3s"
        done.set()
        await async_wait_until(lambda: len(closed) == len(opened), 10, interval=0.01,
                               what="the silent server's connections closed")
    async with httpx.AsyncClient() as client:
        with pytest.raises(UPSTREAM_ERRORS):
            await fetch(client, "GET", url + "/health", 2)  # nothing listens any more


def test_content_type_without_a_header():
    assert content_type(httpx.Response(200)) == "application/octet-stream"
    assert content_type(httpx.Response(200, headers={"content-type": "text/plain"})) == "text/plain"
