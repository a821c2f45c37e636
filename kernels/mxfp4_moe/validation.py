"""Argument checks of the MXFP4 MoE launcher (tensors, scale bytes, launch plans: ``MoEPlan`` checks itself, here
only against the shapes); all raise ValueError."""

from __future__ import annotations

from typing import Mapping

import torch

from .configs import MoEPlan, as_plan


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


def _check_config(config: MoEPlan | Mapping, h: int, inter: int) -> MoEPlan:
    """``config`` as a ``MoEPlan`` (a dict through ``MoEPlan.from_dict``) after the checks against H and I.

    Raises:
        ValueError: any ``MoEPlan`` check, or a tile's BN that does not divide its kernel's N.
    """
    plan = as_plan(config)
    plan.check_dims(h, inter)
    return plan


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
