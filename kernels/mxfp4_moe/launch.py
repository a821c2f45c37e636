"""The MXFP4 MoE launcher: ``fused_moe_mxfp4`` validates, plans (``_plan``) and launches the kernels."""

from __future__ import annotations

import dataclasses
import math
import os

import torch
import triton

from ..device_info import check_runnable
from .configs import BITS_MAX_SCALE_BYTE, MoEPlan, MoETile, default_config
from .kernels import _align_kernel, _down_kernel, _gate_up_kernel, _swiglu_kernel, _topk_sum_kernel
from .layouts import PREPARED_LAYOUTS, WEIGHT_LAYOUTS, WL_SGLANG, WL_SM90_TILED
from .ptx import DEQ_BITS_ASM, DEQ_BITS_TL, DEQ_DOT_SCALED
from .validation import _check_config, _check_scale, _check_weight

GROUP = 32  # values per UE8M0 scale
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


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


def _fit_bk(tile: MoETile, k_len: int) -> MoETile:
    """The tile with BK halved until it divides the K range of one program (I = 128 n at any TP size), and
    BK_DOT (default BK) set, at most BK."""
    bk = tile.BK
    while k_len % bk:
        bk //= 2
    return dataclasses.replace(tile, BK=bk, BK_DOT=min(tile.bk_dot, bk))


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
    config: MoEPlan | dict | None = None,
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
        config: launch plan override (benchmarks): a ``MoEPlan`` (its docstring lists the fields: path, BM, K
            splits, tiles, fold / pdl / prefetch / stage_loads options), or its nested-dict form
            {"path": ..., "gate_up": {"BN", "BK", "num_warps", "num_stages"[, "BK_DOT", "maxnreg"]}, "down": {...},
            ...} read by ``MoEPlan.from_dict``; default ``default_config(T * k, weight_layout)``. fold plans keep
            their tickets in ``workspace``; pdl's down programs start during gate/up's last wave and wait with
            griddepcontrol.wait.
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
    t, h, n_exp, inter, k, w13u, s13u, w2u, s2u = _check_tensors(x, w13, w13_scale, w2, w2_scale, topk_weights,
                                                                 topk_ids)
    dev = x.device
    scaling = _check_options(t, h, k, inter, dev, swiglu_limit, routed_scaling_factor, out, workspace, max_scale_byte)
    cfg = _check_config(config if config is not None else default_config(t * k, weight_layout), h, inter)
    wl, deq = _layout_and_dequant(cfg, weight_layout, h, inter, max_scale_byte, dev)
    if out is None:
        out = torch.empty(t, h, dtype=torch.bfloat16, device=dev)
    if t == 0:
        return out, []
    check_runnable("hidden_states", x, "pd.kernels.mxfp4_moe_reference")  # after every argument check
    sp_gu, sp_dn, gu, dn = _tiles(cfg, h, inter)
    return out, _stages(x, w13u, s13u, w2u, s2u, topk_weights, topk_ids, out, workspace, cfg, t, h, n_exp, inter, k,
                        sp_gu, sp_dn, gu, dn, wl, deq, swiglu_limit, scaling, up_first)


def _check_tensors(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids):
    """(T, H, E, I, k, and the four weight / scale tensors as uint8 views) after checking every tensor input."""
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
    return t, h, n_exp, inter, k, w13u, s13u, w2u, s2u


def _check_options(t, h, k, inter, dev, swiglu_limit, routed_scaling_factor, out, workspace, max_scale_byte):
    """The routed scaling factor (1 for None) after checking the scalar options, ``out`` and ``workspace``."""
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
    return scaling


def _layout_and_dequant(cfg: MoEPlan, weight_layout, h, inter, max_scale_byte, dev):
    """The kernels' WL and DEQ constexprs, after checking that the plan can read ``weight_layout``."""
    if weight_layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"weight_layout must be one of {tuple(WEIGHT_LAYOUTS)}, got {weight_layout!r}")
    wl = WEIGHT_LAYOUTS[weight_layout]
    if cfg.stage_loads and wl == WL_SGLANG:
        raise ValueError(f"config: stage_loads needs a prepared weight_layout {PREPARED_LAYOUTS}")
    if wl >= WL_SM90_TILED:
        if h % 256 or inter % 256:
            raise ValueError(f"weight_layout={weight_layout!r} needs H and I multiples of 256 (whole tiles), got "
                             f"H {h}, I {inter}")
        if cfg.prefetch_gate_up or cfg.prefetch_down:
            raise ValueError(f"config: prefetch_gate_up / prefetch_down read rows of weight_layout='sm90_bits', not "
                             f"{weight_layout!r}")
    if wl == WL_SGLANG:
        return wl, _dequant_mode(cfg.dequant, max_scale_byte, dev)
    if cfg.dequant == "dot_scaled":
        raise ValueError(f"config: dequant='dot_scaled' cannot read weight_layout={weight_layout!r} weights")
    if dev.type == "cuda" and not _INTERPRET and torch.cuda.get_device_capability(dev)[0] < 9:
        raise ValueError(f"weight_layout={weight_layout!r} needs compute capability >= 9.0 (mul.rn.bf16x2)")
    return wl, _dequant_mode("bits", max_scale_byte, dev)


def _tiles(cfg: MoEPlan, h: int, inter: int) -> tuple[int, int, MoETile, MoETile]:
    """(gate/up K splits, down K splits, gate/up tile, down tile) as launched: splits and BK fitted to the shapes,
    BK 128 for sorted blocks of more than 16 rows, small interpreter launches."""
    sp_gu, sp_dn = _fit_split(cfg.split_gate_up, h), _fit_split(cfg.split_down, inter)
    gu = _fit_bk(cfg.gate_up, h // sp_gu)
    dn = _fit_bk(cfg.down, inter // sp_dn)
    if cfg.path == "sorted" and cfg.BM > 16:  # the activation tile grows with BM: keep 99 KiB on sm_120
        gu = dataclasses.replace(gu, BK=128, BK_DOT=min(gu.bk_dot, 128))
        dn = dataclasses.replace(dn, BK=128, BK_DOT=min(dn.bk_dot, 128))
    if _INTERPRET:  # the interpreter's cost is per program step, not per byte (and it has no registers)
        gu = dataclasses.replace(gu, num_warps=4, num_stages=1, maxnreg=None)
        dn = dataclasses.replace(dn, num_warps=4, num_stages=1, maxnreg=None)
    return sp_gu, sp_dn, gu, dn


def _launch_flags(cfg: MoEPlan, dev):
    """(PDL, gate/up PF, down PF) constexprs: programmatic dependent launch needs compute capability >= 9, and
    neither it nor the prefetches' inline PTX runs in the interpreter."""
    on_gpu = dev.type == "cuda" and not _INTERPRET
    pdl = cfg.pdl and on_gpu and torch.cuda.get_device_capability(dev)[0] >= 9
    pdl = (2 if cfg.pdl_release == "start" else 1) if pdl else 0
    return pdl, cfg.prefetch_gate_up if on_gpu else 0, cfg.prefetch_down if on_gpu else 0


def _sorted_blocks(ids, p, n_exp, bm, dev):
    """The sorted path's row blocks: (align stage, sorted pair ids, expert of each block, block count, grid rows)."""
    n_blk = max_sorted_blocks(p, n_exp, bm)
    sorted_ids = torch.empty(n_blk * bm, dtype=torch.int32, device=dev)
    blk_exp = torch.empty(n_blk, dtype=torch.int32, device=dev)
    meta = torch.empty(1 + triton.next_power_of_2(n_exp + 1), dtype=torch.int32, device=dev)
    nblk, cursor = meta[:1], meta[1:]
    stage = ("align", lambda: _align_kernel[(1,)](
        ids, sorted_ids, blk_exp, nblk, cursor, p, n_blk * bm, n_exp, E_BINS=cursor.numel(), BM=bm,
        CHUNK=64 if _INTERPRET else 1024, num_warps=4))
    return stage, sorted_ids, blk_exp, nblk, n_blk


def _stages(x, w13u, s13u, w2u, s2u, topk_weights, ids, out, workspace, cfg, t, h, n_exp, inter, k, sp_gu, sp_dn,
            gu, dn, wl, deq, swiglu_limit, scaling, up_first):
    """The launches of a plan, in order: [align (sorted)], gate/up, [swiglu (two-pass, no fold)], down, [sum]."""
    dev = x.device
    p = t * k
    path = cfg.path
    xs = cfg.stage_loads
    # the optional register cap: more resident programs per SM when a grid would otherwise spill into a second wave
    gu_reg = {"maxnreg": gu.maxnreg} if gu.maxnreg is not None else {}
    dn_reg = {"maxnreg": dn.maxnreg} if dn.maxnreg is not None else {}
    limit = float(swiglu_limit) if swiglu_limit is not None else 0.0
    has_limit = swiglu_limit is not None
    halves = cfg.gate_up_halves
    hbuf = torch.empty(p, inter, dtype=torch.bfloat16, device=dev)
    two_pass = halves or sp_gu > 1  # gate/up partial sums, then _swiglu_kernel
    part = torch.empty(sp_gu, p, 2 * inter, dtype=torch.float32, device=dev) if two_pass else hbuf
    common = dict(H=h, I=inter, TOPK=k, ROUND=_INTERPRET, DEQ=deq, WL=wl)
    bm = cfg.BM
    stages = []
    sorted_mode = path == "sorted"
    if sorted_mode:
        align, sorted_ids, blk_exp, nblk, grid_m = _sorted_blocks(ids, p, n_exp, bm, dev)
        stages.append(align)
    else:
        sorted_ids, blk_exp, nblk = ids, ids, ids  # unused
        grid_m = p
    fold = cfg.fold
    pdl, pf_gu, pf_dn = _launch_flags(cfg, dev)
    n_gu_tick = p * (inter // gu.BN)
    n_tick = n_gu_tick + t * (h // dn.BN)
    if fold and workspace is not None:
        ticks = workspace
    else:
        ticks = _ticket_buffer(dev, n_tick) if fold else ids
    gu_ticks, dn_ticks = (ticks[:n_gu_tick], ticks[n_gu_tick:]) if fold else (ids, ids)
    stages.append(("gate_up", lambda: _gate_up_kernel[(grid_m, (2 if halves else 1) * inter // gu.BN, sp_gu)](
        x, w13u, s13u, ids, sorted_ids, blk_exp, nblk, hbuf, part, gu_ticks, w2u, s2u, x.stride(0), limit, p, n_exp,
        SORTED=sorted_mode, HAS_LIMIT=has_limit, UP_FIRST=bool(up_first), SPLIT=sp_gu, HALVES=halves, BM=bm,
        BN=gu.BN, BK=gu.BK, BKD=gu.BK_DOT, num_warps=gu.num_warps, num_stages=gu.num_stages,
        PF=pf_gu, FOLD=fold and two_pass, PDL=pdl, XS=xs, **common, **gu_reg)))
    if two_pass and not fold:
        blk = math.gcd(inter, 256)  # small blocks: enough programs at T = 1
        stages.append(("swiglu", lambda: _swiglu_kernel[(p, inter // blk)](
            part, ids, hbuf, limit, p, n_exp, I=inter, SPLIT=sp_gu, HAS_LIMIT=has_limit, ROUND=_INTERPRET,
            BLOCK=blk, num_warps=4)))
    if path == "pair_token":
        stages.append(("down", lambda: _down_kernel[(t, h // dn.BN, 1)](
            hbuf, w2u, s2u, ids, topk_weights, ids, ids, ids, out, out, ids, out.stride(0), float(scaling), p,
            n_exp, MODE=2, SPLIT=1, BM=bm, BN=dn.BN, BK=dn.BK, BKD=dn.BK_DOT, num_warps=dn.num_warps,
            num_stages=dn.num_stages, **common, **dn_reg)))
        return stages
    y = torch.empty(sp_dn, p, h, dtype=torch.float32, device=dev)
    stages.append(("down", lambda: _down_kernel[(grid_m, h // dn.BN, sp_dn)](
        hbuf, w2u, s2u, ids, topk_weights, sorted_ids, blk_exp, nblk, y, out, dn_ticks, out.stride(0),
        float(scaling), p, n_exp, MODE=0 if sorted_mode else 1, SPLIT=sp_dn, BM=bm, BN=dn.BN, BK=dn.BK,
        BKD=dn.BK_DOT, num_warps=dn.num_warps, num_stages=dn.num_stages, PF=pf_dn, FOLD=fold, PDL=pdl,
        XS=xs, **common, **dn_reg, **({"launch_pdl": True} if pdl else {}))))
    if fold:
        return stages
    block = 256  # enough programs at T = 1 (the row is read k * split times)
    stages.append(("sum", lambda: _topk_sum_kernel[(t, triton.cdiv(h, block))](
        y, ids, out, out.stride(0), p, n_exp, H=h, TOPK=k, SPLIT=sp_dn, ROUND=_INTERPRET, BLOCK=block,
        num_warps=4)))
    return stages
