"""The engine's radix prefix cache over its KV page pool: which pages a prompt can reuse, and what a finished
prompt leaves behind for the next one.

A request's life, as SGLang's scheduler runs it (``match_prefix``, ``inc_lock_ref``, ``cache_finished_req``):
``match`` locks the longest cached run of whole pages of the prompt; ``alloc`` takes pages for the rest; the
forward reads the matched pages and writes the rest; ``finish`` gives the prompt's whole pages to the tree (a page
the tree already had is freed: a concurrent request cached the same prefix first), frees the partial last page and
unlocks the match. ``drop`` is ``finish`` without keeping anything (a failed request). Locked pages are never
evicted; unlocked ones go back to the pool, least recently used first, when an allocation finds the pool short
(``KVPagePool.reclaim``).

Only prompts are cached (a PD prefill never sees the output), and never with speculative decoding (the draft's
state needs the target's hidden states of every prompt position, which a hit does not compute).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from pd.engines.handoff.kv_pool import KVPagePool
from pd.engines.prefix.radix_cache import Cleared, RadixCache, RadixNode, Removed, Stored
from pd.engines.protocol import SeqRequest


@dataclass
class Hit:
    """A locked match of one prompt.

    Attributes:
        pages: the cached pages, in prompt order.
        cached: prompt tokens they hold (a multiple of the page size; 0 on a miss).
        node: the tree node the match ends at (its path is locked until ``finish`` or ``drop``).
    """

    pages: list[int]
    cached: int
    node: RadixNode


class PrefixCache:
    """The radix cache of one engine's pool.

    Args:
        pool: the KV page pool; the cache installs itself as its ``reclaim``.
        disable: SGLang's ``--disable-radix-cache``: nothing matches and nothing is kept.
        on_event: called with each ``Stored`` / ``Removed`` / ``Cleared`` (the KV events publisher).
    """

    def __init__(self, pool: KVPagePool, disable: bool = False,
                 on_event: Optional[Callable[[Stored | Removed | Cleared], None]] = None):
        self.pool = pool
        self.tree = RadixCache(pool.page_size, disable, on_event)
        pool.reclaim = self.tree.evict
        self.hit_tokens = 0  # prompt tokens served from the cache, since start
        self.prompt_tokens = 0  # prompt tokens of every matched request, since start

    @property
    def disabled(self) -> bool:
        """Whether the cache is off (``--disable-radix-cache``)."""
        return self.tree.disable

    def match(self, req: SeqRequest) -> Hit:
        """Lock the longest cached prefix of ``req``'s prompt that it may reuse: whole pages, at least one prompt
        token left to compute (its logits give the first output token), and no position whose prompt logprob was
        asked for (``logprob_start_len``: its logits must be computed, as SGLang limits the match)."""
        ids = req.prompt_ids
        limit = len(ids) - 1
        if req.return_logprob and req.logprob_start_len >= 0:
            limit = min(limit, req.logprob_start_len - 1)
        limit = max(0, limit) // self.pool.page_size * self.pool.page_size
        pages, cached, node = self.tree.match_prefix(ids[:limit])
        self.tree.inc_lock_ref(node)  # before any await: an unlocked match can be evicted
        self.hit_tokens += cached
        self.prompt_tokens += len(ids)
        return Hit(pages, cached, node)

    async def alloc(self, hit: Hit, num_tokens: int) -> list[int]:
        """Pages for a prompt of ``num_tokens`` tokens: the hit's, then new ones for the rest (evicting unlocked
        cached pages when the pool is short; waiting when it is still short)."""
        return hit.pages + await self.pool.alloc(num_tokens - hit.cached)

    def finish(self, hit: Hit, prompt_ids: list[int], pages: list[int]) -> None:
        """Keep the prompt's whole pages in the tree, free the rest of ``pages`` this request allocated, unlock
        the match. ``pages`` hold the whole prompt's KV (``alloc``'s result, written by the forward)."""
        page_size = self.pool.page_size
        mine = hit.cached // page_size
        if self.disabled:
            self.pool.free(pages[mine:])
        else:
            full = len(prompt_ids) // page_size
            known = self.tree.insert(prompt_ids[: full * page_size], pages[:full])  # >= mine: the hit is locked
            self.pool.free(pages[mine:known] + pages[full:])  # pages the tree already had, and the partial one
        self.unlock(hit)

    def drop(self, hit: Hit, pages: list[int]) -> None:
        """Free the pages this request allocated (``pages`` past the hit) and unlock the match; nothing is kept."""
        self.pool.free(pages[hit.cached // self.pool.page_size:])
        self.unlock(hit)

    def unlock(self, hit: Hit) -> None:
        """Unlock the match only (its pages stay cached); for a request whose own pages go back elsewhere."""
        if self.tree.dec_lock_ref(hit.node) > 0:
            self.pool.poke()  # pages became evictable: an allocation waiting for pages may now get them

    def flush(self) -> bool:
        """Drop every cached page back to the pool (SGLang's /flush_cache); False, dropping nothing, while a
        request or a KV transfer still holds a lock on some."""
        if self.tree.protected_size() > 0:
            return False
        self.pool.free(self.tree.reset())
        return True

    def cached_pages(self) -> int:
        """Pages the tree holds that no request is using (evictable)."""
        return self.tree.evictable_size() // self.pool.page_size

    def hit_rate(self) -> float:
        """Cached prompt tokens over prompt tokens of every match since start (0 before any)."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
