"""docs/api.md's `radixkv.scheduler`: the CacheManager (free pages + prefix cache + requests)
and the ReqToTokenPool.

A page is always in exactly one of three places: free, cached (its slots are
stored in the prefix cache), or held by a request (between `allocate` and its
return through `free`, `free_and_cache_finished_req` or `cache_unfinished_req`).
Most tests drive the engine flow

    handle, cached = cm.match_req(ids); cm.lock(handle)
    own = cm.allocate(len(ids) - handle.cached_len)
    indices = cat(cached, own)
    ... cm.cache_unfinished_req(handle, ids, indices) -> (handle, indices) ...
    cm.free_and_cache_finished_req(handle, ids, indices)

and check, after every step, both `check_integrity()` and an independent
accounting built here: the exact free list (read without disturbing it), the
pages stored in the tree (from `dump()`), and the pages each request holds.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import radixkv
from radixkv.kvcache import NaiveCacheManager, RadixCacheManager
from radixkv.scheduler import CacheManager, ReqToTokenPool
from assertions import raises


def seq(n, start=0):
    return list(range(start, start + n))


def ceil_pages(n, p):
    return -(-n // p)


# --- independent views of the state -------------------------------------------------


def free_pages(cm):
    """The free list, bottom to top, read by taking every free page and giving
    them back as one batch, which restores the stack exactly (a batch comes
    back out in its own order)."""
    a, p = cm._pages, cm.page_size
    k = a.num_free_pages
    if k == 0:
        return []
    pages = a.allocate(k * p)
    assert bool((pages.view(k, p)[:, 0] % p == 0).all())
    a.free(pages)
    return (pages[::p] // p).flip(0).tolist()


def cached_slots(cm):
    if not isinstance(cm.manager, RadixCacheManager):
        return []
    return [s for node in cm.manager.dump() for s in node[2]]


def cached_pages(cm):
    p = cm.page_size
    slots = cached_slots(cm)
    pages = {s // p for s in slots}
    assert len(slots) == len(pages) * p, "cached slots are not whole pages"
    return pages


def dump(cm):
    return cm.manager.dump() if isinstance(cm.manager, RadixCacheManager) else None


def state(cm):
    """Everything an erroring call must leave alone."""
    return (
        free_pages(cm),
        cm.held_pages,
        cm.manager.size_info,
        dump(cm),
        cm._pages.num_free_pages,
        cm.available_size,
    )


def check(cm):
    """check_integrity plus the accounting identities of docs/api.md."""
    cm.check_integrity()
    p = cm.page_size
    info = cm.manager.size_info
    free = cm._pages.num_free_pages
    assert cm.available_size == free * p + info.evictable_size
    assert info.total_size % p == 0
    assert free + info.total_size // p + cm.held_pages == cm.num_pages
    fl = free_pages(cm)
    assert len(fl) == len(set(fl)) == free
    assert not set(fl) & cached_pages(cm)


def assert_whole_pages(slots, p, count=None):
    slots = slots.tolist() if isinstance(slots, torch.Tensor) else list(slots)
    assert len(slots) % p == 0
    if count is not None:
        assert len(slots) == count
    for i in range(0, len(slots), p):
        assert slots[i] % p == 0, f"page at {i} starts at {slots[i]}"
        assert slots[i : i + p] == seq(p, slots[i])
    assert len(set(slots)) == len(slots)


def pages_of(slots, p):
    return [int(s) // p for s in list(slots)[::p]]


class Req:
    """One request driven through the engine flow."""

    def __init__(self, cm, ids):
        self.cm = cm
        self.ids = list(ids)
        self.handle, matched = cm.match_req(self.ids)
        assert matched.dtype == torch.int32 and len(matched) == self.handle.cached_len
        cm.lock(self.handle)
        check(cm)
        own = cm.allocate(len(self.ids) - self.handle.cached_len)
        assert own.dtype == torch.int32
        self.indices = torch.cat([matched, own])
        assert len(self.indices) == ceil_pages(len(self.ids), cm.page_size) * cm.page_size
        check(cm)

    @property
    def cached_len(self):
        return self.handle.cached_len

    def own_pages(self):
        return pages_of(self.indices[self.cached_len :].tolist(), self.cm.page_size)

    def finish(self):
        self.cm.free_and_cache_finished_req(self.handle, self.ids, self.indices)
        assert self.handle.lock_count == 0
        check(self.cm)

    def unfinished(self):
        old = self.handle
        self.handle, self.indices = self.cm.cache_unfinished_req(old, self.ids, self.indices)
        assert old.lock_count == 0 and self.handle.lock_count == 1
        check(self.cm)

    def extend(self, tokens):
        """Decode: append tokens, allocating pages when the last one is full."""
        p = self.cm.page_size
        self.ids += list(tokens)
        need = ceil_pages(len(self.ids), p) * p - len(self.indices)
        if need > 0:
            self.indices = torch.cat([self.indices, self.cm.allocate(need)])
            check(self.cm)

    def abort(self):
        self.cm.free(self.indices[self.cached_len :])
        self.cm.unlock(self.handle)
        check(self.cm)


def slots_in_tree(cm, ids):
    """The tree's slots for the longest cached prefix of ids (refreshes LRU only)."""
    _, idx = cm.manager.match_prefix(ids)
    return idx.tolist()


PS = [1, 4]
PS3 = [1, 4, 16]
TYPES = ["radix", "naive"]


# --- construction ---------------------------------------------------------------------


def test_construct_and_empty_state():
    for p in PS3:
        for t in TYPES:
            cm = CacheManager(10, p, t)
            assert cm.num_pages == 10 and cm.page_size == p and cm.held_pages == 0
            assert cm.available_size == 10 * p
            assert isinstance(cm.manager, RadixCacheManager if t == "radix" else NaiveCacheManager)
            assert free_pages(cm) == seq(10)[::-1]  # page 0 on top
            check(cm)
    assert CacheManager(0).available_size == 0


@pytest.mark.parametrize(
    "kwargs,exc,name",
    [
        (dict(num_pages=-1), ValueError, "num_pages"),
        (dict(num_pages=2.0), TypeError, "num_pages"),
        (dict(num_pages=True), TypeError, "num_pages"),
        (dict(num_pages=4, page_size=0), ValueError, "page_size"),
        (dict(num_pages=4, page_size=1.0), TypeError, "page_size"),
        (dict(num_pages=4, type="lru"), ValueError, "type"),
        (dict(num_pages=2**31, page_size=4), ValueError, "num_pages"),
    ],
)
def test_construct_errors(kwargs, exc, name):
    with raises(exc, name):
        CacheManager(**kwargs)


# --- the engine flow ------------------------------------------------------------------


@pytest.mark.parametrize("p", PS3)
@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 16, 17, 33])
def test_allocate_returns_whole_aligned_pages(p, n):
    cm = CacheManager(8, p)
    if ceil_pages(n, p) > 8:
        with raises(radixkv.OutOfCapacityError, "num_tokens"):
            cm.allocate(n)
        check(cm)
        return
    before = cm.available_size
    slots = cm.allocate(n)
    assert slots.dtype == torch.int32 and slots.device.type == "cpu"
    assert_whole_pages(slots, p, ceil_pages(n, p) * p)
    assert cm.held_pages == ceil_pages(n, p)
    assert cm.available_size == before - len(slots)
    check(cm)
    cm.free(slots)
    assert cm.held_pages == 0 and cm.available_size == before
    check(cm)


@pytest.mark.parametrize("p", PS3)
def test_allocations_are_disjoint_and_recycled(p):
    cm = CacheManager(12, p)
    a, b, c = cm.allocate(1), cm.allocate(3 * p), cm.allocate(p + 1)
    seen = pages_of(a, p) + pages_of(b, p) + pages_of(c, p)
    assert len(seen) == len(set(seen)) == 6 and cm.held_pages == 6
    cm.free(b)
    check(cm)
    d = cm.allocate(3 * p)
    assert sorted(pages_of(d, p)) == sorted(pages_of(b, p))  # freed pages come back first
    for x in (a, c, d):
        cm.free(x)
    check(cm)
    assert cm.held_pages == 0 and cm._pages.num_free_pages == 12


@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("p", PS3)
def test_engine_flow(p, t):
    cm = CacheManager(16, p, t)
    radix = t == "radix"
    prompt = seq(3 * p + 1, 100)
    r = Req(cm, prompt)
    assert r.cached_len == 0
    assert cm.held_pages == 4
    assert_whole_pages(r.indices, p, 4 * p)
    r.extend(seq(p, 500))  # decode a page worth of tokens
    assert cm.held_pages == 5
    r.finish()
    assert cm.held_pages == 0
    full = len(r.ids) - len(r.ids) % p
    if radix:
        assert cm.manager.size_info == (full, 0)
        assert cached_slots(cm) == r.indices[:full].tolist()
    else:
        assert cm.manager.size_info == (0, 0)
    assert cm._pages.num_free_pages + cm.manager.size_info.total_size // p == 16
    assert cm.available_size == 16 * p

    # A follow-up that shares the prompt reuses the cached pages.
    follow = prompt + seq(2 * p, 900)
    r2 = Req(cm, follow)
    expect = (len(prompt) - len(prompt) % p) if radix else 0
    assert r2.cached_len == expect
    if radix:
        assert r2.indices[:expect].tolist() == r.indices[:expect].tolist()
        assert cm.manager.size_info.protected_size == expect
    assert cm.held_pages == ceil_pages(len(follow), p) - expect // p
    r2.finish()
    assert cm.held_pages == 0
    if radix:
        assert cm.manager.size_info.protected_size == 0
    check(cm)


@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("p", PS)
def test_match_req_matches_all_but_the_last_token(p, t):
    cm = CacheManager(16, p, t)
    Req(cm, seq(4 * p, 10)).finish()
    for n in range(1, 4 * p + 2):
        ids = seq(n, 10)
        for form in (
            ids,
            np.array(ids, dtype=np.int64),
            torch.tensor(ids, dtype=torch.int32),
            torch.tensor(ids, dtype=torch.int64),
        ):
            h, idx = cm.match_req(form)
            want = ((min(n, 4 * p + 1) - 1) // p * p) if t == "radix" else 0
            assert h.cached_len == want == len(idx)
            assert idx.dtype == torch.int32
    check(cm)


@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("p", PS)
def test_match_req_without_skip_last_matches_every_token(p, t):
    """An engine whose input already stops where a prefix may be reused
    (SGLang's key) matches all of it; an empty input is the root."""
    cm = CacheManager(16, p, t)
    Req(cm, seq(4 * p + 1, 10)).finish()
    for n in range(0, 4 * p + 2):
        ids = seq(n, 10)
        for form in (ids, np.array(ids, dtype=np.int64), torch.tensor(ids, dtype=torch.int32)):
            for ns in (None, "tenant"):
                h, idx = cm.match_req(form, ns, skip_last=False)
                cached = (4 * p + 1) // p * p  # the whole pages Req cached
                want = min(n, cached) // p * p if t == "radix" and ns is None else 0
                assert h.cached_len == want == len(idx)
    before = state(cm)
    with raises(TypeError, "skip_last"):
        cm.match_req(seq(3), skip_last="no")
    assert state(cm) == before
    check(cm)


@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("p", PS)
def test_match_req_empty_input_raises(p, t):
    cm = CacheManager(8, p, t)
    Req(cm, seq(2 * p + 1)).finish()
    before = state(cm)
    for empty in ([], np.array([], dtype=np.int64), torch.tensor([], dtype=torch.int64)):
        with raises(ValueError, "input_ids"):
            cm.match_req(empty)
    with raises(TypeError, "input_ids"):
        cm.match_req(torch.tensor([1.0, 2.0]))
    with raises(ValueError, "input_ids"):
        cm.match_req(torch.tensor([[1, 2]]))
    assert state(cm) == before
    check(cm)


@pytest.mark.parametrize("p", PS)
def test_available_size_counts_free_and_evictable_not_locked(p):
    cm = CacheManager(12, p)
    Req(cm, seq(3 * p)).finish()
    Req(cm, seq(2 * p, 100)).finish()
    assert cm.available_size == 12 * p
    r = Req(cm, seq(3 * p) + [7])  # locks the first prefix (3 pages), holds 1 page
    assert cm.available_size == 12 * p - 3 * p - p
    assert cm.manager.size_info == (2 * p, 3 * p)
    r.finish()
    assert cm.available_size == 12 * p
    check(cm)


@pytest.mark.parametrize("p", PS)
def test_lock_unlock_errors(p):
    cm = CacheManager(8, p)
    other = CacheManager(8, p)
    Req(cm, seq(2 * p + 1)).finish()
    h, _ = cm.match_req(seq(2 * p + 1))
    before = state(cm)
    with raises(ValueError):
        cm.unlock(h)
    h2, _ = other.match_req([1, 2])
    with raises(ValueError):
        cm.lock(h2)
    with raises(TypeError, "handle"):
        cm.lock("handle")
    assert state(cm) == before and h.lock_count == 0
    cm.lock(h)
    cm.lock(h)
    assert h.lock_count == 2
    cm.unlock(h)
    cm.unlock(h)
    with raises(ValueError):
        cm.unlock(h)
    check(cm)


# --- chunked prefill ------------------------------------------------------------------


@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("p", PS3)
def test_chunked_prefill_then_decode(p, t):
    cm = CacheManager(32, p, t)
    radix = t == "radix"
    prompt = seq(5 * p + 2, 1000)
    chunk = 2 * p + 1
    h, matched = cm.match_req(prompt[:chunk])
    cm.lock(h)
    r = Req.__new__(Req)
    r.cm, r.handle, r.ids = cm, h, prompt[:chunk]
    r.indices = torch.cat([matched, cm.allocate(chunk)])
    check(cm)
    while len(r.ids) < len(prompt):
        own_tail = r.indices[len(r.ids) - len(r.ids) % p :].tolist()
        r.unfinished()
        full = len(r.ids) - len(r.ids) % p
        assert r.cached_len == (full if radix else 0)
        if radix:
            assert r.indices[:full].tolist() == slots_in_tree(cm, r.ids)
            assert r.indices[full:].tolist() == own_tail  # the partial page stays the request's
        assert cm.held_pages == len(r.own_pages())
        r.extend(prompt[len(r.ids) : len(r.ids) + chunk])
    r.extend(seq(3, 7000))  # decode
    r.finish()
    assert cm.held_pages == 0
    if radix:
        full = len(r.ids) - len(r.ids) % p
        assert cm.manager.size_info == (full, 0)
        assert slots_in_tree(cm, r.ids) == r.indices[:full].tolist()
    assert cm._pages.num_free_pages + cm.manager.size_info.total_size // p == 32


@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("p", PS)
def test_cache_unfinished_twice_without_progress_changes_nothing(p, t):
    cm = CacheManager(16, p, t)
    r = Req(cm, seq(3 * p + 1, 60))
    r.unfinished()
    first = (r.indices.tolist(), r.cached_len, cm.held_pages, free_pages(cm))
    r.unfinished()
    assert (r.indices.tolist(), r.cached_len, cm.held_pages, free_pages(cm)) == first
    r.finish()
    assert cm.held_pages == 0


# --- the known traps --------------------------------------------------------------------


@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("p", PS3)
@pytest.mark.parametrize("extra", [0, 1])
def test_trap_unfinished_request_keeps_tree_slots_not_freed_duplicates(p, t, extra):
    """A and B compute the same prompt concurrently; A finishes and caches it;
    B then caches its progress: B must go on with the tree's slots, never with
    its own duplicate slots, which were just freed."""
    cm = CacheManager(32, p, t)
    radix = t == "radix"
    prompt = seq(3 * p + extra, 40)
    a, b = Req(cm, prompt), Req(cm, prompt)
    assert a.cached_len == b.cached_len == 0
    b_own = b.indices.tolist()
    a.finish()
    a_slots = a.indices.tolist()
    b.unfinished()
    full = len(prompt) - len(prompt) % p
    got = b.indices.tolist()
    assert len(got) == ceil_pages(len(prompt), p) * p
    free = set(free_pages(cm))
    assert not {s // p for s in got} & free, "B holds a slot that is free"
    if radix:
        assert b.cached_len == full
        assert got[:full] == a_slots[:full] == slots_in_tree(cm, prompt)
        assert got[full:] == b_own[full:]
        # B's duplicate pages went back to the free list.
        assert set(pages_of(b_own[:full], p)) <= free
        assert cm.held_pages == ceil_pages(len(prompt), p) - full // p
    else:
        assert b.cached_len == 0 and got == b_own
    # B keeps going and finishes; nothing leaks, nothing is owned twice.
    b.extend(seq(2 * p + 1, 700))
    assert not {s // p for s in b.indices.tolist()} & set(free_pages(cm))
    b.finish()
    assert cm.held_pages == 0
    assert cm._pages.num_free_pages + cm.manager.size_info.total_size // p == 32
    if radix:
        fullb = len(b.ids) - len(b.ids) % p
        assert slots_in_tree(cm, b.ids) == b.indices[:fullb].tolist()
        assert b.indices[:full].tolist() == a_slots[:full]


@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("p", PS3)
@pytest.mark.parametrize("extra", [0, 1])
def test_trap_identical_prompts_in_one_batch(p, t, extra):
    cm = CacheManager(16, p, t)
    prompt = seq(2 * p + extra, 3)
    a, b = Req(cm, prompt), Req(cm, prompt)
    assert a.cached_len == b.cached_len == 0
    assert not set(a.own_pages()) & set(b.own_pages())
    assert cm.held_pages == 2 * ceil_pages(len(prompt), p)
    a.finish()
    b.finish()
    assert cm.held_pages == 0
    full = len(prompt) - len(prompt) % p
    cached = full if t == "radix" else 0
    assert cm.manager.size_info == (cached, 0)  # the prompt is cached once
    if t == "radix":
        assert cached_slots(cm) == a.indices[:full].tolist()  # the first to finish wins
        assert cm.manager.num_nodes == 1
    assert cm._pages.num_free_pages == 16 - cached // p
    # The pages B computed were all returned: a third identical prompt can use them.
    c = Req(cm, prompt)
    assert c.cached_len == ((len(prompt) - 1) // p * p if t == "radix" else 0)
    c.finish()
    assert cm.manager.size_info == (cached, 0)


@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("p", PS3)
@pytest.mark.parametrize("extra", [0, 1, 3])
def test_trap_identical_repeat_prompt(p, t, extra):
    if extra >= p and extra:
        extra = extra % p or 1
    cm = CacheManager(16, p, t)
    prompt = seq(2 * p + extra, 77)
    first = Req(cm, prompt)
    first.finish()
    free_before = cm._pages.num_free_pages
    second = Req(cm, prompt)
    want = (len(prompt) - 1) // p * p if t == "radix" else 0
    assert second.cached_len == want
    if t == "radix":
        assert second.indices[:want].tolist() == first.indices[:want].tolist()
    # only the tail is allocated
    assert len(second.indices) - want == ceil_pages(len(prompt) - want, p) * p
    assert cm.held_pages == ceil_pages(len(prompt) - want, p)
    second.finish()
    assert cm.held_pages == 0
    assert cm._pages.num_free_pages == free_before
    full = len(prompt) - len(prompt) % p
    assert cm.manager.size_info == ((full if t == "radix" else 0), 0)
    if t == "radix":
        assert cached_slots(cm) == first.indices[:full].tolist()


@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("p", [4, 16])
def test_trap_partial_last_page_is_freed_at_finish(p, t):
    cm = CacheManager(8, p, t)
    r = Req(cm, seq(2 * p + 3, 5))
    assert cm.held_pages == 3
    last_page = r.own_pages()[-1]
    r.finish()
    assert last_page in free_pages(cm)
    assert cm.held_pages == 0
    if t == "radix":
        assert cm.manager.size_info == (2 * p, 0)
        assert cached_slots(cm) == r.indices[: 2 * p].tolist()
        assert cm._pages.num_free_pages == 6
    else:
        assert cm._pages.num_free_pages == 8
    # The partial page's tokens are not matched by a later request.
    r2 = Req(cm, seq(2 * p + 3, 5) + [1])
    assert r2.cached_len == (2 * p if t == "radix" else 0)
    r2.abort()
    assert cm.held_pages == 0


@pytest.mark.parametrize("p", PS3)
def test_trap_allocation_failure_changes_nothing(p):
    cm = CacheManager(10, p)
    Req(cm, seq(2 * p, 100)).finish()  # 2 evictable pages
    locked = Req(cm, seq(3 * p, 200) + [1])  # holds 1 page, then caches+locks 3
    locked.unfinished()
    held = cm.allocate(2 * p)  # 2 more held pages
    check(cm)
    assert cm.available_size == (10 - 2 - 3 - 1 - 2) * p + 2 * p
    before = state(cm)
    handle_locks = locked.handle.lock_count
    for n in (cm.available_size + 1, cm.available_size + p, 10 * p + 1, 10**6):
        with raises(radixkv.OutOfCapacityError, "num_tokens"):
            cm.allocate(n)
        assert state(cm) == before
        assert locked.handle.lock_count == handle_locks
        check(cm)
    assert issubclass(radixkv.OutOfCapacityError, RuntimeError)
    # Exactly available_size still works, by evicting everything evictable.
    got = cm.allocate(cm.available_size)
    assert cm.manager.size_info.evictable_size == 0 and cm._pages.num_free_pages == 0
    check(cm)
    cm.free(got)
    cm.free(held)
    locked.finish()
    check(cm)


@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("p", PS)
def test_allocation_failure_on_empty_cache(p, t):
    cm = CacheManager(3, p, t)
    a = cm.allocate(2 * p)
    before = state(cm)
    with raises(radixkv.OutOfCapacityError, "num_tokens"):
        cm.allocate(p + 1)
    assert state(cm) == before
    cm.free(a)
    check(cm)


@pytest.mark.parametrize("p", PS)
def test_check_integrity_catches_leaked_page(p):
    cm = CacheManager(8, p)
    r = Req(cm, seq(2 * p + 1))
    r.finish()
    r2 = Req(cm, seq(3 * p, 50))
    check(cm)
    # The count of held pages says one more than there is ...
    cm._held_pages += 1
    with pytest.raises(radixkv.IntegrityError):
        cm.check_integrity()
    cm._held_pages -= 2
    with pytest.raises(radixkv.IntegrityError):
        cm.check_integrity()
    cm._held_pages += 1
    check(cm)
    # ... or a page left the free list but nobody accounts for it.
    lost = cm._pages.allocate(p)
    with pytest.raises(radixkv.IntegrityError):
        cm.check_integrity()
    cm._pages.free(lost)
    check(cm)
    r2.finish()
    check(cm)


@pytest.mark.parametrize("p", PS)
def test_check_integrity_catches_doubly_owned_page(p):
    cm = CacheManager(8, p)
    r = Req(cm, seq(2 * p + 1))
    r.finish()
    tree_page = r.indices[:p]
    # A cached page freed behind the tree's back: both free and cached.
    cm._pages.free(tree_page)
    with pytest.raises(radixkv.IntegrityError):
        cm.check_integrity()
    # Handed to a request while still cached: both held and cached.
    while True:
        got = cm.allocate(p)
        if got.tolist() == tree_page.tolist():
            break
    with pytest.raises(radixkv.IntegrityError):
        cm.check_integrity()


@pytest.mark.parametrize("p", PS)
def test_check_integrity_catches_free_and_cached_with_balanced_counts(p):
    """Counts alone balance (one cached page freed, one held page forgotten):
    the disjointness check must still notice the page that is free and cached."""
    cm = CacheManager(8, p)
    Req(cm, seq(2 * p + 1)).finish()
    r = Req(cm, seq(p + 1, 300))
    tree_page = torch.tensor(cached_slots(cm)[:p], dtype=torch.int32)
    cm._pages.free(tree_page)
    cm._held_pages -= 1
    assert (
        cm._pages.num_free_pages + cm.manager.size_info.total_size // p + cm.held_pages
        == cm.num_pages
    )
    with raises(radixkv.IntegrityError, "both free and cached"):
        cm.check_integrity()
    cm._held_pages += 1
    assert cm._pages.allocate(p).tolist() == tree_page.tolist()  # back off the stack
    check(cm)
    r.finish()
    check(cm)


def test_check_integrity_is_valid_mid_flight():
    for p in PS:
        cm = CacheManager(16, p)
        reqs = [Req(cm, seq(2 * p + i, 10 * i)) for i in range(3)]
        reqs[0].unfinished()
        check(cm)
        reqs[1].abort()
        reqs[0].finish()
        reqs[2].finish()
        check(cm)


# --- eviction inside allocate ---------------------------------------------------------


@pytest.mark.parametrize("p", PS3)
def test_allocate_evicts_only_what_is_missing_lru_first(p):
    cm = CacheManager(8, p)
    prefixes = [seq(2 * p, 1000 * (k + 1)) for k in range(3)]
    slots = []
    for ids in prefixes:  # cached in this order: prefix 0 is the oldest
        r = Req(cm, ids)
        r.finish()
        slots.append(r.indices[: 2 * p].tolist())
    assert cm._pages.num_free_pages == 2 and cm.manager.size_info == (6 * p, 0)
    # No eviction while the free pages suffice.
    a = cm.allocate(2 * p)
    assert cm.manager.size_info == (6 * p, 0)
    cm.free(a)
    # One page missing: exactly one whole node (the oldest, 2 pages) goes.
    a = cm.allocate(3 * p)
    assert cm.manager.size_info == (4 * p, 0)
    assert cm._pages.num_free_pages == 1
    assert set(pages_of(a, p)) & set(pages_of(slots[0], p))
    assert cached_slots(cm) == slots[1] + slots[2]
    check(cm)
    # Touch prefix 1: prefix 2 becomes the oldest.
    h, _ = cm.match_req(prefixes[1] + [5])
    assert h.cached_len == 2 * p
    b = cm.allocate(2 * p)
    assert cached_slots(cm) == slots[1]
    assert cm._pages.num_free_pages == 1
    check(cm)
    for x in (a, b):
        cm.free(x)
    check(cm)


@pytest.mark.parametrize("p", PS)
def test_allocate_evicts_partial_need_rounded_to_nodes(p):
    """Nodes of different sizes: asking for one page more than free evicts the
    oldest leaf only, even when it is bigger than what is missing."""
    cm = CacheManager(12, p)
    Req(cm, seq(4 * p, 100)).finish()  # oldest: 4 pages
    Req(cm, seq(1 * p, 200)).finish()  # 1 page
    Req(cm, seq(2 * p, 300)).finish()  # 2 pages
    assert cm._pages.num_free_pages == 5
    a = cm.allocate(5 * p + 1)
    info = cm.manager.size_info
    assert info == (3 * p, 0)  # the 4-page node went, nothing else
    assert cm._pages.num_free_pages == 3
    b = cm.allocate(3 * p + 1)  # 1 page missing: the 1-page node goes
    assert cm.manager.size_info == (2 * p, 0)
    assert slots_in_tree(cm, seq(2 * p, 300)) == cached_slots(cm)
    for x in (a, b):
        cm.free(x)
    check(cm)


@pytest.mark.parametrize("p", PS)
def test_allocate_never_evicts_locked_prefixes(p):
    cm = CacheManager(8, p)
    old = seq(2 * p, 100)
    Req(cm, old).finish()
    Req(cm, seq(2 * p, 200)).finish()
    Req(cm, seq(2 * p, 300)).finish()
    keep = Req(cm, old + [1])  # locks the oldest prefix (and holds 1 page)
    assert keep.cached_len == 2 * p
    old_slots = keep.indices[: 2 * p].tolist()
    a = cm.allocate(2 * p)  # 1 free page, 1 missing: evicts prefix 200, not the locked one
    assert slots_in_tree(cm, old) == old_slots
    assert slots_in_tree(cm, seq(2 * p, 200)) == []
    b = cm.allocate(2 * p)  # evicts prefix 300
    assert cm.manager.size_info == (0, 2 * p)
    before = state(cm)
    with raises(radixkv.OutOfCapacityError, "num_tokens"):
        cm.allocate(cm._pages.num_free_pages * p + 1)  # only the locked prefix is cached
    assert state(cm) == before
    assert slots_in_tree(cm, old) == old_slots
    for x in (a, b):
        cm.free(x)
    keep.finish()
    check(cm)
    assert cm.manager.size_info == (len(keep.ids) // p * p, 0)


@pytest.mark.parametrize("p", PS)
def test_make_room_evicts_what_allocate_would(p):
    cm = CacheManager(8, p)
    Req(cm, seq(3 * p, 100)).finish()
    Req(cm, seq(2 * p, 200)).finish()
    assert cm.make_room(3 * p) == 0  # 3 pages are free: nothing to do
    assert cm.manager.size_info == (5 * p, 0)
    assert cm.make_room(3 * p + 1) == 3 * p  # 1 page missing: the oldest node goes
    assert cm.manager.size_info == (2 * p, 0) and cm._pages.num_free_pages == 6
    check(cm)
    before = state(cm)
    with raises(radixkv.OutOfCapacityError, "num_tokens"):
        cm.make_room(8 * p + 1)
    with raises(ValueError, "num_tokens"):
        cm.make_room(-1)
    with raises(TypeError, "num_tokens"):
        cm.make_room(1.0)
    assert state(cm) == before
    a = cm.allocate(6 * p)  # no eviction needed now
    assert cm.manager.size_info == (2 * p, 0)
    cm.free(a)
    check(cm)


# --- errors ---------------------------------------------------------------------------


@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize(
    "bad,exc",
    [
        (-1, ValueError),
        (1.5, TypeError),
        (2.0, TypeError),
        (True, TypeError),
        ("3", TypeError),
        (None, TypeError),
        ([3], TypeError),
    ],
)
def test_allocate_bad_count(p, t, bad, exc):
    cm = CacheManager(8, p, t)
    Req(cm, seq(2 * p + 1)).finish()
    r = Req(cm, seq(p + 1, 50))
    before = state(cm)
    with raises(exc, "num_tokens"):
        cm.allocate(bad)
    assert state(cm) == before
    r.finish()
    check(cm)


def _free_case(p, t="radix"):
    """A cached prompt, one in-flight request R, one free page at least."""
    cm = CacheManager(10, p, t)
    done = Req(cm, seq(2 * p + 1, 10))
    done.finish()
    r = Req(cm, seq(2 * p + 1, 10) + seq(2 * p, 500))
    return cm, done, r


@pytest.mark.parametrize("p", PS)
def test_free_errors(p):
    cm, done, r = _free_case(p)
    own = r.indices[r.cached_len :]
    tree = r.indices[:p]
    free_page = free_pages(cm)[-1]
    free_slots = seq(p, free_page * p)
    bad = {
        "free page": (ValueError, free_slots),
        "cached slot": (ValueError, tree),
        "cached slot after own": (ValueError, torch.cat([own[:p], tree])),
        "repeated page": (ValueError, torch.cat([own[:p], own[:p]])),
        "out of range": (ValueError, seq(p, 10 * p)),
        "negative": (ValueError, seq(p, -p)),
        "2-D": (ValueError, own.view(-1, p)),
        "float": (TypeError, own.float()),
        "none": (TypeError, None),
    }
    if p > 1:
        bad["partial page"] = (ValueError, own[: p - 1])
        bad["not page-aligned"] = (ValueError, own[1 : p + 1])
        bad["page out of order"] = (ValueError, own[:p].flip(0))
        bad["halves of two pages"] = (
            ValueError,
            torch.cat([own[: p // 2], own[p + p // 2 : 2 * p]]),
        )
    before = state(cm)
    for name, (exc, idx) in bad.items():
        with raises(exc, "indices"):
            cm.free(idx)
        assert state(cm) == before, name
        check(cm)
    cm.free([])  # nothing to return
    assert state(cm) == before
    # Inputs of every accepted form still work afterwards.
    cm.free(own[:p].numpy().astype(np.int64))
    cm.free(own[p : 2 * p].tolist())
    cm.free(own[2 * p :])
    cm.unlock(r.handle)
    assert cm.held_pages == 0
    check(cm)


def _request_case(p, t, stale=False):
    """cm with cached prefixes and a locked in-flight request R (cached part
    2 pages for radix, own part 2 pages, the last one partial for p > 1).
    Also returns a page of slots cached on another path than R's, and (with
    `stale`, radix only) a handle whose node was evicted."""
    cm = CacheManager(12, p, t)
    old = None
    if stale and t == "radix":
        Req(cm, seq(p, 4000)).finish()
        old, _ = cm.match_req(seq(p, 4000) + [1])
        assert old.cached_len == p
        cm.free(cm.allocate(12 * p))  # evicts that node
        assert not cm.manager.is_valid(old)
        check(cm)
    base = seq(2 * p, 10)
    Req(cm, base + [1]).finish()
    other = Req(cm, seq(p, 900))
    other.finish()
    foreign = other.indices[:p]
    r = Req(cm, base + seq(p + 1, 500))
    if t == "radix":
        assert r.cached_len == 2 * p
        assert slots_in_tree(cm, seq(p, 900)) == foreign.tolist()
    if stale:
        return cm, r, foreign, old
    return cm, r


REQUEST_METHODS = ["free_and_cache_finished_req", "cache_unfinished_req"]


@pytest.mark.parametrize("method", REQUEST_METHODS)
@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("p", PS)
def test_request_errors(p, t, method):
    cm, r, foreign, stale = _request_case(p, t, stale=True)
    radix = t == "radix"
    fn = getattr(cm, method)
    ids, idx, h = r.ids, r.indices, r.handle
    c = r.cached_len
    free_page = free_pages(cm)[-1]
    unlocked, _ = cm.match_req(ids)
    other = CacheManager(12, p, t)
    oh, _ = other.match_req(ids)
    other.lock(oh)
    cases = [
        ("short indices", ValueError, ("indices",), lambda: fn(h, ids, idx[:-p])),
        (
            "long indices",
            ValueError,
            ("indices",),
            lambda: fn(
                h, ids, torch.cat([idx, torch.tensor(seq(p, free_page * p), dtype=torch.int32)])
            ),
        ),
        ("unlocked handle", ValueError, ("old_handle",), lambda: fn(unlocked, ids, idx)),
        ("other manager", ValueError, ("old_handle",), lambda: fn(oh, ids, idx)),
        ("not a handle", TypeError, ("old_handle",), lambda: fn("h", ids, idx)),
        (
            "unallocated slot",
            ValueError,
            ("indices",),
            lambda: fn(
                h,
                ids,
                torch.cat([idx[:-p], torch.tensor(seq(p, free_page * p), dtype=torch.int32)]),
            ),
        ),
        (
            "repeated page",
            ValueError,
            ("indices",),
            lambda: fn(h, ids, torch.cat([idx[:-p], idx[c : c + p]])),
        ),
        (
            "float input_ids",
            TypeError,
            ("input_ids",),
            lambda: fn(h, torch.tensor(ids, dtype=torch.float32), idx),
        ),
        ("2-D indices", ValueError, ("indices",), lambda: fn(h, ids, idx.view(1, -1))),
        (
            "negative slot",
            ValueError,
            ("indices",),
            lambda: fn(h, ids, torch.cat([idx[:-p], torch.tensor(seq(p, -p), dtype=torch.int32)])),
        ),
    ]
    if radix:
        cases += [
            (
                "cached slot as the last page",
                ValueError,
                ("indices",),
                lambda: fn(h, ids, torch.cat([idx[:-p], foreign])),
            ),
            (
                "cached slot as the first own page",
                ValueError,
                ("indices",),
                lambda: fn(h, ids, torch.cat([idx[:c], foreign, idx[c + p :]])),
            ),
            (
                "cached part's slots in own part",
                ValueError,
                ("indices",),
                lambda: fn(h, ids, torch.cat([idx[:-p], idx[:p]])),
            ),
            ("stale handle", ValueError, ("old_handle",), lambda: fn(stale, ids, idx)),
            (
                "ids shorter than the handle",
                ValueError,
                ("old_handle",),
                lambda: fn(h, ids[: c - 1], idx[: ceil_pages(c - 1, p) * p]),
            ),
        ]
    if p > 1:
        shifted = idx.clone()
        shifted[c : c + p] = shifted[c : c + p] + 1
        cases += [
            ("not page-aligned", ValueError, ("indices",), lambda: fn(h, ids, shifted)),
            (
                "page out of order",
                ValueError,
                ("indices",),
                lambda: fn(h, ids, torch.cat([idx[:c], idx[c : c + p].flip(0), idx[c + p :]])),
            ),
        ]
    before = state(cm)
    for name, exc, names, call in cases:
        with raises(exc, *names):
            call()
        assert state(cm) == before, name
        assert h.lock_count == 1 and unlocked.lock_count == 0 and oh.lock_count == 1, name
        cm.manager.check_integrity()
    # R still completes normally afterwards.
    if method == "cache_unfinished_req":
        r.unfinished()
    r.finish()
    assert cm.held_pages == 0


@pytest.mark.parametrize("mine,theirs", [("radix", "naive"), ("naive", "radix")])
@pytest.mark.parametrize("method", REQUEST_METHODS)
@pytest.mark.parametrize("p", PS)
def test_request_error_handle_of_other_type_names_old_handle(p, method, mine, theirs):
    """A handle from a CacheManager of the other type: the message must name
    the argument, `old_handle`, and nothing changes."""
    cm, r = _request_case(p, mine)
    other = CacheManager(12, p, theirs)
    oh, _ = other.match_req(r.ids)
    other.lock(oh)
    before = state(cm)
    with pytest.raises((TypeError, ValueError)) as info:
        getattr(cm, method)(oh, r.ids, r.indices)
    assert "old_handle" in str(info.value), str(info.value)
    assert state(cm) == before
    r.finish()


@pytest.mark.parametrize("p", PS)
def test_request_ids_diverging_from_handle_change_nothing(p):
    """input_ids that disagree with the locked handle's cached tokens: the
    request's cached part would be stored a second time; refused, nothing changed."""
    cm, r = _request_case(p, "radix")
    wrong = [-5] + r.ids[1:]
    before = state(cm)
    for fn in (cm.free_and_cache_finished_req, cm.cache_unfinished_req):
        with pytest.raises(ValueError):
            fn(r.handle, wrong, r.indices)
        assert state(cm) == before
        assert r.handle.lock_count == 1
    r.finish()
    check(cm)


@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("p", PS)
def test_request_inputs_in_every_form(p, t):
    for form in (
        list,
        lambda x: np.array(x, dtype=np.int64),
        lambda x: torch.tensor(x),
        lambda x: torch.tensor(x, dtype=torch.int32),
    ):
        cm, r = _request_case(p, t)
        r2 = Req(cm, r.ids + [3])
        h, idx = cm.cache_unfinished_req(r.handle, form(r.ids), form(r.indices.tolist()))
        assert idx.dtype == torch.int32
        assert h.lock_count == 1
        r.handle, r.indices = h, idx
        check(cm)
        cm.free_and_cache_finished_req(r.handle, form(r.ids), form(r.indices.tolist()))
        cm.free_and_cache_finished_req(r2.handle, form(r2.ids), form(r2.indices.tolist()))
        assert cm.held_pages == 0
        check(cm)


@pytest.mark.parametrize("p", PS)
def test_finish_twice_is_refused(p):
    cm, r = _request_case(p, "radix")
    r.finish()
    before = state(cm)
    for fn in (cm.free_and_cache_finished_req, cm.cache_unfinished_req):
        with raises(ValueError):
            fn(r.handle, r.ids, r.indices)
        assert state(cm) == before


# --- randomized soak ----------------------------------------------------------------


def _audit(cm, reqs):
    """Free, cached and held pages partition all pages; held pages match the requests'."""
    cm.check_integrity()
    p = cm.page_size
    free = free_pages(cm)
    cached = cached_pages(cm)
    held = [pg for r in reqs for pg in r.own_pages()]
    assert len(free) == len(set(free))
    assert len(held) == len(set(held)), "a page is held by two requests"
    free, held = set(free), set(held)
    assert not free & cached and not free & held and not cached & held
    assert free | cached | held == set(range(cm.num_pages))
    assert cm.held_pages == len(held)
    assert cm.available_size == len(free) * p + cm.manager.size_info.evictable_size
    for r in reqs:
        assert set(pages_of(r.indices[: r.cached_len].tolist(), p)) <= cached
        assert len(r.indices) == ceil_pages(len(r.ids), p) * p


def _soak(p, t, steps, seed, num_pages):
    rng = random.Random(seed)
    cm = CacheManager(num_pages, p, t)
    radix = t == "radix"
    bases = [[rng.randrange(4) for _ in range(rng.randrange(1, 4 * p + 3))] for _ in range(5)]
    reqs = []
    counts = dict(
        start=0,
        oom=0,
        decode=0,
        finish=0,
        unfinished=0,
        abort=0,
        evicting=0,
        hit=0,
        dup_unfinished=0,
        dup_finished=0,
        active=0,
    )

    def new_ids():
        if reqs and rng.random() < 0.3:
            # the same prompt as a running request, or a prefix of it, maybe extended
            ids = rng.choice(reqs).ids
            ids = ids[: rng.randrange(1, len(ids) + 1)]
            return ids + [rng.randrange(6) for _ in range(rng.randrange(0, p + 1))]
        base = rng.choice(bases)
        return base[: rng.randrange(len(base) + 1)] + [
            rng.randrange(6) for _ in range(rng.randrange(1, 2 * p + 3))
        ]

    for _ in range(steps):
        x = rng.random()
        counts["active"] += len(reqs)
        if (x < 0.3 and len(reqs) < 10) or not reqs:
            ids = new_ids()
            h, matched = cm.match_req(ids)
            cm.lock(h)
            need = len(ids) - h.cached_len
            pages_needed = ceil_pages(need, p)
            if pages_needed > cm._pages.num_free_pages + cm.manager.size_info.evictable_size // p:
                before = state(cm)
                with pytest.raises(radixkv.OutOfCapacityError):
                    cm.allocate(need)
                assert state(cm) == before
                cm.unlock(h)
                counts["oom"] += 1
            else:
                if pages_needed > cm._pages.num_free_pages:
                    counts["evicting"] += 1
                own = cm.allocate(need)
                assert_whole_pages(own, p, pages_needed * p)
                r = Req.__new__(Req)
                r.cm, r.ids, r.handle = cm, ids, h
                r.indices = torch.cat([matched, own])
                reqs.append(r)
                counts["start"] += 1
                counts["hit"] += h.cached_len > 0
        else:
            r = rng.choice(reqs)
            if x < 0.6:
                k = rng.randrange(1, p + 2)
                r.ids += [rng.randrange(6) for _ in range(k)]
                need = ceil_pages(len(r.ids), p) * p - len(r.indices)
                if need > cm.available_size:
                    del r.ids[-k:]
                    before = state(cm)
                    with pytest.raises(radixkv.OutOfCapacityError):
                        cm.allocate(need)
                    assert state(cm) == before
                    counts["oom"] += 1
                    reqs.remove(r)
                    r.abort() if rng.random() < 0.5 else r.finish()
                elif need > 0:
                    r.indices = torch.cat([r.indices, cm.allocate(need)])
                counts["decode"] += 1
            elif x < 0.75:
                reqs.remove(r)
                full = len(r.ids) - len(r.ids) % p
                counts["dup_finished"] += (
                    radix and len(slots_in_tree(cm, r.ids[:full])) > r.cached_len
                )
                cm.free_and_cache_finished_req(r.handle, r.ids, r.indices)
                assert r.handle.lock_count == 0
                if radix:
                    got = slots_in_tree(cm, r.ids)
                    # everything the request computed in whole pages is cached now
                    assert len(got) >= full
                counts["finish"] += 1
            elif x < 0.93:
                old_tail = r.indices[len(r.ids) - len(r.ids) % p :].tolist()
                old_own = r.indices[r.cached_len :].tolist()
                h, idx = cm.cache_unfinished_req(r.handle, r.ids, r.indices)
                assert r.handle.lock_count == 0 and h.lock_count == 1
                r.handle, r.indices = h, idx
                full = len(r.ids) - len(r.ids) % p
                if radix:
                    assert h.cached_len == full
                    assert idx[:full].tolist() == slots_in_tree(cm, r.ids)[:full]
                    assert idx[full:].tolist() == old_tail
                    c0 = len(r.indices) - len(old_own)
                    counts["dup_unfinished"] += idx[c0:full].tolist() != old_own[: full - c0]
                else:
                    assert h.cached_len == 0
                assert not set(pages_of(idx.tolist(), p)) & set(free_pages(cm))
                counts["unfinished"] += 1
            else:
                reqs.remove(r)
                cm.free(r.indices[r.cached_len :])
                cm.unlock(r.handle)
                counts["abort"] += 1
        _audit(cm, reqs)

    for r in reqs:
        cm.free_and_cache_finished_req(r.handle, r.ids, r.indices)
        _audit(cm, [x for x in reqs if x.handle.lock_count])
    assert cm.held_pages == 0
    info = cm.manager.size_info
    assert info.protected_size == 0
    assert cm._pages.num_free_pages + info.total_size // p == num_pages
    if radix:
        cm._pages.free(cm.manager.evict(info.evictable_size))
    assert cm._pages.num_free_pages == num_pages
    check(cm)
    return counts


@pytest.mark.parametrize(
    "t,p,steps,num_pages,seed",
    [
        ("radix", 1, 4000, 40, 1),
        ("radix", 1, 4000, 24, 2),
        ("radix", 4, 4000, 24, 3),
        ("radix", 4, 4000, 40, 4),
        ("radix", 16, 1000, 12, 5),
        ("naive", 1, 1000, 40, 6),
        ("naive", 4, 1000, 24, 7),
    ],
)
def test_soak(t, p, steps, num_pages, seed):
    counts = _soak(p, t, steps, seed=seed, num_pages=num_pages)
    # The run exercised every path, eviction and running out included.
    for k in ("start", "decode", "finish", "unfinished", "abort", "oom"):
        assert counts[k] > 0, counts
    if t == "radix":
        for k in ("evicting", "hit", "dup_unfinished", "dup_finished"):
            assert counts[k] > 0, counts


# --- ReqToTokenPool -------------------------------------------------------------------


def test_req_to_token_pool_alloc_free_write():
    pool = ReqToTokenPool(4, 8)
    assert pool.table.shape == (4, 8) and pool.table.dtype == torch.int32
    assert pool.available_size == 4
    rows = pool.alloc(3)
    assert len(set(rows)) == 3 and all(0 <= r < 4 for r in rows)
    assert pool.available_size == 1
    pool.write(rows[0], 0, torch.tensor([5, 6, 7]))
    pool.write(rows[0], 3, torch.tensor([8], dtype=torch.int64))
    pool.write(rows[1], 6, torch.tensor([1, 2], dtype=torch.int32))
    assert pool.table[rows[0], :4].tolist() == [5, 6, 7, 8]
    assert pool.table[rows[1], 6:].tolist() == [1, 2]
    assert pool.table[rows[2]].tolist() == [0] * 8
    pool.write(rows[1], 8, torch.tensor([], dtype=torch.int32))  # empty write at the end
    pool.free([rows[1]])
    assert pool.available_size == 2
    again = pool.alloc(2)
    assert rows[1] in again and rows[0] not in again and rows[2] not in again
    assert pool.alloc(0) == []
    pool.free([rows[0], rows[2]] + again)
    assert pool.available_size == 4


def test_req_to_token_pool_errors():
    with raises(ValueError, "max_requests"):
        ReqToTokenPool(0, 8)
    with raises(TypeError, "max_context_len"):
        ReqToTokenPool(2, 8.0)
    pool = ReqToTokenPool(3, 8)
    rows = pool.alloc(2)
    pool.write(rows[0], 0, torch.tensor([1, 2, 3]))
    table = pool.table.clone()
    with raises(RuntimeError):
        pool.alloc(2)
    with raises(ValueError, "count"):
        pool.alloc(-1)
    with raises(TypeError, "count"):
        pool.alloc(1.0)
    assert pool.available_size == 1
    with raises(ValueError, "start", "max_context_len"):
        pool.write(rows[0], 6, torch.tensor([1, 2, 3]))  # past max_context_len
    with raises(ValueError, "start"):
        pool.write(rows[0], -1, torch.tensor([1]))
    free_row = ({0, 1, 2} - set(rows)).pop()
    with raises(ValueError, "row"):
        pool.write(free_row, 0, torch.tensor([1]))
    with raises(ValueError, "row"):
        pool.write(3, 0, torch.tensor([1]))
    with raises(ValueError, "row"):
        pool.write(-1, 0, torch.tensor([1]))
    with raises(ValueError, "twice"):
        pool.free([rows[0], rows[0]])
    with raises(ValueError, "row"):
        pool.free([free_row])
    with raises(ValueError, "row"):
        pool.free([rows[0], 7])  # one bad row: nothing is freed
    assert pool.available_size == 1
    assert torch.equal(pool.table, table)
    pool.free([rows[0]])
    with raises(ValueError, "row"):
        pool.free([rows[0]])  # double free
    assert pool.available_size == 2
    pool.free([rows[1]])
    assert pool.available_size == 3


BAD_POOL_CALLS = {
    # (call on pool with live rows [r0, r1], names the message must contain)
    "write_bool_row": (lambda pool, r: pool.write(True, 0, torch.tensor([9])), ("row",)),
    "write_float_row": (lambda pool, r: pool.write(float(r[1]), 0, torch.tensor([9])), ("row",)),
    "write_float_values": (
        lambda pool, r: pool.write(r[0], 0, torch.tensor([1.5, 2.5])),
        ("values",),
    ),
    "write_values_beyond_int32": (
        lambda pool, r: pool.write(r[0], 0, torch.tensor([2**40])),
        ("values",),
    ),
    "write_2d_values": (
        lambda pool, r: pool.write(r[0], 0, torch.ones(2, 2, dtype=torch.int32)),
        ("values",),
    ),
    "free_float_row": (lambda pool, r: pool.free([r[1] + 0.5]), ("row",)),
    "free_bool_row": (lambda pool, r: pool.free([True]), ("row",)),
}


@pytest.mark.parametrize("case", sorted(BAD_POOL_CALLS))
def test_req_to_token_pool_rejects_bad_input(case):
    """Errors at every entry point (docs/api.md): a non-integer row, non-integer
    values or values that do not fit in int32 raise TypeError/ValueError naming
    the argument, instead of writing (or freeing) something else."""
    pool = ReqToTokenPool(3, 8)
    rows = pool.alloc(2)
    pool.write(rows[0], 0, torch.tensor([1, 2, 3]))
    pool.write(rows[1], 0, torch.tensor([4, 5, 6]))
    table = pool.table.clone()
    call, names = BAD_POOL_CALLS[case]
    with raises((TypeError, ValueError), *names):
        call(pool, rows)
    assert torch.equal(pool.table, table)
    assert pool.available_size == 1


@pytest.mark.parametrize("form", ["list", "numpy"])
def test_req_to_token_pool_write_values_forms(form):
    """docs/api.md, "Inputs and results": indices come as tensors, NumPy arrays or lists. write()
    either accepts them or refuses with a TypeError naming `values`."""
    pool = ReqToTokenPool(2, 8)
    (row,) = pool.alloc(1)
    values = [3, 1, 4] if form == "list" else np.array([3, 1, 4], dtype=np.int64)
    try:
        pool.write(row, 2, values)
    except TypeError as e:
        assert "values" in str(e), str(e)
        assert pool.table[row].tolist() == [0] * 8
    else:
        assert pool.table[row].tolist() == [0, 0, 3, 1, 4, 0, 0, 0]


@pytest.mark.parametrize("page", PS)
def test_chunked_prefill_without_a_prefix_cache_keeps_the_requests_own_pages(page):
    """SGLang's ChunkCache: with the naive cache a chunk is never shared, the
    request goes on with exactly its own indices and frees them at the end."""
    cm = CacheManager(12, page, "naive")
    ids = torch.arange(5 * page + 1)
    h, idx = cm.match_req(ids)
    cm.lock(h)
    own = cm.allocate(3 * page)  # the first chunk
    h, idx = cm.cache_unfinished_req(h, ids[: 3 * page], own)
    assert h.cached_len == 0 and torch.equal(idx, own)
    assert cm.held_pages == 3 and cm.manager.size_info.total_size == 0
    more = cm.allocate(len(ids) - 3 * page)  # the rest
    cm.free_and_cache_finished_req(h, ids, torch.cat([idx, more]))
    assert cm.held_pages == 0 and cm.free_pages == 12
    cm.check_integrity()


def test_request_priorities_order_eviction_under_the_priority_policy():
    cm = CacheManager(6, 2, eviction_policy="priority")

    def serve(ids, priority):
        h, idx = cm.match_req(ids)
        cm.lock(h)
        own = cm.allocate(len(ids) - h.cached_len)
        cm.free_and_cache_finished_req(h, ids, torch.cat([idx, own]), priority=priority)

    serve(torch.arange(5), 3)  # 2 pages cached, priority 3
    serve(torch.arange(10, 15), 0)  # 2 pages, priority 0 (the newer one)
    serve(torch.arange(20, 25), 1)  # needs room: the priority-0 request's pages go
    assert cm.match_req(torch.arange(5))[0].cached_len == 4
    assert cm.match_req(torch.arange(10, 15))[0].cached_len == 0
    with pytest.raises(ValueError, match="eviction_policy"):
        CacheManager(4, 1, eviction_policy="nope")
    cm.check_integrity()
