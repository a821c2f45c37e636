"""The PNG of a run: latency CDFs (TTFT, TPOT, ITL, E2E; one curve per request rate, SLOs as dashed lines)
and, for a sweep, throughput and goodput vs request rate with the SLO attainment. matplotlib (the
``monitoring`` extra), drawn off-screen (Agg).
"""

from __future__ import annotations

import math

import numpy as np


def _rate_label(run: dict) -> str:
    rate = run["request_rate"]
    label = "inf" if rate == "inf" else f"{rate:g}"
    return f"{label} req/s" + (f", conc {run['max_concurrency']}" if run.get("max_concurrency") else "")


def _cdf(ax, values_ms, label: str) -> None:
    if len(values_ms) == 0:
        return
    xs = np.sort(np.asarray(values_ms, dtype=float))
    ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=label, drawstyle="steps-post")


def latency_series(run: dict, columns: dict) -> dict[str, list[float]]:
    """Per-request TTFT, TPOT and E2E, and every ITL, in ms, of one rate's successful requests (from
    pd.bench.metrics.columns)."""
    ok = columns["successes"]
    ttft = [t * 1000 for t, s in zip(columns["ttfts"], ok) if s]
    e2e = [e * 1000 for e, s in zip(columns["e2e_latencies"], ok) if s]
    tpot = [(e - t) / (n - 1) * 1000 for e, t, n, s in
            zip(columns["e2e_latencies"], columns["ttfts"], columns["output_lens"], ok) if s and n > 1]
    itl = [g * 1000 for gaps, s in zip(columns["itls"], ok) if s for g in gaps]
    return {"TTFT": ttft, "TPOT": tpot, "ITL": itl, "E2E": e2e}


def write_png(path: str, runs: list[dict], columns: list[dict], slo_ttft_ms=None, slo_tpot_ms=None,
              attainment_target: float = 0.9, title: str = "") -> None:
    """Draw the run to ``path``.

    Args:
        runs: the per-rate results (pd.bench.metrics.summarize), in sweep order.
        columns: their per-request columns (pd.bench.metrics.columns), same order.
        slo_ttft_ms, slo_tpot_ms: drawn on the TTFT / TPOT CDFs when given.
        attainment_target: the attainment line on the goodput panel.

    Raises:
        ImportError: matplotlib is not installed (``pip install 'pdserve[monitoring]'``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = len(runs) > 1
    fig, axes = plt.subplots(2, 3 if sweep else 2, figsize=(15 if sweep else 10, 8))
    panels = dict(zip(("TTFT", "TPOT", "ITL", "E2E"), [axes[0][0], axes[0][1], axes[1][0], axes[1][1]]))
    for run, cols in zip(runs, columns):
        for name, values in latency_series(run, cols).items():
            _cdf(panels[name], values, _rate_label(run))
    for name, ax in panels.items():
        slo = {"TTFT": slo_ttft_ms, "TPOT": slo_tpot_ms}.get(name)
        if slo:
            ax.axvline(slo, color="k", linestyle="--", linewidth=1, label=f"SLO {slo:g} ms")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests" if name != "ITL" else "fraction of token gaps")
        ax.set_title(f"{name} CDF")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    if sweep:
        rates = [math.inf if r["request_rate"] == "inf" else r["request_rate"] for r in runs]
        finite = [r for r in rates if math.isfinite(r)]
        xs = [r if math.isfinite(r) else (max(finite) * 2 if finite else 1.0) for r in rates]
        ax = axes[0][2]
        ax.plot(xs, [r["request_throughput"] for r in runs], "o-", label="throughput")
        if any(r.get("request_goodput") is not None for r in runs):
            ax.plot(xs, [r.get("request_goodput") or 0 for r in runs], "s-", label="goodput")
        ax.plot(xs, xs, ":", color="grey", label="offered")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("req/s")
        ax.set_title("throughput and goodput vs request rate")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax = axes[1][2]
        if any(r.get("slo_attainment") is not None for r in runs):
            ax.plot(xs, [100 * (r.get("slo_attainment") or 0) for r in runs], "o-", color="tab:green")
            ax.axhline(100 * attainment_target, color="k", linestyle="--", linewidth=1,
                       label=f"target {100 * attainment_target:g}%")
            ax.legend(fontsize=8)
        ax.set_ylim(0, 105)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("SLO attainment (%)")
        ax.set_title("SLO attainment (TTFT and TPOT both met)")
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
