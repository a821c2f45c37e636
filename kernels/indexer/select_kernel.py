"""The indexer's exact top-k: ``_select_topk_kernel`` (see the package docstring) and its helpers: radix select in
registers, the streamed fallbacks over a whole row. The helpers live beside the kernel on purpose: the interpreter
tests count the fallback calls by replacing them in this module's globals."""

from __future__ import annotations

import triton
import triton.language as tl

from .jit_helpers import _order_key, _row_len


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
    CLEAR_HIST: tl.constexpr, SEARCH: tl.constexpr = "fine",
    NBF: tl.constexpr = 4096, FSHIFT: tl.constexpr = 11, DROP_MAX: tl.constexpr = 8, PDL: tl.constexpr = False,
    GROWS: tl.constexpr = 0, FAST_EXACT: tl.constexpr = False, READ_SCORES: tl.constexpr = False,
):
    # program (r, j): slice j of query row r's group maxima (whole tiles of TGS groups, spread over the grid's
    # nsel <= NSEL programs per row); the last active program of the row to finish does the row's final selection.
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
