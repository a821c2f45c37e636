"""One response of the router's upstream client (pd.router.upstream): what a caller reads of it (status,
headers, the body as it arrives) and how it ends (back to the pool, or the connection dropped).

Its connection (pd.router.upstream_connection) feeds it through the methods with a leading underscore;
those, and the attributes with one, are that connection's and the client's side of it, not the caller's.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from pd.router.upstream_connection import Connection

HIGH_WATER = 256 * 1024  # unread response bytes above which reading from the socket pauses


class Response:
    """One upstream response; its headers have arrived when ``post`` returns it.

    Attributes:
        status: HTTP status code.
        headers: header values by lower-case name (the last of repeated headers).
        content_type: the media type without parameters (``application/octet-stream`` if absent).
    """

    __slots__ = ("status", "headers", "content_type", "complete", "_conn", "_chunks", "_buffered", "_paused", "_exc",
                 "_waiter", "_keep_alive", "_deadline", "_done", "_until_close", "_idle_due", "_idle_timer")

    def __init__(self, conn: Connection):
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
            self._conn.resume_reading()
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
                self._conn.resume_reading()
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
            self._conn.pause_reading()
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

