"""Head-batched sparse-MLA decode on the DeepSeek-V4 FP8 paged KV cache (Triton; sm_120a and sm_90a).

``sparse_mla_decode(q, k_cache, indices, ...) -> (out, lse)`` is a drop-in for FlashMLA's sparse decode
(``flash_mla_with_kvcache(q, k_cache, None, None, 512, meta, indices=..., topk_length=..., attn_sink=...,
extra_k_cache=..., extra_indices_in_kvcache=..., extra_topk_length=...)``). The KV layout, the softmax scale
default (1/sqrt(512)), the sink (``out *= 1 / (1 + exp(sink - lse))``, lse without the sink) and the lse
units (natural log; +inf and out = 0 for a row with no usable token) are documented in
``pd.kernels.sparse_mla_reference``, the fp64 torch reference.

Kernel: one program per (batch * query token, block of BLOCK_H >= 16 heads, topk split). It walks its share
of the selected tokens BLOCK_N at a time: gathers the 584-byte records of the tile once, dequantizes them to a
[BLOCK_N, 512] bf16 tile (fp8 nope * 2**(e - 127), bf16 rope), and does S = Q K^T and O += P K with ``tl.dot``
for all BLOCK_H heads at once (MLA: K = V = the 512-wide latent), with an online softmax in base 2. When
(batch * query tokens * head blocks) is too small to fill the GPU the topk is split across programs, each
writing a normalized partial output and its lse, and ``_combine_kernel`` merges them by log-sum-exp (the extra
cache is just more splits), launched as a programmatic dependent of the split kernel on compute capability >= 9
(COMBINE_PDL). Work past ``topk_length`` is skipped, not masked.

``_sparse_mla_fwd_chunked_kernel`` handles the 512 columns as 8 chunks of 64 (no [N, 512] fp32 tile);
``_sparse_mla_fwd_pipelined_kernel`` is the same math with every load inside the loop, so Triton's software
pipeliner gathers the next tiles' records with cp.async into shared memory while this tile is computed, and
dequantizes fp8 by bit moves in inline PTX (_E4M3_BITS_ASM, see _deq_scaled for why that also keeps the loads
pipelined). The default path runs the pipelined kernel for 16-head programs (mma.sync; sm_120 and sm_90) and,
on sm_90 only, for 64-head programs (64-row dots lower to wgmma; 165 KiB shared memory): DEFAULT_CONFIG_SM90,
picked at run time from the device capability. sm_120's configs (DEFAULT_CONFIG, CONFIGS_PIPELINED, CONFIGS)
fit 99 KiB.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from .device_info import check_runnable, is_sm90, num_sms
from .sparse_mla_reference import BYTES_PER_TOKEN, D_QK, page_stride_bytes

LOG2E = 1.4426950408889634
SUPPORTED_PAGE_SIZES = (64, 256)
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _round_bf16(x):
    """fp32 -> the nearest bf16 value (ties to even), kept in fp32. The Triton 3.9 interpreter truncates in
    ``x.to(tl.bfloat16)`` (the GPU rounds to nearest), so interpreter runs round explicitly first."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _load_tile(kc8_ptr, kc16_ptr, idx_row, n, end, page_stride, cols, PAGE_SIZE: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """Gather the raw bytes of BLOCK_N selected tokens: (valid [N], fp8 bytes [N, 512] (cols >= 448 zero),
    UE8M0 scale byte per column [N, 512], rope int16 [N, 64])."""
    offs_n = n + tl.arange(0, BLOCK_N)
    tok = tl.load(idx_row + offs_n, mask=offs_n < end, other=-1)
    valid = tok >= 0
    tok = tl.where(valid, tok, 0)
    page = (tok // PAGE_SIZE).to(tl.int64)
    off = tok % PAGE_SIZE
    page_base = page * page_stride
    tok_base = page_base + off * 576
    sc_base = page_base + PAGE_SIZE * 576 + off * 8
    m_nope = valid[:, None] & (cols < 448)[None, :]
    raw = tl.load(kc8_ptr + tok_base[:, None] + cols[None, :], mask=m_nope, other=0)
    # 8 scale bytes per token (7 + pad), loaded once and broadcast over their 64 columns each; the pad
    # (column block 7, which multiplies the zero padding of the nope tile) reads as 2**0.
    s8 = tl.arange(0, 8)
    sc8 = tl.load(kc8_ptr + sc_base[:, None] + s8[None, :], mask=valid[:, None] & (s8 < 7)[None, :], other=127)
    sc = tl.reshape(tl.broadcast_to(sc8[:, :, None], [BLOCK_N, 8, 64]), [BLOCK_N, 512])
    r = tl.arange(0, 64)
    rope = tl.load(kc16_ptr + (tok_base // 2 + 224)[:, None] + r[None, :], mask=valid[:, None], other=0)
    return valid, raw, sc, rope


@triton.jit
def _split_range(len_ptr, b, pid_sp, chunk, TOPK, HAS_LEN: tl.constexpr):
    """[start, end) of this program's share of the selected tokens: its split, cut at topk_length."""
    if HAS_LEN:
        n_valid = tl.minimum(tl.load(len_ptr + b), TOPK)
    else:
        n_valid = TOPK
    start = pid_sp * chunk
    return start, tl.minimum(start + chunk, n_valid)


@triton.jit
def _softmax_step(qk, valid, m_i, l_i, DOT_F32: tl.constexpr):
    """One online-softmax step in base 2 over a [BLOCK_H, BLOCK_N] score tile (invalid columns masked):
    -> (P for the PV dot, rounded to bf16 as FlashMLA does; alpha, the rescale of the running
    accumulators; the new running max and sum)."""
    qk = tl.where(valid[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(qk - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if DOT_F32:
        p = _round_bf16(p)
    else:
        p = p.to(tl.bfloat16)
    return p, alpha, m_new, l_i


@triton.jit
def _finish(m_i, l_i, sink_ptr, offs_h, HAS_SINK: tl.constexpr, DIRECT: tl.constexpr):
    """-> (empty rows, safe divisor, lse in natural log (-inf when empty), sink factor f (1/(1+exp(sink-lse)),
    only meaningful when DIRECT and HAS_SINK; the combine kernel applies it otherwise))."""
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) / 1.4426950408889634)
    f = l_safe
    if DIRECT:
        if HAS_SINK:
            sink = tl.load(sink_ptr + offs_h)
            f = 1.0 / (1.0 + tl.exp(sink - lse))
    return empty, l_safe, lse, f


@triton.jit
def _program_ids(S, PDL: tl.constexpr, BLOCK_H: tl.constexpr):
    """A program's place in the grid (batch * query token, head block, topk split): returns (pid_bs, pid_sp, b, s,
    offs_h [BLOCK_H] int32). With PDL it first lets the combine launch's programs be placed (they wait for this
    grid's partials with gdc_wait)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    pid_bs = tl.program_id(0)
    pid_h = tl.program_id(1)
    pid_sp = tl.program_id(2)
    b = pid_bs // S
    s = pid_bs % S
    return pid_bs, pid_sp, b, s, pid_h * BLOCK_H + tl.arange(0, BLOCK_H)


@triton.jit
def _sparse_mla_fwd_kernel(
    q_ptr, kc8_ptr, kc16_ptr, idx_ptr, len_ptr, sink_ptr,
    out_ptr, lse_ptr, part_o_ptr, part_lse_ptr,
    sm_scale_log2, page_stride, S, H, TOPK, chunk, split_offset, n_splits_total,
    stride_qb, stride_qs, stride_qh, grid_bucket,  # grid_bucket: autotune key only (log2 of the grid)
    HAS_LEN: tl.constexpr, HAS_SINK: tl.constexpr, DIRECT: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
    DOT_PREC: tl.constexpr = "tf32", PDL: tl.constexpr = False,
):
    pid_bs, pid_sp, b, s, offs_h = _program_ids(S, PDL, BLOCK_H)
    cols = tl.arange(0, 512)
    rcols = tl.arange(0, 64)
    q_row = q_ptr + b.to(tl.int64) * stride_qb + s * stride_qs + offs_h[:, None] * stride_qh
    # nope part zero-padded to 512 columns (tl.dot wants powers of two), rope part [BLOCK_H, 64]
    q = tl.load(q_row + cols[None, :], mask=(cols < 448)[None, :], other=0.0)
    q_r = tl.load(q_row + 448 + rcols[None, :])
    if DOT_F32:
        q = q.to(tl.float32)
        q_r = q_r.to(tl.float32)

    start, end = _split_range(len_ptr, b, pid_sp, chunk, TOPK, HAS_LEN)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, 512], tl.float32)
    acc_r = tl.zeros([BLOCK_H, 64], tl.float32)
    idx_row = idx_ptr + pid_bs.to(tl.int64) * TOPK
    # Software pipeline by hand: the gathers of tile n + BLOCK_N are in flight while tile n is computed.
    valid, raw, sc, rope = _load_tile(kc8_ptr, kc16_ptr, idx_row, start, end, page_stride, cols,
                                      PAGE_SIZE, BLOCK_N)
    for n in range(start, end, BLOCK_N):
        cur_valid = valid
        nope_f = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        scale_f = (sc.to(tl.int32) << 23).to(tl.float32, bitcast=True)
        k = nope_f * scale_f
        k_r = rope.to(tl.bfloat16, bitcast=True)
        if DOT_F32:
            k = k.to(tl.bfloat16).to(tl.float32)
            k_r = k_r.to(tl.float32)
        else:
            k = k.to(tl.bfloat16)
        valid, raw, sc, rope = _load_tile(kc8_ptr, kc16_ptr, idx_row, n + BLOCK_N, end, page_stride, cols,
                                          PAGE_SIZE, BLOCK_N)

        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
        qk = tl.dot(q_r, tl.trans(k_r), qk, input_precision=DOT_PREC) * sm_scale_log2
        p, alpha, m_i, l_i = _softmax_step(qk, cur_valid, m_i, l_i, DOT_F32)
        acc = acc * alpha[:, None] + tl.dot(p, k, input_precision=DOT_PREC)
        acc_r = acc_r * alpha[:, None] + tl.dot(p, k_r, input_precision=DOT_PREC)

    empty, l_safe, lse, f = _finish(m_i, l_i, sink_ptr, offs_h, HAS_SINK, DIRECT)
    o = acc / l_safe[:, None]
    o_r = acc_r / l_safe[:, None]
    if DIRECT:
        if HAS_SINK:
            o = o * f[:, None]
            o_r = o_r * f[:, None]
        o = tl.where(empty[:, None], 0.0, o)
        o_r = tl.where(empty[:, None], 0.0, o_r)
        if DOT_F32:
            o = _round_bf16(o)
            o_r = _round_bf16(o_r)
        out_row = out_ptr + ((pid_bs.to(tl.int64) * H + offs_h) * 512)[:, None]
        tl.store(out_row + cols[None, :], o.to(tl.bfloat16), mask=(cols < 448)[None, :])
        tl.store(out_row + 448 + rcols[None, :], o_r.to(tl.bfloat16))
        tl.store(lse_ptr + (b * H + offs_h) * S + s, tl.where(empty, float("inf"), lse))
    else:
        slot = (pid_bs.to(tl.int64) * H + offs_h) * n_splits_total + split_offset + pid_sp
        tl.store(part_o_ptr + (slot * 512)[:, None] + cols[None, :], o, mask=(cols < 448)[None, :])
        tl.store(part_o_ptr + (slot * 512 + 448)[:, None] + rcols[None, :], o_r)
        tl.store(part_lse_ptr + slot, lse)


@triton.jit
def _raw_chunk(kc8_ptr, tok_base, sc_base, valid, C: tl.constexpr):
    """Issue the loads of nope columns [64 C, 64 C + 64) of BLOCK_N gathered tokens: (fp8 bytes [BLOCK_N, 64],
    UE8M0 scale byte [BLOCK_N]). Kept apart from the dequantization so a tile's loads all go out at once."""
    c64 = tl.arange(0, 64)
    raw = tl.load(kc8_ptr + (tok_base + C * 64)[:, None] + c64[None, :], mask=valid[:, None], other=0)
    sc = tl.load(kc8_ptr + sc_base + C, mask=valid, other=127)
    return raw, sc


@triton.jit
def _deq_chunk(raw, sc, DOT_F32: tl.constexpr):
    """fp8 e4m3 bytes [BLOCK_N, 64] * 2**(UE8M0 scale byte - 127) -> bf16 (fp32 under the interpreter),
    exact in bf16."""
    scale = (sc.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    k = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, None]
    if DOT_F32:
        return k.to(tl.bfloat16).to(tl.float32)
    return k.to(tl.bfloat16)


@triton.jit
def _rope_chunk(kc16_ptr, tok_base, valid, DOT_F32: tl.constexpr):
    r = tl.arange(0, 64)
    k = tl.load(kc16_ptr + (tok_base // 2 + 224)[:, None] + r[None, :], mask=valid[:, None], other=0)
    k = k.to(tl.bfloat16, bitcast=True)
    if DOT_F32:
        return k.to(tl.float32)
    return k


@triton.jit
def _q_chunk(q_row, C: tl.constexpr, DOT_F32: tl.constexpr):
    q = tl.load(q_row + C * 64 + tl.arange(0, 64)[None, :])
    if DOT_F32:
        return q.to(tl.float32)
    return q


@triton.jit
def _store_chunk(acc, l_safe, f, empty, C: tl.constexpr, out_row, part_row,
                 HAS_SINK: tl.constexpr, DIRECT: tl.constexpr, DOT_F32: tl.constexpr):
    c64 = tl.arange(0, 64)
    o = acc / l_safe[:, None]
    if DIRECT:
        if HAS_SINK:
            o = o * f[:, None]
        o = tl.where(empty[:, None], 0.0, o)
        if DOT_F32:
            o = _round_bf16(o)
        tl.store(out_row + C * 64 + c64[None, :], o.to(tl.bfloat16))
    else:
        tl.store(part_row + C * 64 + c64[None, :], o)


@triton.jit
def _q_chunks(q_row, DOT_F32: tl.constexpr):
    """The query rows of one program as the 8 column chunks the chunked kernels multiply: 8 x [BLOCK_H, 64]."""
    return (_q_chunk(q_row, 0, DOT_F32), _q_chunk(q_row, 1, DOT_F32), _q_chunk(q_row, 2, DOT_F32), _q_chunk(q_row, 3, DOT_F32),
            _q_chunk(q_row, 4, DOT_F32), _q_chunk(q_row, 5, DOT_F32), _q_chunk(q_row, 6, DOT_F32), _q_chunk(q_row, 7, DOT_F32))


@triton.jit
def _program_start(q_ptr, len_ptr, idx_ptr, S, TOPK, chunk, stride_qb, stride_qs, stride_qh, HAS_LEN: tl.constexpr,
                   PDL: tl.constexpr, BLOCK_H: tl.constexpr, DOT_F32: tl.constexpr):
    """What a chunked / pipelined program owns (grid: batch * query token, head block, topk split): returns
    (pid_bs, pid_sp, b, s, offs_h [BLOCK_H], its index row pointer, its topk range start, end, and its query rows
    as 8 x [BLOCK_H, 64] chunks). With PDL it first releases the combine launch (programmatic dependent launch)."""
    pid_bs, pid_sp, b, s, offs_h = _program_ids(S, PDL, BLOCK_H)
    q_row = q_ptr + b.to(tl.int64) * stride_qb + s * stride_qs + offs_h[:, None] * stride_qh
    q0, q1, q2, q3, q4, q5, q6, q7 = _q_chunks(q_row, DOT_F32)
    start, end = _split_range(len_ptr, b, pid_sp, chunk, TOPK, HAS_LEN)
    idx_row = idx_ptr + pid_bs.to(tl.int64) * TOPK
    return pid_bs, pid_sp, b, s, offs_h, idx_row, start, end, q0, q1, q2, q3, q4, q5, q6, q7


@triton.jit
def _zero_state(BLOCK_H: tl.constexpr):
    """Online-softmax state before the first tile: running max -inf, sum 0, 8 zero [BLOCK_H, 64] fp32 accumulators."""
    return (tl.full([BLOCK_H], float("-inf"), tl.float32), tl.zeros([BLOCK_H], tl.float32),
            tl.zeros([BLOCK_H, 64], tl.float32),
            tl.zeros([BLOCK_H, 64], tl.float32),
            tl.zeros([BLOCK_H, 64], tl.float32),
            tl.zeros([BLOCK_H, 64], tl.float32),
            tl.zeros([BLOCK_H, 64], tl.float32),
            tl.zeros([BLOCK_H, 64], tl.float32),
            tl.zeros([BLOCK_H, 64], tl.float32),
            tl.zeros([BLOCK_H, 64], tl.float32))


@triton.jit
def _pv_step(p, alpha, k0, k1, k2, k3, k4, k5, k6, k7, a0, a1, a2, a3, a4, a5, a6, a7, DOT_PREC: tl.constexpr):
    """acc_c = acc_c * alpha + P @ K_c for the 8 column chunks (V is the latent K: MLA's shared 512 columns)."""
    a0 = tl.dot(p, k0, a0 * alpha[:, None], input_precision=DOT_PREC)
    a1 = tl.dot(p, k1, a1 * alpha[:, None], input_precision=DOT_PREC)
    a2 = tl.dot(p, k2, a2 * alpha[:, None], input_precision=DOT_PREC)
    a3 = tl.dot(p, k3, a3 * alpha[:, None], input_precision=DOT_PREC)
    a4 = tl.dot(p, k4, a4 * alpha[:, None], input_precision=DOT_PREC)
    a5 = tl.dot(p, k5, a5 * alpha[:, None], input_precision=DOT_PREC)
    a6 = tl.dot(p, k6, a6 * alpha[:, None], input_precision=DOT_PREC)
    a7 = tl.dot(p, k7, a7 * alpha[:, None], input_precision=DOT_PREC)
    return a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def _store_result(a0, a1, a2, a3, a4, a5, a6, a7, m_i, l_i, sink_ptr, offs_h, pid_bs, pid_sp, b, s, S, H, n_splits_total, split_offset,
                  out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, HAS_SINK: tl.constexpr, DIRECT: tl.constexpr,
                  DOT_F32: tl.constexpr):
    """Normalize and store a program's 8 accumulator chunks and its lse: to out / lse (DIRECT, one split) or to the
    split's partial slots for _combine_kernel."""
    empty, l_safe, lse, f = _finish(m_i, l_i, sink_ptr, offs_h, HAS_SINK, DIRECT)
    out_row = out_ptr + ((pid_bs.to(tl.int64) * H + offs_h) * 512)[:, None]
    slot = (pid_bs.to(tl.int64) * H + offs_h) * n_splits_total + split_offset + pid_sp
    part_row = part_o_ptr + (slot * 512)[:, None]
    _store_chunk(a0, l_safe, f, empty, 0, out_row, part_row, HAS_SINK, DIRECT, DOT_F32)
    _store_chunk(a1, l_safe, f, empty, 1, out_row, part_row, HAS_SINK, DIRECT, DOT_F32)
    _store_chunk(a2, l_safe, f, empty, 2, out_row, part_row, HAS_SINK, DIRECT, DOT_F32)
    _store_chunk(a3, l_safe, f, empty, 3, out_row, part_row, HAS_SINK, DIRECT, DOT_F32)
    _store_chunk(a4, l_safe, f, empty, 4, out_row, part_row, HAS_SINK, DIRECT, DOT_F32)
    _store_chunk(a5, l_safe, f, empty, 5, out_row, part_row, HAS_SINK, DIRECT, DOT_F32)
    _store_chunk(a6, l_safe, f, empty, 6, out_row, part_row, HAS_SINK, DIRECT, DOT_F32)
    _store_chunk(a7, l_safe, f, empty, 7, out_row, part_row, HAS_SINK, DIRECT, DOT_F32)
    if DIRECT:
        tl.store(lse_ptr + (b * H + offs_h) * S + s, tl.where(empty, float("inf"), lse))
    else:
        tl.store(part_lse_ptr + slot, lse)


@triton.jit
def _sparse_mla_fwd_chunked_kernel(
    q_ptr, kc8_ptr, kc16_ptr, idx_ptr, len_ptr, sink_ptr,
    out_ptr, lse_ptr, part_o_ptr, part_lse_ptr,
    sm_scale_log2, page_stride, S, H, TOPK, chunk, split_offset, n_splits_total,
    stride_qb, stride_qs, stride_qh, grid_bucket,
    HAS_LEN: tl.constexpr, HAS_SINK: tl.constexpr, DIRECT: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
    DOT_PREC: tl.constexpr = "tf32", PDL: tl.constexpr = False,
):
    """Same contract as _sparse_mla_fwd_kernel, but the 512 columns are handled as 8 chunks of 64 (7 fp8 nope
    chunks with one scale each + the bf16 rope chunk): no zero padding, no [N, 512] fp32 tile, eight
    [BLOCK_H, 64] accumulators. With BLOCK_H = 64 the dots have 64 rows, so on sm_90 Triton lowers them to wgmma
    (the default there for 64-head programs, DEFAULT_CONFIG_SM90); on sm_120 they stay mma.sync."""
    pid_bs, pid_sp, b, s, offs_h, idx_row, start, end, q0, q1, q2, q3, q4, q5, q6, q7 = _program_start(
        q_ptr, len_ptr, idx_ptr, S, TOPK, chunk, stride_qb, stride_qs, stride_qh, HAS_LEN, PDL, BLOCK_H, DOT_F32)
    m_i, l_i, a0, a1, a2, a3, a4, a5, a6, a7 = _zero_state(BLOCK_H)
    # Latency, not bandwidth, bounds this loop: every global round trip (index list, then the gathered
    # records) costs ~1 us. So the next tile's indices are fetched one tile ahead, and all of a tile's loads
    # (7 nope chunks + scales + rope) are issued before its first dot: the shared-memory barrier each dot
    # needs would otherwise serialize one round trip per chunk.
    offs_n = start + tl.arange(0, BLOCK_N)
    tok_next = tl.load(idx_row + offs_n, mask=offs_n < end, other=-1)
    for n in range(start, end, BLOCK_N):
        tok = tok_next
        offs_n = n + BLOCK_N + tl.arange(0, BLOCK_N)
        tok_next = tl.load(idx_row + offs_n, mask=offs_n < end, other=-1)
        valid = tok >= 0
        tok = tl.where(valid, tok, 0)
        page_base = (tok // PAGE_SIZE).to(tl.int64) * page_stride
        off = tok % PAGE_SIZE
        tok_base = page_base + off * 576
        sc_base = page_base + PAGE_SIZE * 576 + off * 8
        r0, s0 = _raw_chunk(kc8_ptr, tok_base, sc_base, valid, 0)
        r1, s1 = _raw_chunk(kc8_ptr, tok_base, sc_base, valid, 1)
        r2, s2 = _raw_chunk(kc8_ptr, tok_base, sc_base, valid, 2)
        r3, s3 = _raw_chunk(kc8_ptr, tok_base, sc_base, valid, 3)
        r4, s4 = _raw_chunk(kc8_ptr, tok_base, sc_base, valid, 4)
        r5, s5 = _raw_chunk(kc8_ptr, tok_base, sc_base, valid, 5)
        r6, s6 = _raw_chunk(kc8_ptr, tok_base, sc_base, valid, 6)
        k7 = _rope_chunk(kc16_ptr, tok_base, valid, DOT_F32)
        k0 = _deq_chunk(r0, s0, DOT_F32)
        qk = tl.dot(q0, tl.trans(k0), input_precision=DOT_PREC)
        k1 = _deq_chunk(r1, s1, DOT_F32)
        qk = tl.dot(q1, tl.trans(k1), qk, input_precision=DOT_PREC)
        k2 = _deq_chunk(r2, s2, DOT_F32)
        qk = tl.dot(q2, tl.trans(k2), qk, input_precision=DOT_PREC)
        k3 = _deq_chunk(r3, s3, DOT_F32)
        qk = tl.dot(q3, tl.trans(k3), qk, input_precision=DOT_PREC)
        k4 = _deq_chunk(r4, s4, DOT_F32)
        qk = tl.dot(q4, tl.trans(k4), qk, input_precision=DOT_PREC)
        k5 = _deq_chunk(r5, s5, DOT_F32)
        qk = tl.dot(q5, tl.trans(k5), qk, input_precision=DOT_PREC)
        k6 = _deq_chunk(r6, s6, DOT_F32)
        qk = tl.dot(q6, tl.trans(k6), qk, input_precision=DOT_PREC)
        qk = tl.dot(q7, tl.trans(k7), qk, input_precision=DOT_PREC) * sm_scale_log2

        p, alpha, m_i, l_i = _softmax_step(qk, valid, m_i, l_i, DOT_F32)
        a0, a1, a2, a3, a4, a5, a6, a7 = _pv_step(p, alpha, k0, k1, k2, k3, k4, k5, k6, k7,
                                 a0, a1, a2, a3, a4, a5, a6, a7, DOT_PREC)

    _store_result(a0, a1, a2, a3, a4, a5, a6, a7, m_i, l_i, sink_ptr, offs_h, pid_bs, pid_sp, b, s, S, H, n_splits_total,
                  split_offset, out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, HAS_SINK, DIRECT, DOT_F32)


@triton.jit
def _gather_chunk(kc8_ptr, tok_base, valid, C: tl.constexpr):
    """fp8 bytes of nope columns [64 C, 64 C + 64) of BLOCK_N gathered tokens, [BLOCK_N, 64] uint8: 64 contiguous
    bytes per token, 16-byte aligned, so the pipeliner turns the load into cp.async (16-byte vectors)."""
    c64 = tl.arange(0, 64)
    return tl.load(kc8_ptr + (tok_base + C * 64)[:, None] + c64[None, :], mask=valid[:, None], other=0)


@triton.jit
def _chunk_scale(sc8, C: tl.constexpr):
    """UE8M0 scale of nope chunk C, byte C of each token's 8 scale bytes (int64 [BLOCK_N]) -> 2**(byte - 127)
    as fp32 [BLOCK_N]."""
    e = ((sc8 >> (8 * C)) & 255).to(tl.int32)
    return (e << 23).to(tl.float32, bitcast=True)


@triton.jit
def _to_dot(x, DOT_F32: tl.constexpr):
    """fp32 values that are exact in bf16 -> the dot operand dtype (bf16; fp32 under the interpreter)."""
    if DOT_F32:
        return x.to(tl.bfloat16).to(tl.float32)
    return x.to(tl.bfloat16)


# e4m3 -> bf16 by bit moves (PTX legal on sm_90 and sm_120: prmt/shl/and and mul.rn.bf16x2). A byte
# s e3..e0 m2..m0 whose sign lands on bf16 bit 15 and e3..e0 m2..m0 on bits 10..4 is the bf16 with exponent field e
# (bias 127 instead of e4m3's 7) and the same mantissa: exactly value * 2**-120, e4m3 subnormals (e = 0) included
# as bf16 subnormals.
# Two bf16 multiplies apply the UE8M0 scale 2**(s - 127) exactly: by 2**(min(s, 134) - 7) (a normal bf16 for every
# s), then by 2**(max(s, 134) - 134) (1 unless s > 134); the first product is exact whenever the second is not 1.
# prmt 0x9180 / 0xB3A2 spread bytes 0, 1 / 2, 3 into 16-bit lanes [byte, sign-replicated byte], so (y << 4) puts the
# sign (bit 3 of the replicated byte) on bit 15 and the byte's low 7 bits on 10..4; 0x87F087F0 keeps those bits of
# both lanes (bit 11, the byte's own sign, and what lane 0 shifts into lane 1 are dropped). The e4m3 NaN codes
# 0x7F / 0xFF (never written by a quantizer, which saturates at +-448) would read as +-480.
_E4M3_BITS_ASM = tl.constexpr("""
{
.reg .b32 y, v, t;
prmt.b32 y, $2, 0, 0x9180;
shl.b32 v, y, 4;
and.b32 v, v, 0x87F087F0;
mul.rn.bf16x2 t, v, $3;
mul.rn.bf16x2 $0, t, $5;
prmt.b32 y, $2, 0, 0xB3A2;
shl.b32 v, y, 4;
and.b32 v, v, 0x87F087F0;
mul.rn.bf16x2 t, v, $4;
mul.rn.bf16x2 $1, t, $6;
}
""")


@triton.jit
def _deq_scaled(raw, sc8, C: tl.constexpr, DOT_F32: tl.constexpr):
    """Dequantize chunk C: fp8 e4m3 bytes [BLOCK_N, 64] * 2**(byte C of the token's 8 scale bytes - 127) -> bf16
    (fp32 under the interpreter, which runs no inline asm: there by fp8 -> fp32 conversion and an fp32 multiply).

    On the GPU by the bit moves of _E4M3_BITS_ASM, as one inline-asm op marked impure. That is not about side
    effects: Triton hoists the dot-operand layout conversions above pure elementwise ops up to the load, which
    then has two users in two register layouts (QK^T and PV read the tile differently), and the software
    pipeliner leaves such a load synchronous (measured on 16-head programs: the 7 nope chunks, 77% of the bytes,
    were plain loads waited on in every tile, and each chunk was dequantized twice). With the conversion pinned
    in the load's layout, the records are cp.async-pipelined into shared memory, dequantized once, stored once,
    and both dots read that one copy."""
    if DOT_F32:
        return _to_dot(raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * _chunk_scale(sc8, C)[:, None], DOT_F32)
    e = ((sc8 >> (8 * C)) & 255).to(tl.int32)
    f1 = ((tl.minimum(e, 134) + 120) << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)
    f2 = ((tl.maximum(e, 134) - 7) << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)
    f1 = tl.broadcast_to(f1[:, None], raw.shape)
    f2 = tl.broadcast_to(f2[:, None], raw.shape)
    return tl.inline_asm_elementwise(_E4M3_BITS_ASM, "=r,=r,r,r,r,r,r", [raw, f1, f2], tl.bfloat16,
                                     is_pure=False, pack=4)


@triton.jit
def _sparse_mla_fwd_pipelined_kernel(
    q_ptr, kc8_ptr, kc16_ptr, idx_ptr, len_ptr, sink_ptr,
    out_ptr, lse_ptr, part_o_ptr, part_lse_ptr,
    sm_scale_log2, page_stride, S, H, TOPK, chunk, split_offset, n_splits_total,
    stride_qb, stride_qs, stride_qh, grid_bucket,
    HAS_LEN: tl.constexpr, HAS_SINK: tl.constexpr, DIRECT: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
    DOT_PREC: tl.constexpr = "tf32", LOOP_STAGES: tl.constexpr = 3, PDL: tl.constexpr = False,
):
    """Same contract and column chunking as _sparse_mla_fwd_chunked_kernel, but every load of a tile (index
    list, 7 nope chunks, the 8 scale bytes as one int64, the rope chunk) is written inside the loop with no
    hand prefetch, so Triton's software pipeliner (``tl.range(num_stages=LOOP_STAGES)``) issues them as
    cp.async into shared memory LOOP_STAGES - 1 tiles ahead: the next tiles' gathered records are in flight
    while this tile is dequantized and multiplied (with 3 stages the index list is fetched a stage earlier than
    the records it addresses). Raw bytes wait in shared memory, not registers, so the accumulators keep theirs."""
    pid_bs, pid_sp, b, s, offs_h, idx_row, start, end, q0, q1, q2, q3, q4, q5, q6, q7 = _program_start(
        q_ptr, len_ptr, idx_ptr, S, TOPK, chunk, stride_qb, stride_qs, stride_qh, HAS_LEN, PDL, BLOCK_H, DOT_F32)
    m_i, l_i, a0, a1, a2, a3, a4, a5, a6, a7 = _zero_state(BLOCK_H)
    # the 8 scale bytes of a token (7 UE8M0 + pad) are 8-byte aligned: one int64 load per token
    kc64_ptr = kc8_ptr.to(tl.pointer_type(tl.int64))
    r64 = tl.arange(0, 64)
    for n in tl.range(start, end, BLOCK_N, num_stages=LOOP_STAGES):
        offs_n = n + tl.arange(0, BLOCK_N)
        tok = tl.load(idx_row + offs_n, mask=offs_n < end, other=-1)
        valid = tok >= 0
        tok = tl.where(valid, tok, 0)
        page_base = (tok // PAGE_SIZE).to(tl.int64) * page_stride
        off = tok % PAGE_SIZE
        tok_base = page_base + off * 576
        sc8 = tl.load(kc64_ptr + (page_base + PAGE_SIZE * 576 + off * 8) // 8, mask=valid,
                      other=0x7F7F7F7F7F7F7F7F)
        r0 = _gather_chunk(kc8_ptr, tok_base, valid, 0)
        r1 = _gather_chunk(kc8_ptr, tok_base, valid, 1)
        r2 = _gather_chunk(kc8_ptr, tok_base, valid, 2)
        r3 = _gather_chunk(kc8_ptr, tok_base, valid, 3)
        r4 = _gather_chunk(kc8_ptr, tok_base, valid, 4)
        r5 = _gather_chunk(kc8_ptr, tok_base, valid, 5)
        r6 = _gather_chunk(kc8_ptr, tok_base, valid, 6)
        rope = tl.load(kc16_ptr + (tok_base // 2 + 224)[:, None] + r64[None, :], mask=valid[:, None], other=0)
        k7 = rope.to(tl.bfloat16, bitcast=True)
        if DOT_F32:
            k7 = k7.to(tl.float32)
        # all of a tile's K chunks are dequantized before its first dot (fewer live values than interleaving:
        # 64-head programs on sm_90a spill 4 bytes instead of 112, ptxas -v)
        k0 = _deq_scaled(r0, sc8, 0, DOT_F32)
        k1 = _deq_scaled(r1, sc8, 1, DOT_F32)
        k2 = _deq_scaled(r2, sc8, 2, DOT_F32)
        k3 = _deq_scaled(r3, sc8, 3, DOT_F32)
        k4 = _deq_scaled(r4, sc8, 4, DOT_F32)
        k5 = _deq_scaled(r5, sc8, 5, DOT_F32)
        k6 = _deq_scaled(r6, sc8, 6, DOT_F32)
        qk = tl.dot(q0, tl.trans(k0), input_precision=DOT_PREC)
        qk = tl.dot(q1, tl.trans(k1), qk, input_precision=DOT_PREC)
        qk = tl.dot(q2, tl.trans(k2), qk, input_precision=DOT_PREC)
        qk = tl.dot(q3, tl.trans(k3), qk, input_precision=DOT_PREC)
        qk = tl.dot(q4, tl.trans(k4), qk, input_precision=DOT_PREC)
        qk = tl.dot(q5, tl.trans(k5), qk, input_precision=DOT_PREC)
        qk = tl.dot(q6, tl.trans(k6), qk, input_precision=DOT_PREC)
        qk = tl.dot(q7, tl.trans(k7), qk, input_precision=DOT_PREC) * sm_scale_log2

        p, alpha, m_i, l_i = _softmax_step(qk, valid, m_i, l_i, DOT_F32)
        a0, a1, a2, a3, a4, a5, a6, a7 = _pv_step(p, alpha, k0, k1, k2, k3, k4, k5, k6, k7,
                                 a0, a1, a2, a3, a4, a5, a6, a7, DOT_PREC)

    _store_result(a0, a1, a2, a3, a4, a5, a6, a7, m_i, l_i, sink_ptr, offs_h, pid_bs, pid_sp, b, s, S, H, n_splits_total,
                  split_offset, out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, HAS_SINK, DIRECT, DOT_F32)


@triton.jit
def _combine_kernel(
    part_o_ptr, part_lse_ptr, sink_ptr, out_ptr, lse_ptr, S, H, n_splits,
    HAS_SINK: tl.constexpr, SPLITS_P2: tl.constexpr, ROUND: tl.constexpr, PDL: tl.constexpr = False,
):
    """Merge the topk splits' partial outputs of one (batch * query token, head) row by log-sum-exp: lse = log sum_j
    exp(lse_j), out = sum_j exp(lse_j - lse) * o_j, times the sink factor 1 / (1 + exp(sink - lse)); out = 0 and lse
    = +inf for a row with no usable token. With PDL (launched as a programmatic dependent of the split kernel) its
    programs start while the split programs run and wait (griddepcontrol.wait) until that grid has finished and its
    partials are visible."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0)  # (b * S + s) * H + h
    h = pid % H
    bs = pid // H
    b = bs // S
    s = bs % S
    offs = tl.arange(0, SPLITS_P2)
    msk = offs < n_splits
    base = pid.to(tl.int64) * n_splits
    lse_p = tl.load(part_lse_ptr + base + offs, mask=msk, other=float("-inf"))
    m = tl.max(lse_p, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse_p - m_safe)
    tot = tl.sum(w, 0)
    empty = tot == 0.0
    tot_safe = tl.where(empty, 1.0, tot)
    cols = tl.arange(0, 512)
    po = tl.load(part_o_ptr + (base + offs)[:, None] * 512 + cols[None, :], mask=msk[:, None], other=0.0)
    o = tl.sum(po * (w / tot_safe)[:, None], 0)
    lse = m_safe + tl.log(tot_safe)
    if HAS_SINK:
        sink = tl.load(sink_ptr + h)
        o = o / (1.0 + tl.exp(sink - lse))
    o = tl.where(empty, 0.0, o)
    if ROUND:
        o = _round_bf16(o)
    tl.store(out_ptr + pid.to(tl.int64) * 512 + cols, o.to(tl.bfloat16))
    tl.store(lse_ptr + (b * H + h) * S + s, tl.where(empty, float("inf"), lse))


# Autotune configs per heads-per-program. Each fits sm_120's 99 KiB of shared memory (tests check it): the
# q tile (BLOCK_H x 576 bf16) plus operand copies of the dequantized KV tile (BLOCK_N x 576 bf16).
CONFIGS = {
    16: [triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=1) for bn in (16, 32) for w in (4, 8)],
    32: [triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=1) for bn in (16, 32) for w in (4, 8)],
    64: [triton.Config({"BLOCK_N": 16}, num_warps=4, num_stages=1)],  # 8 warps: 128 KiB on sm_120
}
_TUNED = {
    bh: triton.autotune(configs=cfgs, key=["PAGE_SIZE", "DIRECT", "HAS_LEN", "HAS_SINK", "grid_bucket"])(_sparse_mla_fwd_kernel)
    for bh, cfgs in CONFIGS.items()
}

def _cache_view(name, k_cache):
    """Validate a cache and return (uint8 view, int16 view, page_size, page_stride_bytes)."""
    if not isinstance(k_cache, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(k_cache).__name__}")
    if k_cache.dtype not in (torch.uint8, torch.int8, torch.float8_e4m3fn):
        raise ValueError(f"{name} must be uint8, int8 or float8_e4m3fn bytes (DSv4 FP8 layout), got {k_cache.dtype}")
    if k_cache.dim() == 4:
        pages, page_size, hk, bpt = k_cache.shape
        if hk != 1 or bpt != BYTES_PER_TOKEN:
            raise ValueError(f"{name} must be (pages, page_size, 1, {BYTES_PER_TOKEN}), got {tuple(k_cache.shape)}")
        if page_size not in SUPPORTED_PAGE_SIZES:
            raise ValueError(f"{name} page_size must be one of {SUPPORTED_PAGE_SIZES}, got {page_size}")
        want = page_stride_bytes(page_size)
        if pages > 1 and k_cache.stride(0) != want:
            raise ValueError(f"{name} page stride must be {want} bytes for page_size {page_size}, got {k_cache.stride(0)}")
        if k_cache.stride(3) != 1 or k_cache.stride(1) != BYTES_PER_TOKEN:
            raise ValueError(f"{name} must be a view of the packed page buffer (token stride 584, byte stride 1)")
        stride = want
    elif k_cache.dim() == 2:
        stride = k_cache.shape[1]
        sizes = {page_stride_bytes(p): p for p in SUPPORTED_PAGE_SIZES}
        if stride not in sizes or not k_cache.is_contiguous():
            raise ValueError(
                f"{name} as a 2-D byte buffer must be contiguous (pages, page_stride) with page_stride in "
                f"{sorted(sizes)} (page_size 64/256), got {tuple(k_cache.shape)}"
            )
        page_size = sizes[stride]
    else:
        raise ValueError(f"{name} must be 4-D (pages, page_size, 1, 584) or 2-D (pages, page_stride), got {k_cache.dim()}-D")
    if k_cache.data_ptr() % 16:
        raise ValueError(f"{name} must be 16-byte aligned")
    u8 = k_cache.view(torch.uint8)
    i16 = u8.view(torch.int16)
    return u8, i16, page_size, stride


def _check_indices(name, indices, b, s, device):
    if not isinstance(indices, torch.Tensor) or indices.dtype != torch.int32:
        raise ValueError(f"{name} must be an int32 tensor [B, S, topk]")
    if indices.dim() != 3 or indices.shape[0] != b or indices.shape[1] != s or indices.shape[2] < 1:
        raise ValueError(f"{name} must have shape [{b}, {s}, topk>=1], got {tuple(indices.shape)}")
    if not indices.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if indices.device != device:
        raise ValueError(f"{name} must be on {device}, got {indices.device}")


def _check_len(name, t, b, device):
    if t is None:
        return
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.shape != (b,) or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous int32 tensor of shape [{b}]")
    if t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")


def _pick_block_h(b: int, s: int, h: int, sm90: bool = False) -> int:
    """Heads per program. Measured on an H200 (benchmarks/results/sparse_mla_decode_2026-11-29.json): 32 heads
    per program wins once the grid has >= 16 (batch * query token * head block) programs, 16 below that and
    for H = 16; 64 heads (one 4-warp config fits sm_120's shared memory) was never the fastest there. On sm_90
    only, 64 heads per program with the chunked kernel (DEFAULT_CONFIG_SM90: 64 rows, so Triton emits wgmma)
    wins from 16 (batch * query token * 64-head block) programs up."""
    if sm90 and h % 64 == 0 and b * s * (h // 64) >= 16:
        return 64
    if h % 32 == 0 and b * s * (h // 32) >= 16:
        return 32
    return 16


# Default tile config per heads-per-program (the H200 sweeps' best; ``autotune=True`` searches CONFIGS with the
# original kernel). ``CHUNKED`` selects _sparse_mla_fwd_chunked_kernel, ``PIPELINE: n`` the software-pipelined
# _sparse_mla_fwd_pipelined_kernel with n loop stages (n >= 5: the gathered records are fetched two tiles ahead
# in two shared-memory buffers; 3: one tile ahead, one buffer; the index list one stage before its records).
# The pipelined kernel keeps a tile's raw records (cp.async buffers) and its dequantized chunks in shared memory:
# 63.5 KiB for 32-token 3-stage programs, 82 KiB for 5 stages, 111 KiB for 64-token tiles (sm_90 only).
# 16-head programs on sm_120: 32-token tiles, 4 warps, 3 stages (unmeasured there; on the H200 8.1 us at H=16 B=1
# and 9.0 at B=16, against 7.6 / 8.8 for sm_90's 64-token default; benchmarks/results/*-s4).
DEFAULT_CONFIG = {
    16: {"BLOCK_N": 32, "num_warps": 4, "num_stages": 1, "PIPELINE": 3},
    32: {"BLOCK_N": 32, "num_warps": 8, "num_stages": 1},
    64: {"BLOCK_N": 16, "num_warps": 4, "num_stages": 1},
}
# 16-head programs once a grid has more than 32 (batch * query token * head block) rows: 4-warp programs (~186
# registers, 82 KiB), two per SM on sm_90, so the default split count doubles. Same-run H200 A/B (s4, topk 512):
# H=16 B=64 19.0 us vs 20.9 for 3 stages and 21.1 for three per SM (168-register cap), B=128 29.2 vs 33.3-34.6.
TWO_PER_SM_CONFIG_16 = {"BLOCK_N": 32, "num_warps": 4, "num_stages": 1, "PIPELINE": 5, "PROGRAMS_PER_SM": 2}
# sm_90 (Hopper) only: configs needing more than sm_120's 99 KiB of shared memory. 64-head programs lower to wgmma
# there (165 KiB); 16-head programs with 64-token tiles (111 KiB) are sm_90's default up to 32 rows (H=16 B=1
# 7.5 us, B=16 8.8).
DEFAULT_CONFIG_SM90 = {**DEFAULT_CONFIG, 16: {"BLOCK_N": 64, "num_warps": 8, "num_stages": 1, "PIPELINE": 3},
                       64: {"BLOCK_N": 64, "num_warps": 8, "num_stages": 1, "PIPELINE": 3}}
CONFIGS_SM90 = {16: [DEFAULT_CONFIG_SM90[16]],
                64: [{"BLOCK_N": 64, "num_warps": 8, "num_stages": 1, "PIPELINE": 3},
                     {"BLOCK_N": 64, "num_warps": 8, "num_stages": 1, "PIPELINE": 5},
                     {"BLOCK_N": 64, "num_warps": 8, "num_stages": 1, "CHUNKED": True},
                     {"BLOCK_N": 32, "num_warps": 8, "num_stages": 1, "CHUNKED": True}]}
# Pipelined configs that sm_120 may run (each fits its 99 KiB of shared memory; tests compile them all).
CONFIGS_PIPELINED = {16: [DEFAULT_CONFIG[16], TWO_PER_SM_CONFIG_16]}


def _default_config(block_h: int, rows: int, sm90: bool) -> dict:
    """The launch config of the default path for ``rows`` = batch * query tokens * head blocks programs."""
    if block_h == 16 and rows > 32:
        return TWO_PER_SM_CONFIG_16
    return (DEFAULT_CONFIG_SM90 if sm90 else DEFAULT_CONFIG)[block_h]


# Launch _combine_kernel with programmatic dependent launch (compute capability >= 9): its programs are placed on
# the SMs while the split programs run and wait there (griddepcontrol.wait), so the second launch's start-up overlaps
# the first's tail. H200 same-run A/B (s4b, topk 512): H=16 B=1 / 16 / 64 / 128 7.1 / 8.4 / 18.9 / 28.5 us vs 7.5 /
# 8.9 / 19.2 / 29.2 without, H=64 B=1 / 64 7.2 / 39.0 vs 7.7 / 39.5 (B=16: 18.5 vs 18.3); the -s4b results run vs the
# s4 kernel: 7.0 / 8.6 / 18.7 / 28.2 vs 7.6 / 8.9 / 19.0 / 29.1 (benchmarks/results/*-s4b). Merging inside the split
# kernel instead (the row's last split program, elected by an atomic ticket, reads the other splits' partials from
# L2) was slower: 23.8 us at H=16 B=64, 58 at H=64 B=16 (the unrolled merge raised registers to 213-255 with spills,
# and one program per row did the whole merge serially after the others finished).
COMBINE_PDL = True


def sparse_mla_decode(
    q,
    k_cache,
    indices,
    topk_length=None,
    attn_sink=None,
    softmax_scale=None,
    extra_k_cache=None,
    extra_indices=None,
    extra_topk_length=None,
    *,
    block_h=None,
    num_splits=None,
    config=None,
    autotune=False,
):
    """Sparse-MLA decode; see the module docstring. Returns (out [B,S,H,512] bf16, lse [B,H,S] fp32).

    Keyword-only tuning knobs (benchmarks/tests): ``block_h`` (16/32/64 heads per program), ``num_splits``
    (topk splits of the main cache; default: enough programs to fill every SM's program slots once),
    ``config`` (a dict {"BLOCK_N", "num_warps", "num_stages"} plus optional "CHUNKED": True for the chunked
    kernel or "PIPELINE": loop stages for the pipelined one, and "PROGRAMS_PER_SM" for the default split count;
    default ``_default_config``: DEFAULT_CONFIG[block_h], on sm_90 DEFAULT_CONFIG_SM90[block_h], and
    TWO_PER_SM_CONFIG_16 for 16-head programs on grids of more than 32 rows), ``autotune`` (search
    CONFIGS[block_h] with triton.autotune instead; not CUDA-graph-capturable on first use). The default path launches a fixed config, so it is capturable.
    """
    if not isinstance(q, torch.Tensor) or q.dtype != torch.bfloat16 or q.dim() != 4 or q.shape[-1] != D_QK:
        raise ValueError(f"q must be a bfloat16 tensor [B, S, H, {D_QK}], got "
                         f"{getattr(q, 'dtype', type(q).__name__)} {tuple(getattr(q, 'shape', ()))}")
    b, s, h, _ = q.shape
    if h % 16 or not 16 <= h <= 128:
        raise ValueError(f"q: number of heads must be a multiple of 16 in [16, 128], got {h}")
    if q.stride(-1) != 1 or q.stride(2) != D_QK:
        raise ValueError("q must have contiguous heads and head dim (stride(2) == 512, stride(3) == 1)")
    dev = q.device
    kc8, kc16, page_size, page_stride = _cache_view("k_cache", k_cache)
    if k_cache.device != dev:
        raise ValueError(f"k_cache must be on {dev}, got {k_cache.device}")
    _check_indices("indices", indices, b, s, dev)
    _check_len("topk_length", topk_length, b, dev)
    if attn_sink is not None:
        if not isinstance(attn_sink, torch.Tensor) or attn_sink.dtype != torch.float32 or attn_sink.shape != (h,) \
                or not attn_sink.is_contiguous() or attn_sink.device != dev:
            raise ValueError(f"attn_sink must be a contiguous float32 tensor of shape [{h}] on {dev}")
    if softmax_scale is None:
        softmax_scale = D_QK ** -0.5
    if not isinstance(softmax_scale, (int, float)) or not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale must be a positive finite float, got {softmax_scale!r}")
    has_extra = extra_k_cache is not None
    if has_extra:
        ekc8, ekc16, epage_size, epage_stride = _cache_view("extra_k_cache", extra_k_cache)
        if extra_k_cache.device != dev:
            raise ValueError(f"extra_k_cache must be on {dev}, got {extra_k_cache.device}")
        if extra_indices is None:
            raise ValueError("extra_indices is required with extra_k_cache")
        _check_indices("extra_indices", extra_indices, b, s, dev)
        _check_len("extra_topk_length", extra_topk_length, b, dev)
    elif extra_indices is not None or extra_topk_length is not None:
        raise ValueError("extra_indices / extra_topk_length given without extra_k_cache")
    if block_h is None:
        block_h = _pick_block_h(b, s, h, is_sm90(dev))
    if block_h not in (16, 32, 64) or h % block_h:
        raise ValueError(f"block_h must be 16, 32 or 64 and divide H={h}, got {block_h}")

    topk = indices.shape[2]
    n_hb = h // block_h
    base = b * s * n_hb
    if _INTERPRET:
        cfg = dict(config or DEFAULT_CONFIG[block_h], BLOCK_N=16, num_warps=4, num_stages=1)
    else:
        cfg = config or _default_config(block_h, base, is_sm90(dev))
    if num_splits is None:
        # enough (batch * query token * head block * split) programs to fill every program slot once
        slots = num_sms(dev) * cfg.get("PROGRAMS_PER_SM", 1)
        num_splits = max(1, (slots + base // 2) // base)
    chunk = max(64, triton.cdiv(triton.cdiv(topk, max(1, num_splits)), 64) * 64)
    ns_main = triton.cdiv(topk, chunk)
    jobs = [(kc8, kc16, page_size, page_stride, indices, topk_length, chunk, ns_main, 0)]
    ns_total = ns_main
    if has_extra:
        etopk = extra_indices.shape[2]
        echunk = max(64, triton.cdiv(triton.cdiv(etopk, max(1, num_splits)), 64) * 64)
        ens = triton.cdiv(etopk, echunk)
        jobs.append((ekc8, ekc16, epage_size, epage_stride, extra_indices, extra_topk_length, echunk, ens, ns_total))
        ns_total += ens
    direct = ns_total == 1

    check_runnable("q", q, "pd.kernels.sparse_mla_reference")  # after every argument check: they name bad input
    out = torch.empty(b, s, h, D_QK, dtype=torch.bfloat16, device=dev)
    lse = torch.empty(b, h, s, dtype=torch.float32, device=dev)
    if direct:
        part_o = part_lse = out  # unused
    else:
        part_o = torch.empty(b * s * h * ns_total, D_QK, dtype=torch.float32, device=dev)
        part_lse = torch.empty(b * s * h * ns_total, dtype=torch.float32, device=dev)
    sink = attn_sink if attn_sink is not None else lse
    sm_scale_log2 = float(softmax_scale) * LOG2E
    # the autotuned kernel objects are launched without the PDL constant, so their combine is a plain launch
    pdl = (not direct and COMBINE_PDL and not _INTERPRET and dev.type == "cuda" and not (autotune and config is None)
           and torch.cuda.get_device_capability(dev)[0] >= 9)
    for c8, c16, ps, pstride, idx, tl_len, ch, ns, soff in jobs:
        args = (q, c8, c16, idx, tl_len if tl_len is not None else idx, sink, out, lse, part_o, part_lse,
                sm_scale_log2, pstride, s, h, idx.shape[2], ch, soff, ns_total,
                q.stride(0), q.stride(1), q.stride(2), (b * s * n_hb * ns).bit_length())
        consts = dict(HAS_LEN=tl_len is not None, HAS_SINK=attn_sink is not None, DIRECT=direct,
                      PAGE_SIZE=ps, BLOCK_H=block_h, DOT_F32=_INTERPRET,
                      DOT_PREC="ieee" if _INTERPRET else "tf32")
        grid = (b * s, n_hb, ns)
        if autotune and not _INTERPRET and config is None:
            _TUNED[block_h][grid](*args, **consts)
        else:
            # the launch right before a PDL combine (the extra cache's, when there is one) releases it early
            consts["PDL"] = pdl and soff + ns == ns_total
            if cfg.get("PIPELINE"):
                _sparse_mla_fwd_pipelined_kernel[grid](*args, **consts, BLOCK_N=cfg["BLOCK_N"],
                                                       LOOP_STAGES=cfg["PIPELINE"], num_warps=cfg["num_warps"],
                                                       num_stages=cfg["num_stages"])
            elif cfg.get("CHUNKED", False):
                _sparse_mla_fwd_chunked_kernel[grid](*args, **consts, BLOCK_N=cfg["BLOCK_N"],
                                                     num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
            else:
                _sparse_mla_fwd_kernel[grid](*args, **consts, BLOCK_N=cfg["BLOCK_N"], num_warps=cfg["num_warps"],
                                             num_stages=cfg["num_stages"])
    if not direct:
        _combine_kernel[(b * s * h,)](part_o, part_lse, sink, out, lse, s, h, ns_total,
                                      HAS_SINK=attn_sink is not None,
                                      SPLITS_P2=triton.next_power_of_2(ns_total), ROUND=_INTERPRET,
                                      PDL=pdl, num_warps=4, **({"launch_pdl": True} if pdl else {}))
    return out, lse
