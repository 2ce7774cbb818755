"""The host tier of a CacheManager: host pages, the copy controller, and the
copies in flight between the device pool and the host pool."""

from __future__ import annotations

import weakref
from collections import deque
from typing import Callable, Deque, Dict, List, NamedTuple, Optional, Tuple

import torch

from radixkv import _core
from radixkv.kvcache.base import BaseCacheHandle
from radixkv.kvcache.host_pool import HostKVCache, copy_controller
from radixkv.kvcache.page_ids import slots_of_pages
from radixkv.kvcache.engine_pool import DevicePool
from radixkv.scheduler.block_events import Events, NoEvents
from radixkv.scheduler.quotas import quota_excess

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
"""When a node gets a host copy: when it is inserted (`write_through`), when it
is matched for the second time (`write_through_selective`), or when it is
evicted from the device (`write_back`)."""

# write_through_selective backs a node up once this many matches reached it.
SELECTIVE_MIN_HITS = 2

# A copy between the tiers, from the tree: (node_id, incarnation, start, end).
Copy = _core.TierCopy


class HostSizeInfo(NamedTuple):
    """The host tier in tokens."""

    capacity: int  # the host pool's slots
    free: int  # host slots in no node and no copy
    cached: int  # tokens with a host copy (host only or mirrored)
    host_only: int  # of those, tokens not on the device
    backing_up: int  # tokens whose backup to host is in flight
    loading: int  # tokens whose load from host is in flight


class TierCounters(NamedTuple):
    """What the tier has moved since it was created, in tokens."""

    backed_up: int  # backups acknowledged and taken by the tree
    loaded_back: int  # loads acknowledged and taken by the tree
    host_evicted: int  # host copies dropped to make room
    backups_skipped: int  # backups not started: the host pool had no room
    failed_copies: int  # copies that reported failure


class InFlight(NamedTuple):
    """Copies a CacheManager started and has not yet applied."""

    backups: int  # device-to-host copies
    loads: int  # host-to-device copies
    loading_tokens: int  # device slots those loads own
    storage: int  # writes to and reads from the storage tier


class LayerWait:
    """The device pool's hook (`attach_layer_wait`): `k_cache(i)` and
    `v_cache(i)` wait for layer i of the tier's loads. It holds the controller
    weakly, so a discarded CacheManager does not keep its controller, thread
    and host pool alive through the pool it used."""

    __slots__ = ("_controller",)

    def __init__(self, controller) -> None:
        self._controller = weakref.ref(controller)

    @property
    def alive(self) -> bool:
        return self._controller() is not None

    def __call__(self, layer: int) -> None:
        controller = self._controller()
        if controller is not None:
            controller.wait_layer(layer)


class HostTier:
    """Host pages and the copies between the tiers, for one CacheManager.

    The tree holds each node's tier state; the controller (C++) runs the
    copies on its thread and leaves acknowledgements; this class starts copies
    (find, begin, queue) and applies acknowledgements to the tree (finish),
    owning meanwhile the slots each copy uses. Pages in flight are owned by
    exactly one copy: a backup's host pages, a load's device pages.
    """

    def __init__(
        self,
        tree: _core.RadixTree,
        page_size: int,
        host_num_pages: int,
        write_policy: str,
        kv_cache: Optional[DevicePool],
        host_layout: str,
        num_layers: int,
        codec: Optional[str],
        manual: bool,
        *,
        events: Optional[Events] = None,
        keep_landed: bool = False,
    ) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(
                f"write_policy must be one of {', '.join(WRITE_POLICIES)}, " f"got {write_policy!r}"
            )
        self.tree = tree
        self.page_size = page_size
        self.write_policy = write_policy
        self.min_hits = SELECTIVE_MIN_HITS if write_policy == "write_through_selective" else 0
        self.pages = _core.PageAllocator(host_num_pages, page_size)
        self.num_pages = host_num_pages
        if kv_cache is not None:
            self.pool: Optional[HostKVCache] = HostKVCache(
                kv_cache, host_num_pages, layout=host_layout, codec=codec
            )
            self.controller = copy_controller(kv_cache, self.pool, manual)
        else:
            # Bookkeeping only (capacity planning): copies succeed at once.
            self.pool = None
            self.controller = _core.CacheController(num_layers, manual)
        # op -> (copy, host, device, pages): `pages` when host and device are
        # page ids (a backup of back_up), else slots.
        self._backups: Dict[int, Tuple[Copy, torch.Tensor, torch.Tensor, bool]] = {}
        # op -> (copy, device, handle, host, pages): `pages` when device and
        # host are page ids (a load of start_load), else slots.
        self._loads: Dict[int, Tuple[Copy, torch.Tensor, BaseCacheHandle, torch.Tensor, bool]] = {}
        self._backup_tokens = 0  # host slots owned by backups in flight
        self._load_tokens = 0  # device slots owned by loads in flight
        self._failed_loads: List[BaseCacheHandle] = []  # handles, until the scheduler takes them
        # Acknowledgements taken from the controller and not yet applied: an
        # exception while one is applied leaves the rest for the next call.
        self._backup_acks: Deque[Tuple[int, bool]] = deque()
        self._load_acks: Deque[Tuple[int, bool]] = deque()
        # With keep_landed: each finished backup's copy that gave nodes host
        # copies, oldest first, until the tiers' owner takes it (to write it
        # on to storage).
        self._keep_landed = keep_landed
        self.landed: Deque[Copy] = deque()
        # The manager's BlockEvents (NoEvents when KV events are off): told of
        # every page that lands on or leaves either tier through this class.
        self.events: Events = events if events is not None else NoEvents()
        # Called before host copies are evicted (the manager's expiry of
        # retention claims, which may keep host copies).
        self.before_evict: Optional[Callable[[], object]] = None
        self.backed_up = self.loaded_back = self.host_evicted = 0
        self.backups_skipped = self.failed_copies = 0

    # -- backups ------------------------------------------------------------------

    def back_up(
        self, input_ids, min_hits: Optional[int] = None, through_partial: bool = False, ns: int = 0
    ) -> int:
        """Queues the backup of `input_ids`' cached path (in namespace `ns`)
        from where its host copy ends. Returns the tokens queued (0 when nothing needs a copy, or
        the host pool cannot make room: the path stays device only)."""
        min_hits = self.min_hits if min_hits is None else min_hits
        # One native call finds the range, takes its host pages and pins it
        # (page ids cross, not slots).
        start = self.tree.start_backup_pages
        started = start(input_ids, self.pages, min_hits, through_partial, ns)
        if started is None:
            return 0
        copy, device_slots, host_slots = started
        if device_slots is None or host_slots is None:  # too few free host pages
            n = copy.end - copy.start
            if self.free_host_slots(n, ns, all_or_nothing=True) < n:
                self.backups_skipped += n
                return 0
            # Making room may have dropped the host copy the range started under.
            started = start(input_ids, self.pages, min_hits, through_partial, ns)
            if started is None:
                return 0
            copy, device_slots, host_slots = started
            if device_slots is None or host_slots is None:
                self.backups_skipped += copy.end - copy.start
                return 0
        return self._queue_backup(copy, device_slots, host_slots, pages=True)

    def copy_path_to_host(self, tokens, ns: int = 0) -> bool:
        """Makes the host copy of `tokens`' cached path again where it was
        evicted (the device still has it), and waits for it: pages read from
        storage join the tree under it. Returns whether the path is host
        backed to its end."""
        if self.back_up(tokens, 0, through_partial=True, ns=ns):
            self.settle_backups()
        return self.tree.storage_prefix_end(tokens, ns)[1]

    def back_up_before_evict(self, size: int, ns: Optional[int] = None) -> int:
        """write_back: backs up, and waits for, the device leaves without a host
        copy that evicting `size` tokens would take (of namespace `ns` only,
        when given: a quota's eviction). Returns the tokens copied."""
        queued = 0
        pending: Dict[Optional[int], int] = {}  # tokens queued per namespace, not landed
        for copy in self.tree.eviction_candidates_without_host(size, ns):
            n = copy.end - copy.start
            # The victim's namespace makes room from its own copies first.
            owner = ns if ns is not None else self.tree.copy_namespace(copy)
            room = self.free_host_slots(
                n, owner, all_or_nothing=True, pending=pending.get(owner, 0)
            )
            if room < n:
                self.backups_skipped += n
                continue
            try:
                started = self._start_backup(copy)
                queued += started
                pending[owner] = pending.get(owner, 0) + started
            except ValueError:
                # Making room dropped the host copy this range starts under:
                # the node is evicted without one.
                self.backups_skipped += n
        if queued:
            self.settle_backups()
        return queued

    def free_host_slots(
        self, n: int, ns: Optional[int] = None, *, all_or_nothing: bool, pending: int = 0
    ) -> int:
        """Makes `n` host slots free for pages of namespace `ns` by evicting
        host copies, least recently used first, its own first when they
        would take it past its host quota (`_own_first`; `pending`: its
        tokens queued and not landed). Returns the host slots free then.

        `all_or_nothing` (a backup's room): evicts only if all `n` can be
        freed, and nothing of another namespace when the copy would still
        take `ns` past its quota (it would be dropped again at once; then 0).
        Otherwise (a prefetch's room) frees what it can: after a failed
        eviction, half as much, and so on."""
        over = self._own_first(n, ns, pending)
        if all_or_nothing and over > 0:
            return 0
        missing = n - self.pages.num_free_pages * self.page_size
        if all_or_nothing:
            if missing > 0:
                self._evict(missing)
        else:
            while missing > 0 and not self._evict(missing):
                missing //= 2
                missing -= missing % self.page_size
        return self.pages.num_free_pages * self.page_size

    def _own_first(self, n: int, ns: Optional[int], pending: int = 0) -> int:
        """When `n` more host tokens of namespace `ns` (beside `pending` ones
        queued) would take it past its host quota, drops its own least
        recently used copies by as much, so a namespace at its quota never
        pushes out another's copies only to have its own trimmed a moment
        later. Returns by how much it would still be over (0 within)."""
        if ns is None:
            return 0
        over = quota_excess(self.tree, ns, n + pending, host=True)
        if over <= 0:
            return 0
        self.evict_namespace(ns, over)
        return max(0, quota_excess(self.tree, ns, n + pending, host=True))

    def _evict(self, size: int) -> bool:
        """Drops host copies of at least `size` tokens (least recently used
        first) and frees their pages; False, dropping none, if it cannot."""
        if self.before_evict is not None:
            self.before_evict()
        try:
            freed = self.tree.evict_host_pages(size)
        except _core.OutOfCapacityError:
            return False
        self._free_evicted(freed, pages=True)
        return True

    def evict_namespace(self, ns: int, size: int) -> torch.Tensor:
        """Drops namespace `ns`'s least recently used host copies until `size`
        tokens are freed or none of it can go (its quota's eviction); returns
        the host slots freed."""
        if self.before_evict is not None:
            self.before_evict()
        freed = self.tree.evict_host_namespace(ns, size)
        self._free_evicted(freed)
        return freed

    def _free_evicted(self, freed: torch.Tensor, pages: bool = False) -> None:
        """Host slots (or with `pages` page ids) the tree evicted go back."""
        (self.pages.free_pages if pages else self.pages.free)(freed, self.tree, True)
        self.host_evicted += freed.shape[0] * (self.page_size if pages else 1)
        self.events.host_evicted(freed, pages)

    def drop_all(self) -> None:
        """Drops every host copy, for a reset (nothing may be locked or in
        flight: OutOfCapacityError, dropping none, if a copy cannot go). Not
        announced block by block: the reset is one event."""
        size = self.tree.tier_sizes().host
        if size:
            freed = self.tree.evict_host(size)
            self.pages.free(freed, self.tree, True)
            self.host_evicted += len(freed)

    def _start_backup(self, copy: Copy) -> int:
        n = copy.end - copy.start
        if n > self.pages.num_free_pages * self.page_size:
            self.backups_skipped += n
            return 0
        host_slots = self.pages.allocate(n)
        try:
            device_slots = self.tree.begin_backup(copy)
        except BaseException:
            self.pages.free(host_slots, self.tree, True)
            raise
        return self._queue_backup(copy, device_slots, host_slots)

    def _queue_backup(
        self, copy: Copy, device_slots: torch.Tensor, host_slots: torch.Tensor, pages: bool = False
    ) -> int:
        """Hands a begun backup to the controller and owns its slots (with
        `pages`, page ids) until `writing_check` applies it."""
        try:
            op = self.controller.backup(device_slots, host_slots, self.page_size if pages else 1)
        except BaseException:  # (a pool moved since the controller was made)
            finish = self.tree.finish_backup_pages if pages else self.tree.finish_backup
            finish(copy, host_slots, False, self.pages)
            raise
        n = copy.end - copy.start
        self._backups[op] = (copy, host_slots, device_slots, pages)
        self._backup_tokens += n
        return n

    def settle_backups(self) -> int:
        """Waits for every backup queued so far and applies them all
        (`writing_check`); returns how many were applied."""
        self.controller.drain()
        return self.writing_check()

    @_core.shielded
    def writing_check(self) -> int:
        """Applies finished backups to the tree: the nodes take their host
        copies (or, for a failed copy, the host pages go back). Returns the
        backups applied."""
        acks = self._backup_acks
        acks.extend(self.controller.take_backup_acks())
        applied = len(acks)
        ps, events = self.page_size, self.events
        while acks:
            op, ok = acks.popleft()
            copy, host, device, pages = self._backups.pop(op)
            # The tree takes the pages; those it does not go back to the pool.
            if pages:
                rejected = self.tree.finish_backup_pages(copy, host, ok, self.pages)
            else:
                rejected = self.tree.finish_backup(copy, host, ok, self.pages)
            unit = ps if pages else 1
            n, refused = host.shape[0] * unit, rejected.shape[0] * unit
            if refused < n:
                events.host_backed_up(device, host, rejected, pages)
            self._backup_tokens -= n
            self.backed_up += n - refused
            self.failed_copies += 0 if ok else n
            if self._keep_landed and refused < n:
                self.landed.append(copy)
        return applied

    # -- loads --------------------------------------------------------------------

    def queue_load(
        self,
        copy: Copy,
        host_slots: torch.Tensor,
        device_slots: torch.Tensor,
        handle: BaseCacheHandle,
        pages: bool = False,
    ) -> None:
        """Hands a begun load to the controller; with `pages` the two are page ids."""
        op = self.controller.load(host_slots, device_slots, self.page_size if pages else 1)
        self._loads[op] = (copy, device_slots, handle, host_slots, pages)
        self._load_tokens += device_slots.shape[0] * (self.page_size if pages else 1)

    @_core.shielded
    def loading_check(self, free_device) -> None:
        """Applies finished loads to the tree: the nodes are on the device with
        the loads' pages, or, for a failed load, stay host only and the pages
        are freed (`free_device`); its handle waits in `take_failed_loads`."""
        acks = self._load_acks
        acks.extend(self.controller.take_load_acks())
        ps = self.page_size
        while acks:
            op, ok = acks.popleft()
            copy, device, handle, host, pages = self._loads.pop(op)
            n = device.shape[0] * (ps if pages else 1)
            self._load_tokens -= n
            if pages:
                taken = self.tree.finish_load_pages(copy, device, ok)
            else:
                taken = self.tree.finish_load(copy, device, ok)
            if ok and taken:
                self.loaded_back += n
                self.events.device_loaded(host, device, pages)
            else:
                free_device(slots_of_pages(device, ps) if pages else device)
                if not ok:
                    self.failed_copies += n
                    self._failed_loads.append(handle)

    def take_failed_loads(self) -> List[BaseCacheHandle]:
        """The handles of loads that failed since the last call."""
        failed, self._failed_loads = self._failed_loads, []
        return failed

    def check_not_loading(self, indices: torch.Tensor, name: str) -> None:
        """Raises ValueError if `indices` has a device slot a load is writing."""
        if not self._loads:
            return
        busy = self._loading_slots()
        if bool(torch.isin(indices, busy).any()):
            raise ValueError(f"{name} has slots a load from host is still writing")

    def _loading_slots(self) -> torch.Tensor:
        """The device slots the loads in flight are writing."""
        ps = self.page_size
        return torch.cat(
            [
                slots_of_pages(device, ps) if pages else device
                for _, device, _, _, pages in self._loads.values()
            ]
        )

    def start_load(self, handle: BaseCacheHandle, device_pages: _core.PageAllocator):
        """The tree's `start_load_pages` of `handle`'s host part (find, room
        check, begin and the device pages, of `device_pages`, in one call;
        page ids cross, not slots); a load in flight on the match's host part
        lands first."""
        start = self.tree.start_load_pages
        try:
            return start(handle, device_pages)  # type: ignore[arg-type]
        except ValueError:
            if not self.tree.tier_sizes().loading:
                raise
            # Another request is loading this part: let it land, then take it.
            self.wait_loads()
            self.loading_check(lambda slots: device_pages.free(slots, self.tree))
            return start(handle, device_pages)  # type: ignore[arg-type]

    def begin_load(self, copy) -> Tuple[BaseCacheHandle, torch.Tensor, torch.Tensor]:
        """Begins the load of `copy` (its host part pinned) before device
        pages are found for it: (locked handle, host page ids, the device
        prefix's page ids)."""
        return self.tree.begin_load_pages(copy)

    def abandon_load(self, copy, loaded: BaseCacheHandle) -> None:
        """Undoes a begun load: its node stays host only, `loaded` unlocks."""
        self.tree.finish_load(copy, torch.zeros(copy.end - copy.start, dtype=torch.int32), False)
        self.tree.lock_handle(loaded, True)  # type: ignore[arg-type]

    def wait_copies(self) -> None:
        """Waits for every copy queued so far (applying them is the checks')."""
        self.controller.drain()

    def wait_loads(self) -> None:
        """Waits for every load queued so far (applying them is `loading_check`'s)."""
        self.controller.wait_loads()

    def start_loading(self) -> None:
        """Starts the loads queued so far (`wait_layer` also does)."""
        self.controller.start_loading()

    def wait_layer(self, layer: int) -> None:
        """Returns once layer `layer` of every load queued so far is in place.
        Without a pool the bookkeeping has no layers: any is ready once the
        loads queued so far are."""
        self.controller.wait_layer(layer if self.pool is not None else 0)

    # -- state --------------------------------------------------------------------

    @property
    def page_bytes(self) -> int:
        """What a host page costs (0 without a pool: bookkeeping only)."""
        pool = self.pool
        return pool.nbytes // pool.num_pages if pool is not None else 0

    def figures(self) -> dict:
        """The tier's part of `CacheMetrics`: what it moved, its slots now."""
        sizes = self.tree.tier_sizes()
        return dict(
            backed_up_tokens=self.backed_up,
            loaded_back_tokens=self.loaded_back,
            host_evicted_tokens=self.host_evicted,
            device_loading_tokens=self._load_tokens,
            host_capacity_tokens=self.num_pages * self.page_size,
            host_free_tokens=self.pages.num_free_pages * self.page_size,
            host_cached_tokens=sizes.host,
            host_only_tokens=sizes.host_only,
            host_backing_up_tokens=self._backup_tokens,
            host_storage_writing_tokens=sizes.storage_writing,
        )

    @property
    def backups_in_flight(self) -> int:
        return len(self._backups)

    @property
    def loads_in_flight(self) -> int:
        return len(self._loads)

    @property
    def backup_tokens(self) -> int:
        """Host slots owned by backups in flight."""
        return self._backup_tokens

    @property
    def loading_tokens(self) -> int:
        """Device slots owned by loads in flight."""
        return self._load_tokens

    def size_info(self) -> HostSizeInfo:
        sizes = self.tree.tier_sizes()
        return HostSizeInfo(
            self.num_pages * self.page_size,
            self.pages.num_free_pages * self.page_size,
            sizes.host,
            sizes.host_only,
            sizes.backing_up,
            sizes.loading,
        )

    def counters(self) -> TierCounters:
        return TierCounters(
            self.backed_up,
            self.loaded_back,
            self.host_evicted,
            self.backups_skipped,
            self.failed_copies,
        )

    def check_integrity(self, device_pages: _core.PageAllocator, reading: int = 0) -> None:
        """Host pages: free + cached + owned by backups + `reading` (owned by
        reads from storage in flight) == all, none twice; every slot a copy
        owns is allocated and in no node."""
        host = self.tree.tier_sizes().host
        free = self.pages.num_free_pages * self.page_size
        owned = free + host + self._backup_tokens + reading
        if owned != self.num_pages * self.page_size:
            raise _core.IntegrityError(
                f"host slots leaked or owned twice: {free} free + {host} cached + "
                f"{self._backup_tokens} in backups + {reading} in reads from "
                f"storage != {self.num_pages * self.page_size}"
            )
        self.pages.check_disjoint(self.tree, True)
        if self._backups:
            slots = torch.cat(
                [
                    slots_of_pages(host, self.page_size) if pages else host
                    for _, host, _, pages in self._backups.values()
                ]
            )
            self.pages.check_owned(slots, "host slots of backups in flight", self.tree, True)
        if self._loads:
            slots = self._loading_slots()
            device_pages.check_owned(slots, "device slots of loads in flight", self.tree)
        # Copies finished but not yet acknowledged to the tree are the tier's only.
        if self.controller.in_flight > len(self._backups) + len(self._loads):
            raise _core.IntegrityError(
                f"the controller has {self.controller.in_flight} copies in flight, the tier "
                f"knows of {len(self._backups)} backups and {len(self._loads)} loads"
            )


class NoHostTier:
    """The host tier, off (`host_num_pages=0`): no host pages and no copies;
    every call answers as an empty host tier would."""

    write_policy: Optional[str] = None
    min_hits = 0
    num_pages = 0
    page_bytes = 0
    pool = None
    controller = None
    before_evict: Optional[Callable[[], object]] = None
    backups_in_flight = loads_in_flight = backup_tokens = loading_tokens = 0

    def back_up(self, tokens, ns: int = 0) -> int:
        return 0

    def back_up_before_evict(self, size: int, ns: Optional[int] = None) -> int:
        return 0

    def writing_check(self) -> int:
        return 0

    def wait_copies(self) -> None:
        pass

    def settle_backups(self) -> int:
        return 0

    def start_load(self, handle: BaseCacheHandle, device_pages: _core.PageAllocator) -> None:
        return None  # (no match has a host part)

    def begin_load(self, copy) -> Tuple[BaseCacheHandle, torch.Tensor, torch.Tensor]:
        raise RuntimeError("no host tier to load from")

    def abandon_load(self, copy, loaded: BaseCacheHandle) -> None:
        raise RuntimeError("no host tier to load from")

    def queue_load(self, copy, host_slots, device_slots, handle, pages: bool = False) -> None:
        raise RuntimeError("no host tier to load from")

    def loading_check(self, free_device) -> None:
        pass

    def take_failed_loads(self) -> List[BaseCacheHandle]:
        return []

    def wait_loads(self) -> None:
        pass

    def start_loading(self) -> None:
        pass

    def wait_layer(self, layer: int) -> None:
        pass

    def check_not_loading(self, indices: torch.Tensor, name: str) -> None:
        pass

    def evict_namespace(self, ns: int, size: int) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int32)

    def drop_all(self) -> None:
        pass

    def size_info(self) -> Optional[HostSizeInfo]:
        return None

    def counters(self) -> Optional[TierCounters]:
        return None

    def figures(self) -> dict:
        return {}

    def check_integrity(self, device_pages: _core.PageAllocator, reading: int = 0) -> None:
        pass
