"""Pages of prompts the ``kv_aware`` policy (pd.router.kv_aware) just sent to one prefill, counted as held there
until that prefill's KV events report them (a prefill stores a prompt only once it computed it: without this a
burst of one tenant's requests would land on every worker before the first event; NVIDIA Dynamo's KV router
likewise predicts the blocks it just routed).

The policy hashes a prompt only as far as some worker holds it (pd.router.kv_tokenizer), so a sent prompt's
later pages may not be hashed yet. Its last hashed page is a *frontier*: a later prompt that reaches it asks the
sent one for its next page (tokenizing it further), so a burst of a new prefix still sees the whole prefix
pending on the worker that got the first copy, while a prefix-free prompt never pays for more than its first page.
Entries expire after ``ttl`` seconds (the events are the truth after that: an evicted or failed prompt stops
counting), oldest first, in O(1) per entry.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Optional, Protocol

# sent prompts kept for their later pages (each holds its text), the newest: a burst's copies come within this many
# requests to one worker; fewer kept objects also mean less work for the garbage collector per request
FRONTIER_MAX = 512


class PagedPrompt(Protocol):
    """What a sent prompt offers (pd.router.kv_plan.KvPlan)."""

    gate: Optional[str]
    text: str
    messages: Optional[tuple[tuple[Any, str], ...]]

    def page(self, block: int, k: int) -> Optional[int]:
        """The hash of page ``k`` of ``block`` tokens; None when the prompt has no such whole page."""

    def hashed(self, block: int) -> list[int]:
        """The page hashes computed so far, first page first."""

    def may_have(self, block: int, pages: int) -> bool:
        """Whether the prompt may have more than ``pages`` whole pages."""


class SentPages:
    """One worker's pages sent but not reported yet. Not thread-safe: use it from one event loop.

    Args:
        ttl: seconds a sent page counts as held.
        remake: a prompt again from its text and chat messages (for one sent untokenized and asked for later).
    """

    def __init__(self, ttl: float, remake: Callable[[str, Optional[tuple[tuple[Any, str], ...]]], PagedPrompt]):
        self.ttl, self.remake = ttl, remake
        self._until: dict[int, float] = {}  # page hash -> until (monotonic s)
        self._order: deque[tuple[float, int]] = deque()  # (until, hash) in the order sent
        self._frontier: dict[int, tuple[PagedPrompt, float]] = {}  # last hashed page -> (its prompt, until)
        self._frontier_order: deque[tuple[float, int]] = deque()
        # prompts sent with no page hashed, by gate: (text, until, chat messages); strings and tuples only, so the
        # collector stops tracking the entry (a prefix-free workload keeps many of them)
        self._unhashed: dict[str, tuple[str, float, Optional[tuple[tuple[Any, str], ...]]]] = {}
        self._unhashed_order: deque[tuple[float, str]] = deque()

    def __len__(self) -> int:
        return len(self._until)

    def remember(self, prompt: PagedPrompt, block: int, now: float) -> None:
        """``prompt`` was just sent: its hashed pages count as held, and its later ones through its frontier."""
        self._expire(now)
        until = now + self.ttl
        hashes = prompt.hashed(block)
        for h in hashes:
            self._add(h, until)
        if hashes and prompt.may_have(block, len(hashes)):
            self._add_frontier(hashes[-1], prompt, until)
        elif not hashes and prompt.gate is not None:  # placed untokenized: its first page comes when asked
            _bounded(self._unhashed, self._unhashed_order, prompt.gate, (prompt.text, until, prompt.messages))

    def holds(self, h: int, prev: Optional[int], k: int, block: int, asking: PagedPrompt, now: float) -> bool:
        """Whether page ``k`` (hash ``h``, after page hash ``prev``) of ``asking`` was sent here and not expired.

        A page one past a sent prompt's frontier (``prev``) is the sent prompt's page ``k`` if the two share
        their first ``k`` pages (the hashes are chained): the sent prompt is hashed one page further for it. A
        first page is likewise asked of a prompt sent untokenized with the same first characters (``gate``).
        """
        until = self._until.get(h)
        if until is not None and until > now:
            return True
        sent: Optional[PagedPrompt] = None
        if prev is not None:
            got = self._frontier.get(prev)
            if got is not None and got[0] is not asking and got[1] > now:  # a retry of one request is no copy
                del self._frontier[prev]
                sent, until = got
        elif asking.gate is not None:
            first = self._unhashed.get(asking.gate)
            if first is not None and first[0] is not asking.text and first[1] > now:
                del self._unhashed[asking.gate]
                sent, until = self.remake(first[0], first[2]), first[1]
        if sent is None or until is None:
            return False
        nxt = sent.page(block, k)
        if nxt is None:
            return False
        self._add(nxt, until)
        if sent.may_have(block, k + 1):
            self._add_frontier(nxt, sent, until)
        return nxt == h

    def _add(self, h: int, until: float) -> None:
        self._until[h] = until
        self._order.append((until, h))

    def _add_frontier(self, h: int, prompt: PagedPrompt, until: float) -> None:
        _bounded(self._frontier, self._frontier_order, h, (prompt, until))

    def _expire(self, now: float) -> None:
        order, pages = self._order, self._until
        while order and order[0][0] <= now:
            until, h = order.popleft()
            if pages.get(h) == until:  # not sent again since
                del pages[h]
        _expire_oldest(self._frontier, self._frontier_order, now)
        _expire_oldest(self._unhashed, self._unhashed_order, now)


def _expire_oldest(entries: dict, order: deque, now: float) -> None:
    """Drop the entries whose expiry (``value[1]``, the time in ``order``) is past ``now``."""
    while order and order[0][0] <= now:
        until, key = order.popleft()
        got = entries.get(key)
        if got is not None and got[1] == until:
            del entries[key]


def _bounded(entries: dict, order: deque, key, value: tuple) -> None:
    """``entries[key] = value`` (``value[1]`` its expiry), the oldest dropped past ``FRONTIER_MAX``."""
    entries[key] = value
    order.append((value[1], key))
    while len(entries) > FRONTIER_MAX:
        then, old = order.popleft()
        got = entries.get(old)
        if got is not None and got[1] == then:
            del entries[old]
