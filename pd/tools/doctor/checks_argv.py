"""Checks of the two roles' SGLang argv: every flag parses with the pinned parser, and the settings
the KV hand-off depends on are the same on prefill and decode."""

from __future__ import annotations

import re

from .context import FIELDS, ROLES, Context
from .findings import Finding


def check_engine_args(ctx: Context) -> list[Finding]:
    """Every flag of both roles' argv (extra_args included) parses with the pinned SGLang parser."""
    if not ctx.sglang:
        return []
    out = []
    for role, (level, msg) in ctx.arg_errors.items():
        if level == "error":
            flag = re.search(r"(--[\w-]+)", msg)
            in_extra = flag and any(t.split("=")[0] == flag.group(1) for t in ctx.cfg.groups()[role].extra_args)
            src = f"{role}.extra_args" if in_extra else "the sglang settings"
            out.append(Finding("error", "engine-args", f"{role}: {src}: {msg}",
                               "use a flag the pinned SGLang accepts (see the candidates)"))
        else:
            out.append(Finding("warning", "engine-args", f"{role}: cannot check the SGLang flags: {msg}",
                               "install the pinned sglang (see the message)"))
    if not out:
        out.append(Finding("ok", "engine-args", "both roles' SGLang argv parse with the pinned parser"))
    return out



# Settings prefill and decode must agree on (KV moves page by page between identically laid-out
# pools; EAGLE's hidden states and top-k tokens travel with the KV).
MUST_MATCH = ("model_path", "page_size", "kv_cache_dtype", "speculative_algorithm", "speculative_eagle_topk",
              "speculative_draft_model_path")


def check_pd_consistency(ctx: Context) -> list[Finding]:
    """Page size, model, KV dtype and the speculative shape must be equal on prefill and decode
    (only a group's extra_args can make them differ); TP may differ."""
    if not ctx.sglang:
        return []
    if set(ctx.args) != set(ROLES):
        return [Finding("ok", "pd-consistency", "skipped: not every role's argv parsed (see engine-args)")]
    out = []
    for attr in MUST_MATCH:
        p, d = ctx.value("prefill", attr), ctx.value("decode", attr)
        if p != d:
            name, flag = FIELDS[attr]
            out.append(Finding("error", "pd-consistency",
                               f"{flag} differs: prefill {p!r}, decode {d!r} (set via {ctx.where(attr, ROLES)}); "
                               "KV caches and draft state moved from prefill to decode must have the same layout",
                               f"set {name} once in the config and drop {flag} from "
                               "prefill.extra_args/decode.extra_args"))
    tp = (ctx.args["prefill"].tp_size, ctx.args["decode"].tp_size)
    if not out:
        note = f"; TP differs (prefill {tp[0]}, decode {tp[1]}): allowed" if tp[0] != tp[1] else ""
        out.append(Finding("ok", "pd-consistency", "page size, model, KV dtype and speculative settings match" + note))
    return out
