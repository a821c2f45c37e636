"""The pooled httpx client a router process uses for its secondary traffic: health checks, aborts
and info proxies (no connection per request: keep-alive connections are reused across requests).
The two generation requests of each PD request go through pd.router.upstream instead (CPU per
request); httpx is the project's client everywhere else (the launcher, the admin client)."""

from __future__ import annotations

import asyncio
from typing import Optional

import httpx

from pd.router.config import RouterConfig

JSON_HEADERS = {"Content-Type": "application/json"}
KEEPALIVE = 60.0  # seconds an idle pooled connection is kept


def make_client(config: RouterConfig) -> httpx.AsyncClient:
    """An ``httpx.AsyncClient`` with a bounded connection pool (``max_connections`` over all
    workers, no per-worker limit: one busy decode may need most of it) and the config's timeouts
    (``timeouts.connect`` seconds to connect, ``timeouts.request`` for each other phase). Each call
    site bounds its own request in total with ``request``. Redirects are followed as a browser
    would, except where a call says otherwise.

    Close it with ``await client.aclose()``.
    """
    limits = httpx.Limits(max_connections=config.max_connections, max_keepalive_connections=config.max_connections,
                          keepalive_expiry=KEEPALIVE)
    timeout = httpx.Timeout(config.timeouts.request, connect=config.timeouts.connect)
    client = httpx.AsyncClient(limits=limits, timeout=timeout, follow_redirects=False)
    # Bodies are relayed byte for byte: ask for no compression, and send no client name.
    del client.headers["accept-encoding"]
    del client.headers["user-agent"]
    return client


def started(client: Optional[httpx.AsyncClient], owner: str) -> httpx.AsyncClient:
    """``client``, which its ``owner`` gets once the event loop runs (the router's lifespan).

    Raises:
        RuntimeError: ``client`` is still None (``owner`` was not started).
    """
    if client is None:
        raise RuntimeError(f"{owner} has no HTTP client yet: the router's lifespan has not started it")
    return client


class WorkerRedirect(httpx.HTTPError):
    """A worker answered a redirect (3xx). The router follows none: a worker could point it at any host (one
    the admin API refuses, or a cloud metadata address) and have that host's answer relayed or trusted."""


async def fetch(client: httpx.AsyncClient, method: str, url: str, total: float, *,
                headers: Optional[dict] = None, json: object = None) -> httpx.Response:
    """``method url`` on ``client`` with its body read, bounded by ``total`` seconds in all (pool
    wait, connect, send, the whole answer): httpx's own timeouts bound each phase, not the sum.

    Raises:
        TimeoutError: ``total`` passed (httpx's own phase timeouts raise ``httpx.TimeoutException``).
        WorkerRedirect: the answer is a 3xx (never followed).
        httpx.HTTPError: the request failed (no connection, broken connection, protocol error).
    """
    async with asyncio.timeout(total):
        r = await client.request(method, url, headers=headers, json=json, follow_redirects=False)
    if r.is_redirect or 300 <= r.status_code < 400:
        raise WorkerRedirect(f"{url} answered {r.status_code}, a redirect (to {r.headers.get('location', '?')!r}); "
                             f"the router follows no redirect from a worker")
    return r


def content_type(resp: httpx.Response) -> str:
    """The media type of ``resp`` without parameters (``application/octet-stream`` when absent)."""
    value = resp.headers.get("content-type")
    return value.split(";", 1)[0].strip().lower() if value else "application/octet-stream"
