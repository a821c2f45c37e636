"""PD router throughput, added latency and memory: pdserve's router vs SGLang's Rust gateway vs the
Shepherd Model Gateway vs SGLang's Python mini_lb vs no router at all, on the same stub engines, in one run.

What is measured
----------------
* **Contenders** (same stub engines, same load, one at a time):
  ``direct``  - the load generator talks to the decode stub itself (no router; the baseline);
  ``pdserve`` - ``pdserve router --prefill URL BOOTSTRAP_PORT --decode URL`` (defaults, log level
  warning);
  ``gateway`` - SGLang's Rust gateway, ``python -m sglang_router.launch_router --pd-disaggregation
  --prefill URL BOOTSTRAP_PORT --decode URL --policy round_robin`` (PyPI ``sglang-router``; the
  same pairing policy as ours; log level warn);
  ``smg``     - the Shepherd Model Gateway (PyPI ``smg`` 1.13.0, the Rust gateway's successor, formerly
  sgl-model-gateway): ``python -m smg.launch_router`` with the gateway's flags exactly (same CLI);
  ``mini_lb`` - SGLang's Python PD balancer from the same package (``launch_router --mini-lb``,
  as shipped: random pairing, a new HTTP session per request, uvicorn access log on).
* **Stub engines** (``benchmarks/stub_engine.py``): one prefill and one decode process, uvloop +
  httptools, SGLang's /generate answers (non-streaming JSON; ``stream: true``: 64 ``data:`` SSE
  events, one socket write per token, then ``data: [DONE]``), /health; they accept and count the
  bootstrap fields. After every measurement the stubs' counters are checked: for a router, prefill
  and decode each got one request per client request, all with ``bootstrap_host/port/room``.
* **Load**: ``wrk`` (C, one thread, closed loop: each of C connections sends its next request when
  the previous answer is complete) POSTs ``/generate`` with ``max_new_tokens`` 64, non-streaming
  (``generate``) and streaming (``stream``; a request is complete at the stream's last byte), at
  each concurrency in ``--concurrency`` (32 = the anchor in docs/design.md). Latency percentiles are wrk's
  (microsecond histogram of complete-answer latency).
* **Interleaving**: contenders are measured round-robin (every (mode, concurrency) cell measures
  all contenders back to back, the order rotating per round); reported numbers are medians over
  rounds. **Added latency** of a contender = its pX latency minus direct's pX latency in the same
  round, mode and concurrency (then the median over rounds): what putting the router in the path
  costs a client at that load. In a closed loop latency ~= concurrency / throughput, so at
  C=32 it mostly reflects the router's capacity; at C=1 (``--concurrency 1,...``) it is the
  per-hop cost alone.
* **CPU pinning** (Linux affinity, stated in the result): the contender runs on ``--router-cpus``
  (default CPU 0); the stubs, wrk and this script on ``--load-cpus`` (default CPU 1). So every
  router gets the same single core and the load side cannot steal it. Per measurement the CPU time
  (cores busy) of the contender, the stubs and wrk is recorded, and the machine's total, so a
  load-side bottleneck (load core ~1.0 busy) or other users of the machine ("foreign" CPU) show.
  A run with foreign CPU above 0.1 core on average is marked ``preliminary``. The router's CPU
  time per request (``router_cpu_us_per_request``) is reported too: unlike req/s it hardly moves
  when other processes share the core, so it compares routers fairly on a busy machine.
* **Memory** (``--memory-streams``, default 1000): a fresh router of each of ``--memory-contenders``
  (default pdserve and gateway), fresh stubs whose decode emits one token every
  ``--memory-token-interval`` s (64 tokens: a ~16 s stream); after a warm-up, N streams are opened
  at once and read to ``[DONE]``, in ``--memory-waves`` (2) waves 10 s apart (a second wave that
  peaks where the first did shows memory reused, not leaked). The router's RSS (sum over its process group,
  /proc VmRSS) is read before, sampled every 50 ms while they run (peak; VmHWM too), and 1 s, 10 s and
  ``--memory-settle`` s (65: past the 60 s idle keep-alive of pooled upstream connections) after
  the last stream ended. The decode stub's count of concurrently open streams proves all N were open
  at once. Goal (issue #6): <= 150 MB added at peak, back near baseline after.
* **Profile** (``--profile``; on when ``py-spy`` is found in the venv, ``.bench/tools/bin`` or
  PATH): py-spy samples the pdserve router (200 Hz; it pauses the router per sample, so req/s
  while sampled is lower) under the non-streaming load at the first concurrency; the top functions
  by own and inclusive samples, and by package, go into the result (the collapsed stacks into
  ``<out>_pyspy.txt`` next to it).

Setup (not project dependencies: the contenders, the load generator and the profiler are installed
for the benchmark only; ``make bench-router`` does all of it)
--------------------------------------------------------------------------------------------------
    apt-get install -y wrk                                           # Debian's wrk 4.1
    .venv/bin/pip install --no-deps --target .bench/sglang-router sglang-router==0.3.2 setproctitle
    .venv/bin/pip install --no-deps --target .bench/smg smg==1.13.0 setproctitle
    .venv/bin/pip install --no-deps --target .bench/tools py-spy     # optional: the profile
(``.bench/`` is git-ignored; the gateway and mini_lb run with ``PYTHONPATH=.bench/sglang-router``,
smg with ``PYTHONPATH=.bench/smg`` (its Rust core is the wheel's ``smg_rs.abi3.so``; the module needs only
setproctitle) on the venv's Python, which already has their runtime dependencies aiohttp, fastapi, uvicorn and
orjson.) The script stops with a message naming the missing piece when one is missing.

Reproduce
---------
    make bench-router                       # = .venv/bin/python benchmarks/router.py (~15 min)
    make bench-router ARGS="--quick"        # one short round (smoke test, ~3 min)
    .venv/bin/python benchmarks/router.py --pdserve-commit HEAD   # the router as committed, not
                                            # the working tree (while router/ is being edited)

The result goes to ``benchmarks/results/router.json`` and ``router.md`` beside it (``--out`` to change; the
py-spy stacks to ``router_pyspy.txt``); the date, the commit and the command are inside.

Modules: ``router_procs`` (processes, /proc accounting), ``router_contenders`` (stubs and routers),
``router_load`` (wrk, the interleaved comparison, medians and ratios), ``router_memory`` (RSS under slow
streams), ``router_profile`` (py-spy), ``router_report`` (the JSON record and the Markdown page).
Run it on an otherwise idle machine: with two cores, anything else running shows up in the numbers
(the result records how much).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import resource
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from router_contenders import CONTENDERS, INSTALL_HINT, SGLANG_ROUTER_DIR, SMG_DIR, SMG_INSTALL_HINT, pdserve_snapshot
from router_load import compare
from router_memory import memory
from router_procs import REPO, parse_cpus, stop_on_signal
from router_profile import find_pyspy, make_profile_hook
from router_report import build_result, markdown

MODES = ("generate", "stream")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contenders", default=",".join(CONTENDERS), help="comma list of %(default)s")
    p.add_argument("--modes", default=",".join(MODES), help="comma list of %(default)s")
    p.add_argument("--concurrency", default="32,128", help="comma list of wrk connection counts (default %(default)s)")
    p.add_argument("--duration", type=float, default=10.0, help="seconds per measurement (default %(default)s)")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds of warm-up load per contender and mode")
    p.add_argument("--rounds", type=int, default=3,
                   help="interleaved rounds; medians are reported (default %(default)s)")
    p.add_argument("--router-cpus", default="0", help="CPUs of the contender (default %(default)s)")
    p.add_argument("--load-cpus", default="1", help="CPUs of the stubs, wrk and this script (default %(default)s)")
    p.add_argument("--memory-streams", type=int, default=1000,
                   help="concurrent slow streams; 0 = skip (default %(default)s)")
    p.add_argument("--memory-token-interval", type=float, default=0.25, help="seconds between tokens of a slow stream")
    p.add_argument("--memory-waves", type=int, default=2,
                   help="waves of --memory-streams, 10 s apart (default %(default)s)")
    p.add_argument("--memory-settle", type=float, default=65.0,
                   help="seconds after the streams end for the last RSS reading (default %(default)s: past the "
                        "routers' 60 s idle keep-alive of pooled upstream connections)")
    p.add_argument("--memory-contenders", default="pdserve,gateway",
                   help="routers measured for memory (default %(default)s)")
    p.add_argument("--profile", action=argparse.BooleanOptionalAction, default=None,
                   help="py-spy profile of the pdserve router (default: on when py-spy is installed)")
    p.add_argument("--profile-duration", type=float, default=10.0)
    p.add_argument("--sglang-router-dir", type=Path, default=SGLANG_ROUTER_DIR,
                   help="where sglang-router is installed with pip --target (default %(default)s)")
    p.add_argument("--pdserve-commit", default=None, metavar="REV",
                   help="measure the router of this git commit (extracted to a temp dir) instead of the working tree")
    p.add_argument("--custom", action="append", default=[], metavar="NAME=COMMAND",
                   help="an extra contender (e.g. a router prototype): NAME=COMMAND with placeholders {python} "
                        "{prefill_url} {bootstrap_port} {decode_url} {port}; it must serve GET /health and "
                        "POST /generate on {port}; add NAME to --contenders (repeatable)")
    p.add_argument("--quick", action="store_true", help="one short round at c=32, 200 memory streams (smoke test)")
    p.add_argument("--out", type=Path, default=None,
                   help="result JSON path; the .md goes beside it (default benchmarks/results/router.json)")
    args = p.parse_args(argv)
    if args.quick:
        args.duration, args.warmup, args.rounds, args.concurrency = 3.0, 1.0, 1, "32"
        args.memory_streams, args.profile_duration, args.memory_settle = min(args.memory_streams, 200), 5.0, 10.0
    args.contenders = [c for c in args.contenders.split(",") if c]
    custom = {}
    for spec in args.custom:
        name, sep, cmd = spec.partition("=")
        if not sep or not name or not cmd or name in CONTENDERS:
            p.error(f"--custom {spec!r}: want NAME=COMMAND with a NAME other than {', '.join(CONTENDERS)}")
        custom[name] = cmd
    args.custom = custom
    args.modes = [m for m in args.modes.split(",") if m]
    args.memory_contenders = [c for c in args.memory_contenders.split(",") if c] if args.memory_streams > 0 else []
    try:
        args.concurrency = [int(c) for c in str(args.concurrency).split(",") if c]
        args.router_cpus, args.load_cpus = parse_cpus(args.router_cpus), parse_cpus(args.load_cpus)
    except ValueError as e:
        p.error(str(e))
    for c in args.contenders + args.memory_contenders:
        if c not in CONTENDERS and c not in custom:
            p.error(f"unknown contender {c!r}; choose from {', '.join(CONTENDERS + tuple(custom))}")
    if "direct" not in args.contenders:
        p.error("--contenders must include direct (added latency is measured against it)")
    if "direct" in args.memory_contenders:
        p.error("--memory-contenders: direct has no router process to measure")
    for m in args.modes:
        if m not in MODES:
            p.error(f"unknown mode {m!r}; choose from {', '.join(MODES)}")
    if args.rounds < 1 or args.duration < 1 or args.memory_waves < 1 or any(c < 1 for c in args.concurrency):
        p.error("--rounds, --duration, --memory-waves and --concurrency must be >= 1")
    if args.router_cpus & args.load_cpus:
        print(f"[router bench] warning: router CPUs {sorted(args.router_cpus)} and load CPUs "
              f"{sorted(args.load_cpus)} overlap", file=sys.stderr)
    return args


def preflight(args) -> None:
    """Stop with a clear message when a tool the run needs is missing."""
    if shutil.which("wrk") is None:
        sys.exit("router bench: `wrk` (the load generator) is not installed: apt-get install -y wrk "
                 "(make bench-router does it)")
    if {"gateway", "mini_lb"} & set(args.contenders + args.memory_contenders):
        if not (args.sglang_router_dir / "sglang_router" / "launch_router.py").exists():
            sys.exit(f"router bench: SGLang's router (PyPI sglang-router) is not in {args.sglang_router_dir}; "
                     f"{INSTALL_HINT}")
        if not (args.sglang_router_dir / "setproctitle").exists():
            sys.exit(f"router bench: setproctitle (needed by sglang_router.launch_router) is not in "
                     f"{args.sglang_router_dir}; {INSTALL_HINT}")
    if "smg" in args.contenders + args.memory_contenders:
        for need in ("smg/launch_router.py", "setproctitle"):
            if not (SMG_DIR / need).exists():
                sys.exit(f"router bench: the Shepherd Model Gateway (PyPI smg) lacks {need} in {SMG_DIR}; "
                         f"{SMG_INSTALL_HINT}")
    has_pyspy = find_pyspy() is not None
    if args.profile and not has_pyspy:
        sys.exit("router bench: --profile needs py-spy: `make bench-router` installs it into .bench/tools, or "
                 ".venv/bin/pip install py-spy")
    if args.profile is None:
        args.profile = has_pyspy and "pdserve" in args.contenders and "generate" in args.modes


def main(argv=None) -> None:
    args = parse_args(argv)
    preflight(args)
    # Stop the stubs and routers on Ctrl-C / SIGTERM, also when started in the background (where
    # a shell leaves SIGINT ignored).
    signal.signal(signal.SIGTERM, stop_on_signal)
    signal.signal(signal.SIGINT, stop_on_signal)
    # Many sockets: 1000 streams are 1000 client + up to 2000 upstream connections in the router.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    os.sched_setaffinity(0, args.load_cpus)  # this script (the memory client) runs with the load
    now = dt.datetime.now(dt.timezone.utc)
    out = args.out or REPO / "benchmarks" / "results" / "router.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    own_pgid = os.getpgid(0)
    with tempfile.TemporaryDirectory(prefix="router_bench_") as tmp:
        workdir = Path(tmp)
        logdir = workdir / "logs"
        logdir.mkdir()
        loadavg_before = Path("/proc/loadavg").read_text().split()[:3]
        try:
            args.pdserve_tree = pdserve_snapshot(args.pdserve_commit, workdir) if args.pdserve_commit else None
            hook = make_profile_hook(args, workdir, out.with_name(out.stem + "_pyspy.txt"))
            res = compare(args, workdir, logdir, own_pgid, hook)
            mem = []
            for name in args.memory_contenders:
                try:
                    mem.append(memory(args, logdir, name))
                except RuntimeError as e:
                    mem.append({"contender": name, "error": str(e)[-2000:]})
        except RuntimeError as e:
            sys.exit(f"router bench failed: {e}\nlogs: " + "; ".join(
                f"{p.name}: {p.read_text(errors='replace')[-1500:]}" for p in sorted(logdir.glob("*.log"))))
    result = build_result(args, argv if argv is not None else sys.argv[1:], now, res, mem, loadavg_before)
    out.write_text(json.dumps(result, indent=1) + "\n")
    md = out.with_suffix(".md")
    md.write_text(markdown(result))
    print(markdown(result))
    print(f"[router bench] wrote {out.relative_to(REPO) if out.is_relative_to(REPO) else out} and {md.name}")


if __name__ == "__main__":
    main()
