"""A thin client of Prometheus's HTTP API (/api/v1/query, query_range, series) for the PNG
renderer and the tests."""

from __future__ import annotations

import math

import httpx


class PrometheusError(RuntimeError):
    """Prometheus answered with an error (bad query, unreachable server); the message says which."""


class Prometheus:
    """Args:
        url: the server, e.g. ``http://localhost:9090``.
        timeout: seconds per HTTP request.
    """

    def __init__(self, url: str, timeout: float = 30.0):
        self.url = url.rstrip("/")
        self.http = httpx.Client(timeout=timeout)

    def _get(self, path: str, params) -> dict:
        try:
            r = self.http.get(self.url + path, params=params)
        except httpx.HTTPError as e:
            raise PrometheusError(f"cannot reach Prometheus at {self.url}: {e!r}") from None
        try:
            body = r.json()
        except ValueError:
            raise PrometheusError(f"{self.url}{path}: HTTP {r.status_code}, not a Prometheus API answer: "
                                  f"{r.text[:200]!r}") from None
        if body.get("status") != "success":
            raise PrometheusError(f"{self.url}{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, time: float | None = None) -> list[dict]:
        """Instant query; returns the vector's samples ``{"metric": {...}, "value": [t, "v"]}``.

        Raises:
            PrometheusError: the query failed (the message carries Prometheus's error).
        """
        params = {"query": expr}
        if time is not None:
            params["time"] = f"{time:.3f}"
        data = self._get("/api/v1/query", params)
        if data["resultType"] != "vector":
            raise PrometheusError(f"{expr!r}: expected a vector, got {data['resultType']}")
        return data["result"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict]:
        """Range query (seconds since the epoch, step in seconds); returns the matrix's series
        ``{"metric": {...}, "values": [[t, "v"], ...]}``."""
        data = self._get("/api/v1/query_range",
                         {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"})
        return data["result"]

    def label_values(self, selector: str, label: str, start: float | None = None,
                     end: float | None = None) -> list[str]:
        """Values of ``label`` on the series ``selector`` matches (what Grafana's
        ``label_values(selector, label)`` variable query returns)."""
        params = [("match[]", selector)]
        if start is not None:
            params += [("start", f"{start:.3f}"), ("end", f"{end:.3f}")]
        series = self._get("/api/v1/series", params)
        return sorted({s[label] for s in series if label in s})

    def close(self) -> None:
        """Close the HTTP client."""
        self.http.close()


def finite_values(result: list[dict]) -> list[float]:
    """The finite sample values of a query result (instant or range)."""
    out = []
    for s in result:
        pairs = s["values"] if "values" in s else [s["value"]]
        out += [v for v in (float(p[1]) for p in pairs) if math.isfinite(v)]
    return out
