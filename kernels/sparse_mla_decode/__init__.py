"""Head-batched sparse-MLA decode on the DeepSeek-V4 FP8 paged KV cache (Triton; sm_120a and sm_90a).

``sparse_mla_decode(q, k_cache, indices, ...) -> (out, lse)`` is a drop-in for FlashMLA's sparse decode
(``flash_mla_with_kvcache(q, k_cache, None, None, 512, meta, indices=..., topk_length=..., attn_sink=...,
extra_k_cache=..., extra_indices_in_kvcache=..., extra_topk_length=...)``). The KV layout, the softmax scale
default (1/sqrt(512)), the sink (``out *= 1 / (1 + exp(sink - lse))``, lse without the sink) and the lse
units (natural log; +inf and out = 0 for a row with no usable token) are documented in
``pd.kernels.sparse_mla_reference``, the fp64 torch reference.

Kernel: one program per (batch * query token, block of BLOCK_H >= 16 heads, topk split). It walks its share
of the selected tokens BLOCK_N at a time: gathers the 584-byte records of the tile once, dequantizes them to a
[BLOCK_N, 512] bf16 tile (fp8 nope * 2**(e - 127), bf16 rope), and does S = Q K^T and O += P K with ``tl.dot``
for all BLOCK_H heads at once (MLA: K = V = the 512-wide latent), with an online softmax in base 2. When
(batch * query tokens * head blocks) is too small to fill the GPU the topk is split across programs, each
writing a normalized partial output and its lse, and ``_combine_kernel`` merges them by log-sum-exp (the extra
cache is just more splits), launched as a programmatic dependent of the split kernel on compute capability >= 9
(``SparseMLAConfig.combine_pdl``). Work past ``topk_length`` is skipped, not masked.

``_sparse_mla_fwd_chunked_kernel`` handles the 512 columns as 8 chunks of 64 (no [N, 512] fp32 tile);
``_sparse_mla_fwd_pipelined_kernel`` is the same math with every load inside the loop, so Triton's software
pipeliner gathers the next tiles' records with cp.async into shared memory while this tile is computed, and
dequantizes fp8 by bit moves in inline PTX (_E4M3_BITS_ASM, see _deq_scaled for why that also keeps the loads
pipelined). The default path runs the pipelined kernel for 16-head programs (mma.sync; sm_120 and sm_90) and,
on sm_90 only, for 64-head programs (64-row dots lower to wgmma; 165 KiB shared memory): DEFAULT_CONFIG_SM90,
picked at run time from the device capability. sm_120's configs (DEFAULT_CONFIG, CONFIGS_PIPELINED, CONFIGS)
fit 99 KiB.

The switches of a launch are one frozen ``SparseMLAConfig`` (``DEFAULT_SPARSE_MLA_CONFIG`` ships), passed as
``mla_config=``. Modules: ``configs`` (tile tables, the heads-per-program pick, ``SparseMLAConfig``),
``jit_helpers``, ``kernels`` (the kernel bodies), ``launch``. The torch reference is
``pd.kernels.sparse_mla_reference``.
"""

from __future__ import annotations

from .configs import (
    CONFIGS,
    CONFIGS_PIPELINED,
    CONFIGS_SM90,
    DEFAULT_CONFIG,
    DEFAULT_CONFIG_SM90,
    DEFAULT_SPARSE_MLA_CONFIG,
    SUPPORTED_PAGE_SIZES,
    TWO_PER_SM_CONFIG_16,
    SparseMLAConfig,
    _default_config,
    _pick_block_h,
)
from .jit_helpers import _E4M3_BITS_ASM, _deq_scaled
from .kernels import (
    _combine_kernel,
    _sparse_mla_fwd_chunked_kernel,
    _sparse_mla_fwd_kernel,
    _sparse_mla_fwd_pipelined_kernel,
)
from .launch import LOG2E, sparse_mla_decode

__all__ = [
    "CONFIGS", "CONFIGS_PIPELINED", "CONFIGS_SM90", "DEFAULT_CONFIG", "DEFAULT_CONFIG_SM90",
    "DEFAULT_SPARSE_MLA_CONFIG", "LOG2E", "SUPPORTED_PAGE_SIZES", "TWO_PER_SM_CONFIG_16", "SparseMLAConfig",
    "_E4M3_BITS_ASM", "_combine_kernel", "_default_config", "_deq_scaled", "_pick_block_h",
    "_sparse_mla_fwd_chunked_kernel", "_sparse_mla_fwd_kernel", "_sparse_mla_fwd_pipelined_kernel",
    "sparse_mla_decode",
]
