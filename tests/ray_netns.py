"""A Ray cluster of separate hosts on one machine: one `ray start` per network namespace (tests/netns.py).

Host ``head`` runs `ray start --head`; worker hosts join it with `ray start --address`, each with its own
logical GPUs and custom resources; host ``client`` runs the `ray job` CLI against the head's dashboard as a
user's laptop would. Every Ray process of a host lives in that host's namespace, so "kill the host" is
SIGKILL to the namespace's PIDs and a partition is its link going down.

Ray's node health check is shortened on the head (Ray's defaults: every 3 s, dead after 5 misses, so
about 15 s) so a lost node is declared dead in about 3 s; docs/cluster.md "Multi-node" names the same settings.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import threading
from typing import Optional

import httpx

from engines import ROOT
from netns import Host, Network
from pd.util.wait import wait_until
from ray_cluster import BIN, RayHead

GCS_PORT, DASHBOARD_PORT = 6379, 8265
# A node is dead after 3 health checks 1 s apart fail (each waits 1 s): ~3-6 s after it goes silent.
# A node that cannot reach the GCS for 10 s ends its raylet (Ray's default: 60 s), so a cut-off node
# rejoins as soon as its link is back instead of waiting for its old connections to time out.
HEALTH_CHECK_ENV = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "1000",
                    "RAY_health_check_failure_threshold": "3", "RAY_health_check_initial_delay_ms": "1000",
                    "RAY_gcs_rpc_server_reconnect_timeout_s": "10"}


class RayNode:
    """One `ray start --block` in a host's namespace, in its own process group and temp dir.

    Args:
        host: the namespace host (netns.Host).
        head: None to start the head, else the head's address to join.
        num_gpus: logical GPUs Ray gives this node.
        resources: custom resources, e.g. ``{"decode_node": 2}``.
    """

    def __init__(self, host: Host, tmp: str, env: dict, head: Optional[str] = None, num_gpus: int = 0,
                 resources: Optional[dict] = None):
        self.host, self.env, self.head = host, env, head
        self.tmp = os.path.join(tmp, host.label)
        self.num_gpus, self.resources = num_gpus, resources or {}
        self.proc: Optional[subprocess.Popen] = None
        self.starts = 0

    def start(self) -> None:
        argv = [os.path.join(BIN, "ray"), "start", "--block", "--node-ip-address", self.host.address,
                "--num-cpus", "4", "--num-gpus", str(self.num_gpus), "--temp-dir", self.tmp, "--disable-usage-stats"]
        if self.resources:
            argv += ["--resources", json.dumps(self.resources)]
        if self.head is None:
            argv += ["--head", "--port", str(GCS_PORT), "--dashboard-host", self.host.address,
                     "--dashboard-port", str(DASHBOARD_PORT)]
        else:
            argv += ["--address", self.head]
        self.starts += 1
        log = open(os.path.join(os.path.dirname(self.tmp), f"{self.host.label}-{self.starts}.log"), "wb")
        self.proc = subprocess.Popen(self.host.argv(*argv), stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                     cwd=ROOT, start_new_session=True)
        log.close()

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def supervise(self, restart_sec: float = 1.0) -> "Supervisor":
        """Start this node again whenever it exits, ``restart_sec`` later, until ``stop()``: what a systemd
        unit with ``Restart=always`` does for `ray start --block` (docs/cluster.md "Multi-node")."""
        return Supervisor(self, restart_sec)


class Supervisor:
    """The thread behind ``RayNode.supervise``."""

    def __init__(self, node: RayNode, restart_sec: float):
        self.node, self.restart_sec = node, restart_sec
        self._stop = threading.Event()
        self.restarts = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.restart_sec):
            if not self.node.running():
                self.restarts += 1
                self.node.start()

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(10)


class NamespaceCluster(RayHead):
    """A head and worker hosts, each its own namespace and Ray node; job methods (``submit``, ``wait_log``,
    ``workers``, ``stop_job``) from RayHead, run in the client namespace.

    Args:
        workers: label -> (num_gpus, custom resources) for each worker host.
    """

    def __init__(self, workers: dict[str, tuple[int, dict]]):
        self.net = Network(("head", *workers, "client"))
        self.tmp = tempfile.mkdtemp(prefix="pdn-", dir="/tmp")  # short: Ray puts sockets under it
        self.env = dict(os.environ, PATH=BIN + os.pathsep + os.environ.get("PATH", ""), **HEALTH_CHECK_ENV)
        head = self.net.hosts["head"]
        self.address = f"http://{head.address}:{DASHBOARD_PORT}"
        self.gcs = f"{head.address}:{GCS_PORT}"
        self.prefix = self.net.hosts["client"].argv()
        self.nodes = {"head": RayNode(head, self.tmp, self.env)}
        for label, (gpus, res) in workers.items():
            self.nodes[label] = RayNode(self.net.hosts[label], self.tmp, self.env, self.gcs, gpus, res)
        try:
            self._token_auth()
            self.nodes["head"].start()
            self._wait_dashboard()
            self._token_auth()  # the head may have just written the token
            for label in workers:
                self.nodes[label].start()
            self.wait_alive(set(self.nodes))
        except BaseException:
            self.stop()
            raise

    def _token_auth(self) -> None:
        """With ``~/.ray/auth_token`` present the head requires Ray's token authentication, and every joining
        node and `ray` CLI call needs ``RAY_AUTH_MODE=token`` ("InvalidAuthToken" otherwise)."""
        if os.path.exists(os.path.expanduser("~/.ray/auth_token")):
            self.env["RAY_AUTH_MODE"] = "token"

    def _wait_dashboard(self) -> None:
        def up() -> bool:
            if not self.nodes["head"].running():
                raise RuntimeError("the Ray head exited: " + self.node_log("head")[-3000:])
            return httpx.get(self.address + "/api/version", timeout=2).status_code in (200, 401)

        wait_until(up, 120, interval=0.5, what=f"the Ray dashboard at {self.address}", retry=(httpx.HTTPError,))

    def node_log(self, label: str) -> str:
        node = self.nodes[label]
        with open(os.path.join(self.tmp, f"{label}-{node.starts}.log"), errors="replace") as f:
            return f.read()

    def alive_nodes(self) -> dict[str, str]:
        """node IP -> node id of the nodes Ray's state API calls ALIVE."""
        token = os.path.expanduser("~/.ray/auth_token")
        headers = {"Authorization": "Bearer " + open(token).read().strip()} if os.path.exists(token) else {}
        r = httpx.get(self.address + "/api/v0/nodes?limit=100", timeout=5, headers=headers)
        r.raise_for_status()
        return {n["node_ip"]: n["node_id"] for n in r.json()["data"]["result"]["result"] if n["state"] == "ALIVE"}

    def wait_alive(self, labels: set[str], timeout: float = 120) -> dict[str, str]:
        """Poll until exactly the hosts ``labels`` are alive Ray nodes; returns IP -> node id."""
        want = {self.net.hosts[label].address for label in labels}

        def check():
            for label in labels:
                if not self.nodes[label].running():
                    raise RuntimeError(f"ray start on {label} exited: " + self.node_log(label)[-3000:])
            alive = self.alive_nodes()
            return alive if set(alive) == want else None

        return wait_until(check, timeout, interval=0.5, what=f"Ray nodes {sorted(labels)} alive",
                          retry=(httpx.HTTPError, KeyError, ValueError))

    def make_whole(self) -> None:
        """Every host linked and its Ray node running and alive (after a test that left one down)."""
        for label, node in self.nodes.items():
            self.net.hosts[label].link(True)
            if not node.running():
                node.start()
        self.wait_alive(set(self.nodes))

    def ray(self, *args: str, timeout: float = 120) -> str:
        self._token_auth()
        out = subprocess.run([*self.prefix, os.path.join(BIN, "ray"), *args], capture_output=True, text=True,
                             env=self.env, cwd=ROOT, timeout=timeout)
        if out.returncode != 0:
            raise RuntimeError(f"ray {' '.join(args)} failed: {out.stdout[-2000:]}\n{out.stderr[-2000:]}")
        return out.stdout + out.stderr

    def submit_config(self, cfg: dict) -> str:
        """`ray job submit --working-dir .` of ``python -m pd.launch`` with ``cfg`` as $PDSERVE_CONFIG_YAML."""
        import yaml

        env = json.dumps({"env_vars": {"PDSERVE_CONFIG_YAML": yaml.safe_dump(cfg)}})
        return self.submit("python", "-m", "pd.launch", options=("--runtime-env-json", env))

    def kill_host(self, label: str) -> list[int]:
        """SIGKILL every process in ``label``'s namespace (its raylet, actors, engines); returns the PIDs."""
        from netns import kill_ns_processes

        return kill_ns_processes(self.net.hosts[label].name)

    def stop(self) -> None:
        """Stop every Ray node (process groups, then whatever is left in the namespaces) and remove the network."""
        from pd.cluster.procs import stop_group

        for node in reversed(list(self.nodes.values())):
            if node.proc is not None:
                stop_group(node.proc.pid, grace=5)
        self.net.teardown()
        shutil.rmtree(self.tmp, ignore_errors=True)
