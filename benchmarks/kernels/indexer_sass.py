"""SASS of the DSA indexer's score-kernel tile loop for the sm_90 fp8-query decode configs, from an sm_90a
ahead-of-time build with whatever Triton is installed (no GPU needed).

  python benchmarks/kernels/indexer_sass.py [--json FILE]

For the committed sm_90 fp8-query default and every other "fp8pv" config of ``SCORE_CONFIGS`` (the candidates a
device run picks among), compiles ``_index_scores_kernel`` as the launcher does for the decode step (fp8 query with
the scale in the weights, S = 1, H = 64, page 64, programmatic dependent launch of the select) and reports the
innermost loop holding the wgmma (one key tile): instructions, barriers (BAR.SYNC), shuffles, shared-memory stores
and loads, asynchronous copies, instructions per key, registers per thread and shared memory per program (which set
the programs per SM). -s5 found the kernel bound by this per-tile path (benchmarks/results/indexer_2026-11-30-s5.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_modules import kernel_module  # noqa: E402  (pd.kernels installed or not)

K = kernel_module("indexer")
sass = kernel_module("sass_stats")

SIG = {"q_ptr": "*fp8e4nv", "w_ptr": "*fp32", "qs_ptr": "*fp32", "kc32_ptr": "*i32", "k8_ptr": "*fp8e4nv",
       "ks_ptr": "*fp32", "bt_ptr": "*i32", "len_ptr": "*i32", "score_ptr": "*fp32", "gmax_ptr": "*fp32",
       "hist_ptr": "*i32", "stride_qb": "i32", "stride_qs": "i32", "stride_qh": "i32", "stride_wb": "i32",
       "stride_ws": "i32", "stride_bt": "i32", "max_len": "i32", "ng_buf": "i32", "n_split": "i32", "topk": "i32",
       "S_ALL": "i32", "s0": "i32"}
# what the launcher's specialization sees as 16-divisible at run time (aligned pointers, strides, max_len)
ALIGNED = ("q_ptr", "w_ptr", "qs_ptr", "kc32_ptr", "k8_ptr", "ks_ptr", "bt_ptr", "len_ptr", "score_ptr", "gmax_ptr",
           "hist_ptr", "stride_qb", "stride_qs", "stride_qh", "stride_wb", "stride_bt", "max_len")


def cfg_name(c: dict) -> str:
    """The config's name as benchmarks/kernels/indexer.py prints it."""
    import indexer as BI  # noqa: PLC0415  (needs torch; only for the name)

    return BI.cfg_name(c)


def build(cfg: dict):
    """The decode score kernel of ``cfg`` for sm_90a (the constants dsa_indexer_topk passes for S = 1, H = 64,
    page 64, an fp8 query)."""
    ch, npv, pair = K.page_vector_consts(cfg["BLOCK_N"], 64, cfg.get("PV", 0))
    const = dict(S=1, S_P2=1, H=64, PAGE=64, BLOCK_N=cfg["BLOCK_N"], G=K.GROUP, LEN_2D=False, HAS_QS=False,
                 Q_FP8=True, MIN_TILES=K.MIN_TILES, DOT_F32=False, TOKENS_M=cfg["TOKENS_M"], PREFETCH=cfg["PREFETCH"],
                 DOT_PREC="tf32", KEYS=cfg["KEYS"], NB=K.HIST_BINS, SHIFT=K.HIST_SHIFT,
                 PDL=K.DEFAULT_INDEXER_CONFIG.select_pdl,
                 CH=ch, NPV=max(npv, 2), PAIR=pair, EPI=cfg.get("EPI", 0))
    fn = K._index_scores_kernel
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in ALIGNED}
    src = ASTSource(fn=fn, signature=dict(SIG, **{k: "constexpr" for k in const}), constexprs=const, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                                       **({"maxnreg": cfg["MAXNREG"]} if cfg.get("MAXNREG") else {})))


def measure() -> list[dict]:
    default = K.DEFAULT_INDEXER_CONFIG.fp8q_score_configs[(True, 1)]
    cfgs = [default] + [c for c in K.SCORE_CONFIGS if c["KEYS"] == "fp8pv" and c != default]
    rows = []
    for c in cfgs:
        k = build(c)
        n, ops = sass.innermost_loop_with(k.asm["cubin"], "QGMMA")
        count = lambda prefix: sum(v for o, v in ops.items() if o.startswith(prefix))  # noqa: E731
        rows.append(dict(config=cfg_name(c), default=c == default, loop_instructions=n,
                         per_key=n / c["BLOCK_N"], bar_sync=count("BAR.SYNC"), shfl=count("SHFL"),
                         sts=count("STS"), lds=count("LDS"), ldgsts=count("LDGSTS"), stg=count("STG"),
                         registers=sass.registers(k.asm["cubin"]), shared_bytes=k.metadata.shared,
                         triton=triton.__version__))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="write the rows to this file")
    args = ap.parse_args()
    rows = measure()
    print("\n| config | tile loop instructions | per key | BAR.SYNC | SHFL | STS | LDS | cp.async | registers | "
          "shared bytes |\n|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        name = r["config"] + (" (default)" if r["default"] else "")
        print(f"| {name} | {r['loop_instructions']} | {r['per_key']:.2f} | {r['bar_sync']} | {r['shfl']} | "
              f"{r['sts']} | {r['lds']} | {r['ldgsts']} | {r['registers']} | {r['shared_bytes']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(command="python benchmarks/kernels/indexer_sass.py " + " ".join(sys.argv[1:]),
                           rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
