"""Aborting one side of a PD request, and finding the sequences a worker reports as aborted.

When one side of a room fails (or the client leaves), the other side must let go of it at once:
a decode waiting for KV that never comes holds pages until its waiting timeout (minutes on SGLang),
and a prefill whose decode is gone holds its KV until its bootstrap timeout. The router therefore
aborts the other side immediately and deterministically:

1. one ``POST /abort_request`` per side with every sequence id of the request: ``{"rid": ID}`` for
   one sequence (SGLang's form), ``{"rid": [ID, ...]}`` for several (the reference engine's; the
   list mirrors ``rid`` of SGLang's GenerateReqInput). The pinned SGLang's ``AbortReq`` takes one
   string ``rid`` only and answers 400 to a list: a worker that refuses a list gets one call per id
   from then on (``Aborter.single_rid``), the router's behaviour before lists;
2. while the side's HTTP request is still running, the same call is sent again at growing intervals
   (``RESEND``, at most ``len(RESEND)`` times, never one per sequence): an abort can overtake the
   request it aborts on another connection, and an engine only aborts sequences it already has;
3. if the request still has not ended, the router drops its connection (SGLang aborts requests
   whose client went away, and the reference engine too).

A worker can also abort some sequences on its own and answer 200 (finish reason ``abort``, e.g. a
prefill that lost its rooms): ``aborted_indexes`` finds them in the answer so the matching decode
sequences are aborted too, not left waiting.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Callable, Optional

import httpx

from pd.router.background import TaskSet
from pd.router.client import fetch, started
from pd.router.errors import UPSTREAM_ERRORS
from pd.router.logprobs import SSE_DATA, SSE_DONE, sse_events

log = logging.getLogger("pd.router")

ABORT_TIMEOUT = 5.0  # seconds for one /abort_request; best effort, it never blocks a reply
# Seconds between resends while the request runs: the race they cover (an abort that overtook its request)
# ends once the request reaches the engine; an engine that took the abort ends the request well within the
# first wait even on a loaded machine, so an abort that worked is never sent twice.
RESEND = (0.25, 0.5, 1.0)
# How a worker refuses a list of rids: the pinned SGLang answers a request that fails validation (its
# AbortReq's ``rid`` is one string) with 400 (its RequestValidationError handler), FastAPI's default is 422.
LIST_REFUSED = frozenset({400, 422})


class Aborter:
    """Sends aborts in the background.

    Args:
        tasks: where the background tasks live.
        headers: headers of every /abort_request, besides each worker's own (``Worker.headers``: its key).
    """

    def __init__(self, tasks: TaskSet, headers: dict[str, str]):
        self.tasks = tasks
        self.headers = headers
        self.client: Optional[httpx.AsyncClient] = None  # pd.router.client, set before the first abort
        self.single_rid: set[str] = set()  # URLs of workers that refused a list of rids (SGLang)

    def abort(self, worker, rids: list[str], request: Optional[asyncio.Future] = None,
              on_done: Optional[Callable[[asyncio.Future], None]] = None) -> None:
        """Abort ``rids`` on ``worker`` now. ``request`` is our HTTP request to that worker (a task
        or future), if still open: aborts are resent while it runs, then it is cancelled;
        ``on_done(request)`` runs once it ended (e.g. to release its response)."""
        self.tasks.spawn(self._abort(worker, rids, request, on_done))

    async def _abort(self, worker, rids, request, on_done) -> None:
        try:
            await self.send(worker, rids)
            if request is None:
                return
            for wait in RESEND:
                if request.done():
                    break
                await asyncio.wait({request}, timeout=wait)
                if request.done():
                    break
                await self.send(worker, rids)
            if not request.done():
                log.warning("%s %s had not ended %.2fs after aborting %s; dropping its connection", worker.role,
                            worker.url, sum(RESEND), rids[:3])
                request.cancel()
                await asyncio.wait({request})
        finally:
            if request is not None and on_done is not None:
                on_done(request)

    async def send(self, worker, rids: list[str]) -> None:
        """Abort ``rids`` on ``worker``: one POST /abort_request naming them all, or, on a worker that
        takes one rid per call, one call per rid, concurrently. Failures are not raised but logged as one
        line (how many failed, the first error): a request of many sequences on a busy engine must not
        write a warning per sequence."""
        if not rids:
            return
        if len(rids) > 1 and worker.url not in self.single_rid:
            status, error = await self._post(worker, rids)
            if status not in LIST_REFUSED:
                if error is not None or status is None or status >= 300:  # no status only with an error
                    log.warning("abort of %d of %d rid(s) on %s %s failed (first: %s: %s)", len(rids), len(rids),
                                worker.role, worker.url, rids[0],
                                repr(error) if error is not None else f"HTTP {status}")
                return
            self.single_rid.add(worker.url)
            log.info("%s %s takes one rid per /abort_request (it answered %d to a list); aborting one by one "
                     "from now on", worker.role, worker.url, status)
        results = await asyncio.gather(*(self._post(worker, rid) for rid in rids))
        failed = [(rid, e) for rid, (_, e) in zip(rids, results) if e is not None]
        if failed:
            log.warning("abort of %d of %d rid(s) on %s %s failed (first: %s: %r)", len(failed), len(rids),
                        worker.role, worker.url, failed[0][0], failed[0][1])

    async def _post(self, worker, rid: str | list[str]) -> tuple[Optional[int], Optional[BaseException]]:
        """One /abort_request: (HTTP status, None), or (None, the error) instead of raising it."""
        try:
            r = await fetch(started(self.client, "Aborter"), "POST", worker.url + "/abort_request", ABORT_TIMEOUT,
                            json={"rid": rid}, headers={**self.headers, **worker.headers})
        except UPSTREAM_ERRORS as e:
            return None, e
        return r.status_code, None


def _generate_aborted(obj) -> bool:
    meta = obj.get("meta_info") if isinstance(obj, dict) else None
    fr = meta.get("finish_reason") if isinstance(meta, dict) else None
    return isinstance(fr, dict) and fr.get("type") == "abort"


def _openai_aborted(obj) -> list[int]:
    choices = obj.get("choices") if isinstance(obj, dict) else None
    if not isinstance(choices, list):
        return []
    return [c.get("index", 0) for c in choices if isinstance(c, dict) and c.get("finish_reason") == "abort"]


def aborted_indexes(route: str, raw: bytes, stream: bool) -> set[int]:
    """Sequence indexes (prompt-major, as the bootstrap rooms) that ``raw``, a worker's whole 2xx
    answer to ``route``, reports as finished with reason ``abort``."""
    if b"abort" not in raw:
        return set()
    if stream:
        objs = []
        for event in sse_events(raw):
            if event.startswith(SSE_DATA) and not event.startswith(SSE_DONE):
                try:
                    objs.append(json.loads(event[len(SSE_DATA):]))
                except ValueError:
                    pass
    else:
        try:
            obj = json.loads(raw)
        except ValueError:
            return set()
        objs = obj if isinstance(obj, list) and route == "/generate" else [obj]
    out: set[int] = set()
    for i, obj in enumerate(objs):
        if route == "/generate":
            if _generate_aborted(obj):
                out.add(obj.get("index", 0) if stream else i)
        else:
            out.update(_openai_aborted(obj))
    return out
