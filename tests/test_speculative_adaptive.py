"""The adaptive speculative depth (--speculative-adaptive, pd.engines.spec.adaptive): its tier file read and refused
as SGLang's ``_load_adaptive_config`` reads it, the tier slots' EMA decisions against hand-computed sequences of
SGLang's formulas (and SGLang's own class), the draft state across depth changes, greedy outputs equal to a plain
engine, the depth metric following the load, and the doctor's refusals."""

import asyncio
import json
import random

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engines import async_metric, start_engine, wait_ready
from pd.config import ConfigError, parse_config
from pd.engines.errors import EngineSettingsError
from pd.engines.settings import parse_settings, resolve
from pd.engines.spec.adaptive import (
    DEFAULT_ADAPTIVE_CONFIG,
    AdaptiveSpeculativeParams,
    AdaptiveStepSlot,
    DecodeRounds,
    TierConfig,
    load_adaptive_config,
)
from pd.tools import doctor as D
from test_doctor import NOGPU, of, profile, reference, run

ADAPTIVE = ("--speculative-algorithm", "EAGLE", "--speculative-adaptive")
GREEDY = {"temperature": 0}
# Fast decisions (every batch, no warmup) over tiers that draft deep alone, not at all from 5 sequences: a few
# concurrent requests of different lengths take every sequence through depth 0 and back.
FAST_TIERS = {"warmup_batches": 0, "update_interval": 1,
              "1": {"candidate_steps": [1, 2, 4, 6], "down_hysteresis": 0.0},
              "3": {"candidate_steps": [0, 2]},
              "5": {"candidate_steps": [0]}}


def spec_args(*flags):
    return resolve(parse_settings(list(flags), environ={})).speculative_config


def write(tmp_path, data, name="tiers.json"):
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(p)


def tier(steps, **knobs):
    k = {"ema_alpha": 0.2, "update_interval": 5, "warmup_batches": 10, "down_hysteresis": -0.25,
         "up_hysteresis": 0.0, "ceiling_coeff": 0.0, **knobs}
    return TierConfig(1, tuple(steps), k["ema_alpha"], k["update_interval"], k["warmup_batches"],
                      k["down_hysteresis"], k["up_hysteresis"], k["ceiling_coeff"])


# ---- the settings and the tier file --------------------------------------------------------------------------
def test_default_tiers_are_sglangs_and_resolve_as_sglang():
    from sglang.srt.speculative.adaptive_spec_params import DEFAULT_ADAPTIVE_CONFIG as SGLANG_DEFAULT

    assert DEFAULT_ADAPTIVE_CONFIG == SGLANG_DEFAULT
    cfg = load_adaptive_config(None)
    assert [(t.batch_size, t.candidate_steps) for t in cfg.tiers] == [
        (1, (1, 3, 5, 7)), (8, (0, 1, 3)), (32, (0, 1)), (64, (0,))]
    t1, t8 = cfg.tiers[0], cfg.tiers[1]
    assert (t1.ema_alpha, t1.update_interval, t1.warmup_batches, t1.down_hysteresis, t1.up_hysteresis,
            t1.ceiling_coeff) == (0.2, 5, 10, -0.25, 0.0, 0.0)
    assert t8.down_hysteresis == 0.0
    # _init_adaptive_speculative_params: topk 1, the middle of [0, 1, 3, 5, 7]; the window covers the deepest
    spec = spec_args(*ADAPTIVE)
    assert (spec.adaptive, spec.num_steps, spec.eagle_topk, spec.num_draft_tokens) == (True, 3, 1, 8)
    assert spec.flags().endswith("--speculative-num-draft-tokens 8 --speculative-adaptive")
    assert spec_args(*ADAPTIVE, "--speculative-num-steps", "5").num_steps == 5
    assert spec_args("--speculative-algorithm", "EAGLE").adaptive is False


def test_a_custom_file_with_shared_knobs(tmp_path):
    path = write(tmp_path, {"ema_alpha": 0.5, "warmup_batches": 2, "comment": "not a tier",
                            "16": {"candidate_steps": [4, 0, 4], "ema_alpha": 0.1},
                            "2": {"candidate_steps": [2, 6], "update_interval": 3, "unknown_knob": 1}})
    cfg = load_adaptive_config(path)
    assert [(t.batch_size, t.candidate_steps, t.ema_alpha, t.warmup_batches, t.update_interval)
            for t in cfg.tiers] == [(2, (2, 6), 0.5, 2, 3), (16, (0, 4), 0.1, 2, 5)]
    spec = spec_args(*ADAPTIVE, "--speculative-adaptive-config", path)
    assert (spec.num_steps, spec.num_draft_tokens) == (4, 7)  # middle of [0, 2, 4, 6]; 6 + 1
    assert spec.adaptive_config == cfg
    with pytest.raises(EngineSettingsError) as e:
        spec_args(*ADAPTIVE, "--speculative-adaptive-config", path, "--speculative-num-steps", "3")
    assert str(e.value).startswith("--speculative-num-steps 3: not in the adaptive config's candidate_steps "
                                   f"[0, 2, 4, 6] ({path})")


BAD_FILES = [
    ("{not json", "not valid JSON"),
    ([1, 3], "the file must hold a JSON object of batch-size tiers, got list"),
    ({"ema_alpha": 0.2}, "must contain at least one integer-string BS key, e.g."),
    ({"1": [1, 3]}, 'BS "1": a tier must be a JSON object, got [1, 3]'),
    ({"1": {"ema_alpha": 0.1}}, 'BS "1": candidate_steps must be a list of non-negative ints, got None'),
    ({"1": {"candidate_steps": []}}, 'BS "1": candidate_steps must be a list of non-negative ints, got []'),
    ({"1": {"candidate_steps": [1, -1]}}, 'BS "1": candidate_steps must be a list of non-negative ints, got [1, -1]'),
    ({"8": {"candidate_steps": [1.5]}}, 'BS "8": candidate_steps must be a list of non-negative ints, got [1.5]'),
    ({"8": {"candidate_steps": [True, 3]}}, 'BS "8": candidate_steps must be a list of non-negative ints, got '
                                            "[True, 3]"),
    ({"8": {"candidate_steps": 3}}, 'BS "8": candidate_steps must be a list of non-negative ints, got 3'),
    ({"1": {"candidate_steps": [1], "ema_alpha": "fast"}}, "BS \"1\": ema_alpha must be a number, got 'fast'"),
    ({"1": {"candidate_steps": [1], "update_interval": 0}}, 'BS "1": update_interval must be >= 1, got 0'),
    ({"warmup_batches": 2.5, "1": {"candidate_steps": [1]}}, "warmup_batches must be an integer (batches), got 2.5"),
]


@pytest.mark.parametrize("data, message", BAD_FILES)
def test_a_bad_tier_file_is_refused_naming_flag_file_and_key(tmp_path, data, message):
    path = write(tmp_path, data)
    with pytest.raises(EngineSettingsError) as e:
        spec_args(*ADAPTIVE, "--speculative-adaptive-config", path)
    assert e.value.flag == "--speculative-adaptive-config"
    assert str(e.value).startswith(f"--speculative-adaptive-config {path}: "), str(e.value)
    assert message in str(e.value)


def test_a_missing_file_and_a_file_without_the_switch_are_refused(tmp_path):
    with pytest.raises(EngineSettingsError, match=r"adaptive-config /nowhere/tiers.json: cannot read it \(No such"):
        spec_args(*ADAPTIVE, "--speculative-adaptive-config", "/nowhere/tiers.json")
    good = write(tmp_path, {"1": {"candidate_steps": [1]}})
    with pytest.raises(EngineSettingsError, match="--speculative-adaptive-config needs --speculative-adaptive"):
        spec_args("--speculative-algorithm", "EAGLE", "--speculative-adaptive-config", good)
    with pytest.raises(EngineSettingsError, match="--speculative-adaptive needs --speculative-algorithm"):
        spec_args("--speculative-adaptive")


def test_a_bad_tier_file_exits_2_and_is_a_config_error(tmp_path, capsys):
    from pd.engines.api.server import main

    path = write(tmp_path, {"1": {"candidate_steps": [-2]}})
    with pytest.raises(SystemExit) as e:
        main([*ADAPTIVE, "--speculative-adaptive-config", path])
    assert e.value.code == 2
    assert f'--speculative-adaptive-config {path}: BS "1": candidate_steps must be' in capsys.readouterr().err
    with pytest.raises(ConfigError) as c:
        parse_config({"speculative": {"adaptive": True, "adaptive_config": path}})
    assert f'speculative.adaptive_config {path}: BS "1": candidate_steps must be' in str(c.value)


def test_both_engines_command_lines_carry_the_switch_alone(tmp_path):
    from pd.commands.build import engine_command
    from pd.commands.sglang import server_args_of, sglang_command

    path = write(tmp_path, {"1": {"candidate_steps": [1, 3]}})
    block = {"adaptive": True, "adaptive_config": path}
    sg = sglang_command(parse_config({"engine": "sglang", "sglang": {"quantization": "fp8"}, "speculative": block}),
                        "decode", "h", 1, None)
    ns = server_args_of(sg)  # the pinned parser takes them: a store_true switch and a path
    assert ns.speculative_adaptive is True and ns.speculative_adaptive_config == path
    ref = engine_command(parse_config({"speculative": block}), "decode", "127.0.0.1", 30000, None).argv
    assert ref[ref.index("--speculative-adaptive") + 1] == "--speculative-adaptive-config"
    for cfg in ({"speculative": {}}, {"speculative": {"adaptive": False}}):  # off: no flag at all
        argv = engine_command(parse_config(cfg), "decode", "127.0.0.1", 30000, None).argv
        assert not [a for a in argv if "adaptive" in a]


# ---- the tier slots: SGLang's formulas -----------------------------------------------------------------------
def test_slot_warmup_interval_and_steps_up_then_down():
    """Tier 1 of the defaults, starting at 3 (EMA 2.0): 15 batches accepting 3 drafts move the EMA to
    3 - 0.8^15 = 2.964816 (> 3 - 0.5: up to 5) at the first decision, batch 15 (10 warmup + 5); five batches of
    [0, 1] (mean 0.5) bring it to 1.307671 (<= 3 - 0.5 - 0.25: down to 3, not to 1: > 1 - 0.5 - 0.25) at batch 20."""
    s = AdaptiveStepSlot(3, tier([1, 3, 5, 7]))
    assert (s.current_steps, s.ema_accept_len) == (3, 2.0)
    expected = [2.2, 2.36, 2.488, 2.5904, 2.67232]
    changed = []
    for i in range(15):
        changed.append(s.update([3]))
        if i < len(expected):
            assert s.ema_accept_len == pytest.approx(expected[i])
    assert changed == [False] * 14 + [True] and s.current_steps == 5
    assert s.ema_accept_len == pytest.approx(2.964816, abs=1e-6)
    for ema in (2.471853, 2.077482, 1.761986, 1.509589, 1.307671):
        s.update([0, 1])
        assert s.ema_accept_len == pytest.approx(ema, abs=1e-6)
    assert s.current_steps == 3
    assert s.update([]) is False and s._batch_count == 20  # an empty batch counts nothing


def test_slot_drops_to_zero_probes_back_and_rises():
    """Tier [0, 1, 3], no warmup, a decision every batch, start 3 (EMA 2): EMA = 2 x 0.8^n after n batches of 0;
    at 0.4194304 (<= 0.5) it drops past 1 to 0; at 0 the EMA stays and the next decision probes 1; a batch
    accepting 1 makes it 0.5355443 (> 1 - 0.5): up to 3."""
    s = AdaptiveStepSlot(3, tier([0, 1, 3], warmup_batches=0, update_interval=1, down_hysteresis=0.0))
    steps, emas = [], []
    for accepted in [[0]] * 7 + [[5]] + [[1]]:
        s.update(accepted)
        steps.append(s.current_steps)
        emas.append(round(s.ema_accept_len, 7))
    assert steps == [3, 3, 3, 3, 3, 3, 0, 1, 3]
    assert emas == [1.6, 1.28, 1.024, 0.8192, 0.65536, 0.524288, 0.4194304, 0.4194304, 0.5355443]


def test_slot_starting_at_zero_probes_with_a_neutral_ema():
    s = AdaptiveStepSlot(0, tier([0, 2], warmup_batches=0, update_interval=1))
    assert (s.current_steps, s.ema_accept_len) == (0, -1.0)
    assert s.update([9]) and (s.current_steps, s.ema_accept_len) == (2, 1.0)  # target 2's neutral EMA


def test_slot_hysteresis_and_ceiling():
    # up_hysteresis 0.3: from 1 (EMA 0) with every draft accepted, EMA = 1 - 0.8^n must pass 0.8, not 0.5
    for up, batches in ((0.0, 4), (0.3, 8)):  # 0.8^4 = 0.4096 < 0.5; 0.8^8 = 0.1678 < 0.2 < 0.8^7
        s = AdaptiveStepSlot(1, tier([1, 3], warmup_batches=0, update_interval=1, up_hysteresis=up))
        n = next(i for i in range(1, 20) if s.update([1]))
        assert (n, s.current_steps) == (batches, 3)
    # ceiling_coeff 1: at 5 with EMA 3.6 nothing steps down (> 3 - 0.5), but the ceiling ceil(3.6) = 4 caps it to 3
    for coeff, after in ((0.0, 5), (1.0, 3)):
        s = AdaptiveStepSlot(5, tier([1, 3, 5], warmup_batches=0, update_interval=1, down_hysteresis=0.0,
                                     ceiling_coeff=coeff))
        s.update([2])
        assert (round(s.ema_accept_len, 6), s.current_steps) == (3.6, after)
    # a start that is not a candidate: the middle one
    assert AdaptiveStepSlot(3, tier([0, 1])).current_steps == 1


def test_slots_follow_sglangs_own_class_on_random_batches():
    """The same random batches through SGLang's AdaptiveStepSlot and this one: the same EMA and depth throughout."""
    from sglang.srt.speculative.adaptive_spec_params import AdaptiveStepSlot as SGLangSlot

    rng = random.Random(5)
    for trial in range(30):
        steps = sorted(rng.sample(range(0, 8), rng.randint(1, 4)))
        knobs = {"ema_alpha": rng.choice([0.1, 0.2, 0.5]), "update_interval": rng.randint(1, 4),
                 "warmup_batches": rng.randint(0, 5), "down_hysteresis": rng.choice([-0.25, 0.0, 0.3]),
                 "up_hysteresis": rng.choice([0.0, 0.2]), "ceiling_coeff": rng.choice([0, 0.8, 1.5])}
        start = rng.choice(range(0, 8))
        theirs, ours = SGLangSlot(start, {"candidate_steps": steps, **knobs}), AdaptiveStepSlot(start, tier(steps,
                                                                                                           **knobs))
        for _ in range(60):
            batch = [rng.randint(0, max(ours.current_steps, 0)) for _ in range(rng.randint(1, 6))]
            assert ours.update(batch) == theirs.update(batch)
            assert (ours.current_steps, ours.ema_accept_len) == (theirs.current_steps,
                                                                  pytest.approx(theirs.ema_accept_len)), trial


def test_batch_sizes_route_to_tiers_as_sglang():
    from sglang.srt.speculative.adaptive_spec_params import AdaptiveSpeculativeParams as SGLangParams

    ours, theirs = AdaptiveSpeculativeParams(3, load_adaptive_config(None)), SGLangParams(3)
    sizes = [0, 1, 7, 8, 31, 32, 63, 64, 500]
    assert [ours.steps_for_batch(b) for b in sizes] == [3, 3, 3, 3, 3, 1, 1, 0, 0]
    assert [ours.steps_for_batch(b) for b in sizes] == [theirs.get_steps_for_batch(b) for b in sizes]
    assert [ours.slot(b).tier.batch_size for b in sizes] == [1, 1, 1, 8, 8, 32, 32, 64, 64]


class Recorder(AdaptiveSpeculativeParams):
    def __init__(self):
        super().__init__(3, load_adaptive_config(None))
        self.fed: list[tuple[list[int], int]] = []

    def on_verify_complete(self, accepted_drafts, batch_size):
        self.fed.append((list(accepted_drafts), batch_size))
        return super().on_verify_complete(accepted_drafts, batch_size)


def test_rounds_are_sglangs_batches():
    """A round takes its depth from the decoding count when it opens and is fed as one batch, to that count's
    tier, when a sequence comes back (or none of its sequences decodes any more)."""
    p = Recorder()
    r = DecodeRounds(p)
    many = [f"s{i}" for i in range(40)]
    assert r.begin("s0", many) == 1  # 40 decoding: tier 32
    r.end(1)
    assert r.begin("s1", many) == 1  # joins the open round, at its depth
    r.end(0)
    assert p.fed == []
    assert r.begin("s0", ["s0"]) == 3  # s0 again: the round closes; one left decoding: tier 1
    assert p.fed == [([1, 0], 40)]
    r.end(2)
    assert r.begin("new", ["new"]) == 3  # s0 is gone: its round closes before "new" opens one
    assert p.fed == [([1, 0], 40), ([2], 1)]
    assert p.slot(40)._batch_count == 1 and p.slot(1)._batch_count == 1


# ---- the draft state across depths (in process) ---------------------------------------------------------------
@pytest.fixture
def one_torch_thread():
    """Torch on one thread: the model is tiny, and on a shared CPU a second thread waits for the first far more than
    it helps (30 forwards of 37 tokens: 0.2 s on one thread, 3.3 s on two, on the loaded 2-core machine)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_depth_changes_keep_greedy_output_and_the_draft_state(model_cache, one_torch_thread):
    """Steps of depths 3, 0, 0, 5, 1, 0, 2, 7, 0, 4, 3: the tokens are plain greedy decoding's, and after every
    step the draft's cache, hidden state and logits are those of a draft run fresh over the whole history (a step
    of depth 0 still runs the draft extend), so drafting resumes at any depth."""
    import torch

    from pd.engines.model_steps import ModelSteps
    from pd.engines.models.model_runner import ModelRunner
    from pd.engines.protocol import SeqRequest
    from pd.engines.sampling import SamplingParams
    from pd.engines.sequence import Sequence
    from pd.engines.spec.decoder import SpecDecoder
    from pd.engines.spec.draft_model import DraftModel, resolve_draft_path

    runner = ModelRunner("builtin:tiny")
    spec = SpecDecoder(runner, DraftModel(resolve_draft_path("builtin:tiny", None), runner),
                       spec_args("--speculative-algorithm", "EAGLE"))
    plain, steps = ModelSteps(runner, None), ModelSteps(runner, spec)
    prompt = [random.Random(3).randrange(3, 259) for _ in range(24)]

    def seq():
        params = SamplingParams(temperature=0, max_new_tokens=1000, ignore_eos=True)
        return Sequence(SeqRequest(0, 0, 0, prompt, params, "r", 0), runner.eos_token_ids, runner.decode,
                        runner.context_length)

    got = seq()
    got.append(*steps.prefill_forward(got))
    schedule = [3, 0, 0, 5, 1, 0, 2, 7, 0, 4, 3]
    accepted = []
    for depth in schedule:
        st = got.spec_state
        res = spec.step(got, st, got.cache, lambda row, tok: steps.logprob_entry(got, row, tok), num_steps=depth)
        assert res.num_steps == depth and len(res.tokens) == res.accepted_drafts + 1
        accepted.append(res.accepted_drafts)
        for t in res.tokens:
            got.append(*t)
        history = prompt + got.output_ids
        _, hidden = runner.forward_hidden(history[:-1], runner.new_cache())
        fresh = spec.extend_prompt(history[:-1], hidden, history[-1])
        assert st.draft_cache.get_seq_length() == got.cache.get_seq_length() == len(history) - 1
        assert torch.allclose(st.hidden, fresh.hidden, atol=1e-4), depth
        assert int(st.logits.argmax()) == int(fresh.logits.argmax()), depth
    ref = seq()
    ref.append(*plain.prefill_forward(ref))
    while len(ref.output_ids) < len(got.output_ids):
        ref.append(*plain.decode_forward(ref))
    assert got.output_ids == ref.output_ids
    assert max(accepted) >= 2  # drafts were accepted after depth-0 steps too


# ---- engines -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def adaptive_engines(model_cache, tmp_path_factory):
    """A null engine without speculation, one adaptive on SGLang's default tiers, one on FAST_TIERS."""
    from pd.engines.spec.draft_model import resolve_draft_path

    resolve_draft_path("builtin:tiny", None)
    logs = tmp_path_factory.mktemp("adaptive-logs")
    fast = logs / "fast.json"
    fast.write_text(json.dumps(FAST_TIERS))
    started = {"plain": start_engine("null", str(logs)),
               "default": start_engine("null", str(logs), *ADAPTIVE),
               "fast": start_engine("null", str(logs), *ADAPTIVE, "--speculative-adaptive-config", str(fast))}
    try:
        wait_ready(list(started.values()))
        yield started
    finally:
        for e in started.values():
            e.stop()


async def generate(engine, prompt, max_new, client):
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True, **GREEDY}}
    r = await client.post(engine.url + "/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def prompts(count, seed):
    rng = random.Random(seed)
    return [[rng.randrange(3, 259) for _ in range(rng.randrange(8, 48))] for _ in range(count)]


async def depth(engine, client):
    """The engine's ``sglang:spec_num_steps`` now; None before its first step (no sample yet)."""
    text = (await client.get(engine.url + "/metrics")).text
    values = [s.value for fam in text_string_to_metric_families(text) for s in fam.samples
              if s.name == "sglang:spec_num_steps"]
    return values[0] if values else None


def same(got, ref):
    assert got["output_ids"] == ref["output_ids"] and got["text"] == ref["text"]
    assert got["meta_info"]["finish_reason"] == ref["meta_info"]["finish_reason"]


async def test_greedy_output_equals_a_plain_engine_one_at_a_time(adaptive_engines):
    async with httpx.AsyncClient(timeout=120) as c:
        for i, prompt in enumerate(prompts(3, 11)):
            ref = await generate(adaptive_engines["plain"], prompt, 40, c)
            for name in ("default", "fast"):
                got = await generate(adaptive_engines[name], prompt, 40, c)
                same(got, ref)
                assert got["meta_info"]["spec_verify_ct"] < 40, "no draft was ever accepted"


async def test_greedy_output_equals_a_plain_engine_concurrently(adaptive_engines):
    """Six requests of different lengths at once on FAST_TIERS: from 5 decoding the steps do not draft, and as
    requests finish the rest draft again (the depth gauge goes through 0 while they run). The lengths keep five
    decoding together for a dozen steps or more, so a sampled gauge sees it on a loaded machine too."""
    lengths = [16, 28, 40, 56, 80, 144]
    ps = prompts(len(lengths), 12)
    engine = adaptive_engines["fast"]
    seen = set()
    async with httpx.AsyncClient(timeout=120) as c:
        refs = await asyncio.gather(*(generate(adaptive_engines["plain"], p, n, c) for p, n in zip(ps, lengths)))
        load = asyncio.gather(*(generate(engine, p, n, c) for p, n in zip(ps, lengths)))
        while not load.done():
            seen.add(await depth(engine, c))
            await asyncio.wait([load], timeout=0.05)
        got = await load
    seen.discard(None)
    for g, r in zip(got, refs):
        same(g, r)
    assert 0 in seen and max(seen) >= 2, seen
    long = got[-1]["meta_info"]
    assert long["spec_verify_ct"] < lengths[-1], "the longest request never drafted again"


async def test_the_depth_metric_follows_the_load(adaptive_engines):
    """SGLang's default tiers: alone a request drafts 3+ (tier 1: 1, 3, 5, 7, starting at 3); with 40 decoding,
    tier 32 (0, 1; 3 is not a candidate: its middle, 1). ``sglang:spec_num_steps`` is the depth now; the accept
    gauges still count accepted tokens per step."""
    engine = adaptive_engines["default"]
    seen = set()
    async with httpx.AsyncClient(timeout=300) as c:
        await generate(engine, prompts(1, 13)[0], 24, c)
        alone = await depth(engine, c)
        assert alone in (3, 5, 7)
        assert await async_metric(engine, "sglang:spec_num_draft_tokens") == alone + 1
        load = asyncio.gather(*(generate(engine, p, 12, c) for p in prompts(40, 14)))
        while not load.done():
            seen.add(await depth(engine, c))
            await asyncio.wait([load], timeout=0.05)
        await load
    assert seen & {0, 1}, seen
    assert await async_metric(engine, "sglang:spec_accept_length") >= 1.0


# ---- doctor --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra, cause, reason", [
    (["--attn-dp-size", "2"], "decode.extra_args (--attn-dp-size / --enable-dp-attention / --ep-join-mode)",
     "attention DP is not supported (adaptive tier decisions are not synchronized across DP ranks)"),
    (["--enable-multi-layer-eagle"], "decode.extra_args (--enable-multi-layer-eagle)",
     "enable_multi_layer_eagle=True is not supported (MultiLayerEagleWorkerV2 does not implement adaptive)"),
    (["--enable-two-batch-overlap"], "decode.extra_args (--enable-two-batch-overlap)",
     "enable_two_batch_overlap=True is not supported (adaptive state swap would discard the TboAttnBackend"),
    (["--enable-pdmux"], "decode.extra_args (--enable-pdmux)", "enable_pdmux=True is not supported"),
    (["--speculative-algorithm", "DSPARK"], "decode.extra_args (--speculative-algorithm)",
     "speculative_algorithm=DSPARK (only EAGLE/EAGLE3 are supported)"),
])
def test_doctor_refuses_what_sglang_turns_adaptive_off_for(extra, cause, reason):
    d = profile(speculative={"adaptive": True})
    assert [f.level for f in of(run(d), "spec-adaptive")] == ["ok"]
    d["decode"]["extra_args"] = extra
    (err,) = of(run(d), "spec-adaptive", "error")
    assert err.message.startswith(f"sglang.speculative.adaptive (--speculative-adaptive) is on with {cause} on "
                                  "decode: SGLang turns it off at start and runs the static depth"), err.message
    assert reason in err.message and "adaptive_unsupported_reason" in err.message
    assert err.fix.startswith("remove sglang.speculative.adaptive")


def test_doctor_refuses_topk_and_what_stops_sglang(tmp_path):
    d = profile(speculative={"adaptive": True, "eagle_topk": 2, "num_draft_tokens": 4})
    (err,) = of(run(d), "spec-adaptive", "error")
    assert ("is on with sglang.speculative.eagle_topk (--speculative-eagle-topk) on both roles" in err.message
            and "speculative_eagle_topk=2 (only topk=1 is supported)" in err.message)
    d = profile(speculative={"adaptive": True})
    d["prefill"]["extra_args"] = ["--enable-lora"]
    (err,) = of(run(d), "spec-adaptive", "error")
    assert "on prefill: SGLang refuses to start: LoRA does not support --speculative-adaptive" in err.message
    d = profile(speculative={"adaptive": True, "adaptive_config": write(tmp_path, {"1": {"candidate_steps": []}})})
    (err,) = of(run(d), "spec-adaptive", "error")
    assert err.message.startswith("sglang.speculative.adaptive_config: SGLang cannot use the tier file on both roles")
    assert 'BS "1": candidate_steps must be a list of non-negative ints, got []' in err.message
    d = profile(speculative={"adaptive": True, "algorithm": "NEXTN"})  # SGLang resolves NEXTN to EAGLE first
    assert [f.level for f in of(run(d), "spec-adaptive")] == ["ok"]
    assert of(run(profile()), "spec-adaptive") == []  # off: nothing to say


def test_doctor_on_the_reference_engine(tmp_path):
    d = reference(speculative={"adaptive": True, "num_draft_tokens": 4})
    f = of(run(d, NOGPU), "speculative")
    assert [x.level for x in f] == ["warning", "warning", "ok"]
    assert "num_draft_tokens 4 is not used with adaptive" in f[0].message
    assert "--speculative-num-draft-tokens 8 --speculative-adaptive" in f[-1].message
    bad = write(tmp_path, {"4": {"candidate_steps": "all"}})
    d = reference(speculative={"num_steps": 3}, decode={"extra_args": ["--speculative-adaptive",
                                                                       "--speculative-adaptive-config", bad]})
    (err,) = of(run(d, NOGPU), "speculative", "error")
    assert err.message.startswith(f"decode: decode.extra_args: --speculative-adaptive-config {bad}: BS \"4\": "
                                  "candidate_steps must be"), err.message
    d = reference(speculative={"adaptive": True}, decode={"extra_args": ["--speculative-eagle-topk", "2"]})
    (err,) = of(run(d, NOGPU), "speculative", "error")
    assert "--speculative-eagle-topk 2: the reference engine drafts a chain only" in err.message
    assert D.exit_code(run(reference(speculative={"adaptive": True}), NOGPU)) == 0
