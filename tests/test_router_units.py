"""Router units without processes: rooms and request ids, logprob merging, policies, the radix
tree, circuit breakers, abort detection, token counting, config/CLI parsing, keys, metrics."""

import json
import random
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pd.router.aborts import aborted_indexes
from pd.router.admission import check
from pd.router.auth import Auth, key_matches, worker_auth_headers
from pd.router.circuit import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from pd.router.cli import config_from_args, parse_prefill
from pd.router.config import CONFIG_ENV, CircuitBreakerConfig, HealthCheckConfig, RouterConfig, RouterSettings
from pd.router.health import HealthMonitor
from pd.router.logprobs import merge_event, merge_full, prefill_inputs, wants_input_logprobs
from pd.router.metrics import ERROR_KINDS, RouterMetrics
from pd.router.policies import POLICIES, routing_key
from pd.router.radix import RadixTree
from pd.router.rooms import ROOM_LIMIT, Shape, assign_rids, request_shape, sequence_count, stamp
from pd.router.tokens import UsageTap, count, wants_usage_injected
from pd.router.workers import Worker, WorkerPool

PREFILL = Worker("http://10.0.0.7:30000", "prefill", 8998, "10.0.0.7")
ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")


# ---- rooms and request ids ----------------------------------------------------------------------
@pytest.mark.parametrize("route,body,expected", [
    ("/generate", {"text": "hi"}, (1, False, 1)),
    ("/generate", {"text": ["a", "b", "c"]}, (3, True, 1)),
    ("/generate", {"text": ["a"]}, (1, True, 1)),
    ("/generate", {"input_ids": [1, 2, 3]}, (1, False, 1)),
    ("/generate", {"input_ids": [[1, 2], [3]]}, (2, True, 1)),
    ("/generate", {"text": "hi", "sampling_params": {"n": 3}}, (3, False, 3)),
    ("/generate", {"text": ["a", "b"], "sampling_params": [{"n": 2}, {"n": 2}]}, (4, True, 2)),
    ("/v1/completions", {"prompt": "hi"}, (1, False, 1)),
    ("/v1/completions", {"prompt": [1, 2, 3]}, (1, False, 1)),
    ("/v1/completions", {"prompt": [[1, 2], [3]], "n": 2}, (4, True, 2)),
    ("/v1/completions", {"prompt": ["a", "b", "c"]}, (3, True, 1)),
    ("/v1/chat/completions", {"messages": [], "n": 3}, (3, False, 3)),
    ("/v1/chat/completions", {"messages": [], "n": "three"}, (1, False, 1)),  # the engine rejects it
])
def test_sequence_count(route, body, expected):
    assert sequence_count(route, body) == expected


@pytest.mark.parametrize("route,body,expected", [
    ("/generate", {"text": ["a", "b", "c"], "sampling_params": {"n": 2}}, Shape(3, 2, True)),
    ("/generate", {"input_ids": [[1], [2]], "sampling_params": [{"n": 5}, {"n": 5}]}, Shape(2, 5, True)),
    ("/generate", {"text": ["a", "b"], "sampling_params": [{"n": 1}, {"n": 9}]}, Shape(2, 9, True)),  # the largest
    ("/generate", {"text": "hi", "sampling_params": []}, Shape(1, 1, False)),
    ("/generate", {"text": "hi", "n": 7}, Shape(1, 1, False)),  # /generate's n is in sampling_params only
    ("/v1/completions", {"prompt": ["a"] * 4, "n": 3}, Shape(4, 3, True)),
    ("/v1/completions", {"prompt": "a", "n": 3, "sampling_params": {"n": 9}}, Shape(1, 3, False)),
    ("/v1/chat/completions", {"messages": [], "n": 10000}, Shape(1, 10000, False)),
    ("/v1/chat/completions", {"messages": [], "n": "12"}, Shape(1, 12, False)),  # pydantic coerces it
    ("/v1/chat/completions", {"messages": [], "n": 12.0}, Shape(1, 12, False)),
    ("/v1/chat/completions", {"messages": [], "n": True}, Shape(1, 1, False)),
])
def test_request_shape_prompts_and_n(route, body, expected):
    shape = request_shape(route, body)
    assert shape == expected and shape.sequences == expected.prompts * expected.n


CAPS = RouterSettings(max_n=4, max_batch_size=8, max_sequences_per_request=16)


def _over(route: str, body: dict):
    return check(route, request_shape(route, body), CAPS)


def test_admission_caps_pass_at_the_limit():
    assert _over("/generate", {"text": "a", "sampling_params": {"n": 4}}) is None
    assert _over("/generate", {"text": ["a"] * 4, "sampling_params": [{"n": 4}] * 4}) is None  # 16 sequences
    assert _over("/generate", {"input_ids": [[1]] * 8}) is None
    assert _over("/v1/completions", {"prompt": ["a"] * 8, "n": 2}) is None
    assert _over("/v1/chat/completions", {"messages": [], "n": 4}) is None
    defaults = RouterSettings()
    assert (defaults.max_n, defaults.max_batch_size, defaults.max_sequences_per_request) == (16, 256, 512)
    assert check("/v1/completions", Shape(256, 2, True), defaults) is None
    assert check("/v1/chat/completions", Shape(1, 16, False), defaults) is None


@pytest.mark.parametrize("route,body,message,param", [
    ("/generate", {"text": "a", "sampling_params": {"n": 5}},
     "sampling_params.n = 5 is over the router's limit of 4 (--max-n)", "sampling_params.n"),
    ("/generate", {"text": ["a", "b"], "sampling_params": [{"n": 1}, {"n": 5}]},
     "sampling_params.n = 5 is over the router's limit of 4 (--max-n)", "sampling_params.n"),
    ("/v1/chat/completions", {"messages": [], "n": 10000},
     "n = 10000 is over the router's limit of 4 (--max-n)", "n"),
    ("/v1/completions", {"prompt": "a", "n": "5"}, "n = 5 is over the router's limit of 4 (--max-n)", "n"),
    ("/generate", {"text": ["a"] * 9}, "a batch of 9 prompts is over the router's limit of 8 (--max-batch-size)", None),
    ("/generate", {"input_ids": [[1]] * 9}, "(--max-batch-size)", None),
    ("/v1/completions", {"prompt": [[1]] * 9}, "(--max-batch-size)", None),
    ("/generate", {"text": ["a"] * 5, "sampling_params": {"n": 4}},
     "5 prompts x n = 4 make 20 sequences, over the router's limit of 16 (--max-sequences-per-request)", None),
    ("/v1/completions", {"prompt": ["a"] * 6, "n": 3}, "(--max-sequences-per-request)", None),
])
def test_admission_caps_refuse_one_over_naming_the_flag(route, body, message, param):
    over = _over(route, body)
    assert over is not None and message in over.message and over.param == param


def test_stamp_replaces_client_fields_with_fresh_rooms():
    body = {"text": "hi", "bootstrap_room": 7, "bootstrap_host": "evil", "bootstrap_port": 1}
    stamp(body, 1, False, PREFILL)
    assert body["bootstrap_host"] == "10.0.0.7" and body["bootstrap_port"] == 8998
    assert isinstance(body["bootstrap_room"], int) and body["bootstrap_room"] != 7
    body = {"prompt": ["a", "b", "c"], "n": 2, "bootstrap_room": [1, 1]}
    stamp(body, 6, True, PREFILL)
    rooms = body["bootstrap_room"]
    assert len(rooms) == 6 and len(set(rooms)) == 6 and all(0 <= r < ROOM_LIMIT for r in rooms)
    assert body["bootstrap_host"] == ["10.0.0.7"] * 6 and body["bootstrap_port"] == [8998] * 6


def test_assign_rids_per_sequence():
    body = {"rid": "p"}
    (rid,) = assign_rids(body, 1, False, 1)
    assert body["rid"] == rid and rid.startswith("pdr-")  # a client's rid is replaced: the router owns ids
    rids = assign_rids(body, 33, True, 1)
    assert body["rid"] == rids and len(set(rids)) == 33
    # fixed width: no id is a prefix of another (a prefix-matching abort of one hits no sibling)
    assert not any(a != b and b.startswith(a) for a in rids for b in rids)
    again = assign_rids(body, 33, True, 1)
    assert not set(again) & set(rids)  # fresh ids per attempt
    # n > 1: a scalar both engines expand to rid_i
    body["rid"] = ["x", "y"]
    rids = assign_rids(body, 6, True, 3)
    assert isinstance(body["rid"], str) and rids == [f"{body['rid']}_{i}" for i in range(6)]


# ---- logprobs -------------------------------------------------------------------------------
def test_merge_full_and_stream_events():
    pre = [{"meta_info": {"input_token_logprobs": [[None, 1, None], [-1.0, 2, None]]}},
           {"meta_info": {"input_token_logprobs": [[None, 3, None]], "input_top_logprobs": [None],
                          "input_token_ids_logprobs": [None, [[-2.0, 7, None]]]}}]
    dec = [{"text": "a", "meta_info": {"input_token_logprobs": [], "output_token_logprobs": [[-0.5, 9, None]]}},
           {"text": "b", "meta_info": {"input_token_logprobs": [], "input_top_logprobs": [],
                                       "input_token_ids_logprobs": [],
                                       "output_token_ids_logprobs": [[[-1.5, 7, None]]]}}]
    inputs = prefill_inputs(json.dumps(pre).encode(), stream=False)
    merged = json.loads(merge_full(json.dumps(dec).encode(), inputs))
    assert merged[0]["meta_info"]["input_token_logprobs"] == [[None, 1, None], [-1.0, 2, None]]
    assert merged[0]["meta_info"]["output_token_logprobs"] == [[-0.5, 9, None]]
    assert merged[1]["meta_info"]["input_top_logprobs"] == [None]
    # token_ids_logprob: the prompt's come from the prefill too
    assert merged[1]["meta_info"]["input_token_ids_logprobs"] == [None, [[-2.0, 7, None]]]
    assert merged[1]["meta_info"]["output_token_ids_logprobs"] == [[[-1.5, 7, None]]]
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


# ---- policies -------------------------------------------------------------------------------
def pool_of(prefill=2, decode=3, **kw) -> WorkerPool:
    cfg = RouterConfig.from_urls([(f"http://p{i}:1", 10 + i) for i in range(prefill)],
                                 [f"http://d{i}:1" for i in range(decode)], **kw)
    return WorkerPool(cfg, RouterMetrics())


def test_round_robin_per_side_skips_unavailable():
    pool = pool_of()
    picks = [(pool.pick_prefill(None).url, pool.pick_decode(None).url) for _ in range(6)]
    assert [p for p, _ in picks] == ["http://p0:1", "http://p1:1"] * 3
    assert [d for _, d in picks] == ["http://d0:1", "http://d1:1", "http://d2:1"] * 2
    pool.decode[1].set_healthy(False)
    pool.decode[2].draining = True
    assert {pool.pick_decode(None).url for _ in range(6)} == {"http://d0:1"}
    for _ in range(10):
        pool.decode[0].breaker.record_failure()
    assert pool.decode[0].breaker.state == OPEN
    # panic mode: every worker is out, but only an operator's drain keeps one from being tried
    assert {pool.pick_decode(None).url for _ in range(6)} == {"http://d0:1", "http://d1:1"}
    pool.decode[0].draining = pool.decode[1].draining = True
    assert pool.pick_decode(None) is None
    pool.decode[0].draining = False
    assert "d0:1 (circuit_open)" in pool.unavailable_reason("decode")
    assert "d1:1 (draining)" in pool.unavailable_reason("decode")
    assert "d2:1 (draining)" in pool.unavailable_reason("decode")
    pool.decode[1].draining = False
    pool.decode[1].set_healthy(True)
    assert {pool.pick_decode(None).url for _ in range(4)} == {"http://d1:1"}  # out of panic


def test_separate_policies_and_decision_counts():
    pool = pool_of(policy="random", decode_policy="least_load")
    assert pool.policies["prefill"].name == "random" and pool.policies["decode"].name == "least_load"
    random.seed(3)
    seen = {pool.pick_prefill(None).url for _ in range(40)}
    assert seen == {"http://p0:1", "http://p1:1"}
    m = pool.metrics
    total = sum(s.value for f in text_string_to_metric_families(m.render().decode())
                if f.name == "pdserve_router_policy_decisions" for s in f.samples
                if s.name.endswith("_total") and s.labels["role"] == "prefill" and s.labels["policy"] == "random")
    assert total == 40


def test_least_load_and_power_of_two():
    pool = pool_of(policy="least_load")
    d0, d1, d2 = pool.decode
    d0.begin(5)
    d1.begin(1)
    assert pool.pick_decode(None) is d2
    d2.begin(33)  # a batch counts its sequences
    assert pool.pick_decode(None) is d1
    d1.end(1)
    d2.end(33)
    assert {pool.pick_decode(None) for _ in range(4)} == {d1, d2}  # ties rotate
    pool = pool_of(decode=2, policy="power_of_two")
    a, b = pool.decode
    a.begin(3)
    assert all(pool.pick_decode(None) is b for _ in range(20))


def test_cache_aware_prefers_the_worker_holding_the_prefix_unless_imbalanced():
    pool = pool_of(prefill=3, policy="cache_aware",
                   cache_aware={"balance_abs_threshold": 4, "balance_rel_threshold": 1.5})
    sys_prompt = "You are a helpful assistant. " * 20
    first = pool.pick_prefill(sys_prompt + "question one")
    assert all(pool.pick_prefill(sys_prompt + f"question {i}") is first for i in range(2, 8))
    # an unrelated prompt goes to an empty cache (the smallest tree), not to `first`
    other = pool.pick_prefill("Completely different text " * 10)
    assert other is not first
    # out of balance: the least loaded worker wins despite the cached prefix
    first.begin(10)
    chosen = pool.pick_prefill(sys_prompt + "question 9")
    assert chosen is not first and chosen.load == 0
    first.end(10)
    # a removed worker's tree is dropped
    pool.remove(first.url)
    assert first.url not in pool.policies["prefill"].trees


def test_routing_key():
    assert routing_key("/generate", {"text": "abc"}) == "abc"
    assert routing_key("/generate", {"text": ["abc", "d"]}) == "abc"
    assert routing_key("/generate", {"input_ids": [65, 66]}) == "AB"
    assert routing_key("/generate", {"input_ids": [[65], [66]]}) == "A"
    assert routing_key("/v1/completions", {"prompt": "p"}) == "p"
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text", "text": "U"}]}]
    key = routing_key("/v1/chat/completions", {"messages": messages})
    assert key.startswith("system\x00S") and "user\x00U" in key
    assert routing_key("/generate", {"input_ids": [-1]}) is None
    assert routing_key("/v1/completions", {}) is None


def test_every_policy_is_one_registered_class():
    assert set(POLICIES) == {"round_robin", "random", "least_load", "power_of_two", "cache_aware", "kv_aware"}
    for name in POLICIES:  # each one serves a pool end to end
        pool = pool_of(policy=name)
        assert pool.pick_prefill("x") in pool.prefill and pool.pick_decode("x") in pool.decode


# ---- radix tree -------------------------------------------------------------------------------
def test_radix_tree_match_insert_evict():
    t = RadixTree()
    t.insert("hello world", 1.0)
    assert t.match("hello there") == 6 and t.match("hello world!") == 11 and t.match("x") == 0
    t.insert("hello there", 2.0)  # splits the "hello world" edge
    assert t.size == len("hello world") + len("there")
    assert t.match("hello there") == 11 and t.match("hello world") == 11
    t.insert("goodbye", 3.0)
    t.evict(t.size - 1)  # the least recently used leaf ("world") goes first
    assert t.match("hello world") == 6 and t.match("hello there") == 11 and t.match("goodbye") == 7
    t.evict(0)
    assert t.size == 0 and t.match("hello") == 0


# ---- circuit breaker ----------------------------------------------------------------------------
def test_circuit_breaker_states():
    now = [0.0]
    changes = []
    cb = CircuitBreaker(CircuitBreakerConfig(failure_threshold=3, success_threshold=2, timeout_duration_secs=10,
                                             window_duration_secs=5), changes.append, clock=lambda: now[0])
    cb.record_failure()
    cb.record_failure()
    cb.record_success()  # a success resets the streak
    cb.record_failure()
    cb.record_failure()
    assert cb.state == CLOSED
    now[0] = 20.0  # failures further apart than the window do not add up
    cb.record_failure()
    assert cb.state == CLOSED
    cb.record_failure()
    cb.record_failure()
    assert cb.state == OPEN and not cb.allows()
    now[0] = 31.0
    assert cb.allows() and cb.state == HALF_OPEN
    cb.record_failure()  # a failed trial re-opens
    assert cb.state == OPEN and not cb.allows()
    now[0] = 42.0
    assert cb.allows()
    cb.record_success()
    assert cb.state == HALF_OPEN
    cb.record_success()
    assert cb.state == CLOSED
    assert changes == [OPEN, HALF_OPEN, OPEN, HALF_OPEN, CLOSED]
    off = CircuitBreaker(CircuitBreakerConfig(enabled=False, failure_threshold=1))
    off.record_failure()
    assert off.state == CLOSED and off.allows()


def test_a_passing_health_probe_turns_an_open_circuit_half_open():
    """A worker back up is tried at its next passing probe, not after the rest of the open timeout."""
    now = [0.0]
    cb = CircuitBreaker(CircuitBreakerConfig(failure_threshold=1, success_threshold=1, timeout_duration_secs=60),
                        clock=lambda: now[0])
    cb.probe_passed()
    assert cb.state == CLOSED  # nothing to do for a closed circuit
    cb.record_failure()
    assert cb.state == OPEN and not cb.allows()
    now[0] = 1.0  # 59 s before the timeout
    cb.probe_passed()
    assert cb.state == HALF_OPEN and cb.allows()
    cb.record_success()
    assert cb.state == CLOSED
    # through the health monitor: a passing probe of a worker whose circuit is open
    w = Worker("http://127.0.0.1:1", "decode", breaker=CircuitBreakerConfig(failure_threshold=1))
    w.breaker.record_failure()
    assert w.breaker.state == OPEN
    HealthMonitor(SimpleNamespace(all=[w]), HealthCheckConfig()).record(w, None)
    assert w.breaker.state == HALF_OPEN and w.available()


# ---- aborts and tokens ------------------------------------------------------------------------
def test_aborted_indexes_every_route_shape():
    ab, ok = {"type": "abort", "message": "Aborted"}, {"type": "length", "length": 1}
    gen = [{"meta_info": {"finish_reason": fr}} for fr in (ok, ab, ok, ab)]
    assert aborted_indexes("/generate", json.dumps(gen).encode(), False) == {1, 3}
    assert aborted_indexes("/generate", json.dumps(gen[1]).encode(), False) == {0}
    sse = b"".join(b"data: " + json.dumps(dict(g, index=i)).encode() + b"\n\n" for i, g in enumerate(gen))
    assert aborted_indexes("/generate", sse + b"data: [DONE]\n\n", True) == {1, 3}
    chat = {"choices": [{"index": i, "finish_reason": "abort" if i % 2 else "stop"} for i in range(4)]}
    assert aborted_indexes("/v1/chat/completions", json.dumps(chat).encode(), False) == {1, 3}
    chunks = b"".join(b"data: " + json.dumps({"choices": [c]}).encode() + b"\n\n" for c in chat["choices"])
    assert aborted_indexes("/v1/completions", chunks, True) == {1, 3}
    assert aborted_indexes("/generate", json.dumps(gen[0]).encode(), False) == set()


def test_token_counts_and_usage_tap():
    gen = [{"meta_info": {"prompt_tokens": 5, "completion_tokens": 7, "cached_tokens": 2}},
           {"meta_info": {"prompt_tokens": 3, "completion_tokens": 1}}]
    assert count(json.dumps(gen).encode()) == (8, 8)
    usage = {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 9, "total_tokens": 13,
                                      "prompt_tokens_details": {"cached_tokens": 1}}}
    assert count(json.dumps(usage).encode()) == (4, 9)
    tap = UsageTap(generate=True, drop_usage=False)
    assert tap.event(b'data: {"meta_info": {"finish_reason": null, "prompt_tokens": 5, "completion_tokens": 1}}')
    assert tap.event(b'data: {"meta_info": {"finish_reason": {"type": "length"}, '
                     b'"prompt_tokens": 5, "completion_tokens": 2}}')
    assert (tap.prompt, tap.completion) == (5, 2)
    tap = UsageTap(generate=False, drop_usage=True)
    assert tap.event(b'data: {"choices": [{"index": 0, "text": "x"}], "usage": null}')
    assert not tap.event(b"data: " + json.dumps(usage).encode())
    assert (tap.prompt, tap.completion) == (4, 9)
    body = {"stream": True}
    assert wants_usage_injected(body) and body["stream_options"] == {"include_usage": True}
    assert not wants_usage_injected({"stream_options": {"include_usage": True}})


async def test_failed_aborts_are_one_warning_per_round_not_one_per_sequence(caplog):
    """A request of many sequences aborted on an unreachable worker: one log line saying how many
    aborts failed, not a line per sequence (n=100000 wrote 500,000 lines in two minutes)."""
    import logging
    import socket

    import httpx

    from pd.router.aborts import Aborter
    from pd.router.background import TaskSet

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    aborter = Aborter(TaskSet(), {})
    async with httpx.AsyncClient() as aborter.client:
        worker = SimpleNamespace(url=f"http://127.0.0.1:{port}", role="decode", headers={})
        with caplog.at_level(logging.WARNING, logger="pd.router"):
            await aborter.send(worker, [f"pdr-x_{i}" for i in range(300)])
    (record,) = [r for r in caplog.records if r.name == "pd.router"]
    assert (f"abort of 300 of 300 rid(s) on decode http://127.0.0.1:{port} failed (first: pdr-x_0: "
            in record.getMessage())


# ---- config, CLI, keys ------------------------------------------------------------------------
def test_cli_parsing_and_flags_round_trip():
    cfg = config_from_args(["--prefill", "http://a:1", "9000", "--prefill", "b:2", "--prefill", "http://c:3", "none",
                            "--decode", "http://d:4/", "--port", "0", "--request-timeout", "5",
                            "--prefill-policy", "cache_aware", "--decode-policy", "power_of_two",
                            "--retry-max-retries", "3", "--cb-failure-threshold", "4", "--disable-circuit-breaker",
                            "--health-check-interval-secs", "0.5", "--stream-idle-timeout-secs", "2",
                            "--max-payload-size", "1000", "--request-id-headers", "x-trace-id", "x-request-id"])
    assert [(p.url, p.bootstrap_port, p.bootstrap_host) for p in cfg.prefill] == [
        ("http://a:1", 9000, "a"), ("http://b:2", 8998, "b"), ("http://c:3", 8998, "c")]
    assert cfg.decode == ["http://d:4"] and cfg.port == 0 and cfg.timeouts.request == 5
    assert cfg.side_policy("prefill") == "cache_aware" and cfg.side_policy("decode") == "power_of_two"
    assert cfg.retry.max_retries == 3 and cfg.circuit_breaker.failure_threshold == 4
    assert not cfg.circuit_breaker.enabled and cfg.health_check.interval_secs == 0.5
    assert cfg.timeouts.stream_idle == 2 and cfg.max_payload_size == 1000
    assert cfg.request_id_headers == ("x-trace-id", "x-request-id")
    disabled = config_from_args(["--disable-retries", "--prefill", "http://a:1", "--decode", "http://d:1"])
    assert disabled.retry.max_retries == 1
    # what the launcher hands a router: the settings and workers as JSON, read back unchanged
    assert config_from_args([], {CONFIG_ENV: cfg.model_dump_json()}) == cfg
    with pytest.raises(ValueError):
        parse_prefill(["http://a:1", "x"])
    with pytest.raises(SystemExit):
        config_from_args(["--prefill", "http://a:1", "1", "2", "--decode", "http://d:1"])
    with pytest.raises(SystemExit):
        config_from_args(["--prefill", "http://a:1", "--decode", "http://a:1"])  # one worker twice


@pytest.mark.parametrize("args, says", [
    (["--port", "99999"], "--port: Input should be less than or equal to 65535, got 99999"),
    (["--retry-max-retries", "0"], "--retry-max-retries: Input should be greater than or equal to 1, got 0"),
    (["--cache-threshold", "2"], "--cache-threshold: "),
    (["--cb-window-duration-secs", "0"], "--cb-window-duration-secs: "),
    (["--health-check-timeout-secs", "0"], "--health-check-timeout-secs: "),
    (["--health-check-endpoint", "health"], "--health-check-endpoint: must be a path starting with '/', got 'health'"),
    (["--first-token-timeout-secs", "-1"], "--first-token-timeout-secs: "),
    (["--max-connections", "0"], "--max-connections: "),
    (["--decode", "http://h:0"], "--decode: worker URL 'http://h:0' has no valid port"),
    (["--decode", "nohost::"], "--decode: worker URL 'http://nohost::' has no valid port"),
    (["--prefill", "http://p:2", "70000"], "--prefill URL BOOTSTRAP_PORT: "),
])
def test_cli_errors_name_the_flag(capsys, args, says):
    """A bad value is reported under the flag that set it, on one line, without pydantic's
    model names or links."""
    with pytest.raises(SystemExit) as exit_info:
        config_from_args(["--prefill", "http://a:1", "--decode", "http://d:1", *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("pdserve router: error: " + says), err
    assert "validation error" not in err and "errors.pydantic.dev" not in err


def test_config_rejects_unknown_keys_and_bad_values():
    with pytest.raises(ValueError, match="retyr"):
        RouterConfig.from_urls(["http://a:1"], ["http://d:1"], retyr={})
    with pytest.raises(ValueError, match="max_retries"):
        RouterConfig.from_urls(["http://a:1"], ["http://d:1"], retry={"max_retries": 0})
    with pytest.raises(ValueError, match="policy"):
        RouterConfig.from_urls(["http://a:1"], ["http://d:1"], policy="fastest")
    with pytest.raises(ValueError, match="endpoint"):
        RouterConfig.from_urls(["http://a:1"], ["http://d:1"], health_check={"endpoint": "health"})


def test_keys():
    assert key_matches("Bearer s3cret", "s3cret") and key_matches("bearer s3cret", "s3cret")
    assert not key_matches("Bearer s3cre", "s3cret") and not key_matches(None, "s3cret")
    assert not key_matches("Basic s3cret", "s3cret")

    def req(auth=None, host="127.0.0.1"):
        return SimpleNamespace(headers={"authorization": auth} if auth else {}, client=SimpleNamespace(host=host))

    open_ = Auth(None, None)
    assert open_.client_ok(req()) and open_.admin_ok(req()) and not open_.admin_ok(req(host="10.1.2.3"))
    keyed = Auth("k", "adm")
    assert not keyed.client_ok(req()) and keyed.client_ok(req("Bearer k"))
    assert keyed.admin_ok(req("Bearer adm")) and not keyed.admin_ok(req("Bearer k"))
    assert Auth("k", None).admin_ok(req("Bearer k", host="10.1.2.3"))
    assert worker_auth_headers("k") == {"Authorization": "Bearer k"} and worker_auth_headers(None) == {}


# ---- metrics ----------------------------------------------------------------------------------
def samples(m: RouterMetrics) -> dict:
    out = {}
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metric_series_exist_from_the_start_and_leave_with_their_worker():
    pool = WorkerPool(RouterConfig.from_urls([("http://p:1", 5)], ["http://d:1"]), RouterMetrics(ROUTES))
    s = samples(pool.metrics)
    for ep in ROUTES:
        e = (("endpoint", ep),)
        for name in ("pdserve_router_retries_total", "pdserve_router_prompt_tokens_total",
                     "pdserve_router_completion_tokens_total", "pdserve_router_e2e_seconds_count",
                     "pdserve_router_queue_seconds_count", "pdserve_router_ttft_seconds_count"):
            assert s[(name, e)] == 0, (name, ep)
        assert s[("pdserve_router_requests_total", (("endpoint", ep), ("status", "200")))] == 0
        for kind in ERROR_KINDS:
            assert s[("pdserve_router_errors_total", (("endpoint", ep), ("kind", kind)))] == 0
    assert s[("pdserve_router_requests_in_flight", ())] == 0
    w = (("role", "decode"), ("worker", "http://d:1"))
    assert s[("pdserve_router_worker_inflight", w)] == 0 and s[("pdserve_router_worker_healthy", w)] == 1
    assert s[("pdserve_router_worker_circuit_state", w)] == 0
    assert s[("pdserve_router_policy_decisions_total", (("policy", "round_robin"),) + w)] == 0
    pool.decode[0].breaker.cfg = CircuitBreakerConfig(failure_threshold=1)
    pool.decode[0].breaker.record_failure()
    assert samples(pool.metrics)[("pdserve_router_worker_circuit_state", w)] == OPEN
    pool.remove("http://d:1")
    assert not any(dict(k[1]).get("worker") == "http://d:1" for k in samples(pool.metrics))


def test_launcher_router_command_line_and_keys():
    from pd.cluster.launch import Launcher
    from pd.config import PDConfig
    from pd.router.config import ADMIN_KEY_ENV, API_KEY_ENV, CONFIG_ENV

    cfg = PDConfig.model_validate({"router": {"port": 8123, "prefill_policy": "cache_aware", "api_key": "ck",
                                              "retry": {"max_retries": 2}, "timeouts": {"first_token": 30}}})
    launcher = Launcher(cfg)
    launcher.workers = [
        {"name": "prefill-0", "role": "prefill", "state": "ready", "url": "http://10.0.0.1:31000",
         "bootstrap_port": 31001},
        {"name": "prefill-1", "role": "prefill", "state": "restarting", "url": "http://10.0.0.2:31000",
         "bootstrap_port": 31001},
        {"name": "decode-0", "role": "decode", "state": "ready", "url": "http://10.0.0.3:31000",
         "bootstrap_port": None},
    ]
    argv = launcher.router_argv()
    assert argv[1:4] == ["-m", "pd.cli", "router"] and "ck" not in argv and launcher.admin_key not in argv
    env = launcher.router_env()
    handed = json.loads(env[CONFIG_ENV])  # the keys travel in their own variables only
    assert handed["api_key"] is None and handed["admin_api_key"] is None and launcher.admin_key not in env[CONFIG_ENV]
    parsed = config_from_args(argv[4:], env)
    assert [p.url for p in parsed.prefill] == ["http://10.0.0.1:31000"] and parsed.decode == ["http://10.0.0.3:31000"]
    assert parsed.port == 8123 and parsed.side_policy("prefill") == "cache_aware" and parsed.retry.max_retries == 2
    assert parsed.timeouts.first_token == 30 and parsed.timeouts.request == cfg.router.timeouts.request
    assert parsed.api_key == "ck" and parsed.admin_api_key == launcher.admin_key
    assert env[API_KEY_ENV] == "ck" and len(env[ADMIN_KEY_ENV]) >= 24
    # no decode up: every known worker, so the router can start and its health checks decide
    launcher.workers[2]["state"] = "restarting"
    assert len(config_from_args(launcher.router_argv()[4:], launcher.router_env()).prefill) == 2


def test_lock_free_metrics_expose_what_prometheus_client_would():
    """The router's own counters/gauges/histograms render exactly as prometheus_client's
    Counter/Gauge/Histogram (names, types, labels, buckets incl. values on a boundary, sums)."""
    import re

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from pd.router.metrics import QUEUE_BUCKETS, Family, _Collector

    ref_reg = CollectorRegistry()
    ref_h = Histogram("x_seconds", "h", ["endpoint"], buckets=QUEUE_BUCKETS, registry=ref_reg)
    ref_c = Counter("x_requests", "c", ["endpoint", "status"], registry=ref_reg)
    ref_g = Gauge("x_in_flight", "g", registry=ref_reg)
    h = Family("histogram", "x_seconds", "h", ["endpoint"], QUEUE_BUCKETS)
    c = Family("counter", "x_requests", "c", ["endpoint", "status"])
    g = Family("gauge", "x_in_flight", "g")
    ours = CollectorRegistry()
    ours.register(_Collector([h, c, g]))
    rng = random.Random(5)
    values = list(QUEUE_BUCKETS) + [0.0, 3.0, 1e9] + [rng.uniform(0, 3) for _ in range(200)]
    for v in values:
        ep = rng.choice(["/a", "/b"])
        ref_h.labels(ep).observe(v)
        h.labels(ep).observe(v)
        status = rng.choice([200, 400])
        ref_c.labels(ep, status).inc(2)
        c.labels(ep, status).inc(2)
    for op in ("inc", "inc", "dec", "inc"):
        getattr(ref_g, op)()
        getattr(g, op)()

    def text(reg):  # series in a fixed order; _created timestamps differ
        lines = re.sub(r"(_created\{[^}]*\}) \S+", r"\1 T", generate_latest(reg).decode()).splitlines()
        return sorted(lines)

    assert text(ours) == text(ref_reg)
    with pytest.raises(ValueError):
        c.labels("/a", 200).inc(-1)
    with pytest.raises(ValueError):
        c.labels("/a")
    c.remove("/a", 200)
    with pytest.raises(KeyError):
        c.remove("/a", 200)


# ---- requests a PD pair cannot serve ---------------------------------------------------------------
@pytest.mark.parametrize("route,body,param", [
    ("/v1/completions", {"prompt": "a", "echo": True, "logprobs": 0}, "echo"),
    ("/v1/completions", {"prompt": "a", "echo": True, "logprobs": 3}, "echo"),
    ("/v1/completions", {"prompt": "a", "echo": True}, None),
    ("/v1/completions", {"prompt": "a", "logprobs": 3}, None),
    ("/v1/completions", {"prompt": "a", "echo": False, "logprobs": 3}, None),
    ("/generate", {"text": "a", "return_logprob": True, "logprob_start_len": 0}, None),
])
def test_echo_with_logprobs_is_refused_naming_echo(route, body, param):
    from pd.router import unsupported

    refused = unsupported.check(route, body)
    assert (refused.param if refused else None) == param
    if refused:
        assert "/generate" in refused.message and "logprob_start_len" in refused.message
