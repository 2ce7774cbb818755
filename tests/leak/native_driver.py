"""Exercises every native entry point, error paths included, for a leak check.

Run under valgrind by .ci/leakcheck; any definite leak or invalid access with a
frame in radixkv's extension fails the check.
"""

import torch
from radixkv.kvcache import RadixCacheManager
from radixkv.scheduler import CacheManager

for page in (1, 4):
    m = RadixCacheManager("cpu", page)
    for i in range(200):
        ids = torch.randint(0, 5, (40,))
        h, idx = m.match_prefix(ids)
        m.lock_handle(h)
        m.lock_handle(h, True)
        m.insert_prefix(ids, torch.arange(i * 40, i * 40 + 40))
        for bad in ([1.5], [[1]], [-1]):
            try:
                m.insert_prefix(bad, bad)
            except (TypeError, ValueError):
                pass
    m.evict(m.size_info.evictable_size)
    m.check_integrity()
    m.dump()
    m.reset()
    cm = CacheManager(64, page)
    for i in range(100):
        ids = list(range(i % 7, i % 7 + 20))
        h, c = cm.match_req(ids)
        cm.lock(h)
        own = cm.allocate(len(ids) - h.cached_len)
        cm.free_and_cache_finished_req(h, ids, torch.cat([c, own]))
        try:
            cm.allocate(10**6)
        except RuntimeError:
            pass
    cm.check_integrity()

# The host tier: the controller's thread, both engines, manual copies that
# fail, loads, host eviction, and the tier's error paths.
from radixkv import _core  # noqa: E402 (a section of its own)
from radixkv.kvcache import MHAKVCache  # noqa: E402

for manual in (False, True):
    pool = MHAKVCache(1, 2, 8, 16, torch.float16, page_size=4)
    cm = CacheManager(
        16,
        4,
        host_num_pages=8,
        kv_cache=pool,
        manual_copies=manual,
        write_policy="write_back" if manual else "write_through",
    )
    for i in range(60):
        ids = list(range(i % 9, i % 9 + 13))
        h, c = cm.match_req(ids)
        h, c = cm.load_back(h)
        own = cm.allocate(len(ids) - h.cached_len)
        pool.k_cache(1)
        if manual:
            for op in cm.controller.waiting()[::2]:
                cm.controller.complete(op, i % 3 != 0)
        failed = cm.loading_check()
        if any(f is h for f in failed):
            cm.unlock(h)
            cm.free(own)
        else:
            cm.free_and_cache_finished_req(h, ids, torch.cat([c, own]))
        cm.drain()
        for bad in ((None,), ([1.5],)):
            try:
                cm.load_back(*bad)
            except (TypeError, ValueError):
                pass
    cm.check_integrity()
    del cm
t = _core.RadixTree(1)
t.insert_prefix([1, 2, 3], [0, 1, 2])
c = t.find_backup([1, 2, 3])
t.begin_backup(c)
for bad in ([-1, 0, 1], [5, 5, 5], [1]):
    try:
        t.finish_backup(c, bad)
    except (TypeError, ValueError):
        pass
t.finish_backup(c, [7, 8, 9])
t.evict(3)
t.evict_host(3)
for layout in ([0, 0, 8, 8, 1, 2**61], [0, 0, 8, 8, 1, 8]):
    try:
        _core.transfer_rows(
            torch.zeros(64, dtype=torch.uint8),
            layout,
            torch.zeros(64, dtype=torch.uint8),
            [0, 0, 8, 8, 1, 8],
            8,
            1,
            [0],
            [9],
        )
    except ValueError:
        pass
# The storage tier's entry points, good and bad inputs.
t = _core.RadixTree(2)
t.insert_prefix([1, 2, 3, 4], [0, 1, 2, 3])
c = t.find_backup([1, 2, 3, 4], 0, True)
t.begin_backup(c)
t.finish_backup(c, [8, 9, 10, 11])
began = t.begin_storage_write(c)
t.finish_storage_write(began[0])
# The typed values: every dump row layout, the tier sizes, a copy as a plain tuple.
for tiers in (False, True):
    for spaces in (False, True):
        t.dump(tiers, spaces)
t.tier_sizes()
again = t.begin_storage_write(tuple(c))
if again is not None:
    t.finish_storage_write(tuple(again[0]))
pin = t.pin_host([1, 2, 3, 4])
t.storage_prefix_end([1, 2, 3, 4, 5, 6])
t.insert_host([1, 2, 3, 4, 5, 6], 4, [20, 21])
t.unpin_host(pin)
for bad in ((None,), ([1, 2], "x"), ([1, 2, 3], 1, [1])):
    try:
        t.insert_host(*bad)
    except (TypeError, ValueError):
        pass
for bad in ((pin,), ((1, 2),), ("x",)):
    try:
        t.unpin_host(*bad)
    except (TypeError, ValueError):
        pass
t.match_prefix_batch([[1, 2, 3, 4], torch.arange(6), []])
for bad in ([[1], "x"], "x", [[2**40]]):
    try:
        t.match_prefix_batch(bad)
    except (TypeError, ValueError):
        pass
_core.page_keys(torch.arange(64), 16, bytes(32))
_core.page_keys([1, 2, 3, 4], 2, raw=True)
_core.crc32c(b"123456789")
_core.crc32c(bytes(1 << 17))
for bad in (("x",), (b"x", -1)):
    try:
        _core.crc32c(*bad)
    except (TypeError, ValueError, OverflowError):
        pass
# The KV-event ledger, inline and on its own thread (destroyed with changes
# still queued, and after a refused one).
for threaded in (False, True):
    ledger = _core.BlockLedger(8, 8, 4, threaded)
    tokens, pages = torch.arange(32, dtype=torch.int32), torch.arange(8, dtype=torch.int32)
    for _ in range(3):
        ledger.device_inserted(tokens, pages, 0, 32, 0, bytes(32), True)
        ledger.host_backed_up(pages, pages, pages[:2], True)
        ledger.device_evicted(pages, True)
        ledger.device_loaded(pages, pages, True)
        ledger.take_events()
    ledger.snapshot()
    try:
        ledger.device_evicted(torch.tensor([99], dtype=torch.int32), True)
    except ValueError:
        pass
    ledger.device_inserted(tokens, pages, 0, 32, 0, None, True)
    del ledger
print("ok")
