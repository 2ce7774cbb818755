"""Which named pages radixkv's host tier holds, for an engine that names its
blocks itself (vLLM: a chain hash per block, so a name stands for its whole
prefix): exact LRU over the names, pages pinned while a step that reads or
writes them is being planned. The index lives where the engine schedules;
the memory (a `HostKVCache`) lives where the engine computes, and the two
agree through the page numbers the scheduler sends with each step."""

from __future__ import annotations

import collections
from typing import Dict, Iterable, List, Optional

from radixkv._checks import as_count


class HostPageIndex:
    """Names -> host pages [0, num_pages), least recently used first."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = as_count(num_pages, "num_pages")
        self._pages: "collections.OrderedDict[str, int]" = collections.OrderedDict()
        self._free: List[int] = list(range(self.num_pages - 1, -1, -1))
        self._pins: Dict[int, int] = {}
        self._dropped: set = set()  # pages of forgotten names, free once unpinned
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._pages)

    def get(self, name: str) -> Optional[int]:
        """The page holding `name`, now the most recently used; None if none."""
        page = self._pages.get(name)
        if page is not None:
            self._pages.move_to_end(name)
        return page

    def run(self, names: List[str]) -> int:
        """How many of `names`, from the first, the host holds."""
        count = 0
        for name in names:
            if self.get(name) is None:
                break
            count += 1
        return count

    def take(self, name: str) -> Optional[int]:
        """A page for `name`, pinned: the one it has, a free one, or the least
        recently used unpinned one (its name forgotten). None when every page
        is pinned."""
        page = self.get(name)
        if page is None:
            page = self._free.pop() if self._free else self._evict()
            if page is None:
                return None
            self._pages[name] = page
        self.pin(page)
        return page

    def _evict(self) -> Optional[int]:
        for victim, page in self._pages.items():
            if not self._pins.get(page):
                del self._pages[victim]
                self.evictions += 1
                return page
        return None

    def pinned(self) -> int:
        """How many pages are pinned."""
        return len(self._pins)

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

    def drop(self, name: str, page: int) -> None:
        """Forgets `name` if it is still on `page` (its bytes proved bad)."""
        if self._pages.get(name) == page:
            del self._pages[name]
            if self._pins.get(page):
                self._dropped.add(page)  # a step being planned still names it
            else:
                self._free.append(page)
