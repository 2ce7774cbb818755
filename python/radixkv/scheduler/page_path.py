"""The page path of a CacheManager: its request steps with page ids crossing
instead of token slots.

Page p of the device pool holds slots p * page_size + [0, page_size) (pages
are aligned in their pool: a CacheManager's tree is made with
`aligned_pages`), so a request's pages name its slots: each call here is
its slot form's (`match_req`, `load_back`, `allocate`, `free`,
`free_and_cache_finished_req`, `cache_unfinished_req`), with page_size
times fewer entries, the same checks and the same effects. At page_size 1
pages are slots. The radix cache only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Tuple, cast

import torch

from radixkv import _core
from radixkv._core import shielded
from radixkv._checks import as_count, as_flag, int32_tensor, to_host
from radixkv.kvcache.base import BaseCacheHandle
from radixkv.kvcache.page_ids import pages_of_slots, slots_of_pages
from radixkv.kvcache.request_inputs import length
from radixkv.scheduler.namespaces import Namespaces

if TYPE_CHECKING:
    from radixkv.scheduler.tiers import Tiers
    from radixkv.scheduler.upkeep import Upkeep


class PagePath:
    """CacheManager's page-form request steps (a base of CacheManager, which
    owns every attribute they use)."""

    if TYPE_CHECKING:  # the CacheManager's (scheduler/cache.py)
        device: torch.device
        page_size: int
        _tree: Optional[_core.RadixTree]
        _pages: _core.PageAllocator
        _tiers: Tiers
        _upkeep: Upkeep
        _namespaces: Namespaces
        _held_pages: int

        def _matched(self, tokens: int, handles) -> None: ...
        def _request_inputs(self, input_ids, indices): ...
        def _finished(
            self,
            handle,
            ids,
            indices,
            in_cache: int,
            held: Optional[int] = None,
            pages: bool = False,
        ) -> None: ...
        def _load_back(self, handle: BaseCacheHandle): ...

    def _page_tree(self, what: str) -> _core.RadixTree:
        tree = self._tree
        if tree is None:
            raise TypeError(f"{what} needs the radix cache: this manager has the naive one")
        return tree

    @shielded
    def match_pages(
        self, input_ids, namespace=None, *, skip_last: bool = True
    ) -> Tuple[BaseCacheHandle, torch.Tensor]:
        """`match_req` returning the device part's pages (`cached_len //
        page_size` page ids, int32 on the host) instead of its slots."""
        tree = self._page_tree("match_pages")
        skip = as_flag(skip_last, "skip_last")
        ids = to_host(input_ids, "input_ids", self.device)
        ns = 0 if Namespaces.is_default(namespace) else self._namespaces.id(namespace)
        handle, pages = tree.match_pages(ids, ns, skip)  # (reads and checks the input)
        self._matched(length(ids) - skip, (handle,))
        if self._tiers.backs_up_on_match:
            self._tiers.back_up(ids[:-1] if skip else ids, ns)
        return handle, pages

    @shielded
    def load_back_pages(self, handle: BaseCacheHandle) -> Tuple[BaseCacheHandle, torch.Tensor]:
        """`load_back`, returning the whole match's pages (the device part's,
        then the new pages the host part loads into)."""
        self._page_tree("load_back_pages")
        loaded, pages, slots = self._load_back(handle)
        if pages is None:  # (a load that had to make room first gives slots)
            pages = pages_of_slots(cast(torch.Tensor, slots), self.page_size)
        return loaded, pages

    @shielded
    def allocate_pages(self, num_tokens: int, namespace=None) -> torch.Tensor:
        """`allocate` as page ids: ceil(num_tokens / page_size) of them."""
        self._page_tree("allocate_pages")
        n = as_count(num_tokens, "num_tokens", minimum=0)
        self._upkeep.make_room(n, self._namespaces.find(namespace))
        pages = self._pages.allocate_pages(n)
        self._held_pages += pages.shape[0]
        return pages

    @shielded
    def release_pages(self, page_ids) -> None:
        """`free` by page ids: returns pages a request holds (not cached ones)."""
        tree = self._page_tree("release_pages")
        ids = to_host(page_ids, "page_ids", self.device)
        if self._tiers.loads_in_flight():
            pages = int32_tensor(ids, "page_ids", self.device)
            self._tiers.check_not_loading(slots_of_pages(pages, self.page_size), "page_ids")
        self._pages.free_pages(ids, tree)
        self._held_pages -= length(ids)

    @shielded
    def free_and_cache_finished_req_pages(
        self, old_handle: BaseCacheHandle, input_ids, page_ids, priority: int = 0
    ) -> None:
        """`free_and_cache_finished_req` with the request's pages: its
        match's (from `match_pages` or `load_back_pages`), then its own
        (ceil(len(input_ids) / page_size) in all)."""
        tree = self._page_tree("free_and_cache_finished_req_pages")
        ids, pages = self._request_inputs(input_ids, page_ids)
        handle = cast(_core.RadixCacheHandle, old_handle)  # (the native call checks it)
        in_cache = tree.finish_request_pages(handle, ids, pages, self._pages, priority)
        ps = self.page_size
        held = (length(pages) - old_handle.cached_len // ps) * ps
        self._finished(old_handle, ids, pages, in_cache, held, pages=True)

    @shielded
    def cache_unfinished_req_pages(
        self, old_handle: BaseCacheHandle, input_ids, page_ids, priority: int = 0
    ) -> Tuple[BaseCacheHandle, torch.Tensor]:
        """`cache_unfinished_req` with pages: returns the new handle (locked)
        and the pages the request goes on with."""
        tree = self._page_tree("cache_unfinished_req_pages")
        ids, pages = self._request_inputs(input_ids, page_ids)
        handle, new_pages, in_cache = tree.cache_request_pages(
            cast(_core.RadixCacheHandle, old_handle), ids, pages, self._pages, priority
        )
        held = handle.cached_len - old_handle.cached_len
        self._finished(old_handle, ids, pages, in_cache, held, pages=True)
        return handle, new_pages
