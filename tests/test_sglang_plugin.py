"""The pdserve SGLang plugin (pd.kernels.sglang_plugin + its adapters) on CPU.

Contract with the pinned SGLang source: every hook target exists with the parameters its adapter takes, every
SGLang name/member an adapter reads exists, the call sites pass what the adapters expect. Most of those
modules need GPU-only packages to import, so the source is read with ``ast`` (and compared with ``inspect``
where a module imports). Then: the entry point is declared and installed, SGLang's own loader picks it up
(or not, by the switches and its allow-list), the config's switches reach the worker env, and each adapter
turns a small CPU example of SGLang's arguments into what our kernels take (kernels replaced by recorders /
the torch references; SGLang objects the CPU cannot import replaced by stand-ins with the checked names).
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import subprocess
import sys
import tomllib
import types
from collections import namedtuple
from functools import lru_cache
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import sglang
import torch

from engines import ROOT
from pd.commands.sglang import sglang_command
from pd.config import load_config, parse_config
from pd.kernels import sglang_indexer as SI
from pd.kernels import sglang_mxfp4_moe as SX
from pd.kernels import sglang_plugin as P
from pd.kernels import sglang_sparse_mla as SM
from pd.kernels.indexer_reference import dsa_indexer_topk_ref, quantize_index_k
from pd.kernels.sparse_mla_reference import quantize_kv, sparse_mla_decode_ref

SGLANG_ROOT = Path(sglang.__file__).parent
ADAPTERS = [SM, SI, SX]
DSV4_PROFILE = os.path.join(ROOT, "deploy", "dsv4-flash-rtxpro6000x8.yaml")


# ---- reading the pinned source without importing it -------------------------------------------------------
def module_file(dotted: str) -> tuple[Path, list[str]]:
    """The source file of the longest module prefix of ``dotted`` and the attribute path after it."""
    parts = dotted.split(".")
    assert parts[0] == "sglang", dotted
    for i in range(len(parts), 0, -1):
        base = SGLANG_ROOT.joinpath(*parts[1:i])
        for cand in (base.with_suffix(".py"), base / "__init__.py"):
            if i > 1 and cand.is_file():
                return cand, parts[i:]
    raise AssertionError(f"no module of {dotted} under {SGLANG_ROOT}")


@lru_cache(maxsize=None)
def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _defs(body):
    """Definitions of a module/class body, looking into if/try/with blocks (not into functions)."""
    for n in body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield n.name, n
        elif isinstance(n, ast.Assign):
            for t in n.targets:
                if isinstance(t, ast.Name):
                    yield t.id, n
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            yield n.target.id, n
        elif isinstance(n, (ast.If, ast.Try, ast.With)):
            yield from _defs(n.body)
            yield from _defs(getattr(n, "orelse", []))
            for h in getattr(n, "handlers", []):
                yield from _defs(h.body)
            yield from _defs(getattr(n, "finalbody", []))


def find(dotted: str):
    """The AST node defining ``dotted`` (last definition wins, as at import)."""
    path, rest = module_file(dotted)
    node = parse(path)
    for name in rest:
        hits = [n for k, n in _defs(node.body) if k == name]
        assert hits, f"{name} is not defined in {getattr(node, 'name', path)} ({path}); wanted {dotted}"
        node = hits[-1]
    return node


def ast_params(fn) -> tuple[str, ...]:
    a = fn.args
    names = [x.arg for x in a.posonlyargs + a.args]
    if a.vararg:
        names.append("*" + a.vararg.arg)
    names += [x.arg for x in a.kwonlyargs]
    if a.kwarg:
        names.append("**" + a.kwarg.arg)
    return tuple(names)


def inspect_params(fn) -> tuple[str, ...]:
    out = []
    for p in inspect.signature(fn).parameters.values():
        prefix = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "")
        out.append(prefix + p.name)
    return tuple(out)


def class_members(dotted: str) -> set[str]:
    """Fields, class attributes, methods/properties and ``self.x = ...`` attributes of a class, with its bases
    defined in the same module."""
    cls = find(dotted)
    assert isinstance(cls, ast.ClassDef), dotted
    names = {k for k, _ in _defs(cls.body)}
    for n in ast.walk(cls):
        targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                names.add(t.attr)
    module = dotted.rsplit(".", 1)[0]
    for b in cls.bases:
        if isinstance(b, ast.Name) and any(k == b.id and isinstance(n, ast.ClassDef)
                                           for k, n in _defs(parse(module_file(module)[0]).body)):
            names |= class_members(f"{module}.{b.id}")
    return names


# ---- 1. contract with the pinned source --------------------------------------------------------------------
@pytest.mark.parametrize("hook", P.HOOKS, ids=lambda h: h.target.split(".", 3)[-1])
def test_hook_target_exists_with_the_parameters_the_adapter_takes(hook):
    fn = find(hook.target)
    assert isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)), f"{hook.target} is not a function"
    assert ast_params(fn) == hook.params, f"{hook.target}: pinned source has {ast_params(fn)}"
    adapter = inspect_params(hook.load_adapter())
    assert adapter[0] == "original"  # HookRegistry AROUND: hook(original_fn, *args, **kwargs)
    if hook.params == ("**kwargs",):
        assert adapter[-1].startswith("**")
    else:
        assert adapter[1:1 + len(hook.params)] == hook.params


def test_ast_reading_agrees_with_import_where_the_module_imports():
    import pkgutil

    target = P.HOOKS[0].target  # flash_mla_sm120 imports on CPU
    assert inspect_params(pkgutil.resolve_name(target)) == ast_params(find(target)) == ("**kwargs",)


@pytest.mark.parametrize("name", [n for a in ADAPTERS for n in a.SGLANG_NAMES])
def test_sglang_names_the_adapters_use_exist(name):
    find(name)


@pytest.mark.parametrize("cls,members", [(c, m) for a in ADAPTERS for c, m in a.SGLANG_MEMBERS.items()],
                         ids=lambda x: x.rsplit(".", 1)[-1] if isinstance(x, str) else None)
def test_sglang_members_the_adapters_read_exist(cls, members):
    missing = set(members) - class_members(cls)
    assert not missing, f"{cls} has no {sorted(missing)} in the pinned source"


def _calls(module: str, name: str):
    return [n for n in ast.walk(parse(module_file(module)[0])) if isinstance(n, ast.Call)
            and (getattr(n.func, "id", None) == name or getattr(n.func, "attr", None) == name)]


def test_sparse_mla_keywords_match_the_callee_and_the_dsv4_call_site():
    fn = find(P.HOOKS[0].target)
    read = set()
    for n in ast.walk(fn):
        if isinstance(n, ast.Subscript) and getattr(n.value, "id", None) == "kwargs":
            read.add(n.slice.value)
        if isinstance(n, ast.Call) and getattr(n.func, "attr", None) == "get" \
                and getattr(n.func.value, "id", None) == "kwargs":
            read.add(n.args[0].value)
    assert read == set(SM.SGLANG_KWARGS)
    backend = "sglang.srt.layers.attention.deepseek_v4_backend"
    (call,) = _calls(backend, "flash_mla_with_kvcache_sm120")
    assert not call.args and {k.arg for k in call.keywords} == set(SM.SGLANG_KWARGS)
    # only the output is used: the call is indexed with [0]
    subs = [n for n in ast.walk(parse(module_file(backend)[0])) if isinstance(n, ast.Subscript) and n.value is call]
    assert len(subs) == 1 and subs[0].slice.value == 0


def test_indexer_call_site_passes_only_parameters_the_adapter_names():
    (call,) = _calls("sglang.srt.layers.attention.dsv4.indexer", "forward_c4_indexer")
    named = {k.arg for k in call.keywords if k.arg}
    assert named <= set(P.HOOKS[2].params) and not call.args
    # the **backend_kwargs splat only ever carries q_lora_quant
    forward = find("sglang.srt.layers.attention.dsv4.indexer.C4Indexer.forward")
    keys = {n.slice.value for n in ast.walk(forward)
            if isinstance(n, ast.Subscript) and getattr(n.value, "id", None) == "backend_kwargs"}
    assert keys == {"q_lora_quant"}


def test_fp4_expert_weights_are_what_the_moe_method_expects():
    """Fp8MoEMethod registers the MXFP4 experts as int8 [E, 2I, H/2] / [E, H, I/2] with one scale per 32
    (w13_weight_scale_inv / w2_weight_scale_inv): the names and the block the adapter relies on."""
    fn = find("sglang.srt.layers.quantization.fp8.Fp8MoEMethod.create_fp8_moe_weight_")
    src = ast.unparse(fn)
    for needle in ("'w13_weight_scale_inv'", "'w2_weight_scale_inv'", "fp4_block_k = 32", "hidden_size // 2",
                   "intermediate_size_per_partition // 2", "dtype=torch.int8"):
        assert needle in src, needle


# ---- 2. entry point and SGLang's loader ---------------------------------------------------------------------
def test_entry_point_is_declared_and_installed():
    data = tomllib.loads(Path(ROOT, "pyproject.toml").read_text())
    assert data["project"]["entry-points"][P.ENTRY_POINT_GROUP] == {P.PLUGIN_NAME: "pd.kernels.sglang_plugin:register"}
    eps = [e for e in entry_points(group=P.ENTRY_POINT_GROUP) if e.name == P.PLUGIN_NAME]
    assert len(eps) == 1, "pdserve's entry point is not installed: pip install -e . (make install)"
    assert eps[0].load() is P.register


def test_sglang_allow_list_decides_whether_it_is_loaded(monkeypatch):
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group

    assert GENERAL_PLUGINS_GROUP == P.ENTRY_POINT_GROUP
    for allow, loaded in (("pdserve", True), ("other,pdserve", True), ("other", False), ("", True)):
        monkeypatch.setenv("SGLANG_PLUGINS", allow)
        assert (P.PLUGIN_NAME in load_plugins_by_group(GENERAL_PLUGINS_GROUP)) is loaded, allow


LOADER = r"""
import json, sys, types, torch

# Stand-ins for the three target modules that need GPU-only packages to import (their real definitions are
# checked above); flash_mla_sm120 is the real module.
class MqaAttentionBase:
    def _kernel_num_heads(self, num_tokens):
        return 64

class C4IndexerBackendMixin:
    def forward_c4_indexer(self, x, q_lora, c4_indexer, forward_batch, alt_streams=None, enable_multi_stream=False,
                           q_lora_ready=None, skip_compressor=False, q_lora_quant=None):
        return "sglang"

class Fp8Config:
    def get_quant_method(self, layer, prefix):
        return "sglang"

for name, attrs in {"sglang.srt.models.deepseek_v4": {"MqaAttentionBase": MqaAttentionBase},
                    "sglang.srt.layers.attention.dsv4.indexer": {"C4IndexerBackendMixin": C4IndexerBackendMixin},
                    "sglang.srt.layers.quantization": {},
                    "sglang.srt.layers.quantization.fp8": {"Fp8Config": Fp8Config}}.items():
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    sys.modules[name] = m

import sglang.kernels.ops.attention.flash_mla_sm120 as fm
from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry

load_plugins()  # HookRegistry wraps each target (keeping it as __wrapped__) and rebinds its aliases
wrapped = {"flash_mla": fm.flash_mla_with_kvcache_sm120, "heads": MqaAttentionBase._kernel_num_heads,
           "indexer": C4IndexerBackendMixin.forward_c4_indexer, "moe": Fp8Config.get_quant_method}
import pd.kernels.sparse_mla_decode as smd
seen = []
smd.sparse_mla_decode = lambda **kw: seen.append({k: list(v.shape) if torch.is_tensor(v) else v
                                                  for k, v in kw.items()}) or ("out", "lse")
kc = torch.zeros(2, 37440, dtype=torch.uint8)[:, :64 * 584].view(2, 64, 1, 584)
res = fm.flash_mla_with_kvcache_sm120(
    q=torch.zeros(3, 1, 16, 512, dtype=torch.bfloat16), k_cache=kc, head_dim_v=512, softmax_scale=0.05,
    indices=torch.zeros(3, 1, 64, dtype=torch.int32), topk_length=None, attn_sink=None, extra_k_cache=None,
    extra_indices_in_kvcache=None, extra_topk_length=None)
print("RESULT " + json.dumps({"wrapped": sorted(k for k, f in wrapped.items() if hasattr(f, "__wrapped__")),
                              "res": res, "seen": seen, "hooks": sorted(HookRegistry._hooks)}))
"""


@pytest.mark.slow
def test_sglang_load_plugins_applies_our_hooks():
    """SGLang's own loader in a fresh process: finds the installed entry point through SGLANG_PLUGINS, runs
    register(), patches every target, and a patched call reaches our kernel (CPU tensors, forced)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PDSERVE_", "SGLANG_PLUGINS"))}
    env.update(SGLANG_PLUGINS="pdserve", PDSERVE_KERNELS="1", PDSERVE_KERNELS_FORCE="1")
    p = subprocess.run([sys.executable, "-c", LOADER], env=env, capture_output=True, text=True, timeout=300,
                       cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads([x for x in p.stdout.splitlines() if x.startswith("RESULT ")][-1][len("RESULT "):])
    assert got["hooks"] == sorted(h.target for h in P.HOOKS)
    assert got["wrapped"] == ["flash_mla", "heads", "indexer", "moe"], p.stderr[-3000:]
    assert got["res"] == ["out", "lse"]
    (call,) = got["seen"]
    assert call["q"] == [3, 1, 16, 512] and call["indices"] == [3, 1, 64] and call["softmax_scale"] == 0.05


# ---- 3. switches --------------------------------------------------------------------------------------------
@pytest.fixture
def registry():
    from sglang.srt.plugins.hook_registry import HookRegistry

    HookRegistry.reset()
    yield HookRegistry
    HookRegistry.reset()
    P._force = False


def _targets(kernels):
    return {h.target for h in P.HOOKS if h.kernel in kernels}


@pytest.mark.parametrize("env,kernels", [
    ({}, set()),
    ({"PDSERVE_KERNELS": "0", "PDSERVE_INDEXER": "1"}, set()),
    ({"PDSERVE_KERNELS": "1"}, {"sparse_mla", "indexer", "mxfp4_moe"}),
    ({"PDSERVE_KERNELS": "true", "PDSERVE_INDEXER": "off"}, {"sparse_mla", "mxfp4_moe"}),
    ({"PDSERVE_KERNELS": "on", "PDSERVE_SPARSE_MLA": "0", "PDSERVE_MXFP4_MOE": "no"}, {"indexer"}),
])
def test_switches_decide_which_hooks_are_registered(registry, monkeypatch, env, kernels):
    from sglang.srt.plugins.hook_registry import HookType

    for flag in [P.MASTER_FLAG, P.FORCE_FLAG, *P.KERNEL_FLAGS.values()]:
        monkeypatch.delenv(flag, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert P.enabled_kernels() == kernels
    P.register()
    assert set(registry._hooks) == _targets(kernels)
    for h in P.HOOKS:
        if h.target in registry._hooks:
            ((kind, fn, _src),) = registry._hooks[h.target]
            assert kind is HookType.AROUND and fn is h.load_adapter()


def test_a_kernel_whose_module_does_not_import_keeps_sglangs_path(registry, monkeypatch, caplog):
    monkeypatch.setenv(P.MASTER_FLAG, "1")
    monkeypatch.setitem(P.KERNEL_MODULES, "indexer", "pd.kernels.no_such_module")
    P.register()
    assert not _targets({"indexer"}) & set(registry._hooks)
    assert _targets({"sparse_mla"}) <= set(registry._hooks)
    assert "cannot import pd.kernels.no_such_module" in caplog.text


@pytest.mark.parametrize("env,says", [
    ({}, "no kernel switched on (PDSERVE_KERNELS=1 switches them on)"),
    ({"PDSERVE_KERNELS": "1", "PDSERVE_SPARSE_MLA": "0", "PDSERVE_INDEXER": "0", "PDSERVE_MXFP4_MOE": "0"},
     "every kernel is switched off (PDSERVE_INDEXER=0, PDSERVE_MXFP4_MOE=0, PDSERVE_SPARSE_MLA=0)"),
])
def test_the_log_says_why_no_kernel_is_on(registry, monkeypatch, caplog, env, says):
    import logging

    for flag in [P.MASTER_FLAG, P.FORCE_FLAG, *P.KERNEL_FLAGS.values()]:
        monkeypatch.delenv(flag, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with caplog.at_level(logging.INFO, logger=P.logger.name):
        P.register()
    assert not registry._hooks
    assert says in caplog.text


def test_bad_switch_values_name_the_variable():
    with pytest.raises(ValueError, match="PDSERVE_INDEXER='maybe'"):
        P.enabled_kernels({"PDSERVE_KERNELS": "1", "PDSERVE_INDEXER": "maybe"})
    with pytest.raises(ValueError, match="unknown pdserve kernel"):
        P.worker_env({"attention": True})


def test_worker_env_extends_an_allow_list():
    env = P.worker_env({"indexer": False}, force=True, allow_list="xpu_hooks, other")
    assert env == {"SGLANG_PLUGINS": "xpu_hooks,other,pdserve", "PDSERVE_KERNELS": "1", "PDSERVE_SPARSE_MLA": "1",
                   "PDSERVE_INDEXER": "0", "PDSERVE_MXFP4_MOE": "1", "PDSERVE_KERNELS_FORCE": "1"}
    assert P.worker_env({}, allow_list="pdserve")["SGLANG_PLUGINS"] == "pdserve"


@pytest.mark.parametrize("allow_list", [None, "", " , "])
def test_without_an_allow_list_every_installed_plugin_still_loads(monkeypatch, allow_list):
    """Naming ``pdserve`` alone would make SGLang skip every other installed plugin: with no allow-list of the
    worker's own, none is set, and SGLang's own loader then takes a second installed plugin next to ours."""
    from importlib.metadata import EntryPoint

    import sglang.srt.plugins as loader

    env = P.worker_env({}, allow_list=allow_list)
    assert P.PLUGIN_ALLOW_LIST not in env and env[P.MASTER_FLAG] == "1"
    ours = [e for e in loader.entry_points(group=P.ENTRY_POINT_GROUP) if e.name == P.PLUGIN_NAME]
    other = EntryPoint(name="other_vendor", value="json:dumps", group=P.ENTRY_POINT_GROUP)
    monkeypatch.setattr(loader, "entry_points", lambda group: [*ours, other] if group == P.ENTRY_POINT_GROUP else [])
    monkeypatch.delenv(P.PLUGIN_ALLOW_LIST, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert set(loader.load_plugins_by_group(P.ENTRY_POINT_GROUP)) == {P.PLUGIN_NAME, "other_vendor"}
    # a node whose own environment holds an allow-list gets ours added where the engine starts
    assert P.allow_list_with_plugin("other_vendor") == "other_vendor,pdserve"
    monkeypatch.setenv(P.PLUGIN_ALLOW_LIST, P.allow_list_with_plugin("other_vendor"))
    assert set(loader.load_plugins_by_group(P.ENTRY_POINT_GROUP)) == {P.PLUGIN_NAME, "other_vendor"}


def test_the_dsv4_profile_switches_every_hook_on_in_both_roles():
    cfg = load_config(DSV4_PROFILE)
    for role, bport in (("prefill", 9000), ("decode", None)):
        env = sglang_command(cfg, role, "h", 1, bport).env
        assert "SGLANG_PLUGINS" not in env  # every installed plugin loads, ours among them
        assert P.selected_hooks(env) == list(P.HOOKS)
        assert P.FORCE_FLAG not in env  # sm_120 only


def test_config_switches_reach_the_worker_env():
    base = {"engine": "sglang", "sglang": {"quantization": "fp8"}}
    off = sglang_command(parse_config(base), "decode", "h", 1, None).env
    assert not P.enabled_kernels(off) and "SGLANG_PLUGINS" not in off
    cfg = parse_config({**base, "sglang": {"quantization": "fp8",
                                           "pdserve_kernels": {"mxfp4_moe": False, "force": True}},
                        "decode": {"env": {"SGLANG_PLUGINS": "other", "PDSERVE_SPARSE_MLA": "0"}}})
    dec = sglang_command(cfg, "decode", "h", 1, None).env
    pre = sglang_command(cfg, "prefill", "h", 2, 3).env
    assert dec["SGLANG_PLUGINS"] == "other,pdserve" and "SGLANG_PLUGINS" not in pre
    assert P.enabled_kernels(dec) == {"indexer"}  # the group's own switch wins
    assert P.enabled_kernels(pre) == {"sparse_mla", "indexer"} and pre[P.FORCE_FLAG] == "1"
    on = parse_config({**base, "sglang": {"quantization": "fp8", "pdserve_kernels": True}})
    assert on.sglang.pdserve_kernels.enabled


# ---- 4. sparse-MLA adapter ----------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def fresh_fallback_log(monkeypatch):
    """Each test sees its own 'using SGLang's path' warnings (they are logged once per process)."""
    monkeypatch.setattr(P, "_warned", set())


@pytest.fixture
def forced(monkeypatch):
    """Adapters take CPU calls (as PDSERVE_KERNELS_FORCE=1 does)."""
    monkeypatch.setattr(P, "_force", True)


def _paged(tokens: int, page_size: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    buf = quantize_kv(torch.randn(tokens, 512, generator=g), page_size)  # uint8 [pages, page_stride]
    pages = buf.shape[0]
    return buf[:, :page_size * 584].view(torch.float8_e4m3fn).view(pages, page_size, 1, 584)


def sglang_style_call(t=3, h=16, topk=64, seed=0):
    """Keyword arguments as DeepseekV4AttnBackend builds them (c4 layer: SWA cache + compressed extra cache)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 256, (t, 1, topk), generator=g, dtype=torch.int32)
    idx[0, 0, 5:9] = -1
    eidx = torch.randint(0, 128, (t, 1, topk), generator=g, dtype=torch.int32)
    return dict(q=torch.randn(t, 1, h, 512, generator=g).bfloat16(), k_cache=_paged(256, 64, seed + 1),
                head_dim_v=512, softmax_scale=512 ** -0.5 * 1.3, indices=idx,
                topk_length=torch.tensor([topk, 40, 17][:t], dtype=torch.int32),
                attn_sink=torch.randn(h, generator=g), extra_k_cache=_paged(128, 64, seed + 2),
                extra_indices_in_kvcache=eidx, extra_topk_length=torch.tensor([30, 0, 64][:t], dtype=torch.int32))


@pytest.fixture
def sparse_recorder(monkeypatch):
    """pd.kernels.sparse_mla_decode.sparse_mla_decode replaced by the fp64 reference, recording its arguments."""
    import pd.kernels.sparse_mla_decode as smd

    seen = []

    def ref(**kw):
        seen.append(kw)
        extra = kw["extra_k_cache"]
        out, lse = sparse_mla_decode_ref(**kw, page_size=kw["k_cache"].shape[1],
                                         extra_page_size=None if extra is None else extra.shape[1])
        return out.bfloat16(), lse

    monkeypatch.setattr(smd, "sparse_mla_decode", ref)
    return seen


def test_sparse_mla_adapter_matches_sglangs_own_torch_path(forced, sparse_recorder):
    from sglang.kernels.ops.attention.flash_mla_sm120 import _sm120_sparse_decode_fwd

    kw = sglang_style_call()
    stock = lambda **_: pytest.fail("a supported call went to SGLang")  # noqa: E731
    out, lse = SM.flash_mla_with_kvcache_sm120(stock, **kw)
    want, want_lse = _sm120_sparse_decode_fwd(kw["q"], kw["k_cache"], kw["indices"], kw["topk_length"],
                                              kw["attn_sink"], 512, kw["softmax_scale"], kw["extra_k_cache"],
                                              kw["extra_indices_in_kvcache"], kw["extra_topk_length"])
    assert out.shape == want.shape == (3, 1, 16, 512) and out.dtype == torch.bfloat16
    rel = (out.float() - want.float()).norm() / want.float().norm()
    assert rel < 1e-2, rel
    assert torch.allclose(lse, want_lse, atol=1e-3)
    (args,) = sparse_recorder
    assert args["extra_indices"] is kw["extra_indices_in_kvcache"] and args["k_cache"] is kw["k_cache"]


def test_sparse_mla_adapter_normalises_what_sglang_may_hand_over(forced, sparse_recorder):
    kw = sglang_style_call(t=2)
    kw.update(q=kw["q"][:, 0], indices=kw["indices"][:, 0].long(), topk_length=kw["topk_length"].view(2, 1).long(),
              attn_sink=torch.cat([kw["attn_sink"], torch.zeros(48)]).double(),
              extra_indices_in_kvcache=kw["extra_indices_in_kvcache"][:, 0])
    SM.flash_mla_with_kvcache_sm120(None, **kw)
    (a,) = sparse_recorder
    assert a["q"].shape == (2, 1, 16, 512)
    assert a["indices"].shape == a["extra_indices"].shape == (2, 1, 64)
    assert a["indices"].dtype == a["extra_indices"].dtype == torch.int32 and a["indices"].is_contiguous()
    assert a["topk_length"].shape == (2,) and a["topk_length"].dtype == torch.int32
    assert a["attn_sink"].shape == (16,) and a["attn_sink"].dtype == torch.float32
    assert isinstance(a["softmax_scale"], float)


def test_sparse_mla_calls_ours_cannot_serve_go_to_sglang_padded_to_64_heads(forced, sparse_recorder, monkeypatch):
    import sglang.kernels.ops.attention.flash_mla_sm120 as fm

    monkeypatch.setattr(fm, "_sm120_default_backend", "flashinfer")
    monkeypatch.setattr(fm, "flashinfer_dsv4_decode_supports_num_heads", lambda h, t: False)
    kw = sglang_style_call()
    # a page size ours does not read (SUPPORTED_PAGE_SIZES: 2, 64, 256)
    kw["extra_k_cache"] = _paged(64, 32, 5)
    got = {}

    def stock(**k):
        got.update(k)
        return torch.arange(3 * 64 * 512.0).view(3, 1, 64, 512), torch.zeros(3, 64, 1)

    out, lse = SM.flash_mla_with_kvcache_sm120(stock, **kw)
    assert not sparse_recorder
    assert got["q"].shape == (3, 1, 64, 512) and torch.equal(got["q"][:, :, :16], kw["q"])
    assert not got["q"][:, :, 16:].any() and not got["attn_sink"][16:].any()
    assert got["extra_k_cache"] is kw["extra_k_cache"]
    assert out.shape == (3, 1, 16, 512) and lse.shape == (3, 16, 1)
    monkeypatch.setattr(fm, "flashinfer_dsv4_decode_supports_num_heads", lambda h, t: True)
    got.clear()
    SM.flash_mla_with_kvcache_sm120(lambda **k: got.update(k) or ("o", None), **kw)
    assert got["q"] is kw["q"]


def test_sparse_mla_calls_the_kernel_refuses_go_to_sglang(forced, monkeypatch, caplog):
    import pd.kernels.sparse_mla_decode as smd

    def refuse(**kw):
        raise ValueError("k_cache page stride must be 37440 bytes for page_size 64, got 37376")

    monkeypatch.setattr(smd, "sparse_mla_decode", refuse)
    import sglang.kernels.ops.attention.flash_mla_sm120 as fm

    monkeypatch.setattr(fm, "_sm120_default_backend", "triton")  # no 64-head padding on this path
    kw = sglang_style_call()
    assert SM.flash_mla_with_kvcache_sm120(lambda **k: ("sglang", k["q"]), **kw) == ("sglang", kw["q"])
    assert "the kernel refused the call: k_cache page stride" in caplog.text


def test_sparse_mla_adapter_leaves_other_gpus_to_sglang(sparse_recorder):
    kw = sglang_style_call()
    assert SM.flash_mla_with_kvcache_sm120(lambda **k: ("sglang", k["q"]), **kw) == ("sglang", kw["q"])
    assert not sparse_recorder


def test_native_head_count_for_our_kernel(forced):
    def att(native, dsv41=False):
        return types.SimpleNamespace(n_local_heads=native, is_dsv41=dsv41)

    padded = lambda self, num_tokens: 64  # noqa: E731  (SGLang's answer on sm_120 decode)
    assert SM.kernel_num_heads(padded, att(16), 8) == 16
    assert SM.kernel_num_heads(padded, att(24), 8) == 64  # not a multiple of 16
    assert SM.kernel_num_heads(padded, att(16, dsv41=True), 8) == 64
    P._force = False
    assert SM.kernel_num_heads(padded, att(16), 8) == 64  # CPU, not forced


# ---- 5. indexer adapter -------------------------------------------------------------------------------------
class Mode:
    """Stand-in for SGLang's ForwardMode (the predicates the adapter calls)."""

    def __init__(self, name):
        self.name = name

    def is_decode(self):
        return self.name == "DECODE"

    def is_target_verify(self):
        return self.name == "TARGET_VERIFY"

    def is_draft_extend_v2(self):
        return self.name == "DRAFT_EXTEND_V2"

    def is_idle(self):
        return self.name == "IDLE"


def indexer_world(rows=3, topk=64, lens=(200, 40, 130), seed=0):
    """A DeepseekV4AttnBackend stand-in around a 6-page index-K cache, and the indexer layer."""
    g = torch.Generator().manual_seed(seed)
    cache = quantize_index_k(torch.randn(6 * 64, 128, generator=g), 64)
    page_table = torch.tensor([[5, 2, 0, 1], [3, 4, 1, 0], [1, 0, 5, 2]], dtype=torch.int32)[:rows]
    q = (torch.randn(rows, 64, 128, generator=g) * 4).to(torch.float8_e4m3fn)
    w = torch.rand(rows, 64, 1, generator=g)
    prepared = []

    def prepare(**kw):
        prepared.append(kw)
        return q, w

    core = types.SimpleNamespace(positions=torch.arange(rows) + 900,
                                 c4_sparse_page_indices=torch.full((rows + 1, topk), 12345, dtype=torch.int32),
                                 c4_sparse_raw_indices=torch.full((rows + 1, topk), 999, dtype=torch.int32))
    im = types.SimpleNamespace(page_table=page_table, compressed_seq_lens=torch.tensor(lens, dtype=torch.int32),
                               compressed_page_size=64)
    backend = types.SimpleNamespace(
        forward_metadata=types.SimpleNamespace(indexer_metadata=im, core_metadata=core),
        token_to_kv_pool=types.SimpleNamespace(get_index_k_with_scale_buffer=lambda layer_id: cache),
        hisparse_coordinator=None, debug_use_external_c4_sparse_indices=False,
        _forward_prepare_normal=prepare, _forward_prepare_multi_stream=prepare)
    layer = types.SimpleNamespace(use_fp4_indexer=False, layer_id=7, n_heads=64)
    return backend, layer, prepared, (q, w, cache)


@pytest.fixture
def indexer_kernel(monkeypatch):
    """``pd.kernels.indexer.dsa_indexer_topk`` as the torch reference, recording calls that bind to the real
    kernel's signature; SGLang's capturer module (GPU-only imports) as a stand-in that reports no capture."""
    import pd.kernels.indexer as ki

    real = inspect.signature(ki.dsa_indexer_topk)
    seen = []

    def kernel(*args, **kw):
        real.bind(*args, **kw)
        seen.append((args, kw))
        return dsa_indexer_topk_ref(*args, **kw)

    monkeypatch.setattr(ki, "dsa_indexer_topk", kernel)
    capt = types.ModuleType("sglang.srt.state_capturer.indexer_topk")
    capt.get_global_indexer_capturer = lambda: None
    monkeypatch.setitem(sys.modules, capt.__name__, capt)
    return seen


def test_indexer_adapter_writes_the_top_k_slots_sglang_would(forced, indexer_kernel):
    backend, layer, prepared, (q, w, cache) = indexer_world()
    x, q_lora = torch.randn(3, 8), torch.randn(3, 4)
    batch = types.SimpleNamespace(forward_mode=Mode("DECODE"))
    stock = lambda *a, **k: pytest.fail("a decode step went to SGLang")  # noqa: E731
    assert SI.forward_c4_indexer(stock, backend, x, q_lora, layer, batch, skip_compressor=True) is None
    (p,) = prepared
    assert p["skip_compressor"] is True and p["c4_indexer"] is layer
    assert torch.equal(p["positions"], torch.arange(3) + 900)
    ((args, kw),) = indexer_kernel
    assert args[0].shape == (3, 1, 64, 128) and args[0].dtype == torch.float8_e4m3fn
    assert args[1].shape == (3, 1, 64) and args[1].dtype == torch.float32 and args[2] is cache
    assert kw == {"topk": 64, "page_size": 64}
    md = backend.forward_metadata
    pos = dsa_indexer_topk_ref(q.unsqueeze(1), w.view(3, 1, 64), cache, md.indexer_metadata.page_table,
                               md.indexer_metadata.compressed_seq_lens, topk=64).view(3, 64)
    slots, raw = md.core_metadata.c4_sparse_page_indices, md.core_metadata.c4_sparse_raw_indices
    assert torch.equal(raw[:3], pos) and (raw[3] == 999).all() and (slots[3] == 12345).all()
    pt = md.indexer_metadata.page_table
    for r, n in enumerate((200, 40, 130)):
        valid = min(n, 64)  # the c4 attention reads the first min(len, 512) entries
        assert (slots[r, :valid] >= 0).all() and (slots[r, valid:] == -1).all()
        want = pt[r, pos[r, :valid].long() // 64].long() * 64 + pos[r, :valid] % 64
        assert torch.equal(slots[r, :valid].long(), want)
    assert torch.equal(slots[1, :40].long() % 64, torch.arange(40))  # short row: every position, in order


@pytest.mark.parametrize("case", ["extend", "fp4", "hisparse", "idle", "heads", "not_forced"])
def test_indexer_cases_ours_does_not_serve_go_to_sglang(forced, indexer_kernel, case):
    backend, layer, prepared, _ = indexer_world()
    mode = {"extend": "EXTEND", "idle": "IDLE"}.get(case, "DECODE")
    if case == "fp4":
        layer.use_fp4_indexer = True
    if case == "heads":
        layer.n_heads = 48
    if case == "hisparse":
        backend.hisparse_coordinator = object()
    if case == "not_forced":
        P._force = False
    calls = []
    SI.forward_c4_indexer(lambda *a, **k: calls.append((a, k)), backend, torch.zeros(3, 8), torch.zeros(3, 4),
                          layer, types.SimpleNamespace(forward_mode=Mode(mode)), q_lora_quant="qq")
    assert len(calls) == 1 and calls[0][1]["q_lora_quant"] == "qq"
    assert not indexer_kernel and not prepared
    assert (backend.forward_metadata.core_metadata.c4_sparse_page_indices == 12345).all()


# ---- 6. MXFP4 MoE adapter -----------------------------------------------------------------------------------
@pytest.fixture
def moe_world(monkeypatch):
    """Stand-ins for the SGLang MoE classes the adapter imports (their names are checked in section 1)."""
    class FusedMoE:
        def __init__(self, draft=True, ep=1, hidden=256, inter=128):
            self.is_draft, self.moe_ep_size, self.with_bias, self.num_fused_shared_experts = draft, ep, False, 0
            self.hidden_size, self.intermediate_size_per_partition = hidden, inter
            self.moe_runner_config = types.SimpleNamespace(
                activation="silu", is_gated=True, apply_router_weight_on_input=False, no_combine=False,
                swiglu_limit=10.0, gemm1_alpha=None, gemm1_clamp_limit=None)

    class Fp8MoEMethod:
        def __init__(self, cfg):
            self.is_fp4_expert = cfg.is_fp4_experts

    mods = {"sglang.srt.layers.moe.fused_moe_triton.layer": {"FusedMoE": FusedMoE},
            "sglang.srt.layers.quantization.fp8": {"Fp8MoEMethod": Fp8MoEMethod},
            "sglang.srt.layers.moe.token_dispatcher.standard":
                {"StandardCombineInput": namedtuple("StandardCombineInput", "hidden_states")}}
    for name, attrs in mods.items():
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, m)
    import pd.kernels.mxfp4_moe as km

    real = inspect.signature(km.fused_moe_mxfp4)
    seen = []

    def kernel(*args, **kw):
        real.bind(*args, **kw)
        seen.append((args, kw))
        return args[0] * 2

    monkeypatch.setattr(km, "fused_moe_mxfp4", kernel)
    return types.SimpleNamespace(FusedMoE=FusedMoE, Fp8MoEMethod=Fp8MoEMethod, seen=seen)


def _fp8_config(fp4=True, dequant=False):
    return types.SimpleNamespace(is_fp4_experts=fp4, dequant_fp4_to_fp8=dequant)


def test_draft_mxfp4_experts_get_our_method_whatever_sglang_chose(forced, moe_world):
    cfg = _fp8_config()
    fp8 = moe_world.Fp8MoEMethod(cfg)
    trtllm = types.SimpleNamespace(_fp8=fp8)  # e.g. Mxfp4FlashinferTrtllmMoEMethod(fp8_method, prefix)
    for chosen in (fp8, trtllm):
        m = SX.get_quant_method(lambda c, layer, prefix: chosen, cfg, moe_world.FusedMoE(), "model.decoder.mlp.experts")
        assert isinstance(m, SX.PdserveMxfp4MoEMethod) and m._fp8 is fp8 and m.prefix == "model.decoder.mlp.experts"
        assert m.fuse_routed_scaling_factor_in_topk and m.runner is None and m.get_moe_runner_backend(None) is None


@pytest.mark.parametrize("case", ["target_layer", "not_fp4", "dequantized", "unquantized_layer", "not_moe",
                                  "expert_parallel", "odd_size", "not_forced"])
def test_other_layers_keep_sglangs_method(forced, moe_world, case):
    cfg = _fp8_config(fp4=case != "not_fp4", dequant=case == "dequantized")
    layer = moe_world.FusedMoE(draft=case != "target_layer", ep=4 if case == "expert_parallel" else 1,
                               inter=96 if case == "odd_size" else 128)
    chosen = moe_world.Fp8MoEMethod(cfg)
    if case == "unquantized_layer":
        chosen = types.SimpleNamespace()  # UnquantizedFusedMoEMethod for a skipped layer
    if case == "not_moe":
        layer = object()
    if case == "not_forced":
        P._force = False
    assert SX.get_quant_method(lambda c, l, p: chosen, cfg, layer, "x") is chosen


def test_our_moe_method_loads_like_sglang_and_calls_the_kernel(moe_world):
    made = []
    fp8 = types.SimpleNamespace(create_weights=lambda *a, **k: made.append((a, k)))
    m = SX.PdserveMxfp4MoEMethod(fp8, "p")
    layer = moe_world.FusedMoE()
    m.create_weights(layer, 4, 256, 64, torch.bfloat16, weight_loader="wl", with_bias=False)
    assert made == [((layer, 4, 256, 64, torch.bfloat16), {"weight_loader": "wl", "with_bias": False})]
    # what Fp8MoEMethod registers for MXFP4 experts (E=4, H=256, I=64), scales loaded as powers of two
    g = torch.Generator().manual_seed(0)
    exps13 = torch.randint(-20, 5, (4, 128, 8), generator=g)
    layer.w13_weight = torch.nn.Parameter(torch.randint(-128, 127, (4, 128, 128), dtype=torch.int8),
                                          requires_grad=False)
    layer.w2_weight = torch.nn.Parameter(torch.randint(-128, 127, (4, 256, 32), dtype=torch.int8), requires_grad=False)
    layer.w13_weight_scale_inv = torch.nn.Parameter(torch.pow(2.0, exps13.float()), requires_grad=False)
    layer.w2_weight_scale_inv = torch.nn.Parameter(torch.full((4, 256, 2), 0.5), requires_grad=False)
    w13_bits = layer.w13_weight.data.clone()
    m.create_moe_runner(layer, layer.moe_runner_config)
    m.process_weights_after_loading(layer)
    assert torch.equal(layer.w13_weight.data, w13_bits)  # packed weights used as loaded
    assert torch.equal(layer.w13_weight_scale_inv.data, (exps13 + 127).to(torch.uint8))
    assert (layer.w2_weight_scale_inv.data == 126).all()
    hs = torch.randn(5, 256).bfloat16()
    tw, ti = torch.rand(5, 6), torch.randint(0, 4, (5, 6), dtype=torch.int32)
    dispatch = types.SimpleNamespace(hidden_states=hs, topk_output=(tw, ti, None))
    out = m.apply(layer, dispatch)
    ((args, kw),) = moe_world.seen
    assert args == (hs, layer.w13_weight, layer.w13_weight_scale_inv, layer.w2_weight, layer.w2_weight_scale_inv,
                    tw, ti)
    assert kw == {"swiglu_limit": 10.0, "max_scale_byte": int(exps13.max()) + 127, "weight_layout": "sglang"}
    assert torch.equal(out.hidden_states, hs * 2)


def test_our_moe_method_prepares_the_sm90_layout_at_load(moe_world, monkeypatch):
    """On sm_90 with scales <= 2 the packed weights are reordered in place and the kernel is told so: into
    sm90_tiled (weights and UE8M0 scales in 32-row tiles) when H and I are multiples of 256, else sm90_bits; with a
    scale > 2 they stay as loaded."""
    from pd.kernels.mxfp4_moe import prepare_mxfp4_weights_sm90, tile_mxfp4_scales

    monkeypatch.setattr(SX, "is_sm90", lambda dev: True)
    for exp, hidden, inter, layout in ((1.0, 512, 512, "sm90_tiled"), (1.0, 512, 384, "sm90_bits"),
                                       (2.0, 512, 512, "sglang")):  # K / 32 = 16: two scale tiles per row
        layer = moe_world.FusedMoE()
        w13 = torch.randint(-128, 127, (2, 2 * inter, hidden // 2), dtype=torch.int8)
        w2 = torch.randint(-128, 127, (2, hidden, inter // 2), dtype=torch.int8)
        s13 = torch.full((2, 2 * inter, hidden // 32), 2.0 ** exp)
        s13[1, 5:40, 3:11] = 0.25  # not uniform: the tiling must move these bytes
        s2 = torch.full((2, hidden, inter // 32), 0.5)
        s2[0, 33:70, 5:] = 1.0
        layer.w13_weight = torch.nn.Parameter(w13.clone(), requires_grad=False)
        layer.w2_weight = torch.nn.Parameter(w2.clone(), requires_grad=False)
        layer.w13_weight_scale_inv = torch.nn.Parameter(s13.clone(), requires_grad=False)
        layer.w2_weight_scale_inv = torch.nn.Parameter(s2.clone(), requires_grad=False)
        m = SX.PdserveMxfp4MoEMethod(None, "p")
        m.create_moe_runner(layer, layer.moe_runner_config)
        ptr = layer.w13_weight.data.data_ptr()
        m.process_weights_after_loading(layer)
        assert m.weight_layout == layout and layer.w13_weight.data.data_ptr() == ptr
        want13, want2 = (w13, w2) if layout == "sglang" else \
            prepare_mxfp4_weights_sm90(w13, w2, tiled=layout == "sm90_tiled")
        assert torch.equal(layer.w13_weight.data, want13) and torch.equal(layer.w2_weight.data, want2)
        u13, u2 = (torch.log2(sc).to(torch.int32) + 127 for sc in (s13, s2))  # the UE8M0 bytes
        if layout == "sm90_tiled":
            u13, u2 = tile_mxfp4_scales(u13.to(torch.uint8), u2.to(torch.uint8))
        assert torch.equal(layer.w13_weight_scale_inv.data.view(torch.uint8).int(), u13.int())
        assert torch.equal(layer.w2_weight_scale_inv.data.view(torch.uint8).int(), u2.int())
        moe_world.seen.clear()
        m.apply(layer, types.SimpleNamespace(hidden_states=torch.randn(1, hidden).bfloat16(),
                                             topk_output=(torch.rand(1, 2), torch.zeros(1, 2, dtype=torch.int32),
                                                          None)))
        assert moe_world.seen[0][1]["weight_layout"] == layout


def test_non_power_of_two_scales_are_refused_at_load(moe_world):
    layer = moe_world.FusedMoE()
    layer.w13_weight_scale_inv = torch.nn.Parameter(torch.tensor([1.0, 3.0]), requires_grad=False)
    layer.w2_weight_scale_inv = torch.nn.Parameter(torch.tensor([1.0]), requires_grad=False)
    with pytest.raises(ValueError, match="powers of two"):
        SX.PdserveMxfp4MoEMethod(None, "p").process_weights_after_loading(layer)
