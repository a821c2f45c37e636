"""Tuning tables and settings of the DSA indexer: score-kernel configs, the fixed sizes of the workspace layout and of
the select kernel's tiles, and ``IndexerConfig``, the switches a launch reads (``DEFAULT_INDEXER_CONFIG`` ships).

Measurements behind each choice: benchmarks/results/indexer.md (the H200 sweeps and picks) and
benchmarks/results/indexer_max_context.md (cost against the max context).
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Mapping

GROUP = 8  # positions per group max
SUPPORTED_HEADS = (16, 32, 64, 128)
SUPPORTED_PAGE_SIZES = tuple(2 ** i for i in range(9))  # 1 .. 256
MAX_TOPK = 2048
MAX_S = 8


def _cfg(bn, w, tm, keys, stages, pf=False, wave=0, maxnreg=0, pv=0, epi=0):
    c = {"BLOCK_N": bn, "num_warps": w, "num_stages": stages, "TOKENS_M": tm, "PREFETCH": pf, "KEYS": keys}
    # optional: one-wave score split (WAVE programs per SM, see score_split), register cap per thread (ptxas .maxnreg),
    # tiles per page-id chunk of the fp8pv path (PV, default PV_TILES; see page_vector_consts), and the fp8pv path's
    # epilogue for one query token (EPI 1: _score_tile_1q; launches of several stacked tokens keep _score_tile)
    return dict(c, **({"WAVE": wave} if wave else {}), **({"MAXNREG": maxnreg} if maxnreg else {}),
                **({"PV": pv} if pv else {}), **({"EPI": epi} if epi else {}))


# Score-kernel configs (fixed, not autotuned, so a launch is capturable). TOKENS_M puts the key tile on the
# dot's M side (q^T on N), else the stacked queries are M. KEYS "packed": int32 tiles unpacked in registers, with
# a hand prefetch (PREFETCH) of the next tile; "fp8": fp8 tiles loaded as such, software-pipelined by Triton over
# num_stages (asynchronous copies into shared memory); "fp8pv": the same with the page ids of PV_TILES tiles loaded
# into registers at once (pages of >= BLOCK_N / 2 positions; smaller pages take the "fp8" path). Every config
# compiles for sm_120a with mma.sync and <= 99 KiB of shared memory, and for sm_90a, for 1, 2 and 4 stacked query
# tokens (tests/test_indexer.py; fp8pv 128/8 in 3 stages and 128/4 in 4 need > 99 KiB for 4 tokens). The 64-key EPI 1
# tiles at 72-80 registers fit 6-7 programs per SM instead of 3 (SASS per tile of an sm_90a build).
SCORE_CONFIGS = [
    _cfg(64, 4, True, "packed", 1, pf=True),
    _cfg(64, 8, True, "packed", 1, pf=True),
    _cfg(128, 8, True, "packed", 1, pf=True),
    _cfg(64, 4, True, "packed", 1, pf=False),
    _cfg(64, 4, False, "packed", 1, pf=True),
    _cfg(64, 4, True, "fp8", 2),
    _cfg(64, 4, True, "fp8", 3),
    _cfg(64, 4, True, "fp8", 4),
    _cfg(64, 8, True, "fp8", 3),
    _cfg(128, 8, True, "fp8", 3),
    _cfg(128, 4, True, "fp8", 3),
    _cfg(64, 4, False, "fp8", 3),
    _cfg(128, 4, True, "fp8pv", 3),
    _cfg(128, 4, True, "fp8pv", 3, wave=3, maxnreg=128),
    _cfg(128, 4, True, "fp8pv", 3, wave=3, maxnreg=128, pv=24),
    _cfg(128, 4, True, "fp8pv", 3, wave=3, maxnreg=128, pv=24, epi=1),
    _cfg(128, 4, True, "fp8pv", 3, wave=3, maxnreg=168, pv=24, epi=1),
    _cfg(64, 4, True, "fp8pv", 3, wave=6, maxnreg=80, pv=48, epi=1),
    _cfg(64, 4, True, "fp8pv", 2, wave=7, maxnreg=72, pv=48, epi=1),
]
# (sm_90?, stacked query tokens) -> config for a bf16 query. sm_90: the fastest of the H200 sweeps at 32K live / 128K
# max (keys on M, packed 64/4 for S = 1; fp8 tiles 64/4 in 2 stages for S = 2 and 128/4 in 3 stages for S = 4;
# benchmarks/results/indexer.md). sm_120: chosen from AOT register counts (no spills; no sm_120 GPU to time on).
DEFAULT_SCORE_CONFIGS = {
    (False, 1): _cfg(64, 4, True, "packed", 1, pf=True),
    (False, 2): _cfg(64, 8, True, "packed", 1, pf=True),
    (False, 4): _cfg(64, 8, True, "packed", 1, pf=True),
    (True, 1): _cfg(64, 4, True, "packed", 1, pf=True),
    (True, 2): _cfg(64, 4, True, "fp8", 2),
    (True, 4): _cfg(128, 4, True, "fp8", 3),
}
# fp8 query overrides (fp8 x fp8 dots need no key conversion; the query SGLang's DSv4 decode passes): sm_90 S = 1:
# 64-key fp8 tiles with the page ids of 48 tiles in registers, the one-token epilogue (EPI 1), 80 registers so 6
# programs per SM run one wave: the fastest full step at 32K for B = 16 and 64 in the H200 pick
# (benchmarks/results/indexer.md, which also lists the variants measured and not kept).
DEFAULT_FP8Q_SCORE_CONFIGS = {
    (True, 1): _cfg(64, 4, True, "fp8pv", 3, wave=6, maxnreg=80, pv=48, epi=1),
}
S_CHUNK = 4  # query tokens stacked per score launch (S > 4: several launches)
SELECT_WARPS = (4, 8, 16)
DEFAULT_SELECT_WARPS = 8
HIST_BINS = 4096  # per-row histogram of group maxima: top 12 bits of the order key (1/8-binade bins)
HIST_SHIFT = 20
RADIX_BITS = 6  # bits per radix-select pass (64-bin warp histograms; 8 bits was slower)
MAX_TILE_P = 4096  # register tile of the final threshold search
SELECT_SPLIT = 16  # select programs per query row at most (slices of its group maxima); sizes the workspace
SELECT_TGS = 256  # group maxima per select tile (a 32K-long row: one tile for each of the 16 slices)
# select programs to aim for in all (B=16: 16 per row, B=64: 4): every program reads the row's 16 KB histogram, so
# more per row cost more than they save at B=64 (H200 sweep at 32K: benchmarks/results/indexer.md)
SELECT_PROGRAMS = 256
FINE_BINS = 4096  # fine histogram of the candidates (select_search "fine"): bins of 2**FINE_SHIFT order keys above t0
FINE_SHIFT = 11  # 4096 x 2**11 = one binade above t0 (the topk-th score lies within it unless scores are extreme)
PV_TILES = 8  # "fp8pv" score path: key tiles per chunk of page ids loaded into registers at once
MIN_TILES = 4  # tiles per score program at least (fewer, larger programs for short rows)
# score programs per SM to aim for (configs without WAVE, or batches too large for a one-wave split): ~3 fit at once
# (~150 registers x 128 threads), so 8 keeps the last partial wave small; each still gets >= MIN_TILES tiles (the
# benchmark sweep times splits around the default)
PROGRAMS_PER_SM = 8
MIN_WAVE_SPLIT = 8  # one-wave score splits (config WAVE) only down to this many programs per request
SELECT_SEARCHES = ("fine", "radix")


@dataclasses.dataclass(frozen=True)
class IndexerConfig:
    """The switches of one indexer launch (``dsa_indexer_topk(..., indexer_config=...)``, ``topk_from_scores``);
    every choice gives the same output bit for bit (tests/indexer_interp_cases.py), they differ in speed only.

    score_configs / fp8q_score_configs: (sm_90?, stacked query tokens as a power of two) -> score-kernel config (one
      of SCORE_CONFIGS) for a bf16 / an fp8 query; the fp8 table overrides the bf16 one where it has the key.
    select_search: the final threshold search. "fine": the slices count their candidates into a per-row histogram of
      FINE_BINS bins above t0 (relaxed atomics), so the final program resolves only the bin holding the topk-th
      candidate; "radix": radix select over all candidates, RADIX_BITS a pass (Triton 3.9 emits one shared-memory
      atomic per key for tl.histogram, which collide when the candidates' top digits agree). fine was faster on the
      H200 at 32K (benchmarks/results/indexer.md).
    select_pdl: launch the select kernel as a programmatic dependent of the scores kernel (compute capability >= 9;
      ignored below and in the interpreter): its programs wait on the SMs (griddepcontrol.wait) for the scores.
    select_gather2d: the final select program reads the slices' candidate lists as one [n, cap / n] tile with their
      counts (one round trip) when every list fits its share; else the counts first, then the lists.
    select_fast_exact: when the fine bin of the topk-th candidate holds exactly the missing ones (the usual case),
      take every candidate in it or above without the threshold search.
    select_reads_scores: the select slices read their scores whole instead of the group maxima and then a gather of
      the groups reaching t0 (one dependent round trip less; no gain measured, so off).

    Raises:
        ValueError: an unknown select_search, or a switch that is not a bool.
    """

    score_configs: Mapping = dataclasses.field(default_factory=lambda: DEFAULT_SCORE_CONFIGS)
    fp8q_score_configs: Mapping = dataclasses.field(default_factory=lambda: DEFAULT_FP8Q_SCORE_CONFIGS)
    select_search: str = "fine"
    select_pdl: bool = True
    select_gather2d: bool = True
    select_fast_exact: bool = True
    select_reads_scores: bool = False

    def __post_init__(self):
        if self.select_search not in SELECT_SEARCHES:
            raise ValueError(f"indexer_config: select_search must be one of {SELECT_SEARCHES}, got "
                             f"{self.select_search!r}")
        for name in ("select_pdl", "select_gather2d", "select_fast_exact", "select_reads_scores"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"indexer_config: {name} must be a bool, got {getattr(self, name)!r}")
        # read-only views: a config is a value, so a caller's later edit of its dict cannot change it
        object.__setattr__(self, "score_configs", MappingProxyType(dict(self.score_configs)))
        object.__setattr__(self, "fp8q_score_configs", MappingProxyType(dict(self.fp8q_score_configs)))

    def score_config(self, sm90: bool, s_p2: int, q_fp8: bool) -> dict:
        """A copy of the score-kernel config for the arch, stacked query tokens and query dtype."""
        return dict((q_fp8 and self.fp8q_score_configs.get((sm90, s_p2))) or self.score_configs[(sm90, s_p2)])


DEFAULT_INDEXER_CONFIG = IndexerConfig()
