"""How a store that fails is treated (`StorageFaultPolicy`) and the back-off
of one direction of a store (`Health`): what the storage tier and the
engines' adapters share."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from radixkv._checks import as_count, as_seconds


@dataclass(frozen=True)
class StorageFaultPolicy:
    """How the storage tier treats a store that fails, stalls or hangs.

    Reads and writes are judged apart: a store that cannot take writes (a
    full disk, a read-only mount) still serves what it has. A direction
    whose calls failed `failures_in_a_row` times in a row is left alone for
    `retry_after_s`; its calls are skipped (and counted) meanwhile; the first
    call after the window is a retry: if it fails the window doubles, up to
    `max_retry_after_s`; the first that succeeds ends the back-off. A single
    failure among successes costs only its own pages.

    Bounds on what the scheduler's thread waits for:
    - `query_timeout_s`: an existence query (at `prefetch`) to a backend
      whose queries may block (Mooncake Store, a network file system) is
      asked on a thread of its own; no answer within the bound is a miss,
      counted in `query_timeouts` and as a failed read.
    - `wait_limit_s`: the longest `wait_prefetch` waits under `wait_complete`.
    - `close_timeout_s`: `close()` waits at most this long for the storage
      thread; a thread still inside a backend call is left to finish alone,
      the pages it holds kept from every other use. `reset()` waits as long
      for the writes and reads in flight.
    A read or write still running after `stall_s` (or a read a
    `wait_prefetch` gave up on) counts as a failed call of its direction,
    so a store that hangs is left alone too; and reads in flight together
    never hold more than half the host pool (one alone may take more).
    """

    retry_after_s: float = 1.0
    max_retry_after_s: float = 30.0
    failures_in_a_row: int = 3
    query_timeout_s: float = 0.05
    wait_limit_s: float = 60.0
    close_timeout_s: float = 5.0
    stall_s: float = 5.0

    def __post_init__(self):
        for name in ("retry_after_s", "max_retry_after_s"):
            object.__setattr__(self, name, as_seconds(getattr(self, name), name))
        for name in ("query_timeout_s", "wait_limit_s", "close_timeout_s", "stall_s"):
            object.__setattr__(self, name, as_seconds(getattr(self, name), name, positive=True))
        object.__setattr__(
            self, "failures_in_a_row", as_count(self.failures_in_a_row, "failures_in_a_row")
        )


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
