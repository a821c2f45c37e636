"""Root cause of a failed engine start or crash, read from its logs (``pdserve diagnose``).

When one tensor-parallel rank of an SGLang server fails, the parent kills the whole process tree:
operators see a SIGQUIT message last and a wall of near-identical tracebacks above it (the log
format is described in :mod:`.logparse`). This package reads such logs (one combined log, per-rank
files, several engines' logs, or the tail a worker actor kept) and names the root cause:

- the earliest root-cause error across ranks, shown once with the ranks that hit it;
- a known category (out of memory, kernel built for another GPU, Mooncake/bootstrap failure, port in
  use, NCCL, prefill/decode mismatch, ...) with the fix to try;
- never the SIGQUIT itself: the parent's message is evidence that a child died, attached to the
  child's error.

Public API: :func:`diagnose_logs`, :func:`diagnose_text`, :func:`render`, :class:`Diagnosis`.

Modules: :mod:`.diagnosis` (the result types and categories), :mod:`.logparse` (log records, streams
and ranks), :mod:`.patterns` (what each failure looks like), :mod:`.rules` (a record -> a finding),
:mod:`.fixes` (what to try), :mod:`.merge` (findings -> diagnoses, root cause first), :mod:`.render`
and :mod:`.cli`.
"""

from .cli import main
from .diagnosis import CATEGORIES, UNRECOGNISED, Diagnosis, Evidence
from .merge import diagnose_logs, diagnose_text
from .render import render

__all__ = ["CATEGORIES", "UNRECOGNISED", "Diagnosis", "Evidence", "diagnose_logs", "diagnose_text", "render", "main"]
