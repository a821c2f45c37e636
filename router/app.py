"""The router's HTTP application (FastAPI/Starlette): routes, lifespan (the pooled clients, health
checks).

Routes:

- client routes (``api_key`` when set): POST /generate, /v1/completions, /v1/chat/completions (PD
  dispatch, pd.router.dispatch, served on bare ASGI in front of FastAPI: pd.router.front); GET
  /v1/models, /get_model_info (/model_info), proxied to an available decode worker (pd.router.client);
- GET /get_server_info (/server_info), proxied the same way but behind the admin key (pd.router.auth:
  SGLang's answer is its whole configuration). Every proxied info answer is scrubbed of secrets
  (pd.util.redact.scrub: ``api_key``, ``admin_api_key``, ``--api-key`` in ``launch_command``, any field
  ending in api_key/token/secret/password, the worker's key itself);
- open routes: GET /health (the router is up), /health_generate (every worker can generate),
  /metrics (Prometheus);
- admin routes (pd.router.admin): /workers, /workers/drain, /workers/activate.

Unknown routes: 404, wrong methods 405, both with an OpenAI-style error body.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

import httpx
from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.routing import Route

from pd.router.admin import AdminAPI
from pd.router.auth import Auth
from pd.router.client import WorkerRedirect, content_type, fetch, make_client, started
from pd.router.config import RouterConfig
from pd.router.dispatch import PDDispatcher
from pd.router.errors import TIMEOUT_ERRORS, UPSTREAM_ERRORS, error_response
from pd.router.front import GenerationFront
from pd.router.health import HealthMonitor
from pd.router.metrics import RouterMetrics
from pd.router.upstream import UpstreamClient
from pd.router.workers import WorkerPool
from pd.util.redact import redact_text, scrub

log = logging.getLogger("pd.router")

GENERATION_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")
SHUTDOWN_DRAIN = 5.0  # seconds to let prefill reads and aborts finish at shutdown
PROXY_TIMEOUT = 30.0  # seconds for a proxied info request
INFO_ROUTES = ("/v1/models", "/get_model_info", "/model_info", "/get_server_info", "/server_info")
ADMIN_INFO_ROUTES = ("/get_server_info", "/server_info")  # SGLang's whole configuration: operators only
# Clients may use either name; workers are asked by the current one (SGLang 0.5.23 logs a deprecation warning
# for each /get_*_info call, entrypoints/http_server.py).
WORKER_INFO_PATH = {"/get_model_info": "/model_info", "/get_server_info": "/server_info"}


class Router:
    """One router: its workers, metrics, dispatcher, health checks and admin API.

    Args:
        config: workers, policies, failure handling, limits.
    """

    def __init__(self, config: RouterConfig):
        self.config = config
        self.metrics = RouterMetrics(GENERATION_ROUTES)
        self.auth = Auth(config.api_key, config.admin_api_key)
        self.pool = WorkerPool(config, self.metrics)
        self.dispatcher = PDDispatcher(self.pool, self.metrics, config, self.auth)
        self.health = HealthMonitor(self.pool, config.health_check)
        self.admin = AdminAPI(self.pool, self.auth, self.health)
        self.http: httpx.AsyncClient | None = None  # health checks, aborts, info proxies
        self.client: UpstreamClient | None = None  # the generation requests

    async def start(self) -> None:
        """Open the pooled clients and start health checks (inside the serving event loop)."""
        self.http = make_client(self.config)
        self.client = UpstreamClient(self.config.max_connections, self.config.timeouts.connect)
        self.dispatcher.bind(self.http, self.client)
        self.health.start(self.http)
        for policy in self.pool.policies.values():
            policy.start(self.http)

    async def stop(self) -> None:
        """Stop health checks, let in-flight background work drain, close the HTTP clients."""
        await self.health.stop()
        for policy in self.pool.policies.values():
            await policy.stop()
        await self.dispatcher.tasks.drain(SHUTDOWN_DRAIN)
        if self.http is not None:
            await self.http.aclose()
        if self.client is not None:
            await self.client.close()

    async def proxy_get(self, request: Request) -> Response:
        """GET the path (its current name, ``WORKER_INFO_PATH``) on an available decode worker and relay status
        and body, scrubbed of secrets
        (``/get_server_info``, ``/server_info``: admin key only); 502/504 naming the worker, 503 when there
        is none."""
        path = request.url.path
        t0 = time.perf_counter()
        status, kind = 200, None
        if path in ADMIN_INFO_ROUTES and not self.auth.admin_ok(request):
            status, kind = (401 if self.auth.admin_api_key or self.auth.api_key else 403), "unauthorized"
            resp = error_response(status, f"{path} needs the admin key ('Authorization: Bearer ADMIN_KEY')"
                                  if status == 401 else f"{path} without an admin key is only open to loopback "
                                  "clients (start the router with --admin-api-key)")
        elif not self.auth.client_ok(request):
            status, kind = 401, "unauthorized"
            resp = error_response(401, "missing or invalid API key (send 'Authorization: Bearer KEY')")
        else:
            worker = next((w for w in self.pool.decode if w.available()), None)
            if worker is None:
                status, kind = 503, "no_worker"
                resp = error_response(503, self.pool.unavailable_reason("decode"))
            else:
                try:
                    r = await fetch(started(self.http, "Router"), "GET", worker.url + WORKER_INFO_PATH.get(path, path),
                                    PROXY_TIMEOUT, headers=worker.headers)
                    status = r.status_code
                    resp = Response(self._scrubbed(r.content, worker), status_code=status,
                                    media_type=content_type(r))
                except UPSTREAM_ERRORS as e:
                    timeout = isinstance(e, TIMEOUT_ERRORS)
                    status, kind = (504, "decode_timeout") if timeout else (502, "decode_connect")
                    what = "timed out" if timeout else \
                        "answered a redirect" if isinstance(e, WorkerRedirect) else "is unreachable"
                    resp = error_response(status, f"decode worker {worker.url} {what} on {path}: {e}")
        m = self.metrics
        m.requests.labels(path, str(status)).inc()
        if kind is not None:
            m.errors.labels(path, kind).inc()
        m.e2e.labels(path).observe(time.perf_counter() - t0)
        return resp

    def _scrubbed(self, body: bytes, worker) -> bytes:
        """A worker's info answer without secrets (pd.util.redact): JSON scrubbed field by field, anything else
        as text; the worker's own key and the router's keys are removed wherever they appear."""
        c = self.config
        keys = [c.api_key, c.admin_api_key, c.worker_api_key]
        _, _, token = worker.headers.get("Authorization", "").partition(" ")
        keys.append(token or None)
        try:
            data = json.loads(body)
        except ValueError:
            return redact_text(body.decode(errors="replace"), keys).encode()
        return json.dumps(scrub(data, keys)).encode()

    async def flush_cache(self, request: Request) -> Response:
        """GET/POST /flush_cache: SGLang's route, sent to every worker (prefill and decode) concurrently with
        the client's ``timeout`` (seconds a worker waits to go idle), as sgl-model-gateway does. 200 when every
        worker flushed; else 502 with each worker's answer (``{"workers": [{"url", "role", "status",
        "message"}]}``); 400 for a ``timeout`` that is not a number of seconds >= 0."""
        if not self.auth.client_ok(request):
            return error_response(401, "missing or invalid API key (send 'Authorization: Bearer KEY')")
        raw = request.query_params.get("timeout", "0")
        try:
            wait = float(raw)
        except ValueError:
            wait = -1.0
        if not 0 <= wait <= 3600:  # NaN fails too
            return error_response(400, f"timeout must be seconds in [0, 3600], got {raw!r}", "timeout")
        query = f"/flush_cache?timeout={wait:g}"

        async def one(w):
            try:
                r = await fetch(self.http, "POST", w.url + query, PROXY_TIMEOUT + wait, headers=w.headers)
                return {"url": w.url, "role": w.role, "status": r.status_code, "message": r.text.strip()}
            except UPSTREAM_ERRORS as e:
                return {"url": w.url, "role": w.role, "status": None, "message": repr(e)}

        results = await asyncio.gather(*(one(w) for w in self.pool.all))
        if results and all(r["status"] == 200 for r in results):
            return Response(f"Cache flushed on {len(results)} workers.\n", status_code=200)
        failed = sum(r["status"] != 200 for r in results)
        return error_response(502, f"{failed} of {len(results)} workers did not flush their cache",
                              extra={"workers": results})


def create_app(config: RouterConfig) -> GenerationFront:
    """The router as an ASGI app; serve it with uvicorn (see ``pd.router.cli.serve``): the
    generation routes on bare ASGI, the rest on FastAPI (``.app``).

    The router object is at ``app.state.router`` (metrics, workers) for tests and the launcher.
    """
    router = Router(config)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="pdserve router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.router = router

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        msg = f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405) else str(exc.detail)
        return error_response(exc.status_code, msg)

    routes = app.router.routes
    for path in INFO_ROUTES:
        routes.append(Route(path, router.proxy_get, methods=["GET"]))
    routes.extend(router.admin.routes())
    routes.append(Route("/flush_cache", router.flush_cache, methods=["GET", "POST"]))

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate():
        failed = await router.health.health_generate()
        if not failed:
            return Response(status_code=200)
        names = ", ".join(f"{f['role']} {f['worker']} ({f['error']})" for f in failed)
        return error_response(503, f"{len(failed)} of {len(router.pool.all)} workers failed /health_generate: {names}",
                              extra={"failed": failed})

    @app.get("/metrics")
    async def metrics():
        return Response(router.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return GenerationFront(app, router.dispatcher.handle, GENERATION_ROUTES)
