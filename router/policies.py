"""Pairing policies: which prefill (and, separately, which decode) worker serves a request.

Every policy is the same pipeline, filter -> score -> pick:

- filter: the workers that are available (healthy, circuit not open, not draining; when none
  is, every worker not drained: see ``Policy.select``);
- score: a number per candidate, lower is better (e.g. its load);
- pick: the best score, ties broken round-robin so equal workers share the traffic.

A new policy is one small subclass overriding ``score`` (or ``pick`` when it is not a minimum)
and registered in ``POLICIES``. The policies:

- ``round_robin``: each side cycles through its candidates.
- ``random``: uniform choice.
- ``least_load``: fewest generated sequences in flight (a batch of 33 counts 33).
- ``power_of_two``: two random candidates, the less loaded one wins.
- ``cache_aware``: the worker whose recent prompts share the longest prefix with this one (an
  approximate radix tree per worker, pd.router.radix), unless the load is out of balance
  (sglang-router's rule: max - min > ``balance_abs_threshold`` and max > min x
  ``balance_rel_threshold`` -> least loaded); below ``cache_threshold`` matched, the worker with
  the smallest tree (most free cache) wins.
- ``kv_aware`` (prefill side): the lowest cost of prompt pages still to compute plus prompt pages in
  flight, from the workers' own KV cache events (pd.router.kv_aware, which registers it when imported, as
  pd.router.workers does).
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from typing import TYPE_CHECKING, Any, ClassVar, Optional, Sequence

from pd.router.config import RouterSettings
from pd.router.radix import RadixTree

if TYPE_CHECKING:
    import httpx

    from pd.router.metrics import RouterMetrics
    from pd.router.workers import Worker

log = logging.getLogger("pd.router")

_MAX_CHAR = 0x10FFFF


class Policy:
    """Base policy: filter -> score -> pick.

    Args:
        role: ``prefill`` or ``decode`` (for metrics and messages).
        settings: router settings (policy tuning).
    """

    name: ClassVar[str] = ""
    uses_key: ClassVar[bool] = False  # True: select() needs the request's routing key

    def __init__(self, role: str, settings: RouterSettings):
        self.role = role
        self.panic = False
        self._turn = itertools.count()

    def select(self, workers: Sequence["Worker"], key: Optional[str]) -> Optional["Worker"]:
        """The worker for one request, or None when there is none to try. Counts the decision
        in ``pdserve_router_policy_decisions_total``.

        Panic mode (as Envoy's): when health checks or circuit breakers have taken out every
        worker of this side, all of them that an operator did not drain stay candidates; failing
        every request outright would turn one worker's restart into an outage for as long as its
        breaker stays open."""
        candidates = [w for w in workers if w.available()]
        if not candidates:
            candidates = [w for w in workers if not w.draining]
            if not candidates:
                return None
            if not self.panic:
                self.panic = True
                log.warning("every %s worker is unhealthy or has its circuit open; trying them anyway", self.role)
        elif self.panic:
            self.panic = False
            log.warning("%s workers are available again", self.role)
        chosen = candidates[0] if len(candidates) == 1 else self.pick(candidates, key)
        self.picked(chosen, key)
        if chosen.decisions is not None:
            chosen.decisions.inc()
        return chosen

    def score(self, candidates: Sequence["Worker"], key: Optional[str]) -> list:
        """Per candidate, lower is better. A policy overrides ``score`` (the default ``pick`` takes the
        lowest) or ``pick`` itself; the base class has no scoring of its own.

        Raises:
            NotImplementedError: a subclass overrode neither (a programming error, never a request's).
        """
        raise NotImplementedError(f"{type(self).__name__} must override score() or pick()")

    def pick(self, candidates: Sequence["Worker"], key: Optional[str]) -> "Worker":
        """The lowest score; ties go round-robin."""
        scores = self.score(candidates, key)
        best = min(scores)
        tied = [w for w, s in zip(candidates, scores) if s == best]
        return tied[next(self._turn) % len(tied)]

    def picked(self, worker: "Worker", key: Optional[str]) -> None:
        """Hook after a decision (the cache-aware policy records the prompt)."""

    def forget(self, worker: "Worker") -> None:
        """Hook when a worker leaves the pool."""

    def joined(self, worker: "Worker") -> None:
        """Hook when a worker joins the pool (also for the workers the router starts with)."""

    def bind(self, metrics: "RouterMetrics") -> None:
        """Hook to attach the router's metrics (once, before any request)."""

    def start(self, http: "httpx.AsyncClient") -> None:
        """Hook once the router's event loop runs: ``http`` is its client for calls to workers."""

    async def stop(self) -> None:
        """Hook at router shutdown: end background work."""


class RoundRobin(Policy):
    """Each worker in turn (``--policy round_robin``)."""
    name = "round_robin"

    def pick(self, candidates, key):
        """The next worker in turn."""
        return candidates[next(self._turn) % len(candidates)]


class Random(Policy):
    """A uniformly random worker (``--policy random``)."""
    name = "random"

    def pick(self, candidates, key):
        """A uniformly random candidate."""
        return random.choice(candidates)


class LeastLoad(Policy):
    """The worker with the fewest requests in flight (``--policy least_load``)."""
    name = "least_load"

    def score(self, candidates, key):
        """Requests in flight per candidate (lower is better)."""
        return [w.load for w in candidates]


class PowerOfTwo(Policy):
    """The less loaded of two random workers (``--policy power_of_two``)."""
    name = "power_of_two"

    def pick(self, candidates, key):
        """The less loaded of two random candidates."""
        a, b = random.sample(candidates, 2)
        return a if a.load <= b.load else b


class CacheAware(Policy):
    """sglang-router's cache-aware policy (``--policy cache_aware``): the worker whose radix tree of routed
    prefixes matches the request text best, unless load is imbalanced beyond the balance thresholds, then the
    least loaded."""
    name = "cache_aware"
    uses_key = True

    def __init__(self, role: str, settings: RouterSettings):
        super().__init__(role, settings)
        self.cfg = settings.cache_aware
        self.trees: dict[str, RadixTree] = {}
        self._next_eviction = time.monotonic() + self.cfg.eviction_interval_secs

    def tree(self, worker: "Worker") -> RadixTree:
        """The radix tree of text routed to ``worker`` (created on first use)."""
        t = self.trees.get(worker.url)
        if t is None:
            t = self.trees[worker.url] = RadixTree()
        return t

    def pick(self, candidates, key):
        """Best prefix match above cache_threshold; otherwise, or when load is imbalanced, the least loaded."""
        loads = [w.load for w in candidates]
        lo, hi = min(loads), max(loads)
        if not key or (hi - lo > self.cfg.balance_abs_threshold and hi > lo * self.cfg.balance_rel_threshold):
            return super().pick(candidates, key)  # the least loaded
        matched = [self.tree(w).match(key) for w in candidates]
        best = max(matched)
        if best / len(key) > self.cfg.cache_threshold:
            tied = [w for w, m in zip(candidates, matched) if m == best]
        else:  # no useful cache anywhere: the emptiest cache, then the least load
            sizes = [(self.tree(w).size, w.load) for w in candidates]
            low = min(sizes)
            tied = [w for w, s in zip(candidates, sizes) if s == low]
        return tied[next(self._turn) % len(tied)]

    def score(self, candidates, key):
        """Requests in flight per candidate (the fallback ranks by load)."""
        return [w.load for w in candidates]

    def picked(self, worker, key):
        """Record that ``key`` went to ``worker``; evict trees to max_tree_size every eviction interval."""
        if not key:
            return
        now = time.monotonic()
        self.tree(worker).insert(key, now)
        if now >= self._next_eviction:
            self._next_eviction = now + self.cfg.eviction_interval_secs
            for t in self.trees.values():
                t.evict(self.cfg.max_tree_size)

    def forget(self, worker):
        """Drop a removed worker's tree."""
        self.trees.pop(worker.url, None)


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (RoundRobin, Random, LeastLoad, PowerOfTwo, CacheAware)}


def make_policy(name: str, role: str, settings: RouterSettings) -> Policy:
    """The policy called ``name`` for side ``role``.

    Raises:
        ValueError: unknown policy name.
    """
    try:
        return POLICIES[name](role, settings)
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}") from None


class PromptKey(str):
    """A routing key (the prompt as a string, what ``cache_aware`` matches) that also says what it was
    made of, for ``kv_aware``: ``kind`` is ``ids`` (one character per token id), ``text`` or ``chat``.
    ``kv`` is where ``kv_aware`` leaves its plan of the request (page hashes, the chosen worker's
    predicted cached tokens); None until it looked."""

    kind: str
    kv: Any
    _ids: Optional[list[int]]
    messages: Optional[tuple[tuple[Any, str], ...]]

    def __new__(cls, value: str, kind: str, ids: Optional[list[int]] = None,
                messages: Optional[tuple[tuple[Any, str], ...]] = None) -> "PromptKey":
        self = super().__new__(cls, value)
        self.kind = kind
        self.kv = None
        self._ids = ids  # the request's own list (not copied: the router never changes a prompt)
        self.messages = messages  # a chat's (role, text content) pairs, as the engine templates them
        return self

    def token_ids(self) -> Optional[list[int]]:
        """The prompt's token ids when it was given as ids, else None."""
        if self.kind != "ids":
            return None
        return self._ids if self._ids is not None else [ord(c) for c in self]


def routing_key(route: str, body: dict) -> Optional[PromptKey]:
    """The prompt as a string for prefix matching, or None when it has none the router can read.

    /generate: ``text``, or ``input_ids`` with one character per token id; /v1/completions:
    ``prompt`` likewise; /v1/chat/completions: the messages' roles and text contents joined. A
    batch is keyed by its first prompt (one prefill serves the whole batch).
    """
    if route == "/v1/chat/completions":
        msgs = body.get("messages")
        if not isinstance(msgs, list):
            return None
        parts, messages = [], []
        for m in msgs:
            if isinstance(m, dict):
                content = m.get("content")
                if isinstance(content, list):  # OpenAI content parts: keep the text ones
                    content = "".join(p.get("text", "") for p in content if isinstance(p, dict)
                                      and isinstance(p.get("text"), str))
                content = content if isinstance(content, str) else ""
                parts.append(f"{m.get('role', '')}\x00{content}\x00")
                messages.append((m.get("role"), content))
        return PromptKey("".join(parts), "chat", messages=tuple(messages)) if parts else None
    prompt = body.get("text") if route == "/generate" else body.get("prompt")
    if route == "/generate" and prompt is None:
        prompt = body.get("input_ids")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch
    if isinstance(prompt, str):
        return PromptKey(prompt, "text") if prompt else None
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and 0 <= t <= _MAX_CHAR for t in prompt):
        return PromptKey("".join(map(chr, prompt)), "ids", prompt)
    return None
