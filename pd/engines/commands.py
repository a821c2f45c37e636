"""The command line and environment of one engine process, from the cluster config.

``engine_command`` is the single place that turns (config, role, ports) into argv + env; the
worker actor runs what it returns (reference engine here, SGLang in pd/engines/sglang.py).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from pd.config import PDConfig


@dataclass
class EngineCommand:
    """What a worker actor runs.

    Attributes:
        argv: the full command line.
        env: variables added to the actor's environment.
        ready_path: HTTP path that answers 200 once the engine serves.
        ready_log_line: log text that also means ready (SGLang prints it).
        args_start: index in ``argv`` where the engine's own flags begin.
    """

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    ready_path: str = "/health"
    ready_log_line: str = "The server is fired up and ready to roll!"
    args_start: int = 0


def engine_command(cfg: PDConfig, role: str, host: str, port: int, bootstrap_port: int | None) -> EngineCommand:
    """Build the engine command for one worker.

    Args:
        role: ``prefill`` or ``decode``.
        host: address the engine listens on and peers reach it at.
        port: HTTP port; ``bootstrap_port``: the prefill's bootstrap port (None for decode).

    Raises:
        ValueError: a prefill without a bootstrap port (sglang engine).
    """
    group = cfg.groups()[role]
    if cfg.engine == "sglang":
        from pd.engines.sglang import sglang_command

        return sglang_command(cfg, role, host, port, bootstrap_port)
    argv = [
        sys.executable, "-m", "pd.cli", "engine",
        "--model-path", cfg.model_path,
        "--host", host, "--port", str(port),
        "--disaggregation-mode", role,
        "--disaggregation-transfer-backend", cfg.transfer.backend,
        "--disaggregation-transfer-protocol", cfg.transfer.protocol,
        "--page-size", str(cfg.page_size),
    ]
    if cfg.served_model_name:
        argv += ["--served-model-name", cfg.served_model_name]
    if cfg.transfer.ib_device:
        argv += ["--disaggregation-ib-device", cfg.transfer.ib_device]
    if bootstrap_port is not None:
        argv += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
    argv += group.extra_args
    env = dict(group.env)
    if cfg.transfer.protocol == "tcp":
        env.setdefault("MC_FORCE_TCP", "1")
    return EngineCommand(argv=argv, env=env, ready_path="/health", args_start=4)
