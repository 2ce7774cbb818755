"""mini-SGLang's current prefix-cache interface over radixkv's native tree.

mini-SGLang's scheduler calls `create_prefix_cache(device, type)` and then
`match_prefix(ids) -> MatchResult(cuda_handle)`, `handle.get_matched_indices()`,
`lock_handle(handle, unlock)`, `insert_prefix(ids, indices) ->
InsertResult(cached_len, handle)`, `evict(size)`, `size_info`, `reset()`,
`check_integrity()`. These classes keep those names and results, so an engine
swaps its cache by changing an import:

    from radixkv.compat.minisgl import create_prefix_cache

mini-SGLang reads the page size from its global context; here it is an
argument (`page_size`, default 1). `insert_prefix` matches the inserted
prefix again to return its handle: that counts as a match (a hit for the
lfu policy and for write_through_selective). Everything else is radixkv's: exact LRU in
C++, every input checked (a clear exception naming the argument, nothing
changed), `reset()` and `check_integrity()` that do what they say.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from radixkv.kvcache.base import SizeInfo
from radixkv.kvcache.naive_manager import NaiveCacheManager
from radixkv.kvcache.radix_manager import RadixCacheManager

__all__ = [
    "BaseCacheHandle",
    "BasePrefixCache",
    "InsertResult",
    "MatchResult",
    "SizeInfo",
    "RadixPrefixCache",
    "NaivePrefixCache",
    "create_prefix_cache",
]


@dataclass(frozen=True, eq=False)  # compared by identity, like mini-SGLang's nodes
class BaseCacheHandle:
    """A match: `cached_len` tokens, whose slots `get_matched_indices()` gives."""

    cached_len: int
    native: object  # the radixkv handle (what lock_handle takes)
    indices: torch.Tensor  # its slots, int32 on the cache's device

    def get_matched_indices(self) -> torch.Tensor:
        return self.indices


class MatchResult(NamedTuple):
    cuda_handle: BaseCacheHandle


class InsertResult(NamedTuple):
    cached_len: int  # tokens that were cached already (the caller frees its copies)
    handle: BaseCacheHandle  # the inserted prefix (not locked)


class BasePrefixCache:
    """mini-SGLang's prefix cache over a radixkv cache manager."""

    def __init__(self, manager):
        self._m = manager
        self.device = manager.device

    def _handle(self, match) -> BaseCacheHandle:
        native, indices = match
        return BaseCacheHandle(native.cached_len, native, indices)

    def lock_handle(self, handle: BaseCacheHandle, unlock: bool = False) -> None:
        if not isinstance(handle, BaseCacheHandle):
            raise TypeError(
                f"handle must come from match_prefix or insert_prefix, got "
                f"{type(handle).__name__}"
            )
        self._m.lock_handle(handle.native, unlock)

    def match_prefix(self, input_ids) -> MatchResult:
        return MatchResult(self._handle(self._m.match_prefix(input_ids)))

    def insert_prefix(self, input_ids, indices) -> InsertResult:
        cached = self._m.insert_prefix(input_ids, indices)
        whole = len(input_ids) - len(input_ids) % self._m.page_size
        return InsertResult(cached, self._handle(self._m.match_prefix(input_ids[:whole])))

    def evict(self, size: int) -> torch.Tensor:
        return self._m.evict(size)

    def reset(self) -> None:
        self._m.reset()

    @property
    def size_info(self) -> SizeInfo:
        return self._m.size_info

    def check_integrity(self) -> None:
        self._m.check_integrity()


class RadixPrefixCache(BasePrefixCache):
    def __init__(
        self,
        device: torch.device | str = "cpu",
        page_size: int = 1,
        max_slots: Optional[int] = None,
    ):
        super().__init__(RadixCacheManager(device, page_size, max_slots=max_slots))


class NaivePrefixCache(BasePrefixCache):
    def __init__(self, device: torch.device | str = "cpu", page_size: int = 1):
        super().__init__(NaiveCacheManager(device, page_size))

    def insert_prefix(self, input_ids, indices) -> InsertResult:
        self._m.insert_prefix(input_ids, indices)
        return InsertResult(0, self._handle(self._m.match_prefix(input_ids[:0])))


_TYPES = {"radix": RadixPrefixCache, "naive": NaivePrefixCache}


def create_prefix_cache(
    device: torch.device | str, type: str, page_size: int = 1, **kwargs
) -> BasePrefixCache:
    """mini-SGLang's factory: `type` is "radix" or "naive"."""
    if type not in _TYPES:
        raise ValueError(f"type must be one of {', '.join(_TYPES)}, got {type!r}")
    return _TYPES[type](device, page_size, **kwargs)
