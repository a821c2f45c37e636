"""The reference engine's radix prefix cache, end to end: a repeated prompt computes only its uncached pages and
answers the same, the hit is reported as SGLang reports it, memory pressure evicts instead of stalling, nothing
leaks, and a prefill publishes what it caches as SGLang's KV events."""

from __future__ import annotations

import asyncio
import itertools
import time

import httpx
import pytest

from engines import metric, start_engine, wait_ready
from pd.util.kv_block_hash import page_hashes
from pdclient import pd_post

PAGE = 4
GREEDY = {"temperature": 0, "max_new_tokens": 6}
_fresh = itertools.count(1)


def prompt(length: int) -> list[int]:
    """A prompt no other test sends (its first token is unique), so each test starts from a miss."""
    first = 300 + next(_fresh)
    return [first] + [(first * 7 + i) % 250 + 1 for i in range(length - 1)]


@pytest.fixture(scope="module")
def cache_engines(model_cache, tmp_path_factory):
    """A null engine with the cache, one without, one with a small pool, and a PD pair whose prefill publishes
    KV events (page size 4, so short prompts span pages)."""
    logs = str(tmp_path_factory.mktemp("prefix-logs"))
    page = ("--page-size", str(PAGE))
    timeouts = ("--disaggregation-bootstrap-timeout", "10", "--disaggregation-waiting-timeout", "10")
    events = '{"publisher": "zmq", "endpoint": "tcp://127.0.0.1:0", "bind": true, "replay_endpoint": ' \
             '"tcp://127.0.0.1:0"}'
    started = {
        "cached": start_engine("null", logs, *page),
        "uncached": start_engine("null", logs, *page, "--disable-radix-cache"),
        "small": start_engine("null", logs, *page, "--max-total-tokens", "64", "--enable-cache-report"),
        "prefill": start_engine("prefill", logs, *page, *timeouts, "--kv-events-config", events),
        "decode": start_engine("decode", logs, *page, *timeouts),
    }
    try:
        wait_ready(list(started.values()))
        yield started
    finally:
        for e in started.values():
            e.stop()


async def generate(engine, ids: list[int], **extra) -> dict:
    async with httpx.AsyncClient(timeout=60) as c:
        r = await c.post(engine.url + "/generate", json={"input_ids": ids, "sampling_params": GREEDY,
                                                         "return_logprob": True, **extra})
    assert r.status_code == 200, r.text
    return r.json()


async def until(condition, describe, timeout: float = 10) -> None:
    """Poll ``condition`` until it holds; fail with ``describe()`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, describe()
        await asyncio.sleep(0.02)


def tokens_and_logprobs(answer: dict) -> tuple[list[int], list[float]]:
    lps = answer["meta_info"]["output_token_logprobs"]
    return [t for _, t, *_ in lps], [lp for lp, *_ in lps]


async def test_a_repeated_prompt_reuses_its_pages_and_answers_the_same(cache_engines):
    ids = prompt(30)
    first = await generate(cache_engines["cached"], ids)
    again = await generate(cache_engines["cached"], ids)
    plain = await generate(cache_engines["uncached"], ids)
    assert first["meta_info"]["cached_tokens"] == 0
    assert again["meta_info"]["cached_tokens"] == 28  # whole pages, one prompt token left to compute
    assert plain["meta_info"]["cached_tokens"] == 0
    want_ids, want_lps = tokens_and_logprobs(plain)
    for answer in (first, again):
        got_ids, got_lps = tokens_and_logprobs(answer)
        assert got_ids == want_ids
        assert got_lps == pytest.approx(want_lps, abs=1e-4)  # float32: attention over imported KV, other sums
    hit = metric(cache_engines["cached"], "sglang:cache_hit_rate")
    assert hit == pytest.approx(28 / 30)
    async with httpx.AsyncClient(timeout=30) as c:
        assert (await c.post(cache_engines["cached"].url + "/flush_cache")).status_code == 200
    assert (await generate(cache_engines["cached"], ids))["meta_info"]["cached_tokens"] == 0


async def test_a_longer_prompt_reuses_a_shorter_ones_pages(cache_engines):
    ids = prompt(21)
    await generate(cache_engines["cached"], ids)
    longer = await generate(cache_engines["cached"], ids + [5, 6, 7, 8, 9, 10, 11])
    assert longer["meta_info"]["cached_tokens"] == 20


async def test_prompt_logprobs_are_computed_not_served_from_the_cache(cache_engines):
    ids = prompt(30)
    await generate(cache_engines["cached"], ids)
    asked = {"logprob_start_len": 10}
    cached = await generate(cache_engines["cached"], ids, **asked)
    plain = await generate(cache_engines["uncached"], ids, **asked)
    assert cached["meta_info"]["cached_tokens"] == 8  # the match stops before position 9's logits are needed
    got = [lp for lp, *_ in cached["meta_info"]["input_token_logprobs"]]
    want = [lp for lp, *_ in plain["meta_info"]["input_token_logprobs"]]
    assert len(got) == len(want) == 20 and got == pytest.approx(want, abs=1e-4)


async def test_openai_usage_reports_cached_tokens_with_enable_cache_report(cache_engines):
    ids = prompt(26)
    body = {"model": "builtin:tiny", "prompt": ids, "max_tokens": 3, "temperature": 0, "n": 2}
    async with httpx.AsyncClient(timeout=60) as c:
        usages = [(await c.post(engine.url + "/v1/completions", json=body)).json()["usage"]
                  for engine in (cache_engines["small"], cache_engines["small"], cache_engines["cached"])]
    assert usages[0]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert usages[1]["prompt_tokens_details"] == {"cached_tokens": 24}  # once per prompt, not per sample
    assert "prompt_tokens_details" not in usages[2]  # without the flag, as SGLang


async def test_memory_pressure_evicts_cached_pages_and_nothing_leaks(cache_engines):
    """16 pages: each 40-token prompt needs 10, so every new one evicts what the last left; concurrent ones wait
    for pages instead of failing."""
    small = cache_engines["small"]
    for _ in range(4):
        await generate(small, prompt(40))
    answers = await asyncio.gather(*(generate(small, prompt(20)) for _ in range(4)))
    assert all(a["meta_info"]["completion_tokens"] == 6 for a in answers)
    assert metric(small, "pdserve_kv_pages_held") == 0
    assert 0 < metric(small, "pdserve_kv_pages_cached") <= 16


async def test_pd_prefill_hit_reaches_the_decode_and_its_kv_events_index_it(cache_engines):
    from pd.router.kv_index import KVIndexManager

    prefill, decode = cache_engines["prefill"], cache_engines["decode"]
    async with httpx.AsyncClient(timeout=30) as c:
        info = (await c.get(prefill.url + "/server_info")).json()["kv_events"]
    assert info["block_size"] == PAGE and info["publisher"] == "zmq"
    manager = KVIndexManager()
    host = info["endpoint_host"]
    manager.add_worker("prefill", f"tcp://{host}:{info['endpoint_port_base']}",
                       f"tcp://{host}:{info['replay_endpoint_port_base']}", info["topic"])
    try:
        ids = prompt(26)
        hashes = [h for _, h in page_hashes(ids, PAGE)]
        body = {"input_ids": ids, "sampling_params": GREEDY}
        answers = []
        async with httpx.AsyncClient(timeout=30) as c:
            for _ in range(2):
                status, dec, (pstatus, _pre) = await pd_post(c, prefill, decode, "/generate", body, None)
                assert status == 200 and pstatus == 200, dec
                answers.append(dec)
        assert [a["meta_info"]["cached_tokens"] for a in answers] == [0, 24]
        assert answers[0]["output_ids"] == answers[1]["output_ids"]
        await until(lambda: manager.overlap(["prefill"], hashes)["prefill"] == len(hashes), manager.stats)
        async with httpx.AsyncClient(timeout=30) as c:  # SGLang's /flush_cache: AllBlocksCleared follows
            assert (await c.post(prefill.url + "/flush_cache")).status_code == 200
        await until(lambda: manager.overlap(["prefill"], hashes)["prefill"] == 0, manager.stats)
        assert metric(prefill, "pdserve_kv_pages_cached") == 0
    finally:
        await manager.close()
    assert metric(prefill, "pdserve_kv_pages_held") == 0 and metric(decode, "pdserve_kv_pages_held") == 0
