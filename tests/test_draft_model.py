"""The MTP draft model (pd.engines.spec.draft_model) and builtin:tiny's fitted draft: shapes, positions, cache crop,
KV pages, the MXFP4 experts, checkpoint caching and determinism, and speculation's accept length."""

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from pd.engines.handoff.kv_pool import KVPagePool

ACCEPT_PROMPTS = 12  # seeded random prompts of 8-64 tokens, 32 greedy tokens each


@pytest.fixture(scope="module")
def pair(model_cache):
    from pd.engines.models.model_runner import ModelRunner
    from pd.engines.spec.draft_model import DraftModel, resolve_draft_path

    target = ModelRunner("builtin:tiny")
    return target, DraftModel(resolve_draft_path("builtin:tiny", None), target)


def _prompt(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 384, (n,), generator=g).tolist()


def _extend(target, draft, ids):
    """Target prefill over ``ids`` then the draft over the pairs (ids[i+1], h_i): (draft cache, logits, hidden)."""
    _, hidden = target.forward_hidden(ids, target.new_cache())
    cache = draft.new_cache()
    logits, out = draft.forward(ids[1:], hidden[:-1], cache)
    return cache, logits, out, hidden


def test_forward_shapes_dtypes_and_cache_growth(pair):
    target, draft = pair
    assert (draft.hidden_size, draft.vocab_size) == (64, 384)
    assert (draft.layout.num_layers, draft.layout.num_kv_heads, draft.layout.head_dim) == (1, 2, 16)
    cache, logits, out, hidden = _extend(target, draft, _prompt(11))
    assert logits.shape == (10, 384) and logits.dtype == torch.float32
    assert out.shape == (10, 64) and out.dtype == torch.float32
    assert cache.get_seq_length() == 10
    assert tuple(cache.layers[0].keys.shape) == (1, 2, 10, 16)
    # a chained step reads the draft's own hidden and grows the cache by one
    logits2, out2 = draft.forward([int(logits[-1].argmax())], out[-1:], cache)
    assert logits2.shape == (1, 384) and out2.shape == (1, 64) and cache.get_seq_length() == 11
    with pytest.raises(ValueError, match="hidden: expected shape"):
        draft.forward([5, 6], out[-1:], cache)


def test_kv_dtype_follows_the_dtype_argument(pair):
    from pd.engines.spec.draft_model import DraftModel

    target, draft = pair
    half = DraftModel(draft.path, target, dtype="bfloat16")
    assert half.layout.dtype == "bfloat16" and half.layout.bytes_per_token() == 2 * 2 * 16 * 2
    cache, logits, _, _ = _extend(target, half, _prompt(6, seed=9))
    assert cache.layers[0].keys.dtype == torch.bfloat16 and logits.dtype == torch.float32


def test_positions_continue_from_the_cache(pair):
    """Two calls (7 then 5 positions) give the one-call outputs: the second call's RoPE positions start at 7
    (restarting at 0 changes the attention scores, so this fails without the offset)."""
    target, draft = pair
    ids = _prompt(13, seed=1)
    _, logits, out, hidden = _extend(target, draft, ids)
    cache = draft.new_cache()
    a_logits, a_out = draft.forward(ids[1:8], hidden[:7], cache)
    b_logits, b_out = draft.forward(ids[8:], hidden[7:12], cache)
    # fp32 sums in another order: up to 1.9e-4 apart (logits up to 9) with torch 2.14.1's CPU kernels, 1e-5 with 2.13
    assert torch.allclose(torch.cat((a_logits, b_logits)), logits, atol=1e-3)
    assert torch.allclose(torch.cat((a_out, b_out)), out, atol=1e-3)


def test_crop_then_rerun_gives_the_same_outputs(pair):
    from pd.engines.spec.draft_model import crop_cache

    target, draft = pair
    ids = _prompt(15, seed=2)
    cache, logits, out, hidden = _extend(target, draft, ids)
    draft.forward([7, 8, 9], out[-3:], cache)  # rejected drafts
    crop_cache(cache, 10)
    assert cache.get_seq_length() == 10
    again_logits, again_out = draft.forward(ids[11:], hidden[10:14], cache)
    assert torch.allclose(again_logits, logits[10:], atol=1e-5) and torch.allclose(again_out, out[10:], atol=1e-5)
    with pytest.raises(ValueError, match="exceeds"):
        crop_cache(cache, 99)


@pytest.mark.parametrize("num_tokens", [1, 16, 37])
def test_kv_export_import_roundtrip(pair, num_tokens):
    target, draft = pair
    ids = _prompt(num_tokens + 1, seed=num_tokens)
    cache, _, out, _ = _extend(target, draft, ids)
    pool = KVPagePool(draft.layout, page_size=16, max_total_tokens=256)
    assert tuple(pool.pages.shape[1:]) == (1, 2, 16, 2, 16)
    pages = [5, 2, 9][: pool.pages_for(num_tokens)]
    draft.export_kv(cache, pool.pages, pages, num_tokens)
    back = draft.import_kv(pool.pages, pages, num_tokens)
    assert torch.equal(cache.layers[0].keys, back.layers[0].keys)
    assert torch.equal(cache.layers[0].values, back.layers[0].values)
    a = draft.forward([42], out[-1:], cache)
    b = draft.forward([42], out[-1:], back)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def _checkpoint(draft):
    from safetensors.torch import load_file

    return load_file(os.path.join(draft.path, "model.safetensors"))


def test_experts_are_stored_as_mxfp4_bytes(pair):
    from pd.kernels.mxfp4_moe_reference import E2M1_VALUES, dequantize_mxfp4

    _, draft = pair
    cfg = json.loads(Path(draft.path, "config.json").read_text())
    e, inter, h = cfg["n_routed_experts"], cfg["moe_intermediate_size"], cfg["hidden_size"]
    assert cfg["quantization_config"]["quant_method"] == "mxfp4" and inter % 32 == 0
    w = _checkpoint(draft)
    shapes = {"w13_weight": (e, 2 * inter, h // 2), "w13_weight_scale": (e, 2 * inter, h // 32),
              "w2_weight": (e, h, inter // 2), "w2_weight_scale": (e, h, inter // 32)}
    for name, shape in shapes.items():
        t = w[f"model.decoder.mlp.experts.{name}"]
        assert t.dtype == torch.uint8 and tuple(t.shape) == shape, name
    for packed, scale in (("w13_weight", "w13_weight_scale"), ("w2_weight", "w2_weight_scale")):
        p, s = w[f"model.decoder.mlp.experts.{packed}"], w[f"model.decoder.mlp.experts.{scale}"]
        assert int(s.max()) < 255 and len(torch.unique(s)) > 1  # UE8M0 bytes, real per-group scales
        values = dequantize_mxfp4(p, s) / torch.exp2(s.float() - 127).repeat_interleave(32, -1)
        assert set(torch.unique(values).tolist()) <= set(E2M1_VALUES)  # every value on the e2m1 grid
    assert not any(k.endswith(("embed_tokens.weight", "lm_head.weight")) for k in w)  # shared, not copied


def test_moe_equals_dense_computation_on_dequantized_experts(pair):
    """mtp_layer.moe (fused_moe_mxfp4_reference on the stored bytes, or its variant on the experts dequantized at
    load: the same bits) equals a dense torch SwiGLU MoE over the dequantized experts with the same router and
    bf16 rounding points; the draft's output depends on the experts."""
    from pd.engines.spec.mtp_layer import (
        EXPERT_TENSORS,
        dequantized_experts,
        layer_forward,
        moe,
        prepare_experts,
        route,
    )

    target, draft = pair
    experts = {k: draft.weights[f"decoder.mlp.experts.{n}"] for k, n in EXPERT_TENSORS.items()}
    gate = draft.weights["decoder.mlp.gate.weight"]
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(3))
    w13, w2 = dequantized_experts(experts)
    inter = w13.shape[1] // 2
    wts, ids = route(gate, x, 2)
    assert ids.shape == (9, 2) and torch.allclose(wts.sum(-1), torch.ones(9))
    bf16 = lambda t: t.to(torch.bfloat16).float()  # noqa: E731
    want = torch.zeros(9, 64)
    for t in range(9):
        for j in range(2):
            e = int(ids[t, j])
            gu = bf16(x[t] @ w13[e].T)
            hid = bf16(torch.nn.functional.silu(gu[:inter]) * gu[inter:])
            want[t] += wts[t, j] * (hid @ w2[e].T)
    got = moe(experts, gate, x, 2)
    assert torch.equal(moe(experts, gate, x, 2, prepare_experts(experts)), got)
    # equal but for bf16 roundings that land on the other side of a tie (batched vs per-row matmul sums)
    assert got.dtype == torch.float32 and (got - want).abs().max() < 2e-3 and (got - want).abs().mean() < 1e-4
    assert got.abs().mean() > 0.01
    # experts scaled by 2**-127 (zeroed scale bytes) change the layer's output: the MoE is in the forward path
    ids_ = _prompt(9, seed=4)
    _, hidden = target.forward_hidden(ids_, target.new_cache())
    embeds = target.model.get_input_embeddings()(torch.tensor(ids_[1:])).float()
    zeroed = {**draft.weights, "decoder.mlp.experts.w2_weight_scale": torch.zeros_like(experts["w2_scale"])}
    base = layer_forward(draft.weights, draft.config, embeds, hidden[:-1], draft.new_cache())[1]
    without = layer_forward(zeroed, draft.config, embeds, hidden[:-1], draft.new_cache())[1]
    assert (without - base).abs().max() > 1e-2


def test_mismatched_draft_is_refused_naming_the_flag(pair, tmp_path):
    from pd.engines.spec.draft_model import DraftModel

    target, draft = pair
    for key, value in (("hidden_size", 32), ("vocab_size", 1000)):
        bad = tmp_path / key
        shutil.copytree(draft.path, bad)
        cfg = json.loads((bad / "config.json").read_text())
        (bad / "config.json").write_text(json.dumps({**cfg, key: value}))
        with pytest.raises(ValueError, match=rf"^--speculative-draft-model-path: .* has {key} {value}, the target "
                                             rf"builtin:tiny has"):
            DraftModel(str(bad), target)
    with pytest.raises(ValueError, match="--dtype"):
        DraftModel(draft.path, target, dtype="int8")


def test_resolve_draft_path(model_cache):
    from pd.engines.spec.draft_model import resolve_draft_path

    assert resolve_draft_path("/models/x", "/drafts/y") == "/drafts/y"
    assert resolve_draft_path("builtin:tiny", "/drafts/y") == "/drafts/y"
    with pytest.raises(ValueError, match=r"^--speculative-draft-model-path: required for --model-path '/models/x'"):
        resolve_draft_path("/models/x", None)


def test_builtin_draft_is_written_once_and_reused(pair, monkeypatch):
    from pd.engines.models import builtin_draft
    from pd.engines.spec.draft_model import resolve_draft_path

    _, draft = pair
    path = Path(draft.path)
    assert path.parent == Path(os.environ["PDSERVE_CACHE"]) and "mtp" in path.name
    before = {f.name: (f.read_bytes(), f.stat().st_mtime_ns) for f in path.iterdir()}

    def refit(*_a, **_k):
        raise AssertionError("the cached draft was rebuilt")

    monkeypatch.setattr(builtin_draft, "build_draft", refit)
    t0 = time.monotonic()
    assert resolve_draft_path("builtin:tiny", None) == str(path)
    assert time.monotonic() - t0 < 1.0
    assert {f.name: (f.read_bytes(), f.stat().st_mtime_ns) for f in path.iterdir()} == before
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no temp dirs left behind


def test_fresh_caches_get_identical_checkpoints(tmp_path, monkeypatch):
    """Target and draft are deterministic: two empty cache directories end up with the same bytes."""
    from pd.engines.spec.draft_model import resolve_draft_path

    files = []
    for name in ("a", "b"):
        monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / name))
        resolve_draft_path("builtin:tiny", None)
        files.append({str(f.relative_to(tmp_path / name)): f.read_bytes()
                      for f in sorted((tmp_path / name).rglob("*")) if f.is_file()})
    assert files[0] == files[1]
    assert any(k.endswith("mtp-v1/model.safetensors") for k in files[0]), sorted(files[0])


def test_speculation_equals_greedy_and_pays(pair, tmp_path):
    """The offline chain-speculation simulator (3 draft tokens, topk 1) on seeded random prompts: the output
    is plain greedy decoding token for token, the fitted draft's mean accept length is >= 2.0 tokens per
    verify step, and the same draft before its fit (seeded weights) accepts almost nothing."""
    from pd.engines.models import builtin_draft
    from pd.engines.spec.draft_model import DraftModel
    from spec_simulator import greedy_decode, random_prompts, speculative_greedy

    target, draft = pair
    prompts = random_prompts(ACCEPT_PROMPTS, target.vocab_size, seed=2024)
    steps = []
    for p in prompts:
        res = speculative_greedy(target, draft, p, 32, num_steps=3)
        assert res.output_ids == greedy_decode(target, p, 32)
        assert all(1 <= s <= 4 for s in res.accepted_per_step)
        steps += res.accepted_per_step
    accept = sum(steps) / len(steps)
    assert accept >= 2.0, accept
    builtin_draft.save_draft(draft.config, builtin_draft.init_weights(draft.config), tmp_path / "unfitted")
    unfitted = DraftModel(str(tmp_path / "unfitted"), target)
    steps = [s for p in prompts[:4] for s in speculative_greedy(target, unfitted, p, 32).accepted_per_step]
    assert sum(steps) / len(steps) < 1.3, steps


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the Triton MXFP4 kernel path)")
def test_cuda_draft_uses_the_kernel_and_matches_cpu(pair):
    """On a GPU the MoE runs through fused_moe_mxfp4 over experts zero-padded to H = 128 (bf16 activations):
    within bf16 rounding of the CPU reference, and the same greedy draft tokens."""
    import copy

    from pd.engines.spec import mtp_layer
    from pd.engines.spec.draft_model import DraftModel

    target, draft = pair
    ids = _prompt(33, seed=5)
    _, cpu_logits, cpu_out, hidden = _extend(target, draft, ids)
    gpu_target = copy.copy(target)
    gpu_target.model = copy.deepcopy(target.model).to("cuda")
    gpu = DraftModel(draft.path, gpu_target)
    assert "padded" in gpu._experts and mtp_layer._triton_kernel() is not None
    logits, out = gpu.forward(ids[1:], hidden[:-1].cuda(), gpu.new_cache())
    assert torch.allclose(out.cpu(), cpu_out, atol=3e-2, rtol=3e-2)
    assert (logits.argmax(-1).cpu() == cpu_logits.argmax(-1)).float().mean() >= 0.9
