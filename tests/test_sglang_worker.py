"""The SGLang worker path in the real worker actor, driven by a stand-in SGLang server
(tests/fake_sglang/launch_server.py): spawn -> readiness -> crash -> diagnosis -> restart."""

import os
import sys

import pytest

from engines import ROOT
from pd.util.wait import wait_until

pytestmark = pytest.mark.cluster  # starts Ray (conftest.py: test tiers)

FAKE = [sys.executable, os.path.join(ROOT, "tests", "fake_sglang", "launch_server.py")]


@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(address="local", num_cpus=2, num_gpus=8, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    yield ray
    ray.shutdown()


def worker(ray, tmp_path, scenario, api_key=None, **overrides):
    from pd.cluster.worker import EngineWorker
    from pd.config import parse_config

    cfg = parse_config({
        "engine": "sglang", "model_path": "/models/none", "page_size": 64,
        "sglang": {"quantization": "fp8", "launch_command": FAKE},
        "prefill": {"tp_size": 4, "env": {"FAKE_SGLANG_SCENARIO": scenario,
                                          "FAKE_SGLANG_STATE": str(tmp_path / "starts"),
                                          "FAKE_SGLANG_CRASH_AFTER": "1.5"}},
        "restart": {"max_restarts": 2, "backoff_initial": 0.2, "backoff_max": 0.5},
        **overrides,
    })
    actor = ray.remote(EngineWorker).options(num_cpus=0, num_gpus=4).remote("prefill-0", "prefill", cfg.model_dump(),
                                                                            None, "127.0.0.1", api_key)
    return actor


def wait_for(ray, actor, pred, timeout=30):
    """Poll the actor's ``info()`` until ``pred(info)`` holds; returns that info (TimeoutError with the last one)."""
    def met():
        info = ray.get(actor.info.remote())
        return info if pred(info) else None

    try:
        return wait_until(met, timeout, interval=0.2, what="actor state", retry=())
    except TimeoutError as e:
        raise AssertionError(f"condition not met: {ray.get(actor.info.remote())}") from e


def test_ready_then_crash_is_diagnosed_and_restarted(ray_local, tmp_path):
    ray = ray_local
    actor = worker(ray, tmp_path, "crash_later,ready")
    try:
        info = ray.get(actor.start.remote(), timeout=60)
        assert info["state"] == "ready" and info["ready_line_seen"]
        assert len(info["cuda_visible_devices"].split(",")) == 4  # Ray gave the actor its 4 GPUs
        first_pid = info["pid"]
        info = wait_for(ray, actor, lambda i: i["restarts"] == 1 and i["state"] == "ready")
        assert info["pid"] != first_pid and info["last_exit"] == 1
        assert "out of memory" in info["diagnosis"].lower() and "TP2" in info["diagnosis"]
        log = "\n".join(ray.get(actor.log.remote(400)))
        assert "fired up and ready" in log
    finally:
        ray.get(actor.stop.remote())
        ray.kill(actor)


def test_crash_at_start_fails_start_with_the_root_cause(ray_local, tmp_path):
    ray = ray_local
    actor = worker(ray, tmp_path, "crash_at_start")
    try:
        with pytest.raises(ray.exceptions.RayTaskError) as e:
            ray.get(actor.start.remote(), timeout=60)
        msg = str(e.value)
        assert "exited with 1 during startup" in msg
        assert "no kernel image" in msg
        assert "TP0, TP1, TP2, TP3" in msg  # one cause, its ranks listed once
        info = ray.get(actor.info.remote())
        assert "no kernel image" in info["diagnosis"] and info["pid"] is None
    finally:
        ray.kill(actor)


def test_hang_hits_the_startup_timeout_and_leaves_no_process(ray_local, tmp_path):
    ray = ray_local
    actor = worker(ray, tmp_path, "hang", engine_startup_timeout=3)
    try:
        with pytest.raises(ray.exceptions.RayTaskError, match="not ready within 3s"):
            ray.get(actor.start.remote(), timeout=60)
        info = ray.get(actor.info.remote())
        assert info["pid"] is None and info["diagnosis"]
    finally:
        ray.kill(actor)


def test_restart_limit_marks_the_worker_failed(ray_local, tmp_path):
    ray = ray_local
    actor = worker(ray, tmp_path, "crash_later")  # every start crashes 1.5 s after becoming ready
    try:
        ray.get(actor.start.remote(), timeout=60)
        info = wait_for(ray, actor, lambda i: i["state"] == "failed", timeout=60)
        assert info["restarts"] == 2
    finally:
        ray.get(actor.stop.remote())
        ray.kill(actor)


def ray_logs(ray) -> dict[str, str]:
    """Every file under this Ray session's log directory (the job log: the actors' stdout/stderr), by path."""
    logs = ray._private.worker._global_node.get_logs_dir_path()
    out = {}
    for root, _, files in os.walk(logs):
        for name in files:
            path = os.path.join(root, name)
            try:
                with open(path, "rb") as f:
                    out[path] = f.read().decode(errors="replace")
            except OSError:
                pass
    return out


def test_the_worker_key_never_reaches_the_job_log(ray_local, tmp_path):
    """SGLang logs ``server_args`` with ``api_key`` in clear; a crash then puts the log's last lines into the
    diagnosis the worker prints and keeps. None of it may carry the key."""
    ray = ray_local
    key = "pdserve-cluster-KEY-7f3a9c"
    actor = worker(ray, tmp_path, "crash_later,ready", api_key=key)
    try:
        ray.get(actor.start.remote(), timeout=60)
        info = wait_for(ray, actor, lambda i: i["restarts"] == 1 and i["state"] == "ready")
        tail = ray.get(actor.log.remote(400))

        def forwarded():  # the actor's stdout file has both starts' server_args lines
            return "\n".join(ray_logs(ray).values()).count("[prefill-0] [") and \
                sum(t.count("server_args={") for t in ray_logs(ray).values()) >= 2

        wait_until(forwarded, 30, interval=0.2, what="both server_args lines in the job log", retry=())
    finally:
        ray.get(actor.stop.remote())
        ray.kill(actor)
    leaked = [path for path, text in ray_logs(ray).items() if key in text]
    assert not leaked, f"the worker key is in {leaked}"
    assert key not in "\n".join(tail) and key not in (info["diagnosis"] or "")
    assert sum("'api_key': '<redacted>'" in line for line in tail) == 2  # both starts logged it, redacted
