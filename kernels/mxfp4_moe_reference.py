"""Torch reference for the MXFP4 fused MoE of DeepSeek-V4's MTP draft layer (dequantize, then torch matmuls).

Weight layout (the pinned SGLang 0.5.23 as ``Fp8MoEMethod.create_fp8_moe_weight_`` in
``srt/layers/quantization/fp8.py`` creates it for ``is_fp4_experts`` checkpoints, filled by
``FusedMoE._load_w13`` in ``srt/layers/moe/fused_moe_triton/layer.py``):
  w13       [E, 2 I, H / 2] int8/uint8: per expert the gate projection (checkpoint ``w1``) in rows [0, I), the up
            projection (``w3``) in rows [I, 2 I) ("w1 into the first half, w3 into the second");
  w13_scale [E, 2 I, H / 32] UE8M0 bytes, one per 32 consecutive values of a row;
  w2        [E, H, I / 2] int8/uint8 (down projection), w2_scale [E, H, I / 32] UE8M0 bytes.
  Two e2m1 values per byte, the even element (column 2 j) in the LOW nibble, column 2 j + 1 in the high nibble
  (``cast_e2m1fn_to_e4m3fn`` in fp8.py; OCP MX v1.0). A nibble is ``s e1 e0 m``: 0..7 -> 0, 0.5, 1, 1.5, 2, 3,
  4, 6; bit 3 negates. A scale byte ``b`` means ``2 ** (b - 127)`` (255 is NaN in E8M0 and not accepted as data).
  SGLang keeps the loaded scales as fp32 powers of two (``w13_weight_scale_inv``) or float8_e8m0fnu; the kernel
  reads the bytes (``float8_e8m0fnu.view(uint8)``, or ``pd.kernels.mxfp4_moe.as_ue8m0`` once at load time).
  FlashInfer's CUTLASS method loads [up; gate] instead (``load_up_proj_weight_first``): ``up_first=True``.

Computation for token t with experts e_j = topk_ids[t, j] and weights w_j = topk_weights[t, j] (the DeepSeek-V4
MoE as SGLang runs it: ``srt/layers/moe/moe_runner/triton_utils/fused_moe.py`` and the clamp of
``kernels/jit/csrc/deepseek_v4/silu_and_mul_masked_post_quant.cuh``):
  g, u = bf16(x_t @ W_gate[e_j]^T), bf16(x_t @ W_up[e_j]^T)    (fp32 accumulation, rounded to bf16 like the GEMM
                                                                   output SGLang clamps)
  with swiglu_limit L (DeepSeek-V4: config.swiglu_limit = 10): g = min(g, L), u = clamp(u, -L, L)
  h = bf16(silu(g) * u)                                         (silu and product in fp32)
  out_t = routed_scaling_factor * sum_j w_j * (h @ W_down[e_j]^T)   (fp32, rounded to bf16 once)
Pairs with topk_ids = -1 (an expert not on this rank) contribute nothing.
"""

from __future__ import annotations

import torch

GROUP = 32  # values per UE8M0 scale
# e2m1 code -> value (bit 3 = sign)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # magnitude decision points between consecutive e2m1 values


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed e2m1 ``[..., K/2]`` (uint8/int8) and UE8M0 ``scale [..., K/32]`` (uint8 / float8_e8m0fnu) ->
    ``[..., K]`` in ``dtype`` (exact in fp32/fp64 for scale bytes 0..254)."""
    p = packed.view(torch.uint8)
    lut = torch.tensor(E2M1_VALUES, dtype=dtype, device=p.device)
    vals = torch.stack([lut[(p & 0xF).long()], lut[(p >> 4).long()]], dim=-1).flatten(-2)
    s = scale.view(torch.uint8).to(dtype)
    s = torch.exp2(s - 127).repeat_interleave(GROUP, dim=-1)
    return vals * s


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., K]`` (K % 32 == 0) -> (packed uint8 ``[..., K/2]``, UE8M0 uint8 ``[..., K/32]``).

    Per group of 32 the scale is the smallest power of two with amax / scale <= 6 (SGLang's
    ``MXFP4QuantizeUtil``: ``ceil(log2(amax / 6))``), each value is rounded to the nearest e2m1 magnitude.
    """
    if w.shape[-1] % GROUP:
        raise ValueError(f"w: last dim must be a multiple of {GROUP}, got {w.shape[-1]}")
    wf = w.float().reshape(*w.shape[:-1], -1, GROUP)
    amax = wf.abs().amax(-1, keepdim=True).clamp_min(2.0 ** -126)
    e = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    q = wf / torch.exp2(e)
    bounds = torch.tensor(_BOUNDS, device=w.device)
    mag = (q.abs().unsqueeze(-1) > bounds).sum(-1).to(torch.uint8)
    code = (mag | ((q < 0).to(torch.uint8) << 3)).reshape(*w.shape[:-1], -1)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    return packed, (e + 127).to(torch.uint8).reshape(*w.shape[:-1], -1)


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(x.dtype)


def swiglu_clamped(gate: torch.Tensor, up: torch.Tensor, swiglu_limit: float | None) -> torch.Tensor:
    """``silu(min(gate, L)) * clamp(up, -L, L)`` (no clamp when ``swiglu_limit`` is None), in gate's dtype."""
    if swiglu_limit is not None:
        gate = gate.clamp(max=swiglu_limit)
        up = up.clamp(-swiglu_limit, swiglu_limit)
    return gate * torch.sigmoid(gate) * up


def fused_moe_mxfp4_reference(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    swiglu_limit: float | None = None,
    routed_scaling_factor: float | None = None,
    up_first: bool = False,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """The module docstring's computation in ``dtype`` (fp64 default; fp32 on a GPU is fine) with the bf16
    rounding points of the kernel. Returns ``[T, H]`` in ``dtype``, not rounded to bf16. Dequantizes one routed
    expert at a time (memory ~ one expert in ``dtype``)."""
    def dequantized(e: int) -> tuple[torch.Tensor, torch.Tensor]:
        return dequantize_mxfp4(w13[e], w13_scale[e], dtype), dequantize_mxfp4(w2[e], w2_scale[e], dtype)

    return _routed_experts(hidden_states, topk_weights, topk_ids, dequantized, w13.shape[1] // 2, swiglu_limit,
                           routed_scaling_factor, up_first, dtype)


def fused_moe_dequantized_reference(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    swiglu_limit: float | None = None,
    routed_scaling_factor: float | None = None,
    up_first: bool = False,
) -> torch.Tensor:
    """:func:`fused_moe_mxfp4_reference` on experts dequantized once beforehand: ``w13 [E, 2 I, H]`` and
    ``w2 [E, H, I]`` as ``dequantize_mxfp4`` returns them (in the computation's dtype). The same operations in the
    same order, so the result is bit-identical to the reference on the packed weights; what it saves is the
    per-call dequantization (measured on the built-in draft's MoE, 4 experts of H 64 x I 128, one token on one
    CPU thread: about 0.55 of the reference's 0.8 ms). Returns ``[T, H]`` in ``w13``'s dtype."""
    return _routed_experts(hidden_states, topk_weights, topk_ids, lambda e: (w13[e], w2[e]), w13.shape[1] // 2,
                           swiglu_limit, routed_scaling_factor, up_first, w13.dtype)


def _routed_experts(hidden_states, topk_weights, topk_ids, expert_weights, inter, swiglu_limit,
                    routed_scaling_factor, up_first, dtype) -> torch.Tensor:
    t, hdim = hidden_states.shape
    x = hidden_states.to(dtype)
    out = torch.zeros(t, hdim, dtype=dtype, device=x.device)
    ids = topk_ids.long()
    wts = topk_weights.to(dtype) * (1.0 if routed_scaling_factor is None else routed_scaling_factor)
    for e in torch.unique(ids).tolist():
        if e < 0:
            continue
        tok, slot = (ids == e).nonzero(as_tuple=True)
        w_gu, w_down = expert_weights(e)
        gu = _bf16(x[tok] @ w_gu.T)
        up, gate = (gu[:, :inter], gu[:, inter:]) if up_first else (gu[:, inter:], gu[:, :inter])
        h = _bf16(swiglu_clamped(gate, up, swiglu_limit))
        y = h @ w_down.T
        out.index_add_(0, tok, y * wts[tok, slot, None])
    return out
