"""The tiers behind a CacheManager's device pool, and their one owner.

`Tiers` holds the host tier (host pages, the copy controller and the copies
in flight), the storage tier and the ledger of KV events, and is the only
way the manager reaches them. `build_tiers` makes it from the manager's
arguments, handing each part its collaborators when it is made: the ledger
to both tiers, the host tier to the storage tier, the host tier's wait for a
layer to the pool. Calls point one way: the manager calls `Tiers`, which
calls the storage tier and the host tier, and the storage tier calls the
host tier (for room and for host copies of a path), never back: the backups
that landed are handed from the host tier to the storage tier here.

A tier that is off is a null object (`NoHostTier`, `NoStorageTier`, and
`block_events.NoEvents` for the ledger) that answers every call as an empty
tier would, so neither `Tiers` nor the manager asks which tiers exist.

The idioms the manager repeats are named here: settling backups (wait for
every copy to host queued so far, then apply them), settling loads, and the
full drain.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple, Union

import torch

from radixkv import _core
from radixkv._checks import as_count
from radixkv.events import EventPublisher
from radixkv.kvcache.base import BaseCacheHandle
from radixkv.kvcache import EngineKVPool, MHAKVCache, MLAKVCache
from radixkv.kvcache.engine_pool import DevicePool
from radixkv.kvcache.host_pool import HOST_LAYOUTS
from radixkv.kvcache.pool_args import resolve_tp_rank
from radixkv.kvcache.page_codec import check_codec, check_codec_dtype
from radixkv.scheduler.block_events import BlockEvents, Events, NoEvents
from radixkv.scheduler.host_tier import (
    WRITE_POLICIES,
    HostSizeInfo,
    HostTier,
    InFlight,
    LayerWait,
    NoHostTier,
    TierCounters,
)
from radixkv.scheduler.namespaces import Namespaces
from radixkv.scheduler.storage_tier import (
    NoStorageTier,
    Prefetch,
    StorageCounters,
    StorageFaultPolicy,
    StorageTier,
    check_prefetch_policy,
    storage_seed_of,
)
from radixkv.storage.base import StorageBackend


class Tiers:
    """The host tier, the storage tier and the KV-event ledger of one
    CacheManager (each a null object when off), over the manager's tree
    and device page allocator. Made by `build_tiers`."""

    def __init__(
        self,
        tree: Optional[_core.RadixTree],
        device_pages: _core.PageAllocator,
        events: Events,
        host: Union[HostTier, NoHostTier],
        storage: Union[StorageTier, NoStorageTier],
    ) -> None:
        self.tree = tree
        self.device_pages = device_pages
        self.events = events
        self.host = host
        self.storage = storage
        # write_through_selective backs a path up when a match reaches it.
        self.backs_up_on_match = bool(host.min_hits)
        self.backs_up_on_insert = host.write_policy == "write_through"
        self.backs_up_on_evict = host.write_policy == "write_back"

    # -- the host tier ------------------------------------------------------------------

    @property
    def write_policy(self) -> Optional[str]:
        return self.host.write_policy

    @property
    def host_pool(self):
        """The host pool the copies fill (None: no host tier, or bookkeeping only)."""
        return self.host.pool

    @property
    def controller(self) -> Optional[_core.CacheController]:
        return self.host.controller

    @property
    def host_num_pages(self) -> int:
        return self.host.num_pages

    @property
    def host_page_bytes(self) -> int:
        return self.host.page_bytes

    def before_host_evict(self, fn) -> None:
        """`fn()` runs before host copies are evicted (the retention claims'
        expiry: a claim may keep host copies)."""
        self.host.before_evict = fn

    def backups_in_flight(self) -> int:
        return self.host.backups_in_flight

    def loads_in_flight(self) -> int:
        return self.host.loads_in_flight

    def loading_tokens(self) -> int:
        """Device slots owned by loads in flight."""
        return self.host.loading_tokens

    def in_flight(self) -> InFlight:
        host = self.host
        return InFlight(
            host.backups_in_flight,
            host.loads_in_flight,
            host.loading_tokens,
            self.storage.in_flight,
        )

    def back_up(self, tokens: torch.Tensor, ns: int) -> None:
        """Queues the backup of `tokens`' cached path as the write policy says."""
        self.host.back_up(tokens, ns=ns)

    def back_up_before_evict(self, size: int, ns: Optional[int] = None) -> None:
        """write_back: the device leaves that evicting `size` tokens takes (of
        namespace `ns` only, when given) get their host copies first (waited
        for)."""
        self._applying_backups(self.host.back_up_before_evict, size, ns)

    def settle_backups(self) -> int:
        """Waits for every backup queued so far and applies them all (what
        landed is written on to storage); returns how many were applied."""
        self.host.wait_copies()
        return self.writing_check()

    def writing_check(self) -> int:
        """Applies the backups that finished (what landed is written on to
        storage); returns how many. None in flight: nothing to apply (a
        round's check costs no shielded call then)."""
        if not self.host.backups_in_flight:
            return 0
        return self._applying_backups(self.host.writing_check)

    @_core.shielded
    def _applying_backups(self, fn, *args):
        """`fn(*args)`, a host-tier call that may apply backups, then the
        storage tier's writes of what landed, as one step: Ctrl-C waits
        until both are done, and an error in the first still leaves the
        writes queued (their host copies are pinned from then on)."""
        try:
            return fn(*args)
        finally:
            self.storage.write_landed()

    def evict_host_namespace(self, ns: int, size: int) -> torch.Tensor:
        """Drops namespace `ns`'s least recently used host copies (its quota)."""
        return self.host.evict_namespace(ns, size)

    def free_loaded(self, slots: torch.Tensor) -> None:
        """Device pages of a load that did not join the tree go back."""
        self.device_pages.free(slots, self.tree)

    def start_load(self, handle: BaseCacheHandle):
        """The host tier's `start_load` of `handle`'s host part."""
        return self.host.start_load(handle, self.device_pages)

    def begin_load(self, copy) -> Tuple[BaseCacheHandle, torch.Tensor, torch.Tensor]:
        return self.host.begin_load(copy)

    def abandon_load(self, copy, loaded: BaseCacheHandle) -> None:
        self.host.abandon_load(copy, loaded)

    def queue_load(
        self, copy, host_slots, device_slots, loaded: BaseCacheHandle, pages: bool = False
    ) -> None:
        """Hands a begun load to the host tier (with `pages` its host and
        device pages as ids); if that fails, the load is undone
        (`abandon_load`, and the device pages go back) and the error stands."""
        try:
            self.host.queue_load(copy, host_slots, device_slots, loaded, pages)
        except BaseException:
            self.abandon_load(copy, loaded)
            if pages:
                self.device_pages.free_pages(device_slots)
            else:
                self.device_pages.free(device_slots)
            raise

    def loading_check(self) -> List[BaseCacheHandle]:
        """Applies the loads that finished; returns the handles of those that
        failed since the last call (their pages were freed)."""
        self._apply_loads()
        return self.host.take_failed_loads()

    def _apply_loads(self) -> None:
        """The host tier's loading check, when a load is in flight (none: no
        ack can be waiting, and the round's check costs no shielded call)."""
        if self.host.loads_in_flight:
            self.host.loading_check(self.free_loaded)

    def settle_loads(self) -> None:
        """Waits for every load queued so far and applies them (failed ones
        wait for the next `loading_check`)."""
        self.host.wait_loads()
        self._apply_loads()

    def start_loading(self) -> None:
        self.host.start_loading()

    def wait_layer(self, layer: int) -> None:
        """Returns once layer `layer` of every load queued so far is in place."""
        self.host.wait_layer(layer)

    def check_not_loading(self, indices: torch.Tensor, name: str) -> None:
        self.host.check_not_loading(indices, name)

    def settle(self, close_bound: bool = False) -> None:
        """Waits for every copy queued so far and applies them all: backups
        (queueing their writes to storage), loads (failed ones wait for the
        next `loading_check`), then storage's writes and reads (at most the
        fault policy's wait limit, or with `close_bound` its close timeout)."""
        self.settle_backups()
        self._apply_loads()
        self.storage.drain(self.storage.close_timeout_s if close_bound else None)

    def drain(self) -> List[BaseCacheHandle]:
        """`settle`, then the handles of the loads that failed."""
        self.settle()
        return self.host.take_failed_loads()

    def drop_host_copies(self) -> None:
        """Evicts every host copy (a reset: nothing may be locked or in flight)."""
        self.host.drop_all()

    # -- the storage tier ---------------------------------------------------------------

    def prefetch(self, tokens: torch.Tensor, namespace) -> Optional[Prefetch]:
        """Starts a read from storage of `tokens`' pages beyond the cache (in
        the namespace named `namespace`, remembered only where there is a
        store); None when there is nothing to read."""
        return self.storage.prefetch(tokens, namespace)

    def wait_prefetch(self, op: Prefetch) -> int:
        """Waits for a read as the prefetch policy says, then applies what
        finished; returns the tokens the tree took from it (so far)."""
        if not isinstance(op, Prefetch):
            raise TypeError(
                f"prefetch must be what prefetch() returned (or None), got {type(op).__name__}"
            )
        self.storage.wait(op)
        self.storage.storage_check()
        return op.inserted

    def storage_check(self) -> int:
        return self.storage.storage_check()

    def storage_in_flight(self) -> int:
        return self.storage.in_flight

    def storage_hit_len(self, handle: BaseCacheHandle) -> int:
        """Of `handle`'s host part, the tokens read from storage and not on
        the device since."""
        return self.storage.hit_len(handle)

    def close(self, wait: bool) -> None:
        """Stops the storage tier (see CacheManager.close); with `wait` the
        backups in flight land first, their writes queued (one landing later
        would queue a write)."""
        self.storage.shut_down(wait, self.settle_backups)

    # -- figures and checks ---------------------------------------------------------------

    def host_size_info(self) -> Optional[HostSizeInfo]:
        return self.host.size_info()

    def tier_counters(self) -> Optional[TierCounters]:
        return self.host.counters()

    def storage_counters(self) -> Optional[StorageCounters]:
        return self.storage.counters()

    def figures(self) -> dict:
        """The tiers' part of `CacheMetrics` (none of a tier that is off)."""
        return {**self.host.figures(), **self.storage.figures()}

    def check_integrity(self) -> None:
        """The host pages and the storage tier's (see HostTier, StorageTier)."""
        self.storage.check_integrity()
        self.host.check_integrity(self.device_pages, self.storage.reading_tokens)


class TierArgs(NamedTuple):
    """CacheManager's arguments of the tiers and the event ledger, checked
    (`check_tier_args`); docs/api.md gives each."""

    host_num_pages: int
    write_policy: str
    kv_cache: Optional[DevicePool]
    host_layout: str
    host_codec: Optional[str]
    manual_copies: bool
    storage: Optional[StorageBackend]
    storage_seed: Optional[bytes]
    prefetch_policy: str
    min_prefetch_tokens: int
    storage_faults: Optional[StorageFaultPolicy]
    tp_rank: Optional[int]
    kv_events: Optional[EventPublisher]


def check_tier_args(radix: bool, num_pages: int, page_size: int, **given) -> TierArgs:
    """The tiers' arguments (`TierArgs`' fields) that CacheManager checks
    before it makes anything, for a prefix cache that is the radix tree's
    (`radix`) and a device pool of `num_pages` pages of `page_size`; the
    counts and the rank normalised."""
    args = TierArgs(**given)
    kv_events, kv_cache, faults = args.kv_events, args.kv_cache, args.storage_faults
    if kv_events is not None and not isinstance(kv_events, EventPublisher):
        raise TypeError(
            "kv_events must be a radixkv.events.EventPublisher (or None), got "
            f"{type(kv_events).__name__}"
        )
    host_num_pages = as_count(args.host_num_pages, "host_num_pages", minimum=0)
    min_prefetch = as_count(args.min_prefetch_tokens, "min_prefetch_tokens", minimum=0)
    if faults is not None and not isinstance(faults, StorageFaultPolicy):
        raise TypeError(
            f"storage_faults must be a StorageFaultPolicy (or None), got {type(faults).__name__}"
        )
    args = args._replace(
        host_num_pages=host_num_pages,
        min_prefetch_tokens=min_prefetch,
        tp_rank=resolve_tp_rank(args.tp_rank),
    )
    host_layout, host_codec = args.host_layout, args.host_codec
    if host_layout not in HOST_LAYOUTS:
        raise ValueError(
            f"host_layout must be one of {', '.join(HOST_LAYOUTS)}, got {host_layout!r}"
        )
    if kv_cache is not None:
        if not isinstance(kv_cache, (MHAKVCache, MLAKVCache, EngineKVPool)):
            raise TypeError(
                "kv_cache must be an MHAKVCache, an MLAKVCache or an EngineKVPool, got "
                f"{type(kv_cache).__name__}"
            )
        if kv_cache.page_size != page_size or kv_cache.num_pages < num_pages:
            raise ValueError(
                f"kv_cache must have page_size={page_size} and at least num_pages={num_pages} "
                f"pages, got page_size={kv_cache.page_size} and {kv_cache.num_pages} pages"
            )
    if check_codec(host_codec) is not None:
        if not host_num_pages or kv_cache is None or host_layout != "page_first":
            raise ValueError(
                f"host_codec={host_codec!r} needs a host tier (host_num_pages > 0) with "
                "kv_cache and host_layout='page_first'"
            )
        check_codec_dtype(host_codec, kv_cache.dtype, f"host_codec={host_codec!r}")
    if host_num_pages and not radix:
        raise ValueError(f"a host tier (host_num_pages={host_num_pages}) needs type='radix'")
    if args.write_policy not in WRITE_POLICIES:
        raise ValueError(
            f"write_policy must be one of {', '.join(WRITE_POLICIES)}, got {args.write_policy!r}"
        )
    if host_num_pages and kv_cache is not None and kv_cache.backs_host_tier:
        raise ValueError(
            "kv_cache already backs the host tier of another CacheManager: "
            "its k_cache(layer) waits for that tier's loads"
        )
    return args


def build_tiers(
    tree: Optional[_core.RadixTree],
    device_pages: _core.PageAllocator,
    namespaces: Namespaces,
    args: TierArgs,
) -> Tiers:
    """The tiers of a CacheManager over its device pages, from its
    arguments (checked by check_tier_args); the storage tier's are checked
    before anything is made, and the pool's hook is attached last."""
    page_size, num_pages = device_pages.page_size, device_pages.num_pages
    host_num_pages, kv_cache, storage = args.host_num_pages, args.kv_cache, args.storage
    host_codec = args.host_codec
    seed = None
    if storage is not None:
        if not host_num_pages or kv_cache is None or args.host_layout != "page_first":
            raise ValueError(
                "a storage tier needs a host tier (host_num_pages > 0) with "
                "kv_cache and host_layout='page_first'"
            )
        if host_codec is not None and storage.codec != host_codec:
            raise ValueError(
                f"host_codec={host_codec!r}: the storage backend must take the same codec "
                f"(its pages are stored as the host holds them), got codec={storage.codec!r}"
            )
        if storage.codec is not None and host_codec is None and not storage.encodes_pages:
            raise ValueError(
                f"{type(storage).__name__} moves pages as the host pool holds them: "
                f"with its codec={storage.codec!r} give host_codec={storage.codec!r}"
            )
        seed = storage_seed_of(storage, args.storage_seed)
        check_prefetch_policy(args.prefetch_policy)
    # Blocks hash like the storage tier's page keys, so a page keeps its hash
    # on every medium.
    events: Events = NoEvents()
    if args.kv_events is not None:
        events = BlockEvents(
            args.kv_events, page_size, seed or None, num_pages, host_num_pages, namespaces
        )
    if not host_num_pages or tree is None:  # (check_tier_args refused a host tier without one)
        return Tiers(tree, device_pages, events, NoHostTier(), NoStorageTier())
    host = HostTier(
        tree,
        page_size,
        host_num_pages,
        args.write_policy,
        kv_cache,
        args.host_layout,
        kv_cache.num_layers if kv_cache else 1,
        host_codec,
        bool(args.manual_copies),
        events=events,
        keep_landed=storage is not None,
    )
    store: Union[StorageTier, NoStorageTier] = NoStorageTier()
    if storage is not None and kv_cache is not None:  # (kv_cache: checked above)
        # An MLA pool's pages are the same on every tensor-parallel rank:
        # rank 0 writes them, every rank reads.
        store = StorageTier(
            host,
            storage,
            args.storage_seed,  # (it derives `seed` from it again: a codec is mixed in once)
            namespaces,
            args.prefetch_policy,
            writer=kv_cache.sides == 2 or args.tp_rank == 0,
            min_prefetch_tokens=args.min_prefetch_tokens,
            faults=args.storage_faults,
            events=events,
        )
    if kv_cache is not None:
        kv_cache.attach_layer_wait(LayerWait(host.controller))
    return Tiers(tree, device_pages, events, host, store)
