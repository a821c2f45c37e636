"""The embedded default model ``builtin:tiny``: a seeded small Llama with a byte-level tokenizer.

Written once to a cache directory as an ordinary Hugging Face checkpoint (config.json,
model.safetensors, tokenizer files with a chat template) and then loaded like any local
checkpoint, so the engine has exactly one loading path. Fully offline and deterministic: the
weights come from ``torch.manual_seed(SEED)``; the tokenizer is transformers' ByT5 tokenizer
(UTF-8 bytes + 3 specials + 125 extra ids = 384 tokens), which needs no vocabulary file.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

BUILTIN_PREFIX = "builtin:"
BUILTIN_MODELS = (BUILTIN_PREFIX + "tiny",)  # the --model-path values written here on first use
SEED = 0
# A chat template in the ChatML style; the tokenizer has no BOS, so none is added.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
}


def cache_dir() -> Path:
    """Where built-in checkpoints are written: ``$PDSERVE_CACHE`` or ``~/.cache/pdserve``."""
    root = os.environ.get("PDSERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "pdserve")
    return Path(root)


def resolve_model_path(model_path: str) -> str:
    """Map ``builtin:NAME`` to a local checkpoint directory (writing it on first use).

    Any other value is returned unchanged (a local Hugging Face checkpoint directory).

    Raises:
        ValueError: an unknown built-in name.
    """
    if not model_path.startswith(BUILTIN_PREFIX):
        return model_path
    if model_path not in BUILTIN_MODELS:
        raise ValueError(f"--model-path: unknown built-in model {model_path!r}; known: {', '.join(BUILTIN_MODELS)}")
    target = cache_dir() / f"tiny-seed{SEED}"
    if not (target / "model.safetensors").exists():
        write_tiny(target)
    return str(target)


def write_tiny(target: Path) -> None:
    """Write the builtin:tiny checkpoint to ``target`` atomically (temp dir, then rename)."""
    import torch
    from transformers import ByT5Tokenizer, LlamaConfig, LlamaForCausalLM

    target.parent.mkdir(parents=True, exist_ok=True)
    tokenizer = ByT5Tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
        **TINY,
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config)
    # Larger-than-default weights give peaked, varied logits instead of near-uniform ones.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
    tmp = tempfile.mkdtemp(dir=target.parent, prefix=".tiny-")
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        os.rename(tmp, target)
    except OSError:
        if not (target / "model.safetensors").exists():
            raise
        # A concurrent writer won; its checkpoint is identical (same seed).
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
