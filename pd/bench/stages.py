"""Per-stage latency of a run through a pdserve router, from the router's and the engines' ``/metrics``
read before and after it: the mean of each stage is (sum after - sum before) / (count after - count
before) of its histogram, so it covers exactly the requests finished in between (the run's, if nothing
else uses the deployment meanwhile).

The engines are the router's workers (``GET /workers``, the admin API) listed with the admin key
:func:`resolve_admin_key` picks: ``--admin-api-key``, else the key file a pdserve launcher left
(pd.util.admin_key: ``$PDSERVE_ADMIN_API_KEY_FILE``, else ``pdserve_admin_key_<router port>`` in Ray's
``session_latest`` for a router on this machine), else none (a router without keys opens it to loopback clients).

Stages, in a request's order (engine stages are ``sglang:per_stage_req_latency_seconds`` by its ``stage``
label; every series summed over its other labels):

- ``router_queue``: ``pdserve_router_queue_seconds``, arrival at the router -> dispatch;
- ``prefill_bootstrap`` (prefill engines, ``stage="prefill_bootstrap"``): the prefill waits for its decode to
  register the room;
- ``prefill`` (``prefill_forward``): queue + prefill forward;
- ``kv_transfer`` (``prefill_transfer_kv_cache``): the KV pages written to the decode;
- ``decode_prealloc`` (decode engines, ``decode_bootstrap``): KV pages allocated;
- ``decode_kv_wait`` (``decode_transferred``): registered -> KV arrived (prefill + transfer seen from the decode);
- ``decode_wait`` (``decode_waiting``): KV arrived -> decoding starts;
- ``decode``: decode engines' ``sglang:e2e_request_latency_seconds`` - ``sglang:time_to_first_token_seconds``,
  first token -> last;
- ``router_prefill``: ``pdserve_router_prefill_seconds``, dispatch -> the prefill's answer read;
- ``router_ttft`` / ``router_e2e``: ``pdserve_router_ttft_seconds`` / ``pdserve_router_e2e_seconds``.

The stage label values are SGLang's (``sglang/srt/observability/req_time_stats.py``), which the reference
engine exports too, so the split works over SGLang workers as well.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pd.util.admin_key import find_admin_key_file, read_admin_key
from pd.util.pd_stages import ENGINE_STAGES as PD_STAGES

ROUTER_HISTOGRAMS = {"router_queue": "pdserve_router_queue_seconds", "router_prefill": "pdserve_router_prefill_seconds",
                     "router_ttft": "pdserve_router_ttft_seconds", "router_e2e": "pdserve_router_e2e_seconds"}
STAGE_HISTOGRAM = "sglang:per_stage_req_latency_seconds"
# Our stage name -> (role of the engines that observe it, SGLang's stage label value): pd.util.pd_stages.
ENGINE_STAGES = {s.name: (s.role, s.label) for s in PD_STAGES}
E2E_HISTOGRAM, TTFT_HISTOGRAM = "sglang:e2e_request_latency_seconds", "sglang:time_to_first_token_seconds"
ORDER = ("router_queue", "prefill_bootstrap", "prefill", "kv_transfer", "decode_prealloc", "decode_kv_wait",
         "decode_wait", "decode", "router_prefill", "router_ttft", "router_e2e")
SCRAPE_TIMEOUT = 10.0  # seconds per /metrics or /workers request


def histogram_totals(text: str) -> dict[tuple[str, str], list[float]]:
    """``{(histogram name, stage label or ""): [sum, count]}`` of a Prometheus text exposition, each summed over
    the other labels (endpoint, model, ranks, ...).

    Raises:
        ValueError: the text is not the Prometheus exposition format.
    """
    totals: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for family in text_string_to_metric_families(text):
        if family.type != "histogram":
            continue
        for s in family.samples:
            if s.name.endswith("_sum"):
                totals[(family.name, s.labels.get("stage", ""))][0] += s.value
            elif s.name.endswith("_count"):
                totals[(family.name, s.labels.get("stage", ""))][1] += s.value
    return dict(totals)


@dataclass
class Targets:
    """Where a router's stage metrics are: its own /metrics and its workers' (by role)."""

    router: str
    workers: dict[str, list[str]] = field(default_factory=lambda: {"prefill": [], "decode": []})
    note: Optional[str] = None  # why the engines' part is missing, when it is


@dataclass(frozen=True)
class AdminKey:
    """The admin key to list a router's workers with: ``key`` (None: send none), ``source`` (where it came
    from, for messages: ``"--admin-api-key"`` or the key file's path; never the key itself) and ``problem``
    (why a key file that was found could not be read)."""

    key: Optional[str] = field(default=None, repr=False)
    source: Optional[str] = None
    problem: Optional[str] = None


def resolve_admin_key(base_url: str, given: Optional[str]) -> AdminKey:
    """The admin key for the router at ``base_url``: ``given`` (``--admin-api-key``) when set; else the key file
    of pd.util.admin_key's rule (``$PDSERVE_ADMIN_API_KEY_FILE``, else ``<Ray temp dir>/session_latest/
    pdserve_admin_key_<port>`` when the router runs on this machine); else none. Never raises: a key file that
    cannot be read gives no key and ``problem`` says why."""
    if given:
        return AdminKey(given, "--admin-api-key")
    path = find_admin_key_file(base_url)
    if path is None:
        return AdminKey()
    try:
        return AdminKey(read_admin_key(path), str(path))
    except (OSError, ValueError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        return AdminKey(None, str(path), f"cannot read the admin key file {path}: {why}")


async def discover(client: httpx.AsyncClient, base_url: str, admin_api_key: Optional[str]) -> Optional[Targets]:
    """The stage targets behind ``base_url`` when it is a pdserve router (its /metrics has
    ``pdserve_router_*``), else None. Workers come from ``GET /workers`` with the admin key
    :func:`resolve_admin_key` picks (``admin_api_key`` first); when that is refused, the router's stages alone
    are measured and ``note`` says why (naming where the key came from, never the key)."""
    try:
        r = await client.get(base_url + "/metrics", timeout=SCRAPE_TIMEOUT)
    except httpx.HTTPError:
        return None
    if r.status_code != 200 or "pdserve_router_" not in r.text:
        return None
    targets = Targets(router=base_url)
    admin = resolve_admin_key(base_url, admin_api_key)
    headers = {"Authorization": f"Bearer {admin.key}"} if admin.key else {}
    try:
        w = await client.get(base_url + "/workers", headers=headers, timeout=SCRAPE_TIMEOUT)
        if w.status_code != 200:
            sent = f"with the key from {admin.source}" if admin.key else "without an admin key"
            targets.note = "; ".join(filter(None, [
                admin.problem, f"GET /workers answered {w.status_code} {sent} (give --admin-api-key, or "
                               "PDSERVE_ADMIN_API_KEY_FILE): engine stages not measured"]))
            return targets
        for worker in w.json().get("workers", []):
            role = worker.get("worker_type")
            if role in targets.workers:
                targets.workers[role].append(str(worker["url"]).rstrip("/"))
    except (httpx.HTTPError, ValueError, KeyError, AttributeError) as e:
        targets.note = f"GET /workers failed ({e!r}): engine stages not measured"
    return targets


@dataclass
class Snapshot:
    """Histogram totals of the router and of each engine role at one moment."""

    router: dict
    engines: dict[str, dict]  # role -> totals summed over that role's engines
    missing: list[str]        # engines whose /metrics did not answer


async def snapshot(client: httpx.AsyncClient, targets: Targets) -> Snapshot:
    """Read every target's /metrics concurrently (each with a deadline of ``SCRAPE_TIMEOUT`` s)."""
    async def totals(url: str) -> Optional[dict]:
        try:
            r = await client.get(url + "/metrics", timeout=SCRAPE_TIMEOUT)
            return histogram_totals(r.text) if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    urls = [targets.router] + [u for role in ("prefill", "decode") for u in targets.workers[role]]
    got = dict(zip(urls, await asyncio.gather(*(totals(u) for u in urls))))
    engines, missing = {}, []
    for role in ("prefill", "decode"):
        acc: dict = defaultdict(lambda: [0.0, 0.0])
        for u in targets.workers[role]:
            if got[u] is None:
                missing.append(u)
                continue
            for key, (s, c) in got[u].items():
                acc[key][0] += s
                acc[key][1] += c
        engines[role] = dict(acc)
    return Snapshot(router=got[targets.router] or {}, engines=engines, missing=missing)


def _delta(after: dict, before: dict, key) -> tuple[float, float]:
    s1, c1 = after.get(key, (0.0, 0.0))
    s0, c0 = before.get(key, (0.0, 0.0))
    return s1 - s0, c1 - c0


def breakdown(before: Snapshot, after: Snapshot, targets: Targets) -> dict:
    """Each stage's mean in ms over the requests finished between the snapshots.

    Returns:
        ``{"mean_ms": {stage: ms or None}, "counts": {stage: observations}, "requests": router E2E count,
        "workers": {"prefill": [url], "decode": [url]}, "note": str or None}``, stages in :data:`ORDER`
        (a stage with no observation has mean None).
    """
    mean, counts = {}, {}

    def put(stage: str, s: float, c: float) -> None:
        counts[stage] = int(round(c))
        mean[stage] = s / c * 1000 if c > 0 else None

    for stage, name in ROUTER_HISTOGRAMS.items():
        put(stage, *_delta(after.router, before.router, (name, "")))
    for stage, (role, label) in ENGINE_STAGES.items():
        put(stage, *_delta(after.engines[role], before.engines[role], (STAGE_HISTOGRAM, label)))
    e2e_s, e2e_c = _delta(after.engines["decode"], before.engines["decode"], (E2E_HISTOGRAM, ""))
    ttft_s, _ = _delta(after.engines["decode"], before.engines["decode"], (TTFT_HISTOGRAM, ""))
    put("decode", e2e_s - ttft_s, e2e_c)
    notes = [n for n in (targets.note, f"no /metrics from {', '.join(after.missing)}" if after.missing else None) if n]
    return {"mean_ms": {k: mean[k] for k in ORDER}, "counts": {k: counts[k] for k in ORDER},
            "requests": counts["router_e2e"], "workers": targets.workers, "note": "; ".join(notes) or None}
