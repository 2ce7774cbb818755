"""The host and storage tiers when storage, masters or callers misbehave: no
hang, no lost hit, no leak, no crash. Real files (FIFOs, directories and
unreadable files at page paths, a file-size limit), a real Mooncake master
paused with SIGSTOP, real threads and real signals. Every row a request is
handed is checked against the K/V stored for its tokens."""

import asyncio
import ctypes
import gc
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import weakref

import pytest
import torch

from radixkv.kvcache import KVCacheLayout, MHAKVCache, MLAKVCache
from radixkv.kvcache.host_pool import HostKVCache
from radixkv.scheduler import CacheManager, StorageFaultPolicy
from radixkv.scheduler import cache as cache_module
from radixkv.scheduler import host_tier as host_tier_module
from radixkv.scheduler import storage_tier as storage_tier_module
from radixkv.scheduler import tiers as tiers_module
from radixkv.scheduler import upkeep as upkeep_module
from radixkv.storage import threads as storage_threads_module
from radixkv.storage import FaultyStorage, FileStorage, MooncakeMaster, MooncakeStorage
from storage_env import (
    KV,
    NOBODY,
    PAGE,
    Instance,
    fingerprint,
    host_pool,
    keys,
    needs_mooncake,
    prompt,
)

HELPERS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/python


def finishes(fn, limit_s=20.0):
    """Runs `fn` on a daemon thread; returns (finished in time, its result or
    exception). A hang guard: the test fails instead of hanging."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - reported to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(limit_s)
    return not t.is_alive(), out


def written(cm):
    return cm.storage_counters.written_pages


# -- 1. a FIFO at a page path ----------------------------------------------------------


def test_a_fifo_at_a_page_path_is_a_miss_not_a_hang(tmp_path):
    pool = host_pool()
    fs = FileStorage(str(tmp_path), fingerprint())
    fs.attach(pool)
    k = keys(2)
    assert fs.batch_set(k, [0, 1]) == [True, True]
    os.unlink(fs.path(k[1]))
    os.mkfifo(fs.path(k[1]))
    assert fs.batch_exists(k) == 1  # the FIFO is not a page
    done, out = finishes(lambda: fs.batch_get(k, [2, 3]))
    assert done, "a read of a FIFO at a page path hung"
    assert out["value"] == [True, False]
    assert not os.path.exists(fs.path(k[1]))  # removed: the next write puts a page there
    assert fs.batch_set(k[1:], [1]) == [True] and fs.batch_get(k[1:], [3]) == [True]


def test_a_request_whose_page_is_a_fifo_is_served(tmp_path):
    a = Instance(FileStorage(str(tmp_path), fingerprint()))
    ids = prompt(1, 4)
    a.serve(ids)
    b = Instance(FileStorage(str(tmp_path), fingerprint()))
    path = b.cm._tiers.storage.backend.path(b.cm._tiers.storage.keys_of(ids)[2])
    os.unlink(path)
    os.mkfifo(path)
    done, out = finishes(lambda: b.serve(ids))
    assert done, "the tier hung on a FIFO"
    assert "error" not in out, out.get("error")
    assert out["value"][2] == 2 * PAGE  # the two pages before the FIFO
    a.close(), b.close()


class Stuck(FileStorage):
    """Every read (or, with `writes=True`, every write) blocks until
    released: a hung device, a FIFO of old, a slow disk taking a backlog."""

    def __init__(self, *args, writes=False, **kw):
        super().__init__(*args, **kw)
        self.release = threading.Event()
        self.writes = writes

    def batch_get(self, keys, pages):
        if not self.writes:
            self.release.wait()
        return super().batch_get(keys, pages)

    def batch_set(self, keys, pages):
        if self.writes:
            self.release.wait()
        return super().batch_set(keys, pages)


@pytest.mark.parametrize("wait", [True, False])
def test_shutdown_is_bounded_whatever_the_storage_does(tmp_path, wait):
    a = Instance(FileStorage(str(tmp_path), fingerprint()))
    ids = prompt(2, 4)
    a.serve(ids)
    store = Stuck(str(tmp_path), fingerprint())
    b = Instance(store, policy="best_effort", faults=StorageFaultPolicy(close_timeout_s=0.5))
    op = b.cm.prefetch(ids)  # its read blocks on the storage thread
    assert op is not None
    t0 = time.monotonic()
    done, out = finishes(lambda: b.cm.close(wait=wait))
    assert done and "error" not in out, out.get("error")
    assert time.monotonic() - t0 < 5
    # The read's host pages stay its own while it may still write them.
    b.cm.check_integrity()
    b.serve(prompt(3, 2))  # the cache goes on without storage
    store.release.set()
    a.close()


# -- 2. an unreadable entry ---------------------------------------------------------------


def test_a_directory_at_a_popular_page_path_does_not_turn_the_store_off(tmp_path):
    a = Instance(FileStorage(str(tmp_path), fingerprint()), host_pages=48)
    popular = prompt(10, 2)
    backend = a.cm._tiers.storage.backend
    path = backend.path(a.cm._tiers.storage.keys_of(popular)[0])
    os.makedirs(os.path.join(path, "inside"))  # a directory where the page goes
    for _ in range(3):
        a.evict_everything()
        a.serve(popular)
    for k in range(40):  # 160 unrelated pages
        a.serve(prompt(100 + k, 4))
    assert written(a.cm) >= 160 + 2
    assert os.path.isfile(path)  # the entry was replaced by the page
    counters = a.cm.storage_counters
    assert counters.skipped_reads == counters.skipped_writes == 0
    a.close()


def nest(path, depth):
    """Makes `path` a directory `depth` levels deep (d/d/d/...), reached a
    level at a time, so no path grows past PATH_MAX."""
    os.mkdir(path)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(depth - 1):
        os.mkdir("d", dir_fd=fd)
        inner = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = inner
    os.close(fd)


def test_a_directory_1200_levels_deep_at_a_page_path_costs_only_its_page(tmp_path):
    """Deeper than the interpreter's recursion limit: removed all the same,
    the page written there, no batch failed and no direction backed off;
    a bounded store's scan removes one too and indexes every other page."""
    a = Instance(FileStorage(str(tmp_path / "store"), fingerprint()), host_pages=48)
    tier = a.cm._tiers.storage
    popular = prompt(10, 1)  # one page: each write of it is a batch of its own
    a.serve(prompt(9, 1))
    path = tier.backend.path(tier.keys_of(popular)[0])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    nest(path, 1200)
    for _ in range(3):
        a.evict_everything()
        a.serve(popular)
    assert os.path.isfile(path)  # the tree was removed and the page written
    a.serve(prompt(11, 3))
    counters = a.cm.storage_counters
    assert counters.write_failures == 0 and counters.errors == 0, counters
    assert counters.skipped_writes == counters.skipped_reads == 0
    assert written(a.cm) == 1 + 1 + 3
    a.close()
    # The start-up scan of a bounded store meets one.
    nest(path + ".deep", 1)  # (not a page's name: left alone)
    os.unlink(path)
    nest(path, 1200)
    lost = []
    hook, threading.excepthook = threading.excepthook, lambda args: lost.append(args)
    try:
        fs = FileStorage(str(tmp_path / "store"), fingerprint(), max_bytes=1 << 30)
        fs.attach(host_pool())
        assert fs.wait_indexed(60)
    finally:
        threading.excepthook = hook
    assert lost == [], lost[0].exc_value
    assert not os.path.lexists(path) and os.path.isdir(path + ".deep")
    assert fs.stored_bytes == 4 * fs.file_bytes  # every other page indexed
    assert fs.corrupt_pages == 1 and fs.errors == 0


def test_an_entry_the_reader_may_not_read_is_a_miss_for_that_page(tmp_path):
    """EACCES on one page: a miss for it, removed, the store stays on. Run
    where permissions bind (root reads anything)."""
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {HELPERS!r})
        from storage_env import Instance, fingerprint, prompt
        from radixkv.storage import FileStorage
        d = {str(tmp_path / "store")!r}
        a = Instance(FileStorage(d, fingerprint()))
        ids = prompt(1, 3)
        a.serve(ids)
        b = Instance(FileStorage(d, fingerprint()))
        path = b.cm._tiers.storage.backend.path(b.cm._tiers.storage.keys_of(ids)[1])
        os.chmod(path, 0)
        assert not os.access(path, os.R_OK), "still readable"
        dev, host, got = b.serve(ids)
        assert got == 4, got                      # the page before the unreadable one
        c = b.cm.storage_counters
        assert c.corrupt_pages == 1 and c.skipped == 0, c
        assert os.access(path, os.R_OK)           # removed, and written again by b
        b.serve(prompt(2, 3))
        assert b.cm.storage_counters.written_pages == 2 + 3  # the store stays on
        b.evict_everything()
        assert b.serve(ids)[2] == 12              # written again, read whole
        print("ok")
    """)
    run_unprivileged(script, tmp_path)


def run_unprivileged(script, tmp_path, groups=()):
    """Runs `script` in a Python subprocess that permissions bind: as root,
    without the capabilities that let root read, write or remove any file
    (and in the supplementary `groups`, when given)."""
    os.makedirs(tmp_path / "store", exist_ok=True)
    cmd = [sys.executable, "-c", script]
    if os.geteuid() == 0:
        caps = "-dac_override,-dac_read_search,-fowner"
        cmd = ["setpriv", f"--bounding-set={caps}", f"--inh-caps={caps}"] + cmd
        if groups:
            cmd.insert(1, "--groups=" + ",".join(map(str, groups)))
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


@pytest.mark.skipif(
    os.geteuid() != 0, reason="another user's entries need root, to act as a second user (nobody)"
)
def test_entries_the_engine_cannot_remove_cost_only_their_own_pages(tmp_path):
    """In a store shared with a group, another member (nobody) puts a
    directory of its own, a file in it, at a page's path, and makes a key
    directory of its own, 0755 with a file in it: neither is the engine's to
    remove or write in. Each costs the pages it holds, counted as bad
    entries; no direction backs off, every other page is written and read."""
    store = tmp_path / "store"
    store.mkdir()
    os.chown(store, 0, NOBODY)
    os.chmod(store, 0o2770)
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {HELPERS!r})
        from storage_env import PAGE, Instance, as_nobody, fingerprint, prompt
        from radixkv.storage import FileStorage
        a = Instance(FileStorage({str(store)!r}, fingerprint(), shared=True), host_pages=48,
                     retry_after_s=60)
        tier = a.cm._tiers.storage
        a.serve(prompt(1, 1))                     # the store exists
        taken = set(os.listdir(tier.backend.directory))

        def pick(seed, pages):
            # A prompt whose key directories are none of `taken`.
            while {{k[:2] for k in tier.keys_of(prompt(seed, pages))}} & taken:
                seed += 1
            ids = prompt(seed, pages)
            taken.update(k[:2] for k in tier.keys_of(ids))
            return ids, tier.keys_of(ids)

        (popular, (pop,)), (blocked, (blk,)) = pick(10, 1), pick(20, 1)
        others = [pick(100 + 10 * k, 3)[0] for k in range(5)]
        as_nobody(tier.backend.directory, f'''
            os.mkdir("{{pop[:2]}}", dir_fd=top)          # a key directory all may write
            os.chmod("{{pop[:2]}}", 0o2770, dir_fd=top)
            os.mkdir("{{pop[:2]}}/{{pop}}.page", 0o755, dir_fd=top)
            os.close(os.open("{{pop[:2]}}/{{pop}}.page/x", os.O_CREAT | os.O_WRONLY, dir_fd=top))
            os.mkdir("{{blk[:2]}}", 0o755, dir_fd=top)   # nobody's alone
            os.chmod("{{blk[:2]}}", 0o755, dir_fd=top)
            os.close(os.open("{{blk[:2]}}/x", os.O_CREAT | os.O_WRONLY, dir_fd=top))
        ''')
        for _ in range(3):                        # each a batch of one page
            a.evict_everything()
            a.serve(popular)
            a.serve(blocked)
        for ids in others:
            a.serve(ids)
        c = a.cm.storage_counters
        assert c.skipped_writes == c.skipped_reads == 0, c
        assert not tier.writes_down() and not tier.reads_down()
        assert c.write_failures == 6 and c.errors == 0 and c.corrupt_pages >= 6, c
        assert c.written_pages == 1 + 5 * 3, c
        a.evict_everything()
        for ids in others:
            assert a.serve(ids)[2] == 3 * PAGE
        assert os.path.isdir(tier.backend.path(pop))  # still there: not ours to remove
        print("ok")
    """)
    run_unprivileged(script, tmp_path, groups=[NOBODY])


# -- 3. failing writes ------------------------------------------------------------------


def test_a_store_that_cannot_take_writes_still_serves_what_it_has(tmp_path):
    """Writes fail with EFBIG (a file-size limit, as a full disk or a
    read-only mount fails them): reads go on."""
    script = textwrap.dedent(f"""
        import os, resource, signal, sys
        sys.path.insert(0, {HELPERS!r})
        from storage_env import Instance, fingerprint, prompt
        from radixkv.scheduler import StorageFaultPolicy
        from radixkv.storage import FileStorage
        d = {str(tmp_path / "store")!r}
        a = Instance(FileStorage(d, fingerprint()), host_pages=64)
        prompts = [prompt(k, 4) for k in range(30)]
        for ids in prompts:
            a.serve(ids)
        a.close()
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))  # every page write fails
        b = Instance(FileStorage(d, fingerprint()), host_pages=64,
                     faults=StorageFaultPolicy(retry_after_s=30))
        for k in range(30):
            b.serve(prompt(1000 + k, 4))          # writes fail: the write side backs off
        assert b.cm.storage_counters.write_failures > 0
        assert b.cm.storage_counters.skipped_writes > 0
        got = 0
        for ids in prompts:
            b.evict_everything()
            got += b.serve(ids)[2]
        assert got == 30 * 16, got                # every token in the store was read
        assert b.cm.storage_counters.skipped_reads == 0
        print("ok")
    """)
    run_unprivileged(script, tmp_path)


# -- 4. rare transient failures -----------------------------------------------------------


def _prefetched_with_faults(tmp_path, fail_call, seed):
    d = str(tmp_path / f"s{fail_call}-{seed}")
    a = Instance(FileStorage(d, fingerprint()), host_pages=64)
    prompts = [prompt(5000 + k, 3) for k in range(60)]
    for ids in prompts:
        a.serve(ids)
    a.close()
    store = FileStorage(d, fingerprint())
    if fail_call:
        store = FaultyStorage(
            store, seed=seed, fail_call=fail_call, fail_page=0, max_delay_s=0, scribble=False
        )
    b = Instance(store, host_pages=64)
    got = 0
    for ids in prompts:
        b.evict_everything()
        got += b.serve(ids)[2]
    counters = b.cm.storage_counters
    b.close()
    return got, counters


@pytest.mark.parametrize("fail_call, keep", [(0.01, 0.95), (0.05, 0.8)])
def test_rare_transient_failures_cost_only_their_own_pages(tmp_path, fail_call, keep):
    clean, _ = _prefetched_with_faults(tmp_path, 0, 0)
    assert clean == 60 * 3 * PAGE
    errors = 0
    for seed in range(3):
        got, counters = _prefetched_with_faults(tmp_path, fail_call, seed)
        assert got >= keep * clean, (seed, got, clean)
        errors += counters.errors
        # Skipped calls are counted, per direction, if any back-off was tripped.
        assert counters.skipped == counters.skipped_reads + counters.skipped_writes
    assert errors > 0  # the faults happened and were counted


def test_a_direction_backs_off_after_failures_in_a_row_and_says_how_much_it_skipped(tmp_path):
    store = FaultyStorage(
        FileStorage(str(tmp_path), fingerprint()), fail_call=1.0, fail_page=0, max_delay_s=0
    )
    a = Instance(store, faults=StorageFaultPolicy(retry_after_s=60, failures_in_a_row=3))
    for k in range(6):
        a.serve(prompt(40 + k, 2))
    c = a.cm.storage_counters
    tier = a.cm._tiers.storage
    assert tier.writes_down() and tier.reads_down()
    assert c.skipped_writes >= 3 and c.skipped_reads >= 3
    m = a.cm.metrics
    assert m.storage_skipped_writes == c.skipped_writes
    assert m.storage_skipped_reads == c.skipped_reads
    assert "radixkv_storage_skipped_writes_total" in m.prometheus()
    a.close()


# -- 5. a paused Mooncake master --------------------------------------------------------------


@needs_mooncake
def test_a_paused_master_never_blocks_the_scheduler_thread():
    m = MooncakeMaster()
    try:

        def backend():
            return MooncakeStorage(
                m.master_address,
                m.metadata_server,
                listen_on_all_interfaces=True,
                segment_bytes=32 << 20,
                buffer_bytes=16 << 20,
            )

        a = Instance(
            backend(),
            policy="best_effort",
            faults=StorageFaultPolicy(query_timeout_s=0.05, close_timeout_s=1),
        )
        ids = prompt(7, 4)
        a.serve(ids)
        a.evict_everything()
        os.kill(m.proc.pid, signal.SIGSTOP)
        try:
            slowest = 0.0
            for k in range(6):
                t0 = time.monotonic()
                a.cm.prefetch(prompt(8 + k, 4))
                slowest = max(slowest, time.monotonic() - t0)
            assert slowest < 1.0, f"prefetch blocked the scheduler thread {slowest:.1f} s"
            c = a.cm.storage_counters
            assert c.query_timeouts >= 1
            assert a.cm._tiers.storage.reads_down()  # left alone after repeated timeouts
        finally:
            os.kill(m.proc.pid, signal.SIGCONT)
        t0 = time.monotonic()
        done, out = finishes(lambda: a.cm.close(wait=False), 30)
        assert done and time.monotonic() - t0 < 5
    finally:
        m.stop()


# -- 6. setup against a hung master ------------------------------------------------------------


@needs_mooncake
def test_mooncake_setup_against_a_hung_master_fails_in_bounded_time():
    m = MooncakeMaster()
    os.kill(m.proc.pid, signal.SIGSTOP)
    try:
        script = textwrap.dedent(f"""
            import time
            from radixkv.storage import MooncakeStorage
            t0 = time.monotonic()
            try:
                MooncakeStorage({m.master_address!r}, {m.metadata_server!r},
                                listen_on_all_interfaces=True,
                                segment_bytes=32 << 20, buffer_bytes=16 << 20,
                                setup_timeout_s=2)
            except RuntimeError as e:
                print("refused", round(time.monotonic() - t0, 1), e)
        """)
        try:
            r = subprocess.run(
                [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
            )
        except subprocess.TimeoutExpired:
            pytest.fail("Mooncake setup against a hung master did not return in 60 s")
        assert "refused" in r.stdout, r.stdout + r.stderr[-2000:]
        assert "did not answer" in r.stdout
        assert float(r.stdout.split()[1]) < 20
    finally:
        os.kill(m.proc.pid, signal.SIGCONT)
        m.stop()


@needs_mooncake
def test_close_with_the_master_killed_is_bounded():
    m = MooncakeMaster()
    a = Instance(
        MooncakeStorage(
            m.master_address,
            m.metadata_server,
            listen_on_all_interfaces=True,
            segment_bytes=32 << 20,
            buffer_bytes=16 << 20,
        ),
        faults=StorageFaultPolicy(close_timeout_s=1),
    )
    a.serve(prompt(9, 3))
    m.proc.kill()
    m.stop()
    t0 = time.monotonic()
    done, _ = finishes(lambda: a.cm.close(), 60)
    assert done and time.monotonic() - t0 < 5


# -- 7. a manager dropped without close ------------------------------------------------------


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _eventually(check, limit_s=20.0):
    deadline = time.monotonic() + limit_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_a_manager_with_storage_dropped_without_close_frees_everything(tmp_path):
    pool = MHAKVCache(KV.num_kv_heads, KV.num_layers, KV.head_dim, 16, KV.dtype, page_size=PAGE)
    threads = threading.active_count()
    # 64 MiB of host pool per manager: 20 leaked would be 1.3 GiB.
    host_pages = (64 << 20) // (2 * KV.num_layers * PAGE * KV.num_kv_heads * KV.head_dim * 2)
    rss = _rss_bytes()
    pools = []
    gc.disable()  # freed by reference counts alone, as a manager without storage is
    try:
        for k in range(20):
            cm = CacheManager(
                16,
                page_size=PAGE,
                host_num_pages=host_pages,
                kv_cache=pool,
                storage=FileStorage(str(tmp_path), fingerprint()),
                storage_seed=fingerprint(),
            )
            ids = prompt(k, 3)
            h, idx = cm.match_req(ids)
            cm.lock(h)
            own = cm.allocate(len(ids))
            cm.free_and_cache_finished_req(h, ids, own)  # a backup and a write in flight
            pools.append(weakref.ref(cm.host_pool))
            del cm, h, idx, own
        assert _eventually(
            lambda: all(p() is None for p in pools)
        ), f"{sum(p() is not None for p in pools)} of 20 host pools are still alive"
        assert _eventually(
            lambda: threading.active_count() <= threads
        ), f"{threading.active_count() - threads} threads left behind"
        assert _rss_bytes() - rss < 256 << 20
        # The device pool can back another manager's host tier.
        cm = CacheManager(16, page_size=PAGE, host_num_pages=8, kv_cache=pool)
        cm.close()
    finally:
        gc.enable()


# -- 8. a BaseException from a backend ------------------------------------------------------


@pytest.mark.parametrize("exc", [asyncio.CancelledError, KeyboardInterrupt, SystemExit])
def test_a_base_exception_from_a_backend_is_an_error_not_a_dead_thread(tmp_path, exc):
    class Raising(FileStorage):
        left = 1

        def batch_set(self, keys, pages):
            if self.left:
                self.left -= 1
                raise exc()
            return super().batch_set(keys, pages)

    a = Instance(Raising(str(tmp_path), fingerprint()))
    a.serve(prompt(20, 3))  # drains: must not raise
    assert a.cm._tiers.storage.thread_alive
    assert a.cm.storage_counters.errors >= 1
    assert a.cm._tree.tier_sizes()[6] == 0  # no host page left pinned
    a.serve(prompt(21, 3))
    assert written(a.cm) == 3
    a.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_storage_thread_lost_switches_storage_off_and_releases_its_pins(tmp_path):
    a = Instance(FileStorage(str(tmp_path), fingerprint()))
    a.serve(prompt(22, 3))
    tier = a.cm._tiers.storage
    thread = tier._writer  # writes come next
    # Kill the idle thread: the exception lands as it takes its next job.
    assert (
        ctypes.pythonapi.PyThreadState_SetAsyncExc(
            ctypes.c_ulong(thread.ident), ctypes.py_object(SystemExit)
        )
        == 1
    )
    a.serve(prompt(23, 3), drain=False)
    done, out = finishes(lambda: a.cm.drain())
    assert done and "error" not in out, out.get("error")
    thread.join(5)
    assert not thread.is_alive()
    assert tier.lost and a.cm.storage_counters.lost
    assert a.cm._tree.tier_sizes()[6] == 0 and a.cm._tree.host_pins == 0
    a.cm.check_integrity()
    assert a.serve(prompt(24, 3))  # the cache goes on without storage
    assert a.cm.prefetch(prompt(22, 3)) is None
    a.close()


# -- 9. Ctrl-C at any bytecode -----------------------------------------------------------------


_TIER_FILES = {
    path
    for m in (
        cache_module,
        upkeep_module,
        tiers_module,
        host_tier_module,
        storage_tier_module,
        storage_threads_module,
    )
    for path in (m.__file__, os.path.realpath(m.__file__))
}


def _opcodes_traced() -> bool:
    """Whether a tracer that asks for opcode events gets them (Python 3.12
    sends none to one set this way: there the test stops at every line)."""
    seen = []

    def probe():
        return len(seen)

    def tracer(frame, event, arg):
        if frame.f_code is not probe.__code__:
            return None
        frame.f_trace_opcodes = True
        if event == "opcode":
            seen.append(1)
        return tracer

    sys.settrace(tracer)
    try:
        probe()
    finally:
        sys.settrace(None)
    return bool(seen)


def _cycle(inst, k):
    """A request cycle that crosses every copy path: a prefetch and its read,
    a load back, backups, writes to storage, device and host eviction."""
    ids = prompt(300 + k % 5, 3)
    inst.serve(ids, drain=k % 2 == 0)
    if k % 3 == 0:
        inst.cm.make_room(inst.cm.num_pages * PAGE)
    if k % 4 == 0:
        inst.cm._tiers.host.free_host_slots(PAGE * 4, all_or_nothing=False)
    inst.cm.writing_check()
    inst.cm.loading_check()
    inst.cm.storage_check()


def _interrupt_at_every_bytecode(tmp_path, sig, exc) -> int:
    """Raises signal `sig` at one bytecode of the tiers' files after another
    (every third where opcodes are traced) during request cycles; after each,
    the tiers' bookkeeping must be whole. Returns how many cycles raised
    `exc` (the exception the signal's handler raises)."""

    def fresh():
        return Instance(
            FileStorage(str(tmp_path), fingerprint()), pages=16, host_pages=12, policy="best_effort"
        )

    inst = fresh()
    for k in range(6):
        _cycle(inst, k)
    event_kind, stride = ("opcode", 3) if _opcodes_traced() else ("line", 1)
    hits, k = 0, 1
    while True:
        count, fired = [0], [False]

        def tracer(frame, event, arg):
            if frame.f_code.co_filename not in _TIER_FILES:
                return None
            frame.f_trace_opcodes = True
            if event == event_kind:
                count[0] += 1
                if count[0] == k:
                    fired[0] = True
                    signal.raise_signal(sig)
            return tracer

        sys.settrace(tracer)
        try:
            _cycle(inst, k)
        except exc:
            hits += 1
        except AssertionError:
            raise
        finally:
            sys.settrace(None)
        # Whatever the caller lost (a handle, pages it was handed), the
        # tiers' bookkeeping is whole, and the manager drains and closes.
        inst.cm.drain()
        inst.cm.check_integrity()
        if not fired[0]:
            break
        if inst.cm.held_pages or inst.cm.manager.size_info.protected_size:
            inst.close()  # the interrupted caller lost what it held: start over
            inst = fresh()
        k += stride
    inst.close()
    return hits


def test_ctrl_c_at_any_bytecode_of_the_tiers_keeps_their_bookkeeping_whole(tmp_path):
    hits = _interrupt_at_every_bytecode(tmp_path, signal.SIGINT, KeyboardInterrupt)
    assert hits > 100, hits


class _Interrupted(Exception):
    """What the test's handlers of other signals raise."""


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGALRM], ids=["SIGUSR1", "SIGALRM"])
def test_another_signals_raising_handler_at_any_bytecode_keeps_the_bookkeeping_whole(tmp_path, sig):
    """A Python handler of any signal (a SIGALRM timeout, SIGUSR1), installed
    after radixkv was imported, that raises: held back until the call
    returns, as Ctrl-C is, so the host tier's acknowledgements (writing_check)
    and every other step are never cut in two."""

    def handler(signum, frame):
        raise _Interrupted(signum)

    previous = signal.signal(sig, handler)
    try:
        hits = _interrupt_at_every_bytecode(tmp_path, sig, _Interrupted)
    finally:
        signal.signal(sig, previous)
    assert hits > 100, hits


# -- 10. pool storage freed under a copy ---------------------------------------------------


@pytest.mark.parametrize("layout", [KVCacheLayout.LayerFirst, KVCacheLayout.PageFirst])
def test_pool_storage_cannot_be_resized_away(layout):
    dev = MHAKVCache(
        KV.num_kv_heads, KV.num_layers, KV.head_dim, 8, KV.dtype, page_size=PAGE, kv_layout=layout
    )
    side = dev.register_side_buffer("scale", (2,), torch.float32)
    mla = MLAKVCache(16, 8, 2, 4, torch.float16, kv_layout=layout, page_size=PAGE)
    host = HostKVCache(dev, 8, pin_memory=False)
    buffers = [dev.kv_buffer, host.kv_buffer, mla.kv_buffer, side, host.side_buffer("scale", 0)]
    for buf in buffers:
        with pytest.raises(RuntimeError, match="not resizable"):
            buf.untyped_storage().resize_(0)
        assert buf.untyped_storage().nbytes() > 0


def test_resizing_a_pool_while_its_copies_run_raises_in_the_caller(tmp_path):
    a = Instance(FileStorage(str(tmp_path), fingerprint()), pages=16, host_pages=32)
    stop = threading.Event()

    def copies():
        k = 0
        while not stop.is_set():
            a.serve(prompt(400 + k % 7, 3), drain=False)
            a.evict_everything()
            k += 1

    t = threading.Thread(target=copies)
    t.start()
    try:
        for _ in range(50):
            for buf in (a.pool.kv_buffer, a.cm.host_pool.kv_buffer):
                with pytest.raises(RuntimeError):
                    buf.untyped_storage().resize_(0)
            time.sleep(0.002)
    finally:
        stop.set()
        t.join()
    a.cm.drain()
    a.cm.check_integrity()
    a.close()


def test_a_pool_moved_under_its_copies_fails_them_and_raises_in_the_caller(tmp_path):
    """share_memory_() moves a pool's storage in place (torch.multiprocessing
    does it to send a view): the copies in flight still have their memory,
    their acknowledgements count as failed, and the next copy raises in the
    caller. In a subprocess: the defect was a SIGSEGV."""
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {HELPERS!r})
        from storage_env import KV, PAGE, prompt
        from radixkv.kvcache import MHAKVCache
        from radixkv.scheduler import CacheManager
        pool = MHAKVCache(KV.num_kv_heads, KV.num_layers, KV.head_dim, 64, KV.dtype,
                          page_size=PAGE)
        pool.register_side_buffer("big", (4096,), torch.float32)  # slow copies
        # Manual copies: they wait until drain() runs them, however loaded the machine.
        cm = CacheManager(64, page_size=PAGE, kv_cache=pool, host_num_pages=128,
                          manual_copies=True)
        for k in range(12):
            ids = prompt(k, 4)
            h, _ = cm.match_req(ids)
            cm.lock(h)
            cm.free_and_cache_finished_req(h, ids, cm.allocate(len(ids)))
        assert cm.controller.in_flight > 0
        pool.kv_buffer.untyped_storage().share_memory_()   # moves it, copies running
        cm.drain()
        assert cm.tier_counters.failed_copies > 0
        cm.check_integrity()
        ids = prompt(99, 4)
        h, _ = cm.match_req(ids)
        cm.lock(h)
        try:
            cm.free_and_cache_finished_req(h, ids, cm.allocate(len(ids)))
        except ValueError as e:
            assert "resized or replaced" in str(e), e
            cm.check_integrity()   # the refused backup left nothing behind
            cm.close()
            print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stdout, r.stderr)


# -- smaller points -----------------------------------------------------------------------


def test_storage_arguments_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="directory"):
        FileStorage("", fingerprint())
    for bad in (math.nan, math.inf, 1.5, "10"):
        with pytest.raises((TypeError, ValueError), match="max_bytes"):
            FileStorage(str(tmp_path), fingerprint(), max_bytes=bad)
    with pytest.raises(NotADirectoryError, match="directory '/etc/passwd' is not a directory"):
        FileStorage("/etc/passwd", fingerprint())
    dev = MHAKVCache(KV.num_kv_heads, KV.num_layers, KV.head_dim, 4, KV.dtype, page_size=PAGE)
    with pytest.raises(TypeError, match="min_prefetch_tokens"):
        CacheManager(
            4,
            page_size=PAGE,
            kv_cache=dev,
            host_num_pages=8,
            storage=FileStorage(str(tmp_path), fingerprint()),
            min_prefetch_tokens="x",
        )
    with pytest.raises(TypeError, match="storage_faults"):
        CacheManager(
            4,
            page_size=PAGE,
            kv_cache=dev,
            host_num_pages=8,
            storage=FileStorage(str(tmp_path), fingerprint()),
            storage_faults=3,
        )
    for field, bad in (
        ("query_timeout_s", 0),
        ("retry_after_s", -1),
        ("failures_in_a_row", 0),
        ("close_timeout_s", math.nan),
    ):
        with pytest.raises((TypeError, ValueError), match=field):
            StorageFaultPolicy(**{field: bad})
    a = Instance(FileStorage(str(tmp_path), fingerprint()))
    with pytest.raises(TypeError, match="prefetch"):
        a.cm.wait_prefetch("x")
    a.close()


def test_cli_storage_dir_that_is_a_file_says_so():
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "radixkv",
            "replay",
            "--storage",
            "file",
            "--storage-dir",
            "/etc/passwd",
            "--limit",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0
    assert "not a directory" in r.stderr, r.stderr
    assert "File exists" not in r.stderr


@pytest.mark.parametrize(
    "sig, exc", [(signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, SystemExit)]
)
def test_a_signal_during_a_call_is_delivered_when_it_returns(sig, exc):
    """Ctrl-C, or a server's SIGTERM handler raising SystemExit, arrives when
    the CacheManager call it landed in returns, complete; the shielded
    methods keep their names, docs and signatures."""
    import inspect

    cm = CacheManager(8, page_size=PAGE, host_num_pages=8)
    ids = prompt(2, 2)
    h, _ = cm.match_req(ids)
    cm.lock(h)
    own = cm.allocate(len(ids))
    previous = signal.getsignal(signal.SIGTERM)
    if sig == signal.SIGTERM:
        signal.signal(signal.SIGTERM, lambda *a: sys.exit(3))
    fired = []

    def tracer(frame, event, arg):
        if frame.f_code.co_filename in _TIER_FILES:
            if event == "call" and frame.f_code.co_name == "_finished" and not fired:
                fired.append(1)
                signal.raise_signal(sig)
            return tracer
        return None

    sys.settrace(tracer)
    try:
        with pytest.raises(exc):
            cm.free_and_cache_finished_req(h, ids, own)
    finally:
        sys.settrace(None)
        signal.signal(signal.SIGTERM, previous)
    assert fired == [1] and cm.held_pages == 0  # the call finished before the signal
    cm.drain()
    cm.check_integrity()
    assert cm.match_req(ids)[0].cached_len == 2 * PAGE
    assert CacheManager.allocate.__name__ == "allocate" and "pages" in CacheManager.allocate.__doc__
    assert list(inspect.signature(CacheManager.allocate).parameters) == [
        "self",
        "num_tokens",
        "namespace",
    ]


# -- a second review's findings -------------------------------------------------------------


def test_a_close_racing_a_prefetch_leaves_nothing_held(tmp_path):
    """close() from a shutdown thread while the scheduler is inside
    prefetch(): the read queued after the stop never runs; what it holds is
    released once the thread is gone, and drain() and reset() return."""
    a = Instance(FileStorage(str(tmp_path), fingerprint()))
    ids = prompt(500, 4)
    a.serve(ids)
    a.evict_everything()
    tier = a.cm._tiers.storage
    exists, closer = tier._exists, []

    def exists_then_close(keys):
        hits = exists(keys)
        t = threading.Thread(target=a.cm.close)
        t.start()
        t.join()
        closer.append(t)
        return hits

    tier._exists = exists_then_close
    op = a.cm.prefetch(ids)
    assert closer and op is not None and not tier.thread_alive
    done, out = finishes(lambda: (a.cm.drain(), a.cm.reset()))
    assert done and "error" not in out, out.get("error")
    assert a.cm.wait_prefetch(op) == 0
    assert a.cm._tree.host_pins == 0 and tier.in_flight == 0
    a.cm.check_integrity()


@pytest.mark.parametrize(
    "answer",
    ["short", "codes", "exists_float", "exists_negative", "exists_too_many", "exists_none"],
)
def test_a_backend_out_of_contract_never_gives_a_wrong_row(tmp_path, answer):
    a = Instance(FileStorage(str(tmp_path), fingerprint()))
    ids = prompt(510, 3)
    a.serve(ids)
    a.close()

    class Liar(FileStorage):
        def batch_get(self, keys, pages):
            got = super().batch_get(keys, pages)
            if answer == "short":
                return got[:1]  # fewer flags than pages
            if answer == "codes":
                return [0 if g else -1 for g in got]  # C-style: -1 is truthy
            return got

        def batch_exists(self, keys):
            n = super().batch_exists(keys)
            return {
                "exists_float": n + 0.5,
                "exists_negative": -3,
                "exists_too_many": len(keys) + 5,
                "exists_none": None,
            }.get(answer, n)

    b = Instance(Liar(str(tmp_path), fingerprint()))
    b.serve(prompt(511, 2))  # a host-backed path, so a prefetch would pin under it
    b.serve(ids)  # every row it is handed is checked
    assert b.cm.storage_counters.errors > 0 and b.cm.storage_counters.prefetched_tokens == 0
    assert b.cm._tree.host_pins == 0
    b.cm.check_integrity()
    b.cm.reset()
    b.close()


def test_reads_that_hang_hold_at_most_half_the_host_pool_and_count(tmp_path):
    a = Instance(FileStorage(str(tmp_path), fingerprint()), pages=40, host_pages=80)
    prompts = [prompt(520 + k, 4) for k in range(12)]
    for ids in prompts:
        a.serve(ids)
    a.close()
    store = Stuck(str(tmp_path), fingerprint())
    b = Instance(
        store,
        pages=40,
        host_pages=48,
        policy="timeout",
        faults=StorageFaultPolicy(retry_after_s=60),
    )
    b.cm._tiers.storage.timeout_base_s = 0.05
    for ids in prompts:
        b.serve(ids, drain=False)
        b.cm.writing_check()
        assert b.cm._tiers.storage.reading_tokens <= 48 * PAGE // 2
    assert b.cm._tiers.storage.reads_down()  # the reads given up on counted as failures
    done, out = finishes(lambda: b.cm.reset())  # bounded, refuses, drops nothing
    assert done and isinstance(out.get("error"), RuntimeError), out
    store.release.set()
    b.cm.drain()
    b.cm.check_integrity()
    b.close()


def test_a_store_whose_directories_are_deleted_is_made_again(tmp_path):
    import shutil

    a = Instance(FileStorage(str(tmp_path / "store"), fingerprint()))
    a.serve(prompt(530, 2))
    shutil.rmtree(tmp_path / "store")
    a.serve(prompt(531, 2))
    assert written(a.cm) == 4 and a.cm.storage_counters.write_failures == 0
    a.close()


def test_out_of_descriptors_is_an_error_and_keeps_the_pages(tmp_path):
    """EMFILE says nothing of the page: an error, and the page file stays."""
    script = textwrap.dedent(f"""
        import errno, os, resource, sys
        sys.path.insert(0, {HELPERS!r})
        from storage_env import fingerprint, host_pool, keys
        from radixkv.storage import FileStorage
        for shared in (False, True):
            fs = FileStorage({str(tmp_path)!r} + f"/store{{int(shared)}}", fingerprint(),
                             shared=shared)
            fs.attach(host_pool())
            k = keys(3)
            assert fs.batch_set(k, [0, 1, 2]) == [True] * 3
            resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(
                resource.RLIMIT_NOFILE)[1]))
            filler = []
            try:
                while True:
                    filler.append(os.open("/dev/null", os.O_RDONLY))
            except OSError as e:
                assert e.errno == errno.EMFILE, e
            got = fs.batch_get(k, [3, 4, 5])
            for fd in filler:
                os.close(fd)
            assert got == [False] * 3, got
            assert fs.errors == 3 and fs.corrupt_pages == 0, (fs.errors, fs.corrupt_pages)
            assert all(os.path.isfile(fs.path(x)) for x in k)  # nothing removed
            assert fs.batch_get(k, [3, 4, 5]) == [True] * 3
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


@pytest.mark.parametrize("shared", [False, True])
def test_a_closed_store_fails_its_calls_cleanly(tmp_path, shared):
    fs = FileStorage(str(tmp_path / "store"), fingerprint(), shared=shared)
    fs.attach(host_pool())
    k = keys(2)
    assert fs.batch_set(k, [0, 1]) == [True, True]
    fs.close()
    assert fs.batch_exists(k) == 0
    assert fs.batch_get(k, [2, 3]) == [False, False]
    assert fs.batch_set(keys(1, "other"), [4]) == [False]
    assert fs.errors == 3
    assert all(os.path.isfile(fs.path(x)) for x in k)
    fs.close()  # twice is fine


@pytest.mark.parametrize("shared", [False, True])
def test_a_store_deleted_and_made_again_by_another_instance_is_read_again(tmp_path, shared):
    import shutil

    d = str(tmp_path / "store")
    a = FileStorage(d, fingerprint(), shared=shared)
    a.attach(host_pool())
    assert a.batch_set(keys(2, "old"), [0, 1]) == [True, True]
    shutil.rmtree(d)
    b = FileStorage(d, fingerprint(), shared=shared)  # another instance makes it again
    b.attach(host_pool())
    k = keys(2, "new")
    assert b.batch_set(k, [0, 1]) == [True, True]
    assert a.batch_exists(k) == 2
    assert a.batch_get(k, [2, 3]) == [True, True]  # through the new directory
    assert a.batch_set(keys(1, "mine"), [4]) == [True]
    assert b.batch_get(keys(1, "mine"), [5]) == [True]  # written into the new one
    assert a.errors == b.errors == 0


def test_a_private_key_directory_replaced_by_a_file_recovers(tmp_path):
    fs = FileStorage(str(tmp_path / "store"), fingerprint())
    fs.attach(host_pool())
    k = keys(1)
    assert fs.batch_set(k, [0]) == [True]
    sub = os.path.dirname(fs.path(k[0]))
    import shutil

    shutil.rmtree(sub)
    open(sub, "wb").close()  # a file where the key directory was
    assert fs.batch_exists(k) == 0
    assert fs.batch_get(k, [1]) == [False]
    assert fs.batch_set(k, [0]) == [True]  # the file is removed, the directory made
    assert os.path.isdir(sub) and fs.batch_get(k, [1]) == [True]


@pytest.mark.parametrize("what", ["file", "fifo", "symlink"])
def test_an_entry_in_place_of_the_configuration_directory_is_replaced(tmp_path, what):
    """`<store>/<fingerprint[:16]>` is named from the public configuration:
    whatever is in its place when the store starts, or is put there while it
    serves, is removed (a bad entry) and the directory made, as for a key
    directory; nothing is written through a link."""
    outside = tmp_path / "outside"
    outside.mkdir()
    probe = FileStorage(str(tmp_path / "probe"), fingerprint())
    root = tmp_path / "store"
    root.mkdir(mode=0o700)
    top = root / os.path.basename(probe.directory)

    def plant():
        if what == "file":
            top.write_bytes(b"not a directory")
        elif what == "fifo":
            os.mkfifo(top)
        else:
            os.symlink(outside, top)

    plant()
    fs = FileStorage(str(root), fingerprint())
    fs.attach(host_pool())
    k = keys(2)
    assert fs.batch_set(k[:1], [0]) == [True]
    assert top.is_dir() and not top.is_symlink()
    import shutil

    shutil.rmtree(top)  # replaced while the store serves
    plant()
    assert fs.batch_set(k[1:], [1]) == [True]  # made again
    assert top.is_dir() and not top.is_symlink()
    assert fs.batch_get(k[1:], [2]) == [True]
    assert fs.corrupt_pages == 2 and fs.errors == 0
    assert list(outside.iterdir()) == []


def test_a_backlog_of_slow_writes_never_holds_reads_back(tmp_path):
    a = Instance(FileStorage(str(tmp_path), fingerprint()))
    old = [prompt(560 + k, 2) for k in range(3)]
    for ids in old:
        a.serve(ids)
    a.close()
    store = Stuck(str(tmp_path), fingerprint(), writes=True)
    b = Instance(store, host_pages=64, policy="timeout")
    b.cm._tiers.storage.timeout_base_s = 2.0
    for k in range(4):  # writes queue up behind the first, which blocks
        b.serve(prompt(570 + k, 2), drain=False)
    deadline = time.monotonic() + 60  # a loaded machine's copy thread may lag
    while len(b.cm._tiers.storage._writes) < 4 and time.monotonic() < deadline:
        b.cm.writing_check()  # backed up to host: handed to storage
        time.sleep(0.001)
    assert len(b.cm._tiers.storage._writes) >= 4
    t0 = time.monotonic()
    for ids in old:
        assert b.serve(ids, drain=False)[2] == 2 * PAGE  # read while the writes wait
    assert time.monotonic() - t0 < 5.0
    counters = b.cm.storage_counters
    assert counters.skipped_reads == 0 and not b.cm._tiers.storage.reads_down()
    store.release.set()
    b.cm.drain()
    assert written(b.cm) >= 4 * 2
    b.close()


def test_a_wait_for_a_read_that_close_dropped_ends(tmp_path):
    a = Instance(FileStorage(str(tmp_path), fingerprint()))
    first, second = prompt(580, 2), prompt(581, 2)
    a.serve(first), a.serve(second)
    a.close()
    store = Stuck(str(tmp_path), fingerprint())
    b = Instance(
        store, host_pages=48, policy="wait_complete", faults=StorageFaultPolicy(close_timeout_s=0.5)
    )
    held = b.cm.prefetch(first)  # its read blocks on the reading thread
    queued = b.cm.prefetch(second)  # queued behind it
    assert held is not None and queued is not None
    waiter = threading.Thread(target=b.cm._tiers.storage.wait, args=(queued,), daemon=True)
    waiter.start()
    time.sleep(0.1)
    assert waiter.is_alive()
    done, out = finishes(lambda: b.cm.close(wait=False))
    assert done and "error" not in out, out.get("error")
    waiter.join(5)
    assert not waiter.is_alive(), "a wait for a dropped read went on"
    assert queued.done.is_set() and queued.pages_ok == 0
    store.release.set()
    b.cm.check_integrity()


def test_a_key_directory_swapped_for_a_symlink_leads_nowhere_else(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    # A private store is this user's alone (only this user could swap one
    # of its directories); a shared one is opened a directory at a time.
    a = Instance(FileStorage(str(tmp_path / "store"), fingerprint(), shared=True))
    ids = prompt(540, 1)
    key = a.cm._tiers.storage.keys_of(ids)[0]
    sub = os.path.dirname(a.cm._tiers.storage.backend.path(key))
    a.serve(prompt(541, 1))  # the store exists
    os.makedirs(sub, exist_ok=True)
    os.rmdir(sub)
    os.symlink(outside, sub)
    a.serve(ids)
    assert list(outside.iterdir()) == []  # nothing written through the link
    assert os.path.isdir(sub) and not os.path.islink(sub)
    a.close()


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("call", ["exists", "read", "evict"])
def test_nothing_outside_the_store_is_read_or_removed_through_a_swapped_key_directory(
    tmp_path, call, shared
):
    """A key directory swapped for a link to a directory outside the store,
    which holds a file at the page's name: prefetch's existence check (it
    removes what is not a page of ours), a read (it would take a page of
    ours) and the bound's removals never reach through the link."""
    import shutil

    outside = tmp_path / "outside"
    outside.mkdir()
    probe = FileStorage(str(tmp_path / "probe"), fingerprint())
    probe.attach(host_pool())
    fs = FileStorage(
        str(tmp_path / "store"), fingerprint(), max_bytes=2 * probe.file_bytes, shared=shared
    )
    fs.attach(host_pool())
    assert fs.wait_indexed(30)
    k = list({x[:2]: x for x in keys(40)}.values())[:3]  # in three key directories
    assert fs.batch_set(k[:2], [0, 1]) == [True, True]
    page = fs.path(k[0])
    there = outside / os.path.basename(page)
    if call == "exists":
        there.write_bytes(b"not a page")  # what the store removes at a page's path
    else:
        shutil.copy(page, there)  # a page of ours, byte for byte
    shutil.rmtree(os.path.dirname(page))
    os.symlink(outside, os.path.dirname(page))
    if call == "exists":
        assert fs.batch_exists(k[:1]) == 0
    elif call == "read":
        assert fs.batch_get(k[:1], [5]) == [False]
    else:
        assert fs.batch_set(k[2:], [2]) == [True]  # over the bound: k[0] is given up
    assert [p.name for p in outside.iterdir()] == [there.name]
    assert fs.errors == 0


def test_temporary_files_of_dead_writers_are_removed_at_start(tmp_path):
    a = Instance(FileStorage(str(tmp_path), fingerprint()))
    ids = prompt(550, 1)
    a.serve(ids)
    page = a.cm._tiers.storage.backend.path(a.cm._tiers.storage.keys_of(ids)[0])
    a.close()
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    ).stdout.strip()
    left = f"{page}.{dead}.0.tmp"
    ours = f"{page}.{os.getpid()}.7.tmp"
    for p in (left, ours):
        open(p, "wb").close()
    assert FileStorage(str(tmp_path), fingerprint(), max_bytes=1 << 20).wait_indexed(10)
    assert not os.path.exists(left) and os.path.exists(ours)


SHIELD_SCRIPTS = {
    # A library's handler installed after the front, chaining to the handler
    # it replaced (faulthandler does): Ctrl-C must not recurse.
    "chained": """
        import faulthandler, signal, time
        from radixkv.scheduler import CacheManager
        cm = CacheManager(8, page_size=4, host_num_pages=8)
        cm.match_req([1, 2, 3, 4, 5])
        faulthandler.register(signal.SIGINT, chain=True, file=open("/dev/null", "w"))
        time.sleep(0.02)
        cm.match_req([1, 2, 3, 4, 5])
        try:
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt:
            print("ok")
    """,
    # asyncio.run() puts the same Python handler back: the next call is held.
    "asyncio": """
        import asyncio, signal, sys
        from radixkv.scheduler import CacheManager
        cm = CacheManager(8, page_size=4, host_num_pages=8)
        cm.match_req([1, 2, 3, 4, 5])
        asyncio.run(asyncio.sleep(0))
        fired = []
        def tracer(frame, event, arg):
            if event == "call" and frame.f_code.co_name == "_finished" and not fired:
                fired.append(1)
                signal.raise_signal(signal.SIGINT)
            return None
        h, _ = cm.match_req(list(range(9)))
        cm.lock(h)
        own = cm.allocate(9)
        sys.settrace(tracer)
        try:
            cm.free_and_cache_finished_req(h, list(range(9)), own)
        except KeyboardInterrupt:
            sys.settrace(None)
            assert cm.held_pages == 0, cm.held_pages
            cm.check_integrity()
            print("ok")
    """,
    # A child forked by another thread during a held call handles signals.
    "fork": """
        import os, signal, threading, time
        from radixkv import _core
        class M:
            @_core.shielded
            def slow(self):
                t = threading.Thread(target=fork_child)
                t.start(); t.join()
        def fork_child():
            pid = os.fork()
            if pid == 0:
                signal.signal(signal.SIGTERM, lambda *a: os._exit(7))
                time.sleep(5)
                os._exit(3)
            time.sleep(0.3)
            os.kill(pid, signal.SIGTERM)
            _, status = os.waitpid(pid, 0)
            print("ok" if os.waitstatus_to_exitcode(status) == 7 else status)
        M().slow()
    """,
    # Every signal with a Python handler is held, whenever the handler was
    # installed (SIGUSR2's before radixkv was imported), and delivered in
    # number order, each as often as it came; a fault's signal never is.
    "others": """
        import signal
        ran = []
        def note(signum, frame):
            ran.append(signal.Signals(signum).name)
        signal.signal(signal.SIGUSR2, note)
        from radixkv import _core
        for s in (signal.SIGUSR1, signal.SIGALRM, signal.SIGFPE):
            signal.signal(s, note)
        @_core.shielded
        def held():
            for s in (signal.SIGUSR2, signal.SIGUSR1, signal.SIGUSR1, signal.SIGALRM):
                signal.raise_signal(s)
            signal.raise_signal(signal.SIGFPE)
            for _ in range(1000):
                pass
            return list(ran)
        inside = held()
        want = ["SIGFPE", "SIGUSR1", "SIGUSR1", "SIGUSR2", "SIGALRM"]
        print("ok" if inside == ["SIGFPE"] and ran == want else (inside, ran))
    """,
    # A signal the kernel gives another thread wakes the main thread asleep
    # on a lock (a server waiting for work), whose handlers Python runs:
    # SIGTERM's installed before radixkv was imported, SIGUSR1's after.
    "thread": """
        import signal, threading, time
        waited = []
        def stop(sig, frame):  # how long the main thread slept with the signal come
            waited.append(round(time.monotonic() - sent[0], 1))
            raise InterruptedError
        signal.signal(signal.SIGTERM, stop)
        from radixkv import _core
        signal.signal(signal.SIGUSR1, stop)
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            sent = []
            def other():
                time.sleep(0.2)
                sent.append(time.monotonic())
                signal.pthread_kill(threading.get_ident(), sig)
            lock = threading.Lock()
            lock.acquire()
            try:
                threading.Thread(target=other).start()
                lock.acquire(timeout=20)  # unwoken, its handler runs after the 20 s
            except InterruptedError:
                pass
        print("ok" if len(waited) == 2 and max(waited) < 10 else waited)
    """,
    # A C handler placed in front of radixkv's that chains to it by raising
    # the signal again (faulthandler's way) for a signal another thread takes:
    # the Python handler still runs once, on the main thread. (The front
    # handler, installed again for the raise, sends it on, so faulthandler may
    # dump a second time there: its stack.)
    "chained thread": """
        import faulthandler, signal, tempfile, threading
        from radixkv import _core
        ran = []
        signal.signal(signal.SIGUSR1, lambda *a: ran.append(1))
        out = tempfile.TemporaryFile("w+")
        faulthandler.register(signal.SIGUSR1, file=out, all_threads=False, chain=True)
        t = threading.Thread(target=lambda: signal.pthread_kill(threading.get_ident(),
                                                                signal.SIGUSR1))
        t.start()
        t.join()
        for _ in range(1000):  # (the main thread runs the handler at a bytecode)
            pass
        out.seek(0)
        dumps = out.read().count("most recent call first")
        print("ok" if dumps in (1, 2) and ran == [1] else (dumps, ran))
    """,
    # SIGINT and SIGTERM both held: SIGTERM's handler still runs after.
    "both": """
        import signal
        from radixkv import _core
        ran = []
        signal.signal(signal.SIGTERM, lambda *a: ran.append("TERM"))
        def on_int(*a):
            ran.append("INT")
            raise KeyboardInterrupt
        signal.signal(signal.SIGINT, on_int)
        @_core.shielded
        def held():
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGTERM)
        try:
            held()
        except KeyboardInterrupt:
            pass
        for _ in range(1000):
            pass
        print("ok" if ran == ["INT", "TERM"] else ran)
    """,
}


@pytest.mark.parametrize("case", sorted(SHIELD_SCRIPTS))
def test_held_signals_are_never_lost_looped_or_stuck(case):
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SHIELD_SCRIPTS[case])],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), (
        r.returncode,
        r.stdout,
        r.stderr[-2000:],
    )
