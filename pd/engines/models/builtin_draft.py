"""The built-in MTP draft of a built-in target (``builtin:tiny``, ``builtin:deep``): initialised from a seed,
fitted to that target in closed form, written once beside the target's checkpoint.

Fit (deterministic, no gradient descent): the draft should map (x_{i+1}, h_i) to the target's next hidden
h_{i+1}, whose LM-head logits give the target's greedy token at i + 1. Training pairs come from the
target's greedy continuations of seeded random prompts (``FIT_PROMPTS`` prompts of 8-64 random tokens,
``FIT_TOKENS`` greedy tokens each, teacher-forced once more to read every position's hidden state). Then
``FIT_ROUNDS`` rounds of ridge least squares (normal equations in fp64) solve
``eh_proj @ z_i ~= h_{i+1} - branches_i`` for eh_proj, where z_i = cat(enorm(E[x_{i+1}]), hnorm(h_i)) and
branches_i is what the decoder layer adds to u (attention + MoE, evaluated with the previous round's
eh_proj; zero in round 1), so the layer's output ``u + branches`` lands on h_{i+1}. The attention and the
MoE keep their seeded weights at reduced scale (``BRANCH_SCALE``); the experts are quantized to MXFP4
before the fit, so the fit sees the experts the checkpoint stores. Being small, the branches move the
result little: 3.12 tokens per verify step after one round, 3.14 after three.

Cost at first use on the 2-core CPU: about 1 s alone (generation and the three fits), 10 s while the cores
are shared with running engines; the target itself is closed form (``pd.engines.models.builtin_model``, ~1 s to
write). Result, by the offline simulator of tests/spec_simulator.py with 3 draft tokens at temperature 0 on 32
seeded random prompts of 8-64 tokens (32 new tokens each): 3.1 tokens per verify step (of the 326 steps, 187
accepted all three drafts); the same draft before the fit: 1.0 (nothing accepted). builtin:deep's draft (same
recipe, fitted to its 22-layer target) costs about 7 s at first use on the 2 idle cores and gives 3.1 tokens per
verify step on the same kind of prompts (tests/test_builtin_deep.py).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from pd.engines.models import builtin_model

DRAFT_FORMAT = 1  # bumped whenever the draft's recipe changes (a cached draft of another recipe is not reused)
DRAFT_SEED = builtin_model.SEED + 2
WEIGHTS_FILE = "model.safetensors"
FIT_PROMPTS = 64
FIT_TOKENS = 32
FIT_BATCH = 8  # prompts of one length generated together
# builtin:deep's forwards cost ~11x builtin:tiny's: the same number of prompts, generated 32 at a time (4x fewer
# forward calls; lengths vary between batches only)
FIT_BATCHES = {builtin_model.BUILTIN_PREFIX + "deep": 32}
FIT_ROUNDS = 3
RIDGE = 1e-3
BRANCH_SCALE = 0.3  # the draft layer's attention / expert output projections, against eh_proj's output
MOE = {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128}


TINY = builtin_model.BUILTIN_PREFIX + "tiny"


def draft_dir(model_path: str = TINY) -> Path:
    """The built-in draft's directory of built-in target ``model_path``: beside the target's, named by both
    recipes' versions.

    Raises:
        ValueError: not a known built-in name.
    """
    target = builtin_model.model_dir(model_path)
    return target.parent / f"{target.name}-mtp-v{DRAFT_FORMAT}"


def ensure_builtin_draft(model_path: str = TINY) -> Path:
    """The built-in draft's directory of built-in target ``model_path``, written (target first) on first use.

    Raises:
        ValueError: not a known built-in name.
    """
    target = Path(builtin_model.resolve_model_path(model_path))
    out = draft_dir(model_path)
    if not (out / WEIGHTS_FILE).exists():
        write_builtin_draft(target, out, FIT_BATCHES.get(model_path, FIT_BATCH))
    return out


def draft_config(target_config) -> dict:
    """The draft's config.json: the target's attention shape and norm eps, a small routed MoE with MXFP4
    experts (names as DeepSeek-V3's config and SGLang's NextN loader use them)."""
    heads = int(target_config.num_attention_heads)
    rope = getattr(target_config, "rope_parameters", None) or {}
    return {
        "architectures": ["DeepseekV3ForCausalLMNextN"],
        "model_type": "pdserve_mtp",
        "hidden_size": int(target_config.hidden_size),
        "vocab_size": int(target_config.vocab_size),
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": int(getattr(target_config, "num_key_value_heads", None) or heads),
        "head_dim": int(getattr(target_config, "head_dim", None) or target_config.hidden_size // heads),
        "rms_norm_eps": float(target_config.rms_norm_eps),
        "rope_theta": float(rope.get("rope_theta", getattr(target_config, "rope_theta", 10000.0))),
        "max_position_embeddings": int(target_config.max_position_embeddings),
        **MOE,
        "scoring_func": "softmax",
        "norm_topk_prob": True,
        "quantization_config": {"quant_method": "mxfp4", "weight_dtype": "e2m1", "scale_dtype": "ue8m0",
                                "group_size": 32, "modules": ["decoder.mlp.experts"]},
    }


def init_weights(cfg: dict) -> dict:
    """Seeded weights (fp32 dense, MXFP4 experts) before the fit; names without the ``model.`` prefix."""
    import torch

    from pd.engines.spec.mtp_layer import EXPERT_TENSORS
    from pd.kernels.mxfp4_moe_reference import quantize_mxfp4

    g = torch.Generator().manual_seed(DRAFT_SEED)
    h, e, inter = cfg["hidden_size"], cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    q_out = cfg["num_attention_heads"] * cfg["head_dim"]
    kv_out = cfg["num_key_value_heads"] * cfg["head_dim"]

    def normal(*shape, std=0.15):
        return torch.randn(*shape, generator=g) * std

    w = {name: torch.ones(h) for name in ("enorm.weight", "hnorm.weight", "decoder.input_layernorm.weight",
                                          "decoder.post_attention_layernorm.weight", "shared_head.norm.weight")}
    w["eh_proj.weight"] = normal(h, 2 * h)
    w["decoder.self_attn.q_proj.weight"] = normal(q_out, h)
    w["decoder.self_attn.k_proj.weight"] = normal(kv_out, h)
    w["decoder.self_attn.v_proj.weight"] = normal(kv_out, h)
    w["decoder.self_attn.o_proj.weight"] = normal(h, q_out) * BRANCH_SCALE
    w["decoder.mlp.gate.weight"] = normal(e, h)
    w13, w13_scale = quantize_mxfp4(normal(e, 2 * inter, h))
    w2, w2_scale = quantize_mxfp4(normal(e, h, inter) * BRANCH_SCALE)
    for key, t in {"w13": w13, "w13_scale": w13_scale, "w2": w2, "w2_scale": w2_scale}.items():
        w[f"decoder.mlp.experts.{EXPERT_TENSORS[key]}"] = t.contiguous()
    return w


def fit_prompts(vocab_size: int, batch: int = FIT_BATCH) -> list[list[int]]:
    """The fit's seeded random prompts: ``FIT_PROMPTS`` of them, 8-64 tokens of ids 3.. (no pad/EOS/UNK),
    equal lengths within each batch of ``batch``."""
    import torch

    g = torch.Generator().manual_seed(DRAFT_SEED + 1)
    prompts = []
    for _ in range(FIT_PROMPTS // batch):
        length = int(torch.randint(8, 65, (1,), generator=g))
        prompts += torch.randint(3, vocab_size, (batch, length), generator=g).tolist()
    return prompts


def target_sequences(model, prompts: list[list[int]], batch: int = FIT_BATCH):
    """Greedy continuations (``FIT_TOKENS`` each) of ``prompts`` by the HF target ``model``, and each
    position's final-norm hidden state: a list of (ids [L] int64, hidden [L, H] fp32), one per prompt. Prompts
    are generated ``batch`` at a time (each batch of equal lengths)."""
    import inspect

    import torch
    from transformers import DynamicCache

    # transformers 5 renamed the forward argument past_key_values -> cache (as ModelRunner handles it)
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = []
    with torch.inference_mode():
        for b in range(0, len(prompts), batch):
            ids = torch.tensor(prompts[b : b + batch])
            cache = DynamicCache(config=model.config)
            step = ids
            for _ in range(FIT_TOKENS):
                logits = model(input_ids=step, use_cache=True, **{cache_kw: cache}).logits[:, -1]
                step = logits.argmax(-1, keepdim=True)
                ids = torch.cat((ids, step), dim=1)
            hidden = model.model(input_ids=ids).last_hidden_state.float()
            out += [(ids[j], hidden[j]) for j in range(ids.shape[0])]
    return out


def fit_eh_proj(w: dict, cfg: dict, embed, seqs) -> None:
    """``FIT_ROUNDS`` rounds of the module docstring's ridge fit of ``w["eh_proj.weight"]`` (in place)."""
    import torch
    from transformers import DynamicCache

    from pd.engines.spec.mtp_layer import EXPERT_TENSORS, layer_forward, prepare_experts, rms_norm

    eps = cfg["rms_norm_eps"]
    zs = [torch.cat((rms_norm(embed[ids[1:]], w["enorm.weight"], eps), rms_norm(h[:-1], w["hnorm.weight"], eps)), -1)
          for ids, h in seqs]
    z = torch.cat(zs).double()
    y = torch.cat([h[1:] for _, h in seqs]).double()
    gram = z.T @ z + RIDGE * len(z) * torch.eye(z.shape[1], dtype=torch.float64)
    branches = torch.zeros_like(y)
    prepared = prepare_experts({k: w[f"decoder.mlp.experts.{n}"] for k, n in EXPERT_TENSORS.items()})
    for _ in range(FIT_ROUNDS):
        w["eh_proj.weight"] = torch.linalg.solve(gram, z.T @ (y - branches)).T.float().contiguous()
        with torch.inference_mode():  # what attention + MoE add to u with this eh_proj, sequence by sequence
            branches = torch.cat([layer_forward(w, cfg, embed[ids[1:]], h[:-1], DynamicCache(), prepared)[0]
                                  - zi @ w["eh_proj.weight"].T for (ids, h), zi in zip(seqs, zs)]).double()


def build_draft(target_path: Path, batch: int = FIT_BATCH) -> tuple[dict, dict]:
    """(config, weights) of the fitted draft of the checkpoint at ``target_path`` (``batch``: fit prompts
    generated together)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target_path), dtype=torch.float32).eval()
    cfg = draft_config(model.config)
    w = init_weights(cfg)
    seqs = target_sequences(model, fit_prompts(cfg["vocab_size"], batch), batch)
    fit_eh_proj(w, cfg, model.model.embed_tokens.weight.detach(), seqs)
    return cfg, w


def write_builtin_draft(target_path: Path, out: Path, batch: int = FIT_BATCH) -> None:
    """Fit the draft of ``target_path`` and write it to ``out`` atomically (temp dir, then rename):
    config.json and model.safetensors (names ``model.*`` as in SGLang's NextN checkpoints; no embedding or
    LM head, the target's are shared)."""
    save_draft(*build_draft(target_path, batch), out)


def save_draft(cfg: dict, w: dict, out: Path) -> None:
    """Write a draft checkpoint (config, weights without the ``model.`` prefix) to ``out`` atomically."""
    from safetensors.torch import save_file

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=out.parent, prefix=".mtp-")
    try:
        save_file({f"model.{k}": v.contiguous() for k, v in sorted(w.items())}, os.path.join(tmp, WEIGHTS_FILE))
        Path(tmp, "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        os.rename(tmp, out)
    except OSError:
        if not (out / WEIGHTS_FILE).exists():
            raise
        # A concurrent writer won; its draft is identical (same seeds, same target).
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
