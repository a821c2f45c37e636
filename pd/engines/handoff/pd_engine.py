"""What both PD modes of the engine share: a KV page pool (and the draft's, with speculation) registered with the
Mooncake transfer engine, an HTTP client for the peer's bootstrap server, and pages held while a transfer may
still touch them."""

from __future__ import annotations

import logging

from pd.engines.engine_core import EngineCore, started
from pd.engines.handoff.bootstrap import make_client
from pd.engines.handoff.kv_pool import KVPagePool
from pd.engines.handoff.transfer import MooncakeTransfer

log = logging.getLogger(__name__)


class PDEngineCore(EngineCore):
    """The engine core of a ``prefill`` or ``decode`` engine (same arguments as ``EngineCore``)."""

    async def start(self) -> None:
        """Allocate the KV pools and register them with a new transfer engine."""
        a = self.args
        self.pool = KVPagePool(self.runner.layout, a.page_size, a.max_total_tokens)
        self.transfer = MooncakeTransfer(a.transfer_host, a.disaggregation_transfer_protocol,
                                         a.disaggregation_ib_device or "")
        self.transfer.register(self.pool.base_addr, self.pool.total_bytes)
        if self.spec is not None:  # SGLang's PD registers the draft's KV pool next to the target's
            self.draft_pool = KVPagePool(self.spec.draft.layout, a.page_size, a.max_total_tokens)
            self.transfer.register(self.draft_pool.base_addr, self.draft_pool.total_bytes)
        self.update_pool_metrics()
        self.http = make_client(a.api_key)
        log.info("%s engine: KV pool %d pages x %d tokens (%.1f MB), transfer session %s",
                 self.mode, self.pool.num_pages, self.pool.page_size, self.pool.total_bytes / 1e6,
                 self.transfer.session_id)

    @property
    def _pool(self) -> KVPagePool:
        """The KV page pool, which ``start`` made."""
        return started(self.pool, "KV page pool")
