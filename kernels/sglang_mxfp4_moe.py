"""SGLang hook for the MoE method of the speculative draft's MXFP4 experts -> ``pd.kernels.mxfp4_moe``.

Target: ``sglang.srt.layers.quantization.fp8.Fp8Config.get_quant_method(self, layer, prefix)
-> QuantizeMethodBase | None``. For a ``FusedMoE`` layer of a checkpoint whose routed experts are MXFP4
(``Fp8Config.is_fp4_experts``: DeepSeek-V4's layout, its MTP layer included; NVFP4 checkpoints reach it through
``HybridFp8NvFp4Config`` for the draft's ``model.decoder.*`` experts) it picks by the *global* MoE runner backend:
marlin / humming wrappers, ``flashinfer_mxfp4`` (TRT-LLM on sm_100, CUTLASS on sm_90/sm_120), and otherwise
``Fp8MoEMethod`` with its own runner choice (TRT-LLM for ``flashinfer_trtllm``, DeepGEMM for ``auto`` when
DeepGEMM is on, Triton's fp8 path, which cannot read packed e2m1 weights). Whether that global is the
``--speculative-moe-runner-backend`` while the draft is built depends on the worker
(``eagle_worker_v2`` swaps it in; ``draft_worker_common`` deliberately does not), which is how a draft ended
on an sm_100-only kernel.

Adapter: for a layer SGLang builds for the speculative draft (``FusedMoE.is_draft``, taken from
``get_flags().moe.in_speculative_scope``, which both draft workers set while building) whose
experts are MXFP4 (not dequantized by SGLANG_DSV4_FP4_DEQUANT), on a device the plugin serves, the layer gets
:class:`PdserveMxfp4MoEMethod` instead, whatever the runner flags say (the replaced choice is logged).
Weights load exactly as SGLang's ``Fp8MoEMethod`` lays them out (its ``create_weights`` is reused):
  w13_weight int8 [E, 2 I, H / 2] (gate rows then up rows, two e2m1 values per byte, low nibble first),
  w13_weight_scale_inv fp32 [E, 2 I, H / 32] (the checkpoint's UE8M0 scales, loaded as powers of two),
  w2_weight int8 [E, H, I / 2], w2_weight_scale_inv fp32 [E, H, I / 32]
(E local experts, H hidden size, I intermediate size per TP rank), which is the layout
``pd.kernels.mxfp4_moe.fused_moe_mxfp4`` reads. After loading, the scales are stored as UE8M0 bytes
(``mxfp4_moe.as_ue8m0``: ``log2(scale) + 127``, exact for powers of two); on an sm_90 GPU with every scale <= 2 the
packed weights are also reordered in place into the kernel's ``"sm90_tiled"`` layout, weights and scales in 32-row
tiles (``mxfp4_moe.prepare_mxfp4_weights_sm90(..., tiled=True)`` and ``tile_mxfp4_scales``; faster than
``"sm90_bits"`` at every T on the H200, benchmarks/results/mxfp4_moe.md), or, when H or I is not a multiple of
256 (no whole tiles), into ``"sm90_bits"`` (its default plans are faster than the checkpoint layout's at every T
measured). ``apply`` passes the dispatcher's bf16
hidden states [T, H] and the top-k weights/ids [T, k] (routed scaling factor already folded in, since the method
declares ``fuse_routed_scaling_factor_in_topk``) with the layer's SwiGLU clamp (``swiglu_limit``) to
``fused_moe_mxfp4`` and returns its [T, H] output; the TP all-reduce stays with ``FusedMoE``.
Layers with expert parallelism, a bias, fused shared experts, a non-SiLU / non-gated activation or sizes
that are not multiples of 128 keep SGLang's method (logged once).
"""

from __future__ import annotations

import logging

import torch

from .sglang_plugin import fall_back, takes_device

KERNEL = "mxfp4_moe"
logger = logging.getLogger("pdserve.sglang_plugin")
SGLANG_NAMES = (
    "sglang.srt.layers.moe.fused_moe_triton.layer.FusedMoE",
    "sglang.srt.layers.quantization.fp8.Fp8MoEMethod",
    "sglang.srt.layers.moe.token_dispatcher.standard.StandardCombineInput",
)
# class members the adapter reads (fields, properties, methods or attributes assigned in the class)
SGLANG_MEMBERS = {
    "sglang.srt.layers.moe.fused_moe_triton.layer.FusedMoE":
        ("is_draft", "moe_ep_size", "with_bias", "num_fused_shared_experts", "moe_runner_config", "hidden_size",
         "intermediate_size_per_partition"),
    "sglang.srt.layers.quantization.fp8.Fp8Config": ("is_fp4_experts", "dequant_fp4_to_fp8"),
    "sglang.srt.layers.quantization.fp8.Fp8MoEMethod": ("is_fp4_expert", "create_weights"),
    "sglang.srt.layers.moe.moe_runner.base.MoeRunnerConfig":
        ("activation", "is_gated", "apply_router_weight_on_input", "no_combine", "swiglu_limit",
         "gemm1_alpha", "gemm1_clamp_limit"),
    "sglang.srt.layers.moe.topk.StandardTopKOutput": ("topk_weights", "topk_ids", "router_logits"),
    "sglang.srt.layers.moe.token_dispatcher.standard.StandardDispatchOutput": ("hidden_states", "topk_output"),
    "sglang.srt.layers.moe.token_dispatcher.standard.StandardCombineInput": ("hidden_states",),
}


class PdserveMxfp4MoEMethod:
    """MoE method for MXFP4 routed experts running ``pd.kernels.mxfp4_moe.fused_moe_mxfp4`` (see the module
    docstring for the weight layout). Duck-types SGLang's FusedMoE method interface, as its own MXFP4 wrapper
    methods do; ``runner`` None / ``get_moe_runner_backend`` None declare a direct kernel that consumes the
    standard top-k with local expert ids."""

    runner = None
    fuse_routed_scaling_factor_in_topk = True
    max_scale_byte = None  # set when the weights are loaded
    weight_layout = "sglang"  # "sm90_tiled" / "sm90_bits" once the weights are prepared for sm_90

    def __init__(self, fp8_method, prefix: str):
        self._fp8 = fp8_method
        self.prefix = prefix
        self.moe_runner_config = None

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                       **extra_weight_attrs):
        self._fp8.create_weights(layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                                 **extra_weight_attrs)

    def create_moe_runner(self, layer, moe_runner_config):
        self.moe_runner_config = moe_runner_config

    def get_moe_runner_backend(self, layer):
        return None

    def get_moe_routing_method_type(self, layer, requested_method):
        return requested_method

    def process_weights_after_loading(self, layer) -> None:
        """Store the loaded fp32 power-of-two scales as the UE8M0 bytes the kernel reads (once, in place, as
        SGLang's own MXFP4 methods repack theirs) and note their largest byte, which lets sm_90 use the bit-arithmetic
        dequantization (scales <= 2). On an sm_90 GPU with scales <= 2 the packed weights are then reordered in
        place into ``weight_layout="sm90_tiled"`` (``mxfp4_moe.prepare_mxfp4_weights_sm90(..., tiled=True)``:
        about half the integer work per weight in the kernels' K loops, a pipeline stage one contiguous run) and
        the scales into its tiles (``tile_mxfp4_scales``), or ``"sm90_bits"`` (not tiled) when H or I is not a
        multiple of 256; elsewhere (sm_120, larger scales) they stay as loaded.

        Raises:
            ValueError: a scale that is not a power of two (not an MXFP4 checkpoint).
        """
        from .mxfp4_moe import (
            BITS_MAX_SCALE_BYTE,
            as_ue8m0,
            mxfp4_max_scale_byte,
            prepare_mxfp4_weights_sm90,
            tile_mxfp4_scales,
        )

        for name in ("w13", "w2"):
            sc = getattr(layer, f"{name}_weight_scale_inv")
            sc.data = as_ue8m0(sc.data)
        self.max_scale_byte = mxfp4_max_scale_byte(layer.w13_weight_scale_inv.data, layer.w2_weight_scale_inv.data)
        if self.max_scale_byte <= BITS_MAX_SCALE_BYTE and is_sm90(layer.w13_weight.device):
            hidden, inter = layer.w2_weight.shape[1], layer.w2_weight.shape[2] * 2
            tiled = hidden % 256 == 0 and inter % 256 == 0
            prepare_mxfp4_weights_sm90(layer.w13_weight.data, layer.w2_weight.data, inplace=True,  # no second copy
                                       tiled=tiled)
            if tiled:
                s13, s2 = layer.w13_weight_scale_inv, layer.w2_weight_scale_inv
                s13.data, s2.data = tile_mxfp4_scales(s13.data, s2.data)
            self.weight_layout = "sm90_tiled" if tiled else "sm90_bits"
        logger.info("pdserve mxfp4_moe: %s runs pd.kernels.mxfp4_moe.fused_moe_mxfp4 (%d experts, largest scale "
                    "2**%d%s, weight layout %s)", self.prefix, layer.w13_weight.shape[0], self.max_scale_byte - 127,
                    "" if self.max_scale_byte <= BITS_MAX_SCALE_BYTE else ": no bits dequantization on sm_90",
                    self.weight_layout)

    def apply(self, layer, dispatch_output):
        from sglang.srt.layers.moe.token_dispatcher.standard import StandardCombineInput

        from .mxfp4_moe import fused_moe_mxfp4

        cfg = self.moe_runner_config
        topk_weights, topk_ids = dispatch_output.topk_output[:2]
        out = fused_moe_mxfp4(
            dispatch_output.hidden_states, layer.w13_weight, layer.w13_weight_scale_inv,
            layer.w2_weight, layer.w2_weight_scale_inv, topk_weights.contiguous(), topk_ids.contiguous(),
            swiglu_limit=cfg.swiglu_limit, max_scale_byte=self.max_scale_byte, weight_layout=self.weight_layout,
        )
        return StandardCombineInput(hidden_states=out)


def is_sm90(device: torch.device) -> bool:
    """Whether ``device`` is a CUDA GPU of compute capability 9.x (H100 / H200), where the prepared weight layout
    is read by the bits dequantization."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def unsupported_reason(layer) -> str | None:
    """Why a draft MXFP4 expert layer keeps SGLang's method (None when ours takes it)."""
    cfg = layer.moe_runner_config
    if layer.moe_ep_size > 1:
        return "expert parallelism (ours expects every expert of the layer on this rank)"
    if layer.with_bias:
        return "expert biases"
    if layer.num_fused_shared_experts:
        return "shared experts fused into the routed tensor"
    if cfg.activation != "silu" or not cfg.is_gated:
        return f"activation {cfg.activation} gated={cfg.is_gated} (ours: SwiGLU)"
    if cfg.gemm1_alpha is not None or cfg.gemm1_clamp_limit is not None:
        return "GPT-OSS-style gemm1 alpha/clamp"
    if cfg.apply_router_weight_on_input or cfg.no_combine:
        return "router weight on the input / no-combine output"
    if layer.hidden_size % 128 or layer.intermediate_size_per_partition % 128:
        return (f"hidden {layer.hidden_size} / intermediate {layer.intermediate_size_per_partition} per rank "
                "(ours: multiples of 128)")
    return None


def get_quant_method(original, self, layer, prefix):
    """AROUND hook of ``Fp8Config.get_quant_method``: :class:`PdserveMxfp4MoEMethod` for the draft's MXFP4
    experts, SGLang's choice for everything else."""
    chosen = original(self, layer, prefix)
    if not (getattr(self, "is_fp4_experts", False) and not getattr(self, "dequant_fp4_to_fp8", False)):
        return chosen
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.layers.quantization.fp8 import Fp8MoEMethod

    if not isinstance(layer, FusedMoE) or not layer.is_draft:
        return chosen
    fp8_method = chosen if isinstance(chosen, Fp8MoEMethod) else getattr(chosen, "_fp8", None)
    if not isinstance(fp8_method, Fp8MoEMethod) or not fp8_method.is_fp4_expert:
        return chosen  # a skipped (unquantized) layer, or a method that does not load MXFP4 experts
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if not takes_device(dev):
        return chosen
    reason = unsupported_reason(layer)
    if reason is not None:
        fall_back(KERNEL, f"{prefix}: {reason}")
        return chosen
    logger.info("pdserve mxfp4_moe: %s: %s replaced by PdserveMxfp4MoEMethod", prefix, type(chosen).__name__)
    return PdserveMxfp4MoEMethod(fp8_method, prefix)
