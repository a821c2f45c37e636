"""The router against stand-in engines (tests/standin_engine.py) that fail on command: request
shapes (rooms, ids), failures (errors, aborted rooms, disconnects, drops, stalls), retries, circuit
breakers, health checks, timeouts, bad input, keys, request ids, the admin API, policies, metrics.

The stand-ins keep exact records (requests with their rooms and headers, /abort_request calls,
live and aborted sequences), and their decodes wait 20 s for KV that never comes, so a router
that forgets an abort is caught by a time bound. The bounds are generous (PROMPT, SOON) and still
well under those 20 s: a busy 2-core machine does not miss them, a forgotten abort does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engines import ROOT, ManagedProcess, free_port, spawn
from pd.util.wait import async_wait_until, wait_until
from pdclient import parse_sse
from routers import RouterProc

CLIENT_KEY, ADMIN_KEY = "client-secret", "admin-secret"
AUTH = {"Authorization": f"Bearer {CLIENT_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
WAIT = 20  # seconds a stand-in waits for its PD peer; every abort below must land well before
PROMPT = 10  # s: a failure reaches the client within this, not after a stand-in's WAIT
SOON = 5  # s: an abort or a health verdict lands within this (after the answer: still before WAIT)


class StandIn(ManagedProcess):
    def __init__(self, role: str, log_dir: str):
        self.role = role
        self.port = free_port()
        self.bootstrap_port = free_port() if role == "prefill" else None
        self.log_path = os.path.join(log_dir, f"standin-{role}-{self.port}.log")
        args = [sys.executable, os.path.join(ROOT, "tests", "standin_engine.py"), "--role", role, "--port",
                str(self.port), "--bootstrap-timeout", str(WAIT), "--waiting-timeout", str(WAIT)]
        if self.bootstrap_port:
            args += ["--bootstrap-port", str(self.bootstrap_port)]
        self.proc = spawn(args, self.log_path)

    def control(self, **kw) -> None:
        httpx.post(self.url + "/control", json=kw, timeout=5).raise_for_status()

    def fault(self, kind: str, **kw) -> None:
        self.control(faults=[dict(kind=kind, **kw)])

    def state(self) -> dict:
        return httpx.get(self.url + "/control", timeout=5).json()

    def reset(self) -> None:
        httpx.post(self.url + "/control/reset", timeout=5).raise_for_status()


def wait_up(procs, timeout: float = 30) -> None:
    """Wait until every stand-in answers /health (200 or 503), all within one ``timeout`` (s)."""
    pending = list(procs)

    def all_up() -> bool:
        for p in list(pending):
            if p.proc.poll() is not None:
                raise RuntimeError(f"{p.log_path} exited:\n{p.log()[-2000:]}")
            try:
                if httpx.get(p.url + "/health", timeout=1).status_code in (200, 503):
                    pending.remove(p)
            except httpx.HTTPError:
                pass
        return not pending

    try:
        wait_until(all_up, timeout, interval=0.1, what="every stand-in answering /health", retry=())
    except TimeoutError as e:
        raise TimeoutError(f"{e}: {[p.log_path for p in pending]} not up") from e


@contextlib.contextmanager
def running_standins(logs: str, *names: str):
    """Stand-ins named ``p*`` (prefill) or ``d*`` (decode), up on /health; all stopped on the way out."""
    procs: dict[str, StandIn] = {}
    try:
        for name in names:
            procs[name] = StandIn("prefill" if name.startswith("p") else "decode", logs)
        wait_up(procs.values())
        yield procs
    finally:
        for p in procs.values():
            p.stop()


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return str(tmp_path_factory.mktemp("fault-logs"))


@pytest.fixture(scope="module")
def si(logs):
    """Two stand-in prefills (p0, p1) and decodes (d0, d1), shared by the module."""
    with running_standins(logs, "p0", "p1", "d0", "d1") as procs:
        yield procs


@pytest.fixture(autouse=True)
def fresh_standins(request):
    if "si" in request.fixturenames:
        for p in request.getfixturevalue("si").values():
            p.reset()


def workers(si, prefill=("p0", "p1"), decode=("d0", "d1")) -> list[str]:
    args = []
    for name in prefill:
        args += ["--prefill", si[name].url, str(si[name].bootstrap_port)]
    for name in decode:
        args += ["--decode", si[name].url]
    return args


ROUTER_FLAGS = {
    # 2 x 2, default retries (5 attempts, fast backoff), keys, a small body limit
    "main": (("p0", "p1"), ("d0", "d1"), ["--api-key", CLIENT_KEY, "--admin-api-key", ADMIN_KEY,
                                         "--max-payload-size", "65536", "--retry-initial-backoff-ms", "10",
                                         "--health-check-interval-secs", "0"]),
    # 1 x 1, no retries: failures reach the client as they happened
    "single": (("p0",), ("d0",), ["--disable-retries", "--health-check-interval-secs", "0"]),
    # stage timeouts long enough that a busy machine's normal requests stay within them
    "timeouts": (("p0",), ("d0",), ["--disable-retries", "--health-check-interval-secs", "0",
                                    "--prefill-timeout-secs", "1.5", "--first-token-timeout-secs", "3",
                                    "--stream-idle-timeout-secs", "1"]),
    # a short first-token timeout, a request timeout a little longer, default retries, and a circuit breaker
    # that a single counted failure opens (the only decode's)
    "long_answers": (("p0",), ("d0",), ["--health-check-interval-secs", "0", "--retry-initial-backoff-ms", "10",
                                        "--first-token-timeout-secs", "1.5", "--request-timeout-secs", "6",
                                        "--cb-failure-threshold", "1"]),
    # a short body-read timeout
    "slow_body": (("p0",), ("d0",), ["--disable-retries", "--health-check-interval-secs", "0",
                                     "--body-read-timeout-secs", "1"]),
    # the default 30 s body timeout, a minimum body rate of 100 bytes/s after 1 s
    "slow_rate": (("p0",), ("d0",), ["--disable-retries", "--health-check-interval-secs", "0",
                                     "--body-read-timeout-secs", "30", "--body-read-grace-secs", "1",
                                     "--body-read-min-rate", "100"]),
    "breaker": (("p0",), ("d0", "d1"), ["--disable-retries", "--health-check-interval-secs", "0",
                                        "--cb-failure-threshold", "2", "--cb-success-threshold", "1",
                                        "--cb-timeout-duration-secs", "5"]),
    "health": (("p0",), ("d0", "d1"), ["--disable-retries", "--health-check-interval-secs", "0.1",
                                       "--health-failure-threshold", "2", "--health-success-threshold", "2",
                                       "--health-check-timeout-secs", "5"]),
    "policies": (("p0", "p1"), ("d0", "d1"), ["--disable-retries", "--health-check-interval-secs", "0",
                                              "--prefill-policy", "cache_aware", "--decode-policy", "least_load"]),
    # small admission caps; default retries, so a refusal that reached a worker would show as retries
    "caps": (("p0",), ("d0",), ["--health-check-interval-secs", "0", "--retry-initial-backoff-ms", "10",
                                "--max-n", "4", "--max-batch-size", "8", "--max-sequences-per-request", "16"]),
}


@pytest.fixture(scope="module")
def routers(si, logs):
    started: dict[str, RouterProc] = {}

    def get(name: str) -> RouterProc:
        if name not in started:
            pre, dec, flags = ROUTER_FLAGS[name]
            started[name] = RouterProc(workers(si, pre, dec) + flags, logs)
            started[name].wait_ready()
        return started[name]

    try:
        yield get
    finally:
        for r in started.values():
            r.stop()


def metrics(router) -> dict:
    out = {}
    for fam in text_string_to_metric_families(httpx.get(router.url + "/metrics", timeout=10).text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric(router, name: str, **labels) -> float:
    return sum(v for (n, lab), v in metrics(router).items() if n == name and all(dict(lab).get(k) == w
                                                                                  for k, w in labels.items()))


async def until(cond, timeout: float = SOON, what: str = "condition"):
    """Poll ``cond()`` every 50 ms until true; ``TimeoutError`` naming ``what`` after ``timeout`` s."""
    return await async_wait_until(cond, timeout, interval=0.05, what=what, retry=())


def gen(n_items: int | None = None, tokens: int = 3, **kw) -> dict:
    text = [f"p{i}" + "x" * i for i in range(n_items)] if n_items else "hello"
    return {"text": text, "sampling_params": {"max_new_tokens": tokens}, **kw}


async def call(router, route: str, body: dict, headers=None, timeout: float = 30) -> httpx.Response:
    async with httpx.AsyncClient(timeout=timeout) as c:
        return await c.post(router.url + route, json=body, headers=headers)


# ---- request shapes ------------------------------------------------------------------------------
SHAPES = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 3, "max_tokens": 2}, 3),
    ("/v1/completions", {"prompt": ["a", "bb"], "n": 3, "max_tokens": 2}, 6),
    ("/v1/completions", {"prompt": [[1, 2], [3]], "max_tokens": 2}, 2),
    ("/generate", gen(33), 33),
    ("/generate", {"input_ids": [[i] * (i + 1) for i in range(33)], "sampling_params": {"max_new_tokens": 2}}, 33),
    ("/generate", {"text": "one", "sampling_params": {"max_new_tokens": 2, "n": 2}}, 2),
]


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
async def test_one_room_per_sequence_same_on_both_sides(si, routers, stream):
    r = routers("main")
    for route, body, count in SHAPES:
        for p in si.values():
            p.reset()
        resp = await call(r, route, dict(body, stream=stream), AUTH)
        assert resp.status_code == 200, resp.text
        # n > 1 is fanned out: one request per sample, each with n 1 and its own rooms (pd.router.fanout)
        n = body.get("n") or body.get("sampling_params", {}).get("n", 1)
        pre = [(q, si[name]) for name in ("p0", "p1") for q in si[name].state()["requests"]]
        dec = {str(q["rid"]): q for name in ("d0", "d1") for q in si[name].state()["requests"]}
        assert len(pre) == len(dec) == n, route
        rooms = []
        for p, prefill in pre:
            d = dec[str(p["rid"])]
            assert d["rooms"] == p["rooms"] and p["count"] == count // n, route
            rooms += p["rooms"] if isinstance(p["rooms"], list) else [p["rooms"]]
            ports = p["ports"] if isinstance(p["ports"], list) else [p["ports"]]
            assert set(ports) == {prefill.bootstrap_port} and len(ports) == count // n
        assert len(rooms) == count and len(set(rooms)) == count, route
        answer = parse_sse(resp.content) if stream else resp.json()
        if route == "/generate":
            items = [c for c in answer[:-1] if c["meta_info"]["finish_reason"]] if stream else answer
            if stream:
                items.sort(key=lambda c: c["index"])
                assert [c["index"] for c in items] == list(range(count))
            prompts = body.get("text") or body.get("input_ids")
            if isinstance(prompts, list):  # results in input order
                assert [i["meta_info"]["prompt_tokens"] for i in items] == [
                    len(x) if isinstance(x, list) else len(x.encode()) for x in prompts]
        else:
            idx = sorted({ch["index"] for c in answer[:-1] for ch in c["choices"]}) if stream else \
                [c["index"] for c in answer["choices"]]
            assert idx == list(range(count)), route


# ---- failures ----------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
async def test_prefill_error_reaches_client_and_decode_is_aborted(si, routers, stream):
    r = routers("single")
    si["p0"].fault("status", status=400, message="The input (9000 tokens) is longer than the model's context length")
    t0 = time.monotonic()
    resp = await call(r, "/generate", gen(stream=stream))
    assert time.monotonic() - t0 < PROMPT  # not after the decode's WAIT
    assert resp.status_code == 400 and "longer than the model's context length" in resp.json()["error"]["message"]
    rid = si["d0"].state()["requests"][0]["rid"]
    await until(lambda: si["d0"].state()["live"] == [], what="decode released")
    st = si["d0"].state()
    assert rid in st["aborts"] and rid in st["aborted"]


async def test_prefill_aborting_some_rooms_aborts_just_those_on_decode(si, routers):
    r = routers("single")
    si["p0"].fault("abort_rooms")
    t0 = time.monotonic()
    resp = await call(r, "/generate", gen(6))
    assert time.monotonic() - t0 < PROMPT  # not the decode's 20 s waiting timeout
    assert resp.status_code == 200
    finish = [i["meta_info"]["finish_reason"]["type"] for i in resp.json()]
    assert finish == ["length", "abort"] * 3
    rids = si["d0"].state()["requests"][0]["rid"]
    assert sorted(si["d0"].state()["aborts"]) == [rids[i] for i in (1, 3, 5)]
    # the OpenAI shape: choices with finish_reason "abort"
    for p in si.values():
        p.reset()
    si["p0"].fault("abort_rooms")
    resp = await call(r, "/v1/completions", {"prompt": ["w", "x", "y", "z"], "max_tokens": 2})
    assert [c["finish_reason"] for c in resp.json()["choices"]] == ["length", "abort"] * 2
    rids = si["d0"].state()["requests"][0]["rid"]
    assert sorted(si["d0"].state()["aborts"]) == [rids[1], rids[3]]


@pytest.mark.parametrize("stream", [False, True])
async def test_decode_aborting_its_room_aborts_the_prefill(si, routers, stream):
    r = routers("single")
    si["d0"].fault("stall")  # the decode never asks for the KV; the prefill waits for it
    held = asyncio.create_task(call(r, "/generate", gen(stream=stream)))
    await until(lambda: si["p0"].state()["live"] != [] and si["d0"].state()["live"] != [], what="both busy")
    await asyncio.to_thread(httpx.post, si["d0"].url + "/abort_request", json={"abort_all": True})
    resp = await held
    assert resp.status_code == 200
    rid = si["p0"].state()["requests"][0]["rid"]
    await until(lambda: si["p0"].state()["live"] == [], what="prefill released, not after its 20 s timeout")
    assert rid in si["p0"].state()["aborts"]


async def test_client_disconnect_mid_stream_aborts_the_decode(si, routers):
    r = routers("single")
    si["d0"].control(token_interval=0.05)
    async with httpx.AsyncClient(timeout=10) as c:
        async with c.stream("POST", r.url + "/generate", json=gen(tokens=400, stream=True)) as resp:
            seen = 0
            async for line in resp.aiter_lines():
                seen += line.startswith("data: {")
                if seen == 3:
                    break
    rid = si["d0"].state()["requests"][0]["rid"]
    await until(lambda: si["d0"].state()["live"] == [], what="decode released")
    st = si["d0"].state()
    assert rid in st["aborted"] and rid in st["aborts"]
    assert si["p0"].state()["finished"] == 1 and si["p0"].state()["aborted"] == []  # its part was done
    await until(lambda: metric(r, "pdserve_router_requests_in_flight") == 0, what="router in-flight 0")


async def test_a_client_rid_cannot_abort_other_clients(si, routers):
    """Two clients send ``"rid": "p"`` and disconnect after one chunk; the stand-in aborts by SGLang's rule (exact
    id, then every id with that prefix, and every router id starts with "p"). The router owns the engine-side
    ids, so the disconnects abort the two attackers' own sequences and none of the five other streams."""
    r = routers("single")
    si["d0"].control(token_interval=0.05)
    async with httpx.AsyncClient(timeout=30) as c:
        victims = [asyncio.create_task(c.post(r.url + "/generate", json=gen(tokens=40, stream=True)))
                   for _ in range(5)]
        await until(lambda: len(si["d0"].state()["live"]) == 5, what="five streams live on the decode")
        for _ in range(2):
            async with c.stream("POST", r.url + "/generate", json=gen(tokens=400, stream=True, rid="p")) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        break
        await until(lambda: len(si["d0"].state()["aborts"]) >= 2, what="the attackers' aborts")
        done = await asyncio.gather(*victims)
    st = si["d0"].state()
    assert "p" not in st["aborts"] and all(a.startswith("pdr-") for a in st["aborts"]), st["aborts"]
    for resp in done:
        final = [e for e in parse_sse(resp.content) if isinstance(e, dict)][-1]
        assert final["meta_info"]["finish_reason"]["type"] == "length", final
        assert final["meta_info"]["completion_tokens"] == 40
    assert len(st["aborted"]) == 2  # the attackers' own sequences only


async def test_an_incomplete_body_gets_408_at_the_body_timeout(si, routers):
    """A client that declares 100 bytes and sends 9 holds nothing past --body-read-timeout-secs: a 408 with the
    request id, counted, and no engine touched."""
    r = routers("slow_body")
    reader, writer = await asyncio.open_connection("127.0.0.1", r.port)
    try:
        writer.write(b"POST /generate HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"text\": ")
        await writer.drain()
        t0 = time.monotonic()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)
        elapsed = time.monotonic() - t0
    finally:
        writer.close()
    assert head.startswith(b"HTTP/1.1 408"), head
    assert b"x-request-id: " in head.lower()
    assert 0.9 <= elapsed < 30, elapsed  # the 1 s timeout, not the client's patience
    assert si["p0"].state()["requests"] == [] and si["d0"].state()["requests"] == []
    assert metric(r, "pdserve_router_errors_total", endpoint="/generate", kind="body_timeout") == 1


async def send_slowly(writer: asyncio.StreamWriter, body: bytes, piece: int, every: float) -> None:
    """Write ``body`` ``piece`` bytes at a time, one piece every ``every`` s, until done or the router hangs up."""
    try:
        for i in range(0, len(body), piece):
            writer.write(body[i:i + piece])
            await writer.drain()
            await asyncio.sleep(every)  # the client's pace, not a wait for a state
    except ConnectionError:
        pass


async def post_slowly(router, body: bytes, piece: int, every: float) -> tuple[bytes, float]:
    """POST /generate with ``body`` sent at a pace; returns the response head and the seconds until it came."""
    reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
    sender = None
    try:
        writer.write(b"POST /generate HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body))
        await writer.drain()
        t0 = time.monotonic()
        sender = asyncio.create_task(send_slowly(writer, body, piece, every))
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)
        elapsed = time.monotonic() - t0
        rest = await asyncio.wait_for(reader.read(65536), 10)
    finally:
        if sender is not None:
            sender.cancel()
        writer.close()
    return head + rest, elapsed


async def test_a_trickled_body_gets_408_at_the_minimum_rate(si, routers):
    """A client sending 2,000 bytes at 25 bytes/s is cut off once it falls below --body-read-min-rate (100 bytes/s
    after the 1 s grace: about 1.3 s in), not at the 30 s --body-read-timeout-secs; no engine is touched."""
    r = routers("slow_rate")
    body = json.dumps(dict(gen(), text="x" * 1900)).encode()
    answer, elapsed = await post_slowly(r, body, piece=5, every=0.2)
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b"--body-read-min-rate" in answer and b"x-request-id: " in answer.lower(), answer
    assert 1.0 <= elapsed < 15, elapsed  # the rate rule, not the 30 s timeout
    assert si["p0"].state()["requests"] == [] and si["d0"].state()["requests"] == []
    assert metric(r, "pdserve_router_errors_total", endpoint="/generate", kind="body_timeout") == 1


async def test_a_body_in_pieces_above_the_minimum_rate_is_served(si, routers):
    """The rate rule does not cut off a client that sends its body in several pieces at a normal pace."""
    r = routers("slow_rate")
    body = json.dumps(dict(gen(), text="y" * 1900)).encode()
    answer, _ = await post_slowly(r, body, piece=500, every=0.3)  # ~1,700 bytes/s
    assert answer.startswith(b"HTTP/1.1 200"), answer


async def test_client_disconnect_before_the_answer_aborts_both_sides(si, routers):
    r = routers("single")
    si["p0"].fault("stall")
    with pytest.raises(httpx.ReadTimeout):  # the client leaves; by then both sides have the request
        await call(r, "/generate", gen(), timeout=2)
    rid = si["d0"].state()["requests"][0]["rid"]
    await until(lambda: si["p0"].state()["live"] == [] and si["d0"].state()["live"] == [], what="both released")
    assert rid in si["p0"].state()["aborts"] and rid in si["d0"].state()["aborts"]
    assert metric(r, "pdserve_router_errors_total", endpoint="/generate", kind="client_disconnect") >= 1


async def test_200_concurrent_streams_abort_no_room(si, routers):
    r = routers("main")
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=200)) as c:
        rs = await asyncio.gather(*(c.post(r.url + "/generate", json=gen(tokens=4, stream=True), headers=AUTH)
                                    for _ in range(200)))
    assert [x.status_code for x in rs] == [200] * 200
    assert all(parse_sse(x.content)[-1] == "[DONE]" for x in rs)
    states = {n: p.state() for n, p in si.items()}
    assert all(s["aborted"] == [] and s["aborts"] == [] for s in states.values()), states
    assert sum(s["finished"] for s in states.values()) == 400  # 200 prefill + 200 decode sequences


async def test_retry_on_a_fresh_pair_before_the_first_byte(si, routers):
    r = routers("main")
    before = metric(r, "pdserve_router_retries_total", endpoint="/generate")
    si["p0"].fault("status", status=503)
    si["p1"].fault("status", status=503)
    resp = await call(r, "/generate", gen(), {**AUTH, "X-Request-Id": "trace-42"})
    assert resp.status_code == 200 and resp.headers["x-request-id"] == "trace-42"
    assert metric(r, "pdserve_router_retries_total", endpoint="/generate") - before == 2
    pre = si["p0"].state()["requests"] + si["p1"].state()["requests"]
    dec = si["d0"].state()["requests"] + si["d1"].state()["requests"]
    assert len(pre) == len(dec) == 3
    assert len({q["rooms"] for q in pre}) == 3 and len({q["rid"] for q in pre}) == 3  # fresh rooms and ids
    assert {q["x_request_id"] for q in pre + dec} == {"trace-42"}
    assert si["p0"].state()["requests"] and si["p1"].state()["requests"]  # round-robin: a fresh prefill each time
    # the decode sides of the two failed attempts were aborted, the third finished
    ok_rid = resp.json()["meta_info"]["id"]
    aborted = si["d0"].state()["aborts"] + si["d1"].state()["aborts"]
    assert sorted(aborted) == sorted(q["rid"] for q in dec if q["rid"] != ok_rid)
    await until(lambda: not si["d0"].state()["live"] and not si["d1"].state()["live"], what="decodes idle")


async def test_retry_when_a_stream_starts_with_an_error(si, routers):
    r = routers("main")
    si["d0"].fault("stream_error_first")
    si["d1"].fault("stream_error_first")
    resp = await call(r, "/generate", gen(tokens=3, stream=True), AUTH)
    chunks = parse_sse(resp.content)
    assert resp.status_code == 200 and chunks[-1] == "[DONE]"
    assert not any("error" in c for c in chunks[:-1])
    assert len(chunks[-2]["output_ids"]) == 3


async def test_no_retry_once_the_first_byte_was_sent(si, routers):
    r = routers("main")
    before = metric(r, "pdserve_router_retries_total", endpoint="/generate")
    broken = metric(r, "pdserve_router_errors_total", endpoint="/generate", kind="decode_stream")
    for d in ("d0", "d1"):  # slow events: the first one reaches the client before the drop
        si[d].control(token_interval=0.5, faults=[{"kind": "drop_mid_stream", "after": 2}])
    resp = await call(r, "/generate", gen(tokens=6, stream=True), AUTH)
    chunks = parse_sse(resp.content)
    assert resp.status_code == 200 and chunks[-1] == "[DONE]"
    assert [("error" in c) for c in chunks[:-1]] == [False, False, True]
    assert metric(r, "pdserve_router_retries_total", endpoint="/generate") == before
    assert metric(r, "pdserve_router_errors_total", endpoint="/generate", kind="decode_stream") == broken + 1


async def test_retries_give_up_and_client_errors_are_not_retried(si, routers):
    r = routers("main")
    before = metric(r, "pdserve_router_retries_total", endpoint="/v1/completions")
    si["p0"].fault("status", status=503, count=5)
    si["p1"].fault("status", status=503, count=5)
    resp = await call(r, "/v1/completions", {"prompt": "x", "max_tokens": 2}, AUTH)
    assert resp.status_code == 503 and "stand-in fault 503" in resp.json()["error"]["message"]
    assert metric(r, "pdserve_router_retries_total", endpoint="/v1/completions") - before == 4  # 5 attempts
    si["p0"].control(clear_faults=True)
    si["p1"].control(clear_faults=True)
    si["p0"].fault("status", status=400, message="bad prompt")
    si["p1"].fault("status", status=400, message="bad prompt")
    resp = await call(r, "/v1/completions", {"prompt": "x", "max_tokens": 2}, AUTH)
    retries = metric(r, "pdserve_router_retries_total", endpoint="/v1/completions") - before
    assert resp.status_code == 400 and retries == 4


async def test_dropped_decode_connection_is_retried(si, routers):
    r = routers("main")
    si["d0"].fault("drop")
    si["d1"].fault("drop")
    resp = await call(r, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
                      AUTH)
    assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"] == " t t"
    await until(lambda: not si["p0"].state()["live"] and not si["p1"].state()["live"], what="prefills released")


async def test_circuit_breaker_opens_and_recovers(si, routers):
    r = routers("breaker")
    d0 = si["d0"].url
    si["d0"].fault("status", status=500, count=2)
    t0 = time.monotonic()  # before the circuit opens
    codes = [(await call(r, "/generate", gen())).status_code for _ in range(4)]  # round-robin d0, d1, d0, d1
    assert sorted(codes) == [200, 200, 500, 500]
    assert metric(r, "pdserve_router_worker_circuit_state", worker=d0) == 2
    n0 = len(si["d0"].state()["requests"])
    assert [(await call(r, "/generate", gen())).status_code for _ in range(4)] == [200] * 4
    assert len(si["d0"].state()["requests"]) == n0  # no request reached the open circuit
    workers_ = httpx.get(r.url + "/workers", timeout=5).json()["workers"]
    assert {w["url"]: w["circuit"] for w in workers_}[d0] == "open"
    # The circuit turns half-open only when a request asks for a worker after the open timeout
    # (5 s: the requests above must all be answered before it, on a loaded machine too), so the router's
    # state shows nothing until then: send requests until one reaches d0.
    # Until then they all go to d1; that trial request succeeds, which closes the circuit.
    reached: list[float] = []

    async def trial_reached_d0() -> bool:
        assert (await call(r, "/generate", gen())).status_code == 200
        reached.append(time.monotonic())  # after the router chose a decode for it
        return len(si["d0"].state()["requests"]) > n0

    await async_wait_until(trial_reached_d0, 30, interval=0.2, what="a trial request reaching d0", retry=())
    assert reached[-1] - t0 >= 5.0  # not before the open timeout
    assert len(si["d0"].state()["requests"]) == n0 + 1
    assert metric(r, "pdserve_router_worker_circuit_state", worker=d0) == 0
    for _ in range(2):  # closed: round-robin over both again
        assert (await call(r, "/generate", gen())).status_code == 200
    assert len(si["d0"].state()["requests"]) == n0 + 2


async def test_health_checks_take_a_worker_out_and_put_it_back(si, routers):
    r = routers("health")
    d0 = si["d0"].url
    si["d0"].control(health=503)
    await until(lambda: metric(r, "pdserve_router_worker_healthy", worker=d0) == 0, what="d0 taken out")
    n0 = len(si["d0"].state()["requests"])
    assert [(await call(r, "/generate", gen())).status_code for _ in range(4)] == [200] * 4
    assert len(si["d0"].state()["requests"]) == n0
    si["d0"].control(health=200)
    await until(lambda: metric(r, "pdserve_router_worker_healthy", worker=d0) == 1, what="d0 back")
    for _ in range(4):
        assert (await call(r, "/generate", gen())).status_code == 200
    assert len(si["d0"].state()["requests"]) == n0 + 2


@pytest.mark.slow
async def test_per_stage_timeouts(si, routers):
    r = routers("timeouts")
    # prefill: no answer within timeouts.prefill (1.5 s) -> 504, decode aborted; the stall itself
    # lasts until the client's 30 s timeout
    si["p0"].fault("stall")
    t0 = time.monotonic()
    resp = await call(r, "/generate", gen())
    assert resp.status_code == 504 and "timeouts.prefill" in resp.json()["error"]["message"]
    assert 1.4 < time.monotonic() - t0 < 6
    await until(lambda: not si["p0"].state()["live"] and not si["d0"].state()["live"], what="both released")
    # first token: a stream's decode silent past timeouts.first_token (3 s) -> 504, both sides aborted;
    # the delay itself is 30 s (a non-stream answer: test_a_long_non_stream_answer_...)
    si["d0"].fault("delay", seconds=30)
    t0 = time.monotonic()
    resp = await call(r, "/generate", gen(stream=True))
    assert resp.status_code == 504 and "timeouts.first_token" in resp.json()["error"]["message"]
    assert 2.9 < time.monotonic() - t0 < 10
    await until(lambda: not si["d0"].state()["live"], what="decode released")
    # inside a stream: silence past timeouts.stream_idle (1 s) -> error chunk and [DONE]
    si["d0"].control(token_interval=3.0)
    resp = await call(r, "/generate", gen(tokens=5, stream=True))
    chunks = parse_sse(resp.content)
    assert chunks[-1] == "[DONE]" and "timeouts.stream_idle" in chunks[-2]["error"]["message"]
    await until(lambda: not si["d0"].state()["live"], what="decode released")
    timeouts = sum(metric(r, "pdserve_router_errors_total", endpoint="/generate", kind=k)
                   for k in ("prefill_timeout", "decode_timeout"))
    assert timeouts == 3


@pytest.mark.slow
async def test_a_long_non_stream_answer_is_bounded_by_the_request_timeout_only(si, routers):
    """Once the decode accepted a non-stream request (its prefill answered), timeouts.first_token no
    longer applies: the answer may take up to timeouts.request, and passing that is one 504, not retried,
    with the decode's circuit breaker left closed."""
    r = routers("long_answers")
    d0 = si["d0"].url
    retries0 = metric(r, "pdserve_router_retries_total", endpoint="/generate")
    # past timeouts.first_token (1.5 s), within timeouts.request (6 s): served by the first attempt
    si["d0"].fault("delay", seconds=3.5)
    t0 = time.monotonic()
    resp = await call(r, "/generate", gen())
    assert resp.status_code == 200, resp.text
    assert len(si["p0"].state()["requests"]) == 1 and len(si["d0"].state()["requests"]) == 1  # one attempt
    assert resp.json()["meta_info"]["completion_tokens"] == 3
    assert time.monotonic() - t0 >= 3.4  # the delayed answer itself, not a retry's
    assert metric(r, "pdserve_router_retries_total", endpoint="/generate") == retries0
    assert metric(r, "pdserve_router_worker_circuit_state", worker=d0) == 0
    # past timeouts.request: a 504 naming it, one attempt, the decode aborted, the breaker still closed
    si["d0"].fault("delay", seconds=60)
    t0 = time.monotonic()
    resp = await call(r, "/generate", gen())
    elapsed = time.monotonic() - t0
    assert resp.status_code == 504, resp.text
    assert "timeouts.request" in resp.json()["error"]["message"]
    assert 5.9 < elapsed < 15
    assert len(si["p0"].state()["requests"]) == 2 and len(si["d0"].state()["requests"]) == 2
    assert metric(r, "pdserve_router_retries_total", endpoint="/generate") == retries0
    assert metric(r, "pdserve_router_worker_circuit_state", worker=d0) == 0
    await until(lambda: not si["d0"].state()["live"], what="decode released")
    assert metric(r, "pdserve_router_errors_total", endpoint="/generate", kind="decode_timeout") == 1
    # the router still serves with its only decode
    assert (await call(r, "/generate", gen())).status_code == 200


# ---- bad input, keys, request ids, metrics -------------------------------------------------------
async def test_bad_input_gets_4xx_and_the_router_keeps_serving(si, routers):
    r = routers("main")
    async with httpx.AsyncClient(timeout=10, base_url=r.url, headers=AUTH) as c:
        resp = await c.post("/generate", content=b'{"text": ', headers={"content-type": "application/json"})
        assert resp.status_code == 400 and "malformed JSON" in resp.json()["error"]["message"]
        resp = await c.post("/v1/completions", json=[1, 2])
        assert resp.status_code == 400 and "JSON object" in resp.json()["error"]["message"]
        resp = await c.post("/generate", json={"text": "x" * 70000})
        assert resp.status_code == 413 and "65536" in resp.json()["error"]["message"]

        async def chunked():
            for _ in range(20):
                yield b"x" * 4096

        resp = await c.post("/generate", content=chunked())  # no Content-Length
        assert resp.status_code == 413
        resp = await c.post("/nope", json={})
        assert resp.status_code == 404 and "no route POST /nope" in resp.json()["error"]["message"]
        resp = await c.get("/generate")
        assert resp.status_code == 405
        resp = await c.post("/generate", json=gen())
        assert resp.status_code == 200
    assert sum(len(p.state()["requests"]) for p in si.values()) == 2  # only the good one reached workers
    assert metric(r, "pdserve_router_errors_total", endpoint="/generate", kind="payload_too_large") >= 2
    assert metric(r, "pdserve_router_errors_total", endpoint="/generate", kind="invalid_request") >= 1


async def test_requests_over_the_caps_get_400_and_touch_no_engine(si, routers):
    r = routers("caps")
    over = [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 10000, "max_tokens": 2},
         "n = 10000 is over the router's limit of 4 (--max-n)", "n"),
        ("/generate", {"text": "hi", "sampling_params": [{"max_new_tokens": 2, "n": 5}]},
         "sampling_params.n = 5 is over the router's limit of 4 (--max-n)", "sampling_params.n"),
        ("/v1/completions", {"prompt": ["a"] * 9, "max_tokens": 2},
         "a batch of 9 prompts is over the router's limit of 8 (--max-batch-size)", None),
        ("/generate", {"text": ["a"] * 5, "sampling_params": {"max_new_tokens": 2, "n": 4}, "stream": True},
         "over the router's limit of 16 (--max-sequences-per-request)", None),
    ]
    before = metric(r, "pdserve_router_errors_total", kind="over_limit")
    for route, body, message, param in over:
        resp = await call(r, route, body, {"X-Request-Id": "caps-1"})
        assert resp.status_code == 400, (route, resp.text)
        assert resp.headers["x-request-id"] == "caps-1"
        error = resp.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert message in error["message"] and error["param"] == param
        assert error["type"] == "BadRequestError" and error["code"] == 400
    assert metric(r, "pdserve_router_errors_total", kind="over_limit") - before == len(over)
    assert metric(r, "pdserve_router_requests_total", endpoint="/generate", status="400") >= 2
    for p in si.values():  # not one request or abort reached a stand-in, on any attempt
        assert p.state()["requests"] == [] and p.state()["aborts"] == []
    # at the caps: served
    resp = await call(r, "/generate", {"text": ["a"] * 4, "sampling_params": {"max_new_tokens": 2, "n": 4}})
    assert resp.status_code == 200 and len(resp.json()) == 16
    assert [len(q["rooms"]) for q in si["d0"].state()["requests"]] == [4] * 4  # one request per sample


async def test_api_key_request_id_and_token_metrics(si, routers):
    r = routers("main")
    assert (await call(r, "/generate", gen())).status_code == 401
    assert (await call(r, "/generate", gen(), {"Authorization": "Bearer wrong"})).status_code == 401
    async with httpx.AsyncClient(timeout=10) as c:
        assert (await c.get(r.url + "/v1/models")).status_code == 401
        assert (await c.get(r.url + "/v1/models", headers=AUTH)).json()["data"][0]["id"] == "standin"
        assert (await c.get(r.url + "/health")).status_code == 200
        assert (await c.get(r.url + "/metrics")).status_code == 200
    prompt, done = (metric(r, f"pdserve_router_{k}_tokens_total", endpoint="/generate")
                    for k in ("prompt", "completion"))
    resp = await call(r, "/generate", gen(2, tokens=5), AUTH)  # prompts "p0" and "p1x": 2 + 3 tokens
    assert resp.status_code == 200
    rid = resp.headers["x-request-id"]
    assert rid  # generated, and what both workers saw
    seen = [q for p in si.values() for q in p.state()["requests"]]
    assert {q["x_request_id"] for q in seen} == {rid} and {q["authorization"] for q in seen} == {AUTH["Authorization"]}
    assert metric(r, "pdserve_router_prompt_tokens_total", endpoint="/generate") - prompt == 5
    assert metric(r, "pdserve_router_completion_tokens_total", endpoint="/generate") - done == 10
    # a stream without include_usage: the router still counts it, and the client gets no usage chunk
    before = metric(r, "pdserve_router_completion_tokens_total", endpoint="/v1/chat/completions")
    resp = await call(r, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
                                                  "stream": True}, AUTH)
    chunks = parse_sse(resp.content)
    assert chunks[-1] == "[DONE]" and all(c["choices"] for c in chunks[:-1])
    assert metric(r, "pdserve_router_completion_tokens_total", endpoint="/v1/chat/completions") - before == 4


async def test_in_flight_gauge_and_stable_series(si, routers):
    r = routers("main")
    m = metrics(r)
    for ep in ("/generate", "/v1/completions", "/v1/chat/completions"):
        for name in ("pdserve_router_retries_total", "pdserve_router_prompt_tokens_total",
                     "pdserve_router_completion_tokens_total"):
            assert (name, (("endpoint", ep),)) in m
    for name in ("p0", "p1", "d0", "d1"):
        role = "prefill" if name[0] == "p" else "decode"
        lab = (("role", role), ("worker", si[name].url))
        for g in ("pdserve_router_worker_inflight", "pdserve_router_worker_healthy",
                  "pdserve_router_worker_circuit_state"):
            assert (g, lab) in m
        assert ("pdserve_router_policy_decisions_total", (("policy", "round_robin"),) + lab) in m
    si["d0"].fault("stall")
    si["d1"].fault("stall")
    task = asyncio.create_task(call(r, "/generate", gen(), AUTH, timeout=30))  # cancelled below
    await until(lambda: metric(r, "pdserve_router_requests_in_flight") == 1, what="one in flight")
    assert sum(metric(r, "pdserve_router_worker_inflight", worker=si[n].url) for n in ("d0", "d1")) == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await until(lambda: metric(r, "pdserve_router_requests_in_flight") == 0, what="none in flight")


# ---- admin API and policies ---------------------------------------------------------------------
async def test_admin_api_lists_adds_drains_and_removes_workers(si, routers):
    r = routers("main")
    d0, d1 = si["d0"].url, si["d1"].url
    async with httpx.AsyncClient(timeout=10, base_url=r.url) as c:
        unauthorized = await c.get("/workers")
        assert unauthorized.status_code == 401
        assert "pdserve_admin_key_<router port>" in unauthorized.json()["error"]["message"]  # where the key is
        assert (await c.get("/workers", headers=AUTH)).status_code == 401  # the client key is not the admin key
        listed = (await c.get("/workers", headers=ADMIN)).json()
        assert listed["total"] == 4 and listed["stats"] == {"prefill_count": 2, "decode_count": 2}
        resp = await c.post("/workers", json={"url": d0, "worker_type": "decode"}, headers=ADMIN)
        assert resp.status_code == 409
        for bad, why in (("http://user:pw@127.0.0.1:1", "credentials"), ("http://127.0.0.1:1/v1?x=1", "path"),
                         ("http://169.254.169.254:80", "link-local"), ("http://[fe80::1]:80", "link-local"),
                         ("http://0.0.0.0:1", "unspecified")):
            resp = await c.post("/workers", json={"url": bad, "worker_type": "decode"}, headers=ADMIN)
            assert resp.status_code == 400 and why in resp.json()["error"]["message"], (bad, resp.text)
        resp = await c.post("/workers", json={"url": "http://127.0.0.1:1", "worker_type": "router"}, headers=ADMIN)
        assert resp.status_code == 400
        resp = await c.post("/workers", json={"url": "http://127.0.0.1:1", "worker_type": "prefill"}, headers=ADMIN)
        assert resp.status_code == 400 and "bootstrap_port" in resp.json()["error"]["message"]
        for route in ("/workers/drain", "/workers/activate"):  # a bad worker reference is a 4xx that changes nothing
            resp = await c.post(route, json={"timeout_secs": 1}, headers=ADMIN)
            assert resp.status_code == 400 and "url is required" in resp.json()["error"]["message"]
            resp = await c.post(route, json=[d0], headers=ADMIN)
            assert resp.status_code == 400 and "JSON object" in resp.json()["error"]["message"]
            assert (await c.post(route, json={"url": "http://127.0.0.1:1"}, headers=ADMIN)).status_code == 404
        # drain d0 (idle: at once); every request then goes to d1
        resp = await c.post("/workers/drain", json={"url": d0, "timeout_secs": 1}, headers=ADMIN)
        assert resp.json()["drained"] is True and resp.json()["worker"]["state"] == "draining"
        for _ in range(3):
            assert (await c.post("/generate", json=gen(), headers=AUTH)).status_code == 200
        assert si["d0"].state()["requests"] == [] and len(si["d1"].state()["requests"]) == 3
        # draining a busy worker waits for its request, up to timeout_secs
        si["d1"].fault("stall")
        held = asyncio.create_task(c.post("/generate", json=gen(), headers=AUTH, timeout=30))  # aborted below
        await until(lambda: si["d1"].state()["live"] != [], what="d1 busy")
        t0 = time.monotonic()
        resp = await c.post("/workers/drain", json={"url": d1, "timeout_secs": 0.3}, headers=ADMIN)
        assert resp.json()["drained"] is False and resp.json()["worker"]["inflight"] == 1
        assert time.monotonic() - t0 >= 0.3
        resp = await c.post("/generate", json=gen(), headers=AUTH)
        assert resp.status_code == 503 and "draining" in resp.json()["error"]["message"]
        await c.post(si["d1"].url + "/abort_request", json={"abort_all": True})
        assert (await held).status_code == 200
        # put both back; remove d1 for good, then add it again
        for url in (d0, d1):
            assert (await c.post("/workers/activate", json={"url": url}, headers=ADMIN)).status_code == 200
        resp = await c.delete("/workers", params={"url": d1}, headers=ADMIN)
        again = await c.delete("/workers", params={"url": d1}, headers=ADMIN)
        assert resp.status_code == 200 and again.status_code == 404
        assert not any(dict(k[1]).get("worker") == d1 for k in metrics(r))  # its series are gone
        n1 = len(si["d1"].state()["requests"])
        for _ in range(2):
            assert (await c.post("/generate", json=gen(), headers=AUTH)).status_code == 200
        assert len(si["d1"].state()["requests"]) == n1
        resp = await c.post("/workers", json={"url": d1, "worker_type": "decode"}, headers=ADMIN)
        assert resp.status_code == 201
        for _ in range(2):
            assert (await c.post("/generate", json=gen(), headers=AUTH)).status_code == 200
        assert len(si["d1"].state()["requests"]) == n1 + 1
        assert (await c.get("/workers", headers=ADMIN)).json()["total"] == 4


async def test_policies_least_load_decode_and_cache_aware_prefill(si, routers):
    r = routers("policies")
    # least_load: with one request held on a decode, the next ones go to the other
    si["d0"].fault("stall")
    si["d1"].fault("stall")
    held = asyncio.create_task(call(r, "/generate", gen(), timeout=10))
    await until(lambda: si["d0"].state()["live"] or si["d1"].state()["live"], what="one held")
    busy, free = ("d0", "d1") if si["d0"].state()["live"] else ("d1", "d0")
    si[free].control(clear_faults=True)
    for _ in range(4):
        assert (await call(r, "/generate", gen())).status_code == 200
    assert len(si[busy].state()["requests"]) == 1 and len(si[free].state()["requests"]) == 4
    await asyncio.to_thread(httpx.post, si[busy].url + "/abort_request", json={"abort_all": True})
    assert (await held).status_code == 200
    # cache_aware: prompts sharing a long prefix stick to one prefill; a new one goes to the other
    shared = "You are a careful assistant. " * 8
    n = {k: len(si[k].state()["requests"]) for k in ("p0", "p1")}
    for i in range(5):
        assert (await call(r, "/generate", {"text": shared + f"question {i}"})).status_code == 200
    grew = {k: len(si[k].state()["requests"]) - n[k] for k in ("p0", "p1")}
    assert sorted(grew.values()) == [0, 5], grew
    assert (await call(r, "/generate", {"text": "Something else entirely, " * 8})).status_code == 200
    other = min(grew, key=grew.get)
    assert len(si[other].state()["requests"]) - n[other] == 1
    assert metric(r, "pdserve_router_policy_decisions_total", role="prefill", policy="cache_aware") >= 6
    assert metric(r, "pdserve_router_policy_decisions_total", role="decode", policy="least_load") >= 6


@pytest.mark.slow
async def test_launcher_membership_follows_workers_and_drains(si, routers, logs):
    """What pd.launch does through the admin API: swap a worker that came back on other ports,
    drop one that failed for good, put one back after a restart, drain everything on stop."""
    from pd.cluster.membership import Membership
    from pd.router.admin_client import AdminClient

    r = routers("main")
    admin = AdminClient(r.url, ADMIN_KEY)
    said: list[str] = []
    m = Membership(admin, said.append)

    def info(name, proc, state="ready"):
        return {"name": name, "role": proc.role, "state": state, "url": proc.url, "bootstrap_port": proc.bootstrap_port}

    infos = [info("prefill-0", si["p0"]), info("prefill-1", si["p1"]), info("decode-0", si["d0"]),
             info("decode-1", si["d1"])]
    m.seed(infos)
    moved = StandIn("decode", logs)  # decode-1 restarted on other ports
    try:
        wait_up([moved])
        await asyncio.to_thread(m.sync, infos[:3] + [info("decode-1", moved)])
        urls = {w["url"] for w in await asyncio.to_thread(admin.workers)}
        assert si["d1"].url not in urls and moved.url in urls and len(urls) == 4
        for _ in range(4):
            assert (await call(r, "/generate", gen(), AUTH)).status_code == 200
        assert len(moved.state()["requests"]) == 2 and si["d1"].state()["requests"] == []
        # decode-1 failed for good: removed
        await asyncio.to_thread(m.sync, infos[:3] + [info("decode-1", moved, "failed")])
        assert moved.url not in {w["url"] for w in await asyncio.to_thread(admin.workers)}
        # decode-0 restarts on the same ports: kept; once ready again it is put back at once
        await asyncio.to_thread(admin.drain, si["d0"].url, 0)
        await asyncio.to_thread(m.sync, infos[:2] + [info("decode-0", si["d0"], "restarting")])
        await asyncio.to_thread(m.sync, infos[:3])
        d0 = next(w for w in await asyncio.to_thread(admin.workers) if w["url"] == si["d0"].url)
        assert d0["state"] == "available"
        assert any("removed decode-1" in s for s in said) and any("decode-0 is back" in s for s in said)
        # stop: drain waits for the request in flight, up to the timeout
        si["d0"].fault("stall")
        held = asyncio.create_task(call(r, "/generate", gen(), AUTH, timeout=10))
        await until(lambda: si["d0"].state()["live"] != [], what="d0 busy")
        assert await asyncio.to_thread(m.drain_all, 0.3) is False
        resp = await call(r, "/generate", gen(), AUTH)
        assert resp.status_code == 503  # every worker is draining: nothing new starts
        await asyncio.to_thread(httpx.post, si["d0"].url + "/abort_request", json={"abort_all": True})
        assert (await held).status_code == 200
        assert await asyncio.to_thread(m.drain_all, 1.0) is True
    finally:
        moved.stop()
