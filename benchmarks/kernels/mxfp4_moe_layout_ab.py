"""Device A/B for pd.kernels.mxfp4_moe's prepared sm_90 weight layout (run on the GPU machine, not in CI).

  python benchmarks/kernels/mxfp4_moe_layout_ab.py --out DIR [--head PATH] [--budget SECONDS]

Same shapes, data, routing and timing method as benchmarks/kernels/mxfp4_moe.py (256 experts, top-6, H 4096,
I 2048, UE8M0 scales 116..123, CUDA-graph medians over 4 routing sets, floor at 4.3 TB/s). In one run, per T in
{1, 16, 64, 128}: the committed kernel (``--head``: a copy of the last committed kernels/mxfp4_moe.py, SGLang
layout, its default plan), this checkout's kernel on the SGLang layout (default plan) and on the weights prepared by
``prepare_mxfp4_weights_sm90`` (default plan and a few tile variants, since the prepared path needs fewer
registers), the dequantize + torch grouped-matmul baseline, and correctness of the prepared path (several plans,
-1 slot, int64 ids, NaN-poisoned output) against the torch reference. Writes mxfp4_moe_layout_ab.json.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mxfp4_moe as bm  # noqa: E402  (weights, routing, baseline, timing helpers of the main benchmark)

mx = bm.mx
K = bm.K


def load_head(path):
    spec = importlib.util.spec_from_file_location("mxfp4_moe_head", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def prep_variants(t):
    """(name, config) timed on the prepared layout at T tokens: the default plan, then tile variants."""
    base = mx.default_config(t * K)
    out = [("default", base)]
    tile = bm._tile
    if t <= 4:
        for gu in (tile(64, 256, 2, 3, 128), tile(64, 256, 2, 4), tile(64, 128, 2, 4)):
            out.append((f"gu{bm._tile_name(gu)}", dict(base, gate_up=gu)))
        out.append(("split8x2", dict(base, split_gate_up=8)))
    else:
        for gu in (tile(64, 256, 2, 3), tile(64, 256, 2, 4), tile(128, 256, 4, 3)):
            out.append((f"gu{bm._tile_name(gu)}", dict(base, gate_up=gu)))
        for dn in (tile(64, 256, 2, 3), tile(128, 256, 2, 3, 128), tile(128, 256, 4, 3)):
            out.append((f"dn{bm._tile_name(dn)}", dict(base, down=dn)))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--head", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "_mxfp4_moe_head.py"))
    ap.add_argument("--budget", type=float, default=100.0)
    ap.add_argument("--ts", default="1,16,64,128")
    args = ap.parse_args()
    t0 = time.time()
    head = load_head(args.head)
    dev = torch.device("cuda")
    ts = [int(v) for v in args.ts.split(",")]
    res = dict(device=torch.cuda.get_device_name(),
               date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
               torch=torch.__version__, triton=triton.__version__, command=" ".join(["python"] + sys.argv),
               expert_bytes=bm.EXPERT_BYTES, hbm_floor_bps=bm.HBM_BPS, rot_sets=bm.ROT)
    w13, s13, w2, s2 = bm.make_weights(dev)
    msb = mx.mxfp4_max_scale_byte(s13, s2)
    tp = time.time()
    p13, p2 = mx.prepare_mxfp4_weights_sm90(w13, w2)
    torch.cuda.synchronize()
    res["prepare_s"] = time.time() - tp
    path = os.path.join(args.out, "mxfp4_moe_layout_ab.json")
    os.makedirs(args.out, exist_ok=True)

    def save():
        res["wall_s"] = time.time() - t0
        with open(path, "w") as f:
            json.dump(res, f, indent=1)

    # correctness of the prepared path at real shapes
    torch.backends.cuda.matmul.allow_tf32 = False
    res["correctness"] = []
    for t in ts:
        x, ids, wts = bm.make_routing(t, dev, seed=1000 + t)
        ids[0, -1] = -1
        ref = bm.fused_moe_mxfp4_reference(x, w13, s13, w2, s2, wts, ids, swiglu_limit=bm.LIMIT,
                                           dtype=torch.float32)
        plans = prep_variants(t)[:2] + [("pair_token", dict(mx.default_config(t * K), path="pair_token",
                                                            split_gate_up=2, split_down=1))]
        for name, cfg in plans:
            for layout, a, b in (("sm90_bits", p13, p2), ("sglang", w13, w2)):
                if layout == "sglang" and name != "default":
                    continue
                out = torch.full((t, bm.H), float("nan"), dtype=torch.bfloat16, device=dev)
                mx.fused_moe_mxfp4(x, a, s13, b, s2, wts, ids.long() if name == "default" else ids,
                                   swiglu_limit=bm.LIMIT, out=out, config=cfg, max_scale_byte=msb,
                                   weight_layout=layout)
                torch.cuda.synchronize()
                c = dict(T=t, plan=name, layout=layout, rel_err=bm.rel(out, ref), nan=bool(torch.isnan(out).any()))
                c["ok"] = c["rel_err"] <= 4e-3 and not c["nan"]
                res["correctness"].append(c)
                print("correct", c, flush=True)
    # T = 256 (P = 1536 > 1024): the 64-row sorted plan, which may compile to wgmma on the prepared layout
    x, ids, wts = bm.make_routing(256, dev, seed=1256)
    ref = bm.fused_moe_mxfp4_reference(x, w13, s13, w2, s2, wts, ids, swiglu_limit=bm.LIMIT, dtype=torch.float32)
    out = mx.fused_moe_mxfp4(x, p13, s13, p2, s2, wts, ids, swiglu_limit=bm.LIMIT, max_scale_byte=msb,
                             weight_layout="sm90_bits")
    c = dict(T=256, plan="default", layout="sm90_bits", rel_err=bm.rel(out, ref), nan=bool(torch.isnan(out).any()))
    c["ok"] = c["rel_err"] <= 4e-3 and not c["nan"]
    res["correctness"].append(c)
    print("correct", c, flush=True)
    res["correct_all_ok"] = all(c["ok"] for c in res["correctness"])
    save()

    lut = bm._lut_pairs(dev)
    res["timing"] = []
    deadline = t0 + args.budget
    for n_t, t in enumerate(ts):
        t_deadline = time.time() + (deadline - time.time()) / (len(ts) - n_t)
        sets = [bm.make_routing(t, dev, seed=7 * t + r) for r in range(bm.ROT)]
        row = bm.floor_row(t, sets)
        outs = [torch.empty(t, bm.H, dtype=torch.bfloat16, device=dev) for _ in range(bm.ROT)]

        def call(mod, a, b, cfg=None, **kw):
            return [lambda i=i: mod.fused_moe_mxfp4(sets[i][0], a, s13, b, s2, sets[i][2], sets[i][1],
                                                    swiglu_limit=bm.LIMIT, out=outs[i], config=cfg,
                                                    max_scale_byte=msb, **kw)
                    for i in range(bm.ROT)]

        head_cfg = head.default_config(t * K)
        row["head_config"] = head_cfg
        row["head_us"] = bm.bench_graph(call(head, w13, w2), 60)
        row["sglang_layout_us"] = bm.bench_graph(call(mx, w13, w2), 60)
        sw = {}
        for name, cfg in prep_variants(t):
            if name != "default" and time.time() > t_deadline:
                row["sweep_truncated"] = True
                break
            try:
                sw[name] = bm.bench_graph(call(mx, p13, p2, cfg, weight_layout="sm90_bits"), 60 if name == "default"
                                          else 30)
            except Exception as e:  # noqa: BLE001
                sw[name] = repr(e)[:200]
                print("variant failed", t, name, sw[name], flush=True)
        row["prep_us"] = sw
        row["prep_default_config"] = mx.default_config(t * K)
        row["head_us_again"] = bm.bench_graph(call(head, w13, w2), 60)
        row["prep_default_us_again"] = bm.bench_graph(call(mx, p13, p2, weight_layout="sm90_bits"), 60)
        bm.time_baseline(row, sets, (w13, s13, w2, s2), lut, rep=100 if t < 64 else 200)
        good = {k: v for k, v in sw.items() if isinstance(v, float)}
        best = min(good.items(), key=lambda kv: kv[1])
        row["prep_best_variant"], row["prep_best_us"] = best
        f = row["floor_us_4p3"]
        row["pct_floor_head"] = 100 * f / row["head_us"]
        row["pct_floor_prep_default"] = 100 * f / sw["default"]
        row["pct_floor_prep_best"] = 100 * f / best[1]
        row["prep_default_vs_head"] = row["head_us"] / sw["default"]
        row["prep_default_vs_baseline"] = row["baseline_us"] / sw["default"]
        res["timing"].append(row)
        save()
        print("time", json.dumps(row), flush=True)
    save()
    print(f"\n{res['device']} correctness ok: {res['correct_all_ok']} prepare {res['prepare_s']:.2f} s")
    for r in res["timing"]:
        print(f"T={r['T']:>3} floor {r['floor_us_4p3']:7.1f} head {r['head_us']:8.1f}/{r['head_us_again']:8.1f} "
              f"({r['pct_floor_head']:.1f}%) sglang {r['sglang_layout_us']:8.1f} prep {r['prep_us']['default']:8.1f}/"
              f"{r['prep_default_us_again']:8.1f} ({r['pct_floor_prep_default']:.1f}%) best {r['prep_best_variant']} "
              f"{r['prep_best_us']:.1f} ({r['pct_floor_prep_best']:.1f}%) baseline {r['baseline_us']:.0f}")
    print("wrote", path)


if __name__ == "__main__":
    main()
