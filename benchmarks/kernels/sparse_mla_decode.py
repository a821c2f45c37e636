"""Device benchmark for pd.kernels.sparse_mla_decode (run on the GPU machine, not in CI).

  python benchmarks/kernels/sparse_mla_decode.py [--out DIR] [--quick] [--full-sweep | --sweep-set sm90_candidates]
      [--baseline PATH] [--precompile N]

1. correctness at real shapes (topk 512/2048, H 16/64/128, S 1/2/4, page 64/256, -1 slots, topk_length,
   attn_sink, extra cache) against the fp64 torch reference: ||out - ref_bf16|| / ||ref|| and max |lse - ref|;
2. timing (median of CUDA-graph replays, 4 input sets cycled so KV is not served from L2) for B in
   {1,16,64,128}, H in {16,64}, S in {1,2}, topk 512, page 64: ours (the default path, and the best of a sweep:
   the default path's alternatives, i.e. every pipelined / sm_90-only config and the original kernel, or with
   --full-sweep every autotune config x topk splits) vs the default path of another version of the kernel file
   (--baseline, same run) vs FlashMLA's sm_90 sparse decode (sgl-flash-mla wheel, if importable) vs
   SGLang's per-(batch, head) Triton sm_120 kernel (file from the pip-installed sglang, path in
   $SGLANG_SM120_TRITON, if present; q_len 1 only) vs the HBM byte floor (selected KV bytes + q + out +
   indices at 4.8 TB/s);
   plus CUDA-graph capture safety: a captured call replayed on fresh inputs gives the eager result (bitwise);
   ``--precompile N`` first builds every kernel of the run in N processes (the device has 16 cores);
3. writes sparse_mla_decode.json (device, date, commit, command, every number) and sparse_mla_decode.md (the
   timing table) to --out, the names of benchmarks/results/.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_modules import kernel_module  # noqa: E402  (pd.kernels installed or not)
from results_io import md_header, run_info, write_result  # noqa: E402  (this folder, put on the path above)

_smd = kernel_module("sparse_mla_decode")
_ref = kernel_module("sparse_mla_reference")
CONFIGS, CONFIGS_PIPELINED, CONFIGS_SM90, DEFAULT_CONFIG = (_smd.CONFIGS, _smd.CONFIGS_PIPELINED, _smd.CONFIGS_SM90,
                                                            _smd.DEFAULT_CONFIG)
TWO_PER_SM_CONFIG_16, sparse_mla_decode = _smd.TWO_PER_SM_CONFIG_16, _smd.sparse_mla_decode
BYTES_PER_TOKEN, quantize_kv, sparse_mla_decode_ref = _ref.BYTES_PER_TOKEN, _ref.quantize_kv, _ref.sparse_mla_decode_ref

HBM_BPS = 4.8e12


def make_inputs(b, s, h, topk, page_size, pool_tokens, dev, *, holes=False, lengths=False, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    pages = triton.cdiv(pool_tokens, page_size)
    kv = torch.randn(pages * page_size, 512, generator=g) * 0.5
    kc = quantize_kv(kv, page_size).to(dev)
    q = torch.randn(b, s, h, 512, generator=g).to(torch.bfloat16).to(dev)
    # distinct tokens per (b, s) row, like a real top-k (large pools: the topk of uniform draws on the GPU, in row
    # chunks, instead of a CPU randperm per row, which took seconds at B=128 S=2)
    n_tok = pages * page_size
    if n_tok > 100_000 and dev.type == "cuda":
        gd = torch.Generator(device=dev).manual_seed(seed)
        idx = torch.cat([torch.rand(min(64, b * s - r), n_tok, generator=gd, device=dev).topk(topk, 1).indices.cpu()
                         for r in range(0, b * s, 64)])
    else:
        idx = torch.stack([torch.randperm(n_tok, generator=g)[:topk] for _ in range(b * s)])
    idx = idx.view(b, s, topk).to(torch.int32)
    if holes:
        idx[torch.rand(idx.shape, generator=g) < 0.1] = -1
    tl_len = None
    if lengths:
        tl_len = torch.randint(0, topk + 1, (b,), generator=g, dtype=torch.int32)
        tl_len[0] = 0
        tl_len[-1] = topk
        tl_len = tl_len.to(dev)
    return q, kc, idx.to(dev), tl_len


def view4(kc, page_size):
    """FlashMLA's (pages, page_size, 1, 584) view of the packed (pages, page_stride) byte buffer."""
    return kc[:, : page_size * BYTES_PER_TOKEN].view(kc.shape[0], page_size, 1, BYTES_PER_TOKEN)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def lse_err(a, b):
    fin = torch.isfinite(b)
    same_inf = torch.equal(torch.isinf(a), torch.isinf(b))
    d = (a[fin] - b[fin]).abs().max().item() if fin.any() else 0.0
    return d if same_inf else float("inf")


# sm_90 candidates timed next to the default (``--sweep-set sm90_candidates``) and checked in ``correctness``, per
# heads per program: (name, config); "x2" / "x4" = two programs per SM with the split count for two / four, "x1" = one
# per SM. All lost to the shipped defaults on the H200 (benchmarks/results/sparse_mla_decode.md).
SM90_CANDIDATES = {
    16: [("pipe3x2_bh16_n64_w8", {"BLOCK_N": 64, "num_warps": 8, "num_stages": 1, "PIPELINE": 3, "PROGRAMS_PER_SM": 2}),
         ("pipe3x4_bh16_n64_w8", {"BLOCK_N": 64, "num_warps": 8, "num_stages": 1, "PIPELINE": 3, "PROGRAMS_PER_SM": 4}),
         ("pipe5x2_bh16_n32_w8", {"BLOCK_N": 32, "num_warps": 8, "num_stages": 1, "PIPELINE": 5, "PROGRAMS_PER_SM": 2}),
         ("pipe3x1_bh16_n64_w8", {"BLOCK_N": 64, "num_warps": 8, "num_stages": 1, "PIPELINE": 3}),
         ("pipe3x1_bh16_n64_w16", {"BLOCK_N": 64, "num_warps": 16, "num_stages": 1, "PIPELINE": 3})],
    64: [("pipe3_bh64_n64_w16", {"BLOCK_N": 64, "num_warps": 16, "num_stages": 1, "PIPELINE": 3}),
         ("pipe3_bh64_n32_w16", {"BLOCK_N": 32, "num_warps": 16, "num_stages": 1, "PIPELINE": 3})],
}
CORRECTNESS_CASES = [
    (512, 16, 1, 64, False), (512, 64, 2, 64, True), (512, 128, 4, 256, False),
    (2048, 16, 2, 256, True), (2048, 64, 1, 64, False), (2048, 128, 2, 64, False),
    (2048, 64, 4, 256, True), (512, 64, 1, 256, False),
]


def correctness_variants(h, quick, sm90):
    """(block_h, num_splits, config) of one correctness case: the default path at default / 1 / 4 splits, 64-head
    programs forced, sm_120's 16-head configs forced, and on sm_90 the 16-head SM90_CANDIDATES forced."""
    variants = [(None, ns, None) for ns in ((None, 1, 4) if not quick else (None, 4))]
    if h % 64 == 0:
        variants += [(64, None, None), (64, 1, None)]
    variants += [(16, None, TWO_PER_SM_CONFIG_16), (16, None, DEFAULT_CONFIG[16])]
    if sm90:
        variants += [(bh, None, c) for bh, cands in SM90_CANDIDATES.items() if h % bh == 0 and (bh == 64 or h == 16)
                     for _, c in cands]
    return variants


def _config_name(cfg):
    if cfg is None:
        return None
    if cfg is TWO_PER_SM_CONFIG_16:
        return "two_per_sm_16"
    if cfg is DEFAULT_CONFIG[16]:
        return "sm120_16"
    return next(n for cands in SM90_CANDIDATES.values() for n, c in cands if c is cfg)


def correctness(dev, fm=None, quick=False, only=None):
    """Every correctness case (or only the (case index, variant index) pair ``only``, to compile it elsewhere)."""
    cases = []
    sm90 = torch.cuda.get_device_capability(dev)[0] == 9
    for ci, (topk, h, s, ps, extra) in enumerate(CORRECTNESS_CASES):
        if only is not None and only[0] != ci:
            continue
        b = 3
        q, kc, idx, tl_len = make_inputs(b, s, h, topk, ps, 8 * topk, dev, holes=True, lengths=True,
                                         seed=topk + h + s)
        sink = torch.randn(h, device=dev)
        kw = dict(topk_length=tl_len, attn_sink=sink)
        rkw = dict(kw)
        if extra:
            _, ekc, eidx, etl = make_inputs(b, s, h, 128, 64, 1024, dev, holes=True, lengths=True, seed=7)
            kw.update(extra_k_cache=view4(ekc, 64), extra_indices=eidx, extra_topk_length=etl)
            rkw.update(extra_k_cache=ekc, extra_indices=eidx, extra_topk_length=etl, extra_page_size=64)
        for vi, (bh, ns, cfg) in enumerate(correctness_variants(h, quick, sm90)):
            if only is not None and only[1] != vi:
                continue
            candidate = _config_name(cfg) not in (None, "two_per_sm_16", "sm120_16")
            try:
                out, lse = sparse_mla_decode(q, view4(kc, ps), idx, num_splits=ns, block_h=bh, config=cfg, **kw)
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001  (a candidate that does not build is reported, not fatal)
                if not candidate:
                    raise
                cases.append(dict(topk=topk, H=h, S=s, config=_config_name(cfg), candidate=True, ok=False,
                                  error=repr(e)[:300]))
                print("correct", cases[-1], flush=True)
                continue
            ro, rl = sparse_mla_decode_ref(q, kc, idx, page_size=ps, **rkw)
            c = dict(topk=topk, H=h, S=s, page_size=ps, extra=extra, num_splits=ns, block_h=bh,
                     config=_config_name(cfg), candidate=candidate,
                     rel_err_vs_ref_bf16=rel(out, ro.to(torch.bfloat16)), rel_err_vs_ref_fp64=rel(out, ro),
                     lse_max_abs_err=lse_err(lse, rl), nan=bool(torch.isnan(out).any()))
            c["meets_2e-3"] = c["rel_err_vs_ref_fp64"] <= 2e-3
            c["ok"] = c["rel_err_vs_ref_fp64"] <= 2.5e-3 and c["lse_max_abs_err"] <= 1e-3 and not c["nan"]
            if fm is not None and ns is None and bh is None and cfg is None and h in (64, 128):
                try:
                    fwk, gmeta = fm
                    fkw = dict(topk_length=tl_len, attn_sink=sink)
                    if extra:
                        fkw.update(extra_k_cache=kw["extra_k_cache"], extra_indices_in_kvcache=eidx,
                                   extra_topk_length=etl)
                    fo, fl = fwk(q, view4(kc, ps), None, None, 512, gmeta()[0], indices=idx, use_legacy=True, **fkw)
                    c["flashmla_rel_err_vs_ref_fp64"] = rel(fo, ro)
                    c["flashmla_lse_max_abs_err"] = lse_err(fl, rl)
                except Exception as e:  # noqa: BLE001
                    c["flashmla_error"] = repr(e)[:200]
            cases.append(c)
            print("correct", c, flush=True)
    return cases


def graph_replay_check(dev):
    """CUDA-graph capture safety of the default path: capture one call (split programs + the combine launch, a
    programmatic dependent launch on compute capability >= 9), copy fresh inputs into the captured input buffers,
    replay, and compare with an eager call on those inputs (bitwise: same kernels, same order), three replays in a
    row. -> one dict per case (H, B, S, max abs difference of out and finite lse, ok)."""
    res = []
    for h, b, s in ((16, 64, 1), (16, 1, 1), (64, 16, 1), (16, 64, 2), (64, 1, 1)):
        topk, ps = 512, 64
        q, kc, idx, ln = make_inputs(3 * b, s, h, topk, ps, 16384, dev, holes=True, lengths=True, seed=11 + b)
        kc4 = view4(kc, ps)
        sink = torch.randn(h, device=dev)
        sq, sidx, sln = q[:b].clone(), idx[:b].clone(), ln[:b].clone()
        sparse_mla_decode(sq, kc4, sidx, topk_length=sln, attn_sink=sink)  # compile outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            go, gl = sparse_mla_decode(sq, kc4, sidx, topk_length=sln, attn_sink=sink)
        diffs = []
        for r in (1, 2, 1):
            sl = slice(r * b, (r + 1) * b)
            sq.copy_(q[sl])
            sidx.copy_(idx[sl])
            sln.copy_(ln[sl])
            g.replay()
            eo, el = sparse_mla_decode(q[sl], kc4, idx[sl], topk_length=ln[sl], attn_sink=sink)
            torch.cuda.synchronize()
            fin = torch.isfinite(el)
            diffs.append(max((go.float() - eo.float()).abs().max().item(),
                             (gl[fin] - el[fin]).abs().max().item() if fin.any() else 0.0,
                             float(not torch.equal(torch.isinf(gl), torch.isinf(el)))))
        res.append(dict(H=h, B=b, S=s, max_abs_diff=max(diffs), ok=max(diffs) == 0.0))
        print("graph replay", res[-1], flush=True)
        del g
    return res


def load_flashmla():
    try:
        import flash_mla  # noqa: F401
        from flash_mla import flash_mla_with_kvcache, get_mla_metadata
        return flash_mla_with_kvcache, get_mla_metadata
    except Exception as e:  # noqa: BLE001
        print("FlashMLA unavailable:", repr(e)[:300], flush=True)
        return None


def load_sglang_triton():
    path = os.environ.get("SGLANG_SM120_TRITON")
    if not path or not os.path.exists(path):
        return None
    spec = importlib.util.spec_from_file_location("sgl_sm120_triton", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.flash_mla_sparse_decode_triton


ROT = 4  # input sets cycled inside one timed graph, so repeated runs do not read KV from L2 (50 MB)


def bench(fn, quick):
    """Median us per call of fn(i) for i in range(ROT), timed as one CUDA graph (no host overhead)."""
    for i in range(ROT):
        fn(i)  # compile / autotune / metadata before capture
    torch.cuda.synchronize()
    t = triton.testing.do_bench_cudagraph(lambda: [fn(i) for i in range(ROT)], rep=20 if quick else 40,
                                          return_mode="median")
    return t * 1e3 / ROT


def load_baseline(path):
    """sparse_mla_decode from another version of kernels/sparse_mla_decode (the package folder, e.g. of ``git
    worktree add /tmp/base HEAD``, or the single file of older trees), imported as its own package next to this
    checkout's reference and device_info modules, for same-run side-by-side timing."""
    import shutil
    import tempfile

    d = tempfile.mkdtemp()
    pkg = os.path.join(d, "baseline_kernels")
    os.makedirs(pkg)
    kdir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "kernels")
    for f in ("sparse_mla_reference.py", "device_info.py"):
        shutil.copy(os.path.join(kdir, f), pkg)
    if os.path.isdir(path):
        shutil.copytree(path, os.path.join(pkg, "sparse_mla_decode"), ignore=shutil.ignore_patterns("__pycache__"))
    else:
        shutil.copy(path, os.path.join(pkg, "sparse_mla_decode.py"))
    open(os.path.join(pkg, "__init__.py"), "w").close()
    sys.path.insert(0, d)
    return importlib.import_module("baseline_kernels.sparse_mla_decode").sparse_mla_decode


def sweep_variants(h, b, s, quick, full, sm90, sweep_set="default"):
    """(name, sparse_mla_decode kwargs) timed next to the default path. ``full``: every autotune config of the
    original kernel x topk splits (None, 1, 4) for 16/32/64 heads per program, plus every pipelined and sm_90-only
    config; ``sweep_set="sm90_candidates"``: on sm_90 the SM90_CANDIDATES configs (16- or 64-head programs for
    H=16 / H=64 rows) at B=16/64/128 S=1 and B=64 S=2; otherwise the default path's alternatives: each pipelined /
    sm_90-only config and the original kernel's default config, at the default split count."""
    out = []
    if sweep_set == "sm90_candidates":
        if sm90 and (s, b) in ((1, 16), (1, 64), (1, 128), (2, 64)):
            out = [(name, dict(block_h=h, config=c)) for name, c in SM90_CANDIDATES[h]]
        return out
    splits = (None, 1, 4) if full and not quick else (None,)
    for bh in (16, 32, 64):
        if h % bh:
            continue
        plain = ([dict(BLOCK_N=c.kwargs["BLOCK_N"], num_warps=c.num_warps, num_stages=c.num_stages)
                  for c in CONFIGS[bh]] if full else [{k: v for k, v in DEFAULT_CONFIG[bh].items()
                                                       if k not in ("PIPELINE", "PROGRAMS_PER_SM")}])
        if not full and DEFAULT_CONFIG[bh].get("PIPELINE"):
            plain = [dict(BLOCK_N=32, num_warps=8, num_stages=1)]  # the original kernel's former default
        for c in plain:
            for ns in splits:
                out.append((f"bh{bh}_n{c['BLOCK_N']}_w{c['num_warps']}_s{ns}",
                            dict(block_h=bh, num_splits=ns, config=c)))
        for c in CONFIGS_PIPELINED.get(bh, []) + (CONFIGS_SM90.get(bh, []) if sm90 else []):
            tag = f"pipe{c['PIPELINE']}" if c.get("PIPELINE") else "chunked"
            tag += "x2" if c.get("PROGRAMS_PER_SM") else ""
            for ns in ((None, 1) if full and not quick else (None,)):
                out.append((f"{tag}_bh{bh}_n{c['BLOCK_N']}_w{c['num_warps']}_s{ns}",
                            dict(block_h=bh, num_splits=ns, config=c)))
    return out


TIMING_ROWS = [(h, s, b) for h in (16, 64) for s in (1, 2) for b in (1, 16, 64, 128)]


def _precompile_job(job):
    """Worker process: run one correctness (case, variant) or one timing call once on small inputs, so every kernel
    the main process runs is in Triton's on-disk cache (device compiles take seconds each; 16 cores do them at
    once)."""
    kind, args, baseline, sweep_set = job
    dev = torch.device("cuda")
    try:
        if kind == "correct":
            correctness(dev, only=args)
        else:
            h, s, b, which, kw = args
            q, kc, idx, _ = make_inputs(b, s, h, 512, 64, 16384, dev, seed=1)
            if which == "sglang":
                load_sglang_triton()(q, view4(kc, 64), idx, None, None, 512, 512 ** -0.5)
            else:
                (load_baseline(baseline) if which == "baseline" else sparse_mla_decode)(q, view4(kc, 64), idx, **kw)
        torch.cuda.synchronize()
        return None
    except Exception as e:  # noqa: BLE001  (the main process runs it again and reports)
        return f"{kind} {args}: {e!r}"[:300]


def precompile(dev, workers, quick, baseline, sweep_set, full_sweep, with_sglang):
    """Compile the kernels of the whole run in ``workers`` spawned processes first. -> (seconds, errors)."""
    import concurrent.futures as cf
    import multiprocessing as mp

    sm90 = torch.cuda.get_device_capability(dev)[0] == 9
    jobs = [("correct", (ci, vi), baseline, sweep_set) for ci, c in enumerate(CORRECTNESS_CASES)
            for vi in range(len(correctness_variants(c[1], quick, sm90)))]
    for h, s, b in TIMING_ROWS:
        jobs.append(("time", (h, s, b, "ours", {}), baseline, sweep_set))
        if baseline:
            jobs.append(("time", (h, s, b, "baseline", {}), baseline, sweep_set))
        if with_sglang and s == 1 and b in (1, 16, 64):
            jobs.append(("time", (h, s, b, "sglang", {}), baseline, sweep_set))
        jobs += [("time", (h, s, b, name, kw), baseline, sweep_set)
                 for name, kw in sweep_variants(h, b, s, quick, full_sweep, sm90, sweep_set)]
    t = time.time()
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
        errs = [e for e in ex.map(_precompile_job, jobs) if e]
    print(f"precompiled {len(jobs)} jobs in {time.time() - t:.1f} s, errors: {errs}", flush=True)
    return time.time() - t, errs


def compiled_facts(mod=None, extra=()):
    """Registers, spills, shared memory and pipelining markers (cp.async, wgmma, async_wait depths) of every
    sparse-MLA kernel compiled in this process, and of the ``extra`` kernels (alternatives an A/B run timed).
    Occupancy: two programs per SM need <= 128 registers at 8 warps, <= 115712 bytes of shared memory on sm_90."""
    mod = mod or _smd
    facts = []
    names = ("_sparse_mla_fwd_pipelined_kernel", "_sparse_mla_fwd_chunked_kernel", "_sparse_mla_fwd_kernel",
             "_combine_kernel")
    fns = [(n, getattr(mod, n)) for n in names] + [(getattr(k, "__name__", "alt"), k) for k in extra]
    for name, fn in fns:
        arg_names = getattr(fn, "arg_names", [])
        for dc in getattr(fn, "device_caches", {}).values():
            cache = dc[0] if isinstance(dc, tuple) else dc
            for k in cache.values():
                try:
                    k._init_handles()
                except Exception:  # noqa: BLE001
                    pass
                c = getattr(getattr(k, "src", None), "constants", None) or getattr(k, "constants", None) or {}
                # constants are keyed by argument index tuples, e.g. (22,): name them
                named = {(arg_names[a[0]] if isinstance(a, tuple) and len(a) == 1 and a[0] < len(arg_names)
                          else str(a)): v for a, v in dict(c).items() if isinstance(v, (int, float, str, bool))}
                ptx, ttgir = k.asm.get("ptx", ""), k.asm.get("ttgir", "")
                facts.append(dict(kernel=name, constants=named,
                                  num_warps=k.metadata.num_warps, n_regs=getattr(k, "n_regs", None),
                                  n_spills=getattr(k, "n_spills", None), shared=k.metadata.shared,
                                  wgmma=ptx.count("wgmma.mma_async"), cp_async=ptx.count("cp.async.c"),
                                  async_waits=[ln.split("num = ")[1].split(" ")[0] for ln in ttgir.splitlines()
                                               if "async_wait" in ln and "num = " in ln]))
    return facts


def timing(dev, quick, fm, sgl, full_sweep=False, budget_s=float("inf"), baseline=None, on_row=None,
           sweep_set="default"):
    """Time every (H, S, B) row (see the module docstring); ``on_row(rows)`` is called after each row (the caller
    saves partial results, so a run stopped at a device limit keeps the rows it finished)."""
    t_start = time.time()
    sm90 = torch.cuda.get_device_capability(dev)[0] == 9
    rows = []
    for h, s, b in TIMING_ROWS:
        topk, ps = 512, 64
        q, kc, idx, _ = make_inputs(ROT * b, s, h, topk, ps, max(16384, ROT * b * s * topk * 5 // 4),
                                    dev, seed=b + h)
        kc4 = view4(kc, ps)
        qs = [q[i * b:(i + 1) * b] for i in range(ROT)]
        ids = [idx[i * b:(i + 1) * b] for i in range(ROT)]
        floor_bytes = b * s * topk * BYTES_PER_TOKEN + 2 * b * s * h * 512 * 2 + b * s * topk * 4
        row = dict(B=b, H=h, S=s, topk=topk, page_size=ps,
                   floor_us=floor_bytes / HBM_BPS * 1e6, bytes=floor_bytes)
        out, _ = sparse_mla_decode(qs[0], kc4, ids[0])
        row["ours_default_us"] = bench(lambda i: sparse_mla_decode(qs[i], kc4, ids[i]), quick)
        if baseline is not None:
            row["baseline_us"] = bench(lambda i: baseline(qs[i], kc4, ids[i]), quick)
        best = (row["ours_default_us"], "default")
        sweep = {}
        for key, kw in sweep_variants(h, b, s, quick, full_sweep, sm90, sweep_set):
            if time.time() - t_start > budget_s:
                row["sweep_stopped"] = "budget"
                break
            try:
                t = bench(lambda i: sparse_mla_decode(qs[i], kc4, ids[i], **kw), quick)
            except Exception as e:  # noqa: BLE001
                print("variant failed", key, repr(e)[:200], flush=True)
                continue
            sweep[key] = t
            if t < best[0]:
                best = (t, key)
        row["ours_best_us"], row["ours_best_variant"] = best
        row["sweep_us"] = sweep
        if fm is not None:
            fwk, gmeta = fm
            try:
                metas = [gmeta()[0] for _ in range(ROT)]
                fo, fl = fwk(qs[0], kc4, None, None, 512, metas[0], indices=ids[0], use_legacy=True)
                row["flashmla_vs_ours_rel"] = rel(out, fo)
                row["flashmla_us"] = bench(
                    lambda i: fwk(qs[i], kc4, None, None, 512, metas[i], indices=ids[i], use_legacy=True),
                    quick)
            except Exception as e:  # noqa: BLE001
                row["flashmla_error"] = repr(e)[:200]
        if sgl is not None and s == 1 and b in (1, 16, 64):
            try:
                so, _ = sgl(qs[0], kc4, ids[0], None, None, 512, 512 ** -0.5)
                row["sglang_triton_vs_ours_rel"] = rel(out, so)
                row["sglang_triton_us"] = bench(
                    lambda i: sgl(qs[i], kc4, ids[i], None, None, 512, 512 ** -0.5), True)
            except Exception as e:  # noqa: BLE001
                row["sglang_triton_error"] = repr(e)[:200]
        rows.append(row)
        if on_row is not None:
            on_row(rows)
        print("time", {k: v for k, v in row.items() if k != "sweep_us"}, flush=True)
    return rows


def copy_gbps(dev) -> float:
    """Device-to-device copy bandwidth of a 1 GiB buffer, GB/s (read + write)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() / (ms * 1e-3) / 1e9


def table_md(res) -> list[str]:
    """The .md of a run: its header and one timing row per case."""
    nan = float("nan")
    lines = md_header("Sparse-MLA decode (DeepSeek-V4 FP8 pages)", res)
    lines += [f"Copy bandwidth {res['copy_GBps']:.0f} GB/s; correctness all ok: {res.get('correct_all_ok')}; "
              f"baseline: {res.get('baseline_file')}", "",
              "| B | H | S | floor µs | ours µs | best µs | best variant | baseline µs | FlashMLA µs | "
              "SGLang Triton µs |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res.get("timing", []):
        lines.append(f"| {r['B']} | {r['H']} | {r['S']} | {r['floor_us']:.1f} | {r['ours_default_us']:.2f} | "
                     f"{r['ours_best_us']:.2f} | {r['ours_best_variant']} | {r.get('baseline_us', nan):.2f} | "
                     f"{r.get('flashmla_us', nan):.2f} | {r.get('sglang_triton_us', nan):.1f} |")
    return lines


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-correctness", action="store_true")
    ap.add_argument("--full-sweep", action="store_true",
                    help="time every autotune config x topk splits too (~5 min on an H200)")
    ap.add_argument("--sweep-budget-s", type=float, default=float("inf"),
                    help="stop adding sweep variants once the timing part has run this long")
    ap.add_argument("--baseline", help="another version of kernels/sparse_mla_decode (the package folder, or the "
                    "single file of older trees) whose default path is timed in the same run")
    ap.add_argument("--sweep-set", default="default", choices=["default", "sm90_candidates"],
                    help="sm90_candidates: the SM90_CANDIDATES configs (sm_90) as the sweep")
    ap.add_argument("--precompile", type=int, default=0,
                    help="compile every kernel of the run in this many processes first (device: 16 cores)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    t0 = time.time()
    res = dict(run_info(), torch=torch.__version__, triton=triton.__version__, hbm_floor_bps=HBM_BPS)
    res["copy_GBps"] = copy_gbps(dev)
    fm = load_flashmla()
    if args.precompile:
        res["precompile_s"], res["precompile_errors"] = precompile(
            dev, args.precompile, args.quick, args.baseline, args.sweep_set, args.full_sweep,
            load_sglang_triton() is not None)
    if not args.skip_correctness:
        res["correctness"] = correctness(dev, fm, args.quick)
        res["graph_replay"] = graph_replay_check(dev)
        # the default path and its forced configs; the candidates are reported per config
        res["correct_all_ok"] = all(c["ok"] for c in res["correctness"] + res["graph_replay"] if not c.get("candidate"))
        res["candidates_ok"] = {n: all(c["ok"] for c in res["correctness"] if c.get("config") == n)
                                for n in {c["config"] for c in res["correctness"] if c.get("candidate")}}
    res["baseline_file"] = args.baseline

    def save(rows=None):
        if rows is not None:
            res["timing"] = rows
        res["wall_s"] = time.time() - t0
        return write_result(args.out, "sparse_mla_decode", res, table_md(res))

    save()
    res["t_before_timing_s"] = time.time() - t0
    res["timing"] = timing(dev, args.quick, fm, load_sglang_triton(), args.full_sweep, args.sweep_budget_s,
                           load_baseline(args.baseline) if args.baseline else None, on_row=save,
                           sweep_set=args.sweep_set)
    try:
        res["compiled"] = compiled_facts()
    except Exception as e:  # noqa: BLE001  (diagnostics only: never lose the timing table to them)
        res["compiled_error"] = repr(e)[:300]
    path = save()
    print(f"\n{res['device']}  copy {res['copy_GBps']:.0f} GB/s  correctness ok: {res.get('correct_all_ok')}")
    print(f"{'B':>4} {'H':>3} {'S':>2} {'floor':>7} {'ours':>8} {'best':>8} {'baseline':>9} {'flashmla':>9} "
          f"{'sglang':>9}  best variant")
    for r in res["timing"]:
        print(f"{r['B']:>4} {r['H']:>3} {r['S']:>2} {r['floor_us']:7.1f} {r['ours_default_us']:8.1f} "
              f"{r['ours_best_us']:8.1f} {r.get('baseline_us', float('nan')):9.1f} "
              f"{r.get('flashmla_us', float('nan')):9.1f} "
              f"{r.get('sglang_triton_us', float('nan')):9.1f}  {r['ours_best_variant']}")
    print("wrote", path)


if __name__ == "__main__":
    main()
