"""The adaptive speculative depth (``speculative.adaptive``, SGLang's ``--speculative-adaptive``) on SGLang workers:
refused where the pinned SGLang would not run it.

SGLang 0.5.23 checks it at start in two ways. ``adaptive_unsupported_reason`` (speculative/adaptive_spec_params.py,
called by arg_groups/speculative_hook.py ``_maybe_disable_adaptive``) turns adaptive off with a warning and falls
back to the static depth: an algorithm other than EAGLE/EAGLE3 (after NEXTN resolves to EAGLE), ``eagle_topk`` other
than 1, attention DP, multi-layer EAGLE, two-batch overlap, PD multiplexing. Other hooks refuse to start:
HiSparse (hisparse_hook.py), LoRA (lora_hook.py), ``SGLANG_ENABLE_PP_SPEC`` (validation_hook.py). Both are refused
here, so a worker gets ``--speculative-adaptive`` only where it adapts; and a tier file that SGLang's
``_load_adaptive_config`` would refuse (the reference engine reads it with the same rules,
pd.engines.spec.adaptive) is refused too. The reference engine refuses its own cases at start, reported by
checks_reference.
"""

from __future__ import annotations

import argparse
import os
from typing import Optional

from .context import FIELDS, ROLES, Context, roles_text
from .findings import Finding

FLAG = "--speculative-adaptive"
CHECK = "spec-adaptive"
SOURCE = "speculative/adaptive_spec_params.py adaptive_unsupported_reason"


def _unsupported(ns: argparse.Namespace) -> Optional[tuple[str, str]]:
    """(SGLang's reason, the setting that causes it: a Context.FIELDS attribute or flags) when SGLang turns adaptive
    off for these parsed flags, else None.
    The order and the words are adaptive_unsupported_reason's (its platform-worker case, for non-CUDA platforms,
    does not apply to these workers)."""
    alg = str(ns.speculative_algorithm).upper()
    alg = "EAGLE" if alg == "NEXTN" else alg  # speculative_hook resolves the alias before asking
    if alg not in ("EAGLE", "EAGLE3"):
        return f"speculative_algorithm={alg} (only EAGLE/EAGLE3 are supported)", "speculative_algorithm"
    if ns.speculative_eagle_topk is not None and ns.speculative_eagle_topk != 1:
        return (f"speculative_eagle_topk={ns.speculative_eagle_topk} (only topk=1 is supported)",
                "speculative_eagle_topk")
    # attn_dp_enabled_of: attn_dp_size > 1 (the older --enable-dp-attention --dp-size N becomes it), or an
    # expert-parallel scale joiner
    if (ns.attn_dp_size > 1 or (ns.enable_dp_attention and ns.dp_size > 1)
            or getattr(ns, "ep_join_mode", None) == "scale"):
        return ("attention DP is not supported (adaptive tier decisions are not synchronized across DP ranks)",
                "--attn-dp-size / --enable-dp-attention / --ep-join-mode")
    if ns.enable_multi_layer_eagle:
        return ("enable_multi_layer_eagle=True is not supported (MultiLayerEagleWorkerV2 does not implement "
                "adaptive)", "--enable-multi-layer-eagle")
    if ns.enable_two_batch_overlap:
        return ("enable_two_batch_overlap=True is not supported (adaptive state swap would discard the "
                "TboAttnBackend wrapper)", "--enable-two-batch-overlap")
    if ns.enable_pdmux:
        return ("enable_pdmux=True is not supported (adaptive state swap does not update "
                "decode_attn_backend_group)", "--enable-pdmux")
    return None


def _refused(ctx: Context, role: str, ns: argparse.Namespace) -> Optional[tuple[str, str]]:
    """(SGLang's start-up error, the cause) when SGLang refuses to start with adaptive on, else None."""
    if getattr(ns, "enable_hisparse", False):
        return ("HiSparse speculative decoding uses statically sized swap state; --speculative-adaptive is not "
                "supported (arg_groups/hisparse_hook.py)", "--enable-hisparse")
    if getattr(ns, "enable_lora", False) or getattr(ns, "lora_paths", None):
        return ("LoRA does not support --speculative-adaptive: the draft is built from a static ServerArgs "
                "snapshot (arg_groups/lora_hook.py)", "--enable-lora / --lora-paths")
    if ctx.env_flag(role, "SGLANG_ENABLE_PP_SPEC"):
        return ("SGLANG_ENABLE_PP_SPEC is not compatible with --speculative-adaptive (arg_groups/validation_hook.py)",
                f"{role}.env SGLANG_ENABLE_PP_SPEC")
    return None


def _cause(ctx: Context, roles: list[str], cause: str) -> str:
    """Where a cause is set: its config key for a config setting, else the groups whose extra_args (or env) set
    it."""
    if cause in FIELDS:
        return ctx.where(cause, roles)
    if " " in cause.split(" / ")[0]:  # "<role>.env NAME"
        return cause
    flags = cause.split(" / ")
    via = [r for r in roles if any(t.split("=", 1)[0] in flags for t in ctx.cfg.groups()[r].extra_args)]
    return (" and ".join(f"{r}.extra_args" for r in via) + f" ({cause})") if via else cause


def _where(ctx: Context, roles: list[str]) -> str:
    """Where the adaptive switch comes from: a group's extra_args, else the config's speculative block."""
    via = [r for r in roles if FLAG in ctx.cfg.groups()[r].extra_args]
    if via:
        return " and ".join(f"{r}.extra_args" for r in via) + f" ({FLAG})"
    return f"{ctx.spec_key('adaptive')} ({FLAG})"


def check_speculative_adaptive(ctx: Context) -> list[Finding]:
    """SGLang workers with ``--speculative-adaptive``: refuse the combinations SGLang turns it off for or will not
    start with, naming the config key and SGLang's reason, and a tier file SGLang would refuse."""
    if not ctx.sglang:
        return []
    roles = [r for r in ROLES if r in ctx.args and getattr(ctx.args[r], "speculative_adaptive", False)
             and ctx.args[r].speculative_algorithm]
    if not roles:
        return []
    out: list[Finding] = []
    by_cause: dict[tuple[str, str, str], list[str]] = {}
    for r in roles:
        ns = ctx.args[r]
        if (why := _refused(ctx, r, ns)) is not None:
            by_cause.setdefault(("refused", *why), []).append(r)
        elif (why := _unsupported(ns)) is not None:
            by_cause.setdefault(("disabled", *why), []).append(r)
    for (kind, reason, cause), rs in by_cause.items():
        where, by = _where(ctx, rs), _cause(ctx, rs, cause)
        if kind == "refused":
            text = f"{where} is on with {by} on {roles_text(rs)}: SGLang refuses to start: {reason}"
        else:
            text = (f"{where} is on with {by} on {roles_text(rs)}: SGLang turns it off at start and runs the "
                    f"static depth (speculative_adaptive disabled: {reason}; {SOURCE})")
        out.append(Finding("error", CHECK, text, f"remove {ctx.spec_key('adaptive')}, or change {by}"))
    out += _check_tier_files(ctx, roles)
    if not out:
        out.append(Finding("ok", CHECK, f"adaptive speculative depth on {roles_text(roles)}: supported by SGLang "
                           "with these flags"))
    return out


def _check_tier_files(ctx: Context, roles: list[str]) -> list[Finding]:
    """The tier file each role names, read with SGLang's rules where it is readable here (it may exist on the GPU
    nodes only: then a warning)."""
    from pd.engines.errors import EngineSettingsError
    from pd.engines.spec.adaptive import load_adaptive_config

    out = []
    paths: dict[str, list[str]] = {}
    for r in roles:
        path = ctx.args[r].speculative_adaptive_config
        if path is not None:
            paths.setdefault(path, []).append(r)
    for path, rs in paths.items():
        key = ctx.spec_key("adaptive_config")
        if not os.path.isfile(path):
            out.append(Finding("warning", CHECK, f"{key}: {path} is not a file here; SGLang reads it on "
                               f"{roles_text(rs)} at start", "run doctor where the file is"))
            continue
        try:
            load_adaptive_config(path)
        except EngineSettingsError as e:
            out.append(Finding("error", CHECK, f"{key}: SGLang cannot use the tier file on {roles_text(rs)} (its "
                               f"loader refuses it at start, or its first depth update fails): {e}",
                               "fix the file (docs/speculative-decoding.md, Adaptive depth)"))
    return out
