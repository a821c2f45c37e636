"""KV transfer through the Mooncake transfer engine (push from prefill to decode).

Uses ``mooncake.engine.TransferEngine`` in P2P-handshake mode, as SGLang's Mooncake backend does
(sglang/srt/disaggregation/mooncake/transfer_engine.py): each side initialises its own engine,
registers its KV pool, and is addressed by the session id ``"host:rpc_port"``.

A write is submitted without blocking (``transfer_submit_write``, one Mooncake batch per coalesced
segment) and polled (``transfer_check_status``), so the caller bounds it with its own deadline.
``batch_transfer_sync_write`` would instead hold a thread, spinning, for Mooncake's own timeout
(``MC_TRANSFER_TIMEOUT``, 30 s), and the batched status call ``get_batch_transfer_status`` blocks
the same way. Mooncake cannot cancel a submitted write: a write abandoned at its deadline keeps
reading the source pages until Mooncake reports it completed or failed (its TCP transport drops a
connection without progress after ``MC_TCP_PROGRESS_TIMEOUT_SEC``, 30 s), so the caller must keep
those pages until ``PendingWrite.poll`` says the write has settled.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

log = logging.getLogger(__name__)

# Mooncake's sync-write deadline (mooncake-integration/transfer_engine/transfer_engine_py.cpp: 30 s unless
# MC_TRANSFER_TIMEOUT says otherwise, plus 1 ns per byte); the reference engine's write deadline defaults to it.
MOONCAKE_TRANSFER_TIMEOUT = 30.0
SECONDS_PER_BYTE = 1e-9

# transfer_check_status's answers (transfer_engine_py.cpp): 1 completed and -1 failed (the batch is freed),
# 0 waiting, -2 a slice older than MC_SLICE_TIMEOUT (still in flight: not an end).
_COMPLETED, _FAILED = 1, -1


def default_transfer_timeout() -> float:
    """Mooncake's own deadline for a synchronous write: ``$MC_TRANSFER_TIMEOUT`` seconds (at least 5, as
    Mooncake clamps it), else 30."""
    raw = os.environ.get("MC_TRANSFER_TIMEOUT")
    if not raw:
        return MOONCAKE_TRANSFER_TIMEOUT
    try:
        return max(5.0, float(int(raw)))
    except ValueError:
        return MOONCAKE_TRANSFER_TIMEOUT


def write_deadline(timeout: float, nbytes: int) -> float:
    """Seconds a write of ``nbytes`` may take: ``timeout`` plus 1 ns per byte, Mooncake's allowance for the
    transfer itself (1 GiB/s) in its sync write."""
    return timeout + nbytes * SECONDS_PER_BYTE


def coalesce(src: list[int], dst: list[int], length: int) -> tuple[list[int], list[int], list[int]]:
    """Merge segments that are contiguous on both sides.

    Args:
        src, dst: start addresses of equal-length segments, pairwise.
        length: bytes per segment.

    Returns:
        (src_addrs, dst_addrs, lengths) with runs that are adjacent in both address spaces joined.
    """
    out_src: list[int] = []
    out_dst: list[int] = []
    out_len: list[int] = []
    for s, d in zip(src, dst):
        if out_src and out_src[-1] + out_len[-1] == s and out_dst[-1] + out_len[-1] == d:
            out_len[-1] += length
        else:
            out_src.append(s)
            out_dst.append(d)
            out_len.append(length)
    return out_src, out_dst, out_len


class TransferError(RuntimeError):
    """A KV write that the transfer engine reported as failed, or that missed its deadline."""


class PendingWrite:
    """A submitted write: one Mooncake batch per segment, each polled until it completes or fails.

    Args:
        engine: the ``mooncake.engine.TransferEngine`` it was submitted on.
        peer: the destination session id (for messages).
        batch_ids: the submitted batches.
        nbytes: bytes in the whole write.
        failed: a segment could not be submitted (the rest were, and still run).
    """

    def __init__(self, engine, peer: str, batch_ids: list[int], nbytes: int, failed: bool = False):
        self.engine = engine
        self.peer = peer
        self.outstanding = list(batch_ids)
        self.nbytes = nbytes
        self.failed = failed

    def poll(self) -> Optional[bool]:
        """Check the batches still in flight, without blocking.

        Returns:
            None while any batch may still read the source memory; then True when every segment
            completed, False when one failed or could not be submitted.
        """
        still = []
        for b in self.outstanding:
            rc = self.engine.transfer_check_status(b)
            if rc == _FAILED:
                self.failed = True
            elif rc != _COMPLETED:
                still.append(b)
        self.outstanding = still
        if still:
            return None
        return not self.failed

    @property
    def settled(self) -> bool:
        """True once no batch is in flight (the source memory may be reused)."""
        return not self.outstanding


class MooncakeTransfer:
    """One Mooncake transfer engine per engine process.

    Args:
        host: address the peer reaches this process on.
        protocol: ``tcp`` or ``rdma``.
        ib_device: RDMA device list for ``rdma`` (SGLang's --disaggregation-ib-device), else "".

    Raises:
        RuntimeError: the mooncake package is missing or the engine failed to initialise.
    """

    def __init__(self, host: str, protocol: str = "tcp", ib_device: str = ""):
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:  # pragma: no cover - depends on the install
            raise RuntimeError(
                "the Mooncake transfer engine is not installed: pip install 'pdserve[cpu]' "
                "(mooncake-transfer-engine-non-cuda) or 'pdserve[gpu]'"
            ) from e
        self.engine = TransferEngine()
        rc = self.engine.initialize(host, "P2PHANDSHAKE", protocol, ib_device or "")
        if rc != 0:
            raise RuntimeError(f"Mooncake TransferEngine.initialize({host!r}, P2PHANDSHAKE, {protocol!r}) "
                               f"returned {rc}")
        self.host = host
        self.protocol = protocol
        self.session_id = f"{host}:{self.engine.get_rpc_port()}"

    def register(self, addr: int, length: int) -> None:
        """Register a memory region for transfers (the whole KV pool, once)."""
        rc = self.engine.register_memory(addr, length)
        if rc != 0:
            raise RuntimeError(f"Mooncake register_memory failed with {rc}")

    def submit(self, peer_session: str, src: list[int], dst: list[int], lengths: list[int]) -> PendingWrite:
        """Start writing local segments into the peer's registered memory; returns at once.

        Blocks only for the first handshake with a new peer (Mooncake's ``openSegment``, bounded by
        ``MC_HANDSHAKE_CONNECT_TIMEOUT``), so call it off the event loop.

        Raises:
            TransferError: no segment could be submitted (peer unreachable, bad address); nothing is in flight.
        """
        batch_ids: list[int] = []
        failed = False
        for s, d, n in zip(src, dst, lengths):
            b = self.engine.transfer_submit_write(peer_session, s, d, n)
            if b <= 0 or b >= 1 << 63:  # 0 or (uint64) -1: openSegment or submitTransfer refused it
                failed = True
                break
            batch_ids.append(b)
        if failed and not batch_ids:
            raise TransferError(f"Mooncake could not start the KV write to {peer_session} (peer unreachable or "
                                "memory not registered)")
        return PendingWrite(self.engine, peer_session, batch_ids, sum(lengths), failed)
