"""``pdserve router``'s flags: the committed table of every flag (names, forms, types, choices) that
must stay compatible with ``python -m sglang_router.launch_router`` where the name exists there, the
setting each flag sets and its default."""

import argparse
from functools import reduce

import pytest

from pd.router.cli import build_parser, config_from_args
from pd.router.config import ADMIN_KEY_ENV, API_KEY_ENV

POLICIES = ("round_robin", "random", "least_load", "power_of_two", "cache_aware", "kv_aware")
LEVELS = ("debug", "info", "warning", "error", "critical")

# option strings, action ("store", "append" or "switch": no value), nargs, type, choices, metavar
FLAGS = [
    (("--prefill",), "append", "+", "str", None, ("URL", "BOOTSTRAP_PORT")),
    (("--decode",), "append", 1, "str", None, "URL"),
    (("--host",), "store", None, "str", None, None),
    (("--port",), "store", None, "int", None, None),
    (("--pd-disaggregation",), "switch", 0, "str", None, None),
    (("--policy",), "store", None, "str", POLICIES, None),
    (("--prefill-policy",), "store", None, "str", POLICIES, None),
    (("--decode-policy",), "store", None, "str", POLICIES, None),
    (("--cache-threshold",), "store", None, "float", None, None),
    (("--balance-abs-threshold",), "store", None, "int", None, None),
    (("--balance-rel-threshold",), "store", None, "float", None, None),
    (("--eviction-interval-secs",), "store", None, "float", None, None),
    (("--max-tree-size",), "store", None, "int", None, None),
    (("--kv-overlap-weight",), "store", None, "float", None, None),
    (("--kv-stale-secs",), "store", None, "float", None, None),
    (("--kv-info-timeout-secs",), "store", None, "float", None, None),
    (("--kv-attach-retry-secs",), "store", None, "float", None, None),
    (("--kv-tokenizer-cache-size",), "store", None, "int", None, None),
    (("--retry-max-retries",), "store", None, "int", None, None),
    (("--retry-initial-backoff-ms",), "store", None, "float", None, None),
    (("--retry-max-backoff-ms",), "store", None, "float", None, None),
    (("--retry-backoff-multiplier",), "store", None, "float", None, None),
    (("--retry-jitter-factor",), "store", None, "float", None, None),
    (("--disable-retries",), "switch", 0, "str", None, None),
    (("--cb-failure-threshold",), "store", None, "int", None, None),
    (("--cb-success-threshold",), "store", None, "int", None, None),
    (("--cb-timeout-duration-secs",), "store", None, "float", None, None),
    (("--cb-window-duration-secs",), "store", None, "float", None, None),
    (("--disable-circuit-breaker",), "switch", 0, "str", None, None),
    (("--health-check-interval-secs", "--health-check-interval"), "store", None, "float", None, None),
    (("--health-check-timeout-secs",), "store", None, "float", None, None),
    (("--health-failure-threshold",), "store", None, "int", None, None),
    (("--health-success-threshold",), "store", None, "int", None, None),
    (("--health-check-endpoint",), "store", None, "str", None, None),
    (("--connect-timeout-secs", "--connect-timeout"), "store", None, "float", None, None),
    (("--client-max-connections",), "store", None, "int", None, None),
    (("--client-max-connections-per-address",), "store", None, "int", None, None),
    (("--client-header-timeout-secs",), "store", None, "float", None, None),
    (("--client-max-header-bytes",), "store", None, "int", None, None),
    (("--client-max-headers",), "store", None, "int", None, None),
    (("--client-keep-alive-timeout-secs",), "store", None, "float", None, None),
    (("--body-read-timeout-secs",), "store", None, "float", None, None),
    (("--body-read-min-rate",), "store", None, "float", None, None),
    (("--body-read-grace-secs",), "store", None, "float", None, None),
    (("--prefill-timeout-secs",), "store", None, "float", None, None),
    (("--first-token-timeout-secs",), "store", None, "float", None, None),
    (("--stream-idle-timeout-secs",), "store", None, "float", None, None),
    (("--request-timeout-secs", "--request-timeout"), "store", None, "float", None, None),
    (("--max-payload-size",), "store", None, "int", None, None),
    (("--max-n",), "store", None, "int", None, None),
    (("--max-batch-size",), "store", None, "int", None, None),
    (("--max-sequences-per-request",), "store", None, "int", None, None),
    (("--max-total-tokens-per-request",), "store", None, "int", None, None),
    (("--max-concurrent-requests",), "store", None, "int", None, None),
    (("--queue-size",), "store", None, "int", None, None),
    (("--queue-timeout-secs",), "store", None, "float", None, None),
    (("--max-connections",), "store", None, "int", None, None),
    (("--api-key",), "store", None, "str", None, None),
    (("--admin-api-key",), "store", None, "str", None, None),
    (("--worker-api-key",), "store", None, "str", None, None),
    (("--allowed-worker-hosts",), "store", "+", "str", None, None),
    (("--request-id-headers",), "store", "+", "str", None, None),
    (("--log-level",), "store", None, "str", LEVELS, None),
]

# flag -> (the setting it sets, its default, a value to give, what the setting becomes)
SETTINGS = {
    "--host": ("host", "127.0.0.1", ["0.0.0.0"], "0.0.0.0"),
    "--port": ("port", 30000, ["8080"], 8080),
    "--policy": ("policy", "round_robin", ["random"], "random"),
    "--prefill-policy": ("prefill_policy", None, ["cache_aware"], "cache_aware"),
    "--decode-policy": ("decode_policy", None, ["least_load"], "least_load"),
    "--cache-threshold": ("cache_aware.cache_threshold", 0.3, ["0.5"], 0.5),
    "--balance-abs-threshold": ("cache_aware.balance_abs_threshold", 64, ["7"], 7),
    "--balance-rel-threshold": ("cache_aware.balance_rel_threshold", 1.5, ["2.5"], 2.5),
    "--eviction-interval-secs": ("cache_aware.eviction_interval_secs", 120, ["3.5"], 3.5),
    "--max-tree-size": ("cache_aware.max_tree_size", 2**26, ["1000"], 1000),
    "--kv-overlap-weight": ("kv_aware.overlap_weight", 1.0, ["2.5"], 2.5),
    "--kv-stale-secs": ("kv_aware.stale_secs", 30, ["4"], 4),
    "--kv-info-timeout-secs": ("kv_aware.info_timeout_secs", 5, ["1.5"], 1.5),
    "--kv-attach-retry-secs": ("kv_aware.attach_retry_secs", 5, ["0.5"], 0.5),
    "--kv-tokenizer-cache-size": ("kv_aware.tokenizer_cache_size", 1024, ["0"], 0),
    "--retry-max-retries": ("retry.max_retries", 5, ["2"], 2),
    "--retry-initial-backoff-ms": ("retry.initial_backoff_ms", 50, ["7.5"], 7.5),
    "--retry-max-backoff-ms": ("retry.max_backoff_ms", 30000, ["900"], 900),
    "--retry-backoff-multiplier": ("retry.backoff_multiplier", 1.5, ["3"], 3),
    "--retry-jitter-factor": ("retry.jitter_factor", 0.2, ["0"], 0),
    "--disable-retries": ("retry.max_retries", 5, [], 1),
    "--cb-failure-threshold": ("circuit_breaker.failure_threshold", 10, ["4"], 4),
    "--cb-success-threshold": ("circuit_breaker.success_threshold", 3, ["5"], 5),
    "--cb-timeout-duration-secs": ("circuit_breaker.timeout_duration_secs", 60, ["1.5"], 1.5),
    "--cb-window-duration-secs": ("circuit_breaker.window_duration_secs", 120, ["9"], 9),
    "--disable-circuit-breaker": ("circuit_breaker.enabled", True, [], False),
    "--health-check-interval-secs": ("health_check.interval_secs", 10, ["0.5"], 0.5),
    "--health-check-interval": ("health_check.interval_secs", 10, ["0"], 0),
    "--health-check-timeout-secs": ("health_check.timeout_secs", 5, ["2"], 2),
    "--health-failure-threshold": ("health_check.failure_threshold", 3, ["6"], 6),
    "--health-success-threshold": ("health_check.success_threshold", 2, ["8"], 8),
    "--health-check-endpoint": ("health_check.endpoint", "/health", ["/ready"], "/ready"),
    "--connect-timeout-secs": ("timeouts.connect", 10, ["2"], 2),
    "--client-max-connections": ("client.max_connections", 0, ["500"], 500),
    "--client-max-connections-per-address": ("client.max_connections_per_address", 0, ["100"], 100),
    "--client-header-timeout-secs": ("client.header_timeout_secs", 10, ["2.5"], 2.5),
    "--client-max-header-bytes": ("client.max_header_bytes", 65536, ["8192"], 8192),
    "--client-max-headers": ("client.max_headers", 100, ["20"], 20),
    "--client-keep-alive-timeout-secs": ("client.keep_alive_timeout_secs", 5, ["30"], 30),
    "--connect-timeout": ("timeouts.connect", 10, ["3"], 3),
    "--body-read-timeout-secs": ("timeouts.body_read", 30, ["5"], 5),
    "--body-read-min-rate": ("timeouts.body_read_min_rate", 500, ["0"], 0),
    "--body-read-grace-secs": ("timeouts.body_read_grace", 5, ["2.5"], 2.5),
    "--prefill-timeout-secs": ("timeouts.prefill", None, ["40"], 40),
    "--first-token-timeout-secs": ("timeouts.first_token", 300, ["30"], 30),
    "--stream-idle-timeout-secs": ("timeouts.stream_idle", 60, ["20"], 20),
    "--request-timeout-secs": ("timeouts.request", 1800, ["60"], 60),
    "--request-timeout": ("timeouts.request", 1800, ["5"], 5),
    "--max-payload-size": ("max_payload_size", 32 * 1024 * 1024, ["1000"], 1000),
    "--max-n": ("max_n", 16, ["4"], 4),
    "--max-batch-size": ("max_batch_size", 256, ["8"], 8),
    "--max-sequences-per-request": ("max_sequences_per_request", 512, ["16"], 16),
    "--max-total-tokens-per-request": ("max_total_tokens_per_request", 1 << 20, ["4096"], 4096),
    "--max-concurrent-requests": ("max_concurrent_requests", 512, ["-1"], -1),
    "--queue-size": ("queue_size", 1024, ["0"], 0),
    "--queue-timeout-secs": ("queue_timeout_secs", 60, ["2.5"], 2.5),
    "--max-connections": ("max_connections", 1024, ["16"], 16),
    "--api-key": ("api_key", None, ["ck"], "ck"),
    "--admin-api-key": ("admin_api_key", None, ["ak"], "ak"),
    "--worker-api-key": ("worker_api_key", None, ["wk"], "wk"),
    "--allowed-worker-hosts": ("allowed_worker_hosts", (), ["10.0.0.0/24", "gpu-7"], ("10.0.0.0/24", "gpu-7")),
    "--request-id-headers": ("request_id_headers", ("x-request-id",), ["X-Trace-Id", "x-b"], ("x-trace-id", "x-b")),
    "--log-level": ("log_level", "info", ["debug"], "debug"),
}

WORKERS = ["--prefill", "http://a:1", "--decode", "http://d:1"]


def flag_table(parser: argparse.ArgumentParser) -> list[tuple]:
    """Every flag of ``parser`` as a FLAGS row."""
    rows = []
    for a in parser._actions:
        if isinstance(a, argparse._HelpAction):
            continue
        action = "append" if isinstance(a, argparse._AppendAction) else "switch" if a.nargs == 0 else "store"
        rows.append((tuple(a.option_strings), action, a.nargs, getattr(a.type, "__name__", "str"),
                     tuple(a.choices) if a.choices else None, a.metavar))
    return rows


def setting(cfg, path: str):
    """The value at a dotted ``path`` of a router config."""
    return reduce(getattr, path.split("."), cfg)


def test_flags_are_the_committed_sglang_router_compatible_set():
    """Same names, aliases, value forms, types and choices as the committed table (in any order:
    the order of flags on a command line does not matter, only --help lists them differently)."""
    assert sorted(flag_table(build_parser()), key=repr) == sorted(FLAGS, key=repr)


def test_every_value_flag_sets_its_setting_and_defaults_to_the_model(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    monkeypatch.delenv(ADMIN_KEY_ENV, raising=False)
    flags = {o for row in FLAGS for o in row[0]}
    assert set(SETTINGS) == flags - {"--prefill", "--decode", "--pd-disaggregation"}
    defaults = config_from_args(WORKERS)
    for flag, (path, default, values, expected) in SETTINGS.items():
        assert setting(defaults, path) == default, flag
        assert setting(config_from_args(WORKERS + [flag, *values]), path) == expected, flag
    assert config_from_args(WORKERS + ["--pd-disaggregation"]) == defaults


def test_keys_come_from_the_environment_unless_a_flag_gives_them(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "env-ck")
    monkeypatch.setenv(ADMIN_KEY_ENV, "env-ak")
    cfg = config_from_args(WORKERS)
    assert (cfg.api_key, cfg.admin_api_key) == ("env-ck", "env-ak")
    cfg = config_from_args(WORKERS + ["--api-key", "flag-ck"])
    assert (cfg.api_key, cfg.admin_api_key) == ("flag-ck", "env-ak")


@pytest.mark.parametrize("argv", [["--port", "x"], ["--policy", "fastest"], ["--log-level", "loud"],
                                  ["--retry-max-retries", "1.5"], ["--decode-policy", "kv_aware"]])
def test_bad_flag_values_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        config_from_args(WORKERS + argv)
    assert exit_info.value.code == 2 and argv[0] in capsys.readouterr().err


def test_a_new_setting_is_one_field_of_the_model(capsys):
    """Adding a setting means adding its field (type, default, docstring) to the model: its flag,
    help, default and error naming follow, and it travels in the launcher's JSON."""
    from pydantic import Field

    from pd.router.config import CONFIG_ENV, RouterConfig, TimeoutConfig

    class MoreTimeouts(TimeoutConfig):
        foo: float = Field(3, gt=0)
        """dispatch -> foo done."""

    class MoreConfig(RouterConfig):
        timeouts: MoreTimeouts = Field(default_factory=MoreTimeouts)

    parser = build_parser(MoreConfig)
    (action,) = [a for a in parser._actions if "--foo-timeout-secs" in a.option_strings]
    assert action.type is float and action.help == "dispatch -> foo done (default 3)"
    assert config_from_args(WORKERS, {}, MoreConfig).timeouts.foo == 3
    assert config_from_args(WORKERS + ["--foo-timeout-secs", "7.5"], {}, MoreConfig).timeouts.foo == 7.5
    from_json = MoreConfig.from_urls(["http://a:1"], ["http://d:1"], timeouts={"foo": 9})
    assert config_from_args([], {CONFIG_ENV: from_json.model_dump_json()}, MoreConfig).timeouts.foo == 9
    with pytest.raises(SystemExit):
        config_from_args(WORKERS + ["--foo-timeout-secs", "0"], {}, MoreConfig)
    assert "--foo-timeout-secs: Input should be greater than 0, got 0.0" in capsys.readouterr().err
    # the committed router's flags are untouched by the subclass
    assert "--foo-timeout-secs" not in {o for row in flag_table(build_parser()) for o in row[0]}


def test_settings_json_then_key_variables_then_flags(monkeypatch, capsys):
    """$PDSERVE_ROUTER_CONFIG sets what no flag sets; key variables beat its keys; flags beat both;
    --prefill / --decode replace its workers."""
    from pd.router.config import CONFIG_ENV, RouterConfig

    cfg = RouterConfig.from_urls([("http://a:1", 9000)], ["http://d:1"], port=8123, api_key="json-ck",
                                 retry={"max_retries": 2, "jitter_factor": 0.5}, timeouts={"first_token": 30})
    env = {CONFIG_ENV: cfg.model_dump_json()}
    assert config_from_args([], env) == cfg
    got = config_from_args(["--retry-max-retries", "4", "--decode", "http://e:2"], {**env, API_KEY_ENV: "env-ck"})
    assert got.retry.max_retries == 4 and got.retry.jitter_factor == 0.5 and got.timeouts.first_token == 30
    assert got.decode == ["http://e:2"] and [p.url for p in got.prefill] == ["http://a:1"]
    assert got.api_key == "env-ck" and got.port == 8123
    assert config_from_args(["--api-key", "flag-ck"], {**env, API_KEY_ENV: "env-ck"}).api_key == "flag-ck"
    for bad, says in (("{", f"${CONFIG_ENV} is not valid JSON"), ("[1]", "must be a JSON object"),
                      ('{"retry": {"max_retries": 0}, "prefill": [{"url": "http://a:1"}], "decode": ["http://d:1"]}',
                       f"retry.max_retries in ${CONFIG_ENV}: Input should be greater than or equal to 1")):
        with pytest.raises(SystemExit):
            config_from_args([], {CONFIG_ENV: bad})
        assert says in capsys.readouterr().err, bad
