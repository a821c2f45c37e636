"""py-spy profile of the pdserve router under load (benchmarks/router.py ``--profile``), and where its CPU goes
by function and by package, from py-spy's collapsed stacks."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Optional

from router_contenders import VENV_BIN, Contender
from router_load import run_wrk
from router_procs import REPO, child_setup

TOOLS_BIN = REPO / ".bench" / "tools" / "bin"  # py-spy when installed for the benchmark only


# A sample whose innermost Python frame is the event loop's run(): time inside the C event loop
# (uvloop: epoll, socket reads/writes, httptools parsing, scheduling callbacks).
EVENT_LOOP = "event loop (uvloop C code: I/O, HTTP parsing, scheduling)"
LOOP_RUN = re.compile(r"^(Runner\.run \(asyncio/runners\.py\)|run \(uvloop/__init__\.py\))$")


def _package(frame: str) -> str:
    """``func (path/file.py)`` -> ``pd.router``, ``aiohttp``, ``asyncio``, ``json``, ... (py-spy
    shortens paths to the part below site-packages or the source root)."""
    m = re.search(r"\(([^:)]+)\)?$", frame)
    path = m.group(1) if m else frame
    if re.match(r"(pd/)?router/", path):
        return "pd.router"
    top = path.split("/", 1)[0]
    return top.removesuffix(".py") if "/" in path or path.endswith(".py") else path


def analyze_profile(collapsed: str, top: int = 25) -> dict:
    """Where the router's CPU goes, from py-spy's collapsed stacks (``frame;frame;... count``
    lines, frames ``func (file:line)``): top functions by own samples (innermost frame) and by
    inclusive samples (anywhere in the stack, entry-point frames left out), and own and inclusive
    samples per package. Percentages are of all samples taken."""
    own, incl, pkg_own, pkg_incl = Counter(), Counter(), Counter(), Counter()
    total = 0
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";") if f]  # fold the lines of one function
        # The entry point down to the loop's run() is in every stack: only what runs above it is work.
        runs = [i for i, f in enumerate(frames) if LOOP_RUN.match(f)]
        work = frames[runs[-1] + 1:] if runs else frames
        leaf = work[-1] if work else EVENT_LOOP
        own[leaf] += n
        pkg_own[EVENT_LOOP if leaf == EVENT_LOOP else _package(leaf)] += n
        for f in set(work):
            incl[f] += n
        for p in {_package(f) for f in work}:
            pkg_incl[p] += n

    def pct(c: Counter, key: str):
        return [{key: f, "samples": n, "pct": round(100 * n / total, 1)} for f, n in c.most_common(top)]

    return {"samples": total, "top_own": pct(own, "frame"), "top_inclusive": pct(incl, "frame"),
            "by_package_own": pct(pkg_own, "package"), "by_package_inclusive": pct(pkg_incl, "package")}


def find_pyspy() -> Optional[str]:
    return shutil.which("py-spy", path=f"{VENV_BIN}:{TOOLS_BIN}") or shutil.which("py-spy")


PROFILE_RATE = 200  # samples/s; py-spy pauses the process per sample (whole stacks; --nonblocking tears them)


def make_profile_hook(args, workdir: Path, out_stacks: Path):
    if not args.profile:
        return None
    pyspy = find_pyspy()

    def hook(c: Optional[Contender], script: Optional[Path]) -> Optional[dict]:
        if c is None or script is None:
            return None
        conc = args.concurrency[0]
        raw = workdir / "pyspy.txt"
        print(f"[router bench] profiling pdserve router (py-spy, {args.profile_duration:.0f} s, c={conc})", flush=True)
        spy = subprocess.Popen([pyspy, "record", "--pid", str(c.proc.pid),
                                "--duration", str(round(args.profile_duration)), "--rate", str(PROFILE_RATE),
                                "--format", "raw", "--output", str(raw)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               preexec_fn=child_setup(args.load_cpus))
        time.sleep(1.0)
        w = run_wrk(c.url, script, conc, args.profile_duration, args.load_cpus)
        spy_out = spy.communicate(timeout=120)[0].decode(errors="replace")
        if spy.returncode != 0 or not raw.exists():
            return {"error": f"py-spy failed ({spy.returncode}): {spy_out[-500:]}"}
        text = raw.read_text()
        out_stacks.write_text(text)
        res = analyze_profile(text)
        res.update({"rps_while_profiled": round(w["requests"] / (w["duration_us"] / 1e6), 1), "concurrency": conc,
                    "mode": "generate", "rate_hz": PROFILE_RATE, "seconds": args.profile_duration,
                    "collapsed_stacks": str(out_stacks.relative_to(REPO)) if out_stacks.is_relative_to(REPO)
                    else str(out_stacks)})
        return res

    return hook
