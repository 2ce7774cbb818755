"""The host tier's native boundary under attack: one test per defect a review
reproduced (layouts that overflow, storage resized under the controller, slot
values and copy ranges forged into finish_backup / finish_load, a pool hook
that outlived its manager, and smaller ones). The crashing cases run in a
fresh interpreter, so a defect that comes back fails the test instead of
ending the run."""

import gc
import subprocess
import sys
import weakref

import pytest
import torch

from radixkv import _core
from radixkv.kvcache import MHAKVCache
from radixkv.scheduler import CacheManager


def _in_subprocess(code: str, timeout: float = 120) -> str:
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_layouts_whose_extent_overflows_int64_are_refused():
    out = _in_subprocess("""
import torch
from radixkv import _core
dev = torch.zeros(64, dtype=torch.uint8); host = torch.zeros(64, dtype=torch.uint8)
ok = [0, 0, 8, 8, 1, 8]
bad = [[0, 0, 8, 8, 1, 2**61], [2**63 - 1, 0, 8, 8, 1, 8], [0, 2**62, 8, 8, 1, 8],
       [0, 0, 2**62, 8, 1, 8], [0, 0, 8, 2**62, 2, 8]]
refused = 0
for layout in bad:
    for make in (lambda: _core.CacheController(dev, layout, host, ok, 8, 2),
                 lambda: _core.CacheController(dev, ok, host, layout, 8, 2),
                 lambda: _core.transfer_rows(dev, layout, host, ok, 8, 2, [0], [0])):
        try:
            make()
        except ValueError as e:
            assert "layout" in str(e), e
            refused += 1
for row_bytes in (2**63 - 1, 2**62):
    try:
        _core.CacheController(dev, ok, host, ok, row_bytes, 1)
    except ValueError:
        refused += 1
print(refused)
""")
    assert int(out) == 5 * 3 + 2


def test_a_pool_resized_under_the_controller_is_refused_not_written():
    out = _in_subprocess("""
import torch
from radixkv import _core
N = 1 << 20
lay = [0, 0, 1024, 1024, 1, 1024]
for resize in ("storage", "tensor"):
    dev = torch.ones(N, dtype=torch.uint8); host = torch.zeros(N, dtype=torch.uint8)
    c = _core.CacheController(dev, lay, host, lay, 1024, 1)
    c.backup(list(range(8)), list(range(8))); c.drain()
    if resize == "storage":
        host.untyped_storage().resize_(0)
    else:
        host.resize_(N * 64)
    for call in (lambda: c.backup([0], [0]), lambda: c.load([0], [0])):
        try:
            call()
        except (ValueError, TypeError) as e:
            assert "host" in str(e), e
        else:
            raise SystemExit(f"{resize}: a copy was queued after the resize")
    # Waiting queues nothing: a shutdown still drains.
    c.drain(); c.wait_layer(0)
print("ok")
""")
    assert out.strip() == "ok"


def _backed_up_tree():
    """Tokens 0..9 and a branch 0..5 + [99, 98], both backed up, then evicted
    to host only, and a load of the first begun."""
    t = _core.RadixTree(1, max_slots=1000)
    t.insert_prefix(list(range(10)), list(range(100, 110)))
    t.insert_prefix(list(range(6)) + [99, 98], list(range(100, 106)) + [200, 201])
    c = t.find_backup(list(range(10)))
    t.begin_backup(c)
    t.finish_backup(c, list(range(10)))
    c = t.find_backup(list(range(6)) + [99, 98])
    t.begin_backup(c)
    t.finish_backup(c, [10, 11])
    t.evict(12)
    h, _ = t.match_prefix(list(range(10)) + [5])
    c = t.find_load(h)
    t.begin_load(c)
    return t, c


def test_finish_load_refuses_forged_ranges_and_bad_slots_changing_nothing():
    t, c = _backed_up_tree()
    before = t.dump(tiers=True)
    n = c[3] - c[2]
    for forged in [(c[0], c[1], 3, c[3]), (c[0], c[1], 6, c[3])]:
        with pytest.raises(ValueError, match="not a load in flight"):
            t.finish_load(forged, list(range(300, 300 + forged[3] - forged[2])))
    for slots, what in [
        ([1000] + list(range(301, 300 + n)), "max_slots"),
        ([-1] + list(range(301, 300 + n)), "max_slots"),
        ([300] * n, "repeats"),
    ]:
        with pytest.raises(ValueError, match=what):
            t.finish_load(c, slots)
    assert t.dump(tiers=True) == before
    t.check_integrity()
    assert t.finish_load(c, list(range(300, 300 + n)))
    t.check_integrity()
    with pytest.raises(ValueError, match="not a load in flight"):  # finished twice
        t.finish_load(c, list(range(400, 400 + n)))
    t.check_integrity()


def test_finish_backup_refuses_forged_ranges_and_bad_slots_changing_nothing():
    t = _core.RadixTree(1)
    t.insert_prefix(list(range(10)), list(range(100, 110)))
    t.insert_prefix(list(range(6)) + [99, 98], list(range(100, 106)) + [200, 201])
    c = t.find_backup(list(range(10)))
    assert (c[2], c[3]) == (0, 10)
    t.begin_backup(c)
    before = t.dump(tiers=True)
    for forged in [(c[0], c[1], 3, c[3]), (c[0], c[1], 6, c[3])]:
        with pytest.raises(ValueError, match="not a backup in flight"):
            t.finish_backup(forged, list(range(forged[3] - forged[2])))
    with pytest.raises(ValueError, match="negative"):
        t.finish_backup(c, [-7] + list(range(1, 10)))
    with pytest.raises(ValueError, match="repeats"):
        t.finish_backup(c, [3] * 10)
    assert t.dump(tiers=True) == before
    t.check_integrity()
    assert len(t.finish_backup(c, list(range(10)))) == 0
    with pytest.raises(ValueError, match="not a backup in flight"):
        t.finish_backup(c, list(range(20, 30)))
    t.check_integrity()
    assert t.tier_sizes()[2] == 10


def test_tier_calls_refuse_broken_pages_changing_nothing():
    """At page_size 4 the tree keeps a slot per page, so the host or device
    slots a backup, a load or pages from storage bring must be whole pages of
    consecutive slots; a broken page is refused, naming the slot, with the
    tree unchanged. A failed backup (ok=False) takes nothing and checks nothing:
    its slots all come back."""
    t = _core.RadixTree(4, max_slots=1000)
    t.insert_prefix(list(range(8)), list(range(100, 108)))
    c = t.find_backup(list(range(8)))
    t.begin_backup(c)
    before = t.dump(tiers=True)
    broken = [20, 21, 22, 23, 40, 41, 43, 42]
    with pytest.raises(
        ValueError, match=r"host_slots\[6\] = 43 breaks the page at host_slots\[4\]"
    ):
        t.finish_backup(c, broken)
    assert t.dump(tiers=True) == before
    t.check_integrity()
    with pytest.raises(ValueError, match="breaks the page"):  # failed or not
        t.finish_backup(c, broken, ok=False)
    assert t.dump(tiers=True) == before
    assert len(t.finish_backup(c, [20, 21, 22, 23, 40, 41, 42, 43], ok=False)) == 8
    assert t.tier_sizes()[2] == 0  # no host copy
    t.check_integrity()

    c = t.find_backup(list(range(8)))
    t.begin_backup(c)
    assert len(t.finish_backup(c, [41, 42, 43, 44, 20, 21, 22, 23])) == 0  # unaligned is fine
    assert t.evict(8).tolist() == list(range(100, 108))  # now host-only
    handle = t.match_prefix(list(range(8)))[0]
    load = t.find_load(handle)
    t.begin_load(load)
    before = t.dump(tiers=True)
    with pytest.raises(ValueError, match=r"device_slots\[1\] = 9 breaks the page"):
        t.finish_load(load, [7, 9, 10, 11, 500, 501, 502, 503])
    assert t.dump(tiers=True) == before
    assert t.finish_load(load, [8, 9, 10, 11, 500, 501, 502, 503])
    t.check_integrity()

    # Pages read from storage join under a host copy.
    before = t.dump(tiers=True)
    with pytest.raises(ValueError, match=r"host_slots\[3\] = 64 breaks the page"):
        t.insert_host(list(range(16)), 8, [60, 61, 62, 64, 70, 71, 72, 73])
    assert t.dump(tiers=True) == before
    t.check_integrity()
    assert len(t.insert_host(list(range(16)), 8, [60, 61, 62, 63, 70, 71, 72, 73])) == 0
    t.check_integrity()


def test_start_backup_finds_takes_pages_and_begins_in_one_call():
    """start_backup is find_backup, the host pages and begin_backup at once;
    with too few free pages it begins nothing and takes nothing; a finish
    given the pages frees there what the tree did not take."""
    t = _core.RadixTree(4, max_slots=1000)
    pages = _core.PageAllocator(3, 4)
    assert t.start_backup(list(range(8)), pages) is None  # nothing cached
    t.insert_prefix(list(range(8)), list(range(100, 108)))
    t.insert_prefix(list(range(16)), list(range(100, 116)))
    before = t.dump(tiers=True)
    copy, dev, host = t.start_backup(list(range(16)), pages)
    assert (copy.start, copy.end) == (0, 16) and dev is None and host is None
    assert pages.num_free_pages == 3 and t.dump(tiers=True) == before
    t.check_integrity()

    copy, dev, host = t.start_backup(list(range(8)), pages)
    assert (copy.start, copy.end) == (0, 8)
    assert dev.tolist() == list(range(100, 108)) and len(host) == 8
    assert pages.num_free_pages == 1 and t.tier_sizes().backing_up == 8
    with pytest.raises(ValueError, match="in flight"):  # a second start of the same range
        t.begin_backup(copy)
    # A failed copy: all its host pages come back to the allocator.
    assert len(t.finish_backup(copy, host, False, pages)) == 8
    assert pages.num_free_pages == 3 and t.tier_sizes().host == 0
    copy, dev, host = t.start_backup(list(range(8)), pages)
    assert len(t.finish_backup(copy, host, True, pages)) == 0
    assert pages.num_free_pages == 1 and t.tier_sizes().host == 8
    pages.check_disjoint(t, True)
    t.check_integrity()

    with pytest.raises(TypeError, match="host_pages must be a radixkv._core.PageAllocator"):
        t.start_backup(list(range(16)), None)
    with pytest.raises(TypeError, match="host_pages must be a radixkv._core.PageAllocator"):
        t.start_backup(list(range(16)), [1, 2])
    with pytest.raises(ValueError, match="host_pages has page_size 2"):
        t.start_backup(list(range(16)), _core.PageAllocator(8, 2))
    with pytest.raises(TypeError, match="host_pages"):
        t.finish_backup(copy, host, True, "pages")
    # Slots that could not all go back to the pages are refused before the
    # tree changes (the tree would take some and the rest would leak).
    t = _core.RadixTree(4, max_slots=1000)
    t.insert_prefix(list(range(8)), list(range(100, 108)))
    pages = _core.PageAllocator(8, 4)
    copy, dev, host = t.start_backup(list(range(8)), pages)
    before, free = t.dump(tiers=True), pages.num_free_pages
    for ok in (True, False):
        for bad, what in [
            (torch.cat([host[:4], host[:4]]), "repeats page"),
            (torch.arange(40, 48, dtype=torch.int32), "out of range"),
        ]:
            with pytest.raises(ValueError, match=what):
                t.finish_backup(copy, bad, ok, pages)
            assert t.dump(tiers=True) == before and pages.num_free_pages == free
        with pytest.raises(ValueError, match="free"):  # pages of another allocator
            t.finish_backup(copy, host, ok, _core.PageAllocator(3, 4))
        with pytest.raises(ValueError, match="host_pages has page_size 2"):
            t.finish_backup(copy, host, ok, _core.PageAllocator(8, 2))
        assert t.dump(tiers=True) == before and pages.num_free_pages == free
    assert len(t.finish_backup(copy, host, False, pages)) == 8
    assert pages.num_free_pages == free + 2
    pages.check_disjoint(t, True)
    t.check_integrity()


def test_copies_by_page_must_name_pages_inside_their_pools():
    """A copy handed over as page ids names pages inside both pools, or is
    refused at once (its slots are made only where it is copied: a page far
    past the pool would have cost its slots first); nothing is queued."""
    dev = torch.zeros(64, dtype=torch.uint8)
    host = torch.zeros(64, dtype=torch.uint8)
    layout = [0, 0, 8, 8, 4, 8]  # 8 slots of 8 bytes, pages of 4: pages 0 and 1
    c = _core.CacheController(dev, layout, host, layout, 8, 1, manual=True)
    ids = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    for queued, (call, first, second) in enumerate(
        [(c.backup, "device_slots", "host_slots"), (c.load, "host_slots", "device_slots")]
    ):
        with pytest.raises(ValueError, match=rf"{first}\[1\] = 2 is a page past the pool's 8"):
            call(ids(0, 2), ids(0, 1), 4)
        with pytest.raises(ValueError, match=rf"{second}\[0\] = 536870910 is a page past"):
            call(ids(1), ids(2**29 - 2), 4)
        assert c.in_flight == queued  # (the refused ones queued nothing)
        call(ids(0, 1), ids(1, 0), 4)
    c.drain()
    assert [ok for _, ok in c.take_backup_acks() + c.take_load_acks()] == [True, True]


def test_begin_load_pages_is_begin_load_in_page_ids():
    """begin_load_pages begins the same load as begin_load and returns the
    host and device-prefix page ids of the slots begin_load returns; a tree
    whose pages are not aligned refuses it, changing nothing."""
    ps, ids = 4, list(range(16))
    results = {}
    for pages in (False, True):
        t = _core.RadixTree(ps, max_slots=64, aligned_pages=True)
        device, host = _core.PageAllocator(16, ps), _core.PageAllocator(16, ps)
        t.insert_prefix(ids, device.allocate(16))
        copy, _, hs = t.start_backup(ids, host)
        t.finish_backup(copy, hs, True, host)
        t.lock_handle(t.match_prefix(ids[:8])[0])
        device.free(t.evict(8))
        load = t.find_load(t.match_prefix(ids)[0])
        begin = t.begin_load_pages if pages else t.begin_load
        loaded, host_ids, prefix = begin(load)
        assert (loaded.cached_len, loaded.lock_count) == (16, 1)
        results[pages] = (host_ids.tolist(), prefix.tolist(), t.dump(tiers=True))
        t.check_integrity()
    (host_slots, prefix_slots, dump), (host_pages, prefix_pages, dump_pages) = (
        results[False],
        results[True],
    )
    assert dump == dump_pages
    assert len(host_pages) == 2 and len(prefix_pages) == 2
    assert host_slots == [p * ps + i for p in host_pages for i in range(ps)]
    assert prefix_slots == [p * ps + i for p in prefix_pages for i in range(ps)]

    t = _core.RadixTree(ps, max_slots=64)  # pages not aligned: slots only
    t.insert_prefix(ids, list(range(16)))
    copy = t.find_backup(ids)
    t.begin_backup(copy)
    t.finish_backup(copy, list(range(16)))
    t.lock_handle(t.match_prefix(ids[:8])[0])
    t.evict(8)
    load = t.find_load(t.match_prefix(ids)[0])
    before = t.dump(tiers=True)
    with pytest.raises(ValueError, match="aligned"):
        t.begin_load_pages(load)
    assert t.dump(tiers=True) == before


def test_start_load_finds_begins_and_takes_device_pages_in_one_call():
    """start_load is find_load, begin_load and the device pages at once: None
    when nothing is left on the host, the copy alone (nothing changed) when
    too few device pages are free, else the loaded handle, the host slots and
    the request's indices (the device part's slots, then the new pages)."""
    t = _core.RadixTree(4, max_slots=64)
    device = _core.PageAllocator(16, 4)
    host = _core.PageAllocator(16, 4)
    ids = list(range(16))
    slots = device.allocate(16)
    t.insert_prefix(ids, slots)
    copy, _, hs = t.start_backup(ids, host)
    t.finish_backup(copy, hs, True, host)
    t.lock_handle(t.match_prefix(ids[:8])[0])  # keeps the first 8 on the device
    device.free(t.evict(8))  # the last 8 are host only now
    h, _ = t.match_prefix(ids)
    assert (h.cached_len, h.host_hit_len) == (8, 8)
    assert t.start_load(t.match_prefix(ids[:8])[0], device) is None  # no host part

    taken = device.allocate(4 * (device.num_free_pages - 1))  # one page left
    before, free = t.dump(tiers=True), device.num_free_pages
    copy, loaded, host_slots, indices = t.start_load(h, device)
    assert (copy.start, copy.end) == (8, 16) and loaded is None and host_slots is None
    assert indices is None and t.dump(tiers=True) == before and device.num_free_pages == free
    for bad, error, says in [
        (None, TypeError, "device_pages must be a radixkv._core.PageAllocator"),
        (_core.PageAllocator(8, 2), ValueError, "device_pages has page_size 2"),
        (_core.PageAllocator(17, 4), ValueError, "68 slots but the tree takes slots below"),
    ]:
        with pytest.raises(error, match=says):
            t.start_load(h, bad)
        assert t.dump(tiers=True) == before

    device.free(taken)
    copy, loaded, host_slots, indices = t.start_load(h, device)
    assert (loaded.cached_len, loaded.lock_count) == (16, 1) and len(host_slots) == 8
    assert indices[:8].tolist() == slots[:8].tolist() and len(indices) == 16
    new = indices[8:]
    for p in range(0, 8, 4):  # whole pages the allocator handed out
        assert new[p] % 4 == 0 and new[p : p + 4].tolist() == list(range(new[p], new[p] + 4))
    assert device.num_free_pages == free + len(taken) // 4 - 2
    with pytest.raises(ValueError, match="load"):  # its host part is loading now
        t.start_load(h, device)
    assert t.finish_load(copy, new, True)
    assert t.match_prefix(ids)[0].cached_len == 16
    t.lock_handle(loaded, True)
    device.check_disjoint(t)
    t.check_integrity()


def test_a_discarded_manager_lets_go_of_its_controller_and_its_pool():
    pool = MHAKVCache(1, 2, 8, 16, torch.float16, page_size=4)
    cm = CacheManager(16, page_size=4, host_num_pages=32, kv_cache=pool)
    with pytest.raises(ValueError, match="already backs the host tier"):
        CacheManager(16, page_size=4, host_num_pages=32, kv_cache=pool)
    controller = weakref.ref(cm.controller)
    del cm
    gc.collect()
    assert controller() is None  # the pool's hook held it weakly
    pool.k_cache(0)  # a hook whose controller is gone waits for nothing
    cm2 = CacheManager(16, page_size=4, host_num_pages=32, kv_cache=pool)
    assert cm2.controller is not None


def test_the_indices_load_back_returns_are_the_callers_not_the_loads(tiered_manager):
    """A caller may write into the indices load_back returned (a scheduler
    reuses its buffers): the load in flight keeps its own slots."""
    cm = tiered_manager(8, 4, 16, kv_shape=(1, 1, 4, torch.float16))
    ids = list(range(1, 17))
    h, _ = cm.match_req(ids[:8] + [0])
    cm.lock(h)
    cm.free_and_cache_finished_req(h, ids[:8] + [0], cm.allocate(9))
    h, idx = cm.match_req(ids + [0])
    cm.lock(h)
    cm.free_and_cache_finished_req(h, ids + [0], torch.cat([idx, cm.allocate(9)]))
    cm.drain()  # both nodes have host copies
    h, _ = cm.match_req(ids[:8] + [0])
    cm.lock(h)  # the first node stays on the device
    cm.make_room(4 * 6)  # the second node leaves it (4 pages were free)
    cm.unlock(h)
    h, _ = cm.match_req(ids + [0])
    assert (h.cached_len, h.host_hit_len) == (8, 8)
    loaded, idx = cm.load_back(h)
    slots = idx.clone()
    idx[8:] = 31  # the caller reuses its tensor
    cm.drain()
    cm.check_integrity()
    assert torch.equal(cm.match_req(ids + [0])[1], slots[:16])
    cm.unlock(loaded)


def test_load_back_after_the_host_part_was_evicted_gives_the_device_part():
    pool = MHAKVCache(1, 1, 4, 4, torch.float16)
    cm = CacheManager(4, host_num_pages=8, kv_cache=pool)

    def run(ids):
        h, idx = cm.match_req(ids)
        h, idx = cm.load_back(h)
        own = cm.allocate(len(ids) - h.cached_len)
        cm.free_and_cache_finished_req(h, ids, torch.cat([idx, own]))
        cm.drain()

    run([1, 2, 3, 4])
    run([7, 8, 9, 10])
    h, _ = cm.match_req([1, 2, 3, 4])
    assert h.host_hit_len == 3
    run([7, 8, 9, 10])
    run([11, 12, 13, 14])  # its backups push [1, 2, 3] out of the host pool
    h2, idx = cm.load_back(h)
    assert h2.cached_len == h.cached_len == len(idx) and h2.lock_count == 1
    cm.unlock(h2)
    cm.check_integrity()


def test_small_argument_errors_on_the_tier_paths():
    pool = MHAKVCache(1, 2, 8, 8, torch.float16, page_size=2)
    grad = torch.zeros(2 * 2 * 8 * 2 * 8, requires_grad=True)
    lay = list(pool.copy_layout())
    with pytest.raises((ValueError, TypeError), match="grad"):
        _core.CacheController(grad, lay, pool.kv_buffer.clone(), lay, 16, 2)
    buf = pool.kv_buffer.clone()
    with pytest.raises(ValueError, match="layers"):
        _core.transfer_rows(pool.kv_buffer, lay, buf, lay, 16, 2, [0], [1], 0, -2)
    with pytest.raises(ValueError, match="write_policy"):
        CacheManager(4, write_policy="bogus")
    cm = CacheManager(8, page_size=2, host_num_pages=8, kv_cache=pool)
    with pytest.raises(TypeError, match="handle"):
        cm.load_back(None)
    with pytest.raises(ValueError, match="layer"):
        cm.wait_layer(-1)
    with pytest.raises(ValueError, match="layer"):
        cm.wait_layer(2)
    bookkeeping = CacheManager(8, page_size=2, host_num_pages=8)
    bookkeeping.wait_layer(5)  # no pool: no layers to wait for
    meta = MHAKVCache(1, 1, 8, 8, torch.float16, page_size=2, device="meta")
    with pytest.raises(TypeError, match="meta"):
        CacheManager(8, page_size=2, host_num_pages=8, kv_cache=meta)
    t = _core.RadixTree(1)
    t.insert_prefix([1, 2], [0, 1])
    with pytest.raises(_core.OutOfCapacityError, match="only 0 can go"):
        t.evict_host(10)
