"""Torch reference for the DSA lightning-indexer decode step (scores + top-k) on SGLang's FP8 index-key cache.

Index-key cache layout (SGLang 0.5.23: ``srt/mem_cache/deepseek_v4_memory_pool.py`` ``DeepSeekV4IndexerPool``
and ``srt/mem_cache/memory_pool.py`` ``DSATokenToKVPool`` allocate it; ``kernels/ops/kvcache/dsa_index_k_cache.py``
``_set_k_and_s_triton_kernel`` writes it; ``srt/layers/attention/dsa/dsa_indexer.py`` ``_get_topk_paged`` hands it
to DeepGEMM's ``fp8_paged_mqa_logits`` as a (pages, page_size, 1, 132) view):
  one uint8 buffer per layer, ``[num_pages, page_size * 132]``. Inside page ``p``:
    bytes [0, page_size * 128): token ``t`` at ``t * 128``: 128 float8_e4m3fn key values;
    bytes [page_size * 128, page_size * 132): token ``t`` at ``page_size * 128 + t * 4``: its float32 scale.
  Dequantized key of token ``t`` = fp8 values * scale. SGLang uses page_size 64 on CUDA (128 with DeepGEMM's
  paged sparse MQA logits for DSv4.1).
  Logical position ``i`` of request ``b`` lives in physical page ``block_table[b, i // page_size]`` at offset
  ``i % page_size`` (SGLang's ``page_table_64``).

Score (DeepSeek-V3.2 / V4 ``Indexer``; DeepGEMM ``fp8_paged_mqa_logits``):
  ``score[b, s, i] = scale_k[i] * sum_h relu(q[b, s, h] . k8[i]) * w[b, s, h]``
  (= ``sum_h relu(q_h . k_i) * w_h`` with the dequantized key, since relu(c x) = c relu(x) for c > 0).
  ``w`` is taken as given: SGLang folds ``n_heads ** -0.5 * head_dim ** -0.5`` (the softmax scale) and, for an
  fp8 query, the per-(token, head) query scale into it (``dsa_indexer.py`` ``_get_logits_head_gate``). A global
  positive factor does not change the selected set.

Causal live range per query token (SGLang ``seqlens_expand_triton``, DeepGEMM's ``next_n`` convention):
  with ``seq_lens`` [B] = the request's length including its S query tokens (whose keys are already in the
  cache), query token ``s`` sees positions ``[0, seq_lens[b] - S + 1 + s)``; with ``seq_lens`` [B, S] it sees
  ``[0, seq_lens[b, s])``. Lengths are clamped to ``[0, block_table.shape[1] * page_size]``.

Output: ``indices[b, s]`` = the logical positions of the ``topk`` highest scores in the live range (any order
here; the kernel returns them ascending); when the live range is not longer than ``topk``, every live position
``0 .. L-1`` in order, then -1.
"""

from __future__ import annotations

import torch

INDEX_DIM = 128
BYTES_PER_TOKEN = INDEX_DIM + 4  # 128 fp8 + one fp32 scale
FP8_MAX = 448.0


def quantize_index_k(k: torch.Tensor, page_size: int) -> torch.Tensor:
    """Pack keys ``k`` [num_pages * page_size, 128] (any float dtype) into the paged FP8 layout above.

    Returns uint8 [num_pages, page_size * 132]. The per-token scale is amax / 448 (fp32), as SGLang's indexer
    key quantization does (one scale per 128 values).
    """
    n = k.shape[0]
    if k.dim() != 2 or k.shape[1] != INDEX_DIM or n % page_size:
        raise ValueError(f"k must be [pages * page_size, {INDEX_DIM}], got {tuple(k.shape)}")
    pages = n // page_size
    kf = k.float().view(pages, page_size, INDEX_DIM)
    scale = (kf.abs().amax(-1) / FP8_MAX).clamp_min(1e-12)
    q8 = (kf / scale.unsqueeze(-1)).to(torch.float8_e4m3fn)
    out = torch.empty(pages, page_size * BYTES_PER_TOKEN, dtype=torch.uint8, device=k.device)
    out[:, : page_size * INDEX_DIM] = q8.view(torch.uint8).reshape(pages, page_size * INDEX_DIM)
    out[:, page_size * INDEX_DIM:] = scale.contiguous().view(torch.uint8).reshape(pages, page_size * 4)
    return out


def cache_fp8_and_scales(index_k_cache: torch.Tensor, page_size: int):
    """Split a cache (uint8 [pages, page_size * 132] or any byte view of it) into fp8 [pages, page_size, 128]
    and fp32 scales [pages, page_size]."""
    kc = index_k_cache.reshape(index_k_cache.shape[0], -1).view(torch.uint8)
    pages = kc.shape[0]
    k8 = kc[:, : page_size * INDEX_DIM].contiguous().view(torch.float8_e4m3fn).view(pages, page_size, INDEX_DIM)
    sc = kc[:, page_size * INDEX_DIM: page_size * BYTES_PER_TOKEN].contiguous().view(torch.float32)
    return k8, sc.view(pages, page_size)


def live_lengths(seq_lens: torch.Tensor, s: int, max_len: int) -> torch.Tensor:
    """Live length [B, S] (int64) of every query token, clamped to [0, max_len] (see the module docstring)."""
    if seq_lens.dim() == 2:
        lens = seq_lens.long()
    else:
        lens = seq_lens.long()[:, None] - s + 1 + torch.arange(s, device=seq_lens.device)[None, :]
    return lens.clamp(0, max_len)


def index_scores_ref(q, weights, index_k_cache, block_table, seq_lens, page_size=64, q_scale=None,
                     dtype=torch.float64, chunk=None):
    """Scores over the whole block table: [B, S, max_pages * page_size] in ``dtype``, -inf past each query
    token's live range.

    q: [B, S, H, 128] bf16 or float8_e4m3fn; weights: [B, S, H]; q_scale: optional [B, S, H] multiplied into
    the weights (fp8 query scales). ``chunk`` (tokens) bounds the dequantized-key temporaries for long block
    tables; the result is the same.
    """
    b, s, h, d = q.shape
    k8, ksc = cache_fp8_and_scales(index_k_cache, page_size)
    k8u = k8.view(torch.uint8)  # index on bytes: not every torch build indexes float8 tensors
    max_len = block_table.shape[1] * page_size
    acc = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype  # weighting / output dtype
    w = weights.to(acc)
    if q_scale is not None:
        w = w * q_scale.to(acc)
    qd = q.to(dtype)  # [B, S, H, D]
    lens = live_lengths(seq_lens, s, max_len)
    out = torch.empty(b, s, max_len, dtype=acc, device=q.device)
    step = chunk or max_len
    pos_all = torch.arange(max_len, device=q.device)
    for c0 in range(0, max_len, step):
        pos = pos_all[c0: c0 + step]
        pages = block_table[:, pos // page_size].long()  # [B, n]
        off = (pos % page_size)[None, :].expand_as(pages)
        kd = k8u[pages, off].view(torch.float8_e4m3fn).to(dtype)  # [B, n, D]
        logits = torch.einsum("bshd,bnd->bshn", qd, kd).to(acc)
        sc = (logits.clamp_min(0) * w[..., None]).sum(2) * ksc[pages, off].to(acc)[:, None, :]
        out[:, :, c0: c0 + step] = sc
    out.masked_fill_(pos_all[None, None, :] >= lens[:, :, None], float("-inf"))
    return out


def topk_from_scores_ref(scores: torch.Tensor, lengths: torch.Tensor, topk: int) -> torch.Tensor:
    """[..., W] scores + live lengths [...] -> [..., topk] int32: torch.topk over the live range (unordered),
    or 0..L-1 then -1 when L <= topk."""
    lead = scores.shape[:-1]
    sc = scores.reshape(-1, scores.shape[-1])
    ln = lengths.reshape(-1).long()
    out = torch.full((sc.shape[0], topk), -1, dtype=torch.int32, device=scores.device)
    ar = torch.arange(topk, device=scores.device)
    short = ln <= topk
    out[short] = torch.where(ar[None, :] < ln[short, None], ar[None, :], -1).to(torch.int32)
    if (~short).any():
        w = int(ln[~short].max())
        masked = sc[~short, :w].masked_fill(torch.arange(w, device=sc.device)[None, :] >= ln[~short, None],
                                            float("-inf"))
        out[~short] = masked.topk(topk, dim=-1).indices.to(torch.int32)
    return out.view(*lead, topk)


def dsa_indexer_topk_ref(q, weights, index_k_cache, block_table, seq_lens, topk=512, page_size=64, q_scale=None,
                         dtype=torch.float64, chunk=None):
    """Reference indices [B, S, topk] int32 (see the module docstring), by scoring the whole block table.

    Its work grows with the block table (max context), not with the live length.
    """
    sc = index_scores_ref(q, weights, index_k_cache, block_table, seq_lens, page_size, q_scale, dtype, chunk)
    lens = live_lengths(seq_lens, q.shape[1], block_table.shape[1] * page_size)
    return topk_from_scores_ref(sc, lens, topk)


def score_error_bound(q, weights, index_k_cache, block_table, page_size=64, q_scale=None):
    """Per-position bound [B, S, max_pages * page_size] (fp64) on the fp32-accumulation error of a kernel
    score: 2e-5 * scale_k * sum_h |w_h| * sum_d |q_hd k8_d|, well above the worst case of fp32 sums of 128
    products then 64 head terms ((128 + 64) * 2**-24 relative). Two positions whose reference scores differ by
    less than the sum of their bounds are a tie when comparing selected sets."""
    k8, ksc = cache_fp8_and_scales(index_k_cache, page_size)
    max_len = block_table.shape[1] * page_size
    pos = torch.arange(max_len, device=q.device)
    pages = block_table[:, pos // page_size].long()
    off = (pos % page_size)[None, :].expand_as(pages)
    ka = k8.view(torch.uint8)[pages, off].view(torch.float8_e4m3fn).to(torch.float64).abs()  # [B, n, D]
    wa = weights.to(torch.float64).abs()
    if q_scale is not None:
        wa = wa * q_scale.to(torch.float64).abs()
    mag = torch.einsum("bshd,bnd->bshn", q.to(torch.float64).abs(), ka)
    mag = (mag * wa[..., None]).sum(2) * ksc[pages, off].to(torch.float64).abs()[:, None, :]
    return 2e-5 * mag


def dsa_indexer_topk_naive(q, weights, key_buffer, seq_lens, topk=512, page_size=64):
    """The naive GPU baseline of the anchor in docs/design.md (an indexer that ignores the live length): every query
    token is scored against one whole key buffer of max-context tokens, then masked past its live length, then
    torch.topk.

    key_buffer: the index-key layout above, [pages, page_size * 132], read as one sequence: position i is token i
    of the buffer (max_len = pages * page_size), shared by all B requests. Per call: the fp8 keys are dequantized to
    bf16 once ([max_len, 128]), ``[B*S*H, 128] x [128, max_len]`` logits come from one bf16 tensor-core matmul, relu,
    the per-head weights are applied by a bf16 batched matmul ([B*S, 1, H] x [B*S, H, max_len]), then the key
    scales, the mask and the top-k. q: [B, S, H, 128] bf16; weights [B, S, H]; seq_lens as in
    ``dsa_indexer_topk``. Returns int32 [B, S, topk] like ``dsa_indexer_topk_ref`` (short rows 0 .. L-1, then -1).
    No host syncs, so it can be captured in a CUDA graph; its work grows with max_len, not the live length.
    """
    b, s, h, d = q.shape
    k8, ksc = cache_fp8_and_scales(key_buffer, page_size)
    max_len = k8.shape[0] * page_size
    kd = k8.reshape(max_len, d).to(torch.bfloat16)
    logits = torch.matmul(q.reshape(b * s * h, d).to(torch.bfloat16), kd.t()).relu_()  # [B*S*H, max_len]
    sc = torch.bmm(weights.reshape(b * s, 1, h).to(torch.bfloat16), logits.view(b * s, h, max_len))
    sc = sc.view(b, s, max_len).float() * ksc.reshape(1, 1, max_len)
    lens = live_lengths(seq_lens, s, max_len)
    sc.masked_fill_(torch.arange(max_len, device=q.device) >= lens[..., None], float("-inf"))
    k = min(topk, max_len)
    top = sc.topk(k, dim=-1).indices.to(torch.int32)
    if k < topk:
        top = torch.cat([top, top.new_full((*top.shape[:-1], topk - k), -1)], -1)
    ar = torch.arange(topk, device=q.device)
    short = torch.where(ar < lens[..., None], ar, -1).to(torch.int32)
    return torch.where((lens <= topk)[..., None], short, top)
