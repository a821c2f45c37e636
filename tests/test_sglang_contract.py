"""Contract tests: every SGLang command line we generate parses with the pinned SGLang's own
parser (ServerArgs.add_cli_args), with the values the config asked for."""

import glob
import os

import pytest

from engines import ROOT
from pd.config import load_config, parse_config
from pd.engines.sglang import SGLangArgError, parse_sglang_args, pinned_sglang_version, server_args_of, sglang_command
from pd.plan import plan

SGLANG_CONFIGS = [p for p in sorted(glob.glob(os.path.join(ROOT, "deploy", "*.yaml")))
                  if load_config(p).engine == "sglang"]


def test_the_installed_sglang_is_the_pinned_one():
    import sglang

    assert sglang.__version__ == pinned_sglang_version()
    assert SGLANG_CONFIGS, "at least one shipped SGLang profile"


@pytest.mark.parametrize("path", SGLANG_CONFIGS, ids=os.path.basename)
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_shipped_config_argv_parses_with_the_values_asked(path, role):
    cfg = load_config(path)
    s, g = cfg.sglang, cfg.groups()[role]
    bport = 8998 if role == "prefill" else None
    cmd = sglang_command(cfg, role, "10.0.0.1", 31000, bport)
    ns = server_args_of(cmd)
    assert ns.model_path == cfg.model_path
    assert ns.tp_size == g.tp_size
    assert (ns.host, ns.port) == ("10.0.0.1", 31000)
    assert ns.disaggregation_mode == role
    assert ns.disaggregation_transfer_backend == "mooncake"
    if role == "prefill":
        assert ns.disaggregation_bootstrap_port == 8998
    assert ns.page_size == cfg.page_size
    assert ns.kv_cache_dtype == s.kv_cache_dtype
    assert ns.quantization == s.quantization and ns.quantization is not None
    assert ns.mem_fraction_static == s.mem_fraction_static
    assert ns.context_length == s.context_length
    assert ns.moe_runner_backend == s.moe_runner_backend
    assert ns.enable_metrics is s.enable_metrics
    assert ns.trust_remote_code is s.trust_remote_code
    assert getattr(ns, f"cuda_graph_max_bs_{role}") == g.cuda_graph_max_bs
    sp = s.speculative
    assert ns.speculative_algorithm == sp.algorithm
    assert (ns.speculative_num_steps, ns.speculative_eagle_topk, ns.speculative_num_draft_tokens) == (
        sp.num_steps, sp.eagle_topk, sp.num_draft_tokens)
    assert ns.speculative_moe_runner_backend == sp.moe_runner_backend
    assert ns.speculative_moe_a2a_backend == sp.moe_a2a_backend
    assert cmd.ready_path == "/health_generate"
    assert cmd.env["MC_FORCE_TCP"] == "1"  # no RDMA device in this profile


@pytest.mark.parametrize("path", SGLANG_CONFIGS, ids=os.path.basename)
def test_speculative_and_page_settings_match_between_roles(path):
    cfg = load_config(path)
    pre = vars(server_args_of(sglang_command(cfg, "prefill", "h", 1, 2)))
    dec = vars(server_args_of(sglang_command(cfg, "decode", "h", 3, None)))
    for key in ("page_size", "model_path", "kv_cache_dtype", "quantization") + tuple(k for k in pre if k.startswith("speculative_")):
        assert pre[key] == dec[key], key


def test_extra_args_pass_through_and_are_checked():
    base = {"engine": "sglang", "sglang": {"quantization": "fp8"}}
    ok = parse_config({**base, "decode": {"extra_args": ["--chunked-prefill-size", "2048", "--max-running-requests", "96"]}})
    ns = server_args_of(sglang_command(ok, "decode", "h", 1, None))
    assert (ns.chunked_prefill_size, ns.max_running_requests) == (2048, 96)
    with pytest.raises(SGLangArgError, match=r"unknown SGLang flag --max-runing-requests.*--max-running-requests"):
        plan(parse_config({**base, "decode": {"extra_args": ["--max-runing-requests", "96"]}}))
    with pytest.raises(SGLangArgError, match=r"ambiguous SGLang flag --speculative-moe.*--speculative-moe-a2a-backend"):
        parse_sglang_args(["--speculative-moe", "triton"])
    with pytest.raises(SGLangArgError, match="abbreviated SGLang flag --page-siz.*--page-size"):
        parse_sglang_args(["--page-siz", "64"])
    with pytest.raises(SGLangArgError, match="moe_runner_backend|--moe-runner-backend"):
        parse_sglang_args(["--moe-runner-backend", "no-such-backend"])


def test_plan_cli_prints_both_command_lines(capsys):
    from pd.plan import main

    assert main([SGLANG_CONFIGS[0]]) == 0
    out = capsys.readouterr().out
    assert out.count("sglang.launch_server") == 2
    assert "--disaggregation-mode prefill" in out and "--disaggregation-mode decode" in out
    assert main([SGLANG_CONFIGS[0], "--json"]) == 0
