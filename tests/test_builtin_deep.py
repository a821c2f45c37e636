"""builtin:deep, the speculative benchmark's target (pd.engines.models.builtin_model): builtin:tiny's tokenizer,
vocabulary and width with more layers, written on first use, and its own fitted MTP draft
(pd.engines.models.builtin_draft), which the chain-speculation simulator accepts at about builtin:tiny's rate."""

import json

import pytest
import torch

ACCEPT_PROMPTS = 4  # seeded random prompts of 8-64 tokens, NEW_TOKENS greedy tokens each
NEW_TOKENS = 24
MIN_ACCEPT = 2.5  # tokens per verify step with 3 draft tokens (measured: 3.1 on 32 prompts; builtin:tiny: 3.0)


@pytest.fixture
def one_thread():
    """Torch on one thread for this test (its 22-layer forwards are many small ops, which a second thread only
    slows down on a busy 2-core machine); the previous count is restored."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_deep_target_builds_and_its_own_draft_is_accepted(model_cache, one_thread):
    from pd.engines.models import builtin_draft, builtin_model
    from pd.engines.models.model_runner import ModelRunner
    from pd.engines.spec.draft_model import DraftModel, resolve_draft_path
    from spec_simulator import greedy_decode, random_prompts, speculative_greedy

    target = ModelRunner("builtin:deep")
    tiny = json.loads((builtin_model.tiny_dir() / "config.json").read_text())
    cfg = target.config
    assert cfg.num_hidden_layers == builtin_model.DEEP["num_hidden_layers"] > tiny["num_hidden_layers"]
    assert (cfg.hidden_size, cfg.vocab_size) == (tiny["hidden_size"], tiny["vocab_size"])
    assert target.encode("héllo") == [b + 3 for b in "héllo".encode()]  # ByT5: UTF-8 bytes after 3 specials
    path = resolve_draft_path("builtin:deep", None)
    # fitted to this target, beside it: not builtin:tiny's draft (which loads, having the same width)
    assert path == str(builtin_draft.draft_dir("builtin:deep")) != str(builtin_draft.draft_dir())
    assert builtin_model.model_dir("builtin:deep").name in path
    draft = DraftModel(path, target)

    prompts = random_prompts(ACCEPT_PROMPTS, target.vocab_size, seed=7)
    steps = []
    for i, p in enumerate(prompts):
        res = speculative_greedy(target, draft, p, NEW_TOKENS, num_steps=3)
        if i == 0:
            assert res.output_ids == greedy_decode(target, p, NEW_TOKENS)
        steps += res.accepted_per_step
    accept = sum(steps) / len(steps)
    print(f"accept length {accept:.2f}")
    assert accept >= MIN_ACCEPT, accept
