"""The router follows no redirect from a worker: a worker answering 3xx (on the info routes, /v1/models,
/flush_cache, health checks or a generation route) is an upstream error naming it, and the host the redirect
points at is never contacted."""

from __future__ import annotations

import http.server
import threading

import httpx
import pytest

from pd.util.wait import wait_until
from routers import RouterProc

ADMIN_KEY = "router-admin-KEY-7e21"


class _Trap(http.server.BaseHTTPRequestHandler):
    """Where the worker's redirects point: records every request that reaches it."""

    hits: list = []

    def do_GET(self):
        self.hits.append(self.path)
        self._ok()

    do_POST = do_GET

    def _ok(self):
        raw = b'{"secret": "trap"}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args):
        pass


class _Redirecting(http.server.BaseHTTPRequestHandler):
    """A worker that answers 307 to the trap for everything but ``/health`` (200 until told otherwise)."""

    trap = ""
    health_redirects = False

    def do_GET(self):
        if self.path == "/health" and not self.health_redirects:
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        n = int(self.headers.get("Content-Length") or 0)
        if n:
            self.rfile.read(n)
        self.send_response(307)
        self.send_header("Location", self.trap + self.path)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_POST = do_GET

    def log_message(self, *args):
        pass


def _serve(handler) -> http.server.ThreadingHTTPServer:
    s = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=s.serve_forever, daemon=True).start()
    return s


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    trap = _serve(type("Trap", (_Trap,), {"hits": []}))
    trap_url = f"http://127.0.0.1:{trap.server_address[1]}"
    handler = type("Worker", (_Redirecting,), {"trap": trap_url, "health_redirects": False})
    workers = [_serve(handler) for _ in range(2)]
    prefill, decode = (f"http://127.0.0.1:{w.server_address[1]}" for w in workers)
    r = RouterProc(["--prefill", prefill, "1", "--decode", decode, "--admin-api-key", ADMIN_KEY,
                    "--health-check-interval-secs", "0.2", "--health-failure-threshold", "1",
                    "--retry-max-retries", "2"], str(tmp_path_factory.mktemp("redirect-router")))
    try:
        r.wait_ready()
        yield r, handler, trap.RequestHandlerClass.hits, decode
    finally:
        r.stop()
        for s in (*workers, trap):
            s.shutdown()
            s.server_close()


ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.mark.parametrize("method,path,headers", [
    ("GET", "/server_info", ADMIN), ("GET", "/get_server_info", ADMIN), ("GET", "/model_info", {}),
    ("GET", "/v1/models", {}), ("POST", "/flush_cache", {}),
])
def test_a_worker_redirect_is_an_error_naming_it(setup, method, path, headers):
    router, _, hits, decode = setup
    r = httpx.request(method, router.url + path, headers=headers, timeout=30)
    assert r.status_code == 502, r.text
    assert "redirect" in r.text and "trap" not in r.text
    if path != "/flush_cache":
        assert decode in r.json()["error"]["message"]
    assert not hits


@pytest.mark.parametrize("path,body", [("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}}),
                                       ("/v1/completions", {"prompt": "hi", "max_tokens": 2})])
def test_a_generation_redirect_is_an_error_naming_the_worker(setup, path, body):
    router, _, hits, _ = setup
    r = httpx.post(router.url + path, json=body, timeout=60)
    assert r.status_code == 502, r.text
    assert "redirect" in r.json()["error"]["message"] and "worker http://127.0.0.1:" in r.json()["error"]["message"]
    assert "location" not in r.headers and not hits


def test_a_redirecting_health_check_takes_the_worker_out(setup):
    router, handler, hits, _ = setup

    def healthy() -> list:
        workers = httpx.get(router.url + "/workers", headers=ADMIN, timeout=10).json()["workers"]
        return [w["is_healthy"] for w in workers]

    wait_until(lambda: all(healthy()), 30, what="both workers healthy")
    handler.health_redirects = True
    try:
        wait_until(lambda: not any(healthy()), 30, what="both workers out after redirecting health checks")
    finally:
        handler.health_redirects = False
    assert not hits
