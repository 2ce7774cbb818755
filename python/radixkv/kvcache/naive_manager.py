"""A cache that caches nothing: every request computes its whole prompt."""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from radixkv import _core
from radixkv._checks import as_count, as_device, as_int, as_max_slots, int32_tensor, to_host
from radixkv.kvcache.base import BaseCacheHandle, BaseCacheManager, SizeInfo, released_slots
from radixkv.kvcache.request_inputs import check_batch, check_request, join_parts, split_flat


class NaiveCacheHandle(BaseCacheHandle):
    """Always an empty match; counts its locks so an unmatched unlock raises."""

    __slots__ = ("_owner", "lock_count")

    def __init__(self, owner: "NaiveCacheManager"):
        self._owner = owner
        self.lock_count = 0

    @property
    def cached_len(self) -> int:
        return 0

    def __repr__(self) -> str:
        return f"NaiveCacheHandle(cached_len=0, lock_count={self.lock_count})"


def _check_namespace(namespace) -> None:
    if as_int(namespace, "namespace") < 0:
        raise ValueError(f"namespace must be >= 0, got {namespace}")


class NaiveCacheManager(BaseCacheManager[NaiveCacheHandle]):
    """The baseline: never matches, stores nothing, has nothing to evict."""

    def __init__(
        self,
        device: torch.device | str = "cpu",
        page_size: int = 1,
        max_slots: Optional[int] = None,
    ):
        page_size = as_count(page_size, "page_size")
        self.device = as_device(device)
        self.page_size = page_size
        self._max_slots = as_max_slots(max_slots)

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int32, device=self.device)

    def match_prefix(
        self, input_ids, namespace: int = 0, skip_last: bool = False
    ) -> Tuple[NaiveCacheHandle, torch.Tensor]:
        _check_namespace(namespace)  # checked as the radix cache does; nothing is shared anyway
        n = _core.check_ids(to_host(input_ids, "input_ids", self.device), "input_ids")
        if skip_last and n == 0:
            raise ValueError("input_ids must hold at least one token")
        return NaiveCacheHandle(self), self._empty()

    def lock_handle(self, handle: NaiveCacheHandle, unlock: bool = False) -> None:
        if not isinstance(handle, NaiveCacheHandle):
            raise TypeError(
                f"handle must be a NaiveCacheHandle from match_prefix, got {type(handle).__name__}"
            )
        if handle._owner is not self:
            raise ValueError("handle belongs to another cache manager")
        if unlock:
            if handle.lock_count == 0:
                raise ValueError("handle is not locked: unlock without a matching lock")
            handle.lock_count -= 1
        else:
            handle.lock_count += 1

    def insert_prefix(self, input_ids, indices, priority: int = 0, namespace: int = 0) -> int:
        _check_namespace(namespace)
        n = _core.check_ids(to_host(input_ids, "input_ids", self.device), "input_ids")
        m = _core.check_slots(to_host(indices, "indices", self.device), "indices", self._max_slots)
        if n != m:
            raise ValueError(f"indices has length {m} but input_ids has length {n}")
        # Nothing is stored: report the whole pages as "cached already", so the
        # caller frees its copies of them, as it frees a partial last page.
        return n - n % self.page_size

    def evict(self, size: int) -> torch.Tensor:
        size = as_int(size, "size")
        if size < 0:
            raise ValueError(f"size must be >= 0, got {size}")
        if size > 0:
            raise _core.OutOfCapacityError(
                f"cannot evict size={size} tokens: evictable_size is 0 (NaiveCacheManager "
                "caches nothing)"
            )
        return self._empty()

    @property
    def max_slots(self) -> Optional[int]:
        """Slots must be below this (None: any int32 slot >= 0)."""
        return None if self._max_slots < 0 else self._max_slots

    def is_valid(self, handle) -> bool:
        return isinstance(handle, NaiveCacheHandle) and handle._owner is self

    def reset(self) -> None:
        pass

    @property
    def size_info(self) -> SizeInfo:
        return SizeInfo(0, 0)

    def check_integrity(self) -> None:
        pass

    def handle_slots(self, handle: NaiveCacheHandle) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int32)

    # -- a request's steps (BaseCacheManager's): checked in Python, nothing cached ----

    def finish_request(
        self, old_handle: NaiveCacheHandle, input_ids, indices, pages, priority: int = 0
    ) -> int:
        ids, idx, n, cached = check_request(self, old_handle, input_ids, indices, pages)
        in_cache = self.insert_prefix(ids, idx[:n], priority)
        for slots in released_slots(idx, cached, in_cache, n, self.page_size, True):
            pages.free(slots)
        self.lock_handle(old_handle, unlock=True)
        return in_cache

    def finish_requests(self, batch, pages, priority=0) -> List[int]:
        return self._finish_batch(batch, pages, priority, "batch")

    def finish_requests_flat(
        self, handles, input_ids, indices, pages, priority=0, own=None
    ) -> List[int]:
        ids = [int32_tensor(x, f"input_ids[{i}]", self.device) for i, x in enumerate(input_ids)]
        if own is not None:
            indices = join_parts(handles, ids, indices, own, self.page_size, self.device)
        batch = split_flat(ids, indices, handles, self.page_size, self.device)
        return self._finish_batch(batch, pages, priority, "request")

    def _finish_batch(self, batch, pages, priority, what: str) -> List[int]:
        priorities = check_batch(self, batch, priority, pages, what)
        return [
            self.finish_request(handle, ids, idx, pages, p)
            for (handle, ids, idx), p in zip(batch, priorities)
        ]

    def cache_request(
        self, old_handle: NaiveCacheHandle, input_ids, indices, pages, priority: int = 0
    ) -> Tuple[NaiveCacheHandle, torch.Tensor, int]:
        ids, idx, n, _ = check_request(self, old_handle, input_ids, indices, pages)
        in_cache = self.insert_prefix(ids, idx[:n], priority)
        handle = NaiveCacheHandle(self)  # an empty match: the request keeps all its pages
        self.lock_handle(handle)
        self.lock_handle(old_handle, unlock=True)
        return handle, idx, in_cache
