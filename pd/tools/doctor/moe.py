"""Which MoE backend SGLang runs the target's and the draft's experts on, and what runs on which GPU.

What the checks know about the pinned SGLang (0.5.23), in our words:

- MoE runner backends that only exist for one GPU generation: the FlashInfer TRT-LLM family
  (``flashinfer_trtllm``, ``experimental_sgl_trtllm``, ``flashinfer_trtllm_routed``) runs
  trtllm-gen kernels built for compute capability 10.x only (SGLang itself says "trtllm-gen MoE
  kernels are SM100-only" when it steers modelopt_fp4 away from them on sm_110/sm_120);
  ``flashinfer_megamoe`` raises unless the device is SM100-family; ``hpc_ops`` is SM90-only.
- The draft (MTP) MoE backend: ``--speculative-moe-runner-backend`` when given, otherwise the
  target's resolved backend (``flashinfer_megamoe`` becomes ``flashinfer_trtllm`` for the draft).
  EAGLE's worker (``eagle_worker_v2``) builds the draft under that backend, so it decides the
  draft's MoE method. The draft's quantization (``--speculative-draft-model-quantization``)
  defaults to ``--quantization``; left unset, the checkpoint's format is auto-detected and the
  guards keyed on the quantization value do not fire.
- MXFP4 routed experts (``ModelConfig.is_fp4_experts``; DeepSeek-V4's layout, MTP layer included)
  get their MoE method from ``Fp8Config.get_quant_method`` by backend: ``flashinfer_mxfp4``
  (FlashInfer CUTLASS MXFP8 x MXFP4 on sm_120, CUTLASS on sm_90, otherwise the TRT-LLM method whose
  kernels are sm_100-only), ``marlin`` (raises off sm_90/sm_120), ``humming``. Every other backend
  leaves them to ``Fp8MoEMethod``, whose FP8 kernels do not read packed e2m1: under ``triton``
  (also what ``auto``, ``flashinfer_cutlass`` and ``flashinfer_cutedsl`` become there) the first
  forward fails "Hidden size mismatch". With ``SGLANG_DSV4_FP4_DEQUANT=1`` the experts are
  dequantized to FP8 at load and the backend must be ``auto`` (SGLang asserts it). Left ``auto``,
  the target of a DeepSeek-V4 checkpoint gets ``flashinfer_mxfp4`` from SGLang's model override on
  sm_90/sm_100/sm_120 (no expert-parallel all-to-all, no dequantization), and
  ``flashinfer_trtllm_routed`` (sm_100-only) for the NVFP4 hybrid; an explicit ``auto`` for the
  draft is not resolved by that override.
"""

from __future__ import annotations

from typing import Optional

from .context import ROLES, Context
from .hardware import GpuInfo

# MoE runner backend -> the compute-capability majors its kernels exist for (pinned SGLang).
ARCH_BOUND_MOE_BACKENDS: dict[str, tuple[int, ...]] = {
    "flashinfer_trtllm": (10,),
    "experimental_sgl_trtllm": (10,),
    "flashinfer_trtllm_routed": (10,),
    "flashinfer_megamoe": (10,),
    "hpc_ops": (9,),
}
# MXFP4 routed experts: Fp8Config.get_quant_method wraps them in an MXFP4 MoE method for these backends;
# value: the compute-capability majors where that method runs (None: SGLang does not gate it by GPU).
FP4_EXPERT_METHODS: dict[str, Optional[tuple[int, ...]]] = {
    "flashinfer_mxfp4": (9, 10, 12),  # CUTLASS on sm_90/sm_12x, TRT-LLM (sm_100-only kernels) on any other GPU
    "marlin": (9, 12),                # Mxfp4MarlinMoEMethod: "MXFP4 Marlin requires SM90 or SM120"
    "humming": None,
}
# Fp8MoEMethod's own runners that read FP4 experts (their GPU limits are in ARCH_BOUND_MOE_BACKENDS).
FP4_EXPERT_RUNNERS = ("deep_gemm", "flashinfer_megamoe", "aiter")
# Backends under which MXFP4 experts end on Fp8MoEMethod's Triton FP8 kernel (auto unless DeepGEMM is on;
# Fp8MoEMethod has no FlashInfer CUTLASS/CuteDSL FP8 path and switches those to Triton).
FP4_TO_TRITON_BACKENDS = ("triton", "auto", "flashinfer_cutlass", "flashinfer_cutedsl")
DEEPGEMM_A2A_BACKENDS = ("deepep", "mooncake", "nixl")  # with these, auto is DeepGEMM in Fp8MoEMethod
DSV4_AUTO_MXFP4_MAJORS = (9, 10, 12)  # SGLang's DeepSeek-V4 override: auto -> flashinfer_mxfp4 there
FP4_DEQUANT_ENV = "SGLANG_DSV4_FP4_DEQUANT"  # dequantize MXFP4 experts to FP8 at load (needs backend auto)
TRITON_MOE_BACKEND = "triton"  # FP8/BF16 experts: Triton's fused MoE runs on every CUDA generation


def target_experts(ctx: Context) -> tuple[Optional[str], str, bool]:
    """(format, where it was read, guessed) of the target's routed experts."""
    if ctx.model is not None:
        return ctx.model.experts_quant, ctx.model.experts_source, False
    dsv4, guessed, src = ctx.dsv4()
    if dsv4:
        return "mxfp4", f"{src}; SGLang's default for DeepSeek-V4 is MXFP4 experts", guessed
    return None, "", False


def draft_experts(ctx: Context) -> tuple[Optional[str], str, bool]:
    """(format, where it was read, guessed) of the draft's routed experts (a separate draft checkpoint,
    else the target's MTP layers)."""
    if ctx.draft is not None:
        return ctx.draft.experts_quant, ctx.draft.experts_source, False
    if ctx.model is not None:
        if not ctx.model.mtp_layers:
            return None, "", False
        return ctx.model.draft_experts_quant, ctx.model.draft_experts_source, False
    if not any(ctx.value(r, "speculative_draft_model_path") for r in ROLES):
        return target_experts(ctx)
    return None, "", False


def _suggested_backend(experts: Optional[str], major: Optional[int]) -> Optional[str]:
    """The MoE backend doctor suggests for experts of this format on this GPU generation; None for
    MXFP4 experts on a GPU none of SGLang's MXFP4 methods runs on (then: dequantize, see moe_fix)."""
    if experts == "mxfp4":
        return "flashinfer_mxfp4" if major is None or major in FP4_EXPERT_METHODS["flashinfer_mxfp4"] else None
    if experts in ("nvfp4", "modelopt_fp4"):
        return "flashinfer_cutlass"  # SGLang's NVFP4 MoE path off sm_100 (its trtllm-gen kernels are SM100-only)
    return TRITON_MOE_BACKEND


def moe_fix(key: str, experts: Optional[str], gpu: GpuInfo) -> str:
    """What to set ``key`` (a config field) to for experts of this format on this GPU."""
    b = _suggested_backend(experts, gpu.major)
    on = gpu.arch or "any GPU"
    if b is None:
        return (f"set {key}: auto and {FP4_DEQUANT_ENV}: '1' in prefill.env and decode.env (no MXFP4 MoE kernel of the "
                f"pinned SGLang runs on {gpu.arch}; the experts are then dequantized to FP8 at load)")
    if experts == "mxfp4":
        how = {9: "FlashInfer CUTLASS", 10: "FlashInfer TRT-LLM", 12: "FlashInfer CUTLASS MXFP8 x MXFP4"}.get(gpu.major)
        where = f" on {how} kernels for {on})" if how else " on sm_90/sm_100/sm_120)"
        return f"set {key}: {b} (MXFP4 experts" + where
    if experts in ("nvfp4", "modelopt_fp4"):
        return (f"set {key}: {b} (SGLang's NVFP4 MoE off sm_100; its config check wants --quantization "
                "modelopt_fp4 or modelopt_mixed)")
    return f"set {key}: {b} (runs on {on})"


def resolve_target_moe(ctx: Context, role: str) -> tuple[str, str]:
    """The MoE backend SGLang runs the target's MoE layers on for ``role``: (backend, how; empty when the
    argv names it). ``auto`` stays ``auto`` except where SGLang's DeepSeek-V4 override decides it."""
    given = ctx.value(role, "moe_runner_backend") or "auto"
    if given != "auto" or not ctx.dsv4()[0]:
        return given, ""
    experts = target_experts(ctx)[0]
    if experts == "nvfp4":
        return "flashinfer_trtllm_routed", "SGLang's DeepSeek-V4 override picks it for the FP8+NVFP4 hybrid checkpoint"
    if (experts == "mxfp4" and ctx.value(role, "moe_a2a_backend") in (None, "none")
            and not ctx.env_flag(role, FP4_DEQUANT_ENV)
            and (ctx.gpu.major is None or ctx.gpu.major in DSV4_AUTO_MXFP4_MAJORS)):
        return "flashinfer_mxfp4", "SGLang's DeepSeek-V4 override picks it for MXFP4 experts on sm_90/sm_100/sm_120"
    return "auto", ""


def resolve_draft_moe(ctx: Context, role: str) -> tuple[str, str]:
    """The MoE backend the draft is built and run under for ``role``: (backend, how; empty when
    ``--speculative-moe-runner-backend`` names it)."""
    given = ctx.value(role, "speculative_moe_runner_backend")
    if given is not None:
        return given, ""
    target, _ = resolve_target_moe(ctx, role)
    backend = {"flashinfer_megamoe": "flashinfer_trtllm"}.get(target, "auto" if target.startswith("lora_") else target)
    return backend, f"unset: the draft inherits the target's {target}" + (f" as {backend}" if backend != target else "")


def backend_text(given: Optional[str], backend: str, how: str) -> str:
    """A backend for a message: as given, or with how SGLang resolved it."""
    if not how:
        return backend
    return how if given is None else f"{given} ({how}: {backend})"
