"""The sparse-MLA decode kernels: the original [BLOCK_N, 512]-tile kernel, the chunked and software-pipelined ones
(8 column chunks of 64), and ``_combine_kernel``, which merges the topk splits' partial outputs. Contracts in the
package docstring; helpers in ``jit_helpers``."""

from __future__ import annotations

import triton
import triton.language as tl

from .jit_helpers import (
    _deq_chunk,
    _deq_scaled,
    _finish,
    _gather_chunk,
    _load_tile,
    _program_ids,
    _program_start,
    _pv_step,
    _raw_chunk,
    _rope_chunk,
    _round_bf16,
    _softmax_step,
    _split_range,
    _store_result,
    _zero_state,
)


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

    _store_result(a0, a1, a2, a3, a4, a5, a6, a7, m_i, l_i, sink_ptr, offs_h, pid_bs, pid_sp, b, s, S, H,
                  n_splits_total, split_offset, out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, HAS_SINK, DIRECT, DOT_F32)




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

    _store_result(a0, a1, a2, a3, a4, a5, a6, a7, m_i, l_i, sink_ptr, offs_h, pid_bs, pid_sp, b, s, S, H,
                  n_splits_total, split_offset, out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, HAS_SINK, DIRECT, DOT_F32)


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

