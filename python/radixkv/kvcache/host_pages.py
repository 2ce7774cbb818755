"""Which named pages radixkv's host tier holds, for an engine that names its
blocks itself (vLLM: a chain hash per block, so a name stands for its whole
prefix). The index lives where the engine schedules; the memory (a
`HostKVCache`) lives where the engine computes, and the two agree through
the page numbers the scheduler sends with each step.

A page is *pending* from the moment it is taken for a name until the copy
that fills it is reported (`filled`): only *ready* pages count as hits. A
page is pinned while anything will read or write it (a fill, a load, a
store write, a request that was promised it): a pinned page is never taken
for another name. Names may be grouped (`group=`, vLLM's cache_salt), each
group with its own bound of pages (`quotas`): a group at its bound makes
room from its own pages first."""

from __future__ import annotations

import collections
import heapq
import itertools
from typing import Dict, Iterable, List, Mapping, Optional

from radixkv._checks import as_count

# The orders in which unpinned ready pages are given up.
HOST_PAGE_POLICIES = ("lru", "fifo", "lfu")


class HostPageIndex:
    """Names -> host pages [0, num_pages)."""

    def __init__(
        self,
        num_pages: int,
        policy: str = "lru",
        quotas: Optional[Mapping[Optional[str], int]] = None,
    ) -> None:
        self.num_pages = as_count(num_pages, "num_pages")
        if policy not in HOST_PAGE_POLICIES:
            raise ValueError(
                f"policy must be one of {', '.join(HOST_PAGE_POLICIES)}, got {policy!r}"
            )
        self.policy = policy
        self.quotas: Dict[Optional[str], int] = {}
        for group, bound in (quotas or {}).items():
            self.quotas[group] = as_count(bound, f"quotas[{group!r}]")
        # name -> page, in the policy's order for lru and fifo (oldest first)
        self._pages: "collections.OrderedDict[str, int]" = collections.OrderedDict()
        self._names: Dict[int, str] = {}  # page -> name
        self._group: Dict[int, Optional[str]] = {}  # page -> its name's group
        self._held: collections.Counter = collections.Counter()  # group -> pages
        self._ready: set = set()
        self._free: List[int] = list(range(self.num_pages - 1, -1, -1))
        self._pins: Dict[int, int] = {}
        self._dropped: set = set()  # pages of forgotten names, free once unpinned
        # lfu: (hits, tick, page) candidates; stale entries are skipped.
        self._hits: Dict[int, int] = {}
        self._heap: list = []
        self._tick = itertools.count()
        self.evictions = 0
        self.evicted: List[int] = []  # pages given up since the last take_evicted()

    def __len__(self) -> int:
        return len(self._pages)

    @property
    def used(self) -> int:
        """Pages holding a name (ready or pending)."""
        return len(self._pages)

    @property
    def ready_pages(self) -> int:
        """Pages whose fill landed (what a lookup can hit)."""
        return len(self._ready)

    def pinned(self) -> int:
        """How many pages are pinned."""
        return len(self._pins)

    def name_of(self, page: int) -> Optional[str]:
        return self._names.get(page)

    # -- lookups ------------------------------------------------------------------------

    def page(self, name: str) -> Optional[int]:
        """The page holding `name` (ready or pending), without counting a use."""
        return self._pages.get(name)

    def get(self, name: str) -> Optional[int]:
        """The ready page holding `name`, now used (the policy sees it);
        None if none."""
        page = self._pages.get(name)
        if page is None or page not in self._ready:
            return None
        self._used(name, page)
        return page

    def run(self, names: Iterable[str]) -> int:
        """How many of `names`, from the first, are on ready pages."""
        count = 0
        for name in names:
            if self.get(name) is None:
                break
            count += 1
        return count

    def used_chain(self, names: Iterable[str]) -> None:
        """Marks a chain of names (each standing for its prefix) used with
        its head last: under lru a chain is then given up from its tail,
        as a block is worth nothing without the ones before it."""
        if self.policy == "lru":
            pages = self._pages
            for name in reversed(list(names)):
                if name in pages:
                    pages.move_to_end(name)

    def _used(self, name: str, page: int) -> None:
        if self.policy == "lru":
            self._pages.move_to_end(name)
        elif self.policy == "lfu":
            hits = self._hits[page] = self._hits.get(page, 0) + 1
            heapq.heappush(self._heap, (hits, next(self._tick), page))

    # -- taking pages -------------------------------------------------------------------

    def take(self, name: str, group: Optional[str] = None) -> Optional[int]:
        """A pending page for `name`, pinned; None when `name` already has a
        page (ready or pending) or no page can be had (every candidate
        pinned, or `group` at its bound with none of its own to give up)."""
        if name in self._pages:
            return None
        bound = self.quotas.get(group)
        if bound is not None and self._held[group] >= bound:
            page = self._evict(group)
        else:
            page = self._free.pop() if self._free else self._evict(None)
        if page is None:
            return None
        self._pages[name] = page
        self._names[page] = name
        self._group[page] = group
        self._held[group] += 1
        self.pin(page)
        return page

    def filled(self, page: int, ok: bool) -> None:
        """The copy filling `page` landed (`ok`) or failed: a ready page, or
        its name forgotten. The fill's pin stays (unpin it)."""
        name = self._names.get(page)
        if name is None:
            return
        if ok:
            self._ready.add(page)
            if self.policy == "lfu":
                self._hits[page] = 0
                heapq.heappush(self._heap, (0, next(self._tick), page))
        else:
            self.drop(name, page)

    def ready(self, page: int) -> bool:
        return page in self._ready

    def _evict(self, group: Optional[str]) -> Optional[int]:
        """Gives up the first unpinned ready page in the policy's order (of
        `group` only, when given); None if there is none."""
        if self.policy == "lfu":
            page = self._evict_lfu(group)
        else:
            page = None
            for victim, p in self._pages.items():
                if (
                    p in self._ready
                    and not self._pins.get(p)
                    and (group is None or self._group[p] == group)
                ):
                    page = p
                    break
        if page is None:
            return None
        self._forget(self._names[page], page)
        self.evictions += 1
        self.evicted.append(page)
        return page

    def _evict_lfu(self, group: Optional[str]) -> Optional[int]:
        heap, skipped, found = self._heap, [], None
        while heap:
            hits, tick, page = heapq.heappop(heap)
            if page not in self._ready or self._hits.get(page) != hits:
                continue  # stale: used since, or gone
            if self._pins.get(page) or (group is not None and self._group[page] != group):
                skipped.append((hits, tick, page))
                continue
            found = page
            break
        for entry in skipped:
            heapq.heappush(heap, entry)
        return found

    def take_evicted(self) -> List[int]:
        """The pages given up for other names since the last call (their
        names are gone; what an engine announces as removed)."""
        out, self.evicted = self.evicted, []
        return out

    # -- pins and drops -----------------------------------------------------------------

    def pin(self, page: int) -> None:
        self._pins[page] = self._pins.get(page, 0) + 1

    def unpin(self, pages: Iterable[int]) -> None:
        for page in pages:
            left = self._pins[page] - 1
            if left:
                self._pins[page] = left
            else:
                del self._pins[page]
                if page in self._dropped:
                    self._dropped.discard(page)
                    self._free.append(page)

    def _forget(self, name: str, page: int) -> None:
        del self._pages[name]
        del self._names[page]
        self._held[self._group.pop(page)] -= 1
        self._ready.discard(page)
        self._hits.pop(page, None)

    def drop(self, name: str, page: int) -> bool:
        """Forgets `name` if it is still on `page` (its bytes proved bad, or
        the cache is being emptied); the page is free once unpinned.
        Whether it was there."""
        if self._pages.get(name) != page:
            return False
        self._forget(name, page)
        if self._pins.get(page):
            self._dropped.add(page)  # something still reads or writes it
        else:
            self._free.append(page)
        return True

    def clear(self) -> List[int]:
        """Forgets every name; returns the pages that were ready."""
        ready = [p for p in self._pages.values() if p in self._ready]
        for name, page in list(self._pages.items()):
            self.drop(name, page)
        return ready
