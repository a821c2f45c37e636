"""The indexer's launchers: ``dsa_indexer_topk`` (scores + select), ``topk_from_scores`` (select of precomputed
scores), the workspace, the score split, and the argument checks (ValueError naming the argument)."""

from __future__ import annotations

import os

import torch
import triton

from ..device_info import check_runnable, is_sm90, num_sms
from ..indexer_reference import BYTES_PER_TOKEN, INDEX_DIM
from .configs import (
    DEFAULT_INDEXER_CONFIG,
    DEFAULT_SELECT_WARPS,
    FINE_BINS,
    FINE_SHIFT,
    GROUP,
    HIST_BINS,
    HIST_SHIFT,
    MAX_S,
    MAX_TILE_P,
    MAX_TOPK,
    MIN_TILES,
    MIN_WAVE_SPLIT,
    PROGRAMS_PER_SM,
    PV_TILES,
    RADIX_BITS,
    S_CHUNK,
    SCORE_CONFIGS,
    SELECT_PROGRAMS,
    SELECT_SPLIT,
    SELECT_TGS,
    SELECT_WARPS,
    SUPPORTED_HEADS,
    SUPPORTED_PAGE_SIZES,
    IndexerConfig,
)
from .score_kernel import _group_max_kernel, _index_scores_kernel
from .select_kernel import _select_topk_kernel

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def score_split(batch: int, cfg: dict, sms: int) -> int:
    """Score programs per request (grid dim 1, at most 64). A config with ``WAVE`` = w (w of its programs fit on an
    SM at once) launches at most w * sms programs in all, one wave, so each program fills its key pipeline once for
    more tiles and no small last wave idles the GPU, when that still splits a request over >= MIN_WAVE_SPLIT
    programs; otherwise (and for configs without WAVE) ~PROGRAMS_PER_SM programs per SM, several waves."""
    wave = cfg.get("WAVE", 0) * sms // batch
    if wave >= MIN_WAVE_SPLIT:
        return min(64, wave)
    return max(1, min(64, triton.cdiv(PROGRAMS_PER_SM * sms, batch)))


def page_vector_consts(block_n: int, page_size: int, tiles: int = 0):
    """(tiles per page-id chunk, page ids per register vector as a power of two, two vectors?) of the "fp8pv" score
    path for chunks of ``tiles`` tiles (0: PV_TILES), or (tiles, 0, False) when a tile can span more than two pages
    (page_size < block_n / 2; that path then does not apply). A chunk needs tiles * block_n / page_size + 1 page ids;
    more than 32 go into two vectors (PAIR), each within one warp. Raises ValueError for a chunk of more than 64."""
    tiles = tiles or PV_TILES
    if 2 * page_size < block_n:
        return tiles, 0, False
    need = tiles * block_n // page_size + 1
    if need > 64:
        _fail("config", f"PV = {tiles} tiles of {block_n} need {need} page ids of {page_size} tokens, at most 64")
    if need <= 32:
        return tiles, triton.next_power_of_2(need), False
    return tiles, triton.next_power_of_2(triton.cdiv(need, 2)), True


def candidate_capacity(topk: int) -> int:
    """Candidate positions (scores >= the histogram bound) the select kernel handles in registers without its
    streamed fallback, per row and per slice: 4x the next power of two of topk, at most MAX_TILE_P (the bound
    admits about topk positions plus those of one 1/8-binade bin)."""
    return min(MAX_TILE_P, 4 * triton.next_power_of_2(topk))


_tile_p = candidate_capacity


def _workspace_layout(rows: int, max_len: int, topk: int):
    """(groups per row, candidate capacity, per-row scratch, int32 elements in all): scores [rows, max_len],
    group maxima [rows, ng], histograms [rows, HIST_BINS], select tickets [rows], fine histograms [rows, FINE_BINS],
    scratch [rows, SELECT_SPLIT * (2 * cap + 1)] (per slice: candidate positions [cap] and keys [cap]; then one count
    per slice)."""
    ng = triton.cdiv(max_len, GROUP)
    cap = candidate_capacity(topk)
    scr = SELECT_SPLIT * (2 * cap + 1)
    return ng, cap, scr, rows * (max_len + ng + HIST_BINS + 1 + FINE_BINS + scr)


def indexer_workspace(batch: int, s: int, max_len: int, topk: int = 512, device="cuda") -> torch.Tensor:
    """A reusable, zero-initialized int32 workspace for ``dsa_indexer_topk(..., workspace=...)``: fp32 scores
    [B*S, max_len], group maxima [B*S, max_len / 8], group-max histograms [B*S, 4096], select tickets [B*S],
    fine candidate histograms [B*S, 4096] and candidate scratch [B*S, 16 * (8 * min(4096, 4 * next_pow2(topk)) + 4)
    bytes]; 4.5 bytes per position of the block table plus ~300 KB per query token at topk 512. ``max_len`` =
    block_table.shape[1] * page_size. Allocate once per (max batch, max context) so a CUDA graph captures fixed
    addresses. Each call leaves the histograms and tickets zeroed for the next; a workspace with nonzero histograms
    (never passed through a full call) still gives exact results, one call more slowly."""
    return torch.zeros(_workspace_layout(batch * s, max_len, topk)[3], dtype=torch.int32, device=device)


def _fail(name, msg):
    raise ValueError(f"{name}: {msg}")


def _check_cache(index_k_cache, page_size):
    """Flat int32 view of the cache (4 fp8 keys per element) after checking its layout."""
    if not isinstance(index_k_cache, torch.Tensor):
        _fail("index_k_cache", f"must be a torch.Tensor, got {type(index_k_cache).__name__}")
    if index_k_cache.dtype not in (torch.uint8, torch.int8, torch.float8_e4m3fn):
        _fail("index_k_cache", f"must hold bytes (uint8, int8 or float8_e4m3fn), got {index_k_cache.dtype}")
    row = page_size * BYTES_PER_TOKEN
    shape = tuple(index_k_cache.shape)
    if index_k_cache.dim() == 2:
        if shape[1] != row:
            _fail("index_k_cache", f"2-D cache must be [num_pages, page_size * 132] = [P, {row}] for page_size "
                                   f"{page_size}, got {shape}")
    elif index_k_cache.dim() == 4:
        if shape[1:] != (page_size, 1, BYTES_PER_TOKEN):
            _fail("index_k_cache", f"4-D cache must be [num_pages, {page_size}, 1, 132] (DeepGEMM's view), got {shape}")
    else:
        _fail("index_k_cache", f"must be [num_pages, page_size * 132] or [num_pages, page_size, 1, 132], got {shape}")
    if not index_k_cache.is_contiguous():
        _fail("index_k_cache", "must be contiguous (SGLang's per-layer page buffer or a view of it)")
    if index_k_cache.data_ptr() % 16:
        _fail("index_k_cache", "must be 16-byte aligned")
    return index_k_cache.view(torch.uint8).reshape(-1).view(torch.int32)


def _check_lengths(seq_lens, b, s, dev):
    if not isinstance(seq_lens, torch.Tensor) or seq_lens.dtype not in (torch.int32, torch.int64):
        _fail("seq_lens", f"must be an int32/int64 tensor, got {getattr(seq_lens, 'dtype', type(seq_lens).__name__)}")
    if tuple(seq_lens.shape) not in ((b,), (b, s)) or not seq_lens.is_contiguous():
        _fail("seq_lens", f"must be contiguous [{b}] (request lengths) or [{b}, {s}] (per query token), got "
                          f"{tuple(seq_lens.shape)}")
    if seq_lens.device != dev:
        _fail("seq_lens", f"must be on {dev} (read on the device), got {seq_lens.device}")
    return seq_lens.dim() == 2


def _check_out(out, shape, dev):
    if out is None:
        return torch.empty(shape, dtype=torch.int32, device=dev)
    if not isinstance(out, torch.Tensor) or out.dtype != torch.int32 or tuple(out.shape) != shape \
            or not out.is_contiguous() or out.device != dev:
        _fail("out", f"must be a contiguous int32 tensor {list(shape)} on {dev}")
    return out


def _check_topk(topk):
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= MAX_TOPK:
        _fail("topk", f"must be an int in [1, {MAX_TOPK}], got {topk!r}")


def _check_warps(select_warps, topk):
    # 8 warps hold topk 512's register tiles without spills; larger topk needs 16 (AOT register counts)
    warps = select_warps or (DEFAULT_SELECT_WARPS if topk <= 1024 else 16)
    if warps not in SELECT_WARPS:
        _fail("select_warps", f"must be one of {SELECT_WARPS}, got {select_warps!r}")
    return warps


def _check_indexer_config(indexer_config):
    if indexer_config is None:
        return DEFAULT_INDEXER_CONFIG
    if not isinstance(indexer_config, IndexerConfig):
        _fail("indexer_config", f"must be an IndexerConfig, got {type(indexer_config).__name__}")
    return indexer_config


def _workspace_views(workspace, rows, max_len, topk, dev):
    ng, cap, scr, n = _workspace_layout(rows, max_len, topk)
    if workspace is None:
        workspace = torch.empty(n, dtype=torch.int32, device=dev)
        # histograms, tickets, fine histograms
        workspace[rows * (max_len + ng): rows * (max_len + ng + HIST_BINS + 1 + FINE_BINS)].zero_()
    elif not isinstance(workspace, torch.Tensor) or workspace.dtype != torch.int32 or workspace.numel() < n \
            or not workspace.is_contiguous() or workspace.device != dev:
        _fail("workspace", f"must be a contiguous int32 tensor of >= {n} elements on {dev} (indexer_workspace())")
    ws = workspace.view(-1)
    o1, o2, o3 = rows * max_len, rows * (max_len + ng), rows * (max_len + ng + HIST_BINS)
    o4 = o3 + rows
    o5 = o4 + rows * FINE_BINS
    return (ws[:o1].view(torch.float32), ws[o1:o2].view(torch.float32), ws[o2:o3], ws[o3:o4], ws[o4:o5], ws[o5:n],
            ng, cap)


def _interp(name, default):
    # small tiles under the interpreter so tests reach the multi-tile and streamed paths at tiny shapes
    return int(os.environ.get(name, default))


def _select_split(rows, select_split):
    if select_split is None:  # ~SELECT_PROGRAMS programs in all: every program reads the row's histogram
        return max(1, min(SELECT_SPLIT, triton.cdiv(SELECT_PROGRAMS, rows)))
    if isinstance(select_split, bool) or not isinstance(select_split, int) or not 1 <= select_split <= SELECT_SPLIT:
        _fail("select_split", f"must be an int in [1, {SELECT_SPLIT}], got {select_split!r}")
    return select_split


def _select_launch(scores, gmax, hist, tick, fine, scr, lens, out, rows, s, max_len, stride_row, ng, cap, topk,
                   len_2d, warps, nsel, icfg, clear_hist=True, pdl=False):
    cap_p = cap if not _INTERPRET else min(cap, _interp("PD_INDEXER_INTERP_TILE_P", cap))
    _select_topk_kernel[(rows, nsel)](
        scores, gmax, hist, tick, fine, scr, lens, out, s, max_len, stride_row, ng, topk,
        LEN_2D=len_2d, G=GROUP, NB=HIST_BINS, SHIFT=HIST_SHIFT, NSEL=SELECT_SPLIT, CAP=cap, CAP_P=cap_p,
        TGS=SELECT_TGS if not _INTERPRET else _interp("PD_INDEXER_INTERP_TGS", 8),
        TILE=1024 if not _INTERPRET else 16, RADIX=RADIX_BITS, CLEAR_HIST=clear_hist,
        SEARCH=icfg.select_search, NBF=FINE_BINS, FSHIFT=FINE_SHIFT, PDL=pdl,
        GROWS=min(triton.next_power_of_2(nsel), cap_p) if icfg.select_gather2d else 0,
        FAST_EXACT=icfg.select_fast_exact, READ_SCORES=icfg.select_reads_scores,
        num_warps=warps, **({"launch_pdl": True} if pdl else {}),
    )


def dsa_indexer_topk(q, weights, index_k_cache, block_table, seq_lens, topk=512, page_size=64, out=None, *,
                     q_scale=None, workspace=None, n_split=None, config=None, select_warps=None,
                     select_split=None, stages=("scores", "select"), indexer_config=None):
    """Top-``topk`` index positions per query token of the DSA lightning indexer (decode / MTP verify).

    Args:
      q: [B, S, H, 128] bfloat16, or float8_e4m3fn (then ``q_scale`` or weights carry its scales); H in
         {16, 32, 64, 128}; innermost dim contiguous. S <= 8 (S > 1: MTP verify tokens; up to 4 share one
         pass over the keys).
      weights: [B, S, H] float32 or bfloat16 per-head weights, as SGLang passes them (already scaled by
         n_heads**-0.5 * head_dim**-0.5 and, for an fp8 query, usually by the query scale).
      index_k_cache: SGLang's index-key buffer of one layer, uint8 [num_pages, page_size * 132] (or its
         [num_pages, page_size, 1, 132] view; int8 / float8_e4m3fn bytes accepted); layout in
         ``pd.kernels.indexer_reference``.
      block_table: int32 [B, max_pages] physical page of each logical page (SGLang's page_table_64); its width
         sets the max context ``max_len = max_pages * page_size`` that the workspace is sized for.
      seq_lens: int32/int64 on the device, [B] request lengths including the S query tokens (query token s
         sees positions [0, seq_lens[b] - S + 1 + s)) or [B, S] per-token live lengths; clamped to
         [0, max_len].
      topk: 1 .. 2048 (DSv4: 512). page_size: 1 .. 256, a power of two (SGLang: 64).
      out: optional int32 [B, S, topk] output (written fully).
      q_scale: optional float32 [B, S, H] contiguous, multiplied into the weights (fp8 query only).
      workspace: optional int32 tensor from ``indexer_workspace(B, S, max_len, topk)``, used by this function
         only; allocated per call when None (inside a CUDA graph capture that is the graph's private pool).
      n_split, config, select_warps, select_split, stages: benchmark knobs: score programs per request,
         score-kernel config (one of SCORE_CONFIGS), warps and programs per query token (1 .. 16) of the select
         kernel, which of the two kernels to launch (a select-only call keeps the histograms the previous
         scores-only call left).
      indexer_config: an ``IndexerConfig`` (the score tables and select switches); None: DEFAULT_INDEXER_CONFIG.

    Returns: int32 [B, S, topk]: ascending logical positions of the topk highest scores in each query token's
      live range (set-equal to torch.topk up to ties), or 0 .. L-1 then -1 when L <= topk.

    Raises: ValueError naming the argument for a wrong type, dtype, shape, layout, device or value, before any
      launch. Block-table entries of live pages must be valid page ids of the cache (not checked: that would
      need a device sync).
    """
    if not isinstance(q, torch.Tensor) or q.dtype not in (torch.bfloat16, torch.float8_e4m3fn) or q.dim() != 4 \
            or q.shape[-1] != INDEX_DIM:
        _fail("q", f"must be a bfloat16 or float8_e4m3fn tensor [B, S, H, {INDEX_DIM}], got "
                   f"{getattr(q, 'dtype', type(q).__name__)} {tuple(getattr(q, 'shape', ()))}")
    b, s, h, _ = q.shape
    if h not in SUPPORTED_HEADS:
        _fail("q", f"number of heads must be one of {SUPPORTED_HEADS}, got {h}")
    if not 1 <= s <= MAX_S:
        _fail("q", f"query tokens per request S must be in [1, {MAX_S}], got {s}")
    if b < 1:
        _fail("q", "batch must be >= 1")
    if q.stride(-1) != 1:
        _fail("q", "the head dim must be contiguous (stride(-1) == 1)")
    dev = q.device
    if not isinstance(weights, torch.Tensor) or weights.dtype not in (torch.float32, torch.bfloat16) \
            or tuple(weights.shape) != (b, s, h) or weights.stride(-1) != 1:
        _fail("weights", f"must be a float32/bfloat16 tensor [{b}, {s}, {h}] with stride(-1) == 1, got "
                         f"{getattr(weights, 'dtype', None)} {tuple(getattr(weights, 'shape', ()))}")
    if weights.device != dev:
        _fail("weights", f"must be on {dev}, got {weights.device}")
    if q_scale is not None:
        if q.dtype != torch.float8_e4m3fn:
            _fail("q_scale", "is only valid with a float8_e4m3fn q")
        if not isinstance(q_scale, torch.Tensor) or q_scale.dtype != torch.float32 \
                or tuple(q_scale.shape) != (b, s, h) or not q_scale.is_contiguous() or q_scale.device != dev:
            _fail("q_scale", f"must be a contiguous float32 tensor [{b}, {s}, {h}] on {dev}")
        if weights.stride() != q_scale.stride():
            _fail("weights", "must have the same strides as q_scale (both contiguous)")
    _check_topk(topk)
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size not in SUPPORTED_PAGE_SIZES:
        _fail("page_size", f"must be a power of two in [1, 256], got {page_size!r}")
    kc32 = _check_cache(index_k_cache, page_size)
    if index_k_cache.device != dev:
        _fail("index_k_cache", f"must be on {dev}, got {index_k_cache.device}")
    if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 or block_table.dim() != 2 \
            or block_table.shape[0] != b or block_table.shape[1] < 1 or block_table.stride(1) != 1:
        _fail("block_table", f"must be an int32 tensor [{b}, max_pages] with stride(1) == 1, got "
                             f"{getattr(block_table, 'dtype', None)} {tuple(getattr(block_table, 'shape', ()))}")
    if block_table.device != dev:
        _fail("block_table", f"must be on {dev}, got {block_table.device}")
    len_2d = _check_lengths(seq_lens, b, s, dev)
    out = _check_out(out, (b, s, topk), dev)
    max_len = block_table.shape[1] * page_size
    if max_len >= 2 ** 31 // 2:
        _fail("block_table", f"max context {max_len} tokens is too large")
    if config is not None and config not in SCORE_CONFIGS:
        _fail("config", f"must be one of SCORE_CONFIGS, got {config!r}")
    warps = _check_warps(select_warps, topk)
    icfg = _check_indexer_config(indexer_config)
    nsel = _select_split(b * s, select_split)
    if n_split is not None and (isinstance(n_split, bool) or not isinstance(n_split, int) or n_split < 1):
        _fail("n_split", f"must be a positive int, got {n_split!r}")

    rows = b * s
    scores, gmax, hist, tick, fine, scr, ng, cap = _workspace_views(workspace, rows, max_len, topk, dev)
    check_runnable("q", q, "pd.kernels.indexer_reference")  # after every argument check: they name bad input
    q_fp8 = q.dtype == torch.float8_e4m3fn
    pdl = icfg.select_pdl and not _INTERPRET and dev.type == "cuda" and torch.cuda.get_device_capability(dev)[0] >= 9
    qs = q_scale if q_scale is not None else weights
    sm90 = is_sm90(dev)
    k8 = kc32.view(torch.float8_e4m3fn)
    for s0 in range(0, s, S_CHUNK) if "scores" in stages else ():
        sc = min(S_CHUNK, s - s0)
        sp2 = triton.next_power_of_2(sc)
        cfg = dict(config) if config else icfg.score_config(sm90, sp2, q_fp8)
        if _INTERPRET:
            cfg["BLOCK_N"] = 32  # small tiles keep interpreted runs short
        ch, npv, pair = page_vector_consts(cfg["BLOCK_N"], page_size, cfg.get("PV", 0))
        if cfg["KEYS"] == "fp8pv" and not npv:
            cfg["KEYS"] = "fp8"  # pages smaller than half a tile: page ids per position (the fp8 path)
        ns = n_split or score_split(b, cfg, num_sms(dev))
        _index_scores_kernel[(b, ns)](
            q, weights, qs, kc32, k8, kc32.view(torch.float32), block_table, seq_lens, scores, gmax, hist,
            q.stride(0), q.stride(1), q.stride(2), weights.stride(0), weights.stride(1), block_table.stride(0),
            max_len, ng, ns, topk, s, s0,
            S=sc, S_P2=sp2, H=h, PAGE=page_size, BLOCK_N=cfg["BLOCK_N"], G=GROUP, LEN_2D=len_2d,
            HAS_QS=q_scale is not None, Q_FP8=q_fp8, MIN_TILES=MIN_TILES, DOT_F32=_INTERPRET,
            TOKENS_M=cfg["TOKENS_M"], PREFETCH=cfg["PREFETCH"], DOT_PREC="ieee" if _INTERPRET else "tf32",
            KEYS=cfg["KEYS"], NB=HIST_BINS, SHIFT=HIST_SHIFT, PDL=pdl, CH=ch, NPV=max(npv, 2),
            PAIR=pair, EPI=cfg.get("EPI", 0) if sc == 1 else 0,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
            **({"maxnreg": cfg["MAXNREG"]} if cfg.get("MAXNREG") else {}),
        )
    if "select" in stages:
        _select_launch(scores, gmax, hist, tick, fine, scr, seq_lens, out, rows, s, max_len, max_len, ng, cap, topk,
                       len_2d, warps, nsel, icfg, clear_hist="scores" in stages, pdl=pdl and "scores" in stages)
    return out


def topk_from_scores(scores, lengths, topk=512, out=None, *, select_warps=None, indexer_config=None):
    """Exact top-k of precomputed scores over each row's live prefix (the select stage of ``dsa_indexer_topk``).

    scores: float32 [R, W], stride(1) == 1; lengths: int32/int64 [R] on the same device (live prefix, clamped to
    [0, W]); returns int32 [R, topk]: ascending positions of the topk highest scores of ``scores[r, :L]``
    (set-equal to torch.topk up to ties; NaN ranks above +inf), or 0 .. L-1 then -1 when L <= topk. Capture-safe
    like ``dsa_indexer_topk``; ``indexer_config``: its select switches (None: DEFAULT_INDEXER_CONFIG). Raises
    ValueError naming the argument.
    """
    if not isinstance(scores, torch.Tensor) or scores.dtype != torch.float32 or scores.dim() != 2 \
            or scores.stride(1) != 1 or scores.shape[0] < 1 or scores.shape[1] < 1:
        _fail("scores", f"must be a float32 tensor [R, W] with stride(1) == 1, got "
                        f"{getattr(scores, 'dtype', None)} {tuple(getattr(scores, 'shape', ()))}")
    r, w = scores.shape
    dev = scores.device
    _check_topk(topk)
    if not isinstance(lengths, torch.Tensor) or lengths.dtype not in (torch.int32, torch.int64) \
            or tuple(lengths.shape) != (r,) or not lengths.is_contiguous() or lengths.device != dev:
        _fail("lengths", f"must be a contiguous int32/int64 tensor [{r}] on {dev}")
    out = _check_out(out, (r, topk), dev)
    warps = _check_warps(select_warps, topk)
    icfg = _check_indexer_config(indexer_config)
    check_runnable("scores", scores, "pd.kernels.indexer_reference")
    ng = triton.cdiv(w, GROUP)
    cap = candidate_capacity(topk)
    gmax = torch.empty(r, ng, dtype=torch.float32, device=dev)
    hist = torch.zeros(r, HIST_BINS, dtype=torch.int32, device=dev)
    tick = torch.zeros(r, dtype=torch.int32, device=dev)
    fine = torch.zeros(r, FINE_BINS, dtype=torch.int32, device=dev)
    scr = torch.empty(r, SELECT_SPLIT * (2 * cap + 1), dtype=torch.int32, device=dev)
    block = 256 if not _INTERPRET else 32
    n_split = max(1, min(64, triton.cdiv(PROGRAMS_PER_SM * num_sms(dev), r)))
    _group_max_kernel[(r, n_split)](scores, gmax, hist, lengths, scores.stride(0), ng, n_split, w, topk,
                                    G=GROUP, BLOCK=block, MIN_TILES=MIN_TILES, NB=HIST_BINS, SHIFT=HIST_SHIFT,
                                    num_warps=4)
    _select_launch(scores, gmax, hist, tick, fine, scr, lengths, out, r, 1, w, scores.stride(0), ng, cap, topk, True,
                   warps, _select_split(r, None), icfg)
    return out
