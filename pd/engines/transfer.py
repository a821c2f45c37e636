"""KV transfer through the Mooncake transfer engine (push from prefill to decode).

Uses ``mooncake.engine.TransferEngine`` in P2P-handshake mode, as SGLang's Mooncake backend does
(sglang/srt/disaggregation/mooncake/transfer_engine.py): each side initialises its own engine,
registers its KV pool, and is addressed by the session id ``"host:rpc_port"``. The prefill writes
with ``batch_transfer_sync_write`` into the decode's registered pages.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def coalesce(src: list[int], dst: list[int], length: int) -> tuple[list[int], list[int], list[int]]:
    """Merge segments that are contiguous on both sides.

    Args:
        src, dst: start addresses of equal-length segments, pairwise.
        length: bytes per segment.

    Returns:
        (src_addrs, dst_addrs, lengths) with runs that are adjacent in both address spaces joined.
    """
    out_src, out_dst, out_len = [], [], []
    for s, d in zip(src, dst):
        if out_src and out_src[-1] + out_len[-1] == s and out_dst[-1] + out_len[-1] == d:
            out_len[-1] += length
        else:
            out_src.append(s)
            out_dst.append(d)
            out_len.append(length)
    return out_src, out_dst, out_len


class TransferError(RuntimeError):
    """A KV write that the transfer engine reported as failed."""


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

    def write(self, peer_session: str, src: list[int], dst: list[int], lengths: list[int]) -> None:
        """Blocking batched write of local segments into the peer's registered memory.

        Raises:
            TransferError: the engine returned a non-zero status (peer gone, bad address).
        """
        rc = self.engine.batch_transfer_sync_write(peer_session, src, dst, lengths)
        if rc != 0:
            raise TransferError(f"Mooncake batch write to {peer_session} failed with status {rc}")
