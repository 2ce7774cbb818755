"""radixkv as SGLang's radix cache: `--radix-cache-backend radixkv`.

`pip install 'radixkv[sglang]'` registers `register()` in SGLang's plug-in
group (`sglang.srt.plugins`); SGLang runs it in each of its processes, and
`--radix-cache-backend radixkv` then builds the scheduler's prefix cache with
`build(ctx)`: radixkv's native tree, driven by SGLang 0.5.23's scheduler as
it drives its own RadixCache (match, lock, checkpoint a running request,
release a request's KV through SGLang's own `release_kv_cache`, evict).

What it serves: full-attention models (every layer keeps all tokens' K/V),
page size 1 or more, `extra_key` / `cache_salt` namespaces, priorities, every
eviction policy radixkv has (`--radix-eviction-policy lru|lfu|fifo|mru|
priority`), KV events (`--kv-events-config`: one BlockStored per page, as
SGLang publishes them). With `--enable-hierarchical-cache` it builds
radixkv's whole cache instead (`radixkv.compat.sglang.hierarchical`: the
host tier, the store, radixkv's config). What it refuses, by name, at
start-up: sliding-window and mamba hybrids, DSA models, speculative decoding's
bigram keys, tensor-, pipeline- or context-parallel ranks with the host tier,
and options that call SGLang's own trees (LMCache, FlexKV, the external
linker, PD decode's host-pool retraction).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import torch

from radixkv.compat.sglang.radix_cache import RadixCache

NAME = "radixkv"

if TYPE_CHECKING:
    # A node of dfs_weight_order's tree of matched paths: its children by
    # page (the page's slots), its own request indices, its weight (in a list).
    _Node = Tuple[Dict[Tuple[int, ...], "_Node"], List[int], List[int]]


def register() -> None:
    """SGLang's plug-in entry point: registers the `radixkv` backend."""
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend

    if get_radix_cache_factory(NAME) is None:
        register_radix_cache_backend(NAME, build)


def _refuse(ctx) -> None:
    why = []
    if ctx.is_hybrid_swa:
        why.append("sliding-window hybrid models (is_hybrid_swa)")
    if ctx.is_hybrid_ssm:
        why.append("mamba hybrid models (is_hybrid_ssm)")
    if getattr(ctx, "is_dsa", False):
        why.append("DSA models (is_dsa)")
    if ctx.enable_hierarchical_cache:
        why += _refused_with_host_tier(ctx)
    if getattr(ctx.params, "is_eagle", False):
        why.append("speculative decoding's bigram keys (is_eagle)")
    why += _refused_options(getattr(ctx, "server_args", None))
    if why:
        raise ValueError(
            f"--radix-cache-backend {NAME} serves full-attention models with "
            "SGLang's device pool only; it does not support " + "; ".join(why)
        )


def _refused_options(args) -> List[str]:
    """SGLang options (of its ServerArgs) that need calls of its own trees:
    LMCache's and FlexKV's prefetches, the external linker, PD decode's
    host-pool retraction backups."""
    why = [
        flag
        for flag, attr in (
            ("--enable-lmcache", "enable_lmcache"),
            ("--enable-flexkv", "enable_flexkv"),
            ("--enable-unified-cache-external-linker", "enable_unified_cache_external_linker"),
        )
        if getattr(args, attr, False)
    ]
    if getattr(args, "disaggregation_decode_retraction_backup", None) == "host_pool":
        why.append("--disaggregation-decode-retraction-backup host_pool")
    return why


def _refused_with_host_tier(ctx) -> List[str]:
    """What radixkv's host tier cannot serve under SGLang: ranks whose trees
    SGLang's HiCache would keep in step."""
    params = ctx.params
    why = []
    for name, size in (
        ("--tp-size", getattr(ctx, "tp_size", 1)),
        ("--pp-size", getattr(params, "pp_size", 1)),
        ("context parallelism (attn_cp_size)", getattr(params, "attn_cp_size", 1)),
    ):
        if (size or 1) > 1:
            why.append(
                f"{name} {size} with --enable-hierarchical-cache (each rank's host tier "
                "would take its copies' acknowledgements at its own pace)"
            )
    return why


def build(ctx) -> Any:
    """The factory SGLang calls with its TreeCacheBuildContext."""
    _refuse(ctx)
    if ctx.disable_radix_cache:
        from sglang.srt.mem_cache.registry import default_radix_cache_factory

        return default_radix_cache_factory(ctx)  # SGLang's own cache-less path
    if ctx.enable_hierarchical_cache:
        return _build_hierarchical(ctx)
    return _cache_class()(ctx.params)


def _build_hierarchical(ctx) -> Any:
    """radixkv's CacheManager with its host tier (and storage) over SGLang's
    device pool, under SGLang's HiCache flags and radixkv's config."""
    from radixkv.compat.sglang import config

    knobs, events = config.sglang_knobs()
    settings = config.settings(knobs, config.load_config())
    if settings.kv_events is not None:
        # radixkv publishes on SGLang's endpoint (with epochs and a replay
        # socket); SGLang's own publisher must not bind it too.
        from sglang.srt.runtime_context import get_context

        get_context().override("radixkv", kv_events_config=None)
    model = getattr(getattr(ctx, "model_config", None), "model_path", "") or ""
    cls = _hierarchical_class()
    return cls(ctx.params, settings, model=model, tp_rank=ctx.tp_rank, tp_worker=ctx.tp_worker)


_CLASS = None
_HCLASS = None


def _hierarchical_class():
    """SGLang's BasePrefixCache with radixkv's hierarchical cache inside."""
    global _HCLASS
    if _HCLASS is None:
        from sglang.srt.mem_cache import base_prefix_cache as base

        from radixkv.compat.sglang.hierarchical import HierarchicalCache

        _HCLASS = type(
            "RadixkvHierarchicalCache",
            (HierarchicalCache, base.BasePrefixCache),
            {"_base": base, "__module__": __name__},
        )
    return _HCLASS


def _cache_class():
    """SGLang's BasePrefixCache with radixkv's tree inside (made once: SGLang
    is imported only when its scheduler asks)."""
    global _CLASS
    if _CLASS is None:
        from sglang.srt.mem_cache import base_prefix_cache as base

        _CLASS = type(
            "RadixkvPrefixCache",
            (_PrefixCache, base.BasePrefixCache),
            {"_base": base, "__module__": __name__},
        )
    return _CLASS


class _PrefixCache(RadixCache):
    """radixkv's RadixCache with SGLang 0.5.23's request flow and result
    types (`_base` is SGLang's base_prefix_cache module)."""

    _base: Any

    if TYPE_CHECKING:
        # SGLang's BasePrefixCache's, which _cache_class() puts after this class.
        def init_metrics_collector(self) -> None: ...
        def update_eviction_metrics(self, num_evicted: int, start_time: float) -> None: ...
        def lock(self, node: Any) -> Any: ...
        def unlock(self, lock: Any) -> None: ...

    def __init__(self, params) -> None:
        super().__init__(params)
        self.kv_events = None  # radixkv records its own (take_events)
        self.sliding_window_size = None
        if getattr(params, "enable_metrics", False):
            self.init_metrics_collector()

    def reset(self) -> None:
        super().reset()
        self._empty_result = self._base.MatchResult(
            device_prefix_len=0,
            last_device_node=self.root_node,
            last_host_node=self.root_node,
            best_match_node=self.root_node,
        )

    # -- the tree ------------------------------------------------------------------------

    def match_prefix(self, params):
        key = getattr(params, "key", params)
        if self.disable or len(key) == 0:
            return self._empty_result
        ids, ns = self._key(key)
        handle, indices = self._match(ids, ns)
        n = len(indices)
        return self._base.MatchResult(
            device_prefix_len=n,
            last_device_node=handle,
            last_host_node=handle,
            best_match_node=handle,
        )

    def touch_prefix(self, key) -> None:
        if not self.disable and len(key):
            self._match(*self._key(key))

    def insert(self, params, value=None, chunked: bool = False, priority: int = 0):
        result = super().insert(params, value, chunked, priority)
        if hasattr(params, "key"):
            return self._base.InsertResult(prefix_len=result.prefix_len)
        return result

    def evict(self, params):
        start = time.perf_counter()
        result = super().evict(params)
        self.update_eviction_metrics(result.num_tokens_evicted, start)
        return self._base.EvictResult(num_tokens_evicted=result.num_tokens_evicted)

    def _free(self, indices: torch.Tensor, start_pos: Optional[int] = None) -> None:
        if len(indices) == 0:
            return
        allocator = self.token_to_kv_pool_allocator
        if start_pos is not None and hasattr(allocator, "free_segment"):
            allocator.free_segment(indices, start_pos=start_pos)
        else:
            allocator.free(indices)

    def inc_lock_ref(self, node):
        return self._base.IncLockRefResult(delta=int(super().inc_lock_ref(node)))

    def dec_lock_ref(self, node, params=None):
        return self._base.DecLockRefResult(delta=int(super().dec_lock_ref(node)))

    def dfs_weight_order(self, node_handles) -> List[int]:
        """Request indices in SGLang's depth-first order of their matched
        paths: children before the node's own requests, heavier subtrees
        (more requests under them) first, ties in the order first seen.
        Iterative (paths of any length), reading the tree's host copy of
        each path's slots (no device sync)."""
        ps = self.page_size
        root: _Node = ({}, [], [0])  # children by page, own request indices, weight
        for i, handle in enumerate(node_handles):
            node = root
            if handle is not None and not self.disable:
                slots = self._tree.handle_slots(handle).tolist()
                for at in range(0, len(slots), ps):
                    page = tuple(slots[at : at + ps])
                    child = node[0].get(page)
                    if child is None:
                        child = node[0][page] = ({}, [], [0])
                    node = child
            node[1].append(i)
        post: List[_Node] = []
        stack = [root]
        while stack:  # every node after its parent; reversed, children first
            node = stack.pop()
            post.append(node)
            stack.extend(node[0].values())
        for node in reversed(post):
            node[2][0] = len(node[1]) + sum(c[2][0] for c in node[0].values())
        order: List[int] = []
        todo = [(root, False)]
        while todo:
            node, visited = todo.pop()
            if visited:
                order.extend(node[1])
                continue
            todo.append((node, True))
            children = sorted(node[0].values(), key=lambda c: -c[2][0])
            todo.extend((c, False) for c in reversed(children))
        return order

    # -- a request's KV --------------------------------------------------------------------

    def checkpoint(self, req, *, up_to: int, **kwargs) -> None:
        """The request's KV up to row position `up_to` joins the tree (whole
        pages); its row is pointed at the tree's copy, its lock moves to the
        node the insert ended on and `cache_protected_len` covers it. The
        slots of pages another request cached meanwhile go back now; the
        rest of the row is `release_kv_cache`'s to free."""
        if self.disable:
            return
        kv = req.kv
        token_ids = req.full_untruncated_fill_ids[:up_to]
        aligned = len(token_ids) // self.page_size * self.page_size
        ids = token_ids[:aligned]
        ns = self._req_namespace(req)
        row = self.req_to_token_pool.req_to_token[kv.req_pool_idx, :aligned]
        values = row.to(dtype=torch.int64, copy=True)
        prefix = self._insert_req(req, ids, values, ns)
        kv.cache_inserted_len = max(kv.cache_inserted_len, aligned)
        protected = kv.cache_protected_len
        if prefix > protected:  # duplicates of what another request cached meanwhile
            self._free(row[protected:prefix], start_pos=protected)
        handle, tree_slots = self._match(ids, ns)
        new_indices = self._device_indices(tree_slots)
        n = len(new_indices)
        if n != aligned:
            raise RuntimeError(
                f"radixkv: request {req.rid} inserted {aligned} tokens but the "
                f"tree holds {n} of them"
            )
        if n > protected:
            self.req_to_token_pool.write(
                (kv.req_pool_idx, slice(protected, n)), new_indices[protected:]
            )
        kv.cache_protected_len = n
        self.unlock(req.lock)
        req.lock = self.lock(handle)
        req.last_node = handle

    def sanity_check(self) -> None:
        self.check_integrity()
