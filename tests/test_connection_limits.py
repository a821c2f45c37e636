"""Connection-level limits of the router (pd.util.connection_guard), driven with raw sockets from several
loopback source addresses (127.0.0.0/8 is all loopback on Linux): one address flooding idle connections
leaves the others served; a header block that trickles, never comes, grows too large or has too many fields
is cut off with 408/431; an idle keep-alive connection is closed. Good traffic runs through a stand-in pair.
"""

from __future__ import annotations

import contextlib
import re
import select
import socket
import time

import httpx
import pytest

from pd.util.wait import wait_until
from routers import pd_router
from test_router_faults import running_standins

BODY = {"text": "hello", "sampling_params": {"max_new_tokens": 2}}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    logs = str(tmp_path_factory.mktemp("conn-logs"))
    with running_standins(logs, "p0", "d0") as si:
        yield si, logs


@contextlib.contextmanager
def router_with(pair, *flags: str):
    si, logs = pair
    r = pd_router(si["p0"].url, si["p0"].bootstrap_port, si["d0"].url, logs, *flags)
    try:
        r.wait_ready()
        yield r
    finally:
        r.stop()


def metric(router, name: str, **labels) -> float:
    text = httpx.get(router.url + "/metrics", timeout=10).text
    sel = ",".join(f'{k}="{v}"' for k, v in labels.items())
    m = re.search(rf"^{re.escape(name)}{re.escape('{' + sel + '}') if sel else ''} (\S+)$", text, re.M)
    assert m, f"{name}{{{sel}}} not in /metrics"
    return float(m.group(1))


def connect(router, source: str) -> socket.socket:
    s = socket.socket()
    s.bind((source, 0))
    s.settimeout(10)
    s.connect(("127.0.0.1", router.port))
    return s


def closed_by_peer(s: socket.socket, within: float) -> bytes:
    """What the router sent before it closed ``s`` (b"" for a reset), waiting up to ``within`` seconds."""
    data = b""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        ready, _, _ = select.select([s], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            continue
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk
    raise AssertionError(f"the router kept the connection open for {within}s (sent {data[:80]!r})")


def good_requests(router, n: int) -> list[int]:
    with httpx.Client(timeout=30) as c:  # from 127.0.0.1
        return [c.post(router.url + "/generate", json=BODY).status_code for _ in range(n)] + \
            [c.get(router.url + "/health").status_code]


def test_a_flood_from_one_address_leaves_the_others_served(pair):
    with router_with(pair, "--client-max-connections", "80", "--client-max-connections-per-address", "50",
                     "--client-header-timeout-secs", "120") as router:
        flood = []
        try:
            for _ in range(120):  # idle connections from 127.0.0.2: 50 held, the rest reset at once
                flood.append(connect(router, "127.0.0.2"))
            wait_until(lambda: metric(router, "pdserve_router_client_connections_refused_total",
                                      reason="per_address") >= 70, 30, what="70 flood connections refused")
            assert set(good_requests(router, 10)) == {200}
            # another address takes the rest of the total; past it, everyone is refused until some close
            wait_until(lambda: metric(router, "pdserve_router_client_connections") == 51, 30,
                       what="the flood's 50 and this query open")
            more = [connect(router, "127.0.0.3") for _ in range(30)]
            late = connect(router, "127.0.0.4")  # the 81st: reset at once
            assert closed_by_peer(late, 10) == b""
            for s in more:
                s.close()
            wait_until(lambda: metric(router, "pdserve_router_client_connections_refused_total", reason="total")
                       >= 1, 30, what="the 81st connection counted as refused (total)")
            assert set(good_requests(router, 3)) == {200}
        finally:
            for s in flood:
                s.close()


@pytest.fixture(scope="module")
def strict(pair):
    with router_with(pair, "--client-header-timeout-secs", "1.5", "--client-max-header-bytes", "16384",
                     "--client-max-headers", "50", "--client-keep-alive-timeout-secs", "1") as router:
        yield router


def test_a_connection_that_sends_nothing_is_closed_with_408(strict):
    s = connect(strict, "127.0.0.5")
    t0 = time.monotonic()
    answer = closed_by_peer(s, 10)
    assert answer.startswith(b"HTTP/1.1 408 ") and b"did not arrive within 1.5s" in answer
    assert 1.0 < time.monotonic() - t0 < 6


def test_headers_trickled_a_line_at_a_time_are_cut_off(strict):
    s = connect(strict, "127.0.0.5")
    s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n")
    t0 = time.monotonic()
    for i in range(40):  # one line every 0.25 s: 10 s in all, far past the 1.5 s allowed
        ready, _, _ = select.select([s], [], [], 0.25)
        if ready:
            break
        with contextlib.suppress(OSError):
            s.sendall(b"X-Slow-%d: y\r\n" % i)
    assert closed_by_peer(s, 10).startswith(b"HTTP/1.1 408 ")
    assert time.monotonic() - t0 < 6
    assert metric(strict, "pdserve_router_client_connections_refused_total", reason="header_timeout") >= 1


def test_a_header_block_over_the_limit_is_431(strict):
    s = connect(strict, "127.0.0.5")
    s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n" + b"X-Big: " + b"a" * 17000 + b"\r\n")
    answer = closed_by_peer(s, 10)
    assert answer.startswith(b"HTTP/1.1 431 ") and b"over 16384 bytes" in answer
    # 11 MB of headers: cut off long before the end, never buffered whole
    s = connect(strict, "127.0.0.5")
    sent = 0
    with pytest.raises(OSError):
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n")
        for _ in range(11 * 1024):
            s.sendall(b"X-Pad: " + b"b" * 1015 + b"\r\n")
            sent += 1024
    assert sent < 11 * 1024 * 1024
    assert metric(strict, "pdserve_router_client_connections_refused_total", reason="header_too_large") >= 2


def test_too_many_header_fields_is_431(strict):
    s = connect(strict, "127.0.0.5")
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-F%d: 1\r\n" % i for i in range(60)) + b"\r\n")
    answer = closed_by_peer(s, 10)
    assert answer.startswith(b"HTTP/1.1 431 ") and b"more than 50 header fields" in answer


def test_an_idle_keep_alive_connection_is_closed(strict):
    s = connect(strict, "127.0.0.5")
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    answer = closed_by_peer(s, 10)  # answered, then closed after the 1 s keep-alive timeout
    assert answer.startswith(b"HTTP/1.1 200 ")


def test_limits_leave_normal_requests_alone(strict):
    with httpx.Client(timeout=30) as c:  # one keep-alive connection, many requests, a few headers each
        for _ in range(5):
            assert c.post(strict.url + "/generate", json=BODY, headers={"X-Request-Id": "ok-1"}).status_code == 200
    assert metric(strict, "pdserve_router_client_connections") >= 0


def test_the_guarded_protocol_follows_uvicorns_own_data_received():
    """GuardedHttpToolsProtocol.data_received repeats uvicorn's (with the limits' refusals in it): a uvicorn
    whose method changed must be read again before the lock moves to it."""
    import inspect
    import textwrap

    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    theirs = textwrap.dedent(inspect.getsource(HttpToolsProtocol.data_received))
    assert theirs == textwrap.dedent('''\
        def data_received(self, data: bytes) -> None:
            self._unset_keepalive_if_required()

            try:
                self.parser.feed_data(data)
            except httptools.HttpParserError:
                msg = "Invalid HTTP request received."
                self.logger.warning(msg)
                self.send_400_response(msg)
                return
            except httptools.HttpParserUpgrade:
                if self._should_upgrade():
                    self.handle_websocket_upgrade()
                else:
                    self._unsupported_upgrade_warning()
        ''')


@pytest.mark.parametrize("path", ["/v1%2fcompletions", "/v1%2Fchat%2fcompletions", "/%2e%2e%2fgenerate",
                                  "/v1%5ccompletions"])
def test_a_percent_encoded_separator_is_no_route(strict, path):
    r = httpx.post(strict.url + path, json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 404 and "no route" in r.json()["error"]["message"]


def test_a_client_request_id_is_echoed_only_when_short_and_visible(strict):
    ok = "req-" + "a" * 124
    for sent, echoed in ((ok, True), ("x" * 8000, False), ("a\tb", False), ("\xe9", False)):
        r = httpx.post(strict.url + "/generate", json=BODY, headers={"X-Request-Id": sent.encode("latin-1")},
                       timeout=30)
        assert r.status_code == 200, r.text
        got = r.headers["x-request-id"]
        assert (got == sent) is echoed and (echoed or re.fullmatch(r"pdr-[0-9a-f]{32}", got)), got
