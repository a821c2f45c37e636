"""The indexer's score kernels: ``_index_scores_kernel`` (scores, group maxima and their histogram of the live key
tiles, see the package docstring) and ``_group_max_kernel`` (the same maxima and histogram for precomputed scores)."""

from __future__ import annotations

import triton
import triton.language as tl

from .jit_helpers import (
    _hist_bin,
    _load_k_fp8,
    _load_k_packed,
    _load_k_scales,
    _load_q,
    _order_key,
    _pages_of_tile,
    _row_len,
    _scales_pv,
    _unpack_fp8,
)


@triton.jit
def _score_tile(kf, ksc, q, w, t, lens, l_max, rows, so, S, score_ptr, gmax_ptr, hist_ptr, max_len, ng_buf,
                hist_ok, topk, S_P2: tl.constexpr, H: tl.constexpr, BLOCK_N: tl.constexpr, G: tl.constexpr,
                Q_FP8: tl.constexpr, DOT_F32: tl.constexpr, TOKENS_M: tl.constexpr, DOT_PREC: tl.constexpr,
                NB: tl.constexpr, SHIFT: tl.constexpr):
    """Scores of one key tile (fp8 [BLOCK_N, 128] + scales) for the stacked queries: stores them and their group
    maxima, and counts the maxima (or, for rows of <= topk groups, the scores) into the per-row histogram the select
    kernel reads its first bound from."""
    if DOT_F32:
        kop = kf.to(tl.float32)
    elif Q_FP8:
        kop = kf
    else:
        kop = kf.to(tl.bfloat16)
    if TOKENS_M:
        acc = tl.dot(kop, tl.trans(q), input_precision=DOT_PREC)  # [BLOCK_N, S_P2 * H]
        x = tl.reshape(tl.maximum(acc, 0.0) * w[None, :], [BLOCK_N, S_P2, H])
        sc = tl.trans(tl.sum(x, 2) * ksc[:, None])  # [S_P2, BLOCK_N]
    else:
        acc = tl.dot(q, tl.trans(kop), input_precision=DOT_PREC)  # [S_P2 * H, BLOCK_N]
        x = tl.reshape(tl.maximum(acc, 0.0) * w[:, None], [S_P2, H, BLOCK_N])
        sc = tl.sum(x, 1) * ksc[None, :]
    pos = t * BLOCK_N + tl.arange(0, BLOCK_N)
    sc = tl.where(pos[None, :] < lens[:, None], sc, float("-inf"))
    l_st = l_max
    tl.store(score_ptr + rows[:, None] * max_len + pos[None, :], sc,
             mask=(so < S)[:, None] & (pos < l_st)[None, :])
    gm = tl.max(tl.reshape(sc, [S_P2, BLOCK_N // G, G]), 2)
    go = t * (BLOCK_N // G) + tl.arange(0, BLOCK_N // G)
    tl.store(gmax_ptr + rows[:, None] * ng_buf + go[None, :], gm,
             mask=(so < S)[:, None] & (go * G < l_st)[None, :])
    # the select's first bound: rows of more than topk groups count their group maxima, shorter rows (<= topk
    # groups, > topk positions) their scores
    many = tl.cdiv(lens, G) > topk
    hb = _hist_bin(_order_key(gm), NB, SHIFT)
    tl.atomic_add(hist_ptr + rows[:, None] * NB + hb, tl.full(hb.shape, 1, tl.int32),
                  mask=(hist_ok & many)[:, None] & (go * G < lens[:, None]), sem="relaxed")
    hs = _hist_bin(_order_key(sc), NB, SHIFT)
    tl.atomic_add(hist_ptr + rows[:, None] * NB + hs, tl.full(hs.shape, 1, tl.int32),
                  mask=(hist_ok & ~many)[:, None] & (pos[None, :] < lens[:, None]), sem="relaxed")


@triton.jit
def _score_tile_1q(kf, ksc, q, w, t, ln, row, score_ptr, gmax_ptr, hist_ptr, max_len, ng_buf, topk,
                   H: tl.constexpr, BLOCK_N: tl.constexpr, G: tl.constexpr, DOT_PREC: tl.constexpr, NB: tl.constexpr,
                   SHIFT: tl.constexpr, DOT_F32: tl.constexpr, Q_FP8: tl.constexpr):
    """_score_tile for one query token with the keys on M (config EPI 1): keys fp8 [BLOCK_N, 128], scales fp32
    [BLOCK_N], q [H, 128], w fp32 [H], live length ln and output row (scalars). The token sums stay 1-D in the dot's
    row layout (no [1, BLOCK_N] transpose), and the histogram's rows-vs-scores choice is a scalar branch, so the
    untaken one issues nothing."""
    if DOT_F32:
        kf = kf.to(tl.float32)
    elif not Q_FP8:
        kf = kf.to(tl.bfloat16)
    acc = tl.dot(kf, tl.trans(q), input_precision=DOT_PREC)  # [BLOCK_N, H]
    pos = t * BLOCK_N + tl.arange(0, BLOCK_N)
    sc = tl.where(pos < ln, tl.sum(tl.maximum(acc, 0.0) * w[None, :], 1) * ksc, float("-inf"))
    l_st = ln
    tl.store(score_ptr + row * max_len + pos, sc, mask=pos < l_st)
    gm = tl.max(tl.reshape(sc, [BLOCK_N // G, G]), 1)
    go = t * (BLOCK_N // G) + tl.arange(0, BLOCK_N // G)
    tl.store(gmax_ptr + row * ng_buf + go, gm, mask=go * G < l_st)
    if ln > topk:
        if tl.cdiv(ln, G) > topk:
            hb = _hist_bin(_order_key(gm), NB, SHIFT)
            tl.atomic_add(hist_ptr + row * NB + hb, tl.full(hb.shape, 1, tl.int32), mask=go * G < ln,
                          sem="relaxed")
        else:
            hs = _hist_bin(_order_key(sc), NB, SHIFT)
            tl.atomic_add(hist_ptr + row * NB + hs, tl.full(hs.shape, 1, tl.int32), mask=pos < ln,
                          sem="relaxed")


@triton.jit
def _index_scores_kernel(
    q_ptr, w_ptr, qs_ptr, kc32_ptr, k8_ptr, ks_ptr, bt_ptr, len_ptr, score_ptr, gmax_ptr, hist_ptr,
    stride_qb, stride_qs, stride_qh, stride_wb, stride_ws, stride_bt,
    max_len, ng_buf, n_split, topk, S_ALL, s0,
    S: tl.constexpr, S_P2: tl.constexpr, H: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    G: tl.constexpr, LEN_2D: tl.constexpr, HAS_QS: tl.constexpr, Q_FP8: tl.constexpr, MIN_TILES: tl.constexpr,
    DOT_F32: tl.constexpr, TOKENS_M: tl.constexpr = True, PREFETCH: tl.constexpr = True,
    DOT_PREC: tl.constexpr = "tf32", KEYS: tl.constexpr = "fp8", NB: tl.constexpr = 4096,
    SHIFT: tl.constexpr = 20, PDL: tl.constexpr = False, CH: tl.constexpr = 8,
    NPV: tl.constexpr = 32, PAIR: tl.constexpr = False, EPI: tl.constexpr = 0,
):
    # this launch scores query tokens s0 .. s0 + S - 1 (S <= 4) of the S_ALL per request
    if PDL:  # the select kernel may be scheduled once every score program has started (it waits for the results)
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    sp = tl.program_id(1)
    so = tl.arange(0, S_P2)
    lens = tl.where(so < S, _row_len(len_ptr, b, s0 + tl.minimum(so, S - 1), S_ALL, max_len, LEN_2D), 0)
    # the longest query token bounds the scan; shorter ones mask their tail (scalars: Triton 3.6's interpreter
    # keeps a reduced 1-element vector 1-D, which range() rejects)
    l_max = _row_len(len_ptr, b, s0, S_ALL, max_len, LEN_2D)
    for i in tl.static_range(1, S):
        l_max = tl.maximum(l_max, _row_len(len_ptr, b, s0 + i, S_ALL, max_len, LEN_2D))
    n_tiles = tl.cdiv(l_max, BLOCK_N)
    per = tl.maximum(tl.cdiv(n_tiles, n_split), MIN_TILES)
    t_begin = sp * per
    t_end = tl.minimum(t_begin + per, n_tiles)
    t_end = tl.where(l_max > topk, t_end, t_begin)  # <= topk live positions: no scores needed
    if t_end > t_begin:  # idle programs (short rows, splits past the live range) exit before loading anything
        bt_row = bt_ptr + b.to(tl.int64) * stride_bt
        rows = b.to(tl.int64) * S_ALL + s0 + so  # [S_P2] output rows
        # rows the select kernel bounds through the histogram (more than topk positions)
        hist_ok = (so < S) & (lens > topk)
        q, w = _load_q(q_ptr, w_ptr, qs_ptr, b, s0, S, stride_qb, stride_qs, stride_qh, stride_wb, stride_ws,
                       S_P2, H, HAS_QS, DOT_F32)
        if KEYS == "fp8":  # fp8 tiles; num_stages > 1 lets Triton's software pipeliner keep loads in flight
            ksc_next = _load_k_scales(ks_ptr, bt_row, t_begin, t_end, l_max, PAGE, BLOCK_N)
            for t in range(t_begin, t_end):
                ksc = ksc_next
                ksc_next = _load_k_scales(ks_ptr, bt_row, t + 1, t_end, l_max, PAGE, BLOCK_N)
                kf = _load_k_fp8(k8_ptr, bt_row, t, l_max, PAGE, BLOCK_N)
                _score_tile(kf, ksc, q, w, t, lens, l_max, rows, so, S, score_ptr, gmax_ptr, hist_ptr, max_len,
                            ng_buf, hist_ok, topk, S_P2, H, BLOCK_N, G, Q_FP8, DOT_F32, TOKENS_M, DOT_PREC, NB, SHIFT)
        elif KEYS == "fp8pv":  # fp8 tiles, page ids of CH tiles at a time in registers (see _pages_of_tile)
            jv = tl.arange(0, NPV)
            for tc in range(t_begin, t_end, CH):
                tce = tl.minimum(tc + CH, t_end)
                pb = (tc * BLOCK_N) // PAGE
                pv = tl.load(bt_row + pb + jv, mask=(pb + jv) * PAGE < l_max, other=0)
                if PAIR:
                    pv2 = tl.load(bt_row + pb + NPV + jv, mask=(pb + NPV + jv) * PAGE < l_max, other=0)
                else:
                    pv2 = pv
                ksc_next = _scales_pv(ks_ptr, pv, pv2, jv, pb, tc, tce, l_max, PAGE, BLOCK_N, NPV, PAIR)
                for t in range(tc, tce):
                    ksc = ksc_next
                    ksc_next = _scales_pv(ks_ptr, pv, pv2, jv, pb, t + 1, tce, l_max, PAGE, BLOCK_N, NPV, PAIR)
                    pos = t * BLOCK_N + tl.arange(0, BLOCK_N)
                    page = _pages_of_tile(pv, pv2, jv, pb, t, PAGE, BLOCK_N, NPV, PAIR)
                    d = tl.arange(0, 128)
                    kf = tl.load(k8_ptr + (page * (PAGE * 132) + (pos % PAGE) * 128)[:, None] + d[None, :],
                                 mask=(pos < l_max)[:, None], other=0.0)
                    if EPI == 1:  # one query token (S == 1: l_max is its live length)
                        _score_tile_1q(kf, ksc, q, w, t, l_max, b.to(tl.int64) * S_ALL + s0, score_ptr, gmax_ptr,
                                       hist_ptr, max_len, ng_buf, topk, H, BLOCK_N, G, DOT_PREC, NB, SHIFT, DOT_F32,
                                       Q_FP8)
                    else:
                        _score_tile(kf, ksc, q, w, t, lens, l_max, rows, so, S, score_ptr, gmax_ptr, hist_ptr,
                                    max_len, ng_buf, hist_ok, topk, S_P2, H, BLOCK_N, G, Q_FP8, DOT_F32, TOKENS_M,
                                    DOT_PREC, NB, SHIFT)
        else:  # packed int32 tiles, hand-pipelined: the gather of tile t + 1 is in flight while t is scored
            if PREFETCH:
                k, ksc = _load_k_packed(kc32_ptr, ks_ptr, bt_row, t_begin, t_end, l_max, PAGE, BLOCK_N)
            for t in range(t_begin, t_end):
                if PREFETCH:
                    cur_k = k
                    cur_ksc = ksc
                    k, ksc = _load_k_packed(kc32_ptr, ks_ptr, bt_row, t + 1, t_end, l_max, PAGE, BLOCK_N)
                else:
                    cur_k, cur_ksc = _load_k_packed(kc32_ptr, ks_ptr, bt_row, t, t_end, l_max, PAGE, BLOCK_N)
                _score_tile(_unpack_fp8(cur_k, BLOCK_N), cur_ksc, q, w, t, lens, l_max, rows, so, S, score_ptr,
                            gmax_ptr, hist_ptr, max_len, ng_buf, hist_ok, topk, S_P2, H, BLOCK_N, G, Q_FP8, DOT_F32,
                            TOKENS_M, DOT_PREC, NB, SHIFT)


@triton.jit
def _group_max_kernel(score_ptr, gmax_ptr, hist_ptr, len_ptr, stride_row, ng_buf, n_split, max_len, topk,
                      G: tl.constexpr, BLOCK: tl.constexpr, MIN_TILES: tl.constexpr, NB: tl.constexpr,
                      SHIFT: tl.constexpr):
    """Group maxima and their histogram for externally computed scores (``topk_from_scores``); same split scheme
    as the scores."""
    r = tl.program_id(0)
    sp = tl.program_id(1)
    ln = _row_len(len_ptr, r, 0, 1, max_len, True)
    n_tiles = tl.cdiv(ln, BLOCK)
    per = tl.maximum(tl.cdiv(n_tiles, n_split), MIN_TILES)
    t_begin = sp * per
    t_end = tl.minimum(t_begin + per, n_tiles)
    t_end = tl.where(ln > topk, t_end, t_begin)
    # histogram counts as in the scores kernel: group maxima of rows of > topk groups, else scores
    ln_gm = tl.where(tl.cdiv(ln, G) > topk, ln, 0)
    ln_sc = tl.where(tl.cdiv(ln, G) > topk, 0, ln)
    for t in range(t_begin, t_end):
        pos = t * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(score_ptr + r.to(tl.int64) * stride_row + pos, mask=pos < ln, other=float("-inf"))
        gm = tl.max(tl.reshape(x, [BLOCK // G, G]), 1)
        go = t * (BLOCK // G) + tl.arange(0, BLOCK // G)
        tl.store(gmax_ptr + r.to(tl.int64) * ng_buf + go, gm, mask=go * G < ln)
        hb = _hist_bin(_order_key(gm), NB, SHIFT)
        tl.atomic_add(hist_ptr + r.to(tl.int64) * NB + hb, tl.full(hb.shape, 1, tl.int32),
                      mask=go * G < ln_gm, sem="relaxed")
        hs = _hist_bin(_order_key(x), NB, SHIFT)
        tl.atomic_add(hist_ptr + r.to(tl.int64) * NB + hs, tl.full(hs.shape, 1, tl.int32),
                      mask=pos < ln_sc, sem="relaxed")
