"""Unit tests of radixkv.kvcache's cache managers, one behaviour at a time."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import radixkv
from reference import canonical
from radixkv.kvcache import (
    BaseCacheHandle,
    BaseCacheManager,
    NaiveCacheManager,
    RadixCacheManager,
    SizeInfo,
    create_cache_manager,
)

PAGE_SIZES = [1, 2, 4, 16]


def assert_i32(t, expected):
    """`t` is a 1-D int32 CPU torch tensor holding `expected`."""
    assert isinstance(t, torch.Tensor)
    assert t.dtype == torch.int32
    assert t.dim() == 1
    assert t.device.type == "cpu"
    assert t.tolist() == list(expected)


def rd(n, p):
    return n - n % p


def seq(n, start=0):
    return list(range(start, start + n))


@pytest.fixture(params=PAGE_SIZES, ids=lambda p: f"page{p}")
def P(request):
    return request.param


def radix(p):
    return create_cache_manager("cpu", "radix", p)


# --- factory and types -------------------------------------------------------


@pytest.mark.parametrize("kind, cls", [("radix", RadixCacheManager), ("naive", NaiveCacheManager)])
def test_create_cache_manager(kind, cls, P):
    m = create_cache_manager("cpu", kind, P)
    assert type(m) is cls
    assert isinstance(m, BaseCacheManager)
    assert m.page_size == P
    assert m.device == torch.device("cpu")
    assert m.size_info == SizeInfo(0, 0)
    m.check_integrity()


def test_create_cache_manager_default_page_size():
    assert create_cache_manager("cpu", "radix").page_size == 1
    assert create_cache_manager(torch.device("cpu"), "naive").page_size == 1


@pytest.mark.parametrize("kind", ["lru", "", "Radix", None, 3])
def test_create_cache_manager_unknown_type(kind):
    with pytest.raises(ValueError, match="type"):
        create_cache_manager("cpu", kind)


@pytest.mark.parametrize("kind", ["radix", "naive"])
@pytest.mark.parametrize(
    "bad, exc",
    [(0, ValueError), (-4, ValueError), (2.0, TypeError), (True, TypeError), ("4", TypeError)],
)
def test_bad_page_size(kind, bad, exc):
    with pytest.raises(exc, match="page_size"):
        create_cache_manager("cpu", kind, bad)


def test_size_info():
    s = SizeInfo(3, 4)
    assert s.evictable_size == 3 and s.protected_size == 4
    assert s.total_size == 7
    assert SizeInfo(0, 0).total_size == 0
    assert tuple(s) == (3, 4)


def test_size_info_of_manager(P):
    m = radix(P)
    m.insert_prefix(seq(3 * P), seq(3 * P, 100))
    h, _ = m.match_prefix(seq(P))
    m.lock_handle(h)
    info = m.size_info
    assert isinstance(info, SizeInfo)
    assert info == SizeInfo(2 * P, P)
    assert info.total_size == 3 * P


# --- match_prefix ------------------------------------------------------------


def test_match_on_empty_cache(P):
    m = radix(P)
    for ids in ([], seq(1), seq(5 * P)):
        h, idx = m.match_prefix(ids)
        assert isinstance(h, BaseCacheHandle)
        assert isinstance(h, radixkv.kvcache.RadixCacheHandle)
        assert h.cached_len == 0
        assert_i32(idx, [])
    assert m.size_info == SizeInfo(0, 0)
    assert m.num_nodes == 0
    m.check_integrity()


def test_match_every_prefix_length(P):
    m = radix(P)
    ids, slots = seq(4 * P, 7), seq(4 * P, 500)
    assert m.insert_prefix(ids, slots) == 0
    for k in range(len(ids) + 1):
        h, idx = m.match_prefix(ids[:k])
        assert h.cached_len == rd(k, P) == len(idx)
        assert_i32(idx, slots[: rd(k, P)])
        m.check_integrity()
    # Longer than what is cached: the whole cached part.
    h, idx = m.match_prefix(ids + [1, 2, 3] * P)
    assert h.cached_len == 4 * P
    assert_i32(idx, slots)


def test_match_stops_at_mismatch_rounded_to_page(P):
    ids, slots = seq(4 * P, 7), seq(4 * P, 500)
    for j in range(len(ids)):
        m = radix(P)
        m.insert_prefix(ids, slots)
        query = list(ids)
        query[j] = -1
        h, idx = m.match_prefix(query)
        assert h.cached_len == rd(j, P)
        assert_i32(idx, slots[: rd(j, P)])
        assert m.size_info.total_size == 4 * P
        m.check_integrity()


@pytest.mark.parametrize("p", [1, 4])
def test_match_long_keys_every_mismatch_offset(p):
    # Long keys exercise the vectorized first-mismatch at every lane and tail.
    n = 256
    ids = [(i * 7919) % 1000 for i in range(n)]
    slots = seq(n, 10)
    for j in list(range(0, 40)) + [n - 9, n - 8, n - 7, n - 2, n - 1]:
        m = radix(p)
        m.insert_prefix(ids, slots)
        query = list(ids)
        query[j] += 1
        h, idx = m.match_prefix(query)
        assert h.cached_len == rd(j, p)
        assert_i32(idx, slots[: rd(j, p)])
        assert m.insert_prefix(query, seq(n, 5000)) == rd(j, p)
        m.check_integrity()


def test_match_ending_inside_a_node_splits_it(P):
    m = radix(P)
    ids, slots = seq(4 * P), seq(4 * P, 100)
    m.insert_prefix(ids, slots)  # clock 1
    assert m.num_nodes == 1
    h, idx = m.match_prefix(ids[: 2 * P])  # clock 2: split
    assert h.cached_len == 2 * P
    assert_i32(idx, slots[: 2 * P])
    assert m.num_nodes == 2
    # The prefix takes the new time, the suffix keeps its old one.
    assert m.dump() == [
        (-1, ids[: 2 * P], slots[: 2 * P], 0, 2),
        (0, ids[2 * P :], slots[2 * P :], 0, 1),
    ]
    # Nothing is cached or uncached by a split.
    assert m.size_info == SizeInfo(4 * P, 0)
    m.check_integrity()
    # Matching again at the same place does not split further.
    m.match_prefix(ids[: 2 * P] + [-1] * P)  # clock 3
    assert m.num_nodes == 2
    assert [row[4] for row in m.dump()] == [3, 1]


def test_match_never_changes_what_is_cached(P):
    m = radix(P)
    m.insert_prefix(seq(4 * P), seq(4 * P, 100))
    m.insert_prefix(seq(2 * P) + seq(2 * P, 50), seq(4 * P, 200))
    before = [(p, k, v) for p, k, v, _, _ in m.dump()]
    info = m.size_info
    for k in range(4 * P + 1):
        m.match_prefix(seq(k))
    after = {(tuple(k), tuple(v)) for _, k, v, _, _ in m.dump()}
    # Splits may cut nodes, but the cached (token, slot) pairs along each path stay.
    assert m.size_info == info
    tokens_before = sorted(s for _, _, v in before for s in v)
    tokens_after = sorted(s for _, v in after for s in v)
    assert tokens_before == tokens_after
    m.check_integrity()


def test_match_refreshes_exactly_the_matched_tokens(P):
    m = radix(P)
    a, b = seq(4 * P, 0), seq(4 * P, 1000)
    m.insert_prefix(a, seq(4 * P, 100))  # t1
    m.insert_prefix(b, seq(4 * P, 200))  # t2
    m.match_prefix(a[: 2 * P])  # t3: a[:2P] refreshed, a[2P:] keeps t1
    assert_i32(m.evict(1), seq(2 * P, 100 + 2 * P))  # the unmatched half of a
    assert_i32(m.evict(1), seq(4 * P, 200))  # then b (t2)
    assert_i32(m.evict(1), seq(2 * P, 100))  # then the matched half of a (t3)
    assert m.size_info == SizeInfo(0, 0)
    m.check_integrity()


# --- insert_prefix -------------------------------------------------------------


def test_insert_into_empty_cache(P):
    m = radix(P)
    assert m.insert_prefix(seq(3 * P), seq(3 * P, 40)) == 0
    assert m.size_info == SizeInfo(3 * P, 0)
    assert m.num_nodes == 1
    assert m.dump() == [(-1, seq(3 * P), seq(3 * P, 40), 0, 1)]
    m.check_integrity()


def test_insert_empty_input(P):
    m = radix(P)
    assert m.insert_prefix([], []) == 0
    assert m.size_info == SizeInfo(0, 0)
    assert m.num_nodes == 0


def test_insert_rounds_down_to_whole_pages(P):
    m = radix(P)
    n = 3 * P + (P - 1)
    assert m.insert_prefix(seq(n), seq(n, 40)) == 0
    assert m.size_info == SizeInfo(3 * P, 0)
    h, idx = m.match_prefix(seq(n))
    assert h.cached_len == 3 * P
    assert_i32(idx, seq(3 * P, 40))
    # The dropped tail's slots were not stored: they can be inserted elsewhere.
    if P > 1:
        tail = seq(P - 1, 40 + 3 * P)
        other = seq(P, 9000)
        # A whole page of consecutive slots: the tail's, then the one after it.
        assert m.insert_prefix(other, tail + [40 + 4 * P - 1]) == 0
        assert_i32(m.match_prefix(other)[1], seq(P, 40 + 3 * P))
    m.check_integrity()


@pytest.mark.parametrize("P", [2, 4, 16])
def test_insert_shorter_than_a_page_stores_nothing(P):
    m = radix(P)
    assert m.insert_prefix(seq(P - 1), seq(P - 1, 10)) == 0
    assert m.num_nodes == 0
    assert m.size_info == SizeInfo(0, 0)


def test_insert_returns_cached_length(P):
    m = radix(P)
    a = seq(4 * P)
    assert m.insert_prefix(a, seq(4 * P, 100)) == 0
    b = a[: 2 * P] + seq(2 * P, 50)
    # The caller's own copies of the shared part are not stored.
    assert m.insert_prefix(b, seq(4 * P, 200)) == 2 * P
    h, idx = m.match_prefix(b)
    assert h.cached_len == 4 * P
    assert_i32(idx, seq(2 * P, 100) + seq(2 * P, 200 + 2 * P))
    assert m.size_info == SizeInfo(6 * P, 0)
    assert m.num_nodes == 3
    m.check_integrity()


def test_insert_never_overwrites(P):
    m = radix(P)
    a = seq(4 * P)
    m.insert_prefix(a, seq(4 * P, 100))
    assert m.insert_prefix(a, seq(4 * P, 300)) == 4 * P
    assert m.insert_prefix(a[: 2 * P], seq(2 * P, 400)) == 2 * P
    h, idx = m.match_prefix(a)
    assert_i32(idx, seq(4 * P, 100))
    assert m.size_info == SizeInfo(4 * P, 0)
    m.check_integrity()


def test_insert_with_the_trees_own_slots_for_the_cached_part(P):
    # The usual flow: match, compute the rest, insert match indices + new slots.
    m = radix(P)
    a = seq(3 * P)
    m.insert_prefix(a, seq(3 * P, 100))
    b = a + seq(2 * P, 70)
    h, idx = m.match_prefix(b)
    slots = idx.tolist() + seq(2 * P, 500)
    assert m.insert_prefix(b, slots) == 3 * P
    h, idx = m.match_prefix(b)
    assert_i32(idx, slots)
    m.check_integrity()


def test_insert_splits_and_adds_a_leaf(P):
    m = radix(P)
    a = seq(4 * P)
    m.insert_prefix(a, seq(4 * P, 100))  # t1
    b = a[:P] + seq(P, 50)
    assert m.insert_prefix(b, seq(2 * P, 200)) == P  # t2: split after one page
    assert m.num_nodes == 3
    # Sibling order is checked by the dump tests; here only the tree's content.
    assert canonical(m.dump()) == canonical(
        [
            (-1, a[:P], seq(P, 100), 0, 2),
            (0, a[P:], seq(3 * P, 100 + P), 0, 1),
            (0, seq(P, 50), seq(P, 200 + P), 0, 2),
        ]
    )
    m.check_integrity()


def test_insert_refreshes_the_whole_path(P):
    m = radix(P)
    a, b = seq(2 * P, 0), seq(2 * P, 1000)
    m.insert_prefix(a, seq(2 * P, 100))  # t1
    m.insert_prefix(b, seq(2 * P, 200))  # t2
    assert m.insert_prefix(a, seq(2 * P, 300)) == 2 * P  # t3: nothing new, a refreshed
    assert_i32(m.evict(1), seq(2 * P, 200))
    assert_i32(m.evict(1), seq(2 * P, 100))


def test_insert_extending_a_leaf(P):
    m = radix(P)
    a = seq(2 * P)
    m.insert_prefix(a, seq(2 * P, 100))
    assert m.insert_prefix(a + seq(P, 40), seq(3 * P, 200)) == 2 * P
    assert m.dump() == [(-1, a, seq(2 * P, 100), 0, 2), (0, seq(P, 40), seq(P, 200 + 2 * P), 0, 2)]
    # The old leaf is no longer a leaf: it goes after its new child.
    assert_i32(m.evict(1), seq(P, 200 + 2 * P))
    assert_i32(m.evict(1), seq(2 * P, 100))
    m.check_integrity()


def test_inputs_are_copied_not_aliased(P):
    m = radix(P)
    ids = torch.arange(2 * P, dtype=torch.int32)
    slots = torch.arange(2 * P, dtype=torch.int32) + 10
    m.insert_prefix(ids, slots)
    ids += 100
    slots += 100
    h, idx = m.match_prefix(list(range(2 * P)))
    assert_i32(idx, seq(2 * P, 10))
    # Results are fresh tensors: writing to them changes nothing.
    idx += 1
    _, again = m.match_prefix(list(range(2 * P)))
    assert_i32(again, seq(2 * P, 10))
    m.check_integrity()


def test_slots_reusable_after_evict_and_reset(P):
    m = radix(P)
    m.insert_prefix(seq(2 * P), seq(2 * P, 10))
    assert_i32(m.evict(2 * P), seq(2 * P, 10))
    assert m.insert_prefix(seq(2 * P, 50), seq(2 * P, 10)) == 0
    m.reset()
    assert m.insert_prefix(seq(2 * P, 90), seq(2 * P, 10)) == 0
    m.check_integrity()


def test_large_slot_values(P):
    m = radix(P)
    slots = [2**20 + i for i in range(P)] + [5 + i for i in range(P)]
    m.insert_prefix(seq(2 * P), slots)
    _, idx = m.match_prefix(seq(2 * P))
    assert_i32(idx, slots)
    m.check_integrity()


def test_extreme_token_values(P):
    m = radix(P)
    lo, hi = -(2**31), 2**31 - 1
    ids = ([lo, hi] * P)[: 2 * P]
    m.insert_prefix(torch.tensor(ids, dtype=torch.int64), seq(2 * P, 1))
    h, idx = m.match_prefix(np.array(ids, dtype=np.int64))
    assert h.cached_len == 2 * P
    assert_i32(idx, seq(2 * P, 1))


# --- lock_handle -----------------------------------------------------------------


def test_lock_protects_the_matched_path(P):
    m = radix(P)
    m.insert_prefix(seq(4 * P), seq(4 * P, 100))
    h, _ = m.match_prefix(seq(2 * P))
    m.lock_handle(h)
    assert h.lock_count == 1
    assert m.size_info == SizeInfo(2 * P, 2 * P)
    assert [row[3] for row in m.dump()] == [1, 0]
    with pytest.raises(radixkv.OutOfCapacityError):
        m.evict(2 * P + 1)
    assert_i32(m.evict(1), seq(2 * P, 100 + 2 * P))
    assert m.size_info == SizeInfo(0, 2 * P)
    with pytest.raises(radixkv.OutOfCapacityError):
        m.evict(1)
    m.lock_handle(h, unlock=True)
    assert h.lock_count == 0
    assert m.size_info == SizeInfo(2 * P, 0)
    assert_i32(m.evict(1), seq(2 * P, 100))
    m.check_integrity()


def test_locks_nest_and_each_handle_counts_its_own(P):
    m = radix(P)
    m.insert_prefix(seq(2 * P), seq(2 * P, 100))
    h1, _ = m.match_prefix(seq(2 * P))
    h2, _ = m.match_prefix(seq(2 * P))
    m.lock_handle(h1)
    m.lock_handle(h1)
    m.lock_handle(h2)
    assert (h1.lock_count, h2.lock_count) == (2, 1)
    assert m.dump()[0][3] == 3
    m.lock_handle(h2, unlock=True)
    with pytest.raises(ValueError, match="handle"):
        m.lock_handle(h2, unlock=True)  # h1 still holds the node, but h2 does not
    assert m.dump()[0][3] == 2
    m.lock_handle(h1, unlock=True)
    m.lock_handle(h1, unlock=True)
    assert m.dump()[0][3] == 0
    assert m.size_info == SizeInfo(2 * P, 0)
    m.check_integrity()


def test_lock_unlock_keyword_and_positional(P):
    m = radix(P)
    m.insert_prefix(seq(P), seq(P))
    h, _ = m.match_prefix(seq(P))
    m.lock_handle(h, False)
    m.lock_handle(handle=h)
    m.lock_handle(h, True)
    m.lock_handle(h, unlock=True)
    assert h.lock_count == 0
    assert m.size_info == SizeInfo(P, 0)


def test_lock_of_an_empty_match(P):
    m = radix(P)
    m.insert_prefix(seq(P), seq(P))
    h, idx = m.match_prefix([-5] * P)
    assert h.cached_len == 0
    m.lock_handle(h)
    assert m.size_info == SizeInfo(P, 0)
    m.lock_handle(h, unlock=True)
    assert h.lock_count == 0


def test_lock_survives_a_split(P):
    m = radix(P)
    m.insert_prefix(seq(4 * P), seq(4 * P, 100))
    h, _ = m.match_prefix(seq(4 * P))
    m.lock_handle(h)
    m.match_prefix(seq(P))  # splits the locked node
    assert [row[3] for row in m.dump()] == [1, 1]
    assert m.is_valid(h)
    m.lock_handle(h, unlock=True)
    assert [row[3] for row in m.dump()] == [0, 0]
    assert m.size_info == SizeInfo(4 * P, 0)
    m.check_integrity()


def test_handle_stale_after_evict_and_reset(P):
    m = radix(P)
    m.insert_prefix(seq(2 * P), seq(2 * P))
    h, _ = m.match_prefix(seq(2 * P))
    assert m.is_valid(h)
    m.evict(1)
    assert not m.is_valid(h)
    with pytest.raises(ValueError, match="stale"):
        m.lock_handle(h)
    m.insert_prefix(seq(2 * P), seq(2 * P))
    h, _ = m.match_prefix(seq(2 * P))
    root, _ = m.match_prefix([])
    m.lock_handle(h)
    m.reset()
    assert not m.is_valid(h)
    assert not m.is_valid(root)
    with pytest.raises(ValueError, match="stale"):
        m.lock_handle(h, unlock=True)
    with pytest.raises(ValueError, match="stale"):
        m.lock_handle(root)
    m.check_integrity()


# --- evict ---------------------------------------------------------------------


def test_evict_zero(P):
    m = radix(P)
    assert_i32(m.evict(0), [])
    m.insert_prefix(seq(P), seq(P))
    assert_i32(m.evict(0), [])
    assert m.size_info == SizeInfo(P, 0)


def test_evict_removes_whole_nodes(P):
    m = radix(P)
    m.insert_prefix(seq(4 * P), seq(4 * P, 100))
    assert_i32(m.evict(1), seq(4 * P, 100))
    assert m.size_info == SizeInfo(0, 0)
    assert m.num_nodes == 0
    m.check_integrity()


def test_evict_lru_order_and_parent_becomes_candidate(P):
    m = radix(P)
    a, x, b = seq(2 * P, 0), seq(2 * P, 100), seq(2 * P, 200)
    m.insert_prefix(a, seq(2 * P, 1000))  # a: t1
    m.insert_prefix(a + x, seq(4 * P, 2000))  # a, x: t2
    m.insert_prefix(b, seq(2 * P, 3000))  # b: t3
    # x (t2) first; then a, now an unlocked leaf with t2 < t3; then b.
    assert_i32(m.evict(6 * P), seq(2 * P, 2000 + 2 * P) + seq(2 * P, 1000) + seq(2 * P, 3000))
    assert m.num_nodes == 0
    m.check_integrity()


def test_evict_frees_at_least_size(P):
    m = radix(P)
    for i in range(4):
        m.insert_prefix(seq(P, 100 * i), seq(P, 1000 * (i + 1)))
    out = m.evict(P + 1)
    assert_i32(out, seq(P, 1000) + seq(P, 2000))
    assert m.size_info == SizeInfo(2 * P, 0)
    out = m.evict(2 * P)
    assert_i32(out, seq(P, 3000) + seq(P, 4000))


def test_evict_accepts_index_like_sizes(P):
    m = radix(P)
    m.insert_prefix(seq(2 * P), seq(2 * P))
    assert_i32(m.evict(np.int64(0)), [])
    assert_i32(m.evict(np.int32(1)), seq(2 * P))


# --- reset -------------------------------------------------------------------------


def test_reset(P):
    m = radix(P)
    m.insert_prefix(seq(4 * P), seq(4 * P))
    m.insert_prefix(seq(2 * P) + seq(P, 77), seq(3 * P, 100))
    h, _ = m.match_prefix(seq(3 * P))
    m.lock_handle(h)
    m.reset()
    assert m.size_info == SizeInfo(0, 0)
    assert m.num_nodes == 0
    assert m.dump() == []
    h2, idx = m.match_prefix(seq(4 * P))
    assert h2.cached_len == 0
    assert_i32(idx, [])
    m.check_integrity()
    # Everything, slots included, can be inserted again.
    assert m.insert_prefix(seq(4 * P), seq(4 * P)) == 0
    m.check_integrity()


# --- inputs of every accepted kind -----------------------------------------------

TORCH_INT_DTYPES = [
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
]
NUMPY_INT_DTYPES = [
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.uint8,
    np.uint16,
    np.uint32,
    np.uint64,
    np.intp,
    np.uintp,
    np.longlong,
    np.ulonglong,
    np.short,
    np.ushort,
    np.byte,
    np.ubyte,
    np.intc,
    np.uintc,
]


def _strided_torch(values, dtype):
    base = torch.full((2 * len(values) + 1,), 99, dtype=dtype)
    base[1::2] = torch.tensor(values, dtype=torch.int64).to(dtype)
    out = base[1::2]
    assert not out.is_contiguous() or len(values) <= 1
    return out


def _offset_torch(values, dtype):
    base = torch.cat(
        [torch.full((3,), 99, dtype=torch.int64), torch.tensor(values, dtype=torch.int64)]
    )
    return base.to(dtype)[3:]


def _column_torch(values, dtype):
    base = torch.stack([torch.full((len(values),), 99), torch.tensor(values, dtype=torch.int64)], 1)
    return base.to(dtype)[:, 1]


def _reversed_numpy(values, dtype):
    out = np.array(values[::-1], dtype=dtype)[::-1]
    assert out.strides[0] < 0 or len(values) <= 1
    return out


def _strided_numpy(values, dtype):
    base = np.full(3 * len(values) + 2, 99, dtype=dtype)
    base[2::3] = values
    return base[2::3]


def _reversed_strided_numpy(values, dtype):
    base = np.full(2 * len(values) + 1, 99, dtype=dtype)
    base[1::2] = values[::-1]
    return base[1::2][::-1]


def _column_numpy(values, dtype):
    return np.stack([np.full(len(values), 99), np.array(values)], 1).astype(dtype)[:, 1]


FORMS = {
    "list": lambda v: list(v),
    "tuple": lambda v: tuple(v),
    "list_of_numpy_scalars": lambda v: [np.int64(x) for x in v],
    **{
        f"torch_{str(d).split('.')[-1]}": (
            lambda d: lambda v: torch.tensor(v, dtype=torch.int64).to(d)
        )(d)
        for d in TORCH_INT_DTYPES
    },
    **{
        f"numpy_{np.dtype(d).name}_{i}": (lambda d: lambda v: np.array(v, dtype=d))(d)
        for i, d in enumerate(NUMPY_INT_DTYPES)
    },
    "torch_strided_int32": lambda v: _strided_torch(v, torch.int32),
    "torch_strided_int64": lambda v: _strided_torch(v, torch.int64),
    "torch_strided_uint8": lambda v: _strided_torch(v, torch.uint8),
    "torch_strided_int16": lambda v: _strided_torch(v, torch.int16),
    "torch_offset_int32": lambda v: _offset_torch(v, torch.int32),
    "torch_offset_int8": lambda v: _offset_torch(v, torch.int8),
    "torch_column_int32": lambda v: _column_torch(v, torch.int32),
    "torch_column_int64": lambda v: _column_torch(v, torch.int64),
    "numpy_reversed_int32": lambda v: _reversed_numpy(v, np.int32),
    "numpy_reversed_int64": lambda v: _reversed_numpy(v, np.int64),
    "numpy_reversed_uint8": lambda v: _reversed_numpy(v, np.uint8),
    "numpy_reversed_strided_int32": lambda v: _reversed_strided_numpy(v, np.int32),
    "numpy_strided_int32": lambda v: _strided_numpy(v, np.int32),
    "numpy_strided_int16": lambda v: _strided_numpy(v, np.int16),
    "numpy_column_int32": lambda v: _column_numpy(v, np.int32),
    "numpy_column_int64": lambda v: _column_numpy(v, np.int64),
    "numpy_readonly_int32": lambda v: np.lib.stride_tricks.as_strided(
        np.array(v, dtype=np.int32), writeable=False
    ),
}


@pytest.mark.parametrize("p", [1, 4])
@pytest.mark.parametrize("form", sorted(FORMS))
def test_input_forms(form, p):
    make = FORMS[form]
    a = [(i * 37) % 100 for i in range(3 * p)]
    slots = [10 + i for i in range(3 * p)]
    b = a[:p] + [(i * 11) % 100 + 1 for i in range(2 * p)]
    b_slots = [60 + i for i in range(3 * p)]

    m = radix(p)
    ref = radix(p)  # the same operations with plain lists
    for mgr, conv in ((m, make), (ref, list)):
        assert mgr.insert_prefix(conv(a), conv(slots)) == 0
        assert mgr.insert_prefix(conv(b), conv(b_slots)) == p
    assert m.dump() == ref.dump()

    for query in (a, b, a[: 2 * p], b[:p] + [0] * p, []):
        h, idx = m.match_prefix(make(query))
        h_ref, idx_ref = ref.match_prefix(query)
        assert h.cached_len == h_ref.cached_len == len(idx)
        assert_i32(idx, idx_ref.tolist())
    assert m.dump() == ref.dump()
    m.check_integrity()


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.int64])
def test_negative_token_ids(dtype):
    m = radix(1)
    ids = torch.tensor([-5, 3, -128], dtype=dtype)
    m.insert_prefix(ids, [1, 2, 3])
    h, idx = m.match_prefix([-5, 3, -128, 4])
    assert_i32(idx, [1, 2, 3])


def test_expanded_tensor_stride_zero():
    m = radix(1)
    m.insert_prefix(torch.tensor([7]).expand(4), torch.arange(4))
    h, idx = m.match_prefix([7, 7, 7, 7, 7])
    assert_i32(idx, [0, 1, 2, 3])
    h, idx = m.match_prefix(np.broadcast_to(np.array([7], dtype=np.int32), (3,)))
    assert_i32(idx, [0, 1, 2])


def test_empty_inputs_of_every_kind():
    m = radix(1)
    m.insert_prefix([1, 2], [3, 4])
    for empty in (
        [],
        (),
        torch.empty(0, dtype=torch.int64),
        torch.empty(0, dtype=torch.uint8),
        np.empty(0, dtype=np.int32),
        np.empty(0, dtype=np.uint64),
    ):
        h, idx = m.match_prefix(empty)
        assert h.cached_len == 0
        assert_i32(idx, [])
        assert m.insert_prefix(empty, empty) == 0
    assert m.size_info == SizeInfo(2, 0)


def test_results_are_int32_1d(P):
    m = radix(P)
    m.insert_prefix(torch.arange(3 * P, dtype=torch.int64), torch.arange(3 * P, dtype=torch.int16))
    h, idx = m.match_prefix(torch.arange(3 * P, dtype=torch.int64))
    assert h.cached_len == len(idx) == 3 * P
    assert isinstance(h.cached_len, int)
    assert_i32(idx, seq(3 * P))
    ev = m.evict(1)
    assert_i32(ev, seq(3 * P))
    ins = m.insert_prefix(np.arange(P), np.arange(P))
    assert type(ins) is int


# --- dump ----------------------------------------------------------------------


def test_dump_lists_siblings_in_ascending_key_order():
    # RadixCacheManager.dump's docstring (and RadixTree::Dump's) promise
    # "siblings in ascending token order".
    m = radix(1)
    m.insert_prefix([5, 1], [50, 51])  # t1
    m.insert_prefix([1, 2], [10, 11])  # t2
    m.insert_prefix([3], [30])  # t3
    m.insert_prefix([1, 0], [12, 13])  # t4: splits [1, 2]
    assert m.dump() == [
        (-1, [1], [10], 0, 4),
        (-1, [3], [30], 0, 3),
        (-1, [5, 1], [50, 51], 0, 1),
        (0, [0], [13], 0, 4),
        (0, [2], [11], 0, 2),
    ]


def test_dump_parents_before_children(P):
    m = radix(P)
    m.insert_prefix(seq(4 * P), seq(4 * P))
    m.insert_prefix(seq(2 * P) + seq(2 * P, 50), seq(4 * P, 100))
    m.insert_prefix(seq(P) + seq(P, 90), seq(2 * P, 200))
    rows = m.dump()
    assert len(rows) == m.num_nodes == 5
    for i, (parent, key, value, ref, ts) in enumerate(rows):
        assert -1 <= parent < i
        assert len(key) == len(value) and len(key) % P == 0 and key


# --- NaiveCacheManager ---------------------------------------------------------


def test_naive_never_matches(P):
    m = create_cache_manager("cpu", "naive", P)
    assert m.insert_prefix(seq(4 * P), seq(4 * P)) == 4 * P
    for ids in ([], seq(4 * P), torch.arange(4 * P), np.arange(4 * P, dtype=np.int32)):
        h, idx = m.match_prefix(ids)
        assert isinstance(h, BaseCacheHandle)
        assert h.cached_len == 0
        assert_i32(idx, [])
    assert m.size_info == SizeInfo(0, 0)
    assert m.size_info.total_size == 0


def test_naive_insert_reports_all_whole_pages_as_cached(P):
    # Nothing is stored, so the caller frees its copies of every whole page
    # (and, as with any cache, its partial last page).
    m = NaiveCacheManager("cpu", P)
    for n in (0, 1, P, 3 * P + 1):
        assert m.insert_prefix(seq(n), seq(n)) == n - n % P
        assert m.insert_prefix(torch.arange(n), np.arange(n)) == n - n % P


def test_naive_evict(P):
    m = NaiveCacheManager(page_size=P)
    m.insert_prefix(seq(P), seq(P))
    assert_i32(m.evict(0), [])
    with pytest.raises(RuntimeError) as e:
        m.evict(1)
    assert isinstance(e.value, radixkv.OutOfCapacityError)
    assert "1" in str(e.value) and "0" in str(e.value)


def test_naive_lock_unlock(P):
    m = NaiveCacheManager(page_size=P)
    h, _ = m.match_prefix(seq(P))
    m.lock_handle(h)
    m.lock_handle(h)
    m.lock_handle(h, unlock=True)
    m.lock_handle(h, unlock=True)
    with pytest.raises(ValueError, match="handle"):
        m.lock_handle(h, unlock=True)
    m.reset()
    m.check_integrity()
    assert m.size_info == SizeInfo(0, 0)


def test_out_of_capacity_error_is_runtime_error():
    assert issubclass(radixkv.OutOfCapacityError, RuntimeError)
    assert issubclass(radixkv.IntegrityError, RuntimeError)


@pytest.mark.parametrize("p", [1, 16])
@pytest.mark.parametrize("form", ["list", "torch_int64", "torch_int32", "numpy_reversed_int32"])
def test_large_inputs_release_the_gil(p, form):
    # Inputs of 2**16 tokens and more take the path that releases the GIL.
    make = FORMS[form]
    n = 70_000
    ids = [(i * 7) % 5000 for i in range(n)]
    m = radix(p)
    assert m.insert_prefix(make(ids), make(seq(n))) == 0
    h, idx = m.match_prefix(make(ids))
    assert h.cached_len == rd(n, p)
    assert torch.equal(idx, torch.arange(rd(n, p), dtype=torch.int32))
    other = ids[: n // 2] + [-1] * (n - n // 2)
    assert m.insert_prefix(make(other), make(seq(n, n))) == rd(n // 2, p)
    m.check_integrity()
    total = m.size_info.total_size
    assert total == rd(n, p) + rd(n, p) - rd(n // 2, p)
    out = m.evict(total)
    assert out.dtype == torch.int32
    assert sorted(out.tolist()) == sorted(
        seq(rd(n, p)) + seq(rd(n, p) - rd(n // 2, p), n + rd(n // 2, p))
    )
    assert m.size_info == SizeInfo(0, 0)
    m.check_integrity()
