"""Device A/B of pd.kernels.mxfp4_moe's prepared sm_90 layouts against a committed kernel (run on the GPU machine,
not in CI): this checkout's default plans on sm90_bits and sm90_tiled, T <= 8 plan variants, the committed kernel's
default, and the anchor, in one run.

  python benchmarks/kernels/mxfp4_moe_ab.py --out DIR --head PATH [--budget SECONDS] [--ts 1,4,8,16,64,128]
      [--rounds 3] [--workers 14] [--baseline] [--ncu-after] [--sweep] [--plans NAME,...]

Layouts: "sm90_bits" (``prepare_mxfp4_weights_sm90``) and "sm90_tiled" (``prepare_mxfp4_weights_sm90(...,
tiled=True)`` and ``tile_mxfp4_scales``: every 32-row x 256-value piece 4 KiB of consecutive bytes, the scales in
[32 x 8 byte] tiles; a weights-only tiling gained nothing, benchmarks/results/mxfp4_moe_ab.md).

Plans are (layout, config) pairs: "head" (the committed kernel, ``--head``: a kernels/mxfp4_moe package folder of
another checkout, e.g. ``git worktree add /tmp/head HEAD`` and ``--head /tmp/head/kernels/mxfp4_moe``, or a file of
the single-module layout, ``git show OLD:kernels/mxfp4_moe.py``; its default plan on the sm90_bits layout), "bits"
(this checkout's default plan on sm90_bits), "tiled" (its default plan on sm90_tiled), and with ``--sweep`` T <= 8
plan variants on sm90_tiled (over its T <= 8 default). In one run:
0. ``--workers`` subprocesses compile every plan's kernels first (Triton's on-disk cache);
1. ``--sweep``: every plan timed once at T = 1 after a quick correctness check; the fastest ``--top`` variants join
   the rounds (``--plans`` names them instead);
2. correctness of every plan of the rounds: T = 1, 4, 8 with int32 and int64 ids and a -1 slot, NaN-poisoned
   output, each called twice (the fold tickets reset), against the torch reference, and captured in a CUDA graph at
   T = 1, 4, 8, replayed on 3 fresh inputs, bitwise equal to eager calls; the default plans also at T = 16, 64, 128
   (sorted path) with int64 ids, and the SGLang-layout default at T = 1;
3. interleaved rounds (median over ``--rounds``) at each T of ``--ts`` (T >= 16: head and the default plan on each
   layout); ``--baseline``: dequantize + torch grouped matmul;
4. kernel profile of T = 1 (torch.profiler over CUDA-graph replays) of the plans of the rounds;
5. ``--ncu-after``: Nsight Compute (``--clock-control none``) of the head and the fastest tiled plan at T = 1.
Writes mxfp4_moe_ab.json (device, date, commit, versions, command, every number; with ``--ncu-after`` also
mxfp4_moe_ab_ncu_t1.txt) to --out, the names of benchmarks/results/, and prints a table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mxfp4_moe as bm  # noqa: E402  (weights, routing, baseline, timing helpers of the main benchmark)
from results_io import run_info, write_result  # noqa: E402  (this folder, put on the path above)

mx = bm.mx
K = bm.K
tile = bm._tile
LAYOUTS = {"bits": "sm90_bits", "tiled": "sm90_tiled"}


def load_head(path):
    """The committed kernel from ``path``, imported inside this checkout's kernels package (its relative imports
    resolve there): a single-file module (``git show OLD:kernels/mxfp4_moe.py > /tmp/head.py``, the layout before
    the package) or a package folder (``git worktree add /tmp/head COMMIT``, then ``/tmp/head/kernels/mxfp4_moe``)."""
    pkg = mx.__name__.rsplit(".", 1)[0]
    if os.path.isdir(path):
        spec = importlib.util.spec_from_file_location(f"{pkg}._mxfp4_moe_head", os.path.join(path, "__init__.py"),
                                                      submodule_search_locations=[path])
    else:
        spec = importlib.util.spec_from_file_location(f"{pkg}._mxfp4_moe_head", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def variants():
    """(name, layout key, plan fields over sm90_tiled's T <= 8 default) of the sweep: wider gate/up tiles (8 KiB per
    stage), gate/up split 2 along K (the sm90_bits plan's), 4 stages, down 64 x 4 or split 2, 16 x 1 warp gate/up."""
    v = [("gu64w4", dict(gate_up=tile(64, 256, 4, 3, 128))),
         ("gu_split2", dict(split_gate_up=2)),
         ("gu_s4", dict(gate_up=tile(32, 256, 2, 4, 128))),
         ("gu16w1", dict(gate_up=tile(16, 256, 1, 3, 128))),
         ("dn64w4", dict(down=tile(64, 256, 4, 3, 128))),
         ("dn_split2", dict(split_down=2)),
         ("dn_s4", dict(down=tile(32, 256, 2, 4, 128))),
         ("both_s4", dict(gate_up=tile(32, 256, 2, 4, 128), down=tile(32, 256, 2, 4, 128)))]
    return [(f"tiled_{n}", "tiled", f) for n, f in v]


def all_plans(head):
    """{name: (layout key, MoEPlan or None = the module's default, module key)}."""
    base = mx.default_config(K, "sm90_tiled")
    plans = {"head": ("bits", None, "head"), "bits": ("bits", None, "mx"), "tiled": ("tiled", None, "mx")}
    for name, lk, f in variants():
        plans[name] = (lk, dataclasses.replace(base, **f), "mx")
    return plans


def plan_record(cfg):
    """A plan as the JSON records hold it: the nested-dict form (a head tree from before ``MoEPlan`` gives dicts)."""
    return cfg.as_dict() if hasattr(cfg, "as_dict") else cfg


# ------------------------------------------------------------------------------------------------ precompile

def compile_jobs(plans, names):
    """[plan name, T, ids dtype]: T = 1 int32 first (the sweep), then the check / round specializations."""
    jobs = [[n, 1, "int32"] for n in names]
    jobs += [[n, t, "int32"] for n in ("head", "bits", "tiled") for t in (16, 64, 128)]
    jobs += [[n, t, d] for n in names for t, d in ((1, "int64"), (8, "int32"), (8, "int64"))]
    jobs += [[n, t, "int64"] for n in ("bits", "tiled") for t in (16, 64, 128)]
    return jobs


def precompile_worker(index, workers, jobs_path, head_path):
    """Run this worker's share of the jobs once on uninitialized weights of the real shapes (the kernels' integer
    specializations and constexprs equal the main process's calls), filling Triton's on-disk cache."""
    with open(jobs_path) as f:
        jobs = json.load(f)[index::workers]
    head = load_head(head_path)
    plans = all_plans(head)
    dev = torch.device("cuda")
    h, i = bm.H, bm.I
    w13 = torch.empty(bm.E, 2 * i, h // 2, dtype=torch.uint8, device=dev)
    s13 = torch.full((bm.E, 2 * i, h // 32), 120, dtype=torch.uint8, device=dev)
    w2 = torch.empty(bm.E, h, i // 2, dtype=torch.uint8, device=dev)
    s2 = torch.full((bm.E, h, i // 32), 120, dtype=torch.uint8, device=dev)
    for name, t, dt in jobs:
        lk, cfg, mk = plans[name]
        mod = head if mk == "head" else mx
        x, ids, wts = bm.make_routing(t, dev, seed=t)
        try:
            mod.fused_moe_mxfp4(x, w13, s13, w2, s2, wts, ids.to(getattr(torch, dt)), swiglu_limit=bm.LIMIT,
                                config=cfg, max_scale_byte=123, weight_layout=LAYOUTS[lk])
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001  (the main process records the failure when it runs the plan)
            print("precompile failed", name, t, dt, repr(e)[:200], flush=True)


# ------------------------------------------------------------------------------------------------ checks

class Weights:
    """The benchmark weights in the SGLang layout and the two prepared layouts."""

    def __init__(self, dev):
        self.dev = dev
        self.w13, self.s13, self.w2, self.s2 = bm.make_weights(dev)
        self.msb = mx.mxfp4_max_scale_byte(self.s13, self.s2)
        p13, p2 = mx.prepare_mxfp4_weights_sm90(self.w13, self.w2)
        t13, t2 = mx.prepare_mxfp4_weights_sm90(self.w13, self.w2, tiled=True)
        ts13, ts2 = mx.tile_mxfp4_scales(self.s13, self.s2)
        self.by = {"bits": (p13, self.s13, p2, self.s2), "tiled": (t13, ts13, t2, ts2)}

    def call(self, mod, lk, x, ids, wts, out=None, cfg=None):
        a, sa, b, sb = self.by[lk]
        return mod.fused_moe_mxfp4(x, a, sa, b, sb, wts, ids, swiglu_limit=bm.LIMIT, out=out, config=cfg,
                                   max_scale_byte=self.msb, weight_layout=LAYOUTS[lk])


def graph_check(W, mod, lk, cfg, t, ids_dtype):
    """The plan captured in a CUDA graph, replayed on 3 fresh inputs copied into the captured buffers: bitwise
    equal to eager calls on those inputs."""
    dev = W.dev
    x, ids, wts = bm.make_routing(t, dev, seed=77 + t)
    xs, ws, is_ = x.clone(), wts.clone(), ids.to(ids_dtype)
    out = torch.empty(t, bm.H, dtype=torch.bfloat16, device=dev)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        W.call(mod, lk, xs, is_, ws, out, cfg)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            W.call(mod, lk, xs, is_, ws, out, cfg)
    torch.cuda.current_stream().wait_stream(s)
    ok = True
    for r in range(3):
        x2, i2, w2_ = bm.make_routing(t, dev, seed=4242 + r)
        i2[-1, 0] = -1
        xs.copy_(x2), is_.copy_(i2.to(is_.dtype)), ws.copy_(w2_)
        g.replay()
        torch.cuda.synchronize()
        ok &= bool(torch.equal(out, W.call(mod, lk, x2, i2.to(ids_dtype), w2_, None, cfg)))
    return ok


def check_one(W, mod, lk, cfg, x, ids, wts, ref, twice=True):
    """rel error (and the second call's) of one call on NaN-poisoned output; ok flag."""
    rec = {}
    try:
        for n in range(2 if twice else 1):
            out = torch.full((x.shape[0], bm.H), float("nan"), dtype=torch.bfloat16, device=x.device)
            W.call(mod, lk, x, ids, wts, out, cfg)
            torch.cuda.synchronize()
            rec["rel_err" if n == 0 else "second_call_rel_err"] = bm.rel(out, ref)
            rec["nan"] = rec.get("nan", False) or bool(torch.isnan(out).any())
    except Exception as e:  # noqa: BLE001  (recorded as a failed check; the run goes on)
        rec = dict(rel_err=float("inf"), nan=True, error=repr(e)[:300])
    rec["ok"] = rec["rel_err"] <= 4e-3 and not rec["nan"] and rec.get("second_call_rel_err", 0) <= 4e-3
    return rec


_CHECK_INPUTS = {}  # T -> (x, ids with a -1 slot, weights, reference output): shared by the plans checked


def check_inputs(W, t):
    if t not in _CHECK_INPUTS:
        x, ids, wts = bm.make_routing(t, W.dev, seed=2000 + t)
        ids[0, -1] = -1
        ref = bm.fused_moe_mxfp4_reference(x, W.w13, W.s13, W.w2, W.s2, wts, ids, swiglu_limit=bm.LIMIT,
                                           dtype=torch.float32)
        _CHECK_INPUTS[t] = (x, ids, wts, ref)
    return _CHECK_INPUTS[t]


def full_check(W, name, mod, lk, cfg, ts=(1, 4, 8), graph=True):
    """Correctness records of one plan (see the module docstring, step 2)."""
    recs = []
    for t in ts:
        x, ids, wts, ref = check_inputs(W, t)
        for n_ids, idv in (("int32", ids), ("int64", ids.long())):
            c = check_one(W, mod, lk, cfg, x, idv, wts, ref)
            c.update(T=t, plan=name, ids=n_ids)
            recs.append(c)
        if graph:
            for dt in (torch.int32, torch.int64):
                try:
                    ok = graph_check(W, mod, lk, cfg, t, dt)
                except Exception as e:  # noqa: BLE001
                    ok = False
                    print("graph check failed", name, t, repr(e)[:300], flush=True)
                recs.append(dict(T=t, plan=name, ids=str(dt)[6:], graph_replay_bitwise=ok, ok=ok))
    return recs


# ------------------------------------------------------------------------------------------------ timing

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



# ------------------------------------------------------------------------------------------------ ncu

def ncu_target(spec):
    """3 T = 1 calls of each named plan (the first may compile): the process ncu profiles."""
    names, head_path = json.loads(spec)
    head = load_head(head_path)
    plans = all_plans(head)
    dev = torch.device("cuda")
    W = Weights(dev)
    x, ids, wts = bm.make_routing(1, dev, seed=5)
    for name in names:
        lk, cfg, mk = plans[name]
        for _ in range(3):
            W.call(head if mk == "head" else mx, lk, x, ids, wts, None, cfg)
        torch.cuda.synchronize()


def run_ncu(names, head_path, timeout_s, out_dir):
    """Nsight Compute sections of the second call's gate/up and down kernels of each plan; the report text."""
    ncu = shutil.which("ncu") or next(iter(sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"))), "ncu")
    cmd = [ncu, "--clock-control", "none", "--section", "SpeedOfLight", "--section", "Occupancy",
           "--section", "WarpStateStats", "--section", "LaunchStats", "--section", "MemoryWorkloadAnalysis",
           "--section", "MemoryWorkloadAnalysis_Tables", "-k", "regex:_gate_up_kernel|_down_kernel",
           "--launch-skip", "2", "--launch-count", "2"]
    text = ""
    for i, name in enumerate(names):  # one process per plan: --launch-skip counts from its start
        try:
            r = subprocess.run(cmd + [sys.executable, os.path.abspath(__file__), "--ncu-target",
                                      json.dumps([[name], head_path])],
                               capture_output=True, text=True, timeout=timeout_s / (len(names) - i))
            text += f"==== {name}\n" + r.stdout + r.stderr
        except Exception as e:  # noqa: BLE001
            text += f"==== {name}\nncu failed: {e!r}\n"
    with open(os.path.join(out_dir, "mxfp4_moe_ab_ncu_t1.txt"), "w") as f:
        f.write(text)
    return text


# ------------------------------------------------------------------------------------------------ main

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--head", required=False, default="")
    ap.add_argument("--budget", type=float, default=130.0, help="seconds; phases shrink or stop when they run out")
    ap.add_argument("--ts", default="1,4,8,16,64,128")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--top", type=int, default=2)
    ap.add_argument("--workers", type=int, default=14)
    ap.add_argument("--baseline", action="store_true")
    ap.add_argument("--ncu-after", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--plans", default="", help="comma-separated sweep plans that join the rounds without a sweep")
    ap.add_argument("--precompile-worker", type=int, default=None)
    ap.add_argument("--jobs-file", default="")
    ap.add_argument("--ncu-target", default="")
    args = ap.parse_args()
    if args.precompile_worker is not None:
        return precompile_worker(args.precompile_worker, args.workers, args.jobs_file, args.head)
    if args.ncu_target:
        return ncu_target(args.ncu_target)

    t0 = time.time()
    deadline = t0 + args.budget
    os.makedirs(args.out, exist_ok=True)
    head = load_head(args.head)
    plans = all_plans(head)
    chosen = [n for n in args.plans.split(",") if n]
    defaults = ["head", "bits", "tiled"]
    names = defaults + ([n for n, _, _ in variants()] if args.sweep else chosen)
    workers = []
    if args.workers > 0:
        path = os.path.join(tempfile.mkdtemp(), "jobs.json")  # not under --out: only results go back
        with open(path, "w") as f:
            json.dump(compile_jobs(plans, names), f)
        workers = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--precompile-worker", str(w),
                                     "--workers", str(args.workers), "--jobs-file", path, "--head", args.head])
                   for w in range(args.workers)]
    dev = torch.device("cuda")
    ts = [int(v) for v in args.ts.split(",")]
    res = dict(run_info(), torch=torch.__version__, triton=triton.__version__, expert_bytes=bm.EXPERT_BYTES,
               hbm_floor_bps=bm.HBM_BPS, rot_sets=bm.ROT, head=args.head,
               plans={n: dict(layout=LAYOUTS[plans[n][0]], config=plan_record(plans[n][1]), module=plans[n][2])
                      for n in names})

    def save():
        res["wall_s"] = time.time() - t0
        return write_result(args.out, "mxfp4_moe_ab", res)

    def left():
        return deadline - time.time()

    torch.backends.cuda.matmul.allow_tf32 = False
    W = Weights(dev)
    for w in workers:  # the compiles, in parallel; a worker still busy past this point only costs a duplicate
        try:
            w.wait(timeout=max(1.0, min(60.0, left() - 90)))
        except subprocess.TimeoutExpired:
            pass
    res["precompile_s"] = time.time() - t0
    print(f"precompile done at {res['precompile_s']:.1f} s", flush=True)

    def mod_of(name):
        return head if plans[name][2] == "head" else mx

    def calls(name, sets, outs):
        lk, cfg, _ = plans[name]
        mod = mod_of(name)
        return [lambda i=i: W.call(mod, lk, sets[i][0], sets[i][1], sets[i][2], outs[i], cfg)
                for i in range(bm.ROT)]

    sets1 = [bm.make_routing(1, dev, seed=7 + r) for r in range(bm.ROT)]
    outs1 = [torch.empty(1, bm.H, dtype=torch.bfloat16, device=dev) for _ in range(bm.ROT)]

    # 1. sweep at T = 1
    res["sweep"] = {}
    if args.sweep:
        xq, iq, wq = bm.make_routing(1, dev, seed=99)
        iq[0, -1] = -1
        refq = bm.fused_moe_mxfp4_reference(xq, W.w13, W.s13, W.w2, W.s2, wq, iq, swiglu_limit=bm.LIMIT,
                                            dtype=torch.float32)
        for name in names:
            if name not in defaults[:2] and left() < 80:
                res["sweep_truncated"] = name
                break
            lk, cfg, _ = plans[name]
            c = check_one(W, mod_of(name), lk, cfg, xq, iq, wq, refq, twice=False)
            us = float("nan")
            if c["ok"]:
                try:
                    us = bm.bench_graph(calls(name, sets1, outs1), 25)
                except Exception as e:  # noqa: BLE001
                    c["error"] = repr(e)[:200]
            res["sweep"][name] = dict(us=us, quick=c)
            print(f"sweep {name:26s} {us:7.2f} us  {c}", flush=True)
        good = sorted((v["us"], n) for n, v in res["sweep"].items()
                      if n not in defaults and v["us"] == v["us"])
        chosen = [n for _, n in good[:args.top]]
    res["round_plans"] = defaults + chosen
    save()

    # 2. correctness
    res["correctness"] = []
    for name in defaults + chosen:
        lk, cfg, _ = plans[name]
        recs = full_check(W, name, mod_of(name), lk, cfg, graph=name != "head" or not args.sweep)
        res["correctness"] += recs
        print("correct", name, all(r["ok"] for r in recs), max(r.get("rel_err", 0) for r in recs), flush=True)
    for name in ("tiled", "bits"):  # the sorted-path defaults
        lk, cfg, _ = plans[name]
        recs = full_check(W, name, mx, lk, cfg, ts=(16, 64, 128), graph=False)
        res["correctness"] += recs
        print("correct", name, "T 16-128", all(r["ok"] for r in recs), flush=True)
    x, ids, wts = bm.make_routing(1, dev, seed=3001)
    ids[0, -1] = -1
    ref = bm.fused_moe_mxfp4_reference(x, W.w13, W.s13, W.w2, W.s2, wts, ids, swiglu_limit=bm.LIMIT,
                                       dtype=torch.float32)
    out = torch.full((1, bm.H), float("nan"), dtype=torch.bfloat16, device=dev)
    mx.fused_moe_mxfp4(x, W.w13, W.s13, W.w2, W.s2, wts, ids, swiglu_limit=bm.LIMIT, out=out, max_scale_byte=W.msb)
    c = dict(T=1, plan="sglang_default", ids="int32", rel_err=bm.rel(out, ref), nan=bool(torch.isnan(out).any()))
    c["ok"] = c["rel_err"] <= 4e-3 and not c["nan"]
    res["correctness"].append(c)
    bad = {r["plan"] for r in res["correctness"] if not r["ok"]}
    res["correct_all_ok"] = not bad
    print("correctness failures:", sorted(bad), flush=True)
    chosen = [n for n in chosen if n not in bad]
    save()

    # 3. rounds
    res["workers_ended_before_rounds"] = end_workers(workers)
    res["timing"] = []
    lut = bm._lut_pairs(dev)
    for n_t, t in enumerate(ts):
        t_deadline = time.time() + max(0.0, left() - 25) / (len(ts) - n_t)
        sets = sets1 if t == 1 else [bm.make_routing(t, dev, seed=7 * t + r) for r in range(bm.ROT)]
        row = bm.floor_row(t, sets)
        floor = row["floor_us_4p3"]
        outs = [torch.empty(t, bm.H, dtype=torch.bfloat16, device=dev) for _ in range(bm.ROT)]
        timed = {n: calls(n, sets, outs) for n in defaults + (chosen if t * K <= 48 else [])
                 if n not in bad}
        interleaved_rounds(row, timed, args.rounds, t_deadline, floor)
        row["configs"] = {n: plan_record(mod_of(n).default_config(t * K, LAYOUTS[plans[n][0]]) if plans[n][1] is None
                                         else plans[n][1]) for n in timed}
        if args.baseline and left() > 15:
            bm.time_baseline(row, sets, (W.w13, W.s13, W.w2, W.s2), lut, rep=60)
        res["timing"].append(row)
        save()
        print("time", t, json.dumps({k: row[k] for k in ("median_us", "pct_floor")}), flush=True)

    # 4. T = 1 kernel profile
    res["profile_t1"] = {}
    if 1 in ts:
        for name in defaults + chosen:
            if left() < 6 or name in bad:
                continue
            try:
                res["profile_t1"][name] = kernel_profile(calls(name, sets1, outs1))
            except Exception as e:  # noqa: BLE001
                res["profile_t1"][name] = dict(error=repr(e)[:300])
            print("profile", name, json.dumps(res["profile_t1"][name]), flush=True)
    save()

    # 5. ncu of the head and the fastest tiled plan at T = 1
    if args.ncu_after and left() > 20:
        t1 = next((r for r in res["timing"] if r["T"] == 1), None)
        cands = [n for n in ["tiled"] + chosen if t1 and n in t1["median_us"]]
        best = min(cands, key=lambda n: t1["median_us"][n]) if cands else "tiled"
        res["ncu_plans"] = ["head", best]
        text = run_ncu(res["ncu_plans"], args.head, max(10.0, left() + 12), args.out)
        res["ncu_lines"] = [ln for ln in text.splitlines() if ln.startswith("====") or any(
            k in ln for k in ("_kernel", "Duration", "DRAM Throughput", "Compute (SM) Throughput", "Achieved Occupancy",
                              "Registers Per", "Warp Cycles Per Issued", "Memory Throughput", "Waves Per SM",
                              "L2 Hit Rate", "Mem Busy", "Max Bandwidth", "Sectors/Req"))]
    out_path = save()

    print(f"\n{res['device']} correctness ok: {res['correct_all_ok']}  wall {time.time() - t0:.0f} s  "
          f"rounds {res['round_plans']}")
    for ln in res.get("ncu_lines", [])[:60]:
        print("ncu", ln.strip())
    print_summary(res, name_width=22)
    print("wrote", out_path)


if __name__ == "__main__":
    main()
