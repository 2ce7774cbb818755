"""docs/api.md, "Inputs and results": every bad input raises the documented exception type, with a
message naming the argument, and leaves the manager exactly as it was.

"Exactly as it was" is checked three ways: size_info, num_nodes, dump() (keys,
slots, ref counts, timestamps) and every handle's lock_count are equal before
and after, check_integrity() passes, and the same follow-up operations on the
manager and on an identically built twin that never saw the bad call give the
same dump -- so not even the logical clock may have moved.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import radixkv
from radixkv.kvcache import NaiveCacheManager, RadixCacheManager, SizeInfo, create_cache_manager
from radixkv.scheduler import CacheManager
from assertions import raises

P_VALUES = [1, 4]


def seq(n, start=0):
    return list(range(start, start + n))


# --- a populated radix manager and its invariants ----------------------------------


def build(p):
    """A radix manager with splits, a locked path, an idle handle and a stale handle.

    Stored slots: 100.. (first insert), 200.. (second insert). Cached tokens:
    seq(4p) and seq(2p) + seq(2p, 50); seq(3p) is locked."""
    m = RadixCacheManager("cpu", p)
    m.insert_prefix(seq(p, 700), seq(p, 700))
    stale, _ = m.match_prefix(seq(p, 700))
    m.evict(1)
    m.insert_prefix(seq(4 * p), seq(4 * p, 100))
    m.insert_prefix(seq(2 * p) + seq(2 * p, 50), seq(4 * p, 200))
    locked, _ = m.match_prefix(seq(3 * p))
    m.lock_handle(locked)
    idle, _ = m.match_prefix(seq(2 * p) + seq(2 * p, 50))
    root, _ = m.match_prefix([-7] * p)
    handles = {"locked": locked, "idle": idle, "stale": stale, "root": root}
    assert not m.is_valid(stale) and m.is_valid(locked) and m.is_valid(idle)
    assert locked.lock_count == 1
    return m, handles


def snapshot(m, handles):
    return (
        m.size_info,
        m.num_nodes,
        m.dump(),
        {k: (h.lock_count, h.cached_len, m.is_valid(h)) for k, h in handles.items()},
    )


def probe(m, p):
    """Follow-up operations whose results depend on the whole state, clock included."""
    out = [m.insert_prefix(seq(2 * p, 900), seq(2 * p, 9000))]
    h, idx = m.match_prefix(seq(4 * p))
    out.append(idx.tolist())
    out.append(m.evict(1).tolist())
    out.append(m.dump())
    out.append(m.size_info)
    m.check_integrity()
    return out


class RadixCase:
    """A fresh populated manager; `check_unchanged()` after the bad call."""

    def __init__(self, p):
        self.p = p
        self.m, self.h = build(p)
        self.before = snapshot(self.m, self.h)

    def check_unchanged(self):
        assert snapshot(self.m, self.h) == self.before
        self.m.check_integrity()
        twin, _ = build(self.p)
        assert probe(self.m, self.p) == probe(twin, self.p)


# --- bad integer-array arguments ------------------------------------------------------

N = 8  # length of the bad arrays (a multiple of every page size used here)

WRONG_RANK = {
    "torch_0d": lambda: torch.tensor(3),
    "torch_0d_int32": lambda: torch.tensor(3, dtype=torch.int32),
    "torch_2d": lambda: torch.arange(N, dtype=torch.int64).reshape(2, N // 2),
    "torch_2d_int32": lambda: torch.arange(N, dtype=torch.int32).reshape(N, 1),
    "torch_2d_empty": lambda: torch.empty((0, 3), dtype=torch.int64),
    "torch_3d": lambda: torch.zeros((1, 2, 4), dtype=torch.int32),
    "numpy_0d": lambda: np.array(3, dtype=np.int64),
    "numpy_0d_int32": lambda: np.array(3, dtype=np.int32),
    "numpy_2d": lambda: np.arange(N, dtype=np.int32).reshape(2, N // 2),
    "numpy_2d_int64": lambda: np.arange(N, dtype=np.int64).reshape(N // 2, 2),
}

NON_INTEGER = {
    "torch_float32": lambda: torch.arange(N, dtype=torch.float32),
    "torch_float64": lambda: torch.arange(N, dtype=torch.float64),
    "torch_float16": lambda: torch.arange(N, dtype=torch.float16),
    "torch_bfloat16": lambda: torch.arange(N, dtype=torch.bfloat16),
    "torch_bool": lambda: torch.ones(N, dtype=torch.bool),
    "torch_complex64": lambda: torch.zeros(N, dtype=torch.complex64),
    "numpy_float32": lambda: np.arange(N, dtype=np.float32),
    "numpy_float64": lambda: np.arange(N, dtype=np.float64),
    "numpy_bool": lambda: np.ones(N, dtype=np.bool_),
    "numpy_complex": lambda: np.zeros(N, dtype=np.complex64),
    "list_of_floats": lambda: [float(i) for i in range(N)],
    "list_with_a_float": lambda: seq(N - 1) + [1.5],
    "list_of_bools": lambda: [True] * N,
    "tuple_with_none": lambda: tuple(seq(N - 1)) + (None,),
    "list_with_str": lambda: seq(N - 1) + ["7"],
    "none": lambda: None,
    "int": lambda: 3,
    "float": lambda: 3.0,
    "str": lambda: "01234567",
    "dict": lambda: {i: i for i in range(N)},
    "object": lambda: object(),
}

NOT_INT32 = {
    "torch_int64_big": lambda: torch.tensor(seq(N - 1) + [2**31], dtype=torch.int64),
    "torch_int64_small": lambda: torch.tensor(seq(N - 1) + [-(2**31) - 1], dtype=torch.int64),
    "torch_uint32_big": lambda: torch.tensor(seq(N - 1) + [2**31], dtype=torch.int64).to(
        torch.uint32
    ),
    "torch_uint64_big": lambda: torch.tensor(seq(N - 1) + [2**62], dtype=torch.int64).to(
        torch.uint64
    ),
    "torch_int64_strided": lambda: torch.tensor([2**40] * (2 * N), dtype=torch.int64)[::2],
    "numpy_uint32_big": lambda: np.array(seq(N - 1) + [2**32 - 1], dtype=np.uint32),
    "numpy_uint64_big": lambda: np.array(seq(N - 1) + [2**64 - 1], dtype=np.uint64),
    "numpy_int64_big": lambda: np.array([2**40] + seq(N - 1), dtype=np.int64),
    "numpy_int64_reversed": lambda: np.array(seq(N - 1) + [-(2**40)], dtype=np.int64)[::-1],
    "list_big": lambda: seq(N - 1) + [2**31],
    "list_small": lambda: [-(2**31) - 1] + seq(N - 1),
    "list_huge": lambda: seq(N - 1) + [2**80],
    "tuple_huge_negative": lambda: tuple(seq(N - 1)) + (-(2**70),),
}


def _radix_calls(p):
    """(entry point, argument name, call with the bad value in that argument)."""
    fresh = seq(N, 5000)  # not cached: a valid call would insert it
    return {
        "match_prefix/input_ids": ("input_ids", lambda m, bad: m.match_prefix(bad)),
        "insert_prefix/input_ids": ("input_ids", lambda m, bad: m.insert_prefix(bad, seq(N, 6000))),
        "insert_prefix/indices": ("indices", lambda m, bad: m.insert_prefix(fresh, bad)),
    }


CALLS = list(_radix_calls(1))


def _check_radix(p, call, make_bad, exc):
    name, fn = _radix_calls(p)[call]
    case = RadixCase(p)
    with raises(exc, name):
        fn(case.m, make_bad())
    case.check_unchanged()


def _check_naive(p, call, make_bad, exc):
    name, fn = _radix_calls(p)[call]
    m = NaiveCacheManager("cpu", p)
    with raises(exc, name):
        fn(m, make_bad())
    assert m.size_info == SizeInfo(0, 0)
    m.check_integrity()


@pytest.mark.parametrize("p", P_VALUES)
@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("bad", sorted(WRONG_RANK))
def test_radix_wrong_rank(p, call, bad):
    _check_radix(p, call, WRONG_RANK[bad], ValueError)


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("bad", sorted(WRONG_RANK))
def test_naive_wrong_rank(call, bad):
    _check_naive(1, call, WRONG_RANK[bad], ValueError)


@pytest.mark.parametrize("call", CALLS)
def test_radix_nested_list(call):
    # A list of lists is 2-D (wrong shape) and also a list of non-ints (wrong type):
    # either error type is in the contract; the message must name the argument.
    _check_radix(1, call, lambda: [seq(4), seq(4, 4)], (TypeError, ValueError))
    _check_naive(1, call, lambda: [seq(4), seq(4, 4)], (TypeError, ValueError))


@pytest.mark.parametrize("p", P_VALUES)
@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("bad", sorted(NON_INTEGER))
def test_radix_non_integer_dtype(p, call, bad):
    _check_radix(p, call, NON_INTEGER[bad], TypeError)


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("bad", sorted(NON_INTEGER))
def test_naive_non_integer_dtype(call, bad):
    _check_naive(1, call, NON_INTEGER[bad], TypeError)


@pytest.mark.parametrize("p", P_VALUES)
@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("bad", sorted(NOT_INT32))
def test_radix_values_outside_int32(p, call, bad):
    _check_radix(p, call, NOT_INT32[bad], ValueError)


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("bad", sorted(NOT_INT32))
def test_naive_values_outside_int32(call, bad):
    _check_naive(1, call, NOT_INT32[bad], ValueError)


@pytest.mark.parametrize("call", CALLS)
def test_radix_non_cpu_tensor(call):
    # A tensor that is not on the CPU is a wrong-type argument (tensor_view.h:
    # "TypeError for ... a non-CPU tensor"); the meta device is always available.
    _check_radix(1, call, lambda: torch.empty(N, dtype=torch.int64, device="meta"), TypeError)


# --- insert_prefix: lengths and slot values --------------------------------------------


@pytest.mark.parametrize("p", P_VALUES)
@pytest.mark.parametrize("ids_len, idx_len", [(8, 7), (8, 9), (8, 0), (0, 1), (9, 8), (8, 16)])
def test_radix_length_mismatch(p, ids_len, idx_len):
    case = RadixCase(p)
    with raises(ValueError, "indices", "input_ids"):
        case.m.insert_prefix(seq(ids_len, 5000), seq(idx_len, 6000))
    case.check_unchanged()


@pytest.mark.parametrize("p", P_VALUES)
def test_radix_length_mismatch_with_cached_input(p):
    case = RadixCase(p)
    with raises(ValueError, "indices", "input_ids"):
        case.m.insert_prefix(seq(4 * p), seq(4 * p - 1, 6000))
    case.check_unchanged()


@pytest.mark.parametrize("ids_len, idx_len", [(8, 7), (8, 9), (0, 1)])
def test_naive_length_mismatch(ids_len, idx_len):
    m = NaiveCacheManager("cpu", 4)
    with raises(ValueError, "indices", "input_ids"):
        m.insert_prefix(seq(ids_len), seq(idx_len))


def _negative_cases(p):
    """(input_ids, indices) with one negative slot, by where the slot sits."""
    cached = seq(2 * p)  # cached already (stored with slots 100..)
    cases = {
        "new_part_first": (seq(4 * p, 5000), [-1] + seq(4 * p - 1, 6000)),
        "new_part_middle": (seq(4 * p, 5000), seq(2 * p, 6000) + [-5] + seq(2 * p - 1, 6100)),
        "new_part_last": (seq(4 * p, 5000), seq(4 * p - 1, 6000) + [-(2**31)]),
        "new_part_after_cached": (cached + seq(2 * p, 5000), seq(3 * p, 6000) + [-1] * p),
        # The caller's copies of cached tokens are still its argument: a negative
        # slot there is bad input too.
        "cached_part": (cached + seq(2 * p, 5000), [-1] + seq(4 * p - 1, 6000)),
        "all_cached": (seq(4 * p), seq(4 * p - 1, 6000) + [-3]),
    }
    if p > 1:
        # The check happens before anything is truncated (docs/decisions.md).
        cases["truncated_tail"] = (seq(4 * p + 1, 5000), seq(4 * p, 6000) + [-1])
        cases["truncated_tail_of_cached"] = (seq(4 * p + 1), seq(4 * p, 6000) + [-1])
    return cases


NEGATIVE_CASES = [(p, where) for p in P_VALUES for where in sorted(_negative_cases(p))]


@pytest.mark.parametrize("p, where", NEGATIVE_CASES)
def test_radix_negative_slot(p, where):
    ids, indices = _negative_cases(p)[where]
    for form in (list, lambda v: torch.tensor(v, dtype=torch.int64), np.array):
        case = RadixCase(p)
        with raises(ValueError, "indices"):
            case.m.insert_prefix(form(ids), form(indices))
        case.check_unchanged()


@pytest.mark.parametrize("p", P_VALUES)
def test_naive_negative_slot(p):
    m = NaiveCacheManager("cpu", p)
    with raises(ValueError, "indices"):
        m.insert_prefix(seq(4 * p), seq(4 * p - 1) + [-1])


def _stored_cases(p):
    """(input_ids, indices) whose part to be stored holds a page the tree stores.

    The stored page is whole (p consecutive slots), as every page given to the
    tree is, so that "already stored" is the only fault."""
    cached = seq(2 * p)
    return {
        "first": (seq(4 * p, 5000), seq(p, 100) + seq(3 * p, 6000)),
        "last": (seq(4 * p, 5000), seq(3 * p, 6000) + seq(p, 200 + 3 * p)),
        "locked_slot": (seq(4 * p, 5000), seq(p, 6000) + seq(p, 100) + seq(2 * p, 6100)),
        "after_cached_part": (
            cached + seq(2 * p, 5000),
            seq(2 * p, 6000) + seq(p, 100 + p) + seq(p, 6100),
        ),
        "extending_a_leaf": (
            seq(4 * p) + seq(p, 5000),
            seq(4 * p, 6000) + seq(p, 100 + 3 * p),
        ),
    }


@pytest.mark.parametrize("p", P_VALUES)
@pytest.mark.parametrize("where", sorted(_stored_cases(1)))
def test_radix_slot_already_stored(p, where):
    ids, indices = _stored_cases(p)[where]
    case = RadixCase(p)
    with raises(ValueError, "indices", "already stored"):
        case.m.insert_prefix(ids, indices)
    case.check_unchanged()


def _repeated_cases(p):
    """(input_ids, indices) with a slot that appears twice in indices."""
    cached = seq(2 * p)
    cases = {
        "new_part_adjacent": (seq(4 * p, 5000), [6000, 6000] + seq(4 * p - 2, 6001)),
        "new_part_apart": (seq(4 * p, 5000), [7000] + seq(4 * p - 2, 6000) + [7000]),
        # The cached part's slots are the caller's own copies, which it frees on
        # return; storing one of them for a new token would hand the caller a slot
        # the tree now owns.
        "cached_and_new_part": (
            cached + seq(2 * p, 5000),
            [7000] + seq(2 * p - 1, 6000) + [7000] + seq(2 * p - 1, 6100),
        ),
    }
    if p > 1:
        # The truncated tail's slot is the caller's to free as well.
        cases["new_part_and_truncated_tail"] = (
            seq(4 * p + 1, 5000),
            [7000] + seq(4 * p - 1, 6000) + [7000],
        )
    return cases


REPEATED_CASES = [(p, where) for p in P_VALUES for where in sorted(_repeated_cases(p))]


@pytest.mark.parametrize("p, where", REPEATED_CASES)
def test_radix_slot_repeated_in_indices(p, where):
    ids, indices = _repeated_cases(p)[where]
    case = RadixCase(p)
    with raises(ValueError, "indices"):
        case.m.insert_prefix(ids, indices)
    case.check_unchanged()


def _broken_page_cases():
    """(input_ids, indices, the index that breaks its page) at page_size 4."""
    return {
        "first_page": (seq(16, 5000), [6000, 6001, 6003, 6002] + seq(12, 6004), 2),
        "after_cached_part": (
            seq(8) + seq(8, 5000),
            seq(8, 6000) + [6100, 6101, 6102, 7] + seq(4, 6200),
            11,
        ),
        "last_whole_page": (seq(16, 5000) + [1], seq(12, 6000) + [6012, 6013, 6014, 6016, 999], 15),
        "descending": (seq(8, 5000), seq(4, 6000) + [6103, 6102, 6101, 6100], 5),
    }


@pytest.mark.parametrize("where", sorted(_broken_page_cases()))
def test_radix_page_of_slots_not_consecutive(where):
    """With page_size > 1 the slots of a whole page are consecutive (the tree
    keeps one slot per page); a page that breaks this is refused, naming the
    slot, and changes nothing. A partial last page is not checked."""
    ids, indices, bad = _broken_page_cases()[where]
    case = RadixCase(4)
    with raises(ValueError, f"indices[{bad}] = {indices[bad]}", "page_size 4"):
        case.m.insert_prefix(ids, indices)
    case.check_unchanged()
    # Consecutive slots that are not page-aligned, and any slots past the last
    # whole page, are accepted.
    m, _ = build(4)
    assert m.insert_prefix(seq(9, 5000), seq(8, 6001) + [999]) == 0
    assert m.match_prefix(seq(9, 5000))[1].tolist() == seq(8, 6001)
    m.check_integrity()


def test_failed_insert_leaves_its_slots_free():
    # After a refused insert, none of its slots counts as stored.
    case = RadixCase(1)
    with pytest.raises(ValueError):
        case.m.insert_prefix(seq(4, 5000), [6000, 6001, 6002, 100])
    assert case.m.insert_prefix(seq(4, 5000), [6000, 6001, 6002, 6003]) == 0
    case.m.check_integrity()


# --- lock_handle ------------------------------------------------------------------------

WRONG_HANDLES = {
    "none": lambda: None,
    "int": lambda: 0,
    "str": lambda: "handle",
    "tuple_from_match": lambda: RadixCacheManager().match_prefix([1]),
    "tensor": lambda: torch.tensor([1]),
    "naive_handle": lambda: NaiveCacheManager().match_prefix([1])[0],
    "object": lambda: object(),
}


@pytest.mark.parametrize("p", P_VALUES)
@pytest.mark.parametrize("unlock", [False, True])
@pytest.mark.parametrize("bad", sorted(WRONG_HANDLES))
def test_radix_handle_of_wrong_type(p, unlock, bad):
    case = RadixCase(p)
    with raises(TypeError, "handle"):
        case.m.lock_handle(WRONG_HANDLES[bad](), unlock=unlock)
    case.check_unchanged()


@pytest.mark.parametrize("unlock", [False, True])
@pytest.mark.parametrize("bad", ["none", "int", "str", "tensor", "object", "radix_handle"])
def test_naive_handle_of_wrong_type(unlock, bad):
    m = NaiveCacheManager()
    if bad == "radix_handle":
        h = RadixCacheManager().match_prefix([1])[0]
    else:
        h = WRONG_HANDLES[bad]()
    with raises(TypeError, "handle"):
        m.lock_handle(h, unlock=unlock)


@pytest.mark.parametrize("p", P_VALUES)
@pytest.mark.parametrize("unlock", [False, True])
@pytest.mark.parametrize("which", ["locked", "idle", "root"])
def test_radix_handle_from_another_manager(p, unlock, which):
    case = RadixCase(p)
    other = RadixCase(p)
    h = other.h[which]
    with raises(ValueError, "handle", "another"):
        case.m.lock_handle(h, unlock=unlock)
    case.check_unchanged()
    other.check_unchanged()


@pytest.mark.parametrize("p", P_VALUES)
@pytest.mark.parametrize("unlock", [False, True])
def test_radix_handle_from_same_shaped_manager(p, unlock):
    # Same page size, same contents, same node ids: still another manager.
    case = RadixCase(p)
    other, handles = build(p)
    with raises(ValueError, "handle"):
        case.m.lock_handle(handles["locked"], unlock=unlock)
    case.check_unchanged()


@pytest.mark.parametrize("unlock", [False, True])
def test_naive_handle_from_another_manager(unlock):
    m, other = NaiveCacheManager(), NaiveCacheManager()
    h, _ = other.match_prefix([1, 2])
    other.lock_handle(h)
    with raises(ValueError, "handle"):
        m.lock_handle(h, unlock=unlock)
    assert h.lock_count == 1


@pytest.mark.parametrize("p", P_VALUES)
@pytest.mark.parametrize("unlock", [False, True])
def test_radix_stale_handle_evicted(p, unlock):
    case = RadixCase(p)
    with raises(ValueError, "handle", "stale"):
        case.m.lock_handle(case.h["stale"], unlock=unlock)
    case.check_unchanged()


@pytest.mark.parametrize("p", P_VALUES)
def test_radix_stale_handle_node_id_reused(p):
    # The evicted node's id is reused by a new node at the same depth: still stale.
    m = RadixCacheManager("cpu", p)
    m.insert_prefix(seq(p), seq(p))
    h, _ = m.match_prefix(seq(p))
    m.evict(p)
    m.insert_prefix(seq(p, 50), seq(p, 50))
    assert m.num_nodes == 1
    before = (m.size_info, m.dump())
    for unlock in (False, True):
        with raises(ValueError, "handle", "stale"):
            m.lock_handle(h, unlock=unlock)
    assert (m.size_info, m.dump()) == before
    m.check_integrity()


@pytest.mark.parametrize("p", P_VALUES)
@pytest.mark.parametrize("which", ["locked", "idle", "root"])
def test_radix_stale_handle_after_reset(p, which):
    m, hs = build(p)
    m.reset()
    m.insert_prefix(seq(4 * p), seq(4 * p, 100))  # same tokens, same slots again
    before = (m.size_info, m.dump())
    for unlock in (False, True):
        with raises(ValueError, "handle", "stale"):
            m.lock_handle(hs[which], unlock=unlock)
    assert (m.size_info, m.dump()) == before
    m.check_integrity()


@pytest.mark.parametrize("p", P_VALUES)
@pytest.mark.parametrize("which", ["idle", "root"])
def test_radix_unlock_without_lock(p, which):
    case = RadixCase(p)
    with raises(ValueError, "handle", "not locked"):
        case.m.lock_handle(case.h[which], unlock=True)
    case.check_unchanged()


@pytest.mark.parametrize("p", P_VALUES)
def test_radix_unlock_more_than_locked_while_another_handle_holds_the_node(p):
    case = RadixCase(p)
    # Same node as the locked handle, which holds one lock on it.
    twin_handle, _ = case.m.match_prefix(seq(3 * p))
    case.before = snapshot(case.m, case.h)
    with raises(ValueError, "handle"):
        case.m.lock_handle(twin_handle, unlock=True)
    assert snapshot(case.m, case.h) == case.before
    assert twin_handle.lock_count == 0
    case.m.check_integrity()
    # Lock it once, unlock it twice: the second unlock fails.
    case.m.lock_handle(twin_handle)
    case.m.lock_handle(twin_handle, unlock=True)
    after = snapshot(case.m, case.h)
    with raises(ValueError, "handle"):
        case.m.lock_handle(twin_handle, unlock=True)
    assert snapshot(case.m, case.h) == after
    case.m.check_integrity()


def test_naive_unlock_without_lock():
    m = NaiveCacheManager()
    h, _ = m.match_prefix([1])
    with raises(ValueError, "handle"):
        m.lock_handle(h, unlock=True)
    m.lock_handle(h)
    m.lock_handle(h, unlock=True)
    with raises(ValueError, "handle"):
        m.lock_handle(h, unlock=True)
    assert h.lock_count == 0


# --- evict -----------------------------------------------------------------------------


@pytest.mark.parametrize("p", P_VALUES)
@pytest.mark.parametrize("size", [-1, -2, -(2**40)])
def test_radix_evict_negative(p, size):
    case = RadixCase(p)
    with raises(ValueError, "size"):
        case.m.evict(size)
    case.check_unchanged()


@pytest.mark.parametrize("size", [-1, -(2**40)])
def test_naive_evict_negative(size):
    with raises(ValueError, "size"):
        NaiveCacheManager().evict(size)


@pytest.mark.parametrize("p", P_VALUES)
@pytest.mark.parametrize("bad", [1.0, "3", None, True, [1]])
def test_radix_evict_size_of_wrong_type(p, bad):
    case = RadixCase(p)
    with raises(TypeError, "size"):
        case.m.evict(bad)
    case.check_unchanged()


@pytest.mark.parametrize("bad", [1.0, "3", None, True, [1]])
def test_naive_evict_size_of_wrong_type(bad):
    with raises(TypeError, "size"):
        NaiveCacheManager().evict(bad)


@pytest.mark.parametrize("p", P_VALUES)
@pytest.mark.parametrize("extra", ["evictable+1", "total", "total+5", "2**40"])
def test_radix_evict_beyond_evictable(p, extra):
    case = RadixCase(p)
    evictable, protected = case.m.size_info
    assert evictable > 0 and protected > 0
    size = {
        "evictable+1": evictable + 1,
        "total": evictable + protected,
        "total+5": evictable + protected + 5,
        "2**40": 2**40,
    }[extra]
    with raises(radixkv.OutOfCapacityError, str(size), str(evictable)) as e:
        case.m.evict(size)
    assert isinstance(e.value, RuntimeError)
    case.check_unchanged()


@pytest.mark.parametrize("p", P_VALUES)
def test_radix_evict_beyond_evictable_on_empty_cache(p):
    m = RadixCacheManager("cpu", p)
    with raises(radixkv.OutOfCapacityError, "1", "0"):
        m.evict(1)
    assert m.size_info == SizeInfo(0, 0)
    m.check_integrity()


@pytest.mark.parametrize("size", [1, 7, 2**40])
def test_naive_evict_beyond_evictable(size):
    m = NaiveCacheManager()
    with raises(RuntimeError, str(size), "0") as e:
        m.evict(size)
    assert isinstance(e.value, radixkv.OutOfCapacityError)


def test_radix_evict_beyond_int64():
    case = RadixCase(1)
    with pytest.raises((ValueError, radixkv.OutOfCapacityError)) as e:
        case.m.evict(2**70)
    assert "size" in str(e.value)
    case.check_unchanged()


@pytest.mark.parametrize(
    "make",
    [
        lambda d: CacheManager(8, device=d),
        lambda d: create_cache_manager(d, "radix", 1),
        lambda d: create_cache_manager(d, "naive", 1),
    ],
)
@pytest.mark.parametrize(
    "device, exc, words",
    [
        ("meta", ValueError, "device must be a device that holds data, got meta"),
        (torch.device("meta"), ValueError, "holds data"),
        ("bogus", ValueError, "device: "),
        (3.5, TypeError, "device must be a torch.device or a device name, got float"),
        (True, TypeError, "got bool"),
    ],
)
def test_managers_refuse_a_device_that_holds_no_data(make, device, exc, words):
    """A manager on the meta device would hand out indices that hold nothing."""
    with pytest.raises(exc, match=words):
        make(device)
