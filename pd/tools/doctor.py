"""``pdserve doctor CONFIG [--assume-gpu sm_120] [--json]``: preflight checks of a deployment.

Each check is a small function of a :class:`Context` (the config, the GPU architecture, the
model's config.json, the SGLang argv of both roles parsed by the pinned parser) that returns
:class:`Finding` objects: ``error`` (known to fail: the launch is refused), ``warning`` (runs, but
probably not the way you want) or ``ok`` (passed, or skipped with the reason). ``pd.cluster.launch`` runs
the same checks before it touches Ray (:func:`preflight`).

Exit codes: 0 no errors (warnings allowed), 1 at least one error, 2 an unreadable/invalid config.

What the checks know about the pinned SGLang (0.5.23), in our words:

- MoE runner backends that only exist for one GPU generation: the FlashInfer TRT-LLM family
  (``flashinfer_trtllm``, ``experimental_sgl_trtllm``, ``flashinfer_trtllm_routed``) runs
  trtllm-gen kernels built for compute capability 10.x only (SGLang itself says "trtllm-gen MoE
  kernels are SM100-only" when it steers modelopt_fp4 away from them on sm_110/sm_120);
  ``flashinfer_megamoe`` raises unless the device is SM100-family; ``hpc_ops`` is SM90-only.
- The draft (MTP) MoE backend: ``--speculative-moe-runner-backend`` when given, otherwise the
  target's resolved backend (``flashinfer_megamoe`` becomes ``flashinfer_trtllm`` for the draft).
  EAGLE's worker (``eagle_worker_v2``) builds the draft under that backend, so it decides the
  draft's MoE method. The draft's quantization (``--speculative-draft-model-quantization``)
  defaults to ``--quantization``; left unset, the checkpoint's format is auto-detected and the
  guards keyed on the quantization value do not fire.
- MXFP4 routed experts (``ModelConfig.is_fp4_experts``; DeepSeek-V4's layout, MTP layer included)
  get their MoE method from ``Fp8Config.get_quant_method`` by backend: ``flashinfer_mxfp4``
  (FlashInfer CUTLASS MXFP8 x MXFP4 on sm_120, CUTLASS on sm_90, otherwise the TRT-LLM method whose
  kernels are sm_100-only), ``marlin`` (raises off sm_90/sm_120), ``humming``. Every other backend
  leaves them to ``Fp8MoEMethod``, whose FP8 kernels do not read packed e2m1: under ``triton``
  (also what ``auto``, ``flashinfer_cutlass`` and ``flashinfer_cutedsl`` become there) the first
  forward fails "Hidden size mismatch". With ``SGLANG_DSV4_FP4_DEQUANT=1`` the experts are
  dequantized to FP8 at load and the backend must be ``auto`` (SGLang asserts it). Left ``auto``,
  the target of a DeepSeek-V4 checkpoint gets ``flashinfer_mxfp4`` from SGLang's model override on
  sm_90/sm_100/sm_120 (no expert-parallel all-to-all, no dequantization), and
  ``flashinfer_trtllm_routed`` (sm_100-only) for the NVFP4 hybrid; an explicit ``auto`` for the
  draft is not resolved by that override.
- DeepSeek-V4 on CUDA runs 256-token KV pages: its model override replaces any ``--page-size``
  (the last declaration wins over the command line, with only an info log) and the dsv4
  attention metadata asserts 256.
- DeepSeek-V4 with EAGLE requires ``--speculative-eagle-topk 1``.

config.json keys read (the model directory's, and the draft directory's when
``sglang.speculative.draft_model_path`` is set):

- ``architectures[0]``, ``hidden_size``, ``max_position_embeddings``, ``num_nextn_predict_layers``
  (> 0: the checkpoint carries its own MTP draft layers), ``index_topk`` (present: a DSA
  lightning indexer; DeepSeek-V4 / V3.2 architectures are treated the same).
- ``quantization_config.quant_method``: what SGLang auto-detects for ``--quantization``. When it
  is missing or ``modelopt``, ``quantization_config.quant_algo`` (or ``hf_quant_config.json``'s
  ``quantization.quant_algo``) maps as SGLang maps it: FP8 -> modelopt_fp8, *FP4* ->
  modelopt_fp4, MXFP8 -> mxfp8, MIXED_PRECISION -> modelopt_mixed (w4afp8 without NVFP4 layers).
  A ``compression_config`` means compressed-tensors.
- Routed-expert format: ``quantization_config.routed_experts_quant_method == "mxfp4"`` (all
  routed experts, the MTP layer's included, are MXFP4); ``quant_method == "mxfp4"``;
  ``quant_algo == "MIXED_PRECISION"`` with ``moe_quant_algo == "NVFP4"`` (main experts NVFP4, the
  MTP layer's ``mtp.*`` experts stay MXFP4); a DeepSeek-V4 architecture without
  ``routed_experts_quant_method``: as SGLang decides it, by the dtype of one routed expert weight
  in the safetensors header (``model.safetensors.index.json`` -> shard; U8/I8/F4: MXFP4,
  F8_E4M3: FP8 experts), else its default ``SGLANG_DSV4_FP4_EXPERTS=1`` (MXFP4).

When config.json cannot be read here, a ``model_path`` whose name says DeepSeek-V4 is taken as one
(architecture-keyed checks then report warnings, not errors: the guess could be wrong).

GPU detection: ``--assume-gpu`` wins (no device query). Otherwise ``nvidia-smi
--query-gpu=compute_cap`` first — it counts the node's physical GPUs, which is what the config's
``gpus`` ids index (workers put them in CUDA_VISIBLE_DEVICES), and creates no CUDA context in the
launching process — then ``torch.cuda``. Neither: architecture checks are skipped. The reference
engine needs no GPU, so for it nothing is queried.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

from pd.config import ConfigError, PDConfig, load_config
from pd.engines.builtin_model import BUILTIN_MODELS, BUILTIN_PREFIX

LEVELS = ("error", "warning", "ok")

# MoE runner backend -> the compute-capability majors its kernels exist for (pinned SGLang).
ARCH_BOUND_MOE_BACKENDS: dict[str, tuple[int, ...]] = {
    "flashinfer_trtllm": (10,),
    "experimental_sgl_trtllm": (10,),
    "flashinfer_trtllm_routed": (10,),
    "flashinfer_megamoe": (10,),
    "hpc_ops": (9,),
}
# MXFP4 routed experts: Fp8Config.get_quant_method wraps them in an MXFP4 MoE method for these backends;
# value: the compute-capability majors where that method runs (None: SGLang does not gate it by GPU).
FP4_EXPERT_METHODS: dict[str, Optional[tuple[int, ...]]] = {
    "flashinfer_mxfp4": (9, 10, 12),  # CUTLASS on sm_90/sm_12x, TRT-LLM (sm_100-only kernels) on any other GPU
    "marlin": (9, 12),                # Mxfp4MarlinMoEMethod: "MXFP4 Marlin requires SM90 or SM120"
    "humming": None,
}
# Fp8MoEMethod's own runners that read FP4 experts (their GPU limits are in ARCH_BOUND_MOE_BACKENDS).
FP4_EXPERT_RUNNERS = ("deep_gemm", "flashinfer_megamoe", "aiter")
# Backends under which MXFP4 experts end on Fp8MoEMethod's Triton FP8 kernel (auto unless DeepGEMM is on;
# Fp8MoEMethod has no FlashInfer CUTLASS/CuteDSL FP8 path and switches those to Triton).
FP4_TO_TRITON_BACKENDS = ("triton", "auto", "flashinfer_cutlass", "flashinfer_cutedsl")
DEEPGEMM_A2A_BACKENDS = ("deepep", "mooncake", "nixl")  # with these, auto is DeepGEMM in Fp8MoEMethod
DSV4_AUTO_MXFP4_MAJORS = (9, 10, 12)  # SGLang's DeepSeek-V4 override: auto -> flashinfer_mxfp4 there
FP4_DEQUANT_ENV = "SGLANG_DSV4_FP4_DEQUANT"  # dequantize MXFP4 experts to FP8 at load (needs backend auto)
DSV4_PAGE_SIZE = 256  # what DeepSeek-V4's model override sets on CUDA, and what its attention asserts
TRITON_MOE_BACKEND = "triton"  # FP8/BF16 experts: Triton's fused MoE runs on every CUDA generation
CONTEXT_LENGTH_LIMIT = 65536  # above this the stock DSA indexer's per-step cost dominates
DSA_ARCH_PREFIXES = ("DeepseekV4", "DeepseekV32")
DSV4_ARCH_PREFIX = "DeepseekV4"
DSV4_NAME = re.compile(r"deepseek[-_ .]?v4", re.IGNORECASE)  # a model_path that names DeepSeek-V4
# a routed expert's weight in a DeepSeek checkpoint (the key SGLang probes for the expert dtype)
ROUTED_EXPERT_KEY = re.compile(r"\.experts\.\d+\.(?:w[123]|down_proj|up_proj|gate_proj)\.weight$")
FP4_SAFETENSORS_DTYPES = ("U8", "I8", "F4")  # packed e2m1 pairs
IB_SYSFS = "/sys/class/infiniband"


@dataclass
class Finding:
    """One preflight result.

    Attributes:
        level: ``error`` (known to fail), ``warning`` or ``ok`` (passed or skipped, see message).
        check: the check's id, e.g. ``quantization``.
        message: what was found, naming the config field and SGLang flag.
        fix: what to try (empty for ``ok``).
    """

    level: str
    check: str
    message: str
    fix: str = ""


@dataclass
class GpuInfo:
    """The GPU generation the deployment runs on.

    Attributes:
        arch: ``sm_XY`` (e.g. ``sm_120``), or None when unknown (no GPU visible, no flag).
        count: GPUs on this node, or None when not detected.
        source: where it came from (``--assume-gpu``, ``nvidia-smi``, ``torch.cuda``, ...).
    """

    arch: Optional[str] = None
    count: Optional[int] = None
    source: str = "not detected"

    @property
    def major(self) -> Optional[int]:
        """Compute-capability major (``sm_120`` -> 12), None when the arch is unknown."""
        return None if self.arch is None else int(self.arch[3:]) // 10


@dataclass
class ModelInfo:
    """What the checks need from one checkpoint's config.json (see the module docstring for keys).

    Attributes:
        quant_method: the ``--quantization`` value SGLang would auto-detect, None for none.
        quant_source: the key it came from (for messages).
        experts_quant / draft_experts_quant: routed-expert format of the main / MTP layers
            (``mxfp4``, ``nvfp4``, the quant_method, or None), with ``*_source`` keys.
    """

    path: str
    architecture: Optional[str] = None
    hidden_size: Optional[int] = None
    max_position_embeddings: Optional[int] = None
    mtp_layers: int = 0
    dsa: bool = False
    quant_method: Optional[str] = None
    quant_source: str = ""
    experts_quant: Optional[str] = None
    experts_source: str = ""
    draft_experts_quant: Optional[str] = None
    draft_experts_source: str = ""


class ModelConfigError(Exception):
    """A checkpoint's config.json is missing or unreadable."""


_MODELOPT_ALGOS = {"FP8": "modelopt_fp8", "MXFP8": "mxfp8"}


def _modelopt_method(qc: dict) -> Optional[str]:
    algo = str(qc.get("quant_algo") or "").upper()
    if not algo:
        return None
    if algo == "MIXED_PRECISION":
        layers = qc.get("quantized_layers") or {}
        nvfp4 = any(str(v.get("quant_algo", "")).upper() in ("NVFP4", "W4A16_NVFP4")
                    for v in layers.values() if isinstance(v, dict))
        return "modelopt_mixed" if nvfp4 else "w4afp8"
    if "FP4" in algo:
        return "modelopt_fp4"
    return _MODELOPT_ALGOS.get(algo)


def read_model_info(path: str | os.PathLike) -> ModelInfo:
    """Read a checkpoint directory's config.json (and hf_quant_config.json when present).

    Raises:
        ModelConfigError: no such directory, no config.json, or invalid JSON.
    """
    d = Path(path)
    if not d.is_dir():
        raise ModelConfigError(f"{d} is not a local directory")
    cfg_file = d / "config.json"
    try:
        c = json.loads(cfg_file.read_text())
    except OSError as e:
        raise ModelConfigError(f"cannot read {cfg_file}: {e.strerror}") from None
    except ValueError as e:
        raise ModelConfigError(f"{cfg_file} is not valid JSON: {e}") from None
    if not isinstance(c, dict):
        raise ModelConfigError(f"{cfg_file} is not a JSON object")
    archs = c.get("architectures") or []
    arch = archs[0] if archs and isinstance(archs[0], str) else None
    info = ModelInfo(
        path=str(d), architecture=arch,
        hidden_size=c.get("hidden_size") if isinstance(c.get("hidden_size"), int) else None,
        max_position_embeddings=c.get("max_position_embeddings") if isinstance(c.get("max_position_embeddings"), int) else None,
        mtp_layers=int(c.get("num_nextn_predict_layers") or 0),
        dsa="index_topk" in c or bool(arch and arch.startswith(DSA_ARCH_PREFIXES)),
    )
    qc = c.get("quantization_config")
    qc = qc if isinstance(qc, dict) else None
    if qc is not None:
        qm = qc.get("quant_method")
        if qm and qm != "modelopt":
            info.quant_method, info.quant_source = str(qm), "config.json quantization_config.quant_method"
        else:
            info.quant_method = _modelopt_method(qc)
            info.quant_source = "config.json quantization_config.quant_algo"
    elif isinstance(c.get("compression_config"), dict):
        info.quant_method, info.quant_source = "compressed-tensors", "config.json compression_config"
    else:
        hq = d / "hf_quant_config.json"
        if hq.is_file():
            try:
                data = json.loads(hq.read_text())
                inner = data.get("quantization", data) if isinstance(data, dict) else {}
                info.quant_method = _modelopt_method(inner if isinstance(inner, dict) else {})
                info.quant_source = "hf_quant_config.json quantization.quant_algo"
            except (OSError, ValueError):
                pass
    # Routed-expert formats (main and MTP layers).
    q = qc or {}
    if q.get("routed_experts_quant_method") == "mxfp4":
        src = "config.json quantization_config.routed_experts_quant_method=mxfp4"
        info.experts_quant = info.draft_experts_quant = "mxfp4"
        info.experts_source = info.draft_experts_source = src
    elif str(q.get("quant_method") or "").lower() == "mxfp4":
        src = "config.json quantization_config.quant_method=mxfp4"
        info.experts_quant = info.draft_experts_quant = "mxfp4"
        info.experts_source = info.draft_experts_source = src
    elif (str(q.get("quant_algo") or "").upper() == "MIXED_PRECISION"
          and str(q.get("moe_quant_algo") or "").upper() == "NVFP4"):
        info.experts_quant, info.experts_source = "nvfp4", "config.json quantization_config.moe_quant_algo=NVFP4"
        info.draft_experts_quant = "mxfp4"
        info.draft_experts_source = ("config.json quantization_config.quant_algo=MIXED_PRECISION with moe_quant_algo=NVFP4; "
                                     "the MTP layer's mtp.* experts stay MXFP4")
    elif arch and arch.startswith(DSV4_ARCH_PREFIX) and "routed_experts_quant_method" not in q:
        dtype, where = routed_expert_dtype(d)
        base = f"architectures[0]={arch} without quantization_config.routed_experts_quant_method"
        if dtype == "F8_E4M3":
            info.experts_quant = info.draft_experts_quant = info.quant_method
            src = f"{base}; {where} is F8_E4M3 (FP8 experts)"
        else:
            info.experts_quant = info.draft_experts_quant = "mxfp4"
            src = (f"{base}; {where} is {dtype} (packed MXFP4)" if dtype in FP4_SAFETENSORS_DTYPES
                   else f"{base}; expert dtype not in a safetensors header here (SGLang default: MXFP4 experts)")
        info.experts_source = info.draft_experts_source = src
    else:
        info.experts_quant = info.draft_experts_quant = info.quant_method
        info.experts_source = info.draft_experts_source = info.quant_source
    return info


def routed_expert_dtype(d: Path) -> tuple[Optional[str], str]:
    """The safetensors dtype (``U8``, ``F8_E4M3``, ...) of one routed expert weight of checkpoint ``d``,
    read from a shard's JSON header only (the first ``<u64 little-endian length>`` + JSON bytes), the way
    SGLang decides ``is_fp4_experts`` for DeepSeek-V4. Returns (dtype or None, where it was read); None when
    there is no index/shard, no routed-expert key, or an unreadable header (never raises)."""
    try:
        index = d / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map") or {}
            key = next((k for k in weight_map if ROUTED_EXPERT_KEY.search(k)), None)
            if key is None:
                return None, ""
            shard = d / weight_map[key]
        else:
            shards = sorted(d.glob("*.safetensors"))
            if not shards:
                return None, ""
            shard, key = shards[0], None
        with open(shard, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n <= 1 << 28:
                return None, ""
            header = json.loads(f.read(n))
        if key is None:
            key = next((k for k in header if ROUTED_EXPERT_KEY.search(k)), None)
        meta = header.get(key) if key else None
        if isinstance(meta, dict) and isinstance(meta.get("dtype"), str):
            return meta["dtype"], f"{shard.name} {key}"
    except (OSError, ValueError, AttributeError, TypeError):
        pass
    return None, ""


# ---- GPU ---------------------------------------------------------------------------------------
def parse_arch(text: str) -> str:
    """Normalize a GPU architecture: ``sm_120``, ``sm120``, ``sm_120a``, ``12.0``, ``120`` -> ``sm_120``.

    Raises:
        ValueError: not an architecture.
    """
    t = text.strip().lower()
    m = re.fullmatch(r"(?:sm_?)?(\d{2,3})a?", t)
    if m:
        return f"sm_{int(m.group(1))}"
    m = re.fullmatch(r"(\d{1,2})\.(\d)", t)
    if m:
        return f"sm_{int(m.group(1)) * 10 + int(m.group(2))}"
    raise ValueError(f"not a GPU architecture: {text!r} (expected e.g. sm_90, sm_100, sm_120)")


def _from_nvidia_smi() -> Optional[GpuInfo]:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    caps = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    if out.returncode != 0 or not caps:
        return None
    try:
        archs = [parse_arch(c) for c in caps]
    except ValueError:
        return None
    return GpuInfo(arch=archs[0], count=len(caps), source="nvidia-smi" + (" (mixed GPUs: " + ", ".join(sorted(set(archs))) + ")" if len(set(archs)) > 1 else ""))


def _from_torch() -> Optional[GpuInfo]:
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return None
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        major, minor = torch.cuda.get_device_capability(0)
        return GpuInfo(arch=f"sm_{major * 10 + minor}", count=torch.cuda.device_count(), source="torch.cuda")
    except Exception:
        return None


def detect_gpu(assume: Optional[str] = None) -> GpuInfo:
    """The GPU architecture: ``assume`` (``--assume-gpu``) if given, else nvidia-smi, else
    torch.cuda; ``GpuInfo()`` (unknown) on a machine without GPUs.

    Raises:
        ValueError: ``assume`` is not an architecture.
    """
    if assume:
        return GpuInfo(arch=parse_arch(assume), count=None, source="--assume-gpu")
    return _from_nvidia_smi() or _from_torch() or GpuInfo()


# ---- context -----------------------------------------------------------------------------------
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


@dataclass
class Context:
    """Everything the checks look at; built once by :func:`build_context`.

    Attributes:
        model / draft: the target's and the separate draft's config.json (None: not read, see
            ``model_note`` / ``draft_note``).
        args: each role's SGLang argv parsed by the pinned parser (sglang engine; a role is
            missing when parsing failed, see ``arg_errors``).
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
        s, sp = self.cfg.sglang, self.cfg.sglang.speculative
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
        via = [r for r in roles if any(t == flag or t.startswith(flag + "=") for t in self.cfg.groups()[r].extra_args)]
        if via:
            return " and ".join(f"{r}.extra_args" for r in via) + f" ({flag})"
        return f"{name} ({flag})"

    def spec_roles(self) -> list[str]:
        """Roles that run speculative decoding."""
        return [r for r in ROLES if self.value(r, "speculative_algorithm")]


def _roles(roles) -> str:
    return "both roles" if set(roles) == set(ROLES) else " and ".join(roles)


def build_context(cfg: PDConfig, gpu: GpuInfo, check_ports: bool = True) -> Context:
    """Read the model configs and parse both roles' SGLang argv (sglang engine)."""
    ctx = Context(cfg=cfg, gpu=gpu, check_ports=check_ports)
    if cfg.engine != "sglang":
        return ctx
    if cfg.model_path.startswith("builtin:"):
        ctx.model_note = f"{cfg.model_path} is built in"
    else:
        try:
            ctx.model = read_model_info(cfg.model_path)
        except ModelConfigError as e:
            ctx.model_note = str(e)
    sp = cfg.sglang.speculative
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


# ---- checks ------------------------------------------------------------------------------------
def check_gpu_arch(ctx: Context) -> list[Finding]:
    """Report the GPU architecture the other checks assume (or that they are skipped)."""
    g = ctx.gpu
    if g.arch is None:
        if not ctx.sglang:
            return [Finding("ok", "gpu-arch", "the reference engine needs no GPU architecture")]
        return [Finding("ok", "gpu-arch", "skipped: no GPU detected (no nvidia-smi, no torch.cuda); architecture checks "
                        "are skipped — pass --assume-gpu sm_120 (or sm_90, sm_100) to check for that GPU")]
    count = f", {g.count} GPUs" if g.count is not None else ""
    return [Finding("ok", "gpu-arch", f"GPU {g.arch}{count} (from {g.source})")]


def check_model_config(ctx: Context) -> list[Finding]:
    """Read the target's (and a separate draft's) config.json; a missing one is a warning."""
    if not ctx.sglang:
        return _reference_model(ctx.cfg.model_path)
    out = []
    if ctx.model is None:
        if ctx.cfg.model_path.startswith("builtin:"):
            out.append(Finding("ok", "model-config", f"skipped: model_path {ctx.model_note}"))
        else:
            out.append(Finding("warning", "model-config", f"cannot check the checkpoint: model_path: {ctx.model_note}; "
                               "quantization, MTP and hidden-size checks are skipped",
                               "run doctor where the checkpoint is (each node needs it at model_path)"))
    else:
        m = ctx.model
        mtp = f", {m.mtp_layers} MTP layer(s) with {m.draft_experts_quant or 'unquantized'} experts" if m.mtp_layers else ", no MTP layers"
        out.append(Finding("ok", "model-config", f"{m.path}/config.json: {m.architecture or '?'}, quantization "
                           f"{m.quant_method or 'none'}, routed experts {m.experts_quant or 'unquantized'}{mtp}"))
    sp = ctx.cfg.sglang.speculative
    if sp is not None and sp.draft_model_path:
        if ctx.draft is None:
            out.append(Finding("warning", "model-config", f"cannot check the draft: sglang.speculative.draft_model_path: "
                               f"{ctx.draft_note}", "run doctor where the draft checkpoint is"))
        else:
            out.append(Finding("ok", "model-config", f"draft {ctx.draft.path}/config.json: {ctx.draft.architecture or '?'}, "
                               f"quantization {ctx.draft.quant_method or 'none'}, experts {ctx.draft.experts_quant or 'unquantized'}"))
    return out


def _reference_model(path: str) -> list[Finding]:
    """The reference engine's model_path: a known built-in, or a Hugging Face checkpoint directory
    (config.json inside; nothing is downloaded). Not a directory here is a warning: on a multi-node
    cluster only the engine nodes may hold it."""
    if path.startswith(BUILTIN_PREFIX):
        if path in BUILTIN_MODELS:
            return [Finding("ok", "model-config", f"model_path {path} is built in")]
        return [Finding("error", "model-config", f"model_path: unknown built-in model {path!r}",
                        f"use one of {', '.join(BUILTIN_MODELS)} or a local checkpoint directory")]
    if not os.path.isdir(path):
        return [Finding("warning", "model-config", f"model_path {path} is not a directory on this machine; every "
                        "node that runs an engine needs the checkpoint directory there (nothing is downloaded)",
                        "point model_path at a local Hugging Face checkpoint directory, or builtin:tiny")]
    if not os.path.isfile(os.path.join(path, "config.json")):
        return [Finding("error", "model-config", f"model_path {path} has no config.json: not a Hugging Face "
                        "checkpoint directory", "point model_path at the directory that holds config.json, "
                        "the tokenizer and the weights")]
    return [Finding("ok", "model-config", f"model_path {path}: a checkpoint directory")]


def _target_experts(ctx: Context) -> tuple[Optional[str], str, bool]:
    """(format, where it was read, guessed) of the target's routed experts."""
    if ctx.model is not None:
        return ctx.model.experts_quant, ctx.model.experts_source, False
    dsv4, guessed, src = ctx.dsv4()
    if dsv4:
        return "mxfp4", f"{src}; SGLang's default for DeepSeek-V4 is MXFP4 experts", guessed
    return None, "", False


def _draft_experts(ctx: Context) -> tuple[Optional[str], str, bool]:
    """(format, where it was read, guessed) of the draft's routed experts (a separate draft checkpoint,
    else the target's MTP layers)."""
    if ctx.draft is not None:
        return ctx.draft.experts_quant, ctx.draft.experts_source, False
    if ctx.model is not None:
        return (ctx.model.draft_experts_quant, ctx.model.draft_experts_source, False) if ctx.model.mtp_layers else (None, "", False)
    if not any(ctx.value(r, "speculative_draft_model_path") for r in ROLES):
        return _target_experts(ctx)
    return None, "", False


def _suggested_backend(experts: Optional[str], major: Optional[int]) -> Optional[str]:
    """The MoE backend doctor suggests for experts of this format on this GPU generation; None for
    MXFP4 experts on a GPU none of SGLang's MXFP4 methods runs on (then: dequantize, see _moe_fix)."""
    if experts == "mxfp4":
        return "flashinfer_mxfp4" if major is None or major in FP4_EXPERT_METHODS["flashinfer_mxfp4"] else None
    if experts in ("nvfp4", "modelopt_fp4"):
        return "flashinfer_cutlass"  # SGLang's NVFP4 MoE path off sm_100 (its trtllm-gen kernels are SM100-only)
    return TRITON_MOE_BACKEND


def _moe_fix(key: str, experts: Optional[str], gpu: GpuInfo) -> str:
    b = _suggested_backend(experts, gpu.major)
    on = gpu.arch or "any GPU"
    if b is None:
        return (f"set {key}: auto and {FP4_DEQUANT_ENV}: '1' in prefill.env and decode.env (no MXFP4 MoE kernel of the "
                f"pinned SGLang runs on {gpu.arch}; the experts are then dequantized to FP8 at load)")
    if experts == "mxfp4":
        how = {9: "FlashInfer CUTLASS", 10: "FlashInfer TRT-LLM", 12: "FlashInfer CUTLASS MXFP8 x MXFP4"}.get(gpu.major)
        return f"set {key}: {b} (MXFP4 experts" + (f" on {how} kernels for {on})" if how else " on sm_90/sm_100/sm_120)")
    if experts in ("nvfp4", "modelopt_fp4"):
        return (f"set {key}: {b} (SGLang's NVFP4 MoE off sm_100; its config check wants --quantization "
                "modelopt_fp4 or modelopt_mixed)")
    return f"set {key}: {b} (runs on {on})"


def resolve_target_moe(ctx: Context, role: str) -> tuple[str, str]:
    """The MoE backend SGLang runs the target's MoE layers on for ``role``: (backend, how; empty when the
    argv names it). ``auto`` stays ``auto`` except where SGLang's DeepSeek-V4 override decides it."""
    given = ctx.value(role, "moe_runner_backend") or "auto"
    if given != "auto" or not ctx.dsv4()[0]:
        return given, ""
    experts = _target_experts(ctx)[0]
    if experts == "nvfp4":
        return "flashinfer_trtllm_routed", "SGLang's DeepSeek-V4 override picks it for the FP8+NVFP4 hybrid checkpoint"
    if (experts == "mxfp4" and ctx.value(role, "moe_a2a_backend") in (None, "none")
            and not ctx.env_flag(role, FP4_DEQUANT_ENV)
            and (ctx.gpu.major is None or ctx.gpu.major in DSV4_AUTO_MXFP4_MAJORS)):
        return "flashinfer_mxfp4", "SGLang's DeepSeek-V4 override picks it for MXFP4 experts on sm_90/sm_100/sm_120"
    return "auto", ""


def resolve_draft_moe(ctx: Context, role: str) -> tuple[str, str]:
    """The MoE backend the draft is built and run under for ``role``: (backend, how; empty when
    ``--speculative-moe-runner-backend`` names it)."""
    given = ctx.value(role, "speculative_moe_runner_backend")
    if given is not None:
        return given, ""
    target, _ = resolve_target_moe(ctx, role)
    backend = {"flashinfer_megamoe": "flashinfer_trtllm"}.get(target, "auto" if target.startswith("lora_") else target)
    return backend, f"unset: the draft inherits the target's {target}" + (f" as {backend}" if backend != target else "")


def _shown(given: Optional[str], backend: str, how: str) -> str:
    if not how:
        return backend
    return how if given is None else f"{given} ({how}: {backend})"


def check_moe_backend_arch(ctx: Context) -> list[Finding]:
    """Refuse a target or draft MoE backend whose kernels do not exist for this GPU generation (e.g.
    FlashInfer TRT-LLM, sm_100-only, on sm_120), whether named or what SGLang resolves ``auto`` to."""
    if not ctx.sglang:
        return []
    if ctx.gpu.arch is None:
        return [Finding("ok", "moe-backend-arch", "skipped: GPU architecture unknown")]
    major, spec = ctx.gpu.major, ctx.spec_roles()
    dq, dsrc, _ = _draft_experts(ctx)
    tq = _target_experts(ctx)[0]
    groups: dict = {}
    for r in ROLES:
        groups.setdefault(("moe_runner_backend", ctx.value(r, "moe_runner_backend"), *resolve_target_moe(ctx, r)), []).append(r)
        if r in spec and ctx.value(r, "speculative_moe_runner_backend") is not None:  # unset: reported with the target
            groups.setdefault(("speculative_moe_runner_backend", ctx.value(r, "speculative_moe_runner_backend"), *resolve_draft_moe(ctx, r)), []).append(r)
    out = []
    for (attr, given, backend, how), rs in groups.items():
        need = ARCH_BOUND_MOE_BACKENDS.get(backend)
        if not need or major in need:
            continue
        gens = "/".join(f"sm_{n}x" for n in need)
        draft = attr == "speculative_moe_runner_backend"
        what = "the draft (MTP) MoE" if draft else "the target model's MoE"
        detail = f"; the draft's experts are MXFP4 ({dsrc})" if draft and dq == "mxfp4" else ""
        inherit = ""
        if not draft and any(ctx.value(r, "speculative_moe_runner_backend") is None for r in rs if r in spec):
            inherit = "; the draft inherits it because sglang.speculative.moe_runner_backend is unset"
        fix_key = "sglang.speculative.moe_runner_backend" if draft else "sglang.moe_runner_backend"
        out.append(Finding(
            "error", "moe-backend-arch",
            f"{ctx.where(attr, rs)} is {_shown(given, backend, how)} on {_roles(rs)}: "
            f"{what} would run kernels built only for {gens}, not {ctx.gpu.arch}{detail}{inherit} "
            "(startup dies with 'no kernel image is available')",
            _moe_fix(fix_key, dq if draft else tq, ctx.gpu)))
    if not out:
        out.append(Finding("ok", "moe-backend-arch", f"MoE backends run on {ctx.gpu.arch}"))
    return out


def _fp4_problem(backend: str, a2a: Optional[str], dequant: bool, major: Optional[int]) -> Optional[tuple[str, str]]:
    """Why MXFP4 experts under ``backend`` do not run: (level, reason), or None when they do."""
    if dequant:
        if backend == "auto":
            return None
        return "error", (f"with {FP4_DEQUANT_ENV}=1 the experts are dequantized to FP8, and SGLang asserts "
                         f"'{backend} is not compatible with {FP4_DEQUANT_ENV}=1' when it builds the layer")
    if backend == "auto" and a2a in DEEPGEMM_A2A_BACKENDS:
        return None  # Fp8MoEMethod's auto is DeepGEMM then, which reads FP4 experts
    methods = ", ".join(FP4_EXPERT_METHODS)
    if backend in FP4_TO_TRITON_BACKENDS:
        return "error", (f"under {backend} SGLang's Fp8Config.get_quant_method leaves them to Fp8MoEMethod, which runs "
                         "its Triton FP8 MoE kernel on the packed e2m1 weights: the first forward fails 'Hidden size "
                         f"mismatch' (MXFP4 MoE methods exist for {methods})")
    if backend in FP4_EXPERT_RUNNERS:
        return None
    if backend in FP4_EXPERT_METHODS:
        majors = FP4_EXPERT_METHODS[backend]
        if majors and major is not None and major not in majors:
            where = "/".join(f"sm_{m}x" for m in majors)
            tail = "; elsewhere it takes the TRT-LLM method, whose kernels are sm_100-only" if backend == "flashinfer_mxfp4" else ""
            return "error", f"{backend}'s MXFP4 MoE method runs on {where} only{tail}"
        return None
    return "warning", (f"{backend} is not one of SGLang's MXFP4 MoE backends ({methods}): the experts go to "
                       "Fp8MoEMethod's FP8 path for it, which is not known to read packed e2m1")


def _plugin_takes_draft_moe(ctx: Context, role: str) -> bool:
    """pdserve's plugin replaces the draft's MXFP4 MoE method on this GPU (sm_12x, or forced), whatever the
    runner flags say, unless the layer uses expert parallelism (it then keeps SGLang's method)."""
    k = ctx.cfg.sglang.pdserve_kernels
    ep = getattr(ctx.args.get(role), "ep_size", 1) or 1
    return k.enabled and k.mxfp4_moe and (ctx.gpu.major == 12 or k.force) and ep == 1


def check_fp4_experts(ctx: Context) -> list[Finding]:
    """MXFP4 routed experts (target, and the MTP draft's) need a backend that loads them on this GPU:
    refuse one that hands them to an FP8-only kernel (e.g. ``triton``), or one whose MXFP4 method does
    not exist for this GPU generation, or any backend but ``auto`` with SGLANG_DSV4_FP4_DEQUANT=1."""
    if not ctx.sglang:
        return []
    spec = ctx.spec_roles()
    dsv4 = ctx.dsv4()[0]
    groups: dict = {}
    for r in ROLES:
        dequant = ctx.env_flag(r, FP4_DEQUANT_ENV)
        a2a = ctx.value(r, "moe_a2a_backend")
        parts = [("moe_runner_backend", _target_experts(ctx), resolve_target_moe(ctx, r), a2a)]
        if r in spec:
            parts.append(("speculative_moe_runner_backend", _draft_experts(ctx), resolve_draft_moe(ctx, r),
                          ctx.value(r, "speculative_moe_a2a_backend") or a2a))
        for attr, (experts, src, guessed), (backend, how), a2a_used in parts:
            if experts != "mxfp4":
                continue
            if backend == "auto" and not dsv4 and not dequant and (attr == "moe_runner_backend" or how):
                continue  # the target's auto is another model's override to decide; not known here
            problem = _fp4_problem(backend, a2a_used, dequant, ctx.gpu.major)
            if problem is None:
                continue
            level, reason = problem
            need = ARCH_BOUND_MOE_BACKENDS.get(backend)
            if level == "warning" and need and ctx.gpu.major is not None and ctx.gpu.major not in need:
                continue  # refused by moe-backend-arch already
            plugin = (attr == "speculative_moe_runner_backend" and not dequant and _plugin_takes_draft_moe(ctx, r))
            key = (attr, ctx.value(r, attr), backend, how, level, reason, src, guessed, dequant, plugin)
            groups.setdefault(key, []).append(r)
    out = []
    for (attr, given, backend, how, level, reason, src, guessed, dequant, plugin), rs in groups.items():
        draft = attr == "speculative_moe_runner_backend"
        what = "the draft (MTP) MoE's" if draft else "the target model's"
        notes = ""
        if plugin:
            level = "warning"
            notes += ("; pdserve's plugin (sglang.pdserve_kernels mxfp4_moe) replaces the draft's MXFP4 MoE method "
                      f"on {ctx.gpu.arch or 'this GPU'}, so it runs, but not without the plugin")
        if guessed and level == "error":
            level = "warning"
            notes += "; the checkpoint's config.json was not read here, so this is a guess"
        fix_key = "sglang.speculative.moe_runner_backend" if draft else "sglang.moe_runner_backend"
        if dequant:
            envs = " and ".join(f"{r}.env" for r in rs)
            fix = f"set {fix_key}: auto ({FP4_DEQUANT_ENV}=1 requires it), or drop {FP4_DEQUANT_ENV} from {envs}"
        else:
            fix = _moe_fix(fix_key, "mxfp4", ctx.gpu)
        out.append(Finding(level, "moe-fp4-experts",
                           f"{ctx.where(attr, rs)} is {_shown(given, backend, how)} on {_roles(rs)}: {what} routed "
                           f"experts are MXFP4 ({src}); {reason}{notes}", fix))
    if not out:
        tq, dq = _target_experts(ctx)[0], _draft_experts(ctx)[0] if spec else None
        if "mxfp4" not in (tq, dq):
            out.append(Finding("ok", "moe-fp4-experts", "no MXFP4 routed experts" if ctx.model is not None or ctx.dsv4()[0]
                               else "skipped: the checkpoint's config.json was not read"))
        else:
            guess = " (DeepSeek-V4 guessed from model_path)" if ctx.model is None else ""
            out.append(Finding("ok", "moe-fp4-experts", "MXFP4 routed experts: the MoE backends in use load them"
                               + (f" on {ctx.gpu.arch}" if ctx.gpu.arch else "") + guess))
    return out


def check_spec_moe_explicit(ctx: Context) -> list[Finding]:
    """Speculative decoding must name the draft's MoE backend: auto-selection once picked an
    sm_100-only kernel for the MXFP4 draft (an error on sm_120, a warning elsewhere)."""
    if not ctx.sglang:
        return []
    spec = ctx.spec_roles()
    if not spec:
        return [Finding("ok", "spec-moe-backend", "no speculative decoding")]
    unset = [r for r in spec if ctx.value(r, "speculative_moe_runner_backend") in (None, "auto")]
    if not unset:
        return [Finding("ok", "spec-moe-backend", "sglang.speculative.moe_runner_backend is explicit")]
    dq, dsrc, _ = _draft_experts(ctx)
    level = "error" if ctx.gpu.major == 12 else "warning"
    experts = f" The draft's experts are MXFP4 ({dsrc})." if dq == "mxfp4" else ""
    on = f" on {ctx.gpu.arch}" if ctx.gpu.arch else ""
    return [Finding(level, "spec-moe-backend",
                    f"{ctx.where('speculative_moe_runner_backend', unset)} is "
                    f"{ctx.value(unset[0], 'speculative_moe_runner_backend') or 'unset'} on {_roles(unset)}: the draft MoE's "
                    f"kernel is chosen automatically{on}, which once picked an sm_100-only FlashInfer TRT-LLM kernel.{experts}",
                    _moe_fix("sglang.speculative.moe_runner_backend", dq, ctx.gpu))]


def check_page_size(ctx: Context) -> list[Finding]:
    """DeepSeek-V4 runs 256-token KV pages on CUDA whatever ``page_size`` says: SGLang's model override
    replaces the value (only an info log says so) and the dsv4 attention asserts 256. Warn when the config
    asks for another size (it would not be the size that runs)."""
    if not ctx.sglang:
        return []
    dsv4, guessed, src = ctx.dsv4()
    if not dsv4:
        return [Finding("ok", "page-size", "no model-imposed page size known" if ctx.model is not None or not src
                        else "skipped: the checkpoint's config.json was not read")]
    out = []
    for ps, rs in ctx.by_value("page_size").items():
        if ps != DSV4_PAGE_SIZE:
            out.append(Finding("warning", "page-size",
                               f"{ctx.where('page_size', rs)} is {ps} on {_roles(rs)}, but DeepSeek-V4 ({src}) runs "
                               f"{DSV4_PAGE_SIZE}-token KV pages on CUDA: SGLang's model override replaces --page-size "
                               f"with {DSV4_PAGE_SIZE} (its dsv4 attention asserts {DSV4_PAGE_SIZE}), so the workers "
                               f"run {DSV4_PAGE_SIZE}, not {ps}", f"set page_size: {DSV4_PAGE_SIZE}"))
    return out or [Finding("ok", "page-size", f"page_size {DSV4_PAGE_SIZE}, what DeepSeek-V4 runs")]


def check_quantization(ctx: Context) -> list[Finding]:
    """Refuse ``--quantization`` left to auto-detection; warn when it differs from the checkpoint's."""
    if not ctx.sglang:
        return []
    m = ctx.model
    out = []
    for q, rs in ctx.by_value("quantization").items():
        if q is None:
            if m is not None and m.quant_method:
                fix = f"set sglang.quantization: {m.quant_method} (the checkpoint's {m.quant_source})"
            elif m is not None:
                fix = "set sglang.quantization: unquant (the checkpoint declares no quantization; unquant is SGLang's explicit 'none')"
            else:
                fix = "set sglang.quantization to the checkpoint's config.json quantization_config.quant_method (e.g. fp8)"
            out.append(Finding("error", "quantization",
                               f"{ctx.where('quantization', rs)} is unset on {_roles(rs)}: SGLang auto-detects it, and an "
                               f"auto-detected format leaves the draft's quantization unset too, which skips the guards that route "
                               f"the draft MoE to a safe backend", fix))
        elif m is not None and m.quant_method and q not in (m.quant_method, "unquant"):
            out.append(Finding("warning", "quantization",
                               f"{ctx.where('quantization', rs)} is {q} but the checkpoint says {m.quant_method} ({m.quant_source})",
                               f"set sglang.quantization: {m.quant_method} unless you mean to re-quantize"))
    if not out:
        out.append(Finding("ok", "quantization", f"sglang.quantization is {ctx.value('prefill', 'quantization')}"))
    return out


def check_speculative_draft(ctx: Context) -> list[Finding]:
    """Speculative decoding needs a draft (MTP layers or a draft dir) whose hidden size matches the
    target's; DeepSeek-V4 EAGLE needs eagle_topk 1."""
    if not ctx.sglang or not ctx.spec_roles():
        return []
    out = []
    m, d, sp = ctx.model, ctx.draft, ctx.cfg.sglang.speculative
    has_draft_path = any(ctx.value(r, "speculative_draft_model_path") for r in ROLES)
    if m is not None and not m.mtp_layers and not has_draft_path:
        out.append(Finding("error", "draft",
                           f"sglang.speculative is set but the checkpoint has no MTP layers (config.json num_nextn_predict_layers "
                           f"is {m.mtp_layers}) and sglang.speculative.draft_model_path is unset: there is no draft model",
                           "set sglang.speculative.draft_model_path to a draft checkpoint, or remove sglang.speculative"))
    if m is not None and d is not None and m.hidden_size and d.hidden_size and m.hidden_size != d.hidden_size:
        out.append(Finding("error", "draft",
                           f"sglang.speculative.draft_model_path: the draft's hidden_size {d.hidden_size} ({d.path}/config.json) "
                           f"differs from the target's {m.hidden_size} ({m.path}/config.json); EAGLE feeds the target's hidden "
                           "states to the draft (and PD ships them with the KV)",
                           "use the draft trained for this target (same hidden_size)"))
    if m is not None and (m.architecture or "").startswith("DeepseekV4"):
        for topk, rs in ctx.by_value("speculative_eagle_topk", ctx.spec_roles()).items():
            if topk not in (None, 1) and ctx.value(rs[0], "speculative_algorithm") in ("EAGLE", "NEXTN"):
                out.append(Finding("error", "draft", f"{ctx.where('speculative_eagle_topk', rs)} is {topk}: the pinned SGLang "
                                   f"supports only eagle_topk 1 for {m.architecture}", "set sglang.speculative.eagle_topk: 1"))
    if not out:
        if m is None:
            out.append(Finding("ok", "draft", "skipped: the checkpoint's config.json was not read"))
        elif d is None and sp is not None and sp.draft_model_path:
            out.append(Finding("ok", "draft", "draft hidden size not checked: the draft's config.json was not read"))
        else:
            src = f"draft {d.path}" if d is not None else f"{m.mtp_layers} built-in MTP layer(s)"
            out.append(Finding("ok", "draft", f"draft: {src}"))
    return out


# Settings prefill and decode must agree on (KV moves page by page between identically laid-out
# pools; EAGLE's hidden states and top-k tokens travel with the KV).
MUST_MATCH = ("model_path", "page_size", "kv_cache_dtype", "speculative_algorithm", "speculative_eagle_topk",
              "speculative_draft_model_path")


def check_pd_consistency(ctx: Context) -> list[Finding]:
    """Page size, model, KV dtype and the speculative shape must be equal on prefill and decode
    (only a group's extra_args can make them differ); TP may differ."""
    if not ctx.sglang:
        return []
    if set(ctx.args) != set(ROLES):
        return [Finding("ok", "pd-consistency", "skipped: not every role's argv parsed (see engine-args)")]
    out = []
    for attr in MUST_MATCH:
        p, d = ctx.value("prefill", attr), ctx.value("decode", attr)
        if p != d:
            name, flag = FIELDS[attr]
            out.append(Finding("error", "pd-consistency",
                               f"{flag} differs: prefill {p!r}, decode {d!r} (set via {ctx.where(attr, ROLES)}); KV caches "
                               "and draft state moved from prefill to decode must have the same layout",
                               f"set {name} once in the config and drop {flag} from prefill.extra_args/decode.extra_args"))
    tp = (ctx.args["prefill"].tp_size, ctx.args["decode"].tp_size)
    if not out:
        note = f"; TP differs (prefill {tp[0]}, decode {tp[1]}): allowed" if tp[0] != tp[1] else ""
        out.append(Finding("ok", "pd-consistency", "page size, model, KV dtype and speculative settings match" + note))
    return out


def check_gpus(ctx: Context) -> list[Finding]:
    """Explicit GPU ids must exist on the node; warn when the cluster claims more GPUs than one
    node has."""
    cfg, out = ctx.cfg, []
    n = ctx.gpu.count
    for role, g in cfg.groups().items():
        for i, ids in enumerate(g.gpus or []):
            beyond_node = [x for x in ids if x >= cfg.cluster.gpus_per_node]
            if beyond_node:
                out.append(Finding("error", "gpus", f"{role}.gpus[{i}]: GPU ids {beyond_node} are not below cluster.gpus_per_node="
                                   f"{cfg.cluster.gpus_per_node}; the ids index the GPUs of the worker's node (CUDA_VISIBLE_DEVICES)",
                                   f"use ids 0..{cfg.cluster.gpus_per_node - 1} (placement picks the node)"))
            elif n is not None and any(x >= n for x in ids):
                out.append(Finding("error", "gpus", f"{role}.gpus[{i}]: GPU ids {[x for x in ids if x >= n]} do not exist: "
                                   f"this node has {n} GPUs ({ctx.gpu.source})",
                                   f"use ids 0..{n - 1}, or let Ray place the workers ({role}.gpus: null)"))
    per_node = min(cfg.cluster.num_gpus, cfg.cluster.gpus_per_node)
    if n is not None and per_node > n:
        out.append(Finding("warning", "gpus", f"cluster.num_gpus={cfg.cluster.num_gpus} (gpus_per_node={cfg.cluster.gpus_per_node}) "
                           f"but this node has {n} GPUs ({ctx.gpu.source})",
                           f"set cluster.gpus_per_node: {n} (and cluster.num_gpus to the cluster's total)"))
    if not out:
        out.append(Finding("ok", "gpus", "GPU ids exist and do not overlap" if n is not None
                           else "GPU ids do not overlap (GPU count not detected)"))
    return out


def check_router_port(ctx: Context) -> list[Finding]:
    """The router's host:port must be bindable on this machine (the launcher runs the router here)."""
    if not ctx.check_ports:
        return []
    r = ctx.cfg.router
    try:
        infos = socket.getaddrinfo(r.host, r.port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        return [Finding("error", "router-port", f"router.host {r.host!r} does not resolve: {e}", "set router.host to an address of this machine")]
    family, _, _, _, addr = infos[0]
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the router's server does
        s.bind(addr)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            return [Finding("error", "router-port", f"router.port {r.port} on {r.host} is already in use",
                            f"stop what listens there (ss -ltnp 'sport = :{r.port}') or set router.port to a free port")]
        if e.errno == errno.EADDRNOTAVAIL:
            return [Finding("error", "router-port", f"router.host {r.host} is not an address of this machine",
                            "set router.host to 0.0.0.0, 127.0.0.1 or this machine's address")]
        return [Finding("error", "router-port", f"cannot bind router {r.host}:{r.port}: {e.strerror}",
                        "set router.port to a free port above 1023")]
    finally:
        s.close()
    return [Finding("ok", "router-port", f"router {r.host}:{r.port} is free")]


def check_engine_args(ctx: Context) -> list[Finding]:
    """Every flag of both roles' argv (extra_args included) parses with the pinned SGLang parser."""
    if not ctx.sglang:
        return []
    out = []
    for role, (level, msg) in ctx.arg_errors.items():
        if level == "error":
            flag = re.search(r"(--[\w-]+)", msg)
            src = f"{role}.extra_args" if flag and any(t.split("=")[0] == flag.group(1)
                                                        for t in ctx.cfg.groups()[role].extra_args) else "the sglang settings"
            out.append(Finding("error", "engine-args", f"{role}: {src}: {msg}", "use a flag the pinned SGLang accepts (see the candidates)"))
        else:
            out.append(Finding("warning", "engine-args", f"{role}: cannot check the SGLang flags: {msg}", "install the pinned sglang (see the message)"))
    if not out:
        out.append(Finding("ok", "engine-args", "both roles' SGLang argv parse with the pinned parser"))
    return out


def check_context_length(ctx: Context) -> list[Finding]:
    """Warn when --context-length is far above need while the stock DSA indexer runs (its per-step
    work scales with --context-length, not with the real sequence)."""
    if not ctx.sglang:
        return []
    m = ctx.model
    if m is not None and not m.dsa:
        return [Finding("ok", "context-length", "the model has no DSA indexer")]
    if ctx.cfg.sglang.pdserve_kernels.enabled and ctx.cfg.sglang.pdserve_kernels.indexer:
        return [Finding("ok", "context-length", "sglang.pdserve_kernels: the pdserve indexer's cost follows the real sequence")]
    out = []
    for cl, rs in ctx.by_value("context_length").items():
        if cl is None:
            mx = m.max_position_embeddings if m is not None else None
            eff = f"the model's maximum ({mx} from config.json max_position_embeddings)" if mx else "the model's maximum"
            if mx is not None and mx <= CONTEXT_LENGTH_LIMIT:
                continue
            what = f"{ctx.where('context_length', rs)} is unset on {_roles(rs)}, so SGLang uses {eff}"
        elif cl > CONTEXT_LENGTH_LIMIT:
            what = f"{ctx.where('context_length', rs)} is {cl} on {_roles(rs)}"
        else:
            continue
        out.append(Finding("warning", "context-length",
                           f"{what}: the stock DSA indexer scores every key slot up to --context-length on each step "
                           f"(measured on H200: about 10x slower at 128K than at 8K for the same work)",
                           f"cap sglang.context_length near the longest request you serve (e.g. {CONTEXT_LENGTH_LIMIT}), "
                           "or set sglang.pdserve_kernels: true"))
    return out or [Finding("ok", "context-length", f"context length <= {CONTEXT_LENGTH_LIMIT}")]


def check_pdserve_plugin(ctx: Context) -> list[Finding]:
    """With ``sglang.pdserve_kernels`` on, this Python must expose pdserve's SGLang plugin: SGLang finds
    plugins only through installed package metadata, and without it the workers start, silently, without
    our kernels."""
    if not ctx.sglang or not ctx.cfg.sglang.pdserve_kernels.enabled:
        return []
    from importlib.metadata import entry_points

    from pd.kernels.sglang_plugin import ENTRY_POINT_GROUP, PLUGIN_NAME

    want = "pd.kernels.sglang_plugin:register"
    if any(e.name == PLUGIN_NAME and e.value == want for e in entry_points(group=ENTRY_POINT_GROUP)):
        return [Finding("ok", "pdserve-plugin", f"SGLang workers load pdserve's plugin ({want})")]
    level = "warning" if ctx.cfg.sglang.launch_command else "error"  # a wrapper may run another Python
    return [Finding(level, "pdserve-plugin",
                    f"sglang.pdserve_kernels is on, but {sys.executable} has no '{PLUGIN_NAME}' entry point in "
                    f"{ENTRY_POINT_GROUP}: SGLang workers would run without pdserve's kernels",
                    "pip install -e . (this checkout) in the Python that runs the workers; a stale "
                    "pdserve.egg-info in the working directory also hides the installed metadata: delete it")]


def ib_devices() -> Optional[list[str]]:
    """RDMA devices listed in /sys/class/infiniband, None when the directory does not exist."""
    try:
        return sorted(os.listdir(IB_SYSFS))
    except OSError:
        return None


def check_kv_transfer(ctx: Context) -> list[Finding]:
    """KV over TCP is a warning (SGLang engine); an ib_device this machine does not have is an error."""
    t = ctx.cfg.transfer
    have = ib_devices()
    if t.protocol == "rdma":
        want = [x.strip() for x in (t.ib_device or "").split(",") if x.strip()]
        missing = [x for x in want if not have or x not in have]
        if missing:
            listed = f"it lists {', '.join(have)}" if have else f"{IB_SYSFS} lists none"
            return [Finding("error", "kv-transfer", f"transfer.ib_device {', '.join(missing)} is not an RDMA device of this "
                            f"machine ({listed})",
                            "set transfer.ib_device to one of " + ", ".join(have) if have
                            else "set transfer.protocol: tcp (or install the RDMA driver)")]
        return [Finding("ok", "kv-transfer", f"KV over RDMA ({t.ib_device})")]
    if not ctx.sglang:
        return [Finding("ok", "kv-transfer", "KV over TCP (reference engine)")]
    ignored = f"; transfer.ib_device {t.ib_device} is ignored (MC_FORCE_TCP=1)" if t.ib_device else ""
    fix = (f"set transfer.protocol: rdma and transfer.ib_device: {have[0]} (this machine has {', '.join(have)})" if have
           else "with an RDMA NIC: set transfer.protocol: rdma and transfer.ib_device (e.g. mlx5_0)")
    return [Finding("warning", "kv-transfer", f"transfer.protocol is tcp: KV caches move over TCP (Mooncake, MC_FORCE_TCP=1), "
                    f"slower than RDMA; long prompts pay for it in time to first token{ignored}", fix)]


CHECKS: list[Callable[[Context], list[Finding]]] = [
    check_gpu_arch, check_model_config, check_engine_args, check_quantization, check_moe_backend_arch,
    check_fp4_experts, check_spec_moe_explicit, check_speculative_draft, check_page_size, check_pd_consistency,
    check_gpus, check_router_port,
    check_context_length, check_pdserve_plugin, check_kv_transfer,
]


def run_checks(cfg: PDConfig, gpu: GpuInfo, check_ports: bool = True) -> list[Finding]:
    """Every check on a validated config, in order."""
    ctx = build_context(cfg, gpu, check_ports=check_ports)
    return [f for check in CHECKS for f in check(ctx)]


def exit_code(findings: list[Finding]) -> int:
    """1 when any finding is an error, else 0."""
    return 1 if any(f.level == "error" for f in findings) else 0


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


_TAGS = {"error": "ERROR", "warning": "WARN ", "ok": "ok   "}


def render(findings: list[Finding], verbose: bool = True) -> str:
    """Human-readable findings, one block each (``verbose=False``: errors and warnings only)."""
    lines = []
    for f in findings:
        if f.level == "ok" and not verbose:
            continue
        lines.append(f"{_TAGS[f.level]} [{f.check}] {f.message}")
        if f.fix:
            lines.append(f"      fix: {f.fix}")
    n_err = sum(f.level == "error" for f in findings)
    n_warn = sum(f.level == "warning" for f in findings)
    lines.append(f"{n_err} error(s), {n_warn} warning(s)")
    return "\n".join(lines)


def preflight(cfg: PDConfig, out=None) -> bool:
    """What ``pd.cluster.launch`` runs before starting: detect the GPU, run every check, print warnings and
    errors (to ``out``, default stderr). Returns False when an error must stop the launch."""
    out = out or sys.stderr
    gpu = detect_gpu() if cfg.engine == "sglang" else GpuInfo()
    findings = run_checks(cfg, gpu)
    if any(f.level != "ok" for f in findings):
        print("pdserve doctor:\n" + render(findings, verbose=False), file=out, flush=True)
    return exit_code(findings) == 0


def main(argv: Optional[list[str]] = None) -> int:
    """``pdserve doctor``: returns the exit code (0 ok, 1 errors, 2 invalid config)."""
    p = argparse.ArgumentParser(prog="pdserve doctor", description="Preflight checks of a deployment; non-zero exit on errors.")
    p.add_argument("config", nargs="?", help="cluster config YAML (default: deploy/local.yaml)")
    p.add_argument("--assume-gpu", metavar="ARCH", help="check for this GPU architecture (sm_90, sm_100, sm_120, ...) "
                   "instead of the one on this machine")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    args = p.parse_args(argv)
    if args.assume_gpu:
        try:
            parse_arch(args.assume_gpu)
        except ValueError as e:
            p.error(str(e))
    findings, code, gpu = doctor(args.config, args.assume_gpu)
    if args.json:
        print(json.dumps({"config": args.config, "gpu": asdict(gpu), "exit_code": code,
                          "findings": [asdict(f) for f in findings]}, indent=2))
    else:
        print(f"pdserve doctor: {args.config or 'deploy/local.yaml (default)'}")
        print(render(findings))
    return code


if __name__ == "__main__":
    sys.exit(main())
