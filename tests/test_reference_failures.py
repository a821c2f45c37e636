"""Failure semantics of the reference engine: bad input, aborts, timeouts, dead peers.

Every case ends with nothing held: no KV pages, no running request, and the engine still serves.
"""

import asyncio
import random
import subprocess
import sys
import time
import uuid

import httpx
import pytest

from conftest import AT_ONCE, PD_TIMEOUT
from engines import async_metric, free_port, metric
from pd.util.wait import async_wait_until
from pdclient import add_rooms, pd_post, stream_then_disconnect

GOOD = {"text": "still alive", "sampling_params": {"max_new_tokens": 3, "temperature": 0}}


def assert_error(r: httpx.Response, status: int, *words: str):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status
    for w in words:
        assert w in err["message"], err["message"]
    return err


async def assert_idle(engines):
    """Nothing held anywhere and a normal PD request still works."""
    async def idle() -> bool:
        for s in ("prefill", "decode"):
            for name in ("pdserve_kv_pages_held", "sglang:num_running_reqs", "sglang:num_queue_reqs"):
                if await async_metric(engines[s], name) != 0:
                    return False
        return True

    try:
        await async_wait_until(idle, 30, interval=0.1, what="both engines idle")
    except TimeoutError:
        pass  # the assertions below say what is still held
    for side in ("prefill", "decode"):
        assert metric(engines[side], "pdserve_kv_pages_held") == 0, side
        assert metric(engines[side], "sglang:num_running_reqs") == 0, side
    async with httpx.AsyncClient(timeout=30) as c:
        status, dec, _ = await pd_post(c, engines["prefill"], engines["decode"], "/generate", GOOD, None)
    assert status == 200 and len(dec["output_ids"]) == 3


async def wait_metric(engine, name: str, at_least: float, what: str) -> None:
    """Poll the engine's /metrics until ``name`` (summed) is at least ``at_least``."""
    async def reached() -> bool:
        return await async_metric(engine, name) >= at_least

    await async_wait_until(reached, 30, interval=0.05, what=what)


async def waiting_for_kv(engines, n: int = 1) -> None:
    """The decode holds pages for ``n`` requests and waits on the prefill's bootstrap server for their KV."""
    await wait_metric(engines["decode"], "sglang:num_decode_transfer_queue_reqs", n,
                      f"{n} decode request(s) waiting for KV")


async def waiting_for_decode(engines) -> None:
    """The prefill holds a request that waits for its decode to register."""
    await wait_metric(engines["prefill"], "sglang:num_prefill_bootstrap_queue_reqs", 1,
                      "a prefill waiting for its decode")


# ---- bad input --------------------------------------------------------------------------------
@pytest.mark.parametrize("side", ["null", "decode", "prefill"])
async def test_bad_inputs_get_4xx_and_hold_nothing(engines, side):
    e = engines[side]
    pd_fields = ({} if side == "null"
                 else {"bootstrap_host": "127.0.0.1", "bootstrap_port": engines["prefill"].bootstrap_port})
    async with httpx.AsyncClient(timeout=30, base_url=e.url) as c:
        r = await c.post("/generate", content=b'{"text": "oops"', headers={"content-type": "application/json"})
        assert_error(r, 400, "malformed JSON")
        r = await c.post("/v1/completions", json={"model": "gpt-17", "prompt": "hi"})
        assert_error(r, 404, "gpt-17")
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 0, **pd_fields, "bootstrap_room": 1})
        assert assert_error(r, 400, "max_tokens")["param"] == "max_tokens"
        r = await c.post("/v1/chat/completions",
                         json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3})
        assert_error(r, 400, "max_tokens")
        r = await c.post("/generate", json={"text": "x" * 3000, "sampling_params": {"max_new_tokens": 4},
                                            **pd_fields, "bootstrap_room": 2})
        assert_error(r, 400, "maximum context length")
        r = await c.post("/generate", json={"text": "hi", "sampling_params": {"temperature": -1}, **pd_fields,
                                            "bootstrap_room": 3})
        assert_error(r, 400, "temperature")
        # SGLang refuses a sampling_params key it does not know (a misspelt max_new_tokens is not the default)
        r = await c.post("/generate", json={"text": "hi", "sampling_params": {"max_new_token": 2}, **pd_fields,
                                            "bootstrap_room": 4})
        assert assert_error(r, 400, "unknown field `max_new_token`", "max_new_tokens")["param"] == "sampling_params"
        r = await c.post("/generate", json={"text": ["a", "b"], "sampling_params": [{}, {"tempreature": 0}],
                                            **pd_fields, "bootstrap_room": [5, 6]})
        assert_error(r, 400, "unknown field `tempreature`")
        # SGLang's constrained decoding is refused, not silently ignored; a null value is no request for it
        r = await c.post("/generate", json={"text": "hi", "sampling_params": {"json_schema": "{}"}, **pd_fields,
                                            "bootstrap_room": 11})
        assert assert_error(r, 400, "`json_schema` is not supported")["param"] == "sampling_params.json_schema"
        if side == "null":  # (a PD side would wait for its peer)
            r = await c.post("/generate", json={"text": "hi", "sampling_params": {"regex": None, "max_new_tokens": 1}})
            assert r.status_code == 200, r.text
        # JSON types as SGLang's /generate contract checks them
        r = await c.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": "5"}, **pd_fields,
                                            "bootstrap_room": 9})
        err = assert_error(r, 400, "sampling_params.max_new_tokens: Input should be a valid integer, got '5'")
        assert err["param"] == "sampling_params.max_new_tokens"
        r = await c.post("/generate", json={"text": "hi", "stream": "yes", **pd_fields, "bootstrap_room": 10})
        assert assert_error(r, 400, "valid boolean")["param"] == "stream"
        for n in ("x", 2.5, [2]):
            r = await c.post("/generate", json={"text": "hi", "sampling_params": {"n": n}, **pd_fields,
                                                "bootstrap_room": 7})
            assert assert_error(r, 400, "n must be an integer")["param"] == "n"
        r = await c.post("/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "hi"}], **pd_fields,
                                                        "bootstrap_room": 8})
        err = assert_error(r, 400, "role must be one of user, system, assistant", "got 'wizard'")
        assert err["param"] == "messages.0.role" and "Value error" not in err["message"]
        r = await c.post("/v1/completions", json={"prompt": "hi", "n": "three"})
        assert_error(r, 400, "n")
        r = await c.post("/nope", json={})
        assert r.status_code == 404
        if side != "null":
            r = await c.post("/generate", json={"text": "hi"})
            assert_error(r, 400, "bootstrap room")
            r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
            assert_error(r, 400, "bootstrap room")
    await assert_idle(engines)


async def test_oversize_body_gets_413(engines):
    async with httpx.AsyncClient(timeout=60) as c:
        r = await c.post(engines["null"].url + "/generate", json={"text": "a" * (33 * 1024 * 1024)})
    assert_error(r, 413, "exceeds")


async def test_room_already_active_is_rejected(engines):
    dec = engines["decode"]
    room = random.randrange(2**63)
    body = {"text": "hold this room", "bootstrap_host": "127.0.0.1",
            "bootstrap_port": engines["prefill"].bootstrap_port, "bootstrap_room": room,
            "rid": "holder-" + uuid.uuid4().hex}
    async with httpx.AsyncClient(timeout=30, base_url=dec.url) as c:
        first = asyncio.create_task(c.post("/generate", json=body))
        await waiting_for_kv(engines)  # the first request now waits for KV that never comes
        r = await c.post("/generate", json=dict(body, rid="second"))
        assert_error(r, 409, str(room), "already active")
        # Same room twice inside one batch is refused too.
        r = await c.post("/generate", json=dict(body, text=["a", "b"], bootstrap_room=[5, 5], rid=None,
                                                bootstrap_host=["127.0.0.1"] * 2, bootstrap_port=[1, 1]))
        assert_error(r, 400, "own room")
        await c.post("/abort_request", json={"rid": body["rid"]})
        r1 = await first
    assert r1.status_code == 200 and r1.json()["meta_info"]["finish_reason"]["type"] == "abort"
    await assert_idle(engines)


# ---- timeouts ---------------------------------------------------------------------------------
@pytest.mark.slow
async def test_decode_times_out_without_prefill(engines):
    body = add_rooms({"text": "lonely decode", "sampling_params": {"max_new_tokens": 4}}, "127.0.0.1",
                     engines["prefill"].bootstrap_port, None)
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(engines["decode"].url + "/generate", json=body)
    elapsed = time.monotonic() - t0
    assert_error(r, 500, str(body["bootstrap_room"]))
    # the session's waiting timeout (it cannot fire early), not the default 300 s; generous for a loaded machine
    assert float(PD_TIMEOUT) - 0.5 <= elapsed < 60, elapsed
    await assert_idle(engines)


@pytest.mark.slow
async def test_prefill_times_out_without_decode(engines):
    body = add_rooms({"text": "lonely prefill", "sampling_params": {"max_new_tokens": 4}}, "127.0.0.1",
                     engines["prefill"].bootstrap_port, None)
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(engines["prefill"].url + "/generate", json=body)
    elapsed = time.monotonic() - t0
    assert_error(r, 500, "bootstrap timeout")
    assert float(PD_TIMEOUT) - 0.5 <= elapsed < 60, elapsed  # the session's bootstrap timeout, not the default 300 s
    await assert_idle(engines)


# ---- aborts -----------------------------------------------------------------------------------
async def test_abort_on_decode_fails_prefill_fast(engines):
    rid = "dec-abort-" + uuid.uuid4().hex
    body = add_rooms({"text": "abort me on decode", "rid": rid, "sampling_params": {"max_new_tokens": 4}},
                     "127.0.0.1", engines["prefill"].bootstrap_port, None)
    async with httpx.AsyncClient(timeout=30) as c:
        waiting = asyncio.create_task(c.post(engines["decode"].url + "/generate", json=body))
        await waiting_for_kv(engines)  # registered with the prefill: the abort must reach it
        assert (await c.post(engines["decode"].url + "/abort_request", json={"rid": rid})).status_code == 200
        r = await waiting
        assert r.status_code == 200
        assert r.json()["meta_info"]["finish_reason"] == {"type": "abort", "message": "Aborted", "status_code": None}
        # The prefill learns of it: its request for the room fails at once, not after its bootstrap timeout
        # (the message below says which; the bound leaves a loaded machine room).
        t0 = time.monotonic()
        r = await c.post(engines["prefill"].url + "/generate", json=body)
        assert time.monotonic() - t0 < AT_ONCE
    assert_error(r, 500, "aborted by the decode")
    await assert_idle(engines)


async def test_abort_on_prefill_fails_decode_fast(engines):
    rid = "pre-abort-" + uuid.uuid4().hex
    body = add_rooms({"text": "abort me on prefill", "rid": rid, "sampling_params": {"max_new_tokens": 4}},
                     "127.0.0.1", engines["prefill"].bootstrap_port, None)
    async with httpx.AsyncClient(timeout=30) as c:
        waiting = asyncio.create_task(c.post(engines["prefill"].url + "/generate", json=body))
        await waiting_for_decode(engines)
        await c.post(engines["prefill"].url + "/abort_request", json={"rid": rid})
        r = await waiting
        assert r.json()["meta_info"]["finish_reason"]["type"] == "abort"
        t0 = time.monotonic()
        r = await c.post(engines["decode"].url + "/generate", json=body)
        assert time.monotonic() - t0 < AT_ONCE  # not after the waiting timeout
    assert_error(r, 500, "aborted by the prefill")
    await assert_idle(engines)


async def test_client_disconnect_mid_stream_releases_both_sides(engines):
    body = add_rooms({"text": "stream forever", "stream": True,
                      "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True, "temperature": 0}},
                     "127.0.0.1", engines["prefill"].bootstrap_port, None)
    async with httpx.AsyncClient(timeout=30) as c:
        pre = asyncio.create_task(c.post(engines["prefill"].url + "/generate", json=body))
        await stream_then_disconnect(c, engines["decode"].url + "/generate", body)
        assert (await pre).status_code == 200
    assert metric(engines["decode"], "pdserve_engine_aborted_requests_total") >= 1
    await assert_idle(engines)


async def test_dead_prefill_fails_decode_fast_and_decode_stays_healthy(engines):
    body = add_rooms({"text": "nobody home", "sampling_params": {"max_new_tokens": 4}}, "127.0.0.1", free_port(), None)
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(engines["decode"].url + "/generate", json=body)
        assert time.monotonic() - t0 < AT_ONCE  # a refused connection, not the waiting timeout
        assert_error(r, 500, "unreachable")
        assert (await c.get(engines["decode"].url + "/health_generate")).status_code == 200
    await assert_idle(engines)


async def test_stream_error_before_first_token_is_plain_http_error(engines):
    body = add_rooms({"text": "nobody home", "stream": True, "sampling_params": {"max_new_tokens": 4}},
                     "127.0.0.1", free_port(), None)
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(engines["decode"].url + "/generate", json=body)
    assert_error(r, 500, "unreachable")


async def test_abort_all(engines):
    async with httpx.AsyncClient(timeout=30) as c:
        bodies = [add_rooms({"text": f"w{i}", "sampling_params": {"max_new_tokens": 4}}, "127.0.0.1",
                            engines["prefill"].bootstrap_port, None) for i in range(3)]
        tasks = [asyncio.create_task(c.post(engines["decode"].url + "/generate", json=b)) for b in bodies]
        await waiting_for_kv(engines, 3)
        await c.post(engines["decode"].url + "/abort_request", json={"abort_all": True})
        results = await asyncio.gather(*tasks)
    assert all(r.json()["meta_info"]["finish_reason"]["type"] == "abort" for r in results)
    await assert_idle(engines)


@pytest.mark.slow
async def test_abort_names_one_exact_id_and_abort_all_is_a_boolean(engines):
    """An id names one sequence: aborting "p" aborts the request "p" only, not "pdr-..." or "p_0" (SGLang's
    prefix match would take all three); those two end at their waiting timeout instead. abort_all "false"
    (a string, truthy) is a 400 that aborts nothing."""
    rids = ["p", "pdr-" + uuid.uuid4().hex, "p_0"]
    url = engines["decode"].url
    async with httpx.AsyncClient(timeout=30) as c:
        bodies = [add_rooms({"text": f"w{i}", "rid": rid, "sampling_params": {"max_new_tokens": 4}}, "127.0.0.1",
                            engines["prefill"].bootstrap_port, None) for i, rid in enumerate(rids)]
        tasks = [asyncio.create_task(c.post(url + "/generate", json=b)) for b in bodies]
        await waiting_for_kv(engines, 3)
        assert_error(await c.post(url + "/abort_request", json={"abort_all": "false"}), 400, "abort_all")
        assert (await c.post(url + "/abort_request", json={"rid": "p"})).status_code == 200
        aborted, *others = await asyncio.gather(*tasks)
    assert aborted.json()["meta_info"]["finish_reason"]["type"] == "abort", aborted.text
    for r, body in zip(others, bodies[1:]):
        assert_error(r, 500, str(body["bootstrap_room"]))  # the waiting timeout, not an abort
    await assert_idle(engines)


async def test_info_endpoints(engines):
    async with httpx.AsyncClient(timeout=30) as c:
        assert (await c.post(engines["null"].url + "/generate", json=GOOD)).status_code == 200
        models = (await c.get(engines["null"].url + "/v1/models")).json()
        assert models["data"][0]["id"] == "builtin:tiny"
        info = (await c.get(engines["decode"].url + "/get_server_info")).json()
        assert info["disaggregation_mode"] == "decode" and info["scheduler_info"]["status"] == "ready"
        assert info["kv_pages_held"] == 0
        minfo = (await c.get(engines["prefill"].url + "/get_model_info")).json()
        assert minfo["disaggregation_mode"] == "prefill" and minfo["architectures"] == ["LlamaForCausalLM"]
        # a benchmark client finds the tokenizer of builtin:tiny there, and from `pdserve model-path`
        from transformers import AutoTokenizer

        assert AutoTokenizer.from_pretrained(minfo["tokenizer_path"]).encode("hi") == [107, 108, 1]
        cli = subprocess.run([sys.executable, "-m", "pd.cli", "model-path", "builtin:tiny"], capture_output=True,
                             text=True, timeout=120)
        assert cli.returncode == 0 and cli.stdout.strip() == minfo["tokenizer_path"], cli.stdout + cli.stderr
        bad = subprocess.run([sys.executable, "-m", "pd.cli", "model-path", "builtin:huge"], capture_output=True,
                             text=True, timeout=120)
        assert bad.returncode == 2 and "builtin:huge" in bad.stderr
        assert (await c.get(engines["prefill"].url + "/health_generate")).status_code == 200
        metrics = (await c.get(engines["null"].url + "/metrics")).text
        for name in ("sglang:time_to_first_token_seconds_bucket", "sglang:inter_token_latency_seconds_bucket",
                     "sglang:e2e_request_latency_seconds_bucket", "sglang:num_running_reqs", "sglang:num_queue_reqs",
                     "sglang:prompt_tokens_total", "sglang:generation_tokens_total"):
            assert name in metrics, name


async def test_abort_during_cleanup_still_releases_pages(engines):
    """An /abort_request landing while the decode is already cleaning up a failed room (here:
    the prefill is unreachable) must not skip the page release."""
    async with httpx.AsyncClient(timeout=30) as c:
        for i in range(6):
            rid = f"race-{i}-" + uuid.uuid4().hex
            body = add_rooms({"text": "race", "rid": rid, "sampling_params": {"max_new_tokens": 2}},
                             "127.0.0.1", free_port(), None)
            req = asyncio.create_task(c.post(engines["decode"].url + "/generate", json=body))
            await asyncio.sleep(0.002 * i)
            await c.post(engines["decode"].url + "/abort_request", json={"rid": rid})
            await req
    await assert_idle(engines)
