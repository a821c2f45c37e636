"""The reference engine's core: runs each generated sequence through its mode's lifecycle.

Modes (SGLang's ``--disaggregation-mode``):

- ``null``: prefill forward, then decode steps, all here.
- ``prefill``: claim the bootstrap room, wait for the decode to register its pages (bootstrap
  timeout), prefill forward, sample the first token, copy the KV into local pool pages, push them
  into the decode's pages with the Mooncake transfer engine, then resolve the decode's long poll with
  the first token (and its logprobs, cached-token count). The HTTP answer carries the first token
  and the prompt logprobs, with ``finish_reason {"type": "length", "length": 0}`` as SGLang's
  prefill gives.
- ``decode``: pre-allocate pages for the prompt, register them with the prefill's bootstrap server
  and wait (waiting timeout), load the KV from the pages, continue from the shipped first token.

All model work runs on one thread, one sequence at a time (see model_runner). Every path
releases its KV pages, including cancellation (client disconnect, /abort_request, peer abort).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Callable, Optional

import httpx
import torch

from pd.engines.bootstrap import (
    BootstrapServer,
    Registration,
    RegistrationLimits,
    RoomFailed,
    abort_on_prefill,
    make_client,
    register_with_prefill,
)
from pd.engines.errors import EngineError, bad_request
from pd.engines.kv_pool import KVPagePool, PoolExhausted
from pd.engines.metrics import EngineMetrics
from pd.engines.model_runner import ModelRunner
from pd.engines.protocol import SeqSpec
from pd.engines.sampling import sample
from pd.engines.sequence import Sequence
from pd.engines.spec_config import SpecConfig
from pd.engines.speculative import SpecDecoder
from pd.engines.transfer import MooncakeTransfer, TransferError, coalesce, write_deadline

log = logging.getLogger(__name__)

USER_ABORT = "Aborted"
WRITE_POLL_MIN, WRITE_POLL_MAX = 0.0005, 0.02  # s between polls of a KV write (a local write takes ~1 ms)
# s a failed decode request waits for its /pd/abort to land before it answers, so that the prefill has ended the
# room first (its request for the room then fails at once); a hung prefill delays the answer no longer than this
ABORT_LANDING_WAIT = 1.0


def _write_settled(job) -> bool:
    """Whether a submitted KV write (the executor future of ``MooncakeTransfer.submit``) can no longer touch
    memory: never started, failed to submit, or every Mooncake batch of it completed or failed."""
    if not job.done():
        return False
    return job.cancelled() or job.exception() is not None or job.result().settled


async def run_blocking(executor: ThreadPoolExecutor, fn: Callable, *args):
    """Run ``fn`` on ``executor``. If the caller is cancelled while ``fn`` still waits in the executor's
    queue, ``fn`` never runs (an aborted request with many samples must not keep the model thread busy);
    if ``fn`` is already running, wait for it to finish before re-raising, so memory it touches (KV
    pages) is not released under it."""
    job = executor.submit(fn, *args)
    fut = asyncio.wrap_future(job)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        if job.cancel():  # not started: it never will
            raise
        while not fut.done():
            with contextlib.suppress(BaseException):
                await asyncio.shield(fut)
        raise


class EngineCore:
    """Owns the model thread, the KV page pool, the transfer engine and the bootstrap channel.

    Args:
        runner: the loaded model.
        args: parsed engine arguments (see pd.engines.args).
        metrics: where to record SGLang's metrics.
        spec: the draft and its settings when ``--speculative-algorithm`` is set: the prefill then also runs the
            draft on the prompt and ships its KV and state; the decode (or a ``null`` engine) drafts and verifies.
    """

    def __init__(self, runner: ModelRunner, args, metrics: EngineMetrics, spec: Optional[SpecDecoder] = None):
        self.runner = runner
        self.spec = spec  # speculative decoding (pd.engines.speculative), None when off
        self.args = args
        self.mode = args.disaggregation_mode
        self.metrics = metrics
        self.model_exec = ThreadPoolExecutor(1, thread_name_prefix="model")
        self.transfer_exec = ThreadPoolExecutor(4, thread_name_prefix="kv-transfer")
        self.pool: Optional[KVPagePool] = None
        self.draft_pool: Optional[KVPagePool] = None  # the draft's KV pages (speculative PD only)
        self.transfer: Optional[MooncakeTransfer] = None
        self.bootstrap: Optional[BootstrapServer] = None
        self.http: Optional[httpx.AsyncClient] = None
        self.sequences: set[Sequence] = set()
        self.decode_rooms: set[int] = set()
        self.quarantined = 0  # KV pages held for a write that may still be in flight (see _hold_pages)
        self._holds: set[asyncio.Task] = set()
        self.queued = 0
        self.running = 0

    # ---- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        """Allocate and register the KV pool, start the transfer engine and, on a prefill, the
        bootstrap server."""
        if self.mode == "null":
            return
        a = self.args
        self.pool = KVPagePool(self.runner.layout, a.page_size, a.max_total_tokens)
        self.transfer = MooncakeTransfer(a.transfer_host, a.disaggregation_transfer_protocol,
                                         a.disaggregation_ib_device or "")
        self.transfer.register(self.pool.base_addr, self.pool.total_bytes)
        if self.spec is not None:  # SGLang's PD registers the draft's KV pool next to the target's
            self.draft_pool = KVPagePool(self.spec.draft.layout, a.page_size, a.max_total_tokens)
            self.transfer.register(self.draft_pool.base_addr, self.draft_pool.total_bytes)
        self._update_pool_metrics()
        self.http = make_client(a.api_key)
        if self.mode == "prefill":
            self.bootstrap = BootstrapServer(
                a.host, a.disaggregation_bootstrap_port, a.waiting_timeout,
                tombstone_ttl=max(60.0, 2 * a.waiting_timeout), api_key=a.api_key,
                limits=RegistrationLimits(self.runner.context_length, self.pool.page_size,
                                          self.spec.config.num_draft_tokens if self.spec is not None else 0),
                on_refused_connection=lambda reason: self.metrics.connections_refused.labels(reason=reason).inc(),
            )
            await self.bootstrap.start()
        log.info("%s engine: KV pool %d pages x %d tokens (%.1f MB), transfer session %s",
                 self.mode, self.pool.num_pages, self.pool.page_size, self.pool.total_bytes / 1e6,
                 self.transfer.session_id)

    async def stop(self) -> None:
        """Cancel every running sequence (its client gets an error), wait up to 10 s for them, then stop the
        bootstrap and HTTP servers."""
        for seq in list(self.sequences):
            self.cancel(seq, "engine shutting down")
        tasks = [s.task for s in self.sequences if s.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=10)
        if self.bootstrap is not None:
            await self.bootstrap.stop()
        if self.http is not None:
            await self.http.aclose()
        self.model_exec.shutdown(wait=False, cancel_futures=True)
        self.transfer_exec.shutdown(wait=False, cancel_futures=True)

    # ---- admission ----------------------------------------------------------------------
    def validate(self, spec: SeqSpec) -> None:
        """Refuse a sequence before anything is held for it.

        Raises:
            EngineError: 400 for an empty/too-long prompt, bad sampling values, a PD request without
                bootstrap fields, or one whose KV can never fit the pool; 409 for a room already
                active here.
        """
        n = len(spec.prompt_ids)
        if n == 0:
            raise bad_request("the prompt is empty", "prompt")
        bad = [t for t in spec.prompt_ids if not 0 <= t < self.runner.vocab_size]
        if bad:
            raise bad_request(f"input_ids: token {bad[0]} is outside the vocabulary [0, {self.runner.vocab_size})",
                              "input_ids")
        spec.params.validate_for(self.runner.vocab_size)
        max_new = spec.params.max_new_tokens or 0
        ctx = self.runner.context_length
        if n + max_new >= ctx:
            raise bad_request(
                f"Requested token count exceeds the model's maximum context length of {ctx} tokens. "
                f"You requested a total of {n + max_new} tokens: {n} tokens from the input messages and "
                f"{max_new} tokens for the completion. Please reduce the number of tokens in the input "
                f"messages or the completion to fit within the limit.",
                "max_tokens",
            )
        if spec.top_logprobs_num < 0:
            raise bad_request("top_logprobs_num must be >= 0", "top_logprobs_num")
        if self.mode == "null":
            return
        b = spec.bootstrap
        if b is None:
            raise bad_request(
                f"Disaggregated request received without bootstrap room id (this engine runs with "
                f"--disaggregation-mode {self.mode}); send bootstrap_host, bootstrap_port and bootstrap_room",
                "bootstrap_room",
            )
        try:
            need = self.pool.pages_for(n)
            if need > self.pool.num_pages:
                raise PoolExhausted(f"{n} prompt tokens need {need} KV pages; the pool has {self.pool.num_pages}")
        except PoolExhausted as e:
            raise bad_request(str(e), "prompt") from None
        if self.mode == "decode":
            if not b.host or b.port is None:
                raise bad_request("bootstrap_host and bootstrap_port are required on a decode engine", "bootstrap_host")
            if b.room in self.decode_rooms:
                raise EngineError(409, f"bootstrap room {b.room} is already active on this decode", "bootstrap_room")
        else:
            if b.room in self.bootstrap.rooms and self.bootstrap.rooms[b.room].prefill_attached:
                raise EngineError(409, f"bootstrap room {b.room} is already active on this prefill", "bootstrap_room")
            aborted = self.bootstrap.tombstone_reason(b.room)
            if aborted is not None:
                raise EngineError(500, f"Prefill bootstrap failed for request rid={spec.rid!r} "
                                       f"bootstrap_room={b.room}: the room was aborted by the decode: {aborted}")

    def submit(self, specs: list[SeqSpec]) -> list[Sequence]:
        """Validate every sequence of a request, then start them all (all or nothing).

        Raises:
            EngineError: the first invalid sequence; nothing was started or held.
        """
        rooms = [s.bootstrap.room for s in specs if s.bootstrap is not None]
        if len(set(rooms)) != len(rooms):
            raise bad_request("bootstrap_room: every generated sequence needs its own room; the request repeats one",
                              "bootstrap_room")
        for spec in specs:
            self.validate(spec)
        seqs = []
        for spec in specs:
            seq = Sequence(spec, self.runner.eos_token_ids, self.runner.decode, self.runner.context_length)
            if self.mode == "decode":
                self.decode_rooms.add(spec.bootstrap.room)
            elif self.mode == "prefill":
                seq.room = self.bootstrap.attach(spec.bootstrap.room, lambda reason, s=seq: self.cancel(s, reason),
                                                 len(spec.prompt_ids))
            self.sequences.add(seq)
            seq.task = asyncio.get_running_loop().create_task(self._run(seq))
            seq.task.add_done_callback(lambda _t, s=seq: self._finalize(s))
            seqs.append(seq)
        return seqs

    def cancel(self, seq: Sequence, reason: str) -> None:
        """Abort a sequence (client disconnect, /abort_request, peer abort, shutdown)."""
        if seq.done or seq.task is None:
            return
        seq.abort_reason = seq.abort_reason or reason
        seq.task.cancel()

    def abort(self, rid: str | list[str] = "", abort_all: bool = False) -> int:
        """/abort_request: abort the sequences whose rid is exactly ``rid``, or one of the list ``rid`` (the
        router names all sequences of a request in one call), or all of them.

        SGLang also aborts every request whose id starts with ``rid``; that lets any client that can name
        a prefix (``"p"`` matches the router's ``pdr-...`` ids) abort other clients' requests, so here an
        id names one sequence only. Returns how many were aborted."""
        wanted = {rid} if isinstance(rid, str) else set(rid)
        wanted.discard("")
        hits = [s for s in self.sequences if abort_all or s.spec.rid in wanted]
        for s in hits:
            self.cancel(s, USER_ABORT)
        return len(hits)

    # ---- the sequence lifecycle ----------------------------------------------------------
    async def _run(self, seq: Sequence) -> None:
        try:
            if self.mode == "null":
                await self._run_null(seq)
            elif self.mode == "prefill":
                await self._run_prefill(seq)
            else:
                await self._run_decode(seq)
        except asyncio.CancelledError:
            self._set_aborted(seq)
        except RoomFailed as e:
            seq.fail(EngineError(500, f"{self.mode.capitalize()} transfer failed for request rid={seq.spec.rid!r} "
                                      f"bootstrap_room={seq.spec.bootstrap.room}: {e}"))
        except EngineError as e:
            seq.fail(e)
        except Exception as e:  # a bug or a model error: fail this request, keep serving
            log.exception("request %s failed", seq.spec.rid)
            seq.fail(EngineError(500, f"internal error: {e!r}"))

    def _set_aborted(self, seq: Sequence) -> None:
        reason = seq.abort_reason or "cancelled"
        self.metrics.observe_aborted("user" if reason == USER_ABORT else "peer")
        if reason == USER_ABORT:
            seq.finish({"type": "abort", "message": reason, "status_code": None})
        else:
            seq.fail(EngineError(500, reason))

    def _finalize(self, seq: Sequence) -> None:
        """Task done-callback: runs even when the task was cancelled before it started."""
        if not seq.done:
            self._set_aborted(seq)
        seq.cache = seq.spec_state = None
        self.sequences.discard(seq)
        if self.mode == "decode":
            self.decode_rooms.discard(seq.spec.bootstrap.room)
        room = seq.room
        if room is not None and self.bootstrap.rooms.get(room.room) is room:
            self.bootstrap.finish(room, None, seq.abort_reason or "prefill request ended")
        if seq.finish_time is None:
            seq.finish_time = time.perf_counter()
        if seq.error is None:  # every engine type, the PD prefill included, as SGLang's tokenizer does
            n_out = len(seq.output_ids)
            tpot = None
            if (self.mode != "prefill" and n_out > 1 and seq.first_token_time is not None
                    and (seq.finish_reason or {}).get("type") in ("stop", "length")):
                tpot = (seq.finish_time - seq.first_token_time) / (n_out - 1)
            self.metrics.observe_finished(seq.finish_time - seq.arrival, len(seq.spec.prompt_ids), n_out,
                                          bool(seq.spec.extra.get("stream")), tpot, seq.spec_verify_ct)
        seq.signal()

    async def _compute(self, fn: Callable, *args):
        return await run_blocking(self.model_exec, fn, *args)

    @contextlib.contextmanager
    def _gauge(self, gauge):
        gauge.labels(**self.metrics.labels).inc()
        try:
            yield
        finally:
            gauge.labels(**self.metrics.labels).dec()

    def _emit(self, seq: Sequence, token: int, lp: float, top: list) -> None:
        prev = seq.last_token_time
        seq.append(token, lp, top)
        if prev is None:
            if self.mode != "prefill":  # SGLang's PD prefill never observes TTFT
                self.metrics.observe_ttft(seq.first_token_time - seq.arrival, bool(seq.spec.extra.get("stream")))
        else:
            self.metrics.observe_itl(seq.last_token_time - prev)

    async def _run_null(self, seq: Sequence) -> None:
        with self._gauge(self.metrics.queued):
            first = await self._compute(self._prefill_forward, seq)
        with self._gauge(self.metrics.running):
            self._emit(seq, *first)
            await self._decode_loop(seq)

    async def _decode_loop(self, seq: Sequence) -> None:
        while not seq.done:
            if self.spec is None:
                self._emit(seq, *await self._compute(self._decode_forward, seq))
            else:
                self._emit_spec_step(seq, await self._compute(self._spec_step, seq))
        seq.finish(seq.finish_reason)

    def _emit_spec_step(self, seq: Sequence, step) -> None:
        """Emit one verify step's tokens in order until the sequence finishes (a stop id, stop string or
        max_new_tokens inside the accepted run drops the rest), and count it as SGLang does."""
        emitted = 0
        for tok in step.tokens:
            if seq.done:
                break
            self._emit(seq, *tok)
            emitted += 1
        seq.spec_verify_ct += 1
        seq.spec_draft_width = self.spec.config.num_draft_tokens - 1
        seq.spec_correct_drafts += min(emitted, step.accepted_drafts)
        self.metrics.observe_spec_step(step.accepted_drafts + 1, self.spec.config.num_draft_tokens - 1,
                                       step.draft_s, step.verify_s, step.extend_s, self.spec.config.num_steps)

    async def _run_prefill(self, seq: Sequence) -> None:
        b = seq.spec.bootstrap
        room = seq.room
        meta = None
        reason = None
        try:
            t0 = time.perf_counter()
            with self._gauge(self.metrics.prefill_bootstrap_queue):
                reg = await self.bootstrap.wait_registration(room, self.args.bootstrap_timeout)
            self._check_registration(reg, seq)
            t1 = time.perf_counter()
            self.metrics.observe_stage("prefill_bootstrap", t1 - t0)
            pages = await self.pool.alloc(len(seq.spec.prompt_ids))
            self._update_pool_metrics()
            draft_pages: list[int] = []
            try:
                if self.draft_pool is not None:
                    draft_pages = await self.draft_pool.alloc(len(seq.spec.prompt_ids))
                    self._update_pool_metrics()
                with self._gauge(self.metrics.queued):
                    # The forward stores the prompt's KV into the pool pages, as SGLang's attention
                    # backends do (set_kv_buffer); the transfer then reads the pages as they are.
                    first = await self._compute(self._prefill_forward, seq, pages, draft_pages)
                t2 = time.perf_counter()
                self.metrics.observe_stage("prefill_forward", t2 - t1)
                with self._gauge(self.metrics.running):
                    nbytes = await self._push_kv(pages, reg, room, draft_pages)
            finally:
                held = [(self.pool, pages)] + ([(self.draft_pool, draft_pages)] if draft_pages else [])
                if room.write is not None:  # Mooncake may still read them: they go back once the write settles
                    self._hold_pages(held, self._write_settles(room))
                else:
                    for pool, p in held:
                        pool.free(p)
                self._update_pool_metrics()
            t3 = time.perf_counter()
            self.metrics.observe_stage("prefill_transfer_kv_cache", t3 - t2)
            self.metrics.observe_transfer(nbytes, t3 - t2)
            token, lp, top = first
            meta = {"first_token": {"id": token, "logprob": lp, "top": top}, "cached_tokens": 0, "bytes": nbytes}
            if self.spec is not None:
                meta["spec"] = self._spec_metadata(seq)
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
            raise EngineError(500, f"Prefill transfer failed for request rid={seq.spec.rid!r} "
                                   f"bootstrap_room={b.room}: {e}") from None
        except BaseException as e:
            reason = f"prefill failed: {e}"
            raise
        finally:
            self.bootstrap.finish(room, meta, reason)

    def _check_registration(self, reg: Registration, seq: Sequence) -> None:
        problem = self._spec_mismatch(reg) or self._layout_mismatch(reg, seq)
        if problem:
            raise RoomFailed(problem)

    def _layout_mismatch(self, reg: Registration, seq: Sequence) -> Optional[str]:
        ours = asdict(self.runner.layout)
        n = len(seq.spec.prompt_ids)
        if reg.layout != ours or reg.page_size != self.pool.page_size or reg.page_bytes != self.pool.page_bytes:
            return (f"KV layout mismatch: decode has {reg.layout} page_size={reg.page_size}, prefill has {ours} "
                    f"page_size={self.pool.page_size} (--page-size and the model must match on both sides)")
        need = self.pool.pages_for(n)
        if reg.num_tokens != n or len(reg.page_addrs) < need or (self.spec and len(reg.draft_page_addrs) < need):
            return (f"prompt mismatch: decode expects {reg.num_tokens} tokens in {len(reg.page_addrs)} pages, "
                    f"prefill tokenized {n} (were both sides sent the same request?)")
        return None

    async def _push_kv(self, pages: list[int], reg: Registration, room, draft_pages: list[int] = ()) -> int:
        """Write our pages (and the draft's, with speculation) into the decode's registered pages in one batch;
        returns bytes moved."""
        room.no_transfer_in_flight.clear()
        try:
            src = [self.pool.page_addr(p) for p in pages]
            dst = reg.page_addrs[: len(pages)]
            segs = coalesce(src, dst, self.pool.page_bytes)
            nbytes = len(pages) * self.pool.page_bytes
            if draft_pages:
                dsegs = coalesce([self.draft_pool.page_addr(p) for p in draft_pages],
                                 reg.draft_page_addrs[: len(draft_pages)], self.draft_pool.page_bytes)
                segs = tuple(a + b for a, b in zip(segs, dsegs))
                nbytes += len(draft_pages) * self.draft_pool.page_bytes
            await self._write_kv(reg.session_id, segs, room)
            return nbytes
        finally:
            if room.write is None:  # else an abandoned write still runs: _write_settles ends it
                room.no_transfer_in_flight.set()

    async def _write_kv(self, peer: str, segs: tuple[list[int], list[int], list[int]], room) -> None:
        """Write ``segs`` (src addresses, dst addresses, lengths) into the peer's pages within the transfer deadline.

        ``--disaggregation-transfer-timeout`` plus Mooncake's 1 ns per byte bounds the write, its first handshake
        with the peer included. Mooncake cannot cancel a write, so while it may still read the source pages
        (the deadline passed, or the request was cancelled) ``room.write`` stays set: the caller then frees the
        pages through ``_hold_pages`` once ``_write_settles``.

        Raises:
            TransferError: the write failed or missed its deadline.
        """
        nbytes = sum(segs[2])
        timeout = write_deadline(self.args.transfer_timeout, nbytes)
        room.write = self.transfer_exec.submit(self.transfer.submit, peer, *segs)
        try:
            async with asyncio.timeout(timeout):
                write = await asyncio.wrap_future(room.write)
                delay = WRITE_POLL_MIN
                while (ok := write.poll()) is None:
                    await asyncio.sleep(delay)
                    delay = min(2 * delay, WRITE_POLL_MAX)
        except TimeoutError:
            raise TransferError(f"the KV write of {nbytes} bytes to {peer} did not complete within {timeout:g}s "
                                "(--disaggregation-transfer-timeout): the decode is hung or unreachable") from None
        finally:
            if _write_settled(room.write):
                self.bootstrap.write_settled(room)
        if not ok:
            raise TransferError(f"the transfer engine reported the KV write of {nbytes} bytes to {peer} failed")

    async def _write_settles(self, room) -> None:
        """Wait until the room's abandoned KV write settles (Mooncake reports it completed or failed), then let the
        decode's pending /pd/abort answer. Mooncake's own timeouts end it (pd.engines.transfer); one that outlives
        them by far is logged, and its pages stay held: freeing them under a running write could corrupt KV."""
        job, waited, warn_after = room.write, 0.0, 4 * self.args.transfer_timeout
        while not _write_settled(job):
            if job.done():
                job.result().poll()
                if job.result().settled:
                    break
            await asyncio.sleep(WRITE_POLL_MAX)
            waited += WRITE_POLL_MAX
            if warn_after is not None and waited >= warn_after:
                log.warning("an abandoned KV write of bootstrap room %s is still unsettled after %.0fs; its pages "
                            "stay held until the transfer engine reports it", room.room, waited)
                warn_after = None
        self.bootstrap.write_settled(room)

    def _hold_pages(self, held: list[tuple[KVPagePool, list[int]]], until) -> asyncio.Task:
        """Keep each ``(pool, pages)`` of ``held`` out of its pool (counted in pdserve_kv_pages_quarantined) until
        the coroutine ``until`` ends, then free them; the request that held them need not wait. Returns the task
        that frees them."""
        count = sum(len(p) for _, p in held)
        self.quarantined += count
        self.metrics.pages_quarantined.labels(**self.metrics.labels).set(self.quarantined)

        async def release() -> None:
            try:
                await until
            except Exception as e:  # the pages go back whatever happened (engine stopping: client closed)
                log.info("releasing %d held KV pages after %r", count, e)
            finally:
                for pool, pages in held:
                    pool.free(pages)
                self.quarantined -= count
                self.metrics.pages_quarantined.labels(**self.metrics.labels).set(self.quarantined)
                self._update_pool_metrics()

        task = asyncio.get_running_loop().create_task(release())
        self._holds.add(task)
        task.add_done_callback(self._holds.discard)
        return task

    async def _run_decode(self, seq: Sequence) -> None:
        b = seq.spec.bootstrap
        n = len(seq.spec.prompt_ids)
        pages: list[int] = []
        draft_pages: list[int] = []
        kv_arrived = False
        # With speculation the decode also holds the verify window's pages, in both caches.
        tokens = n + (self.spec.config.num_draft_tokens if self.spec is not None else 0)
        try:
            t0 = time.perf_counter()
            with self._gauge(self.metrics.decode_prealloc_queue):
                try:
                    async with asyncio.timeout(self.args.waiting_timeout):
                        pages = await self.pool.alloc(tokens)
                        if self.draft_pool is not None:
                            draft_pages = await self.draft_pool.alloc(tokens)
                except TimeoutError:
                    raise RoomFailed(f"no free KV pages for {n} tokens within {self.args.waiting_timeout:g}s") from None
            self._update_pool_metrics()
            t1 = time.perf_counter()
            self.metrics.observe_stage("decode_bootstrap", t1 - t0)
            reg = Registration(
                room=b.room, session_id=self.transfer.session_id,
                page_addrs=[self.pool.page_addr(p) for p in pages], page_bytes=self.pool.page_bytes,
                page_size=self.pool.page_size, layout=asdict(self.runner.layout), num_tokens=n,
                **self._spec_registration(draft_pages),
            )
            with self._gauge(self.metrics.decode_transfer_queue):
                try:
                    meta = await register_with_prefill(self.http, b.host, b.port, reg, self.args.waiting_timeout)
                except RoomFailed:
                    self.metrics.transfer_failed.labels(**self.metrics.labels).inc()
                    raise
            kv_arrived = True
            t2 = time.perf_counter()
            self.metrics.observe_stage("decode_transferred", t2 - t1)
            self.metrics.transfer_bytes.labels(**self.metrics.labels).inc(meta.get("bytes", 0))
            with self._gauge(self.metrics.queued):
                seq.cache = await self._compute(self.runner.import_kv, self.pool.pages, pages, n)
                if self.spec is not None:
                    seq.spec_state = await self._compute(self._restore_spec, meta, draft_pages, n)
            self.metrics.observe_stage("decode_waiting", time.perf_counter() - t2)
            seq.cached_tokens = int(meta.get("cached_tokens", 0))
            first = meta["first_token"]
            with self._gauge(self.metrics.running):
                self._emit(seq, int(first["id"]), first["logprob"], [tuple(t) for t in first["top"]])
                await self._decode_loop(seq)
        finally:
            if pages:
                held = [(self.pool, pages)] + ([(self.draft_pool, draft_pages)] if draft_pages else [])
                if kv_arrived:
                    for pool, p in held:
                        pool.free(p)
                    self._update_pool_metrics()
                else:
                    # The prefill may be writing into these pages: they go back once it says no write is in flight
                    # (or after SGLang's deferred KV release timeout); this request answers once the abort landed.
                    abort = abort_on_prefill(self.http, b.host, b.port, b.room, seq.abort_reason or "decode failed",
                                             self.args.kv_release_timeout)
                    releasing = self._hold_pages(held, abort)
                    await asyncio.wait({releasing}, timeout=ABORT_LANDING_WAIT)

    # ---- speculative decoding: the PD handoff (pd.engines.speculative has the loop) -----------
    def _spec_registration(self, draft_pages: list[int]) -> dict:
        """The registration fields a speculative decode adds: where the draft's KV goes and its settings."""
        if self.spec is None:
            return {}
        return {"draft_page_addrs": [self.draft_pool.page_addr(p) for p in draft_pages],
                "draft_page_bytes": self.draft_pool.page_bytes, "draft_layout": asdict(self.spec.draft.layout),
                "speculative": self.spec.config.handshake()}

    def _spec_mismatch(self, reg: Registration) -> Optional[str]:
        """Why the decode's speculative settings differ from ours (both sides must run the same draft with
        the same window), or None."""
        ours = self.spec.config.handshake() if self.spec is not None else None
        if reg.speculative != ours:
            mine = self.spec.config.flags() if self.spec is not None else "no speculative decoding"
            try:
                theirs = SpecConfig(**reg.speculative, draft_model_path=None).flags()
            except TypeError:
                theirs = "no speculative decoding" if reg.speculative is None else repr(reg.speculative)
            return (f"speculative settings mismatch: decode has {theirs}, prefill has {mine} (set the same "
                    "--speculative-* flags on both sides)")
        if self.spec is not None and (reg.draft_layout != asdict(self.spec.draft.layout)
                                      or reg.draft_page_bytes != self.draft_pool.page_bytes):
            return (f"draft KV layout mismatch: decode has {reg.draft_layout}, prefill has "
                    f"{asdict(self.spec.draft.layout)} (both sides need the same --speculative-draft-model-path)")
        return None

    def _spec_metadata(self, seq: Sequence) -> dict:
        """What SGLang's PD prefill puts in its aux buffer for speculation (sglang/srt/disaggregation/utils.py,
        MetadataBuffers: output_hidden_states, output_topk_p, output_topk_index)."""
        state = seq.spec_state
        topk_p, topk_index = self.spec.topk(state)
        return {"hidden": state.hidden.tolist(), "topk_p": topk_p, "topk_index": topk_index}

    def _restore_spec(self, meta: dict, draft_pages: list[int], n: int):
        try:
            sm = meta["spec"]
            cache = self.spec.draft.import_kv(self.draft_pool.pages, draft_pages, n)
            return self.spec.restore(cache, sm["hidden"], sm["topk_index"])
        except (KeyError, TypeError, ValueError) as e:
            raise RoomFailed(f"bad speculative metadata from the prefill: {e}") from None

    def _spec_step(self, seq: Sequence):
        return self.spec.step(seq, seq.spec_state, seq.cache, lambda row, tok: self._logprob_entry(seq, row, tok))

    # ---- model-thread work ---------------------------------------------------------------
    def _select(self, seq: Sequence, logits: torch.Tensor, step: int) -> tuple[int, float, list]:
        spec = seq.spec
        token = sample(logits, spec.params, spec.seed, step, seq.banned_tokens(step), seq.output_ids)
        return self._logprob_entry(seq, logits, token)

    def _logprob_entry(self, seq: Sequence, logits: torch.Tensor, token: int) -> tuple[int, float, list]:
        """``(token, logprob, top)`` of a chosen token: the raw log-softmax of ``logits`` [vocab] and, with
        ``top_logprobs_num``, its best entries."""
        spec = seq.spec
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        top = []
        if spec.top_logprobs_num > 0:
            vals, ids = torch.topk(logprobs, min(spec.top_logprobs_num, logprobs.numel()))
            top = [(float(v), int(i)) for v, i in zip(vals, ids)]
        return token, float(logprobs[token]), top

    def _prefill_forward(self, seq: Sequence, pages: Optional[list[int]] = None,
                         draft_pages: Optional[list[int]] = None) -> tuple[int, float, list]:
        """Prompt forward (+ store its KV into ``pages`` on a prefill); returns the first token. With
        speculation the draft then runs on the prompt (draft extend) and its KV goes into ``draft_pages``."""
        spec = seq.spec
        seq.cache = self.runner.new_cache()
        logits, hidden = self.runner.forward_hidden(spec.prompt_ids, seq.cache)
        if pages is not None:
            self.runner.export_kv(seq.cache, self.pool.pages, pages, len(spec.prompt_ids))
        first = self._select(seq, logits[-1], 0)
        if self.spec is not None:
            seq.spec_state = self.spec.extend_prompt(spec.prompt_ids, hidden, first[0])
            if draft_pages:
                self.spec.draft.export_kv(seq.spec_state.draft_cache, self.draft_pool.pages, draft_pages,
                                          len(spec.prompt_ids))
        if spec.return_logprob and spec.logprob_start_len >= 0:
            ids = spec.prompt_ids
            logprobs = torch.log_softmax(logits, dim=-1)
            for pos in range(spec.logprob_start_len, len(ids)):
                if pos == 0:
                    seq.input_logprobs.append((None, ids[0]))
                    seq.input_top.append(None)
                    continue
                row = logprobs[pos - 1]
                seq.input_logprobs.append((float(row[ids[pos]]), ids[pos]))
                if spec.top_logprobs_num > 0:
                    vals, top_ids = torch.topk(row, min(spec.top_logprobs_num, row.numel()))
                    seq.input_top.append([(float(v), int(i)) for v, i in zip(vals, top_ids)])
                else:
                    seq.input_top.append(None)
        return first

    def _decode_forward(self, seq: Sequence) -> tuple[int, float, list]:
        logits = self.runner.forward([seq.output_ids[-1]], seq.cache)
        return self._select(seq, logits[-1], len(seq.output_ids))

    async def health_generate(self) -> int:
        """One greedy token from a one-token prompt, queued on the model thread behind real work
        (SGLang's /health_generate sends input_ids=[0], max_new_tokens=1)."""

        def one_token() -> int:
            logits = self.runner.forward([0], self.runner.new_cache())
            return int(torch.argmax(logits[-1]))

        return await self._compute(one_token)

    def _update_pool_metrics(self) -> None:
        if self.pool is not None:
            self.metrics.set_pool(self.pool.held, self.pool.num_pages, self.pool.page_size)
        if self.draft_pool is not None:
            self.metrics.set_draft_pool(self.draft_pool.held)
