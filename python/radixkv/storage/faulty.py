"""A fault-injecting wrapper around any storage backend, for tests."""

from __future__ import annotations

import random
import threading
import time
from typing import List, Optional, Sequence

from radixkv.storage.base import StorageBackend, takes_parents


class FaultyStorage(StorageBackend):
    """Wraps `backend`: each call sleeps a seeded random delay up to
    `max_delay_s`, and fails (an exception from the backend's side, counted
    as errors) with probability `fail_call`; each page of a get or set fails
    on its own with probability `fail_page`, and a get may also scribble over
    the host page before failing (`scribble`), as a torn read would. What the
    cache must do: count the failures, never use a failed page, leak no host
    page, never hang."""

    def __init__(
        self,
        backend: StorageBackend,
        seed: int = 0,
        fail_call: float = 0.05,
        fail_page: float = 0.1,
        max_delay_s: float = 0.001,
        scribble: bool = True,
    ):
        super().__init__()
        self.backend = backend
        self.rng = random.Random(seed)
        self.fail_call, self.fail_page = fail_call, fail_page
        self.max_delay_s, self.scribble = max_delay_s, scribble
        self.injected = 0
        self.fingerprint = backend.fingerprint
        self.codec = backend.codec  # (the wrapped backend encodes: its keys)
        # The wrapped store's keys and latency: the tier names pages as it does.
        self.name_key, self.tag_key = backend.name_key, backend.tag_key
        self.blocking_queries = backend.blocking_queries
        self.concurrent_calls = backend.concurrent_calls
        self._parents = takes_parents(backend)
        self._rng_lock = threading.Lock()  # batch_exists may come from another thread

    def call_lock(self) -> Optional[threading.Lock]:
        """The wrapped backend's: calls through the wrapper take turns as its own do."""
        return self.backend.call_lock()

    def _attached(self) -> None:
        pool = self.pool
        if pool is None:  # (attach() sets it before it calls this)
            raise RuntimeError("_attached() runs from attach(), once the pool is set")
        self.backend.attach(pool)

    def _random(self) -> float:
        with self._rng_lock:
            return self.rng.random()

    def _call_fails(self) -> bool:
        if self.max_delay_s:
            time.sleep(self._random() * self.max_delay_s)
        if self._random() < self.fail_call:
            with self._rng_lock:
                self.injected += 1
            self.count_error()
            return True
        return False

    def batch_exists(self, keys: Sequence[str]) -> int:
        if self._call_fails():
            return 0
        n = self.backend.batch_exists(keys)
        if n and self._random() < self.fail_page:
            with self._rng_lock:
                return self.rng.randint(0, n)
        return n

    def batch_get(self, keys: Sequence[str], host_pages: Sequence[int]) -> List[bool]:
        if self._call_fails():
            return [False] * len(keys)
        ok = self.backend.batch_get(keys, host_pages)
        for i, page in enumerate(host_pages):
            if ok[i] and self._random() < self.fail_page:
                ok[i] = False
                self.injected += 1
                self.count_error()
                if self.scribble:
                    self.page_view(page).fill_(0xAB)
        return ok

    def batch_set(
        self,
        keys: Sequence[str],
        host_pages: Sequence[int],
        parents: Optional[Sequence[Optional[str]]] = None,
    ) -> List[bool]:
        if self._call_fails():
            return [False] * len(keys)
        fail = [self._random() < self.fail_page for _ in keys]
        todo = [i for i, f in enumerate(fail) if not f]
        some: tuple = ([keys[i] for i in todo], [host_pages[i] for i in todo])
        if parents is not None and self._parents:
            some += ([parents[i] for i in todo],)
        done = self.backend.batch_set(*some)
        ok = [False] * len(keys)
        for i, d in zip(todo, done):
            ok[i] = d
        self.injected += sum(fail)
        if any(fail):
            self.count_error(sum(fail))
        return ok

    @property
    def errors_total(self) -> int:
        return self.errors + self.backend.errors

    def counts(self):
        """(errors, corrupt pages): injected ones and the wrapped backend's."""
        return self.errors + self.backend.errors, self.corrupt_pages + self.backend.corrupt_pages

    def thread_errors(self) -> int:
        return super().thread_errors() + self.backend.thread_errors()

    def close(self) -> None:
        self.backend.close()
