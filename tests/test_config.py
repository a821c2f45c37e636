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
    from pd.engines.settings import parse_settings

    args = parse_settings(argv[argv.index("engine") + 1:], environ={})
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


# ---- speculative decoding ------------------------------------------------------------------------
SPEC_FLAGS = ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
              "--speculative-num-draft-tokens", "4"]  # what the engine resolves (3, 1, 4) to


def _engine_spec(argv):
    """The speculative settings the reference engine resolves from a generated argv (its own parser and check)."""
    from pd.engines.settings import parse_settings
    from pd.engines.spec.config import resolve_speculative

    settings = parse_settings(argv[argv.index("engine") + 1:], environ={})
    return resolve_speculative(settings.speculative, settings.model_path)


@pytest.mark.parametrize("where", ["speculative", "sglang.speculative"])
def test_speculative_block_drives_both_reference_roles(where):
    block = {"algorithm": "EAGLE", "num_steps": 3, "num_draft_tokens": 4}
    cfg = parse_config({"speculative": block} if where == "speculative" else {"sglang": {"speculative": block}})
    assert cfg.speculative_settings()[1] == where
    argvs = {role: engine_command(cfg, role, "127.0.0.1", 30000, 30001 if role == "prefill" else None).argv
             for role in ("prefill", "decode")}
    given = ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3", "--speculative-num-draft-tokens", "4"]
    for argv in argvs.values():  # the keys the block sets, no more: the engine chooses the rest
        i = argv.index("--speculative-algorithm")
        assert argv[i:i + len(given)] == given
    specs = {role: _engine_spec(argv) for role, argv in argvs.items()}
    assert specs["prefill"] == specs["decode"] and specs["decode"].flags() == " ".join(SPEC_FLAGS)
    # off: no flag at all, and the engine runs without a draft
    plain = engine_command(parse_config({}), "decode", "127.0.0.1", 30000, None).argv
    assert not [t for t in plain if t.startswith("--speculative")] and _engine_spec(plain) is None


def test_speculative_draft_path_and_extra_args_override():
    cfg = parse_config({"speculative": {"draft_model_path": "/models/draft"},
                        "decode": {"extra_args": ["--speculative-num-steps", "2"]}})
    argv = engine_command(cfg, "decode", "127.0.0.1", 30000, None).argv
    assert argv[argv.index("--speculative-draft-model-path") + 1] == "/models/draft"
    assert _engine_spec(argv).num_steps == 2  # extra_args come last: they win, as argparse reads them


def test_top_level_speculative_drives_sglang_workers_too():
    from pd.commands.sglang import sglang_command

    sglang = {"quantization": "fp8"}
    block = {"algorithm": "EAGLE", "num_steps": 2, "eagle_topk": 1, "num_draft_tokens": 3}
    old = sglang_command(parse_config({"engine": "sglang", "sglang": {**sglang, "speculative": block}}),
                         "decode", "h", 1, None).argv
    new = sglang_command(parse_config({"engine": "sglang", "sglang": sglang, "speculative": block}),
                         "decode", "h", 1, None).argv
    assert new == old and old[old.index("--speculative-num-steps") + 1] == "2"


@pytest.mark.parametrize("data, message", [
    ({"speculative": {"num_steps": 3, "eagle_topk": 2, "num_draft_tokens": 4}},
     "x.yaml: speculative.eagle_topk 2: the reference engine drafts a chain only"),
    ({"speculative": {"eagle_topk": 1}}, "x.yaml: speculative.num_steps: --speculative-eagle-topk and "
                                         "--speculative-num-draft-tokens need --speculative-num-steps"),
    ({"sglang": {"speculative": {"num_steps": 3, "eagle_topk": 4}}}, "x.yaml: sglang.speculative.eagle_topk 4"),
    ({"speculative": {"algorithm": "EAGLE3"}}, "x.yaml: speculative.algorithm EAGLE3: the reference engine supports "
                                               "EAGLE and NEXTN"),
    ({"speculative": {"moe_runner_backend": "flashinfer_mxfp4"}},
     "x.yaml: speculative.moe_runner_backend: SGLang workers only"),
    ({"speculative": {}, "sglang": {"speculative": {}}}, "x.yaml: speculative and sglang.speculative are both set"),
    ({"speculative": {"num_steps": 0}}, "x.yaml: speculative.num_steps: Input should be greater than or equal to 1"),
    ({"speculative": {"algorithm": "MEDUSA"}},
     "x.yaml: speculative.algorithm: 'MEDUSA' is not one of EAGLE, EAGLE3, NEXTN"),
])
def test_bad_speculative_blocks_name_the_key(data, message):
    with pytest.raises(ConfigError) as e:
        parse_config(data, "x.yaml")
    assert str(e.value).startswith(message), str(e.value)


def test_sglang_workers_keep_tree_drafting_and_eagle3():
    """What only the reference engine refuses stays valid for SGLang workers."""
    cfg = parse_config({"engine": "sglang", "speculative": {"algorithm": "EAGLE3", "eagle_topk": 4,
                                                            "num_draft_tokens": 8, "moe_runner_backend": "triton"}})
    assert cfg.speculative_settings()[0].eagle_topk == 4


def test_local_spec_profile_serves_the_default_with_speculation(capsys):
    """deploy/local-spec.yaml is package data next to local.yaml, equals it but for the speculative block, and
    `pdserve plan` shows the same --speculative-* flags on both workers."""
    from importlib.resources import files

    import yaml

    from pd.tools.plan import main as plan_main

    path = str(files("pd.deploy").joinpath("local-spec.yaml"))
    with open(path) as f, open(os.path.join(ROOT, "deploy", "local.yaml")) as g:
        spec, plain = yaml.safe_load(f), yaml.safe_load(g)
    assert {k: v for k, v in spec.items() if k != "speculative"} == plain
    assert load_config(path).speculative_settings()[0].num_steps == 3
    assert plan_main([path]) == 0
    blocks = [b for b in capsys.readouterr().out.split("\n\n") if b.startswith(("prefill-0", "decode-0"))]
    assert len(blocks) == 2 and all(" ".join(SPEC_FLAGS) in b for b in blocks), blocks
