"""Speculative decoding's settings (SGLang's ``--speculative-*`` flags), resolved and checked as SGLang does.

One model, ``SpeculativeSettings``, is the engine's ``--speculative-*`` flags (a section of
pd.engines.settings.EngineSettings), the cluster config's ``speculative:`` block (pd.config subclasses it) and
what a decode sends its prefill in the bootstrap handshake. No torch: the flag parser and the config import it.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, fields
from typing import ClassVar, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pd.engines.errors import EngineSettingsError
from pd.engines.models.builtin_model import BUILTIN_PREFIX
from pd.engines.spec.adaptive import AdaptiveConfig, load_adaptive_config

log = logging.getLogger(__name__)

ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN")  # SGLang's EAGLE family, as both engine kinds take it
REFERENCE_ALGORITHMS = ("EAGLE", "NEXTN")  # NEXTN is SGLang's alias of EAGLE (speculative_hook.py resolves it so)
DEFAULT_STEPS = (3, 1, 4)  # SGLang's auto choice for DeepSeek MTP: (num_steps, eagle_topk, num_draft_tokens)


class SpeculativeSettings(BaseModel):
    """EAGLE/MTP speculative decoding, SGLang's ``--speculative-*`` flags (sglang/srt/server_args.py). Values left
    unset are chosen as SGLang chooses them (``resolve_speculative``); both PD sides must agree on all of them."""

    # The docstring under a field is its description: its flag's --help and the config key's documentation.
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)
    FLAG: ClassVar[str] = "--speculative-{}"  # the flag of a key (pd.util.settings_flags)

    algorithm: Optional[str] = None
    """EAGLE (or NEXTN, SGLang's alias of it for MTP checkpoints): speculative decoding with an MTP/EAGLE draft.
    EAGLE3 drafts with an EAGLE-3 head (SGLang workers only). Unset: off."""
    draft_model_path: Optional[str] = None
    """The draft checkpoint. Unset: SGLang uses the target's own MTP layers, the reference engine builtin:tiny's
    built-in draft (other models need one)."""
    num_steps: Optional[int] = Field(default=None, ge=1)
    """Draft tokens proposed per verify step. Unset: 3, with topk 1 and 4 draft tokens (SGLang's choice for
    DeepSeek MTP)."""
    eagle_topk: Optional[int] = Field(default=None, ge=1)
    """Tokens kept per draft step; > 1 drafts a tree, which SGLang serves and the reference engine refuses (it
    has no tree attention). Unset: 1."""
    num_draft_tokens: Optional[int] = Field(default=None, ge=1)
    """Tokens per verify window; with topk 1 both engines use num_steps + 1 whatever is set (SGLang adjusts it
    with a warning). With adaptive, the window of the deepest candidate (docs/speculative-decoding.md)."""
    adaptive: bool = False
    """Choose the draft depth of every decode step at run time from the decode's batch size and the running
    acceptance, among the adaptive config's candidate depths (0: that step does not draft). EAGLE/NEXTN with
    eagle_topk 1. num_steps, if set, is the starting depth and must be a candidate; unset, the middle candidate."""
    adaptive_config: Optional[str] = None
    """A JSON file of batch-size tiers for adaptive (SGLang's format: {"1": {"candidate_steps": [1, 3, 5, 7], ...},
    "8": ...}). Unset: SGLang's default tiers."""

    @field_validator("algorithm")
    @classmethod
    def _known_algorithm(cls, v: Optional[str]) -> Optional[str]:
        if v is None:
            return v
        if v.upper() not in ALGORITHMS:  # SGLang upper-cases the value before it compares
            raise ValueError(f"{v!r} is not one of {', '.join(ALGORITHMS)} (SGLang's EAGLE family)")
        return v.upper()



@dataclass(frozen=True)
class SpecConfig:
    """Resolved speculative settings of one engine (``resolve_speculative``); both PD sides must agree on all of
    them.

    Attributes:
        algorithm: ``EAGLE`` (``NEXTN`` resolves to it).
        num_steps: draft tokens proposed per verify step.
        eagle_topk: 1 (a chain); tree drafting is refused at start.
        num_draft_tokens: tokens per verify window, ``num_steps + 1`` for a chain; with adaptive, the deepest
            candidate's (``max(candidate_steps) + 1``: the pages a decode holds for the window cover every depth,
            SGLang's ``max_speculative_num_draft_tokens``).
        draft_model_path: the draft checkpoint as given; None for a built-in model's own draft.
        adaptive: the depth adapts at run time (pd.engines.spec.adaptive); ``num_steps`` is then the starting
            depth (may be 0).
        adaptive_config: the adaptive tiers (SGLang's defaults or the file's), None when not adaptive.
    """

    algorithm: str
    num_steps: int
    eagle_topk: int
    num_draft_tokens: int
    draft_model_path: Optional[str]
    adaptive: bool = False
    adaptive_config: Optional[AdaptiveConfig] = None

    def handshake(self) -> dict:
        """The settings a decode sends in its bootstrap registration for the prefill to compare (the draft is
        compared by its KV layout and hidden size, not by path: paths differ between nodes; the adaptive tiers
        steer the decode's steps only)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in ("draft_model_path", "adaptive_config")}

    def flags(self) -> str:
        """The settings as the command-line flags that give them (for error messages)."""
        out = []
        for k, v in self.handshake().items():
            if isinstance(v, bool):
                out += [_flag(k)] if v else []
            else:
                out.append(f"{_flag(k)} {v}")
        return " ".join(out)


def resolve_speculative(sp: SpeculativeSettings, model_path: str) -> Optional[SpecConfig]:
    """Check the settings as SGLang does (sglang/srt/arg_groups/speculative_hook.py, ``_handle_eagle_family``) and
    fill what is unset; None when speculation is off.

    SGLang's behaviour kept: ``NEXTN`` is ``EAGLE``; ``num_steps`` unset means all three counts are chosen
    together, so ``eagle_topk`` / ``num_draft_tokens`` must be unset too (SGLang asserts it); the choice is
    DeepSeek MTP's (3, 1, 4), the draft here being MTP-shaped (SGLang picks (5, 4, 8) for a Llama target, a tree,
    which this engine does not draft); with topk 1, ``num_draft_tokens`` is adjusted to ``num_steps + 1`` with
    SGLang's warning. With ``--speculative-adaptive`` (``_init_adaptive_speculative_params``): the tiers are read
    and checked, topk unset is 1, ``num_steps`` unset is the middle of every tier's candidates and, set, must be one
    of them; ``num_draft_tokens`` is then the deepest candidate's window (SGLang resolves it to ``num_steps + 1``
    and sizes its buffers for the deepest, ``max_speculative_num_draft_tokens``).

    Raises:
        EngineSettingsError: naming the flag: a setting without ``--speculative-algorithm``, EAGLE3, topk > 1,
            counts given without ``--speculative-num-steps``, no draft for a model without a built-in one, an
            adaptive config without ``--speculative-adaptive`` or one that cannot be read or is malformed, a
            ``--speculative-num-steps`` that is not an adaptive candidate.
    """
    if sp.algorithm is None:
        stray = [k for k, v in sp.model_dump().items() if v != SpeculativeSettings.model_fields[k].default]
        if stray:
            raise EngineSettingsError(_flag(stray[0]), f"{_flag(stray[0])} needs --speculative-algorithm "
                                                       "(EAGLE or NEXTN)")
        return None
    if sp.algorithm not in REFERENCE_ALGORITHMS:
        raise EngineSettingsError(_flag("algorithm"), f"--speculative-algorithm {sp.algorithm}: the reference "
                                  f"engine supports {' and '.join(REFERENCE_ALGORITHMS)} (an MTP draft layer), "
                                  "not EAGLE-3 heads")
    if sp.adaptive_config is not None and not sp.adaptive:
        raise EngineSettingsError(_flag("adaptive_config"), f"{_flag('adaptive_config')} needs "
                                  f"{_flag('adaptive')} (it only tunes the adaptive depth)")
    if sp.adaptive:
        return _resolve_adaptive(sp, model_path)
    steps, topk, draft_tokens = sp.num_steps, sp.eagle_topk, sp.num_draft_tokens
    if steps is None:
        if topk is not None or draft_tokens is not None:
            raise EngineSettingsError(_flag("num_steps"), "--speculative-eagle-topk and "
                                      "--speculative-num-draft-tokens need --speculative-num-steps (unset, all "
                                      "three are chosen together)")
        steps, topk, draft_tokens = DEFAULT_STEPS
    topk = _chain_topk(topk)
    if draft_tokens != steps + 1:
        if draft_tokens is not None:
            log.warning("speculative_num_draft_tokens is adjusted to speculative_num_steps + 1 when "
                        "speculative_eagle_topk == 1")
        draft_tokens = steps + 1
    _check_draft_given(sp, model_path)
    return SpecConfig("EAGLE", steps, topk, draft_tokens, sp.draft_model_path)


def _resolve_adaptive(sp: SpeculativeSettings, model_path: str) -> SpecConfig:
    """``--speculative-adaptive`` (SGLang's ``_init_adaptive_speculative_params``): the starting depth is the middle
    of every tier's candidates unless given, and a given one must be a candidate. SGLang's other refusals
    (``adaptive_unsupported_reason``: EAGLE3 aside, topk > 1) are refused here before, as without adaptive."""
    cfg = load_adaptive_config(sp.adaptive_config)
    candidates = cfg.candidate_steps
    topk = _chain_topk(sp.eagle_topk)
    steps = candidates[len(candidates) // 2] if sp.num_steps is None else sp.num_steps
    if steps not in candidates:
        raise EngineSettingsError(_flag("num_steps"), f"{_flag('num_steps')} {steps}: not in the adaptive config's "
                                  f"candidate_steps {candidates} ({cfg.source}); pass one of those values")
    _check_draft_given(sp, model_path)
    return SpecConfig("EAGLE", steps, topk, max(candidates) + 1, sp.draft_model_path, adaptive=True,
                      adaptive_config=cfg)


def _chain_topk(topk: Optional[int]) -> int:
    """``eagle_topk``, 1 when unset; a tree (> 1) is refused."""
    topk = 1 if topk is None else topk
    if topk > 1:
        raise EngineSettingsError(_flag("eagle_topk"), f"--speculative-eagle-topk {topk}: the reference engine "
                                  "drafts a chain only (--speculative-eagle-topk 1); tree drafting needs tree "
                                  "attention, which it does not have")
    return topk


def _check_draft_given(sp: SpeculativeSettings, model_path: str) -> None:
    if sp.draft_model_path is None and not model_path.startswith(BUILTIN_PREFIX):
        raise EngineSettingsError(_flag("draft_model_path"), f"--speculative-draft-model-path is required with "
                                  f"--model-path {model_path} (only built-in models have a default draft)")


def _flag(key: str) -> str:
    return SpeculativeSettings.FLAG.format(key.replace("_", "-"))


def check_draft_shape(model_path: str, draft_path: str) -> None:
    """Refuse, at engine start before anything loads, a draft checkpoint that cannot serve the target (the engine's
    own check: a config built elsewhere may name paths that exist only on the GPU nodes): no config.json, or a
    hidden size (or vocabulary) other than the target's (an MTP draft reads the target's hidden states and shares
    its embedding and LM head). A built-in target is compared by its recipe's hidden size.

    Raises:
        EngineSettingsError: naming ``--speculative-draft-model-path`` and both values.
    """
    from pd.engines.models.builtin_model import TINY

    flag = _flag("draft_model_path")
    draft = _config_json(draft_path)
    if draft is None:
        raise EngineSettingsError(flag, f"{flag} {draft_path}: no config.json there (not a draft checkpoint "
                                        "directory)")
    target = {"hidden_size": TINY["hidden_size"]} if model_path.startswith(BUILTIN_PREFIX) else _config_json(model_path)
    for key in ("hidden_size", "vocab_size"):
        if target and key in target and draft.get(key) != target[key]:
            raise EngineSettingsError(flag, f"{flag} {draft_path}: the draft's {key} is {draft.get(key)}, the "
                                      f"target's ({model_path}) is {target[key]}; an MTP/EAGLE draft must match "
                                      "the target's")


def _config_json(path: str) -> Optional[dict]:
    try:
        with open(os.path.join(path, "config.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
