"""Tuning tables and settings of sparse-MLA decode: the tile config per heads-per-program on each architecture, the
autotune search space, the heads-per-program pick, and ``SparseMLAConfig``, the switches a launch reads
(``DEFAULT_SPARSE_MLA_CONFIG`` ships).

A tile config is a dict {"BLOCK_N", "num_warps", "num_stages"} plus optional "CHUNKED": True
(_sparse_mla_fwd_chunked_kernel), "PIPELINE": n (_sparse_mla_fwd_pipelined_kernel with n loop stages) and
"PROGRAMS_PER_SM" (for the default split count). Measurements behind each choice: benchmarks/results/
sparse_mla_decode.md (the H200 sweeps and the shipped defaults) and benchmarks/results/sparse_mla_ab.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import triton

# Tokens per page of the caches the kernels read. 64 and 256: SGLang's SWA (main) pool and the c4 layers' compressed
# cache; 2: the c128 layers' compressed cache (SGLang's 256-token page / 128). The address math is generic in the
# constexpr PAGE_SIZE (token t: page t // P, record at page * page_stride + (t % P) * 576, scales at
# page * page_stride + P * 576 + (t % P) * 8); page_stride_bytes(2) = 1728 keeps every record 16-byte and every
# scale word 8-byte aligned, and the three page strides (1728, 37440, 149760) tell a 2-D buffer's page size apart.
# No tile assumes a page holds BLOCK_N tokens: each token of a tile is addressed on its own.
SUPPORTED_PAGE_SIZES = (2, 64, 256)

# Autotune configs per heads-per-program. Each fits sm_120's 99 KiB of shared memory (tests check it): the
# q tile (BLOCK_H x 576 bf16) plus operand copies of the dequantized KV tile (BLOCK_N x 576 bf16).
CONFIGS = {
    16: [triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=1) for bn in (16, 32) for w in (4, 8)],
    32: [triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=1) for bn in (16, 32) for w in (4, 8)],
    64: [triton.Config({"BLOCK_N": 16}, num_warps=4, num_stages=1)],  # 8 warps: 128 KiB on sm_120
}

# Default tile config per heads-per-program (the H200 sweeps' best; ``autotune=True`` searches CONFIGS with the
# original kernel). ``PIPELINE: n`` with n >= 5 fetches the gathered records two tiles ahead in two shared-memory
# buffers, 3 one tile ahead in one buffer (the index list one stage before its records). The pipelined kernel keeps
# a tile's raw records and its dequantized chunks in shared memory: 63.5 KiB for 32-token 3-stage programs, 82 KiB
# for 5 stages, 111 KiB for 64-token tiles (sm_90 only). sm_120's 16-head config is unmeasured on sm_120 itself; it is
# the 32-token tile that fits its 99 KiB.
DEFAULT_CONFIG = {
    16: {"BLOCK_N": 32, "num_warps": 4, "num_stages": 1, "PIPELINE": 3},
    32: {"BLOCK_N": 32, "num_warps": 8, "num_stages": 1},
    64: {"BLOCK_N": 16, "num_warps": 4, "num_stages": 1},
}
# 16-head programs once a grid has more than 32 (batch * query token * head block) rows: 4-warp programs (~186
# registers, 82 KiB), two per SM on sm_90, so the default split count doubles; faster on the H200 than 3 stages or
# three per SM at B >= 64 (benchmarks/results/sparse_mla_decode.md).
TWO_PER_SM_CONFIG_16 = {"BLOCK_N": 32, "num_warps": 4, "num_stages": 1, "PIPELINE": 5, "PROGRAMS_PER_SM": 2}
# sm_90 (Hopper) only: configs needing more than sm_120's 99 KiB of shared memory. 64-head programs lower to wgmma
# there (165 KiB); 16-head programs with 64-token tiles (111 KiB) are sm_90's default up to 32 rows.
DEFAULT_CONFIG_SM90 = {**DEFAULT_CONFIG, 16: {"BLOCK_N": 64, "num_warps": 8, "num_stages": 1, "PIPELINE": 3},
                       64: {"BLOCK_N": 64, "num_warps": 8, "num_stages": 1, "PIPELINE": 3}}
CONFIGS_SM90 = {16: [DEFAULT_CONFIG_SM90[16]],
                64: [{"BLOCK_N": 64, "num_warps": 8, "num_stages": 1, "PIPELINE": 3},
                     {"BLOCK_N": 64, "num_warps": 8, "num_stages": 1, "PIPELINE": 5},
                     {"BLOCK_N": 64, "num_warps": 8, "num_stages": 1, "CHUNKED": True},
                     {"BLOCK_N": 32, "num_warps": 8, "num_stages": 1, "CHUNKED": True}]}
# Pipelined configs that sm_120 may run (each fits its 99 KiB of shared memory; tests compile them all).
CONFIGS_PIPELINED = {16: [DEFAULT_CONFIG[16], TWO_PER_SM_CONFIG_16]}


def _pick_block_h(b: int, s: int, h: int, sm90: bool = False) -> int:
    """Heads per program, as measured on an H200 (benchmarks/results/sparse_mla_decode.md): 32 heads per program
    once the grid has >= 16 (batch * query token * head block) programs, 16 below that and for H = 16; on sm_90
    only, 64 heads (DEFAULT_CONFIG_SM90: 64-row dots, so Triton emits wgmma) from 16 such 64-head programs up. On
    sm_120 a 64-head program (one 4-warp config fits its shared memory) was never the fastest."""
    if sm90 and h % 64 == 0 and b * s * (h // 64) >= 16:
        return 64
    if h % 32 == 0 and b * s * (h // 32) >= 16:
        return 32
    return 16


def _default_config(block_h: int, rows: int, sm90: bool) -> dict:
    """The launch config of the default path for ``rows`` = batch * query tokens * head blocks programs."""
    if block_h == 16 and rows > 32:
        return TWO_PER_SM_CONFIG_16
    return (DEFAULT_CONFIG_SM90 if sm90 else DEFAULT_CONFIG)[block_h]


@dataclasses.dataclass(frozen=True)
class SparseMLAConfig:
    """The switches of one sparse-MLA decode launch (``sparse_mla_decode(..., mla_config=...)``); every choice gives
    the same output, they differ in speed only.

    combine_pdl: launch _combine_kernel as a programmatic dependent of the split kernel (compute capability >= 9;
      ignored below, in the interpreter and with ``autotune``): its programs are placed on the SMs while the split
      programs run and wait there (griddepcontrol.wait), so the second launch's start-up overlaps the first's tail.
      Faster on the H200 at every measured batch (benchmarks/results/sparse_mla_decode.md). Merging inside the split
      kernel instead (the row's last split program, elected by an atomic ticket) was slower: the unrolled merge
      spilled, and one program per row merged serially after the others finished.
    pipelined_kernel: a @triton.jit kernel with _sparse_mla_fwd_pipelined_kernel's signature, launched in its place
      (same-run A/B of a rewritten kernel, benchmarks/kernels/sparse_mla_ab.py); None: the shipped one.

    Raises:
        ValueError: combine_pdl is not a bool.
    """

    combine_pdl: bool = True
    pipelined_kernel: Any = None

    def __post_init__(self):
        if not isinstance(self.combine_pdl, bool):
            raise ValueError(f"mla_config: combine_pdl must be a bool, got {self.combine_pdl!r}")


DEFAULT_SPARSE_MLA_CONFIG = SparseMLAConfig()
