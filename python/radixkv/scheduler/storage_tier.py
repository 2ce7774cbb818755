"""The storage tier of a CacheManager: pages written to a shared store after
their backup to host, and prefetched from it into host pages after a match."""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, NamedTuple, Optional, Tuple, Union

import numpy as np
import torch

from radixkv import _core
from radixkv._checks import as_count
from radixkv.scheduler.block_events import BlockEvents, Events, NoEvents
from radixkv.scheduler.host_tier import HostTier
from radixkv.scheduler.quotas import quota_limit
from radixkv.scheduler.namespaces import Namespaces
from radixkv.storage.base import MAX_BATCH, StorageBackend, takes_parents
from radixkv.kvcache.page_codec import codec_seed
from radixkv.storage.health import Health, StorageFaultPolicy
from radixkv.storage.keys import page_keys
from radixkv.storage.threads import BoundedQuery, drop_queued, serving

log = logging.getLogger("radixkv")

PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
"""When the scheduler takes a prefetch's pages: as far as they have arrived
when the request is scheduled (`best_effort`), once all have (`wait_complete`),
or waiting up to a bound that grows with the length (`timeout`)."""


class StorageCounters(NamedTuple):
    written_pages: int  # pages whose write succeeded
    prefetched_tokens: int  # tokens read from storage and added to the tree
    errors: int  # failed calls and pages (the backend's count)
    corrupt_pages: int  # pages read back that failed their checks, bad entries
    write_failures: int  # pages whose write failed
    skipped: int  # reads and writes not tried while the store was left alone
    present_pages: int  # pages not written: the store had them already
    skipped_reads: int = 0  # of `skipped`: prefetches not tried (reads left alone)
    skipped_writes: int = 0  # of `skipped`: writes not tried (writes left alone)
    query_timeouts: int = 0  # existence queries that did not answer within the bound
    lost: bool = False  # the storage thread died: storage was switched off


@dataclass(eq=False)  # identity: jobs are found by `is`, never compared
class _Write:
    copy: tuple
    keys: List[str]
    pages: List[int]
    ok: List[bool] = field(default_factory=list)
    skipped: bool = False  # writes were left alone before every page was tried
    present: int = 0  # pages from the first that the store had already
    blocks: Optional[np.ndarray] = None  # the pages' blocks, when KV events are on
    parent: Optional[str] = None  # the key of the page the first extends
    done: threading.Event = field(default_factory=threading.Event)
    started: Optional[float] = None  # when its thread took it (None: still queued)
    stalled: bool = False  # counted as a failed call for running too long


@dataclass(eq=False)
class Prefetch:
    """A read of pages from storage into host pages, in flight."""

    tokens: torch.Tensor  # the path's tokens, up to the last page asked for
    start: int  # tokens[start:] are being read
    keys: List[str]
    host_slots: torch.Tensor
    pin: Optional[_core.TierCopy]  # the tree's pin on the host copy the pages join under
    ns: int = 0  # the path's cache namespace
    pages: List[int] = field(default_factory=list)  # the host pages read into
    done: threading.Event = field(default_factory=threading.Event)
    pages_ok: int = 0  # consecutive pages read from the first
    applied: bool = False
    inserted: int = 0  # tokens the tree took
    skipped: bool = False  # reads were left alone before every page was tried
    started: Optional[float] = None  # when its thread took it (None: still queued)
    stalled: bool = False  # counted as a failed read for running too long

    @property
    def num_tokens(self) -> int:
        return len(self.host_slots)


def _answer(got, n: int, query: bool):
    """A backend's answer as the tier takes it, or ValueError: a query's
    count, an int in [0, n]; one True or False per page of a get or set
    (anything else, say a C-style code, would let a page that was never
    read join the tree)."""
    if query:
        if isinstance(got, bool) or not isinstance(got, (int, np.integer)) or not 0 <= got <= n:
            raise ValueError(f"batch_exists answered {got!r} for {n} keys")
        return int(got)
    flags = list(got)
    if len(flags) != n or not all(isinstance(f, (bool, np.bool_)) for f in flags):
        raise ValueError(f"a backend answered {flags!r:.80} for {n} pages")
    return [bool(f) for f in flags]


class _BackendIO:
    """The backend, how it has been answering, and the storage threads'
    queues: what the reading and writing threads, the query thread and the
    scheduler's thread share. Reads and writes have a thread each, so a
    backlog of slow writes never holds a read back. It holds nothing of the
    tier or the tree, so a thread still running never keeps a dropped
    manager alive."""

    def __init__(self, backend: StorageBackend, policy: StorageFaultPolicy) -> None:
        self.backend = backend
        self.reads = Health(policy)
        self.writes = Health(policy)
        # Reads and writes one at a time where the backend needs it.
        self._one_at_a_time = backend.call_lock()
        self._parents = takes_parents(backend)
        self.read_jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        self.write_jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        self.finished: "queue.SimpleQueue" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._running = 2  # threads that have not ended
        self.closing = False  # both ended: the backend is being closed

    def call(self, health: Health, fn, keys, *args, query: bool = False):
        """Runs one backend call and notes how the store answered: a call
        that raised (anything, a backend's CancelledError too), or counted
        errors on this thread with no page found, read or written, failed."""
        before = self.backend.thread_errors()
        try:
            if query or self._one_at_a_time is None:
                got = _answer(fn(keys, *args), len(keys), query)
            else:
                with self._one_at_a_time:
                    got = _answer(fn(keys, *args), len(keys), query)
        except BaseException:  # noqa: BLE001 - the backend's, counted, never fatal here
            self.backend.count_error(max(1, len(keys)))
            got = 0 if query else [False] * len(keys)
        ok = got > 0 if query else any(got)
        if ok and not query:
            health.succeeded()
        elif not ok and self.backend.thread_errors() != before:
            health.failed()
        return got

    def exists(self, keys: List[str]) -> Optional[int]:
        """How many of `keys`, from the first, the store has, asked in
        batches of MAX_BATCH; None while reads are left alone."""
        present = 0
        while present < len(keys):
            if self.reads.down():
                return None
            batch = keys[present : present + MAX_BATCH]
            got = self.call(self.reads, self.backend.batch_exists, batch, query=True)
            present += got
            if got < len(batch):
                break
        return present

    # -- the storage thread --------------------------------------------------------

    def run(self, jobs: "queue.SimpleQueue") -> None:
        try:
            with serving(jobs):
                self._serve(jobs, self.finished)
        finally:
            with self._lock:
                self._running -= 1
                last = self._running == 0
        if last:  # the other is done too: the backend is closed (may take a while)
            self.closing = True
            try:
                self.backend.close()
            except BaseException:  # noqa: BLE001
                pass

    def _serve(self, jobs: "queue.SimpleQueue", finished: "queue.SimpleQueue") -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            job.started = time.monotonic()
            try:
                if isinstance(job, _Write):
                    self._write(job)
                else:
                    self._read(job)
            except BaseException:  # noqa: BLE001 - a bug here must not kill the thread
                self.backend.count_error()
            finally:
                # Queued before `done` is set: a waiter that wakes finds it.
                finished.put(job)
                job.done.set()
            del job  # not held while waiting for the next

    def _write(self, job: _Write) -> None:
        if self.writes.down():
            job.skipped = True
            return
        # Pages the store has already (another instance wrote them, or a
        # host copy made again) are not written twice.
        present = job.present = self.exists(job.keys) or 0
        job.ok = [True] * present
        keys = job.keys
        for i in range(present, len(keys), MAX_BATCH):
            if self.writes.down():
                job.skipped = True
                return
            batch = keys[i : i + MAX_BATCH]
            extra: tuple = ()
            if self._parents:
                extra = ([keys[i - 1] if i else job.parent, *batch[:-1]],)
            job.ok += self.call(
                self.writes, self.backend.batch_set, batch, job.pages[i : i + MAX_BATCH], *extra
            )

    def _read(self, job: Prefetch) -> None:
        ok = 0
        for i in range(0, len(job.keys), MAX_BATCH):
            if self.reads.down():
                job.skipped = True
                break
            got = self.call(
                self.reads,
                self.backend.batch_get,
                job.keys[i : i + MAX_BATCH],
                job.pages[i : i + MAX_BATCH],
            )
            for g in got:
                if not g:
                    job.pages_ok = ok
                    return
                ok += 1
        job.pages_ok = ok

    @staticmethod
    def stop_soon(store: "_BackendIO", asker: Optional[BoundedQuery]) -> None:
        """Stops the threads of a tier that was dropped: nobody will apply
        what is queued, so it is dropped; the threads end after their calls
        and the last closes the backend."""
        for jobs in (store.read_jobs, store.write_jobs):
            drop_queued(jobs)
            jobs.put(None)
        if asker is not None:
            asker.stop()


def check_prefetch_policy(policy: str) -> None:
    """Raises ValueError unless `policy` is one of PREFETCH_POLICIES."""
    if policy not in PREFETCH_POLICIES:
        raise ValueError(
            f"prefetch_policy must be one of {', '.join(PREFETCH_POLICIES)}, got {policy!r}"
        )


def storage_seed_of(backend: StorageBackend, seed: Optional[bytes]) -> bytes:
    """The seed of a store's page keys: `seed`, else the backend's
    fingerprint; b'' keys pages without one (SGLang's page hash). A backend
    with a codec gets keys of its own: `seed` is mixed with the codec's name."""
    given = seed
    if seed is None:
        seed = backend.fingerprint
    if seed is None:
        raise ValueError(
            "storage_seed: give config_fingerprint(...) of this configuration "
            "(or a backend with a fingerprint), so configurations sharing a "
            "store never read each other's pages; b'' keys pages without a "
            "seed (SGLang's page hash)"
        )
    if not isinstance(seed, bytes) or len(seed) not in (0, 32):
        raise ValueError("storage_seed must be 32 bytes (config_fingerprint) or b''")
    if given is not None:  # (a backend's fingerprint names its codec already)
        seed = codec_seed(seed, backend.codec)
    return seed


class StorageTier:
    """Writes and prefetches between the host tier and a StorageBackend.

    Backend calls run on the tier's own thread (and existence queries of a
    blocking backend on one more, with a bound); the tree and the host pages
    change only on the scheduler's thread, when it applies what finished
    (`storage_check`). A write pins its host pages (the tree's BeginStorageWrite)
    until the thread reports it, so they are never evicted, freed or reused
    under the write. A prefetch owns the host pages it reads into until it is
    applied: the pages read (consecutive from the first) join the tree as a
    host-only node under the path's host copy (InsertHost), the rest go back.

    Faults (`StorageFaultPolicy`): reads and writes back off apart after
    failures in a row; a backend's exception of any kind is an error, never
    the thread's end. If the thread is lost all the same, storage is switched
    off: what it held is released and the manager goes on without it.
    `close()` is bounded. A tier that is dropped without `close()` stops its
    threads (a finalizer) and frees its pools.

    With `writer=False` the tier only reads: the pages of a pool that is the
    same on every tensor-parallel rank (MLA) are written by one rank, and
    every rank prefetches them.
    """

    def __init__(
        self,
        host_tier: HostTier,
        backend: StorageBackend,
        seed: Optional[bytes],
        namespaces: Namespaces,
        prefetch_policy: str = "best_effort",
        timeout_base_s: float = 1.0,
        timeout_per_1k_tokens_s: float = 0.25,
        min_prefetch_tokens: int = 0,
        faults: Optional[StorageFaultPolicy] = None,
        writer: bool = True,
        events: Optional[Events] = None,
    ):
        check_prefetch_policy(prefetch_policy)
        min_prefetch_tokens = as_count(min_prefetch_tokens, "min_prefetch_tokens", minimum=0)
        if faults is None:
            faults = StorageFaultPolicy()
        elif not isinstance(faults, StorageFaultPolicy):
            raise TypeError(
                "storage_faults must be a StorageFaultPolicy (or None), got "
                f"{type(faults).__name__}"
            )
        if host_tier.pool is None:
            raise ValueError("a storage tier moves K/V bytes: the CacheManager needs kv_cache")
        seed = storage_seed_of(backend, seed)
        self.host = host_tier
        self.tree = host_tier.tree
        self.page_size = host_tier.page_size
        self.backend = backend
        self.seed = seed or None
        self.name_key = backend.name_key  # pages named by a keyed hash (a secret)
        self.namespaces = namespaces
        self.writer = bool(writer)
        self.policy = prefetch_policy
        self.faults = faults
        self.timeout_base_s = timeout_base_s
        self.timeout_per_1k_tokens_s = timeout_per_1k_tokens_s
        self.min_prefetch_tokens = max(min_prefetch_tokens, self.page_size)
        backend.attach(host_tier.pool)
        self._io = _BackendIO(backend, faults)
        self._asker = (
            BoundedQuery(self._io.exists, self._io.backend.count_error)
            if backend.blocking_queries
            else None
        )
        self._closed = False
        self.lost = False  # the storage thread died: storage is off
        self.abandoned = False  # close() left a thread stuck in a backend call
        self._writes: Dict[_Write, None] = {}  # in flight, oldest first
        self._prefetches: List[Prefetch] = []
        self.written_pages = self.prefetched_tokens = self.write_failures = 0
        self.present_pages = 0
        self.skipped_reads = self.skipped_writes = self.query_timeouts = 0
        # The manager's BlockEvents (NoEvents when KV events are off).
        self.events: Events = events if events is not None else NoEvents()
        self.reading_tokens = 0  # host slots owned by prefetches in flight
        self._reader = threading.Thread(
            target=self._io.run,
            args=(self._io.read_jobs,),
            name="radixkv-storage-read",
            daemon=True,
        )
        self._writer = threading.Thread(
            target=self._io.run,
            args=(self._io.write_jobs,),
            name="radixkv-storage-write",
            daemon=True,
        )
        self._reader.start()
        self._writer.start()
        stop = weakref.finalize(self, _BackendIO.stop_soon, self._io, self._asker)
        stop.atexit = False

    # -- the store's health -----------------------------------------------------------

    def reads_down(self) -> bool:
        """True while reads (prefetches) are left alone."""
        return self._io.reads.down()

    def writes_down(self) -> bool:
        """True while writes are left alone."""
        return self._io.writes.down()

    @property
    def thread_alive(self) -> bool:
        """Both storage threads run."""
        return self._reader.is_alive() and self._writer.is_alive()

    def keys_of(self, tokens, ns: int = 0) -> List[str]:
        """The store's keys of the whole pages of `tokens` in namespace `ns`."""
        return page_keys(
            tokens, self.page_size, self.namespaces.seed(ns, self.seed), key=self.name_key
        )

    # -- writes ---------------------------------------------------------------------

    def write(self, backup_copy) -> None:
        """Queues the write of what a finished backup gave a host copy."""
        if self._closed or not self.writer:
            return
        if self._io.writes.down():
            self.skipped_writes += 1
            return
        began = self.tree.begin_storage_write(backup_copy)
        if began is None:
            return
        copy, host_slots, tokens, ns = began
        if not self.namespaces.known(ns):  # its name was forgotten: no seed for its keys
            self.tree.finish_storage_write(copy)
            return
        ps = self.page_size
        # The keys from the page before the first written: that page's key is
        # the parent of the first (a bounded store removes suffixes first).
        first = copy.start // ps
        before = 1 if first else 0
        blocks = None
        if isinstance(self.events, BlockEvents):
            # The blocks hold the pages' chain keys: the chain is hashed once.
            blocks = self.events.blocks(tokens.to(torch.int32).numpy(), first - before, ns)
            if self.name_key is not None:
                keys = _core.keyed_page_keys(np.ascontiguousarray(blocks["key"]), self.name_key)
            else:
                keys = [bytes(k).hex() for k in blocks["key"]]
            blocks = blocks[before:]
        else:
            keys = self.keys_of(tokens, ns)[first - before :]
        parent = keys[0] if before else None
        pages = host_slots[::ps].div(ps, rounding_mode="floor").tolist()
        job = _Write(copy, keys[before:], pages, blocks=blocks, parent=parent)
        self._writes[job] = None
        self._io.write_jobs.put(job)

    def write_landed(self) -> None:
        """Queues the writes of the backups that landed on the host tier
        since the last call (`HostTier.landed`), oldest first, one at a time:
        an error leaves the rest for the next call. Called by the tiers'
        owner after every host-tier call that may apply backups, and here
        as soon as a prefetch made a path's host copy again (before it
        makes host room, which could evict what landed)."""
        landed = self.host.landed
        while landed:
            self.write(landed.popleft())

    # -- prefetch -------------------------------------------------------------------

    def prefetch(self, tokens: torch.Tensor, namespace=None) -> Optional[Prefetch]:
        """Starts reading the pages of `tokens` (in the namespace named
        `namespace`) beyond the cache's match (whole pages) that the store
        has, consecutive from the first, into fresh host pages. None when
        there is nothing worth fetching, no host room, or reads are left
        alone."""
        ns = self.namespaces.id(namespace)
        if self._closed:
            return None
        self._check_thread()
        ps = self.page_size
        n = len(tokens) - len(tokens) % ps
        start, host_backed = self.tree.storage_prefix_end(tokens[:n], ns)
        if n - start < self.min_prefetch_tokens:
            return None
        if self._io.reads.down():
            self.skipped_reads += 1
            return None
        keys = self.keys_of(tokens[:n], ns)[start // ps :]
        hits = self._exists(keys)
        # No more than the namespace's host quota holds: the rest would be
        # read only to be dropped.
        limit = quota_limit(self.tree, ns, host=True) if hits else None
        if limit is not None and hits is not None:
            hits = min(hits, limit // ps)
            if not hits:
                return None
        if hits is None or hits * ps < self.min_prefetch_tokens:
            return None
        # With other reads in flight, all of them together hold at most half
        # the host pool: a store whose reads stall never takes the host
        # tier's cache (a read alone may take what it needs).
        if self._prefetches:
            hits = min(hits, (self.host.num_pages * ps // 2 - self.reading_tokens) // ps)
            if hits * ps < self.min_prefetch_tokens:
                return None
        if not host_backed:
            try:
                backed = self.host.copy_path_to_host(tokens[:start], ns)
            finally:  # what landed meanwhile is pinned before host room is made
                self.write_landed()
            if not backed:
                return None
        # The host copy the pages will join under stays until they do.
        pin = self.tree.pin_host(tokens[:start], ns) if start else None
        if start and pin is None:
            return None
        try:
            room = self.host.free_host_slots(hits * ps, ns, all_or_nothing=False)
            hits = min(hits, room // ps)
            if hits * ps < self.min_prefetch_tokens:
                if pin is not None:
                    self.tree.unpin_host(pin)
                return None
            host_slots = self.host.pages.allocate(hits * ps)
        except BaseException:
            if pin is not None:
                self.tree.unpin_host(pin)
            raise
        pages = host_slots[::ps].div(ps, rounding_mode="floor").tolist()
        op = Prefetch(
            tokens[: start + hits * ps].clone(), start, keys[:hits], host_slots, pin, ns, pages
        )
        self.reading_tokens += hits * ps
        self._prefetches.append(op)
        self._io.read_jobs.put(op)
        return op

    def _exists(self, keys: List[str]) -> Optional[int]:
        """The store's consecutive hits among `keys`, asked from the
        scheduler's thread: within `query_timeout_s` for a blocking backend.
        None (counted) when reads are left alone or no answer came."""
        if self._asker is None:
            hits = self._io.exists(keys)
        else:
            hits, why = self._asker.ask(keys, self.faults.query_timeout_s)
            if why:  # no answer in time, or an earlier query still waits for one
                self.query_timeouts += why == "timeout"
                self.skipped_reads += why == "busy"
                self._io.reads.failed()
                return None
        if hits is None:
            self.skipped_reads += 1
        return hits

    def wait(self, op: Prefetch) -> None:
        """Waits for `op`'s pages as the policy says (none for best_effort;
        up to `wait_limit_s` for wait_complete; a bound growing with the
        length for timeout). Applying them is `storage_check`'s."""
        if self.policy == "wait_complete":
            deadline = time.monotonic() + self.faults.wait_limit_s
            while not op.done.wait(min(1.0, max(0.0, deadline - time.monotonic()))):
                if time.monotonic() >= deadline or not self._reader.is_alive():
                    break
        elif self.policy == "timeout":
            op.done.wait(self.timeout_base_s + self.timeout_per_1k_tokens_s * op.num_tokens / 1000)
        else:
            return
        if not op.done.is_set():  # given up on: it failed to come in time, whether it
            self._stalled(op, self._io.reads)  # ran or waited behind slow reads

    def _apply_prefetch(self, op: Prefetch) -> None:
        ps = self.page_size
        got = op.pages_ok * ps
        taken_slots = op.host_slots[:got]
        rest = op.host_slots[got:]
        self.reading_tokens -= op.num_tokens
        if got:
            rejected = self.tree.insert_host(
                op.tokens[: op.start + got], op.start, taken_slots, op.ns
            )
            op.inserted = got - len(rejected)
            if len(rejected):
                self.host.pages.free(rejected, self.tree, True)
            if op.inserted:
                self.events.host_inserted(
                    op.tokens[: op.start + got], op.start, taken_slots, rejected, op.ns
                )
        if len(rest):
            self.host.pages.free(rest, self.tree, True)
        if op.pin is not None:
            self.tree.unpin_host(op.pin)
        self.prefetched_tokens += op.inserted
        op.applied = True

    # -- acknowledgements ----------------------------------------------------------------

    @_core.shielded
    def storage_check(self) -> int:
        """Applies every finished write (unpins its host pages) and prefetch
        (its pages join the tree). Returns how many were applied."""
        self._check_thread()
        applied = self._apply_finished()
        now = time.monotonic()
        in_flight: Tuple[Tuple[Iterable[Union[_Write, Prefetch]], Health], ...] = (
            (self._writes, self._io.writes),
            (self._prefetches, self._io.reads),
        )
        for jobs, health in in_flight:
            oldest = next(iter(jobs), None)  # the one running, or finished
            if (
                oldest is not None
                and oldest.started is not None
                and now - oldest.started > self.faults.stall_s
            ):
                self._stalled(oldest, health)
        return applied

    def _stalled(self, job, health: Health) -> None:
        """A job running too long counts, once, as a failed call."""
        if not job.stalled:
            job.stalled = True
            health.failed()

    def _apply_finished(self) -> int:
        applied = 0
        while True:
            try:
                job = self._io.finished.get_nowait()
            except queue.Empty:
                return applied
            applied += self._apply(job)

    def _apply(self, job) -> int:
        """Applies one finished (or dropped) job; 0 if it was applied before."""
        job.done.set()  # (a dropped one never ran: whoever waits for it wakes)
        if isinstance(job, _Write):
            if job not in self._writes:
                return 0
            del self._writes[job]
            self.tree.finish_storage_write(job.copy)
            # A failed page ends the run of pages that count as stored.
            run = job.ok.index(False) if False in job.ok else len(job.ok)
            self.written_pages += run - job.present
            self.present_pages += min(job.present, run)
            self.write_failures += job.ok.count(False)
            self.skipped_writes += job.skipped
            if job.blocks is not None and run:
                self.events.disk_stored(job.blocks[:run])
            return 1
        if job.applied:
            return 0
        self._prefetches.remove(job)
        self.skipped_reads += job.skipped
        self._apply_prefetch(job)
        return 1

    def drain(self, limit_s: Optional[float] = None) -> bool:
        """Waits for every write and prefetch queued so far, and applies them;
        at most `limit_s` (None: `wait_limit_s`). Returns whether all were."""
        deadline = time.monotonic() + (self.faults.wait_limit_s if limit_s is None else limit_s)
        while self._writes or self._prefetches:
            self._check_thread()
            left = deadline - time.monotonic()
            if self.abandoned or left <= 0 or not (self._writes or self._prefetches):
                break
            self._oldest().done.wait(min(1.0, left))
            self.storage_check()
        return not (self._writes or self._prefetches)

    def _oldest(self):
        """A job in flight, to wait for (only storage_check takes what
        finished: a wait that is interrupted loses nothing)."""
        return next(iter(self._writes)) if self._writes else self._prefetches[0]

    def _check_thread(self) -> None:
        """A storage thread that died while the tier was open is lost:
        storage is switched off (the other thread is stopped too), so the
        manager goes on without it. Once a thread is gone (lost, or stopped
        by close), what its jobs still hold is released: a dead thread
        touches nothing (a job queued after the stop, by a prefetch racing
        close from another thread, never runs)."""
        reader, writer = self._reader.is_alive(), self._writer.is_alive()
        if reader and writer:
            return
        if not self._closed:
            self.lost = True
            self._stop()
            log.warning("radixkv: a storage tier's thread is gone; storage is switched off")
        if (not writer and self._writes) or (not reader and self._prefetches):
            self._apply_finished()
            if not writer:
                for job in list(self._writes):
                    job.ok = []
                    self._apply(job)
            if not reader:
                for op in list(self._prefetches):
                    op.pages_ok = 0
                    self._apply(op)

    @property
    def in_flight(self) -> int:
        return len(self._writes) + len(self._prefetches)

    def hit_len(self, handle) -> int:
        """Of `handle`'s host part, the tokens read from storage and not on
        the device since (the storage tier's hits)."""
        return self.tree.storage_hit_len(handle)

    def figures(self) -> dict:
        """The tier's part of `CacheMetrics`."""
        c = self.counters()
        return dict(
            storage_written_pages=c.written_pages,
            storage_prefetched_tokens=c.prefetched_tokens,
            storage_errors=c.errors,
            storage_corrupt_pages=c.corrupt_pages,
            storage_skipped_reads=c.skipped_reads,
            storage_skipped_writes=c.skipped_writes,
            storage_query_timeouts=c.query_timeouts,
            host_reading_tokens=self.reading_tokens,
        )

    def counters(self) -> StorageCounters:
        errors, corrupt = self.backend.counts()
        return StorageCounters(
            self.written_pages,
            self.prefetched_tokens,
            errors,
            corrupt,
            self.write_failures,
            self.skipped_reads + self.skipped_writes,
            self.present_pages,
            self.skipped_reads,
            self.skipped_writes,
            self.query_timeouts,
            self.lost,
        )

    def check_integrity(self) -> None:
        """Checks that the host slots prefetches in flight own are counted
        (`reading_tokens`), allocated and in no node, that the tree's pins
        are the prefetches' and its pages being written the writes'."""
        storage_writing = self.tree.tier_sizes().storage_writing
        writing = sum(len(job.pages) for job in self._writes) * self.page_size
        if storage_writing != writing:
            raise _core.IntegrityError(
                f"the tree pins {storage_writing} host tokens for writes to "
                f"storage, the writes in flight hold {writing}"
            )
        pins = sum(op.pin is not None and not op.applied for op in self._prefetches)
        if self.tree.host_pins != pins:
            raise _core.IntegrityError(
                f"the tree holds {self.tree.host_pins} host pins, " f"prefetches in flight {pins}"
            )
        if self._prefetches:
            slots = torch.cat([op.host_slots for op in self._prefetches])
            self.host.pages.check_owned(
                slots, "host slots of prefetches in flight", self.tree, True
            )
        owned = sum(op.num_tokens for op in self._prefetches)
        if owned != self.reading_tokens:
            raise _core.IntegrityError(
                f"reads from storage own {owned} host slots but the "
                f"tier counts {self.reading_tokens}"
            )

    # -- closing ----------------------------------------------------------------------

    @property
    def close_timeout_s(self) -> float:
        return self.faults.close_timeout_s

    def shut_down(self, wait: bool, settle_backups: Callable[[], object]) -> None:
        """`close` as the manager's close does it: with `wait`,
        `settle_backups()` first (the host tier's backups land and their
        writes are queued), then what is queued is waited for."""
        if wait:
            settle_backups()
        self.close(self.wait_closed(wait))

    def wait_closed(self, wait: bool) -> float:
        """What `close` waits for before it changes anything: with `wait`,
        the queued writes and prefetches, until the close deadline (the host
        tier's copies must have landed first: a backup that lands later would
        queue a write). Returns the deadline."""
        deadline = time.monotonic() + self.faults.close_timeout_s
        if wait and not self._closed:
            self.drain(self.faults.close_timeout_s)
        return deadline

    def close(self, deadline: float) -> None:
        """Stops the storage tier by `deadline` (from `wait_closed`): later
        writes and prefetches are not made, queued ones are dropped (their
        pages released), the thread is asked to stop and waited for until
        the deadline, and the backend is closed (by the thread, once its
        call returns). A thread still inside a backend call at the deadline
        is left to it: the jobs it holds keep their host pages, which nothing
        else uses, and `storage_check()` applies them if it ever finishes."""
        self._check_thread()  # a thread lost before: storage was switched off already
        self._stop()
        for thread in (self._reader, self._writer):
            thread.join(max(0.0, deadline - time.monotonic()))
        self.storage_check()
        if (self._reader.is_alive() or self._writer.is_alive()) and not self._io.closing:
            self.abandoned = True
            log.warning(
                "radixkv: the storage tier's thread is still inside a backend call "
                "after close(); it is left to finish alone"
            )

    @_core.shielded
    def _stop(self) -> bool:
        """Closes the tier to new work, drops what is queued and asks the
        threads to stop; False if it was closed (or lost) already."""
        if self._closed:
            return False
        self._closed = True
        for jobs in (self._io.read_jobs, self._io.write_jobs):
            while True:
                try:
                    job = jobs.get_nowait()
                except queue.Empty:
                    break
                job.skipped = True  # never started: what it held goes back now
                self._apply(job)
            jobs.put(None)
        if self._asker is not None:
            self._asker.stop()
        return True


class NoStorageTier:
    """The storage tier, off (`storage=None`): a store that holds nothing."""

    in_flight = reading_tokens = 0
    close_timeout_s: Optional[float] = None

    def prefetch(self, tokens: torch.Tensor, namespace=None) -> Optional[Prefetch]:
        Namespaces.check(namespace)  # a bad name raises all the same; a good one is not kept
        return None

    def wait(self, op: Prefetch) -> None:
        pass

    def storage_check(self) -> int:
        return 0

    def write_landed(self) -> None:
        pass

    def drain(self, limit_s: Optional[float] = None) -> bool:
        return True

    def hit_len(self, handle) -> int:
        return 0

    def shut_down(self, wait: bool, settle_backups) -> None:
        pass

    def counters(self) -> Optional[StorageCounters]:
        return None

    def figures(self) -> dict:
        return {}

    def check_integrity(self) -> None:
        pass
