"""The launcher's worker actors across node loss: each one polled on its own, lost when Ray says so,
started again where Ray places it.

The actors are created with ``max_restarts=-1`` in their own placement group. When a node dies Ray
(not us) does the recovery: GCS marks the node dead, reschedules the placement group's bundle onto a
node that can hold it (the same node once it rejoins, when only it has the bundle's custom resource),
and restarts the actor there, which runs ``EngineWorker.__init__`` again. What is left to the launcher
is what Ray cannot know: the restarted actor is ``created`` with no engine, so it gets ports unique on
its node and ``start``; until then the worker is ``lost`` and the router is told to drop it
(pd.cluster.membership).

Each poll keeps at most one ``info()`` call in flight per actor (a call to a restarting actor waits
in Ray until the actor is back), so a dead node never blocks the other workers' polling.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

INFO_WAIT_S = 5.0  # an info() slower than this, or failed, marks the worker lost until it answers


@dataclass
class ActorSlot:
    """One worker actor: its last ``info()``, the call in flight, a start in progress.

    Attributes:
        name: the worker's name (``decode-0``).
        role: ``prefill`` or ``decode``.
        actor: the Ray actor handle (an EngineWorker).
        info: the last state reported (pd.cluster.worker.EngineWorker.info), or a ``lost`` stand-in.
    """

    name: str
    role: str
    actor: object
    info: dict = field(default_factory=dict)
    info_ref: object = None
    start_ref: object = None
    lost_reason: Optional[str] = None
    node_dead_said: bool = False
    failed_starts: int = 0


def lost_info(slot: ActorSlot, reason: str) -> dict:
    """The stand-in ``info()`` of an actor that does not answer: state ``lost``, no URL, the node it was on."""
    old = slot.info
    return {"name": slot.name, "role": slot.role, "state": "lost", "host": old.get("host"), "port": None,
            "bootstrap_port": None, "url": None, "pid": None, "restarts": old.get("restarts", 0),
            "last_exit": old.get("last_exit"), "diagnosis": reason, "node_id": old.get("node_id"),
            "cuda_visible_devices": old.get("cuda_visible_devices", ""), "actor_pid": None}


def node_description(node_id: Optional[str], nodes: list[dict]) -> str:
    """``198.51.100.3 (node 3f2a..., dead)`` from ``ray.nodes()``; the id alone when Ray no longer lists it."""
    for n in nodes:
        if n.get("NodeID") == node_id:
            return f"{n.get('NodeManagerAddress')} (node {node_id[:12]}, {'alive' if n.get('Alive') else 'dead'})"
    return f"node {(node_id or '?')[:12]}"


class ActorSlots:
    """Poll every worker actor without letting one dead node stall the rest.

    Args:
        slots: one per worker actor, in launch order.
        say: where state changes are reported (the job log).
    """

    def __init__(self, slots: list[ActorSlot], say: Callable[[str], None], max_start_attempts: int = 3):
        self.slots = slots
        self.say = say
        self.max_start_attempts = max_start_attempts

    def poll(self, timeout: float = INFO_WAIT_S) -> list[dict]:
        """One round: every actor's ``info()`` (or ``lost``), a restarted actor's ports and start kicked
        off; returns the infos in slot order. Waits at most ``timeout`` s in all."""
        import ray

        for s in self.slots:
            if s.info_ref is None:
                s.info_ref = s.actor.info.remote()
        pending = [s.info_ref for s in self.slots]
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=timeout)
        ready = set(ready)
        nodes = None
        for s in self.slots:
            if s.info_ref not in ready:
                nodes = nodes if nodes is not None else ray.nodes()
                self._mark_lost(s, "no answer from its actor within "
                                   f"{timeout:g}s; last on {node_description(s.info.get('node_id'), nodes)}")
                continue
            ref, s.info_ref = s.info_ref, None
            try:
                info = ray.get(ref)
            except Exception as e:  # RayActorError (node gone, restarts pending) and the like
                nodes = nodes if nodes is not None else ray.nodes()
                self._mark_lost(s, f"{type(e).__name__} on {node_description(s.info.get('node_id'), nodes)}")
                continue
            self._answered(s, info)
        if nodes is not None:
            self._say_dead_nodes(nodes)
        self._collect_starts()
        return [s.info for s in self.slots]

    def _say_dead_nodes(self, nodes: list[dict]) -> None:
        """Once per lost worker: the node it was on, when Ray has declared that node dead (an actor often
        stops answering seconds before Ray's health checks give up on its node)."""
        for s in self.slots:
            node_id = s.info.get("node_id")
            if s.lost_reason is None or s.node_dead_said or not node_id:
                continue
            if any(n.get("NodeID") == node_id and not n.get("Alive") for n in nodes):
                self.say(f"Ray declared {s.name}'s node dead: {node_description(node_id, nodes)}; {s.name} waits "
                         "for Ray to place it again")
                s.node_dead_said = True

    def _mark_lost(self, s: ActorSlot, reason: str) -> None:
        if s.lost_reason is None:
            self.say(f"{s.name} lost: {reason}; Ray restarts its actor where its placement group is placed "
                     "again (the same node's resources once it rejoins)")
        s.lost_reason = reason
        s.info = lost_info(s, reason)

    def _answered(self, s: ActorSlot, info: dict) -> None:
        if s.lost_reason is not None:
            self.say(f"{s.name}'s actor answers again on {info.get('host')} ({info['state']})")
            s.lost_reason, s.node_dead_said = None, False
        s.info = info
        # "created": Ray restarted the actor (new node or rejoined one); "starting" with nothing in flight: a
        # start on it failed, tried again up to max_start_attempts in all.
        again = info["state"] == "created" or (info["state"] == "starting" and s.failed_starts > 0)
        if again and s.start_ref is None and s.failed_starts < self.max_start_attempts:
            self._start(s)

    def _start(self, s: ActorSlot) -> None:
        """Ports unique among the other workers on its node, then ``start`` (collected in a later poll)."""
        import ray

        taken = [p for o in self.slots if o is not s and o.info.get("host") == s.info.get("host")
                 for p in (o.info.get("port"), o.info.get("bootstrap_port")) if p]
        try:
            # its name and role as the split controller may have changed them (Ray restarts it with its first ones)
            s.info = ray.get(s.actor.reserve_ports.remote(taken, s.role, s.name), timeout=INFO_WAIT_S)
        except Exception as e:
            self.say(f"{s.name}: could not reserve ports on its new actor: {e!r}; retrying")
            return
        self.say(f"starting {s.name} again on {s.info['host']}:{s.info['port']}")
        s.start_ref = s.actor.start.remote()

    def _collect_starts(self) -> None:
        import ray

        for s in self.slots:
            if s.start_ref is None:
                continue
            ready, _ = ray.wait([s.start_ref], timeout=0)
            if not ready:
                continue
            ref, s.start_ref = s.start_ref, None
            try:
                s.info = ray.get(ref)
                s.failed_starts = 0
                self.say(f"{s.name} is ready again at {s.info['url']}")
            except Exception as e:  # the engine failed to start; the next poll tries again, a bounded number of times
                s.failed_starts += 1
                first = str(e).splitlines()[0] if str(e) else repr(e)
                left = self.max_start_attempts - s.failed_starts
                self.say(f"{s.name} did not start again ({first}); "
                         + (f"{left} more attempts" if left > 0 else "giving up: the worker stays down"))
