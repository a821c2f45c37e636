"""PD across Ray nodes that are separate hosts: network namespaces on a bridge (tests/netns.py), one Ray node
each (tests/ray_netns.py), the cluster submitted with `ray job submit --working-dir` from a client namespace.

Host ``b`` holds prefill workers (custom resource ``prefill_node``), host ``c`` the decode worker
(``decode_node``) and room for one more prefill; the head holds only the launcher and the router. Checked:
every engine advertises its own host's address (URL, bootstrap, Mooncake session), the KV crosses hosts over
Mooncake TCP, PD output equals the null engine's, and the cluster rides out host ``c`` being SIGKILLed and
being cut off for 20 s: requests in flight end within stated bounds, no KV page stays held on ``b``, and once
``c``'s Ray node is back the launcher's workers are re-placed there by Ray and re-admitted by the router.
"""

from __future__ import annotations

import os
import re
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from netns import leftovers_of, namespaces_unavailable, sweep_leftovers
from pd.util.wait import wait_until
from ray_cluster import wait_pids_gone

pytestmark = [pytest.mark.cluster,
              pytest.mark.skipif(bool(namespaces_unavailable()), reason=namespaces_unavailable() or "")]

GEN = {"temperature": 0, "max_new_tokens": 12}
PROMPTS = ["the quick brown fox", "multi-node prefill and decode", "bootstrap room 7", "KV pages over TCP"]
STREAM_IDLE = 5.0  # the router's timeouts.stream_idle here: a silent decode stream ends after this
CONNECT = 2.0      # timeouts.connect: a cut-off worker costs a retry at most this long
FIRST_TOKEN = 8.0  # timeouts.first_token: a request sent on a kept-alive connection into a partition waits this
LOST_BOUND = 30.0  # a lost node: Ray declares it dead in ~3-6 s (tests/ray_netns.py), the launcher polls every 2 s
RECOVER_BOUND = 90.0  # from a rejoined Ray node to a 200 through the router (engine start included)


def cluster_config(router_host: str, prefill_replicas: int = 1, prefill_policy: str | None = None) -> dict:
    """The embedded default placed by custom resources, with short router timeouts and checks for the faults."""
    return {
        "model_path": "builtin:tiny", "engine": "reference",
        "cluster": {"num_gpus": 4, "gpus_per_node": 2},
        "prefill": {"replicas": prefill_replicas, "tp_size": 1, "placement": {"resources": {"prefill_node": 1}}},
        "decode": {"replicas": 1, "tp_size": 1, "placement": {"resources": {"decode_node": 1}}},
        "transfer": {"backend": "mooncake", "protocol": "tcp"},
        "router": {"host": router_host, "port": 8000, "drain_timeout_secs": 2, "prefill_policy": prefill_policy,
                   "timeouts": {"connect": CONNECT, "first_token": FIRST_TOKEN, "stream_idle": STREAM_IDLE,
                                "request": 120},
                   "health_check": {"interval_secs": 1, "timeout_secs": 1, "failure_threshold": 2}},
    }


@pytest.fixture(scope="module")
def cluster(model_cache):
    from ray_netns import NamespaceCluster

    sweep_leftovers()  # what a killed earlier run left, never a live run's
    c = NamespaceCluster({"b": (2, {"prefill_node": 2}), "c": (2, {"decode_node": 1, "prefill_node": 1})})
    try:
        yield c
    finally:
        ours = [pid for h in c.net.hosts.values() for pid in h.pids()]  # Ray, actors, engines, router
        c.stop()
        assert leftovers_of(os.getpid()) == [], "the namespace test left namespaces or links behind"
        assert wait_pids_gone(ours, 15) == [], "processes of the namespace hosts outlived the test"
        assert not os.path.exists(c.tmp)


@pytest.fixture(scope="module")
def job(cluster):
    """The 1P (host b) + 1D (host c) cluster, prefills routed with kv_aware: (job id, router URL, workers by
    role)."""
    head = cluster.net.hosts["head"].address
    job = cluster.submit_config(cluster_config(head, prefill_policy="kv_aware"))
    try:
        url = cluster.wait_log(job, r"pdserve: router ready at (\S+)").group(1)
        workers = {w["role"]: w for w in cluster.workers(job)}
        yield job, url, workers
    finally:
        if not re.search(r"STOPPED|SUCCEEDED|FAILED", cluster.status(job)):
            cluster.stop_job(job)


def metric(url: str, name: str) -> float:
    """Sum of ``name``'s samples on ``url``/metrics."""
    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name)


def generate(url: str, prompt: str, timeout: float = 30) -> httpx.Response:
    return httpx.post(url + "/generate", json={"text": prompt, "sampling_params": GEN}, timeout=timeout)


def null_ids(engines, prompt: str) -> list[int]:
    r = httpx.post(engines["null"].url + "/generate", json={"text": prompt, "sampling_params": GEN}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def veth_bytes(cluster, label: str) -> int:
    """Bytes that crossed host ``label``'s link to the bridge, both ways (the root side's counters)."""
    base = f"/sys/class/net/{cluster.net.hosts[label].veth}/statistics/"
    return sum(int(open(base + f).read()) for f in ("rx_bytes", "tx_bytes"))


class Streams:
    """Long streaming requests through the router, each on its own thread: when it ended and how."""

    def __init__(self, url: str, n: int):
        self.ends: dict[int, tuple[float, int, str]] = {}
        self.started = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(url, i), daemon=True) for i in range(n)]
        self._first = [threading.Event() for _ in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, url: str, i: int) -> None:
        body = {"text": f"stream {i}", "stream": True,
                "sampling_params": {"max_new_tokens": 100_000, "temperature": 0, "ignore_eos": True}}
        last = ""
        status = 0
        try:
            with httpx.stream("POST", url + "/generate", json=body, timeout=httpx.Timeout(10, read=60)) as r:
                status = r.status_code
                for line in r.iter_lines():
                    if line:
                        last = line
                        self._first[i].set()
        except httpx.HTTPError as e:
            last = f"client error {e!r}"
        self._first[i].set()
        self.ends[i] = (time.monotonic(), status, last)

    def wait_first_bytes(self, timeout: float = 30) -> None:
        for e in self._first:
            assert e.wait(timeout), "a stream got no first token"

    def wait_ended(self, timeout: float) -> dict[int, tuple[float, int, str]]:
        for t in self.threads:
            t.join(timeout)
        assert len(self.ends) == len(self.threads), f"streams still open after {timeout}s: {self.ends}"
        return self.ends


def assert_streams_failed_clearly(ends: dict, since: float, bound: float) -> None:
    for i, (at, status, last) in ends.items():
        assert at - since <= bound, f"stream {i} ended {at - since:.1f}s after the fault (bound {bound}s)"
        # the router ends a broken decode stream with an error event, then [DONE]
        assert status == 200 and last == "data: [DONE]" or '"error"' in last, (i, status, last)


def wait_pages_free(worker: dict, timeout: float) -> None:
    """No KV page held or quarantined on ``worker`` (polls its /metrics)."""
    wait_until(lambda: metric(worker["url"], "pdserve_kv_pages_held") == 0
               and metric(worker["url"], "pdserve_kv_pages_quarantined") == 0,
               timeout, interval=0.5, what=f"{worker['name']} holding no KV page", retry=(httpx.HTTPError,))


def wait_serving(url: str, since: float, bound: float) -> None:
    """Poll the router until a request succeeds, within ``bound`` s of ``since``."""
    def ok() -> bool:
        return generate(url, "back?", timeout=10).status_code == 200

    wait_until(ok, bound - (time.monotonic() - since), interval=1, what="a 200 through the router",
               retry=(httpx.HTTPError,))


def wait_recovered(cluster, job: str, url: str, since: float, bound: float) -> str:
    """``wait_serving``, then the URL the launcher says decode-0 is ready again at."""
    wait_serving(url, since, bound)
    again = re.findall(r"pdserve: decode-0 is ready again at (\S+)", cluster.logs(job))
    assert again, "the launcher did not say it started decode-0 again"
    return again[-1]


def test_engines_advertise_their_own_hosts_and_kv_crosses_over_tcp(cluster, job, engines):
    jid, url, workers = job
    b, c = cluster.net.hosts["b"], cluster.net.hosts["c"]
    pre, dec = workers["prefill"], workers["decode"]
    assert url == f"http://{cluster.net.hosts['head'].address}:8000"
    assert (pre["host"], dec["host"]) == (b.address, c.address)
    assert pre["url"].startswith(f"http://{b.address}:") and dec["url"].startswith(f"http://{c.address}:")
    logs = cluster.logs(jid)
    # the Mooncake session each engine registers is its host's address, never loopback
    sessions = dict(re.findall(r"\[(prefill-0|decode-0)\] .*transfer session (\S+?):\d+", logs))
    assert sessions == {"prefill-0": b.address, "decode-0": c.address}, sessions
    assert "127.0.0.1" not in " ".join(w["url"] for w in workers.values())
    # the router pairs by the prefill's bootstrap host: B's address, as the admin API lists it
    key_file = cluster.wait_log(jid, r"admin API at \S+/workers; its key is in (\S+) ").group(1)
    key = open(key_file).read().strip()
    listed = httpx.get(url + "/workers", headers={"Authorization": f"Bearer {key}"}, timeout=5).json()["workers"]
    assert sorted((w["worker_type"], w["url"]) for w in listed) == [("decode", dec["url"]), ("prefill", pre["url"])]
    assert [w["bootstrap_host"] for w in listed if w["worker_type"] == "prefill"] == [b.address], listed
    before = {r: metric(w["url"], "pdserve_kv_transfer_bytes_total") for r, w in workers.items()}
    link_before = veth_bytes(cluster, "c")
    for p in PROMPTS:
        r = generate(url, p)
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == null_ids(engines, p), p
    sent = {r: metric(w["url"], "pdserve_kv_transfer_bytes_total") - before[r] for r, w in workers.items()}
    assert sent["prefill"] > 0 and sent["prefill"] == sent["decode"], sent
    # the KV bytes went through host c's link (the bridge), not a loopback inside one namespace
    assert veth_bytes(cluster, "c") - link_before >= sent["decode"]


def router_kv(url: str, worker: str) -> dict[str, float]:
    """The router's ``pdserve_router_kv_*`` samples about ``worker`` (and its fallbacks, by reason), by name."""
    text = httpx.get(url + "/metrics", timeout=5).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("pdserve_router_kv_") and s.labels.get("worker", worker) == worker:
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def test_kv_aware_router_follows_the_prefills_events_across_hosts(cluster, job):
    """The launcher has the prefill on host b publish its KV events on b's own address; the router on the head
    subscribes across the bridge, its index mirrors what the engine caches, and it predicts the cached tokens
    the engine then reports."""
    jid, url, workers = job
    pre, b = workers["prefill"], cluster.net.hosts["b"]
    pub, _ = pre["kv_events_ports"]  # reserved on b by the launcher; the decode publishes none
    assert workers["decode"]["kv_events_ports"] is None
    endpoint = f"tcp://{b.address}:{pub}"  # what the prefill's /server_info told the router
    cluster.wait_log(jid, rf"\[router\] .*kv_aware: following KV events of {re.escape(pre['url'])} at "
                          rf"{re.escape(endpoint)} \(pages of 16 tokens\)", timeout=30)
    prompt = [3 + (7 * i) % 250 for i in range(52)]  # 3 whole pages of 16 tokens, and 4 more

    def send() -> dict:
        r = httpx.post(url + "/generate", json={"input_ids": prompt, "sampling_params": GEN}, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["meta_info"]

    before = router_kv(url, pre["url"])
    assert send()["cached_tokens"] == 0
    # the 3 pages' BlockStored event crosses from b to the head: the index holds what the engine keeps
    engine_pages = before["pdserve_router_kv_index_blocks"] + 3
    wait_until(lambda: router_kv(url, pre["url"])["pdserve_router_kv_index_blocks"] == engine_pages, 10,
               interval=0.2, what="the router's index holding the prompt's pages", retry=(httpx.HTTPError,))
    assert metric(pre["url"], "pdserve_kv_pages_cached") == engine_pages
    assert send()["cached_tokens"] == 48  # a hit stops short of the whole prompt
    after = router_kv(url, pre["url"])
    gained = {k: after[k] - before[k] for k in after if k.endswith("_cached_tokens_total")}
    assert gained == {"pdserve_router_kv_predicted_cached_tokens_total": 48,
                      "pdserve_router_kv_reported_cached_tokens_total": 48}, after
    assert 0 <= after["pdserve_router_kv_events_lag_seconds"] < 60
    assert after["pdserve_router_kv_fallbacks_total"] == 0


def test_host_killed_with_requests_in_flight_then_rejoined(cluster, job, engines):
    jid, url, workers = job
    streams = Streams(url, 3)
    streams.wait_first_bytes()
    killed_at = time.monotonic()
    assert cluster.kill_host("c"), "nothing ran on host c"
    assert_streams_failed_clearly(streams.wait_ended(STREAM_IDLE + 10), killed_at, STREAM_IDLE + 5)
    # before a first byte: retried on the (only, dead) decode, then a clear 5xx, fast
    t = time.monotonic()
    r = generate(url, "while c is down")
    assert r.status_code in (502, 503) and r.json()["error"]["message"], r.text
    assert time.monotonic() - t < 2 * CONNECT + 5
    lost = cluster.wait_log(jid, r"pdserve: decode-0 lost: [^\n]*", timeout=LOST_BOUND).group(0)
    dead = cluster.wait_log(jid, r"pdserve: Ray declared decode-0's node dead: [^\n]*", timeout=LOST_BOUND).group(0)
    assert cluster.net.hosts["c"].address in lost and cluster.net.hosts["c"].address in dead, (lost, dead)
    cluster.wait_log(jid, r"router: removed decode-0", timeout=10)
    wait_pages_free(workers["prefill"], 10)
    assert generate(url, "no decode").status_code == 503
    rejoined = time.monotonic()
    cluster.nodes["c"].start()
    cluster.wait_alive({"head", "b", "c"})
    new = wait_recovered(cluster, jid, url, rejoined, RECOVER_BOUND)
    print(f"kill: serving again {time.monotonic() - rejoined:.1f}s after host c's Ray node restarted")
    assert new.startswith(f"http://{cluster.net.hosts['c'].address}:")
    assert generate(url, PROMPTS[0]).json()["output_ids"] == null_ids(engines, PROMPTS[0])
    wait_pages_free(workers["prefill"], 10)


def test_host_cut_off_for_20s_then_healed(cluster, job, engines):
    jid, url, workers = job
    c = cluster.net.hosts["c"]
    cluster.make_whole()  # whatever the previous test left
    wait_serving(url, time.monotonic(), RECOVER_BOUND)
    streams = Streams(url, 3)
    streams.wait_first_bytes()
    supervisor = cluster.nodes["c"].supervise()  # as systemd's Restart=always would
    try:
        cut_at = time.monotonic()
        c.link(False)
        # a silent decode: the router ends each stream after stream_idle with an error event
        assert_streams_failed_clearly(streams.wait_ended(STREAM_IDLE + 10), cut_at, STREAM_IDLE + 5)
        t = time.monotonic()
        r = generate(url, "while c is cut off")
        assert r.status_code in (502, 503, 504) and r.json()["error"]["message"], r.text
        took = time.monotonic() - t
        assert took < FIRST_TOKEN + 2 * CONNECT + 5, f"a request during the partition took {took:.1f}s"
        lost = cluster.wait_log(jid, r"pdserve: decode-0 lost: [^\n]*", timeout=LOST_BOUND)
        assert c.address in lost.group(0)
        wait_pages_free(workers["prefill"], 20)
        time.sleep(max(0.0, 20 - (time.monotonic() - cut_at)))  # the partition's length is the scenario
        healed = time.monotonic()
        c.link(True)
        new = wait_recovered(cluster, jid, url, healed, RECOVER_BOUND)
        print(f"partition: serving again {time.monotonic() - healed:.1f}s after the link came back "
              f"(host c's Ray node restarted {supervisor.restarts}x)")
        assert new.startswith(f"http://{c.address}:")
        assert generate(url, PROMPTS[1]).json()["output_ids"] == null_ids(engines, PROMPTS[1])
    finally:
        supervisor.stop()
    wait_pages_free(workers["prefill"], 10)


def test_two_prefill_on_b_one_prefill_and_decode_on_c(cluster, job, engines):
    cluster.stop_job(job[0])  # its GPUs go back to Ray: this layout takes all four
    cluster.make_whole()
    head = cluster.net.hosts["head"].address
    jid = cluster.submit_config(cluster_config(head, prefill_replicas=3))
    try:
        url = cluster.wait_log(jid, r"pdserve: router ready at (\S+)").group(1)
        workers = cluster.workers(jid)
        hosts = sorted((w["role"], w["host"]) for w in workers)
        b, c = cluster.net.hosts["b"].address, cluster.net.hosts["c"].address
        assert hosts == sorted([("prefill", b), ("prefill", b), ("prefill", c), ("decode", c)]), hosts
        ports = [(w["host"], p) for w in workers for p in (w["port"], w["bootstrap_port"]) if p]
        assert len(ports) == len(set(ports)) == 7
        prefills = [w for w in workers if w["role"] == "prefill"]
        before = [metric(w["url"], "pdserve_kv_transfer_bytes_total") for w in prefills]
        for i in range(6):  # round robin: every prefill serves two
            p = PROMPTS[i % len(PROMPTS)]
            r = generate(url, p)
            assert r.status_code == 200 and r.json()["output_ids"] == null_ids(engines, p), r.text
        after = [metric(w["url"], "pdserve_kv_transfer_bytes_total") for w in prefills]
        assert all(a > b0 for a, b0 in zip(after, before)), (before, after)
    finally:
        cluster.stop_job(jid)
