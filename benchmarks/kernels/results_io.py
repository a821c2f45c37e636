"""What every kernel benchmark records about its run, and how it writes its result under the stable name.

``run_info()`` is the device, the UTC date, the commit (``git rev-parse --short HEAD``, "unknown" outside a git
checkout, e.g. on the device machine's bare copy) and the command line. ``write_result(out_dir, name, res, md)``
writes ``<name>.json`` (and ``<name>.md`` when ``md`` is given) to ``out_dir``: the names of benchmarks/results/, so
a result is committed by copying it.
"""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def git_commit() -> str:
    """The checkout's short commit hash, or "unknown"."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=_ROOT, capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def run_info(device: str | None = None) -> dict:
    """device, date (UTC, ISO 8601), commit and command of this run; ``device``: None asks torch."""
    if device is None:
        import torch

        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return dict(device=device, date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                commit=git_commit(), command=" ".join(["python3"] + sys.argv))


def md_header(title: str, res: dict) -> list[str]:
    """The first lines of a result's .md: title, device, date, commit, command."""
    return [f"# {title}", "", f"- Device: {res.get('device')}", f"- Date: {res.get('date')}",
            f"- Commit: {res.get('commit')}", f"- Command: `{res.get('command')}`", ""]


def write_result(out_dir: str, name: str, res: dict, md: list[str] | None = None) -> str:
    """Write ``<name>.json`` (and ``<name>.md`` from the lines ``md``) to ``out_dir``; returns the JSON path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name + ".json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    if md is not None:
        with open(os.path.join(out_dir, name + ".md"), "w") as f:
            f.write("\n".join(md) + "\n")
    return path
