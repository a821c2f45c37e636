"""Speculative decoding on vs off, through the router on the embedded default, in one run.

What is measured
----------------
Two PD stacks run side by side as subprocesses: each is ``pdserve router`` over one prefill and one decode
reference engine serving ``builtin:tiny``; one stack has speculation off, the other ``--speculative-algorithm
EAGLE --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4`` on both engines
(the built-in MTP draft). The same seeded prompts (random token ids, 8-64 long) go to both, as streaming
``/generate`` requests through the router at temperature 0 with ``max_new_tokens`` fixed and ``ignore_eos``, at
each concurrency (1 and 8 by default). Rounds alternate between the stacks (off, on, off, on, ...) so both see
the same machine state; the greedy outputs of the two stacks are checked token for token.

Per request, from the client: TTFT (first chunk), TPOT = (E2E - TTFT) / (tokens - 1), and decode tokens/s per
stream = (tokens - 1) / (E2E - TTFT). From the decode engine's ``/metrics`` before and after each round:
``sglang:spec_verify_calls_total`` and the per-request ``meta_info.spec_verify_ct`` give the mean accept length
(tokens per verify step, the bonus included: SGLang's ``spec_accept_length``); ``pdserve_spec_step_seconds``
(phases draft / verify / extend) gives the verify step's share of the speculative step time and of the decode
time (sum over requests of E2E - TTFT).

Reproduce
---------
    .venv/bin/python benchmarks/speculative.py                 # writes benchmarks/results/speculative.{json,md}
    .venv/bin/python benchmarks/speculative.py --quick         # a short run

Torch in each engine gets one thread (``--cpu-threads 1``): the 2-core machine runs four engines, two routers
and the client.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from kv_transfer import git_commit, machine

from pd.cluster.procs import LoggedGroup
from pd.util.ports import free_ports
from pd.util.wait import async_wait_until

REPO = Path(__file__).resolve().parent.parent
SPEC_FLAGS = ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
              "--speculative-num-draft-tokens", "4"]
TARGET_SPEEDUP = 1.5  # decode tokens/s per stream at concurrency 1, on / off
WHY = """Why the speedup is small here: speculation trades target forwards for draft forwards and one wider
verify forward, which pays when the draft is much cheaper than the target. On a GPU, DeepSeek-V4's MTP layer is
one layer against the target's 43, and a verify window of 4 tokens costs about what one token does (decode is
bound by reading the weights). builtin:tiny is a 2-layer target on a CPU whose forwards are bound by per-operation
overhead: one draft forward (a decoder layer plus the MXFP4 MoE) costs about as much as one target forward, a
verify window costs more than a one-token step, and each verify step runs num_steps - 1 chained draft forwards
and one draft extend. So the model work per token is about what a plain decode step costs, and what speculation
saves is mostly the per-token overhead of the engine and the router (one streamed chunk per verify step instead
of per token), which is why the gain grows with concurrency. A target whose forward costs several draft forwards
(a deeper model, or any GPU deployment) is what reaches the 1.5x."""


class Stack:
    """A router over one prefill and one decode engine, all subprocesses of this process."""

    def __init__(self, name: str, extra: list[str], logs: Path):
        self.name = name
        port, pport, bport, dport = free_ports(4)
        py = [sys.executable, "-m", "pd.cli"]
        common = ["--cpu-threads", "1", *extra]
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

    async def ready(self, client: httpx.AsyncClient, timeout: float = 300) -> None:
        async def up() -> bool:
            for p in self.procs:
                if not p.alive():
                    raise RuntimeError(f"{p.name} exited:\n{p.tail()}")
            return (await client.get(self.url + "/health")).status_code == 200 and \
                (await client.get(self.decode_url + "/health")).status_code == 200

        await async_wait_until(up, timeout, interval=0.5, what=f"{self.name} stack healthy", retry=(httpx.HTTPError,))

    async def metrics(self, client: httpx.AsyncClient) -> dict[str, float]:
        """The decode's speculative counters: verify calls and the phase-time sums (seconds)."""
        from prometheus_client.parser import text_string_to_metric_families

        text = (await client.get(self.decode_url + "/metrics")).text
        out = {"verify_calls": 0.0, "draft": 0.0, "verify": 0.0, "extend": 0.0}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == "sglang:spec_verify_calls_total":
                    out["verify_calls"] += s.value
                elif s.name == "pdserve_spec_step_seconds_sum":
                    out[s.labels["phase"]] += s.value
        return out

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()


async def one_request(client: httpx.AsyncClient, url: str, prompt: list[int], max_new: int) -> dict:
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
    e2e = time.perf_counter() - t0
    n = len(last["output_ids"])
    decode_s = e2e - ttft
    return {"ttft_s": ttft, "e2e_s": e2e, "tokens": n, "decode_s": decode_s, "tpot_s": decode_s / max(1, n - 1),
            "tok_s_per_stream": (n - 1) / decode_s if decode_s > 0 else None, "output_ids": last["output_ids"],
            "spec_verify_ct": last["meta_info"].get("spec_verify_ct", 0)}


async def round_(client, stack: Stack, prompts: list[list[int]], concurrency: int, max_new: int) -> list[dict]:
    sem = asyncio.Semaphore(concurrency)

    async def run(p):
        async with sem:
            return await one_request(client, stack.url, p, max_new)

    return await asyncio.gather(*(run(p) for p in prompts))


def summarize(reqs: list[dict], before: dict, after: dict, wall_s: float) -> dict:
    phases = {k: after[k] - before[k] for k in ("draft", "verify", "extend")}
    spec_s = sum(phases.values())
    verify_ct = sum(r["spec_verify_ct"] for r in reqs)
    out = {
        "requests": len(reqs),
        "tok_s_per_stream_median": statistics.median(r["tok_s_per_stream"] for r in reqs),
        "tpot_ms_median": 1e3 * statistics.median(r["tpot_s"] for r in reqs),
        "ttft_ms_median": 1e3 * statistics.median(r["ttft_s"] for r in reqs),
    }
    if verify_ct:
        # tokens after the prefill's first one, per verify step (the first token comes from the prefill)
        out["mean_accept_length"] = sum(r["tokens"] - 1 for r in reqs) / verify_ct
        out["verify_share_of_spec_step"] = phases["verify"] / spec_s if spec_s else None
        # the decode engine runs one model thread: its rounds' wall time is the decode time it served
        out["verify_share_of_decode_time"] = phases["verify"] / wall_s
        out["phase_s"] = phases
        out["verify_calls"] = verify_ct
    return out


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = ["# Speculative decoding on vs off (embedded default, through the router)", "",
             f"- Device: {m['cpu_model']}, {m['cpu_cores']} cores, {m['mem_gib']} GiB, no GPU",
             f"- Date: {report['started_utc']} ({report['wall_s']:.0f} s)",
             f"- Measured at commit {report['commit']}",
             f"- Command: `{report['command']}`",
             "- Anchor, same run: the same prompts through a stack with speculation off, rounds interleaved", "",
             f"Headline: {report['headline']}", "",
             "| concurrency | spec | tok/s per stream (median) | TPOT ms | TTFT ms | accept length | verify share "
             "of spec step | verify share of decode time | speedup |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in report["results"]:
        for mode in ("off", "on"):
            s = c[mode]
            acc = f"{s['mean_accept_length']:.2f}" if "mean_accept_length" in s else "-"
            vs = f"{s['verify_share_of_spec_step']:.2f}" if s.get("verify_share_of_spec_step") else "-"
            vd = f"{s['verify_share_of_decode_time']:.2f}" if "verify_share_of_decode_time" in s else "-"
            sp = f"{c['speedup']:.2f}x" if mode == "on" else ""
            lines.append(f"| {c['concurrency']} | {mode} | {s['tok_s_per_stream_median']:.1f} | "
                         f"{s['tpot_ms_median']:.2f} | {s['ttft_ms_median']:.1f} | {acc} | {vs} | {vd} | {sp} |")
    lines += ["", f"Outputs equal token for token: {report['outputs_equal']}.", "", "Where the time goes, per verify "
              "step at concurrency 1: " + report["breakdown"] + ".", "", WHY, ""]
    return "\n".join(lines)


async def main(args) -> dict:
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    t_start = time.perf_counter()
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, 259) for _ in range(rng.randrange(8, 64))] for _ in range(args.num_prompts)]
    logs = Path(tempfile.mkdtemp(prefix="pdserve-spec-bench-"))
    stacks = {"off": Stack("off", [], logs), "on": Stack("on", SPEC_FLAGS, logs)}
    results, equal = [], True
    try:
        async with httpx.AsyncClient(timeout=600, trust_env=False) as client:
            for s in stacks.values():
                await s.ready(client)
            await round_(client, stacks["off"], prompts[:2], 1, 16)  # warm both (first requests load lazily)
            await round_(client, stacks["on"], prompts[:2], 1, 16)
            for conc in args.concurrency:
                reqs = {"off": [], "on": []}
                for rnd in range(args.rounds):
                    for mode in ("off", "on"):
                        before = await stacks[mode].metrics(client)
                        t0 = time.perf_counter()
                        got = await round_(client, stacks[mode], prompts, conc, args.max_new_tokens)
                        wall = time.perf_counter() - t0
                        after = await stacks[mode].metrics(client)
                        reqs[mode].append((got, before, after, wall))
                    equal &= all(a["output_ids"] == b["output_ids"]
                                 for a, b in zip(reqs["off"][-1][0], reqs["on"][-1][0]))
                entry = {"concurrency": conc}
                for mode in ("off", "on"):
                    flat = [r for got, *_ in reqs[mode] for r in got]
                    first, last = reqs[mode][0][1], reqs[mode][-1][2]
                    entry[mode] = summarize(flat, first, last, sum(w for *_, w in reqs[mode]))
                entry["speedup"] = entry["on"]["tok_s_per_stream_median"] / entry["off"]["tok_s_per_stream_median"]
                results.append(entry)
                print(json.dumps(entry), flush=True)
    finally:
        for s in stacks.values():
            s.stop()
    c1 = next((r for r in results if r["concurrency"] == 1), results[0])
    met = c1["speedup"] >= TARGET_SPEEDUP
    on = c1["on"]
    per = {k: 1e3 * v / on["verify_calls"] for k, v in on["phase_s"].items()} if "phase_s" in on else {}
    step_ms = sum(per.values())
    breakdown = (f"draft {per['draft']:.2f} ms + verify {per['verify']:.2f} ms + draft extend {per['extend']:.2f} "
                 f"ms = {step_ms:.2f} ms for {on['mean_accept_length']:.2f} tokens, "
                 f"{step_ms / on['mean_accept_length']:.2f} ms per token, vs {c1['off']['tpot_ms_median']:.2f} "
                 "ms per token (TPOT) without speculation" if per else "no verify steps recorded")
    headline = (f"concurrency {c1['concurrency']}: **{c1['speedup']:.2f}x** decode tokens/s per stream with "
                "speculation "
                f"(target >= {TARGET_SPEEDUP}x: {'met' if met else 'missed'}), mean accept length "
                f"{c1['on'].get('mean_accept_length', 0):.2f} tokens per verify step with 3 draft tokens")
    return {
        "benchmark": "speculative", "started_utc": started, "wall_s": time.perf_counter() - t_start,
        "commit": git_commit(), "machine": machine(), "command": " ".join(["benchmarks/speculative.py", *sys.argv[1:]]),
        "settings": {"spec_flags": SPEC_FLAGS, "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens,
                     "rounds": args.rounds, "concurrency": args.concurrency, "seed": args.seed},
        "results": results, "outputs_equal": equal, "headline": headline, "target_speedup": TARGET_SPEEDUP,
        "breakdown": breakdown,
    }


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-prompts", type=int, default=8, help="prompts per round (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per request (default 128)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per concurrency (default 3)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8], help="concurrencies (default 1 8)")
    p.add_argument("--seed", type=int, default=0, help="prompt seed (default 0)")
    p.add_argument("--quick", action="store_true", help="4 prompts, 48 tokens, 1 round")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results", help="where the results go")
    args = p.parse_args(argv)
    if args.quick:
        args.num_prompts, args.max_new_tokens, args.rounds = 4, 48, 1
    return args


if __name__ == "__main__":
    a = parse_args()
    report = asyncio.run(main(a))
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "speculative.json").write_text(json.dumps(report, indent=1) + "\n")
    (a.out / "speculative.md").write_text(markdown(report))
    print(report["headline"])
