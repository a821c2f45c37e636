"""Checks of the MoE backends: that the target's and the draft's kernels exist for this GPU, that
MXFP4 routed experts land on a method that reads them, and that speculative decoding names the
draft's backend. The SGLang behaviour they rely on is in :mod:`.moe`."""

from __future__ import annotations

from typing import Optional

from .context import ROLES, Context, roles_text
from .findings import Finding
from .moe import (
    ARCH_BOUND_MOE_BACKENDS,
    DEEPGEMM_A2A_BACKENDS,
    FP4_DEQUANT_ENV,
    FP4_EXPERT_METHODS,
    FP4_EXPERT_RUNNERS,
    FP4_TO_TRITON_BACKENDS,
    backend_text,
    draft_experts,
    moe_fix,
    resolve_draft_moe,
    resolve_target_moe,
    target_experts,
)


def check_moe_backend_arch(ctx: Context) -> list[Finding]:
    """Refuse a target or draft MoE backend whose kernels do not exist for this GPU generation (e.g.
    FlashInfer TRT-LLM, sm_100-only, on sm_120), whether named or what SGLang resolves ``auto`` to."""
    if not ctx.sglang:
        return []
    if ctx.gpu.arch is None:
        return [Finding("ok", "moe-backend-arch", "skipped: GPU architecture unknown")]
    major, spec = ctx.gpu.major, ctx.spec_roles()
    dq, dsrc, _ = draft_experts(ctx)
    tq = target_experts(ctx)[0]
    groups: dict = {}
    for r in ROLES:
        target_key = ("moe_runner_backend", ctx.value(r, "moe_runner_backend"), *resolve_target_moe(ctx, r))
        groups.setdefault(target_key, []).append(r)
        if r in spec and ctx.value(r, "speculative_moe_runner_backend") is not None:  # unset: reported with the target
            draft_key = ("speculative_moe_runner_backend", ctx.value(r, "speculative_moe_runner_backend"),
                         *resolve_draft_moe(ctx, r))
            groups.setdefault(draft_key, []).append(r)
    out = []
    for (attr, given, backend, how), rs in groups.items():
        need = ARCH_BOUND_MOE_BACKENDS.get(backend)
        if not need or major in need:
            continue
        gens = "/".join(f"sm_{n}x" for n in need)
        draft = attr == "speculative_moe_runner_backend"
        what = "the draft (MTP) MoE" if draft else "the target model's MoE"
        detail = f"; the draft's experts are MXFP4 ({dsrc})" if draft and dq == "mxfp4" else ""
        inherit = ""
        if not draft and any(ctx.value(r, "speculative_moe_runner_backend") is None for r in rs if r in spec):
            inherit = f"; the draft inherits it because {ctx.spec_key('moe_runner_backend')} is unset"
        fix_key = ctx.spec_key("moe_runner_backend") if draft else "sglang.moe_runner_backend"
        out.append(Finding(
            "error", "moe-backend-arch",
            f"{ctx.where(attr, rs)} is {backend_text(given, backend, how)} on {roles_text(rs)}: "
            f"{what} would run kernels built only for {gens}, not {ctx.gpu.arch}{detail}{inherit} "
            "(startup dies with 'no kernel image is available')",
            moe_fix(fix_key, dq if draft else tq, ctx.gpu)))
    if not out:
        out.append(Finding("ok", "moe-backend-arch", f"MoE backends run on {ctx.gpu.arch}"))
    return out


def _fp4_problem(backend: str, a2a: Optional[str], dequant: bool, major: Optional[int]) -> Optional[tuple[str, str]]:
    """Why MXFP4 experts under ``backend`` do not run: (level, reason), or None when they do."""
    if dequant:
        if backend == "auto":
            return None
        return "error", (f"with {FP4_DEQUANT_ENV}=1 the experts are dequantized to FP8, and SGLang asserts "
                         f"'{backend} is not compatible with {FP4_DEQUANT_ENV}=1' when it builds the layer")
    if backend == "auto" and a2a in DEEPGEMM_A2A_BACKENDS:
        return None  # Fp8MoEMethod's auto is DeepGEMM then, which reads FP4 experts
    methods = ", ".join(FP4_EXPERT_METHODS)
    if backend in FP4_TO_TRITON_BACKENDS:
        return "error", (f"under {backend} SGLang's Fp8Config.get_quant_method leaves them to Fp8MoEMethod, which runs "
                         "its Triton FP8 MoE kernel on the packed e2m1 weights: the first forward fails 'Hidden size "
                         f"mismatch' (MXFP4 MoE methods exist for {methods})")
    if backend in FP4_EXPERT_RUNNERS:
        return None
    if backend in FP4_EXPERT_METHODS:
        majors = FP4_EXPERT_METHODS[backend]
        if majors and major is not None and major not in majors:
            where = "/".join(f"sm_{m}x" for m in majors)
            tail = ("; elsewhere it takes the TRT-LLM method, whose kernels are sm_100-only"
                    if backend == "flashinfer_mxfp4" else "")
            return "error", f"{backend}'s MXFP4 MoE method runs on {where} only{tail}"
        return None
    return "warning", (f"{backend} is not one of SGLang's MXFP4 MoE backends ({methods}): the experts go to "
                       "Fp8MoEMethod's FP8 path for it, which is not known to read packed e2m1")


def _plugin_takes_draft_moe(ctx: Context, role: str) -> bool:
    """pdserve's plugin replaces the draft's MXFP4 MoE method on this GPU (sm_12x, or forced), whatever the
    runner flags say, unless the layer uses expert parallelism (it then keeps SGLang's method)."""
    k = ctx.cfg.sglang.pdserve_kernels
    ep = getattr(ctx.args.get(role), "ep_size", 1) or 1
    return k.enabled and k.mxfp4_moe and (ctx.gpu.major == 12 or k.force) and ep == 1


def check_fp4_experts(ctx: Context) -> list[Finding]:
    """MXFP4 routed experts (target, and the MTP draft's) need a backend that loads them on this GPU:
    refuse one that hands them to an FP8-only kernel (e.g. ``triton``), or one whose MXFP4 method does
    not exist for this GPU generation, or any backend but ``auto`` with SGLANG_DSV4_FP4_DEQUANT=1."""
    if not ctx.sglang:
        return []
    spec = ctx.spec_roles()
    dsv4 = ctx.dsv4()[0]
    groups: dict = {}
    for r in ROLES:
        dequant = ctx.env_flag(r, FP4_DEQUANT_ENV)
        a2a = ctx.value(r, "moe_a2a_backend")
        parts = [("moe_runner_backend", target_experts(ctx), resolve_target_moe(ctx, r), a2a)]
        if r in spec:
            parts.append(("speculative_moe_runner_backend", draft_experts(ctx), resolve_draft_moe(ctx, r),
                          ctx.value(r, "speculative_moe_a2a_backend") or a2a))
        for attr, (experts, src, guessed), (backend, how), a2a_used in parts:
            if experts != "mxfp4":
                continue
            if backend == "auto" and not dsv4 and not dequant and (attr == "moe_runner_backend" or how):
                continue  # the target's auto is another model's override to decide; not known here
            problem = _fp4_problem(backend, a2a_used, dequant, ctx.gpu.major)
            if problem is None:
                continue
            level, reason = problem
            need = ARCH_BOUND_MOE_BACKENDS.get(backend)
            if level == "warning" and need and ctx.gpu.major is not None and ctx.gpu.major not in need:
                continue  # refused by moe-backend-arch already
            plugin = (attr == "speculative_moe_runner_backend" and not dequant and _plugin_takes_draft_moe(ctx, r))
            key = (attr, ctx.value(r, attr), backend, how, level, reason, src, guessed, dequant, plugin)
            groups.setdefault(key, []).append(r)
    out = []
    for (attr, given, backend, how, level, reason, src, guessed, dequant, plugin), rs in groups.items():
        draft = attr == "speculative_moe_runner_backend"
        what = "the draft (MTP) MoE's" if draft else "the target model's"
        notes = ""
        if plugin:
            level = "warning"
            notes += ("; pdserve's plugin (sglang.pdserve_kernels mxfp4_moe) replaces the draft's MXFP4 MoE method "
                      f"on {ctx.gpu.arch or 'this GPU'}, so it runs, but not without the plugin")
        if guessed and level == "error":
            level = "warning"
            notes += "; the checkpoint's config.json was not read here, so this is a guess"
        fix_key = ctx.spec_key("moe_runner_backend") if draft else "sglang.moe_runner_backend"
        if dequant:
            envs = " and ".join(f"{r}.env" for r in rs)
            fix = f"set {fix_key}: auto ({FP4_DEQUANT_ENV}=1 requires it), or drop {FP4_DEQUANT_ENV} from {envs}"
        else:
            fix = moe_fix(fix_key, "mxfp4", ctx.gpu)
        out.append(Finding(level, "moe-fp4-experts",
                           f"{ctx.where(attr, rs)} is {backend_text(given, backend, how)} on {roles_text(rs)}: "
                           f"{what} routed experts are MXFP4 ({src}); {reason}{notes}", fix))
    if not out:
        tq, dq = target_experts(ctx)[0], draft_experts(ctx)[0] if spec else None
        if "mxfp4" not in (tq, dq):
            read = ctx.model is not None or ctx.dsv4()[0]
            out.append(Finding("ok", "moe-fp4-experts", "no MXFP4 routed experts" if read
                               else "skipped: the checkpoint's config.json was not read"))
        else:
            guess = " (DeepSeek-V4 guessed from model_path)" if ctx.model is None else ""
            out.append(Finding("ok", "moe-fp4-experts", "MXFP4 routed experts: the MoE backends in use load them"
                               + (f" on {ctx.gpu.arch}" if ctx.gpu.arch else "") + guess))
    return out


def check_spec_moe_explicit(ctx: Context) -> list[Finding]:
    """Speculative decoding must name the draft's MoE backend: auto-selection once picked an
    sm_100-only kernel for the MXFP4 draft (an error on sm_120, a warning elsewhere)."""
    if not ctx.sglang:
        return []
    spec = ctx.spec_roles()
    if not spec:
        return [Finding("ok", "spec-moe-backend", "no speculative decoding")]
    unset = [r for r in spec if ctx.value(r, "speculative_moe_runner_backend") in (None, "auto")]
    if not unset:
        return [Finding("ok", "spec-moe-backend", f"{ctx.spec_key('moe_runner_backend')} is explicit")]
    dq, dsrc, _ = draft_experts(ctx)
    level = "error" if ctx.gpu.major == 12 else "warning"
    experts = f" The draft's experts are MXFP4 ({dsrc})." if dq == "mxfp4" else ""
    on = f" on {ctx.gpu.arch}" if ctx.gpu.arch else ""
    return [Finding(level, "spec-moe-backend",
                    f"{ctx.where('speculative_moe_runner_backend', unset)} is "
                    f"{ctx.value(unset[0], 'speculative_moe_runner_backend') or 'unset'} on {roles_text(unset)}: "
                    f"the draft MoE's kernel is chosen automatically{on}, which once picked an sm_100-only "
                    f"FlashInfer TRT-LLM kernel.{experts}",
                    moe_fix(ctx.spec_key("moe_runner_backend"), dq, ctx.gpu))]
