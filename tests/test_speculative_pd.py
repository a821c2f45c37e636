"""Speculative decoding end to end: a speculative prefill + decode pair (and a speculative null engine) give the
same tokens as the null engine without speculation, hand the draft's state across, count as SGLang does, refuse
mismatched settings, and hold no KV page in either cache after a failure."""

import asyncio
import os
import random
import signal

import httpx
import pytest

from conftest import SPEC_FLAGS
from engines import async_metric, start_engine, wait_ready
from pd.util.wait import async_wait_until
from pdclient import add_rooms, merge_logprobs, parse_sse, pd_post

GREEDY = {"temperature": 0}
LOGPROB_TOL = 1e-4  # a verify window's logits come from one multi-token forward (see test_logprobs_match)
PAGES = ("pdserve_kv_pages_held", "pdserve_draft_kv_pages_held")


async def post(engine, route, body):
    async with httpx.AsyncClient(timeout=120) as c:
        r = await c.post(engine.url + route, json=body)
    assert r.status_code == 200, r.text
    return parse_sse(r.content) if body.get("stream") else r.json()


async def pd_run(pair, route, body, rooms=None):
    async with httpx.AsyncClient(timeout=120) as c:
        status, dec, (pstatus, pre) = await pd_post(c, pair["prefill"], pair["decode"], route, body, rooms)
    assert status == 200 and pstatus == 200, (dec, pre)
    return dec, pre


def final(result, stream):
    """The per-sequence final objects of a /generate answer (a stream's last chunk per index)."""
    if not stream:
        return result if isinstance(result, list) else [result]
    last = {}
    for chunk in result:
        if chunk != "[DONE]":
            last[chunk.get("index", 0)] = chunk
    return [last[i] for i in sorted(last)]


def assert_same(got, ref):
    """Same tokens, text and finish reason; logprobs within LOGPROB_TOL."""
    assert got["output_ids"] == ref["output_ids"]
    assert got["text"] == ref["text"]
    gm, rm = got["meta_info"], ref["meta_info"]
    assert gm["finish_reason"] == rm["finish_reason"]
    for key in ("output_token_logprobs", "input_token_logprobs"):
        if key in rm:
            assert [e[1] for e in gm[key]] == [e[1] for e in rm[key]]
            for a, b in zip(gm[key], rm[key]):
                assert (a[0] is None and b[0] is None) or abs(a[0] - b[0]) <= LOGPROB_TOL
    if "output_top_logprobs" in rm:
        for ga, ra in zip(gm["output_top_logprobs"], rm["output_top_logprobs"]):
            assert [e[1] for e in ga] == [e[1] for e in ra]
            assert max(abs(a[0] - b[0]) for a, b in zip(ga, ra)) <= LOGPROB_TOL


def random_prompts(count, seed):
    rng = random.Random(seed)
    return [[rng.randrange(3, 259) for _ in range(rng.randrange(8, 64))] for _ in range(count)]


async def reference_output(engines, prompt, max_new=48):
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": max_new, **GREEDY}}
    return await post(engines["null"], "/generate", body)


def shapes(ref_ids, tokenizer_text):
    """Request shapes whose stop conditions land inside a run of accepted drafts of the reference output."""
    return {
        "plain": {"max_new_tokens": 48},
        "max_new_tokens mid-run": {"max_new_tokens": 7},
        "stop id": {"max_new_tokens": 48, "stop_token_ids": [ref_ids[13]]},
        "stop string": {"max_new_tokens": 48, "stop": tokenizer_text[9:12]},
        "min_new_tokens": {"max_new_tokens": 30, "min_new_tokens": 20, "stop_token_ids": [ref_ids[3]]},
        "penalties": {"max_new_tokens": 40, "frequency_penalty": 0.7, "presence_penalty": 0.3,
                      "repetition_penalty": 1.3},
    }


SHAPES = ["plain", "max_new_tokens mid-run", "stop id", "stop string", "min_new_tokens", "penalties"]


@pytest.mark.parametrize("where", ["pd", "null"])
@pytest.mark.parametrize("shape", SHAPES)
async def test_greedy_output_equals_the_null_engine_without_speculation(engines, spec_engines, where, shape):
    prompt = random_prompts(1, SHAPES.index(shape))[0]
    base = await reference_output(engines, prompt)
    sp = {**GREEDY, **shapes(base["output_ids"], base["text"])[shape]}
    body = {"input_ids": prompt, "sampling_params": sp, "return_logprob": True, "logprob_start_len": 0,
            "top_logprobs_num": 3}
    ref = await post(engines["null"], "/generate", body)
    if where == "pd":
        dec, pre = await pd_run(spec_engines, "/generate", body)
        got = merge_logprobs(dec, pre)
    else:
        got = await post(spec_engines["null"], "/generate", body)
    assert_same(got, ref)
    meta = got["meta_info"]
    if len(got["output_ids"]) > 1:  # SGLang's per-request counts (tokenizer_manager._calculate_spec_decoding_metrics)
        assert meta["spec_verify_ct"] >= 1
        assert meta["spec_accept_length"] == pytest.approx(len(got["output_ids"]) / meta["spec_verify_ct"])
        assert meta["spec_num_proposed_drafts"] == 3 * meta["spec_verify_ct"]
        assert 0 <= meta["spec_accept_rate"] <= 1


@pytest.mark.parametrize("stream", [False, True])
async def test_batches_n_and_streams_match(engines, spec_engines, stream):
    """Three prompts x n=2 greedy samples: six sequences with different accept lengths served side by side."""
    prompts = random_prompts(3, 99)
    body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": 32, "n": 2, **GREEDY}, "stream": stream}
    ref = final(await post(engines["null"], "/generate", body), stream)
    dec, _ = await pd_run(spec_engines, "/generate", body, rooms=6)
    got = final(dec, stream)
    assert len(got) == len(ref) == 6
    for g, r in zip(got, ref):
        assert g["output_ids"] == r["output_ids"] and g["text"] == r["text"]
    accept = {g["meta_info"]["spec_accept_length"] for g in got}
    assert len(accept) > 1, "every sequence accepted the same number of drafts: nothing tested the batching"


async def test_openai_chat_stream_matches(engines, spec_engines):
    body = {"model": "builtin:tiny", "messages": [{"role": "user", "content": "Tell me about Paris."}],
            "max_tokens": 40, "temperature": 0, "stream": True, "logprobs": True, "top_logprobs": 2}

    def text(chunks):
        return "".join((c["choices"][0]["delta"].get("content") or "") for c in chunks[:-1] if c["choices"])

    ref = await post(engines["null"], "/v1/chat/completions", body)
    dec, _ = await pd_run(spec_engines, "/v1/chat/completions", body)
    assert text(dec) == text(ref) and text(ref)


async def test_mean_accept_length_on_random_prompts(spec_engines):
    """The built-in pair makes speculation pay: >= 2 tokens per verify step with 3 draft tokens at temperature 0."""
    steps = tokens = 0
    for prompt in random_prompts(8, 7):
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 64, "ignore_eos": True, **GREEDY}}
        dec, _ = await pd_run(spec_engines, "/generate", body)
        steps += dec["meta_info"]["spec_verify_ct"]
        tokens += len(dec["output_ids"])
    assert tokens / steps >= 2.0
    # /metrics exports SGLang's speculative series on the decode
    assert await async_metric(spec_engines["decode"], "sglang:spec_accept_length") >= 1.0
    assert await async_metric(spec_engines["decode"], "sglang:spec_verify_calls_total") >= steps
    assert 0 < await async_metric(spec_engines["decode"], "sglang:spec_accept_rate") <= 1


@pytest.mark.parametrize("spec_side", ["prefill", "decode"])
async def test_mismatched_speculative_settings_fail_the_handshake(engines, spec_engines, spec_side):
    """Speculation on one side only: the room fails at the handshake, naming both sides' settings."""
    prefill = spec_engines["prefill"] if spec_side == "prefill" else engines["prefill"]
    decode = spec_engines["decode"] if spec_side == "decode" else engines["decode"]
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 4, **GREEDY}}
    async with httpx.AsyncClient(timeout=60) as c:
        status, dec, (pstatus, pre) = await pd_post(c, prefill, decode, "/generate", body, None)
    assert status >= 500 and pstatus >= 500
    message = dec["error"]["message"] + pre["error"]["message"]
    assert "speculative settings mismatch" in message
    assert "--speculative-num-steps 3" in message and "no speculative decoding" in message
    for e in (prefill, decode):
        for name in PAGES:
            await async_wait_until(lambda e=e, n=name: _zero(e, n), 10, what=f"{name} back to 0 on {e.mode}")


async def _zero(engine, name):
    return await async_metric(engine, name) == 0


async def test_client_gone_mid_verify_frees_both_caches(spec_engines):
    """A streaming client that disconnects after a few chunks: no target or draft page stays held on either side."""
    body = add_rooms({"input_ids": random_prompts(1, 3)[0], "stream": True,
                      "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True, **GREEDY}},
                     "127.0.0.1", spec_engines["prefill"].bootstrap_port, None)
    async with httpx.AsyncClient(timeout=60) as c:
        pre = asyncio.create_task(c.post(spec_engines["prefill"].url + "/generate", json=body))
        async with c.stream("POST", spec_engines["decode"].url + "/generate", json=body) as r:
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data:")
                if seen >= 3:
                    break
        await pre
    for e in (spec_engines["prefill"], spec_engines["decode"]):
        for name in PAGES:
            await async_wait_until(lambda e=e, n=name: _zero(e, n), 20, what=f"{name} back to 0 on {e.mode}")


@pytest.mark.slow
async def test_decode_killed_mid_verify_leaves_the_prefill_clean(model_cache, spec_engines, tmp_path):
    """SIGKILL a speculative decode while it streams: the prefill holds no page of either cache afterwards."""
    decode = start_engine("decode", str(tmp_path), *SPEC_FLAGS)
    try:
        wait_ready([decode])
        pair = {"prefill": spec_engines["prefill"], "decode": decode}
        body = add_rooms({"input_ids": random_prompts(1, 4)[0], "stream": True,
                          "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True, **GREEDY}},
                         "127.0.0.1", pair["prefill"].bootstrap_port, None)
        async with httpx.AsyncClient(timeout=60) as c:
            pre = asyncio.create_task(c.post(pair["prefill"].url + "/generate", json=body))
            with pytest.raises(httpx.HTTPError):
                async with c.stream("POST", decode.url + "/generate", json=body) as r:
                    async for line in r.aiter_lines():
                        verified = await async_metric(decode, "pdserve_spec_step_seconds_count", phase="verify")
                        if line.startswith("data:") and verified > 0 and decode.proc.poll() is None:
                            os.killpg(decode.proc.pid, signal.SIGKILL)
            await pre
        for name in PAGES:
            await async_wait_until(lambda n=name: _zero(pair["prefill"], n), 20, what=f"{name} back to 0 on prefill")
    finally:
        decode.stop()
