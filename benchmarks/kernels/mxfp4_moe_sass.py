"""SASS instructions per weight in the K loop of pd.kernels.mxfp4_moe's GEMM kernels, tl.dot_scaled vs the bits
dequantization, from an sm_90a ahead-of-time build with whatever Triton is installed (no GPU needed).

  python benchmarks/kernels/mxfp4_moe_sass.py [--json FILE]

For each default tile config (DeepSeek-V4 shapes: H = 4096, I = 2048, top-6; the plan's rows per block, <= 16):
compiles ``_gate_up_kernel`` and ``_down_kernel`` with DEQ = 0 (dot_scaled), 1 (bits) and 1 on the prepared layout
(WL = 1, "bits_prepared"; also for the tiles of DEFAULT_CONFIGS_SM90_BITS), disassembles the cubin with the
cuobjdump that ships with Triton, takes the longest loop (the K loop, tests/sass_stats.py) and divides its
instruction count by the weights one thread handles per iteration (BN x BK x (2 for fused gate/up) / (32 x
num_warps)). Also prints the registers per thread (cuobjdump -res-usage), which set the blocks per SM.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
sys.path.append(os.path.join(_HERE, "..", "..", "tests"))  # after the rest: tests/ only for sass_stats
from kernel_modules import kernel_module  # noqa: E402  (pd.kernels installed or not)

import sass_stats as sass  # noqa: E402  (the loop counter tests/test_mxfp4_moe.py uses too)

mx = kernel_module("mxfp4_moe")

DIMS = dict(H=4096, I=2048, TOPK=6, ROUND=False)


def compile_sm90a(fn, sig, const, tile, stride_arg):
    # constexprs left out take their defaults, as at a launch (an AOT build needs every one named)
    const = dict({p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **const)
    aligned = [n for n, ty in sig.items() if ty.startswith("*")] + [stride_arg]
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = ASTSource(fn=fn, signature=dict(sig, **{k: "constexpr" for k in const}), constexprs=const, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=tile.num_warps, num_stages=tile.num_stages))


def measure():
    rows = []
    seen = set()
    kinds = ((0, 0, "dot_scaled"), (1, 0, "bits"), (1, 1, "bits_prepared"))
    plans = [(cfg, kinds) for _, cfg in mx.DEFAULT_CONFIGS] + [(cfg, kinds[2:]) for _, cfg in
                                                               mx.DEFAULT_CONFIGS_SM90_BITS]
    for cfg, deqs in plans:
        bm = cfg.BM
        if bm > 16:
            continue
        halves = cfg.gate_up_halves
        for kind, tile in (("gate_up", cfg.gate_up), ("down", cfg.down)):
            for deq, wl, name in deqs:
                key = (kind, halves if kind == "gate_up" else None, tile, name, bm)
                if key in seen:
                    continue
                seen.add(key)
                if kind == "gate_up":
                    const = dict(DIMS, SORTED=True, HAS_LIMIT=True, UP_FIRST=False, SPLIT=1, HALVES=halves, BM=bm,
                                 BN=tile.BN, BK=tile.BK, BKD=tile.bk_dot, DEQ=deq, WL=wl, PF=0, FOLD=False, PDL=False)
                    k = compile_sm90a(mx._gate_up_kernel, mx.GATE_UP_SIGNATURE, const, tile, "stride_xt")
                    weights = (1 if halves else 2) * tile.BN * tile.BK
                else:
                    const = dict(DIMS, MODE=0, SPLIT=1, BM=bm, BN=tile.BN, BK=tile.BK, BKD=tile.bk_dot, DEQ=deq, WL=wl,
                                 PF=0, FOLD=False, PDL=False)
                    k = compile_sm90a(mx._down_kernel, mx.DOWN_SIGNATURE, const, tile, "stride_ot")
                    weights = tile.BN * tile.BK
                n, ops = sass.longest_loop(k.asm["cubin"])
                regs = sass.registers(k.asm["cubin"])
                per_thread = weights / (32 * tile.num_warps)
                rows.append(dict(kernel=kind, halves=halves if kind == "gate_up" else None, tile=tile.as_dict(),
                                 BM=bm, dequant=name,
                                 loop_sass=n, weights_per_thread=per_thread, sass_per_weight=n / per_thread,
                                 regs=regs, ptx_mul_bf16x2=k.asm["ptx"].count("mul.rn.bf16x2"),
                                 loop_ops=dict(ops.most_common(12))))
                print(json.dumps(rows[-1]), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = measure()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(triton=triton.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
