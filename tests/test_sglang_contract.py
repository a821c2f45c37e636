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
    assert cmd.env["SGLANG_HOST_IP"] == ns.host == "10.0.0.1"  # KV registered on the address peers reach


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


# ---- speculative settings the DeepSeek-V4 hook refuses: SGLang's own hook on our argv ------------------
def sglang_refuses_spec(cmd, model_type: str):
    """Run the pinned SGLang's DeepSeek-V4 hooks (arg_groups/deepseek_v4_hook.py: apply_deepseek_v4_defaults and
    validate_deepseek_v41_features, what model_hook.py runs for DeepseekV4ForCausalLM) on a ServerArgs built
    from our argv by SGLang's own from_cli_args; the error text, or None when it accepts.

    One stand-in: ``model_config_of`` (it builds ModelConfig, whose package imports torchvision and reads the
    checkpoint) returns the two config.json fields the hooks read. Everything else is SGLang's code on CPU.
    """
    from sglang.srt.arg_groups import deepseek_v4_hook as H
    from sglang.srt.arg_groups import overrides as O
    from sglang.srt.server_args import ServerArgs

    sa = ServerArgs.from_cli_args(server_args_of(cmd))
    mc = types.SimpleNamespace(hf_config=types.SimpleNamespace(architectures=["DeepseekV4ForCausalLM"],
                                                                model_type=model_type))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(H, "model_config_of", lambda _: mc)
        mp.setattr(O, "model_config_of", lambda _: mc)  # _deepseek_v4_kv_cache_dtype, run by the first hook
        try:
            H.apply_deepseek_v4_defaults(sa, "DeepseekV4ForCausalLM")
            H.validate_deepseek_v41_features(sa)
        except (AssertionError, ValueError) as e:
            return str(e)
    return None


SPEC_CASES = {  # id -> (speculative keys, extra_args of both groups, config.json model_type, SGLang refuses)
    "eagle": ({"algorithm": "EAGLE"}, [], "deepseek_v4", False),
    "nextn": ({"algorithm": "NEXTN"}, [], "deepseek_v4", True),
    "eagle3": ({"algorithm": "EAGLE3"}, [], "deepseek_v4", True),
    "eagle-topk2": ({"algorithm": "EAGLE", "eagle_topk": 2, "num_draft_tokens": 4}, [], "deepseek_v4", True),
    "nextn-topk2": ({"algorithm": "NEXTN", "eagle_topk": 2, "num_draft_tokens": 4}, [], "deepseek_v4", True),
    "dspark-extra": ({"algorithm": "EAGLE"}, ["--speculative-algorithm", "DSPARK"], "deepseek_v4", False),
    "eagle-lower-extra": ({"algorithm": "EAGLE"}, ["--speculative-algorithm", "eagle"], "deepseek_v4", True),
    "v41-eagle": ({"algorithm": "EAGLE"}, [], "deepseek_v41", True),
    "v41-nextn": ({"algorithm": "NEXTN"}, [], "deepseek_v41", True),
}


@pytest.mark.parametrize("path", SGLANG_CONFIGS, ids=os.path.basename)
@pytest.mark.parametrize("case", SPEC_CASES)
def test_doctor_refuses_the_speculative_settings_the_dsv4_hook_refuses(tmp_path, path, case):
    import yaml

    spec, extra, model_type, refused = SPEC_CASES[case]
    with open(path) as f:
        d = yaml.safe_load(f)
    (tmp_path / "config.json").write_text(json.dumps({**CKPT, "model_type": model_type,
                                                      "quantization_config": {"quant_method": "fp8"}}))
    d["model_path"] = str(tmp_path)
    d["sglang"]["speculative"] = {**(d["sglang"].get("speculative") or {}), **spec}
    for role in ("prefill", "decode"):
        d[role]["extra_args"] = list(d[role].get("extra_args") or []) + extra
    cfg = parse_config(d)
    for role in ("prefill", "decode"):
        cmd = sglang_command(cfg, role, "10.0.0.1", 31000, 8998 if role == "prefill" else None)
        why = sglang_refuses_spec(cmd, model_type)
        assert (why is not None) is refused, (role, why)
    findings = [f for f in D.run_checks(cfg, D.GpuInfo("sm_120"), check_ports=False) if f.check == "spec-model"]
    assert any(f.level == "error" for f in findings) is refused, findings
    if refused:  # naming the key (the config's, or the extra_args that set it)
        assert re.search(r"(sglang\.speculative\.\w+|extra_args) \(--speculative-[\w-]+\)", findings[0].message)


def test_non_dsv4_models_keep_nextn():
    """model_hook.py runs the DeepSeek-V4 hook for DeepseekV4ForCausalLM only, and NEXTN is SGLang's alias of EAGLE
    (speculative_hook.py _resolve_speculative_algorithm_alias)."""
    from sglang.srt.arg_groups.speculative_hook import _resolve_speculative_algorithm_alias

    assert _resolve_speculative_algorithm_alias("NEXTN", None) == "EAGLE"
    hook = (sglang_srt() / "arg_groups/model_hook.py").read_text()
    assert re.search(r'model_arch in \[\s*"DeepseekV4ForCausalLM",\s*\]:\s*from sglang\.srt\.arg_groups\.'
                     r'deepseek_v4_hook import \(\s*apply_deepseek_v4_defaults,', hook)
    assert hook.index("apply_deepseek_v4_defaults(server_args") > 0
    pipeline = (sglang_srt() / "arg_groups/pipeline.py").read_text()
    # the model hook (with the DeepSeek-V4 assert) runs before the alias is resolved
    assert pipeline.index("arg_groups.model_hook import") < pipeline.index("run_hook(handle_speculative_decoding")


# ---- the KV address: SGLang's own get_local_ip_auto with our env ---------------------------------------
def test_sglang_get_local_ip_auto_returns_the_workers_host(monkeypatch):
    """SGLang's KV manager (disaggregation/common/conn.py) and Mooncake register get_local_ip_auto(); with the
    env we give the worker it is the worker's --host, not the default route's interface."""
    import sys

    from pd.bench.sglang_serving import _load_file_alone

    _load_file_alone("sglang.srt.utils.network")  # the package __init__ imports torch
    network = sys.modules["sglang.srt.utils.network"]
    cfg = parse_config({"engine": "sglang", "sglang": {"quantization": "fp8"}})
    for role, host in (("prefill", "10.9.8.7"), ("decode", "fd00::7")):
        cmd = sglang_command(cfg, role, host, 31000, 8998 if role == "prefill" else None)
        assert server_args_of(cmd).host == host
        for k in ("SGLANG_HOST_IP", "HOST_IP", "SGLANG_LOCAL_IP_NIC"):
            monkeypatch.delenv(k, raising=False)
        assert network.get_local_ip_auto() != host  # what SGLang picks without it
        for k, v in cmd.env.items():
            monkeypatch.setenv(k, v)
        assert network.get_local_ip_auto() == host
    conn = (sglang_srt() / "disaggregation/common/conn.py").read_text()
    assert "self.local_ip = get_local_ip_auto()" in conn


def test_the_kv_layout_env_defaults_are_sglangs():
    from sglang.srt.environ import envs

    from pd.tools.doctor.checks_argv import PD_MATCHED_ENV

    for name, (default, kind, _) in PD_MATCHED_ENV.items():
        assert getattr(envs, name).default == default, name
    conn = (sglang_srt() / "disaggregation/common/conn.py").read_text()
    assert "SGLANG_DSV4_UNIFIED_KV_FP8 must be set the same on both sides" in conn
    assert "must use the same --dsv4-attn-backend and SGLANG_DSV4_KV_LAYOUT" in conn
    pool = (sglang_srt() / "mem_cache/deepseek_v4_memory_pool.py").read_text()
    assert "mode = envs.SGLANG_DSV4_KV_LAYOUT.get().lower()" in pool
    assert "option = envs.SGLANG_DSV4_COMPRESSED_KV_LAYOUT.get().lower()" in pool


def test_the_kv_address_env_follows_the_host_unless_the_group_picks_one():
    cfg = parse_config({"engine": "sglang", "sglang": {"quantization": "fp8"}})
    for host, want in (("192.168.7.2", "192.168.7.2"), ("127.0.0.1", "127.0.0.1"), ("fd00::2", "fd00::2"),
                       ("0.0.0.0", None), ("::", None), ("node-a.cluster", None)):
        cmd = sglang_command(cfg, "decode", host, 31000, None)
        assert server_args_of(cmd).host == host
        assert cmd.env.get("SGLANG_HOST_IP") == want, host
    for var in ("SGLANG_HOST_IP", "HOST_IP", "SGLANG_LOCAL_IP_NIC"):  # the group's own choice stands
        own = parse_config({"engine": "sglang", "sglang": {"quantization": "fp8"}, "decode": {"env": {var: "x"}}})
        env = sglang_command(own, "decode", "192.168.7.2", 31000, None).env
        assert env[var] == "x" and (var == "SGLANG_HOST_IP" or "SGLANG_HOST_IP" not in env)
        assert sglang_command(own, "prefill", "192.168.7.2", 31000, 1).env["SGLANG_HOST_IP"] == "192.168.7.2"


def test_sglang_refuses_a_list_rid_to_abort_request_with_a_status_the_router_falls_back_on():
    """The pinned SGLang's /abort_request takes one string ``rid`` and answers 400 to a list: the
    router's Aborter then aborts each id with a call of its own (pd.router.aborts), as the stand-in
    engine's ``abort_lists`` off models."""
    from typing import Optional

    import msgspec
    from pydantic import TypeAdapter, ValidationError
    from sglang.srt.utils.msgspec_utils import msgspec_struct_pydantic_core_schema

    from pd.router.aborts import LIST_REFUSED

    tree = ast.parse((sglang_srt() / "managers" / "io_struct.py").read_text())
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}

    def fields(cls: str) -> dict[str, tuple[str, str]]:
        return {f.target.id: (ast.unparse(f.annotation), ast.unparse(f.value)) for f in classes[cls].body
                if isinstance(f, ast.AnnAssign) and isinstance(f.target, ast.Name)}

    abort = classes["AbortReq"]
    assert [ast.unparse(b) for b in abort.bases] == ["BaseReq"]
    assert "rid" not in fields("AbortReq") and fields("BaseReq")["rid"] == ("Optional[str]", "None")

    class Rid(msgspec.Struct, kw_only=True):  # AbortReq's rid, validated by SGLang's own schema builder
        rid: Optional[str] = None

        @classmethod
        def __get_pydantic_core_schema__(cls, source, handler):
            return msgspec_struct_pydantic_core_schema(cls, handler)

    check = TypeAdapter(Rid)
    assert check.validate_json('{"rid": "pdr-1"}').rid == "pdr-1"
    with pytest.raises(ValidationError):
        check.validate_json('{"rid": ["pdr-1", "pdr-2"]}')
    # a validation error on /abort_request: the handler's last answer, 400 (its special cases are other paths)
    handler = next(n for n in ast.parse((sglang_srt() / "entrypoints" / "http_server.py").read_text()).body
                   if isinstance(n, ast.AsyncFunctionDef)
                   and any("exception_handler(RequestValidationError)" in ast.unparse(d) for d in n.decorator_list))
    last = ast.unparse(handler.body[-1])
    assert "status_code=400" in last, last
    assert "abort" not in ast.unparse(handler)
    assert 400 in LIST_REFUSED


def test_the_prompt_logprob_keys_the_router_merges_are_sglangs():
    """Each list the router moves from the prefill's answer to decode's is one SGLang's tokenizer manager fills."""
    from pd.router.logprobs import INPUT_KEYS

    src = (sglang_srt() / "managers" / "tokenizer_manager.py").read_text()
    filled = set(re.findall(r'meta_info\["(input_\w+)"\]\s*=', src))
    assert set(INPUT_KEYS) == filled, (INPUT_KEYS, filled)


def test_the_router_asks_workers_by_the_info_routes_current_names():
    """SGLang 0.5.23 serves /model_info and /server_info and marks the /get_* names deprecated; the router
    asks workers by the current names whichever the client used."""
    from pd.router.app import WORKER_INFO_PATH

    src = (sglang_srt() / "entrypoints" / "http_server.py").read_text()
    for old, new in WORKER_INFO_PATH.items():
        assert re.search(rf'@app\.(api_route|get)\("{new}"', src), new
        route = src[src.index(f'"{old}"'):]
        assert "deprecated" in route[:600], old


def test_launch_server_is_still_a_supported_entry_point():
    """Workers start with ``python -m sglang.launch_server`` (the worker's own interpreter); the pinned release
    warns that it is "still supported" and recommends the ``sglang serve`` console script, which has no
    ``python -m`` form. A release that drops the entry point fails here, not on a GPU box."""
    src = (sglang_srt().parent / "launch_server.py").read_text()
    assert "is still supported" in src and 'if __name__ == "__main__":' in src
    assert 'if __name__ == "__main__"' not in (sglang_srt().parent / "cli" / "main.py").read_text()
