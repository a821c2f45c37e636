"""The PD router end to end: real reference engines (null, prefill, decode) and the router as a
real subprocess (`python -m pd.cli router ...`). Outputs through the router equal the null engine's."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import AT_ONCE
from engines import ROOT, async_metric, free_port, metric
from pd.router.app import GENERATION_ROUTES
from pd.util.wait import async_wait_until
from pdclient import add_rooms, parse_sse, stream_then_disconnect, strip_volatile
from pdclient import final_generate_chunks as final_chunks
from routers import pd_router

GREEDY = {"temperature": 0}
# s: a failure reaches the client, and both engines are idle again, within this of the request; under the
# engines' PD timeouts (conftest.PD_TIMEOUT), which a router that forgot an abort or waited for the other side
# would take
PROMPTLY = AT_ONCE
PREFILL_HITS = ("sglang:per_stage_req_latency_seconds_count", {"stage": "prefill_forward"})


@pytest.fixture(scope="module")
def routers(engines, tmp_path_factory):
    """``good``: routes to the real prefill + decode; ``dead``: its decode URL has nobody listening;
    ``dead_prefill``: its prefill (HTTP and bootstrap port) has nobody listening."""
    logs = str(tmp_path_factory.mktemp("router-logs"))
    pre, dec = engines["prefill"], engines["decode"]
    nobody = f"http://127.0.0.1:{free_port()}"
    started = {}
    try:
        started["good"] = pd_router(pre.url, pre.bootstrap_port, dec.url, logs)
        started["dead"] = pd_router(pre.url, pre.bootstrap_port, nobody, logs)
        started["dead_prefill"] = pd_router(nobody, free_port(), dec.url, logs)
        for r in started.values():
            r.wait_ready()
        yield started
    finally:
        for r in started.values():
            r.stop()


@pytest.fixture
def router(routers):
    return routers["good"]


# ---- helpers ---------------------------------------------------------------------------------
async def post(url: str, route: str, body: dict) -> httpx.Response:
    async with httpx.AsyncClient(timeout=60) as c:
        return await c.post(url + route, json=body)


async def null_answer(engines, route: str, body: dict):
    r = await post(engines["null"].url, route, body)
    assert r.status_code == 200, r.text
    return parse_sse(r.content) if body.get("stream") else r.json()


async def routed_answer(router, route: str, body: dict):
    r = await post(router.url, route, body)
    assert r.status_code == 200, r.text
    return parse_sse(r.content) if body.get("stream") else r.json()


def router_metrics(router) -> dict:
    out = {}
    for fam in text_string_to_metric_families(httpx.get(router.url + "/metrics", timeout=10).text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def prefill_hits(engines) -> float:
    name, labels = PREFILL_HITS
    return metric(engines["prefill"], name, **labels)


async def assert_decode_idle(engines, timeout: float = PROMPTLY):
    """Wait until neither PD engine holds KV pages, running or bootstrapping requests; fails with
    what they held after ``timeout`` s (one check when ``timeout`` <= 0)."""
    held: dict = {}

    def idle() -> bool:
        held.update({s: (metric(engines[s], "pdserve_kv_pages_held"), metric(engines[s], "sglang:num_running_reqs"),
                         metric(engines[s], "sglang:num_prefill_bootstrap_queue_reqs"))
                     for s in ("prefill", "decode")})
        return all(v == (0, 0, 0) for v in held.values())

    try:
        await async_wait_until(idle, timeout, interval=0.1, what="both PD engines idle", retry=())
    except TimeoutError as e:
        raise AssertionError(f"{e}: {held}") from e


# ---- outputs equal the null engine's ---------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
async def test_generate_single_with_logprobs(engines, router, stream):
    body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 16, **GREEDY},
            "stream": stream, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2,
            "bootstrap_room": 5, "bootstrap_host": "10.9.9.9"}  # client rooms must be replaced
    ref = await null_answer(engines, "/generate", body)
    before = prefill_hits(engines)
    got = await routed_answer(router, "/generate", body)
    assert prefill_hits(engines) - before == 1
    if stream:
        ref, got = final_chunks(ref)[0], final_chunks(got)[0]
    assert strip_volatile(got) == strip_volatile(ref)
    meta = got["meta_info"]
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"] == len(body["text"].encode())
    assert len(meta["input_top_logprobs"]) == meta["prompt_tokens"]
    assert len(got["output_ids"]) == 16 == len(meta["output_token_logprobs"]) == meta["completion_tokens"]


@pytest.mark.parametrize("stream", [False, True])
async def test_generate_batch_of_8(engines, router, stream):
    texts = [f"prompt number {i} says" + "!" * i for i in range(8)]
    body = {"text": texts, "sampling_params": {"max_new_tokens": 8, **GREEDY}, "stream": stream,
            "return_logprob": True, "logprob_start_len": 0}
    ref = await null_answer(engines, "/generate", body)
    before = prefill_hits(engines)
    got = await routed_answer(router, "/generate", body)
    assert prefill_hits(engines) - before == 8
    if stream:
        # every streamed chunk already carries the prefill's prompt logprobs
        assert all(len(c["meta_info"]["input_token_logprobs"]) == len(texts[c["index"]].encode())
                   for c in got[:-1])
        ref, got = final_chunks(ref), final_chunks(got)
    assert len(got) == 8
    assert strip_volatile(got) == strip_volatile(ref)
    assert [len(g["meta_info"]["input_token_logprobs"]) for g in got] == [len(t.encode()) for t in texts]


async def test_generate_input_ids_batch_with_n(engines, router):
    # 2 prompts x n=2 sampled with a seed: 4 sequences, each its own room
    body = {"input_ids": [[5, 17, 99, 120], [33, 34, 35]],
            "sampling_params": {"max_new_tokens": 6, "temperature": 0.8, "sampling_seed": 11, "n": 2}}
    ref = await null_answer(engines, "/generate", body)
    before = prefill_hits(engines)
    got = await routed_answer(router, "/generate", body)
    assert prefill_hits(engines) - before == 4
    assert [g["output_ids"] for g in got] == [r["output_ids"] for r in ref]


@pytest.mark.parametrize("stream", [False, True])
async def test_completions_list_prompt(engines, router, stream):
    body = {"model": "builtin:tiny", "prompt": ["Once upon a time", "In a galaxy far", "def main():"],
            "max_tokens": 8, "temperature": 0, "stream": stream, "logprobs": 2}
    ref = await null_answer(engines, "/v1/completions", body)
    before = prefill_hits(engines)
    got = await routed_answer(router, "/v1/completions", body)
    assert prefill_hits(engines) - before == 3
    if stream:
        def texts(chunks):
            out = {}
            for c in chunks[:-1]:
                for ch in c["choices"]:
                    out[ch["index"]] = out.get(ch["index"], "") + ch["text"]
            return out
        assert texts(got) == texts(ref) and sorted(texts(got)) == [0, 1, 2]
    else:
        assert strip_volatile(got["choices"]) == strip_volatile(ref["choices"])
        assert got["usage"] == ref["usage"]


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_n3_openai_client(engines, router, stream):
    kwargs = dict(model="builtin:tiny", messages=[{"role": "user", "content": "Tell me a story"}],
                  n=3, max_tokens=12, temperature=0.9, seed=1234)
    ref = await null_answer(engines, "/v1/chat/completions", dict(kwargs, stream=False))
    ref_texts = [c["message"]["content"] for c in ref["choices"]]
    client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)
    before = prefill_hits(engines)
    try:
        if stream:
            texts = ["", "", ""]
            async for chunk in await client.chat.completions.create(stream=True, **kwargs):
                for ch in chunk.choices:
                    texts[ch.index] += ch.delta.content or ""
        else:
            resp = await client.chat.completions.create(**kwargs)
            texts = [c.message.content for c in sorted(resp.choices, key=lambda c: c.index)]
    finally:
        await client.close()
    assert prefill_hits(engines) - before == 3
    assert texts == ref_texts and len(set(texts)) > 1


# Every generation route the router exposes, with a body of 2 sequences: a route added without
# an entry here fails test_every_generation_route_runs_pd.
ROUTE_BODIES = {
    "/generate": ({"text": ["route check a", "route check b"], "sampling_params": {"max_new_tokens": 3, **GREEDY}}, 2),
    "/v1/completions": ({"model": "builtin:tiny", "prompt": "route check", "n": 2, "max_tokens": 3,
                         "temperature": 0.5, "seed": 3}, 2),
    "/v1/chat/completions": ({"model": "builtin:tiny", "messages": [{"role": "user", "content": "route check"}],
                              "n": 2, "max_tokens": 3, "temperature": 0.5, "seed": 3}, 2),
}


@pytest.mark.parametrize("stream", [False, True])
async def test_every_generation_route_runs_pd(engines, router, stream):
    assert set(ROUTE_BODIES) == set(GENERATION_ROUTES)
    for route, (body, seqs) in ROUTE_BODIES.items():
        before = prefill_hits(engines)
        await routed_answer(router, route, dict(body, stream=stream))
        assert prefill_hits(engines) - before == seqs, route  # no route silently runs decode-only


@pytest.mark.parametrize("kind", ["text", "input_ids"])
async def test_generate_batch_of_33_in_input_order(engines, router, kind):
    prompts = [f"item {i} " + "x" * i for i in range(33)]
    body = {kind: prompts if kind == "text" else [list(p.encode()) for p in prompts],
            "sampling_params": {"max_new_tokens": 3, **GREEDY}}
    ref = await null_answer(engines, "/generate", body)
    before = prefill_hits(engines)
    got = await routed_answer(router, "/generate", body)
    assert prefill_hits(engines) - before == 33
    assert [g["meta_info"]["prompt_tokens"] for g in got] == [len(p.encode()) for p in prompts]
    assert [g["output_ids"] for g in got] == [r["output_ids"] for r in ref]


@pytest.mark.parametrize("stream", [False, True])
async def test_completions_list_prompt_with_n(engines, router, stream):
    body = {"model": "builtin:tiny", "prompt": ["Once upon a time", "def main():"], "n": 3, "max_tokens": 6,
            "temperature": 0.9, "seed": 77, "stream": stream}
    ref = await null_answer(engines, "/v1/completions", dict(body, stream=False))
    before = prefill_hits(engines)
    got = await routed_answer(router, "/v1/completions", body)
    assert prefill_hits(engines) - before == 6
    ref_texts = {c["index"]: c["text"] for c in ref["choices"]}
    if stream:
        texts: dict = {}
        for c in got[:-1]:
            for ch in c["choices"]:
                texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
        assert got[-1] == "[DONE]"
    else:
        texts = {c["index"]: c["text"] for c in got["choices"]}
    assert sorted(texts) == list(range(6)) and texts == ref_texts
    assert len(set(texts.values())) > 1  # samples differ: each had its own room and seed


@pytest.mark.parametrize("stream", [False, True])
async def test_openai_logprob_lengths(engines, router, stream):
    body = {"model": "builtin:tiny", "messages": [{"role": "user", "content": "count"}], "n": 2, "max_tokens": 7,
            "temperature": 0, "logprobs": True, "top_logprobs": 2, "stream": stream,
            "stream_options": {"include_usage": True} if stream else None}
    got = await routed_answer(router, "/v1/chat/completions", body)
    if stream:
        n_lp: dict = {}
        for c in got[:-1]:
            for ch in c["choices"]:
                n_lp[ch["index"]] = n_lp.get(ch["index"], 0) + len((ch.get("logprobs") or {}).get("content") or [])
        usage = next(c["usage"] for c in got[:-1] if c.get("usage"))
        assert got[-1] == "[DONE]"
    else:
        n_lp = {c["index"]: len(c["logprobs"]["content"]) for c in got["choices"]}
        usage = got["usage"]
    assert sorted(n_lp) == [0, 1] and all(v >= 1 for v in n_lp.values())
    assert sum(n_lp.values()) == usage["completion_tokens"]


async def test_long_streams_arrive_whole(engines, router):
    body = {"text": "long", "stream": True, "sampling_params": {"max_new_tokens": 500, "ignore_eos": True, **GREEDY}}
    got = await routed_answer(router, "/generate", body)
    assert got[-1] == "[DONE]" and "[DONE]" not in got[:-1]
    final = final_chunks(got)[0]
    assert len(final["output_ids"]) == final["meta_info"]["completion_tokens"] == 500
    assert final["meta_info"]["finish_reason"]["type"] == "length"
    body = {"model": "builtin:tiny", "prompt": "long", "max_tokens": 500, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    got = await routed_answer(router, "/v1/completions", body)
    assert got[-1] == "[DONE]" and got[-2]["usage"]["completion_tokens"] == 500
    assert sum(1 for c in got[:-1] for ch in c["choices"] if ch["finish_reason"] == "length") == 1


SHORT_CASES = {
    "max_tokens_1": {"max_tokens": 1},
    "min_tokens_small_max": {"max_tokens": 4, "min_tokens": 3},
    "stop_string": {"max_tokens": 24},  # the stop string is taken from the unconstrained output below
}


@pytest.mark.parametrize("case", sorted(SHORT_CASES))
@pytest.mark.parametrize("stream", [False, True])
async def test_short_and_stopped_generations_equal_null(engines, router, case, stream):
    body = {"model": "builtin:tiny", "prompt": "The weather today", "temperature": 0, "stream": stream,
            **SHORT_CASES[case]}
    if case == "stop_string":  # a stop string that does occur: two characters from the middle of the output
        free = (await null_answer(engines, "/v1/completions", dict(body, stream=False)))["choices"][0]["text"]
        assert len(free) > 8, free
        body["stop"] = [free[6:8]]
    ref = await null_answer(engines, "/v1/completions", dict(body, stream=False))
    got = await routed_answer(router, "/v1/completions", body)
    if stream:
        assert got[-1] == "[DONE]"
        text = "".join(ch["text"] for c in got[:-1] for ch in c["choices"])
        finish = [ch["finish_reason"] for c in got[:-1] for ch in c["choices"] if ch["finish_reason"]]
    else:
        text, finish = got["choices"][0]["text"], [got["choices"][0]["finish_reason"]]
    assert text == ref["choices"][0]["text"] and finish == [ref["choices"][0]["finish_reason"]]
    if not stream:
        assert got["usage"] == ref["usage"]
        if case == "max_tokens_1":
            assert got["usage"]["completion_tokens"] == 1
        if case == "min_tokens_small_max":
            assert 3 <= got["usage"]["completion_tokens"] <= 4
    if case == "stop_string":
        assert finish == ["stop"] and body["stop"][0] not in text


async def test_concurrent_streams_abort_no_room(engines, router):
    # 40 at once fit the test engines' PD timeouts on 2 CPU cores; 200 at once run against
    # stand-in engines in test_router_faults.py.
    aborted = {s: metric(engines[s], "pdserve_engine_aborted_requests_total") for s in ("prefill", "decode")}
    body = {"text": "many at once", "stream": True,
            "sampling_params": {"max_new_tokens": 3, "ignore_eos": True, **GREEDY}}
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=40)) as c:
        rs = await asyncio.gather(*(c.post(router.url + "/generate", json=body) for _ in range(40)))
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs if r.status_code != 200][:1]
    finals = [final_chunks(parse_sse(r.content))[0] for r in rs]
    assert all(len(f["output_ids"]) == 3 for f in finals)
    assert {s: metric(engines[s], "pdserve_engine_aborted_requests_total") for s in ("prefill", "decode")} == aborted
    await assert_decode_idle(engines)


async def test_concurrent_requests_round_trip(engines, router):
    body = {"text": "queue me", "sampling_params": {"max_new_tokens": 4, **GREEDY}}
    results = await asyncio.gather(*(routed_answer(router, "/generate", body) for _ in range(12)))
    assert len({tuple(r["output_ids"]) for r in results}) == 1
    await assert_decode_idle(engines)


# ---- failures ----------------------------------------------------------------------------------
async def test_prefill_error_is_returned_promptly_and_decode_holds_nothing(engines, router):
    body = {"text": "x" * 3000, "sampling_params": {"max_new_tokens": 4}}
    t0 = time.monotonic()
    r = await post(router.url, "/generate", body)
    assert time.monotonic() - t0 < PROMPTLY
    assert r.status_code == 400, r.text
    assert "maximum context length" in r.json()["error"]["message"]
    await assert_decode_idle(engines, timeout=t0 + PROMPTLY - time.monotonic())  # not the decode's PD timeout


async def test_malformed_json_and_unknown_route(router):
    async with httpx.AsyncClient(timeout=10) as c:
        r = await c.post(router.url + "/generate", content=b'{"text": "oops"',
                         headers={"content-type": "application/json"})
        assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
        r = await c.post(router.url + "/v1/completions", json=["not", "an", "object"])
        assert r.status_code == 400
        r = await c.post(router.url + "/nope", json={})
        assert r.status_code == 404 and r.json()["error"]["code"] == 404


async def test_dead_decode_gives_502_promptly_and_prefill_is_released(engines, routers):
    dead = routers["dead"]
    t0 = time.monotonic()
    r = await post(dead.url, "/generate", {"text": "anyone there", "sampling_params": {"max_new_tokens": 4}})
    assert time.monotonic() - t0 < PROMPTLY
    assert r.status_code == 502, r.text
    err = r.json()["error"]
    assert "decode worker http://127.0.0.1:" in err["message"] and err["code"] == 502
    assert set(err) == {"message", "type", "param", "code"}
    # the router aborted the prefill's request: it does not wait out its bootstrap timeout
    await assert_decode_idle(engines, timeout=t0 + PROMPTLY - time.monotonic())
    async with httpx.AsyncClient(timeout=60) as c:
        assert (await c.get(dead.url + "/health_generate")).status_code == 503
        r = await c.get(routers["good"].url + "/health_generate")
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("stream", [False, True])
async def test_dead_prefill_gives_502_promptly_and_decode_is_released(engines, routers, stream):
    t0 = time.monotonic()
    r = await post(routers["dead_prefill"].url, "/generate",
                   {"text": "anyone there", "stream": stream, "sampling_params": {"max_new_tokens": 4}})
    assert time.monotonic() - t0 < PROMPTLY
    assert r.status_code == 502, r.text
    assert "prefill worker http://127.0.0.1:" in r.json()["error"]["message"]
    await assert_decode_idle(engines, timeout=t0 + PROMPTLY - time.monotonic())  # not its waiting timeout


async def test_client_disconnect_mid_stream_aborts_decode(engines, router):
    body = {"text": "stream forever", "stream": True,
            "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True, "temperature": 0}}
    aborted = metric(engines["decode"], "pdserve_engine_aborted_requests_total")
    async with httpx.AsyncClient(timeout=30) as c:
        await stream_then_disconnect(c, router.url + "/generate", body)
    await assert_decode_idle(engines)
    assert metric(engines["decode"], "pdserve_engine_aborted_requests_total") == aborted + 1


# ---- info routes and metrics -------------------------------------------------------------------
async def test_info_routes_are_proxied(router):
    async with httpx.AsyncClient(timeout=10) as c:
        models = (await c.get(router.url + "/v1/models")).json()
        assert models["data"][0]["id"] == "builtin:tiny"
        assert (await c.get(router.url + "/get_model_info")).json()["disaggregation_mode"] == "decode"
        assert (await c.get(router.url + "/get_server_info")).json()["disaggregation_mode"] == "decode"


async def test_metrics_after_traffic(engines, router):
    await routed_answer(router, "/generate",
                        {"text": "hello", "stream": True, "sampling_params": {"max_new_tokens": 4}})
    async with httpx.AsyncClient(timeout=10) as c:
        await c.post(router.url + "/generate", content=b"{", headers={"content-type": "application/json"})
    m = router_metrics(router)
    ep = (("endpoint", "/generate"),)
    for name in ("pdserve_router_queue_seconds", "pdserve_router_prefill_seconds", "pdserve_router_ttft_seconds",
                 "pdserve_router_inter_token_seconds", "pdserve_router_e2e_seconds"):
        assert m[(name + "_count", ep)] > 0, name
        assert (name + "_bucket", tuple(sorted({"endpoint": "/generate", "le": "+Inf"}.items()))) in m
    assert m[("pdserve_router_requests_total", (("endpoint", "/generate"), ("status", "200")))] > 0
    assert m[("pdserve_router_errors_total", (("endpoint", "/generate"), ("kind", "invalid_request")))] >= 1
    worker = (("role", "decode"), ("worker", engines["decode"].url))
    assert m[("pdserve_router_worker_inflight", worker)] == 0
    assert m[("pdserve_router_worker_healthy", worker)] == 1
    # every router log line a human waits for
    assert f"pdserve router ready at http://127.0.0.1:{router.port}" in router.log()


def test_cli_rejects_missing_workers():
    r = subprocess.run([sys.executable, "-m", "pd.cli", "router", "--port", "1"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "--prefill" in r.stderr


@pytest.mark.slow
async def test_flush_cache_reaches_every_worker(routers, engines):
    """sglang.bench_serving's --flush-cache: POST /flush_cache through the router flushes both engines (and the
    engine refuses while requests run, as SGLang does); a worker that cannot be reached makes it a 502 naming
    that worker; a bad timeout is a 400."""
    async with httpx.AsyncClient(timeout=60) as c:
        ok = await c.post(routers["good"].url + "/flush_cache", params={"timeout": 5})
        assert ok.status_code == 200 and "on 2 workers" in ok.text, ok.text
        dead = await c.post(routers["dead"].url + "/flush_cache")
        assert dead.status_code == 502, dead.text
        by_role = {w["role"]: w for w in dead.json()["workers"]}
        assert by_role["prefill"]["status"] == 200 and by_role["decode"]["status"] is None
        bad = await c.post(routers["good"].url + "/flush_cache", params={"timeout": "soon"})
        assert bad.status_code == 400 and "timeout" in bad.json()["error"]["message"]
        # the engine itself: busy while a decode waits for KV that never comes, idle again after its timeout
        body = add_rooms({"text": "wait", "sampling_params": {"max_new_tokens": 2}}, "127.0.0.1",
                         engines["prefill"].bootstrap_port, None)
        waiting = asyncio.create_task(c.post(engines["decode"].url + "/generate", json=body))
        await async_wait_until(lambda: async_metric(engines["decode"], "sglang:num_decode_transfer_queue_reqs"),
                               30, interval=0.05, what="the decode waiting for its KV")
        busy = await c.post(engines["decode"].url + "/flush_cache")
        assert busy.status_code == 400 and "running" in busy.text, busy.text
        await waiting
        assert (await c.get(engines["decode"].url + "/flush_cache", params={"timeout": 30})).status_code == 200
        assert (await c.post(engines["null"].url + "/flush_cache", params={"timeout": -1})).status_code == 400
