"""The radix prefix cache (pd.engines.prefix): matching, insertion, locking, LRU eviction, page
conservation under random operation sequences, disable mode and SGLang-compatible KV event hashes."""

from __future__ import annotations

import hashlib
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

# SGLang's own int64 conversion is the oracle for the event hash (pure Python in the wheel).
from sglang.srt.mem_cache.utils import hash_str_to_int64

from pd.engines.prefix import Cleared, RadixCache, Removed, Stored, page_hashes


class Pages:
    """Hands out fresh page ids, as the pool would."""

    def __init__(self):
        self.next = 1000

    def take(self, n: int) -> list[int]:
        self.next += n
        return list(range(self.next - n, self.next))


def _cache(page_size=2, **kw):
    events = []
    return RadixCache(page_size, on_event=events.append, **kw), events


def _oracle_hashes(tokens, page_size):
    """SHA-256 chain over uint32 pages, converted with SGLang's hash_str_to_int64."""
    out, prior = [], b""
    for start in range(0, len(tokens) // page_size * page_size, page_size):
        digest = hashlib.sha256(prior + array("I", tokens[start : start + page_size]).tobytes()).digest()
        out.append((digest, hash_str_to_int64(digest.hex())))
        prior = digest
    return out


# ----- hashing -----

@pytest.mark.parametrize("page_size", [1, 2, 16])
def test_page_hashes_match_sglang_scheme(page_size):
    assert array("I").itemsize == 4
    tokens = [0, 1, 2**31, 2**32 - 1, 151643, 7, 9, 11] * 5
    got = page_hashes(tokens, page_size)
    assert got == _oracle_hashes(tokens, page_size)
    assert len(got) == len(tokens) // page_size
    assert any(h < 0 for _, h in _oracle_hashes(list(range(64)), 1)), "sign conversion not exercised"


def test_page_hashes_chain_from_prior_digest_and_ignore_partial_page():
    tokens = list(range(10))
    whole = page_hashes(tokens, 4)
    assert len(whole) == 2
    assert page_hashes(tokens[4:], 4, prior_digest=whole[0][0]) == whole[1:]
    assert page_hashes(tokens[4:8], 4) != whole[1:]


def test_page_hashes_reject_bad_input():
    with pytest.raises(ValueError):
        page_hashes([1, 2], 0)
    with pytest.raises(ValueError):
        page_hashes([1, 2**32], 2)
    with pytest.raises(ValueError):
        page_hashes([-1, 2], 2)
    with pytest.raises(ValueError):
        page_hashes([1, 2], 2, prior_digest=b"short")


# ----- match and insert -----

def test_match_after_insert_full_partial_and_unaligned():
    cache, _ = _cache(page_size=2)
    assert cache.insert([1, 2, 3, 4, 5, 6], [10, 11, 12]) == 0
    assert cache.match_prefix([1, 2, 3, 4, 5, 6])[:2] == ([10, 11, 12], 6)
    # Non-page-aligned prompts only match whole pages.
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7])[:2] == ([10, 11, 12], 6)
    assert cache.match_prefix([1, 2, 3, 4, 5])[:2] == ([10, 11], 4)
    assert cache.match_prefix([1, 2, 3])[:2] == ([10], 2)
    assert cache.match_prefix([1])[:2] == ([], 0)
    # A divergence inside a page loses the whole page.
    assert cache.match_prefix([1, 2, 3, 9, 5, 6])[:2] == ([10], 2)
    pages, n, node = cache.match_prefix([7, 8])
    assert (pages, n, node) == ([], 0, cache.root)


def test_mid_edge_match_splits_at_page_boundary():
    cache, events = _cache(page_size=2)
    cache.insert([1, 2, 3, 4, 5, 6], [10, 11, 12])
    full_node = cache.match_prefix([1, 2, 3, 4, 5, 6])[2]
    pages, n, node = cache.match_prefix([1, 2, 3, 4, 9, 9])
    assert (pages, n) == ([10, 11], 4)
    assert node.tokens == (1, 2, 3, 4) and node.pages == [10, 11]
    assert full_node.parent is node and full_node.tokens == (5, 6) and full_node.pages == [12]
    assert list(node.children.values()) == [full_node]
    # Hashes split with the pages; a split is not a storage change, so no events.
    assert node.hashes + full_node.hashes == [h for _, h in page_hashes([1, 2, 3, 4, 5, 6], 2)]
    assert len(events) == 2  # Cleared at construction, one Stored
    # The old handle stays valid after the split.
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]) == ([10, 11, 12], 6, full_node)


def test_insert_returns_duplicate_page_count_and_branches():
    cache, _ = _cache(page_size=2)
    assert cache.insert([1, 2, 3, 4], [10, 11]) == 0
    # The same prefix again: both pages are duplicates the caller frees.
    assert cache.insert([1, 2, 3, 4], [20, 21]) == 2
    assert cache.match_prefix([1, 2, 3, 4])[0] == [10, 11]
    # Extending: the first two are duplicates, the third enters the tree.
    assert cache.insert([1, 2, 3, 4, 5, 6, 7], [30, 31, 32, 33]) == 2
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7])[:2] == ([10, 11, 32], 6)
    # A branch inside an edge splits it; one page is shared.
    assert cache.insert([1, 2, 8, 8], [40, 41]) == 1
    assert cache.match_prefix([1, 2, 8, 8])[0] == [10, 41]
    assert sorted(cache.all_pages()) == [10, 11, 32, 41]
    assert cache.evictable_size() == 8 and cache.protected_size() == 0


def test_insert_with_matched_prefix_pages_protocol():
    """The engine's flow: match, lock, compute the rest, insert all pages, free the new duplicates."""
    cache, _ = _cache(page_size=2)
    cache.insert([1, 2, 3, 4], [10, 11])
    prefix_pages, matched, node = cache.match_prefix([1, 2, 3, 4, 5, 6])
    cache.inc_lock_ref(node)
    # Meanwhile another request cached the same continuation.
    cache.insert([1, 2, 3, 4, 5, 6], [50, 51, 52])
    mine = prefix_pages + [60]
    dup = cache.insert([1, 2, 3, 4, 5, 6], mine)
    assert dup == 3
    to_free = mine[matched // 2 : dup]
    assert to_free == [60]
    cache.dec_lock_ref(node)
    assert sorted(cache.all_pages()) == [10, 11, 52]


def test_insert_rejects_bad_page_lists():
    cache, _ = _cache(page_size=2)
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3, 4], [10])
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3, 4], [10, 11, 12])
    cache.insert([1, 2, 3, 4, 5], [10, 11, 12])  # the partial page's id is allowed, not taken
    assert sorted(cache.all_pages()) == [10, 11]
    with pytest.raises(ValueError):
        cache.insert([7, 7], [11])  # already in the tree: would be freed twice
    with pytest.raises(ValueError):
        cache.insert([7, 7, 8, 8], [20, 20])


# ----- locking and eviction -----

def test_locked_paths_are_never_evicted_and_lru_order():
    cache, _ = _cache(page_size=1)
    cache.insert([1, 2], [10, 11])
    cache.insert([3, 4], [12, 13])
    cache.insert([5, 6], [14, 15])
    _, _, node = cache.match_prefix([1, 2])  # 1,2 is now the most recently used
    cache.inc_lock_ref(node)
    assert cache.protected_size() == 2 and cache.evictable_size() == 4
    assert cache.evict(1) == [12, 13]  # LRU unlocked leaf, whole node
    assert cache.evict(100) == [14, 15]
    assert cache.evict(100) == []
    assert sorted(cache.all_pages()) == [10, 11]
    assert cache.dec_lock_ref(node) == 2
    assert cache.evictable_size() == 2 and cache.protected_size() == 0
    assert cache.evict(1) == [10, 11]
    assert cache.all_pages() == []


def test_lock_below_protects_ancestors_and_parents_become_leaves():
    cache, _ = _cache(page_size=1)
    cache.insert([1, 2, 3], [10, 11, 12])
    cache.insert([1, 2, 4], [10, 11, 13])  # splits: [1,2] -> {[3], [4]}
    cache.insert([9], [20])
    cache.match_prefix([9])
    cache.match_prefix([1, 2, 3])
    # Leaves by last access: [4] (its insert), [9], [3]; [1,2] is a leaf only once both children go.
    assert cache.evict(1) == [13]
    assert cache.evict(1) == [20]
    assert cache.evict(1) == [12]
    assert cache.evict(1) == [10, 11]
    assert cache.all_pages() == []
    cache.insert([1, 2, 3], [10, 11, 12])
    _, _, leaf = cache.match_prefix([1, 2, 3])
    _, _, mid = cache.match_prefix([1])  # splits the edge above the leaf
    cache.inc_lock_ref(leaf)
    assert mid.lock_ref == 1 and cache.evict(10) == []
    cache.dec_lock_ref(leaf)
    assert mid.lock_ref == 0
    # One call evicts the leaf and then its parent, which became a leaf.
    assert cache.evict(10) == [11, 12, 10]


def test_lock_errors_and_stale_handles():
    cache, _ = _cache(page_size=1)
    cache.insert([1], [10])
    _, _, node = cache.match_prefix([1])
    with pytest.raises(ValueError):
        cache.dec_lock_ref(node)
    cache.inc_lock_ref(cache.root)  # a no-op, as in SGLang
    cache.dec_lock_ref(cache.root)
    assert cache.evict(1) == [10]
    with pytest.raises(ValueError):
        cache.inc_lock_ref(node)
    with pytest.raises(ValueError):
        cache.evict(-1)
    other = RadixCache(1)
    other.insert([1], [10])
    with pytest.raises(ValueError):
        cache.inc_lock_ref(other.match_prefix([1])[2])


def test_split_of_locked_edge_keeps_lock_accounting():
    cache, _ = _cache(page_size=2)
    cache.insert([1, 2, 3, 4], [10, 11])
    _, _, node = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock_ref(node)
    _, _, upper = cache.match_prefix([1, 2, 9, 9])
    assert upper.lock_ref == 1 and cache.protected_size() == 4
    cache.insert([1, 2, 5, 5], [20, 21])
    assert cache.evict(10) == [21]  # the new sibling only
    cache.dec_lock_ref(node)
    assert cache.protected_size() == 0 and cache.evictable_size() == 4
    assert sorted(cache.evict(10)) == [10, 11]


# ----- disable mode and reset -----

def test_disable_mode_caches_nothing():
    cache, events = _cache(page_size=2, disable=True)
    assert cache.insert([1, 2, 3, 4], [10, 11]) == 0
    assert cache.match_prefix([1, 2, 3, 4]) == ([], 0, cache.root)
    assert cache.inc_lock_ref(cache.root) == 0 and cache.dec_lock_ref(cache.root) == 0
    assert cache.evict(10) == [] and cache.reset() == [] and cache.all_pages() == []
    assert cache.evictable_size() == 0 and events == []


def test_reset_returns_all_pages_and_emits_cleared():
    cache, events = _cache(page_size=2)
    assert events == [Cleared()]
    cache.insert([1, 2, 3, 4], [10, 11])
    cache.insert([1, 2, 5, 6], [12, 13])
    _, _, node = cache.match_prefix([1, 2, 5, 6])
    cache.inc_lock_ref(node)
    events.clear()
    assert sorted(cache.reset()) == [10, 11, 13]
    assert events == [Cleared()]
    assert cache.all_pages() == [] and cache.evictable_size() == 0 and cache.protected_size() == 0
    assert cache.match_prefix([1, 2])[:2] == ([], 0)
    with pytest.raises(ValueError):
        cache.dec_lock_ref(node)


# ----- events -----

def test_events_carry_sglang_block_hashes():
    cache, events = _cache(page_size=2)
    events.clear()
    cache.insert([1, 2, 3, 4, 5], [10, 11, 12])
    cache.insert([1, 2, 3, 4, 7, 8, 9, 9], [10, 11, 20, 21])
    oracle_a = _oracle_hashes([1, 2, 3, 4], 2)
    oracle_b = _oracle_hashes([1, 2, 3, 4, 7, 8, 9, 9], 2)
    assert events == [
        Stored([h for _, h in oracle_a], None, [1, 2, 3, 4], 2),
        Stored([h for _, h in oracle_b[2:]], oracle_b[1][1], [7, 8, 9, 9], 2),
    ]
    events.clear()
    cache.match_prefix([1, 2, 9])  # split: no event
    assert events == []
    assert cache.evict(1) == [20, 21]
    assert events == [Removed([h for _, h in oracle_b[2:]])]
    assert sorted(cache.evict(10)) == [10, 11]
    assert events[1:] == [Removed([oracle_a[1][1]]), Removed([oracle_a[0][1]])]


# ----- conservation under random operation sequences -----

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.lists(st.integers(0, 2), max_size=9)),
        st.tuples(st.just("extend"), st.lists(st.integers(0, 2), max_size=9)),
        st.tuples(st.just("lock"), st.lists(st.integers(0, 2), max_size=9)),
        st.tuples(st.just("unlock"), st.integers(0, 10)),
        st.tuples(st.just("evict"), st.integers(0, 6)),
        st.tuples(st.just("reset"), st.just(0)),
    ),
    max_size=40,
)


@settings(max_examples=400, deadline=None)
@given(page_size=st.sampled_from([1, 2, 3]), ops=OPS)
def test_random_sequences_conserve_pages(page_size, ops):
    live_hashes: set[int] = set()

    def on_event(ev):
        if isinstance(ev, Cleared):
            live_hashes.clear()
        elif isinstance(ev, Stored):
            assert ev.parent_block_hash is None or ev.parent_block_hash in live_hashes
            assert not live_hashes.intersection(ev.block_hashes)
            assert len(ev.token_ids) == len(ev.block_hashes) * ev.block_size
            live_hashes.update(ev.block_hashes)
        else:
            assert live_hashes.issuperset(ev.block_hashes)
            live_hashes.difference_update(ev.block_hashes)

    cache = RadixCache(page_size, on_event=on_event)
    pool = Pages()
    given_pages: set[int] = set()
    returned: list[int] = []
    locks = []

    def fresh(n):
        got = pool.take(n)
        given_pages.update(got)
        return got

    for op, arg in ops:
        if op == "insert":
            pages = fresh(-(-len(arg) // page_size))
            full = len(arg) // page_size
            dup = cache.insert(arg, pages)
            returned.extend(pages[:dup])
            returned.extend(pages[full:])  # the partial page never enters the tree
        elif op == "extend":
            # Match, lock, add pages for the rest, insert, free only the caller's own duplicates.
            prefix, matched, node = cache.match_prefix(arg)
            assert matched == len(prefix) * page_size and matched <= len(arg)
            cache.inc_lock_ref(node)
            pages = prefix + fresh(-(-len(arg) // page_size) - len(prefix))
            dup = cache.insert(arg, pages)
            assert dup >= len(prefix)
            returned.extend(pages[len(prefix) : dup])
            returned.extend(pages[len(arg) // page_size :])
            cache.dec_lock_ref(node)
        elif op == "lock":
            node = cache.match_prefix(arg)[2]
            cache.inc_lock_ref(node)
            locks.append(node)
        elif op == "unlock" and locks:
            cache.dec_lock_ref(locks.pop(arg % len(locks)))
        elif op == "evict":
            locked = set()
            for node in locks:
                while node is not cache.root:
                    locked.update(node.pages)
                    node = node.parent
            before = set(cache.all_pages())
            got = cache.evict(arg)
            assert not locked.intersection(got), "evicted a locked page"
            assert len(got) >= arg or set(got) == before - locked
            returned.extend(got)
        elif op == "reset":
            returned.extend(cache.reset())
            locks.clear()

        held = cache.all_pages()
        assert len(set(held)) == len(held), "a page is in the tree twice"
        assert len(set(returned)) == len(returned), "a page was returned twice"
        assert not set(held).intersection(returned), "a returned page is still in the tree"
        assert set(held) | set(returned) == given_pages, "a page was lost"
        assert cache.evictable_size() + cache.protected_size() == len(held) * page_size
        assert live_hashes == {h for n in cache._nodes() for h in n.hashes}

    for node in locks:
        cache.dec_lock_ref(node)
    assert cache.protected_size() == 0
    returned.extend(cache.evict(len(given_pages) + 1))
    assert cache.all_pages() == [] and not live_hashes
    assert sorted(returned) == sorted(given_pages)
