"""The PD bootstrap channel: how a decode tells a prefill where to write a room's KV.

Protocol (SGLang's handshake in our words; SGLang does it over its bootstrap HTTP server + ZMQ in
sglang/srt/disaggregation/mooncake/conn.py, we do it over one HTTP server on the prefill's
``--disaggregation-bootstrap-port``):

- ``POST /pd/register`` (decode -> prefill), JSON ``{room, session_id, page_addrs, page_bytes,
  page_size, layout, num_tokens}``: the decode has pre-allocated ``page_addrs`` (addresses in its
  transfer-engine session ``session_id``) for ``num_tokens`` prompt tokens. The call is a long poll:
  it returns when the prefill has pushed the KV (``{"status": "ok", "first_token": ...}``) or
  failed (``{"status": "failed", "reason": ...}``). A refused connection means a dead prefill.
- ``POST /pd/abort`` (decode -> prefill), ``{room, reason}``: the decode gave up on the room. The
  prefill cancels it and answers only once no KV write into the decode's pages is in flight, so
  the decode may then reuse them. That holds after the room ended too: a write the prefill
  abandoned at its transfer deadline keeps the room "draining" until the transfer engine settles it.
- ``GET /health``.

With the engine's ``--api-key``, ``/pd/register`` and ``/pd/abort`` need ``Authorization: Bearer KEY``
(pd.engines.auth; 401 ``{"error": "Unauthorized"}`` otherwise, /health stays open), and the decode's
client sends it: whoever reaches the port could otherwise name where a prefill writes KV or abort its rooms.

A room aborted on either side is remembered for ``tombstone_ttl`` seconds, so the other side's
late arrival fails at once instead of waiting for its timeout.

The server is a Starlette app on an embedded ``uvicorn.Server`` in the engine's event loop (the
engine's own HTTP server is FastAPI on uvicorn); the decode's calls go through the engine's one
``httpx.AsyncClient``. Neither cancels a long poll when the peer disconnects: only a result, a
timeout or an abort ends it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pd.engines.auth import ApiKeyMiddleware, auth_headers
from pd.engines.errors import EngineError
from pd.util.wait import async_wait_until

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024 * 1024  # a registration lists every page address of the room's prompt
SHUTDOWN_GRACE = 5.0  # s the server waits for open requests when it stops, then cancels them
# s a decode's /pd/abort may take (it waits for in-flight KV writes); the engine passes its own, SGLang's
# SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT (30 s)
ABORT_TIMEOUT = 30.0


class RoomFailed(Exception):
    """The room cannot complete: the peer aborted it, timed out, or died."""


@dataclass
class Registration:
    """What the decode sent: where to write one room's KV."""

    room: int
    session_id: str
    page_addrs: list[int]
    page_bytes: int
    page_size: int
    layout: dict
    num_tokens: int
    # With speculative decoding (SGLang registers the draft's KV pool next to the target's): where the draft's
    # KV goes, its layout, and the decode's --speculative-* settings (pd.engines.spec_config.SpecConfig.handshake).
    draft_page_addrs: list[int] = field(default_factory=list)
    draft_page_bytes: int = 0
    draft_layout: Optional[dict] = None
    speculative: Optional[dict] = None


@dataclass
class Room:
    """Prefill-side state of one bootstrap room."""

    room: int
    registered: asyncio.Future = field(default_factory=lambda: asyncio.get_event_loop().create_future())
    result: asyncio.Future = field(default_factory=lambda: asyncio.get_event_loop().create_future())
    prefill_attached: bool = False
    no_transfer_in_flight: asyncio.Event = field(default_factory=asyncio.Event)
    on_abort: Optional[Callable[[str], None]] = None
    write: Optional[object] = None  # the prefill's KV write into the decode's pages while it may still run

    def __post_init__(self) -> None:
        self.no_transfer_in_flight.set()


class BootstrapServer:
    """Prefill side of the bootstrap channel (one per prefill engine).

    Args:
        host, port: where to listen (``--host`` and ``--disaggregation-bootstrap-port``).
        waiting_timeout: seconds a registration may wait for the prefill request (s).
        tombstone_ttl: seconds an aborted room is remembered.
        api_key: the engine's ``--api-key`` (None = open).
    """

    def __init__(self, host: str, port: int, waiting_timeout: float, tombstone_ttl: float,
                 api_key: Optional[str] = None):
        self.host = host
        self.api_key = api_key
        self.port = port
        self.waiting_timeout = waiting_timeout
        self.tombstone_ttl = tombstone_ttl
        self.rooms: dict[int, Room] = {}
        self.tombstones: dict[int, tuple[str, float]] = {}
        self.draining: dict[int, Room] = {}  # ended rooms whose abandoned KV write has not settled yet
        self._server: Optional[uvicorn.Server] = None
        self._serving: Optional[asyncio.Task] = None

    # ---- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        """Start serving /pd/register, /pd/abort and /health on ``host:port``; returns once it listens.

        Raises:
            OSError: ``host:port`` cannot be bound (in use, bad address).
            RuntimeError: the server stopped while starting.
        """
        app = Starlette(routes=[
            Route("/pd/register", self._handle_register, methods=["POST"]),
            Route("/pd/abort", self._handle_abort, methods=["POST"]),
            Route("/health", self._handle_health, methods=["GET"]),
        ])
        sockets = _listen(self.host, self.port)  # bound here, so a taken port raises instead of exiting
        config = uvicorn.Config(ApiKeyMiddleware(app, self.api_key), lifespan="off", log_config=None,
                                access_log=False, timeout_graceful_shutdown=SHUTDOWN_GRACE)
        self._server = _EmbeddedServer(config)
        self._serving = asyncio.get_running_loop().create_task(self._server.serve(sockets=sockets))

        def started() -> bool:
            if self._serving.done():
                raise RuntimeError(f"bootstrap server on {self.host}:{self.port} stopped while starting")
            return self._server.started

        await async_wait_until(started, 30, interval=0.01, what=f"bootstrap server on {self.host}:{self.port}",
                               retry=())

    async def stop(self) -> None:
        """Fail every room still waiting (its decode's long poll answers at once), then stop the
        HTTP server, waiting up to ``SHUTDOWN_GRACE`` s for open requests (idempotent)."""
        for room in list(self.rooms):
            self._abort_room(room, "prefill shutting down")
        if self._server is not None and self._serving is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception):
                await self._serving
            self._server = self._serving = None

    # ---- tombstones ---------------------------------------------------------------------
    def tombstone(self, room: int, reason: str) -> None:
        """Remember for ``tombstone_ttl`` seconds that bootstrap room ``room`` ended with ``reason``,
        so a late register from the peer is refused with that reason; expired entries are dropped here."""
        now = time.monotonic()
        self.tombstones[room] = (reason, now + self.tombstone_ttl)
        for r in [r for r, (_, exp) in self.tombstones.items() if exp < now]:
            del self.tombstones[r]

    def tombstone_reason(self, room: int) -> Optional[str]:
        """Why bootstrap room ``room`` ended, or None if it has no live tombstone."""
        entry = self.tombstones.get(room)
        if entry is None or entry[1] < time.monotonic():
            return None
        return entry[0]

    # ---- prefill-side API ---------------------------------------------------------------
    def attach(self, room: int, on_abort: Callable[[str], None]) -> Room:
        """Claim ``room`` for a prefill request.

        Raises:
            EngineError: 409 when a prefill request already holds the room.
            RoomFailed: the decode already aborted the room.
        """
        reason = self.tombstone_reason(room)
        if reason is not None:
            raise RoomFailed(f"bootstrap room {room} was aborted by the decode: {reason}")
        rec = self.rooms.get(room)
        if rec is None:
            rec = self.rooms[room] = Room(room)
        elif rec.prefill_attached:
            raise EngineError(409, f"bootstrap room {room} is already active on this prefill", "bootstrap_room")
        rec.prefill_attached = True
        rec.on_abort = on_abort
        return rec

    async def wait_registration(self, rec: Room, timeout: float) -> Registration:
        """Wait for the decode to say where to write.

        Raises:
            RoomFailed: the decode aborted, or did not register within ``timeout`` seconds.
        """
        try:
            return await asyncio.wait_for(asyncio.shield(rec.registered), timeout)
        except asyncio.TimeoutError:
            raise RoomFailed(
                f"bootstrap room {rec.room}: no decode registered within {timeout:g}s (bootstrap timeout)"
            ) from None

    def finish(self, rec: Room, meta: Optional[dict], reason: Optional[str] = None) -> None:
        """Resolve the decode's long poll (``meta`` on success, ``reason`` on failure) and forget
        the room. A failure is tombstoned so a late registration fails fast."""
        if not rec.result.done():
            rec.result.set_result({"status": "ok", **meta} if meta is not None
                                  else {"status": "failed", "reason": reason})
        if meta is None:
            self.tombstone(rec.room, reason or "aborted by prefill")
        if self.rooms.get(rec.room) is rec:
            del self.rooms[rec.room]
        if not rec.no_transfer_in_flight.is_set():  # a decode's /pd/abort must still wait for it
            self.draining[rec.room] = rec

    def write_settled(self, rec: Room) -> None:
        """The room's KV write has settled: answer the decode's pending /pd/abort and forget the room."""
        rec.write = None
        rec.no_transfer_in_flight.set()
        if self.draining.get(rec.room) is rec:
            del self.draining[rec.room]

    # ---- HTTP handlers (decode -> prefill) ----------------------------------------------
    async def _handle_health(self, request: Request) -> Response:
        return _json({"status": "ok", "rooms": len(self.rooms), "draining": len(self.draining)})

    async def _handle_register(self, request: Request) -> Response:
        try:
            body = await _read_json(request)
            reg = Registration(**{k: body[k] for k in Registration.__dataclass_fields__ if k in body})
        except _TooLarge as e:
            return _json({"status": "failed", "reason": str(e)}, status=413)
        except (ValueError, KeyError, TypeError) as e:
            return _json({"status": "failed", "reason": f"bad registration: {e!r}"}, status=400)
        reason = self.tombstone_reason(reg.room)
        if reason is not None:
            return _json({"status": "failed", "reason": f"room {reg.room} was aborted by the prefill: {reason}"})
        rec = self.rooms.get(reg.room)
        if rec is None:
            rec = self.rooms[reg.room] = Room(reg.room)
        if rec.registered.done():
            return _json({"status": "failed", "reason": f"room {reg.room} already has a decode registered"}, status=409)
        rec.registered.set_result(reg)
        try:
            result = await asyncio.wait_for(asyncio.shield(rec.result), self.waiting_timeout)
        except asyncio.TimeoutError:
            result = {"status": "failed",
                      "reason": f"room {reg.room}: no prefill request arrived within {self.waiting_timeout:g}s"}
            self._abort_room(reg.room, "decode waiting timeout")
        return _json(result)

    async def _handle_abort(self, request: Request) -> Response:
        try:
            body = await _read_json(request)
            room = int(body["room"])
            reason = str(body.get("reason", "aborted by decode"))
        except _TooLarge as e:
            return _json({"ok": False, "reason": str(e)}, status=413)
        except (ValueError, KeyError, TypeError) as e:
            return _json({"ok": False, "reason": f"bad abort: {e!r}"}, status=400)
        rec = self._abort_room(room, reason) or self.draining.get(room)
        if rec is not None:
            await rec.no_transfer_in_flight.wait()
        return _json({"ok": True})

    def _abort_room(self, room: int, reason: str) -> Optional[Room]:
        self.tombstone(room, reason)
        rec = self.rooms.pop(room, None)
        if rec is None:
            return None
        if not rec.registered.done():
            rec.registered.set_exception(RoomFailed(f"bootstrap room {room} was aborted by the decode: {reason}"))
            rec.registered.exception()  # mark retrieved; the prefill may never await it
        if not rec.result.done():
            rec.result.set_result({"status": "failed", "reason": reason})
        if rec.on_abort is not None:
            rec.on_abort(f"bootstrap room {room} was aborted by the decode: {reason}")
        return rec


# ---- HTTP plumbing of the server ----------------------------------------------------------
class _EmbeddedServer(uvicorn.Server):
    """A uvicorn server inside the engine's loop: the engine's own server keeps the signals, so
    SIGTERM stops the engine (which then stops this server) rather than this server alone."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield

    def install_signal_handlers(self) -> None:  # uvicorn < 0.29 calls this instead
        pass


class _TooLarge(Exception):
    """A request body over ``MAX_BODY_BYTES``."""


def _listen(host: str, port: int) -> list[socket.socket]:
    """Bound listening sockets for every address ``host`` resolves to (as asyncio's create_server
    binds them: SO_REUSEADDR, IPv6 sockets v6-only).

    Raises:
        OSError: an address cannot be bound or ``host`` does not resolve.
    """
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, addr in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(addr)
            sock.listen(2048)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


async def _read_json(request: Request):
    """The request body parsed as JSON.

    Raises:
        _TooLarge: the body is over ``MAX_BODY_BYTES``.
        ValueError: the body is not JSON (or not UTF-8).
    """
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise _TooLarge(f"request body exceeds {MAX_BODY_BYTES} bytes")
    return json.loads(body)


def _json(obj, status: int = 200) -> Response:
    # json.dumps as-is, NaN/Infinity included (a logprob may be -inf), as the decode's json.loads reads it
    return Response(json.dumps(obj), status_code=status, media_type="application/json")


# ---- decode side --------------------------------------------------------------------------
def make_client(api_key: Optional[str] = None) -> httpx.AsyncClient:
    """The engine's client for its peers: no connection limit (one long poll per room in flight),
    every call with its own timeout, no proxies from the environment (peers are direct), and the
    cluster's ``api_key`` on every call (the peers' bootstrap servers check it)."""
    return httpx.AsyncClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
                             timeout=httpx.Timeout(300.0, connect=30.0), trust_env=False,
                             headers=auth_headers(api_key))


async def register_with_prefill(
    client: httpx.AsyncClient, host: str, port: int, reg: Registration, timeout: float
) -> dict:
    """Send the registration and wait for the prefill's KV push (the long poll).

    Returns:
        The prefill's success message (``first_token``, ``cached_tokens``, ``bytes``...).

    Raises:
        RoomFailed: the prefill failed or aborted the room, is unreachable, or nothing came within
            ``timeout`` seconds (SGLang's decode waiting timeout; the whole call, connecting included).
    """
    url = f"http://{host}:{port}/pd/register"
    try:
        async with asyncio.timeout(timeout):
            resp = await client.post(url, json=reg.__dict__, timeout=timeout)
        body = resp.json()
    except (TimeoutError, httpx.TimeoutException):
        raise RoomFailed(f"bootstrap room {reg.room}: no KV from prefill {host}:{port} within {timeout:g}s "
                         "(waiting timeout)") from None
    except (httpx.HTTPError, ValueError) as e:
        raise RoomFailed(f"bootstrap room {reg.room}: prefill bootstrap server {host}:{port} unreachable: "
                         f"{e!r}") from None
    if not isinstance(body, dict) or body.get("status") != "ok":
        reason = body.get("reason", "failed on the prefill") if isinstance(body, dict) else "failed on the prefill"
        raise RoomFailed(f"bootstrap room {reg.room}: {reason}")
    return body


async def abort_on_prefill(client: httpx.AsyncClient, host: str, port: int, room: int, reason: str,
                           timeout: float = ABORT_TIMEOUT) -> None:
    """Tell the prefill the decode gave up on ``room``; returns once no KV write into our pages is
    in flight (or the prefill is unreachable, so none can be; at most ``timeout`` s, after which the
    decode releases its pages as SGLang's deferred KV release does). Never raises."""
    try:
        async with asyncio.timeout(timeout):
            await client.post(f"http://{host}:{port}/pd/abort", json={"room": room, "reason": reason},
                              timeout=timeout)
    except (httpx.HTTPError, TimeoutError) as e:
        log.info("abort of room %s on %s:%s not delivered: %r", room, host, port, e)
