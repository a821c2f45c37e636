"""The decode's radix prefix cache (SGLang's ``--disaggregation-decode-enable-radix-cache``): the prompt KV pages a
decode received stay cached, so a later prompt that starts with them registers only its missing pages and its
prefill writes only those (pd.engines.handoff.decode_engine, ``decode_prefix_len`` in the registration).

A request's life: ``match`` locks the longest cached run of whole pages of the prompt (at least one prompt token
left to the prefill); the decode allocates pages for the rest, the prefill writes them, the decode imports the KV
of the cached pages followed by the received ones; ``finish`` gives the prompt's whole pages to the tree, frees the
rest (the partial last page, the verify window) and unlocks the match. The decode never writes into its pool pages
(the KV is imported into the sequence's own cache), so a cached page holds exactly what its prefill sent.

With speculative decoding the draft's KV is cached alongside: every cached target page keeps the draft page of the
same positions. Draft entry ``i`` is computed from the target's hidden state ``h[i]`` and token ``x[i+1]``
(pd.engines.spec.decoder, ``SpecDecoder.extend_prompt``), so the draft page of positions ``[j*ps, (j+1)*ps)`` also
depends on the token at ``(j+1)*ps``, which the tree's key (the page's own tokens) does not cover. Each cached page
therefore records that "next token" (for the prompt's last whole page it can be the first output token), and a
match stops at the first page whose next token differs from the new prompt's. SGLang shares one allocator between
the target and draft pools and checks nothing of the kind (it refuses the decode radix cache with other
speculative algorithms than EAGLE, EAGLE3 and DSPARK).

Eviction, least recently used first, frees a page's draft page and forgets its next token with it, whichever pool
ran short. Locked pages are never evicted, so a request never loses the pages it reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from pd.engines.handoff.kv_pool import KVPagePool
from pd.engines.prefix.prefix_pages import Hit, PrefixCache


@dataclass
class DecodeHit(Hit):
    """A locked match of one prompt on the decode (``Hit``'s fields) and, with speculation, the draft pages of the
    matched positions (``draft_pages[i]`` goes with ``pages[i]``; empty without)."""

    draft_pages: list[int] = field(default_factory=list)


class DecodePrefixCache(PrefixCache):
    """The radix cache of a decode's pool, with the draft's pages alongside when it speculates.

    Args:
        pool: the target's KV page pool; the cache reclaims its unlocked pages when an allocation finds it short.
        draft_pool: the draft's KV page pool (speculative decoding), None without; reclaimed the same way.
    """

    def __init__(self, pool: KVPagePool, draft_pool: Optional[KVPagePool] = None):
        super().__init__(pool)
        self.draft_pool = draft_pool
        # Speculation only: cached target page -> its draft page, and -> the token after its last position.
        self._draft_of: dict[int, int] = {}
        self._next_token: dict[int, int] = {}
        pool.reclaim = self._reclaim_target
        if draft_pool is not None:
            draft_pool.reclaim = self._reclaim_draft

    def match_prompt(self, prompt_ids: Sequence[int]) -> DecodeHit:
        """Lock the longest cached run of whole pages of ``prompt_ids`` the decode may reuse: at least one prompt
        token is left (the prefill computes it and its first output token), and with speculation the run stops
        before the first page whose recorded next token is not the prompt's token after that page."""
        ps = self.pool.page_size
        limit = max(0, len(prompt_ids) - 1) // ps * ps
        pages, cached, node = self.tree.match_prefix(prompt_ids[:limit])
        if self.draft_pool is not None:
            # limit < len(prompt_ids): the token after each matched page is a prompt token
            keep = next((i for i, p in enumerate(pages) if self._next_token[p] != prompt_ids[(i + 1) * ps]),
                        len(pages))
            if keep < len(pages):
                pages, cached, node = self.tree.match_prefix(prompt_ids[: keep * ps])
        self.tree.inc_lock_ref(node)  # before any await: an unlocked match can be evicted
        self.hit_tokens += cached
        self.prompt_tokens += len(prompt_ids)
        return DecodeHit(pages, cached, node, [self._draft_of[p] for p in pages] if self.draft_pool is not None else [])

    def finish_prompt(self, hit: DecodeHit, prompt_ids: Sequence[int], pages: list[int], draft_pages: list[int],
                      first_token: Optional[int]) -> None:
        """Keep the prompt's whole pages (and their draft pages) in the tree, free the rest of what this request
        allocated, unlock the match.

        Args:
            pages: the request's target pages in prompt order, the hit's first (the prompt and the verify window).
            draft_pages: the draft's, likewise (empty without speculation).
            first_token: the first output token (the next token of a prompt's last page that ends the prompt);
                None when unknown, and that page is then not kept with speculation.
        """
        ps, n = self.pool.page_size, len(prompt_ids)
        mine = hit.cached // ps
        full = n // ps
        if self.draft_pool is not None and first_token is None:
            full = (n - 1) // ps  # a page ending the prompt needs the first output token as its next token
        known = self.tree.insert(prompt_ids[: full * ps], pages[:full])  # >= mine: the hit is locked
        if self.draft_pool is not None:
            for i in range(known, full):
                after = (i + 1) * ps
                nxt = prompt_ids[after] if after < n else first_token
                assert nxt is not None  # full excludes that page when first_token is None
                self._next_token[pages[i]] = nxt
                self._draft_of[pages[i]] = draft_pages[i]
        self.pool.free(pages[mine:known] + pages[full:])  # pages the tree already had, and the rest
        if self.draft_pool is not None:
            self.draft_pool.free(draft_pages[mine:known] + draft_pages[full:])
        self.unlock(hit)

    def drop_prompt(self, hit: DecodeHit, pages: list[int], draft_pages: list[int]) -> None:
        """Free the pages this request allocated (past the hit, in both pools) and unlock the match; nothing is
        kept (KV that arrived but could not be loaded)."""
        mine = hit.cached // self.pool.page_size
        self.pool.free(pages[mine:])
        if self.draft_pool is not None:
            self.draft_pool.free(draft_pages[mine:])
        self.unlock(hit)

    def unlock(self, hit: Hit) -> None:
        """Unlock the match; allocations waiting for pages of either pool may now evict its pages."""
        if self.tree.dec_lock_ref(hit.node) > 0:
            self.pool.poke()
            if self.draft_pool is not None:
                self.draft_pool.poke()

    def flush(self) -> bool:
        """Drop every cached page (and draft page) back to its pool; False, dropping nothing, while a request
        holds a lock on some."""
        if self.tree.protected_size() > 0:
            return False
        pages = self.tree.reset()
        self.pool.free(pages)
        drafts = self._forget(pages)
        if self.draft_pool is not None:
            self.draft_pool.free(drafts)
        return True

    def _forget(self, pages: list[int]) -> list[int]:
        """Drop what is recorded for target ``pages`` that left the tree; returns their draft pages."""
        if self.draft_pool is None:
            return []
        for p in pages:
            del self._next_token[p]
        return [self._draft_of.pop(p) for p in pages]

    def _reclaim_target(self, short: int) -> list[int]:
        """The target pool's ``reclaim``: evict ``short`` pages or more; their draft pages go back to the draft
        pool."""
        pages = self.tree.evict(short)
        drafts = self._forget(pages)
        if drafts:
            assert self.draft_pool is not None
            self.draft_pool.free(drafts)
        return pages

    def _reclaim_draft(self, short: int) -> list[int]:
        """The draft pool's ``reclaim``: evict ``short`` cached pages or more; their target pages go back to the
        target pool."""
        pages = self.tree.evict(short)
        drafts = self._forget(pages)
        if pages:
            self.pool.free(pages)
        return drafts
