"""Device A/B for pd.kernels.mxfp4_moe at T <= 8, session 5b (run on the GPU machine, not in CI): more warps per SM
for the one-row (BM 1) fold plan of the prepared sm_90 layout.

  python benchmarks/kernels/mxfp4_moe_s5b.py --out DIR [--head PATH] [--budget SECONDS] [--ts 1,4,8,16]
      [--rounds 3] [--workers 14] [--baseline] [--ncu-after] [--set s5b|s5c|s5d] [--tag s5b]
      [--profile-plans NAME,...]

``--set s5c`` (session 5c) sweeps ``stage_loads`` instead (the activation row and the scales staged by the cp.async
pipeline, see ``gate_up_variants_s5c``); ``--set s5d`` (session 5d) the down launch's overlap with gate/up (PDL
release at gate/up's start, down's weights prefetched into L2 before its wait) and one-wave K splits (see
``gate_up_variants_s5d`` and ``down_variants_s5d``); ``--tag`` names the results file (mxfp4_moe_<tag>.json);
``--profile-plans`` adds sweep plans to the kernel profile of step 4 (e.g. one without the fold, to see the down
kernel without its epilogue).

Why these candidates (sm_90a AOT builds with triton 3.9 on a CPU, no GPU): the T = 1 default runs gate/up as 768
programs of 2 warps (BN 64) and down as 768 programs of 2 warps, 0.53 / 0.42 of one wave, so every SM holds ~12
warps, 3 per scheduler. Its K loop is 708 (gate/up) and 374 (down) SASS instructions per warp per BK step; at the
measured ~1 instruction per 8 cycles per warp that is 8 x 708 x 8 cycles = 24 us and 8 x 374 x 8 = 12.6 us, the
measured 24.5 and 14.8 us: the kernels are bound by each warp's serial instruction stream, not by DRAM (32% busy).
Spreading a program's rows over more warps (BN 64 with 4 warps, or BN 32 / 16 with 2 / 1 warp: 16 weight rows
per warp, 379-395 instructions per BK 256 step) halves that stream and still fits one wave (62-64 registers: 32
warps per SM). The sweep times these tiles for gate/up and for down separately, then the best pairs together.

In one run:
0. ``--workers`` subprocesses compile every candidate's kernels first (Triton's on-disk cache; the main process
   then loads them), for T = 1 / 8 and int32 / int64 ids (the launcher's integer specializations);
1. sweep at T = 1 (one timing each after a quick correctness check), gate/up tiles with the default down tile,
   down tiles with the default gate/up tile, then the best 2 x 2 combinations;
2. full correctness of the default and the fastest ``--top`` plans: T = 1, 4, 8 with int32 and int64 ids and a -1
   slot, NaN-poisoned output, each called twice (the fold tickets reset), against the torch reference; each
   captured in a CUDA graph at T = 1, 4, 8 and replayed on 3 fresh inputs, bitwise equal to eager calls;
3. interleaved rounds (median over ``--rounds``) at each T of ``--ts``: the committed kernel (``--head``, a copy
   of the last committed kernels/mxfp4_moe.py, its default plan), this checkout's default and the ``--top``
   plans (T >= 16: the committed and this checkout's default only); ``--baseline``: dequantize + torch grouped
   matmul;
4. kernel-level profile of T = 1 (torch.profiler over CUDA-graph replays) for the plans of the rounds;
5. ``--ncu-after``: Nsight Compute (``--clock-control none``) of the fastest plan's two T = 1 kernels, if time
   is left.
Writes mxfp4_moe_s5b.json (device, date, versions, command, every number) and prints a table last.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mxfp4_moe as bm  # noqa: E402  (weights, routing, baseline, timing helpers of the main benchmark)
import mxfp4_moe_s5 as s5  # noqa: E402  (graph replay check, kernel profile, head loader)

mx = bm.mx
K = bm.K
tile = bm._tile
LAYOUT = "sm90_bits"
HERE = os.path.dirname(os.path.abspath(__file__))


def base_plan():
    """This checkout's T = 1 plan on the prepared layout (one-row blocks, fold, 2 x 2 K splits)."""
    return mx.default_config(K, LAYOUT)


def capped(t, maxnreg):
    """A tile with a register cap per thread (the launch option ``maxnreg``)."""
    return dict(t, maxnreg=maxnreg)


def gate_up_variants():
    """(name, plan fields) for gate/up: 16 weight rows per warp (BN = 16 x num_warps) and variants; with 4 K splits
    the 1536 / 3072 programs fit one wave only at 40 registers (AOT: 44 uncapped, 48 warps per SM capped)."""
    v = [("gu64k256d128w4s3", tile(64, 256, 4, 3, 128)),
         ("gu32k256d128w2s3", tile(32, 256, 2, 3, 128)),
         ("gu16k256d128w1s3", tile(16, 256, 1, 3, 128)),
         ("gu64k256d64w4s3", tile(64, 256, 4, 3, 64)),
         ("gu64k512d128w4s3", tile(64, 512, 4, 3, 128)),
         ("gu64k256d128w4s4", tile(64, 256, 4, 4, 128)),
         ("gu32k256d128w2s4", tile(32, 256, 2, 4, 128)),
         ("gu32k512d128w2s3", tile(32, 512, 2, 3, 128)),
         ("gu64k128w4s4", tile(64, 128, 4, 4)),
         ("gu32k256d64w2s3", tile(32, 256, 2, 3, 64)),
         ("gu64k256d128w4s2", tile(64, 256, 4, 2, 128))]
    out = [(n, dict(gate_up=c)) for n, c in v]
    out += [("gu64k256d64w4s3r40_s4", dict(gate_up=capped(tile(64, 256, 4, 3, 64), 40), split_gate_up=4)),
            ("gu32k256d64w2s3r40_s4", dict(gate_up=capped(tile(32, 256, 2, 3, 64), 40), split_gate_up=4))]
    return out


def down_variants():
    """(name, plan fields) for down, as for gate/up."""
    v = [("dn64k128w4s3", tile(64, 128, 4, 3)),
         ("dn32k128w2s3", tile(32, 128, 2, 3)),
         ("dn16k128w1s3", tile(16, 128, 1, 3)),
         ("dn32k256d128w2s3", tile(32, 256, 2, 3, 128)),
         ("dn64k256d128w4s3", tile(64, 256, 4, 3, 128)),
         ("dn64k128w4s4", tile(64, 128, 4, 4)),
         ("dn32k128w2s4", tile(32, 128, 2, 4)),
         ("dn16k256d128w1s3", tile(16, 256, 1, 3, 128)),
         ("dn32k128w2s2", tile(32, 128, 2, 2))]
    out = [(n, dict(down=c)) for n, c in v]
    out += [("dn32k128d64w2s3r40_s4", dict(down=capped(tile(32, 128, 2, 3, 64), 40), split_down=4)),
            ("dn64k128d64w4s3r40_s4", dict(down=capped(tile(64, 128, 4, 3, 64), 40), split_down=4))]
    return out


def gate_up_variants_s5c():
    """--set s5c: ``stage_loads`` (the activation row, and with 3 the scales, read as contiguous loads that
    Triton's cp.async pipeliner stages with the weights; sm_90a AOT, triton 3.9: the default tiles' K loops then
    have no plain global load left, gate/up 54 and down 56 registers instead of 62 / 67), on the default tiles and
    on gate/up tile variants (the sweep times each with the default down tile and stage_loads 3 in both)."""
    v = [("xs3", {}), ("xs2", dict(stage_loads=2)), ("xs1", dict(stage_loads=1)),
         ("xs3_gu64w4", dict(gate_up=tile(64, 256, 4, 3, 128))),
         ("xs3_gu16w1", dict(gate_up=tile(16, 256, 1, 3, 128))),
         ("xs3_gu32s4", dict(gate_up=tile(32, 256, 2, 4, 128))),
         ("xs3_gu32s2", dict(gate_up=tile(32, 256, 2, 2, 128))),
         ("xs3_gu_split4", dict(split_gate_up=4)),
         ("xs3_nopdl", dict(pdl=False))]
    return [(n, dict(dict(stage_loads=3), **f)) for n, f in v]


def down_variants_s5c():
    """--set s5c: down tile variants with stage_loads 3."""
    v = [("xs3_dn32w2", dict(down=tile(32, 256, 2, 3, 128))),
         ("xs3_dn64s4", dict(down=tile(64, 256, 4, 4, 128))),
         ("xs3_dn64s2", dict(down=tile(64, 256, 4, 2, 128))),
         ("xs3_dn_split4", dict(split_down=4)),
         ("xs3_dn128w4", dict(down=tile(128, 256, 4, 3, 128)))]
    return [(n, dict(dict(stage_loads=3), **f)) for n, f in v]


def gate_up_variants_s5d():
    """--set s5d: gate/up variants of the default (stage_loads 3) plan. sm_90a AOT (triton 3.9): the T = 1 gate/up grid
    (1536 programs of 2 warps, 54 registers, 9.5 KiB of shared memory) is 0.65 of a wave of ~23 warps per SM. Split
    4 with 2 stages and a 40-register cap: 3072 programs, 25 per SM, one wave of ~46 warps per SM (4 spill stores
    outside the K loop); uncapped (48 registers) it is 1.1 waves. ``gu_pf1``: each program first prefetches its own
    rows into L2. ``nofold`` (4 launches, no PDL) is there for the profile (``--profile-plans``): the down kernel
    without its fold epilogue, to tell its load waits from the fold's partial-sum reads."""
    v = [("gu_s4_s2_r40", dict(split_gate_up=4, gate_up=capped(tile(32, 256, 2, 2, 128), 40))),
         ("gu_s4_s2", dict(split_gate_up=4, gate_up=tile(32, 256, 2, 2, 128))),
         ("gu_pf1", dict(prefetch_gate_up=1)),
         ("nofold", dict(fold=False, pdl=False))]
    return [(n, dict(dict(stage_loads=3), **f)) for n, f in v]


def down_variants_s5d():
    """--set s5d: the down launch's overlap with gate/up, and down tiles. Every gate/up program is resident from the
    start (0.65 of a wave), and each SM keeps room for ~3 down programs (56 registers x 128 threads, 18 KiB). Released
    at gate/up's start (``pdl_release="start"``), down programs take that room at once and, with ``prefetch_down``,
    fetch their weights into L2 (DRAM is 56% busy in gate/up) before griddepcontrol.wait; 2 = evict_last, since
    gate/up streams 53 MB, more than L2, after them. Tiles (sm_90a AOT): split 1 (8 K steps per program instead of
    4: a pipeline that is not refilled every 4 steps) with 32 x 2 warps (768 programs, 56 registers) or 64 x 4 (384,
    48); split 4 with 64 x 4, 2 stages and a 40-register cap (1536 programs, one wave of ~46 warps per SM; 3 spill
    stores outside the loop); 2 stages (s5c's close alternative)."""
    start = dict(pdl_release="start")
    dn64s2 = dict(down=tile(64, 256, 4, 2, 128))
    v = [("rel_start", start),
         ("rel_start_pfd1", dict(start, prefetch_down=1)),
         ("rel_start_pfd2", dict(start, prefetch_down=2)),
         ("rel_start_pfd2_dn64s2", dict(start, prefetch_down=2, **dn64s2)),
         ("pfd1", dict(prefetch_down=1)),
         ("pfd2", dict(prefetch_down=2)),
         ("dn64s2", dn64s2),
         ("dn_split1_32w2", dict(split_down=1, down=tile(32, 256, 2, 3, 128))),
         ("dn_split1_64w4", dict(split_down=1)),
         ("dn_s4_s2_r40", dict(split_down=4, down=capped(tile(64, 256, 4, 2, 128), 40)))]
    return [(n, dict(dict(stage_loads=3), **f)) for n, f in v]


VARIANT_SETS = {"s5b": (gate_up_variants, down_variants), "s5c": (gate_up_variants_s5c, down_variants_s5c),
                "s5d": (gate_up_variants_s5d, down_variants_s5d)}
VARIANT_SET = "s5b"  # --set
NO_COMBO = {"nofold"}  # diagnostic variants: not combined with the other list's best


def _variants():
    gu_fn, dn_fn = VARIANT_SETS[VARIANT_SET]
    return gu_fn(), dn_fn()


def sweep_plans():
    """(name, config) of the one-factor sweep: each gate/up variant with the default down, each down variant with
    the default gate/up."""
    base = base_plan()
    gu, dn = _variants()
    return [(n, dict(base, **f)) for n, f in gu + dn]


def combo_plans(names):
    """The best gate/up variants x the best down variants (names from the sweep), as one plan each."""
    gu, dn = map(dict, _variants())
    base = base_plan()
    return [(f"{g}+{d}", {**base, **dn[d], **gu[g]})  # the gate/up variant's stage_loads wins
            for g in names["gate_up"] for d in names["down"]]


# ------------------------------------------------------------------------------------------------ precompile

def compile_jobs(plans, head_path):
    """[module ("mx" or the committed copy's path), plan name, config (None: the module's default), T, ids dtype]:
    every sweep plan at T = 1 with int32 ids first (the sweep needs them), then the integer specializations the
    checks use (T = 8: P = 48 is a multiple of 16; int64 ids), then the plans of the rounds at T = 16 and the
    committed kernel's defaults."""
    first = [["mx", n, c, 1, "int32"] for n, c in plans]
    rest = [["mx", n, c, t, d] for n, c in plans for t, d in ((1, "int64"), (8, "int32"), (8, "int64"))]
    extra = [["mx", "default16", None, 16, "int32"]] + [[head_path, "head", None, t, "int32"] for t in (1, 8, 16)]
    return first + extra + rest


def precompile_worker(index, workers, jobs_path):
    """Run each job of this worker's share once on uninitialized weights of the real shapes (the kernels' integer
    specializations and constexprs equal the main process's calls), filling Triton's on-disk cache."""
    with open(jobs_path) as f:
        jobs = json.load(f)[index::workers]
    dev = torch.device("cuda")
    h, i = bm.H, bm.I
    w13 = torch.empty(bm.E, 2 * i, h // 2, dtype=torch.uint8, device=dev)
    s13 = torch.full((bm.E, 2 * i, h // 32), 120, dtype=torch.uint8, device=dev)
    w2 = torch.empty(bm.E, h, i // 2, dtype=torch.uint8, device=dev)
    s2 = torch.full((bm.E, h, i // 32), 120, dtype=torch.uint8, device=dev)
    mods = {}
    for mod_name, name, cfg, t, dt in jobs:
        if mod_name not in mods:
            mods[mod_name] = mx if mod_name == "mx" else s5.load_head(mod_name)
        x, ids, wts = bm.make_routing(t, dev, seed=t)
        try:
            mods[mod_name].fused_moe_mxfp4(x, w13, s13, w2, s2, wts, ids.to(getattr(torch, dt)),
                                           swiglu_limit=bm.LIMIT, config=cfg, max_scale_byte=123,
                                           weight_layout=LAYOUT)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001  (the main process records the failure when it runs the plan)
            print("precompile failed", name, t, dt, repr(e)[:200], flush=True)


def start_workers(plans, head_path, n):
    path = os.path.join(tempfile.mkdtemp(), "compile_jobs.json")  # not under --out: only results go back
    with open(path, "w") as f:
        json.dump(compile_jobs(plans, head_path), f)
    return [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--precompile-worker", str(w),
                              "--workers", str(n), "--jobs-file", path]) for w in range(n)]


# ------------------------------------------------------------------------------------------------ checks

def full_check(name, cfg, p13, s13, p2, s2, w13, w2, msb, ts=(1, 4, 8)):
    """Correctness records of one plan (see the module docstring, step 2)."""
    recs = []
    for t in ts:
        x, ids, wts = bm.make_routing(t, torch.device("cuda"), seed=2000 + t)
        ids[0, -1] = -1
        ref = bm.fused_moe_mxfp4_reference(x, w13, s13, w2, s2, wts, ids, swiglu_limit=bm.LIMIT, dtype=torch.float32)
        for n_ids, idv in (("int32", ids), ("int64", ids.long())):
            try:
                _, c = s5.check(x, p13, s13, p2, s2, wts, idv, ref, cfg, msb, LAYOUT)
                _, c2 = s5.check(x, p13, s13, p2, s2, wts, idv, ref, cfg, msb, LAYOUT)
                c["second_call_rel_err"] = c2["rel_err"]
                c["nan"] |= c2["nan"]
            except Exception as e:  # noqa: BLE001
                c = dict(rel_err=float("inf"), nan=True, error=repr(e)[:300])
            c.update(T=t, plan=name, ids=n_ids)
            c["ok"] = c["rel_err"] <= 4e-3 and not c["nan"] and c.get("second_call_rel_err", 0) <= 4e-3
            recs.append(c)

        def eager(x2, i2, w2_, cfg=cfg):
            return mx.fused_moe_mxfp4(x2, p13, s13, p2, s2, w2_, i2, swiglu_limit=bm.LIMIT, config=cfg,
                                      max_scale_byte=msb, weight_layout=LAYOUT)
        try:
            ok = s5.graph_check(x, p13, s13, p2, s2, wts, ids, cfg, msb, eager)
        except Exception as e:  # noqa: BLE001
            ok = False
            print("graph check failed", name, t, repr(e)[:300], flush=True)
        recs.append(dict(T=t, plan=name, graph_replay_bitwise=ok, ok=ok))
    return recs


def quick_check(cfg, x, ids, wts, ref, p13, s13, p2, s2, msb):
    """One T = 1 call (int32 ids with a -1 slot) against the reference, before a sweep timing."""
    try:
        _, c = s5.check(x, p13, s13, p2, s2, wts, ids, ref, cfg, msb, LAYOUT)
        return c["rel_err"] <= 4e-3 and not c["nan"], c["rel_err"]
    except Exception as e:  # noqa: BLE001
        return False, repr(e)[:200]


# ------------------------------------------------------------------------------------------------ ncu

def ncu_target(cfg_json):
    """3 T = 1 calls of one plan on random weights (the first may compile): the process ncu profiles."""
    cfg = json.loads(cfg_json)
    dev = torch.device("cuda")
    w13, s13, w2, s2 = bm.make_weights(dev)
    p13, p2 = mx.prepare_mxfp4_weights_sm90(w13, w2)
    x, ids, wts = bm.make_routing(1, dev, seed=5)
    for _ in range(3):
        mx.fused_moe_mxfp4(x, p13, s13, p2, s2, wts, ids, swiglu_limit=bm.LIMIT, max_scale_byte=123, config=cfg,
                           weight_layout=LAYOUT)
    torch.cuda.synchronize()


def run_ncu(cfg, timeout_s, out_dir):
    """Nsight Compute sections of the second call's gate/up and down kernels; returns the report text."""
    ncu = shutil.which("ncu") or next(iter(sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"))), "ncu")
    cmd = [ncu, "--clock-control", "none", "--section", "SpeedOfLight", "--section", "Occupancy",
           "--section", "WarpStateStats", "--section", "LaunchStats", "--section", "MemoryWorkloadAnalysis",
           "-k", "regex:_gate_up_kernel|_down_kernel", "--launch-skip", "2", "--launch-count", "2",
           sys.executable, os.path.abspath(__file__), "--ncu-target", json.dumps(cfg)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        text = r.stdout + r.stderr
    except Exception as e:  # noqa: BLE001
        text = f"ncu failed: {e!r}"
    with open(os.path.join(out_dir, "ncu_t1.txt"), "w") as f:
        f.write(text)
    return text


# ------------------------------------------------------------------------------------------------ main

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--head", default=os.path.join(HERE, "_mxfp4_moe_s5b_head.py"))
    ap.add_argument("--budget", type=float, default=140.0, help="seconds; phases shrink or stop when they run out")
    ap.add_argument("--ts", default="1,4,8,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--top", type=int, default=3)
    ap.add_argument("--workers", type=int, default=14)
    ap.add_argument("--baseline", action="store_true")
    ap.add_argument("--ncu-after", action="store_true")
    ap.add_argument("--precompile-worker", type=int, default=None)
    ap.add_argument("--jobs-file", default="")
    ap.add_argument("--ncu-target", default="")
    ap.add_argument("--set", default="s5b", choices=sorted(VARIANT_SETS),
                    help="the sweep's variants: s5b (16 weight rows per warp), s5c (stage_loads), s5d (PDL overlap, "
                         "one-wave splits)")
    ap.add_argument("--profile-plans", default="", help="comma-separated sweep plans also profiled in step 4")
    ap.add_argument("--tag", default="s5b", help="results file mxfp4_moe_<tag>.json")
    args = ap.parse_args()
    global VARIANT_SET
    VARIANT_SET = args.set
    if args.precompile_worker is not None:
        return precompile_worker(args.precompile_worker, args.workers, args.jobs_file)
    if args.ncu_target:
        return ncu_target(args.ncu_target)

    t0 = time.time()
    deadline = t0 + args.budget
    os.makedirs(args.out, exist_ok=True)
    head = s5.load_head(args.head)
    sweep = [("default", base_plan())] + sweep_plans()
    workers = start_workers(sweep, args.head, args.workers) if args.workers > 0 else []
    dev = torch.device("cuda")
    ts = [int(v) for v in args.ts.split(",")]
    res = dict(device=torch.cuda.get_device_name(),
               date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
               torch=torch.__version__, triton=triton.__version__, command=" ".join(["python"] + sys.argv),
               expert_bytes=bm.EXPERT_BYTES, hbm_floor_bps=bm.HBM_BPS, rot_sets=bm.ROT, head=args.head,
               sweep_plans={n: c for n, c in sweep})
    path = os.path.join(args.out, f"mxfp4_moe_{args.tag}.json")

    def save():
        res["wall_s"] = time.time() - t0
        with open(path, "w") as f:
            json.dump(res, f, indent=1)

    def left():
        return deadline - time.time()

    w13, s13, w2, s2 = bm.make_weights(dev)
    msb = mx.mxfp4_max_scale_byte(s13, s2)
    p13, p2 = mx.prepare_mxfp4_weights_sm90(w13, w2)
    torch.backends.cuda.matmul.allow_tf32 = False
    for w in workers:  # the compiles, in parallel; a worker still busy past this point only costs a duplicate
        try:
            w.wait(timeout=max(1.0, min(60.0, left() - 90)))
        except subprocess.TimeoutExpired:
            pass
    res["precompile_s"] = time.time() - t0
    print(f"precompile done at {res['precompile_s']:.1f} s", flush=True)

    # 1. sweep at T = 1
    sets1 = [bm.make_routing(1, dev, seed=7 + r) for r in range(bm.ROT)]
    outs1 = [torch.empty(1, bm.H, dtype=torch.bfloat16, device=dev) for _ in range(bm.ROT)]

    def calls(mod, a, b, sets, outs, cfg=None, layout=LAYOUT):
        return [lambda i=i: mod.fused_moe_mxfp4(sets[i][0], a, s13, b, s2, sets[i][2], sets[i][1],
                                                swiglu_limit=bm.LIMIT, out=outs[i], config=cfg,
                                                max_scale_byte=msb, weight_layout=layout)
                for i in range(bm.ROT)]
    xq, iq, wq = bm.make_routing(1, dev, seed=99)
    iq[0, -1] = -1
    refq = bm.fused_moe_mxfp4_reference(xq, w13, s13, w2, s2, wq, iq, swiglu_limit=bm.LIMIT, dtype=torch.float32)
    res["sweep"] = {}

    def sweep_one(name, cfg):
        ok, err = quick_check(cfg, xq, iq, wq, refq, p13, s13, p2, s2, msb)
        us = float("nan")
        if ok:
            try:
                us = bm.bench_graph(calls(mx, p13, p2, sets1, outs1, cfg), 25)
            except Exception as e:  # noqa: BLE001
                err = repr(e)[:200]
                ok = False
        res["sweep"][name] = dict(us=us, quick_ok=ok, quick_err=err)
        print(f"sweep {name:36s} {us:7.2f} us  ok={ok} err={err}", flush=True)

    for name, cfg in sweep:
        if name != "default" and left() < 75:
            res["sweep_truncated"] = name
            break
        sweep_one(name, cfg)
    good = {n: v["us"] for n, v in res["sweep"].items() if v["quick_ok"] and v["us"] == v["us"]}
    gu_v, dn_v = _variants()
    best_gu = sorted((v, n) for n, v in good.items() if n in dict(gu_v) and n not in NO_COMBO)[:2]
    best_dn = sorted((v, n) for n, v in good.items() if n in dict(dn_v))[:2]
    combos = combo_plans(dict(gate_up=[n for _, n in best_gu], down=[n for _, n in best_dn]))
    all_plans = dict(sweep)
    for name, cfg in combos:
        if left() < 65:
            res["sweep_truncated"] = name
            break
        all_plans[name] = cfg
        sweep_one(name, cfg)
    good = {n: v["us"] for n, v in res["sweep"].items() if v["quick_ok"] and v["us"] == v["us"] and n != "default"}
    best = min(good, key=good.get) if good else None
    # the fastest plan as a PDL dependent of gate/up (where it is not one already)
    if best and all_plans[best].get("fold") and not all_plans[best].get("pdl") and left() > 62:
        all_plans[best + "+pdl"] = dict(all_plans[best], pdl=True)
        sweep_one(best + "+pdl", all_plans[best + "+pdl"])
        good = {n: v["us"] for n, v in res["sweep"].items()
                if v["quick_ok"] and v["us"] == v["us"] and n != "default"}
    top = [n for _, n in sorted((v, n) for n, v in good.items())[:args.top]]
    res["top"] = top
    save()

    # 2. full correctness of the default and the top plans
    res["correctness"] = []
    for name in ["default"] + top:
        recs = full_check(name, all_plans[name], p13, s13, p2, s2, w13, w2, msb)
        res["correctness"] += recs
        print("correct", name, all(r["ok"] for r in recs),
              max((r.get("rel_err", 0) for r in recs), default=0), flush=True)
    bad = {r["plan"] for r in res["correctness"] if not r["ok"]}
    res["correct_all_ok"] = not bad
    top = [n for n in top if n not in bad]
    save()

    # 3. rounds (no compile worker may still run kernels beside them: the ones left are ended, by their handles)
    res["workers_ended_before_rounds"] = s5.end_workers(workers)
    res["timing"] = []
    lut = bm._lut_pairs(dev)
    for n_t, t in enumerate(ts):
        t_deadline = time.time() + max(0.0, left() - 22) / (len(ts) - n_t)
        sets = sets1 if t == 1 else [bm.make_routing(t, dev, seed=7 * t + r) for r in range(bm.ROT)]
        row = bm.floor_row(t, sets)
        floor = row["floor_us_4p3"]
        outs = [torch.empty(t, bm.H, dtype=torch.bfloat16, device=dev) for _ in range(bm.ROT)]
        timed = {"head": calls(head, p13, p2, sets, outs), "default": calls(mx, p13, p2, sets, outs)}
        if t * K <= 48:
            timed.update({n: calls(mx, p13, p2, sets, outs, all_plans[n]) for n in top})
        s5.interleaved_rounds(row, timed, args.rounds, t_deadline, floor)
        row["configs"] = {n: (head.default_config(t * K, LAYOUT) if n == "head" else
                              mx.default_config(t * K, LAYOUT) if n == "default" else all_plans[n]) for n in timed}
        if args.baseline and left() > 15:
            bm.time_baseline(row, sets, (w13, s13, w2, s2), lut, rep=60)
        res["timing"].append(row)
        save()
        print("time", t, json.dumps({k: row[k] for k in ("median_us", "pct_floor")}), flush=True)

    # 4. T = 1 kernel profile
    res["profile_t1"] = {}
    if 1 in ts:
        extra = [n for n in args.profile_plans.split(",") if n and n in all_plans and n not in top]
        for name in ["head", "default"] + top + extra:
            if left() < 4:
                break
            fns = calls(head, p13, p2, sets1, outs1) if name == "head" else \
                calls(mx, p13, p2, sets1, outs1, None if name == "default" else all_plans[name])
            try:
                res["profile_t1"][name] = s5.kernel_profile(fns)
            except Exception as e:  # noqa: BLE001
                res["profile_t1"][name] = dict(error=repr(e)[:300])
            print("profile", name, json.dumps(res["profile_t1"][name]), flush=True)
    save()

    # 5. ncu of the fastest plan at T = 1 (a child process), if time is left
    if args.ncu_after and top and left() > 20:
        t1 = next((r for r in res["timing"] if r["T"] == 1), None)
        best = min(top, key=lambda n: t1["median_us"].get(n, float("inf"))) if t1 else top[0]
        res["ncu_plan"] = best
        text = run_ncu(all_plans[best], max(10.0, left() + 12), args.out)
        res["ncu_lines"] = [ln for ln in text.splitlines() if any(
            k in ln for k in ("_kernel", "Duration", "DRAM Throughput", "Compute (SM) Throughput", "Achieved Occupancy",
                              "Theoretical Occupancy", "Registers Per", "Warp Cycles Per Issued", "Memory Throughput",
                              "Waves Per SM", "Block Limit"))]
    save()

    print(f"\n{res['device']} correctness ok: {res['correct_all_ok']}  wall {time.time() - t0:.0f} s  top {top}")
    for ln in res.get("ncu_lines", [])[:40]:
        print("ncu", ln.strip())
    s5.print_summary(res, name_width=34)
    print("wrote", path)


if __name__ == "__main__":
    main()
