"""The engine-side stages of one PD request, in order: SGLang's label values of
``sglang:per_stage_req_latency_seconds`` (sglang/srt/observability/req_time_stats.py; the reference engine observes
the same), the role whose engines observe each, the short name ``pdserve bench`` reports it under and the title
the dashboards show. One table: the engine's metrics (pd.engines.metrics), the dashboards (pd.monitoring.stages)
and the bench's stage split (pd.bench.stages) read it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStage:
    """One stage: ``label`` SGLang's stage label value, ``role`` prefill or decode, ``name`` the bench's short name,
    ``title`` the dashboards' legend."""

    label: str
    role: str
    name: str
    title: str


ENGINE_STAGES = (
    EngineStage("prefill_bootstrap", "prefill", "prefill_bootstrap", "Prefill waits for decode bootstrap"),
    EngineStage("prefill_forward", "prefill", "prefill", "Prefill forward"),
    EngineStage("prefill_transfer_kv_cache", "prefill", "kv_transfer", "Prefill writes the KV"),
    EngineStage("decode_bootstrap", "decode", "decode_prealloc", "Decode KV prealloc"),
    EngineStage("decode_transferred", "decode", "decode_kv_wait", "Decode waits for KV"),
    EngineStage("decode_waiting", "decode", "decode_wait", "Decode queue"),
)
BY_LABEL = {s.label: s for s in ENGINE_STAGES}
