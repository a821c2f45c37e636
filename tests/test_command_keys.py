"""The cluster's key reaches each engine off its command line: the environment (reference engine) or
SGLang's own --config YAML (checked with the pinned SGLang's parser and config merger)."""

import json

import pytest

from pd.commands.build import engine_command
from pd.config import load_config
from pd.engines.settings import API_KEY_ENV

KEY = "0f" * 32


def test_reference_engine_gets_the_key_in_its_environment():
    cfg = load_config()
    cmd = engine_command(cfg, "prefill", "127.0.0.1", 30001, 30002, KEY, "/nonexistent")
    assert cmd.env[API_KEY_ENV] == KEY and KEY not in " ".join(cmd.argv) and not cmd.files
    assert API_KEY_ENV not in engine_command(cfg, "decode", "127.0.0.1", 30003, None).env


def test_sglang_reads_the_key_from_its_config_file(tmp_path):
    from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger

    from pd.commands.sglang import parse_sglang_args, sglang_parser

    cfg = load_config().model_copy(update={"engine": "sglang"})
    cmd = engine_command(cfg, "decode", "127.0.0.1", 30003, None, KEY, str(tmp_path))
    assert KEY not in " ".join(cmd.argv) and KEY not in json.dumps(cmd.env)
    (path, text), = cmd.files.items()
    assert cmd.argv[cmd.argv.index("--config") + 1] == path and path.endswith(".yaml")
    with open(path, "w") as f:
        f.write(text)
    merged = ConfigArgumentMerger(sglang_parser()).merge_config_with_args(cmd.argv[cmd.args_start:])
    assert parse_sglang_args(merged).api_key == KEY


def test_sglang_extra_config_cannot_hide_the_key_file(tmp_path):
    cfg = load_config().model_copy(update={"engine": "sglang"})
    cfg.decode.extra_args = ["--config", "mine.yaml"]
    with pytest.raises(ValueError, match="--config"):
        engine_command(cfg, "decode", "127.0.0.1", 30003, None, KEY, str(tmp_path))
