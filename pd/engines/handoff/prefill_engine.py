"""The prefill engine's lifecycle of one sequence (SGLang's ``--disaggregation-mode prefill``).

Claim the bootstrap room, wait for the decode to register its pages (bootstrap timeout), run the prompt forward
(it stores the prompt's KV into local pool pages), push them into the decode's pages with the Mooncake transfer
engine (only the pages past the prefix the decode already holds, ``decode_prefix_len``), then resolve the decode's
long poll with the first token (its logprobs, the cached-token count and, with speculation, the draft state). The
HTTP answer carries the first token and the prompt logprobs, with ``finish_reason {"type": "length", "length": 0}``
as SGLang's prefill gives.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict
from typing import Optional

from pd.engines.engine_core import started
from pd.engines.errors import EngineError
from pd.engines.handoff.bootstrap import BootstrapServer, Registration, RegistrationLimits, RoomFailed
from pd.engines.handoff.kv_write import KVWriter
from pd.engines.handoff.pd_engine import PDEngineCore
from pd.engines.handoff.transfer import TransferError
from pd.engines.prefix.prefix_pages import Hit, PrefixCache
from pd.engines.sequence import Sequence
from pd.engines.spec import pd_handoff


class PrefillEngineCore(PDEngineCore):
    """The engine core of a ``prefill`` engine: also runs the bootstrap server decodes register with."""

    async def start(self) -> None:
        """The pools and transfer engine, then the bootstrap server and the KV writer."""
        await super().start()
        a = self.args
        self.bootstrap = BootstrapServer(
            a.host, a.disaggregation_bootstrap_port, a.disaggregation_waiting_timeout,
            tombstone_ttl=max(60.0, 2 * a.disaggregation_waiting_timeout), api_key=a.api_key,
            limits=RegistrationLimits(self.runner.context_length, self._pool.page_size,
                                      self.spec.config.num_draft_tokens if self.spec is not None else 0),
            on_refused_connection=lambda reason: self.metrics.connections_refused.labels(reason=reason).inc(),
        )
        await self.bootstrap.start()
        self.writer = KVWriter(started(self.transfer, "transfer engine"), self.transfer_exec, self.bootstrap,
                               a.disaggregation_transfer_timeout)
        self._start_prefix_cache(self._pool)

    @property
    def _bootstrap(self) -> BootstrapServer:
        """The bootstrap server, which ``start`` started."""
        return started(self.bootstrap, "bootstrap server")

    def _admit(self, seq: Sequence) -> None:
        b = seq.req.bootstrap
        assert b is not None  # validate_request refuses a prefill request without a room
        seq.room = self._bootstrap.attach(b.room, lambda reason: self.cancel(seq, reason), len(seq.req.prompt_ids))

    def _release(self, seq: Sequence) -> None:
        room = seq.room
        if room is not None and self._bootstrap.rooms.get(room.room) is room:
            self._bootstrap.finish(room, None, seq.abort_reason or "prefill request ended")

    async def _serve(self, seq: Sequence) -> None:
        b = seq.req.bootstrap
        room = seq.room
        assert b is not None and room is not None  # _admit attached the request's room
        bootstrap, pool, writer = self._bootstrap, self._pool, started(self.writer, "KV writer")
        meta: Optional[dict] = None
        reason = None
        try:
            t0 = time.perf_counter()
            with self._gauge(self.metrics.prefill_bootstrap_queue):
                reg = await bootstrap.wait_registration(room, self.args.disaggregation_bootstrap_timeout)
            self._check_registration(reg, seq)
            t1 = time.perf_counter()
            self.metrics.observe_stage("prefill_bootstrap", t1 - t0)
            prefix = started(self.prefix, "prefix cache")
            hit = prefix.match(seq.req)
            try:
                pages = await prefix.alloc(hit, len(seq.req.prompt_ids))
            except BaseException:
                prefix.unlock(hit)
                raise
            self.update_pool_metrics()
            draft_pages: list[int] = []
            pushed = False
            try:
                if self.draft_pool is not None:
                    draft_pages = await self.draft_pool.alloc(len(seq.req.prompt_ids))
                    self.update_pool_metrics()
                with self._gauge(self.metrics.queued):
                    # The forward stores the prompt's KV into the pool pages, as SGLang's attention
                    # backends do (set_kv_buffer); the transfer then reads the pages as they are.
                    first = await self._compute(self.steps.prefill_forward, seq, (pool, pages),
                                                (self.draft_pool, draft_pages) if draft_pages else None, hit.cached)
                t2 = time.perf_counter()
                self.metrics.observe_stage("prefill_forward", t2 - t1)
                with self._gauge(self.metrics.running):
                    nbytes = await writer.push(pool, pages, reg, room, self.draft_pool, draft_pages)
                pushed = True
            finally:
                held = [(pool, pages[hit.cached // pool.page_size:])]
                if draft_pages:
                    held.append((started(self.draft_pool, "draft KV page pool"), draft_pages))
                if room.write is not None:  # Mooncake may still read them: they go back once the write settles
                    self.held.hold(held, self._settled_then_unlock(writer, room, prefix, hit))
                else:
                    prefix.finish(hit, seq.req.prompt_ids, pages) if pushed else prefix.drop(hit, pages)
                    for held_pool, p in held[1:]:
                        held_pool.free(p)
                self.update_pool_metrics()
            self._observe_hit(seq, hit)
            t3 = time.perf_counter()
            self.metrics.observe_stage("prefill_transfer_kv_cache", t3 - t2)
            self.metrics.observe_transfer(nbytes, t3 - t2)
            token, lp, top = first
            meta = {"first_token": {"id": token, "logprob": lp, "top": top}, "cached_tokens": hit.cached,
                    "bytes": nbytes}
            if self.spec is not None:
                meta["spec"] = pd_handoff.first_token_metadata(self.spec, seq)
            self._emit(seq, token, lp, top)
            seq.finish_reason = {"type": "length", "length": 0}
            seq.finish(seq.finish_reason)
        except asyncio.CancelledError:
            reason = seq.abort_reason or "prefill request cancelled"
            raise
        except RoomFailed as e:
            reason = str(e)
            self.metrics.bootstrap_failed.labels(**self.metrics.labels).inc()
            raise
        except TransferError as e:
            reason = str(e)
            self.metrics.transfer_failed.labels(**self.metrics.labels).inc()
            raise EngineError(500, f"Prefill transfer failed for request rid={seq.req.rid!r} "
                                   f"bootstrap_room={b.room}: {e}") from None
        except BaseException as e:
            reason = f"prefill failed: {e}"
            raise
        finally:
            bootstrap.finish(room, meta, reason)

    @staticmethod
    async def _settled_then_unlock(writer: KVWriter, room, prefix: PrefixCache, hit: Hit) -> None:
        """Wait for an abandoned KV write to settle, then unlock the cached pages it may have been reading."""
        try:
            await writer.settled(room)
        finally:
            prefix.unlock(hit)

    def _check_registration(self, reg: Registration, seq: Sequence) -> None:
        problem = pd_handoff.settings_mismatch(self.spec, self.draft_pool, reg) or self._layout_mismatch(reg, seq)
        if problem:
            raise RoomFailed(problem)

    def _layout_mismatch(self, reg: Registration, seq: Sequence) -> Optional[str]:
        ours = asdict(self.runner.layout)
        n = len(seq.req.prompt_ids)
        pool = self._pool
        if reg.layout != ours or reg.page_size != pool.page_size or reg.page_bytes != pool.page_bytes:
            return (f"KV layout mismatch: decode has {reg.layout} page_size={reg.page_size}, prefill has {ours} "
                    f"page_size={pool.page_size} (--page-size and the model must match on both sides)")
        if reg.decode_prefix_len % pool.page_size or not 0 <= reg.decode_prefix_len < n:
            return (f"decode_prefix_len: the decode holds {reg.decode_prefix_len} prompt tokens; it must be whole "
                    f"pages of {pool.page_size} tokens short of the prompt's {n}")
        need = pool.pages_for(n) - reg.decode_prefix_len // pool.page_size  # the decode holds the pages before
        if reg.num_tokens != n or len(reg.page_addrs) < need or (self.spec and len(reg.draft_page_addrs) < need):
            return (f"prompt mismatch: decode expects {reg.num_tokens} tokens in {len(reg.page_addrs)} pages past "
                    f"{reg.decode_prefix_len} cached, prefill tokenized {n} (were both sides sent the same request?)")
        return None
