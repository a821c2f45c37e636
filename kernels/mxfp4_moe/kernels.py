"""The ``@triton.jit`` kernels of the MXFP4 MoE (see the package docstring) and the Triton types of the GEMM kernels'
runtime arguments."""

from __future__ import annotations

import triton
import triton.language as tl

from .jit_helpers import (
    _acc_init,
    _acc_out,
    _load_s_stage,
    _mx_step,
    _next_stage,
    _prefetch_rows,
    _prefetch_span,
    _rne_bf16,
    _rows_of,
    _s_ptrs,
    _s_step,
    _swiglu_bf16,
    _w_elems,
    _w_ptrs,
    _w_step,
    _x_cols,
    _x_stage,
    _x_step,
)
from .ptx import PF_LINE


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, blk_exp_ptr, nblk_ptr, cursor_ptr, P, max_rows, E,
                  E_BINS: tl.constexpr, BM: tl.constexpr, CHUNK: tl.constexpr):
    """Group the P (token, slot) pairs by expert: rows [BM b, BM b + BM) of ``sorted`` hold pair ids of expert
    ``blk_exp[b]`` (padding = P); ``nblk`` = number of blocks. Ids outside [0, E) are dropped."""
    bins = tl.arange(0, E_BINS)
    cnt = tl.zeros([E_BINS], tl.int32)
    for s in range(0, P, CHUNK):
        offs = s + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < P, other=-1).to(tl.int32)
        ok = (offs < P) & (ids >= 0) & (ids < E)
        cnt += tl.histogram(tl.where(ok, ids, E_BINS - 1), E_BINS)
    cnt = tl.where(bins < E, cnt, 0)  # bin E_BINS - 1 >= E collects the dropped pairs
    nb = (cnt + BM - 1) // BM
    start = tl.cumsum(nb, 0) - nb
    tl.store(nblk_ptr, tl.sum(nb, 0))
    tl.store(cursor_ptr + bins, start * BM)
    for s in range(0, max_rows, CHUNK):
        offs = s + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + offs, tl.full([CHUNK], 0, tl.int32) + P, mask=offs < max_rows)
    tl.debug_barrier()  # cursors and padding visible to every thread before the scatter
    for s in range(0, P, CHUNK):
        offs = s + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < P, other=-1).to(tl.int32)
        ok = (offs < P) & (ids >= 0) & (ids < E)
        pos = tl.atomic_add(cursor_ptr + tl.where(ok, ids, 0), 1, mask=ok)
        tl.store(sorted_ptr + pos, offs, mask=ok)
        tl.store(blk_exp_ptr + pos // BM, ids, mask=ok)


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, s_ptr, ids_ptr, sorted_ptr, blk_exp_ptr, nblk_ptr, h_ptr, part_ptr, tick_ptr, w2_ptr, s2_ptr,
    stride_xt, limit, P, E,
    H: tl.constexpr, I: tl.constexpr, TOPK: tl.constexpr, SORTED: tl.constexpr, HAS_LIMIT: tl.constexpr,
    UP_FIRST: tl.constexpr, SPLIT: tl.constexpr, HALVES: tl.constexpr, ROUND: tl.constexpr, BM: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr, BKD: tl.constexpr, DEQ: tl.constexpr, WL: tl.constexpr = 0,
    PF: tl.constexpr = 0, FOLD: tl.constexpr = False, PDL: tl.constexpr = False, XS: tl.constexpr = 0,
):
    """Program (row block, BN columns, K split). Fused (HALVES False): BN intermediate columns, gate and up rows
    both; with SPLIT == 1 it writes h[pair] = SwiGLU (bf16). Otherwise it writes fp32 partial sums of its K
    range to part[pid_k, pair, 0:I] (gate) / [I:2I] (up) for ``_swiglu_kernel``; with HALVES each program
    covers BN of the 2 I rows of w13 (one accumulator: half the registers, more programs). Each loop iteration
    (one cp.async pipeline stage) covers BK of K as BK / BKD separate loads + dequantize + dot steps: the
    converted weights of only BKD columns are live at a time (BK 256 as one step: 247 registers, as two steps of
    128: 142, so 6 instead of 4 blocks per SM on sm_90).
    PF 1: the program first prefetches all its weight rows (and scales) of its K range into L2, so every load is
    in flight at once (the pipeline keeps only 2-3 stages); PF 2 (pair paths): also its 1 / (programs per pair)
    slice of the pair's expert's down weights and scales (w2_ptr, s2_ptr), evict_last, for the down launch.
    FOLD (pair path, SPLIT > 1 or HALVES): the last of the 2 SPLIT (HALVES) or SPLIT programs of a (pair, BN
    columns) group to finish (acq_rel ticket in tick_ptr[pair * I / BN + column block], reset by that program)
    sums the group's partials in split order and writes h = SwiGLU itself, as ``_swiglu_kernel`` would (same
    arithmetic, same order: identical bits). PDL 1: releases the programmatic dependent launch of the next kernel
    at the end of its K loop (the down programs may take free SM slots once every program here has got there);
    PDL 2: at the start of the program, so when this grid fits one wave the down programs fill the SM slots it
    leaves free from the start (there they wait, or prefetch their weights into L2 with ``prefetch_down``)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    if PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()
    e, rows, rmask, active = _rows_of(pid_m, ids_ptr, sorted_ptr, blk_exp_ptr, nblk_ptr, P, E, SORTED, BM)
    if active:
        tok = (rows // TOPK).to(tl.int64)
        e64 = e.to(tl.int64)
        k0 = pid_k * (H // SPLIT)
        if PF >= 1:  # this program's weight rows and scales over its K range, into L2
            if HALVES:
                pf_rows = pid_n * BN + tl.arange(0, BN)
            else:
                pf_rows = tl.join(pid_n * BN + tl.arange(0, BN), pid_n * BN + tl.arange(0, BN) + I)
            pf_rows = pf_rows.to(tl.int64) + e64 * (2 * I)
            _prefetch_rows(w_ptr + pf_rows * (H // 2) + k0 // 2, H // SPLIT // 2, False)
            _prefetch_rows(s_ptr + pf_rows * (H // 32) + k0 // 32, H // SPLIT // 32, False)
        if PF >= 2:  # a slice of this expert's down weights and scales, for the down launch
            n_q = tl.num_programs(1) * SPLIT
            q = pid_n * SPLIT + pid_k
            W2B: tl.constexpr = H * (I // 2)
            S2B: tl.constexpr = H * (I // 32)
            per_w = tl.cdiv(tl.cdiv(W2B, n_q), PF_LINE) * PF_LINE
            per_s = tl.cdiv(tl.cdiv(S2B, n_q), PF_LINE) * PF_LINE
            w_lo = tl.minimum(q * per_w, W2B)
            s_lo = tl.minimum(q * per_s, S2B)
            _prefetch_span(w2_ptr + e64 * W2B + w_lo, tl.minimum(per_w, W2B - w_lo), True, 128)
            _prefetch_span(s2_ptr + e64 * S2B + s_lo, tl.minimum(per_s, S2B - s_lo), True, 128)
        WV: tl.constexpr = 2 if WL == 0 else 4  # values per weight element
        w_base = _w_elems(w_ptr, WL) + e64 * (2 * I * (H // WV))
        if WL < 2:
            w_base += k0 // WV
        SK: tl.constexpr = 32  # K per scale byte
        s_base = s_ptr + e64 * (2 * I * (H // SK))
        if WL < 2:
            s_base += k0 // SK
        kb = tl.arange(0, BKD // WV)
        ALIGNED: tl.constexpr = BK % 256 == 0 and (H // SPLIT) % 256 == 0  # WL >= 2: stages start tiles
        ks = tl.arange(0, (BK if XS == 3 else BKD) // SK)  # XS 3: a stage's scales in one load
        x_ptrs = x_ptr + tok[:, None] * stride_xt + k0 + _x_cols(BK if XS >= 2 else BKD, WL, XS)[None, :]
        r64 = rows.to(tl.int64)[:, None]
        if HALVES:
            w_row = pid_n * BN + tl.arange(0, BN)
            w_ptrs = _w_ptrs(w_base, w_row, H // WV, kb, WL)
            sc_ptrs = _s_ptrs(s_base, w_row, H // SK, ks, WL)
            acc = _acc_init(BM, BN, WL)
            for it in range(0, H // SPLIT // BK):
                m = k0 // WV + it * (BK // WV)  # the stage's first element of a row (WL >= 2)
                g = k0 // SK + it * (BK // SK)  # and its first scale column (WL 2)
                xa, xb = _x_stage(x_ptrs, rmask[:, None], BK, BKD, XS)
                if XS == 3:
                    sca, scb = _load_s_stage(_s_step(sc_ptrs, g, 0, ks, WL, ALIGNED), BN, BK, BKD)
                for j in tl.static_range(BK // BKD):
                    x0, x1, x2, x3 = _x_step(xa, xb, x_ptrs, rmask[:, None], j, XS, BKD, WL)
                    if XS == 3:
                        sc = sca if j == 0 else scb
                    else:
                        sc = tl.load(_s_step(sc_ptrs, g, j * (BKD // SK), ks, WL, ALIGNED))
                    w = tl.load(_w_step(w_ptrs, m, j * (BKD // WV), WL, BKD // WV, ALIGNED))
                    acc = _mx_step(acc, x0, x1, x2, x3, w, sc, DEQ, WL, BM, BN, BKD)
                x_ptrs += BK
                w_ptrs = _next_stage(w_ptrs, BK // WV, WL)
                sc_ptrs = _next_stage(sc_ptrs, BK // SK, WL)
            if PDL == 1:  # after the K loop: released at the start of a grid of several waves, the down programs
                tl.extra.cuda.gdc_launch_dependents()  # crowd onto the SMs freed first and run slower there
            acc = _acc_out(acc, WL)
            if UP_FIRST:  # part keeps [gate | up]
                col = (w_row + I) % (2 * I)
            else:
                col = w_row
            tl.store(part_ptr + (pid_k * P + r64) * (2 * I) + col[None, :], acc, mask=rmask[:, None])
            if FOLD:
                _fold_swiglu(part_ptr, h_ptr, tick_ptr, pid_m, pid_n % (I // BN), limit, P, I, BN, 2 * SPLIT,
                             SPLIT, HAS_LIMIT, ROUND)
        else:
            offs_n = pid_n * BN + tl.arange(0, BN)
            if UP_FIRST:
                g_row = offs_n + I
                u_row = offs_n
            else:
                g_row = offs_n
                u_row = offs_n + I
            wg_ptrs = _w_ptrs(w_base, g_row, H // WV, kb, WL)
            wu_ptrs = _w_ptrs(w_base, u_row, H // WV, kb, WL)
            sg_ptrs = _s_ptrs(s_base, g_row, H // SK, ks, WL)
            su_ptrs = _s_ptrs(s_base, u_row, H // SK, ks, WL)
            acc_g = _acc_init(BM, BN, WL)
            acc_u = _acc_init(BM, BN, WL)
            for it in range(0, H // SPLIT // BK):
                m = k0 // WV + it * (BK // WV)
                g = k0 // SK + it * (BK // SK)
                xa, xb = _x_stage(x_ptrs, rmask[:, None], BK, BKD, XS)
                if XS == 3:
                    sga, sgb = _load_s_stage(_s_step(sg_ptrs, g, 0, ks, WL, ALIGNED), BN, BK, BKD)
                    sua, sub = _load_s_stage(_s_step(su_ptrs, g, 0, ks, WL, ALIGNED), BN, BK, BKD)
                for j in tl.static_range(BK // BKD):
                    x0, x1, x2, x3 = _x_step(xa, xb, x_ptrs, rmask[:, None], j, XS, BKD, WL)
                    wg = tl.load(_w_step(wg_ptrs, m, j * (BKD // WV), WL, BKD // WV, ALIGNED))
                    wu = tl.load(_w_step(wu_ptrs, m, j * (BKD // WV), WL, BKD // WV, ALIGNED))
                    if XS == 3:
                        sg = sga if j == 0 else sgb
                        su = sua if j == 0 else sub
                    else:
                        sg = tl.load(_s_step(sg_ptrs, g, j * (BKD // SK), ks, WL, ALIGNED))
                        su = tl.load(_s_step(su_ptrs, g, j * (BKD // SK), ks, WL, ALIGNED))
                    acc_g = _mx_step(acc_g, x0, x1, x2, x3, wg, sg, DEQ, WL, BM, BN, BKD)
                    acc_u = _mx_step(acc_u, x0, x1, x2, x3, wu, su, DEQ, WL, BM, BN, BKD)
                x_ptrs += BK
                wg_ptrs = _next_stage(wg_ptrs, BK // WV, WL)
                wu_ptrs = _next_stage(wu_ptrs, BK // WV, WL)
                sg_ptrs = _next_stage(sg_ptrs, BK // SK, WL)
                su_ptrs = _next_stage(su_ptrs, BK // SK, WL)
            if PDL == 1:
                tl.extra.cuda.gdc_launch_dependents()
            acc_g = _acc_out(acc_g, WL)
            acc_u = _acc_out(acc_u, WL)
            if SPLIT == 1:
                hv = _swiglu_bf16(acc_g, acc_u, limit, HAS_LIMIT, ROUND)
                tl.store(h_ptr + r64 * I + offs_n[None, :], hv.to(tl.bfloat16), mask=rmask[:, None])
            else:
                part = part_ptr + (pid_k * P + r64) * (2 * I) + offs_n[None, :]
                tl.store(part, acc_g, mask=rmask[:, None])
                tl.store(part + I, acc_u, mask=rmask[:, None])
                if FOLD:
                    _fold_swiglu(part_ptr, h_ptr, tick_ptr, pid_m, pid_n, limit, P, I, BN, SPLIT, SPLIT, HAS_LIMIT,
                                 ROUND)


@triton.jit
def _fold_swiglu(part_ptr, h_ptr, tick_ptr, pair, cb, limit, P, I: tl.constexpr, BN: tl.constexpr,
                 ARRIVALS: tl.constexpr, SPLIT: tl.constexpr, HAS_LIMIT: tl.constexpr, ROUND: tl.constexpr):
    """Ticket fold of ``_swiglu_kernel`` into the gate/up programs (pair paths): called by each of the ARRIVALS
    programs of (pair, column block cb) after storing its partials; the last one writes h[pair, cb BN : cb BN + BN]
    from the SPLIT partial rows (summed in split order, as _swiglu_kernel does) and resets the ticket."""
    tl.debug_barrier()  # every thread's partial stores are issued before the release
    tick = tick_ptr + pair * (I // BN) + cb
    if tl.atomic_add(tick, 1, sem="acq_rel") == ARRIVALS - 1:
        tl.store(tick, 0)  # for the next call
        offs = cb * BN + tl.arange(0, BN)
        g = tl.zeros([BN], tl.float32)
        u = tl.zeros([BN], tl.float32)
        for s in tl.static_range(SPLIT):
            row = part_ptr + (s * P + pair).to(tl.int64) * (2 * I)
            g += tl.load(row + offs, cache_modifier=".cg")
            u += tl.load(row + I + offs, cache_modifier=".cg")
        hv = _swiglu_bf16(g, u, limit, HAS_LIMIT, ROUND)
        tl.store(h_ptr + pair.to(tl.int64) * I + offs, hv.to(tl.bfloat16))


@triton.jit
def _swiglu_kernel(part_ptr, ids_ptr, h_ptr, limit, P, E, I: tl.constexpr, SPLIT: tl.constexpr,
                   HAS_LIMIT: tl.constexpr, ROUND: tl.constexpr, BLOCK: tl.constexpr):
    """h[pair] = SwiGLU of the K-split partial sums (summed in split order: deterministic)."""
    pair = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(ids_ptr + pair).to(tl.int32)
    if (e >= 0) & (e < E):
        g = tl.zeros([BLOCK], tl.float32)
        u = tl.zeros([BLOCK], tl.float32)
        for s in tl.static_range(SPLIT):
            row = part_ptr + (s * P + pair).to(tl.int64) * (2 * I)
            g += tl.load(row + offs)
            u += tl.load(row + I + offs)
        hv = _swiglu_bf16(g, u, limit, HAS_LIMIT, ROUND)
        tl.store(h_ptr + pair.to(tl.int64) * I + offs, hv.to(tl.bfloat16))


@triton.jit
def _down_tile(h_ptr, w_base, s_base, rows, rmask, offs_n, k0, KLEN: tl.constexpr, I: tl.constexpr,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BKD: tl.constexpr, DEQ: tl.constexpr,
               WL: tl.constexpr, XS: tl.constexpr = 0):
    """[BM, BN] fp32 = h[rows, k0:k0+KLEN] @ W_down[expert][offs_n, k0:k0+KLEN]^T (BK of K per loop iteration,
    in BK / BKD dequantize + dot steps, as in _gate_up_kernel)."""
    WV: tl.constexpr = 2 if WL == 0 else 4  # values per weight element
    kb = tl.arange(0, BKD // WV)
    ALIGNED: tl.constexpr = BK % 256 == 0 and KLEN % 256 == 0  # WL >= 2: stages start tiles (k0 a multiple of KLEN)
    SK: tl.constexpr = 32  # K per scale byte
    ks = tl.arange(0, (BK if XS == 3 else BKD) // SK)  # XS 3: a stage's scales in one load
    if WL >= 2:
        w_ptrs = _w_ptrs(_w_elems(w_base, WL), offs_n, I // WV, kb, WL)
    else:
        w_ptrs = _w_elems(w_base, WL) + offs_n[:, None] * (I // WV) + k0 // WV + kb[None, :]
    if WL >= 2:
        s_ptrs = _s_ptrs(s_base, offs_n, I // SK, ks, WL)
    else:
        s_ptrs = s_base + offs_n[:, None] * (I // SK) + k0 // SK + ks[None, :]
    a_ptrs = h_ptr + rows.to(tl.int64)[:, None] * I + k0 + _x_cols(BK if XS >= 2 else BKD, WL, XS)[None, :]
    acc = _acc_init(BM, BN, WL)
    for it in range(0, KLEN // BK):
        m = k0 // WV + it * (BK // WV)  # the stage's first element of a row (WL >= 2)
        g = k0 // SK + it * (BK // SK)  # and its first scale column (WL 2)
        xa, xb = _x_stage(a_ptrs, rmask[:, None], BK, BKD, XS)
        if XS == 3:
            sa, sb = _load_s_stage(_s_step(s_ptrs, g, 0, ks, WL, ALIGNED), BN, BK, BKD)
        for j in tl.static_range(BK // BKD):
            a0, a1, a2, a3 = _x_step(xa, xb, a_ptrs, rmask[:, None], j, XS, BKD, WL)
            w = tl.load(_w_step(w_ptrs, m, j * (BKD // WV), WL, BKD // WV, ALIGNED))
            if XS == 3:
                s = sa if j == 0 else sb
            else:
                s = tl.load(_s_step(s_ptrs, g, j * (BKD // SK), ks, WL, ALIGNED))
            acc = _mx_step(acc, a0, a1, a2, a3, w, s, DEQ, WL, BM, BN, BKD)
        a_ptrs += BK
        w_ptrs = _next_stage(w_ptrs, BK // WV, WL)
        s_ptrs = _next_stage(s_ptrs, BK // SK, WL)
    return _acc_out(acc, WL)


@triton.jit
def _down_kernel(
    h_ptr, w_ptr, s_ptr, ids_ptr, tw_ptr, sorted_ptr, blk_exp_ptr, nblk_ptr, y_ptr, out_ptr, tick_ptr,
    stride_ot, scaling, P, E,
    H: tl.constexpr, I: tl.constexpr, TOPK: tl.constexpr, MODE: tl.constexpr, SPLIT: tl.constexpr,
    ROUND: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BKD: tl.constexpr,
    DEQ: tl.constexpr, WL: tl.constexpr = 0, PF: tl.constexpr = 0, FOLD: tl.constexpr = False,
    PDL: tl.constexpr = False, XS: tl.constexpr = 0,
):
    """MODE 0: sorted row blocks, 1: one pair per program (both write the routing-weighted rows of K split
    ``pid_k`` to y[pid_k, pair] fp32 for _topk_sum_kernel); MODE 2 (SPLIT 1): one token per program, its k
    experts summed here, bf16 out[token] written.
    PF 1 (MODE 0, 1): prefetch the program's weight rows and scales over its K range into L2 first; PF 2: the same
    with evict_last (fetched while an early-released gate/up grid still streams its weights through L2). PDL: launched
    as a programmatic dependent of the gate/up kernel: the routing reads and the prefetch (inputs only) run before
    griddepcontrol.wait, everything that reads h after it. FOLD (MODE 1): the last of the TOPK * SPLIT programs
    of a (token, BN columns) group to finish (acq_rel ticket in tick_ptr[token * H / BN + pid_n], reset by it)
    writes out[token] as ``_topk_sum_kernel`` would (same order: identical bits)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BN + tl.arange(0, BN)
    w_stride_e = H * (I // 2)
    s_stride_e = H * (I // 32)
    if MODE == 2:
        if PDL:
            tl.extra.cuda.gdc_wait()
        offs_m = tl.arange(0, BM)
        total = tl.zeros([BN], tl.float32)
        for j in tl.static_range(TOPK):
            pair = pid_m * TOPK + j
            e = tl.load(ids_ptr + pair).to(tl.int32)
            if (e >= 0) & (e < E):
                rows = pair + offs_m * 0
                acc = _down_tile(h_ptr, w_ptr + e.to(tl.int64) * w_stride_e, s_ptr + e.to(tl.int64) * s_stride_e,
                                 rows, offs_m == 0, offs_n, 0, I, I, BM, BN, BK, BKD, DEQ, WL)
                wt = tl.load(tw_ptr + pair).to(tl.float32) * scaling
                total += tl.sum(tl.where(offs_m[:, None] == 0, acc, 0.0), axis=0) * wt
        if ROUND:
            total = _rne_bf16(total)
        tl.store(out_ptr + pid_m.to(tl.int64) * stride_ot + offs_n, total.to(tl.bfloat16))
    else:
        e, rows, rmask, active = _rows_of(pid_m, ids_ptr, sorted_ptr, blk_exp_ptr, nblk_ptr, P, E, MODE == 0, BM)
        if PF >= 1:
            if active:
                k0 = pid_k * (I // SPLIT)
                pf_rows = e.to(tl.int64) * H + offs_n
                _prefetch_rows(w_ptr + pf_rows * (I // 2) + k0 // 2, I // SPLIT // 2, PF == 2)
                _prefetch_rows(s_ptr + pf_rows * (I // 32) + k0 // 32, I // SPLIT // 32, PF == 2)
        if PDL:
            tl.extra.cuda.gdc_wait()
        if active:
            acc = _down_tile(h_ptr, w_ptr + e.to(tl.int64) * w_stride_e, s_ptr + e.to(tl.int64) * s_stride_e,
                             rows, rmask, offs_n, pid_k * (I // SPLIT), I // SPLIT, I, BM, BN, BK, BKD, DEQ, WL,
                             XS)
            wt = tl.load(tw_ptr + rows, mask=rmask, other=0.0).to(tl.float32) * scaling
            y_ptrs = y_ptr + (pid_k * P + rows.to(tl.int64))[:, None] * H + offs_n[None, :]
            tl.store(y_ptrs, acc * wt[:, None], mask=rmask[:, None])
        if FOLD:  # MODE 1: every program of the token arrives, skipped pairs too
            tl.debug_barrier()  # every thread's y stores are issued before the release
            t = pid_m // TOPK
            tick = tick_ptr + t * (H // BN) + pid_n
            if tl.atomic_add(tick, 1, sem="acq_rel") == TOPK * SPLIT - 1:
                tl.store(tick, 0)  # for the next call
                total = tl.zeros([BN], tl.float32)
                for j in tl.static_range(TOPK):
                    pair = t * TOPK + j
                    ej = tl.load(ids_ptr + pair).to(tl.int32)
                    if (ej >= 0) & (ej < E):
                        for sp in tl.static_range(SPLIT):
                            total += tl.load(y_ptr + (sp * P + pair).to(tl.int64) * H + offs_n, cache_modifier=".cg")
                if ROUND:
                    total = _rne_bf16(total)
                tl.store(out_ptr + t.to(tl.int64) * stride_ot + offs_n, total.to(tl.bfloat16))


@triton.jit
def _topk_sum_kernel(y_ptr, ids_ptr, out_ptr, stride_ot, P, E, H: tl.constexpr, TOPK: tl.constexpr,
                     SPLIT: tl.constexpr, ROUND: tl.constexpr, BLOCK: tl.constexpr):
    """out[t] = bf16(sum over the token's valid pairs and K splits of y[split, pair]) (y carries the routing
    weight), in a fixed order."""
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(TOPK):
        pair = t * TOPK + j
        e = tl.load(ids_ptr + pair + offs * 0).to(tl.int32)  # broadcast: a vector mask for the row
        ok = (offs < H) & (e >= 0) & (e < E)
        for s in tl.static_range(SPLIT):
            acc += tl.load(y_ptr + (s * P + pair).to(tl.int64) * H + offs, mask=ok, other=0.0)
    if ROUND:
        acc = _rne_bf16(acc)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + offs, acc.to(tl.bfloat16), mask=offs < H)


# Triton types of the runtime (non-constexpr) arguments of _gate_up_kernel / _down_kernel, for ahead-of-time
# compiles without a GPU (tests/test_mxfp4_moe.py, benchmarks/kernels/mxfp4_moe_sass.py).
GATE_UP_SIGNATURE = {"x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*u8", "ids_ptr": "*i32", "sorted_ptr": "*i32",
                     "blk_exp_ptr": "*i32", "nblk_ptr": "*i32", "h_ptr": "*bf16", "part_ptr": "*fp32",
                     "tick_ptr": "*i32", "w2_ptr": "*u8", "s2_ptr": "*u8",
                     "stride_xt": "i32", "limit": "fp32", "P": "i32", "E": "i32"}
DOWN_SIGNATURE = {"h_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*u8", "ids_ptr": "*i32", "tw_ptr": "*fp32",
                  "sorted_ptr": "*i32", "blk_exp_ptr": "*i32", "nblk_ptr": "*i32", "y_ptr": "*fp32", "out_ptr": "*bf16",
                  "tick_ptr": "*i32", "stride_ot": "i32", "scaling": "fp32", "P": "i32", "E": "i32"}
