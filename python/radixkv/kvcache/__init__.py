"""KV-cache managers (prefix caches) and the paged KV pool."""

from __future__ import annotations

from typing import Optional

import torch

from radixkv.kvcache.base import (
    BaseCacheHandle,
    BaseCacheManager,
    BaseKVCache,
    CopyLayout,
    KVCacheLayout,
    KVCacheType,
    SizeInfo,
)
from radixkv.kvcache.engine_pool import EngineKVPool
from radixkv.kvcache.factory import create_kvcache
from radixkv.kvcache.mha_pool import MHAKVCache, kv_bytes_per_page, num_pages_for_memory
from radixkv.kvcache.mla_pool import MLAKVCache
from radixkv.kvcache.naive_manager import NaiveCacheHandle, NaiveCacheManager
from radixkv.kvcache.radix_manager import (
    EVICTION_POLICIES,
    RadixCacheHandle,
    RadixCacheManager,
    check_eviction_policy,
    tel_safe_tokens,
)

_MANAGERS = {"naive": NaiveCacheManager, "radix": RadixCacheManager}


def create_cache_manager(
    device: torch.device | str,
    type: str,
    page_size: int = 1,
    max_slots: Optional[int] = None,
    eviction_policy: str = "lru",
    eviction_policy_config: Optional[dict] = None,
    aligned_pages: bool = False,
) -> BaseCacheManager:
    """A cache manager of `type` ("naive" or "radix") on `device`; `max_slots`
    bounds the slots it accepts (the pool's size; None: any); the radix cache
    evicts under `eviction_policy` (EVICTION_POLICIES) and, with
    `aligned_pages`, takes only pages aligned in their pool (and page ids)."""
    try:
        cls = _MANAGERS[type]
    except (KeyError, TypeError):
        raise ValueError(f"type must be one of {sorted(_MANAGERS)}, got {type!r}") from None
    if cls is RadixCacheManager:
        return cls(
            device=device,
            page_size=page_size,
            max_slots=max_slots,
            eviction_policy=eviction_policy,
            eviction_policy_config=eviction_policy_config,
            aligned_pages=aligned_pages,
        )
    check_eviction_policy(eviction_policy)
    tel_safe_tokens(eviction_policy, eviction_policy_config)  # checked, unused
    return cls(device=device, page_size=page_size, max_slots=max_slots)


__all__ = [
    "EngineKVPool",
    "BaseCacheHandle",
    "BaseCacheManager",
    "BaseKVCache",
    "CopyLayout",
    "KVCacheLayout",
    "KVCacheType",
    "MHAKVCache",
    "MLAKVCache",
    "NaiveCacheHandle",
    "NaiveCacheManager",
    "RadixCacheHandle",
    "RadixCacheManager",
    "SizeInfo",
    "create_cache_manager",
    "EVICTION_POLICIES",
    "create_kvcache",
    "kv_bytes_per_page",
    "num_pages_for_memory",
]
