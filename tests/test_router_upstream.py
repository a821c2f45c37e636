"""The router's keep-alive HTTP/1.1 upstream client (pd.router.upstream) against a scripted raw
TCP server: content-length and chunked (SSE) bodies, connection reuse, a server closing
keep-alive connections, errors mid-body, malformed answers, timeouts, the connection limit."""

from __future__ import annotations

import asyncio
import time

import pytest

from pd.router.upstream import UpstreamClient, UpstreamError, header_block
from pd.util.wait import async_wait_until


async def until(cond, what: str, timeout: float = 10):
    """Poll ``cond()`` every 10 ms until true; ``TimeoutError`` naming ``what`` after ``timeout`` s."""
    await async_wait_until(cond, timeout, interval=0.01, what=what, retry=())


class ScriptedServer:
    """Reads each HTTP request (headers + Content-Length body) and answers with ``script(req)``:
    an async function given the request bytes and the writer."""

    def __init__(self, script):
        self.script = script
        self.connections = 0
        self.open_now = 0
        self.max_open = 0
        self.requests: list[bytes] = []
        self.closed_by_peer = 0
        self.server = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open_now += 1
        self.max_open = max(self.max_open, self.open_now)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    self.closed_by_peer += 1
                    return
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                if await self.script(head + body, writer, reader) == "close":
                    writer.close()
                    return
        finally:
            self.open_now -= 1

    async def stop(self) -> None:
        self.server.close()


def answer(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s" % (
        len(body), extra, body)


@pytest.fixture
async def served():
    servers = []

    async def make(script):
        s = ScriptedServer(script)
        url = await s.start()
        servers.append(s)
        return s, url

    yield make
    for s in servers:
        await s.stop()


async def test_content_length_bodies_headers_and_connection_reuse(served):
    async def echo(req, w, r):
        w.write(answer(req.split(b"\r\n\r\n", 1)[1], b"X-Thing: 1\r\n"))

    srv, url = await served(echo)
    client = UpstreamClient(limit=8, connect_timeout=2)
    hdr = header_block({"Content-Type": "application/json", "X-Request-Id": "abc"})
    for i in range(5):
        resp = await client.post(url, "/generate", b'{"i": %d}' % i, hdr)
        assert resp.status == 200 and resp.content_type == "application/json" and resp.headers["x-thing"] == "1"
        assert await resp.read() == b'{"i": %d}' % i
        resp.release()
    assert srv.connections == 1  # one keep-alive connection served all five
    first = srv.requests[0]
    assert first.startswith(b"POST /generate HTTP/1.1\r\n") and b"\r\nX-Request-Id: abc\r\n" in first
    assert b"\r\nContent-Length: 8\r\n" in first and f"\r\nHost: {url[7:]}\r\n".encode() in first
    await client.close()


async def test_chunked_sse_arrives_as_it_is_sent(served):
    gate = asyncio.Event()

    async def sse(req, w, r):
        w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i in range(3):
            ev = b"data: {\"i\": %d}\n\n" % i
            w.write(b"%x\r\n%s\r\n" % (len(ev), ev))
            await w.drain()
            if i == 0:
                await gate.wait()  # the client must get event 0 before the rest is sent
        w.write(b"0\r\n\r\n")

    srv, url = await served(sse)
    client = UpstreamClient(limit=8, connect_timeout=2)
    resp = await client.post(url, "/generate", b"{}")
    assert resp.status == 200 and resp.content_type == "text/event-stream"
    assert await asyncio.wait_for(resp.readany(), 10) == b'data: {"i": 0}\n\n'
    gate.set()
    rest = b""
    while chunk := await asyncio.wait_for(resp.readany(), 10):
        rest += chunk
    assert rest == b'data: {"i": 1}\n\ndata: {"i": 2}\n\n' and resp.complete
    resp.release()
    resp2 = await client.post(url, "/generate", b"{}")  # the chunked message ended cleanly: reused
    await resp2.read()
    resp2.release()
    assert srv.connections == 1
    await client.close()


async def test_server_closing_keepalive_connections(served):
    calls = []

    async def script(req, w, r):
        calls.append(1)
        if len(calls) == 1:
            w.write(answer(b"1", b"Connection: close\r\n"))
            return "close"
        w.write(answer(b"%d" % len(calls)))
        await w.drain()
        return "close"  # closes an idle keep-alive connection right after answering

    srv, url = await served(script)
    client = UpstreamClient(limit=8, connect_timeout=2)
    for i in range(3):
        resp = await client.post(url, "/x", b"")
        assert await resp.read() == b"%d" % (i + 1)
        resp.release()
        await until(lambda: client.open == 0, "the server's close reaching the client")  # dropped
    assert srv.connections == 3  # closed ones were never reused
    await client.close()


async def test_errors_mid_body_and_malformed_answers(served):
    async def script(req, w, r):
        if b"/short" in req:
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"x" * 10)
        elif b"/chunked" in req:
            w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        elif b"/garbage" in req:
            w.write(b"SPDY/9 banana\r\n\r\n")
        else:
            w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil the end")  # no length: until close
        await w.drain()
        return "close"

    srv, url = await served(script)
    client = UpstreamClient(limit=8, connect_timeout=2)
    resp = await client.post(url, "/short", b"")
    with pytest.raises(UpstreamError, match="closed the connection"):
        await resp.read()
    resp.close()
    resp = await client.post(url, "/chunked", b"")
    assert await resp.readany() == b"hello"
    with pytest.raises(UpstreamError):
        await resp.readany()
    resp.close()
    with pytest.raises(UpstreamError, match="malformed"):
        await client.post(url, "/garbage", b"")
    resp = await client.post(url, "/eof", b"")
    assert await resp.read() == b"until the end" and resp.content_type == "text/plain"
    resp.release()
    await until(lambda: client.open == 0, "every connection closed")
    dead = f"http://127.0.0.1:{srv.server.sockets[0].getsockname()[1]}"
    await srv.stop()
    await srv.server.wait_closed()
    with pytest.raises(UpstreamError, match="cannot connect"):
        await client.post(dead, "/x", b"")
    assert client.open == 0
    await client.close()


async def test_timeouts_and_dropping_a_response(served):
    async def script(req, w, r):
        if b"/slow-body" in req:
            w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n")
        await asyncio.sleep(30)  # never (finishes) answering

    srv, url = await served(script)
    client = UpstreamClient(limit=8, connect_timeout=2)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        await client.post(url, "/stall", b"", timeout=0.5)
    assert 0.45 < time.monotonic() - t0 < 5  # the request's timeout, not the server's 30 s
    resp = await client.post(url, "/slow-body", b"", timeout=0.5)  # the total covers the body too
    assert await resp.readany() == b"hi"
    with pytest.raises(TimeoutError):
        await resp.readany()
    resp.close()
    await until(lambda: client.open == 0, "the timed-out connections closed")  # never reused

    sent = len(srv.requests)
    resp = asyncio.create_task(client.post(url, "/stall", b""))  # a cancelled request drops its connection
    await until(lambda: len(srv.requests) > sent, "the request reaching the server")
    resp.cancel()
    with pytest.raises(asyncio.CancelledError):
        await resp
    assert client.open == 0
    await client.close()


async def test_connection_limit_is_shared_and_waits(served):
    async def script(req, w, r):
        await asyncio.sleep(0.05)
        w.write(answer(b"ok"))

    a, url_a = await served(script)
    b, url_b = await served(script)
    client = UpstreamClient(limit=2, connect_timeout=2)

    async def one(url):
        resp = await client.post(url, "/x", b"")
        body = await resp.read()
        resp.release()
        return body

    results = await asyncio.gather(*(one(url_a if i % 2 else url_b) for i in range(10)))
    assert results == [b"ok"] * 10
    assert a.max_open + b.max_open <= 3 and client.open <= 2  # never more than 2 at once (+1 closing)
    assert a.connections + b.connections >= 2
    tight = UpstreamClient(limit=1, connect_timeout=1)
    held = await tight.post(url_a, "/x", b"")  # holds the only slot
    with pytest.raises(TimeoutError):
        await tight.post(url_b, "/x", b"")
    await held.read()
    held.release()  # now idle: evicted for the other worker
    resp = await tight.post(url_b, "/x", b"")
    assert await resp.read() == b"ok"
    resp.release()
    await client.close()
    await tight.close()


def test_header_block_rejects_injection():
    assert header_block({"A": "1", "X-Request-Id": "r"}) == b"A: 1\r\nX-Request-Id: r\r\n"
    with pytest.raises(ValueError):
        header_block({"X-Request-Id": "r\r\nEvil: 1"})
    with pytest.raises(ValueError):
        header_block({"Bad:Name": "1"})
