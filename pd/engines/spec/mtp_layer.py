"""The math of the MTP draft layer (DeepSeek-V3 tech report, section 2.2; SGLang's
``srt/models/deepseek_nextn.py``): pure functions over a dict of weights, shared by the draft model that
serves (``pd.engines.spec.draft_model``) and the code that fits the built-in draft
(``pd.engines.models.builtin_draft``).

For draft position i with next token x_{i+1} and previous hidden h_i (the target's LM head input, or the
draft's own when chaining):
  u   = eh_proj(cat(enorm(E[x_{i+1}]), hnorm(h_i)))               2H -> H, no bias
  r   = u + o_proj(attn(RoPE(q), RoPE(k), v))   on input_layernorm(u), causal over the draft's own KV cache
  out = r + MoE(post_attention_layernorm(r))                      routed experts, MXFP4 weights
  hidden_out = shared_head.norm(out); logits = lm_head(hidden_out)  (the target's LM head, shared)
``hidden_out`` is what the next chained step reads as its h: SGLang's NextN model returns the states after
``shared_head.norm`` and its LogitsProcessor captures those for the next draft step, the same point as the
target's captured hidden (final norm output), so target and draft hiddens are drawn from one distribution.

The MoE: router logits ``gate @ x`` -> softmax -> top-k -> renormalised weights (DeepSeek's
``norm_topk_prob``), experts computed by ``fused_moe_mxfp4_reference`` in fp32 on CPU (its variant
``fused_moe_dequantized_reference`` on experts dequantized once at load: bit-identical, without the
per-call dequantization), by the Triton ``fused_moe_mxfp4`` on a CUDA tensor when Triton imports. The
kernel needs H and I to be multiples of 128; builtin:tiny's H is 64, so on CUDA the experts are
zero-padded to H = 128 once (exact: the padded columns and rows are zeros and the scale bytes of all-zero
groups are 0), the activations likewise, and the output sliced back.
"""

from __future__ import annotations

import functools

import torch

from pd.kernels.mxfp4_moe_reference import (
    dequantize_mxfp4,
    fused_moe_dequantized_reference,
    fused_moe_mxfp4_reference,
)

# the checkpoint's expert tensor names (SGLang's FusedMoE parameter names), by the reference's argument names
EXPERT_TENSORS = {"w13": "w13_weight", "w13_scale": "w13_weight_scale",
                  "w2": "w2_weight", "w2_scale": "w2_weight_scale"}
KERNEL_MULTIPLE = 128  # fused_moe_mxfp4 requires H % 128 == 0 and I % 128 == 0 (its launcher's check)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama / DeepSeek RMSNorm in fp32: ``x / sqrt(mean(x^2) + eps) * weight``."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


@functools.lru_cache(maxsize=8)
def _inv_freq(dim: int, theta: float, device: torch.device) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama's rotary embedding (``rotate_half`` convention of transformers' modeling_llama) on
    ``x [heads, T, head_dim]`` at integer ``positions [T]``."""
    dim = x.shape[-1]
    freqs = positions.float()[:, None] * _inv_freq(dim, theta, x.device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    x1, x2 = x[..., : dim // 2], x[..., dim // 2 :]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def attention(w: dict, cfg: dict, x: torch.Tensor, cache, kv_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Grouped-query causal self-attention of ``x [T, H]`` after the ``cache.get_seq_length()`` tokens the
    cache holds (positions continue from there); appends this call's K/V to ``cache`` as layer 0 in
    ``kv_dtype`` (transformers ``DynamicCache.update`` layout ``[1, kv_heads, tokens, head_dim]``).
    Returns ``[T, H]`` fp32 (o_proj applied)."""
    heads, kv_heads, dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    t = x.shape[0]
    past = cache.get_seq_length()
    pos = torch.arange(past, past + t, device=x.device)
    q = (x @ w["decoder.self_attn.q_proj.weight"].T).view(t, heads, dim).transpose(0, 1)
    k = (x @ w["decoder.self_attn.k_proj.weight"].T).view(t, kv_heads, dim).transpose(0, 1)
    v = (x @ w["decoder.self_attn.v_proj.weight"].T).view(t, kv_heads, dim).transpose(0, 1)
    q, k = rope(q, pos, cfg["rope_theta"]), rope(k, pos, cfg["rope_theta"])
    k_all, v_all = cache.update(k.unsqueeze(0).to(kv_dtype), v.unsqueeze(0).to(kv_dtype), 0)
    k_all, v_all = k_all[0].float(), v_all[0].float()
    # query j (absolute position past + j) sees keys 0..past + j; one query (a chained step) sees them all
    mask = torch.arange(past + t, device=x.device)[None, :] <= pos[:, None] if t > 1 else None
    out = torch.nn.functional.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, enable_gqa=True)
    return out.transpose(0, 1).reshape(t, heads * dim) @ w["decoder.self_attn.o_proj.weight"].T


def route(gate_weight: torch.Tensor, x: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax router: ``(topk_weights [T, k] fp32 renormalised to sum 1, topk_ids [T, k] int32)``
    (DeepSeek-V2/V3 ``scoring_func="softmax"`` with ``norm_topk_prob``)."""
    probs = torch.softmax((x @ gate_weight.T).float(), dim=-1)
    wts, ids = probs.topk(top_k, dim=-1)
    return (wts / wts.sum(-1, keepdim=True)).contiguous(), ids.to(torch.int32).contiguous()


@functools.lru_cache(maxsize=1)
def _triton_kernel():
    """``pd.kernels.mxfp4_moe.fused_moe_mxfp4``, or None where Triton does not import."""
    try:
        from pd.kernels.mxfp4_moe import fused_moe_mxfp4
    except ImportError:
        return None
    return fused_moe_mxfp4


def pad_experts_for_kernel(experts: dict) -> dict:
    """Experts zero-padded to the kernel's multiples of 128 along H and I (uint8 codes and UE8M0 bytes;
    code 0 is +0.0 and scale byte 0 is 2**-127, so padded entries are exact zeros)."""
    w13, w13s, w2, w2s = experts["w13"], experts["w13_scale"], experts["w2"], experts["w2_scale"]
    e, two_i, half_h = w13.shape
    h, inter = 2 * half_h, two_i // 2
    hp, ip = -(-h // KERNEL_MULTIPLE) * KERNEL_MULTIPLE, -(-inter // KERNEL_MULTIPLE) * KERNEL_MULTIPLE

    def pad(t, rows_per_half, rows, cols):
        out = torch.zeros((e, rows, cols), dtype=t.dtype, device=t.device)
        if rows_per_half is None:
            out[:, : t.shape[1], : t.shape[2]] = t
        else:  # w13: gate rows [0, I) then up rows [I, 2I) keep their halves
            out[:, :rows_per_half, : t.shape[2]] = t[:, :inter]
            out[:, rows // 2 : rows // 2 + rows_per_half, : t.shape[2]] = t[:, inter:]
        return out.contiguous()

    return {"w13": pad(w13, inter, 2 * ip, hp // 2), "w13_scale": pad(w13s, inter, 2 * ip, hp // 32),
            "w2": pad(w2, None, hp, ip // 2), "w2_scale": pad(w2s, None, hp, ip // 32), "hidden": h}


def prepare_experts(experts: dict) -> dict:
    """What :func:`moe` reuses across calls, made once at load time: on CUDA with Triton the kernel's padded
    copy (``"padded"``, :func:`pad_experts_for_kernel`), else the fp32 dequantized experts (``"dense"``)."""
    if experts["w13"].is_cuda and _triton_kernel() is not None:
        return {"padded": pad_experts_for_kernel(experts)}
    return {"dense": dequantized_experts(experts)}


def moe(experts: dict, gate_weight: torch.Tensor, x: torch.Tensor, top_k: int,
        prepared: dict | None = None) -> torch.Tensor:
    """The routed MoE on ``x [T, H]``: ``[T, H]`` fp32.

    ``experts``: w13 [E, 2I, H/2] uint8, w13_scale [E, 2I, H/32] uint8, w2 [E, H, I/2] uint8, w2_scale
    [E, H, I/32] uint8 (``pd.kernels.mxfp4_moe_reference`` layout). ``prepared`` (:func:`prepare_experts` of
    the same experts) None: ``fused_moe_mxfp4_reference(..., dtype=torch.float32)``; with ``"dense"``: its
    bit-identical variant on the dequantized experts; with ``"padded"`` (a CUDA tensor, Triton present):
    ``fused_moe_mxfp4`` on bf16 activations, output back in fp32.
    """
    wts, ids = route(gate_weight, x, top_k)
    prepared = prepared or {}
    kernel = _triton_kernel() if x.is_cuda else None
    padded = prepared.get("padded")
    if kernel is not None and padded is not None:
        h = padded["hidden"]
        xp = torch.zeros((x.shape[0], padded["w2"].shape[1]), dtype=torch.bfloat16, device=x.device)
        xp[:, :h] = x
        out = kernel(xp, padded["w13"], padded["w13_scale"], padded["w2"], padded["w2_scale"], wts, ids)
        return out[:, :h].float()
    if "dense" in prepared:
        w13, w2 = prepared["dense"]  # dequantized_experts' pair
        return fused_moe_dequantized_reference(x.float(), w13, w2, wts, ids)
    return fused_moe_mxfp4_reference(x, experts["w13"], experts["w13_scale"], experts["w2"], experts["w2_scale"],
                                     wts, ids, dtype=torch.float32)


def dequantized_experts(experts: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13 [E, 2I, H], w2 [E, H, I]) fp32: the MXFP4 experts' exact values."""
    return (dequantize_mxfp4(experts["w13"], experts["w13_scale"]),
            dequantize_mxfp4(experts["w2"], experts["w2_scale"]))


def layer_forward(w: dict, cfg: dict, embeds: torch.Tensor, hidden: torch.Tensor, cache,
                  prepared: dict | None = None,
                  kv_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """One MTP step over T positions: ``embeds [T, H]`` (the target's embedding rows of x_{i+1}) and
    ``hidden [T, H]`` (h_i) -> ``(out [T, H], hidden_out [T, H])`` fp32, the decoder layer's output before and
    after ``shared_head.norm`` (the LM head reads hidden_out). The cache grows by T. Weights are fp32 (the
    experts MXFP4 bytes); ``prepared``: see :func:`moe`."""
    eps = cfg["rms_norm_eps"]
    z = torch.cat((rms_norm(embeds, w["enorm.weight"], eps), rms_norm(hidden, w["hnorm.weight"], eps)), dim=-1)
    u = z @ w["eh_proj.weight"].T
    r = u + attention(w, cfg, rms_norm(u, w["decoder.input_layernorm.weight"], eps), cache, kv_dtype)
    experts = {k: w[f"decoder.mlp.experts.{name}"] for k, name in EXPERT_TENSORS.items()}
    m = moe(experts, w["decoder.mlp.gate.weight"], rms_norm(r, w["decoder.post_attention_layernorm.weight"], eps),
            cfg["num_experts_per_tok"], prepared)
    out = r + m
    return out, rms_norm(out, w["shared_head.norm.weight"], eps)
