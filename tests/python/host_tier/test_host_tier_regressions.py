"""Regression tests for the host tier (L2): one group per failure class that
SGLang's HiCache users hit (docs/reliability.md, "The cache", lists the
guarantees), driven through CacheManager's public API.

Every request stores K/V rows derived from its whole prefix (a rolling hash
of the tokens up to and including each position, the layer and K or V), so a
row handed to the wrong node, or read back from the wrong tier, shows. After
the steps that matter, `Env.check` runs `check_integrity`, an accounting built
here from `dump(tiers=True)` and `tier_sizes()` (device: free + cached + held +
loading == total; host: free + cached + backing up == capacity; no slot
twice; both tiers root-closed) and an oracle that compares the bytes of every
node's device and host slots with what was stored for its tokens.

Most tests run the controller with `manual_copies=True`, so they decide when
each copy runs (`controller.complete(id, ok)`); the last one runs the real
controller thread.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch

import radixkv
from radixkv.kvcache import KVCacheLayout, MHAKVCache
from radixkv.scheduler import CacheManager

LAYERS, HEADS, DIM = 2, 2, 4
DTYPE = torch.float32


def seq(n, start=0):
    return list(range(start, start + n))


# --- K/V rows: a function of the whole prefix ---------------------------------------


def _prefix_hashes(ids):
    out, h = [], 0
    for t in ids:
        h = (h * 1000003 + int(t) + 1) % (1 << 31)
        out.append(h)
    return out


def kv_rows(ids, start, end, layer, side, heads=HEADS, dim=DIM, dtype=DTYPE):
    """[end - start, heads, dim] rows for positions start..end of `ids`: bytes
    derived from a hash of the prefix up to each position, the layer and K/V
    (any bit pattern: compare them as bytes)."""
    h = torch.tensor(_prefix_hashes(list(ids)[:end])[start:], dtype=torch.int64)
    width = heads * dim * dtype.itemsize
    x = h[:, None] * 1000003 + torch.arange(width) * 7919 + layer * 104729 + side * 1299709
    x = (x & 0xFFFFFFF) * 2654435761
    raw = ((x >> 16) & 0xFF).to(torch.uint8)
    return raw.view(dtype).view(-1, heads, dim)


def same_bytes(a, b):
    return a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


# --- the environment ----------------------------------------------------------------


class Env:
    """A CacheManager with a host tier over a real MHAKVCache."""

    def __init__(
        self,
        num_pages,
        host_pages,
        page_size=1,
        policy="write_through",
        layout="page_first",
        manual=True,
        heads=HEADS,
        dim=DIM,
        dtype=DTYPE,
        kv_layout=KVCacheLayout.LayerFirst,
    ):
        self.ps = page_size
        self.heads, self.dim, self.dtype = heads, dim, dtype
        self.pool = MHAKVCache(
            heads,
            LAYERS,
            dim,
            num_pages,
            dtype,
            kv_layout=kv_layout,
            page_size=page_size,
            tp_size=1,
        )
        self.cm = CacheManager(
            num_pages,
            page_size=page_size,
            host_num_pages=host_pages,
            write_policy=policy,
            kv_cache=self.pool,
            host_layout=layout,
            manual_copies=manual,
        )
        self.failed = []  # handles of failed loads, as loading_check/drain return them

    # -- K/V ------------------------------------------------------------------------

    def rows(self, ids, start, end, layer, side):
        return kv_rows(ids, start, end, layer, side, self.heads, self.dim, self.dtype)

    def store(self, ids, slots, start):
        slots = torch.as_tensor(slots, dtype=torch.int32)
        if len(slots) == 0:
            return
        for layer in range(LAYERS):
            self.pool.store_kv(
                self.rows(ids, start, start + len(slots), layer, 0),
                self.rows(ids, start, start + len(slots), layer, 1),
                slots,
                layer,
            )

    def _flat(self, cache, slots):
        return cache.reshape(-1, self.heads, self.dim)[torch.as_tensor(slots, dtype=torch.long)]

    def device_rows(self, slots, layer, side):
        """Rows of the device pool, read without waiting for loads."""
        buf = self.pool.kv_buffer
        if self.pool.kv_layout is KVCacheLayout.LayerFirst:
            cache = buf[side, layer]  # [2, L, P, S, H, D]
        else:
            cache = buf[side, :, layer]  # [2, P, L, S, H, D]
        return self._flat(cache, slots)

    def forward_rows(self, slots, layer, side):
        """Rows as a forward pass reads them: k_cache/v_cache wait for the layer's loads."""
        cache = self.pool.k_cache(layer) if side == 0 else self.pool.v_cache(layer)
        return self._flat(cache, slots)

    def host_rows(self, slots, layer, side):
        hp = self.cm.host_pool
        return self._flat(hp.k_cache(layer) if side == 0 else hp.v_cache(layer), slots)

    def assert_rows(self, read, slots, ids, start, what):
        slots = list(torch.as_tensor(slots).tolist())
        for layer in range(LAYERS):
            for side in (0, 1):
                got = read(slots, layer, side)
                want = self.rows(ids, start, start + len(slots), layer, side)
                if not same_bytes(got, want):
                    diff = got.contiguous().view(torch.uint8).view(
                        len(slots), -1
                    ) != want.contiguous().view(torch.uint8).view(len(slots), -1)
                    bad = diff.any(1).nonzero().flatten().tolist()
                    raise AssertionError(
                        f"{what}: layer {layer} {'KV'[side]} rows differ at positions "
                        f"{[start + i for i in bad]} (slots {[slots[i] for i in bad]})"
                    )

    def scrub(self):
        """Fills every free device page with garbage, so a load that does not
        copy shows."""
        n = self.cm.free_pages * self.ps
        if not n:
            return
        slots = self.cm.allocate(n)
        junk = (
            torch.full((n * self.heads * self.dim * self.dtype.itemsize,), 0xA5, dtype=torch.uint8)
            .view(self.dtype)
            .view(n, self.heads, self.dim)
        )
        for layer in range(LAYERS):
            self.pool.store_kv(junk, junk, slots, layer)
        self.cm.free(slots)

    # -- the tree -------------------------------------------------------------------

    def nodes(self):
        """[(path tokens, start, device slots, host slots, ref_count, parent index)]."""
        out = []
        for parent, key, dev, host, ref, _ in self.cm._tree.dump(tiers=True):
            above = out[parent][0] if parent >= 0 else []
            out.append((above + list(key), len(above), list(dev), list(host), ref, parent))
        return out

    def node_for(self, ids):
        """The node whose path is exactly `ids` (None if there is none)."""
        for n in self.nodes():
            if n[0] == list(ids):
                return n
        return None

    def _covered(self, ids, tier):
        """How many of `ids`' leading tokens lie on nodes with a copy in `tier`
        (2: device, 3: host); root-closed sets make this a prefix."""
        ids, best = list(ids), 0
        for n in self.nodes():
            path, start = n[0], n[1]
            if not n[tier] or path[:start] != ids[:start]:
                continue
            common = start
            while common < min(len(path), len(ids)) and path[common] == ids[common]:
                common += 1
            if common > start:
                best = max(best, common)
        return best

    def host_tokens_of(self, ids):
        return self._covered(ids, 3)

    def device_tokens_of(self, ids):
        return self._covered(ids, 2)

    # -- checks ---------------------------------------------------------------------

    def check(self, idle=False, held=None, content=True):
        cm, ps = self.cm, self.ps
        cm.check_integrity()
        ev, prot, host, host_only, backing, loading, _ = cm._tree.tier_sizes()
        info = cm.host_size_info
        assert (info.cached, info.host_only, info.backing_up, info.loading) == (
            host,
            host_only,
            backing,
            loading,
        )
        assert cm.manager.size_info.evictable_size == ev
        assert cm.manager.size_info.protected_size == prot
        # Device: every page free, cached, held by a request or owned by a load.
        assert cm.free_pages * ps + ev + prot + cm.held_pages * ps + loading == cm.num_pages * ps, (
            cm.free_pages,
            ev,
            prot,
            cm.held_pages,
            loading,
        )
        assert cm.available_size == cm.free_pages * ps + ev
        # Host: every slot free, cached or owned by a backup.
        assert info.free + host + backing == info.capacity, info
        assert 0 <= info.free <= info.capacity
        nodes = self.nodes()
        dev = [s for n in nodes for s in n[2]]
        hst = [s for n in nodes for s in n[3]]
        assert len(dev) == len(set(dev)) == ev + prot
        assert len(hst) == len(set(hst)) == host
        assert all(0 <= s < cm.num_pages * ps for s in dev)
        assert all(0 <= s < info.capacity for s in hst)
        assert sum(len(n[3]) for n in nodes if not n[2]) == host_only
        for path, start, d, h, ref, parent in nodes:
            assert d or h or loading or backing, f"node {path} is in no tier"
            if parent >= 0:
                # Root-closed: device nodes under device nodes, host copies under host copies.
                assert not d or nodes[parent][2], f"device node {path} under a host-only parent"
                assert not h or nodes[parent][3], f"host copy of {path} under a parent without one"
            assert not d or len(d) == len(path) - start
            assert not h or len(h) == len(path) - start
        if idle:
            assert backing == 0 and loading == 0, (backing, loading)
            assert cm.controller.in_flight == 0 and cm.controller.waiting() == []
            assert prot == 0, f"{prot} device tokens still locked at rest"
            assert cm.held_pages == (held or 0)
            assert info.free + info.cached == info.capacity
            assert cm.free_pages * ps + ev + cm.held_pages * ps == cm.num_pages * ps
        c = cm.tier_counters
        assert c.backed_up - c.host_evicted == host, c
        if content:
            for path, start, d, h, _, _ in nodes:
                if d:
                    self.assert_rows(self.device_rows, d, path, start, f"device copy of {path}")
                if h:
                    self.assert_rows(self.host_rows, h, path, start, f"host copy of {path}")

    def state(self):
        """Everything an erroring call must leave alone."""
        cm = self.cm
        return (
            cm._tree.dump(tiers=True),
            cm._tree.tier_sizes(),
            cm.free_pages,
            cm.held_pages,
            cm.host_size_info,
            cm.tier_counters,
            cm.controller.waiting(),
            cm.controller.in_flight,
        )

    # -- requests -------------------------------------------------------------------

    def start(self, ids, load=True):
        return Req(self, ids, load)

    def run(self, ids, drain=True):
        r = Req(self, ids)
        r.forward()
        r.finish()
        if drain:
            self.drain()
        return r

    def drain(self):
        failed = self.cm.drain()
        self.failed += failed
        return failed

    def complete_all(self, ok=True, order=None):
        ids = self.cm.controller.waiting()
        for op in order(ids) if order else ids:
            assert self.cm.controller.complete(op, ok)
        return ids

    def evict_device(self):
        """Evicts every unlocked device page (write_back backs them up first)."""
        return self.cm.make_room(self.cm.available_size)


class Req:
    """One request through the engine flow: match, load back or lock, allocate, store."""

    def __init__(self, env, ids, load=True):
        cm = env.cm
        self.env, self.ids = env, list(ids)
        h, idx = cm.match_req(self.ids)
        assert len(idx) == h.cached_len
        self.matched = h
        self.device_hit, self.host_hit = h.cached_len, h.host_hit_len
        if load and h.host_hit_len:
            h, idx = cm.load_back(h)
            assert h.lock_count == 1
            assert len(idx) == h.cached_len
        else:
            cm.lock(h)
        self.handle, self.cached = h, idx
        self.n_own = len(self.ids) - h.cached_len
        try:
            self.own = cm.allocate(self.n_own)
        except radixkv.OutOfCapacityError:
            cm.unlock(h)  # the request waits; a load it started goes on without it
            raise
        env.store(self.ids, self.own[: self.n_own], h.cached_len)

    @property
    def loaded_slots(self):
        return self.cached[self.device_hit :]

    def forward(self):
        """Reads every cached row as attention would, and checks it."""
        self.env.assert_rows(
            self.env.forward_rows,
            self.cached,
            self.ids,
            0,
            f"cached rows of request {self.ids[:3]}...",
        )

    def finish(self):
        self.env.cm.free_and_cache_finished_req(
            self.handle, self.ids, torch.cat([self.cached, self.own])
        )

    def abort(self):
        """A request whose load failed: unlock, free its own pages, compute again later."""
        self.env.cm.unlock(self.handle)
        self.env.cm.free(self.own)


# =====================================================================================
# 1. SGLang #19126: host slots freed while a copy still used them (IMA).
# =====================================================================================


def test_19126_host_eviction_never_takes_pages_of_a_backup_in_flight():
    """A backup in flight owns its host pages: host eviction for a later
    backup must take other pages, and completing the copies in any order
    leaves both host copies intact."""
    env = Env(num_pages=32, host_pages=8)
    cm = env.cm
    A, B, C = seq(4, 100), seq(4, 200), seq(4, 300)
    env.run(A)
    assert env.host_tokens_of(A) == 4
    env.evict_device()
    env.check(idle=True)
    assert env.node_for(A)[2] == [] and env.node_for(A)[3]  # host only

    env.run(B, drain=False)  # B's backup is queued, its host pages owned
    (op_b,) = cm.controller.waiting()
    assert cm.host_size_info.backing_up == 4 and cm.host_size_info.free == 0
    env.check()

    env.run(C, drain=False)  # needs 4 host slots: only A (host only) may go
    ops = cm.controller.waiting()
    assert len(ops) == 2 and op_b in ops
    (op_c,) = [o for o in ops if o != op_b]
    assert env.node_for(A) is None, "A, the only evictable host copy, should have been evicted"
    assert cm.tier_counters.host_evicted == 4 and cm.tier_counters.backups_skipped == 0
    assert cm.host_size_info.backing_up == 8
    env.check()

    # D needs host room but everything is owned by the two backups in flight.
    D = seq(4, 400)
    env.run(D, drain=False)
    assert cm.tier_counters.backups_skipped == 4
    assert sorted(cm.controller.waiting()) == sorted([op_b, op_c])
    env.check()

    # Complete the later copy first, then the earlier one.
    assert cm.controller.complete(op_c, True)
    assert cm.writing_check() == 1
    env.check()
    assert cm.controller.complete(op_b, True)
    assert cm.writing_check() == 1
    env.check()
    assert env.host_tokens_of(B) == 4 and env.host_tokens_of(C) == 4
    assert env.host_tokens_of(D) == 0

    # The host copies really hold B's and C's K/V: evict the device, load back.
    env.evict_device()
    env.scrub()
    for ids in (B, C):
        r = env.start(ids)
        assert r.host_hit == 3 and r.device_hit == 0
        r.forward()
        r.finish()
        env.drain()
        env.check(idle=True)


def test_19126_host_pages_of_a_load_in_flight_are_not_evicted_or_reused():
    """A load in flight reads its host pages: a backup that needs host room
    (write_through_selective backs up in match_req, while the load runs) must
    not evict them (it is skipped instead), and the load brings the right K/V."""
    env = Env(num_pages=16, host_pages=6, policy="write_through_selective")
    cm = env.cm
    A, B = seq(7, 10), seq(7, 50)
    for _ in range(3):  # the second match of A's nodes backs them up
        env.run(A)
    assert env.host_tokens_of(A) == 6
    env.evict_device()
    env.scrub()
    for _ in range(2):
        env.run(B)
    assert env.host_tokens_of(B) == 0
    env.check(idle=True)
    host_before = env.node_for(A[:6])[3]

    r = env.start(A)  # load of A[:6] queued, not run
    assert r.host_hit == 6 and cm.host_size_info.loading == 6
    assert cm.controller.waiting()
    env.check(held=1)

    h, _ = cm.match_req(B)  # B's second hit: its backup needs the host pool
    assert h.cached_len == 6
    assert cm.tier_counters.host_evicted == 0, "a loading node's host copy was evicted"
    assert cm.tier_counters.backups_skipped == 6
    assert env.node_for(A[:6])[3] == host_before
    env.check(held=1)

    # Host pressure from a direct host eviction: the loading node is not a victim.
    with pytest.raises(radixkv.OutOfCapacityError):
        cm._tree.evict_host(1)
    env.check(held=1)

    r.forward()  # waits for the load (runs it)
    assert cm.loading_check() == []
    assert cm.tier_counters.loaded_back == 6
    r.finish()
    env.drain()
    env.check(idle=True)


def test_19126_failed_backup_frees_its_host_pages_exactly_once():
    """A failed backup returns its host pages once: the next backups get them
    and nothing is owned twice."""
    env = Env(num_pages=32, host_pages=4, page_size=2)
    cm = env.cm
    A, B, C = seq(8, 0), seq(8, 100), seq(8, 200)
    env.run(A, drain=False)
    env.complete_all(ok=False)
    assert cm.writing_check() == 1
    assert cm.host_size_info.free == 8 and cm.tier_counters.failed_copies == 8
    assert env.host_tokens_of(A) == 0
    env.check(idle=True)
    env.run(B, drain=False)
    assert cm.host_size_info.free == 0 and cm.host_size_info.backing_up == 8
    env.complete_all(ok=True)
    cm.writing_check()
    env.check(idle=True)
    assert env.host_tokens_of(B) == 8
    env.run(C)  # host eviction of B's mirror, C backed up
    assert env.host_tokens_of(C) == 8 and env.host_tokens_of(B) == 0
    assert cm.tier_counters.host_evicted == 8
    env.check(idle=True)


# =====================================================================================
# 2. SGLang #21631 (+ #20611, #19737, #18785, #14363, #13912): a copy racing the
#    reuse of its pages.
# =====================================================================================


def test_21631_device_pages_of_a_backup_in_flight_are_not_evicted():
    """While a node's backup is in flight its device pages are pinned: nothing
    evicts them; an allocation that needs them waits for the copy first, so the
    host copy holds the old K/V, not the new owner's."""
    env = Env(num_pages=8, host_pages=16)
    cm = env.cm
    A = seq(8, 0)
    env.run(A, drain=False)
    assert cm.controller.waiting() and cm.host_size_info.backing_up == 8
    ev, prot = cm._tree.tier_sizes()[:2]
    assert ev == 0 and prot == 8, "a node being backed up must not be evictable"
    assert cm.available_size == 0
    with pytest.raises(radixkv.OutOfCapacityError):
        cm.manager.evict(1)
    env.check()

    # An allocation of the whole device: the backup must complete first.
    B = seq(8, 100)
    r = env.start(B)
    assert cm.controller.waiting() == [] and cm.host_size_info.backing_up == 0
    assert env.host_tokens_of(A) == 8 and env.device_tokens_of(A) == 0
    # B wrote its K/V over A's old device pages: A's host copy must be untouched.
    env.check(held=4)
    r.forward()
    r.finish()
    env.drain()
    env.check(idle=True)
    env.evict_device()
    env.scrub()
    r = env.start(A)
    assert r.host_hit == 7
    r.forward()
    r.finish()
    env.drain()
    env.check(idle=True)


def test_21631_device_pages_of_a_load_are_nobody_elses_until_applied():
    """The pages a load writes are the load's: not handed out by allocate,
    not freeable by cm.free, not evictable, not usable as another request's
    pages; the load lands intact."""
    env = Env(num_pages=16, host_pages=16, page_size=2)
    cm = env.cm
    A = seq(9, 0)
    env.run(A)
    env.evict_device()
    env.scrub()
    env.check(idle=True)

    r = env.start(A)
    assert r.host_hit == 8 and r.device_hit == 0
    load = r.loaded_slots.tolist()
    assert len(load) == 8
    env.check(held=1)

    # allocate never hands out a load's pages, even when it evicts everything.
    other = cm.allocate(cm.available_size)
    assert not set(other.tolist()) & set(load)
    env.store(seq(len(other), 500), other, 0)
    env.check(held=1 + len(other) // 2)

    # cm.free of a load's pages is refused, changing nothing.
    before = env.state()
    with pytest.raises(ValueError):
        cm.free(torch.tensor(load[:2], dtype=torch.int32))
    assert env.state() == before
    with pytest.raises(ValueError):
        cm.free(torch.tensor(load, dtype=torch.int32))
    assert env.state() == before

    # Nothing evictable: the load's pages are not, nor the path above them.
    assert cm.available_size == 0
    with pytest.raises(radixkv.OutOfCapacityError):
        cm.make_room(2)
    assert env.state() == before

    cm.free(other)
    # Another request passing the load's pages as its own is refused.
    q = env.start(seq(3, 900))
    with pytest.raises(ValueError):
        cm.free_and_cache_finished_req(q.handle, q.ids, torch.tensor(load[:4], dtype=torch.int32))
    env.check(held=1 + 2)
    q.finish()

    r.forward()
    assert cm.loading_check() == []
    r.finish()
    env.drain()
    env.check(idle=True)
    assert cm.tier_counters.loaded_back == 8


def test_21631_write_back_reuses_device_pages_only_after_their_backup():
    """write_back: the node evicted to make room is copied to host before its
    pages are given to the request that overwrites them."""
    env = Env(num_pages=8, host_pages=8, page_size=2, policy="write_back")
    cm = env.cm
    A, B = seq(16, 0), seq(16, 100)
    env.run(A)
    assert env.host_tokens_of(A) == 0  # write_back: nothing on host yet
    r = env.start(B)  # evicts A: backs it up first
    assert env.host_tokens_of(A) == 16 and env.device_tokens_of(A) == 0
    assert cm.tier_counters.backed_up == 16
    env.check(held=8)  # the host bytes of A are A's, though B overwrote its old pages
    r.forward()
    r.finish()
    env.drain()
    r = env.start(A)  # loads A back: evicts B, which finds no host room (A is loading)
    assert r.host_hit == 14
    assert env.node_for(B) is None and cm.tier_counters.backups_skipped == 16
    env.check(held=1)
    r.forward()
    r.finish()
    env.drain()
    env.check(idle=True)


def test_21631_second_request_on_a_loading_prefix_waits_and_shares_the_pages():
    """Two requests on the same host-only prefix: the second waits for the
    first one's load and gets the same pages, never a second copy or pages
    still being written."""
    env = Env(num_pages=32, host_pages=32, page_size=2)
    cm = env.cm
    A = seq(12, 0)
    env.run(A)
    env.evict_device()
    env.scrub()
    r1 = env.start(A + [77, 78, 79])
    assert r1.host_hit == 12
    r2 = env.start(A[:8] + [55, 56, 57])  # splits the loading node, then waits for it
    assert r2.handle.cached_len == 8
    assert r2.cached.tolist() == r1.cached[:8].tolist()
    env.check(held=4)
    r2.forward()
    r1.forward()
    assert cm.loading_check() == []
    r1.finish()
    r2.finish()
    env.drain()
    env.check(idle=True)
    assert cm.tier_counters.loaded_back == 12


def test_21631_lock_of_a_match_whose_device_part_was_evicted_since():
    """match_req's indices are the cache's slots; if the match's node is
    evicted from the device before the request locks it (with a host tier it
    stays in the tree, host only), lock must not succeed as if those slots
    were still the request's: they are free and handed to the next request.
    Without a host tier the same lock raises ValueError (stale handle)."""
    env = Env(num_pages=8, host_pages=16, page_size=2)
    cm = env.cm
    A = seq(9, 0)
    env.run(A)
    h, idx = cm.match_req(A)
    assert h.cached_len == 8 and h.host_hit_len == 0
    env.evict_device()  # A is host only now; its device pages are free
    other = cm.allocate(cm.num_pages * 2)  # the next request gets every page
    assert set(idx.tolist()) <= set(other.tolist())
    before = env.state()
    try:
        cm.lock(h)
    except ValueError:
        assert env.state() == before
    else:
        # A lock that succeeds must hold the handle's tokens on the device, at
        # the slots the request was given.
        assert h.lock_count == 1
        assert env.device_tokens_of(A) == 8, (
            "lock() succeeded on a match whose tokens left the device: the request "
            "would read pages now owned by another request"
        )
        assert cm._tree.handle_slots(h).tolist() == idx.tolist()
    cm.free(other)


def test_21631_lock_without_host_tier_refuses_an_evicted_match():
    """The contract the test above holds the tiered manager to."""
    cm = CacheManager(8, page_size=2)
    A = seq(9, 0)
    h, _ = cm.match_req(A)
    cm.lock(h)
    own = cm.allocate(9)
    cm.free_and_cache_finished_req(h, A, own)
    h, idx = cm.match_req(A)
    assert h.cached_len == 8
    cm.make_room(cm.available_size)
    with pytest.raises(ValueError):
        cm.lock(h)
    cm.check_integrity()


# =====================================================================================
# 3. SGLang #30106, #23537 (-> #19212): asynchronous completion breaking the
#    root-closed host set.
# =====================================================================================


def _parent_and_child(env):
    """P (8 tokens) and its child C (8 more), each with a backup queued."""
    P = seq(8, 0)
    C = P + seq(8, 100)
    env.run(P, drain=False)
    (op_p,) = env.cm.controller.waiting()
    env.run(C, drain=False)
    ops = env.cm.controller.waiting()
    assert len(ops) == 2
    (op_c,) = [o for o in ops if o != op_p]
    assert env.cm.host_size_info.backing_up == 16
    env.check()
    return P, C, op_p, op_c


@pytest.mark.parametrize("child_first", [True, False])
@pytest.mark.parametrize("p_ok,c_ok", [(True, True), (False, True), (True, False), (False, False)])
@pytest.mark.parametrize("apply_between", [True, False])
def test_30106_out_of_order_backup_acks_keep_host_copies_root_closed(
    child_first, p_ok, c_ok, apply_between
):
    env = Env(num_pages=16, host_pages=16, page_size=2)
    cm = env.cm
    P, C, op_p, op_c = _parent_and_child(env)
    steps = [(op_c, c_ok), (op_p, p_ok)] if child_first else [(op_p, p_ok), (op_c, c_ok)]
    for op, ok in steps:
        assert cm.controller.complete(op, ok)
        if apply_between:
            assert cm.writing_check() == 1
            env.check()
    cm.writing_check()
    env.check(idle=True)
    p_host = env.node_for(P)[3] != []
    c_host = env.node_for(C)[3] != []
    assert p_host == p_ok
    if not p_ok:
        assert not c_host, "a child got a host copy while its parent has none"
    if c_host:
        assert p_host
    if not c_ok:
        assert not c_host
    if p_ok and c_ok and not child_first:
        assert c_host
    counters = cm.tier_counters
    assert counters.backed_up == 8 * p_host + 8 * c_host
    assert counters.failed_copies == 8 * (not p_ok) + 8 * (not c_ok)
    assert cm.host_size_info.cached == counters.backed_up

    # Device eviction: host copies stay (host only), the rest is deleted, and
    # what matches from host is exactly what has a host copy.
    env.evict_device()
    env.check(idle=True)
    h, _ = cm.match_req(C + [1])
    assert h.cached_len == 0 and h.host_hit_len == 8 * p_host + 8 * c_host

    # A child left without a host copy gets one on its next write-through.
    env.scrub()
    r = env.start(C + [1])
    r.forward()
    r.finish()
    env.drain()
    env.check(idle=True)
    assert env.host_tokens_of(C) == 16


def test_23537_parent_host_copy_survives_host_pressure_while_child_backup_in_flight():
    """The parent's host copy is not a host-eviction victim while a child's
    backup (which starts under it) is in flight."""
    env = Env(num_pages=32, host_pages=12, page_size=2)
    cm = env.cm
    P = seq(8, 0)
    env.run(P)
    C = P + seq(8, 100)
    env.run(C, drain=False)  # C's backup in flight, starting under P's host copy
    (op_c,) = cm.controller.waiting()
    assert cm.host_size_info.free == 24 - 16
    D = seq(12, 300)  # needs 12 host slots: 8 free; P may not go
    env.run(D, drain=False)
    assert env.node_for(P)[3], "P's host copy was evicted under a backup in flight"
    assert cm.tier_counters.backups_skipped == 12
    env.check()
    cm.controller.complete(op_c, True)
    cm.writing_check()
    env.check(idle=True)
    assert env.host_tokens_of(C) == 16


def test_30106_split_of_a_node_being_backed_up_or_loaded():
    """A match that splits a node while its backup (or load) is in flight:
    both halves finish the copy, with the right K/V."""
    env = Env(num_pages=32, host_pages=32, page_size=2)
    cm = env.cm
    A = seq(16, 0)
    env.run(A, drain=False)  # backup of A (16 tokens) in flight
    h, idx = cm.match_req(A[:6] + [999, 998])  # splits A at 6
    assert h.cached_len == 6
    env.check()
    env.complete_all(ok=True)
    cm.writing_check()
    env.check(idle=True)
    assert env.host_tokens_of(A) == 16 and env.host_tokens_of(A[:6]) == 6

    env.evict_device()
    env.scrub()
    r = env.start(A + [5])  # loads A (16 tokens)
    assert r.host_hit == 16
    h, _ = cm.match_req(A[:10] + [999, 998])  # splits the loading node at 10
    assert h.cached_len == 0 and h.host_hit_len == 10
    env.check(held=1)
    r.forward()
    assert cm.loading_check() == []
    env.check(held=1)
    r.finish()
    env.drain()
    env.check(idle=True)
    h, _ = cm.match_req(A[:10] + [999, 998])
    assert h.cached_len == 10 and h.host_hit_len == 0


def test_30106_insert_over_host_only_nodes_keeps_both_sets_root_closed():
    """A request that recomputes a host-only prefix instead of loading it:
    its insert gives the host-only nodes its device slots (they become
    device + host), down to where its tokens end, splitting a host-only node
    there; what lies below stays host only under a device parent."""
    env = Env(num_pages=32, host_pages=32, page_size=2)
    cm = env.cm
    A = seq(16, 0)
    env.run(A)
    env.evict_device()
    env.scrub()
    r = env.start(A[:6] + [3], load=False)  # lock only: recompute A[:6] itself
    assert r.device_hit == 0 and r.host_hit == 6
    r.finish()
    env.drain()
    env.check(idle=True)
    assert env.device_tokens_of(A) == 6 and env.host_tokens_of(A) == 16
    assert cm.tier_counters.loaded_back == 0
    r = env.start(A + [1])  # device part 6, loads the other 10
    assert r.device_hit == 6 and r.host_hit == 10
    r.forward()
    r.finish()
    env.drain()
    env.check(idle=True)
    assert env.device_tokens_of(A) == 16


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_30106_fuzz_interleaved_completions_evictions_and_requests(seed, policy):
    """Random requests with shared prefixes, copies completed (or failed) in
    random order, device and host evictions in between; after every step the
    accounting, both root-closed sets and the bytes of both tiers hold, and
    every cached row a request reads is the one stored for it."""
    rng = random.Random(seed)
    ps = rng.choice([1, 2, 4])
    env = Env(
        num_pages=48 // ps,
        host_pages=32 // ps,
        page_size=ps,
        policy=policy,
        layout=rng.choice(["page_first", "layer_first"]),
    )
    cm = env.cm
    stems = [seq(rng.randint(4, 12), 1000 * k) for k in range(4)]
    active = []
    failed_handles = []

    def take_failed(handles):
        failed_handles.extend(handles)

    def is_failed(r):
        return any(h is r.handle for h in failed_handles)

    def settle(r):
        for layer in range(LAYERS):
            env.pool.k_cache(layer)
        take_failed(cm.loading_check())
        return not is_failed(r)

    for step in range(120):
        op = rng.random()
        waiting = cm.controller.waiting()
        if op < 0.35 and len(active) < 4:
            ids = rng.choice(stems) + [rng.randint(1, 5) for _ in range(rng.randint(1, 8))]
            try:
                active.append(env.start(ids))
            except radixkv.OutOfCapacityError:
                pass
        elif op < 0.47 and active:
            r = active.pop(rng.randrange(len(active)))
            if settle(r):
                r.forward()
                r.finish()
            else:
                r.abort()
        elif op < 0.51 and active:
            # Chunked prefill: cache what the request computed, go on with it.
            r = active[rng.randrange(len(active))]
            if settle(r):
                r.forward()
                h, idx = cm.cache_unfinished_req(r.handle, r.ids, torch.cat([r.cached, r.own]))
                assert h.lock_count == 1 and len(idx) == len(r.cached) + len(r.own)
                r.handle, r.cached, r.own = h, idx[: h.cached_len], idx[h.cached_len :]
                r.device_hit = h.cached_len
                r.forward()
            else:
                active.remove(r)
                r.abort()
        elif op < 0.55 and active:
            # The request goes away before its load (if any) lands.
            active.pop(rng.randrange(len(active))).abort()
        elif op < 0.75 and waiting:
            cm.controller.complete(rng.choice(waiting), rng.random() < 0.75)
        elif op < 0.82:
            cm.writing_check()
        elif op < 0.88:
            take_failed(cm.loading_check())
        elif op < 0.94:
            try:
                cm.make_room(cm.free_pages * ps + rng.randint(1, 12))
            except radixkv.OutOfCapacityError:
                pass
        else:
            take_failed(env.drain())
        env.check(held=None)
    for r in active:
        if settle(r):
            r.forward()
            r.finish()
        else:
            r.abort()
    take_failed(env.drain())
    env.check(idle=True)


# =====================================================================================
# 4. SGLang #27108, #24585, #28468: write_back with a nearly full host pool.
# =====================================================================================


def test_27108_write_back_without_host_room_deletes_instead_of_backing_up():
    env = Env(num_pages=9, host_pages=4, page_size=2, policy="write_back")
    cm = env.cm
    A, B, C = seq(8, 0), seq(8, 100), seq(8, 200)
    env.run(A)
    env.run(B)
    assert cm.host_size_info.cached == 0
    env.run(C)  # evicts A (LRU): backed up first
    assert env.node_for(A)[3] and not env.node_for(A)[2]
    assert cm.tier_counters.backed_up == 8
    env.check(idle=True)

    r = env.start(A + [1])  # loads A: its host copy is busy, the host pool is full
    assert r.host_hit == 8
    # Loading A needed 8 device slots: B (LRU) was evicted, but the host had
    # no room (A's pages are loading, not evictable): B must be deleted.
    assert env.node_for(B) is None
    assert cm.tier_counters.backups_skipped == 8
    assert cm.tier_counters.backed_up == 8
    h, _ = cm.match_req(B + [1])
    assert h.cached_len == 0 and h.host_hit_len == 0
    env.check(held=1)
    r.forward()
    r.finish()
    env.drain()
    env.check(idle=True)


def test_28468_write_back_sweep_keeps_in_flight_copies_and_their_parents():
    """One eviction sweep backs up several leaves; host eviction for a later
    one must not free an earlier one's copy or the host copy it starts under."""
    env = Env(num_pages=32, host_pages=6, page_size=2, policy="write_back")
    cm = env.cm
    P = seq(8, 0)
    C1, C2 = P + seq(4, 100), P + seq(4, 200)
    env.run(P)
    env.evict_device()  # P backed up, host only
    env.check(idle=True)
    assert cm.host_size_info.cached == 8
    env.run(C1)  # loads P (now on device and host), C1 device only
    env.run(C2)
    assert cm.host_size_info.free == 4
    env.check(idle=True)
    # Evict both leaves in one sweep: room for one (P's copy cannot go while
    # the first leaf's copy hangs under it).
    env.evict_device()
    env.check(idle=True)
    n1, n2 = env.host_tokens_of(C1), env.host_tokens_of(C2)
    assert sorted([n1, n2]) == [8, 12], (n1, n2)
    assert env.node_for(P)[3], "P's host copy was evicted under its child's backup"
    assert cm.tier_counters.backups_skipped == 4
    assert cm.host_size_info.free == 0


def test_28468_write_back_host_eviction_of_the_parent_mirror_skips_the_child():
    """Host room for a leaf found by evicting its parent's own host mirror:
    the leaf's backup cannot start there; it is deleted, nothing leaks."""
    env = Env(num_pages=32, host_pages=4, page_size=2, policy="write_back")
    cm = env.cm
    P = seq(8, 0)
    C = P + seq(4, 100)
    env.run(P)
    env.evict_device()
    env.run(C)  # P loaded back (on device with its host mirror), C device only
    assert env.node_for(P)[2] and env.node_for(P)[3]
    env.check(idle=True)
    env.evict_device()
    env.check(idle=True)
    assert env.node_for(C) is None or env.node_for(C)[3]
    assert cm.host_size_info.free + cm.host_size_info.cached == 8
    counters = cm.tier_counters
    assert counters.backed_up - counters.host_evicted == cm.host_size_info.cached


@pytest.mark.parametrize("seed", range(4))
def test_27108_write_back_churn_accounting_exact(seed):
    """Many evictions under write_back with a host pool a third of the device:
    after every request the pools add up and every host copy is right."""
    rng = random.Random(seed)
    env = Env(num_pages=24, host_pages=8, page_size=2, policy="write_back")
    cm = env.cm
    stems = [seq(rng.randint(2, 10), 1000 * k) for k in range(5)]
    for _ in range(40):
        ids = rng.choice(stems) + [rng.randint(1, 4) for _ in range(rng.randint(1, 10))]
        env.run(ids)
        env.check(idle=True)
        c = cm.tier_counters
        assert c.backed_up - c.host_evicted == cm.host_size_info.cached
    assert cm.tier_counters.backed_up > 0


# =====================================================================================
# 5. SGLang #33862 (#12875): write_through with a host pool smaller than the
#    device pool; host mirrors of device nodes must be reclaimable.
# =====================================================================================


def test_33862_small_host_pool_keeps_backing_up_under_write_through():
    env = Env(num_pages=32, host_pages=6, page_size=2)
    cm = env.cm
    reqs = [seq(8, 100 * k) for k in range(8)]  # 64 tokens: all stay on the device
    for ids in reqs:
        env.run(ids)
        env.check(idle=True)
    c = cm.tier_counters
    assert c.backups_skipped == 0, "host mirrors of device nodes were not reclaimed"
    assert c.backed_up == 64
    assert c.host_evicted == 64 - cm.host_size_info.cached
    assert cm.host_size_info.cached == 8  # room for one 8-token request of 12 slots
    assert env.host_tokens_of(reqs[-1]) == 8  # the newest has the mirror

    # Hits keep working: the newest survives device eviction as host only.
    env.evict_device()
    env.scrub()
    r = env.start(reqs[-1] + [1])
    assert r.host_hit == 8
    r.forward()
    r.finish()
    env.drain()
    env.check(idle=True)


def test_33862_mirrors_of_locked_running_requests_are_reclaimable():
    env = Env(num_pages=64, host_pages=4, page_size=2)
    cm = env.cm
    running = []
    for k in range(6):
        r = env.start(seq(8, 100 * k))
        r.forward()
        h, idx = cm.cache_unfinished_req(r.handle, r.ids, torch.cat([r.cached, r.own]))
        r.handle, r.cached, r.own = h, idx[: h.cached_len], idx[h.cached_len :]
        env.drain()
        running.append(r)
        env.check()
    assert cm.tier_counters.backups_skipped == 0
    assert cm.tier_counters.backed_up == 48
    for r in running:
        r.finish()
    env.drain()
    env.check(idle=True)


def test_33862_shared_prefix_with_many_children_and_a_small_host():
    env = Env(num_pages=64, host_pages=8, page_size=2)
    cm = env.cm
    S = seq(8, 0)
    for k in range(10):
        env.run(S + seq(4, 100 * (k + 1)))
        env.check(idle=True)
        assert env.host_tokens_of(S) == 8  # the shared prefix stays mirrored
    assert cm.tier_counters.backups_skipped == 0
    env.evict_device()
    env.scrub()
    r = env.start(S + seq(4, 1000) + [3])
    assert r.host_hit == 12
    r.forward()
    r.finish()
    env.drain()
    env.check(idle=True)


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_33862_host_pool_smaller_than_one_request_skips_and_keeps_serving(policy):
    """A host pool too small for any request's path: every backup is skipped
    (counted), the device cache keeps serving hits, nothing leaks."""
    env = Env(num_pages=4, host_pages=1, page_size=4, policy=policy)
    cm = env.cm
    A, B = seq(9, 0), seq(9, 100)
    for ids in (A, A, A, B, B, B):  # B evicts A
        r = env.run(ids)
        env.check(idle=True)
    assert r.device_hit == 8
    c = cm.tier_counters
    assert c.backed_up == 0 and cm.host_size_info.cached == 0
    assert c.backups_skipped > 0
    assert cm.host_size_info.free == 4


# =====================================================================================
# 6. SGLang #21624 (-> #19332), #4987, bytedance-iaas/sglang#744: slot leaks on
#    error paths.
# =====================================================================================


def test_21624_failed_backups_and_loads_leak_nothing():
    env = Env(num_pages=16, host_pages=16, page_size=2)
    cm = env.cm
    reqs = [seq(9, 100 * k) for k in range(3)]
    for ids in reqs:
        env.run(ids, drain=False)
    env.complete_all(ok=False)
    assert cm.writing_check() == 3
    env.check(idle=True)
    info = cm.host_size_info
    assert info.free == info.capacity and info.cached == 0
    assert cm.tier_counters.failed_copies == 24 and cm.tier_counters.backed_up == 0

    for ids in reqs:  # the next write-through backs them up
        env.run(ids)
    assert cm.host_size_info.cached == 24
    env.evict_device()
    env.scrub()
    env.check(idle=True)

    # Failed loads: the handle comes back, its pages are freed, the host copy stays.
    for ids in reqs:
        r = env.start(ids)
        assert r.host_hit == 8
        (op,) = cm.controller.waiting()
        assert cm.controller.complete(op, False)
        failed = cm.loading_check()
        assert len(failed) == 1 and failed[0] is r.handle
        r.abort()
        env.check(idle=True)
        h, _ = cm.match_req(ids)
        assert h.cached_len == 0 and h.host_hit_len == 8
    assert cm.tier_counters.loaded_back == 0
    assert cm.tier_counters.failed_copies == 24 + 24
    # And a retry loads the right K/V.
    for ids in reqs:
        r = env.start(ids)
        r.forward()
        assert cm.loading_check() == []
        r.finish()
        env.drain()
    env.check(idle=True)


def test_4987_out_of_capacity_in_load_back_changes_nothing():
    env = Env(num_pages=8, host_pages=16, page_size=2)
    cm = env.cm
    A = seq(9, 0)
    env.run(A)
    env.evict_device()
    env.check(idle=True)
    blockers = [env.start(seq(4, 100 * (k + 1))) for k in range(3)]  # 6 of 8 pages locked
    h, _ = cm.match_req(A)
    assert h.host_hit_len == 8
    before = env.state()
    with pytest.raises(radixkv.OutOfCapacityError):
        cm.load_back(h)
    assert env.state() == before
    env.check(held=6)
    for b in blockers:
        b.finish()
    env.drain()
    r = env.start(A)
    assert r.host_hit == 8
    r.forward()
    r.finish()
    env.drain()
    env.check(idle=True)


def test_4987_load_back_waits_for_backups_that_pin_the_room_it_needs():
    """When the only evictable room is pinned by backups in flight, allocate
    lets the copies finish and evicts; load_back must do the same, not raise
    OutOfCapacityError (a spurious failure: the request would be computed
    again, the hit lost)."""
    for use_load_back in (False, True):
        env = Env(num_pages=8, host_pages=32, page_size=2)
        cm = env.cm
        A = seq(9, 0)
        env.run(A)
        env.evict_device()
        for k in range(4):  # fill the device; their backups stay in flight
            env.run(seq(4, 100 * (k + 1)), drain=False)
        assert cm.free_pages == 0 and cm.host_size_info.backing_up == 16
        assert cm.available_size == 0
        env.check()
        if not use_load_back:
            own = cm.allocate(8)  # waits for the backups, then evicts
            assert len(own) == 8
            cm.free(own)
        else:
            r = env.start(A)  # load_back of 8 tokens: same room
            assert r.host_hit == 8
            r.forward()
            r.finish()
        env.drain()
        env.check(idle=True)


def test_4987_load_back_of_a_device_match_evicted_since_leaks_no_lock():
    """load_back of a match with no host part (host_hit_len == 0) whose device
    part went to host since: it must either load it back or raise leaving
    nothing locked (a lock left on a host-only node pins its host pages
    forever: no host eviction can take them)."""
    env = Env(num_pages=8, host_pages=8, page_size=2)
    cm = env.cm
    A = seq(9, 0)
    env.run(A)
    h, idx = cm.match_req(A)
    assert h.cached_len == 8 and h.host_hit_len == 0
    env.evict_device()
    env.scrub()
    env.check(idle=True)
    before = env.state()
    try:
        h2, idx2 = cm.load_back(h)
    except (ValueError, radixkv.OutOfCapacityError):
        assert h.lock_count == 0, "load_back raised but left the handle locked"
        assert env.state() == before
        env.check(idle=True)
    else:
        assert h2.cached_len == 8 and len(idx2) == 8
        env.assert_rows(env.forward_rows, idx2, A, 0, "load_back of an evicted device match")
        assert cm.loading_check() == []
        own = cm.allocate(1)
        env.store(A, own[:1], 8)
        cm.free_and_cache_finished_req(h2, A, torch.cat([idx2, own]))
        env.drain()
        env.check(idle=True)
    # Either way the host pool stays reclaimable.
    env.run(seq(9, 100))
    assert env.host_tokens_of(seq(9, 100)) == 8, "A's host copy could not be evicted"
    env.check(idle=True)


def test_4987_out_of_capacity_after_waiting_for_another_load_changes_nothing():
    """load_back that waits for another request's load of the same prefix and
    then finds no room for the rest raises with nothing leaked."""
    env = Env(num_pages=12, host_pages=32, page_size=2)
    cm = env.cm
    A = seq(17, 0)
    env.run(A)
    env.evict_device()
    env.check(idle=True)
    r1 = env.start(A[:9])  # loads A[:8]
    h2, _ = cm.match_req(A)  # host part 16, of which 8 loading
    blockers = []
    while cm.available_size:
        blockers.append(env.start(seq(2, 500 + 10 * len(blockers))))
    with pytest.raises(radixkv.OutOfCapacityError):
        cm.load_back(h2)  # waits for r1's load, then finds no room for A[8:16]
    assert h2.lock_count == 0
    assert cm.host_size_info.loading == 0 and cm.controller.waiting() == []
    env.check(held=sum(len(b.own) // 2 for b in blockers) + 1)
    for b in blockers:
        b.finish()
    r1.forward()
    r1.finish()
    failed = env.drain()
    assert failed == []
    env.check(idle=True)


def test_4987_bad_inputs_on_the_tier_paths_change_nothing():
    env = Env(num_pages=16, host_pages=4, page_size=2)
    other = Env(num_pages=16, host_pages=4, page_size=2)
    cm = env.cm
    A, B = seq(9, 0), seq(9, 100)
    env.run(A)
    other.run(A)
    env.evict_device()
    other.evict_device()
    h_other, _ = other.cm.match_req(A)
    before = env.state()
    with pytest.raises(ValueError):
        cm.load_back(h_other)
    assert env.state() == before
    assert cm.controller.complete(12345, True) is False
    assert env.state() == before

    # A handle whose host part was evicted since (B's backup took the host
    # pool): load_back gives the device part only (here none), locked.
    h, _ = cm.match_req(A)
    assert h.host_hit_len == 8
    env.run(B)
    assert env.node_for(A) is None and cm.tier_counters.host_evicted == 8
    before = env.state()
    h2, idx = cm.load_back(h)
    assert h2.cached_len == h.cached_len == len(idx) and h2.lock_count == 1
    cm.unlock(h2)
    assert env.state() == before
    env.check(idle=True)

    # Wrong indices while a load is in flight: refused, then the request finishes.
    env.evict_device()
    r = env.start(B)
    assert r.host_hit == 8
    with pytest.raises(ValueError):
        cm.free_and_cache_finished_req(r.handle, r.ids, r.cached)  # too short
    with pytest.raises(ValueError):
        cm.free_and_cache_finished_req(r.handle, r.ids, torch.cat([r.own, r.cached]))
    env.check(held=1)
    r.forward()
    r.finish()
    env.drain()
    env.check(idle=True)


# =====================================================================================
# 7. SGLang #38452 (#33713, #12092, #9292): a hit counted but its tier never read.
# =====================================================================================


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_38452_host_hit_returns_the_stored_kv(layout, page_size):
    env = Env(
        num_pages=64 // page_size, host_pages=64 // page_size, page_size=page_size, layout=layout
    )
    cm = env.cm
    S = seq(12, 0)
    T = S + seq(13, 100)  # 25 tokens: a partial last page for page_size 4
    env.run(T)
    env.check(idle=True)
    # Evict only T's leaf: S stays on the device (locked by a running request).
    hold = env.start(S + [7])
    env.evict_device()
    env.scrub()
    env.check(held=len(hold.own) // page_size)
    r = env.start(T)
    whole = (len(T) - 1) // page_size * page_size
    assert r.device_hit == 12 and r.host_hit == whole - 12
    assert r.cached[:12].tolist() == hold.cached[:12].tolist()
    loaded_before = cm.tier_counters.loaded_back
    r.forward()  # reads through k_cache/v_cache: the loaded rows are the stored ones
    assert cm.loading_check() == []
    assert cm.tier_counters.loaded_back - loaded_before == whole - 12
    r.finish()
    hold.finish()
    env.drain()
    env.check(idle=True)
    h, idx = cm.match_req(T)
    assert h.cached_len == whole and h.host_hit_len == 0


@pytest.mark.parametrize(
    "dtype,heads,dim",
    [
        (torch.float16, 1, 3),
        (torch.bfloat16, 3, 8),
        (torch.float32, 1, 1),
        (getattr(torch, "float8_e4m3fn", torch.float16), 2, 5),
    ],
)
@pytest.mark.parametrize("kv_layout", [KVCacheLayout.LayerFirst, KVCacheLayout.PageFirst])
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_38452_round_trip_is_bit_exact_for_every_row_shape(dtype, heads, dim, kv_layout, layout):
    """Odd row sizes (3 to 48 bytes), every dtype, both device and host layouts:
    device -> host -> device gives back the stored bytes, and nothing around
    them is touched."""
    env = Env(
        num_pages=12,
        host_pages=12,
        page_size=4,
        layout=layout,
        heads=heads,
        dim=dim,
        dtype=dtype,
        kv_layout=kv_layout,
    )
    cm = env.cm
    A, B = seq(14, 0), seq(10, 100)
    env.run(A)
    env.run(B)
    env.check(idle=True)
    env.evict_device()
    env.scrub()
    r = env.start(B)  # B first: its pages sit between garbage pages
    assert r.host_hit == 8
    r.forward()
    q = env.start(A)
    assert q.host_hit == 12
    q.forward()
    assert cm.loading_check() == []
    r.finish()
    q.finish()
    env.drain()
    env.check(idle=True)


def test_38452_failed_load_is_reported_not_counted_and_not_usable():
    env = Env(num_pages=16, host_pages=16, page_size=2)
    cm = env.cm
    A = seq(11, 0)
    env.run(A)
    env.evict_device()
    env.scrub()
    r = env.start(A)
    assert r.host_hit == 10
    (op,) = cm.controller.waiting()
    assert cm.controller.complete(op, False)
    failed = cm.loading_check()
    assert len(failed) == 1 and failed[0] is r.handle
    c = cm.tier_counters
    assert c.loaded_back == 0 and c.failed_copies == 10
    # The failed handle cannot be finished as if its K/V were there.
    with pytest.raises(ValueError):
        r.finish()
    r.abort()
    env.check(idle=True)
    h, _ = cm.match_req(A)
    assert h.cached_len == 0 and h.host_hit_len == 10


def test_38452_failed_load_is_reported_even_when_another_call_applied_it():
    """A load that fails while another request's call waits for loads (its
    finish, or its load_back of the same prefix) must still be reported to the
    scheduler by loading_check(), never silently swallowed."""
    env = Env(num_pages=32, host_pages=32, page_size=2)
    cm = env.cm
    A, B = seq(11, 0), seq(9, 100)
    env.run(A)
    env.run(B)
    env.evict_device()
    env.scrub()
    q = env.start(seq(5, 900))  # an unrelated request in flight

    r = env.start(A)
    (op,) = cm.controller.waiting()
    assert cm.controller.complete(op, False)
    q.forward()
    q.finish()  # settles the loads in flight: applies r's failure
    failed = cm.loading_check()
    assert [h is r.handle for h in failed] == [
        True
    ], "the failed load's handle was swallowed by another request's call"
    r.abort()
    assert env.drain() == []
    env.check(idle=True)

    r = env.start(B)
    (op,) = cm.controller.waiting()
    assert cm.controller.complete(op, False)
    r2 = env.start(B)  # load_back of the same prefix waits for r's (failed) load
    failed = cm.loading_check()
    assert any(
        h is r.handle for h in failed
    ), "the failed load's handle was swallowed by another request's load_back"
    r.abort()
    r2.forward()
    assert cm.loading_check() == []
    r2.finish()
    env.drain()
    env.check(idle=True)


def test_38452_device_part_evicted_between_match_and_load_back():
    """The match's device part is unlocked until load_back: if it was evicted
    to host meanwhile, load_back must still return indices that hold the
    match's K/V (or refuse), never a mix of stale slots."""
    env = Env(num_pages=32, host_pages=32, page_size=2)
    cm = env.cm
    S = seq(8, 0)
    T = S + seq(8, 100)
    env.run(T)
    hold = env.start(S + [1])  # keep S on the device, evict T's leaf
    env.evict_device()
    h, _ = cm.match_req(T + [2])
    assert h.cached_len == 8 and h.host_hit_len == 8
    hold.finish()
    env.evict_device()  # S goes to host too: h's device part is now host only
    env.scrub()
    env.check(idle=True)
    try:
        h2, idx = cm.load_back(h)
    except ValueError:
        env.check(idle=True)
        return
    assert len(idx) == h2.cached_len == 16
    ids = T + [2]
    env.assert_rows(env.forward_rows, idx, ids, 0, "load_back after the device part left")
    assert cm.loading_check() == []
    own = cm.allocate(1)
    env.store(ids, own[:1], 16)
    cm.free_and_cache_finished_req(h2, ids, torch.cat([idx, own]))
    env.drain()
    env.check(idle=True)


# =====================================================================================
# End to end: the real controller thread, a real pool, many requests.
# =====================================================================================


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_end_to_end_controller_thread_every_loaded_row_is_the_stored_one(policy, layout):
    """Up to three requests in flight over the real controller thread: loads
    run while other requests are admitted, backups while pages are reused;
    every cached row a request reads (device hit or loaded back) is the one
    stored for its prefix, and the pools add up at the end."""
    run_end_to_end(policy, layout, seed=len(policy) * 31 + len(layout))


def run_end_to_end(policy, layout, seed, steps=250):
    rng = random.Random(seed)
    ps = 2
    env = Env(num_pages=40, host_pages=48, page_size=ps, policy=policy, layout=layout, manual=False)
    cm = env.cm
    stems = [seq(rng.randint(6, 20), 1000 * k) for k in range(6)]
    active = []
    loaded_tokens = 0
    host_hits = 0
    for step in range(steps):
        if len(active) < 3 and rng.random() < 0.6:
            ids = rng.choice(stems) + [rng.randint(1, 3) for _ in range(rng.randint(1, 10))]
            try:
                r = env.start(ids)
            except radixkv.OutOfCapacityError:
                r = None
            if r is not None:
                active.append(r)
                host_hits += r.host_hit
                loaded_tokens += len(r.loaded_slots) if r.host_hit else 0
        elif active and rng.random() < 0.1:
            active.pop(rng.randrange(len(active))).abort()  # before its load lands
        elif active:
            r = active.pop(rng.randrange(len(active)))
            r.forward()  # waits per layer for the loads, then checks every cached row
            failed = cm.loading_check()
            assert failed == [], "a load failed on the CPU controller"
            r.finish()
        cm.writing_check()
        env.failed += cm.loading_check()
        if step % 10 == 0:
            env.check(content=False)
    for r in active:
        r.forward()
        r.finish()
    assert env.drain() == [] and env.failed == []
    env.check(idle=True)
    c = cm.tier_counters
    assert c.backed_up > 0
    assert host_hits > 0 and c.loaded_back > 0, "no request was served from the host tier"
    assert c.failed_copies == 0


FORKED = """
import os, sys, torch
from radixkv.kvcache import MHAKVCache
from radixkv.scheduler import CacheManager

pool = MHAKVCache(num_kv_heads=1, num_layers=2, head_dim=4, num_pages=16,
                  dtype=torch.float32, page_size=4)
cm = CacheManager(num_pages=16, page_size=4, kv_cache=pool, host_num_pages=32)

def serve(base):
    ids = torch.arange(base, base + 14)
    h, cached = cm.match_req(ids)
    cm.lock(h)
    cm.free_and_cache_finished_req(h, ids, torch.cat([cached, cm.allocate(14 - h.cached_len)]))

serve(0)
cm.drain()
serve(100)  # its backup queued, or under way, on the copy thread at the fork
child = os.fork()
if child == 0:
    if sys.argv[1] == "use":
        serve(200)
        cm.drain()
        # 12 tokens a request; a backup under way at the fork failed here
        # (the copy thread may or may not have been copying it).
        failed = cm.tier_counters.failed_copies
        assert failed in (0, 12), failed
        assert cm.metrics.host_cached_tokens == 36 - failed, (cm.metrics, failed)
        cm.check_integrity()
    sys.exit(0)  # the manager goes at the interpreter's exit
_, status = os.waitpid(child, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
serve(300)
cm.drain()
assert cm.metrics.host_cached_tokens == 36, cm.metrics
cm.check_integrity()
"""


@pytest.mark.parametrize("child", ["use", "exit"])
def test_a_forked_child_backs_up_and_exits_with_the_copy_thread_left_behind(child):
    """The copy controller's thread stays in the parent at a fork(): a child
    that serves starts a copy thread of its own (a copy under way at the fork
    fails there), and one that only exits does not wait for the parent's
    (before, both hung). The parent's copies go on untouched."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, "-c", FORKED, child], check=True, env=env, timeout=120)
