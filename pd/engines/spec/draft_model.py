"""The MTP/EAGLE draft model of the reference engine: one DeepSeek-style MTP layer over the target's
hidden states, sharing the target's embedding and LM head (math: ``pd.engines.spec.mtp_layer``).

A draft checkpoint is a directory with config.json (``pd.engines.models.builtin_draft.draft_config``) and
model.safetensors holding ``model.enorm``, ``model.hnorm``, ``model.eh_proj``, ``model.decoder.*`` (one
decoder layer; routed experts as MXFP4 bytes) and ``model.shared_head.norm``, the names of SGLang's
NextN checkpoints (``srt/models/deepseek_nextn.py``). Like the target, it runs one sequence at a time
with its own KV cache (a transformers DynamicCache of one layer).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pd.engines.models.builtin_model import BUILTIN_MODELS
from pd.engines.models.model_runner import DTYPES, KVLayout, export_cache_kv, import_cache_kv
from pd.engines.spec.mtp_layer import EXPERT_TENSORS, layer_forward, prepare_experts

if TYPE_CHECKING:
    from pd.engines.models.model_runner import ModelRunner

DRAFT_FLAG = "--speculative-draft-model-path"


def resolve_draft_path(model_path: str, draft_path: str | None) -> str:
    """The draft checkpoint directory for target ``model_path``.

    ``draft_path`` given: returned as is. None with a built-in target (``builtin:tiny``, ``builtin:deep``): its
    built-in draft's directory (fitted to it and written on first use beside the target under
    ``builtin_model.cache_dir()``, atomically; about 1 s on 2 CPU cores for builtin:tiny, see
    ``pd.engines.models.builtin_draft``).

    Raises:
        ValueError: None for any other model (it has no built-in draft), naming the flag.
    """
    if draft_path is not None:
        return draft_path
    if model_path in BUILTIN_MODELS:
        from pd.engines.models.builtin_draft import ensure_builtin_draft

        return str(ensure_builtin_draft(model_path))
    raise ValueError(f"{DRAFT_FLAG}: required for --model-path {model_path!r} (only {', '.join(BUILTIN_MODELS)} "
                     f"have a built-in draft)")


def crop_cache(cache, num_tokens: int) -> None:
    """Keep the first ``num_tokens`` tokens of a transformers cache (transformers 5 ``crop`` takes the number
    of tokens to remove as a negative count; a positive count is refused)."""
    extra = cache.get_seq_length() - num_tokens
    if extra < 0:
        raise ValueError(f"num_tokens: {num_tokens} exceeds the cache's {cache.get_seq_length()} tokens")
    if extra:
        cache.crop(-extra)


class DraftModel:
    """A loaded MTP draft bound to its target.

    Args:
        path: the draft checkpoint directory (:func:`resolve_draft_path`).
        target: the target's ModelRunner; its embedding and LM head are used, not copied.
        dtype: the draft's KV cache dtype (``float32``, ``bfloat16``, ``float16``); activations are fp32.

    Raises:
        ValueError: naming ``--speculative-draft-model-path`` when the draft's hidden_size or vocab_size
            differs from the target's, or the checkpoint lacks a tensor; naming ``--dtype`` for a bad dtype.
        OSError: an unreadable checkpoint directory.
    """

    def __init__(self, path: str, target: "ModelRunner", dtype: str = "float32"):
        from safetensors.torch import load_file

        if dtype not in DTYPES:
            raise ValueError(f"--dtype: {dtype!r} is not one of {sorted(DTYPES)}")
        self.path = path
        cfg = json.loads((Path(path) / "config.json").read_text())
        for key in ("hidden_size", "vocab_size"):
            want = int(getattr(target.config, key))
            if int(cfg.get(key, -1)) != want:
                raise ValueError(f"{DRAFT_FLAG}: the draft at {path} has {key} {cfg.get(key)}, the target "
                                 f"{target.model_path} has {want}")
        self.config = cfg
        self.hidden_size = int(cfg["hidden_size"])
        self.vocab_size = int(cfg["vocab_size"])
        self.layout = KVLayout(num_layers=1, num_kv_heads=int(cfg["num_key_value_heads"]),
                               head_dim=int(cfg["head_dim"]), dtype=dtype)
        device = target.model.device
        raw = load_file(str(Path(path) / "model.safetensors"), device=str(device))
        self.weights = {k.removeprefix("model."): v if v.dtype == torch.uint8 else v.float() for k, v in raw.items()}
        missing = [n for n in self.required_tensors() if n not in self.weights]
        if missing:
            raise ValueError(f"{DRAFT_FLAG}: the draft at {path} lacks {', '.join('model.' + n for n in missing)}")
        self.embed = target.model.get_input_embeddings()
        self.lm_head = target.model.lm_head
        experts = {k: self.weights[f"decoder.mlp.experts.{n}"] for k, n in EXPERT_TENSORS.items()}
        # the kernel's zero-padded experts on a GPU, the dequantized ones on CPU: made once, not per call
        self._experts = prepare_experts(experts)

    @staticmethod
    def required_tensors() -> list[str]:
        """The tensor names (without ``model.``) a draft checkpoint must hold."""
        names = ["enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                 "decoder.input_layernorm.weight", "decoder.post_attention_layernorm.weight", "decoder.mlp.gate.weight"]
        names += [f"decoder.self_attn.{p}_proj.weight" for p in "qkvo"]
        return names + [f"decoder.mlp.experts.{n}" for n in EXPERT_TENSORS.values()]

    def new_cache(self):
        """An empty transformers DynamicCache for the draft's one layer."""
        from transformers import DynamicCache

        return DynamicCache()

    @torch.inference_mode()
    def forward(self, token_ids: list[int], hidden: torch.Tensor, cache) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft positions ``cache.get_seq_length() ..`` for pairs (token_ids[j], hidden[j]).

        Args:
            token_ids: x_{i+1} of each new position (len T).
            hidden: [T, H] float32, h_i of each position: the target's ``forward_hidden`` output, or this
                model's own ``hidden_out`` when chaining (step k+1 reads (d_{k+1}, g_k)).
        Returns:
            (logits [T, vocab] float32 through the target's LM head, hidden_out [T, H] float32); the cache
            grows by T.
        """
        if hidden.shape != (len(token_ids), self.hidden_size):
            raise ValueError(f"hidden: expected shape {(len(token_ids), self.hidden_size)}, got {tuple(hidden.shape)}")
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.embed.weight.device)
        embeds = self.embed(ids).float()
        _, hidden_out = layer_forward(self.weights, self.config, embeds, hidden.float().to(embeds.device), cache,
                                      self._experts, self.layout.torch_dtype)
        logits = self.lm_head(hidden_out.to(self.lm_head.weight.dtype)).float()
        return logits, hidden_out

    # ---- KV <-> pages (same contract as ModelRunner.export_kv / import_kv) ----------------
    def export_kv(self, cache, pool_pages: torch.Tensor, page_ids: list[int], num_tokens: int) -> None:
        """Copy the first ``num_tokens`` tokens of ``cache`` into pool pages of :attr:`layout`
        (``pool_pages`` [num_pages, 1, 2, page_size, kv_heads, head_dim])."""
        export_cache_kv(self.layout, cache, pool_pages, page_ids, num_tokens)

    def import_kv(self, pool_pages: torch.Tensor, page_ids: list[int], num_tokens: int):
        """A fresh cache holding ``num_tokens`` tokens read from pool pages (inverse of :meth:`export_kv`)."""
        return import_cache_kv(self.layout, self.new_cache(), pool_pages, page_ids, num_tokens)
