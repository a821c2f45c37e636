"""``pdserve bench`` against servers: a stub with exact timings (TTFT, token gaps, failures), a Ctrl-C in the
middle of a run, and the reference engines' PD pair behind the router (the per-stage split)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from aiohttp import web

from engines import ROOT
from pd.bench import BenchConfig, run_bench
from pd.util.ports import free_port
from pd.util.wait import wait_until
from routers import pd_router


class StubServer:
    """SGLang-shaped ``/generate`` with fixed timings: the first token ``ttft`` s after the request, then one
    token every ``gap`` s; the first chunk's text is empty (a byte of a character still incomplete, as
    byte-level tokenizers stream), every ``fail_every``-th request answers 500. Runs on its own loop thread."""

    def __init__(self, ttft: float, gap: float, fail_every: int = 0):
        self.ttft, self.gap, self.fail_every = ttft, gap, fail_every
        self.port = free_port()
        self.received = self.finished = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise TimeoutError("stub server did not start in 10 s")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/get_model_info", self.model_info)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self._loop.run_forever()

    async def models(self, request):
        return web.json_response({"data": [{"id": "stub"}]})

    async def model_info(self, request):
        from pd.engines.builtin_model import resolve_model_path

        return web.json_response({"model_path": "builtin:tiny", "tokenizer_path": resolve_model_path("builtin:tiny")})

    async def generate(self, request):
        body = await request.json()
        self.received += 1
        if self.fail_every and self.received % self.fail_every == 0:
            return web.json_response({"error": {"message": "stub failure", "code": 500}}, status=500)
        n = body["sampling_params"]["max_new_tokens"]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(self.ttft)
        for k in range(1, n + 1):
            if k > 1:
                await asyncio.sleep(self.gap)
            chunk = {"text": "x" * (k - 1), "meta_info": {"completion_tokens": k, "prompt_tokens": 7}}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        self.finished += 1
        return resp

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@pytest.fixture
def stub():
    servers = []

    def make(**kw):
        servers.append(StubServer(**kw))
        return servers[-1]

    yield make
    for s in servers:
        s.stop()


def _cfg(url: str, **kw) -> BenchConfig:
    base = dict(base_url=url, dataset_name="random", random_input_len=16, random_output_len=5,
                random_input_dist="fixed", random_output_dist="fixed", num_prompts=8, disable_tqdm=True,
                warmup_requests=1, ready_check_timeout_sec=10)
    return BenchConfig(**{**base, **kw})


def test_bench_against_a_stub_measures_its_timings_and_goodput(stub, tmp_path):
    server = stub(ttft=0.05, gap=0.2, fail_every=4)  # the warm-up is request 1; requests 4 and 8 fail
    out = tmp_path / "stub.json"
    result = run_bench(_cfg(server.url, request_rate="inf", max_concurrency=8, slo_ttft_ms=1000, slo_tpot_ms=300,
                            output_file=str(out), output_details=True), quiet=True)
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert (tmp_path / "stub.png").stat().st_size > 10000
    run, = result["runs"]
    assert run["sent"] == run["num_prompts"] == 8
    assert run["completed"] == 6 and run["failed"] == 2 and "stub failure" in run["error_samples"][0]
    # TTFT from the first token, not from the first visible text (one 200 ms gap later); loose upper bounds: a
    # busy 2-core machine delays the client's event loop
    assert 50 <= run["median_ttft_ms"] < 200, run["median_ttft_ms"]
    assert 195 <= run["median_tpot_ms"] < 260 and 195 <= run["median_itl_ms"] < 260
    assert 850 <= run["median_e2e_latency_ms"] < 1100
    # input tokens as SGLang counts them: the dataset's lengths (16, less the BOS the server adds)
    assert run["total_output_tokens"] == 6 * 5 and run["total_input_tokens"] == 6 * 15
    assert run["request_throughput"] == pytest.approx(6 / run["duration"])
    for m in ("ttft", "tpot", "itl", "e2e_latency"):
        assert run[f"median_{m}_ms"] <= run[f"p90_{m}_ms"] <= run[f"p99_{m}_ms"]
    # goodput: every answered request meets TTFT <= 1000 and TPOT <= 300; the failures count against it
    assert run["num_good"] == 6 and run["slo_attainment"] == pytest.approx(6 / 8)
    assert run["request_goodput"] == pytest.approx(6 / run["duration"])
    assert result["max_request_rate_meeting_slo"] is None  # 75% < the 90% target
    assert "stages" not in run                            # not a pdserve router
    assert len(run["ttfts"]) == 8 and sum(run["successes"]) == 6


def test_rate_sweep_with_constant_arrivals_paces_requests(stub):
    server = stub(ttft=0.01, gap=0.005)
    result = run_bench(_cfg(server.url, request_rate="5,20", arrival_process="constant", num_prompts=6,
                            slo_ttft_ms=1000, slo_tpot_ms=1000, output_details=True), quiet=True)
    slow, fast = result["runs"]
    assert [r["request_rate"] for r in result["runs"]] == [5.0, 20.0]
    assert slow["arrival_times"] == pytest.approx([i / 5 for i in range(6)])
    assert slow["duration"] >= 1.0 > fast["duration"]  # the last request is sent at 5 / rate s
    assert result["max_request_rate_meeting_slo"] == 20.0


def test_ctrl_c_writes_what_was_measured(stub, tmp_path):
    server = stub(ttft=0.02, gap=0.1)  # each request ~0.5 s; 60 at 4 req/s would take 15 s
    out = tmp_path / "partial.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "pd.cli", "bench", "--base-url", server.url, "--dataset-name", "random",
         "--random-input-len", "8", "--random-output-len", "5", "--random-output-dist", "fixed", "--num-prompts",
         "60", "--request-rate", "4", "--output-file", str(out), "--disable-tqdm"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        wait_until(lambda: server.finished >= 4, 90, interval=0.1, what="4 requests finished")
        os.kill(proc.pid, signal.SIGINT)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, output
    result = json.loads(out.read_text())
    run, = result["runs"]
    assert result["interrupted"] and run["interrupted"]
    assert 3 <= run["completed"] < 60 and run["sent"] < 60
    assert run["mean_ttft_ms"] >= 20
    assert "interrupted" in output


@pytest.fixture(scope="module")
def router(engines, tmp_path_factory):
    r = pd_router(engines["prefill"].url, engines["prefill"].bootstrap_port, engines["decode"].url,
                  str(tmp_path_factory.mktemp("bench-router")))
    try:
        r.wait_ready()
        yield r
    finally:
        r.stop()


def test_bench_through_the_router_splits_the_stages(router, engines):
    result = run_bench(_cfg(router.url, num_prompts=10, random_input_len=48, random_output_len=6,
                            request_rate="inf", max_concurrency=3, slo_ttft_ms=5000, slo_tpot_ms=5000), quiet=True)
    run, = result["runs"]
    assert run["completed"] == 10 and run["failed"] == 0 and run["slo_attainment"] == 1.0
    st = run["stages"]
    assert st["requests"] == 10 and st["note"] is None
    assert st["workers"] == {"prefill": [engines["prefill"].url], "decode": [engines["decode"].url]}
    ms = st["mean_ms"]
    for stage in ("router_queue", "prefill_bootstrap", "prefill", "kv_transfer", "decode_prealloc", "decode_kv_wait",
                  "decode_wait", "decode", "router_prefill", "router_ttft", "router_e2e"):
        assert st["counts"][stage] == 10, (stage, st["counts"])
        assert ms[stage] is not None and ms[stage] >= 0, stage
    # the router sees each request inside the client's view of it, and the prefill's stages inside the router's
    assert ms["router_e2e"] <= run["mean_e2e_latency_ms"] + 1
    assert ms["router_ttft"] <= run["mean_ttft_ms"] + 1
    assert ms["prefill_bootstrap"] + ms["prefill"] + ms["kv_transfer"] <= ms["router_prefill"] + 1
    assert ms["decode"] <= run["mean_e2e_latency_ms"]
    assert math.isclose(run["total_output_tokens"], 60)


def test_bench_against_one_engine_has_no_stage_split(engines):
    started = time.perf_counter()
    result = run_bench(_cfg(engines["null"].url, num_prompts=4, dataset_name="sharegpt", sharegpt_output_len=4,
                            sharegpt_context_len=600, request_rate="inf"), quiet=True)
    run, = result["runs"]
    assert run["completed"] == 4 and "stages" not in run
    assert result["model_id"] == "builtin:tiny"
    assert time.perf_counter() - started < 30
