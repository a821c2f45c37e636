"""Router memory under many slow streams (benchmarks/router.py ``--memory-streams``): a fresh router's RSS before,
during and after waves of concurrent slow SSE streams, read from /proc over its process group."""

from __future__ import annotations

import asyncio
import shlex
import time
from collections import Counter
from pathlib import Path

from router_contenders import TOKENS, Contender, Stubs, request_body
from router_procs import group_hwm_mb, group_rss_mb, http, rnd


async def _slow_streams(url: str, n: int, tokens: int, pgid: int, samples: list[tuple[float, float]]) -> dict:
    import aiohttp

    stop = asyncio.Event()

    async def sample():
        t0 = time.perf_counter()
        while not stop.is_set():
            samples.append((time.perf_counter() - t0, group_rss_mb(pgid)))
            try:
                await asyncio.wait_for(stop.wait(), 0.05)
            except asyncio.TimeoutError:
                pass

    async def one(session) -> tuple[int, bool]:
        events, done = 0, False
        async with session.post(url + "/generate", json=request_body(True, tokens)) as r:
            if r.status != 200:
                return 0, False
            buf = b""
            async for chunk in r.content.iter_any():
                buf += chunk
                while (cut := buf.find(b"\n\n")) >= 0:
                    ev, buf = buf[:cut], buf[cut + 2:]
                    if ev == b"data: [DONE]":
                        done = True
                    elif ev.startswith(b"data:"):
                        events += 1
        return events, done

    sampler = asyncio.ensure_future(sample())
    t0 = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        results = await asyncio.gather(*(one(session) for _ in range(n)), return_exceptions=True)
    elapsed = time.perf_counter() - t0
    stop.set()
    await sampler
    whole = sum(1 for r in results if not isinstance(r, BaseException) and r == (tokens, True))
    failures = Counter(type(r).__name__ if isinstance(r, BaseException) else f"events={r[0]},done={r[1]}"
                       for r in results if isinstance(r, BaseException) or r != (tokens, True))
    return {"streams": n, "whole_streams": whole, "failures": dict(failures), "seconds": elapsed}


def memory(args, logdir: Path, name: str) -> dict:
    """RSS of a fresh ``name`` router before / during / after ``args.memory_waves`` waves of
    ``args.memory_streams`` concurrent slow streams (a second wave peaking where the first did shows
    memory reused, not leaked)."""
    stubs = Stubs("mem_", args.load_cpus, logdir, token_interval=args.memory_token_interval)
    c = Contender(name, stubs, args.router_cpus, logdir, args.sglang_router_dir, tag="mem_",
                  pdserve_tree=args.pdserve_tree, custom=args.custom)
    try:
        c.ready()
        # Warm-up: code paths, pools and caches the router keeps anyway.
        for _ in range(64):
            http("POST", c.url + "/generate", request_body(False), timeout=30)
        for _ in range(4):
            http("POST", c.url + "/generate", request_body(True, 2), timeout=30)
        time.sleep(1.0)
        pgid = c.proc.pid
        before = group_rss_mb(pgid)
        s0 = stubs.stats()
        samples: list[tuple[float, float]] = []
        waves = []
        for wave in range(args.memory_waves):
            if wave:
                time.sleep(10.0)  # between waves: what the first one left behind, then the same load again
            print(f"[router bench] memory: {args.memory_streams} slow streams through {name}, wave {wave + 1}/"
                  f"{args.memory_waves} (RSS {group_rss_mb(pgid):.1f} MB)", flush=True)
            wave_samples: list[tuple[float, float]] = []
            res = asyncio.run(_slow_streams(c.url, args.memory_streams, TOKENS, pgid, wave_samples))
            s1 = stubs.stats()
            res["max_concurrent_streams_at_decode"] = s1["decode"]["max_active_streams"]
            res["peak_mb"] = rnd(max(r for _, r in wave_samples), 1) if wave_samples else None
            res["rss_at_start_mb"] = rnd(wave_samples[0][1], 1) if wave_samples else None
            waves.append(res)
            t0 = samples[-1][0] + 10.0 if samples else 0.0
            samples += [(t0 + t, r) for t, r in wave_samples]
        time.sleep(1.0)
        after_1s = group_rss_mb(pgid)
        time.sleep(9.0)
        after_10s = group_rss_mb(pgid)
        time.sleep(max(0.0, args.memory_settle - 10.0))
        after_settle = group_rss_mb(pgid)
        peak = max(rss for _, rss in samples) if samples else None
        out = {
            "contender": name, "command": shlex.join(c.argv),
            "streams": args.memory_streams, "waves": args.memory_waves,
            "whole_streams": sum(w["whole_streams"] for w in waves),
            "failures": dict(sum((Counter(w["failures"]) for w in waves), Counter())),
            "token_interval_s": args.memory_token_interval, "tokens_per_stream": TOKENS,
            "max_concurrent_streams_at_decode": max(w["max_concurrent_streams_at_decode"] for w in waves),
            "prefill_requests": stubs.stats()["prefill"]["requests"] - s0["prefill"]["requests"],
            "per_wave": waves,
            "rss_mb": {"before": rnd(before, 1), "peak_sampled": rnd(peak, 1), "vm_hwm": rnd(group_hwm_mb(pgid), 1),
                       "after_1s": rnd(after_1s, 1), "after_10s": rnd(after_10s, 1),
                       f"after_{args.memory_settle:.0f}s": rnd(after_settle, 1)},
            "added_mb_peak": rnd(peak - before, 1) if peak else None,
            "added_mb_after_10s": rnd(after_10s - before, 1),
            "settle_s": args.memory_settle, "added_mb_after_settle": rnd(after_settle - before, 1),
            "rss_timeline_mb": [[round(t, 2), round(r, 1)] for t, r in samples[::10]],
        }
        print(f"[router bench] memory {name}: before {before:.1f} MB, peak per wave "
              f"{', '.join(str(w['peak_mb']) for w in waves)} MB, after 10 s {after_10s:.1f} MB, "
              f"after {args.memory_settle:.0f} s {after_settle:.1f} MB; {out['whole_streams']}/"
              f"{args.memory_streams * args.memory_waves} whole streams, max open at decode "
              f"{out['max_concurrent_streams_at_decode']}", flush=True)
        return out
    finally:
        c.stop()
        stubs.stop()
