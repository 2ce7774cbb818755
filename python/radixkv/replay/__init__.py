"""Trace replay: drives real or generated traffic through the cache and reports what it achieved."""

from radixkv.replay.core import KVShape, ReplayResult, pages_for_all
from radixkv.replay.replay import replay
from radixkv.replay.traces import Request, TokenMaker, load_mooncake, optimal_hit_tokens
from radixkv.replay.workloads import chat_sessions

__all__ = [
    "KVShape",
    "ReplayResult",
    "Request",
    "TokenMaker",
    "chat_sessions",
    "load_mooncake",
    "optimal_hit_tokens",
    "pages_for_all",
    "replay",
]
