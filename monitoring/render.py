"""``pdserve render-dashboard``: the PD overview's main panels as one PNG, from a Prometheus URL,
for a user without Grafana.

    pdserve render-dashboard --prometheus http://localhost:9090 --out pd-overview.png [--range 15m] [--end TIME]

Draws the panels named in pd.monitoring.dashboards.MAIN_PANELS with the same queries as the
Grafana dashboard (every template variable at "All", resolved as Grafana does). Needs matplotlib
(``pip install 'pdserve[monitoring]'``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import re
import sys
import time
from pathlib import Path

from pd.monitoring import grafana as g
from pd.monitoring.dashboards import MAIN_PANELS, overview
from pd.monitoring.prom_api import Prometheus, PrometheusError
from pd.monitoring.rules import SLO

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str, name: str = "duration") -> float:
    """Seconds in a Prometheus-style duration: ``90s``, ``15m``, ``1h``, ``2d`` (or plain seconds).

    Raises:
        ValueError: naming ``name`` when ``text`` is not a positive duration.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text or "")
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"{name}: expected a positive duration like 90s, 15m, 1h; got {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


def _prom_duration(seconds: float) -> str:
    return f"{max(1, int(round(seconds)))}s"


def rate_interval(step: float, scrape_interval: float) -> float:
    """Grafana's ``$__rate_interval``: max(step + scrape interval, 4 x scrape interval)."""
    return max(step + scrape_interval, 4 * scrape_interval)


def _legend(fmt: str, labels: dict) -> str:
    if fmt in ("", "__auto"):
        return ", ".join(f"{k}={v}" for k, v in sorted(labels.items())) or "value"
    return re.sub(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt)


def _fmt_seconds(v: float, _pos=None) -> str:
    if v <= 0 or not math.isfinite(v):
        return "0"
    if v < 1e-3:
        return f"{v * 1e6:.3g} µs"
    if v < 1:
        return f"{v * 1e3:.3g} ms"
    return f"{v:.3g} s"


def _fmt_range(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def parse_time(text: str) -> float:
    """Seconds since the epoch from a Unix timestamp or an ISO 8601 / RFC 3339 time (UTC if no
    zone is given).

    Raises:
        ValueError: naming ``--end`` when ``text`` is neither.
    """
    try:
        return float(text)
    except ValueError:
        pass
    try:
        t = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError("--end: expected a Unix timestamp or an ISO 8601 time like 2026-11-30T01:13:00Z, "
                         f"got {text!r}") from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=dt.timezone.utc)
    return t.timestamp()


# 12 distinguishable line colours (the stage panels have 12 series): tab10 plus two.
COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
          "#17becf", "#000000", "#b8860b"]


def _utc(ts: float) -> dt.datetime:
    """Unix time -> aware UTC datetime: the time axis is in UTC, as the title says, whatever the local zone."""
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc)


def render(prom: Prometheus, out: Path, range_s: float, end: float, step: float,
           scrape_interval: float) -> dict[str, int]:
    """Draw the main panels into ``out`` (PNG). Returns panel title -> series drawn.

    Raises:
        PrometheusError: a query failed or Prometheus is unreachable.
        ValueError: a dashboard variable found no values (nothing of the cluster is scraped).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    start = end - range_s
    dash = overview(SLO())
    values = g.resolve_variables(dash, lambda sel, label: prom.label_values(sel, label, start, end))
    ri = _prom_duration(rate_interval(step, scrape_interval))
    panels = {p["title"]: p for p in dash["panels"] if p["type"] != "row"}
    fig, axes = plt.subplots(2, 2, figsize=(18, 11), dpi=100)
    drawn: dict[str, int] = {}
    for ax, title in zip(axes.flat, MAIN_PANELS):
        p = panels[title]
        unit = p["fieldConfig"]["defaults"].get("unit")
        n = 0
        if p["type"] == "bargauge":
            names, vals = [], []
            for t in p["targets"]:
                expr = g.expand(t["expr"], values, rate_interval=ri, interval=_prom_duration(step),
                                range_=_prom_duration(range_s))
                for s in prom.query_range(expr, start, end, step):
                    last = [float(v) for _, v in s["values"] if math.isfinite(float(v))]
                    if last:
                        names.append(_legend(t["legendFormat"], s["metric"]))
                        vals.append(last[-1])
            n = len(vals)
            ax.barh(range(n), vals, color="tab:orange")
            ax.set_yticks(range(n), names, fontsize=8)
            ax.invert_yaxis()
            for i, v in enumerate(vals):
                ax.text(v, i, " " + _fmt_seconds(v), va="center", fontsize=8)
            if unit == "s":
                ax.xaxis.set_major_formatter(FuncFormatter(_fmt_seconds))
        else:
            log = p["fieldConfig"]["defaults"].get("custom", {}).get("scaleDistribution", {}).get("type") == "log"
            for t in p["targets"]:
                expr = g.expand(t["expr"], values, rate_interval=ri, interval=_prom_duration(step),
                                range_=_prom_duration(range_s))
                for s in prom.query_range(expr, start, end, step):
                    pts = [(_utc(float(ts)), float(v)) for ts, v in s["values"]]
                    pts = [(x, y) for x, y in pts if math.isfinite(y) and (y > 0 or not log)]
                    if not pts:
                        continue
                    ax.plot([x for x, _ in pts], [y for _, y in pts], label=_legend(t["legendFormat"], s["metric"]),
                            linewidth=1.2, color=COLORS[n % len(COLORS)])
                    n += 1
            if log and n:
                ax.set_yscale("log")
            if unit == "s":
                ax.yaxis.set_major_formatter(FuncFormatter(_fmt_seconds))
            elif unit == "reqps":
                ax.set_ylabel("requests / s")
            ax.set_xlim(_utc(start), _utc(end))  # the whole requested range, as Grafana shows it
            locator = mdates.AutoDateLocator(tz=dt.timezone.utc)  # seconds on a 5-minute range, hours on a day
            ax.xaxis.set_major_locator(locator)
            ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator, tz=dt.timezone.utc))
            ax.grid(True, which="major", alpha=0.3)
            if n:
                ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
        if not n:
            ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center", color="grey")
        ax.set_title(title, fontsize=11)
        drawn[title] = n
    when = dt.datetime.fromtimestamp(end, dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    fig.suptitle(f"pdserve: PD overview  ({prom.url}, {_fmt_range(range_s)} to {when})", fontsize=13)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    plt.close(fig)
    return drawn


def main(argv: list[str] | None = None) -> int:
    """``pdserve render-dashboard``: query Prometheus and write the PNG; returns 1 when a query fails or no panel
    has data, 2 without matplotlib."""
    p = argparse.ArgumentParser(prog="pdserve render-dashboard", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prometheus", required=True, metavar="URL", help="Prometheus that scrapes the cluster")
    p.add_argument("--out", required=True, type=Path, metavar="FILE.png")
    p.add_argument("--range", default="15m", help="time range ending at --end (default %(default)s)")
    p.add_argument("--end", default=None, help="end of the range: Unix time or ISO 8601, e.g. 2026-11-30T01:13:00Z "
                                              "(default: now)")
    p.add_argument("--step", default=None, help="resolution (default: range / 240, at least the scrape interval)")
    p.add_argument("--scrape-interval", default="10s",
                   help="Prometheus's scrape_interval, for $__rate_interval "
                        "(default %(default)s, as monitoring/prometheus.yml)")
    args = p.parse_args(argv)
    if args.out.suffix.lower() != ".png":
        p.error(f"--out: expected a .png file name, got {str(args.out)!r}")
    try:
        range_s = parse_duration(args.range, "--range")
        scrape = parse_duration(args.scrape_interval, "--scrape-interval")
        step = parse_duration(args.step, "--step") if args.step else max(scrape, range_s / 240)
        end = parse_time(args.end) if args.end else time.time()
    except ValueError as e:
        p.error(str(e))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("pdserve render-dashboard needs matplotlib: pip install 'pdserve[monitoring]'", file=sys.stderr)
        return 2
    prom = Prometheus(args.prometheus)
    try:
        drawn = render(prom, args.out, range_s, end, step, scrape)
    except (PrometheusError, ValueError) as e:
        print(f"pdserve render-dashboard: {e}", file=sys.stderr)
        return 1
    finally:
        prom.close()
    empty = [t for t, n in drawn.items() if not n]
    print(f"wrote {args.out}: " + ", ".join(f"{t} ({n} series)" for t, n in drawn.items()))
    if len(empty) == len(drawn):
        print(f"pdserve render-dashboard: no panel has data in the last {args.range}; is Prometheus scraping the "
              "cluster (monitoring/prometheus.yml) and has it served requests?", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
