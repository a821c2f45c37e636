"""The decode's radix prefix cache (``--disaggregation-decode-enable-radix-cache``), end to end: a decode that already
holds a prompt's leading pages registers only the missing ones and its prefill sends only those (bytes counted
exactly), greedy output and, with speculation, the accept lengths equal a pair with the flag off, the draft's cached
pages are reused only where the token after them matches, eviction and aborts leak no page and never free one a
request reads, and the prefill refuses a registration whose cached prefix is not whole pages short of the prompt."""

from __future__ import annotations

import asyncio
import itertools
import random

import httpx
import pytest

from conftest import SPEC_FLAGS
from engines import async_metric, start_engine, wait_ready
from pd.engines.handoff.kv_pool import KVPagePool
from pd.engines.models.model_runner import KVLayout
from pd.engines.prefix.decode_prefix import DecodePrefixCache
from pd.util.wait import async_wait_until
from pdclient import add_rooms, pd_post

PAGE = 16  # the engines' --page-size (its default: the shared flag-off pairs run with it)
SMALL_POOL_PAGES = 8
GREEDY = {"temperature": 0, "max_new_tokens": 24}
SPEC_GREEDY = {"temperature": 0, "max_new_tokens": 96, "ignore_eos": True}
BYTES = "pdserve_kv_transfer_bytes_total"
DECODE_HIT = "pdserve_decode_prefix_cached_tokens_total"
HELD = ("pdserve_kv_pages_held", "pdserve_draft_kv_pages_held", "pdserve_kv_pages_quarantined")
_seeds = itertools.count(1)


def prompt(length: int) -> list[int]:
    """A fresh random prompt (builtin:tiny's byte ids); its first page is unique, so it starts from a miss."""
    rng = random.Random(1000 + next(_seeds))
    return [rng.randrange(3, 259) for _ in range(length)]


def pages_for(tokens: int) -> int:
    return -(-tokens // PAGE)


# The built-in draft's attention branch is weak (pd.engines.models.builtin_draft, BRANCH_SCALE): wrong prompt KV in
# its cache almost never changes what it proposes, so the acceptance could not tell a broken draft cache from a
# sound one. This copy's attention output is 3x as strong: with 32 stale prompt positions the accept lengths of
# 64 greedy tokens changed on 9 of 10 random prompts, and it still accepts 2.9 tokens per verify step.
DRAFT_ATTENTION_GAIN = 3.0


def attentive_draft(directory) -> str:
    """A copy of builtin:tiny's draft with its attention output scaled by ``DRAFT_ATTENTION_GAIN``; its path."""
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    from pd.engines.spec.draft_model import resolve_draft_path

    src = Path(resolve_draft_path("builtin:tiny", None))
    out = Path(directory) / "attentive-draft"
    shutil.copytree(src, out)
    weights = load_file(str(out / "model.safetensors"))
    weights["model.decoder.self_attn.o_proj.weight"] = weights["model.decoder.self_attn.o_proj.weight"] \
        * DRAFT_ATTENTION_GAIN
    save_file(weights, str(out / "model.safetensors"))
    return str(out)


@pytest.fixture(scope="module")
def reuse(engines, tmp_path_factory):
    """Decodes with the flag on, paired with the shared flag-off pair's prefill (``engines``): plain and with a pool
    of ``SMALL_POOL_PAGES`` pages; and a speculative prefill with two decodes, the flag on and off, all drafting
    with ``attentive_draft``. The flag-off decodes are the baseline."""
    logs = str(tmp_path_factory.mktemp("decode-prefix-logs"))
    timeouts = ("--disaggregation-bootstrap-timeout", "10", "--disaggregation-waiting-timeout", "10")
    flag = "--disaggregation-decode-enable-radix-cache"
    spec = (*SPEC_FLAGS, "--speculative-draft-model-path", attentive_draft(tmp_path_factory.mktemp("draft")))
    started = {
        "decode": start_engine("decode", logs, flag, *timeouts),
        "small": start_engine("decode", logs, flag, *timeouts, "--max-total-tokens", str(SMALL_POOL_PAGES * PAGE)),
        "spec_prefill": start_engine("prefill", logs, *spec, *timeouts),
        "spec": start_engine("decode", logs, flag, *spec, *timeouts),
        "spec_off": start_engine("decode", logs, *spec, *timeouts),
    }
    try:
        wait_ready(list(started.values()))
        yield {**started, "prefill": engines["prefill"], "off": engines["decode"]}
    finally:
        for e in started.values():
            e.stop()


async def run(prefill, decode, ids: list[int], sampling: dict = GREEDY) -> dict:
    """One greedy /generate through a PD pair; the decode's answer."""
    body = {"input_ids": ids, "sampling_params": sampling, "return_logprob": True}
    async with httpx.AsyncClient(timeout=120) as c:
        status, dec, (pstatus, pre) = await pd_post(c, prefill, decode, "/generate", body, None)
    assert status == 200 and pstatus == 200, (dec, pre)
    return dec


async def measured(prefill, decode, ids: list[int], sampling: dict = GREEDY) -> tuple[dict, int, int]:
    """``run``, with the KV bytes the decode received and the prompt tokens it served from its cache."""
    b0, h0 = await async_metric(decode, BYTES), await async_metric(decode, DECODE_HIT)
    answer = await run(prefill, decode, ids, sampling)
    return answer, int(await async_metric(decode, BYTES) - b0), int(await async_metric(decode, DECODE_HIT) - h0)


def assert_same_output(got: dict, want: dict) -> None:
    assert got["output_ids"] == want["output_ids"]
    g = [lp for lp, *_ in got["meta_info"]["output_token_logprobs"]]
    w = [lp for lp, *_ in want["meta_info"]["output_token_logprobs"]]
    assert g == pytest.approx(w, abs=1e-4)  # float32 sums over KV imported from other pages


def assert_same_acceptance(got: dict, want: dict) -> None:
    """The draft proposed the same tokens: as many verify steps and the same accept length and rate."""
    for key in ("spec_verify_ct", "spec_accept_length", "spec_accept_rate"):
        assert got["meta_info"][key] == want["meta_info"][key], key


async def assert_nothing_held(*engines_) -> None:
    """No page of either pool held by a request or quarantined (cached pages are not held)."""
    for e in engines_:
        for name in HELD:
            async def zero(e=e, name=name) -> bool:
                return await async_metric(e, name) == 0
            await async_wait_until(zero, 15, what=f"{name} back to 0 on {e.url}")


async def flush(engine) -> None:
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(engine.url + "/flush_cache", params={"timeout": 10})
    assert r.status_code == 200, r.text


# ---- the transfer shrinks, the output does not change ------------------------------------------------------------
async def test_a_shared_prefix_moves_only_the_missing_pages(reuse):
    """The second prompt shares 2 whole pages with the first: its decode registers 2 of its 4 pages, and exactly
    those bytes move. Greedy tokens equal the flag-off pair; ``cached_tokens`` is SGLang's (the longer of the
    prefill's and the decode's hits: the prefill's cache was flushed in between)."""
    p, d = reuse["prefill"], reuse["decode"]
    first = prompt(40)
    second = first[:2 * PAGE] + prompt(18)  # 50 tokens: 4 pages, the first 2 cached on the decode
    a, bytes_a, hit_a = await measured(p, d, first)
    page_bytes, rest = divmod(bytes_a, pages_for(40))
    assert hit_a == 0 and rest == 0 and page_bytes > 0
    assert await async_metric(p, "pdserve_kv_pages_cached") > 0
    await flush(p)
    b, bytes_b, hit_b = await measured(p, d, second)
    assert hit_b == 2 * PAGE
    assert bytes_b == (pages_for(50) - 2) * page_bytes
    assert b["meta_info"]["cached_tokens"] == 2 * PAGE  # the prefill's own hit was 0
    assert_same_output(a, await run(p, reuse["off"], first))
    assert_same_output(b, await run(p, reuse["off"], second))
    again, bytes_again, hit_again = await measured(p, d, second)  # the whole prompt but its last partial page
    assert hit_again == 3 * PAGE and bytes_again == page_bytes
    assert_same_output(again, b)
    await assert_nothing_held(p, d)


async def test_the_prefill_sends_its_own_cached_pages_past_the_decodes_prefix(reuse):
    """The decode holds 1 page of a prompt, its prefill 3 (its own radix cache): the prefill writes its 2 cached
    pages past the decode's one and its new last page, and the answer equals the flag-off pair's."""
    p, d, off = reuse["prefill"], reuse["decode"], reuse["off"]
    ids = prompt(60)
    _, miss_bytes, _ = await measured(p, d, ids[:PAGE] + prompt(20))  # the decode caches the first page
    page_bytes = miss_bytes // pages_for(PAGE + 20)
    await run(p, off, ids)  # the prefill caches the 3 whole pages
    b0 = await async_metric(p, BYTES)
    got, nbytes, hit = await measured(p, d, ids)
    assert hit == PAGE and nbytes == (pages_for(60) - 1) * page_bytes
    assert await async_metric(p, BYTES) - b0 == nbytes  # the prefill counts what it wrote
    assert got["meta_info"]["cached_tokens"] == 3 * PAGE  # the prefill's hit, the longer one
    assert_same_output(got, await run(p, off, ids))


async def test_speculative_hits_keep_the_draft_cache_and_the_acceptance(reuse):
    """With speculation the cached draft pages come along: prompts sharing 3 whole pages (and the token after them)
    with a first one receive only their last page in both caches, and their tokens and accept lengths equal the
    flag-off speculative pair's (wrong draft KV keeps greedy tokens but changes what the draft proposes)."""
    p, d, off = reuse["spec_prefill"], reuse["spec"], reuse["spec_off"]
    first = prompt(60)
    a, bytes_a, hit_a = await measured(p, d, first, SPEC_GREEDY)
    both_page_bytes, rest = divmod(bytes_a, pages_for(60))  # a target page and a draft page
    assert hit_a == 0 and rest == 0
    answers = [(a, first)]
    for _ in range(3):
        ids = first[:3 * PAGE + 1] + prompt(12)  # the token after the shared pages is the same: the draft's too
        got, nbytes, hit = await measured(p, d, ids, SPEC_GREEDY)
        assert hit == 3 * PAGE and nbytes == both_page_bytes
        answers.append((got, ids))
    for got, ids in answers:
        want = await run(p, off, ids, SPEC_GREEDY)
        assert_same_output(got, want)
        assert_same_acceptance(got, want)
    await assert_nothing_held(p, d)


async def test_the_draft_reuses_a_page_only_when_the_next_token_matches(reuse):
    """A prompt sharing 2 whole pages but not the token after them: without speculation the decode reuses both
    pages; with it only the first (the second's last draft entry was computed from the other token). A prompt of
    exactly 2 pages records its first output token as the next one: a longer prompt continuing with that token
    reuses both pages, one continuing with another token only the first."""
    shared = prompt(40)
    other = shared[:2 * PAGE] + [shared[2 * PAGE] % 250 + 3] + prompt(17)
    cases = [(reuse["prefill"], reuse["decode"], reuse["off"], GREEDY, 2),
             (reuse["spec_prefill"], reuse["spec"], reuse["spec_off"], SPEC_GREEDY, 1)]
    for p, d, off, sampling, pages_hit in cases:
        await run(p, d, shared, sampling)
        got, _, hit = await measured(p, d, other, sampling)
        assert hit == pages_hit * PAGE, d.args
        want = await run(p, off, other, sampling)
        assert_same_output(got, want)
        if d is reuse["spec"]:
            assert_same_acceptance(got, want)

    p, d = reuse["spec_prefill"], reuse["spec"]
    exact = prompt(2 * PAGE)
    first_out = (await run(p, d, exact, SPEC_GREEDY))["output_ids"][0]
    for nxt, pages_hit in ((first_out, 2), (first_out % 250 + 3, 1)):
        ids = exact + [nxt] + prompt(9)
        got, _, hit = await measured(p, d, ids, SPEC_GREEDY)
        assert hit == pages_hit * PAGE, nxt
        want = await run(p, reuse["spec_off"], ids, SPEC_GREEDY)
        assert_same_output(got, want)
        assert_same_acceptance(got, want)
    await assert_nothing_held(p, d)


# ---- pressure, aborts, refusals ----------------------------------------------------------------------------------
async def test_eviction_under_pressure_finishes_everything_and_holds_nothing(reuse):
    """An 8-page pool, prompts of 3 to 4 pages sharing prefixes, 4 at a time: requests wait for pages and evict
    unlocked cached ones, never a page another request reads (every answer equals the flag-off pair's)."""
    p, small = reuse["prefill"], reuse["small"]
    roots = [prompt(2 * PAGE) for _ in range(3)]
    prompts = [root + prompt(random.Random(i).randrange(8, 30)) for i in range(4) for root in roots]
    want = [await run(p, reuse["off"], ids) for ids in prompts]
    h0 = await async_metric(small, DECODE_HIT)
    for start in range(0, len(prompts), 4):
        got = await asyncio.gather(*(run(p, small, ids) for ids in prompts[start:start + 4]))
        for g, w in zip(got, want[start:start + 4]):
            assert_same_output(g, w)
    assert await async_metric(small, DECODE_HIT) > h0  # some prefixes survived to be reused
    await assert_nothing_held(small)
    assert 0 < await async_metric(small, "pdserve_kv_pages_cached") <= SMALL_POOL_PAGES


async def test_a_decode_aborted_while_waiting_for_its_kv_leaks_nothing_and_keeps_the_prefix(reuse):
    """A request that hits the cache, registers, then is aborted before any KV comes: its new pages go back once the
    prefill confirms no write, the cached pages it locked stay cached and valid for the next request."""
    p, d = reuse["prefill"], reuse["decode"]
    first = prompt(40)
    second = first[:2 * PAGE] + prompt(20)
    await run(p, d, first)
    cached = await async_metric(d, "pdserve_kv_pages_cached")
    body = add_rooms({"input_ids": second, "sampling_params": GREEDY, "rid": "decode-prefix-abort"},
                     "127.0.0.1", p.bootstrap_port, None)
    async with httpx.AsyncClient(timeout=60) as c:
        waiting = asyncio.create_task(c.post(d.url + "/generate", json=body))  # no prefill request: no KV comes

        async def registered() -> bool:
            return await async_metric(d, "sglang:num_decode_transfer_queue_reqs") == 1
        await async_wait_until(registered, 10, what="the decode request waiting for its KV")
        assert await async_metric(d, "pdserve_kv_pages_held") >= 2  # the locked hit and its new pages
        r = await c.post(d.url + "/abort_request", json={"rid": "decode-prefix-abort"})
        assert r.status_code == 200
        answer = await waiting
    assert answer.json()["meta_info"]["finish_reason"]["type"] == "abort", answer.text
    await assert_nothing_held(d)
    assert await async_metric(d, "pdserve_kv_pages_cached") == cached
    got, _, hit = await measured(p, d, second)
    assert hit == 2 * PAGE
    assert_same_output(got, await run(p, reuse["off"], second))


@pytest.mark.parametrize("prefix, num_tokens, pages, param, words", [
    (5, 40, 3, "decode_prefix_len", "not a multiple of the page size 16"),
    (32, 32, 1, "decode_prefix_len", "must be less than num_tokens 32"),
    (48, 40, 1, "decode_prefix_len", "must be less than num_tokens 40"),
    (16, 40, 3, "page_addrs", "3 pages for 40 tokens past a cached prefix of 16"),
])
async def test_the_prefill_refuses_a_bad_cached_prefix(reuse, prefix, num_tokens, pages, param, words):
    reg = {"room": random.randrange(2**63), "session_id": "127.0.0.1:1", "page_addrs": [(i + 1) << 30
                                                                                          for i in range(pages)],
           "page_bytes": 4096, "page_size": PAGE, "layout": {"num_layers": 2}, "num_tokens": num_tokens,
           "decode_prefix_len": prefix}
    async with httpx.AsyncClient(timeout=10) as c:
        r = await c.post(f"http://127.0.0.1:{reuse['prefill'].bootstrap_port}/pd/register", json=reg)
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["status"] == "failed" and body["error"]["param"] == param
    assert words in body["reason"], body["reason"]


# ---- the cache alone ---------------------------------------------------------------------------------------------
def pools(num_pages: int) -> tuple[KVPagePool, KVPagePool]:
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=2, dtype="float32")
    return KVPagePool(layout, 2, 2 * num_pages), KVPagePool(layout, 2, 2 * num_pages)


async def test_eviction_frees_the_draft_page_with_its_target_page_whichever_pool_is_short():
    target, draft = pools(4)
    cache = DecodePrefixCache(target, draft)
    ids = [1, 2, 3, 4, 5]
    hit = cache.match_prompt(ids)
    pages, drafts = await target.alloc(5), await draft.alloc(5)
    cache.finish_prompt(hit, ids, pages, drafts, first_token=9)
    assert (target.held, draft.held) == (2, 2) and cache.cached_pages() == 2
    hit = cache.match_prompt(ids)  # a hit locks: nothing to evict
    assert hit.cached == 4 and hit.draft_pages == drafts[:2]
    assert draft.try_alloc(6) is None
    cache.unlock(hit)
    assert len(draft.try_alloc(6) or []) == 3  # evicted from the draft pool's side: the target pages went back
    assert target.held == 0 and cache.cached_pages() == 0


async def test_a_match_stops_at_the_first_page_whose_next_token_differs():
    target, draft = pools(8)
    cache = DecodePrefixCache(target, draft)
    ids = [1, 2, 3, 4, 5, 6]  # three whole pages; the last one's next token is the first output token, 7
    hit = cache.match_prompt(ids)
    cache.finish_prompt(hit, ids, await target.alloc(6), await draft.alloc(6), first_token=7)
    for other, cached in (([1, 2, 3, 4, 5, 6, 7, 0], 6), ([1, 2, 3, 4, 5, 6, 8, 0], 4), ([1, 2, 3, 9, 9], 2),
                          ([1, 2, 4, 4, 4], 0)):
        hit = cache.match_prompt(other)
        assert hit.cached == cached, other
        cache.unlock(hit)
    plain = DecodePrefixCache(*pools(8)[:1])  # without speculation the next token does not matter
    hit = plain.match_prompt(ids)
    plain.finish_prompt(hit, ids, await plain.pool.alloc(6), [], first_token=None)
    assert plain.match_prompt([1, 2, 3, 4, 5, 6, 8, 0]).cached == 6
