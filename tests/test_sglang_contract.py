"""Contract tests: every SGLang command line we generate parses with the pinned SGLang's own
parser (ServerArgs.add_cli_args), with the values the config asked for."""

import ast
import glob
import json
import os
import re
import types
from pathlib import Path

import pytest

from engines import ROOT
from pd.commands.sglang import SGLangArgError, parse_sglang_args, pinned_sglang_version, server_args_of, sglang_command
from pd.config import load_config, parse_config
from pd.tools import doctor as D
from pd.tools.plan import plan

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
    speculative = tuple(k for k in pre if k.startswith("speculative_"))
    for key in ("page_size", "model_path", "kv_cache_dtype", "quantization") + speculative:
        assert pre[key] == dec[key], key


def test_extra_args_pass_through_and_are_checked():
    base = {"engine": "sglang", "sglang": {"quantization": "fp8"}}
    extra = ["--chunked-prefill-size", "2048", "--max-running-requests", "96"]
    ok = parse_config({**base, "decode": {"extra_args": extra}})
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
    from pd.tools.plan import main

    assert main([SGLANG_CONFIGS[0]]) == 0
    out = capsys.readouterr().out
    assert out.count("sglang.launch_server") == 2
    assert "--disaggregation-mode prefill" in out and "--disaggregation-mode decode" in out
    assert main([SGLANG_CONFIGS[0], "--json"]) == 0


# ---- facts `pdserve doctor` relies on, checked against the pinned source ----------------------------
def sglang_srt() -> Path:
    import sglang

    return Path(sglang.__file__).parent / "srt"


def method_source(rel: str, cls: str, name: str) -> str:
    """Source of ``cls.name`` in sglang/srt/``rel``, read with ast (these modules need GPU packages to import)."""
    tree = ast.parse((sglang_srt() / rel).read_text())
    c = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    return ast.unparse(next(n for n in c.body if isinstance(n, ast.FunctionDef) and n.name == name))


def test_mxfp4_expert_methods_are_the_backends_fp8config_wraps():
    src = method_source("layers/quantization/fp8.py", "Fp8Config", "get_quant_method")
    wrapped = set(re.findall(r"self\.is_fp4_experts and get_moe_runner_backend\(\)\.is_(\w+)\(\)", src))
    assert wrapped == set(D.FP4_EXPERT_METHODS)
    assert "get_platform().is_sm90 or get_platform().is_sm120" in src  # flashinfer_mxfp4: CUTLASS there, else TRT-LLM
    assert "is not compatible with SGLANG_DSV4_FP4_DEQUANT=1" in src and "is_auto()" in src
    marlin = (sglang_srt() / "layers/quantization/mxfp4_marlin_moe.py").read_text()
    assert "MXFP4 Marlin requires SM90 or SM120." in marlin and D.FP4_EXPERT_METHODS["marlin"] == (9, 12)
    # everything else is Fp8MoEMethod: auto (without DeepGEMM) and FlashInfer CUTLASS/CuteDSL become Triton,
    # whose quant info is FP8 w8a8 only
    runner = method_source("layers/quantization/fp8.py", "Fp8MoEMethod", "create_moe_runner")
    assert runner.count("moe_runner_backend = MoeRunnerBackend.TRITON") == 2 and "is_flashinfer_cutedsl()" in runner
    triton = method_source("layers/quantization/fp8.py", "Fp8MoEMethod", "get_triton_quant_info")
    assert "use_fp8_w8a8" in triton and "fp4" not in triton
    assert set(D.FP4_TO_TRITON_BACKENDS) == {"triton", "auto", "flashinfer_cutlass", "flashinfer_cutedsl"}


@pytest.fixture
def dsv4_override(monkeypatch):
    """SGLang's DeepSeek-V4 config override, on a stand-in platform (no GPU here): fn(arch, experts, **args)."""
    from sglang.srt.arg_groups.model_overrides import deepseek_v4 as O

    def call(arch, experts, **args):
        major = D.GpuInfo(arch).major
        monkeypatch.setattr(O, "get_platform", lambda: types.SimpleNamespace(
            is_hip=False, is_sm90=major == 9, is_sm100=major == 10, is_sm120=major == 12))
        monkeypatch.setattr(O, "model_config_of", lambda _: types.SimpleNamespace(
            nvfp4_moe_meta={"group_size": 16} if experts == "nvfp4" else None, is_fp4_experts=experts == "mxfp4"))
        sa = types.SimpleNamespace(**{"device": "cuda", "page_size": 64, "moe_runner_backend": "auto",
                                      "moe_a2a_backend": "none", "swa_full_tokens_ratio": 0.1,
                                      "fp8_gemm_runner_backend": "auto", **args})
        hf = types.SimpleNamespace(architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4",
                                   quantization_config={"quant_method": "fp8"})
        return sa, O._deepseek_v4_overrides(sa, hf)

    return call


def test_dsv4_runs_256_token_pages_whatever_page_size_says(dsv4_override):
    from sglang.srt.arg_groups.model_override_base import resolved_view

    sa, declared = dsv4_override("sm_120", "mxfp4", page_size=64)
    assert declared["page_size"] == D.DSV4_PAGE_SIZE
    sa._resolved_overrides = [("_deepseek_v4_overrides", declared)]  # what model_hook appends
    assert resolved_view(sa).page_size == D.DSV4_PAGE_SIZE  # the declaration wins over --page-size 64
    meta = (sglang_srt() / "layers/attention/dsv4/metadata.py").read_text()
    assert f"assert self.page_size == {D.DSV4_PAGE_SIZE}" in meta


CKPT = {"architectures": ["DeepseekV4ForCausalLM"], "hidden_size": 4096, "num_nextn_predict_layers": 1}


@pytest.mark.parametrize("arch", ["sm_89", "sm_90", "sm_100", "sm_120"])
@pytest.mark.parametrize("experts", ["mxfp4", "nvfp4"])
def test_doctor_resolves_auto_as_the_dsv4_override_does(tmp_path, dsv4_override, arch, experts):
    qc = ({"quant_method": "fp8", "routed_experts_quant_method": "mxfp4"} if experts == "mxfp4" else
          {"quant_method": "fp8", "quant_algo": "MIXED_PRECISION", "moe_quant_algo": "NVFP4", "group_size": 16})
    (tmp_path / "config.json").write_text(json.dumps({**CKPT, "quantization_config": qc}))
    cfg = parse_config({"engine": "sglang", "model_path": str(tmp_path), "sglang": {"quantization": "fp8"}})
    ctx = D.build_context(cfg, D.GpuInfo(arch), check_ports=False)
    _, declared = dsv4_override(arch, experts)
    for role in ("prefill", "decode"):
        assert D.resolve_target_moe(ctx, role)[0] == declared.get("moe_runner_backend", "auto")
