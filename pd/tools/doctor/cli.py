"""``pdserve doctor CONFIG [--assume-gpu sm_120] [--json]``: the command line."""

from __future__ import annotations

import argparse
from typing import Optional

from .hardware import parse_arch
from .render import render, render_json
from .runner import doctor


def main(argv: Optional[list[str]] = None) -> int:
    """``pdserve doctor``: returns the exit code (0 ok, 1 errors, 2 invalid config)."""
    p = argparse.ArgumentParser(prog="pdserve doctor",
                                description="Preflight checks of a deployment; non-zero exit on errors.")
    p.add_argument("config", nargs="?", help="cluster config YAML (default: deploy/local.yaml)")
    p.add_argument("--assume-gpu", metavar="ARCH", help="check for this GPU architecture (sm_90, sm_100, sm_120, ...) "
                   "instead of the one on this machine")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    args = p.parse_args(argv)
    if args.assume_gpu:
        try:
            parse_arch(args.assume_gpu)
        except ValueError as e:
            p.error(str(e))
    findings, code, gpu = doctor(args.config, args.assume_gpu)
    if args.json:
        print(render_json(args.config, gpu, code, findings))
    else:
        print(f"pdserve doctor: {args.config or 'deploy/local.yaml (default)'}")
        print(render(findings))
    return code
