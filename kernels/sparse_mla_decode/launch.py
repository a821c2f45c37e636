"""``sparse_mla_decode``: argument checks, the heads-per-program and split pick, and the launches of the split kernel
(one per cache) and the combine. The default path launches a fixed config, so it is CUDA-graph-capturable."""

from __future__ import annotations

import math
import os

import torch
import triton

from ..device_info import check_runnable, is_sm90, num_sms
from ..sparse_mla_reference import BYTES_PER_TOKEN, D_QK, page_stride_bytes
from .configs import (
    CONFIGS,
    DEFAULT_CONFIG,
    DEFAULT_SPARSE_MLA_CONFIG,
    SUPPORTED_PAGE_SIZES,
    SparseMLAConfig,
    _default_config,
    _pick_block_h,
)
from .kernels import (
    _combine_kernel,
    _sparse_mla_fwd_chunked_kernel,
    _sparse_mla_fwd_kernel,
    _sparse_mla_fwd_pipelined_kernel,
)

LOG2E = 1.4426950408889634
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

_TUNED = {
    bh: triton.autotune(configs=cfgs, key=["PAGE_SIZE", "DIRECT", "HAS_LEN", "HAS_SINK", "grid_bucket"])(
        _sparse_mla_fwd_kernel)
    for bh, cfgs in CONFIGS.items()
}


def _cache_view(name, k_cache):
    """Validate a cache and return (uint8 view, int16 view, page_size, page_stride_bytes)."""
    if not isinstance(k_cache, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(k_cache).__name__}")
    if k_cache.dtype not in (torch.uint8, torch.int8, torch.float8_e4m3fn):
        raise ValueError(f"{name} must be uint8, int8 or float8_e4m3fn bytes (DSv4 FP8 layout), got {k_cache.dtype}")
    if k_cache.dim() == 4:
        pages, page_size, hk, bpt = k_cache.shape
        if hk != 1 or bpt != BYTES_PER_TOKEN:
            raise ValueError(f"{name} must be (pages, page_size, 1, {BYTES_PER_TOKEN}), got {tuple(k_cache.shape)}")
        if page_size not in SUPPORTED_PAGE_SIZES:
            raise ValueError(f"{name} page_size must be one of {SUPPORTED_PAGE_SIZES}, got {page_size}")
        want = page_stride_bytes(page_size)
        if pages > 1 and k_cache.stride(0) != want:
            raise ValueError(f"{name} page stride must be {want} bytes for page_size {page_size}, "
                             f"got {k_cache.stride(0)}")
        if k_cache.stride(3) != 1 or k_cache.stride(1) != BYTES_PER_TOKEN:
            raise ValueError(f"{name} must be a view of the packed page buffer (token stride 584, byte stride 1)")
        stride = want
    elif k_cache.dim() == 2:
        stride = k_cache.shape[1]
        sizes = {page_stride_bytes(p): p for p in SUPPORTED_PAGE_SIZES}
        if stride not in sizes or not k_cache.is_contiguous():
            pss = "/".join(map(str, SUPPORTED_PAGE_SIZES))
            raise ValueError(
                f"{name} as a 2-D byte buffer must be contiguous (pages, page_stride) with page_stride in "
                f"{sorted(sizes)} (page_size {pss}), got {tuple(k_cache.shape)}"
            )
        page_size = sizes[stride]
    else:
        raise ValueError(f"{name} must be 4-D (pages, page_size, 1, 584) or 2-D (pages, page_stride), "
                         f"got {k_cache.dim()}-D")
    if k_cache.data_ptr() % 16:
        raise ValueError(f"{name} must be 16-byte aligned")
    u8 = k_cache.view(torch.uint8)
    i16 = u8.view(torch.int16)
    return u8, i16, page_size, stride


def _check_indices(name, indices, b, s, device):
    if not isinstance(indices, torch.Tensor) or indices.dtype != torch.int32:
        raise ValueError(f"{name} must be an int32 tensor [B, S, topk]")
    if indices.dim() != 3 or indices.shape[0] != b or indices.shape[1] != s or indices.shape[2] < 1:
        raise ValueError(f"{name} must have shape [{b}, {s}, topk>=1], got {tuple(indices.shape)}")
    if not indices.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if indices.device != device:
        raise ValueError(f"{name} must be on {device}, got {indices.device}")


def _check_len(name, t, b, device):
    if t is None:
        return
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.shape != (b,) or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous int32 tensor of shape [{b}]")
    if t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")



def sparse_mla_decode(
    q,
    k_cache,
    indices,
    topk_length=None,
    attn_sink=None,
    softmax_scale=None,
    extra_k_cache=None,
    extra_indices=None,
    extra_topk_length=None,
    *,
    block_h=None,
    num_splits=None,
    config=None,
    autotune=False,
    mla_config=None,
):
    """Sparse-MLA decode; see the module docstring. Returns (out [B,S,H,512] bf16, lse [B,H,S] fp32).

    Keyword-only tuning knobs (benchmarks/tests): ``block_h`` (16/32/64 heads per program), ``num_splits``
    (topk splits of the main cache; default: enough programs to fill every SM's program slots once),
    ``config`` (a dict {"BLOCK_N", "num_warps", "num_stages"} plus optional "CHUNKED": True for the chunked
    kernel or "PIPELINE": loop stages for the pipelined one, and "PROGRAMS_PER_SM" for the default split count;
    default ``_default_config``: DEFAULT_CONFIG[block_h], on sm_90 DEFAULT_CONFIG_SM90[block_h], and
    TWO_PER_SM_CONFIG_16 for 16-head programs on grids of more than 32 rows), ``autotune`` (search
    CONFIGS[block_h] with triton.autotune instead; not CUDA-graph-capturable on first use), ``mla_config`` (a
    ``SparseMLAConfig``; None: DEFAULT_SPARSE_MLA_CONFIG). The default path launches a fixed config, so it is
    capturable.
    """
    if not isinstance(q, torch.Tensor) or q.dtype != torch.bfloat16 or q.dim() != 4 or q.shape[-1] != D_QK:
        raise ValueError(f"q must be a bfloat16 tensor [B, S, H, {D_QK}], got "
                         f"{getattr(q, 'dtype', type(q).__name__)} {tuple(getattr(q, 'shape', ()))}")
    b, s, h, _ = q.shape
    if h % 16 or not 16 <= h <= 128:
        raise ValueError(f"q: number of heads must be a multiple of 16 in [16, 128], got {h}")
    if q.stride(-1) != 1 or q.stride(2) != D_QK:
        raise ValueError("q must have contiguous heads and head dim (stride(2) == 512, stride(3) == 1)")
    dev = q.device
    kc8, kc16, page_size, page_stride = _cache_view("k_cache", k_cache)
    if k_cache.device != dev:
        raise ValueError(f"k_cache must be on {dev}, got {k_cache.device}")
    _check_indices("indices", indices, b, s, dev)
    _check_len("topk_length", topk_length, b, dev)
    if attn_sink is not None:
        if not isinstance(attn_sink, torch.Tensor) or attn_sink.dtype != torch.float32 or attn_sink.shape != (h,) \
                or not attn_sink.is_contiguous() or attn_sink.device != dev:
            raise ValueError(f"attn_sink must be a contiguous float32 tensor of shape [{h}] on {dev}")
    if softmax_scale is None:
        softmax_scale = D_QK ** -0.5
    if not isinstance(softmax_scale, (int, float)) or not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale must be a positive finite float, got {softmax_scale!r}")
    has_extra = extra_k_cache is not None
    if has_extra:
        ekc8, ekc16, epage_size, epage_stride = _cache_view("extra_k_cache", extra_k_cache)
        if extra_k_cache.device != dev:
            raise ValueError(f"extra_k_cache must be on {dev}, got {extra_k_cache.device}")
        if extra_indices is None:
            raise ValueError("extra_indices is required with extra_k_cache")
        _check_indices("extra_indices", extra_indices, b, s, dev)
        _check_len("extra_topk_length", extra_topk_length, b, dev)
    elif extra_indices is not None or extra_topk_length is not None:
        raise ValueError("extra_indices / extra_topk_length given without extra_k_cache")
    if mla_config is None:
        mla_config = DEFAULT_SPARSE_MLA_CONFIG
    if not isinstance(mla_config, SparseMLAConfig):
        raise ValueError(f"mla_config must be a SparseMLAConfig, got {type(mla_config).__name__}")
    if block_h is None:
        block_h = _pick_block_h(b, s, h, is_sm90(dev))
    if block_h not in (16, 32, 64) or h % block_h:
        raise ValueError(f"block_h must be 16, 32 or 64 and divide H={h}, got {block_h}")

    topk = indices.shape[2]
    n_hb = h // block_h
    base = b * s * n_hb
    if _INTERPRET:
        cfg = dict(config or DEFAULT_CONFIG[block_h], BLOCK_N=16, num_warps=4, num_stages=1)
    else:
        cfg = config or _default_config(block_h, base, is_sm90(dev))
    if num_splits is None:
        # enough (batch * query token * head block * split) programs to fill every program slot once
        slots = num_sms(dev) * cfg.get("PROGRAMS_PER_SM", 1)
        num_splits = max(1, (slots + base // 2) // base)
    chunk = max(64, triton.cdiv(triton.cdiv(topk, max(1, num_splits)), 64) * 64)
    ns_main = triton.cdiv(topk, chunk)
    jobs = [(kc8, kc16, page_size, page_stride, indices, topk_length, chunk, ns_main, 0)]
    ns_total = ns_main
    if has_extra:
        etopk = extra_indices.shape[2]
        echunk = max(64, triton.cdiv(triton.cdiv(etopk, max(1, num_splits)), 64) * 64)
        ens = triton.cdiv(etopk, echunk)
        jobs.append((ekc8, ekc16, epage_size, epage_stride, extra_indices, extra_topk_length, echunk, ens, ns_total))
        ns_total += ens
    direct = ns_total == 1

    check_runnable("q", q, "pd.kernels.sparse_mla_reference")  # after every argument check: they name bad input
    out = torch.empty(b, s, h, D_QK, dtype=torch.bfloat16, device=dev)
    lse = torch.empty(b, h, s, dtype=torch.float32, device=dev)
    if direct:
        part_o = part_lse = out  # unused
    else:
        part_o = torch.empty(b * s * h * ns_total, D_QK, dtype=torch.float32, device=dev)
        part_lse = torch.empty(b * s * h * ns_total, dtype=torch.float32, device=dev)
    sink = attn_sink if attn_sink is not None else lse
    sm_scale_log2 = float(softmax_scale) * LOG2E
    # the autotuned kernel objects are launched without the PDL constant, so their combine is a plain launch
    pdl = (not direct and mla_config.combine_pdl and not _INTERPRET and dev.type == "cuda"
           and not (autotune and config is None) and torch.cuda.get_device_capability(dev)[0] >= 9)
    pipelined = mla_config.pipelined_kernel or _sparse_mla_fwd_pipelined_kernel
    for c8, c16, ps, pstride, idx, tl_len, ch, ns, soff in jobs:
        args = (q, c8, c16, idx, tl_len if tl_len is not None else idx, sink, out, lse, part_o, part_lse,
                sm_scale_log2, pstride, s, h, idx.shape[2], ch, soff, ns_total,
                q.stride(0), q.stride(1), q.stride(2), (b * s * n_hb * ns).bit_length())
        consts = dict(HAS_LEN=tl_len is not None, HAS_SINK=attn_sink is not None, DIRECT=direct,
                      PAGE_SIZE=ps, BLOCK_H=block_h, DOT_F32=_INTERPRET,
                      DOT_PREC="ieee" if _INTERPRET else "tf32")
        grid = (b * s, n_hb, ns)
        if autotune and not _INTERPRET and config is None:
            _TUNED[block_h][grid](*args, **consts)
        else:
            # the launch right before a PDL combine (the extra cache's, when there is one) releases it early
            consts["PDL"] = pdl and soff + ns == ns_total
            if cfg.get("PIPELINE"):
                pipelined[grid](*args, **consts, BLOCK_N=cfg["BLOCK_N"], LOOP_STAGES=cfg["PIPELINE"],
                                num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
            elif cfg.get("CHUNKED", False):
                _sparse_mla_fwd_chunked_kernel[grid](*args, **consts, BLOCK_N=cfg["BLOCK_N"],
                                                     num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
            else:
                _sparse_mla_fwd_kernel[grid](*args, **consts, BLOCK_N=cfg["BLOCK_N"], num_warps=cfg["num_warps"],
                                             num_stages=cfg["num_stages"])
    if not direct:
        _combine_kernel[(b * s * h,)](part_o, part_lse, sink, out, lse, s, h, ns_total,
                                      HAS_SINK=attn_sink is not None,
                                      SPLITS_P2=triton.next_power_of_2(ns_total), ROUND=_INTERPRET,
                                      PDL=pdl, num_warps=4, **({"launch_pdl": True} if pdl else {}))
    return out, lse
