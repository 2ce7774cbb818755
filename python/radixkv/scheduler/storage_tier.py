"""The storage tier of a CacheManager: pages written to a shared store after
their backup to host, and prefetched from it into host pages after a match."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import List, NamedTuple, Optional

import torch

from radixkv import _core
from radixkv.storage.base import MAX_BATCH, StorageBackend
from radixkv.scheduler.namespaces import Namespaces
from radixkv.storage.keys import page_keys

PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
"""When the scheduler takes a prefetch's pages: as far as they have arrived
when the request is scheduled (`best_effort`), once all have (`wait_complete`),
or waiting up to a bound that grows with the length (`timeout`)."""


class StorageCounters(NamedTuple):
    written_pages: int     # pages whose write succeeded
    prefetched_tokens: int  # tokens read from storage and added to the tree
    errors: int            # failed calls and pages (the backend's count)
    corrupt_pages: int     # pages read back that failed their checks
    write_failures: int    # pages whose write failed
    skipped: int           # writes and prefetches not tried while the store was down
    present_pages: int     # pages not written: the store had them already


@dataclass(eq=False)  # identity: jobs are found by `is`, never compared
class _Write:
    copy: tuple
    keys: List[str]
    pages: List[int]
    ok: List[bool] = field(default_factory=list)
    skipped: bool = False  # the store went down before every page was tried
    present: int = 0       # pages from the first that the store had already
    blocks: Optional[list] = None  # the pages' blocks, when KV events are on


@dataclass(eq=False)
class Prefetch:
    """A read of pages from storage into host pages, in flight."""

    tokens: torch.Tensor   # the path's tokens, up to the last page asked for
    start: int             # tokens[start:] are being read
    keys: List[str]
    host_slots: torch.Tensor
    pin: Optional[tuple]   # the tree's pin on the host copy the pages join under
    ns: int = 0            # the path's cache namespace
    done: threading.Event = field(default_factory=threading.Event)
    pages_ok: int = 0      # consecutive pages read from the first
    applied: bool = False
    inserted: int = 0      # tokens the tree took
    skipped: bool = False  # the store went down before every page was tried

    @property
    def num_tokens(self) -> int:
        return len(self.host_slots)


class StorageTier:
    """Writes and prefetches between the host tier and a StorageBackend.

    Backend calls run on the tier's own thread; the tree and the host pages
    change only on the scheduler's thread, when it applies what finished
    (`storage_check`). A write pins its host pages (the tree's BeginStore)
    until the thread reports it, so they are never evicted, freed or reused
    under the write. A prefetch owns the host pages it reads into until it is
    applied: the pages read (consecutive from the first) join the tree as a
    host-only node under the path's host copy (InsertHost), the rest go back.

    A store that stops answering (a backend call whose pages all failed with
    an error) is left alone for `retry_after_s`, doubling at each failed
    retry up to `max_retry_after_s`: meanwhile writes and prefetches are
    skipped and counted, so a dead store costs one stalled call per window,
    not one per request. The first call that succeeds ends the back-off.

    With `writer=False` the tier only reads: the pages of a pool that is the
    same on every tensor-parallel rank (MLA) are written by one rank, and
    every rank prefetches them.
    """

    def __init__(self, host_tier, backend: StorageBackend, seed: Optional[bytes],
                 namespaces: Namespaces,
                 prefetch_policy: str = "best_effort", timeout_base_s: float = 1.0,
                 timeout_per_1k_tokens_s: float = 0.25, min_prefetch_tokens: int = 0,
                 retry_after_s: float = 1.0, max_retry_after_s: float = 30.0,
                 writer: bool = True):
        if prefetch_policy not in PREFETCH_POLICIES:
            raise ValueError(f"prefetch_policy must be one of {', '.join(PREFETCH_POLICIES)}, "
                             f"got {prefetch_policy!r}")
        if host_tier.pool is None:
            raise ValueError("a storage tier moves K/V bytes: the CacheManager needs kv_cache")
        if seed is None:
            seed = backend.fingerprint
        if seed is None:
            raise ValueError("storage_seed: give config_fingerprint(...) of this configuration "
                             "(or a backend with a fingerprint), so configurations sharing a "
                             "store never read each other's pages; b'' keys pages without a "
                             "seed (SGLang's page hash)")
        if not isinstance(seed, bytes) or len(seed) not in (0, 32):
            raise ValueError("storage_seed must be 32 bytes (config_fingerprint) or b''")
        self.host = host_tier
        self.tree = host_tier.tree
        self.page_size = host_tier.page_size
        self.backend = backend
        self.seed = seed or None
        self.namespaces = namespaces
        self.writer = bool(writer)
        self.policy = prefetch_policy
        self.timeout_base_s = timeout_base_s
        self.timeout_per_1k_tokens_s = timeout_per_1k_tokens_s
        self.min_prefetch_tokens = max(min_prefetch_tokens, self.page_size)
        self.retry_after_s = retry_after_s
        self.max_retry_after_s = max_retry_after_s
        self._health = threading.Lock()  # the back-off is set from both threads
        self._backoff_s = 0.0
        self._down_until = 0.0  # monotonic time before which the store is left alone
        self._closed = False
        self.skipped = 0
        backend.attach(host_tier.pool)
        self._jobs: "queue.Queue" = queue.Queue()
        self._finished: "queue.Queue" = queue.Queue()
        self._writes_in_flight = 0
        self._writing_tokens = 0
        self._prefetches: List[Prefetch] = []
        self.written_pages = self.prefetched_tokens = self.write_failures = 0
        self.present_pages = 0
        self.events = None  # the manager's BlockEvents when KV events are on
        self._thread = threading.Thread(target=self._run, name="radixkv-storage", daemon=True)
        self._thread.start()
        host_tier.on_backed_up = self.write

    # -- the store's health -----------------------------------------------------------

    def store_down(self) -> bool:
        """True while the tier is leaving a failed store alone."""
        return time.monotonic() < self._down_until

    def _call(self, fn, keys, *args):
        """Runs one backend call and notes how the store answered. A call that
        raised, or counted errors (on this thread) with no page succeeding,
        is a failure: the store is left alone for a while, longer each time.
        Only a page read or written ends that (an existence query proves
        little: a store may answer it and fail every write)."""
        before = self.backend.thread_errors()
        try:
            got = fn(keys, *args)
        except Exception:
            self.backend.count_error(max(1, len(keys)))
            got = 0 if fn == self.backend.batch_exists else [False] * len(keys)
        ok = got > 0 if isinstance(got, int) else any(got)
        if not ok and self.backend.thread_errors() != before:
            with self._health:
                self._backoff_s = min(max(self._backoff_s * 2, self.retry_after_s),
                                      self.max_retry_after_s)
                self._down_until = time.monotonic() + self._backoff_s
        elif ok and fn != self.backend.batch_exists:
            with self._health:
                self._backoff_s = 0.0
                self._down_until = 0.0
        return got

    def _exists(self, keys: List[str]) -> Optional[int]:
        """How many of `keys`, from the first, the store has, asked in
        batches of MAX_BATCH; None when the store is being left alone."""
        present = 0
        while present < len(keys):
            if self.store_down():
                return None
            got = self._call(self.backend.batch_exists, keys[present:present + MAX_BATCH])
            present += got
            if got < min(MAX_BATCH, len(keys) - present + got):
                break
        return present

    # -- the storage thread --------------------------------------------------------

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                if isinstance(job, _Write):
                    self._do_write(job)
                else:
                    self._do_read(job)
            except Exception:  # a backend bug must not kill the thread
                self.backend.count_error()
            finally:
                # Queued before `done` is set: a waiter that wakes finds it.
                self._finished.put(job)
                if isinstance(job, Prefetch):
                    job.done.set()

    def _do_write(self, job: _Write) -> None:
        # Pages the store has already (another instance wrote them, or a
        # host copy made again) are not written twice.
        present = self._exists(job.keys)
        if present is None:
            job.skipped = True
            return
        job.present = present
        job.ok = [True] * present
        for i in range(present, len(job.keys), MAX_BATCH):
            if self.store_down():
                job.skipped = True
                return
            job.ok += self._call(self.backend.batch_set, job.keys[i:i + MAX_BATCH],
                                 job.pages[i:i + MAX_BATCH])

    def _do_read(self, job: Prefetch) -> None:
        pages = job.host_slots[::self.page_size].div(self.page_size, rounding_mode="floor").tolist()
        ok = 0
        for i in range(0, len(job.keys), MAX_BATCH):
            if self.store_down():
                job.skipped = True
                break
            got = self._call(self.backend.batch_get, job.keys[i:i + MAX_BATCH],
                             pages[i:i + MAX_BATCH])
            for g in got:
                if not g:
                    job.pages_ok = ok
                    return
                ok += 1
        job.pages_ok = ok

    # -- writes ---------------------------------------------------------------------

    def write(self, backup_copy) -> None:
        """Queues the write of what a finished backup gave a host copy."""
        if self._closed or not self.writer:
            return
        if self.store_down():
            self.skipped += 1
            return
        began = self.tree.begin_store(backup_copy)
        if began is None:
            return
        copy, host_slots, tokens, ns = began
        if not self.namespaces.known(ns):  # its name was forgotten: no seed for its keys
            self.tree.finish_store(copy)
            return
        ps = self.page_size
        blocks = None
        if self.events is not None:
            # The blocks hold the pages' keys: the chain is hashed once.
            blocks = self.events.blocks(tokens.to(torch.int32).numpy(), copy[2] // ps, -1, ns)
            keys = [bytes(k).hex() for k in blocks["key"]]
        else:
            keys = page_keys(tokens, ps, self.namespaces.seed(ns, self.seed))[copy[2] // ps:]
        pages = host_slots[::ps].div(ps, rounding_mode="floor").tolist()
        self._writes_in_flight += 1
        self._writing_tokens += len(host_slots)
        self._jobs.put(_Write(copy, keys, pages, blocks=blocks))

    # -- prefetch -------------------------------------------------------------------

    def prefetch(self, tokens: torch.Tensor, ns: int = 0) -> Optional[Prefetch]:
        """Starts reading the pages of `tokens` (in namespace `ns`) beyond
        the cache's match (whole pages) that the store has, consecutive from
        the first, into fresh host pages. None when there is nothing worth
        fetching or no host room."""
        if self._closed:
            return None
        ps = self.page_size
        n = len(tokens) - len(tokens) % ps
        start, host_backed = self.tree.storage_prefix_end(tokens[:n], ns)
        if n - start < self.min_prefetch_tokens:
            return None
        keys = page_keys(tokens[:n], ps, self.namespaces.seed(ns, self.seed))[start // ps:]
        hits = self._exists(keys)
        if hits is None:
            self.skipped += 1
            return None
        if hits * ps < self.min_prefetch_tokens:
            return None
        if not host_backed and not self.host.copy_path_to_host(tokens[:start], ns):
            return None
        # The host copy the pages will join under stays until they do.
        pin = self.tree.pin_host(tokens[:start], ns) if start else None
        if start and pin is None:
            return None
        room = self.host.make_room(hits * ps)
        hits = min(hits, room // ps)
        if hits * ps < self.min_prefetch_tokens:
            if pin is not None:
                self.tree.unpin_host(pin)
            return None
        host_slots = self.host.pages.allocate(hits * ps)
        self.host.prefetch_tokens += hits * ps
        op = Prefetch(tokens[:start + hits * ps].clone(), start, keys[:hits], host_slots, pin, ns)
        self._prefetches.append(op)
        self._jobs.put(op)
        return op

    def wait_for(self, op: Prefetch) -> None:
        """Waits as the policy says for `op`'s pages, then applies what arrived."""
        if self.policy == "wait_complete":
            while not op.done.wait(1.0):
                if not self._thread.is_alive():
                    raise RuntimeError("the storage tier's thread is gone with a read in flight")
        elif self.policy == "timeout":
            op.done.wait(self.timeout_base_s + self.timeout_per_1k_tokens_s * op.num_tokens / 1000)
        self.storage_check()

    def _apply_prefetch(self, op: Prefetch) -> None:
        ps = self.page_size
        got = op.pages_ok * ps
        taken_slots = op.host_slots[:got]
        rest = op.host_slots[got:]
        self.host.prefetch_tokens -= op.num_tokens
        if got:
            rejected = self.tree.insert_host(op.tokens[:op.start + got], op.start, taken_slots,
                                             op.ns)
            op.inserted = got - len(rejected)
            if len(rejected):
                self.host.pages.free(rejected, self.tree, True)
            if self.events is not None and op.inserted:
                self.events.host_inserted(op.tokens[:op.start + got], op.start, taken_slots,
                                          rejected, op.ns)
        if len(rest):
            self.host.pages.free(rest, self.tree, True)
        if op.pin is not None:
            self.tree.unpin_host(op.pin)
        self.prefetched_tokens += op.inserted
        op.applied = True

    # -- acknowledgements ----------------------------------------------------------------

    def storage_check(self) -> int:
        """Applies every finished write (unpins its host pages) and prefetch
        (its pages join the tree). Returns how many were applied."""
        applied = 0
        while True:
            try:
                job = self._finished.get_nowait()
            except queue.Empty:
                return applied
            applied += 1
            if isinstance(job, _Write):
                self._writes_in_flight -= 1
                self._writing_tokens -= len(job.pages) * self.page_size
                self.tree.finish_store(job.copy)
                # A failed page ends the run of pages that count as stored.
                run = job.ok.index(False) if False in job.ok else len(job.ok)
                self.written_pages += run - job.present
                self.present_pages += min(job.present, run)
                self.write_failures += job.ok.count(False)
                if job.blocks is not None and run:
                    self.events.disk_stored(job.blocks[:run])
                self.skipped += job.skipped
            else:
                self._prefetches.remove(job)
                self.skipped += job.skipped
                self._apply_prefetch(job)

    def drain(self) -> None:
        """Waits for every write and prefetch queued so far, and applies them."""
        while self._writes_in_flight or self._prefetches:
            try:
                job = self._finished.get(timeout=1.0)
            except queue.Empty:
                if not self._thread.is_alive():
                    raise RuntimeError("the storage tier's thread is gone with "
                                       f"{self.in_flight} jobs in flight") from None
                continue
            self._finished.put(job)
            self.storage_check()

    @property
    def in_flight(self) -> int:
        return self._writes_in_flight + len(self._prefetches)

    def counters(self) -> StorageCounters:
        errors, corrupt = self.backend.counts()
        return StorageCounters(self.written_pages, self.prefetched_tokens, errors, corrupt,
                               self.write_failures, self.skipped, self.present_pages)

    def check_integrity(self) -> int:
        """Host slots owned by prefetches in flight (for the host pool's sum);
        checks they are allocated and in no node, that the tree's pins are
        the prefetches' and its pages being written the writes'."""
        storing = self.tree.tier_sizes()[6]
        if storing != self._writing_tokens:
            raise _core.IntegrityError(f"the tree pins {storing} host tokens for writes to "
                                       f"storage, the writes in flight hold {self._writing_tokens}")
        pins = sum(op.pin is not None and not op.applied for op in self._prefetches)
        if self.tree.host_pins != pins:
            raise _core.IntegrityError(f"the tree holds {self.tree.host_pins} host pins, "
                                       f"prefetches in flight {pins}")
        if self._prefetches:
            slots = torch.cat([op.host_slots for op in self._prefetches])
            self.host.pages.check_owned(slots, "host slots of prefetches in flight", self.tree,
                                        True)
        return sum(op.num_tokens for op in self._prefetches)

    def close(self, wait: bool = True) -> None:
        """Finishes what is queued (the host tier's copies first: a backup
        that lands later would queue a write), then stops the thread and
        closes the backend. Later writes and prefetches are not made.

        With `wait=False` (a shutdown that cannot wait, after an error) the
        queued writes and prefetches are dropped instead: the thread stops
        after the job it is running, and the backend is closed."""
        if self._closed:
            return
        if wait:
            self.host.controller.drain()
            self.host.writing_check()
            self.drain()
        self._closed = True
        self.host.on_backed_up = None
        if self._thread.is_alive():
            if not wait:
                self._drop_queued_jobs()
            self._jobs.put(None)
            self._thread.join()
        self.backend.close()

    def _drop_queued_jobs(self) -> None:
        while True:
            try:
                self._jobs.get_nowait()
            except queue.Empty:
                return
