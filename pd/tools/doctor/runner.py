"""Running the checks: :data:`CHECKS` in order on one :class:`~.context.Context`, as ``pdserve doctor``
(:func:`doctor`: load a config file, never raise) and as ``pd.cluster.launch`` (:func:`preflight`)."""

from __future__ import annotations

import sys
from typing import Callable, Optional

from pd.config import ConfigError, PDConfig, load_config

from .checks_adaptive import check_speculative_adaptive
from .checks_argv import check_engine_args, check_pd_consistency, check_pd_env
from .checks_model import (
    check_context_length,
    check_model_config,
    check_model_speculative,
    check_page_size,
    check_quantization,
    check_speculative_draft,
)
from .checks_moe import check_fp4_experts, check_moe_backend_arch, check_spec_moe_explicit
from .checks_node import check_gpu_arch, check_gpus, check_kv_transfer, check_pdserve_plugin, check_router_port
from .checks_reference import check_reference_engine_args, check_reference_speculative
from .context import Context, build_context
from .findings import Finding, exit_code
from .hardware import GpuInfo, detect_gpu
from .render import render

CHECKS: list[Callable[[Context], list[Finding]]] = [
    check_gpu_arch, check_model_config, check_engine_args, check_reference_engine_args, check_reference_speculative,
    check_quantization, check_moe_backend_arch,
    check_fp4_experts, check_spec_moe_explicit, check_speculative_draft, check_model_speculative,
    check_speculative_adaptive,
    check_page_size, check_pd_consistency, check_pd_env,
    check_gpus, check_router_port,
    check_context_length, check_pdserve_plugin, check_kv_transfer,
]


def run_checks(cfg: PDConfig, gpu: GpuInfo, check_ports: bool = True) -> list[Finding]:
    """Every check on a validated config, in order."""
    ctx = build_context(cfg, gpu, check_ports=check_ports)
    return [f for check in CHECKS for f in check(ctx)]


def config_findings(e: ConfigError) -> list[Finding]:
    """An invalid config as findings (one per problem line), check id ``config``."""
    def fix(line: str) -> str:
        if "invalid YAML" in line:
            return "fix the YAML at that line"
        if "cannot read config" in line:
            return "check the config path"
        return "fix the named field"

    return [Finding("error", "config", line, fix(line)) for line in str(e).splitlines() if line.strip()]


def doctor(path: Optional[str], assume_gpu: Optional[str] = None) -> tuple[list[Finding], int, GpuInfo]:
    """Load a config file and check it: (findings, exit code, GPU info). Exit code 2 for an
    unreadable or invalid config (reported as ``config`` findings, not raised)."""
    try:
        cfg = load_config(path)
    except ConfigError as e:
        return config_findings(e), 2, GpuInfo()
    gpu = detect_gpu(assume_gpu) if (assume_gpu or cfg.engine == "sglang") else GpuInfo()
    findings = run_checks(cfg, gpu)
    return findings, exit_code(findings), gpu


def preflight(cfg: PDConfig, out=None) -> bool:
    """What ``pd.cluster.launch`` runs before starting: detect the GPU, run every check, print warnings and
    errors (to ``out``, default stderr). Returns False when an error must stop the launch."""
    out = out or sys.stderr
    gpu = detect_gpu() if cfg.engine == "sglang" else GpuInfo()
    findings = run_checks(cfg, gpu)
    if any(f.level != "ok" for f in findings):
        print("pdserve doctor:\n" + render(findings, verbose=False), file=out, flush=True)
    return exit_code(findings) == 0
