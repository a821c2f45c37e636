"""No secret leaves: pd.util.redact on the pinned SGLang's real log lines and ``/server_info`` answers, and the
router's info routes in front of an engine answering SGLang's real ``/server_info`` (key in clear)."""

from __future__ import annotations

import http.server
import json
import os
import threading

import httpx
import pytest

from pd.util.redact import REDACTED, redact_text, scrub, secret_name
from routers import RouterProc

WORKER_KEY = "cluster-KEY-4b1d9e"  # the engine's --api-key (pdserve: through its --config file)
ENGINE_ADMIN_KEY = "engine-admin-KEY-88c2"  # the engine's --admin-api-key (on its argv, as an operator might)
ADMIN_KEY = "router-admin-KEY-51aa"
KEYS = (WORKER_KEY, ENGINE_ADMIN_KEY)


@pytest.fixture(scope="module")
def server_args(tmp_path_factory):
    """The pinned SGLang's ``ServerArgs`` of a pdserve decode worker: parsed by SGLang's ``prepare_server_args``
    from the argv pdserve builds (the key in the owner-only ``--config`` file), plus ``--admin-api-key``."""
    pytest.importorskip("sglang.srt.server_args")
    from sglang.srt.server_args import prepare_server_args

    from pd.commands.sglang import sglang_command
    from pd.config import parse_config

    cfg = parse_config({"engine": "sglang", "model_path": "/models/none", "page_size": 64,
                        "sglang": {"quantization": "fp8"},
                        "decode": {"extra_args": ["--admin-api-key", ENGINE_ADMIN_KEY]}})
    key_dir = str(tmp_path_factory.mktemp("keys"))
    cmd = sglang_command(cfg, "decode", "127.0.0.1", 30000, None, WORKER_KEY, key_dir)
    for path, text in cmd.files.items():
        with open(path, "w") as f:
            f.write(text)
    assert WORKER_KEY not in " ".join(cmd.argv)
    sa = prepare_server_args(cmd.argv[cmd.args_start:])
    assert sa.api_key == WORKER_KEY and sa.admin_api_key == ENGINE_ADMIN_KEY
    return sa


@pytest.fixture(scope="module")
def server_info(server_args) -> dict:
    """What the pinned SGLang's ``GET /server_info`` answers (sglang/srt/entrypoints/http_server.py
    ``server_info``), scheduler and internal state made up."""
    from sglang.srt.sampling.watermarking.core import redact_watermark_secrets
    from sglang.srt.utils import msgspec_to_builtins
    from sglang.srt.utils.common import build_server_info

    info = msgspec_to_builtins(redact_watermark_secrets({
        **build_server_info(server_args, {"max_total_num_tokens": 81920, "max_req_input_len": 8191}),
        "startup_time": 1765000000.0, "internal_states": [{"last_gen_throughput": 0.0}],
        "version": "0.5.23", "frontend": "python"}))
    info = json.loads(json.dumps(info))
    assert info["api_key"] == WORKER_KEY and f"--api-key {WORKER_KEY}" in info["launch_command"]
    return info


def without(text: str, *keys: str) -> str:
    """``text`` with each key's repr replaced by ``'<redacted>'``: what redaction may change, and nothing else."""
    for k in keys:
        text = text.replace(repr(k), repr(REDACTED))
    return text


# ---- log lines ---------------------------------------------------------------------------------------------
def test_sglang_server_args_log_line_loses_its_keys_and_nothing_else(server_args):
    from sglang.srt.sampling.watermarking.core import redact_watermark_secrets

    # sglang/srt/entrypoints/engine.py: logger.info(f"server_args={_server_args_for_logging(server_args)}")
    line = f"[2026-12-06 05:00:00] server_args={redact_watermark_secrets(server_args.resolved_dict())}"
    assert WORKER_KEY in line and ENGINE_ADMIN_KEY in line
    out = redact_text(line)  # by the rules alone, no literal key given
    assert out == without(line, *KEYS)
    assert f"'api_key': '{REDACTED}'" in out and f"'admin_api_key': '{REDACTED}'" in out
    assert "'ssl_keyfile_password': None" in out and "'max_total_tokens': None" in out


def test_server_args_repr_and_launch_command_lose_their_keys(server_args):
    line = f"server_args={server_args!r}"  # the ServerArgs(...) form
    assert WORKER_KEY in line
    out = redact_text(line)
    assert out == without(line, *KEYS) and f"api_key='{REDACTED}'" in out
    cmdline = server_args.launch_command  # the config-merged argv: --api-key KEY first
    out = redact_text(f"launch_command={cmdline!r}")
    assert not any(k in out for k in KEYS)
    assert f"--api-key {REDACTED} " in out and f"--admin-api-key {REDACTED}" in out and "--model-path" in out


@pytest.mark.parametrize("line, expected", [
    ("cmd: python -m sglang.launch_server --api-key s3cr3t --port 1",
     f"cmd: python -m sglang.launch_server --api-key {REDACTED} --port 1"),
    ("--admin-api-key=s3cr3t --port=1", f"--admin-api-key={REDACTED} --port=1"),
    ("argv=['python', '--api-key', 's3cr3t', '--port', '1']",
     f"argv=['python', '--api-key', '{REDACTED}', '--port', '1']"),
    ('{"launch_command": ["--api-key", "s3cr3t"], "api_key": "s3cr3t", "hf_token": "hf_x", "port": 1}',
     f'{{"launch_command": ["--api-key", "{REDACTED}"], "api_key": "{REDACTED}", "hf_token": "{REDACTED}", '
     '"port": 1}'),
    ("ServerArgs(api_key=\"it's\", admin_api_key=None, db_password='p')",
     f"ServerArgs(api_key=\"{REDACTED}\", admin_api_key=None, db_password='{REDACTED}')"),
    ("HF_TOKEN=hf_abc SOME_SECRET=x", f"HF_TOKEN={REDACTED} SOME_SECRET={REDACTED}"),
    ("headers={'Authorization': 'Bearer s3cr3t'}", f"headers={{'Authorization': 'Bearer {REDACTED}'}}"),
])
def test_key_fields_flags_and_bearer_tokens_are_redacted(line, expected):
    assert redact_text(line) == expected


@pytest.mark.parametrize("line", [
    "[2026-12-06 05:00:01 TP0] Decode batch, #running-req: 3, #token: 4096, token usage: 0.05, "
    "gen throughput (token/s): 812.44, #queue-req: 0",
    "[2026-12-06 05:00:01 TP0] Prefill batch, #new-seq: 1, #new-token: 64, #cached-token: 0, input throughput",
    "server_args={'max_total_tokens': 81920, 'bucket_time_to_first_token': [0.1, 0.5], 'speculative_token_map': None}",
    "python -m sglang.launch_server --bucket-time-to-first-token 0.1 --max-total-tokens 8192",
    "The server is fired up and ready to roll!",
])
def test_ordinary_log_lines_are_untouched(line):
    assert redact_text(line) == line


def test_the_key_itself_goes_wherever_it_appears():
    key = "k'ey\"9"
    line = f"Unauthorized: got {key} and {key!r} and {json.dumps(key)}"
    out = redact_text(line, [key, None, ""])
    assert "k'ey" not in out and "ey\\\"9" not in out and out.count(REDACTED) == 3


# ---- JSON answers ------------------------------------------------------------------------------------------
def test_server_info_is_scrubbed_field_by_field(server_info):
    out = scrub(server_info)
    text = json.dumps(out)
    assert not any(k in text for k in KEYS)
    assert out["api_key"] == REDACTED and out["admin_api_key"] == REDACTED
    assert "--api-key" in out["launch_command"] and "--model-path /models/none" in out["launch_command"]
    changed = {k for k in server_info if out[k] != server_info[k]}
    assert changed == {"api_key", "admin_api_key", "launch_command"}


def test_scrub_handles_argv_lists_nested_fields_and_literal_keys():
    data = {"launch_command": ["python", "--api-key", "a1", "--admin-api-key=a2", "--port", "1"],
            "nested": [{"client_secret": "a3", "num_token": 5, "note": "key a4 here"}],
            "max_total_tokens": 9, "password": None}
    out = scrub(data, ["a4"])
    assert out == {"launch_command": ["python", "--api-key", REDACTED, f"--admin-api-key={REDACTED}", "--port", "1"],
                   "nested": [{"client_secret": REDACTED, "num_token": 5, "note": f"key {REDACTED} here"}],
                   "max_total_tokens": 9, "password": None}


def test_secret_names():
    assert all(map(secret_name, ["api_key", "admin_api_key", "apiKey", "hf_token", "client_secret",
                                 "ssl_keyfile_password", "--api-key"]))
    assert not any(map(secret_name, ["max_total_tokens", "api_key_file", "tokenizer_path", "secrets_dir"]))


# ---- the router --------------------------------------------------------------------------------------------
class _Engine(http.server.BaseHTTPRequestHandler):
    """SGLang's info routes, with the key required as SGLang does; only their current names (SGLang 0.5.23
    deprecates ``/get_server_info`` and ``/get_model_info``): the router must ask by those."""

    info: dict = {}

    def do_GET(self):
        if self.headers.get("Authorization") != f"Bearer {WORKER_KEY}" and self.path != "/health":
            return self._send(401, {"error": "Unauthorized"})
        if self.path == "/server_info":
            return self._send(200, self.info)
        if self.path == "/model_info":
            return self._send(200, {"model_path": self.info["model_path"], "is_generation": True,
                                    "has_image_understanding": False, "weight_version": "default"})
        if self.path == "/v1/models":
            return self._send(200, {"object": "list", "data": [{"id": self.info["model_path"], "object": "model"}]})
        self._send(404, {"error": "not found"})

    def _send(self, status: int, body: dict):
        raw = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def router(server_info, tmp_path_factory):
    """A router with an admin key but no client key (its client routes open) over one engine answering SGLang's
    ``/server_info`` with the worker key in it."""
    handler = type("Engine", (_Engine,), {"info": server_info})
    engines = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) for _ in ("prefill", "decode")]
    for e in engines:
        threading.Thread(target=e.serve_forever, daemon=True).start()
    prefill, decode = (f"http://127.0.0.1:{e.server_address[1]}" for e in engines)
    r = RouterProc(["--prefill", prefill, "1", "--decode", decode, "--admin-api-key", ADMIN_KEY,
                    "--worker-api-key", WORKER_KEY, "--health-check-interval-secs", "0"],
                   str(tmp_path_factory.mktemp("redact-router")))
    try:
        r.wait_ready()
        yield r
    finally:
        r.stop()
        for e in engines:
            e.shutdown()
            e.server_close()


@pytest.mark.parametrize("path", ["/server_info", "/get_server_info"])
def test_router_server_info_needs_the_admin_key_and_has_no_secret(router, server_info, path):
    r = httpx.get(router.url + path, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30)
    assert r.status_code == 200, r.text
    leaked = [k for k in (*KEYS, ADMIN_KEY) if k in r.text]
    assert not leaked, f"{path} answers keys {leaked}"
    body = r.json()
    assert body["api_key"] == REDACTED and body["admin_api_key"] == REDACTED
    assert body["launch_command"] == server_info["launch_command"].replace(WORKER_KEY, REDACTED) \
        .replace(ENGINE_ADMIN_KEY, REDACTED)
    assert {k for k in body if body[k] != server_info[k]} == {"api_key", "admin_api_key", "launch_command"}
    for headers in ({}, {"Authorization": f"Bearer {WORKER_KEY}"}, {"Authorization": "Bearer wrong"}):
        r = httpx.get(router.url + path, headers=headers, timeout=30)
        assert r.status_code == 401, r.text
        assert not any(k in r.text for k in KEYS)


@pytest.mark.parametrize("path", ["/v1/models", "/get_model_info", "/model_info"])
def test_router_model_routes_stay_public(router, server_info, path):
    r = httpx.get(router.url + path, timeout=30)
    assert r.status_code == 200, r.text
    assert server_info["model_path"] in r.text and not any(k in r.text for k in KEYS)


def test_router_log_has_no_key(router):
    httpx.get(router.url + "/server_info", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30)
    assert os.path.exists(router.log_path)
    assert not any(k in router.log() for k in (*KEYS, ADMIN_KEY))
