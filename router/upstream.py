"""The keep-alive HTTP/1.1 client of the router's two generation requests per PD request (POST to
the prefill, POST to the decode), on ``asyncio.Protocol`` and httptools' response parser.

Why not aiohttp here (the project prefers well-kept libraries): aiohttp's client cost about 100 us
of router CPU per upstream request on this machine, two per PD request, 40-50% of the router's
CPU in the py-spy profiles (benchmarks/results/router.md, "What each change bought"). Measured in one run
(benchmarks/router.py, stub engines, c=32, router CPU per request): the router with aiohttp for
these two requests 355-382 us per non-streaming request and 821-897 us per 64-event stream; with
this client 151 us and 657 us (the Rust gateway in the same run: 135 us and 664 us). Parsing is
httptools' (llhttp, the parser uvicorn and Node.js use), connections come from uvloop; this module
only pools connections and hands bodies over. Everything else the router sends (health checks,
aborts, info proxies) goes through httpx (pd.router.client).

What it does: POST with a fixed set of headers and a body; keeps connections alive and reuses the
most recently used one per worker (LIFO); at most ``limit`` connections open over all workers (a
request waits for a free one, within the connect timeout; an idle connection to another worker
is closed to make room); idle connections are closed after ``keepalive`` seconds, and are dropped
as soon as the server closes them. Responses: status, headers, ``read()`` (the whole body),
``readany()`` (what has arrived; chunked bodies arrive de-chunked), ``release()`` (back to the
pool when the message ended cleanly and the server keeps the connection alive) and ``close()``
(drop the connection: an engine aborts the request of a client that went away). A response is
read-paused above 256 KiB unread (a slow client does not make the router buffer a whole stream).

Errors: ``UpstreamError`` (an ``OSError``: cannot connect, connection closed or reset before the
message ended, malformed response) and ``TimeoutError`` (connect: ``connect_timeout`` seconds to
get a connection, pool wait included; ``timeout``: the whole request, body included, one deadline
for all of it). Nothing is retried here: the router retries on a fresh pair with fresh
rooms (a POST resent on another connection could start a second generation).
"""

from __future__ import annotations

import asyncio
import collections
import socket
import ssl as ssl_module
from typing import Optional
from urllib.parse import urlsplit

import httptools

HIGH_WATER = 256 * 1024  # unread response bytes above which reading from the socket pauses


class UpstreamError(ConnectionError):
    """An upstream request failed without a (complete) HTTP answer."""


def header_block(headers: dict[str, str]) -> bytes:
    """Request headers encoded once for ``UpstreamClient.post``.

    Raises:
        ValueError: a name or value holds CR or LF (header injection), or is not latin-1.
    """
    out = []
    for name, value in headers.items():
        if any(c in name or c in value for c in "\r\n") or ":" in name:
            raise ValueError(f"header {name!r}: CR, LF (or ':' in the name) are not allowed")
        out.append(f"{name}: {value}\r\n")
    return "".join(out).encode("latin-1")


class Response:
    """One upstream response; its headers have arrived when ``post`` returns it.

    Attributes:
        status: HTTP status code.
        headers: header values by lower-case name (the last of repeated headers).
        content_type: the media type without parameters (``application/octet-stream`` if absent).
    """

    __slots__ = ("status", "headers", "content_type", "complete", "_conn", "_chunks", "_buffered", "_paused", "_exc",
                 "_waiter", "_keep_alive", "_deadline", "_done", "_until_close", "_idle_due", "_idle_timer")

    def __init__(self, conn: "_Connection"):
        self._conn = conn
        self.status = 0
        self.headers: dict[str, str] = {}
        self.content_type = "application/octet-stream"
        self.complete = False  # the whole message arrived
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._paused = False
        self._exc: Optional[BaseException] = None
        self._waiter: Optional[asyncio.Future] = None
        self._keep_alive = False
        self._deadline: Optional[float] = None  # loop time by which the whole response must have arrived
        self._done = False  # released or closed
        self._until_close = False  # the body ends when the server closes the connection
        self._idle_due: Optional[float] = None  # loop time by which the readany() waiting now must get bytes
        self._idle_timer: Optional[asyncio.TimerHandle] = None

    # ---- reading ----------------------------------------------------------------------------------
    async def _wait(self) -> None:
        self._waiter = self._conn.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def _head(self) -> None:
        while not self.status:
            if self._exc is not None:
                raise self._exc
            await self._wait()

    async def readany(self, idle: Optional[float] = None) -> bytes:
        """The body bytes that arrived since the last read (waits for some); b"" at the end.

        Args:
            idle: seconds this call may wait (None: no limit of its own), as ``asyncio.timeout(idle)`` around it
                would bound it, without a timer made and cancelled per call: one timer per response stays armed
                and re-arms for the current call's deadline when it fires early.

        Raises:
            UpstreamError / TimeoutError: the connection broke or the request timed out first.
            TimeoutError: ``idle`` seconds passed with no bytes (the response stays open).
        """
        due = None
        while not self._chunks:
            if self._exc is not None:
                raise self._exc
            if self.complete:
                return b""
            if idle is None:
                await self._wait()
                continue
            if due is None:
                due = self._conn.loop.time() + idle
            self._idle_due = due
            if self._idle_timer is None:
                self._idle_timer = self._conn.loop.call_at(due, self._idle_check)
            try:
                await self._wait()
            finally:
                self._idle_due = None
        chunks = self._chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self._chunks = []
        self._buffered = 0
        if self._paused:
            self._paused = False
            self._conn.transport.resume_reading()
        return data

    async def read(self) -> bytes:
        """The rest of the body, to its end.

        Raises:
            UpstreamError / TimeoutError: the connection broke or the request timed out first.
        """
        while not self.complete:
            if self._exc is not None:
                raise self._exc
            if self._paused:
                self._paused = False
                self._conn.transport.resume_reading()
            await self._wait()
        chunks = self._chunks
        self._chunks = []
        self._buffered = 0
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    @property
    def at_eof(self) -> bool:
        """The whole body arrived cleanly and has been read: the next read returns b""."""
        return self.complete and not self._chunks and self._exc is None

    # ---- ending -----------------------------------------------------------------------------------
    def release(self) -> None:
        """Done with the response: the connection goes back to the pool if the message ended
        cleanly and the server keeps it alive, else it is closed. Idempotent."""
        if self._done:
            return
        self._end()
        conn = self._conn
        if self.complete and self._keep_alive and self._exc is None and not conn.closed:
            conn.client._put_idle(conn)
        else:
            conn.close()

    def close(self) -> None:
        """Drop the connection (the server sees the client go away). Idempotent."""
        if self._done:
            return
        self._end()
        self._conn.close()

    def _end(self) -> None:
        self._done = True
        self._deadline = None
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        self._conn.response = None

    # ---- fed by the connection --------------------------------------------------------------------
    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > HIGH_WATER and not self._paused:
            self._paused = True
            self._conn.transport.pause_reading()
        self._wake()

    def _finish(self, keep_alive: bool) -> None:
        self.complete = True
        self._keep_alive = keep_alive
        self._deadline = None
        self._wake()

    def _fail(self, exc: BaseException) -> None:
        if self.complete or self._exc is not None:
            return
        self._exc = exc
        self._wake()

    def _idle_check(self) -> None:
        """The idle timer: fail the waiting readany() whose deadline passed, or re-arm for the one waiting now."""
        self._idle_timer = None
        due, w = self._idle_due, self._waiter
        if due is None or w is None or w.done() or self._done:
            return
        loop = self._conn.loop
        if loop.time() < due:
            self._idle_timer = loop.call_at(due, self._idle_check)
        else:
            w.set_exception(TimeoutError())

    def _timed_out(self) -> None:
        self._deadline = None
        if not self.complete:
            self._fail(TimeoutError(f"upstream request to {self._conn.origin} timed out"))
            self._conn.close()


class _Connection(asyncio.Protocol):
    """One keep-alive connection; one request at a time."""

    def __init__(self, client: "UpstreamClient", origin: str):
        self.client = client
        self.origin = origin
        self.loop = client.loop
        self.transport: Optional[asyncio.Transport] = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: Optional[Response] = None
        self.closed = False
        self.counted = True  # holds one of the client's ``limit`` slots
        self.idle_since = 0.0
        self._headers: list[tuple[bytes, bytes]] = []
        # The request deadline's timer: armed by a request, left armed when it ends in time (the next request on
        # this connection reuses it), checked against the current response's deadline when it fires.
        self._timer: Optional[asyncio.TimerHandle] = None
        self._timer_at = 0.0

    def arm(self, deadline: float) -> None:
        """The current response times out at ``deadline`` (loop time)."""
        if self._timer is not None:
            if self._timer_at <= deadline:
                return  # fires first; re-arms for the deadline then
            self._timer.cancel()
        self._timer_at = deadline
        self._timer = self.loop.call_at(deadline, self._check_deadline)

    def _check_deadline(self) -> None:
        self._timer = None
        r = self.response
        if r is None or r._deadline is None:
            return  # ended in time: the next request arms it again
        if self.loop.time() < r._deadline:
            self.arm(r._deadline)
        else:
            r._timed_out()

    # ---- asyncio.Protocol -------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:  # a request is one write; never hold it back waiting for an ACK (Nagle)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except (OSError, AttributeError):
                pass

    def data_received(self, data: bytes) -> None:
        if self.response is None:
            self.close()  # bytes nobody asked for: the connection's state is unknown
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            r = self.response
            if r is not None:
                r._fail(UpstreamError(f"malformed HTTP response from {self.origin}: {e}"))
            self.close()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.closed = True
        self.client._lost(self)
        r = self.response
        if r is not None and not r.complete:
            if r.status and r._until_close and exc is None:
                r._finish(False)  # a body delimited by the end of the connection
            else:
                why = f": {exc!r}" if exc else ""
                r._fail(UpstreamError(f"{self.origin} closed the connection before the response ended{why}"))

    # ---- httptools callbacks ----------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        r = self.response
        headers = {n.decode("latin-1").lower(): v.decode("latin-1") for n, v in self._headers}
        self._headers = []
        r.headers = headers
        ctype = headers.get("content-type")
        if ctype:
            r.content_type = ctype.split(";", 1)[0].strip().lower()
        r._until_close = "content-length" not in headers and "chunked" not in headers.get("transfer-encoding", "")
        r.status = self.parser.get_status_code()
        r._wake()

    def on_body(self, body: bytes) -> None:
        self.response._feed(body)

    def on_message_complete(self) -> None:
        self.response._finish(self.parser.should_keep_alive())

    # ---- ---------------------------------------------------------------------------------------------
    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()
            self.client._lost(self)
            r = self.response
            if r is not None:
                r._fail(UpstreamError(f"connection to {self.origin} closed"))


class _Origin:
    """Where one worker is, and its idle connections (most recently used last)."""

    __slots__ = ("origin", "host", "port", "ssl", "host_header", "idle")

    def __init__(self, origin: str):
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"upstream origin {origin!r} is not an http(s)://host[:port] URL")
        self.origin = origin
        self.host = parts.hostname
        self.ssl = ssl_module.create_default_context() if parts.scheme == "https" else None
        self.port = parts.port or (443 if self.ssl else 80)
        self.host_header = parts.netloc.encode("idna")
        self.idle: collections.deque[_Connection] = collections.deque()


class UpstreamClient:
    """Pooled keep-alive HTTP/1.1 connections to the workers, for POST requests.

    Args:
        limit: connections open at most, all workers together (>= 1).
        connect_timeout: seconds to get a connection (pool wait and TCP connect).
        keepalive: seconds an idle connection is kept.

    Must be created and used inside one running event loop; ``close()`` when done.
    """

    def __init__(self, limit: int, connect_timeout: float, keepalive: float = 60.0):
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.loop = asyncio.get_running_loop()
        self.limit = limit
        self.connect_timeout = connect_timeout
        self.keepalive = keepalive
        self.open = 0  # connections open or being opened
        self._origins: dict[str, _Origin] = {}
        self._slot_waiters: collections.deque[asyncio.Future] = collections.deque()
        self._sweeper: Optional[asyncio.TimerHandle] = None
        self._closed = False

    async def post(self, origin: str, path: str, body: bytes, headers: bytes = b"",
                   timeout: Optional[float] = None) -> Response:
        """POST ``body`` to ``origin`` + ``path``; returns once the response's headers arrived.

        Args:
            origin: ``http(s)://host:port`` of the worker.
            path: the request target, e.g. ``/generate``.
            body: the request body.
            headers: extra request headers from ``header_block`` (Host and Content-Length are added).
            timeout: seconds for the whole request, body included (None: no limit).

        Raises:
            UpstreamError: no connection, or it broke before the response headers.
            TimeoutError: ``connect_timeout`` or ``timeout`` passed.
            ValueError: ``origin`` is not an http(s) URL.
        """
        o = self._origins.get(origin)
        if o is None:
            o = self._origins[origin] = _Origin(origin)
        deadline = None if timeout is None else self.loop.time() + timeout
        conn = await self._acquire(o)
        r = Response(conn)
        conn.response = r
        head = b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Length: %d\r\n%s\r\n" % (
            path.encode("latin-1"), o.host_header, len(body), headers)
        try:
            if len(body) < 65536:
                conn.transport.write(head + body)
            else:
                conn.transport.writelines((head, body))
            if deadline is not None:
                r._deadline = deadline
                conn.arm(deadline)
            await r._head()
        except BaseException:
            r.close()
            raise
        return r

    async def close(self) -> None:
        """Close every idle connection (responses still open close with their owners)."""
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for o in self._origins.values():
            while o.idle:
                o.idle.pop().close()

    # ---- the pool ---------------------------------------------------------------------------------
    async def _acquire(self, o: _Origin) -> _Connection:
        idle = o.idle
        while idle:
            conn = idle.pop()
            if conn.closed or conn.transport.is_closing():
                conn.close()
                continue
            if self.loop.time() - conn.idle_since > self.keepalive:
                conn.close()
                continue
            return conn
        try:
            async with asyncio.timeout(self.connect_timeout):
                while self.open >= self.limit:
                    if self._evict_idle():
                        break
                    fut = self.loop.create_future()
                    self._slot_waiters.append(fut)
                    try:
                        await fut
                    finally:
                        if not fut.done():
                            fut.cancel()
                    while idle:  # a connection of ours came back meanwhile
                        conn = idle.pop()
                        if not conn.closed and not conn.transport.is_closing():
                            return conn
                        conn.close()
                self.open += 1
                try:
                    _, conn = await self.loop.create_connection(lambda: _Connection(self, o.origin), o.host, o.port,
                                                                ssl=o.ssl)
                except BaseException:
                    self.open -= 1
                    self._wake_slot()
                    raise
        except TimeoutError:  # before OSError: TimeoutError is one
            raise TimeoutError(f"no connection to {o.origin} within {self.connect_timeout:g}s") from None
        except OSError as e:
            if isinstance(e, UpstreamError):
                raise
            raise UpstreamError(f"cannot connect to {o.origin}: {e!r}") from e
        return conn

    def _put_idle(self, conn: _Connection) -> None:
        if self._closed:
            conn.close()
            return
        conn.idle_since = self.loop.time()
        self._origins[conn.origin].idle.append(conn)
        if self._sweeper is None:
            self._sweeper = self.loop.call_later(self.keepalive, self._sweep)
        self._wake_slot()

    def _lost(self, conn: _Connection) -> None:
        """A connection closed (by us or the server): free its slot, forget it if idle."""
        if conn.counted:
            conn.counted = False
            self.open -= 1
            o = self._origins.get(conn.origin)
            if o is not None and conn in o.idle:
                o.idle.remove(conn)
            self._wake_slot()

    def _evict_idle(self) -> bool:
        """Close the longest-idle connection of any worker to free a slot; False if none is idle."""
        oldest: Optional[_Connection] = None
        for o in self._origins.values():
            if o.idle and (oldest is None or o.idle[0].idle_since < oldest.idle_since):
                oldest = o.idle[0]
        if oldest is None:
            return False
        oldest.close()
        return True

    def _wake_slot(self) -> None:
        while self._slot_waiters:
            fut = self._slot_waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return

    def _sweep(self) -> None:
        self._sweeper = None
        cutoff = self.loop.time() - self.keepalive
        left = False
        for o in self._origins.values():
            while o.idle and o.idle[0].idle_since <= cutoff:
                o.idle[0].close()
            left = left or bool(o.idle)
        if left and not self._closed:
            self._sweeper = self.loop.call_later(self.keepalive / 2, self._sweep)
