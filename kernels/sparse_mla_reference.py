"""Torch reference for sparse-MLA decode on the DeepSeek-V4 FP8 paged KV cache (FlashMLA semantics).

KV layout (FlashMLA "MODEL1_FP8Sparse", 584 bytes per token, one KV head):
  a page of ``page_size`` tokens is ``page_stride`` bytes, ``page_stride`` = ``page_size * 584`` rounded up to
  a multiple of 576 (page_size 64 -> 37440, 256 -> 149760). Inside a page:
    bytes [0, page_size * 576): token ``t`` at ``t * 576``: 448 float8_e4m3fn "nope" values, then 64 bfloat16
      "rope" values (128 bytes);
    bytes [page_size * 576, page_size * 584): token ``t`` at ``page_size * 576 + t * 8``: 7 UE8M0 scales
      (float8_e8m0fnu: value 2**(byte - 127)), scale ``j`` covering nope values [64 j, 64 j + 64), then 1 pad byte.
  Dequantized key = value = [nope * scale (448), rope (64)] -> 512 values (d_qk = d_v = 512).
  ``indices[b, s, i]`` is a token id ``page * page_size + offset``; -1 skips the slot.

Semantics (what ``pd.kernels.sparse_mla_decode`` implements; FlashMLA's ``flash_mla_with_kvcache`` sparse
decode, tests/ref.py ``ref_sparse_attn_decode``):
  - ``softmax_scale`` defaults to ``1 / sqrt(512)`` (``q.shape[-1] ** -0.5``, FlashMLA's default).
  - Only the first ``topk_length[b]`` entries of ``indices[b, s]`` are used (all when None); the extra cache
    (``extra_k_cache`` / ``extra_indices`` / ``extra_topk_length``) adds its tokens to the same softmax, which
    is the log-sum-exp merge of the two partial attentions.
  - ``lse[b, h, s]`` = natural-log log-sum-exp of ``softmax_scale * q . k`` over the used tokens of both caches.
    It does not include the sink. A row with no usable token gets ``out = 0`` and ``lse = +inf``.
  - ``attn_sink[h]`` (fp32) adds ``exp(attn_sink[h])`` to the softmax denominator of head h without adding a
    value: ``out *= exp(lse) / (exp(lse) + exp(attn_sink)) = 1 / (1 + exp(attn_sink - lse))``; lse unchanged.
"""

from __future__ import annotations

import math

import torch

D_NOPE = 448
D_ROPE = 64
D_QK = 512
DATA_BYTES = 576  # 448 fp8 + 64 bf16
SCALE_BYTES = 8  # 7 UE8M0 + 1 pad
BYTES_PER_TOKEN = DATA_BYTES + SCALE_BYTES  # 584
N_SCALES = 7


def page_stride_bytes(page_size: int) -> int:
    """Bytes per page: page_size * 584 rounded up to a multiple of 576."""
    return (page_size * BYTES_PER_TOKEN + DATA_BYTES - 1) // DATA_BYTES * DATA_BYTES


def quantize_kv(kv: torch.Tensor, page_size: int) -> torch.Tensor:
    """Pack bf16/fp32 ``kv`` [num_pages * page_size, 512] into the FP8 paged layout.

    Returns a uint8 tensor [num_pages, page_stride_bytes(page_size)] (pad bytes zero). The per-64 scale is the
    power of two >= amax / 448 (FlashMLA tests/quant.py).
    """
    n = kv.shape[0]
    assert kv.shape[1] == D_QK and n % page_size == 0
    pages = n // page_size
    kvf = kv.float().view(pages, page_size, D_QK)
    out = torch.zeros(pages, page_stride_bytes(page_size), dtype=torch.uint8, device=kv.device)
    data = out[:, : page_size * DATA_BYTES].view(pages, page_size, DATA_BYTES)
    scales = out[:, page_size * DATA_BYTES : page_size * BYTES_PER_TOKEN].view(pages, page_size, SCALE_BYTES)
    nope = kvf[..., :D_NOPE].view(pages, page_size, N_SCALES, 64)
    amax = nope.abs().amax(-1).clamp_min(1e-4) / 448.0
    exp = torch.ceil(torch.log2(amax)).clamp(-126, 127)
    scale = torch.pow(2.0, exp)
    q8 = (nope / scale.unsqueeze(-1)).to(torch.float8_e4m3fn).view(torch.uint8)
    data[..., :D_NOPE] = q8.view(pages, page_size, D_NOPE)
    rope = kvf[..., D_NOPE:].to(torch.bfloat16).contiguous().view(torch.uint8)
    data[..., D_NOPE:] = rope.view(pages, page_size, 2 * D_ROPE)
    scales[..., :N_SCALES] = (exp + 127).to(torch.uint8)
    return out


def dequantize_kv(k_cache: torch.Tensor, page_size: int) -> torch.Tensor:
    """FP8 paged cache (uint8 [pages, page_stride] or any byte view of it) -> fp32 [pages * page_size, 512]."""
    kc = k_cache.reshape(k_cache.shape[0], -1).view(torch.uint8)
    pages = kc.shape[0]
    data = kc[:, : page_size * DATA_BYTES].reshape(pages, page_size, DATA_BYTES)
    sc = kc[:, page_size * DATA_BYTES : page_size * BYTES_PER_TOKEN].reshape(pages, page_size, SCALE_BYTES)
    nope = data[..., :D_NOPE].contiguous().view(torch.float8_e4m3fn).float().view(pages, page_size, N_SCALES, 64)
    scale = torch.pow(2.0, sc[..., :N_SCALES].float() - 127.0)
    rope = data[..., D_NOPE:].contiguous().view(torch.bfloat16).float()
    k = torch.cat([(nope * scale.unsqueeze(-1)).view(pages, page_size, D_NOPE), rope], dim=-1)
    return k.view(pages * page_size, D_QK)


def _gather(k_cache, indices, topk_length, page_size):
    b, s, topk = indices.shape
    kv = dequantize_kv(k_cache, page_size).double()
    invalid = indices < 0
    if topk_length is not None:
        invalid = invalid | (torch.arange(topk, device=indices.device).view(1, 1, topk) >= topk_length.view(b, 1, 1))
    gathered = kv.index_select(0, indices.clamp_min(0).reshape(-1).long()).view(b, s, topk, D_QK)
    return gathered, invalid


def sparse_mla_decode_ref(
    q,
    k_cache,
    indices,
    topk_length=None,
    attn_sink=None,
    softmax_scale=None,
    extra_k_cache=None,
    extra_indices=None,
    extra_topk_length=None,
    page_size=64,
    extra_page_size=None,
):
    """fp64 reference. Returns (out fp32 [B,S,H,512], lse fp32 [B,H,S]); see the module docstring."""
    b, s, h, d = q.shape
    if softmax_scale is None:
        softmax_scale = d ** -0.5
    kv, invalid = _gather(k_cache, indices, topk_length, page_size)
    if extra_k_cache is not None:
        kv1, inv1 = _gather(extra_k_cache, extra_indices, extra_topk_length, extra_page_size or page_size)
        kv = torch.cat([kv, kv1], dim=2)
        invalid = torch.cat([invalid, inv1], dim=2)
    qd = q.double()
    logits = torch.einsum("bshd,bstd->bsht", qd, kv) * softmax_scale
    logits = logits.masked_fill(invalid.unsqueeze(2), float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # [b, s, h]
    empty = lse == float("-inf")
    p = torch.exp(logits - torch.where(empty, torch.zeros_like(lse), lse).unsqueeze(-1))
    out = torch.einsum("bsht,bstd->bshd", p, kv)
    if attn_sink is not None:
        out = out / (1.0 + torch.exp(attn_sink.double().view(1, 1, h) - lse)).unsqueeze(-1)
    out = out.masked_fill(empty.unsqueeze(-1), 0.0)
    lse = lse.masked_fill(empty, math.inf)
    return out.float(), lse.transpose(1, 2).float().contiguous()
