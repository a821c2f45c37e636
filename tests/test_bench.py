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

import httpx
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
        app.router.add_get("/model_info", self.model_info)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self._loop.run_forever()

    async def models(self, request):
        return web.json_response({"data": [{"id": "stub"}]})

    async def model_info(self, request):
        from pd.engines.models.builtin_model import resolve_model_path

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
    assert 195 <= run["median_tpot_ms"] < 300 and 195 <= run["median_itl_ms"] < 300
    assert 850 <= run["median_e2e_latency_ms"] < 1400
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


@pytest.mark.slow
@pytest.mark.parametrize("inherited", [signal.SIG_DFL, signal.SIG_IGN], ids=["terminal", "background-job"])
def test_ctrl_c_writes_what_was_measured(stub, tmp_path, inherited):
    """SIGINT stops the run and writes what was measured, also in a background job (`pdserve bench ... &` in a
    script, or any child of one such as a test run started with `&`), which starts with SIGINT ignored."""
    server = stub(ttft=0.02, gap=0.1)  # each request ~0.5 s; 60 at 4 req/s would take 15 s
    out = tmp_path / "partial.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "pd.cli", "bench", "--base-url", server.url, "--dataset-name", "random",
         "--random-input-len", "8", "--random-output-len", "5", "--random-output-dist", "fixed", "--num-prompts",
         "60", "--request-rate", "4", "--output-file", str(out), "--disable-tqdm"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, inherited))
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


# `pdserve` in an install without matplotlib (`pip install 'pdserve[cpu]'`): its import fails as a missing one's does.
NO_MATPLOTLIB = "import sys; sys.modules['matplotlib'] = None; from pd.cli import main; main()"


def _pdserve_without_matplotlib(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", NO_MATPLOTLIB, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
def test_bench_without_matplotlib_writes_the_json_and_names_the_extra_for_the_png(stub, tmp_path):
    r = _pdserve_without_matplotlib("bench", "--help")
    assert r.returncode == 0 and "usage: pdserve bench" in r.stdout, r.stdout + r.stderr
    server = stub(ttft=0.01, gap=0.01)
    out = tmp_path / "nompl.json"
    r = _pdserve_without_matplotlib(
        "bench", "--base-url", server.url, "--dataset-name", "random", "--random-input-len", "8",
        "--random-output-len", "3", "--random-output-dist", "fixed", "--num-prompts", "4", "--request-rate", "inf",
        "--output-file", str(out), "--disable-tqdm", "--ready-check-timeout-sec", "10")
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads(out.read_text())
    assert result["runs"][0]["completed"] == 4 and "plot_file" not in result
    assert not (tmp_path / "nompl.png").exists()
    notes = [line for line in r.stderr.splitlines() if "pip install" in line]
    assert len(notes) == 1 and "matplotlib is not installed (pip install 'pdserve[monitoring]')" in notes[0], r.stderr
    assert str(tmp_path / "nompl.png") in notes[0] and "pdserve[bench]" not in r.stdout + r.stderr


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
    # The router sees each request inside the client's view of it, and the prefill's stages inside the router's.
    # Each process stops its clock when its own coroutine runs again, which on a loaded machine can come a few ms
    # after the next process already read the answer: the bound allows that, not a wrong unit or a sum for a mean.
    def inside(inner: float, outer: float) -> bool:
        return inner <= 1.25 * outer + 5

    assert inside(ms["router_e2e"], run["mean_e2e_latency_ms"]), (ms, run["mean_e2e_latency_ms"])
    assert inside(ms["router_ttft"], run["mean_ttft_ms"]), (ms, run["mean_ttft_ms"])
    assert inside(ms["prefill_bootstrap"] + ms["prefill"] + ms["kv_transfer"], ms["router_prefill"]), ms
    assert ms["decode"] <= run["mean_e2e_latency_ms"]
    assert math.isclose(run["total_output_tokens"], 60)


def test_bench_finds_the_admin_key_file_the_launcher_wrote(engines, tmp_path, monkeypatch, capsys):
    """Against a router with an admin key (as `make serve` starts it), `pdserve bench` lists its workers with the
    key in the file the launcher wrote (found by the router's port in Ray's session_latest), never printing it;
    --admin-api-key wins over the file; PDSERVE_ADMIN_API_KEY_FILE names a file anywhere."""
    import secrets

    import yaml

    from pd.bench import stages
    from pd.cluster import prom_targets
    from pd.cluster.launch import Launcher
    from pd.config import DEFAULT_CONFIG, parse_config

    key = secrets.token_urlsafe(24)
    with monkeypatch.context() as env:  # the router reads its admin key from its environment
        env.setenv("PDSERVE_ROUTER_ADMIN_API_KEY", key)
        router = pd_router(engines["prefill"].url, engines["prefill"].bootstrap_port, engines["decode"].url,
                           str(tmp_path))
    try:
        router.wait_ready()
        # the launcher writes the key file of a cluster whose router has this port, into its Ray session dir
        session = tmp_path / "ray" / "session_2026-12-06_10-01-02_123456_789"
        (tmp_path / "ray").mkdir()
        (tmp_path / "ray" / "session_latest").symlink_to(session.name)
        data = yaml.safe_load(DEFAULT_CONFIG.read_text())
        data["router"]["port"] = router.port
        launcher = Launcher(parse_config(data))
        launcher.admin_key = key
        monkeypatch.setattr(prom_targets, "ray_session_dir", lambda: session)
        launcher.announce_admin_api()
        assert launcher.admin_key_file.parent == session and launcher.admin_key_file.stat().st_mode & 0o777 == 0o600
        assert httpx.get(router.url + "/workers", timeout=10).status_code == 401  # the admin API is keyed
        monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
        monkeypatch.delenv("PDSERVE_ADMIN_API_KEY_FILE", raising=False)
        capsys.readouterr()
        result = run_bench(_cfg(router.url, num_prompts=3, random_input_len=32, random_output_len=4,
                                request_rate="inf", output_file=str(tmp_path / "keyed.json")), quiet=False)
        st = result["runs"][0]["stages"]
        assert st["note"] is None and st["counts"]["prefill"] == 3, st
        assert st["workers"] == {"prefill": [engines["prefill"].url], "decode": [engines["decode"].url]}
        printed = capsys.readouterr()
        assert key not in printed.out + printed.err and key not in (tmp_path / "keyed.json").read_text()

        async def discover(given=None):
            async with httpx.AsyncClient() as client:
                return await stages.discover(client, router.url, given)

        wrong = asyncio.run(discover("not-the-key"))  # --admin-api-key wins over the file
        assert not wrong.workers["prefill"] and "401 with the key from --admin-api-key" in wrong.note
        elsewhere = tmp_path / "elsewhere" / "admin.key"
        elsewhere.parent.mkdir()
        elsewhere.write_text(key + "\n")
        launcher.admin_key_file.unlink()  # the launcher stopped: no file in the session dir
        assert "answered 401 without an admin key" in asyncio.run(discover()).note
        monkeypatch.setenv("PDSERVE_ADMIN_API_KEY_FILE", str(elsewhere))
        assert asyncio.run(discover()).workers["decode"] == [engines["decode"].url]
        monkeypatch.setenv("PDSERVE_ADMIN_API_KEY_FILE", str(tmp_path / "missing.key"))
        note = asyncio.run(discover()).note
        assert f"cannot read the admin key file {tmp_path / 'missing.key'}" in note and key not in note
    finally:
        router.stop()


def test_bench_against_one_engine_has_no_stage_split(engines):
    started = time.perf_counter()
    result = run_bench(_cfg(engines["null"].url, num_prompts=4, dataset_name="sharegpt", sharegpt_output_len=4,
                            sharegpt_context_len=600, request_rate="inf"), quiet=True)
    run, = result["runs"]
    assert run["completed"] == 4 and "stages" not in run
    assert result["model_id"] == "builtin:tiny"
    assert time.perf_counter() - started < 30
