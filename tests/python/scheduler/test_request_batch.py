"""The end of a request in one native call, and a scheduler step for a whole
batch: `finish_request` / `finish_requests` on the tree, and
`free_and_cache_finished_reqs` / `allocate_batch` on the CacheManager. A batch
is exactly its requests one by one (tree, free pages, events, backups); every
request is checked first, and together; a bad one changes nothing."""

import pytest
import torch

from radixkv import OutOfCapacityError, _core
from radixkv.events import EventPublisher
from radixkv.scheduler import CacheManager


class _Keep(EventPublisher):
    """A publisher that keeps its batches (nothing leaves the process)."""

    def __init__(self) -> None:  # no sockets
        self.batches: list = []
        self._closed = False

    def publish(self, events) -> None:
        self.batches.append(events)

    def publish_packed(self, events) -> None:
        self.batches.append(events)


def prompts(seed, count, page):
    """Requests that share prefixes (a few system prompts, repeated turns)."""
    g = torch.Generator().manual_seed(seed)
    bases = [
        torch.randint(0, 40, (int(torch.randint(1, 4 * page + 2, (1,), generator=g)),), generator=g)
        for _ in range(4)
    ]
    out = []
    for k in range(count):
        base = bases[int(torch.randint(0, len(bases), (1,), generator=g))]
        tail = torch.randint(
            0, 40, (int(torch.randint(1, 2 * page + 3, (1,), generator=g)),), generator=g
        )
        out.append(torch.cat([base, tail]).to(torch.int32) if k % 5 else base.clone())
    return out


def state(cm):
    """The tree (with the LRU order as ranks: a backup ticks the clock, and a
    batch starts its backups after all its inserts), free pages, metrics."""
    rows = cm.manager.tree.dump(True) if cm.manager.tree is not None else []
    rank = {t: r for r, t in enumerate(sorted({row.timestamp for row in rows}))}
    return ([row[:-1] + (rank[row.timestamp],) for row in rows], cm.free_pages, cm.metrics)


def manager(page, tiers, events=None, num_pages=64):
    kw = dict(host_num_pages=num_pages, write_policy="write_through") if tiers else {}
    return CacheManager(num_pages=num_pages, page_size=page, kv_events=events, **kw)


def one_by_one(cm, batch):
    """A step with one call a request, as a scheduler without batch calls
    makes it: every request matched and locked, then allocated, then finished
    (priority i % 3 for request i)."""
    held = [cm.match_req(ids) for ids in batch]
    for h, _ in held:
        cm.lock(h)
    held = [
        (h, ids, torch.cat([idx, cm.allocate(len(ids) - h.cached_len)]))
        for ids, (h, idx) in zip(batch, held)
    ]
    for i, (h, ids, idx) in enumerate(held):
        cm.free_and_cache_finished_req(h, ids, idx, priority=i % 3)


@pytest.mark.parametrize("page", [1, 4, 16])
@pytest.mark.parametrize("tiers", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_a_batch_step_is_its_requests_one_by_one(page, tiers, seed):
    ev_one, ev_many = _Keep(), _Keep()
    # Room for every step without eviction: allocate_batch evicts once for the
    # whole batch, and a batch starts its backups after all its inserts, so
    # where room runs out could differ (each is exact, not the same).
    one = manager(page, tiers, ev_one, num_pages=1024)
    many = manager(page, tiers, ev_many, num_pages=1024)
    for step in range(4):
        batch = prompts(seed * 10 + step, 6, page)
        one_by_one(one, batch)
        # The same step with one call each.
        matched = many.match_req_batch(batch)
        for h, _ in matched:
            many.lock(h)
        new = many.allocate_batch([len(ids) - h.cached_len for ids, (h, _) in zip(batch, matched)])
        items = [(h, ids, torch.cat([idx, own])) for ids, (h, idx), own in zip(batch, matched, new)]
        many.free_and_cache_finished_reqs(items, priority=[i % 3 for i in range(len(items))])
        one.drain()  # every backup landed and applied
        many.drain()
        assert state(many) == state(one)
    one.check_integrity()
    many.check_integrity()
    assert ev_many.batches == ev_one.batches


def admitted(cm, batch):
    out = []
    for ids in batch:
        h, idx = cm.match_req(ids)
        cm.lock(h)
        out.append((h, ids, torch.cat([idx, cm.allocate(len(ids) - h.cached_len)])))
    return out


def test_a_bad_request_names_its_place_and_changes_nothing():
    cm = manager(4, False)
    seed = admitted(cm, [torch.arange(8)])
    cm.free_and_cache_finished_reqs(seed)
    items = admitted(cm, [torch.arange(10), torch.arange(50, 55)])
    before = state(cm)
    (h0, ids0, idx0), (h1, ids1, idx1) = items
    stolen = idx1.clone()
    stolen[:4] = idx0[8:12]  # request 1 claims request 0's own page
    cases = [
        ("x", TypeError, "batch must be a list or tuple"),
        ([(h0, ids0)], TypeError, "batch[0] must be a tuple (old_handle, input_ids, indices)"),
        ([items[0], (h1, ids1, idx1[:4])], ValueError, "batch[1] indices has length 4"),
        (
            [items[0], (h1, ids1, stolen)],
            ValueError,
            "batch[0] indices and batch[1] indices both hold page",
        ),
        ([items[0], items[0]], ValueError, "appears 2 times in the batch but holds 1 locks"),
        ([items[0], (7, ids1, idx1)], TypeError, "batch[1] old_handle must be a RadixCacheHandle"),
        ([items[0], (h1, [1.5], idx1)], TypeError, "batch[1] input_ids"),
        ([items[0], (h1, ids1, idx1.flip(0))], ValueError, "batch[1] indices"),
        (
            [items[0], (h1, ids1.to("meta"), idx1)],
            TypeError,
            "batch[1] input_ids must be a CPU tensor, got a tensor on meta",
        ),
    ]
    for batch, error, says in cases:
        with pytest.raises(error) as e:
            cm.free_and_cache_finished_reqs(batch)
        assert says in str(e.value), str(e.value)
        assert state(cm) == before
        assert h0.lock_count == 1 and h1.lock_count == 1
    with pytest.raises(ValueError, match="priority has 1 entries but batch has 2"):
        cm.free_and_cache_finished_reqs(items, priority=[0])
    with pytest.raises(ValueError, match=r"priority\[1\] must fit int32"):
        cm.free_and_cache_finished_reqs(items, priority=[0, 2**40])
    assert state(cm) == before
    cm.free_and_cache_finished_reqs(items)
    assert h0.lock_count == 0 and h1.lock_count == 0
    assert cm.free_pages == 64 - 3  # the 10-token request's last page was partial
    cm.check_integrity()


def test_finish_request_checks_what_the_python_path_checked():
    cm = manager(4, False)
    ((h, ids, idx),) = admitted(cm, [torch.arange(6)])
    before = state(cm)
    tree = cm.manager.tree
    cases = [
        (lambda: tree.finish_request(h, ids, idx, None), TypeError, "pages must be"),
        (
            lambda: tree.finish_request(h, ids, idx, _core.PageAllocator(64, 2)),
            ValueError,
            "pages has page_size 2 but the tree has 4",
        ),
        (lambda: tree.finish_request("h", ids, idx, cm._pages), TypeError, "old_handle must be"),
        (lambda: tree.finish_request(h, ids, idx, cm._pages, 2**40), ValueError, "priority"),
        (
            lambda: cm.free_and_cache_finished_req(h, ids, idx[:4]),
            ValueError,
            "indices has length 4 but must cover input_ids (length 6)",
        ),
    ]
    for call, error, says in cases:
        with pytest.raises(error) as e:
            call()
        assert says in str(e.value), str(e.value)
        assert state(cm) == before and h.lock_count == 1
    cm.unlock(h)
    with pytest.raises(ValueError, match="old_handle is not locked"):
        cm.free_and_cache_finished_req(h, ids, idx)
    cm.lock(h)
    cm.free_and_cache_finished_req(h, ids, idx)
    with pytest.raises(ValueError, match="old_handle is not locked"):
        cm.free_and_cache_finished_req(h, ids, idx)  # finished once already
    cm.check_integrity()


def test_allocate_batch_is_all_or_nothing_in_whole_pages():
    cm = manager(4, False)
    got = cm.allocate_batch([5, 0, 4, 1])
    assert [len(x) for x in got] == [8, 0, 4, 4]
    flat = torch.cat(got)
    assert len(set(flat.tolist())) == len(flat)
    assert cm.free_pages == 64 - 4
    with pytest.raises(OutOfCapacityError):
        cm.allocate_batch([4 * 30, 4 * 31])
    assert cm.free_pages == 64 - 4
    for bad, error, says in [
        ("x", TypeError, "sizes must be a list or tuple"),
        ([1, -1], ValueError, "sizes[1] must be >= 0"),
        ([1, 2.5], TypeError, "sizes[1]"),
    ]:
        with pytest.raises(error) as e:
            cm.allocate_batch(bad)
        assert says in str(e.value), str(e.value)
        assert cm.free_pages == 64 - 4
    for x in got:
        cm.free(x)
    assert cm.free_pages == 64
    # Cached pages are evicted once for the whole batch when they are needed.
    cm.free_and_cache_finished_reqs(admitted(cm, [torch.arange(4 * 40)]))
    assert cm.free_pages == 24
    got = cm.allocate_batch([4 * 20, 4 * 20])
    # 16 pages were missing: the one cached node (40 pages) went, once.
    assert [len(x) for x in got] == [80, 80]
    assert cm.free_pages == 24 and cm.metrics.evicted_tokens == 4 * 40
    cm.check_integrity()


def test_cache_unfinished_req_is_one_native_call_that_refuses_changing_nothing():
    cm = manager(4, True)
    ((h, ids, idx),) = admitted(cm, [torch.arange(10)])
    before = (state(cm), cm.held_pages)
    for call, error, says in [
        (lambda: cm.cache_unfinished_req(h, ids, idx[:8]), ValueError, "indices has length 8"),
        (lambda: cm.cache_unfinished_req(h, ids, idx.flip(0)), ValueError, "indices"),
        (lambda: cm.cache_unfinished_req(5, ids, idx), TypeError, "old_handle must be"),
        (lambda: cm.cache_unfinished_req(h, ids, idx, 2**40), ValueError, "priority"),
    ]:
        with pytest.raises(error) as e:
            call()
        assert says in str(e.value), str(e.value)
        assert (state(cm), cm.held_pages) == before and h.lock_count == 1
    new, new_idx = cm.cache_unfinished_req(h, ids, idx)
    assert (new.cached_len, new.lock_count, h.lock_count) == (8, 1, 0)
    assert torch.equal(new_idx, idx)  # its own pages are the cache's now
    assert cm.held_pages == 1  # the partial last page
    cm.free_and_cache_finished_req(new, ids, new_idx)
    cm.drain()
    assert cm.held_pages == 0 and cm.metrics.backed_up_tokens == 8
    cm.check_integrity()


@pytest.mark.parametrize("kind", ["radix", "naive"])
def test_a_request_whose_tokens_are_not_its_match_fails_the_batch_before_any_finishes(kind):
    cm = CacheManager(num_pages=64, page_size=4, type=kind)
    cm.free_and_cache_finished_reqs(admitted(cm, [torch.arange(9)]))
    (a,) = admitted(cm, [torch.arange(20, 29)])
    ((hb, _, idxb),) = admitted(cm, [torch.arange(9)])
    bad = (hb, torch.arange(100, 109), idxb)  # not the tokens hb matched
    before = (state(cm), cm.held_pages, a[0].lock_count, hb.lock_count)
    with pytest.raises(ValueError) as e:
        cm.free_and_cache_finished_reqs(
            [a, bad] if kind == "radix" else [a, (hb, bad[1], idxb[:4])]
        )
    assert str(e.value).startswith("batch[1] "), str(e.value)
    if kind == "radix":
        assert "input_ids[:8] are not the tokens batch[1] old_handle matched" in str(e.value)
    assert (state(cm), cm.held_pages, a[0].lock_count, hb.lock_count) == before
    with pytest.raises(ValueError, match="appears 2 times in the batch but holds 1 locks"):
        cm.free_and_cache_finished_reqs([a, a])
    assert (state(cm), cm.held_pages) == before[:2]
    cm.free_and_cache_finished_reqs([a, (hb, torch.arange(9), idxb)])
    assert cm.held_pages == 0
    cm.check_integrity()
