"""Hostile clients against a router and a reference PD pair while good traffic flows: every class of attack
the project defends against, one after another, with a client on another address sending greedy requests the
whole time. The good requests must all succeed with the output they had before any attack, and afterwards
nothing is held (KV pages, in-flight requests). Each class has its own detailed tests (test_connection_limits,
test_bootstrap_hostile, test_ignored_fields, test_router_ids, test_router_redirects); this one shows they hold
together, under load, on the real engines.
"""

from __future__ import annotations

import contextlib
import json
import threading

import httpx
import pytest

from engines import metric
from pd.util.wait import wait_until
from routers import pd_router
from test_connection_limits import closed_by_peer, connect

pytestmark = pytest.mark.slow  # ~30 s: a router over the session's engines and six attacks
GOOD = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}


@pytest.fixture(scope="module")
def router(engines, tmp_path_factory):
    p, d = engines["prefill"], engines["decode"]
    r = pd_router(p.url, p.bootstrap_port, d.url, str(tmp_path_factory.mktemp("hostile-router")),
                  "--client-max-connections", "200", "--client-max-connections-per-address", "60",
                  "--client-header-timeout-secs", "2", "--client-max-header-bytes", "16384")
    try:
        r.wait_ready()
        yield r
    finally:
        r.stop()


class GoodTraffic:
    """Greedy /generate requests in a loop from 127.0.0.1 until stopped; every answer is recorded."""

    def __init__(self, url: str, expected: str):
        self.url, self.expected = url, expected
        self.answers: list[tuple[int, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=60) as c:
            while not self._stop.is_set():
                r = c.post(self.url + "/generate", json=GOOD)
                self.answers.append((r.status_code, r.json().get("text") if r.status_code == 200 else r.text))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=120)
        assert not self._thread.is_alive(), "a good request hung"

    def served_since(self, n: int) -> bool:
        return len(self.answers) >= n


def test_good_traffic_survives_every_attack(engines, router):
    expected = httpx.post(router.url + "/generate", json=GOOD, timeout=60).json()["text"]
    held = []
    with GoodTraffic(router.url, expected) as good:
        wait_until(lambda: good.served_since(3), 60, what="good traffic flowing")
        # 1. an idle-connection flood from one address: 60 held, the rest reset
        flood = [connect(router, "127.0.0.2") for _ in range(150)]
        held += flood
        n = len(good.answers)
        wait_until(lambda: good.served_since(n + 5), 60, what="good requests during the flood")
        # 2. slow headers and 3. huge headers, from another address: cut off
        slow = connect(router, "127.0.0.3")
        slow.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n")
        big = connect(router, "127.0.0.3")
        with contextlib.suppress(OSError):  # a request line, then 2 MB of header lines: cut off at 16 KiB
            big.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n")
            for _ in range(2048):
                big.sendall(b"X-Pad: " + b"p" * 1015 + b"\r\n")
        closed_by_peer(big, 10)  # its 431 may be lost to the reset the sends after it cause: counted below
        assert closed_by_peer(slow, 10).startswith(b"HTTP/1.1 408 ")
        # 4. hostile bootstrap registrations straight to the prefill's bootstrap port
        boot = f"http://127.0.0.1:{engines['prefill'].bootstrap_port}/pd/register"
        hostile = ({"room": [1, 2]}, {"room": "7"}, {"room": 2**200}, {"room": 5, "page_addrs": list(range(3_000_000))})
        for body in hostile:
            r = httpx.post(boot, content=json.dumps(body), timeout=30)
            assert r.status_code in (400, 413) and "Traceback" not in r.text, (body.keys(), r.status_code)
        # 5. fields the engine would ignore, and 6. routes spelled with an encoded slash
        r = httpx.post(router.url + "/v1/chat/completions", timeout=30, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
        assert httpx.post(router.url + "/v1%2fcompletions", json={"prompt": "a"}, timeout=30).status_code == 404
        n = len(good.answers)
        wait_until(lambda: good.served_since(n + 5), 60, what="good requests after the attacks")
    for s in held:
        s.close()
    bad = [a for a in good.answers if a != (200, expected)]
    assert not bad and len(good.answers) >= 13, bad[:3]
    for side in ("prefill", "decode"):
        wait_until(lambda: metric(engines[side], "pdserve_kv_pages_held") == 0, 30, what=f"{side} pages released")
    refused = httpx.get(router.url + "/metrics", timeout=10).text
    for reason in ("per_address", "header_timeout", "header_too_large"):
        line = next(x for x in refused.splitlines()
                    if x.startswith(f'pdserve_router_client_connections_refused_total{{reason="{reason}"}}'))
        assert float(line.split()[-1]) >= 1, line
