"""What ``pdserve diagnose`` reports: :class:`Diagnosis` (one distinct cause) with its
:class:`Evidence` lines, and the failure :data:`CATEGORIES` a cause falls in."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

MAX_TEXT = 400  # evidence text is cut here


CATEGORIES: dict[str, str] = {
    "kernel_arch": "a GPU kernel built for another architecture (no kernel image / sm_100-only kernel)",
    "cuda_oom": "CUDA out of memory (weights, CUDA graph capture, or at run time)",
    "kv_cache_memory": "no GPU memory left for the KV cache after loading",
    "shared_memory": "a Triton kernel needs more shared memory per block than the GPU has",
    "cuda_graph_capture": "CUDA graph capture failed for a reason not recognised below it",
    "cuda_error": "another CUDA error (illegal memory access, device-side assert, driver too old)",
    "nccl": "NCCL / torch.distributed communication failure",
    "kv_transfer": "Mooncake KV transfer or PD bootstrap failure",
    "page_size_mismatch": "prefill and decode run with different --page-size",
    "pd_config_mismatch": "prefill and decode disagree on another setting (KV dtype, layout, policy)",
    "port_in_use": "a port the engine binds is already taken",
    "missing_dependency": "a Python module the engine needs is not installed",
    "shadowed_import": "a folder of a checkout or working dir on sys.path hides an installed package of its name",
    "model_path": "--model-path is not a local checkpoint directory (typo, not mounted on this node)",
    "watchdog_timeout": "a forward step hung past SGLang's watchdog timeout",
    "child_exit": "an engine subprocess died (killed, crashed) without a Python traceback",
    "sigquit": "the parent got SIGQUIT from a failed child (a symptom; never the root cause)",
    "exception": "a Python traceback that matches no known pattern (shown as found)",
}

#: Categories that are not a recognised cause (the CLI exits 1 when only these are found).
UNRECOGNISED = frozenset({"exception", "sigquit"})


class Evidence(NamedTuple):
    """One log line that proves a diagnosis: ``(file, line, text)``, line numbers from 1."""

    file: str
    line: int
    text: str


@dataclasses.dataclass
class Diagnosis:
    """One distinct cause found in the logs.

    Attributes:
        cause: short title, e.g. ``"CUDA out of memory during CUDA graph capture"``.
        category: category id, a key of :data:`CATEGORIES`.
        evidence: the few lines that prove it, as :class:`Evidence` ``(file, line, text)``.
        ranks: tensor-parallel ranks that hit it (``[0, 1, 2, 3]``); empty when the log has no ranks.
        fix: what to try.
        primary: True for the one root cause to act on first (at most one per result).
        occurrences: how many log records showed it (all ranks, all repeats).
    """

    cause: str
    category: str
    evidence: list[Evidence]
    ranks: list[int]
    fix: str
    primary: bool = False
    occurrences: int = 1

    @property
    def recognised(self) -> bool:
        """True when the category is a known failure pattern (not a bare traceback or a SIGQUIT)."""
        return self.category not in UNRECOGNISED

    def ranks_text(self) -> str:
        """The ranks as ``"TP0, TP1, TP2, TP3"`` (empty string when none are known)."""
        return ", ".join(f"TP{r}" for r in self.ranks)

    def to_dict(self) -> dict:
        """A JSON-friendly dict (evidence as ``{"file", "line", "text"}`` objects)."""
        d = dataclasses.asdict(self)
        d["evidence"] = [e._asdict() for e in self.evidence]
        return d
