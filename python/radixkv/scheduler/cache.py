"""The scheduler-side cache manager: free pages, the prefix cache and requests.

`CacheManager` is a facade: the prefix cache (`radixkv.kvcache`: the radix
tree's request steps, or the naive cache's) checks and applies each request
step, `Tiers` owns the host and storage tiers and the KV-event ledger,
`Upkeep` makes room on the device and runs the hook after each step (claims
expire, quotas are enforced, events are published), `Counters` and the
tiers' own figures make `metrics`. What stays here is the order of the
calls and the pages requests hold; the same steps with page ids instead of
slots are `PagePath`'s (`scheduler/page_path.py`), a base of the class."""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple, cast

import torch

from radixkv import _core
from radixkv._core import shielded
from radixkv._checks import as_count, as_device, as_flag, int32_tensor, per_input, to_host
from radixkv.events import EventPublisher, KVSnapshot
from radixkv.kvcache import BaseCacheHandle, create_cache_manager
from radixkv.kvcache.engine_pool import DevicePool
from radixkv.kvcache.host_pool import HostKVCache
from radixkv.kvcache.page_ids import slots_of_pages
from radixkv.kvcache.request_inputs import (
    check_handle,
    flat_own_pages,
    host_batch,
    host_flat,
    page_counts,
    join_parts,
    length,
    split_flat,
)
from radixkv.scheduler.host_tier import HostSizeInfo, InFlight, TierCounters
from radixkv.scheduler.metrics import CacheMetrics, Counters
from radixkv.scheduler.namespaces import Namespaces
from radixkv.scheduler.page_path import PagePath
from radixkv.scheduler.quotas import QuotaUsage
from radixkv.scheduler.retention import RetentionClaim, check_retention_args
from radixkv.scheduler.storage_tier import Prefetch, StorageCounters, StorageFaultPolicy
from radixkv.scheduler.tiers import build_tiers, check_tier_args
from radixkv.scheduler.upkeep import build_upkeep
from radixkv.storage.base import StorageBackend


class CacheManager(PagePath):
    """Hands KV pages to requests and caches their prefixes when they finish.

    Owns a pool of `num_pages` pages of `page_size` token slots (slot `s`
    lives in page `s // page_size`) and a prefix cache of `type` ("radix" or
    "naive"; results are int32 tensors on `device`). A page is at any time
    in exactly one place: free, cached, held by a request (between
    `allocate` and its return through `free`, `free_and_cache_finished_req`
    or `cache_unfinished_req`), or owned by one copy between tiers in
    flight. Requests are the caller's: the manager keeps no request objects,
    only the count of pages they hold. A request's indices cover its tokens
    in order: the first `handle.cached_len` are the cache's slots (from
    `match_req`), the rest the request's own, in whole pages.

    The arguments, grouped (docs/api.md gives each in full):

    - the host tier (radix only; docs/tiers.md): `host_num_pages`,
      `write_policy` (write_through, write_through_selective, write_back),
      `kv_cache` (the device pool the copies read and write; without it the
      tier keeps its bookkeeping only), `host_layout`, `host_codec`
      ("float8": pages held encoded, lossy), `manual_copies` (copies run
      when a test says);
    - the storage tier (needs a host tier with `kv_cache`, page_first):
      `storage`, `storage_seed`, `prefetch_policy`, `min_prefetch_tokens`,
      `storage_faults`;
    - eviction: `eviction_policy` (`_core.EVICTION_POLICIES`),
      `eviction_policy_config` (tlru's);
    - cache namespaces: `max_namespaces` names remembered (requests of
      different namespaces never share a prefix, on any tier);
    - `tp_rank` (MLA pages are written to storage by rank 0 only);
    - `kv_events` (a `radixkv.events.EventPublisher`: each tier's blocks as
      vLLM's KV events, published once a round by `flush_events()`, which
      the per-round checks call);
    - retention claims (`retain`): `retain_budget_tokens` (None: half the
      device pool), `clock` (seconds; `time.monotonic` by default).

    Copies between tiers change the cache only when the scheduler applies
    their acknowledgements: `writing_check()`, `loading_check()` and
    `storage_check()` once a round (`drain()` waits for every copy).
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
        num_pages = as_count(num_pages, "num_pages", minimum=0)
        page_size = as_count(page_size, "page_size")
        tier_args = check_tier_args(
            type == "radix",
            num_pages,
            page_size,
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
        check_retention_args(retain_budget_tokens, clock)
        self._pages = _core.PageAllocator(num_pages, page_size)
        self.manager = create_cache_manager(
            device,
            type,
            page_size,
            max_slots=num_pages * page_size,
            eviction_policy=eviction_policy,
            eviction_policy_config=eviction_policy_config,
            aligned_pages=True,  # (its pages come from its own PageAllocator)
        )
        self.device = as_device(device)
        self.page_size = page_size
        self.num_pages = num_pages
        # Pages held by requests: allocated, not yet freed or cached.
        self._held_pages = 0
        self._tree = self.manager.tree  # (None for the naive cache: handed to native calls)
        self._counters = Counters()
        self._namespaces = Namespaces(as_count(max_namespaces, "max_namespaces"))
        self._tiers = build_tiers(self._tree, self._pages, self._namespaces, tier_args)
        self._events = self._tiers.events  # the device's events are the manager's to tell
        self._upkeep = build_upkeep(
            self.manager,
            self._pages,
            self._tiers,
            self._counters,
            kv_cache,
            retain_budget_tokens,
            clock,
        )
        self._retention = self._upkeep.retention
        self._quotas = self._upkeep.quotas
        # A match the tree can take as it comes (its inputs read and checked
        # natively): on the CPU, without a backup on match.
        self._native_match = self.device.type == "cpu" and not self._tiers.backs_up_on_match
        # What a finish does per request beyond the native call (KV events,
        # write_through's backup), decided once.
        self._per_request_tail = self._events.on or self._tiers.backs_up_on_insert

    # -- matching and locking -------------------------------------------------

    @shielded
    def match_req(
        self, input_ids, namespace=None, *, skip_last: bool = True
    ) -> Tuple[BaseCacheHandle, torch.Tensor]:
        """Match `input_ids[:-1]`: the last token is always computed. An
        engine whose input already leaves out the tokens it will compute
        (SGLang's key stops where a prefix may be reused) passes
        `skip_last=False` to match all of `input_ids` (none: the root)."""
        skip = as_flag(skip_last, "skip_last")
        if self._native_match and Namespaces.is_default(namespace):
            # The prefix cache reads and checks the input itself, without its
            # last token (the length is taken first: an input it reads may
            # have none).
            try:
                n = length(input_ids)
            except (TypeError, IndexError):  # (no len(), a 0-d tensor): checked below
                n = None
            if n is not None:
                ids = to_host(input_ids, "input_ids", self.device)  # (refuses other devices)
                handle, indices = self.manager.match_prefix(ids, 0, skip)
                self._matched(n - skip, (handle,))
                return handle, indices
        ids = int32_tensor(input_ids, "input_ids", self.device)
        n = ids.shape[0]  # (a tensor's len() is a Python call)
        if n == 0 and skip:
            raise ValueError("input_ids must hold at least one token")
        ns = self._namespaces.id(namespace)
        asked = ids[:-1] if skip else ids
        handle, indices = self.manager.match_prefix(asked, ns)
        self._matched(n - skip, (handle,))
        if self._tiers.backs_up_on_match:
            self._tiers.back_up(asked, ns)
        return handle, indices

    def _matched(self, tokens: int, handles) -> None:
        """Every match ends here: `handles` asked about `tokens` tokens in
        all. Counted (each hit by the tier serving it), and the claims that
        refresh on a hit see their paths matched."""
        self._counters.matched(tokens, handles, self._tiers.storage_hit_len)
        self._upkeep.refresh_claims(handles)

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
        if self._native_match and Namespaces.is_default(namespace):
            # The prefix cache reads and checks the inputs itself (the
            # lengths are taken first: an input it reads may have none).
            try:
                tokens = sum(length(x) for x in batch) - len(batch)
            except (TypeError, IndexError):  # (no len(), a 0-d tensor): checked below
                tokens = None
            if tokens is not None:
                try:
                    return self._match_batch(batch, 0, tokens, flat)
                except TypeError:  # raised before anything changed
                    # Tensors on another device: copied to the host, or
                    # refused, as match_req does; any other error stands.
                    host = [to_host(x, f"batch[{i}]", self.device) for i, x in enumerate(batch)]
                    if all(h is x for h, x in zip(host, batch)):
                        raise
                    return self._match_batch(host, 0, tokens, flat)
        ids = [int32_tensor(x, f"batch[{i}]", self.device) for i, x in enumerate(batch)]
        for i, x in enumerate(ids):
            if x.shape[0] == 0:
                raise ValueError(f"batch[{i}] must hold at least one token")
        spaces = self._namespaces.ids(namespace, names, len(batch))  # (the inputs checked)
        out = self._match_batch(ids, spaces, sum(x.shape[0] for x in ids) - len(ids), flat)
        if self._tiers.backs_up_on_match:
            for x, ns in zip(ids, spaces):
                self._tiers.back_up(x[:-1], ns)
        return out

    def _match_batch(self, batch, spaces, tokens: int, flat: bool):
        """match_req_batch's one call of the prefix cache, which reads and
        checks the inputs, each matched without its last token (`tokens` in
        all, once matched) in namespace ids `spaces` (one for all, or one
        each)."""
        out = self.manager.match_prefix_batch(batch, spaces, True, flat)
        if flat:
            handles = cast(Tuple[List[BaseCacheHandle], torch.Tensor], out)[0]
        else:
            handles = [h for h, _ in cast(List[Tuple[BaseCacheHandle, torch.Tensor]], out)]
        self._matched(tokens, handles)
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
        loaded, pages, slots = self._load_back(handle)
        if slots is None:
            slots = slots_of_pages(cast(torch.Tensor, pages), self.page_size)
        return loaded, slots.to(self.device, non_blocking=True)

    def _load_back(self, handle: BaseCacheHandle):
        """load_back's work: (the locked handle, its pages, None), or (handle,
        None, its slots) where the path gave slots (the naive cache)."""
        check_handle(self.manager, handle, "handle")
        started = self._tiers.start_load(handle) if handle.host_hit_len else None
        if started is None:  # no host part, or nothing left on the host beyond the device part
            tree = self._tree
            if tree is not None:
                pages = tree.handle_pages(cast(_core.RadixCacheHandle, handle))  # (checked there)
                self.lock(handle)
                return handle, pages, None
            slots = self.manager.handle_slots(handle)
            self.lock(handle)
            return handle, None, slots
        copy, loaded, host_pages, pages = started
        if loaded is None or host_pages is None or pages is None:
            loaded, pages = self._upkeep.load_making_room(handle, copy)
            return loaded, pages, None
        if copy.end == copy.start:  # another request's load landed the whole part meanwhile
            return loaded, pages, None
        # The load's own pages: the caller may reuse the ones it gets.
        own = pages[copy.start // self.page_size :].clone()
        self._tiers.queue_load(copy, host_pages, own, loaded, pages=True)
        return loaded, pages, None

    @shielded
    def lock(self, handle: BaseCacheHandle) -> None:
        self.manager.lock_handle(handle, unlock=False)

    @shielded
    def unlock(self, handle: BaseCacheHandle) -> None:
        """Releases a lock of `lock`: pages it kept past their namespace's
        quota are evicted now."""
        self.manager.lock_handle(handle, unlock=True)
        self._upkeep.after_step()

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

        `tier="device"` keeps the prefix on the device (locked, as a
        request's pages are), `tier="host"` at least in host memory;
        `priority` is the prefix's eviction priority after the claim
        (docs/api.md, "Retention claims"). Returns a `RetentionClaim` whose
        `tokens` say how much is held (0 when nothing is cached).

        Raises `RetainBudgetError` when the claims would together hold more
        than `retain_budget_tokens` distinct tokens, or more than the
        namespace's budget (`set_retain_budget`); that, or a clock that
        raises, changes nothing (no LRU time either).
        """
        retention = self._retention.require("retain")
        ttl, priority, refresh = retention.check_args(ttl_s, tier, priority, refresh_on_hit)
        ids = int32_tensor(input_ids, "input_ids", self.device)
        # Admitted (budgets, the clock) before anything changes: a match
        # stamps LRU times, and a new name would be remembered.
        deadline = retention.admit(ids, self._namespaces.find(namespace), namespace, tier, ttl)
        ns = self._namespaces.id(namespace)
        return retention.claim(ids, ns, namespace, tier, ttl, deadline, priority, refresh)

    @shielded
    def release(self, claim: RetentionClaim) -> bool:
        """Ends a claim of `retain`: its pages may be evicted again, and
        those it kept past their namespace's quota are evicted now. Returns
        False when it had ended already (released, expired, or a reset)."""
        ended = self._retention.require("release").release(claim)
        self._upkeep.after_step()
        return ended

    def set_retain_budget(self, tokens: Optional[int], namespace=None, *, whole: bool = False):
        """Sets the most tokens the claims of `namespace` may hold together
        (None: no budget of its own), or with `whole` the manager's budget
        for all claims. A lower budget refuses new claims; the ones held stay."""
        retention = self._retention.require("set_retain_budget")
        whole = as_flag(whole, "whole")
        retention.set_budget(tokens, None if whole else self._namespaces.id(namespace))

    @property
    def retained_tokens(self) -> int:
        """Tokens that at least one retention claim holds (after ending the
        claims whose time is up)."""
        return self._retention.held()

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
        (whole pages; bytes need `kv_cache`), or the same in tokens
        (`device_tokens`, `host_tokens`; one of the two per tier, None for no
        limit there; all None removes the quota). Whenever the namespace
        holds more (at once here, and after every step), its own least
        recently used pages are evicted, and no other namespace's; pages in
        use stay until released. docs/api.md, "Namespace quotas", gives the
        rules in full; `quota_usage(namespace)` says where it stands."""
        quotas = self._quotas.require("set_quota")
        limits = quotas.limits(device_tokens, device_bytes, host_tokens, host_bytes, namespace)
        if quotas.set_named(self._namespaces, namespace, *limits):
            self._upkeep.after_step()

    def quota_usage(self, namespace=None) -> Optional[QuotaUsage]:
        """What `namespace` holds against its quota, in tokens, and what the
        quota has evicted since it was first set (None without a quota)."""
        quotas = self._quotas.require("quota_usage")
        ns = self._namespaces.find(namespace)
        return None if ns is None else quotas.usage(ns)

    # -- pages ------------------------------------------------------------------

    @property
    def free_pages(self) -> int:
        """Pages neither cached nor held by a request."""
        return self._pages.num_free_pages

    @property
    def available_size(self) -> int:
        """Tokens that `allocate` can serve: free plus evictable."""
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
        n = as_count(num_tokens, "num_tokens", minimum=0)
        return self._upkeep.make_room(n, self._namespaces.find(namespace))

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
        ps = self.page_size
        pages = page_counts(sizes, ps)
        total = sum(pages) * ps
        self._upkeep.make_room(total, None, f"allocate sizes (together {sum(pages)} pages of {ps})")
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
        self._held_pages -= length(indices) // self.page_size

    # -- finishing requests: each is one request step of the prefix cache, which
    # checks everything and raises, changing nothing; then `_finished` for each.

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
        ids, indices = self._request_inputs(input_ids, indices)
        tree, announce = self._tree, self._announce_args(old_handle)
        if tree is not None and announce is not None:  # (the call announces its BlockStored)
            h = cast(_core.RadixCacheHandle, old_handle)
            in_cache = tree.finish_request(h, ids, indices, self._pages, priority, *announce)
        else:
            in_cache = self.manager.finish_request(old_handle, ids, indices, self._pages, priority)
        self._finished(old_handle, ids, indices, in_cache, announced=announce is not None)

    def _announce_args(
        self, handle
    ) -> Optional[Tuple[Optional[_core.BlockLedger], Optional[bytes]]]:
        """The (ledger, seed) a single request step's native call takes to
        announce the BlockStored of what it caches itself (the radix tree,
        KV events on); None where `_finished` announces them."""
        if self._tree is None or not self._events.on:
            return None
        # (not a handle: the step's own call refuses it, naming old_handle)
        return self._events.announcer(getattr(handle, "namespace", 0))

    def _request_inputs(self, input_ids, indices):
        """A request's inputs on the host for a request step, once its loads
        (and any on its path) joined the tree: its slots are compared with
        the tree's."""
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
        host = host_batch(batch, self.device)
        if self._tiers.loads_in_flight():
            self._tiers.settle_loads()
        in_cache = self.manager.finish_requests(host, self._pages, priority)
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
        input_ids, indices, own = host_flat(handles, input_ids, indices, own, self.device)
        if self._tiers.loads_in_flight():
            self._tiers.settle_loads()
        in_cache = self.manager.finish_requests_flat(  # (reads and checks every input)
            handles, input_ids, indices, self._pages, priority, own
        )
        self._flat_finished(handles, input_ids, indices, own, in_cache)

    def _flat_finished(self, handles, input_ids, indices, own, in_cache, pages=False) -> None:
        """`_finished` of each of a flat batch's requests (page ids with `pages`)."""
        if not self._per_request_tail:  # (no KV events, no write_through: no parts to read)
            self._held_pages -= flat_own_pages(handles, indices, own, self.page_size, pages)
            self._upkeep.after_step()
            return
        ps, device = self.page_size, self.device
        if own is not None:
            indices = join_parts(handles, input_ids, indices, own, ps, device, pages)
        parts = split_flat(input_ids, indices, handles, ps, device, pages)
        for (handle, ids, part), k in zip(parts, in_cache):
            self._finished(handle, ids, part, k, pages=pages)

    def _finished(
        self,
        handle,
        ids,
        indices,
        in_cache: int,
        held: Optional[int] = None,
        pages: bool = False,
        announced: bool = False,
    ) -> None:
        """The manager's side of a request that a request step ended (its inputs were
        checked there; `indices` are page ids with `pages`): the pages it held (`held`
        slots; None: all but its cached part), its KV events (`announced`: the step's
        native call told them), its write_through backup, then the post-step hook."""
        if held is None:
            held = length(indices) * (self.page_size if pages else 1) - handle.cached_len
        self._held_pages -= held // self.page_size
        if announced:
            self._events.announced()
        else:
            self._events.request_cached(ids, indices, in_cache, handle, self.page_size, pages)
        if self._tiers.backs_up_on_insert:
            self._tiers.back_up(ids, handle.namespace)
        self._upkeep.after_step()

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
        ids, indices = self._request_inputs(input_ids, indices)
        # One call: the checks, the insert, the new match and its lock, the
        # frees and the unlock (and the BlockStored); it raises, changing nothing.
        tree, announce = self._tree, self._announce_args(old_handle)
        if tree is not None and announce is not None:
            h = cast(_core.RadixCacheHandle, old_handle)
            step = tree.cache_request(h, ids, indices, self._pages, priority, *announce)
        else:
            step = self.manager.cache_request(old_handle, ids, indices, self._pages, priority)
        handle, new_indices, in_cache = step
        # (the request's locked pages stay)
        held = handle.cached_len - old_handle.cached_len
        self._finished(old_handle, ids, indices, in_cache, held, announced=announce is not None)
        return handle, new_indices.to(self.device, non_blocking=True)

    # -- once a scheduling round --------------------------------------------------
    # Each applies what the tiers finished, then the post-step hook publishes
    # the round's KV events.

    @shielded
    def writing_check(self) -> int:
        """Applies finished backups: their nodes have host copies from now on
        (a failed one's host pages are freed). Returns how many were applied;
        0 without a host tier. Call once per scheduling round (it publishes
        the round's KV events, as `flush_events()`)."""
        applied = self._tiers.writing_check()
        self._upkeep.after_step(publish=True)
        return applied

    @shielded
    def loading_check(self) -> List[BaseCacheHandle]:
        """Applies finished loads: their nodes are on the device from now on.
        Returns the handles (from `load_back`) whose loads failed since the
        last call (also those found by another call that waited for loads):
        their pages were freed; see `load_back`."""
        failed = self._tiers.loading_check()
        self._upkeep.after_step(publish=True)
        return failed

    @shielded
    def storage_check(self) -> int:
        """Applies finished writes to storage (their host pages are released)
        and reads (their pages join the tree). Call once per scheduling round."""
        applied = self._tiers.storage_check()
        self._upkeep.after_step(publish=True)
        return applied

    def drain(self) -> List[BaseCacheHandle]:
        """Waits for every copy queued so far and applies them all (backups,
        then loads). Returns the handles of failed loads, as `loading_check`."""
        failed = self._tiers.drain()
        self._upkeep.after_step(publish=True)
        return failed

    def start_loading(self) -> None:
        """Starts the loads queued by `load_back` (`wait_layer` also does)."""
        self._tiers.start_loading()

    def wait_layer(self, layer: int) -> None:
        """Returns once layer `layer` of every load queued so far is in place
        (starting them first). The pool given as `kv_cache` calls it from
        `k_cache(layer)` and `v_cache(layer)`."""
        self._tiers.wait_layer(as_count(layer, "layer", minimum=0))

    # -- the storage tier ----------------------------------------------------------

    @shielded
    def prefetch(self, input_ids, namespace=None) -> Optional[Prefetch]:
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
        ids = int32_tensor(input_ids, "input_ids", self.device)[:-1]
        return self._tiers.prefetch(ids, namespace)

    def wait_prefetch(self, prefetch) -> int:
        """Waits for a read as `prefetch_policy` says (not at all for
        best_effort, all of it for wait_complete, a bound growing with its
        length for timeout), then applies what arrived: those pages join the
        tree as host-only nodes, and the next `match_req` sees them as host
        hits. Returns the tokens the tree took from it (so far)."""
        if prefetch is None:
            return 0
        inserted = self._tiers.wait_prefetch(prefetch)
        self._upkeep.after_step(publish=True)
        return inserted

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
        return self._events.publisher

    def flush_events(self) -> int:
        """Publishes the KV events since the last call as one batch (none
        when there are none, events are off, or the publisher was closed:
        then they are dropped); returns how many. Call once
        per scheduling round if the engine calls none of `writing_check()`,
        `loading_check()` and `storage_check()`, which do."""
        return self._upkeep.publish()

    def kv_snapshot(self) -> KVSnapshot:
        """Every block the device and host tiers hold, as one batch of
        BlockStored events in the KV events' wire format (device blocks
        first, each tier's parents before their children), after the
        pending events were published: `seq` is the number of the first
        batch it does not cover, `epoch` the publisher's. A router that lost
        track (a gap, a restart) replaces its state with it and applies the
        batches from `seq` on. Replay clients get the same over the socket
        (`radixkv.event_index`). Raises RuntimeError without kv_events."""
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
        self._tiers.settle(close_bound=True)
        self._upkeep.reset()

    # -- figures and checks ---------------------------------------------------------

    @property
    def host_pool(self) -> Optional[HostKVCache]:
        """The host pool the tier copies K/V into (None: no tier or no kv_cache)."""
        return self._tiers.host_pool

    @property
    def controller(self) -> Optional[_core.CacheController]:
        """The host tier's copy controller (None without a host tier)."""
        return self._tiers.controller

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
        them as Prometheus text. Each part reports its own figures: the
        manager's counters, the tiers', the retention claims'."""
        return CacheMetrics(
            **self._counters.figures(),
            **self._tiers.figures(),
            **self._retention.figures(),
            **self._upkeep.device_figures(self._held_pages),
        )

    def check_integrity(self) -> None:
        """Free + cached + held (+ loading) pages == all pages, no page both free
        and cached; with a host tier the same for host pages (see HostTier).

        Valid at any time, with requests in flight. Raises
        `radixkv.IntegrityError` on a violation.
        """
        self.manager.check_integrity()
        self._upkeep.check_pages(self._held_pages)
        self._tiers.check_integrity()
        self._retention.check()

    @property
    def held_pages(self) -> int:
        """Pages handed to requests and not yet returned or cached."""
        return self._held_pages
