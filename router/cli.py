"""``pdserve router``: the PD router alone, for engines started by hand.

Flag names follow ``sglang_router.launch_router``: ``--prefill URL [BOOTSTRAP_PORT]`` (repeatable;
the bootstrap port defaults to SGLang's 8998 when omitted or ``none``), ``--decode URL``
(repeatable), ``--host``, ``--port``, ``--policy``, ``--request-timeout-secs`` (alias
``--request-timeout``). ``--pd-disaggregation`` is accepted and implied.
"""

from __future__ import annotations

import argparse
import logging
from typing import Optional

import uvicorn

from pd.router.app import create_app
from pd.router.config import DEFAULT_BOOTSTRAP_PORT, PrefillWorkerConfig, RouterConfig

log = logging.getLogger("pd.router")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdserve router",
        description="The pdserve PD router: pairs each request with one prefill and one decode worker "
                    "(round-robin per side), adds the bootstrap fields, relays decode's answer.",
    )
    p.add_argument("--prefill", nargs="+", action="append", default=[], metavar=("URL", "BOOTSTRAP_PORT"),
                   help="a prefill worker URL and its bootstrap port (default %d); repeat for more"
                        % DEFAULT_BOOTSTRAP_PORT)
    p.add_argument("--decode", nargs=1, action="append", default=[], metavar="URL",
                   help="a decode worker URL; repeat for more")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    p.add_argument("--port", type=int, default=30000, help="port to listen on (default %(default)s)")
    p.add_argument("--policy", default="round_robin", choices=["round_robin"],
                   help="how the (prefill, decode) pair is picked (default %(default)s)")
    p.add_argument("--pd-disaggregation", action="store_true", help="accepted for sglang_router compatibility; implied")
    p.add_argument("--request-timeout-secs", "--request-timeout", dest="request_timeout", type=float, default=1800.0,
                   help="seconds one upstream request may take in total, streams included (default %(default)s)")
    p.add_argument("--connect-timeout-secs", "--connect-timeout", dest="connect_timeout", type=float, default=10.0,
                   help="seconds to connect to a worker (default %(default)s)")
    p.add_argument("--health-check-interval-secs", "--health-check-interval", dest="health_check_interval",
                   type=float, default=10.0, help="seconds between /health probes of every worker; 0 = off "
                                                  "(default %(default)s)")
    p.add_argument("--max-connections", type=int, default=1024,
                   help="pooled upstream connections, all workers together (default %(default)s)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def parse_prefill(values: list[str]) -> PrefillWorkerConfig:
    """``[URL]`` or ``[URL, BOOTSTRAP_PORT]`` (port may be ``none``) -> PrefillWorkerConfig.

    Raises:
        ValueError: more than two values, or a port that is not an integer / ``none``.
    """
    if len(values) > 2:
        raise ValueError(f"--prefill takes URL [BOOTSTRAP_PORT], got {values}")
    url = values[0]
    port = values[1] if len(values) == 2 else None
    if port is None or port.lower() == "none":
        return PrefillWorkerConfig(url=url)
    if not port.isdigit():
        raise ValueError(f"--prefill {url}: bootstrap port {port!r} is not a number")
    return PrefillWorkerConfig(url=url, bootstrap_port=int(port))


def config_from_args(argv: Optional[list[str]] = None) -> RouterConfig:
    """Parse ``pdserve router`` arguments into a RouterConfig (exits with usage on bad input)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.prefill or not args.decode:
        parser.error("at least one --prefill and one --decode worker are required")
    try:
        return RouterConfig(
            prefill=[parse_prefill(v) for v in args.prefill],
            decode=[v[0] for v in args.decode],
            host=args.host, port=args.port, policy=args.policy,
            request_timeout=args.request_timeout, connect_timeout=args.connect_timeout,
            health_check_interval=args.health_check_interval, max_connections=args.max_connections,
            log_level=args.log_level,
        )
    except ValueError as e:  # pydantic's ValidationError is a ValueError
        parser.error(str(e))


class _Server(uvicorn.Server):
    """uvicorn.Server that logs the ready line once the socket is listening."""

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            port = self.config.port
            for server in getattr(self, "servers", []):
                for sock in server.sockets:
                    port = sock.getsockname()[1]  # the real port when --port 0
            log.info("pdserve router ready at http://%s:%d", self.config.host, port)


def make_server(config: RouterConfig) -> uvicorn.Server:
    """A uvicorn server for the router (``await server.serve()`` inside a loop, or
    ``server.run()`` to block)."""
    ucfg = uvicorn.Config(create_app(config), host=config.host, port=config.port,
                          log_level=config.log_level, access_log=False, timeout_graceful_shutdown=5,
                          backlog=4096)
    return _Server(ucfg)


def serve(config: RouterConfig) -> None:
    """Run the router until SIGINT/SIGTERM (blocking)."""
    make_server(config).run()


async def serve_async(config: RouterConfig) -> None:
    """Run the router in the current event loop until it is told to exit."""
    await make_server(config).serve()


def main(argv: Optional[list[str]] = None) -> None:
    """Entry point of ``pdserve router``."""
    config = config_from_args(argv)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.info("prefill workers: %s; decode workers: %s",
             ", ".join(f"{p.url} (bootstrap {p.bootstrap_host}:{p.bootstrap_port})" for p in config.prefill),
             ", ".join(config.decode))
    serve(config)

