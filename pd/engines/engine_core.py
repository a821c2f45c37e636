"""The reference engine's core: runs each generated sequence through its mode's lifecycle.

Modes (SGLang's ``--disaggregation-mode``): ``null`` runs the prompt forward and then the decode steps, all
here (this class); ``prefill`` and ``decode`` are subclasses (pd.engines.handoff.prefill_engine,
pd.engines.handoff.decode_engine) that override ``start``, ``_serve`` and the per-sequence ``_admit`` /
``_release``; the server picks one by mode (``pd.engines.api.server.CORES``).

All model work runs on one thread, one sequence at a time (pd.engines.model_steps). Every path releases its KV
pages, including cancellation (client disconnect, /abort_request, peer abort).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable, Optional, TypeVar

from pd.engines.admission import validate_request
from pd.engines.errors import EngineError, bad_request
from pd.engines.handoff.bootstrap import RoomFailed
from pd.engines.handoff.held_pages import HeldPages
from pd.engines.handoff.kv_pool import KVPagePool
from pd.engines.metrics import EngineMetrics
from pd.engines.model_steps import ModelSteps, run_blocking
from pd.engines.models.model_runner import ModelRunner
from pd.engines.prefix.kv_events import KVEventPublisher, KVEventsConfig
from pd.engines.prefix.prefix_pages import Hit, PrefixCache
from pd.engines.prefix.radix_cache import Cleared, Removed, Stored
from pd.engines.protocol import SeqRequest
from pd.engines.sequence import Sequence
from pd.engines.settings import ResolvedSettings
from pd.engines.spec.decoder import SpecDecoder, StepResult

if TYPE_CHECKING:
    import httpx

    from pd.engines.handoff.bootstrap import BootstrapServer
    from pd.engines.handoff.kv_write import KVWriter
    from pd.engines.handoff.transfer import MooncakeTransfer

log = logging.getLogger(__name__)

USER_ABORT = "Aborted"

T = TypeVar("T")


def started(value: Optional[T], what: str) -> T:
    """``value``, which the engine core's ``start`` sets (``what`` names it).

    Raises:
        RuntimeError: ``value`` is still None: ``start`` has not run (or does not set it in this mode).
    """
    if value is None:
        raise RuntimeError(f"the engine core has no {what}: its start() has not run")
    return value


class EngineCore:
    """Owns the model thread, the KV page pool, the transfer engine and the bootstrap channel.

    Args:
        runner: the loaded model.
        args: the engine's resolved settings (pd.engines.settings.ResolvedSettings).
        metrics: where to record SGLang's metrics.
        spec: the draft and its settings when ``--speculative-algorithm`` is set: the prefill then also runs the
            draft on the prompt and ships its KV and state; the decode (or a ``null`` engine) drafts and verifies.
    """

    def __init__(self, runner: ModelRunner, args: ResolvedSettings, metrics: EngineMetrics,
                 spec: Optional[SpecDecoder] = None):
        self.runner = runner
        self.spec = spec  # speculative decoding (pd.engines.spec.decoder), None when off
        self.args = args
        self.mode = args.disaggregation_mode
        self.metrics = metrics
        self.steps = ModelSteps(runner, spec)
        self.model_exec = ThreadPoolExecutor(1, thread_name_prefix="model")
        self.transfer_exec = ThreadPoolExecutor(4, thread_name_prefix="kv-transfer")
        self.pool: Optional[KVPagePool] = None
        self.draft_pool: Optional[KVPagePool] = None  # the draft's KV pages (speculative PD only)
        self.prefix: Optional[PrefixCache] = None  # the radix prefix cache (null, prefill; decode with its flag)
        self.events: Optional[KVEventPublisher] = None  # its KV events (--kv-events-config)
        self.transfer: Optional[MooncakeTransfer] = None
        self.bootstrap: Optional[BootstrapServer] = None
        self.writer: Optional[KVWriter] = None  # the prefill's KV writes
        self.http: Optional[httpx.AsyncClient] = None  # to the peer's bootstrap server
        self.sequences: set[Sequence] = set()
        self.decode_rooms: set[int] = set()
        self.held = HeldPages(self._held_changed)  # KV pages a transfer may still touch
        self.queued = 0
        self.running = 0

    # ---- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        """Start what the mode needs beyond the model: a ``null`` engine, the KV pool of its prefix cache."""
        if self.spec is None and not self.args.disable_radix_cache:
            self.pool = KVPagePool(self.runner.layout, self.args.page_size, self.args.max_total_tokens)
            self._start_prefix_cache(self.pool)

    def _start_prefix_cache(self, pool: KVPagePool) -> None:
        """The radix prefix cache over ``pool`` (off with speculative decoding: pd.engines.prefix.prefix_pages), and
        its KV events publisher when ``--kv-events-config`` asks for one."""
        if self.args.kv_events_config:
            self.events = KVEventPublisher.from_config(KVEventsConfig.from_cli(self.args.kv_events_config))
        self.prefix = PrefixCache(pool, disable=self.args.disable_radix_cache or self.spec is not None,
                                  on_event=self._publish if self.events is not None else None)

    def _publish(self, event: Stored | Removed | Cleared) -> None:
        """One radix cache event out as a KV event batch (never blocks: the publisher queues it)."""
        if self.events is not None:
            self.events.publish([event])

    def kv_events_source(self) -> Optional[dict]:
        """Where a router subscribes to this engine's KV events, as SGLang's /server_info ``kv_events`` block
        describes it (sglang/srt/runtime_context.py, ``describe_kv_events_publisher``); None when none are
        published. A wildcard host means the engine's own address."""
        if self.events is None or self.prefix is None:
            return None
        host, _, port = self.events.endpoint.removeprefix("tcp://").rpartition(":")
        source = {"publisher": "zmq", "endpoint_host": host, "endpoint_port_base": int(port),
                  "topic": self.events.topic, "block_size": self.prefix.pool.page_size, "dp_size": 1}
        if self.events.replay_endpoint is not None:
            source["replay_endpoint_port_base"] = int(self.events.replay_endpoint.rpartition(":")[2])
        return source

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
        if self.events is not None:
            self.events.close()

    # ---- admission ----------------------------------------------------------------------
    def validate(self, req: SeqRequest) -> None:
        """Refuse a sequence before anything is held for it (pd.engines.admission.validate_request).

        Raises:
            EngineError: 4xx naming the bad field, 409 for a room already active here.
        """
        validate_request(req, self.runner, self.mode, self.pool, self.bootstrap, self.decode_rooms)

    def submit(self, reqs: list[SeqRequest]) -> list[Sequence]:
        """Validate every sequence of a request, then start them all (all or nothing).

        Raises:
            EngineError: the first invalid sequence; nothing was started or held.
        """
        rooms = [r.bootstrap.room for r in reqs if r.bootstrap is not None]
        if len(set(rooms)) != len(rooms):
            raise bad_request("bootstrap_room: every generated sequence needs its own room; the request repeats one",
                              "bootstrap_room")
        for req in reqs:
            self.validate(req)
        seqs = []
        for req in reqs:
            seq = Sequence(req, self.runner.eos_token_ids, self.runner.decode, self.runner.context_length)
            self._admit(seq)
            self.sequences.add(seq)
            seq.task = asyncio.get_running_loop().create_task(self._run(seq))
            seq.task.add_done_callback(functools.partial(self._finalize, seq))
            seqs.append(seq)
        return seqs

    def _admit(self, seq: Sequence) -> None:
        """Claim what the mode keeps per sequence (its bootstrap room) once every sequence is valid."""

    def _release(self, seq: Sequence) -> None:
        """Give back what ``_admit`` claimed; runs once per sequence, however it ended."""

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
        hits = [s for s in self.sequences if abort_all or s.req.rid in wanted]
        for s in hits:
            self.cancel(s, USER_ABORT)
        return len(hits)

    # ---- the sequence lifecycle ----------------------------------------------------------
    async def _run(self, seq: Sequence) -> None:
        try:
            await self._serve(seq)
        except asyncio.CancelledError:
            self._set_aborted(seq)
        except RoomFailed as e:
            b = seq.req.bootstrap
            assert b is not None  # rooms fail in the PD modes only, which refuse a request without one
            seq.fail(EngineError(500, f"{self.mode.capitalize()} transfer failed for request rid={seq.req.rid!r} "
                                      f"bootstrap_room={b.room}: {e}"))
        except EngineError as e:
            seq.fail(e)
        except Exception as e:  # a bug or a model error: fail this request, keep serving
            log.exception("request %s failed", seq.req.rid)
            seq.fail(EngineError(500, f"internal error: {e!r}"))

    def _set_aborted(self, seq: Sequence) -> None:
        reason = seq.abort_reason or "cancelled"
        self.metrics.observe_aborted("user" if reason == USER_ABORT else "peer")
        if reason == USER_ABORT:
            seq.finish({"type": "abort", "message": reason, "status_code": None})
        else:
            seq.fail(EngineError(500, reason))

    def _finalize(self, seq: Sequence, _task: asyncio.Task) -> None:
        """``seq``'s task's done-callback: runs even when the task was cancelled before it started."""
        if not seq.done:
            self._set_aborted(seq)
        seq.cache = seq.spec_state = None
        self.sequences.discard(seq)
        self._release(seq)
        if seq.finish_time is None:
            seq.finish_time = time.perf_counter()
        if seq.error is None:  # every engine type, the PD prefill included, as SGLang's tokenizer does
            n_out = len(seq.output_ids)
            tpot = None
            if (self.mode != "prefill" and n_out > 1 and seq.first_token_time is not None
                    and (seq.finish_reason or {}).get("type") in ("stop", "length")):
                tpot = (seq.finish_time - seq.first_token_time) / (n_out - 1)
            self.metrics.observe_finished(seq.finish_time - seq.arrival, len(seq.req.prompt_ids), n_out,
                                          bool(seq.req.extra.get("stream")), tpot, seq.spec_verify_ct)
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
        assert seq.first_token_time is not None and seq.last_token_time is not None  # append sets both
        if prev is None:
            if self.mode != "prefill":  # SGLang's PD prefill never observes TTFT
                self.metrics.observe_ttft(seq.first_token_time - seq.arrival, bool(seq.req.extra.get("stream")))
        else:
            self.metrics.observe_itl(seq.last_token_time - prev)

    async def _serve(self, seq: Sequence) -> None:
        """Run one sequence through the mode's lifecycle; a ``null`` engine: prefill, then decode, here."""
        with self._gauge(self.metrics.queued):
            if self.prefix is None:
                first = await self._compute(self.steps.prefill_forward, seq)
            else:
                first = await self._prefill_cached(seq, self.prefix)
        with self._gauge(self.metrics.running):
            self._emit(seq, *first)
            await self._decode_loop(seq)

    async def _decode_loop(self, seq: Sequence) -> None:
        while not seq.done:
            if self.spec is None:
                self._emit(seq, *await self._compute(self.steps.decode_forward, seq))
            else:
                self._emit_spec_step(seq, await self._compute(self.steps.spec_step, seq), self.spec)
        seq.finish(seq.finish_reason)

    def _emit_spec_step(self, seq: Sequence, step: StepResult, spec: SpecDecoder) -> None:
        """Emit one verify step's tokens in order until the sequence finishes (a stop id, stop string or
        max_new_tokens inside the accepted run drops the rest), and count it as SGLang does."""
        emitted = 0
        for tok in step.tokens:
            if seq.done:
                break
            self._emit(seq, *tok)
            emitted += 1
        seq.spec_verify_ct += 1
        seq.spec_draft_width = spec.config.num_draft_tokens - 1
        seq.spec_correct_drafts += min(emitted, step.accepted_drafts)
        self.metrics.observe_spec_step(step.accepted_drafts + 1, step.num_steps,  # the step's own depth (adaptive)
                                       step.draft_s, step.verify_s, step.extend_s, step.num_steps)

    async def health_generate(self) -> int:
        """One greedy token from a one-token prompt, queued on the model thread behind real work
        (SGLang's /health_generate sends input_ids=[0], max_new_tokens=1)."""
        return await self._compute(self.steps.health_token)

    async def _prefill_cached(self, seq: Sequence, prefix: PrefixCache):
        """The prompt forward through the prefix cache: the cached pages read, the rest computed into new pages,
        the prompt's whole pages kept for the next request (a ``null`` engine's prefill)."""
        hit = prefix.match(seq.req)
        pages: list[int] = []
        try:
            pages = await prefix.alloc(hit, len(seq.req.prompt_ids))
            self.update_pool_metrics()
            first = await self._compute(self.steps.prefill_forward, seq, (prefix.pool, pages), None, hit.cached)
        except BaseException:
            prefix.drop(hit, pages) if pages else prefix.unlock(hit)
            self.update_pool_metrics()
            raise
        prefix.finish(hit, seq.req.prompt_ids, pages)
        self._observe_hit(seq, hit)
        return first

    def _observe_hit(self, seq: Sequence, hit: Hit) -> None:
        """Report a prefix cache hit as SGLang does: ``meta_info.cached_tokens`` and ``sglang:cache_hit_rate``
        (cached over prompt tokens of this prefill)."""
        seq.cached_tokens = hit.cached
        self.metrics.cache_hit_rate.labels(**self.metrics.labels).set(hit.cached / len(seq.req.prompt_ids))
        self.update_pool_metrics()

    def _held_changed(self, count: int) -> None:
        self.metrics.pages_quarantined.labels(**self.metrics.labels).set(count)
        self.update_pool_metrics()

    def update_pool_metrics(self) -> None:
        """Publish the pools' occupancy (pages held by requests, pages the prefix cache keeps unused)."""
        if self.pool is not None:
            cached = self.prefix.cached_pages() if self.prefix is not None else 0
            self.metrics.set_pool(self.pool.held - cached, self.pool.num_pages, self.pool.page_size, cached)
        if self.draft_pool is not None:
            self.metrics.set_draft_pool(self.draft_pool.held)
