"""sha256 of the PTX of every shipped default kernel config, for sm_90a and sm_120a (no GPU needed).

  python benchmarks/kernels/ptx_fingerprint.py [--kernels DIR] [--out FILE.json] [--only mxfp4_moe,indexer,sparse_mla]
  python benchmarks/kernels/ptx_fingerprint.py --compare A.json B.json

Why: a refactor of kernels/ (moving @triton.jit helpers between files, turning module switches into config objects)
must not change the code the GPU runs. This script compiles, with Triton's AOT path (``triton.compile(ASTSource)``
for ``GPUTarget("cuda", cc, 32)``, as tests/triton_aot.py does), each kernel with the constexprs and launch options
its launcher passes on the default path, and writes one record per build keyed ``family/kernel/config@arch``:

* ``ptx``: sha256 of the PTX with the debug lines dropped (``.file``, ``.loc`` and the ``.section .debug_*`` blocks,
  which name the source file and line of every op, so moving a function to another file changes them);
* ``ptx_raw``: sha256 of the PTX as emitted (differs between two checkouts in different folders);
* ``entry``: the ``.entry`` name (the kernel's function name).

``--kernels DIR`` loads DIR (a kernels/ folder, e.g. of ``git worktree add /tmp/kbase HEAD``) as the package
``pd_kernels``, so two trees can be fingerprinted and compared with ``--compare``, which exits 1 on any difference.
Each run uses a fresh Triton cache (a cache hit would return the PTX of the other tree's build).
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.util
import json
import os
import re
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
ARCHS = (90, 120)
DIMS = dict(H=4096, I=2048, TOPK=6)  # DeepSeek-V4-Flash's MTP MoE: hidden, intermediate, experts per token
INDEX_HEADS = 64  # DeepSeek-V4-Flash's indexer heads
PAGE = 64  # SGLang's page size for both caches


def load_kernels(path: str):
    """The kernels/ folder at ``path`` as the package ``pd_kernels`` (its relative imports resolve inside it)."""
    spec = importlib.util.spec_from_file_location("pd_kernels", os.path.join(path, "__init__.py"),
                                                  submodule_search_locations=[path])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules["pd_kernels"] = pkg
    spec.loader.exec_module(pkg)
    return lambda name: importlib.import_module(f"pd_kernels.{name}")


def strip_debug(ptx: str) -> str:
    """The PTX without its debug info: ``.file`` / ``.loc`` lines and the ``.section .debug_*`` blocks."""
    out, skipping, depth = [], False, 0
    for line in ptx.splitlines():
        s = line.strip()
        if skipping:
            depth += s.count("{") - s.count("}")
            skipping = depth > 0 or "{" not in s and depth == 0 and not s.startswith("}")
            continue
        if s.startswith(".section") and ".debug" in s:
            skipping, depth = True, s.count("{") - s.count("}")
            continue
        if s.startswith((".file", ".loc")):
            continue
        out.append(line)
    return "\n".join(out) + "\n"


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class Builds:
    """Collects (key -> compile thunk) and runs them."""

    def __init__(self):
        self.jobs = []

    def add(self, key, fn, signature, constexprs, cc, num_warps=4, num_stages=2, aligned=(), maxnreg=None):
        self.jobs.append((f"{key}@sm_{cc}a", (fn, signature, constexprs, cc, num_warps, num_stages, aligned,
                                              maxnreg)))

    def run(self):
        sys.path.insert(0, os.path.join(_HERE, "..", "..", "tests"))
        from triton_aot import compile_for

        res = {}
        for key, (fn, sig, const, cc, nw, ns, aligned, maxnreg) in self.jobs:
            t0 = time.time()
            # constexprs left out take their defaults, as at a launch (an AOT build needs every one named)
            const = dict({p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **const)
            k = compile_for(fn, sig, const, cc, num_warps=nw, num_stages=ns, aligned=aligned, maxnreg=maxnreg)
            ptx = k.asm["ptx"]
            entry = re.search(r"\.entry\s+(\w+)", ptx)
            res[key] = dict(ptx=_sha(strip_debug(ptx)), ptx_raw=_sha(ptx), entry=entry.group(1) if entry else None)
            print(f"{res[key]['ptx'][:16]} {time.time() - t0:5.1f}s {key}", flush=True)
        return res


def _aligned(sig, *extra):
    return tuple(n for n, ty in sig.items() if ty.startswith("*")) + extra


# ------------------------------------------------------------------------------------------------------ mxfp4 MoE

def _as_dict(c):
    """A plan or tile in its nested-dict form: kernels trees with ``MoEPlan`` / ``MoETile`` give ``as_dict()``,
    older trees keep the tables as dicts."""
    return c.as_dict() if hasattr(c, "as_dict") else dict(c)


def _part(plan, part):
    """The plan's gate_up / down tile, as the tree's own ``_fit_bk`` takes it (a ``MoETile`` or a dict)."""
    return getattr(plan, part) if hasattr(plan, "as_dict") else plan[part]


def mxfp4_moe(mod, b: Builds):
    """Both GEMM kernels of every default plan (SGLang layout: tl.dot_scaled and the bits dequantization; the
    prepared layouts: bits), with the constexprs ``fused_moe_mxfp4`` derives on a GPU of compute capability >= 9,
    and the small kernels of the sorted and unfolded paths."""
    m = mod("mxfp4_moe")
    h, inter, k = DIMS["H"], DIMS["I"], DIMS["TOPK"]
    tables = [("sglang", m.DEFAULT_CONFIGS, 0, (0, 1), ARCHS),
              ("sm90_bits", m.DEFAULT_CONFIGS_SM90_BITS, 1, (1,), (90,)),
              ("sm90_tiled", m.DEFAULT_CONFIGS_SM90_TILED, 2, (1,), (90,))]
    for layout, table, wl, deqs, archs in tables:
        for bound, plan in table:
            cfg = _as_dict(plan)
            sp_gu, sp_dn = m._fit_split(cfg.get("split_gate_up", 1), h), m._fit_split(cfg.get("split_down", 1), inter)
            gu = _as_dict(m._fit_bk(_part(plan, "gate_up"), h // sp_gu))
            dn = _as_dict(m._fit_bk(_part(plan, "down"), inter // sp_dn))
            bm = cfg.get("BM", 16)
            if cfg["path"] == "sorted" and bm > 16:
                gu["BK"] = dn["BK"] = 128
                gu["BK_DOT"], dn["BK_DOT"] = min(gu["BK_DOT"], 128), min(dn["BK_DOT"], 128)
            halves = cfg.get("gate_up_halves", False)
            two_pass = halves or sp_gu > 1
            fold = cfg.get("fold", False)
            pdl = (2 if cfg.get("pdl_release", "k_loop") == "start" else 1) if cfg.get("pdl", False) else 0
            xs = cfg.get("stage_loads", 0)
            mode = {"sorted": 0, "pair": 1, "pair_token": 2}[cfg["path"]]
            for deq in deqs:
                common = dict(H=h, I=inter, TOPK=k, ROUND=False, DEQ=deq, WL=wl)
                gconst = dict(common, SORTED=mode == 0, HAS_LIMIT=True, UP_FIRST=False, SPLIT=sp_gu, HALVES=halves,
                              BM=bm, BN=gu["BN"], BK=gu["BK"], BKD=gu["BK_DOT"], PF=cfg.get("prefetch_gate_up", 0),
                              FOLD=fold and two_pass, PDL=pdl, XS=xs)
                if mode == 2:
                    dconst = dict(common, MODE=2, SPLIT=1, BM=bm, BN=dn["BN"], BK=dn["BK"], BKD=dn["BK_DOT"])
                else:
                    dconst = dict(common, MODE=mode, SPLIT=sp_dn, BM=bm, BN=dn["BN"], BK=dn["BK"], BKD=dn["BK_DOT"],
                                  PF=cfg.get("prefetch_down", 0), FOLD=fold, PDL=pdl, XS=xs)
                name = f"{layout}/P<={bound}/deq{deq}"
                for cc in archs:
                    b.add(f"mxfp4_moe/_gate_up_kernel/{name}", m._gate_up_kernel, m.GATE_UP_SIGNATURE, gconst, cc,
                          gu["num_warps"], gu["num_stages"], _aligned(m.GATE_UP_SIGNATURE, "stride_xt"),
                          gu.get("maxnreg"))
                    b.add(f"mxfp4_moe/_down_kernel/{name}", m._down_kernel, m.DOWN_SIGNATURE, dconst, cc,
                          dn["num_warps"], dn["num_stages"], _aligned(m.DOWN_SIGNATURE, "stride_ot"),
                          dn.get("maxnreg"))
    for cc in ARCHS:
        b.add("mxfp4_moe/_align_kernel/E256", m._align_kernel,
              {"ids_ptr": "*i32", "sorted_ptr": "*i32", "blk_exp_ptr": "*i32", "nblk_ptr": "*i32", "cursor_ptr": "*i32",
               "P": "i32", "max_rows": "i32", "E": "i32"}, dict(E_BINS=512, BM=16, CHUNK=1024), cc, 4, 3)
        b.add("mxfp4_moe/_swiglu_kernel/split4", m._swiglu_kernel,
              {"part_ptr": "*fp32", "ids_ptr": "*i32", "h_ptr": "*bf16", "limit": "fp32", "P": "i32", "E": "i32"},
              dict(I=inter, SPLIT=4, HAS_LIMIT=True, ROUND=False, BLOCK=256), cc, 4, 3)
        b.add("mxfp4_moe/_topk_sum_kernel/split2", m._topk_sum_kernel,
              {"y_ptr": "*fp32", "ids_ptr": "*i32", "out_ptr": "*bf16", "stride_ot": "i32", "P": "i32", "E": "i32"},
              dict(H=h, TOPK=k, SPLIT=2, ROUND=False, BLOCK=256), cc, 4, 3)


# ------------------------------------------------------------------------------------------------------- indexer

SCORE_SIG = {"q_ptr": "*bf16", "w_ptr": "*fp32", "qs_ptr": "*fp32", "kc32_ptr": "*i32", "k8_ptr": "*fp8e4nv",
             "ks_ptr": "*fp32", "bt_ptr": "*i32", "len_ptr": "*i32", "score_ptr": "*fp32", "gmax_ptr": "*fp32",
             "hist_ptr": "*i32", "stride_qb": "i32", "stride_qs": "i32", "stride_qh": "i32", "stride_wb": "i32",
             "stride_ws": "i32", "stride_bt": "i32", "max_len": "i32", "ng_buf": "i32", "n_split": "i32",
             "topk": "i32", "S_ALL": "i32", "s0": "i32"}
SCORE_ALIGNED = ("q_ptr", "w_ptr", "qs_ptr", "kc32_ptr", "k8_ptr", "ks_ptr", "bt_ptr", "len_ptr", "score_ptr",
                 "gmax_ptr", "hist_ptr", "stride_qb", "stride_qs", "stride_qh", "stride_wb", "stride_bt", "max_len")
SELECT_SIG = {"score_ptr": "*fp32", "gmax_ptr": "*fp32", "hist_ptr": "*i32", "tick_ptr": "*i32", "fine_ptr": "*i32",
              "scr_ptr": "*i32", "len_ptr": "*i32", "out_ptr": "*i32", "S": "i32", "max_len": "i32",
              "stride_row": "i32", "ng_buf": "i32", "topk": "i32"}
GROUP_MAX_SIG = {"score_ptr": "*fp32", "gmax_ptr": "*fp32", "hist_ptr": "*i32", "len_ptr": "*i32",
                 "stride_row": "i32", "ng_buf": "i32", "n_split": "i32", "max_len": "i32", "topk": "i32"}


def _indexer_settings(ix):
    """The indexer's shipped settings as one dict: from its ``IndexerConfig`` default, or, for kernels trees older
    than that object, from the module's switches of the same (upper-case) names."""
    if hasattr(ix, "DEFAULT_INDEXER_CONFIG"):
        c = ix.DEFAULT_INDEXER_CONFIG
        return dict(pdl=c.select_pdl, search=c.select_search, gather2d=c.select_gather2d,
                    fast_exact=c.select_fast_exact, reads_scores=c.select_reads_scores,
                    score_configs=c.score_configs, fp8q_score_configs=c.fp8q_score_configs)
    return dict(pdl=ix.SELECT_PDL, search=ix.SELECT_SEARCH, gather2d=ix.SELECT_GATHER2D,
                fast_exact=ix.SELECT_FAST_EXACT, reads_scores=ix.SELECT_READS_SCORES,
                score_configs=ix.DEFAULT_SCORE_CONFIGS, fp8q_score_configs=ix.DEFAULT_FP8Q_SCORE_CONFIGS)


def indexer(mod, b: Builds):
    """The score kernel of every default config (bf16 and fp8 query, 1 / 2 / 4 stacked tokens) for the arch it
    ships on, the select kernel as launched at B = 16 and 64 (16 and 4 programs per row), topk 512 and 2048, and
    ``topk_from_scores``' group-max and select launches, on both archs."""
    ix = mod("indexer")
    st = _indexer_settings(ix)
    tables = [("bf16q", st["score_configs"], False), ("fp8q", st["fp8q_score_configs"], True)]
    for qname, table, fp8 in tables:
        for (sm90, sp2), cfg in sorted(table.items()):
            ch, npv, pair = ix.page_vector_consts(cfg["BLOCK_N"], PAGE, cfg.get("PV", 0))
            keys = "fp8" if cfg["KEYS"] == "fp8pv" and not npv else cfg["KEYS"]
            const = dict(S=sp2, S_P2=sp2, H=INDEX_HEADS, PAGE=PAGE, BLOCK_N=cfg["BLOCK_N"], G=ix.GROUP, LEN_2D=False,
                         HAS_QS=fp8, Q_FP8=fp8, MIN_TILES=ix.MIN_TILES, DOT_F32=False, TOKENS_M=cfg["TOKENS_M"],
                         PREFETCH=cfg["PREFETCH"], DOT_PREC="tf32", KEYS=keys, NB=ix.HIST_BINS, SHIFT=ix.HIST_SHIFT,
                         PDL=st["pdl"], CH=ch, NPV=max(npv, 2), PAIR=pair, EPI=cfg.get("EPI", 0) if sp2 == 1 else 0)
            sig = dict(SCORE_SIG, q_ptr="*fp8e4nv" if fp8 else "*bf16")
            b.add(f"indexer/_index_scores_kernel/{qname}/S{sp2}", ix._index_scores_kernel, sig, const,
                  90 if sm90 else 120, cfg["num_warps"], cfg["num_stages"], SCORE_ALIGNED, cfg.get("MAXNREG"))
    for topk in (512, 2048):
        cap = ix.candidate_capacity(topk)
        warps = ix.DEFAULT_SELECT_WARPS if topk <= 1024 else 16
        const = dict(G=ix.GROUP, NB=ix.HIST_BINS, SHIFT=ix.HIST_SHIFT, NSEL=ix.SELECT_SPLIT, CAP=cap, CAP_P=cap,
                     TGS=ix.SELECT_TGS, TILE=1024, RADIX=ix.RADIX_BITS, CLEAR_HIST=True, SEARCH=st["search"],
                     NBF=ix.FINE_BINS, FSHIFT=ix.FINE_SHIFT, FAST_EXACT=st["fast_exact"],
                     READ_SCORES=st["reads_scores"])
        for cc in ARCHS:
            for nsel in (16, 4):  # B = 16 and B = 64 at S = 1 (SELECT_PROGRAMS = 256 in all)
                g = min(nsel, cap) if st["gather2d"] else 0
                b.add(f"indexer/_select_topk_kernel/topk{topk}/nsel{nsel}", ix._select_topk_kernel, SELECT_SIG,
                      dict(const, LEN_2D=False, PDL=st["pdl"], GROWS=g), cc, warps, 3)
            b.add(f"indexer/_select_topk_kernel/from_scores/topk{topk}", ix._select_topk_kernel, SELECT_SIG,
                  dict(const, LEN_2D=True, PDL=False, GROWS=min(16, cap) if st["gather2d"] else 0), cc, warps, 3)
    for cc in ARCHS:
        b.add("indexer/_group_max_kernel/block256", ix._group_max_kernel, GROUP_MAX_SIG,
              dict(G=ix.GROUP, BLOCK=256, MIN_TILES=ix.MIN_TILES, NB=ix.HIST_BINS, SHIFT=ix.HIST_SHIFT), cc, 4, 3)


# -------------------------------------------------------------------------------------------------- sparse MLA

MLA_SIG = {"q_ptr": "*bf16", "kc8_ptr": "*u8", "kc16_ptr": "*i16", "idx_ptr": "*i32", "len_ptr": "*i32",
           "sink_ptr": "*fp32", "out_ptr": "*bf16", "lse_ptr": "*fp32", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32",
           "sm_scale_log2": "fp32", "page_stride": "i32", "S": "i32", "H": "i32", "TOPK": "i32", "chunk": "i32",
           "split_offset": "i32", "n_splits_total": "i32", "stride_qb": "i32", "stride_qs": "i32", "stride_qh": "i32",
           "grid_bucket": "i32"}
MLA_ALIGNED = ("q_ptr", "kc8_ptr", "kc16_ptr", "idx_ptr", "out_ptr", "part_o_ptr", "page_stride", "stride_qb",
               "stride_qs", "stride_qh", "TOPK")
COMBINE_SIG = {"part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "sink_ptr": "*fp32", "out_ptr": "*bf16",
               "lse_ptr": "*fp32", "S": "i32", "H": "i32", "n_splits": "i32"}


def sparse_mla(mod, b: Builds):
    """Every config the default path launches (DEFAULT_CONFIG on sm_120, DEFAULT_CONFIG_SM90 on sm_90, the two per
    SM 16-head config on both), split (releasing the PDL combine) and direct, and the combine kernel."""
    m = mod("sparse_mla_decode")
    per_arch = {120: dict(m.DEFAULT_CONFIG), 90: dict(m.DEFAULT_CONFIG_SM90)}
    # the shipped SparseMLAConfig, or, for kernels trees older than that object, the module switch
    combine_pdl = m.DEFAULT_SPARSE_MLA_CONFIG.combine_pdl if hasattr(m, "DEFAULT_SPARSE_MLA_CONFIG") else m.COMBINE_PDL
    for cc, table in per_arch.items():
        items = sorted(table.items()) + [("16two", m.TWO_PER_SM_CONFIG_16)]
        for bh, cfg in items:
            block_h = 16 if bh == "16two" else bh
            for direct in (False, True):
                const = dict(HAS_LEN=True, HAS_SINK=True, DIRECT=direct, PAGE_SIZE=PAGE, BLOCK_H=block_h,
                             DOT_F32=False, DOT_PREC="tf32", BLOCK_N=cfg["BLOCK_N"], PDL=combine_pdl and not direct)
                if cfg.get("PIPELINE"):
                    fn = m._sparse_mla_fwd_pipelined_kernel
                    const["LOOP_STAGES"] = cfg["PIPELINE"]
                elif cfg.get("CHUNKED", False):
                    fn = m._sparse_mla_fwd_chunked_kernel
                else:
                    fn = m._sparse_mla_fwd_kernel
                b.add(f"sparse_mla/{fn.__name__}/h{bh}/{'direct' if direct else 'split'}", fn, MLA_SIG, const, cc,
                      cfg["num_warps"], cfg["num_stages"], MLA_ALIGNED)
    for cc in ARCHS:
        for pdl in (False, True):
            b.add(f"sparse_mla/_combine_kernel/pdl{int(pdl)}", m._combine_kernel, COMBINE_SIG,
                  dict(HAS_SINK=True, SPLITS_P2=8, ROUND=False, PDL=pdl), cc, 4, 3)


FAMILIES = {"mxfp4_moe": mxfp4_moe, "indexer": indexer, "sparse_mla": sparse_mla}


def compare(a_path: str, b_path: str) -> int:
    a, b = (json.load(open(p))["builds"] for p in (a_path, b_path))
    keys = sorted(set(a) | set(b))
    missing = [k for k in keys if k not in a or k not in b]
    ptx_diff = [k for k in keys if k in a and k in b and a[k]["ptx"] != b[k]["ptx"]]
    raw_diff = [k for k in keys if k in a and k in b and a[k]["ptx_raw"] != b[k]["ptx_raw"]]
    entry_diff = [k for k in keys if k in a and k in b and a[k]["entry"] != b[k]["entry"]]
    n = len(keys) - len(missing)
    print(f"{n} builds in both; PTX without debug lines identical: {n - len(ptx_diff)}; raw PTX identical: "
          f"{n - len(raw_diff)}; entry names identical: {n - len(entry_diff)}; in one file only: {len(missing)}")
    for k in missing:
        print("  only in one:", k)
    for k in ptx_diff:
        print("  PTX differs:", k)
    for k in entry_diff:
        print("  entry differs:", k, a[k]["entry"], b[k]["entry"])
    return 1 if missing or ptx_diff or entry_diff else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernels", default=os.path.join(_HERE, "..", "..", "kernels"), help="a kernels/ folder")
    ap.add_argument("--out", default="", help="write the fingerprints here (JSON)")
    ap.add_argument("--only", default=",".join(FAMILIES), help=f"comma-separated subset of {tuple(FAMILIES)}")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two --out files and exit")
    args = ap.parse_args()
    if args.compare:
        return compare(*args.compare)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, as the launchers get it
    os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="ptx_fingerprint_"))
    mod = load_kernels(os.path.abspath(args.kernels))
    b = Builds()
    for fam in args.only.split(","):
        FAMILIES[fam](mod, b)
    import triton

    res = dict(kernels=os.path.abspath(args.kernels), triton=triton.__version__,
               date=time.strftime("%Y-%m-%d %H:%M:%S"), command=" ".join(sys.argv), builds=b.run())
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1, sort_keys=True)
    print(f"{len(res['builds'])} builds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
