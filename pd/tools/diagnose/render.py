"""Diagnoses as text for a terminal (:func:`render`); ``--json`` uses :meth:`Diagnosis.to_dict`."""

from __future__ import annotations

import textwrap

from .diagnosis import Diagnosis


def render(diagnoses: list[Diagnosis]) -> str:
    """Human-readable text for :func:`diagnose_logs` / :func:`diagnose_text` results."""
    if not diagnoses:
        return "No known failure pattern found."
    out = []
    for n, d in enumerate(diagnoses, 1):
        if d.primary:
            tag = "ROOT CAUSE" if d.recognised else "ROOT CAUSE (no known pattern; first error shown)"
        elif d.category == "sigquit":
            tag = "SYMPTOM ONLY"
        else:
            tag = "also found"
        out.append(f"[{n}] {tag}: {d.cause}  [{d.category}]")
        if d.ranks:
            out.append(f"    ranks:    {d.ranks_text()}")
        if d.occurrences > 1:
            out.append(f"    seen:     {d.occurrences} times")
        for k, e in enumerate(d.evidence):
            out.append(f"    {'evidence:' if k == 0 else '         '} {e.file}:{e.line}: {e.text}")
        out.append(textwrap.fill(d.fix, width=110, initial_indent="    fix:      ",
                                 subsequent_indent="              ", break_on_hyphens=False,
                                 break_long_words=False))
    return "\n".join(out)
