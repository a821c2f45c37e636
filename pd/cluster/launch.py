"""The Ray job entrypoint: bring up a PD cluster from a config, serve until stopped.

    ray job submit --address http://HEAD:8265 --working-dir . -- python -m pd.launch deploy/X.yaml

Steps: connect to Ray; one STRICT_PACK placement group per worker (its TP ranks on one node);
one EngineWorker actor per engine holding its GPUs; unique ports per node; start every engine and
wait for readiness; start the router (its settings and the workers' URLs and bootstrap ports as
JSON in ``$PDSERVE_ROUTER_CONFIG``, the keys in their own variables); print
``pdserve: router ready at URL`` and a ``pdserve: workers [...]`` JSON line; serve worker state
and restarts to Prometheus and keep its targets file current (``monitoring`` config); keep the
router's workers in step with the actors through its admin API (a worker back on other ports is
swapped in, a failed one removed); with ``planner.mode`` advise or act, run the P:D split controller every
``planner.interval_secs`` (pd.cluster.split_planner); block. On SIGTERM/SIGINT (``ray job stop``, Ctrl-C): drain the
router's workers (``router.drain_timeout_secs``), stop the router, stop the engines, kill the actors,
remove the placement groups. Engines and the router also die with their parent process, so a
SIGKILLed job leaves nothing behind either.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import sys
import threading
import time
from typing import Optional

import httpx

from pd.cluster.procs import popen_group, stop_group
from pd.config import ConfigError, PDConfig, load_config, parse_config
from pd.util.admin_key import admin_key_file_name
from pd.util.wait import wait_until

CONFIG_ENV = "PDSERVE_CONFIG_YAML"  # `pdserve up` ships the config text here (works for any path)
PG_READY_TIMEOUT = 120.0


class Shutdown(Exception):
    """Raised in the main thread by SIGTERM/SIGINT."""


def say(msg: str) -> None:
    """Print a launcher message (prefixed ``pdserve:``) to the job log, flushed at once."""
    print(f"pdserve: {msg}", flush=True)


class Launcher:
    """Owns the placement groups, worker actors and router process of one deployment."""

    def __init__(self, cfg: PDConfig):
        self.cfg = cfg
        self.pgs: list = []
        self.actors: list = []
        self.workers: list[dict] = []
        self.router = None
        # The router's admin API (worker membership, drain on stop) is keyed; the key travels in
        # the router's environment, never on a command line.
        self.admin_key = cfg.router.admin_api_key or secrets.token_urlsafe(24)
        # One key per cluster for the engines (their --api-key, the bootstrap servers' too), sent by the
        # router to the workers it was started with and re-adds; hex, so SGLang's parser never reads it as
        # a flag. In environments and an owner-only file, never on a command line or in the log.
        self.worker_key = cfg.router.worker_api_key or secrets.token_hex(32)
        self.membership = None  # pd.cluster.membership.Membership, once the router answers
        self.exporter = None  # pd.cluster.worker_metrics.WorkerStateExporter
        self.targets = None  # pd.cluster.prom_targets.TargetsFile
        self.slots = None  # pd.cluster.actor_slots.ActorSlots, once every worker started
        self.admin_key_file = None  # where announce_admin_api wrote a generated admin key
        self.planner = None  # pd.cluster.split_planner.SplitPlanner, with planner.mode advise or act
        self.actuator = None  # pd.cluster.split_actuator.RayActuator, its hands
        self._membership_lock = threading.Lock()  # the serve loop and a move's thread both change membership

    def check_resources(self) -> None:
        """Raises ConfigError when the cluster cannot hold the config."""
        import ray

        have = ray.cluster_resources().get("GPU", 0)
        need = self.cfg.total_gpus()
        if need > have:
            pre, dec = self.cfg.prefill, self.cfg.decode
            raise ConfigError(f"the config needs {need} GPUs (prefill {pre.replicas}x{pre.tp_size}, "
                              f"decode {dec.replicas}x{dec.tp_size}); the Ray cluster has {have:g}")

    def start(self) -> None:
        """Place and start every worker, then the router and the metrics endpoint; returns when the router answers.

        Raises ConfigError when the Ray cluster lacks the GPUs or a bundle cannot be placed within
        PG_READY_TIMEOUT (naming the missing resource), RuntimeError when an engine or the router fails to start.
        The caller's ``shutdown()`` stops whatever was started."""
        import ray
        from ray.util.placement_group import placement_group

        from pd.cluster.actor_slots import ActorSlot, ActorSlots
        from pd.cluster.placement_check import unplaceable_reason

        self.check_resources()
        specs = []
        nodes = ray.nodes()
        for role, group in self.cfg.groups().items():
            for i in range(group.replicas):
                bundle = {"GPU": group.tp_size, **group.placement.resources}
                kwargs = {}
                if group.placement.node_labels:
                    kwargs["bundle_label_selector"] = [dict(group.placement.node_labels)]
                why = unplaceable_reason(bundle, group.placement.node_labels, nodes)
                if why:  # an autoscaler may still add such a node, so this only warns
                    say(f"{role}-{i}: {why}; waiting up to {PG_READY_TIMEOUT:g}s for one to join")
                pg = placement_group([bundle], strategy="STRICT_PACK", name=f"pdserve-{role}-{i}", **kwargs)
                self.pgs.append(pg)
                specs.append((role, i, group, pg, bundle))
        names = []
        for role, i, group, pg, bundle in specs:
            try:
                ray.get(pg.ready(), timeout=PG_READY_TIMEOUT)
            except ray.exceptions.GetTimeoutError:
                why = unplaceable_reason(bundle, group.placement.node_labels, ray.nodes()) or \
                    "the nodes that could hold it are taken by other placement groups"
                raise ConfigError(f"{role}-{i}: Ray could not place a bundle {bundle} within {PG_READY_TIMEOUT:g}s: "
                                  f"{why} (check {role}.placement)") from None
            gpu_ids = group.gpus[i] if group.gpus is not None else None
            actor = self._new_actor(f"{role}-{i}", role, pg, gpu_ids)
            self.actors.append(actor)
            names.append((f"{role}-{i}", role))
        # Ports are handed out one worker at a time so two workers on a node never collide.
        used: dict[str, list[int]] = {}
        infos = []
        here = ray.get_runtime_context().get_node_id()
        for actor in self.actors:
            actor_info = ray.get(actor.info.remote())
            node_host = actor_info["host"]
            if _is_loopback(self.cfg.engine_host) and actor_info["node_id"] != here:
                raise ConfigError(f"{actor_info['name']} runs on another node, where engine_host "
                                  f"{self.cfg.engine_host} cannot be reached: leave engine_host unset on a "
                                  "multi-node cluster (each engine then listens on its node's Ray address)")
            info = ray.get(actor.reserve_ports.remote(used.get(node_host, [])))
            used.setdefault(node_host, []).extend(p for p in (info["port"], info["bootstrap_port"],
                                                              *(info.get("kv_events_ports") or ())) if p)
            infos.append(info)
        say(f"starting {len(self.actors)} engines: " + ", ".join(f"{i['name']}@{i['host']}:{i['port']}" for i in infos))
        self.workers = ray.get([a.start.remote() for a in self.actors])
        self.slots = ActorSlots([ActorSlot(n, r, a, info) for (n, r), a, info in zip(names, self.actors, self.workers)],
                                say, max_start_attempts=max(1, self.cfg.restart.max_restarts))
        say("workers " + json.dumps(self.workers))
        self.start_router()
        self.start_monitoring()
        self.start_planner()

    def _new_actor(self, name: str, role: str, pg, gpu_ids: Optional[list[int]]):
        """An EngineWorker actor in placement group ``pg``."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from pd.cluster.worker import EngineWorker

        # max_restarts=-1: when its node dies, Ray re-places the bundle and restarts the actor there
        # (pd.cluster.actor_slots starts its engine again).
        return ray.remote(EngineWorker).options(
            num_cpus=0, num_gpus=self.cfg.groups()[role].tp_size, max_restarts=-1,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
        ).remote(name, role, self.cfg.model_dump(), gpu_ids, self.cfg.engine_host, self.worker_key)

    def router_workers(self) -> list[dict]:
        """The workers a (re)started router begins with: those that are up (all known ones when a
        side has none up: its health checks sort them out)."""
        ready = [w for w in self.workers if w.get("state") == "ready" and w.get("url")]
        if not all(any(w["role"] == role for w in ready) for role in ("prefill", "decode")):
            ready = [w for w in self.workers if w.get("url")]
        return ready

    def router_argv(self) -> list[str]:
        """The router's command line: ``pdserve router`` alone (its settings travel in ``router_env``)."""
        return [sys.executable, "-m", "pd.cli", "router"]

    def router_config(self):
        """The router's settings (the config's ``router`` section) and ``router_workers()``, keys left
        out (``router_env`` passes them in their own variables): a pd.router.config.RouterConfig."""
        from pd.router.config import RouterConfig, RouterSettings

        settings = self.cfg.router.model_dump(include=set(RouterSettings.model_fields),
                                              exclude={"api_key", "admin_api_key", "worker_api_key"})
        workers = self.router_workers()
        return RouterConfig(**settings,
                            prefill=[{"url": w["url"], "bootstrap_port": w["bootstrap_port"]}
                                     for w in workers if w["role"] == "prefill"],
                            decode=[w["url"] for w in workers if w["role"] == "decode"])

    def router_env(self) -> dict[str, str]:
        """Environment for the router process: ours plus its settings as JSON (``router_config()``),
        the admin key, the cluster's worker key and, when set, the API key (in the environment, where
        ``ps`` does not show them)."""
        from pd.router.config import ADMIN_KEY_ENV, API_KEY_ENV, CONFIG_ENV, WORKER_KEY_ENV

        env = dict(os.environ, **{ADMIN_KEY_ENV: self.admin_key, WORKER_KEY_ENV: self.worker_key,
                                  CONFIG_ENV: self.router_config().model_dump_json()})
        if self.cfg.router.api_key:
            env[API_KEY_ENV] = self.cfg.router.api_key
        return env

    def router_admin_url(self) -> str:
        """Base URL of the router's admin API as reachable from this host (a wildcard bind becomes 127.0.0.1)."""
        r = self.cfg.router
        host = "127.0.0.1" if r.host in ("0.0.0.0", "::", "") else r.host
        return f"http://[{host}]:{r.port}" if ":" in host else f"http://{host}:{r.port}"

    def sync_router(self, infos: list[dict]) -> None:
        """Tell the router about workers that moved, left or came back (pd.cluster.membership); a worker the split
        controller is moving is left to the move (pd.cluster.split_actuator)."""
        self.workers = infos
        moving = self.actuator.moving if self.actuator is not None else set()
        if self.membership is not None:
            mine = [i for s, i in zip(self.slots.slots, infos) if id(s) not in moving] if self.slots else infos
            with self._membership_lock:
                self.membership.sync(mine)

    # ---- the split controller's needs (pd.cluster.split_actuator, pd.cluster.split_mover) ------------------------
    def admit(self, info: dict) -> None:
        """Put a moved worker into the router (its membership entry under its new name)."""
        with self._membership_lock:
            if self.membership is not None:
                self.membership.sync([info])

    def retire(self, info: dict) -> None:
        """Take a drained worker out of the router before its engine stops."""
        with self._membership_lock:
            if self.membership is not None:
                self.membership.sync([{**info, "state": "stopped"}])

    def adopt(self, slot) -> None:
        """Add a worker ``place_replica`` started to the slots (the serve loop's thread: the next poll sees it)."""
        self.actors.append(slot.actor)
        self.slots.slots.append(slot)

    def start_router(self) -> None:
        """Start the router process group and wait until it answers; raises RuntimeError if it exits or times out."""
        import subprocess

        r = self.cfg.router
        self.router = popen_group(self.router_argv(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  env=self.router_env())
        threading.Thread(target=self._forward_router_log, args=(self.router,), daemon=True).start()
        url = f"http://{r.host}:{r.port}"

        def ready() -> bool:
            if self.router.poll() is not None:
                raise RuntimeError(f"the router exited with {self.router.returncode} "
                                   f"(is port {r.port} free? set router.port)")
            return httpx.get(url + "/health", timeout=2).status_code == 200

        try:
            wait_until(ready, 60, interval=0.2, what=f"the router answering {url}/health",
                       retry=(httpx.HTTPError,))
        except TimeoutError as e:
            raise RuntimeError(f"the router did not answer {url}/health within 60s") from e
        from pd.cluster.membership import Membership
        from pd.router.admin_client import AdminClient

        self.membership = Membership(AdminClient(self.router_admin_url(), self.admin_key), say, self.worker_key)
        self.membership.seed(self.router_workers())
        say(f"router ready at {url}")
        self.announce_admin_api()

    def announce_admin_api(self) -> None:
        """Say where the router's admin API is and where its key is, never the key itself: a generated key
        goes to an owner-only file in the Ray session dir (``pdserve_admin_key_<router port>``, removed on
        stop; where ``pdserve bench`` and other tools look, pd.util.admin_key); a configured one is the config's
        ``router.admin_api_key``."""
        admin = self.router_admin_url()
        if self.cfg.router.admin_api_key:
            say(f"admin API at {admin}/workers (key: the config's router.admin_api_key)")
            return
        from pd.cluster.prom_targets import ray_session_dir

        path = ray_session_dir() / admin_key_file_name(self.cfg.router.port)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(self.admin_key + "\n")
        except OSError as e:
            say(f"admin API at {admin}/workers; could not write its key file {path}: {e.strerror} "
                "(set router.admin_api_key to use the admin API)")
            return
        self.admin_key_file = path
        say(f"admin API at {admin}/workers; its key is in {path} on this node: "
            f"curl -H \"Authorization: Bearer $(cat {path})\" {admin}/workers")

    def start_monitoring(self) -> None:
        """Serve worker state and engine restarts (pd.cluster.worker_metrics) and write the Prometheus
        targets file (pd.cluster.prom_targets) that monitoring/prometheus.yml reads."""
        from pd.cluster.prom_targets import TargetsFile, default_targets_path
        from pd.cluster.worker_metrics import WorkerStateExporter

        m, host = self.cfg.monitoring, self.cfg.router.host
        self.exporter = WorkerStateExporter()
        try:
            self.exporter.start(host, m.metrics_port)
        except OSError as e:
            raise RuntimeError(f"cannot serve the launcher's metrics on {host}:{m.metrics_port}: {e} "
                               "(set monitoring.metrics_port)") from None
        self.targets = TargetsFile(m.targets_file or default_targets_path(self.cfg.router.port))
        self.publish(self.workers)
        say(f"prometheus targets in {self.targets.path}; launcher metrics on port {self.exporter.port}")

    def start_planner(self) -> None:
        """With ``planner.mode`` advise or act, the P:D split controller (pd.cluster.split_planner) over the router's
        admin API, its decisions counted by the launcher's exporter.

        Raises:
            ConfigError: ``planner.profile`` cannot be read or has no entry for the workers' TP size.
        """
        pc = self.cfg.planner
        if pc.mode == "off":
            return
        from pd.cluster.split_actuator import RayActuator
        from pd.cluster.split_mover import SplitMover
        from pd.cluster.split_planner import RouterPlannerState, SplitPlanner
        from pd.planner.controller import Policy, SplitController
        from pd.router.admin_client import AdminClient

        scorer = None
        if pc.profile:
            from pd.planner.live_model import ModelScorer
            from pd.planner.profile import ProfileError, load_profile
            from pd.planner.simulate import SLO

            try:
                scorer = ModelScorer(load_profile(pc.profile), self.cfg.prefill.tp_size,
                                     SLO(pc.slo_ttft_ms / 1e3, pc.slo_tpot_ms / 1e3), pc.slo_attainment)
            except ProfileError as e:
                raise ConfigError(f"planner.profile: {e}") from None
        policy = Policy(slo_attainment=pc.slo_attainment, band=pc.attainment_band, min_requests=pc.min_requests,
                        cooldown_secs=pc.cooldown_secs, cooldown_restarts=pc.cooldown_restarts,
                        hold_secs=pc.hold_secs, hold_restarts=pc.hold_restarts, min_gain=pc.min_gain)
        admin = AdminClient(self.router_admin_url(), self.admin_key)
        self.actuator = RayActuator(self, SplitMover(admin, self.admit, self.retire, pc.settle_timeout_secs, say),
                                    PG_READY_TIMEOUT)
        self.planner = SplitPlanner(pc, SplitController(policy, scorer), self.actuator, RouterPlannerState(admin, say),
                                    self.router_admin_url(), self.exporter, say)
        say(f"planner: {pc.mode} every {pc.interval_secs:g}s (SLO TTFT {pc.slo_ttft_ms:g} ms, TPOT "
            f"{pc.slo_tpot_ms:g} ms at {100 * pc.slo_attainment:g}%; "
            f"{'model: ' + pc.profile if pc.profile else 'measured attainment only'}); "
            f"GET {self.router_admin_url()}/planner shows it")

    def publish(self, infos: list[dict]) -> None:
        """Hand the latest worker infos to the exporter; rewrite the targets file if they moved."""
        from pd.cluster.prom_targets import build_targets, scrape_address

        if self.exporter is None:
            return
        self.exporter.update(infos)
        r = self.cfg.router
        try:
            self.targets.write(build_targets(scrape_address(r.host, r.port), infos,
                                             scrape_address(r.host, self.exporter.port)))
        except OSError as e:  # monitoring must not take the cluster down
            say(f"could not write {self.targets.path}: {e}")

    @staticmethod
    def _forward_router_log(proc) -> None:
        for raw in proc.stdout:
            print(f"[router] {raw.decode(errors='replace').rstrip()}", flush=True)

    def serve(self) -> None:
        """Block; report worker state changes; restart the router if it dies."""
        last: dict[str, tuple] = {}
        while True:
            time.sleep(2)
            if self.router is not None and self.router.poll() is not None:
                say(f"router exited with {self.router.returncode}; restarting it")
                self.start_router()
            infos = self.slots.poll()  # a lost node's workers come back "lost" (pd.cluster.actor_slots)
            self.sync_router(infos)
            self.publish(infos)
            if self.planner is not None and self.planner.due():
                self.planner.tick(infos)
            for info in infos:
                key = (info["state"], info["restarts"])
                if last.get(info["name"]) not in (None, key):
                    say(f"{info['name']} is {info['state']} "
                        f"(restarts {info['restarts']}, last exit {info['last_exit']})")
                last[info["name"]] = key

    def shutdown(self) -> None:
        """Stop everything this launcher started; safe to call at any point of start()."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if self.targets is not None:  # Prometheus stops scraping what is about to go away
            try:
                self.targets.remove()
            except OSError:
                pass
        if self.admin_key_file is not None:
            self.admin_key_file.unlink(missing_ok=True)
        if self.exporter is not None:
            self.exporter.stop()
        if self.router is not None:
            if self.membership is not None and self.router.poll() is None and self.cfg.router.drain_timeout_secs > 0:
                say(f"draining the router's workers "
                    f"(up to {self.cfg.router.drain_timeout_secs:g}s for requests in flight)")
                if not self.membership.drain_all(self.cfg.router.drain_timeout_secs):
                    say("some requests were still in flight; stopping anyway")
            stop_group(self.router.pid)
        lost = {id(s.actor) for s in self.slots.slots if s.lost_reason} if self.slots is not None else set()
        try:  # a lost worker's actor would hold this up to the deadline: ray.kill below is all it gets
            ray.get([a.stop.remote() for a in self.actors if id(a) not in lost], timeout=30)
        except Exception as e:
            say(f"some workers did not stop cleanly: {e!r}")
        for a in self.actors:
            ray.kill(a)
        for pg in self.pgs:
            try:
                remove_placement_group(pg)
            except Exception:
                pass
        say("stopped")


def _is_loopback(host: Optional[str]) -> bool:
    import ipaddress

    try:
        return host is not None and (host == "localhost" or ipaddress.ip_address(host).is_loopback)
    except ValueError:
        return False


def _raise_shutdown(signum, _frame):
    raise Shutdown(signal.Signals(signum).name)


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m pd.launch [CONFIG]``: run one cluster until SIGTERM/SIGINT, then stop all of it.

    Returns 0 on a clean stop, 2 for a bad config, failed preflight or unplaceable layout, 1 when a start fails."""
    p = argparse.ArgumentParser(prog="python -m pd.launch", description="Run a pdserve PD cluster as a Ray job.")
    p.add_argument("config", nargs="?",
                   help="cluster config YAML (default: $PDSERVE_CONFIG_YAML, else deploy/local.yaml)")
    args = p.parse_args(argv)
    try:
        if args.config is None and os.environ.get(CONFIG_ENV):
            import yaml

            cfg = parse_config(yaml.safe_load(os.environ[CONFIG_ENV]), f"${CONFIG_ENV}")
        else:
            cfg = load_config(args.config)
    except ConfigError as e:
        print(f"pdserve: invalid config:\n{e}", file=sys.stderr)
        return 2
    from pd.tools.doctor import preflight

    if not preflight(cfg):  # prints warnings and errors; errors stop the launch
        print("pdserve: the preflight checks failed (see above; `pdserve doctor CONFIG` runs them alone)",
              file=sys.stderr)
        return 2

    import ray

    signal.signal(signal.SIGTERM, _raise_shutdown)
    signal.signal(signal.SIGINT, _raise_shutdown)
    ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), log_to_driver=True)
    launcher = Launcher(cfg)
    try:
        launcher.start()
        launcher.serve()
    except Shutdown as s:
        say(f"received {s}; shutting down")
        return 0
    except ConfigError as e:
        print(f"pdserve: cannot deploy:\n{e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"pdserve: {e}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        launcher.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
