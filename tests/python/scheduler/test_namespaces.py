"""Cache namespaces: sequences of different namespaces never share a prefix, in
one tree under one eviction order, and each namespace seeds its own storage keys."""

from __future__ import annotations

import random

import pytest
import torch

from radixkv import _core
from radixkv.kvcache import MHAKVCache, RadixCacheManager
from radixkv.scheduler import CacheManager
from radixkv.scheduler.namespaces import Namespaces
from radixkv.storage import FileStorage, config_fingerprint
from radixkv.storage.keys import page_keys
from reference import RefOutOfCapacity, ReferenceRadixCache


@pytest.mark.parametrize("page_size", [1, 4])
def test_same_tokens_in_two_namespaces_share_nothing(page_size):
    t = _core.RadixTree(page_size)
    ids = list(range(4 * page_size))
    assert t.insert_prefix(ids, list(range(len(ids)))) == 0
    # The same tokens under namespace 7 are new: insert reports nothing cached
    # and stores the caller's slots.
    other = list(range(100, 100 + len(ids)))
    assert t.insert_prefix(ids, other, namespace=7) == 0
    h0, i0 = t.match_prefix(ids)
    h7, i7 = t.match_prefix(ids, 7)
    assert (h0.cached_len, h7.cached_len) == (len(ids), len(ids))
    assert i0.tolist() == list(range(len(ids))) and i7.tolist() == other
    # A namespace never inserted into matches nothing.
    assert t.match_prefix(ids, namespace=8)[0].cached_len == 0
    # A longer sequence in namespace 7 extends its own path only.
    longer = ids + list(range(50, 50 + page_size))
    assert t.insert_prefix(longer, other + [200 + j for j in range(page_size)], namespace=7) == len(
        ids
    )
    assert t.match_prefix(longer)[0].cached_len == len(ids)
    assert t.match_prefix(longer, 7)[0].cached_len == len(longer)
    t.check_integrity()
    assert t.num_nodes == 3


def test_namespaces_share_one_eviction_order():
    t = _core.RadixTree(1)
    t.insert_prefix([1, 2], [0, 1], namespace=1)
    t.insert_prefix([1, 2], [2, 3], namespace=2)
    t.insert_prefix([1, 2], [4, 5])
    t.match_prefix([1, 2], 1)  # namespace 1 is now the most recently used
    assert t.evict(2).tolist() == [2, 3]
    assert t.evict(2).tolist() == [4, 5]
    assert t.match_prefix([1, 2], 1)[0].cached_len == 2
    t.check_integrity()


def test_bad_namespaces_raise_naming_the_argument():
    t = _core.RadixTree(1)
    with pytest.raises(ValueError, match="^namespace must be >= 0"):
        t.match_prefix([1], -1)
    with pytest.raises(TypeError, match="namespace"):
        t.insert_prefix([1], [0], 0, "a")
    with pytest.raises(ValueError, match="namespace has 1 entries but batch has 2"):
        t.match_prefix_batch([[1], [2]], [3])
    with pytest.raises(ValueError, match=r"^namespace\[1\] must be >= 0"):
        t.match_prefix_batch([[1], [2]], [3, -4])
    assert t.num_nodes == 0
    m = CacheManager(8)
    for bad in (1.5, True, [1]):
        with pytest.raises(TypeError, match="^namespace must be None, a str, bytes or an int"):
            m.match_req([1, 2], namespace=bad)
    with pytest.raises(TypeError, match=r"^namespace\[0\] must be"):
        m.match_req_batch([[1, 2]], namespace=[2.0])


def test_batch_matches_each_input_in_its_namespace():
    t = _core.RadixTree(1)
    t.insert_prefix([1, 2, 3], [0, 1, 2], namespace=3)
    out = t.match_prefix_batch([[1, 2, 3], [1, 2, 3], [1, 2]], [0, 3, 3])
    assert [h.cached_len for h, _ in out] == [0, 3, 2]
    assert [h.cached_len for h, _ in t.match_prefix_batch([[1, 2, 3]] * 2, 3)] == [3, 3]


@pytest.mark.parametrize("page_size,seed", [(1, 0), (1, 1), (2, 2), (4, 3)])
def test_random_operations_over_namespaces_match_the_model(page_size, seed):
    rng = random.Random(seed)
    native = RadixCacheManager("cpu", page_size)
    ref = ReferenceRadixCache(page_size)
    # Slots come in pages of page_size consecutive slots (page g: g * page_size + i),
    # handed out and taken back whole, as a paged pool does.
    held, free, next_page = [], [], 0
    words = [[rng.randrange(2) for _ in range(page_size)] for _ in range(3)]
    for step in range(600):
        ns = rng.randrange(3)
        ids = [x for _ in range(rng.randrange(0, 5)) for x in rng.choice(words)]
        op = rng.random()
        if op < 0.35:
            h, idx = native.match_prefix(ids, ns)
            rh, ridx = ref.match_prefix(ids, ns)
            assert (h.cached_len, idx.tolist()) == (rh.cached_len, ridx), step
            if rng.random() < 0.3:
                native.lock_handle(h)
                ref.lock_handle(rh)
                held.append((h, rh))
        elif op < 0.75:
            slots = []
            for _ in range(-(-len(ids) // page_size)):
                if free:
                    page = free.pop()
                else:
                    page = next_page
                    next_page += 1
                slots.extend(page * page_size + i for i in range(page_size))
            slots = slots[: len(ids)]
            got = native.insert_prefix(ids, slots, 0, ns)
            assert got == ref.insert_prefix(ids, slots, 0, ns), step
            # Slots of tokens cached already, and of a ragged tail, stay the caller's.
            n = len(ids) - len(ids) % page_size
            free.extend(s // page_size for s in (slots[:got] + slots[n:])[::page_size])
        elif op < 0.85 and held:
            h, rh = held.pop(rng.randrange(len(held)))
            native.lock_handle(h, True)
            ref.lock_handle(rh, True)
        else:
            size = rng.randrange(0, 3 * page_size)
            try:
                want = ref.evict(size)
            except RefOutOfCapacity:
                with pytest.raises(_core.OutOfCapacityError):
                    native.evict(size)
                continue
            got = native.evict(size).tolist()
            assert got == want, step  # one eviction order over every namespace
            free.extend(s // page_size for s in got[::page_size])
        assert tuple(native.size_info) == ref.size_info()
        assert native.num_nodes == ref.num_nodes
        native.check_integrity()


def test_namespace_ids_are_exact_and_typed():
    spaces = Namespaces()
    assert spaces.id(None) == spaces.id(0) == 0 and len(spaces) == 0
    a, b, c = spaces.id("5"), spaces.id(b"5"), spaces.id(5)
    assert len({a, b, c}) == 3 and 0 not in (a, b, c)
    assert spaces.id("5") == a and spaces.id(bytearray(b"5")) == b
    base = bytes(32)
    assert spaces.seed(0, base) == base and spaces.seed(0, None) is None
    seeds = {spaces.seed(x, base) for x in (a, b, c)} | {spaces.seed(a, None)}
    assert len(seeds) == 4 and all(len(s) == 32 for s in seeds)
    # The seed depends on the name only, not on the order ids were handed out.
    other = Namespaces()
    assert other.seed(other.id(5), base) == spaces.seed(c, base)
    # Lone surrogates (what JSON's "\ud800" decodes to) are names too, none
    # equal to another or to a valid string's.
    odd = [spaces.id(x) for x in ("\ud800", "\udc00", "\ud800\udc00", "\U00010000")]
    assert len(set(odd)) == 4 and spaces.id("\ud800") == odd[0]


def test_forgotten_names_miss_and_never_hit_wrongly():
    spaces = Namespaces(capacity=2)
    a, b = spaces.id("a"), spaces.id("b")
    spaces.id("a")  # "b" is now the least recently used
    c = spaces.id("c")  # ... and is forgotten
    assert len(spaces) == 2 and not spaces.known(b) and spaces.known(a) and spaces.known(c)
    with pytest.raises(KeyError):
        spaces.seed(b, bytes(32))
    assert spaces.id("b") not in (a, b, c)  # a new id: its old prefixes are never found
    m = CacheManager(16, max_namespaces=1)
    h, _ = m.match_req([1, 2, 3], namespace="x")
    m.lock(h)
    m.free_and_cache_finished_req(h, [1, 2, 3], m.allocate(3))
    assert m.match_req([1, 2, 3, 4], namespace="x")[0].cached_len == 3
    m.match_req([1], namespace="y")  # "x" is forgotten
    assert m.match_req([1, 2, 3, 4], namespace="x")[0].cached_len == 0
    assert m.match_req([1, 2, 3, 4], namespace="y")[0].cached_len == 0
    assert m.match_req([1, 2, 3, 4])[0].cached_len == 0
    m.check_integrity()
    assert m.manager.evict(3).numel() == 3  # its pages age out in the eviction order


def test_failed_calls_remember_no_name_and_handles_carry_theirs():
    m = CacheManager(8)
    with pytest.raises(ValueError):
        m.match_req([], namespace="t1")
    with pytest.raises(ValueError):
        m.match_req_batch([[1], []], namespace=["t2", "t3"])
    with pytest.raises(TypeError, match=r"^namespace\[1\]"):
        m.match_req_batch([[1], [2]], namespace=["t4", 2.5])
    assert m.prefetch([1, 2], namespace="t5") is None
    assert len(m._namespaces) == 0
    h, _ = m.match_req([5, 6, 7], namespace="t6")
    assert h.namespace == m._namespaces.id("t6") != 0
    m.lock(h)
    # Finishing with cached_len == 0 still caches in the match's namespace.
    m.free_and_cache_finished_req(h, [5, 6, 7], m.allocate(3))
    assert m.match_req([5, 6, 7, 8])[0].cached_len == 0
    assert m.match_req([5, 6, 7, 8], namespace="t6")[0].cached_len == 3


def test_naive_manager_checks_namespaces_like_the_radix_one():
    from radixkv.kvcache import create_cache_manager

    for kind in ("naive", "radix"):
        mgr = create_cache_manager("cpu", kind, 1)
        with pytest.raises(ValueError, match="^namespace must be >= 0"):
            mgr.match_prefix([1, 2], -5)
        with pytest.raises(TypeError, match="namespace"):
            mgr.insert_prefix([1], [0], 0, 1.5)


def test_dump_shows_namespaces_and_orders_equal_siblings_by_them():
    t = _core.RadixTree(1)
    t.insert_prefix([1, 2], [0, 1], 0, 9)
    t.insert_prefix([1, 2], [2, 3], 0, 4)
    t.insert_prefix([1, 2, 3], [4, 5, 6])
    rows = t.dump(namespaces=True)
    assert [(r[1], r[-1]) for r in rows] == [([1, 2], 4), ([1, 2], 9), ([1, 2, 3], 0)]
    assert [len(r) for r in t.dump(True, True)] == [7, 7, 7]
    assert t.dump() == [r[:-1] for r in rows]


def _manager(root, device_pages=16):
    pool = MHAKVCache(1, 1, 4, device_pages, torch.float32, page_size=2)
    fp = config_fingerprint(
        model="m",
        dtype=torch.float32,
        page_size=2,
        layout="page_first",
        num_layers=1,
        kv_heads=1,
        head_dim=4,
    )
    storage = FileStorage(str(root), fingerprint=fp)
    m = CacheManager(
        device_pages,
        2,
        host_num_pages=device_pages,
        kv_cache=pool,
        storage=storage,
        prefetch_policy="wait_complete",
    )
    return m, pool, storage, fp


def _serve(m, pool, ids, namespace, value):
    handle, _ = m.match_req(ids, namespace=namespace)
    m.lock(handle)
    idx = torch.cat([m._tree.handle_slots(handle), m.allocate(len(ids) - handle.cached_len)])
    rows = torch.full((len(ids), 1, 4), float(value))
    pool.store_kv(rows, rows, idx[: len(ids)], 0)
    assert handle.namespace == m._namespaces.id(namespace)
    m.free_and_cache_finished_req(handle, ids, idx)  # the handle carries the namespace
    m.drain()
    return handle.cached_len


def test_manager_namespaces_on_every_tier(tmp_path):
    m, pool, storage, fp = _manager(tmp_path)
    prompt = list(range(9))
    assert _serve(m, pool, prompt, "tenant-a", 1.0) == 0
    assert _serve(m, pool, prompt, "tenant-b", 2.0) == 0  # no hit across namespaces
    assert _serve(m, pool, prompt, "tenant-a", 3.0) == 8  # a hit within one
    assert m.match_req(prompt)[0].cached_len == 0  # the default namespace is its own
    m.check_integrity()
    # Storage keys: the default namespace keeps the configuration's keys, each
    # other namespace has its own, and each wrote its pages under them.
    keys = {
        ns: page_keys(prompt[:8], 2, Namespaces().seed(0, fp) if ns is None else _seed(ns, fp))
        for ns in (None, "tenant-a", "tenant-b")
    }
    assert keys[None] == page_keys(prompt[:8], 2, fp)
    assert len({tuple(k) for k in keys.values()}) == 3
    assert storage.batch_exists(keys["tenant-a"]) == 4
    assert storage.batch_exists(keys["tenant-b"]) == 4
    assert storage.batch_exists(keys[None]) == 0
    m.close()
    # A fresh instance over the same store reads a namespace's pages back for
    # that namespace only, with that namespace's bytes.
    m2, pool2, _, _ = _manager(tmp_path)
    assert m2.prefetch(prompt, namespace="tenant-c") is None
    op = m2.prefetch(prompt, namespace="tenant-b")
    assert m2.wait_prefetch(op) == 8
    assert m2.match_req(prompt, namespace="tenant-a")[0].host_hit_len == 0
    handle, _ = m2.match_req(prompt, namespace="tenant-b")
    assert handle.host_hit_len == 8
    loaded, idx = m2.load_back(handle)
    m2.drain()
    assert torch.equal(pool2.k_cache(0).reshape(-1, 1, 4)[idx.long()], torch.full((8, 1, 4), 2.0))
    m2.unlock(loaded)
    m2.check_integrity()
    m2.close()


def _seed(name, fp):
    spaces = Namespaces()
    return spaces.seed(spaces.id(name), fp)
