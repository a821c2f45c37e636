"""Grafana dashboard JSON as plain Python dicts, and Grafana's variable expansion (for checking
and rendering dashboards without Grafana).

Why plain dicts and not grafana-foundation-sdk: the dashboards use five panel types with a handful
of options each; a few builder functions cover them in ~200 lines, the output is the JSON model
Grafana documents (schemaVersion 39, loads in Grafana 9.4+ through file provisioning), and no
runtime or generator dependency is added. The SDK's Python package is generated code that tracks
one Grafana version per release and adds a dependency for every user that only wants the JSON.
vLLM's and Ray's dashboards are kept the same way.
"""

from __future__ import annotations

import re
from typing import Callable, Iterable, Optional

DS = {"type": "prometheus", "uid": "${datasource}"}
SCHEMA_VERSION = 39
GRID_WIDTH = 24


def target(expr: str, legend: str = "", *, ref: Optional[str] = None, heatmap: bool = False,
           instant: bool = False) -> dict:
    """One Prometheus query of a panel (``refId`` filled in by :func:`panel` when None)."""
    t = {"datasource": DS, "expr": expr, "legendFormat": legend or "__auto", "refId": ref,
         "range": not instant, "instant": instant, "editorMode": "code"}
    if heatmap:
        t["format"] = "heatmap"
        t["legendFormat"] = "{{le}}"
    return t


def _refs(targets: list[dict]) -> list[dict]:
    out = []
    for i, t in enumerate(targets):
        t = dict(t)
        if t["refId"] is None:
            t["refId"] = chr(ord("A") + i)
        out.append(t)
    if len({t["refId"] for t in out}) != len(out):
        raise ValueError("targets: duplicate refId")
    return out


def _thresholds(line_at: Optional[float]) -> dict:
    steps = [{"color": "green", "value": None}]
    if line_at is not None:
        steps.append({"color": "red", "value": line_at})
    return {"mode": "absolute", "steps": steps}


def panel(kind: str, title: str, targets: list[dict], *, description: str = "", unit: str = "short",
          w: int = 12, h: int = 8, options: Optional[dict] = None, defaults: Optional[dict] = None,
          custom: Optional[dict] = None) -> dict:
    """A panel of type ``kind`` (``timeseries``, ``heatmap``, ``bargauge``, ``stat``,
    ``state-timeline``); position and id are assigned by :func:`dashboard`.

    Raises:
        ValueError: ``w`` outside 1..24, no targets, or duplicate refIds.
    """
    if not 1 <= w <= GRID_WIDTH:
        raise ValueError(f"w must be in 1..{GRID_WIDTH}, got {w}")
    if not targets:
        raise ValueError(f"panel {title!r}: targets must not be empty")
    fd = {"unit": unit, "thresholds": _thresholds(None), "color": {"mode": "palette-classic"}}
    if custom:
        fd["custom"] = custom
    fd.update(defaults or {})
    return {"type": kind, "title": title, "description": description, "datasource": DS,
            "gridPos": {"h": h, "w": w, "x": 0, "y": 0}, "fieldConfig": {"defaults": fd, "overrides": []},
            "options": options or {}, "targets": _refs(targets)}


def timeseries(title: str, targets: list[dict], *, unit: str = "short", log: bool = False,
               slo: Optional[float] = None, stack: bool = False, **kw) -> dict:
    """A time series panel; ``log`` = log2 y axis (latencies), ``slo`` draws a red threshold line."""
    custom = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10 if stack else 0, "showPoints": "never",
              "spanNulls": False, "axisSoftMin": 0,
              "stacking": {"mode": "normal" if stack else "none", "group": "A"},
              "scaleDistribution": {"type": "log", "log": 2} if log else {"type": "linear"},
              "thresholdsStyle": {"mode": "line" if slo is not None else "off"}}
    if log:
        del custom["axisSoftMin"]
    options = {"legend": {"displayMode": "table", "placement": "bottom", "showLegend": True,
                          "calcs": ["mean", "max", "lastNotNull"]},
               "tooltip": {"mode": "multi", "sort": "desc"}}
    p = panel("timeseries", title, targets, unit=unit, options=options, custom=custom, **kw)
    p["fieldConfig"]["defaults"]["thresholds"] = _thresholds(slo)
    return p


def heatmap(title: str, buckets_expr: str, *, unit: str = "s", **kw) -> dict:
    """A heatmap of pre-bucketed Prometheus histogram data (``buckets_expr`` keeps ``le``)."""
    options = {"calculate": False, "cellGap": 1, "yAxis": {"axisPlacement": "left", "unit": unit, "reverse": False},
               "rowsFrame": {"layout": "auto"}, "color": {"mode": "scheme", "scheme": "Spectral", "steps": 64,
                                                          "exponent": 0.5, "scale": "exponential", "reverse": False,
                                                          "fill": "dark-orange"},
               "filterValues": {"le": 1e-9}, "showValue": "never", "tooltip": {"show": True, "yHistogram": True},
               "legend": {"show": True}, "exemplars": {"color": "rgba(255,0,255,0.7)"}}
    return panel("heatmap", title, [target(buckets_expr, heatmap=True)], unit=unit, options=options,
                 custom={"scaleDistribution": {"type": "linear"},
                         "hideFrom": {"legend": False, "tooltip": False, "viz": False}},
                 **kw)


def bargauge(title: str, targets: list[dict], *, unit: str = "s", **kw) -> dict:
    """Horizontal bars, one per target, showing each target's last value."""
    options = {"orientation": "horizontal", "displayMode": "gradient", "showUnfilled": True, "valueMode": "color",
               "namePlacement": "left", "sizing": "auto", "minVizHeight": 16, "maxVizHeight": 300,
               "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}}
    return panel("bargauge", title, targets, unit=unit, options=options, defaults={"min": 0}, **kw)


def mappings(values: dict[int, tuple[str, str]]) -> list[dict]:
    """Value mappings ``{0: ("closed", "green"), ...}`` for stat / state-timeline panels."""
    return [{"type": "value", "options": {str(v): {"text": text, "color": color, "index": i}
                                          for i, (v, (text, color)) in enumerate(values.items())}}]


def state_timeline(title: str, targets: list[dict], states: dict[int, tuple[str, str]], **kw) -> dict:
    """A state timeline: one band per series, coloured and named by ``states`` (value -> (text, colour))."""
    options = {"showValue": "auto", "mergeValues": True, "alignValue": "left", "rowHeight": 0.9,
               "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
               "tooltip": {"mode": "single", "sort": "none"}}
    return panel("state-timeline", title, targets, options=options,
                 defaults={"mappings": mappings(states), "color": {"mode": "thresholds"}}, **kw)


def stat(title: str, targets: list[dict], *, unit: str = "short", **kw) -> dict:
    """Big numbers: each series' last value."""
    options = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}, "colorMode": "value",
               "graphMode": "none", "justifyMode": "auto", "orientation": "auto", "textMode": "value_and_name",
               "wideLayout": True, "showPercentChange": False}
    return panel("stat", title, targets, unit=unit, options=options, **kw)


def row(title: str) -> dict:
    """A (never collapsed) row header; the panels after it belong to it."""
    return {"type": "row", "title": title, "collapsed": False, "panels": [],
            "gridPos": {"h": 1, "w": GRID_WIDTH, "x": 0, "y": 0}}


# ---- variables ------------------------------------------------------------------------------------
def datasource_variable() -> dict:
    """``$datasource``: any Prometheus datasource, the default one preselected."""
    return {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
            "current": {}, "hide": 0, "refresh": 1, "regex": "", "options": [], "includeAll": False, "multi": False}


def query_variable(name: str, label: str, metric_selector: str, label_name: str) -> dict:
    """A multi-value variable over ``label_values(metric_selector, label_name)`` with "All"
    (Grafana then substitutes a regex of every value, e.g. ``(a|b)``)."""
    q = f"label_values({metric_selector}, {label_name})"
    return {"name": name, "label": label, "type": "query", "datasource": DS,
            "query": q,  # the classic string form: every Grafana version since 7 loads (and migrates) it
            "definition": q, "refresh": 2, "includeAll": True, "multi": True, "allValue": None, "sort": 1,
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "hide": 0, "regex": "", "options": []}


def annotation(name: str, expr: str, title: str, text: str, color: str = "rgba(255, 152, 48, 1)") -> dict:
    """A Prometheus-query annotation: a mark on every time panel wherever ``expr`` returns a sample;
    ``title``/``text`` are Grafana templates over the series' labels (``{{label}}``)."""
    return {"name": name, "datasource": DS, "enable": True, "hide": False, "iconColor": color, "expr": expr,
            "step": "30s", "titleFormat": title, "textFormat": text, "useValueForTime": False}


def dashboard(uid: str, title: str, description: str, variables: list[dict], items: list[dict],
              links: Iterable[dict] = (), annotations: Iterable[dict] = ()) -> dict:
    """A dashboard; ``items`` are rows and panels in reading order, laid out left to right on
    Grafana's 24-column grid (a row starts a new line). Panel ids are assigned in order.

    Raises:
        ValueError: two panels share a title (titles identify panels in tests and the renderer).
    """
    panels, x, y, line_h = [], 0, 0, 0
    titles = set()
    for i, item in enumerate(items, start=1):
        p = dict(item, id=i)
        gp = dict(p["gridPos"])
        if p["type"] == "row" or x + gp["w"] > GRID_WIDTH:
            y, x, line_h = y + line_h, 0, 0
        gp["x"], gp["y"] = x, y
        p["gridPos"] = gp
        if p["type"] == "row":
            y += gp["h"]
        else:
            if p["title"] in titles:
                raise ValueError(f"duplicate panel title {p['title']!r}")
            titles.add(p["title"])
            x += gp["w"]
            line_h = max(line_h, gp["h"])
        panels.append(p)
    return {"id": None, "uid": uid, "title": title, "description": description, "tags": ["pdserve"],
            "timezone": "browser", "editable": True, "graphTooltip": 1, "schemaVersion": SCHEMA_VERSION,
            "version": 1, "refresh": "30s", "time": {"from": "now-1h", "to": "now"},
            "timepicker": {}, "fiscalYearStartMonth": 0, "liveNow": False, "weekStart": "",
            "annotations": {"list": [{"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                                      "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
                                      "name": "Annotations & Alerts", "type": "dashboard"},
                                     *annotations]},
            "templating": {"list": [datasource_variable(), *variables]}, "links": list(links), "panels": panels}


# ---- Grafana's variable expansion, for checks and the PNG renderer -----------------------------------
_LABEL_VALUES = re.compile(r"^label_values\((.*),\s*([A-Za-z_][A-Za-z0-9_]*)\)$")
_REGEX_SPECIAL = re.compile(r"[$^*{}\[\]'+?.()|\\]")


def regex_escape(value: str) -> str:
    """Escape a label value the way Grafana's Prometheus datasource does before it puts it into a
    regex matcher (a ``\\\\`` inside the PromQL string, so the regex sees ``\\.``)."""
    return _REGEX_SPECIAL.sub(lambda m: "\\\\" + m.group(0), value)


def resolve_variables(dash: dict, label_values: Callable[[str, str], list[str]]) -> dict[str, str]:
    """Values of the dashboard's query variables with every variable at "All", as Grafana computes
    them: each ``label_values(selector, label)`` query runs in order (a selector may use earlier
    variables) and "All" becomes ``(v1|v2|...)`` of the escaped values.

    Args:
        label_values: ``(selector, label) -> values``, e.g. from Prometheus's series API.

    Raises:
        ValueError: a variable query that is not ``label_values(selector, label)``, or one that
            finds no values (every panel filtered by it would be empty).
    """
    out: dict[str, str] = {}
    for var in dash["templating"]["list"]:
        if var["type"] != "query":
            continue
        m = _LABEL_VALUES.match(var["definition"].strip())
        if not m:
            raise ValueError(f"variable {var['name']}: unsupported query {var['definition']!r}")
        selector = expand(m.group(1), out)
        values = sorted(set(label_values(selector, m.group(2))))
        if not values:
            raise ValueError(f"variable {var['name']}: label_values({selector}, {m.group(2)}) found no values")
        out[var["name"]] = "(" + "|".join(regex_escape(v) for v in values) + ")"
    return out


def expand(expr: str, values: dict[str, str], rate_interval: str = "1m", interval: str = "15s",
           range_: str = "1h") -> str:
    """Substitute ``$var`` / ``${var}`` and Grafana's ``$__rate_interval``, ``$__interval``,
    ``$__range`` in ``expr``.

    Raises:
        KeyError: a variable with no value.
    """
    builtins = {"__rate_interval": rate_interval, "__interval": interval, "__range": range_}

    def sub(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        if name in builtins:
            return builtins[name]
        if name not in values:
            raise KeyError(f"no value for variable ${name} in {expr!r}")
        return values[name]

    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)", sub, expr)


def iter_targets(dash: dict):
    """``(panel, target)`` for every query of every panel (rows' nested panels included)."""
    for p in dash["panels"]:
        for sub in [p, *p.get("panels", [])]:
            for t in sub.get("targets", []):
                yield sub, t
