"""Fused MoE with MXFP4 expert weights and bf16 activations (Triton; sm_120a and sm_90a): the draft MoE of
DeepSeek-V4's MTP layer.

``fused_moe_mxfp4(hidden_states, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, ...) -> [T, H] bf16``
computes, per token, the top-k routed experts' gate/up projections, the (clamped) SwiGLU, the down projection,
and the routing-weighted sum over k. The weight layout is SGLang's (``Fp8MoEMethod`` for ``is_fp4_experts``
checkpoints, srt/layers/quantization/fp8.py; gate rows first, low nibble = even column, one UE8M0 byte per 32
values along K) and the exact computation, rounding points included, is documented in
``pd.kernels.mxfp4_moe_reference``, so the plugin passes SGLang's tensors straight through.

Kernels (weights are never dequantized in memory):
  * ``_gate_up_kernel``: one program per (row block, BN columns of the intermediate): streams the packed gate
    and up rows of its expert over K = H; the packed bytes go global -> shared (cp.async) -> registers in the
    mma operand layout, are turned into bf16 there and fed to mma.sync with fp32 accumulation, by one of two
    dequantizations (``_mx_dot``): ``tl.dot_scaled(x, None, "bf16", w, scale, "e2m1")`` (Triton's emulation: a
    PRMT lookup table per 8 values, or the cvt instruction Triton emits for sm_120, then a multiply by the bf16
    ``2 ** (scale - 127)``), or on sm_90 the "bits" dequantization (``_E2M1_BITS_ASM``: bit arithmetic on packed
    32-bit words; the K loop takes ~3.3-3.65 SASS instructions per weight instead of ~4.6-5.0; needs every scale
    <= 2, which the caller states with ``max_scale_byte``). With ``weight_layout="sm90_bits"`` the weights were
    reordered once at load time (``prepare_mxfp4_weights_sm90``, ``_E2M1_PREP_ASM``): about half the integer
    work and ~2.7-3.1 SASS per weight, the product computed transposed (converted weights as the mma A operand).
    ``"sm90_tiled"`` is the same elements stored as 32-row x 256-value tiles and the scales as 32-row x 8-byte
    tiles, so a pipeline stage reads one contiguous 4 KiB run (and one 256-byte run of scales) instead of 128 bytes
    (and 8 bytes) from each of 32 rows: the grid streams its experts in long runs instead of 128-byte pieces.
    Faster than "sm90_bits" at every T timed on the H200 (the figures, against the weight-bandwidth floor:
    benchmarks/results/mxfp4_moe.md), it is what the SGLang method prepares on sm_90 when H and I are multiples of
    256.
    The epilogue rounds gate/up to bf16, clamps, applies SiLU(gate) * up and stores h (bf16).
  * ``_down_kernel``: the same over K = I for the down projection; multiplies by the routing weight and either
    stores the per-pair rows (fp32) for ``_topk_sum_kernel``, or (``pair_token`` path) loops over a token's k
    experts and writes the summed bf16 output itself.
  * ``_align_kernel`` (``sorted`` path): one program groups the (token, slot) pairs by expert into blocks of
    BM rows (histogram + scan + atomic cursors), so each expert's weights are read once per block.
  * ``fold`` plans (pair path): no ``_swiglu_kernel`` / ``_topk_sum_kernel`` launches; the last gate/up program of
    each (pair, columns) group and the last down program of each (token, columns) group, elected by acq_rel atomic
    tickets (``mxfp4_moe_workspace``, left zeroed), do that work with the same arithmetic in the same order.
Paths: ``pair`` / ``pair_token`` give every (token, slot) pair its own programs (no sorting; for the draft's
small T the routed experts of a token are distinct and shared ones are served from L2); ``sorted`` reads each
routed expert once per BM rows, for larger T. ``DEFAULT_CONFIGS`` (``DEFAULT_CONFIGS_SM90_BITS`` for prepared
weights) picks by the number of pairs; all paths
launch fixed grids computed from shapes alone and read routing on the device, so a call is CUDA-graph
capturable (no host sync). H200 numbers, profiles and the variants measured and rejected:
benchmarks/results/mxfp4_moe.md; the prepared layouts against each other: benchmarks/results/mxfp4_moe_ab.md.

Modules: ``ptx`` (inline PTX), ``layouts`` (weight layouts and the sm_90 re-layouts), ``jit_helpers`` and ``kernels``
(the ``@triton.jit`` code), ``configs`` (the launch plan ``MoEPlan`` of two ``MoETile`` and the tuning tables),
``validation`` (argument checks), ``launch`` (the launcher and its planner). The torch reference is
``pd.kernels.mxfp4_moe_reference``.
"""

from .configs import (
                      BITS_MAX_SCALE_BYTE,
                      BM_CHOICES,
                      DEFAULT_CONFIGS,
                      DEFAULT_CONFIGS_SM90_BITS,
                      DEFAULT_CONFIGS_SM90_TILED,
                      DEQUANT_CHOICES,
                      MAXNREG_MIN,
                      PATHS,
                      PDL_RELEASE_CHOICES,
                      SPLIT_CHOICES,
                      STAGE_LOADS_CHOICES,
                      TILE_CONFIGS,
                      MoEPlan,
                      MoETile,
                      as_plan,
                      default_config,
)
from .kernels import (
                      DOWN_SIGNATURE,
                      GATE_UP_SIGNATURE,
                      _align_kernel,
                      _down_kernel,
                      _gate_up_kernel,
                      _swiglu_kernel,
                      _topk_sum_kernel,
)
from .launch import (
                      GROUP,
                      _dequant_mode,
                      _fit_bk,
                      _fit_split,
                      _plan,
                      fused_moe_mxfp4,
                      max_sorted_blocks,
                      mxfp4_moe_workspace,
)
from .layouts import (
                      PREPARED_LAYOUTS,
                      TILE_ELEMS,
                      TILE_ROWS,
                      TILE_SCALES,
                      WEIGHT_LAYOUTS,
                      WL_SGLANG,
                      WL_SM90_BITS,
                      WL_SM90_TILED,
                      prepare_mxfp4_weights_sm90,
                      tile_mxfp4_scales,
)
from .ptx import _E2M1_BITS_ASM, _E2M1_PREP_ASM, _UE8M0_FACTOR_ASM, DEQ_BITS_ASM, DEQ_BITS_TL, DEQ_DOT_SCALED
from .validation import UE8M0_DTYPES, _check_config, as_ue8m0, mxfp4_max_scale_byte

__all__ = [
    "BITS_MAX_SCALE_BYTE", "BM_CHOICES", "DEFAULT_CONFIGS", "DEFAULT_CONFIGS_SM90_BITS",
    "DEFAULT_CONFIGS_SM90_TILED", "DEQUANT_CHOICES", "DEQ_BITS_ASM", "DEQ_BITS_TL", "DEQ_DOT_SCALED",
    "DOWN_SIGNATURE", "GATE_UP_SIGNATURE", "GROUP", "MAXNREG_MIN", "MoEPlan", "MoETile", "PATHS", "PDL_RELEASE_CHOICES",
    "PREPARED_LAYOUTS", "SPLIT_CHOICES", "STAGE_LOADS_CHOICES", "TILE_CONFIGS", "TILE_ELEMS", "TILE_ROWS",
    "TILE_SCALES", "UE8M0_DTYPES", "WEIGHT_LAYOUTS", "WL_SGLANG", "WL_SM90_BITS", "WL_SM90_TILED", "_E2M1_BITS_ASM",
    "_E2M1_PREP_ASM", "_UE8M0_FACTOR_ASM", "_align_kernel", "_check_config", "_dequant_mode", "_down_kernel",
    "_fit_bk", "_fit_split", "_gate_up_kernel", "_plan", "_swiglu_kernel", "_topk_sum_kernel", "as_plan", "as_ue8m0",
    "default_config", "fused_moe_mxfp4", "max_sorted_blocks", "mxfp4_max_scale_byte", "mxfp4_moe_workspace",
    "prepare_mxfp4_weights_sm90", "tile_mxfp4_scales",
]
