"""The launcher's per-actor polling (pd.cluster.actor_slots) against scripted actors: a silent or dead actor is
`lost` without stalling the others, a restarted one gets ports unique on its node and a start, a failing start is
retried a bounded number of times. Ray's object refs are stood in by a tiny fake `ray` module."""

import sys
import types

import pytest

from pd.cluster.actor_slots import ActorSlot, ActorSlots


class Ref:
    def __init__(self, value=None, error=None, ready=True):
        self.value, self.error, self.ready = value, error, ready


class FakeRay(types.ModuleType):
    def __init__(self):
        super().__init__("ray")
        self.node_list = [{"NodeID": "c" * 40, "NodeManagerAddress": "198.51.100.3", "Alive": False}]

    def wait(self, refs, num_returns=1, timeout=None):
        done = [r for r in refs if r.ready]
        return done, [r for r in refs if not r.ready]

    def get(self, ref, timeout=None):
        if ref.error is not None:
            raise ref.error
        return ref.value

    def nodes(self):
        return self.node_list


@pytest.fixture
def fake_ray(monkeypatch):
    ray = FakeRay()
    monkeypatch.setitem(sys.modules, "ray", ray)
    return ray


class Method:
    def __init__(self, fn):
        self.fn = fn
        self.calls = []

    def remote(self, *args):
        self.calls.append(args)
        return self.fn(*args)


def info(name, state, host="198.51.100.3", port=None, node="c" * 40):
    return {"name": name, "role": name.split("-")[0], "state": state, "host": host, "port": port,
            "bootstrap_port": None, "url": f"http://{host}:{port}" if port else None, "node_id": node,
            "restarts": 0}


class Actor:
    """An actor whose info() answers from ``self.state`` (None: no answer; an exception: it died)."""

    def __init__(self, name, state="ready", port=30000):
        self.name, self.state, self.port = name, state, port
        self.start_result = None  # a Ref, or None for "ready"
        self.info = Method(self._info)
        self.reserve_ports = Method(self._reserve)
        self.start = Method(self._start)

    def _info(self):
        if self.state is None:
            return Ref(ready=False)
        if isinstance(self.state, Exception):
            return Ref(error=self.state)
        return Ref(info(self.name, self.state, port=self.port))

    def _reserve(self, taken, role=None, name=None):  # EngineWorker.reserve_ports takes the role and name too
        self.port = max([40000, *taken]) + 1
        return Ref(info(self.name, self.state, port=self.port))

    def _start(self):
        if self.start_result is not None:
            return self.start_result
        self.state = "ready"
        return Ref(info(self.name, "ready", port=self.port))


def slots_of(*actors, attempts=3):
    said = []
    slots = ActorSlots([ActorSlot(a.name, a.name.split("-")[0], a, info(a.name, "ready", port=a.port))
                        for a in actors], said.append, max_start_attempts=attempts)
    return slots, said


def test_a_silent_actor_is_lost_and_the_others_still_report(fake_ray):
    pre, dec = Actor("prefill-0", port=30001), Actor("decode-0", port=30002)
    slots, said = slots_of(pre, dec)
    dec.state = None
    got = slots.poll(timeout=0)
    assert [i["state"] for i in got] == ["ready", "lost"]
    assert got[1]["url"] is None
    assert any("decode-0 lost" in s and "198.51.100.3" in s and "dead" in s for s in said), said
    slots.poll(timeout=0)  # still silent: the same call stays in flight, no second one
    assert len(dec.info.calls) == 1
    assert sum("decode-0 lost" in s for s in said) == 1


def test_a_dead_actor_is_lost_with_the_error_named(fake_ray):
    dec = Actor("decode-0")
    slots, said = slots_of(dec)
    dec.state = RuntimeError("ActorDiedError")
    assert slots.poll(timeout=0)[0]["state"] == "lost"
    assert "RuntimeError" in said[0]


def test_a_restarted_actor_gets_ports_apart_from_its_node_mates_and_a_start(fake_ray):
    pre, dec = Actor("prefill-0", port=45000), Actor("decode-0", port=30002)
    slots, said = slots_of(pre, dec)
    dec.state = "created"  # Ray restarted it on the node where prefill-0 runs
    slots.poll(timeout=0)
    assert dec.reserve_ports.calls == [([45000], "decode", "decode-0")]  # and its current role and name
    assert len(dec.start.calls) == 1
    got = slots.poll(timeout=0)
    assert got[1]["state"] == "ready" and got[1]["port"] == 45001
    assert any("decode-0 is ready again at http://198.51.100.3:45001" in s for s in said)
    slots.poll(timeout=0)
    assert len(dec.start.calls) == 1  # ready: never started twice


def test_a_failing_start_is_retried_a_bounded_number_of_times(fake_ray):
    dec = Actor("decode-0")
    slots, said = slots_of(dec, attempts=2)
    dec.state = "created"
    dec.start_result = Ref(error=RuntimeError("decode-0: engine exited with 1 during startup"))
    for _ in range(6):
        dec.state = "starting" if dec.start.calls else "created"
        slots.poll(timeout=0)
    assert len(dec.start.calls) == 2
    assert "giving up" in said[-1] and "engine exited with 1" in said[-1]


def test_a_start_in_flight_is_not_started_again(fake_ray):
    dec = Actor("decode-0")
    slots, said = slots_of(dec)
    dec.state = "created"
    dec.start_result = Ref(ready=False)  # the engine is still loading; info() answered before the start began
    for _ in range(3):
        assert slots.poll(timeout=0)[0]["state"] == "created"
    assert len(dec.start.calls) == 1
    dec.start_result.ready, dec.start_result.value = True, info("decode-0", "ready", port=dec.port)
    assert slots.poll(timeout=0)[0]["state"] in ("created", "ready")
    assert any("ready again" in s for s in said)


def test_the_node_is_named_dead_once_ray_declares_it(fake_ray):
    dec = Actor("decode-0")
    slots, said = slots_of(dec)
    fake_ray.node_list[0]["Alive"] = True  # the actor went silent before Ray's health checks gave up on its node
    dec.state = None
    slots.poll(timeout=0)
    assert "alive" in said[-1] and not any("declared" in s for s in said)
    fake_ray.node_list[0]["Alive"] = False
    slots.poll(timeout=0)
    slots.poll(timeout=0)
    dead = [s for s in said if "declared decode-0's node dead" in s]
    assert len(dead) == 1 and "198.51.100.3" in dead[0], said
