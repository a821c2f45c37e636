"""Which key the router sends to which worker, and where the admin API may add workers."""

import httpx
import pytest

from routers import RouterProc
from test_router_faults import running_standins

CLIENT_KEY, ADMIN_KEY, WORKER_KEY = "client-secret", "admin-secret", "cluster-secret"
AUTH = {"Authorization": f"Bearer {CLIENT_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
GEN = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}


@pytest.fixture(scope="module")
def si(tmp_path_factory):
    logs = str(tmp_path_factory.mktemp("worker-auth"))
    with running_standins(logs, "p0", "d0", "p1", "d1") as procs:
        yield procs


@pytest.fixture(scope="module")
def router(si, tmp_path_factory):
    """Started with p0/d0 (on 127.0.0.1, the cluster's node); localhost and 10.9.0.0/16 allowed besides."""
    r = RouterProc(["--prefill", si["p0"].url, str(si["p0"].bootstrap_port), "--decode", si["d0"].url,
                    "--api-key", CLIENT_KEY, "--admin-api-key", ADMIN_KEY, "--worker-api-key", WORKER_KEY,
                    "--allowed-worker-hosts", "localhost", "10.9.0.0/16", "--health-check-interval-secs", "0",
                    "--disable-retries"], str(tmp_path_factory.mktemp("worker-auth-router")))
    try:
        r.wait_ready()
        yield r
    finally:
        r.stop()


def admin(router, method, path="/workers", **kw):
    return httpx.request(method, router.url + path, headers=ADMIN, timeout=30, **kw)


def seen_auth(*standins) -> set:
    return {q["authorization"] for p in standins for q in p.state()["requests"]}


def test_admin_refuses_hosts_outside_the_cluster_and_its_allow_list(router, si):
    for url in ("http://192.0.2.77:30000", "http://127.0.0.2:30000", "http://gpu-9:30000"):
        r = admin(router, "POST", json={"url": url, "worker_type": "decode"})
        assert r.status_code == 403, r.text
        assert r.json()["error"]["param"] == "url" and "allowed_worker_hosts" in r.json()["error"]["message"]
    # an allowed network and an allowed name are taken
    r = admin(router, "POST", json={"url": "http://10.9.3.4:30000", "worker_type": "decode"})
    assert r.status_code == 201, r.text
    assert admin(router, "DELETE", params={"url": "http://10.9.3.4:30000"}).status_code == 200
    urls = {w["url"] for w in admin(router, "GET").json()["workers"]}
    assert urls == {si["p0"].url, si["d0"].url}


def test_started_workers_get_the_worker_key_added_ones_only_their_own(router, si):
    for p in si.values():
        p.reset()
    assert httpx.post(router.url + "/generate", json=GEN, headers=AUTH, timeout=30).status_code == 200
    assert seen_auth(si["p0"], si["d0"]) == {f"Bearer {WORKER_KEY}"}  # not the client key
    # p1/d1 added through the admin API (as localhost: allowed), without a key, then p0/d0 drained
    p1, d1 = si["p1"], si["d1"]
    assert admin(router, "POST", json={"url": f"http://localhost:{p1.port}", "worker_type": "prefill",
                                       "bootstrap_port": p1.bootstrap_port}).status_code == 201
    assert admin(router, "POST", json={"url": f"http://localhost:{d1.port}", "worker_type": "decode"}).status_code \
        == 201
    listed = {w["url"]: w for w in admin(router, "GET").json()["workers"]}
    assert listed[f"http://localhost:{d1.port}"]["api_key"] is False and listed[si["d0"].url]["api_key"] is True
    assert WORKER_KEY not in str(listed)
    for name in ("p0", "d0"):
        admin(router, "POST", "/workers/drain", json={"url": si[name].url, "timeout_secs": 0})
    assert httpx.post(router.url + "/generate", json=GEN, headers=AUTH, timeout=30).status_code == 200
    assert seen_auth(p1, d1) == {None}  # neither the client key nor the cluster's
    # re-added with a key of their own: they get exactly that one
    for w in (p1, d1):
        assert admin(router, "DELETE", params={"url": f"http://localhost:{w.port}"}).status_code == 200
        w.reset()
    bad = admin(router, "POST", json={"url": f"http://localhost:{d1.port}", "worker_type": "decode",
                                      "api_key": "two words"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "api_key"
    assert admin(router, "POST", json={"url": f"http://localhost:{p1.port}", "worker_type": "prefill",
                                       "bootstrap_port": p1.bootstrap_port, "api_key": "own-key"}).status_code == 201
    assert admin(router, "POST", json={"url": f"http://localhost:{d1.port}", "worker_type": "decode",
                                       "api_key": "own-key"}).status_code == 201
    assert httpx.post(router.url + "/generate", json=GEN, headers=AUTH, timeout=30).status_code == 200
    assert seen_auth(p1, d1) == {"Bearer own-key"}
