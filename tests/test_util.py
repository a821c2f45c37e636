"""pd.util: waiting with a deadline and free ports."""

from __future__ import annotations

import asyncio
import os
import socket
import time

import pytest

from pd.util.ports import free_port, free_ports, port_holder
from pd.util.wait import async_wait_until, wait_until
from tcp_states import server_side_time_wait


class Countdown:
    """A predicate that is falsy ``n`` times, then returns ``"ready"``; ``error`` raised instead of falsy."""

    def __init__(self, n: int, error: Exception | None = None):
        self.n, self.error, self.calls = n, error, 0

    def __call__(self):
        self.calls += 1
        if self.calls <= self.n:
            if self.error is not None:
                raise self.error
            return 0
        return "ready"


# ---- wait_until -----------------------------------------------------------------------------------
def test_wait_until_returns_the_first_truthy_value_promptly():
    p = Countdown(3)
    t0 = time.monotonic()
    assert wait_until(p, timeout=60, interval=0.01, what="countdown") == "ready"
    assert p.calls == 4
    assert time.monotonic() - t0 < 30  # far from the 60 s deadline: it returned when the value came


def test_wait_until_true_at_once_does_not_sleep(monkeypatch):
    monkeypatch.setattr(time, "sleep", lambda s: pytest.fail("slept"))
    assert wait_until(lambda: [1], timeout=5) == [1]


def test_wait_until_never_true_raises_timeout_naming_what_and_the_last_value():
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"the thing not reached within 0.3 s .*last value: 0\)") as e:
        wait_until(lambda: 0, timeout=0.3, interval=0.05, what="the thing")
    assert time.monotonic() - t0 >= 0.3  # the deadline, not an early give-up
    assert e.value.__cause__ is None


def test_wait_until_retries_exceptions_and_reports_the_last_one():
    p = Countdown(10**9, error=ConnectionRefusedError("nobody home"))
    with pytest.raises(TimeoutError, match=r"nobody home") as e:
        wait_until(p, timeout=0.3, interval=0.05, what="server")
    assert p.calls >= 2 and isinstance(e.value.__cause__, ConnectionRefusedError)

    p = Countdown(2, error=ConnectionRefusedError("starting"))
    assert wait_until(p, timeout=60, interval=0.01) == "ready" and p.calls == 3


def test_wait_until_propagates_exceptions_it_is_not_told_to_retry():
    def exited():
        raise RuntimeError("the process exited")

    calls = []
    with pytest.raises(RuntimeError, match="exited"):
        wait_until(lambda: calls.append(1) or exited(), timeout=60, retry=(OSError,))
    assert calls == [1]


def test_wait_until_nonpositive_timeout_calls_once():
    p = Countdown(1)
    with pytest.raises(TimeoutError):
        wait_until(p, timeout=-1)
    assert p.calls == 1


def test_wait_until_needs_a_finite_deadline():
    with pytest.raises(ValueError, match="finite"):
        wait_until(lambda: True, timeout=float("inf"))
    with pytest.raises(ValueError, match="interval"):
        wait_until(lambda: True, timeout=1, interval=0)


# ---- async_wait_until -----------------------------------------------------------------------------
async def test_async_wait_until_with_sync_and_async_predicates():
    p = Countdown(2)
    assert await async_wait_until(p, timeout=60, interval=0.01) == "ready" and p.calls == 3

    q = Countdown(2, error=OSError("refused"))

    async def probe():
        await asyncio.sleep(0)
        return q()

    assert await async_wait_until(probe, timeout=60, interval=0.01) == "ready" and q.calls == 3


async def test_async_wait_until_timeout_reports_the_last_error():
    async def probe():
        raise ConnectionError("still down")

    with pytest.raises(TimeoutError, match=r"engine up not reached within 0.2 s .*still down"):
        await async_wait_until(probe, timeout=0.2, interval=0.05, what="engine up")


async def test_async_wait_until_cancels_a_hanging_attempt_at_the_deadline():
    cancelled = asyncio.Event()

    async def hang():
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="hung probe"):
        await async_wait_until(hang, timeout=0.2, interval=0.05, what="hung probe")
    assert cancelled.is_set() and time.monotonic() - t0 < 60  # not the predicate's hour


async def test_async_wait_until_passes_a_predicates_own_timeout_error_to_retry():
    q = Countdown(1, error=TimeoutError("one slow probe"))
    assert await async_wait_until(q, timeout=60, interval=0.01) == "ready" and q.calls == 2


# ---- ports ----------------------------------------------------------------------------------------
def test_free_port_is_bindable():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()


def fake_socket(ports):
    """A socket.socket stand-in whose bind(port 0) gets the next of ``ports``."""
    given = iter(ports)

    class FakeSocket:
        def __init__(self, *a):
            self.port = next(given)

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def bind(self, addr):
            pass

        def getsockname(self):
            return ("127.0.0.1", self.port)

    return FakeSocket


def test_free_port_skips_excluded_ports(monkeypatch):
    monkeypatch.setattr(socket, "socket", fake_socket([5000, 5001, 5000, 5002]))
    assert free_port(exclude={5000}) == 5001
    assert free_port(exclude=[5000, 5001]) == 5002


def test_free_port_gives_up_when_every_port_is_excluded(monkeypatch):
    from pd.util import ports

    monkeypatch.setattr(ports, "MAX_TRIES", 3)
    monkeypatch.setattr(socket, "socket", fake_socket([5000] * 4))
    with pytest.raises(OSError, match="no free port"):
        free_port(exclude={5000})


def test_free_ports_are_distinct_bindable_and_outside_exclude():
    first = free_port()
    ports = free_ports(5, exclude=[first])
    assert len(set(ports)) == 5 and first not in ports
    socks = []
    try:
        for p in ports:
            s = socket.socket()
            s.bind(("127.0.0.1", p))
            socks.append(s)
    finally:
        for s in socks:
            s.close()


def test_port_holder_ignores_time_wait_as_servers_do_and_names_a_listener():
    """A server stopped a moment ago leaves TIME-WAIT sockets on its port for about a minute: a server binding
    it with SO_REUSEADDR (Ray's dashboard, aiohttp) starts anyway, so the port is free; a listener is not."""
    import psutil

    port = server_side_time_wait()
    with socket.socket() as plain:  # a bind without SO_REUSEADDR still fails there
        with pytest.raises(OSError):
            plain.bind(("127.0.0.1", port))
    assert port_holder(port) is None
    with socket.socket() as server:  # ... and a server binds it the way port_holder tried
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", port))
        server.listen()
        assert port_holder(port) in (f"pid {os.getpid()} ({psutil.Process().name()})", "another program")


# ---- admin key file ---------------------------------------------------------------------------------
def test_admin_key_file_rule(tmp_path, monkeypatch):
    """The launcher's key file is found for a router on this machine by its port in Ray's session_latest
    ($RAY_TMPDIR, else $TMPDIR, else /tmp); $PDSERVE_ADMIN_API_KEY_FILE names one for any router."""
    from pd.util.admin_key import admin_key_file_name, find_admin_key_file, is_this_machine, read_admin_key

    monkeypatch.delenv("PDSERVE_ADMIN_API_KEY_FILE", raising=False)
    monkeypatch.delenv("RAY_TMPDIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    session = tmp_path / "ray" / "session_latest"
    session.mkdir(parents=True)
    (session / admin_key_file_name(8123)).write_text("k3y\n")
    for url in ("http://127.0.0.1:8123", "http://localhost:8123/", "127.0.0.1:8123"):
        assert find_admin_key_file(url) == session / "pdserve_admin_key_8123", url
    assert find_admin_key_file("http://127.0.0.1:8124") is None  # no cluster with that router port
    assert not is_this_machine("203.0.113.7") and is_this_machine("127.0.0.2")
    assert find_admin_key_file("http://203.0.113.7:8123") is None  # a router elsewhere: its node has the file
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path / "other"))  # Ray's own precedence: RAY_TMPDIR first
    assert find_admin_key_file("http://127.0.0.1:8123") is None
    given = tmp_path / "given.key"
    monkeypatch.setenv("PDSERVE_ADMIN_API_KEY_FILE", str(given))
    assert find_admin_key_file("http://203.0.113.7:8123") == given
    assert read_admin_key(session / "pdserve_admin_key_8123") == "k3y"
    given.write_text("\n")
    with pytest.raises(ValueError, match="holds no key"):
        read_admin_key(given)
    with pytest.raises(OSError):
        read_admin_key(tmp_path / "missing")
