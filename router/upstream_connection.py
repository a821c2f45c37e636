"""One keep-alive HTTP/1.1 connection of the router's upstream client (pd.router.upstream): it sends
nothing itself (the client writes the request) and feeds the bytes it receives, parsed by httptools,
to the one response it serves at a time (pd.router.upstream_response).
"""

from __future__ import annotations

import asyncio
import socket
from typing import TYPE_CHECKING, Optional, cast

import httptools

if TYPE_CHECKING:
    from pd.router.upstream import UpstreamClient
    from pd.router.upstream_response import Response


class UpstreamError(ConnectionError):
    """An upstream request failed without a (complete) HTTP answer."""


class Connection(asyncio.Protocol):
    """One keep-alive connection; one request at a time."""

    def __init__(self, client: UpstreamClient, origin: str):
        self.client = client
        self.origin = origin
        self.loop = client.loop
        self.transport: Optional[asyncio.Transport] = None  # set by connection_made
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

    def reusable(self) -> bool:
        """Open, with a transport that is not closing: it may serve another request."""
        return not self.closed and self.transport is not None and not self.transport.is_closing()

    def pause_reading(self) -> None:
        """Stop reading from the socket (the response has too much unread)."""
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        """Read from the socket again."""
        if self.transport is not None:
            self.transport.resume_reading()

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
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # create_connection's transports are stream transports
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
        assert r is not None  # data_received feeds the parser only while a response waits
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
        r = self.response
        assert r is not None  # as in on_headers_complete
        r._feed(body)

    def on_message_complete(self) -> None:
        r = self.response
        assert r is not None  # as in on_headers_complete
        r._finish(self.parser.should_keep_alive())

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

