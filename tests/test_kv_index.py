"""The router's KV prefix index fed by real engine publishers over loopback: stored and removed pages,
a dropped batch filled by replay (or, when it cannot be, a reset), AllBlocksCleared, publisher
restarts and workers leaving."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from pd.engines.prefix.kv_events import KVEventPublisher, build_batch
from pd.router.kv_index import KVBatch, KVEvent, KVEventSubscriber, KVIndexManager, PrefixIndex, decode_batch
from pd.util.wait import async_wait_until

TIMEOUT = 10.0  # s, every wait's deadline
pytestmark = pytest.mark.usefixtures("no_leaked_threads")
PROBE = -(2**63)  # a hash no test stores: removing it is a no-op, so probes leave the index alone


@pytest.fixture
async def setup():
    """Makes publishers (ephemeral loopback ports) and one manager; closes them all afterwards."""
    pubs: list[KVEventPublisher] = []
    manager = KVIndexManager(replay_timeout=2.0)

    def publisher(replay: bool = True, **kw) -> KVEventPublisher:
        pub = KVEventPublisher("tcp://127.0.0.1:0", bind=True,
                               replay_endpoint="tcp://127.0.0.1:0" if replay else None, **kw)
        pubs.append(pub)
        return pub

    yield publisher, manager
    await manager.close()
    for pub in pubs:
        pub.close(timeout=2.0)


def stored(*hashes: int, parent=None) -> tuple:
    return ("stored", {"block_hashes": list(hashes), "parent_block_hash": parent,
                       "token_ids": [0] * (2 * len(hashes)), "block_size": 2})


def removed(*hashes: int) -> tuple:
    return ("removed", {"block_hashes": list(hashes)})


async def synced(pub: KVEventPublisher, sub: KVEventSubscriber) -> None:
    """Publish no-op probes until the subscriber has applied one (a new SUB misses messages until its
    connection is up), then until it has applied everything published."""
    async def caught_up():
        if sub.stats.last_seq < 0:
            pub.publish([removed(PROBE)])
        return sub.stats.last_seq == pub.next_seq - 1
    await async_wait_until(caught_up, timeout=TIMEOUT, interval=0.02, what="the subscriber caught up")


async def applied(pub: KVEventPublisher, sub: KVEventSubscriber) -> None:
    await async_wait_until(lambda: sub.stats.last_seq == pub.next_seq - 1, timeout=TIMEOUT, interval=0.01,
                           what=f"batch {pub.next_seq - 1} applied")


async def test_stored_and_removed_pages_show_in_overlap(setup):
    publisher, manager = setup
    pub = publisher()
    sub = manager.add_worker("w", pub.endpoint, pub.replay_endpoint)
    await synced(pub, sub)
    assert manager.overlap(["w", "other"], [1, 2, 3]) == {"w": 0, "other": 0}
    pub.publish([stored(1, 2, 3), stored(4, parent=3)])
    await applied(pub, sub)
    assert manager.overlap(["w", "other"], [1, 2, 3, 4, 5]) == {"w": 4, "other": 0}
    assert manager.overlap(["w"], [1, 9, 3]) == {"w": 1}  # only the leading run counts
    assert manager.overlap(["w"], [9, 2, 3]) == {"w": 0}  # the first page is missing: nothing usable
    assert manager.index.size("w") == manager.index.size() == 4
    pub.publish([removed(2), removed(12345)])  # 12345 was never stored: ignored
    await applied(pub, sub)
    assert manager.overlap(["w"], [1, 2, 3, 4]) == {"w": 1}
    assert manager.index.size("w") == 3
    stats = manager.stats()["w"]
    assert stats.events >= 4 and stats.batches >= 3 and stats.resets == 0 and stats.decode_errors == 0
    assert stats.last_event_ts is not None and stats.last_received_at is not None


def drop_once(pub: KVEventPublisher, monkeypatch, seq: int) -> None:
    """Make the publisher skip sending batch ``seq`` live (it is still buffered for replay)."""
    real = pub._send_live
    monkeypatch.setattr(pub, "_send_live", lambda s, payload: None if s == seq else real(s, payload))


async def test_gap_is_filled_by_replay(setup, monkeypatch):
    publisher, manager = setup
    pub = publisher()
    sub = manager.add_worker("w", pub.endpoint, pub.replay_endpoint)
    await synced(pub, sub)
    before = dataclasses.replace(sub.stats)
    pub.publish([stored(1)])
    drop_once(pub, monkeypatch, pub.next_seq)
    pub.publish([stored(2, parent=1)])  # never arrives live
    pub.publish([stored(3, parent=2), removed(1)])
    await applied(pub, sub)
    assert manager.overlap(["w"], [1, 2, 3]) == {"w": 0}
    assert manager.overlap(["w"], [2, 3]) == {"w": 2}
    assert manager.index.size("w") == 2  # pages 2 and 3: the replay filled the hole, nothing was reset
    assert (sub.stats.gaps, sub.stats.replays) == (before.gaps + 1, before.replays + 1)
    assert (sub.stats.resets, sub.stats.replay_failures) == (before.resets, before.replay_failures)


async def test_gap_without_replay_resets_the_worker(setup, monkeypatch):
    publisher, manager = setup
    pub = publisher(replay=False)
    sub = manager.add_worker("w", pub.endpoint)
    await synced(pub, sub)
    resets = sub.stats.resets
    pub.publish([stored(1)])
    await applied(pub, sub)
    drop_once(pub, monkeypatch, pub.next_seq)
    pub.publish([removed(1)])  # lost: page 1 would otherwise stay in the index for ever
    pub.publish([stored(7)])
    await applied(pub, sub)
    assert manager.overlap(["w"], [1]) == {"w": 0}
    assert manager.overlap(["w"], [7]) == {"w": 1}
    assert sub.stats.resets == resets + 1


async def test_gap_beyond_the_replay_buffer_resets(setup, monkeypatch):
    publisher, manager = setup
    pub = publisher(buffer_steps=1)
    sub = manager.add_worker("w", pub.endpoint, pub.replay_endpoint)
    await synced(pub, sub)
    failures = sub.stats.replay_failures
    pub.publish([stored(1)])
    await applied(pub, sub)
    drop_once(pub, monkeypatch, pub.next_seq)
    pub.publish([stored(2)])  # lost, and gone from the one-batch buffer once the next is sent
    pub.publish([stored(3)])
    await applied(pub, sub)
    assert manager.index.size("w") == 1 and manager.overlap(["w"], [3]) == {"w": 1}
    assert sub.stats.replay_failures == failures + 1


async def test_joining_a_running_worker_catches_up_by_replay(setup):
    publisher, manager = setup
    pub = publisher()
    pub.publish([stored(1, 2)])  # before anyone listens
    pub.publish([stored(3, parent=2)])
    sub = manager.add_worker("w", pub.endpoint, pub.replay_endpoint)
    await synced(pub, sub)
    assert manager.overlap(["w"], [1, 2, 3]) == {"w": 3}


async def test_all_blocks_cleared_resets(setup):
    publisher, manager = setup
    pub = publisher()
    sub = manager.add_worker("w", pub.endpoint, pub.replay_endpoint)
    await synced(pub, sub)
    pub.publish([stored(1, 2)])
    pub.publish([("cleared", {}), stored(5)])
    await applied(pub, sub)
    assert manager.overlap(["w"], [1, 2]) == {"w": 0}
    assert manager.overlap(["w"], [5]) == {"w": 1}
    assert manager.index.size("w") == 1


async def test_worker_removal_drops_its_pages(setup):
    publisher, manager = setup
    pubs = [publisher(), publisher()]
    subs = [manager.add_worker(f"w{i}", p.endpoint, p.replay_endpoint) for i, p in enumerate(pubs)]
    for i, (p, s) in enumerate(zip(pubs, subs)):
        await synced(p, s)
        p.publish([stored(1, 2 + i)])
        await applied(p, s)
    assert manager.overlap(["w0", "w1"], [1, 2]) == {"w0": 2, "w1": 1}
    with pytest.raises(ValueError, match="already followed"):
        manager.add_worker("w0", pubs[0].endpoint)
    await manager.remove_worker("w0")
    assert not subs[0].running and subs[1].running
    assert manager.overlap(["w0", "w1"], [1, 2]) == {"w0": 0, "w1": 1}
    assert manager.index.workers() == ["w1"] and set(manager.stats()) == {"w1"}
    await manager.remove_worker("w0")  # twice: a no-op


async def test_publisher_restart_resets_the_worker(setup):
    """A restarted engine starts again at seq 0 with an empty cache (fed frame by frame)."""
    index = PrefixIndex()
    sub = KVEventSubscriber("w", "tcp://127.0.0.1:1", index)  # never started: frames are fed directly

    def frames(seq, events):
        return [b"", seq.to_bytes(8, "big"), msgspec.msgpack.encode(build_batch(events, ts=1.0))]

    for seq in range(3):
        await sub._on_live(frames(seq, [stored(10 + seq)]))
    assert index.size("w") == 3
    await sub._on_live(frames(0, [stored(99)]))
    assert (index.size("w"), sub.stats.restarts, sub.stats.last_seq) == (1, 1, 0)
    await sub._on_live([b"", b"short", b""])
    await sub._on_live(frames(1, [])[:2] + [b"\xc1"])  # not msgpack: the worker is forgotten
    assert (index.size("w"), sub.stats.decode_errors, sub.stats.last_seq) == (0, 2, 1)
    await sub.close()


def test_decode_batch():
    payload = msgspec.msgpack.encode(build_batch([stored(1, 2), removed(2), ("cleared", {})], ts=5.0,
                                                 attn_dp_rank=1))
    assert decode_batch(payload) == KVBatch(5.0, [KVEvent("stored", (1, 2)), KVEvent("removed", (2,)),
                                                  KVEvent("cleared", ())], 1)
    # An event type this router does not know (a newer publisher) is skipped, not an error.
    newer = msgspec.msgpack.encode([1.0, [{"type": "BlockPinned", "block_hashes": [1]}], None])
    assert decode_batch(newer) == KVBatch(1.0, [], None)
    for bad in (b"\xc1", msgspec.msgpack.encode({"ts": 1}), msgspec.msgpack.encode([1.0, [5]]),
                msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": ["x"]}]])):
        with pytest.raises(ValueError):
            decode_batch(bad)
