"""Adaptive speculative depth (SGLang's ``--speculative-adaptive``): the draft depth of each decode step chosen from
the decode's batch size and the running acceptance.

Follows SGLang 0.5.23's sglang/srt/speculative/adaptive_spec_params.py: the config format and its checks
(``_load_adaptive_config``, ``DEFAULT_ADAPTIVE_CONFIG``), one ``AdaptiveStepSlot`` per batch-size tier (an EMA of
the accepted drafts per request, a warmup, an update interval, hysteresis, a ceiling) and the routing of a batch
size to its tier (``bisect``). The formulas are copied; what this engine adds is ``DecodeRounds``, which turns its
one-sequence-at-a-time decode into SGLang's batches (see there). No torch: the settings resolve through here.
"""

from __future__ import annotations

import bisect
import json
import logging
import math
from dataclasses import dataclass
from typing import Collection, Hashable, Optional

from pd.engines.errors import EngineSettingsError

log = logging.getLogger(__name__)

CONFIG_FLAG = "--speculative-adaptive-config"

# SGLang's DEFAULT_ADAPTIVE_CONFIG, copied as a fact: deep drafts at batch 1, none from batch 64.
DEFAULT_ADAPTIVE_CONFIG: dict[str, dict] = {
    "1": {"candidate_steps": [1, 3, 5, 7], "up_hysteresis": 0.0, "down_hysteresis": -0.25, "ceiling_coeff": 0},
    "8": {"candidate_steps": [0, 1, 3], "up_hysteresis": 0.0, "down_hysteresis": 0.0, "ceiling_coeff": 0},
    "32": {"candidate_steps": [0, 1], "up_hysteresis": 0.0, "down_hysteresis": 0.0, "ceiling_coeff": 0},
    "64": {"candidate_steps": [0], "up_hysteresis": 0.0, "down_hysteresis": 0.0, "ceiling_coeff": 0},
}
# The per-tier knobs and SGLang's defaults for them (AdaptiveStepSlot.__init__'s cfg.get(...) fallbacks).
TIER_DEFAULTS: dict[str, float] = {"ema_alpha": 0.2, "update_interval": 5, "warmup_batches": 10,
                                   "down_hysteresis": -0.25, "up_hysteresis": 0.0, "ceiling_coeff": 0}
INT_KNOBS = ("update_interval", "warmup_batches")


@dataclass(frozen=True)
class TierConfig:
    """One batch-size tier of the adaptive config.

    Attributes:
        batch_size: the smallest decode batch size the tier serves (its key in the file).
        candidate_steps: the depths it may choose, sorted, without repeats (0: no drafting).
        ema_alpha: weight of a batch's mean accepted drafts in the EMA.
        update_interval: batches between depth decisions once warm.
        warmup_batches: batches before the first decision.
        down_hysteresis / up_hysteresis: added to the thresholds of a step down / up (accepted drafts).
        ceiling_coeff: > 0 caps a depth that is not a step up at ``ceil(ema x ceiling_coeff)``.
    """

    batch_size: int
    candidate_steps: tuple[int, ...]
    ema_alpha: float
    update_interval: int
    warmup_batches: int
    down_hysteresis: float
    up_hysteresis: float
    ceiling_coeff: float


@dataclass(frozen=True)
class AdaptiveConfig:
    """The adaptive config of one engine: its tiers by batch size and where they came from."""

    tiers: tuple[TierConfig, ...]
    source: str

    @property
    def candidate_steps(self) -> list[int]:
        """Every tier's candidate depths, sorted (SGLang's ``resolve_candidate_steps_from_config``)."""
        return sorted({s for t in self.tiers for s in t.candidate_steps})


def load_adaptive_config(path: Optional[str]) -> AdaptiveConfig:
    """Read and check an adaptive config file as SGLang's ``_load_adaptive_config`` does; None: SGLang's defaults.

    The file is a JSON object. Keys that are integer strings (``str.isdigit``) are batch-size tiers, each an object
    with ``candidate_steps`` (a non-empty list of ints >= 0) and optionally the knobs of ``TIER_DEFAULTS``; other
    top-level keys are ignored as tiers and serve as every tier's knob defaults (SGLang merges ``{**cfg, **entry}``).
    Unknown keys are ignored, as SGLang ignores them. Checked beyond SGLang (it fails at its first update instead):
    a knob that is not a number, ``update_interval`` / ``warmup_batches`` not integers, ``update_interval`` < 1,
    and ``true`` / ``false`` in ``candidate_steps`` (Python counts them as ints).

    Raises:
        EngineSettingsError: naming ``--speculative-adaptive-config``, the file and the key at fault.
    """
    where = f"{CONFIG_FLAG} {path}"
    if path is None:
        data: object = DEFAULT_ADAPTIVE_CONFIG
    else:
        try:
            with open(path) as f:
                data = json.load(f)
        except OSError as e:
            raise EngineSettingsError(CONFIG_FLAG, f"{where}: cannot read it ({e.strerror or e})") from None
        except ValueError as e:
            raise EngineSettingsError(CONFIG_FLAG, f"{where}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise EngineSettingsError(CONFIG_FLAG, f"{where}: the file must hold a JSON object of batch-size tiers, got "
                                               f"{type(data).__name__}")
    shared = {k: v for k, v in data.items() if not k.isdigit()}
    tiers = []
    for key, entry in data.items():
        if not key.isdigit():
            continue
        if not isinstance(entry, dict):
            raise EngineSettingsError(CONFIG_FLAG, f'{where}: BS "{key}": a tier must be a JSON object, got '
                                                   f"{entry!r}")
        steps = entry.get("candidate_steps")
        if (not isinstance(steps, list) or not steps
                or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in steps)):
            # SGLang's message: "BS {key}: candidate_steps must be a list of non-negative ints, got {steps!r}"
            raise EngineSettingsError(CONFIG_FLAG, f'{where}: BS "{key}": candidate_steps must be a list of '
                                                   f"non-negative ints, got {steps!r}")
        merged = {**TIER_DEFAULTS, **shared, **entry}
        for knob in TIER_DEFAULTS:
            _check_knob(where, key if knob in entry else None, knob, merged[knob])
        tiers.append(TierConfig(int(key), tuple(sorted(set(steps))), float(merged["ema_alpha"]),
                                int(merged["update_interval"]), int(merged["warmup_batches"]),
                                float(merged["down_hysteresis"]), float(merged["up_hysteresis"]),
                                float(merged["ceiling_coeff"])))
    if not tiers:
        raise EngineSettingsError(CONFIG_FLAG, f"{where}: speculative_adaptive_config must contain at least one "
                                               'integer-string BS key, e.g. {"1": {"candidate_steps": [1,3,7]}}. '
                                               f"Got keys: {list(data)}")
    return AdaptiveConfig(tuple(sorted(tiers, key=lambda t: t.batch_size)), path or "SGLang's default tiers")


def _check_knob(where: str, tier: Optional[str], knob: str, value: object) -> None:
    """Refuse a knob value SGLang's slot would fail on (a non-number; an interval that divides by zero)."""
    at = f'BS "{tier}": {knob}' if tier is not None else knob
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise EngineSettingsError(CONFIG_FLAG, f"{where}: {at} must be a number, got {value!r}")
    if knob in INT_KNOBS and not isinstance(value, int):
        raise EngineSettingsError(CONFIG_FLAG, f"{where}: {at} must be an integer (batches), got {value!r}")
    if knob == "update_interval" and value < 1:
        raise EngineSettingsError(CONFIG_FLAG, f"{where}: {at} must be >= 1, got {value!r}")


class AdaptiveStepSlot:
    """One tier's depth: an EMA of accepted drafts per request, a depth decision every ``update_interval`` batches
    after ``warmup_batches`` (SGLang's ``AdaptiveStepSlot``, formulas and order kept).

    Args:
        initial_steps: the engine's starting depth; kept when it is a candidate, else the middle candidate.
        tier: the tier's settings.
    """

    def __init__(self, initial_steps: int, tier: TierConfig):
        self.tier = tier
        self.candidate_steps = list(tier.candidate_steps)
        if initial_steps in self.candidate_steps:
            self.current_steps = initial_steps
        else:
            self.current_steps = self.candidate_steps[len(self.candidate_steps) // 2]
        self.ema_accept_len = float(self.current_steps - 1)  # SGLang's neutral start
        self._batch_count = 0

    def update(self, accepted_drafts: list[int]) -> bool:
        """Feed one batch's accepted drafts per request (bonus not counted); True when the depth changed. The EMA
        moves only while drafting (depth > 0); the batch counts either way."""
        if not accepted_drafts:
            return False
        if self.current_steps > 0:
            batch_avg = sum(accepted_drafts) / len(accepted_drafts)
            a = self.tier.ema_alpha
            self.ema_accept_len = (1 - a) * self.ema_accept_len + a * batch_avg
        self._batch_count += 1
        if self._batch_count <= self.tier.warmup_batches:
            return False
        if (self._batch_count - self.tier.warmup_batches) % self.tier.update_interval != 0:
            return False
        return self._recompute()

    def _recompute(self) -> bool:
        """The depth the EMA asks for: from 0, probe the next candidate up; else step down past every candidate
        whose threshold (``prev - 0.5``, 0.5 for a 0 floor, plus ``down_hysteresis``) the EMA is at or under, and
        only when not stepping down, up past every one whose ``current - 0.5 + up_hysteresis`` it exceeds; a
        ceiling of ``max(1, ceil(ema x ceiling_coeff))`` caps a decision that is not a step up."""
        old = self.current_steps
        cands = self.candidate_steps
        idx = old_idx = cands.index(old)
        if old == 0:
            idx = min(idx + 1, len(cands) - 1)
            target = cands[idx]
            if target > 0 and self.ema_accept_len < 0:  # started at 0: no acceptance seen yet
                self.ema_accept_len = float(target - 1)
            return self._apply(target)
        while idx > 0:
            prev = cands[idx - 1]
            drop = (0.5 if prev == 0 else prev - 0.5) + self.tier.down_hysteresis
            if self.ema_accept_len <= drop:
                idx -= 1
            else:
                break
        if idx == old_idx:
            while idx < len(cands) - 1 and self.ema_accept_len > cands[idx] - 0.5 + self.tier.up_hysteresis:
                idx += 1
        target = cands[idx]
        if self.tier.ceiling_coeff > 0:
            ceiling = max(1, math.ceil(self.ema_accept_len * self.tier.ceiling_coeff))
            if ceiling < target <= old:
                while idx > 0 and cands[idx] > ceiling:
                    idx -= 1
                target = cands[idx]
        return self._apply(target)

    def _apply(self, target: int) -> bool:
        if target == self.current_steps:
            return False
        log.info("adaptive speculative depth (tier BS %d): steps %d -> %d (ema_accept_len=%.2f)",
                 self.tier.batch_size, self.current_steps, target, self.ema_accept_len)
        self.current_steps = target
        return True


class AdaptiveSpeculativeParams:
    """A slot per tier, and the tier of a batch size: the largest tier key <= the batch size, the smallest tier
    below all of them (SGLang's ``_find_closest_bs``; without CUDA graphs it pads no batch size)."""

    def __init__(self, initial_steps: int, config: AdaptiveConfig):
        self._bs = [t.batch_size for t in config.tiers]
        self._slots = [AdaptiveStepSlot(initial_steps, t) for t in config.tiers]

    def slot(self, batch_size: int) -> AdaptiveStepSlot:
        """The slot that serves ``batch_size`` sequences."""
        return self._slots[max(0, bisect.bisect_right(self._bs, batch_size) - 1)]

    def steps_for_batch(self, batch_size: int) -> int:
        """The depth a batch of ``batch_size`` runs at now."""
        return self.slot(batch_size).current_steps

    def on_verify_complete(self, accepted_drafts: list[int], batch_size: int) -> Optional[int]:
        """Feed one batch's accepted drafts to its tier; the tier's new depth when it changed, else None."""
        s = self.slot(batch_size)
        return s.current_steps if s.update(accepted_drafts) else None


class DecodeRounds:
    """SGLang's decode batches over this engine's decode, which steps one sequence at a time in turn.

    SGLang picks the depth once per batch from its size, runs every request of it at that depth, and feeds the
    batch's accepted drafts per request to that size's slot after the verify (eagle_worker_v2.py:
    ``activate_step_by_batch`` then ``on_verify_complete``). Here the running decode sequences each take a step in
    turn (FIFO on the model thread), so a *round* is the batch: it opens at a step when no round is open, takes
    its depth from the number of decoding sequences then, and closes when a sequence comes back for its next step,
    or when none of its sequences decodes any more (its tier is fed then, before the new round picks its depth).
    A sequence that joins mid-round runs at the round's depth, as it would join SGLang's next batch at that batch's
    depth.
    """

    def __init__(self, params: AdaptiveSpeculativeParams):
        self.params = params
        self._members: set[Hashable] = set()
        self._accepted: list[int] = []
        self._batch_size = 0
        self._steps = 0

    def begin(self, key: Hashable, decoding: Collection[Hashable]) -> int:
        """The sequence ``key`` starts a step while the sequences ``decoding`` (``key`` among them) decode; returns
        the depth it runs at."""
        if self._members and (key in self._members or self._members.isdisjoint(decoding)):
            self._close()
        if not self._members:
            self._batch_size = len(decoding)
            self._steps = self.params.steps_for_batch(self._batch_size)
        self._members.add(key)
        return self._steps

    def end(self, accepted_drafts: int) -> None:
        """The step that ``begin`` opened accepted ``accepted_drafts`` drafts (the bonus token not counted)."""
        self._accepted.append(accepted_drafts)

    def _close(self) -> None:
        self.params.on_verify_complete(self._accepted, self._batch_size)
        self._members.clear()
        self._accepted = []
