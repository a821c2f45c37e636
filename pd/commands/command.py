"""What a worker actor runs: one engine process's argv, environment and readiness signals."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineCommand:
    """What a worker actor runs.

    Attributes:
        argv: the full command line.
        env: variables added to the actor's environment.
        ready_path: HTTP path that answers 200 once the engine serves.
        ready_log_line: log text that also means ready (SGLang prints it).
        args_start: index in ``argv`` where the engine's own flags begin.
        files: files the worker writes (owner-only, 0600) before it starts the engine, path -> text:
            where a secret goes that the engine reads only from its command line (SGLang's ``--api-key``
            through its ``--config`` YAML), so that ``ps`` shows a path, never the secret.
    """

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    ready_path: str = "/health"
    ready_log_line: str = "The server is fired up and ready to roll!"
    args_start: int = 0
    files: dict[str, str] = field(default_factory=dict)
