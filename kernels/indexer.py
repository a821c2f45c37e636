"""DSA lightning-indexer decode step: scores + exact top-k over each request's live range (Triton; sm_120a, sm_90a).

``dsa_indexer_topk(q, weights, index_k_cache, block_table, seq_lens, topk=512, page_size=64) -> indices``
[B, S, topk] int32: for every query token, the logical positions of its ``topk`` highest indexer scores,
ascending, or all live positions then -1 when the live range is not longer than ``topk``. Cache layout, score
formula, weight scaling and the causal live range of each query token (MTP verify, S > 1) are documented in
``pd.kernels.indexer_reference``, the torch reference (SGLang 0.5.23's DSA / DSv4 index-key cache:
``[num_pages, page_size * 132]`` uint8, per page ``page_size x 128`` fp8 e4m3 keys then ``page_size`` fp32 scales).

Why it exists: a decode step must cost O(live length), not O(--context-length). Both kernels read the lengths on
the device, so the launch is fixed for a given (batch, S, block-table width) and can be captured in a CUDA graph;
nothing past a request's length is read, scored or sorted.

1. ``_index_scores_kernel``, grid (B, n_split): program (b, j) scores its share of request b's live tiles
   (``BLOCK_N`` tokens; the share is computed on the device from ``seq_lens``, at least ``MIN_TILES`` tiles, so
   programs past the live range exit at once; n_split from ``score_split``: one wave of programs at small batch for
   configs that say how many fit on an SM, so each fills its key pipeline once). Per tile it gathers the fp8 keys
   and scales through the block table once and scores it for all S query tokens at once (up to 4 stacked as one
   [S * H, 128] operand; S > 4 takes several launches): ``q . k^T`` with one ``tl.dot`` (bf16 x bf16, or fp8 x fp8 for an fp8 query; mma.sync on
   sm_120, wgmma on sm_90), then ``sum_h relu(.) * w_h * scale_k`` per token. Key tiles are either loaded as fp8
   and software-pipelined by Triton (asynchronous copies, ``num_stages``) or loaded packed as int32 with a hand
   prefetch of the next tile (``SCORE_CONFIGS``; sm_90 fp8 x fp8 is wgmma e4m3, sm_120 mma.sync e4m3). The "fp8pv"
   tiles take their page ids from a register vector loaded once per ``PV_TILES`` tiles (config ``PV``; more than 32
   ids go into two vectors, each within one warp, so picking an id stays a warp reduction): with the page lookup of
   each position done by a load inside the loop ("fp8"), the pipeliner turns that lookup into an asynchronous copy
   of its own and, copies completing in order, waits for every copy in flight before each tile (cp.async.wait_group
   0), so a program has one tile in flight and not while it computes; without it the keys of the next
   ``num_stages - 1`` tiles stay in flight (wait_group num_stages - 2). Config ``EPI`` 1 gives the fp8pv path a
   one-query-token epilogue (``_score_tile_1q``: 1-D token sums in the dot's row layout, scalar row and histogram
   switches). It stores
   the fp32 scores, per group of ``GROUP`` = 8 positions their max, and counts each group max into a per-row
   histogram of the top 12 bits of its order key (4096 1/8-binade bins; relaxed atomics). Requests whose longest
   query token sees <= topk positions are skipped.
2. ``_select_topk_kernel``, grid (B * S, nsel): exact top-k of one query token's live scores, on order-preserving
   int32 keys of the fp32 scores, split over nsel <= ``SELECT_SPLIT`` programs per query token (slices of its
   group maxima; ~``SELECT_PROGRAMS`` programs in all, so a small batch still fills the GPU). Every program:
   (a) from the histogram, the low edge ``t0`` of the bin holding the topk-th largest group max. >= topk groups,
   hence >= topk distinct positions, reach t0, so t0 <= the topk-th largest score. Rows of <= topk groups
   (<= 8 * topk positions) count their scores instead, which bounds the topk-th score directly. (b) Its slice's
   positions with score >= t0 (only groups whose max reaches t0 are read; with ``SELECT_READS_SCORES`` the slice's
   scores are read whole instead, requested with the histogram, so no gather waits on the group maxima) and their
   keys, compacted in position order into its own candidate list (fixed slots in the workspace; no atomics, so the
   order is deterministic).
   (c) A ticket (acq_rel atomic counter per query token, reset by its last user): the last slice to finish
   gathers all slices' lists (every position that can be selected, ~topk of them), zeroes the histogram for the
   next call, finds the exact threshold T among them in registers and takes keys > T, then keys == T in position
   order. ``SELECT_SEARCH`` "fine": in (b) every slice also counts its candidates into a per-row histogram of
   ``FINE_BINS`` bins of 2**``FINE_SHIFT`` order keys above t0 (relaxed atomics), so the final program reads the
   bin b holding the topk-th candidate, checks it against its own candidates (their counts above and in b must
   bracket topk, else it searches all of them) and resolves only bin b: usually it holds exactly the missing
   ones (``SELECT_FAST_EXACT``: then every candidate in b or above is the answer, no search), or a few more whose
   smallest values it drops; else radix select on the bin ("radix": radix select over all candidates,
   ``tl.histogram`` passes). With ``SELECT_GATHER2D`` the final program requests the slices' lists as one tile
   together with their counts (one round trip instead of two) when every list fits its share of the tile. The
   select kernel is launched with programmatic dependent launch (``SELECT_PDL``, compute capability >= 9) and waits
   for the scores with griddepcontrol.wait. Set-equal to ``torch.topk`` up to ties. Fallbacks keep it exact on
   any input, streamed from memory over the whole live row:
   more candidates than the register tile (``candidate_capacity``; mass ties) or fewer than topk (only a stale
   histogram, e.g. a workspace that skipped a select). At 32K a query token's select is three dependent memory
   round trips in parallel programs (histogram with the first group-max tile, the score gather, the candidate
   lists), then the fine histogram and a few block-wide reductions over a ~topk-sized register tile, independent
   of the max context.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .device_info import check_runnable, is_sm90, num_sms
from .indexer_reference import BYTES_PER_TOKEN, INDEX_DIM

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
GROUP = 8  # positions per group max
SUPPORTED_HEADS = (16, 32, 64, 128)
SUPPORTED_PAGE_SIZES = tuple(2 ** i for i in range(9))  # 1 .. 256
MAX_TOPK = 2048
MAX_S = 8


@triton.jit
def _order_key(x):
    """fp32 -> int32 whose signed order is the float order (-0.0 sorts just below +0.0; NaN above +inf)."""
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


# ------------------------------------------------------------------------------------------------ scores

@triton.jit
def _load_k_packed(kc32_ptr, ks_ptr, bt_row, t, t_end, l_max, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys of tile t as packed int32 [BLOCK_N, 32] (4 fp8 each, little-endian) and fp32 scales [BLOCK_N]; zeros
    outside [0, l_max) or when t >= t_end. Packed, a hand-prefetched tile costs 1 register per 4 keys."""
    pos = t * BLOCK_N + tl.arange(0, BLOCK_N)
    inb = pos < tl.where(t < t_end, l_max, 0)
    page = tl.load(bt_row + pos // PAGE, mask=inb, other=0).to(tl.int64)
    off = pos % PAGE
    d = tl.arange(0, 32)
    k = tl.load(kc32_ptr + (page * (PAGE * 33) + off * 32)[:, None] + d[None, :], mask=inb[:, None], other=0)
    ksc = tl.load(ks_ptr + page * (PAGE * 33) + PAGE * 32 + off, mask=inb, other=0.0)
    return k, ksc


@triton.jit
def _unpack_fp8(kw, BLOCK_N: tl.constexpr):
    """int32 [BLOCK_N, 32] holding 4 fp8 e4m3 each -> fp8 [BLOCK_N, 128] in memory order."""
    b0 = (kw & 0xFF).to(tl.uint8)
    b1 = ((kw >> 8) & 0xFF).to(tl.uint8)
    b2 = ((kw >> 16) & 0xFF).to(tl.uint8)
    b3 = ((kw >> 24) & 0xFF).to(tl.uint8)
    k = tl.reshape(tl.join(tl.join(b0, b2), tl.join(b1, b3)), [BLOCK_N, 128])
    return k.to(tl.float8e4nv, bitcast=True)


@triton.jit
def _load_k_fp8(k8_ptr, bt_row, t, l_max, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys of tile t as fp8 [BLOCK_N, 128] straight from the cache (16-byte vector loads the software pipeliner
    turns into asynchronous copies to shared memory); zeros past l_max."""
    pos = t * BLOCK_N + tl.arange(0, BLOCK_N)
    inb = pos < l_max
    page = tl.load(bt_row + pos // PAGE, mask=inb, other=0).to(tl.int64)
    d = tl.arange(0, 128)
    return tl.load(k8_ptr + (page * (PAGE * 132) + (pos % PAGE) * 128)[:, None] + d[None, :], mask=inb[:, None],
                   other=0.0)


@triton.jit
def _page_pick(pv, pv2, jv, j, NPV: tl.constexpr, PAIR: tl.constexpr):
    """Page id number j (scalar) of the register page ids: pv [NPV] holds entries 0 .. NPV - 1, and with PAIR pv2
    holds NPV .. 2 * NPV - 1. Two warp-wide vectors instead of one of 2 * NPV: a vector of more than 32 ids spans
    warps, and its reductions then go through shared memory and barriers."""
    p = tl.sum(tl.where(jv == j, pv, 0), 0)
    if PAIR:
        p += tl.sum(tl.where(jv + NPV == j, pv2, 0), 0)
    return p


@triton.jit
def _pages_of_tile(pv, pv2, jv, pb, t, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, NPV: tl.constexpr,
                   PAIR: tl.constexpr):
    """Physical page (int64 [BLOCK_N]) of each position of tile t, picked from the page ids (pv, pv2: see
    _page_pick) of logical pages pb + j held in registers (a tile spans at most two pages: PAGE >= BLOCK_N / 2). No
    load on the way, so the software pipeliner can issue the tile's key gather stages ahead."""
    pos = t * BLOCK_N + tl.arange(0, BLOCK_N)
    first = (t * BLOCK_N) // PAGE - pb
    p0 = _page_pick(pv, pv2, jv, first, NPV, PAIR)
    if BLOCK_N <= PAGE:  # the tile lies in one page (both powers of two): one pick
        return tl.zeros([BLOCK_N], tl.int64) + p0.to(tl.int64)
    p1 = _page_pick(pv, pv2, jv, first + 1, NPV, PAIR)
    return tl.where(pos // PAGE - pb == first, p0, p1).to(tl.int64)


@triton.jit
def _scales_pv(ks_ptr, pv, pv2, jv, pb, t, t_end, l_max, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
               NPV: tl.constexpr, PAIR: tl.constexpr):
    """fp32 key scales [BLOCK_N] of tile t through the register page ids (zeros past l_max or when t >= t_end)."""
    pos = t * BLOCK_N + tl.arange(0, BLOCK_N)
    page = _pages_of_tile(pv, pv2, jv, pb, t, PAGE, BLOCK_N, NPV, PAIR)
    return tl.load(ks_ptr + page * (PAGE * 33) + PAGE * 32 + pos % PAGE, mask=pos < tl.where(t < t_end, l_max, 0),
                   other=0.0)


@triton.jit
def _load_k_scales(ks_ptr, bt_row, t, t_end, l_max, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """fp32 key scales [BLOCK_N] of tile t (zeros past l_max or when t >= t_end). Loaded one tile ahead by hand:
    the pipeliner only makes asynchronous copies of dot operands, and this load waits on its own page lookup."""
    pos = t * BLOCK_N + tl.arange(0, BLOCK_N)
    inb = pos < tl.where(t < t_end, l_max, 0)
    page = tl.load(bt_row + pos // PAGE, mask=inb, other=0).to(tl.int64)
    return tl.load(ks_ptr + page * (PAGE * 33) + PAGE * 32 + pos % PAGE, mask=inb, other=0.0)


@triton.jit
def _load_q(q_ptr, w_ptr, qs_ptr, b, s0, S, stride_qb, stride_qs, stride_qh, stride_wb, stride_ws,
            S_P2: tl.constexpr, H: tl.constexpr, HAS_QS: tl.constexpr, DOT_F32: tl.constexpr):
    """Query tokens s0 .. s0 + S - 1 of request b stacked as rows (s, h): q [S_P2 * H, 128], weights [S_P2 * H]
    (fp32, times the query scales when given); rows s >= S are zero."""
    r = tl.arange(0, S_P2 * H)
    s = r // H
    h = r % H
    d = tl.arange(0, 128)
    ok = s < S
    s = s + s0
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + (s * stride_qs + h * stride_qh)[:, None] + d[None, :],
                mask=ok[:, None], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    w_off = b.to(tl.int64) * stride_wb + s * stride_ws + h
    w = tl.load(w_ptr + w_off, mask=ok, other=0.0).to(tl.float32)
    if HAS_QS:
        w = w * tl.load(qs_ptr + w_off, mask=ok, other=0.0)
    return q, w


@triton.jit
def _row_len(len_ptr, b, s, S, max_len, LEN_2D: tl.constexpr):
    """Live length of query token s (scalar or vector) of request b (see indexer_reference.live_lengths)."""
    if LEN_2D:
        ln = tl.load(len_ptr + b * S + s).to(tl.int32)
    else:
        ln = tl.load(len_ptr + b).to(tl.int32) - S + 1 + s
    return tl.minimum(tl.maximum(ln, 0), max_len)


@triton.jit
def _hist_bin(key, NB: tl.constexpr, SHIFT: tl.constexpr):
    """Histogram bin of an order key: its top log2(NB) bits (1/8-binade bins for NB = 4096), offset to >= 0."""
    return (key >> SHIFT) + NB // 2


@triton.jit
def _score_tile(kf, ksc, q, w, t, lens, l_max, rows, so, S, score_ptr, gmax_ptr, hist_ptr, max_len, ng_buf,
                hist_ok, topk, S_P2: tl.constexpr, H: tl.constexpr, BLOCK_N: tl.constexpr, G: tl.constexpr,
                Q_FP8: tl.constexpr, DOT_F32: tl.constexpr, TOKENS_M: tl.constexpr, DOT_PREC: tl.constexpr,
                NB: tl.constexpr, SHIFT: tl.constexpr, PROBE: tl.constexpr = 0):
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
    if PROBE >= 2:  # benchmark probe: no stores (a runtime-false mask keeps the math)
        l_st = tl.where(l_max < 0, l_max, 0)
    else:
        l_st = l_max
    tl.store(score_ptr + rows[:, None] * max_len + pos[None, :], sc,
             mask=(so < S)[:, None] & (pos < l_st)[None, :])
    gm = tl.max(tl.reshape(sc, [S_P2, BLOCK_N // G, G]), 2)
    go = t * (BLOCK_N // G) + tl.arange(0, BLOCK_N // G)
    tl.store(gmax_ptr + rows[:, None] * ng_buf + go[None, :], gm,
             mask=(so < S)[:, None] & (go * G < l_st)[None, :])
    # the select's first bound: rows of more than topk groups count their group maxima, shorter rows (<= topk
    # groups, > topk positions) their scores
    if PROBE == 0:  # benchmark probe >= 1: no histogram atomics
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
                   SHIFT: tl.constexpr, DOT_F32: tl.constexpr, Q_FP8: tl.constexpr, PROBE: tl.constexpr = 0):
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
    if PROBE >= 2:  # benchmark probe: no stores (a runtime-false mask keeps the math)
        l_st = tl.where(ln < 0, ln, 0)
    else:
        l_st = ln
    tl.store(score_ptr + row * max_len + pos, sc, mask=pos < l_st)
    gm = tl.max(tl.reshape(sc, [BLOCK_N // G, G]), 1)
    go = t * (BLOCK_N // G) + tl.arange(0, BLOCK_N // G)
    tl.store(gmax_ptr + row * ng_buf + go, gm, mask=go * G < l_st)
    if PROBE == 0:  # as _score_tile: rows of more than topk groups count their group maxima, shorter ones scores
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
    SHIFT: tl.constexpr = 20, PROBE: tl.constexpr = 0, PDL: tl.constexpr = False, CH: tl.constexpr = 8,
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
                            ng_buf, hist_ok, topk, S_P2, H, BLOCK_N, G, Q_FP8, DOT_F32, TOKENS_M, DOT_PREC, NB, SHIFT,
                            PROBE)
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
                                       Q_FP8, PROBE)
                    else:
                        _score_tile(kf, ksc, q, w, t, lens, l_max, rows, so, S, score_ptr, gmax_ptr, hist_ptr,
                                    max_len, ng_buf, hist_ok, topk, S_P2, H, BLOCK_N, G, Q_FP8, DOT_F32, TOKENS_M,
                                    DOT_PREC, NB, SHIFT, PROBE)
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
                            TOKENS_M, DOT_PREC, NB, SHIFT, PROBE)


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


# ------------------------------------------------------------------------------------------------ top-k

@triton.jit
def _count3(keys, valid, m1, m2, m3):
    """(#keys >= m1, #keys >= m2, #keys >= m3) over valid keys, in one reduction (21-bit fields of an int64)."""
    v = (keys >= m1).to(tl.int64) + ((keys >= m2).to(tl.int64) << 21) + ((keys >= m3).to(tl.int64) << 42)
    tot = tl.sum(tl.where(valid, v, 0), 0)
    return tot & 0x1FFFFF, (tot >> 21) & 0x1FFFFF, (tot >> 42) & 0x1FFFFF


@triton.jit
def _narrow(lo, hi, c1, c2, c3, m1, m2, m3, k):
    """One 4-way step. Invariant: #(>= lo) >= k and #(>= hi + 1) < k."""
    new_lo = tl.where(c3 >= k, m3, tl.where(c2 >= k, m2, tl.where(c1 >= k, m1, lo)))
    new_hi = tl.where(c3 >= k, hi, tl.where(c2 >= k, m3 - 1, tl.where(c1 >= k, m2 - 1, m1 - 1)))
    return new_lo, new_hi


@triton.jit
def _kth_largest_radix(keys, valid, k, RADIX: tl.constexpr):
    """Largest int32 T with #(valid & keys >= T) >= k, for 1 <= k <= #valid; keys 1-D in registers.

    Radix select on keys - min: one ``tl.histogram`` of RADIX bits per pass (a ballot-based warp histogram:
    a few instructions per key, far cheaper than compare-and-count), from the top bit of the live range down,
    keeping only keys whose higher bits equal the digits chosen so far."""
    NBR: tl.constexpr = 1 << RADIX
    lo = tl.min(tl.where(valid, keys, 2147483647), 0).to(tl.int64)
    hi = tl.max(tl.where(valid, keys, -2147483648), 0).to(tl.int64)
    u = keys.to(tl.int64) - lo
    one = tl.full([], 1, tl.int64)
    shift = tl.zeros([], tl.int64)
    while (one << shift) <= hi - lo:
        shift += 1
    prefix = tl.zeros([], tl.int64)
    kk = tl.zeros([], tl.int32) + k
    bins = tl.arange(0, NBR)
    while shift > 0:
        ns = tl.maximum(shift - RADIX, 0)
        width = shift - ns
        match = valid & ((u >> shift) == prefix)
        dig = ((u >> ns) & ((one << width) - 1)).to(tl.int32)
        h = tl.histogram(dig, NBR, mask=match)
        c_ge = tl.cumsum(h, 0, reverse=True)
        dsel = tl.max(tl.where(c_ge >= kk, bins, 0), 0)
        kk -= tl.sum(tl.where(bins > dsel, h, 0), 0)
        prefix = (prefix << width) + dsel
        shift = ns
    return (lo + prefix).to(tl.int32)


@triton.jit
def _add2(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@triton.jit
def _stream_keys(srow, idx_ptr, i0, n, INDIRECT: tl.constexpr, TILE: tl.constexpr):
    """Order keys, mask and positions of items i0 .. i0 + TILE - 1 of a streamed list: row positions i
    (INDIRECT False) or the positions stored at idx_ptr[i]."""
    i = i0 + tl.arange(0, TILE)
    m = i < n
    if INDIRECT:
        p = tl.load(idx_ptr + i, mask=m, other=0, cache_modifier=".cg")
    else:
        p = i
    return _order_key(tl.load(srow + p, mask=m, other=0.0)), m, p


@triton.jit
def _kth_largest_mem(srow, idx_ptr, n, k, INDIRECT: tl.constexpr, TILE: tl.constexpr):
    """As _kth_largest_radix for the n listed scores (see _stream_keys), streamed from memory at each step of a
    4-way search."""
    lo = tl.full([], 2147483647, tl.int32)
    hi = tl.full([], -2147483648, tl.int32)
    for i in range(0, n, TILE):
        x, m, p = _stream_keys(srow, idx_ptr, i, n, INDIRECT, TILE)
        lo = tl.minimum(lo, tl.min(tl.where(m, x, 2147483647), 0))
        hi = tl.maximum(hi, tl.max(tl.where(m, x, -2147483648), 0))
    lo = lo.to(tl.int64)
    hi = hi.to(tl.int64)
    while lo < hi:
        step = (hi - lo + 3) // 4
        m1 = lo + step
        m2 = tl.minimum(lo + 2 * step, hi)
        m3 = tl.minimum(lo + 3 * step, hi)
        c1 = tl.zeros([], tl.int64)
        c2 = tl.zeros([], tl.int64)
        c3 = tl.zeros([], tl.int64)
        for i in range(0, n, TILE):
            x, m, p = _stream_keys(srow, idx_ptr, i, n, INDIRECT, TILE)
            d1, d2, d3 = _count3(x, m, m1.to(tl.int32), m2.to(tl.int32), m3.to(tl.int32))
            c1 += d1
            c2 += d2
            c3 += d3
        lo, hi = _narrow(lo, hi, c1, c2, c3, m1, m2, m3, k)
    return lo.to(tl.int32)


@triton.jit
def _select_streamed(srow, idx_ptr, n, topk, out_row, INDIRECT: tl.constexpr, TILE: tl.constexpr):
    """Exact top-k of n listed scores (ascending list order), streamed: the slow path for inputs that defeat the
    bounds (mass ties, a stale histogram). Writes the chosen positions in list order."""
    thr = _kth_largest_mem(srow, idx_ptr, n, topk, INDIRECT, TILE)
    n_gt = tl.zeros([], tl.int32)
    for i in range(0, n, TILE):
        x, m, p = _stream_keys(srow, idx_ptr, i, n, INDIRECT, TILE)
        n_gt += tl.sum((m & (x > thr)).to(tl.int32), 0)
    need_eq = topk - n_gt
    n_out = tl.zeros([], tl.int32)
    n_eq = tl.zeros([], tl.int32)
    for i in range(0, n, TILE):
        x, m, p = _stream_keys(srow, idx_ptr, i, n, INDIRECT, TILE)
        gt = m & (x > thr)
        eq = m & (x == thr)
        take = gt | (eq & (n_eq + tl.cumsum(eq.to(tl.int32), 0) <= need_eq))
        slot = n_out + tl.cumsum(take.to(tl.int32), 0) - 1
        tl.store(out_row + slot, p, mask=take)
        n_out += tl.sum(take.to(tl.int32), 0)
        n_eq += tl.sum(eq.to(tl.int32), 0)


@triton.jit
def _select_topk_kernel(
    score_ptr, gmax_ptr, hist_ptr, tick_ptr, fine_ptr, scr_ptr, len_ptr, out_ptr,
    S, max_len, stride_row, ng_buf, topk,
    LEN_2D: tl.constexpr, G: tl.constexpr, NB: tl.constexpr, SHIFT: tl.constexpr, NSEL: tl.constexpr,
    CAP: tl.constexpr, CAP_P: tl.constexpr, TGS: tl.constexpr, TILE: tl.constexpr, RADIX: tl.constexpr,
    CLEAR_HIST: tl.constexpr, PROBE: tl.constexpr = 0, SEARCH: tl.constexpr = "fine",
    NBF: tl.constexpr = 4096, FSHIFT: tl.constexpr = 11, DROP_MAX: tl.constexpr = 8, PDL: tl.constexpr = False,
    GROWS: tl.constexpr = 0, FAST_EXACT: tl.constexpr = False, READ_SCORES: tl.constexpr = False,
):
    # program (r, j): slice j of query row r's group maxima (whole tiles of TGS groups, spread over the grid's
    # nsel <= NSEL programs per row); the last active program of the row to finish does the row's final selection.
    # PROBE (benchmark only, wrong output): 1 stops after the bound t0, 2 after the ticket and the counts, 3 with the
    # candidates and the fine histogram loaded, before the final threshold search.
    r = tl.program_id(0)
    j = tl.program_id(1)
    nsel = tl.num_programs(1)
    b = r // S
    s = r % S
    ln = _row_len(len_ptr, b, s, S, max_len, LEN_2D)
    r64 = r.to(tl.int64)
    out_row = out_ptr + r64 * topk
    ng = tl.cdiv(ln, G)
    n_gt = tl.cdiv(ng, TGS)
    per = tl.maximum(tl.cdiv(n_gt, nsel), 1)
    n_act = tl.cdiv(n_gt, per)  # programs with group tiles; the others only write short rows or exit
    if PDL:  # launched early (programmatic dependent launch): wait for the scores kernel's results
        tl.extra.cuda.gdc_wait()
    if ln <= topk:
        if j == 0:  # every live position, then -1 (no scores were computed for such rows)
            for o in range(0, topk, TILE):
                idx = o + tl.arange(0, TILE)
                tl.store(out_row + idx, tl.where(idx < ln, idx, -1), mask=idx < topk)
    elif j < n_act:
        srow = score_ptr + r64 * stride_row
        grow = gmax_ptr + r64 * ng_buf
        crow = scr_ptr + r64 * (NSEL * (2 * CAP + 1))  # positions [NSEL, CAP], keys [NSEL, CAP], counts [NSEL]
        pos_blk = crow
        key_blk = crow + NSEL * CAP
        cnt_ptr = crow + 2 * NSEL * CAP
        tick = tick_ptr + r64
        g_begin = j * per * TGS
        g_end = tl.minimum(g_begin + per * TGS, ng)
        # this slice's first tile of group maxima (READ_SCORES: of scores) is requested before the histogram, so the
        # two loads overlap
        if READ_SCORES:
            p_end = tl.minimum(g_end * G, ln)
            cp = g_begin * G + tl.arange(0, TGS * G)
            ck = _order_key(tl.load(srow + cp, mask=cp < p_end, other=0.0))
        else:
            go = g_begin + tl.arange(0, TGS)
            gk = _order_key(tl.load(grow + go, mask=go < g_end, other=0.0))
        # 1) t0 <= the topk-th largest score: the low edge of the histogram bin holding the topk-th largest count
        #    (group maxima: >= topk groups, hence distinct positions, reach it; short rows count the scores)
        bins = tl.arange(0, NB)
        hrow = hist_ptr + r64 * NB
        h = tl.load(hrow + bins, cache_modifier=".cg")
        c_ge = tl.cumsum(h, 0, reverse=True)
        t0 = ((tl.max(tl.where(c_ge >= topk, bins, 0), 0) - NB // 2) << SHIFT).to(tl.int32)
        if PROBE == 1:
            tl.store(out_row + j, t0)
            return
        # 2) positions of this slice with score >= t0 (only groups whose max reaches t0 are read), compacted in
        #    position order into the slice's candidate list with their keys
        gg = tl.arange(0, G)
        n = tl.zeros([], tl.int32)
        for g0 in range(g_begin, g_end, TGS):
            if READ_SCORES:  # the slice's scores themselves, a whole tile at a time (no dependent gather)
                cv = cp < p_end
                cf = cv & (ck >= t0)
                cp_n = cp + TGS * G
                ck_n = _order_key(tl.load(srow + cp_n, mask=cp_n < p_end, other=0.0))  # the next tile, in flight
            else:
                f = (go < g_end) & (gk >= t0)
                go = go + TGS
                gk = _order_key(tl.load(grow + go, mask=go < g_end, other=0.0))  # the next tile, in flight meanwhile
                cp = tl.reshape((g0 + tl.arange(0, TGS))[:, None] * G + gg[None, :], [TGS * G])
                cv = tl.reshape(f[:, None] & (gg < G)[None, :], [TGS * G]) & (cp < ln)
                ck = _order_key(tl.load(srow + cp, mask=cv, other=0.0))
                cf = cv & (ck >= t0)
            slot = n + tl.cumsum(cf.to(tl.int32), 0) - 1
            keep = cf & (slot < CAP)
            tl.store(pos_blk + j * CAP + slot, cp, mask=keep)
            tl.store(key_blk + j * CAP + slot, ck, mask=keep)
            if SEARCH == "fine":  # the row's fine histogram of candidate keys above t0 (NBF bins of 2**FSHIFT)
                fb = tl.minimum(tl.maximum(ck.to(tl.int64) - t0, 0) >> FSHIFT, NBF - 1).to(tl.int32)
                tl.atomic_add(fine_ptr + r64 * NBF + fb, tl.full(fb.shape, 1, tl.int32), mask=cf, sem="relaxed")
            n += tl.sum(cf.to(tl.int32), 0)
            if READ_SCORES:
                cp = cp_n
                ck = ck_n
        tl.store(cnt_ptr + j, n)
        # 3) ticket: every thread's stores are issued (barrier) before the release; the last slice to arrive sees
        #    all slices' lists (acquire, loads through L2)
        tl.debug_barrier()
        ticket = tl.atomic_add(tick, 1, sem="acq_rel")
        if ticket == n_act - 1:
            tl.store(tick, 0)  # for the next call
            if CLEAR_HIST:
                tl.store(hrow + bins, tl.zeros([NB], tl.int32))
            i = tl.arange(0, CAP_P)
            qv = tl.arange(0, NSEL)
            cnt_v = tl.load(cnt_ptr + qv, mask=qv < n_act, other=0, cache_modifier=".cg")
            total = tl.sum(cnt_v, 0)
            over = tl.max(cnt_v, 0) - CAP
            if GROWS > 0:
                # the first CAP_P / GROWS entries of the lists of slices 0 .. GROWS - 1 (GROWS >= nsel), requested
                # together with the counts (no load waits on another); used when no slice has more (the usual case:
                # ~topk candidates spread over the nsel slices)
                SL: tl.constexpr = CAP_P // GROWS
                qg = tl.arange(0, GROWS)
                cg = tl.load(cnt_ptr + qg, mask=qg < n_act, other=0, cache_modifier=".cg")
                off2 = (qg * CAP)[:, None] + tl.arange(0, SL)[None, :]
                rp2 = tl.reshape(tl.load(pos_blk + off2, cache_modifier=".cg"), [CAP_P])
                k2 = tl.reshape(tl.load(key_blk + off2, cache_modifier=".cg"), [CAP_P])
                m2 = tl.reshape(tl.arange(0, SL)[None, :] < cg[:, None], [CAP_P])
                fits = tl.max(cg, 0) <= SL
            else:  # (never read: fits is false)
                rp2 = tl.zeros([CAP_P], tl.int32)
                k2 = tl.zeros([CAP_P], tl.int32)
                m2 = tl.zeros([CAP_P], tl.int1)
                fits = tl.zeros([], tl.int1)
            if SEARCH == "fine":  # read and clear the fine histogram on every path
                fbins = tl.arange(0, NBF)
                hf = tl.load(fine_ptr + r64 * NBF + fbins, cache_modifier=".cg")
                tl.store(fine_ptr + r64 * NBF + fbins, tl.zeros([NBF], tl.int32))
            if PROBE == 2:
                tl.store(out_row, total)
                return
            if (total < topk) | (total > CAP_P) | (over > 0):
                # fewer than topk positions reach t0 (only a histogram not written by this call's scores does that)
                # or more candidates than the register tile (mass ties): exact over the whole live row, streamed
                _select_streamed(srow, pos_blk, ln, topk, out_row, False, TILE)
            else:
                # 4) exact threshold T among the candidates (in registers; SELECT_SEARCH); 5) keys > T, then == T
                #    in position order
                if fits:  # the slices' lists side by side, gaps masked (position order among the valid entries)
                    m = m2
                    rp = rp2
                    keys = k2
                else:  # candidate i of the row is entry i - excl[q] of slice q (slices hold ascending position ranges)
                    src = tl.zeros([CAP_P], tl.int32)
                    excl = tl.zeros([], tl.int32)
                    for q in tl.static_range(NSEL):
                        c = tl.sum(tl.where(qv == q, cnt_v, 0), 0)
                        src = tl.where((i >= excl) & (i < excl + c), q * CAP + i - excl, src)
                        excl += c
                    m = i < total
                    rp = tl.load(pos_blk + src, mask=m, other=0, cache_modifier=".cg")
                    keys = tl.load(key_blk + src, mask=m, other=0, cache_modifier=".cg")
                if PROBE == 3:  # the candidates (and the fine histogram) are in registers
                    if SEARCH == "fine":
                        tl.store(out_row + 1, tl.sum(hf, 0))
                    tl.store(out_row, tl.sum(tl.where(m, keys, 0), 0))
                    return
                if SEARCH == "fine":
                    # the fine bin b holding the topk-th candidate (from the slices' atomics); the candidates'
                    # own counts above and in b decide (a stale histogram can only fall back, never mislead)
                    cf2 = tl.cumsum(hf, 0, reverse=True)
                    bsel = tl.max(tl.where(cf2 >= topk, fbins, 0), 0)
                    fk = tl.minimum((keys.to(tl.int64) - t0) >> FSHIFT, NBF - 1)
                    above, inb = tl.reduce(((m & (fk > bsel)).to(tl.int32), (m & (fk == bsel)).to(tl.int32)), 0,
                                           _add2)
                    ok = (bsel < NBF - 1) & (above < topk) & (above + inb >= topk)
                    if FAST_EXACT & ok & (above + inb == topk):
                        # the usual case: bin b holds exactly the missing ones, so the answer is every candidate in
                        # b or above (no threshold search, no tie handling)
                        take = m & (fk >= bsel)
                    else:
                        base = (m & (fk > bsel)) & (tl.zeros_like(m) | ok)  # (a scalar & a vector is not boolean
                        cand = m & ((fk == bsel) | (tl.zeros_like(m) | ~ok))  # in the interpreter)
                        kk = tl.where(ok, topk - above, topk)
                        c = tl.where(ok, inb, total)
                        if c - kk <= DROP_MAX:
                            # a few too many in the bin: drop its smallest values while >= kk remain
                            cur = cand
                            mn = tl.min(tl.where(cur, keys, 2147483647), 0)
                            nm = tl.sum((cur & (keys == mn)).to(tl.int32), 0)
                            while c - nm >= kk:
                                cur = cur & (keys != mn)
                                c -= nm
                                mn = tl.min(tl.where(cur, keys, 2147483647), 0)
                                nm = tl.sum((cur & (keys == mn)).to(tl.int32), 0)
                            thr = mn
                        else:
                            thr = _kth_largest_radix(keys, cand, kk, RADIX)
                        gt = base | (cand & (keys > thr))
                        eq = cand & (keys == thr)
                        need_eq = topk - tl.sum(gt.to(tl.int32), 0)
                        take = gt | (eq & (tl.cumsum(eq.to(tl.int32), 0) <= need_eq))
                else:
                    thr = _kth_largest_radix(keys, m, topk, RADIX)
                    gt = m & (keys > thr)
                    eq = m & (keys == thr)
                    need_eq = topk - tl.sum(gt.to(tl.int32), 0)
                    take = gt | (eq & (tl.cumsum(eq.to(tl.int32), 0) <= need_eq))
                tl.store(out_row + tl.cumsum(take.to(tl.int32), 0) - 1, rp, mask=take)

# ------------------------------------------------------------------------------------------------ host side

def _cfg(bn, w, tm, keys, stages, pf=False, wave=0, maxnreg=0, pv=0, epi=0):
    c = {"BLOCK_N": bn, "num_warps": w, "num_stages": stages, "TOKENS_M": tm, "PREFETCH": pf, "KEYS": keys}
    # optional: one-wave score split (WAVE programs per SM, see score_split), register cap per thread (ptxas .maxnreg),
    # tiles per page-id chunk of the fp8pv path (PV, default PV_TILES; see page_vector_consts), and the fp8pv path's
    # epilogue for one query token (EPI 1: _score_tile_1q; launches of several stacked tokens keep _score_tile)
    return dict(c, **({"WAVE": wave} if wave else {}), **({"MAXNREG": maxnreg} if maxnreg else {}),
                **({"PV": pv} if pv else {}), **({"EPI": epi} if epi else {}))


# Score-kernel configs (fixed, not autotuned, so a launch is capturable). TOKENS_M puts the key tile on the
# dot's M side (q^T on N), else the stacked queries are M. KEYS "packed": int32 tiles unpacked in registers, with
# a hand prefetch (PREFETCH) of the next tile; "fp8": fp8 tiles loaded as such, software-pipelined by Triton over
# num_stages (asynchronous copies into shared memory); "fp8pv": the same with the page ids of PV_TILES tiles loaded
# into registers at once (pages of >= BLOCK_N / 2 positions; smaller pages take the "fp8" path). Every config
# compiles for sm_120a with mma.sync and <= 99 KiB of shared memory, and for sm_90a, for 1, 2 and 4 stacked query
# tokens (tests/test_indexer.py; fp8pv 128/8 in 3 stages and 128/4 in 4 need > 99 KiB for 4 tokens).
# The last four (-s6) were candidates for the sm_90 fp8-query default (timed in -s7, see DEFAULT_FP8Q_SCORE_CONFIGS).
# SASS of the Triton 3.9 sm_90a decode build per key tile (benchmarks/kernels/indexer_sass.py): the pv24 default 511
# instructions / 6 barriers / 114 registers; with EPI 1 508; with EPI 1 and a 168-register cap 480 at 140 registers
# (shared memory still holds it to 3 programs per SM); 64-key tiles with EPI 1 at 80 registers 337 instructions / 4
# barriers per 64 keys and 33 KB of shared memory, so 6 programs (24 warps) per SM instead of 3 (12 warps): -s5 found
# the per-tile path the limit at 3 programs, more warps in flight is what this one tries; in 2 stages at 72 registers
# 317 instructions and 25 KB, 7 programs (28 warps) per SM, one 64-key tile in flight per program.
SCORE_CONFIGS = [
    _cfg(64, 4, True, "packed", 1, pf=True),
    _cfg(64, 8, True, "packed", 1, pf=True),
    _cfg(128, 8, True, "packed", 1, pf=True),
    _cfg(64, 4, True, "packed", 1, pf=False),
    _cfg(64, 4, False, "packed", 1, pf=True),
    _cfg(64, 4, True, "fp8", 2),
    _cfg(64, 4, True, "fp8", 3),
    _cfg(64, 4, True, "fp8", 4),
    _cfg(64, 8, True, "fp8", 3),
    _cfg(128, 8, True, "fp8", 3),
    _cfg(128, 4, True, "fp8", 3),
    _cfg(64, 4, False, "fp8", 3),
    _cfg(128, 4, True, "fp8pv", 3),
    _cfg(128, 4, True, "fp8pv", 3, wave=3, maxnreg=128),
    _cfg(128, 4, True, "fp8pv", 3, wave=3, maxnreg=128, pv=24),
    _cfg(128, 4, True, "fp8pv", 3, wave=3, maxnreg=128, pv=24, epi=1),
    _cfg(128, 4, True, "fp8pv", 3, wave=3, maxnreg=168, pv=24, epi=1),
    _cfg(64, 4, True, "fp8pv", 3, wave=6, maxnreg=80, pv=48, epi=1),
    _cfg(64, 4, True, "fp8pv", 2, wave=7, maxnreg=72, pv=48, epi=1),
]
# (sm_90?, stacked query tokens) -> config for a bf16 query. sm_90: the fastest configs of the H200 sweeps at 32K live
# / 128K max (S = 1: benchmarks/results/indexer_2026-11-30.md, keys on M 64/4 packed, 94.6 us vs 113.5 for heads on
# M at B=16, 209 vs 280 at B=64, and again the fastest with the histogram select: 67.0 / 188.5 us; S = 2 and 4: the
# -r2 sweep, fp8 tiles 64/4 in 2 stages (96.2 / 278.9 us vs 97.8 / 291.0 packed 64/8) and 128/4 in 3 stages
# (135.1 / 425.5 us vs 184.1 / 616.2) at B = 16 / 64; -r3 confirms S = 1 and 4, and has S = 2 the other way round
# within 5%: 108.5 / 309.2 vs 103.4 / 302.4). sm_120: chosen from AOT register counts (no spills; no sm_120 GPU to
# time on).
DEFAULT_SCORE_CONFIGS = {
    (False, 1): _cfg(64, 4, True, "packed", 1, pf=True),
    (False, 2): _cfg(64, 8, True, "packed", 1, pf=True),
    (False, 4): _cfg(64, 8, True, "packed", 1, pf=True),
    (True, 1): _cfg(64, 4, True, "packed", 1, pf=True),
    (True, 2): _cfg(64, 4, True, "fp8", 2),
    (True, 4): _cfg(128, 4, True, "fp8", 3),
}
# fp8 query overrides (fp8 x fp8 dots need no key conversion; the query SGLang's DSv4 decode passes): sm_90 S = 1:
# fp8 tiles 128/4 in 3 stages with the page ids in registers ("fp8pv"), picked in the -s4 run (full step at 32K,
# B = 16 / 64: 42.6 / 111.0 us vs 42.2 / 116.9 with the per-position page lookup "fp8" 128/4 of r2 / s3, and 45.7 /
# 129.1 with fp8pv 64/4 in 4 stages; scores alone at B = 64 87.0 vs 93.8). Earlier: fp8 128/4 beat the bf16 default
# (49.7 / 114.3 vs 51.0 / 122.2), 64/4 and 128/8 tiles, a 4th stage and a two-tiles-ahead scale prefetch. Not kept
# (-s4 exploration): fp8 tiles loaded into registers a tile or two ahead by hand (num_stages 1) and stored to shared
# memory for the dot, 40-102 us for the scores alone at B = 16 (fewer programs per SM, loads through registers).
# -s4b (benchmarks/results/indexer_2026-11-30-s4b.md): the same tiles split in one wave ("_wave3": 3 programs of
# 57 KB shared memory fit on an SM, so B = 16 runs 24 programs of 11 tiles per request instead of 64 of 4 in 2.6
# waves; B = 64 keeps 17 per request, see score_split): full step at 32K B = 16 40.2 vs 42.7 us in the pick (41.0 vs
# 43.1 in the sweep, the scores alone 27.0 vs 29.1), B = 64 110.9 vs 110.5; around it n_split 22 / 26 (26 x 16 > 396
# slots: a second wave) / 48: 41.4 / 47.2 / 42.0. 2 stages in one wave of 4 per SM (41 KB, 128 registers) tied at
# B = 16 (40.3) and lost at B = 64 (114.7 with 8 per request); not kept. maxnreg 128 as measured (4 programs'
# registers; shared memory holds it to 3).
# -s5 (benchmarks/results/indexer_2026-11-30-s5.md): the same tiles with the page ids of 24 tiles per chunk ("_pv24",
# two warp-wide register vectors): a program's share of a 32K row (11 tiles at B = 16, 16 at B = 64) is one chunk, so
# its key pipeline fills and drains once instead of at every 8 tiles; pick, full step B = 16 / 64: 40.5 / 109.6 us vs
# 41.1 / 112.3 (exploration run 39.3 / 111.7 vs 40.6 / 114.1; the scores alone at B = 16 25.4 vs 27.2).
# Measured in the exploration run and not kept: 4 stages (74 KB, still 3 programs per SM) 42.5 / 117.9 (41.3 / 114.3
# with pv24), 8 warps with 80 registers (6 warps per scheduler) 42.0 / 118.1 in 3 stages and 43.5 / 121.6 in 4
# (Nsight Compute on 4 stages: 56% of DRAM peak, 3 warps per scheduler issuing every 6 cycles, as with 3 stages: not
# short of copies in flight).
# -s7 (benchmarks/results/indexer_2026-11-30-s7-pick.md, the pick of the five, full step at 32K, B = 16 / 64):
# 64-key tiles, EPI 1, 80 registers, 6 programs per SM in one wave, page ids of 48 tiles per chunk: 38.3 / 103.8 us vs
# the -s5 default 39.5 / 109.6; the same -s5 tiles with EPI 1 37.6 / 108.0 (168 registers: 37.6 / 108.4), 64-key
# tiles in 2 stages at 72 registers 38.1 / 106.0. Committed run (indexer_2026-11-30-s7.md): 39.7 / 104.7 vs 40.5 /
# 109.6 with the -s5 default.
DEFAULT_FP8Q_SCORE_CONFIGS = {
    (True, 1): _cfg(64, 4, True, "fp8pv", 3, wave=6, maxnreg=80, pv=48, epi=1),
}
S_CHUNK = 4  # query tokens stacked per score launch (S > 4: several launches)
SELECT_WARPS = (4, 8, 16)
DEFAULT_SELECT_WARPS = 8
HIST_BINS = 4096  # per-row histogram of group maxima: top 12 bits of the order key (1/8-binade bins)
HIST_SHIFT = 20
RADIX_BITS = 6  # bits per radix-select pass (64-bin warp histograms; 8 bits was slower in -s3, below)
MAX_TILE_P = 4096  # register tile of the final threshold search
SELECT_SPLIT = 16  # select programs per query row at most (slices of its group maxima); sizes the workspace
SELECT_TGS = 256  # group maxima per select tile (a 32K-long row: one tile for each of the 16 slices)
# select programs to aim for in all (B=16: 16 per row, B=64: 4): every program reads the row's 16 KB histogram, so
# more per row cost more than they save at B=64 (H200 -s3 sweep at 32K: B=16 1/2/4/8/16 per row 68.8/58.6/52.7/49.9/
# 49.5 us; B=64 135.4/123.1/120.5/123.2/129.7 us)
SELECT_PROGRAMS = 256
_SELECT_PROBE = 0  # benchmark only: stop the select after a phase (see _select_topk_kernel)
_SCORES_PROBE = 0  # benchmark only: 1 = scores without histogram atomics, 2 = also without stores (wrong output)
# final threshold search: "fine" (the slices count their candidates into a per-row histogram of fine bins above
# t0 with atomics, so the final program reads the bin holding the topk-th candidate and only resolves that bin: by
# dropping its smallest values when a few too many, else radix select on it) or "radix" (radix select over all
# candidates, RADIX_BITS a pass: s3's default; Triton 3.9's PTX for tl.histogram is one shared-memory atomic per
# key, which collide when the candidates' top digits agree). H200 -s4 (benchmarks/results/indexer_2026-11-30-s4.md,
# 32K, fp8 query): B = 16 43.6 us vs radix 45.7, B = 64 110.8 vs 113.1; the select alone at B = 16 14.8 vs s3's 17.4;
# exploration run: 4K B = 16 21.8 vs 26.7. (s3: an 8-way count search, 48.7 / 119.9, slower than radix, is gone.)
SELECT_SEARCH = "fine"
# launch the select kernel with programmatic dependent launch (compute capability >= 9): its programs are placed on
# the SMs while the scores kernel's last programs run, and wait there (griddepcontrol.wait) for its results. -s4 at
# 32K: B = 16 43.6 us vs 45.1 without, B = 64 110.8 vs 113.4
SELECT_PDL = True
# the final select program reads the slices' candidate lists as one [n, cap / n] tile (n = nsel rounded up to a power of
# two) together with their counts, one round trip, when no slice has more than cap / n candidates; else (and with
# False) it loads the counts first and then gathers the lists back to back
SELECT_GATHER2D = True
# the final select program takes every candidate in the fine bin of the topk-th one or above when that bin holds
# exactly the missing ones (the usual case), without the threshold search over the bin
SELECT_FAST_EXACT = True
# -s5 (benchmarks/results/indexer_2026-11-30-s5.md, --pick-select, full step at 32K, B = 16 / 64, fp8pv _pv24 scores):
# both on 40.1 / 111.2 us, both off (the s4 select) 40.6 / 111.3, one-tile read off 40.0 / 112.6, fast path off 40.5 /
# 111.0: within the run's spread in the full step; the select alone at B = 16 13.1 vs 14.4 us (phase probes: the
# final program's loads 0.9 us, its threshold and output 2.8 us). Dropped there: slices requesting the next group-max
# tile's candidate scores ahead (B = 64 at 32K has 4 tiles per slice): 110.9 at B = 64, 40.7 at B = 16.
# the select slices read their scores whole (a tile of SELECT_TGS * GROUP positions requested with the histogram)
# instead of the group maxima and then a gather of the groups reaching t0 (one dependent round trip less; same
# candidates, same output). The scores kernel still stores the group maxima: without that store its histogram atomics
# need a layout conversion of their own (-s6 SASS: 540 instead of 512 instructions per tile). -s7 pick (B = 16 / 64 at
# 32K): on 38.8 / 105.3 us, off 37.9 / 106.3; in the sweep on 38.3 / 102.4 vs 38.1 / 102.9: no gain outside the run's
# spread
SELECT_READS_SCORES = False
# Not kept (-s7, benchmarks/results/indexer_2026-11-30-s7-explore.md; the code is at commit 9e31b1d): the selection
# inside the score kernel (each score program keeps its positions above the row's histogram bound as it stands at its
# end, the row's last program selects): exact, but B = 16 / 64 at 32K 53.2 / 120.1 us vs 37.7 / 102.6 with the two
# kernels; the per-program tail alone added 7.7 us to the 24.4 us scores (early programs see a loose bound).
FINE_BINS = 4096  # fine histogram of the candidates (SELECT_SEARCH "fine"): bins of 2**FINE_SHIFT order keys above t0
FINE_SHIFT = 11  # 4096 x 2**11 = one binade above t0 (the topk-th score lies within it unless scores are extreme)
PV_TILES = 8  # "fp8pv" score path: key tiles per chunk of page ids loaded into registers at once
MIN_TILES = 4  # tiles per score program at least (fewer, larger programs for short rows)
# score programs per SM to aim for (configs without WAVE, or batches too large for a one-wave split): ~3 fit at once
# (~150 registers x 128 threads), so 8 keeps the last partial wave small; each still gets >= MIN_TILES tiles (the
# benchmark sweep times splits around the default)
PROGRAMS_PER_SM = 8
MIN_WAVE_SPLIT = 8  # one-wave score splits (config WAVE) only down to this many programs per request


def score_split(batch: int, cfg: dict, sms: int) -> int:
    """Score programs per request (grid dim 1, at most 64). A config with ``WAVE`` = w (w of its programs fit on an
    SM at once) launches at most w * sms programs in all, one wave, so each program fills its key pipeline once for
    more tiles and no small last wave idles the GPU, when that still splits a request over >= MIN_WAVE_SPLIT
    programs; otherwise (and for configs without WAVE) ~PROGRAMS_PER_SM programs per SM, several waves."""
    wave = cfg.get("WAVE", 0) * sms // batch
    if wave >= MIN_WAVE_SPLIT:
        return min(64, wave)
    return max(1, min(64, triton.cdiv(PROGRAMS_PER_SM * sms, batch)))


def page_vector_consts(block_n: int, page_size: int, tiles: int = 0):
    """(tiles per page-id chunk, page ids per register vector as a power of two, two vectors?) of the "fp8pv" score
    path for chunks of ``tiles`` tiles (0: PV_TILES), or (tiles, 0, False) when a tile can span more than two pages
    (page_size < block_n / 2; that path then does not apply). A chunk needs tiles * block_n / page_size + 1 page ids;
    more than 32 go into two vectors (PAIR), each within one warp. Raises ValueError for a chunk of more than 64."""
    tiles = tiles or PV_TILES
    if 2 * page_size < block_n:
        return tiles, 0, False
    need = tiles * block_n // page_size + 1
    if need > 64:
        _fail("config", f"PV = {tiles} tiles of {block_n} need {need} page ids of {page_size} tokens, at most 64")
    if need <= 32:
        return tiles, triton.next_power_of_2(need), False
    return tiles, triton.next_power_of_2(triton.cdiv(need, 2)), True


def candidate_capacity(topk: int) -> int:
    """Candidate positions (scores >= the histogram bound) the select kernel handles in registers without its
    streamed fallback, per row and per slice: 4x the next power of two of topk, at most MAX_TILE_P (the bound
    admits about topk positions plus those of one 1/8-binade bin)."""
    return min(MAX_TILE_P, 4 * triton.next_power_of_2(topk))


_tile_p = candidate_capacity


def _workspace_layout(rows: int, max_len: int, topk: int):
    """(groups per row, candidate capacity, per-row scratch, int32 elements in all): scores [rows, max_len],
    group maxima [rows, ng], histograms [rows, HIST_BINS], select tickets [rows], fine histograms [rows, FINE_BINS],
    scratch [rows, SELECT_SPLIT * (2 * cap + 1)] (per slice: candidate positions [cap] and keys [cap]; then one count
    per slice)."""
    ng = triton.cdiv(max_len, GROUP)
    cap = candidate_capacity(topk)
    scr = SELECT_SPLIT * (2 * cap + 1)
    return ng, cap, scr, rows * (max_len + ng + HIST_BINS + 1 + FINE_BINS + scr)


def indexer_workspace(batch: int, s: int, max_len: int, topk: int = 512, device="cuda") -> torch.Tensor:
    """A reusable, zero-initialized int32 workspace for ``dsa_indexer_topk(..., workspace=...)``: fp32 scores
    [B*S, max_len], group maxima [B*S, max_len / 8], group-max histograms [B*S, 4096], select tickets [B*S],
    fine candidate histograms [B*S, 4096] and candidate scratch [B*S, 16 * (8 * min(4096, 4 * next_pow2(topk)) + 4)
    bytes]; 4.5 bytes per position of the block table plus ~300 KB per query token at topk 512. ``max_len`` =
    block_table.shape[1] * page_size. Allocate once per (max batch, max context) so a CUDA graph captures fixed
    addresses. Each call leaves the histograms and tickets zeroed for the next; a workspace with nonzero histograms
    (never passed through a full call) still gives exact results, one call more slowly."""
    return torch.zeros(_workspace_layout(batch * s, max_len, topk)[3], dtype=torch.int32, device=device)


def _fail(name, msg):
    raise ValueError(f"{name}: {msg}")


def _check_cache(index_k_cache, page_size):
    """Flat int32 view of the cache (4 fp8 keys per element) after checking its layout."""
    if not isinstance(index_k_cache, torch.Tensor):
        _fail("index_k_cache", f"must be a torch.Tensor, got {type(index_k_cache).__name__}")
    if index_k_cache.dtype not in (torch.uint8, torch.int8, torch.float8_e4m3fn):
        _fail("index_k_cache", f"must hold bytes (uint8, int8 or float8_e4m3fn), got {index_k_cache.dtype}")
    row = page_size * BYTES_PER_TOKEN
    shape = tuple(index_k_cache.shape)
    if index_k_cache.dim() == 2:
        if shape[1] != row:
            _fail("index_k_cache", f"2-D cache must be [num_pages, page_size * 132] = [P, {row}] for page_size "
                                   f"{page_size}, got {shape}")
    elif index_k_cache.dim() == 4:
        if shape[1:] != (page_size, 1, BYTES_PER_TOKEN):
            _fail("index_k_cache", f"4-D cache must be [num_pages, {page_size}, 1, 132] (DeepGEMM's view), got {shape}")
    else:
        _fail("index_k_cache", f"must be [num_pages, page_size * 132] or [num_pages, page_size, 1, 132], got {shape}")
    if not index_k_cache.is_contiguous():
        _fail("index_k_cache", "must be contiguous (SGLang's per-layer page buffer or a view of it)")
    if index_k_cache.data_ptr() % 16:
        _fail("index_k_cache", "must be 16-byte aligned")
    return index_k_cache.view(torch.uint8).reshape(-1).view(torch.int32)


def _check_lengths(seq_lens, b, s, dev):
    if not isinstance(seq_lens, torch.Tensor) or seq_lens.dtype not in (torch.int32, torch.int64):
        _fail("seq_lens", f"must be an int32/int64 tensor, got {getattr(seq_lens, 'dtype', type(seq_lens).__name__)}")
    if tuple(seq_lens.shape) not in ((b,), (b, s)) or not seq_lens.is_contiguous():
        _fail("seq_lens", f"must be contiguous [{b}] (request lengths) or [{b}, {s}] (per query token), got "
                          f"{tuple(seq_lens.shape)}")
    if seq_lens.device != dev:
        _fail("seq_lens", f"must be on {dev} (read on the device), got {seq_lens.device}")
    return seq_lens.dim() == 2


def _check_out(out, shape, dev):
    if out is None:
        return torch.empty(shape, dtype=torch.int32, device=dev)
    if not isinstance(out, torch.Tensor) or out.dtype != torch.int32 or tuple(out.shape) != shape \
            or not out.is_contiguous() or out.device != dev:
        _fail("out", f"must be a contiguous int32 tensor {list(shape)} on {dev}")
    return out


def _check_topk(topk):
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= MAX_TOPK:
        _fail("topk", f"must be an int in [1, {MAX_TOPK}], got {topk!r}")


def _check_warps(select_warps, topk):
    # 8 warps hold topk 512's register tiles without spills; larger topk needs 16 (AOT register counts)
    warps = select_warps or (DEFAULT_SELECT_WARPS if topk <= 1024 else 16)
    if warps not in SELECT_WARPS:
        _fail("select_warps", f"must be one of {SELECT_WARPS}, got {select_warps!r}")
    return warps


def _workspace_views(workspace, rows, max_len, topk, dev):
    ng, cap, scr, n = _workspace_layout(rows, max_len, topk)
    if workspace is None:
        workspace = torch.empty(n, dtype=torch.int32, device=dev)
        # histograms, tickets, fine histograms
        workspace[rows * (max_len + ng): rows * (max_len + ng + HIST_BINS + 1 + FINE_BINS)].zero_()
    elif not isinstance(workspace, torch.Tensor) or workspace.dtype != torch.int32 or workspace.numel() < n \
            or not workspace.is_contiguous() or workspace.device != dev:
        _fail("workspace", f"must be a contiguous int32 tensor of >= {n} elements on {dev} (indexer_workspace())")
    ws = workspace.view(-1)
    o1, o2, o3 = rows * max_len, rows * (max_len + ng), rows * (max_len + ng + HIST_BINS)
    o4 = o3 + rows
    o5 = o4 + rows * FINE_BINS
    return (ws[:o1].view(torch.float32), ws[o1:o2].view(torch.float32), ws[o2:o3], ws[o3:o4], ws[o4:o5], ws[o5:n],
            ng, cap)


def _interp(name, default):
    # small tiles under the interpreter so tests reach the multi-tile and streamed paths at tiny shapes
    return int(os.environ.get(name, default))


def _select_split(rows, select_split):
    if select_split is None:  # ~SELECT_PROGRAMS programs in all: every program reads the row's histogram
        return max(1, min(SELECT_SPLIT, triton.cdiv(SELECT_PROGRAMS, rows)))
    if isinstance(select_split, bool) or not isinstance(select_split, int) or not 1 <= select_split <= SELECT_SPLIT:
        _fail("select_split", f"must be an int in [1, {SELECT_SPLIT}], got {select_split!r}")
    return select_split


def _select_launch(scores, gmax, hist, tick, fine, scr, lens, out, rows, s, max_len, stride_row, ng, cap, topk,
                   len_2d, warps, nsel, clear_hist=True, pdl=False):
    cap_p = cap if not _INTERPRET else min(cap, _interp("PD_INDEXER_INTERP_TILE_P", cap))
    _select_topk_kernel[(rows, nsel)](
        scores, gmax, hist, tick, fine, scr, lens, out, s, max_len, stride_row, ng, topk,
        LEN_2D=len_2d, G=GROUP, NB=HIST_BINS, SHIFT=HIST_SHIFT, NSEL=SELECT_SPLIT, CAP=cap, CAP_P=cap_p,
        TGS=SELECT_TGS if not _INTERPRET else _interp("PD_INDEXER_INTERP_TGS", 8),
        TILE=1024 if not _INTERPRET else 16, RADIX=RADIX_BITS, CLEAR_HIST=clear_hist, PROBE=_SELECT_PROBE,
        SEARCH=SELECT_SEARCH, NBF=FINE_BINS, FSHIFT=FINE_SHIFT, PDL=pdl,
        GROWS=min(triton.next_power_of_2(nsel), cap_p) if SELECT_GATHER2D else 0, FAST_EXACT=SELECT_FAST_EXACT,
        READ_SCORES=SELECT_READS_SCORES,
        num_warps=warps, **({"launch_pdl": True} if pdl else {}),
    )


def dsa_indexer_topk(q, weights, index_k_cache, block_table, seq_lens, topk=512, page_size=64, out=None, *,
                     q_scale=None, workspace=None, n_split=None, config=None, select_warps=None,
                     select_split=None, stages=("scores", "select")):
    """Top-``topk`` index positions per query token of the DSA lightning indexer (decode / MTP verify).

    Args:
      q: [B, S, H, 128] bfloat16, or float8_e4m3fn (then ``q_scale`` or weights carry its scales); H in
         {16, 32, 64, 128}; innermost dim contiguous. S <= 8 (S > 1: MTP verify tokens; up to 4 share one
         pass over the keys).
      weights: [B, S, H] float32 or bfloat16 per-head weights, as SGLang passes them (already scaled by
         n_heads**-0.5 * head_dim**-0.5 and, for an fp8 query, usually by the query scale).
      index_k_cache: SGLang's index-key buffer of one layer, uint8 [num_pages, page_size * 132] (or its
         [num_pages, page_size, 1, 132] view; int8 / float8_e4m3fn bytes accepted); layout in
         ``pd.kernels.indexer_reference``.
      block_table: int32 [B, max_pages] physical page of each logical page (SGLang's page_table_64); its width
         sets the max context ``max_len = max_pages * page_size`` that the workspace is sized for.
      seq_lens: int32/int64 on the device, [B] request lengths including the S query tokens (query token s
         sees positions [0, seq_lens[b] - S + 1 + s)) or [B, S] per-token live lengths; clamped to
         [0, max_len].
      topk: 1 .. 2048 (DSv4: 512). page_size: 1 .. 256, a power of two (SGLang: 64).
      out: optional int32 [B, S, topk] output (written fully).
      q_scale: optional float32 [B, S, H] contiguous, multiplied into the weights (fp8 query only).
      workspace: optional int32 tensor from ``indexer_workspace(B, S, max_len, topk)``, used by this function
         only; allocated per call when None (inside a CUDA graph capture that is the graph's private pool).
      n_split, config, select_warps, select_split, stages: benchmark knobs: score programs per request,
         score-kernel config (one of SCORE_CONFIGS), warps and programs per query token (1 .. 16) of the select
         kernel, which of the two kernels to launch (a select-only call keeps the histograms the previous
         scores-only call left).

    Returns: int32 [B, S, topk]: ascending logical positions of the topk highest scores in each query token's
      live range (set-equal to torch.topk up to ties), or 0 .. L-1 then -1 when L <= topk.

    Raises: ValueError naming the argument for a wrong type, dtype, shape, layout, device or value, before any
      launch. Block-table entries of live pages must be valid page ids of the cache (not checked: that would
      need a device sync).
    """
    if not isinstance(q, torch.Tensor) or q.dtype not in (torch.bfloat16, torch.float8_e4m3fn) or q.dim() != 4 \
            or q.shape[-1] != INDEX_DIM:
        _fail("q", f"must be a bfloat16 or float8_e4m3fn tensor [B, S, H, {INDEX_DIM}], got "
                   f"{getattr(q, 'dtype', type(q).__name__)} {tuple(getattr(q, 'shape', ()))}")
    b, s, h, _ = q.shape
    if h not in SUPPORTED_HEADS:
        _fail("q", f"number of heads must be one of {SUPPORTED_HEADS}, got {h}")
    if not 1 <= s <= MAX_S:
        _fail("q", f"query tokens per request S must be in [1, {MAX_S}], got {s}")
    if b < 1:
        _fail("q", "batch must be >= 1")
    if q.stride(-1) != 1:
        _fail("q", "the head dim must be contiguous (stride(-1) == 1)")
    dev = q.device
    if not isinstance(weights, torch.Tensor) or weights.dtype not in (torch.float32, torch.bfloat16) \
            or tuple(weights.shape) != (b, s, h) or weights.stride(-1) != 1:
        _fail("weights", f"must be a float32/bfloat16 tensor [{b}, {s}, {h}] with stride(-1) == 1, got "
                         f"{getattr(weights, 'dtype', None)} {tuple(getattr(weights, 'shape', ()))}")
    if weights.device != dev:
        _fail("weights", f"must be on {dev}, got {weights.device}")
    if q_scale is not None:
        if q.dtype != torch.float8_e4m3fn:
            _fail("q_scale", "is only valid with a float8_e4m3fn q")
        if not isinstance(q_scale, torch.Tensor) or q_scale.dtype != torch.float32 \
                or tuple(q_scale.shape) != (b, s, h) or not q_scale.is_contiguous() or q_scale.device != dev:
            _fail("q_scale", f"must be a contiguous float32 tensor [{b}, {s}, {h}] on {dev}")
        if weights.stride() != q_scale.stride():
            _fail("weights", "must have the same strides as q_scale (both contiguous)")
    _check_topk(topk)
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size not in SUPPORTED_PAGE_SIZES:
        _fail("page_size", f"must be a power of two in [1, 256], got {page_size!r}")
    kc32 = _check_cache(index_k_cache, page_size)
    if index_k_cache.device != dev:
        _fail("index_k_cache", f"must be on {dev}, got {index_k_cache.device}")
    if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 or block_table.dim() != 2 \
            or block_table.shape[0] != b or block_table.shape[1] < 1 or block_table.stride(1) != 1:
        _fail("block_table", f"must be an int32 tensor [{b}, max_pages] with stride(1) == 1, got "
                             f"{getattr(block_table, 'dtype', None)} {tuple(getattr(block_table, 'shape', ()))}")
    if block_table.device != dev:
        _fail("block_table", f"must be on {dev}, got {block_table.device}")
    len_2d = _check_lengths(seq_lens, b, s, dev)
    out = _check_out(out, (b, s, topk), dev)
    max_len = block_table.shape[1] * page_size
    if max_len >= 2 ** 31 // 2:
        _fail("block_table", f"max context {max_len} tokens is too large")
    if config is not None and config not in SCORE_CONFIGS:
        _fail("config", f"must be one of SCORE_CONFIGS, got {config!r}")
    warps = _check_warps(select_warps, topk)
    nsel = _select_split(b * s, select_split)
    if n_split is not None and (isinstance(n_split, bool) or not isinstance(n_split, int) or n_split < 1):
        _fail("n_split", f"must be a positive int, got {n_split!r}")

    rows = b * s
    scores, gmax, hist, tick, fine, scr, ng, cap = _workspace_views(workspace, rows, max_len, topk, dev)
    check_runnable("q", q, "pd.kernels.indexer_reference")  # after every argument check: they name bad input
    q_fp8 = q.dtype == torch.float8_e4m3fn
    pdl = SELECT_PDL and not _INTERPRET and dev.type == "cuda" and torch.cuda.get_device_capability(dev)[0] >= 9
    qs = q_scale if q_scale is not None else weights
    sm90 = is_sm90(dev)
    k8 = kc32.view(torch.float8_e4m3fn)
    for s0 in range(0, s, S_CHUNK) if "scores" in stages else ():
        sc = min(S_CHUNK, s - s0)
        sp2 = triton.next_power_of_2(sc)
        cfg = dict(config or (q_fp8 and DEFAULT_FP8Q_SCORE_CONFIGS.get((sm90, sp2)))
                   or DEFAULT_SCORE_CONFIGS[(sm90, sp2)])
        if _INTERPRET:
            cfg["BLOCK_N"] = 32  # small tiles keep interpreted runs short
        ch, npv, pair = page_vector_consts(cfg["BLOCK_N"], page_size, cfg.get("PV", 0))
        if cfg["KEYS"] == "fp8pv" and not npv:
            cfg["KEYS"] = "fp8"  # pages smaller than half a tile: page ids per position (the fp8 path)
        ns = n_split or score_split(b, cfg, num_sms(dev))
        _index_scores_kernel[(b, ns)](
            q, weights, qs, kc32, k8, kc32.view(torch.float32), block_table, seq_lens, scores, gmax, hist,
            q.stride(0), q.stride(1), q.stride(2), weights.stride(0), weights.stride(1), block_table.stride(0),
            max_len, ng, ns, topk, s, s0,
            S=sc, S_P2=sp2, H=h, PAGE=page_size, BLOCK_N=cfg["BLOCK_N"], G=GROUP, LEN_2D=len_2d,
            HAS_QS=q_scale is not None, Q_FP8=q_fp8, MIN_TILES=MIN_TILES, DOT_F32=_INTERPRET,
            TOKENS_M=cfg["TOKENS_M"], PREFETCH=cfg["PREFETCH"], DOT_PREC="ieee" if _INTERPRET else "tf32",
            KEYS=cfg["KEYS"], NB=HIST_BINS, SHIFT=HIST_SHIFT, PROBE=_SCORES_PROBE, PDL=pdl, CH=ch, NPV=max(npv, 2),
            PAIR=pair, EPI=cfg.get("EPI", 0) if sc == 1 else 0,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
            **({"maxnreg": cfg["MAXNREG"]} if cfg.get("MAXNREG") else {}),
        )
    if "select" in stages:
        _select_launch(scores, gmax, hist, tick, fine, scr, seq_lens, out, rows, s, max_len, max_len, ng, cap, topk,
                       len_2d, warps, nsel, clear_hist="scores" in stages, pdl=pdl and "scores" in stages)
    return out


def topk_from_scores(scores, lengths, topk=512, out=None, *, select_warps=None):
    """Exact top-k of precomputed scores over each row's live prefix (the select stage of ``dsa_indexer_topk``).

    scores: float32 [R, W], stride(1) == 1; lengths: int32/int64 [R] on the same device (live prefix, clamped to
    [0, W]); returns int32 [R, topk]: ascending positions of the topk highest scores of ``scores[r, :L]``
    (set-equal to torch.topk up to ties; NaN ranks above +inf), or 0 .. L-1 then -1 when L <= topk. Capture-safe
    like ``dsa_indexer_topk``. Raises ValueError naming the argument.
    """
    if not isinstance(scores, torch.Tensor) or scores.dtype != torch.float32 or scores.dim() != 2 \
            or scores.stride(1) != 1 or scores.shape[0] < 1 or scores.shape[1] < 1:
        _fail("scores", f"must be a float32 tensor [R, W] with stride(1) == 1, got "
                        f"{getattr(scores, 'dtype', None)} {tuple(getattr(scores, 'shape', ()))}")
    r, w = scores.shape
    dev = scores.device
    _check_topk(topk)
    if not isinstance(lengths, torch.Tensor) or lengths.dtype not in (torch.int32, torch.int64) \
            or tuple(lengths.shape) != (r,) or not lengths.is_contiguous() or lengths.device != dev:
        _fail("lengths", f"must be a contiguous int32/int64 tensor [{r}] on {dev}")
    out = _check_out(out, (r, topk), dev)
    warps = _check_warps(select_warps, topk)
    check_runnable("scores", scores, "pd.kernels.indexer_reference")
    ng = triton.cdiv(w, GROUP)
    cap = candidate_capacity(topk)
    gmax = torch.empty(r, ng, dtype=torch.float32, device=dev)
    hist = torch.zeros(r, HIST_BINS, dtype=torch.int32, device=dev)
    tick = torch.zeros(r, dtype=torch.int32, device=dev)
    fine = torch.zeros(r, FINE_BINS, dtype=torch.int32, device=dev)
    scr = torch.empty(r, SELECT_SPLIT * (2 * cap + 1), dtype=torch.int32, device=dev)
    block = 256 if not _INTERPRET else 32
    n_split = max(1, min(64, triton.cdiv(PROGRAMS_PER_SM * num_sms(dev), r)))
    _group_max_kernel[(r, n_split)](scores, gmax, hist, lengths, scores.stride(0), ng, n_split, w, topk,
                                    G=GROUP, BLOCK=block, MIN_TILES=MIN_TILES, NB=HIST_BINS, SHIFT=HIST_SHIFT,
                                    num_warps=4)
    _select_launch(scores, gmax, hist, tick, fine, scr, lengths, out, r, 1, w, scores.stride(0), ng, cap, topk, True,
                   warps, _select_split(r, None))
    return out
