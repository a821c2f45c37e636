"""Moving one worker between prefill and decode while serving, without losing a request.

The steps, each with a deadline (``settle_timeout`` for the first two together):

1. **Drain** in the router (``POST /workers/drain``): no new pair includes the worker; wait until the router has
   no request in flight there.
2. **Settle**: the worker's engine holds nothing a peer may still use -- its ``/metrics`` shows no request running
   or queued (``sglang:num_running_reqs``, ``num_queue_reqs``, the PD bootstrap, prealloc and transfer queues)
   and no KV page held (``pdserve_kv_pages_held``, which counts pages kept for an abandoned KV write until the
   transfer engine settles it, and the draft's ``pdserve_draft_kv_pages_held``; SGLang: ``sglang:num_used_tokens``),
   and a prefill's bootstrap server has no room registered by a decode and none draining (its ``/health``). A
   moving prefill's rooms are the decodes' side of its transfers; a moving decode's pages are its own side.
   Past the deadline the drain is undone and the move given up (``drain_timeout`` / ``settle_timeout``): the
   worker serves on as it was.
3. **Retire** it from the router, **stop** its engine (the worker actor and its placement group stay), **start** it
   in the other role on fresh ports (a prefill has a bootstrap port a decode has not; its flags come from the
   config's group for that role, speculative settings included), wait for its ready path and ``/health``.
4. **Admit** it, and wait until the router lists it healthy in its new role.

A failure in 3 or 4 **rolls back**: the engine is started again in its old role and admitted (``rolled_back``);
if that fails too the worker is left stopped and said so (``failed``).

The worker itself is reached through ``WorkerOps`` (a Ray actor in the launcher: pd.cluster.split_actuator; a
subprocess in the tests), the router through its admin API, and the router's membership through ``admit`` /
``retire`` (the launcher's pd.cluster.membership), so the steps run the same everywhere.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pd.router.admin_client import AdminClient, AdminError
from pd.util.wait import wait_until

# Engine gauges that must read 0 before the engine may stop (SGLang's names, sglang/srt/observability/
# metrics_collector.py; the reference engine exports the first five; SGLang's prefill counts the requests whose KV it
# is still sending in the inflight queue, its decode the KV it has not yet freed in the deferred release queue).
BUSY_GAUGES = ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:num_prefill_bootstrap_queue_reqs",
               "sglang:num_decode_prealloc_queue_reqs", "sglang:num_decode_transfer_queue_reqs",
               "sglang:num_prefill_inflight_queue_reqs", "sglang:num_decode_deferred_kv_release_reqs")
PAGE_GAUGES = ("pdserve_kv_pages_held", "pdserve_draft_kv_pages_held")
SGLANG_PAGES = "sglang:num_used_tokens"  # where pdserve_kv_pages_held is not exported
HEALTH_TIMEOUT = 30.0  # s: a started engine's /health, then the router listing it healthy


class WorkerOps(Protocol):
    """One worker's engine, as the mover drives it."""

    def stop_engine(self) -> None:
        """Stop the engine for good (no restart by its supervisor); the worker (and its GPUs) stay."""

    def start_as(self, role: str, name: str) -> dict:
        """Start the engine in ``role`` as ``name`` on fresh ports and wait for its ready path; the worker's info
        (pd.cluster.worker.EngineWorker.info). Raises RuntimeError when it does not start."""


@dataclass
class MoveResult:
    """How a move ended.

    Attributes:
        outcome: ``moved``, ``rolled_back``, ``failed``, ``drain_timeout`` or ``settle_timeout``.
        name, from_role, to_role: the worker as it was, and the role asked for.
        info: the worker's info afterwards (its new name and URL when moved).
        seconds: the whole move; start_seconds: the engine's start in the new role (None if not reached).
        detail: what happened, for the log.
    """

    outcome: str
    name: str
    from_role: str
    to_role: str
    info: dict
    seconds: float
    start_seconds: Optional[float]
    detail: str


def engine_holdings(url: str, bootstrap_url: Optional[str], client: httpx.Client) -> dict[str, float]:
    """What the engine at ``url`` still holds: series name -> nonzero value (empty: settled); with
    ``bootstrap_url``, its bootstrap server's registered and draining rooms as ``bootstrap_rooms`` /
    ``bootstrap_draining`` (the reference engine's ``/health`` counts them; SGLang's answers ``OK`` and its rooms
    show in the inflight queue gauge instead).

    Raises:
        httpx.HTTPError: an endpoint did not answer (200).
    """
    r = client.get(url + "/metrics")
    r.raise_for_status()
    values: dict[str, float] = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            if s.name in BUSY_GAUGES or s.name in PAGE_GAUGES or s.name == SGLANG_PAGES:
                values[s.name] = values.get(s.name, 0.0) + s.value
    if "pdserve_kv_pages_held" in values:
        values.pop(SGLANG_PAGES, None)  # held pages are the finer count (no prefix cache pages)
    if bootstrap_url is not None:
        b = client.get(bootstrap_url + "/health")
        b.raise_for_status()
        try:
            body = b.json()
        except ValueError:
            body = None
        if isinstance(body, dict):
            values["bootstrap_rooms"] = float(body.get("rooms", 0))
            values["bootstrap_draining"] = float(body.get("draining", 0))
    return {k: v for k, v in values.items() if v}


def bootstrap_url(info: dict) -> Optional[str]:
    """The prefill's bootstrap server's base URL (None for a decode)."""
    if info.get("role") != "prefill" or not info.get("bootstrap_port"):
        return None
    host = info["host"]
    return f"http://[{host}]:{info['bootstrap_port']}" if ":" in host else f"http://{host}:{info['bootstrap_port']}"


class SplitMover:
    """Moves workers (module docstring: the steps).

    Args:
        admin: the router's admin API.
        admit: puts a started worker's info into the router (the launcher: its membership).
        retire: takes a drained worker's info out of the router.
        settle_timeout: seconds for the drain and the settle together.
        say: where each step is reported.
        poll: seconds between checks.
    """

    def __init__(self, admin: AdminClient, admit: Callable[[dict], None], retire: Callable[[dict], None],
                 settle_timeout: float, say: Callable[[str], None] = print, poll: float = 0.25):
        self.admin, self.admit, self.retire = admin, admit, retire
        self.settle_timeout, self.say, self.poll = settle_timeout, say, poll

    def move(self, info: dict, ops: WorkerOps, to_role: str, new_name: str) -> MoveResult:
        """Move the worker ``info`` describes to ``to_role`` as ``new_name``; never raises for a failed step (the
        result says how it ended)."""
        t0 = time.monotonic()
        name, role, url = info["name"], info["role"], info["url"]

        def result(outcome: str, now_info: dict, start_s: Optional[float], detail: str) -> MoveResult:
            return MoveResult(outcome, name, role, to_role, now_info, time.monotonic() - t0, start_s, detail)

        deadline = t0 + self.settle_timeout
        self.say(f"planner: moving {name} ({url}) to {to_role}: draining")
        try:
            self.admin.drain(url, 0)
            if not self.admin.drain(url, max(0.0, deadline - time.monotonic())):
                return self._give_up(info, "drain_timeout", f"requests still in flight after "
                                                            f"{self.settle_timeout:g}s", result)
        except (AdminError, httpx.HTTPError) as e:
            return self._give_up(info, "drain_timeout", f"the router did not drain it: {e}", result)
        held = self._settle(info, deadline)
        if held:
            return self._give_up(info, "settle_timeout", f"still held after {self.settle_timeout:g}s: {held}", result)
        self.say(f"planner: {name} drained and settled in {time.monotonic() - t0:.1f}s; restarting it as "
                 f"{new_name} ({to_role})")
        self.retire(info)
        start_s = None
        admitted: list[dict] = []
        try:
            ops.stop_engine()
            t_start = time.monotonic()
            new_info = ops.start_as(to_role, new_name)
            start_s = time.monotonic() - t_start
            self._admit_checked(new_info, admitted)
        except Exception as e:  # a failed start, health check or admission: roll back
            why = str(e).splitlines()[0] if str(e) else repr(e)
            self.say(f"planner: {new_name} did not come up as {to_role} ({why}); rolling back to {name} ({role})")
            for a in admitted:
                self.retire(a)
            return self._roll_back(info, ops, why, start_s, result)
        return result("moved", new_info, start_s, f"{name} -> {new_name} in {time.monotonic() - t0:.1f}s "
                                                  f"(engine start {start_s:.1f}s)")

    # ---- steps -------------------------------------------------------------------------------------------------
    def _settle(self, info: dict, deadline: float) -> dict:
        """Poll the engine until it holds nothing; what it still holds at the deadline (empty: settled)."""
        held: dict = {"unknown": 1.0}
        with httpx.Client(timeout=5) as client:
            def settled() -> bool:
                nonlocal held
                held = engine_holdings(info["url"], bootstrap_url(info), client)
                return not held

            try:
                wait_until(settled, max(0.0, deadline - time.monotonic()), interval=self.poll,
                           what=f"{info['name']} settled", retry=(httpx.HTTPError, ValueError))
            except TimeoutError:
                return held
        return {}

    def _admit_checked(self, info: dict, admitted: list[dict]) -> None:
        """``/health`` of the started engine, admission (``info`` appended to ``admitted``), then the router listing
        it healthy and not draining.

        Raises:
            TimeoutError: either not within HEALTH_TIMEOUT.
        """
        url = info["url"]
        wait_until(lambda: httpx.get(url + "/health", timeout=5).status_code == 200, HEALTH_TIMEOUT,
                   interval=self.poll, what=f"{url}/health answering 200", retry=(httpx.HTTPError,))
        admitted.append(info)
        self.admit(info)

        def listed() -> bool:
            return any(w["url"] == url and w["worker_type"] == info["role"] and w["is_healthy"] and not w["draining"]
                       for w in self.admin.workers())

        wait_until(listed, HEALTH_TIMEOUT, interval=self.poll, what=f"the router routing to {url}",
                   retry=(AdminError, httpx.HTTPError))

    def _give_up(self, info: dict, outcome: str, why: str, result) -> MoveResult:
        """The move stops before the engine did: undo the drain, the worker serves on."""
        try:
            self.admin.activate(info["url"])
        except (AdminError, httpx.HTTPError) as e:
            why += f"; undoing the drain failed too: {e} (the launcher's membership sync re-admits it)"
        self.say(f"planner: gave up moving {info['name']}: {why}; it serves on as {info['role']}")
        return result(outcome, info, None, why)

    def _roll_back(self, info: dict, ops: WorkerOps, why: str, start_s: Optional[float], result) -> MoveResult:
        try:
            ops.stop_engine()
            back = ops.start_as(info["role"], info["name"])
            self._admit_checked(back, [])
        except Exception as e:
            again = str(e).splitlines()[0] if str(e) else repr(e)
            self.say(f"planner: rollback of {info['name']} failed too ({again}); the worker is down")
            return result("failed", {**info, "state": "failed", "url": None}, start_s, f"{why}; rollback: {again}")
        self.say(f"planner: {info['name']} is back as {info['role']} at {back['url']}")
        return result("rolled_back", back, start_s, why)
