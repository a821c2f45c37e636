"""A radix tree of cached KV pages keyed by token ids, with SGLang's RadixCache semantics.

Keys are page granular: only whole pages of ``page_size`` tokens are cached, so every match, insert
and eviction is a multiple of ``page_size`` tokens. Each edge holds the token ids of its pages, the
page ids the engine's ``KVPagePool`` handed out for them and the pages' chained block hashes.

The cache never frees pages itself. ``insert`` says how many of the caller's pages were already
cached (the caller frees those it allocated), and ``evict`` / ``reset`` return the page ids that
left the tree (the caller frees them). Paths in use are pinned with ``inc_lock_ref`` and released
with ``dec_lock_ref``; a locked node is never evicted.

Storage changes are reported through ``on_event`` as ``Stored`` / ``Removed`` / ``Cleared``, which
map one to one onto SGLang's ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` KV events.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional, Union

from pd.util.kv_block_hash import page_hashes


@dataclass(frozen=True)
class Stored:
    """Pages entered the tree (SGLang's ``BlockStored``).

    ``block_hashes``: int64 hash per page; ``parent_block_hash``: hash of the page before the first
    one, None when they start at the root; ``token_ids``: the pages' tokens
    (``len(block_hashes) * block_size`` of them); ``block_size``: tokens per page.
    """

    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int


@dataclass(frozen=True)
class Removed:
    """Pages left the tree by eviction (SGLang's ``BlockRemoved``); int64 hash per page."""

    block_hashes: list[int]


@dataclass(frozen=True)
class Cleared:
    """The whole tree was emptied (SGLang's ``AllBlocksCleared``)."""


Event = Union[Stored, Removed, Cleared]


class RadixNode:
    """One edge of the tree and the node it ends in; an opaque handle outside this module.

    ``match_prefix`` returns one for locking. Attributes are read-only for callers: ``tokens``
    (token ids, a whole number of pages), ``pages`` (page ids), ``digests`` / ``hashes`` (per page,
    see ``page_hashes``), ``lock_ref`` (locks held through this node), ``last_access`` (a tick of
    the owning cache's clock), ``children`` (keyed by their first page's token tuple), ``parent``
    (None for the root and for nodes no longer in the tree).
    """

    __slots__ = ("tokens", "pages", "digests", "hashes", "lock_ref", "last_access", "children", "parent", "id")

    def __init__(self, tokens: tuple[int, ...], pages: list[int], digests: list[bytes], hashes: list[int],
                 parent: Optional[RadixNode], node_id: int, last_access: int):
        self.tokens = tokens
        self.pages = pages
        self.digests = digests
        self.hashes = hashes
        self.lock_ref = 0
        self.last_access = last_access
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.parent = parent
        self.id = node_id


class RadixCache:
    """SGLang's radix prefix cache over KV page ids (``sglang/srt/mem_cache/radix_cache.py``).

    Args:
        page_size: tokens per KV page (the pool's ``page_size``).
        disable: SGLang's ``--disable-radix-cache``: nothing is matched, cached, evicted or
            reported, and ``insert`` returns 0 so the caller frees all its pages.
        on_event: called synchronously with a ``Stored`` / ``Removed`` / ``Cleared`` after each
            change (``Cleared`` also once at construction, as SGLang's reset does). It must not
            raise: an exception leaves the tree consistent but loses the call's return value.

    Raises:
        ValueError: ``page_size`` is not positive.

    Sizes (``evictable_size``, ``protected_size``) are in tokens as in SGLang; page counts are
    those divided by ``page_size``. Not thread-safe: call from the engine's event loop only.
    """

    def __init__(self, page_size: int, disable: bool = False,
                 on_event: Optional[Callable[[Event], None]] = None):
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.page_size = page_size
        self.disable = disable
        self._on_event = on_event if not disable else None
        # A logical clock rather than wall time: ties cannot reorder LRU and tests are deterministic.
        self._clock = itertools.count(1)
        self._ids = itertools.count(1)
        self.reset()

    # ----- public API -----

    def reset(self) -> list[int]:
        """Drop every cached page, locked or not, and emit ``Cleared``.

        Only call when no request holds a lock or a page from a match (e.g. flush_cache on an idle
        engine): old ``RadixNode`` handles become invalid.

        Returns:
            Every page id the tree held; the caller frees them.
        """
        freed = self.all_pages() if hasattr(self, "_root") else []
        self._root = RadixNode((), [], [], [], None, next(self._ids), next(self._clock))
        # The root is never evicted and locking stops below it.
        self._root.lock_ref = 1
        self._evictable = 0
        self._protected = 0
        # Page ids in the tree, so insert can refuse one it already holds (a later double free).
        self._held: set[int] = set()
        self._emit(Cleared())
        return freed

    @property
    def root(self) -> RadixNode:
        """The root node: what ``match_prefix`` returns when nothing matched."""
        return self._root

    def match_prefix(self, token_ids: Sequence[int]) -> tuple[list[int], int, RadixNode]:
        """Longest cached whole-page prefix of ``token_ids``.

        Refreshes the access time of the matched path. A match ending inside an edge splits it at
        that page boundary, so the returned node ends exactly at the match.

        Returns:
            ``(page ids, matched tokens, last node)``: one page id per matched page, matched tokens
            ``== len(page ids) * page_size``, and the node to pass to ``inc_lock_ref`` (the root
            when nothing matched). The pages stay the tree's: lock the node before using them.
        """
        if self.disable:
            return [], 0, self._root
        key = self._aligned(token_ids)
        node, off, pages = self._walk(key)
        return pages, off, node

    def insert(self, token_ids: Sequence[int], page_ids: Sequence[int]) -> int:
        """Cache the whole pages of a sequence whose KV is in ``page_ids``.

        Args:
            token_ids: the sequence's token ids; a trailing partial page is not cached.
            page_ids: page id per page of ``token_ids``, either one per whole page or also one for
                the trailing partial page (the pool's ``pages_for(len(token_ids))``). The partial
                page's id is never taken: it stays the caller's.

        Returns:
            ``n``: how many leading pages were already cached. ``page_ids[:n]`` did not enter the
            tree; of those the caller frees the ones it allocated itself, i.e. all but the ones it
            got from ``match_prefix`` and still holds locked (SGLang's ``cache_protected_len``).
            ``page_ids[n:full]`` now belong to the tree. 0 in disable mode.

        Raises:
            ValueError: ``page_ids`` has the wrong length, a page id to be taken is already in the
                tree, or a token id does not fit in uint32.
        """
        full = len(token_ids) // self.page_size
        if len(page_ids) not in (full, -(-len(token_ids) // self.page_size)):
            raise ValueError(f"{len(token_ids)} tokens need {full} page ids (or one more for the "
                             f"partial page), got {len(page_ids)}")
        if self.disable:
            return 0
        key = self._aligned(token_ids)
        node, off, _ = self._walk(key)
        if off < len(key):
            new_pages = list(page_ids[off // self.page_size : full])
            if len(set(new_pages)) != len(new_pages) or self._held.intersection(new_pages):
                raise ValueError(f"page ids already cached or repeated: {new_pages}")
            prior = node.digests[-1] if node.digests else None
            hashed = page_hashes(key[off:], self.page_size, prior)
            child = RadixNode(key[off:], new_pages, [d for d, _ in hashed], [h for _, h in hashed],
                              node, next(self._ids), node.last_access)
            node.children[child.tokens[: self.page_size]] = child
            self._evictable += len(child.tokens)
            self._held.update(new_pages)
            self._emit(Stored(list(child.hashes), node.hashes[-1] if node.hashes else None,
                              list(child.tokens), self.page_size))
        return off // self.page_size

    def inc_lock_ref(self, node: RadixNode) -> int:
        """Lock the path from ``node`` up to the root so none of it is evicted.

        Returns:
            Change of ``evictable_size`` in tokens (0 or negative).

        Raises:
            ValueError: ``node`` is not in this tree (evicted, from before a reset, or foreign).
        """
        if self.disable:
            return 0
        self._check_in_tree(node)
        delta = 0
        while node is not self._root:
            if node.lock_ref == 0:
                delta -= len(node.tokens)
            node.lock_ref += 1
            node = _parent(node)
        self._evictable += delta
        self._protected -= delta
        return delta

    def dec_lock_ref(self, node: RadixNode) -> int:
        """Release one ``inc_lock_ref`` of ``node``'s path.

        Returns:
            Change of ``evictable_size`` in tokens (0 or positive).

        Raises:
            ValueError: ``node`` is not in this tree, or its path is not locked.
        """
        if self.disable:
            return 0
        self._check_in_tree(node)
        if node is not self._root and node.lock_ref <= 0:
            raise ValueError("dec_lock_ref on a node that is not locked")
        delta = 0
        while node is not self._root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                delta += len(node.tokens)
            node = _parent(node)
        self._evictable += delta
        self._protected -= delta
        return delta

    def evict(self, num_pages: int) -> list[int]:
        """Evict unlocked leaves, least recently used first, until ``num_pages`` pages are freed.

        A parent whose last child goes becomes a leaf and a candidate in the same call. Whole nodes
        are evicted, so more than ``num_pages`` may come back; fewer when too little is unlocked.
        Emits one ``Removed`` per evicted node. Costs O(nodes) to find the leaves.

        Returns:
            The evicted page ids; the caller frees them.

        Raises:
            ValueError: ``num_pages`` is negative.
        """
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        if self.disable:
            return []
        heap = [(n.last_access, n.id, n) for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed: list[int] = []
        while len(freed) < num_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = _parent(leaf)
            del parent.children[leaf.tokens[: self.page_size]]
            # Detached nodes fail _check_in_tree, so a stale handle cannot be locked.
            leaf.parent = None
            self._evictable -= len(leaf.tokens)
            freed.extend(leaf.pages)
            self._held.difference_update(leaf.pages)
            self._emit(Removed(list(leaf.hashes)))
            if parent is not self._root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return freed

    def evictable_size(self) -> int:
        """Tokens in unlocked cached pages (what ``evict`` can free, times ``page_size``)."""
        return self._evictable

    def protected_size(self) -> int:
        """Tokens in cached pages on locked paths."""
        return self._protected

    def all_pages(self) -> list[int]:
        """Every page id the tree holds, parents before children."""
        return [p for n in self._nodes() for p in n.pages]

    # ----- internals -----

    def _emit(self, event: Event) -> None:
        if self._on_event is not None:
            self._on_event(event)

    def _aligned(self, token_ids: Sequence[int]) -> tuple[int, ...]:
        # Tuples make page slices directly usable as child keys and comparable with edges.
        n = len(token_ids) // self.page_size * self.page_size
        return tuple(token_ids[:n])

    def _walk(self, key: tuple[int, ...]) -> tuple[RadixNode, int, list[int]]:
        """Follow ``key`` down the tree, splitting the last edge where the match ends inside it and
        refreshing access times; returns ``(last node, matched tokens, matched page ids)``."""
        node, now, off, pages = self._root, next(self._clock), 0, []
        node.last_access = now
        while off < len(key):
            child = node.children.get(key[off : off + self.page_size])
            if child is None:
                break
            child.last_access = now
            n = self._common_pages(child.tokens, key, off)
            if n * self.page_size < len(child.tokens):
                child = self._split(child, n)
            pages.extend(child.pages)
            node = child
            off += len(child.tokens)
        return node, off, pages

    def _common_pages(self, edge: tuple[int, ...], key: tuple[int, ...], off: int) -> int:
        """Whole pages ``edge`` shares with ``key[off:]`` (at least one: the child key matched)."""
        ps = self.page_size
        limit = min(len(edge), len(key) - off) // ps
        n = 1
        while n < limit and edge[n * ps : (n + 1) * ps] == key[off + n * ps : off + (n + 1) * ps]:
            n += 1
        return n

    def _split(self, child: RadixNode, n: int) -> RadixNode:
        """Cut ``child``'s edge after ``n`` pages; returns the new upper node.

        ``child`` stays the lower part, so handles to it (and locks through it) stay valid; the new
        node inherits its lock count and access time. Hashes are positional, so no events.
        """
        cut = n * self.page_size
        upper = RadixNode(child.tokens[:cut], child.pages[:n], child.digests[:n], child.hashes[:n],
                          child.parent, next(self._ids), child.last_access)
        upper.lock_ref = child.lock_ref
        _parent(child).children[upper.tokens[: self.page_size]] = upper
        child.tokens, child.pages = child.tokens[cut:], child.pages[n:]
        child.digests, child.hashes = child.digests[n:], child.hashes[n:]
        child.parent = upper
        upper.children[child.tokens[: self.page_size]] = child
        return upper

    def _nodes(self) -> list[RadixNode]:
        """Every non-root node, parents before children."""
        out, todo = [], list(self._root.children.values())
        while todo:
            node = todo.pop()
            out.append(node)
            todo.extend(node.children.values())
        return out

    def _check_in_tree(self, node: RadixNode) -> None:
        top = node
        while top.parent is not None:
            top = top.parent
        if top is not self._root:
            raise ValueError("node is not in this radix cache (evicted, reset, or from another cache)")


def _parent(node: RadixNode) -> RadixNode:
    """The parent of a node in the tree: every node but the root has one while it is in the tree (callers have
    checked that, ``_check_in_tree``, or walk up from such a node)."""
    assert node.parent is not None, "the root has no parent; a detached node is not in the tree"
    return node.parent
