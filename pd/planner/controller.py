"""The P:D split controller's decision: from a snapshot of the live traffic to the next step and its reason.

Pure: no I/O and no clock of its own (the snapshot carries the time), so each rule is testable alone; the launcher
feeds it (pd.cluster.split_planner) and carries its steps out (pd.cluster.split_mover). One decision, in order:

1. **A move under way**: hold (``moving``); one worker changes role at a time.
2. **Override**: an operator's pinned split (the router's admin API, ``POST /planner/override``) is the target;
   one worker moves toward it per decision, with no hysteresis or cooldown (``override``). A pin the cluster
   cannot hold (more replicas than its slots and free GPUs) is held (``override_unreachable``).
3. **Too little traffic** in the window (< ``min_requests`` finished): hold (``idle``).
4. **Which stage is short**, from what is measured (SLO attainment per stage), with a dead band: the prefill
   stage when the TTFT attainment is below the target less ``band`` (``ttft_slo``) -- unless more requests wait
   at the decodes than at the prefills, when the decodes' admission is what delays the first token
   (``decode_queue``); the decode stage when the TPOT attainment is below the target less ``band``
   (``tpot_slo``) or its KV pool is full with requests waiting (``kv_full``). Neither: hold (``slo_met``): a move
   cannot raise goodput that already meets the SLO. A stage gives a worker up only while it meets the target
   itself (attainment at or above it, not merely inside the band): else hold (``no_spare``), so a move does not
   make the other stage short and start a move back.
5. **The model** (a profile: pd.planner.profile, pd.planner.simulate): each split of the slots (and of one more
   replica when a GPU is free) is scored by DistServe's goodput -- the highest rate meeting the SLO attainment --
   for the live workload (request rate, mean prompt and output lengths). When one stage is short, a move toward
   it that the model predicts to lose more than ``min_gain`` of the current goodput is held
   (``model_disagrees``); when both are, the model's best split (if it beats the current by ``min_gain``) picks
   the direction (``model``). Without a profile, both short goes toward the longer queue per worker
   (``queue``); with queues even, toward the stage whose attainment is lower by more than ``band`` (``shortfall``:
   TTFT 79% and TPOT 0% is the decodes' doing -- a request's first token is theirs); else holds (``overloaded``).
6. **Never below one prefill and one decode** (``min_split``); when a GPU is free, **adding** a replica to the
   short role comes before moving one (``add_prefill`` / ``add_decode``).
7. **Hysteresis**: the same step must be proposed by every decision for ``hold_time`` before it is taken
   (``hysteresis``); any other proposal (a noisy metric) starts the wait again.
8. **Cooldown**: no step for ``cooldown_time`` after the last move ended (``cooldown``).

Both times follow how long a worker takes to come back (``restart_s``, measured by the launcher on every engine
start): ``hold_time = max(hold_secs, hold_restarts x restart_s)``, ``cooldown_time = max(cooldown_secs,
cooldown_restarts x restart_s)``: seconds for the reference engine, minutes for DeepSeek-V4 on SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Optional

ACTIONS = ("hold", "move_to_prefill", "move_to_decode", "add_prefill", "add_decode")
REASONS = ("moving", "override", "override_unreachable", "idle", "slo_met", "ttft_slo", "decode_queue", "tpot_slo",
           "kv_full", "no_spare", "model", "model_disagrees", "queue", "shortfall", "overloaded", "min_split",
           "hysteresis", "cooldown")
KV_FULL = 0.95  # decode token usage at which waiting requests are waiting for KV pages


@dataclass(frozen=True)
class Snapshot:
    """What the controller sees at one decision (pd.planner.live_metrics builds it from /metrics).

    Attributes:
        now: seconds on the caller's monotonic clock.
        prefill, decode: replicas serving in each role now.
        free_slots: replicas that could be added (free GPUs / tp_size), 0 when adding is off.
        requests: requests finished in the window.
        request_rate: requests per second over the window.
        mean_input_len, mean_output_len: tokens per request over the window.
        ttft_attainment, tpot_attainment: fractions of the window's requests within the TTFT / TPOT objective,
            None without data.
        prefill_queue, decode_queue: requests waiting now at all prefills (queue + bootstrap) / all decodes
            (prealloc + transfer + queue).
        kv_usage: the fullest decode's KV pool usage in [0, 1].
        restart_s: the measured time an engine takes to start, seconds (None: not measured yet).
        moving: a move is under way.
        override: an operator's pinned (prefill, decode), or None.
    """

    now: float
    prefill: int
    decode: int
    free_slots: int = 0
    requests: int = 0
    request_rate: float = 0.0
    mean_input_len: float = 0.0
    mean_output_len: float = 0.0
    ttft_attainment: Optional[float] = None
    tpot_attainment: Optional[float] = None
    prefill_queue: float = 0.0
    decode_queue: float = 0.0
    kv_usage: float = 0.0
    restart_s: Optional[float] = None
    moving: bool = False
    override: Optional[tuple[int, int]] = None


@dataclass(frozen=True)
class Decision:
    """One decision.

    Attributes:
        action: one of ACTIONS; ``hold`` does nothing.
        reason: one of REASONS (a metric label: a short fixed word).
        current: (prefill, decode) replicas now.
        target: the split aimed at (the override, the model's pick, or one step from the current).
        detail: the reason in words, with the numbers, for the log.
    """

    action: str
    reason: str
    current: tuple[int, int]
    target: tuple[int, int]
    detail: str

    def describe(self) -> dict:
        """The decision as JSON (the admin API's ``GET /planner``)."""
        return {"action": self.action, "reason": self.reason, "current": _split(self.current),
                "target": _split(self.target), "detail": self.detail}


def _split(s: tuple[int, int]) -> dict:
    return {"prefill": s[0], "decode": s[1]}


@dataclass(frozen=True)
class Policy:
    """The controller's settings (the config's ``planner`` block, pd.config.Planner, documents each)."""

    slo_attainment: float = 0.9
    band: float = 0.05
    min_requests: int = 20
    cooldown_secs: float = 60.0
    cooldown_restarts: float = 3.0
    hold_secs: float = 20.0
    hold_restarts: float = 2.0
    min_gain: float = 0.1

    def hold_time(self, restart_s: Optional[float]) -> float:
        """Seconds a step must be proposed before it is taken."""
        return max(self.hold_secs, self.hold_restarts * (restart_s or 0.0))

    def cooldown_time(self, restart_s: Optional[float]) -> float:
        """Seconds after a move during which no step is taken."""
        return max(self.cooldown_secs, self.cooldown_restarts * (restart_s or 0.0))


# A model scores a split (prefill, decode) for the snapshot's workload: predicted goodput, requests/s.
Scorer = Callable[[Snapshot, tuple[int, int]], float]


@dataclass
class SplitController:
    """Decides, once per interval, the next step of the split (module docstring: the rules).

    Args:
        policy: thresholds and times.
        scorer: the planner's model (pd.planner.live_model.ModelScorer), or None to decide from measurements only.
    """

    policy: Policy = field(default_factory=Policy)
    scorer: Optional[Scorer] = None
    last_move_end: Optional[float] = None
    _pending: Optional[tuple[str, float]] = None  # (proposed action, since when)

    def moved(self, now: float) -> None:
        """A move (or an add) ended at ``now``, done or rolled back: the cooldown starts."""
        self.last_move_end = now
        self._pending = None

    def decide(self, s: Snapshot) -> Decision:
        """The next step for snapshot ``s`` (a Decision whose action is ``hold`` when nothing is to be done)."""
        cur = (s.prefill, s.decode)
        if s.moving:
            return self._hold(s, "moving", cur, "a move is under way")
        if s.override is not None:
            return self._toward_override(s, cur, s.override)
        if s.requests < self.policy.min_requests:
            return self._hold(s, "idle", cur, f"{s.requests} requests in the window, fewer than "
                                              f"{self.policy.min_requests}")
        proposal = self._propose(s, cur)
        if proposal.action == "hold":
            self._pending = None
            return proposal
        return self._gate(s, proposal)

    # ---- rules -------------------------------------------------------------------------------------------------
    def _hold(self, s: Snapshot, reason: str, target: tuple[int, int], detail: str) -> Decision:
        return Decision("hold", reason, (s.prefill, s.decode), target, detail)

    def _step(self, s: Snapshot, to_role: str, reason: str, target: tuple[int, int], detail: str) -> Decision:
        """One step toward ``to_role``: add a replica when a slot is free, else move one from the other role (never
        its last)."""
        cur = (s.prefill, s.decode)
        if s.free_slots > 0:
            return Decision(f"add_{to_role}", reason, cur, target, detail)
        giver = s.decode if to_role == "prefill" else s.prefill
        if giver <= 1:
            other = "decode" if to_role == "prefill" else "prefill"
            return self._hold(s, "min_split", cur, f"{detail}; but {other} has only one replica")
        return Decision(f"move_to_{to_role}", reason, cur, target, detail)

    def _toward_override(self, s: Snapshot, cur: tuple[int, int], pin: tuple[int, int]) -> Decision:
        self._pending = None
        slots = s.prefill + s.decode
        if pin == cur:
            return self._hold(s, "override", pin, f"pinned at {_fmt(pin)}")
        if not slots <= sum(pin) <= slots + s.free_slots:
            return self._hold(s, "override_unreachable", pin,
                              f"the pinned split {_fmt(pin)} has {sum(pin)} replicas; {slots} serve, {s.free_slots} "
                              "more fit, and the controller never removes one")
        short = "prefill" if pin[0] > s.prefill else "decode"
        if sum(pin) == slots:
            s = replace(s, free_slots=0)  # the pin keeps the replicas it has: move, do not add
        return self._step(s, short, "override", pin, f"pinned at {_fmt(pin)}")

    def _pressure(self, s: Snapshot) -> tuple[Optional[str], Optional[str]]:
        """(reason the prefill stage is short, reason the decode stage is short), None where it is not."""
        target = self.policy.slo_attainment - self.policy.band
        pre = dec = None
        if s.tpot_attainment is not None and s.tpot_attainment < target:
            dec = "tpot_slo"
        elif s.kv_usage >= KV_FULL and s.decode_queue > 0:
            dec = "kv_full"
        if s.ttft_attainment is not None and s.ttft_attainment < target:
            if s.decode_queue / max(1, s.decode) > s.prefill_queue / max(1, s.prefill):
                dec = dec or "decode_queue"
            else:
                pre = "ttft_slo"
        return pre, dec

    def _propose(self, s: Snapshot, cur: tuple[int, int]) -> Decision:
        pre, dec = self._pressure(s)
        att = (f"TTFT attainment {_pct(s.ttft_attainment)}, TPOT {_pct(s.tpot_attainment)} (target "
               f"{_pct(self.policy.slo_attainment)}), queues {s.prefill_queue:g} prefill / {s.decode_queue:g} decode, "
               f"KV {_pct(s.kv_usage)}, {s.request_rate:.3g} req/s, {s.mean_input_len:.0f}/{s.mean_output_len:.0f} "
               "tokens in/out")
        if pre is None and dec is None:
            return self._hold(s, "slo_met", cur, att)
        grown = s.free_slots > 0
        if pre is not None and dec is not None:
            if self.scorer is not None:
                best, scores = self._best(s, cur)
                if best == cur:
                    return self._hold(s, "overloaded", cur, f"both stages short and no split predicted better; {att}")
                to = "prefill" if best[0] > s.prefill else "decode"
                return self._step(s, to, "model", best, f"model: {_scores(scores)}; {att}")
            pq, dq = s.prefill_queue / max(1, s.prefill), s.decode_queue / max(1, s.decode)
            if pq != dq:
                to = "prefill" if pq > dq else "decode"
                return self._step(s, to, "queue", _plus(cur, to, grown), att)
            # no queue to tell: the stage far further below its objective (the other may miss for its sake: a
            # request's first token is the decode's)
            gap = (s.ttft_attainment or 0.0) - (s.tpot_attainment or 0.0) if dec == "tpot_slo" else 0.0
            if abs(gap) <= self.policy.band:
                return self._hold(s, "overloaded", cur, f"both stages short, queues even; {att}")
            to = "decode" if gap > 0 else "prefill"
            return self._step(s, to, "shortfall", _plus(cur, to, grown), att)
        to, reason = ("prefill", pre) if pre is not None else ("decode", dec)
        target = _plus(cur, to, grown)
        # a TTFT missed for the decodes' queue is not the prefills' own: they can still give a worker up
        ttft_short = s.ttft_attainment is not None and s.ttft_attainment < self.policy.slo_attainment - self.policy.band
        giver_att = s.tpot_attainment if to == "prefill" else None if ttft_short else s.ttft_attainment
        if not grown and giver_att is not None and giver_att < self.policy.slo_attainment:
            return self._hold(s, "no_spare", cur, f"{to} is short ({reason}) but the other stage is under its target "
                                                  f"too; {att}")
        if self.scorer is not None and target[0] >= 1 and target[1] >= 1:
            now_score, new_score = self.scorer(s, cur), self.scorer(s, target)
            if new_score < now_score * (1 - self.policy.min_gain):
                return self._hold(s, "model_disagrees", cur, f"{to} is short but the model predicts "
                                                              f"{_fmt(target)} {new_score:.3g} req/s against "
                                                              f"{_fmt(cur)} {now_score:.3g}; {att}")
        return self._step(s, to, reason, target, att)

    def _best(self, s: Snapshot, cur: tuple[int, int]) -> tuple[tuple[int, int], dict]:
        """The model's best split of the slots (and of one more replica when one is free), the current one unless
        another beats it by ``min_gain``; and every score."""
        assert self.scorer is not None
        slots = s.prefill + s.decode
        totals = [slots] + ([slots + 1] if s.free_slots > 0 else [])
        scores = {(p, n - p): self.scorer(s, (p, n - p)) for n in totals for p in range(1, n)}
        best = max(scores, key=lambda k: (scores[k], -abs(k[0] - cur[0])))
        if scores[best] <= scores[cur] * (1 + self.policy.min_gain):
            return cur, scores
        return best, scores

    def _gate(self, s: Snapshot, proposal: Decision) -> Decision:
        """Hysteresis, then cooldown, on a proposed step."""
        key = proposal.action
        if self._pending is None or self._pending[0] != key:
            self._pending = (key, s.now)
        waited = s.now - self._pending[1]
        need = self.policy.hold_time(s.restart_s)
        if waited < need:
            return self._hold(s, "hysteresis", proposal.target, f"{proposal.action} ({proposal.reason}) proposed for "
                                                                 f"{waited:.0f}s of {need:.0f}s; {proposal.detail}")
        if self.last_move_end is not None:
            since, cool = s.now - self.last_move_end, self.policy.cooldown_time(s.restart_s)
            if since < cool:
                return self._hold(s, "cooldown", proposal.target, f"{proposal.action} ({proposal.reason}) waits: "
                                                                   f"last move {since:.0f}s ago, cooldown {cool:.0f}s; "
                                                                   f"{proposal.detail}")
        return proposal


def _plus(cur: tuple[int, int], role: str, grown: bool) -> tuple[int, int]:
    """The split one step toward ``role``: one more replica (``grown``: added), or one moved from the other role."""
    p, d = cur
    if role == "prefill":
        return (p + 1, d if grown else d - 1)
    return (p if grown else p - 1, d + 1)


def _pct(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{100 * x:.0f}%"


def _fmt(split: tuple[int, int]) -> str:
    return f"{split[0]}P{split[1]}D"


def _scores(scores: dict) -> str:
    return ", ".join(f"{_fmt(k)} {v:.3g}" for k, v in sorted(scores.items()))
