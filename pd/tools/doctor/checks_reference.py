"""Checks of the reference engine's two roles (``engine: reference``): their argv parse with the engine's own
parser, and speculative decoding is the same on both, a chain the engine drafts, with a draft whose hidden size
is the target's.

What each refusal stands for at run time (pd/engines): a flag set the engine refuses stops it at start
(``pd.engines.spec.config``); speculation on one role only, or different settings, fails every request at the
bootstrap handshake ("speculative settings mismatch: decode has ..., prefill has ..."); a draft of another hidden
size stops it at start (``pd.engines.spec.draft_model.DraftModel``: the draft reads the target's hidden states, and PD
ships the last one with the KV).
"""

from __future__ import annotations

import json
from typing import Optional

from .checkpoint import ModelConfigError, read_model_info
from .context import ROLES, Context, roles_text
from .findings import Finding

SPEC_FLAG = "--speculative-"


def _spec_via(ctx: Context, role: str) -> str:
    """Where a role's speculative flags come from: ``decode.extra_args`` or the config's block."""
    if any(t.startswith(SPEC_FLAG) for t in ctx.cfg.groups()[role].extra_args):
        return f"{role}.extra_args"
    return ctx.spec_key()


def _fix(ctx: Context) -> str:
    return (f"set the {ctx.spec_key()} block in the config (both roles get the same --speculative-* flags) "
            "and drop --speculative-* from prefill.extra_args / decode.extra_args")


def check_reference_engine_args(ctx: Context) -> list[Finding]:
    """Both roles' reference-engine argv (extra_args included) parse with ``pdserve engine``'s parser."""
    if ctx.sglang:
        return []
    out = [Finding("error", "engine-args", f"{role}: {role}.extra_args: the reference engine refuses its argv: "
                   f"{ea.error}", "use flags `pdserve engine --help` lists")
           for role, ea in ctx.engine_args.items() if ea.error]
    return out or [Finding("ok", "engine-args", "both roles' reference-engine argv parse")]


def _hidden_of(path: str) -> tuple[Optional[int], str]:
    """(hidden_size, where it was read) of a checkpoint directory's config.json; (None, why not) otherwise."""
    try:
        info = read_model_info(path)
    except ModelConfigError as e:
        return None, str(e)
    return info.hidden_size, f"{info.path}/config.json"


def _target_hidden(model_path: str) -> tuple[Optional[int], str]:
    """The target's hidden size: builtin:tiny's from its written checkpoint, else from the recipe that writes it."""
    from pd.engines.models import builtin_model

    if not model_path.startswith(builtin_model.BUILTIN_PREFIX):
        return _hidden_of(model_path)
    written = builtin_model.tiny_dir() / "config.json"
    if written.is_file():
        return _hidden_of(str(written.parent))
    return builtin_model.TINY["hidden_size"], f"{model_path} (pd.engines.models.builtin_model.TINY)"


def _draft_hidden(model_path: str, draft_path: Optional[str], target: Optional[int]) -> tuple[Optional[int], str]:
    """The draft's hidden size. Unset path (builtin:tiny's own draft): its written config.json, else the target's
    (``pd.engines.models.builtin_draft.draft_config`` copies the target's hidden_size)."""
    if draft_path:
        return _hidden_of(draft_path)
    from pd.engines.models import builtin_draft

    written = builtin_draft.draft_dir() / "config.json"
    if written.is_file():
        try:
            return int(json.loads(written.read_text())["hidden_size"]), str(written)
        except (OSError, ValueError, KeyError, TypeError):
            pass
    return target, f"the built-in draft of {model_path} (fitted to it at first use)"


def check_reference_speculative(ctx: Context) -> list[Finding]:
    """Speculative decoding on the reference engine: flags it accepts, the same settings on prefill and decode,
    and a draft whose hidden size is the target's."""
    if ctx.sglang:
        return []
    parsed = {r: ea for r, ea in ctx.engine_args.items() if ea.args is not None}
    refused: dict = {}
    for r, ea in parsed.items():
        if ea.spec_error:
            refused.setdefault((_spec_via(ctx, r), ea.spec_error), []).append(r)
    out = [Finding("error", "speculative", f"{roles_text(rs)}: {via}: {msg}",
                   "the engine refuses the same at start; " + _fix(ctx)) for (via, msg), rs in refused.items()]
    if out or set(parsed) != set(ROLES):
        return out or [Finding("ok", "speculative", "skipped: not every role's argv parsed (see engine-args)")]
    spec = {r: parsed[r].spec for r in ROLES}
    on = [r for r in ROLES if spec[r] is not None]
    if not on:
        return [Finding("ok", "speculative", "no speculative decoding")]
    p, d = (spec[r].flags() if spec[r] is not None else "no speculative decoding" for r in ROLES)
    if len(on) == 1:
        (role,) = on
        return [Finding("error", "speculative",
                        f"speculative decoding on {role} only ({_spec_via(ctx, role)}: {spec[role].flags()}): both "
                        f"sides of a PD pair must run the same settings; the prefill fails every request at the "
                        f"bootstrap handshake (speculative settings mismatch: decode has {d}, prefill has {p})",
                        _fix(ctx))]
    if spec["prefill"].handshake() != spec["decode"].handshake():
        via = " and ".join(sorted({_spec_via(ctx, r) for r in ROLES}))
        return [Finding("error", "speculative",
                        f"speculative settings differ ({via}): the prefill fails every request at the bootstrap "
                        f"handshake (speculative settings mismatch: decode has {d}, prefill has {p})", _fix(ctx))]
    model = ctx.cfg.model_path
    target, target_src = _target_hidden(model)
    for r in on:
        given = parsed[r].args.speculative.num_draft_tokens
        if given is not None and spec[r].adaptive:
            out.append(Finding("warning", "speculative",
                               f"{r}: {_spec_via(ctx, r)}: num_draft_tokens {given} is not used with adaptive: each "
                               "step's window follows its depth, and the decode holds pages for the deepest "
                               f"candidate's ({spec[r].num_draft_tokens} tokens)",
                               f"drop {ctx.spec_key('num_draft_tokens')}"))
        elif given not in (None, spec[r].num_draft_tokens):
            out.append(Finding("warning", "speculative",
                               f"{r}: {_spec_via(ctx, r)}: num_draft_tokens {given} is "
                               f"adjusted to num_steps + 1 = {spec[r].num_draft_tokens} (eagle_topk 1: a chain, "
                               "as SGLang adjusts it)",
                               f"set {ctx.spec_key('num_draft_tokens')}: {spec[r].num_draft_tokens}"))
    drafts = {}
    for r in on:
        drafts.setdefault(spec[r].draft_model_path, []).append(r)
    for path, rs in drafts.items():
        where = (f"{_spec_via(ctx, rs[0])} draft_model_path" if path else "the built-in draft")
        hidden, src = _draft_hidden(model, path, target)
        if hidden is None or target is None:
            missing = src if hidden is None else target_src
            out.append(Finding("warning", "speculative", f"cannot check the draft's hidden size on "
                               f"{' and '.join(rs)}: {missing}", "run doctor where the checkpoints are"))
        elif hidden != target:
            out.append(Finding("error", "speculative",
                               f"{where}: the draft's hidden_size {hidden} ({src}) differs from the target's {target} "
                               f"({target_src}); the draft reads the target's hidden states (and PD ships the last "
                               "one with the KV), so the engine refuses it at start",
                               "use the draft fitted to this target (same hidden_size)"))
    if not any(f.level == "error" for f in out):
        src = ", ".join(str(k or "built-in") for k in drafts)
        out.append(Finding("ok", "speculative", f"speculative decoding on both roles: {spec['decode'].flags()}; "
                           f"draft {src}" + (f", hidden_size {target} as the target's" if target else "")))
    return out

