"""Prefix-aware routing on the PD reference stack: which prefill a request goes to decides how much of its prompt
is computed again. round_robin, cache_aware (the router's approximate tree of what it sent) and kv_aware (an index
built from the prefills' own KV events) against an oracle that knows every cache exactly.

What is measured
----------------
Three prefill reference engines (``builtin:tiny``, ``--page-size 16``, a pool of ``--pool-tokens`` each, so one
prefill cannot keep every tenant's prompt) publishing KV events, one decode, and ``pdserve router`` with
``--prefill-policy P``; each policy's router is started in turn, in an order rotated every round (interleaved),
every prefill's cache flushed before each workload. Two workloads, the same requests for every policy (seeded):

* **shared prefix** (multi-tenant): ``--tenants`` system prompts of ``--prefix-tokens`` tokens, each request one
  tenant's prompt and a short question, Poisson arrivals at ``--rate`` req/s;
* **multi-turn chat**: ``--sessions`` sessions of ``--turns`` turns, one session's turns in order (each prompt is
  the previous prompt, its answer and a new question), the sessions at once.

Per policy: **prefill tokens computed** (prompt tokens minus the ``cached_tokens`` each answer reports: exact,
machine-independent), hit rate, KV bytes the prefills pushed, TTFT p50/p90 (first streamed chunk through the
router) and throughput. The oracle replays the shared-prefix requests in arrival order against three simulated
prompt caches of the same page size and capacity (LRU over whole pages, as the engines evict), sending each to the
prefill that holds the longest prefix of it (ties: the one with the least work so far): the prefill tokens a policy
that knew every cache exactly would compute.

**Index accuracy** (kv_aware): the shared-prefix requests, then the multi-turn prompts, sent one at a time through
a fresh kv_aware router on flushed caches; per request, the router's predicted cached tokens (its
``pdserve_router_kv_predicted_cached_tokens_total`` before and after) against the ``cached_tokens`` the answer
reports. Once on pools of ``--accuracy-pool-tokens`` (every page of the run fits: nothing is evicted) and once on
the pools above (evicting). One at a time, so each prediction is read alone; with requests in flight together a
prediction also counts pages sent to a prefill and not computed yet.

Reproduce
---------
    .venv/bin/python benchmarks/prefix_routing.py           # writes benchmarks/results/prefix_routing.{json,md}
    .venv/bin/python benchmarks/prefix_routing.py --quick   # one short round, not written
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
from collections import OrderedDict
from pathlib import Path

import httpx
from kv_transfer import git_commit, machine

from pd.cluster.procs import LoggedGroup
from pd.util.kv_block_hash import page_hashes
from pd.util.ports import free_ports
from pd.util.wait import async_wait_until

REPO = Path(__file__).resolve().parent.parent
POLICIES = ("round_robin", "cache_aware", "kv_aware")
PAGE = 16
PREFILLS = 3
OUTPUT_TOKENS = 8


class Stack:
    """Three prefills (KV events on), one decode, and a router per policy; subprocesses of this process."""

    def __init__(self, logs: Path, pool_tokens: int):
        logs.mkdir(exist_ok=True)
        self.logs = logs
        py = [sys.executable, "-m", "pd.cli", "engine", "--page-size", str(PAGE), "--cpu-threads", "1"]
        ports = free_ports(4 * PREFILLS + 1)
        self.prefills = []
        self.procs = []
        for i in range(PREFILLS):
            port, bport, events, replay = ports[4 * i: 4 * i + 4]
            config = json.dumps({"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{events}", "bind": True,
                                 "replay_endpoint": f"tcp://127.0.0.1:{replay}"})
            self.prefills.append((f"http://127.0.0.1:{port}", bport))
            self.procs.append(LoggedGroup(f"prefill{i}", [*py, "--disaggregation-mode", "prefill", "--port", str(port),
                                                         "--disaggregation-bootstrap-port", str(bport),
                                                         "--max-total-tokens", str(pool_tokens),
                                                         "--kv-events-config", config], logs / f"prefill{i}.log"))
        self.decode = f"http://127.0.0.1:{ports[-1]}"
        self.procs.append(LoggedGroup("decode", [*py, "--disaggregation-mode", "decode", "--port", str(ports[-1])],
                                      logs / "decode.log"))
        self.router: LoggedGroup | None = None
        self.url = ""

    async def wait(self, urls: list[str], timeout: float = 300) -> None:
        async with httpx.AsyncClient() as c:
            async def up() -> bool:
                for p in self.procs + ([self.router] if self.router else []):
                    if not p.alive():
                        raise RuntimeError(f"{p.name} exited:\n{p.tail()}")
                for u in urls:
                    if (await c.get(u + "/health", timeout=5)).status_code != 200:
                        return False
                return True

            await async_wait_until(up, timeout, interval=0.5, what="stack healthy", retry=(httpx.HTTPError,))

    async def start_router(self, policy: str) -> None:
        port = free_ports(1)[0]
        argv = [sys.executable, "-m", "pd.cli", "router", "--port", str(port), "--prefill-policy", policy,
                "--decode-policy", "round_robin"]
        for url, bport in self.prefills:
            argv += ["--prefill", url, str(bport)]
        argv += ["--decode", self.decode]
        self.router = LoggedGroup("router", argv, self.logs / f"router-{policy}.log")
        self.url = f"http://127.0.0.1:{port}"
        await self.wait([self.url])
        if policy == "kv_aware":  # its index gauges appear once it follows each prefill's events
            async with httpx.AsyncClient() as c:
                async def following() -> bool:
                    text = (await c.get(self.url + "/metrics", timeout=5)).text
                    return all(f'pdserve_router_kv_index_blocks{{worker="{u}"}}' in text for u, _ in self.prefills)

                await async_wait_until(following, 60, interval=0.2, what="the router following every prefill's "
                                       "KV events", retry=(httpx.HTTPError,))

    def stop_router(self) -> None:
        if self.router is not None:
            self.router.stop()
            self.router = None

    async def flush(self) -> None:
        async with httpx.AsyncClient(timeout=60) as c:
            for url, _ in self.prefills:
                r = await c.post(url + "/flush_cache", params={"timeout": 30})
                assert r.status_code == 200, r.text

    async def pushed_bytes(self) -> float:
        """KV bytes the prefills have pushed so far (their ``pdserve_kv_transfer_bytes_total``)."""
        total = 0.0
        async with httpx.AsyncClient(timeout=30) as c:
            for url, _ in self.prefills:
                for line in (await c.get(url + "/metrics")).text.splitlines():
                    if line.startswith("pdserve_kv_transfer_bytes_total"):
                        total += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self) -> None:
        self.stop_router()
        for p in self.procs:
            p.stop()


def shared_prefix_requests(tenants: int, prefix_tokens: int, count: int, rate: float, seed: int):
    """``count`` (arrival s, token ids): a tenant's system prompt and a 16-31 token question, Poisson arrivals."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 250) for _ in range(prefix_tokens)] for _ in range(tenants)]
    t, out = 0.0, []
    for _ in range(count):
        t += rng.expovariate(rate)
        out.append((t, systems[rng.randrange(tenants)] + [rng.randrange(1, 250) for _ in range(rng.randrange(16, 32))]))
    return out


async def generate(client: httpx.AsyncClient, url: str, ids: list[int]) -> dict:
    """One streamed /generate through the router: TTFT (first chunk), E2E, the answer's ids and cached tokens."""
    t0 = time.perf_counter()
    ttft, last = None, None
    body = {"input_ids": ids, "stream": True, "sampling_params": {"temperature": 0, "max_new_tokens": OUTPUT_TOKENS}}
    async with client.stream("POST", url + "/generate", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                last = json.loads(line[6:])
    assert last is not None
    return {"ttft": ttft, "e2e": time.perf_counter() - t0, "prompt": len(ids),
            "cached": last["meta_info"]["cached_tokens"], "output_ids": last["output_ids"]}


async def run_shared(url: str, requests) -> list[dict]:
    async with httpx.AsyncClient(timeout=300) as c:
        t0 = time.perf_counter()

        async def one(at, ids):
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            return await generate(c, url, ids)

        return list(await asyncio.gather(*(one(at, ids) for at, ids in requests)))


async def run_multi_turn(url: str, sessions: int, turns: int, system_tokens: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    starts = [[rng.randrange(1, 250) for _ in range(system_tokens)] for _ in range(sessions)]
    questions = [[[rng.randrange(1, 250) for _ in range(rng.randrange(16, 32))] for _ in range(turns)]
                 for _ in range(sessions)]
    async with httpx.AsyncClient(timeout=300) as c:
        async def session(i):
            prompt, out = list(starts[i]), []
            for q in questions[i]:
                prompt = prompt + q
                answer = await generate(c, url, prompt)
                out.append(answer)
                prompt = prompt + answer["output_ids"]
            return out

        return [a for s in await asyncio.gather(*(session(i) for i in range(sessions))) for a in s]


def oracle_prefill_tokens(requests, capacity_pages: int) -> int:
    """Prefill tokens computed by routing each request to the simulated prefill cache holding its longest prefix
    (LRU over whole pages; a page is kept with the prefix before it, as a radix tree keeps it)."""
    caches = [OrderedDict() for _ in range(PREFILLS)]  # page hash -> None, least recently used first
    work = [0] * PREFILLS
    total = 0
    for _, ids in requests:
        hashes = [h for _, h in page_hashes(ids[: (len(ids) - 1) // PAGE * PAGE], PAGE)]

        def overlap(cache) -> int:
            n = 0
            while n < len(hashes) and hashes[n] in cache:
                n += 1
            return n

        best = max(range(PREFILLS), key=lambda w: (overlap(caches[w]), -work[w]))
        hit = overlap(caches[best]) * PAGE
        computed = len(ids) - hit
        total += computed
        work[best] += computed
        cache = caches[best]
        for h in [h for _, h in page_hashes(ids, PAGE)]:
            cache[h] = None
            cache.move_to_end(h)
        while len(cache) > capacity_pages:
            cache.popitem(last=False)
    return total


def summary(answers: list[dict], wall: float, pushed: float) -> dict:
    prompt = sum(a["prompt"] for a in answers)
    cached = sum(a["cached"] for a in answers)
    ttfts = sorted(a["ttft"] for a in answers)
    return {"requests": len(answers), "prompt_tokens": prompt, "prefill_tokens_computed": prompt - cached,
            "hit_rate": cached / prompt, "kv_bytes_pushed": pushed,
            "ttft_p50_ms": 1000 * statistics.median(ttfts),
            "ttft_p90_ms": 1000 * ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))],
            "throughput_req_s": len(answers) / wall,
            "output_tok_s": len(answers) * OUTPUT_TOKENS / wall}


async def kv_totals(url: str) -> tuple[float, float]:
    """The router's (predicted, reported) cached-token counters, summed over the prefills."""
    async with httpx.AsyncClient(timeout=30) as c:
        text = (await c.get(url + "/metrics")).text
    out = [0.0, 0.0]
    for line in text.splitlines():
        for i, name in enumerate(("pdserve_router_kv_predicted_cached_tokens_total",
                                  "pdserve_router_kv_reported_cached_tokens_total")):
            if line.startswith(name + "{"):
                out[i] += float(line.rsplit(" ", 1)[1])
    return out[0], out[1]


async def accuracy(stack: "Stack", prompts: list[list[int]]) -> dict:
    """kv_aware's index accuracy per request: ``prompts`` sent one at a time through a fresh kv_aware router on
    flushed caches; each request's predicted cached tokens (the router's counter before and after it) against the
    ``cached_tokens`` its answer reports. One at a time, so that each prediction is read alone."""
    await stack.start_router("kv_aware")
    await stack.flush()
    rows = []
    try:
        async with httpx.AsyncClient(timeout=300) as c:
            for i, ids in enumerate(prompts):
                before = await kv_totals(stack.url)
                answer = await generate(c, stack.url, ids)
                after = await kv_totals(stack.url)
                predicted, reported = after[0] - before[0], after[1] - before[1]
                assert reported == answer["cached"], (i, reported, answer["cached"])
                rows.append({"request": i, "prompt": len(ids), "predicted": predicted, "reported": reported})
    finally:
        stack.stop_router()
    equal = sum(r["predicted"] == r["reported"] for r in rows)
    return {"requests": len(rows), "equal": equal, "fraction_equal": equal / len(rows),
            "over": [r for r in rows if r["predicted"] > r["reported"]],
            "under": [r for r in rows if r["predicted"] < r["reported"]]}


async def multi_turn_prompts(url: str, sessions: int, turns: int, system_tokens: int, seed: int) -> list[list[int]]:
    """The multi-turn sessions' prompts (answers from ``url``, greedy: the same in every run), sessions in order."""
    answers = await run_multi_turn(url, sessions, turns, system_tokens, seed)
    rng = random.Random(seed)
    starts = [[rng.randrange(1, 250) for _ in range(system_tokens)] for _ in range(sessions)]
    questions = [[[rng.randrange(1, 250) for _ in range(rng.randrange(16, 32))] for _ in range(turns)]
                 for _ in range(sessions)]
    out = []
    for i in range(sessions):
        prompt = list(starts[i])
        for t in range(turns):
            prompt = prompt + questions[i][t]
            out.append(prompt)
            prompt = prompt + answers[i * turns + t]["output_ids"]
    return out


async def measure(args) -> dict:
    shared = shared_prefix_requests(args.tenants, args.prefix_tokens, args.requests, args.rate, args.seed)
    runs: dict[str, dict[str, list]] = {p: {"shared_prefix": [], "multi_turn": []} for p in POLICIES}
    with tempfile.TemporaryDirectory(prefix="prefix-routing-") as logs:
        stack = Stack(Path(logs), args.pool_tokens)
        try:
            await stack.wait([u for u, _ in stack.prefills] + [stack.decode])
            for r in range(args.rounds):
                order = POLICIES[r % len(POLICIES):] + POLICIES[: r % len(POLICIES)]
                for policy in order:
                    await stack.start_router(policy)
                    for name in ("shared_prefix", "multi_turn"):
                        await stack.flush()
                        pushed, t0 = await stack.pushed_bytes(), time.perf_counter()
                        if name == "shared_prefix":
                            answers = await run_shared(stack.url, shared)
                        else:
                            answers = await run_multi_turn(stack.url, args.sessions, args.turns, args.prefix_tokens,
                                                           args.seed)
                        wall = time.perf_counter() - t0
                        runs[policy][name].append(summary(answers, wall, await stack.pushed_bytes() - pushed))
                        print(f"round {r} {policy:12s} {name:13s} computed "
                              f"{runs[policy][name][-1]['prefill_tokens_computed']}", flush=True)
                    stack.stop_router()
            # index accuracy, pools as above (evicting): shared-prefix requests then multi-turn prompts, in order
            await stack.start_router("round_robin")
            turns = await multi_turn_prompts(stack.url, args.sessions, args.turns, args.prefix_tokens, args.seed)
            stack.stop_router()
            prompts = [ids for _, ids in shared] + turns
            evicting = await accuracy(stack, prompts)
        finally:
            stack.stop()
        # the same on pools that hold every page of the run (nothing evicted)
        stack = Stack(Path(logs) / "big", args.accuracy_pool_tokens)
        try:
            await stack.wait([u for u, _ in stack.prefills] + [stack.decode])
            whole = await accuracy(stack, prompts)
        finally:
            stack.stop()
    capacity = args.pool_tokens // PAGE
    return {"runs": runs, "oracle_shared_prefix_prefill_tokens": oracle_prefill_tokens(shared, capacity),
            "accuracy": {"no_eviction": whole, "eviction": evicting}}


def mean_of(rows: list[dict], key: str) -> float:
    return statistics.fmean(r[key] for r in rows)


def report(result: dict, args) -> dict:
    runs, oracle = result["runs"], result["oracle_shared_prefix_prefill_tokens"]
    table = {p: {w: {k: mean_of(rows, k) for k in rows[0]} for w, rows in per.items()} for p, per in runs.items()}
    computed = {p: table[p]["shared_prefix"]["prefill_tokens_computed"] for p in POLICIES}
    kv = computed["kv_aware"]
    targets = {
        "kv_aware prefill tokens vs oracle": {"value": kv / oracle, "goal": "<= 1.1x oracle",
                                              "met": kv / oracle <= 1.1},
        "kv_aware prefill tokens vs round_robin": {"value": kv / computed["round_robin"], "goal": "< 1 (fewer)",
                                                   "met": kv < computed["round_robin"]},
        "kv_aware prefill tokens vs cache_aware": {"value": kv / computed["cache_aware"], "goal": "< 1 (fewer)",
                                                   "met": kv < computed["cache_aware"]},
    }
    acc = result["accuracy"]["no_eviction"]["fraction_equal"]
    targets["index_accuracy"] = {"value": acc, "goal": ">= 0.99", "met": acc >= 0.99}
    return {"benchmark": "prefix_routing", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "commit": git_commit(), "machine": machine(), "command": "python benchmarks/prefix_routing.py "
            + " ".join(sys.argv[1:]), "settings": vars(args), "oracle_shared_prefix_prefill_tokens": oracle,
            "mean": table, "runs": runs, "accuracy": result["accuracy"], "targets": targets}


def markdown(out: dict) -> str:
    lines = [f"# Prefix-aware routing ({out['date'][:10]}, commit {out['commit']})", "",
             f"Machine: {out['machine']}. Command: `{out['command']}`. Means over {out['settings']['rounds']} "
             "interleaved rounds; the method is benchmarks/prefix_routing.py's docstring.", ""]
    for workload in ("shared_prefix", "multi_turn"):
        lines += [f"## {workload.replace('_', ' ')}", "",
                  "| policy | prefill tokens computed | hit rate | KV MB pushed | TTFT p50 ms | TTFT p90 ms | req/s |",
                  "|---|---|---|---|---|---|---|"]
        for p in POLICIES:
            m = out["mean"][p][workload]
            lines.append(f"| {p} | {m['prefill_tokens_computed']:.0f} | {m['hit_rate']:.2f} | "
                         f"{m['kv_bytes_pushed'] / 1e6:.1f} | {m['ttft_p50_ms']:.0f} | {m['ttft_p90_ms']:.0f} | "
                         f"{m['throughput_req_s']:.2f} |")
        if workload == "shared_prefix":
            lines.append(f"| oracle (simulated) | {out['oracle_shared_prefix_prefill_tokens']} | | | | | |")
        lines.append("")
    lines += ["## Index accuracy", "", "kv_aware's predicted cached tokens per request against the engine's "
              "reported `cached_tokens`: the shared-prefix requests, then the multi-turn prompts, sent one at a "
              f"time on flushed caches; pools of {out['settings']['accuracy_pool_tokens']} tokens (nothing evicted) "
              f"and of {out['settings']['pool_tokens']} (the run above, evicting).", "",
              "| pools | requests | equal | fraction | predicted more | predicted less |", "|---|---|---|---|---|---|"]
    for name, a in out["accuracy"].items():
        lines.append(f"| {name.replace('_', ' ')} | {a['requests']} | {a['equal']} | {a['fraction_equal']:.3f} | "
                     f"{len(a['over'])} | {len(a['under'])} |")
    lines.append("")
    lines += ["## Targets", "", "| target | value | goal | met |", "|---|---|---|---|"]
    lines += [f"| {k} | {v['value']:.2f} | {v['goal']} | {v['met']} |" for k, v in out["targets"].items()]
    lines += ["", "Reading: the router sees every request here and no cache changes behind its back (no restart, no "
              "flush mid-run, one router), so cache_aware's tree of what it sent is as good as the engines' events. "
              "kv_aware's tokens over the oracle's are whole tenant prefixes (256 tokens each) computed on a second "
              "prefill: its cost counts the pages in flight on the prefill that got a tenant's first request, so a "
              "second request arriving while the first is still computed goes to an idle prefill (a 17-page prompt: "
              "1 page to compute + 17 in flight there against 17 elsewhere: Dynamo's cost). How often that happens "
              "depends on how long a prefill takes on the machine: on this shared 2-core VM, in shared-prefix runs "
              "alternating the two on one stack, kv_aware as committed here computed 4633 to 5657 tokens (1.06-1.29x "
              "the oracle) and as committed before lazy tokenization 4633 to 6425. kv_aware should "
              "gain where caches change out of the router's sight (restarts, flushes, several routers), which this "
              "workload does not exercise.", "",
              "Index accuracy: one request at a time, a request's BlockStored and BlockRemoved events reached the "
              "router before the next decision (every prediction equal on both pools, evicting included). With "
              "requests in flight together a prediction also counts pages sent to a prefill and not stored yet (a "
              "copy that gets there first computes them), and pages evicted after the decision but before the "
              "prefill ran; those are the differences to expect on the concurrent runs above."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tenants", type=int, default=8)
    ap.add_argument("--prefix-tokens", type=int, default=256)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--rate", type=float, default=6.0, help="shared-prefix arrivals, req/s (Poisson)")
    ap.add_argument("--sessions", type=int, default=6)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--pool-tokens", type=int, default=1280, help="each prefill's KV pool, tokens")
    ap.add_argument("--accuracy-pool-tokens", type=int, default=32768,
                    help="each prefill's KV pool for the index accuracy run without eviction, tokens")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="one short round, results not written")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.requests, args.sessions, args.turns = 1, 24, 2, 2
    out = report(asyncio.run(measure(args)), args)
    print(markdown(out))
    if not args.quick:
        results = REPO / "benchmarks" / "results"
        (results / "prefix_routing.json").write_text(json.dumps(out, indent=1) + "\n")
        (results / "prefix_routing.md").write_text(markdown(out))


if __name__ == "__main__":
    main()
