"""SGLang hook for DeepSeek-V4's C4 lightning indexer on decode steps -> ``pd.kernels.indexer.dsa_indexer_topk``.

Target: ``sglang.srt.layers.attention.dsv4.indexer.C4IndexerBackendMixin.forward_c4_indexer(self, x, q_lora,
c4_indexer, forward_batch, alt_streams=None, enable_multi_stream=False, q_lora_ready=None, skip_compressor=False,
q_lora_quant=None) -> None`` (a method of ``DeepseekV4AttnBackend``, called by ``C4Indexer.forward`` in every
c4 layer). SGLang's version runs the indexer's compressor, builds the index query (``_forward_prepare_normal``
or ``_forward_prepare_multi_stream``: fp8 e4m3 q [T, 64, 128] and fp32 weights [T, 64, 1] that already carry
q's dequantization scale, ``weights_proj`` and 1/sqrt(128 * 64)), then scores every slot of the paged index-K
cache up to ``max_compressed_seq_len`` (DeepGEMM's ``fp8_paged_mqa_logits`` or a torch fallback: a [T,
max_len] logits matrix whose width is the configured context / 4 under CUDA graphs) and selects the top 512
into ``core_metadata.c4_sparse_page_indices`` [T, 512] int32 (slots of the c4 KV pool, -1 past
``min(len, 512)``; the c4 attention reads the first ``c4_sparse_topk_lengths`` entries).

Adapter (decode, target-verify and draft-extend-v2 steps, the ones CUDA graphs replay): the same compressor
and query preparation (SGLang's own methods, same arguments), then ``dsa_indexer_topk`` on
  q [T, 1, 64, 128] fp8, weights [T, 1, 64] fp32, the layer's index-K pages
  (``get_index_k_with_scale_buffer``: per 64-token page 64 x 128 fp8 values then 64 fp32 scales, DeepGEMM's
  paged layout), block_table = ``indexer_metadata.page_table`` [T, pages] int32, seq_lens =
  ``indexer_metadata.compressed_seq_lens`` [T] int32 (read on the device, so pages past a row's length
  are never touched), topk = the output width (512), page_size = ``compressed_page_size`` (64),
which returns request-local compressed positions [T, 1, 512] (valid ones first, -1 after). The adapter maps
them through the page table to pool slots (``page_table[t, p // 64] * 64 + p % 64``, as SGLang's
``topk_transform_paged`` does) and writes slots (and, when the metadata keeps them, the raw positions) in
place into the buffers the attention reads. Prefill rows, the FP4 index cache, hisparse, top-k capture and
head counts / page sizes the kernel does not take stay on SGLang's path (logged once); they are decided before
the query is prepared, so SGLang's method then runs from the start (the compressor runs once either way).
"""

from __future__ import annotations

import torch

from .sglang_plugin import fall_back, takes_device

KERNEL = "indexer"
INDEX_HEAD_DIM = 128
INDEX_BYTES_PER_TOKEN = INDEX_HEAD_DIM + 4  # fp8 values + one fp32 scale
SGLANG_NAMES = (
    "sglang.srt.state_capturer.indexer_topk.get_global_indexer_capturer",
    "sglang.srt.layers.attention.dsv4.indexer.C4IndexerBackendMixin._forward_prepare_normal",
    "sglang.srt.layers.attention.dsv4.indexer.C4IndexerBackendMixin._forward_prepare_multi_stream",
    "sglang.srt.mem_cache.deepseek_v4_memory_pool.DeepSeekV4TokenToKVPool.get_index_k_with_scale_buffer",
    "sglang.srt.model_executor.forward_batch_info.ForwardMode.is_decode",
    "sglang.srt.model_executor.forward_batch_info.ForwardMode.is_target_verify",
    "sglang.srt.model_executor.forward_batch_info.ForwardMode.is_draft_extend_v2",
    "sglang.srt.model_executor.forward_batch_info.ForwardMode.is_idle",
)
# class members the adapter reads (fields, properties, methods or attributes assigned in the class)
SGLANG_MEMBERS = {
    "sglang.srt.layers.attention.deepseek_v4_backend.DeepseekV4AttnBackend":
        ("forward_metadata", "token_to_kv_pool", "hisparse_coordinator"),
    "sglang.srt.layers.attention.dsv4.indexer.C4IndexerBackendMixin": ("debug_use_external_c4_sparse_indices",),
    "sglang.srt.layers.attention.dsv4.indexer.C4Indexer": ("use_fp4_indexer", "layer_id", "n_heads"),
    "sglang.srt.layers.attention.deepseek_v4_backend.DSV4Metadata": ("indexer_metadata", "core_metadata"),
    "sglang.srt.layers.attention.deepseek_v4_backend.DSV4AttnMetadata":
        ("positions", "c4_sparse_page_indices", "c4_sparse_raw_indices"),
    "sglang.srt.layers.attention.dsv4.metadata.PagedIndexerMetadata":
        ("page_table", "compressed_seq_lens", "compressed_page_size"),
    "sglang.srt.model_executor.forward_batch_info.ForwardBatch": ("forward_mode",),
}


def _decode_like(mode) -> bool:
    return mode.is_decode() or mode.is_target_verify() or mode.is_draft_extend_v2()


def unsupported_reason(backend, c4_indexer, forward_batch) -> str | None:
    """Why this call stays on SGLang's path (None when ours serves it)."""
    from sglang.srt.state_capturer.indexer_topk import get_global_indexer_capturer

    if not _decode_like(forward_batch.forward_mode):
        return f"{forward_batch.forward_mode.name} rows (ours serves decode / target-verify / draft-extend-v2)"
    if c4_indexer.use_fp4_indexer:
        return "the FP4 index-K cache (ours reads the fp8 + fp32-scale layout)"
    from .indexer import SUPPORTED_HEADS, SUPPORTED_PAGE_SIZES

    if c4_indexer.n_heads not in SUPPORTED_HEADS:
        return f"{c4_indexer.n_heads} index heads (ours: {SUPPORTED_HEADS})"
    page = backend.forward_metadata.indexer_metadata.compressed_page_size
    if page not in SUPPORTED_PAGE_SIZES:
        return f"index-K page size {page} (ours: {SUPPORTED_PAGE_SIZES})"
    if getattr(backend, "hisparse_coordinator", None) is not None:
        return "hierarchical sparse attention (hisparse) swaps pages after the top-k"
    if get_global_indexer_capturer() is not None:
        return "indexer top-k capture is on"
    return None


def _rows(t, n: int, fill: int):
    """SGLang's match_num_queries: the first n rows, padded with ``fill``."""
    if t.shape[0] >= n:
        return t[:n]
    pad = t.new_full((n - t.shape[0], *t.shape[1:]), fill)
    return torch.cat([t, pad])


def positions_to_slots(pos, page_table, page_size: int):
    """Request-local positions [T, K] (-1 = none) -> pool slots [T, K] int32 through page_table [T, P]."""
    valid = pos >= 0
    p = pos.clamp(min=0).long()
    pages = torch.gather(page_table, 1, p // page_size)
    slots = pages.long() * page_size + p % page_size
    return torch.where(valid, slots, -1).to(torch.int32)


def forward_c4_indexer(original, self, x, q_lora, c4_indexer, forward_batch, alt_streams=None,
                       enable_multi_stream=False, q_lora_ready=None, skip_compressor=False, q_lora_quant=None,
                       **extra):
    """AROUND hook of ``C4IndexerBackendMixin.forward_c4_indexer``; see the module docstring."""
    def sglang():
        kw = dict(alt_streams=alt_streams, enable_multi_stream=enable_multi_stream, q_lora_ready=q_lora_ready,
                  skip_compressor=skip_compressor, **extra)
        if q_lora_quant is not None:
            kw["q_lora_quant"] = q_lora_quant
        return original(self, x, q_lora, c4_indexer, forward_batch, **kw)

    if extra or forward_batch.forward_mode.is_idle() or self.debug_use_external_c4_sparse_indices \
            or not takes_device(x.device):
        return sglang()
    reason = unsupported_reason(self, c4_indexer, forward_batch)
    if reason is not None:
        fall_back(KERNEL, reason)
        return sglang()

    metadata = self.forward_metadata
    im, core = metadata.indexer_metadata, metadata.core_metadata
    positions = core.positions
    n = min(x.shape[0], q_lora.shape[0], positions.shape[0])
    if q_lora.shape[0] != n:
        q_lora_quant = None  # quantized for the untrimmed rows
    x, q_lora, positions = x[:n], q_lora[:n], positions[:n]
    if enable_multi_stream:
        q, weights = self._forward_prepare_multi_stream(
            x=x, q_lora=q_lora, c4_indexer=c4_indexer, positions=positions, forward_batch=forward_batch,
            alt_streams=alt_streams, q_lora_ready=q_lora_ready)
    else:
        q, weights = self._forward_prepare_normal(
            x=x, q_lora=q_lora, c4_indexer=c4_indexer, positions=positions, forward_batch=forward_batch,
            skip_compressor=skip_compressor, q_lora_quant=q_lora_quant)

    rows = q.shape[0]
    seq_lens = _rows(im.compressed_seq_lens.reshape(-1), rows, 1).to(torch.int32)
    page_table = _rows(im.page_table, rows, 0).to(torch.int32)
    out_slots = core.c4_sparse_page_indices
    topk = out_slots.shape[1]
    cache = self.token_to_kv_pool.get_index_k_with_scale_buffer(layer_id=c4_indexer.layer_id)

    from .indexer import dsa_indexer_topk

    pos = dsa_indexer_topk(q.unsqueeze(1), weights.reshape(rows, 1, -1).float(), cache, page_table, seq_lens,
                           topk=topk, page_size=im.compressed_page_size)
    pos = pos.reshape(rows, topk)
    keep = min(rows, out_slots.shape[0])
    out_slots[:keep].copy_(positions_to_slots(pos[:keep], page_table[:keep], im.compressed_page_size))
    raw = core.c4_sparse_raw_indices
    if raw is not None:
        raw[:keep].copy_(pos[:keep])
