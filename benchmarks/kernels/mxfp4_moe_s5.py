"""Device A/B for pd.kernels.mxfp4_moe, session 5 (run on the GPU machine, not in CI).

  python benchmarks/kernels/mxfp4_moe_s5.py --out DIR [--head PATH] [--budget SECONDS] [--baseline] [--sweep]
      [--ts 1,4,8,16,64,128] [--rounds 3]

Same shapes, data, routing and timing method as benchmarks/kernels/mxfp4_moe.py (256 experts, top-6, H 4096,
I 2048, UE8M0 scales 116..123, CUDA-graph medians over 4 routing sets, floor at 4.3 TB/s), weights in the prepared
sm_90 layout (``prepare_mxfp4_weights_sm90``). In one run:
1. correctness of every plan timed below (each T, and T = 256; int64 ids, a -1 slot, NaN-poisoned output) against
   the torch reference; fold plans called twice (the tickets reset); every T = 1 plan captured in a CUDA graph and
   replayed on fresh inputs (bitwise equal to eager calls);
2. timing in interleaved rounds (``--rounds``, each round times every plan once), median over rounds: the
   committed kernel (``--head``: a copy of the last committed kernels/mxfp4_moe.py, its default plan, on the
   prepared and on the SGLang layout), this checkout's default plan, and candidate plans. At T = 1 (``--sweep``)
   every candidate is timed once first and the fastest three go into the rounds; T = 2..8 time T = 1's round plans;
   ``--baseline``: dequantize + torch grouped matmul, same run;
3. a kernel-level profile of T = 1 (torch.profiler over CUDA-graph replays: per-kernel durations, the gaps between
   the kernels of a call, the call's span) for the committed plan on both layouts and the plans of the rounds.
Writes mxfp4_moe_s5.json (device, date, versions, command, every number); prints a table last.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mxfp4_moe as bm  # noqa: E402  (weights, routing, baseline, timing helpers of the main benchmark)

mx = bm.mx
K = bm.K
tile = bm._tile
LAYOUT = "sm90_bits"


def load_head(path):
    spec = importlib.util.spec_from_file_location("mxfp4_moe_head", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def t1_plans(head, sweep):
    """(name, config) at T = 1 on the prepared layout: one-row blocks (BM 1) with the fold (2 launches), then
    (sweep) splits, tiles and the other options around it. Run 1 of s5 (pdl with the release at the start of
    gate/up, L2 prefetch) lost 6-15 us and is not repeated."""
    base = dict(head.default_config(K, LAYOUT), BM=1, fold=True)
    plans = [("bm1_fold", base)]
    if sweep:
        plans += [("bm1", dict(base, fold=False)),
                  ("bm8_fold", dict(base, BM=8)),
                  ("bm1_fold_pdl", dict(base, pdl=True)),
                  ("bm1_fold_gu64k128w2s3", dict(base, gate_up=tile(64, 128, 2, 3))),
                  ("bm1_fold_gu64k128w2s4", dict(base, gate_up=tile(64, 128, 2, 4))),
                  ("bm1_fold_gu64k256w2s3", dict(base, gate_up=tile(64, 256, 2, 3))),
                  ("bm1_fold_gu64k256w2s4", dict(base, gate_up=tile(64, 256, 2, 4))),
                  ("bm1_fold_gu128k256w4s3", dict(base, gate_up=tile(128, 256, 4, 3))),
                  ("bm1_fold_s2x2", dict(base, split_gate_up=2)),
                  ("bm1_fold_s8x2", dict(base, split_gate_up=8)),
                  ("bm1_fold_s4x4", dict(base, split_down=4)),
                  ("bm1_fold_s4x1", dict(base, split_down=1)),
                  ("bm1_fold_dn64k256d128w2s3", dict(base, down=tile(64, 256, 2, 3, 128))),
                  ("bm1_fold_dn64k128w2s4", dict(base, down=tile(64, 128, 2, 4))),
                  ("bm1_fold_s2x2_gu64k256w2s4", dict(base, split_gate_up=2, gate_up=tile(64, 256, 2, 4))),
                  ("bm1_fold_gu64k128w2s3_s4x4", dict(base, gate_up=tile(64, 128, 2, 3), split_down=4)),
                  ("bm1_fold_gu64k128w2s3_dn64k128w2s4", dict(base, gate_up=tile(64, 128, 2, 3),
                                                              down=tile(64, 128, 2, 4)))]
    return plans


def big_plans(head, t):
    """(name, config) at T >= 16 (sorted path, prepared layout): fewer rows per sorted block (the T = 16..128
    blocks hold 1.2-3.1 rows on average)."""
    base = mx.default_config(t * K, LAYOUT)
    if base["path"] != "sorted" or base.get("BM", 16) != 16:
        return []
    return [("bm8", dict(base, BM=8)),
            ("bm4", dict(base, BM=4)),
            ("bm8_gu64k256w2s3", dict(base, BM=8, gate_up=tile(64, 256, 2, 3)))]


SGLANG_T1 = None  # set in main: the SGLang-layout T = 1 plan with one-row blocks and the fold


def check(x, w13, s13, w2, s2, wts, ids, ref, cfg, msb, layout, mod=mx):
    out = torch.full((x.shape[0], bm.H), float("nan"), dtype=torch.bfloat16, device=x.device)
    mod.fused_moe_mxfp4(x, w13, s13, w2, s2, wts, ids, swiglu_limit=bm.LIMIT, out=out, config=cfg,
                        max_scale_byte=msb, weight_layout=layout)
    torch.cuda.synchronize()
    return out, dict(rel_err=bm.rel(out, ref), nan=bool(torch.isnan(out).any()))


def graph_check(x, w13, s13, w2, s2, wts, ids, cfg, msb, eager):
    """The plan captured in a CUDA graph, replayed on fresh inputs copied into the captured buffers: bitwise equal
    to eager calls on those inputs (fixed grid, no host sync, tickets reset across replays)."""
    xs, ws, is_ = x.clone(), wts.clone(), ids.clone()
    out = torch.empty(x.shape[0], bm.H, dtype=torch.bfloat16, device=x.device)

    def call():
        mx.fused_moe_mxfp4(xs, w13, s13, w2, s2, ws, is_, swiglu_limit=bm.LIMIT, out=out, config=cfg,
                           max_scale_byte=msb, weight_layout=LAYOUT)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            call()
    torch.cuda.current_stream().wait_stream(s)
    ok = True
    for r in range(3):
        x2, i2, w2_ = bm.make_routing(x.shape[0], x.device, seed=4242 + r)
        i2[-1, 0] = -1
        xs.copy_(x2), is_.copy_(i2.to(is_.dtype)), ws.copy_(w2_)
        g.replay()
        torch.cuda.synchronize()
        ok &= bool(torch.equal(out, eager(x2, i2, w2_)))
    return ok


def kernel_profile(call_sets, n_replay=10):
    """torch.profiler over graph replays of len(call_sets) calls each: per call, the kernels in launch order with
    their durations (us) and the gaps before each (start minus the previous kernel's end; negative = overlap, PDL),
    and the span first start -> last end. Medians over the profiled calls."""
    n_sets = len(call_sets)
    for f in call_sets:
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in call_sets:
            f()
    g.replay()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n_replay):
            g.replay()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tf:
        path = tf.name
    prof.export_chrome_trace(path)
    with open(path) as f:
        ev = json.load(f)["traceEvents"]
    os.unlink(path)
    kern = sorted((e for e in ev if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    if not kern or len(kern) % (n_replay * n_sets):
        return dict(error=f"{len(kern)} kernel events for {n_replay * n_sets} calls")
    per = len(kern) // (n_replay * n_sets)
    calls = [kern[i:i + per] for i in range(0, len(kern), per)]
    names = [e["name"].split("(")[0][:40] for e in calls[0]]
    durs = [[c[j]["dur"] for c in calls] for j in range(per)]
    gaps = [[c[j]["ts"] - (c[j - 1]["ts"] + c[j - 1]["dur"]) for c in calls] for j in range(1, per)]
    spans = [c[-1]["ts"] + c[-1]["dur"] - c[0]["ts"] for c in calls]
    between = [calls[i][0]["ts"] - (calls[i - 1][-1]["ts"] + calls[i - 1][-1]["dur"]) for i in range(1, len(calls))]
    med = statistics.median
    return dict(kernels=names, dur_us=[round(med(d), 2) for d in durs], gap_us=[round(med(g), 2) for g in gaps],
                span_us=round(med(spans), 2), between_calls_us=round(med(between), 2), kernels_per_call=per)


def ncu_run(args):
    """3 calls of each named T = 1 plan on the prepared layout (the first compiles), nothing else: for ncu."""
    head = load_head(args.head)
    dev = torch.device("cuda")
    w13, s13, w2, s2 = bm.make_weights(dev)
    msb = mx.mxfp4_max_scale_byte(s13, s2)
    p13, p2 = mx.prepare_mxfp4_weights_sm90(w13, w2)
    x, ids, wts = bm.make_routing(1, dev, seed=5)
    named = dict(t1_plans(head, True), default=mx.default_config(K, LAYOUT))
    for name in args.ncu_plans.split(","):
        mod, cfg = (head, None) if name == "head" else (mx, named[name])
        for _ in range(3):
            mod.fused_moe_mxfp4(x, p13, s13, p2, s2, wts, ids, swiglu_limit=bm.LIMIT, max_scale_byte=msb,
                                config=cfg, weight_layout=LAYOUT)
        torch.cuda.synchronize()


def end_workers(workers) -> int:
    """Kill and reap the compile workers (subprocess.Popen handles) still running, so none runs kernels beside the
    timed rounds; returns how many were."""
    alive = [w for w in workers if w.poll() is None]
    for w in alive:
        w.kill()
        w.wait()
    return len(alive)


def interleaved_rounds(row, timed, n_rounds, t_deadline, floor):
    """Time every plan of ``timed`` ({name: CUDA-graph call list}) once per round, ``n_rounds`` interleaved rounds
    (at least 2; later ones only before ``t_deadline``), into ``row``: rounds_us, median_us, pct_floor (of
    ``floor`` us) and vs_head (the "head" plan's median over each); a plan that fails gets NaN and its error."""
    rounds = {n: [] for n in timed}
    for r in range(n_rounds):
        if r >= 2 and time.time() > t_deadline:
            row["rounds_truncated"] = r
            break
        for n, fns in timed.items():
            try:
                rounds[n].append(bm.bench_graph(fns, 40))
            except Exception as e:  # noqa: BLE001
                rounds[n].append(float("nan"))
                row.setdefault("errors", {})[n] = repr(e)[:200]
    row["rounds_us"] = rounds
    row["median_us"] = {n: statistics.median(v) for n, v in rounds.items() if v}
    row["pct_floor"] = {n: 100 * floor / v for n, v in row["median_us"].items()}
    row["vs_head"] = {n: row["median_us"]["head"] / v for n, v in row["median_us"].items()}


def print_summary(res, name_width=28):
    """Print the T = 1 kernel profile of each plan (span, time between calls when recorded, per-kernel durations,
    gaps) and each T's round medians with their spread and % of the floor."""
    for name, p in res["profile_t1"].items():
        if "kernels" in p:
            between = f"between {p['between_calls_us']:5.1f} " if "between_calls_us" in p else ""
            print(f"profile T=1 {name:{name_width}s} span {p['span_us']:6.1f} {between}"
                  + " ".join(f"{k[:14]}={d:.1f}" for k, d in zip(p["kernels"], p["dur_us"]))
                  + " gaps " + " ".join(f"{g:.1f}" for g in p["gap_us"]))
    for r in res["timing"]:
        spread = {n: f"{min(v):.1f}-{max(v):.1f}" for n, v in r["rounds_us"].items() if v}
        print(f"T={r['T']:>3} floor {r['floor_us_4p3']:6.1f} "
              + " ".join(f"{n}={r['median_us'][n]:.1f}[{spread[n]}]({r['pct_floor'][n]:.1f}%)"
                         for n in r["median_us"])
              + (f" baseline={r['baseline_us']:.0f}" if "baseline_us" in r else ""))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--head", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "_mxfp4_moe_s4b.py"))
    ap.add_argument("--budget", type=float, default=120.0, help="seconds; sweeps and rounds stop when they run out")
    ap.add_argument("--ts", default="1,4,8,16,64,128")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sweep", action="store_true", help="more T = 1 variants (each timed once, the best retimed)")
    ap.add_argument("--baseline", action="store_true", help="also time dequantize + torch grouped matmul")
    ap.add_argument("--extra-plans", default="", help="JSON {T: {name: config}} added to the timed plans")
    ap.add_argument("--ncu-plans", default="", help="only run these T = 1 plans (comma-separated names), 3 calls "
                    "each, for a profiler (ncu); 'head' = the committed kernel")
    args = ap.parse_args()
    if args.ncu_plans:
        return ncu_run(args)
    t0 = time.time()
    deadline = t0 + args.budget
    head = load_head(args.head)
    global SGLANG_T1
    SGLANG_T1 = dict(head.default_config(K), BM=1, fold=True)
    dev = torch.device("cuda")
    ts = [int(v) for v in args.ts.split(",")]
    res = dict(device=torch.cuda.get_device_name(),
               date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
               torch=torch.__version__, triton=triton.__version__, command=" ".join(["python"] + sys.argv),
               expert_bytes=bm.EXPERT_BYTES, hbm_floor_bps=bm.HBM_BPS, rot_sets=bm.ROT, head=args.head)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "mxfp4_moe_s5.json")

    def save():
        res["wall_s"] = time.time() - t0
        with open(path, "w") as f:
            json.dump(res, f, indent=1)

    w13, s13, w2, s2 = bm.make_weights(dev)
    msb = mx.mxfp4_max_scale_byte(s13, s2)
    p13, p2 = mx.prepare_mxfp4_weights_sm90(w13, w2)
    extra = {int(k): v for k, v in json.loads(args.extra_plans).items()} if args.extra_plans else {}

    plans = {}  # T -> [(name, config)]: "default" is this checkout's default plan
    for t in ts:
        pl = [("default", mx.default_config(t * K, LAYOUT))]
        pl += t1_plans(head, args.sweep) if t * K <= 48 else big_plans(head, t)
        pl += list(extra.get(t, {}).items())
        seen, uniq = [], []
        for n, c in pl:  # a candidate equal to the default plan is timed once, as the default
            if c not in seen:
                seen.append(c)
                uniq.append((n, c))
        plans[t] = uniq
    res["plans"] = {str(t): {n: c for n, c in pl} for t, pl in plans.items()}

    # 1. correctness
    torch.backends.cuda.matmul.allow_tf32 = False
    res["correctness"] = []
    for t in ts + [256]:
        x, ids, wts = bm.make_routing(t, dev, seed=1000 + t)
        ids[0, -1] = -1
        ref = bm.fused_moe_mxfp4_reference(x, w13, s13, w2, s2, wts, ids, swiglu_limit=bm.LIMIT,
                                           dtype=torch.float32)
        cands = plans.get(t, [("default", mx.default_config(t * K, LAYOUT))])
        if t == 256:  # past the 64-row entry's bound: the sorted plans of T <= 170 here too (more rows per block)
            cands = cands + [("sorted16", mx.default_config(128 * K, LAYOUT))] + big_plans(head, 128)
        for i_plan, (name, cfg) in enumerate(cands):
            for n_ids, idv in (("int64", ids.long()), ("int32", ids))[0 if i_plan < 6 else 1:]:
                try:
                    _, c = check(x, p13, s13, p2, s2, wts, idv, ref, cfg, msb, LAYOUT)
                    if cfg.get("fold"):  # a second call: the tickets were reset by the first
                        out2, c2 = check(x, p13, s13, p2, s2, wts, idv, ref, cfg, msb, LAYOUT)
                        c["second_call_rel_err"] = c2["rel_err"]
                        c["nan"] |= c2["nan"]
                except Exception as e:  # noqa: BLE001  (recorded as a failed check; the run goes on)
                    c = dict(rel_err=float("inf"), nan=True, error=repr(e)[:300])
                c.update(T=t, plan=name, ids=n_ids, layout=LAYOUT)
                c["ok"] = c["rel_err"] <= 4e-3 and not c["nan"] and c.get("second_call_rel_err", 0) <= 4e-3
                res["correctness"].append(c)
                print("correct", c, flush=True)
        if t == 1:  # the one-row fold plan on the SGLang layout too (DEFAULT_CONFIGS' T = 1 plan)
            try:
                _, c = check(x, w13, s13, w2, s2, wts, ids, ref, SGLANG_T1, msb, "sglang")
            except Exception as e:  # noqa: BLE001
                c = dict(rel_err=float("inf"), nan=True, error=repr(e)[:300])
            c.update(T=t, plan="sglang_bm1_fold", ids="int32", layout="sglang")
            c["ok"] = c["rel_err"] <= 4e-3 and not c["nan"]
            res["correctness"].append(c)
            print("correct", c, flush=True)
            for name, cfg in plans[1]:  # every T = 1 plan captured in a graph, replayed on fresh inputs
                def eager(x2, i2, w2_, cfg=cfg):
                    return mx.fused_moe_mxfp4(x2, p13, s13, p2, s2, w2_, i2, swiglu_limit=bm.LIMIT, config=cfg,
                                              max_scale_byte=msb, weight_layout=LAYOUT)
                try:
                    ok = graph_check(x, p13, s13, p2, s2, wts, ids, cfg, msb, eager)
                except Exception as e:  # noqa: BLE001
                    ok = False
                    print("graph check failed", name, repr(e)[:300], flush=True)
                res["correctness"].append(dict(T=1, plan=name, graph_replay_bitwise=ok, ok=ok))
                print("graph", name, ok, flush=True)
    res["correct_all_ok"] = all(c["ok"] for c in res["correctness"])
    save()

    # 2. timing
    res["timing"] = []
    lut = bm._lut_pairs(dev)
    share = {t: (3 if t == 1 and args.sweep else 1) for t in ts}  # the T = 1 sweep gets a larger share
    for n_t, t in enumerate(ts):
        t_deadline = time.time() + (deadline - time.time()) * share[t] / sum(share[u] for u in ts[n_t:])
        sets = [bm.make_routing(t, dev, seed=7 * t + r) for r in range(bm.ROT)]
        row = bm.floor_row(t, sets)
        floor = row["floor_us_4p3"]
        outs = [torch.empty(t, bm.H, dtype=torch.bfloat16, device=dev) for _ in range(bm.ROT)]

        def call(mod, a, b, cfg=None, layout=LAYOUT):
            return [lambda i=i: mod.fused_moe_mxfp4(sets[i][0], a, s13, b, s2, sets[i][2], sets[i][1],
                                                    swiglu_limit=bm.LIMIT, out=outs[i], config=cfg,
                                                    max_scale_byte=msb, weight_layout=layout)
                    for i in range(bm.ROT)]
        cand = dict(plans[t])
        row["sweep_us"] = {}
        t1_row = next((r for r in res["timing"] if r["T"] == 1), None)
        if t > 1 and t * K <= 48 and t1_row is not None:  # T = 2..8: the plans of T = 1's rounds, no sweep
            cand = {n: cand[n] for n in t1_row["median_us"] if n in cand}
        elif len(cand) > 4:  # one timing each, then the fastest three go into the rounds
            for name, cfg in cand.items():
                if name != "default" and time.time() > t_deadline - 8:
                    row["sweep_truncated"] = True
                    break
                try:
                    row["sweep_us"][name] = bm.bench_graph(call(mx, p13, p2, cfg), 25)
                except Exception as e:  # noqa: BLE001
                    row["sweep_us"][name] = repr(e)[:200]
                print("sweep", t, name, row["sweep_us"][name], flush=True)
            good = sorted((v, k) for k, v in row["sweep_us"].items() if isinstance(v, float) and k != "default")
            cand = {"default": cand["default"], **{k: cand[k] for _, k in good[:3]}}
        timed = {"head": call(head, p13, p2), "head_sglang": call(head, w13, w2, layout="sglang")}
        timed.update({n: call(mx, p13, p2, c) for n, c in cand.items()})
        if t == 1:  # the one-row fold plan on the SGLang layout (for DEFAULT_CONFIGS; not a default here)
            timed["sglang_bm1_fold"] = call(mx, w13, w2, SGLANG_T1, layout="sglang")
        interleaved_rounds(row, timed, args.rounds, t_deadline, floor)
        row["configs"] = {n: (cand[n] if n in cand else SGLANG_T1 if n == "sglang_bm1_fold" else
                              head.default_config(t * K, LAYOUT if n == "head" else "sglang")) for n in timed}
        if args.baseline:
            bm.time_baseline(row, sets, (w13, s13, w2, s2), lut, rep=100 if t < 64 else 200)
        res["timing"].append(row)
        save()
        print("time", t, json.dumps({k: row[k] for k in ("median_us", "pct_floor")}), flush=True)
    # 3. T = 1 kernel profile (after the timing: the plans of its rounds)
    res["profile_t1"] = {}
    if 1 in ts:
        sets = [bm.make_routing(1, dev, seed=7 + r) for r in range(bm.ROT)]
        outs = [torch.empty(1, bm.H, dtype=torch.bfloat16, device=dev) for _ in range(bm.ROT)]

        def calls(mod, a, b, cfg=None, layout=LAYOUT):
            return [lambda i=i: mod.fused_moe_mxfp4(sets[i][0], a, s13, b, s2, sets[i][2], sets[i][1],
                                                    swiglu_limit=bm.LIMIT, out=outs[i], config=cfg,
                                                    max_scale_byte=msb, weight_layout=layout)
                    for i in range(bm.ROT)]
        prof_plans = [("head_sglang", calls(head, w13, w2, layout="sglang")),
                      ("head_prepared", calls(head, p13, p2)),
                      ("sglang_bm1_fold", calls(mx, w13, w2, SGLANG_T1, layout="sglang"))]
        named = dict(plans[1])
        t1_row = next(r for r in res["timing"] if r["T"] == 1)
        prof_plans += [(n, calls(mx, p13, p2, named[n])) for n in t1_row["median_us"] if n in named]
        for name, fns in prof_plans:
            try:
                res["profile_t1"][name] = kernel_profile(fns)
            except Exception as e:  # noqa: BLE001
                res["profile_t1"][name] = dict(error=repr(e)[:300])
            print("profile", name, json.dumps(res["profile_t1"][name]), flush=True)
        save()

    save()
    print(f"\n{res['device']} correctness ok: {res['correct_all_ok']}  wall {time.time() - t0:.0f} s")
    print_summary(res)
    print("wrote", path)


if __name__ == "__main__":
    main()
