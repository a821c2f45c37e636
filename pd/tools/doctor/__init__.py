"""``pdserve doctor CONFIG [--assume-gpu sm_120] [--json]``: preflight checks of a deployment.

Each check is a small function of a :class:`Context` (the config, the GPU architecture, the
model's config.json, the SGLang argv of both roles parsed by the pinned parser) that returns
:class:`Finding` objects: ``error`` (known to fail: the launch is refused), ``warning`` (runs, but
probably not the way you want) or ``ok`` (passed, or skipped with the reason). ``pd.cluster.launch`` runs
the same checks before it touches Ray (:func:`preflight`).

Exit codes: 0 no errors (warnings allowed), 1 at least one error, 2 an unreadable/invalid config.

Modules: :mod:`.findings` (the result type), :mod:`.hardware` (GPU and RDMA detection),
:mod:`.checkpoint` (what is read from config.json), :mod:`.context` (what each role runs;
:mod:`.engine_argv` for the reference engine),
:mod:`.moe` (which MoE backend SGLang picks, and where it runs), the checks by subject
(:mod:`.checks_model`, :mod:`.checks_moe`, :mod:`.checks_argv`, :mod:`.checks_node`, and
:mod:`.checks_reference` for the reference engine's argv and speculative decoding),
:mod:`.runner` (:data:`CHECKS` in order), :mod:`.render` and :mod:`.cli`.
"""

from .checkpoint import ModelConfigError, ModelInfo, read_model_info, routed_expert_dtype
from .checks_model import CONTEXT_LENGTH_LIMIT, DSV4_PAGE_SIZE
from .cli import main
from .context import FIELDS, ROLES, Context, build_context
from .findings import LEVELS, Finding, exit_code
from .hardware import GpuInfo, detect_gpu, ib_devices, parse_arch
from .moe import (
    ARCH_BOUND_MOE_BACKENDS,
    FP4_EXPERT_METHODS,
    FP4_TO_TRITON_BACKENDS,
    resolve_draft_moe,
    resolve_target_moe,
)
from .render import render, render_json
from .runner import CHECKS, config_findings, doctor, preflight, run_checks

__all__ = [
    "ARCH_BOUND_MOE_BACKENDS", "CHECKS", "CONTEXT_LENGTH_LIMIT", "DSV4_PAGE_SIZE", "FIELDS", "FP4_EXPERT_METHODS",
    "FP4_TO_TRITON_BACKENDS", "LEVELS", "ROLES", "Context", "Finding", "GpuInfo", "ModelConfigError", "ModelInfo",
    "build_context", "config_findings", "detect_gpu", "doctor", "exit_code", "ib_devices", "main", "parse_arch",
    "preflight", "read_model_info", "render", "render_json", "resolve_draft_moe", "resolve_target_moe",
    "routed_expert_dtype", "run_checks",
]
