"""Namespace quotas: a tenant that floods the cache pushes out its own pages
only, on the device and on the host tier, within limits given in bytes or
tokens; pages in use count but stay; bad limits change nothing."""

from __future__ import annotations

import random

import pytest
import torch

from radixkv.kvcache import MHAKVCache
from radixkv.scheduler import CacheManager

PS = 4


def serve(cm, ids, namespace, pool=None):
    """One request: match, load back, compute the rest, cache it, a round."""
    ids = torch.as_tensor(ids, dtype=torch.int32)
    h, _ = cm.match_req(ids, namespace)
    hit = h.cached_len + h.host_hit_len
    h, cached = cm.load_back(h)
    own = cm.allocate(len(ids) - h.cached_len)
    if pool is not None:
        new = len(ids) - h.cached_len
        for layer in range(pool.num_layers):
            rows = torch.full((new, *pool.row_shape), float(len(str(namespace))), dtype=pool.dtype)
            pool.store_kv(rows, rows, own[:new], layer)
    cm.free_and_cache_finished_req(h, ids, torch.cat([cached, own]))
    cm.writing_check()
    cm.loading_check()
    return hit


def prompt(seed, pages=4):
    return [seed * 1000 + i for i in range(pages * PS + 1)]


def test_a_flooding_tenant_pushes_out_its_own_pages_only():
    def run(quota):
        cm = CacheManager(64, PS)
        if quota:
            cm.set_quota("noisy", device_tokens=16 * PS)
        quiet = [prompt(s) for s in range(6)]  # 24 pages
        for ids in quiet:
            serve(cm, ids, "quiet")
        for s in range(100, 140):  # 160 pages of distinct prompts
            serve(cm, prompt(s), "noisy")
            usage = cm.quota_usage("noisy")
            assert usage is None or usage.device <= 16 * PS
        hits = sum(serve(cm, ids, "quiet") for ids in quiet)
        cm.check_integrity()
        return hits, cm

    without, _ = run(False)
    with_quota, cm = run(True)
    assert without == 0  # the flood took everything
    assert with_quota == 6 * 4 * PS  # every quiet prompt whole
    usage = cm.quota_usage("noisy")
    assert usage.device_limit == 16 * PS and usage.host_limit is None
    assert usage.device_evicted >= (160 - 16) * PS
    assert cm.quota_usage("quiet") is None


def test_a_host_quota_keeps_the_tenants_host_copies_within_bytes():
    pool = MHAKVCache(2, 2, 8, 32, torch.float16, page_size=PS)
    cm = CacheManager(32, PS, kv_cache=pool, host_num_pages=64)
    host_page = cm.host_pool.nbytes // cm.host_pool.num_pages
    device_page = pool.nbytes // pool.num_pages
    cm.set_quota("noisy", host_bytes=10 * host_page + 7, device_bytes=8 * device_page)
    usage = cm.quota_usage("noisy")
    assert (usage.device_limit, usage.host_limit) == (8 * PS, 10 * PS)  # whole pages
    cm.set_quota("quiet", host_tokens=10**6)  # (no limit that binds: it counts)
    quiet = [prompt(s, 3) for s in range(8)]  # 24 pages, each with a host copy
    for ids in quiet:
        serve(cm, ids, "quiet", pool)
    cm.drain()
    assert cm.quota_usage("quiet").host == 24 * PS
    for s in range(100, 120):
        serve(cm, prompt(s), "noisy", pool)
        cm.drain()
        usage = cm.quota_usage("noisy")
        assert usage.host <= 10 * PS and usage.device <= 8 * PS
    assert cm.quota_usage("noisy").host_evicted > 0
    # The quiet tenant's host copies all survived (80 pages of flood through
    # a host pool of 64 would have pushed them out), and its prompts come back.
    assert cm.quota_usage("quiet").host == 24 * PS
    assert sum(serve(cm, ids, "quiet", pool) for ids in quiet) == 8 * 3 * PS
    cm.drain()
    cm.check_integrity()


def test_write_back_backs_up_what_a_quota_evicts():
    pool = MHAKVCache(2, 2, 8, 32, torch.float16, page_size=PS)
    cm = CacheManager(32, PS, kv_cache=pool, host_num_pages=64, write_policy="write_back")
    cm.set_quota(5, device_tokens=4 * PS)
    first = prompt(1)
    serve(cm, first, 5, pool)
    serve(cm, prompt(2), 5, pool)  # pushes `first` out of the device
    cm.drain()
    h, _ = cm.match_req(torch.as_tensor(first, dtype=torch.int32), 5)
    assert h.cached_len == 0 and h.host_hit_len == 4 * PS  # on host: backed up first
    cm.check_integrity()


def test_pages_in_use_count_against_the_quota_but_stay():
    cm = CacheManager(64, PS)
    cm.set_quota("t", device_tokens=2 * PS)
    ids = torch.as_tensor(prompt(3, 6), dtype=torch.int32)
    h, _ = cm.match_req(ids, "t")
    cm.lock(h)
    own = cm.allocate(len(ids))
    # A chunk cached while the request runs: its pages are locked, over the quota.
    h2, idx = cm.cache_unfinished_req(h, ids, own)
    assert cm.quota_usage("t").device == 6 * PS
    cm.free_and_cache_finished_req(h2, ids, idx)  # released: now they can go
    assert cm.quota_usage("t").device <= 2 * PS
    cm.check_integrity()


def test_a_namespace_with_a_quota_is_never_forgotten():
    cm = CacheManager(64, PS, max_namespaces=2)
    cm.set_quota("kept", device_tokens=PS * 8)
    serve(cm, prompt(1), "kept")
    for name in ("a", "b", "c", "d"):  # more names than remembered
        serve(cm, prompt(2), name)
    assert serve(cm, prompt(1), "kept") == 4 * PS  # same id, same pages
    assert cm.quota_usage("kept").device_limit == 8 * PS
    cm.set_quota("kept")  # removed: may be forgotten again
    assert cm.quota_usage("kept") is None


def test_lowering_a_quota_evicts_at_once_and_removing_it_stops():
    cm = CacheManager(64, PS)
    cm.set_quota("t", device_tokens=40 * PS)
    for s in range(8):
        serve(cm, prompt(s), "t")
    assert cm.quota_usage("t").device == 32 * PS
    cm.set_quota("t", device_tokens=8 * PS)
    assert cm.quota_usage("t").device == 8 * PS
    # The most recent prompts are the ones kept.
    assert serve(cm, prompt(7), "t") == 4 * PS
    cm.set_quota("t")
    for s in range(20, 28):
        serve(cm, prompt(s), "t")
    assert cm.quota_usage("t") is None
    cm.check_integrity()


def test_bad_quotas_raise_naming_the_argument_and_change_nothing():
    cm = CacheManager(16, PS)
    with pytest.raises(ValueError, match="device_tokens or device_bytes, not both"):
        cm.set_quota("t", device_tokens=4, device_bytes=4)
    with pytest.raises(ValueError, match="device_tokens must be"):
        cm.set_quota("t", device_tokens=-1)
    with pytest.raises(ValueError, match="host_bytes needs the pool's bytes"):
        cm.set_quota("t", host_bytes=1 << 20)
    with pytest.raises(TypeError, match="namespace must be"):
        cm.set_quota(1.5, device_tokens=4)
    assert cm.quota_usage("t") is None and cm._tree.quotas() == []
    with pytest.raises(TypeError, match="needs the radix cache"):
        CacheManager(16, PS, type="naive").set_quota("t", device_tokens=4)


@pytest.mark.parametrize("seed", range(6))
def test_random_requests_in_three_tenants_keep_every_quota(seed):
    """Random requests (some left running, some chunked) in three namespaces,
    two with quotas changed along the way: after every step the tree's
    integrity walk (which checks each quota's counts and heaps) passes and a
    namespace over its limit has nothing more it could evict."""
    rng = random.Random(seed)
    pool = MHAKVCache(2, 1, 8, 48, torch.float16, page_size=PS)
    policy = rng.choice(["write_through", "write_back", "write_through_selective"])
    cm = CacheManager(48, PS, kv_cache=pool, host_num_pages=64, write_policy=policy)
    running = []
    for step in range(150):
        ns = rng.choice(["a", "b", None])
        op = rng.random()
        if op < 0.1:
            cm.set_quota(
                rng.choice(["a", "b"]),
                device_tokens=rng.choice([None, rng.randrange(0, 20) * PS]),
                host_tokens=rng.choice([None, rng.randrange(0, 30) * PS]),
            )
        elif op < 0.2 and running:
            h, ids, idx = running.pop(rng.randrange(len(running)))
            cm.free_and_cache_finished_req(h, ids, idx)
        else:
            ids = torch.as_tensor(prompt(rng.randrange(12), rng.randrange(1, 5)))
            ids = ids.to(torch.int32)
            try:
                if op < 0.3 and len(running) < 3:
                    h, _ = cm.match_req(ids, ns)
                    h, cached = cm.load_back(h)
                    own = cm.allocate(len(ids) - h.cached_len)
                    h, idx = cm.cache_unfinished_req(h, ids, torch.cat([cached, own]))
                    running.append((h, ids, idx))
                else:
                    serve(cm, ids.tolist(), ns, pool)
            except Exception as e:  # a full pool: the request waits (none here)
                if type(e).__name__ != "OutOfCapacityError":
                    raise
        cm.writing_check()
        cm.loading_check()
        cm.check_integrity()
        for name in ("a", "b"):
            usage = cm.quota_usage(name)
            if usage is None or usage.device_limit is None:
                continue
            if usage.device > usage.device_limit:  # then nothing of it can go
                ns_id = cm._namespaces.id(name)
                assert len(cm._tree.evict_namespace(ns_id, 1)) == 0
                assert cm._tree.over_quota() != []
    for h, ids, idx in running:
        cm.free_and_cache_finished_req(h, ids, idx)
    cm.drain()
    cm.check_integrity()
    for name in ("a", "b"):
        usage = cm.quota_usage(name)
        if usage is not None and usage.device_limit is not None:
            assert usage.device <= usage.device_limit


def test_the_trees_quota_calls_refuse_bad_input():
    from radixkv import _core

    t = _core.RadixTree(1)
    with pytest.raises(ValueError, match="namespace 3 has no quota"):
        t.evict_namespace(3, 1)
    with pytest.raises(ValueError, match="namespace 3 has no quota"):
        t.evict_host_namespace(3, 1)
    with pytest.raises(ValueError, match="namespace 3 has no quota"):
        t.eviction_candidates_without_host(1, 3)
    with pytest.raises(ValueError, match="^device must be >= 0 or None"):
        t.set_quota(3, -1, None)
    with pytest.raises(ValueError, match="^namespace must be >= 0"):
        t.set_quota(-3, 1, None)
    assert t.quotas() == []
    t.insert_prefix([1, 2, 3], [0, 1, 2], namespace=3)
    t.set_quota(3, 1, None)
    assert t.quotas() == [(3, 3, 0, 1, -1)] and t.over_quota() == [(3, 2, 0, 1, -1)]
    with pytest.raises(ValueError, match="^size must be >= 0"):
        t.evict_namespace(3, -1)
    assert t.evict_namespace(3, 2).tolist() == [0, 1, 2]
    t.check_integrity()


def fill(cm, quiet_pages=24, noisy_limit_pages=6):
    cm.set_quota("quiet", device_tokens=10**6)  # a limit that never binds: it counts
    for s in range(quiet_pages // 4):
        serve(cm, prompt(s), "quiet")
    cm.set_quota("noisy", device_tokens=noisy_limit_pages * PS)


def test_a_namespace_at_its_quota_makes_device_room_from_its_own_pages():
    """In a full pool, a request of a namespace at its quota that names its
    namespace to allocate takes the room of its own oldest pages; one that
    does not takes everyone's least recently used pages."""
    for named in (True, False):
        cm = CacheManager(32, PS)
        fill(cm)
        for s in range(100, 110):
            ids = torch.as_tensor(prompt(s), dtype=torch.int32)
            h, cached = cm.match_req(ids, "noisy")
            cm.lock(h)
            own = cm.allocate(len(ids) - h.cached_len, "noisy" if named else None)
            cm.free_and_cache_finished_req(h, ids, torch.cat([cached, own]))
        quiet = cm.quota_usage("quiet").device
        assert quiet == 24 * PS if named else quiet < 24 * PS
        assert cm.quota_usage("noisy").device <= 6 * PS
        cm.check_integrity()


def test_a_namespace_at_its_host_quota_makes_host_room_from_its_own_copies():
    pool = MHAKVCache(2, 2, 8, 16, torch.float16, page_size=PS)
    cm = CacheManager(16, PS, kv_cache=pool, host_num_pages=8)
    cm.set_quota("b", host_tokens=10**6)
    for s in range(6):  # 6 pages of host copies (of 8)
        serve(cm, prompt(s, 1), "b", pool)
    cm.drain()
    cm.set_quota("a", host_tokens=2 * PS)
    for s in range(100, 110):  # each backup of a's past its 2 pages drops a's own first
        serve(cm, prompt(s, 1), "a", pool)
        cm.drain()
    assert cm.quota_usage("b").host == 6 * PS
    assert cm.quota_usage("a").host == 2 * PS
    cm.check_integrity()


def test_the_flat_batch_finish_keeps_quotas_too():
    cm = CacheManager(64, PS)
    cm.set_quota("t", device_tokens=2 * PS)
    batch = [torch.as_tensor(prompt(s, 3), dtype=torch.int32) for s in range(4)]
    handles, indices = cm.match_req_batch(batch, ["t"] * 4, flat=True)
    for h in handles:
        cm.lock(h)
    own = cm.allocate_batch([len(ids) for ids in batch], flat=True)
    cm.free_and_cache_finished_reqs_flat(handles, batch, indices, own=own)
    assert cm.quota_usage("t").device <= 2 * PS
    cm.check_integrity()


@pytest.mark.parametrize("policy", ["mru", "tlru", "lfu", "slru", "priority"])
def test_a_namespace_eviction_takes_the_victim_the_policy_would(policy):
    """Inside one namespace the quota's eviction takes the same leaves, in
    the same order, as the tree's own eviction under every policy (mru and
    tlru re-key the heaps as a node is touched or split)."""
    from radixkv import _core

    rng = random.Random(7)
    trees = [_core.RadixTree(2, eviction_policy=policy) for _ in range(2)]
    trees[1].set_quota(3, 1 << 40, None)  # a limit that never binds: its heaps only
    ops = []
    for step in range(200):
        base = rng.randrange(8) * 100
        ids = [base + i for i in range(2 * rng.randrange(1, 4))]
        ops.append(("insert", ids) if rng.random() < 0.6 else ("match", ids))
    slot = 0
    for op, ids in ops:
        for t in trees:
            if op == "insert":
                t.insert_prefix(ids, list(range(slot, slot + len(ids))), namespace=3)
            else:
                t.match_prefix(ids, 3)
        slot += len(ids) if op == "insert" else 0
    while trees[0].size_info()[0]:
        a = trees[0].evict(1).tolist()
        b = trees[1].evict_namespace(3, 1).tolist()
        assert a == b
        for t in trees:
            t.check_integrity()


def test_a_failed_set_quota_changes_nothing_and_removing_none_remembers_nothing():
    cm = CacheManager(16, PS, max_namespaces=1)
    serve(cm, prompt(1, 2), "a")
    with pytest.raises(ValueError, match="device_tokens must be below 2\\*\\*62"):
        cm.set_quota("b", device_tokens=1 << 63)
    with pytest.raises(ValueError, match="host_tokens and host_bytes need a host tier"):
        cm.set_quota("b", host_tokens=8)
    cm.set_quota("c")  # nothing to remove
    assert serve(cm, prompt(1, 2), "a") == 2 * PS  # "a" was not forgotten


def test_a_prefetch_reads_no_more_than_the_namespaces_host_quota(tmp_path):
    from radixkv.storage import FileStorage, config_fingerprint

    fp = config_fingerprint(
        model="q",
        dtype=torch.float32,
        page_size=PS,
        layout="page_first",
        num_layers=1,
        kv_heads=1,
        head_dim=8,
    )

    def make(host_pages):
        pool = MHAKVCache(1, 1, 8, 16, torch.float32, page_size=PS)
        cm = CacheManager(
            16,
            PS,
            kv_cache=pool,
            host_num_pages=host_pages,
            storage=FileStorage(str(tmp_path), fp),
            storage_seed=fp,
            prefetch_policy="wait_complete",
        )
        return cm, pool

    writer, pool = make(16)
    ids = prompt(7, 5)
    serve(writer, ids, "b", pool)
    writer.drain()
    writer.close()
    cm, pool = make(8)
    cm.set_quota("quiet", host_tokens=10**6)
    cm.set_quota("b", host_tokens=2 * PS)
    for s in range(3):  # 6 of 8 host pages
        serve(cm, prompt(s, 2), "quiet", pool)
    cm.drain()
    op = cm.prefetch(torch.as_tensor(ids, dtype=torch.int32), "b")
    assert cm.wait_prefetch(op) == 2 * PS  # what the quota holds, not the store's 5 pages
    assert cm.quota_usage("b").host == 2 * PS and cm.quota_usage("b").host_evicted == 0
    assert cm.quota_usage("quiet").host == 6 * PS  # the 2 free pages were enough
    cm.check_integrity()
    cm.close()


def test_write_back_victims_make_host_room_from_their_own_namespace():
    """A device eviction for one tenant backs up another's victims: those
    make host room from their own namespace's copies (at its host quota),
    not from a third tenant's."""
    pool = MHAKVCache(1, 1, 8, 8, torch.float16, page_size=PS)
    cm = CacheManager(8, PS, kv_cache=pool, host_num_pages=8, write_policy="write_back")
    cm.set_quota("quiet", host_tokens=10**6)  # counts only
    cm.set_quota("a", host_tokens=2 * PS)
    for s in range(3):
        serve(cm, prompt(s, 2), "quiet", pool)
    serve(cm, prompt(50, 2), "a", pool)
    serve(cm, prompt(51, 2), "a", pool)
    cm.drain()
    quiet_host = cm.quota_usage("quiet").host
    ids = torch.as_tensor(prompt(9, 7), dtype=torch.int32)  # needs the whole device pool
    h, cached = cm.match_req(ids, "quiet")
    cm.lock(h)
    own = cm.allocate(len(ids) - h.cached_len, "quiet")
    cm.free_and_cache_finished_req(h, ids, torch.cat([cached, own]))
    cm.drain()
    assert cm.quota_usage("a").host <= 2 * PS
    assert cm.quota_usage("a").host_evicted == 0  # a's copies past its quota were never made
    assert cm.quota_usage("quiet").host >= quiet_host
    for s in range(3):  # quiet's older prompts all kept their host copies
        h, _ = cm.match_req(torch.as_tensor(prompt(s, 2), dtype=torch.int32), "quiet")
        assert h.cached_len + h.host_hit_len == 2 * PS
    cm.check_integrity()


@pytest.mark.parametrize("held_by", ["claim", "lock", "expiring claim"])
def test_a_quota_is_applied_again_when_a_claim_or_lock_is_released(held_by):
    """Pages a claim or a lock keeps past the quota go when it is released
    (a claim whose time is up: at the next call that may evict), not at the
    next finished request; and the quota evicts whole nodes, so a namespace
    of one 24-token node under an 8-token quota keeps nothing."""
    now = [0.0]
    cm = CacheManager(64, PS, clock=lambda: now[0])
    ids = prompt(3, 6)
    serve(cm, ids, "t")  # one node of 6 pages
    if held_by == "lock":
        h, _ = cm.match_req(ids, "t")
        cm.lock(h)
    else:
        claim = cm.retain(ids[:-1], "t", ttl_s=5.0 if held_by == "expiring claim" else None)
    cm.set_quota("t", device_tokens=2 * PS)
    assert cm.quota_usage("t").device == 6 * PS  # held: over the quota, and stays
    if held_by == "lock":
        cm.unlock(h)
    elif held_by == "claim":
        assert cm.release(claim) is True
    else:
        now[0] = 5.0
        cm.allocate(PS)  # room enough without evicting: the quota evicts all the same
    usage = cm.quota_usage("t")
    assert usage.device == 0 and usage.device_evicted == 6 * PS  # the whole node went
    cm.check_integrity()
