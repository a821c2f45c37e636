"""The traffic the planner simulates: request arrival times and prompt/output lengths.

Lengths are ``pdserve bench``'s random datasets (pd.bench.datasets), so a planned workload and a measured run
describe the same traffic: ``uniform`` is ``sglang.bench_serving``'s (sglang/benchmark/datasets/common.py,
``compute_random_lens``: integers in ``[max(int(len x range_ratio), 1), len]``), ``fixed`` is ``len`` each,
``lognormal`` has mean ``len`` (``mu = ln(len) - sigma^2 / 2``), rounded and clipped to ``[1, 16 x len]``.
Arrivals are Poisson (exponential gaps, as bench_serving's ``get_request``) or evenly spaced (``constant``).
The draws are made at rate 1 and scaled, so runs of one seed at different rates see the same requests in the
same order (common random numbers: goodput against rate is then smooth enough to search).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from typing import Literal

LengthDist = Literal["uniform", "fixed", "lognormal"]


@dataclass(frozen=True)
class Request:
    """One request: arrival time (s from the start), prompt tokens, output tokens to generate."""

    arrival_s: float
    input_len: int
    output_len: int


@dataclass(frozen=True)
class Workload:
    """A random-length workload (field names follow bench_serving's flags).

    Attributes:
        request_rate: requests per second (> 0).
        num_prompts: requests in the run.
        random_input_len, random_output_len: the longest prompt / output, tokens.
        random_range_ratio: uniform lengths: the shortest is ``int(len x ratio)`` (at least 1).
        arrival_process: ``poisson`` or ``constant``.
        seed: draws of lengths and gaps.
        random_input_dist, random_output_dist: ``uniform``, ``fixed`` or ``lognormal`` (module docstring).
        random_lognormal_sigma: sigma of the log-normal lengths.
    """

    request_rate: float
    num_prompts: int = 1000
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    arrival_process: Literal["poisson", "constant"] = "poisson"
    seed: int = 0
    random_input_dist: LengthDist = "uniform"
    random_output_dist: LengthDist = "uniform"
    random_lognormal_sigma: float = 1.0

    def __post_init__(self):
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 requests/s, got {self.request_rate}")
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}")
        if self.random_input_len < 1 or self.random_output_len < 1:
            raise ValueError("random_input_len and random_output_len must be >= 1 token")
        if not 0.0 <= self.random_range_ratio <= 1.0:
            raise ValueError(f"random_range_ratio must be in [0, 1], got {self.random_range_ratio}")
        if self.arrival_process not in ("poisson", "constant"):
            raise ValueError(f"arrival_process must be poisson or constant, got {self.arrival_process!r}")
        for name in ("random_input_dist", "random_output_dist"):
            if getattr(self, name) not in ("uniform", "fixed", "lognormal"):
                raise ValueError(f"{name} must be uniform, fixed or lognormal, got {getattr(self, name)!r}")
        if not 0 < self.random_lognormal_sigma <= 4:
            raise ValueError(f"random_lognormal_sigma must be in (0, 4], got {self.random_lognormal_sigma}")

    def at_rate(self, request_rate: float) -> "Workload":
        """The same requests (same seed) arriving at ``request_rate``."""
        return replace(self, request_rate=request_rate)

    def requests(self) -> list[Request]:
        """The requests in arrival order; the first arrives at 0."""
        rng = random.Random(self.seed)

        def lens(dist: str, full: int) -> list[int]:
            if dist == "fixed":
                return [full] * self.num_prompts
            if dist == "lognormal":
                sigma = self.random_lognormal_sigma
                mu = math.log(full) - sigma * sigma / 2
                return [int(min(max(round(rng.lognormvariate(mu, sigma)), 1), 16 * full))
                        for _ in range(self.num_prompts)]
            lo = max(int(full * self.random_range_ratio), 1)
            return [rng.randint(lo, full) for _ in range(self.num_prompts)]

        ins = lens(self.random_input_dist, self.random_input_len)
        outs = lens(self.random_output_dist, self.random_output_len)
        t, out = 0.0, []
        for i in range(self.num_prompts):
            out.append(Request(t, ins[i], outs[i]))
            gap = rng.expovariate(1.0) if self.arrival_process == "poisson" else 1.0
            t += gap / self.request_rate
        return out
