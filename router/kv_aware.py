"""The ``kv_aware`` policy: prefill workers ranked by what their KV caches hold, as their own KV events
report it (pd.router.kv_index), rather than by what the router sent them (``cache_aware``).

Cost of worker ``w`` for a prompt of ``B`` whole KV pages, lower is better (NVIDIA Dynamo's KV router
cost function: "cost = overlap_score_weight x prefill_blocks + decode_blocks", Dynamo's Router Guide,
https://docs.nvidia.com/dynamo/user-guides/kv-cache-aware-routing, section "Cost Function", and
``lib/llm/src/kv_router/scheduler.rs``)::

    cost(w) = overlap_weight x (B - overlap(w)) + inflight_blocks(w)

- ``overlap(w)``: the prompt's leading pages ``w`` holds (pages are SGLang's chained page hashes,
  pd.util.kv_block_hash.page_hashes, the ``block_hashes`` the workers publish), counting the pages of
  prompts the router sent ``w`` in the last ``PENDING_SECS`` that no event has reported yet: a prefill
  stores a prompt only once it computed it, and a burst of one tenant's requests would otherwise land
  on every worker before the first event (Dynamo's router likewise predicts the blocks it just routed);
- ``inflight_blocks(w)``: prompt pages the requests the router sent to ``w`` make it compute (their pages
  minus the overlap counted when they were sent) whose prefill has not answered yet (Dynamo's "active
  blocks", counted on the prefill side: the work queued there);
- ``overlap_weight``: ``--kv-overlap-weight`` (Dynamo's ``kv-overlap-score-weight``, default 1.0).

Equal costs go to the worker with the larger overlap (it keeps one copy of a prefix: a burst of one tenant's
requests otherwise ties its first worker's queue against a cold worker's compute), then to the one whose index
holds the fewest pages (cache_aware's rule for a miss: new prefixes spread over the caches), then round-robin.

The prompt's token ids are the engines' (pd.router.kv_tokenizer): the request's ``input_ids`` (or a
completion's id prompt); a text prompt tokenized with the workers' tokenizer (``/model_info``'s
``tokenizer_path``, BOS prepended); a chat prompt rendered with that tokenizer's chat template over the messages'
roles and text contents, as the engine renders it. Text and chat prompts are tokenized lazily, a chunk at a
time, only as far as some worker holds (or was just sent) their pages, and a prompt whose first
``GATE_CHARS`` characters no prompt routed lately had is placed as a miss without being tokenized at all. On a
prefix-free workload of ~1000-token prompts (benchmarks/results/kv_router_cpu.md, same run, 2 shared cores) the
router's CPU per request is 1.19x ``round_robin``'s for text and 1.24x for chats (``cache_aware``: 1.22x and
1.28x); tokenizing every prompt whole, as this policy did before, cost 16x. The price: the first prompt of a
prefix this router has not seen lately is placed blind (a prefix another router cached, or a first page shared
with a prompt that differs within its first ``GATE_CHARS`` characters); its later ones are not.

Fallbacks to the approximate ``cache_aware`` (its radix tree is fed only the decisions it made or estimated:
feeding it every decision cost more CPU than the rest of this policy), each counted in
``pdserve_router_kv_fallbacks_total{reason}``:

- ``no_token_ids``: text without a tokenizer (not loaded yet), or a chat whose tokenizer has no chat
  template: the whole decision is ``cache_aware``'s;
- ``no_live_events``: no candidate's events are live: the whole decision is ``cache_aware``'s;
- ``worker_events_stale``: a candidate not followed (no event source yet) or whose events stopped (none
  for ``--kv-stale-secs`` after it was sent a prompt with pages it lacked) gets ``overlap(w)``
  estimated from ``cache_aware``'s tree of what the router sent it.

A joining prefill's ``/server_info`` ``kv_events`` block says where it publishes (a wildcard host is
the worker's own); a worker that does not answer yet is tried again every ``--kv-attach-retry-secs``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Optional

import httpx
import zmq

from pd.router.config import RouterSettings
from pd.router.kv_index import KVIndexManager
from pd.router.kv_pending import SentPages
from pd.router.kv_plan import KvPlan
from pd.router.kv_source import event_source
from pd.router.kv_tokenizer import PromptTokenizer, load_tokenizer
from pd.router.policies import POLICIES, CacheAware, Policy, PromptKey

if TYPE_CHECKING:
    from pd.router.metrics import CounterValue, RouterMetrics
    from pd.router.workers import Worker

log = logging.getLogger("pd.router")

FALLBACK_REASONS = ("no_token_ids", "no_live_events", "worker_events_stale")
_NO_EVENTS_RETRY = 12  # a worker that publishes nothing is asked again after this many retry intervals
# s a sent prompt's pages count as held before the worker's event reports them: its queue and prefill time
# under load; later, the events are the truth (an evicted or failed prompt stops counting)
PENDING_SECS = 10.0
# A text or chat prompt whose first GATE_CHARS characters no prompt routed before had is placed as a miss without
# being tokenized (the prefix-free fast path; its pages are found if a later prompt shares them). Fewer
# characters than a 16-token page of text spans, so prompts sharing a first page share them too.
GATE_CHARS = 48
KNOWN_GATES = 65536  # first characters of recent prompts remembered (LRU): ~100 bytes each


def kv_cost(total_blocks: int, overlap_blocks: int, inflight_blocks: int, overlap_weight: float) -> float:
    """Dynamo's KV router cost of one worker (see the module docstring), in KV pages; lower is better."""
    return overlap_weight * (total_blocks - overlap_blocks) + inflight_blocks


class KvAware(Policy):
    """Prefill pairing by Dynamo's KV cost over the workers' own KV events (``--prefill-policy kv_aware``).

    Raises:
        ValueError: made for the decode side (its cache saves no prefill work; pd.router.config refuses it).
    """

    name = "kv_aware"
    uses_key = True

    def __init__(self, role: str, settings: RouterSettings):
        if role != "prefill":
            raise ValueError("kv_aware is a prefill policy")
        super().__init__(role, settings)
        self.cfg = settings.kv_aware
        self.approx = CacheAware(role, settings)
        self.kv = KVIndexManager()
        self.tokenizer: Optional[PromptTokenizer] = None
        self.known: OrderedDict[str, None] = OrderedDict()  # GATE_CHARS of the prompts routed lately
        self.workers: dict[str, Worker] = {}
        self.block_size: dict[str, int] = {}  # followed workers' page size
        self.retry_at: dict[str, float] = {}  # workers not followed yet: when to read their /server_info next
        self.expect: dict[str, float] = {}  # url -> when (epoch s) it was sent pages it lacked, no event since
        self.pending: dict[str, SentPages] = {}  # url -> pages sent there and not reported yet
        self.metrics: Optional[RouterMetrics] = None
        self.fallbacks: dict[str, CounterValue] = {}
        self._http: Optional[httpx.AsyncClient] = None
        self._tokenizer_asked = False
        self._attaching: set[str] = set()
        self._tasks: set[asyncio.Task] = set()

    # ---- membership ------------------------------------------------------------------------------
    def bind(self, metrics):
        """Keep the router's metrics: fallback counters, per-worker series, gauges refreshed per scrape."""
        self.metrics = metrics
        self.fallbacks = {r: metrics.kv_fallbacks.labels(r) for r in FALLBACK_REASONS}
        metrics.refreshers.append(self._refresh)
        for w in self.workers.values():
            self._bind_worker(w)

    def _bind_worker(self, worker: "Worker") -> None:
        if self.metrics is not None:
            worker.kv_counters = (self.metrics.kv_predicted.labels(worker.url),
                                  self.metrics.kv_reported.labels(worker.url))

    def joined(self, worker):
        """Follow the new prefill's KV events as soon as its ``/server_info`` says where they are."""
        self.workers[worker.url] = worker
        self.retry_at[worker.url] = 0.0
        self._bind_worker(worker)
        if self._http is not None:
            self._spawn(self._attach(worker.url))

    def forget(self, worker):
        """Stop following a removed prefill and drop its pages and series."""
        url = worker.url
        self.approx.forget(worker)
        self.workers.pop(url, None)
        self.retry_at.pop(url, None)
        self.expect.pop(url, None)
        self.pending.pop(url, None)
        self.block_size.pop(url, None)
        worker.kv_counters = None
        if self._http is not None:
            self._spawn(self.kv.remove_worker(url))
        if self.metrics is not None:
            for family in (self.metrics.kv_predicted, self.metrics.kv_reported, self.metrics.kv_events_lag,
                           self.metrics.kv_index_blocks):
                try:
                    family.remove(url)
                except KeyError:
                    pass

    def start(self, http):
        """Start reading the workers' event sources (and retrying those not up yet)."""
        self._http = http
        self._spawn(self._maintain())

    async def stop(self):
        """Stop the background work and every subscriber."""
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=2)
        await self.kv.close()

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _maintain(self) -> None:
        while True:
            now = time.monotonic()
            for url, at in list(self.retry_at.items()):
                if at <= now and url not in self._attaching:
                    self._spawn(self._attach(url))
            await asyncio.sleep(self.cfg.attach_retry_secs)

    async def _attach(self, url: str) -> None:
        """Read ``url``'s event source and follow it; on failure try again later (never raises)."""
        worker, http = self.workers.get(url), self._http
        if worker is None or http is None or url in self._attaching or url in self.block_size:
            return
        self._attaching.add(url)
        retry = self.cfg.attach_retry_secs
        try:
            async with asyncio.timeout(self.cfg.info_timeout_secs):
                r = await http.get(url + "/server_info", headers=worker.headers)
                r.raise_for_status()
                info = r.json()
            source = info.get("kv_events") if isinstance(info, dict) else None
            if not source:
                log.warning("prefill %s publishes no KV events: kv_aware estimates its cache as cache_aware does",
                            url)
                self.retry_at[url] = time.monotonic() + retry * _NO_EVENTS_RETRY
                return
            endpoint, replay, topic, block = event_source(url, source)
            if url not in self.workers:  # removed while we asked
                return
            self.kv.add_worker(url, endpoint, replay, topic)
            self.block_size[url] = block
            self.retry_at.pop(url, None)
            log.info("kv_aware: following KV events of %s at %s (pages of %d tokens)", url, endpoint, block)
            await self._load_tokenizer(worker, http)
        except (httpx.HTTPError, TimeoutError, ValueError, zmq.ZMQError) as e:
            log.info("kv_aware: no KV event source from %s yet (%s); trying again in %g s", url, e, retry)
            if url in self.workers:
                self.retry_at[url] = time.monotonic() + retry
        finally:
            self._attaching.discard(url)

    async def _load_tokenizer(self, worker: "Worker", http: httpx.AsyncClient) -> None:
        """Load the tokenizer ``worker``'s ``/model_info`` names, once per router (text prompts need it)."""
        if self._tokenizer_asked:
            return
        self._tokenizer_asked = True
        try:
            async with asyncio.timeout(self.cfg.info_timeout_secs):
                r = await http.get(worker.url + "/model_info", headers=worker.headers)
                r.raise_for_status()
                path = r.json().get("tokenizer_path")
            if not isinstance(path, str) or not path:
                raise ValueError("no tokenizer_path in /model_info")
            started = time.monotonic()
            self.tokenizer = await asyncio.to_thread(load_tokenizer, path, self.cfg.tokenizer_cache_size)
            log.info("kv_aware: tokenizer of %s loaded in %.1f s", path, time.monotonic() - started)
        except (httpx.HTTPError, TimeoutError) as e:
            self._tokenizer_asked = False  # the next worker to attach asks again
            log.info("kv_aware: no /model_info from %s (%s)", worker.url, e)
        except Exception as e:  # ImportError, a path only the worker's host has, a broken tokenizer
            log.warning("kv_aware: no tokenizer (%s): text prompts are routed as cache_aware does", e)

    # ---- deciding --------------------------------------------------------------------------------
    def _plan(self, key) -> Optional[KvPlan]:
        """The key's plan (made once per request): its ids, or its text or chat messages to tokenize lazily;
        None without token ids (no tokenizer yet, or a chat it cannot render)."""
        if not isinstance(key, PromptKey):
            return None
        if key.kv is not None:
            return key.kv
        if key.kind == "ids":
            key.kv = KvPlan(key.token_ids())
            return key.kv
        tok = self.tokenizer
        if tok is None or key.kind not in ("text", "chat") or key.kind == "chat" and (
                key.messages is None or not tok.has_chat_template):
            return None
        gate = key[:GATE_CHARS]
        known = gate in self.known
        if not known:  # first in, first out: a prefix still in use is seen again when it comes back
            self.known[gate] = None
            if len(self.known) > KNOWN_GATES:
                self.known.popitem(last=False)
        # str(key): a copy, not the key the plan is kept on (a reference cycle would wait for the garbage
        # collector); a chat's plan keeps the routing key's text only for its length estimate
        plan = key.kv = KvPlan(tokenizer=tok, text=str(key), messages=key.messages if key.kind == "chat" else None,
                               gate=gate, known=known)
        return plan

    def live(self, url: str, now: float) -> bool:
        """Whether ``url``'s KV events can be trusted: followed, and not silent for ``stale_secs`` since it
        was sent pages it lacked (``now`` in seconds since the epoch)."""
        if url not in self.block_size or not self.kv.following(url):
            return False
        since = self.expect.get(url)
        if since is None:
            return True
        last = self.kv.last_received_at(url)
        if last is not None and last >= since:
            del self.expect[url]
            return True
        return now - since <= self.cfg.stale_secs

    def _held(self, urls: list[str], plan: KvPlan, block: int) -> dict[str, int]:
        """Leading prompt pages each of ``urls`` holds by its events or was just sent; the prompt is tokenized
        and hashed page by page only as far as some worker still holds it (a miss costs its first page)."""
        if not plan.known:  # a prompt no recent one began like: a miss everywhere, not tokenized
            return dict.fromkeys(urls, 0)
        now = time.monotonic()
        held = {}
        for url in urls:
            pages, sent = self.kv.index.pages(url), self.pending.get(url)
            k, prev = 0, None
            while True:
                h = plan.page(block, k)
                if h is None or not (h in pages or sent is not None and sent.holds(h, prev, k, block, plan, now)):
                    break
                k, prev = k + 1, h
            held[url] = k
        return held

    def _remake(self, text: str, messages: Optional[tuple[tuple[Any, str], ...]]) -> KvPlan:
        """The plan of a prompt sent untokenized, made again when a later prompt asks for its pages."""
        return KvPlan(tokenizer=self.tokenizer, text=text, messages=messages, known=True)

    def _remember_sent(self, url: str, plan: KvPlan, block: int) -> None:
        """The pages of a prompt just sent to ``url`` count as held there for ``PENDING_SECS``."""
        sent = self.pending.get(url)
        if sent is None:
            sent = self.pending[url] = SentPages(PENDING_SECS, self._remake)
        sent.remember(plan, block, time.monotonic())

    def _estimate(self, worker: "Worker", key: PromptKey, plan: KvPlan, block: int) -> int:
        """Leading prompt pages ``worker`` holds, estimated from cache_aware's tree of the prompts sent to it."""
        matched = self.approx.tree(worker).match(key)  # characters: tokens for ids, text otherwise
        tokens = plan.tokens()
        estimate = matched if key.kind == "ids" else matched * tokens // max(1, len(key))
        return min(tokens // block, estimate // block)

    def pick(self, candidates, key):
        """The lowest ``kv_cost``; cache_aware's pick without token ids or without any live events."""
        plan = self._plan(key)
        if plan is None:
            self._fallback("no_token_ids")
            return self.approx.pick(candidates, key)
        now = time.time()
        if not plan.known:  # the prefix-free fast path: a miss everywhere, nothing tokenized
            for w in candidates:
                if not self.live(w.url, now):
                    break
            else:
                return self._pick_miss(candidates, plan)
        live = [self.live(w.url, now) for w in candidates]
        if not any(live):
            self._fallback("no_live_events")
            return self.approx.pick(candidates, key)
        if not all(live):
            self._fallback("worker_events_stale")
        default_block = next(self.block_size[w.url] for w, ok in zip(candidates, live) if ok)
        overlaps: dict[str, tuple[int, int, bool]] = {}
        by_block: dict[int, list[str]] = {}
        for w, ok in zip(candidates, live):
            block = self.block_size.get(w.url, default_block)
            if ok:
                by_block.setdefault(block, []).append(w.url)
            else:
                overlaps[w.url] = (plan.tokens() // block, self._estimate(w, key, plan, block), False)
        for block, urls in by_block.items():
            held = self._held(urls, plan, block)
            pages = plan.tokens() // block  # after the walk: as exact as the tokens it needed
            for url in urls:
                overlaps[url] = (max(pages, held[url]), held[url], True)
        plan.overlaps = overlaps
        w_ = self.cfg.overlap_weight
        costs = [kv_cost(*overlaps[w.url][:2], w.prompt_blocks, w_) for w in candidates]
        best = min(costs)
        tied = [w for w, c in zip(candidates, costs) if c == best]
        most = max(overlaps[w.url][1] for w in tied)  # equal cost: the one that keeps the prefix cached once
        tied = [w for w in tied if overlaps[w.url][1] == most]
        if len(tied) > 1:  # then the emptiest cache, as cache_aware picks for a miss: new prefixes spread out
            least = min(self.kv.index.size(w.url) for w in tied)
            tied = [w for w in tied if self.kv.index.size(w.url) == least]
        return tied[next(self._turn) % len(tied)]

    def _pick_miss(self, candidates, plan: KvPlan):
        """``pick`` for a prompt no worker holds (``kv_cost`` is then the pages in flight plus a constant)."""
        # the least in flight, then the emptiest cache, then round-robin; few allocations: a prefix-free request's
        # garbage is most of what this policy adds to the router's collector
        least = min(w.prompt_blocks for w in candidates)
        tied = [w for w in candidates if w.prompt_blocks == least]
        if len(tied) > 1:
            index = self.kv.index
            emptiest = min(index.size(w.url) for w in tied)
            tied = [w for w in tied if index.size(w.url) == emptiest]
        chosen = tied[next(self._turn) % len(tied)]
        plan.overlaps = {chosen.url: (plan.tokens() // self.block_size[chosen.url], 0, True)}
        return chosen

    def picked(self, worker, key):
        """On the key's plan, record this decision's pages and prediction; feed cache_aware's tree with the
        decisions it made or estimated (only those: keeping it warm on every decision costs more router CPU
        than the rest of this policy, benchmarks/results/kv_router_cpu.md)."""
        plan = self._plan(key)  # made by pick(), or here when the only candidate skipped it
        if plan is None:
            self.approx.picked(worker, key)
            return
        url = worker.url
        got = plan.overlaps.get(url) if plan.overlaps is not None else None
        if got is None:  # the only candidate: pick() did not run
            block = self.block_size.get(url) or next(iter(self.block_size.values()), 0)
            if not block:
                plan.worker = None
                return
            exact = self.live(url, time.time())
            held = self._held([url], plan, block)[url] if exact else self._estimate(worker, key, plan, block)
            got = (max(plan.tokens() // block, held), held, exact)
        plan.overlaps = None
        pages, held, exact = got
        if not exact:
            self.approx.picked(worker, key)
        block = self.block_size.get(url, 0)
        plan.worker, plan.blocks = worker, pages - held  # the pages it makes ``worker`` compute
        # the engine computes at least the prompt's last token: a hit stops a page short of a full prompt (an
        # incomplete plan stopped at a page it lacks, before its last token)
        if not exact:
            plan.predicted = None
        elif plan.complete:
            plan.predicted = min(held, (len(plan.ids) - 1) // block) * block
        else:
            plan.predicted = held * block
        if held < pages and url not in self.expect:
            self.expect[url] = time.time()  # it will store pages: an event should follow
        if block:
            self._remember_sent(url, plan, block)

    def _fallback(self, reason: str) -> None:
        counter = self.fallbacks.get(reason)
        if counter is not None:
            counter.inc()

    def _refresh(self) -> None:
        """Per-worker gauges of the event streams, at scrape time."""
        m = self.metrics
        if m is None:
            return
        m.kv_tokenizer_ready.set(1 if self.tokenizer is not None else 0)
        now, stats = time.time(), self.kv.stats()
        for url in self.block_size:
            st = stats.get(url)
            last = st.last_received_at if st is not None else None
            m.kv_events_lag.labels(url).set(now - last if last is not None else -1)
            m.kv_index_blocks.labels(url).set(self.kv.index.size(url))


POLICIES[KvAware.name] = KvAware
