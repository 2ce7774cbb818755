"""match_prefix_batch: a prefill batch matched in one native call is exactly one
match_prefix per input, in order (results, LRU times, splits), every input is
checked before any is matched, and a large batch runs without the GIL."""

import threading

import numpy as np
import pytest
import torch

from radixkv import _core
from radixkv.kvcache import NaiveCacheManager, RadixCacheManager
from radixkv.scheduler import CacheManager


def filled(page, seed):
    m = RadixCacheManager(page_size=page)
    g = torch.Generator().manual_seed(seed)
    prefixes = [
        torch.randint(0, 50, (int(torch.randint(4, 40, (1,), generator=g)),), generator=g)
        for _ in range(6)
    ]
    slot = 0
    for k in range(30):
        base = prefixes[k % len(prefixes)]
        ids = torch.cat([base, torch.randint(0, 50, (k % 7 * page,), generator=g)])
        n = len(ids) - len(ids) % page
        slots = torch.arange(slot, slot + n)
        slot += n
        m.insert_prefix(ids[:n], slots)
    return m, prefixes, g


@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("seed", range(3))
def test_a_batch_is_one_match_per_input_in_order(page, seed):
    a, prefixes, g = filled(page, seed)
    b, _, _ = filled(page, seed)
    batch = []
    for k in range(12):
        base = prefixes[int(torch.randint(0, len(prefixes), (1,), generator=g))]
        cut = int(torch.randint(0, len(base) + 1, (1,), generator=g))
        batch.append(torch.cat([base[:cut], torch.randint(0, 50, (3,), generator=g)]))
    batch.append([])  # an empty input matches nothing
    one = [a.match_prefix(ids) for ids in batch]
    many = b.match_prefix_batch(batch)
    assert len(many) == len(one)
    for (h1, i1), (h2, i2) in zip(one, many):
        assert h1.cached_len == h2.cached_len and torch.equal(i1, i2)
    assert a._tree.dump() == b._tree.dump()  # the same splits and LRU times
    b.check_integrity()
    for h, _ in many:
        b.lock_handle(h)
        b.lock_handle(h, unlock=True)


@pytest.mark.parametrize(
    "bad,error",
    [
        ("x", TypeError),
        ([1, 2**40], ValueError),
        (torch.zeros(2, 2, dtype=torch.int32), ValueError),
        ([1.5], TypeError),
    ],
)
def test_a_bad_input_names_its_place_and_nothing_is_matched(bad, error):
    m, prefixes, _ = filled(1, 0)
    before = m._tree.dump()
    with pytest.raises(error, match=r"batch\[2\]"):
        m.match_prefix_batch([prefixes[0], prefixes[1], bad])
    assert m._tree.dump() == before  # the first two were not matched either
    with pytest.raises(TypeError, match="batch must be a list or tuple"):
        m.match_prefix_batch(prefixes[0])
    assert m.match_prefix_batch([]) == []


@pytest.mark.parametrize("kind", [RadixCacheManager, NaiveCacheManager])
def test_skip_last_matches_each_input_but_its_last_token(kind):
    m = kind(page_size=2) if kind is NaiveCacheManager else filled(2, 3)[0]
    batch = [torch.arange(7), [5, 6, 7], np.arange(3, dtype=np.int64)]
    skipped = m.match_prefix_batch(batch, 0, skip_last=True)
    plain = m.match_prefix_batch([torch.as_tensor(x)[:-1] for x in batch])
    for (h1, i1), (h2, i2) in zip(skipped, plain):
        assert h1.cached_len == h2.cached_len and torch.equal(i1, i2)
    before = m.dump() if kind is RadixCacheManager else None
    with pytest.raises(ValueError, match=r"batch\[1\] must hold at least one token"):
        m.match_prefix_batch([[1, 2], []], skip_last=True)
    if before is not None:
        assert m.dump() == before  # the first was not matched either


def test_the_trees_single_match_leaves_out_the_last_token_too():
    m, prefixes, _ = filled(2, 3)
    tree = m._tree
    for ids in [prefixes[0], torch.arange(7), [5, 6, 7], np.arange(3, dtype=np.int64), [9]]:
        h1, i1 = tree.match_prefix(ids, 0, True)
        h2, i2 = tree.match_prefix(torch.as_tensor(ids)[:-1])
        assert h1.cached_len == h2.cached_len and torch.equal(i1, i2)
    before = m.dump()
    with pytest.raises(ValueError, match=r"input_ids must hold at least one token"):
        tree.match_prefix([], skip_last=True)
    assert m.dump() == before


def test_match_req_hands_cpu_inputs_to_the_tree_with_the_same_hits_and_errors():
    """The default namespace's match_req reads its input natively; a named
    one takes the checked path. Both count and refuse alike."""
    from radixkv.scheduler import CacheManager

    ids = torch.arange(40, dtype=torch.int32)
    results = []
    for ns in (None, "named"):
        cm = CacheManager(32, page_size=4)
        h, idx = cm.match_req(ids, ns)
        cm.lock(h)
        slots = torch.cat([idx, cm.allocate(40)])
        cm.free_and_cache_finished_req(h, ids, slots)
        h, idx = cm.match_req(ids.tolist(), ns)
        m = cm.metrics
        stats = (h.cached_len, idx.tolist(), m.queries, m.query_tokens, m.device_hit_tokens)
        errors = []
        for bad in ([], torch.zeros(2, 2, dtype=torch.int32), [1, "a"], None):
            with pytest.raises((TypeError, ValueError)) as e:
                cm.match_req(bad, ns)
            errors.append((type(e.value), str(e.value)))
        with pytest.raises(TypeError, match="must be a CPU tensor, got a tensor on meta"):
            cm.match_req(torch.zeros(3, dtype=torch.int32, device="meta"), ns)
        meta = [ids, torch.zeros(3, dtype=torch.int32, device="meta")]
        with pytest.raises(
            TypeError, match=r"batch\[1\] must be a CPU tensor, got a tensor on meta"
        ):
            cm.match_req_batch(meta, ns)
        results.append((stats, errors))
    assert results[0] == results[1]
    assert results[0][0][0] == 36  # whole pages of the 39 tokens matched


def test_the_batch_is_read_once_whatever_its_items_do():
    m, prefixes, _ = filled(1, 1)
    batch = [prefixes[0], None, prefixes[1]]

    class Sneaky:
        def __index__(self):
            batch.clear()  # changes the list while it is being read
            return 3

    batch[1] = [1, 2, Sneaky()]
    out = m.match_prefix_batch(batch)
    assert len(out) == 3 and out[0][0].cached_len == len(prefixes[0])


def test_a_large_batch_runs_without_the_gil_and_matches_the_same():
    m = RadixCacheManager(page_size=1)
    seqs = [torch.arange(k * 10_000, k * 10_000 + 9_000) for k in range(10)]
    for k, s in enumerate(seqs):
        m.insert_prefix(s, torch.arange(k * 9_000, (k + 1) * 9_000))
    batch = [s[: 8_000 + k] for k, s in enumerate(seqs)]  # 80k tokens: the GIL goes
    stop = threading.Event()
    ticks = []

    def spin():  # Python code that runs only while the batch does not hold the GIL
        while not stop.is_set():
            ticks.append(1)

    t = threading.Thread(target=spin)
    t.start()
    for _ in range(20):
        out = m.match_prefix_batch(batch)
        assert [h.cached_len for h, _ in out] == [8_000 + k for k in range(10)]
    stop.set()
    t.join()
    m.check_integrity()


def test_naive_and_scheduler_managers_take_batches():
    n = NaiveCacheManager()
    out = n.match_prefix_batch([[1, 2, 3], torch.arange(4)])
    assert [h.cached_len for h, _ in out] == [0, 0]
    with pytest.raises(TypeError, match=r"batch\[1\]"):
        n.match_prefix_batch([[1], "x"])

    cm = CacheManager(16, page_size=4)
    ids = torch.arange(20)
    h, idx = cm.match_req(ids)
    cm.lock(h)
    cm.free_and_cache_finished_req(h, ids, cm.allocate(len(ids)))
    got = cm.match_req_batch([ids, torch.arange(9), torch.arange(100, 110)])
    assert [h.cached_len for h, _ in got] == [16, 8, 0]  # ids[:-1], in whole pages
    with pytest.raises(ValueError, match=r"batch\[0\] must hold at least one token"):
        cm.match_req_batch([[]])
    assert isinstance(got[0][0], _core.RadixCacheHandle)


def test_scheduler_batch_inputs_without_len_or_rank_are_read_or_named():
    """match_req_batch hands the default namespace's inputs to the tree: one
    the tree reads but len() does not (a buffer) is matched as before, and a
    0-d tensor is refused naming its place, nothing matched or counted."""
    import array
    import pickle

    cm = CacheManager(num_pages=16, page_size=4)
    ids = list(range(1, 13))
    h, _ = cm.match_req(ids + [0])
    cm.lock(h)
    cm.free_and_cache_finished_req(h, ids + [0], cm.allocate(13))
    before = (cm.manager.dump(), cm.metrics)
    with pytest.raises(ValueError, match=r"batch\[1\]"):
        cm.match_req_batch([[1, 2, 3], torch.tensor(5)])
    assert (cm.manager.dump(), cm.metrics) == before
    out = cm.match_req_batch([[1, 2, 3], pickle.PickleBuffer(array.array("i", [1, 2, 3, 4, 5]))])
    assert [h.cached_len for h, _ in out] == [0, 4]
    assert cm.metrics.query_tokens == before[1].query_tokens + 2 + 4
