"""Config loading: the shipped configs are valid; bad ones fail naming the field."""

import glob
import os

import pytest

from engines import ROOT
from pd.commands.build import engine_command
from pd.config import ConfigError, load_config, parse_config


def test_default_is_local_yaml():
    cfg = load_config()
    assert cfg.engine == "reference" and cfg.model_path == "builtin:tiny"
    assert (cfg.prefill.replicas, cfg.decode.replicas, cfg.cluster.num_gpus) == (1, 1, 8)
    assert (cfg.router.host, cfg.router.port) == ("127.0.0.1", 8000)


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "deploy", "*.yaml"))))
def test_shipped_configs_load(path):
    load_config(path)


@pytest.mark.parametrize("data, message", [
    ({"prefil": {}}, "prefil: unknown key"),
    ({"prefill": {"tp": 2}}, "prefill.tp: unknown key"),
    ({"prefill": {"tp_size": 0}}, "prefill.tp_size"),
    ({"prefill": {"tp_size": 16}}, "prefill.tp_size 16 does not fit a node"),
    ({"prefill": {"replicas": 2, "tp_size": 4}, "decode": {"tp_size": 4}}, "= 12 GPUs; cluster.num_gpus is 8"),
    ({"prefill": {"gpus": [[0]]}, "decode": {"gpus": [[0]]}}, "decode.gpus[0]: GPU 0 is also used by prefill.gpus[0]"),
    ({"prefill": {"gpus": [[9]]}}, "prefill.gpus[0]: GPU 9 does not exist"),
    ({"prefill": {"gpus": [[0, 1]]}}, "prefill.gpus[0] has 2 GPUs; prefill.tp_size is 1"),
    ({"decode": {"replicas": 0}}, "decode.replicas must both be >= 1"),
    ({"transfer": {"protocol": "rdma"}}, "ib_device"),
    ({"router": {"port": 70000}}, "router.port"),
    ({"engine": "vllm"}, "engine"),
])
def test_bad_configs_name_the_field(data, message):
    with pytest.raises(ConfigError) as e:
        parse_config(data, "x.yaml")
    assert message in str(e.value) and str(e.value).startswith("x.yaml:")


def test_bad_yaml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("prefill: [unclosed")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml")


def test_reference_engine_command():
    cfg = parse_config({"transfer": {"protocol": "tcp"}, "prefill": {"extra_args": ["--max-total-tokens", "4096"]}})
    cmd = engine_command(cfg, "prefill", "127.0.0.1", 30000, 30001)
    argv = cmd.argv
    assert argv[argv.index("--disaggregation-mode") + 1] == "prefill"
    assert argv[argv.index("--disaggregation-bootstrap-port") + 1] == "30001"
    assert argv[-2:] == ["--max-total-tokens", "4096"]
    assert cmd.env["MC_FORCE_TCP"] == "1"
    # the argv parses with the engine's own parser
    from pd.engines.server import build_parser

    args = build_parser().parse_args(argv[argv.index("engine") + 1:])
    assert args.port == 30000 and args.disaggregation_mode == "prefill" and args.max_total_tokens == 4096


def test_launch_refuses_a_bad_config_before_touching_ray(tmp_path):
    import subprocess
    import sys

    bad = tmp_path / "bad.yaml"
    bad.write_text("prefill: {tp_size: 3, replicas: 4}\n")
    out = subprocess.run([sys.executable, "-m", "pd.launch", str(bad)], capture_output=True, text=True, cwd=ROOT,
                         env=dict(os.environ, RAY_ADDRESS="http://127.0.0.1:1"), timeout=60)
    assert out.returncode == 2
    assert "invalid config" in out.stderr and "= 13 GPUs; cluster.num_gpus is 8" in out.stderr
