"""The :class:`Context` every check reads, built once by :func:`build_context`.

It holds the config, the GPU, the target's and the draft's config.json (:mod:`.checkpoint`) and each
role's SGLang argv parsed by the pinned parser, and answers "what does this role effectively run"
(:meth:`Context.value`: the parsed argv, extra_args included, else the config's value).

When config.json cannot be read here, a ``model_path`` whose name says DeepSeek-V4 is taken as one
(:meth:`Context.dsv4`; architecture-keyed checks then report warnings, not errors: the guess could be
wrong).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from pd.config import PDConfig

from .checkpoint import DSV4_ARCH_PREFIX, ModelConfigError, ModelInfo, read_model_info
from .engine_argv import parse_reference_args
from .hardware import GpuInfo

DSV4_NAME = re.compile(r"deepseek[-_ .]?v4", re.IGNORECASE)  # a model_path that names DeepSeek-V4


# SGLang namespace attribute -> (config field, flag), for messages.
FIELDS = {
    "quantization": ("sglang.quantization", "--quantization"),
    "moe_runner_backend": ("sglang.moe_runner_backend", "--moe-runner-backend"),
    "speculative_moe_runner_backend": ("sglang.speculative.moe_runner_backend", "--speculative-moe-runner-backend"),
    "speculative_algorithm": ("sglang.speculative.algorithm", "--speculative-algorithm"),
    "speculative_eagle_topk": ("sglang.speculative.eagle_topk", "--speculative-eagle-topk"),
    "speculative_draft_model_path": ("sglang.speculative.draft_model_path", "--speculative-draft-model-path"),
    "context_length": ("sglang.context_length", "--context-length"),
    "page_size": ("page_size", "--page-size"),
    "model_path": ("model_path", "--model-path"),
    "kv_cache_dtype": ("sglang.kv_cache_dtype", "--kv-cache-dtype"),
}
ROLES = ("prefill", "decode")
SPEC_PREFIX = "sglang.speculative."  # FIELDS' spelling; messages use the key the config gave (Context.spec_key)


@dataclass
class Context:
    """Everything the checks look at; built once by :func:`build_context`.

    Attributes:
        model / draft: the target's and the separate draft's config.json (None: not read, see
            ``model_note`` / ``draft_note``).
        args: each role's SGLang argv parsed by the pinned parser (sglang engine; a role is
            missing when parsing failed, see ``arg_errors``).
        engine_args: each role's reference-engine argv parsed by the engine's parser, with its speculative
            settings resolved as the engine resolves them (reference engine; :mod:`.engine_argv`).
        check_ports: try binding the router's address.
    """

    cfg: PDConfig
    gpu: GpuInfo
    model: Optional[ModelInfo] = None
    model_note: str = ""
    draft: Optional[ModelInfo] = None
    draft_note: str = ""
    args: dict = field(default_factory=dict)
    arg_errors: dict = field(default_factory=dict)
    engine_args: dict = field(default_factory=dict)
    check_ports: bool = True

    @property
    def sglang(self) -> bool:
        """True when the config's engine is SGLang (the SGLang-only checks apply)."""
        return self.cfg.engine == "sglang"

    def value(self, role: str, attr: str):
        """The effective SGLang setting of a role: the parsed argv (extra_args included), else
        the config's value."""
        if role in self.args:
            return getattr(self.args[role], attr)
        s, sp = self.cfg.sglang, self.spec_block
        fallback = {
            "quantization": s.quantization, "moe_runner_backend": s.moe_runner_backend or "auto",
            "speculative_moe_runner_backend": sp.moe_runner_backend if sp else None,
            "speculative_algorithm": sp.algorithm if sp else None,
            "speculative_eagle_topk": sp.eagle_topk if sp else None,
            "speculative_draft_model_path": sp.draft_model_path if sp else None,
            "context_length": s.context_length, "page_size": self.cfg.page_size,
            "model_path": self.cfg.model_path, "kv_cache_dtype": s.kv_cache_dtype,
            "moe_a2a_backend": "none", "speculative_moe_a2a_backend": sp.moe_a2a_backend if sp else None,
        }
        return fallback[attr]

    @property
    def spec_block(self):
        """The config's speculative block (``speculative`` or ``sglang.speculative``), None when off."""
        return self.cfg.speculative_settings()[0]

    def spec_key(self, name: str = "") -> str:
        """The config key of the speculative block, or of one of its keys, as the config spells it:
        ``speculative.eagle_topk`` or ``sglang.speculative.eagle_topk``."""
        key = self.cfg.speculative_settings()[1]
        return f"{key}.{name}" if name else key

    def env_flag(self, role: str, name: str) -> bool:
        """Whether a role's ``env`` switches an SGLang boolean variable on (SGLang's EnvBool spelling:
        true/1/yes/y, any case)."""
        return str(self.cfg.groups()[role].env.get(name, "")).strip().lower() in ("true", "1", "yes", "y")

    def dsv4(self) -> tuple[bool, bool, str]:
        """Whether the target is DeepSeek-V4: (is_dsv4, guessed, where from). From config.json's
        architectures[0]; when it was not read, guessed from a model_path that names DeepSeek-V4."""
        if self.model is not None:
            arch = self.model.architecture or "?"
            return arch.startswith(DSV4_ARCH_PREFIX), False, f"config.json architectures[0]={arch}"
        name = Path(self.cfg.model_path).name
        if DSV4_NAME.search(name):
            return True, True, f"model_path {name} names DeepSeek-V4 (its config.json was not read here)"
        return False, False, ""

    def by_value(self, attr: str, roles=ROLES) -> dict:
        """{value: [roles]} of an effective setting."""
        out: dict = {}
        for r in roles:
            out.setdefault(self.value(r, attr), []).append(r)
        return out

    def where(self, attr: str, roles) -> str:
        """``sglang.quantization (--quantization)``, or ``decode.extra_args (--flag)`` when a
        group's extra_args sets it."""
        name, flag = FIELDS[attr]
        if name.startswith(SPEC_PREFIX):
            name = self.spec_key(name[len(SPEC_PREFIX):])
        via = [r for r in roles if any(t == flag or t.startswith(flag + "=") for t in self.cfg.groups()[r].extra_args)]
        if via:
            return " and ".join(f"{r}.extra_args" for r in via) + f" ({flag})"
        return f"{name} ({flag})"

    def spec_roles(self) -> list[str]:
        """Roles that run speculative decoding."""
        return [r for r in ROLES if self.value(r, "speculative_algorithm")]


def roles_text(roles) -> str:
    """``both roles``, or the roles named (for messages)."""
    return "both roles" if set(roles) == set(ROLES) else " and ".join(roles)


def build_context(cfg: PDConfig, gpu: GpuInfo, check_ports: bool = True) -> Context:
    """Read the model configs and parse both roles' SGLang argv (sglang engine), or parse both roles' reference
    engine argv (reference engine: its checkpoints are read by the checks that need them)."""
    ctx = Context(cfg=cfg, gpu=gpu, check_ports=check_ports)
    if cfg.engine != "sglang":
        ctx.engine_args = {role: parse_reference_args(cfg, role) for role in ROLES}
        return ctx
    if cfg.model_path.startswith("builtin:"):
        ctx.model_note = f"{cfg.model_path} is built in"
    else:
        try:
            ctx.model = read_model_info(cfg.model_path)
        except ModelConfigError as e:
            ctx.model_note = str(e)
    sp = ctx.spec_block
    if sp is not None and sp.draft_model_path:
        try:
            ctx.draft = read_model_info(sp.draft_model_path)
        except ModelConfigError as e:
            ctx.draft_note = str(e)
    from pd.commands.sglang import SGLangArgError, server_args_of, sglang_command

    for role in ROLES:
        try:
            cmd = sglang_command(cfg, role, "127.0.0.1", 30000, 8998 if role == "prefill" else None)
            ctx.args[role] = server_args_of(cmd)
        except SGLangArgError as e:
            ctx.arg_errors[role] = ("error", str(e))
        except RuntimeError as e:  # the pinned parser is not importable here
            ctx.arg_errors[role] = ("warning", str(e))
    return ctx
