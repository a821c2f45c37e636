"""The decode engine's lifecycle of one sequence (SGLang's ``--disaggregation-mode decode``).

Pre-allocate pages for the prompt (and the verify window, with speculation), register them with the prefill's
bootstrap server and wait (waiting timeout) until the prefill has written the KV and sent the first token, load
the KV from the pages and continue decoding from that token. Pages the prefill may still be writing into go back
only once the prefill says no write is in flight.

With ``--disaggregation-decode-enable-radix-cache`` (pd.engines.prefix.decode_prefix) the prompt's leading whole
pages may already be cached here: the decode locks them, registers only the pages past them (``decode_prefix_len``
names how many prompt tokens it holds), loads the KV from the cached pages and the received ones, and leaves the
prompt's whole pages in the cache when the request ends.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict
from typing import Optional

from pd.engines.engine_core import started
from pd.engines.handoff.bootstrap import Registration, RoomFailed, abort_on_prefill, register_with_prefill
from pd.engines.handoff.pd_engine import PDEngineCore
from pd.engines.prefix.decode_prefix import DecodeHit, DecodePrefixCache
from pd.engines.protocol import Bootstrap
from pd.engines.sequence import Sequence
from pd.engines.spec import pd_handoff

# s a failed decode request waits for its /pd/abort to land before it answers, so that the prefill has ended the
# room first (its request for the room then fails at once); a hung prefill delays the answer no longer than this
ABORT_LANDING_WAIT = 1.0


class DecodeEngineCore(PDEngineCore):
    """The engine core of a ``decode`` engine."""

    decode_prefix: Optional[DecodePrefixCache] = None  # --disaggregation-decode-enable-radix-cache

    async def start(self) -> None:
        """The pools and transfer engine, and the decode's radix cache when it is on."""
        await super().start()
        if self.args.disaggregation_decode_enable_radix_cache:
            self.prefix = self.decode_prefix = DecodePrefixCache(self._pool, self.draft_pool)

    def _admit(self, seq: Sequence) -> None:
        self.decode_rooms.add(_bootstrap(seq).room)

    def _release(self, seq: Sequence) -> None:
        self.decode_rooms.discard(_bootstrap(seq).room)

    def update_pool_metrics(self) -> None:
        """The pools' occupancy; cached draft pages, like cached target pages, are not counted as held."""
        super().update_pool_metrics()
        if self.draft_pool is not None and self.decode_prefix is not None:
            self.metrics.set_draft_pool(self.draft_pool.held - self.decode_prefix.cached_pages())

    async def _serve(self, seq: Sequence) -> None:
        b = _bootstrap(seq)
        host, port = b.host, b.port
        assert host and port is not None  # validate_request refuses a decode request without them
        pool, http = self._pool, started(self.http, "HTTP client")
        transfer = started(self.transfer, "transfer engine")
        prompt = seq.req.prompt_ids
        n = len(prompt)
        cache = self.decode_prefix
        hit: Optional[DecodeHit] = None
        pages: list[int] = []  # this request's own pages (past the hit), in both pools
        draft_pages: list[int] = []
        kv_arrived = kv_loaded = False
        first_token: Optional[int] = None
        # With speculation the decode also holds the verify window's pages, in both caches.
        tokens = n + (self.spec.config.num_draft_tokens if self.spec is not None else 0)
        try:
            t0 = time.perf_counter()
            with self._gauge(self.metrics.decode_prealloc_queue):
                if cache is not None:
                    hit = cache.match_prompt(prompt)  # locked from here until the finally below
                cached = hit.cached if hit is not None else 0
                try:
                    async with asyncio.timeout(self.args.disaggregation_waiting_timeout):
                        pages = await pool.alloc(tokens - cached)
                        if self.draft_pool is not None:
                            draft_pages = await self.draft_pool.alloc(tokens - cached)
                except TimeoutError:
                    raise RoomFailed(f"no free KV pages for {n - cached} tokens within "
                                     f"{self.args.disaggregation_waiting_timeout:g}s") from None
            self.update_pool_metrics()
            t1 = time.perf_counter()
            self.metrics.observe_stage("decode_bootstrap", t1 - t0)
            reg = Registration(
                room=b.room, session_id=transfer.session_id,
                page_addrs=[pool.page_addr(p) for p in pages], page_bytes=pool.page_bytes,
                page_size=pool.page_size, layout=asdict(self.runner.layout), num_tokens=n, decode_prefix_len=cached,
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
            first = meta["first_token"]
            first_token = int(first["id"])
            # the KV in prompt order: the cached pages, then the ones the prefill wrote
            all_pages = (hit.pages if hit is not None else []) + pages
            all_draft = (hit.draft_pages if hit is not None else []) + draft_pages
            with self._gauge(self.metrics.queued):
                seq.cache = await self._compute(self.runner.import_kv, pool.pages, all_pages, n)
                if self.spec is not None:
                    seq.spec_state = await self._compute(pd_handoff.restore_state, self.spec, self.draft_pool, meta,
                                                         all_draft, n)
            kv_loaded = True
            self.metrics.observe_stage("decode_waiting", time.perf_counter() - t2)
            # SGLang's decode reports the prefill's hit, raised to its own when that is longer
            # (decode_schedule_batch_mixin.py, prepare_for_prebuilt)
            seq.cached_tokens = max(int(meta.get("cached_tokens", 0)), cached)
            if cached:
                self.metrics.decode_prefix_cached.labels(**self.metrics.labels).inc(cached)
            with self._gauge(self.metrics.running):
                self._emit(seq, first_token, first["logprob"], [tuple(t) for t in first["top"]])
                await self._decode_loop(seq)
        finally:
            releasing = self._release_pages(seq, hit, pages, draft_pages, kv_arrived, kv_loaded, first_token)
            if releasing is not None:  # this request answers once its abort landed on the prefill
                await asyncio.wait({releasing}, timeout=ABORT_LANDING_WAIT)

    def _release_pages(self, seq: Sequence, hit: Optional[DecodeHit], pages: list[int], draft_pages: list[int],
                       kv_arrived: bool, kv_loaded: bool, first_token: Optional[int]) -> Optional[asyncio.Task]:
        """Give back a finished or failed request's pages: with the radix cache, a prompt whose KV was loaded leaves
        its whole pages in the tree, and KV that arrived but did not load is dropped. Pages the prefill may still
        be writing into are held until it says no write is in flight: returns the task that frees them, which
        first tells the prefill the room is aborted (the hit's cached pages were never registered, so only their
        lock goes at once)."""
        cache = self.decode_prefix
        own = [(self._pool, pages)]
        if draft_pages:
            own.append((started(self.draft_pool, "draft KV page pool"), draft_pages))
        if kv_arrived:
            if cache is not None and hit is not None:
                whole, whole_draft = hit.pages + pages, hit.draft_pages + draft_pages
                if kv_loaded:
                    cache.finish_prompt(hit, seq.req.prompt_ids, whole, whole_draft, first_token)
                else:
                    cache.drop_prompt(hit, whole, whole_draft)
            else:
                for pool, p in own:
                    pool.free(p)
            self.update_pool_metrics()
            return None
        if cache is not None and hit is not None:
            cache.unlock(hit)
        if not pages:
            self.update_pool_metrics()
            return None
        # The prefill may be writing into these pages: they go back once it says no write is in flight (or after
        # SGLang's deferred KV release timeout).
        b = _bootstrap(seq)
        assert b.host and b.port is not None  # validate_request refuses a decode request without them
        abort = abort_on_prefill(started(self.http, "HTTP client"), b.host, b.port, b.room,
                                 seq.abort_reason or "decode failed", self.args.decode_kv_release_timeout)
        return self.held.hold(own, abort)


def _bootstrap(seq: Sequence) -> Bootstrap:
    """The request's bootstrap fields, which validate_request requires of a decode request."""
    b = seq.req.bootstrap
    assert b is not None  # validate_request refused the request otherwise
    return b
