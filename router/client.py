"""The pooled aiohttp client a router process uses for health checks, aborts and info proxies
(no connection per request: keep-alive connections are reused across requests). The two
generation requests of each PD request go through pd.router.upstream instead (CPU per request)."""

from __future__ import annotations

import aiohttp

from pd.router.config import RouterConfig

JSON_HEADERS = {"Content-Type": "application/json"}


def make_session(config: RouterConfig) -> aiohttp.ClientSession:
    """An ``aiohttp.ClientSession`` with a bounded connection pool and the config's timeouts
    (``timeouts.request`` seconds in total per upstream request, ``timeouts.connect`` to connect).

    Must be called inside a running event loop; close it with ``await session.close()``.
    """
    connector = aiohttp.TCPConnector(
        limit=config.max_connections,
        limit_per_host=0,  # the global limit is the bound; one busy decode may need most of it
        keepalive_timeout=60,
        ttl_dns_cache=300,
        enable_cleanup_closed=False,  # plain HTTP to the workers: no SSL transports to reap
    )
    timeout = aiohttp.ClientTimeout(total=config.timeouts.request, connect=config.timeouts.connect)
    # Bodies are relayed byte for byte: ask for no compression, and never decompress.
    return aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False,
                                 skip_auto_headers=("User-Agent", "Accept-Encoding"))
