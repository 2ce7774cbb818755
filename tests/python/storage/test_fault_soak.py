"""Soaks: the built-in chat workload through two serving instances that share
a storage tier while it is attacked.

- File storage: a vandal thread keeps making page entries unreadable (a
  directory, a FIFO, a symlink, a file of another user, flipped and cut
  bytes), fills the disk for a while, and the backends fail 3% of their
  calls and 1% of their pages. Every K/V row is checked; the hit rate stays
  within the bound README's reliability table states; threads, file
  descriptors and memory do not grow.
- Mooncake Store: the master is paused (SIGSTOP) for seconds, then killed
  and started again, in the middle of the replay. No call the scheduler's
  thread makes blocks longer than the bound README states; every row is right.

The two instances run in this process, one request at a time, as the
replay's instances do (so threads, descriptors and memory can be counted).
"""

import contextlib
import os
import random
import signal
import stat
import subprocess
import threading
import time


from radixkv.replay import chat_sessions
from radixkv.replay.instances import route
from radixkv.replay.core import Instance, KVShape, StorageConfig, pages_for_all
from radixkv.replay.traces import TokenMaker, max_hash_id
from radixkv.scheduler import StorageFaultPolicy
from radixkv.storage import MooncakeMaster
from storage_env import needs_mooncake

BLOCK = 16
KV = KVShape(num_layers=2, num_kv_heads=2, head_dim=16)
# The hit rate a run under attack keeps, at least, of the fault-free run's
# (README's reliability table states it).
HIT_BOUND = 0.7


def _threads():
    return len(os.listdir("/proc/self/task"))


def _fds():
    return len(os.listdir("/proc/self/fd"))


def _rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _drive(requests, storage, *, overlap=False, during=None, every=None, host_factor=2):
    """Serves `requests` through two instances sharing `storage`. Calls
    `every(i)` before request i; returns (results, stats at a quarter and at
    the end of the run, the slowest scheduler-thread call of each kind in
    seconds)."""
    biggest = max(-(-(r.input_length + r.output_length) // BLOCK) for r in requests)
    config = dict(
        block_size=BLOCK,
        page_size=BLOCK,
        capacity_pages=biggest,
        policy="radix",
        kv=KV,
        store=True,
        host_pages=min(host_factor * biggest, pages_for_all(requests, BLOCK)),
        write_policy="write_through",
        storage=storage,
        max_hash=max_hash_id(requests),
        overlap=overlap,
    )
    insts = [Instance(**config) for _ in range(2)]
    maker = TokenMaker(BLOCK, max_hash_id(requests))
    marks = {}
    for i, req in enumerate(requests):
        if i == len(requests) // 4:
            marks["start"] = (_threads(), _fds(), _rss())
        if every is not None:
            every(i, insts)
        inst = insts[route(req, i, 2)]
        inst.serve(req, maker.position)
        if not inst.skips(req):
            maker.advance(req)
    slowest = {}
    for inst in insts:
        for kind, samples in inst.lat.items():
            if samples:
                slowest[kind] = max(slowest.get(kind, 0), max(samples) / 1e9)
    results = [inst.finish() for inst in insts]
    del insts
    marks["end"] = (_threads(), _fds(), _rss())
    return results, marks, slowest


def _hits(results):
    return sum(r.hit_tokens for r in results)


@contextlib.contextmanager
def _small_disk(path, size_mb):
    """A tmpfs of `size_mb` at `path` when this process may mount one (root),
    so the disk can really fill; else a plain directory and None."""
    path.mkdir()
    mounted = False
    if os.geteuid() == 0:
        mounted = (
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=0700", "tmpfs", str(path)],
                capture_output=True,
            ).returncode
            == 0
        )
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


class Vandal:
    """Attacks the page files of a store directory from its own thread, at
    the pace of the replay: each request the driver serves (`tick`) lets it
    spoil one page entry, and now and then fill the disk for the next ten
    requests; it acts while the instances serve."""

    def __init__(self, root, seed, disk_full=False):
        self.root, self.rng, self.disk_full = str(root), random.Random(seed), disk_full
        self.ticks = threading.Semaphore(0)
        self.done = False
        self.acts = {}
        self.full_for = 0  # requests the disk stays full
        self.listed = []
        self.thread = threading.Thread(target=self.run, daemon=True)

    def tick(self, i=None, insts=None):
        self.ticks.release()

    def pages(self):
        out = []
        for d, _, files in os.walk(self.root):
            out += [os.path.join(d, f) for f in files if f.endswith(".page")]
        return out

    def act(self, path):
        kind = self.rng.choice(["dir", "fifo", "symlink", "owner", "flip", "cut", "mode"])
        try:
            if kind in ("dir", "fifo", "symlink"):
                os.unlink(path)
                if kind == "dir":
                    os.makedirs(os.path.join(path, "x"))
                elif kind == "fifo":
                    os.mkfifo(path)
                else:
                    os.symlink("/etc/hostname", path)
            elif kind == "owner" and os.geteuid() == 0:
                os.chown(path, 65534, 65534)
            elif kind in ("flip", "cut"):
                with open(path, "r+b") as f:
                    size = os.fstat(f.fileno()).st_size
                    if kind == "cut" or size == 0:
                        f.truncate(size // 2)
                    else:
                        f.seek(self.rng.randrange(size))
                        f.write(bytes([self.rng.randrange(256)]))
            else:
                os.chmod(path, 0)  # unreadable unless root
        except OSError:
            return
        self.acts[kind] = self.acts.get(kind, 0) + 1

    def fill(self, full):
        """Fills the disk (full) or frees it."""
        filler = os.path.join(self.root, "filler")
        if not full:
            os.unlink(filler)
            return
        try:
            with open(filler, "wb") as f:
                while True:
                    f.write(b"\0" * (1 << 20))
                    f.flush()
        except OSError:
            pass
        self.acts["full"] = self.acts.get("full", 0) + 1

    def run(self):
        while True:
            self.ticks.acquire()
            if self.done:
                break
            if self.rng.random() < 0.05 or not self.listed:  # a walk now and then
                self.listed = self.pages()
            if self.listed:
                self.act(self.rng.choice(self.listed))
            if self.full_for:
                self.full_for -= 1
                if not self.full_for:
                    self.fill(False)
            elif self.disk_full and self.rng.random() < 0.01:  # full ~10% of requests
                self.full_for = 10
                self.fill(True)
        if self.full_for:
            self.fill(False)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done = True
        self.ticks.release()
        self.thread.join()


def test_file_storage_under_attack_keeps_every_row_right(tmp_path):
    requests = chat_sessions(200, BLOCK, seed=17)
    clean, _, _ = _drive(requests, StorageConfig("file", directory=str(tmp_path / "clean")))
    assert sum(r.kv_mismatches for r in clean) == 0
    used = sum(
        os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(tmp_path / "clean") for f in fs
    )
    with _small_disk(tmp_path / "disk", max(4, 2 * used >> 20)) as mounted:
        store = StorageConfig(
            "file",
            directory=str(tmp_path / "disk" / "store"),
            fault_seed=5,
            fault_call=0.03,
            fault_page=0.01,
            faults=StorageFaultPolicy(retry_after_s=0.2),
        )
        with Vandal(tmp_path / "disk", seed=3, disk_full=mounted) as vandal:
            attacked, marks, _ = _drive(requests, store, every=vandal.tick)
        marks["end"] = (_threads(), _fds(), _rss())  # the vandal's file closed too
    assert sum(r.kv_mismatches for r in attacked) == 0
    assert sum(r.failed_loads for r in attacked) == 0
    assert sum(r.requests for r in attacked) == len(requests)
    assert sum(r.storage_errors for r in attacked) > 0
    assert len(vandal.acts) >= 5, vandal.acts
    assert not mounted or vandal.acts.get("full", 0) > 0
    assert _hits(attacked) >= HIT_BOUND * _hits(clean), (_hits(attacked), _hits(clean))
    (t0, f0, r0), (t1, f1, r1) = marks["start"], marks["end"]
    # The instances are closed at the end: their threads are gone, no more.
    assert t1 <= t0 and f1 <= f0, marks
    assert r1 - r0 < 96 << 20, marks


@needs_mooncake
def test_mooncake_paused_killed_and_restarted_mid_replay():
    requests = chat_sessions(120, BLOCK, seed=19)
    master = MooncakeMaster()
    faults = StorageFaultPolicy(
        query_timeout_s=0.05, retry_after_s=0.2, max_retry_after_s=1.0, close_timeout_s=2
    )
    storage = StorageConfig(
        "mooncake",
        master_address=master.master_address,
        metadata_server=master.metadata_server,
        segment_bytes=32 << 20,
        prefetch_policy="best_effort",
        faults=faults,
    )
    n = len(requests)
    events = []
    read_before_restart = []

    def every(i, insts):
        nonlocal master
        if i == n // 4:
            os.kill(master.proc.pid, signal.SIGSTOP)
            events.append(("paused", time.monotonic()))
        elif i == n // 2:
            os.kill(master.proc.pid, signal.SIGCONT)
            master.proc.kill()
            master.stop()
            events.append(("killed", time.monotonic()))
        elif i == 5 * n // 8:
            master = MooncakeMaster(ports=master.ports)
            events.append(("restarted", time.monotonic()))
            read_before_restart.append(
                sum(inst.cm.storage_counters.prefetched_tokens for inst in insts)
            )
        elif i == 7 * n // 8:
            for inst in insts:  # the next turns need their pages from the new master
                inst.cm.reset()
        if events and events[-1][0] != "killed" and i < 7 * n // 8:
            # The pause, and the time after the restart, last seconds (the
            # clients find the new master after a few of their pings).
            time.sleep(0.03)

    try:
        results, _, slowest = _drive(requests, storage, overlap=True, every=every)
    finally:
        with contextlib.suppress(Exception):
            os.kill(master.proc.pid, signal.SIGCONT)
        master.stop()
    assert [e for e, _ in events] == ["paused", "killed", "restarted"]
    assert sum(r.kv_mismatches for r in results) == 0
    assert sum(r.requests for r in results) == n
    # No call of the scheduler's thread waited on the store longer than the
    # bound (README: 50 ms a query, plus the machine's own noise).
    assert slowest["prefetch"] < 0.5, slowest
    assert max(slowest.values()) < 1.0, slowest
    assert sum(r.storage_errors for r in results) > 0
    # Storage served pages before the pause, and again once the master was back.
    read = sum(r.prefetched_tokens for r in results)
    assert 0 < read_before_restart[0] < read, (read_before_restart, read)


def test_vandal_acts_are_real(tmp_path):
    """The vandal's acts are what they claim (so the soak attacks for real)."""
    d = tmp_path / "s"
    d.mkdir()
    p = d / "a.page"
    for kind in ("dir", "fifo", "symlink"):
        p.write_bytes(b"x" * 10)
        v = Vandal(d, 0)
        v.rng.choice = lambda options, k=kind: k
        v.act(str(p))
        mode = os.lstat(p).st_mode
        assert {"dir": stat.S_ISDIR, "fifo": stat.S_ISFIFO, "symlink": stat.S_ISLNK}[kind](mode)
        if kind == "dir":
            os.rmdir(p / "x")
            os.rmdir(p)
        else:
            os.unlink(p)
