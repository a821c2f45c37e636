"""The prefill's side of the KV handoff: write a prompt's KV pages into the decode's registered pages with the
Mooncake transfer engine, within a deadline, and know when an abandoned write can no longer touch memory.

Mooncake cannot cancel a write. A write that missed its deadline, or whose request was cancelled, may still read
the source pages: ``room.write`` then stays set, the caller keeps the pages out of the pool (``HeldPages``) until
``settled`` returns, and only then does the decode's pending /pd/abort answer (pd.engines.handoff.bootstrap).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

from pd.engines.handoff.bootstrap import BootstrapServer, Registration
from pd.engines.handoff.kv_pool import KVPagePool
from pd.engines.handoff.transfer import MooncakeTransfer, TransferError, coalesce, write_deadline

log = logging.getLogger(__name__)

WRITE_POLL_MIN, WRITE_POLL_MAX = 0.0005, 0.02  # s between polls of a KV write (a local write takes ~1 ms)


def write_settled(job: Optional[Future]) -> bool:
    """Whether a submitted KV write (the executor future of ``MooncakeTransfer.submit``) can no longer touch
    memory: never started, failed to submit, or every Mooncake batch of it completed or failed."""
    if job is None or not job.done():
        return job is None
    return job.cancelled() or job.exception() is not None or job.result().settled


class KVWriter:
    """Writes prompts' KV from this prefill's pools into decodes' pages.

    Args:
        transfer: this engine's transfer engine, the pools registered with it.
        executor: threads that submit writes (a submit blocks on Mooncake's first handshake with a peer).
        bootstrap: the prefill's bootstrap server, told when a room's write settles.
        transfer_timeout: ``--disaggregation-transfer-timeout`` in seconds (Mooncake adds 1 ns per byte).
    """

    def __init__(self, transfer: MooncakeTransfer, executor: ThreadPoolExecutor, bootstrap: BootstrapServer,
                 transfer_timeout: float):
        self.transfer = transfer
        self.executor = executor
        self.bootstrap = bootstrap
        self.transfer_timeout = transfer_timeout

    async def push(self, pool: KVPagePool, pages: list[int], reg: Registration, room,
                   draft_pool: Optional[KVPagePool] = None, draft_pages: Sequence[int] = ()) -> int:
        """Write the prompt's ``pages`` of ``pool`` (and the draft's, with speculation), in prompt order, into the
        decode's registered pages in one batch; returns the bytes moved.

        The decode registers pages only past the prefix it already holds (``reg.decode_prefix_len`` tokens, whole
        pages): the pages before it are not written.

        Raises:
            TransferError: the write failed or missed its deadline.
        """
        skip = reg.decode_prefix_len // pool.page_size
        pages, draft_pages = pages[skip:], draft_pages[skip:]
        room.no_transfer_in_flight.clear()
        try:
            # (src addresses, dst addresses, lengths), the draft's appended to each
            segs: tuple[list[int], ...] = coalesce([pool.page_addr(p) for p in pages], reg.page_addrs[: len(pages)],
                                                   pool.page_bytes)
            nbytes = len(pages) * pool.page_bytes
            if draft_pages:
                assert draft_pool is not None
                dsegs = coalesce([draft_pool.page_addr(p) for p in draft_pages],
                                 reg.draft_page_addrs[: len(draft_pages)], draft_pool.page_bytes)
                segs = tuple(a + b for a, b in zip(segs, dsegs))
                nbytes += len(draft_pages) * draft_pool.page_bytes
            await self._write(reg.session_id, segs, room)
            return nbytes
        finally:
            if room.write is None:  # else an abandoned write still runs: settled() ends it
                room.no_transfer_in_flight.set()

    async def _write(self, peer: str, segs: tuple[list[int], ...], room) -> None:
        """Write ``segs`` (src addresses, dst addresses, lengths) into the peer's pages within the transfer
        deadline, the first handshake with the peer included.

        Raises:
            TransferError: the write failed or missed its deadline.
        """
        nbytes = sum(segs[2])
        timeout = write_deadline(self.transfer_timeout, nbytes)
        room.write = self.executor.submit(self.transfer.submit, peer, *segs)
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
            if write_settled(room.write):
                self.bootstrap.write_settled(room)
        if not ok:
            raise TransferError(f"the transfer engine reported the KV write of {nbytes} bytes to {peer} failed")

    async def settled(self, room) -> None:
        """Wait until the room's abandoned KV write settles (Mooncake reports it completed or failed), then let the
        decode's pending /pd/abort answer. Mooncake's own timeouts end it (pd.engines.handoff.transfer); one that
        outlives them by far is logged, and its pages stay held: freeing them under a running write could corrupt
        KV."""
        job, waited = room.write, 0.0
        warn_after: Optional[float] = 4 * self.transfer_timeout  # None once warned
        while not write_settled(job):
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
