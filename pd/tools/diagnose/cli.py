"""``pdserve diagnose [--json] LOG [LOG...]``: the command line."""

from __future__ import annotations

import os

from .diagnosis import MAX_TEXT
from .logparse import ANSI
from .merge import diagnose_logs
from .patterns import RX_ERRORISH
from .render import render


def _last_error_lines(paths: list[str], n: int = 12) -> list[str]:
    """The last traceback / error-looking lines of the logs (shown when nothing known was found)."""
    out = []
    for p in paths:
        try:
            with open(p, "rb") as f:
                f.seek(0, 2)
                size = f.tell()
                f.seek(max(0, size - 1_000_000))
                tail = f.read().decode("utf-8", "replace")
        except OSError:
            continue
        tail = ANSI.sub("", tail)
        lines = tail.splitlines()[-5000:]
        for i, t in enumerate(lines):
            if RX_ERRORISH.search(t) or (t.startswith("  File ") and i + 1 < len(lines)):
                out.append(f"{p}: {t[:MAX_TEXT]}")
    return out[-n:]


USAGE = """usage: pdserve diagnose [--json] LOG [LOG...]

Finds the root cause of a failed engine start or crash in SGLang (or reference engine) logs: one
combined server log, per-rank logs, or the logs of several engines. A directory means its *.log files.
Exit status: 0 a known cause was found, 1 nothing known (the last error lines are shown), 2 a file
cannot be read (or a directory holds no *.log file, or an unknown option).
"""


def main(argv: list[str] | None = None) -> int:
    """``pdserve diagnose``: print the diagnosis of the given logs; returns the exit status."""
    import json
    import sys

    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0 if argv else 2
    as_json = "--json" in argv
    paths = []
    for a in argv:
        if a == "--json":
            continue
        if a.startswith("-") and not os.path.exists(a):
            print(f"pdserve diagnose: unknown option {a} (options: --json, --help)", file=sys.stderr)
            return 2
        if os.path.isdir(a):
            logs = sorted(os.path.join(a, f) for f in os.listdir(a) if f.endswith(".log"))
            if not logs:
                print(f"pdserve diagnose: {a} has no *.log files", file=sys.stderr)
                return 2
            paths.extend(logs)
        else:
            paths.append(a)
    if not paths:
        print("pdserve diagnose: no log files given", file=sys.stderr)
        return 2
    try:
        found = diagnose_logs(paths)
    except OSError as e:
        print(f"pdserve diagnose: cannot read {e.filename or '?'}: {e.strerror or e}", file=sys.stderr)
        return 2
    known = any(d.primary and d.recognised for d in found)
    if as_json:
        print(json.dumps([d.to_dict() for d in found], indent=2))
        return 0 if known else 1
    print(render(found))
    if not known:
        tail = _last_error_lines(paths)
        if tail and not found:
            print("Last error lines seen:")
            print("\n".join("  " + t for t in tail))
        elif not found:
            print("No error or traceback lines seen.")
    return 0 if known else 1
