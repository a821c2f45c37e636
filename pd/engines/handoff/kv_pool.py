"""A fixed pool of KV pages, allocated once and registered with the transfer engine.

Layout: one torch tensor ``[num_pages, num_layers, 2, page_size, num_kv_heads, head_dim]``, so a
page is one contiguous byte range (``page_bytes`` long, at ``page_addr(page)``) that the Mooncake
transfer engine can write with a single segment. SGLang keeps per-layer buffers instead; one
contiguous page is what a CPU reference needs and keeps transfers to few, large segments.
"""

from __future__ import annotations

import asyncio
from typing import Callable, Optional

import torch

from pd.engines.models.model_runner import KVLayout


class PoolExhausted(Exception):
    """Raised when more pages are asked for than the pool can ever hold."""


class KVPagePool:
    """Pages of KV cache with allocation, release and waiting for free pages.

    Args:
        layout: per-token KV shape and dtype.
        page_size: tokens per page (SGLang's --page-size).
        max_total_tokens: pool capacity in tokens (SGLang's --max-total-tokens); rounded up to
            whole pages.

    Allocation returns the lowest free page ids first, so concurrent sequences tend to get
    contiguous runs that the transfer coalesces into one segment.
    """

    def __init__(self, layout: KVLayout, page_size: int, max_total_tokens: int):
        if page_size <= 0:
            raise ValueError("--page-size must be positive")
        self.layout = layout
        self.page_size = page_size
        self.num_pages = max(1, -(-max_total_tokens // page_size))
        self.pages = torch.zeros(
            (self.num_pages, layout.num_layers, 2, page_size, layout.num_kv_heads, layout.head_dim),
            dtype=layout.torch_dtype,
        )
        self.page_bytes = self.pages[0].numel() * self.pages.element_size()
        self._free = set(range(self.num_pages))
        self._changed = asyncio.Condition()
        # Pages another owner can give back on demand (the radix prefix cache evicts unlocked pages): called with
        # the shortfall in pages, returns the page ids it released (possibly more or fewer).
        self.reclaim: Optional[Callable[[int], list[int]]] = None

    @property
    def base_addr(self) -> int:
        """Device address of the first KV page (the buffer registered with the transfer engine)."""
        return self.pages.data_ptr()

    @property
    def total_bytes(self) -> int:
        """Size of the page buffer in bytes (num_pages x page_bytes)."""
        return self.num_pages * self.page_bytes

    def page_addr(self, page: int) -> int:
        """Virtual address of a page's first byte."""
        return self.base_addr + page * self.page_bytes

    def pages_for(self, num_tokens: int) -> int:
        """KV pages needed for ``num_tokens`` tokens (at least one)."""
        return max(1, -(-num_tokens // self.page_size))

    @property
    def held(self) -> int:
        """Pages currently allocated."""
        return self.num_pages - len(self._free)

    def try_alloc(self, num_tokens: int) -> list[int] | None:
        """Pages for ``num_tokens`` tokens, or None when not enough are free now.

        Raises:
            PoolExhausted: the request needs more pages than the whole pool.
        """
        need = self.pages_for(num_tokens)
        if need > self.num_pages:
            raise PoolExhausted(
                f"{num_tokens} tokens need {need} KV pages of {self.page_size} tokens; the pool has {self.num_pages}"
            )
        if need > len(self._free) and self.reclaim is not None:
            self._free.update(self.reclaim(need - len(self._free)))
        if need > len(self._free):
            return None
        got = sorted(self._free)[:need]
        self._free.difference_update(got)
        return got

    async def alloc(self, num_tokens: int) -> list[int]:
        """Wait until pages for ``num_tokens`` tokens are free and take them (FIFO-fair enough
        for a reference engine; cancellation-safe: nothing is held when cancelled)."""
        async with self._changed:
            while True:
                got = self.try_alloc(num_tokens)
                if got is not None:
                    return got
                await self._changed.wait()

    def free(self, pages: list[int]) -> None:
        """Return pages to the pool. Freeing a page twice is a bug and raises ValueError."""
        dup = [p for p in pages if p in self._free]
        if dup:
            raise ValueError(f"KV pages freed twice: {dup}")
        self._free.update(pages)
        asyncio.get_event_loop().create_task(self._notify())

    def poke(self) -> None:
        """Wake the allocations waiting for pages: ``reclaim`` may have more to give (the prefix cache unlocked
        some)."""
        asyncio.get_event_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()
