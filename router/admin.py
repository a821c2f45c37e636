"""The admin API: list, add, drain, restore and remove workers at runtime (the launcher uses it when a
worker comes back on new ports, and drains every worker before stopping them).

Routes (JSON bodies; ``Authorization: Bearer ADMIN_KEY``, see pd.router.auth):

- ``GET /workers``: ``{"workers": [...], "total", "stats": {"prefill_count", "decode_count"}}``;
  each worker: url, worker_type, bootstrap_host/port, state (available / unhealthy / circuit_open
  / draining), is_healthy, draining, circuit (closed / half_open / open), inflight, load.
- ``POST /workers`` ``{"url", "worker_type": "prefill"|"decode", "bootstrap_port", "api_key"}``: add one
  (201; 409 when the URL is already a worker; 400 for bad fields; 403 for a host outside the cluster's
  nodes and ``allowed_worker_hosts``). The router sends the worker only the ``api_key`` given here
  (sgl-model-gateway's field; none without it), never a key of its own: a worker someone added is not
  told the client or the cluster key.
- ``POST /workers/drain`` ``{"url", "timeout_secs": 30, "remove": false}``: no new requests go to
  the worker; answers once nothing is in flight there (``"drained": true``) or after
  ``timeout_secs`` (``false``), and removes it afterwards with ``remove``.
- ``POST /workers/activate`` ``{"url"}``: undo a drain and close its circuit breaker (the health
  checks still decide whether it is healthy).
- ``DELETE /workers?url=URL``: remove it now (requests in flight finish on their connections).
- ``GET /planner``: the P:D split controller's state (pd.planner.controller, run by the launcher): ``current`` (the
  router's prefill and decode counts), ``override``, and what the launcher last reported (``mode``, ``target``,
  ``decision``, ``moving``); ``POST /planner`` is that report (the launcher's).
- ``PUT /planner/override`` ``{"prefill": N, "decode": M}``: pin the split (each >= 1; the controller moves
  workers to it and holds it); ``DELETE /planner/override``: unpin.
"""

from __future__ import annotations

import ipaddress
import json
import logging
from typing import Optional, cast
from urllib.parse import urlsplit

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pd.router.auth import Auth, valid_key
from pd.router.config import RouterConfig, normalize_url
from pd.router.errors import error_response
from pd.router.health import HealthMonitor
from pd.router.workers import Worker, WorkerPool
from pd.util import jsonbody

log = logging.getLogger("pd.router")

DEFAULT_DRAIN_TIMEOUT = 30.0  # seconds


def _unroutable_host(url: str) -> Optional[str]:
    """Why the admin API refuses a worker at ``url``'s host, or None: an IP literal that is link-local (the
    cloud metadata service at 169.254.169.254), multicast or unspecified is never a worker, and a worker
    receives the client API key."""
    try:
        host = urlsplit(url if "://" in url else "http://" + url).hostname or ""
        ip = ipaddress.ip_address(host)
    except ValueError:  # a name (resolved when the router connects) or a malformed URL (the pool says why)
        return None
    if ip.is_link_local or ip.is_multicast or ip.is_unspecified:
        return f"worker URL {url!r}: {ip} is a link-local, multicast or unspecified address, not a worker's"
    return None


class WorkerHosts:
    """Where the admin API may add workers: the cluster's own nodes (the hosts of the workers the router
    started with), plus ``allowed_worker_hosts`` (names, IPs, networks, ``*``). Names are compared as
    written, never resolved (a name that resolves elsewhere later must not widen the list).

    Args:
        config: the router's config (its initial workers and ``allowed_worker_hosts``).
    """

    def __init__(self, config: RouterConfig):
        urls = [p.url for p in config.prefill] + list(config.decode)
        self.nodes = {_host(u) for u in urls}
        allowed = set(config.allowed_worker_hosts)
        self.any = "*" in allowed
        self.networks = [ipaddress.ip_network(h, strict=False) for h in allowed if "/" in h]
        self.names = {h for h in allowed if "/" not in h and h != "*"}

    def refusal(self, url: str) -> Optional[str]:
        """Why a worker at ``url`` may not be added, or None."""
        host = _host(url)
        if self.any or host in self.nodes or host in self.names:
            return None
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            ip = None
        if ip is not None and any(ip in net for net in self.networks):
            return None
        return (f"worker host {host!r} is not one of this cluster's nodes ({', '.join(sorted(self.nodes))}); "
                "allow it with the router's allowed_worker_hosts (--allowed-worker-hosts HOST|NETWORK|*)")


def _host(url: str) -> str:
    """A URL's host, lower case, IPv6 without brackets (normalize_url's form)."""
    return (urlsplit(url if "://" in url else "http://" + url).hostname or "").lower()


def _json(obj, status: int = 200) -> Response:
    return Response(json.dumps(obj).encode(), status_code=status, media_type="application/json")


class AdminAPI:
    """Admin routes over one pool.

    Args:
        pool: the workers.
        auth: key checks.
        health: the health monitor (its thresholds apply to restored workers).
    """

    def __init__(self, pool: WorkerPool, auth: Auth, health: HealthMonitor):
        self.pool = pool
        self.auth = auth
        self.health = health
        self.hosts = WorkerHosts(pool.config)
        self.planner: dict = {}  # the launcher's last report of the split controller
        self.override: Optional[dict] = None

    def routes(self) -> list[Route]:
        """The admin routes (/workers GET/POST/DELETE, /workers/drain, /workers/activate), each behind the admin key."""
        return [
            Route("/workers", self._guard(self.list_workers), methods=["GET"]),
            Route("/workers", self._guard(self.add_worker), methods=["POST"]),
            Route("/workers", self._guard(self.remove_worker), methods=["DELETE"]),
            Route("/workers/drain", self._guard(self.drain_worker), methods=["POST"]),
            Route("/workers/activate", self._guard(self.activate_worker), methods=["POST"]),
            Route("/planner", self._guard(self.get_planner), methods=["GET"]),
            Route("/planner", self._guard(self.report_planner), methods=["POST"]),
            Route("/planner/override", self._guard(self.set_override), methods=["PUT"]),
            Route("/planner/override", self._guard(self.clear_override), methods=["DELETE"]),
        ]

    def _guard(self, handler):
        async def guarded(request: Request) -> Response:
            if not self.auth.admin_ok(request):
                if self.auth.admin_api_key or self.auth.api_key:
                    return error_response(401, "the admin API needs 'Authorization: Bearer ADMIN_KEY' (a cluster "
                                          "pdserve launched: the config's router.admin_api_key, else the key file "
                                          "its log names, pdserve_admin_key_<router port> in the Ray session dir)")
                return error_response(403, "the admin API without an admin key is only open to loopback clients "
                                           "(start the router with --admin-api-key)")
            return await handler(request)

        return guarded

    @staticmethod
    async def _body(request: Request) -> dict | Response:
        """The request's JSON object body, or the 400 to answer."""
        try:
            body = jsonbody.loads(await request.body() or b"{}")  # no NaN, no lone surrogates, any nesting
        except (ValueError, UnicodeDecodeError) as e:
            return error_response(400, f"malformed JSON body: {e}")
        if not isinstance(body, dict):
            return error_response(400, "the request body must be a JSON object")
        return body

    async def _body_and_worker(self, request: Request) -> tuple[dict, Worker] | Response:
        """The JSON body of a request about one worker, and that worker (by the body's ``url``); or the 4xx."""
        body = await self._body(request)
        if isinstance(body, Response):
            return body
        w = self._find(body.get("url"))
        if isinstance(w, Response):
            return w
        return body, w

    def _find(self, url: object) -> Worker | Response:
        """The worker with URL ``url``, or the 400 (no URL, a bad one) or 404 (no such worker) to answer."""
        if not isinstance(url, str) or not url:
            return error_response(400, "url is required", "url")
        try:
            w = self.pool.get(url)
        except ValueError as e:
            return error_response(400, str(e), "url")
        if w is None:
            return error_response(404, f"{url} is not a worker of this router", "url")
        return w

    async def list_workers(self, request: Request) -> Response:
        """GET /workers: every worker's description and the per-role counts."""
        workers = [w.describe() for w in self.pool.all]
        return _json({"workers": workers, "total": len(workers),
                      "stats": {"prefill_count": len(self.pool.prefill), "decode_count": len(self.pool.decode)}})

    async def add_worker(self, request: Request) -> Response:
        """POST /workers {url, worker_type|role, bootstrap_port?, api_key?}: add a worker; 400 naming the bad
        field, 403 for a host outside the cluster (``WorkerHosts``)."""
        body = await self._body(request)
        if isinstance(body, Response):
            return body
        url, role = body.get("url"), body.get("worker_type", body.get("role"))
        if not isinstance(url, str) or not url:
            return error_response(400, "url is required", "url")
        refused = _unroutable_host(url)
        if refused:
            return error_response(400, refused, "url")
        api_key = body.get("api_key")
        if api_key is not None and not valid_key(api_key):
            return error_response(400, "api_key must be a non-empty string of visible ASCII characters", "api_key")
        try:
            outside = self.hosts.refusal(normalize_url(url))
        except ValueError as e:
            return error_response(400, str(e), "url")
        if outside:
            return error_response(403, outside, "url")
        try:
            # pool.add refuses a role that is not one of ROLES (None and non-strings included) with a ValueError
            w = self.pool.add(url, cast(str, role), body.get("bootstrap_port"), api_key)
        except ValueError as e:
            status = 409 if "already a worker" in str(e) else 400
            return error_response(status, str(e))
        except TypeError as e:
            return error_response(400, f"bootstrap_port: {e}", "bootstrap_port")
        log.warning("admin: added %s worker %s", w.role, w.url)
        return _json({"worker": w.describe()}, 201)

    async def remove_worker(self, request: Request) -> Response:
        """DELETE /workers?url=: remove a worker at once (its in-flight requests finish); 404 if unknown."""
        w = self._find(request.query_params.get("url"))
        if isinstance(w, Response):
            return w
        self.pool.remove(w.url)
        log.warning("admin: removed %s worker %s (%d requests in flight finish on their own)", w.role, w.url,
                    w.inflight)
        return _json({"removed": w.describe()})

    async def drain_worker(self, request: Request) -> Response:
        """POST /workers/drain {url, timeout_secs?}: stop new requests to a worker and wait for its in-flight ones."""
        found = await self._body_and_worker(request)
        if isinstance(found, Response):
            return found
        body, w = found
        timeout = body.get("timeout_secs", DEFAULT_DRAIN_TIMEOUT)
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout < 0:
            return error_response(400, "timeout_secs must be a number >= 0", "timeout_secs")
        w.draining = True
        log.warning("admin: draining %s worker %s (%d requests in flight)", w.role, w.url, w.inflight)
        drained = await w.wait_idle(float(timeout))
        removed = False
        if body.get("remove") and self.pool.get(w.url) is w:
            self.pool.remove(w.url)
            removed = True
        return _json({"worker": w.describe(), "drained": drained, "removed": removed})

    async def activate_worker(self, request: Request) -> Response:
        """POST /workers/activate {url}: end a drain and reset the worker's circuit breaker."""
        found = await self._body_and_worker(request)
        if isinstance(found, Response):
            return found
        _, w = found
        w.draining = False
        w.breaker.reset()
        w.health_failures = w.health_successes = 0
        w.set_healthy(True)
        log.warning("admin: %s worker %s is back in routing", w.role, w.url)
        return _json({"worker": w.describe()})

    async def get_planner(self, request: Request) -> Response:
        """GET /planner: the current split (the pool's counts), the override, the launcher's last report."""
        current = {"prefill": len(self.pool.prefill), "decode": len(self.pool.decode)}
        return _json({"mode": "off", **self.planner, "current": current, "override": self.override})

    async def report_planner(self, request: Request) -> Response:
        """POST /planner {mode, target, decision, moving, ...}: the launcher's report, shown by GET /planner."""
        body = await self._body(request)
        if isinstance(body, Response):
            return body
        self.planner = {k: v for k, v in body.items() if k not in ("current", "override")}
        return _json({"ok": True})

    async def set_override(self, request: Request) -> Response:
        """PUT /planner/override {prefill, decode}: pin the split; 400 naming a count that is not an integer >= 1."""
        body = await self._body(request)
        if isinstance(body, Response):
            return body
        for role in ("prefill", "decode"):
            n = body.get(role)
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                return error_response(400, f"{role} must be an integer >= 1 (replicas in that role)", role)
        self.override = {"prefill": body["prefill"], "decode": body["decode"]}
        log.warning("admin: planner split pinned at %dP%dD", body["prefill"], body["decode"])
        return _json({"override": self.override})

    async def clear_override(self, request: Request) -> Response:
        """DELETE /planner/override: unpin the split."""
        self.override = None
        log.warning("admin: planner split unpinned")
        return _json({"override": None})
