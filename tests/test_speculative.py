"""Speculative decoding units: the --speculative-* checks and the acceptance rule's distribution."""

import json
import math

import pytest
import torch

from pd.engines.errors import EngineSettingsError
from pd.engines.sampling import SamplingParams, step_generator
from pd.engines.settings import parse_settings, resolve
from pd.engines.spec.config import resolve_speculative
from pd.engines.spec.decoder import accept_drafts, draft_token


def spec_args(*flags):
    return resolve(parse_settings(list(flags), environ={})).speculative_config


# ---- flags -------------------------------------------------------------------------------------------------
def test_speculation_is_off_by_default():
    assert spec_args() is None


@pytest.mark.parametrize("algo", ["EAGLE", "NEXTN", "eagle"])
def test_unset_steps_choose_deepseek_mtp_defaults(algo):
    cfg = spec_args("--speculative-algorithm", algo)
    assert (cfg.algorithm, cfg.num_steps, cfg.eagle_topk, cfg.num_draft_tokens) == ("EAGLE", 3, 1, 4)
    assert cfg.draft_model_path is None  # builtin:tiny's own draft


def test_chain_adjusts_num_draft_tokens_as_sglang(caplog):
    cfg = spec_args("--speculative-algorithm", "EAGLE", "--speculative-num-steps", "2",
                    "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "7")
    assert (cfg.num_steps, cfg.num_draft_tokens) == (2, 3)
    assert "speculative_num_draft_tokens is adjusted to speculative_num_steps + 1" in caplog.text


@pytest.mark.parametrize("flags, named", [
    (["--speculative-algorithm", "EAGLE", "--speculative-eagle-topk", "4", "--speculative-num-steps", "3"],
     "--speculative-eagle-topk 4"),
    (["--speculative-algorithm", "EAGLE", "--speculative-eagle-topk", "1"], "--speculative-num-steps"),
    (["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "0"],
     "--speculative-num-steps 0: Input should be greater than or equal to 1"),
    (["--speculative-algorithm", "MEDUSA"],
     "--speculative-algorithm MEDUSA: 'MEDUSA' is not one of EAGLE, EAGLE3, NEXTN"),
    (["--speculative-algorithm", "EAGLE3"],
     "--speculative-algorithm EAGLE3: the reference engine supports EAGLE and NEXTN"),
    (["--speculative-num-steps", "3"], "--speculative-num-steps needs --speculative-algorithm"),
    (["--speculative-draft-model-path", "/x"], "--speculative-draft-model-path needs --speculative-algorithm"),
])
def test_bad_speculative_flags_name_the_flag(flags, named):
    with pytest.raises(EngineSettingsError) as e:
        spec_args(*flags)
    assert named in str(e.value)


def test_a_checkpoint_without_builtin_draft_needs_a_draft_path(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    settings = parse_settings(["--model-path", str(tmp_path), "--speculative-algorithm", "EAGLE"], environ={})
    with pytest.raises(EngineSettingsError, match="--speculative-draft-model-path is required"):
        resolve_speculative(settings.speculative, settings.model_path)


@pytest.mark.parametrize("draft_config, named", [
    (None, "no config.json there"),
    ({"hidden_size": 128, "vocab_size": 384}, "the draft's hidden_size is 128, the target's (builtin:tiny) is 64"),
])
def test_a_draft_that_cannot_serve_the_target_is_refused_at_start(tmp_path, draft_config, named):
    if draft_config is not None:
        (tmp_path / "config.json").write_text(json.dumps(draft_config))
    with pytest.raises(EngineSettingsError) as e:
        spec_args("--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", str(tmp_path))
    assert "--speculative-draft-model-path" in str(e.value) and named in str(e.value)


def test_a_checkpoint_draft_must_match_the_checkpoint_target(tmp_path):
    target, draft = tmp_path / "target", tmp_path / "draft"
    target.mkdir()
    draft.mkdir()
    (target / "config.json").write_text(json.dumps({"hidden_size": 64, "vocab_size": 1000}))
    (draft / "config.json").write_text(json.dumps({"hidden_size": 64, "vocab_size": 999}))
    flags = ["--model-path", str(target), "--speculative-algorithm", "EAGLE", "--speculative-draft-model-path",
             str(draft)]
    with pytest.raises(EngineSettingsError, match="the draft's vocab_size is 999"):
        spec_args(*flags)
    (draft / "config.json").write_text(json.dumps({"hidden_size": 64, "vocab_size": 1000}))
    assert spec_args(*flags).draft_model_path == str(draft)


# ---- the acceptance rule -------------------------------------------------------------------------------------
# A vocabulary of 6 with target p and draft q far apart, so a wrong rule shows in a few thousand draws.
P = torch.tensor([0.30, 0.25, 0.20, 0.12, 0.08, 0.05])
Q = torch.tensor([0.05, 0.10, 0.40, 0.05, 0.30, 0.10])
SAMPLED = SamplingParams(temperature=1.0)
DRAWS = 6000
# chi-square critical value for 5 degrees of freedom at significance 1e-3 (fixed seeds make the test
# deterministic; the threshold only says how far from p a histogram may be)
CHI2_5DF_999 = 20.515


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def first_token_histogram(rule) -> torch.Tensor:
    """Emit one token per seed through ``rule`` (one draft from Q, verified against P) and count them."""
    logits_p, logits_q = P.log(), Q.log()
    counts = torch.zeros(6)
    for seed in range(DRAWS):
        d, q = draft_token(logits_q, SAMPLED, seed, 0, [], [])
        target = torch.stack([logits_p, logits_p])  # row 0 verifies d, row 1 would give the bonus
        counts[rule(target, d, q, seed)] += 1
    return counts


def speculative_rule(target, d, q, seed):
    j, bonus = accept_drafts(target, [d], [q], SAMPLED, seed, 0, lambda _s: [], [])
    return d if j == 1 else bonus


def argmax_rule(target, d, q, seed):
    """The naive rule: keep the draft when it is the target's argmax, else take the argmax."""
    top = int(torch.argmax(target[0]))
    return d if d == top else top


def resample_rule(target, d, q, seed):
    """Another wrong rule: accept with probability p(d) (ignoring q), else draw from p again."""
    u = float(torch.rand((), generator=step_generator(seed, 0, 2)))
    if u < float(P[d]):
        return d
    return int(torch.multinomial(P, 1, generator=step_generator(seed, 0, 3)))


def test_draft_tokens_follow_the_draft_distribution():
    counts = torch.zeros(6)
    for seed in range(DRAWS):
        counts[draft_token(Q.log(), SAMPLED, seed, 0, [], [])[0]] += 1
    assert chi_square(counts, Q) < CHI2_5DF_999


def test_speculative_sampling_keeps_the_target_distribution():
    assert chi_square(first_token_histogram(speculative_rule), P) < CHI2_5DF_999


@pytest.mark.parametrize("wrong_rule", [argmax_rule, resample_rule])
def test_the_goodness_of_fit_test_rejects_wrong_rules(wrong_rule):
    assert chi_square(first_token_histogram(wrong_rule), P) > CHI2_5DF_999


def test_all_accepted_bonus_is_drawn_from_the_last_row():
    """Two drafts: the emitted pair's second token, given the first was accepted, is still p-distributed."""
    logits_p, logits_q = P.log(), Q.log()
    counts = torch.zeros(6)
    for seed in range(DRAWS):
        d1, q1 = draft_token(logits_q, SAMPLED, seed, 0, [], [])
        d2, q2 = draft_token(logits_q, SAMPLED, seed, 1, [], [d1])
        j, bonus = accept_drafts(torch.stack([logits_p] * 3), [d1, d2], [q1, q2], SAMPLED, seed, 0,
                                 lambda _s: [], [])
        if j >= 1:
            counts[d2 if j == 2 else bonus] += 1
    assert counts.sum() > DRAWS / 4
    assert chi_square(counts, P) < CHI2_5DF_999


def test_greedy_accepts_the_longest_agreeing_prefix_and_adds_the_bonus():
    greedy = SamplingParams(temperature=0)
    rows = torch.full((4, 6), -5.0)
    for k, tok in enumerate([2, 4, 1, 5]):  # the target's greedy tokens at the four window rows
        rows[k, tok] = 5.0
    none = lambda _s: []  # noqa: E731
    assert accept_drafts(rows, [2, 4, 1], [None] * 3, greedy, 0, 0, none, []) == (3, 5)
    assert accept_drafts(rows, [2, 3, 1], [None] * 3, greedy, 0, 0, none, []) == (1, 4)
    assert accept_drafts(rows, [0, 4, 1], [None] * 3, greedy, 0, 0, none, []) == (0, 2)
    # min_new_tokens' banned ids apply per row: with 4 banned at output 1 the target's row-1 token is the next best
    rows[1, 3] = 4.0
    banned = lambda step: [4] if step == 1 else []  # noqa: E731
    assert accept_drafts(rows, [2, 4, 1], [None] * 3, greedy, 0, 0, banned, []) == (1, 3)


def test_penalties_see_the_accepted_drafts():
    """Row k is processed with the history up to it: a frequency penalty on a token drafted at row 0 changes
    row 1's greedy choice, as it would in a one-token step."""
    params = SamplingParams(temperature=0, frequency_penalty=2.0)
    rows = torch.zeros(2, 6)
    rows[0, 2] = 3.0
    rows[1, 2], rows[1, 3] = 3.0, 2.0  # 2 wins unless penalised for having been emitted once
    assert accept_drafts(rows, [2], [None], params, 0, 0, lambda _s: [], []) == (1, 3)
    assert math.isclose(float(rows[1, 2]), 3.0)  # the verify logits are not modified in place
