"""The reference engine's caps on one request (--max-n, --max-batch-size, --max-sequences-per-request,
--max-body-bytes) and its /abort_request with a list of exact rids (one call per side per request from
the router), on the session's real engines; the cluster's engine command carries the router's caps."""

from __future__ import annotations

import json
import time
import uuid

import httpx
import pytest

from pd.commands.build import engine_command
from pd.config import parse_config

GEN = {"max_new_tokens": 1, "temperature": 0}


@pytest.mark.parametrize("route, body, says, param", [
    ("/generate", {"text": "hi", "sampling_params": {**GEN, "n": 17}},
     "sampling_params.n = 17 is over the engine's limit of 16 (--max-n)", "sampling_params.n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 17, "max_tokens": 1},
     "n = 17 is over the engine's limit of 16 (--max-n)", "n"),
    ("/v1/completions", {"prompt": ["x"] * 5000, "max_tokens": 1},
     "a batch of 5000 prompts is over the engine's limit of 256 (--max-batch-size)", "prompt"),
    ("/generate", {"input_ids": [[1, 2]] * 300, "sampling_params": GEN},
     "a batch of 300 prompts is over the engine's limit of 256 (--max-batch-size)", "input_ids"),
    ("/generate", {"text": ["x"] * 200, "sampling_params": {**GEN, "n": 3}},
     "200 prompts x n = 3 make 600 sequences, over the engine's limit of 512 (--max-sequences-per-request)",
     "sampling_params.n"),
])
async def test_requests_over_the_engine_caps_get_400_before_any_work(engines, route, body, says, param):
    async with httpx.AsyncClient(timeout=30) as c:
        t0 = time.monotonic()
        r = await c.post(engines["null"].url + route, json=body)
        elapsed = time.monotonic() - t0
    assert r.status_code == 400, r.text
    assert r.json() == {"error": {"message": says, "type": "BadRequestError", "param": param, "code": 400}}
    assert elapsed < 5  # refused before 5000 prompts are tokenized or 600 sequences allocated


async def test_at_the_caps_a_request_is_served(engines):
    async with httpx.AsyncClient(timeout=60) as c:
        r = await c.post(engines["null"].url + "/generate", json={"text": "hi", "sampling_params": {**GEN, "n": 16}})
    assert r.status_code == 200 and len(r.json()) == 16


async def test_a_body_over_max_body_bytes_gets_413(engines):
    big = json.dumps({"text": "x" * (32 * 1024 * 1024), "sampling_params": GEN})
    async with httpx.AsyncClient(timeout=60) as c:
        r = await c.post(engines["null"].url + "/generate", content=big, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and "exceeds the limit of 33554432 bytes" in r.json()["error"]["message"]


async def test_abort_request_takes_a_list_of_exact_rids(engines):
    """One call aborts every sequence it names and only those: ``base-a`` is a prefix of ``base-ab``
    (SGLang's scheduler would abort both), and ``base-ab`` keeps generating."""
    url = engines["null"].url
    base = "lst-" + uuid.uuid4().hex
    rids = [f"{base}-a", f"{base}-b", f"{base}-ab"]
    body = {"text": ["one", "two", "three"], "rid": rids, "stream": True,
            "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True, "temperature": 0}}
    async with httpx.AsyncClient(timeout=60) as c:
        bad = await c.post(url + "/abort_request", json={"rid": [1, 2]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "rid"
        last: dict[int, dict] = {}
        aborted_at = None
        async with c.stream("POST", url + "/generate", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[len("data: "):])
                last[chunk["index"]] = chunk
                if aborted_at is None and len(last) == 3:
                    r = await c.post(url + "/abort_request", json={"rid": rids[:2]})
                    assert r.status_code == 200
                    aborted_at = 0
                ends = [last[i]["meta_info"]["finish_reason"] for i in (0, 1)] if len(last) == 3 else None
                if ends and all(e and e["type"] == "abort" for e in ends):
                    tokens = last[2]["meta_info"]["completion_tokens"]
                    if aborted_at == 0:
                        aborted_at = tokens  # a and b are done; ab's length now
                    elif tokens > aborted_at and last[2]["meta_info"]["finish_reason"] is None:
                        r = await c.post(url + "/abort_request", json={"rid": rids[2]})  # SGLang's one-id form
                        assert r.status_code == 200
                        aborted_at = -1
    assert aborted_at == -1, "ab stopped with a and b: the list abort was not exact"
    assert [last[i]["meta_info"]["finish_reason"]["type"] for i in range(3)] == ["abort"] * 3
    assert all(last[i]["meta_info"]["completion_tokens"] < 1500 for i in range(3))


def test_the_cluster_engine_command_carries_the_router_caps():
    from pd.engines.settings import parse_settings

    cfg = parse_config({"router": {"max_n": 4, "max_batch_size": 8, "max_sequences_per_request": 20,
                                   "max_payload_size": 1000}})
    argv = engine_command(cfg, "decode", "127.0.0.1", 30000, None).argv
    args = parse_settings(argv[argv.index("engine") + 1:], environ={})
    assert (args.max_n, args.max_batch_size, args.max_sequences_per_request, args.max_body_bytes) == (4, 8, 20, 1000)


@pytest.mark.parametrize("flag", ["--max-n", "--max-batch-size", "--max-sequences-per-request", "--max-body-bytes"])
def test_engine_caps_must_be_positive(flag):
    from pd.engines.errors import EngineSettingsError
    from pd.engines.settings import parse_settings

    with pytest.raises(EngineSettingsError, match=flag):
        parse_settings([flag, "0"], environ={})


def test_the_engine_and_the_router_share_one_default_per_cap():
    """pd.util.request_caps is the one place the defaults live: the engine's flags, its RequestLimits and the
    router's settings all read it."""
    from pd.engines.api.limits import RequestLimits
    from pd.engines.settings import EngineSettings
    from pd.router.config import RouterSettings
    from pd.util import request_caps as caps

    engine = EngineSettings()
    router = RouterSettings()
    want = {"max_n": caps.MAX_N, "max_batch_size": caps.MAX_BATCH_SIZE,
            "max_sequences_per_request": caps.MAX_SEQUENCES_PER_REQUEST}
    for name, value in want.items():
        assert getattr(engine, name) == getattr(router, name) == getattr(RequestLimits(), name) == value, name
    assert engine.max_body_bytes == router.max_payload_size == caps.MAX_BODY_BYTES
