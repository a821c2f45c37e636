"""Inline PTX of the MXFP4 MoE kernels: e2m1 -> bf16 dequantization by bit arithmetic (sm_90) and L2 prefetches.

The strings are ``tl.constexpr`` so the ``@triton.jit`` helpers in ``jit_helpers`` can pass them to
``tl.inline_asm_elementwise``. ``DEQ_*`` are the values of the kernels' ``DEQ`` constexpr.
"""

from __future__ import annotations

import triton.language as tl

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
# tl.dot operand of its own, loaded straight from memory (H200: benchmarks/results/mxfp4_moe.md).
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


# L2 prefetch of one 128-byte line per lane (sm_80+: sm_90 and sm_120): the loads a program will issue, all in
# flight at once instead of the 2-3 stages of its cp.async pipeline; ``evict_last`` keeps lines read by a later
# launch (the down weights a gate/up program fetches for the down kernel) ahead of the streamed gate/up lines.
_PREFETCH_L2_ASM = tl.constexpr("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;")
_PREFETCH_L2_LAST_ASM = tl.constexpr("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;")
PF_LINE = tl.constexpr(128)  # bytes per prefetch
