"""An approximate radix tree of recent prompts, one per worker, for the ``cache_aware`` policy.

It approximates what the worker's own prefix cache (SGLang's radix cache) holds: every prompt routed
to the worker is inserted, the longest stored prefix of a new prompt estimates how much of it the
worker has cached, and the tree is trimmed to a size budget, least recently used leaves first (the
engine's cache evicts in that order too). Keys are strings: prompt text, or token ids mapped to one
character each (see pd.router.policies.routing_key).
"""

from __future__ import annotations

import heapq
from typing import Optional


class _Node:
    __slots__ = ("edge", "parent", "children", "last")

    def __init__(self, edge: str, parent: Optional["_Node"], last: float):
        self.edge = edge  # the characters on the edge from parent to this node
        self.parent = parent
        self.children: dict[str, _Node] = {}  # first character of the child's edge -> child
        self.last = last  # when a prompt through this node was last inserted or matched


def _common(edge: str, text: str, start: int) -> int:
    """Length of the common prefix of ``edge`` and ``text[start:]`` (C-speed startswith calls:
    the whole edge first, else a binary search)."""
    if text.startswith(edge, start):
        return len(edge)
    lo, hi = 1, min(len(edge), len(text) - start)  # edge[0] == text[start] is known
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if text.startswith(edge[:mid], start):
            lo = mid
        else:
            hi = mid - 1
    return lo


class RadixTree:
    """Prefixes of the prompts one worker has seen.

    Attributes:
        size: characters stored (sum of edge lengths).
    """

    def __init__(self) -> None:
        self.root = _Node("", None, 0.0)
        self.size = 0

    def match(self, text: str, now: Optional[float] = None) -> int:
        """Length of the longest prefix of ``text`` stored in the tree (characters). With ``now``,
        the matched nodes count as used at that time."""
        node, i, n = self.root, 0, len(text)
        while i < n:
            child = node.children.get(text[i])
            if child is None:
                break
            k = _common(child.edge, text, i)
            i += k
            if now is not None:
                child.last = now
            if k < len(child.edge):
                break
            node = child
        return i

    def insert(self, text: str, now: float) -> None:
        """Store ``text`` (all its prefixes), stamping the nodes on its path with ``now``."""
        node, i, n = self.root, 0, len(text)
        while i < n:
            first = text[i]
            child = node.children.get(first)
            if child is None:
                node.children[first] = _Node(text[i:], node, now)
                self.size += n - i
                return
            k = _common(child.edge, text, i)
            if k < len(child.edge):  # split the edge: node -> mid (shared part) -> child (rest)
                mid = _Node(child.edge[:k], node, now)
                child.edge = child.edge[k:]
                child.parent = mid
                mid.children[child.edge[0]] = child
                node.children[first] = mid
                child = mid
            child.last = now
            i += k
            node = child

    def evict(self, max_size: int) -> None:
        """Drop least recently used leaves until at most ``max_size`` characters remain."""
        if self.size <= max_size:
            return
        heap = [(leaf.last, id(leaf), leaf) for leaf in self._leaves()]
        heapq.heapify(heap)
        while self.size > max_size and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[leaf.edge[0]]
            self.size -= len(leaf.edge)
            if parent is not self.root and not parent.children:
                heapq.heappush(heap, (parent.last, id(parent), parent))

    def _leaves(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root:
                yield node
