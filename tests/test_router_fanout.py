"""Requests with ``n > 1`` through the router (pd.router.fanout): fanned out into single-sample PD
requests (one scalar room and ``n`` 1 each, which SGLang's own normalisation keeps one room per
sequence) and merged into exactly the one n-sample answer: choice/sequence order, usage, streams with
one ``[DONE]``, per-sample seeds, and aborts of every sample's real request id."""

from __future__ import annotations

import ast
import asyncio
import types
from pathlib import Path

import httpx
import pytest

from pd.router import fanout, jsonio
from pd.router.rooms import assign_rids, request_shape, stamp
from pd.util.wait import async_wait_until
from pdclient import parse_sse
from routers import RouterProc, pd_router
from test_router_faults import metric, running_standins

N = 4
CHAT = {"model": "builtin:tiny", "messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 10}
COMPLETION = {"model": "builtin:tiny", "prompt": "Once upon a time", "max_tokens": 10}
GENERATE = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 10}}
BATCH = {"text": ["Once upon a time", "def main():"], "sampling_params": {"max_new_tokens": 10}}


def with_n(route: str, body: dict, n: int, temperature: float, seed=None) -> dict:
    """``body`` asking for ``n`` samples at ``temperature`` (and ``seed``), in the route's own fields."""
    if route == "/generate":
        sp = dict(body["sampling_params"], n=n, temperature=temperature)
        if seed is not None:
            sp["sampling_seed"] = seed
        return dict(body, sampling_params=sp)
    out = dict(body, n=n, temperature=temperature)
    if seed is not None:
        out["seed"] = seed
    return out


# ---- what the router sends -------------------------------------------------------------------------
class _Prefill:
    bootstrap_host, bootstrap_port = "10.0.0.1", 8998


def outgoing(route: str, body: dict) -> list[dict]:
    """The bodies the router POSTs for ``body``: its samples, each stamped as one attempt does."""
    shape = request_shape(route, body)
    subs = fanout.split(route, body, shape) if shape.n > 1 else [dict(body)]
    for sub in subs:
        one = request_shape(route, sub)
        assign_rids(sub, one.sequences, one.batch, one.n)
        stamp(sub, one.sequences, one.batch, _Prefill)
    return subs


CASES = [("/v1/chat/completions", CHAT, 1), ("/v1/completions", COMPLETION, 1), ("/generate", GENERATE, 1),
         ("/generate", BATCH, 2), ("/v1/completions", dict(COMPLETION, prompt=["a b", "c d", "e f"]), 3)]


@pytest.mark.parametrize("route,body,prompts", CASES)
def test_each_outgoing_body_is_one_sample_with_its_own_rooms_and_seed(route, body, prompts):
    subs = outgoing(route, with_n(route, body, N, 1.0, seed=2**63 - 2))
    assert len(subs) == N
    rooms = []
    for s, sub in enumerate(subs):
        sp = sub.get("sampling_params", sub)
        assert sp["n"] == 1
        seed = sp.get("sampling_seed", sp.get("seed"))
        assert seed == (2**63 - 2 + s + 2**63) % 2**64 - 2**63  # distinct, reproducible, in int64
        if prompts == 1 and "text" in sub and not isinstance(sub["text"], list) or route == "/v1/chat/completions" \
                or (route == "/v1/completions" and isinstance(sub["prompt"], str)):
            assert isinstance(sub["bootstrap_room"], int) and isinstance(sub["rid"], str)
            rooms.append(sub["bootstrap_room"])
        else:
            assert len(sub["bootstrap_room"]) == prompts == len(sub["rid"])
            rooms += sub["bootstrap_room"]
    assert len(set(rooms)) == prompts * N  # no room shared by two sequences
    assert len({str(sub["rid"]) for sub in subs}) == N


def _sglang_normalize_bootstrap():
    """SGLang's ``GenerateReqInput._normalize_bootstrap_params``, read from the pinned source with ast
    (io_struct needs GPU-side packages to import here)."""
    import sglang

    src = (Path(sglang.__file__).parent / "srt" / "managers" / "io_struct.py").read_text()
    cls = next(n for n in ast.parse(src).body if isinstance(n, ast.ClassDef) and n.name == "GenerateReqInput")
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "_normalize_bootstrap_params")
    scope: dict = {}
    exec(compile(ast.Module([fn], []), "io_struct.py", "exec"), scope)
    fields = {n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute) and getattr(n.value, "id", "") == "self"}
    return scope["_normalize_bootstrap_params"], fields


def sglang_sequence_rooms(body: dict) -> list:
    """The room of every sequence SGLang's tokenizer manager runs for a /generate ``body`` (its warm-up
    request and samples of prompt ``i`` are copies of request ``i``, so they all carry room ``i``)."""
    shape = request_shape("/generate", body)
    if not shape.batch and shape.n == 1:
        return [body["bootstrap_room"]]  # a single request: its room as sent
    normalize, fields = _sglang_normalize_bootstrap()
    obj = types.SimpleNamespace(**{k: body.get(k) for k in fields})
    obj.parallel_sample_num = shape.n
    batch = shape.prompts
    normalize(obj, batch * shape.n)
    rooms = [obj.bootstrap_room[i] for i in range(batch)]
    return [r for r in rooms for _ in range(shape.n + (1 if shape.n > 1 else 0))]  # warm-up + samples


@pytest.mark.parametrize("body", [GENERATE, BATCH])
def test_sglang_normalisation_keeps_one_room_per_sequence(body):
    body = with_n("/generate", body, N, 1.0)
    rooms = [r for sub in outgoing("/generate", body) for r in sglang_sequence_rooms(sub)]
    prompts = request_shape("/generate", body).prompts
    assert len(rooms) == prompts * N and len(set(rooms)) == len(rooms)
    # what one n-sample body did: SGLang ran all n samples (and the warm-up) of a prompt on one room
    old = dict(body, bootstrap_host=[_Prefill.bootstrap_host] * prompts * N,
               bootstrap_port=[_Prefill.bootstrap_port] * prompts * N,
               bootstrap_room=list(range(100, 100 + prompts * N)), rid="pdr-x")
    assert len(set(sglang_sequence_rooms(old))) == prompts < len(sglang_sequence_rooms(old))


def test_merge_whole_orders_prompt_major_and_counts_prompts_once():
    usage = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
             "prompt_tokens_details": {"cached_tokens": 2}}
    samples = [jsonio.encode({"id": f"c{s}", "choices": [{"index": p, "text": f"p{p}s{s}"} for p in range(2)],
                              "usage": dict(usage, completion_tokens=3 + s)}) for s in range(3)]
    out = jsonio.parse(fanout.merge_whole("/v1/completions", 3, samples))[0]
    assert [c["index"] for c in out["choices"]] == list(range(6))
    assert [c["text"] for c in out["choices"]] == [f"p{p}s{s}" for p in range(2) for s in range(3)]
    assert out["id"] == "c0"
    assert out["usage"] == {"prompt_tokens": 7, "completion_tokens": 12, "total_tokens": 19,
                            "prompt_tokens_details": {"cached_tokens": 2}}
    gen = [jsonio.encode([{"text": f"p{p}s{s}"} for p in range(2)]) for s in range(3)]
    assert [x["text"] for x in jsonio.parse(fanout.merge_whole("/generate", 3, gen))[0]] == \
        [f"p{p}s{s}" for p in range(2) for s in range(3)]


# ---- through the router, on the reference engines ------------------------------------------------
@pytest.fixture(scope="module")
def router(engines, tmp_path_factory):
    pre, dec = engines["prefill"], engines["decode"]
    r = pd_router(pre.url, pre.bootstrap_port, dec.url, str(tmp_path_factory.mktemp("fanout-logs")))
    try:
        r.wait_ready()
        yield r
    finally:
        r.stop()


async def ask(url: str, route: str, body: dict):
    async with httpx.AsyncClient(timeout=120) as c:
        r = await c.post(url + route, json=body)
    assert r.status_code == 200, r.text
    return parse_sse(r.content) if body.get("stream") else r.json()


def samples(route: str, answer, stream: bool) -> tuple[list[str], dict | None]:
    """(text of each sequence in order, usage) of an answer; checks the indexes are 0.. in order and a
    stream ends with exactly one ``[DONE]``."""
    if stream:
        assert answer[-1] == "[DONE]" and answer.count("[DONE]") == 1
        texts: dict = {}
        usage = None
        for c in answer[:-1]:
            if route == "/generate":
                texts[c.get("index", 0)] = c["text"]  # cumulative (no index: a single sequence)
                continue
            usage = c.get("usage") or usage
            for ch in c["choices"]:
                piece = ch["delta"].get("content") if "delta" in ch else ch["text"]
                texts[ch["index"]] = texts.get(ch["index"], "") + (piece or "")
        assert sorted(texts) == list(range(len(texts)))
        return [texts[i] for i in sorted(texts)], usage
    if route == "/generate":
        answer = answer if isinstance(answer, list) else [answer]
        return [a["text"] for a in answer], None
    assert [c["index"] for c in answer["choices"]] == list(range(len(answer["choices"])))
    return [c["message"]["content"] if "message" in c else c["text"] for c in answer["choices"]], answer["usage"]


ROUTES = [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION), ("/generate", GENERATE)]


def streamed(route: str, body: dict, stream: bool) -> dict:
    body = dict(body, stream=stream)
    if stream and route != "/generate":
        body["stream_options"] = {"include_usage": True}
    return body


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route,body", ROUTES)
async def test_greedy_samples_each_equal_a_single_request(router, route, body, stream):
    one, one_usage = samples(route, await ask(router.url, route, streamed(route, with_n(route, body, 1, 0), stream)),
                             stream)
    many, usage = samples(route, await ask(router.url, route, streamed(route, with_n(route, body, N, 0), stream)),
                          stream)
    assert len(one) == 1 and many == one * N
    if route != "/generate":  # prompt counted once, completions summed (SGLang's UsageProcessor)
        assert usage["prompt_tokens"] == one_usage["prompt_tokens"]
        assert usage["completion_tokens"] == N * one_usage["completion_tokens"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route,body", ROUTES + [("/generate", BATCH)])
async def test_sampled_samples_differ_and_a_seed_reproduces_them(engines, router, route, body, stream):
    seeded = with_n(route, dict(body), N, 1.0, seed=4242)
    first, _ = samples(route, await ask(router.url, route, streamed(route, seeded, stream)), stream)
    again, _ = samples(route, await ask(router.url, route, streamed(route, seeded, stream)), stream)
    prompts = request_shape(route, seeded).prompts
    assert len(first) == prompts * N and first == again
    for p in range(prompts):
        assert len(set(first[p * N:(p + 1) * N])) == N  # each sample its own seed
    # exactly the one n-sample answer an engine gives without PD (seed + s per sample, prompt-major)
    ref, _ = samples(route, await ask(engines["null"].url, route, dict(seeded, stream=False)), False)
    assert first == ref


# ---- on stand-in engines: the bodies on the wire, aborts ------------------------------------------
@pytest.fixture(scope="module")
def standins(tmp_path_factory):
    logs = str(tmp_path_factory.mktemp("fanout-standin-logs"))
    with running_standins(logs, "p0", "d0") as procs:
        r = RouterProc(["--prefill", procs["p0"].url, str(procs["p0"].bootstrap_port), "--decode", procs["d0"].url,
                        "--health-check-interval", "0"], logs)
        try:
            r.wait_ready()
            yield procs, r
        finally:
            r.stop()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route,body", ROUTES)
async def test_the_router_sends_one_scalar_room_per_sample(standins, route, body, stream):
    procs, r = standins
    for p in procs.values():
        p.reset()
    before = metric(r, "pdserve_router_requests_total", endpoint=route, status="200")
    await ask(r.url, route, dict(with_n(route, dict(body), N, 1.0), stream=stream))
    # one request for the client, and in the router's counts, whatever its samples
    await async_wait_until(lambda: metric(r, "pdserve_router_requests_total", endpoint=route, status="200")
                           == before + 1, 10, what="the request counted once")
    pre, dec = procs["p0"].state()["requests"], procs["d0"].state()["requests"]
    assert len(pre) == len(dec) == N
    assert all(q["count"] == 1 and isinstance(q["rooms"], int) and isinstance(q["rid"], str) for q in pre + dec)
    assert sorted(q["rooms"] for q in pre) == sorted(q["rooms"] for q in dec)
    assert len({q["rooms"] for q in pre}) == N and len({q["rid"] for q in pre}) == N


async def test_a_client_leaving_a_stream_aborts_every_sample(standins):
    procs, r = standins
    for p in procs.values():
        p.reset()
    procs["d0"].control(token_interval=0.05)
    body = {"text": "x", "sampling_params": {"max_new_tokens": 400, "n": N}, "stream": True}
    async with httpx.AsyncClient(timeout=30) as c:
        async with c.stream("POST", r.url + "/generate", json=body) as resp:
            seen = 0
            async for line in resp.aiter_lines():
                seen += line.startswith("data: {")
                if seen == 3 * N:
                    break
    rids = {q["rid"] for q in procs["d0"].state()["requests"]}
    assert len(rids) == N

    async def all_aborted() -> bool:
        st = await asyncio.to_thread(procs["d0"].state)
        return st["live"] == [] and rids <= set(st["aborts"])

    await async_wait_until(all_aborted, 15, what="every sample's rid aborted on the decode")
    procs["d0"].control(token_interval=0)


@pytest.mark.parametrize("route,body,fanned", [
    ("/generate", {"text": ["a", "b"], "sampling_params": [{"n": 2}, {"n": 2}]}, True),
    ("/generate", {"text": ["a", "b"], "sampling_params": [{"n": 1}, {"n": 2}]}, False),  # the engine's 400
    ("/generate", {"text": "a", "sampling_params": {"n": "2"}}, False),  # strict int, as SGLang checks it
    ("/generate", {"text": "a", "sampling_params": {"n": 1}}, False),
    ("/v1/completions", {"prompt": "a", "n": "2"}, True),  # the OpenAI models coerce it
    ("/v1/chat/completions", {"messages": [], "n": True}, False),
])
def test_only_an_n_the_engines_accept_is_fanned_out(route, body, fanned):
    assert fanout.applies(route, body, request_shape(route, body)) is fanned


def test_an_openai_seed_given_as_text_still_differs_per_sample():
    subs = fanout.split("/v1/completions", {"prompt": "a", "n": 3, "seed": " 7"},
                        request_shape("/v1/completions", {"prompt": "a", "n": 3}))
    assert [sub["seed"] for sub in subs] == [7, 8, 9]
    gen = {"text": "a", "sampling_params": {"n": 2, "sampling_seed": "7"}}  # strict there: the engine's 400
    subs = fanout.split("/generate", gen, request_shape("/generate", gen))
    assert [sub["sampling_params"]["sampling_seed"] for sub in subs] == ["7"] * 2
