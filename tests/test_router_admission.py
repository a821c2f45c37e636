"""Admission at the router: the in-flight limit and its queue (429 + Retry-After), the per-request
token cap, and batched aborts (one /abort_request per side per request), against the stand-in
engines of test_router_faults (exact records of every request and abort call) and, for the KV
pages, the real reference engines.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from engines import async_metric
from pd.router.admission import InFlightLimit, check, request_tokens
from pd.router.config import RouterSettings
from pd.router.metrics import GaugeValue
from pd.router.rooms import request_shape
from pd.util.wait import async_wait_until
from routers import RouterProc, pd_router
from test_router_faults import PROMPT, call, gen, metric, running_standins, until, workers

ADMISSION = ["--disable-retries", "--health-check-interval-secs", "0"]
WAIT_LONG = 15  # s a stand-in prefill holds its answer; the aborts must end it long before


# ---- the token estimate and the caps (units) -------------------------------------------------------
@pytest.mark.parametrize("route, body, tokens", [
    ("/generate", {"input_ids": [[1] * 30, [2] * 10], "sampling_params": {"max_new_tokens": 5, "n": 2}},
     2 * (30 + 5) + 2 * (10 + 5)),
    ("/generate", {"text": "héllo"}, 6 + 128),  # UTF-8 bytes; SGLang's default max_new_tokens
    ("/generate", {"text": ["ab", "abc"], "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 2}]},
     (2 + 1) + (3 + 2)),
    ("/generate", {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": None}}, 3),
    ("/v1/completions", {"prompt": "abcd", "n": 3}, 3 * (4 + 16)),
    ("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 7}, 3 + 7),
    ("/v1/completions", {"prompt": [[1, 2], [3]], "max_tokens": 1}, (2 + 1) + (1 + 1)),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"},
                                           {"role": "user", "content": [{"type": "text", "text": "日本"}]}],
                              "max_completion_tokens": 10, "n": 2}, 2 * (2 + 6 + 10)),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, 2 + 4),
    ("/v1/chat/completions", {"messages": "not a list"}, 0),  # the engine's 400, not the router's guess
])
def test_request_tokens_count_ids_text_bytes_and_output_length(route, body, tokens):
    assert request_tokens(route, body, request_shape(route, body)) == tokens


def test_the_token_cap_names_its_flag():
    s = RouterSettings(max_total_tokens_per_request=100)
    body = {"input_ids": [[1] * 40, [1] * 40], "sampling_params": {"max_new_tokens": 11}}
    over = check("/generate", request_shape("/generate", body), s, body)
    assert over is not None and "up to 102 tokens" in over.message
    assert "limit of 100 (--max-total-tokens-per-request)" in over.message
    body["sampling_params"]["max_new_tokens"] = 10
    assert check("/generate", request_shape("/generate", body), s, body) is None


async def test_in_flight_limit_is_fifo_bounded_and_leaves_no_waiter_behind():
    depth = GaugeValue()
    lim = InFlightLimit(2, 2, timeout=5, depth=depth)
    assert lim.enter() and lim.enter() and not lim.enter()
    order = []

    async def waiter(name):
        got = await lim.wait()
        order.append((name, got))

    a = asyncio.create_task(waiter("a"))
    await async_wait_until(lambda: lim.waiting == 1, 2, interval=0.001, what="a queued", retry=())
    b = asyncio.create_task(waiter("b"))
    await async_wait_until(lambda: lim.waiting == 2, 2, interval=0.001, what="b queued", retry=())
    assert depth.value == 2 and await lim.wait() == "queue_full"
    assert not lim.enter()  # a free slot would go to the queue first, never to a newcomer
    lim.release(1.0)
    lim.release(1.0)
    await asyncio.gather(a, b)
    assert order == [("a", None), ("b", None)] and lim.active == 2 and depth.value == 0
    # a waiter that leaves (its client went away) takes its place in the queue with it
    c = asyncio.create_task(lim.wait())
    await async_wait_until(lambda: lim.waiting == 1, 2, interval=0.001, what="c queued", retry=())
    c.cancel()
    with pytest.raises(asyncio.CancelledError):
        await c
    assert lim.waiting == 0 and depth.value == 0
    lim.release(1.0)
    lim.release(1.0)
    assert lim.active == 0 and lim.enter()
    # the wait is bounded
    quick = InFlightLimit(1, 1, timeout=0.05, depth=GaugeValue())
    assert quick.enter()
    assert await quick.wait() == "queue_timeout" and quick.waiting == 0
    assert 1 <= quick.retry_after() <= 60
    assert InFlightLimit(-1, 0, 1, GaugeValue()).enter()  # -1: unlimited


# ---- the in-flight limit through a real router -------------------------------------------------------
@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return str(tmp_path_factory.mktemp("admission-logs"))


@pytest.fixture(scope="module")
def si(logs):
    with running_standins(logs, "p0", "d0") as procs:
        yield procs


@pytest.fixture(autouse=True)
def fresh_standins(request):
    if "si" in request.fixturenames:
        for p in request.getfixturevalue("si").values():
            p.reset()


@pytest.fixture(scope="module")
def routers(si, logs):
    started: dict[str, RouterProc] = {}

    def get(name: str, *flags: str) -> RouterProc:
        if name not in started:
            started[name] = RouterProc(workers(si, ("p0",), ("d0",)) + ADMISSION + list(flags), logs)
            started[name].wait_ready()
        return started[name]

    try:
        yield get
    finally:
        for r in started.values():
            r.stop()


def sent(si) -> tuple[int, int]:
    """Generation requests the stand-in prefill and decode have seen."""
    return len(si["p0"].state()["requests"]), len(si["d0"].state()["requests"])


async def test_over_the_in_flight_limit_requests_queue_then_get_429(si, routers):
    r = routers("queue", "--max-concurrent-requests", "2", "--queue-size", "1", "--queue-timeout-secs", "60")
    for p in si.values():
        p.fault("stall", count=2)  # two requests held open on both sides until their clients leave
    async with httpx.AsyncClient(timeout=60) as c:
        held = [asyncio.create_task(c.post(r.url + "/generate", json=gen())) for _ in range(2)]
        await until(lambda: sent(si) == (2, 2), what="two requests at both stand-ins")
        queued = asyncio.create_task(c.post(r.url + "/generate", json=gen()))
        await until(lambda: metric(r, "pdserve_router_requests_queued") == 1, what="one request queued")
        t0 = time.monotonic()
        full = await c.post(r.url + "/generate", json=gen(), headers={"X-Request-Id": "busy-1"})
        assert time.monotonic() - t0 < PROMPT
        assert full.status_code == 429 and full.headers["x-request-id"] == "busy-1"
        assert 1 <= int(full.headers["retry-after"]) <= 60
        error = full.json()["error"]
        assert error["type"] == "RateLimitError" and error["code"] == 429
        for says in ("limit of 2 requests in flight (--max-concurrent-requests)", "1 waiting (--queue-size)",
                     "request id busy-1"):
            assert says in error["message"]
        assert metric(r, "pdserve_router_errors_total", endpoint="/generate", kind="queue_full") == 1
        assert sent(si) == (2, 2)  # nothing went to an engine for the queued or the refused request
        # a client that leaves while queued leaves the queue (and is never sent)
        queued.cancel()
        await until(lambda: metric(r, "pdserve_router_requests_queued") == 0, what="the queue empty again")
        await until(lambda: metric(r, "pdserve_router_errors_total", kind="client_disconnect") == 1,
                    what="the queued client's departure recorded")
        # the next waiter gets the slot a leaving in-flight client frees, and is served
        nxt = asyncio.create_task(c.post(r.url + "/generate", json=gen()))
        await until(lambda: metric(r, "pdserve_router_requests_queued") == 1, what="the next request queued")
        assert sent(si) == (2, 2)
        held[0].cancel()
        resp = await nxt
        assert resp.status_code == 200, resp.text
        held[1].cancel()
        await asyncio.gather(*held, return_exceptions=True)
    assert sent(si) == (3, 3)
    await until(lambda: metric(r, "pdserve_router_requests_in_flight") == 0, what="router idle")


async def test_a_queued_request_gets_429_when_its_wait_ends(si, routers):
    r = routers("queue_timeout", "--max-concurrent-requests", "1", "--queue-size", "4",
                "--queue-timeout-secs", "0.5")
    for p in si.values():
        p.fault("stall")
    async with httpx.AsyncClient(timeout=60) as c:
        held = asyncio.create_task(c.post(r.url + "/generate", json=gen()))
        await until(lambda: sent(si) == (1, 1), what="the first request at both stand-ins")
        late = await c.post(r.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert late.status_code == 429 and int(late.headers["retry-after"]) >= 1
        assert "no in-flight slot within 0.5 s (--queue-timeout-secs)" in late.json()["error"]["message"]
        assert metric(r, "pdserve_router_errors_total", endpoint="/v1/completions", kind="queue_timeout") == 1
        assert sent(si) == (1, 1)
        held.cancel()
        await asyncio.gather(held, return_exceptions=True)


@pytest.mark.slow
async def test_a_stream_holds_its_slot_until_it_ends(si, routers):
    r = routers("one_slot", "--max-concurrent-requests", "1", "--queue-size", "4", "--queue-timeout-secs", "60")
    si["d0"].control(token_interval=0.02)
    async with httpx.AsyncClient(timeout=60) as c:
        async with c.stream("POST", r.url + "/generate", json=gen(tokens=200, stream=True)) as stream:
            lines = stream.aiter_lines()
            while not (await anext(lines)).startswith("data: {"):
                pass
            other = asyncio.create_task(c.post(r.url + "/generate", json=gen()))
            await until(lambda: metric(r, "pdserve_router_requests_queued") == 1, what="the second request queued")
            assert sent(si) == (1, 1)
            rest = [line async for line in lines]
        assert "data: [DONE]" in rest  # the whole stream; only now may the queued request go
        resp = await other
    assert resp.status_code == 200 and sent(si) == (2, 2)


async def test_the_token_cap_refuses_at_once_and_touches_no_engine(si, routers):
    r = routers("tokens", "--max-total-tokens-per-request", "100")
    over = [
        ("/generate", {"input_ids": [[1] * 45] * 2, "sampling_params": {"max_new_tokens": 6}}, "up to 102 tokens"),
        ("/v1/completions", {"prompt": "é" * 30, "n": 2, "max_tokens": 1}, "up to 122 tokens"),  # 60 bytes each
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 50}], "max_tokens": 51},
         "up to 101 tokens"),
    ]
    for route, body, says in over:
        resp = await call(r, route, body, {"X-Request-Id": "tok-1"})
        assert resp.status_code == 400 and resp.headers["x-request-id"] == "tok-1", resp.text
        error = resp.json()["error"]
        assert says in error["message"] and "limit of 100 (--max-total-tokens-per-request)" in error["message"]
    assert metric(r, "pdserve_router_errors_total", kind="over_limit") == len(over)
    assert sent(si) == (0, 0) and si["p0"].state()["aborts"] == [] and si["d0"].state()["aborts"] == []
    ok = await call(r, "/generate", {"input_ids": [[1] * 45] * 2, "sampling_params": {"max_new_tokens": 5}})
    assert ok.status_code == 200 and sent(si) == (1, 1)


# ---- batched aborts ------------------------------------------------------------------------------------
async def read_one_chunk_then_leave(url: str, body: dict) -> None:
    async with httpx.AsyncClient(timeout=30) as c:
        async with c.stream("POST", url, json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    return


async def test_a_16_sequence_stream_is_aborted_with_one_call_per_side(si, routers):
    r = routers("aborts")
    si["p0"].fault("delay", seconds=WAIT_LONG)  # the prefill's answer stays open until it is aborted
    si["d0"].control(token_interval=0.05)
    await read_one_chunk_then_leave(r.url + "/generate", gen(16, tokens=400, stream=True))
    await until(lambda: si["p0"].state()["live"] == [] and si["d0"].state()["live"] == [], what="both released")
    for name in ("p0", "d0"):
        st = si[name].state()
        (request,) = st["requests"]
        assert request["count"] == 16
        rids = request["rid"]  # a batch: one router id per sequence
        assert st["abort_calls"] == [rids], (name, st["abort_calls"])  # one call, every sequence in it
        assert set(st["aborted"]) == set(rids)


async def test_a_worker_that_takes_one_rid_per_call_gets_one_call_per_rid(si, routers):
    """The pinned SGLang's /abort_request takes one string rid: the router learns it from the first refusal."""
    r = routers("aborts_one_by_one")
    si["d0"].control(token_interval=0.05, abort_lists=False)
    body = gen(3, tokens=400, stream=True)
    for attempt in range(2):
        await read_one_chunk_then_leave(r.url + "/generate", body)
        await until(lambda: si["d0"].state()["live"] == [], what="decode released")
        st = si["d0"].state()
        rids = st["requests"][attempt]["rid"]
        calls = st["abort_calls"][4 * attempt:]  # the first request: a refused list and 3 calls; then 3
        assert sorted(c for c in calls if c) == [[rid] for rid in rids], calls
        assert calls.count([]) == (1 if attempt == 0 else 0), calls  # a list is tried only the first time
        assert set(st["aborted"]) >= set(rids)


async def test_n16_stream_disconnect_frees_every_kv_page_of_the_reference_engines(engines, tmp_path):
    """Real engines: n = 16, one chunk read, client gone -> all 32 sequences aborted, no KV page held."""
    pre, dec = engines["prefill"], engines["decode"]
    r = pd_router(pre.url, pre.bootstrap_port, dec.url, str(tmp_path))
    try:
        r.wait_ready()
        before = {s: await async_metric(engines[s], "sglang:num_aborted_requests_total") for s in ("prefill", "decode")}
        body = {"text": "abort me sixteen times", "stream": True,
                "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True, "n": 16}}
        await read_one_chunk_then_leave(r.url + "/generate", body)

        async def released() -> bool:
            return all([await async_metric(engines[s], "pdserve_kv_pages_held") == 0
                        and await async_metric(engines[s], "sglang:num_used_tokens") == 0
                        and await async_metric(engines[s], "sglang:num_running_reqs") == 0
                        for s in ("prefill", "decode")])

        await async_wait_until(released, PROMPT, interval=0.1, what="no KV page held on either engine", retry=())
        aborted = await async_metric(dec, "sglang:num_aborted_requests_total") - before["decode"]
        assert aborted == 16  # every decode sequence aborted, none ran to its 1500 tokens
    finally:
        r.stop()
