"""Same-run A/B of sparse-MLA decode variants on the device (benchmarks/results/sparse_mla_ab.md).

  python benchmarks/kernels/sparse_mla_ab.py [--out DIR] [--budget-s 200] [--cases h64|h16|all]
      [--baseline OLD_SPARSE_MLA_DECODE] [--profile] [--alt-kernel FILE.py:NAME]
      [--combine-modes pdl,launch] [--graph-check] [--correctness] [--case-list "16,1,64;64,1,16"]

For each case (B, H, S; topk 512, page 64, the input sets of benchmarks/kernels/sparse_mla_decode.py cycled so KV
is not served from L2) times the default path, every variant of ``variants_for`` (heads per program, tile, warps,
pipeline stages, topk splits), the default path of another version of kernels/sparse_mla_decode (``--baseline``:
the package folder, or the single file of older trees) and a rewritten kernel launched in place of the pipelined
one (``--alt-kernel``, through ``SparseMLAConfig.pipelined_kernel``), with CUDA-graph replay, and checks each output
against the fp64 reference (||out - ref|| / ||ref||). ``--combine-modes pdl,launch`` times the default path with and
without programmatic dependent launch of the combine (``SparseMLAConfig.combine_pdl``), ``--graph-check`` checks
CUDA-graph replay on fresh inputs against eager calls, ``--correctness`` runs the benchmark's quick correctness
cases. ``--profile`` adds the per-tile cost (topk_length 64..512 at one split, KV cold and L2-hot). Ends with
registers / spills / shared memory / cp.async and async_wait counts of every kernel the device compiled. Stops adding
variants once --budget-s seconds have passed, so a device call ends inside its limit; writes sparse_mla_ab.json
(device, date, commit, command, every number) to --out after every case.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("sparse_mla_bench", os.path.join(HERE, "sparse_mla_decode.py"))
bm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bm)
sparse_mla_decode = bm.sparse_mla_decode
sparse_mla_decode_ref = bm.sparse_mla_decode_ref
TWO_PER_SM = bm.TWO_PER_SM_CONFIG_16
SparseMLAConfig = bm._smd.SparseMLAConfig


def pipelined(bh, bn, w, stages, ns=None, ppsm=None):
    cfg = {"BLOCK_N": bn, "num_warps": w, "num_stages": 1, "PIPELINE": stages}
    if ppsm:
        cfg["PROGRAMS_PER_SM"] = ppsm
    name = f"pipe{stages}_bh{bh}_n{bn}_w{w}_s{ns}" + (f"_x{ppsm}" if ppsm else "")
    return name, dict(block_h=bh, num_splits=ns, config=cfg)


def variants_for(h, b, s):
    """Variants timed next to the default path (and the --baseline file's default, when given): the default path
    at other topk split counts."""
    out = [("default", {})]
    if h == 16 and b * s > 32:
        out += [pipelined(16, 32, 4, 5, ns=ns, ppsm=2) for ns in (2, 3, 8)]
    elif b * s * h // 16 <= 32:
        out += [(f"default_s{ns}", dict(num_splits=ns)) for ns in (2, 4)]
    return out


CASES = {
    "h64": [(64, 1, 64), (64, 1, 128), (64, 2, 16), (64, 2, 64), (64, 1, 16), (64, 1, 1)],
    "h16": [(16, 1, 64), (16, 1, 128), (16, 2, 64), (16, 1, 16), (16, 1, 1), (16, 2, 16), (16, 2, 1)],
}


def load_alt(spec):
    path, name = spec.split(":")
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    return getattr(importlib.import_module(os.path.splitext(os.path.basename(path))[0]), name)


def per_tile_profile(dev, h, b, kw, hot):
    """us per call at topk_length 64..512 (1..8 tiles of 64 per program, one split): the slope is the time per
    tile, the intercept the fixed cost. ``hot``: every index points into 64 tokens (L2-resident), so the slope
    is the compute chain alone; otherwise random tokens from a pool several times the L2."""
    topk, ps = 512, 64
    q, kc, idx, _ = bm.make_inputs(bm.ROT * b, 1, h, topk, ps, max(16384, bm.ROT * b * topk * 5 // 4), dev, seed=3)
    if hot:
        idx = idx % 64
    kc4 = bm.view4(kc, ps)
    qs = [q[i * b:(i + 1) * b] for i in range(bm.ROT)]
    ids = [idx[i * b:(i + 1) * b] for i in range(bm.ROT)]
    res = {}
    for n in (64, 128, 256, 512):
        ln = torch.full((b,), n, dtype=torch.int32, device=dev)
        res[n] = bm.bench(lambda i: sparse_mla_decode(qs[i], kc4, ids[i], topk_length=ln, num_splits=1, **kw), True)
    return res


def check_bits_dequant(dev):
    """Every e4m3 byte (NaN codes aside) under every UE8M0 scale byte, dequantized on the device by the
    pipelined kernel's bits path (_deq_scaled on the GPU) vs torch (fp64 product rounded once to bf16):
    -> number of mismatching elements (0 expected; checks mul.rn.bf16x2's subnormal handling on the hardware)."""
    import triton
    import triton.language as tl

    deq = bm._smd._deq_scaled

    @triton.jit
    def k(raw_ptr, sc_ptr, out_ptr):
        r = tl.program_id(0) * 32 + tl.arange(0, 32)
        c = tl.arange(0, 64)
        raw = tl.load(raw_ptr + r[:, None] * 64 + c[None, :])
        sc8 = tl.load(sc_ptr + r)
        tl.store(out_ptr + r[:, None] * 64 + c[None, :], deq(raw, sc8, 3, False))

    codes = torch.tensor([v for v in range(256) if v not in (0x7F, 0xFF)], dtype=torch.uint8)
    n = 256 * 4  # rows: scale byte s = row // 4, each row 64 codes (4 rows cover the 254 codes)
    raw = torch.zeros(n, 64, dtype=torch.uint8)
    flat = codes.repeat((n * 64 + len(codes) - 1) // len(codes))[: n * 64]
    raw.view(-1)[:] = flat
    s = torch.arange(n) // 4
    sc8 = (s << 24).to(torch.int64)  # byte 3 of the 8 scale bytes
    out = torch.empty(n, 64, dtype=torch.bfloat16, device=dev)
    k[(n // 32,)](raw.to(dev), sc8.to(dev), out)
    ref = (raw.view(torch.float8_e4m3fn).double() * torch.pow(2.0, (s - 127).double())[:, None]).to(torch.bfloat16)
    got = out.cpu()
    return int((got.view(torch.int16) != ref.view(torch.int16)).sum())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget-s", type=float, default=200.0)
    ap.add_argument("--cases", default="all", choices=["h64", "h16", "all"])
    ap.add_argument("--baseline", help="another version of kernels/sparse_mla_decode (package folder or single file) "
                    "whose default path is timed too")
    ap.add_argument("--profile", action="store_true", help="per-tile cost (topk_length sweep, cold/hot KV)")
    ap.add_argument("--alt-kernel", help="FILE.py:NAME of a kernel with the pipelined kernel's signature, timed "
                    "in the pipelined configs of --alt-configs in its place (exploring a rewrite)")
    ap.add_argument("--alt-configs", default="64,64,8,3;64,64,8,5;64,32,8,5",
                    help="';'-separated block_h,BLOCK_N,num_warps,loop_stages for --alt-kernel")
    ap.add_argument("--combine-modes", default="",
                    help="'pdl', 'launch' or both (','-separated): the default path timed with and without PDL combine")
    ap.add_argument("--graph-check", action="store_true", help="CUDA-graph replay vs eager on fresh inputs")
    ap.add_argument("--correctness", action="store_true", help="the benchmark's quick correctness cases first")
    ap.add_argument("--case-list", help="';'-separated H,S,B cases instead of --cases")
    args = ap.parse_args()
    t0 = time.time()
    dev = torch.device("cuda")
    cases = CASES["h64"] + CASES["h16"] if args.cases == "all" else CASES[args.cases]
    # interleave so a budget stop still covers both head counts
    if args.cases == "all":
        cases = [c for pair in zip(CASES["h64"], CASES["h16"]) for c in pair] + CASES["h64"][len(CASES["h16"]):]
    if args.case_list:
        cases = [tuple(map(int, c.split(","))) for c in args.case_list.split(";")]
    res = dict(bm.run_info(), torch=torch.__version__, triton=bm.triton.__version__, cases=[])
    try:
        res["bits_dequant_mismatches"] = check_bits_dequant(dev)
    except Exception as e:  # noqa: BLE001  (report, keep timing)
        res["bits_dequant_mismatches"] = repr(e)[:300]
    print("bits dequant mismatches (all e4m3 codes x scale bytes):", res["bits_dequant_mismatches"], flush=True)
    if args.correctness:
        res["correctness"] = bm.correctness(dev, quick=True)
        print("correctness ok", sum(c["ok"] for c in res["correctness"]), "/", len(res["correctness"]), flush=True)
    base_fn = bm.load_baseline(args.baseline) if args.baseline else None
    alt = load_alt(args.alt_kernel) if args.alt_kernel else None
    for h, s, b in cases:
        topk, ps = 512, 64
        q, kc, idx, _ = bm.make_inputs(bm.ROT * b, s, h, topk, ps, max(16384, bm.ROT * b * s * topk * 5 // 4), dev,
                                       seed=b + h)
        kc4 = bm.view4(kc, ps)
        qs = [q[i * b:(i + 1) * b] for i in range(bm.ROT)]
        ids = [idx[i * b:(i + 1) * b] for i in range(bm.ROT)]
        ref, _ = sparse_mla_decode_ref(qs[0], kc, ids[0], page_size=ps)
        row = dict(B=b, H=h, S=s, us={}, rel={}, errors={})
        runs = [(name, sparse_mla_decode, kw) for name, kw in variants_for(h, b, s)]
        if base_fn is not None:
            runs.insert(0, ("baseline", base_fn, {}))
        for mode in args.combine_modes.split(","):
            if mode:
                runs.insert(2, (f"combine_{mode}", sparse_mla_decode,
                                dict(mla_config=SparseMLAConfig(combine_pdl=mode == "pdl"))))
        if alt is not None:
            for spec in args.alt_configs.split(";"):
                bh, bn, w, st = map(int, spec.split(","))
                if h % bh == 0:
                    name, kw = pipelined(bh, bn, w, st)
                    runs.append(("alt_" + name, sparse_mla_decode,
                                 dict(kw, mla_config=SparseMLAConfig(pipelined_kernel=alt))))
        for name, fn, kw in runs:
            if time.time() - t0 > args.budget_s:
                row["errors"]["budget"] = "stopped"
                break
            try:
                o, _ = fn(qs[0], kc4, ids[0], **kw)
                row["rel"][name] = bm.rel(o, ref)
                row["us"][name] = bm.bench(lambda i: fn(qs[i], kc4, ids[i], **kw), True)
            except Exception as e:  # noqa: BLE001
                row["errors"][name] = repr(e)[:300]
        res["cases"].append(row)
        best = sorted((v, k) for k, v in row["us"].items())[:4]
        print(f"H={h} S={s} B={b} baseline {row['us'].get('baseline', float('nan')):.1f} default "
              f"{row['us'].get('default', float('nan')):.1f} us | best "
              + ", ".join(f"{k} {v:.1f} (rel {row['rel'][k]:.2e})" for v, k in best)
              + (f" | errors {list(row['errors'])}" if row["errors"] else ""), flush=True)
        res["wall_s"] = time.time() - t0
        bm.write_result(args.out, "sparse_mla_ab", res)
        del q, kc, idx, ref
        if time.time() - t0 > args.budget_s:
            break
    if args.graph_check:
        res["graph_replay"] = bm.graph_replay_check(dev)
    if args.profile:
        res["per_tile"] = []
        for h, b, kw in ((64, 128, {}), (16, 128, dict(config=TWO_PER_SM))):
            for hot in (False, True):
                if time.time() - t0 > args.budget_s + 20:
                    break
                r = per_tile_profile(dev, h, b, kw, hot)
                res["per_tile"].append(dict(H=h, B=b, config=kw.get("config", "default"), hot=hot, us=r))
                print("per-tile", h, b, kw.get("config", "default"), "hot" if hot else "cold",
                      {n: round(v, 1) for n, v in r.items()}, flush=True)
    res["compiled"] = bm.compiled_facts(extra=[alt] if alt is not None else [])
    for f in res["compiled"]:
        print("compiled", json.dumps(f), flush=True)
    res["wall_s"] = time.time() - t0
    print("wrote", bm.write_result(args.out, "sparse_mla_ab", res))


if __name__ == "__main__":
    main()
