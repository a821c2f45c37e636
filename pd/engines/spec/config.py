"""The reference engine's ``--speculative-*`` settings, checked as SGLang checks them (no torch: the flag parser
imports this)."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from typing import Optional

from pd.engines.models.builtin_model import BUILTIN_PREFIX

log = logging.getLogger(__name__)

ALGORITHMS = ("EAGLE", "NEXTN")  # NEXTN is SGLang's alias of EAGLE (speculative_hook.py resolves it so)
DEFAULT_STEPS = (3, 1, 4)  # SGLang's auto choice for DeepSeek MTP: (num_steps, eagle_topk, num_draft_tokens)


@dataclass(frozen=True)
class SpecConfig:
    """Resolved speculative settings of one engine; both PD sides must agree on all of them.

    Attributes:
        algorithm: ``EAGLE`` (``NEXTN`` resolves to it).
        num_steps: draft tokens proposed per verify step (``--speculative-num-steps``).
        eagle_topk: 1 (a chain); tree drafting is refused at start.
        num_draft_tokens: tokens per verify window, ``num_steps + 1`` for a chain.
        draft_model_path: the draft checkpoint as given; None for a built-in model's own draft.
    """

    algorithm: str
    num_steps: int
    eagle_topk: int
    num_draft_tokens: int
    draft_model_path: Optional[str]

    def handshake(self) -> dict:
        """The settings a decode sends in its bootstrap registration for the prefill to compare (the draft is
        compared by its KV layout and hidden size, not by path: paths differ between nodes)."""
        d = asdict(self)
        del d["draft_model_path"]
        return d

    def flags(self) -> str:
        """The settings as the command-line flags that give them (for error messages)."""
        return (f"--speculative-algorithm {self.algorithm} --speculative-num-steps {self.num_steps} "
                f"--speculative-eagle-topk {self.eagle_topk} --speculative-num-draft-tokens {self.num_draft_tokens}")


def resolve_spec_config(args) -> Optional[SpecConfig]:
    """Check the ``--speculative-*`` flags as SGLang does (sglang/srt/arg_groups/speculative_hook.py,
    ``_handle_eagle_family``) and resolve them; None when speculation is off.

    SGLang's behaviour kept: ``NEXTN`` is ``EAGLE``; ``--speculative-num-steps`` unset means all three are chosen
    together, so ``--speculative-eagle-topk`` / ``--speculative-num-draft-tokens`` must be unset too (SGLang
    asserts it); the choice is DeepSeek MTP's (3, 1, 4), the draft here being MTP-shaped (SGLang picks (5, 4, 8)
    for a Llama target, a tree, which this engine does not draft); with topk 1, ``--speculative-num-draft-tokens``
    is adjusted to ``num_steps + 1`` with SGLang's warning.

    Raises:
        SystemExit: a message naming the bad flag: an unknown algorithm, a count below 1, topk > 1, a
            ``--speculative-*`` flag without ``--speculative-algorithm``, no draft path for a non-built-in model.
    """
    algo = args.speculative_algorithm
    given = {f: getattr(args, f) for f in ("speculative_num_steps", "speculative_eagle_topk",
                                           "speculative_num_draft_tokens", "speculative_draft_model_path")}
    if algo is None:
        stray = [f for f, v in given.items() if v is not None]
        if stray:
            raise SystemExit(f"--{stray[0].replace('_', '-')} needs --speculative-algorithm (EAGLE or NEXTN)")
        return None
    if algo.upper() not in ALGORITHMS:
        raise SystemExit(f"--speculative-algorithm {algo!r}: the reference engine supports {', '.join(ALGORITHMS)}")
    steps, topk, draft_tokens = (given["speculative_num_steps"], given["speculative_eagle_topk"],
                                 given["speculative_num_draft_tokens"])
    if steps is None:
        if topk is not None or draft_tokens is not None:
            raise SystemExit("--speculative-eagle-topk and --speculative-num-draft-tokens need "
                             "--speculative-num-steps (unset, all three are chosen together)")
        steps, topk, draft_tokens = DEFAULT_STEPS
    topk = 1 if topk is None else topk
    for flag, value in (("--speculative-num-steps", steps), ("--speculative-eagle-topk", topk)):
        if value < 1:
            raise SystemExit(f"{flag} must be >= 1, got {value}")
    if topk > 1:
        raise SystemExit(f"--speculative-eagle-topk {topk}: the reference engine drafts a chain only "
                         "(--speculative-eagle-topk 1); tree drafting needs tree attention, which it does not have")
    if draft_tokens != steps + 1:
        if draft_tokens is not None:
            log.warning("speculative_num_draft_tokens is adjusted to speculative_num_steps + 1 when "
                        "speculative_eagle_topk == 1")
        draft_tokens = steps + 1
    draft = given["speculative_draft_model_path"]
    if draft is None and not args.model_path.startswith(BUILTIN_PREFIX):
        raise SystemExit(f"--speculative-draft-model-path is required with --model-path {args.model_path} "
                         "(only built-in models have a default draft)")
    return SpecConfig("EAGLE", steps, topk, draft_tokens, draft)


def check_draft_shape(model_path: str, draft_path: str) -> None:
    """Refuse, at engine start before anything loads, a draft checkpoint that cannot serve the target (the engine's
    own check: a config built elsewhere may name paths that exist only on the GPU nodes): no config.json, or a
    hidden size (or vocabulary) other than the target's (an MTP draft reads the target's hidden states and shares
    its embedding and LM head). A built-in target is compared by its recipe's hidden size.

    Raises:
        SystemExit: naming ``--speculative-draft-model-path`` and both values.
    """
    from pd.engines.models.builtin_model import TINY

    flag = "--speculative-draft-model-path"
    draft = _config_json(draft_path)
    if draft is None:
        raise SystemExit(f"{flag} {draft_path}: no config.json there (not a draft checkpoint directory)")
    target = {"hidden_size": TINY["hidden_size"]} if model_path.startswith(BUILTIN_PREFIX) else _config_json(model_path)
    for key in ("hidden_size", "vocab_size"):
        if target and key in target and draft.get(key) != target[key]:
            raise SystemExit(f"{flag} {draft_path}: the draft's {key} is {draft.get(key)}, the target's "
                             f"({model_path}) is {target[key]}; an MTP/EAGLE draft must match the target's")


def _config_json(path: str) -> Optional[dict]:
    try:
        with open(os.path.join(path, "config.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
