"""The storage tiers' threads: a registry that stops them before the
interpreter is torn down, and existence queries asked on a thread of their
own with a bound (for a backend whose queries may block)."""

from __future__ import annotations

import atexit
import contextlib
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Tuple

# The request queues of the threads while they run, by thread: at exit they
# are stopped and waited for (briefly) before the interpreter is torn down,
# so none of them runs Python code while it is.
_RUNNING: Dict[int, "queue.SimpleQueue"] = {}


@atexit.register
def _stop_threads_at_exit(limit_s: float = 2.0) -> None:
    running = dict(_RUNNING)
    for requests in running.values():
        drop_queued(requests)
        requests.put(None)
    deadline = time.monotonic() + limit_s
    for t in threading.enumerate():
        if t.ident in running:
            t.join(max(0.0, deadline - time.monotonic()))


@contextlib.contextmanager
def serving(requests: "queue.SimpleQueue") -> Iterator[None]:
    """Marks the calling thread as one serving `requests` until it leaves:
    at exit a None is queued for it (its queued requests dropped) and it is
    waited for."""
    _RUNNING[threading.get_ident()] = requests
    try:
        yield
    finally:
        _RUNNING.pop(threading.get_ident(), None)


def drop_queued(requests: "queue.SimpleQueue") -> None:
    """Empties `requests` without serving what it held."""
    while True:
        try:
            requests.get_nowait()
        except queue.Empty:
            return


@dataclass(eq=False)
class _Ask:
    keys: List[str]
    done: threading.Event = field(default_factory=threading.Event)
    hits: Optional[int] = None


class BoundedQuery:
    """Existence queries from the scheduler's thread to a backend whose
    queries may block, asked on a thread of their own and waited for at most
    a bound. One at a time: while one is still unanswered, others are misses
    without asking.

    `exists(keys)` answers how many of `keys`, from the first, the backend
    has (None: not asked); `count_error()` is called, on the query thread,
    when it raises."""

    def __init__(
        self,
        exists: Callable[[List[str]], Optional[int]],
        count_error: Callable[[], None],
    ) -> None:
        self._exists = exists
        self._count_error = count_error
        self._asks: "queue.SimpleQueue" = queue.SimpleQueue()
        self._stuck: Optional[_Ask] = None
        self._thread: Optional[threading.Thread] = None

    def ask(self, keys: List[str], timeout_s: float) -> Tuple[Optional[int], str]:
        """(hits or None, why): why is "" (answered), "busy" (an earlier query
        is still unanswered) or "timeout"."""
        if self._stuck is not None:
            if not self._stuck.done.is_set():
                return None, "busy"
            self._stuck = None
        if self._thread is None:
            self._thread = threading.Thread(
                target=BoundedQuery._serve,
                args=(self._asks, self._exists, self._count_error),
                name="radixkv-storage-query",
                daemon=True,
            )
            self._thread.start()
        a = _Ask(keys)
        self._asks.put(a)
        if a.done.wait(timeout_s):
            return a.hits, ""
        self._stuck = a
        return None, "timeout"

    @staticmethod
    def _serve(
        asks: "queue.SimpleQueue",
        exists: Callable[[List[str]], Optional[int]],
        count_error: Callable[[], None],
    ) -> None:
        with serving(asks):
            while True:
                a = asks.get()
                if a is None:
                    return
                try:
                    a.hits = exists(a.keys)
                except BaseException:  # noqa: BLE001
                    count_error()
                finally:
                    a.done.set()
                del a

    def stop(self) -> None:
        """Ends the query thread after the query it is asking, if any."""
        self._asks.put(None)
