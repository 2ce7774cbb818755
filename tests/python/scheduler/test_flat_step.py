"""A scheduler step in flat tensors: `match_req_batch(flat=True)`,
`allocate_batch(flat=True)` and `free_and_cache_finished_reqs_flat` (with the
requests' slots in one tensor, or their cached parts and own pages as the
two calls return them). A flat step is exactly its requests one by one (tree,
free pages, held pages, events, backups); a bad request is named by its place
and changes nothing."""

import pytest
import torch

from radixkv.scheduler import CacheManager
from test_request_batch import _Keep, admitted, one_by_one, prompts, state


def manager(kind, page, tiers, events=None):
    kw = dict(host_num_pages=1024, write_policy="write_through") if tiers else {}
    return CacheManager(num_pages=1024, page_size=page, type=kind, kv_events=events, **kw)


def flat_step(cm, batch, joined):
    handles, cached = cm.match_req_batch(batch, flat=True)
    for h in handles:
        cm.lock(h)
    own = cm.allocate_batch([len(ids) - h.cached_len for ids, h in zip(batch, handles)], flat=True)
    priority = [i % 3 for i in range(len(batch))]
    if joined:  # as gathered from a request-to-token table
        parts = []
        at_cached = at_own = 0
        for ids, h in zip(batch, handles):
            rest = -(-len(ids) // cm.page_size) * cm.page_size - h.cached_len
            parts += [cached[at_cached : at_cached + h.cached_len], own[at_own : at_own + rest]]
            at_cached += h.cached_len
            at_own += rest
        cm.free_and_cache_finished_reqs_flat(handles, batch, torch.cat(parts), priority)
    else:
        cm.free_and_cache_finished_reqs_flat(handles, batch, cached, priority, own=own)


@pytest.mark.parametrize("page", [1, 4, 16])
@pytest.mark.parametrize("kind, tiers", [("radix", False), ("radix", True), ("naive", False)])
def test_a_flat_step_is_its_requests_one_by_one(kind, page, tiers):
    ev_one, ev_flat = (_Keep(), _Keep()) if kind == "radix" else (None, None)
    one = manager(kind, page, tiers, ev_one)
    flat = manager(kind, page, tiers, ev_flat)
    for step in range(6):
        batch = prompts(step, 7, page)
        if step == 3:
            batch = [x.tolist() for x in batch]  # lists are inputs too
        one_by_one(one, batch)
        flat_step(flat, batch, joined=step % 2 == 1)
        one.drain()
        flat.drain()
        assert state(flat) == state(one)
        assert flat.held_pages == one.held_pages == 0
    one.check_integrity()
    flat.check_integrity()
    if kind == "radix":
        assert ev_flat.batches == ev_one.batches and ev_one.batches


@pytest.mark.parametrize("page", [1, 16])
def test_flat_match_and_allocation_are_the_list_forms_joined(page):
    cm = manager("radix", page, False)
    cm.free_and_cache_finished_reqs(admitted(cm, prompts(1, 6, page)))
    batch = prompts(2, 5, page)
    listed = cm.match_req_batch(batch)
    handles, joined = cm.match_req_batch(batch, flat=True)
    assert [h.cached_len for h in handles] == [h.cached_len for h, _ in listed]
    assert torch.equal(joined, torch.cat([idx for _, idx in listed]))
    assert joined.dtype == torch.int32
    # A named namespace takes the checked path: the same result, joined.
    spaces = ["a", None, "a", "b", None]
    listed = cm.match_req_batch(batch, namespace=spaces)
    handles, joined = cm.match_req_batch(batch, namespace=spaces, flat=True)
    assert [h.cached_len for h in handles] == [h.cached_len for h, _ in listed]
    assert torch.equal(joined, torch.cat([idx for _, idx in listed]))
    handles, joined = cm.match_req_batch([], flat=True)
    assert handles == [] and joined.shape == (0,) and joined.dtype == torch.int32
    with pytest.raises(ValueError, match=r"batch\[1\] must hold at least one token"):
        cm.match_req_batch([[1, 2], []], flat=True)
    free = cm.free_pages
    own = cm.allocate_batch([page + 1, 0, 1], flat=True)
    assert own.shape == (3 * page,) and len(set(own.tolist())) == 3 * page
    assert cm.free_pages == free - 3 and cm.held_pages == 3
    cm.free(own)
    assert cm.allocate_batch([], flat=True).shape == (0,)
    cm.check_integrity()


def test_a_bad_flat_request_names_its_place_and_changes_nothing():
    cm = manager("radix", 4, False)
    cm.free_and_cache_finished_reqs(admitted(cm, [torch.arange(8)]))
    batch = [torch.arange(10), torch.arange(50, 55)]
    handles, cached = cm.match_req_batch(batch, flat=True)
    for h in handles:
        cm.lock(h)
    own = cm.allocate_batch([10 - handles[0].cached_len, 5], flat=True)
    h0, h1 = handles
    assert (h0.cached_len, h1.cached_len) == (8, 0)
    full = torch.cat([cached, own])  # request 0: 8 cached + 4 own; request 1: 8 own
    before = (state(cm), cm.held_pages)
    stolen = full.clone()
    stolen[12:16] = full[8:12]  # request 1 claims request 0's own page
    cases = [
        (("x", batch, full), {}, TypeError, "handles must be a list or tuple"),
        ((handles, batch[0], full), {}, TypeError, "input_ids must be a list or tuple"),
        ((handles, batch[:1], full), {}, ValueError, "input_ids has 1 entries but handles has 2"),
        ((handles, batch, full[:-4]), {}, ValueError, "indices has length 16 but"),
        ((handles, batch, stolen), {}, ValueError, "request[0] indices and request[1] indices"),
        (
            ([h0, h0], [batch[0], batch[0]], torch.cat([full[:12], full[:12]])),
            {},
            ValueError,
            "appears 2 times in the batch but holds 1 locks",
        ),
        (([h0, 7], batch, full), {}, TypeError, "handles[1] must be a RadixCacheHandle"),
        ((handles, [batch[0], [1.5]], full), {}, TypeError, "input_ids[1]"),
        ((handles, batch, full.flip(0)), {}, ValueError, "request[0] indices[:8] must be"),
        ((handles, batch, cached), {"own": own[:-1]}, ValueError, "own has length 11 but"),
        (
            (handles, batch, cached[:4]),
            {"own": own},
            ValueError,
            "indices has length 4 but with own",
        ),
        ((handles, batch, full), {"priority": [0]}, ValueError, "priority has 1 entries"),
        ((handles, [batch[0], batch[1].to("meta")], full), {}, TypeError, "input_ids[1]"),
        ((handles, batch, full.to(torch.float32)), {}, TypeError, "indices"),
    ]
    for args, kw, error, says in cases:
        with pytest.raises(error) as e:
            cm.free_and_cache_finished_reqs_flat(*args, **kw)
        assert says in str(e.value), str(e.value)
        assert (state(cm), cm.held_pages) == before
        assert h0.lock_count == 1 and h1.lock_count == 1
    # The tree's own call refuses a handle that covers more than its request.
    tree = cm.manager.tree
    with pytest.raises(ValueError, match=r"request\[0\] old_handle covers 8 tokens but"):
        tree.finish_requests_flat([h0], [batch[0][:3]], cached, cm._pages, 0, own[:0])
    assert (state(cm), cm.held_pages) == before
    cm.free_and_cache_finished_reqs_flat(handles, batch, cached, own=own)
    assert h0.lock_count == 0 and h1.lock_count == 0 and cm.held_pages == 0
    # Cached: the seed's 2 pages and request 1's whole page; the partial pages went back.
    assert cm.free_pages == 1024 - 3
    cm.check_integrity()


def test_the_flat_finish_waits_for_loads_as_the_batch_finish_does():
    cm = CacheManager(num_pages=16, page_size=4, host_num_pages=64, write_policy="write_through")
    cm.free_and_cache_finished_reqs(admitted(cm, [torch.arange(40)]))
    cm.drain()
    cm.make_room(64)  # everything cached goes host only
    assert cm.host_size_info.host_only == 40
    h, _ = cm.match_req(torch.arange(41))
    loaded, idx = cm.load_back(h)
    assert loaded.cached_len == 40
    own = cm.allocate(1)
    cm.free_and_cache_finished_reqs_flat([loaded], [torch.arange(41)], torch.cat([idx, own]))
    assert cm.held_pages == 0 and cm.metrics.loaded_back_tokens == 40
    cm.check_integrity()


@pytest.mark.parametrize("flat", [False, True])
def test_a_naive_batch_is_checked_together_before_any_request_finishes(flat):
    cm = CacheManager(num_pages=64, page_size=4, type="naive")
    batch = [torch.arange(8), torch.arange(20, 26)]
    held = admitted(cm, batch)
    (h0, _, idx0), (h1, _, idx1) = held
    stolen = idx1.clone()
    stolen[:4] = idx0[:4]  # request 1 claims request 0's first page
    what = "request" if flat else "batch"
    before = (cm.free_pages, cm.held_pages, h0.lock_count, h1.lock_count)

    def finish(indices, priority=0):
        if flat:
            cm.free_and_cache_finished_reqs_flat([h0, h1], batch, torch.cat(indices), priority)
        else:
            items = [(h, ids, i) for h, ids, i in zip((h0, h1), batch, indices)]
            cm.free_and_cache_finished_reqs(items, priority)

    with pytest.raises(ValueError) as e:
        finish([idx0, stolen])
    assert f"{what}[0] indices and {what}[1] indices both hold page" in str(e.value), str(e.value)
    assert (cm.free_pages, cm.held_pages, h0.lock_count, h1.lock_count) == before
    with pytest.raises(ValueError, match=rf"{what}\[1\] priority must fit int32"):
        finish([idx0, idx1], priority=[0, 2**33])
    assert (cm.free_pages, cm.held_pages, h0.lock_count, h1.lock_count) == before
    finish([idx0, idx1])
    assert cm.held_pages == 0 and cm.free_pages == 64
    cm.check_integrity()
