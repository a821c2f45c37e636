"""Tuning tables of the MXFP4 MoE kernels: tile configs, the option choices a plan may take, the default plans."""

from __future__ import annotations

import math

# Tile configs (BN: output columns per program, BK: K per pipeline stage, BK_DOT: K per dequantize + dot step,
# default BK; with BM > 16 rows BK becomes 128). BN >= 16 *
# num_warps: with 16-row tiles the warps split N, and fewer columns per warp made Triton convert the same
# weights in several warps. Every entry fits sm_120's 99 KiB of shared memory with 16- and 64-row blocks and
# compiles to mma.sync there (tests/test_mxfp4_moe.py checks all of them, and sm_90a).
TILE_CONFIGS = [
    dict(BN=BN, BK=BK, num_warps=w, num_stages=st)
    for BN, BK, w, st in [(16, 256, 1, 4), (32, 256, 2, 3), (32, 128, 2, 4), (64, 256, 2, 3), (64, 128, 4, 3),
                          (128, 128, 4, 3), (64, 128, 2, 3), (64, 128, 2, 4), (128, 128, 2, 3)]
] + [dict(BN=64, BK=256, BK_DOT=128, num_warps=2, num_stages=3),
       dict(BN=32, BK=256, BK_DOT=128, num_warps=2, num_stages=3),  # 16 weight rows per warp (prepared T <= 8)
       dict(BN=64, BK=256, BK_DOT=128, num_warps=4, num_stages=3)]
# rows per block: the pair paths hold one pair per program (row 0; BM 1 keeps the activation tile and the epilogue
# to that row, tl.dot pads it to the mma shape), the sorted path up to BM pairs of one expert
BM_CHOICES = (1, 2, 4, 8, 16, 32, 64)
SPLIT_CHOICES = (1, 2, 4, 8)
PATHS = ("pair_token", "pair", "sorted")
# "bits": the bit-arithmetic dequantization (needs max_scale_byte <= 128); "dot_scaled": tl.dot_scaled; "auto": bits
# on sm_90 when max_scale_byte allows it, else dot_scaled (sm_120 converts e2m1 with an instruction).
DEQUANT_CHOICES = ("auto", "bits", "dot_scaled")
BITS_MAX_SCALE_BYTE = 128  # 2 ** (s - 1) must be a normal bf16
MAXNREG_MIN = 32  # a tile's optional register cap per thread (the launch option ``maxnreg``; ptxas spills past it)
# ``stage_loads`` (prepared layout, BM 1): how the K loop reads the activation row (x in gate/up, h in down) and the
# scales. 0: four [1, BK_DOT / 4] value-column loads per dequantize + dot step, which Triton issues as plain loads in
# the dot layout in the step that uses them (not staged by its cp.async pipeliner); 1: one contiguous [1, BK_DOT] row
# per step, split into the value columns in registers (staged when it is >= 4 bytes per thread: BK_DOT >= 2 x
# threads); 2: one [1, BK] row per pipeline stage (BK <= 2 BK_DOT); 3: as 2, and the stage's scales [BN, BK / 32] in
# one load too (staged like the weights instead of 2-byte loads per step). The K loop's math is the same. The
# pair_token path's down kernel (one token per program, k experts) keeps 0.
STAGE_LOADS_CHOICES = (0, 1, 2, 3)
# ``pdl_release`` (with ``pdl``): where the gate/up programs release the dependent down launch. "k_loop" (default):
# after their K loop; "start": at their start (when the gate/up grid fits one wave, the down programs then take the
# SM slots it leaves free from the beginning, and with ``prefetch_down`` fetch their weights into L2 before they wait).
PDL_RELEASE_CHOICES = ("k_loop", "start")

# Default plan per number of (token, slot) pairs P = T * k: the first entry with P <= bound.
#   path: pair_token (gate/up per pair; down per token, k-sum fused: 2 launches), pair (+ sum kernel), sorted
#   (+ align kernel: each routed expert read once per BM rows); split_*: K splits for more programs at tiny T
#   (gate/up partials finished by _swiglu_kernel, down partials summed by _topk_sum_kernel).
# From the H200 sweeps (benchmarks/results/mxfp4_moe.md): T = 1 pair with 4 x 2 K splits and gate/up in separate
# 64-column programs; T = 16..128 sorted, gate/up in separate 64-column programs and 64-column down programs, both BK
# 256 per stage in two BK_DOT 128 steps (142 / 168 registers: 6 blocks per SM). The pair paths are 1.1x slower at
# T = 16, 1.7-2.7x at 64-128, where experts are shared. The switch at P = 48 (T = 8 for top-6) is not measured.
DEFAULT_CONFIGS = [
    (48, dict(path="pair", BM=16, split_gate_up=4, split_down=2, gate_up_halves=True,
              gate_up=dict(BN=64, BK=128, num_warps=2, num_stages=3),
              down=dict(BN=64, BK=128, num_warps=2, num_stages=3))),
    (1024, dict(path="sorted", BM=16, split_gate_up=1, split_down=1, gate_up_halves=True,
                gate_up=dict(BN=64, BK=256, BK_DOT=128, num_warps=2, num_stages=3),
                down=dict(BN=64, BK=256, BK_DOT=128, num_warps=2, num_stages=3))),
    (math.inf, dict(path="sorted", BM=64, split_gate_up=1, split_down=1,
                    gate_up=dict(BN=64, BK=128, num_warps=4, num_stages=3),
                    down=dict(BN=64, BK=128, num_warps=4, num_stages=3))),
]


# Default plan for weights in the prepared layout (weight_layout="sm90_bits"; H200, benchmarks/results/mxfp4_moe.md).
# T <= 8: one-row blocks (BM 1: the activation tile and the epilogue shrink to the pair's row; BM 16 kept 16 KiB of
# shared memory for 15 masked rows, which limited gate/up to 6 blocks per SM, latency bound), the SwiGLU and the k-sum
# folded into the last program of each group (2 launches instead of 4), gate/up split 2 along K, 16 weight rows per
# warp, the down launch a programmatic dependent of gate/up, ``stage_loads=3`` (the activation row and the scales go
# through the cp.async pipeline with the weights), and down over the whole K = I per program. T = 16..170: sorted
# blocks of 8 rows (1.2-3.1 rows per routed expert) with gate/up BK 256 in one step.
DEFAULT_CONFIGS_SM90_BITS = [
    (48, dict(DEFAULT_CONFIGS[0][1], BM=1, fold=True, pdl=True, split_gate_up=2, split_down=1, stage_loads=3,
              gate_up=dict(BN=32, BK=256, BK_DOT=128, num_warps=2, num_stages=3),
              down=dict(BN=32, BK=256, BK_DOT=128, num_warps=2, num_stages=3))),
    (1024, dict(DEFAULT_CONFIGS[1][1], BM=8, gate_up=dict(BN=64, BK=256, num_warps=2, num_stages=3))),
    DEFAULT_CONFIGS[2],
]


# Default plan for weight_layout="sm90_tiled": the sm90_bits plans, with gate/up at T <= 8 not split along K (768
# programs, each reading one contiguous 64 KiB run per 32 rows instead of two of 32 KiB): faster at T = 1 / 4 / 8
# than the split of 2 (benchmarks/results/mxfp4_moe_ab.md).
DEFAULT_CONFIGS_SM90_TILED = [
    (48, dict(DEFAULT_CONFIGS_SM90_BITS[0][1], split_gate_up=1)),
    *DEFAULT_CONFIGS_SM90_BITS[1:],
]


def default_config(num_pairs: int, weight_layout: str = "sglang") -> dict:
    """The launch plan ``fused_moe_mxfp4`` uses for ``num_pairs`` = T * k (see DEFAULT_CONFIGS, and
    DEFAULT_CONFIGS_SM90_BITS / DEFAULT_CONFIGS_SM90_TILED for the prepared layouts ``PREPARED_LAYOUTS``)."""
    table = {"sm90_bits": DEFAULT_CONFIGS_SM90_BITS, "sm90_tiled": DEFAULT_CONFIGS_SM90_TILED}.get(weight_layout,
                                                                                                  DEFAULT_CONFIGS)
    for bound, cfg in table:
        if num_pairs <= bound:
            return cfg
    raise AssertionError("unreachable")
