"""A cache that caches nothing: every request computes its whole prompt."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from radixkv import _core
from radixkv._checks import as_count, as_device, as_int, as_max_slots, to_host
from radixkv.kvcache.base import BaseCacheHandle, BaseCacheManager, SizeInfo


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

    def match_prefix(self, input_ids, namespace: int = 0) -> Tuple[NaiveCacheHandle, torch.Tensor]:
        _check_namespace(namespace)  # checked as the radix cache does; nothing is shared anyway
        _core.check_ids(to_host(input_ids, "input_ids", self.device), "input_ids")
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
