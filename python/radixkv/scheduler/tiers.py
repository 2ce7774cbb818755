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
Without a host tier, storage or events the matching part is None and its
calls do nothing.

The idioms the manager repeats are named here: settling backups (wait for
every copy to host queued so far, then apply them), settling loads, and the
full drain.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from radixkv import _core
from radixkv.events import EventPublisher
from radixkv.kvcache.base import BaseCacheHandle
from radixkv.kvcache.engine_pool import DevicePool
from radixkv.kvcache.page_codec import check_codec, check_codec_dtype
from radixkv.scheduler.block_events import BlockEvents
from radixkv.scheduler.host_tier import (
    WRITE_POLICIES,
    HostSizeInfo,
    HostTier,
    InFlight,
    LayerWait,
    TierCounters,
)
from radixkv.scheduler.namespaces import Namespaces
from radixkv.scheduler.storage_tier import (
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
    CacheManager (each None when off), over the manager's tree and device
    page allocator. Made by `build_tiers`."""

    def __init__(
        self,
        tree: Optional[_core.RadixTree],
        device_pages: _core.PageAllocator,
        events: Optional[BlockEvents],
    ) -> None:
        self.tree = tree
        self.device_pages = device_pages
        self.events = events
        self.host: Optional[HostTier] = None
        self.storage: Optional[StorageTier] = None
        # write_through_selective backs a path up when a match reaches it.
        self.backs_up_on_match = False

    # -- the host tier ------------------------------------------------------------------

    @property
    def write_policy(self) -> Optional[str]:
        return self.host.write_policy if self.host is not None else None

    def backups_in_flight(self) -> int:
        return self.host.backups_in_flight if self.host is not None else 0

    def loads_in_flight(self) -> int:
        return self.host.loads_in_flight if self.host is not None else 0

    def loading_tokens(self) -> int:
        """Device slots owned by loads in flight."""
        return self.host.loading_tokens if self.host is not None else 0

    def in_flight(self) -> InFlight:
        host, storage = self.host, self.storage_in_flight()
        if host is None:
            return InFlight(0, 0, 0, storage)
        return InFlight(
            host.backups_in_flight, host.loads_in_flight, host.loading_tokens, storage
        )

    def back_up(self, tokens: torch.Tensor, ns: int) -> None:
        """Queues the backup of `tokens`' cached path as the write policy says."""
        if self.host is not None:
            self.host.back_up(tokens, ns=ns)

    def back_up_before_evict(self, size: int, ns: Optional[int] = None) -> None:
        """write_back: the device leaves that evicting `size` tokens takes (of
        namespace `ns` only, when given) get their host copies first (waited
        for)."""
        if self.host is not None:
            self._applying_backups(self.host.back_up_before_evict, size, ns)

    def settle_backups(self) -> int:
        """Waits for every backup queued so far and applies them all (what
        landed is written on to storage); returns how many were applied."""
        if self.host is None:
            return 0
        self.host.controller.drain()
        return self.writing_check()

    def writing_check(self) -> int:
        """Applies the backups that finished (what landed is written on to
        storage); returns how many."""
        if self.host is None:
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
            if self.storage is not None:
                self.storage.write_landed()

    def free_loaded(self, slots: torch.Tensor) -> None:
        """Device pages of a load that did not join the tree go back."""
        self.device_pages.free(slots, self.tree)

    def loading_check(self) -> List[BaseCacheHandle]:
        """Applies the loads that finished; returns the handles of those that
        failed since the last call (their pages were freed)."""
        if self.host is None:
            return []
        self.host.loading_check(self.free_loaded)
        return self.host.take_failed_loads()

    def settle_loads(self) -> None:
        """Waits for every load queued so far and applies them (failed ones
        wait for the next `loading_check`)."""
        if self.host is not None:
            self.host.controller.wait_loads()
            self.host.loading_check(self.free_loaded)

    def start_loading(self) -> None:
        if self.host is not None:
            self.host.controller.start_loading()

    def wait_layer(self, layer: int) -> None:
        """Returns once layer `layer` of every load queued so far is in place."""
        host = self.host
        if host is not None:
            # Without a pool the tier's bookkeeping has no layers: any is ready
            # once the loads queued so far are.
            host.controller.wait_layer(layer if host.pool is not None else 0)

    def check_not_loading(self, indices: torch.Tensor, name: str) -> None:
        if self.host is not None and self.host.loads_in_flight:
            self.host.check_not_loading(indices, name)

    def settle(self, storage_limit_s: Optional[float] = None) -> None:
        """Waits for every copy queued so far and applies them all: backups
        (queueing their writes to storage), loads (failed ones wait for the
        next `loading_check`), then storage's writes and reads (at most
        `storage_limit_s`; None: the fault policy's wait limit)."""
        if self.host is None:
            return
        self.settle_backups()
        self.host.loading_check(self.free_loaded)
        if self.storage is not None:
            self.storage.drain(storage_limit_s)

    def drain(self) -> List[BaseCacheHandle]:
        """`settle`, then the handles of the loads that failed."""
        self.settle()
        return self.host.take_failed_loads() if self.host is not None else []

    def drop_host_copies(self) -> None:
        """Evicts every host copy (a reset: nothing may be locked or in flight)."""
        if self.host is not None:
            self.host.drop_all()

    # -- the storage tier ---------------------------------------------------------------

    def prefetch(self, tokens: torch.Tensor, ns: int) -> Optional[Prefetch]:
        if self.storage is None:
            return None
        return self.storage.prefetch(tokens, ns)

    def wait_prefetch(self, op: Prefetch) -> int:
        """Waits for a read as the prefetch policy says, then applies what
        finished; returns the tokens the tree took from it (so far)."""
        if self.storage is None:
            return 0
        self.storage.wait(op)
        self.storage.storage_check()
        return op.inserted

    def storage_check(self) -> int:
        return self.storage.storage_check() if self.storage is not None else 0

    def storage_in_flight(self) -> int:
        return self.storage.in_flight if self.storage is not None else 0

    def close(self, wait: bool) -> None:
        """Stops the storage tier (see CacheManager.close)."""
        storage = self.storage
        if storage is not None:
            if wait:  # backups that land later would queue writes
                self.settle_backups()
            storage.close(storage.wait_closed(wait))

    # -- figures and checks ---------------------------------------------------------------

    def host_size_info(self) -> Optional[HostSizeInfo]:
        return self.host.size_info() if self.host is not None else None

    def tier_counters(self) -> Optional[TierCounters]:
        return self.host.counters() if self.host is not None else None

    def storage_counters(self) -> Optional[StorageCounters]:
        return self.storage.counters() if self.storage is not None else None

    def check_integrity(self) -> None:
        """The host pages and the storage tier's (see HostTier, StorageTier)."""
        if self.host is None:
            return
        reading = 0
        if self.storage is not None:
            self.storage.check_integrity()
            reading = self.storage.reading_tokens
        self.host.check_integrity(self.device_pages, reading)


def check_tier_args(
    radix: bool,
    host_num_pages: int,
    write_policy: str,
    kv_cache: Optional[DevicePool],
    host_layout: str = "page_first",
    host_codec: Optional[str] = None,
) -> None:
    """The host tier's arguments that CacheManager checks before it makes
    anything (its `host_layout` and `kv_cache` checked already)."""
    if check_codec(host_codec) is not None:
        if not host_num_pages or kv_cache is None or host_layout != "page_first":
            raise ValueError(
                f"host_codec={host_codec!r} needs a host tier (host_num_pages > 0) with "
                "kv_cache and host_layout='page_first'"
            )
        check_codec_dtype(host_codec, kv_cache.dtype, f"host_codec={host_codec!r}")
    if host_num_pages and not radix:
        raise ValueError(f"a host tier (host_num_pages={host_num_pages}) needs type='radix'")
    if write_policy not in WRITE_POLICIES:
        raise ValueError(
            f"write_policy must be one of {', '.join(WRITE_POLICIES)}, " f"got {write_policy!r}"
        )
    if host_num_pages and kv_cache is not None and kv_cache.backs_host_tier:
        raise ValueError(
            "kv_cache already backs the host tier of another CacheManager: "
            "its k_cache(layer) waits for that tier's loads"
        )


def build_tiers(
    tree: Optional[_core.RadixTree],
    device_pages: _core.PageAllocator,
    namespaces: Namespaces,
    *,
    page_size: int,
    num_pages: int,
    host_num_pages: int,
    write_policy: str,
    kv_cache: Optional[DevicePool],
    host_layout: str,
    host_codec: Optional[str],
    manual_copies: bool,
    storage: Optional[StorageBackend],
    storage_seed: Optional[bytes],
    prefetch_policy: str,
    min_prefetch_tokens: int,
    storage_faults: Optional[StorageFaultPolicy],
    tp_rank: int,
    kv_events: Optional[EventPublisher],
) -> Tiers:
    """The tiers of a CacheManager, from its arguments (checked by
    check_tier_args); the storage tier's are checked before anything is
    made, and the pool's hook is attached last."""
    seed = None
    if storage is not None:
        if not host_num_pages or kv_cache is None or host_layout != "page_first":
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
        seed = storage_seed_of(storage, storage_seed)
        check_prefetch_policy(prefetch_policy)
    # Blocks hash like the storage tier's page keys, so a page keeps its hash
    # on every medium.
    events = None
    if kv_events is not None:
        events = BlockEvents(
            kv_events, page_size, seed or None, num_pages, host_num_pages, namespaces
        )
    tiers = Tiers(tree, device_pages, events)
    if not host_num_pages:
        return tiers
    if tree is None:  # check_tier_args refused a host tier without one
        raise ValueError(f"a host tier (host_num_pages={host_num_pages}) needs type='radix'")
    tiers.host = HostTier(
        tree,
        page_size,
        host_num_pages,
        write_policy,
        kv_cache,
        host_layout,
        kv_cache.num_layers if kv_cache else 1,
        host_codec,
        bool(manual_copies),
        events=events,
        keep_landed=storage is not None,
    )
    tiers.backs_up_on_match = bool(tiers.host.min_hits)
    if storage is not None:
        # An MLA pool's pages are the same on every tensor-parallel rank:
        # rank 0 writes them, every rank reads.
        if kv_cache is None:  # refused above
            raise ValueError("a storage tier needs a host tier with kv_cache")
        writer = kv_cache.sides == 2 or tp_rank == 0
        tiers.storage = StorageTier(
            tiers.host,
            storage,
            storage_seed,  # (it derives `seed` from it again: a codec is mixed in once)
            namespaces,
            prefetch_policy,
            writer=writer,
            min_prefetch_tokens=min_prefetch_tokens,
            faults=storage_faults,
            events=events,
        )
    if kv_cache is not None:
        kv_cache.attach_layer_wait(LayerWait(tiers.host.controller))
    return tiers
