"""The Prometheus file_sd targets file the launcher keeps current (monitoring/prometheus.yml reads it).

Format (Prometheus ``file_sd_configs`` JSON): a list of ``{"targets": ["host:port"], "labels": {...}}``.
Labels: ``component`` (``router``, ``engine``, ``launcher``); engines add ``role`` (``prefill`` /
``decode``) and ``worker_name`` (``prefill-0``). None of them collides with a label the router,
the engines or the launcher's exporter put on their own metrics, so Prometheus keeps both.

Default path: ``<Ray session dir>/pdserve_prometheus_targets_<router port>.json`` next to Ray's own
``prom_metrics_service_discovery.json``, i.e. ``/tmp/ray/session_latest/...`` on the head node for
Ray's default temp dir; config ``monitoring.targets_file`` overrides it. One file per cluster (keyed by
its router port, unique on a node) so several clusters on one Ray head do not overwrite each other's
targets; monitoring/prometheus.yml reads them all by glob.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional
from urllib.parse import urlsplit

TARGETS_FILE_PREFIX = "pdserve_prometheus_targets"
RAY_DEFAULT_SESSION = Path("/tmp/ray/session_latest")


def ray_session_dir() -> Path:
    """The session dir of the connected Ray cluster, or /tmp/ray/session_latest when this process is not
    connected to Ray (the head's own session dir for Ray's default temp dir)."""
    try:  # Ray has no public API for the session dir; its metrics agent writes its own file there
        import ray._private.worker as ray_worker

        node = ray_worker._global_node
        if node is not None:
            return Path(node.get_session_dir_path())
    except (ImportError, AttributeError):
        pass
    return RAY_DEFAULT_SESSION


def default_targets_path(router_port: int) -> Path:
    """``<ray_session_dir()>/pdserve_prometheus_targets_<router_port>.json``."""
    return ray_session_dir() / f"{TARGETS_FILE_PREFIX}_{router_port}.json"


def scrape_address(host: str, port: int, node_ip: Optional[str] = None) -> str:
    """``host:port`` Prometheus can reach: a wildcard bind address (0.0.0.0, ::, empty) becomes
    ``node_ip`` (default: this node's IP as Ray sees it).

    Raises:
        ValueError: ``port`` outside 1..65535.
    """
    if not 0 < port < 65536:
        raise ValueError(f"port must be in 1..65535, got {port}")
    if host in ("", "0.0.0.0", "::", "[::]"):
        if node_ip is None:
            import ray

            node_ip = ray.util.get_node_ip_address()
        host = node_ip
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def build_targets(router: Optional[str], workers: list[dict], launcher: Optional[str]) -> list[dict]:
    """The file_sd document.

    Args:
        router: the router's ``host:port`` (None: not running yet).
        workers: worker infos as ``EngineWorker.info()`` returns them (``name``, ``role``, ``url``);
            workers without a URL yet are left out.
        launcher: the launcher exporter's ``host:port`` (None: not running).
    """
    out = []
    if router:
        out.append({"targets": [router], "labels": {"component": "router"}})
    for w in sorted(workers, key=lambda w: w["name"]):
        if not w.get("url"):
            continue
        out.append({"targets": [urlsplit(w["url"]).netloc],
                    "labels": {"component": "engine", "role": w["role"], "worker_name": w["name"]}})
    if launcher:
        out.append({"targets": [launcher], "labels": {"component": "launcher"}})
    return out


class TargetsFile:
    """Writes the targets file atomically (Prometheus may read it at any moment), only when the
    content changes.

    Args:
        path: where to write; its directory is created.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._last: Optional[str] = None

    def write(self, targets: list[dict]) -> bool:
        """Write ``targets``; returns whether the file changed.

        Raises:
            OSError: the directory cannot be created or written.
        """
        text = json.dumps(targets, indent=2) + "\n"
        if text == self._last:
            return False
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, self.path)
        self._last = text
        return True

    def remove(self) -> None:
        """Delete the file (the cluster is going away: Prometheus drops its targets at the next
        file_sd refresh); a missing file is fine."""
        self.path.unlink(missing_ok=True)
        self._last = None
