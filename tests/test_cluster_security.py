"""The embedded default deployed on a Ray node whose address is not loopback (as `ray start --head` gives
by default): the cluster's key reaches every engine and the router but no command line, the engines
refuse calls without it, and nothing of ours listens on a non-loopback address (Mooncake's own ports
aside: it always binds every interface, docs/security.md "What listens where")."""

import contextlib
import ipaddress
import os
import socket

import httpx
import psutil
import pytest
import yaml

from engines import ROOT, free_port
from netns import local_address
from pd.engines.settings import API_KEY_ENV
from ray_cluster import RayHead

pytestmark = pytest.mark.cluster  # starts Ray (conftest.py: test tiers)

MOONCAKE_PORTS = range(15000, 17001)  # Mooncake's RPC and TCP transport ports (MC_MIN/MAX_RPC_PORT defaults)
GEN = {"text": "hi", "sampling_params": {"max_new_tokens": 2, "temperature": 0}}


def lan_address() -> str | None:
    """The address of this machine a default route leaves from, or None when there is no route out of it (a
    loopback-only network namespace) or it is a loopback address."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
        except OSError:  # ENETUNREACH: no route
            return None
        ip = s.getsockname()[0]
    return None if ipaddress.ip_address(ip).is_loopback else ip


@pytest.fixture(scope="module")
def lan_head(model_cache):
    """A Ray head whose node address is not loopback: the LAN address, else one made here for the test
    (netns.local_address: a veth pair's address, e.g. in a loopback-only network namespace)."""
    with contextlib.ExitStack() as stack:
        ip = lan_address()
        if ip is None:
            try:
                ip = stack.enter_context(local_address())
            except (RuntimeError, OSError) as e:  # not root, no `ip`, no veth driver
                pytest.skip(f"no non-loopback address here, and none could be added: {e}")
        head = RayHead(num_gpus=2, node_ip=ip)
        try:
            yield head
        finally:
            head.stop()


def listening(pid: int) -> list[tuple[str, int]]:
    return [(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN]


def test_local_yaml_on_a_lan_node_keys_and_bind_addresses(lan_head):
    router_port = free_port()
    cfg = yaml.safe_load(open(os.path.join(ROOT, "deploy", "local.yaml")))
    cfg["router"]["port"] = router_port
    cfg["cluster"]["num_gpus"] = 2
    path = os.path.join(ROOT, "deploy", f".test-security-{router_port}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    try:
        job = lan_head.submit("python", "-m", "pd.launch", os.path.relpath(path, ROOT))
    finally:
        os.remove(path)
    try:
        url = lan_head.wait_log(job, r"pdserve: router ready at (\S+)").group(1)
        workers = lan_head.workers(job)
        engines = {w["name"]: w for w in workers}
        # every engine got the one cluster key, in its environment
        keys = {psutil.Process(w["pid"]).environ().get(API_KEY_ENV) for w in workers}
        assert len(keys) == 1 and None not in keys
        key = keys.pop()
        assert len(key) >= 32
        # ... and it is on no command line of this machine (engines, router, actors, launcher, Ray)
        for proc in psutil.process_iter(["cmdline"]):
            assert key not in " ".join(proc.info["cmdline"] or []), proc.pid
        assert key not in lan_head.logs(job)
        # the engines refuse a caller without it; the router sends it
        for w in workers:
            r = httpx.post(w["url"] + "/generate", json=GEN, timeout=30)
            assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}, w["name"]
        r = httpx.post(url + "/generate", json=GEN, timeout=60)
        assert r.status_code == 200, r.text
        # bind addresses: HTTP and bootstrap on loopback; only Mooncake's two ports on the wildcard
        for name, w in engines.items():
            assert w["url"].startswith("http://127.0.0.1:"), w["url"]
            socks = listening(w["pid"])
            ours = {w["port"], w["bootstrap_port"]} - {None}
            assert {p for _, p in socks} >= ours, (name, socks)
            wide = [(ip, p) for ip, p in socks if not ipaddress.ip_address(ip).is_loopback]
            assert all(p in MOONCAKE_PORTS and p not in ours for _, p in wide), (name, wide)
            assert len(wide) <= 2, (name, wide)
        router_pids = {c.pid for c in psutil.net_connections(kind="inet")
                       if c.status == psutil.CONN_LISTEN and c.laddr.port == router_port}
        assert router_pids
        for pid in router_pids:  # the router (and nothing else of ours on its port) on loopback only
            assert all(ipaddress.ip_address(ip).is_loopback for ip, _ in listening(pid)), listening(pid)
    finally:
        lan_head.stop_job(job)
