"""Device benchmark for pd.kernels.mxfp4_moe (run on the GPU machine, not in CI).

  python benchmarks/kernels/mxfp4_moe.py [--out DIR] [--budget SECONDS] [--no-sweep]
  ncu ... python benchmarks/kernels/mxfp4_moe.py --profile T [--profile-variant NAME]   # one plan, for a profiler

DeepSeek-V4-Flash draft MoE shapes: 256 experts, top-6, hidden 4096, moe intermediate 2048, MXFP4 weights
(random e2m1 bytes and UE8M0 scales), bf16 hidden states, SwiGLU clamp 10, uniformly random distinct experts per
token (the most distinct experts, i.e. the most weight bytes, a routing can touch).
1. correctness at real shapes, T in {1, 16, 64, 128}, every path (pair_token, pair with and without K splits,
   sorted), -1 slots and int64 ids included: ||out - ref|| / ||ref|| against the torch reference (dequantize,
   fp32 matmuls with TF32 off, the kernel's bf16 rounding points); output buffer NaN-poisoned first;
2. timing (median of CUDA-graph replays via triton.testing.do_bench_cudagraph; ROT routing/input sets cycled
   inside the graph so the weights come from HBM, not L2): the default plan (twice: the run-to-run spread),
   per-stage times of the default plan, a sweep over paths, K splits and tile configs,
   the sweep's fastest plan timed again on its own, and the dequantize-to-bf16 + torch grouped-matmul baseline
   in the same run (events; it synchronizes for torch.unique);
3. the weight-bandwidth floor: bytes of the distinct routed experts' weights + scales (+ activations) at
   4.3 TB/s (docs/design.md's figure) and at the copy bandwidth measured here; % of floor = floor / time;
4. writes mxfp4_moe.json (device, date, commit, versions, command, every number) and mxfp4_moe.md (the timing
   table) to --out, the names of benchmarks/results/.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_modules import kernel_module  # noqa: E402  (pd.kernels installed or not)
from results_io import md_header, run_info, write_result  # noqa: E402  (this folder, put on the path above)

mx = kernel_module("mxfp4_moe")
fused_moe_mxfp4_reference = kernel_module("mxfp4_moe_reference").fused_moe_mxfp4_reference

E, H, I, K = 256, 4096, 2048, 6
LIMIT = 10.0
HBM_BPS = 4.3e12
ROT = 4
TS = (1, 16, 64, 128)
EXPERT_BYTES = 2 * I * H // 2 + 2 * I * H // 32 + H * I // 2 + H * I // 32  # w13 + scales + w2 + scales


def make_weights(dev, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    w13 = torch.randint(0, 256, (E, 2 * I, H // 2), generator=g, device=dev, dtype=torch.uint8)
    s13 = torch.randint(120, 124, (E, 2 * I, H // 32), generator=g, device=dev, dtype=torch.uint8)
    w2 = torch.randint(0, 256, (E, H, I // 2), generator=g, device=dev, dtype=torch.uint8)
    s2 = torch.randint(116, 120, (E, H, I // 32), generator=g, device=dev, dtype=torch.uint8)
    return w13, s13, w2, s2


def make_routing(t, dev, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(t, H, generator=g).to(torch.bfloat16).to(dev)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)]).to(torch.int32).to(dev)
    wts = torch.rand(t, K, generator=g).to(dev)
    return x, ids, wts / wts.sum(1, keepdim=True)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _tile(bn, bk, w, st, bk_dot=None):
    return mx.MoETile(BN=bn, BK=bk, num_warps=w, num_stages=st, BK_DOT=bk_dot)


def _tile_name(c):
    return f"{c.BN}k{c.BK}{'' if c.BK_DOT is None else 'd%d' % c.BK_DOT}w{c.num_warps}s{c.num_stages}"


def variants(t):
    """(name, config) pairs timed for T tokens: the default, then plans around it: BK per pipeline stage vs BK_DOT
    per dequantize + dot step (fewer live registers, more blocks per SM), K splits at T = 1."""
    out = [("default", mx.default_config(t * K))]

    def add(path, sg, sd, gu, dn, halves=True):
        name = f"{path}_s{sg}x{sd}{'_halves' if halves else ''}_gu{_tile_name(gu)}_dn{_tile_name(dn)}"
        out.append((name, mx.MoEPlan(path=path, BM=16, split_gate_up=sg, split_down=sd, gate_up_halves=halves,
                                     gate_up=gu, down=dn)))

    t64, t128 = _tile(64, 128, 2, 3), _tile(128, 128, 2, 3)
    g256d128, g512d128, g256d64 = _tile(64, 256, 2, 3, 128), _tile(64, 512, 2, 2, 128), _tile(64, 256, 2, 3, 64)
    if t <= 4:
        for gu in (g256d128, g512d128, g256d64, _tile(64, 256, 2, 4, 128)):
            add("pair", 4, 2, gu, t64)
        for sg in (2, 8):
            add("pair", sg, 2, g256d128, t64)
        add("pair", 2, 2, g512d128, t64)
        for dn in (g256d128, g512d128, g256d64, _tile(128, 256, 2, 3, 64)):
            add("pair", 4, 2, g256d128, dn)
        add("pair", 4, 1, g256d128, g512d128)
        add("pair", 4, 4, g256d128, g256d128)
        add("pair", 4, 2, _tile(128, 256, 4, 3, 128), t64)
    else:
        for gu in (g256d128, g512d128, g256d64, _tile(128, 256, 4, 3, 128), _tile(64, 512, 2, 3, 128)):
            add("sorted", 1, 1, gu, t128)
        for dn in (g256d128, g512d128, _tile(128, 256, 2, 3, 64), _tile(128, 512, 2, 2, 128), g256d64):
            add("sorted", 1, 1, g256d128, dn)
            add("sorted", 1, 1, g512d128, dn)
    return out


def bench_graph(fns, rep_ms):
    """Median us per call of one input set: fns[i]() for i in range(ROT) captured in one graph."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    ms = triton.testing.do_bench_cudagraph(lambda: [f() for f in fns], rep=rep_ms, return_mode="median")
    return ms * 1e3 / len(fns)


# ------------------------------------------------------------------------------------- dequantize + torch baseline

def _lut_pairs(dev):
    """byte -> int32 holding the two bf16 e2m1 values (low nibble in the low half)."""
    vals = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    bits = vals.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    b = torch.arange(256)
    return (bits[b & 15] | (bits[b >> 4] << 16)).to(torch.int32).to(dev)


def dequant_bf16(packed, scale, lut):
    """[G, N, K/2] e2m1 + [G, N, K/32] UE8M0 -> [G, N, K] bf16 (torch ops, exact)."""
    g, n, kh = packed.shape
    v = torch.index_select(lut, 0, packed.reshape(-1).to(torch.int32)).view(torch.bfloat16).view(g, n, 2 * kh)
    s = torch.exp2(scale.to(torch.float32) - 127).to(torch.bfloat16).repeat_interleave(32, dim=-1)
    return v * s


def _gmm(a, w, offs, bounds):
    """a [M, K] (rows grouped by expert) @ w[g]^T per group: torch._grouped_mm when it runs, else mm per group."""
    if hasattr(torch, "_grouped_mm") and a.is_cuda:
        try:
            return torch._grouped_mm(a, w.transpose(1, 2), offs=offs), "torch._grouped_mm"
        except (RuntimeError, TypeError):
            pass
    return torch.cat([a[s:e] @ w[j].T for j, (s, e) in enumerate(bounds)]), "torch.mm per expert"


def floor_row(t, sets):
    """The timing row of T = ``t`` tokens, with its weight-bandwidth floor over the routing ``sets`` [(x, ids, wts)]:
    distinct experts (mean over the sets), bytes (those experts' weights + scales, bf16 activations in and out, ids
    and routing weights) and floor_us_4p3 = bytes / HBM_BPS in microseconds."""
    distinct = sum(torch.unique(ids).numel() for _, ids, _ in sets) / len(sets)
    nbytes = distinct * EXPERT_BYTES + 2 * t * H * 2 + t * K * 8
    return dict(T=t, distinct_experts=distinct, floor_bytes=nbytes, floor_us_4p3=nbytes / HBM_BPS * 1e6)


def time_baseline(row, sets, weights, lut, rep):
    """Time the anchor (``baseline_moe``, dequantize + torch grouped matmuls) on ``sets[0]`` for ``rep`` ms: sets
    row["baseline_impl"] and row["baseline_us"] (median, microseconds); returns its output [T, H] bf16."""
    (x, ids, wts), (w13, s13, w2, s2) = sets[0], weights
    out, row["baseline_impl"] = baseline_moe(x, w13, s13, w2, s2, wts, ids, lut)
    row["baseline_us"] = triton.testing.do_bench(lambda: baseline_moe(x, w13, s13, w2, s2, wts, ids, lut), rep=rep,
                                                 return_mode="median") * 1e3
    return out


def baseline_moe(x, w13, s13, w2, s2, wts, ids, lut, chunk=16):
    """Dequantize the distinct routed experts to bf16, then torch grouped matmuls (torch._grouped_mm when it is
    there, else one mm per expert); SwiGLU with the same clamp and rounding; weighted sum over k."""
    t, k = ids.shape
    uniq, inv = torch.unique(ids.long(), return_inverse=True)
    order = torch.argsort(inv.view(-1), stable=True)
    tok = order // k
    counts = torch.bincount(inv.view(-1), minlength=uniq.numel())
    ends = torch.cumsum(counts, 0)
    a = x[tok]
    out = torch.zeros(t, H, dtype=torch.float32, device=x.device)
    wsorted = wts.reshape(-1)[order].float()
    starts = (ends - counts).tolist()
    endl = ends.tolist()
    for c0 in range(0, uniq.numel(), chunk):
        sel = uniq[c0:c0 + chunk]
        r0, r1 = starts[c0], endl[min(c0 + chunk, uniq.numel()) - 1]
        wgu = dequant_bf16(w13[sel], s13[sel], lut)
        wd = dequant_bf16(w2[sel], s2[sel], lut)
        offs = (ends[c0:c0 + chunk] - r0).to(torch.int32)
        bounds = [(s - r0, e - r0) for s, e in zip(starts[c0:c0 + chunk], endl[c0:c0 + chunk])]
        gu, impl = _gmm(a[r0:r1], wgu, offs, bounds)
        gate, up = gu[:, :I].float().clamp(max=LIMIT), gu[:, I:].float().clamp(-LIMIT, LIMIT)
        hh = (gate * torch.sigmoid(gate) * up).to(torch.bfloat16)
        y, _ = _gmm(hh, wd, offs, bounds)
        out.index_add_(0, tok[r0:r1], y.float() * wsorted[r0:r1, None])
    return out.to(torch.bfloat16), impl


# ---------------------------------------------------------------------------------------------------- runs

def correctness(dev, weights, ts):
    w13, s13, w2, s2 = weights
    msb = mx.mxfp4_max_scale_byte(s13, s2)
    torch.backends.cuda.matmul.allow_tf32 = False
    cases = []
    for t in ts:
        x, ids, wts = make_routing(t, dev, seed=1000 + t)
        ids[0, -1] = -1  # a skipped slot (expert on another rank)
        kinds, plans = set(), [("default", None)]
        for n, c in variants(t)[1:]:  # the first variant of each path / split / halves kind
            kind = (c.path, c.split_gate_up > 1, c.split_down > 1, c.gate_up_halves, c.dequant,
                    c.gate_up.BK_DOT is not None, c.down.BK_DOT is not None)
            if kind not in kinds:
                kinds.add(kind)
                plans.append((n, c))
        ref = fused_moe_mxfp4_reference(x, w13, s13, w2, s2, wts, ids, swiglu_limit=LIMIT, dtype=torch.float32)
        for name, cfg in plans:
            out = torch.full((t, H), float("nan"), dtype=torch.bfloat16, device=dev)
            mx.fused_moe_mxfp4(x, w13, s13, w2, s2, wts, ids.long() if name == "default" else ids,
                               swiglu_limit=LIMIT, out=out, config=cfg, max_scale_byte=msb)
            torch.cuda.synchronize()
            c = dict(T=t, plan=name, rel_err=rel(out, ref), nan=bool(torch.isnan(out).any()),
                     dequant=(cfg or mx.default_config(t * K)).dequant)
            c["ok"] = c["rel_err"] <= 4e-3 and not c["nan"]
            cases.append(c)
            print("correct", c, flush=True)
    return cases


def timing(dev, weights, deadline, sweep, ts, save):
    w13, s13, w2, s2 = weights
    msb = mx.mxfp4_max_scale_byte(s13, s2)
    lut = _lut_pairs(dev)
    rows = []
    for n_t, t in enumerate(ts):
        t_deadline = time.time() + (deadline - time.time()) / (len(ts) - n_t)  # an equal share of what is left
        sets = [make_routing(t, dev, seed=7 * t + r) for r in range(ROT)]
        row = floor_row(t, sets)
        outs = [torch.empty(t, H, dtype=torch.bfloat16, device=dev) for _ in range(ROT)]

        def call(cfg):
            return [lambda i=i: mx.fused_moe_mxfp4(sets[i][0], w13, s13, w2, s2, sets[i][2], sets[i][1],
                                                   swiglu_limit=LIMIT, out=outs[i], config=cfg, max_scale_byte=msb)
                    for i in range(ROT)]

        row["default_config"] = mx.default_config(t * K).as_dict()
        row["ours_us"] = bench_graph(call(None), 60)
        row["ours_us_again"] = bench_graph(call(None), 60)  # the default timed twice: the run-to-run spread
        # stages of the default plan (each timed alone over the same ROT sets; inputs from a full run)
        plans = [mx._plan(sets[i][0], w13, s13, w2, s2, sets[i][2], sets[i][1], LIMIT, None, False, outs[i], None,
                          msb) for i in range(ROT)]
        for _, st in plans:
            for _, f in st:
                f()
        row["stages_us"] = {name: bench_graph([plans[i][1][j][1] for i in range(ROT)], 30)
                            for j, (name, _) in enumerate(plans[0][1])}
        sw = {}
        if sweep:
            for name, cfg in variants(t)[2:]:
                if time.time() > t_deadline:
                    row["sweep_truncated"] = True
                    break
                try:
                    sw[name] = bench_graph(call(cfg), 25)
                except Exception as e:  # noqa: BLE001
                    sw[name] = repr(e)[:200]
                    print("variant failed", t, name, sw[name], flush=True)
        row["sweep_us"] = sw
        good = {"default": row["ours_us"], **{k: v for k, v in sw.items() if isinstance(v, float)}}
        best = min(good.items(), key=lambda kv: kv[1])
        row["best_variant"], row["best_us"] = best
        if best[0] != "default":  # the sweep's winner timed on its own, as the default was
            best_plan = dict(variants(t))[best[0]]
            row["best_config"] = best_plan.as_dict()
            row["best_retimed_us"] = bench_graph(call(best_plan), 60)
        b = time_baseline(row, sets, weights, lut, rep=120 if t < 64 else 250)
        x, ids, wts = sets[0]
        o = mx.fused_moe_mxfp4(x, w13, s13, w2, s2, wts, ids, swiglu_limit=LIMIT, max_scale_byte=msb)
        row["baseline_vs_ours_rel"] = rel(o, b)
        rows.append(row)
        save()
        print("time", {k: v for k, v in row.items() if k != "sweep_us"}, flush=True)
        ranked = sorted(((v, k) for k, v in good.items()))[:6]
        print("fastest", t, [(k, round(v, 1)) for v, k in ranked], flush=True)
    return rows


def profile_once(t, config=None):
    """For a profiler (ncu): ``config`` (default: the default plan) at T tokens, 3 calls (the first compiles)."""
    dev = torch.device("cuda")
    w13, s13, w2, s2 = make_weights(dev)
    x, ids, wts = make_routing(t, dev, seed=5)
    msb = mx.mxfp4_max_scale_byte(s13, s2)
    for _ in range(3):
        mx.fused_moe_mxfp4(x, w13, s13, w2, s2, wts, ids, swiglu_limit=LIMIT, max_scale_byte=msb, config=config)
    torch.cuda.synchronize()


def _finish(res):
    for r in res.get("timing", []):
        r["floor_us_copy"] = r["floor_bytes"] / (res["copy_GBps"] * 1e9) * 1e6
        r["pct_floor_4p3"] = 100 * r["floor_us_4p3"] / r["ours_us"]
        r["pct_floor_4p3_best"] = 100 * r["floor_us_4p3"] / r["best_us"]
        r["speedup_vs_baseline"] = r["baseline_us"] / r["ours_us"]


def copy_gbps(dev) -> float:
    """Device-to-device copy bandwidth of a 1 GiB buffer, GB/s (read + write)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() / (ms * 1e-3) / 1e9


def table_md(res) -> list[str]:
    """The .md of a run: its header and one timing row per T."""
    lines = md_header("MXFP4 MoE (DeepSeek-V4-Flash draft shapes)", res)
    lines += [f"Copy bandwidth {res['copy_GBps']:.0f} GB/s; correctness all ok: {res.get('correct_all_ok')}", "",
              "| T | distinct experts | floor µs (4.3 TB/s) | ours µs | % of floor | best variant µs | best variant | "
              "dequantize + grouped_mm µs | x |", "|---|---|---|---|---|---|---|---|---|"]
    for r in res.get("timing", []):
        lines.append(f"| {r['T']} | {r['distinct_experts']:.1f} | {r['floor_us_4p3']:.1f} | {r['ours_us']:.1f} | "
                     f"{r['pct_floor_4p3']:.1f} | {r['best_us']:.1f} | {r['best_variant']} | {r['baseline_us']:.1f} | "
                     f"{r['speedup_vs_baseline']:.1f} |")
    return lines


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget", type=float, default=200.0, help="seconds; the sweeps stop when they run out")
    ap.add_argument("--ts", default=",".join(map(str, TS)), help="token counts, comma-separated")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--skip-correctness", action="store_true")
    ap.add_argument("--profile", type=int, default=0, help="only run the default plan at this T (for ncu)")
    ap.add_argument("--profile-variant", default=None, help="with --profile: a variant name of that T instead")
    args = ap.parse_args()
    if args.profile:
        cfg = dict(variants(args.profile))[args.profile_variant] if args.profile_variant else None
        return profile_once(args.profile, cfg)
    t0 = time.time()
    ts = [int(v) for v in args.ts.split(",")]
    dev = torch.device("cuda")
    res = dict(run_info(), torch=torch.__version__, triton=triton.__version__,
               shapes=dict(E=E, H=H, I=I, topk=K, swiglu_limit=LIMIT), expert_bytes=EXPERT_BYTES,
               hbm_floor_bps=HBM_BPS, rot_sets=ROT)
    res["copy_GBps"] = copy_gbps(dev)
    weights = make_weights(dev)

    def save():  # after every phase, so a run stopped at its time limit still leaves its numbers
        res["wall_s"] = time.time() - t0
        _finish(res)
        return write_result(args.out, "mxfp4_moe", res, table_md(res))

    if not args.skip_correctness:
        res["correctness"] = correctness(dev, weights, ts)
        res["correct_all_ok"] = all(c["ok"] for c in res["correctness"])
        save()
    res["timing"] = []
    res["timing"] = timing(dev, weights, t0 + args.budget, not args.no_sweep, ts, save)
    path = save()
    print(f"\n{res['device']}  copy {res['copy_GBps']:.0f} GB/s  correctness ok: {res.get('correct_all_ok')}")
    print(f"{'T':>4} {'experts':>7} {'floor':>7} {'ours':>8} {'%floor':>6} {'best':>8} {'%':>5} "
          f"{'baseline':>9} {'x':>6}  stages / best variant")
    for r in res["timing"]:
        st = " ".join(f"{k}={v:.1f}" for k, v in r["stages_us"].items())
        print(f"{r['T']:>4} {r['distinct_experts']:7.1f} {r['floor_us_4p3']:7.1f} {r['ours_us']:8.1f} "
              f"{r['pct_floor_4p3']:6.1f} {r['best_us']:8.1f} "
              f"{r['pct_floor_4p3_best']:5.1f} {r['baseline_us']:9.1f} {r['speedup_vs_baseline']:6.1f}  {st} / "
              f"{r['best_variant']}")
    print("wrote", path)


if __name__ == "__main__":
    main()
