"""radixkv inside SGLang.

- `radix_cache`: SGLang 0.5.x's `RadixCache` interface over radixkv's native
  tree (`from radixkv.compat.sglang import RadixCache`, re-exported here).
- `plugin`: `--radix-cache-backend radixkv`, SGLang's plug-in entry point
  (`radixkv.compat.sglang.plugin:register`).
- `hicache_storage`: radixkv's storage tier as HiCache's L3 under SGLang's
  own tree (`--hicache-storage-backend dynamic`).
"""

from radixkv.compat.sglang.radix_cache import (
    HAS_NAMESPACES,
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
    RadixCache,
    RadixKey,
)

__all__ = [
    "DecLockRefResult",
    "EvictParams",
    "EvictResult",
    "IncLockRefResult",
    "InsertParams",
    "InsertResult",
    "MatchPrefixParams",
    "MatchResult",
    "RadixCache",
    "RadixKey",
    "HAS_NAMESPACES",
]
