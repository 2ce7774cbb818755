"""The page path (`match_pages`, `allocate_pages`, ...) against the slot path.

Two managers serve the same requests in lockstep, one through each path:
every handle, every page (the slot path's pages, read as ids), the trees,
the counters and the pools must agree at page sizes 1, 16 and 512, with and
without a host tier. Then the page forms' refusals: each names its argument
and changes nothing."""

from __future__ import annotations

import random

import msgpack
import pytest
import torch

from radixkv import _core
from radixkv.events import EventPublisher
from radixkv.kvcache.page_ids import pages_of_slots, slots_of_pages
from radixkv.scheduler import CacheManager


def manager(ps: int, host: bool) -> CacheManager:
    tiers = dict(host_num_pages=48, write_policy="write_through") if host else {}
    return CacheManager(32, page_size=ps, manual_copies=False, **tiers)


def state(cm: CacheManager):
    cm.check_integrity()
    tree = cm.manager.tree
    return (tree.dump(tiers=True), cm.free_pages, cm.held_pages, tree.tier_sizes())


def prompts(ps: int, seed: int, n: int):
    rnd = random.Random(seed)
    systems = [[rnd.randrange(50) for _ in range(rnd.randrange(1, 5) * ps)] for _ in range(4)]
    for _ in range(n):
        own = [rnd.randrange(50) for _ in range(rnd.randrange(1, 3 * ps + 3))]
        yield torch.tensor(rnd.choice(systems) + own, dtype=torch.int32), rnd.random() < 0.3


@pytest.mark.parametrize("host", [False, True], ids=["device", "host"])
@pytest.mark.parametrize("ps", [1, 16, 512])
def test_the_page_path_is_the_slot_path_in_pages(ps, host):
    slots_cm, pages_cm = manager(ps, host), manager(ps, host)
    for ids, chunked in prompts(ps, seed=ps + host, n=160):
        h1, idx = slots_cm.match_req(ids)
        h2, pages = pages_cm.match_pages(ids)
        assert (h1.cached_len, h1.host_hit_len) == (h2.cached_len, h2.host_hit_len)
        assert pages.tolist() == pages_of_slots(idx, ps).tolist()
        if h1.host_hit_len:
            h1, idx = slots_cm.load_back(h1)
            h2, pages = pages_cm.load_back_pages(h2)
            assert h1.cached_len == h2.cached_len
        else:
            slots_cm.lock(h1)
            pages_cm.lock(h2)
        assert pages.tolist() == pages_of_slots(idx, ps).tolist()
        need = ids.shape[0] - h1.cached_len
        own_slots, own_pages = slots_cm.allocate(need), pages_cm.allocate_pages(need)
        assert own_pages.tolist() == pages_of_slots(own_slots, ps).tolist()
        idx, pages = torch.cat([idx, own_slots]), torch.cat([pages, own_pages])
        assert slots_of_pages(pages, ps).tolist() == idx.tolist()
        if chunked:
            h1, idx = slots_cm.cache_unfinished_req(h1, ids, idx)
            h2, pages = pages_cm.cache_unfinished_req_pages(h2, ids, pages)
            assert pages.tolist() == pages_of_slots(idx, ps).tolist()
        slots_cm.free_and_cache_finished_req(h1, ids, idx)
        pages_cm.free_and_cache_finished_req_pages(h2, ids, pages)
        if host:
            assert slots_cm.drain() == pages_cm.drain() == []
        assert state(slots_cm) == state(pages_cm)
    assert slots_cm.metrics == pages_cm.metrics
    assert pages_cm.held_pages == 0
    if host:
        assert pages_cm.tier_counters == slots_cm.tier_counters
        assert pages_cm.tier_counters.backed_up > 0


def test_an_aborted_request_gives_its_pages_back():
    cm = manager(16, False)
    pages = cm.allocate_pages(40)
    assert pages.shape[0] == 3 and cm.held_pages == 3
    cm.release_pages(pages)
    assert cm.held_pages == 0 and cm.free_pages == 32
    cm.check_integrity()


@pytest.fixture
def finished():
    """A manager with one cached 32-token prompt (page 16) and a second
    request matched, locked and holding its own pages: (cm, handle, ids, pages)."""
    cm = manager(16, False)
    ids = torch.arange(48, dtype=torch.int32)
    h, pages = cm.match_pages(ids)
    cm.lock(h)
    cm.free_and_cache_finished_req_pages(h, ids, torch.cat([pages, cm.allocate_pages(48)]))
    ids2 = torch.cat([ids[:32], torch.arange(100, 120, dtype=torch.int32)])
    h2, cached = cm.match_pages(ids2)
    cm.lock(h2)
    assert h2.cached_len == 32 and cached.shape[0] == 2
    return cm, h2, ids2, torch.cat([cached, cm.allocate_pages(20)])


@pytest.mark.parametrize(
    "bad, message",
    [
        (lambda p: p[:-1], "page_ids has length 3 but must cover"),
        (lambda p: torch.cat([p[:3], torch.tensor([32], dtype=torch.int32)]), "out of range"),
        (lambda p: torch.cat([p[:3], p[2:3]]), "page_ids"),
        (lambda p: torch.cat([p[:2], p[1:2], p[3:]]), "page_ids"),
        (lambda p: torch.cat([p[1:2], p[1:]]), "old_handle"),
    ],
    ids=["short", "out-of-range", "repeated", "cached", "not-the-match"],
)
def test_a_bad_finish_names_its_argument_and_changes_nothing(finished, bad, message):
    cm, h, ids, pages = finished
    before = state(cm)
    with pytest.raises(ValueError, match=message):
        cm.free_and_cache_finished_req_pages(h, ids, bad(pages))
    assert state(cm) == before
    cm.free_and_cache_finished_req_pages(h, ids, pages)  # the right pages still finish it
    assert cm.held_pages == 0


def test_a_refusal_names_the_entry_at_fault(finished):
    """A bad own page is named by its position in page_ids (after the
    match's pages: `page_ids[2:][1]` is page_ids[3])."""
    cm, h, ids, pages = finished
    bad = torch.cat([pages[:3], pages[:1]])  # page_ids[3] is the match's first page
    with pytest.raises(ValueError, match=r"page_ids\[2:\]\[1\] = \d+ is owned by the prefix cache"):
        cm.free_and_cache_finished_req_pages(h, ids, bad)


def test_release_refuses_cached_and_free_pages(finished):
    cm, h, ids, pages = finished
    before = state(cm)
    with pytest.raises(ValueError, match="is owned by the prefix cache"):
        cm.release_pages(pages[:1])
    with pytest.raises(ValueError, match="repeats page"):
        cm.release_pages(torch.cat([pages[2:], pages[2:3]]))
    assert state(cm) == before
    cm.release_pages(pages[2:])
    with pytest.raises(ValueError, match="is free"):
        cm.release_pages(pages[2:3])


def test_the_slot_path_refuses_a_page_that_does_not_start_at_a_multiple():
    cm = manager(16, False)
    ids = torch.arange(33, dtype=torch.int32)
    h, idx = cm.match_req(ids)
    cm.lock(h)
    own = cm.allocate(33)
    before = state(cm)
    with pytest.raises(ValueError, match="does not start a page"):
        cm.manager.tree.insert_prefix(ids, torch.arange(8, 41, dtype=torch.int32))
    assert state(cm) == before
    cm.free_and_cache_finished_req(h, ids, own)


def test_the_tree_page_forms_read_as_the_slot_forms():
    unaligned = _core.RadixTree(4)  # takes any page of consecutive slots: no page ids
    ids = torch.arange(12, dtype=torch.int32)
    pool = _core.PageAllocator(16, 4)
    for call in (  # refused even where there is nothing to do
        lambda: unaligned.evict_pages(4),
        lambda: unaligned.evict_host_pages(4),
        lambda: unaligned.start_backup_pages(ids, pool),
        lambda: unaligned.start_load_pages(unaligned.match_prefix(ids)[0], pool),
    ):
        with pytest.raises(ValueError, match="aligned"):
            call()
    unaligned.insert_prefix(ids, torch.arange(21, 33, dtype=torch.int32))
    with pytest.raises(ValueError, match="aligned"):
        unaligned.match_pages(ids)
    tree = _core.RadixTree(4, aligned_pages=True)
    assert tree.insert_prefix(ids, torch.arange(20, 32, dtype=torch.int32)) == 0
    h, pages = tree.match_pages(ids)
    assert pages.tolist() == [5, 6, 7] and h.cached_len == 12
    assert tree.handle_pages(h).tolist() == [5, 6, 7]
    assert tree.evict_pages(4).tolist() == [5, 6, 7]  # (whole nodes go)
    assert tree.match_prefix(ids)[1].tolist() == []


def test_the_naive_cache_has_no_page_path():
    cm = CacheManager(8, page_size=4, type="naive")
    with pytest.raises(TypeError, match="radix cache"):
        cm.match_pages(torch.arange(5, dtype=torch.int32))


class Recorder(EventPublisher):
    """A publisher without sockets that keeps each batch's events."""

    def __init__(self):  # no sockets
        self.data_parallel_rank = 0
        self._closed = False
        self.batches: list = []

    def _send(self, payload: bytes):
        self.batches.append(msgpack.unpackb(payload)[1])  # (without its timestamp)
        return len(self.batches) - 1


@pytest.mark.parametrize("ps", [1, 16])
def test_the_page_path_announces_the_same_kv_events(ps):
    """KV events on, both paths, host tier on: the same batches, event by
    event (stores, evictions, backups, loads, host evictions)."""
    recorders = Recorder(), Recorder()
    slots_cm, pages_cm = (
        CacheManager(
            32, page_size=ps, host_num_pages=48, write_policy="write_through", kv_events=r
        )
        for r in recorders
    )
    for ids, _ in prompts(ps, seed=3, n=120):
        h1, idx = slots_cm.match_req(ids)
        h2, pages = pages_cm.match_pages(ids)
        if h1.host_hit_len:
            h1, idx = slots_cm.load_back(h1)
            h2, pages = pages_cm.load_back_pages(h2)
        else:
            slots_cm.lock(h1)
            pages_cm.lock(h2)
        need = ids.shape[0] - h1.cached_len
        idx = torch.cat([idx, slots_cm.allocate(need)])
        pages = torch.cat([pages, pages_cm.allocate_pages(need)])
        slots_cm.free_and_cache_finished_req(h1, ids, idx)
        pages_cm.free_and_cache_finished_req_pages(h2, ids, pages)
        slots_cm.drain()
        pages_cm.drain()
    slots_cm.close()
    pages_cm.close()
    assert recorders[0].batches == recorders[1].batches
    kinds = {e[0] for batch in recorders[0].batches for e in batch}
    assert {"BlockStored", "BlockRemoved"} <= kinds
