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
  the decode may then reuse them.
- ``GET /health``.

A room aborted on either side is remembered for ``tombstone_ttl`` seconds, so the other side's
late arrival fails at once instead of waiting for its timeout.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import aiohttp
from aiohttp import web

from pd.engines.errors import EngineError

log = logging.getLogger(__name__)


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


@dataclass
class Room:
    """Prefill-side state of one bootstrap room."""

    room: int
    registered: asyncio.Future = field(default_factory=lambda: asyncio.get_event_loop().create_future())
    result: asyncio.Future = field(default_factory=lambda: asyncio.get_event_loop().create_future())
    prefill_attached: bool = False
    no_transfer_in_flight: asyncio.Event = field(default_factory=asyncio.Event)
    on_abort: Optional[Callable[[str], None]] = None

    def __post_init__(self) -> None:
        self.no_transfer_in_flight.set()


class BootstrapServer:
    """Prefill side of the bootstrap channel (one per prefill engine).

    Args:
        host, port: where to listen (``--host`` and ``--disaggregation-bootstrap-port``).
        waiting_timeout: seconds a registration may wait for the prefill request (s).
        tombstone_ttl: seconds an aborted room is remembered.
    """

    def __init__(self, host: str, port: int, waiting_timeout: float, tombstone_ttl: float):
        self.host = host
        self.port = port
        self.waiting_timeout = waiting_timeout
        self.tombstone_ttl = tombstone_ttl
        self.rooms: dict[int, Room] = {}
        self.tombstones: dict[int, tuple[str, float]] = {}
        self._runner: Optional[web.AppRunner] = None

    # ---- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        """Start serving /pd/register, /pd/abort and /health on ``host:port``."""
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/pd/register", self._handle_register)
        app.router.add_post("/pd/abort", self._handle_abort)
        app.router.add_get("/health", self._handle_health)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()

    async def stop(self) -> None:
        """Stop the HTTP server (idempotent)."""
        if self._runner is not None:
            await self._runner.cleanup()

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
            rec.result.set_result({"status": "ok", **meta} if meta is not None else {"status": "failed", "reason": reason})
        if meta is None:
            self.tombstone(rec.room, reason or "aborted by prefill")
        if self.rooms.get(rec.room) is rec:
            del self.rooms[rec.room]

    # ---- HTTP handlers (decode -> prefill) ----------------------------------------------
    async def _handle_health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "rooms": len(self.rooms)})

    async def _handle_register(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            reg = Registration(**{k: body[k] for k in Registration.__dataclass_fields__})
        except (ValueError, KeyError, TypeError) as e:
            return web.json_response({"status": "failed", "reason": f"bad registration: {e!r}"}, status=400)
        reason = self.tombstone_reason(reg.room)
        if reason is not None:
            return web.json_response({"status": "failed", "reason": f"room {reg.room} was aborted by the prefill: {reason}"})
        rec = self.rooms.get(reg.room)
        if rec is None:
            rec = self.rooms[reg.room] = Room(reg.room)
        if rec.registered.done():
            return web.json_response({"status": "failed", "reason": f"room {reg.room} already has a decode registered"}, status=409)
        rec.registered.set_result(reg)
        try:
            result = await asyncio.wait_for(asyncio.shield(rec.result), self.waiting_timeout)
        except asyncio.TimeoutError:
            result = {"status": "failed", "reason": f"room {reg.room}: no prefill request arrived within {self.waiting_timeout:g}s"}
            self._abort_room(reg.room, "decode waiting timeout")
        return web.json_response(result)

    async def _handle_abort(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            room = int(body["room"])
            reason = str(body.get("reason", "aborted by decode"))
        except (ValueError, KeyError, TypeError) as e:
            return web.json_response({"ok": False, "reason": f"bad abort: {e!r}"}, status=400)
        rec = self._abort_room(room, reason)
        if rec is not None:
            await rec.no_transfer_in_flight.wait()
        return web.json_response({"ok": True})

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


# ---- decode side --------------------------------------------------------------------------
async def register_with_prefill(
    session: aiohttp.ClientSession, host: str, port: int, reg: Registration, timeout: float
) -> dict:
    """Send the registration and wait for the prefill's KV push (the long poll).

    Returns:
        The prefill's success message (``first_token``, ``cached_tokens``, ``bytes``...).

    Raises:
        RoomFailed: the prefill failed or aborted the room, is unreachable, or nothing came within
            ``timeout`` seconds (SGLang's decode waiting timeout).
    """
    url = f"http://{host}:{port}/pd/register"
    try:
        async with session.post(url, json=reg.__dict__, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            body = await resp.json()
    except asyncio.TimeoutError:
        raise RoomFailed(f"bootstrap room {reg.room}: no KV from prefill {host}:{port} within {timeout:g}s (waiting timeout)") from None
    except (aiohttp.ClientError, ValueError) as e:
        raise RoomFailed(f"bootstrap room {reg.room}: prefill bootstrap server {host}:{port} unreachable: {e!r}") from None
    if body.get("status") != "ok":
        raise RoomFailed(f"bootstrap room {reg.room}: {body.get('reason', 'failed on the prefill')}")
    return body


async def abort_on_prefill(session: aiohttp.ClientSession, host: str, port: int, room: int, reason: str) -> None:
    """Tell the prefill the decode gave up on ``room``; returns once no KV write into our pages is
    in flight (or the prefill is unreachable, so none can be). Never raises."""
    try:
        async with session.post(
            f"http://{host}:{port}/pd/abort",
            json={"room": room, "reason": reason},
            timeout=aiohttp.ClientTimeout(total=30),
        ) as resp:
            await resp.read()
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        log.info("abort of room %s on %s:%s not delivered: %r", room, host, port, e)


