"""Which worker holds which KV cache page, from the workers' own KV cache events.

Each worker (SGLang, or the reference engine) publishes its prefix cache's changes in SGLang's
format (``sglang/srt/disaggregation/kv_events.py``): a PUB socket sends ``(topic, seq, payload)``
with ``seq`` 8 bytes big-endian, from 0 and one more per batch, and ``payload`` the msgpack array
``[ts, events, attn_dp_rank]``; each event is a map tagged by ``"type"``: ``BlockStored`` and
``BlockRemoved`` carry ``block_hashes`` (int64 page hashes), ``AllBlocksCleared`` none. A ROUTER
replay socket resends buffered batches from a given seq, then an end marker (seq -1).

``KVEventSubscriber`` follows one worker's stream into a ``PrefixIndex``; ``KVIndexManager`` keeps
one subscriber per worker and answers ``overlap`` for the routing policy. The router decodes the
format itself (plain msgpack), so it does not depend on the engine's package.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Iterable, NamedTuple, Optional, Sequence

import msgspec
import zmq
import zmq.asyncio

logger = logging.getLogger(__name__)

END_SEQ = -1  # the replay's end marker, in the seq frame (8 bytes signed big-endian)
_YIELD_EVERY = 1000  # batches applied between yields to the event loop during a replay


class KVEvent(NamedTuple):
    """One decoded event: ``kind`` is ``"stored"``, ``"removed"`` or ``"cleared"``."""

    kind: str
    block_hashes: tuple[int, ...]


class KVBatch(NamedTuple):
    """One decoded batch: ``ts`` in seconds since the epoch (the publisher's clock)."""

    ts: float
    events: list[KVEvent]
    attn_dp_rank: Optional[int]


_KINDS = {"BlockStored": "stored", "BlockRemoved": "removed", "AllBlocksCleared": "cleared"}
_NONE: frozenset[int] = frozenset()


def decode_batch(payload: bytes) -> KVBatch:
    """Decode one batch's msgpack payload; events of unknown types are skipped (newer publishers).

    Raises:
        ValueError: the payload is not msgpack or not shaped like ``[ts, [event...], rank]``.
    """
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as e:
        raise ValueError(f"KV event batch is not msgpack: {e}") from None
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[0], (int, float)) \
            or not isinstance(raw[1], list):
        raise ValueError("KV event batch is not an array [ts, events, attn_dp_rank]")
    rank = raw[2] if len(raw) > 2 and isinstance(raw[2], int) else None
    events = []
    for ev in raw[1]:
        if not isinstance(ev, dict):
            raise ValueError(f"KV event is not a map: {ev!r}")
        kind = _KINDS.get(ev.get("type"))  # type: ignore[arg-type]
        if kind is None:
            continue
        hashes = ev.get("block_hashes", [])
        if not isinstance(hashes, list) or not all(type(h) is int for h in hashes):
            raise ValueError(f"{ev.get('type')} block_hashes is not a list of ints")
        events.append(KVEvent(kind, tuple(hashes)))
    return KVBatch(float(raw[0]), events, rank)


class PrefixIndex:
    """The set of page hashes each worker holds. Not thread-safe: use it from one event loop."""

    def __init__(self) -> None:
        self._blocks: dict[str, set[int]] = {}

    def apply(self, worker: str, batch: KVBatch) -> None:
        """Apply one batch's events in order (a new worker is added). Removing an unknown hash is
        a no-op: it was stored before this index started following the worker, or already dropped."""
        blocks = self._blocks.setdefault(worker, set())
        for ev in batch.events:
            if ev.kind == "stored":
                blocks.update(ev.block_hashes)
            elif ev.kind == "removed":
                blocks.difference_update(ev.block_hashes)
            else:
                blocks.clear()

    def overlap(self, workers: Iterable[str], block_hashes: Sequence[int]) -> dict[str, int]:
        """For each worker, how many of the prompt's pages it holds, counting from the first page
        and stopping at the first one it lacks (a cached prefix is only usable up to a hole).

        Args:
            workers: the candidate workers; unknown ones get 0.
            block_hashes: the prompt's page hashes, first page first.

        Returns:
            ``{worker: pages}``; multiply by the page size for tokens.
        """
        out = {}
        for w in workers:
            blocks = self._blocks.get(w)
            n = 0
            if blocks:
                for h in block_hashes:
                    if h not in blocks:
                        break
                    n += 1
            out[w] = n
        return out

    def pages(self, worker: str) -> set[int] | frozenset[int]:
        """The page hashes ``worker`` holds (the live set: read it, do not change it); empty when unknown."""
        return self._blocks.get(worker) or _NONE

    def reset_worker(self, worker: str) -> None:
        """Forget every page of ``worker`` but keep it known (its stream goes on)."""
        self._blocks[worker] = set()

    def remove_worker(self, worker: str) -> None:
        """Forget ``worker`` entirely; unknown workers are ignored."""
        self._blocks.pop(worker, None)

    def workers(self) -> list[str]:
        """The workers this index knows."""
        return list(self._blocks)

    def size(self, worker: Optional[str] = None) -> int:
        """Pages held by ``worker``, or by all workers together when None."""
        if worker is not None:
            return len(self._blocks.get(worker, ()))
        return sum(len(b) for b in self._blocks.values())


@dataclass
class SubscriberStats:
    """Counters of one worker's event stream, for metrics."""

    batches: int = 0  # batches applied
    events: int = 0  # events applied
    gaps: int = 0  # missed batches detected (a catch-up on joining a running worker counts too)
    replays: int = 0  # replay requests made
    replay_failures: int = 0  # replays that timed out or could not fill the gap
    resets: int = 0  # times this worker's pages were forgotten (gap not filled, restart, bad batch)
    duplicates: int = 0  # live batches already applied from a replay
    restarts: int = 0  # publisher restarts seen (seq went backwards)
    decode_errors: int = 0
    last_seq: int = -1  # the last applied batch's seq
    last_event_ts: Optional[float] = None  # the last applied batch's ts, s since the epoch (publisher's clock)
    last_received_at: Optional[float] = None  # when the last batch arrived, s since the epoch (local clock)


class KVEventSubscriber:
    """Follows one worker's KV events into ``index`` from an asyncio task.

    Batches are applied in seq order. A gap (a seq beyond the last applied one plus one, including
    the first batch after joining a running worker) asks the replay socket for the missed batches;
    if they come back complete they are applied and the index stays exact, else the worker's pages
    are forgotten (stale pages would mislead routing more than missing ones) and the stream goes on.

    Args:
        worker: the name the index files this worker's pages under.
        endpoint: the worker's PUB address (``tcp://host:port``).
        index: the index to update.
        replay_endpoint: the worker's ROUTER replay address; None: gaps just reset.
        topic: the topic prefix to subscribe to.
        replay_timeout: seconds a replay may take, from request to end marker.
        context: an asyncio ZMQ context; None: one sharing the process's ZMQ context.
    """

    def __init__(self, worker: str, endpoint: str, index: PrefixIndex, *, replay_endpoint: Optional[str] = None,
                 topic: str = "", replay_timeout: float = 2.0,
                 context: Optional[zmq.asyncio.Context] = None) -> None:
        self.worker = worker
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.index = index
        self.replay_timeout = replay_timeout
        self.stats = SubscriberStats()
        self._topic = topic.encode("utf-8")
        self._ctx = context or zmq.asyncio.Context.shadow(zmq.Context.instance().underlying)
        self._live_seq: Optional[int] = None  # the last seq seen on the PUB stream (in order there)
        self._task: Optional[asyncio.Task] = None
        self._sub: Optional[zmq.asyncio.Socket] = None

    def start(self) -> None:
        """Connect and start following; call from the running event loop.

        Raises:
            RuntimeError: already started, or no running event loop.
            zmq.ZMQError: the endpoint is malformed.
        """
        if self._task is not None:
            raise RuntimeError(f"KV event subscriber for {self.worker} already started")
        sub = self._ctx.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, 100_000)  # the publisher's default send HWM: queue while a replay runs
            sub.setsockopt(zmq.SUBSCRIBE, self._topic)
            sub.connect(self.endpoint)
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"kv-events-{self.worker}")
        except BaseException:
            sub.close(linger=0)
            raise
        self._sub = sub

    @property
    def running(self) -> bool:
        """Whether the follower task is alive."""
        return self._task is not None and not self._task.done()

    async def close(self, timeout: float = 1.0) -> None:
        """Stop following and close the socket (the index keeps the pages; see ``remove_worker``).

        Args:
            timeout: seconds to wait for the task to finish after cancelling it.
        """
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=timeout)
        if self._sub is not None:
            self._sub.close(linger=0)
            self._sub = None

    async def _run(self) -> None:
        assert self._sub is not None
        while True:
            frames = await self._sub.recv_multipart()
            try:
                await self._on_live(frames)
            except Exception:  # one bad batch must not end the stream
                logger.exception("KV events from %s: batch not applied", self.worker)
                self._reset()

    async def _on_live(self, frames: list) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.stats.decode_errors += 1
            return
        seq = int.from_bytes(frames[1], "big")
        if self._live_seq is not None and seq <= self._live_seq:
            # PUB delivers in order, so a seq going back means the publisher restarted (empty cache).
            self.stats.restarts += 1
            self._reset()
            self.stats.last_seq = -1
        self._live_seq = seq
        if seq <= self.stats.last_seq:
            self.stats.duplicates += 1
            return
        if seq > self.stats.last_seq + 1:
            await self._recover(seq)
            if seq <= self.stats.last_seq:
                return
        self._apply(seq, frames[2])

    async def _recover(self, seq: int) -> None:
        """Fill the batches missed before ``seq`` from the replay socket, or reset the worker."""
        self.stats.gaps += 1
        start = self.stats.last_seq + 1
        got = await self._request_replay(start)
        # Complete: contiguous from ``start`` up to at least the live batch before ``seq``.
        complete = bool(got) and got is not None and got[-1][0] >= seq - 1 \
            and all(s == start + i for i, (s, _) in enumerate(got))
        if not complete:
            logger.warning("KV events from %s: batches %d..%d lost; forgetting its pages", self.worker, start, seq - 1)
            if got is not None:
                self.stats.replay_failures += 1
            self._reset()
        for i, (s, payload) in enumerate(got or ()):
            if s > self.stats.last_seq:  # ascending from start; the guard only shields a confused replay
                self._apply(s, payload)
            if i % _YIELD_EVERY == _YIELD_EVERY - 1:
                await asyncio.sleep(0)
        self.stats.last_seq = max(self.stats.last_seq, seq - 1)

    async def _request_replay(self, start: int) -> Optional[list[tuple[int, bytes]]]:
        """The buffered batches from ``start`` on, or None without a replay socket or on timeout."""
        if self.replay_endpoint is None:
            return None
        self.stats.replays += 1
        sock = self._ctx.socket(zmq.DEALER)  # DEALER, not REQ: one request gets many replies
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)  # a replay may be the whole buffer; ROUTER drops what does not fit
        try:
            sock.connect(self.replay_endpoint)
            out: list[tuple[int, bytes]] = []
            async with asyncio.timeout(self.replay_timeout):
                await sock.send_multipart([b"", start.to_bytes(8, "big")])
                while True:
                    frames = await sock.recv_multipart()  # [b"", topic, seq, payload]
                    if len(frames) != 4 or len(frames[2]) != 8:
                        continue
                    s = int.from_bytes(frames[2], "big", signed=True)
                    if s == END_SEQ:
                        return out
                    out.append((s, frames[3]))
        except TimeoutError:
            self.stats.replay_failures += 1
            logger.warning("KV events from %s: replay from %d timed out after %.3g s",
                           self.worker, start, self.replay_timeout)
            return None
        finally:
            sock.close(linger=0)

    def _apply(self, seq: int, payload: bytes) -> None:
        self.stats.last_seq = seq
        self.stats.last_received_at = time.time()
        try:
            batch = decode_batch(payload)
        except ValueError as e:
            self.stats.decode_errors += 1
            logger.warning("KV events from %s: batch %d undecodable (%s); forgetting its pages", self.worker, seq, e)
            self._reset()
            return
        self.index.apply(self.worker, batch)
        self.stats.batches += 1
        self.stats.events += len(batch.events)
        self.stats.last_event_ts = batch.ts

    def _reset(self) -> None:
        self.stats.resets += 1
        self.index.reset_worker(self.worker)


class KVIndexManager:
    """One ``KVEventSubscriber`` per worker feeding one ``PrefixIndex``; use from one event loop.

    Args:
        replay_timeout: seconds each replay may take.
        context: an asyncio ZMQ context shared by the subscribers; None: see ``KVEventSubscriber``.
    """

    def __init__(self, replay_timeout: float = 2.0, context: Optional[zmq.asyncio.Context] = None) -> None:
        self.index = PrefixIndex()
        self.replay_timeout = replay_timeout
        self._ctx = context
        self._subs: dict[str, KVEventSubscriber] = {}

    def add_worker(self, worker: str, endpoint: str, replay_endpoint: Optional[str] = None,
                   topic: str = "") -> KVEventSubscriber:
        """Start following ``worker``'s events (from the running event loop).

        Raises:
            ValueError: ``worker`` is already followed.
            zmq.ZMQError: an endpoint is malformed.
        """
        if worker in self._subs:
            raise ValueError(f"worker {worker!r} is already followed")
        sub = KVEventSubscriber(worker, endpoint, self.index, replay_endpoint=replay_endpoint, topic=topic,
                                replay_timeout=self.replay_timeout, context=self._ctx)
        sub.start()
        self._subs[worker] = sub
        self.index.reset_worker(worker)
        return sub

    async def remove_worker(self, worker: str, timeout: float = 1.0) -> None:
        """Stop following ``worker`` and drop its pages; unknown workers are ignored.

        Args:
            timeout: seconds to wait for its subscriber to stop.
        """
        sub = self._subs.pop(worker, None)
        if sub is not None:
            await sub.close(timeout)
        self.index.remove_worker(worker)

    def overlap(self, workers: Iterable[str], block_hashes: Sequence[int]) -> dict[str, int]:
        """``PrefixIndex.overlap``: leading prompt pages each worker holds."""
        return self.index.overlap(workers, block_hashes)

    def following(self, worker: str) -> bool:
        """Whether ``worker``'s subscriber is alive (added and its task not ended)."""
        sub = self._subs.get(worker)
        return sub is not None and sub.running

    def last_received_at(self, worker: str) -> Optional[float]:
        """When ``worker``'s last batch arrived (s since the epoch); None before any or when not followed."""
        sub = self._subs.get(worker)
        return sub.stats.last_received_at if sub is not None else None

    def stats(self) -> dict[str, SubscriberStats]:
        """Each followed worker's counters (live objects: copy them to keep a snapshot)."""
        return {w: s.stats for w, s in self._subs.items()}

    async def close(self, timeout: float = 1.0) -> None:
        """Stop every subscriber and drop every worker's pages.

        Args:
            timeout: seconds to wait for each subscriber to stop.
        """
        for worker in list(self._subs):
            await self.remove_worker(worker, timeout)
