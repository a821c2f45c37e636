"""Polling a condition until it holds or a deadline passes, for code and tests alike.

``wait_until`` (blocking) and ``async_wait_until`` (asyncio) call a predicate every ``interval``
seconds until it returns a truthy value, which they return. Every wait has a deadline: ``timeout``
defaults to ``DEFAULT_TIMEOUT`` seconds, and when it passes they raise ``TimeoutError`` naming
what was awaited and the last value or error the predicate gave, so a failed wait says why.

Exceptions of the ``retry`` types raised by the predicate count as "not yet" (a server that
refuses connections while it starts); any other exception ends the wait at once (a child process
that exited will never become ready).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from typing import Any, Awaitable, Callable, TypeVar, Union, cast

T = TypeVar("T")

DEFAULT_TIMEOUT = 30.0  # s
DEFAULT_INTERVAL = 0.2  # s

_NOTHING = object()


def _timeout_error(what: str, timeout: float, attempts: int, last_value: Any,
                   last_error: BaseException | None) -> TimeoutError:
    if last_error is not None:
        seen = f"last error: {last_error!r}"
    elif last_value is _NOTHING:
        seen = "the predicate never returned"
    else:
        seen = f"last value: {last_value!r}"
    err = TimeoutError(f"{what} not reached within {timeout:g} s ({attempts} attempts; {seen})")
    err.__cause__ = last_error
    return err


def _check_args(timeout: float, interval: float) -> None:
    if timeout is None or timeout != timeout or timeout == float("inf"):
        raise ValueError(f"timeout must be a finite number of seconds, got {timeout!r}")
    if interval <= 0:
        raise ValueError(f"interval must be > 0 s, got {interval!r}")


def wait_until(predicate: Callable[[], T], timeout: float = DEFAULT_TIMEOUT, interval: float = DEFAULT_INTERVAL,
               what: str = "condition", retry: tuple[type[BaseException], ...] = (Exception,)) -> T:
    """Call ``predicate()`` until it returns a truthy value, and return that value.

    The predicate is called at once, then every ``interval`` seconds; a last call is made at the
    deadline, so a ``timeout`` of 0 or less means exactly one call.

    Args:
        predicate: no-argument callable; a falsy result or a ``retry`` exception means "not yet".
        timeout: seconds from the call until the deadline (finite: every wait has one).
        interval: seconds between calls (> 0).
        what: what is awaited, for the error message (``"engine /health on :30000"``).
        retry: exception types that mean "not yet"; others propagate at once.

    Returns:
        The predicate's first truthy result.

    Raises:
        TimeoutError: the deadline passed; the message names ``what`` and the last value or
            error, which is also the exception's ``__cause__``.
        ValueError: ``timeout`` is not finite or ``interval`` is not positive.
        Exception: whatever the predicate raised that is not a ``retry`` type.
    """
    _check_args(timeout, interval)
    deadline = time.monotonic() + timeout
    attempts, last_value, last_error = 0, _NOTHING, None
    while True:
        attempts += 1
        try:
            value = predicate()
        except retry as e:
            last_error = e
        else:
            if value:
                return value
            last_value, last_error = value, None
        left = deadline - time.monotonic()
        if left <= 0:
            raise _timeout_error(what, timeout, attempts, last_value, last_error)
        time.sleep(min(interval, left))


async def async_wait_until(predicate: Callable[[], Union[T, Awaitable[T]]], timeout: float = DEFAULT_TIMEOUT,
                           interval: float = DEFAULT_INTERVAL, what: str = "condition",
                           retry: tuple[type[BaseException], ...] = (Exception,)) -> T:
    """``wait_until`` for asyncio: ``predicate`` may be a plain or an async callable (or return
    an awaitable); the waits between calls are ``asyncio.sleep``.

    An awaitable attempt still running at the deadline (or ``interval`` seconds after it starts,
    whichever is later) is cancelled and the wait fails with ``TimeoutError``, so a hanging
    predicate cannot stretch the deadline.

    Args and Raises: as ``wait_until``.
    """
    _check_args(timeout, interval)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    attempts, last_value, last_error = 0, _NOTHING, None
    while True:
        attempts += 1
        try:
            result = predicate()
            if inspect.isawaitable(result):
                value = await _bounded(result, max(deadline - loop.time(), interval))
            else:
                value = cast(T, result)  # not awaitable: the predicate's own value
        except _AttemptTimedOut:
            raise _timeout_error(what, timeout, attempts, last_value, last_error) from None
        except retry as e:
            last_error = e
        else:
            if value:
                return value
            last_value, last_error = value, None
        left = deadline - loop.time()
        if left <= 0:
            raise _timeout_error(what, timeout, attempts, last_value, last_error)
        await asyncio.sleep(min(interval, left))


class _AttemptTimedOut(BaseException):
    """An awaitable attempt outlived the deadline (a BaseException: no ``retry`` type catches it)."""


async def _bounded(awaitable: Awaitable[T], limit: float) -> T:
    """``await awaitable``, cancelled after ``limit`` seconds (then ``_AttemptTimedOut``); the
    awaitable's own exceptions, a ``TimeoutError`` included, pass through unchanged."""
    task = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({task}, timeout=limit)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not done:
        task.cancel()
        await asyncio.wait({task})
        raise _AttemptTimedOut()
    return task.result()
