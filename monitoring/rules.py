"""Prometheus recording and alerting rules (written to monitoring/rules.yml by the generator).

Recording rules pre-aggregate the dashboards' heavy queries: per-second bucket rates of every
latency histogram (monitoring/stages.py) over 1m, summed to a few labels, so a panel's quantile
or heatmap reads a handful of series instead of every bucket of every engine rank. Alerts use
5m windows and hold for a while before firing so one slow request does not page anyone.

SLO thresholds are arguments (``python -m pd.monitoring.generate --ttft-p99-slo 1.5 ...``); the
committed rules.yml uses the defaults of :class:`SLO`.
"""

from __future__ import annotations

from dataclasses import dataclass

from pd.monitoring.promql import REQUEST_ENGINES, quantile, sel
from pd.monitoring.stages import ENGINE_ITL, HISTOGRAMS, ROUTER_TTFT

ACCEPT_LENGTH = "sglang:spec_accept_length"

TTFT_P99 = "pdserve:router_ttft_seconds:p99_5m"
ACCEPT_5M = "pdserve:spec_accept_length:avg5m"
ACCEPT_BASELINE = "pdserve:spec_accept_length:baseline1h"
ITL_P99 = "pdserve:engine_itl_seconds:p99_5m"
ERROR_RATIO = "pdserve:router_error_ratio:5m"


@dataclass(frozen=True)
class SLO:
    """Alert thresholds.

    Attributes:
        ttft_p99: seconds; router TTFT p99 over 5m above this for 5m fires PdserveTTFTP99AboveSLO.
        itl_p99: seconds; decode inter-token latency p99 over 5m above this for 5m fires
            PdserveInterTokenP99AboveSLO.
        error_ratio: fraction of router responses with HTTP 5xx over 5m (PdserveErrorRatioHigh).
        accept_drop: fraction; a decode worker whose accepted drafts per verify step (accept length - 1) over 5m
            fall below this fraction of its own 1h baseline for 5m fires PdserveSpecAcceptanceCollapsed.
    """

    ttft_p99: float = 2.0
    itl_p99: float = 0.1
    error_ratio: float = 0.05
    accept_drop: float = 0.5

    def __post_init__(self):
        for name in ("ttft_p99", "itl_p99", "error_ratio", "accept_drop"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("error_ratio", "accept_drop"):
            if getattr(self, name) >= 1:
                raise ValueError(f"{name} must be < 1, got {getattr(self, name)}")


def recording_rules() -> list[dict]:
    """Per-histogram 1m bucket rates (monitoring/stages.py), then the SLO quantiles and error ratio."""
    rules = [{"record": h.record, "expr": h.recording_expr()} for h in HISTOGRAMS]
    requests = "pdserve_router_requests_total"
    total = f"sum by (endpoint) (rate({requests}[5m]))"
    rules += [
        {"record": TTFT_P99,
         "expr": quantile(0.99, f"rate({ROUTER_TTFT.metric}_bucket[5m])", by=("endpoint",))},
        {"record": ITL_P99,
         "expr": quantile(0.99, f"rate({sel(ENGINE_ITL.metric + '_bucket', REQUEST_ENGINES)}[5m])",
                          by=("model_name",))},
        # `or 0 * total`: 0 (not nothing) while there are requests and no 5xx.
        {"record": ERROR_RATIO,
         "expr": f'(sum by (endpoint) (rate({requests}{{status=~"5.."}}[5m])) or 0 * {total}) / {total}'},
        # A decode's accept length now, and its own baseline: the hour before the last 15m (so a collapse does not
        # drag its own baseline down while the alert waits out its `for`).
        {"record": ACCEPT_5M,
         "expr": f"avg by (instance, model_name) (avg_over_time({sel(ACCEPT_LENGTH, REQUEST_ENGINES)}[5m]))"},
        {"record": ACCEPT_BASELINE,
         "expr": f"avg by (instance, model_name) (avg_over_time({sel(ACCEPT_LENGTH, REQUEST_ENGINES)}[1h] "
                 "offset 15m))"},
    ]
    return rules


def acceptance_collapse(drop: float) -> str:
    """A decode worker's accepted drafts per verify step (accept length - 1, so depth-normalised enough that an
    adaptive depth moving between tiers does not fire it) below ``drop`` x its baseline's, while its baseline
    shows a working draft (>= 0.5 accepted drafts per step), it still verifies (requests finished with verify
    steps in the last 10m) and drafts (current depth > 0: an adaptive depth of 0 emits 1 token per step)."""
    on = "on (instance, model_name)"
    return (f"({ACCEPT_5M} - 1) < {drop:g} * ({ACCEPT_BASELINE} - 1)"
            f" and {on} ({ACCEPT_BASELINE} - 1) >= 0.5"
            f" and {on} sum by (instance, model_name) "
            f"(increase({sel('sglang:spec_verify_calls_total', REQUEST_ENGINES)}[10m])) > 0"
            f" and {on} max by (instance, model_name) ({sel('sglang:spec_num_steps', REQUEST_ENGINES)}) > 0")


def _alert(name: str, expr: str, for_: str, severity: str, summary: str, description: str) -> dict:
    return {"alert": name, "expr": expr, "for": for_, "labels": {"severity": severity},
            "annotations": {"summary": summary, "description": description}}


def alerting_rules(slo: SLO) -> list[dict]:
    """Every alert (monitoring/rules_test.yml tests each one)."""
    return [
        _alert("PdserveTTFTP99AboveSLO", f"{TTFT_P99} > {slo.ttft_p99:g}", "5m", "warning",
               f"TTFT p99 on {{{{ $labels.endpoint }}}} is above the {slo.ttft_p99:g}s SLO",
               "Router time to first token p99 over 5m is {{ $value | humanizeDuration }}. Look at the PD overview's "
               "per-stage panels: router queue, prefill bootstrap/forward, KV transfer or decode queue."),
        _alert("PdserveInterTokenP99AboveSLO", f"{ITL_P99} > {slo.itl_p99:g}", "5m", "warning",
               f"Inter-token latency p99 of {{{{ $labels.model_name }}}} is above the {slo.itl_p99:g}s SLO",
               "Decode inter-token latency p99 over 5m is {{ $value | humanizeDuration }} (decode batch too large, "
               "or a slow decode kernel)."),
        _alert("PdserveErrorRatioHigh", f"{ERROR_RATIO} > {slo.error_ratio:g}", "5m", "critical",
               f"More than {slo.error_ratio:.0%} of {{{{ $labels.endpoint }}}} requests fail with 5xx",
               "{{ $value | humanizePercentage }} of router responses on {{ $labels.endpoint }} were 5xx over 5m; "
               "pdserve_router_errors_total by kind says which side failed."),
        _alert("PdserveWorkerUnhealthy", "min by (worker, role) (pdserve_router_worker_healthy) == 0", "1m", "critical",
               "{{ $labels.role }} worker {{ $labels.worker }} fails the router's health probe",
               "The router's health probe of {{ $labels.worker }} has failed for 1m; the router stops sending it "
               "new requests."),
        _alert("PdserveWorkerFailed",
               'max by (worker, worker_name, role) (pdserve_worker_state{state="failed"}) == 1', "0m",
               "critical", "{{ $labels.worker_name }} gave up restarting its engine",
               "The worker actor reached restart.max_restarts; its engine stays down until the deployment is "
               "restarted. `pdserve diagnose` on its log names the cause."),
        _alert("PdserveWorkerRestarted", "increase(pdserve_worker_restarts_total[15m]) > 0", "0m", "warning",
               "{{ $labels.worker_name }} restarted its engine",
               "{{ $value | humanize }} engine restart(s) of {{ $labels.worker_name }} in 15m; the job log has the "
               "diagnosis of each exit."),
        _alert("PdserveKVTransferFailures",
               "sum by (instance, engine_type, model_name) (increase(sglang:num_transfer_failed_reqs_total[5m])) > 0",
               "0m", "warning", "KV transfers fail on {{ $labels.engine_type }} {{ $labels.instance }}",
               "{{ $value | humanize }} request(s) failed their KV transfer in 5m (transfer engine, network or a "
               "dead peer)."),
        _alert("PdserveKVBootstrapFailures",
               "sum by (instance, engine_type, model_name) (increase(sglang:num_bootstrap_failed_reqs_total[5m])) > 0",
               "0m", "warning", "PD bootstrap fails on {{ $labels.engine_type }} {{ $labels.instance }}",
               "{{ $value | humanize }} request(s) failed the prefill/decode handshake in 5m (timeouts, layout "
               "mismatch, unreachable bootstrap port)."),
        _alert("PdserveCircuitOpen", "max by (worker, role) (pdserve_router_worker_circuit_state) == 2", "2m",
               "warning",
               "The router's circuit breaker for {{ $labels.role }} worker {{ $labels.worker }} is open",
               "The router stopped sending requests to {{ $labels.worker }} after repeated failures."),
        _alert("PdserveSpecAcceptanceCollapsed", acceptance_collapse(slo.accept_drop), "5m", "warning",
               "Speculative acceptance collapsed on {{ $labels.instance }}",
               f"Accepted drafts per verify step on {{{{ $labels.instance }}}} ({{{{ $labels.model_name }}}}) fell "
               f"below {slo.accept_drop:.0%} of its own last hour's for 5m; speculation now costs more than it "
               "saves. Usual causes: the draft lost its state (a cache hit or a transfer that skipped the draft's "
               "KV or hidden state), a draft checkpoint that does not match the target, or a traffic shift to text "
               "the draft was not trained on. Compare sglang:spec_accept_length with the other decode workers."),
        _alert("PdserveTargetDown", 'up{job="pdserve"} == 0', "2m", "critical",
               "Prometheus cannot scrape {{ $labels.component }} {{ $labels.instance }}",
               "The {{ $labels.component }} at {{ $labels.instance }} has not answered /metrics for 2m."),
    ]


def rules_file(slo: SLO) -> dict:
    """The rules.yml document."""
    return {"groups": [
        {"name": "pdserve-recording", "rules": recording_rules()},
        {"name": "pdserve-alerts", "rules": alerting_rules(slo)},
    ]}
