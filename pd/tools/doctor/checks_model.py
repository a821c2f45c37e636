"""Checks of the checkpoint against the SGLang settings: model_path, ``--quantization``, the
speculative draft, the page size and the context length.

Two things the pinned SGLang imposes on DeepSeek-V4:

- on CUDA it runs 256-token KV pages: its model override replaces any ``--page-size`` (the last
  declaration wins over the command line, with only an info log) and the dsv4 attention metadata
  asserts 256;
- speculative decoding: only ``EAGLE`` (with ``--speculative-eagle-topk 1``) or ``DSPARK``, checked on the
  algorithm as given, before SGLang resolves its ``NEXTN`` alias to EAGLE; DeepSeek-V4.1 only ``DSPARK``
  (:func:`check_model_speculative`).
"""

from __future__ import annotations

import os

from pd.engines.models.builtin_model import BUILTIN_MODELS, BUILTIN_PREFIX

from .context import ROLES, Context, roles_text
from .findings import Finding

DSV4_PAGE_SIZE = 256  # what DeepSeek-V4's model override sets on CUDA, and what its attention asserts
CONTEXT_LENGTH_LIMIT = 65536  # above this the stock DSA indexer's per-step cost dominates


def check_model_config(ctx: Context) -> list[Finding]:
    """Read the target's (and a separate draft's) config.json; a missing one is a warning."""
    if not ctx.sglang:
        return _reference_model(ctx.cfg.model_path)
    out = []
    if ctx.model is None:
        if ctx.cfg.model_path.startswith("builtin:"):
            out.append(Finding("ok", "model-config", f"skipped: model_path {ctx.model_note}"))
        else:
            out.append(Finding("warning", "model-config",
                               f"cannot check the checkpoint: model_path: {ctx.model_note}; "
                               "quantization, MTP and hidden-size checks are skipped",
                               "run doctor where the checkpoint is (each node needs it at model_path)"))
    else:
        m = ctx.model
        mtp = (f", {m.mtp_layers} MTP layer(s) with {m.draft_experts_quant or 'unquantized'} experts"
               if m.mtp_layers else ", no MTP layers")
        out.append(Finding("ok", "model-config", f"{m.path}/config.json: {m.architecture or '?'}, quantization "
                           f"{m.quant_method or 'none'}, routed experts {m.experts_quant or 'unquantized'}{mtp}"))
    sp = ctx.spec_block
    if sp is not None and sp.draft_model_path:
        if ctx.draft is None:
            out.append(Finding("warning", "model-config", "cannot check the draft: "
                               f"{ctx.spec_key('draft_model_path')}: {ctx.draft_note}",
                               "run doctor where the draft checkpoint is"))
        else:
            d = ctx.draft
            out.append(Finding("ok", "model-config", f"draft {d.path}/config.json: {d.architecture or '?'}, "
                               f"quantization {d.quant_method or 'none'}, experts {d.experts_quant or 'unquantized'}"))
    return out


def _reference_model(path: str) -> list[Finding]:
    """The reference engine's model_path: a known built-in, or a Hugging Face checkpoint directory
    (config.json inside; nothing is downloaded). Not a directory here is a warning: on a multi-node
    cluster only the engine nodes may hold it."""
    if path.startswith(BUILTIN_PREFIX):
        if path in BUILTIN_MODELS:
            return [Finding("ok", "model-config", f"model_path {path} is built in")]
        return [Finding("error", "model-config", f"model_path: unknown built-in model {path!r}",
                        f"use one of {', '.join(BUILTIN_MODELS)} or a local checkpoint directory")]
    if not os.path.isdir(path):
        return [Finding("warning", "model-config", f"model_path {path} is not a directory on this machine; every "
                        "node that runs an engine needs the checkpoint directory there (nothing is downloaded)",
                        "point model_path at a local Hugging Face checkpoint directory, or builtin:tiny")]
    if not os.path.isfile(os.path.join(path, "config.json")):
        return [Finding("error", "model-config", f"model_path {path} has no config.json: not a Hugging Face "
                        "checkpoint directory", "point model_path at the directory that holds config.json, "
                        "the tokenizer and the weights")]
    return [Finding("ok", "model-config", f"model_path {path}: a checkpoint directory")]


def check_quantization(ctx: Context) -> list[Finding]:
    """Refuse ``--quantization`` left to auto-detection; warn when it differs from the checkpoint's."""
    if not ctx.sglang:
        return []
    m = ctx.model
    out = []
    for q, rs in ctx.by_value("quantization").items():
        if q is None:
            if m is not None and m.quant_method:
                fix = f"set sglang.quantization: {m.quant_method} (the checkpoint's {m.quant_source})"
            elif m is not None:
                fix = ("set sglang.quantization: unquant (the checkpoint declares no quantization; unquant is "
                       "SGLang's explicit 'none')")
            else:
                fix = ("set sglang.quantization to the checkpoint's config.json quantization_config.quant_method "
                       "(e.g. fp8)")
            out.append(Finding("error", "quantization",
                               f"{ctx.where('quantization', rs)} is unset on {roles_text(rs)}: SGLang auto-detects "
                               f"it, and an auto-detected format leaves the draft's quantization unset too, which "
                               f"skips the guards that route the draft MoE to a safe backend", fix))
        elif m is not None and m.quant_method and q not in (m.quant_method, "unquant"):
            out.append(Finding("warning", "quantization",
                               f"{ctx.where('quantization', rs)} is {q} but the checkpoint says {m.quant_method} "
                               f"({m.quant_source})",
                               f"set sglang.quantization: {m.quant_method} unless you mean to re-quantize"))
    if not out:
        out.append(Finding("ok", "quantization", f"sglang.quantization is {ctx.value('prefill', 'quantization')}"))
    return out


def check_speculative_draft(ctx: Context) -> list[Finding]:
    """Speculative decoding needs a draft (MTP layers or a draft dir) whose hidden size matches the
    target's (what the model itself allows: :func:`check_model_speculative`)."""
    if not ctx.sglang or not ctx.spec_roles():
        return []
    out = []
    m, d, sp = ctx.model, ctx.draft, ctx.spec_block
    has_draft_path = any(ctx.value(r, "speculative_draft_model_path") for r in ROLES)
    if m is not None and not m.mtp_layers and not has_draft_path:
        out.append(Finding("error", "draft",
                           f"{ctx.spec_key()} is set but the checkpoint has no MTP layers (config.json "
                           f"num_nextn_predict_layers is {m.mtp_layers}) and {ctx.spec_key('draft_model_path')} is "
                           "unset: there is no draft model",
                           f"set {ctx.spec_key('draft_model_path')} to a draft checkpoint, or remove "
                           f"{ctx.spec_key()}"))
    if m is not None and d is not None and m.hidden_size and d.hidden_size and m.hidden_size != d.hidden_size:
        out.append(Finding("error", "draft",
                           f"{ctx.spec_key('draft_model_path')}: the draft's hidden_size {d.hidden_size} "
                           f"({d.path}/config.json) differs from the target's {m.hidden_size} ({m.path}/config.json); "
                           "EAGLE feeds the target's hidden states to the draft (and PD ships them with the KV)",
                           "use the draft trained for this target (same hidden_size)"))
    if not out:
        if m is None:
            out.append(Finding("ok", "draft", "skipped: the checkpoint's config.json was not read"))
        elif d is None and sp is not None and sp.draft_model_path:
            out.append(Finding("ok", "draft", "draft hidden size not checked: the draft's config.json was not read"))
        else:
            src = f"draft {d.path}" if d is not None else f"{m.mtp_layers} built-in MTP layer(s)"
            out.append(Finding("ok", "draft", f"draft: {src}"))
    return out


# What the pinned SGLang (0.5.23) lets DeepSeek-V4 speculate with. sglang/srt/arg_groups/model_hook.py runs
# deepseek_v4_hook.apply_deepseek_v4_defaults for architectures[0] == DeepseekV4ForCausalLM before
# speculative_hook.handle_speculative_decoding upper-cases the algorithm and resolves NEXTN to EAGLE, so
# the hook's assert sees the algorithm exactly as the command line gives it.
DSV4_SPEC_ARCH = "DeepseekV4ForCausalLM"
DSV4_SPEC_ALGORITHMS = ("EAGLE", "DSPARK")  # apply_deepseek_v4_defaults; EAGLE only with eagle_topk 1
DSV41_MODEL_TYPE = "deepseek_v41"  # config.json model_type of DeepSeek-V4.1 (same architecture)
DSV41_SPEC_ALGORITHMS = ("DSPARK",)  # validate_deepseek_v41_features, compared upper-cased


def check_model_speculative(ctx: Context) -> list[Finding]:
    """Refuse the speculative settings the pinned SGLang refuses for the target model at start, naming the
    config key and the values allowed.

    Rules (sglang/srt/arg_groups/deepseek_v4_hook.py, for ``architectures[0]`` DeepseekV4ForCausalLM):

    - ``apply_deepseek_v4_defaults``: ``--speculative-algorithm`` must be exactly ``EAGLE`` or ``DSPARK``. It
      runs before ``speculative_hook._resolve_speculative_algorithm_alias`` turns ``NEXTN`` into ``EAGLE``, so
      ``NEXTN`` (and ``EAGLE3``, lower case) are refused; ``EAGLE`` needs ``--speculative-eagle-topk 1``.
    - ``validate_deepseek_v41_features``: config.json ``model_type`` ``deepseek_v41`` (DeepSeek-V4.1) allows
      no algorithm but ``DSPARK`` (compared upper-cased).

    Other models and the reference engine keep ``NEXTN``. When config.json was not read and the model_path
    only names DeepSeek-V4, the findings are warnings (the guess could be wrong; V4.1 cannot be told).
    """
    if not ctx.sglang or not ctx.spec_roles():
        return []
    m = ctx.model
    if m is not None:
        dsv4, guessed, src = m.architecture == DSV4_SPEC_ARCH, False, f"config.json architectures[0]={m.architecture}"
    else:
        dsv4, guessed, src = ctx.dsv4()
    if not dsv4:
        if m is None:
            return [Finding("ok", "spec-model", f"skipped: {ctx.model_note or 'config.json not read'}")]
        return [Finding("ok", "spec-model", f"{src}: no model-specific speculative rule known")]
    level, out = ("warning" if guessed else "error"), []
    v41 = m is not None and m.model_type == DSV41_MODEL_TYPE
    for alg, rs in ctx.by_value("speculative_algorithm", ctx.spec_roles()).items():
        where = ctx.where("speculative_algorithm", rs)
        if v41 and str(alg).upper() not in DSV41_SPEC_ALGORITHMS:
            out.append(Finding(level, "spec-model",
                               f"{where} is {alg} on {roles_text(rs)}: SGLang refuses speculative decoding other "
                               f"than {' or '.join(DSV41_SPEC_ALGORITHMS)} for DeepSeek-V4.1 (config.json model_type "
                               f"{DSV41_MODEL_TYPE}; arg_groups/deepseek_v4_hook.py validate_deepseek_v41_features)",
                               f"remove {ctx.spec_key()} (speculative.algorithm offers no DSPARK; a group's "
                               "extra_args --speculative-algorithm DSPARK is the only way)"))
        elif alg not in DSV4_SPEC_ALGORITHMS:
            alias = (", before it resolves the NEXTN alias to EAGLE" if str(alg).upper() == "NEXTN" else "")
            out.append(Finding(level, "spec-model",
                               f"{where} is {alg} on {roles_text(rs)}: the pinned SGLang allows only "
                               f"{' or '.join(DSV4_SPEC_ALGORITHMS)} for {DSV4_SPEC_ARCH} ({src}) and asserts it "
                               f"at start (arg_groups/deepseek_v4_hook.py apply_deepseek_v4_defaults){alias}",
                               f"set {ctx.spec_key('algorithm')}: EAGLE (the checkpoint's MTP layer as the draft, "
                               "what NEXTN means)"))
    eagle = [r for r in ctx.spec_roles() if ctx.value(r, "speculative_algorithm") == "EAGLE" and not v41]
    for topk, rs in ctx.by_value("speculative_eagle_topk", eagle).items():
        if topk != 1:
            out.append(Finding(level, "spec-model",
                               f"{ctx.where('speculative_eagle_topk', rs)} is {topk} on {roles_text(rs)}: SGLang "
                               f"allows EAGLE only with eagle_topk 1 for {DSV4_SPEC_ARCH} ({src}; "
                               "arg_groups/deepseek_v4_hook.py apply_deepseek_v4_defaults)",
                               f"set {ctx.spec_key('eagle_topk')}: 1"))
    if not out:
        alg = ctx.value(ctx.spec_roles()[0], "speculative_algorithm")
        out.append(Finding("ok", "spec-model", f"speculative algorithm {alg} is one SGLang allows for {src}"))
    return out


def check_page_size(ctx: Context) -> list[Finding]:
    """DeepSeek-V4 runs 256-token KV pages on CUDA whatever ``page_size`` says: SGLang's model override
    replaces the value (only an info log says so) and the dsv4 attention asserts 256. Warn when the config
    asks for another size (it would not be the size that runs)."""
    if not ctx.sglang:
        return []
    dsv4, guessed, src = ctx.dsv4()
    if not dsv4:
        return [Finding("ok", "page-size", "no model-imposed page size known" if ctx.model is not None or not src
                        else "skipped: the checkpoint's config.json was not read")]
    out = []
    for ps, rs in ctx.by_value("page_size").items():
        if ps != DSV4_PAGE_SIZE:
            out.append(Finding("warning", "page-size",
                               f"{ctx.where('page_size', rs)} is {ps} on {roles_text(rs)}, but DeepSeek-V4 ({src}) "
                               f"runs {DSV4_PAGE_SIZE}-token KV pages on CUDA: SGLang's model override replaces "
                               f"--page-size with {DSV4_PAGE_SIZE} (its dsv4 attention asserts {DSV4_PAGE_SIZE}), so "
                               f"the workers run {DSV4_PAGE_SIZE}, not {ps}", f"set page_size: {DSV4_PAGE_SIZE}"))
    return out or [Finding("ok", "page-size", f"page_size {DSV4_PAGE_SIZE}, what DeepSeek-V4 runs")]


def check_context_length(ctx: Context) -> list[Finding]:
    """Warn when --context-length is far above need while the stock DSA indexer runs (its per-step
    work scales with --context-length, not with the real sequence)."""
    if not ctx.sglang:
        return []
    m = ctx.model
    if m is not None and not m.dsa:
        return [Finding("ok", "context-length", "the model has no DSA indexer")]
    if ctx.cfg.sglang.pdserve_kernels.enabled and ctx.cfg.sglang.pdserve_kernels.indexer:
        return [Finding("ok", "context-length",
                        "sglang.pdserve_kernels: the pdserve indexer's cost follows the real sequence")]
    out = []
    for cl, rs in ctx.by_value("context_length").items():
        if cl is None:
            mx = m.max_position_embeddings if m is not None else None
            eff = (f"the model's maximum ({mx} from config.json max_position_embeddings)" if mx
                   else "the model's maximum")
            if mx is not None and mx <= CONTEXT_LENGTH_LIMIT:
                continue
            what = f"{ctx.where('context_length', rs)} is unset on {roles_text(rs)}, so SGLang uses {eff}"
        elif cl > CONTEXT_LENGTH_LIMIT:
            what = f"{ctx.where('context_length', rs)} is {cl} on {roles_text(rs)}"
        else:
            continue
        out.append(Finding("warning", "context-length",
                           f"{what}: the stock DSA indexer scores every key slot up to --context-length on each step "
                           f"(measured on H200: about 10x slower at 128K than at 8K for the same work)",
                           "cap sglang.context_length near the longest request you serve "
                           f"(e.g. {CONTEXT_LENGTH_LIMIT}), "
                           "or set sglang.pdserve_kernels: true"))
    return out or [Finding("ok", "context-length", f"context length <= {CONTEXT_LENGTH_LIMIT}")]
