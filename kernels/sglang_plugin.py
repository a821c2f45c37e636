"""pdserve's SGLang plugin: routes the pinned SGLang's sm_120 DeepSeek-V4 paths to pdserve's Triton kernels.

SGLang (0.5.23) loads general plugins from the entry point group ``sglang.srt.plugins`` in every process it
starts (``sglang.srt.plugins.load_plugins``: scheduler, detokenizer, main), filtered by the comma-separated
allow-list ``SGLANG_PLUGINS`` when that is set. pyproject.toml registers :func:`register` there under the name
``pdserve``. It registers AROUND hooks with ``sglang.srt.plugins.hook_registry.HookRegistry`` (by dotted target
path); SGLang patches the targets right after all plugins ran. AROUND, not REPLACE, because each adapter must
be able to hand a call it cannot serve back to SGLang's own function (the hook receives it as ``original``).

Switches (environment of the SGLang worker; ``pdserve plan`` prints what a config sets):

==========================  =======  ==============================================================
variable                    default  meaning
==========================  =======  ==============================================================
``PDSERVE_KERNELS``         ``0``    master switch; unset or 0 = the plugin registers nothing
``PDSERVE_SPARSE_MLA``      ``1``    sparse-MLA decode -> ``pd.kernels.sparse_mla_decode``
``PDSERVE_INDEXER``         ``1``    DSA/C4 lightning-indexer scores + top-k -> ``pd.kernels.indexer``
``PDSERVE_MXFP4_MOE``       ``1``    MTP draft MXFP4 MoE method -> ``pd.kernels.mxfp4_moe``
``PDSERVE_KERNELS_FORCE``   ``0``    also take calls on GPUs other than the sm_120 family (testing)
``SGLANG_PLUGINS``          (all)    SGLang's allow-list; when set, pdserve adds itself to it
==========================  =======  ==============================================================

Values: 1/true/yes/on or 0/false/no/off (anything else is a ValueError naming the variable). The per-kernel
switches only matter with the master switch on. The hooks are registered whatever the GPU; each adapter takes
a call only when its tensors live on a compute capability 12.x GPU (sm_120 RTX PRO 6000 / RTX 50, sm_121),
or anywhere with ``PDSERVE_KERNELS_FORCE=1``, and otherwise calls SGLang's function unchanged.

The hook table is :data:`HOOKS`; each adapter module documents its target's signature and the conversion:
``pd.kernels.sglang_sparse_mla``, ``pd.kernels.sglang_indexer``, ``pd.kernels.sglang_mxfp4_moe``.
This module imports neither torch nor sglang at import time (pd.commands.sglang reads its flag names).
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

logger = logging.getLogger("pdserve.sglang_plugin")

ENTRY_POINT_GROUP = "sglang.srt.plugins"
PLUGIN_NAME = "pdserve"
PLUGIN_ALLOW_LIST = "SGLANG_PLUGINS"
MASTER_FLAG = "PDSERVE_KERNELS"
FORCE_FLAG = "PDSERVE_KERNELS_FORCE"
# kernel name -> its switch; all default to on once the master switch is on
KERNEL_FLAGS = {
    "sparse_mla": "PDSERVE_SPARSE_MLA",
    "indexer": "PDSERVE_INDEXER",
    "mxfp4_moe": "PDSERVE_MXFP4_MOE",
}
# kernel name -> the module its adapters call (imported at registration: a missing or broken kernel
# leaves SGLang's path in place with an error in the log, instead of failing inside a forward pass)
KERNEL_MODULES = {
    "sparse_mla": "pd.kernels.sparse_mla_decode",
    "indexer": "pd.kernels.indexer",
    "mxfp4_moe": "pd.kernels.mxfp4_moe",
}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@dataclass(frozen=True)
class HookSpec:
    """One AROUND hook: ``adapter(original, *args, **kwargs)`` wraps SGLang's ``target``.

    Attributes:
        kernel: the switch it belongs to (a key of KERNEL_FLAGS).
        target: dotted path of the function/method in the pinned sglang (HookRegistry's target syntax).
        params: the target's parameters, in order, that the adapter reads (``**kwargs`` for a kwargs-only
            function); the contract tests compare them with the pinned source.
        adapter: ``module:function`` of the adapter inside pd.kernels (imported only when registered).
    """

    kernel: str
    target: str
    params: tuple[str, ...]
    adapter: str

    def load_adapter(self) -> Callable:
        module, _, name = self.adapter.partition(":")
        return getattr(importlib.import_module(module), name)


HOOKS: tuple[HookSpec, ...] = (
    # DSv4 sparse decode on sm_120 (DeepseekV4AttnBackend._forward_attention calls it with keywords only).
    HookSpec("sparse_mla", "sglang.kernels.ops.attention.flash_mla_sm120.flash_mla_with_kvcache_sm120",
             ("**kwargs",), "pd.kernels.sglang_sparse_mla:flash_mla_with_kvcache_sm120"),
    # The query-head padding to 64 that only FlashInfer's decode specialization needs.
    HookSpec("sparse_mla", "sglang.srt.models.deepseek_v4.MqaAttentionBase._kernel_num_heads",
             ("self", "num_tokens"), "pd.kernels.sglang_sparse_mla:kernel_num_heads"),
    # C4 lightning indexer: scores over the paged index-K cache + top-k -> sparse page indices.
    HookSpec("indexer", "sglang.srt.layers.attention.dsv4.indexer.C4IndexerBackendMixin.forward_c4_indexer",
             ("self", "x", "q_lora", "c4_indexer", "forward_batch", "alt_streams", "enable_multi_stream",
              "q_lora_ready", "skip_compressor", "q_lora_quant"),
             "pd.kernels.sglang_indexer:forward_c4_indexer"),
    # MoE method choice for MXFP4 routed experts of the speculative draft (DSv4 MTP layer).
    HookSpec("mxfp4_moe", "sglang.srt.layers.quantization.fp8.Fp8Config.get_quant_method",
             ("self", "layer", "prefix"), "pd.kernels.sglang_mxfp4_moe:get_quant_method"),
)


def parse_flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    """A boolean switch from ``env``; ``default`` when unset.

    Raises:
        ValueError: the value is not one of 1/true/yes/on/0/false/no/off (names the variable).
    """
    raw = env.get(name)
    if raw is None:
        return default
    v = raw.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r}: expected one of 1/true/yes/on or 0/false/no/off")


def enabled_kernels(env: Optional[Mapping[str, str]] = None) -> frozenset[str]:
    """Kernel names switched on in ``env`` (default os.environ): empty unless PDSERVE_KERNELS is on."""
    env = os.environ if env is None else env
    if not parse_flag(env, MASTER_FLAG, False):
        return frozenset()
    return frozenset(k for k, flag in KERNEL_FLAGS.items() if parse_flag(env, flag, True))


def selected_hooks(env: Optional[Mapping[str, str]] = None) -> list[HookSpec]:
    """The hooks :func:`register` installs for ``env`` (default os.environ)."""
    on = enabled_kernels(env)
    return [h for h in HOOKS if h.kernel in on]


def allow_list_with_plugin(allow_list: Optional[str]) -> Optional[str]:
    """``allow_list`` (an ``SGLANG_PLUGINS`` value) extended with ``pdserve``, or None when it is unset or
    empty: SGLang then loads every installed plugin, ours among them, and naming ours alone would turn the
    others off (``sglang.srt.plugins.load_plugins_by_group`` treats a non-empty value as the only ones)."""
    names = [p.strip() for p in (allow_list or "").split(",") if p.strip()]
    if not names:
        return None
    if PLUGIN_NAME not in names:
        names.append(PLUGIN_NAME)
    return ",".join(names)


def worker_env(kernels: Mapping[str, bool], force: bool = False,
               allow_list: Optional[str] = None) -> dict[str, str]:
    """Environment that switches the plugin on in an SGLang worker.

    Args:
        kernels: kernel name -> on/off (keys from KERNEL_FLAGS; missing keys stay on).
        force: take calls on any GPU architecture, not only sm_120.
        allow_list: the worker's own SGLANG_PLUGINS value, if it sets one; ``pdserve`` is added to it. Unset,
            the result sets no SGLANG_PLUGINS, so every installed plugin keeps loading (a value the node's
            own environment holds is extended where the engine starts: :func:`allow_list_with_plugin`).

    Raises:
        ValueError: an unknown kernel name.
    """
    unknown = set(kernels) - set(KERNEL_FLAGS)
    if unknown:
        raise ValueError(f"unknown pdserve kernel(s) {sorted(unknown)}; known: {sorted(KERNEL_FLAGS)}")
    env = {MASTER_FLAG: "1"}
    allowed = allow_list_with_plugin(allow_list)
    if allowed is not None:
        env[PLUGIN_ALLOW_LIST] = allowed
    for k, flag in KERNEL_FLAGS.items():
        env[flag] = "1" if kernels.get(k, True) else "0"
    if force:
        env[FORCE_FLAG] = "1"
    return env


# ---- runtime state shared by the adapters ----------------------------------------------------------------
_force = False
_arch_ok: dict = {}
_warned: set = set()


def takes_device(device) -> bool:
    """Whether adapters take calls on ``device`` (a torch.device): CUDA compute capability 12.x, or any
    device with PDSERVE_KERNELS_FORCE=1 (read at registration)."""
    if _force:
        return True
    if getattr(device, "type", None) != "cuda":
        return False
    key = device.index
    if key not in _arch_ok:
        import torch

        _arch_ok[key] = torch.cuda.get_device_capability(device)[0] == 12
    return _arch_ok[key]


def fall_back(kernel: str, reason: str) -> None:
    """Log once per (kernel, reason) that a call goes to SGLang's own path, and why."""
    if (kernel, reason) not in _warned:
        _warned.add((kernel, reason))
        logger.warning("pdserve %s: using SGLang's path for this call: %s", kernel, reason)


def register() -> None:
    """Entry point (``sglang.srt.plugins``: ``pdserve``): register the AROUND hooks of every switched-on kernel
    whose module imports.

    Raises:
        ValueError: a malformed switch value (SGLang logs it as a failed plugin and starts without hooks).
    """
    global _force
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    _force = parse_flag(os.environ, FORCE_FLAG, False)
    hooks = selected_hooks()
    for kernel in sorted({h.kernel for h in hooks}):
        try:
            importlib.import_module(KERNEL_MODULES[kernel])
        except Exception:
            logger.exception("pdserve %s: cannot import %s; SGLang's own path stays in place", kernel,
                             KERNEL_MODULES[kernel])
            hooks = [h for h in hooks if h.kernel != kernel]
    for h in hooks:
        HookRegistry.register(h.target, h.load_adapter(), HookType.AROUND)
    if hooks:
        logger.info("pdserve kernels on (%s%s): hooks on %s", ", ".join(sorted({h.kernel for h in hooks})),
                    "; forced on every GPU" if _force else "; sm_120 family only",
                    ", ".join(h.target for h in hooks))
    elif not parse_flag(os.environ, MASTER_FLAG, False):
        logger.info("pdserve plugin loaded, no kernel switched on (%s=1 switches them on)", MASTER_FLAG)
    else:  # on, but every kernel is switched off or failed to import (logged above)
        off = [flag for k, flag in sorted(KERNEL_FLAGS.items()) if not parse_flag(os.environ, flag, True)]
        why = "every kernel is switched off" if len(off) == len(KERNEL_FLAGS) else \
            "the kernels not switched off failed to import (see above)"
        logger.info("pdserve plugin loaded with %s=1 but no kernel is on: %s (%s); SGLang's own paths stay in place",
                    MASTER_FLAG, why, ", ".join(f"{f}=0" for f in off) or "none switched off")
