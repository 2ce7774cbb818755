"""The page path of a CacheManager: its request steps with page ids crossing
instead of token slots.

Page p of the device pool holds slots p * page_size + [0, page_size) (pages
are aligned in their pool: a CacheManager's tree is made with
`aligned_pages`), so a request's pages name its slots: each call here is
its slot form's (`match_req`, `load_back`, `allocate`, `free`,
`free_and_cache_finished_req`, `free_and_cache_finished_reqs`,
`free_and_cache_finished_reqs_flat`, `cache_unfinished_req`), with page_size
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
from radixkv.kvcache.page_ids import slots_of_pages
from radixkv.kvcache.request_inputs import host_batch, host_flat, length
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
            announced: bool = False,
        ) -> None: ...
        def _flat_finished(
            self, handles, input_ids, indices, own, in_cache, pages: bool = False
        ) -> None: ...
        def _load_back(self, handle: BaseCacheHandle): ...
        def _announce_args(
            self, handle
        ) -> Optional[Tuple[Optional[_core.BlockLedger], Optional[bytes]]]: ...

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
        loaded, pages, _ = self._load_back(handle)  # (the radix cache: pages)
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
        announce = self._announce_args(handle) or (None, None)  # (the call's own BlockStored)
        in_cache = tree.finish_request_pages(handle, ids, pages, self._pages, priority, *announce)
        self._finished(old_handle, ids, pages, in_cache, pages=True, announced=True)

    @shielded
    def free_and_cache_finished_reqs_pages(self, batch, priority=0) -> None:
        """`free_and_cache_finished_reqs` with each request's pages: `batch`
        holds (old_handle, input_ids, page_ids), its page_ids as
        `free_and_cache_finished_req_pages` takes them. Checked first, and
        together (no page held by two requests, no handle finished more
        often than it is locked): a bad one raises, naming `batch[i]
        page_ids`, and changes nothing. `priority` is one int for the whole
        batch, or a list or tuple of one per request."""
        tree = self._page_tree("free_and_cache_finished_reqs_pages")
        host = host_batch(batch, self.device, "page_ids")
        if self._tiers.loads_in_flight():
            self._tiers.settle_loads()
        in_cache = tree.finish_requests_pages(host, self._pages, priority)
        for (handle, ids, pages), k in zip(host, in_cache):
            self._finished(handle, ids, pages, k, pages=True)

    @shielded
    def free_and_cache_finished_reqs_flat_pages(
        self, handles, input_ids, page_ids, priority=0, *, own=None
    ) -> None:
        """`free_and_cache_finished_reqs_flat` with page ids: request i's
        are the next ceil(len(input_ids[i]) / page_size) ids of `page_ids`
        (its match's, then its own; `page_ids` must hold exactly all of
        them), as a scheduler gathers them from its block table. With `own`,
        `page_ids` holds only each request's cached part
        (`handles[i].cached_len // page_size` ids, as `match_pages` returns
        them) and `own` the rest (its own pages, as `allocate_pages` returns
        them). Checked as the batch call is (errors name request i as
        `request[i]`, its pages by their position among its own, and the
        tensors as `page_ids` and `own`); raises, changing nothing."""
        tree = self._page_tree("free_and_cache_finished_reqs_flat_pages")
        input_ids, pages, own = host_flat(
            handles, input_ids, page_ids, own, self.device, "page_ids"
        )
        if self._tiers.loads_in_flight():
            self._tiers.settle_loads()
        in_cache = tree.finish_requests_flat_pages(  # (reads and checks every input)
            handles, input_ids, pages, self._pages, priority, own
        )
        self._flat_finished(handles, input_ids, pages, own, in_cache, pages=True)

    @shielded
    def cache_unfinished_req_pages(
        self, old_handle: BaseCacheHandle, input_ids, page_ids, priority: int = 0
    ) -> Tuple[BaseCacheHandle, torch.Tensor]:
        """`cache_unfinished_req` with pages: returns the new handle (locked)
        and the pages the request goes on with."""
        tree = self._page_tree("cache_unfinished_req_pages")
        ids, pages = self._request_inputs(input_ids, page_ids)
        announce = self._announce_args(old_handle) or (None, None)  # (the call's own BlockStored)
        handle, new_pages, in_cache = tree.cache_request_pages(
            cast(_core.RadixCacheHandle, old_handle), ids, pages, self._pages, priority, *announce
        )
        held = handle.cached_len - old_handle.cached_len
        self._finished(old_handle, ids, pages, in_cache, held, pages=True, announced=True)
        return handle, new_pages
