"""radixkv.compat.sglang.hierarchical.evict_tokens: SGLang's `evict()` on
radixkv's whole cache. No SGLang needed: the call takes the CacheManager.

SGLang admits a prefill against its allocator's free tokens plus the cache's
evictable ones, then allocates and asks the cache to evict what is short.
Under write_through_selective a match starts a host backup of a path hit
often enough, pinning that path until the backup lands; a waiting request
matched in between (SGLang matches again each round) moved evictable tokens
to protected, and a server crashed with "Prefill out of memory" when the
eviction stopped at what was evictable before the backup landed."""

import torch

from radixkv.compat.sglang.hierarchical import evict_tokens
from radixkv.kvcache import MHAKVCache
from radixkv.scheduler import CacheManager

PS = 4


def manager(policy: str) -> CacheManager:
    pool = MHAKVCache(2, 2, 4, 16, torch.float32, page_size=PS)
    return CacheManager(
        16, page_size=PS, kv_cache=pool, host_num_pages=32, write_policy=policy, manual_copies=True
    )


def cache(cm: CacheManager, ids: torch.Tensor) -> torch.Tensor:
    """Caches `ids`; returns the free pages' slots, taken as the adapter
    hands every page the tree does not hold to SGLang's allocator."""
    h, cached = cm.match_req(ids)
    cm.lock(h)
    cm.free_and_cache_finished_req(
        h, ids, torch.cat([cached, cm.allocate(len(ids) - h.cached_len)])
    )
    return cm.allocate(cm.free_pages * PS)


def test_eviction_waits_for_the_backups_a_match_started():
    cm = manager("write_through_selective")
    tree = cm.manager.tree
    path = torch.arange(100, 125)  # 6 whole pages cached, nothing holding them
    sglang = cache(cm, path)
    counted = tree.evictable_size()  # what SGLang's admission counts
    assert counted == 24 and cm.in_flight.backups == 0
    for _ in range(2):  # a waiting request matched twice: its path's backup starts
        cm.match_req(path)
    assert tree.evictable_size() == 0 and cm.in_flight.backups == 1
    assert evict_tokens(cm, counted) >= counted
    assert cm.free_pages * PS >= counted and cm.in_flight.backups == 0
    cm.free(sglang)
    cm.check_integrity()


def test_eviction_past_what_can_go_evicts_all_it_can():
    cm = manager("write_through_selective")
    cache(cm, torch.arange(100, 125))
    for _ in range(2):
        cm.match_req(torch.arange(100, 125))
    assert evict_tokens(cm, 10**6) == 24  # no error: SGLang reads what is free after
    assert evict_tokens(cm, 0) == 0 and evict_tokens(cm, 4) == 0  # nothing left to evict
    cm.check_integrity()
