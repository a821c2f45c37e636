"""Requests are answered as asked or refused, never accepted and silently ignored.

- numbers sent as strings: the router's token cap counts what the engines' pydantic models read
  (``"5000"`` is 5000 on the OpenAI routes), so a string ``max_tokens`` cannot slip past it;
- fields of SGLang's request models the reference engine does not implement (response_format, tools,
  best_of, suffix, ...) are a 400 naming the field, while their defaults pass;
- /v1/completions ``top_logprobs`` (not a field of SGLang's CompletionRequest) is a 400 naming it;
  ``logprobs: true`` is 1 top logprob per token, as SGLang's lax int reads it;
- seeds use all 64 bits (0, 2^32, 2^63 - 1 and -2^63 are four streams) and SGLang's range;
- admin worker URLs are compared in one spelling, so one endpoint cannot be added twice.
"""

from __future__ import annotations

import httpx
import pytest
import torch

from pd.engines.sampling import step_generator
from pd.router.admission import check, request_tokens
from pd.router.config import RouterConfig, RouterSettings
from pd.router.rooms import request_shape
from pd.router.workers import WorkerPool, canonical_url
from routers import pd_router

CAP = 100  # the module router's --max-total-tokens-per-request
ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")


def body_for(route: str, **extra) -> dict:
    if route == "/generate":
        base = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    elif route == "/v1/completions":
        base = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
    else:
        base = {"messages": [{"role": "user", "content": "Once upon a time"}], "max_tokens": 4, "temperature": 0}
    return {**base, **extra}


async def post(url: str, route: str, body: dict) -> httpx.Response:
    async with httpx.AsyncClient(timeout=60) as c:
        return await c.post(url + route, json=body)


@pytest.fixture(scope="module")
def router(engines, tmp_path_factory):
    """A router over the session's prefill and decode engines with a small token cap."""
    pre, dec = engines["prefill"], engines["decode"]
    r = pd_router(pre.url, pre.bootstrap_port, dec.url, str(tmp_path_factory.mktemp("ignored-fields-router")),
                  "--max-total-tokens-per-request", str(CAP))
    try:
        r.wait_ready()
        yield r
    finally:
        r.stop()


# ---- 1. numbers given as strings ----------------------------------------------------------------------
@pytest.mark.parametrize("route, body, tokens", [
    ("/v1/completions", {"prompt": "ab", "max_tokens": "5000"}, 2 + 5000),
    ("/v1/completions", {"prompt": "ab", "max_tokens": " +40 "}, 2 + 40),
    ("/v1/completions", {"prompt": "ab", "max_tokens": "4_0"}, 2 + 40),
    ("/v1/completions", {"prompt": "ab", "max_tokens": None}, 2 + 16),  # null: the engine's default
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ab"}], "max_tokens": "5000"}, 2 + 5000),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ab"}], "max_completion_tokens": "40.0"},
     2 + 40),
    # SGLang reads ``max_completion_tokens or max_tokens``
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ab"}], "max_completion_tokens": 0,
                              "max_tokens": 300}, 2 + 300),
    # /generate's sampling_params take a JSON integer only (the engine refuses "40": nothing to count)
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": "40"}}, 2),
])
def test_router_counts_numeric_strings_as_the_engine_reads_them(route, body, tokens):
    assert request_tokens(route, body, request_shape(route, body)) == tokens


@pytest.mark.parametrize("n", ["+3", "3.0", "1_0"])
def test_router_refuses_an_n_it_would_count_differently_from_the_engine(n):
    body = {"prompt": "ab", "n": n}
    over = check("/v1/completions", request_shape("/v1/completions", body), RouterSettings(), body)
    assert over is not None and over.param == "n", over


async def test_string_max_tokens_over_the_cap_is_the_routers_400(router):
    resp = await post(router.url, "/v1/completions", {"prompt": "hi", "max_tokens": "1000", "ignore_eos": True})
    assert resp.status_code == 400, resp.text
    assert "--max-total-tokens-per-request" in resp.json()["error"]["message"], resp.text
    # under the cap, the string is the engine's number
    resp = await post(router.url, "/v1/completions", {"prompt": "hi", "max_tokens": "8", "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 8


async def test_engine_chat_reads_max_completion_tokens_and_refuses_a_max_tokens_it_would_ignore(engines):
    """SGLang reads ``max_completion_tokens or max_tokens`` and the router counts the same field; the reference
    engine uses max_completion_tokens too, and refuses a different max_tokens beside it rather than drop it."""
    url = engines["null"].url
    resp = await post(url, "/v1/chat/completions", body_for("/v1/chat/completions", max_tokens=None,
                                                            max_completion_tokens=3, ignore_eos=True))
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 3
    resp = await post(url, "/v1/chat/completions", body_for("/v1/chat/completions", max_tokens=40,
                                                            max_completion_tokens=3, ignore_eos=True))
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_tokens", resp.text


# ---- 2. fields the reference engine does not implement --------------------------------------------------
SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
REFUSED = [
    ("/v1/chat/completions", "response_format", SCHEMA),
    ("/v1/chat/completions", "response_format", {"type": "json_object"}),
    ("/v1/chat/completions", "tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("/v1/chat/completions", "tool_choice", "required"),
    ("/v1/chat/completions", "regex", "a+"),
    ("/v1/chat/completions", "return_hidden_states", True),
    ("/v1/chat/completions", "chat_template_kwargs", {"enable_thinking": True}),
    ("/v1/chat/completions", "reasoning_effort", "high"),
    ("/v1/chat/completions", "continue_final_message", True),
    ("/v1/chat/completions", "return_meta_info", True),
    ("/v1/chat/completions", "stream_options.continuous_usage_stats", True),
    ("/v1/completions", "best_of", 3),
    ("/v1/completions", "suffix", " the end"),
    ("/v1/completions", "json_schema", '{"type": "object"}'),
    ("/v1/completions", "response_format", SCHEMA),
    ("/v1/completions", "ebnf", 'root ::= "a"'),
    ("/v1/completions", "lora_path", "adapter"),
    ("/v1/completions", "return_token_ids", True),
    ("/v1/completions", "custom_logit_processor", "x"),
    ("/v1/completions", "cache_salt", "tenant-a"),
    ("/generate", "token_ids_logprob", [1, 2]),
    ("/generate", "return_hidden_states", True),
    ("/generate", "lora_path", "adapter"),
    ("/generate", "session_params", {"id": "s"}),
    ("/generate", "image_data", "http://x/y.png"),
    ("/generate", "routed_dp_rank", 1),
]


def with_field(route: str, field: str, value) -> dict:
    if field == "stream_options.continuous_usage_stats":
        return body_for(route, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": value})
    return body_for(route, **{field: value})


@pytest.mark.parametrize("route, field, value", REFUSED)
async def test_an_unimplemented_field_is_a_400_naming_it(engines, route, field, value):
    resp = await post(engines["null"].url, route, with_field(route, field, value))
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == field and "is not supported by the reference engine" in err["message"], err


DEFAULTS = [
    ("/v1/chat/completions", {"response_format": {"type": "text"}, "tools": None, "tool_choice": "auto",
                              "parallel_tool_calls": True, "return_hidden_states": False, "regex": None,
                              "user": "u", "metadata": {"k": "v"}, "store": False, "priority": 1,
                              "separate_reasoning": True, "chat_template_kwargs": None}),
    ("/v1/chat/completions", {"tools": [], "tool_choice": "none", "lora_path": [None]}),
    ("/v1/completions", {"best_of": 1, "suffix": None, "json_schema": None, "return_token_ids": False,
                         "routed_dp_rank": 0, "user": "u"}),
    ("/generate", {"return_hidden_states": [False], "lora_path": None, "token_ids_logprob": None,
                   "priority": 0, "custom_labels": {"team": "a"}}),
]


@pytest.mark.parametrize("route, extra", DEFAULTS)
async def test_default_values_of_unimplemented_fields_pass(engines, route, extra):
    resp = await post(engines["null"].url, route, body_for(route, **extra))
    assert resp.status_code == 200, resp.text


async def test_the_router_passes_sglang_fields_through_to_the_worker(router):
    """SGLang workers implement response_format: the router does not refuse it; the reference decode does."""
    resp = await post(router.url, "/v1/chat/completions", body_for("/v1/chat/completions", response_format=SCHEMA))
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "response_format" and "reference engine" in err["message"], err


# ---- 3. /v1/completions logprobs ----------------------------------------------------------------------
async def test_completions_top_logprobs_is_refused_naming_it(engines):
    resp = await post(engines["null"].url, "/v1/completions", body_for("/v1/completions", logprobs=True,
                                                                       top_logprobs=3))
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "top_logprobs" and "logprobs: N" in err["message"], err


@pytest.mark.parametrize("logprobs, tops", [(True, 1), (3, 3), (0, 0)])
async def test_completions_logprobs_reads_as_sglangs_int(engines, logprobs, tops):
    """SGLang's CompletionRequest is lax: ``logprobs: true`` is 1 top logprob per token."""
    resp = await post(engines["null"].url, "/v1/completions", body_for("/v1/completions", logprobs=logprobs))
    assert resp.status_code == 200, resp.text
    lp = resp.json()["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == 4
    if tops:
        assert all(len(t) == tops for t in lp["top_logprobs"]), lp["top_logprobs"]
    else:
        assert all(t is None for t in lp["top_logprobs"]), lp["top_logprobs"]


# ---- 4. seeds ----------------------------------------------------------------------------------------
SEEDS = [0, 2**32, 2**63 - 1, -(2**63)]


def test_step_generators_use_all_64_bits_of_the_seed():
    draws = [tuple(torch.rand(4, generator=step_generator(s, 0)).tolist()) for s in SEEDS + [1, 2**32 + 1]]
    assert len(set(draws)) == len(draws), draws
    assert torch.equal(torch.rand(4, generator=step_generator(2**40, 3)),
                       torch.rand(4, generator=step_generator(2**40, 3)))  # deterministic


async def test_seeds_give_distinct_reproducible_streams(engines):
    async def tokens(seed):
        body = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 12, "temperature": 1.0,
                                                                "ignore_eos": True, "sampling_seed": seed}}
        resp = await post(engines["null"].url, "/generate", body)
        assert resp.status_code == 200, resp.text
        return tuple(resp.json()["output_ids"])

    streams = [await tokens(s) for s in SEEDS]
    assert len(set(streams)) == len(SEEDS), streams
    assert await tokens(2**32) == streams[1]  # same seed, same tokens


@pytest.mark.parametrize("route, body, param", [
    ("/generate", {"text": "a", "sampling_params": {"sampling_seed": 2**63}}, "sampling_seed"),
    ("/generate", {"text": "a", "sampling_params": {"sampling_seed": -(2**63) - 1}}, "sampling_seed"),
    ("/v1/completions", {"prompt": "a", "seed": 2**63}, "seed"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "seed": 2**64}, "seed"),
])
async def test_a_seed_outside_int64_is_refused_as_sglang_does(engines, route, body, param):
    resp = await post(engines["null"].url, route, body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param, resp.text


# ---- 5. admin worker URLs -----------------------------------------------------------------------------
@pytest.mark.parametrize("a, b", [
    ("http://127.0.0.1:31002", "HTTP://127.0.0.1:031002/"),
    ("http://Worker.Example:80", "http://worker.example"),
    ("https://w:443/", "HTTPS://W"),
    ("http://[::1]:5000", "http://[0:0::0001]:5000"),
])
def test_one_endpoint_has_one_spelling(a, b):
    assert canonical_url(a) == canonical_url(b)
    pool = WorkerPool(RouterConfig.from_urls([("http://p:1", 5)], ["http://d:1"]))
    pool.add(a, "decode")
    with pytest.raises(ValueError, match="already a worker"):
        pool.add(b, "decode")
    assert pool.get(b) is pool.get(a) is not None


async def test_admin_api_refuses_a_second_spelling_of_a_worker_like_a_verbatim_duplicate(router, engines):
    dec = engines["decode"].url  # http://127.0.0.1:PORT
    host, port = dec.removeprefix("http://").rsplit(":", 1)
    async with httpx.AsyncClient(base_url=router.url, timeout=10) as c:
        verbatim = await c.post("/workers", json={"url": dec, "worker_type": "decode"})
        assert verbatim.status_code == 409, verbatim.text
        for alias in (f"HTTP://{host}:0{port}/", f"http://{host}:{port}/"):
            resp = await c.post("/workers", json={"url": alias, "worker_type": "decode"})
            if resp.status_code == 201:  # undo, so the router keeps one decode
                await c.delete("/workers", params={"url": resp.json()["worker"]["url"]})
            assert resp.status_code == verbatim.status_code, resp.text
        listed = (await c.get("/workers")).json()
        assert listed["stats"]["decode_count"] == 1, listed
