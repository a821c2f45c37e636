"""The pdserve plugin applied to the pinned SGLang's own modules, run in a subprocess by
tests/test_sglang_plugin_live.py: ``python tests/sglang_live_cases.py TARGET...`` prints one JSON line per
record. A subprocess because TRITON_INTERPRET must be set before triton decorates any kernel, SGLang's
``load_plugins`` runs once per process, and its hooks are process-wide monkeypatches.

1. every TARGET resolves (imports) with the pinned SGLang (``resolve`` records);
2. SGLang's own ``load_plugins()`` (which ends in ``HookRegistry.apply_hooks()``) under each switch setting:
   which TARGETs it patched and with whose hooks (``switches``); SGLang's originals are put back after each;
3. with ``PDSERVE_KERNELS=1 PDSERVE_KERNELS_FORCE=1`` applied, each hooked call made the way SGLang's
   DeepSeek-V4 code makes it, next to SGLang's own function (the hook's ``__wrapped__``) on the same inputs:
   ``sparse_mla`` (vs SGLang's Triton sm_120 kernel under the interpreter and the fp64 reference),
   ``kernel_num_heads``, ``indexer`` (vs SGLang's torch indexer path) and ``moe`` (vs the MXFP4 torch reference).
Every record carries plain numbers; the test file holds the tolerances.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import pkgutil
import sys
import time
import traceback
import types

os.environ["TRITON_INTERPRET"] = "1"
# SGLang's own sm_120 paths on CPU: its Triton sparse decode (read at import), its torch indexer logits.
os.environ["SGLANG_SM120_FLASHMLA_BACKEND"] = "triton"
os.environ["SGLANG_FP8_PAGED_MQA_LOGITS_TORCH"] = "1"

import torch  # noqa: E402

_KEEP = []  # torch.library.Library objects live as long as the process


_T0 = time.monotonic()


def emit(name: str, **data) -> None:
    """One record; ``t`` is seconds since the script started (where the time goes, for the test's report)."""
    print(json.dumps({"name": name, **data, "t": round(time.monotonic() - _T0, 1)}), flush=True)


def declare_torchvision_ops() -> None:
    """Let torchvision import next to the CPU torch: its PyPI wheel's C ops link CUDA torch and do not load here,
    and its import then dies registering a fake kernel for ``torchvision::nms`` (and ``qnms``), which do not
    exist. Declaring those two schemas is enough for the pure-Python part SGLang's DeepSeek-V4 import path uses
    (``sglang.srt.configs`` -> InternVL's ``torchvision.transforms``); nothing here runs a torchvision op."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None:
        return  # SGLang's import then fails naming torchvision
    try:
        torch.ops.load_library(os.path.join(os.path.dirname(spec.origin), "_C.so"))
        return
    except OSError:
        pass
    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor qdets, Tensor qscores, float iou_threshold) -> Tensor")
    _KEEP.append(lib)


def rel(a, b) -> float:
    b = b.double()
    return float((a.double() - b).norm() / b.norm())


# ---- 1. targets -----------------------------------------------------------------------------------------------
def import_failure(target: str) -> str | None:
    """Why a module on ``target``'s path does not import (pkgutil.resolve_name reports only a missing attribute)."""
    parts = target.split(".")
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:
                return None  # not a module: the rest of the path are attributes
            return f"importing {name}: {type(e).__name__}: {e}"
        except Exception as e:  # noqa: BLE001
            return f"importing {name}: {type(e).__name__}: {e}"
    return None


def resolve_targets(targets):
    originals = {}
    for t in targets:
        try:
            originals[t] = pkgutil.resolve_name(t)
            emit("resolve", target=t, error=None)
        except Exception as e:  # noqa: BLE001 - reported to the test, which names the target
            emit("resolve", target=t, error=import_failure(t) or f"{type(e).__name__}: {e}",
                 trace=traceback.format_exc(limit=-3))
    return originals


def _owner(target: str):
    path, attr = target.rsplit(".", 1)
    return pkgutil.resolve_name(path), attr


def restore(originals) -> None:
    """Put SGLang's functions back where HookRegistry put its wrappers (the owner and every module that had
    imported the name, as HookRegistry's own propagation does)."""
    for t, orig in originals.items():
        owner, attr = _owner(t)
        cur = getattr(owner, attr)
        if cur is orig:
            continue
        setattr(owner, attr, orig)
        for mod in list(sys.modules.values()):
            if isinstance(mod, types.ModuleType):
                for k, v in list(vars(mod).items()):
                    if v is cur:
                        setattr(mod, k, orig)


class _Errors(logging.Handler):
    """SGLang's plugin loader only logs what fails (a plugin that raises, a target that does not resolve)."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.messages = []

    def emit(self, record):
        text = record.getMessage()
        if record.exc_info:
            text += ": " + "".join(traceback.format_exception_only(*record.exc_info[:2])).strip()
        self.messages.append(text)


SWITCH_ENVS = {
    "on": {"PDSERVE_KERNELS": "1"},
    "off": {"PDSERVE_KERNELS": "0"},
    "unset": {},
    "sparse_mla_off": {"PDSERVE_KERNELS": "1", "PDSERVE_SPARSE_MLA": "0"},
    "indexer_off": {"PDSERVE_KERNELS": "1", "PDSERVE_INDEXER": "0"},
    "mxfp4_moe_off": {"PDSERVE_KERNELS": "1", "PDSERVE_MXFP4_MOE": "0"},
}


def load_with(env: dict, originals) -> dict:
    """SGLang's ``load_plugins()`` in this process with ``env``; what it patched."""
    import sglang.srt.plugins as plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    for k in [k for k in os.environ if k.startswith("PDSERVE_")]:
        del os.environ[k]
    os.environ.update(env, SGLANG_PLUGINS="pdserve")
    HookRegistry.reset()
    plugins._plugins_loaded = False  # its once-per-process guard
    errors = _Errors()
    logging.getLogger("sglang").addHandler(errors)
    logging.getLogger("pdserve").addHandler(errors)
    try:
        plugins.load_plugins()
    finally:
        logging.getLogger("sglang").removeHandler(errors)
        logging.getLogger("pdserve").removeHandler(errors)
    patched = {}
    for t, orig in originals.items():
        now = pkgutil.resolve_name(t)
        if now is not orig and getattr(now, "__wrapped__", None) is orig:
            patched[t] = sorted({src.plugin_name for _, _, src in HookRegistry._hooks.get(t, []) if src})
    registered = sorted(HookRegistry._hooks)
    return dict(patched=patched, registered=registered, applied=sorted(HookRegistry._patched), errors=errors.messages)


def run_switches(originals) -> None:
    for name, env in SWITCH_ENVS.items():
        try:
            emit("switches", config=name, **load_with(env, originals))
        finally:
            restore(originals)


# ---- 3a. sparse-MLA decode --------------------------------------------------------------------------------------
def _counting(module, name: str):
    """Count the calls of ``module.name`` (the adapters look it up at call time)."""
    real = getattr(module, name)
    box = {"n": 0}

    def wrapper(*a, **k):
        box["n"] += 1
        return real(*a, **k)

    setattr(module, name, wrapper)
    return box


def _kv_pack(k):
    """bf16 [n, 512] -> SGLang's (fp8 nope, bf16 rope, UE8M0 scale bytes) pack: per 64 nope values the power of
    two >= amax / 448, as SGLang's quantizer (``sglang.test.kernels.deepseek_v4.k_cache_reference``) computes it."""
    from sglang.kernels.ops.kvcache.dsv4_main_kv_store import NopeFp8RopeBf16Pack

    nope = k[:, :448].float().view(-1, 7, 64)
    exp = torch.ceil(torch.log2(nope.abs().amax(-1).clamp_min(1e-8) / 448.0))
    q8 = (nope / torch.exp2(exp).unsqueeze(-1)).clamp(-448, 448).to(torch.float8_e4m3fn).view(-1, 448)
    return NopeFp8RopeBf16Pack(k_nope_fp8=q8.contiguous(), k_rope_bf16=k[:, 448:].contiguous(),
                               scale_k_nope_ue8m0=(exp.to(torch.int32) + 127).to(torch.uint8).contiguous())


def _pool(slots: int, page_size: int):
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4SingleKVPool

    return DeepSeekV4SingleKVPool(size=slots, page_size=page_size, dtype=torch.float8_e4m3fn, qk_nope_head_dim=448,
                                  qk_rope_head_dim=64, layer_num=1, device="cpu", enable_memory_saver=False)


def _fill(pool, slots, g):
    pool.set_key_buffer(0, slots, _kv_pack(torch.randn(slots.numel(), 512, generator=g).bfloat16()))


def _cache_view(pool):
    """``DeepseekV4AttnBackend._forward_attention``'s view of a pool's layer buffer: [pages, page_size, 1, 584]."""
    buf = pool.get_key_buffer(0)
    ps = pool.page_size
    return buf[:, : ps * 584].view(buf.shape[0], ps, 1, 584)


def _stale_past(idx, lengths, slots, g) -> None:
    """Fill the entries past each row's length with written slots, in place. The kernels read only the first
    ``topk_length`` entries (FlashMLA's contract; SGLang's graph-replayed index buffers keep stale entries there),
    so this changes nothing for a correct call and shows a length handed to the wrong cache."""
    past = torch.arange(idx.shape[1])[None, :] >= lengths[:, None]
    idx[past] = slots[torch.randint(0, slots.numel(), (int(past.sum()),), generator=g)].to(idx.dtype)


def sparse_mla_inputs(seq_lens, q_len, swa_page, extra_ratio, heads=16, seed=0):
    """Keyword arguments exactly as ``DeepseekV4AttnBackend._forward_attention`` hands them to
    ``flash_mla_with_kvcache_sm120`` for one layer, built with SGLang's own pieces: its KV pools
    (``DeepSeekV4SingleKVPool``, rows written by its Triton writer), its causal SWA window
    (``BuildCausalSwaPageIndices``: 128 tokens, -1 padded to 64), ``swa_topk_lengths = min(seq_len, 128)``, one
    query row per token (q_len 2 = two rows per request, the second seeing one more token), the compressed
    cache of a c4 (64-token pages) or c128 (2-token pages) layer with its own index rows, and the sink.
    Returns (kwargs, reference kwargs for ``sparse_mla_decode_ref``)."""
    from sglang.kernels.ops.attention.dsv4.attn_metadata_kernels import BuildCausalSwaPageIndices

    g = torch.Generator().manual_seed(seed)
    b = len(seq_lens)
    ctx = 512
    req_to_token = torch.zeros(b, ctx, dtype=torch.int32)
    for r, n in enumerate(seq_lens):
        req_to_token[r, :n] = torch.arange(n) + 1 + r * ctx
    full_to_swa = torch.full((b * ctx + 2,), -1, dtype=torch.int64)  # the last entry serves index -1
    used = torch.cat([req_to_token[r, max(0, n - 128):n] for r, n in enumerate(seq_lens)]).long()
    swa = _pool(512, swa_page)
    slots = torch.randperm(511, generator=g)[: used.numel()] + 1
    full_to_swa[used] = slots
    _fill(swa, slots, g)
    rows = torch.tensor([r for r in range(b) for _ in range(q_len)])
    casual = torch.tensor([n - q_len + 1 + s for n in seq_lens for s in range(q_len)], dtype=torch.int32)
    idx = BuildCausalSwaPageIndices.execute(
        req_to_token=req_to_token, full_to_swa_mapping=full_to_swa, req_pool_indices_repeated=rows,
        seq_lens_casual=casual, swa_window=128, page_index_aligned_size=64)
    t = rows.numel()
    lens = casual.clamp(max=128)
    _stale_past(idx, lens, slots, g)
    kw = dict(q=torch.randn(t, 1, heads, 512, generator=g).bfloat16(), k_cache=_cache_view(swa), head_dim_v=512,
              softmax_scale=512 ** -0.5, indices=idx.unsqueeze(1), topk_length=lens,
              # sinks of the size of the softmax's own log-sum-exp, so that dropping one shows
              attn_sink=4 + 2 * torch.randn(heads, generator=g), extra_k_cache=None, extra_indices_in_kvcache=None,
              extra_topk_length=None)
    ref = dict(page_size=swa_page)
    if extra_ratio:
        page = 256 // extra_ratio
        pool = _pool(128, page)
        cslots = torch.randperm(127, generator=g)[:96] + 1
        _fill(pool, cslots, g)
        width = 64
        eidx = torch.full((t, width), -1, dtype=torch.int32)
        elen = (casual // extra_ratio).clamp(max=width).to(torch.int32)
        for i in range(t):
            eidx[i, : elen[i]] = cslots[torch.randperm(96, generator=g)[: elen[i]]].int()
        _stale_past(eidx, elen, cslots, g)
        kw.update(extra_k_cache=_cache_view(pool), extra_indices_in_kvcache=eidx.unsqueeze(1), extra_topk_length=elen)
        ref.update(extra_page_size=page)
    return kw, ref


def run_sparse_mla() -> None:
    import sglang.kernels.ops.attention.flash_mla_sm120 as fm
    import sglang.kernels.ops.attention.flash_mla_sm120_triton as ft

    import pd.kernels.sparse_mla_decode as smd
    from pd.kernels.sparse_mla_reference import sparse_mla_decode_ref

    # Under the interpreter autotuning would run every config; any one computes the same, and the widest token
    # tile takes the fewest interpreted steps.
    tuner = ft._tiled_sparse_decode_kernel
    tuner.configs = [max(tuner.configs, key=lambda c: c.kwargs["BLOCK_T"])]
    hooked = fm.flash_mla_with_kvcache_sm120
    sglang_fn = getattr(hooked, "__wrapped__", None)
    ours = _counting(smd, "sparse_mla_decode")
    cases = {"decode_c4_swa256": dict(seq_lens=[150, 37], q_len=1, swa_page=256, extra_ratio=4),
             "verify_c4_swa64": dict(seq_lens=[131], q_len=2, swa_page=64, extra_ratio=4),
             "decode_c128_swa256": dict(seq_lens=[140], q_len=1, swa_page=256, extra_ratio=128)}
    for name, spec in cases.items():
        kw, rkw = sparse_mla_inputs(**spec)
        # A call ours does not take must reach SGLang's function unchanged, whichever backend that runs: its torch
        # one here, which takes a fraction of the Triton kernel's interpreted time.
        backend = "torch" if name.endswith("fallback") else "triton"
        fm._sm120_default_backend, saved = backend, fm._sm120_default_backend
        try:
            before = ours["n"]
            out = hooked(**kw)[0]
            calls = ours["n"] - before
            want = sglang_fn(**kw)[0] if sglang_fn is not None else None
        finally:
            fm._sm120_default_backend = saved
        u8 = lambda c: None if c is None else c.view(torch.uint8).as_strided(  # noqa: E731
            (c.shape[0], c.stride(0)), (c.stride(0), 1))  # the pool's [pages, page bytes] buffer
        ref, _ = sparse_mla_decode_ref(kw["q"], u8(kw["k_cache"]), kw["indices"], kw["topk_length"], kw["attn_sink"],
                                       kw["softmax_scale"], u8(kw["extra_k_cache"]), kw["extra_indices_in_kvcache"],
                                       kw["extra_topk_length"], **rkw)
        emit("sparse_mla", case=name, sglang_backend=backend, ours_calls=calls, wrapped=sglang_fn is not None,
             shape=list(out.shape), want_shape=None if want is None else list(want.shape), dtype=str(out.dtype),
             ours_vs_ref=rel(out, ref), sglang_vs_ref=None if want is None else rel(want, ref),
             ours_vs_sglang=None if want is None else rel(out, want),
             identical=None if want is None else bool(torch.equal(out, want)))


# ---- 3b. query-head padding ---------------------------------------------------------------------------------
def run_kernel_num_heads() -> None:
    from sglang.srt.models.deepseek_v4 import MqaAttentionBase

    import pd.kernels.sglang_plugin as P

    def attention(tp, dsv41=False):
        """A DeepSeek-V4-Flash attention layer's head fields at attention-TP ``tp`` (64 heads; the weights are not
        needed: ``_kernel_num_heads`` reads only these)."""
        m = MqaAttentionBase.__new__(MqaAttentionBase)
        torch.nn.Module.__init__(m)
        m.attn_tp_size, m.n_heads, m.n_local_heads, m.is_dsv41 = tp, 64, 64 // tp, dsv41
        return m

    hooked = MqaAttentionBase._kernel_num_heads
    sglang_fn = getattr(hooked, "__wrapped__", hooked)
    rows = []
    for tp, dsv41, tokens, force in ((4, False, 8, True), (4, False, 100, True), (1, False, 8, True),
                                     (4, True, 8, True), (4, False, 8, False)):
        m = attention(tp, dsv41)
        P._force = force
        try:
            rows.append(dict(tp=tp, dsv41=dsv41, tokens=tokens, force=force, ours=hooked(m, tokens),
                             sglang=sglang_fn(m, tokens), native=m.n_local_heads))
        finally:
            P._force = True
    emit("kernel_num_heads", wrapped=hooked is not sglang_fn, rows=rows)


# ---- 3c. C4 indexer ---------------------------------------------------------------------------------------------
def _index_k(pool, slots, g):
    """Keys quantized as SGLang's indexer stores them (fp8 values, one fp32 amax / 448 scale per token), written by
    the pool's own writer."""
    k = torch.randn(slots.numel(), 128, generator=g)
    scale = (k.abs().amax(-1, keepdim=True) / 448.0).float()
    pool.set_index_k_scale_buffer(0, slots, (k / scale).to(torch.float8_e4m3fn), scale)


class _Indexer:
    """The C4Indexer members ``forward_c4_indexer`` reads, with its projections replaced by a fixed mapping:
    ``x`` [T, 64] are the weight-projection outputs, ``q_lora`` [T, 64 * 128] the index query (so a call that
    hands the wrong rows or tensors gives other scores)."""

    use_fp4_indexer = False
    n_heads = 64
    layer_id = 0
    compressor = None

    def compute_weights(self, x, skip_scale=False):
        return x.float().unsqueeze(-1)

    def compute_q(self, q_lora, positions, weight, q_lora_quant=None):
        return q_lora.view(-1, 64, 128).to(torch.float8_e4m3fn), weight * 128 ** -0.5


_INDEX_POOLS: dict = {}


def indexer_world(mode: str, seed=0):
    """A backend built on SGLang's real C4IndexerBackendMixin, index-K pool, PagedIndexerMetadata and ForwardMode:
    request 0 has 700 compressed tokens (more than the 512 the top-k keeps), request 1 has 37."""
    from sglang.srt.layers.attention.dsa.dsa_topk_backend import DSATopKBackend
    from sglang.srt.layers.attention.dsv4.indexer import C4IndexerBackendMixin
    from sglang.srt.layers.attention.dsv4.metadata import PagedIndexerMetadata
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4IndexerPool
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    g = torch.Generator().manual_seed(seed)
    lens = (700, 37)
    if seed not in _INDEX_POOLS:  # written once: the modes share the cache
        pool = DeepSeekV4IndexerPool(size=16 * 64, page_size=64, dtype=torch.float8_e4m3fn, index_head_dim=128,
                                     layer_num=1, device="cpu", enable_memory_saver=False, use_fp4_indexer=False)
        pages = torch.randperm(15, generator=g) + 1
        tables = [pages[:11], pages[11:12]]
        for n, tab in zip(lens, tables):
            pos = torch.arange(n)
            _index_k(pool, tab[pos // 64].long() * 64 + pos % 64, g)
        _INDEX_POOLS[seed] = pool, tables
    pool, tables = _INDEX_POOLS[seed]
    q_len = 2 if mode == "TARGET_VERIFY" else 1
    width = 11
    page_table = torch.zeros(len(lens) * q_len, width, dtype=torch.int32)
    comp = []
    for r, (n, tab) in enumerate(zip(lens, tables)):
        for s in range(q_len):
            page_table[r * q_len + s, : tab.numel()] = tab
            comp.append(n - q_len + 1 + s)
    rows = page_table.shape[0]
    im = PagedIndexerMetadata(page_size=256, compressed_page_size=64, page_table=page_table,
                              compressed_seq_lens=torch.tensor(comp, dtype=torch.int32), use_topk_v2=False)
    core = types.SimpleNamespace(positions=torch.tensor(comp, dtype=torch.int64) * 4 - 1,
                                 c4_sparse_page_indices=torch.full((rows, 512), 12345, dtype=torch.int32),
                                 c4_sparse_raw_indices=torch.full((rows, 512), 12345, dtype=torch.int32))

    class Backend(C4IndexerBackendMixin):
        """DeepseekV4AttnBackend's members the mixin reads; SGLang's torch top-k."""

        def __init__(self):
            super().__init__()
            self.token_to_kv_pool = pool
            self.forward_metadata = types.SimpleNamespace(indexer_metadata=im, core_metadata=core)
            self.hisparse_coordinator = None
            self.dsa_topk_backend = DSATopKBackend.TORCH
            self.compressed = 0

        def forward_indexer_compressor(self, **_):
            self.compressed += 1  # the compressor writes the index-K cache; both paths run it once

    x = torch.rand(rows, 64, generator=g)
    q_lora = torch.randn(rows, 64 * 128, generator=g) * 3
    batch = types.SimpleNamespace(forward_mode=getattr(ForwardMode, mode))
    return Backend(), x, q_lora, batch, (pool, page_table, torch.tensor(comp))


def _tie_report(ours_raw, sglang_raw, scores, lens):
    """Rows where the two selections differ beyond ties: a position one side kept and the other dropped must score
    within 1e-2 (relative; SGLang's torch logits are bf16) of the row's 512th score (fp64 reference scores)."""
    bad, swaps = [], 0
    for r in range(ours_raw.shape[0]):
        n = int(lens[r])
        a, b = ours_raw[r], sglang_raw[r]
        if n <= 512:
            if not torch.equal(a, b):
                bad.append(dict(row=r, why="short row differs"))
            continue
        sa, sb = set(a.tolist()), set(b.tolist())
        if -1 in sa or -1 in sb or len(sa) != 512 or len(sb) != 512:
            bad.append(dict(row=r, why="not 512 distinct positions"))
            continue
        diff = sorted(sa ^ sb)
        swaps += len(diff) // 2
        kth = scores[r, :n].topk(512).values[-1]
        far = [p for p in diff if abs(float(scores[r, p] - kth)) > 1e-2 * abs(float(kth))]
        if far:
            bad.append(dict(row=r, why=f"{len(far)} positions differ beyond ties", sample=far[:5]))
    return bad, swaps


def run_indexer() -> None:
    from sglang.srt.layers.attention.dsv4.indexer import C4IndexerBackendMixin

    import pd.kernels.indexer as ki
    from pd.kernels.indexer_reference import index_scores_ref

    hooked = C4IndexerBackendMixin.forward_c4_indexer
    sglang_fn = getattr(hooked, "__wrapped__", None)
    ours = _counting(ki, "dsa_indexer_topk")
    for mode in ("DECODE", "TARGET_VERIFY", "EXTEND"):
        if sglang_fn is None:  # not hooked: nothing to compare
            emit("indexer", mode=mode, wrapped=False)
            continue
        backend, x, q_lora, batch, (pool, page_table, lens) = indexer_world(mode)
        core = backend.forward_metadata.core_metadata
        before = ours["n"]
        hooked(backend, x, q_lora, _Indexer(), batch, skip_compressor=False)
        calls = ours["n"] - before
        got_slots, got_raw = core.c4_sparse_page_indices.clone(), core.c4_sparse_raw_indices.clone()
        compressed = backend.compressed
        core.c4_sparse_page_indices.fill_(12345)
        core.c4_sparse_raw_indices.fill_(12345)
        sglang_fn(backend, x, q_lora, _Indexer(), batch, skip_compressor=False)
        want_slots, want_raw = core.c4_sparse_page_indices, core.c4_sparse_raw_indices
        q, w = _Indexer().compute_q(q_lora, None, _Indexer().compute_weights(x))
        scores = index_scores_ref(q.unsqueeze(1), w.view(-1, 1, 64), pool.get_index_k_with_scale_buffer(0),
                                  page_table, lens.to(torch.int32)).view(lens.numel(), -1)
        bad, swaps = _tie_report(got_raw, want_raw, scores, lens)
        # the slots must be the positions mapped through the page table, in both
        slots_ok = all(
            torch.equal(s, torch.where(raw >= 0, page_table.gather(1, (raw.clamp(min=0) // 64).long()).long() * 64
                                       + raw.clamp(min=0) % 64, -1).to(s.dtype))
            for s, raw in ((got_slots, got_raw), (want_slots, want_raw)))
        emit("indexer", mode=mode, ours_calls=calls, wrapped=sglang_fn is not None, compressor_runs=compressed,
             rows=int(lens.numel()), bad_rows=bad, swaps=swaps, slots_follow_page_table=slots_ok,
             identical=bool(torch.equal(got_slots, want_slots) and torch.equal(got_raw, want_raw)),
             untouched=int((got_slots == 12345).sum()))


# ---- 3d. MXFP4 MoE of the draft ---------------------------------------------------------------------------------
# DeepSeek-V4-Flash's quantization_config (config.json); the loader then marks the MXFP4 routed experts.
DSV4_QUANT_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "scale_fmt": "ue8m0",
                     "weight_block_size": [128, 128]}


@contextlib.contextmanager
def sglang_runtime():
    """The runtime state a model build reads (published ServerArgs, this process's ranks), as SGLang's own tests
    set it: ``RuntimeContext.override_server_args`` and ``ParallelContext.override``."""
    from sglang.srt.runtime_context import get_context, get_parallel

    with get_context().override_server_args(), \
            get_parallel().override(moe_ep_rank=0, moe_tp_rank=0, tp_rank=0, attn_tp_rank=0):
        yield


def run_moe() -> None:
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.layers.moe.token_dispatcher.standard import StandardDispatchOutput
    from sglang.srt.layers.moe.topk import StandardTopKOutput
    from sglang.srt.layers.moe.utils import draft_model_build_scope
    from sglang.srt.layers.quantization.fp8 import Fp8Config

    from pd.kernels.mxfp4_moe_reference import fused_moe_mxfp4_reference, quantize_mxfp4

    wrapped = hasattr(Fp8Config.get_quant_method, "__wrapped__")
    E, H, I, K = 4, 256, 128, 2  # noqa: E741
    with sglang_runtime():
        cfg = Fp8Config.from_config(DSV4_QUANT_CONFIG)
        cfg.is_fp4_experts, cfg.is_dsv4_fp4_experts, cfg.dequant_fp4_to_fp8 = True, True, False  # as the loader does

        def build(prefix):
            return FusedMoE(num_experts=E, hidden_size=H, intermediate_size=I, layer_id=0, top_k=K, quant_config=cfg,
                            prefix=prefix, params_dtype=torch.bfloat16, swiglu_limit=10.0)

        target = build("model.layers.3.mlp.experts")
        with draft_model_build_scope():  # what both draft workers wrap the MTP model's construction in
            draft = build("model.decoder.mlp.experts")
        params = {n: [list(p.shape), str(p.dtype)] for n, p in draft.named_parameters()}
        g = torch.Generator().manual_seed(0)
        w13, s13 = quantize_mxfp4(torch.randn(E, 2 * I, H, generator=g) * 0.05)
        w2, s2 = quantize_mxfp4(torch.randn(E, H, I, generator=g) * 0.05)
        # the checkpoint's bytes, the scales as SGLang loads them (fp32 powers of two)
        for name, v in (("w13_weight", w13.view(torch.int8)), ("w2_weight", w2.view(torch.int8)),
                        ("w13_weight_scale_inv", torch.exp2(s13.float() - 127)),
                        ("w2_weight_scale_inv", torch.exp2(s2.float() - 127))):
            getattr(draft, name).data.copy_(v)
        draft.quant_method.process_weights_after_loading(draft)
        hs = torch.randn(5, H, generator=g).bfloat16()
        tw = torch.rand(5, K, generator=g)
        ti = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(5)]).to(torch.int32)
        topk = StandardTopKOutput(topk_weights=tw, topk_ids=ti, router_logits=torch.zeros(5, E))
        combine = draft.quant_method.apply(draft, StandardDispatchOutput(hidden_states=hs, hidden_states_scale=None,
                                                                         topk_output=topk))
        ref = fused_moe_mxfp4_reference(hs, w13, s13, w2, s2, tw, ti, swiglu_limit=10.0)
        emit("moe", wrapped=wrapped, target_method=type(target.quant_method).__name__,
             draft_method=type(draft.quant_method).__name__, draft_is_draft=bool(draft.is_draft),
             target_is_draft=bool(target.is_draft), params=params,
             out_shape=list(combine.hidden_states.shape), out_dtype=str(combine.hidden_states.dtype),
             ours_vs_ref=rel(combine.hidden_states, ref))


def main(targets) -> None:
    declare_torchvision_ops()
    originals = resolve_targets(targets)
    if len(originals) != len(targets):
        return
    run_switches(originals)
    load_with({"PDSERVE_KERNELS": "1", "PDSERVE_KERNELS_FORCE": "1"}, originals)  # kept for the calls below
    for case in (run_sparse_mla, run_kernel_num_heads, run_indexer, run_moe):
        try:
            case()
        except Exception as e:  # noqa: BLE001 - one broken case must not hide the others
            emit(case.__name__.removeprefix("run_"), crash=f"{type(e).__name__}: {e}", trace=traceback.format_exc())


if __name__ == "__main__":
    main(sys.argv[1:])
