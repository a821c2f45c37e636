"""``@triton.jit`` helpers of the MXFP4 MoE kernels: bf16 rounding, weight / scale / activation pointers and loads
per layout, the dequantize + dot steps, L2 prefetches, row blocks, SwiGLU."""

from __future__ import annotations

import triton
import triton.language as tl

from .layouts import TILE_ELEMS, TILE_ROWS, TILE_SCALES
from .ptx import _E2M1_BITS_ASM, _E2M1_PREP_ASM, _PREFETCH_L2_ASM, _PREFETCH_L2_LAST_ASM, _UE8M0_FACTOR_ASM, PF_LINE


@triton.jit
def _rne_bf16(x):
    """fp32 -> nearest bf16 (ties to even), kept in fp32 (the interpreter truncates in ``.to(tl.bfloat16)``)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _to_bf16_f32(x, ROUND: tl.constexpr):
    if ROUND:
        return _rne_bf16(x)
    return x.to(tl.bfloat16).to(tl.float32)



@triton.jit
def _tiled_rows(rows, KE: tl.constexpr, TE: tl.constexpr):
    """WL >= 2: the element offset of each row's first tile (rows: int tensor of row indices, KE: elements per row,
    TE: elements per row of a tile)."""
    return (rows // TILE_ROWS) * (TILE_ROWS * KE) + (rows % TILE_ROWS) * TE


@triton.jit
def _tile_col(c, TW: tl.constexpr):
    """WL >= 2: the offset of column c of a row from the row's first tile (TW columns per row of a tile)."""
    return (c // TW) * (TILE_ROWS * TW) + c % TW


@triton.jit
def _w_ptrs(base, rows, KE: tl.constexpr, kb, WL: tl.constexpr):
    """[len(rows), len(kb)] weight element pointers: rows ``rows``, elements ``kb`` of the row (WL 0 / 1: from
    ``base``, which holds the program's K start; WL >= 2: of the row's first tile, ``_w_step`` adds the K offset)."""
    if WL >= 2:
        return base + _tiled_rows(rows, KE, TILE_ELEMS)[:, None] + kb[None, :]
    else:
        return base + rows[:, None] * KE + kb[None, :]


@triton.jit
def _w_step(ptrs, m, j_off: tl.constexpr, WL: tl.constexpr, STEP: tl.constexpr, ALIGNED: tl.constexpr):
    """The weight pointers of a dequantize + dot step ``j_off`` elements into the stage that starts at row element
    ``m``: WL 0 / 1 ``ptrs + j_off`` (the K loop advances ``ptrs``, ``_next_stage``); WL >= 2 the tile offset of element
    m + j_off (a multiple of STEP <= 64: the step stays inside one tile) added to the row offsets. ALIGNED: every
    stage starts a tile (m % 64 == 0), so the offset is m * 32 plus a constant (no division in the K loop)."""
    if WL >= 2:
        if ALIGNED:
            jo = tl.constexpr(j_off)  # the interpreter passes a plain int
            return ptrs + m * TILE_ROWS + ((jo // TILE_ELEMS) * (TILE_ROWS * TILE_ELEMS) + jo % TILE_ELEMS)
        else:
            return ptrs + tl.multiple_of(_tile_col(m + j_off, TILE_ELEMS), STEP)
    else:
        return ptrs + j_off


@triton.jit
def _next_stage(ptrs, n: tl.constexpr, WL: tl.constexpr):
    """The weight or scale pointers of the next stage (``n`` elements or bytes on; WL >= 2 keeps the row offsets,
    ``_w_step`` / ``_s_step`` add the stage's)."""
    if WL >= 2:
        return ptrs
    else:
        return ptrs + n


@triton.jit
def _s_ptrs(base, rows, KS: tl.constexpr, ks, WL: tl.constexpr):
    """Scale byte pointers: [len(rows), len(ks)] (``base`` holds the program's K start), or WL 2 (scales tiled like
    the weights: [32 rows x 8 bytes] tiles) the rows' first-tile pointers [len(rows), 1] (``_s_step`` adds the
    columns)."""
    if WL >= 2:
        return base + _tiled_rows(rows, KS, TILE_SCALES)[:, None]
    else:
        return base + rows[:, None] * KS + ks[None, :]


@triton.jit
def _s_step(ptrs, g, j_off: tl.constexpr, ks, WL: tl.constexpr, ALIGNED: tl.constexpr):
    """The scale pointers of a load ``j_off`` bytes into the stage that starts at scale column ``g`` of a row: WL < 2
    ``ptrs + j_off``; WL 2 the tiled offsets of columns g + j_off + ks (ALIGNED: g % 8 == 0)."""
    if WL >= 2:
        if ALIGNED:
            return ptrs + g * TILE_ROWS + _tile_col(ks + j_off, TILE_SCALES)[None, :]
        else:
            return ptrs + _tile_col(g + j_off + ks, TILE_SCALES)[None, :]
    else:
        return ptrs + j_off


@triton.jit
def _e2m1_bits_f32(code, f):
    """4-bit codes (int32, 0..15) -> fp32 code value * 2**-126 * f: the bf16 bit pattern of the PTX above in the
    top half of an fp32 word (same exponent/mantissa fields, E = 0 the fp32 subnormal), so the same arithmetic."""
    return (((code & 7) << 22) | ((code & 8) << 28)).to(tl.float32, bitcast=True) * f


@triton.jit
def _mx_dot_eo(acc, xe, xo, w, s, DEQ: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """acc [BM, BN] fp32 += x @ dequant(w [BN, BK/2] uint8, s [BN, BK/32] UE8M0)^T on a bits path (DEQ 1 or 2),
    the activation x given as its even (xe) and odd (xo) K columns, [BM, BK/2] bf16 each."""
    if DEQ == 1:
        f = tl.inline_asm_elementwise(_UE8M0_FACTOR_ASM, "=r,=r,r", [s], tl.bfloat16, is_pure=True, pack=4)
        f = tl.reshape(tl.broadcast_to(f[:, :, None], [BN, BK // 32, 16]), [BN, BK // 2])
        we, wo = tl.inline_asm_elementwise(_E2M1_BITS_ASM, "=r,=r,=r,=r,r,r,r", [tl.trans(w), tl.trans(f)],
                                           (tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        acc = tl.dot(xe, we, acc)
        acc = tl.dot(xo, wo, acc)
    else:
        f = ((tl.minimum(s.to(tl.int32), 129) + 126) << 23).to(tl.float32, bitcast=True)
        f = tl.trans(tl.reshape(tl.broadcast_to(f[:, :, None], [BN, BK // 32, 16]), [BN, BK // 2]))
        wt = tl.trans(w).to(tl.int32)
        # fp32 operands (exact: bf16 x, e2m1 * 2**k weights): the interpreter's tl.dot misreads bf16 tensors made
        # by a conversion inside the kernel
        acc = tl.dot(xe.to(tl.float32), _e2m1_bits_f32(wt & 15, f), acc, input_precision="ieee")
        acc = tl.dot(xo.to(tl.float32), _e2m1_bits_f32(wt >> 4, f), acc, input_precision="ieee")
    return acc


@triton.jit
def _mx_dot_prep(acc_t, x0, x1, x2, x3, w, s, DEQ: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """acc_t [BN, BM] fp32 += dequant(w [BN, BK/4] uint16 in the prepared layout WL 1, s [BN, BK/32] UE8M0) @ x^T,
    the activation given as its value-c columns x_c = x[:, 32 g + 8 c + 0..7] ([BM, BK/4] bf16 each); DEQ 1 (PTX)
    or 2 (the same bit moves in Triton ops, for the interpreter). Transposed product: the converted weights are the
    mma A operand (registers the conversion writes freely) and the activation rows the B operand; with the
    activation as A, Triton's kWidth-4 layout (byte-wide scales in the chain) needed ~150 register moves per K
    step for its fragments, as B ~90 (triton 3.9, sm_90a)."""
    if DEQ == 1:
        f = tl.inline_asm_elementwise(_UE8M0_FACTOR_ASM, "=r,=r,r", [s], tl.bfloat16, is_pure=True, pack=4)
        f = tl.reshape(tl.broadcast_to(f[:, :, None], [BN, BK // 32, 8]), [BN, BK // 4])
        w0, w1, w2, w3 = tl.inline_asm_elementwise(_E2M1_PREP_ASM, "=r,=r,=r,=r,r,r", [w, f],
                                                   (tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16),
                                                   is_pure=True, pack=2)
        acc_t = tl.dot(w0, tl.trans(x0), acc_t)
        acc_t = tl.dot(w1, tl.trans(x1), acc_t)
        acc_t = tl.dot(w2, tl.trans(x2), acc_t)
        acc_t = tl.dot(w3, tl.trans(x3), acc_t)
    else:
        f = ((tl.minimum(s.to(tl.int32), 129) + 126) << 23).to(tl.float32, bitcast=True)
        f = tl.reshape(tl.broadcast_to(f[:, :, None], [BN, BK // 32, 8]), [BN, BK // 4])
        wt = w.to(tl.int32) & 0xFFFF
        c0 = ((wt >> 6) & 7) | ((wt >> 12) & 8)
        c1 = ((wt >> 3) & 7) | ((wt >> 9) & 8)
        c2 = (wt & 7) | ((wt >> 6) & 8)
        c3 = ((wt >> 13) & 3) | ((wt >> 8) & 12)
        acc_t = tl.dot(_e2m1_bits_f32(c0, f), tl.trans(x0.to(tl.float32)), acc_t, input_precision="ieee")
        acc_t = tl.dot(_e2m1_bits_f32(c1, f), tl.trans(x1.to(tl.float32)), acc_t, input_precision="ieee")
        acc_t = tl.dot(_e2m1_bits_f32(c2, f), tl.trans(x2.to(tl.float32)), acc_t, input_precision="ieee")
        acc_t = tl.dot(_e2m1_bits_f32(c3, f), tl.trans(x3.to(tl.float32)), acc_t, input_precision="ieee")
    return acc_t


@triton.jit
def _acc_init(BM: tl.constexpr, BN: tl.constexpr, WL: tl.constexpr):
    """Zero accumulator: [BM, BN], or transposed [BN, BM] for WL 1 (see ``_mx_dot_prep``)."""
    if WL >= 1:
        return tl.zeros([BN, BM], tl.float32)
    else:
        return tl.zeros([BM, BN], tl.float32)


@triton.jit
def _acc_out(acc, WL: tl.constexpr):
    """The accumulator as [BM, BN]."""
    if WL >= 1:
        return tl.trans(acc)
    else:
        return acc


@triton.jit
def _x_cols(BKD: tl.constexpr, WL: tl.constexpr, XS: tl.constexpr = 0):
    """Activation column offsets of one load: [BKD] (WL 0, or XS >= 1: a contiguous K range, the caller passing
    BK_DOT or BK as BKD), or the [BKD/4] columns of the prepared layout's value 0, 32 g + 0..7 per group g (WL 1,
    XS 0; value c's columns are these + 8 c)."""
    if WL >= 1 and XS == 0:
        j = tl.arange(0, BKD // 4)
        return (j // 8) * 32 + j % 8
    else:
        return tl.arange(0, BKD)


@triton.jit
def _load_x(ptrs, mask, WL: tl.constexpr):
    """Activation operands at ``ptrs`` (from ``_x_cols``): WL 0 the [BM, BKD] tile (four times, unused but the
    first); WL 1 the value-0..3 columns."""
    x0 = tl.load(ptrs, mask=mask, other=0.0)
    if WL >= 1:
        x1 = tl.load(ptrs + 8, mask=mask, other=0.0)
        x2 = tl.load(ptrs + 16, mask=mask, other=0.0)
        x3 = tl.load(ptrs + 24, mask=mask, other=0.0)
    else:
        x1 = x0
        x2 = x0
        x3 = x0
    return x0, x1, x2, x3


@triton.jit
def _load_x_row(ptrs, mask, BK: tl.constexpr, BKD: tl.constexpr):
    """XS >= 1 (WL 1, one-row blocks): BK contiguous activation values of the row as one [1, BK] load (``ptrs``
    from ``_x_cols(BK, 1, XS)``; XS 1 passes BK = BKD, one dequantize + dot step, XS 2 / 3 a pipeline stage),
    returned as its two BK_DOT halves [BKD] (BK = 2 BKD; the second is the first again when BK = BKD). Why: the
    value-column loads of ``_load_x`` hold BKD / 4 < threads elements, which Triton rematerializes in the dot layout
    (64-bit loads its cp.async pipeliner does not stage, so every K step waits on them); a contiguous row of
    >= 4 bytes per thread is staged ahead with the weights."""
    v = tl.reshape(tl.load(ptrs, mask=mask, other=0.0), [BK])
    if BK == BKD:
        xa = v
        xb = v
    else:
        xa, xb = tl.split(tl.permute(tl.reshape(v, [2, BKD]), (1, 0)))
    return xa, xb


@triton.jit
def _load_s_stage(ptrs, BN: tl.constexpr, BK: tl.constexpr, BKD: tl.constexpr):
    """XS 3: a stage's scale bytes [BN, BK / 32] in one load (>= 4 bytes per thread, so staged by cp.async like
    the weights; per BK_DOT step the [BN, BKD / 32] loads are 2-byte loads in the K loop), as its two BK_DOT
    halves (the second the first again when BK = BKD)."""
    v = tl.load(ptrs)
    if BK == BKD:
        sa = v
        sb = v
    else:
        sa, sb = tl.split(tl.permute(tl.reshape(v, [BN, 2, BKD // 32]), (0, 2, 1)))
    return sa, sb


@triton.jit
def _x_values(v, BKD: tl.constexpr):
    """The value-0..3 columns [1, BKD / 4] of the prepared layout (see ``_x_cols``) of one contiguous [BKD] K range
    (K = 32 g + 8 c + i), split in registers."""
    v = tl.reshape(tl.permute(tl.reshape(v, [BKD // 32, 4, 8]), (0, 2, 1)), [BKD // 4, 2, 2])  # (8 g + i, c)
    a, b = tl.split(v)  # c = 0, 2 / c = 1, 3
    x0, x2 = tl.split(a)
    x1, x3 = tl.split(b)
    return x0[None, :], x1[None, :], x2[None, :], x3[None, :]


@triton.jit
def _x_stage(ptrs, mask, BK: tl.constexpr, BKD: tl.constexpr, XS: tl.constexpr):
    """XS >= 2: a pipeline stage's activation row as its two BK_DOT halves (``_load_x_row``); else nothing is
    loaded here (``_x_step`` loads per step) and the two placeholders are never read."""
    if XS >= 2:
        xa, xb = _load_x_row(ptrs, mask, BK, BKD)
    else:
        xa = 0
        xb = 0
    return xa, xb


@triton.jit
def _x_step(xa, xb, ptrs, mask, j: tl.constexpr, XS: tl.constexpr, BKD: tl.constexpr, WL: tl.constexpr):
    """The activation operands x0..x3 of dequantize + dot step ``j`` of a stage: from the stage's halves xa / xb
    (XS >= 2, ``_x_stage``), one contiguous row load of the step (XS 1) or the value-column loads (XS 0)."""
    if XS >= 2:
        x0, x1, x2, x3 = _x_values(xa if j == 0 else xb, BKD)
    elif XS == 1:
        x0, x1, x2, x3 = _x_values(_load_x_row(ptrs + j * BKD, mask, BKD, BKD)[0], BKD)
    else:
        x0, x1, x2, x3 = _load_x(ptrs + j * BKD, mask, WL)
    return x0, x1, x2, x3


@triton.jit
def _mx_step(acc, x0, x1, x2, x3, w, s, DEQ: tl.constexpr, WL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
             BK: tl.constexpr):
    """``_mx_dot`` for WL 0 (x0 = the [BM, BK] tile), ``_mx_dot_prep`` for WL 1."""
    if WL >= 1:
        acc = _mx_dot_prep(acc, x0, x1, x2, x3, w, s, DEQ, BN, BK)
    else:
        acc = _mx_dot(acc, x0, w, s, DEQ, BM, BN, BK)
    return acc


@triton.jit
def _w_elems(w_ptr, WL: tl.constexpr):
    """Weight bytes as the elements the kernels load: uint8 (WL 0), or uint16 (WL 1: four e2m1 values each)."""
    if WL >= 1:
        return w_ptr.to(tl.pointer_type(tl.uint16))
    else:
        return w_ptr


@triton.jit
def _mx_dot(acc, x, w, s, DEQ: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """acc [BM, BN] fp32 += x [BM, BK] bf16 @ dequant(w [BN, BK/2] uint8 packed e2m1, s [BN, BK/32] UE8M0)^T."""
    if DEQ == 0:
        acc = tl.dot_scaled(x, None, "bf16", tl.trans(w), s, "e2m1", acc, fast_math=True)
    else:
        xe, xo = tl.split(tl.reshape(x, [BM, BK // 2, 2]))  # activation columns K = 2 j and 2 j + 1
        acc = _mx_dot_eo(acc, xe, xo, w, s, DEQ, BN, BK)
    return acc



@triton.jit
def _prefetch_rows(row_ptrs, nbytes, EVICT_LAST: tl.constexpr):
    """Prefetch ``nbytes`` bytes from each of the row start addresses ``row_ptrs`` (uint8 pointers, any shape) into
    L2."""
    for off in range(0, nbytes, PF_LINE):
        if EVICT_LAST:
            tl.inline_asm_elementwise(_PREFETCH_L2_LAST_ASM, "=r,l", [row_ptrs + off], tl.int32, is_pure=False,
                                      pack=1)
        else:
            tl.inline_asm_elementwise(_PREFETCH_L2_ASM, "=r,l", [row_ptrs + off], tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_span(base, nbytes, EVICT_LAST: tl.constexpr, LANES: tl.constexpr):
    """Prefetch the byte range [base, base + nbytes) (uint8 pointer) into L2, LANES lines per step."""
    for off in range(0, nbytes, PF_LINE * LANES):
        o = off + tl.arange(0, LANES) * PF_LINE
        ptrs = base + tl.where(o < nbytes, o, 0)  # lanes past the end fetch the first line again (harmless)
        if EVICT_LAST:
            tl.inline_asm_elementwise(_PREFETCH_L2_LAST_ASM, "=r,l", [ptrs], tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise(_PREFETCH_L2_ASM, "=r,l", [ptrs], tl.int32, is_pure=False, pack=1)


@triton.jit
def _rows_of(pid_m, ids_ptr, sorted_ptr, blk_exp_ptr, nblk_ptr, P, E, SORTED: tl.constexpr, BM: tl.constexpr):
    """(expert, pair ids [BM], row mask [BM], active) of row block ``pid_m``: a sorted block, or pair ``pid_m``
    alone in row 0."""
    offs_m = tl.arange(0, BM)
    if SORTED:
        active = pid_m < tl.load(nblk_ptr)  # the grid is an upper bound; both buffers span it
        e = tl.load(blk_exp_ptr + pid_m)
        rows = tl.load(sorted_ptr + pid_m * BM + offs_m)
        rmask = rows < P
    else:
        e = tl.load(ids_ptr + pid_m).to(tl.int32)
        active = (e >= 0) & (e < E)
        rows = pid_m + offs_m * 0
        rmask = offs_m == 0
    return e, rows, rmask, active


@triton.jit
def _swiglu_bf16(g, u, limit, HAS_LIMIT: tl.constexpr, ROUND: tl.constexpr):
    """bf16(silu(min(g, L)) * clamp(u, -L, L)) as fp32, g and u first rounded to bf16 (the GEMM output SGLang
    clamps is bf16; SiLU and the product in fp32)."""
    g = _to_bf16_f32(g, ROUND)
    u = _to_bf16_f32(u, ROUND)
    if HAS_LIMIT:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    return _to_bf16_f32(g / (1.0 + tl.exp(-g)) * u, ROUND)
