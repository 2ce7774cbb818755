"""What a bounded page store knows of its pages: their bytes, when each was
last used, and which page each extends, so that it can give pages up least
recently used first and never a page before the pages that extend it."""

from __future__ import annotations

import heapq
import threading
import time
from typing import Dict, List, Optional, Tuple


class PageIndex:
    """The pages of a store bounded to `max_bytes`, by raw key (32 bytes).

    A page's key covers its whole prefix (the key chain), so a page is read
    only after its prefix is found, here or in a faster tier: a prefix is
    worth more than any page that extends it. The index therefore gives up
    only *leaves*, pages that no page in the store extends: the least
    recently used leaf first. Giving one up may make its
    parent a leaf. A page whose parent is unknown (not given, or not in the
    store) is a root.

    Each page has a tick (nanoseconds of wall time, increasing): a page found
    on disk at start-up gets its modification time, a page written or read
    gets the current time. Leaves wait in a min-heap of (tick, key); an
    entry is stale once the page was used again, extended or given up, and is
    dropped when it comes up (the heap is rebuilt when it holds more than
    twice the pages). Adding, using and giving up a page cost O(log n).

    A page whose parent is not in the store still counts: its prefix may be
    on the device or the host, where a prefetch starts after it.

    With `max_bytes` None the index gives nothing up by itself: its owner
    takes leaves with `pop_leaf` while a bound of its own is exceeded (a
    file store whose bound is shared with other processes).

    Thread-safe: a store's reader and writer threads and its start-up scan
    share one index.
    """

    def __init__(self, max_bytes: Optional[int]):
        self.max_bytes = max_bytes
        self.total = 0  # bytes of the pages in the index
        self._lock = threading.Lock()
        # key -> (tick, size, parent key or None)
        self._pages: Dict[bytes, Tuple[int, int, Optional[bytes]]] = {}
        # key -> how many pages in the index extend it (kept while the key
        # itself is absent: its children are still there when it comes back)
        self._children: Dict[bytes, int] = {}
        self._leaves: List[Tuple[int, bytes]] = []
        self._last_tick = 0
        # Until the store's start-up scan has found every page, a page may
        # look like a leaf only because the pages extending it are not found
        # yet: nothing is given up before `complete()`.
        self._complete = False

    def __len__(self) -> int:
        return len(self._pages)

    def __contains__(self, key: bytes) -> bool:
        return key in self._pages

    def tick(self) -> int:
        """A tick after every tick so far: now, in nanoseconds of wall time
        (a store writes it as the page file's modification time, so the
        order of use is the same after a restart)."""
        with self._lock:
            return self._tick()

    def _tick(self) -> int:
        tick = self._last_tick = max(self._last_tick + 1, time.time_ns())
        return tick

    def _push(self, key: bytes, tick: int) -> None:
        heapq.heappush(self._leaves, (tick, key))
        if len(self._leaves) > 2 * len(self._pages) + 64:
            self._compact()

    def _compact(self) -> None:
        """The heap of leaves without its stale entries."""
        children = self._children
        self._leaves = [(entry[0], k) for k, entry in self._pages.items() if not children.get(k)]
        heapq.heapify(self._leaves)

    def add(
        self,
        key: bytes,
        size: int,
        parent: Optional[bytes] = None,
        tick: Optional[int] = None,
        *,
        if_absent: bool = False,
    ) -> List[bytes]:
        """Records page `key` of `size` bytes extending `parent`, used at
        `tick` (None: now), then gives up pages until the index fits its
        bound. With `if_absent`, a page already known is left as it is (what
        a start-up scan finds after a write came first). The keys given up,
        for the caller to remove: they may include `key` itself, when the
        bound cannot hold it with its prefix."""
        with self._lock:
            entry = self._pages.get(key)
            if entry is not None:
                if if_absent:
                    return []
                self.total += size - entry[1]
                if tick is None:
                    tick = self._tick()
                else:
                    self._last_tick = max(self._last_tick, tick)
                self._pages[key] = (tick, size, entry[2])
            else:
                if tick is None:
                    tick = self._tick()
                else:
                    self._last_tick = max(self._last_tick, tick)
                if parent == key:
                    parent = None
                self._pages[key] = (tick, size, parent)
                self.total += size
                if parent is not None:
                    self._children[parent] = self._children.get(parent, 0) + 1
            if not self._children.get(key):
                self._push(key, tick)
            return self._trim()

    def touch(self, key: bytes, tick: Optional[int] = None) -> None:
        """Page `key` was read (at `tick`, None: now): it is now the most
        recently used."""
        with self._lock:
            entry = self._pages.get(key)
            if entry is not None:
                if tick is None:
                    tick = self._tick()
                else:
                    self._last_tick = max(self._last_tick, tick)
                self._pages[key] = (tick, entry[1], entry[2])
                if not self._children.get(key):
                    self._push(key, tick)

    def discard(self, key: bytes) -> None:
        """Page `key` is gone from the store (removed by another process,
        found damaged): it leaves the index."""
        with self._lock:
            self._drop(key)

    def trim(self) -> List[bytes]:
        """Gives up pages until the index fits its bound: their keys."""
        with self._lock:
            return self._trim()

    def _drop(self, key: bytes) -> bool:
        entry = self._pages.pop(key, None)
        if entry is None:
            return False
        self.total -= entry[1]
        parent = entry[2]
        if parent is not None and parent in self._children:
            left = self._children[parent] - 1
            if left:
                self._children[parent] = left
            else:
                del self._children[parent]
                up = self._pages.get(parent)
                if up is not None:  # the parent is a leaf now
                    self._push(parent, up[0])
        return True

    def complete(self) -> List[bytes]:
        """Every page of the store is in the index now: it gives up what
        exceeds the bound (the keys, for the caller to remove)."""
        with self._lock:
            self._complete = True
            self._compact()  # the scan pushed every page it found
            return self._trim()

    def _trim(self) -> List[bytes]:
        gone: List[bytes] = []
        if not self._complete or self.max_bytes is None:
            return gone
        while self.total > self.max_bytes and self._pages:
            gone.append(self._pop_leaf()[0])
        return gone

    def _pop_leaf(self) -> Tuple[bytes, int, int, Optional[bytes]]:
        """Gives up the least recently used leaf of a non-empty index: (its
        key, tick, size, parent)."""
        while True:
            if self._leaves:
                tick, key = heapq.heappop(self._leaves)
                entry = self._pages.get(key)
                if entry is None or entry[0] != tick or self._children.get(key):
                    continue  # stale: used again, extended or given up since
            else:
                # Pages but no leaf: parents read from damaged or planted
                # headers made a cycle. They are not trusted from here: every
                # page is a leaf, in the order of use (one pass, O(n)).
                self._children.clear()
                self._pages = {k: (e[0], e[1], None) for k, e in self._pages.items()}
                self._compact()
                continue
            self._drop(key)
            return key, entry[0], entry[1], entry[2]

    def pop_leaf(self) -> Optional[Tuple[bytes, int, int, Optional[bytes]]]:
        """Gives up the least recently used page no page in the index extends:
        (its key, tick, size, parent); None when the index is empty or not
        complete yet."""
        with self._lock:
            if not self._complete or not self._pages:
                return None
            return self._pop_leaf()

    def tick_of(self, key: bytes) -> Optional[int]:
        """The tick of page `key` (None: not in the index)."""
        with self._lock:
            entry = self._pages.get(key)
            return None if entry is None else entry[0]

    def entries(self) -> List[Tuple[bytes, int, int, Optional[bytes]]]:
        """Every page: (key, tick, size, parent)."""
        with self._lock:
            return [(k, e[0], e[1], e[2]) for k, e in self._pages.items()]

    def clear(self) -> None:
        """Forgets every page (whether the index is complete stays as it was)."""
        with self._lock:
            self._pages.clear()
            self._children.clear()
            self._leaves.clear()
            self.total = 0

    def leaves_first(self) -> List[bytes]:
        """Every key, in the order the index would give them up (for tests:
        it empties a copy)."""
        with self._lock:
            copy = PageIndex(-1)
            copy._complete = True
            copy._pages = dict(self._pages)
            copy._children = dict(self._children)
            copy._leaves = list(self._leaves)
            copy.total = self.total
            return copy._trim()
