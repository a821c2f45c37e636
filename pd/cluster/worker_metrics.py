"""The launcher's Prometheus exporter: what only the worker actors know (engine restarts, state).

Metrics (labels ``worker`` = the engine URL as the router labels it, ``worker_name`` =
``prefill-0``, ``role``):

- ``pdserve_worker_restarts_total``: engine restarts by the worker actor (counter);
- ``pdserve_worker_state{state}``: 1 for the actor's current state (created, starting, ready,
  restarting, failed, stopped, lost), 0 for the others;
- ``pdserve_worker_ready``: 1 while the engine is ready.

The launcher calls :meth:`WorkerStateExporter.update` with the infos it polls every few seconds;
scrapes read the latest snapshot.
"""

from __future__ import annotations

import threading
from typing import Iterable, Optional

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

STATES = ("created", "starting", "ready", "restarting", "failed", "stopped",  # pd/cluster/worker.py's states
          "lost")  # the actor does not answer: its node died (pd.cluster.actor_slots)
LABELS = ["worker", "worker_name", "role"]


class WorkerStateExporter:
    """A prometheus_client collector over the latest worker infos, with its own HTTP server."""

    def __init__(self) -> None:
        self._infos: list[dict] = []
        self._lock = threading.Lock()
        self.registry = CollectorRegistry()
        self.registry.register(self)
        self._server = None
        self.port: Optional[int] = None

    def update(self, infos: Iterable[dict]) -> None:
        """Replace the snapshot with ``infos`` (``EngineWorker.info()`` dicts: name, role, url,
        state, restarts)."""
        with self._lock:
            self._infos = [dict(i) for i in infos]

    def collect(self):
        """prometheus_client's collector hook: the metric families of the current snapshot."""
        with self._lock:
            infos = list(self._infos)
        restarts = CounterMetricFamily("pdserve_worker_restarts", "Engine restarts by the worker actor.", labels=LABELS)
        state = GaugeMetricFamily("pdserve_worker_state", "1 for the worker actor's current state.",
                                  labels=LABELS + ["state"])
        ready = GaugeMetricFamily("pdserve_worker_ready", "1 while the worker's engine is ready.", labels=LABELS)
        for i in infos:
            key = [i.get("url") or "", i["name"], i["role"]]
            restarts.add_metric(key, i.get("restarts", 0))
            for s in STATES:
                state.add_metric(key + [s], 1.0 if i.get("state") == s else 0.0)
            ready.add_metric(key, 1.0 if i.get("state") == "ready" else 0.0)
        yield from (restarts, state, ready)

    def start(self, host: str, port: int = 0) -> int:
        """Serve /metrics on ``host:port`` (0 = a free port) in a daemon thread; returns the port.

        Raises:
            OSError: the address is in use or cannot be bound.
        """
        self._server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self.port = self._server.server_port
        return self.port

    def stop(self) -> None:
        """Stop serving (idempotent)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
