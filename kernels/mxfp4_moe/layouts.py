"""MXFP4 weight layouts: SGLang's checkpoint layout and the sm_90 re-layouts made once at weight-load time.

``prepare_mxfp4_weights_sm90`` reorders packed e2m1 weights into the "sm90_bits" element encoding (``ptx``'s
``_E2M1_PREP_ASM`` reads it), optionally stored as 32-row x 256-value tiles ("sm90_tiled"), whose scales come from
``tile_mxfp4_scales``. ``WL_*`` are the values of the kernels' ``WL`` constexpr.
"""

from __future__ import annotations

import torch
import triton.language as tl

from .validation import UE8M0_DTYPES

WL_SGLANG = 0  # SGLang's checkpoint layout (any dequantization)
WL_SM90_BITS = 1  # the prepared layout above (bits dequantization only)
# WL 2 ("sm90_tiled"): the elements of WL 1 (``prepare_mxfp4_weights_sm90(..., tiled=True)``), each band of 32 rows
# stored as K / 256 consecutive tiles of [32 rows x 64 elements] (4 KiB; a row's 256 values of one tile are 128
# contiguous bytes), and the scale bytes in the same bands of [32 rows x 8 bytes] tiles (``tile_mxfp4_scales``).
# Why: in WL 1 a program's pipeline stage reads one 128-byte piece (and 8 scale bytes) from each of its 32 rows, the
# rows 1-2 KiB apart, so the whole grid streams its experts in 128-byte pieces, well below DRAM peak; here a 32-row,
# BK-256 stage is one contiguous 4 KiB run and 256 bytes of scales. The weight tiles alone gained nothing, so the scale
# tiles, which gained with them, are kept only together (the A/B: benchmarks/results/mxfp4_moe_ab.md).
WL_SM90_TILED = 2
WEIGHT_LAYOUTS = {"sglang": WL_SGLANG, "sm90_bits": WL_SM90_BITS, "sm90_tiled": WL_SM90_TILED}
PREPARED_LAYOUTS = ("sm90_bits", "sm90_tiled")  # read with the sm90_bits element encoding
TILE_ROWS = tl.constexpr(32)  # rows per band of the tiled layout
TILE_ELEMS = tl.constexpr(64)  # 16-bit elements (256 values) per row of one tile
TILE_SCALES = tl.constexpr(8)  # WL 2: scale bytes (256 values) per row of one scale tile


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
