"""Speculative decoding: off vs fixed depths vs adaptive depth, through the router, in one run.

What is measured
----------------
One PD stack per variant runs side by side as subprocesses: ``pdserve router`` over one prefill and one decode
reference engine serving ``--model`` (default ``builtin:deep``, the benchmark target whose forward costs several
draft forwards, as DeepSeek-V4's does on a GPU: benchmarks/results/spec_model_work_gpu.md). Variants: speculation
``off``; fixed depths ``d1``, ``d3``, ``d5`` (``--speculative-algorithm EAGLE --speculative-num-steps K
--speculative-eagle-topk 1 --speculative-num-draft-tokens K+1`` on both engines, the built-in MTP draft); and
``adaptive`` (``--speculative-algorithm EAGLE --speculative-adaptive``, SGLang's default tiers) and ``adaptive-cpu``
(the same with ``--speculative-adaptive-config benchmarks/adaptive_tiers_cpu.json``, tiers for this CPU), which are
skipped, saying so, while the engine has no such flag.

Sweep: at each concurrency (1, 2, 4, 8, 16 by default) ``--rounds`` rounds; each round sends the same seeded
prompts (random token ids, 8-64 long; ``max(--num-prompts, concurrency)`` of them) to every variant in turn, the
variants' order rotated between rounds, as streaming ``/generate`` requests at temperature 0 with
``max_new_tokens`` fixed and ``ignore_eos``. Mixed phase: ``--mixed-cycles`` cycles, each ``--mixed-low``
requests one at a time then ``--mixed-high`` at once (concurrency 1, then 16), per variant in turn (rotated): the
total tokens / total wall time of each variant.

Per request, from the client: TTFT (first chunk), TPOT = (E2E - TTFT) / (tokens - 1), decode tokens/s per stream =
(tokens - 1) / (E2E - TTFT); medians per (variant, concurrency). Accept length: tokens after the first per verify
step (``meta_info.spec_verify_ct``; SGLang's ``spec_accept_length``). Depth chosen: the decode's
``sglang:spec_num_steps`` gauge, sampled every 0.25 s during the adaptive variant's rounds (its share of samples at
each depth) and read after every fixed-depth round (a check that it is the depth asked for). The greedy outputs of
every variant are compared with ``off``'s token for token.

Targets (``targets`` in the JSON): speedup_c1: the best speculative variant's decode tokens/s per stream at
concurrency 1 over ``off``'s (>= 1.5x); adaptive_vs_best_fixed: adaptive over the best fixed depth at every
concurrency (>= 0.95x at each); adaptive_mixed_vs_fixed: adaptive's total tokens/s in the mixed phase over the
best fixed depth's (> 1.0x); the same two for ``adaptive-cpu`` (``adaptive-cpu_vs_best_fixed``, ...).

Reproduce
---------
    .venv/bin/python benchmarks/speculative.py                 # writes benchmarks/results/speculative.{json,md}
    .venv/bin/python benchmarks/speculative.py --quick --out /tmp/spec   # a short smoke run

Torch in each engine gets one thread (``--cpu-threads 1``): the 2-core machine runs the stacks, which idle while
another variant's round runs, and the client.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx
from kv_transfer import git_commit, machine
from speculative_report import markdown, summarize, targets

from pd.cluster.procs import LoggedGroup
from pd.util.ports import free_ports
from pd.util.wait import async_wait_until

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = "builtin:deep"
# A tier file for this CPU (see its "_why"): SGLang's default tiers are sized for a GPU's batching.
CPU_TIERS = REPO / "benchmarks" / "adaptive_tiers_cpu.json"
VARIANTS = ["off", "d1", "d3", "d5", "adaptive", "adaptive-cpu"]


def variants(adaptive_ok: bool) -> dict[str, list[str] | None]:
    """Variant name -> the engines' speculative flags ([] off; None: skipped, the engine lacks the flag)."""
    def depth(k: int) -> list[str]:
        return ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", str(k), "--speculative-eagle-topk",
                "1", "--speculative-num-draft-tokens", str(k + 1)]

    adaptive = ["--speculative-algorithm", "EAGLE", "--speculative-adaptive"]
    return {"off": [], "d1": depth(1), "d3": depth(3), "d5": depth(5),
            "adaptive": adaptive if adaptive_ok else None,
            "adaptive-cpu": [*adaptive, "--speculative-adaptive-config", str(CPU_TIERS)] if adaptive_ok else None}


def adaptive_supported() -> bool:
    """Whether the reference engine takes ``--speculative-adaptive`` (its settings model has the field)."""
    from pd.engines.spec.config import SpeculativeSettings

    return "adaptive" in SpeculativeSettings.model_fields


class Stack:
    """A router over one prefill and one decode engine, all subprocesses of this process."""

    def __init__(self, name: str, model: str, extra: list[str], logs: Path):
        self.name = name
        port, pport, bport, dport = free_ports(4)
        py = [sys.executable, "-m", "pd.cli"]
        common = ["--model-path", model, "--cpu-threads", "1", *extra]
        self.decode_url = f"http://127.0.0.1:{dport}"
        self.url = f"http://127.0.0.1:{port}"
        self.procs = [
            LoggedGroup(f"{name}-prefill", [*py, "engine", "--disaggregation-mode", "prefill", "--port", str(pport),
                                            "--disaggregation-bootstrap-port", str(bport), *common],
                        logs / f"{name}-prefill.log"),
            LoggedGroup(f"{name}-decode", [*py, "engine", "--disaggregation-mode", "decode", "--port", str(dport),
                                           *common], logs / f"{name}-decode.log"),
            LoggedGroup(f"{name}-router", [*py, "router", "--port", str(port), "--prefill",
                                           f"http://127.0.0.1:{pport}", str(bport), "--decode", self.decode_url],
                        logs / f"{name}-router.log"),
        ]

    async def ready(self, client: httpx.AsyncClient, timeout: float = 600) -> None:
        """Wait (deadline ``timeout`` s) until the router and the decode answer /health; raises if one exits."""
        async def up() -> bool:
            for p in self.procs:
                if not p.alive():
                    raise RuntimeError(f"{p.name} exited:\n{p.tail()}")
            return (await client.get(self.url + "/health")).status_code == 200 and \
                (await client.get(self.decode_url + "/health")).status_code == 200

        await async_wait_until(up, timeout, interval=0.5, what=f"{self.name} stack healthy", retry=(httpx.HTTPError,))

    async def num_steps(self, client: httpx.AsyncClient) -> float | None:
        """The decode's ``sglang:spec_num_steps`` gauge (the depth of its last speculative step), None if absent."""
        from prometheus_client.parser import text_string_to_metric_families

        text = (await client.get(self.decode_url + "/metrics")).text
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == "sglang:spec_num_steps":
                    return s.value
        return None

    def stop(self) -> None:
        """Stop the router, then the engines (each by its process group)."""
        for p in reversed(self.procs):
            p.stop()


async def one_request(client: httpx.AsyncClient, url: str, prompt: list[int], max_new: int) -> dict:
    """One streaming greedy /generate request; the client-side times and the output."""
    body = {"input_ids": prompt, "stream": True,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}
    t0 = time.perf_counter()
    ttft, last = None, None
    async with client.stream("POST", url + "/generate", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            if ttft is None:
                ttft = time.perf_counter() - t0
            last = json.loads(line[5:])
    if last is None or ttft is None:
        raise RuntimeError(f"{url}/generate streamed no data")
    e2e = time.perf_counter() - t0
    n = len(last["output_ids"])
    decode_s = e2e - ttft
    return {"ttft_s": ttft, "e2e_s": e2e, "tokens": n, "decode_s": decode_s, "tpot_s": decode_s / max(1, n - 1),
            "tok_s_per_stream": (n - 1) / decode_s if decode_s > 0 else None, "output_ids": last["output_ids"],
            "spec_verify_ct": last["meta_info"].get("spec_verify_ct", 0)}


async def round_(client, stack: Stack, prompts: list[list[int]], concurrency: int, max_new: int) -> list[dict]:
    """All ``prompts`` through ``stack``, at most ``concurrency`` in flight."""
    sem = asyncio.Semaphore(concurrency)

    async def run(p):
        async with sem:
            return await one_request(client, stack.url, p, max_new)

    return await asyncio.gather(*(run(p) for p in prompts))


async def watched(client, stack: Stack, work, samples: list[float]):
    """Await ``work`` and record the decode's depth gauge in ``samples``: the adaptive variant's every 0.25 s
    while it runs, a fixed depth's once after it (a check), nothing with speculation off."""
    if stack.name.startswith("adaptive"):
        return await sampled(client, stack, work, samples)
    out = await work
    if stack.name != "off":
        value = await stack.num_steps(client)
        samples += [] if value is None else [value]
    return out


async def sampled(client, stack: Stack, work, samples: list[float], every: float = 0.25):
    """Await ``work`` while appending the decode's depth gauge to ``samples`` every ``every`` s."""
    task = asyncio.ensure_future(work)
    while not task.done():
        await asyncio.wait({task}, timeout=every)
        value = await stack.num_steps(client)
        if value is not None:
            samples.append(value)
    return task.result()


def rotated(names: list[str], k: int) -> list[str]:
    """``names`` starting at index ``k`` (mod len): the variants' order in round ``k``."""
    k %= len(names)
    return names[k:] + names[:k]


async def sweep(client, stacks: dict[str, Stack], prompts: list[list[int]], args) -> tuple[list[dict], dict]:
    """The concurrency sweep; returns (one entry per concurrency, {variant: outputs equal off's})."""
    names = list(stacks)
    results, equal = [], {n: True for n in names if n != "off"}
    for conc in args.concurrency:
        batch = prompts[: max(args.num_prompts, conc)]
        got: dict[str, list[dict]] = {n: [] for n in names}
        depths: dict[str, list[float]] = {n: [] for n in names}
        for rnd in range(args.rounds):
            outs = {}
            for name in rotated(names, rnd):
                reqs = await watched(client, stacks[name], round_(client, stacks[name], batch, conc,
                                                                  args.max_new_tokens), depths[name])
                got[name] += reqs
                outs[name] = [r["output_ids"] for r in reqs]
            for n in equal:
                equal[n] &= outs[n] == outs["off"]
        entry = {"concurrency": conc, "prompts": len(batch),
                 "variants": {n: summarize(got[n], depths[n]) for n in names}}
        results.append(entry)
        print(json.dumps({"concurrency": conc, **{n: round(v["tok_s_per_stream_median"], 1)
                                                  for n, v in entry["variants"].items()}}), flush=True)
    return results, equal


async def mixed(client, stacks: dict[str, Stack], prompts: list[list[int]], args) -> dict:
    """The mixed-concurrency phase: per variant, total tokens / wall time over all cycles."""
    names = list(stacks)
    low, high = prompts[: args.mixed_low], prompts[: args.mixed_high]
    acc = {n: {"tokens": 0, "wall_s": 0.0, "low_s": 0.0, "high_s": 0.0, "depth_samples": []} for n in names}
    for cycle in range(args.mixed_cycles):
        for name in rotated(names, cycle):
            a, stack = acc[name], stacks[name]
            t0 = time.perf_counter()
            lo = await watched(client, stack, round_(client, stack, low, 1, args.max_new_tokens), a["depth_samples"])
            t1 = time.perf_counter()
            hi = await watched(client, stack, round_(client, stack, high, len(high), args.max_new_tokens),
                               a["depth_samples"])
            t2 = time.perf_counter()
            a["tokens"] += sum(r["tokens"] for r in lo + hi)
            a["wall_s"] += t2 - t0
            a["low_s"] += t1 - t0
            a["high_s"] += t2 - t1
    out = {}
    for n, a in acc.items():
        out[n] = {"tokens": a["tokens"], "wall_s": a["wall_s"], "tok_s": a["tokens"] / a["wall_s"],
                  "low_phase_s": a["low_s"], "high_phase_s": a["high_s"]}
        if a["depth_samples"]:
            out[n]["depth_share"] = summarize([], a["depth_samples"])["depth_share"]
    print(json.dumps({"mixed_tok_s": {n: round(v["tok_s"], 1) for n, v in out.items()}}), flush=True)
    return out


async def main(args) -> dict:
    """Start the stacks, run the sweep and the mixed phase, stop the stacks; the report."""
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    t_start = time.perf_counter()
    rng = random.Random(args.seed)
    count = max([args.num_prompts, args.mixed_high, args.mixed_low, *args.concurrency])
    prompts = [[rng.randrange(3, 259) for _ in range(rng.randrange(8, 64))] for _ in range(count)]
    logs = Path(tempfile.mkdtemp(prefix="pdserve-spec-bench-"))
    table = variants(adaptive_supported())
    skipped = {n: "the engine has no --speculative-adaptive flag yet (pd.engines.spec.config.SpeculativeSettings "
                  "lacks the field): variant skipped" for n, flags in table.items() if flags is None}
    for n, why in skipped.items():
        print(f"{n}: {why}", flush=True)
    chosen = [n for n in args.variants if n not in skipped]
    stacks = {n: Stack(n, args.model, table[n] or [], logs) for n in chosen}
    try:
        async with httpx.AsyncClient(timeout=900, trust_env=False) as client:
            for s in stacks.values():
                await s.ready(client)
            for s in stacks.values():  # first requests load lazily; the draft is fitted on first use
                await round_(client, s, prompts[:2], 1, 16)
            results, equal = await sweep(client, stacks, prompts, args)
            mix = await mixed(client, stacks, prompts, args) if args.mixed_cycles else {}
    finally:
        for s in stacks.values():
            s.stop()
    report = {
        "benchmark": "speculative", "started_utc": started, "wall_s": time.perf_counter() - t_start,
        "commit": git_commit(), "machine": machine(),
        "command": " ".join(["benchmarks/speculative.py", *sys.argv[1:]]),
        "settings": {"model": args.model, "variants": {n: table[n] for n in chosen}, "skipped": skipped,
                     "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens, "rounds": args.rounds,
                     "concurrency": args.concurrency, "mixed": {"cycles": args.mixed_cycles, "low": args.mixed_low,
                                                               "high": args.mixed_high}, "seed": args.seed},
        "results": results, "mixed": mix, "outputs_equal_off": equal, "logs": str(logs),
    }
    report["targets"] = targets(report)
    return report


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"the engines' --model-path (default {DEFAULT_MODEL})")
    p.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS,
                   help="variants to run (default all; off is needed)")
    p.add_argument("--num-prompts", type=int, default=8, help="prompts per round, at least the concurrency (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens per request (default 64)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per concurrency (default 3)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16],
                   help="concurrencies (default 1 2 4 8 16)")
    p.add_argument("--mixed-cycles", type=int, default=3, help="mixed-phase cycles (default 3; 0: no mixed phase)")
    p.add_argument("--mixed-low", type=int, default=4, help="requests one at a time per cycle (default 4)")
    p.add_argument("--mixed-high", type=int, default=16, help="requests at once per cycle (default 16)")
    p.add_argument("--seed", type=int, default=0, help="prompt seed (default 0)")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: 2 prompts, 16 tokens, 1 round, concurrency 1 and 2, one mixed cycle of 1 + 2")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results", help="where the results go")
    if p.parse_known_args(argv)[0].quick:  # --quick changes the defaults; flags given still win
        p.set_defaults(num_prompts=2, max_new_tokens=16, rounds=1, concurrency=[1, 2], mixed_cycles=1, mixed_low=1,
                       mixed_high=2)
    args = p.parse_args(argv)
    if "off" not in args.variants:
        p.error("--variants: off is needed (every speedup is against it)")
    for name in ("num_prompts", "max_new_tokens", "rounds", "mixed_low", "mixed_high"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: must be >= 1")
    if min(args.concurrency) < 1:
        p.error("--concurrency: every value must be >= 1")
    return args


if __name__ == "__main__":
    a = parse_args()
    rep = asyncio.run(main(a))
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "speculative.json").write_text(json.dumps(rep, indent=1) + "\n")
    (a.out / "speculative.md").write_text(markdown(rep))
    print(rep["targets"])
