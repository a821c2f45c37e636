"""Checks of the two roles' SGLang argv: every flag parses with the pinned parser, and the settings
the KV hand-off depends on are the same on prefill and decode, the KV-layout environment variables of
the groups' ``env`` included (:func:`check_pd_env`)."""

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


# SGLang environment variables that set the KV byte layout a PD pair shares; only a group's ``env`` sets them,
# so nothing on the command line shows a difference. name -> (SGLang's default, kind, where it is read).
# SGLang itself rejects a mismatch only at the KV handshake, once the workers run.
PD_MATCHED_ENV = {
    "SGLANG_DSV4_KV_LAYOUT": ("v4", "str", "mem_cache/deepseek_v4_memory_pool.py select_dsv4_kv_layout -> "
                              "pd_kv_layout, compared in disaggregation/common/conn.py ('KV layout mismatch')"),
    "SGLANG_DSV4_COMPRESSED_KV_LAYOUT": ("auto", "str", "mem_cache/deepseek_v4_memory_pool.py "
                                         "select_dsv4_kv_layout -> pd_kv_layout, compared in "
                                         "disaggregation/common/conn.py ('KV layout mismatch')"),
    "SGLANG_DSV4_UNIFIED_KV_FP8": (False, "bool", "layers/attention/dsv4/unified_kv_gate.py is_unified_kv_fp8; "
                                   "disaggregation/common/conn.py: 'must be set the same on both sides'"),
}
_TRUE, _FALSE = ("true", "1", "yes", "y"), ("false", "0", "no", "n")  # SGLang's EnvBool (srt/environ.py)


def pd_env_value(role_env: dict[str, str], name: str):
    """The value SGLang reads for one of :data:`PD_MATCHED_ENV` in a worker with ``role_env``: its default
    when unset; a string lower-cased (select_dsv4_kv_layout lower-cases both layouts); a boolean as
    srt/environ.py's EnvBool parses it (a value it would refuse is returned as given)."""
    default, kind, _ = PD_MATCHED_ENV[name]
    if name not in role_env:
        return default
    raw = str(role_env[name]).strip()
    if kind == "bool":
        low = raw.lower()
        return True if low in _TRUE else False if low in _FALSE else raw
    return raw.lower()


def check_pd_env(ctx: Context) -> list[Finding]:
    """KV-layout environment variables (:data:`PD_MATCHED_ENV`) must read the same on prefill and decode; a
    difference is an error naming both values (an unset variable counts as SGLang's default)."""
    if not ctx.sglang:
        return []
    groups, out = ctx.cfg.groups(), []
    for name, (default, _, src) in PD_MATCHED_ENV.items():
        p, d = (pd_env_value(groups[r].env, name) for r in ROLES)
        if p != d:
            shown = {r: repr(groups[r].env[name]) if name in groups[r].env
                     else f"unset (SGLang's default {default!r})" for r in ROLES}
            out.append(Finding("error", "pd-env",
                               f"{name} differs: prefill.env {shown['prefill']}, decode.env {shown['decode']}; it sets "
                               f"the KV layout both sides must share ({src})",
                               f"set {name} to the same value in prefill.env and decode.env"))
    return out or [Finding("ok", "pd-env", "KV-layout environment variables match on prefill and decode")]
