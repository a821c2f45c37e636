"""The split controller on a Ray cluster: `python -m pd.launch` with ``planner.mode: act`` on 3 slots (2P1D); an
operator pins 1P2D through the admin API while requests stream; the launcher moves a prefill worker's actor to
decode in its placement group, nothing fails, and the router, the job log, the launcher's metrics and the
Prometheus targets all show the new split."""

import json
import os
import threading

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from engines import ROOT, free_port
from pd.cluster.split_mover import bootstrap_url, engine_holdings
from pd.util.wait import wait_until
from ray_cluster import RayHead

pytestmark = pytest.mark.cluster  # starts Ray (conftest.py: test tiers)


@pytest.fixture(scope="module")
def ray_head(model_cache):
    head = RayHead(num_gpus=8)
    try:
        yield head
    finally:
        head.stop()


def launcher_samples(targets_file: str, name: str) -> dict:
    """Samples of ``name`` on the launcher's exporter (its address from the targets file): labels -> value."""
    with open(targets_file) as f:
        launcher = next(e for e in json.load(f) if e["labels"]["component"] == "launcher")
    text = httpx.get(f"http://{launcher['targets'][0]}/metrics", timeout=5).text
    return {tuple(sorted(s.labels.items())): s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == name}


def test_a_pinned_split_moves_a_worker_on_ray_without_failing_a_request(ray_head):
    port = free_port()
    cfg = yaml.safe_load(open(os.path.join(ROOT, "deploy", "local.yaml")))
    cfg["cluster"]["num_gpus"] = 3  # three slots, none free: the split changes by moving a worker
    cfg["prefill"]["replicas"], cfg["decode"]["replicas"] = 2, 1
    cfg["router"]["port"] = port
    # objectives nothing misses: only the operator's pin moves a worker
    cfg["planner"] = {"mode": "act", "interval_secs": 1, "window_secs": 10, "slo_ttft_ms": 600000,
                      "slo_tpot_ms": 600000, "settle_timeout_secs": 60}
    path = os.path.join(ROOT, "deploy", f".test-split-{port}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    try:
        job = ray_head.submit("python", "-m", "pd.launch", os.path.relpath(path, ROOT))
    finally:
        os.remove(path)
    results, stopping = [], threading.Event()
    try:
        url = ray_head.wait_log(job, r"pdserve: router ready at (\S+)").group(1)
        admin, key_file = ray_head.wait_log(job, r"admin API at (\S+)/workers; its key is in (\S+) ").groups()
        ray_head.wait_log(job, r"pdserve: planner: act every 1s")
        headers = {"Authorization": f"Bearer {open(key_file).read().strip()}"}
        before = {w["name"]: w for w in ray_head.workers(job)}

        def stream() -> None:
            body = {"text": "move me " * 30, "stream": True, "sampling_params": {"max_new_tokens": 64,
                                                                                 "temperature": 0}}
            with httpx.Client(timeout=120) as c:
                while not stopping.is_set():
                    try:
                        with c.stream("POST", url + "/generate", json=body) as r:
                            text = r.read().decode()
                        results.append(r.status_code == 200 and "data: [DONE]" in text and '"error"' not in text)
                    except httpx.HTTPError:
                        results.append(False)

        threads = [threading.Thread(target=stream, daemon=True) for _ in range(3)]
        for t in threads:
            t.start()
        wait_until(lambda: len(results) >= 3, 120, interval=0.2, what="traffic flowing")
        pinned = httpx.put(admin + "/planner/override", json={"prefill": 1, "decode": 2}, headers=headers, timeout=10)
        assert pinned.status_code == 200, pinned.text
        moved = ray_head.wait_log(job, r"pdserve: planner: moved: (\S+) -> (\S+) in", timeout=300)
        assert moved.groups() == ("prefill-1", "decode-1")
        n = len(results)
        wait_until(lambda: len(results) >= n + 6, 120, interval=0.2, what="traffic after the move")
        stopping.set()
        for t in threads:
            t.join(120)
        assert results and all(results), f"{results.count(False)} of {len(results)} requests failed"

        state = httpx.get(admin + "/planner", headers=headers, timeout=10).json()
        assert state["current"] == {"prefill": 1, "decode": 2} and state["override"] == {"prefill": 1, "decode": 2}
        assert state["mode"] == "act" and state["decision"]["reason"] == "override"
        listed = httpx.get(admin + "/workers", headers=headers, timeout=10).json()["workers"]
        assert sorted(w["worker_type"] for w in listed) == ["decode", "decode", "prefill"]
        assert before["prefill-1"]["url"] not in {w["url"] for w in listed}  # back on fresh ports, as a decode
        logs = ray_head.logs(job)
        assert "pdserve: planner (act): 2P1D -> 1P2D: does move_to_decode (override)" in logs
        assert "[prefill-1] pdserve: engine stopped to change role (was prefill)" in logs
        # the same actor, GPU and node: its placement group did not change
        targets_file = os.path.join(ray_head.tmp, "session_latest", f"pdserve_prometheus_targets_{port}.json")
        with open(targets_file) as f:
            engines = {e["labels"]["worker_name"]: e for e in json.load(f) if e["labels"]["component"] == "engine"}
        assert set(engines) == {"prefill-0", "decode-0", "decode-1"}
        assert engines["decode-1"]["labels"]["role"] == "decode"
        decisions = launcher_samples(targets_file, "pdserve_planner_decisions_total")
        assert decisions[(("action", "move_to_decode"), ("reason", "override"))] >= 1
        assert launcher_samples(targets_file, "pdserve_planner_moves_total") == {(("outcome", "moved"),): 1.0}
        # nothing held anywhere once the traffic ended
        for w in listed:
            info = {"role": w["worker_type"], "host": "127.0.0.1", "bootstrap_port": w["bootstrap_port"]}
            wait_until(lambda: not engine_holdings(w["url"], bootstrap_url(info), httpx.Client(timeout=5)), 30,
                       interval=0.2, what=f"{w['url']} holding nothing")
    finally:
        stopping.set()
        ray_head.stop_job(job)


def test_a_free_gpu_is_used_before_a_worker_is_moved(ray_head):
    """1P1D in a 3-GPU budget: pinning 1P2D adds a decode replica in a placement group of its own (nothing moves);
    the stopped job removes it with the rest."""
    port = free_port()
    cfg = yaml.safe_load(open(os.path.join(ROOT, "deploy", "local.yaml")))
    cfg["cluster"]["num_gpus"] = 3
    cfg["router"]["port"] = port
    cfg["planner"] = {"mode": "act", "interval_secs": 1, "slo_ttft_ms": 600000, "slo_tpot_ms": 600000}
    path = os.path.join(ROOT, "deploy", f".test-split-add-{port}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    try:
        job = ray_head.submit("python", "-m", "pd.launch", os.path.relpath(path, ROOT))
    finally:
        os.remove(path)
    try:
        url = ray_head.wait_log(job, r"pdserve: router ready at (\S+)").group(1)
        admin, key_file = ray_head.wait_log(job, r"admin API at (\S+)/workers; its key is in (\S+) ").groups()
        headers = {"Authorization": f"Bearer {open(key_file).read().strip()}"}
        ray_head.wait_log(job, r"pdserve: planner: act every 1s")
        pinned = httpx.put(admin + "/planner/override", json={"prefill": 1, "decode": 2}, headers=headers, timeout=10)
        assert pinned.status_code == 200, pinned.text
        added = ray_head.wait_log(job, r"pdserve: planner: added: decode-1 at (\S+)", timeout=300).group(1)
        wait_until(lambda: httpx.get(admin + "/planner", headers=headers, timeout=10).json()["current"]
                   == {"prefill": 1, "decode": 2}, 60, interval=0.5, what="the router listing 1P2D")
        logs = ray_head.logs(job)
        assert "does add_decode (override)" in logs
        assert "planner: moved" not in logs and "stopped to change role" not in logs  # nothing moved
        with httpx.Client(timeout=60) as c:
            for i in range(6):  # round robin: the new decode serves
                r = c.post(url + "/generate", json={"text": f"added {i}", "sampling_params": {"max_new_tokens": 4}})
                assert r.status_code == 200, r.text
        assert "sglang:num_requests_total" in httpx.get(added + "/metrics", timeout=10).text
        served = sum(s.value for fam in text_string_to_metric_families(httpx.get(added + "/metrics").text)
                     for s in fam.samples if s.name == "sglang:num_requests_total")
        assert served >= 1
    finally:
        ray_head.stop_job(job)
    assert "pdserve-decode-1" not in ray_head.ray("list", "placement-groups", "--address", ray_head.address,
                                                  "--filter", "state=CREATED")
