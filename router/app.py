"""The router's HTTP application (FastAPI): routes, lifespan (the pooled client, health probes).

Routes: POST /generate, /v1/completions, /v1/chat/completions (PD dispatch); GET /v1/models,
/get_model_info (/model_info), /get_server_info (/server_info) (proxied to the first decode
worker); GET /health (the router is up), /health_generate (every worker can generate),
/metrics (Prometheus). Unknown routes: 404 with an OpenAI-style error body.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import aiohttp
from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.routing import Route

from pd.router.client import make_session
from pd.router.config import RouterConfig
from pd.router.dispatch import UPSTREAM_ERRORS, PDDispatcher
from pd.router.errors import error_response
from pd.router.health import HealthMonitor
from pd.router.metrics import RouterMetrics
from pd.router.workers import Worker, WorkerPool

log = logging.getLogger("pd.router")

GENERATION_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")
SHUTDOWN_DRAIN = 5.0  # seconds to let prefill reads and aborts finish at shutdown
PROXY_TIMEOUT = 30.0  # seconds for a proxied info request


class Router:
    """One router: its workers, metrics, dispatcher and health monitor.

    Args:
        config: workers, policy, timeouts.
    """

    def __init__(self, config: RouterConfig):
        self.config = config
        self.metrics = RouterMetrics()
        self.pool = WorkerPool(config)
        self.pool.bind_metrics(self.metrics.inflight, self.metrics.healthy)
        self.dispatcher = PDDispatcher(self.pool, self.metrics)
        self.health = HealthMonitor(self.pool, config.health_check_interval)
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        """Open the pooled client and start health probes (inside the serving event loop)."""
        self.session = make_session(self.config)
        self.dispatcher.session = self.session
        self.health.start(self.session)

    async def stop(self) -> None:
        await self.health.stop()
        await self.dispatcher.drain(SHUTDOWN_DRAIN)
        if self.session is not None:
            await self.session.close()

    async def proxy_get(self, worker: Worker, path: str) -> Response:
        """GET ``path`` on ``worker`` and relay status and body; 502/504 naming the worker."""
        t0 = time.perf_counter()
        try:
            async with self.session.get(worker.url + path, timeout=aiohttp.ClientTimeout(total=PROXY_TIMEOUT)) as r:
                data = await r.read()
                status, ctype = r.status, r.content_type
        except UPSTREAM_ERRORS as e:
            timeout = isinstance(e, asyncio.TimeoutError)
            status = 504 if timeout else 502
            self.metrics.errors.labels(path, f"{worker.role}_{'timeout' if timeout else 'connect'}").inc()
            resp = error_response(status, f"{worker.role} worker {worker.url} {'timed out' if timeout else 'is unreachable'} "
                                          f"on {path}: {e!r}")
        else:
            resp = Response(data, status_code=status, media_type=ctype)
        self.metrics.requests.labels(path, str(status)).inc()
        self.metrics.e2e.labels(path).observe(time.perf_counter() - t0)
        return resp


def create_app(config: RouterConfig) -> FastAPI:
    """The router as an ASGI app; serve it with uvicorn (see ``pd.router.cli.serve``).

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

    def dispatch_route(path: str):
        async def handler(request: Request):
            return await router.dispatcher.handle(request, path)

        # A plain Starlette route: the hot path needs no FastAPI dependency solving or validation.
        app.router.routes.append(Route(path, handler, methods=["POST"], name="dispatch_" + path.strip("/").replace("/", "_")))

    for path in GENERATION_ROUTES:
        dispatch_route(path)

    def proxy_route(paths: tuple[str, ...]):
        async def handler(request: Request):
            return await router.proxy_get(router.pool.decode[0], request.url.path)

        handler.__name__ = "proxy_" + paths[0].strip("/").replace("/", "_")
        for p in paths:
            app.add_api_route(p, handler, methods=["GET"])

    proxy_route(("/v1/models",))
    proxy_route(("/get_model_info", "/model_info"))
    proxy_route(("/get_server_info", "/server_info"))

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

    return app
