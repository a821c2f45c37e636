"""The console summary of a run: one row per request rate (throughputs, TTFT / TPOT / ITL / E2E at p50 and
p99, goodput), then the stage split when there is one."""

from __future__ import annotations


def _num(value, fmt: str = ".1f") -> str:
    return "-" if value is None else format(value, fmt)


def _rate(rate) -> str:
    return "inf" if rate == "inf" else f"{rate:g}"


def table(result: dict) -> str:
    """The text table of ``result`` (pd.bench.run_bench's dict)."""
    runs = result["runs"]
    slo = any("request_goodput" in r for r in runs)
    head = ["rate", "done/sent", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "ITL p50",
            "E2E p50", "E2E p99"] + (["goodput", "attain %"] if slo else [])
    rows = []
    for r in runs:
        rate = r["request_rate"]
        row = [_rate(rate) + ("*" if r.get("interrupted") else ""),
               f"{r['completed']}/{r['sent']}", _num(r["request_throughput"], ".2f"), _num(r["output_throughput"]),
               _num(r["median_ttft_ms"]), _num(r["p99_ttft_ms"]), _num(r["median_tpot_ms"]), _num(r["p99_tpot_ms"]),
               _num(r["median_itl_ms"]), _num(r["median_e2e_latency_ms"]), _num(r["p99_e2e_latency_ms"])]
        if slo:
            row += [_num(r.get("request_goodput"), ".2f"), _num(100 * r["slo_attainment"])]
        rows.append(row)
    widths = [max(len(h), *(len(x[i]) for x in rows)) for i, h in enumerate(head)] if rows else [len(h) for h in head]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    lines.append("latencies in ms" + ("; * interrupted (finished requests only)" if result.get("interrupted") else ""))
    if slo:
        slos = runs[0]["goodput_slos_ms"]
        best = result.get("max_request_rate_meeting_slo")
        lines.append("goodput: requests meeting " + " and ".join(f"{k.upper()} <= {v:g} ms" for k, v in slos.items())
                     + f"; highest rate with >= {100 * result['slo_attainment_target']:g}% attainment: "
                     + ("none" if best is None else f"{_rate(best)} req/s"))
    for r in runs:
        st = r.get("stages")
        if not st:
            continue
        rate = r["request_rate"]
        parts = [f"{k} {v:.1f}" for k, v in st["mean_ms"].items() if v is not None]
        lines.append(f"stages at {_rate(rate)} req/s (mean ms, {st['requests']} "
                     f"requests through the router): " + ", ".join(parts) + (f" [{st['note']}]" if st["note"] else ""))
    return "\n".join(lines)
