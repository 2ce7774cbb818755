"""The scheduler-side cache manager: free pages, the prefix cache and requests."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Callable, Iterable, List, Optional, Tuple, cast

import numpy as np
import torch

from radixkv import _core
from radixkv._core import RadixCacheHandle, shielded
from radixkv._checks import as_count, as_device, as_int, int32_tensor, per_input, to_host
from radixkv.events import EventPublisher, KVSnapshot
from radixkv.kvcache import (
    BaseCacheHandle,
    EngineKVPool,
    MHAKVCache,
    MLAKVCache,
    create_cache_manager,
)
from radixkv.kvcache.base import released_slots
from radixkv.kvcache.engine_pool import DevicePool
from radixkv.kvcache.host_pool import HOST_LAYOUTS, HostKVCache
from radixkv.kvcache.pool_args import resolve_tp_rank
from radixkv.scheduler.host_tier import HostSizeInfo, HostTier, InFlight, TierCounters
from radixkv.scheduler.metrics import CacheMetrics
from radixkv.scheduler.namespaces import Namespaces
from radixkv.scheduler.quotas import Quotas, QuotaUsage, quota_excess
from radixkv.scheduler.retention import TIERS, Retention, RetentionClaim, check_ttl
from radixkv.scheduler.storage_tier import (
    Prefetch,
    StorageCounters,
    StorageFaultPolicy,
    StorageTier,
)
from radixkv.scheduler.tiers import build_tiers, check_tier_args
from radixkv.storage.base import StorageBackend


def _length(values) -> int:
    """len() of a checked 1-D input; a tensor's own len() is a Python call."""
    return values.shape[0] if isinstance(values, torch.Tensor) else len(values)


class CacheManager:
    """Hands KV pages to requests and caches their prefixes when they finish.

    Owns a pool of `num_pages` pages of `page_size` token slots (slot `s`
    lives in page `s // page_size`) and a prefix cache of `type` ("radix" or
    "naive"). A page is at any time in exactly one of three places: free,
    cached (stored in the prefix cache), or held by a request between
    `allocate` and its return through `free`, `free_and_cache_finished_req`
    or `cache_unfinished_req`. Requests are the caller's: the manager keeps
    no request objects, only the count of pages they hold.

    A request's indices cover its tokens in order: the first
    `handle.cached_len` are the cache's slots (from `match_req`), the rest
    the request's own, in whole pages (`allocate` rounds up to whole pages, so
    the last page may have room for the tokens that follow).

    The host tier. With `host_num_pages > 0` (radix only) the cache spans
    device and host memory: nodes are copied to `host_num_pages` host pages
    under `write_policy` (`write_through`: when inserted;
    `write_through_selective`: when matched a second time; `write_back`:
    when evicted from the device), device eviction keeps a node that has a
    host copy as host only, and `load_back` brings a match's host part back.
    With `kv_cache` (the device pool) the K/V bytes move between it and a
    `HostKVCache` of layout `host_layout`, on a controller thread; without
    it the tier keeps the bookkeeping only (capacity planning). With
    `host_codec="float8"` (needs `kv_cache` and `page_first`) the host pool
    holds each page encoded (`HostKVCache(codec=...)`), in half the bytes for
    16-bit K/V or a quarter for 32-bit, so the same memory holds 2-4x the
    pages: backups encode and loads decode in the copy engine, and a storage
    backend (which must take the same codec) stores the pages as they are.
    Lossy; the default (None) keeps pages bit for bit. Copies change
    the cache only when the scheduler applies their acknowledgements:
    `writing_check()` and `loading_check()`, called once per scheduling
    round (`drain()` waits for every copy and applies all). With
    `manual_copies=True` the controller has no thread: copies run when a test
    says (`controller.complete(id, ok)`) or on `drain()`/`wait_layer()`.
    A page is then in exactly one place: free, cached, held by a request, or
    owned by one copy in flight (a load's device pages, a backup's host pages).

    Cache namespaces. `match_req`, `match_req_batch` and `prefetch` take
    `namespace`: None or 0 (the default), a str, bytes or an int, such as a
    tenant's cache salt, SGLang's extra_key or a LoRA adapter's id. Requests
    of different namespaces never share a prefix, on any tier: they live in
    one tree (one pool, one eviction order), and each namespace seeds its own
    storage keys. The handle carries the namespace to the `cache_*_req` call
    that ends the request. The last `max_namespaces` names used are
    remembered (see `radixkv.scheduler.namespaces.Namespaces`).

    MLA. `kv_cache` may be an `MLAKVCache`: its one latent row per token and
    layer moves between the tiers like K/V pages. Its pages are the same on
    every tensor-parallel rank, so only `tp_rank` 0 writes them to storage
    (None: the torch.distributed rank, else 0); every rank reads them (key them
    with `radixkv.storage.pool_fingerprint`, which leaves the rank out).

    KV events. With `kv_events` (a `radixkv.events.EventPublisher`) the
    manager tells a KV-aware router which blocks (pages) each tier holds, in
    vLLM's format: BlockStored / BlockRemoved with medium "GPU" when pages
    join the device tree (an insert, a load from host) or are evicted from
    it, "CPU_PINNED" when host copies land (a backup, a read from storage) or
    are evicted, "DISK" when a write to storage finishes; AllBlocksCleared on
    `reset()`. The events of a scheduling round go out as one batch at
    `flush_events()`, which `writing_check()`, `loading_check()`,
    `storage_check()`, `drain()`, `reset()` and `close()` also call. Without
    it (the default) nothing of this exists.

    Retention claims. `retain(input_ids, ttl_s=...)` keeps a cached prefix
    on the device (or, with `tier="host"`, at least in host memory) until
    `release(claim)` or until `ttl_s` seconds of `clock` have passed
    (`refresh_on_hit` starts the time again at each match that covers the
    prefix). Claims together hold at most `retain_budget_tokens` distinct
    tokens (None: half the device pool), and each namespace at most what
    `set_retain_budget` gives it, so they never starve admission: a claim
    past a budget raises `RetainBudgetError`. Expiry is lazy and exact: any
    call that may evict ends the claims whose time is up first.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int = 1,
        type: str = "radix",
        device: torch.device | str = "cpu",
        *,
        host_num_pages: int = 0,
        write_policy: str = "write_through",
        kv_cache: Optional[DevicePool] = None,
        host_layout: str = "page_first",
        host_codec: Optional[str] = None,
        manual_copies: bool = False,
        storage: Optional[StorageBackend] = None,
        storage_seed: Optional[bytes] = None,
        prefetch_policy: str = "best_effort",
        min_prefetch_tokens: int = 0,
        storage_faults: Optional[StorageFaultPolicy] = None,
        eviction_policy: str = "lru",
        eviction_policy_config: Optional[dict] = None,
        max_namespaces: int = 1 << 16,
        tp_rank: Optional[int] = None,
        kv_events: Optional[EventPublisher] = None,
        retain_budget_tokens: Optional[int] = None,
        clock: Optional[Callable[[], float]] = None,
    ):
        if kv_events is not None and not isinstance(kv_events, EventPublisher):
            raise TypeError(
                "kv_events must be a radixkv.events.EventPublisher (or None), got "
                f"{_type_name(kv_events)}"
            )
        num_pages = as_count(num_pages, "num_pages", minimum=0)
        page_size = as_count(page_size, "page_size")
        host_num_pages = as_count(host_num_pages, "host_num_pages", minimum=0)
        min_prefetch_tokens = as_count(min_prefetch_tokens, "min_prefetch_tokens", minimum=0)
        if storage_faults is not None and not isinstance(storage_faults, StorageFaultPolicy):
            raise TypeError(
                "storage_faults must be a StorageFaultPolicy (or None), got "
                f"{_type_name(storage_faults)}"
            )
        tp_rank = resolve_tp_rank(tp_rank)
        if retain_budget_tokens is not None:
            retain_budget_tokens = as_count(retain_budget_tokens, "retain_budget_tokens", minimum=0)
        if clock is not None and not callable(clock):
            raise TypeError(f"clock must be callable (or None), got {_type_name(clock)}")
        if host_layout not in HOST_LAYOUTS:
            raise ValueError(
                f"host_layout must be one of {', '.join(HOST_LAYOUTS)}, got {host_layout!r}"
            )
        if kv_cache is not None:
            if not isinstance(kv_cache, (MHAKVCache, MLAKVCache, EngineKVPool)):
                raise TypeError(
                    "kv_cache must be an MHAKVCache, an MLAKVCache or an EngineKVPool, got "
                    f"{_type_name(kv_cache)}"
                )
            if kv_cache.page_size != page_size or kv_cache.num_pages < num_pages:
                raise ValueError(
                    f"kv_cache must have page_size={page_size} and at least num_pages={num_pages} "
                    f"pages, got page_size={kv_cache.page_size} and {kv_cache.num_pages} pages"
                )
        check_tier_args(
            type == "radix", host_num_pages, write_policy, kv_cache, host_layout, host_codec
        )
        self._pages = _core.PageAllocator(num_pages, page_size)
        self.manager = create_cache_manager(
            device,
            type,
            page_size,
            max_slots=num_pages * page_size,
            eviction_policy=eviction_policy,
            eviction_policy_config=eviction_policy_config,
        )
        self.device = as_device(device)
        self.page_size = page_size
        self.num_pages = num_pages
        # Pages held by requests: allocated, not yet freed or cached.
        self._held_pages = 0
        self._tree = self.manager.tree
        self._queries = self._query_tokens = self._device_hits = self._host_hits = 0
        self._storage_hits = self._hits = 0
        self._evicted = 0
        self._namespaces = Namespaces(as_count(max_namespaces, "max_namespaces"))
        self._tiers = build_tiers(
            self._tree,
            self._pages,
            self._namespaces,
            page_size=page_size,
            num_pages=num_pages,
            host_num_pages=host_num_pages,
            write_policy=write_policy,
            kv_cache=kv_cache,
            host_layout=host_layout,
            host_codec=host_codec,
            manual_copies=manual_copies,
            storage=storage,
            storage_seed=storage_seed,
            prefetch_policy=prefetch_policy,
            min_prefetch_tokens=min_prefetch_tokens,
            storage_faults=storage_faults,
            tp_rank=tp_rank,
            kv_events=kv_events,
        )
        self._events = self._tiers.events  # the device's events are the manager's to tell
        self._retention: Optional[Retention] = None
        if self._tree is not None:
            budget = retain_budget_tokens
            if budget is None:
                budget = num_pages // 2 * page_size
            self._retention = Retention(self._tree, budget, clock or time.monotonic)
            if self._tiers.host is not None:
                self._tiers.host.before_evict = self._retention.expire
        self._quotas: Optional[Quotas] = None
        self._claims_ended_seen = 0  # retention.ended when the quotas were last enforced
        if self._tree is not None:
            host_pool = self._tiers.host.pool if self._tiers.host is not None else None
            self._quotas = Quotas(
                self._tree,
                page_size,
                _device_page_bytes(kv_cache) if kv_cache is not None else 0,
                host_pool.nbytes // host_pool.num_pages if host_pool is not None else 0,
                self._tiers.host is not None,
            )
        # What the write policy does on the request path, decided once.
        self._backs_up_on_insert = self._tiers.write_policy == "write_through"
        self._backs_up_on_evict = self._tiers.write_policy == "write_back"

    @property
    def _tier(self) -> Optional[HostTier]:
        return self._tiers.host

    @property
    def _storage(self) -> Optional[StorageTier]:
        return self._tiers.storage

    # -- matching and locking -------------------------------------------------

    @shielded
    def match_req(
        self, input_ids, namespace=None, *, skip_last: bool = True
    ) -> Tuple[BaseCacheHandle, torch.Tensor]:
        """Match `input_ids[:-1]`: the last token is always computed. An
        engine whose input already leaves out the tokens it will compute
        (SGLang's key stops where a prefix may be reused) passes
        `skip_last=False` to match all of `input_ids` (none: the root)."""
        skip = _flag(skip_last, "skip_last")
        tree = self._tree
        if tree is not None and self.device.type == "cpu" and self._matches_natively(namespace):
            # The tree reads and checks the input itself, without its last
            # token (the length is taken first: an input the tree reads may
            # have none).
            try:
                n = _length(input_ids)
            except (TypeError, IndexError):  # (no len(), a 0-d tensor): checked below
                n = None
            if n is not None:
                ids = to_host(input_ids, "input_ids", self.device)  # (refuses other devices)
                handle, indices = tree.match_prefix(ids, 0, skip)
                self._count_match(n - skip, handle)
                self._refresh_claims((handle,))
                return handle, indices
        ids = int32_tensor(input_ids, "input_ids", self.device)
        n = ids.shape[0]  # (a tensor's len() is a Python call)
        if n == 0 and skip:
            raise ValueError("input_ids must hold at least one token")
        ns = self._namespaces.id(namespace)
        asked = ids[:-1] if skip else ids
        handle, indices = self.manager.match_prefix(asked, ns)
        self._count_match(n - skip, handle)
        self._refresh_claims((handle,))
        if self._tiers.backs_up_on_match:
            self._tiers.back_up(asked, ns)
        return handle, indices

    def _matches_natively(self, namespace) -> bool:
        """Whether a match can hand its inputs to the tree as they come: the
        radix cache, the default namespace (nothing to remember before the
        inputs are checked), and no backup on match."""
        return (
            self._tree is not None
            and (namespace is None or (type(namespace) is int and namespace == 0))
            and not self._tiers.backs_up_on_match
        )

    def _refresh_claims(self, handles: Iterable[BaseCacheHandle]) -> None:
        """Claims that refresh on a hit see the paths of `handles` matched."""
        retention = self._retention
        if retention is not None and retention.refreshing:
            for handle in handles:
                retention.hit(handle)

    def _count_match(self, tokens: int, handle: BaseCacheHandle) -> None:
        self._queries += 1
        self._query_tokens += tokens
        self._device_hits += handle.cached_len
        self._hits += handle.cached_len + handle.host_hit_len
        if handle.host_hit_len:
            self._count_host_part(handle, handle.host_hit_len)

    def _count_host_part(self, handle: BaseCacheHandle, tokens: int) -> None:
        """Attributes a match's host part to the tier serving it: pages read
        from storage and not on the device since are the storage tier's."""
        storage = 0
        if self._storage is not None:
            storage = self._tree.storage_hit_len(handle)  # type: ignore[union-attr,arg-type]
        self._storage_hits += storage
        self._host_hits += tokens - storage

    @shielded
    def match_req_batch(self, batch, namespace=None, *, flat: bool = False):
        """`match_req` of each request of a prefill batch, in order, in one
        native call for the radix cache; every input is checked first.
        `namespace` is one for the whole batch, or a list or tuple of one per
        request. Returns [(handle, indices), ...]; with `flat`, ([handle, ...],
        indices): every match's indices in one tensor, request i's
        (`handles[i].cached_len` of them) after those of the requests before
        it, as a scheduler writes them into its request-to-token table."""
        flat = bool(flat)
        if not isinstance(batch, (list, tuple)):
            raise TypeError(
                "batch must be a list or tuple of token id sequences, got "
                f"{type(batch).__name__}"
            )
        names = per_input(namespace, len(batch))
        if self._matches_natively(namespace):
            # The tree reads and checks the inputs itself (the lengths are
            # taken first: an input the tree reads may have none).
            try:
                tokens = sum(_length(x) for x in batch) - len(batch)
            except (TypeError, IndexError):  # (no len(), a 0-d tensor): checked below
                tokens = None
            if tokens is not None:
                try:
                    return self._match_batch_natively(batch, tokens, flat)
                except TypeError:  # raised before anything changed
                    # Tensors on another device: copied to the host, or
                    # refused, as match_req does; any other error stands.
                    host = [to_host(x, f"batch[{i}]", self.device) for i, x in enumerate(batch)]
                    if all(h is x for h, x in zip(host, batch)):
                        raise
                    return self._match_batch_natively(host, tokens, flat)
        ids = [int32_tensor(x, f"batch[{i}]", self.device) for i, x in enumerate(batch)]
        for i, x in enumerate(ids):
            if x.shape[0] == 0:
                raise ValueError(f"batch[{i}] must hold at least one token")
        if names is not None:  # all checked before any is remembered
            for i, x in enumerate(names):
                Namespaces.check(x, f"namespace[{i}]")
            spaces = [self._namespaces.id(x) for x in names]
        else:
            spaces = [self._namespaces.id(namespace)] * len(batch)
        out = cast(
            List[Tuple[BaseCacheHandle, torch.Tensor]],
            self.manager.match_prefix_batch([x[:-1] for x in ids], spaces),
        )
        for x, (handle, _) in zip(ids, out):
            self._count_match(x.shape[0] - 1, handle)
        self._refresh_claims(handle for handle, _ in out)
        if self._tiers.backs_up_on_match:
            for x, ns in zip(ids, spaces):
                self._tiers.back_up(x[:-1], ns)
        if flat:
            return [h for h, _ in out], self._joined([idx for _, idx in out])
        return out

    def _joined(self, parts: List[torch.Tensor]) -> torch.Tensor:
        """Slot tensors back to back in one (an empty int32 one for none)."""
        if not parts:
            return torch.empty(0, dtype=torch.int32, device=self.device)
        return torch.cat(parts)

    def _match_batch_natively(self, batch, tokens: int, flat: bool):
        """match_req_batch in the default namespace in one native call that
        reads and checks the inputs, each matched without its last token
        (`tokens` in all, once matched)."""
        out = self.manager.match_prefix_batch(batch, 0, True, flat)
        if flat:
            handles = cast(Tuple[List[BaseCacheHandle], torch.Tensor], out)[0]
        else:
            handles = [h for h, _ in cast(List[Tuple[BaseCacheHandle, torch.Tensor]], out)]
        device = host = 0
        for handle in handles:
            device += handle.cached_len
            host += handle.host_hit_len
        self._refresh_claims(handles)
        self._queries += len(batch)
        self._query_tokens += tokens
        self._device_hits += device
        self._hits += device + host
        if host:
            for handle in handles:
                if handle.host_hit_len:
                    self._count_host_part(handle, handle.host_hit_len)
        return out

    @shielded
    def load_back(self, handle: BaseCacheHandle) -> Tuple[BaseCacheHandle, torch.Tensor]:
        """Brings the host part of `handle`'s match to the device.

        Returns a locked handle for the whole match (`cached_len` covers the
        device and the host part) and its indices: the device part's slots,
        then fresh device pages that the host part is loading into. Takes the
        place of `lock(handle)` after `match_req`; `handle` itself is left as
        it was. The pages are the cache's from the start (not the request's);
        the copy runs with the next forward pass (`wait_layer(i)`, which the
        pool's `k_cache(i)`/`v_cache(i)` call, returns once layer i is in
        place) and joins the tree at `loading_check()`. If it fails,
        `loading_check()` returns the handle: its pages were freed and the
        request must unlock it, free its own pages and be computed again.

        Evicts on the device if pages are missing (never the matched path);
        raises `radixkv.OutOfCapacityError`, changing nothing, when even that
        cannot make room. Without a host part this is `lock(handle)`; when the
        host part was evicted from host since the match (another request's
        backups needed the room), the returned handle covers the device part
        only: check `cached_len`, never `handle.host_hit_len`, for what the
        request may skip.
        """
        tier = self._tiers.host
        if not isinstance(handle, BaseCacheHandle):
            raise TypeError(f"handle must be a cache handle, got {type(handle).__name__}")
        if not self.manager.is_valid(handle):
            raise ValueError("handle is stale or belongs to another cache manager")
        if tier is None or handle.host_hit_len == 0:
            return self._lock_device_part(handle)
        tree = tier.tree  # (the manager's tree: a host tier needs the radix cache)
        if TYPE_CHECKING:  # so a valid handle is the tree's (no call at run time)
            handle = cast(RadixCacheHandle, handle)
        started = self._start_load(tree, handle)
        if started is None:  # nothing left on the host beyond the device part
            return self._lock_device_part(handle)
        copy, loaded, host_slots, indices = started
        if loaded is None or host_slots is None or indices is None:
            return self._load_making_room(tier, tree, handle, copy)
        if copy.end == copy.start:  # another request's load landed the whole part meanwhile
            return loaded, indices.to(self.device, non_blocking=True)
        # The load's own slots: the caller may reuse the indices it gets.
        device_slots = indices[copy.start :].clone()
        try:
            tier.queue_load(copy, host_slots, device_slots, loaded)
        except BaseException:
            tree.finish_load(copy, torch.zeros(copy.end - copy.start, dtype=torch.int32), False)
            tree.lock_handle(loaded, True)
            self._pages.free(device_slots)
            raise
        return loaded, indices.to(self.device, non_blocking=True)

    def _load_making_room(self, tier, tree, handle, copy) -> Tuple[BaseCacheHandle, torch.Tensor]:
        """load_back when device pages must be evicted first: the load is
        begun (its host part pinned) before the eviction, so a write_back
        backup of the victims cannot take the host room the load reads."""
        n = copy.end - copy.start
        self.lock(handle)  # the device part stays while room is made
        try:
            missing, evictable = self._device_room(n)
            if missing > evictable:
                room = self._pages.num_free_pages * self.page_size + evictable
                raise _core.OutOfCapacityError(
                    f"cannot load {n} tokens back from host: {room} device slots are free "
                    "or evictable"
                )
            loaded, host_slots, prefix = tree.begin_load(copy)
        finally:
            self.manager.lock_handle(handle, unlock=True)  # (quotas wait for the load)
        device_slots = None
        try:
            self._make_room(n, getattr(handle, "namespace", None))
            device_slots = self._pages.allocate(n)
            tier.queue_load(copy, host_slots, device_slots, loaded)
        except BaseException:
            tree.finish_load(copy, torch.zeros(n, dtype=torch.int32), False)
            tree.lock_handle(loaded, True)
            if device_slots is not None:
                self._pages.free(device_slots)
            raise
        indices = torch.cat([prefix, device_slots])
        return loaded, indices.to(self.device, non_blocking=True)

    def _start_load(self, tree, handle):
        """`start_load` (find, room check, begin and the device pages in one
        call); a load in flight on the match's host part lands first."""
        try:
            return tree.start_load(handle, self._pages)
        except ValueError:
            if not tree.tier_sizes().loading:
                raise
            # Another request is loading this part: let it land, then take it.
            self._tiers.settle_loads()
            return tree.start_load(handle, self._pages)

    def _lock_device_part(self, handle) -> Tuple[BaseCacheHandle, torch.Tensor]:
        indices = self._device_slots(handle)  # raises, changing nothing, if not there
        self.lock(handle)
        return handle, indices

    def _device_slots(self, handle) -> torch.Tensor:
        if self._tree is None:
            return torch.empty(0, dtype=torch.int32, device=self.device)
        return self._tree.handle_slots(handle).to(self.device, non_blocking=True)

    @shielded
    def lock(self, handle: BaseCacheHandle) -> None:
        self.manager.lock_handle(handle, unlock=False)

    @shielded
    def unlock(self, handle: BaseCacheHandle) -> None:
        """Releases a lock of `lock`: pages it kept past their namespace's
        quota are evicted now."""
        self.manager.lock_handle(handle, unlock=True)
        self._enforce_quotas()

    # -- retention claims -------------------------------------------------------

    @shielded
    def retain(
        self,
        input_ids,
        namespace=None,
        *,
        ttl_s: Optional[float] = None,
        priority: int = 0,
        tier: str = "device",
        refresh_on_hit: bool = False,
    ) -> RetentionClaim:
        """Keeps the cached prefix of `input_ids` (all of them, in whole
        pages) until `release(claim)` or, with `ttl_s`, until that many
        seconds of the manager's clock have passed; `refresh_on_hit` starts
        them again whenever a match covers the whole prefix.

        `tier="device"` keeps the prefix's device part on the device (its
        pages are locked, as a request's are); `tier="host"` keeps the whole
        match, host part included, at least in host memory: its pages may
        leave the device once they have a host copy, and that copy stays.
        `priority` raises the prefix's eviction priority (the "priority"
        policy's order) for after the claim. Returns a `RetentionClaim`
        whose `tokens` say how much is held (0 when nothing is cached: such a
        claim holds nothing, and no match refreshes it).

        Raises `RetainBudgetError` when the claims would together hold more
        than `retain_budget_tokens` distinct tokens, or more than the
        namespace's budget (`set_retain_budget`); that, or a clock that
        raises, changes nothing (no LRU time either: the cost is found
        without a match).
        """
        retention = self._claims_of("retain")
        ttl = check_ttl(ttl_s)
        if tier not in TIERS:
            raise ValueError(f"tier must be one of {', '.join(TIERS)}, got {tier!r}")
        if tier == "host" and self._tier is None:
            raise ValueError('tier="host" needs a host tier (host_num_pages > 0)')
        priority = as_int(priority, "priority")
        if not -(2**31) <= priority < 2**31:
            raise ValueError(f"priority must fit int32, got {priority}")
        refresh = _flag(refresh_on_hit, "refresh_on_hit")
        ids = int32_tensor(input_ids, "input_ids", self.device)
        # Admitted (budgets, the clock) before anything changes: a match
        # stamps LRU times, and a new name would be remembered.
        known = self._namespaces.find(namespace)
        deadline = retention.admit(ids, known, namespace, tier, ttl)
        ns = self._namespaces.id(namespace)
        handle, _ = self._tree.match_prefix(ids, ns)  # type: ignore[union-attr]
        return retention.claim(handle, ns, namespace, tier, ttl, deadline, priority, refresh)

    @shielded
    def release(self, claim: RetentionClaim) -> bool:
        """Ends a claim of `retain`: its pages may be evicted again, and
        those it kept past their namespace's quota are evicted now. Returns
        False when it had ended already (released, expired, or a reset)."""
        retention = self._claims_of("release")
        if not isinstance(claim, RetentionClaim):
            raise TypeError(f"claim must be a RetentionClaim from retain, got {_type_name(claim)}")
        if claim._owner is not retention:
            raise ValueError("claim was made by another cache manager")
        ended = retention.release(claim)
        self._enforce_quotas()
        return ended

    def set_retain_budget(self, tokens: Optional[int], namespace=None, *, whole: bool = False):
        """Sets the most tokens the claims of `namespace` may hold together
        (None: no budget of its own), or with `whole` the manager's budget
        for all claims. A lower budget refuses new claims; the ones held stay."""
        retention = self._claims_of("set_retain_budget")
        if _flag(whole, "whole"):
            if tokens is None:
                raise ValueError("tokens must be a count for the whole manager's budget")
            retention.budget = as_count(tokens, "tokens", minimum=0)
            return
        ns = self._namespaces.id(namespace)
        if tokens is None:
            retention.ns_budgets.pop(ns, None)
        else:
            retention.ns_budgets[ns] = as_count(tokens, "tokens", minimum=0)

    @property
    def retained_tokens(self) -> int:
        """Tokens that at least one retention claim holds (after ending the
        claims whose time is up)."""
        if self._retention is None:
            return 0
        self._retention.expire()
        return self._retention.tree.claimed_size

    def _claims_of(self, what: str) -> Retention:
        if self._retention is None:
            raise TypeError(f"{what} needs the radix cache (type='radix'), not {self.manager!r}")
        return self._retention

    # -- namespace quotas ---------------------------------------------------------

    @shielded
    def set_quota(
        self,
        namespace=None,
        *,
        device_bytes: Optional[int] = None,
        host_bytes: Optional[int] = None,
        device_tokens: Optional[int] = None,
        host_tokens: Optional[int] = None,
    ) -> None:
        """Bounds what `namespace` (a tenant) keeps cached on each tier: at
        most `device_bytes` of device pool and `host_bytes` of host pool
        (rounded down to whole pages; bytes need `kv_cache`), or the same in
        tokens (`device_tokens`, `host_tokens`; one of the two per tier, None
        for no limit there; all None removes the quota). Whenever the
        namespace holds more (after a request is cached, copies land or pages
        arrive from storage, and at once here), its own least recently used
        pages are evicted, as the tier's eviction would (write_back backs them
        up first), and no other namespace's: a tenant that floods the cache
        pushes out its own pages only. When a pool is full, new pages of a
        namespace at its quota take the room of its own oldest pages first:
        on the host tier always, on the device when the request's namespace
        is given to `allocate` (or `make_room`; `load_back` knows it from the
        handle); without it, room comes from every namespace's least recently
        used pages and the quota trims the namespace afterwards. Pages its
        running requests hold, copies in flight and retention claims count
        against the quota but stay until they are released (`unlock`,
        `release`, the request's end; a claim whose time is up, at the next
        call that may evict), and go then. The quota evicts whole nodes, as
        every eviction does, so it may leave the namespace well below its
        limit. A namespace with a quota is never forgotten (see
        `max_namespaces`).
        `quota_usage(namespace)` says where it stands."""
        quotas = self._quotas_of("set_quota")
        Namespaces.check(namespace)
        device, host = quotas.limits(device_tokens, device_bytes, host_tokens, host_bytes)
        if device is None and host is None and self._namespaces.find(namespace) is None:
            return  # no quota to remove: a name never used is not remembered for it
        ns = self._namespaces.id(namespace)
        quotas.set(ns, device, host)
        self._namespaces.pin(ns, ns in quotas.namespaces)
        self._enforce_quotas()

    def quota_usage(self, namespace=None) -> Optional[QuotaUsage]:
        """What `namespace` holds against its quota, in tokens, and what the
        quota has evicted since it was first set (None without a quota)."""
        quotas = self._quotas_of("quota_usage")
        ns = self._namespaces.find(namespace)
        return None if ns is None else quotas.usage(ns)

    def _quotas_of(self, what: str) -> Quotas:
        if self._quotas is None:
            raise TypeError(f"{what} needs the radix cache (type='radix'), not {self.manager!r}")
        return self._quotas

    def _enforce_quotas(self) -> None:
        """Brings every namespace over its quota back within it (what can go)."""
        quotas = self._quotas
        if quotas is None or not quotas.active:
            return
        retention = self._retention
        if retention is not None:
            retention.expire()
            self._claims_ended_seen = retention.ended
        host = self._tiers.host
        quotas.enforce(self._evict_namespace, host.evict_namespace if host is not None else None)

    def _evict_namespace(self, ns: int, size: int) -> torch.Tensor:
        if self._backs_up_on_evict:
            self._tiers.back_up_before_evict(size, ns)
        evicted = self._tree.evict_namespace(ns, size)  # type: ignore[union-attr]
        self._free_evicted(evicted)
        return evicted

    # -- pages ------------------------------------------------------------------

    @property
    def free_pages(self) -> int:
        """Pages neither cached nor held by a request."""
        return self._pages.num_free_pages

    @property
    def available_size(self) -> int:
        """Tokens that `allocate` can serve: free plus evictable."""
        if self._retention is not None:
            self._retention.expire()
        return self._pages.num_free_pages * self.page_size + self.manager.size_info.evictable_size

    @shielded
    def make_room(self, num_tokens: int, namespace=None) -> int:
        """Evict just enough that `allocate(num_tokens)` needs no eviction.

        Returns the tokens evicted (whole cache nodes, so possibly more than
        missing). Raises `radixkv.OutOfCapacityError`, changing nothing, when
        even evicting every unlocked cached page would not make room. With
        `namespace` (the request's), a namespace whose quota the new pages
        would exceed gives up its own least recently used pages first.
        """
        n = as_int(num_tokens, "num_tokens")
        if n < 0:
            raise ValueError(f"num_tokens must be >= 0, got {n}")
        return self._make_room(n, self._namespaces.find(namespace))

    def _make_room(self, n: int, ns: Optional[int] = None) -> int:
        missing, evictable = self._device_room(n)
        if missing <= 0:
            return 0
        if missing > evictable:
            raise _core.OutOfCapacityError(
                f"cannot allocate num_tokens={n} ({-(-n // self.page_size)} pages): "
                f"{self._pages.num_free_pages} pages are free and "
                f"{evictable // self.page_size} evictable"
            )
        freed = 0
        if ns is not None and self._quotas is not None and self._quotas.active:
            # Its own pages past its quota would be trimmed once these are
            # cached: they go now, instead of someone else's.
            pages = -(-n // self.page_size) * self.page_size
            over = quota_excess(self._tree, ns, pages, host=False)  # type: ignore[arg-type]
            if over > 0:
                freed = len(self._evict_namespace(ns, min(over, missing)))
                missing, _ = self._device_room(n)
                if missing <= 0:
                    return freed
        if self._backs_up_on_evict:
            self._tiers.back_up_before_evict(missing)
        evicted = self.manager.evict(missing).cpu()
        self._free_evicted(evicted)
        return freed + evicted.shape[0]

    def _expire_claims(self) -> None:
        """Ends the retention claims whose time is up; when claims ended
        since the quotas were last enforced (here, or wherever their end was
        first seen), the pages they kept past a quota go now, before the
        device evicts anyone else's."""
        retention = self._retention
        if retention is None:
            return
        retention.expire()
        if retention.ended != self._claims_ended_seen:
            self._enforce_quotas()

    def _free_evicted(self, evicted: torch.Tensor) -> None:
        """Device slots the tree evicted (on the host) go back to the pool."""
        self._pages.free(evicted)
        self._evicted += evicted.shape[0]
        if self._events is not None:
            self._events.device_evicted(evicted)

    def _device_room(self, n: int) -> Tuple[int, int]:
        """(missing, evictable): the slots `n` tokens need beyond the free
        pages (whole pages), and the cached slots eviction could free, once
        the backups in flight finished if they pin what is missing (and the
        retention claims whose time is up ended)."""
        self._expire_claims()
        missing = (-(-n // self.page_size) - self._pages.num_free_pages) * self.page_size
        evictable = self.manager.size_info.evictable_size
        if 0 < missing and evictable < missing and self._tiers.backups_in_flight():
            self._tiers.settle_backups()  # nodes being backed up are pinned
            evictable = self.manager.size_info.evictable_size
        return missing, evictable

    @shielded
    def allocate(self, num_tokens: int, namespace=None) -> torch.Tensor:
        """Slots of ceil(num_tokens / page_size) pages, evicting only what is missing.

        Raises `radixkv.OutOfCapacityError`, changing nothing, when even
        evicting every unlocked cached page would not make room. `namespace`
        (the request's, optional): see `make_room`.
        """
        self.make_room(num_tokens, namespace)
        slots = self._pages.allocate(num_tokens)
        self._held_pages += slots.shape[0] // self.page_size
        return slots if self.device.type == "cpu" else slots.to(self.device, non_blocking=True)

    @shielded
    def allocate_batch(self, sizes, *, flat: bool = False):
        """`allocate` of each count of `sizes` (a list or tuple), in order: one
        eviction for the whole batch and one native allocation, split into
        one tensor of whole pages per count (views of one tensor), or with
        `flat` that one tensor (count i's pages after those of the counts
        before it). All or nothing: raises `radixkv.OutOfCapacityError`,
        changing nothing, when even evicting every unlocked cached page
        cannot hold them all."""
        if not isinstance(sizes, (list, tuple)):
            raise TypeError(
                f"sizes must be a list or tuple of token counts, got {type(sizes).__name__}"
            )
        ps = self.page_size
        pages = []
        for i, x in enumerate(sizes):
            n = as_int(x, f"sizes[{i}]")
            if n < 0:
                raise ValueError(f"sizes[{i}] must be >= 0, got {n}")
            pages.append(-(-n // ps))
        total = sum(pages) * ps
        missing, evictable = self._device_room(total)
        if missing > evictable:
            raise _core.OutOfCapacityError(
                f"cannot allocate sizes (together {sum(pages)} pages of {ps}): "
                f"{self._pages.num_free_pages} pages are free and {evictable // ps} evictable"
            )
        self.make_room(total)
        slots = self._pages.allocate(total)
        self._held_pages += slots.shape[0] // ps
        if self.device.type != "cpu":
            slots = slots.to(self.device, non_blocking=True)
        if flat:
            return slots
        return list(torch.split(slots, [p * ps for p in pages]))

    @shielded
    def free(self, indices) -> None:
        """Return pages a request holds (whole pages, not cached ones)."""
        indices = to_host(indices, "indices", self.device)
        if self._tiers.loads_in_flight():
            self._tiers.check_not_loading(int32_tensor(indices, "indices", self.device), "indices")
        self._pages.free(indices, self._tree)
        self._held_pages -= _length(indices) // self.page_size

    # -- finishing requests -----------------------------------------------------

    def _check_request(self, old_handle, input_ids, indices):
        """Checks everything before anything changes.

        Returns (input_ids, indices, n, cached_len) with both sequences as
        CPU int32 tensors.
        """
        ids = int32_tensor(input_ids, "input_ids", self.device)
        idx = int32_tensor(indices, "indices", self.device)
        n, m = ids.shape[0], idx.shape[0]
        whole = -(-n // self.page_size) * self.page_size
        if m != whole:
            raise ValueError(
                f"indices has length {m} but must cover input_ids (length {n}) in whole pages "
                f"of {self.page_size}: expected {whole}"
            )
        if not isinstance(old_handle, BaseCacheHandle):
            raise TypeError(f"old_handle must be a cache handle, got {type(old_handle).__name__}")
        if not self.manager.is_valid(old_handle):
            raise ValueError("old_handle is stale or belongs to another cache manager")
        if getattr(old_handle, "lock_count", 0) < 1:
            raise ValueError("old_handle is not locked: lock it after match_req")
        if self._tiers.loads_in_flight():
            # The request's loads (and any on its path) join the tree before
            # its slots are compared with the tree's.
            self._tiers.settle_loads()
        cached = old_handle.cached_len
        if cached > n:
            raise ValueError(f"old_handle covers {cached} tokens but input_ids has only {n}")
        if cached and not torch.equal(idx[:cached], self._tree.handle_slots(old_handle)):
            # Anything else there would be stored (or freed) as if it were the
            # cache's: a page could end up both free and cached.
            raise ValueError(
                f"indices[:{cached}] must be the cache's slots that match_req "
                "returned with old_handle"
            )
        self._pages.check_owned(idx[cached:], "indices", self._tree)
        return ids, idx, n, cached

    def _write_through(self, input_ids, ns: int) -> None:
        if self._backs_up_on_insert:
            self._tiers.back_up(input_ids, ns)

    def _insert(
        self, old_handle, input_ids, indices, n: int, cached: int, priority: int
    ) -> Tuple[int, int]:
        """Caches a request's whole pages in the namespace of `old_handle`'s
        match (announcing those that are new); returns how many leading tokens
        were cached already, and the namespace."""
        ns = getattr(old_handle, "namespace", 0)
        in_cache = self.manager.insert_prefix(input_ids, indices[:n], priority, ns)
        full = n - n % self.page_size
        if self._events is not None and in_cache < full:
            self._events.device_inserted(input_ids, indices, in_cache, full, cached, ns)
        return in_cache, ns

    @shielded
    def free_and_cache_finished_req(
        self, old_handle: BaseCacheHandle, input_ids, indices, priority: int = 0
    ) -> None:
        """Cache a finished request's tokens and return every page it held.

        Its whole pages not cached yet join the prefix cache; its copies of
        tokens someone else cached meanwhile, and its partial last page, are
        freed; then its lock is released. The tokens are cached in the
        namespace of `old_handle`'s match.
        """
        if self._tree is None:
            input_ids, indices, n, cached = self._check_request(old_handle, input_ids, indices)
            in_cache, ns = self._insert(old_handle, input_ids, indices, n, cached, priority)
            for slots in released_slots(indices, cached, in_cache, n, self.page_size, True):
                self._pages.free(slots)
            self._held_pages -= (indices.shape[0] - cached) // self.page_size
            self.unlock(old_handle)
            return
        ids, indices = self._request_inputs(input_ids, indices)
        if TYPE_CHECKING:  # the tree checks the handle's type itself
            old_handle = cast(RadixCacheHandle, old_handle)
        # One native call checks everything, caches the whole pages, frees
        # the rest and unlocks; it raises, changing nothing, on bad input.
        in_cache = self._tree.finish_request(old_handle, ids, indices, self._pages, priority)
        self._finished(old_handle, ids, indices, in_cache)

    def _request_inputs(self, input_ids, indices):
        """A request's inputs on the host for a native request step, once
        its loads (and any on its path) joined the tree: its slots are
        compared with the tree's."""
        ids = to_host(input_ids, "input_ids", self.device)
        indices = to_host(indices, "indices", self.device)
        if self._tiers.loads_in_flight():
            self._tiers.settle_loads()
        return ids, indices

    @shielded
    def free_and_cache_finished_reqs(self, batch, priority=0) -> None:
        """`free_and_cache_finished_req` of each (old_handle, input_ids,
        indices) of `batch`, in order, in one native call for the radix
        cache. Every request is checked first, and together (no page held by
        two of them, no handle finished more often than it is locked): a bad
        one raises, naming it, and changes nothing. `priority` is one int for
        the whole batch, or a list or tuple of one per request."""
        if not isinstance(batch, (list, tuple)):
            raise TypeError(
                "batch must be a list or tuple of (old_handle, input_ids, indices), got "
                f"{type(batch).__name__}"
            )
        for i, item in enumerate(batch):
            if not isinstance(item, tuple) or len(item) != 3:
                raise TypeError(
                    f"batch[{i}] must be a tuple (old_handle, input_ids, indices), got "
                    f"{type(item).__name__}"
                )
        if self._tree is None:
            self._finish_naive_batch(batch, priority)
            return
        host = []
        for i, (handle, ids, indices) in enumerate(batch):
            host.append(
                (
                    handle,
                    to_host(ids, f"batch[{i}] input_ids", self.device),
                    to_host(indices, f"batch[{i}] indices", self.device),
                )
            )
        if self._tiers.loads_in_flight():
            self._tiers.settle_loads()
        in_cache = self._tree.finish_requests(host, self._pages, priority)
        for (handle, ids, indices), k in zip(host, in_cache):
            self._finished(handle, ids, indices, k)

    @shielded
    def free_and_cache_finished_reqs_flat(
        self, handles, input_ids, indices, priority=0, *, own=None
    ) -> None:
        """`free_and_cache_finished_reqs` with the requests' slots in one
        tensor: request i holds `handles[i]` and `input_ids[i]`, and its
        indices are the next ceil(len(input_ids[i]) / page_size) pages of
        `indices` (the cache's from its match, then its own), which must hold
        exactly all of them: what a scheduler gathers from its
        request-to-token table in one step. With `own`, `indices` holds only
        each request's cached part (`handles[i].cached_len` slots, as
        `match_req_batch(flat=True)` returns them) and `own` the rest (its own
        whole pages, as `allocate_batch(flat=True)` returns them): a prefill
        step's finish without joining them. Checked as the batch call is
        (errors name request i as `request[i]`, its slots by their position
        among its own); raises, changing nothing."""
        for name, value in (("handles", handles), ("input_ids", input_ids)):
            if not isinstance(value, (list, tuple)):
                raise TypeError(f"{name} must be a list or tuple, got {type(value).__name__}")
        if len(input_ids) != len(handles):
            raise ValueError(
                f"input_ids has {len(input_ids)} entries but handles has {len(handles)}"
            )
        if self._tree is None:
            # Checked here: the native call checks them for the radix cache.
            input_ids = [
                int32_tensor(x, f"input_ids[{i}]", self.device) for i, x in enumerate(input_ids)
            ]
            if own is not None:
                indices = self._joined_parts(handles, input_ids, indices, own)
            batch = self._split_flat(input_ids, indices, handles)
            self._finish_naive_batch(batch, priority, "request")
            return
        if self.device.type != "cpu":
            input_ids = [
                to_host(x, f"input_ids[{i}]", self.device) for i, x in enumerate(input_ids)
            ]
            indices = to_host(indices, "indices", self.device)
            own = None if own is None else to_host(own, "own", self.device)
        if self._tiers.loads_in_flight():
            self._tiers.settle_loads()
        # One native call reads (and checks) every input.
        in_cache = self._tree.finish_requests_flat(
            handles, input_ids, indices, self._pages, priority, own
        )
        if self._events is None and not self._backs_up_on_insert:
            cached = 0
            for handle in handles:
                cached += handle.cached_len
            held = _length(indices) + (0 if own is None else _length(own)) - cached
            self._held_pages -= held // self.page_size
            self._enforce_quotas()
            return
        # The per-request tail (KV events, write_through) reads each one's part.
        if own is not None:
            indices = self._joined_parts(handles, input_ids, indices, own)
        for (handle, ids, part), k in zip(self._split_flat(input_ids, indices, handles), in_cache):
            self._finished(handle, ids, part, k)

    def _whole_sizes(self, input_ids) -> List[int]:
        """Each request's slots: its input_ids (checked 1-D inputs) in whole pages."""
        ps = self.page_size
        return [-(-_length(x) // ps) * ps for x in input_ids]

    def _split_flat(self, input_ids, indices, handles) -> list:
        """(handle, input_ids, indices) of each request of a flat batch; the
        length is checked as the native flat finish checks it."""
        sizes = self._whole_sizes(input_ids)
        indices = int32_tensor(indices, "indices", self.device)
        n = _length(indices)
        if n != sum(sizes):
            raise ValueError(
                f"indices has length {n} but the requests' input_ids need {sum(sizes)} slots "
                f"(each in whole pages of {self.page_size})"
            )
        return list(zip(handles, input_ids, torch.split(indices, sizes) if sizes else []))

    def _joined_parts(self, handles, input_ids, cached, own) -> torch.Tensor:
        """The flat indices of requests whose cached parts are `cached` and
        whose own pages are `own` (both back to back), checked as the native
        flat finish checks them."""
        cached = int32_tensor(cached, "indices", self.device)
        own = int32_tensor(own, "own", self.device)
        hits = [
            as_int(getattr(h, "cached_len", 0), f"handles[{i}].cached_len")
            for i, h in enumerate(handles)
        ]
        sizes = self._whole_sizes(input_ids)
        for i, (hit, size) in enumerate(zip(hits, sizes)):
            if not 0 <= hit <= size:
                raise ValueError(
                    f"request[{i}] old_handle covers {hit} tokens but request[{i}] input_ids "
                    f"has only {_length(input_ids[i])}"
                )
        rest = [size - hit for hit, size in zip(hits, sizes)]
        if _length(cached) != sum(hits):
            raise ValueError(
                f"indices has length {_length(cached)} but with own it holds the requests' "
                f"cached parts: {sum(hits)} slots"
            )
        if _length(own) != sum(rest):
            raise ValueError(
                f"own has length {_length(own)} but the requests' input_ids need {sum(rest)} "
                f"more slots than their cached parts (each in whole pages of {self.page_size})"
            )
        parts: list = [None] * (2 * len(handles))
        parts[0::2] = torch.split(cached, hits) if hits else []
        parts[1::2] = torch.split(own, rest) if rest else []
        return self._joined(parts)

    def _finish_naive_batch(self, batch, priority, what: str = "batch") -> None:
        """The naive cache's batch: every request checked (each alone, then
        together: no page held by two, no handle more often than it is
        locked) before any finishes. Errors name request i as `what[i]`."""
        priorities = per_input(priority, len(batch), "priority") or [priority] * len(batch)
        uses: dict = {}
        held: dict = {}  # page -> the request holding it
        ps = self.page_size
        for i, (handle, ids, indices) in enumerate(batch):
            try:
                _, idx, _, cached = self._check_request(handle, ids, indices)
                p = as_int(priorities[i], "priority")
                if not -(2**31) <= p < 2**31:
                    raise ValueError(f"priority must fit int32, got {p}")
            except (TypeError, ValueError) as e:
                raise type(e)(f"{what}[{i}] {e}") from None
            uses[id(handle)] = uses.get(id(handle), 0) + 1
            if uses[id(handle)] > handle.lock_count:
                raise ValueError(
                    f"{what}[{i}] old_handle appears {uses[id(handle)]} times in the batch but "
                    f"holds {handle.lock_count} locks"
                )
            for page in (idx[cached::ps] // ps).tolist():
                j = held.setdefault(page, i)
                if j != i:
                    raise ValueError(
                        f"{what}[{j}] indices and {what}[{i}] indices both hold page {page}"
                    )
        for item, p in zip(batch, priorities):
            self.free_and_cache_finished_req(*item, priority=p)

    def _finished(self, handle, ids, indices, in_cache: int) -> None:
        """The Python side of a request that finish_request ended (its inputs
        were checked there): the pages it held, its KV events and its
        write_through backup."""
        self._held_pages -= (_length(indices) - handle.cached_len) // self.page_size
        self._announce(handle, ids, indices, in_cache)
        self._write_through(ids, handle.namespace)
        self._enforce_quotas()

    def _announce(self, handle, ids, indices, in_cache: int) -> None:
        """The KV events of the pages a request's insert cached (checked
        inputs; `in_cache` tokens were on the device before it)."""
        if self._events is None:
            return
        n = _length(ids)
        full = n - n % self.page_size
        if in_cache < full:  # (the ledger reads the host inputs as they are)
            self._events.device_inserted(
                ids, indices, in_cache, full, handle.cached_len, handle.namespace
            )

    @shielded
    def cache_unfinished_req(
        self, old_handle: BaseCacheHandle, input_ids, indices, priority: int = 0
    ) -> Tuple[BaseCacheHandle, torch.Tensor]:
        """Cache what a running request has computed (chunked prefill).

        Returns the new handle, already locked (the old one is unlocked), and
        the indices the request goes on with: the cache's slots for its cached
        part, then its own slots. Its copies of tokens that were cached
        meanwhile are freed, so it never keeps a slot that was just freed.
        The tokens are cached in the namespace of `old_handle`'s match.
        """
        if self._tree is not None:
            ids, indices = self._request_inputs(input_ids, indices)
            if TYPE_CHECKING:  # the tree checks the handle's type itself
                old_handle = cast(RadixCacheHandle, old_handle)
            # One native call: the checks, the insert, the new match and its
            # lock, the frees and the unlock; it raises, changing nothing.
            handle, new_indices, in_cache = self._tree.cache_request(
                old_handle, ids, indices, self._pages, priority
            )
            self._held_pages -= (handle.cached_len - old_handle.cached_len) // self.page_size
            self._announce(old_handle, ids, indices, in_cache)
            self._write_through(ids, old_handle.namespace)
            self._enforce_quotas()  # (the request's locked pages stay)
            return handle, new_indices.to(self.device, non_blocking=True)
        input_ids, indices, n, cached = self._check_request(old_handle, input_ids, indices)
        in_cache, ns = self._insert(old_handle, input_ids, indices, n, cached, priority)
        new_handle, tree_indices = self.manager.match_prefix(input_ids, ns)
        now_cached = new_handle.cached_len
        self._pages.free(
            released_slots(indices, cached, min(in_cache, now_cached), n, self.page_size, False)[0]
        )
        self.lock(new_handle)
        self.unlock(old_handle)
        self._held_pages -= (now_cached - cached) // self.page_size
        new_indices = torch.cat([tree_indices.cpu(), indices[now_cached:]])
        self._write_through(input_ids, ns)
        return new_handle, new_indices.to(self.device, non_blocking=True)

    # -- the host tier ----------------------------------------------------------

    @shielded
    def writing_check(self) -> int:
        """Applies finished backups: their nodes have host copies from now on
        (a failed one's host pages are freed). Returns how many were applied;
        0 without a host tier. Call once per scheduling round (it publishes
        the round's KV events, as `flush_events()`)."""
        applied = self._tiers.writing_check()
        self._enforce_quotas()
        self.flush_events()
        return applied

    @shielded
    def loading_check(self) -> List[BaseCacheHandle]:
        """Applies finished loads: their nodes are on the device from now on.
        Returns the handles (from `load_back`) whose loads failed since the
        last call (also those found by another call that waited for loads):
        their pages were freed; see `load_back`."""
        failed = self._tiers.loading_check()
        self._enforce_quotas()
        self.flush_events()
        return failed

    def start_loading(self) -> None:
        """Starts the loads queued by `load_back` (`wait_layer` also does)."""
        self._tiers.start_loading()

    def wait_layer(self, layer: int) -> None:
        """Returns once layer `layer` of every load queued so far is in place
        (starting them first). The pool given as `kv_cache` calls it from
        `k_cache(layer)` and `v_cache(layer)`."""
        layer = as_int(layer, "layer")
        if layer < 0:
            raise ValueError(f"layer must be >= 0, got {layer}")
        self._tiers.wait_layer(layer)

    def drain(self) -> List[BaseCacheHandle]:
        """Waits for every copy queued so far and applies them all (backups,
        then loads). Returns the handles of failed loads, as `loading_check`."""
        failed = self._tiers.drain()
        self._enforce_quotas()
        self.flush_events()
        return failed

    # -- the storage tier ----------------------------------------------------------

    @shielded
    def prefetch(self, input_ids, namespace=None):
        """Starts reading from storage the pages of `input_ids[:-1]` beyond
        what the cache holds (device and host), that the store has, into host
        pages; call it when a request arrives. Returns the read in flight (for
        `wait_prefetch`), or None: no storage tier, nothing worth fetching or
        no host room. Changes no LRU time.

        Pages read join the tree under the host copy of the path. When the
        match ends on device pages whose host copies were evicted, and the
        store has pages beyond it, those device pages are copied to host
        again first (a device-to-host copy, waited for: cheaper than reading
        them from storage)."""
        if self._storage is None:
            Namespaces.check(namespace)  # a bad name raises all the same
            return None
        ids = int32_tensor(input_ids, "input_ids", self.device)[:-1]
        return self._tiers.prefetch(ids, self._namespaces.id(namespace))

    def wait_prefetch(self, prefetch) -> int:
        """Waits for a read as `prefetch_policy` says (not at all for
        best_effort, all of it for wait_complete, a bound growing with its
        length for timeout), then applies what arrived: those pages join the
        tree as host-only nodes, and the next `match_req` sees them as host
        hits. Returns the tokens the tree took from it (so far)."""
        if prefetch is not None and not isinstance(prefetch, Prefetch):
            raise TypeError(
                f"prefetch must be what prefetch() returned (or None), got "
                f"{_type_name(prefetch)}"
            )
        if prefetch is None:
            return 0
        inserted = self._tiers.wait_prefetch(prefetch)
        self._enforce_quotas()
        self.flush_events()
        return inserted

    @shielded
    def storage_check(self) -> int:
        """Applies finished writes to storage (their host pages are released)
        and reads (their pages join the tree). Call once per scheduling round."""
        applied = self._tiers.storage_check()
        self._enforce_quotas()
        self.flush_events()
        return applied

    @property
    def storage_counters(self) -> Optional[StorageCounters]:
        return self._tiers.storage_counters()

    def close(self, wait: bool = True) -> None:
        """Stops the storage tier's thread and closes its backend (after
        waiting for what is queued), and publishes the pending KV events (the
        publisher stays open: it is its creator's to close). Bounded whatever
        the storage does: after `StorageFaultPolicy.close_timeout_s` what is
        still queued is dropped and a thread stuck in a backend call is left
        to it (the pages it holds stay out of use).

        `wait=False` is the shutdown after an error or a second Ctrl-C: the
        storage tier's queued writes and prefetches are dropped, its thread
        stops after its current job, and no events are published. The cache
        goes on serving without storage (it is not to be used afterwards
        when the close ends a run)."""
        self._tiers.close(wait)
        if wait:
            self.flush_events()

    # -- KV events --------------------------------------------------------------------

    @property
    def kv_events(self) -> Optional[EventPublisher]:
        """The publisher of this manager's KV events (None: events are off)."""
        return self._events.publisher if self._events is not None else None

    @shielded
    def flush_events(self) -> int:
        """Publishes the KV events since the last call as one batch (none
        when there are none, events are off, or the publisher was closed:
        then they are dropped); returns how many. Call once
        per scheduling round if the engine calls none of `writing_check()`,
        `loading_check()` and `storage_check()`, which do."""
        return self._events.flush() if self._events is not None else 0

    def kv_snapshot(self) -> KVSnapshot:
        """Every block the device and host tiers hold, as one batch of
        BlockStored events in the KV events' wire format (device blocks
        first, each tier's parents before their children), after the
        pending events were published: `seq` is the number of the first
        batch it does not cover, `epoch` the publisher's. A router that lost
        track (a gap, a restart) replaces its state with it and applies the
        batches from `seq` on. Replay clients get the same over the socket
        (`radixkv.event_index`). Raises RuntimeError without kv_events."""
        if self._events is None:
            raise RuntimeError("kv_snapshot needs KV events (CacheManager(kv_events=...))")
        return self._events.snapshot()

    def reset(self) -> None:
        """Drops every cached page of the device and host tiers (what an
        engine's cache flush does); pages held by requests stay theirs, the
        storage tier keeps its pages. Copies in flight are waited for and
        applied first. Raises RuntimeError, dropping nothing, while a request
        holds a lock on cached pages, or while writes or reads of the
        storage tier are still in flight after `close_timeout_s`.

        With KV events: BlockRemoved for every host block, then
        AllBlocksCleared (the device's), published at once.
        """
        storage = self._storage
        self._tiers.settle(storage.faults.close_timeout_s if storage is not None else None)
        self._reset_now()

    @shielded
    def _reset_now(self) -> None:
        retention = self._retention
        if retention is not None and retention.claims:
            locked = self._tree.locked_beyond_claims()  # type: ignore[union-attr]
        else:
            locked = self.manager.size_info.protected_size
        if locked:
            raise RuntimeError(
                f"cannot reset: requests hold locks on {locked} cached tokens "
                "(unlock or finish them first)"
            )
        in_flight = self._tiers.storage_in_flight()
        if in_flight:
            raise RuntimeError(
                f"cannot reset: {in_flight} writes or reads of the storage tier "
                "are still in flight (the store is not answering); their host "
                "pages stay theirs until they end"
            )
        if retention is not None:
            retention.release_all()
        evictable = self.manager.size_info.evictable_size
        if evictable:
            evicted = self.manager.evict(evictable).cpu()
            self._pages.free(evicted)
            self._evicted += len(evicted)
        self._tiers.drop_host_copies()
        if self._tree is not None and self._tree.num_nodes:
            raise _core.IntegrityError(f"reset left {self._tree.num_nodes} nodes in the tree")
        self.manager.reset()
        if self._events is not None:
            self._events.reset()
            self._events.flush()

    @property
    def host_pool(self) -> Optional[HostKVCache]:
        """The host pool the tier copies K/V into (None: no tier or no kv_cache)."""
        return self._tier.pool if self._tier is not None else None

    @property
    def controller(self) -> Optional[_core.CacheController]:
        """The host tier's copy controller (None without a host tier)."""
        return self._tier.controller if self._tier is not None else None

    @property
    def write_policy(self) -> Optional[str]:
        return self._tiers.write_policy

    @property
    def host_size_info(self) -> Optional[HostSizeInfo]:
        """The host tier's slots and tokens (None without a host tier)."""
        return self._tiers.host_size_info()

    @property
    def in_flight(self) -> InFlight:
        """Copies started and not yet applied: backups, loads (and the device
        slots they own) and storage reads and writes (all 0 when idle)."""
        return self._tiers.in_flight()

    @property
    def tier_counters(self) -> Optional[TierCounters]:
        """Tokens the host tier has moved (None without a host tier)."""
        return self._tiers.tier_counters()

    @property
    def metrics(self) -> CacheMetrics:
        """Counters since the manager was made (queries, hits per tier,
        evictions, copies) and the pools' sizes now; `.prometheus()` gives
        them as Prometheus text."""
        tier, storage = self.tier_counters, self.storage_counters
        host = self.host_size_info
        sizes = self.manager.size_info
        host_tier, storage_tier = self._tier, self._storage
        claims = self._retention
        if claims is not None:
            claims.expire()
        return CacheMetrics(
            queries=self._queries,
            query_tokens=self._query_tokens,
            hit_tokens=self._hits,
            device_hit_tokens=self._device_hits,
            host_hit_tokens=self._host_hits,
            storage_hit_tokens=self._storage_hits,
            evicted_tokens=self._evicted,
            backed_up_tokens=tier.backed_up if tier else 0,
            loaded_back_tokens=tier.loaded_back if tier else 0,
            host_evicted_tokens=tier.host_evicted if tier else 0,
            storage_written_pages=storage.written_pages if storage else 0,
            storage_prefetched_tokens=storage.prefetched_tokens if storage else 0,
            storage_errors=storage.errors if storage else 0,
            storage_corrupt_pages=storage.corrupt_pages if storage else 0,
            storage_skipped_reads=storage.skipped_reads if storage else 0,
            storage_skipped_writes=storage.skipped_writes if storage else 0,
            storage_query_timeouts=storage.query_timeouts if storage else 0,
            device_capacity_tokens=self.num_pages * self.page_size,
            device_free_tokens=self._pages.num_free_pages * self.page_size,
            device_cached_tokens=sizes.total_size,
            device_locked_tokens=sizes.protected_size,
            device_held_tokens=self._held_pages * self.page_size,
            device_loading_tokens=self._tiers.loading_tokens(),
            host_capacity_tokens=host.capacity if host else 0,
            host_free_tokens=host.free if host else 0,
            host_cached_tokens=host.cached if host else 0,
            host_only_tokens=host.host_only if host else 0,
            host_backing_up_tokens=host_tier.backup_tokens if host_tier else 0,
            host_reading_tokens=storage_tier.reading_tokens if storage_tier else 0,
            host_storage_writing_tokens=(
                self._tree.tier_sizes().storage_writing if host_tier and self._tree else 0
            ),
            retain_claims_made=claims.made if claims else 0,
            retain_claims_refused=claims.refused if claims else 0,
            retain_claims_expired=claims.expired if claims else 0,
            retain_claims=claims.claims if claims else 0,
            retained_tokens=claims.tree.claimed_size if claims else 0,
        )

    # -- checks -----------------------------------------------------------------

    def check_integrity(self) -> None:
        """Free + cached + held (+ loading) pages == all pages, no page both free
        and cached; with a host tier the same for host pages (see HostTier).

        Valid at any time, with requests in flight. Raises
        `radixkv.IntegrityError` on a violation.
        """
        self.manager.check_integrity()
        cached_tokens = self.manager.size_info.total_size
        if cached_tokens % self.page_size:
            raise _core.IntegrityError(f"{cached_tokens} cached tokens are not whole pages")
        free = self._pages.num_free_pages
        cached = cached_tokens // self.page_size
        loading = self._tiers.loading_tokens() // self.page_size
        if free + cached + self._held_pages + loading != self.num_pages:
            raise _core.IntegrityError(
                f"pages leaked or owned twice: {free} free + {cached} cached + "
                f"{self._held_pages} held by requests + {loading} loading != {self.num_pages}"
            )
        self._pages.check_disjoint(self._tree)
        self._tiers.check_integrity()
        if self._retention is not None:
            self._retention.check()

    @property
    def held_pages(self) -> int:
        """Pages handed to requests and not yet returned or cached."""
        return self._held_pages


def _device_page_bytes(pool: DevicePool) -> int:
    """What a device page costs: its K/V and its side buffers' rows."""
    sides = sum(
        math.prod((pool.num_layers, pool.page_size) + tuple(shape)) * dtype.itemsize
        for _, shape, dtype in pool.side_buffer_specs()
    )
    return pool.nbytes // pool.num_pages + sides


def _flag(value, name: str) -> bool:
    """A bool argument: True or False (numpy's too), nothing else."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {_type_name(value)}")
    return bool(value)


def _type_name(obj) -> str:
    return type(obj).__name__
