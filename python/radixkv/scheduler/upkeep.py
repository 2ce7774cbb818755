"""Room on a CacheManager's device pool, and the hook that follows each step.

The tree evicts; this class decides when and whose pages, for one manager:
room on the device for new pages (the one check that raises
OutOfCapacityError, then a namespace at its quota gives up its own pages
first, write_back backs the victims up first), the pages each eviction frees
(back to the pool, counted, announced as KV events), the namespaces over
their quota, and the retention claims whose time is up.

`after_step` is the hook every step that may change what is cached ends
with: the claims whose time is up end and every namespace over its quota is
trimmed to it (when a quota is set), and, once a scheduling round, the
round's KV events are published. A step never does these by hand.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Iterable, Optional, Tuple, Union

import torch

from radixkv import _core
from radixkv.kvcache.base import BaseCacheHandle, BaseCacheManager
from radixkv.kvcache.engine_pool import DevicePool
from radixkv.scheduler.metrics import Counters
from radixkv.scheduler.quotas import NoQuotas, Quotas
from radixkv.scheduler.retention import NoRetention, Retention
from radixkv.scheduler.tiers import Tiers


class Upkeep:
    """Device room, quotas, claims' expiry and the post-step hook of one
    CacheManager. Without the radix tree `retention` and `quotas` are null
    objects (the naive cache holds nothing to keep or trim). Made by
    `build_upkeep`."""

    def __init__(
        self,
        manager: BaseCacheManager,
        pages: _core.PageAllocator,
        tiers: Tiers,
        counters: Counters,
        page_size: int,
        retention: Union[Retention, NoRetention],
        quotas: Union[Quotas, NoQuotas],
    ) -> None:
        self.manager = manager
        self.tree = manager.tree
        self.pages = pages
        self.tiers = tiers
        self.events = tiers.events
        self.counters = counters
        self.page_size = page_size
        self.retention = retention
        self.quotas = quotas
        self._claims_ended_seen = 0  # retention.ended when the quotas were last enforced

    # -- the hook ---------------------------------------------------------------------

    def after_step(self, publish: bool = False) -> None:
        """What follows a step that may have changed what is cached (a
        request's end, an unlock, copies or reads applied): when a quota is
        set, the claims whose time is up end and every namespace over its
        quota gives up its own least recently used pages (those in use stay
        until released); with `publish` (the per-round calls) the round's KV
        events go out as one batch."""
        quotas = self.quotas
        if quotas.active:
            self.retention.expire()
            self._claims_ended_seen = self.retention.ended
            quotas.enforce(self.evict_namespace, self.tiers.evict_host_namespace)
        if publish and self.events.on:  # (events off: nothing to publish, no shielded call)
            self.publish()

    @_core.shielded
    def publish(self) -> int:
        """Publishes the KV events since the last call as one batch; returns how many."""
        return self.events.flush()

    def expire(self) -> None:
        """Ends the retention claims whose time is up; when claims ended
        since the quotas were last enforced (here, or wherever their end was
        first seen), the pages they kept past a quota go now, before the
        device evicts anyone else's."""
        if self.expiry_idle():
            return
        retention = self.retention
        retention.expire()
        if retention.ended != self._claims_ended_seen:
            self.after_step()

    def expiry_idle(self) -> bool:
        """Whether `expire` would change nothing: no claim has a deadline, and
        no claim that ended since awaits a quota's enforcement."""
        retention = self.retention
        return not retention.timed and (
            retention.ended == self._claims_ended_seen or not self.quotas.active
        )

    def refresh_claims(self, handles: Iterable[BaseCacheHandle]) -> None:
        """Claims that refresh on a hit see the paths of `handles` matched."""
        retention = self.retention
        if retention.refreshing:
            for handle in handles:
                retention.hit(handle)

    # -- room on the device -------------------------------------------------------------

    def room(self, n: int) -> Tuple[int, int]:
        """(missing, evictable): the slots `n` tokens need beyond the free
        pages (whole pages), and the cached slots eviction could free, once
        the backups in flight finished if they pin what is missing (and the
        retention claims whose time is up ended)."""
        self.expire()
        missing = (-(-n // self.page_size) - self.pages.num_free_pages) * self.page_size
        if missing <= 0:  # (the free pages suffice: what is evictable does not matter)
            return missing, 0
        evictable = self.manager.size_info.evictable_size
        if 0 < missing and evictable < missing and self.tiers.backups_in_flight():
            self.tiers.settle_backups()  # nodes being backed up are pinned
            evictable = self.manager.size_info.evictable_size
        return missing, evictable

    def require_room(self, n: int, what: Optional[str] = None) -> int:
        """The one check of room on the device: raises
        `radixkv.OutOfCapacityError` ("cannot {what}: ..."), changing
        nothing, when even evicting every unlocked cached page would not
        make room for `n` tokens; else returns the slots missing. `what`
        names the call (None: an allocation of `n` tokens)."""
        missing, evictable = self.room(n)
        if missing > evictable:
            if what is None:
                what = f"allocate num_tokens={n} ({-(-n // self.page_size)} pages)"
            raise _core.OutOfCapacityError(
                f"cannot {what}: {self.pages.num_free_pages} pages are free and "
                f"{evictable // self.page_size} evictable"
            )
        return missing

    def make_room(self, n: int, ns: Optional[int] = None, what: Optional[str] = None) -> int:
        """Evicts just enough that `n` tokens need no eviction (`what` names
        the call for `require_room`); returns the tokens evicted. A namespace
        `ns` whose quota the new pages would exceed gives up its own least
        recently used pages first."""
        ps = self.page_size
        if -(-n // ps) <= self.pages.num_free_pages and self.expiry_idle():
            return 0  # (what require_room finds then, without its calls)
        missing = self.require_room(n, what)
        if missing <= 0:
            return 0
        freed = 0
        quotas = self.quotas
        if ns is not None and quotas.active:
            # Its own pages past its quota would be trimmed once these are
            # cached: they go now, instead of someone else's.
            over = quotas.device_excess(ns, -(-n // ps) * ps)
            if over > 0:
                freed = len(self.evict_namespace(ns, min(over, missing)))
                missing, _ = self.room(n)
                if missing <= 0:
                    return freed
        if self.tiers.backs_up_on_evict:
            self.tiers.back_up_before_evict(missing)
        if self.tree is not None:  # the radix tree's victims as page ids
            return freed + self.free_evicted(self.tree.evict_pages(missing), pages=True)
        return freed + self.free_evicted(self.manager.evict(missing).cpu())

    def load_making_room(self, handle, copy) -> Tuple[BaseCacheHandle, torch.Tensor]:
        """CacheManager.load_back when device pages must be evicted first:
        the load is begun (its host part pinned) before the eviction, so a
        write_back backup of the victims cannot take the host room the load
        reads. Returns the loaded handle and its pages (on the host; a host
        tier has the radix tree, whose pages are aligned)."""
        n = copy.end - copy.start
        what = f"load {n} tokens back from host"
        self.manager.lock_handle(handle)  # the device part stays while room is made
        try:
            self.require_room(n, what)
            loaded, host_pages, prefix = self.tiers.begin_load(copy)
        finally:
            self.manager.lock_handle(handle, unlock=True)  # (quotas wait for the load)
        try:
            self.make_room(n, handle.namespace, what)
            device_pages = self.pages.allocate_pages(n)
        except BaseException:
            self.tiers.abandon_load(copy, loaded)
            raise
        self.tiers.queue_load(copy, host_pages, device_pages, loaded, pages=True)
        return loaded, torch.cat([prefix, device_pages])

    def evict_namespace(self, ns: int, size: int) -> torch.Tensor:
        """Evicts namespace `ns`'s least recently used device pages (its quota)."""
        if self.tiers.backs_up_on_evict:
            self.tiers.back_up_before_evict(size, ns)
        evicted = self.tree.evict_namespace(ns, size)  # type: ignore[union-attr]
        self.free_evicted(evicted)
        return evicted

    def free_evicted(self, evicted: torch.Tensor, pages: bool = False) -> int:
        """Device slots the tree evicted (on the host; with `pages`, page ids)
        go back to the pool; returns the tokens."""
        (self.pages.free_pages if pages else self.pages.free)(evicted)
        tokens = evicted.shape[0] * (self.page_size if pages else 1)
        self.counters.evicted_tokens += tokens
        self.events.device_evicted(evicted, pages)
        return tokens

    # -- figures and checks ----------------------------------------------------------------

    def device_figures(self, held_pages: int) -> dict:
        """The device pool's part of `CacheMetrics`, requests holding `held_pages`."""
        ps, sizes = self.page_size, self.manager.size_info
        return dict(
            device_capacity_tokens=self.pages.num_pages * ps,
            device_free_tokens=self.pages.num_free_pages * ps,
            device_cached_tokens=sizes.total_size,
            device_locked_tokens=sizes.protected_size,
            device_held_tokens=held_pages * ps,
        )

    def check_pages(self, held_pages: int) -> None:
        """Free + cached + held (`held_pages`) + loading device pages == all
        pages, and no page both free and cached; raises IntegrityError."""
        ps, cached_tokens = self.page_size, self.manager.size_info.total_size
        if cached_tokens % ps:
            raise _core.IntegrityError(f"{cached_tokens} cached tokens are not whole pages")
        free, cached = self.pages.num_free_pages, cached_tokens // ps
        loading, total = self.tiers.loading_tokens() // ps, self.pages.num_pages
        if free + cached + held_pages + loading != total:
            raise _core.IntegrityError(
                f"pages leaked or owned twice: {free} free + {cached} cached + "
                f"{held_pages} held by requests + {loading} loading != {total}"
            )
        self.pages.check_disjoint(self.tree)

    # -- a reset ------------------------------------------------------------------------

    def locked_by_requests(self) -> int:
        """Cached tokens that requests (not retention claims) hold locked."""
        if self.retention.claims:
            return self.tree.locked_beyond_claims()  # type: ignore[union-attr]
        return self.manager.size_info.protected_size

    @_core.shielded
    def reset(self) -> None:
        """CacheManager.reset once the copies in flight were settled: raises
        RuntimeError, dropping nothing, while a request holds a lock on
        cached pages or storage still has writes or reads in flight; else
        ends every claim, evicts every device page and host copy, and
        publishes the reset as one event."""
        locked = self.locked_by_requests()
        if locked:
            raise RuntimeError(
                f"cannot reset: requests hold locks on {locked} cached tokens "
                "(unlock or finish them first)"
            )
        in_flight = self.tiers.storage_in_flight()
        if in_flight:
            raise RuntimeError(
                f"cannot reset: {in_flight} writes or reads of the storage tier "
                "are still in flight (the store is not answering); their host "
                "pages stay theirs until they end"
            )
        self.evict_everything()
        self.tiers.drop_host_copies()
        if self.manager.num_nodes:
            raise _core.IntegrityError(f"reset left {self.manager.num_nodes} nodes in the tree")
        self.manager.reset()
        self.events.reset()
        self.events.flush()

    def evict_everything(self) -> None:
        """Ends every claim and evicts every cached device page (a reset:
        nothing may be locked), unannounced: the reset is one event."""
        self.retention.release_all()
        evictable = self.manager.size_info.evictable_size
        if evictable:
            evicted = self.manager.evict(evictable).cpu()
            self.pages.free(evicted)
            self.counters.evicted_tokens += len(evicted)


def device_page_bytes(pool: DevicePool) -> int:
    """What a device page costs: its K/V and its side buffers' rows."""
    sides = sum(
        math.prod((pool.num_layers, pool.page_size) + tuple(shape)) * dtype.itemsize
        for _, shape, dtype in pool.side_buffer_specs()
    )
    return pool.nbytes // pool.num_pages + sides


def build_upkeep(
    manager: BaseCacheManager,
    pages: _core.PageAllocator,
    tiers: Tiers,
    counters: Counters,
    kv_cache: Optional[DevicePool],
    retain_budget_tokens: Optional[int],
    clock: Optional[Callable[[], float]],
) -> Upkeep:
    """A manager's Upkeep, with retention claims (within
    `retain_budget_tokens`, None: half the device pool, on `clock`) and
    quotas where the prefix cache has a tree."""
    tree, page_size, num_pages = manager.tree, pages.page_size, pages.num_pages
    if tree is None:
        return Upkeep(
            manager, pages, tiers, counters, page_size, NoRetention(manager), NoQuotas(manager)
        )
    budget = num_pages // 2 * page_size if retain_budget_tokens is None else retain_budget_tokens
    retention = Retention(tree, budget, clock or time.monotonic, tiers.host_num_pages > 0)
    tiers.before_host_evict(retention.expire)
    quotas = Quotas(
        tree,
        page_size,
        device_page_bytes(kv_cache) if kv_cache is not None else 0,
        tiers.host_page_bytes,
        tiers.host_num_pages > 0,
    )
    return Upkeep(manager, pages, tiers, counters, page_size, retention, quotas)
