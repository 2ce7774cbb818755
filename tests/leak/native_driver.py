"""Exercises every native entry point, error paths included, for a leak check.

Run under valgrind by .ci/leakcheck; any definite leak or invalid access with a
frame in radixkv's extension fails the check.
"""
import torch, radixkv
from radixkv.kvcache import RadixCacheManager
from radixkv.scheduler import CacheManager
for page in (1, 4):
    m = RadixCacheManager("cpu", page)
    for i in range(200):
        ids = torch.randint(0, 5, (40,))
        h, idx = m.match_prefix(ids)
        m.lock_handle(h); m.lock_handle(h, True)
        m.insert_prefix(ids, torch.arange(i * 40, i * 40 + 40))
        for bad in ([1.5], [[1]], [-1]):
            try: m.insert_prefix(bad, bad)
            except (TypeError, ValueError): pass
    m.evict(m.size_info.evictable_size); m.check_integrity(); m.dump(); m.reset()
    cm = CacheManager(64, page)
    for i in range(100):
        ids = list(range(i % 7, i % 7 + 20))
        h, c = cm.match_req(ids); cm.lock(h)
        own = cm.allocate(len(ids) - h.cached_len)
        cm.free_and_cache_finished_req(h, ids, torch.cat([c, own]))
        try: cm.allocate(10**6)
        except RuntimeError: pass
    cm.check_integrity()
print("ok")
