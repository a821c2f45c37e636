"""DSA lightning-indexer decode step: scores + exact top-k over each request's live range (Triton; sm_120a, sm_90a).

``dsa_indexer_topk(q, weights, index_k_cache, block_table, seq_lens, topk=512, page_size=64) -> indices``
[B, S, topk] int32: for every query token, the logical positions of its ``topk`` highest indexer scores,
ascending, or all live positions then -1 when the live range is not longer than ``topk``. Cache layout, score
formula, weight scaling and the causal live range of each query token (MTP verify, S > 1) are documented in
``pd.kernels.indexer_reference``, the torch reference (SGLang 0.5.23's DSA / DSv4 index-key cache:
``[num_pages, page_size * 132]`` uint8, per page ``page_size x 128`` fp8 e4m3 keys then ``page_size`` fp32 scales).

Why it exists: a decode step must cost O(live length), not O(--context-length). Both kernels read the lengths on
the device, so the launch is fixed for a given (batch, S, block-table width) and can be captured in a CUDA graph;
nothing past a request's length is read, scored or sorted.

1. ``_index_scores_kernel``, grid (B, n_split): program (b, j) scores its share of request b's live tiles
   (``BLOCK_N`` tokens; the share is computed on the device from ``seq_lens``, at least ``MIN_TILES`` tiles, so
   programs past the live range exit at once; n_split from ``score_split``: one wave of programs at small batch for
   configs that say how many fit on an SM, so each fills its key pipeline once). Per tile it gathers the fp8 keys
   and scales through the block table once and scores it for all S query tokens at once (up to 4 stacked as one
   [S * H, 128] operand; S > 4 takes several launches): ``q . k^T`` with one ``tl.dot`` (bf16 x bf16, or fp8 x fp8
   for an fp8 query; mma.sync on sm_120, wgmma on sm_90), then ``sum_h relu(.) * w_h * scale_k`` per token. Key
   tiles are either loaded as fp8 and software-pipelined by Triton (asynchronous copies, ``num_stages``) or loaded
   packed as int32 with a hand
   prefetch of the next tile (``SCORE_CONFIGS``; sm_90 fp8 x fp8 is wgmma e4m3, sm_120 mma.sync e4m3). The "fp8pv"
   tiles take their page ids from a register vector loaded once per ``PV_TILES`` tiles (config ``PV``; more than 32
   ids go into two vectors, each within one warp, so picking an id stays a warp reduction): with the page lookup of
   each position done by a load inside the loop ("fp8"), the pipeliner turns that lookup into an asynchronous copy
   of its own and, copies completing in order, waits for every copy in flight before each tile (cp.async.wait_group
   0), so a program has one tile in flight and not while it computes; without it the keys of the next
   ``num_stages - 1`` tiles stay in flight (wait_group num_stages - 2). Config ``EPI`` 1 gives the fp8pv path a
   one-query-token epilogue (``_score_tile_1q``: 1-D token sums in the dot's row layout, scalar row and histogram
   switches). It stores
   the fp32 scores, per group of ``GROUP`` = 8 positions their max, and counts each group max into a per-row
   histogram of the top 12 bits of its order key (4096 1/8-binade bins; relaxed atomics). Requests whose longest
   query token sees <= topk positions are skipped.
2. ``_select_topk_kernel``, grid (B * S, nsel): exact top-k of one query token's live scores, on order-preserving
   int32 keys of the fp32 scores, split over nsel <= ``SELECT_SPLIT`` programs per query token (slices of its
   group maxima; ~``SELECT_PROGRAMS`` programs in all, so a small batch still fills the GPU). Every program:
   (a) from the histogram, the low edge ``t0`` of the bin holding the topk-th largest group max. >= topk groups,
   hence >= topk distinct positions, reach t0, so t0 <= the topk-th largest score. Rows of <= topk groups
   (<= 8 * topk positions) count their scores instead, which bounds the topk-th score directly. (b) Its slice's
   positions with score >= t0 (only groups whose max reaches t0 are read; with ``select_reads_scores`` the slice's
   scores are read whole instead, requested with the histogram, so no gather waits on the group maxima) and their
   keys, compacted in position order into its own candidate list (fixed slots in the workspace; no atomics, so the
   order is deterministic).
   (c) A ticket (acq_rel atomic counter per query token, reset by its last user): the last slice to finish
   gathers all slices' lists (every position that can be selected, ~topk of them), zeroes the histogram for the
   next call, finds the exact threshold T among them in registers and takes keys > T, then keys == T in position
   order. ``select_search`` "fine": in (b) every slice also counts its candidates into a per-row histogram of
   ``FINE_BINS`` bins of 2**``FINE_SHIFT`` order keys above t0 (relaxed atomics), so the final program reads the
   bin b holding the topk-th candidate, checks it against its own candidates (their counts above and in b must
   bracket topk, else it searches all of them) and resolves only bin b: usually it holds exactly the missing
   ones (``select_fast_exact``: then every candidate in b or above is the answer, no search), or a few more whose
   smallest values it drops; else radix select on the bin ("radix": radix select over all candidates,
   ``tl.histogram`` passes). With ``select_gather2d`` the final program requests the slices' lists as one tile
   together with their counts (one round trip instead of two) when every list fits its share of the tile. The
   select kernel is launched with programmatic dependent launch (``select_pdl``, compute capability >= 9) and waits
   for the scores with griddepcontrol.wait. Set-equal to ``torch.topk`` up to ties. Fallbacks keep it exact on
   any input, streamed from memory over the whole live row:
   more candidates than the register tile (``candidate_capacity``; mass ties) or fewer than topk (only a stale
   histogram, e.g. a workspace that skipped a select). At 32K a query token's select is three dependent memory
   round trips in parallel programs (histogram with the first group-max tile, the score gather, the candidate
   lists), then the fine histogram and a few block-wide reductions over a ~topk-sized register tile, independent
   of the max context.

The switches of a launch are one frozen ``IndexerConfig`` (``DEFAULT_INDEXER_CONFIG`` ships), passed as
``indexer_config=``. Modules: ``configs`` (tuning tables, fixed sizes, ``IndexerConfig``), ``jit_helpers``,
``score_kernel``, ``select_kernel``, ``launch``. The torch reference is ``pd.kernels.indexer_reference``.
"""

from __future__ import annotations

from .configs import (
    DEFAULT_FP8Q_SCORE_CONFIGS,
    DEFAULT_INDEXER_CONFIG,
    DEFAULT_SCORE_CONFIGS,
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
    SELECT_SEARCHES,
    SELECT_SPLIT,
    SELECT_TGS,
    SELECT_WARPS,
    SUPPORTED_HEADS,
    SUPPORTED_PAGE_SIZES,
    IndexerConfig,
)
from .launch import (
    _workspace_layout,
    candidate_capacity,
    dsa_indexer_topk,
    indexer_workspace,
    num_sms,
    page_vector_consts,
    score_split,
    topk_from_scores,
)
from .score_kernel import _group_max_kernel, _index_scores_kernel
from .select_kernel import _kth_largest_radix, _select_streamed, _select_topk_kernel

__all__ = [
    "DEFAULT_FP8Q_SCORE_CONFIGS", "DEFAULT_INDEXER_CONFIG", "DEFAULT_SCORE_CONFIGS", "DEFAULT_SELECT_WARPS",
    "FINE_BINS", "FINE_SHIFT", "GROUP", "HIST_BINS", "HIST_SHIFT", "IndexerConfig", "MAX_S", "MAX_TILE_P",
    "MAX_TOPK", "MIN_TILES", "MIN_WAVE_SPLIT", "PROGRAMS_PER_SM", "PV_TILES", "RADIX_BITS", "SCORE_CONFIGS",
    "SELECT_PROGRAMS", "SELECT_SEARCHES", "SELECT_SPLIT", "SELECT_TGS", "SELECT_WARPS", "SUPPORTED_HEADS",
    "SUPPORTED_PAGE_SIZES", "S_CHUNK", "_group_max_kernel", "_index_scores_kernel", "_kth_largest_radix",
    "_select_streamed", "_select_topk_kernel", "_workspace_layout", "candidate_capacity", "dsa_indexer_topk",
    "indexer_workspace", "num_sms", "page_vector_consts", "score_split", "topk_from_scores",
]
