"""The engine's KV event publisher against SGLang's own wire format: its structs encode to the same
bytes and decode with SGLang's classes, the replay socket answers like SGLang's, and the config reads
SGLang's ``--kv-events-config`` JSON."""

from __future__ import annotations

import threading

import msgspec
import pytest
import zmq
from sglang.srt.disaggregation import kv_events as sgl

from pd.engines.prefix import kv_events as kv
from pd.engines.prefix.radix_cache import Cleared, Removed, Stored
from pd.util.wait import wait_until

TIMEOUT = 10.0  # s, every wait's deadline
pytestmark = pytest.mark.usefixtures("no_leaked_threads")
END = (-1).to_bytes(8, "big", signed=True)  # the replay's end marker; the DEALER sees [b"", b"", END, b""]


@pytest.fixture
def publisher():
    pubs = []

    def make(**kw) -> kv.KVEventPublisher:
        kw.setdefault("bind", True)
        pub = kv.KVEventPublisher("tcp://127.0.0.1:0", **kw)
        pubs.append(pub)
        return pub

    yield make
    for pub in pubs:
        pub.close(timeout=2.0)


def _events():
    return [
        ("stored", {"block_hashes": [11, -22], "parent_block_hash": None, "token_ids": [1, 2, 3, 4],
                    "block_size": 2}),
        ("BlockStored", {"block_hashes": [33], "parent_block_hash": -22, "token_ids": [5, 6], "block_size": 2,
                         "lora_id": 7, "medium": "GPU", "cache_salt": "s", "session_id": "x", "lora_name": "l"}),
        ("removed", {"block_hashes": [11]}),
        ("removed", {"block_hashes": [33], "medium": "CPU_PINNED"}),
        ("cleared", {}),
    ]


def _sglang_events():
    return [
        sgl.BlockStored(block_hashes=[11, -22], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=2,
                        lora_id=None),
        sgl.BlockStored(block_hashes=[33], parent_block_hash=-22, token_ids=[5, 6], block_size=2, lora_id=7,
                        medium="GPU", cache_salt="s", session_id="x", lora_name="l"),
        sgl.BlockRemoved(block_hashes=[11]),
        sgl.BlockRemoved(block_hashes=[33], medium="CPU_PINNED"),
        sgl.AllBlocksCleared(),
    ]


def _same(ours: kv.KVEventBatch, theirs: sgl.KVEventBatch) -> None:
    assert (theirs.ts, theirs.attn_dp_rank) == (ours.ts, ours.attn_dp_rank)
    assert [type(e).__name__ for e in theirs.events] == [type(e).__name__ for e in ours.events]
    assert [msgspec.structs.asdict(e) for e in theirs.events] == [msgspec.structs.asdict(e) for e in ours.events]


@pytest.mark.parametrize("rank", [None, 3])
def test_batch_bytes_equal_sglang(rank):
    ours = kv.build_batch(_events(), ts=1234.5, attn_dp_rank=rank)
    theirs = sgl.KVEventBatch(ts=1234.5, events=_sglang_events(), attn_dp_rank=rank)
    payload = msgspec.msgpack.encode(ours)
    assert payload == msgspec.msgpack.encode(theirs)
    _same(ours, msgspec.msgpack.Decoder(sgl.KVEventBatch).decode(payload))
    # And the other way round: SGLang's bytes decode into our classes.
    assert msgspec.msgpack.Decoder(kv.KVEventBatch).decode(msgspec.msgpack.encode(theirs)) == ours


def test_build_event_rejects_bad_fields():
    with pytest.raises(ValueError, match="unknown KV event kind"):
        kv.build_event("evicted", {})
    with pytest.raises(ValueError, match="unknown fields.*blok_hashes"):
        kv.build_event("removed", {"blok_hashes": [1]})
    with pytest.raises(ValueError, match="Expected `int`"):
        kv.build_event("removed", {"block_hashes": ["1"]})
    with pytest.raises(ValueError, match="block_size"):
        kv.build_event("stored", {"block_hashes": [1], "token_ids": [1]})
    with pytest.raises(ValueError, match="pair"):
        kv.build_batch([42])


def test_radix_cache_events_convert():
    batch = kv.build_batch([Stored([1, 2], None, [9, 9, 8, 8], 2), Removed([1]), Cleared()], ts=1.0)
    assert batch.events == [kv.BlockStored([1, 2], None, [9, 9, 8, 8], 2, None), kv.BlockRemoved([1]),
                            kv.AllBlocksCleared()]


def _subscribe(pub: kv.KVEventPublisher, topic: bytes = b"") -> zmq.Socket:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(pub.endpoint)
    return sub


def _recv(sock: zmq.Socket) -> list[bytes]:
    assert sock.poll(int(TIMEOUT * 1000)), "no message within the deadline"
    return sock.recv_multipart()


def _sync(pub: kv.KVEventPublisher, sub: zmq.Socket) -> int:
    """Publish probes until one arrives (a new SUB misses messages until it is connected); its seq."""
    def arrived():
        pub.publish([("removed", {"block_hashes": [0]})])
        return sub.poll(50) and sub.recv_multipart()
    frames = wait_until(arrived, timeout=TIMEOUT, interval=0.01, what="a first message on the SUB socket")
    seq = int.from_bytes(frames[1], "big")
    wait_until(lambda: pub.sent == pub.next_seq, timeout=TIMEOUT, interval=0.01, what="the probes sent")
    while sub.poll(0):  # the probes after the first
        seq = int.from_bytes(sub.recv_multipart()[1], "big")
    return seq


def test_live_batches_decode_with_sglang(publisher):
    pub = publisher(topic="kv", attn_dp_rank=2)
    assert pub.endpoint.startswith("tcp://127.0.0.1:") and not pub.endpoint.endswith(":0")
    sub = _subscribe(pub, b"kv")
    try:
        last = _sync(pub, sub)
        decoder = msgspec.msgpack.Decoder(sgl.KVEventBatch)
        for i, spec in enumerate(_events()):
            assert pub.publish([spec]) == last + 1 + i
            topic, seq, payload = _recv(sub)
            assert (topic, int.from_bytes(seq, "big"), len(seq)) == (b"kv", last + 1 + i, 8)
            theirs = decoder.decode(payload)
            assert theirs.attn_dp_rank == 2
            _same(kv.build_batch([spec], ts=theirs.ts, attn_dp_rank=2), theirs)
        assert pub.publish([]) is None  # nothing to say: no batch, no seq used
        assert pub.next_seq == last + 1 + len(_events())
    finally:
        sub.close(linger=0)


def _replay(pub: kv.KVEventPublisher, start: int) -> list[list[bytes]]:
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(pub.replay_endpoint)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            out.append(_recv(dealer))
            if out[-1][2] == END:
                return out
    finally:
        dealer.close(linger=0)


def test_replay_sends_buffer_then_end_marker(publisher):
    pub = publisher(replay_endpoint="tcp://127.0.0.1:0", buffer_steps=3, topic="t")
    assert pub.replay_endpoint.startswith("tcp://127.0.0.1:") and pub.replay_endpoint != pub.endpoint
    for i in range(5):
        assert pub.publish([("removed", {"block_hashes": [i]})]) == i
    wait_until(lambda: pub.sent == 5, timeout=TIMEOUT, interval=0.01, what="5 batches sent")
    msgs = _replay(pub, 0)  # only the last 3 are kept; each is [b"", topic, seq, payload]
    assert msgs[-1] == [b"", b"", END, b""]
    decoder = msgspec.msgpack.Decoder(sgl.KVEventBatch)
    got = [(m[0], m[1], int.from_bytes(m[2], "big"), decoder.decode(m[3]).events[0].block_hashes) for m in msgs[:-1]]
    assert got == [(b"", b"t", s, [s]) for s in (2, 3, 4)]
    assert [int.from_bytes(m[2], "big") for m in _replay(pub, 4)[:-1]] == [4]
    assert _replay(pub, 9) == [[b"", b"", END, b""]]
    assert pub.replays_served == 3


def test_full_queue_drops_but_uses_the_seq(publisher, monkeypatch):
    pub = publisher(max_queue_size=1)
    entered, release = threading.Event(), threading.Event()
    real_send = pub._send_live

    def slow_send(seq, payload):
        entered.set()
        release.wait(TIMEOUT)
        real_send(seq, payload)

    monkeypatch.setattr(pub, "_send_live", slow_send)
    assert pub.publish([("cleared", {})]) == 0
    assert entered.wait(TIMEOUT)  # the thread holds batch 0, so the queue is empty
    assert pub.publish([("cleared", {})]) == 1  # queued
    assert pub.publish([("cleared", {})]) == 2  # dropped: subscribers will see seq 2 missing
    assert pub.dropped == 1
    release.set()
    wait_until(lambda: pub.sent == 2, timeout=TIMEOUT, interval=0.01, what="2 batches sent")


def test_publish_from_threads_gives_unique_seqs(publisher):
    pub = publisher()
    seqs: list[int] = []
    lock = threading.Lock()

    def work():
        for _ in range(200):
            s = pub.publish([("removed", {"block_hashes": [1]})])
            with lock:
                seqs.append(s)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert sorted(seqs) == list(range(800))
    wait_until(lambda: pub.sent == 800, timeout=TIMEOUT, interval=0.01, what="800 batches sent")


def test_close_is_idempotent_and_final(publisher):
    pub = publisher(replay_endpoint="tcp://127.0.0.1:0")
    pub.publish([("cleared", {})])
    pub.close(timeout=2.0)
    assert pub.sent == 1  # close sends what was queued
    pub.close()
    with pytest.raises(RuntimeError, match="closed"):
        pub.publish([("cleared", {})])


def test_bind_failure_raises_and_leaks_nothing(publisher):
    pub = publisher()
    with pytest.raises(zmq.ZMQError):
        kv.KVEventPublisher(pub.endpoint, bind=True)  # the port is taken


SGLANG_JSON = ('{"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "bind": true, '
               '"buffer_steps": 100, "hwm": 1000, "max_queue_size": 50, "topic": "kv", "format": "dynamo"}')


@pytest.mark.parametrize("text", [SGLANG_JSON, "{}", '{"publisher": "zmq"}'])
def test_config_matches_sglang(text):
    assert kv.KVEventsConfig.from_cli(text).model_dump() == sgl.KVEventsConfig.from_cli(text).model_dump()


def test_config_makes_the_publisher():
    assert kv.KVEventPublisher.from_config(kv.KVEventsConfig()) is None
    cfg = kv.KVEventsConfig.from_cli('{"publisher": "zmq", "endpoint": "tcp://127.0.0.1:0", "bind": true, '
                                     '"replay_endpoint": "tcp://127.0.0.1:0"}')
    pub = kv.KVEventPublisher.from_config(cfg)
    try:
        assert pub is not None and pub.replay_endpoint is not None
    finally:
        pub.close()


@pytest.mark.parametrize("text, key", [
    ('{"publisher": "zmq", "endpont": "tcp://*:1"}', "endpont"),
    ('{"publisher": "kafka"}', "publisher"),
    ('{"buffer_steps": 0}', "buffer_steps"),
    ('{"hwm": "lots"}', "hwm"),
    ('{"format": "vllm"}', "format"),
    ('{"bind": "maybe"}', "bind"),
    ("publisher=zmq", "whole value"),
])
def test_config_rejects_bad_json(text, key):
    with pytest.raises(ValueError, match=key):
        kv.KVEventsConfig.from_cli(text)
