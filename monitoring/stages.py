"""The stages of one PD request, in order, and the latency histogram that measures each.

One table feeds the recording rules (one ``..._bucket:rate1m`` series per histogram), the PD
overview dashboard (per-stage p50/p90/p99 and heatmaps) and ``pdserve render-dashboard``.

Where each stage is measured (router: router/metrics.py; engine: SGLang's
``sglang:per_stage_req_latency_seconds`` stage values, sglang/srt/observability/req_time_stats.py,
which the reference engine exports under the same names):

- router queue: arrival at the router -> dispatch to both workers;
- prefill (router): dispatch -> the prefill's response fully read;
- prefill bootstrap: the prefill waits for its decode to register the room;
- prefill forward: the prefill's forward pass;
- KV transfer: the prefill writes the KV into the decode's pages (``sglang:kv_transfer_latency_ms``);
- decode prealloc (``decode_bootstrap``): the decode reserves KV pages and registers;
- decode waits for KV (``decode_transferred``): registration -> KV arrived;
- decode queue (``decode_waiting``): KV arrived -> first decode step;
- TTFT, inter-token latency, TPOT, E2E: at the router (what clients see) and at the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from pd.monitoring.promql import REQUEST_ENGINES, quantile, sel
from pd.util.pd_stages import BY_LABEL

# Labels the recorded bucket rates keep (besides ``le``). Everything else (SGLang's tp_rank,
# pp_rank, moe_ep_rank, dp_rank, priority, is_streaming, custom labels) is summed away, so
# engines with different label sets aggregate into the same series.
ROUTER_BY = ("instance", "endpoint")
ENGINE_BY = ("instance", "model_name", "engine_type")

# Grafana variable filters (the dashboards define $endpoint, $model, $role, $instance).
ROUTER_FILTER = 'endpoint=~"$endpoint"'
ENGINE_FILTERS = ('model_name=~"$model"', 'engine_type=~"$role"', 'instance=~"$instance"')


@dataclass(frozen=True)
class Histogram:
    """One source histogram and its recorded per-second bucket rates.

    Attributes:
        metric: the histogram's base name (``<metric>_bucket`` is what is scraped).
        record: the recording rule's name for ``sum by (le, *by) (rate(<metric>_bucket[1m]))``.
        by: labels the recording keeps besides ``le``.
        side: ``router`` or ``engine`` (which dashboard filters apply).
        scale: factor to seconds (0.001 for a milliseconds histogram).
    """

    metric: str
    record: str
    by: tuple[str, ...]
    side: str
    scale: float = 1.0

    def recording_expr(self) -> str:
        """PromQL of the recording rule ``record``."""
        return f"sum by ({', '.join(('le',) + self.by)}) (rate({self.metric}_bucket[1m]))"


def _router(stage: str) -> Histogram:
    return Histogram(f"pdserve_router_{stage}_seconds", f"pdserve:router_{stage}_seconds_bucket:rate1m", ROUTER_BY,
                     "router")


ROUTER_QUEUE = _router("queue")
ROUTER_PREFILL = _router("prefill")
ROUTER_TTFT = _router("ttft")
ROUTER_ITL = _router("inter_token")
ROUTER_E2E = _router("e2e")
ENGINE_STAGE = Histogram("sglang:per_stage_req_latency_seconds", "pdserve:engine_stage_seconds_bucket:rate1m",
                         ENGINE_BY + ("stage",), "engine")
ENGINE_TTFT = Histogram("sglang:time_to_first_token_seconds", "pdserve:engine_ttft_seconds_bucket:rate1m",
                        ENGINE_BY, "engine")
ENGINE_ITL = Histogram("sglang:inter_token_latency_seconds", "pdserve:engine_itl_seconds_bucket:rate1m",
                       ENGINE_BY, "engine")
ENGINE_TPOT = Histogram("sglang:request_time_per_output_token_seconds", "pdserve:engine_tpot_seconds_bucket:rate1m",
                        ENGINE_BY, "engine")
ENGINE_E2E = Histogram("sglang:e2e_request_latency_seconds", "pdserve:engine_e2e_seconds_bucket:rate1m",
                       ENGINE_BY, "engine")
ENGINE_KV_TRANSFER = Histogram("sglang:kv_transfer_latency_ms", "pdserve:engine_kv_transfer_latency_ms_bucket:rate1m",
                               ENGINE_BY, "engine", scale=0.001)

HISTOGRAMS = (ROUTER_QUEUE, ROUTER_PREFILL, ROUTER_TTFT, ROUTER_ITL, ROUTER_E2E,
              ENGINE_STAGE, ENGINE_TTFT, ENGINE_ITL, ENGINE_TPOT, ENGINE_E2E, ENGINE_KV_TRANSFER)


@dataclass(frozen=True)
class Stage:
    """One stage of a request as the dashboards show it.

    Attributes:
        key: short id (``router_queue``).
        title: legend / panel title.
        hist: where it is measured.
        matchers: fixed label matchers on the recorded series (the engine stage, the role).
    """

    key: str
    title: str
    hist: Histogram
    matchers: tuple[str, ...] = ()

    def filters(self) -> tuple[str, ...]:
        """Label matchers for this stage's histogram: its own plus the router's or the engines' filter."""
        extra = (ROUTER_FILTER,) if self.hist.side == "router" else ENGINE_FILTERS
        return self.matchers + extra

    def buckets(self) -> str:
        """The recorded bucket rates of this stage, with the dashboard's variable filters."""
        return sel(self.hist.record, *self.filters())

    def quantile(self, q: float) -> str:
        """PromQL for the stage's q-quantile in seconds, over everything the filters select."""
        return quantile(q, self.buckets(), scale=self.hist.scale)

    def mean(self, window: str = "$__rate_interval") -> str:
        """PromQL for the stage's mean in seconds over ``window`` (from ``_sum`` / ``_count``)."""
        ms = self.filters()
        s = f"sum(rate({sel(self.hist.metric + '_sum', *ms)}[{window}]))"
        c = f"sum(rate({sel(self.hist.metric + '_count', *ms)}[{window}]))"
        expr = f"{s} / {c}"
        return expr if self.hist.scale == 1 else f"({expr}) * {self.hist.scale:g}"


def _engine_stage(label: str) -> Stage:
    """The engine stage ``label`` of pd.util.pd_stages, with its title there."""
    return Stage(label, BY_LABEL[label].title, ENGINE_STAGE, (f'stage="{label}"',))


# The request's path through the system, in order.
STAGES = (
    Stage("router_queue", "Router queue", ROUTER_QUEUE),
    Stage("router_prefill", "Prefill (router: dispatch to prefill done)", ROUTER_PREFILL),
    _engine_stage("prefill_bootstrap"),
    _engine_stage("prefill_forward"),
    # the prefill's KV write from its transfer histogram (milliseconds, every transfer) rather than the stage label
    Stage("kv_transfer", "KV transfer", ENGINE_KV_TRANSFER, ('engine_type="prefill"',)),
    _engine_stage("decode_bootstrap"),
    _engine_stage("decode_transferred"),
    _engine_stage("decode_waiting"),
    Stage("ttft", "TTFT (router)", ROUTER_TTFT),
    Stage("inter_token", "Inter-token latency (router)", ROUTER_ITL),
    Stage("tpot", "TPOT (engine)", ENGINE_TPOT, (REQUEST_ENGINES,)),
    Stage("e2e", "E2E (router)", ROUTER_E2E),
)
STAGE = {s.key: s for s in STAGES}

# Engine-side views of the client-facing latencies (decode/unified only: the PD prefill does not
# observe TTFT and its E2E is only its own part).
ENGINE_TTFT_STAGE = Stage("engine_ttft", "TTFT (engine)", ENGINE_TTFT, (REQUEST_ENGINES,))
ENGINE_ITL_STAGE = Stage("engine_itl", "Inter-token latency (engine)", ENGINE_ITL, (REQUEST_ENGINES,))
ENGINE_E2E_STAGE = Stage("engine_e2e", "E2E (engine)", ENGINE_E2E, (REQUEST_ENGINES,))
