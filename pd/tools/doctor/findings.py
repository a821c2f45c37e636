"""What a check returns: a :class:`Finding` at one of three levels (:data:`LEVELS`).

``error``: known to fail, the launch is refused; ``warning``: runs, but probably not the way you want;
``ok``: passed, or skipped with the reason in the message.
"""

from __future__ import annotations

from dataclasses import dataclass

LEVELS = ("error", "warning", "ok")


@dataclass
class Finding:
    """One preflight result.

    Attributes:
        level: ``error`` (known to fail), ``warning`` or ``ok`` (passed or skipped, see message); anything
            else raises ValueError.
        check: the check's id, e.g. ``quantization``.
        message: what was found, naming the config field and SGLang flag.
        fix: what to try (empty for ``ok``).
    """

    level: str
    check: str
    message: str
    fix: str = ""

    def __post_init__(self):
        if self.level not in LEVELS:  # a misspelt level would render and count as nothing
            raise ValueError(f"Finding level {self.level!r} is not one of {LEVELS}")


def exit_code(findings: list[Finding]) -> int:
    """1 when any finding is an error, else 0."""
    return 1 if any(f.level == "error" for f in findings) else 0
