"""What the checks read from a checkpoint directory: :func:`read_model_info` -> :class:`ModelInfo`.

config.json keys read (the model directory's, and the draft directory's when
``sglang.speculative.draft_model_path`` is set):

- ``architectures[0]``, ``model_type`` (``deepseek_v41``: DeepSeek-V4.1, which SGLang tells apart from V4
  by it alone), ``hidden_size``, ``max_position_embeddings``, ``num_nextn_predict_layers``
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
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

DSA_ARCH_PREFIXES = ("DeepseekV4", "DeepseekV32")
DSV4_ARCH_PREFIX = "DeepseekV4"
# a routed expert's weight in a DeepSeek checkpoint (the key SGLang probes for the expert dtype)
ROUTED_EXPERT_KEY = re.compile(r"\.experts\.\d+\.(?:w[123]|down_proj|up_proj|gate_proj)\.weight$")
FP4_SAFETENSORS_DTYPES = ("U8", "I8", "F4")  # packed e2m1 pairs


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
    model_type: Optional[str] = None
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
        model_type=c.get("model_type") if isinstance(c.get("model_type"), str) else None,
        hidden_size=c.get("hidden_size") if isinstance(c.get("hidden_size"), int) else None,
        max_position_embeddings=(c.get("max_position_embeddings")
                                 if isinstance(c.get("max_position_embeddings"), int) else None),
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
        info.draft_experts_source = ("config.json quantization_config.quant_algo=MIXED_PRECISION with "
                                     "moe_quant_algo=NVFP4; "
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
