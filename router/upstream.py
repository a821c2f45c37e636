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

The pool is here; one connection is pd.router.upstream_connection, one response
pd.router.upstream_response (``Response`` and ``UpstreamError`` are importable from here too).
"""

from __future__ import annotations

import asyncio
import collections
import ssl as ssl_module
from typing import Optional
from urllib.parse import urlsplit

from pd.router.upstream_connection import Connection, UpstreamError
from pd.router.upstream_response import Response


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
        self.idle: collections.deque[Connection] = collections.deque()


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
        transport = conn.transport
        assert transport is not None  # _acquire hands out connections that were made
        r = Response(conn)
        conn.response = r
        head = b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Length: %d\r\n%s\r\n" % (
            path.encode("latin-1"), o.host_header, len(body), headers)
        try:
            if len(body) < 65536:
                transport.write(head + body)
            else:
                transport.writelines((head, body))
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
    async def _acquire(self, o: _Origin) -> Connection:
        idle = o.idle
        while idle:
            conn = idle.pop()
            if not conn.reusable():
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
                        if conn.reusable():
                            return conn
                        conn.close()
                self.open += 1
                try:
                    _, conn = await self.loop.create_connection(lambda: Connection(self, o.origin), o.host, o.port,
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

    def _put_idle(self, conn: Connection) -> None:
        if self._closed:
            conn.close()
            return
        conn.idle_since = self.loop.time()
        self._origins[conn.origin].idle.append(conn)
        if self._sweeper is None:
            self._sweeper = self.loop.call_later(self.keepalive, self._sweep)
        self._wake_slot()

    def _lost(self, conn: Connection) -> None:
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
        oldest: Optional[Connection] = None
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
