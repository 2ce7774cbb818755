"""Back-off of one direction of a store: what the storage tier and the
SGLang L3 adapter share."""

from __future__ import annotations

import threading
import time


class Health:
    """How one direction of a store (reads or writes) has been answering,
    and whether it is left alone for now: after `failures_in_a_row` failed
    calls it is, for `retry_after_s`, doubling up to `max_retry_after_s`
    while the retries fail (a StorageFaultPolicy's fields). Thread-safe."""

    def __init__(self, policy) -> None:
        self._policy = policy
        self._lock = threading.Lock()
        self.backoff_s = 0.0
        self._down_until = 0.0
        self._in_a_row = 0

    def down(self) -> bool:
        """True while the direction is left alone."""
        return time.monotonic() < self._down_until

    def failed(self) -> None:
        p = self._policy
        with self._lock:
            self._in_a_row += 1
            if self.backoff_s:  # the retry after a back-off failed: wait longer
                self.backoff_s = min(self.backoff_s * 2, p.max_retry_after_s)
            elif self._in_a_row >= p.failures_in_a_row:
                self.backoff_s = min(p.retry_after_s, p.max_retry_after_s)
            else:
                return
            self._down_until = time.monotonic() + self.backoff_s

    def succeeded(self) -> None:
        """A call that moved pages: the run of failures and any back-off end.
        (An existence query that answers proves nothing of the kind: a store
        may answer queries and fail, or hang, every read.)"""
        with self._lock:
            self._in_a_row = 0
            if self.backoff_s:
                self.backoff_s = 0.0
                self._down_until = 0.0
