"""``pdserve bench`` against SGLang's own ``bench_serving``, with the same flags on the same runs.

What is measured
----------------
``pdserve bench`` and ``python -m sglang.bench_serving`` (the pinned SGLang's own code, run through
``python -m pd.bench.sglang_serving``, which only gives its GPU-only imports stand-ins) are given the same
flags: the same seeded ShareGPT-format requests (the shipped synthetic file, answers fixed at --output-len
tokens), the same backend, rate and seed. Two targets:

1. **Fixed-latency engine** (the check, target: mean and median TTFT and TPOT within 5%): a stand-in SGLang
   server in its own process whose latencies do not depend on load or on the machine -- first token after
   ``5 ms + 0.05 ms x prompt tokens``, then one token every 4 ms, all by timers, every chunk with text -- so the
   two tools, run one after the other with Poisson arrivals at --rate req/s, measure the same thing and any
   difference is theirs (load generator, recorder, metrics), not the server's.
2. **The embedded default** (informative): ``pdserve router`` over one prefill and one decode reference engine
   serving ``builtin:tiny`` (``--cpu-threads 1``), both tools at once, one request in flight each, the same
   order. A real 2-core machine shared with other work: its latencies move by more than 5% from one second to
   the next, so this table shows agreement in kind, not to 5%. On the native backend the tools also differ by
   design: pdserve bench times the first token by the token count each chunk carries, SGLang by the first chunk
   with non-empty text, which builtin:tiny's byte-level tokenizer often sends one or more tokens later
   (pd.bench.recorder).

Reproduce
---------
    .venv/bin/python benchmarks/serving.py            # writes benchmarks/results/serving_compare.{json,md}
    .venv/bin/python benchmarks/serving.py --quick    # a short run, not written
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import subprocess
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
TARGET = 0.05
METRICS = ("mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "mean_itl_ms", "mean_e2e_latency_ms",
           "request_throughput")


class Stack:
    """A router over one prefill and one decode reference engine, subprocesses of this process."""

    def __init__(self, logs: Path):
        port, pport, bport, dport = free_ports(4)
        py = [sys.executable, "-m", "pd.cli"]
        self.url = f"http://127.0.0.1:{port}"
        self.procs = [
            LoggedGroup("prefill", [*py, "engine", "--disaggregation-mode", "prefill", "--port", str(pport),
                                    "--disaggregation-bootstrap-port", str(bport), "--cpu-threads", "1"],
                        logs / "prefill.log"),
            LoggedGroup("decode", [*py, "engine", "--disaggregation-mode", "decode", "--port", str(dport),
                                   "--cpu-threads", "1"], logs / "decode.log"),
            LoggedGroup("router", [*py, "router", "--port", str(port), "--prefill", f"http://127.0.0.1:{pport}",
                                   str(bport), "--decode", f"http://127.0.0.1:{dport}"], logs / "router.log"),
        ]

    async def ready(self, timeout: float = 300) -> None:
        async with httpx.AsyncClient() as client:
            async def up() -> bool:
                for p in self.procs:
                    if not p.alive():
                        raise RuntimeError(f"{p.name} exited:\n{p.tail()}")
                return (await client.get(self.url + "/health_generate", timeout=10)).status_code == 200

            await async_wait_until(up, timeout, interval=0.5, what="PD stack healthy", retry=(httpx.HTTPError,))

    def stop(self) -> None:
        for p in self.procs:
            p.stop()


# The fixed-latency engine: seconds.
STUB_TTFT_BASE, STUB_TTFT_PER_TOKEN, STUB_GAP = 0.005, 0.00005, 0.004


def serve_stub(port: int) -> None:
    """SGLang's /generate and /v1/completions streams with load-independent timings (see the module docstring)."""
    from aiohttp import web

    async def stream(request, native: bool):
        body = await request.json()
        prompt = body.get("text") if native else body.get("prompt")
        n_in = len(prompt) if isinstance(prompt, (str, list)) else 1
        n = body["sampling_params"]["max_new_tokens"] if native else body["max_tokens"]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        t0 = time.perf_counter()
        for k in range(1, n + 1):
            due = t0 + STUB_TTFT_BASE + STUB_TTFT_PER_TOKEN * n_in + (k - 1) * STUB_GAP
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            if native:
                chunk = {"text": "ab" * k, "meta_info": {"completion_tokens": k, "prompt_tokens": n_in}}
            else:
                chunk = {"choices": [{"index": 0, "text": "ab", "finish_reason": None}]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def native(request):
        return await stream(request, True)

    async def completions(request):
        return await stream(request, False)

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": "stub"}]})

    async def empty(request):
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/generate", native)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    for path in ("/server_info", "/get_server_info", "/get_model_info", "/health"):
        app.router.add_get(path, empty)
    web.run_app(app, host="127.0.0.1", port=port, print=None)


class StubProc:
    """The fixed-latency engine as a subprocess (``benchmarks/serving.py --serve-stub PORT``)."""

    def __init__(self, logs: Path):
        self.port = free_ports(1)[0]
        self.url = f"http://127.0.0.1:{self.port}"
        self.procs = [LoggedGroup("stub", [sys.executable, str(Path(__file__).resolve()), "--serve-stub",
                                           str(self.port)], logs / "stub.log")]

    async def ready(self, timeout: float = 60) -> None:
        async with httpx.AsyncClient() as client:
            async def up() -> bool:
                if not self.procs[0].alive():
                    raise RuntimeError(f"stub exited:\n{self.procs[0].tail()}")
                return (await client.get(self.url + "/v1/models", timeout=5)).status_code == 200

            await async_wait_until(up, timeout, interval=0.2, what="stub up", retry=(httpx.HTTPError,))

    def stop(self) -> None:
        self.procs[0].stop()


def tool_argv(tool: str, backend: str, url: str, args, out: Path, load: list[str]) -> list[str]:
    """The command line of one tool: the same flags for both (SGLang's names)."""
    from pd.engines.models.builtin_model import resolve_model_path

    module = "pd.cli" if tool == "pdserve" else "pd.bench.sglang_serving"
    argv = [sys.executable, "-m", module] + (["bench"] if tool == "pdserve" else [])
    return argv + ["--backend", backend, "--base-url", url, "--dataset-name", "sharegpt", "--dataset-path",
                   str(REPO / "pd" / "bench" / "data" / "sharegpt_synthetic.json"), "--tokenizer",
                   resolve_model_path("builtin:tiny"), "--num-prompts", str(args.num_prompts),
                   "--sharegpt-output-len", str(args.output_len), "--sharegpt-context-len", "1024",
                   "--seed", "7", "--disable-tqdm", "--output-file", str(out), *load]


def run_pair(name: str, backend: str, url: str, args, work: Path, load: list[str], together: bool) -> dict:
    """Both tools, at once (``together``) or one after the other; their results (SGLang's JSONL line,
    pdserve's run) and wall times."""
    outs = {"pdserve": work / f"{name}-pdserve-{backend}.json", "sglang": work / f"{name}-sglang-{backend}.jsonl"}
    procs, results = {}, {}
    for tool, out in outs.items():
        log = open(work / f"{tool}-{backend}.log", "wb")
        procs[tool] = (subprocess.Popen(tool_argv(tool, backend, url, args, out, load), cwd=REPO, stdout=log,
                                        stderr=subprocess.STDOUT), log, time.perf_counter())
        if not together:
            procs[tool][0].wait(timeout=args.num_prompts * 5 + 180)
    for tool, (proc, log, t0) in procs.items():
        rc = proc.wait(timeout=args.num_prompts * 5 + 180)
        log.close()
        if rc != 0:
            raise RuntimeError(f"{tool} {backend} exited {rc}:\n{(work / f'{tool}-{backend}.log').read_text()[-3000:]}")
        data = outs[tool].read_text()
        run = json.loads(data)["runs"][0] if tool == "pdserve" else json.loads(data.splitlines()[-1])
        results[tool] = {k: run[k] for k in METRICS + ("completed",)}
        results[tool]["wall_s"] = time.perf_counter() - t0
    return results


def compare(pair: dict) -> dict:
    """pdserve / SGLang for each metric, and whether TTFT and TPOT (mean, median) are within the target."""
    ratios = {k: pair["pdserve"][k] / pair["sglang"][k] for k in METRICS if pair["sglang"][k]}
    checked = ("mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms", "median_tpot_ms")
    return {"ratio": ratios, "within_target": all(abs(ratios[k] - 1) <= TARGET for k in checked)}


def markdown(report: dict) -> str:
    m, a = report["machine"], report["args"]
    lines = [
        "# pdserve bench vs sglang.bench_serving", "",
        f"- Device: {m.get('cpu_model')}, {m.get('cpu_cores')} cores, {m.get('mem_gib')} GiB, no GPU",
        f"- Date: {report['started_utc']} ({report['wall_s']:.0f} s)",
        f"- Measured at commit {report['commit']} (+ the benchmarks/serving.py committed with this file)",
        f"- Command: `{report['command']}`",
        "- Anchor, same runs: SGLang 0.5.23's own `bench_serving` (through `python -m pd.bench.sglang_serving`), "
        "the same flags and seed",
        f"- Workload: the shipped synthetic ShareGPT-format prompts, {a['output_len']} output tokens each, "
        f"{a['num_prompts']} requests per tool; fixed-latency engine: Poisson {a['rate']:g} req/s, the tools one "
        "after the other; embedded default (router + PD pair of reference engines): both tools at once, one "
        "request in flight each", "",
    ]
    for name, t in report["targets"].items():
        lines += [f"## {name}", "", "| backend | metric | pdserve bench | sglang.bench_serving | ratio |",
                  "|---|---|---|---|---|"]
        for backend, res in t["backends"].items():
            for k in METRICS:
                pd_v, sg_v = res["pair"]["pdserve"][k], res["pair"]["sglang"][k]
                lines.append(f"| {backend} | {k} | {pd_v:.2f} | {sg_v:.2f} | {res['ratio'].get(k, float('nan')):.3f} |")
        lines.append("")
        for backend, res in t["backends"].items():
            verdict = "met" if res["within_target"] else "missed"
            lines.append(f"- {backend}: TTFT and TPOT (mean, median) within {TARGET:.0%}: **{verdict}**")
        lines.append("")
    lines += [report["why"], ""]
    return "\n".join(lines)


WHY = """How to read it: against the fixed-latency engine the server answers every request on the same timers,
so the ratios are the tools' own agreement (load generator, recorder, metrics); that is the 5% check. On
`sglang-oai` both tools record with SGLang's OpenAI recorder; on `sglang` (native `/generate`) pdserve bench uses
its own (first token = first chunk that carries one), SGLang's takes the first chunk with non-empty text: the same
times when every chunk has text, as here. On the embedded default the tools run at once on a loaded 2-core machine,
and builtin:tiny's byte-level tokenizer sends an empty first chunk for most prompts (21 of 30 of this file): there
SGLang's native TTFT is later by one or more token gaps and its TPOT lower, by design of its recorder.
Request throughput is not part of the check: each tool draws its own Poisson gaps (numpy's global generator in
SGLang, a seeded Generator here), and over 120 requests the realised rates differ by several percent."""


async def main(args) -> dict:
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    t0 = time.perf_counter()
    targets = {}
    with tempfile.TemporaryDirectory(prefix="pdserve-serving-") as tmp:
        work = Path(tmp)
        for name, make, load, together in (
                ("fixed-latency engine", StubProc, ["--request-rate", str(args.rate)], False),
                ("embedded default", Stack, ["--request-rate", "inf", "--max-concurrency", "1"], True)):
            target = make(work)
            try:
                await target.ready()
                backends = {}
                for backend in ("sglang-oai", "sglang"):
                    pair = await asyncio.to_thread(run_pair, name.split()[0], backend, target.url, args, work, load,
                                                   together)
                    backends[backend] = {"pair": pair, **compare(pair)}
                    print(name, backend, json.dumps(backends[backend]["ratio"]), flush=True)
            finally:
                target.stop()
            targets[name] = {"load": load, "together": together, "backends": backends}
    return {"benchmark": "serving_compare", "started_utc": started, "wall_s": time.perf_counter() - t0,
            "commit": git_commit(), "machine": machine(), "command": "benchmarks/serving.py" +
            (" --quick" if args.quick else ""), "args": vars(args), "target": TARGET, "targets": targets,
            "why": WHY}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--serve-stub", type=int, metavar="PORT", help="run the fixed-latency engine (internal)")
    ap.add_argument("--rate", type=float, default=8.0, help="req/s of each tool against the fixed-latency engine")
    ap.add_argument("--num-prompts", type=int, default=120)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--quick", action="store_true", help="30 requests per tool; results not written")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    a = ap.parse_args()
    if a.serve_stub:
        serve_stub(a.serve_stub)
        raise SystemExit(0)
    if a.quick:
        a.num_prompts = 30
    report = asyncio.run(main(a))
    if not a.quick:
        out = Path(a.out)
        (out / "serving_compare.json").write_text(json.dumps(report, indent=1) + "\n")
        (out / "serving_compare.md").write_text(markdown(report))
        print(f"wrote {out / 'serving_compare.md'}")
    print(markdown(report))
