"""SGLang hooks for DeepSeek-V4 sparse-MLA decode on sm_120 -> ``pd.kernels.sparse_mla_decode``.

1. ``sglang.kernels.ops.attention.flash_mla_sm120.flash_mla_with_kvcache_sm120(**kwargs) -> (out, lse)``
   SGLang's sm_120 stand-in for FlashMLA's sparse decode; it dispatches to FlashInfer's CUTLASS kernel
   (default), a per-(batch, head) Triton kernel or torch (``SGLANG_SM120_FLASHMLA_BACKEND``).
   ``DeepseekV4AttnBackend._forward_attention`` calls it with keywords only, after viewing the caches:
     q [T, 1, H, 512] bf16 (T = query tokens; every token has its own index row),
     k_cache [pages, page_size, 1, 584] (fp8/uint8 view of the 584-byte DSv4 pages, page stride padded to 576),
     head_dim_v (512), softmax_scale (float), indices [T, 1, topk] int32 token ids (-1 = none),
     topk_length [T] int32, attn_sink [H] fp32, extra_k_cache / extra_indices_in_kvcache /
     extra_topk_length (the compressed c4/c128 cache of the layer, or None).
   The caller keeps only ``[0]`` (out [T, 1, H, 512] bf16).
   Adapter: same semantics as ours (FlashMLA's), so it only renames ``extra_indices_in_kvcache`` ->
   ``extra_indices``, adds the query axis to 3-D q / 2-D indices, makes indices/lengths int32 contiguous,
   flattens lengths to [T], cuts attn_sink to H and makes it fp32. Every DSv4 layer's call is ours: the SWA
   cache (256-token pages), and the compressed cache of c4 layers (64-token pages) and of c128 layers (256/128 =
   2 tokens per page; ``sparse_mla_decode.SUPPORTED_PAGE_SIZES`` is (2, 64, 256); on an H100, SGLang's Triton
   kernel took 14-181x our time on c128 calls, benchmarks/results/sparse_mla_c128.md). Calls whose caches our
   kernel does not read (another bytes-per-token layout, e.g. DSv4.1's 528/288; any other page size), a
   head_dim_v other than 512, a head count that is not a multiple of 16, or anything else the kernel's own
   checks refuse (ValueError, raised before any launch) go to SGLang's function; when
   that function's FlashInfer decode needs 64 padded heads (see 2.) the adapter pads q and attn_sink with
   zeros and cuts the output back.

2. ``sglang.srt.models.deepseek_v4.MqaAttentionBase._kernel_num_heads(self, num_tokens) -> int``
   How many query heads the attention kernel gets. With TP, sm_120 decode pads the per-rank heads
   (e.g. 16 at TP4) to 64 unless FlashInfer has a kernel for the native count; ours takes any multiple
   of 16, and 64 padded heads would cost it 4x the MMA work. Adapter: the native ``self.n_local_heads``
   when it is a multiple of 16 on a device the plugin serves (not for DSv4.1, whose caches we do not read),
   else SGLang's answer.
"""

from __future__ import annotations

import torch

from .sglang_plugin import fall_back, takes_device

KERNEL = "sparse_mla"
BYTES_PER_TOKEN = 584  # pd.kernels.sparse_mla_reference.BYTES_PER_TOKEN (DSv4 FP8 layout)
HEAD_DIM = 512
PAD_HEADS = 64  # what SGLang's FlashInfer sm_120 decode specialises on
# SGLang names the adapter reads at call time (checked against the pinned source by the contract tests).
SGLANG_NAMES = (
    "sglang.kernels.ops.attention.flash_mla_sm120.SM120_DECODE_MAX_TOKENS",
    "sglang.kernels.ops.attention.flash_mla_sm120._sm120_default_backend",
    "sglang.kernels.ops.attention.flash_mla_sm120.flashinfer_dsv4_decode_supports_num_heads",
)
SGLANG_MEMBERS = {"sglang.srt.models.deepseek_v4.MqaAttentionBase": ("n_local_heads", "is_dsv41")}
# keyword arguments the backend passes, and the ones flash_mla_with_kvcache_sm120 reads
SGLANG_KWARGS = ("q", "k_cache", "head_dim_v", "softmax_scale", "indices", "topk_length", "attn_sink",
                 "extra_k_cache", "extra_indices_in_kvcache", "extra_topk_length")


def _supported_page_sizes() -> tuple[int, ...]:
    from .sparse_mla_decode import SUPPORTED_PAGE_SIZES

    return tuple(SUPPORTED_PAGE_SIZES)


def _cache_problem(name: str, cache) -> str | None:
    if cache is None:
        return None
    if cache.dim() != 4 or cache.shape[2] != 1 or cache.shape[3] != BYTES_PER_TOKEN:
        return f"{name} {tuple(cache.shape)} is not the 584-byte DSv4 FP8 layout"
    if cache.shape[1] not in _supported_page_sizes():
        return f"{name} page size {cache.shape[1]} (ours: {_supported_page_sizes()})"
    if cache.dtype not in (torch.uint8, torch.int8, torch.float8_e4m3fn):
        return f"{name} dtype {cache.dtype}"
    return None


def unsupported_reason(kw: dict) -> str | None:
    """Why ``pd.kernels.sparse_mla_decode`` cannot serve this call (None when it can)."""
    q = kw["q"]
    if q.dtype != torch.bfloat16 or q.shape[-1] != HEAD_DIM or q.dim() not in (3, 4):
        return f"q {q.dtype} {tuple(q.shape)} (ours: bf16 [T, S, H, 512])"
    h = q.shape[-2]
    if h % 16 or not 16 <= h <= 128:
        return f"{h} query heads (ours: a multiple of 16 up to 128)"
    if kw.get("head_dim_v", HEAD_DIM) != HEAD_DIM:
        return f"head_dim_v {kw['head_dim_v']} (ours: 512)"
    return _cache_problem("k_cache", kw["k_cache"]) or _cache_problem("extra_k_cache", kw.get("extra_k_cache"))


def _index(t):
    """[T, topk] or [T, S, topk] int -> contiguous int32 [T, S, topk]."""
    if t is None:
        return None
    if t.dim() == 2:
        t = t.unsqueeze(1)
    return t.to(torch.int32).contiguous()


def _lengths(t, b):
    return None if t is None else t.reshape(b).to(torch.int32).contiguous()


def to_pdserve_args(kw: dict) -> dict:
    """SGLang's keyword arguments -> ``sparse_mla_decode`` keyword arguments (see the module docstring)."""
    q = kw["q"]
    q4 = q.unsqueeze(1) if q.dim() == 3 else q
    if q4.stride(-1) != 1 or q4.stride(2) != HEAD_DIM:
        q4 = q4.contiguous()
    b, _, h, _ = q4.shape
    sink = kw.get("attn_sink")
    if sink is not None:
        sink = sink.reshape(-1)[:h].float().contiguous()
    scale = kw.get("softmax_scale")
    extra = kw.get("extra_k_cache")
    return dict(
        q=q4,
        k_cache=kw["k_cache"],
        indices=_index(kw["indices"]),
        topk_length=_lengths(kw.get("topk_length"), b),
        attn_sink=sink,
        softmax_scale=None if scale is None else float(scale),
        extra_k_cache=extra,
        extra_indices=_index(kw.get("extra_indices_in_kvcache")) if extra is not None else None,
        extra_topk_length=_lengths(kw.get("extra_topk_length"), b) if extra is not None else None,
    )


def _needs_pad(mod, q) -> bool:
    """SGLang's FlashInfer decode specialises on 64 heads unless it has a kernel for this count."""
    tokens, h = q.shape[0], q.shape[-2]
    return (h < PAD_HEADS and tokens <= mod.SM120_DECODE_MAX_TOKENS and mod._sm120_default_backend == "flashinfer"
            and not mod.flashinfer_dsv4_decode_supports_num_heads(h, tokens))


def _sglang_call(original, kw: dict):
    """SGLang's own function, with q / attn_sink zero-padded to 64 heads when its decode kernel needs them."""
    import sglang.kernels.ops.attention.flash_mla_sm120 as mod

    q = kw["q"]
    if not _needs_pad(mod, q):
        return original(**kw)
    h = q.shape[-2]
    qp = q.new_zeros(*q.shape[:-2], PAD_HEADS, q.shape[-1])
    qp[..., :h, :] = q
    kw = dict(kw, q=qp)
    if kw.get("attn_sink") is not None:
        sink = kw["attn_sink"].new_zeros(PAD_HEADS)
        sink[:h] = kw["attn_sink"].reshape(-1)[:h]
        kw["attn_sink"] = sink
    out, lse = original(**kw)
    return out[..., :h, :], (None if lse is None else lse[:, :h])


def flash_mla_with_kvcache_sm120(original, *args, **kwargs):
    """AROUND hook of ``flash_mla_with_kvcache_sm120(**kwargs)``: our kernel when it can serve the call.

    Returns:
        (out [T, S, H, 512] bf16, lse [T, H, S] fp32) from ``pd.kernels.sparse_mla_decode.sparse_mla_decode``,
        or SGLang's result.
    """
    if args or not takes_device(kwargs["q"].device):
        return original(*args, **kwargs)
    reason = unsupported_reason(kwargs)
    if reason is None:
        from .sparse_mla_decode import sparse_mla_decode

        try:
            return sparse_mla_decode(**to_pdserve_args(kwargs))
        except ValueError as e:  # raised by the kernel's checks, before any launch
            reason = f"the kernel refused the call: {e}"
    fall_back(KERNEL, reason)
    return _sglang_call(original, kwargs)


def kernel_num_heads(original, self, num_tokens):
    """AROUND hook of ``MqaAttentionBase._kernel_num_heads``: native per-rank heads for our kernel."""
    n = original(self, num_tokens)
    native = self.n_local_heads
    if n == native or native % 16 or getattr(self, "is_dsv41", False):
        return n
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return native if takes_device(dev) else n
