"""The radix prefix cache: a thin front for the native tree in radixkv._core."""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from radixkv import _core
from radixkv._checks import as_count, as_device, as_max_slots, to_host
from radixkv.kvcache.base import BaseCacheHandle, BaseCacheManager, SizeInfo

RadixCacheHandle = _core.RadixCacheHandle
EVICTION_POLICIES: Tuple[str, ...] = _core.EVICTION_POLICIES  # the tree's, in its order
BaseCacheHandle.register(RadixCacheHandle)


def check_eviction_policy(policy, given=None) -> str:
    """`policy` when it is one of EVICTION_POLICIES; otherwise ValueError
    naming eviction_policy and showing `given` (what the caller was given,
    by default `policy`)."""
    if policy not in EVICTION_POLICIES:
        raise ValueError(
            f"eviction_policy must be one of {', '.join(EVICTION_POLICIES)}, "
            f"got {policy if given is None else given!r}"
        )
    return policy


_REQUEST_STEPS = ("finish_request", "finish_requests", "finish_requests_flat", "cache_request")

TLRU_CONFIG_KEYS = ("threshold", "next_prompt_estimate")


def tel_safe_tokens(policy: str, config) -> int:
    """tlru's TEL-safe length from `config` (SGLang's eviction policy config:
    `threshold`, the next turn's TTFT budget in tokens, and
    `next_prompt_estimate`, its expected prompt in tokens; both 0 by
    default): a leaf at most threshold - next_prompt_estimate tokens long may
    be recomputed within the budget, so it goes first. 0 without a config;
    ValueError for a config with another policy, or keys or values it does
    not know."""
    if config is None:
        return 0
    if policy != "tlru":
        raise ValueError(f"eviction_policy_config is tlru's; eviction_policy is {policy!r}")
    if not isinstance(config, dict):
        raise TypeError(f"eviction_policy_config must be a dict, got {type(config).__name__}")
    unknown = sorted(str(k) for k in config if k not in TLRU_CONFIG_KEYS)
    if unknown:
        raise ValueError(
            f"eviction_policy_config takes {' and '.join(TLRU_CONFIG_KEYS)}, got {', '.join(unknown)}"
        )
    threshold, estimate = (
        as_count(config.get(k, 0), f"eviction_policy_config[{k!r}]", minimum=0)
        for k in TLRU_CONFIG_KEYS
    )
    if threshold >= 2**62 or estimate >= 2**62:
        raise ValueError("eviction_policy_config's token counts must be below 2**62")
    return threshold - estimate


class RadixCacheManager(BaseCacheManager[RadixCacheHandle]):
    """Shares the KV slots of common prefixes between requests.

    Every method is one call into the native tree, which checks its inputs and
    raises before changing anything. On a CPU manager the tree's methods are
    bound directly, so a call costs no Python frame; on an accelerator the
    results are copied to the device and device inputs are read on the host.

    `max_slots` is the size of the KV pool the slots index, when known: a slot
    at or past it is refused. None accepts any int32 slot >= 0 (memory still
    follows the slots stored, never the largest value seen).

    `eviction_policy` says which unlocked leaf goes first (EVICTION_POLICIES):
    least recently used (the default), fewest matches, cached earliest, most
    recently used, or lowest priority (`insert_prefix(..., priority=p)` raises
    the priority of the path it inserts to at least p), slru (matched fewer
    than twice first), tlru (leaves short enough to recompute within the next
    turn's budget first: `eviction_policy_config`, see `tel_safe_tokens`);
    ties and everything within a class go least recently used first. Exact,
    O(log n) a node.

    Cache namespaces: `match_prefix`, `match_prefix_batch` and
    `insert_prefix` take `namespace`, an int >= 0 (0 is the default).
    Sequences of different namespaces never share a prefix (a tenant's cache
    salt, a LoRA adapter); they live in this one tree, under one eviction
    order. `radixkv.scheduler.CacheManager` maps names (str, bytes) to these ids.

    `aligned_pages`: every page starts at a multiple of page_size (as a paged
    allocator hands them out; checked), so the tree also takes and gives
    page ids (`match_pages`, `finish_request_pages`, ...). A CacheManager's
    tree is made so.
    """

    def __init__(
        self,
        device: torch.device | str = "cpu",
        page_size: int = 1,
        max_slots: Optional[int] = None,
        eviction_policy: str = "lru",
        eviction_policy_config: Optional[dict] = None,
        aligned_pages: bool = False,
    ):
        page_size = as_count(page_size, "page_size")
        check_eviction_policy(eviction_policy)
        safe = tel_safe_tokens(eviction_policy, eviction_policy_config)
        self.device = as_device(device)
        self.page_size = page_size
        self.eviction_policy = eviction_policy
        self._tree = _core.RadixTree(
            page_size, as_max_slots(max_slots), eviction_policy, safe, bool(aligned_pages)
        )
        self.tree = self._tree
        # The tree's own methods (same signatures) bound over these: a call
        # costs no Python frame. The request steps read and return host
        # tensors on any device; the rest only on a CPU manager. (setattr:
        # mypy refuses assigning to a method.)
        bound = [*_REQUEST_STEPS, "handle_slots"]
        if self.device.type == "cpu":
            bound += ["match_prefix", "insert_prefix", "lock_handle", "evict"]
        for name in bound:
            setattr(self, name, getattr(self._tree, name))

    def match_prefix(
        self, input_ids, namespace: int = 0, skip_last: bool = False
    ) -> Tuple[RadixCacheHandle, torch.Tensor]:
        handle, indices = self._tree.match_prefix(
            to_host(input_ids, "input_ids", self.device), namespace, skip_last
        )
        return handle, indices.to(self.device, non_blocking=True)

    def match_prefix_batch(self, batch, namespace=0, skip_last: bool = False, flat: bool = False):
        """`match_prefix` of each input of a prefill batch, in order, in one
        native call (one lock, the GIL released once for a large batch);
        every input is checked before any is matched. `namespace` is one int
        for the whole batch or a sequence of one per input. With `skip_last`
        each input is matched without its last token (each must have one).
        Returns [(handle, indices), ...], or with `flat` ([handle, ...],
        indices): every match's indices in one tensor, back to back."""
        if not isinstance(batch, (list, tuple)):
            raise TypeError(
                "batch must be a list or tuple of token id sequences, got "
                f"{type(batch).__name__}"
            )
        if self.device.type != "cpu":
            batch = [to_host(ids, f"batch[{i}]", self.device) for i, ids in enumerate(batch)]
        # The tree reads (and checks) the host inputs itself.
        if flat:
            handles, idx = self._tree.match_prefix_batch(batch, namespace, skip_last, flat=True)
            return handles, idx.to(self.device, non_blocking=True)
        out = self._tree.match_prefix_batch(batch, namespace, skip_last)
        if self.device.type == "cpu":
            return out
        return [(h, idx.to(self.device, non_blocking=True)) for h, idx in out]

    def lock_handle(self, handle: RadixCacheHandle, unlock: bool = False) -> None:
        self._tree.lock_handle(handle, unlock)

    def insert_prefix(self, input_ids, indices, priority: int = 0, namespace: int = 0) -> int:
        return self._tree.insert_prefix(
            to_host(input_ids, "input_ids", self.device),
            to_host(indices, "indices", self.device),
            priority,
            namespace,
        )

    def evict(self, size: int) -> torch.Tensor:
        return self._tree.evict(size).to(self.device, non_blocking=True)

    def reset(self) -> None:
        self._tree.reset()

    @property
    def size_info(self) -> SizeInfo:
        return SizeInfo(*self._tree.size_info())

    def check_integrity(self) -> None:
        self._tree.check_integrity()

    @property
    def max_slots(self) -> Optional[int]:
        """Slots must be below this (None: any int32 slot >= 0)."""
        limit = self._tree.max_slots
        return None if limit < 0 else limit

    @property
    def num_nodes(self) -> int:
        """Nodes in the tree, the root excluded."""
        return self._tree.num_nodes

    def handle_slots(self, handle: RadixCacheHandle) -> torch.Tensor:
        return self._tree.handle_slots(handle)

    # -- a request's steps (BaseCacheManager's): the tree's, bound in __init__ ------

    def finish_request(self, old_handle, input_ids, indices, pages, priority: int = 0) -> int:
        return self._tree.finish_request(old_handle, input_ids, indices, pages, priority)

    def finish_requests(self, batch, pages, priority=0) -> List[int]:
        return self._tree.finish_requests(batch, pages, priority)

    def finish_requests_flat(
        self, handles, input_ids, indices, pages, priority=0, own=None
    ) -> List[int]:
        return self._tree.finish_requests_flat(handles, input_ids, indices, pages, priority, own)

    def cache_request(
        self, old_handle, input_ids, indices, pages, priority: int = 0
    ) -> Tuple[RadixCacheHandle, torch.Tensor, int]:
        return self._tree.cache_request(old_handle, input_ids, indices, pages, priority)

    def is_valid(self, handle: RadixCacheHandle) -> bool:
        """Whether `handle` came from this cache and still names a live node."""
        return isinstance(handle, RadixCacheHandle) and self._tree.is_valid(handle)

    def dump(self) -> List[_core.DumpRow]:
        """Every node as (parent, tokens, slots, ref_count, timestamp).

        Parents come before children and siblings in ascending token order;
        `parent` indexes this list, -1 for children of the root. For tests and
        debugging: it copies the whole tree.
        """
        return self._tree.dump()
