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
from radixkv.kvcache.request_inputs import host_flat
from radixkv.scheduler import CacheManager


def manager(ps: int, host: bool) -> CacheManager:
    tiers = dict(host_num_pages=48, write_policy="write_through") if host else {}
    return CacheManager(32, page_size=ps, manual_copies=False, **tiers)


def state(cm: CacheManager):
    cm.check_integrity()
    tree = cm.manager.tree
    return (tree.dump(tiers=True), cm.free_pages, cm.held_pages, tree.tier_sizes())


def prompts(ps: int, seed: int, n: int, systems: int = 4):
    rnd = random.Random(seed)
    shared = [[rnd.randrange(50) for _ in range(rnd.randrange(1, 5) * ps)] for _ in range(systems)]
    for _ in range(n):
        own = [rnd.randrange(50) for _ in range(rnd.randrange(1, 3 * ps + 3))]
        yield torch.tensor(rnd.choice(shared) + own, dtype=torch.int32), rnd.random() < 0.3


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


@pytest.mark.parametrize("step", ["finish_request", "cache_request"])
@pytest.mark.parametrize("form", ["pages", "slots"])
def test_a_request_step_announces_its_block_stored_itself(step, form):
    """`finish_request[_pages](..., ledger, seed)` and `cache_request[_pages]`:
    the BlockStored of the whole pages the step cached come from the step
    itself, the same events as the ledger's own `device_inserted` after it
    (the chain going on from the cached page before them); a bad ledger or
    seed is refused before the step, naming it, with nothing changed."""
    by_pages = form == "pages"
    call_name = step + ("_pages" if by_pages else "")
    seed = bytes(range(32))
    ids = torch.arange(40, dtype=torch.int32)  # 2 whole pages of 16 and 8 tokens more
    ids2 = torch.cat([ids[:16], torch.arange(100, 140, dtype=torch.int32)])

    def serve(announce: bool):
        tree, pool = _core.RadixTree(16, aligned_pages=True), _core.PageAllocator(16, 16)
        # (announced through a threaded ledger, as CacheManager's is)
        ledger, events = _core.BlockLedger(16, 0, 16, threaded=announce), []
        for tokens in (ids, ids2):
            h, cached = tree.match_pages(tokens)
            tree.lock_handle(h)
            pages = torch.cat([cached, pool.allocate_pages(tokens.shape[0] - h.cached_len)])
            entries = pages if by_pages else slots_of_pages(pages, 16)
            call = getattr(tree, call_name)
            if announce:
                got = call(h, tokens, entries, pool, 0, ledger, seed)
            else:
                got = call(h, tokens, entries, pool)
            k = got if step == "finish_request" else got[2]
            if not announce:
                whole = tokens.shape[0] // 16 * 16
                ledger.device_inserted(tokens, entries, k, whole, h.cached_len, seed, by_pages)
            if step == "cache_request":  # the request goes on (its pages stay: 7 of 16)
                tree.lock_handle(got[0], unlock=True)
            events.append(ledger.take_events())
        return events, tree.dump()

    announced, dump = serve(True)
    assert (announced, dump) == serve(False)
    stored = [msgpack.unpackb(e) for batch in announced for e in batch]
    assert [(e[0], len(e[1]), len(e[3])) for e in stored] == [
        ("BlockStored", 2, 32),
        ("BlockStored", 2, 32),  # ids2: its pages 1 and 2, after the cached page 0
    ]
    assert stored[1][2] == stored[0][1][0]  # parent: the cached page's block

    tree, pool = _core.RadixTree(16, aligned_pages=True), _core.PageAllocator(16, 16)
    ledger = _core.BlockLedger(16, 0, 16)
    h, _ = tree.match_pages(ids)
    tree.lock_handle(h)
    pages = pool.allocate_pages(40)
    if not by_pages:
        pages = slots_of_pages(pages, 16)
    call = getattr(tree, call_name)
    for bad, error, message in (
        ("ledger", TypeError, "ledger must be a BlockLedger or None, got str"),
        (b"short", ValueError, "seed must be 32 bytes"),
        (7, TypeError, "seed must be bytes"),
        (_core.BlockLedger(16, 0, 4), ValueError, "ledger holds 16 device pages of 4 tokens"),
        (_core.BlockLedger(15, 0, 16), ValueError, "ledger holds 15 device pages of 16 tokens"),
    ):
        if isinstance(bad, _core.BlockLedger):
            args = (bad, seed)
        else:
            args = ("ledger", seed) if isinstance(bad, str) else (ledger, bad)
        with pytest.raises(error, match=message):
            call(h, ids, pages, pool, 0, *args)
        assert tree.num_nodes == 0 and h.lock_count == 1 and ledger.pending == 0
    with pytest.raises(ValueError, match="seed must be 32 bytes"):  # checked without a ledger too
        call(h, ids, pages, pool, 0, None, b"short")
    call(h, ids, pages, pool, 0, None, None)  # no ledger: no events
    assert tree.match_pages(ids)[0].cached_len == 32 and ledger.pending == 0


@pytest.mark.parametrize("events", [False, True], ids=["events-off", "events-on"])
def test_a_step_given_no_handle_names_old_handle(events):
    """With KV events on the step's call also takes the ledger: something
    that is not a handle is still refused by that call, naming old_handle."""
    cm = CacheManager(8, page_size=2, kv_events=Recorder() if events else None)
    ids = torch.arange(6, dtype=torch.int32)
    for call in (
        lambda: cm.free_and_cache_finished_req(None, ids, torch.arange(6, dtype=torch.int32)),
        lambda: cm.free_and_cache_finished_req_pages(None, ids, torch.arange(3, dtype=torch.int32)),
        lambda: cm.cache_unfinished_req(None, ids, torch.arange(6, dtype=torch.int32)),
        lambda: cm.cache_unfinished_req_pages(None, ids, torch.arange(3, dtype=torch.int32)),
    ):
        with pytest.raises(TypeError, match="old_handle must be a RadixCacheHandle"):
            call()
    assert cm.free_pages == 8 and cm.manager.tree.num_nodes == 0


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
        CacheManager(32, page_size=ps, host_num_pages=48, write_policy="write_through", kv_events=r)
        for r in recorders
    )
    for ids, _ in prompts(ps, seed=3, n=120):
        (h1, idx, own_slots), (h2, pages, own_pages) = admit(slots_cm, pages_cm, ids)
        slots_cm.free_and_cache_finished_req(h1, ids, torch.cat([idx, own_slots]))
        pages_cm.free_and_cache_finished_req_pages(h2, ids, torch.cat([pages, own_pages]))
        slots_cm.drain()
        pages_cm.drain()
    slots_cm.close()
    pages_cm.close()
    assert recorders[0].batches == recorders[1].batches
    kinds = {e[0] for batch in recorders[0].batches for e in batch}
    assert {"BlockStored", "BlockRemoved"} <= kinds


# --- the batch and flat steps in pages ----------------------------------------------


def admit(slots_cm: CacheManager, pages_cm: CacheManager, ids: torch.Tensor):
    """One request matched (loaded back when the host holds more), locked
    and given its own pages on both paths, which must agree:
    ((slot handle, cached slots, own slots), (page handle, cached pages, own pages))."""
    ps = slots_cm.page_size
    h1, idx = slots_cm.match_req(ids)
    h2, pages = pages_cm.match_pages(ids)
    assert (h1.cached_len, h1.host_hit_len) == (h2.cached_len, h2.host_hit_len)
    if h1.host_hit_len:
        h1, idx = slots_cm.load_back(h1)
        h2, pages = pages_cm.load_back_pages(h2)
    else:
        slots_cm.lock(h1)
        pages_cm.lock(h2)
    assert h1.cached_len == h2.cached_len
    assert pages.tolist() == pages_of_slots(idx, ps).tolist()
    need = ids.shape[0] - h1.cached_len
    own_slots, own_pages = slots_cm.allocate(need), pages_cm.allocate_pages(need)
    assert own_pages.tolist() == pages_of_slots(own_slots, ps).tolist()
    return (h1, idx, own_slots), (h2, pages, own_pages)


def finish_both(slots_cm, pages_cm, batch, ids, form: str) -> None:
    """Finishes a batch of admitted requests on both paths with `form`:
    "batch" (a list of tuples), "flat" (one tensor), "own" (flat, the
    cached parts and own pages apart)."""
    slots_side = [s for s, _ in batch]
    pages_side = [p for _, p in batch]
    priority = [i % 3 for i in range(len(batch))]
    if form == "batch":
        slots_cm.free_and_cache_finished_reqs(
            [(h, x, torch.cat([c, o])) for (h, c, o), x in zip(slots_side, ids)], priority
        )
        pages_cm.free_and_cache_finished_reqs_pages(
            [(h, x, torch.cat([c, o])) for (h, c, o), x in zip(pages_side, ids)], priority
        )
        return
    for cm, side, flat in (
        (slots_cm, slots_side, slots_cm.free_and_cache_finished_reqs_flat),
        (pages_cm, pages_side, pages_cm.free_and_cache_finished_reqs_flat_pages),
    ):
        handles = [h for h, _, _ in side]
        if form == "own":
            cached = torch.cat([c for _, c, _ in side])
            flat(handles, ids, cached, priority, own=torch.cat([o for _, _, o in side]))
        else:
            flat(handles, ids, torch.cat([torch.cat([c, o]) for _, c, o in side]), priority)


@pytest.mark.parametrize("tier", ["device", "events", "host"])
@pytest.mark.parametrize("ps", [1, 16, 512])
def test_batch_and_flat_page_steps_are_their_slot_twins_in_pages(ps, tier):
    """Rounds of 1 to 3 requests, finished by the batch, the flat and the
    flat-with-own step on both paths: the same handles, pages, trees,
    counters, metrics and KV events. `device` has no per-request tail (no
    KV events, no write_through): only held pages are counted."""
    recorders = (Recorder(), Recorder()) if tier != "device" else (None, None)
    tiers = dict(host_num_pages=48, write_policy="write_through") if tier == "host" else {}
    slots_cm, pages_cm = (
        CacheManager(32, page_size=ps, manual_copies=False, kv_events=r, **tiers) for r in recorders
    )
    requests = [ids for ids, _ in prompts(ps, seed=7 * ps + len(tier), n=150, systems=8)]
    forms = ("batch", "flat", "own")
    rnd = random.Random(ps)
    rounds = 0
    while requests:
        k = min(rnd.randrange(1, 4), len(requests))
        ids, requests = requests[:k], requests[k:]
        batch = [admit(slots_cm, pages_cm, x) for x in ids]
        assert slots_cm.held_pages == pages_cm.held_pages
        finish_both(slots_cm, pages_cm, batch, ids, forms[rounds % 3])
        rounds += 1
        for (h1, _, _), (h2, _, _) in batch:
            assert (h1.cached_len, h1.host_hit_len) == (h2.cached_len, h2.host_hit_len)
        if tier == "host":
            assert slots_cm.drain() == pages_cm.drain() == []
        assert state(slots_cm) == state(pages_cm)
        assert pages_cm.held_pages == 0
    assert slots_cm.metrics == pages_cm.metrics
    if tier == "host":
        assert pages_cm.tier_counters == slots_cm.tier_counters
        assert pages_cm.tier_counters.backed_up > 0
        assert pages_cm.tier_counters.loaded_back > 0
    slots_cm.close()
    pages_cm.close()
    if recorders[0] is not None:
        assert recorders[0].batches == recorders[1].batches
        kinds = {e[0] for batch in recorders[0].batches for e in batch}
        assert "BlockStored" in kinds


@pytest.fixture
def two_finishing():
    """A manager (page 16) with a cached 32-token prompt and two requests
    admitted on it: (cm, handles, ids, cached pages, own pages)."""
    cm = manager(16, False)
    ids = torch.arange(48, dtype=torch.int32)
    h, pages = cm.match_pages(ids)
    cm.lock(h)
    cm.free_and_cache_finished_req_pages(h, ids, torch.cat([pages, cm.allocate_pages(48)]))
    handles, ids_list, cached, own = [], [], [], []
    for start in (100, 200):
        x = torch.cat([ids[:32], torch.arange(start, start + 20, dtype=torch.int32)])
        h, c = cm.match_pages(x)
        cm.lock(h)
        handles.append(h)
        ids_list.append(x)
        cached.append(c)
        own.append(cm.allocate_pages(20))
    return cm, handles, ids_list, cached, own


def _swap_own(own):
    """Request 1's own pages with request 0's first one in: a page in two requests."""
    return [own[0], torch.cat([own[0][:1], own[1][1:]])]


def _short(own):
    return [own[0], own[1][:-1]]


def _cached_for_own(cached, own):
    """Request 1's cached part with an own page for its first: not the match's."""
    return [cached[0], torch.cat([own[1][:1], cached[1][1:]])]


@pytest.mark.parametrize(
    "form, spoil, message",
    [
        ("batch", lambda c, o: (c, _short(o)), r"batch\[1\] page_ids has length 3 but must cover"),
        ("batch", lambda c, o: (c, _swap_own(o)), r"batch\[0\] page_ids.*batch\[1\] page_ids"),
        ("batch", lambda c, o: (_cached_for_own(c, o), o), r"batch\[1\] page_ids\[:2\] must be"),
        ("flat", lambda c, o: (c, _short(o)), r"page_ids has length 7 but .* need 8 pages"),
        ("flat", lambda c, o: (c, _swap_own(o)), r"request\[\d\] page_ids"),
        ("own", lambda c, o: (c, _short(o)), r"own has length 3 but .* need 4 more pages"),
        ("own", lambda c, o: ([c[0], c[1][:1]], o), r"page_ids has length 3 but .*: 4 pages"),
        ("own", lambda c, o: (_cached_for_own(c, o), o), r"request\[1\] page_ids\[:2\] must be"),
    ],
    ids=[
        "batch-short",
        "batch-shared",
        "batch-not-the-match",
        "flat-short",
        "flat-shared",
        "own-short",
        "own-short-cached",
        "own-not-the-match",
    ],
)
def test_a_bad_page_batch_names_its_argument_and_changes_nothing(
    two_finishing, form, spoil, message
):
    cm, handles, ids, cached, own = two_finishing

    def finish(cached, own):
        if form == "batch":
            batch = [(h, x, torch.cat([c, o])) for h, x, c, o in zip(handles, ids, cached, own)]
            cm.free_and_cache_finished_reqs_pages(batch)
        elif form == "flat":
            joined = torch.cat([torch.cat([c, o]) for c, o in zip(cached, own)])
            cm.free_and_cache_finished_reqs_flat_pages(handles, ids, joined)
        else:
            cm.free_and_cache_finished_reqs_flat_pages(
                handles, ids, torch.cat(cached), own=torch.cat(own)
            )

    before = state(cm)
    with pytest.raises(ValueError, match=message):
        finish(*spoil(cached, own))
    assert state(cm) == before
    assert [h.lock_count for h in handles] == [1, 1]
    finish(cached, own)  # the right pages still finish them
    assert cm.held_pages == 0
    cm.check_integrity()


def test_the_page_batch_refuses_bad_shapes_naming_page_ids(two_finishing):
    cm, handles, ids, cached, own = two_finishing
    before = state(cm)
    with pytest.raises(TypeError, match=r"tuple \(old_handle, input_ids, page_ids\)"):
        cm.free_and_cache_finished_reqs_pages([(handles[0], ids[0])])
    with pytest.raises(TypeError, match=r"batch\[0\] page_ids"):
        cm.free_and_cache_finished_reqs_pages([(handles[0], ids[0], "pages")])
    with pytest.raises(TypeError, match=r"\bpage_ids\b"):
        cm.free_and_cache_finished_reqs_flat_pages(handles, ids, "pages")
    with pytest.raises(TypeError, match=r"\bown\b"):
        cm.free_and_cache_finished_reqs_flat_pages(handles, ids, torch.cat(cached), own="own")
    with pytest.raises(ValueError, match="input_ids has 1 entries but handles has 2"):
        cm.free_and_cache_finished_reqs_flat_pages(handles, ids[:1], torch.cat(cached))
    assert state(cm) == before


def test_the_naive_cache_and_an_unaligned_tree_have_no_page_batches():
    cm = CacheManager(8, page_size=4, type="naive")
    with pytest.raises(TypeError, match="radix cache"):
        cm.free_and_cache_finished_reqs_pages([])
    with pytest.raises(TypeError, match="radix cache"):
        cm.free_and_cache_finished_reqs_flat_pages([], [], torch.empty(0, dtype=torch.int32))
    unaligned = _core.RadixTree(4)
    pool = _core.PageAllocator(16, 4)
    none = torch.empty(0, dtype=torch.int32)
    for call in (  # refused even where there is nothing to do
        lambda: unaligned.finish_requests_pages([], pool),
        lambda: unaligned.finish_requests_flat_pages([], [], none, pool),
        lambda: unaligned.finish_requests_flat_pages([], [], none, pool, 0, none),
    ):
        with pytest.raises(ValueError, match="aligned"):
            call()
    assert unaligned.finish_requests([], pool) == []  # (the slot forms take it)
    assert unaligned.finish_requests_flat([], [], none, pool) == []


def test_the_tree_page_batches_take_page_ids():
    tree = _core.RadixTree(4, aligned_pages=True)
    pool = _core.PageAllocator(16, 4)
    ids = torch.arange(10, dtype=torch.int32)
    handles, own = [], []
    for _ in range(2):
        h, pages = tree.match_pages(ids)
        tree.lock_handle(h)
        handles.append(h)
        own.append(pool.allocate_pages(10))
    assert [p.shape[0] for p in own] == [3, 3]
    assert tree.finish_requests_flat_pages(handles, [ids, ids], torch.cat(own), pool) == [0, 8]
    h, pages = tree.match_pages(ids)
    assert h.cached_len == 8 and pages.tolist() == own[0][:2].tolist()
    assert pool.num_free_pages == 16 - 2  # (the cached pages only)
    tree.check_integrity()


def test_a_flat_step_off_the_cpu_names_its_tensor_of_slots_or_pages():
    """On a device manager the flat steps bring their tensors to the host
    first; one that cannot come is named as the step names it."""
    meta = torch.empty(0, dtype=torch.int32, device="meta")
    for name in ("indices", "page_ids"):
        with pytest.raises(TypeError, match=f"^{name} must be"):
            host_flat([], [], meta, None, torch.device("cuda"), name)
    with pytest.raises(TypeError, match="^own must be"):
        host_flat([], [], [], meta, torch.device("cuda"), "page_ids")
