"""radixkv's whole cache inside SGLang: `--radix-cache-backend radixkv
--enable-hierarchical-cache`.

SGLang's scheduler drives this cache as it drives its own HiCache: it
matches (a device part and a host part), loads a request's host part back
(`init_load_back`, then `ready_to_load_host_cache` once per batch, the
forward pass waiting layer by layer), drains the copies' acknowledgements
each round (`check_hicache_events`), checkpoints running requests' KV into
the tree, evicts when its allocator runs short, and with a storage backend
prefetches from L3 (`prefetch_from_storage`, `check_prefetch_progress`).
Behind these calls is one radixkv CacheManager: its radix tree over the
device and host tiers, its host pool (`HostKVCache`) copying pages straight
to and from SGLang's own per-layer K/V tensors (`EngineKVPool`), its copy
thread, its storage tier, quotas, retention and KV events.

Device slots: SGLang's token allocator hands them to requests and gets them
back; the CacheManager owns those the tree caches or loads into. Both count
every page: the manager's page allocator holds, as if handed to a request,
every page SGLang's allocator owns (free or a request's), and pages the tree
gives up are handed to SGLang's allocator at once (`_give_back`); a load
takes free pages from SGLang's allocator first (`_take`), evicting from the
tree only when SGLang has none. So SGLang's idle check (free + evictable +
protected = the pool) holds at every step.

What it refuses, by name, at start-up: more than one tensor-, pipeline- or
context-parallel rank (the ranks' trees would drift apart without the
synchronization SGLang's HiCache does), models other than plain MHA with a
float K/V cache, and the HiCache options config.py lists. Run-time attaching
or detaching of a storage backend is refused (start the server with it).
"""

from __future__ import annotations

import logging
import time
from array import array
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from radixkv import _core
from radixkv.compat.sglang.config import Settings, namespace_name
from radixkv.compat.sglang.radix_cache import _priority
from radixkv.storage.staged import open_backend, storage_options
from radixkv.kvcache import EngineKVPool
from radixkv.kvcache.host_pool import HostKVCache
from radixkv.scheduler import CacheManager, StorageFaultPolicy
from radixkv.storage import pool_fingerprint

log = logging.getLogger("radixkv")

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _into(out: torch.Tensor, ids, n: int) -> None:
    """Writes the first `n` of `ids` (SGLang's array("q"), a list or a
    tensor) into int32 `out[:n]` (an array is read in place, not element by
    element)."""
    if n == 0:
        return
    if isinstance(ids, array) and ids.typecode in "ilq":
        kind = torch.int32 if ids.itemsize == 4 else torch.int64
        out[:n] = torch.frombuffer(ids, dtype=kind, count=n)
    elif isinstance(ids, torch.Tensor):
        out[:n] = ids[:n]
    else:
        out[:n] = torch.as_tensor(ids[:n], dtype=torch.int64)


def _tokens(ids, n: int, tail: bool = False) -> torch.Tensor:
    """The first `n` token ids as an int32 tensor; with `tail`, one more
    (0), which match_req and prefetch leave out: so all `n` are matched.
    With `ids` empty the `n` are left for the caller to write."""
    out = torch.empty(n + 1 if tail else n, dtype=torch.int32)
    if tail:
        out[n] = 0
    if len(ids):
        _into(out, ids, n)
    return out


def _ids(ids, n: int):
    """The first `n` token ids as radixkv reads them fast: SGLang's
    array("q") as a NumPy view (no copy), a tensor or a list sliced."""
    if isinstance(ids, array) and ids.typecode in "ilq":
        if n == 0:
            return np.empty(0, dtype=np.int32)
        return np.frombuffer(ids, dtype=np.int32 if ids.itemsize == 4 else np.int64, count=n)
    return ids[:n] if n < len(ids) else ids


class LayerCounter:
    """What SGLang's device pool and model runner wait on before reading a
    layer (its `layer_transfer_counter`): `wait_until(i)` returns once layer
    i of the loads of the batch being computed is in place (on CUDA: the
    current stream waits for it). SGLang sets the batch's consumer index
    (`ready_to_load_host_cache`'s answer, -1 for a batch without loads)
    before each forward pass."""

    def __init__(self, cache_manager: CacheManager, num_layers: int) -> None:
        self._cm = cache_manager
        self.num_layers = num_layers
        self.consumer_index = -1

    def set_consumer(self, index: int) -> None:
        self.consumer_index = index

    def wait_until(self, layer: int) -> None:
        if self.consumer_index >= 0:
            self._cm.wait_layer(layer)

    def update_producer(self) -> int:
        return 0

    def reset(self) -> None:
        self.consumer_index = -1


class _Count:
    """A size SGLang reads with len() (its `ongoing_*` collections)."""

    def __init__(self, count) -> None:
        self._count = count

    def __len__(self) -> int:
        return self._count()


class HostPoolView:
    """What SGLang's metrics read of a host pool: its slots and free slots."""

    def __init__(self, cache_manager: CacheManager) -> None:
        self._cm = cache_manager
        info = cache_manager.host_size_info
        self.logical_size = info.capacity if info is not None else 0
        self.size = self.logical_size

    def available_size(self) -> int:
        info = self._cm.host_size_info
        return info.free if info is not None else 0


def evict_tokens(cm: CacheManager, want: int) -> int:
    """SGLang's `evict(num_tokens)`: evicts at least `want` device tokens
    where the tree can, else all it can; returns the tokens evicted.
    `make_room` first waits for the backups in flight where they pin what is
    missing, so the cap is what is evictable after them, not before: under
    write_through_selective a match starts a backup (its path pinned)
    between SGLang's admission of a request, which counted that path
    evictable, and the request's allocation."""
    if want <= 0:
        return 0
    try:
        return cm.make_room(want)
    except _core.OutOfCapacityError:  # (the backups in flight have landed by now)
        return cm.make_room(min(want, cm.manager.size_info.evictable_size))


def check_device_pool(device_pool, page_size: int) -> None:
    """Refuses, by name, a device pool the host tier cannot copy."""
    kind = type(device_pool).__name__
    if kind != "MHATokenToKVPool":
        raise ValueError(
            f"--enable-hierarchical-cache with --radix-cache-backend radixkv serves SGLang's "
            f"MHATokenToKVPool (full-attention MHA models); this model's pool is {kind}"
        )
    if getattr(device_pool, "is_quantized_kv_cache", False):
        raise ValueError(
            "--enable-hierarchical-cache with --radix-cache-backend radixkv: a quantized K/V "
            "cache (--kv-cache-dtype fp8/fp4) is not supported"
        )
    buffers = list(device_pool.k_buffer) + list(device_pool.v_buffer)
    if any(b.dim() != 3 or b.dtype not in _FLOAT_DTYPES for b in buffers):
        raise ValueError(
            "--enable-hierarchical-cache with --radix-cache-backend radixkv needs the K/V "
            "buffers as [slots, heads, head_dim] of float16, bfloat16 or float32 "
            f"(got {tuple(buffers[0].shape)} {buffers[0].dtype})"
        )
    if buffers[0].shape[0] % page_size:
        raise ValueError(
            f"the device pool's {buffers[0].shape[0]} slots are not whole pages of {page_size}"
        )


class HierarchicalCache:
    """SGLang's HiCache calls over one radixkv CacheManager (see the module
    doc); `_cache_class` puts SGLang's BasePrefixCache after it.

    Handles are radixkv's: a match's handle is SGLang's `last_device_node`,
    `last_host_node` and `best_match_node` at once (its `cached_len` is the
    device part, `host_hit_len` the host part)."""

    _base: Any  # SGLang's base_prefix_cache module

    def __init__(
        self,
        params,
        settings: Settings,
        *,
        model: str = "",
        tp_rank: int = 0,
        tp_worker=None,
    ) -> None:
        allocator = params.token_to_kv_pool_allocator
        device_pool = allocator.get_kvcache()
        page_size = int(params.page_size)
        check_device_pool(device_pool, page_size)
        self.req_to_token_pool = params.req_to_token_pool
        self.token_to_kv_pool_allocator = allocator
        self.page_size = page_size
        self.disable = False
        self.settings = settings
        self.device = torch.device(getattr(allocator, "device", "cpu"))
        self.pool = EngineKVPool(device_pool.k_buffer, device_pool.v_buffer, page_size)
        host_page_bytes = HostKVCache(
            self.pool, 1, layout=settings.host_layout, pin_memory=False, codec=settings.host_codec
        ).page_bytes
        host_pages = settings.host_pages(
            self.pool.num_pages, self.pool.nbytes // self.pool.num_pages, host_page_bytes
        )
        storage = None
        prefetch: Dict[str, Any] = {}
        if settings.storage is not None:
            o = storage_options(settings.storage.options)
            fingerprint = pool_fingerprint(
                self.pool,
                model=model,
                tp_rank=tp_rank,
                namespace=o.get("namespace"),
                revision=o.get("revision"),
            )
            storage = open_backend(o, fingerprint, codec=settings.host_codec)
            prefetch = dict(
                prefetch_policy=settings.storage.prefetch_policy,
                min_prefetch_tokens=settings.storage.threshold_tokens,
                storage_faults=StorageFaultPolicy(
                    **{k: o[k] for k in ("query_timeout_s", "retry_after_s") if k in o}
                ),
            )
        self.publisher = _publisher(settings.kv_events, params)
        self.cm = CacheManager(
            self.pool.num_pages,
            page_size,
            host_num_pages=host_pages,
            kv_cache=self.pool,
            write_policy=settings.write_policy,
            host_layout=settings.host_layout,
            host_codec=settings.host_codec,
            storage=storage,
            eviction_policy=settings.eviction_policy,
            eviction_policy_config=settings.eviction_policy_config,
            max_namespaces=settings.max_namespaces,
            tp_rank=tp_rank,
            kv_events=self.publisher,
            retain_budget_tokens=settings.retain_budget_tokens,
            **prefetch,
        )
        tree = self.cm.manager.tree
        if tree is None:  # (a radix CacheManager always has one)
            raise RuntimeError("radixkv's hierarchical cache needs the radix cache")
        self._tree = tree
        for q in settings.quotas:
            self.cm.set_quota(namespace_name(q.extra_key, q.cache_salt), **q.limits)
        # Every page is SGLang's allocator's to begin with (its slot 0's page
        # a padding page it never hands out).
        self.cm.allocate(self.pool.num_slots)
        self.counter = LayerCounter(self.cm, self.pool.num_layers)
        device_pool.register_layer_transfer_counter(self.counter)
        if tp_worker is not None and hasattr(tp_worker, "register_hicache_layer_transfer_counter"):
            tp_worker.register_hicache_layer_transfer_counter(self.counter)
        self.token_to_kv_pool_host = HostPoolView(self.cm)
        self.enable_storage = storage is not None
        self.hicache_storage_pass_prefix_keys = False
        # (handle, its device slots): locked until their loads land.
        self._loading: List[tuple] = []
        self._loads_queued = False  # loads since the last ready_to_load_host_cache
        self._prefetching: Dict[Any, tuple] = {}  # request handle -> (read, started, tokens)
        self._loaded: Dict[Any, int] = {}  # request handle -> tokens its read brought
        self.ongoing_write_through = _Count(lambda: self.cm.in_flight.backups)
        self.ongoing_load_back = _Count(lambda: len(self._loading) + self.cm.in_flight.loads)
        self.ongoing_prefetch = self._prefetching
        self.ongoing_backup = _Count(lambda: self.cm.in_flight.storage)
        # radixkv's figures in SGLang's /metrics (its multiprocess mode).
        self.exporter = None
        if getattr(params, "enable_metrics", False):
            from radixkv.prometheus import CacheMetricsExporter

            self.exporter = CacheMetricsExporter(self.cm, labels={"tp_rank": str(tp_rank)})
        self._busy = False  # whether copies may be in flight (check_hicache_events)
        # SGLang asks these every round: the tree answers in one native call.
        # (Pages a load copies into are held, neither free nor evictable; at
        # idle, where SGLang's leak check runs, there are none.)
        self.evictable_size = self.full_evictable_size = tree.evictable_size
        self.protected_size = self.full_protected_size = tree.protected_size
        self._reset_root()
        log.info(
            "radixkv: hierarchical cache: %d device pages, %d host pages (%s, %s%s), "
            "%s eviction, storage %s",
            self.pool.num_pages,
            host_pages,
            settings.write_policy,
            settings.host_layout,
            f", {settings.host_codec}" if settings.host_codec else "",
            settings.eviction_policy,
            settings.storage.options["backend"] if settings.storage else "off",
        )

    # -- pages between SGLang's allocator and the cache ---------------------------------

    def _give_back(self) -> None:
        """After a call that may have changed the cache: pages the tree gave
        up go to SGLang's allocator, the sizes SGLang reads are read again,
        and the next round looks for copies to apply."""
        self._busy = True
        cm = self.cm
        if cm.free_pages:
            slots = cm.allocate(cm.free_pages * self.page_size)
            self.token_to_kv_pool_allocator.free(self._engine(slots))

    def _take(self, tokens: int) -> None:
        """Free pages of SGLang's allocator, up to `tokens` worth, for a load."""
        ps = self.page_size
        allocator = self.token_to_kv_pool_allocator
        n = min(-(-tokens // ps), allocator.available_size() // ps) * ps
        if n > 0:
            slots = allocator.alloc(n)
            if slots is not None:
                self.cm.free(slots.to("cpu", torch.int32))

    def _engine(self, slots: torch.Tensor) -> torch.Tensor:
        """radixkv's slots as SGLang's allocator and rows take them."""
        return slots.to(device=self.device, dtype=torch.int64)

    # -- matching -----------------------------------------------------------------------

    def _reset_root(self) -> None:
        root, _ = self.cm.match_req(np.empty(0, dtype=np.int32), skip_last=False)
        self.root_node = root
        self._empty_result = self._base.MatchResult(
            device_prefix_len=0,
            last_device_node=root,
            last_host_node=root,
            best_match_node=root,
        )

    def _match(self, key):
        ns = namespace_name(getattr(key, "extra_key", None), getattr(key, "cache_salt", None))
        # SGLang's key already stops where a prefix may be reused: all of it.
        handle, _ = self.cm.match_req(_ids(key.token_ids, len(key)), ns, skip_last=False)
        return handle

    def match_prefix(self, params):
        key = getattr(params, "key", params)
        if getattr(key, "is_bigram", False):
            raise NotImplementedError("key.is_bigram: bigram keys are not supported")
        if len(key) == 0:
            return self._empty_result
        handle = self._match(key)
        return self._base.MatchResult(
            device_prefix_len=handle.cached_len,
            last_device_node=handle,
            last_host_node=handle,
            best_match_node=handle,
            host_hit_length=handle.host_hit_len,
        )

    def touch_prefix(self, key) -> None:
        if len(key):
            self._match(key)

    def is_root(self, node) -> bool:
        return node is None or node.cached_len + node.host_hit_len == 0

    def is_backuped(self, node) -> bool:
        # radixkv finds what to prefetch itself, from the whole prompt.
        return True

    def get_last_hash_value(self, node):
        return None

    def get_prefix_hash_values(self, node):
        return None

    def path_device_indices(self, node) -> torch.Tensor:
        for handle, indices in self._loading:  # the tree has them once the load lands
            if handle is node:
                return indices
        return self._engine(self._tree.handle_slots(node))

    # -- locks --------------------------------------------------------------------------

    def inc_lock_ref(self, node):
        """Locks the path to `node` (SGLang reads no delta of ours)."""
        self.cm.lock(node)
        return self._base.IncLockRefResult()

    def dec_lock_ref(self, node, params=None):
        self.cm.unlock(node)  # (an unlock applies the quotas again)
        self._give_back()
        return self._base.DecLockRefResult()

    def inc_host_lock_ref(self, node):
        return self._base.IncLockRefResult(delta=0)

    def dec_host_lock_ref(self, node, params=None):
        return self._base.DecLockRefResult(delta=0)

    # -- the host tier ------------------------------------------------------------------

    def init_load_back(self, params):
        """Loads the host part of `params.best_match_node`'s match back:
        device pages from SGLang's free ones first, else evicted. Returns
        (tokens loaded, the handle covering the device and loaded parts),
        or (0, the request's device match) when it cannot load all of it
        (the request then computes those tokens)."""
        handle = params.best_match_node
        want = params.host_hit_length
        req = params.req
        fallback = getattr(req, "last_node", None) or handle
        if want <= 0:
            return 0, fallback
        self._take(want)
        try:
            loaded, indices = self.cm.load_back(handle)
        except _core.OutOfCapacityError:
            self._give_back()
            return 0, fallback
        self._give_back()
        got = loaded.cached_len - handle.cached_len
        if got == 0:
            self.cm.unlock(loaded)  # (load_back locked the device part alone)
            return 0, fallback
        self._loading.append((loaded, self._engine(indices)))
        self._loads_queued = True
        if got < want:
            # Part of the host part left the host tier since the match: the
            # request computes all of it; what is loading stays cached.
            return 0, fallback
        return got, loaded

    def ready_to_load_host_cache(self) -> int:
        """Starts the loads queued for the batch; its forward pass waits on
        layer i's (LayerCounter). -1 when there are none."""
        if not self._loads_queued:
            return -1
        self._loads_queued = False
        self.cm.start_loading()
        return 0

    def check_hicache_events(self) -> None:
        """Applies finished copies (and storage reads and writes), releases
        the locks of landed loads, hands freed pages to SGLang's allocator.
        Called every round, idle or not: with nothing in flight it only
        publishes the round's KV events."""
        if not self._busy:  # nothing changed since the last round's copies landed
            if self.exporter is not None:
                self.exporter.update()
            return
        cm = self.cm
        if self._loads_queued:  # queued by a batch that never ran
            self.ready_to_load_host_cache()
        flight = cm.in_flight
        if flight.backups:
            cm.writing_check()
        if flight.loads or self._loading:
            failed = cm.loading_check()
            if failed:
                # The forward pass has read those rows already: serving on
                # would hand out K/V that never arrived.
                raise RuntimeError(
                    f"radixkv: {len(failed)} loads from the host tier failed after their "
                    "batch ran; the server stops rather than serve wrong K/V"
                )
            if self._loading and not cm.in_flight.loads:
                for handle, _ in self._loading:
                    cm.unlock(handle)
                self._loading.clear()
        if flight.storage:
            cm.storage_check()
        elif self.publisher is not None:
            cm.flush_events()
        self._give_back()
        flight = cm.in_flight
        self._busy = bool(
            flight.backups or flight.loads or flight.storage or self._loading or self._prefetching
        )
        if self.exporter is not None:
            self.exporter.update()

    def flush_pending_backups(self) -> None:
        """Backups start when they are queued: nothing waits here."""

    # -- a request's KV -----------------------------------------------------------------

    def checkpoint(self, req, *, up_to: int, **kwargs) -> None:
        """The request's whole pages up to row position `up_to` join the
        tree (write-through backups start as the policy says); the row
        points at the tree's slots where another request cached the same
        tokens meanwhile (its own go back to SGLang's allocator); its lock
        moves to the new match and `cache_protected_len` covers it."""
        kv = req.kv
        token_ids = req.full_untruncated_fill_ids
        aligned = min(up_to, len(token_ids)) // self.page_size * self.page_size
        protected = kv.cache_protected_len
        if aligned <= protected:
            return
        lock = req.lock
        old = lock.node if lock is not None else req.last_node
        if lock is None:
            self.cm.lock(old)
        row = self.req_to_token_pool.req_to_token[kv.req_pool_idx, :aligned]
        ids = _ids(token_ids, aligned)
        priority = _priority(int(getattr(req, "priority", 0) or 0))
        new, indices = self.cm.cache_unfinished_req(old, ids, row.to("cpu", torch.int32), priority)
        self._give_back()
        n = new.cached_len
        if n > protected:
            self.req_to_token_pool.write((kv.req_pool_idx, slice(protected, n)), indices[protected:n])
        kv.cache_protected_len = n
        if hasattr(kv, "cache_inserted_len"):
            kv.cache_inserted_len = max(kv.cache_inserted_len, aligned)
        req.lock = self._base.TreeLock(new, self._base.DecLockRefParams())
        req.last_node = new

    # -- eviction and sizes -------------------------------------------------------------

    def evict(self, params):
        start = time.perf_counter()
        want = params.num_tokens if hasattr(params, "num_tokens") else int(params)
        evicted = 0
        if want > 0:
            evicted = evict_tokens(self.cm, want)
            self._give_back()
        if self.metrics_collector is not None:
            self.update_eviction_metrics(evicted, start)
        return self._base.EvictResult(num_tokens_evicted=evicted)

    def total_size(self) -> int:
        return self._tree.evictable_size() + self._tree.protected_size()

    def sanity_check(self) -> None:
        self.cm.check_integrity()

    def pretty_print(self) -> None:
        print(self.cm.metrics)

    # -- the storage tier ---------------------------------------------------------------

    def prefetch_from_storage(
        self,
        handle,
        last_host_node,
        new_input_tokens,
        last_hash=None,
        prefix_keys=None,
        *,
        matched_prefix_tokens=(),
        extra_key=None,
        cache_salt=None,
        **kwargs,
    ):
        """Starts reading the request's pages beyond the cache from storage."""
        if not self.enable_storage or handle in self._prefetching:
            return None
        matched, new = len(matched_prefix_tokens), len(new_input_tokens)
        tokens = _tokens((), matched + new, tail=True)  # (the rest written below)
        _into(tokens, matched_prefix_tokens, matched)
        _into(tokens[matched:], new_input_tokens, new)
        op = self.cm.prefetch(tokens, namespace=namespace_name(extra_key, cache_salt))
        if op is not None:
            self._prefetching[handle] = (op, time.monotonic(), new)
            self._busy = True
        return None

    def check_prefetch_progress(self, handle) -> bool:
        """Whether the request's read may stop being waited for, as the
        prefetch policy says; then what arrived joins the tree."""
        entry = self._prefetching.get(handle)
        if entry is None:
            return True
        op, started, tokens = entry
        storage = self.settings.storage
        if not op.done.is_set() and storage is not None:
            waited = time.monotonic() - started
            if storage.prefetch_policy == "wait_complete":
                bound = StorageFaultPolicy.wait_limit_s
            elif storage.prefetch_policy == "timeout":
                bound = storage.timeout_base_s + storage.timeout_per_ki_token_s * tokens / 1024
            else:
                bound = 0.0
            if waited < bound:
                return False
        self.cm.storage_check()
        self._give_back()
        del self._prefetching[handle]
        self._loaded[handle] = op.inserted
        return True

    def pop_prefetch_loaded_tokens(self, handle) -> int:
        return self._loaded.pop(handle, 0)

    def pop_prefetch_loaded_span(self, handle):
        return self.pop_prefetch_loaded_tokens(handle), None

    def release_aborted_request(self, handle) -> None:
        self._prefetching.pop(handle, None)
        self._loaded.pop(handle, None)

    def attach_storage_backend(self, *args, **kwargs):
        return False, (
            "radixkv: a storage backend is attached at start-up only " "(--hicache-storage-backend)"
        )

    def detach_storage_backend(self, *args, **kwargs):
        return False, "radixkv: the storage backend stays attached until the server stops"

    def clear_storage_backend(self, *args, **kwargs) -> bool:
        log.warning(
            "radixkv: the store is shared by every instance of the deployment and is "
            "not cleared from one of them"
        )
        return False

    # -- the rest of SGLang's calls -----------------------------------------------------

    def reset(self) -> None:
        """Drops every cached page of both tiers (SGLang's /flush_cache; its
        allocator is cleared right after)."""
        cm = self.cm
        cm.reset()
        if cm.free_pages:  # SGLang's allocator takes them back with its clear()
            cm.allocate(cm.free_pages * self.page_size)
        self._loading.clear()
        self._loads_queued = False
        self._prefetching.clear()
        self._loaded.clear()
        self.counter.reset()
        self._busy = True  # (the reset's events go out next round)
        self._reset_root()

    def release_host_resources(self) -> None:
        m = self.cm.metrics
        log.info(
            "radixkv: %d queries, hit tokens %d (device %d, host %d, storage %d), loaded back "
            "%d, backed up %d",
            m.queries,
            m.hit_tokens,
            m.device_hit_tokens,
            m.host_hit_tokens,
            m.storage_hit_tokens,
            m.loaded_back_tokens,
            m.backed_up_tokens,
        )
        self.cm.close()
        if self.publisher is not None:
            self.publisher.close()

    def take_events(self) -> list:
        return []  # radixkv's publisher sends them (see config.py)

    def supports_prefix_sharing(self) -> bool:
        return True

    def supports_swa(self) -> bool:
        return False

    def supports_mamba(self) -> bool:
        return False

    def supports_fast_match_prefix(self) -> bool:
        return False

    def is_chunk_cache(self) -> bool:
        return False

    def is_tree_cache(self) -> bool:
        return True


def _publisher(config: Optional[dict], params):
    """radixkv's event publisher on SGLang's --kv-events-config endpoint (on
    the rank SGLang publishes from), or None."""
    if config is None or not getattr(params, "enable_kv_cache_events", False):
        return None
    from radixkv.events import EventPublisher

    return EventPublisher(
        config.get("endpoint", "tcp://*:5557"),
        replay_endpoint=config.get("replay_endpoint"),
        topic=config.get("topic", ""),
        buffer_steps=int(config.get("buffer_steps", 10_000)),
        hwm=int(config.get("hwm", 100_000)),
        bind=config.get("bind"),
    )
