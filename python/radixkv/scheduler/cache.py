"""The scheduler-side cache manager: free pages, the prefix cache and requests."""

from __future__ import annotations

from typing import Tuple

import torch

from radixkv import _core
from radixkv._checks import as_count, as_int, int32_tensor, to_host
from radixkv.kvcache import BaseCacheHandle, RadixCacheManager, create_cache_manager


class CacheManager:
    """Hands KV pages to requests and caches their prefixes when they finish.

    Owns a pool of `num_pages` pages of `page_size` token slots (slot `s`
    lives in page `s // page_size`) and a prefix cache of `type` ("radix" or
    "naive"). A page is at any time in exactly one of three places: free,
    cached (stored in the prefix cache), or held by a request between
    `allocate` and its return through `free`, `free_and_cache_finished_req`
    or `cache_unfinished_req`. Requests are the caller's: the manager keeps
    no request objects, only the count of pages they hold.

    A request's indices cover its tokens in order: the first
    `handle.cached_len` are the cache's slots (from `match_req`), the rest
    the request's own, in whole pages (`allocate` rounds up to whole pages, so
    the last page may have room for the tokens that follow).
    """

    def __init__(self, num_pages: int, page_size: int = 1, type: str = "radix",
                 device: torch.device | str = "cpu"):
        num_pages = as_count(num_pages, "num_pages", minimum=0)
        page_size = as_count(page_size, "page_size")
        self._pages = _core.PageAllocator(num_pages, page_size)
        self.manager = create_cache_manager(device, type, page_size,
                                            max_slots=num_pages * page_size)
        self.device = torch.device(device)
        self.page_size = page_size
        self.num_pages = num_pages
        # Pages held by requests: allocated, not yet freed or cached.
        self._held_pages = 0
        self._tree = self.manager._tree if isinstance(self.manager, RadixCacheManager) else None

    # -- matching and locking -------------------------------------------------

    def match_req(self, input_ids) -> Tuple[BaseCacheHandle, torch.Tensor]:
        """Match `input_ids[:-1]`: the last token is always computed."""
        ids = int32_tensor(input_ids, "input_ids", self.device)
        if len(ids) == 0:
            raise ValueError("input_ids must hold at least one token")
        return self.manager.match_prefix(ids[:-1])

    def lock(self, handle: BaseCacheHandle) -> None:
        self.manager.lock_handle(handle, unlock=False)

    def unlock(self, handle: BaseCacheHandle) -> None:
        self.manager.lock_handle(handle, unlock=True)

    # -- pages ------------------------------------------------------------------

    @property
    def free_pages(self) -> int:
        """Pages neither cached nor held by a request."""
        return self._pages.num_free_pages

    @property
    def available_size(self) -> int:
        """Tokens that `allocate` can serve: free plus evictable."""
        return self._pages.num_free_pages * self.page_size + self.manager.size_info.evictable_size

    def make_room(self, num_tokens: int) -> int:
        """Evict just enough that `allocate(num_tokens)` needs no eviction.

        Returns the tokens evicted (whole cache nodes, so possibly more than
        missing). Raises `radixkv.OutOfCapacityError`, changing nothing, when
        even evicting every unlocked cached page would not make room.
        """
        n = as_int(num_tokens, "num_tokens")
        if n < 0:
            raise ValueError(f"num_tokens must be >= 0, got {n}")
        pages = -(-n // self.page_size)
        missing = pages - self._pages.num_free_pages
        if missing <= 0:
            return 0
        evictable = self.manager.size_info.evictable_size
        if missing * self.page_size > evictable:
            raise _core.OutOfCapacityError(
                f"cannot allocate num_tokens={n} ({pages} pages): "
                f"{self._pages.num_free_pages} pages are free and "
                f"{evictable // self.page_size} evictable"
            )
        evicted = self.manager.evict(missing * self.page_size).cpu()
        self._pages.free(evicted)
        return len(evicted)

    def allocate(self, num_tokens: int) -> torch.Tensor:
        """Slots of ceil(num_tokens / page_size) pages, evicting only what is missing.

        Raises `radixkv.OutOfCapacityError`, changing nothing, when even
        evicting every unlocked cached page would not make room.
        """
        self.make_room(num_tokens)
        slots = self._pages.allocate(num_tokens)
        self._held_pages += len(slots) // self.page_size
        return slots if self.device.type == "cpu" else slots.to(self.device, non_blocking=True)

    def free(self, indices) -> None:
        """Return pages a request holds (whole pages, not cached ones)."""
        indices = to_host(indices, "indices", self.device)
        self._pages.free(indices, self._tree)
        self._held_pages -= len(indices) // self.page_size

    # -- finishing requests -----------------------------------------------------

    def _check_request(self, old_handle, input_ids, indices):
        """Checks everything before anything changes.

        Returns (input_ids, indices, n, cached_len) with both sequences as
        CPU int32 tensors.
        """
        ids = int32_tensor(input_ids, "input_ids", self.device)
        idx = int32_tensor(indices, "indices", self.device)
        n, m = len(ids), len(idx)
        whole = -(-n // self.page_size) * self.page_size
        if m != whole:
            raise ValueError(
                f"indices has length {m} but must cover input_ids (length {n}) in whole pages "
                f"of {self.page_size}: expected {whole}"
            )
        if not isinstance(old_handle, BaseCacheHandle):
            raise TypeError(f"old_handle must be a cache handle, got {type(old_handle).__name__}")
        if not self.manager.is_valid(old_handle):
            raise ValueError("old_handle is stale or belongs to another cache manager")
        if getattr(old_handle, "lock_count", 0) < 1:
            raise ValueError("old_handle is not locked: lock it after match_req")
        cached = old_handle.cached_len
        if cached > n:
            raise ValueError(f"old_handle covers {cached} tokens but input_ids has only {n}")
        if cached and not torch.equal(idx[:cached], self._tree.handle_slots(old_handle)):
            # Anything else there would be stored (or freed) as if it were the
            # cache's: a page could end up both free and cached.
            raise ValueError(f"indices[:{cached}] must be the cache's slots that match_req "
                             "returned with old_handle")
        self._pages.check_owned(idx[cached:], "indices", self._tree)
        return ids, idx, n, cached

    def free_and_cache_finished_req(self, old_handle: BaseCacheHandle, input_ids, indices) -> None:
        """Cache a finished request's tokens and return every page it held.

        Its whole pages not cached yet join the prefix cache; its copies of
        tokens someone else cached meanwhile, and its partial last page, are
        freed; then its lock is released.
        """
        input_ids, indices, n, cached = self._check_request(old_handle, input_ids, indices)
        full = n - n % self.page_size
        in_cache = self.manager.insert_prefix(input_ids, indices[:n])
        self._pages.free(indices[cached:in_cache])
        self._pages.free(indices[full:])
        self._held_pages -= (len(indices) - cached) // self.page_size
        self.unlock(old_handle)

    def cache_unfinished_req(
        self, old_handle: BaseCacheHandle, input_ids, indices
    ) -> Tuple[BaseCacheHandle, torch.Tensor]:
        """Cache what a running request has computed (chunked prefill).

        Returns the new handle, already locked (the old one is unlocked), and
        the indices the request goes on with: the cache's slots for its cached
        part, then its own slots. Its copies of tokens that were cached
        meanwhile are freed, so it never keeps a slot that was just freed.
        """
        input_ids, indices, n, cached = self._check_request(old_handle, input_ids, indices)
        in_cache = self.manager.insert_prefix(input_ids, indices[:n])
        new_handle, tree_indices = self.manager.match_prefix(input_ids)
        now_cached = new_handle.cached_len
        self._pages.free(indices[cached:min(in_cache, now_cached)])
        self.lock(new_handle)
        self.unlock(old_handle)
        self._held_pages -= (now_cached - cached) // self.page_size
        new_indices = torch.cat([tree_indices.cpu(), indices[now_cached:]])
        return new_handle, new_indices.to(self.device, non_blocking=True)

    # -- checks -----------------------------------------------------------------

    def check_integrity(self) -> None:
        """Free + cached + held pages == all pages, and no page both free and cached.

        Valid at any time, with requests in flight. Raises
        `radixkv.IntegrityError` on a violation.
        """
        self.manager.check_integrity()
        cached_tokens = self.manager.size_info.total_size
        if cached_tokens % self.page_size:
            raise _core.IntegrityError(f"{cached_tokens} cached tokens are not whole pages")
        free = self._pages.num_free_pages
        cached = cached_tokens // self.page_size
        if free + cached + self._held_pages != self.num_pages:
            raise _core.IntegrityError(
                f"pages leaked or owned twice: {free} free + {cached} cached + "
                f"{self._held_pages} held by requests != {self.num_pages}"
            )
        self._pages.check_disjoint(self._tree)

    @property
    def held_pages(self) -> int:
        """Pages handed to requests and not yet returned or cached."""
        return self._held_pages
