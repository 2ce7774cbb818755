"""Replays requests through a CacheManager the way a serving engine does."""

from __future__ import annotations

import time
from typing import Optional, Sequence

import torch

from radixkv.replay.control import StopOnCtrlC, UntilStopped, progress_bar

# The parts replay() is made of, importable from here as before.
from radixkv.replay.core import (  # noqa: F401
    Instance,
    KVShape,
    ReplayResult,
    StorageConfig,
    StorageUnavailable,
    pages_for_all,
    percentiles,
    too_large,
)
from radixkv.replay.instances import replay_instances
from radixkv.replay.traces import Request, max_hash_id, optimal_hit_tokens


def replay(
    requests: Sequence[Request],
    *,
    block_size: int,
    page_size: int,
    capacity_pages: Optional[int] = None,
    policy: str = "radix",
    kv: Optional[KVShape] = None,
    store: bool = True,
    progress: bool = False,
    host_pages: int = 0,
    write_policy: str = "write_through",
    storage: Optional[StorageConfig] = None,
    instances: int = 1,
    overlap: bool = False,
    eviction_policy: str = "lru",
    eviction_policy_config: Optional[dict] = None,
    retain_ttl_s: Optional[float] = None,
    host_codec: Optional[str] = None,
) -> ReplayResult:
    """Drives `requests` through `instances` serving instances (see radixkv.replay.core.Instance).

    A request larger than the whole pool is skipped and counted. Ctrl-C stops
    the run between requests: the request in flight finishes (with several
    instances, each finishes the requests already sent to it), and the
    result covers the requests finished (`interrupted`). A second Ctrl-C
    stops at once, without a result. With `host_pages` each instance has a host tier of that
    many pages (capped at what the requests can use) under `write_policy`;
    with `storage` they share a storage tier. When storing, K/V rows are
    derived from token and position (KVShape.rows) and every row loaded back
    from host (or storage, through host) is compared with them
    (`kv_mismatches`).

    With one instance the replay runs here. With more, each instance is a
    process of its own; requests go to them in trace order, round robin (by
    session when the trace names sessions), one at a time: each finishes,
    its copies included, before the next starts, so the run is
    deterministic. `overlap` lets instances run concurrently and copies
    overlap the next requests (throughput, at some cost in hits).

    `host_codec` ("float8"; needs `store` and `host_pages`) holds the host
    pages encoded (CacheManager's `host_codec`): rows loaded back are then
    compared within the codec's error, and a storage tier must take the same
    codec (`StorageConfig.codec`).

    `retain_ttl_s` claims each session's conversation after every turn for
    that many seconds of trace time (an agent workload: see Instance). The
    claims' budget is half the pool, less if the largest request would not
    fit beside it, so every request is still admitted.
    """
    # The replay is one thread driving the cache, like a scheduler. torch's
    # intra-op threads would only spin between the small tensor ops here
    # and take the second core from the driver.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if capacity_pages is None:
            capacity_pages = pages_for_all(requests, page_size)
        # A host pool larger than every token of every request is never full:
        # it is allocated at the size that can be used.
        host_pages = min(host_pages, pages_for_all(requests, page_size))
        config = dict(
            block_size=block_size,
            page_size=page_size,
            capacity_pages=capacity_pages,
            policy=policy,
            kv=kv or KVShape(),
            store=store,
            host_pages=host_pages,
            host_codec=host_codec,
            write_policy=write_policy,
            storage=storage,
            max_hash=max_hash_id(requests),
            overlap=overlap,
            eviction_policy=eviction_policy,
            eviction_policy_config=eviction_policy_config,
            retain_ttl_s=retain_ttl_s,
            retain_budget_tokens=retain_budget(requests, page_size, capacity_pages),
        )
        if instances > 1:
            result = replay_instances(requests, config, instances, progress)
        else:
            result = _replay_here(requests, config, progress)
        if page_size == block_size:
            replayed = [r for r in requests if not too_large(r, page_size, capacity_pages)][
                : result.requests
            ]
            result.optimal_hit_tokens = optimal_hit_tokens(replayed, block_size)
        return result
    finally:
        torch.set_num_threads(threads)


def retain_budget(requests: Sequence[Request], page_size: int, capacity_pages: int) -> int:
    """Tokens the claims may hold: half the pool, or less, so that the
    largest request that fits the pool fits beside them."""
    fits = [r for r in requests if not too_large(r, page_size, capacity_pages)]
    largest = max((-(-(r.input_length + r.output_length) // page_size) for r in fits), default=0)
    return max(0, min(capacity_pages // 2, capacity_pages - largest)) * page_size


def _replay_here(requests, config, progress) -> ReplayResult:
    inst = Instance(**config)
    t_start = time.perf_counter()
    try:
        with StopOnCtrlC() as ctrl_c, progress_bar(len(requests), progress) as bar:
            todo = UntilStopped(requests, bar, ctrl_c)
            for _, req in todo:
                inst.serve(req)
            wall = time.perf_counter() - t_start
        result = inst.finish(todo.interrupted)
    except BaseException:  # a second Ctrl-C, a failure: the storage thread stops too
        inst.cm.close(wait=False)
        raise
    result.wall_s = wall
    result.latency_us = {k: percentiles(v) for k, v in inst.lat.items()}
    return result
