"""The decode engine's lifecycle of one sequence (SGLang's ``--disaggregation-mode decode``).

Pre-allocate pages for the prompt (and the verify window, with speculation), register them with the prefill's
bootstrap server and wait (waiting timeout) until the prefill has written the KV and sent the first token, load
the KV from the pages and continue decoding from that token. Pages the prefill may still be writing into go back
only once the prefill says no write is in flight.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict

from pd.engines.engine_core import started
from pd.engines.handoff.bootstrap import Registration, RoomFailed, abort_on_prefill, register_with_prefill
from pd.engines.handoff.pd_engine import PDEngineCore
from pd.engines.protocol import Bootstrap
from pd.engines.sequence import Sequence
from pd.engines.spec import pd_handoff

# s a failed decode request waits for its /pd/abort to land before it answers, so that the prefill has ended the
# room first (its request for the room then fails at once); a hung prefill delays the answer no longer than this
ABORT_LANDING_WAIT = 1.0


class DecodeEngineCore(PDEngineCore):
    """The engine core of a ``decode`` engine."""

    def _admit(self, seq: Sequence) -> None:
        self.decode_rooms.add(_bootstrap(seq).room)

    def _release(self, seq: Sequence) -> None:
        self.decode_rooms.discard(_bootstrap(seq).room)

    async def _serve(self, seq: Sequence) -> None:
        b = _bootstrap(seq)
        host, port = b.host, b.port
        assert host and port is not None  # validate_request refuses a decode request without them
        pool, http = self._pool, started(self.http, "HTTP client")
        transfer = started(self.transfer, "transfer engine")
        n = len(seq.req.prompt_ids)
        pages: list[int] = []
        draft_pages: list[int] = []
        kv_arrived = False
        # With speculation the decode also holds the verify window's pages, in both caches.
        tokens = n + (self.spec.config.num_draft_tokens if self.spec is not None else 0)
        try:
            t0 = time.perf_counter()
            with self._gauge(self.metrics.decode_prealloc_queue):
                try:
                    async with asyncio.timeout(self.args.disaggregation_waiting_timeout):
                        pages = await pool.alloc(tokens)
                        if self.draft_pool is not None:
                            draft_pages = await self.draft_pool.alloc(tokens)
                except TimeoutError:
                    raise RoomFailed(f"no free KV pages for {n} tokens within "
                                     f"{self.args.disaggregation_waiting_timeout:g}s") from None
            self.update_pool_metrics()
            t1 = time.perf_counter()
            self.metrics.observe_stage("decode_bootstrap", t1 - t0)
            reg = Registration(
                room=b.room, session_id=transfer.session_id,
                page_addrs=[pool.page_addr(p) for p in pages], page_bytes=pool.page_bytes,
                page_size=pool.page_size, layout=asdict(self.runner.layout), num_tokens=n,
                **pd_handoff.registration_fields(self.spec, self.draft_pool, draft_pages),
            )
            with self._gauge(self.metrics.decode_transfer_queue):
                try:
                    meta = await register_with_prefill(http, host, port, reg,
                                                       self.args.disaggregation_waiting_timeout)
                except RoomFailed:
                    self.metrics.transfer_failed.labels(**self.metrics.labels).inc()
                    raise
            kv_arrived = True
            t2 = time.perf_counter()
            self.metrics.observe_stage("decode_transferred", t2 - t1)
            self.metrics.transfer_bytes.labels(**self.metrics.labels).inc(meta.get("bytes", 0))
            with self._gauge(self.metrics.queued):
                seq.cache = await self._compute(self.runner.import_kv, pool.pages, pages, n)
                if self.spec is not None:
                    seq.spec_state = await self._compute(pd_handoff.restore_state, self.spec, self.draft_pool, meta,
                                                         draft_pages, n)
            self.metrics.observe_stage("decode_waiting", time.perf_counter() - t2)
            seq.cached_tokens = int(meta.get("cached_tokens", 0))
            first = meta["first_token"]
            with self._gauge(self.metrics.running):
                self._emit(seq, int(first["id"]), first["logprob"], [tuple(t) for t in first["top"]])
                await self._decode_loop(seq)
        finally:
            if pages:
                held = [(pool, pages)]
                if draft_pages:
                    held.append((started(self.draft_pool, "draft KV page pool"), draft_pages))
                if kv_arrived:
                    for held_pool, p in held:
                        held_pool.free(p)
                    self.update_pool_metrics()
                else:
                    # The prefill may be writing into these pages: they go back once it says no write is in flight
                    # (or after SGLang's deferred KV release timeout); this request answers once the abort landed.
                    abort = abort_on_prefill(http, host, port, b.room, seq.abort_reason or "decode failed",
                                             self.args.decode_kv_release_timeout)
                    releasing = self.held.hold(held, abort)
                    await asyncio.wait({releasing}, timeout=ABORT_LANDING_WAIT)


def _bootstrap(seq: Sequence) -> Bootstrap:
    """The request's bootstrap fields, which validate_request requires of a decode request."""
    b = seq.req.bootstrap
    assert b is not None  # validate_request refused the request otherwise
    return b
