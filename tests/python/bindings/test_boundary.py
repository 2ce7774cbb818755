"""The Python boundary under attack: inputs that alias the pool, Python code run
while arguments are read, other threads freeing memory during a call, torch's
lazy views, huge slot values, and the small things a review found.

Each test names the defect it guards against. Several would crash the process
(a read or write of freed memory) if the defect came back, so a run that dies
in this file has found one.
"""

import gc
import os
import threading
import time

import numpy as np
import pytest
import torch

import radixkv
from radixkv import _core, kernel
from radixkv.kvcache import MHAKVCache, RadixCacheManager
from radixkv.scheduler import CacheManager

# Above glibc's largest mmap threshold (32 MiB): freeing such a buffer unmaps
# it, so a read or write of it afterwards faults instead of passing unnoticed.
HUGE = 10_000_000  # int32 elements, 40 MB


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_thread(target):
    errors = []

    def wrapped():
        try:
            target()
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            errors.append(e)

    t = threading.Thread(target=wrapped)
    t.start()
    return t, errors


# --- 1. the CPU store reads each slot once -------------------------------------------


def test_store_out_loc_inside_the_pool_is_read_once():
    """out_loc is an int32 view of slot 0's own row: storing token 0 there rewrites
    token 1's slot (to about 1.9e9) before token 1 is stored. Each slot is read once,
    before anything is written, so token 1 lands in slot 5."""
    c = MHAKVCache(1, 1, 8, num_pages=16, dtype=torch.float32)
    row0 = c.k_cache(0)[0].view(-1)  # 8 floats: slot 0's key row
    loc = row0.view(torch.int32)[:2]
    loc.copy_(torch.tensor([0, 5], dtype=torch.int32))
    k = torch.full((2, 1, 8), 1e30)
    k[1] = 2.0
    c.store_kv(k, k, loc, 0)
    assert c.k_cache(0)[5].eq(2.0).all()
    assert c.k_cache(0)[0].eq(1e30).all()


def test_store_survives_another_thread_rewriting_out_loc():
    """A large store runs without the GIL; another thread keeps writing slots a
    billion past the cache into the last quarter of out_loc, and putting the good
    ones back. The store either raises (it saw them) or writes in range, never out
    of bounds."""
    n = 1 << 17
    kc = torch.zeros(n, 1, 8)
    k = torch.ones(n, 1, 8)
    loc = torch.randperm(n, dtype=torch.int32)
    q = 3 * n // 4
    good = loc[q:].clone()
    stop = threading.Event()

    def vandal():
        while not stop.is_set():
            loc[q:] = 1 << 30
            time.sleep(0.0005)
            loc[q:] = good
            time.sleep(0.0005)

    t = threading.Thread(target=vandal)
    t.start()
    raised = 0
    try:
        for _ in range(40):
            try:
                _core.store_cache(kc, kc.clone(), loc, k, k)
            except ValueError as e:
                assert "is out of range" in str(e)
                raised += 1
    finally:
        stop.set()
        t.join()
    assert raised < 40


# --- 2. no borrowed pointer across Python code run while arguments are read -----------


def test_list_item_index_replacing_an_earlier_tensor():
    """indices is a list whose item's __index__ gives `ids` new storage (freeing
    the old, 400 KB). ids is read after every conversion that runs Python code,
    so the tree caches the tokens ids holds then, and never reads freed memory."""
    m = RadixCacheManager("cpu", 1)
    n = 100_000
    ids = torch.arange(n, dtype=torch.int32)
    new = torch.arange(7, n + 7, dtype=torch.int32)

    class Evil:
        def __index__(self):
            ids.set_(new)
            gc.collect()
            return 1

    m.insert_prefix(ids, [0, Evil()] + list(range(2, n)))
    assert m.match_prefix(new)[0].cached_len == n
    m.check_integrity()


def test_index_freeing_the_first_argument_of_first_mismatch():
    a = torch.arange(HUGE, dtype=torch.int32)

    class Evil:
        def __index__(self):
            a.set_(torch.zeros(3, dtype=torch.int32))
            gc.collect()
            return 0

    assert _core.first_mismatch(a, [0, Evil(), 5]) == 2


# --- 3. memory other threads free while a call runs without the GIL -------------------


def test_free_waiting_for_the_tree_owns_its_indices():
    """PageAllocator.free waits for a tree another thread is inside, with the GIL
    released; meanwhile the caller's indices tensor gets new storage and the old
    (40 MB) is unmapped. The free uses the indices it read before waiting."""
    tree = _core.RadixTree(1)
    pages = _core.PageAllocator(HUGE, 1)
    idx = pages.allocate(HUGE)
    long_ids = torch.arange(HUGE + 6_000_000, HUGE + 22_000_000, dtype=torch.int32)
    busy, busy_errors = run_thread(lambda: tree.insert_prefix(long_ids, long_ids))
    time.sleep(0.02)
    freer, free_errors = run_thread(lambda: pages.free(idx, tree))
    time.sleep(0.05)
    idx.set_(torch.zeros(0, dtype=torch.int32))
    gc.collect()
    busy.join()
    freer.join()
    assert not busy_errors and not free_errors, busy_errors + free_errors
    assert pages.num_free_pages == HUGE
    pages.check_disjoint(None)


@pytest.mark.parametrize("victim", ["k_cache", "k"])
def test_store_without_the_gil_keeps_its_tensors_alive(victim):
    """A large store runs without the GIL; another thread gives the cache (or the
    rows) new storage meanwhile, unmapping the old. The store keeps what it was
    given alive until it is done."""
    n = (1 << 20) + 4096  # over 32 MiB of rows, the cache as large
    loc = torch.randperm(n, dtype=torch.int32)
    # On a loaded machine the thread may start after the swap: then the store
    # rightly refuses the emptied tensor and nothing was tested; again, longer.
    for wait in (0.005, 0.02, 0.05, 0.1):
        tensors = {
            "k_cache": torch.zeros(n, 1, 8),
            "v_cache": torch.zeros(n, 1, 8),
            "k": torch.ones(n, 1, 8),
            "v": torch.ones(n, 1, 8),
        }
        t, errors = run_thread(
            lambda: _core.store_cache(
                tensors["k_cache"], tensors["v_cache"], loc, tensors["k"], tensors["v"]
            )
        )
        time.sleep(wait)
        tensors[victim].set_(torch.zeros(0))
        gc.collect()
        t.join()
        late = [e for e in errors if isinstance(e, TypeError) and "has no data" in str(e)]
        if not late:
            break
    assert not errors, errors
    assert tensors["v_cache"].eq(1).all()


def test_batched_compare_without_the_gil_keeps_its_tensors_alive():
    keys = torch.zeros(20_000, 2_000, dtype=torch.int32)  # 160 MB, compared to the end
    query = torch.zeros(2_000, dtype=torch.int32)
    out = torch.empty(20_000, dtype=torch.int32)
    t, errors = run_thread(lambda: _core.first_mismatch_batched(query, keys, None, out))
    time.sleep(0.002)
    keys.set_(torch.zeros(0, dtype=torch.int32))
    gc.collect()
    t.join()
    assert not errors, errors
    assert out.eq(2_000).all()


# --- 4. torch's lazy negation and conjugation ------------------------------------------


def test_lazy_negation_of_indices_is_resolved():
    """_neg_view(t) means -t: read as such, so negative slots are refused and
    negated negatives are stored as the positives they are."""
    m = RadixCacheManager("cpu", 1)
    ids = torch.tensor([1, 2, 3, 4], dtype=torch.int32)
    positive = torch._neg_view(torch.tensor([-5, -6, -7, -8], dtype=torch.int32))
    assert positive.is_neg()
    assert m.insert_prefix(ids, positive) == 0
    assert m.match_prefix(ids)[1].tolist() == [5, 6, 7, 8]
    negative = torch._neg_view(torch.tensor([9, 10, 11, 12]))
    with pytest.raises(ValueError, match=r"indices\[0\] = -9 is negative"):
        m.insert_prefix(torch.tensor([2, 3, 4, 5]), negative)
    assert m.match_prefix(torch._neg_view(-ids))[0].cached_len == 4


@pytest.mark.parametrize(
    "make",
    [
        lambda x: torch._neg_view(x),
        lambda x: torch.complex(x, x).conj().imag,  # imag of a conjugate view: a negation
    ],
    ids=["neg_view", "conj_imag"],
)
def test_store_refuses_lazy_negation(make):
    kc = torch.zeros(4, 1, 2)
    k = make(torch.ones(2, 1, 2))
    assert k.is_neg()
    with pytest.raises(ValueError, match=r"^k is a lazy negation"):
        kernel.store_cache(kc, kc.clone(), torch.tensor([0, 1]), k, k.resolve_neg())
    assert kc.eq(0).all()
    kernel.store_cache(kc, kc.clone(), torch.tensor([0, 1]), k.resolve_neg(), k.resolve_neg())
    assert kc[:2].eq(-1).all()  # torch's own value of the view


# --- 7. memory follows the slots stored -----------------------------------------------


def test_one_huge_slot_costs_little_memory():
    m = RadixCacheManager("cpu", 1)
    gc.collect()
    before = rss_bytes()
    m.insert_prefix([1, 2, 3], [0, 2**31 - 2, 17])
    grew = rss_bytes() - before
    assert grew < 8 << 20, f"RSS grew by {grew} bytes for three slots"
    assert m.evict(3).numel() == 3
    m.check_integrity()


def test_max_slots_bounds_every_slot():
    m = RadixCacheManager("cpu", 2, max_slots=100)
    with pytest.raises(ValueError, match=r"^indices\[3\] = 100 is out of range \[0, 100\)"):
        m.insert_prefix([1, 2, 3, 4], [96, 97, 98, 100])
    assert m.size_info.total_size == 0
    m.insert_prefix([1, 2, 3, 4], [96, 97, 98, 99])
    with pytest.raises(ValueError, match="max_slots"):
        RadixCacheManager("cpu", 1, max_slots=-1)


def test_cache_manager_bounds_slots_by_its_pool():
    cm = CacheManager(num_pages=8, page_size=2)
    assert cm.manager.max_slots == 16


# --- 8. the smaller ones ----------------------------------------------------------------


def test_store_refuses_a_cache_that_requires_grad():
    kc = torch.zeros(4, 1, 2, requires_grad=True)
    with pytest.raises(ValueError, match=r"^k_cache requires grad"):
        kernel.store_cache(kc, torch.zeros(4, 1, 2), [0], torch.ones(1, 1, 2), torch.ones(1, 1, 2))
    assert kc.eq(0).all()


def test_store_bumps_the_version_of_both_caches():
    c = MHAKVCache(1, 2, 8, num_pages=4, dtype=torch.float16)
    k0, v0 = c.k_cache(1)._version, c.v_cache(1)._version
    c.store_kv(
        torch.ones(1, 1, 8, dtype=torch.float16),
        torch.ones(1, 1, 8, dtype=torch.float16),
        torch.tensor([2]),
        1,
    )
    assert c.k_cache(1)._version > k0 and c.v_cache(1)._version > v0
    # autograd now sees the write: a graph that saved the cache refuses to run
    w = torch.ones(8, requires_grad=True)
    kc = torch.zeros(4, 1, 8)
    y = (kc * w).sum()
    kernel.store_cache(kc, torch.zeros(4, 1, 8), [1], torch.ones(1, 1, 8), torch.ones(1, 1, 8))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_numpy_datetime_and_raising_index_name_the_argument():
    m = RadixCacheManager("cpu", 1)
    with pytest.raises(TypeError, match=r"^input_ids must have an integer dtype"):
        m.match_prefix(np.array(["2020-01-01"], dtype="datetime64[D]"))
    with pytest.raises(TypeError, match=r"^input_ids must have an integer dtype"):
        m.match_prefix(np.array([1], dtype="timedelta64[s]"))

    class Raises:
        def __index__(self):
            raise ArithmeticError("no index today")

    with pytest.raises(TypeError, match=r"^indices\[1\] could not be read as an int") as info:
        m.insert_prefix([1, 2], [0, Raises()])
    assert isinstance(info.value.__cause__, ArithmeticError)
    assert m.size_info.total_size == 0


def test_num_nodes_waits_for_a_call_in_progress():
    """num_nodes takes the tree's mutex: read while a long insert runs, it reports
    the tree before or after that insert, never one half built."""
    tree = _core.RadixTree(1)
    ids = torch.arange(16_000_000, dtype=torch.int32)
    t, errors = run_thread(lambda: tree.insert_prefix(ids, ids))
    time.sleep(0.02)
    seen = tree.num_nodes
    t.join()
    assert not errors
    # Before (the thread had not started yet on a loaded machine) or after.
    assert seen in (0, 1) and tree.num_nodes == 1


def test_cuda_available_needs_a_gpu():
    assert kernel.cuda_available() == (kernel.cuda_built() and torch.cuda.is_available())
    if not torch.cuda.is_available():
        assert kernel.cuda_available() is False


def test_plain_import_reaches_the_subpackages():
    import subprocess
    import sys

    code = (
        "import radixkv; radixkv.kvcache.RadixCacheManager; radixkv.scheduler.CacheManager;"
        "radixkv.kernel.store_cache; print(radixkv.__version__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == radixkv.__version__


def test_bound_methods_carry_docstrings():
    m = RadixCacheManager("cpu", 1)
    for name in ("match_prefix", "insert_prefix", "lock_handle", "evict"):
        doc = getattr(m, name).__doc__ or ""
        assert name in doc and len(doc) > 80, (name, doc)


# --- found by review: Python code run inside a call, and the allocator's guard ---------


def _in_subprocess(code: str, timeout: float = 120):
    """Runs `code` in a fresh interpreter (a hang or a crash is a failure, not the
    end of the test run) and returns its stdout."""
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_finalizer_unlocking_during_a_match_does_not_deadlock():
    """A request object in a reference cycle unlocks its handle in __del__; the
    garbage collector may run it while a match builds its result tensor. Nothing
    runs Python code while the tree's mutex is held, so the unlock goes through."""
    out = _in_subprocess(
        """
import gc, torch
from radixkv.kvcache import RadixCacheManager
gc.set_threshold(50, 1, 1)   # collect often
cm = RadixCacheManager(page_size=1)
cm.insert_prefix(torch.arange(64, dtype=torch.int32), torch.arange(64, dtype=torch.int32))
class Request:
    def __init__(self, ids):
        self.handle, self.cached = cm.match_prefix(ids)
        cm.lock_handle(self.handle)
        self.callbacks = [self.on_done]   # a bound method: a reference cycle
    def on_done(self): pass
    def __del__(self):
        cm.lock_handle(self.handle, unlock=True)
ids = torch.arange(32, dtype=torch.int32)
for i in range(30000):
    Request(ids)
gc.collect()
cm.check_integrity()
print("done", cm.size_info.protected_size)
""",
        timeout=90,
    )
    assert out.strip() == "done 0"


def test_finalizer_freeing_the_input_of_int32_tensor():
    out = _in_subprocess("""
import gc, torch
from radixkv import _core
gc.set_threshold(1, 1, 1)
src = torch.arange(1 << 24, dtype=torch.int32)   # 64 MB: unmapped when freed
class Freer:
    def __del__(self):
        src.set_(torch.empty(0, dtype=torch.int32))
for _ in range(3):
    a = Freer(); b = [a]; a.cycle = b; del a, b
    out = _core.int32_tensor(src, "v")
print("ok", out.numel())
""")
    assert out.startswith("ok")


def test_finalizer_allocating_during_allocate_keeps_the_pages_right():
    out = _in_subprocess("""
import gc, torch
from radixkv import _core
alloc = _core.PageAllocator(8, 1)
gc.set_threshold(1, 1, 1)
class Greedy:
    def __del__(self):
        try:
            alloc.allocate(8)
        except RuntimeError:
            pass
got = []
for _ in range(4):
    a = Greedy(); b = [a]; a.cycle = b; del a, b
    try:
        got.append(alloc.allocate(4).tolist())
    except RuntimeError:
        pass
alloc.check_disjoint(None)
print("free", alloc.num_free_pages, "held", sum(len(g) for g in got))
""")
    free, held = int(out.split()[1]), int(out.split()[3])
    assert 0 <= free <= 8 and held <= 8


def test_free_with_a_busy_tree_runs_the_allocator_under_the_gil():
    """free(indices, tree) waits for a busy tree; while it waits other threads use
    the same allocator (holding only the GIL). It must take the GIL back before
    touching the allocator: no page handed out twice, the free list consistent."""
    tree = _core.RadixTree(1)
    alloc = _core.PageAllocator(400_000, 1)
    for i in range(100):
        s = alloc.allocate(1000)
        tree.insert_prefix(torch.arange(1000, dtype=torch.int32) + i * 100_000, s)
    stop = time.time() + 6
    errors = []

    def busy():
        while time.time() < stop:
            tree.check_integrity()

    def churn(use_tree):
        a = alloc.allocate(100_000)
        while time.time() < stop:
            try:
                alloc.free(a, tree if use_tree else None)
                a = alloc.allocate(100_000)
            except Exception as e:  # noqa: BLE001
                errors.append(repr(e))
                return

    threads = [
        threading.Thread(target=busy),
        threading.Thread(target=churn, args=(True,)),
        threading.Thread(target=churn, args=(False,)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    alloc.check_disjoint(tree)


@pytest.mark.parametrize("entry", ["int32_tensor", "match_prefix", "store_cache"])
def test_fake_tensors_are_refused(entry):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        ids = torch.arange(8, dtype=torch.int32)
        rows = torch.ones(2, 1, 4)
    with pytest.raises(TypeError, match="has no data"):
        if entry == "int32_tensor":
            _core.int32_tensor(ids, "ids")
        elif entry == "match_prefix":
            RadixCacheManager("cpu", 1).match_prefix(ids)
        else:
            kc = torch.zeros(4, 1, 4)
            kernel.store_cache(kc, kc.clone(), [0, 1], rows, torch.ones(2, 1, 4))


def test_negative_bit_set_by_a_later_argument_is_read():
    """A list item's __index__ gives `ids` its negative bit after `ids` was
    looked at: the bit is read when ids is borrowed, after every conversion, so
    the tree stores what ids then reads."""
    m = RadixCacheManager("cpu", 1)
    ids = torch.tensor([5, 6, 7], dtype=torch.int32)

    class Flip:
        def __index__(self):
            torch._C._set_neg(ids, True)
            return 10

    m.insert_prefix(ids, [Flip(), 11, 12])
    assert m.match_prefix(ids)[0].cached_len == 3
    assert m.dump()[0][1] == [-5, -6, -7]


def test_negative_view_wraps_like_torch():
    x = torch._neg_view(torch.tensor([-128, 5], dtype=torch.int8))
    assert _core.int32_tensor(x, "x").tolist() == x.resolve_neg().tolist() == [-128, -5]


def test_store_refuses_overlap_and_expanded_caches():
    c = torch.zeros(8, 1, 4)
    with pytest.raises(ValueError, match="^k lies in the memory of k_cache"):
        kernel.store_cache(c, torch.zeros(8, 1, 4), [5, 6], c[:2], torch.ones(2, 1, 4))
    wide = torch.zeros(1, 1, 4).expand(8, 1, 4)
    with pytest.raises(ValueError, match="^k_cache has stride 0"):
        kernel.store_cache(
            wide, torch.zeros(8, 1, 4), [0], torch.ones(1, 1, 4), torch.ones(1, 1, 4)
        )
    assert c.eq(0).all()


def test_fast_methods_name_themselves_in_argument_errors():
    t = _core.RadixTree(1)
    with pytest.raises(TypeError, match=r"^reset\(\) takes no arguments"):
        t.reset(1)
    with pytest.raises(TypeError, match=r"^handle_slots\(\) missing required argument 'handle'"):
        t.handle_slots()
    with pytest.raises(TypeError, match=r"^match_prefix\(\) takes at most 3 arguments \(4"):
        t.match_prefix([1], 0, False, [2])
    with pytest.raises(TypeError, match="page_size must be an int"):
        _core.RadixTree(True)
    with pytest.raises(ValueError, match="page_size is out of the int64 range"):
        _core.RadixTree(2**70)
    with pytest.raises(TypeError):
        _core.RadixCacheHandle()
