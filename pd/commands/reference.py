"""The reference engine's command line (``pdserve engine``, SGLang's flag names) for one worker."""

from __future__ import annotations

import sys

from pd.commands.command import EngineCommand
from pd.config import PDConfig
from pd.engines.api.auth import API_KEY_ENV


def speculative_flags(cfg: PDConfig) -> list[str]:
    """The ``--speculative-*`` flags of the config's speculative block (``PDConfig.speculative_settings``), the same
    for prefill, decode and a null engine of the same config (a PD pair with different settings fails every room at
    the bootstrap handshake); [] when speculation is off. The SGLang-only keys never get here (pd.config refuses
    them for the reference engine)."""
    sp, _ = cfg.speculative_settings()
    if sp is None:
        return []
    flags = ["--speculative-algorithm", sp.algorithm, "--speculative-num-steps", str(sp.num_steps),
             "--speculative-eagle-topk", str(sp.eagle_topk), "--speculative-num-draft-tokens", str(sp.num_draft_tokens)]
    if sp.draft_model_path:
        flags += ["--speculative-draft-model-path", sp.draft_model_path]
    return flags


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
    # the router's caps, so that what the router admits no engine refuses (a group's extra_args may still lower them)
    r = cfg.router
    argv += ["--max-n", str(r.max_n), "--max-batch-size", str(r.max_batch_size),
             "--max-sequences-per-request", str(r.max_sequences_per_request),
             "--max-body-bytes", str(r.max_payload_size)]
    argv += speculative_flags(cfg)
    argv += group.extra_args
    env = dict(group.env)
    if cfg.transfer.protocol == "tcp":
        env.setdefault("MC_FORCE_TCP", "1")
    if api_key:
        env[API_KEY_ENV] = api_key  # the environment, not the command line: ps shows argv to everyone
    return EngineCommand(argv=argv, env=env, ready_path="/health", args_start=4)
