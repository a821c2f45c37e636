"""KV cache events in SGLang's wire format: the config, the event structs and a ZMQ publisher.

The format is SGLang's (``sglang/srt/disaggregation/kv_events.py`` in SGLang 0.5.23), so a router
written for SGLang reads this engine unchanged:

- A PUB socket sends one multipart message per batch: ``(topic, seq, payload)``. ``seq`` is the
  batch's sequence number as 8 bytes big-endian, from 0 and one more per batch; ``payload`` is the
  msgpack of a ``KVEventBatch``, a positional array ``[ts, events, attn_dp_rank]``.
- Each event is a msgpack map tagged with its class name under ``"type"`` (``BlockStored``,
  ``BlockRemoved``, ``AllBlocksCleared``); optional fields left at ``None`` are omitted.
- An optional ROUTER replay socket answers a request ``[identity, b"", start_seq (8 bytes BE)]``
  with one message ``(identity, b"", topic, seq, payload)`` per buffered batch with ``seq >=
  start_seq``, then the end marker ``(identity, b"", b"", (-1) as 8 bytes signed BE, b"")``.

Block hashes are int64 page hashes computed by the engine's prefix cache; this module carries them.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections import deque
from typing import Any, Iterable, Literal, Mapping, Optional, Union

import msgspec
import zmq
from pydantic import BaseModel, ConfigDict, Field, ValidationError

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's end marker, in the seq frame


class KVEventsConfig(BaseModel):
    """``--kv-events-config``: SGLang's JSON keys and defaults (``KVEventsConfig`` in SGLang's
    ``kv_events.py``). Unknown keys are rejected, so a typo does not silently disable publishing."""

    model_config = ConfigDict(extra="forbid")

    publisher: Literal["null", "zmq"] = "null"  # "null": events are not published at all
    endpoint: str = "tcp://*:5557"  # the PUB socket's address
    bind: Optional[bool] = None  # bind (True) or connect (False); None: bind wildcard/ipc/inproc addresses
    replay_endpoint: Optional[str] = None  # the ROUTER replay socket's address (always bound); None: no replay
    buffer_steps: int = Field(10_000, ge=1)  # batches kept for replay
    hwm: int = Field(100_000, ge=0)  # ZMQ send high-water mark, in messages (0: unlimited)
    max_queue_size: int = Field(100_000, ge=1)  # batches queued for the sender thread before new ones drop
    topic: str = ""  # the first frame of every message; subscribers filter on its prefix
    format: Literal["default", "dynamo"] = "default"  # carried for SGLang parity; only "default" hashes exist here

    @classmethod
    def from_cli(cls, value: str) -> "KVEventsConfig":
        """Parse the ``--kv-events-config`` JSON string.

        Raises:
            ValueError: the string is not a JSON object, has an unknown key or a bad value; the
                message names each offending key.
        """
        try:
            return cls.model_validate_json(value)
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or '(whole value)'}: {err['msg']}"
                                 for err in e.errors())
            raise ValueError(problems) from None  # the caller names the flag and shows the value


# The structs below mirror SGLang's field for field, in the same order and with the same options:
# msgpack of a tagged/array-like Struct depends on both, and subscribers decode by position and name.

class EventBatch(msgspec.Struct, array_like=True, gc=False):
    """A batch of events: msgpack ``[ts, events, attn_dp_rank]``; ``ts`` is seconds since the epoch."""

    ts: float
    events: list[Any]
    attn_dp_rank: Optional[int] = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the events: a msgpack map with ``"type"`` = the class name; ``None`` defaults omitted."""


class BlockStored(KVCacheEvent):
    """Full pages entered the cache: ``block_hashes`` in prompt order, chained from ``parent_block_hash``
    (None: from the root); ``token_ids`` are the pages' tokens; ``block_size`` is tokens per page."""

    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str] = None
    cache_salt: Optional[str] = None
    session_id: Optional[str] = None
    lora_name: Optional[str] = None


class BlockRemoved(KVCacheEvent):
    """Pages left the cache (evicted or freed)."""

    block_hashes: list[int]
    medium: Optional[str] = None


class AllBlocksCleared(KVCacheEvent):
    """The whole cache was flushed."""


class KVEventBatch(EventBatch):
    """``EventBatch`` with the event types spelled out, so a decoder gets the classes back."""

    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


# Short names the engine may use instead of the class names.
_KINDS: dict[str, type[KVCacheEvent]] = {
    "stored": BlockStored, "removed": BlockRemoved, "cleared": AllBlocksCleared,
    "Stored": BlockStored, "Removed": BlockRemoved, "Cleared": AllBlocksCleared,  # the radix cache's classes
    "BlockStored": BlockStored, "BlockRemoved": BlockRemoved, "AllBlocksCleared": AllBlocksCleared,
}

EventSpec = Union[KVCacheEvent, tuple[str, Mapping[str, Any]], Any]


def build_event(kind: str, fields: Mapping[str, Any]) -> KVCacheEvent:
    """One event from its kind and fields, so the engine need not import msgspec.

    Args:
        kind: ``"stored"``/``"Stored"``/``"BlockStored"``, ``"removed"``/``"Removed"``/``"BlockRemoved"``
            or ``"cleared"``/``"Cleared"``/``"AllBlocksCleared"``.
        fields: the struct's fields by name; for ``stored``, ``parent_block_hash`` and ``lora_id``
            default to None here (SGLang requires them on the wire, so they are always encoded).

    Raises:
        ValueError: unknown kind, unknown field, missing field or a value of the wrong type.
    """
    cls = _KINDS.get(kind)
    if cls is None:
        raise ValueError(f"unknown KV event kind {kind!r}; expected one of {sorted(_KINDS)}")
    data = dict(fields)
    unknown = set(data) - set(cls.__struct_fields__)
    if unknown:  # msgspec.convert ignores unknown keys; a misspelt field must not vanish silently
        raise ValueError(f"unknown fields for KV event {kind!r}: {sorted(unknown)}")
    if cls is BlockStored:
        data.setdefault("parent_block_hash", None)
        data.setdefault("lora_id", None)
    try:
        # convert() checks types (ints are ints, lists are lists), unlike the constructor.
        return msgspec.convert(data, cls, strict=True)
    except (msgspec.ValidationError, TypeError) as e:
        raise ValueError(f"bad fields for KV event {kind!r}: {e}") from None


def build_batch(events: Iterable[EventSpec], ts: Optional[float] = None,
                attn_dp_rank: Optional[int] = None) -> KVEventBatch:
    """A batch from events, each a ``KVCacheEvent``, a ``(kind, fields)`` pair (see ``build_event``) or
    a dataclass named like a kind (the radix cache's ``Stored``/``Removed``/``Cleared``).

    Args:
        events: the events in the order they happened.
        ts: the batch's timestamp in seconds since the epoch; None: now.
        attn_dp_rank: the attention-DP rank the cache belongs to (None on a single-rank engine).

    Raises:
        ValueError: an event is neither a ``KVCacheEvent`` nor a valid ``(kind, fields)`` pair.
    """
    out: list[Any] = []
    for ev in events:
        if isinstance(ev, KVCacheEvent):
            out.append(ev)
        elif isinstance(ev, tuple) and len(ev) == 2:
            out.append(build_event(*ev))
        elif dataclasses.is_dataclass(ev) and not isinstance(ev, type):
            # The radix cache's own Stored/Removed/Cleared: matched by class name, so no import cycle.
            out.append(build_event(type(ev).__name__, {f.name: getattr(ev, f.name) for f in dataclasses.fields(ev)}))
        else:
            raise ValueError(f"a KV event must be a KVCacheEvent, a (kind, fields) pair or an event dataclass, "
                             f"got {ev!r}")
    return KVEventBatch(ts=time.time() if ts is None else ts, events=out, attn_dp_rank=attn_dp_rank)


def _should_bind(endpoint: str, bind: Optional[bool]) -> bool:
    """SGLang's rule: an explicit ``bind`` wins; else bind wildcard hosts and ipc/inproc, connect others."""
    if bind is not None:
        return bind
    return any(w in endpoint for w in ("*", "0.0.0.0", "::")) or endpoint.startswith(("ipc://", "inproc://"))


_STOP = object()  # queued by close(): the sender thread exits after sending what came before it


class KVEventPublisher:
    """Publishes event batches on a ZMQ PUB socket, with an optional ROUTER replay socket.

    ``publish`` encodes the batch and queues it (never blocks); one background thread owns both
    sockets, sends the queue in order, keeps the last ``buffer_steps`` batches and answers replay
    requests. Sequence numbers are given in ``publish``, so a batch dropped because the queue is
    full still uses its number and subscribers see the gap.

    Args:
        endpoint: the PUB address (``tcp://*:5557``; ``tcp://127.0.0.1:0`` with ``bind=True`` binds
            an ephemeral port, read back from ``endpoint``).
        replay_endpoint: the ROUTER address, always bound; None: no replay.
        bind: bind or connect the PUB socket; None: SGLang's rule (bind wildcard, ipc, inproc).
        buffer_steps: batches kept for replay (>= 1).
        hwm: ZMQ send high-water mark of both sockets, in messages (0: unlimited).
        max_queue_size: batches waiting for the sender thread before ``publish`` drops new ones.
        topic: the first frame of every message.
        attn_dp_rank: written into each batch whose own rank is None.
        context: the ZMQ context; None: the process's shared one (never terminated here).

    Raises:
        zmq.ZMQError: a socket cannot bind or connect (the address is in use or malformed).
        ValueError: ``buffer_steps`` or ``max_queue_size`` below 1.
    """

    def __init__(self, endpoint: str = "tcp://*:5557", *, replay_endpoint: Optional[str] = None,
                 bind: Optional[bool] = None, buffer_steps: int = 10_000, hwm: int = 100_000,
                 max_queue_size: int = 100_000, topic: str = "", attn_dp_rank: Optional[int] = None,
                 context: Optional[zmq.Context] = None) -> None:
        if buffer_steps < 1 or max_queue_size < 1:
            raise ValueError(f"buffer_steps and max_queue_size must be >= 1, got {buffer_steps}, {max_queue_size}")
        self._topic = topic.encode("utf-8")
        self._attn_dp_rank = attn_dp_rank
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)  # (seq, payload), sender thread only
        self._encoder = msgspec.msgpack.Encoder()
        self._lock = threading.Lock()  # orders seq numbers with queue order across publishing threads
        self._next_seq = 0
        self._closed = False
        self._abort = threading.Event()  # close()'s deadline passed: stop without draining
        self.dropped = 0  # batches dropped because the queue was full
        self.sent = 0  # batches sent on the PUB socket
        self.replays_served = 0
        ctx = context or zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._replay: Optional[zmq.Socket] = None
        try:
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.setsockopt(zmq.SNDHWM, hwm)
            if _should_bind(endpoint, bind):
                self._pub.bind(endpoint)
                self._endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self._pub.connect(endpoint)
                self._endpoint = endpoint
            self._replay_endpoint: Optional[str] = None
            if replay_endpoint is not None:
                self._replay = ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.setsockopt(zmq.SNDHWM, hwm)  # a replay sends up to buffer_steps messages at once
                self._replay.bind(replay_endpoint)
                self._replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except BaseException:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: KVEventsConfig, attn_dp_rank: Optional[int] = None,
                    context: Optional[zmq.Context] = None) -> Optional["KVEventPublisher"]:
        """The publisher ``config`` describes, or None when ``config.publisher`` is ``"null"``.

        Raises:
            zmq.ZMQError: a socket cannot bind or connect.
        """
        if config.publisher == "null":
            return None
        return cls(config.endpoint, replay_endpoint=config.replay_endpoint, bind=config.bind,
                   buffer_steps=config.buffer_steps, hwm=config.hwm, max_queue_size=config.max_queue_size,
                   topic=config.topic, attn_dp_rank=attn_dp_rank, context=context)

    @property
    def endpoint(self) -> str:
        """The PUB socket's address: the bound one (ephemeral port resolved) or the connected one."""
        return self._endpoint

    @property
    def topic(self) -> str:
        """The topic every message carries (the subscribers' filter)."""
        return self._topic.decode("utf-8")

    @property
    def replay_endpoint(self) -> Optional[str]:
        """The ROUTER replay socket's bound address, or None without replay."""
        return self._replay_endpoint

    @property
    def next_seq(self) -> int:
        """The sequence number the next published batch gets."""
        return self._next_seq

    def publish(self, events: Union[list[EventSpec], KVEventBatch]) -> Optional[int]:
        """Queue one batch for sending; thread-safe and non-blocking.

        Args:
            events: a list of events as ``build_batch`` takes them (``KVCacheEvent``, ``(kind,
                fields)`` pairs, the radix cache's event dataclasses), or a ready ``KVEventBatch``.
                An empty list publishes nothing.

        Returns:
            The batch's sequence number, or None for an empty list.

        Raises:
            RuntimeError: the publisher is closed.
            ValueError: an event is malformed (see ``build_batch``).
        """
        batch = events if isinstance(events, KVEventBatch) else build_batch(events)
        if not batch.events:
            return None
        if batch.attn_dp_rank is None:
            batch.attn_dp_rank = self._attn_dp_rank
        payload = self._encoder.encode(batch)  # here, so later changes to the engine's lists do not leak in
        with self._lock:
            if self._closed:
                raise RuntimeError("KV event publisher is closed")
            seq = self._next_seq
            self._next_seq += 1
            try:
                self._queue.put_nowait((seq, payload))
            except queue.Full:
                self.dropped += 1
                logger.warning("KV event queue full: dropped batch %d (%d dropped so far)", seq, self.dropped)
        return seq

    def close(self, timeout: float = 1.0) -> None:
        """Send what is queued, then close both sockets; idempotent.

        Args:
            timeout: seconds to wait for the queue to drain; past it, unsent batches are dropped
                and the thread is stopped (it checks every 50 ms).
        """
        deadline = time.monotonic() + max(timeout, 0.0)
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._queue.put(_STOP, timeout=max(deadline - time.monotonic(), 0.001))
        except queue.Full:
            self._abort.set()
        self._thread.join(max(deadline - time.monotonic(), 0.0))
        if self._thread.is_alive():
            logger.warning("KV event publisher did not drain within %.3g s; dropping %d queued batches",
                           timeout, self._queue.qsize())
            self._abort.set()
            self._thread.join(1.0)

    def _send_live(self, seq: int, payload: bytes) -> None:
        """Send one batch to subscribers (a method, so tests can drop one on purpose)."""
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), copy=False)

    def _run(self) -> None:
        """The sender thread: the only user of the sockets once the constructor returns."""
        try:
            while not self._abort.is_set():
                self._serve_replays()
                try:
                    item = self._queue.get(timeout=0.05)
                except queue.Empty:
                    continue
                if item is _STOP:
                    break
                seq, payload = item
                try:
                    self._send_live(seq, payload)
                    self.sent += 1
                except zmq.ZMQError as e:  # PUB never blocks; an error here is a closed context
                    logger.error("KV event batch %d not sent: %s", seq, e)
                self._buffer.append((seq, payload))  # replayable even if the live send failed
        except Exception:
            logger.exception("KV event publisher thread failed")
        finally:
            self._close_sockets()

    def _serve_replays(self) -> None:
        """Answer every waiting replay request (see the module docstring for the frames)."""
        if self._replay is None:
            return
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                logger.warning("ignoring a malformed KV event replay request (%d frames)", len(frames))
                continue
            client, start = frames[0], int.from_bytes(frames[2], "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
            self.replays_served += 1  # before the end marker, so a client that got it sees the count
            self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None and not sock.closed:
                sock.close(linger=0)
