"""Fused MoE with MXFP4 expert weights and bf16 activations (Triton; sm_120a and sm_90a): the draft MoE of
DeepSeek-V4's MTP layer.

``fused_moe_mxfp4(hidden_states, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, ...) -> [T, H] bf16``
computes, per token, the top-k routed experts' gate/up projections, the (clamped) SwiGLU, the down projection,
and the routing-weighted sum over k. The weight layout is SGLang's (``Fp8MoEMethod`` for ``is_fp4_experts``
checkpoints, srt/layers/quantization/fp8.py; gate rows first, low nibble = even column, one UE8M0 byte per 32
values along K) and the exact computation, rounding points included, is documented in
``pd.kernels.mxfp4_moe_reference``, so the plugin passes SGLang's tensors straight through.

Kernels (weights are never dequantized in memory):
  * ``_gate_up_kernel``: one program per (row block, BN columns of the intermediate): streams the packed gate
    and up rows of its expert over K = H; the packed bytes go global -> shared (cp.async) -> registers in the
    mma operand layout, are turned into bf16 there and fed to mma.sync with fp32 accumulation, by one of two
    dequantizations (``_mx_dot``): ``tl.dot_scaled(x, None, "bf16", w, scale, "e2m1")`` (Triton's emulation: a
    PRMT lookup table per 8 values, or the cvt instruction Triton emits for sm_120, then a multiply by the bf16
    ``2 ** (scale - 127)``), or on sm_90 the "bits" dequantization (``_E2M1_BITS_ASM``: bit arithmetic on packed
    32-bit words; the K loop takes ~3.3-3.65 SASS instructions per weight instead of ~4.6-5.0; needs every scale
    <= 2, which the caller states with ``max_scale_byte``). With ``weight_layout="sm90_bits"`` the weights were
    reordered once at load time (``prepare_mxfp4_weights_sm90``, ``_E2M1_PREP_ASM``): about half the integer
    work and ~2.7-3.1 SASS per weight, the product computed transposed (converted weights as the mma A operand).
    ``"sm90_tiled"`` is the same elements stored as 32-row x 256-value tiles and the scales as 32-row x 8-byte
    tiles, so a pipeline stage reads one contiguous 4 KiB run (and one 256-byte run of scales) instead of 128 bytes
    (and 8 bytes) from each of 32 rows: 1.05-1.07x over "sm90_bits" at T = 1..128 on the H200 (T = 1 30.1 us, 62% of
    the weight-bandwidth floor; benchmarks/results/mxfp4_moe_2026-11-30-s7.md), what the SGLang method prepares on
    sm_90 when H and I are multiples of 256.
    The epilogue rounds gate/up to bf16, clamps, applies SiLU(gate) * up and stores h (bf16).
  * ``_down_kernel``: the same over K = I for the down projection; multiplies by the routing weight and either
    stores the per-pair rows (fp32) for ``_topk_sum_kernel``, or (``pair_token`` path) loops over a token's k
    experts and writes the summed bf16 output itself.
  * ``_align_kernel`` (``sorted`` path): one program groups the (token, slot) pairs by expert into blocks of
    BM rows (histogram + scan + atomic cursors), so each expert's weights are read once per block.
  * ``fold`` plans (pair path): no ``_swiglu_kernel`` / ``_topk_sum_kernel`` launches; the last gate/up program of
    each (pair, columns) group and the last down program of each (token, columns) group, elected by acq_rel atomic
    tickets (``mxfp4_moe_workspace``, left zeroed), do that work with the same arithmetic in the same order.
Paths: ``pair`` / ``pair_token`` give every (token, slot) pair its own programs (no sorting; for the draft's
small T the routed experts of a token are distinct and shared ones are served from L2); ``sorted`` reads each
routed expert once per BM rows, for larger T. ``DEFAULT_CONFIGS`` (``DEFAULT_CONFIGS_SM90_BITS`` for prepared
weights) picks by the number of pairs; all paths
launch fixed grids computed from shapes alone and read routing on the device, so a call is CUDA-graph
capturable (no host sync). H200 numbers and profile: benchmarks/results/mxfp4_moe_2026-11-30.md (dot_scaled),
mxfp4_moe_2026-11-30-s3.md (bits), -s4.md (BK_DOT steps; Nsight Compute stall reasons), -s4b.md (prepared
layout), -s5.md (one-row pair blocks, the fold, 8-row sorted blocks; kernel profile of T = 1), -s5b.md
(16 weight rows per warp at T <= 8; Nsight Compute of T = 1), -s5c.md (stage_loads) and -s5d.md (split-1 down at
T <= 8; PDL release / L2 prefetch variants measured and rejected).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from .device_info import check_runnable

GROUP = 32  # values per UE8M0 scale
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


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


# ------------------------------------------------------------------------------------- e2m1 -> bf16 in registers
# sm_90 has no e2m1 conversion instruction and no bf16 x e2m1 tensor-core op; with tl.dot_scaled's emulation (PRMT
# lookup tables) the K loop takes ~4.6-5.0 SASS instructions per weight, with the "bits" dequantization below
# ~3.3-3.65, of which the conversion and scaling are 2.25 (benchmarks/kernels/mxfp4_moe_sass.py). A nibble
# s e1 e0 m is moved so that s lands on the bf16 sign bit and e1 e0 m on the two lowest exponent bits and the top
# mantissa bit; that bf16 is exactly e2m1 * 2**-126 (code 1, E = 0, is the bf16 subnormal 0.5 * 2**-126), and one
# bf16 multiply by 2**(s - 1) = 2**126 * 2**(s - 127) applies the UE8M0 scale exactly. 2**(s - 1) is a normal
# bf16 only for scale bytes s <= 128 (scales <= 2, |weights| <= 12): the caller states the largest scale byte
# (``max_scale_byte``, checked once at weight-load time) and larger ones keep tl.dot_scaled. A byte s > 128 that
# reaches the bits path anyway makes the factor +inf (min(s, 129)), so the output is inf/NaN, never silently wrong.
# Packed byte j of a row holds K = 2 j (low nibble) and 2 j + 1 (high nibble): the even and odd nibbles become two
# [BK/2, BN] operands, multiplied with the activation's even and odd K columns (two tl.dot), so no interleave.
DEQ_DOT_SCALED = 0  # tl.dot_scaled (any scale; the path sm_120 runs: its e2m1 conversion is an instruction there)
DEQ_BITS_ASM = 1  # inline PTX on packed 32-bit words (sm_90, mul.rn.bf16x2 needs sm_90+)
DEQ_BITS_TL = 2  # the same bit arithmetic in fp32 lanes with Triton ops (the interpreter runs no inline asm)

# 4 packed bytes b0..b3 -> even nibbles (bf16 pairs $0 = K 0, 2 and $1 = K 4, 6 of the 8 values) and odd nibbles
# ($2 = K 1, 3; $3 = K 5, 7), each times its factor ($5 for bytes 0, 1; $6 for bytes 2, 3). prmt puts b0 in byte 1
# and b1 in byte 3 (bytes 0, 2 zero): the 16-bit lanes hold [low nibble at bits 8..11 | high nibble at 12..15].
# Even: (y >> 2) puts e1 e0 m at bits 8..6, (y << 4) the sign at bit 15 (the high nibble leaves the lane upward,
# into bits the mask drops). Odd: the low nibble is cleared first, since (y >> 6) would move it onto bit 8.
# 0x81C081C0 keeps bits 15, 8, 7, 6 of each lane; lop3 LUT 0xA8 = (a | b) & c (a, b, c = 0xF0, 0xCC, 0xAA).
_E2M1_BITS_ASM = tl.constexpr("""
{
.reg .b32 y01, y23, t, u, v;
prmt.b32 y01, $4, 0, 0x1404;
prmt.b32 y23, $4, 0, 0x3424;
shr.b32 t, y01, 2;
shl.b32 u, y01, 4;
lop3.b32 v, t, u, 0x81C081C0, 0xA8;
mul.rn.bf16x2 $0, v, $5;
shr.b32 t, y23, 2;
shl.b32 u, y23, 4;
lop3.b32 v, t, u, 0x81C081C0, 0xA8;
mul.rn.bf16x2 $1, v, $6;
and.b32 u, y01, 0xF000F000;
shr.b32 t, u, 6;
lop3.b32 v, t, u, 0x81C081C0, 0xA8;
mul.rn.bf16x2 $2, v, $5;
and.b32 u, y23, 0xF000F000;
shr.b32 t, u, 6;
lop3.b32 v, t, u, 0x81C081C0, 0xA8;
mul.rn.bf16x2 $3, v, $6;
}
""")
# 4 UE8M0 bytes -> 4 bf16 factors 2**(s - 1): the bytes spread into 16-bit lanes, s * 128 + 126 * 128 is the bf16
# with exponent field s + 126 (no carry between lanes: <= 48640), capped at 0x7F80 (+inf) for s > 128.
_UE8M0_FACTOR_ASM = tl.constexpr("""
{
.reg .b32 a, b, c;
mov.b32 c, 0x7F807F80;
prmt.b32 a, $2, 0, 0x5140;
prmt.b32 b, $2, 0, 0x7362;
mad.lo.u32 a, a, 128, 0x3F003F00;
mad.lo.u32 b, b, 128, 0x3F003F00;
min.u16x2 $0, a, c;
min.u16x2 $1, b, c;
}
""")


# Weight layout WL = 1 ("sm90_bits", made once at weight load by ``prepare_mxfp4_weights_sm90``): each row is a
# sequence of 16-bit little-endian elements; element 8 g + i (g: scale group, i = 0..7) holds the four values
# K = 32 g + 8 c + i, c = 0..3 ("value c"), with the bits (s e1 e0 m of value c, bit 15 first):
#   v0.s v3.e0 v3.m v1.s v3.s v3.e1 v2.s v0.e1 | v0.e0 v0.m v1.e1 v1.e0 v1.m v2.e1 v2.e0 v2.m
# i.e. value 0 already sits where the bf16 pattern wants it (bits 6..8 and 15, see above), value 1 and value 2 one
# left shift (3, 6) away, and value 3's bits move by >> 7, >> 2 and << 4 without collisions. On a 32-bit word of two
# elements (one per 16-bit lane) that is 4 bf16 pairs in 7 integer-pipe ops (4 LOP3, 2 SHF.R; value 1/2's left
# shifts and value 3's << 4 + add go to IMAD) instead of 12 plus the activation's even/odd split; every lane depends
# on its own element only. The activation is four 8-column runs per group (value c: K = 32 g + 8 c + 0..7), each a
# tl.dot operand of its own, loaded straight from memory (H200: benchmarks/results/mxfp4_moe_2026-11-30-s4b.md).
_E2M1_PREP_ASM = tl.constexpr("""
{
.reg .b32 v, x, t, u;
and.b32 v, $4, 0x81C081C0;
mul.rn.bf16x2 $0, v, $5;
shl.b32 t, $4, 3;
and.b32 v, t, 0x81C081C0;
mul.rn.bf16x2 $1, v, $5;
shl.b32 t, $4, 6;
and.b32 v, t, 0x81C081C0;
mul.rn.bf16x2 $2, v, $5;
and.b32 x, $4, 0x6C006C00;
shr.b32 t, x, 7;
shr.b32 u, x, 2;
mad.lo.u32 u, x, 16, u;
lop3.b32 v, t, u, 0x81C081C0, 0xA8;
mul.rn.bf16x2 $3, v, $5;
}
""")
WL_SGLANG = 0  # SGLang's checkpoint layout (any dequantization)
WL_SM90_BITS = 1  # the prepared layout above (bits dequantization only)
# WL 2 ("sm90_tiled"): the elements of WL 1 (``prepare_mxfp4_weights_sm90(..., tiled=True)``), each band of 32 rows
# stored as K / 256 consecutive tiles of [32 rows x 64 elements] (4 KiB; a row's 256 values of one tile are 128
# contiguous bytes), and the scale bytes in the same bands of [32 rows x 8 bytes] tiles (``tile_mxfp4_scales``).
# Why: in WL 1 a program's pipeline stage reads one 128-byte piece (and 8 scale bytes) from each of its 32 rows, the
# rows 1-2 KiB apart, so the whole grid streams its experts in 128-byte pieces (H200, s5d: gate/up at 55% of DRAM
# peak with 23 or 46 warps per SM); here a 32-row, BK-256 stage is one contiguous 4 KiB run and 256 bytes of scales.
# H200 s7 (benchmarks/results/mxfp4_moe_2026-11-30-s7-ab.json): the weight tiles alone gained nothing (T = 1 32.4 vs
# 32.4 us, T = 64 869 vs 888), the scale tiles with them 1.03-1.11x (31.4 / 829.8 us), so only both together remain.
WL_SM90_TILED = 2
WEIGHT_LAYOUTS = {"sglang": WL_SGLANG, "sm90_bits": WL_SM90_BITS, "sm90_tiled": WL_SM90_TILED}
PREPARED_LAYOUTS = ("sm90_bits", "sm90_tiled")  # read with the sm90_bits element encoding
TILE_ROWS = tl.constexpr(32)  # rows per band of the tiled layout
TILE_ELEMS = tl.constexpr(64)  # 16-bit elements (256 values) per row of one tile
TILE_SCALES = tl.constexpr(8)  # WL 2: scale bytes (256 values) per row of one scale tile


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


# L2 prefetch of one 128-byte line per lane (sm_80+: sm_90 and sm_120): the loads a program will issue, all in
# flight at once instead of the 2-3 stages of its cp.async pipeline; ``evict_last`` keeps lines read by a later
# launch (the down weights a gate/up program fetches for the down kernel) ahead of the streamed gate/up lines.
_PREFETCH_L2_ASM = tl.constexpr("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;")
_PREFETCH_L2_LAST_ASM = tl.constexpr("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;")
PF_LINE = tl.constexpr(128)  # bytes per prefetch


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
                tl.extra.cuda.gdc_launch_dependents()  # crowded onto the SMs freed first (H200, s5: down 1.5x slower)
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


# ---------------------------------------------------------------------------------------------------- configs

# Tile configs (BN: output columns per program, BK: K per pipeline stage, BK_DOT: K per dequantize + dot step,
# default BK; with BM > 16 rows BK becomes 128). BN >= 16 *
# num_warps: with 16-row tiles the warps split N, and fewer columns per warp made Triton convert the same
# weights in several warps. Every entry fits sm_120's 99 KiB of shared memory with 16- and 64-row blocks and
# compiles to mma.sync there (tests/test_mxfp4_moe.py checks all of them, and sm_90a).
TILE_CONFIGS = [
    dict(BN=BN, BK=BK, num_warps=w, num_stages=st)
    for BN, BK, w, st in [(16, 256, 1, 4), (32, 256, 2, 3), (32, 128, 2, 4), (64, 256, 2, 3), (64, 128, 4, 3),
                          (128, 128, 4, 3), (64, 128, 2, 3), (64, 128, 2, 4), (128, 128, 2, 3)]
] + [dict(BN=64, BK=256, BK_DOT=128, num_warps=2, num_stages=3),
       dict(BN=32, BK=256, BK_DOT=128, num_warps=2, num_stages=3),  # 16 weight rows per warp (prepared T <= 8)
       dict(BN=64, BK=256, BK_DOT=128, num_warps=4, num_stages=3)]
# rows per block: the pair paths hold one pair per program (row 0; BM 1 keeps the activation tile and the epilogue
# to that row, tl.dot pads it to the mma shape), the sorted path up to BM pairs of one expert
BM_CHOICES = (1, 2, 4, 8, 16, 32, 64)
SPLIT_CHOICES = (1, 2, 4, 8)
PATHS = ("pair_token", "pair", "sorted")
# "bits": the bit-arithmetic dequantization (needs max_scale_byte <= 128); "dot_scaled": tl.dot_scaled; "auto": bits
# on sm_90 when max_scale_byte allows it, else dot_scaled (sm_120 converts e2m1 with an instruction).
DEQUANT_CHOICES = ("auto", "bits", "dot_scaled")
BITS_MAX_SCALE_BYTE = 128  # 2 ** (s - 1) must be a normal bf16
MAXNREG_MIN = 32  # a tile's optional register cap per thread (the launch option ``maxnreg``; ptxas spills past it)
# ``stage_loads`` (prepared layout, BM 1): how the K loop reads the activation row (x in gate/up, h in down) and the
# scales. 0: four [1, BK_DOT / 4] value-column loads per dequantize + dot step, which Triton issues as plain loads in
# the dot layout in the step that uses them (not staged by its cp.async pipeliner); 1: one contiguous [1, BK_DOT] row
# per step, split into the value columns in registers (staged when it is >= 4 bytes per thread: BK_DOT >= 2 x
# threads); 2: one [1, BK] row per pipeline stage (BK <= 2 BK_DOT); 3: as 2, and the stage's scales [BN, BK / 32] in
# one load too (staged like the weights instead of 2-byte loads per step). The K loop's math is the same. The
# pair_token path's down kernel (one token per program, k experts) keeps 0.
STAGE_LOADS_CHOICES = (0, 1, 2, 3)
# ``pdl_release`` (with ``pdl``): where the gate/up programs release the dependent down launch. "k_loop" (default):
# after their K loop; "start": at their start (when the gate/up grid fits one wave, the down programs then take the
# SM slots it leaves free from the beginning, and with ``prefetch_down`` fetch their weights into L2 before they wait).
PDL_RELEASE_CHOICES = ("k_loop", "start")

# Default plan per number of (token, slot) pairs P = T * k: the first entry with P <= bound.
#   path: pair_token (gate/up per pair; down per token, k-sum fused: 2 launches), pair (+ sum kernel), sorted
#   (+ align kernel: each routed expert read once per BM rows); split_*: K splits for more programs at tiny T
#   (gate/up partials finished by _swiglu_kernel, down partials summed by _topk_sum_kernel).
# From the H200 sweeps (benchmarks/results/mxfp4_moe_2026-11-30.md, tl.dot_scaled; _2026-11-30-s3.md and -s4.md,
# the bits dequantization): T = 1 pair with 4 x 2 K splits and gate/up in separate 64-column programs (1.03x over
# 8 x 4, within noise of 2 x 2; s4: BK 256 in two BK_DOT 128 steps is 1.11x slower there); T = 16, 64, 128 sorted,
# gate/up in separate 64-column programs and 64-column down programs, both BK 256 per stage in two BK_DOT 128 steps
# (142 / 168 registers: 6 blocks per SM): the fastest of 17 plans at each of the three in s4, 1.01-1.03x over s3's
# (one BK 256 step: 247 registers, 4 blocks; 128-column down). The pair paths are 1.1x slower at T = 16, 1.7-2.7x
# at 64-128, where experts are shared. The switch at P = 48 (T = 8 for top-6) is not measured: there a pair
# re-reads ~8% shared experts (from L2) vs the sorted path's extra launch.
DEFAULT_CONFIGS = [
    (48, dict(path="pair", BM=16, split_gate_up=4, split_down=2, gate_up_halves=True,
              gate_up=dict(BN=64, BK=128, num_warps=2, num_stages=3),
              down=dict(BN=64, BK=128, num_warps=2, num_stages=3))),
    (1024, dict(path="sorted", BM=16, split_gate_up=1, split_down=1, gate_up_halves=True,
                gate_up=dict(BN=64, BK=256, BK_DOT=128, num_warps=2, num_stages=3),
                down=dict(BN=64, BK=256, BK_DOT=128, num_warps=2, num_stages=3))),
    (math.inf, dict(path="sorted", BM=64, split_gate_up=1, split_down=1,
                    gate_up=dict(BN=64, BK=128, num_warps=4, num_stages=3),
                    down=dict(BN=64, BK=128, num_warps=4, num_stages=3))),
]


# Default plan for weights in the prepared layout (weight_layout="sm90_bits"), from the H200 runs of
# benchmarks/results/mxfp4_moe_2026-11-30-s5.md and -s5b.md (each the same run as the committed kernel; medians of 3
# interleaved rounds). T <= 8: one-row blocks (BM 1: the activation tile and the epilogue shrink to the pair's row;
# BM 16 kept 16 KiB of shared memory for 15 masked rows, which limited gate/up to 6 blocks of 2 warps per SM,
# latency bound at 32% of HBM bandwidth per Nsight Compute), the SwiGLU and the k-sum folded into the last program
# of each group (2 launches instead of 4), 2 x 2 K splits (s5: T = 1 39.7 us vs 52.6), and since s5b 16 weight rows
# per warp (gate/up 32 columns x 2 warps, down 64 x 4 with BK 256 in two steps: the same 768 / 1536 programs hold
# twice the warps, and each warp's K loop is half as long) with the down launch a programmatic dependent of gate/up
# (released after gate/up's K loop): T = 1 36.9 us (50.5% of the floor) vs 39.5, T = 4 118.5 vs 122.6, T = 8 228.1
# vs 229.4 (equal within the rounds' spread); since s5c (mxfp4_moe_2026-11-30-s5c.md) with ``stage_loads=3``: the
# activation row and the scales go through the cp.async pipeline with the weights (no plain global load left in
# either K loop; gate/up 56 instead of 64 registers): T = 1 32.8 us (56.8% of the floor) vs 37.0, T = 4 109.4 vs
# 119.1, T = 8 218.6 vs 228.5; since s5d (mxfp4_moe_2026-11-30-s5d.md) down reads the whole K = I per program
# (split 1, 32 columns x 2 warps: 768 programs of 8 K steps instead of 4, 6 fold arrivals per group instead of 12):
# T = 1 32.3 vs 32.7 us (57.8% of the floor), T = 4 106.7 vs 108.7, T = 8 211.2 vs 215.7 (the rounds' spreads
# overlap). T = 16..170: sorted blocks of 8 rows (1.2-3.1 rows per routed expert
# at T = 16..128) with gate/up BK 256 in one step: 355.9 / 913.5 / 1114.9 us at T = 16 / 64 / 128 (69.5 / 68.7 /
# 68.2%) vs 403.5 / 1030.6 / 1265.4. Every plan here was checked on the device in the run that chose it.
DEFAULT_CONFIGS_SM90_BITS = [
    (48, dict(DEFAULT_CONFIGS[0][1], BM=1, fold=True, pdl=True, split_gate_up=2, split_down=1, stage_loads=3,
              gate_up=dict(BN=32, BK=256, BK_DOT=128, num_warps=2, num_stages=3),
              down=dict(BN=32, BK=256, BK_DOT=128, num_warps=2, num_stages=3))),
    (1024, dict(DEFAULT_CONFIGS[1][1], BM=8, gate_up=dict(BN=64, BK=256, num_warps=2, num_stages=3))),
    DEFAULT_CONFIGS[2],
]


# Default plan for weight_layout="sm90_tiled": the sm90_bits plans, with gate/up at T <= 8 not split along K (768
# programs, each reading one contiguous 64 KiB run per 32 rows instead of two of 32 KiB). H200 s7 pick
# (benchmarks/results/mxfp4_moe_2026-11-30-s7-ab.json, medians of 3 interleaved rounds): T = 1 / 4 / 8 30.3 / 100.4 /
# 197.7 us vs 31.4 / 102.3 / 199.6 with the split of 2 (sm90_bits, its plan: 32.4 / 108.0 / 212.5); the sorted plans
# at T = 16 / 64 / 128 327.8 / 829.8 / 1043.4 vs 347.6 / 917.8 / 1130.0 on sm90_bits. The committed run
# (mxfp4_moe_2026-11-30-s7.md): T = 1 / 16 / 64 / 128 30.1 / 328.6 / 823.5 / 1006.3 us (62.0 / 75.2 / 76.2 / 75.5% of
# the floor) vs 32.2 / 344.1 / 863.2 / 1074.3 for the previous default.
DEFAULT_CONFIGS_SM90_TILED = [
    (48, dict(DEFAULT_CONFIGS_SM90_BITS[0][1], split_gate_up=1)),
    *DEFAULT_CONFIGS_SM90_BITS[1:],
]


def default_config(num_pairs: int, weight_layout: str = "sglang") -> dict:
    """The launch plan ``fused_moe_mxfp4`` uses for ``num_pairs`` = T * k (see DEFAULT_CONFIGS, and
    DEFAULT_CONFIGS_SM90_BITS / DEFAULT_CONFIGS_SM90_TILED for the prepared layouts ``PREPARED_LAYOUTS``)."""
    table = {"sm90_bits": DEFAULT_CONFIGS_SM90_BITS, "sm90_tiled": DEFAULT_CONFIGS_SM90_TILED}.get(weight_layout,
                                                                                                  DEFAULT_CONFIGS)
    for bound, cfg in table:
        if num_pairs <= bound:
            return cfg
    raise AssertionError("unreachable")


# ---------------------------------------------------------------------------------------------------- host side

def as_ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """MXFP4 scales as the UE8M0 bytes the kernel reads.

    uint8 and float8_e8m0fnu are returned as a uint8 view (no copy). fp32/bf16/fp16 scales (SGLang keeps the
    loaded scales as fp32 powers of two in ``w13_weight_scale_inv``) are converted to ``log2(s) + 127`` once;
    do that at weight-load time, not per call (it reads every scale and synchronizes to validate).

    Raises:
        ValueError: a float scale that is not a power of two in [2**-127, 2**127], or another dtype.
    """
    if scale.dtype in (torch.uint8, getattr(torch, "float8_e8m0fnu", torch.uint8)):
        return scale.view(torch.uint8)
    if scale.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"scale must be uint8 / float8_e8m0fnu bytes or float powers of two, got {scale.dtype}")
    mant, exp = torch.frexp(scale.float())
    if not bool(((mant == 0.5) & (exp - 1 >= -127) & (exp - 1 <= 127)).all()):
        raise ValueError("scale: float MXFP4 scales must be powers of two in [2**-127, 2**127]")
    return (exp + 126).to(torch.uint8)


UE8M0_DTYPES = (torch.uint8, getattr(torch, "float8_e8m0fnu", torch.uint8))  # dtypes accepted for scale bytes


def _check_bytes(name, t, shape, dev, dtypes, what, hint=""):
    """``t`` as uint8 after checking dtype, shape, contiguity and device; ValueError naming ``name`` otherwise."""
    if not isinstance(t, torch.Tensor) or t.dtype not in dtypes:
        raise ValueError(f"{name} must be {what} {shape}, got {getattr(t, 'dtype', type(t).__name__)}{hint}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if t.device != dev:
        raise ValueError(f"{name} must be on {dev}, got {t.device}")
    return t.view(torch.uint8)


def _check_weight(name, w, shape, dev):
    return _check_bytes(name, w, shape, dev, (torch.uint8, torch.int8), "a uint8/int8 tensor of packed e2m1 pairs")


def _check_scale(name, s, shape, dev):
    return _check_bytes(name, s, shape, dev, UE8M0_DTYPES, "UE8M0 bytes (uint8 or float8_e8m0fnu)",
                        " (float scales: convert once with as_ue8m0)")


def _check_config(cfg: dict, h: int, inter: int) -> None:
    if not isinstance(cfg, dict) or cfg.get("path") not in PATHS:
        raise ValueError(f"config: path must be one of {PATHS}, got {cfg!r}")
    if cfg.get("BM", 16) not in BM_CHOICES:
        raise ValueError(f"config: BM must be one of {BM_CHOICES}")
    if cfg["path"] != "sorted" and cfg.get("BM", 16) > 16:
        raise ValueError("config: the pair paths take BM <= 16 (one pair per program)")
    for part, n_dim in (("gate_up", inter), ("down", h)):
        c = cfg.get(part)
        if not isinstance(c, dict) or not {"BN", "BK", "num_warps", "num_stages"} <= set(c) \
                or not set(c) <= {"BN", "BK", "BK_DOT", "num_warps", "num_stages", "maxnreg"}:
            raise ValueError(f"config: {part} must be a dict with BN, BK, num_warps, num_stages (and optional BK_DOT, "
                             f"maxnreg)")
        if "maxnreg" in c and (isinstance(c["maxnreg"], bool) or not isinstance(c["maxnreg"], int)
                               or not MAXNREG_MIN <= c["maxnreg"] <= 255):
            raise ValueError(f"config: {part} maxnreg must be an int in [{MAXNREG_MIN}, 255], got {c['maxnreg']!r}")
        if c["BN"] not in (16, 32, 64, 128) or n_dim % c["BN"]:
            raise ValueError(f"config: {part} BN must be 16/32/64/128 and divide {n_dim}, got {c['BN']}")
        if c["BK"] not in (128, 256, 512):  # halved where it does not divide K / split (_fit_bk)
            raise ValueError(f"config: {part} BK must be 128, 256 or 512, got {c['BK']}")
        if c.get("BK_DOT", c["BK"]) not in (64, 128, 256) or c["BK"] % c.get("BK_DOT", c["BK"]):
            raise ValueError(f"config: {part} BK_DOT must be 64, 128 or 256 and divide BK, got {c.get('BK_DOT')}")
        if cfg.get(f"split_{part}", 1) not in SPLIT_CHOICES:
            raise ValueError(f"config: split_{part} must be one of {SPLIT_CHOICES}, got {cfg.get(f'split_{part}')}")
    if cfg.get("dequant", "auto") not in DEQUANT_CHOICES:
        raise ValueError(f"config: dequant must be one of {DEQUANT_CHOICES}, got {cfg.get('dequant')!r}")
    if not isinstance(cfg.get("gate_up_halves", False), bool):
        raise ValueError("config: gate_up_halves must be a bool")
    if cfg["path"] == "pair_token" and cfg.get("split_down", 1) != 1:
        raise ValueError("config: the pair_token path sums over k in the down kernel, so split_down must be 1")
    for key in ("fold", "pdl"):
        if not isinstance(cfg.get(key, False), bool):
            raise ValueError(f"config: {key} must be a bool")
    if cfg.get("fold", False) and cfg["path"] != "pair":
        raise ValueError("config: fold (ticket-folded SwiGLU and k-sum) needs path 'pair'")
    if cfg.get("pdl", False) and not cfg.get("fold", False):
        raise ValueError("config: pdl (the down launch as a programmatic dependent of gate/up) needs fold")
    if cfg.get("prefetch_gate_up", 0) not in (0, 1, 2):
        raise ValueError(f"config: prefetch_gate_up must be 0, 1 or 2, got {cfg.get('prefetch_gate_up')!r}")
    if cfg.get("prefetch_gate_up", 0) == 2 and cfg["path"] == "sorted":
        raise ValueError("config: prefetch_gate_up=2 (down weights fetched by gate/up) needs a pair path")
    if cfg.get("prefetch_down", 0) not in (0, 1, 2):
        raise ValueError(f"config: prefetch_down must be 0, 1 or 2, got {cfg.get('prefetch_down')!r}")
    if cfg.get("pdl_release", "k_loop") not in PDL_RELEASE_CHOICES:
        raise ValueError(f"config: pdl_release must be one of {PDL_RELEASE_CHOICES}, got {cfg.get('pdl_release')!r}")
    if "pdl_release" in cfg and not cfg.get("pdl", False):
        raise ValueError("config: pdl_release (where gate/up releases the down launch) needs pdl")
    xs = cfg.get("stage_loads", 0)
    if isinstance(xs, bool) or xs not in STAGE_LOADS_CHOICES:
        raise ValueError(f"config: stage_loads must be one of {STAGE_LOADS_CHOICES}, got {xs!r}")
    if xs and cfg.get("BM", 16) != 1:
        raise ValueError("config: stage_loads (one contiguous activation row per load) needs BM=1")
    if xs >= 2:
        for part in ("gate_up", "down"):
            c = cfg[part]
            if c["BK"] > 2 * c.get("BK_DOT", c["BK"]):
                raise ValueError(f"config: stage_loads={xs} needs {part} BK <= 2 * BK_DOT, got BK {c['BK']}, "
                                 f"BK_DOT {c.get('BK_DOT')}")


def mxfp4_max_scale_byte(*scales: torch.Tensor) -> int:
    """The largest UE8M0 byte over ``scales`` (uint8 / float8_e8m0fnu tensors, any shape), for
    ``fused_moe_mxfp4(max_scale_byte=...)``. Reads every byte and synchronizes: call it once at weight-load time.

    Raises:
        ValueError: no tensor, or one that is not UE8M0 bytes (float scales: ``as_ue8m0`` first).
    """
    if not scales:
        raise ValueError("scales: pass at least one scale tensor")
    best = 0
    for sc in scales:
        if not isinstance(sc, torch.Tensor) or sc.dtype not in UE8M0_DTYPES:
            raise ValueError(f"scales must be UE8M0 bytes (uint8 or float8_e8m0fnu), got {getattr(sc, 'dtype', sc)}")
        if sc.numel():
            best = max(best, int(sc.view(torch.uint8).max()))
    return best


def prepare_mxfp4_weights_sm90(w13: torch.Tensor, w2: torch.Tensor, *, inplace: bool = False,
                               chunk_bytes: int = 1 << 26, tiled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Reorder packed e2m1 weights once, at weight-load time, into ``weight_layout="sm90_bits"`` (or, ``tiled``, the
    weights of ``"sm90_tiled"``, whose scales come from ``tile_mxfp4_scales``), which the sm_90 bits dequantization
    reads with about half the integer instructions of SGLang's layout.

    Layout (per row of K values v[0..K), K = H for w13 and I for w2, a multiple of 32): SGLang's byte j holds
    v[2 j] (low nibble) and v[2 j + 1]; the prepared row is K / 4 little-endian 16-bit elements (bytes 2 m, 2 m + 1
    hold bits 0..7 and 8..15 of element m), element m = 8 g + i (g = scale group, i = 0..7) holding the four
    values c = 0..3 at K = 32 g + 8 c + i, each a 4-bit code s e1 e0 m (OCP MX e2m1), at bits
        value 0: m 6, e0 7, e1 8, s 15     value 1: m 3, e0 4, e1 5, s 12
        value 2: m 0, e0 1, e1 2, s 9      value 3: m 13, e0 14, e1 10, s 11.
    Every value stays in its scale group (the UE8M0 scale tensors are unchanged), and the layout is this project's
    own (``pd.kernels.mxfp4_moe._E2M1_PREP_ASM`` says why these positions). ``tiled`` ("sm90_tiled"): the same
    elements, each expert's rows in bands of 32, each band stored as K / 256 consecutive [32 rows x 64 elements]
    tiles: element m of row r at ((r // 32) * K / 256 + m // 64) * 2048 + (r % 32) * 64 + m % 64 (in 16-bit
    elements from the expert's start), so a 32-row x 256-value piece of the weights is 4 KiB of consecutive bytes.

    Args:
        w13: [E, 2 I, H / 2] uint8/int8 (SGLang's layout, see ``fused_moe_mxfp4``). w2: [E, H, I / 2] uint8/int8.
        inplace: write the result into w13 / w2 (no second copy of the weights; done ``chunk_bytes`` at a time).
        chunk_bytes: weight bytes converted per step (bounds the temporaries, ~10x this).
        tiled: also store the rows as 32-row x 256-value tiles (the weights of ``weight_layout="sm90_tiled"``).
    Returns:
        (w13, w2) in the prepared layout, same shapes and dtypes (the inputs themselves when ``inplace``).
    Raises:
        ValueError: a tensor that is not 3-D uint8/int8 and contiguous, or whose last dimension is not a multiple of
        16 (K a multiple of 32); with ``tiled``, a row count that is not a multiple of 32 or a last dimension that
        is not a multiple of 128 (K a multiple of 256).
    """
    return tuple(_prepare_sm90(name, w, inplace, chunk_bytes, tiled) for name, w in (("w13", w13), ("w2", w2)))


def _prepare_sm90(name: str, w: torch.Tensor, inplace: bool, chunk_bytes: int, tiled: bool = False) -> torch.Tensor:
    if not isinstance(w, torch.Tensor) or w.dtype not in (torch.uint8, torch.int8) or w.dim() != 3 \
            or not w.is_contiguous():
        raise ValueError(f"{name} must be a contiguous 3-D uint8/int8 tensor of packed e2m1 pairs, got "
                         f"{getattr(w, 'dtype', type(w).__name__)} {tuple(getattr(w, 'shape', ()))}")
    if w.shape[2] % 16:
        raise ValueError(f"{name}: the packed row length must be a multiple of 16 bytes (K % 32 == 0), got "
                         f"{w.shape[2]}")
    if tiled and (w.shape[1] % 32 or w.shape[2] % 128):
        raise ValueError(f"{name}: tiled needs rows a multiple of 32 and the packed row length a multiple of 128 "
                         f"bytes (K % 256 == 0), got {tuple(w.shape[1:])}")
    out = w if inplace else torch.empty_like(w)
    src, dst = w.view(torch.uint8), out.view(torch.uint8)
    per_expert = max(1, w[0].numel())
    step = max(1, chunk_bytes // per_expert)
    for e0 in range(0, w.shape[0], step):
        b = src[e0:e0 + step].to(torch.int32)
        v = torch.stack((b & 15, b >> 4), dim=-1)  # [n, rows, K / 2, 2]: the K values in order
        v = v.reshape(*b.shape[:2], -1, 4, 8)  # [n, rows, group, value c, i]
        c0, c1, c2, c3 = v.unbind(-2)
        el = (((c0 & 7) << 6) | ((c0 >> 3) << 15) | ((c1 & 7) << 3) | ((c1 >> 3) << 12) | (c2 & 7)
              | ((c2 >> 3) << 9) | ((c3 & 3) << 13) | ((c3 & 4) << 8) | ((c3 >> 3) << 11))
        el = torch.stack((el & 255, el >> 8), dim=-1)  # [n, rows, K / 4, 2]: little-endian bytes
        if tiled:  # [n, band, row in band, tile, element in tile, byte] -> [n, band, tile, row in band, ...]
            n, rows = el.shape[:2]
            el = el.reshape(n, rows // 32, 32, -1, 64, 2).permute(0, 1, 3, 2, 4, 5)
        dst[e0:e0 + step] = el.reshape(b.shape).to(torch.uint8)
    return out


def tile_mxfp4_scales(w13_scale: torch.Tensor, w2_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The UE8M0 scales of ``weight_layout="sm90_tiled"`` (weights from ``prepare_mxfp4_weights_sm90(...,
    tiled=True)``): each expert's rows in bands of 32, each band stored as K / 256 consecutive [32 rows x 8 bytes]
    tiles, byte g of row r at ((r // 32) * K / 256 + g // 8) * 256 + (r % 32) * 8 + g % 8 from the expert's start.

    Args:
        w13_scale: [E, 2 I, H / 32], w2_scale: [E, H, I / 32]; uint8 or float8_e8m0fnu, contiguous.
    Returns:
        New tensors of the same shapes and dtypes.
    Raises:
        ValueError: a tensor that is not 3-D UE8M0 bytes and contiguous, or whose rows are not a multiple of 32 or
        whose row length is not a multiple of 8 (K % 256 == 0).
    """
    out = []
    for name, sc in (("w13_scale", w13_scale), ("w2_scale", w2_scale)):
        if not isinstance(sc, torch.Tensor) or sc.dtype not in UE8M0_DTYPES or sc.dim() != 3 \
                or not sc.is_contiguous():
            raise ValueError(f"{name} must be a contiguous 3-D uint8 / float8_e8m0fnu tensor, got "
                             f"{getattr(sc, 'dtype', type(sc).__name__)} {tuple(getattr(sc, 'shape', ()))}")
        n, rows, kg = sc.shape
        if rows % 32 or kg % 8:
            raise ValueError(f"{name}: tiles need rows a multiple of 32 and K / 32 a multiple of 8, got "
                             f"{tuple(sc.shape[1:])}")
        b = sc.view(torch.uint8).reshape(n, rows // 32, 32, kg // 8, 8).permute(0, 1, 3, 2, 4)
        out.append(b.contiguous().view(sc.dtype).reshape(sc.shape))
    return out[0], out[1]


def _dequant_mode(choice: str, max_scale_byte: int | None, dev: torch.device) -> int:
    """The kernels' DEQ constexpr for a config's ``dequant`` choice (see DEQUANT_CHOICES)."""
    bits_ok = max_scale_byte is not None and max_scale_byte <= BITS_MAX_SCALE_BYTE
    if choice == "bits" and not bits_ok:
        raise ValueError(f"config: dequant='bits' needs max_scale_byte <= {BITS_MAX_SCALE_BYTE} (scales <= 2), got "
                         f"max_scale_byte={max_scale_byte!r}")
    if choice == "auto":
        hopper = dev.type == "cuda" and not _INTERPRET and torch.cuda.get_device_capability(dev)[0] == 9
        choice = "bits" if bits_ok and hopper else "dot_scaled"
    if choice == "dot_scaled":
        return DEQ_DOT_SCALED
    return DEQ_BITS_TL if _INTERPRET else DEQ_BITS_ASM


def _fit_split(split: int, k_dim: int) -> int:
    """The requested K split halved until every split is a whole number of 128-wide steps."""
    while k_dim % (split * 128):
        split //= 2
    return split


def _fit_bk(cfg: dict, k_len: int) -> dict:
    """The config with BK halved until it divides the K range of one program (I = 128 n at any TP size), and
    BK_DOT (default BK) at most BK."""
    c = dict(cfg)
    while k_len % c["BK"]:
        c["BK"] //= 2
    c["BK_DOT"] = min(c.get("BK_DOT", c["BK"]), c["BK"])
    return c


def max_sorted_blocks(num_pairs: int, num_experts: int, bm: int) -> int:
    """Upper bound of sum_e ceil(count_e / bm) over experts (the sorted path's grid; shapes only)."""
    return (num_pairs + min(num_experts, num_pairs) * (bm - 1)) // bm


_TICKETS: dict = {}  # device -> the shared int32 ticket counters of the fold plans, all zero between calls


def mxfp4_moe_workspace(max_tokens: int, topk: int, hidden: int, intermediate: int, device="cuda") -> torch.Tensor:
    """A zeroed int32 workspace for ``fused_moe_mxfp4(..., workspace=...)``: the ticket counters of the ``fold``
    plans, [max_tokens * (topk * intermediate + hidden) / 16] (one per (pair, 16 intermediate columns) and per
    (token, 16 hidden columns)). Every call leaves it zeroed for the next. Give each caller that may run at the
    same time as another (different CUDA streams) its own; calls on one stream, or replays of CUDA graphs, can
    share one.

    Raises:
        ValueError: a size argument that is not a positive int.
    """
    for name, v in (("max_tokens", max_tokens), ("topk", topk), ("hidden", hidden), ("intermediate", intermediate)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    return torch.zeros(_ticket_count(max_tokens, topk, hidden, intermediate), dtype=torch.int32, device=device)


def _ticket_count(t: int, k: int, h: int, inter: int, bn_gu: int = 16, bn_dn: int = 16) -> int:
    return t * k * (inter // bn_gu) + t * (h // bn_dn)


def _ticket_buffer(dev: torch.device, n: int) -> torch.Tensor:
    """n int32 ticket counters when the caller passed no workspace: one buffer per device, zero on entry and left
    zero by every call (each ticket's last user resets it), made outside graph capture, so a captured call adds
    no memset node and its replays may run on any stream. During capture with no large enough buffer yet, a fresh
    zeroed one (a memset node in the graph) is used rather than caching memory of the graph's pool."""
    buf = _TICKETS.get(str(dev))
    if buf is None or buf.numel() < n:
        if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return torch.zeros(n, dtype=torch.int32, device=dev)
        buf = torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=dev)
        _TICKETS[str(dev)] = buf
    return buf


def fused_moe_mxfp4(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    swiglu_limit: float | None = None,
    routed_scaling_factor: float | None = None,
    up_first: bool = False,
    out: torch.Tensor | None = None,
    config: dict | None = None,
    max_scale_byte: int | None = None,
    weight_layout: str = "sglang",
    workspace: torch.Tensor | None = None,
) -> torch.Tensor:
    """Top-k routed MoE with MXFP4 experts (computation: ``pd.kernels.mxfp4_moe_reference``).

    Args:
        hidden_states: [T, H] bfloat16 (row stride free, unit column stride).
        w13: [E, 2 I, H / 2] uint8/int8, contiguous: gate rows [0, I), up rows [I, 2 I) (``up_first=True``:
            FlashInfer's [up; gate]); two e2m1 per byte, low nibble = even column.
        w13_scale: [E, 2 I, H / 32] UE8M0 (uint8 or float8_e8m0fnu), contiguous.
        w2: [E, H, I / 2] uint8/int8, contiguous. w2_scale: [E, H, I / 32] UE8M0, contiguous.
        topk_weights: [T, k] float32/bfloat16/float16, contiguous. topk_ids: [T, k] int32/int64, contiguous;
            values in [0, E) or -1 (pair skipped, e.g. an expert on another rank); others are skipped too.
        swiglu_limit: SwiGLU clamp L (gate <= L, |up| <= L); DeepSeek-V4 uses config.swiglu_limit = 10.0. None:
            no clamp (SGLang's default).
        routed_scaling_factor: multiplies the output (None: 1; pass None when it is folded into topk_weights).
        out: optional [T, H] bfloat16 output buffer with unit column stride.
        max_scale_byte: the largest UE8M0 byte in w13_scale and w2_scale, from ``mxfp4_max_scale_byte`` at
            weight-load time (it reads every scale and synchronizes, so not per call). When it is <= 128 (every
            scale <= 2) an sm_90 GPU dequantizes with bit arithmetic (~2x fewer instructions than tl.dot_scaled;
            see ``_E2M1_BITS_ASM``); None (unknown) or larger keeps tl.dot_scaled. A wrong value that lets a byte
            > 128 reach the bits path gives inf/NaN outputs, not silently wrong numbers.
        weight_layout: "sglang" (the layout above) or "sm90_bits": w13 and w2 as returned by
            ``prepare_mxfp4_weights_sm90`` (same shapes and dtypes, bytes reordered once at weight-load time; the
            scales unchanged), read by the bits dequantization with about half its integer work. Needs a GPU of
            compute capability >= 9.0 (or the interpreter) and max_scale_byte <= 128; ``dequant="dot_scaled"`` is
            refused. "sm90_tiled": w13 and w2 from ``prepare_mxfp4_weights_sm90(..., tiled=True)`` (rows in
            32-row x 256-value tiles) and the scales from ``tile_mxfp4_scales`` (32-row x 8-byte tiles), with the
            same needs, plus H and I multiples of 256; ``prefetch_*`` is refused.
        config: launch plan override (benchmarks): {"path": "pair_token"|"pair"|"sorted", "BM": 16|32|64,
            "split_gate_up": 1|2|4|8, "split_down": ..., "gate_up_halves": bool, "dequant": "auto"|"bits"|
            "dot_scaled", "gate_up": {BN, BK, num_warps, num_stages[, BK_DOT, maxnreg]}, "down": {...}, "fold": bool,
            "pdl": bool, "pdl_release": "k_loop"|"start", "prefetch_gate_up": 0|1|2, "prefetch_down": 0|1|2,
            "stage_loads": 0..3}; default
            ``default_config(T * k, weight_layout)``. BK: K per loop iteration (pipeline stage), 128/256/512;
            BK_DOT: K per dequantize + dot step inside it (64/128/256, default BK); maxnreg: registers per thread
            cap (32..255, the Triton launch option; more programs per SM). fold (path "pair"): the SwiGLU
            and the sum over k are done by the last program of each group (atomic tickets in ``workspace``), so
            a call is 2 launches instead of 4; pdl (with fold; compute capability >= 9, else ignored): the down
            launch is a programmatic dependent of gate/up (its programs start during gate/up's last wave and wait
            with griddepcontrol.wait), released after gate/up's K loop or (pdl_release="start") at its start;
            prefetch_*: 1 = each program first prefetches its weight rows into L2, 2 (gate/up, pair paths) = also
            a slice of its expert's down weights (evict_last) for the down launch, 2 (down) = its own rows with
            evict_last; stage_loads: see ``STAGE_LOADS_CHOICES``.
        workspace: int32 ticket counters for fold plans, from ``mxfp4_moe_workspace`` (zeroed once; every call
            leaves it zeroed). None: one buffer per device kept by this module, so two fold calls must not run
            at the same time on different streams without their own workspaces.
    Returns:
        [T, H] bfloat16 (``out`` when given).
    Raises:
        ValueError: naming the argument, for a wrong dtype, shape, layout or device, H or I not a multiple of
        128, a bad swiglu_limit / routed_scaling_factor / max_scale_byte / config (``dequant="bits"`` without
        max_scale_byte <= 128), an unknown weight_layout, a prepared layout where the bits path cannot run or (tiled)
        H or I not a multiple of 256, a
        workspace of the wrong dtype, device or size; raised before any launch.
    Requires H % 128 == 0 and I % 128 == 0 (DeepSeek-V4: H = 4096, I = 2048 / TP). Capturable in a CUDA graph
    (fixed grids from shapes, routing read on the device, workspaces from the caching allocator).
    """
    out, stages = _plan(hidden_states, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, swiglu_limit,
                        routed_scaling_factor, up_first, out, config, max_scale_byte, weight_layout, workspace)
    for _, launch in stages:
        launch()
    return out


def _plan(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, swiglu_limit, routed_scaling_factor, up_first,
          out, config, max_scale_byte=None, weight_layout="sglang", workspace=None):
    """Validate, allocate, and return (out, [(stage name, launch callable), ...]); the stages run in order."""
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.dim() != 2:
        raise ValueError(f"hidden_states must be a bfloat16 tensor [T, H], got "
                         f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
    t, h = x.shape
    if x.stride(1) != 1:
        raise ValueError("hidden_states must have unit column stride")
    if h % 128 or h == 0:
        raise ValueError(f"hidden_states: hidden size H must be a positive multiple of 128, got {h}")
    dev = x.device
    if not isinstance(w13, torch.Tensor) or w13.dim() != 3:
        raise ValueError(f"w13 must be a 3-D tensor [E, 2 I, H / 2], got {tuple(getattr(w13, 'shape', ()))}")
    n_exp, two_i = w13.shape[0], w13.shape[1]
    inter = two_i // 2
    if two_i % 2 or inter % 128 or inter == 0:
        raise ValueError(f"w13: dim 1 must be 2 I with I a positive multiple of 128, got {two_i}")
    w13u = _check_weight("w13", w13, (n_exp, two_i, h // 2), dev)
    s13u = _check_scale("w13_scale", w13_scale, (n_exp, two_i, h // GROUP), dev)
    w2u = _check_weight("w2", w2, (n_exp, h, inter // 2), dev)
    s2u = _check_scale("w2_scale", w2_scale, (n_exp, h, inter // GROUP), dev)
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dtype not in (torch.int32, torch.int64) \
            or topk_ids.dim() != 2 or topk_ids.shape[0] != t or topk_ids.shape[1] < 1:
        raise ValueError(f"topk_ids must be an int32/int64 tensor [{t}, k], got "
                         f"{getattr(topk_ids, 'dtype', None)} {tuple(getattr(topk_ids, 'shape', ()))}")
    k = topk_ids.shape[1]
    if not topk_ids.is_contiguous() or topk_ids.device != dev:
        raise ValueError(f"topk_ids must be contiguous and on {dev}")
    if not isinstance(topk_weights, torch.Tensor) or topk_weights.dtype not in (torch.float32, torch.bfloat16,
                                                                                   torch.float16) \
            or tuple(topk_weights.shape) != (t, k):
        raise ValueError(f"topk_weights must be a float32/bfloat16/float16 tensor [{t}, {k}], got "
                         f"{getattr(topk_weights, 'dtype', None)} {tuple(getattr(topk_weights, 'shape', ()))}")
    if not topk_weights.is_contiguous() or topk_weights.device != dev:
        raise ValueError(f"topk_weights must be contiguous and on {dev}")
    if swiglu_limit is not None and not (isinstance(swiglu_limit, (int, float)) and math.isfinite(swiglu_limit)
                                         and swiglu_limit > 0):
        raise ValueError(f"swiglu_limit must be None or a positive finite float, got {swiglu_limit!r}")
    scaling = 1.0 if routed_scaling_factor is None else routed_scaling_factor
    if not isinstance(scaling, (int, float)) or not math.isfinite(scaling):
        raise ValueError(f"routed_scaling_factor must be None or a finite float, got {routed_scaling_factor!r}")
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.dtype != torch.bfloat16 or tuple(out.shape) != (t, h) \
                or out.stride(1) != 1 or out.device != dev:
            raise ValueError(f"out must be a bfloat16 tensor [{t}, {h}] with unit column stride on {dev}")
    if workspace is not None and (not isinstance(workspace, torch.Tensor) or workspace.dtype != torch.int32
                                  or workspace.dim() != 1 or not workspace.is_contiguous() or workspace.device != dev
                                  or workspace.numel() < _ticket_count(t, k, h, inter)):
        raise ValueError(f"workspace must be a contiguous 1-D int32 tensor on {dev} of at least "
                         f"{_ticket_count(t, k, h, inter)} elements (mxfp4_moe_workspace), got "
                         f"{getattr(workspace, 'dtype', type(workspace).__name__)} "
                         f"{tuple(getattr(workspace, 'shape', ()))}")
    if max_scale_byte is not None and (isinstance(max_scale_byte, bool) or not isinstance(max_scale_byte, int)
                                       or not 0 <= max_scale_byte <= 254):
        raise ValueError(f"max_scale_byte must be None or an int in [0, 254], got {max_scale_byte!r}")
    cfg = config if config is not None else default_config(t * k, weight_layout)
    _check_config(cfg, h, inter)
    if weight_layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"weight_layout must be one of {tuple(WEIGHT_LAYOUTS)}, got {weight_layout!r}")
    wl = WEIGHT_LAYOUTS[weight_layout]
    xs = cfg.get("stage_loads", 0)
    if xs and wl == WL_SGLANG:
        raise ValueError(f"config: stage_loads needs a prepared weight_layout {PREPARED_LAYOUTS}")
    if wl >= WL_SM90_TILED:
        if h % 256 or inter % 256:
            raise ValueError(f"weight_layout={weight_layout!r} needs H and I multiples of 256 (whole tiles), got "
                             f"H {h}, I {inter}")
        if cfg.get("prefetch_gate_up", 0) or cfg.get("prefetch_down", 0):
            raise ValueError(f"config: prefetch_gate_up / prefetch_down read rows of weight_layout='sm90_bits', not "
                             f"{weight_layout!r}")
    if wl != WL_SGLANG:
        if cfg.get("dequant", "auto") == "dot_scaled":
            raise ValueError(f"config: dequant='dot_scaled' cannot read weight_layout={weight_layout!r} weights")
        if dev.type == "cuda" and not _INTERPRET and torch.cuda.get_device_capability(dev)[0] < 9:
            raise ValueError(f"weight_layout={weight_layout!r} needs compute capability >= 9.0 (mul.rn.bf16x2)")
        deq = _dequant_mode("bits", max_scale_byte, dev)
    else:
        deq = _dequant_mode(cfg.get("dequant", "auto"), max_scale_byte, dev)
    if out is None:
        out = torch.empty(t, h, dtype=torch.bfloat16, device=dev)
    if t == 0:
        return out, []
    check_runnable("hidden_states", x, "pd.kernels.mxfp4_moe_reference")  # after every argument check

    p = t * k
    path = cfg["path"]
    sp_gu, sp_dn = _fit_split(cfg.get("split_gate_up", 1), h), _fit_split(cfg.get("split_down", 1), inter)
    gu = _fit_bk(cfg["gate_up"], h // sp_gu)
    dn = _fit_bk(cfg["down"], inter // sp_dn)
    if path == "sorted" and cfg.get("BM", 16) > 16:  # the activation tile grows with BM: keep 99 KiB on sm_120
        gu["BK"] = dn["BK"] = 128
        gu["BK_DOT"], dn["BK_DOT"] = min(gu["BK_DOT"], 128), min(dn["BK_DOT"], 128)
    if _INTERPRET:  # the interpreter's cost is per program step, not per byte (and it has no registers)
        gu = dict(gu, num_warps=4, num_stages=1)
        dn = dict(dn, num_warps=4, num_stages=1)
        gu.pop("maxnreg", None)
        dn.pop("maxnreg", None)
    # the optional register cap: more resident programs per SM when a grid would otherwise spill into a second wave
    gu_reg = {"maxnreg": gu["maxnreg"]} if "maxnreg" in gu else {}
    dn_reg = {"maxnreg": dn["maxnreg"]} if "maxnreg" in dn else {}
    ids = topk_ids
    limit = float(swiglu_limit) if swiglu_limit is not None else 0.0
    has_limit = swiglu_limit is not None
    halves = cfg.get("gate_up_halves", False)
    hbuf = torch.empty(p, inter, dtype=torch.bfloat16, device=dev)
    two_pass = halves or sp_gu > 1  # gate/up partial sums, then _swiglu_kernel
    part = torch.empty(sp_gu, p, 2 * inter, dtype=torch.float32, device=dev) if two_pass else hbuf
    common = dict(H=h, I=inter, TOPK=k, ROUND=_INTERPRET, DEQ=deq, WL=wl)
    stages = []
    if path == "sorted":
        bm = cfg.get("BM", 16)
        n_blk = max_sorted_blocks(p, n_exp, bm)
        sorted_ids = torch.empty(n_blk * bm, dtype=torch.int32, device=dev)
        blk_exp = torch.empty(n_blk, dtype=torch.int32, device=dev)
        meta = torch.empty(1 + triton.next_power_of_2(n_exp + 1), dtype=torch.int32, device=dev)
        nblk, cursor = meta[:1], meta[1:]
        stages.append(("align", lambda: _align_kernel[(1,)](
            ids, sorted_ids, blk_exp, nblk, cursor, p, n_blk * bm, n_exp, E_BINS=cursor.numel(), BM=bm,
            CHUNK=64 if _INTERPRET else 1024, num_warps=4)))
        grid_m = n_blk
    else:
        bm = cfg.get("BM", 16)
        sorted_ids, blk_exp, nblk = ids, ids, ids  # unused
        grid_m = p
    sorted_mode = path == "sorted"
    fold = cfg.get("fold", False)
    on_gpu = dev.type == "cuda" and not _INTERPRET
    pdl = cfg.get("pdl", False) and on_gpu and torch.cuda.get_device_capability(dev)[0] >= 9
    pdl = (2 if cfg.get("pdl_release", "k_loop") == "start" else 1) if pdl else 0  # the kernels' PDL constexpr
    pf_gu = cfg.get("prefetch_gate_up", 0) if on_gpu else 0  # inline PTX: not in the interpreter
    pf_dn = cfg.get("prefetch_down", 0) if on_gpu else 0
    n_gu_tick = p * (inter // gu["BN"])
    n_tick = n_gu_tick + t * (h // dn["BN"])
    if fold and workspace is not None:
        ticks = workspace
    else:
        ticks = _ticket_buffer(dev, n_tick) if fold else ids
    gu_ticks, dn_ticks = (ticks[:n_gu_tick], ticks[n_gu_tick:]) if fold else (ids, ids)
    stages.append(("gate_up", lambda: _gate_up_kernel[(grid_m, (2 if halves else 1) * inter // gu["BN"], sp_gu)](
        x, w13u, s13u, ids, sorted_ids, blk_exp, nblk, hbuf, part, gu_ticks, w2u, s2u, x.stride(0), limit, p, n_exp,
        SORTED=sorted_mode, HAS_LIMIT=has_limit, UP_FIRST=bool(up_first), SPLIT=sp_gu, HALVES=halves, BM=bm,
        BN=gu["BN"], BK=gu["BK"], BKD=gu["BK_DOT"], num_warps=gu["num_warps"], num_stages=gu["num_stages"],
        PF=pf_gu, FOLD=fold and two_pass, PDL=pdl, XS=xs, **common, **gu_reg)))
    if two_pass and not fold:
        blk = math.gcd(inter, 256)  # small blocks: enough programs at T = 1
        stages.append(("swiglu", lambda: _swiglu_kernel[(p, inter // blk)](
            part, ids, hbuf, limit, p, n_exp, I=inter, SPLIT=sp_gu, HAS_LIMIT=has_limit, ROUND=_INTERPRET,
            BLOCK=blk, num_warps=4)))
    if path == "pair_token":
        stages.append(("down", lambda: _down_kernel[(t, h // dn["BN"], 1)](
            hbuf, w2u, s2u, ids, topk_weights, ids, ids, ids, out, out, ids, out.stride(0), float(scaling), p,
            n_exp, MODE=2, SPLIT=1, BM=bm, BN=dn["BN"], BK=dn["BK"], BKD=dn["BK_DOT"], num_warps=dn["num_warps"],
            num_stages=dn["num_stages"], **common, **dn_reg)))
        return out, stages
    y = torch.empty(sp_dn, p, h, dtype=torch.float32, device=dev)
    stages.append(("down", lambda: _down_kernel[(grid_m, h // dn["BN"], sp_dn)](
        hbuf, w2u, s2u, ids, topk_weights, sorted_ids, blk_exp, nblk, y, out, dn_ticks, out.stride(0),
        float(scaling), p, n_exp, MODE=0 if sorted_mode else 1, SPLIT=sp_dn, BM=bm, BN=dn["BN"], BK=dn["BK"],
        BKD=dn["BK_DOT"], num_warps=dn["num_warps"], num_stages=dn["num_stages"], PF=pf_dn, FOLD=fold, PDL=pdl,
        XS=xs, **common, **dn_reg, **({"launch_pdl": True} if pdl else {}))))
    if fold:
        return out, stages
    block = 256  # enough programs at T = 1 (the row is read k * split times)
    stages.append(("sum", lambda: _topk_sum_kernel[(t, triton.cdiv(h, block))](
        y, ids, out, out.stride(0), p, n_exp, H=h, TOPK=k, SPLIT=sp_dn, ROUND=_INTERPRET, BLOCK=block,
        num_warps=4)))
    return out, stages
