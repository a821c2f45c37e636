"""Findings as text (one block each, errors and warnings only for the launcher) and as ``--json``."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Optional

from .findings import Finding
from .hardware import GpuInfo

_TAGS = {"error": "ERROR", "warning": "WARN ", "ok": "ok   "}


def render(findings: list[Finding], verbose: bool = True) -> str:
    """Human-readable findings, one block each (``verbose=False``: errors and warnings only)."""
    lines = []
    for f in findings:
        if f.level == "ok" and not verbose:
            continue
        lines.append(f"{_TAGS[f.level]} [{f.check}] {f.message}")
        if f.fix:
            lines.append(f"      fix: {f.fix}")
    n_err = sum(f.level == "error" for f in findings)
    n_warn = sum(f.level == "warning" for f in findings)
    lines.append(f"{n_err} error(s), {n_warn} warning(s)")
    return "\n".join(lines)


def render_json(config: Optional[str], gpu: GpuInfo, code: int, findings: list[Finding]) -> str:
    """``pdserve doctor --json``: the config path, the GPU, the exit code and every finding."""
    return json.dumps({"config": config, "gpu": asdict(gpu), "exit_code": code,
                       "findings": [asdict(f) for f in findings]}, indent=2)
