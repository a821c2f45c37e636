"""The kv_aware prefill policy: Dynamo's KV cost over the workers' own KV events, its fallbacks to
cache_aware, and end to end with two reference prefills publishing events behind a router."""

from __future__ import annotations

import itertools
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from engines import start_engine, wait_ready
from kv_tokenizers import char_tokenizer
from pd.router.config import RouterConfig
from pd.router.kv_aware import KvAware, kv_cost
from pd.router.kv_index import KVBatch, KVEvent, SubscriberStats
from pd.router.kv_plan import KvPlan
from pd.router.kv_source import event_source
from pd.router.kv_tokenizer import PromptTokenizer
from pd.router.metrics import RouterMetrics
from pd.router.policies import PromptKey, routing_key
from pd.router.tokens import count_all
from pd.router.workers import WorkerPool
from pd.util.kv_block_hash import page_hashes
from pd.util.wait import wait_until
from routers import RouterProc

PAGE = 4
_fresh = itertools.count(1)


def prompt(length: int) -> list[int]:
    """A prompt no other test sends (its first token is unique)."""
    first = 340 + next(_fresh)  # the tiny model has 384 token ids
    return [first] + [(first * 7 + i) % 250 + 1 for i in range(length - 1)]


# ---- units ----------------------------------------------------------------------------------------
def test_cost_is_dynamos_weighted_prefill_pages_plus_pages_in_flight():
    assert kv_cost(10, 4, 0, 1.0) == 6
    assert kv_cost(10, 4, 5, 1.0) == 11
    assert kv_cost(10, 10, 3, 2.0) == 3
    assert kv_cost(10, 0, 0, 0.5) == 5


def test_event_source_from_server_info():
    src = {"publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": 5557, "topic": "", "block_size": 16,
           "dp_size": 1, "replay_endpoint_port_base": 5558}
    assert event_source("http://10.0.0.7:30000", src) == ("tcp://10.0.0.7:5557", "tcp://10.0.0.7:5558", "", 16)
    own = dict(src, endpoint_host="10.0.0.9", replay_endpoint_port_base=None)
    assert event_source("http://h:1", own) == ("tcp://10.0.0.9:5557", None, "", 16)
    assert event_source("http://[::1]:1", dict(src, endpoint_host="0.0.0.0"))[0] == "tcp://[::1]:5557"
    for bad in (None, {"publisher": "kafka"}, dict(src, dp_size=2), dict(src, block_size=0),
                dict(src, endpoint_port_base=None)):
        with pytest.raises(ValueError):
            event_source("http://h:1", bad)


def test_cached_tokens_ride_along_the_token_count_scan():
    answer = b'{"text":"x","meta_info":{"prompt_tokens":30,"completion_tokens":4,"cached_tokens":28}}'
    assert count_all(answer) == (30, 4, 28)
    assert count_all(b'{"usage":{"prompt_tokens":3,"completion_tokens":1}}') == (3, 1, None)  # none reported


def test_routing_key_says_what_the_prompt_was_made_of():
    key = routing_key("/generate", {"input_ids": [5, 6, 7]})
    assert isinstance(key, PromptKey) and key.kind == "ids" and key.token_ids() == [5, 6, 7]
    assert routing_key("/generate", {"text": "hi"}).kind == "text"
    assert routing_key("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}).kind == "chat"


class Harness:
    """A kv_aware prefill policy over workers a, b whose event streams are faked (index and stats set by hand)."""

    def __init__(self, prefills=("http://a:1", "http://b:1"), **kv):
        cfg = RouterConfig.from_urls([(u, 9) for u in prefills], ["http://d:1"], prefill_policy="kv_aware",
                                     kv_aware=kv)
        self.metrics = RouterMetrics()
        self.pool = WorkerPool(cfg, self.metrics)
        self.policy = self.pool.policies["prefill"]
        assert isinstance(self.policy, KvAware)
        self.a, self.b = (list(self.pool.prefill) + [None])[:2]
        self.stats = {}
        self.policy.kv.following = lambda url: url in self.stats  # type: ignore[method-assign]
        self.policy.kv.stats = lambda: self.stats  # type: ignore[method-assign]
        self.policy.kv.last_received_at = lambda url: self.stats[url].last_received_at  # type: ignore[method-assign]

    def follow(self, worker, held: list[int] = ()):
        """``worker`` publishes (pages of PAGE tokens) and holds the pages of ``held``'s leading tokens."""
        self.policy.block_size[worker.url] = PAGE
        self.stats[worker.url] = SubscriberStats(last_received_at=time.time())
        hashes = tuple(h for _, h in page_hashes(held, PAGE))
        self.policy.kv.index.apply(worker.url, KVBatch(time.time(), [KVEvent("stored", hashes)], None))

    def pick(self, ids: list[int]):
        return self.pool.pick_prefill(routing_key("/generate", {"input_ids": ids}))

    def fallbacks(self, reason: str) -> float:
        return self.metrics.kv_fallbacks.labels(reason).value


def test_the_worker_holding_the_prompt_wins_unless_its_queue_costs_more():
    h = Harness()
    ids = prompt(17)  # 4 pages
    h.follow(h.a, ids[:12])  # 3 of them
    h.follow(h.b)
    for _ in range(3):
        assert h.pick(ids) is h.a  # cost a = 1, b = 4
    h.a.prompt_blocks = 10  # cost a = 11
    assert h.pick(ids) is h.b
    h2 = Harness(overlap_weight=4.0)  # a: 4 x 1 + 10 = 14, b: 4 x 4 = 16
    h2.follow(h2.a, ids[:12])
    h2.follow(h2.b)
    h2.a.prompt_blocks = 10
    assert h2.pick(ids) is h2.a
    assert h.fallbacks("no_live_events") == h.fallbacks("worker_events_stale") == 0


def test_a_burst_of_one_new_prompt_stays_on_one_worker_before_any_event():
    """The pages of a prompt just sent count as held there until its event arrives, and an equal cost goes to
    the larger overlap: the second and third copies follow the first instead of computing it again elsewhere."""
    h = Harness()
    h.follow(h.a)
    h.follow(h.b)
    ids = prompt(17)
    first = h.pick(ids)
    first.prompt_blocks += 4  # its prefill is in flight: 4 pages to compute
    assert [h.pick(ids) for _ in range(2)] == [first, first]
    other = h.pick(prompt(17))  # a different prompt: the idle worker
    assert other is not first


def test_a_burst_of_one_new_text_prompt_stays_on_one_worker():
    """A text prompt is tokenized only as far as a worker holds it, and one whose first characters no prompt
    routed lately had is placed as a miss untokenized. A second copy finds the first one's first page pending
    on the worker that got it and hashes the sent prompt further, page by page: the whole prompt counts as
    pending there and the copy follows it; a prompt sharing only the system part gets that part's pages; a new
    one is not tokenized."""
    h = Harness()
    h.follow(h.a)
    h.follow(h.b)
    h.policy.tokenizer = PromptTokenizer(char_tokenizer(), 16)  # one token per character
    system = "You answer questions about the router, briefly and politely. " * 3  # 183 tokens
    key = routing_key("/generate", {"text": system + "What is a page?"})
    first = h.pool.pick_prefill(key)
    assert not key.kv.known and key.kv.hashed(PAGE) == [] and key.kv.predicted == 0  # untokenized miss
    first.prompt_blocks += key.kv.blocks  # its prefill is in flight
    again = routing_key("/generate", {"text": system + "What is a page?"})
    assert h.pool.pick_prefill(again) is first
    assert again.kv.known and again.kv.predicted == (len(system) + 14) // PAGE * PAGE
    first.prompt_blocks = 0  # both answered
    other = routing_key("/generate", {"text": system + "How is it held?"})
    assert h.pool.pick_prefill(other) is first and other.kv.predicted == len(system) // PAGE * PAGE
    new = routing_key("/generate", {"text": "Something else entirely. " * 8})
    assert h.pool.pick_prefill(new) is not first and new.kv.hashed(PAGE) == []


def test_a_new_prefix_goes_to_the_emptiest_cache():
    """A miss everywhere costs the same: the worker whose index holds fewest pages takes the new prefix, so
    tenants spread over the caches instead of crowding the ones round-robin happened to pick."""
    h = Harness()
    h.follow(h.a, prompt(33))  # 8 pages cached on a
    h.follow(h.b, prompt(9))  # 2 on b
    assert h.pick(prompt(17)) is h.b
    h.follow(h.b, prompt(41))  # b now holds 12
    assert h.pick(prompt(17)) is h.a


def test_the_plan_counts_pages_in_flight_and_predicts_cached_tokens():
    h = Harness()
    ids = prompt(17)
    h.follow(h.a, ids[:12])
    h.follow(h.b)
    key = routing_key("/generate", {"input_ids": ids})
    assert h.pool.pick_prefill(key) is h.a
    assert key.kv.worker is h.a and key.kv.blocks == 1 and key.kv.predicted == 12  # it computes 1 of 4 pages
    assert h.a.url in h.policy.expect  # a lacks a page: an event must follow
    full = ids[:16]  # all 4 pages held: the engine still computes the last token, so 3 pages are served
    h.follow(h.a, full)
    key = routing_key("/generate", {"input_ids": full})
    assert h.pool.pick_prefill(key) is h.a and key.kv.predicted == 12


def test_a_lone_prefill_is_predicted_too():
    """With one candidate the pool skips pick(): the decision still records its pages and prediction."""
    h = Harness(prefills=("http://a:1",))
    ids = prompt(17)
    h.follow(h.a, ids[:12])
    key = routing_key("/generate", {"input_ids": ids})
    assert h.pool.pick_prefill(key) is h.a
    assert key.kv is not None and key.kv.worker is h.a and key.kv.blocks == 1 and key.kv.predicted == 12


def test_pages_are_hashed_only_as_far_as_a_worker_matches():
    ids = prompt(41)  # 10 pages
    want = [h for _, h in page_hashes(ids, PAGE)]
    plan = KvPlan(ids)
    assert plan.page(PAGE, 2) == want[2] and len(plan.hashed(PAGE)) == 3
    assert [plan.page(PAGE, k) for k in range(11)] == want + [None]
    h = Harness()
    h.follow(h.a, ids)  # all 10 pages
    h.follow(h.b, ids[:8])
    key = routing_key("/generate", {"input_ids": ids})
    assert h.pool.pick_prefill(key) is h.a and key.kv.predicted == 40
    fresh = routing_key("/generate", {"input_ids": prompt(41)})
    h.pool.pick_prefill(fresh)
    assert len(fresh.kv.hashed(PAGE)) == 1  # a miss everywhere: only its first page was hashed
    sent = h.policy.pending[fresh.kv.worker.url]
    assert len(sent) == 1  # ...and counts as sent; its later pages come through its frontier if asked


def test_a_worker_whose_events_stopped_is_estimated_as_cache_aware_does():
    h = Harness(stale_secs=5)
    ids = prompt(17)
    h.follow(h.a, ids[:16])  # the index says a holds everything...
    h.follow(h.b, ids[:4])
    h.policy.expect[h.a.url] = time.time() - 10  # ...but a was sent new pages 10 s ago and published nothing
    h.stats[h.a.url].last_received_at = time.time() - 20
    assert h.pick(ids) is h.b  # a's overlap comes from cache_aware's (empty) tree: cost 4 > b's 3
    assert h.fallbacks("worker_events_stale") == 1
    h.stats[h.a.url].last_received_at = time.time()  # events flow again
    h.policy.pending.clear()  # PENDING_SECS later: b's copy counts only once its events report it
    assert h.pick(ids) is h.a and h.a.url not in h.policy.expect
    assert h.fallbacks("worker_events_stale") == 1


def test_without_live_events_or_token_ids_the_decision_is_cache_aware():
    h = Harness()
    ids = prompt(17)
    assert h.pick(ids) in (h.a, h.b)  # nobody followed yet
    assert h.fallbacks("no_live_events") == 1
    h.follow(h.a)
    h.follow(h.b)
    assert h.pool.pick_prefill(routing_key("/generate", {"text": "no tokenizer yet"})) in (h.a, h.b)
    assert h.fallbacks("no_token_ids") == 1
    h.policy.tokenizer = PromptTokenizer(char_tokenizer(), 16)
    key = routing_key("/generate", {"text": "with a tokenizer now"})
    h.pool.pick_prefill(key)
    assert h.fallbacks("no_token_ids") == 1 and key.kv.page(PAGE, 0) is not None
    assert key.kv.ids[:4] == [119, 105, 116, 104]  # tokenized when a page was asked for


def test_a_removed_worker_is_forgotten():
    h = Harness()
    h.follow(h.a)
    h.pool.remove(h.a.url)
    assert h.a.url not in h.policy.block_size and h.a.url not in h.policy.workers and h.a.kv_counters is None


# ---- end to end -------------------------------------------------------------------------------------
def _metric(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"{name}(?:\{{(.*)\}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


@pytest.fixture(scope="module")
def kv_cluster(model_cache, tmp_path_factory):
    """Two prefills publishing KV events (page size 4), one decode, a router with --prefill-policy kv_aware."""
    logs = str(tmp_path_factory.mktemp("kv-aware-logs"))
    page = ("--page-size", str(PAGE))
    timeouts = ("--disaggregation-bootstrap-timeout", "60", "--disaggregation-waiting-timeout", "60")
    events = '{"publisher": "zmq", "endpoint": "tcp://127.0.0.1:0", "bind": true, ' \
             '"replay_endpoint": "tcp://127.0.0.1:0"}'
    report = ("--enable-cache-report",)  # chat answers' usage carries cached_tokens
    engines = [start_engine("prefill", logs, *page, *timeouts, *report, "--kv-events-config", events)
               for _ in range(2)]
    engines.append(start_engine("decode", logs, *page, *timeouts, *report))
    router = None
    try:
        wait_ready(engines)
        p1, p2, d = engines
        router = RouterProc(["--prefill", p1.url, str(p1.bootstrap_port), "--prefill", p2.url, str(p2.bootstrap_port),
                             "--decode", d.url, "--health-check-interval", "0", "--prefill-policy", "kv_aware",
                             "--decode-policy", "round_robin", "--kv-attach-retry-secs", "0.5"], logs)
        router.wait_ready()
        yield router, p1, p2, d
    finally:
        for proc in ([router] if router else []) + engines:
            proc.stop()


def test_repeats_go_to_the_prefill_that_cached_the_prompt_and_load_to_the_idle_one(kv_cluster):
    router, p1, p2, decode = kv_cluster
    prefills = (p1.url, p2.url)

    def scrape() -> str:
        return httpx.get(router.url + "/metrics", timeout=10).text

    def metric(name: str, **labels) -> float:
        return _metric(scrape(), name, **labels)

    def decisions(url: str) -> float:
        return metric("pdserve_router_policy_decisions_total", role="prefill", worker=url)

    def generate(ids: list[int]) -> dict:
        r = httpx.post(router.url + "/generate", timeout=120,
                       json={"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 4}})
        assert r.status_code == 200, r.text
        return r.json()

    # the router follows both prefills' events (their index gauges exist)
    wait_until(lambda: all(f'pdserve_router_kv_index_blocks{{worker="{u}"}}' in scrape() for u in prefills), 60,
               interval=0.2, what="the router following both prefills' KV events")
    ids = prompt(30)  # 7 whole pages
    assert generate(ids)["meta_info"]["cached_tokens"] == 0
    owner = next(u for u in prefills if decisions(u) == 1)
    other = p2.url if owner == p1.url else p1.url
    wait_until(lambda: metric("pdserve_router_kv_index_blocks", worker=owner) >= 7, 30, interval=0.1,
               what="the cached prompt's pages in the router's index")
    for _ in range(4):
        assert generate(ids)["meta_info"]["cached_tokens"] == 28  # 7 pages; the last token is computed
    assert (decisions(owner), decisions(other)) == (5, 0)
    text = scrape()
    assert _metric(text, "pdserve_router_kv_predicted_cached_tokens_total", worker=owner) == 4 * 28
    assert _metric(text, "pdserve_router_kv_reported_cached_tokens_total", worker=owner) == 4 * 28
    assert 0 <= _metric(text, "pdserve_router_kv_events_lag_seconds", worker=owner) < 60
    assert _metric(text, "pdserve_router_kv_fallbacks_total") == 0

    # Hold the prefills in flight: a stopped decode never takes their KV. The cached prompt and 8 more tokens
    # (9 pages) go to the owner (cost 2 + 0 against 9 + 0) and keep 2 pages to compute in flight there; then a
    # prompt sharing only its first page costs 6 + 2 there against 7 on the idle one (without the pages in
    # flight it would be 6 against 7: the owner).
    fresh = ids[:PAGE] + prompt(30 - PAGE)
    os.killpg(decode.proc.pid, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(2) as pool:
            repeat = pool.submit(generate, ids + prompt(8))
            wait_until(lambda: metric("pdserve_router_worker_inflight", role="prefill", worker=owner) == 1, 30,
                       interval=0.05, what="the repeat in flight on the prefill that cached it")
            other_one = pool.submit(generate, fresh)
            wait_until(lambda: metric("pdserve_router_worker_inflight", role="prefill", worker=other) == 1, 30,
                       interval=0.05, what="the fresh prompt in flight on the idle prefill")
            os.killpg(decode.proc.pid, signal.SIGCONT)
            assert repeat.result()["meta_info"]["cached_tokens"] == 28
            assert other_one.result()["meta_info"]["cached_tokens"] == 0
    finally:
        os.killpg(decode.proc.pid, signal.SIGCONT)
    assert (decisions(owner), decisions(other)) == (6, 1)

    # A text prompt is tokenized as the engines do (the workers' tokenizer): its repeat is predicted exactly.
    text = "a system prompt that every request of this app repeats, word for word. "
    wait_until(lambda: metric("pdserve_router_kv_tokenizer_ready") == 1, 60, interval=0.2,
               what="the router's tokenizer loaded")
    r = httpx.post(router.url + "/generate", timeout=120,
                   json={"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": 2}})
    assert r.status_code == 200 and r.json()["meta_info"]["cached_tokens"] == 0
    wait_until(lambda: metric("pdserve_router_kv_index_blocks") >= 7 + 7 + 1, 30, interval=0.1,
               what="the text prompt's pages in the router's index")
    r = httpx.post(router.url + "/generate", timeout=120,
                   json={"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": 2}})
    assert r.status_code == 200 and r.json()["meta_info"]["cached_tokens"] > 0
    text = scrape()
    for url in prefills:
        predicted = _metric(text, "pdserve_router_kv_predicted_cached_tokens_total", worker=url)
        assert predicted == _metric(text, "pdserve_router_kv_reported_cached_tokens_total", worker=url), url
    assert _metric(text, "pdserve_router_kv_predicted_cached_tokens_total") == 5 * 28 + r.json()["meta_info"][
        "cached_tokens"]
    assert _metric(text, "pdserve_router_kv_fallbacks_total") == 0


def test_a_repeated_chat_is_predicted_as_the_engine_caches_it(kv_cluster):
    """Chat prompts are rendered with the chat template as the engine renders them: the router's predicted
    cached tokens equal the engines' reported ``cached_tokens`` for a repeated conversation and its next turn,
    with no fallback (a chat used to fall back to cache_aware)."""
    router, p1, p2, _ = kv_cluster

    def totals() -> tuple[float, float, float]:
        text = httpx.get(router.url + "/metrics", timeout=10).text
        return (_metric(text, "pdserve_router_kv_predicted_cached_tokens_total"),
                _metric(text, "pdserve_router_kv_reported_cached_tokens_total"),
                _metric(text, "pdserve_router_kv_fallbacks_total"))

    def chat(messages: list[dict]) -> tuple[str, int]:
        r = httpx.post(router.url + "/v1/chat/completions", timeout=120,
                       json={"messages": messages, "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200, r.text
        out = r.json()
        return out["choices"][0]["message"]["content"], out["usage"]["prompt_tokens_details"]["cached_tokens"]

    wait_until(lambda: _metric(httpx.get(router.url + "/metrics", timeout=10).text,
                               "pdserve_router_kv_tokenizer_ready") == 1, 60, interval=0.2,
               what="the router's tokenizer loaded")
    before = totals()
    messages = [{"role": "system", "content": f"conversation {next(_fresh)}: you answer in three words."},
                {"role": "user", "content": "which prefill holds this conversation's pages?"}]
    blocks = lambda: _metric(httpx.get(router.url + "/metrics", timeout=10).text,  # noqa: E731
                             "pdserve_router_kv_index_blocks")
    seen = blocks()
    answer, cached = chat(messages)
    assert cached == 0
    wait_until(lambda: blocks() > seen, 30, interval=0.1, what="the chat's pages in the router's index")
    again_answer, again = chat(messages)
    assert again > 0
    turn = messages + [{"role": "assistant", "content": again_answer},
                       {"role": "user", "content": "and the next turn?"}]
    _, follow = chat(turn)
    assert follow >= again // PAGE * PAGE - PAGE  # the conversation so far, but the last page of the old prompt
    predicted, reported, fallbacks = (a - b for a, b in zip(totals(), before))
    assert reported == again + follow and predicted == reported
    assert fallbacks == 0
