"""The storage tier: the file and Mooncake backends on a real file system and a
real Mooncake master started here, instances sharing a store, configurations
that must never read each other's pages, and faults injected into every call.
Every page a request is handed is checked against the K/V stored for its
tokens."""

import os
import signal
import threading
import time

import pytest
import torch

import radixkv
from radixkv.kvcache import MHAKVCache
from radixkv.kvcache.host_pool import HostKVCache
from radixkv.replay.replay import KVShape
from radixkv.scheduler import CacheManager
from radixkv.storage import (
    FaultyStorage,
    FileStorage,
    MooncakeMaster,
    MooncakeStorage,
    StorageBackend,
)
from radixkv.storage.file import HEADER
from storage_env import KV, PAGE, Instance, fingerprint, host_pool, keys, needs_mooncake, prompt

# -- the file backend ---------------------------------------------------------------


def test_file_pages_round_trip_and_exists_counts_from_the_first(tmp_path):
    pool = host_pool()
    fs = FileStorage(str(tmp_path), fingerprint())
    fs.attach(pool)
    ks = keys(4)
    assert fs.batch_set(ks[:3], [0, 1, 2]) == [True] * 3
    assert fs.batch_exists(ks) == 3
    assert fs.batch_exists([ks[3]] + ks[:3]) == 0  # a miss first: nothing after counts
    before = pool.kv_buffer.clone()
    assert fs.batch_get(ks[:3], [5, 6, 7]) == [True] * 3
    b = pool.kv_buffer.view(torch.uint8).reshape(8, -1)
    o = before.view(torch.uint8).reshape(8, -1)
    assert torch.equal(b[5:8], o[0:3])
    assert fs.batch_get([ks[3]], [4]) == [False]  # a miss leaves the page as it was
    assert torch.equal(b[4], o[4])
    leftovers = [
        f for d in os.listdir(tmp_path) for f in os.listdir(tmp_path / d) if f.endswith(".tmp")
    ]
    assert not leftovers


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "foreign", "moved", "longer"])
def test_a_damaged_or_foreign_page_is_a_miss_never_wrong_kv(tmp_path, damage):
    pool = host_pool()
    fs = FileStorage(str(tmp_path), fingerprint())
    fs.attach(pool)
    k = keys(2)
    assert fs.batch_set(k[:1], [0]) == [True]
    path = fs.path(k[0])
    data = open(path, "rb").read()
    if damage == "flip":
        data = data[:-10] + bytes([data[-10] ^ 0x40]) + data[-9:]
    elif damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "empty":
        data = b""
    elif damage == "longer":
        data = data + b"x"
    elif damage == "foreign":  # another configuration's page under our key
        other = FileStorage(str(tmp_path / "other"), fingerprint(dtype=torch.bfloat16))
        other.attach(pool)
        other.batch_set(k[:1], [0])
        data = open(other.path(k[0]), "rb").read()
    elif damage == "moved":  # a page stored under another key
        os.makedirs(os.path.dirname(fs.path(k[1])), exist_ok=True)
        path = fs.path(k[1])
        k = [k[1]]
    with open(path, "wb") as f:
        f.write(data)
    page = pool.kv_buffer.view(torch.uint8).reshape(8, -1)[3].clone()
    # (A payload read in part, then refused, leaves bytes in a page the failed
    # read owns and nobody uses: it is freed, never inserted.)
    assert fs.batch_get(k[:1], [3]) == [False]
    assert fs.corrupt_pages == 1
    if damage in ("empty", "foreign", "moved"):  # refused at the header: page untouched
        assert torch.equal(pool.kv_buffer.view(torch.uint8).reshape(8, -1)[3], page)
    # ... and removed, so the next write of the page replaces it.
    assert fs.batch_exists(k[:1]) == 0
    assert fs.batch_set(k[:1], [0]) == [True] and fs.batch_get(k[:1], [3]) == [True]


def test_file_store_bounded_by_least_recent_use(tmp_path):
    pool = host_pool()
    page_file = HEADER.size + pool.kv_buffer.numel() * 2 // 8
    fs = FileStorage(str(tmp_path), fingerprint(), max_bytes=3 * page_file)
    fs.attach(pool)
    assert fs.wait_indexed(10)
    k = keys(5)
    fs.batch_set(k[:3], [0, 1, 2])
    assert fs.batch_get([k[0]], [7]) == [True]  # k0 is now the most recent
    fs.batch_set(k[3:5], [3, 4])  # two more: k1 and k2 go
    assert [os.path.exists(fs.path(x)) for x in k] == [True, False, False, True, True]
    assert fs.removed_pages == 2
    again = FileStorage(str(tmp_path), fingerprint(), max_bytes=3 * page_file)  # rescans
    again.attach(pool)
    assert again.wait_indexed(10) and again.stored_bytes == 3 * page_file
    assert again.batch_exists([k[0]]) == 1


# -- instances sharing a store ---------------------------------------------------------


def test_a_second_instance_reads_the_first_ones_pages(tmp_path):
    a = Instance(FileStorage(str(tmp_path), fingerprint()))
    b = Instance(FileStorage(str(tmp_path), fingerprint()))
    ids = prompt(1, 6)
    assert a.serve(ids) == (0, 0, 0)
    device, host, got = b.serve(ids)
    assert (device, host, got) == (0, 6 * PAGE, 6 * PAGE)  # every whole page from storage
    assert b.cm.storage_counters.prefetched_tokens == 6 * PAGE
    assert b.cm.metrics.storage_prefetched_tokens == 6 * PAGE
    assert b.serve(ids)[0] == 6 * PAGE  # then from its own device
    # Storage is what fell out of host memory too: A evicts everything, reads it back.
    a.evict_everything()
    assert a.serve(ids)[2] == 6 * PAGE
    a.close(), b.close()


@pytest.mark.parametrize(
    "change",
    [
        dict(dtype=torch.bfloat16),
        dict(model="other"),
        dict(namespace="tenant-b"),
        dict(revision="weights-v2"),
    ],
)
def test_configurations_sharing_a_store_never_read_each_others_pages(tmp_path, change):
    """SGLang #33268 (dtype missing from the key), #26747 (namespaces)."""
    a = Instance(FileStorage(str(tmp_path), fingerprint()))
    seed = fingerprint(**change)
    kv = KV if "dtype" not in change else KVShape(2, 2, 8, torch.bfloat16)
    b = Instance(FileStorage(str(tmp_path), seed), seed=seed, kv=kv)
    ids = prompt(2, 5)
    a.serve(ids)
    assert b.serve(ids) == (0, 0, 0)
    assert b.cm.storage_counters.prefetched_tokens == 0
    b.serve(ids)
    c = Instance(FileStorage(str(tmp_path), seed), seed=seed, kv=kv)  # same config as b
    assert c.serve(ids)[2] == 5 * PAGE
    a.close(), b.close(), c.close()


def test_host_pages_are_released_only_after_the_storage_thread_acknowledges(tmp_path):
    """SGLang #19126: host slots freed while the storage thread still read them."""
    gate = threading.Event()

    class Slow(FileStorage):
        def batch_set(self, keys, pages):
            gate.wait(10)
            return super().batch_set(keys, pages)

    a = Instance(Slow(str(tmp_path), fingerprint()), host_pages=6)
    ids = prompt(3, 5)
    a.serve(ids, drain=False)
    a.cm._tiers.host.controller.drain()
    a.cm.writing_check()  # the backup landed: its write is queued
    info = a.cm.host_size_info
    assert a.cm._tree.tier_sizes()[6] == 5 * PAGE  # pinned while written
    with pytest.raises(radixkv.OutOfCapacityError):
        a.cm._tree.evict_host(PAGE)
    a.cm.check_integrity()
    gate.set()
    a.cm._tiers.storage.drain()
    assert a.cm._tree.tier_sizes()[6] == 0
    a.cm._tree.evict_host(PAGE)  # now it may go
    assert info.cached == 5 * PAGE
    a.close()


# -- faults ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("policy", ["best_effort", "wait_complete", "timeout"])
def test_faults_in_every_call_give_no_wrong_kv_no_leak_no_hang(tmp_path, seed, policy):
    """Seeded delays, failed calls and pages, torn reads: requests are served,
    each cached row is checked, both pools add up, nothing hangs."""

    def backend(s):
        return FaultyStorage(
            FileStorage(str(tmp_path), fingerprint()),
            seed=s,
            fail_call=0.1,
            fail_page=0.15,
            max_delay_s=0.0005,
        )

    # No back-off: every call goes to the faulty store.
    insts = [
        Instance(backend(seed * 10 + i), pages=10, host_pages=12, policy=policy, retry_after_s=0)
        for i in range(2)
    ]
    g = torch.Generator().manual_seed(seed)
    prompts = [prompt(100 + k, 3 + k % 4) for k in range(8)]
    deadline = time.monotonic() + 60
    for step in range(60):
        inst = insts[int(torch.randint(0, 2, (1,), generator=g))]
        ids = prompts[int(torch.randint(0, len(prompts), (1,), generator=g))]
        inst.serve(ids, drain=step % 3 != 0)
        if step % 7 == 0:
            inst.evict_everything()
        assert time.monotonic() < deadline, "the storage tier hung"
    for inst in insts:
        inst.cm.drain()
        inst.cm.check_integrity()
        info = inst.cm.host_size_info
        assert info.free + info.cached == info.capacity
        assert inst.cm.held_pages == 0
        inst.close()
    errors = sum(i.cm._tiers.storage.backend.errors for i in insts)
    assert errors > 0  # the faults did happen, and were counted
    assert sum(i.cm.storage_counters.skipped for i in insts) == 0


def test_a_store_that_stops_answering_is_left_alone_then_retried(tmp_path):
    """A dead store costs a few failed calls per back-off window, not one per
    request: after three failures in a row a direction is left alone, its
    calls skipped and counted meanwhile; a failed retry doubles the window,
    and the first call after it that succeeds ends the back-off."""

    class Switch(FileStorage):
        down = False
        calls = 0

        def _fail(self, n):
            self.calls += 1
            if self.down:
                self.count_error(n)
            return self.down

        def batch_exists(self, keys):
            return 0 if self._fail(1) else super().batch_exists(keys)

        def batch_get(self, keys, pages):
            return [False] * len(keys) if self._fail(len(keys)) else super().batch_get(keys, pages)

        def batch_set(self, keys, pages):
            return [False] * len(keys) if self._fail(len(keys)) else super().batch_set(keys, pages)

    store = Switch(str(tmp_path), fingerprint())
    a = Instance(store, host_pages=24, retry_after_s=1.0)  # the loop below fits in it
    tier = a.cm._tiers.storage
    a.serve(prompt(1, 3))
    assert a.cm.storage_counters.written_pages == 3
    store.down = True
    for k in range(3):  # reads and writes fail three times in a row
        a.serve(prompt(2 + k, 3))
    assert tier.reads_down() and tier.writes_down()
    calls = store.calls
    for k in range(5):
        a.evict_everything()
        a.serve(prompt(5 + k, 3))  # neither prefetched nor written
    assert store.calls == calls
    c = a.cm.storage_counters
    assert c.skipped_reads >= 5 and c.skipped_writes >= 5
    assert c.skipped == c.skipped_reads + c.skipped_writes
    time.sleep(1.1)
    a.serve(prompt(20, 3))  # the retries fail: the windows double
    assert tier.reads_down() and tier._io.reads.backoff_s == pytest.approx(2.0)
    assert tier.writes_down() and tier._io.writes.backoff_s == pytest.approx(2.0)
    store.down = False
    time.sleep(2.1)
    a.evict_everything()
    assert a.serve(prompt(1, 3))[2] == 3 * PAGE  # back: prefetched again
    assert not tier.reads_down() and tier._io.reads.backoff_s == 0
    a.cm.check_integrity()
    info = a.cm.host_size_info
    a.cm.drain()
    assert info.free + info.cached == info.capacity
    a.close()


# -- Mooncake Store -------------------------------------------------------------------


@pytest.fixture(scope="module")
def master():
    with MooncakeMaster() as m:
        yield m


@needs_mooncake
def test_mooncake_instances_share_pages_through_a_real_master(master):
    def backend():
        return MooncakeStorage(
            master.master_address,
            master.metadata_server,
            listen_on_all_interfaces=True,
            segment_bytes=32 << 20,
            buffer_bytes=16 << 20,
        )

    a, b = Instance(backend()), Instance(backend())
    ids = prompt(5, 6)
    assert a.serve(ids) == (0, 0, 0)
    assert b.serve(ids) == (0, 6 * PAGE, 6 * PAGE)
    assert a.cm.storage_counters.written_pages == 6
    seed = fingerprint(namespace="mooncake-other")
    c = Instance(backend(), seed=seed)
    assert c.serve(ids) == (0, 0, 0)  # another namespace: never our pages
    a.close(), b.close(), c.close()


@needs_mooncake
def test_a_stopped_master_leaves_no_log_behind():
    with MooncakeMaster() as m:
        path = m.log_path
        assert os.path.exists(path)
    assert not os.path.exists(path)


@needs_mooncake
def test_mooncake_master_stopped_mid_run_is_counted_not_a_crash_or_hang():
    m = MooncakeMaster()
    a = Instance(
        MooncakeStorage(
            m.master_address,
            m.metadata_server,
            listen_on_all_interfaces=True,
            segment_bytes=32 << 20,
            buffer_bytes=16 << 20,
        )
    )
    a.serve(prompt(6, 4))
    m.stop()
    t0 = time.monotonic()
    for k in range(4):
        a.serve(prompt(7 + k, 4))
        a.evict_everything()
        a.serve(prompt(6, 4))  # wants its pages back from a store that is gone
    assert time.monotonic() - t0 < 120
    a.cm.check_integrity()
    assert a.cm.storage_counters.errors > 0
    assert a.cm.storage_counters.skipped > 0  # left alone after it stopped answering
    a.close()


def test_a_backend_needs_a_page_first_host_pool(tmp_path):
    dev = MHAKVCache(1, 1, 8, 4, torch.float16, page_size=PAGE)
    with pytest.raises(ValueError, match="page_first"):
        FileStorage(str(tmp_path), fingerprint()).attach(HostKVCache(dev, 4, layout="layer_first"))
    with pytest.raises(ValueError, match="storage tier needs a host tier"):
        CacheManager(
            4, page_size=PAGE, kv_cache=dev, storage=FileStorage(str(tmp_path), fingerprint())
        )
    with pytest.raises(ValueError, match="32 bytes"):
        FileStorage(str(tmp_path), b"short")
    assert issubclass(FileStorage, StorageBackend)


# -- the review's findings ------------------------------------------------------------


def test_a_storage_tier_needs_a_seed_naming_its_configuration(tmp_path):
    class Bare(FileStorage):
        pass

    dev = MHAKVCache(KV.num_kv_heads, KV.num_layers, KV.head_dim, 4, KV.dtype, page_size=PAGE)
    store = Bare(str(tmp_path), fingerprint())
    store.fingerprint = None  # a backend that cannot name the configuration
    with pytest.raises(ValueError, match="storage_seed"):
        CacheManager(4, page_size=PAGE, kv_cache=dev, host_num_pages=8, storage=store)
    with pytest.raises(ValueError, match="storage_seed"):
        CacheManager(
            4, page_size=PAGE, kv_cache=dev, host_num_pages=8, storage=store, storage_seed=b"short"
        )
    # The backend's own fingerprint seeds the keys; b"" asks for unseeded ones.
    a = Instance(FileStorage(str(tmp_path), fingerprint()), seed=b"")
    assert a.cm._tiers.storage.seed is None
    a.close()
    cm = CacheManager(
        4,
        page_size=PAGE,
        kv_cache=dev,
        host_num_pages=8,
        storage=FileStorage(str(tmp_path), fingerprint(model="m")),
    )
    assert cm._tiers.storage.seed == fingerprint(model="m")
    cm.close()


def test_after_close_nothing_is_written_or_pinned_and_drain_returns(tmp_path):
    a = Instance(FileStorage(str(tmp_path), fingerprint()))
    ids = prompt(30, 4)
    a.serve(ids, drain=False)  # a backup still in flight: close() lands and writes it
    a.close()
    tree = a.cm._tree
    assert tree.tier_sizes()[6] == 0 and tree.host_pins == 0
    assert a.cm.storage_counters.written_pages == 4
    assert a.cm.prefetch(prompt(31, 4)) is None
    a.serve(prompt(32, 4))  # the cache keeps serving, without storage
    assert a.cm.drain() == []
    a.cm.check_integrity()


def test_check_integrity_sees_a_pin_or_a_write_nobody_holds(tmp_path):
    a = Instance(FileStorage(str(tmp_path), fingerprint()))
    ids = prompt(33, 4)
    a.serve(ids)
    pin = a.cm._tree.pin_host(ids[: 4 * PAGE])
    assert pin is not None
    with pytest.raises(radixkv.IntegrityError, match="pins"):
        a.cm.check_integrity()
    a.cm._tree.unpin_host(pin)
    a.cm.check_integrity()
    a.close()


class _Dead(FileStorage):
    """Answers existence queries; every write fails (`raises`: by raising)."""

    raises = False

    def batch_set(self, keys, pages):
        if self.raises:
            raise OSError("store gone")
        self.count_error(len(keys))
        return [False] * len(keys)


@pytest.mark.parametrize("raises", [False, True])
def test_back_off_doubles_while_writes_fail_though_queries_answer(tmp_path, raises):
    store = _Dead(str(tmp_path), fingerprint())
    store.raises = raises
    a = Instance(store, retry_after_s=0.05)
    tier = a.cm._tiers.storage
    windows = []
    for k in range(6):
        a.serve(prompt(40 + k, 2))
        windows.append(round(tier._io.writes.backoff_s, 3))
        time.sleep(tier._io.writes.backoff_s + 0.01)
    assert windows == [0, 0, 0.05, 0.1, 0.2, 0.4]  # from the third failure in a row
    assert not tier.reads_down()  # reads answer: they are not left alone
    counters = a.cm.storage_counters
    assert counters.write_failures == 6 * 2 and counters.errors >= 6 * 2
    a.close()


def test_a_prefetch_waited_for_is_applied_when_its_thread_finishes(tmp_path):
    """The thread queues a finished read before it wakes the waiter."""
    a = Instance(FileStorage(str(tmp_path), fingerprint()))
    ids = prompt(50, 6)
    a.serve(ids)
    for _ in range(50):
        b = Instance(FileStorage(str(tmp_path), fingerprint()))
        op = b.cm.prefetch(ids)
        assert b.cm.wait_prefetch(op) == 6 * PAGE and op.applied
        b.close()
    a.close()


def test_file_bound_follows_pages_removed_by_another_process(tmp_path):
    pool = host_pool()
    page_file = HEADER.size + pool.kv_buffer.numel() * 2 // 8
    a = FileStorage(str(tmp_path), fingerprint(), max_bytes=4 * page_file)
    b = FileStorage(str(tmp_path), fingerprint())
    a.attach(pool), b.attach(pool)
    assert a.wait_indexed(10)
    k = keys(4)
    a.batch_set(k, [0, 1, 2, 3])
    os.unlink(b.path(k[0]))  # another process removes one
    assert a.batch_get([k[0]], [5]) == [False]  # a miss, and no longer counted
    assert a.stored_bytes == 3 * page_file
    # A restart with a smaller bound trims once its scan is done.
    c = FileStorage(str(tmp_path), fingerprint(), max_bytes=2 * page_file)
    assert c.wait_indexed(10) and c.stored_bytes <= 2 * page_file
    assert sum(os.path.exists(c.path(x)) for x in k) == 2


def test_faults_report_the_wrapped_backends_counts_too(tmp_path):
    inner = FileStorage(str(tmp_path), fingerprint())
    f = FaultyStorage(inner, fail_call=0, fail_page=0, max_delay_s=0)
    f.attach(host_pool())
    k = keys(1)
    assert f.batch_set(k, [0]) == [True]
    with open(inner.path(k[0]), "r+b") as fh:
        fh.write(b"garbage!")
    assert f.batch_get(k, [1]) == [False]
    assert f.counts() == (0, 1)


def test_close_without_waiting_drops_the_queued_writes(tmp_path):
    """`close(wait=False)`: the write running finishes, the ones queued behind
    it are dropped, the thread stops and the backend is closed."""

    class Held(FileStorage):
        def __init__(self, *args):
            super().__init__(*args)
            self.release, self.sets, self.closed = threading.Event(), 0, False

        def batch_set(self, keys, pages):
            self.sets += 1
            self.release.wait()
            return super().batch_set(keys, pages)

        def close(self):
            self.closed = True
            super().close()

    store = Held(str(tmp_path), fingerprint())
    a = Instance(store, host_pages=48)
    for k in range(4):
        a.serve(prompt(60 + k, 2), drain=False)
    a.cm._tiers.settle_backups()  # every backup landed: four writes queued or running
    tier = a.cm._tiers.storage
    deadline = time.monotonic() + 60  # a hang guard
    while store.sets < 1:  # the thread holds the first write
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert tier._io.write_jobs.qsize() >= 2  # behind the one the thread holds
    closer = threading.Thread(target=a.cm.close, kwargs={"wait": False})
    closer.start()
    while not (tier._closed and tier._io.write_jobs.qsize() <= 1):  # only the stop is queued
        assert time.monotonic() < deadline
        time.sleep(0.01)
    store.release.set()
    closer.join()
    assert store.sets == 1 and store.closed
    assert not tier.thread_alive and not tier._writer.is_alive()
    # The dropped writes' host pages were released, the one made was applied.
    assert a.cm._tree.tier_sizes()[6] == 0
    assert a.cm.storage_counters.written_pages == 2
    a.cm.check_integrity()
    assert a.cm.prefetch(prompt(60, 2)) is None  # closed: no more storage calls
    assert store.sets == 1


def test_backups_that_land_during_a_prefetch_are_written_before_it_makes_host_room(tmp_path):
    # A prefetch that first copies its path to host again waits for every
    # backup in flight; those must be pinned by their writes to storage
    # before the prefetch makes host room, which would evict them otherwise.
    a = Instance(FileStorage(str(tmp_path), fingerprint()))
    p = prompt(1, 6)
    a.serve(p)
    a.close()
    b = Instance(FileStorage(str(tmp_path), fingerprint()), pages=16, host_pages=4)
    b.serve(torch.cat([p[:PAGE], torch.tensor([7], dtype=torch.int32)]))  # p's first page
    b.serve(prompt(2, 3))  # the host tier is full
    q = prompt(3, 3)
    b.serve(q, drain=False)  # its backup is in flight
    b.serve(p, drain=False)  # prefetch: the path to host again, then room for the pages
    b.cm.drain()
    b.cm.check_integrity()
    st = b.cm._tiers.storage
    assert st.backend.batch_exists(st.keys_of(q[: 3 * PAGE])) == 3
    b.close()


def test_ctrl_c_while_backups_are_applied_still_queues_their_writes(tmp_path):
    # Applying a backup and queueing its write to storage are one step: a
    # Ctrl-C that arrives meanwhile waits for both, so the host copy is
    # pinned by its write before anything can evict it.
    a = Instance(FileStorage(str(tmp_path), fingerprint()), host_pages=8)
    a.serve(prompt(1, 3), drain=False)  # its write_through backup is in flight
    tier = a.cm._tiers.host
    real = tier.controller

    class InterruptedAcks:
        def __getattr__(self, name):
            return getattr(real, name)

        def take_backup_acks(self):
            signal.raise_signal(signal.SIGINT)
            return real.take_backup_acks()

    tier.controller = InterruptedAcks()
    try:
        with pytest.raises(KeyboardInterrupt):
            a.cm.drain()
    finally:
        tier.controller = real
    assert a.cm._tree.tier_sizes().storage_writing == 3 * PAGE  # pinned by its write
    tier.free_host_slots(8 * PAGE, all_or_nothing=False)  # a host eviction before the next tier call
    a.cm.drain()
    a.cm.check_integrity()
    assert a.cm.storage_counters.written_pages == 3
    a.close()
