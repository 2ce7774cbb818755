"""One manager hammered from several Python threads stays consistent.

Inputs of 70k tokens and large evictions make the native calls release the
GIL, so the threads really run inside the tree at the same time; the tree's
mutex must keep every call whole.
"""

import threading

import torch

from radixkv.kvcache import RadixCacheManager
from radixkv.scheduler import CacheManager

LONG = 70_000  # above the length at which the native calls release the GIL


def _run_in_threads(worker, count):
    """Runs worker(0) .. worker(count - 1) in threads at once and waits for all."""
    threads = [threading.Thread(target=worker, args=(t,)) for t in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_radix_manager_survives_concurrent_threads():
    m = RadixCacheManager("cpu", 1)
    errors = []
    shared = torch.randint(0, 50, (LONG,), dtype=torch.int32)

    def worker(tid):
        try:
            g = torch.Generator().manual_seed(tid)
            for i in range(12):
                tail = torch.randint(0, 50, (64,), generator=g, dtype=torch.int32)
                ids = torch.cat([shared[: LONG - 64 * (i % 3)], tail])
                base = (tid * 100 + i) * (LONG + 64)
                m.insert_prefix(ids, torch.arange(base, base + ids.numel(), dtype=torch.int32))
                h, idx = m.match_prefix(ids)
                assert idx.numel() == h.cached_len
                try:
                    m.lock_handle(h)
                except ValueError as e:
                    # Match and lock are two calls: another thread may evict
                    # the matched node in between, and the lock says so.
                    assert "stale" in str(e)
                else:
                    m.lock_handle(h, unlock=True)
                if i % 4 == 3:
                    evictable = m.size_info.evictable_size
                    if evictable:
                        try:
                            m.evict(min(evictable, LONG))
                        except RuntimeError:
                            pass  # another thread evicted first
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    _run_in_threads(worker, 4)
    assert not errors, errors
    m.check_integrity()
    info = m.size_info
    assert info.protected_size == 0
    assert sum(len(v) for _, _, v, _, _ in m.dump()) == info.total_size


def test_cache_manager_serialised_by_a_lock_stays_consistent():
    # CacheManager itself is documented as single-threaded (a scheduler runs
    # it); engines that share one serialise calls, which this checks holds.
    cm = CacheManager(4096, page_size=4)
    lock = threading.Lock()
    errors = []

    def worker(tid):
        try:
            for i in range(200):
                ids = [tid % 2] * 8 + list(range(i % 13, i % 13 + 12))
                with lock:
                    h, cached = cm.match_req(ids)
                    cm.lock(h)
                    own = cm.allocate(len(ids) - h.cached_len)
                with lock:
                    cm.free_and_cache_finished_req(h, ids, torch.cat([cached, own]))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    _run_in_threads(worker, 4)
    assert not errors, errors
    cm.check_integrity()
    assert cm.held_pages == 0
