"""The speculative loop's model work on a GPU at DeepSeek-V4-Flash-like shapes, and the same ratios on the CPU
benchmark target: what the CPU's target / draft cost ratio stands for.

  python3 benchmarks/spec_model_work_gpu.py gpu [--out DIR] [--batches 1 4 16 64] [--windows 1 2 4 6]
  .venv/bin/python benchmarks/spec_model_work_gpu.py cpu      # this machine: builtin:tiny and builtin:deep
  TRITON_INTERPRET=1 .venv/bin/python benchmarks/spec_model_work_gpu.py gpu --smoke --device cpu   # API check

One EAGLE/MTP verify step (SGLang's EAGLE worker, ``--speculative-eagle-topk 1``) runs ``num_steps - 1`` chained
draft forwards of one token per sequence, one target forward over the verify window (``num_steps + 1`` tokens per
sequence) and one draft extend over the accepted tokens; speculation off runs one target forward of one token per
sequence per token. So the ratios that decide its gain are target(1) / draft(1) and target(window) / target(1).

``gpu``: one CUDA graph per (batch, window) of each forward, timed by graph replays (median of CUDA events):
  - target: embedding, 43 layers, final norm, LM head (129280 x 4096 bf16) and a greedy argmax over every token.
    A layer: the dense projections as bf16 stand-ins with the bytes of DeepSeek-V4's FP8 ones (q_a, q_b, kv, o,
    shared expert, indexer projections: ``dsv4_profile.DENSE_PARAMS`` ~112M parameters = ~112 MB, read as two
    [4096, 6784] matrices: half the FLOPs of FP8, the same bytes, and decode is bound by bytes); the router gate
    (4096 x 256) + softmax + top-6; the routed MoE by ``pd.kernels``' MXFP4 kernel (256 experts, top-6, moe
    intermediate 2048, the sm90_tiled layout; routing: uniformly random distinct experts per token, the most
    weight bytes a routing can touch); sparse-MLA decode by ``pd.kernels`` (64 heads, topk 512 of a 584 B/token
    FP8 KV pool); on 21 of the 43 layers (the C4 layers, ``dsv4_profile.C4_LAYERS``) the DSA indexer by
    ``pd.kernels`` (64 heads, fp8 query, topk 512 over 2048 live compressed positions, an 8K context).
  - draft (DeepSeek-V4's MTP layer, sglang/srt/models/deepseek_v4_nextn.py): e_proj and h_proj (4096 x 4096 FP8
    each, same stand-ins), one decoder layer with compress ratio 0 (sliding-window attention: sparse-MLA over 128
    tokens, no indexer) and the routed MoE, shared_head norm, its LM head (129280 x 4096) and argmax.
  Weights: two target layer sets (dense + experts, 3.5 GB each) alternate over the layers and the draft has a
  third, so no layer reads weights the previous one left in L2 (50 MB); each layer has its own routing, attention
  indices and index-cache pages. One GPU, no tensor parallelism: TP splits the target and the draft alike.
``cpu``: the reference engine's own forwards (ModelRunner.forward_hidden, DraftModel.forward, one sequence, torch
  on one thread as the benchmarks run the engines) after a 64-token context, target and draft called in turn; the
  CPU is shared, so the fastest of the calls (the cost without preemption) gives the ratios, the median is kept.

Writes benchmarks/results/spec_model_work_gpu.json (``gpu`` and ``cpu`` sections, each written by its own run) and
spec_model_work_gpu.md (rendered from both).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "kernels"))
import dsv4_profile as V4  # noqa: E402  (this folder, put on the path above)

RESULT = HERE / "results" / "spec_model_work_gpu"
CPU_CONTEXT = 64  # tokens already in the cache when the CPU forwards are timed
DEPTHS = (1, 3, 5)  # the fixed depths benchmarks/speculative.py sweeps (verify windows 2, 4, 6)


@dataclass(frozen=True)
class Dims:
    """The modelled shapes (DeepSeek-V4-Flash: dsv4_profile's constants from the pinned SGLang's config)."""

    layers: int = V4.LAYERS
    hidden: int = V4.HIDDEN
    vocab: int = V4.VOCAB
    experts: int = V4.EXPERTS
    topk: int = V4.TOPK
    moe_inter: int = V4.MOE_INTER
    dense_cols: int = 6784  # two [hidden, cols] bf16 matrices = DENSE_PARAMS bytes (FP8), rounded to 128
    heads: int = V4.HEADS
    attn_topk: int = 512
    draft_window: int = 128  # the MTP layer's sliding window (compress ratio 0)
    kv_pool_tokens: int = 1 << 18  # 150 MB of FP8 KV: per-layer random rows miss L2
    index_live: int = 2048  # compressed positions of an 8K context (C4)
    index_max: int = 4096
    c4_every: int = 2  # layers 1, 3, ..., 41: 21 C4 layers
    weight_sets: int = 2

    @classmethod
    def smoke(cls) -> "Dims":
        """Small enough for the Triton interpreter on a CPU (shapes the kernels accept)."""
        return cls(layers=2, vocab=1024, experts=8, moe_inter=256, dense_cols=256, kv_pool_tokens=4096,
                   index_live=256, index_max=512)


# ---------------------------------------------------------------------------------------------------- GPU model
class V4Work:
    """Weights and per-shape inputs of the stand-in target and draft (module docstring), on ``dev``."""

    def __init__(self, d: Dims, dev):
        import torch
        from kernel_modules import kernel_module

        self.d, self.dev, self.torch = d, dev, torch
        self.mx = kernel_module("mxfp4_moe")
        self.mla = kernel_module("sparse_mla_decode")
        self.idx = kernel_module("indexer")
        mla_ref, idx_ref = kernel_module("sparse_mla_reference"), kernel_module("indexer_reference")
        g = torch.Generator(device=dev).manual_seed(0)
        h, e, i = d.hidden, d.experts, d.moe_inter

        def bf16(*shape, std=0.02):
            return (torch.randn(*shape, device=dev, generator=g) * std).to(torch.bfloat16)

        def u8(lo, hi, *shape):
            return torch.randint(lo, hi, shape, device=dev, generator=g, dtype=torch.uint8)

        def layer_set():
            # random e2m1 bytes in any layout are random e2m1 bytes: no prepare step needed for timing;
            # scale bytes <= 128 let the kernel's sm_90 bit dequantization run (max_scale_byte below)
            return {"wu": bf16(h, d.dense_cols), "wd": bf16(d.dense_cols, h), "gate": bf16(h, e),
                    "w13": u8(0, 256, e, 2 * i, h // 2), "s13": u8(120, 124, e, 2 * i, h // 32),
                    "w2": u8(0, 256, e, h, i // 2), "s2": u8(116, 120, e, h, i // 32)}

        self.sets = [layer_set() for _ in range(d.weight_sets)]
        self.draft_set = layer_set()
        self.draft_set["eh"] = bf16(2 * h, h // 2)  # e_proj + h_proj: 2 x hidden^2 FP8 bytes
        self.embed = bf16(d.vocab, h, std=1.0)
        self.lm_head = bf16(d.vocab, h)
        self.layout = "sm90_tiled" if dev.type == "cuda" and torch.cuda.get_device_capability(dev)[0] == 9 \
            else "sglang"
        # KV pool: 4096 quantized tokens tiled to kv_pool_tokens (distinct addresses, so distinct L2 lines)
        page = 64
        base = mla_ref.quantize_kv(torch.randn(min(4096, d.kv_pool_tokens), 512) * 0.5, page).to(dev)
        self.kv = base.repeat(d.kv_pool_tokens // (base.shape[0] * page), 1).contiguous()
        self.kv_tokens = self.kv.shape[0] * page
        self.index_pages = 4 * 64 * d.index_max // 64  # room for 4 disjoint page sets of 64 requests
        kc = idx_ref.quantize_index_k(torch.randn(64 * 64, 128, device=dev, generator=g), 64)
        self.index_cache = kc.repeat(self.index_pages // kc.shape[0] + 1, 1)[: self.index_pages].contiguous()

    # -- per-shape inputs -----------------------------------------------------------------------------------
    def inputs(self, batch: int, window: int) -> dict:
        """Everything a forward of ``batch`` sequences x ``window`` tokens reads besides the weights."""
        torch, d, dev = self.torch, self.d, self.dev
        g = torch.Generator(device="cpu").manual_seed(batch * 100 + window)
        t = batch * window
        route = []
        for _ in range(d.layers + 1):  # the last one is the draft layer's
            ids = torch.stack([torch.randperm(d.experts, generator=g)[: d.topk] for _ in range(t)]).to(torch.int32)
            w = torch.rand(t, d.topk, generator=g)
            route.append((ids.to(dev), (w / w.sum(1, keepdim=True)).to(dev)))
        attn = [torch.randint(0, self.kv_tokens, (t, 1, d.attn_topk), generator=g, dtype=torch.int32).to(dev)
                for _ in range(d.layers)]
        start = torch.randint(0, self.kv_tokens - d.draft_window * t, (1,), generator=g).item()
        draft_attn = (start + torch.arange(t * d.draft_window, dtype=torch.int32)).view(t, 1, -1).to(dev)
        pages = d.index_max // 64
        tables = []
        for k in range(4):  # four disjoint page sets, cycled over the C4 layers
            perm = torch.randperm(self.index_pages // 4, generator=g)[: batch * pages] + k * (self.index_pages // 4)
            tables.append(perm.view(batch, pages).to(torch.int32).to(dev))
        return {
            "batch": batch, "window": window,
            "ids": torch.randint(3, d.vocab, (t,), generator=g).to(dev),
            "hidden": (torch.randn(t, d.hidden, generator=g)).to(torch.bfloat16).to(dev),
            "q": (torch.randn(t, 1, d.heads, 512, generator=g) * 0.1).to(torch.bfloat16).to(dev),
            "iq": (torch.randn(batch, window, 64, 128, generator=g) * 40).to(dev).to(torch.float8_e4m3fn),
            "iw": (torch.randn(batch, window, 64, generator=g) / 64).to(dev),
            "seq_lens": torch.full((batch,), d.index_live, dtype=torch.int32, device=dev),
            "route": route, "attn": attn, "draft_attn": draft_attn, "tables": tables,
        }

    # -- forwards -------------------------------------------------------------------------------------------
    def _norm(self, x):
        torch = self.torch
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)

    def _layer(self, x, w, inp, route, attn_idx, table):
        torch = self.torch
        h = self._norm(x)
        if table is not None:  # C4 layer: the indexer picks the compressed positions the attention reads
            self.idx.dsa_indexer_topk(inp["iq"], inp["iw"], self.index_cache, table, inp["seq_lens"], topk=512)
        self.mla.sparse_mla_decode(inp["q"], self.kv, attn_idx)
        x = x + (h @ w["wu"]) @ w["wd"]
        h = self._norm(x)
        torch.topk(torch.softmax((h @ w["gate"]).float(), -1), self.d.topk, dim=-1)  # the router's cost
        ids, wts = route
        moe = self.mx.fused_moe_mxfp4(h, w["w13"], w["s13"], w["w2"], w["s2"], wts, ids, swiglu_limit=10.0,
                                      max_scale_byte=123, weight_layout=self.layout)
        return x + moe

    def target(self, inp):
        """One target forward over every sequence's window: greedy token ids [batch * window]."""
        x = self.embed[inp["ids"]]
        for layer in range(self.d.layers):
            c4 = layer % self.d.c4_every == 1
            x = self._layer(x, self.sets[layer % len(self.sets)], inp, inp["route"][layer], inp["attn"][layer],
                            inp["tables"][(layer // 2) % 4] if c4 else None)
        return (self._norm(x) @ self.lm_head.T).argmax(-1)

    def draft(self, inp):
        """One MTP draft forward over the same tokens (each with the previous hidden state): greedy ids."""
        torch = self.torch
        w = self.draft_set
        u = torch.cat((self._norm(self.embed[inp["ids"]]), self._norm(inp["hidden"])), -1)
        x = (u[:, : self.d.hidden] @ w["eh"][: self.d.hidden]) @ w["eh"][self.d.hidden:].T  # 2 x [h, h/2] reads
        x = self._layer(x, w, inp, inp["route"][-1], inp["draft_attn"], None)
        return (self._norm(x) @ self.lm_head.T).argmax(-1)


def time_forward(work: V4Work, fn, inp, reps: int) -> float:
    """Median microseconds of ``fn(inp)``: CUDA-graph replays timed with events (eager on a CPU)."""
    torch = work.torch
    if work.dev.type != "cuda":
        t0 = time.perf_counter()
        fn(inp)
        return (time.perf_counter() - t0) * 1e6
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # compile and warm up outside the capture
            fn(inp)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(inp)
    graph.replay()
    torch.cuda.synchronize()
    if not bool((out >= 0).all() and (out < work.d.vocab).all()):
        raise RuntimeError("a forward's argmax is out of the vocabulary")
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    del graph
    return statistics.median(times)


def run_gpu(args) -> dict:
    """Time target and draft forwards at every (batch, window); returns the ``gpu`` section."""
    import torch

    dev = torch.device(args.device)
    d = Dims.smoke() if args.smoke else Dims()
    t_start = time.perf_counter()
    work = V4Work(d, dev)
    rows = []
    for batch, window in [(b, w) for b in args.batches for w in args.windows]:
        if time.perf_counter() - t_start > args.budget:
            print(f"budget of {args.budget} s spent: batch {batch} window {window} and later not timed")
            break
        inp = work.inputs(batch, window)
        row = {"batch": batch, "window": window, "tokens": batch * window,
               "target_us": time_forward(work, work.target, inp, args.reps),
               "draft_us": time_forward(work, work.draft, inp, args.reps)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        del inp
    import results_io

    info = results_io.run_info()
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        info["device"] = f"{p.name} ({p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB), " \
                         f"torch {torch.__version__}"
    return {**info, "dims": asdict(d), "moe_layout": work.layout, "smoke": args.smoke, "rows": rows,
            "wall_s": time.perf_counter() - t_start}


# ---------------------------------------------------------------------------------------------------- CPU target
def run_cpu(args) -> dict:
    """Time the reference engine's target and draft forwards of each built-in model; returns the ``cpu`` section."""
    import torch

    from pd.engines.models.builtin_draft import ensure_builtin_draft
    from pd.engines.models.model_runner import ModelRunner
    from pd.engines.spec.draft_model import DraftModel, crop_cache

    torch.set_num_threads(1)
    import datetime as dt

    from kv_transfer import git_commit, machine

    out = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "commit": git_commit(),
           "machine": machine(), "command": " ".join(["benchmarks/spec_model_work_gpu.py", *sys.argv[1:]]),
           "context_tokens": CPU_CONTEXT, "threads": 1, "models": {}}
    for name in args.models:
        target = ModelRunner(name)
        draft = DraftModel(str(ensure_builtin_draft(name)), target)
        prompt = [3 + (7 * k) % 250 for k in range(CPU_CONTEXT)]
        tcache = target.new_cache()
        _, hidden = target.forward_hidden(prompt, tcache)
        dcache = draft.new_cache()
        draft.forward(prompt[1:] + [5], hidden, dcache)
        base = tcache.get_seq_length()

        def times(*fns) -> list[list[float]]:
            """Microseconds of ``args.reps`` calls of each of ``fns``, called in turn (a load change hits all)."""
            ts: list[list[float]] = [[] for _ in fns]
            for _ in range(args.reps):
                for t, fn in zip(ts, fns):
                    t0 = time.perf_counter()
                    fn()
                    t.append(1e6 * (time.perf_counter() - t0))
            return ts

        rows = []
        for window in args.windows:
            ids = prompt[:window]
            t_us, d_us = times(lambda: (target.forward_hidden(ids, tcache), crop_cache(tcache, base)),
                               lambda: (draft.forward(ids, hidden[:window], dcache), crop_cache(dcache, base)))
            # the machine is shared: the fastest call is the cost without preemption (the ratios use it)
            rows.append({"window": window, "target_us": min(t_us), "draft_us": min(d_us),
                         "target_us_median": statistics.median(t_us), "draft_us_median": statistics.median(d_us)})
            print(name, json.dumps(rows[-1]), flush=True)
        out["models"][name] = {"layers": int(target.config.num_hidden_layers), "rows": rows,
                               "accept_length": accept_lengths(target, draft)}
        print(name, "accept length by depth", out["models"][name]["accept_length"], flush=True)
    return out


def accept_lengths(target, draft, prompts: int = 16, new_tokens: int = 32) -> dict[str, float]:
    """Tokens per verify step at depths 1, 3 and 5 (greedy, seeded random prompts): the offline chain
    simulator of tests/spec_simulator.py, which runs the decode loop's steps on the two models."""
    sys.path.insert(0, str(HERE.parent / "tests"))
    from spec_simulator import mean_accept_length, random_prompts

    ps = random_prompts(prompts, target.vocab_size, seed=11)
    return {str(k): mean_accept_length(target, draft, ps, new_tokens, k) for k in DEPTHS}


# ---------------------------------------------------------------------------------------------------- report
def ratios(rows: list[dict]) -> list[dict]:
    """Per row: target/draft at the same tokens, and target(window) / target(1) and / draft(1) of its batch."""
    one = {r.get("batch", 1): r for r in rows if r["window"] == 1}
    out = []
    for r in rows:
        base = one.get(r.get("batch", 1))
        out.append({**r, "target_over_draft": r["target_us"] / r["draft_us"],
                    "target_over_target1": r["target_us"] / base["target_us"] if base else None,
                    "target_over_draft1": r["target_us"] / base["draft_us"] if base else None})
    return out


def model_work_speedup(rows: list[dict], accept: dict[str, float]) -> dict[str, float]:
    """Speculation's speedup of the model work alone at each depth s, for one batch's rows: ``a(s) x T(1) /
    (T(s+1) + (s-1) x D(1) + D(s+1))``: a verify step emits a(s) tokens for one target forward over the window,
    s - 1 chained one-token draft forwards and a draft extend (taken at the whole window: an upper bound), where
    speculation off runs one target forward per token (T, D: target and draft forward times by window)."""
    by = {r["window"]: r for r in rows}
    out = {}
    for s in DEPTHS:
        if 1 in by and s + 1 in by and str(s) in accept:
            step = by[s + 1]["target_us"] + (s - 1) * by[1]["draft_us"] + by[s + 1]["draft_us"]
            out[str(s)] = accept[str(s)] * by[1]["target_us"] / step
    return out


def speedup_table(res: dict) -> list[str]:
    """The model-work speedups of the GPU's batches and the CPU's models at builtin:deep's accept lengths."""
    cpu, gpu = res.get("cpu") or {}, res.get("gpu") or {}
    accept = cpu.get("models", {}).get("builtin:deep", {}).get("accept_length")
    if not accept:
        return []
    lines = ["Model work per emitted token, speculation off over on (``model_work_speedup``), at builtin:deep's "
             "accept lengths (" + ", ".join(f"depth {k}: {v:.2f}" for k, v in accept.items()) + " tokens per "
             "verify step, the offline simulator, 16 seeded prompts x 32 tokens); engine and router overheads "
             "excluded:", "", "| where | " + " | ".join(f"depth {s}" for s in DEPTHS) + " |",
             "|---|" + "---|" * len(DEPTHS)]
    for batch in sorted({r["batch"] for r in gpu.get("rows", [])}):
        sp = model_work_speedup([r for r in gpu["rows"] if r["batch"] == batch], accept)
        lines.append(f"| GPU, batch {batch} | " + " | ".join(_f(sp.get(str(s))) + "x" for s in DEPTHS) + " |")
    for name, m in cpu.get("models", {}).items():
        sp = model_work_speedup(m["rows"], accept)
        lines.append(f"| CPU, {name} | " + " | ".join(_f(sp.get(str(s))) + "x" for s in DEPTHS) + " |")
    return lines + [""]


def markdown(res: dict) -> str:
    """The .md of ``res`` ({"gpu": ..., "cpu": ...}, either may be missing)."""
    lines = ["# The speculative loop's model work: GPU at DeepSeek-V4-Flash shapes vs the CPU benchmark target", ""]
    gpu, cpu = res.get("gpu"), res.get("cpu")
    if gpu:
        lines += [f"GPU run: {gpu['device']}; {gpu['date']}; commit {gpu['commit']}; `{gpu['command']}`;",
                  f"{gpu['dims']['layers']} layers, MoE layout {gpu['moe_layout']}, {gpu['wall_s']:.0f} s.", "",
                  "| batch | window | target us | draft us | target / draft | target / target(1) | "
                  "target / draft(1) |", "|---|---|---|---|---|---|---|"]
        for r in sorted(ratios(gpu["rows"]), key=lambda r: (r["batch"], r["window"])):
            lines.append(f"| {r['batch']} | {r['window']} | {r['target_us']:.0f} | {r['draft_us']:.0f} | "
                         f"{r['target_over_draft']:.1f} | {_f(r['target_over_target1'])} | "
                         f"{_f(r['target_over_draft1'])} |")
        lines.append("")
    else:
        lines += ["GPU: not measured.", ""]
    if cpu:
        lines += [f"CPU run: {cpu['machine']['cpu_model']}, {cpu['machine']['cpu_cores']} cores (torch on 1 "
                  f"thread); {cpu['date']}; commit {cpu['commit']}; `{cpu['command']}`; after a "
                  f"{cpu['context_tokens']}-token context.", "",
                  "| model | layers | window | target us, fastest (median) | draft us, fastest (median) | "
                  "target / draft | target / target(1) | "
                  "target / draft(1) |", "|---|---|---|---|---|---|---|---|"]
        for name, m in cpu["models"].items():
            for r in ratios(m["rows"]):
                lines.append(f"| {name} | {m['layers']} | {r['window']} | {r['target_us']:.0f} "
                             f"({r['target_us_median']:.0f}) | {r['draft_us']:.0f} ({r['draft_us_median']:.0f}) | "
                             f"{r['target_over_draft']:.1f} | {_f(r['target_over_target1'])} | "
                             f"{_f(r['target_over_draft1'])} |")
        lines.append("")
    lines += speedup_table(res)
    if res.get("reading"):
        lines += [res["reading"], ""]
    lines += [__doc__.split("\n\n", 2)[2].strip(), ""]
    return "\n".join(lines)


def _f(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("gpu", help="time the DeepSeek-V4-Flash-shaped forwards (device machine)")
    g.add_argument("--device", default="cuda", help="cuda, or cpu with TRITON_INTERPRET=1 and --smoke")
    g.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64], help="sequences (default 1 4 16 64)")
    g.add_argument("--windows", type=int, nargs="+", default=[1, 2, 4, 6],
                   help="tokens per sequence: 1 = plain decode, num_steps + 1 = a verify window (default 1 2 4 6)")
    g.add_argument("--reps", type=int, default=20, help="graph replays timed per forward (default 20)")
    g.add_argument("--budget", type=float, default=400, help="seconds; shapes after it are skipped (default 400)")
    g.add_argument("--smoke", action="store_true", help="tiny dimensions, for an API check in the interpreter")
    g.add_argument("--out", type=Path, default=None, help="write the gpu section to OUT/spec_model_work_gpu.json")
    c = sub.add_parser("cpu", help="time builtin models' forwards on this CPU (updates the results' cpu section)")
    c.add_argument("--models", nargs="+", default=["builtin:tiny", "builtin:deep"])
    c.add_argument("--windows", type=int, nargs="+", default=[1, 2, 4, 6])
    c.add_argument("--reps", type=int, default=200)
    r = sub.add_parser("report", help="merge a gpu section into the results and write the .md")
    r.add_argument("--gpu-json", type=Path, default=None, help="a gpu run's spec_model_work_gpu.json to merge")
    r.add_argument("--reading", default=None, help="the results' reading (a paragraph for the .md)")
    args = p.parse_args(argv)

    path = RESULT.with_suffix(".json")
    res = json.loads(path.read_text()) if path.exists() else {}
    if args.cmd == "gpu":
        section = run_gpu(args)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "spec_model_work_gpu.json").write_text(json.dumps({"gpu": section}, indent=1) + "\n")
        print(markdown({"gpu": section}))
        return
    if args.cmd == "cpu":
        res["cpu"] = run_cpu(args)
    else:
        if args.gpu_json:
            res["gpu"] = json.loads(args.gpu_json.read_text())["gpu"]
        if args.reading:
            res["reading"] = args.reading
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1) + "\n")
    RESULT.with_suffix(".md").write_text(markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
