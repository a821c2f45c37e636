"""Every PD wait of the reference engine ends at its deadline, and the pages it held come back.

A hung peer is a SIGSTOPped engine process of this module's own prefill/decode pair (resumed in a
``finally``): a decode hung while the prefill writes its KV (transfer deadline), a decode that never
registers (bootstrap deadline), a prefill that never answers (waiting deadline, then SGLang's
deferred KV release timeout).
"""

import asyncio
import os
import signal
import time
import uuid

import httpx
import pytest

from engines import async_metric, start_engine, wait_ready
from pd.util.wait import async_wait_until
from pdclient import add_rooms, pd_post

TRANSFER_TIMEOUT = 4.0  # --disaggregation-transfer-timeout
PD_TIMEOUT = 3.0  # --disaggregation-bootstrap-timeout and the decode's --disaggregation-waiting-timeout
RELEASE_TIMEOUT = 2.0  # SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT
SLACK = 8.0  # s a loaded 2-core machine may add to a deadline; far below every default (30 s and more)
# The waiting timeout of the prefill, and of the decode that a test freezes while the prefill writes to it. Both
# timers run from the registration; with PD_TIMEOUT either could expire, on a loaded machine, before the write's
# own deadline (or the test's abort) ends the room: the prefill's bootstrap then aborts the room as a waiting
# timeout, and a frozen decode's timer runs on while it is stopped.
PATIENT_WAITING_TIMEOUT = 60.0
GOOD = {"text": "still alive", "sampling_params": {"max_new_tokens": 3, "temperature": 0}}


@pytest.fixture(scope="module")
def pair(model_cache, tmp_path_factory):
    """A prefill (short bootstrap and transfer deadlines, a patient waiting timeout) and a decode with short
    deadlines, and a ``patient_decode`` that waits PATIENT_WAITING_TIMEOUT for its KV, warmed up (the transfer
    engines have shaken hands)."""
    logs = str(tmp_path_factory.mktemp("deadline-logs"))
    def flags(waiting: float) -> tuple:
        return ("--disaggregation-bootstrap-timeout", str(PD_TIMEOUT), "--disaggregation-waiting-timeout",
                str(waiting), "--disaggregation-transfer-timeout", str(TRANSFER_TIMEOUT))

    key = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT"
    before = os.environ.get(key)
    os.environ[key] = str(RELEASE_TIMEOUT)  # the engines inherit it
    try:
        started = {"prefill": start_engine("prefill", logs, *flags(PATIENT_WAITING_TIMEOUT)),
                   "decode": start_engine("decode", logs, *flags(PD_TIMEOUT)),
                   "patient_decode": start_engine("decode", logs, *flags(PATIENT_WAITING_TIMEOUT))}
    finally:
        if before is None:
            del os.environ[key]
        else:
            os.environ[key] = before
    try:
        wait_ready(list(started.values()))
        asyncio.run(assert_pd_works(started))
        asyncio.run(assert_pd_works(patient(started)))
        yield started
    finally:
        for e in started.values():
            e.stop()


def patient(pair) -> dict:
    """The prefill with the patient decode."""
    return {"prefill": pair["prefill"], "decode": pair["patient_decode"]}


async def assert_pd_works(pair) -> None:
    async with httpx.AsyncClient(timeout=60) as c:
        status, dec, _ = await pd_post(c, pair["prefill"], pair["decode"], "/generate", GOOD, None)
    assert status == 200 and len(dec["output_ids"]) == 3, dec


async def bootstrap_health(pair) -> dict:
    async with httpx.AsyncClient(timeout=10) as c:
        return (await c.get(f"http://127.0.0.1:{pair['prefill'].bootstrap_port}/health")).json()


async def until(predicate, what: str, timeout: float = 30) -> None:
    await async_wait_until(predicate, timeout, interval=0.05, what=what)


async def nothing_held(engine) -> bool:
    return (await async_metric(engine, "pdserve_kv_pages_held") == 0
            and await async_metric(engine, "pdserve_kv_pages_quarantined") == 0
            and await async_metric(engine, "sglang:num_running_reqs") == 0)


async def assert_idle(pair) -> None:
    """Nothing held or draining on either side, and a PD request works."""
    await until(lambda: nothing_held(pair["prefill"]), "prefill holds no KV pages")
    await until(lambda: nothing_held(pair["decode"]), "decode holds no KV pages")
    health = await bootstrap_health(pair)
    assert health["rooms"] == 0 and health["draining"] == 0, health
    await assert_pd_works(pair)


def error_message(r: httpx.Response, status: int = 500) -> str:
    assert r.status_code == status, r.text
    return r.json()["error"]["message"]


async def decode_registered(pair, c: httpx.AsyncClient, body: dict) -> asyncio.Task:
    """Start the decode's half of ``body``; returns once its registration has reached the prefill."""
    task = asyncio.create_task(c.post(pair["decode"].url + "/generate", json=body))

    async def registered() -> bool:
        return (await bootstrap_health(pair))["rooms"] >= 1

    await until(registered, "the decode's registration on the prefill")
    return task


@pytest.mark.slow
async def test_hung_decode_fails_the_kv_write_at_its_deadline(pair):
    """The decode hangs after registering: the prefill's request fails at the transfer deadline, the room ends,
    its pages are held only while the transfer engine may still read them (counted as quarantined), and the
    decode, once resumed, learns of it and frees its pages too."""
    pair = patient(pair)
    body = add_rooms({"text": "write into a hung decode", "sampling_params": {"max_new_tokens": 4}},
                     "127.0.0.1", pair["prefill"].bootstrap_port, None)
    decode_pid = pair["decode"].proc.pid
    async with httpx.AsyncClient(timeout=120) as c:
        dec = await decode_registered(pair, c, body)
        os.kill(decode_pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            r = await c.post(pair["prefill"].url + "/generate", json=body)
            elapsed = time.monotonic() - t0
            msg = error_message(r)
            assert "did not complete within" in msg and "--disaggregation-transfer-timeout" in msg, msg
            assert str(body["bootstrap_room"]) in msg
            assert TRANSFER_TIMEOUT - 0.1 <= elapsed < TRANSFER_TIMEOUT + SLACK, elapsed
            # The room is over and the request gone; the pages stay only as long as the write may run.
            health = await bootstrap_health(pair)
            assert health["rooms"] == 0 and health["draining"] == 1, health
            held = await async_metric(pair["prefill"], "pdserve_kv_pages_held")
            assert held > 0 and await async_metric(pair["prefill"], "pdserve_kv_pages_quarantined") == held
            assert await async_metric(pair["prefill"], "sglang:num_running_reqs") == 0
            assert await async_metric(pair["prefill"], "sglang:num_transfer_failed_reqs_total") >= 1
        finally:
            os.kill(decode_pid, signal.SIGCONT)
        msg = error_message(await dec)
        assert "did not complete within" in msg, msg  # the decode is told why, by the prefill
    await assert_idle(pair)


async def test_abort_during_a_hung_kv_write_ends_the_request_at_once(pair):
    """An /abort_request (as the router sends when its client leaves) ends a prefill request stuck writing into
    a hung decode at once, not when the write gives up; its pages follow once the write settles."""
    rid = "hung-write-" + uuid.uuid4().hex
    body = add_rooms({"text": "abort a hung write", "rid": rid, "sampling_params": {"max_new_tokens": 4}},
                     "127.0.0.1", pair["prefill"].bootstrap_port, None)
    decode_pid = pair["decode"].proc.pid
    async with httpx.AsyncClient(timeout=120) as c:
        dec = await decode_registered(pair, c, body)
        os.kill(decode_pid, signal.SIGSTOP)
        try:
            pre = asyncio.create_task(c.post(pair["prefill"].url + "/generate", json=body))

            async def writing() -> bool:
                return await async_metric(pair["prefill"], "sglang:num_running_reqs") >= 1

            await until(writing, "the prefill writing the KV")
            t0 = time.monotonic()
            assert (await c.post(pair["prefill"].url + "/abort_request", json={"rid": rid})).status_code == 200
            r = await pre
            assert time.monotonic() - t0 < TRANSFER_TIMEOUT, "the abort waited for the write"
            assert r.status_code == 200 and r.json()["meta_info"]["finish_reason"]["type"] == "abort", r.text
            assert await async_metric(pair["prefill"], "pdserve_kv_pages_quarantined") > 0
        finally:
            os.kill(decode_pid, signal.SIGCONT)
        assert (await dec).status_code == 500
    await assert_idle(pair)


async def test_decode_that_never_registers_frees_the_room_at_the_bootstrap_deadline(pair):
    body = add_rooms({"text": "nobody registers", "sampling_params": {"max_new_tokens": 4}},
                     "127.0.0.1", pair["prefill"].bootstrap_port, None)
    async with httpx.AsyncClient(timeout=120) as c:
        t0 = time.monotonic()
        r = await c.post(pair["prefill"].url + "/generate", json=body)
    elapsed = time.monotonic() - t0
    assert "bootstrap timeout" in error_message(r)
    assert PD_TIMEOUT - 0.1 <= elapsed < PD_TIMEOUT + SLACK, elapsed
    health = await bootstrap_health(pair)
    assert health["rooms"] == 0 and health["draining"] == 0, health
    await assert_idle(pair)


@pytest.mark.slow
async def test_prefill_that_never_answers_frees_the_decode_pages(pair):
    """The prefill hangs: the decode's request fails at the waiting deadline, and its pages come back after
    SGLang's deferred KV release timeout, while the prefill is still hung (not when it recovers)."""
    body = add_rooms({"text": "hung prefill", "sampling_params": {"max_new_tokens": 4}},
                     "127.0.0.1", pair["prefill"].bootstrap_port, None)
    prefill_pid = pair["prefill"].proc.pid
    os.kill(prefill_pid, signal.SIGSTOP)
    try:
        async with httpx.AsyncClient(timeout=120) as c:
            t0 = time.monotonic()
            r = await c.post(pair["decode"].url + "/generate", json=body)
            elapsed = time.monotonic() - t0
        assert "waiting timeout" in error_message(r)
        assert PD_TIMEOUT - 0.1 <= elapsed < PD_TIMEOUT + SLACK, elapsed
        await until(lambda: nothing_held(pair["decode"]), "decode frees its pages", RELEASE_TIMEOUT + SLACK)
        assert time.monotonic() - t0 >= PD_TIMEOUT + RELEASE_TIMEOUT - 0.2  # not before the prefill could stop
    finally:
        os.kill(prefill_pid, signal.SIGCONT)
    await assert_idle(pair)
