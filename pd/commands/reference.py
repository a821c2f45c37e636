"""The reference engine's command line (``pdserve engine``, SGLang's flag names) for one worker, written from its
settings model (pd.engines.settings)."""

from __future__ import annotations

import sys

from pydantic import ValidationError

from pd.commands.command import EngineCommand
from pd.config import PDConfig
from pd.engines.settings import API_KEY_ENV, EngineSettings, engine_argv, settings_error


def reference_settings(cfg: PDConfig, role: str, host: str, port: int, bootstrap_port: int | None) -> EngineSettings:
    """The settings the config gives one worker of ``role`` (before its group's ``extra_args``, which the engine
    parses after these). The speculative block is the same for prefill and decode (a PD pair with different
    settings fails every room at the bootstrap handshake); the SGLang-only keys never get here (pd.config refuses
    them for the reference engine).

    Raises:
        pd.engines.errors.EngineSettingsError: a value the engine refuses, naming the flag.
    """
    # the router's caps, so that what the router admits no engine refuses (a group's extra_args may still lower them)
    r = cfg.router
    values = dict(model_path=cfg.model_path, host=host, port=port, disaggregation_mode=role,
                  disaggregation_transfer_backend=cfg.transfer.backend,
                  disaggregation_transfer_protocol=cfg.transfer.protocol, page_size=cfg.page_size,
                  served_model_name=cfg.served_model_name, disaggregation_ib_device=cfg.transfer.ib_device or None,
                  disaggregation_bootstrap_port=bootstrap_port, max_n=r.max_n, max_batch_size=r.max_batch_size,
                  max_sequences_per_request=r.max_sequences_per_request, max_body_bytes=r.max_payload_size)
    sp, _ = cfg.speculative_settings()
    if sp is not None:
        values["speculative"] = sp.engine_settings()
    try:
        return EngineSettings(**{k: v for k, v in values.items() if v is not None})
    except ValidationError as e:
        raise settings_error(e) from None


def reference_command(cfg: PDConfig, role: str, host: str, port: int, bootstrap_port: int | None,
                      api_key: str | None = None) -> EngineCommand:
    """Build the reference engine's command for one worker.

    Args:
        role: ``prefill`` or ``decode``.
        host: address the engine listens on and peers reach it at.
        port: HTTP port; ``bootstrap_port``: the prefill's bootstrap port (None for decode).
        api_key: the key the engine requires (``--api-key``), passed in ``$PDSERVE_ENGINE_API_KEY``.
    """
    group = cfg.groups()[role]
    argv = [sys.executable, "-m", "pd.cli", "engine"]
    argv += engine_argv(reference_settings(cfg, role, host, port, bootstrap_port))
    argv += group.extra_args
    env = dict(group.env)
    if cfg.transfer.protocol == "tcp":
        env.setdefault("MC_FORCE_TCP", "1")
    if api_key:
        env[API_KEY_ENV] = api_key  # the environment, not the command line: ps shows argv to everyone
    return EngineCommand(argv=argv, env=env, ready_path="/health", args_start=4)
