"""Tuning tables of the MXFP4 MoE kernels: ``MoETile`` (one GEMM kernel's tile) and ``MoEPlan`` (a launch plan,
checked in one place), the tile configs, the option choices a plan may take, and the default plans.

A plan also loads from its nested-dict form (``MoEPlan.from_dict``, what ``fused_moe_mxfp4(config=...)`` and the
benchmarks' JSON records take): {"path", "BM", ..., "gate_up": {"BN", "BK", ...}, "down": {...}}.
Measurements behind each choice: benchmarks/results/mxfp4_moe.md and benchmarks/results/mxfp4_moe_ab.md.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

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

_TILE_KEYS = ("BN", "BK", "num_warps", "num_stages")  # a tile's required keys; BK_DOT and maxnreg are optional


@dataclasses.dataclass(frozen=True)
class MoETile:
    """The tile of one GEMM kernel (gate/up or down) in a ``MoEPlan``.

    BN: output columns per program (16, 32, 64 or 128; it must divide I for gate/up, H for down).
    BK: K per pipeline stage (128, 256 or 512; halved at launch until it divides one program's K range, and 128 for
      sorted blocks of more than 16 rows).
    num_warps, num_stages: the Triton launch options (positive ints).
    BK_DOT: K per dequantize + dot step inside a stage (64, 128 or 256, dividing BK); None: BK.
    maxnreg: register cap per thread (the launch option, MAXNREG_MIN..255; more programs per SM, ptxas spills past
      it); None: no cap.

    A tile is checked by the ``MoEPlan`` that holds it, so its errors name the part (gate_up / down).
    """

    BN: int
    BK: int
    num_warps: int
    num_stages: int
    BK_DOT: int | None = None
    maxnreg: int | None = None

    @property
    def bk_dot(self) -> int:
        """K per dequantize + dot step (BK_DOT, or BK when it is None)."""
        return self.BK if self.BK_DOT is None else self.BK_DOT

    def as_dict(self) -> dict:
        """The tile as its dict form (the optional keys only when set)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def from_dict(cls, part: str, d: Any) -> MoETile:
        """The tile of ``part`` ("gate_up" / "down") from its dict form.

        Raises:
            ValueError: ``d`` is not a dict with the keys BN, BK, num_warps, num_stages (and optional BK_DOT,
                maxnreg), or gives an optional key as None.
        """
        if not isinstance(d, Mapping) or not set(_TILE_KEYS) <= set(d) or not set(d) <= set(_TILE_FIELDS):
            raise ValueError(f"config: {part} must be a dict with BN, BK, num_warps, num_stages (and optional BK_DOT, "
                             f"maxnreg), got {d!r}")
        for key in ("BK_DOT", "maxnreg"):  # None is the field's "unset", not a value a dict may give
            if key in d and d[key] is None:
                raise ValueError(f"config: {part} {key} must be an int, got None (leave the key out instead)")
        return cls(**d)

    def _check(self, part: str) -> None:
        """ValueError naming ``part`` and the field for a value outside its choices."""
        for name in ("num_warps", "num_stages"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"config: {part} {name} must be a positive int, got {v!r}")
        if self.maxnreg is not None and (isinstance(self.maxnreg, bool) or not isinstance(self.maxnreg, int)
                                         or not MAXNREG_MIN <= self.maxnreg <= 255):
            raise ValueError(f"config: {part} maxnreg must be an int in [{MAXNREG_MIN}, 255], got {self.maxnreg!r}")
        if self.BN not in (16, 32, 64, 128):
            raise ValueError(f"config: {part} BN must be 16/32/64/128, got {self.BN!r}")
        if self.BK not in (128, 256, 512):  # halved where it does not divide K / split (_fit_bk)
            raise ValueError(f"config: {part} BK must be 128, 256 or 512, got {self.BK!r}")
        if self.bk_dot not in (64, 128, 256) or self.BK % self.bk_dot:
            raise ValueError(f"config: {part} BK_DOT must be 64, 128 or 256 and divide BK, got {self.BK_DOT!r}")


_TILE_FIELDS = tuple(f.name for f in dataclasses.fields(MoETile))


@dataclasses.dataclass(frozen=True)
class MoEPlan:
    """A launch plan of ``fused_moe_mxfp4`` (``config=``; default ``default_config(T * k, weight_layout)``); every
    plan gives the same output up to fp32 summation order, they differ in speed only.

    path: "pair_token" (gate/up per pair; down per token, k-sum fused: 2 launches), "pair" (+ sum kernel) or
      "sorted" (+ align kernel: each routed expert read once per BM rows).
    gate_up, down: the two GEMM kernels' ``MoETile``.
    BM: rows per block (BM_CHOICES; the pair paths take <= 16: one pair per program).
    split_gate_up, split_down: K splits (SPLIT_CHOICES) for more programs at tiny T; gate/up partials are finished
      by _swiglu_kernel, down partials summed by _topk_sum_kernel. pair_token takes split_down 1.
    gate_up_halves: gate and up columns in separate programs.
    dequant: DEQUANT_CHOICES ("bits" needs max_scale_byte <= 128).
    fold (path "pair"): the SwiGLU and the sum over k done by the last program of each group (atomic tickets in the
      launch's workspace), so a call is 2 launches instead of 4.
    pdl (with fold; compute capability >= 9, else ignored): the down launch a programmatic dependent of gate/up.
    pdl_release (with pdl): PDL_RELEASE_CHOICES; None: "k_loop".
    prefetch_gate_up, prefetch_down: 0, 1 (each program first prefetches its weight rows into L2) or 2 (gate/up,
      pair paths: also a slice of its expert's down weights, evict_last; down: its own rows with evict_last).
    stage_loads: STAGE_LOADS_CHOICES (needs BM 1; 2 and 3 need BK <= 2 BK_DOT in both tiles).

    Raises:
        ValueError: ``config: <field> ...`` for a value outside its choices or a combination the kernels do not
            take; ``check_dims`` adds the checks against H and I.
    """

    path: str
    gate_up: MoETile
    down: MoETile
    BM: int = 16
    split_gate_up: int = 1
    split_down: int = 1
    gate_up_halves: bool = False
    dequant: str = "auto"
    fold: bool = False
    pdl: bool = False
    pdl_release: str | None = None
    prefetch_gate_up: int = 0
    prefetch_down: int = 0
    stage_loads: int = 0

    def __post_init__(self):
        if self.path not in PATHS:
            raise ValueError(f"config: path must be one of {PATHS}, got {self.path!r}")
        if self.BM not in BM_CHOICES:
            raise ValueError(f"config: BM must be one of {BM_CHOICES}, got {self.BM!r}")
        if self.path != "sorted" and self.BM > 16:
            raise ValueError("config: the pair paths take BM <= 16 (one pair per program)")
        for part in ("gate_up", "down"):
            tile = getattr(self, part)
            if not isinstance(tile, MoETile):
                raise ValueError(f"config: {part} must be a MoETile, got {type(tile).__name__}")
            tile._check(part)
            if getattr(self, f"split_{part}") not in SPLIT_CHOICES:
                raise ValueError(f"config: split_{part} must be one of {SPLIT_CHOICES}, got "
                                 f"{getattr(self, f'split_{part}')!r}")
        if self.dequant not in DEQUANT_CHOICES:
            raise ValueError(f"config: dequant must be one of {DEQUANT_CHOICES}, got {self.dequant!r}")
        for name in ("gate_up_halves", "fold", "pdl"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"config: {name} must be a bool, got {getattr(self, name)!r}")
        if self.path == "pair_token" and self.split_down != 1:
            raise ValueError("config: the pair_token path sums over k in the down kernel, so split_down must be 1")
        if self.fold and self.path != "pair":
            raise ValueError("config: fold (ticket-folded SwiGLU and k-sum) needs path 'pair'")
        if self.pdl and not self.fold:
            raise ValueError("config: pdl (the down launch as a programmatic dependent of gate/up) needs fold")
        for name in ("prefetch_gate_up", "prefetch_down"):
            if getattr(self, name) not in (0, 1, 2):
                raise ValueError(f"config: {name} must be 0, 1 or 2, got {getattr(self, name)!r}")
        if self.prefetch_gate_up == 2 and self.path == "sorted":
            raise ValueError("config: prefetch_gate_up=2 (down weights fetched by gate/up) needs a pair path")
        if self.pdl_release is not None:
            if self.pdl_release not in PDL_RELEASE_CHOICES:
                raise ValueError(f"config: pdl_release must be one of {PDL_RELEASE_CHOICES}, got "
                                 f"{self.pdl_release!r}")
            if not self.pdl:
                raise ValueError("config: pdl_release (where gate/up releases the down launch) needs pdl")
        xs = self.stage_loads
        if isinstance(xs, bool) or xs not in STAGE_LOADS_CHOICES:
            raise ValueError(f"config: stage_loads must be one of {STAGE_LOADS_CHOICES}, got {xs!r}")
        if xs and self.BM != 1:
            raise ValueError("config: stage_loads (one contiguous activation row per load) needs BM=1")
        if xs >= 2:
            for part in ("gate_up", "down"):
                tile = getattr(self, part)
                if tile.BK > 2 * tile.bk_dot:
                    raise ValueError(f"config: stage_loads={xs} needs {part} BK <= 2 * BK_DOT, got BK {tile.BK}, "
                                     f"BK_DOT {tile.BK_DOT}")

    def check_dims(self, h: int, inter: int) -> None:
        """ValueError unless each tile's BN divides its kernel's N (gate/up: I = ``inter``, down: H = ``h``)."""
        for part, n_dim in (("gate_up", inter), ("down", h)):
            bn = getattr(self, part).BN
            if n_dim % bn:
                raise ValueError(f"config: {part} BN must be 16/32/64/128 and divide {n_dim}, got {bn}")

    def as_dict(self) -> dict:
        """The plan as its nested-dict form (JSON-ready; ``from_dict`` reads it back); fields left None omitted."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is not None:
                out[f.name] = v.as_dict() if isinstance(v, MoETile) else v
        return out

    @classmethod
    def from_dict(cls, d: Any) -> MoEPlan:
        """A plan from its nested-dict form: {"path", "gate_up": {tile}, "down": {tile}, and any other field}.

        Raises:
            ValueError: not a dict, an unknown key (named), a missing path or tile, or any ``MoEPlan`` check.
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"config must be a MoEPlan or a dict of its fields, got {type(d).__name__}")
        unknown = sorted(set(d) - set(_PLAN_FIELDS), key=str)
        if unknown:
            raise ValueError(f"config: unknown key(s) {unknown}; a plan takes {list(_PLAN_FIELDS)}")
        if d.get("path") not in PATHS:
            raise ValueError(f"config: path must be one of {PATHS}, got {d.get('path')!r}")
        tiles = {part: MoETile.from_dict(part, d.get(part)) for part in ("gate_up", "down")}
        return cls(**{**d, **tiles})


_PLAN_FIELDS = tuple(f.name for f in dataclasses.fields(MoEPlan))


def as_plan(config: MoEPlan | Mapping) -> MoEPlan:
    """``config`` as a ``MoEPlan``: a plan as is, a dict through ``MoEPlan.from_dict``.

    Raises:
        ValueError: see ``MoEPlan.from_dict``.
    """
    return config if isinstance(config, MoEPlan) else MoEPlan.from_dict(config)


# Tile configs (BN: output columns per program, BK: K per pipeline stage, BK_DOT: K per dequantize + dot step,
# default BK; with BM > 16 rows BK becomes 128). BN >= 16 *
# num_warps: with 16-row tiles the warps split N, and fewer columns per warp made Triton convert the same
# weights in several warps. Every entry fits sm_120's 99 KiB of shared memory with 16- and 64-row blocks and
# compiles to mma.sync there (tests/test_mxfp4_moe.py checks all of them, and sm_90a).
TILE_CONFIGS = [
    MoETile(BN=BN, BK=BK, num_warps=w, num_stages=st)
    for BN, BK, w, st in [(16, 256, 1, 4), (32, 256, 2, 3), (32, 128, 2, 4), (64, 256, 2, 3), (64, 128, 4, 3),
                          (128, 128, 4, 3), (64, 128, 2, 3), (64, 128, 2, 4), (128, 128, 2, 3)]
] + [MoETile(BN=64, BK=256, BK_DOT=128, num_warps=2, num_stages=3),
     MoETile(BN=32, BK=256, BK_DOT=128, num_warps=2, num_stages=3),  # 16 weight rows per warp (prepared T <= 8)
     MoETile(BN=64, BK=256, BK_DOT=128, num_warps=4, num_stages=3)]


# Default plan per number of (token, slot) pairs P = T * k: the first entry with P <= bound (the paths and splits:
# see MoEPlan). From the H200 sweeps (benchmarks/results/mxfp4_moe.md): T = 1 pair with 4 x 2 K splits and gate/up
# in separate 64-column programs; T = 16..128 sorted, gate/up in separate 64-column programs and 64-column down
# programs, both BK 256 per stage in two BK_DOT 128 steps (142 / 168 registers: 6 blocks per SM). From T = 16 up
# experts are shared, so reading each routed expert once per block beats the pair paths (their timings: the same
# results file). The switch at P = 48 (T = 8 for top-6) is not measured.
DEFAULT_CONFIGS = [
    (48, MoEPlan(path="pair", BM=16, split_gate_up=4, split_down=2, gate_up_halves=True,
                 gate_up=MoETile(BN=64, BK=128, num_warps=2, num_stages=3),
                 down=MoETile(BN=64, BK=128, num_warps=2, num_stages=3))),
    (1024, MoEPlan(path="sorted", BM=16, split_gate_up=1, split_down=1, gate_up_halves=True,
                   gate_up=MoETile(BN=64, BK=256, BK_DOT=128, num_warps=2, num_stages=3),
                   down=MoETile(BN=64, BK=256, BK_DOT=128, num_warps=2, num_stages=3))),
    (math.inf, MoEPlan(path="sorted", BM=64, split_gate_up=1, split_down=1,
                       gate_up=MoETile(BN=64, BK=128, num_warps=4, num_stages=3),
                       down=MoETile(BN=64, BK=128, num_warps=4, num_stages=3))),
]


# Default plan for weights in the prepared layout (weight_layout="sm90_bits"; H200, benchmarks/results/mxfp4_moe.md).
# T <= 8: one-row blocks (BM 1: the activation tile and the epilogue shrink to the pair's row; BM 16 kept 16 KiB of
# shared memory for 15 masked rows, which limited gate/up to 6 blocks per SM, latency bound), the SwiGLU and the k-sum
# folded into the last program of each group (2 launches instead of 4), gate/up split 2 along K, 16 weight rows per
# warp, the down launch a programmatic dependent of gate/up, ``stage_loads=3`` (the activation row and the scales go
# through the cp.async pipeline with the weights), and down over the whole K = I per program. T = 16..170: sorted
# blocks of 8 rows (1.2-3.1 rows per routed expert) with gate/up BK 256 in one step.
DEFAULT_CONFIGS_SM90_BITS = [
    (48, dataclasses.replace(DEFAULT_CONFIGS[0][1], BM=1, fold=True, pdl=True, split_gate_up=2, split_down=1,
                             stage_loads=3, gate_up=MoETile(BN=32, BK=256, BK_DOT=128, num_warps=2, num_stages=3),
                             down=MoETile(BN=32, BK=256, BK_DOT=128, num_warps=2, num_stages=3))),
    (1024, dataclasses.replace(DEFAULT_CONFIGS[1][1], BM=8,
                               gate_up=MoETile(BN=64, BK=256, num_warps=2, num_stages=3))),
    DEFAULT_CONFIGS[2],
]


# Default plan for weight_layout="sm90_tiled": the sm90_bits plans, with gate/up at T <= 8 not split along K (768
# programs, each reading one contiguous 64 KiB run per 32 rows instead of two of 32 KiB): faster at T = 1 / 4 / 8
# than the split of 2 (benchmarks/results/mxfp4_moe_ab.md).
DEFAULT_CONFIGS_SM90_TILED = [
    (48, dataclasses.replace(DEFAULT_CONFIGS_SM90_BITS[0][1], split_gate_up=1)),
    *DEFAULT_CONFIGS_SM90_BITS[1:],
]


def default_config(num_pairs: int, weight_layout: str = "sglang") -> MoEPlan:
    """The launch plan ``fused_moe_mxfp4`` uses for ``num_pairs`` = T * k (see DEFAULT_CONFIGS, and
    DEFAULT_CONFIGS_SM90_BITS / DEFAULT_CONFIGS_SM90_TILED for the prepared layouts ``PREPARED_LAYOUTS``)."""
    table = {"sm90_bits": DEFAULT_CONFIGS_SM90_BITS, "sm90_tiled": DEFAULT_CONFIGS_SM90_TILED}.get(weight_layout,
                                                                                                  DEFAULT_CONFIGS)
    for bound, cfg in table:
        if num_pairs <= bound:
            return cfg
    raise AssertionError("unreachable")
