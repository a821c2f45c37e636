"""Connection-level limits for the HTTP servers pdserve runs (router, reference engine, bootstrap server).

uvicorn bounds none of what an unauthenticated client can hold before it sends a request: a connection that
never sends a byte stays open forever, a header block may trickle one line every few seconds, or grow to
megabytes. One process with 20,000 idle connections used up the router's file descriptors, and every other
client's request (``/health`` included) then failed. So every connection passes :class:`ConnectionGuard`:

- **open connections**: at most ``max_connections`` in all and ``max_connections_per_address`` from one source
  address (set below the total, so one address flooding leaves room for the others). Over either, a new
  connection is closed at once (a TCP reset: no byte is read or written) before uvicorn sees it.
- **header read timeout**: a request's header block (the whole of it, request line included) must arrive within
  ``header_timeout`` seconds of the connection opening or of the request's first byte; otherwise 408 and close.
  This also closes a connection that never sends anything (Apache's ``mod_reqtimeout header=`` rule).
- **header size and count**: more than ``max_header_bytes`` bytes or ``max_headers`` fields is a 431 and close
  (RFC 6585). Bytes are counted as they arrive, so a block that never ends is cut off at the limit instead
  of being buffered by the parser; on a reused connection the count starts when the next request's first
  byte is parsed, so its first read (at most 256 KiB with uvloop) may go uncounted.
- **idle keep-alive**: a connection with no request in flight closes after ``keep_alive_timeout`` seconds
  (uvicorn's ``timeout_keep_alive``).

Every refusal is counted by reason (``on_refuse``). The guard is a subclass of uvicorn's httptools protocol
(:meth:`ConnectionGuard.protocol`, given to ``uvicorn.Config(http=...)``); its ``data_received`` follows
uvicorn 0.55's own, which the lock pins (tests/test_connection_limits.py checks uvicorn's is unchanged).

Two costs per request are saved on the way (the same bytes, the same deadlines): a response's head (status
line and headers, uvicorn's write for ``http.response.start``) goes out with the first body write in one
send, not two (:class:`_HeadWithBody`); and the header timer of a reused connection is not made and cancelled
per request: one timer stays armed and, when it fires, compares with the current request's deadline.
"""

from __future__ import annotations

import asyncio
import json
import resource
from dataclasses import dataclass
from typing import Callable, ClassVar, Optional, cast

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle

REASONS = ("total", "per_address", "header_timeout", "header_too_large", "too_many_headers")
NOFILE_RESERVE = 1024  # descriptors kept for everything that is not a client connection (workers, logs, files)


def raise_nofile_limit() -> int:
    """Raise this process's soft limit of open files to its hard limit; returns the soft limit now in force.
    (Linux distributions ship a soft limit of 1024 for compatibility with select(); asyncio uses epoll.)"""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


@dataclass(frozen=True)
class ConnectionLimits:
    """Limits on client connections (see the module docstring); 0 for a connection cap means no cap.

    Attributes:
        max_connections: open client connections in all.
        max_connections_per_address: open client connections from one source IP address.
        header_timeout: seconds for a request's whole header block.
        max_header_bytes: bytes of a request's header block (request line included).
        max_headers: header fields of a request.
        keep_alive_timeout: seconds an idle connection is kept between requests.
    """

    max_connections: int = 0
    max_connections_per_address: int = 0
    header_timeout: float = 10.0
    max_header_bytes: int = 64 * 1024
    max_headers: int = 100
    keep_alive_timeout: float = 5.0

    @classmethod
    def auto(cls, max_connections: int = 0, max_connections_per_address: int = 0, **kw) -> "ConnectionLimits":
        """Limits with the connection caps filled in where they are 0: the total from the open-file limit (raised
        to its hard limit first) less ``NOFILE_RESERVE``, at most 65,536; per address, half the total."""
        if max_connections <= 0:
            max_connections = max(64, min(65536, raise_nofile_limit() - NOFILE_RESERVE))
        if max_connections_per_address <= 0:
            max_connections_per_address = max(1, max_connections // 2)
        return cls(max_connections, min(max_connections_per_address, max_connections), **kw)


class ConnectionGuard:
    """The open-connection counts of one server and the protocol class that enforces ``limits``.

    Args:
        limits: the limits.
        on_refuse: called with a reason of ``REASONS`` for every connection closed by a limit.
        on_change: called with the number of open connections whenever it changes.
    """

    def __init__(self, limits: ConnectionLimits, on_refuse: Optional[Callable[[str], None]] = None,
                 on_change: Optional[Callable[[int], None]] = None):
        self.limits = limits
        self.open = 0
        self.by_address: dict[str, int] = {}
        self._on_refuse = on_refuse
        self._on_change = on_change

    def admit(self, address: str) -> Optional[str]:
        """Count a new connection from ``address``, or return why it is refused (it is then not counted)."""
        lim = self.limits
        if lim.max_connections and self.open >= lim.max_connections:
            return "total"
        held = self.by_address.get(address, 0)
        if lim.max_connections_per_address and held >= lim.max_connections_per_address:
            return "per_address"
        self.by_address[address] = held + 1
        self.open += 1
        if self._on_change is not None:
            self._on_change(self.open)
        return None

    def release(self, address: str) -> None:
        """A counted connection from ``address`` closed."""
        held = self.by_address.get(address, 0) - 1
        if held > 0:
            self.by_address[address] = held
        else:
            self.by_address.pop(address, None)
        self.open -= 1
        if self._on_change is not None:
            self._on_change(self.open)

    def refused(self, reason: str) -> None:
        if self._on_refuse is not None:
            self._on_refuse(reason)

    def protocol(self) -> type:
        """A uvicorn HTTP protocol class bound to this guard, for ``uvicorn.Config(http=...)``."""
        return type("GuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,), {"guard": self})


_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"  # uvicorn's interim answer to Expect: 100-continue


class _Refused(Exception):
    """Raised from a parser callback to stop parsing; the refusal is on the protocol."""


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits of ``guard`` (a subclass per guard: ConnectionGuard.protocol)."""

    guard: ClassVar[ConnectionGuard]

    def connection_made(self, transport) -> None:
        peer = transport.get_extra_info("peername")
        self._address = peer[0] if isinstance(peer, (tuple, list)) and peer else ""
        self._admitted = False
        self._header_timer: Optional[asyncio.TimerHandle] = None
        reason = self.guard.admit(self._address)
        if reason is not None:
            self.transport = transport
            transport.abort()
            self.guard.refused(reason)
            return
        self._admitted = True
        self._refusal: Optional[tuple[int, str, str]] = None
        super().connection_made(transport)
        self._start_headers()

    def connection_lost(self, exc) -> None:
        if not self._admitted:
            return
        self._admitted = False
        self._stop_header_timer()
        self.guard.release(self._address)
        super().connection_lost(exc)

    # ---- header limits ------------------------------------------------------------------------------------
    def _start_headers(self) -> None:
        self._reading_headers = True
        self._header_bytes = 0
        self._header_count = 0
        # this request's deadline; a timer armed for an earlier request stays and re-arms for this one (below)
        self._headers_due = self.loop.time() + self.guard.limits.header_timeout
        if self._header_timer is None:
            self._header_timer = self.loop.call_at(self._headers_due, self._header_timeout)

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self._reading_headers and not self.transport.is_closing():
            if self.loop.time() < self._headers_due:  # armed for an earlier request: wait for this one's deadline
                self._header_timer = self.loop.call_at(self._headers_due, self._header_timeout)
                return
            self._refuse(408, f"the request's headers did not arrive within {self.guard.limits.header_timeout:g}s",
                         "header_timeout")

    def _refuse(self, status: int, message: str, reason: str) -> None:
        """Answer ``status`` with a JSON reason, close the connection, count it."""
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "code": status}}).encode()
        self.transport.write(b"".join((STATUS_LINE[status], b"content-type: application/json\r\n",
                                       b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body), body)))
        self.transport.close()
        self._reading_headers = False
        self._stop_header_timer()
        self.guard.refused(reason)

    def data_received(self, data: bytes) -> None:
        if self._reading_headers:
            end = data.find(b"\r\n\r\n")
            self._header_bytes += len(data) if end < 0 else end
            if self._header_bytes > self.guard.limits.max_header_bytes:
                return self._refuse(431, f"the request's header block is over {self.guard.limits.max_header_bytes} "
                                    f"bytes", "header_too_large")
        # uvicorn 0.55's HttpToolsProtocol.data_received, with the refusals of the parser callbacks
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self._refusal is not None:
                return self._refuse(*self._refusal)
            msg = "Invalid HTTP request received."
            self.logger.warning(msg)
            self.send_400_response(msg)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if not self._reading_headers:  # a reused connection's next request (the first counts from the connect)
            self._start_headers()

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self.guard.limits.max_headers:
            self._refusal = (431, f"the request has more than {self.guard.limits.max_headers} header fields",
                             "too_many_headers")
            raise _Refused()
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._reading_headers = False  # the header timer, if it fires before the next request, does nothing
        cycle = self.cycle
        super().on_headers_complete()
        if self.cycle is not cycle:  # a request to answer (not an upgrade): its head waits for its first body bytes
            # a stand-in for the transport: the methods the cycle calls are its own, the rest the transport's
            self.cycle.transport = cast(asyncio.Transport, _HeadWithBody(self.cycle, self.transport, self.loop))


class _HeadWithBody:
    """The transport of one request's ``RequestResponseCycle``: the response head (uvicorn's first write other
    than ``100 Continue``) is held until the next write, which takes it along in one send; so a whole answer
    (start + body) leaves in one segment instead of two. A head that no write follows before the event loop's
    next turn (a stream waiting for its first chunk, a HEAD answer) is sent on its own then. Once the head is
    out the cycle writes to the real transport again. Everything else is the transport's."""

    __slots__ = ("_cycle", "_transport", "_loop", "_head", "_flush", "_sent")

    def __init__(self, cycle: RequestResponseCycle, transport: asyncio.Transport,
                 loop: asyncio.AbstractEventLoop) -> None:
        self._cycle = cycle
        self._transport = transport
        self._loop = loop
        self._head: Optional[bytes] = None
        self._flush: Optional[asyncio.Handle] = None  # the call that sends a head no write took along
        self._sent = False

    def write(self, data: bytes) -> None:
        head = self._head
        if head is None:
            if data == _CONTINUE or self._sent:
                self._transport.write(data)
                return
            self._head = data
            self._flush = self._loop.call_soon(self._send_head)
            return
        self._done()
        if len(data) < 65536:
            self._transport.write(head + data)
        else:  # no copy of a large body: one writev
            self._transport.writelines((head, data))

    def _done(self) -> None:
        self._head = None
        self._sent = True
        if self._flush is not None:  # always, with a head held
            self._flush.cancel()
        self._cycle.transport = self._transport

    def _send_head(self) -> None:
        head = self._head
        if head is not None:
            self._head = None
            self._sent = True
            self._cycle.transport = self._transport
            if not self._transport.is_closing():
                self._transport.write(head)

    def close(self) -> None:
        if self._head is not None:
            head = self._head
            self._done()
            self._transport.write(head)
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def __getattr__(self, name: str):
        return getattr(self._transport, name)
