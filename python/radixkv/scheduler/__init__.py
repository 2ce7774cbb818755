"""Scheduler-side memory management: pages for requests, prefix caching."""

from radixkv.scheduler.cache import CacheManager
from radixkv.scheduler.metrics import CacheMetrics
from radixkv.scheduler.req_to_token import ReqToTokenPool
from radixkv.scheduler.retention import RetainBudgetError, RetentionClaim
from radixkv.scheduler.storage_tier import StorageFaultPolicy

__all__ = [
    "CacheManager",
    "CacheMetrics",
    "ReqToTokenPool",
    "RetainBudgetError",
    "RetentionClaim",
    "StorageFaultPolicy",
]
