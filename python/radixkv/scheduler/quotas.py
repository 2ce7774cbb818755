"""Namespace quotas: the most a namespace (a tenant) keeps cached on each tier.

The tree counts each quota's tokens per tier and keeps heaps of that
namespace's own eviction candidates; this class turns bytes into tokens,
remembers the limits and, when a namespace holds more than its limit,
evicts that namespace's own least recently used pages (and nobody else's)."""

from __future__ import annotations

from typing import Callable, Dict, NamedTuple, Optional, Tuple

import torch

from radixkv import _core
from radixkv._checks import as_count
from radixkv.scheduler.namespaces import Namespaces


# The largest limit: far beyond any pool, and far from int64's end, so a
# namespace's use plus a request never overflows beside it.
_MAX_LIMIT = 1 << 62


def quota_limit(tree: _core.RadixTree, ns: int, host: bool) -> Optional[int]:
    """Namespace `ns`'s quota on a tier (host, or the device) in tokens; None
    without one."""
    for q_ns, _, _, device_limit, host_limit in tree.quotas():
        if q_ns == ns:
            limit = host_limit if host else device_limit
            return limit if limit >= 0 else None
    return None


def quota_excess(tree: _core.RadixTree, ns: int, n: int, host: bool) -> int:
    """Tokens by which `n` more tokens of namespace `ns` on a tier (host, or
    the device) would take it past its quota there; 0 without one."""
    for q_ns, device, held, device_limit, host_limit in tree.quotas():
        if q_ns == ns:
            use, limit = (held, host_limit) if host else (device, device_limit)
            return use + n - limit if limit >= 0 else 0
    return 0


class QuotaUsage(NamedTuple):
    """What a namespace with a quota holds, in tokens."""

    device: int  # tokens on the device
    host: int  # tokens with a host copy
    device_limit: Optional[int]  # the quota on the device (None: no limit)
    host_limit: Optional[int]  # the quota on the host tier (None: no limit)
    device_evicted: int  # tokens its quota evicted from the device
    host_evicted: int  # tokens its quota evicted from the host tier


def _limit(tokens, size, page_bytes: int, page_size: int, tier: str) -> Optional[int]:
    """The limit in tokens (whole pages) of `tokens` or `size` (bytes), at
    most one given; None for none."""
    if tokens is not None and size is not None:
        raise ValueError(f"give {tier}_tokens or {tier}_bytes, not both")
    if size is not None:
        size = as_count(size, f"{tier}_bytes", minimum=0)
        if not page_bytes:
            raise ValueError(
                f"{tier}_bytes needs the pool's bytes (kv_cache, and a host tier for "
                f"host_bytes): give {tier}_tokens"
            )
        return min(size // page_bytes * page_size, _MAX_LIMIT)
    if tokens is not None:
        tokens = as_count(tokens, f"{tier}_tokens", minimum=0)
        if tokens > _MAX_LIMIT:
            raise ValueError(f"{tier}_tokens must be below 2**62, got {tokens}")
        return tokens
    return None


class Quotas:
    """The namespace quotas of one CacheManager's tree. `device_page_bytes`
    and `host_page_bytes` are what a page costs on each tier (0 when the
    manager keeps bookkeeping only: limits are then in tokens); `host_tier`
    says whether there is a host tier to limit."""

    def __init__(
        self,
        tree: _core.RadixTree,
        page_size: int,
        device_page_bytes: int,
        host_page_bytes: int,
        host_tier: bool,
    ) -> None:
        self.tree = tree
        self.host_tier = host_tier
        self.page_size = page_size
        self.device_page_bytes = device_page_bytes
        self.host_page_bytes = host_page_bytes
        self._evicted: Dict[int, list] = {}  # ns -> [device tokens, host tokens]

    def require(self, what: str) -> "Quotas":
        """These quotas, for the call `what` (NoQuotas refuses it)."""
        return self

    @property
    def active(self) -> bool:
        """Whether any namespace has a quota."""
        return bool(self._evicted)

    def device_excess(self, ns: int, n: int) -> int:
        """Tokens by which `n` more device tokens would take namespace `ns`
        past its device quota (0 without one)."""
        return quota_excess(self.tree, ns, n, host=False)

    @property
    def namespaces(self):
        """The namespaces with a quota."""
        return self._evicted.keys()

    def limits(
        self, device_tokens, device_bytes, host_tokens, host_bytes, namespace=None
    ) -> Tuple[Optional[int], Optional[int]]:
        """The limits in tokens on each tier (each given in tokens or bytes, at
        most one; None: no limit there) of the quota of `namespace` (a name,
        checked first). Raises, naming the argument."""
        Namespaces.check(namespace)
        ps = self.page_size
        device = _limit(device_tokens, device_bytes, self.device_page_bytes, ps, "device")
        host = _limit(host_tokens, host_bytes, self.host_page_bytes, ps, "host")
        if host is not None and not self.host_tier:
            raise ValueError("host_tokens and host_bytes need a host tier (host_num_pages > 0)")
        return device, host

    def set(self, ns: int, device: Optional[int], host: Optional[int]) -> None:
        """Sets namespace `ns`'s limits in tokens (`limits`); None on both
        tiers removes its quota."""
        self.tree.set_quota(ns, device, host)
        if device is None and host is None:
            self._evicted.pop(ns, None)
        else:
            self._evicted.setdefault(ns, [0, 0])

    def set_named(
        self, namespaces: Namespaces, namespace, device: Optional[int], host: Optional[int]
    ) -> bool:
        """`set` for the namespace named `namespace` (of `namespaces`, which
        never forget a name with a quota); False when there was nothing to
        do: no quota to remove, for a name never used (not remembered for
        it)."""
        if device is None and host is None and namespaces.find(namespace) is None:
            return False
        ns = namespaces.id(namespace)
        self.set(ns, device, host)
        namespaces.pin(ns, ns in self._evicted)
        return True

    def usage(self, ns: int) -> Optional[QuotaUsage]:
        """What namespace `ns` holds against its quota (None without one)."""
        if ns not in self._evicted:
            return None
        for q_ns, device, host, device_limit, host_limit in self.tree.quotas():
            if q_ns == ns:
                evicted = self._evicted[ns]
                return QuotaUsage(
                    device,
                    host,
                    None if device_limit < 0 else device_limit,
                    None if host_limit < 0 else host_limit,
                    evicted[0],
                    evicted[1],
                )
        return None

    def enforce(
        self,
        evict_device: Callable[[int, int], torch.Tensor],
        evict_host: Optional[Callable[[int, int], torch.Tensor]],
    ) -> None:
        """Evicts, in every namespace over a limit, its own least recently
        used pages until it is within (or nothing of it can go: pages in use
        stay). `evict_device(ns, tokens)` and `evict_host(ns, tokens)` evict
        and return the slots freed."""
        for ns, device, _, _, _ in self.tree.over_quota():
            if device:
                self._evicted.setdefault(ns, [0, 0])[0] += len(evict_device(ns, device))
        if evict_host is None:
            return
        # After the device's: write_back backs its victims up to host first.
        for ns, _, host, _, _ in self.tree.over_quota():
            if host:
                self._evicted.setdefault(ns, [0, 0])[1] += len(evict_host(ns, host))


class NoQuotas:
    """The quotas of a prefix cache that keeps nothing (the naive cache):
    none is ever set, and a call about one raises TypeError naming it."""

    active = False

    def __init__(self, cache) -> None:
        self._cache = cache

    def require(self, what: str) -> Quotas:
        raise TypeError(f"{what} needs the radix cache (type='radix'), not {self._cache!r}")

    def device_excess(self, ns: int, n: int) -> int:
        return 0

    def enforce(self, evict_device, evict_host) -> None:
        pass
