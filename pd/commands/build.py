"""The command line and environment of one engine process, from the cluster config.

``engine_command`` is the single place that turns (config, role, ports) into argv + env; the worker
actor runs what it returns: the reference engine (``pd/commands/reference.py``) or SGLang
(``pd/commands/sglang.py``).
"""

from __future__ import annotations

from pd.commands.command import EngineCommand
from pd.commands.reference import reference_command
from pd.commands.sglang import sglang_command
from pd.config import PDConfig


def engine_command(cfg: PDConfig, role: str, host: str, port: int, bootstrap_port: int | None,
                   api_key: str | None = None, key_dir: str | None = None) -> EngineCommand:
    """Build the engine command for one worker.

    Args:
        role: ``prefill`` or ``decode``.
        host: address the engine listens on and peers reach it at.
        port: HTTP port; ``bootstrap_port``: the prefill's bootstrap port (None for decode).
        api_key: the cluster's key the engine requires (``--api-key``), never on its command line: the
            reference engine reads it from its environment, SGLang from a 0600 file in ``key_dir``.

    Raises:
        ValueError: a prefill without a bootstrap port (sglang engine).
    """
    if cfg.engine == "sglang":
        return sglang_command(cfg, role, host, port, bootstrap_port, api_key, key_dir)
    return reference_command(cfg, role, host, port, bootstrap_port, api_key)
