"""Argument checks of the MXFP4 MoE launcher (tensors, scale bytes, launch plans); all raise ValueError."""

from __future__ import annotations

import torch

from .configs import (
    BM_CHOICES,
    DEQUANT_CHOICES,
    MAXNREG_MIN,
    PATHS,
    PDL_RELEASE_CHOICES,
    SPLIT_CHOICES,
    STAGE_LOADS_CHOICES,
)


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
