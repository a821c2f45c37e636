"""``pdserve profile``: measure a running engine's costs over HTTP and write them as a planner profile.

    pdserve profile --url http://127.0.0.1:30000 --tp-size 1 --output profile.json \\
        [--pd-url ROUTER --prefill-url PREFILL --decode-url DECODE] [--host-cores 2]

What is measured, on SGLang's native ``/generate`` with random ``input_ids`` (no tokenizer, no prefix-cache hits):

- prefill (``--url``, a whole engine: SGLang's ``--disaggregation-mode null`` or the reference engine): the wall
  time of ``batch_size`` concurrent requests of ``input_len`` tokens each with ``max_new_tokens=1``, from sending
  to the last answer, at every ``--prompt-lens`` x ``--prefill-batch-sizes``; median of ``--repeats``.
- decode (``--url``): ``batch_size`` concurrent streams of ``--decode-steps`` tokens on prompts of ``context``
  tokens (``ignore_eos``). The decode iteration time is the median inter-token latency inside the window where
  every stream of the batch is decoding (after the last first token, before the first finish), so the prefills
  of the batch do not count; the point's context is the prompt plus half the steps. A batch whose streams never
  all decode at once is sent again (3 tries), then left out with a message.
- KV transfer and decode admission (``--pd-url``, a router over one prefill and one decode, with their own URLs
  for ``/metrics``): one request at a time at each prompt length; from the prefill's ``/metrics``,
  ``sglang:kv_transfer_latency_ms`` (forward end to KV written) and the bytes moved
  (``pdserve_kv_transfer_bytes_total``, else ``sglang:kv_transfer_total_mb`` x 2^20); from the decode's,
  ``sglang:per_stage_req_latency_seconds{stage="decode_waiting"}`` (KV arrived to first token out: the KV
  load), when the engine exports it. With ``--host-cores`` (engines sharing one machine's CPU), also the CPU a
  request costs the prefill, decode and router processes beyond that model work (``process_cpu_seconds_total``),
  per request and per output token. Without ``--pd-url``, give ``--kv-bytes-per-token`` and
  ``--transfer-bandwidth-gb-s`` (numbers measured elsewhere; the profile names them as given by hand).

Engine limits come from ``/server_info``: the reference engine runs one prompt at a time (prefill batch 1) and
its KV pool size; SGLang's ``max_running_requests`` and ``chunked_prefill_size``. A reference engine's
``--cpu-threads`` become the TP entry's ``engine_args``. An existing ``--output`` keeps its other TP entries (one
run per TP size builds a multi-TP profile).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import httpx

from pd.planner.profile import ProfileError, load_profile, parse_profile

STAGE_METRIC = "sglang:per_stage_req_latency_seconds"


def _ints(text: str, flag: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: give comma-separated integers") from None
    if not vals or min(vals) < 1:
        raise ValueError(f"{flag} {text!r}: every value must be >= 1")
    return sorted(set(vals))


class Prober:
    """Sends the measuring requests (random token ids in ``[lo, hi)``, a fresh prompt per request)."""

    def __init__(self, client: httpx.AsyncClient, token_range: tuple[int, int], seed: int = 0):
        self.client = client
        self.lo, self.hi = token_range
        self.rng = random.Random(seed)

    def prompt(self, n: int) -> list[int]:
        return [self.rng.randrange(self.lo, self.hi) for _ in range(n)]

    async def one(self, url: str, input_len: int, max_new_tokens: int) -> None:
        body = {"input_ids": self.prompt(input_len),
                "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}
        r = await self.client.post(url + "/generate", json=body)
        if r.status_code != 200:
            raise RuntimeError(f"{url}/generate answered {r.status_code}: {r.text[:300]}")

    async def prefill_batch(self, url: str, batch_size: int, input_len: int) -> float:
        """Wall seconds of ``batch_size`` concurrent one-token requests of ``input_len`` tokens."""
        t0 = time.perf_counter()
        await asyncio.gather(*(self.one(url, input_len, 1) for _ in range(batch_size)))
        return time.perf_counter() - t0

    async def stream(self, url: str, input_len: int, steps: int) -> list[tuple[float, int]]:
        """(time, tokens so far) per streamed chunk of one request."""
        body = {"input_ids": self.prompt(input_len), "stream": True,
                "sampling_params": {"max_new_tokens": steps, "temperature": 0, "ignore_eos": True}}
        marks = []
        async with self.client.stream("POST", url + "/generate", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"{url}/generate answered {r.status_code}: {(await r.aread())[:300]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                n = chunk.get("meta_info", {}).get("completion_tokens") or len(chunk.get("output_ids") or [])
                marks.append((time.perf_counter(), int(n)))
        return marks

    async def decode_iteration(self, url: str, batch_size: int, context: int, steps: int,
                               attempts: int = 3) -> Optional[float]:
        """Median seconds per token while all ``batch_size`` streams decode (module docstring); None when the
        window held no interval in any of ``attempts`` tries. An empty window means a stream finished before
        the last one started (too few steps for the batch, or a busy host delaying one request's start), so
        the batch is sent again rather than the point dropped at the first miss."""
        for _ in range(attempts):
            streams = await asyncio.gather(*(self.stream(url, context, steps) for _ in range(batch_size)))
            start = max(s[0][0] for s in streams)
            end = min(s[-1][0] for s in streams)
            gaps = []
            for s in streams:
                for (t0, n0), (t1, n1) in zip(s, s[1:]):
                    if t0 >= start and t1 <= end and n1 > n0:
                        gaps.append((t1 - t0) / (n1 - n0))
            if gaps:
                return statistics.median(gaps)
        return None


def _samples(text: str) -> list:
    from prometheus_client.parser import text_string_to_metric_families

    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]


def metric_sum(samples: list, name: str, **labels) -> Optional[float]:
    """Sum of the samples named ``name`` whose labels include ``labels``; None when there is none."""
    vals = [s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    return sum(vals) if vals else None


async def _metrics(client: httpx.AsyncClient, url: str) -> list:
    r = await client.get(url + "/metrics")
    r.raise_for_status()
    return _samples(r.text)


async def measure_pd(prober: Prober, pd_url: str, prefill_url: str, decode_url: str, lens: list[int],
                     repeats: int) -> tuple[list[dict], list[dict], list[float]]:
    """Transfer points, decode admit points and bytes per token, one request at a time through ``pd_url``.

    Raises:
        RuntimeError: the prefill exports no KV transfer metrics, or a request fails.
    """
    transfer, admit, per_token = [], [], []
    for _ in range(2):  # the first handoffs pay the transfer engines' connection setup
        await prober.one(pd_url, min(lens), 1)
    for n in lens:
        p0, d0 = await _metrics(prober.client, prefill_url), await _metrics(prober.client, decode_url)
        for _ in range(repeats):
            await prober.one(pd_url, n, 1)
        p1, d1 = await _metrics(prober.client, prefill_url), await _metrics(prober.client, decode_url)

        def delta(a, b, name, **lb) -> Optional[float]:
            # a labelled series first appears with its first observation: absent before counts as 0
            x, y = metric_sum(a, name, **lb), metric_sum(b, name, **lb)
            return None if y is None else y - (x or 0.0)

        count = delta(p0, p1, "sglang:kv_transfer_latency_ms_count")
        ms = delta(p0, p1, "sglang:kv_transfer_latency_ms_sum")
        if not count:
            raise RuntimeError(f"{prefill_url}/metrics: no sglang:kv_transfer_latency_ms observations after "
                               f"{repeats} requests through {pd_url} (is it the prefill behind that router?)")
        nbytes = delta(p0, p1, "pdserve_kv_transfer_bytes_total")
        if nbytes is None:
            mb = delta(p0, p1, "sglang:kv_transfer_total_mb_sum")
            nbytes = None if mb is None else mb * 2**20
        src = f"{prefill_url}/metrics sglang:kv_transfer_latency_ms, {int(count)} requests of {n} tokens"
        if nbytes:
            transfer.append({"bytes": int(nbytes / count), "seconds": ms / count / 1e3, "source": src})
            per_token.append(nbytes / count / n)
        wait_n = delta(d0, d1, f"{STAGE_METRIC}_count", stage="decode_waiting")
        wait_s = delta(d0, d1, f"{STAGE_METRIC}_sum", stage="decode_waiting")
        if wait_n:
            admit.append({"input_len": n, "seconds": wait_s / wait_n,
                          "source": f"{decode_url}/metrics {STAGE_METRIC}{{stage=decode_waiting}}"})
    return transfer, admit, per_token


async def measure_host_cpu(prober: Prober, pd_url: str, urls: list[str], lens: list[int], repeats: int,
                           steps: int) -> Optional[list[tuple[int, int, list[float]]]]:
    """CPU seconds one PD request costs each process at ``urls`` (the prefill, the decode, the router at ``pd_url``;
    their ``process_cpu_seconds_total``), one request at a time: ``(input_len, max_new_tokens, [seconds per
    process])`` at every prompt length with one output token and at the shortest with ``steps``; None when one of
    them does not export the metric."""
    async def cpu() -> Optional[list[float]]:
        vals = [metric_sum(await _metrics(prober.client, u), "process_cpu_seconds_total") for u in urls]
        return None if any(v is None for v in vals) else vals

    out = []
    for n, new in [(n, 1) for n in lens] + [(min(lens), steps)]:
        c0 = await cpu()
        if c0 is None:
            return None
        for _ in range(repeats):
            await prober.one(pd_url, n, new)
        out.append((n, new, [(b - a) / repeats for a, b in zip(c0, await cpu())]))
    return out


def host_overheads(samples: list[tuple[int, int, list[float]]], entry: dict) -> dict[str, float]:
    """The CPU each process spends beyond the model work the entry's curves account for (that work keeps
    ``host_cores`` cores busy): the prefill's per request (median over prompt lengths of its CPU less the prefill),
    the decode's per request (less the KV load) and per output token (what the long request costs beyond that and
    its decode steps), the router's per request and per token. Each at least 0."""
    from pd.planner.profile import DecodeCosts, PrefillCosts

    pre, dec = PrefillCosts(**entry["prefill"]), DecodeCosts(**entry["decode"])
    k = entry.get("host_cores") or 1.0
    ones = [(n, c) for n, new, c in samples if new == 1]
    n, new, (lp, ld, lr) = next(x for x in samples if x[1] > 1)
    out = {
        "prefill_request": statistics.median(max(0.0, c[0] - k * pre.seconds(1, m)) for m, c in ones),
        "decode_request": statistics.median(max(0.0, c[1] - k * dec.admit_seconds(m)) for m, c in ones),
        "router_request": statistics.median(c[2] for _, c in ones),
    }
    steps = k * (dec.admit_seconds(n) + (new - 1) * dec.step_seconds(1, n + new / 2))
    out["decode_token"] = max(0.0, (ld - steps - out["decode_request"]) / (new - 1))
    out["router_token"] = max(0.0, (lr - out["router_request"]) / (new - 1))
    return out


async def measure(args) -> dict:
    """Measure and return the profile mapping (module docstring)."""
    lens = _ints(args.prompt_lens, "--prompt-lens")
    pbatches = _ints(args.prefill_batch_sizes, "--prefill-batch-sizes")
    dbatches = _ints(args.decode_batch_sizes, "--decode-batch-sizes")
    contexts = _ints(args.decode_contexts, "--decode-contexts")
    try:
        lo, hi = (int(x) for x in args.token_id_range.split(","))
    except ValueError:
        raise ValueError(f"--token-id-range {args.token_id_range!r}: give LO,HI (e.g. 3,259)") from None
    if not 0 <= lo < hi:
        raise ValueError(f"--token-id-range {args.token_id_range!r}: need 0 <= LO < HI")
    url = args.url.rstrip("/")
    now = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    async with httpx.AsyncClient(timeout=args.request_timeout, trust_env=False) as client:
        info = (await client.get(url + "/server_info")).json()
        model = (await client.get(url + "/model_info")).json()
        prober = Prober(client, (lo, hi), args.seed)
        reference = info.get("engine") == "pdserve-reference"
        for _ in range(2):  # the first requests pay lazy initialisation
            await prober.one(url, min(lens), 4)
        prefill = []
        for b in pbatches:
            for n in lens:
                t = statistics.median([await prober.prefill_batch(url, b, n) for _ in range(args.repeats)])
                prefill.append({"batch_size": b, "input_len": n, "seconds": t})
        decode = []
        for b in dbatches:
            for c in contexts:
                runs = [await prober.decode_iteration(url, b, c, args.decode_steps) for _ in range(args.repeats)]
                runs = [x for x in runs if x is not None]
                if runs:
                    decode.append({"batch_size": b, "context_len": c + args.decode_steps // 2,
                                   "seconds": statistics.median(runs)})
                else:
                    print(f"pdserve profile: decode batch {b} at context {c}: the streams never all decoded at "
                          f"once; point left out (raise --decode-steps)", file=sys.stderr)
        if not decode:
            raise RuntimeError("no decode point measured: raise --decode-steps above the largest batch size")
        src = f"pdserve profile --url {url}, {now}, median of {args.repeats}"
        entry: dict = {
            "prefill": {"points": prefill, "source": src + " (batch of concurrent max_new_tokens=1 requests)",
                        "max_batch_size": 1 if reference else int(info.get("max_running_requests") or 1)},
            "decode": {"points": decode, "source": src + " (median ITL while the whole batch decodes)"},
        }
        if not reference and info.get("chunked_prefill_size"):
            entry["prefill"]["max_batch_tokens"] = int(info["chunked_prefill_size"])
        if not reference and info.get("max_running_requests"):
            entry["decode"]["max_batch_size"] = int(info["max_running_requests"])
        if reference and "cpu_threads" in info:
            entry["engine_args"] = ["--cpu-threads", str(info["cpu_threads"])]
            if args.host_cores:  # on a shared host a reference replica keeps one core busy per torch thread
                entry["host_cores"] = float(info["cpu_threads"])
        kv_per_token, kv_src = args.kv_bytes_per_token, "given by hand (--kv-bytes-per-token)"
        host_cpu = None
        if args.pd_url:
            if not (args.prefill_url and args.decode_url):
                raise ValueError("--pd-url needs --prefill-url and --decode-url (their /metrics)")
            transfer, admit, per_token = await measure_pd(prober, args.pd_url.rstrip("/"),
                                                          args.prefill_url.rstrip("/"), args.decode_url.rstrip("/"),
                                                          lens, args.repeats)
            if transfer:
                entry["transfer"] = {"points": transfer, "source": f"pdserve profile --pd-url {args.pd_url}, {now}"}
            if admit:
                entry["decode"]["admit_points"] = admit
                # the reference decode's pool bounds the running sequences' KV
                dinfo = (await client.get(args.decode_url.rstrip("/") + "/server_info")).json()
                pool = dinfo.get("scheduler_info", {}).get("max_total_num_tokens")
                if pool:
                    entry["decode"]["max_kv_tokens"] = int(pool)
            if per_token and kv_per_token is None:
                kv_per_token = statistics.median(per_token)
                kv_src = f"KV bytes moved per prompt token through {args.pd_url} (prefill /metrics)"
            if args.host_cores:
                cpu_urls = [args.prefill_url.rstrip("/"), args.decode_url.rstrip("/"), args.pd_url.rstrip("/")]
                # process_cpu_seconds_total counts clock ticks (10 ms): enough requests that a few ms each show
                host_cpu = await measure_host_cpu(prober, args.pd_url.rstrip("/"), cpu_urls, lens,
                                                  max(10, args.repeats), args.decode_steps)
        if "transfer" not in entry:
            if args.transfer_bandwidth_gb_s is None or kv_per_token is None:
                raise ValueError("without --pd-url give --kv-bytes-per-token and "
                                 "--transfer-bandwidth-gb-s (the KV transfer cannot be measured on one engine)")
            entry["transfer"] = {"bandwidth_gb_s": args.transfer_bandwidth_gb_s,
                                 "latency_s": args.transfer_latency_ms / 1e3,
                                 "source": "given by hand (--transfer-bandwidth-gb-s, --transfer-latency-ms)"}
    data = {
        "schema": "pdserve-profile/1",
        "name": args.name or f"{model.get('served_model_name') or model.get('model_path')} on {url}",
        "model": str(model.get("model_path") or "unknown"),
        "engine": "reference" if reference else "sglang",
        "hardware": args.hardware, "date": now,
        "kv_bytes_per_token": kv_per_token, "kv_bytes_per_token_source": kv_src,
        "tp": {str(args.tp_size): entry},
    }
    if args.host_cores:
        data["host"] = {"cores": args.host_cores, "source": "--host-cores: replicas share this machine's cores"}
        if host_cpu:
            o = host_overheads(host_cpu, entry)
            entry["prefill"]["cpu_overhead_per_request_s"] = o["prefill_request"]
            entry["decode"]["cpu_overhead_per_request_s"] = o["decode_request"]
            entry["decode"]["cpu_overhead_per_token_s"] = o["decode_token"]
            data["host"].update(cpu_per_request_s=o["router_request"], cpu_per_token_s=o["router_token"],
                                cpu_overhead_source=(
                                    "process_cpu_seconds_total per request through the router at "
                                    f"{args.pd_url} (the engines': their TP entries, less the profiled prefill, "
                                    f"KV load and decode steps) ({now})"))
    return {k: v for k, v in data.items() if v is not None}


def merge(new: dict, path: Path) -> dict:
    """``new`` with the TP entries of the profile at ``path`` it does not replace (the new run's top-level
    fields win).

    Raises:
        ProfileError: the existing file is not a valid profile.
    """
    if not path.exists():
        return new
    old = load_profile(path).dump()
    return {**old, **{k: v for k, v in new.items() if k != "tp"}, "tp": {**old["tp"], **new["tp"]}}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve profile", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="a whole engine (null mode) to measure prefill and decode on")
    p.add_argument("--tp-size", type=int, default=1, help="the TP size this engine runs at. Default: 1.")
    p.add_argument("--output", required=True, help="profile JSON to write (an existing one keeps other TP sizes)")
    p.add_argument("--pd-url", default=None, help="a router over one prefill and one decode (KV transfer)")
    p.add_argument("--prefill-url", default=None, help="that prefill's URL (its /metrics)")
    p.add_argument("--decode-url", default=None, help="that decode's URL (its /metrics)")
    p.add_argument("--prompt-lens", default="16,128,512,1024,1536", help="prompt lengths, tokens")
    p.add_argument("--prefill-batch-sizes", default="1,2,4", help="concurrent prompts per prefill point")
    p.add_argument("--decode-batch-sizes", default="1,2,4,8,16", help="concurrent streams per decode point")
    p.add_argument("--decode-contexts", default="16,512,1024", help="prompt tokens of the decode streams")
    p.add_argument("--decode-steps", type=int, default=48, help="tokens per decode stream. Default: 48.")
    p.add_argument("--repeats", type=int, default=3, help="runs per point (median). Default: 3.")
    p.add_argument("--token-id-range", default="3,259", help="prompt token ids are drawn from [lo, hi)")
    p.add_argument("--kv-bytes-per-token", type=float, default=None, help="KV bytes per token (without --pd-url)")
    p.add_argument("--transfer-bandwidth-gb-s", type=float, default=None, help="KV transfer GB/s (without --pd-url)")
    p.add_argument("--transfer-latency-ms", type=float, default=0.0, help="KV transfer fixed cost, ms")
    p.add_argument("--host-cores", type=float, default=None,
                   help="CPU engines sharing one machine: the cores they share (profile host.cores)")
    p.add_argument("--name", default=None, help="profile name. Default: model and URL.")
    p.add_argument("--hardware", default=None, help="what it ran on, in words")
    p.add_argument("--seed", type=int, default=0, help="prompt token seed")
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds one request may take")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run ``pdserve profile``; returns the exit status (2 for bad input, 1 when the engine fails)."""
    args = parser().parse_args(argv)
    if args.repeats < 1 or args.decode_steps < 2:
        print("pdserve profile: --repeats must be >= 1 and --decode-steps >= 2", file=sys.stderr)
        return 2
    out = Path(args.output)
    try:
        data = merge(asyncio.run(measure(args)), out)
        parse_profile(data, args.output)
    except (ProfileError, ValueError) as e:
        print(f"pdserve profile: {e}", file=sys.stderr)
        return 2
    except (httpx.HTTPError, RuntimeError) as e:
        print(f"pdserve profile: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    out.write_text(json.dumps(data, indent=1) + "\n")
    entry = data["tp"][str(args.tp_size)]
    print(f"wrote {out}: TP {args.tp_size}, {len(entry['prefill']['points'])} prefill, "
          f"{len(entry['decode']['points'])} decode, {len(entry['transfer'].get('points', []))} transfer points")
    return 0
