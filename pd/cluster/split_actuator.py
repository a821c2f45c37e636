"""The split controller's hands in the launcher: a move (pd.cluster.split_mover) or an added replica, run on a
background thread so the launcher's loop keeps polling the other workers and the router meanwhile.

At most one step at a time. The launcher's own bookkeeping (a moved slot's name and role, a new slot) changes only
in :meth:`RayActuator.done`, which the launcher's loop calls, so the slot list is never touched by two threads; the
router's membership is changed by the mover through the launcher's ``admit`` / ``retire``, under its lock, and
the loop leaves a moving worker out of its own membership sync until the move is collected.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from pd.cluster.split_mover import MoveResult, SplitMover

if TYPE_CHECKING:
    from pd.cluster.actor_slots import ActorSlot
    from pd.cluster.launch import Launcher


@dataclass
class AddResult:
    """How adding a replica ended: ``added`` (``slot`` is the new worker) or ``add_failed``."""

    outcome: str
    detail: str
    slot: Optional["ActorSlot"] = None


class RayWorkerOps:
    """pd.cluster.split_mover.WorkerOps over a worker actor (pd.cluster.worker.EngineWorker).

    Args:
        launcher: for the ports of the other workers on the node.
        slot: the worker's slot.
    """

    def __init__(self, actuator: "RayActuator", slot: "ActorSlot"):
        self.actuator, self.slot = actuator, slot

    def _get(self, ref, timeout: float):
        import ray

        try:
            return ray.get(ref, timeout=timeout)
        except ray.exceptions.RayTaskError as e:  # the actor method's own error, without Ray's wrapping
            raise RuntimeError(str(e.cause) if e.cause is not None else str(e)) from None

    def stop_engine(self) -> None:
        """Stop the engine (SIGTERM, SIGKILL after 10 s)."""
        self._get(self.slot.actor.stop_engine.remote(), 60)

    def start_as(self, role: str, name: str) -> dict:
        """Start the engine in ``role`` as ``name``; its info. Raises RuntimeError when it does not start."""
        taken = self.actuator.ports_taken(self.slot.info.get("host"), self.slot)
        return self._get(self.slot.actor.start_as.remote(role, name, taken),
                         self.actuator.launcher.cfg.engine_startup_timeout + 60)


class RayActuator:
    """pd.cluster.split_planner.Actuator for a launcher (module docstring).

    Args:
        launcher: the cluster's launcher (its slots, ports, membership, placement).
        mover: the move's steps.
        pg_ready_timeout: seconds an added replica's placement group may take to be placed.
    """

    def __init__(self, launcher: "Launcher", mover: SplitMover, pg_ready_timeout: float):
        self.launcher, self.mover, self.pg_ready_timeout = launcher, mover, pg_ready_timeout
        self._thread: Optional[threading.Thread] = None
        self._results: collections.deque = collections.deque()
        self.moving: set[int] = set()  # id() of the slots being moved

    def busy(self) -> bool:
        """A step is under way (or ended and not yet collected by ``done``)."""
        return (self._thread is not None and self._thread.is_alive()) or bool(self._results)

    @property
    def slots(self) -> list["ActorSlot"]:
        return self.launcher.slots.slots

    def free_name(self, role: str) -> str:
        """The first ``<role>-<i>`` no worker has."""
        names = {s.name for s in self.slots} | {s.info.get("name") for s in self.slots}
        return next(f"{role}-{i}" for i in range(len(names) + 1) if f"{role}-{i}" not in names)

    def ports_taken(self, host: Optional[str], but: Optional["ActorSlot"] = None) -> list[int]:
        """The ports the workers on ``host`` hold (``but`` that one's)."""
        return [p for o in self.slots if o is not but and o.info.get("host") == host
                for p in (o.info.get("port"), o.info.get("bootstrap_port"), *(o.info.get("kv_events_ports") or ()))
                if p]

    def free_slots(self) -> int:
        """Replicas that may be added: GPUs of ``cluster.num_gpus`` no worker uses that Ray has free, in units of
        ``tp_size``; 0 with ``planner.add_replicas`` off or explicit ``gpus`` lists."""
        import ray

        cfg = self.launcher.cfg
        if not cfg.planner.add_replicas or cfg.prefill.gpus is not None:
            return 0
        tp = cfg.prefill.tp_size
        in_budget = (cfg.cluster.num_gpus - len(self.slots) * tp) // tp
        return max(0, min(in_budget, int(ray.available_resources().get("GPU", 0) // tp)))

    def place_replica(self, role: str) -> "ActorSlot":
        """A new worker in ``role``: its placement group, actor and started engine (on the step's thread; ``done``
        adds it to the launcher's slots).

        Raises:
            TimeoutError: the bundle was not placed within ``pg_ready_timeout``. RuntimeError: the engine did not start.
        """
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        from pd.cluster.actor_slots import ActorSlot

        cfg = self.launcher.cfg
        group = cfg.groups()[role]
        name = self.free_name(role)
        kwargs = {"bundle_label_selector": [dict(group.placement.node_labels)]} if group.placement.node_labels else {}
        pg = placement_group([{"GPU": group.tp_size, **group.placement.resources}], strategy="STRICT_PACK",
                             name=f"pdserve-{name}", **kwargs)
        actor = None
        try:
            try:
                ray.get(pg.ready(), timeout=self.pg_ready_timeout)
            except ray.exceptions.GetTimeoutError:
                raise TimeoutError(f"{name}: Ray could not place its bundle within {self.pg_ready_timeout:g}s") \
                    from None
            actor = self.launcher._new_actor(name, role, pg, None)
            host = ray.get(actor.info.remote(), timeout=60)["host"]
            ray.get(actor.reserve_ports.remote(self.ports_taken(host)), timeout=60)
            info = RayWorkerOps(self, ActorSlot(name, role, actor))._get(actor.start.remote(),
                                                                         cfg.engine_startup_timeout + 60)
        except BaseException:
            if actor is not None:
                ray.kill(actor)
            remove_placement_group(pg)
            raise
        self.launcher.pgs.append(pg)
        return ActorSlot(name, role, actor, info)

    def move(self, worker: dict, to_role: str) -> None:
        """Start moving the worker whose info is ``worker`` to ``to_role`` under the first free ``<role>-<i>``."""
        slot = next(s for s in self.slots if s.info.get("url") == worker["url"])
        new_name = self.free_name(to_role)
        self.moving.add(id(slot))

        def run() -> None:
            result = self.mover.move(dict(slot.info), RayWorkerOps(self, slot), to_role, new_name)
            self._results.append((slot, result))

        self._start(run)

    def add(self, role: str) -> None:
        """Start adding a replica in ``role`` (``place_replica``)."""
        def run() -> None:
            try:
                slot = self.place_replica(role)
            except Exception as e:  # a placement or start that failed: the cluster serves on as it was
                first = str(e).splitlines()[0] if str(e) else repr(e)
                self._results.append((None, AddResult("add_failed", f"a {role} replica: {first}")))
                return
            self._results.append((None, AddResult("added", f"{slot.name} at {slot.info.get('url')}", slot)))

        self._start(run)

    def _start(self, run) -> None:
        if self.busy():
            raise RuntimeError("a move or an add is already under way")
        self._thread = threading.Thread(target=run, name="pdserve-split-move", daemon=True)
        self._thread.start()

    def done(self) -> list:
        """The steps that ended since the last call; a moved slot takes its new name and role, an added one joins
        the launcher's slots. Call from the launcher's loop only."""
        out = []
        while self._results:
            slot, result = self._results.popleft()
            if isinstance(result, MoveResult):
                self.moving.discard(id(slot))
                slot.info = dict(result.info)
                slot.name, slot.role = result.info.get("name", slot.name), result.info.get("role", slot.role)
            elif result.slot is not None:
                self.launcher.adopt(result.slot)
            out.append(result)
        return out
