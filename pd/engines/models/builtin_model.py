"""The embedded default model ``builtin:tiny``: a seeded small Llama with a byte-level tokenizer; and
``builtin:deep``, the speculative-decoding benchmark's target: the same recipe with 22 layers instead of 2.

Written once to a cache directory as an ordinary Hugging Face checkpoint (config.json,
model.safetensors, tokenizer files with a chat template) and then loaded like any local
checkpoint, so the engine has exactly one loading path. Fully offline and deterministic: the
weights come from ``torch.manual_seed(SEED)``; the tokenizer is transformers' ByT5 tokenizer
(UTF-8 bytes + 3 specials + 125 extra ids = 384 tokens), which needs no vocabulary file.

A seeded random Llama is chaotic: its greedy continuations look random and no small draft model can
predict them, so speculative decoding would never pay on it. The weights are therefore shaped in closed
form (:func:`shape_predictable`): the LM head reads the residual stream's token component as a vote for a
fixed successor table (a seeded permutation of the vocabulary), and the attention and MLP branches are
scaled down so that they override that vote on a minority of steps. Measured on 32 seeded random prompts
of 8-64 tokens, 32 greedy tokens each: the greedy token is the table's successor of the previous token
83% of the time; the rest depends on the context (attention), so greedy text is neither the table's
cycle nor random (4 of 24 prompts settle into a short loop within 96 tokens, as small models do), and at
temperature 1 the top token's median probability is about 0.25.
Costs nothing at first use (no fitting); the built-in MTP draft is fitted to this target
(``pd.engines.models.builtin_draft``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import NamedTuple, TypedDict

BUILTIN_PREFIX = "builtin:"
SEED = 0
# Bumped whenever the weights' recipe changes, so a cache written by an older recipe is not reused.
FORMAT = 2
SUCCESSOR_SEED = SEED + 1  # the successor table's permutation
# logit of the table's successor ~= LM_HEAD_GAIN * cos(residual, token embedding): sets only the
# temperature (greedy picks do not depend on it); at 15, a frequency penalty of 2 no longer stops every
# greedy repetition, which the engine tests rely on
LM_HEAD_GAIN = 12.0
# attention and MLP output projections are scaled by this against the embedding (whose rows have std
# WEIGHT_STD): at 0.10 the successor wins ~95% of steps, at 0.20 ~40%
BRANCH_SCALE = 0.13
WEIGHT_STD = 0.15
# A chat template in the ChatML style; the tokenizer has no BOS, so none is added.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


class TinyShape(TypedDict):
    """The builtin:tiny model's dimensions, as LlamaConfig's keyword arguments."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int


TINY: TinyShape = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
}


# builtin:deep, for benchmarks (not the test suite): builtin:tiny's tokenizer, vocabulary and width with 22 layers,
# so that on a CPU one target forward costs about 11 draft forwards, as DeepSeek-V4-Flash's 43 layers cost against
# its one MTP layer on an H100 at batch 1 (benchmarks/results/spec_model_work_gpu.md measures both ratios).
DEEP: TinyShape = {**TINY, "num_hidden_layers": 22}
# More layers add more branch output to the residual stream, so the branches are scaled down further: at 0.037 the
# greedy token is the table's successor 83% of the time and the fitted draft's accept length is 3.1 with 3 draft
# tokens (builtin:tiny: 80% and 3.0; 32 seeded random prompts, 32 tokens each; 0.034 gives 91%, 0.039 76%).
DEEP_BRANCH_SCALE = 0.037
DEEP_FORMAT = 1  # builtin:deep's own recipe version (bumping it leaves builtin:tiny's cache valid)


class Recipe(NamedTuple):
    """How one built-in model is written: its dimensions, branch scale (:func:`shape_predictable`) and recipe
    version (part of its cache directory's name)."""

    shape: TinyShape
    branch_scale: float
    format: int


RECIPES = {"tiny": Recipe(TINY, BRANCH_SCALE, FORMAT), "deep": Recipe(DEEP, DEEP_BRANCH_SCALE, DEEP_FORMAT)}
BUILTIN_MODELS = tuple(BUILTIN_PREFIX + name for name in RECIPES)  # the --model-path values written on first use


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
    target = model_dir(model_path)
    if not (target / "model.safetensors").exists():
        write_model(target, model_path)
    return str(target)


def recipe(model_path: str) -> Recipe:
    """The recipe of built-in ``model_path`` (``builtin:NAME``).

    Raises:
        ValueError: not a known built-in name.
    """
    name = model_path.removeprefix(BUILTIN_PREFIX)
    if not model_path.startswith(BUILTIN_PREFIX) or name not in RECIPES:
        raise ValueError(f"--model-path: unknown built-in model {model_path!r}; known: {', '.join(BUILTIN_MODELS)}")
    return RECIPES[name]


def model_dir(model_path: str) -> Path:
    """A built-in model's checkpoint directory under :func:`cache_dir` (named by recipe version and seed).

    Raises:
        ValueError: not a known built-in name.
    """
    name = model_path.removeprefix(BUILTIN_PREFIX)
    return cache_dir() / f"{name}-v{recipe(model_path).format}-seed{SEED}"


def tiny_dir() -> Path:
    """The builtin:tiny checkpoint directory under :func:`cache_dir` (named by recipe version and seed)."""
    return model_dir(BUILTIN_PREFIX + "tiny")


def successor_table(vocab_size: int):
    """The seeded permutation ``succ`` (int64 ``[vocab_size]``) that builtin:tiny's LM head favours:
    after token x the model's greedy pick is ``succ[x]`` unless the context outweighs it."""
    import torch

    return torch.randperm(vocab_size, generator=torch.Generator().manual_seed(SUCCESSOR_SEED))


def shape_predictable(model, branch_scale: float = BRANCH_SCALE) -> None:
    """Make a random Llama follow :func:`successor_table` most of the time (in place, closed form).

    ``lm_head[succ[x]] = LM_HEAD_GAIN / H * E[x] / rms(E[x])``: the final hidden state is
    ``RMSNorm(E[x] + attention + MLP)`` (norm of sqrt(H)), so succ[x]'s logit is about
    ``LM_HEAD_GAIN * cos(hidden, E[x])`` while other tokens get the near-orthogonal rows of other
    embeddings (|cos| ~ 1/sqrt(H)). The attention and MLP output projections are scaled by
    ``branch_scale`` (builtin:tiny's ``BRANCH_SCALE``), which sets how often the context overrides the table.
    """
    import torch

    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        hidden = emb.shape[1]
        unit = emb / emb.pow(2).mean(-1, keepdim=True).sqrt()
        head = torch.empty_like(model.lm_head.weight)
        head[successor_table(emb.shape[0])] = unit * (LM_HEAD_GAIN / hidden)
        model.lm_head.weight.copy_(head)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(branch_scale)
            layer.mlp.down_proj.weight.mul_(branch_scale)


def write_tiny(target: Path) -> None:
    """Write the builtin:tiny checkpoint to ``target`` atomically (temp dir, then rename)."""
    write_model(target, BUILTIN_PREFIX + "tiny")


def write_model(target: Path, model_path: str) -> None:
    """Write built-in ``model_path``'s checkpoint to ``target`` atomically (temp dir, then rename).

    Raises:
        ValueError: not a known built-in name.
    """
    import torch
    from transformers import ByT5Tokenizer, LlamaConfig, LlamaForCausalLM

    spec = recipe(model_path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tokenizer = ByT5Tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
        **spec.shape,
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config)
    # Larger-than-default weights give peaked, varied logits instead of near-uniform ones.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, WEIGHT_STD)
    shape_predictable(model, spec.branch_scale)
    tmp = tempfile.mkdtemp(dir=target.parent, prefix=f".{model_path.removeprefix(BUILTIN_PREFIX)}-")
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
