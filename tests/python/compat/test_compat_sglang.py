"""radixkv.compat.sglang: SGLang 0.5.x's RadixCache interface (match_prefix ->
MatchResult, insert -> prefix length or InsertResult, evict, inc/dec_lock_ref,
cache_finished_req / cache_unfinished_req over a req-to-token pool and a
token-to-KV allocator), written from SGLang's documented behaviour and driven
the way its scheduler drives it; then, where SGLang itself imports, the same
random operations on both caches with every result compared."""

from __future__ import annotations

import collections
import importlib
import importlib.util
import os
import random
import sys
import warnings
from array import array
from types import SimpleNamespace

import pytest
import torch

from radixkv.compat.sglang import radix_cache as compat
from radixkv.compat.sglang import (
    EvictParams,
    EvictResult,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
    RadixCache,
    RadixKey,
)
from devices import DEVICES


class Allocator:
    """A token-to-KV allocator of SGLang's shape that refuses a slot freed
    twice or never handed out, so every test can count slots exactly."""

    def __init__(self, size: int, page_size: int = 1, device="cpu"):
        self.device = torch.device(device)
        self.page_size = page_size
        self.size = size
        self.free_slots = set(range(size))
        self.freed = []  # every free() call, in order

    def alloc(self, n: int) -> torch.Tensor:
        if n > len(self.free_slots):
            raise RuntimeError("out of slots")
        out = sorted(self.free_slots)[:n]
        self.free_slots.difference_update(out)
        return torch.tensor(out, dtype=torch.int64, device=self.device)

    def free(self, indices: torch.Tensor) -> None:
        # SGLang's device is "cuda"; tensors made there are on "cuda:<index>".
        if indices.device != torch.empty(0, device=self.device).device:
            raise AssertionError(f"slots on {indices.device}, the pool is on {self.device}")
        slots = indices.tolist()
        if len(set(slots)) != len(slots) or self.free_slots.intersection(slots):
            raise AssertionError(f"double free: {slots}")
        if any(not 0 <= s < self.size for s in slots):
            raise AssertionError(f"foreign slot: {slots}")
        self.free_slots.update(slots)
        self.freed.append(slots)

    def free_segment(self, indices: torch.Tensor, start_pos: int = 0) -> None:  # 0.5.23's name
        self.free(indices)

    def available_size(self) -> int:
        return len(self.free_slots)


class PagedAllocator:
    """A token-to-KV allocator of the shape of SGLang's paged one
    (PagedTokenToKVPoolAllocator): it hands out whole pages of page_size
    consecutive slots (page g is slots g * page_size + i), a request's
    extension fills the rest of its last page before taking new pages
    (alloc_extend), and freeing any slot of a page frees the whole page. It
    refuses a page freed twice or never handed out, so every test can count
    slots exactly (free_slots: every slot of a free page)."""

    def __init__(self, size: int, page_size: int, device="cpu"):
        assert size % page_size == 0
        self.device = torch.device(device)
        self.page_size = page_size
        self.size = size
        self.free_pages = set(range(size // page_size))
        self.freed = []  # every free() call, in order

    @property
    def free_slots(self) -> set:
        p = self.page_size
        return {g * p + i for g in self.free_pages for i in range(p)}

    def new_slots_needed(self, prefix_len: int, n: int) -> int:
        """Slots of new pages that extending a row of prefix_len by n takes."""
        room = -prefix_len % self.page_size  # the rest of the row's last page
        return -(-max(n - room, 0) // self.page_size) * self.page_size

    def alloc_extend(self, prefix_len: int, last_loc: int, n: int) -> torch.Tensor:
        """n slots after a row of prefix_len whose last slot is last_loc."""
        p = self.page_size
        room = min(-prefix_len % p, n)
        out = [last_loc + 1 + i for i in range(room)]
        k = self.new_slots_needed(prefix_len, n) // p
        if k > len(self.free_pages):
            raise RuntimeError("out of slots")
        pages = sorted(self.free_pages)[:k]
        self.free_pages.difference_update(pages)
        out += [g * p + i for g in pages for i in range(p)][: n - room]
        return torch.tensor(out, dtype=torch.int64, device=self.device)

    def free(self, indices: torch.Tensor) -> None:
        if indices.device != torch.empty(0, device=self.device).device:
            raise AssertionError(f"slots on {indices.device}, the pool is on {self.device}")
        slots = indices.tolist()
        if any(not 0 <= s < self.size for s in slots):
            raise AssertionError(f"foreign slot: {slots}")
        pages = {s // self.page_size for s in slots}
        if len(set(slots)) != len(slots) or self.free_pages.intersection(pages):
            raise AssertionError(f"double free: {slots}")
        self.free_pages.update(pages)
        self.freed.append(slots)

    def free_segment(self, indices: torch.Tensor, start_pos: int = 0) -> None:
        self.free(indices)

    def available_size(self) -> int:
        return len(self.free_pages) * self.page_size


class Sink:
    """An allocator that only records what a cache frees (the differential
    test hands out no slots of its own)."""

    def __init__(self, page_size: int = 1):
        self.device = torch.device("cpu")
        self.page_size = page_size
        self.freed = []

    def free(self, indices: torch.Tensor) -> None:
        self.freed.append(indices.tolist())

    def free_segment(self, indices: torch.Tensor, start_pos: int = 0) -> None:
        self.free(indices)


class ReqToTokenPool:
    def __init__(self, size: int, max_context_len: int, device="cpu"):
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int32, device=device)
        self.free_rows = list(range(size))

    def write(self, indices, values) -> None:
        self.req_to_token[indices] = values


class Req:
    """The fields SGLang's RadixCache reads and writes on a request."""

    def __init__(self, input_ids, extra_key=None, container=list):
        # 0.5.9 keeps token ids in lists, 0.5.16 and later in array('q').
        self.origin_input_ids = container(input_ids)
        self.output_ids = container([])
        self.fill_ids = container(input_ids)
        self.extra_key = extra_key
        self.priority = None
        self.req_pool_idx = None
        self.prefix_indices = torch.empty(0, dtype=torch.int64)
        self.last_node = None
        self.cache_protected_len = 0

    def get_fill_ids(self):  # 0.5.16's accessor
        return self.fill_ids


def cache_and_pools(page=1, slots=512, rows=8, ctx=256, device="cpu", paged=False, **kw):
    alloc = (PagedAllocator if paged else Allocator)(slots, page, device)
    pool = ReqToTokenPool(rows, ctx, device)
    return (
        RadixCache(req_to_token_pool=pool, token_to_kv_pool_allocator=alloc, page_size=page, **kw),
        pool,
        alloc,
    )


# ---------------------------------------------------------------------------
# The documented behaviour
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("page", [1, 4])
def test_match_returns_longest_cached_prefix_in_whole_pages(page):
    c = RadixCache.create_simulated(page_size=page)
    a = list(range(100, 118))  # 18 tokens
    m = c.match_prefix(MatchPrefixParams(key=RadixKey(a)))
    assert isinstance(m, MatchResult) and len(m.device_indices) == 0
    assert m.last_device_node is m.last_host_node and m.host_hit_length == 0
    r = c.insert(InsertParams(key=RadixKey(a), value=torch.arange(18) + 1000))
    assert isinstance(r, InsertResult) and r.prefix_len == 0
    whole = 18 // page * page
    assert c.total_size() == c.evictable_size() == whole and c.protected_size() == 0

    m = c.match_prefix(MatchPrefixParams(key=RadixKey(a[:11] + [7, 7, 7])))
    assert m.device_indices.dtype == torch.int64
    assert m.device_indices.tolist() == list(range(1000, 1000 + 11 // page * page))
    assert m.device_prefix_len == 11 // page * page
    # The plain forms of early 0.5.x: a list of ids, insert(key, value) -> int.
    assert c.match_prefix(a).device_indices.tolist() == list(range(1000, 1000 + whole))
    b = a[:9] + list(range(300, 309))
    assert c.insert(b, torch.arange(2000, 2018)) == 9 // page * page
    got = c.match_prefix(torch.tensor(b)).device_indices.tolist()
    assert got == (
        list(range(1000, 1000 + 9 // page * page))
        + list(range(2000 + 9 // page * page, 2000 + whole))
    )
    assert c.total_size() == whole + whole - 9 // page * page
    # An empty (or shorter than a page) key matches nothing, at the root.
    for key in ([], a[: page - 1]):
        m = c.match_prefix(key)
        assert len(m.device_indices) == 0 and m.last_device_node.cached_len == 0
    c.check_integrity()


def test_insert_without_value_stores_the_token_ids_and_never_overwrites():
    c = RadixCache.create_simulated()
    assert c.insert(InsertParams(key=RadixKey([5, 6, 7]))).prefix_len == 0
    assert c.match_prefix([5, 6, 7]).device_indices.tolist() == [5, 6, 7]
    assert c.insert([5, 6, 7, 8], torch.tensor([50, 60, 70, 80])) == 3
    assert c.match_prefix([5, 6, 7, 8]).device_indices.tolist() == [5, 6, 7, 80]
    # value longer than the key: cut to the key, as SGLang does
    assert c.insert([1, 2], torch.tensor([11, 12, 13, 14])) == 0
    assert c.match_prefix([1, 2]).device_indices.tolist() == [11, 12]


def test_lock_refs_protect_from_eviction_and_return_the_evictable_delta():
    c, _, alloc = cache_and_pools()
    c.insert(list(range(10)), alloc.alloc(10))
    c.insert(
        list(range(6)) + [50, 51],
        torch.cat([c.match_prefix(list(range(6))).device_indices, alloc.alloc(2)]),
    )
    # tree: [0..5] -> {[6..9], [50, 51]}
    node = c.match_prefix(list(range(6)) + [50, 51]).last_device_node
    d = c.inc_lock_ref(node)
    assert d == -8 and d.delta == -8  # int (0.5.x) and .delta (later)
    assert (c.evictable_size(), c.protected_size()) == (4, 8)
    assert c.inc_lock_ref(node) == 0  # locks nest
    evicted = c.evict(100)  # only the unlocked leaf can go
    assert evicted.num_tokens_evicted == 4 and alloc.freed[-1] == [6, 7, 8, 9]
    assert (c.evictable_size(), c.protected_size()) == (0, 8)
    assert c.evict(EvictParams(num_tokens=1)).num_tokens_evicted == 0
    assert c.dec_lock_ref(node) == 0
    assert c.dec_lock_ref(node).delta == 8
    assert (c.evictable_size(), c.protected_size()) == (8, 0)
    with pytest.raises(ValueError, match="not locked"):  # never negative
        c.dec_lock_ref(node)
    assert c.inc_lock_ref(c.root_node) == 0 and c.dec_lock_ref(c.root_node) == 0
    with pytest.raises(TypeError, match="node"):
        c.inc_lock_ref(object())
    assert (c.evictable_size(), c.protected_size()) == (8, 0)


def test_evict_frees_least_recently_used_leaves_first():
    c, _, alloc = cache_and_pools(page=2)
    seqs = {name: [base + i for i in range(6)] for name, base in (("a", 0), ("b", 100), ("c", 200))}
    slots = {}
    for name, s in seqs.items():
        slots[name] = alloc.alloc(6)
        c.insert(InsertParams(key=RadixKey(s), value=slots[name]))
    c.match_prefix(seqs["a"])  # a is now the most recent
    r = c.evict(EvictParams(num_tokens=3))  # whole nodes: b goes, 6 tokens
    assert isinstance(r, EvictResult) and r.num_tokens_evicted == 6
    assert alloc.freed[-1] == slots["b"].tolist()
    assert c.match_prefix(seqs["b"]).device_prefix_len == 0
    assert c.evict(1).num_tokens_evicted == 6 and alloc.freed[-1] == slots["c"].tolist()
    assert c.evict(1000).num_tokens_evicted == 6  # asking for more evicts what there is
    assert c.total_size() == 0 and alloc.available_size() == alloc.size
    assert c.evict(0).num_tokens_evicted == 0


def test_a_parent_left_as_an_unlocked_leaf_is_evicted_too():
    c, _, alloc = cache_and_pools()
    c.insert(list(range(4)), alloc.alloc(4))
    c.insert(
        list(range(4)) + [9],
        torch.cat([c.match_prefix([0, 1, 2, 3]).device_indices, alloc.alloc(1)]),
    )
    assert c.evict(5).num_tokens_evicted == 5
    assert alloc.available_size() == alloc.size and c.total_size() == 0


def test_errors_name_the_argument_and_change_nothing():
    c = RadixCache.create_simulated(page_size=2)
    c.insert([1, 2, 3, 4], torch.tensor([10, 11, 12, 13]))
    before = (c._tree.dump(), c.evictable_size(), c.protected_size())
    with pytest.raises(ValueError, match="value has length 2 but key has length 4"):
        c.insert([5, 6, 7, 8], torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="key must be 1-D"):
        c.match_prefix(torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="key must be 1-D"):
        c.insert(InsertParams(key=RadixKey(torch.zeros(2, 2, dtype=torch.int64))))
    with pytest.raises(TypeError, match="key"):
        c.match_prefix(MatchPrefixParams(key=None))
    with pytest.raises(TypeError, match="value"):
        c.insert([5, 6], torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="value"):
        c.insert([5, 6], torch.tensor([-1, 2]))
    with pytest.raises(TypeError, match="num_tokens"):
        c.evict(1.5)
    with pytest.raises(ValueError, match="num_tokens"):
        c.evict(EvictParams(num_tokens=-1))
    with pytest.raises(TypeError, match="priority"):
        c.insert([5, 6], torch.tensor([1, 2]), priority="high")
    with pytest.raises(NotImplementedError, match="bigram"):
        c.match_prefix(RadixKey([1, 2], is_bigram=True))
    with pytest.raises(ValueError, match="key.limit"):
        c.insert(RadixKey([5, 6, 7, 8], limit=-2), torch.tensor([1, 2, 3, 4]))
    with pytest.raises(TypeError, match="key.limit"):
        c.match_prefix(RadixKey([1, 2], limit="2"))
    assert (c._tree.dump(), c.evictable_size(), c.protected_size()) == before
    assert c.match_prefix(RadixKey([1, 2, 3, 4], limit=2)).device_indices.tolist() == [10, 11]


def test_constructor_forms():
    alloc, pool = Allocator(64, 4), ReqToTokenPool(2, 16)
    params = SimpleNamespace(
        disable=False,
        req_to_token_pool=pool,
        token_to_kv_pool_allocator=alloc,
        page_size=4,
        eviction_policy="LRU",
        is_eagle=False,
        enable_kv_cache_events=False,
    )
    for c in (
        RadixCache(params),
        RadixCache(pool, alloc, 4),
        RadixCache(req_to_token_pool=pool, token_to_kv_pool_allocator=alloc, page_size=4),
    ):
        assert (c.req_to_token_pool, c.token_to_kv_pool_allocator, c.page_size) == (pool, alloc, 4)
        assert c.device == torch.device("cpu") and c.eviction_policy == "lru"
    assert RadixCache.create_simulated().page_size == 1
    with pytest.raises(ValueError, match="page_size"):
        RadixCache(pool, alloc, 0)
    with pytest.raises(ValueError, match="eviction_policy"):
        RadixCache(pool, alloc, 1, eviction_policy="filo")
    with pytest.raises(NotImplementedError, match="is_eagle"):
        RadixCache(pool, alloc, 1, is_eagle=True)
    c = RadixCache(pool, alloc, 4)
    assert c.is_tree_cache() and not (
        c.is_chunk_cache()
        or c.supports_swa()
        or c.supports_mamba()
        or c.supports_fast_match_prefix()
    )
    c.insert(list(range(8)), torch.arange(8))
    assert c.available_and_evictable_str() == (
        "Available tokens: 72 (available_size=64 + evictable_size=8)\n"
    )
    fifo = RadixCache.create_simulated(eviction_policy="fifo")
    fifo.insert([1], torch.tensor([1]))
    fifo.insert([2], torch.tensor([2]))
    fifo.match_prefix([1])  # a hit does not save it under fifo
    assert fifo.evict(1).num_tokens_evicted == 1 and fifo.match_prefix([1]).device_prefix_len == 0


def test_reset_and_pretty_print(capsys):
    c = RadixCache.create_simulated()
    c.insert([1, 2, 3], torch.tensor([7, 8, 9]))
    c.insert([1, 2, 4], torch.tensor([7, 8, 5]))
    c.pretty_print()
    out = capsys.readouterr().out
    assert "[1, 2]" in out and "[3]" in out and "[4]" in out and "#tokens: 4" in out
    assert sorted(c.all_values_flatten().tolist()) == [5, 7, 8, 9]
    old_root = c.root_node
    c.reset()
    assert c.total_size() == 0 and c.match_prefix([1, 2, 3]).device_prefix_len == 0
    assert c.inc_lock_ref(c.root_node) == 0
    with pytest.raises(ValueError):  # a node from before the reset
        c.inc_lock_ref(old_root)


# ---------------------------------------------------------------------------
# The scheduler's per-request calls
# ---------------------------------------------------------------------------


class Scheduler:
    """How SGLang's scheduler drives the cache around a request: match its
    prompt, lock, allocate the rest, prefill in chunks
    (cache_unfinished_req after each but the last), decode, then
    cache_finished_req; the row is freed by the caller afterwards."""

    def __init__(self, cache, pool, alloc, params=MatchPrefixParams, key=RadixKey):
        self.cache, self.pool, self.alloc = cache, pool, alloc
        self.params, self.key = params, key

    def admit(self, req):
        # at least one token is computed: the match leaves out the last one
        m = self.cache.match_prefix(
            self.params(key=self.key(req.origin_input_ids[:-1], req.extra_key))
        )
        req.prefix_indices, req.last_node = m.device_indices, m.last_device_node
        req.cache_protected_len = len(req.prefix_indices)
        self.cache.inc_lock_ref(req.last_node)
        req.req_pool_idx = self.pool.free_rows.pop()
        n = len(req.prefix_indices)
        self.pool.write((req.req_pool_idx, slice(0, n)), req.prefix_indices)
        return n

    def extend(self, req, upto):
        """Compute KV for [len(prefix_indices), upto): fresh slots in the row."""
        start = len(req.prefix_indices)
        paged = isinstance(self.alloc, PagedAllocator)
        need = self.alloc.new_slots_needed(start, upto - start) if paged else upto - start
        short = need - self.alloc.available_size()
        if short > 0:
            self.cache.evict(EvictParams(num_tokens=short))
        if paged:  # the row's last page first, then whole new pages
            last = int(self.pool.req_to_token[req.req_pool_idx, start - 1]) if start else -1
            fresh = self.alloc.alloc_extend(start, last, upto - start)
        else:
            fresh = self.alloc.alloc(upto - start)
        self.pool.write((req.req_pool_idx, slice(start, upto)), fresh)
        req.fill_ids = (req.origin_input_ids + req.output_ids)[:upto]
        req.prefix_indices = self.pool.req_to_token[req.req_pool_idx, :upto].to(torch.int64)

    def row_owned(self, req, upto):
        owned = self.pool.req_to_token[req.req_pool_idx, req.cache_protected_len : upto].tolist()
        if isinstance(self.alloc, PagedAllocator) and owned:
            # The request holds the whole of its row's last page.
            p = self.alloc.page_size
            owned += range(owned[-1] + 1, owned[-1] // p * p + p)
        return owned

    def finish(self, req):
        self.cache.cache_finished_req(req)
        self.pool.free_rows.append(req.req_pool_idx)
        req.req_pool_idx = None


def accounted(cache, alloc, live):
    """free + cached + owned by live requests == the pool, with no slot twice."""
    cached = cache.all_values_flatten().tolist()
    owned = [s for slots in live for s in slots]
    everything = sorted(list(alloc.free_slots) + cached + owned)
    assert everything == list(range(alloc.size)), "a slot leaked or is counted twice"


def q_array(values):
    return array("q", values)




@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("container", [list, q_array])
@pytest.mark.parametrize("page", [1, 4])
def test_cache_unfinished_req_points_the_row_at_the_trees_slots(page, container, device):
    """The pools, the slots and the matched indices all live on `device`
    (SGLang's allocator says where); the tree reads them on the host."""
    c, pool, alloc = cache_and_pools(page, device=device)
    assert c.device == torch.device(device)
    sched = Scheduler(c, pool, alloc)
    prompt = list(range(30))
    r = Req(prompt, container=container)
    assert sched.admit(r) == 0
    sched.extend(r, 13)
    c.cache_unfinished_req(r, chunked=True)
    whole = 13 // page * page
    assert r.cache_protected_len == whole
    assert r.last_node.cached_len == whole and r.last_node.lock_count == 1
    assert r.prefix_indices.device == torch.empty(0, device=c.device).device
    assert r.prefix_indices.dtype == torch.int64
    assert c.protected_size() == whole and c.evictable_size() == 0
    row = pool.req_to_token[r.req_pool_idx, :13].tolist()
    assert row[:whole] == c.path_device_indices(r.last_node).tolist()
    assert r.prefix_indices.tolist() == row  # the partial page stays with the req
    accounted(c, alloc, [sched.row_owned(r, 13)])

    # A second request with the same prompt, admitted before the first caches
    # more, computes the same tokens again: its copies are the duplicates.
    r2 = Req(prompt, container=container)
    assert sched.admit(r2) == whole
    sched.extend(r, 30)
    sched.extend(r2, 30)
    c.cache_unfinished_req(r)
    dup = pool.req_to_token[r2.req_pool_idx, whole : 30 // page * page].tolist()
    c.cache_unfinished_req(r2)
    assert set(dup) <= alloc.free_slots  # r2's duplicates went back
    assert (
        pool.req_to_token[r2.req_pool_idx, : 30 // page * page].tolist()
        == pool.req_to_token[r.req_pool_idx, : 30 // page * page].tolist()
    )
    accounted(c, alloc, [sched.row_owned(r, 30), sched.row_owned(r2, 30)])

    r.output_ids, r2.output_ids = container([900, 901, 902]), container([900, 903])
    sched.extend(r, 32)
    sched.extend(r2, 31)
    sched.finish(r)
    sched.finish(r2)
    assert c.protected_size() == 0
    accounted(c, alloc, [])
    c.evict(c.evictable_size())
    assert alloc.available_size() == alloc.size and c.total_size() == 0


@pytest.mark.parametrize("page", [1, 4])
def test_many_requests_with_shared_prefixes_leak_nothing(page):
    """Random requests over a few shared system prompts, in overlapping waves,
    with chunked prefill, decoding, is_insert=False, and eviction when the
    allocator runs short: after every step each slot is free, cached or held,
    exactly once (the allocator itself refuses a double free)."""
    rng = random.Random(page)
    # A paged pool, as SGLang's at page_size > 1: the tree takes whole pages
    # of consecutive slots.
    c, pool, alloc = cache_and_pools(page, slots=1024, rows=6, ctx=160, paged=page > 1)
    sched = Scheduler(c, pool, alloc)
    systems = [[rng.randrange(1000) for _ in range(40)] for _ in range(3)]
    running = []
    reused = 0
    for step in range(300):
        for _ in range(rng.randrange(3) if len(running) < 5 else 0):  # same-step requests
            if rng.random() < 0.3:  # a new shared prompt appears
                systems.append([rng.randrange(1000) for _ in range(40)])
            sys_prompt = rng.choice(systems[-3:])
            prompt = sys_prompt[: rng.randrange(10, 41)] + [
                rng.randrange(1000) for _ in range(rng.randrange(1, 30))
            ]
            need = len(prompt) + 12
            if alloc.available_size() < need:
                c.evict(EvictParams(num_tokens=need - alloc.available_size()))
            if alloc.available_size() >= need:
                r = Req(prompt)
                reused += sched.admit(r)
                r.computed = len(r.prefix_indices)
                running.append(r)
        for r in list(running):
            if r.computed < len(r.origin_input_ids):  # prefill, in chunks of 16
                upto = min(r.computed + 16, len(r.origin_input_ids))
                sched.extend(r, upto)
                r.computed = upto
                if upto < len(r.origin_input_ids):
                    c.cache_unfinished_req(r)
                else:
                    r.output_ids.append(rng.randrange(1000))  # its KV comes next step
            elif len(r.output_ids) < 10 and rng.random() < 0.8:  # decode one token
                total = len(r.origin_input_ids) + len(r.output_ids)
                sched.extend(r, total)
                r.computed = total
                r.output_ids.append(rng.randrange(1000))
            else:
                if rng.random() < 0.1:
                    c.cache_finished_req(r, is_insert=False)
                    pool.free_rows.append(r.req_pool_idx)
                else:
                    sched.finish(r)
                running.remove(r)
        accounted(c, alloc, [sched.row_owned(r, r.computed) for r in running])
        assert c.protected_size() <= sum(r.cache_protected_len for r in running)
        c.check_integrity()
    assert reused > 0
    for r in running:
        r.output_ids.append(1)  # kv_len_to_handle says how far the KV goes
        c.cache_finished_req(r, kv_len_to_handle=r.computed)
    assert c.protected_size() == 0
    accounted(c, alloc, [])


def test_cache_finished_req_default_length_and_pop_committed_kv_cache():
    c, pool, alloc = cache_and_pools()
    sched = Scheduler(c, pool, alloc)
    r = Req(range(8))
    sched.admit(r)
    r.output_ids = [100, 101]
    sched.extend(r, 9)  # the last output has no KV
    sched.finish(r)
    assert c.total_size() == 9 and c.protected_size() == 0
    r2 = Req(range(8))
    sched.admit(r2)
    r2.output_ids = [100, 102]
    sched.extend(r2, 10)
    r2.pop_committed_kv_cache = lambda: 10  # 0.5.9's request says how far
    c.cache_finished_req(r2)
    assert (
        c.total_size() == 10 and c.match_prefix(list(range(8)) + [100, 102]).device_prefix_len == 10
    )
    accounted(c, alloc, [])


def test_bad_request_fields_raise_before_anything_changes():
    c, pool, alloc = cache_and_pools()
    sched = Scheduler(c, pool, alloc)
    c.insert(list(range(8)), alloc.alloc(8))
    r = Req(range(8))
    sched.admit(r)
    sched.extend(r, 8)
    state = (c._tree.dump(), c.protected_size(), set(alloc.free_slots))
    with pytest.raises(TypeError, match="kv_len_to_handle"):
        c.cache_finished_req(r, kv_len_to_handle="8")
    r.priority = "high"
    with pytest.raises(TypeError, match="req.priority"):
        c.cache_finished_req(r, kv_len_to_handle=8)
    with pytest.raises(TypeError, match="req.priority"):
        c.cache_unfinished_req(r)
    with pytest.raises(TypeError, match="fill_ids"):
        c.cache_unfinished_req(
            SimpleNamespace(req_pool_idx=0, last_node=None, prefix_indices=r.prefix_indices)
        )
    with pytest.raises(TypeError, match="req has no output_ids"):
        c.cache_finished_req(
            SimpleNamespace(
                req_pool_idx=0,
                origin_input_ids=[1],
                last_node=None,
                prefix_indices=r.prefix_indices,
            )
        )
    with pytest.raises(ValueError, match="create_simulated"):
        RadixCache.create_simulated().cache_finished_req(r)
    assert (c._tree.dump(), c.protected_size(), set(alloc.free_slots)) == state
    r.priority = None
    sched.finish(r)
    assert c.protected_size() == 0
    accounted(c, alloc, [])


def test_disabled_cache_caches_nothing_and_frees_everything():
    c, pool, alloc = cache_and_pools(page=2, disable=True)
    sched = Scheduler(c, pool, alloc)
    assert c.insert(InsertParams(key=RadixKey([1, 2]), value=torch.tensor([1, 2]))).prefix_len == 0
    assert c.insert([1, 2], torch.tensor([1, 2])) == 0
    r = Req(range(10), extra_key="never looked at")
    assert sched.admit(r) == 0
    sched.extend(r, 7)
    c.cache_unfinished_req(r)  # nothing happens
    assert r.cache_protected_len == 0 and len(r.prefix_indices) == 7
    r.output_ids = [5]
    sched.extend(r, 10)
    sched.finish(r)
    assert alloc.available_size() == alloc.size
    assert c.total_size() == c.evictable_size() == c.protected_size() == 0
    assert c.inc_lock_ref(c.root_node) == 0 and c.evict(5).num_tokens_evicted == 0
    assert not c.supports_prefix_sharing()


# ---------------------------------------------------------------------------
# extra_key namespaces
# ---------------------------------------------------------------------------


def test_extra_key_none_is_the_default_namespace():
    c = RadixCache.create_simulated()
    c.insert(InsertParams(key=RadixKey([1, 2, 3], extra_key=None), value=torch.tensor([4, 5, 6])))
    assert c.match_prefix([1, 2, 3]).device_prefix_len == 3
    assert c.match_prefix(MatchPrefixParams(key=RadixKey([1, 2], None))).device_prefix_len == 2


def test_extra_key_without_native_namespaces_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(compat, "HAS_NAMESPACES", False)  # as on a tree built without them
    c, pool, alloc = cache_and_pools()
    with pytest.raises(NotImplementedError, match="extra_key='lora-a'"):
        c.match_prefix(MatchPrefixParams(key=RadixKey([1, 2], extra_key="lora-a")))
    with pytest.raises(NotImplementedError, match="extra_key"):
        c.insert(InsertParams(key=RadixKey([1, 2], extra_key="lora-a"), value=torch.tensor([1, 2])))
    r = Req(range(8), extra_key="lora-a")
    r.req_pool_idx, r.last_node = 0, None
    with pytest.raises(NotImplementedError, match="extra_key"):
        c.cache_unfinished_req(r)
    assert c.total_size() == 0 and alloc.available_size() == alloc.size


@pytest.mark.skipif(
    not compat.HAS_NAMESPACES,
    reason="the installed radixkv._core.RadixTree "
    "has no namespace= keyword on match_prefix/insert_prefix",
)
def test_requests_with_different_extra_keys_never_share_a_prefix():
    c, pool, alloc = cache_and_pools()
    sched = Scheduler(c, pool, alloc)
    prompt = list(range(20))
    done = {}
    for extra in (None, "lora-a", "lora-b", "lora-a"):
        r = Req(prompt, extra_key=extra)
        done.setdefault(extra, 0)
        hit = sched.admit(r)
        assert hit == (19 if done[extra] else 0), extra  # shared only within one extra_key
        r.output_ids = [1]
        sched.extend(r, 20)
        sched.finish(r)
        done[extra] += 1
    assert c.total_size() == 3 * 20
    for extra in (None, "lora-a", "lora-b"):
        m = c.match_prefix(MatchPrefixParams(key=RadixKey(prompt, extra)))
        assert m.device_prefix_len == 20
    a = c.match_prefix(RadixKey(prompt, "lora-a")).device_indices
    b = c.match_prefix(RadixKey(prompt, "lora-b")).device_indices
    assert not set(a.tolist()) & set(b.tolist())
    assert c.match_prefix(RadixKey(prompt, "lora-c")).device_prefix_len == 0
    accounted(c, alloc, [])
    c.evict(c.evictable_size())
    assert alloc.available_size() == alloc.size


@pytest.mark.skipif(
    not compat.HAS_NAMESPACES,
    reason="the installed radixkv._core.RadixTree "
    "has no namespace= keyword on match_prefix/insert_prefix",
)
def test_extra_key_names_salts_and_their_bound():
    ids = [1, 2, 3, 4]

    def salted(extra, salt):  # 0.5.23's RadixKey carries a cache_salt beside extra_key
        return SimpleNamespace(token_ids=ids, extra_key=extra, cache_salt=salt)

    c = RadixCache.create_simulated()
    c.insert(RadixKey(ids, "a"), torch.tensor([10, 11, 12, 13]))
    c.insert(salted("a", "s"), torch.tensor([20, 21, 22, 23]))  # a salted key: its own
    assert c.match_prefix(RadixKey(ids, "a")).device_indices.tolist() == [10, 11, 12, 13]
    assert c.match_prefix(salted("a", "s")).device_indices.tolist() == [20, 21, 22, 23]
    for other in (
        salted("a", "t"),
        salted(None, "s"),
        salted("s", "a"),
        RadixKey(ids, b"a"),
        RadixKey(ids, "s"),
    ):
        assert c.match_prefix(other).device_prefix_len == 0
    with pytest.raises(TypeError, match="extra_key"):
        c.match_prefix(RadixKey(ids, 1.5))
    with pytest.raises(TypeError, match="cache_salt"):
        c.match_prefix(salted("a", ["s"]))

    # Two names are remembered: a third forgets the least recently used one,
    # whose prefixes are then a miss (never another name's hit) and age out.
    c = RadixCache.create_simulated(max_namespaces=2)
    c.insert(RadixKey(ids, "a"), torch.tensor([10, 11, 12, 13]))
    c.insert(RadixKey(ids, "b"), torch.tensor([20, 21, 22, 23]))
    assert c.match_prefix(RadixKey(ids, "a")).device_prefix_len == 4  # b is now the oldest
    assert c.match_prefix(RadixKey(ids, "c")).device_prefix_len == 0  # forgets b
    assert c.match_prefix(RadixKey(ids, "a")).device_prefix_len == 4
    assert c.match_prefix(RadixKey(ids, "b")).device_prefix_len == 0
    assert c.total_size() == 8
    assert c.evict(8).num_tokens_evicted == 8


# ---------------------------------------------------------------------------
# Against SGLang's own RadixCache
# ---------------------------------------------------------------------------


def _import_sglang():
    """SGLang's radix cache module, or the reason it does not import here."""
    stubs = os.path.join(os.environ.get("RADIXKV_PEERS_DIR", "/work/peers"), "stubs")
    if importlib.util.find_spec("torchvision") is None and os.path.isdir(stubs):
        sys.path.insert(0, stubs)  # bench/PEERS.md: its import-only torchvision stand-in
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rc = importlib.import_module("sglang.srt.mem_cache.radix_cache")
            bpc = importlib.import_module("sglang.srt.mem_cache.base_prefix_cache")
    except Exception as e:  # any failure of its import chain means: not importable here
        return None, f"{type(e).__name__}: {e}"
    return (rc, bpc), None


@pytest.fixture(scope="module")
def sglang_modules():
    mods, why = _import_sglang()
    if mods is None:
        pytest.skip(
            f"SGLang's RadixCache does not import here ({why}); install it as "
            "bench/PEERS.md says to run this comparison"
        )
    return mods


class TheirCache:
    """SGLang's RadixCache driven through its own parameter objects, whatever
    0.5.x is installed (device_indices up to 0.5.16, device_prefix_len later)."""

    def __init__(self, mods, page):
        rc, bpc = mods
        self.rc, self.bpc = rc, bpc
        self.alloc = Sink(page)
        self.cache = rc.RadixCache.create_simulated(mock_allocator=self.alloc, page_size=page)

    def key(self, tokens, extra=None):
        return self.rc.RadixKey(array("q", tokens), extra)

    def match(self, tokens, extra=None):
        r = self.cache.match_prefix(self.bpc.MatchPrefixParams(key=self.key(tokens, extra)))
        if hasattr(r, "device_indices"):
            return r.last_device_node, r.device_indices.tolist()
        path = self.cache.path_device_indices(r.last_device_node)
        return r.last_device_node, path[: r.device_prefix_len].tolist()

    def insert(self, tokens, value, extra=None):
        return self.cache.insert(
            self.bpc.InsertParams(key=self.key(tokens, extra), value=value)
        ).prefix_len

    def lock(self, node, unlock):
        r = self.cache.dec_lock_ref(node) if unlock else self.cache.inc_lock_ref(node)
        return r if isinstance(r, int) else r.delta

    def evict(self, n):
        return self.cache.evict(self.bpc.EvictParams(num_tokens=n)).num_tokens_evicted

    def sizes(self):
        return self.cache.evictable_size(), self.cache.protected_size()


@pytest.mark.parametrize("page", [1, 4])
def test_same_results_as_sglangs_radix_cache(sglang_modules, page):
    """2,000 random matches, inserts, locks, unlocks and evictions on both
    (over three extra_keys where the native tree has namespaces): equal
    matched indices, insert results, lock deltas and evictable /
    protected sizes after every step. An eviction frees at least what was
    asked on both; which leaves go first may differ, as SGLang also refreshes
    the unmatched rest of a node that a match or insert splits (radixkv
    refreshes exactly the tokens used), so each partial eviction is followed
    by evicting everything unlocked, after which both have freed the same
    slots and hold the same (locked) paths."""
    theirs = TheirCache(sglang_modules, page)
    ours = RadixCache.create_simulated(mock_allocator=Sink(page), page_size=page)
    rng = random.Random(page)
    bases = [[rng.randrange(50) for _ in range(48)] for _ in range(4)]
    # extra_key namespaces where the native tree has them
    extras = [None, "lora-a", "lora-b"] if compat.HAS_NAMESPACES else [None]
    slot = 0
    held = []  # (their node, our node)
    for k in range(2000):
        base = rng.choice(bases)
        tokens = base[: rng.randrange(49)] + [rng.randrange(50) for _ in range(rng.randrange(9))]
        extra = rng.choice(extras)
        op = rng.random()
        if op < 0.45:
            (tn, ti), m = (
                theirs.match(tokens, extra),
                ours.match_prefix(MatchPrefixParams(key=RadixKey(tokens, extra))),
            )
            assert m.device_indices.tolist() == ti, k
            if rng.random() < 0.3:
                assert theirs.lock(tn, False) == ours.inc_lock_ref(m.last_device_node), k
                held.append((tn, m.last_device_node))
        elif op < 0.85:
            value = torch.arange(slot, slot + len(tokens), dtype=torch.int64)
            slot += len(tokens)
            assert (
                theirs.insert(tokens, value, extra)
                == ours.insert(InsertParams(key=RadixKey(tokens, extra), value=value)).prefix_len
            ), k
        elif op < 0.93 and held:
            tn, on = held.pop(rng.randrange(len(held)))
            assert theirs.lock(tn, True) == ours.dec_lock_ref(on), k
        else:
            n, there = rng.randrange(1, 40), ours.evictable_size()
            assert theirs.evict(n) >= min(n, there), k
            assert ours.evict(EvictParams(num_tokens=n)).num_tokens_evicted >= min(n, there), k
            # Which leaves go first may differ (see the docstring): evicting the
            # rest leaves both with exactly the locked paths, every slot freed once.
            theirs.evict(1 << 30), ours.evict(1 << 30)
            assert sorted(s for f in theirs.alloc.freed for s in f) == sorted(
                s for f in ours.token_to_kv_pool_allocator.freed for s in f
            ), k
        assert theirs.sizes() == (ours.evictable_size(), ours.protected_size()), k


@pytest.mark.parametrize("page", [1, 4])
def test_same_kv_events_as_sglangs_radix_cache(sglang_modules, page):
    """400 random inserts (three namespaces, one with a cache_salt) and
    full evictions on both caches with events on: after every operation the
    same events, field for field, but for the block hashes themselves
    (radixkv's are its page keys): as many per event, parents where
    SGLang's are, the same tokens, sizes, media and salts."""
    rc, bpc = sglang_modules
    theirs = rc.RadixCache.create_simulated(
        mock_allocator=Sink(page), page_size=page, enable_kv_cache_events=True
    )
    ours = RadixCache.create_simulated(
        mock_allocator=Sink(page), page_size=page, enable_kv_cache_events=True
    )

    def shape(events):
        return [
            (
                type(e).__name__,
                len(getattr(e, "block_hashes", ())),
                getattr(e, "parent_block_hash", None) is None,
                getattr(e, "token_ids", None),
                getattr(e, "block_size", None),
                getattr(e, "medium", None),
                getattr(e, "cache_salt", None),
            )
            for e in events
        ]

    assert shape(theirs.take_events()) == shape(ours.take_events())
    rng = random.Random(page)
    bases = [[rng.randrange(50) for _ in range(40)] for _ in range(4)]
    tags = (
        [(None, None), ("tenant", None), ("tenant", "salt")]
        if compat.HAS_NAMESPACES
        else [(None, None)]
    )
    slot, seen = 0, collections.Counter()
    for k in range(400):
        if rng.random() < 0.9:
            tokens = rng.choice(bases)[: rng.randrange(41)] + [
                rng.randrange(50) for _ in range(rng.randrange(9))
            ]
            extra, salt = rng.choice(tags)
            value = torch.arange(slot, slot + len(tokens), dtype=torch.int64)
            slot += len(tokens)
            theirs.insert(
                bpc.InsertParams(
                    key=rc.RadixKey(array("q", tokens), extra, cache_salt=salt), value=value
                )
            )
            ours.insert(InsertParams(key=RadixKey(tokens, extra, cache_salt=salt), value=value))
        else:
            theirs.evict(bpc.EvictParams(num_tokens=1 << 30))
            ours.evict(EvictParams(num_tokens=1 << 30))
        events = shape(theirs.take_events())
        assert events == shape(ours.take_events()), k
        seen.update(e[0] for e in events)
    assert seen["BlockStored"] > 200 and seen["BlockRemoved"] > 10, seen


def test_same_requests_leave_the_same_pools_as_sglangs_radix_cache(sglang_modules):
    """The scheduler's per-request calls (match, lock, chunked prefill with
    cache_unfinished_req, decode, cache_finished_req) for 200 steps of random
    requests over shared prompts, page size 4, on both caches with their own
    pools: after every step the same slots are free, every running request's
    row, prefix_indices and cache_protected_len are equal, and so are the
    evictable and protected sizes. Requests carry an extra_key of two where
    the native tree has namespaces."""
    import inspect

    rc, bpc = sglang_modules
    if not hasattr(rc.RadixCache, "cache_finished_req"):
        pytest.skip(
            "this SGLang's RadixCache has no cache_finished_req (0.5.23 has "
            "checkpoint / release_kv_cache instead)"
        )
    takes_len = "kv_len_to_handle" in inspect.signature(rc.RadixCache.cache_finished_req).parameters
    page = 4
    sides = []
    for theirs in (True, False):
        alloc, pool = Allocator(4096, page), ReqToTokenPool(6, 160)
        if theirs:
            cache = rc.RadixCache.create_simulated(mock_allocator=alloc, page_size=page)
            cache.req_to_token_pool = pool
            sched = Scheduler(
                cache, pool, alloc, bpc.MatchPrefixParams, lambda t, e: rc.RadixKey(t, e)
            )
        else:  # built from SGLang's own CacheInitParams
            cip = importlib.import_module("sglang.srt.mem_cache.cache_init_params")
            cache = RadixCache(
                cip.CacheInitParams(
                    disable=False,
                    req_to_token_pool=pool,
                    token_to_kv_pool_allocator=alloc,
                    page_size=page,
                )
            )
            assert (cache.page_size, cache.req_to_token_pool) == (page, pool)
            sched = Scheduler(cache, pool, alloc)
        sides.append(sched)

    def finish(sched, r, is_insert):
        if takes_len:
            sched.cache.cache_finished_req(r, is_insert, kv_len_to_handle=r.computed)
        else:
            r.pop_committed_kv_cache = lambda: r.computed
            sched.cache.cache_finished_req(r, is_insert)
        sched.pool.free_rows.append(r.req_pool_idx)

    rng = random.Random(7)
    extras = [None, "lora-a"] if compat.HAS_NAMESPACES else [None]
    systems = [[rng.randrange(1000) for _ in range(40)] for _ in range(3)]
    running = []  # (their req, our req)
    for step in range(200):
        # Requests admitted in the same step compute their shared prompt twice:
        # the one caching it second frees its duplicates.
        for _ in range(rng.randrange(3) if len(running) < 5 else 0):
            if rng.random() < 0.3:  # a new shared prompt appears
                systems.append([rng.randrange(1000) for _ in range(40)])
            prompt = rng.choice(systems[-3:])[: rng.randrange(10, 41)] + [
                rng.randrange(1000) for _ in range(rng.randrange(1, 30))
            ]
            extra = rng.choice(extras)
            pair = (Req(prompt, extra, q_array), Req(prompt, extra, q_array))
            for sched, r in zip(sides, pair):
                sched.admit(r)
                r.computed = len(r.prefix_indices)
            running.append(pair)
        for pair in list(running):
            a = pair[0]
            if a.computed < len(a.origin_input_ids):
                upto = min(a.computed + 16, len(a.origin_input_ids))
                more = upto < len(a.origin_input_ids)
                tok = rng.randrange(1000)
                for sched, r in zip(sides, pair):
                    sched.extend(r, upto)
                    r.computed = upto
                    if more:
                        sched.cache.cache_unfinished_req(r)
                    else:
                        r.output_ids.append(tok)
            elif len(a.output_ids) < 10 and rng.random() < 0.8:
                tok = rng.randrange(1000)
                for sched, r in zip(sides, pair):
                    total = len(r.origin_input_ids) + len(r.output_ids)
                    sched.extend(r, total)
                    r.computed = total
                    r.output_ids.append(tok)
            else:
                is_insert = rng.random() > 0.1
                for sched, r in zip(sides, pair):
                    finish(sched, r, is_insert)
                running.remove(pair)
        (a_sched, b_sched) = sides
        assert a_sched.alloc.free_slots == b_sched.alloc.free_slots, step
        for a, b in running:
            assert (
                a_sched.pool.req_to_token[a.req_pool_idx, : a.computed].tolist()
                == b_sched.pool.req_to_token[b.req_pool_idx, : b.computed].tolist()
            ), step
            assert a.prefix_indices.tolist() == b.prefix_indices.tolist(), step
            assert a.cache_protected_len == b.cache_protected_len, step
        assert (a_sched.cache.evictable_size(), a_sched.cache.protected_size()) == (
            b_sched.cache.evictable_size(),
            b_sched.cache.protected_size(),
        ), step


def _admitted(c, pool, alloc, ids, extra_key=None):
    """A request matched, locked and extended to all its tokens: (scheduler,
    request, tokens it matched)."""
    sched = Scheduler(c, pool, alloc)
    r = Req(ids, extra_key)
    n = sched.admit(r)
    sched.extend(r, len(ids))
    return sched, r, n


def test_a_request_that_does_not_hold_its_lock_is_refused_before_anything_changes():
    """A lock of another cache, not a node, a protected length below the
    lock's prefix or past the tokens, a second finish: refused with the
    tree, the locks and the allocator as they were (freeing first would
    give the allocator slots the tree still maps)."""
    c, pool, alloc = cache_and_pools(page=4)
    sched, r0, _ = _admitted(c, pool, alloc, list(range(41)))
    sched.finish(r0)
    sched, r, n = _admitted(c, pool, alloc, list(range(45)))
    assert n == 40
    other, _, _ = cache_and_pools(page=4)
    foreign = other.match_prefix(RadixKey(list(range(8)))).last_device_node
    other.inc_lock_ref(foreign)
    state = lambda: (c._tree.dump(), c.protected_size(), set(alloc.free_slots))  # noqa: E731
    before, node = state(), r.last_node
    for last_node, protected, exc, words in [
        (foreign, 40, ValueError, "another cache"),
        ("node", 40, TypeError, "req.last_node"),
        (node, 36, ValueError, "cache_protected_len"),
        (node, 60, ValueError, "cache_protected_len"),
    ]:
        r.last_node, r.cache_protected_len = last_node, protected
        for call in (c.cache_finished_req, c.cache_unfinished_req):
            with pytest.raises(exc, match=words):
                call(r)
            assert state() == before
    r.last_node, r.cache_protected_len = node, 40
    row = r.req_pool_idx
    sched.finish(r)
    after = state()
    r.req_pool_idx = row
    with pytest.raises(ValueError, match="not locked"):
        c.cache_finished_req(r)  # finished twice
    assert state() == after
    accounted(c, alloc, [])


def test_a_request_whose_extra_key_was_forgotten_finishes_in_its_namespace():
    c, pool, alloc = cache_and_pools(page=4, max_namespaces=1)
    sched, r0, _ = _admitted(c, pool, alloc, list(range(41)), extra_key="a")
    sched.finish(r0)
    sched, r1, n = _admitted(c, pool, alloc, list(range(45)), extra_key="a")
    assert n == 40
    c.match_prefix(RadixKey([1, 2, 3, 4, 5], "b"))  # "a" leaves the table
    sched.finish(r1)
    assert c.protected_size() == 0
    accounted(c, alloc, [])


def test_request_fields_sglang_never_has_are_refused():
    """Token ids as a NumPy array would broadcast `+` into other tokens; a
    negative length would drop slots."""
    import numpy as np

    c, pool, alloc = cache_and_pools(page=4)
    sched, r, _ = _admitted(c, pool, alloc, list(range(20)))
    before = (c._tree.dump(), set(alloc.free_slots))
    r.origin_input_ids = np.array(r.origin_input_ids)
    with pytest.raises(TypeError, match="req.origin_input_ids"):
        c.cache_finished_req(r, kv_len_to_handle=20)
    r.origin_input_ids = list(range(20))
    with pytest.raises(ValueError, match="kv_len_to_handle"):
        c.cache_finished_req(r, kv_len_to_handle=-8)
    row = r.req_pool_idx
    for idx, exc in ((None, TypeError), (100, ValueError), (-1, ValueError), ("0", TypeError)):
        r.req_pool_idx = idx
        for call in (c.cache_finished_req, c.cache_unfinished_req):
            with pytest.raises(exc, match="req.req_pool_idx"):
                call(r)
    r.req_pool_idx, fill = row, r.fill_ids
    r.fill_ids = None
    with pytest.raises(TypeError, match="req.fill_ids"):
        c.cache_unfinished_req(r)
    r.fill_ids = fill
    assert (c._tree.dump(), set(alloc.free_slots)) == before
    r.output_ids = array("q", [])  # a list and an array together are fine
    sched.finish(r)
    accounted(c, alloc, [])


# -- what SGLang's own unit tests check of the key, the match and the events --------------


def test_a_key_slices_indexes_iterates_and_shows_its_tokens():
    key = RadixKey([1, 2, 3, 4, 5], "extra", cache_salt="s")
    assert list(key) == [1, 2, 3, 4, 5]
    part = key[1:4]
    assert isinstance(part, RadixKey) and part.token_ids == [2, 3, 4]
    assert (part.extra_key, part.cache_salt) == ("extra", "s")
    assert key[-1].token_ids == [5] and key[0].token_ids == [1]
    assert key[2:2].token_ids == [] and key[:].token_ids == [1, 2, 3, 4, 5]
    with pytest.raises(IndexError):
        key[10]
    with pytest.raises(ValueError, match="step"):
        key[::2]
    with pytest.raises(TypeError, match="int or a slice"):
        key["1"]
    capped = RadixKey([1, 2, 3, 4, 5], limit=3)
    assert list(capped) == [1, 2, 3] and capped[1:].token_ids == [2, 3]
    assert RadixKey(list(range(10))).page_aligned(4).token_ids == list(range(8))
    text = repr(RadixKey([1, 2, 3], "test"))
    assert "extra_key='test'" in text and "[1, 2, 3]" in text
    assert "..." in repr(RadixKey(list(range(15))))


def test_a_match_says_its_prefix_len():
    c = RadixCache.create_simulated(page_size=2)
    c.insert(RadixKey([1, 2, 3, 4, 5]), torch.tensor([10, 11, 12, 13, 14]))
    m = c.match_prefix(RadixKey([1, 2, 3, 4, 9]))
    assert m.prefix_len == m.device_prefix_len == 4


@pytest.mark.parametrize("page_size", [1, 2])
def test_kv_events_are_chains_of_pages_stored_and_removed_on_eviction(page_size):
    """As SGLang 0.5.23 queues them: an insert's new pages are one
    BlockStored (a page per block hash), continuing the event before it when
    they continue its chain; evictions in a row are one BlockRemoved."""
    BlockStored, BlockRemoved, AllBlocksCleared = compat._event_types()  # SGLang's where it is
    freed = []
    alloc = type(
        "Alloc",
        (),
        {"device": torch.device("cpu"), "free": lambda self, idx: freed.append(idx.tolist())},
    )()
    c = RadixCache(None, alloc, page_size, enable_kv_cache_events=True)
    assert c.enable_kv_cache_events
    assert [type(e) for e in c.take_events()] == [AllBlocksCleared]
    c.insert(RadixKey([1, 2, 3, 4, 5]), torch.tensor([10, 11, 12, 13, 14]))
    [first] = c.take_events()
    pages = 5 // page_size
    assert type(first) is BlockStored and first.block_size == page_size
    assert len(first.block_hashes) == len(set(first.block_hashes)) == pages
    assert first.token_ids == [1, 2, 3, 4, 5][: pages * page_size]
    assert first.parent_block_hash is None
    assert c.take_events() == []
    # A longer key adds only its new pages, chained on the cached ones; a
    # second sequence after it starts an event of its own.
    c.insert(RadixKey([1, 2, 3, 4, 5, 6, 7]), torch.tensor([10, 11, 12, 13, 14, 15, 16]))
    c.insert(RadixKey([9, 8, 7, 6]), torch.tensor([30, 31, 32, 33]))
    more, apart = c.take_events()
    assert len(more.block_hashes) == 7 // page_size - pages
    assert more.parent_block_hash == first.block_hashes[-1]
    assert apart.parent_block_hash is None and apart.token_ids == [9, 8, 7, 6]
    # Inserts that continue each other's chains in one step: one event.
    c.insert(RadixKey([9, 8, 7, 6, 5, 4]), torch.tensor([30, 31, 32, 33, 34, 35]))
    c.insert(RadixKey([9, 8, 7, 6, 5, 4, 3, 2]), torch.tensor([30, 31, 32, 33, 34, 35, 36, 37]))
    [joined] = c.take_events()
    assert joined.token_ids == [5, 4, 3, 2] and len(joined.block_hashes) == 4 // page_size
    # Another namespace: other hashes for the same tokens, its salt on the event.
    c.insert(RadixKey([1, 2, 3, 4], "tenant", cache_salt="s"), torch.tensor([20, 21, 22, 23]))
    [other] = c.take_events()
    assert other.block_hashes[0] != first.block_hashes[0]
    assert getattr(other, "cache_salt", "s") == "s"  # SGLang's events carry it
    c.evict(100)
    [removed] = c.take_events()
    assert type(removed) is BlockRemoved
    stored = {h for e in (first, more, apart, joined, other) for h in e.block_hashes}
    assert sorted(removed.block_hashes) == sorted(stored)
    # Off: nothing recorded.
    quiet = RadixCache(None, alloc, page_size)
    quiet.insert(RadixKey([1, 2, 3, 4]), torch.tensor([1, 2, 3, 4]))
    assert quiet.take_events() == [] and not quiet.enable_kv_cache_events


def test_a_key_matches_another_of_its_namespace_only():
    a = RadixKey([1, 2, 3, 4, 5], "x")
    assert a.match(RadixKey([1, 2, 3, 9], "x")) == 3
    assert a.match(RadixKey([1, 2, 3, 4, 5, 6], "x"), page_size=2) == 4
    assert RadixKey([1, 2, 3], limit=2).match(RadixKey([1, 2, 3])) == 2
    with pytest.raises(ValueError, match="extra_key"):
        a.match(RadixKey([1, 2]))
    with pytest.raises(ValueError, match="cache_salt"):
        a.match(RadixKey([1, 2], "x", cache_salt="s"))


def test_a_key_that_repeats_a_token_needs_values():
    c = RadixCache.create_simulated(page_size=4)
    with pytest.raises(ValueError, match="value=None .* repeats a token"):
        c.insert(RadixKey([1, 2, 3, 4, 1, 2, 3, 4]), None)
    assert c.evictable_size() == 0
    c.insert(RadixKey([1, 2, 3, 4, 1, 2, 3, 4]), torch.arange(8))
    assert c.match_prefix(RadixKey([1, 2, 3, 4, 1, 2, 3, 4])).device_indices.tolist() == list(
        range(8)
    )
