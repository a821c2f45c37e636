"""Goodput at latency SLOs, DistServe's definition (Zhong et al., "DistServe: Disaggregating Prefill and
Decoding for Goodput-optimized Large Language Model Serving", OSDI'24, section 2): a request counts iff its
TTFT <= the TTFT SLO and its TPOT <= the TPOT SLO; goodput is the rate of such requests, and a
deployment's goodput is the highest request rate whose SLO attainment (the good fraction) stays at or above
a target such as 90%.

Pure Python, no SGLang or numpy: the planner scores its simulated requests with the same function as the
benchmark scores measured ones. Result keys are ``sglang.benchmark.goodput.GoodputMetrics``'s (the pinned
SGLang's ``--goodput`` output), plus the counts; the two agree on the same trace (tests/test_bench_units.py).
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Optional, Sequence


def request_latencies_ms(record: Any) -> tuple[bool, float, Optional[float]]:
    """``(success, ttft_ms, tpot_ms)`` of one request record; ``tpot_ms`` is None for a single-token answer.

    A record is any of:

    - a mapping with ``ttft_ms`` and ``tpot_ms`` (None or absent: one output token), optional ``success``
      (default True) -- what a simulator writes;
    - an object with those attributes;
    - SGLang's ``RequestFuncOutput`` (seconds: ``ttft``, ``latency``, ``output_len``, ``success``), whose TPOT
      is ``(latency - ttft) / (output_len - 1)`` as SGLang's ``calculate_metrics`` computes it.

    Raises:
        TypeError: the record has none of these shapes.
    """
    if isinstance(record, Mapping):
        get = record.get
    elif hasattr(record, "ttft_ms"):
        def get(key, default=None):
            return getattr(record, key, default)
    elif hasattr(record, "ttft") and hasattr(record, "latency"):
        tpot = None
        if record.output_len > 1:
            tpot = (record.latency - record.ttft) / (record.output_len - 1) * 1000
        return bool(record.success), record.ttft * 1000, tpot
    else:
        raise TypeError(f"a goodput record needs ttft_ms/tpot_ms (or SGLang's ttft/latency/output_len), "
                        f"got {type(record).__name__}")
    tpot = get("tpot_ms")
    return bool(get("success", True)), float(get("ttft_ms")), None if tpot is None else float(tpot)


def _check_slo(name: str, value: Optional[float]) -> None:
    if value is not None and not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number of milliseconds > 0 (or None: no SLO), got {value!r}")


def goodput(records: Iterable[Any], slo_ttft_ms: Optional[float], slo_tpot_ms: Optional[float],
            duration_s: Optional[float] = None) -> dict:
    """Goodput of ``records`` at the SLOs (DistServe's definition; see the module docstring).

    Args:
        records: one record per request sent (see :func:`request_latencies_ms`); failed requests count in the
            denominator of the attainment and never as good.
        slo_ttft_ms: TTFT SLO in ms, or None for no TTFT SLO.
        slo_tpot_ms: TPOT SLO in ms, or None for no TPOT SLO. A single-token answer has no TPOT and meets it.
        duration_s: the run's wall time in s; gives ``request_goodput`` (good requests / s), else it is None.

    Returns:
        ``{"goodput_slos_ms": {"ttft": .., "tpot": ..} (the SLOs given), "request_goodput": req/s or None,
        "slo_attainment": good / requests, "slo_attainment_by_metric": {"ttft": .., "tpot": ..},
        "num_requests": n, "num_good": good}``; attainments are fractions in [0, 1] (0 for no records).

    Raises:
        ValueError: an SLO or ``duration_s`` that is not a finite number > 0.
    """
    _check_slo("slo_ttft_ms", slo_ttft_ms)
    _check_slo("slo_tpot_ms", slo_tpot_ms)
    if duration_s is not None and not (duration_s > 0 and math.isfinite(duration_s)):
        raise ValueError(f"duration_s must be a finite number of seconds > 0, got {duration_s!r}")
    slos = {k: v for k, v in (("ttft", slo_ttft_ms), ("tpot", slo_tpot_ms)) if v is not None}
    n = good = 0
    met = dict.fromkeys(slos, 0)
    for record in records:
        n += 1
        ok, ttft, tpot = request_latencies_ms(record)
        if not ok:
            continue
        observed = {"ttft": ttft, "tpot": 0.0 if tpot is None else tpot}
        hits = [k for k, slo in slos.items() if observed[k] <= slo]
        for k in hits:
            met[k] += 1
        good += len(hits) == len(slos)
    return {
        "goodput_slos_ms": slos,
        "request_goodput": None if duration_s is None else good / duration_s,
        "slo_attainment": good / n if n else 0.0,
        "slo_attainment_by_metric": {k: (c / n if n else 0.0) for k, c in met.items()},
        "num_requests": n,
        "num_good": good,
    }


def max_rate_meeting_attainment(rates: Sequence[float], attainments: Sequence[float],
                                target: float = 0.9) -> Optional[float]:
    """DistServe's goodput of a deployment from a rate sweep: the highest request rate (req/s) whose SLO
    attainment is >= ``target``, taken over the measured rates as they are (no interpolation); None when
    no rate meets it. Rates below a failing rate still count (attainment need not be monotonic in noise).

    Raises:
        ValueError: lengths differ, or ``target`` is not in (0, 1].
    """
    if len(rates) != len(attainments):
        raise ValueError(f"{len(rates)} rates but {len(attainments)} attainments")
    if not 0 < target <= 1:
        raise ValueError(f"target must be a fraction in (0, 1], got {target!r}")
    ok = [r for r, a in zip(rates, attainments) if a >= target]
    return max(ok) if ok else None
