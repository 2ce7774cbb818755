"""Stateful property tests: random operation sequences against simple models.

CI runs a bounded budget. The long profile runs many more and longer
sequences: RADIXKV_HYPOTHESIS_PROFILE=long python -m pytest tests/python/scheduler/test_stateful.py
"""


import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    rule,
)

import radixkv
from reference import ReferenceRadixCache, RefOutOfCapacity
from radixkv.kvcache import RadixCacheManager
from radixkv.scheduler import CacheManager

# The budgets (profiles "ci" and "long") are conftest.py's.

# A tiny alphabet makes shared prefixes, splits and page collisions common.
tokens_st = st.lists(st.integers(0, 3), min_size=0, max_size=24)

PAGE_SIZES = [1, 2, 4, 16, 512]


def widen(ids, p, per_page=1):
    """The tokens a drawn list stands for at page size `p`. Up to page 4 they
    are used as drawn. At 16 and 512 every `per_page` drawn tokens stand for
    one page: the first of them picks one of four page patterns (two
    unrelated ones, and two that differ from the first only in its middle or
    last token, so walks stop inside pages), and an odd count of drawn tokens
    cuts the last page short (a ragged tail)."""
    ids = list(ids)
    if p <= 4:
        return ids
    base = [(3 * i + 1) % 5 for i in range(p)]
    middle, last = list(base), list(base)
    middle[p // 2] = 9
    last[-1] = 9
    patterns = (base, [(7 * i) % 5 for i in range(p)], middle, last)
    out = [t for k in ids[::per_page] for t in patterns[k % 4]]
    if len(ids) % 2 == 1 and out:
        out = out[: len(out) - p // 2]
    return out


class RadixManagerMachine(RuleBasedStateMachine):
    """RadixCacheManager against the pure-Python reference, step for step."""

    handles = Bundle("handles")

    @initialize(
        page_size=st.sampled_from(PAGE_SIZES),
        policy=st.sampled_from(["lru", "lfu", "fifo", "mru", "priority", "slru", "tlru"]),
    )
    def setup(self, page_size, policy):
        # tlru: leaves of at most two pages (or tokens) go first.
        config = {"threshold": 2 * page_size} if policy == "tlru" else None
        self.native = RadixCacheManager(
            "cpu", page_size, eviction_policy=policy, eviction_policy_config=config
        )
        self.ref = ReferenceRadixCache(page_size, policy, 2 * page_size if config else 0)
        self.next_slot = 0

    @rule(target=handles, ids=tokens_st)
    def match(self, ids):
        ids = widen(ids, self.native.page_size)
        h, idx = self.native.match_prefix(torch.tensor(ids, dtype=torch.int64))
        rh, ridx = self.ref.match_prefix(ids)
        assert idx.dtype == torch.int32 and idx.tolist() == ridx
        assert h.cached_len == rh.cached_len == len(ridx)
        return (h, rh)

    @rule(ids=tokens_st, priority=st.sampled_from([0, 0, 1, -3, 7]))
    def insert(self, ids, priority):
        ids = widen(ids, self.native.page_size)
        slots = list(range(self.next_slot, self.next_slot + len(ids)))
        self.next_slot += len(ids)
        assert self.native.insert_prefix(ids, slots, priority=priority) == self.ref.insert_prefix(
            ids, slots, priority=priority
        )

    @rule(pair=handles)
    def lock(self, pair):
        h, rh = pair
        if self.ref.is_valid(rh):
            self.native.lock_handle(h)
            self.ref.lock_handle(rh)
        else:
            with pytest.raises(ValueError, match="stale"):
                self.native.lock_handle(h)

    @rule(pair=handles)
    def unlock(self, pair):
        h, rh = pair
        if self.ref.is_valid(rh) and rh.lock_count > 0:
            self.native.lock_handle(h, unlock=True)
            self.ref.lock_handle(rh, unlock=True)
        else:
            with pytest.raises(ValueError):
                self.native.lock_handle(h, unlock=True)
        assert h.lock_count == rh.lock_count

    @rule(data=st.data())
    def evict(self, data):
        evictable = self.ref.size_info()[0]
        size = data.draw(st.integers(0, evictable + 3))
        if size > evictable:
            with pytest.raises(radixkv.OutOfCapacityError):
                self.native.evict(size)
            with pytest.raises(RefOutOfCapacity):
                self.ref.evict(size)
        else:
            assert self.native.evict(size).tolist() == self.ref.evict(size)

    @rule()
    def evict_negative(self):
        with pytest.raises(ValueError, match="size"):
            self.native.evict(-1)

    @rule(data=st.data())
    def insert_stored_slot(self, data):
        p = self.native.page_size
        stored = [v for _, _, vals, _, _ in self.native.dump() for v in vals]
        # Whole pages of consecutive slots, as the tree stores them.
        pages = [stored[i : i + p] for i in range(0, len(stored), p)]
        if not pages:
            return
        page = data.draw(st.sampled_from(pages))
        # The page shifted by less than a page (consecutive still, not aligned
        # with the stored ones): it holds at least one stored slot.
        shift = data.draw(st.integers(max(-page[0], 1 - p), p - 1))
        slots = [s + shift for s in page]
        # A first token outside the alphabet: the whole input is new, so the
        # stored slot must be refused and nothing may change.
        ids = [100] * p
        before = self.native.dump()
        with pytest.raises(ValueError, match="already stored"):
            self.native.insert_prefix(ids, slots)
        assert self.native.dump() == before

    @rule()
    def reset(self):
        self.native.reset()
        self.ref.reset()

    @invariant()
    def same_state(self):
        self.native.check_integrity()
        assert tuple(self.native.size_info) == self.ref.size_info()
        assert self.native.num_nodes == self.ref.num_nodes


class CacheManagerMachine(RuleBasedStateMachine):
    """CacheManager against a model of page ownership: every page is exactly
    one of free, cached or held by a live request, at every step."""

    requests = Bundle("requests")

    @initialize(page_size=st.sampled_from([1, 4, 16, 512]), num_pages=st.integers(4, 24))
    def setup(self, page_size, num_pages):
        self.cm = CacheManager(num_pages, page_size=page_size)
        self.page = page_size
        self.num_pages = num_pages
        self.live = 0

    def _held(self):
        return self.cm.held_pages

    @rule(target=requests, ids=st.lists(st.integers(0, 3), min_size=1, max_size=40))
    def start(self, ids):
        ids = widen(ids, self.page, per_page=5)
        h, cached = self.cm.match_req(ids)
        assert h.cached_len <= len(ids) - 1 and h.cached_len % self.page == 0
        self.cm.lock(h)
        need = len(ids) - h.cached_len
        before = (self.cm.available_size, self.cm.held_pages, tuple(self.cm.manager.size_info))
        if -(-need // self.page) * self.page > self.cm.available_size:
            with pytest.raises(radixkv.OutOfCapacityError):
                self.cm.allocate(need)
            assert before == (
                self.cm.available_size,
                self.cm.held_pages,
                tuple(self.cm.manager.size_info),
            )
            self.cm.unlock(h)
            return multiple()
        own = self.cm.allocate(need)
        assert len(own) == -(-need // self.page) * self.page
        self.live += 1
        return multiple([ids, h, torch.cat([cached, own])])

    @rule(req=consumes(requests))
    def finish(self, req):
        ids, h, indices = req
        held = self.cm.held_pages
        self.cm.free_and_cache_finished_req(h, ids, indices)
        assert self.cm.held_pages == held - (len(indices) - h.cached_len) // self.page
        self.live -= 1

    @rule(
        req=consumes(requests),
        extra=st.lists(st.integers(0, 3), min_size=0, max_size=8),
        target=requests,
    )
    def chunk(self, req, extra):
        ids, h, indices = req
        extra = widen(extra, self.page, per_page=4)
        nh, nidx = self.cm.cache_unfinished_req(h, ids, indices)
        # The request goes on with the cache's slots: none of them may be free.
        self.cm.check_integrity()
        if nh.cached_len:
            _, tree_idx = self.cm.manager.match_prefix(ids)
            assert nidx[: nh.cached_len].tolist() == tree_idx[: nh.cached_len].tolist()
        ids = ids + extra
        spare = len(nidx) - (len(ids) - len(extra))
        if len(extra) > spare:
            need = len(extra) - spare
            if -(-need // self.page) * self.page > self.cm.available_size:
                self.cm.free(nidx[nh.cached_len :])
                self.cm.unlock(nh)
                self.live -= 1
                return multiple()
            nidx = torch.cat([nidx, self.cm.allocate(need)])
        return multiple([ids, nh, nidx])

    @rule(req=consumes(requests))
    def abort(self, req):
        ids, h, indices = req
        self.cm.free(indices[h.cached_len :])
        self.cm.unlock(h)
        self.live -= 1

    @invariant()
    def pages_add_up(self):
        self.cm.check_integrity()
        free = self.cm._pages.num_free_pages
        cached = self.cm.manager.size_info.total_size // self.page
        assert free + cached + self.cm.held_pages == self.num_pages
        if self.live == 0:
            assert self.cm.held_pages == 0


TestRadixManagerStateful = RadixManagerMachine.TestCase
TestCacheManagerStateful = CacheManagerMachine.TestCase
