"""Random operations on RadixCacheManager and the model in reference.py, compared step by step.

Every return value (cached_len, indices, insert results, evicted slots in
order, raised error types), size_info, num_nodes, handle state and the whole
tree (dump: keys, slots, ref counts, LRU timestamps) must agree after every
step, and check_integrity() must pass after every step.

The long runs compare the dump with sibling order factored out (see
reference.canonical), so that they test the tree's content; the exact order of
dump() rows is compared by test_dump_order_matches_reference.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import radixkv
from radixkv.kvcache import RadixCacheManager, SizeInfo
from reference import RefOutOfCapacity, ReferenceRadixCache, canonical

PAGE_SIZES = [1, 2, 4, 16, 512]


def _as_torch64(v):
    return torch.tensor(v, dtype=torch.int64)


def _as_torch_strided(v):
    base = torch.zeros(2 * len(v), dtype=torch.int32)
    base[::2] = torch.tensor(v, dtype=torch.int32)
    return base[::2]


def _as_numpy_reversed(v):
    return np.array(v[::-1], dtype=np.int64)[::-1]


ALLOC_PAGES = 1 << 21  # the page-form finish's allocator (Driver.alloc)

INPUT_FORMS = [
    list,
    tuple,
    _as_torch64,
    lambda v: torch.tensor(v, dtype=torch.int32),
    lambda v: np.array(v, dtype=np.int32),
    _as_torch_strided,
    _as_numpy_reversed,
]


class Driver:
    """Applies the same random operation to the native manager and the model."""

    def __init__(
        self,
        page_size: int,
        seed: int,
        strict_dump: bool = False,
        policy: str = "lru",
        pages: bool = False,
    ):
        self.p = page_size
        # `pages`: the tree is aligned and half the matches and evictions go
        # through the page forms (page ids, read back as their slots).
        self.page_forms = pages
        self.rng = random.Random(seed)
        # tlru: leaves of at most two pages are safe to evict first.
        config = {"threshold": 3 * page_size, "next_prompt_estimate": page_size}
        tlru = policy == "tlru"
        self.native = RadixCacheManager(
            "cpu",
            page_size,
            eviction_policy=policy,
            eviction_policy_config=config if tlru else None,
            aligned_pages=pages,
        )
        self.ref = ReferenceRadixCache(page_size, policy, 2 * page_size if tlru else 0)
        self.priorities = policy == "priority"
        self.strict_dump = strict_dump
        self.held = []  # (native handle, model handle)
        self.history = []  # recent token sequences, to share prefixes with
        # Slots come as a paged pool hands them out: whole pages of `page_size`
        # consecutive slots, page g being slots base + g * page_size + i. The
        # base (fixed per run) need not be a multiple of page_size: the tree
        # asks only that a page's slots be consecutive.
        self.free_pages = []  # pages handed back by evict / not stored by insert
        self.next_page = 0
        self.slot_base = self.rng.randrange(page_size) if not pages else 3 * page_size
        self.cap = 128 * page_size if page_size > 1 else 300
        # A small pool of pages, with near-duplicates that differ in one token
        # (first, middle or last), so walks stop inside pages and at page ends.
        alphabet = 3
        base = [[self.rng.randrange(alphabet) for _ in range(self.p)] for _ in range(3)]
        pool = [list(x) for x in base]
        if self.p > 1:
            for b in base:
                for pos in (0, self.p // 2, self.p - 1):
                    v = list(b)
                    v[pos] = (v[pos] + 1) % alphabet
                    pool.append(v)
        self.pages = pool
        self.counts = {}
        if pages:
            # The page-form finish takes its pages from an allocator: one whose
            # every page is handed out, so the driver's own pool (page g is
            # page id 3 + g) is "allocated", and what a finish frees is read
            # back from it.
            self.alloc = radixkv._core.PageAllocator(ALLOC_PAGES, page_size)
            self.alloc.allocate_pages(ALLOC_PAGES * page_size)

    # -- inputs ------------------------------------------------------------------
    def tokens(self):
        r = self.rng
        if self.history and r.random() < 0.65:
            src = r.choice(self.history)
            cut = r.randrange(len(src) + 1)
            out = list(src[:cut])
        else:
            out = []
        if r.random() < 0.04:
            n_pages = r.randrange(8, 40 if self.p == 1 else 12)  # long keys
        else:
            n_pages = r.randrange(0, 5)
        for _ in range(n_pages):
            out.extend(r.choice(self.pages))
        if self.p > 1 and r.random() < 0.3:
            out.extend(r.randrange(3) for _ in range(r.randrange(1, self.p)))  # ragged tail
        if out:
            self.history.append(out)
            if len(self.history) > 40:
                self.history.pop(self.rng.randrange(len(self.history)))
        return out

    def fresh_slots(self, n):
        """n slots: whole pages of consecutive slots (the last one cut short when
        n is not a multiple of page_size), pages reused in random order."""
        pages = []
        n_pages = -(-n // self.p)
        self.rng.shuffle(self.free_pages)
        while len(pages) < n_pages and self.free_pages:
            pages.append(self.free_pages.pop())
        while len(pages) < n_pages:
            if self.rng.random() < 0.002 * self.p:
                # sparse, growing slot bitmap
                self.next_page += -(-self.rng.randrange(1, 5000) // self.p)
            pages.append(self.next_page)
            self.next_page += 1
        return [self.slot_base + g * self.p + i for g in pages for i in range(self.p)][:n]

    def free(self, slots):
        """Hand back the pages of `slots` (whole pages, or the start of one)."""
        self.free_pages.extend((s - self.slot_base) // self.p for s in slots[:: self.p])

    def form(self, v):
        return self.rng.choice(INPUT_FORMS)(v)

    def stored_slots(self):
        return [s for _, _, value, _, _ in self.ref.dump() for s in value]

    def stored_pages(self):
        """The tree's pages, each a list of page_size consecutive slots."""
        slots = self.stored_slots()
        return [slots[i : i + self.p] for i in range(0, len(slots), self.p)]

    # -- operations ----------------------------------------------------------------
    def slots_of(self, page_ids: torch.Tensor) -> torch.Tensor:
        """The slots of page ids from a page form."""
        assert page_ids.dtype == torch.int32 and page_ids.dim() == 1
        ramp = torch.arange(self.p, dtype=torch.int32)
        return (page_ids.view(-1, 1) * self.p + ramp).view(-1)

    def use_pages(self) -> bool:
        return self.page_forms and self.rng.random() < 0.5

    def op_match(self):
        ids = self.tokens()
        if self.use_pages():
            h, page_ids = self.native.tree.match_pages(self.form(ids))
            idx = self.slots_of(page_ids)
            self.count("match_pages")
        else:
            h, idx = self.native.match_prefix(self.form(ids))
        rh, ridx = self.ref.match_prefix(ids)
        assert idx.dtype == torch.int32 and idx.dim() == 1
        assert h.cached_len == rh.cached_len == len(idx), (h.cached_len, rh.cached_len)
        assert idx.tolist() == ridx
        if self.rng.random() < 0.6:
            self.keep(h, rh)
        return ids, idx.tolist()

    def keep(self, h, rh):
        self.held.append((h, rh))
        if len(self.held) > 24:
            # Forget a handle that holds no lock (or is stale), never leak locks.
            idle = [
                i
                for i, (_, r) in enumerate(self.held)
                if r.lock_count == 0 or not self.ref.is_valid(r)
            ]
            if idle:
                self.held.pop(self.rng.choice(idle))

    def op_insert(self):
        r = self.rng
        if self.page_forms and r.random() < 0.4:
            return self.op_finish_pages()
        if r.random() < 0.3:
            # The usual flow: match, then insert the matched slots plus new ones.
            ids, prefix = self.op_match()
            ids = ids + self.tokens()[: r.randrange(0, 4 * self.p + 1)]
            new = self.fresh_slots(len(ids) - len(prefix))
            slots = prefix + new
            n_own = len(prefix)
        else:
            ids = self.tokens()
            slots = self.fresh_slots(len(ids))
            n_own = 0
        if self.priorities:  # a few classes, as requests' priorities are
            prio = r.choice([-2, 0, 0, 1, 3])
            got = self.native.insert_prefix(self.form(ids), self.form(slots), priority=prio)
            want = self.ref.insert_prefix(ids, slots, priority=prio)
        else:
            got = self.native.insert_prefix(self.form(ids), self.form(slots))
            want = self.ref.insert_prefix(ids, slots)
        assert type(got) is int
        assert got == want
        assert got >= n_own
        n = len(ids) - len(ids) % self.p
        # Slots the tree did not keep go back to the caller's free list.
        self.free(slots[n_own:got])
        self.free(slots[n:])

    def op_finish_pages(self):
        """A request's whole flow in page ids: match_pages, lock, its own pages
        after the match's, finish_request_pages (the insert from the handle, the
        frees, the unlock), against the model's match, lock, insert, unlock;
        the pages the finish gave back are exactly those the model did not keep."""
        r, p = self.rng, self.p
        ids = self.tokens()
        h, page_ids = self.native.tree.match_pages(self.form(ids))
        rh, prefix = self.ref.match_prefix(ids)
        assert self.slots_of(page_ids).tolist() == prefix and h.cached_len == rh.cached_len
        self.native.lock_handle(h)
        self.ref.lock_handle(rh)
        ids = ids + self.tokens()[: r.randrange(0, 4 * p + 1)]
        new = self.fresh_slots(len(ids) - len(prefix))
        own = [s // p for s in new[::p]]  # (slot_base is 3 pages: page g is id 3 + g)
        assert not own or max(own) < ALLOC_PAGES
        prio = r.choice([-2, 0, 0, 1, 3]) if self.priorities else 0
        row = page_ids.tolist() + own
        got = self.native.tree.finish_request_pages(
            h, self.form(ids), self.form(row), self.alloc, prio
        )
        want = self.ref.insert_prefix(ids, prefix + new, priority=prio)
        self.ref.lock_handle(rh, True)
        assert got == want and got >= len(prefix)
        assert h.lock_count == rh.lock_count
        n = len(ids) - len(ids) % p
        slots = prefix + new
        unkept = sorted(s // p for s in slots[len(prefix) : got : p] + slots[n::p])
        back = self.alloc.num_free_pages
        freed = self.alloc.allocate_pages(back * p).tolist() if back else []
        assert sorted(freed) == unkept
        self.free(slots[len(prefix) : got])
        self.free(slots[n:])
        self.count("finish_pages")

    def op_lock(self):
        live = [(h, rh) for h, rh in self.held if self.ref.is_valid(rh)]
        if not live:
            return self.op_match()
        h, rh = self.rng.choice(live)
        self.native.lock_handle(h)
        self.ref.lock_handle(rh)

    def op_unlock(self):
        locked = [(h, rh) for h, rh in self.held if rh.lock_count > 0 and self.ref.is_valid(rh)]
        if not locked:
            return self.op_lock()
        h, rh = self.rng.choice(locked)
        self.native.lock_handle(h, unlock=True)
        self.ref.lock_handle(rh, True)

    def op_evict(self):
        r = self.rng
        evictable = self.ref.size_info()[0]
        x = r.random()
        if x < 0.08:
            size = 0
        elif x < 0.11:
            size = evictable
        elif x < 0.18:
            size = evictable + r.randrange(1, 3 * self.p + 2)
        else:
            size = r.randrange(0, min(evictable, 6 * self.p) + 1)
        if size > evictable:
            with pytest.raises(radixkv.OutOfCapacityError) as e:
                self.native.evict(size)
            assert str(size) in str(e.value) and str(evictable) in str(e.value)
            with pytest.raises(RefOutOfCapacity):
                self.ref.evict(size)
            self.count("evict_refused")
            return
        if self.use_pages():
            out = self.slots_of(self.native.tree.evict_pages(size))
            self.count("evict_pages")
        else:
            out = self.native.evict(size)
        want = self.ref.evict(size)
        assert out.dtype == torch.int32 and out.dim() == 1
        assert out.tolist() == want
        assert len(want) >= size
        self.free(want)

    def op_reset(self):
        self.free(self.stored_slots())
        self.native.reset()
        self.ref.reset()

    def op_invalid(self):
        """A call that must raise and change nothing (the clock included: later
        timestamps are compared with the model's, which did not tick)."""
        r = self.rng
        choice = r.randrange(4)
        if choice == 0:
            stale = [(h, rh) for h, rh in self.held if not self.ref.is_valid(rh)]
            if stale:
                h, rh = r.choice(stale)
                with pytest.raises(ValueError, match="handle"):
                    self.native.lock_handle(h, unlock=r.random() < 0.5)
                self.count("stale_handle")
                return
        if choice == 1:
            idle = [(h, rh) for h, rh in self.held if rh.lock_count == 0 and self.ref.is_valid(rh)]
            if idle:
                h, rh = r.choice(idle)
                with pytest.raises(ValueError, match="handle"):
                    self.native.lock_handle(h, unlock=True)
                self.count("unlock_unlocked")
                return
        stored = self.stored_pages()
        if choice == 2 and stored:
            # An uncached sequence whose new part repeats a page the tree holds
            # (a whole page, consecutive, so that "already stored" is the fault).
            ids = [-1 - r.randrange(1000)] * self.p + self.tokens()
            slots = self.fresh_slots(len(ids))
            n = len(ids) - len(ids) % self.p
            k = r.randrange(n // self.p) * self.p
            self.free(slots)
            slots[k : k + self.p] = r.choice(stored)
            with pytest.raises(ValueError, match="indices.*already stored"):
                self.native.insert_prefix(self.form(ids), self.form(slots))
            with pytest.raises(ValueError):
                self.ref.insert_prefix(ids, slots)
            self.count("slot_stored")
            return
        with pytest.raises(ValueError, match="size"):
            self.native.evict(-r.randrange(1, 10))
        self.count("evict_negative")

    def count(self, name):
        self.counts[name] = self.counts.get(name, 0) + 1

    # -- the loop ----------------------------------------------------------------
    def step(self):
        r = self.rng
        evictable, protected = self.ref.size_info()
        if evictable + protected > self.cap and r.random() < 0.5:
            name = "evict" if evictable > 0 and r.random() < 0.7 else "unlock"
        elif protected > self.cap // 2 and r.random() < 0.5:
            name = "unlock"
        else:
            name = r.choices(
                ["match", "insert", "lock", "unlock", "evict", "invalid", "reset"],
                weights=[26, 32, 12, 12, 9, 6, 0.25],
            )[0]
        self.count(name)
        getattr(self, "op_" + name)()
        self.compare()

    def compare(self):
        native, ref = self.native, self.ref
        assert native.size_info == SizeInfo(*ref.size_info())
        assert native.num_nodes == ref.num_nodes
        dump, ref_dump = native.dump(), ref.dump()
        if self.strict_dump:
            assert dump == ref_dump
        else:
            assert canonical(dump) == canonical(ref_dump)
        for h, rh in self.held:
            assert native.is_valid(h) == ref.is_valid(rh)
            assert h.lock_count == rh.lock_count
            assert h.cached_len == rh.cached_len
        native.check_integrity()


@pytest.mark.parametrize(
    "page_size, seed",
    # Two seeds at page 512: a run there moves 6k-token inputs through the model.
    [(p, s) for p in PAGE_SIZES for s in ((0, 1) if p == 512 else (0, 1, 2))],
)
def test_random_operations_match_reference(page_size, seed):
    d = Driver(page_size, seed=1000 * page_size + seed)
    steps = 4000
    for i in range(steps):
        try:
            d.step()
        except AssertionError as e:
            raise AssertionError(f"step {i} (page_size={page_size}, seed={seed}): {e}") from e
    # The run must have exercised what it claims to.
    c = d.counts
    for name in (
        "match",
        "insert",
        "lock",
        "unlock",
        "evict",
        "reset",
        "evict_refused",
        "stale_handle",
        "unlock_unlocked",
        "slot_stored",
        "evict_negative",
    ):
        assert c.get(name, 0) > 0, (name, c)
    assert d.ref.clock > steps // 2


@pytest.mark.parametrize("page_size", [1, 3, 16, 512])
def test_the_page_forms_match_the_reference(page_size):
    """An aligned tree (a bit a page in its sets where the page size is a
    power of two; page 3 keeps a bit a slot), half its matches and
    evictions in page ids and some of its inserts as a request's page-form
    finish, against the model."""
    d = Driver(page_size, seed=77 + page_size, pages=True)
    for i in range(2500 if page_size < 512 else 1200):
        try:
            d.step()
        except AssertionError as e:
            raise AssertionError(f"step {i} (page_size={page_size}): {e}") from e
    for name in ("match_pages", "evict_pages", "finish_pages", "match", "evict", "slot_stored"):
        assert d.counts.get(name, 0) > 0, (name, d.counts)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_random_operations_build_deep_trees(page_size):
    """Sanity check of the generator: splits and sharing really happen."""
    d = Driver(page_size, seed=7 + page_size)
    max_nodes = max_depth_nodes = 0
    for _ in range(600):
        d.step()
        dump = d.native.dump()
        max_nodes = max(max_nodes, len(dump))
        depth = {}
        for i, row in enumerate(dump):
            depth[i] = depth.get(row[0], 0) + 1
        max_depth_nodes = max([max_depth_nodes] + list(depth.values()))
    assert max_nodes >= 10
    assert max_depth_nodes >= 4


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_dump_order_matches_reference(page_size):
    """dump() rows in exactly the model's order: parents first, the children of a
    node together and in ascending key order, the stack order of RadixTree::Dump."""
    d = Driver(page_size, seed=99 + page_size, strict_dump=True)
    for i in range(300):
        try:
            d.step()
        except AssertionError as e:
            raise AssertionError(f"step {i} (page_size={page_size}): {e}") from e


@pytest.mark.parametrize("policy", ["lfu", "fifo", "mru", "priority", "slru", "tlru"])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", [0, 1])
def test_every_eviction_policy_evicts_exactly_as_the_model(policy, page_size, seed):
    """The same random runs under each policy: every evicted slot, in order,
    and the whole tree after every step, against the model's definition of
    the policy (reference.POLICY_KEYS)."""
    d = Driver(page_size, seed=500 * page_size + seed, policy=policy)
    for i in range(2500):
        try:
            d.step()
        except AssertionError as e:
            raise AssertionError(f"step {i} ({policy}, page_size={page_size}): {e}") from e
    assert d.counts.get("evict", 0) > 50


def test_eviction_policies_order_leaves_as_documented():
    def tree(policy):
        m = RadixCacheManager("cpu", 1, eviction_policy=policy)
        m.insert_prefix([1, 2, 3], [0, 1, 2], priority=5)  # oldest, high priority
        m.insert_prefix([4, 5], [3, 4])
        m.insert_prefix([6, 7], [5, 6], priority=-1)  # newest insert, lowest priority
        m.match_prefix([1, 2, 3]), m.match_prefix([1, 2, 3]), m.match_prefix([4, 5])
        return m

    first = {p: tree(p).evict(1).tolist() for p in ("lru", "lfu", "fifo", "mru", "priority")}
    assert first == {
        "lru": [5, 6],
        "lfu": [5, 6],
        "fifo": [0, 1, 2],
        "mru": [3, 4],
        "priority": [5, 6],
    }

    # slru: a leaf matched twice is protected, however long ago.
    def two_leaves(policy):
        m = RadixCacheManager("cpu", 1, eviction_policy=policy)
        m.insert_prefix([1, 2], [0, 1])
        m.insert_prefix([4, 5], [3, 4])
        m.match_prefix([1, 2]), m.match_prefix([1, 2]), m.match_prefix([4, 5])
        return m

    assert two_leaves("lru").evict(1).tolist() == [0, 1]
    assert two_leaves("slru").evict(1).tolist() == [3, 4]
    # tlru: a leaf short enough to recompute within the budget goes first.
    m = RadixCacheManager("cpu", 1, eviction_policy="tlru", eviction_policy_config={"threshold": 3})
    m.insert_prefix([1, 2], [0, 1])  # 2 tokens: safe
    m.insert_prefix([4, 5, 6, 7], [3, 4, 5, 6])  # 4 tokens: not safe, and older use
    m.match_prefix([1, 2])
    assert m.evict(1).tolist() == [0, 1]
    with pytest.raises(ValueError, match="eviction_policy_config is tlru's"):
        RadixCacheManager("cpu", 1, eviction_policy="lru", eviction_policy_config={})
    with pytest.raises(ValueError, match="takes threshold and next_prompt_estimate"):
        RadixCacheManager("cpu", 1, eviction_policy="tlru", eviction_policy_config={"xi": 1})
    with pytest.raises(ValueError, match="threshold"):
        RadixCacheManager(
            "cpu", 1, eviction_policy="tlru", eviction_policy_config={"threshold": -1}
        )
    with pytest.raises(ValueError, match="eviction_policy must be one of"):
        RadixCacheManager("cpu", 1, eviction_policy="random")
    with pytest.raises(ValueError, match="priority must fit int32"):
        tree("priority").insert_prefix([9], [9], priority=2**40)
