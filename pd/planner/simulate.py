"""A discrete-event model of the PD pipeline: what each request's TTFT and TPOT would be under a split.

The pipeline, one request at a time (what pdserve's router and engines do, docs/design.md):

1. It arrives at the router, which picks a prefill and a decode replica (``round_robin``: each role in turn, the
   router's default; ``least_load``: the one with the fewest requests in flight).
2. Prefill: each replica serves a FIFO queue in batches. An idle replica takes the queue head and the requests
   behind it while the batch stays within ``max_batch_size`` prompts and ``max_batch_tokens`` tokens, and runs the
   batch for ``prefill.seconds(batch, mean input length)``; every request of the batch has its first token then.
3. KV transfer: ``transfer.seconds(input_len x kv_bytes_per_token)``, off the prefill's compute (the prefill takes
   its next batch meanwhile); transfers do not contend with each other.
4. Decode: continuous batching. Each iteration advances every running sequence by ``tokens_per_step`` tokens and
   takes ``decode.step_seconds(running, mean context)``; transferred requests wait for the next iteration, which
   admits them while ``max_batch_size`` and ``max_kv_tokens`` allow and adds their ``admit_seconds``. An admitted
   request streams its first token (the prefill's) at the end of that iteration: TTFT. It then needs
   ``ceil((output_len - 1) / tokens_per_step)`` iterations; its last one ends it (E2E).

An idle replica starts work once everything arriving at that instant has arrived, so simultaneous requests
share a batch. TPOT = (E2E - TTFT) / (output_len - 1), 0 for one output token, as sglang.bench_serving computes
it; goodput is scored by pdserve bench's own function (pd.bench.goodput); the run's duration runs from the first
arrival to the last completion.

Shared CPU cores (``profile.host``): when replicas share a machine's cores, every busy replica runs at
``min(1, cores / (cores the busy replicas need + the background demand))`` of its profiled speed (processor
sharing, as the kernel's fair scheduler shares cores among runnable threads); the background is other work on
the machine and the CPU the workload's requests cost outside the model threads (``Host.background_demand``).
Compute jobs are kept on a work clock W (profiled seconds done by any one busy replica, dW/dt = that speed), so a
change of speed moves no scheduled completion: it only changes how fast W reaches them.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Literal, Optional

from pd.planner.profile import DecodeCosts, PrefillCosts, Profile, TransferCosts
from pd.planner.workload import Request, Workload

Policy = Literal["round_robin", "least_load"]


@dataclass(frozen=True)
class Split:
    """A deployment's split: replicas x TP size per role."""

    prefill_replicas: int
    prefill_tp: int
    decode_replicas: int
    decode_tp: int

    def __post_init__(self):
        for name in ("prefill_replicas", "prefill_tp", "decode_replicas", "decode_tp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def num_gpus(self) -> int:
        """GPUs the split uses: replicas x TP summed over both roles."""
        return self.prefill_replicas * self.prefill_tp + self.decode_replicas * self.decode_tp

    @property
    def label(self) -> str:
        """``2P1D``, or with TP sizes above 1 ``1P(TP2)1D``, ``2P(TP4)1D(TP4)``."""
        p = f"{self.prefill_replicas}P" + (f"(TP{self.prefill_tp})" if self.prefill_tp > 1 else "")
        d = f"{self.decode_replicas}D" + (f"(TP{self.decode_tp})" if self.decode_tp > 1 else "")
        return p + d


@dataclass(frozen=True)
class SLO:
    """Per-request latency objectives in seconds (DistServe's two: TTFT and TPOT)."""

    ttft_s: float
    tpot_s: float

    def met(self, ttft_s: float, tpot_s: float) -> bool:
        """Whether a request with this TTFT and TPOT meets both (<=, as sglang's goodput counts)."""
        return ttft_s <= self.ttft_s and tpot_s <= self.tpot_s


@dataclass
class RequestResult:
    """One simulated request: its lengths and when each stage ended (seconds from the run's start)."""

    request: Request
    prefill_replica: int
    decode_replica: int
    prefill_start_s: float = math.nan
    prefill_end_s: float = math.nan
    kv_arrived_s: float = math.nan
    first_token_s: float = math.nan
    end_s: float = math.nan

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.request.arrival_s

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.request.arrival_s

    @property
    def tpot_s(self) -> float:
        n = self.request.output_len
        return (self.end_s - self.first_token_s) / (n - 1) if n > 1 else 0.0


@dataclass
class SimResult:
    """A simulated run: every request's stages, and the run's duration (first arrival to last completion)."""

    split: Split
    workload: Workload
    requests: list[RequestResult]
    duration_s: float

    def summary(self, slo: SLO) -> dict:
        """Goodput and latencies, named as sglang.bench_serving's result fields where they overlap
        (``request_goodput`` req/s, ``slo_attainment`` fraction, ``*_ms`` percentiles), plus the mean time
        per PD stage in ms (``stages_ms``: prefill queue, prefill, KV transfer, decode wait, decode)."""
        rs = self.requests
        ttft = sorted(r.ttft_s for r in rs)
        tpot = sorted(r.tpot_s for r in rs if r.request.output_len > 1) or [0.0]
        n = len(rs)

        def mean(xs) -> float:
            return 1e3 * sum(xs) / n

        return {
            "completed": n,
            "duration": self.duration_s,
            "request_throughput": n / self.duration_s,
            **score(self.records(), slo, self.duration_s),
            **{f"{k}_ttft_ms": 1e3 * v for k, v in percentiles(ttft).items()},
            **{f"{k}_tpot_ms": 1e3 * v for k, v in percentiles(tpot).items()},
            "stages_ms": {
                "prefill_queue": mean(r.prefill_start_s - r.request.arrival_s for r in rs),
                "prefill": mean(r.prefill_end_s - r.prefill_start_s for r in rs),
                "kv_transfer": mean(r.kv_arrived_s - r.prefill_end_s for r in rs),
                "decode_wait": mean(r.first_token_s - r.kv_arrived_s for r in rs),
                "decode": mean(r.end_s - r.first_token_s for r in rs),
            },
        }


    def records(self) -> list[dict]:
        """Per request ``ttft_ms`` and ``tpot_ms`` (None for one output token): pdserve bench's goodput records."""
        return [{"ttft_ms": 1e3 * r.ttft_s, "tpot_ms": 1e3 * r.tpot_s if r.request.output_len > 1 else None}
                for r in self.requests]


def score(records: list[dict], slo: SLO, duration_s: float) -> dict:
    """``pdserve bench``'s goodput of simulated records (pd.bench.goodput, DistServe's definition), so predicted
    and measured runs are scored by one function: request_goodput, slo_attainment, slo_attainment_by_metric."""
    from pd.bench.goodput import goodput

    g = goodput(records, 1e3 * slo.ttft_s, 1e3 * slo.tpot_s, duration_s)
    return {k: g[k] for k in ("request_goodput", "slo_attainment", "slo_attainment_by_metric", "num_good")}


def percentiles(sorted_values: list[float]) -> dict[str, float]:
    """mean, median, p90, p99 of ascending values (linear interpolation between ranks, numpy's default)."""
    def q(p: float) -> float:
        x = p * (len(sorted_values) - 1)
        i = int(x)
        j = min(i + 1, len(sorted_values) - 1)
        return sorted_values[i] + (sorted_values[j] - sorted_values[i]) * (x - i)

    return {"mean": sum(sorted_values) / len(sorted_values), "median": q(0.5), "p90": q(0.9), "p99": q(0.99)}


# ---- the event loop ---------------------------------------------------------------------------------------------

# Event kinds, in the order they are handled at one instant: an idle replica starts work (a kick) only after
# every request arriving at that instant has arrived, so simultaneous requests share a batch.
_ARRIVAL, _KV_ARRIVED, _KICK = 0, 1, 2


@dataclass
class _Prefill:
    costs: PrefillCosts
    demand: float  # host cores it keeps busy while it works (0: no shared host)
    queue: deque = field(default_factory=deque)
    batch: list = field(default_factory=list)
    in_flight: int = 0  # requests routed here and not yet past prefill (least_load)
    kicked: bool = False


@dataclass
class _Decode:
    costs: DecodeCosts
    demand: float
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)  # heap of (finishing iteration, seq, admitting iteration, request)
    admitted: list = field(default_factory=list)  # admitted in the iteration under way
    busy: bool = False
    iteration: int = 0
    context_base: float = 0.0  # sum over running of input_len - tokens_per_step x admitting iteration
    kv_tokens: int = 0
    in_flight: int = 0  # requests routed here and not finished (least_load)
    kicked: bool = False


class _Sim:
    def __init__(self, profile: Profile, split: Split, policy: Policy, rate: float, mean_output_len: float):
        self.kv_bytes = profile.kv_bytes_per_token
        p, d = profile.entry(split.prefill_tp), profile.entry(split.decode_tp)
        self.transfer: TransferCosts = profile.transfer_for(split.prefill_tp)
        pd_, dd = profile.host_demand(split.prefill_tp), profile.host_demand(split.decode_tp)
        self.prefills = [_Prefill(p.prefill, pd_) for _ in range(split.prefill_replicas)]
        self.decodes = [_Decode(d.decode, dd) for _ in range(split.decode_replicas)]
        self.policy = policy
        self.turn = [0, 0]
        self.cores = profile.host.cores if profile.host else None
        self.background = 0.0
        if profile.host:
            self.background = profile.host.background_demand(
                rate, mean_output_len, p.prefill.cpu_overhead_per_request_s + d.decode.cpu_overhead_per_request_s,
                d.decode.cpu_overhead_per_token_s)
        self.now = 0.0
        self.work = 0.0  # the work clock W
        self.busy = 0.0  # host cores the busy replicas need
        self.seq = 0
        self.events: list = []  # (time s, kind, seq, payload)
        self.jobs: list = []  # (W at completion, seq, server)

    # -- clocks
    def speed(self) -> float:
        demand = self.busy + self.background
        if self.cores is None or demand <= self.cores + 1e-9:
            return 1.0
        return self.cores / demand

    def start_job(self, server, seconds: float) -> None:
        self.seq += 1
        heapq.heappush(self.jobs, (self.work + seconds, self.seq, server))

    def at(self, t: float, kind: int, payload) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, kind, self.seq, payload))

    def run(self, requests: list[Request]) -> list[RequestResult]:
        results = []
        for r in requests:
            self.at(r.arrival_s, _ARRIVAL, r)
        while self.events or self.jobs:
            t_event = self.events[0][0] if self.events else math.inf
            t_job = self.now + (self.jobs[0][0] - self.work) / self.speed() if self.jobs else math.inf
            if t_job < t_event:  # at a tie, events first: simultaneous requests join one batch
                w, _, server = heapq.heappop(self.jobs)
                self.now, self.work = max(self.now, t_job), w
                self.job_done(server)
            else:
                t, kind, _, payload = heapq.heappop(self.events)
                if self.jobs:
                    self.work += (t - self.now) * self.speed()
                self.now = t
                if kind == _ARRIVAL:
                    results.append(self.arrive(payload))
                elif kind == _KV_ARRIVED:
                    self.kv_arrived(payload)
                else:
                    self.kick(payload)
        return results

    # -- routing
    def pick(self, role: int, servers: list) -> int:
        if self.policy == "least_load":
            return min(range(len(servers)), key=lambda i: (servers[i].in_flight, i))
        i = self.turn[role] % len(servers)
        self.turn[role] += 1
        return i

    def arrive(self, req: Request) -> RequestResult:
        pi, di = self.pick(0, self.prefills), self.pick(1, self.decodes)
        res = RequestResult(req, pi, di)
        p = self.prefills[pi]
        p.in_flight += 1
        self.decodes[di].in_flight += 1
        p.queue.append(res)
        if not p.batch and not p.kicked:
            p.kicked = True
            self.at(self.now, _KICK, p)
        return res

    def kick(self, server) -> None:
        server.kicked = False
        if isinstance(server, _Prefill):
            if not server.batch and server.queue:
                self.start_prefill(server)
        elif not server.busy and server.waiting:
            self.start_iteration(server)

    # -- prefill
    def start_prefill(self, p: _Prefill) -> None:
        c = p.costs
        batch = [p.queue.popleft()]
        tokens = batch[0].request.input_len
        while p.queue and len(batch) < c.max_batch_size:
            nxt = p.queue[0].request.input_len
            if c.max_batch_tokens is not None and tokens + nxt > c.max_batch_tokens:
                break
            batch.append(p.queue.popleft())
            tokens += nxt
        for r in batch:
            r.prefill_start_s = self.now
        p.batch = batch
        self.busy += p.demand
        self.start_job(p, c.seconds(len(batch), tokens / len(batch)))

    def prefill_done(self, p: _Prefill) -> None:
        for r in p.batch:
            r.prefill_end_s = self.now
            p.in_flight -= 1
            self.at(self.now + self.transfer.seconds(r.request.input_len * self.kv_bytes), _KV_ARRIVED, r)
        p.batch = []
        self.busy -= p.demand
        if p.queue:
            self.start_prefill(p)

    # -- decode
    def kv_arrived(self, r: RequestResult) -> None:
        r.kv_arrived_s = self.now
        d = self.decodes[r.decode_replica]
        d.waiting.append(r)
        if not d.busy and not d.kicked:
            d.kicked = True
            self.at(self.now, _KICK, d)

    def start_iteration(self, d: _Decode) -> None:
        c = d.costs
        seconds = 0.0
        b = len(d.running)
        if b:
            mean_ctx = (d.context_base + b * c.tokens_per_step * d.iteration) / b
            seconds += c.step_seconds(b, mean_ctx)
        while d.waiting and b + len(d.admitted) < c.max_batch_size:
            r = d.waiting[0]
            need = r.request.input_len + r.request.output_len
            if c.max_kv_tokens is not None and d.kv_tokens + need > c.max_kv_tokens and (b or d.admitted):
                break  # no room until a sequence finishes (one that can never fit runs alone)
            d.waiting.popleft()
            d.kv_tokens += need
            d.admitted.append(r)
            seconds += c.admit_seconds(r.request.input_len)
        d.busy = True
        self.busy += d.demand
        self.start_job(d, seconds)

    def iteration_done(self, d: _Decode) -> None:
        c = d.costs
        d.iteration += 1
        k = d.iteration
        while d.running and d.running[0][0] <= k:
            _, _, k_admit, r = heapq.heappop(d.running)
            d.context_base -= r.request.input_len - c.tokens_per_step * k_admit
            self.finish(d, r)
        for r in d.admitted:
            r.first_token_s = self.now
            steps = math.ceil((r.request.output_len - 1) / c.tokens_per_step)
            if steps <= 0:
                self.finish(d, r)
                continue
            self.seq += 1
            heapq.heappush(d.running, (k + steps, self.seq, k, r))
            d.context_base += r.request.input_len - c.tokens_per_step * k
        d.admitted = []
        d.busy = False
        self.busy -= d.demand
        if d.running or d.waiting:
            self.start_iteration(d)

    def finish(self, d: _Decode, r: RequestResult) -> None:
        r.end_s = self.now
        d.kv_tokens -= r.request.input_len + r.request.output_len
        d.in_flight -= 1

    def job_done(self, server) -> None:
        if isinstance(server, _Prefill):
            self.prefill_done(server)
        else:
            self.iteration_done(server)


def simulate(profile: Profile, split: Split, workload: Workload, policy: Policy = "round_robin",
             requests: Optional[list[Request]] = None) -> SimResult:
    """Simulate ``workload`` (or the given ``requests``) on ``split``.

    Raises:
        ProfileError: the profile has no entry for a TP size of the split.
    """
    reqs = workload.requests() if requests is None else requests
    mean_out = sum(r.output_len for r in reqs) / len(reqs)
    results = _Sim(profile, split, policy, workload.request_rate, mean_out).run(reqs)
    duration = max(r.end_s for r in results) - min(r.request.arrival_s for r in results)
    return SimResult(split, workload, results, duration)


def max_goodput_rate(profile: Profile, split: Split, workload: Workload, slo: SLO, attainment: float = 0.9,
                     policy: Policy = "round_robin", rel_tol: float = 0.02) -> float:
    """DistServe's goodput: the highest request rate (req/s) whose simulated SLO attainment is >= ``attainment``
    (DistServe, OSDI'24, section 2: 90% by default), found by doubling then bisection on the same requests
    rescaled (pd.planner.workload); 0 when even a slow trickle misses (the SLO is tighter than an unloaded
    request's latency)."""
    base = workload.requests()

    def ok(rate: float) -> bool:
        scaled = [Request(r.arrival_s * workload.request_rate / rate, r.input_len, r.output_len) for r in base]
        res = simulate(profile, split, workload.at_rate(rate), policy, scaled)
        return score(res.records(), slo, res.duration_s)["slo_attainment"] >= attainment

    lo, hi = 0.0, max(workload.request_rate, 1e-3)
    if ok(hi):
        lo = hi
        while ok(hi * 2):
            hi *= 2
            lo = hi
            if hi > 1e7:
                return hi
        hi *= 2
    else:
        floor = hi / 1024
        while hi > floor and not ok(hi / 2):
            hi /= 2
        if hi <= floor:
            return 0.0
        lo, hi = hi / 2, hi
    while hi - lo > rel_tol * lo:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo
