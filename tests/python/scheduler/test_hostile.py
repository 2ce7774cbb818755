"""A hostile-input matrix over every public entry point (docs/api.md, "Inputs and
results", and docs/decisions.md).

One parametrized test per (entry point x kind of hostile input):

- inputs the contract accepts (any 1-D integer tensor/array/list: every integer
  dtype, strided, reversed, offset views, empty) must give exactly the result and
  the state that a contiguous int64 tensor gives on an identically built twin;
- inputs it refuses (wrong rank, non-integer dtype, a non-CPU tensor, a stride-0
  view of 2**31 elements, values outside int32, negative or out-of-range slots,
  length mismatches, bad or stale handles, bad counts, bad layer ids, mismatched
  K/V shapes and dtypes) must raise TypeError / ValueError (bad arguments) or a
  RuntimeError subclass (running out), with a message that names the argument,
  and leave the whole state exactly as it was (size_info, a full dump, the free
  list, held pages, handle lock counts, every byte of the KV pool), with
  check_integrity() passing afterwards.

The non-CPU device is stood in for by torch's "meta" device (no GPU needed).
"""

from __future__ import annotations

import resource
import time

import numpy as np
import pytest
import torch

import radixkv
from radixkv import kernel
from radixkv.kvcache import KVCacheLayout, MHAKVCache, NaiveCacheManager, RadixCacheManager
from radixkv.scheduler import CacheManager, ReqToTokenPool

pytestmark = pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")

P_VALUES = [1, 4]
OOC = radixkv.OutOfCapacityError


def seq(n, start=0):
    return list(range(start, start + n))


class raises:
    """Like pytest.raises(exc), and the message must name each of `names` (a
    string, or a tuple of strings of which one suffices). A wrong exception, a
    message that names nothing, or no exception at all fails the test with a
    one-line report (the expected and the actual exception) instead of a long
    traceback."""

    class Info:
        value = None

    def __init__(self, exc, *names):
        self.exc = exc if isinstance(exc, tuple) else (exc,)
        self.names = names

    def __enter__(self):
        self.info = raises.Info()
        return self.info

    def __exit__(self, et, ev, tb):
        __tracebackhide__ = True
        want = " or ".join(e.__name__ for e in self.exc)
        if et is None:
            pytest.fail(f"DID NOT RAISE: expected {want} naming {self.names}", pytrace=False)
        if not issubclass(et, Exception):
            return False
        if not issubclass(et, self.exc):
            pytest.fail(
                f"expected {want} naming {self.names}, got {et.__name__}: {ev}", pytrace=False
            )
        msg = str(ev)
        for name in self.names:
            options = name if isinstance(name, tuple) else (name,)
            if not any(o in msg for o in options):
                pytest.fail(f"{et.__name__} message {msg!r} does not name {name!r}", pytrace=False)
        self.info.value = ev
        return True


def norm(r):
    """A result as plain, comparable Python data."""
    if isinstance(r, torch.Tensor):
        return ("tensor", str(r.dtype), r.device.type, r.tolist())
    if isinstance(r, (tuple, list)):
        return tuple(norm(x) for x in r)
    if hasattr(r, "cached_len"):
        return ("handle", type(r).__name__, r.cached_len, getattr(r, "lock_count", None))
    return r


def as_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(torch.uint8).numpy().tobytes()


# --- the objects under test, built identically every time --------------------------------


class Scenario:
    """One entry point on a freshly built object: `call(x)` passes `x` as the
    argument under test (named `arg`), the other arguments being valid;
    `valid` is a valid value for it (a list of small non-negative ints)."""

    def __init__(self, arg, valid, call, state, integrity=lambda: None, lenient=False, empty=None):
        self.arg = arg
        self.valid = valid
        self.call = call
        self.state = state
        self.integrity = integrity
        # lenient: the entry point documents a narrower input type (the K/V store
        # takes int32/int64 torch tensors with a contiguous out_loc); an input of
        # another form may be refused with TypeError/ValueError naming the
        # argument, changing nothing, instead of being accepted.
        self.lenient = lenient
        # empty: (call taking a form-of-empty maker, expected normalized result or
        # an exception type)
        self.empty = empty


# radix / naive prefix caches


def radix_manager(p):
    """Splits, a locked path, an idle handle and a stale (evicted) handle.
    Tokens and slots are < 256 so that every unsigned dtype can hold them."""
    m = RadixCacheManager("cpu", p)
    m.insert_prefix(seq(p, 90), seq(p, 150))
    stale, _ = m.match_prefix(seq(p, 90))
    m.evict(1)
    m.insert_prefix(seq(4 * p, 10), seq(4 * p, 100))
    m.insert_prefix(seq(2 * p, 10) + seq(2 * p, 60), seq(4 * p, 200))
    locked, _ = m.match_prefix(seq(3 * p, 10))
    m.lock_handle(locked)
    idle, _ = m.match_prefix(seq(2 * p, 10) + seq(2 * p, 60))
    hs = {"locked": locked, "idle": idle, "stale": stale}
    assert not m.is_valid(stale) and m.size_info.evictable_size > 0
    return m, hs


def radix_state(m, hs):
    return (
        m.size_info,
        m.num_nodes,
        m.dump(),
        {k: (h.lock_count, h.cached_len, m.is_valid(h)) for k, h in hs.items()},
    )


def naive_manager(p):
    m = NaiveCacheManager("cpu", p)
    locked, _ = m.match_prefix(seq(3 * p, 10))
    m.lock_handle(locked)
    idle, _ = m.match_prefix(seq(3 * p, 10))
    return m, {"locked": locked, "idle": idle}


def naive_state(m, hs):
    return (m.size_info, {k: (h.lock_count, m.is_valid(h)) for k, h in hs.items()})


MATCH_IDS = lambda p: seq(p, 10) + [250, 251]  # noqa: E731  (splits a node)
INSERT_IDS = lambda p: seq(2 * p, 10) + seq(2 * p, 70)  # noqa: E731  (2p cached, 2p new)
INSERT_IDX = lambda p: seq(4 * p, 120)  # noqa: E731


def _prefix_cache(kind, p, which):
    m, hs = radix_manager(p) if kind == "radix" else naive_manager(p)
    st = (lambda: radix_state(m, hs)) if kind == "radix" else (lambda: naive_state(m, hs))
    handle_name = "RadixCacheHandle" if kind == "radix" else "NaiveCacheHandle"
    empty_match = (("handle", handle_name, 0, 0), ("tensor", "torch.int32", "cpu", []))
    if which == "match_prefix/input_ids":
        return Scenario(
            "input_ids",
            MATCH_IDS(p),
            m.match_prefix,
            st,
            m.check_integrity,
            empty=(lambda f: m.match_prefix(f([])), empty_match),
        )
    if which == "insert_prefix/input_ids":
        return Scenario(
            "input_ids",
            INSERT_IDS(p),
            lambda x: m.insert_prefix(x, INSERT_IDX(p)),
            st,
            m.check_integrity,
            empty=(lambda f: m.insert_prefix(f([]), f([])), 0),
        )
    assert which == "insert_prefix/indices"
    return Scenario(
        "indices", INSERT_IDX(p), lambda x: m.insert_prefix(INSERT_IDS(p), x), st, m.check_integrity
    )


# the scheduler's CacheManager


def _finish(cm, ids):
    h, m = cm.match_req(ids)
    cm.lock(h)
    own = cm.allocate(len(ids) - h.cached_len)
    cm.free_and_cache_finished_req(h, ids, torch.cat([m, own]))


def cache_manager(p, t):
    """16 pages; a cached prompt; an in-flight request R (locked, cached part
    2p tokens for radix, own part 2 pages with a partial last page when p > 1);
    an idle matched handle; for radix a stale handle (evicted)."""
    cm = CacheManager(16, p, t)
    hs = {}
    if t == "radix":
        _finish(cm, seq(p + 1, 200))
        stale, _ = cm.match_req(seq(p + 1, 200))
        assert stale.cached_len == p
        cm.free(cm.allocate(16 * p))  # evicts it
        assert not cm.manager.is_valid(stale)
        hs["stale"] = stale
    _finish(cm, seq(2 * p + 1, 10))
    ids = seq(2 * p, 10) + seq(p + 1, 60)
    h, m = cm.match_req(ids)
    cm.lock(h)
    idx = torch.cat([m, cm.allocate(len(ids) - h.cached_len)])
    hs["locked"] = h
    hs["idle"], _ = cm.match_req(seq(2 * p + 1, 10))
    assert h.cached_len == (2 * p if t == "radix" else 0)
    cm.check_integrity()
    return cm, hs, ids, idx


def free_list(cm):
    """The exact free list in the order it hands pages out, read by taking
    every free page and giving them back as one batch, which restores it (a
    batch comes back out in its own order)."""
    a, p = cm._pages, cm.page_size
    k = a.num_free_pages
    if k == 0:
        return []
    pages = a.allocate(k * p)
    a.free(pages)
    return (pages[::p] // p).tolist()


def cm_state(cm, hs):
    dump = cm.manager.dump() if isinstance(cm.manager, RadixCacheManager) else None
    return (
        free_list(cm),
        cm._pages.num_free_pages,
        cm.held_pages,
        cm.manager.size_info,
        dump,
        cm.available_size,
        {k: (h.lock_count, h.cached_len, cm.manager.is_valid(h)) for k, h in hs.items()},
    )


def _cache_manager(t, p, which):
    cm, hs, ids, idx = cache_manager(p, t)
    h = hs["locked"]
    st = lambda: cm_state(cm, hs)  # noqa: E731
    if which == "match_req/input_ids":
        return Scenario(
            "input_ids",
            seq(2 * p, 10) + [99, 98],
            cm.match_req,
            st,
            cm.check_integrity,
            empty=(lambda f: cm.match_req(f([])), ValueError),
        )
    if which == "free/indices":
        return Scenario(
            "indices",
            idx[h.cached_len :].tolist(),
            cm.free,
            st,
            cm.check_integrity,
            empty=(lambda f: cm.free(f([])), None),
        )
    method, arg = which.split("/")
    fn = getattr(cm, method)
    if arg == "input_ids":
        return Scenario("input_ids", list(ids), lambda x: fn(h, x, idx), st, cm.check_integrity)
    return Scenario("indices", idx.tolist(), lambda x: fn(h, ids, x), st, cm.check_integrity)


# kernels, the request table, the KV pool

FM_A = [1, 2, 3, 4, 9, 9]
FM_B = [1, 2, 3, 4, 5, 6, 7]


def _first_mismatch(which):
    if which == "a":
        return Scenario(
            "a",
            FM_A,
            lambda x: kernel.first_mismatch(x, FM_B),
            lambda: None,
            empty=(lambda f: kernel.first_mismatch(f([]), FM_B), 0),
        )
    return Scenario(
        "b",
        FM_B,
        lambda x: kernel.first_mismatch(FM_A, x),
        lambda: None,
        empty=(lambda f: kernel.first_mismatch(FM_A, f([])), 0),
    )


def req_pool():
    pool = ReqToTokenPool(4, 16)
    rows = pool.alloc(2)
    pool.write(rows[0], 0, torch.tensor([3, 1, 4]))
    pool.write(rows[1], 0, torch.tensor([9, 9, 9, 9, 9, 9]))
    free_row = sorted(set(range(4)) - set(rows))[0]
    return pool, rows, free_row


def pool_state(pool):
    return (as_bytes(pool.table), list(pool._free), list(pool._live), pool.available_size)


def _pool_write():
    pool, rows, _ = req_pool()
    return Scenario(
        "values",
        [5, 6, 7, 200],
        lambda x: pool.write(rows[1], 2, x),
        lambda: pool_state(pool),
        empty=(lambda f: pool.write(rows[1], 16, f([])), None),
    )


KV_H, KV_D, KV_L, KV_SLOTS = 2, 8, 3, 16
STORE_LOC = [1, 14, 7, 3]


def kv_pool(p):
    """16 slots, 3 layers, 2 heads of 8, float16, filled with random values;
    LayerFirst for p == 1, PageFirst otherwise."""
    layout = KVCacheLayout.LayerFirst if p == 1 else KVCacheLayout.PageFirst
    c = MHAKVCache(KV_H, KV_L, KV_D, KV_SLOTS // p, torch.float16, kv_layout=layout, page_size=p)
    g = torch.Generator().manual_seed(7)
    c.kv_buffer.copy_(torch.randn(c.kv_buffer.shape, generator=g).half())
    n = len(STORE_LOC)
    k = (torch.arange(n * KV_H * KV_D).view(n, KV_H, KV_D) % 251).half()
    v = -k
    return c, k, v


def kv_state(c):
    layers = [c.k_cache(i) for i in range(c.num_layers)] + [
        c.v_cache(i) for i in range(c.num_layers)
    ]
    return as_bytes(torch.stack(layers)), as_bytes(c.kv_buffer)


def _store(which, p):
    c, k, v = kv_pool(p)

    def call(loc, k=k, v=v):
        if which == "store_kv":
            return c.store_kv(k, v, loc, 1)
        return kernel.store_cache(c.k_cache(1), c.v_cache(1), loc, k, v)

    return Scenario(
        "out_loc",
        STORE_LOC,
        call,
        lambda: kv_state(c),
        lenient=True,
        empty=(lambda f: call(f([]), k[:0], v[:0]), None),
    )


# name -> (builder(p), whether the page size matters)
ENTRIES = {}
for _kind in ("radix", "naive"):
    for _which in ("match_prefix/input_ids", "insert_prefix/input_ids", "insert_prefix/indices"):
        ENTRIES[f"{_kind}.{_which}"] = (
            lambda p, _k=_kind, _w=_which: _prefix_cache(_k, p, _w),
            True,
        )
for _t in ("radix", "naive"):
    for _which in (
        "match_req/input_ids",
        "free/indices",
        "free_and_cache_finished_req/input_ids",
        "free_and_cache_finished_req/indices",
        "cache_unfinished_req/input_ids",
        "cache_unfinished_req/indices",
    ):
        ENTRIES[f"CacheManager[{_t}].{_which}"] = (
            lambda p, _t=_t, _w=_which: _cache_manager(_t, p, _w),
            True,
        )
ENTRIES["kernel.first_mismatch/a"] = (lambda p: _first_mismatch("a"), False)
ENTRIES["kernel.first_mismatch/b"] = (lambda p: _first_mismatch("b"), False)
ENTRIES["ReqToTokenPool.write/values"] = (lambda p: _pool_write(), False)
ENTRIES["MHAKVCache.store_kv/out_loc"] = (lambda p: _store("store_kv", p), True)
ENTRIES["kernel.store_cache/out_loc"] = (lambda p: _store("store_cache", p), True)

ENTRY_P = [
    pytest.param(e, p, id=f"{e}-p{p}")
    for e, (_, paged) in ENTRIES.items()
    for p in (P_VALUES if paged else [1])
]


def build(entry, p):
    return ENTRIES[entry][0](p)


def check_refused(s, bad, exc, lenient_exc=(TypeError, ValueError)):
    """`s.call(bad)` raises `exc` naming `s.arg`, and nothing changes."""
    before = s.state()
    with raises(lenient_exc if s.lenient else exc, s.arg):
        s.call(bad)
    assert s.state() == before
    s.integrity()


# --- valid input forms: same result and state as a contiguous int64 tensor --------------


def _interleave(values, junk):
    out = []
    for x in values:
        out += [x, junk]
    return out


VALID_FORMS = {
    "list": list,
    "tuple": tuple,
    "torch_int32": lambda v: torch.tensor(v, dtype=torch.int32),
    "torch_int16": lambda v: torch.tensor(v, dtype=torch.int16),
    "torch_uint8": lambda v: torch.tensor(v, dtype=torch.uint8),
    "torch_uint16": lambda v: torch.tensor(v, dtype=torch.int64).to(torch.uint16),
    "torch_uint32": lambda v: torch.tensor(v, dtype=torch.int64).to(torch.uint32),
    "torch_uint64": lambda v: torch.tensor(v, dtype=torch.int64).to(torch.uint64),
    # strided views whose skipped elements do not even fit in int32
    "torch_int64_step2": lambda v: torch.tensor(_interleave(v, -(2**40)), dtype=torch.int64)[::2],
    "torch_int32_step2": lambda v: torch.tensor(_interleave(v, -7), dtype=torch.int32)[::2],
    "torch_column": lambda v: torch.tensor([[x, 2**40, -1] for x in v], dtype=torch.int64)[:, 0],
    "torch_offset": lambda v: torch.tensor([2**40] + v, dtype=torch.int64)[1:],
    "numpy_int32": lambda v: np.array(v, dtype=np.int32),
    "numpy_uint8": lambda v: np.array(v, dtype=np.uint8),
    "numpy_uint16": lambda v: np.array(v, dtype=np.uint16),
    "numpy_uint32": lambda v: np.array(v, dtype=np.uint32),
    "numpy_uint64": lambda v: np.array(v, dtype=np.uint64),
    "numpy_step2": lambda v: np.array(_interleave(v, 2**40), dtype=np.int64)[::2],
    "numpy_reversed": lambda v: np.array(v[::-1], dtype=np.int64)[::-1],
    "numpy_int32_reversed": lambda v: np.array(v[::-1], dtype=np.int32)[::-1],
    "numpy_fortran_column": lambda v: np.asfortranarray(np.array([v, v], dtype=np.int64))[0],
}


@pytest.mark.parametrize("form", sorted(VALID_FORMS))
@pytest.mark.parametrize("entry, p", ENTRY_P)
def test_valid_form_same_as_int64(entry, p, form):
    ref, s = build(entry, p), build(entry, p)
    want = norm(ref.call(torch.tensor(ref.valid, dtype=torch.int64)))
    ref.integrity()
    x = VALID_FORMS[form](s.valid)
    before = s.state()
    try:
        got = s.call(x)
    except Exception as e:  # noqa: BLE001  (reported below, with the state)
        changed = s.state() != before
        if s.lenient and isinstance(e, (TypeError, ValueError)) and s.arg in str(e) and not changed:
            s.integrity()
            return  # a form the K/V store documents it does not take, refused cleanly
        pytest.fail(
            f"valid input refused: {type(e).__name__}: {e} -- and the state "
            f"{'CHANGED' if changed else 'is unchanged'}",
            pytrace=False,
        )
    assert norm(got) == want
    assert s.state() == ref.state()
    s.integrity()


EMPTY_FORMS = {
    "list": lambda v: [],
    "tuple": lambda v: (),
    "torch_int64": lambda v: torch.empty(0, dtype=torch.int64),
    "torch_int32": lambda v: torch.empty(0, dtype=torch.int32),
    "torch_uint8": lambda v: torch.empty(0, dtype=torch.uint8),
    "numpy_int64": lambda v: np.empty(0, dtype=np.int64),
    "numpy_uint64": lambda v: np.empty(0, dtype=np.uint64),
    "torch_empty_view": lambda v: torch.arange(4)[2:2],
}
ENTRY_P_EMPTY = [e for e in ENTRY_P if build(*e.values).empty is not None]


@pytest.mark.parametrize("form", sorted(EMPTY_FORMS))
@pytest.mark.parametrize("entry, p", ENTRY_P_EMPTY)
def test_empty_input(entry, p, form):
    """match of [] -> cached_len 0; insert of [] -> 0; free/write/store of
    nothing -> no change; match_req([]) -> ValueError naming input_ids."""
    s = build(entry, p)
    call, want = s.empty
    before = s.state()
    f = EMPTY_FORMS[form]
    if isinstance(want, type) and issubclass(want, Exception):
        with raises(want, s.arg):
            call(f)
    elif s.lenient:
        try:
            got = call(f)
        except (TypeError, ValueError) as e:  # a form the store does not take
            assert s.arg in str(e), str(e)
        else:
            assert norm(got) == want
    else:
        try:
            got = call(f)
        except Exception as e:  # noqa: BLE001
            pytest.fail(f"empty input refused: {type(e).__name__}: {e}", pytrace=False)
        assert norm(got) == want
    assert s.state() == before
    s.integrity()


# --- wrong rank, wrong dtype, non-CPU device, huge, outside int32 ------------------------

N = 8

WRONG_RANK = {
    "torch_0d": (lambda: torch.tensor(3), ValueError),
    "torch_0d_int32": (lambda: torch.tensor(3, dtype=torch.int32), ValueError),
    "torch_2d": (lambda: torch.arange(N).view(2, N // 2), ValueError),
    "torch_2d_one_row": (lambda: torch.arange(4).view(1, 4), ValueError),
    "torch_2d_empty": (lambda: torch.empty((0, 3), dtype=torch.int64), ValueError),
    "numpy_0d": (lambda: np.array(3), ValueError),
    "numpy_2d": (lambda: np.arange(N).reshape(N // 2, 2), ValueError),
    "list_2d": (lambda: [[0, 1], [2, 3]], (TypeError, ValueError)),
}


@pytest.mark.parametrize("kind", sorted(WRONG_RANK))
@pytest.mark.parametrize("entry, p", ENTRY_P)
def test_wrong_rank(entry, p, kind):
    make, exc = WRONG_RANK[kind]
    check_refused(build(entry, p), make(), exc)


WRONG_DTYPE = {
    "torch_float32": lambda: torch.arange(N, dtype=torch.float32),
    "torch_float64": lambda: torch.arange(N, dtype=torch.float64),
    "torch_float16": lambda: torch.arange(N, dtype=torch.float16),
    "torch_bool": lambda: torch.ones(N, dtype=torch.bool),
    "torch_complex64": lambda: torch.zeros(N, dtype=torch.complex64),
    "torch_float32_empty": lambda: torch.empty(0, dtype=torch.float32),
    "numpy_float32": lambda: np.arange(N, dtype=np.float32),
    "numpy_float64": lambda: np.arange(N, dtype=np.float64),
    "numpy_bool": lambda: np.ones(N, dtype=np.bool_),
    "numpy_complex128": lambda: np.zeros(N, dtype=np.complex128),
    "list_of_floats": lambda: [float(i) for i in range(N)],
    "list_of_bools": lambda: [True, False] * (N // 2),
}


@pytest.mark.parametrize("kind", sorted(WRONG_DTYPE))
@pytest.mark.parametrize("entry, p", ENTRY_P)
def test_wrong_dtype(entry, p, kind):
    check_refused(build(entry, p), WRONG_DTYPE[kind](), TypeError)


NON_CPU = {
    "meta_int64": lambda: torch.arange(N, device="meta"),
    "meta_empty": lambda: torch.empty(0, dtype=torch.int64, device="meta"),
}


@pytest.mark.parametrize("kind", sorted(NON_CPU))
@pytest.mark.parametrize("entry, p", ENTRY_P)
def test_non_cpu_tensor(entry, p, kind):
    """docs/decisions.md: TypeError for a CUDA or meta tensor where a CPU one is required
    (every manager here lives on the CPU)."""
    check_refused(build(entry, p), NON_CPU[kind](), TypeError, lenient_exc=TypeError)


HUGE = {
    "numpy_stride0_int32": lambda: np.broadcast_to(np.int32(1), (2**31,)),
    "numpy_stride0_int64": lambda: np.broadcast_to(np.int64(1), (2**31 + 5,)),
    "numpy_stride0_uint8": lambda: np.broadcast_to(np.uint8(1), (2**32,)),
    "torch_stride0_int32": lambda: torch.ones(1, dtype=torch.int32).expand(2**31),
    "torch_stride0_int64": lambda: torch.ones(1, dtype=torch.int64).expand(2**40),
}


@pytest.mark.parametrize("kind", sorted(HUGE))
@pytest.mark.parametrize("entry, p", ENTRY_P)
def test_huge_length(entry, p, kind):
    """A stride-0 view of 2**31 elements or more: refused by its length, with
    no huge copy and no walk over its elements (over the 2**40 view a walk
    would take hours: the bound catches one, it is no speed limit)."""
    s = build(entry, p)
    bad = HUGE[kind]()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    t0 = time.perf_counter()
    check_refused(s, bad, ValueError)
    assert time.perf_counter() - t0 < 60
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 256 * 1024


NOT_INT32 = {
    "torch_int64_2**31": (lambda: torch.tensor([1, 2, 3, 2**31]), ValueError),
    "torch_int64_-2**31-1": (lambda: torch.tensor([-(2**31) - 1, 1, 2, 3]), ValueError),
    "torch_uint32_2**31": (lambda: torch.tensor([1, 2, 2**31]).to(torch.uint32), ValueError),
    "torch_uint64_2**40": (lambda: torch.tensor([1, 2, 2**40]).to(torch.uint64), ValueError),
    "numpy_uint64_max": (lambda: np.array([1, 2, 2**64 - 1], dtype=np.uint64), ValueError),
    "numpy_uint32_max": (lambda: np.array([1, 2, 2**32 - 1], dtype=np.uint32), ValueError),
    "numpy_int64_step2": (lambda: np.array([2**40] * 8, dtype=np.int64)[::2], ValueError),
    "list_2**31": (lambda: [1, 2, 2**31], ValueError),
    "list_-2**31-1": (lambda: [1, -(2**31) - 1], ValueError),
    # huge Python ints: TypeError, ValueError or OverflowError all fit the contract
    "list_2**70": (lambda: [1, 2, 2**70], (TypeError, ValueError, OverflowError)),
    "list_-2**70": (lambda: [-(2**70), 1], (TypeError, ValueError, OverflowError)),
}


@pytest.mark.parametrize("kind", sorted(NOT_INT32))
@pytest.mark.parametrize("entry, p", ENTRY_P)
def test_values_outside_int32(entry, p, kind):
    make, exc = NOT_INT32[kind]
    check_refused(build(entry, p), make(), exc)


# --- negative and out-of-range slots, length mismatches -----------------------------------

# entry -> slot capacity (None: no upper bound short of int32)
SLOT_ENTRIES = {
    "radix.insert_prefix/indices": None,
    "naive.insert_prefix/indices": None,
    "ReqToTokenPool.write/values": None,
    "MHAKVCache.store_kv/out_loc": "pool",
    "kernel.store_cache/out_loc": "pool",
}
for _t in ("radix", "naive"):
    for _w in (
        "free/indices",
        "free_and_cache_finished_req/indices",
        "cache_unfinished_req/indices",
    ):
        SLOT_ENTRIES[f"CacheManager[{_t}].{_w}"] = "pages"


def _slot_cases(entry, p, s):
    v = list(s.valid)
    cases = {
        "negative_first": [-1] + v[1:],
        "negative_last": v[:-1] + [-(2**31)],
        "negative_middle": v[:2] + [-5] + v[3:],
    }
    cap = SLOT_ENTRIES[entry]
    if cap == "pool":
        cases["capacity_last"] = v[:-1] + [KV_SLOTS]
        cases["int32_max_last"] = v[:-1] + [2**31 - 1]
    if cap == "pages":
        # whole pages, so that only the range is wrong
        cases["negative_last_page"] = v[:-p] + seq(p, -p)
        cases["capacity_last_page"] = v[:-p] + seq(p, 16 * p)
        cases["int32_max_last_page"] = v[:-p] + seq(p, 2**31 - p)
    if entry.endswith("_req/indices") and entry.startswith("CacheManager[radix]"):
        # The request's cached part (the tree's slots, from match_req) is part of
        # `indices` too: a slot outside the pool there is bad input as well.
        cases["capacity_page_in_cached_part"] = seq(p, 16 * p) + v[p:]
        cases["int32_max_page_in_cached_part"] = seq(p, 2**31 - p) + v[p:]
    return cases


SLOT_PARAMS = [
    pytest.param(e, p, case, id=f"{e}-p{p}-{case}")
    for e in SLOT_ENTRIES
    for p in (P_VALUES if ENTRIES[e][1] else [1])
    for case in _slot_cases(e, p, build(e, p))
]


@pytest.mark.parametrize("entry, p, case", SLOT_PARAMS)
def test_bad_slot(entry, p, case):
    s = build(entry, p)
    bad = _slot_cases(entry, p, s)[case]
    if s.lenient:
        bad = torch.tensor(bad, dtype=torch.int64)
    check_refused(s, bad, ValueError, lenient_exc=ValueError)


def _length_cases(entry):
    """case -> how the valid value is changed."""
    if entry.endswith(("insert_prefix/input_ids", "insert_prefix/indices")):
        return {"one_longer": "+1", "one_shorter": "-1", "empty": "[]", "twice_as_long": "x2"}
    if entry.endswith("_req/indices"):
        return {
            "one_longer": "+1",
            "one_shorter": "-1",
            "page_longer": "+p",
            "page_shorter": "-p",
            "empty": "[]",
        }
    if entry.endswith("out_loc"):
        return {"one_longer": "+1", "one_shorter": "-1", "empty": "[]"}
    return {}


LENGTH_PARAMS = [
    pytest.param(e, p, c, id=f"{e}-p{p}-{c}")
    for e in ENTRIES
    for p in (P_VALUES if ENTRIES[e][1] else [1])
    for c in _length_cases(e)
]


@pytest.mark.parametrize("entry, p, case", LENGTH_PARAMS)
def test_length_mismatch(entry, p, case):
    """indices shorter or longer than input_ids (for a request: than its whole
    pages), out_loc shorter or longer than k: ValueError, nothing changed."""
    s = build(entry, p)
    v = list(s.valid)
    how = _length_cases(entry)[case]
    if entry.startswith(("radix", "naive")):
        extra = seq(p, 240)  # neither cached nor stored
        names = ["indices", "input_ids"]
    elif entry.startswith("CacheManager"):
        extra = seq(p, 15 * p)  # the last page of the pool
        names = [s.arg]
    else:
        extra = [0]  # a slot in range
        names = [s.arg]
    bad = {
        "+1": v + extra[:1],
        "-1": v[:-1],
        "+p": v + extra,
        "-p": v[:-p],
        "[]": [],
        "x2": v + [x + 100 for x in v],
    }[how]
    if s.lenient:
        bad = torch.tensor(bad, dtype=torch.int64)
    before = s.state()
    with raises(ValueError, *names):
        s.call(bad)
    assert s.state() == before
    s.integrity()


@pytest.mark.parametrize("p", P_VALUES)
@pytest.mark.parametrize("method", ["free_and_cache_finished_req", "cache_unfinished_req"])
def test_request_ids_shorter_than_handle(p, method):
    cm, hs, ids, idx = cache_manager(p, "radix")
    h = hs["locked"]
    c = h.cached_len
    before = cm_state(cm, hs)
    short = ids[: c - 1]
    with raises(ValueError, "old_handle"):
        getattr(cm, method)(h, short, idx[: -(-len(short) // p) * p])
    assert cm_state(cm, hs) == before
    cm.check_integrity()


# --- handles ---------------------------------------------------------------------------------


class HandleCase:
    """An entry point that takes a handle, on a freshly built object, with a twin
    manager of the same type (for a handle from another manager) and a handle of
    the other manager type."""

    def __init__(self, name, p):
        base, op = name.split(":")
        self.op = op
        if base in ("radix", "naive"):
            build_m = radix_manager if base == "radix" else naive_manager
            state_of = radix_state if base == "radix" else naive_state
            m, hs = build_m(p)
            om, ohs = build_m(p)
            self.state = lambda: state_of(m, hs)
            self.other_state = lambda: state_of(om, ohs)
            self.integrity = m.check_integrity
            self.lock = m.lock_handle
            self.reset = m.reset
            self.call = {
                "lock": lambda h: m.lock_handle(h),
                "unlock": lambda h: m.lock_handle(h, unlock=True),
            }[op]
            self.other_type = (naive_manager if base == "radix" else radix_manager)(p)[1]["locked"]
        else:
            t = base.split("[")[1].rstrip("]")
            cm, hs, ids, idx = cache_manager(p, t)
            ocm, ohs, _, _ = cache_manager(p, t)
            self.state = lambda: cm_state(cm, hs)
            self.other_state = lambda: cm_state(ocm, ohs)
            self.integrity = cm.check_integrity
            self.lock = cm.lock
            self.reset = None
            self.call = {
                "lock": cm.lock,
                "unlock": cm.unlock,
                "free_and_cache_finished_req": lambda h: cm.free_and_cache_finished_req(
                    h, ids, idx
                ),
                "cache_unfinished_req": lambda h: cm.cache_unfinished_req(h, ids, idx),
            }[op]
            self.other_type = cache_manager(p, "naive" if t == "radix" else "radix")[1]["locked"]
        self.hs = hs
        self.other = ohs["locked"]


HANDLE_ENTRIES = [f"{b}:{op}" for b in ("radix", "naive") for op in ("lock", "unlock")] + [
    f"CacheManager[{t}]:{op}"
    for t in ("radix", "naive")
    for op in ("lock", "unlock", "free_and_cache_finished_req", "cache_unfinished_req")
]

HANDLE_KINDS = {
    "none": (lambda hs, o: None, TypeError),
    "int": (lambda hs, o: 3, TypeError),
    "str": (lambda hs, o: "handle", TypeError),
    "tensor": (lambda hs, o: torch.tensor([1]), TypeError),
    "match_result_tuple": (
        lambda hs, o: (hs["idle"], torch.empty(0, dtype=torch.int32)),
        TypeError,
    ),
    "other_type_handle": (lambda hs, o: o["other_type"], (TypeError, ValueError)),
    "other_manager": (lambda hs, o: o["other"], ValueError),
    "stale_evicted": (lambda hs, o: hs["stale"], ValueError),
    "stale_after_reset": (lambda hs, o: hs["locked"], ValueError),
    "unlock_without_lock": (lambda hs, o: hs["idle"], ValueError),
    "double_unlock": (lambda hs, o: hs["idle"], ValueError),
}


def _handle_applies(entry, kind):
    base, op = entry.split(":")
    radix = base in ("radix", "CacheManager[radix]")
    unlocking = op != "lock"
    if kind == "stale_evicted":
        return radix
    if kind == "stale_after_reset":
        return base == "radix"
    if kind in ("unlock_without_lock", "double_unlock"):
        return unlocking
    return True


HANDLE_PARAMS = [
    pytest.param(e, p, k, id=f"{e}-p{p}-{k}")
    for e in HANDLE_ENTRIES
    for p in P_VALUES
    for k in HANDLE_KINDS
    if _handle_applies(e, k)
]


@pytest.mark.parametrize("entry, p, kind", HANDLE_PARAMS)
def test_bad_handle(entry, p, kind):
    c = HandleCase(entry, p)
    make, exc = HANDLE_KINDS[kind]
    h = make(c.hs, {"other": c.other, "other_type": c.other_type})
    if kind == "stale_after_reset":
        c.reset()  # every earlier handle is stale now
    if kind == "double_unlock":
        if c.op == "unlock":
            c.lock(h)
            c.call(h)  # balanced: one lock, one unlock
        else:
            h = c.hs["locked"]
            c.call(h)  # finishes (or checkpoints) the request: its handle is unlocked
        c.integrity()
    before = (c.state(), getattr(h, "lock_count", None))
    other_before = c.other_state()
    with raises(exc, "handle"):
        c.call(h)
    assert (c.state(), getattr(h, "lock_count", None)) == before
    assert c.other_state() == other_before
    c.integrity()


# --- evict ---------------------------------------------------------------------------------

EVICT_KINDS = {
    "minus_1": (lambda m: -1, ValueError),
    "minus_2**40": (lambda m: -(2**40), ValueError),
    "beyond_evictable": (lambda m: m.size_info.evictable_size + 1, OOC),
    "total_size_plus_1": (lambda m: m.size_info.total_size + 1, OOC),
    "2**62": (lambda m: 2**62, OOC),
    "2**63-1": (lambda m: 2**63 - 1, OOC),
    "2**70": (lambda m: 2**70, (ValueError, OverflowError, OOC)),
    "-2**70": (lambda m: -(2**70), (ValueError, OverflowError)),
    "True": (lambda m: True, TypeError),
    "False": (lambda m: False, TypeError),
    "float_1.0": (lambda m: 1.0, TypeError),
    "numpy_float64": (lambda m: np.float64(1.0), TypeError),
    "None": (lambda m: None, TypeError),
    "str": (lambda m: "1", TypeError),
    "list": (lambda m: [1], TypeError),
    "tensor_2_elements": (lambda m: torch.tensor([1, 2]), TypeError),
}


@pytest.mark.parametrize("kind", sorted(EVICT_KINDS))
@pytest.mark.parametrize("p", P_VALUES)
@pytest.mark.parametrize("manager", ["radix", "naive"])
def test_evict_bad_size(manager, p, kind):
    m, hs = radix_manager(p) if manager == "radix" else naive_manager(p)
    st = (lambda: radix_state(m, hs)) if manager == "radix" else (lambda: naive_state(m, hs))
    make, exc = EVICT_KINDS[kind]
    size = make(m)
    evictable = m.size_info.evictable_size
    before = st()
    names = ["size"]
    if exc is OOC:
        names += [str(size), str(evictable)]  # the error names both numbers
    with raises(exc, *names) as info:
        m.evict(size)
    if exc is OOC:
        assert isinstance(info.value, RuntimeError)
    assert st() == before
    m.check_integrity()


@pytest.mark.parametrize("p", P_VALUES)
@pytest.mark.parametrize("manager", ["radix", "naive"])
def test_evict_zero(manager, p):
    (m, hs), (twin, _) = [
        radix_manager(p) if manager == "radix" else naive_manager(p) for _ in range(2)
    ]
    got = m.evict(0)
    assert norm(got) == ("tensor", "torch.int32", "cpu", [])
    if manager == "radix":
        twin.evict(0)
        assert m.dump() == twin.dump() and m.size_info == twin.size_info
    m.check_integrity()


# --- CacheManager.allocate -------------------------------------------------------------------

ALLOC_KINDS = {
    "minus_1": (lambda cm: -1, ValueError),
    "minus_2**40": (lambda cm: -(2**40), ValueError),
    "beyond_available": (lambda cm: cm.available_size + 1, OOC),
    "all_pages_plus_1": (lambda cm: cm.num_pages * cm.page_size + 1, OOC),
    "2**62": (lambda cm: 2**62, OOC),
    "2**63-1": (lambda cm: 2**63 - 1, OOC),
    "2**70": (lambda cm: 2**70, (ValueError, OverflowError, OOC)),
    "-2**70": (lambda cm: -(2**70), (ValueError, OverflowError)),
    "None": (lambda cm: None, TypeError),
    "True": (lambda cm: True, TypeError),
    "False": (lambda cm: False, TypeError),
    "float_1.0": (lambda cm: 1.0, TypeError),
    "numpy_float64": (lambda cm: np.float64(2.0), TypeError),
    "str": (lambda cm: "1", TypeError),
    "list": (lambda cm: [1], TypeError),
}


@pytest.mark.parametrize("kind", sorted(ALLOC_KINDS))
@pytest.mark.parametrize("p", P_VALUES)
@pytest.mark.parametrize("t", ["radix", "naive"])
def test_allocate_bad_num_tokens(t, p, kind):
    """Beyond what free + evictable pages can serve: OutOfCapacityError and
    nothing evicted; bad types and values: TypeError / ValueError."""
    cm, hs, _, _ = cache_manager(p, t)
    make, exc = ALLOC_KINDS[kind]
    n = make(cm)
    before = cm_state(cm, hs)
    with raises(exc, "num_tokens") as info:
        cm.allocate(n)
    if exc is OOC:
        assert isinstance(info.value, RuntimeError)
    assert cm_state(cm, hs) == before
    cm.check_integrity()


# --- ReqToTokenPool ----------------------------------------------------------------------------

POOL_ALLOC_KINDS = {
    "minus_1": (-1, ValueError),
    "beyond_free": (3, RuntimeError),
    "2**62": (2**62, RuntimeError),
    "2**70": (2**70, (RuntimeError, ValueError, OverflowError)),
    "None": (None, TypeError),
    "True": (True, TypeError),
    "float_1.0": (1.0, TypeError),
    "str": ("1", TypeError),
}


@pytest.mark.parametrize("kind", sorted(POOL_ALLOC_KINDS))
def test_pool_alloc_bad_count(kind):
    pool, _, _ = req_pool()
    bad, exc = POOL_ALLOC_KINDS[kind]
    before = pool_state(pool)
    with raises(exc, "count"):
        pool.alloc(bad)
    assert pool_state(pool) == before


POOL_FREE_KINDS = {
    "None": (lambda r, f: None, TypeError),
    "int": (lambda r, f: r[0], TypeError),
    "numpy_0d": (lambda r, f: np.array(r[0]), (TypeError, ValueError)),
    "numpy_2d": (lambda r, f: np.array([[r[0]], [r[1]]]), (TypeError, ValueError)),
    "free_row": (lambda r, f: [f], ValueError),
    "negative_row": (lambda r, f: [-1], ValueError),
    "row_out_of_range": (lambda r, f: [4], ValueError),
    "row_2**70": (lambda r, f: [2**70], (ValueError, OverflowError)),
    "row_twice": (lambda r, f: [r[0], r[0]], ValueError),
    "good_then_bad": (lambda r, f: [r[0], 99], ValueError),
    "bool_row": (lambda r, f: [True], TypeError),
    "float_row": (lambda r, f: [float(r[0])], TypeError),
    "str": (lambda r, f: "01", TypeError),
}


@pytest.mark.parametrize("kind", sorted(POOL_FREE_KINDS))
def test_pool_free_bad_rows(kind):
    pool, rows, free_row = req_pool()
    make, exc = POOL_FREE_KINDS[kind]
    before = pool_state(pool)
    with raises(exc, "row"):
        pool.free(make(rows, free_row))
    assert pool_state(pool) == before


@pytest.mark.parametrize("form", ["list", "tuple", "numpy_int64", "numpy_uint8", "generator"])
def test_pool_free_row_forms(form):
    (pool, rows, _), (twin, trows, _) = req_pool(), req_pool()
    twin.free(list(trows))
    make = {
        "list": list,
        "tuple": tuple,
        "numpy_int64": lambda r: np.array(r, dtype=np.int64),
        "numpy_uint8": lambda r: np.array(r, dtype=np.uint8),
        "generator": lambda r: (x for x in r),
    }[form]
    pool.free(make(rows))
    assert pool_state(pool) == pool_state(twin)


POOL_WRITE_KINDS = {
    "row_negative": ("row", -1, ValueError),
    "row_free": ("row", "free", ValueError),
    "row_out_of_range": ("row", 4, ValueError),
    "row_2**70": ("row", 2**70, (ValueError, OverflowError)),
    "row_True": ("row", True, TypeError),
    "row_float": ("row", 1.0, TypeError),
    "row_None": ("row", None, TypeError),
    "row_str": ("row", "0", TypeError),
    "start_negative": ("start", -1, ValueError),
    "start_past_end": ("start", 14, ValueError),
    "start_2**70": ("start", 2**70, (ValueError, OverflowError)),
    "start_-2**70": ("start", -(2**70), (ValueError, OverflowError)),
    "start_True": ("start", True, TypeError),
    "start_float": ("start", 1.0, TypeError),
    "start_None": ("start", None, TypeError),
}


@pytest.mark.parametrize("kind", sorted(POOL_WRITE_KINDS))
def test_pool_write_bad_row_or_start(kind):
    pool, rows, free_row = req_pool()
    arg, bad, exc = POOL_WRITE_KINDS[kind]
    if bad == "free":
        bad = free_row
    args = {"row": rows[1], "start": 2, "values": torch.tensor([5, 6, 7, 8])}
    args[arg] = bad
    before = pool_state(pool)
    with raises(exc, arg):
        pool.write(**args)
    assert pool_state(pool) == before


# --- the K/V store: shapes, dtypes, devices of k, v and the caches ---------------------------

STORE_BAD = {
    # name: (replacements given (c, k, v), exception, argument the message must name)
    "v_shape_differs_from_k": (lambda c, k, v: dict(v=v[:, :1]), ValueError, "v"),
    "k_wrong_heads": (lambda c, k, v: dict(k=k[:, :1]), ValueError, "k"),
    "k_and_v_wrong_heads": (lambda c, k, v: dict(k=k[:, :1], v=v[:, :1]), ValueError, "k"),
    "k_too_many_heads": (
        lambda c, k, v: dict(k=torch.cat([k, k], 1), v=torch.cat([v, v], 1)),
        ValueError,
        "k",
    ),
    "k_wrong_head_dim": (lambda c, k, v: dict(k=k[..., :4].contiguous()), ValueError, "k"),
    "v_wrong_head_dim": (lambda c, k, v: dict(v=torch.cat([v, v], 2)), ValueError, "v"),
    "k_rank_2": (lambda c, k, v: dict(k=k.reshape(4, -1)), ValueError, "k"),
    "k_rank_4": (lambda c, k, v: dict(k=k.unsqueeze(1)), ValueError, "k"),
    "k_0d": (lambda c, k, v: dict(k=torch.tensor(1.0, dtype=torch.float16)), ValueError, "k"),
    "v_fewer_tokens": (lambda c, k, v: dict(v=v[:3]), ValueError, "v"),
    "k_fewer_tokens": (lambda c, k, v: dict(k=k[:3]), ValueError, "k"),
    "k_float32": (lambda c, k, v: dict(k=k.float()), TypeError, "k"),
    "v_float32": (lambda c, k, v: dict(v=v.float()), TypeError, "v"),
    "k_and_v_float32": (lambda c, k, v: dict(k=k.float(), v=v.float()), TypeError, "k"),
    "k_float64": (lambda c, k, v: dict(k=k.double()), TypeError, "k"),
    "v_bfloat16": (lambda c, k, v: dict(v=v.bfloat16()), TypeError, "v"),
    "k_int16_same_width": (lambda c, k, v: dict(k=k.view(torch.int16)), TypeError, "k"),
    "k_int32": (lambda c, k, v: dict(k=k.int()), TypeError, "k"),
    "k_bool": (lambda c, k, v: dict(k=k.bool()), TypeError, "k"),
    "k_meta": (lambda c, k, v: dict(k=k.to("meta")), TypeError, "k"),
    "v_meta": (lambda c, k, v: dict(v=v.to("meta")), TypeError, "v"),
    "k_list": (lambda c, k, v: dict(k=k.tolist()), TypeError, "k"),
    "v_numpy": (lambda c, k, v: dict(v=v.numpy()), TypeError, "v"),
    "k_None": (lambda c, k, v: dict(k=None), TypeError, "k"),
    "k_last_dim_strided": (lambda c, k, v: dict(k=torch.cat([k, k], 2)[..., ::2]), ValueError, "k"),
    "out_loc_None": (lambda c, k, v: dict(out_loc=None), TypeError, "out_loc"),
    "out_loc_float": (
        lambda c, k, v: dict(out_loc=torch.tensor(STORE_LOC).float()),
        TypeError,
        "out_loc",
    ),
    "out_loc_repeats": (
        lambda c, k, v: dict(out_loc=torch.tensor(STORE_LOC[:-1] + STORE_LOC[:1])),
        ValueError,
        "out_loc",
    ),
    "k_neg_view": (lambda c, k, v: dict(k=torch._neg_view(k)), ValueError, "k"),
    # conj().imag of a complex tensor is a lazy negation too
    "v_conj_imag": (
        lambda c, k, v: dict(v=torch.complex(v.float(), v.float()).conj().imag),
        ValueError,
        "v",
    ),
}
STORE_CACHE_BAD = {
    "k_cache_meta": (lambda c, k, v: dict(k_cache=c.k_cache(1).to("meta")), TypeError, "k_cache"),
    "v_cache_meta": (lambda c, k, v: dict(v_cache=c.v_cache(1).to("meta")), TypeError, "v_cache"),
    "v_cache_other_shape": (lambda c, k, v: dict(v_cache=c.v_cache(1)[:1]), ValueError, "v_cache"),
    "v_cache_float32": (lambda c, k, v: dict(v_cache=c.v_cache(1).float()), TypeError, "v_cache"),
    "k_cache_2d": (lambda c, k, v: dict(k_cache=c.kv_buffer.view(16, -1)), ValueError, "k_cache"),
    "k_cache_numpy": (lambda c, k, v: dict(k_cache=c.k_cache(1).numpy()), TypeError, "k_cache"),
    "k_cache_neg_view": (
        lambda c, k, v: dict(k_cache=torch._neg_view(c.k_cache(1))),
        ValueError,
        "k_cache",
    ),
    "v_cache_requires_grad": (
        lambda c, k, v: dict(v_cache=c.v_cache(1).clone().requires_grad_()),
        ValueError,
        "v_cache",
    ),
    "k_cache_complex": (
        lambda c, k, v: dict(
            k_cache=torch.zeros(c.k_cache(1).shape[:-1] + (4,), dtype=torch.complex64),
            v_cache=torch.zeros(c.k_cache(1).shape[:-1] + (4,), dtype=torch.complex64),
        ),
        TypeError,
        "k_cache",
    ),
}
STORE_PARAMS = [
    pytest.param(e, p, case, id=f"{e}-p{p}-{case}")
    for e in ("store_kv", "store_cache")
    for p in P_VALUES
    for case in sorted(STORE_BAD) + (sorted(STORE_CACHE_BAD) if e == "store_cache" else [])
]


@pytest.mark.parametrize("entry", ["store_kv", "store_cache"])
@pytest.mark.parametrize("p", P_VALUES)
@pytest.mark.parametrize("form", ["list", "numpy", "int16", "uint8", "strided"])
def test_store_takes_any_integer_out_loc_on_cpu(entry, p, form):
    """On the CPU, out_loc is read like every other index input (docs/api.md): any
    1-D integer tensor, NumPy array or list, all storing the same rows."""
    c, k, v = kv_pool(p)
    ref, _, _ = kv_pool(p)
    loc = {
        "list": list(STORE_LOC),
        "numpy": np.array(STORE_LOC),
        "int16": torch.tensor(STORE_LOC, dtype=torch.int16),
        "uint8": torch.tensor(STORE_LOC, dtype=torch.uint8),
        "strided": torch.tensor([x for s in STORE_LOC for x in (s, -9)])[::2],
    }[form]
    ref.store_kv(k, v, torch.tensor(STORE_LOC), 1)
    if entry == "store_kv":
        c.store_kv(k, v, loc, 1)
    else:
        kernel.store_cache(c.k_cache(1), c.v_cache(1), loc, k, v)
    assert kv_state(c) == kv_state(ref)


@pytest.mark.parametrize("entry, p, case", STORE_PARAMS)
def test_store_bad_tensors(entry, p, case):
    c, k, v = kv_pool(p)
    make, exc, name = {**STORE_BAD, **STORE_CACHE_BAD}[case]
    args = dict(
        k_cache=c.k_cache(1), v_cache=c.v_cache(1), out_loc=torch.tensor(STORE_LOC), k=k, v=v
    )
    args.update(make(c, k, v))
    before = kv_state(c)
    with raises(exc, name):
        if entry == "store_kv":
            c.store_kv(args["k"], args["v"], args["out_loc"], 1)
        else:
            kernel.store_cache(**args)
    assert kv_state(c) == before


LAYER_KINDS = {
    "num_layers": (KV_L, ValueError),
    "minus_1": (-1, ValueError),
    "minus_num_layers": (-KV_L, ValueError),
    "2**70": (2**70, (ValueError, OverflowError)),
    "-2**70": (-(2**70), (ValueError, OverflowError)),
    "numpy_int64_num_layers": (np.int64(KV_L), ValueError),
    "torch_int_num_layers": (torch.tensor(KV_L), ValueError),
    "True": (True, TypeError),
    "False": (False, TypeError),
    "float_1.0": (1.0, TypeError),
    "numpy_float64": (np.float64(1.0), TypeError),
    "numpy_bool": (np.bool_(True), TypeError),
    "torch_float": (torch.tensor(1.0), TypeError),
    "torch_2_elements": (torch.tensor([0, 1]), TypeError),
    "str": ("0", TypeError),
    "None": (None, TypeError),
}
LAYER_ENTRIES = {"store_kv": "layer_id", "k_cache": "index", "v_cache": "index"}


@pytest.mark.parametrize("kind", sorted(LAYER_KINDS))
@pytest.mark.parametrize("p", P_VALUES)
@pytest.mark.parametrize("entry", sorted(LAYER_ENTRIES))
def test_bad_layer(entry, p, kind):
    c, k, v = kv_pool(p)
    bad, exc = LAYER_KINDS[kind]
    before = kv_state(c)
    with raises(exc, LAYER_ENTRIES[entry]):
        if entry == "store_kv":
            c.store_kv(k, v, torch.tensor(STORE_LOC), bad)
        else:
            getattr(c, entry)(bad)
    assert kv_state(c) == before


@pytest.mark.parametrize("form", ["numpy_int64", "numpy_uint8", "torch_0d"])
@pytest.mark.parametrize("entry", sorted(LAYER_ENTRIES))
def test_layer_integer_forms(entry, form):
    (c, k, v), (twin, _, _) = kv_pool(4), kv_pool(4)
    layer = {"numpy_int64": np.int64(2), "numpy_uint8": np.uint8(2), "torch_0d": torch.tensor(2)}[
        form
    ]
    if entry == "store_kv":
        c.store_kv(k, v, torch.tensor(STORE_LOC), layer)
        twin.store_kv(k, v, torch.tensor(STORE_LOC), 2)
        assert kv_state(c) == kv_state(twin)
    else:
        got, want = getattr(c, entry)(layer), getattr(c, entry)(2)
        assert (got.data_ptr(), got.shape, got.stride()) == (
            want.data_ptr(),
            want.shape,
            want.stride(),
        )


# --- first_mismatch_batched --------------------------------------------------------------------

FMB_Q = [1, 2, 3, 4, 5, 6, 7, 8]
FMB_KEYS = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 0, 4, 5, 6, 7, 8], [9, 2, 3, 4, 5, 6, 7, 8]]


def _fmb_args():
    return dict(
        query=torch.tensor(FMB_Q, dtype=torch.int32),
        keys=torch.tensor(FMB_KEYS, dtype=torch.int32),
        key_lens=torch.tensor([8, 8, 8], dtype=torch.int32),
        out=torch.full((3,), -5, dtype=torch.int32),
    )


FMB_BAD = {
    "query_int64": (lambda a: dict(query=a["query"].long()), TypeError, "query"),
    "query_float32": (lambda a: dict(query=a["query"].float()), TypeError, "query"),
    "query_2d": (lambda a: dict(query=a["query"].view(2, 4)), ValueError, "query"),
    "query_0d": (lambda a: dict(query=a["query"][0]), ValueError, "query"),
    "query_list": (lambda a: dict(query=list(FMB_Q)), TypeError, "query"),
    "query_numpy": (lambda a: dict(query=np.array(FMB_Q, dtype=np.int32)), TypeError, "query"),
    "query_meta": (lambda a: dict(query=a["query"].to("meta")), TypeError, "query"),
    "query_stride0_huge": (lambda a: dict(query=a["query"][:1].expand(2**31)), ValueError, "query"),
    "keys_int64": (lambda a: dict(keys=a["keys"].long()), TypeError, "keys"),
    "keys_float32": (lambda a: dict(keys=a["keys"].float()), TypeError, "keys"),
    "keys_1d": (lambda a: dict(keys=a["keys"][0]), ValueError, "keys"),
    "keys_3d": (lambda a: dict(keys=a["keys"].unsqueeze(0)), ValueError, "keys"),
    "keys_meta": (lambda a: dict(keys=a["keys"].to("meta")), TypeError, "keys"),
    "keys_list": (lambda a: dict(keys=FMB_KEYS), TypeError, "keys"),
    "key_lens_float32": (lambda a: dict(key_lens=a["key_lens"].float()), TypeError, "key_lens"),
    "key_lens_short": (lambda a: dict(key_lens=a["key_lens"][:2]), ValueError, "key_lens"),
    "key_lens_2d": (lambda a: dict(key_lens=a["key_lens"].view(3, 1)), ValueError, "key_lens"),
    "key_lens_meta": (lambda a: dict(key_lens=a["key_lens"].to("meta")), TypeError, "key_lens"),
    "key_lens_negative": (
        lambda a: dict(key_lens=torch.tensor([8, -1, 8])),
        ValueError,
        "key_lens",
    ),
    "key_lens_beyond_L": (lambda a: dict(key_lens=torch.tensor([8, 9, 8])), ValueError, "key_lens"),
    "key_lens_2**40": (
        lambda a: dict(key_lens=torch.tensor([8, 2**40, 8])),
        ValueError,
        "key_lens",
    ),
    "out_int64": (lambda a: dict(out=torch.full((3,), -5, dtype=torch.int64)), TypeError, "out"),
    "out_short": (lambda a: dict(out=a["out"][:2]), ValueError, "out"),
    "out_2d": (lambda a: dict(out=a["out"].view(3, 1)), ValueError, "out"),
    "out_meta": (lambda a: dict(out=a["out"].to("meta")), TypeError, "out"),
}


@pytest.mark.parametrize("kind", sorted(FMB_BAD))
def test_first_mismatch_batched_bad(kind):
    """query/keys/key_lens/out of the wrong type, dtype, rank, length or device
    (all must be on one device): TypeError / ValueError naming the argument, and
    nothing written to `out`."""
    args = _fmb_args()
    make, exc, name = FMB_BAD[kind]
    args.update(make(args))
    out_before = args["out"].tolist() if args["out"].device.type == "cpu" else None
    with raises(exc, name):
        kernel.first_mismatch_batched(**args)
    if out_before is not None:
        assert args["out"].tolist() == out_before


# -- regressions from review --------------------------------------------------


def test_rejected_buffer_input_releases_its_export():
    import array

    from radixkv.kvcache import RadixCacheManager

    buf = array.array("d", [1.0, 2.0])
    with pytest.raises(TypeError, match="input_ids"):
        RadixCacheManager().match_prefix(buf)
    buf.append(3.0)  # a leaked buffer export would make this raise BufferError


def test_list_changed_by_index_during_conversion_is_read_from_a_snapshot():
    from radixkv.kvcache import RadixCacheManager

    ids = [1, 2, 3]

    class Shrinks:
        def __index__(self):
            ids.clear()
            return 7

    ids.insert(1, Shrinks())
    handle, indices = RadixCacheManager().match_prefix(ids)
    assert handle.cached_len == 0 and indices.numel() == 0


SUBCLASS_QUERY_FREES = """
import sys, torch
from radixkv.scheduler import CacheManager
call, n = sys.argv[1], 1 << 20  # 4 MiB: a freed block goes back to the system
cm = CacheManager(num_pages=4 * n, page_size=1)
victim = torch.arange(n, dtype=torch.int32)

class Evil(torch.Tensor):
    def is_neg(self):
        victim.set_(torch.arange(n, dtype=torch.int32))  # the old storage is freed
        return False

def evil(t):
    return torch.Tensor._make_subclass(Evil, t)

if call == "insert":  # two views of one call (FinishViews)
    m = cm.manager
    m.insert_prefix(victim, evil(torch.arange(n, dtype=torch.int32)))
    print([t for row in m.tree.dump() for t in row.tokens] == list(range(n)))
    sys.exit()
if call == "match_batch":
    h, cached = cm.match_req(torch.arange(n + 1))
    cm.lock(h)
    cm.free_and_cache_finished_req(h, torch.arange(n + 1), cm.allocate(n + 1))
    (h, _), (h2, _) = cm.match_req_batch([victim, evil(torch.arange(n))])
    print(h.cached_len == h2.cached_len == n - 1)
    sys.exit()
h, cached = cm.match_req(victim)
cm.lock(h)
own = cm.allocate(n)
if call == "finish_batch":
    cm.free_and_cache_finished_reqs([(h, victim, evil(own))])
elif call == "finish_flat":
    cm.free_and_cache_finished_reqs_flat([h], [victim], evil(own))
else:
    cm.free_and_cache_finished_reqs_flat([h], [victim], cached, own=evil(own))
cm.check_integrity()
print([t for row in cm.manager.tree.dump() for t in row.tokens] == list(range(n)))
"""


@pytest.mark.parametrize(
    "call", ["insert", "match_batch", "finish_batch", "finish_flat", "finish_flat_own"]
)
def test_a_subclass_query_that_frees_an_earlier_argument_is_run_before_any_is_read(call):
    """A tensor subclass's `is_neg` (asked while a call's arguments are read)
    replaces the storage of an argument read before it, and the old storage
    goes back to the system: every such query runs before any argument's
    memory is borrowed, so the call reads the replacement (reading the freed
    memory would crash, or cache what the memory holds then). In a process of
    its own, so a crash fails this test alone."""
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-c", SUBCLASS_QUERY_FREES, call],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0 and run.stdout.strip() == "True", (
        run.returncode,
        run.stderr[-2000:],
    )


def test_cached_part_of_indices_must_be_the_caches_own_slots():
    from radixkv.scheduler import CacheManager

    cm = CacheManager(16, page_size=1)
    first = [1, 2, 3, 4]
    h, c = cm.match_req(first)
    cm.lock(h)
    cm.free_and_cache_finished_req(h, first, torch.cat([c, cm.allocate(4)]))
    h, c = cm.match_req(first + [5])
    cm.lock(h)
    assert h.cached_len == 4
    own = cm.allocate(1)
    free_pages = sorted(set(range(16)) - set(c.tolist()) - set(own.tolist()))
    forged = torch.tensor(free_pages[:4] + own.tolist(), dtype=torch.int32)
    before = (cm._pages.num_free_pages, cm.held_pages, cm.manager.dump())
    with pytest.raises(ValueError, match="indices"):
        cm.free_and_cache_finished_req(h, first + [5], forged)
    assert (cm._pages.num_free_pages, cm.held_pages, cm.manager.dump()) == before
    cm.free_and_cache_finished_req(h, first + [5], torch.cat([c, own]))
    cm.check_integrity()
