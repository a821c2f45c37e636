"""The reference engine's settings model is the one source of its flags, of the config's ``speculative:`` block and
of both engine kinds' ``--speculative-*`` command lines: a setting added to the model reaches all of them."""

from __future__ import annotations

import typing

import pytest

from pd.commands.build import engine_command
from pd.config import parse_config
from pd.engines.errors import EngineSettingsError
from pd.engines.settings import EngineSettings, build_parser, engine_argv, parse_settings, resolve
from pd.engines.spec.config import SpeculativeSettings

# A value each kind of setting accepts with the others at these values (a chain of one step, the built-in draft's
# path given explicitly, the adaptive depth on with a tier file the test writes): an added int or str setting gets
# the generic one, a switch True.
SAMPLES = {"algorithm": "EAGLE", "draft_model_path": "/models/draft", "num_steps": 1, "eagle_topk": 1,
           "num_draft_tokens": 2}


def _sample(key: str, annotation) -> object:
    if key in SAMPLES:
        return SAMPLES[key]
    if annotation is bool:
        return True
    return 1 if int in typing.get_args(annotation) or annotation is int else "x"


def test_every_speculative_setting_is_an_engine_flag_a_config_key_and_on_both_command_lines(tmp_path):
    tiers = tmp_path / "adaptive.json"
    tiers.write_text('{"1": {"candidate_steps": [1, 3]}}')
    values = {k: _sample(k, f.annotation) for k, f in SpeculativeSettings.model_fields.items()}
    values["adaptive_config"] = str(tiers)
    help_text = build_parser().format_help()
    for engine in ("reference", "sglang"):
        cfg = parse_config({"engine": engine, "speculative": values, **({"sglang": {"quantization": "fp8"}}
                                                                       if engine == "sglang" else {})})
        argv = engine_command(cfg, "decode", "127.0.0.1", 30000, None).argv
        for key, value in values.items():
            flag = SpeculativeSettings.FLAG.format(key.replace("_", "-"))
            assert flag in help_text, flag
            if value is True:  # a switch: the flag alone, both engines
                assert flag in argv, (engine, flag)
            else:
                assert argv[argv.index(flag) + 1] == str(value), (engine, flag)
        if engine == "reference":
            assert parse_settings(argv[argv.index("engine") + 1:], environ={}).speculative.model_dump() == values


def test_a_block_key_left_unset_is_the_engine_default_not_a_second_one():
    """``speculative: {}`` passes only the algorithm: the engine's (3, 1, 4) choice, not a config default."""
    cfg = parse_config({"speculative": {}})
    argv = engine_command(cfg, "decode", "127.0.0.1", 30000, None).argv
    assert [a for a in argv if a.startswith("--speculative")] == ["--speculative-algorithm"]
    spec = resolve(parse_settings(argv[argv.index("engine") + 1:], environ={})).speculative_config
    assert (spec.num_steps, spec.eagle_topk, spec.num_draft_tokens) == (3, 1, 4)


def test_engine_argv_round_trips_through_the_engine_parser():
    settings = EngineSettings(model_path="builtin:tiny", port=31000, disaggregation_mode="decode", page_size=32,
                              api_key="sekret", speculative=SpeculativeSettings(algorithm="NEXTN", num_steps=2))
    argv = engine_argv(settings)
    assert "sekret" not in argv and "--api-key" not in argv  # the key travels in the environment
    assert parse_settings(argv, environ={}) == settings.model_copy(update={"api_key": None})


@pytest.mark.parametrize("argv, env, flag", [
    (["--page-size", "0"], {}, "--page-size"),
    (["--speculative-num-steps", "0"], {}, "--speculative-num-steps"),
    ([], {"SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "soon"}, "--disaggregation-waiting-timeout"),
    ([], {"SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": "-1"},
     "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT"),
])
def test_an_invalid_setting_is_a_typed_error_naming_its_flag_or_variable(argv, env, flag):
    with pytest.raises(EngineSettingsError) as e:
        parse_settings(argv, environ=env)
    assert e.value.flag == flag and str(e.value).startswith(flag)


def test_pdserve_engine_exits_2_naming_the_flag(capsys):
    from pd.engines.api.server import main

    with pytest.raises(SystemExit) as e:
        main(["--speculative-eagle-topk", "2", "--speculative-num-steps", "3", "--speculative-algorithm", "EAGLE"])
    assert e.value.code == 2
    assert "--speculative-eagle-topk 2: the reference engine drafts a chain only" in capsys.readouterr().err
