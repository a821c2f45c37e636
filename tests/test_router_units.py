"""Router units without processes: room stamping, logprob merging, pairing, config and CLI parsing."""

import json

import pytest

from pd.router.cli import config_from_args, parse_prefill
from pd.router.config import RouterConfig
from pd.router.logprobs import merge_event, merge_full, prefill_inputs, wants_input_logprobs
from pd.router.rooms import ROOM_LIMIT, sequence_count, stamp
from pd.router.workers import Worker, WorkerPool

PREFILL = Worker("http://10.0.0.7:30000", "prefill", 8998, "10.0.0.7")


@pytest.mark.parametrize("route,body,expected", [
    ("/generate", {"text": "hi"}, (1, False)),
    ("/generate", {"text": ["a", "b", "c"]}, (3, True)),
    ("/generate", {"text": ["a"]}, (1, True)),
    ("/generate", {"input_ids": [1, 2, 3]}, (1, False)),
    ("/generate", {"input_ids": [[1, 2], [3]]}, (2, True)),
    ("/generate", {"text": "hi", "sampling_params": {"n": 3}}, (3, False)),
    ("/generate", {"text": ["a", "b"], "sampling_params": [{"n": 2}, {"n": 2}]}, (4, True)),
    ("/v1/completions", {"prompt": "hi"}, (1, False)),
    ("/v1/completions", {"prompt": [1, 2, 3]}, (1, False)),
    ("/v1/completions", {"prompt": [[1, 2], [3]], "n": 2}, (4, True)),
    ("/v1/completions", {"prompt": ["a", "b", "c"]}, (3, True)),
    ("/v1/chat/completions", {"messages": [], "n": 3}, (3, False)),
    ("/v1/chat/completions", {"messages": [], "n": "three"}, (1, False)),  # the engine rejects it
])
def test_sequence_count(route, body, expected):
    assert sequence_count(route, body) == expected


def test_stamp_scalar_replaces_client_fields_and_adds_rid():
    body = {"text": "hi", "bootstrap_room": 7, "bootstrap_host": "evil", "bootstrap_port": 1}
    rids = stamp("/generate", body, PREFILL)
    assert body["bootstrap_host"] == "10.0.0.7" and body["bootstrap_port"] == 8998
    assert isinstance(body["bootstrap_room"], int) and body["bootstrap_room"] != 7
    assert 0 <= body["bootstrap_room"] < ROOM_LIMIT
    assert rids == [body["rid"]] and body["rid"].startswith("pdr-")


def test_stamp_lists_one_room_per_sequence_and_keeps_client_rid():
    body = {"prompt": ["a", "b", "c"], "n": 2, "rid": "mine", "bootstrap_room": [1, 1]}
    assert stamp("/v1/completions", body, PREFILL) == ["mine"]
    rooms = body["bootstrap_room"]
    assert len(rooms) == 6 and len(set(rooms)) == 6 and all(0 <= r < ROOM_LIMIT for r in rooms)
    assert body["bootstrap_host"] == ["10.0.0.7"] * 6 and body["bootstrap_port"] == [8998] * 6
    body = {"messages": [], "n": 3, "rid": ["x", "y", "z"]}
    assert stamp("/v1/chat/completions", body, PREFILL) == ["x", "y", "z"]
    assert len(set(body["bootstrap_room"])) == 3


def test_merge_full_and_stream_events():
    pre = [{"meta_info": {"input_token_logprobs": [[None, 1, None], [-1.0, 2, None]]}},
           {"meta_info": {"input_token_logprobs": [[None, 3, None]], "input_top_logprobs": [None]}}]
    dec = [{"text": "a", "meta_info": {"input_token_logprobs": [], "output_token_logprobs": [[-0.5, 9, None]]}},
           {"text": "b", "meta_info": {"input_token_logprobs": [], "input_top_logprobs": []}}]
    inputs = prefill_inputs(json.dumps(pre).encode(), stream=False)
    merged = json.loads(merge_full(json.dumps(dec).encode(), inputs))
    assert merged[0]["meta_info"]["input_token_logprobs"] == [[None, 1, None], [-1.0, 2, None]]
    assert merged[0]["meta_info"]["output_token_logprobs"] == [[-0.5, 9, None]]
    assert merged[1]["meta_info"]["input_top_logprobs"] == [None]
    # streams: the prefill's last chunk per index wins
    sse = b"".join(b"data: " + json.dumps(dict(p, index=i)).encode() + b"\n\n" for i, p in enumerate(pre))
    sse = b'data: {"index": 0, "meta_info": {"input_token_logprobs": []}}\n\n' + sse + b"data: [DONE]\n\n"
    inputs = prefill_inputs(sse, stream=True)
    ev = merge_event(b"data: " + json.dumps(dict(dec[1], index=1)).encode(), inputs)
    assert json.loads(ev[len(b"data: "):])["meta_info"]["input_token_logprobs"] == [[None, 3, None]]
    assert merge_event(b"data: [DONE]", inputs) == b"data: [DONE]"
    assert merge_event(b'data: {"error": {"message": "x"}}', inputs) == b'data: {"error": {"message": "x"}}'


def test_wants_input_logprobs():
    assert wants_input_logprobs("/generate", {"return_logprob": True})
    assert wants_input_logprobs("/generate", {"return_logprob": [False, True]})
    assert not wants_input_logprobs("/generate", {})
    assert not wants_input_logprobs("/v1/completions", {"return_logprob": True})


def test_round_robin_per_side_skips_unhealthy():
    cfg = RouterConfig.from_urls([("http://p1:1", 10), ("http://p2:1", 11)], ["http://d1:1", "http://d2:1", "http://d3:1"])
    pool = WorkerPool(cfg)
    pairs = [pool.pick() for _ in range(6)]
    assert [p.prefill.url for p in pairs] == ["http://p1:1", "http://p2:1"] * 3
    assert [p.decode.url for p in pairs] == ["http://d1:1", "http://d2:1", "http://d3:1"] * 2
    pool.decode[1].set_healthy(False)
    assert {pool.pick().decode.url for _ in range(6)} == {"http://d1:1", "http://d3:1"}
    for w in pool.decode:
        w.set_healthy(False)
    assert pool.pick().decode in pool.decode  # none healthy: still answers (with that worker's error)


def test_cli_parsing():
    cfg = config_from_args(["--prefill", "http://a:1", "9000", "--prefill", "b:2", "--prefill", "http://c:3", "none",
                            "--decode", "http://d:4/", "--port", "0", "--request-timeout", "5"])
    assert [(p.url, p.bootstrap_port, p.bootstrap_host) for p in cfg.prefill] == [
        ("http://a:1", 9000, "a"), ("http://b:2", 8998, "b"), ("http://c:3", 8998, "c")]
    assert cfg.decode == ["http://d:4"] and cfg.port == 0 and cfg.request_timeout == 5
    with pytest.raises(ValueError):
        parse_prefill(["http://a:1", "x"])
    with pytest.raises(SystemExit):
        config_from_args(["--prefill", "http://a:1", "1", "2", "--decode", "http://d:1"])
