"""``pdserve bench``: an open-loop serving benchmark with goodput and the PD per-stage split.

Python API (stable; the planner calls it):

- ``run_bench(args: argparse.Namespace | BenchConfig, *, quiet=False) -> dict``: run it and return the result
  (the same dict ``--output-file`` gets). Synchronous (it runs its own event loops). A Ctrl-C writes what was
  measured, then re-raises ``KeyboardInterrupt``. ``BenchConfig`` fields are the flags
  (``--request-rate`` -> ``request_rate``); a namespace may carry only some (the rest take the defaults).
  Raises ``ValueError`` (bad setting, names the flag) or ``pd.bench.run.BenchError`` (cannot start).
- ``goodput(records, slo_ttft_ms, slo_tpot_ms, duration_s=None) -> dict``: DistServe's goodput of any
  records (mappings or objects with ``ttft_ms``, ``tpot_ms``, optional ``success``; or SGLang's
  ``RequestFuncOutput``): ``request_goodput`` (req/s, with ``duration_s``), ``slo_attainment``,
  ``slo_attainment_by_metric``, ``goodput_slos_ms``, ``num_requests``, ``num_good``. No SGLang needed.
- ``max_rate_meeting_attainment(rates, attainments, target=0.9)``: a sweep's goodput (highest rate at target).

Result dict: ``date``, ``base_url``, ``backend``, ``model_id``, ``tokenizer``, ``dataset_name``,
``num_prompts``, ``config`` (every setting), ``interrupted``, ``slo_attainment_target``,
``max_request_rate_meeting_slo`` (with an SLO), ``output_file`` / ``plot_file`` (when written), and
``runs``: one dict per request rate with ``sglang.bench_serving``'s JSON keys -- ``request_rate``,
``max_concurrency``, ``duration`` (s), ``completed``, ``total_input_tokens``, ``total_output_tokens``,
``request_throughput`` (req/s), ``input_throughput``, ``output_throughput``, ``total_throughput`` (tok/s),
``{mean,median,std,p90,p95,p99}_{ttft,tpot,itl,e2e_latency}_ms``, ``max_itl_ms``, ``concurrency``,
``max_output_tokens_per_s``, ``max_concurrent_requests``; with an SLO SGLang's goodput keys
``goodput_slos_ms``, ``request_goodput``, ``slo_attainment``, ``slo_attainment_by_metric`` (+ ``num_good``);
ours: ``arrival_process``, ``num_prompts``, ``sent``, ``failed``, ``error_samples``, ``interrupted``;
``stages`` behind a pdserve router (pd.bench.stages: ``mean_ms`` per stage -- router_queue,
prefill_bootstrap, prefill, kv_transfer, decode_prealloc, decode_kv_wait, decode_wait, decode,
router_prefill, router_ttft, router_e2e -- ``counts``, ``requests``, ``workers``, ``note``); with
``--output-details`` SGLang's per-request columns (``input_lens``, ``output_lens``, ``ttfts``, ``itls``,
``generated_texts``, ``errors``; s) plus ``e2e_latencies``, ``arrival_times``, ``successes``.

What comes from the pinned SGLang (``sglang.benchmark.serving``, loaded by pd.bench.sglang_serving): the
request function of each backend (streaming, TTFT / ITL / E2E per request), ShareGPT sampling, uniform
lengths, ``calculate_metrics`` (every latency and throughput number above) and the key names. Written
here: the open-loop driver (absolute Poisson or constant arrivals, deadlines, interrupt-safe), rate sweeps,
log-normal lengths and shared prefixes, download-free random prompts, goodput usable without SGLang, the
stage split, the PNG.
"""

from __future__ import annotations

from pd.bench.config import BenchConfig
from pd.bench.goodput import goodput, max_rate_meeting_attainment

__all__ = ["BenchConfig", "goodput", "max_rate_meeting_attainment", "run_bench"]


def run_bench(args, *, quiet: bool = False) -> dict:
    """See the module docstring; imported lazily (SGLang's benchmark and torch load in seconds)."""
    from pd.bench.run import run_bench as run

    return run(args, quiet=quiet)
