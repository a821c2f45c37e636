"""The main job end to end: `ray job submit -- python -m pd.launch deploy/local.yaml` on a local
Ray cluster with 8 logical GPUs, real prompts through the router, failures, clean stop."""

import asyncio
import json
import os
import re
import signal
import time

import httpx
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from engines import ROOT, free_port
from import_guard import assert_guard_passed, guard_report
from pd.util.wait import async_wait_until, wait_until
from ray_cluster import RayHead, wait_pids_gone

pytestmark = pytest.mark.cluster  # starts Ray (conftest.py: test tiers)

GEN = {"temperature": 0, "max_new_tokens": 12}


@pytest.fixture(scope="module")
def ray_head(model_cache):
    head = RayHead(num_gpus=8)
    try:
        yield head
    finally:
        head.stop()


def targets_path(ray_head, router_port: int = 8000) -> str:
    """The targets file of the cluster whose router listens on ``router_port`` (one per cluster)."""
    return os.path.join(ray_head.tmp, "session_latest", f"pdserve_prometheus_targets_{router_port}.json")


def prometheus_targets(ray_head, router_port: int = 8000) -> dict:
    """component/worker_name -> file_sd entry of the targets file the launcher keeps in the Ray
    session dir (what monitoring/prometheus.yml scrapes)."""
    with open(targets_path(ray_head, router_port)) as f:
        return {e["labels"].get("worker_name", e["labels"]["component"]): e for e in json.load(f)}


def launcher_restarts(targets: dict) -> dict:
    """worker_name -> pdserve_worker_restarts_total on the launcher's exporter."""
    text = httpx.get(f"http://{targets['launcher']['targets'][0]}/metrics", timeout=5).text
    return {s.labels["worker_name"]: s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == "pdserve_worker_restarts_total"}


def router_retries(url: str) -> float:
    """pdserve_router_retries_total summed over endpoints, from the router's /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "pdserve_router_retries_total")


def null_generate(engines, body):
    r = httpx.post(engines["null"].url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_local_yaml_job(ray_head, engines):
    job = ray_head.submit("python", "-m", "pd.launch", "deploy/local.yaml")
    pids = set()
    try:
        url = ray_head.wait_log(job, r"pdserve: router ready at (\S+)").group(1)
        workers = ray_head.workers(job)
        assert url == "http://127.0.0.1:8000"
        by_role = {w["role"]: w for w in workers}
        assert set(by_role) == {"prefill", "decode"}
        pre, dec = by_role["prefill"], by_role["decode"]
        pids |= {pre["pid"], dec["pid"]}
        # Ray gave each worker its own logical GPU
        pre_gpus, dec_gpus = set(pre["cuda_visible_devices"].split(",")), set(dec["cuda_visible_devices"].split(","))
        assert pre_gpus and dec_gpus and not pre_gpus & dec_gpus
        # Prometheus file_sd targets: the router, each engine with its role, the launcher's exporter.
        targets = prometheus_targets(ray_head)
        assert targets["router"]["targets"] == ["127.0.0.1:8000"]
        for w in workers:
            labels = {"component": "engine", "role": w["role"], "worker_name": w["name"]}
            assert targets[w["name"]] == {"targets": [w["url"].removeprefix("http://")], "labels": labels}
        assert launcher_restarts(targets) == {"prefill-0": 0, "decode-0": 0}
        # The admin API: the log names the generated key's owner-only file, never the key.
        admin, key_file = ray_head.wait_log(job, r"admin API at (\S+)/workers; its key is in (\S+) ").groups()
        assert os.stat(key_file).st_mode & 0o777 == 0o600
        key = open(key_file).read().strip()
        assert key and key not in ray_head.logs(job)
        listed = httpx.get(admin + "/workers", headers={"Authorization": f"Bearer {key}"}, timeout=10)
        assert listed.status_code == 200 and len(listed.json()["workers"]) == 2, listed.text

        # OpenAI client, not streaming and streaming, equals the null-mode engine.
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        prompt = "The quick brown fox"
        ref = null_generate(engines, {"text": prompt, "sampling_params": GEN})
        out = client.completions.create(model="builtin:tiny", prompt=prompt, max_tokens=12, temperature=0)
        assert out.choices[0].text == ref["text"]
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model="builtin:tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True) if c.choices)
        assert streamed == ref["text"]
        chat = client.chat.completions.create(model="builtin:tiny", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=8, temperature=0, n=2)
        assert len(chat.choices) == 2 and chat.choices[0].message.content == chat.choices[1].message.content
        # batched /generate
        texts = [f"batch item {i}" for i in range(5)]
        r = httpx.post(url + "/generate", json={"text": texts, "sampling_params": GEN}, timeout=60)
        assert r.status_code == 200, r.text
        ref_batch = null_generate(engines, {"text": texts, "sampling_params": GEN})
        assert [x["output_ids"] for x in r.json()] == [x["output_ids"] for x in ref_batch]

        # Kill the prefill engine while requests are in flight: each ends promptly (done or error),
        # the decode stays healthy, only the prefill restarts, the next request succeeds.
        long_prompt = "y" * 1800

        async def one_stream():
            t0 = time.monotonic()
            async with httpx.AsyncClient(timeout=120) as c:
                try:
                    async with c.stream("POST", url + "/generate", json={
                            "text": long_prompt, "stream": True,
                            "sampling_params": {"max_new_tokens": 40, "temperature": 0}}) as resp:
                        body = (await resp.aread()).decode()
                        ok = resp.status_code == 200 and "data: [DONE]" in body and '"error"' not in body
                except httpx.HTTPError:
                    ok = False
            return ok, time.monotonic() - t0

        async def kill_during():
            tasks = [asyncio.create_task(one_stream()) for _ in range(12)]
            # Kill once the prefill demonstrably holds requests (queued for its forward).
            async with httpx.AsyncClient(timeout=5) as c:
                async def holds_two() -> bool:
                    m = (await c.get(pre["url"] + "/metrics")).text
                    gauges = ("sglang:num_queue_reqs{", "sglang:num_prefill_bootstrap_queue_reqs{")
                    queued = sum(float(line.rsplit(" ", 1)[1]) for line in m.splitlines() if line.startswith(gauges))
                    return queued >= 2

                await async_wait_until(holds_two, 60, interval=0.01, what="the prefill holding 2 requests")
            os.kill(pre["pid"], signal.SIGKILL)
            return await asyncio.gather(*tasks)

        retries_before = router_retries(url)
        results = asyncio.run(kill_during())
        # the requests the prefill held fail, or the router sends them again on a fresh pair, which on an idle
        # machine may already include the restarted prefill (then every stream ends well)
        assert any(not ok for ok, _ in results) or router_retries(url) > retries_before, \
            "killing the prefill should fail or retry the requests it held"
        # promptly: well before the 120 s client timeout, the decode's 300 s waiting timeout and the router's
        # 600 s request timeout (a few seconds on a loaded machine)
        assert all(elapsed < 60 for _, elapsed in results), results
        assert httpx.get(dec["url"] + "/health_generate", timeout=20).status_code == 200
        ray_head.wait_log(job, r"\[prefill-0\] pdserve: engine ready again", timeout=120)
        logs = ray_head.logs(job)
        assert "[prefill-0] pdserve: engine exited with -9; restart 1/5" in logs
        assert "[decode-0] pdserve: engine exited" not in logs
        # the launcher polls worker state every 2 s
        wait_until(lambda: launcher_restarts(targets) == {"prefill-0": 1, "decode-0": 0}, 30, interval=0.5,
                   what="the launcher's exporter counting the prefill restart", retry=())
        assert prometheus_targets(ray_head)["prefill-0"] == targets["prefill-0"]  # same port after the restart
        r = httpx.post(url + "/generate", json={"text": prompt, "sampling_params": GEN}, timeout=60)
        assert r.status_code == 200 and r.json()["output_ids"] == ref["output_ids"]
        last_start = r"\[prefill-0\] pdserve: started engine pid (\d+)(?![\s\S]*started engine pid)"
        new_pid = int(ray_head.wait_log(job, last_start).group(1))
        pids.add(new_pid)
    finally:
        ray_head.stop_job(job)
    assert not wait_pids_gone(pids, 30), "engine processes left behind"
    assert not os.path.exists(targets_path(ray_head)), "a stopped cluster must leave no scrape targets"
    assert not os.path.exists(key_file), "a stopped cluster must leave no admin key behind"
    with pytest.raises(httpx.HTTPError):
        httpx.get("http://127.0.0.1:8000/health", timeout=2)


def test_two_prefill_two_decode_ports_and_pairing(ray_head, tmp_path):
    router_port = free_port()
    cfg = yaml.safe_load(open(os.path.join(ROOT, "deploy", "local.yaml")))
    cfg["prefill"]["replicas"] = 2
    cfg["decode"]["replicas"] = 2
    cfg["router"]["port"] = router_port
    path = os.path.join(ROOT, "deploy", f".test-2p2d-{router_port}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    try:
        job = ray_head.submit("python", "-m", "pd.launch", os.path.relpath(path, ROOT))
    finally:
        os.remove(path)
    try:
        url = ray_head.wait_log(job, r"pdserve: router ready at (\S+)").group(1)
        workers = ray_head.workers(job)
        # its own targets file, next to any other cluster's on this head
        assert set(prometheus_targets(ray_head, router_port)) == {"router", "launcher"} | {w["name"] for w in workers}
        ports = [w["port"] for w in workers] + [w["bootstrap_port"] for w in workers if w["bootstrap_port"]]
        assert len(ports) == 6 and len(set(ports)) == 6
        gpus = [w["cuda_visible_devices"] for w in workers]
        assert len(set(gpus)) == 4
        # A request whose bootstrap_port belonged to another prefill would wait for a decode that
        # registers elsewhere and time out; 12 quick successes across both pairs show correct pairing.
        with httpx.Client(timeout=30) as c:
            for i in range(12):
                r = c.post(url + "/generate", json={"text": f"pair {i}", "sampling_params": GEN})
                assert r.status_code == 200, r.text
            for w in workers:
                if w["role"] == "prefill":
                    m = c.get(w["url"] + "/metrics").text
                    line = next(x for x in m.splitlines() if x.startswith("pdserve_kv_transfer_bytes_total{"))
                    assert float(line.rsplit(" ", 1)[1]) > 0, f"{w['name']} got no traffic"
    finally:
        ray_head.stop_job(job)
    # the launcher removes it while it shuts down
    wait_until(lambda: not os.path.exists(targets_path(ray_head, router_port)), 30, interval=0.5,
               what="the stopped cluster's targets file removed")


def test_config_needing_more_gpus_than_the_cluster_fails_clearly(ray_head):
    path = os.path.join(ROOT, "deploy", f".test-big-{free_port()}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump({"cluster": {"num_gpus": 16}, "prefill": {"replicas": 2, "tp_size": 4},
                        "decode": {"replicas": 1, "tp_size": 4}, "router": {"port": free_port()}}, f)
    try:
        job = ray_head.submit("python", "-m", "pd.launch", os.path.relpath(path, ROOT))
    finally:
        os.remove(path)
    wait_until(lambda: re.search(r"failed|succeeded|stopped", ray_head.status(job), re.IGNORECASE), 120,
               interval=1, what=f"job {job} ended", retry=())
    logs = ray_head.logs(job)
    assert "the config needs 12 GPUs" in logs and "the Ray cluster has 8" in logs
    assert "FAILED" in ray_head.status(job) or "failed" in ray_head.status(job)


def test_bundle_no_node_can_hold_is_named_at_once(ray_head):
    """The multi-node example of docs/cluster.md on a one-node head: the job log names the missing custom resource right
    away (the launcher keeps waiting for an autoscaler to add such a node; the test stops it)."""
    path = os.path.join(ROOT, "deploy", f".test-placement-{free_port()}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump({"decode": {"placement": {"resources": {"decode_node": 0.01}}},
                        "router": {"port": free_port()}}, f)
    try:
        job = ray_head.submit("python", "-m", "pd.launch", os.path.relpath(path, ROOT))
    finally:
        os.remove(path)
    try:
        m = ray_head.wait_log(job, r"pdserve: decode-0: (no alive node has resource 'decode_node'[^\n]*)", timeout=60)
        assert "ray start --resources '{\"decode_node\": 1}'" in m.group(1) and "_group_" not in m.group(1)
        assert "prefill-0: no alive node" not in ray_head.logs(job)  # the prefill bundle fits
    finally:
        ray_head.stop_job(job)


def test_a_ray_job_imports_the_real_packages(ray_head):
    """`ray job submit --working-dir .` puts the uploaded checkout on the job's sys.path: ``import kernels`` is
    still Hugging Face's and transformers builds a model (tests/import_guard.py)."""
    job = ray_head.submit("python", "tests/import_guard.py")
    wait_until(lambda: re.search(r"failed|succeeded|stopped", ray_head.status(job), re.IGNORECASE), 120,
               interval=1, what=f"job {job} ended", retry=())
    logs = ray_head.logs(job)
    assert_guard_passed(guard_report(logs))
    assert "succeeded" in ray_head.status(job).lower(), logs[-3000:]
