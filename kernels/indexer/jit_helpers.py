"""``@triton.jit`` helpers shared by the indexer's kernels: order keys, key-cache tile loads (packed int32, fp8, page
ids in registers), query loads, live lengths, histogram bins."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _order_key(x):
    """fp32 -> int32 whose signed order is the float order (-0.0 sorts just below +0.0; NaN above +inf)."""
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)



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
