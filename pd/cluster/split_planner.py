"""The P:D split controller's loop in the launcher: every ``planner.interval_secs``, read the metrics, decide,
report, and -- in ``act`` mode -- start the step.

One tick (pd.cluster.launch's serve loop calls :meth:`SplitPlanner.tick` with the workers' latest infos):

1. collect the moves and adds that ended since the last tick (the controller's cooldown starts there);
2. scrape the router's and every serving engine's ``/metrics`` into the window (pd.planner.live_metrics);
3. read the operator's override from the router (``GET /planner``), build the snapshot, decide
   (pd.planner.controller);
4. count the decision (``pdserve_planner_decisions_total{action,reason}``), log it when it is not a repeat
   (``pdserve: planner ...``), report the state to the router (``GET /planner`` shows it);
5. ``act`` only: hand a move or an add to the actuator (pd.cluster.split_actuator), which runs it in the
   background; ``advise`` never calls it.

Everything it touches is injected -- the clock, the fetch of a metrics page, the router's planner state, the
actuator -- so the loop runs in tests without Ray or a network.
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Protocol

import httpx

from pd.config import Planner
from pd.planner.controller import Decision, SplitController
from pd.planner.live_metrics import ROUTER, MetricsWindow, reduce_text


class Actuator(Protocol):
    """Carries the controller's steps out (pd.cluster.split_actuator.RayActuator in the launcher)."""

    def busy(self) -> bool:
        """A move or an add is under way."""

    def done(self) -> list:
        """The pd.cluster.split_mover.MoveResult (or add results) that ended since the last call."""

    def free_slots(self) -> int:
        """Replicas that can be added now (0 when adding is off)."""

    def move(self, worker: dict, to_role: str) -> None:
        """Start moving ``worker`` (its info) to ``to_role``; returns at once."""

    def add(self, role: str) -> None:
        """Start adding a replica in ``role``; returns at once."""


class PlannerState(Protocol):
    """Where the override is read and the controller's state shown (the router's admin API)."""

    def override(self) -> Optional[tuple[int, int]]:
        """The pinned (prefill, decode), or None."""

    def report(self, state: dict) -> None:
        """Show ``state`` (``GET /planner``)."""


class RouterPlannerState:
    """PlannerState over the router's admin API (pd.router.admin_client.AdminClient).

    Args:
        admin: the client; say: where a failed call is reported (once per failure streak).
    """

    def __init__(self, admin, say: Callable[[str], None]):
        self.admin, self.say = admin, say
        self._pin: Optional[tuple[int, int]] = None
        self._failing = False

    def override(self) -> Optional[tuple[int, int]]:
        """The router's pin; the last one known while the router does not answer."""
        from pd.router.admin_client import AdminError

        try:
            pin = self.admin.planner().get("override")
        except (AdminError, httpx.HTTPError) as e:
            if not self._failing:
                self.say(f"planner: cannot read the router's planner state: {e}")
            self._failing = True
            return self._pin
        self._failing = False
        self._pin = (pin["prefill"], pin["decode"]) if pin else None
        return self._pin

    def report(self, state: dict) -> None:
        """Post ``state`` to the router; a failure is dropped (the next tick reports again)."""
        from pd.router.admin_client import AdminError

        try:
            self.admin.report_planner(state)
        except (AdminError, httpx.HTTPError):
            pass


def http_fetch(url: str) -> str:
    """``url``'s body (a /metrics page), 5 s at most.

    Raises:
        httpx.HTTPError: no 200 answer.
    """
    r = httpx.get(url, timeout=5)
    r.raise_for_status()
    return r.text


class SplitPlanner:
    """The loop (module docstring).

    Args:
        cfg: the config's ``planner`` block.
        controller: decides (pd.planner.controller.SplitController).
        actuator: carries steps out.
        state: the override and the report (RouterPlannerState).
        router_url: the router's base URL, for its /metrics.
        exporter: counts decisions and moves (pd.cluster.worker_metrics.WorkerStateExporter), or None.
        say: the job log (``pdserve: ...``).
        clock: seconds, monotonic.
        fetch: GETs a metrics page (http_fetch).
    """

    def __init__(self, cfg: Planner, controller: SplitController, actuator: Actuator, state: PlannerState,
                 router_url: str, exporter=None, say: Callable[[str], None] = print,
                 clock: Callable[[], float] = time.monotonic, fetch: Callable[[str], str] = http_fetch):
        self.cfg, self.controller, self.actuator, self.state = cfg, controller, actuator, state
        self.router_url, self.exporter, self.say, self.clock, self.fetch = router_url, exporter, say, clock, fetch
        self.window = MetricsWindow(cfg.window_secs, cfg.slo_ttft_ms / 1e3, cfg.slo_tpot_ms / 1e3)
        self.next_at: Optional[float] = None
        self.last: Optional[Decision] = None
        self._said: Optional[tuple] = None

    def due(self) -> bool:
        """Whether a tick is due (the first one is, at once)."""
        return self.next_at is None or self.clock() >= self.next_at

    def tick(self, workers: list[dict]) -> Decision:
        """One round (module docstring) over the workers' latest infos; returns the decision."""
        now = self.clock()
        self.next_at = now + self.cfg.interval_secs
        for r in self.actuator.done():
            self.controller.moved(now)
            if self.exporter is not None:
                self.exporter.count_move(r.outcome)
            self.say(f"planner: {r.outcome}: {r.detail}")
        serving = [w for w in workers if w.get("state") == "ready" and w.get("url")]
        self._scrape(now, serving)
        starts = [w["start_seconds"] for w in workers if w.get("start_seconds")]
        snap = self.window.snapshot(now, {w["url"]: w["role"] for w in serving},
                                    free_slots=self.actuator.free_slots(), restart_s=max(starts, default=None),
                                    moving=self.actuator.busy(), override=self.state.override())
        d = self.controller.decide(snap)
        self.last = d
        self._publish(d, snap.moving)
        if self.cfg.mode == "act" and d.action != "hold":
            self._act(d, serving)
        return d

    def _scrape(self, now: float, serving: list[dict]) -> None:
        for source, url in [(ROUTER, self.router_url), *((w["url"], w["url"]) for w in serving)]:
            try:
                self.window.add(now, source, reduce_text(self.fetch(url + "/metrics")))
            except (httpx.HTTPError, ValueError):
                continue  # a worker restarting, the router restarting: its reading is missing this once
        self.window.forget({w["url"] for w in serving})

    def _publish(self, d: Decision, moving: bool) -> None:
        if self.exporter is not None:
            self.exporter.count_decision(d.action, d.reason)
            self.exporter.set_split(d.current, d.target)
        key = (d.action, d.reason, d.current, d.target)
        if d.action != "hold" or key != self._said:
            verb = "would" if self.cfg.mode == "advise" and d.action != "hold" else "does"
            self.say(f"planner ({self.cfg.mode}): {d.current[0]}P{d.current[1]}D -> {d.target[0]}P{d.target[1]}D: "
                     f"{verb} {d.action} ({d.reason}): {d.detail}")
            self._said = key
        self.state.report({"mode": self.cfg.mode, "target": {"prefill": d.target[0], "decode": d.target[1]},
                           "decision": d.describe(), "moving": moving})

    def _act(self, d: Decision, serving: list[dict]) -> None:
        if d.action.startswith("add_"):
            self.actuator.add(d.action.removeprefix("add_"))
            return
        to_role = d.action.removeprefix("move_to_")
        giver = "decode" if to_role == "prefill" else "prefill"
        router = self.window.latest(ROUTER)
        inflight = router.gauges if router is not None else {}
        candidates = [w for w in serving if w["role"] == giver]
        # the least busy worker drains fastest; among equals the last started (the newest name)
        victim = min(candidates, key=lambda w: (inflight.get(("inflight", w["url"]), 0.0), -_index(w["name"])))
        self.actuator.move(victim, to_role)


def _index(name: str) -> int:
    """``3`` of ``decode-3`` (-1 for another shape)."""
    tail = name.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else -1
