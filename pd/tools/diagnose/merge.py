"""From findings to diagnoses: one :class:`~.diagnosis.Diagnosis` per distinct cause across ranks,
files and repeats, the root cause first (:func:`diagnose_sources`), and the entry points
:func:`diagnose_text` and :func:`diagnose_logs`.

Repeated one-line records are classified once.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Iterable

from .diagnosis import MAX_TEXT, Diagnosis, Evidence
from .logparse import HEAD, Record, Source, default_rank
from .patterns import RX_ARCH_120, RX_NOIMAGE, RX_NORM, TRIGGERS
from .rules import SYMPTOM, Finding, classify, short_name, sm100_tokens

_MAX_EVIDENCE = 10


@dataclasses.dataclass
class _Group:
    finding: Finding
    order: tuple
    diag: Diagnosis
    ranks_seen: set


def _evidence(rec: Record, idx: int) -> Evidence:
    no, text = rec.lines[idx]
    return Evidence(rec.src, no, text if len(text) <= MAX_TEXT else text[: MAX_TEXT - 3] + "...")


def diagnose_sources(sources: list[Source]) -> list[Diagnosis]:
    """Classify every triggered record of ``sources`` and merge the findings: causes first (root-cause tier,
    then time, then file order), the first marked ``primary`` with the symptoms' lines as evidence."""
    groups: dict[tuple, _Group] = {}
    sm100_lines: list[tuple[Source, Record, int]] = []
    cache: dict[str, Finding | None] = {}
    arch_120 = False
    all_ts = True
    for src in sources:
        low_head = src.text[:2_000_000].lower()
        arch_120 = arch_120 or any(w in low_head for w in RX_ARCH_120)
        for rec in src.records(TRIGGERS):
            texts = rec.bodies
            if not texts:
                continue
            if len(texts) == 1:  # repeated one-line records: classify once
                m = HEAD.match(texts[0])
                norm = RX_NORM.sub("#", texts[0][m.end():] if m else texts[0])
                if norm in cache:
                    finding = cache[norm]
                else:
                    finding = cache[norm] = classify(texts)
            else:
                finding = classify(texts)
            for i, t in enumerate(texts):
                if sm100_tokens(t):
                    sm100_lines.append((src, rec, i))
            if finding is None or finding.tier < 0:
                continue
            key = (finding.category, finding.key)
            ranks = set(finding.ranks)
            if rec.rank is not None:
                ranks.add(rec.rank)
            g = groups.get(key)
            if g is None:
                ev = [_evidence(rec, i) for i in sorted(finding.evidence)]
                if (finding.evidence and 0 not in finding.evidence and rec.ts and rec.rank is not None
                        and HEAD.match(rec.bodies[0])):
                    ev.insert(0, _evidence(rec, 0))  # the header line shows the rank and the time
                diag = Diagnosis(cause=finding.title, category=finding.category, evidence=ev, ranks=[],
                                 fix=finding.fix, occurrences=0)
                first_line = rec.lines[finding.evidence[0] if finding.evidence else 0][0]
                g = _Group(finding, (rec.ts, src.idx, first_line), diag, set())
                groups[key] = g
                g.ranks_seen |= ranks
            else:
                new = ranks - g.ranks_seen
                if new and len(g.diag.evidence) < _MAX_EVIDENCE and finding.evidence:
                    g.diag.evidence.append(_evidence(rec, finding.evidence[0]))
                g.ranks_seen |= ranks
            g.diag.occurrences += 1
    for g in groups.values():
        g.diag.ranks = sorted(g.ranks_seen)
        if g.order[0] is None:
            all_ts = False

    # kernel_arch found through "no kernel image": name the sm_100 kernel seen just before on that rank.
    arch = groups.get(("kernel_arch", ""))
    if arch is not None:
        if arch_120 and "sm_120" not in arch.diag.cause:
            arch.diag.cause += " on this sm_120 GPU"
        noimage = [e for e in arch.diag.evidence if RX_NOIMAGE.search(e.text)]
        if "sm_100 kernel" not in arch.diag.cause and sm100_lines and noimage:
            first = noimage[0]
            before = [(s, r, i) for s, r, i in sm100_lines
                      if s.name == first.file and first.line - 300 <= r.lines[i][0] <= first.line]
            if before:
                s, r, i = before[-1]
                name = max(sm100_tokens(r.lines[i][1]), key=len)
                arch.diag.cause = arch.diag.cause.replace(
                    "for this device", f"for this device (sm_100 kernel {short_name(name)})", 1)
                arch.diag.evidence.append(_evidence(r, i))
                arch.diag.evidence.sort(key=lambda e: (e.file != first.file, e.line))

    def order(g: _Group) -> tuple:
        ts, idx, line = g.order
        return (g.finding.tier, ts if all_ts else "", idx, line)

    ranked = sorted(groups.values(), key=order)
    symptoms = [g for g in ranked if g.finding.tier == SYMPTOM]
    causes = [g for g in ranked if g.finding.tier != SYMPTOM]
    if causes:
        primary = causes[0].diag
        primary.primary = True
        # The parent's SIGQUIT message (and exit-code-1 notices) point at the child's error: evidence.
        for g in symptoms:
            if len(primary.evidence) < _MAX_EVIDENCE + 2:
                primary.evidence.append(g.diag.evidence[-1])
        return [g.diag for g in causes]
    return [g.diag for g in symptoms]


def diagnose_text(text: str, source: str = "<log>") -> list[Diagnosis]:
    """Diagnose one log's text (a whole engine log or just its tail).

    Args:
        text: the log; any content (binary garbage, partial lines) is accepted.
        source: the name evidence lines refer to. A name like ``tp2.log`` or ``rank2`` gives lines
            without a rank prefix that rank.

    Returns:
        Distinct causes, root causes first in the order they happened; the first one has
        ``primary=True`` unless only a symptom (a SIGQUIT with no child error) was found.
        Empty when nothing known was found.
    """
    if not isinstance(text, str):
        text = bytes(text).decode("utf-8", "replace")
    return diagnose_sources([Source(text, source, 0, default_rank(source))])


def diagnose_logs(paths: Iterable[str | os.PathLike]) -> list[Diagnosis]:
    """Diagnose one or more log files together (a combined server log, per-rank files, or the logs of
    several engines, e.g. a prefill's and a decode's): one cause seen in several files is reported once.

    Args:
        paths: log files; a file name like ``tp2.log`` gives lines without a rank prefix that rank.

    Returns:
        As :func:`diagnose_text`; evidence names each file as given.

    Raises:
        OSError: a file cannot be read (the exception's ``filename`` names it).
    """
    sources = []
    for i, p in enumerate(paths):
        name = os.fspath(p)
        with open(name, "rb") as f:
            data = f.read()
        sources.append(Source(data.decode("utf-8", "replace"), name, i, default_rank(name)))
    return diagnose_sources(sources)
