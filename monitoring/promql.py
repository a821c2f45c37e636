"""Small PromQL helpers shared by the dashboards, the rules and the PNG renderer, plus the metric
name extractor the tests use to check that every name a query uses is exported somewhere.
"""

from __future__ import annotations

import re

# Label values that select the request-level view of an engine. SGLang's PD prefill also counts
# every request it served (e2e, prompt/generation tokens, num_requests: TokenizerManager's
# observe_one_finished_request runs on all engine types), so summing those over prefill + decode
# counts each request twice. The decode side (or a non-PD "unified" server) sees each request once.
REQUEST_ENGINES = 'engine_type=~"decode|unified"'


def sel(name: str, *matchers: str) -> str:
    """``name{m1, m2}``; empty matchers are dropped. ``sel("x", 'a="1"', "")`` -> ``x{a="1"}``."""
    ms = [m for m in matchers if m]
    return f"{name}{{{', '.join(ms)}}}" if ms else name


def quantile(q: float, buckets: str, by: tuple[str, ...] = (), scale: float = 1.0) -> str:
    """``histogram_quantile(q, sum by (le, *by) (buckets))``, times ``scale``.

    Args:
        q: the quantile in [0, 1].
        buckets: an expression of per-second bucket rates (e.g. a recorded ``..._bucket:rate1m``).
        by: extra labels to keep (one quantile per combination).
        scale: unit conversion of the result (0.001 turns a milliseconds histogram into seconds).

    Raises:
        ValueError: ``q`` outside [0, 1].
    """
    if not 0 <= q <= 1:
        raise ValueError(f"q must be in [0, 1], got {q}")
    expr = f"histogram_quantile({q:g}, sum by ({', '.join(('le',) + tuple(by))}) ({buckets}))"
    return expr if scale == 1 else f"{expr} * {scale:g}"


_KEYWORDS = {
    "and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
    "inf", "nan", "atan2",
}
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """Metric names an expression selects (a PromQL tokenizer, not a full parser).

    Drops string literals, label matcher blocks ``{...}``, range/subquery brackets ``[...]``,
    grouping label lists (``by (...)``, ``on (...)``, ...), function names (an identifier followed
    by ``(``), keywords, numbers and Grafana variables (``$x``); what is left are metric names.
    ``metric_names('sum by (le) (rate(a_bucket{x="1"}[5m])) / b')`` -> ``{"a_bucket", "b"}``.
    """
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    s = re.sub(r"'(?:[^'\\]|\\.)*'", "''", s)
    s = re.sub(r"\{[^{}]*\}", " ", s)
    s = re.sub(r"\[[^\[\]]*\]", " ", s)
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", " ", s)
    s = re.sub(r"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?", " ", s)
    names = set()
    for m in _IDENT.finditer(s):
        word = m.group(0)
        start = m.start()
        if start > 0 and (s[start - 1].isdigit() or s[start - 1] == "."):  # 1e-3, 0.5, 5m
            continue
        rest = s[m.end():].lstrip()
        if rest.startswith("(") or word.lower() in _KEYWORDS:
            continue
        names.add(word)
    return names
