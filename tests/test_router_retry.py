"""pd.router.retry alone: the backoff schedule, which failures retry, and the attempt loop (no
retry once an answer is committed, ``max_retries`` attempts in all, ``--disable-retries``)."""

import json
import random

import pytest

from pd.router.cli import config_from_args
from pd.router.config import RetryConfig
from pd.router.retry import RETRYABLE_STATUS, Failure, Retrier, answered, no_answer, no_worker, stream_start


def no_jitter(**kw) -> Retrier:
    return Retrier(RetryConfig(jitter_factor=0, **kw))


# ---- backoff ------------------------------------------------------------------------------------
def test_backoff_grows_by_the_multiplier_and_stops_at_the_cap():
    r = no_jitter(initial_backoff_ms=50, backoff_multiplier=2, max_backoff_ms=300)
    assert [r.base_delay(k) for k in range(1, 7)] == [50, 100, 200, 300, 300, 300]
    assert [r.delay(k) for k in range(1, 5)] == [0.05, 0.1, 0.2, 0.3]
    default = no_jitter()  # 50 ms x 1.5 per attempt, 30 s cap
    assert [default.base_delay(k) for k in (1, 2, 3)] == [50, 75, 112.5] and default.base_delay(50) == 30_000


def test_jitter_stays_in_its_bounds_and_is_seeded():
    cfg = RetryConfig(initial_backoff_ms=100, backoff_multiplier=1.5, max_backoff_ms=1000, jitter_factor=0.2)
    r = Retrier(cfg, rng=random.Random(7))
    delays = [[r.delay(k) for k in range(1, 10)] for _ in range(200)]
    for k in range(1, 10):
        base = r.base_delay(k) / 1000
        seen = [d[k - 1] for d in delays]
        assert all(0.8 * base <= d <= 1.2 * base for d in seen), k
        assert max(seen) - min(seen) > 0.2 * base  # the jitter is really applied
    assert max(d[-1] for d in delays) <= 1.2 * 1.0  # the cap applies before the jitter
    again = Retrier(cfg, rng=random.Random(7))
    assert [again.delay(k) for k in range(1, 10)] == delays[0]


# ---- which failures retry -------------------------------------------------------------------------
@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_no_answer_is_retried_as_502_or_504(side):
    t = no_answer(side, True, "timed out")
    c = no_answer(side, False, "refused")
    assert (t.status, t.kind, t.retryable) == (504, f"{side}_timeout", True)
    assert (c.status, c.kind, c.retryable) == (502, f"{side}_connect", True)
    assert json.loads(c.body)["error"]["message"] == "refused" and c.content_type == "application/json"


@pytest.mark.parametrize("status", [400, 401, 403, 404, 408, 413, 422, 429, 500, 501, 502, 503, 504])
def test_worker_answers_retry_for_408_429_and_5xx(status):
    f = answered("decode", "http://d:1", status, b'{"error": "x"}', "application/json")
    assert f.retryable == (status in (408, 429, 500, 502, 503, 504)) and f.kind == "decode_status"
    assert (f.status, f.body) == (status, b'{"error": "x"}')  # the worker's own answer, as it was
    assert RETRYABLE_STATUS == {408, 429, 500, 502, 503, 504}


def test_no_worker_is_retried():
    f = no_worker("no decode worker is available")
    assert (f.status, f.kind, f.retryable) == (503, "no_worker", True)


@pytest.mark.parametrize("first, expected", [
    (b'data: {"error": {"message": "busy", "code": 503}}\n\n', (503, True)),
    (b'data: {"error": {"message": "too long", "code": 400}}\n\ndata: [DONE]\n\n', (400, False)),
    (b'data: {"error": {"message": "no code"}}\n\n', (500, True)),
    (b'data: {"error": {"message": "odd code", "code": 42}}\n\n', (500, True)),
    (b'data: {"error": {"message": "not implemented", "code": 501}}\n\n', (501, False)),
    (b'data: {"text": "hello"}\n\n', None),  # a token: the stream is fine
    (b'data: {"error": "a string"}\n\n', None),  # not an engine error object
    (b'data: {"error": {broken\n\n', None),  # not JSON: relayed as it is
])
def test_a_stream_whose_first_event_is_an_error_is_a_failure(first, expected):
    f = stream_start(first)
    if expected is None:
        assert f is None
    else:
        assert (f.status, f.retryable, f.kind) == (*expected, "decode_status")
        assert "error" in json.loads(f.body)


# ---- the loop -----------------------------------------------------------------------------------
class Attempts:
    """Attempt outcomes in order; records the calls and the waits."""

    def __init__(self, *outcomes):
        self.outcomes = list(outcomes)
        self.calls, self.waits, self.retried = [], [], []

    async def __call__(self, number):
        self.calls.append(number)
        return self.outcomes.pop(0) if len(self.outcomes) > 1 else self.outcomes[0]

    async def sleep(self, seconds):
        self.waits.append(seconds)

    def on_retry(self, number, failure):
        self.retried.append((number, failure.kind))


def retrier(attempts: Attempts, **kw) -> Retrier:
    return Retrier(RetryConfig(jitter_factor=0, initial_backoff_ms=10, backoff_multiplier=2, **kw),
                   sleep=attempts.sleep)


BUSY = answered("decode", "http://d:1", 503, b"busy", "text/plain")


@pytest.mark.parametrize("max_retries", [1, 2, 5])
async def test_attempts_are_max_retries_in_all(max_retries):
    a = Attempts(BUSY)
    outcome, n = await retrier(a, max_retries=max_retries).run(a, a.on_retry)
    assert outcome is BUSY and n == max_retries and a.calls == list(range(1, max_retries + 1))
    assert a.retried == [(k, "decode_status") for k in range(1, max_retries)]
    assert a.waits == [0.01 * 2 ** (k - 1) for k in range(1, max_retries)]


async def test_a_committed_answer_is_never_retried():
    """Anything but a Failure means the answer started (the first byte may be with the client)."""
    committed = object()
    a = Attempts(BUSY, committed, BUSY)
    outcome, n = await retrier(a).run(a, a.on_retry)
    assert outcome is committed and n == 2 and a.calls == [1, 2] and len(a.waits) == 1
    a = Attempts(committed)
    assert await retrier(a).run(a) == (committed, 1) and a.waits == []


async def test_a_failure_that_cannot_be_fixed_is_not_retried():
    bad = answered("prefill", "http://p:1", 400, b"prompt too long", "application/json")
    a = Attempts(BUSY, bad)
    outcome, n = await retrier(a).run(a, a.on_retry)
    assert outcome is bad and n == 2 and a.retried == [(1, "decode_status")]


async def test_disable_retries_makes_one_attempt():
    cfg = config_from_args(["--disable-retries", "--prefill", "http://a:1", "--decode", "http://d:1"]).retry
    a = Attempts(no_answer("decode", False, "refused"))
    outcome, n = await Retrier(cfg, sleep=a.sleep).run(a, a.on_retry)
    assert n == 1 and isinstance(outcome, Failure) and a.retried == [] and a.waits == []
