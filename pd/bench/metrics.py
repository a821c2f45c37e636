"""One rate's results: SGLang's ``calculate_metrics`` over the finished requests (the same numbers and
field names as ``python -m sglang.bench_serving``'s JSON), goodput at the SLOs, and the per-request columns.

SGLang's TPOT of a request is ``(E2E - TTFT) / (output_len - 1)``; its ITLs are the gaps between streamed
chunks (split evenly over the tokens a chunk carries); percentiles are numpy's (linear interpolation);
``median_*`` is p50. Throughputs divide by the run's wall time (first send to last answer).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Optional

from pd.bench.config import BenchConfig
from pd.bench.goodput import goodput
from pd.bench.load import LoadState

# SGLang's result keys for BenchmarkMetrics fields it renames (sglang/benchmark/serving.py, benchmark()).
_RENAMED = {"total_input": "total_input_tokens", "total_input_text": "total_input_text_tokens",
            "total_input_vision": "total_input_vision_tokens", "total_output": "total_output_tokens",
            "total_output_retokenized": "total_output_tokens_retokenized"}
# Distinct error messages kept in a result (the first ones seen), each cut to this many characters.
_MAX_ERRORS, _ERROR_CHARS = 5, 500


def _finite(value):
    """JSON has no NaN or inf: SGLang's means of no samples (NaN) become None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "item"):  # numpy scalars
        return _finite(value.item())
    return value


def summarize(cfg: BenchConfig, rows: list, state: LoadState, rate: float, tokenizer, *, interrupted: bool = False,
              details: Optional[bool] = None) -> dict:
    """The result of one rate.

    Args:
        rows: the run's requests (SGLang ``DatasetRow``), indexed as ``state.finished[*].index``.
        state: what the load measured (after an interrupt: the requests that finished before it).
        rate: the request rate in req/s (inf allowed; written as the string "inf").
        tokenizer: to retokenize outputs, as SGLang does (``total_output_tokens_retokenized``).
        interrupted: the run was stopped before every request finished.
        details: add the per-request columns (default ``cfg.output_details``).

    Returns:
        A dict with SGLang's result keys (``completed``, ``duration``, ``request_throughput``,
        ``output_throughput``, ``mean/median/std/p90/p95/p99_{ttft,tpot,itl,e2e_latency}_ms``, ...), goodput
        keys when an SLO is set (pd.bench.goodput), and ours: ``request_rate``, ``arrival_process``,
        ``num_prompts`` (requests the run was to send), ``sent``, ``failed``,
        ``error_samples`` (the first distinct error messages), ``interrupted``.
    """
    from pd.bench.sglang_serving import serving

    done = sorted(state.finished, key=lambda f: f.index)
    outputs = [f.output for f in done]
    duration = max(state.duration_s, 1e-9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "All requests failed" / mean of an empty list: reported below instead
        metrics, output_lens = serving().calculate_metrics(
            input_requests=[rows[f.index] for f in done], outputs=outputs, dur_s=duration, tokenizer=tokenizer,
            backend=cfg.backend)
    result = {
        "tag": cfg.tag, "backend": cfg.backend, "dataset_name": cfg.dataset_name,
        "request_rate": "inf" if math.isinf(rate) else rate, "arrival_process": cfg.arrival_process,
        "max_concurrency": cfg.max_concurrency,
        "sharegpt_output_len": cfg.sharegpt_output_len, "random_input_len": cfg.random_input_len,
        "random_output_len": cfg.random_output_len, "random_range_ratio": cfg.random_range_ratio,
        "duration": duration, "num_prompts": len(rows), "sent": state.sent,
    }
    for f in dataclasses.fields(metrics):
        result[_RENAMED.get(f.name, f.name)] = _finite(getattr(metrics, f.name))
    errors = []
    for out in outputs:
        if not out.success and out.error:
            msg = out.error.strip()[-_ERROR_CHARS:]
            if msg not in errors:
                errors.append(msg)
            if len(errors) == _MAX_ERRORS:
                break
    result.update({"failed": len(outputs) - result["completed"], "error_samples": errors, "interrupted": interrupted})
    if cfg.slo_ttft_ms is not None or cfg.slo_tpot_ms is not None:
        # Requests never sent or unanswered at an interrupt are not in the denominator: they were not measured.
        result.update(goodput(outputs, cfg.slo_ttft_ms, cfg.slo_tpot_ms, duration))
    if cfg.output_details if details is None else details:
        result.update(columns(done, output_lens))
    return result


def columns(done: list, output_lens: list[int]) -> dict:
    """Per-request columns in request order: SGLang's ``--output-details`` ones (input_lens, output_lens, ttfts,
    itls, generated_texts, errors; seconds) plus ``e2e_latencies`` (s), ``arrival_times`` (scheduled, s from
    the start) and ``successes``."""
    outs = [f.output for f in done]
    return {
        "input_lens": [o.prompt_len for o in outs], "output_lens": list(output_lens),
        "ttfts": [o.ttft for o in outs], "itls": [list(o.itl) for o in outs],
        "generated_texts": [o.generated_text for o in outs], "errors": [o.error for o in outs],
        "e2e_latencies": [o.latency for o in outs], "arrival_times": [f.arrival_s for f in done],
        "successes": [bool(o.success) for o in outs],
    }
