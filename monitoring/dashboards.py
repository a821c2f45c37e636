"""The Grafana dashboards: "PD overview" (one request's stages, traffic, KV transfer,
speculative decoding) and "Workers" (health, restarts, in-flight, queues, KV usage, prefix cache hit
rate and the kv_aware router's index accuracy, circuit state, speculative step time and draft KV).

Query conventions, so the same panels work on the reference engine and on SGLang, on prefill and
decode alike:

- Engine role = SGLang's ``engine_type`` label (prefill / decode / unified); every engine query
  aggregates with an explicit ``sum/max by (...)`` of labels both engine kinds export, so extra
  rank labels (tp_rank, moe_ep_rank, dp_rank, ...) never split or break a panel.
- Request-level engine counters (tokens, TTFT, E2E) select ``engine_type=~"decode|unified"``: the
  PD prefill counts every request too (see pd.monitoring.promql.REQUEST_ENGINES).
- KV transfer size/latency come from the prefill (the sender records them in SGLang).
"""

from __future__ import annotations

from pd.monitoring import grafana as g
from pd.monitoring.promql import REQUEST_ENGINES, sel
from pd.monitoring.rules import SLO
from pd.monitoring.stages import (
    ENGINE_E2E_STAGE,
    ENGINE_FILTERS,
    ENGINE_ITL_STAGE,
    ENGINE_STAGE,
    ENGINE_TTFT_STAGE,
    ROUTER_FILTER,
    STAGE,
    STAGES,
    Stage,
)

RATE = "$__rate_interval"
OVERVIEW_UID = "pdserve-pd-overview"
WORKERS_UID = "pdserve-workers"

# The panels `pdserve render-dashboard` draws (titles in the PD overview).
MAIN_PANELS = ("Per-stage latency p50", "Per-stage latency p99", "Mean time per stage", "Requests by status")

# Panels under a row whose title starts so read metrics SGLang does not export: empty against SGLang workers.
REFERENCE_ONLY_ROW = "Reference engine only"
SPEC_STEP = "pdserve_spec_step_seconds"  # the reference engine's histogram of a speculative step's phases
ENGINE_GAUGE = "sglang:num_running_reqs"  # every engine exports it from start: the variables' source
PREFILL = 'engine_type="prefill"'
COMPUTE_ENGINES = 'engine_type=~"prefill|unified"'  # the engines that compute prompts (and cache them)
STATUS_5XX = 'status=~"5.."'


# The P:D split controller (planner: in the cluster config): what it decided, advise mode included, and each
# move's outcome, marked on every time panel of the overview (pd.cluster.worker_metrics exports both counters).
SPLIT_ANNOTATIONS = [
    g.annotation("P:D split decisions",
                 'sum by (action, reason) (increase(pdserve_planner_decisions_total{action!="hold"}[1m])) > 0',
                 "planner: {{action}}", "reason: {{reason}}"),
    g.annotation("P:D split moves", "sum by (outcome) (increase(pdserve_planner_moves_total[1m])) > 0",
                 "worker move: {{outcome}}", "outcome: {{outcome}}", color="rgba(242, 73, 92, 1)"),
]


def _variables(router: bool) -> list[dict]:
    vs = []
    if router:
        vs.append(g.query_variable("endpoint", "Endpoint", "pdserve_router_ttft_seconds_count", "endpoint"))
    vs += [
        g.query_variable("model", "Model", ENGINE_GAUGE, "model_name"),
        g.query_variable("role", "Role", sel(ENGINE_GAUGE, 'model_name=~"$model"'), "engine_type"),
        g.query_variable("instance", "Engine", sel(ENGINE_GAUGE, 'model_name=~"$model"', 'engine_type=~"$role"'),
                         "instance"),
    ]
    return vs


def _eng(name: str, *matchers: str) -> str:
    """An engine metric selector with the dashboard's model/role/instance filters."""
    return sel(name, *matchers, *ENGINE_FILTERS)


def _quantiles(stage: Stage) -> list[dict]:
    return [g.target(stage.quantile(q), f"p{round(q * 100)}") for q in (0.5, 0.9, 0.99)]


def _stage_row(title: str, main: Stage, extra: list[tuple[Stage, float]], description: str,
               slo: float | None = None, heat: Stage | None = None) -> list[dict]:
    """A row: ``main``'s p50/p90/p99 plus ``extra`` stages at one quantile each, and a heatmap."""
    targets = _quantiles(main) + [g.target(s.quantile(q), f"{s.title} p{round(q * 100)}") for s, q in extra]
    heat = heat or main
    return [
        g.row(title),
        g.timeseries(f"{title}: p50 / p90 / p99", targets, unit="s", log=True, slo=slo, w=14,
                     description=description),
        g.heatmap(f"{title}: distribution ({heat.title})", f"sum by (le) ({heat.buckets()})",
                  unit="s" if heat.hist.scale == 1 else "ms", w=10,
                  description=f"Requests per second in each latency bucket of {heat.hist.metric}."),
    ]


def overview(slo: SLO) -> dict:
    """The "PD overview" dashboard."""
    requests = sel("pdserve_router_requests_total", ROUTER_FILTER)
    requests_5xx = sel("pdserve_router_requests_total", ROUTER_FILTER, STATUS_5XX)
    items = [
        g.row("One request, stage by stage"),
        g.timeseries("Per-stage latency p50", [g.target(s.quantile(0.5), s.title) for s in STAGES], unit="s",
                     log=True, w=12, h=10, description="Median time of each stage of a PD request, in request "
                     "order: router queue, prefill, KV transfer, decode wait, TTFT, inter-token latency, TPOT, E2E."),
        g.timeseries("Per-stage latency p99", [g.target(s.quantile(0.99), s.title) for s in STAGES], unit="s",
                     log=True, w=12, h=10, description="p99 of each stage of a PD request, in request order."),
        g.bargauge("Mean time per stage", [g.target(s.mean(), s.title) for s in STAGES], w=12, h=10,
                   description="Mean seconds spent in each stage over the rate window (from _sum / _count)."),
        g.timeseries("Requests by status",
                     [g.target(f"sum by (endpoint, status) (rate({requests}[{RATE}]))", "{{endpoint}} {{status}}")],
                     unit="reqps", stack=True, w=12, h=10,
                     description="Router responses per second by endpoint and HTTP status."),
        *_stage_row("Router queue", STAGE["router_queue"], [],
                    "Arrival at the router to dispatch to both workers (body parse, pair pick, rooms)."),
        *_stage_row("Prefill", STAGE["router_prefill"],
                    [(STAGE["prefill_bootstrap"], 0.99), (STAGE["prefill_forward"], 0.99)],
                    "Router: dispatch to the prefill's response fully read. Engine: waiting for the decode's "
                    "bootstrap, then the forward pass."),
        *_stage_row("KV transfer", STAGE["kv_transfer"],
                    [(Stage("kv_stage", "Prefill transfer stage", ENGINE_STAGE,
                            ('stage="prefill_transfer_kv_cache"',)), 0.99),
                     (STAGE["decode_transferred"], 0.99)],
                    "Prefill -> decode KV write (transfer engine), as measured by the prefill; the decode's wait "
                    "for the KV to arrive."),
        *_stage_row("Decode wait", STAGE["decode_waiting"],
                    [(STAGE["decode_bootstrap"], 0.99), (STAGE["decode_transferred"], 0.99)],
                    "Decode: KV page preallocation, waiting for the KV, then waiting for a decode batch slot."),
        *_stage_row("TTFT", STAGE["ttft"], [(ENGINE_TTFT_STAGE, 0.5), (ENGINE_TTFT_STAGE, 0.99)],
                    "Time to first token at the router (first decode byte of a stream, or the whole response) "
                    "and at the decode engine.", slo=slo.ttft_p99),
        *_stage_row("Inter-token latency / TPOT", STAGE["inter_token"],
                    [(ENGINE_ITL_STAGE, 0.5), (ENGINE_ITL_STAGE, 0.99), (STAGE["tpot"], 0.5), (STAGE["tpot"], 0.99)],
                    "Router: gap between streamed chunks. Engine: per-token decode latency (all requests) and "
                    "per-request TPOT.", slo=slo.itl_p99, heat=ENGINE_ITL_STAGE),
        *_stage_row("E2E", STAGE["e2e"], [(ENGINE_E2E_STAGE, 0.99)],
                    "Arrival to the last byte at the router; the decode engine's view."),
        g.row("Traffic"),
        g.timeseries("Errors by kind",
                     [g.target("sum by (endpoint, kind) "
                               f"(rate({sel('pdserve_router_errors_total', ROUTER_FILTER)}[{RATE}]))",
                               "{{endpoint}} {{kind}}")], unit="reqps", w=8,
                     description="Failed requests per second: invalid_request, over_limit, payload_too_large, "
                     "body_timeout, unauthorized, no_worker, {prefill,decode}_{status,connect,timeout}, "
                     "decode_stream, client_disconnect."),
        g.timeseries("Error ratio (5xx)",
                     [g.target(f"(sum(rate({requests_5xx}[{RATE}])) or vector(0)) / sum(rate({requests}[{RATE}]))",
                               "5xx ratio")],
                     unit="percentunit", slo=slo.error_ratio, w=8),
        g.timeseries("Tokens per second",
                     [g.target(f"sum(rate({_eng('sglang:prompt_tokens_total', REQUEST_ENGINES)}[{RATE}]))",
                               "prompt (engine)"),
                      g.target(f"sum(rate({_eng('sglang:generation_tokens_total', REQUEST_ENGINES)}[{RATE}]))",
                               "generated (engine)"),
                      g.target(f"sum(rate({sel('pdserve_router_prompt_tokens_total', ROUTER_FILTER)}[{RATE}]))",
                               "prompt (router)"),
                      g.target(f"sum(rate({sel('pdserve_router_completion_tokens_total', ROUTER_FILTER)}[{RATE}]))",
                               "completion (router)")],
                     unit="short", w=8, description="Tokens in (prompt) and out (generated) per second, counted once "
                     "per request (decode side) and at the router."),
        g.timeseries("Requests in flight",
                     [g.target("sum(pdserve_router_requests_in_flight)", "router"),
                      g.target("sum by (role) (pdserve_router_worker_inflight)", "router -> {{role}} workers"),
                      g.target(f"sum by (engine_type) ({_eng('sglang:num_running_reqs')})",
                               "{{engine_type}} engines running")],
                     w=8),
        g.timeseries("Retries",
                     [g.target("sum by (endpoint) "
                               f"(rate({sel('pdserve_router_retries_total', ROUTER_FILTER)}[{RATE}]))",
                               "{{endpoint}}")], unit="reqps", w=8,
                     description="Requests the router re-dispatched to another worker pair."),
        g.timeseries("Request rate by engine role",
                     [g.target(f"sum by (engine_type) (rate({_eng('sglang:num_requests_total')}[{RATE}]))",
                               "{{engine_type}}")],
                     unit="reqps", w=8, description="Requests finished per second as each engine role counts them "
                     "(prefill and decode each count every PD request once)."),
        g.row("KV transfer"),
        g.timeseries("KV transfer throughput",
                     [g.target(f"sum by (instance) (rate({_eng('sglang:kv_transfer_total_mb_sum', PREFILL)}[{RATE}]))"
                               " * 1048576", "{{instance}}")], unit="Bps", w=8,
                     description="Bytes per second each prefill writes to decodes "
                     "(SGLang's kv_transfer_total_mb, MiB)."),
        g.timeseries("KV transfer speed per request",
                     [g.target(f"histogram_quantile({q}, sum by (le) "
                               f"(rate({_eng('sglang:kv_transfer_speed_gb_s_bucket')}[{RATE}])))",
                               f"p{round(q * 100)}") for q in (0.1, 0.5, 0.9)], unit="GBs", w=8,
                     description="Per-request transfer speed (GB/s) as the prefill measures it."),
        g.timeseries("KV transfer and bootstrap failures",
                     [g.target("sum by (instance, engine_type) "
                               f"(rate({_eng('sglang:num_transfer_failed_reqs_total')}[{RATE}]))",
                               "transfer {{engine_type}} {{instance}}"),
                      g.target("sum by (instance, engine_type) "
                               f"(rate({_eng('sglang:num_bootstrap_failed_reqs_total')}[{RATE}]))",
                               "bootstrap {{engine_type}} {{instance}}")], unit="reqps", w=8),
        g.row("Speculative decoding (--speculative-algorithm; empty without it)"),
        g.timeseries("Speculative accept length",
                     [g.target(f"avg by (instance) ({_eng('sglang:spec_accept_length', REQUEST_ENGINES)})",
                               "{{instance}}")], w=12,
                     description="Per decode worker: tokens emitted per verify step (accepted drafts + the target's "
                     "bonus token), averaged over its last verify steps (SGLang's spec_accept_length; "
                     "--speculative-num-steps + 1 at most)."),
        g.timeseries("Speculative accept rate",
                     [g.target(f"avg by (instance) ({_eng('sglang:spec_accept_rate', REQUEST_ENGINES)})",
                               "{{instance}}")], unit="percentunit", w=12,
                     description="Per decode worker: accepted draft tokens / proposed draft tokens over its last "
                     "verify steps (SGLang's spec_accept_rate)."),
    ]
    return g.dashboard(OVERVIEW_UID, "pdserve: PD overview",
                       "Per-stage latency of prefill-decode disaggregated requests (router + engines).",
                       _variables(router=True), items, links=[_link("Workers", WORKERS_UID)],
                       annotations=SPLIT_ANNOTATIONS)


def workers() -> dict:
    """The "Workers" dashboard."""
    worker = 'worker=~"$worker"'
    items = [
        g.row("Worker state"),
        g.state_timeline("Health (router probe)",
                         [g.target(f"min by (role, worker) ({sel('pdserve_router_worker_healthy', worker)})",
                                   "{{role}} {{worker}}")],
                         {0: ("unhealthy", "red"), 1: ("healthy", "green")}, w=12),
        g.state_timeline("Circuit breaker (router)",
                         [g.target(f"max by (role, worker) ({sel('pdserve_router_worker_circuit_state', worker)})",
                                   "{{role}} {{worker}}")],
                         {0: ("closed", "green"), 1: ("half-open", "yellow"), 2: ("open", "red")}, w=12),
        g.stat("Engine restarts (since launch)",
               [g.target(f"max by (worker_name, role) ({sel('pdserve_worker_restarts_total', worker)})",
                         "{{worker_name}}")],
               w=8, description="Engine restarts by each worker actor (launcher's exporter)."),
        g.state_timeline("Worker state (launcher)",
                         [g.target(f"max by (worker_name) ({sel('pdserve_worker_ready', worker)})", "{{worker_name}}")],
                         {0: ("not ready", "red"), 1: ("ready", "green")}, w=8),
        g.state_timeline("Scrape targets up",
                         [g.target('min by (component, instance) (up{job="pdserve"})', "{{component}} {{instance}}")],
                         {0: ("down", "red"), 1: ("up", "green")}, w=8),
        g.row("Load"),
        g.timeseries("In flight per worker (router)",
                     [g.target(f"sum by (role, worker) ({sel('pdserve_router_worker_inflight', worker)})",
                               "{{role}} {{worker}}")],
                     w=8),
        g.timeseries("Policy decisions per worker",
                     [g.target("sum by (role, policy, worker) "
                               f"(rate({sel('pdserve_router_policy_decisions_total', worker)}[{RATE}]))",
                               "{{role}} {{worker}} ({{policy}})")], unit="reqps", w=8),
        g.timeseries("Running requests",
                     [g.target(f"sum by (engine_type, instance) ({_eng('sglang:num_running_reqs')})",
                               "{{engine_type}} {{instance}}")],
                     w=8),
        g.timeseries("Queue depth",
                     [g.target(f"sum by (engine_type, instance) ({_eng('sglang:num_queue_reqs')})",
                               "{{engine_type}} {{instance}}")],
                     w=8, description="Requests waiting for a forward batch."),
        g.timeseries("PD queues",
                     [g.target(f"sum by (instance) ({_eng('sglang:num_prefill_bootstrap_queue_reqs')})",
                               "prefill bootstrap {{instance}}"),
                      g.target(f"sum by (instance) ({_eng('sglang:num_decode_prealloc_queue_reqs')})",
                               "decode prealloc {{instance}}"),
                      g.target(f"sum by (instance) ({_eng('sglang:num_decode_transfer_queue_reqs')})",
                               "decode transfer {{instance}}")],
                     w=8, description="Prefills waiting for their decode's bootstrap; decodes waiting for KV pages; "
                     "decodes waiting for the KV to arrive."),
        g.timeseries("Tokens per second per engine",
                     [g.target(f"sum by (instance) (rate({_eng('sglang:prompt_tokens_total', PREFILL)}[{RATE}]))",
                               "prefill in {{instance}}"),
                      g.target("sum by (instance) "
                               f"(rate({_eng('sglang:generation_tokens_total', REQUEST_ENGINES)}[{RATE}]))",
                               "decode out {{instance}}")], w=8),
        g.row("KV cache"),
        g.timeseries("KV token usage",
                     [g.target(f"max by (engine_type, instance) ({_eng('sglang:token_usage')})",
                               "{{engine_type}} {{instance}}")],
                     unit="percentunit", w=12, description="Fraction of the KV pool in use (max over ranks)."),
        g.timeseries("KV tokens in use",
                     [g.target(f"max by (engine_type, instance) ({_eng('sglang:num_used_tokens')})",
                               "{{engine_type}} {{instance}}")],
                     w=12),
        *_prefix_cache_row(worker),
        g.row("Speculative decoding (--speculative-algorithm; empty without it)"),
        g.timeseries("Verify steps per second",
                     [g.target(f"sum by (engine_type, instance) (rate({_eng('sglang:spec_verify_calls_total')}"
                               f"[{RATE}]))", "{{engine_type}} {{instance}}")],
                     unit="ops", w=12, description="Speculative verify steps (one target forward each) per decode "
                     "worker, counted when a request finishes (SGLang's spec_verify_calls)."),
        g.timeseries("Speculative depth (steps / draft tokens)",
                     [g.target(f"max by (instance) ({_eng('sglang:spec_num_steps')})", "steps {{instance}}"),
                      g.target(f"max by (instance) ({_eng('sglang:spec_num_draft_tokens')})",
                               "draft tokens {{instance}}")],
                     w=12, description="The depth each decode worker speculates at now: "
                     "speculative_num_steps and speculative_num_draft_tokens. Fixed unless --speculative-adaptive, "
                     "which moves it with the decode batch size and the running accept length (0: no drafting)."),
        g.row(f"{REFERENCE_ONLY_ROW}: speculative step phases and the draft's KV pool"),
        g.timeseries("Speculative step time (draft / verify / extend)",
                     [g.target(f"sum by (instance, phase) (rate({_eng(SPEC_STEP + '_sum')}[{RATE}])) / "
                               f"sum by (instance, phase) (rate({_eng(SPEC_STEP + '_count')}[{RATE}]))",
                               "{{phase}} mean {{instance}}"),
                      g.target(f"histogram_quantile(0.99, sum by (le, instance, phase) "
                               f"(rate({_eng(SPEC_STEP + '_bucket')}[{RATE}])))", "{{phase}} p99 {{instance}}")],
                     unit="s", log=True, w=12,
                     description="One speculative step per decode worker, by phase: draft (the draft model proposes "
                     "--speculative-num-steps tokens), verify (one target forward over the window, then acceptance), "
                     "extend (the draft re-run on the accepted tokens)."),
        g.timeseries("Draft KV pages held",
                     [g.target(f"max by (engine_type, instance) ({_eng('pdserve_draft_kv_pages_held')})",
                               "{{engine_type}} {{instance}}")],
                     w=12, description="Pages of the draft model's KV pool in use; with no request running it "
                     "returns to 0 (rejected drafts' pages are released or reused)."),
    ]
    variables = [g.query_variable("worker", "Worker (router view)", "pdserve_router_worker_healthy", "worker"),
                 *_variables(router=False)]
    return g.dashboard(WORKERS_UID, "pdserve: Workers",
                       "Per-worker health, restarts, load, queues, KV usage and prefix cache.",
                       variables, items, links=[_link("PD overview", OVERVIEW_UID)])


def _prefix_cache_row(worker: str) -> list[dict]:
    """The "Prefix cache" row of the Workers dashboard: each prefill's hit rate (engine) and how well the router's
    ``kv_aware`` index (pd.router.kv_aware) predicts it; ``worker`` is the router-side worker matcher."""
    predicted = sel("pdserve_router_kv_predicted_cached_tokens_total", worker)
    reported = sel("pdserve_router_kv_reported_cached_tokens_total", worker)
    return [
        g.row("Prefix cache (index panels: --prefill-policy kv_aware; empty without it)"),
        g.timeseries("Cache hit rate per worker",
                     [g.target(f"max by (instance) ({_eng('sglang:cache_hit_rate', COMPUTE_ENGINES)})",
                               "{{instance}}")],
                     unit="percentunit", w=8, description="Cached prompt tokens over prompt tokens of each prefill "
                     "(SGLang: of its last prefill batches; reference engine: of its last prefill)."),
        g.timeseries("Index accuracy (predicted / reported cached tokens)",
                     [g.target(f"sum by (worker) (rate({predicted}[{RATE}])) / "
                               f"sum by (worker) (rate({reported}[{RATE}]))", "{{worker}}")],
                     unit="percentunit", w=8, description="Prompt tokens the router's kv_aware index expected each "
                     "prefill to serve from its cache, over the cached_tokens its answers reported: 100% is an exact "
                     "index; above, the router counts pages the prefill evicted or never stored; below, it misses "
                     "pages the prefill holds."),
        g.timeseries("Cached prompt tokens per second (kv_aware)",
                     [g.target(f"sum by (worker) (rate({predicted}[{RATE}]))", "predicted {{worker}}"),
                      g.target(f"sum by (worker) (rate({reported}[{RATE}]))", "reported {{worker}}")],
                     w=8, description="The two sides of the index accuracy: tokens the router predicted cached, "
                     "tokens the prefill reported cached."),
        g.timeseries("KV events lag (kv_aware)",
                     [g.target(f"max by (worker) ({sel('pdserve_router_kv_events_lag_seconds', worker)})",
                               "{{worker}}")],
                     unit="s", w=8, description="Seconds since the router last received a KV event batch from each "
                     "prefill (-1: none yet). It grows while a prefill stores nothing new; a prefill that goes "
                     "silent after being sent uncached pages falls back to estimates after --kv-stale-secs."),
        g.timeseries("Router index size (kv_aware)",
                     [g.target(f"max by (worker) ({sel('pdserve_router_kv_index_blocks', worker)})", "{{worker}}")],
                     w=8, description="KV pages the router's index says each prefill holds, from its events; "
                     "on an idle reference engine it equals the engine's pdserve_kv_pages_cached."),
        g.timeseries("kv_aware fallbacks",
                     [g.target(f"sum by (reason) (rate(pdserve_router_kv_fallbacks_total[{RATE}]))", "{{reason}}")],
                     unit="reqps", w=8, description="Decisions (no_token_ids, no_live_events) or workers "
                     "(worker_events_stale) the router estimated as cache_aware does instead of from KV events."),
    ]


def _link(title: str, uid: str) -> dict:
    return {"title": title, "type": "link", "url": f"/d/{uid}", "keepTime": True, "includeVars": False,
            "targetBlank": False, "asDropdown": False, "icon": "dashboard", "tags": [], "tooltip": ""}


def all_dashboards(slo: SLO) -> dict[str, dict]:
    """File name -> dashboard."""
    return {"pd-overview.json": overview(slo), "workers.json": workers()}
