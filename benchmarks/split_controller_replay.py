"""The split controller replayed on the planner's simulator with the DeepSeek-V4 profile: the decisions and timings an
8-GPU box (8x RTX PRO 6000, TP 2: four slots) would see for the traffic of benchmarks/split_controller.py's phases
-- prefill-heavy, decode-heavy, prefill-heavy -- scaled to the model.

How
---
The traffic is the phases' requests end to end (pd.planner.workload: Poisson arrivals, uniform lengths). The
controller (pd.planner.controller with the profile as its model, pd.planner.live_model; the shipped ``planner:``
defaults -- a decision every 10 s from 60 s of metrics, hold max(20 s, 2 x restart), cooldown max(60 s, 3 x
restart) -- and again with the live benchmark's multipliers, hold 0.5 x restart and cooldown 1 x restart) is
fed every interval a snapshot built from the simulated requests as the live metrics would give it
(pd.planner.live_metrics): request rate and mean lengths of the window's requests, TTFT attainment of the first
tokens and TPOT attainment of the requests finished in the window, the requests waiting for a prefill and those
whose KV has arrived at a decode that has not admitted them (Little's law is not needed: the simulator knows each
request's stage times).

A split holds from one change to the next; the requests arriving in that segment are simulated on it
(pd.planner.simulate) when the segment starts, and again from the next change on. A move takes, in simulated time:
the drain of the moving worker (until the last request routed to it before the decision has left it, read from the
simulation), then the engine's restart (``--restart-s``), during which the other workers serve without it. Requests
in flight at a change finish as simulated before it; the new segment starts with empty queues (a backlog is not
carried over: optimistic for the split after a change).

Every phase starts from empty queues, the controller's split as it is then and each static split alike (a static
split that cannot serve one phase would otherwise carry its backlog into the next, and the comparison would be of
backlogs). Goodput per phase: the requests that arrived in the phase and met both objectives, per second of the
phase.

Reproduce
---------
    .venv/bin/python benchmarks/split_controller_replay.py       # prints the replay; split_controller.py stores it
"""

from __future__ import annotations

import argparse
import bisect
import json
from dataclasses import dataclass
from pathlib import Path

from pd.config import Planner
from pd.planner.controller import Policy, Snapshot, SplitController
from pd.planner.live_model import ModelScorer
from pd.planner.profile import load_profile
from pd.planner.simulate import SLO, RequestResult, Split, simulate
from pd.planner.workload import Request, Workload

REPO = Path(__file__).resolve().parent.parent
PROFILE = REPO / "deploy" / "profiles" / "dsv4-flash-rtxpro6000.json"
TP, SLOTS = 2, 4  # 8 GPUs at TP 2 (TP 1 does not fit the weights: the profile's notes)
SLO_TTFT_S, SLO_TPOT_S = 3.0, 0.05
ATTAINMENT = 0.9
# the live benchmark's shapes scaled to the model: long prompts and short answers, then short prompts and long answers
WORKLOADS = {
    "prefill-heavy": {"random_input_len": 16384, "random_output_len": 64, "random_range_ratio": 0.5, "rate": 3.5},
    "decode-heavy": {"random_input_len": 1024, "random_output_len": 1024, "random_range_ratio": 0.5, "rate": 5.0},
}
PHASES = ("prefill-heavy", "decode-heavy", "prefill-heavy")
HORIZON_S = 1800.0  # a request is looked at for the window's metrics until this long after its arrival


@dataclass
class Segment:
    """A split in service from ``t0``; ``results``: the requests arriving from ``t0`` on, simulated on it."""

    t0: float
    split: tuple[int, int]
    results: list[RequestResult]


def phase_requests(phase_s: float, seed: int) -> tuple[list[Request], list[tuple[str, float, float]]]:
    """Every request of the sequence (absolute arrival times) and each phase's (name, start, end)."""
    reqs, spans, t = [], [], 0.0
    for i, name in enumerate(PHASES):
        w = WORKLOADS[name]
        wl = Workload(w["rate"], max(1, round(w["rate"] * phase_s)), w["random_input_len"], w["random_output_len"],
                      w["random_range_ratio"], seed=seed + i)
        reqs += [Request(t + r.arrival_s, r.input_len, r.output_len) for r in wl.requests() if r.arrival_s < phase_s]
        spans.append((name, t, t + phase_s))
        t += phase_s
    return reqs, spans


def run_on(profile, split: tuple[int, int], reqs: list[Request], t0: float) -> list[RequestResult]:
    """``reqs`` arriving from ``t0`` on, simulated on ``split`` (results on the absolute clock)."""
    todo = [Request(r.arrival_s - t0, r.input_len, r.output_len) for r in reqs if r.arrival_s >= t0]
    if not todo:
        return []
    rate = len(todo) / max(todo[-1].arrival_s, 1.0)
    res = simulate(profile, Split(split[0], TP, split[1], TP), Workload(rate, len(todo)), requests=todo)
    for r in res.requests:
        r.request = Request(r.request.arrival_s + t0, r.request.input_len, r.request.output_len)
        for k in ("prefill_start_s", "prefill_end_s", "kv_arrived_s", "first_token_s", "end_s"):
            setattr(r, k, getattr(r, k) + t0)
    return res.requests


def snapshot(now: float, split: tuple[int, int], done: list[RequestResult], window: float, **kw) -> Snapshot:
    """What the live metrics would show at ``now`` (module docstring); ``done``: the requests that arrived since
    ``now - window - HORIZON_S``."""
    lo = now - window
    arrived = [r for r in done if lo < r.request.arrival_s <= now]
    first = [r for r in done if lo < r.first_token_s <= now]
    ended = [r for r in done if lo < r.end_s <= now and r.request.output_len > 1]
    answered = [r for r in done if lo < r.end_s <= now]
    ttft = sum(r.ttft_s <= SLO_TTFT_S for r in first) / len(first) if first else None
    tpot = sum(r.tpot_s <= SLO_TPOT_S for r in ended) / len(ended) if ended else None
    pq = sum(r.request.arrival_s <= now < r.prefill_start_s for r in done)
    dq = sum(r.kv_arrived_s <= now < r.first_token_s for r in done)
    n = len(answered)
    return Snapshot(now=now, prefill=split[0], decode=split[1], requests=n,
                    request_rate=len(arrived) / window, mean_input_len=sum(r.request.input_len for r in answered) / n
                    if n else 0.0, mean_output_len=sum(r.request.output_len for r in answered) / n if n else 0.0,
                    ttft_attainment=ttft, tpot_attainment=tpot, prefill_queue=pq, decode_queue=dq, **kw)


def served(segs: list[Segment]) -> list[RequestResult]:
    """Each request as served by the segment it arrived in, in arrival order."""
    return [r for s, nxt in zip(segs, segs[1:] + [None]) for r in s.results
            if nxt is None or r.request.arrival_s < nxt.t0]


# The policies replayed: the shipped ``planner:`` defaults, and the live benchmark's multipliers of the restart time
# (hold half a restart, cool down one), which follow a shift sooner.
POLICIES = {"shipped defaults": {},
            "hold 0.5 x restart, cooldown 1 x restart": {"hold_restarts": 0.5, "cooldown_restarts": 1.0}}


def replays(phase_s: float, restart_s: float, seed: int = 1) -> list[dict]:
    """:func:`replay` under each of POLICIES."""
    out = []
    for name, kw in POLICIES.items():
        cfg = Planner(mode="act", slo_ttft_ms=SLO_TTFT_S * 1e3, slo_tpot_ms=SLO_TPOT_S * 1e3, **kw)
        out.append({"policy_name": name, **replay(phase_s, restart_s, seed, cfg)})
    return out


def replay(phase_s: float, restart_s: float, seed: int = 1, cfg: Planner | None = None) -> dict:
    """The controller over the phases (module docstring); its decisions, moves and goodput per phase beside each
    static split's."""
    cfg = cfg or Planner(mode="act", slo_ttft_ms=SLO_TTFT_S * 1e3, slo_tpot_ms=SLO_TPOT_S * 1e3)
    profile = load_profile(PROFILE)
    reqs, spans = phase_requests(phase_s, seed)
    end = spans[-1][2]
    policy = Policy(slo_attainment=cfg.slo_attainment, band=cfg.attainment_band, min_requests=cfg.min_requests,
                    cooldown_secs=cfg.cooldown_secs, cooldown_restarts=cfg.cooldown_restarts, hold_secs=cfg.hold_secs,
                    hold_restarts=cfg.hold_restarts, min_gain=cfg.min_gain)
    ctl = SplitController(policy, ModelScorer(profile, TP, SLO(SLO_TTFT_S, SLO_TPOT_S), cfg.slo_attainment))
    split = (3, 1)
    segs = [Segment(0.0, split, run_on(profile, split, reqs, 0.0))]
    decisions, moves = [], []
    pending = None  # (t the moving worker is back, new split)
    n_segs, done, arrivals = 0, [], []
    last_key = None
    t = cfg.interval_secs
    starts = [a for _, a, _ in spans[1:]]
    while t <= end:
        if starts and t >= starts[0]:  # a phase starts from empty queues, as each static split's does
            segs.append(Segment(starts[0], segs[-1].split, run_on(profile, segs[-1].split, reqs, starts.pop(0))))
        if pending is not None and t >= pending[0]:
            t_back, split = pending
            segs.append(Segment(t_back, split, run_on(profile, split, reqs, t_back)))
            ctl.moved(t_back)
            moves[-1]["done_s"] = t_back
            pending = None
        if len(segs) != n_segs:
            done, n_segs = served(segs), len(segs)
            arrivals = [r.request.arrival_s for r in done]
        near = done[bisect.bisect_left(arrivals, t - cfg.window_secs - HORIZON_S):bisect.bisect_right(arrivals, t)]
        serving = segs[-1].split
        s = snapshot(t, serving, near, cfg.window_secs, restart_s=restart_s, moving=pending is not None)
        d = ctl.decide(s)
        key = (d.action, d.reason, d.target)
        if d.action != "hold" or key != last_key:
            phase = next(name for name, a, b in spans if a <= t < b or b == end)
            decisions.append({"t_s": t, "phase": phase, "action": d.action, "reason": d.reason,
                              "current": f"{d.current[0]}P{d.current[1]}D", "target": f"{d.target[0]}P{d.target[1]}D",
                              "detail": d.detail})
            last_key = key
        if d.action.startswith("move_to_"):
            to = d.action.removeprefix("move_to_")
            new = (serving[0] + 1, serving[1] - 1) if to == "prefill" else (serving[0] - 1, serving[1] + 1)
            victim = serving[1] - 1 if to == "prefill" else serving[0] - 1  # the last replica of the giving role
            own = [r for r in segs[-1].results if r.request.arrival_s <= t and
                   (r.decode_replica if to == "prefill" else r.prefill_replica) == victim]
            busy_until = max([r.end_s if to == "prefill" else r.prefill_end_s for r in own] + [t])
            drain = busy_until - t
            during = (new[0], new[1] - 1) if to == "decode" else (new[0] - 1, new[1])  # without the moving worker
            segs.append(Segment(t, during, run_on(profile, during, reqs, t)))
            pending = (busy_until + restart_s, new)
            shift = max(a for _, a, _ in spans if a <= t)
            moves.append({"decided_s": t, "since_shift_s": t - shift, "from": f"{serving[0]}P{serving[1]}D",
                          "to": f"{new[0]}P{new[1]}D", "reason": d.reason, "drain_s": drain, "restart_s": restart_s})
        t += cfg.interval_secs
    for m in moves:
        shift = max(a for _, a, _ in spans if a <= m["decided_s"])
        m["shift_to_new_split_s"] = m["done_s"] - shift if "done_s" in m else None
    goodput = {"controller": per_phase(served(segs), spans)}
    for p in range(1, SLOTS):  # each phase from empty queues: the split's own goodput for that traffic
        res = [r for _, a, b in spans for r in run_on(profile, (p, SLOTS - p), [q for q in reqs if q.arrival_s < b], a)]
        goodput[f"static-{p}P{SLOTS - p}D"] = per_phase(res, spans)
    statics = [k for k in goodput if k.startswith("static-")]
    best = [max(goodput[k][i] for k in statics) for i in range(len(spans))]
    return {"profile": str(PROFILE.relative_to(REPO)), "tp_size": TP, "slots": SLOTS, "start_split": "3P1D",
            "slo": {"ttft_ms": SLO_TTFT_S * 1e3, "tpot_ms": SLO_TPOT_S * 1e3, "attainment": ATTAINMENT},
            "workloads": WORKLOADS, "phases": list(PHASES), "phase_s": phase_s, "restart_s": restart_s,
            "planner": cfg.model_dump(), "hold_s": policy.hold_time(restart_s),
            "cooldown_s": policy.cooldown_time(restart_s), "decisions": decisions, "moves": moves, "goodput": goodput,
            "best_static": best, "ratio_to_best_static": {k: [v[i] / best[i] if best[i] else None
                                                              for i in range(len(spans))] for k, v in goodput.items()}}


def per_phase(done: list[RequestResult], spans) -> list[float]:
    """Requests arriving in each phase that met both objectives, per second of the phase."""
    return [sum(a <= r.request.arrival_s < b and r.ttft_s <= SLO_TTFT_S and
                (r.request.output_len <= 1 or r.tpot_s <= SLO_TPOT_S) for r in done) / (b - a) for _, a, b in spans]


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--phase-s", type=float, default=3600.0, help="seconds per phase")
    p.add_argument("--restart-s", type=float, default=300.0, help="an engine's restart, seconds (assumed)")
    a = p.parse_args()
    for out in replays(a.phase_s, a.restart_s):
        print(out["policy_name"])
        print(json.dumps({k: out[k] for k in ("moves", "goodput", "ratio_to_best_static")}, indent=1))
        for d in out["decisions"]:
            print(f"{d['t_s']:7.0f}s {d['phase']:14s} {d['current']} -> {d['target']} {d['action']} ({d['reason']})")
