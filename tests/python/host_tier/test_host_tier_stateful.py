"""A state machine over the tiered CacheManager: requests come and go, and the
test decides when each queued copy between device and host completes or fails.

The manager runs with `manual_copies=True`: the controller has no thread, a
copy runs when a rule completes it (or fails it), or when a request reads its
K/V (`k_cache(layer)` waits for its layer, which runs the loads queued so
far). Every request stores K/V derived from its tokens and positions, and
every row a request is handed as cached, from the device or loaded back from
host, is compared with what was stored for that token at that position.
After every step `check_integrity` covers both pools and the copies in flight.

CI runs a bounded budget; RADIXKV_HYPOTHESIS_PROFILE=long runs many more.
"""

from dataclasses import dataclass

import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import radixkv
from radixkv.kvcache import MHAKVCache
from radixkv.replay.replay import KVShape
from radixkv.scheduler import CacheManager

# The budgets (profiles "ci" and "long") are conftest.py's.

KV = KVShape(num_layers=2, num_kv_heads=1, head_dim=8, dtype=torch.float16)
POLICIES = ["write_through", "write_through_selective", "write_back"]


@dataclass
class Request:
    handle: object
    ids: torch.Tensor
    cached: torch.Tensor  # the cache's slots for ids[:handle.cached_len]
    own: torch.Tensor  # the request's pages for the rest


def prompts(page_size):
    """Token lists with many shared prefixes: whole pages drawn from three
    patterns, then a partial page."""
    pattern = st.integers(0, 2)
    if page_size == 1:
        return st.lists(st.integers(0, 3), min_size=1, max_size=20).map(
            lambda xs: torch.tensor(xs, dtype=torch.int32)
        )
    pages = st.lists(pattern, min_size=0, max_size=4)
    tail = st.integers(1, page_size)

    def build(args):
        ps, t = args
        blocks = [torch.arange(page_size, dtype=torch.int32) * 3 + p for p in ps]
        blocks.append(torch.full((t,), 7, dtype=torch.int32))
        return torch.cat(blocks)

    return st.tuples(pages, tail).map(build)


class TieredMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.requests = []
        self.failed = []

    @initialize(
        page_size=st.sampled_from([1, 16]),
        policy=st.sampled_from(POLICIES),
        host_ratio=st.sampled_from([0.5, 1, 2, 3]),
        host_layout=st.sampled_from(["page_first", "layer_first"]),
    )
    def setup(self, page_size, policy, host_ratio, host_layout):
        self.page_size = page_size
        self.device_pages = 24 if page_size == 1 else 8
        self.host_pages = max(1, int(self.device_pages * host_ratio))
        self.pool = MHAKVCache(
            KV.num_kv_heads,
            KV.num_layers,
            KV.head_dim,
            self.device_pages,
            KV.dtype,
            page_size=page_size,
        )
        self.cm = CacheManager(
            self.device_pages,
            page_size=page_size,
            host_num_pages=self.host_pages,
            write_policy=policy,
            kv_cache=self.pool,
            host_layout=host_layout,
            manual_copies=True,
        )
        self.ids_st = prompts(page_size)

    # -- the K/V oracle -------------------------------------------------------

    def store(self, slots, ids, start):
        for layer in range(KV.num_layers):
            self.pool.store_kv(
                KV.rows(ids, start, layer, 0), KV.rows(ids, start, layer, 1), slots, layer
            )

    def check_rows(self, slots, ids, start=0):
        if len(slots) == 0:
            return
        for layer in range(KV.num_layers):
            # k_cache(layer) waits for (here: runs) the loads queued so far.
            for side, cache in ((0, self.pool.k_cache(layer)), (1, self.pool.v_cache(layer))):
                rows = cache.reshape(-1, KV.num_kv_heads, KV.head_dim)[slots.long()]
                want = KV.rows(ids, start, layer, side)
                assert torch.equal(
                    rows.view(torch.int16), want.view(torch.int16)
                ), f"layer {layer} side {side}: cached K/V differs from what was stored"

    def take_failed(self, failed):
        self.failed.extend(failed)

    def is_failed(self, handle):
        return any(h is handle for h in self.failed)

    # -- requests ---------------------------------------------------------------

    @rule(data=st.data())
    def start_request(self, data):
        ids = data.draw(self.ids_st)
        pages = -(-len(ids) // self.page_size)
        if pages > self.device_pages:
            return
        h, idx = self.cm.match_req(ids)
        assert h.cached_len + h.host_hit_len <= len(ids) - 1
        assert len(idx) == h.cached_len
        self.check_rows(idx, ids[: h.cached_len])
        device_hit = h.cached_len
        if h.host_hit_len:
            before = self.cm.host_size_info
            try:
                h, idx = self.cm.load_back(h)
            except radixkv.OutOfCapacityError:
                # Nothing new is loading (waiting for an earlier load may have ended it).
                assert self.cm.host_size_info.loading <= before.loading
                return
            assert h.cached_len == device_hit + (len(idx) - device_hit)
            assert h.lock_count == 1
        else:
            self.cm.lock(h)
        try:
            own = self.cm.allocate(len(ids) - h.cached_len)
        except radixkv.OutOfCapacityError:
            self.cm.unlock(h)
            return
        self.store(own[: len(ids) - h.cached_len], ids[h.cached_len :], h.cached_len)
        self.requests.append(Request(h, ids, idx, own))

    def _read_kv(self, r):
        """The request's forward pass: reads its K/V (running queued loads),
        then the scheduler applies acknowledgements."""
        for layer in range(KV.num_layers):
            self.pool.k_cache(layer)
        self.take_failed(self.cm.loading_check())
        if self.is_failed(r.handle):
            return False
        self.check_rows(r.cached, r.ids[: r.handle.cached_len])
        self.check_rows(
            r.own[: len(r.ids) - r.handle.cached_len],
            r.ids[r.handle.cached_len :],
            r.handle.cached_len,
        )
        return True

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def finish_request(self, data):
        r = self.requests.pop(data.draw(st.integers(0, len(self.requests) - 1)))
        if not self._read_kv(r):
            return self._abandon(r)
        self.cm.free_and_cache_finished_req(r.handle, r.ids, torch.cat([r.cached, r.own]))

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def chunked_prefill_step(self, data):
        i = data.draw(st.integers(0, len(self.requests) - 1))
        r = self.requests[i]
        if not self._read_kv(r):
            self.requests.pop(i)
            return self._abandon(r)
        h, idx = self.cm.cache_unfinished_req(r.handle, r.ids, torch.cat([r.cached, r.own]))
        assert h.lock_count == 1
        self.requests[i] = Request(h, r.ids, idx[: h.cached_len], idx[h.cached_len :])
        self.check_rows(idx[: h.cached_len], r.ids[: h.cached_len])

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def abort_request(self, data):
        self._abandon(self.requests.pop(data.draw(st.integers(0, len(self.requests) - 1))))

    def _abandon(self, r):
        # A request whose load failed is computed again elsewhere: it returns
        # its lock and its own pages; the failed load's pages were freed.
        self.cm.unlock(r.handle)
        self.cm.free(r.own)

    # -- the copies ---------------------------------------------------------------

    @rule(data=st.data(), ok=st.booleans())
    def complete_a_copy(self, data, ok):
        waiting = self.cm.controller.waiting()
        if waiting:
            self.cm.controller.complete(data.draw(st.sampled_from(waiting)), ok)

    @rule()
    def writing_check(self):
        self.cm.writing_check()

    @rule()
    def loading_check(self):
        self.take_failed(self.cm.loading_check())

    @rule()
    def drain(self):
        self.take_failed(self.cm.drain())
        assert self.cm.controller.in_flight == 0
        info = self.cm.host_size_info
        assert info.backing_up == 0 and info.loading == 0

    # -- invariants ---------------------------------------------------------------

    @invariant()
    def integrity(self):
        if hasattr(self, "cm"):
            self.cm.check_integrity()

    def teardown(self):
        if not hasattr(self, "cm"):
            return
        for r in self.requests:
            if self._read_kv(r):
                self.cm.free_and_cache_finished_req(r.handle, r.ids, torch.cat([r.cached, r.own]))
            else:
                self._abandon(r)
        self.take_failed(self.cm.drain())
        self.cm.check_integrity()
        assert self.cm.held_pages == 0
        info = self.cm.host_size_info
        assert info.free + info.cached == info.capacity
        evictable, protected = self.cm.manager.size_info
        assert protected == 0
        assert self.cm.free_pages * self.page_size + evictable == self.device_pages * self.page_size


TestTieredMachine = TieredMachine.TestCase


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("page_size", [1, 16, 512])
def test_every_policy_and_page_size_runs_a_long_random_session(policy, page_size):
    """A fixed-seed session per (policy, page size), so each combination is
    exercised whatever hypothesis draws."""
    g = torch.Generator().manual_seed(page_size * 7 + POLICIES.index(policy))
    m = TieredMachine()
    m.setup(page_size=page_size, policy=policy, host_ratio=2, host_layout="page_first")

    steps = 0
    for _ in range(300):
        op = int(torch.randint(0, 10, (1,), generator=g))
        if op < 4 or not m.requests:
            n_pages = int(torch.randint(0, 4, (1,), generator=g))
            ids = _prompt(g, page_size, n_pages)
            m.start_request(_Fixed([ids]))
        elif op < 6:
            m.finish_request(_Fixed([int(torch.randint(0, len(m.requests), (1,), generator=g))]))
        elif op == 6:
            m.chunked_prefill_step(
                _Fixed([int(torch.randint(0, len(m.requests), (1,), generator=g))])
            )
        elif op == 7:
            waiting = m.cm.controller.waiting()
            if waiting:
                pick = waiting[int(torch.randint(0, len(waiting), (1,), generator=g))]
                m.cm.controller.complete(pick, bool(torch.randint(0, 4, (1,), generator=g)))
        elif op == 8:
            m.writing_check()
            m.loading_check()
        else:
            m.abort_request(_Fixed([int(torch.randint(0, len(m.requests), (1,), generator=g))]))
        m.integrity()
        steps += 1
    counters = m.cm.tier_counters
    m.teardown()
    assert steps == 300
    # The session really used the tier.
    assert counters.backed_up > 0
    assert m.cm.tier_counters.loaded_back > 0


class _Fixed:
    """Stands in for hypothesis' `data` with values decided by the test."""

    def __init__(self, values):
        self.values = list(values)

    def draw(self, strategy):
        return self.values.pop(0)


def _prompt(g, page_size, n_pages):
    if page_size == 1:
        n = int(torch.randint(1, 16, (1,), generator=g))
        return torch.randint(0, 3, (n,), generator=g, dtype=torch.int32)
    blocks = [
        torch.arange(page_size, dtype=torch.int32) * 3 + int(torch.randint(0, 3, (1,), generator=g))
        for _ in range(n_pages)
    ]
    blocks.append(
        torch.full((int(torch.randint(1, page_size + 1, (1,), generator=g)),), 7, dtype=torch.int32)
    )
    return torch.cat(blocks)
