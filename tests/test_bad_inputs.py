"""Every bad input is a 4xx with an OpenAI-style error body, never retried, and leaves other traffic alone.

The cases are generated from the request schemas (tests/bad_inputs.py, several hundred per target). They go
through a real router over the session's real prefill and decode engines, and straight to the engines,
while good requests run concurrently and must all succeed. Then: no retry (the router's retry counter), no
worker's circuit breaker opened, no KV page or running request left on any engine. A seeded, bounded
hypothesis run over the same schemas checks that no body, bad or good, is a 5xx.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from datetime import timedelta

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from bad_inputs import GOOD, MODELS, ROUTER_OWNED, SURROGATE, Case, all_cases
from engines import async_metric
from pd.engines.sampling import SamplingParams
from pd.router.app import GENERATION_ROUTES
from pd.util.wait import async_wait_until
from routers import pd_router

CASES = all_cases()
CONCURRENCY = 4  # bad requests in flight at once
GOOD_STREAMS = 2  # loops of good requests running meanwhile


@pytest.fixture(scope="module")
def router(engines, tmp_path_factory):
    """A router over the session's prefill and decode engines (health checks off)."""
    pre, dec = engines["prefill"], engines["decode"]
    r = pd_router(pre.url, pre.bootstrap_port, dec.url, str(tmp_path_factory.mktemp("bad-input-router")))
    try:
        r.wait_ready()
        yield r
    finally:
        r.stop()


async def send(client: httpx.AsyncClient, url: str, case: Case) -> httpx.Response:
    headers = {} if case.content_type is None else {"content-type": case.content_type}
    target = url + case.route + (f"?{case.query}" if case.query else "")
    return await client.request(case.method, target, content=case.body, headers=headers)


def problems(case: Case, resp: httpx.Response, from_router: bool) -> list[str]:
    """What is wrong with the answer to a bad request (empty when it is a proper 4xx)."""
    out = []
    if not 400 <= resp.status_code < 500:
        out.append(f"status {resp.status_code}")
    if case.status is not None and resp.status_code != case.status:
        out.append(f"status {resp.status_code}, expected {case.status}")
    try:
        err = resp.json()["error"]
        if not (isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
                and err["code"] == resp.status_code and "param" in err):
            out.append("error body not OpenAI-shaped")
    except (ValueError, KeyError, TypeError):
        out.append("no JSON {'error': {...}} body")
    if from_router and case.route in GENERATION_ROUTES and not resp.headers.get("x-request-id"):
        out.append("no X-Request-Id")
    return [f"{case.name}: {p}: {resp.text[:200]!r}" for p in out]


GOOD_ID = "good-"  # the X-Request-Id prefix of the good requests sent alongside the bad ones


async def good_traffic(url: str, stop: asyncio.Event, outcomes: list) -> None:
    """Good requests on every generation route, streamed and not, until ``stop``; each outcome recorded. Each
    carries an ``X-Request-Id`` starting with GOOD_ID, so the router's retry lines tell them from bad input."""
    async with httpx.AsyncClient(timeout=60) as c:
        i = 0
        while not stop.is_set():
            route = GENERATION_ROUTES[i % len(GENERATION_ROUTES)]
            body = dict(GOOD[route], stream=bool(i // len(GENERATION_ROUTES) % 2))
            i += 1
            try:
                r = await c.post(url + route, json=body, headers={"x-request-id": f"{GOOD_ID}{uuid.uuid4().hex}"})
                outcomes.append((route, r.status_code, r.text[:200]))
            except httpx.HTTPError as e:
                outcomes.append((route, None, repr(e)))


async def run_cases(url: str, cases: list[Case], from_router: bool, good_url: str) -> tuple[list[str], list]:
    """Send ``cases`` to ``url`` (CONCURRENCY at a time) while good requests go to ``good_url``."""
    stop, outcomes, found = asyncio.Event(), [], []
    good = [asyncio.create_task(good_traffic(good_url, stop, outcomes)) for _ in range(GOOD_STREAMS)]
    sem = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(timeout=30) as c:
        async def one(case: Case) -> None:
            async with sem:
                try:
                    found.extend(problems(case, await send(c, url, case), from_router))
                except httpx.HTTPError as e:
                    found.append(f"{case.name}: no answer: {e!r}")

        try:
            await asyncio.gather(*(one(case) for case in cases))
        finally:
            stop.set()
            await asyncio.gather(*good)
    return found, outcomes


def circuits(router) -> list[float]:
    """Every worker's circuit state (0 closed)."""
    return [s.value for fam in text_string_to_metric_families(httpx.get(router.url + "/metrics", timeout=10).text)
            for s in fam.samples if s.name == "pdserve_router_worker_circuit_state"]


def bad_input_retries(router) -> list[str]:
    """The router's retry lines for any request but the good traffic. A good request may be retried when the
    loaded machine outlasts the session engines' short PD timeouts; a bad input never may (a 4xx is final)."""
    lines = [ln for ln in router.log().splitlines() if "; retrying on a fresh pair" in ln]
    return [ln for ln in lines if not re.search(rf"request {GOOD_ID}\S+ attempt", ln)]


async def assert_idle(engines, names=("null", "prefill", "decode")) -> None:
    """Every named engine holds no KV page and runs no request (polled, with a deadline)."""
    held = {}

    async def idle() -> bool:
        for n in names:
            held[n] = (await async_metric(engines[n], "pdserve_kv_pages_held"),
                       await async_metric(engines[n], "sglang:num_running_reqs"))
        return all(v == (0, 0) for v in held.values())

    try:
        await async_wait_until(idle, 10, interval=0.1, what="engines idle", retry=())
    except TimeoutError as e:
        raise AssertionError(f"{e}: {held}") from e


def assert_good(outcomes: list) -> None:
    bad = [o for o in outcomes if o[1] != 200]
    assert not bad, f"{len(bad)} of {len(outcomes)} good requests failed: {bad[:5]}"
    assert len(outcomes) >= 2 * GOOD_STREAMS, f"too few good requests ran alongside: {len(outcomes)}"


# ---- the table --------------------------------------------------------------------------------------
@pytest.mark.slow
async def test_every_bad_input_is_a_4xx_through_the_router(engines, router):
    cases = [c for c in CASES if c.router]
    assert len(cases) > 300
    found, outcomes = await run_cases(router.url, cases, True, router.url)
    assert not found, f"{len(found)} of {len(cases)} bad inputs were not a proper 4xx:\n" + "\n".join(found[:40])
    assert_good(outcomes)
    retried = bad_input_retries(router)
    assert not retried, "the router retried bad input:\n" + "\n".join(retried[:10])
    states = circuits(router)
    assert states and all(c == 0 for c in states), f"a bad input opened a circuit breaker: {states}"
    await assert_idle(engines)


async def test_every_bad_input_is_a_4xx_at_the_engines(engines, router):
    """The null engine gets every engine case, with good requests to it meanwhile; the prefill and decode
    get the cases whose bad value is in a field the router replaces (rooms, ids)."""
    cases = [c for c in CASES if c.engine]
    assert len(cases) > 300
    found, outcomes = await run_cases(engines["null"].url, cases, False, engines["null"].url)
    assert not found, f"{len(found)} of {len(cases)} bad inputs were not a proper 4xx:\n" + "\n".join(found[:40])
    assert_good(outcomes)
    pd_cases = [c for c in cases if not c.router and c.route in GENERATION_ROUTES]
    for side in ("prefill", "decode"):
        found, outcomes = await run_cases(engines[side].url, pd_cases, False, router.url)
        assert not found, f"{side}: {len(found)} of {len(pd_cases)} not a proper 4xx:\n" + "\n".join(found[:40])
        assert_good(outcomes)
    await assert_idle(engines)


@pytest.mark.parametrize("route", GENERATION_ROUTES)
async def test_extreme_but_valid_sampling_values_are_served(engines, router, route):
    """Finite values at the edges are answers, not 500s: a temperature of 1e-300 samples greedily (SGLang rounds
    below 1e-6 to greedy; dividing by it made the logits infinite), a logit_bias of -1e30 is a ban."""
    body = dict(GOOD[route], temperature=1e-300, logit_bias={"5": -1e30})
    if route == "/generate":
        body = dict(GOOD[route], sampling_params=dict(GOOD[route]["sampling_params"], temperature=1e-300,
                                                      logit_bias={"5": -1e30}))
    async with httpx.AsyncClient(timeout=30) as c:
        for url in (router.url, engines["null"].url):
            r = await c.post(url + route, json=body)
            assert r.status_code == 200, (url, r.text[:300])


# ---- the fuzz run -----------------------------------------------------------------------------------
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=12),
                    st.sampled_from([SURROGATE, "a" + SURROGATE, "\x00", "", "user"]))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=8)
FIELDS = {route: sorted(set(model.model_fields) - ROUTER_OWNED) for route, model in MODELS.items()}
SAMPLING_FIELDS = sorted(set(SamplingParams.model_fields) | {"n"})
# Valid values of these make long generations: bounded so a body that happens to be good stays quick.
LENGTHS = {"max_new_tokens", "max_tokens", "max_completion_tokens", "min_new_tokens", "min_tokens", "n",
           "top_logprobs_num", "logprobs", "top_logprobs"}


def _bounded(field: str, value):
    if field in LENGTHS and (value is None or isinstance(value, int) and not isinstance(value, bool)
                             and 4 < value < 10**5):
        return 2  # null is the default: up to the whole context on chat
    if field == "sampling_params" and (value is None or isinstance(value, dict)):
        return dict(value or {}, max_new_tokens=_bounded("max_new_tokens", (value or {}).get("max_new_tokens")))
    if field in ("text", "prompt") and isinstance(value, list) and len(value) > 2:
        return value[:2]
    return value


@st.composite
def bodies(draw):
    """(route, raw body): a good body with a few fields replaced by arbitrary JSON values."""
    route = draw(st.sampled_from(GENERATION_ROUTES))
    body = json.loads(json.dumps(GOOD[route]))
    for field in draw(st.lists(st.sampled_from(FIELDS[route]), min_size=1, max_size=3, unique=True)):
        body[field] = _bounded(field, draw(VALUES))
    if route == "/generate" and isinstance(body.get("sampling_params"), dict) and draw(st.booleans()):
        for field in draw(st.lists(st.sampled_from(SAMPLING_FIELDS), min_size=1, max_size=3, unique=True)):
            body["sampling_params"][field] = _bounded(field, draw(VALUES))
    return route, json.dumps(body, allow_nan=True).encode()


@settings(max_examples=100, derandomize=True, database=None, deadline=timedelta(seconds=10),
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@pytest.mark.slow
@given(case=bodies())
def test_fuzz_request_schemas_never_5xx(engines, router, case):
    route, raw = case
    for url in (router.url, engines["null"].url):
        r = httpx.post(url + route, content=raw, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code < 500, (url, r.status_code, raw[:300], r.text[:300])
        if r.status_code >= 400:
            assert problems(Case("fuzz", route, raw), r, url == router.url) == [], raw[:300]


async def test_fuzz_left_nothing_behind(engines, router):
    """After the fuzz run (this module's order): no retry of bad input, no open breaker, nothing held."""
    retried = bad_input_retries(router)
    assert not retried, "the router retried bad input:\n" + "\n".join(retried[:10])
    states = circuits(router)
    assert all(c == 0 for c in states), states
    await assert_idle(engines)
