"""Choosing a split: every way to divide a GPU budget between prefill and decode, simulated and ranked.

A candidate is (prefill replicas x TP, decode replicas x TP) with TP sizes from the allowed list that the profile
has, at least one replica per role, using at most the budget. Each is simulated twice
(pd.planner.simulate): at the requested rate, for its SLO attainment and goodput there, and under a rate search
for DistServe's goodput (the highest rate it serves at the attainment target). Candidates rank by that goodput per
GPU, as DistServe chooses its placement; a split that fails the target at the requested rate ranks after every
one that meets it. Equal goodputs (the rate search stops within 2%) are ordered by the attainment at the requested
rate, then by its p90 TTFT + p90 TPOT, then fewer GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass

from pd.planner.profile import Profile, ProfileError
from pd.planner.simulate import SLO, Policy, Split, max_goodput_rate, simulate
from pd.planner.workload import Workload


@dataclass(frozen=True)
class Candidate:
    """One ranked split.

    Attributes:
        split: the split.
        max_rate: DistServe goodput, req/s (highest rate with attainment >= the target).
        per_gpu: ``max_rate / split.num_gpus``.
        at_rate: the simulation summary at the requested rate (pd.planner.simulate.SimResult.summary).
        meets_rate: whether the split serves the requested rate at the attainment target.
    """

    split: Split
    max_rate: float
    per_gpu: float
    at_rate: dict
    meets_rate: bool

    def row(self) -> dict:
        """The table row as JSON: split, GPUs, goodput figures, latencies at the requested rate."""
        s = self.at_rate
        return {"split": self.split.label, "prefill": {"replicas": self.split.prefill_replicas,
                                                       "tp_size": self.split.prefill_tp},
                "decode": {"replicas": self.split.decode_replicas, "tp_size": self.split.decode_tp},
                "num_gpus": self.split.num_gpus, "max_goodput_rate": self.max_rate,
                "max_goodput_rate_per_gpu": self.per_gpu, "meets_request_rate": self.meets_rate,
                "request_goodput": s["request_goodput"], "slo_attainment": s["slo_attainment"],
                "median_ttft_ms": s["median_ttft_ms"], "p90_ttft_ms": s["p90_ttft_ms"],
                "median_tpot_ms": s["median_tpot_ms"], "p90_tpot_ms": s["p90_tpot_ms"], "stages_ms": s["stages_ms"]}


def candidate_splits(num_gpus: int, tp_sizes: list[int], profile: Profile) -> list[Split]:
    """Every split of at most ``num_gpus`` GPUs with TP sizes in ``tp_sizes`` (each must be profiled).

    Raises:
        ProfileError: a TP size the profile has no entry for.
        ValueError: no split fits (``num_gpus`` below two of the smallest TP size).
    """
    for tp in tp_sizes:
        profile.entry(tp)  # names the missing TP size
    out = []
    for ptp in sorted(set(tp_sizes)):
        for dtp in sorted(set(tp_sizes)):
            for p in range(1, num_gpus // ptp + 1):
                for d in range(1, (num_gpus - p * ptp) // dtp + 1):
                    out.append(Split(p, ptp, d, dtp))
    if not out:
        raise ValueError(f"no split of {num_gpus} GPUs with TP sizes {sorted(set(tp_sizes))} has a prefill and a "
                         "decode replica")
    return out


def rank_splits(profile: Profile, num_gpus: int, tp_sizes: list[int], workload: Workload, slo: SLO,
                attainment: float = 0.9, policy: Policy = "round_robin") -> list[Candidate]:
    """Simulate every candidate split and rank them (module docstring), best first.

    Raises:
        ProfileError, ValueError: as ``candidate_splits``.
    """
    if not 0 < attainment <= 1:
        raise ValueError(f"attainment must be in (0, 1], got {attainment}")
    ranked = []
    for split in candidate_splits(num_gpus, tp_sizes, profile):
        at = simulate(profile, split, workload, policy).summary(slo)
        rate = max_goodput_rate(profile, split, workload, slo, attainment, policy)
        ranked.append(Candidate(split, rate, rate / split.num_gpus, at, at["slo_attainment"] >= attainment))
    ranked.sort(key=lambda c: (not c.meets_rate, -round(c.per_gpu, 9), -c.at_rate["slo_attainment"],
                               c.at_rate["p90_ttft_ms"] + c.at_rate["p90_tpot_ms"], c.split.num_gpus, c.split.label))
    return ranked


__all__ = ["Candidate", "ProfileError", "candidate_splits", "rank_splits"]
