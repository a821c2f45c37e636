"""Open-loop load: send each request at its arrival time, whatever the server's state, through SGLang's
per-backend request functions (``sglang.benchmark.serving.ASYNC_REQUEST_FUNCS``: they stream the answer
and record TTFT, each inter-token gap, E2E and the output length).

Written here rather than calling SGLang's ``benchmark()`` because that one gathers every request before it
returns anything (an interrupt loses the run), has Poisson arrivals only, sleeps its gaps one after the
other (so arrivals drift later by the event loop's delay at each step), has no per-request deadline, and
prints, flushes caches and writes files itself. Here arrivals are absolute offsets from the start, each
request has a deadline, and every finished request is appended to :class:`LoadState` at once, so a Ctrl-C
(the task is cancelled) leaves what was measured.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np


def arrival_offsets(n: int, rate: float, process: str, rng: np.random.Generator) -> list[float]:
    """Send times in s from the start of ``n`` requests at ``rate`` req/s.

    ``poisson``: exponential gaps of mean ``1/rate`` (the first request at 0, as SGLang sends it);
    ``constant``: ``i / rate``; ``rate`` inf: all at 0.

    Raises:
        ValueError: ``rate`` is not > 0, or an unknown ``process``.
    """
    if not rate > 0:
        raise ValueError(f"request rate must be > 0 req/s, got {rate!r}")
    if math.isinf(rate):
        return [0.0] * n
    if process == "constant":
        return [i / rate for i in range(n)]
    if process == "poisson":
        gaps = rng.exponential(1.0 / rate, max(n - 1, 0))
        return [0.0] + np.cumsum(gaps).tolist()
    raise ValueError(f"unknown arrival process {process!r} (poisson or constant)")


@dataclass
class Finished:
    """One finished request: its index in the run's request list, SGLang's ``RequestFuncOutput`` (seconds;
    ``start_time`` on ``time.perf_counter``'s clock) and its scheduled send time (s from the start)."""

    index: int
    output: Any
    arrival_s: float


@dataclass
class LoadState:
    """What a load run has measured so far (read it after an interrupt too)."""

    sent: int = 0
    finished: list[Finished] = field(default_factory=list)
    start: Optional[float] = None  # time.perf_counter() at the first send
    end: Optional[float] = None    # when the last request finished, or the run was interrupted

    @property
    def duration_s(self) -> float:
        """Wall time from the first send to the end (or to now, while running)."""
        if self.start is None:
            return 0.0
        return (self.end if self.end is not None else time.perf_counter()) - self.start


async def drive(rows: list, offsets: list[float], request_func: Callable, *, api_url: str, model_id: str,
                extra_body: dict, max_concurrency: Optional[int], timeout_s: float, state: LoadState,
                progress=None) -> LoadState:
    """Send ``rows`` (SGLang ``DatasetRow``) at ``offsets`` (s) with SGLang's ``request_func`` and wait for all.

    Args:
        api_url: the full route URL (base URL + the backend's path).
        model_id: the ``model`` field of OpenAI requests.
        extra_body: merged into every body (a row's own extra body wins, as in SGLang).
        max_concurrency: at most this many requests in flight (a request waits for a slot after its arrival
            time; its TTFT starts when it is sent, as SGLang measures it); None: no limit.
        timeout_s: a request running longer fails with an error saying so.
        state: filled as requests finish.
        progress: a tqdm-like bar (``update(1)`` per finished request) or None.

    Returns:
        ``state``. A cancelled run (Ctrl-C) cancels the requests in flight and re-raises; ``state`` keeps the
        finished ones and ``state.end`` the moment it stopped.
    """
    serving_mod = _serving()
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(i: int, row) -> None:
        inp = serving_mod.RequestFuncInput(
            model=model_id, prompt=row.prompt, api_url=api_url, prompt_len=row.prompt_len,
            output_len=row.output_len, lora_name=None, image_data=row.image_data,
            extra_request_body={**extra_body, **(row.extra_request_body or {})})
        async with slots if slots is not None else contextlib.nullcontext():
            sent = time.perf_counter()
            try:
                out = await asyncio.wait_for(request_func(request_func_input=inp, pbar=None), timeout_s)
            except TimeoutError:
                out = serving_mod.RequestFuncOutput.init_new(inp)
                out.start_time, out.latency = sent, time.perf_counter() - sent
                out.error = f"no complete answer within --request-timeout-secs {timeout_s:g}"
        state.finished.append(Finished(i, out, offsets[i]))
        if len(state.finished) == len(rows):
            state.end = time.perf_counter()
        if progress is not None:
            progress.update(1)

    tasks = []
    state.start = time.perf_counter()
    try:
        for i, row in enumerate(rows):
            delay = state.start + offsets[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i, row)))
            state.sent += 1
        await asyncio.gather(*tasks)
    finally:
        if state.end is None:
            state.end = time.perf_counter()
        for t in tasks:
            t.cancel()
    return state


def _serving():
    from pd.bench.sglang_serving import serving

    return serving()
