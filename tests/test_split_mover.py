"""Moving a worker between prefill and decode (pd.cluster.split_mover) on real reference engines behind a real
router, without Ray: the worker is a `pdserve engine` subprocess the test restarts in the other role, as the
worker actor does (pd.cluster.worker.EngineWorker.start_as; tests/test_split_cluster.py moves a Ray actor)."""

from __future__ import annotations

import os
import signal
import threading

import httpx
import pytest

from conftest import PD_TIMEOUT, SPEC_FLAGS
from engines import Engine, metric, start_engine, wait_ready, wait_until_ready
from pd.cluster.split_mover import SplitMover, engine_holdings
from pd.router.admin_client import AdminClient
from pd.util.wait import wait_until
from routers import RouterProc

pytestmark = pytest.mark.slow  # each test starts three engines and restarts one (a minute or more)

TIMEOUTS = ("--disaggregation-bootstrap-timeout", PD_TIMEOUT, "--disaggregation-waiting-timeout", PD_TIMEOUT)


def info(e: Engine, name: str) -> dict:
    """The worker info the mover reads (pd.cluster.worker.EngineWorker.info's keys it uses)."""
    return {"name": name, "role": e.mode, "url": e.url, "host": "127.0.0.1", "port": e.port,
            "bootstrap_port": e.bootstrap_port, "state": "ready"}


class LocalOps:
    """WorkerOps over an engine subprocess: stop it, start `pdserve engine` in the asked role on new ports.

    Args:
        engine: the running engine. log_dir: engine logs. extra: flags of every engine it starts.
        fail_role: a role whose engine is given a flag it refuses (exits at once): its start fails.
    """

    def __init__(self, engine: Engine, log_dir: str, extra: tuple = (), fail_role: str | None = None):
        self.engine, self.log_dir, self.extra, self.fail_role = engine, log_dir, extra, fail_role
        self.started: list[Engine] = []

    def stop_engine(self) -> None:
        # SIGKILL: the harshest stop (an engine that does not finish its requests on SIGTERM, as the reference
        # engine's server does): what the engine still held when the mover stopped it is lost
        if self.engine.proc.poll() is None:
            os.killpg(self.engine.proc.pid, signal.SIGKILL)
            self.engine.proc.wait(10)

    def start_as(self, role: str, name: str) -> dict:
        bad = ("--no-such-engine-flag",) if role == self.fail_role else ()
        e = start_engine(role, self.log_dir, *self.extra, *TIMEOUTS, *bad)
        self.started.append(e)
        wait_until_ready(e, timeout=180)  # RuntimeError when it exits
        self.engine = e
        return info(e, name)


class Cluster:
    """Two prefills and a decode (or as given) behind `pdserve router`, and the admin API the mover uses."""

    def __init__(self, log_dir: str, roles=("prefill", "prefill", "decode"), extra: tuple = (),
                 router_args: tuple = ()):
        self.log_dir, self.extra = log_dir, extra
        self.engines = [start_engine(r, log_dir, *extra, *TIMEOUTS) for r in roles]
        self.router = None
        try:
            wait_ready(self.engines)
            args = []
            for e in self.engines:
                args += ["--prefill", e.url, str(e.bootstrap_port)] if e.mode == "prefill" else ["--decode", e.url]
            self.router = RouterProc(args + ["--health-check-interval", "0", *router_args], log_dir)
            self.router.wait_ready()
        except BaseException:
            self.stop()
            raise
        self.admin = AdminClient(self.router.url, None)
        self.ops: list[LocalOps] = []

    def mover(self) -> SplitMover:
        admit = lambda i: self.admin.add(i["url"], i["role"], i.get("bootstrap_port"))  # noqa: E731
        return SplitMover(self.admin, admit, lambda i: self.admin.remove(i["url"]), settle_timeout=60,
                          say=lambda m: print("pdserve:", m))

    def local_ops(self, e: Engine, **kw) -> LocalOps:
        ops = LocalOps(e, self.log_dir, self.extra, **kw)
        self.ops.append(ops)
        return ops

    def split(self) -> tuple[int, int]:
        ws = self.admin.workers()
        return (sum(w["worker_type"] == "prefill" for w in ws), sum(w["worker_type"] == "decode" for w in ws))

    def stop(self) -> None:
        if self.router is not None:
            self.router.stop()
        for e in self.engines + [x for o in getattr(self, "ops", []) for x in o.started]:
            e.stop()


@pytest.fixture
def cluster_factory(model_cache, tmp_path):
    made = []

    def make(**kw) -> Cluster:
        c = Cluster(str(tmp_path), **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.stop()


class Traffic:
    """Streaming /generate requests from ``concurrency`` threads until stopped; each one's outcome kept."""

    def __init__(self, url: str, concurrency: int = 4, max_new_tokens: int = 24):
        self.url, self.results, self.stopping = url, [], threading.Event()
        self.body = {"text": "The planner moves a worker " * 8, "stream": True,
                     "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
        self.threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(concurrency)]
        for t in self.threads:
            t.start()

    def _loop(self) -> None:
        with httpx.Client(timeout=120) as c:
            while not self.stopping.is_set():
                try:
                    with c.stream("POST", self.url + "/generate", json=self.body) as r:
                        text = r.read().decode()
                    ok = r.status_code == 200 and "data: [DONE]" in text and '"error"' not in text
                    self.results.append((ok, r.status_code, text[-300:]))
                except httpx.HTTPError as e:
                    self.results.append((False, None, repr(e)))

    def finished(self) -> int:
        return len(self.results)

    def stop(self) -> list:
        self.stopping.set()
        for t in self.threads:
            t.join(180)
        return self.results


def router_counter(router: RouterProc, name: str) -> float:
    from engines import _metric_sum

    return _metric_sum(httpx.get(router.url + "/metrics", timeout=10).text, name, {})


def wait_inflight(admin: AdminClient, url: str) -> None:
    """Until the router has a request in flight on ``url`` (the move then starts with work to drain)."""
    wait_until(lambda: any(w["url"] == url and w["inflight"] > 0 for w in admin.workers()), 60, interval=0.02,
               what=f"a request in flight on {url}")


def assert_nothing_held(engines) -> None:
    for e in engines:
        wait_until(lambda: not engine_holdings(e.url, f"http://127.0.0.1:{e.bootstrap_port}" if e.bootstrap_port
                                               else None, httpx.Client(timeout=5)),
                   30, interval=0.2, what=f"{e.url} holding nothing")


def test_a_move_with_requests_in_flight_loses_none(cluster_factory):
    """A decode streaming answers is moved to prefill: the drain lets its streams end, nothing fails or is retried,
    it then serves prefills; no engine holds a page or a room afterwards."""
    c = cluster_factory(roles=("prefill", "decode", "decode"))
    p0, d0, d1 = c.engines
    traffic = Traffic(c.router.url, max_new_tokens=160)  # long streams: the move starts with some on d1
    try:
        wait_until(lambda: traffic.finished() >= 4, 120, interval=0.1, what="traffic flowing")
        wait_inflight(c.admin, d1.url)
        ops = c.local_ops(d1)
        result = c.mover().move(info(d1, "decode-1"), ops, "prefill", "prefill-1")
        assert result.outcome == "moved", result.detail
        done = traffic.finished()
        wait_until(lambda: traffic.finished() >= done + 8, 180, interval=0.1, what="traffic after the move")
    finally:
        results = traffic.stop()
    failed = [r for r in results if not r[0]]
    assert not failed and len(results) >= 12, failed[:3]
    new = ops.engine
    # drained, not retried elsewhere: no attempt on the moved worker (old or new engine) failed. A retry between the
    # two workers the move left alone is not its doing (on a loaded machine a KV wait can outlast its timeout).
    retried = [line for line in c.router.log().splitlines() if "retrying" in line]
    moved = {f"{d1.url} ", f"{new.url} "}  # as the line names a pair: "on <prefill> -> <decode> failed"
    assert not [line for line in retried if any(u in line for u in moved)], retried
    assert router_counter(c.router, "pdserve_router_retries_total") == len(retried)
    assert router_counter(c.router, "pdserve_router_errors_total") == 0
    assert c.split() == (2, 1)
    assert new.mode == "prefill" and result.info["url"] == new.url and result.info["name"] == "prefill-1"
    assert metric(new, "pdserve_kv_transfer_bytes_total") > 0  # the moved worker serves prefills
    assert d1.proc.poll() is not None  # its old engine is gone
    assert_nothing_held([p0, d0, new])


def test_a_move_that_fails_to_start_rolls_back(cluster_factory):
    c = cluster_factory()
    p0, p1, d0 = c.engines
    traffic = Traffic(c.router.url)
    try:
        wait_until(lambda: traffic.finished() >= 4, 120, interval=0.1, what="traffic flowing")
        ops = c.local_ops(p1, fail_role="decode")
        result = c.mover().move(info(p1, "prefill-1"), ops, "decode", "decode-1")
        assert result.outcome == "rolled_back", result.detail
        assert "during startup" in result.detail or "exited" in result.detail, result.detail
        done = traffic.finished()
        wait_until(lambda: traffic.finished() >= done + 8, 120, interval=0.1, what="traffic after the rollback")
    finally:
        results = traffic.stop()
    assert not [r for r in results if not r[0]]
    back = ops.engine
    assert back.mode == "prefill" and back is not p1 and result.info["name"] == "prefill-1"
    assert c.split() == (2, 1)
    listed = {w["url"]: w for w in c.admin.workers()}
    assert back.url in listed and listed[back.url]["is_healthy"] and not listed[back.url]["draining"]
    assert p1.url not in listed
    assert metric(back, "pdserve_kv_transfer_bytes_total") > 0  # it serves prefills again


def test_a_move_gives_up_without_stopping_anything_when_the_engine_does_not_settle(cluster_factory):
    """A drained worker whose engine still holds a request past the deadline is put back as it was."""
    # d0 is the only decode: a stream that ends while it is drained starts a request that finds no decode until
    # the move gives up (1 s settle deadline). These retries wait about 6 s in all, so that request is served
    # once d0 is back; the default retries give up after about 0.7 s.
    c = cluster_factory(router_args=("--retry-max-retries", "10", "--retry-initial-backoff-ms", "200",
                                     "--retry-max-backoff-ms", "1000"))
    p0, p1, d0 = c.engines
    mover = c.mover()
    mover.settle_timeout = 1.0
    traffic = Traffic(c.router.url, concurrency=2, max_new_tokens=400)  # long streams: the drain cannot finish
    try:
        wait_inflight(c.admin, d0.url)
        ops = c.local_ops(d0)
        result = mover.move(info(d0, "decode-0"), ops, "prefill", "prefill-2")
    finally:
        results = traffic.stop()
    assert result.outcome in ("drain_timeout", "settle_timeout") and not ops.started
    assert not [r for r in results if not r[0]]
    assert d0.proc.poll() is None and c.split() == (2, 1)
    assert not any(w["draining"] for w in c.admin.workers())


def test_a_speculative_decode_worker_can_be_moved(cluster_factory):
    """1P2D with EAGLE on both sides: a decode becomes a prefill (it drafts the prompt and ships the draft's state
    with the KV), the remaining decode goes on verifying drafts, nothing fails."""
    from pd.engines.spec.draft_model import resolve_draft_path

    resolve_draft_path("builtin:tiny", None)
    c = cluster_factory(roles=("prefill", "decode", "decode"), extra=SPEC_FLAGS)
    p0, d0, d1 = c.engines
    traffic = Traffic(c.router.url)
    try:
        wait_until(lambda: traffic.finished() >= 4, 120, interval=0.1, what="traffic flowing")
        wait_inflight(c.admin, d1.url)
        ops = c.local_ops(d1)
        result = c.mover().move(info(d1, "decode-1"), ops, "prefill", "prefill-1")
        assert result.outcome == "moved", result.detail
        verified = metric(d0, "sglang:spec_verify_calls_total")
        done = traffic.finished()
        wait_until(lambda: traffic.finished() >= done + 8, 120, interval=0.1, what="traffic after the move")
    finally:
        results = traffic.stop()
    assert not [r for r in results if not r[0]]
    assert c.split() == (2, 1)
    new = ops.engine
    assert new.mode == "prefill" and "--speculative-algorithm" in new.args
    assert metric(new, "pdserve_kv_transfer_bytes_total") > 0  # it prefilled for the speculative decode
    assert metric(d0, "sglang:spec_verify_calls_total") > verified
    assert_nothing_held([p0, d0, new])


def test_the_admin_api_pins_the_split_and_shows_the_controllers_report(cluster_factory):
    c = cluster_factory(roles=("prefill", "decode"))
    assert c.admin.planner() == {"mode": "off", "current": {"prefill": 1, "decode": 1}, "override": None}
    assert c.admin.pin_split(1, 2) == {"prefill": 1, "decode": 2}
    c.admin.report_planner({"mode": "act", "target": {"prefill": 1, "decode": 2}, "moving": True,
                            "current": {"prefill": 9, "decode": 9}})  # current is the router's own count
    got = c.admin.planner()
    assert got["mode"] == "act" and got["moving"] and got["current"] == {"prefill": 1, "decode": 1}
    assert got["override"] == {"prefill": 1, "decode": 2} and got["target"] == {"prefill": 1, "decode": 2}
    for body, field in (({"prefill": 0, "decode": 2}, "prefill"), ({"prefill": 1, "decode": True}, "decode"),
                        ({"prefill": 1}, "decode")):
        r = httpx.put(c.router.url + "/planner/override", json=body, timeout=10)
        assert r.status_code == 400 and field in r.text, r.text
    c.admin.unpin_split()
    assert c.admin.planner()["override"] is None
