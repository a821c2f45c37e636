"""The pdserve SGLang plugin exercised live on CPU, at the level SGLang itself runs it.

The pinned SGLang's own modules are imported (``sglang.srt.models.deepseek_v4`` and the rest of the DeepSeek-V4
path, with the light packages of tests/sglang_live_requirements.txt), its own ``load_plugins()`` finds pdserve's
entry point and ``HookRegistry.apply_hooks()`` patches the real targets; then every hooked call is made the way
SGLang's DeepSeek-V4 code makes it and compared with SGLang's own function on the same inputs (Triton kernels
under the interpreter). All of it runs in one subprocess (tests/sglang_live_cases.py: the interpreter must be
on before triton decorates a kernel, and the hooks are process-wide patches), once per session; the tests
below read its records. tests/test_sglang_plugin.py keeps the source-text contract and the adapters' unit tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import distributions
from pathlib import Path

import pytest

from engines import ROOT
from pd.kernels import sglang_plugin as P

HERE = Path(__file__).parent
REQUIREMENTS = HERE / "sglang_live_requirements.txt"
LIVE_DEPS = Path(sys.prefix) / "sglang-live"  # `make install` puts the requirements there
# The four SGLang functions pdserve must reach, written out here rather than read from P.HOOKS, so a hook that is
# dropped or whose target is mistyped there fails below instead of silently leaving SGLang's path in place.
SPARSE_MLA = "sglang.kernels.ops.attention.flash_mla_sm120.flash_mla_with_kvcache_sm120"
HEADS = "sglang.srt.models.deepseek_v4.MqaAttentionBase._kernel_num_heads"
INDEXER = "sglang.srt.layers.attention.dsv4.indexer.C4IndexerBackendMixin.forward_c4_indexer"
MOE = "sglang.srt.layers.quantization.fp8.Fp8Config.get_quant_method"
TARGETS = {SPARSE_MLA: "sparse_mla", HEADS: "sparse_mla", INDEXER: "indexer", MOE: "mxfp4_moe"}
# Relative L2 error bounds. Ours vs the fp64 reference: the kernels' own interpreter bounds
# (tests/test_sparse_mla_decode.py, tests/test_mxfp4_moe.py). SGLang's Triton sm_120 kernel lands at 3.9-4.0e-3
# from the reference on these inputs (bf16 rounding of P and of its two partial outputs before the merge), so
# ours vs it is bounded by the sum; a dropped sink, cache or length moves the output by more than 5e-2.
SPARSE_MLA_OURS_TOL = 2.5e-3
SPARSE_MLA_SGLANG_TOL = 6e-3
SPARSE_MLA_BETWEEN_TOL = SPARSE_MLA_OURS_TOL + SPARSE_MLA_SGLANG_TOL
MOE_TOL = 4e-3


def _pins() -> dict[str, str]:
    out = {}
    for line in REQUIREMENTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[name.lower().replace("_", "-")] = version
    return out


@pytest.fixture(scope="module")
def live():
    """Records of one run of tests/sglang_live_cases.py: name -> list of records."""
    have = {d.metadata["Name"].lower().replace("_", "-"): d.version for d in distributions(path=[str(LIVE_DEPS)])}
    missing = {n: v for n, v in _pins().items() if have.get(n) != v}
    assert not missing, (f"{LIVE_DEPS} lacks {missing} (has {have}); `make install` installs "
                         f"{REQUIREMENTS.name} there")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PDSERVE_", "SGLANG_", "TRITON_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(LIVE_DEPS), env.get("PYTHONPATH")]))
    p = subprocess.run([sys.executable, str(HERE / "sglang_live_cases.py"), *TARGETS], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=900)
    records: dict[str, list] = {}
    for line in p.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            records.setdefault(r["name"], []).append(r)
    records["_stderr"] = p.stderr[-4000:]
    assert p.returncode == 0, p.stderr[-4000:]
    return records


def one(live, name, **match):
    """The record ``name`` whose fields equal ``match``; a clear failure when the run did not produce it."""
    crashed = [r for r in live.get(name, []) if "crash" in r]
    if crashed:
        pytest.fail(f"{name} raised in the live run: {crashed[0]['crash']}\n{crashed[0]['trace']}")
    got = [r for r in live.get(name, []) if all(r.get(k) == v for k, v in match.items())]
    if not got:
        broken = [r for r in live.get("resolve", []) if r["error"]]
        why = f"SGLang's modules did not import: {broken}" if broken else live["_stderr"][-2000:]
        pytest.fail(f"no {name} record {match} from the live run; {why}")
    (r,) = got
    return r


# ---- the targets and the loader ---------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS)
def test_every_target_imports_with_the_pinned_sglang(live, target):
    r = one(live, "resolve", target=target)
    assert r["error"] is None, f"{target} does not resolve in the pinned SGLang: {r['error']}"


def test_the_plugin_hooks_exactly_these_targets():
    hooked = {h.target: h.kernel for h in P.HOOKS}
    missing = sorted(set(TARGETS) - set(hooked))
    extra = sorted(set(hooked) - set(TARGETS))
    assert not missing and not extra, f"pdserve hooks no {missing}; it hooks unknown targets {extra}"
    assert hooked == TARGETS


EXPECTED_PATCHED = {
    "on": set(TARGETS),
    "off": set(),
    "unset": set(),
    "sparse_mla_off": {INDEXER, MOE},
    "indexer_off": {SPARSE_MLA, HEADS, MOE},
    "mxfp4_moe_off": {SPARSE_MLA, HEADS, INDEXER},
}


@pytest.mark.parametrize("config", EXPECTED_PATCHED)
def test_sglang_load_plugins_patches_what_the_switches_say(live, config):
    """SGLang's own load_plugins() + HookRegistry.apply_hooks() on the real modules: with PDSERVE_KERNELS=1
    every target is wrapped (the original kept as __wrapped__) by pdserve's hooks; with it 0 or unset none;
    a kernel switched off leaves exactly its targets alone."""
    r = one(live, "switches", config=config)
    want = EXPECTED_PATCHED[config]
    patched = set(r["patched"])
    not_patched = sorted(want - patched)
    assert not not_patched, (f"{config}: SGLang did not patch {not_patched}; registered {r['registered']}, "
                             f"its log: {r['errors']}")
    assert patched == want, f"{config}: patched {sorted(patched - want)} too"
    assert all(by == [P.PLUGIN_NAME] for by in r["patched"].values()), r["patched"]
    assert r["applied"] == sorted(r["registered"]), f"registered hooks SGLang could not apply: {r['errors']}"
    assert not r["errors"], r["errors"]


# ---- sparse-MLA decode ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["decode_c4_swa256", "verify_c4_swa64", "decode_c128_swa256"])
def test_hooked_sparse_decode_matches_sglangs_triton_kernel(live, case):
    """flash_mla_with_kvcache_sm120 as DeepseekV4AttnBackend calls it (SGLang's pools, causal SWA window, c4
    compressed cache, sink; q_len 1 and 2): the hooked call runs our kernel, and its output matches SGLang's own
    Triton kernel and the fp64 reference."""
    r = one(live, "sparse_mla", case=case)
    assert r["wrapped"], f"{SPARSE_MLA} is not hooked"
    assert r["ours_calls"] == 1, f"the hooked call did not reach pd.kernels.sparse_mla_decode: {r}"
    assert r["shape"] == r["want_shape"] and r["dtype"] == "torch.bfloat16", r
    assert r["ours_vs_ref"] <= SPARSE_MLA_OURS_TOL, r
    assert r["sglang_vs_ref"] <= SPARSE_MLA_SGLANG_TOL, r
    assert r["ours_vs_sglang"] <= SPARSE_MLA_BETWEEN_TOL, r


def test_head_padding_our_path_gets(live):
    """MqaAttentionBase._kernel_num_heads on a DeepSeek-V4-Flash attention layer (64 heads): at TP 4 SGLang pads
    the 16 per-rank heads to 64 (no FlashInfer decode here), the hooked method hands our kernel the native 16;
    TP 1, DSv4.1 and a GPU the plugin does not serve keep SGLang's answer."""
    r = one(live, "kernel_num_heads")
    assert r["wrapped"], f"{HEADS} is not hooked"
    got = [(x["tp"], x["dsv41"], x["tokens"], x["force"], x["ours"], x["sglang"]) for x in r["rows"]]
    assert got == [(4, False, 8, True, 16, 64), (4, False, 100, True, 16, 64), (1, False, 8, True, 64, 64),
                   (4, True, 8, True, 64, 64), (4, False, 8, False, 64, 64)]


# ---- C4 indexer ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["DECODE", "TARGET_VERIFY"])
def test_hooked_indexer_selects_sglangs_top_k(live, mode):
    """forward_c4_indexer through the real mixin (SGLang's index-K pool and PagedIndexerMetadata, 700 and 37
    compressed tokens): our kernel writes the top-512 SGLang's torch path writes, up to ties, as pool slots
    through the page table and as raw positions."""
    r = one(live, "indexer", mode=mode)
    assert r["wrapped"], f"{INDEXER} is not hooked"
    assert r["ours_calls"] == 1, f"the hooked call did not reach pd.kernels.indexer: {r}"
    assert r["compressor_runs"] == 1, r
    assert not r["bad_rows"], r["bad_rows"]
    assert r["slots_follow_page_table"] and r["untouched"] == 0, r


def test_hooked_indexer_leaves_prefill_to_sglang(live):
    r = one(live, "indexer", mode="EXTEND")
    assert r["wrapped"], f"{INDEXER} is not hooked"
    assert r["ours_calls"] == 0 and r["identical"] and r["compressor_runs"] == 1, r


# ---- MXFP4 MoE of the draft -----------------------------------------------------------------------------------
def test_draft_experts_get_our_moe_method_and_target_experts_do_not(live):
    """A real Fp8Config from DeepSeek-V4-Flash's quantization config, real FusedMoE layers: the one built in SGLang's
    draft build scope gets PdserveMxfp4MoEMethod, the target model's keeps Fp8MoEMethod; the draft's weights are
    Fp8MoEMethod's MXFP4 layout, and apply() matches the MXFP4 torch reference."""
    r = one(live, "moe")
    assert r["wrapped"], f"{MOE} is not hooked"
    assert r["target_method"] == "Fp8MoEMethod" and not r["target_is_draft"], r
    assert r["draft_method"] == "PdserveMxfp4MoEMethod" and r["draft_is_draft"], r
    assert r["params"] == {"w13_weight": [[4, 256, 128], "torch.int8"], "w2_weight": [[4, 256, 64], "torch.int8"],
                           "w13_weight_scale_inv": [[4, 256, 8], "torch.float32"],
                           "w2_weight_scale_inv": [[4, 256, 4], "torch.float32"]}, r["params"]
    assert r["out_shape"] == [5, 256] and r["out_dtype"] == "torch.bfloat16", r
    assert r["ours_vs_ref"] <= MOE_TOL, r
