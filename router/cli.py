"""``pdserve router``: the PD router alone, for engines started by hand.

Flag names follow ``sglang_router.launch_router`` (``--prefill URL [BOOTSTRAP_PORT]``, repeatable,
the bootstrap port defaulting to SGLang's 8998 when omitted or ``none``; ``--decode URL``,
repeatable; ``--policy`` / ``--prefill-policy`` / ``--decode-policy``; ``--cache-threshold``,
``--balance-abs-threshold``, ``--balance-rel-threshold``, ``--eviction-interval-secs``,
``--max-tree-size``; ``--retry-*``, ``--disable-retries``; ``--cb-*``,
``--disable-circuit-breaker``; ``--health-*``; ``--request-timeout-secs``; ``--max-payload-size``;
``--api-key``; ``--request-id-headers``). pdserve adds per-stage timeouts
(``--connect-timeout-secs``, ``--prefill-timeout-secs``, ``--first-token-timeout-secs``,
``--stream-idle-timeout-secs``) and ``--admin-api-key``. ``--pd-disaggregation`` is accepted and
implied. Keys may come from the environment instead of the command line (visible in ``ps``):
``PDSERVE_ROUTER_API_KEY``, ``PDSERVE_ROUTER_ADMIN_API_KEY``.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
from typing import Optional

import uvicorn
from pydantic import ValidationError

from pd.router.app import create_app
from pd.router.config import (ADMIN_KEY_ENV, API_KEY_ENV, DEFAULT_BOOTSTRAP_PORT, POLICY_NAMES, CacheAwareConfig,
                              CircuitBreakerConfig, HealthCheckConfig, PrefillWorkerConfig, RetryConfig, RouterConfig,
                              TimeoutConfig)

log = logging.getLogger("pd.router")

# (config model, field) -> the flag that sets it, so a bad value is reported under the flag the user typed.
_FLAG_OF_FIELD: dict[tuple[str, str], str] = {
    **{("RouterConfig", f): "--" + f.replace("_", "-") for f in (
        "host", "port", "prefill", "decode", "policy", "prefill_policy", "decode_policy", "max_payload_size",
        "max_connections", "api_key", "admin_api_key", "request_id_headers", "log_level")},
    ("PrefillWorkerConfig", "url"): "--prefill",
    ("PrefillWorkerConfig", "bootstrap_port"): "--prefill URL BOOTSTRAP_PORT",
    **{("CacheAwareConfig", f): "--" + f.replace("_", "-") for f in (
        "cache_threshold", "balance_abs_threshold", "balance_rel_threshold", "eviction_interval_secs",
        "max_tree_size")},
    **{("RetryConfig", f): "--retry-" + f.replace("_", "-") for f in (
        "max_retries", "initial_backoff_ms", "max_backoff_ms", "backoff_multiplier", "jitter_factor")},
    **{("CircuitBreakerConfig", f): "--cb-" + f.replace("_", "-") for f in (
        "failure_threshold", "success_threshold", "timeout_duration_secs", "window_duration_secs")},
    ("HealthCheckConfig", "interval_secs"): "--health-check-interval-secs",
    ("HealthCheckConfig", "timeout_secs"): "--health-check-timeout-secs",
    ("HealthCheckConfig", "failure_threshold"): "--health-failure-threshold",
    ("HealthCheckConfig", "success_threshold"): "--health-success-threshold",
    ("HealthCheckConfig", "endpoint"): "--health-check-endpoint",
    **{("TimeoutConfig", f): f"--{f.replace('_', '-')}-timeout-secs" for f in (
        "connect", "prefill", "first_token", "stream_idle", "request")},
}


def flag_errors(e: ValidationError) -> str:
    """A router config validation error as one line per problem, each naming the ``pdserve router``
    flag that set the bad value (``--port: Input should be less than or equal to 65535, got 99999``)."""
    lines = []
    for err in e.errors():
        field = str(err["loc"][0]) if err["loc"] else ""
        flag = _FLAG_OF_FIELD.get((e.title, field), ".".join(str(x) for x in err["loc"]))
        msg = err["msg"].removeprefix("Value error, ")
        got = f", got {err['input']!r}" if err["type"] != "value_error" and not isinstance(err["input"], dict) else ""
        lines.append(f"{flag}: {msg}{got}" if flag else msg)
    return "; ".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The router's argument parser (sglang-router's flag names where one exists)."""
    p = argparse.ArgumentParser(
        prog="pdserve router",
        description="The pdserve PD router: pairs each request with one prefill and one decode worker, adds the "
                    "bootstrap fields, relays decode's answer; retries, circuit breakers, health checks, admin API.",
    )
    add = p.add_argument
    add("--prefill", nargs="+", action="append", default=[], metavar=("URL", "BOOTSTRAP_PORT"),
        help="a prefill worker URL and its bootstrap port (default %d); repeat for more" % DEFAULT_BOOTSTRAP_PORT)
    add("--decode", nargs=1, action="append", default=[], metavar="URL", help="a decode worker URL; repeat for more")
    add("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    add("--port", type=int, default=30000, help="port to listen on, 0 = any free one (default %(default)s)")
    add("--pd-disaggregation", action="store_true", help="accepted for sglang_router compatibility; implied")

    g = p.add_argument_group("policies")
    g.add_argument("--policy", default="round_robin", choices=POLICY_NAMES,
                   help="pairing policy of both sides unless overridden (default %(default)s)")
    g.add_argument("--prefill-policy", choices=POLICY_NAMES, help="policy of the prefill side")
    g.add_argument("--decode-policy", choices=POLICY_NAMES, help="policy of the decode side")
    ca = CacheAwareConfig()
    g.add_argument("--cache-threshold", type=float, default=ca.cache_threshold,
                   help="cache_aware: prefix match ratio that wins a worker (default %(default)s)")
    g.add_argument("--balance-abs-threshold", type=int, default=ca.balance_abs_threshold,
                   help="cache_aware: in-flight difference that switches to least load (default %(default)s)")
    g.add_argument("--balance-rel-threshold", type=float, default=ca.balance_rel_threshold,
                   help="cache_aware: in-flight ratio that switches to least load (default %(default)s)")
    g.add_argument("--eviction-interval-secs", type=float, default=ca.eviction_interval_secs,
                   help="cache_aware: seconds between tree trims (default %(default)s)")
    g.add_argument("--max-tree-size", type=int, default=ca.max_tree_size,
                   help="cache_aware: characters kept per worker tree (default %(default)s)")

    g = p.add_argument_group("retries (before the first byte reaches the client, each on a fresh pair)")
    r = RetryConfig()
    g.add_argument("--retry-max-retries", type=int, default=r.max_retries,
                   help="attempts in all, 1 = no retry (default %(default)s)")
    g.add_argument("--retry-initial-backoff-ms", type=float, default=r.initial_backoff_ms)
    g.add_argument("--retry-max-backoff-ms", type=float, default=r.max_backoff_ms)
    g.add_argument("--retry-backoff-multiplier", type=float, default=r.backoff_multiplier)
    g.add_argument("--retry-jitter-factor", type=float, default=r.jitter_factor)
    g.add_argument("--disable-retries", action="store_true", help="same as --retry-max-retries 1")

    g = p.add_argument_group("circuit breaker (per worker)")
    cb = CircuitBreakerConfig()
    g.add_argument("--cb-failure-threshold", type=int, default=cb.failure_threshold,
                   help="consecutive failures that open a worker's circuit (default %(default)s)")
    g.add_argument("--cb-success-threshold", type=int, default=cb.success_threshold,
                   help="half-open successes that close it (default %(default)s)")
    g.add_argument("--cb-timeout-duration-secs", type=float, default=cb.timeout_duration_secs,
                   help="seconds open before trial requests (default %(default)s)")
    g.add_argument("--cb-window-duration-secs", type=float, default=cb.window_duration_secs,
                   help="failures further apart do not add up (default %(default)s)")
    g.add_argument("--disable-circuit-breaker", action="store_true")

    g = p.add_argument_group("active health checks")
    hc = HealthCheckConfig()
    g.add_argument("--health-check-interval-secs", "--health-check-interval", dest="health_check_interval_secs",
                   type=float, default=hc.interval_secs, help="seconds between probe rounds, 0 = off (default %(default)s)")
    g.add_argument("--health-check-timeout-secs", type=float, default=hc.timeout_secs)
    g.add_argument("--health-failure-threshold", type=int, default=hc.failure_threshold,
                   help="failed probes in a row that take a worker out (default %(default)s)")
    g.add_argument("--health-success-threshold", type=int, default=hc.success_threshold,
                   help="passed probes in a row that put it back (default %(default)s)")
    g.add_argument("--health-check-endpoint", default=hc.endpoint)

    g = p.add_argument_group("timeouts (seconds)")
    t = TimeoutConfig()
    g.add_argument("--connect-timeout-secs", "--connect-timeout", dest="connect_timeout_secs", type=float,
                   default=t.connect, help="to connect to a worker (default %(default)s)")
    g.add_argument("--prefill-timeout-secs", type=float, help="dispatch -> the prefill's whole answer")
    g.add_argument("--first-token-timeout-secs", type=float,
                   help="dispatch -> decode's first byte (streams) or whole answer; retried")
    g.add_argument("--stream-idle-timeout-secs", type=float, help="longest silence inside a decode stream")
    g.add_argument("--request-timeout-secs", "--request-timeout", dest="request_timeout_secs", type=float,
                   default=t.request, help="one upstream request in total, streams included (default %(default)s)")

    g = p.add_argument_group("limits, keys, logging")
    g.add_argument("--max-payload-size", type=int, default=512 * 1024 * 1024,
                   help="largest request body in bytes (default %(default)s)")
    g.add_argument("--max-connections", type=int, default=1024,
                   help="pooled upstream connections, all workers together, per client (generation requests; "
                        "health checks, aborts and info) (default %(default)s)")
    g.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"key clients must send as 'Authorization: Bearer KEY'; also sent to the workers "
                        f"(default ${API_KEY_ENV})")
    g.add_argument("--admin-api-key", default=os.environ.get(ADMIN_KEY_ENV),
                   help=f"key of the admin API /workers (default ${ADMIN_KEY_ENV}; none: the api key, else "
                        f"loopback clients only)")
    g.add_argument("--request-id-headers", nargs="+", default=["x-request-id"],
                   help="headers a client request id is read from (default %(default)s)")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error", "critical"])
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
    a = parser.parse_args(argv)
    if not a.prefill or not a.decode:
        parser.error("at least one --prefill and one --decode worker are required")
    try:
        return RouterConfig(
            prefill=[parse_prefill(v) for v in a.prefill],
            decode=[v[0] for v in a.decode],
            host=a.host, port=a.port,
            policy=a.policy, prefill_policy=a.prefill_policy, decode_policy=a.decode_policy,
            cache_aware=CacheAwareConfig(cache_threshold=a.cache_threshold, balance_abs_threshold=a.balance_abs_threshold,
                                         balance_rel_threshold=a.balance_rel_threshold,
                                         eviction_interval_secs=a.eviction_interval_secs, max_tree_size=a.max_tree_size),
            retry=RetryConfig(max_retries=1 if a.disable_retries else a.retry_max_retries,
                              initial_backoff_ms=a.retry_initial_backoff_ms, max_backoff_ms=a.retry_max_backoff_ms,
                              backoff_multiplier=a.retry_backoff_multiplier, jitter_factor=a.retry_jitter_factor),
            circuit_breaker=CircuitBreakerConfig(enabled=not a.disable_circuit_breaker,
                                                 failure_threshold=a.cb_failure_threshold,
                                                 success_threshold=a.cb_success_threshold,
                                                 timeout_duration_secs=a.cb_timeout_duration_secs,
                                                 window_duration_secs=a.cb_window_duration_secs),
            health_check=HealthCheckConfig(interval_secs=a.health_check_interval_secs,
                                           timeout_secs=a.health_check_timeout_secs,
                                           failure_threshold=a.health_failure_threshold,
                                           success_threshold=a.health_success_threshold,
                                           endpoint=a.health_check_endpoint),
            timeouts=TimeoutConfig(connect=a.connect_timeout_secs, prefill=a.prefill_timeout_secs,
                                   first_token=a.first_token_timeout_secs, stream_idle=a.stream_idle_timeout_secs,
                                   request=a.request_timeout_secs),
            max_payload_size=a.max_payload_size, max_connections=a.max_connections,
            api_key=a.api_key, admin_api_key=a.admin_api_key, request_id_headers=tuple(a.request_id_headers),
            log_level=a.log_level,
        )
    except ValidationError as e:
        parser.error(flag_errors(e))
    except ValueError as e:
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
    # uvloop + httptools named (not "auto": a missing one must fail, not silently cost 2x CPU);
    # no access log and no X-Forwarded-* processing on the hot path.
    ucfg = uvicorn.Config(create_app(config), host=config.host, port=config.port, loop="uvloop",
                          http="httptools", proxy_headers=False, log_level=config.log_level, access_log=False,
                          timeout_graceful_shutdown=5, backlog=4096)
    return _Server(ucfg)


def serve(config: RouterConfig) -> None:
    """Run the router until SIGINT/SIGTERM (blocking)."""
    make_server(config).run()


async def serve_async(config: RouterConfig) -> None:
    """Run the router in the current event loop until it is told to exit."""
    await make_server(config).serve()


# gen0 threshold (allocations of container objects between young collections), gen1, gen2 ratios.
# CPython's default (700, 10, 10) runs a full collection every ~70,000 net allocations: a few
# hundred requests, each pause scanning every object of uvicorn, FastAPI, pydantic, aiohttp (ms),
# which showed as a 4-5x p99 (38 ms vs 8.8 ms at c=32, stub engines, benchmarks/router.py).
GC_THRESHOLDS = (20_000, 50, 100)


def tune_gc() -> None:
    """Make the garbage collector's pauses rare and short in a router process: move everything
    allocated so far (imported modules, the app) out of the collector's sight (``gc.freeze``) and
    collect young objects less often (``GC_THRESHOLDS``). Process-wide: only for a process that
    is the router (``pdserve router``)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def main(argv: Optional[list[str]] = None) -> None:
    """Entry point of ``pdserve router``."""
    config = config_from_args(argv)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.info("prefill workers: %s; decode workers: %s; policies: prefill %s, decode %s",
             ", ".join(f"{p.url} (bootstrap {p.bootstrap_host}:{p.bootstrap_port})" for p in config.prefill),
             ", ".join(config.decode), config.side_policy("prefill"), config.side_policy("decode"))
    tune_gc()
    serve(config)
