"""The launcher's Prometheus exporter: what only the worker actors know (engine restarts, state).

Metrics (labels ``worker`` = the engine URL as the router labels it, ``worker_name`` =
``prefill-0``, ``role``):

- ``pdserve_worker_restarts_total``: engine restarts by the worker actor (counter);
- ``pdserve_worker_state{state}``: 1 for the actor's current state (created, starting, ready,
  restarting, failed, stopped, lost), 0 for the others;
- ``pdserve_worker_ready``: 1 while the engine is ready.

And the P:D split controller's (pd.cluster.split_planner; none while ``planner.mode`` is off):

- ``pdserve_planner_decisions_total{action,reason}``: every decision, ``hold`` included (pd.planner.controller's
  ACTIONS and REASONS); in ``advise`` mode they are what it would do;
- ``pdserve_planner_moves_total{outcome}``: moves and adds carried out (moved, rolled_back, failed,
  drain_timeout, settle_timeout, added, add_failed);
- ``pdserve_planner_replicas{role,split}``: replicas per role, ``split`` = ``current`` or ``target``.

The launcher calls :meth:`WorkerStateExporter.update` with the infos it polls every few seconds;
scrapes read the latest snapshot.
"""

from __future__ import annotations

import threading
from typing import Iterable, Optional

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

STATES = ("created", "starting", "ready", "restarting", "failed", "stopped",  # pd/cluster/worker.py's states
          "lost",  # the actor does not answer: its node died (pd.cluster.actor_slots)
          "moving")  # the split controller is changing its role (pd.cluster.split_mover)
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
        self._decisions: dict[tuple[str, str], int] = {}
        self._moves: dict[str, int] = {}
        self._split: dict[tuple[str, str], int] = {}

    def update(self, infos: Iterable[dict]) -> None:
        """Replace the snapshot with ``infos`` (``EngineWorker.info()`` dicts: name, role, url,
        state, restarts)."""
        with self._lock:
            self._infos = [dict(i) for i in infos]

    def count_decision(self, action: str, reason: str) -> None:
        """One decision of the split controller."""
        with self._lock:
            self._decisions[(action, reason)] = self._decisions.get((action, reason), 0) + 1

    def count_move(self, outcome: str) -> None:
        """One move (or add) of the split controller ended with ``outcome``."""
        with self._lock:
            self._moves[outcome] = self._moves.get(outcome, 0) + 1

    def set_split(self, current: tuple[int, int], target: tuple[int, int]) -> None:
        """The split now and the one the controller aims at, (prefill, decode) replicas."""
        with self._lock:
            for split, (p, d) in (("current", current), ("target", target)):
                self._split[("prefill", split)], self._split[("decode", split)] = p, d

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
        with self._lock:
            decisions, moves, split = dict(self._decisions), dict(self._moves), dict(self._split)
        if not (decisions or split):
            return
        dec = CounterMetricFamily("pdserve_planner_decisions", "Decisions of the P:D split controller.",
                                  labels=["action", "reason"])
        for (action, reason), n in sorted(decisions.items()):
            dec.add_metric([action, reason], n)
        mv = CounterMetricFamily("pdserve_planner_moves", "Moves and adds by the split controller, by outcome.",
                                 labels=["outcome"])
        for outcome, n in sorted(moves.items()):
            mv.add_metric([outcome], n)
        reps = GaugeMetricFamily("pdserve_planner_replicas", "Replicas per role: the current split and the "
                                 "controller's target.", labels=["role", "split"])
        for (role, which), n in sorted(split.items()):
            reps.add_metric([role, which], n)
        yield from (dec, mv, reps)

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
