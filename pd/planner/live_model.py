"""The planner's model scoring splits for the live traffic: the split controller's ``scorer``.

A split's score is DistServe's goodput (pd.planner.simulate.max_goodput_rate: the highest request rate whose
simulated SLO attainment meets the target) for the workload measured in the window: its mean prompt and output
lengths, drawn log-normal around those means (sigma 0.5: the window gives means, not the distribution; a spread
keeps batching and queueing realistic), Poisson arrivals at the measured rate. Scores are kept per (split,
workload with each figure rounded to a twentieth of its power of ten: 3.01 req/s is 3.0, 141 tokens 140), so one
decision simulates each split once and a steady workload is not simulated again.
"""

from __future__ import annotations

import math
from typing import Optional

from pd.planner.controller import Snapshot
from pd.planner.profile import Profile
from pd.planner.simulate import SLO, Split, max_goodput_rate
from pd.planner.workload import Workload

LENGTH_SIGMA = 0.5
NUM_PROMPTS = 200  # requests per simulated run: enough for a 90th percentile, fast enough for every interval


def _round5(x: float) -> float:
    """``x`` to a twentieth of its power of ten (module docstring), so a jittering measurement hits the cache."""
    if x <= 0:
        return 0.0
    step = 10 ** math.floor(math.log10(x)) / 20
    return round(round(x / step) * step, 10)


class ModelScorer:
    """Scores (prefill, decode) replica splits at one TP size.

    Args:
        profile: the engines' costs (pd.planner.profile).
        tp_size: both roles' TP size (the controller needs them equal: pd.config.check_planner).
        slo: the objectives.
        attainment: the fraction of requests that must meet them.

    Raises:
        pd.planner.profile.ProfileError: the profile has no entry for ``tp_size``.
    """

    def __init__(self, profile: Profile, tp_size: int, slo: SLO, attainment: float):
        profile.entry(tp_size)
        self.profile, self.tp, self.slo, self.attainment = profile, tp_size, slo, attainment
        self._cache: dict = {}

    def workload(self, s: Snapshot) -> Optional[Workload]:
        """The simulated workload for snapshot ``s`` (None without traffic to model)."""
        if s.request_rate <= 0 or s.mean_input_len < 1 or s.mean_output_len < 1:
            return None
        return Workload(request_rate=_round5(s.request_rate), num_prompts=NUM_PROMPTS,
                        random_input_len=max(1, round(_round5(s.mean_input_len))),
                        random_output_len=max(1, round(_round5(s.mean_output_len))),
                        random_input_dist="lognormal", random_output_dist="lognormal",
                        random_lognormal_sigma=LENGTH_SIGMA)

    def __call__(self, s: Snapshot, split: tuple[int, int]) -> float:
        """Predicted goodput (requests/s) of ``split`` for ``s``'s workload; 0 without traffic to model."""
        w = self.workload(s)
        if w is None or min(split) < 1:
            return 0.0
        key = (split, w)
        if key not in self._cache:
            if len(self._cache) > 4096:
                self._cache.clear()
            self._cache[key] = max_goodput_rate(self.profile, Split(split[0], self.tp, split[1], self.tp), w,
                                                self.slo, self.attainment)
        return self._cache[key]
