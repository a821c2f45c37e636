"""The PD bootstrap channel: how a decode tells a prefill where to write a room's KV.

Protocol (SGLang's handshake in our words; SGLang does it over its bootstrap HTTP server + ZMQ in
sglang/srt/disaggregation/mooncake/conn.py, we do it over one HTTP server on the prefill's
``--disaggregation-bootstrap-port``):

- ``POST /pd/register`` (decode -> prefill), JSON ``{room, session_id, page_addrs, page_bytes,
  page_size, layout, num_tokens, decode_prefix_len}``: the decode has pre-allocated ``page_addrs`` (addresses in
  its transfer-engine session ``session_id``) for ``num_tokens`` prompt tokens but the first
  ``decode_prefix_len`` (whole pages it already holds from its radix cache; 0 without). The call is a long poll:
  it returns when the prefill has pushed the KV (``{"status": "ok", "first_token": ...}``) or
  failed (``{"status": "failed", "reason": ...}``). A refused connection means a dead prefill.
- ``POST /pd/abort`` (decode -> prefill), ``{room, reason}``: the decode gave up on the room. The
  prefill cancels it and answers only once no KV write into the decode's pages is in flight, so
  the decode may then reuse them. That holds after the room ended too: a write the prefill
  abandoned at its transfer deadline keeps the room "draining" until the transfer engine settles it.
- ``GET /health``.

With the engine's ``--api-key``, ``/pd/register`` and ``/pd/abort`` need ``Authorization: Bearer KEY``
(pd.engines.api.auth; 401 ``{"error": "Unauthorized"}`` otherwise, /health stays open), and the decode's
client sends it: whoever reaches the port could otherwise name where a prefill writes KV or abort its rooms.

A room aborted on either side is remembered for ``tombstone_ttl`` seconds, so the other side's
late arrival fails at once instead of waiting for its timeout.

The server is a Starlette app on an embedded ``uvicorn.Server`` in the engine's event loop (the
engine's own HTTP server is FastAPI on uvicorn); the decode's calls go through the engine's one
``httpx.AsyncClient``. A long poll ends with a result, the waiting timeout, an abort, or its
client's disconnect: a decode that closes its ``/pd/register`` connection gives the room up, and the
prefill aborts the room at once (as an ``/pd/abort`` would) instead of holding it until the timeout.

Validation: pd.engines.handoff.bootstrap_checks (strict models, size caps tied to the engine and the request).

The binding rule: the first valid registration of a room binds it, for the room's life, to that
decode (its transfer-engine ``session_id`` and page lists): the prefill writes the room's KV there and
nowhere else. A second registration of a live room, from anyone, is refused with 409 (param
``room``) and changes nothing about the first; nor can an invalid registration alter a room. A room
the prefill aborted or failed stays refused (tombstoned) for ``tombstone_ttl`` seconds. Who may
register is not checked beyond ``--api-key``: as in SGLang (whose bootstrap server has no key at
all), what keeps a stranger from binding a victim's room is that rooms are 63-bit CSPRNG values drawn
by the router per request (pd.router; unguessable, and never reused), and that the bootstrap port is
reachable only by the cluster's nodes (a firewall's job: it is plain HTTP).
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

from pd.engines.api.auth import ApiKeyMiddleware, auth_headers
from pd.engines.errors import EngineError
from pd.engines.handoff.bootstrap_checks import (
    MAX_ABORT_BODY_BYTES,
    AbortBody,
    BadBody,
    RegisterBody,
    RegistrationLimits,
    check_prompt,
    check_registration,
    parse_body,
    truncate_reason,
)
from pd.util.connection_guard import ConnectionGuard, ConnectionLimits
from pd.util.wait import async_wait_until

log = logging.getLogger(__name__)

SHUTDOWN_GRACE = 5  # s the server waits for open requests when it stops, then cancels them
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
    # Leading prompt tokens whose KV the decode already holds (its radix cache, whole pages): ``page_addrs`` (and
    # ``draft_page_addrs``) start at that page, and the prefill writes only from there (SGLang's decode_prefix_len).
    decode_prefix_len: int = 0
    # With speculative decoding (SGLang registers the draft's KV pool next to the target's): where the draft's
    # KV goes, its layout, and the decode's --speculative-* settings (pd.engines.spec.config.SpecConfig.handshake).
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
    prompt_tokens: Optional[int] = None  # the prefill request's prompt length, once it is attached

    def __post_init__(self) -> None:
        self.no_transfer_in_flight.set()


class BootstrapServer:
    """Prefill side of the bootstrap channel (one per prefill engine).

    Args:
        host, port: where to listen (``--host`` and ``--disaggregation-bootstrap-port``).
        waiting_timeout: seconds a registration may wait for the prefill request (s).
        tombstone_ttl: seconds an aborted room is remembered.
        api_key: the engine's ``--api-key`` (None = open).
        limits: what a registration may ask (the engine's context length, page size, verify window).
    """

    def __init__(self, host: str, port: int, waiting_timeout: float, tombstone_ttl: float,
                 api_key: Optional[str] = None, limits: Optional[RegistrationLimits] = None,
                 on_refused_connection: Optional[Callable[[str], None]] = None):
        self.host = host
        self.api_key = api_key
        self.limits = limits or RegistrationLimits()
        self._on_refused_connection = on_refused_connection
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
        # the engines' limits on client connections (pd.util.connection_guard), at their defaults
        guard = ConnectionGuard(ConnectionLimits.auto(), on_refuse=self._on_refused_connection)
        config = uvicorn.Config(ApiKeyMiddleware(app, self.api_key), lifespan="off", log_config=None,
                                access_log=False, timeout_graceful_shutdown=SHUTDOWN_GRACE, http=guard.protocol(),
                                # uvicorn annotates int seconds; its keep-alive timer takes a float as well
                                timeout_keep_alive=guard.limits.keep_alive_timeout)  # type: ignore[arg-type]
        server = self._server = _EmbeddedServer(config)
        serving = self._serving = asyncio.get_running_loop().create_task(server.serve(sockets=sockets))

        def started() -> bool:
            if serving.done():
                raise RuntimeError(f"bootstrap server on {self.host}:{self.port} stopped while starting")
            return server.started

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
    def attach(self, room: int, on_abort: Callable[[str], None], prompt_tokens: Optional[int] = None) -> Room:
        """Claim ``room`` for a prefill request of ``prompt_tokens`` prompt tokens (a registration that comes
        later must match it; one already there is checked by ``wait_registration``).

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
        rec.prompt_tokens = prompt_tokens
        return rec

    async def wait_registration(self, rec: Room, timeout: float) -> Registration:
        """Wait for the decode to say where to write.

        Raises:
            RoomFailed: the decode aborted, did not register within ``timeout`` seconds, or registered a
                different prompt length than the prefill request's (the room then fails with that reason).
        """
        try:
            reg = await asyncio.wait_for(asyncio.shield(rec.registered), timeout)
        except asyncio.TimeoutError:
            raise RoomFailed(
                f"bootstrap room {rec.room}: no decode registered within {timeout:g}s (bootstrap timeout)"
            ) from None
        problem = check_prompt(reg, rec.prompt_tokens) if rec.prompt_tokens is not None else None
        if problem:
            raise RoomFailed(problem)
        return reg

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
            body = parse_body(RegisterBody, await _read_body(request, self.limits.max_body_bytes))
            check_registration(body, self.limits)
        except BadBody as e:
            return _refusal(e, status_key="status", status_value="failed")
        reg = Registration(**body.model_dump())
        reason = self.tombstone_reason(reg.room)
        if reason is not None:
            return _json({"status": "failed", "reason": f"room {reg.room} was aborted by the prefill: {reason}"})
        rec = self.rooms.get(reg.room)
        if rec is not None and rec.registered.done():
            return _refusal(BadBody(409, f"room {reg.room} already has a decode registered (a room binds to its "
                                         "first registration)", "room"), status_key="status", status_value="failed")
        if rec is not None and rec.prompt_tokens is not None:
            problem = check_prompt(reg, rec.prompt_tokens)
            if problem:
                return _refusal(BadBody(400, f"num_tokens: {problem}", "num_tokens"),
                                status_key="status", status_value="failed")
        if rec is None:
            rec = self.rooms[reg.room] = Room(reg.room)
        rec.registered.set_result(reg)
        left = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait({rec.result, left}, timeout=self.waiting_timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            left.cancel()
        if rec.result.done():
            return _json(rec.result.result())
        if left in done:  # the decode gave the room up: abort it now, not at the waiting timeout
            if self.rooms.get(reg.room) is rec:
                self._abort_room(reg.room, "its /pd/register connection closed")
            return _json({"status": "failed", "reason": "the registration's connection closed"})
        if self.rooms.get(reg.room) is rec:
            self._abort_room(reg.room, "decode waiting timeout")
        return _json({"status": "failed",
                      "reason": f"room {reg.room}: no prefill request arrived within {self.waiting_timeout:g}s"})

    async def _handle_abort(self, request: Request) -> Response:
        try:
            body = parse_body(AbortBody, await _read_body(request, MAX_ABORT_BODY_BYTES))
        except BadBody as e:
            return _refusal(e, status_key="ok", status_value=False)
        room, reason = body.room, truncate_reason(body.reason)
        rec = self._abort_room(room, reason) or self.draining.get(room)
        if rec is not None:
            await rec.no_transfer_in_flight.wait()
        return _json({"ok": True})

    def _abort_room(self, room: int, reason: str) -> Optional[Room]:
        self.tombstone(room, reason)
        rec = self.rooms.pop(room, None)
        if rec is None:
            return None
        if not rec.no_transfer_in_flight.is_set():  # a later /pd/abort must still wait for the write
            self.draining[room] = rec
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


async def _read_body(request: Request, limit: int) -> bytes:
    """The raw request body, refused over ``limit`` bytes before it is parsed (by its Content-Length at once,
    else as it streams in).

    Raises:
        BadBody: 413 over ``limit``.
    """
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BadBody(413, f"request body of {declared} bytes exceeds the bootstrap server's limit of {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise BadBody(413, f"request body exceeds the bootstrap server's limit of {limit} bytes")
    return bytes(body)


async def _disconnected(request: Request) -> None:
    """Return once the client of ``request`` (whose body was read) disconnects: uvicorn's receive() then
    answers ``http.disconnect`` (it blocks until then, or until the response is sent)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _refusal(e: BadBody, status_key: str, status_value) -> Response:
    """A refused request: HTTP ``e.status`` with the engine's error body (pd.engines.errors.EngineError: the
    message and the field at fault) and the route's own failure keys (``status: failed`` or ``ok: false``,
    ``reason``), which the decode's client reads."""
    body = EngineError(e.status, e.message, e.param).body()
    return _json({status_key: status_value, "reason": e.message, **body}, status=e.status)


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
        reason = body.get("reason") if isinstance(body, dict) else None
        if not isinstance(reason, str):
            error = body.get("error") if isinstance(body, dict) else None
            reason = error.get("message") if isinstance(error, dict) else None
        raise RoomFailed(f"bootstrap room {reg.room}: {reason if isinstance(reason, str) else 'failed on the prefill'}")
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
