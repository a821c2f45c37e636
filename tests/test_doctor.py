"""`pdserve doctor`: every preflight check refuses (or warns about) what it must, and passes the
shipped profiles. Fixture checkpoints are config.json files written in tmp_path."""

import copy
import json
import os
import socket
import stat

import pytest
import yaml

from engines import ROOT, free_port
from pd.config import ConfigError, parse_config
from pd.tools import doctor as D
from pd.tools.doctor import hardware

PROFILE = os.path.join(ROOT, "deploy", "dsv4-flash-rtxpro6000x8.yaml")
SM120, SM100, SM90, NOGPU = D.GpuInfo("sm_120"), D.GpuInfo("sm_100"), D.GpuInfo("sm_90"), D.GpuInfo()

DSV4_CONFIG = {  # the keys doctor reads, shaped like DeepSeek-V4-Flash's config.json
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "hidden_size": 4096,
    "num_nextn_predict_layers": 1, "max_position_embeddings": 1048576, "index_topk": 512,
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                            "activation_scheme": "dynamic", "routed_experts_quant_method": "mxfp4"},
}
# The campaign in docs/design.md ("Why it exists"): NVFP4 main experts, MTP (mtp.*) experts still MXFP4.
NVFP4_HYBRID = {**DSV4_CONFIG, "quantization_config": {"quant_method": "fp8", "quant_algo": "MIXED_PRECISION",
                                                       "moe_quant_algo": "NVFP4", "group_size": 16}}


def ckpt(tmp_path, name=None, **config):
    d = tmp_path / (name or next(f"ckpt{i}" for i in range(1000) if not (tmp_path / f"ckpt{i}").exists()))
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return str(d)


def safetensors_header(d, tensors, shard="model-00001-of-00002.safetensors"):
    """A shard holding only a safetensors header ({name: dtype}) plus the index that points at it."""
    header = json.dumps({k: {"dtype": t, "shape": [1], "data_offsets": [0, 1]} for k, t in tensors.items()}).encode()
    (d / shard).write_bytes(len(header).to_bytes(8, "little") + header + b"\0")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: shard for k in tensors}}))


def profile(tmp_path=None, model=None, **sglang):
    """The shipped DSv4 profile as a dict, on a free router port, optionally on a fixture checkpoint."""
    with open(PROFILE) as f:
        d = yaml.safe_load(f)
    d["router"]["port"] = free_port()
    if model is not None:
        d["model_path"] = ckpt(tmp_path, **model)
    for k, v in sglang.items():
        if k == "speculative":
            d["sglang"]["speculative"].update(v)
        else:
            d["sglang"][k] = v
    return d


def run(d, gpu=SM120, check_ports=False):
    return D.run_checks(parse_config(copy.deepcopy(d)), gpu, check_ports=check_ports)


def of(findings, check, level=None):
    return [f for f in findings if f.check == check and (level is None or f.level == level)]


def write_yaml(tmp_path, d, name="cfg.yaml"):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(d))
    return str(p)


# ---- the "done when" cases ---------------------------------------------------------------------
def test_shipped_profile_passes_on_sm120(tmp_path, capsys):
    from pd.cli import main as cli

    d = profile()
    with open(PROFILE) as f:
        shipped = yaml.safe_load(f)
    assert {**d, "router": shipped["router"]} == shipped  # only the router port differs
    with pytest.raises(SystemExit) as e:
        cli(["doctor", write_yaml(tmp_path, d), "--assume-gpu", "sm_120"])
    out = capsys.readouterr().out
    assert e.value.code == 0, out
    assert "0 error(s)" in out and "WARN  [model-config]" in out  # /models/... is not here: a warning
    # ...and the DeepSeek-V4 rules still apply (by model_path), with nothing to report
    assert "ok    [moe-fp4-experts] MXFP4 routed experts: the MoE backends in use load them on sm_120" in out
    assert "ok    [page-size] page_size 256" in out


@pytest.mark.parametrize("gpu", [SM120, SM100, SM90], ids=lambda g: g.arch)
def test_shipped_profile_is_right_without_the_plugin(tmp_path, gpu):
    """On the real checkpoint's config (MXFP4 experts, MTP layer), without pdserve's plugin taking the draft's
    MoE: no error and no MoE/page-size warning on any GPU generation the MXFP4 backends serve."""
    f = run(profile(tmp_path, DSV4_CONFIG, pdserve_kernels=False), gpu)
    assert D.exit_code(f) == 0, [x for x in f if x.level == "error"]
    for check in ("moe-backend-arch", "moe-fp4-experts", "spec-moe-backend", "page-size"):
        assert [x.level for x in of(f, check)] == ["ok"], of(f, check)


@pytest.mark.parametrize("spec_backend", ["flashinfer_trtllm", None])
@pytest.mark.parametrize("model", [DSV4_CONFIG, NVFP4_HYBRID], ids=["routed-mxfp4", "nvfp4-hybrid"])
def test_the_design_md_failure_is_refused_naming_both_causes(tmp_path, capsys, spec_backend, model):
    d = profile(tmp_path, model, quantization=None, speculative={"moe_runner_backend": spec_backend})
    code = D.main([write_yaml(tmp_path, d), "--assume-gpu", "sm_120"])
    out = capsys.readouterr().out
    assert code == 1, out
    # cause 1: the draft's MXFP4 MoE on an sm_100-only kernel (or left to auto on sm_120)
    draft_check = "moe-backend-arch" if spec_backend else "spec-moe-backend"
    assert f"ERROR [{draft_check}] sglang.speculative.moe_runner_backend (--speculative-moe-runner-backend)" in out
    assert "MXFP4" in out
    assert "fix: set sglang.speculative.moe_runner_backend: flashinfer_mxfp4" in out
    assert "moe_runner_backend: triton" not in out  # Triton's FP8 MoE cannot read MXFP4 experts
    # cause 2: quantization left to auto-detection, fix names the checkpoint's value
    assert "ERROR [quantization] sglang.quantization (--quantization) is unset" in out
    assert "fix: set sglang.quantization: fp8 (the checkpoint's config.json quantization_config.quant_method)" in out


def test_local_yaml_reference_engine_passes(tmp_path, capsys):
    with open(os.path.join(ROOT, "deploy", "local.yaml")) as f:
        d = yaml.safe_load(f)
    d["router"]["port"] = free_port()
    assert D.main([write_yaml(tmp_path, d)]) == 0
    out = capsys.readouterr().out
    assert "0 error(s), 0 warning(s)" in out and "reference engine needs no GPU" in out


def test_reference_engine_model_path(tmp_path):
    """The reference engine's model_path: a known built-in, or a checkpoint directory with config.json."""
    def model_findings(path):
        return of(run({"model_path": path, "engine": "reference"}, gpu=NOGPU), "model-config")

    assert [f.level for f in model_findings("builtin:tiny")] == ["ok"]
    (bad_builtin,) = model_findings("builtin:huge")
    assert bad_builtin.level == "error" and "builtin:huge" in bad_builtin.message and "builtin:tiny" in bad_builtin.fix
    (missing,) = model_findings(str(tmp_path / "nowhere"))  # may exist on the engine nodes only
    assert missing.level == "warning" and "not a directory" in missing.message
    empty = tmp_path / "empty"
    empty.mkdir()
    (no_config,) = model_findings(str(empty))
    assert no_config.level == "error" and "no config.json" in no_config.message
    assert [f.level for f in model_findings(ckpt(tmp_path, architectures=["LlamaForCausalLM"]))] == ["ok"]


def test_bad_yaml_is_one_finding_with_its_line(tmp_path, capsys):
    p = tmp_path / "bad.yaml"
    p.write_text("model_path: builtin:tiny\nrouter: {port: 8000\n")
    assert D.main([str(p)]) == 2
    out = capsys.readouterr().out
    assert out.count("ERROR") == 1 and "<unicode string>" not in out, out
    assert f"{p}: invalid YAML: line 3, column 1: " in out and "at line 2, column 9" in out, out
    assert "fix: fix the YAML at that line" in out


def test_json_output(tmp_path, capsys):
    d = profile(tmp_path, DSV4_CONFIG, quantization=None)
    assert D.main([write_yaml(tmp_path, d), "--assume-gpu", "12.0", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["exit_code"] == 1 and data["gpu"]["arch"] == "sm_120"
    assert {"level": "error", "check": "quantization"}.items() <= data["findings"][
        [f["check"] for f in data["findings"]].index("quantization")].items()


def test_cli_usage_lists_doctor():
    from pd.cli import USAGE

    assert "doctor" in USAGE and "--assume-gpu" in USAGE


@pytest.mark.slow
def test_cli_version_and_a_closed_pipe():
    """``pdserve --version``; a reader that closes early (``pdserve plan --json | head``) is a quiet
    exit 1, not a BrokenPipeError traceback."""
    import subprocess
    import sys
    from importlib.metadata import version

    r = subprocess.run([sys.executable, "-m", "pd.cli", "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == f"pdserve {version('pdserve')}"
    p = subprocess.Popen([sys.executable, "-m", "pd.cli", "plan", "--json", PROFILE], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    p.stdout.close()  # before the plan is printed
    err = p.stderr.read()
    assert p.wait(timeout=60) == 1 and "Traceback" not in err and "BrokenPipeError" not in err, err


# ---- 1. GPU architecture -----------------------------------------------------------------------
def test_parse_arch():
    for text in ("sm_120", "sm120", "SM_120a", "12.0", "120"):
        assert D.parse_arch(text) == "sm_120"
    assert D.parse_arch("9.0") == "sm_90" and D.GpuInfo("sm_100").major == 10
    with pytest.raises(ValueError):
        D.parse_arch("blackwell")
    with pytest.raises(SystemExit):
        D.main([PROFILE, "--assume-gpu", "blackwell"])


def test_detect_gpu_from_nvidia_smi_then_nothing(tmp_path, monkeypatch):
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\n[ \"$1\" = --query-gpu=compute_cap ] && printf '12.0\\n12.0\\n12.0\\n12.0\\n'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", str(fake.parent))
    assert D.detect_gpu() == D.GpuInfo("sm_120", 4, "nvidia-smi")
    assert D.detect_gpu("sm_90") == D.GpuInfo("sm_90", None, "--assume-gpu")
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    monkeypatch.setattr(hardware, "_from_torch", lambda: None)  # a CPU machine
    assert D.detect_gpu() == D.GpuInfo()


def test_no_gpu_skips_the_architecture_checks(tmp_path):
    f = run(profile(tmp_path, DSV4_CONFIG, moe_runner_backend="flashinfer_trtllm"), NOGPU)
    assert of(f, "gpu-arch")[0].message.startswith("skipped")
    assert [x.level for x in of(f, "moe-backend-arch")] == ["ok"] and "skipped" in of(f, "moe-backend-arch")[0].message


# ---- 2. the model's config.json ----------------------------------------------------------------
def test_read_model_info_keys(tmp_path):
    m = D.read_model_info(ckpt(tmp_path, "a", **DSV4_CONFIG))
    assert (m.quant_method, m.experts_quant, m.draft_experts_quant, m.mtp_layers, m.hidden_size, m.dsa) == (
        "fp8", "mxfp4", "mxfp4", 1, 4096, True)
    h = D.read_model_info(ckpt(tmp_path, "b", **NVFP4_HYBRID))
    assert (h.quant_method, h.experts_quant, h.draft_experts_quant) == ("fp8", "nvfp4", "mxfp4")
    dflt = D.read_model_info(ckpt(tmp_path, "c", architectures=["DeepseekV4ForCausalLM"],
                                  quantization_config={"quant_method": "fp8"}))
    assert dflt.draft_experts_quant == "mxfp4" and "SGLang default" in dflt.draft_experts_source
    # without routed_experts_quant_method SGLang reads one routed expert's dtype from the safetensors header
    for dtype, want in (("U8", "mxfp4"), ("I8", "mxfp4"), ("F8_E4M3", "fp8")):
        d = tmp_path / f"hdr-{dtype}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"architectures": ["DeepseekV4ForCausalLM"],
                                                   "quantization_config": {"quant_method": "fp8"}}))
        safetensors_header(d, {"model.embed_tokens.weight": "BF16", "model.layers.0.ffn.experts.0.w2.weight": dtype})
        m = D.read_model_info(d)
        assert (m.experts_quant, m.draft_experts_quant) == (want, want) and f"is {dtype}" in m.experts_source
    mo = D.read_model_info(ckpt(tmp_path, "d", architectures=["LlamaForCausalLM"],
                                quantization_config={"quant_method": "modelopt", "quant_algo": "NVFP4"}))
    assert (mo.quant_method, mo.experts_quant, mo.dsa, mo.mtp_layers) == ("modelopt_fp4", "modelopt_fp4", False, 0)
    hq = tmp_path / "e"
    hq.mkdir()
    (hq / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (hq / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "FP8"}}))
    assert D.read_model_info(hq).quant_method == "modelopt_fp8"
    with pytest.raises(D.ModelConfigError):
        D.read_model_info(tmp_path / "missing")


def test_missing_checkpoint_is_a_warning_never_an_error(tmp_path):
    d = profile()
    d["model_path"] = str(tmp_path / "nowhere")
    f = run(d)
    assert [x.level for x in of(f, "model-config")] == ["warning"]
    assert D.exit_code(f) == 0
    empty = tmp_path / "empty"
    empty.mkdir()  # a directory without config.json
    d["model_path"] = str(empty)
    assert [x.level for x in of(run(d), "model-config")] == ["warning"]


# ---- 3a. sm_100-only MoE kernels ---------------------------------------------------------------
def test_sm100_only_moe_backends_are_refused_off_sm100(tmp_path):
    d = profile(tmp_path, DSV4_CONFIG, moe_runner_backend="flashinfer_trtllm")
    err = of(run(d, SM120), "moe-backend-arch", "error")
    assert len(err) == 1 and "sglang.moe_runner_backend (--moe-runner-backend) is flashinfer_trtllm" in err[0].message
    assert err[0].fix == ("set sglang.moe_runner_backend: flashinfer_mxfp4 (MXFP4 experts on FlashInfer CUTLASS "
                          "MXFP8 x MXFP4 kernels for sm_120)")
    assert not of(run(d, SM100), "moe-backend-arch", "error")
    (err,) = of(run(d, SM90), "moe-backend-arch", "error")  # not sm_100 either
    assert err.fix.startswith("set sglang.moe_runner_backend: flashinfer_mxfp4 (MXFP4 experts on FlashInfer "
                              "CUTLASS kernels")
    fp8 = profile(tmp_path, {**DSV4_CONFIG, "architectures": ["DeepseekV3ForCausalLM"],
                             "quantization_config": {"quant_method": "fp8"}},
                  moe_runner_backend="flashinfer_trtllm")  # FP8 experts: Triton is the portable choice
    assert (of(run(fp8, SM120), "moe-backend-arch", "error")[0].fix
            == "set sglang.moe_runner_backend: triton (runs on sm_120)")
    d = profile(speculative={"moe_runner_backend": "flashinfer_trtllm_routed"})
    err = of(run(d, SM120), "moe-backend-arch", "error")
    assert len(err) == 1 and "the draft (MTP) MoE" in err[0].message
    # set through a group's extra_args, on one role only
    d = profile()
    d["decode"]["extra_args"] = ["--moe-runner-backend", "flashinfer_megamoe"]
    err = of(run(d, SM120), "moe-backend-arch", "error")
    assert len(err) == 1 and err[0].message.startswith(
        "decode.extra_args (--moe-runner-backend) is flashinfer_megamoe on decode")
    d = profile(moe_runner_backend="hpc_ops")  # SM90-only
    assert of(run(d, SM120), "moe-backend-arch", "error") and not of(run(d, SM90), "moe-backend-arch", "error")
    # auto is resolved as SGLang resolves it: the FP8+NVFP4 hybrid gets flashinfer_trtllm_routed (sm_100-only)
    d = profile(tmp_path, NVFP4_HYBRID, moe_runner_backend=None, speculative={"moe_runner_backend": None})
    (err,) = of(run(d, SM120), "moe-backend-arch", "error")
    assert ("is auto (SGLang's DeepSeek-V4 override picks it for the FP8+NVFP4 hybrid checkpoint: "
            "flashinfer_trtllm_routed)") in err.message
    assert "the draft inherits it" in err.message
    assert not of(run(d, SM100), "moe-backend-arch", "error")


# ---- 3a'. MXFP4 routed experts -----------------------------------------------------------------
def test_mxfp4_experts_under_triton_are_refused(tmp_path):
    """Triton's fused MoE is FP8/BF16: SGLang hands it MXFP4 experts through Fp8MoEMethod ("Hidden size mismatch")."""
    d = profile(tmp_path, DSV4_CONFIG, moe_runner_backend="triton", speculative={"moe_runner_backend": "triton"},
                pdserve_kernels=False)
    for gpu in (SM120, SM100, SM90, NOGPU):  # no GPU generation reads packed e2m1 as FP8
        err = of(run(d, gpu), "moe-fp4-experts", "error")
        assert [e.message.split(" (")[0] for e in err] == ["sglang.moe_runner_backend",
                                                           "sglang.speculative.moe_runner_backend"]
        assert all("routed experts are MXFP4" in e.message and "Hidden size mismatch" in e.message for e in err)
    err = of(run(d, SM120), "moe-fp4-experts", "error")
    assert [e.fix.split(" (")[0] for e in err] == ["set sglang.moe_runner_backend: flashinfer_mxfp4",
                                                   "set sglang.speculative.moe_runner_backend: flashinfer_mxfp4"]
    # backends that become Triton for these layers, and the draft's explicit auto (SGLang's DSv4 override
    # resolves only the target's auto)
    for spec in ("flashinfer_cutlass", "auto"):
        bad = profile(tmp_path, None, speculative={"moe_runner_backend": spec}, pdserve_kernels=False)
        bad["model_path"] = d["model_path"]
        (e,) = of(run(bad, SM120), "moe-fp4-experts", "error")
        assert e.message.startswith(
            f"sglang.speculative.moe_runner_backend (--speculative-moe-runner-backend) is {spec}")
    # the same backends on FP8 experts (a converted checkpoint: the safetensors header says F8_E4M3) are fine
    fp8 = tmp_path / "fp8-experts"
    fp8.mkdir()
    (fp8 / "config.json").write_text(json.dumps({**DSV4_CONFIG, "quantization_config": {"quant_method": "fp8"}}))
    safetensors_header(fp8, {"model.layers.3.ffn.experts.7.w1.weight": "F8_E4M3"})
    d["model_path"] = str(fp8)
    assert [x.level for x in of(run(d, SM120), "moe-fp4-experts")] == ["ok"]
    # no checkpoint here, but model_path names DeepSeek-V4: a warning (a guess), still naming the fix
    guess = profile(moe_runner_backend="triton", speculative={"moe_runner_backend": "triton"}, pdserve_kernels=False)
    f = of(run(guess, SM120), "moe-fp4-experts")
    assert [x.level for x in f] == ["warning", "warning"] and all("names DeepSeek-V4" in x.message for x in f)


@pytest.mark.parametrize("backend,ok_on,bad_on", [
    ("flashinfer_mxfp4", ("sm_90", "sm_100", "sm_120"), ("sm_89",)),  # CUTLASS sm_90/sm_12x, TRT-LLM sm_100
    ("marlin", ("sm_90", "sm_120"), ("sm_100", "sm_89")),                 # Mxfp4MarlinMoEMethod raises elsewhere
    ("humming", ("sm_90", "sm_100", "sm_120"), ()),
])
def test_mxfp4_expert_backends_by_gpu_generation(tmp_path, backend, ok_on, bad_on):
    d = profile(tmp_path, DSV4_CONFIG, moe_runner_backend=backend, speculative={"moe_runner_backend": backend},
                pdserve_kernels=False)
    for arch in ok_on:
        assert [x.level for x in of(run(d, D.GpuInfo(arch)), "moe-fp4-experts")] == ["ok"], arch
    for arch in bad_on:
        err = of(run(d, D.GpuInfo(arch)), "moe-fp4-experts", "error")
        assert len(err) == 2 and f"{backend}'s MXFP4 MoE method runs on" in err[0].message, arch
    if backend == "flashinfer_mxfp4":  # nothing MXFP4 runs on sm_89: dequantize to FP8
        assert "auto and SGLANG_DSV4_FP4_DEQUANT: '1'" in of(run(d, D.GpuInfo("sm_89")), "moe-fp4-experts",
                                                             "error")[0].fix


def test_mxfp4_target_left_to_auto_and_dequantization(tmp_path):
    # auto: SGLang's DeepSeek-V4 override picks flashinfer_mxfp4 on sm_90/sm_100/sm_120; an unset draft inherits it
    d = profile(tmp_path, DSV4_CONFIG, moe_runner_backend=None, speculative={"moe_runner_backend": None},
                pdserve_kernels=False)
    for gpu in (SM120, SM100, SM90):
        assert [x.level for x in of(run(d, gpu), "moe-fp4-experts")] == ["ok"]
    err = of(run(d, D.GpuInfo("sm_89")), "moe-fp4-experts", "error")  # there auto stays auto: Triton
    assert len(err) == 2 and "is auto on both roles" in err[0].message
    # SGLANG_DSV4_FP4_DEQUANT=1 dequantizes the experts to FP8 and SGLang asserts the backend is auto
    deq = copy.deepcopy(d)
    for role in ("prefill", "decode"):
        deq[role]["env"] = {"SGLANG_DSV4_FP4_DEQUANT": "1"}
    assert [x.level for x in of(run(deq, D.GpuInfo("sm_89")), "moe-fp4-experts")] == ["ok"]
    deq["sglang"]["speculative"]["moe_runner_backend"] = "flashinfer_mxfp4"
    (e,) = of(run(deq, SM120), "moe-fp4-experts", "error")
    assert "is not compatible with SGLANG_DSV4_FP4_DEQUANT=1" in e.message
    assert e.fix.startswith("set sglang.speculative.moe_runner_backend: auto")


def test_pdserve_plugin_takes_the_drafts_mxfp4_moe_on_sm120(tmp_path):
    d = profile(tmp_path, DSV4_CONFIG, speculative={"moe_runner_backend": "triton"}, pdserve_kernels=True)
    (w,) = of(run(d, SM120), "moe-fp4-experts")
    assert w.level == "warning" and "pdserve's plugin" in w.message and "not without the plugin" in w.message
    assert w.fix.startswith("set sglang.speculative.moe_runner_backend: flashinfer_mxfp4")
    assert of(run(d, SM90), "moe-fp4-experts", "error")  # the plugin serves sm_12x only
    d["sglang"]["pdserve_kernels"] = {"mxfp4_moe": False}
    assert of(run(d, SM120), "moe-fp4-experts", "error")


# ---- 3b. draft MoE backend left to auto --------------------------------------------------------
@pytest.mark.parametrize("value", [None, "auto"])
def test_speculative_moe_backend_must_be_explicit(tmp_path, value):
    d = profile(tmp_path, DSV4_CONFIG, speculative={"moe_runner_backend": value})
    (e,) = of(run(d, SM120), "spec-moe-backend")
    assert e.level == "error" and e.fix.startswith("set sglang.speculative.moe_runner_backend: flashinfer_mxfp4")
    assert [x.level for x in of(run(d, SM100), "spec-moe-backend")] == ["warning"]
    assert [x.level for x in of(run(d, NOGPU), "spec-moe-backend")] == ["warning"]
    assert [x.level for x in of(run(profile()), "spec-moe-backend")] == ["ok"]
    no_spec = profile()
    del no_spec["sglang"]["speculative"]
    assert of(run(no_spec), "spec-moe-backend")[0].message == "no speculative decoding"


# ---- 3c. quantization --------------------------------------------------------------------------
def test_quantization_left_to_auto_detection_is_refused(tmp_path):
    f = of(run(profile(quantization=None)), "quantization")  # no checkpoint here: a generic fix
    assert [x.level for x in f] == ["error"] and "quantization_config.quant_method" in f[0].fix
    mo = {"architectures": ["X"], "quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}}
    f = of(run(profile(tmp_path, mo, quantization=None)), "quantization")
    assert f[0].level == "error" and f[0].fix.startswith("set sglang.quantization: modelopt_fp4")
    bf16 = profile(quantization=None)
    bf16["model_path"] = ckpt(tmp_path, "bf16", architectures=["X"])
    assert of(run(bf16), "quantization")[0].fix.startswith("set sglang.quantization: unquant")
    mismatch = profile(quantization="fp8")
    mismatch["model_path"] = ckpt(tmp_path, "nvfp4", **mo)
    f = of(run(mismatch), "quantization")
    assert [x.level for x in f] == ["warning"] and "checkpoint says modelopt_fp4" in f[0].message
    assert [x.level for x in of(run(profile()), "quantization")] == ["ok"]


# ---- 3d. the draft -----------------------------------------------------------------------------
def test_draft_hidden_size_mismatch_is_refused(tmp_path):
    draft = ckpt(tmp_path, "draft", **{**DSV4_CONFIG, "hidden_size": 2048})
    d = profile(tmp_path, DSV4_CONFIG, speculative={"draft_model_path": draft})
    err = of(run(d), "draft", "error")
    assert len(err) == 1 and "hidden_size 2048" in err[0].message and "target's 4096" in err[0].message
    d["sglang"]["speculative"]["draft_model_path"] = ckpt(tmp_path, "draft2", **DSV4_CONFIG)
    assert not of(run(d), "draft", "error")


def test_speculative_without_a_draft_and_dsv4_topk(tmp_path):
    d = profile(tmp_path, {**DSV4_CONFIG, "num_nextn_predict_layers": 0})
    err = of(run(d), "draft", "error")
    assert len(err) == 1 and "num_nextn_predict_layers" in err[0].message
    d = profile(speculative={"eagle_topk": 2, "num_draft_tokens": 4})
    d["model_path"] = ckpt(tmp_path, "topk", **DSV4_CONFIG)
    f = run(d)
    assert not of(f, "draft", "error")
    err = of(f, "spec-model", "error")
    assert len(err) == 1 and err[0].message.startswith("sglang.speculative.eagle_topk (--speculative-eagle-topk) "
                                                       "is 2 on both roles: SGLang allows EAGLE only with eagle_topk 1")
    assert err[0].fix == "set sglang.speculative.eagle_topk: 1"


# ---- 3d-spec. speculative settings the model refuses (SGLang's DeepSeek-V4 hook) -----------------------
@pytest.mark.parametrize("algorithm", ["NEXTN", "EAGLE3"])
@pytest.mark.parametrize("key", ["sglang.speculative", "speculative"])
def test_dsv4_refuses_nextn_and_eagle3_through_the_cli(tmp_path, capsys, algorithm, key):
    from pd.cli import main as cli

    d = profile(tmp_path, DSV4_CONFIG, speculative={"algorithm": algorithm})
    if key == "speculative":
        d["speculative"] = d["sglang"].pop("speculative")
    with pytest.raises(SystemExit) as e:
        cli(["doctor", write_yaml(tmp_path, d), "--assume-gpu", "sm_120"])
    out = capsys.readouterr().out
    assert e.value.code == 1, out
    assert (f"ERROR [spec-model] {key}.algorithm (--speculative-algorithm) is {algorithm} on both roles: the pinned "
            "SGLang allows only EAGLE or DSPARK for DeepseekV4ForCausalLM") in out
    assert ("before it resolves the NEXTN alias to EAGLE" in out) is (algorithm == "NEXTN")
    assert f"set {key}.algorithm: EAGLE" in out
    assert out.count("ERROR") == 1, out  # nothing else in the profile is wrong
    block = d["speculative"] if key == "speculative" else d["sglang"]["speculative"]
    block["algorithm"] = "EAGLE"
    assert D.main([write_yaml(tmp_path, d, "eagle.yaml"), "--assume-gpu", "sm_120"]) == 0


def test_nextn_stays_allowed_for_other_models_and_the_reference_engine(tmp_path):
    v3 = {**DSV4_CONFIG, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}
    f = run(profile(tmp_path, v3, speculative={"algorithm": "NEXTN"}))
    assert [x.level for x in of(f, "spec-model")] == ["ok"]
    cfg = parse_config({"speculative": {"algorithm": "NEXTN"}})  # the reference engine drafts NEXTN
    assert not [x for x in D.run_checks(cfg, NOGPU, check_ports=False) if x.level == "error"]


def test_dsv4_algorithm_set_by_extra_args_is_named(tmp_path):
    d = profile(tmp_path, DSV4_CONFIG)
    d["decode"]["extra_args"] = ["--speculative-algorithm", "NEXTN"]
    err = of(run(d), "spec-model", "error")
    assert len(err) == 1 and err[0].message.startswith("decode.extra_args (--speculative-algorithm) is NEXTN on "
                                                       "decode: ")
    d["decode"]["extra_args"] = ["--speculative-algorithm", "DSPARK"]  # SGLang's other allowed value
    assert not of(run(d), "spec-model", "error")


def test_dsv41_allows_only_dspark(tmp_path):
    v41 = {**DSV4_CONFIG, "model_type": "deepseek_v41"}
    err = of(run(profile(tmp_path, v41)), "spec-model", "error")
    assert len(err) == 1 and ("is EAGLE on both roles: SGLang refuses speculative decoding other than DSPARK for "
                              "DeepSeek-V4.1 (config.json model_type deepseek_v41") in err[0].message
    assert err[0].fix.startswith("remove sglang.speculative")
    d = profile(tmp_path, v41)
    del d["sglang"]["speculative"]
    assert of(run(d), "spec-model") == []


def test_a_guessed_dsv4_only_warns():
    f = run(profile(speculative={"algorithm": "NEXTN"}))  # /models/DeepSeek-V4-Flash: named, not read
    assert [x.level for x in of(f, "spec-model")] == ["warning"]
    assert "names DeepSeek-V4 (its config.json was not read here)" in of(f, "spec-model")[0].message


# ---- 3d-env. KV-layout environment variables -----------------------------------------------------------
def test_kv_layout_env_must_match_between_roles():
    d = profile()
    d["prefill"]["env"] = {"SGLANG_DSV4_UNIFIED_KV_FP8": "1"}
    err = of(run(d), "pd-env", "error")
    assert len(err) == 1 and err[0].message.startswith(
        "SGLANG_DSV4_UNIFIED_KV_FP8 differs: prefill.env '1', decode.env unset (SGLang's default False)")
    d["decode"]["env"] = {"SGLANG_DSV4_UNIFIED_KV_FP8": "true", "SGLANG_DSV4_KV_LAYOUT": "v41"}
    d["prefill"]["env"]["SGLANG_DSV4_KV_LAYOUT"] = "auto"
    err = of(run(d), "pd-env", "error")  # "1" and "true" read the same; auto and v41 do not
    assert len(err) == 1 and "SGLANG_DSV4_KV_LAYOUT differs: prefill.env 'auto', decode.env 'v41'" in err[0].message
    d["prefill"]["env"]["SGLANG_DSV4_KV_LAYOUT"] = "V41"  # SGLang lower-cases it
    d["decode"]["env"]["SGLANG_DSV4_COMPRESSED_KV_LAYOUT"] = "auto"  # its default, set explicitly
    assert [x.level for x in of(run(d), "pd-env")] == ["ok"]
    d["decode"]["env"]["SGLANG_DSV4_COMPRESSED_KV_LAYOUT"] = "fp4"
    err = of(run(d), "pd-env", "error")
    assert len(err) == 1 and "prefill.env unset (SGLang's default 'auto'), decode.env 'fp4'" in err[0].message


# ---- 3d'. page size ----------------------------------------------------------------------------
def test_dsv4_page_size_other_than_256_is_reported(tmp_path):
    """SGLang replaces a DeepSeek-V4 --page-size with 256 (the dsv4 attention asserts it): say so."""
    d = profile(tmp_path, DSV4_CONFIG)
    assert [x.level for x in of(run(d), "page-size")] == ["ok"]
    d["page_size"] = 64
    (w,) = of(run(d), "page-size")
    assert w.level == "warning" and w.message.startswith("page_size (--page-size) is 64 on both roles")
    assert "runs 256-token KV pages" in w.message and w.fix == "set page_size: 256"
    guess = profile()  # no checkpoint here: model_path names DeepSeek-V4
    guess["decode"]["extra_args"] = ["--page-size", "64"]
    (w,) = of(run(guess), "page-size", "warning")
    assert w.message.startswith("decode.extra_args (--page-size) is 64 on decode") and "names DeepSeek-V4" in w.message
    llama = profile(tmp_path, {"architectures": ["LlamaForCausalLM"]}, quantization="unquant")
    llama["page_size"] = 64
    assert [x.level for x in of(run(llama), "page-size")] == ["ok"]


# ---- 3e/3i. prefill vs decode ------------------------------------------------------------------
@pytest.mark.parametrize("flag,value", [("--page-size", "32"), ("--model-path", "/models/other"),
                                        ("--kv-cache-dtype", "bf16")])
def test_settings_that_must_match_between_roles(flag, value):
    d = profile()
    d["decode"]["extra_args"] = [flag, value]
    err = of(run(d), "pd-consistency", "error")
    assert len(err) == 1 and err[0].message.startswith(f"{flag} differs") and "decode.extra_args" in err[0].message


def test_tp_may_differ_between_prefill_and_decode():
    d = profile()
    d["decode"].update(tp_size=2, gpus=[[4, 5]])
    f = run(d)
    assert D.exit_code(f) == 0
    assert "TP differs (prefill 4, decode 2): allowed" in of(f, "pd-consistency")[0].message


# ---- 3f. GPUs ----------------------------------------------------------------------------------
def test_overlapping_gpus_are_a_finding_not_a_crash(tmp_path):
    d = profile()
    d["decode"]["gpus"] = [[3, 4, 5, 6]]
    findings, code, _ = D.doctor(write_yaml(tmp_path, d), "sm_120")
    assert code == 2 and findings[0].level == "error" and findings[0].check == "config"
    assert "decode.gpus[0]: GPU 3 is also used by prefill.gpus[0]" in findings[0].message
    assert D.main([str(tmp_path / "nope.yaml")]) == 2


def test_missing_gpus():
    d = profile()
    f = of(run(d, D.GpuInfo("sm_120", 4, "nvidia-smi")), "gpus")
    assert [x.level for x in f] == ["error", "warning"]
    assert "decode.gpus[0]: GPU ids [4, 5, 6, 7] do not exist" in f[0].message
    assert "cluster.num_gpus=8" in f[1].message
    assert [x.level for x in of(run(d, D.GpuInfo("sm_120", 8, "nvidia-smi")), "gpus")] == ["ok"]
    d["cluster"] = {"num_gpus": 16, "gpus_per_node": 8}  # two nodes: ids index a node's GPUs
    d["decode"]["gpus"] = [[8, 9, 10, 11]]
    f = of(run(d), "gpus", "error")
    assert len(f) == 1 and "not below cluster.gpus_per_node=8" in f[0].message


# ---- 3g. ports ---------------------------------------------------------------------------------
def test_router_port_in_use_is_refused():
    d = profile()
    d["router"]["host"] = "127.0.0.1"
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        s.listen()
        d["router"]["port"] = s.getsockname()[1]
        f = of(run(d, check_ports=True), "router-port")
        assert (f[0].level == "error"
                and f"router.port {d['router']['port']} on 127.0.0.1 is already in use" in f[0].message)
    assert of(run(d, check_ports=True), "router-port")[0].level == "ok"
    d["router"]["host"] = "192.0.2.1"  # TEST-NET: not this machine's
    assert "not an address of this machine" in of(run(d, check_ports=True), "router-port")[0].message


def test_router_port_of_a_running_pdserve_router_is_a_warning(tmp_path):
    """The config's cluster already up: its router holds the port. That is a warning naming it, not an error."""
    from routers import RouterProc

    router = RouterProc(["--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:10",
                         "--health-check-interval-secs", "0"], str(tmp_path))
    try:
        router.wait_ready()
        d = profile()
        d["router"].update(host="127.0.0.1", port=router.port)
        f = of(run(d, check_ports=True), "router-port")
    finally:
        router.stop()
    assert len(f) == 1 and f[0].level == "warning", f
    assert f"router.port {router.port}" in f[0].message and "running pdserve router" in f[0].message


def test_launch_stops_on_errors_before_ray(tmp_path, capsys, monkeypatch):
    import sys
    import types

    from pd.cluster import launch

    def no_ray(*a, **k):
        raise AssertionError("the launch reached ray.init")

    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(init=no_ray))
    with open(os.path.join(ROOT, "deploy", "local.yaml")) as f:
        d = yaml.safe_load(f)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        d["router"]["port"] = s.getsockname()[1]
        assert launch.main([write_yaml(tmp_path, d)]) == 2
    err = capsys.readouterr().err
    assert "ERROR [router-port]" in err and "preflight checks failed" in err


# ---- 3h. flags the pinned parser refuses -------------------------------------------------------
def test_unknown_extra_flag_is_refused_with_candidates(monkeypatch):
    d = profile()
    d["prefill"]["extra_args"] = ["--max-runing-requests", "8"]
    err = of(run(d), "engine-args", "error")
    assert len(err) == 1 and err[0].message.startswith(
        "prefill: prefill.extra_args: unknown SGLang flag --max-runing-requests")
    assert "--max-running-requests" in err[0].message

    import pd.commands.sglang as sg

    def unavailable(_cmd):
        raise RuntimeError("checking SGLang flags needs the pinned sglang==0.5.23 importable")

    monkeypatch.setattr(sg, "server_args_of", unavailable)
    f = run(profile())
    assert [x.level for x in of(f, "engine-args")] == ["warning", "warning"] and D.exit_code(f) == 0


# ---- 4. warnings -------------------------------------------------------------------------------
def test_context_length_far_above_need_with_the_stock_indexer(tmp_path):
    stock = {"pdserve_kernels": False}  # the shipped profile switches the pdserve indexer on
    f = of(run(profile(tmp_path, DSV4_CONFIG, context_length=None, **stock)), "context-length")
    assert [x.level for x in f] == ["warning"] and "1048576 from config.json max_position_embeddings" in f[0].message
    assert "pdserve_kernels" in f[0].fix
    assert of(run(profile(context_length=131072, **stock)), "context-length")[0].level == "warning"
    assert of(run(profile(context_length=65536, **stock)), "context-length")[0].level == "ok"
    assert of(run(profile(context_length=131072, pdserve_kernels=True)), "context-length")[0].level == "ok"
    assert of(run(profile(context_length=131072, pdserve_kernels={"indexer": False})),
              "context-length")[0].level == "warning"
    llama = profile(context_length=None, **stock)
    llama["model_path"] = ckpt(tmp_path, "llama", architectures=["LlamaForCausalLM"], max_position_embeddings=131072)
    assert of(run(llama), "context-length")[0].message == "the model has no DSA indexer"


def test_pdserve_kernels_need_the_plugin_installed(monkeypatch):
    assert [x.level for x in of(run(profile()), "pdserve-plugin")] == ["ok"]
    assert of(run(profile(pdserve_kernels=False)), "pdserve-plugin") == []
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kw: [])
    (f,) = of(run(profile()), "pdserve-plugin")
    assert f.level == "error" and "without pdserve's kernels" in f.message and "pip install -e ." in f.fix
    assert of(run(profile(launch_command=["wrapper", "sglang"])), "pdserve-plugin")[0].level == "warning"


def test_kv_transfer_tcp_warning_and_missing_rdma_device(tmp_path, monkeypatch):
    assert of(run(profile()), "kv-transfer")[0].level == "warning"
    ib = tmp_path / "infiniband"
    (ib / "mlx5_0").mkdir(parents=True)
    monkeypatch.setattr(hardware, "IB_SYSFS", str(ib))
    d = profile()
    d["transfer"] = {"protocol": "rdma", "ib_device": "mlx5_1"}
    f = of(run(d), "kv-transfer")
    assert f[0].level == "error" and "mlx5_1" in f[0].message and "mlx5_0" in f[0].fix
    d["transfer"]["ib_device"] = "mlx5_0"
    assert of(run(d), "kv-transfer")[0].level == "ok"
    monkeypatch.setattr(hardware, "IB_SYSFS", str(tmp_path / "none"))
    assert of(run(d), "kv-transfer")[0].level == "error"
    ref = parse_config({"router": {"port": free_port()}})
    assert of(D.run_checks(ref, NOGPU), "kv-transfer")[0].level == "ok"  # reference engine on TCP: fine


# ---- 5. speculative decoding on the reference engine -------------------------------------------
LOCAL_SPEC = os.path.join(ROOT, "deploy", "local-spec.yaml")


def reference(**data):
    """A reference-engine config (builtin:tiny unless model_path is given) as a dict."""
    return {"engine": "reference", "router": {"port": free_port()}, **data}


def test_local_spec_profile_passes(tmp_path, capsys):
    with open(LOCAL_SPEC) as f:
        d = yaml.safe_load(f)
    d["router"]["port"] = free_port()
    assert D.main([write_yaml(tmp_path, d)]) == 0
    out = capsys.readouterr().out
    assert "0 error(s), 0 warning(s)" in out
    assert ("ok    [speculative] speculative decoding on both roles: --speculative-algorithm EAGLE "
            "--speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4") in out


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_speculation_on_one_role_only_is_refused(role):
    d = reference(**{role: {"extra_args": ["--speculative-algorithm", "EAGLE"]}})
    (err,) = of(run(d, NOGPU), "speculative", "error")
    assert err.message.startswith(f"speculative decoding on {role} only ({role}.extra_args: --speculative-algorithm "
                                  "EAGLE --speculative-num-steps 3"), err.message
    other = "decode" if role == "prefill" else "prefill"
    assert f"{other} has no speculative decoding" in err.message and "speculative settings mismatch" in err.message
    assert "drop --speculative-* from" in err.fix
    assert D.exit_code(run(reference(), NOGPU)) == 0  # off on both: fine


def test_different_speculative_settings_are_refused():
    d = reference(speculative={"num_steps": 3, "num_draft_tokens": 4},
                  decode={"extra_args": ["--speculative-num-steps", "2", "--speculative-num-draft-tokens", "3"]})
    (err,) = of(run(d, NOGPU), "speculative", "error")
    assert err.message.startswith("speculative settings differ (decode.extra_args and speculative)")
    assert ("decode has --speculative-algorithm EAGLE --speculative-num-steps 2" in err.message
            and "prefill has --speculative-algorithm EAGLE --speculative-num-steps 3" in err.message)


def test_reference_draft_hidden_size_must_be_the_targets(tmp_path):
    small = ckpt(tmp_path, "small-draft", architectures=["DeepseekV3ForCausalLMNextN"], hidden_size=32)
    (err,) = of(run(reference(speculative={"draft_model_path": small}), NOGPU), "speculative", "error")
    assert err.message.startswith("speculative draft_model_path: the draft's hidden_size 32 "
                                  f"({small}/config.json) differs from the target's 64"), err.message
    # a checkpoint target: both config.json files are read
    target = ckpt(tmp_path, "target", architectures=["LlamaForCausalLM"], hidden_size=128)
    draft = ckpt(tmp_path, "draft", architectures=["DeepseekV3ForCausalLMNextN"], hidden_size=128)
    f = of(run(reference(model_path=target, speculative={"draft_model_path": draft}), NOGPU), "speculative")
    assert [x.level for x in f] == ["ok"] and "hidden_size 128 as the target's" in f[0].message
    f = of(run(reference(model_path=target, speculative={"draft_model_path": small}), NOGPU), "speculative", "error")
    assert len(f) == 1 and "target's 128" in f[0].message
    # a draft that is not here: a warning, never an error
    f = of(run(reference(speculative={"draft_model_path": str(tmp_path / "nowhere")}), NOGPU), "speculative")
    assert [x.level for x in f] == ["warning", "ok"] and "cannot check the draft's hidden size" in f[0].message


def test_builtin_draft_hidden_size_is_read_once_written(tmp_path, monkeypatch):
    """builtin:tiny's own draft: its written config.json when there is one (else the recipe: the target's)."""
    from pd.engines.models import builtin_draft

    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    (ok,) = of(run(reference(speculative={}), NOGPU), "speculative")
    assert ok.level == "ok" and "draft built-in, hidden_size 64" in ok.message
    written = builtin_draft.draft_dir()
    written.mkdir(parents=True)
    (written / "config.json").write_text(json.dumps({"hidden_size": 48}))
    (err,) = of(run(reference(speculative={}), NOGPU), "speculative", "error")
    assert err.message.startswith("the built-in draft: the draft's hidden_size 48") and "target's 64" in err.message


def test_reference_topk_above_one_is_refused():
    """In the config: an invalid config naming the key (exit 2); through extra_args: the engine's own message."""
    with pytest.raises(ConfigError) as e:
        parse_config(reference(speculative={"num_steps": 3, "eagle_topk": 2, "num_draft_tokens": 4}))
    assert "speculative.eagle_topk 2: the reference engine drafts a chain only" in str(e.value)
    d = reference(speculative={"num_steps": 3}, decode={"extra_args": ["--speculative-eagle-topk", "2"]})
    (err,) = of(run(d, NOGPU), "speculative", "error")
    assert err.message.startswith("decode: decode.extra_args: --speculative-eagle-topk 2: the reference engine "
                                  "drafts a chain only"), err.message


def test_reference_topk_in_the_config_is_a_config_finding(tmp_path, capsys):
    d = reference(speculative={"num_steps": 3, "eagle_topk": 2, "num_draft_tokens": 4})
    assert D.main([write_yaml(tmp_path, d)]) == 2
    out = capsys.readouterr().out
    assert "ERROR [config]" in out and "speculative.eagle_topk 2" in out


def test_reference_speculation_needs_a_draft_for_a_checkpoint(tmp_path):
    """In the config: an invalid config naming the key; through extra_args: the engine's own message."""
    target = ckpt(tmp_path, "target", architectures=["LlamaForCausalLM"], hidden_size=128)
    with pytest.raises(ConfigError, match="speculative.draft_model_path is required with --model-path"):
        parse_config(reference(model_path=target, speculative={}))
    d = reference(model_path=target, decode={"extra_args": ["--speculative-algorithm", "EAGLE"]})
    (err,) = of(run(d, NOGPU), "speculative", "error")
    assert err.message.startswith("decode: decode.extra_args: --speculative-draft-model-path is required with "
                                  "--model-path"), err.message


def test_reference_num_draft_tokens_adjusted_is_a_warning():
    f = of(run(reference(speculative={"num_steps": 3, "num_draft_tokens": 2}), NOGPU), "speculative")
    assert [x.level for x in f] == ["warning", "warning", "ok"]
    assert "num_draft_tokens 2 is adjusted to num_steps + 1 = 4" in f[0].message
    assert f[0].fix == "set speculative.num_draft_tokens: 4"


def test_reference_unknown_extra_flag_is_refused():
    (err,) = of(run(reference(decode={"extra_args": ["--speculative-algoritm", "EAGLE"]}), NOGPU), "engine-args")
    assert err.level == "error" and err.message.startswith("decode: decode.extra_args: the reference engine refuses")
    assert "--speculative-algoritm" in err.message
