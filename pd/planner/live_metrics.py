"""The live traffic the split controller decides on, from the router's and the engines' Prometheus text.

Each scrape is reduced per source (the router, each engine by URL) to the few series the decision needs; a
window of scrapes gives what Prometheus' ``increase()`` would (counter resets -- an engine restarted, a worker
moved to the other role -- count from 0), and :meth:`MetricsWindow.snapshot` turns them into a
pd.planner.controller.Snapshot:

- request rate: ``pdserve_router_requests_total`` (every status) over the window's span;
- mean prompt / output length: ``pdserve_router_{prompt,completion}_tokens_total`` per answered (200) request;
- TTFT attainment: ``pdserve_router_ttft_seconds`` (what clients see), TPOT attainment: the decodes'
  ``sglang:request_time_per_output_token_seconds`` (per request, SGLang's definition); the fraction of the
  window's observations at or under the objective, linear inside the bucket the objective falls in (as
  Prometheus' ``histogram_quantile`` assumes);
- queues, now: the prefills' ``sglang:num_queue_reqs`` (waiting for a forward); the decodes'
  ``sglang:num_decode_prealloc_queue_reqs`` (waiting for KV pages) plus ``sglang:num_queue_reqs`` (waiting to join
  the batch). Requests a decode holds waiting for their KV (``num_decode_transfer_queue_reqs``) are the same ones
  the prefills queue, so they are not counted twice;
- KV usage, now: the fullest decode's ``sglang:token_usage``.

The names are SGLang's (pd/engines/metrics.py), so SGLang workers are read the same way.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from prometheus_client.parser import text_string_to_metric_families

from pd.planner.controller import Snapshot

ROUTER = "router"  # the router's source name; engines are named by URL

TTFT = "pdserve_router_ttft_seconds"
TPOT = "sglang:request_time_per_output_token_seconds"
COUNTERS = {"pdserve_router_requests_total": "requests", "pdserve_router_prompt_tokens_total": "prompt_tokens",
            "pdserve_router_completion_tokens_total": "completion_tokens"}
PREFILL_QUEUES = ("sglang:num_queue_reqs",)
DECODE_QUEUES = ("sglang:num_decode_prealloc_queue_reqs", "sglang:num_queue_reqs")


@dataclass
class Reading:
    """One source's reduced scrape: counters (cumulative, incl. histogram buckets as ``(name, le)``) and gauges (the
    router's requests in flight per worker as ``("inflight", url)``)."""

    counters: dict = field(default_factory=dict)
    gauges: dict = field(default_factory=dict)


def reduce_text(text: str) -> Reading:
    """The series the controller uses from one /metrics text, summed over their other labels.

    Raises:
        ValueError: the text is not Prometheus' exposition format.
    """
    r = Reading()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in COUNTERS:
                key = COUNTERS[s.name]
                r.counters[key] = r.counters.get(key, 0.0) + s.value
                if key == "requests" and s.labels.get("status") == "200":
                    r.counters["answered"] = r.counters.get("answered", 0.0) + s.value
            elif s.name in (TTFT + "_bucket", TPOT + "_bucket"):
                key = (s.name.removesuffix("_bucket"), float(s.labels["le"]))
                r.counters[key] = r.counters.get(key, 0.0) + s.value
            elif s.name == "pdserve_router_worker_inflight":
                r.gauges[("inflight", s.labels.get("worker", ""))] = s.value
            elif s.name in ("sglang:num_queue_reqs", "sglang:num_decode_prealloc_queue_reqs", "sglang:token_usage"):
                r.gauges[s.name] = r.gauges.get(s.name, 0.0) + s.value
    return r


def attainment(increase: dict, name: str, objective_s: float) -> Optional[float]:
    """Fraction of a histogram's observations (its buckets' ``increase``, keys ``(name, le)``) at or under
    ``objective_s``, interpolated linearly inside the bucket holding it; None with no observations."""
    bounds = sorted(k[1] for k in increase if isinstance(k, tuple) and k[0] == name)
    if not bounds or increase.get((name, math.inf), 0.0) <= 0:
        return None
    total = increase[(name, math.inf)]
    below_le, below_count = 0.0, 0.0
    for le in bounds:
        count = increase[(name, le)]
        if objective_s < le:
            if math.isinf(le):
                return below_count / total  # past the last finite bound: nothing above it is known to meet it
            frac = (objective_s - below_le) / (le - below_le)
            return (below_count + frac * (count - below_count)) / total
        below_le, below_count = le, count
    return below_count / total


@dataclass
class MetricsWindow:
    """The last ``window_s`` seconds of readings per source.

    Args:
        window_s: the window, seconds.
        slo_ttft_s, slo_tpot_s: the objectives attainment is measured against.
    """

    window_s: float
    slo_ttft_s: float
    slo_tpot_s: float
    _history: dict = field(default_factory=dict)  # source -> deque[(t, Reading)]

    def add(self, now: float, source: str, reading: Reading) -> None:
        """Record ``source``'s reading at ``now`` (seconds, monotonic); readings older than the window (one kept at
        its edge, to span it) are forgotten."""
        h = self._history.setdefault(source, deque())
        h.append((now, reading))
        while len(h) > 2 and h[1][0] <= now - self.window_s:
            h.popleft()

    def forget(self, keep: set[str]) -> None:
        """Drop the sources not in ``keep`` (engines that left or moved to another URL) and the router's none."""
        for source in list(self._history):
            if source not in keep and source != ROUTER:
                del self._history[source]

    def increase(self, source: str) -> tuple[dict, float]:
        """(every counter's increase over the window, the window's span in seconds) for ``source``; a counter that
        went down was reset and counts from 0 (Prometheus' ``increase``)."""
        h = self._history.get(source)
        if not h or len(h) < 2:
            return {}, 0.0
        out: dict = {}
        for (_, prev), (_, cur) in zip(list(h), list(h)[1:]):
            for key, value in cur.counters.items():
                before = prev.counters.get(key, 0.0)
                out[key] = out.get(key, 0.0) + (value - before if value >= before else value)
        return out, h[-1][0] - h[0][0]

    def latest(self, source: str) -> Optional[Reading]:
        """The newest reading of ``source``."""
        h = self._history.get(source)
        return h[-1][1] if h else None

    def snapshot(self, now: float, roles: dict[str, str], **kw) -> Snapshot:
        """The controller's input from the window; ``roles``: engine URL -> ``prefill``/``decode`` of the workers
        serving now (their replica counts are the current split); ``kw``: the Snapshot's other fields (free_slots,
        restart_s, moving, override)."""
        router, span = self.increase(ROUTER)
        requests = router.get("requests", 0.0)
        answered = router.get("answered", 0.0)
        tpot: dict = {}
        prefill_q = decode_q = kv = 0.0
        for url, role in roles.items():
            latest = self.latest(url)
            if role == "decode":
                inc, _ = self.increase(url)
                for key, v in inc.items():
                    if isinstance(key, tuple) and key[0] == TPOT:
                        tpot[key] = tpot.get(key, 0.0) + v
            if latest is None:
                continue
            if role == "prefill":
                prefill_q += sum(latest.gauges.get(n, 0.0) for n in PREFILL_QUEUES)
            else:
                decode_q += sum(latest.gauges.get(n, 0.0) for n in DECODE_QUEUES)
                kv = max(kv, latest.gauges.get("sglang:token_usage", 0.0))
        return Snapshot(
            now=now, prefill=sum(r == "prefill" for r in roles.values()),
            decode=sum(r == "decode" for r in roles.values()), requests=int(requests),
            request_rate=requests / span if span > 0 else 0.0,
            mean_input_len=router.get("prompt_tokens", 0.0) / answered if answered else 0.0,
            mean_output_len=router.get("completion_tokens", 0.0) / answered if answered else 0.0,
            ttft_attainment=attainment(router, TTFT, self.slo_ttft_s),
            tpot_attainment=attainment(tpot, TPOT, self.slo_tpot_s),
            prefill_queue=prefill_q, decode_queue=decode_q, kv_usage=kv, **kw)
