"""SGLang's RadixCache interface over radixkv's native tree.

SGLang's scheduler drives its prefix cache through `match_prefix`, `insert`,
`evict`, `inc_lock_ref` / `dec_lock_ref`, `evictable_size()` /
`protected_size()` and, per request, `cache_finished_req` /
`cache_unfinished_req` over its req-to-token pool and token-to-KV allocator.
`RadixCache` here keeps those names, arguments and results as SGLang 0.5.x
has them, in both of the forms its releases used: the plain calls of the
early ones (0.5.2: `match_prefix(token_ids)`, `insert(key, value) -> int`,
`evict(num_tokens)`) and the parameter objects of the later ones (0.5.9 and
0.5.16: `MatchPrefixParams`, `InsertParams -> InsertResult`, `EvictParams ->
EvictResult`). 0.5.23's request flow (`checkpoint`, SGLang's own
`release_kv_cache`) and result types are `radixkv.compat.sglang.plugin`'s,
the same class under SGLang's BasePrefixCache, which `--radix-cache-backend
radixkv` loads. An engine of an earlier release swaps its cache by changing
an import:

    from radixkv.compat.sglang import RadixCache

What differs, on purpose:
- Nodes are radixkv handles: opaque, for `inc_lock_ref` / `dec_lock_ref` and
  `path_device_indices` only (no `.parent`, `.children`, `.key`). Each handle
  counts its own locks: unlocking a node more often than it was locked raises
  a ValueError instead of driving a counter negative.
- `evict` frees what it evicts through the allocator in one `free` call, and
  eviction is exact LRU on a logical clock (SGLang also refreshes the unmatched
  rest of a node a match splits; radixkv refreshes exactly the matched tokens).
- `insert(InsertParams)` returns an InsertResult whose `last_device_node` is
  None (the native insert returns no node; a match of the key gives it).
- KV events (`enable_kv_cache_events`): as SGLang 0.5.23 queues them, one
  BlockStored per page an insert adds, a page joining the event before it
  when it continues that chain in the same namespace, and one BlockRemoved
  per eviction (joined the same way); each carries the key's cache_salt
  and, where SGLang's LoRA name table knows its extra_key, the adapter's
  name. Block hashes are radixkv's page keys (a SHA-256 chain from the
  sequence's start, seeded per namespace), low 64 bits as a signed int64
  like SGLang's, not SGLang's token hashes.
- `value=None` in an insert stands for the token ids, as in SGLang's
  simulated caches; radixkv's tree keeps each slot in one place (a slot
  cached twice would be freed twice), so a key whose tokens repeat needs
  explicit values.
- Not supported (a clear exception): bigram keys (`is_eagle`) and, on a
  native tree without namespaces, a non-None `extra_key`.
Requests whose `extra_key` (with `cache_salt`, where the key has one) differ
never share a prefix: each distinct value gets a namespace of the one native
tree (radixkv.scheduler.namespaces names them).
"""

from __future__ import annotations

import dataclasses
from array import array
from typing import Any, List, NamedTuple, Optional

import torch

from radixkv import _core
from radixkv._checks import as_count, as_int, as_max_slots, to_host
from radixkv.events import MEDIUM_GPU, block_hash
from radixkv.kvcache.base import released_slots
from radixkv.kvcache.radix_manager import check_eviction_policy
from radixkv.scheduler.namespaces import Namespaces

__all__ = [
    "DecLockRefResult",
    "EvictParams",
    "EvictResult",
    "IncLockRefResult",
    "InsertParams",
    "InsertResult",
    "MatchPrefixParams",
    "MatchResult",
    "RadixCache",
    "RadixKey",
    "HAS_NAMESPACES",
]


def _tree_has_namespaces() -> bool:
    try:
        _core.RadixTree(1).match_prefix([1], namespace=1)
    except TypeError:
        return False
    return True


HAS_NAMESPACES = _tree_has_namespaces()
"""Whether the installed native tree takes `namespace=` (needed for extra_key)."""

_EVENTS = None


def _event_types():
    """(BlockStored, BlockRemoved, AllBlocksCleared): SGLang's, so its
    publisher sends them as its own, else radixkv.events' (same fields)."""
    global _EVENTS
    if _EVENTS is None:
        try:
            from sglang.srt.disaggregation.kv_events import (
                AllBlocksCleared,
                BlockRemoved,
                BlockStored,
            )
        except Exception:  # noqa: BLE001 - SGLang absent, or not importable here
            from radixkv.events import AllBlocksCleared, BlockRemoved, BlockStored
        _EVENTS = (BlockStored, BlockRemoved, AllBlocksCleared)
    return _EVENTS


def _has_field(event_type, name: str) -> bool:
    fields = getattr(event_type, "__struct_fields__", ()) or getattr(event_type, "_fields", ())
    return name in fields


class RadixKey:
    """SGLang's key: token ids and the namespace tags `extra_key` and
    `cache_salt`; `limit` caps the tokens it stands for without a copy. It
    slices, indexes and iterates as SGLang's does. SGLang's own RadixKey
    objects are accepted as well (anything with `token_ids`)."""

    __slots__ = ("token_ids", "extra_key", "is_bigram", "limit", "cache_salt")

    def __init__(
        self,
        token_ids,
        extra_key: Optional[str] = None,
        is_bigram: bool = False,
        limit: Optional[int] = None,
        cache_salt: Optional[str] = None,
    ):
        self.token_ids = token_ids
        self.extra_key = extra_key
        self.is_bigram = is_bigram
        self.limit = limit
        self.cache_salt = cache_salt or None

    def __len__(self) -> int:
        n = len(self.token_ids)
        return n if self.limit is None else min(n, self.limit)

    def _ids(self):
        n, ids = len(self), self.token_ids
        return ids if n == len(ids) else ids[:n]

    def __iter__(self):
        return iter(self._ids())

    def __getitem__(self, idx) -> "RadixKey":
        """A key over a slice of the tokens (an int: that one token), with
        the same namespace tags."""
        if isinstance(idx, int) and not isinstance(idx, bool):
            n = len(self)
            i = idx + n if idx < 0 else idx
            if not 0 <= i < n:
                raise IndexError(f"RadixKey index out of range: {idx}")
            idx = slice(i, i + 1)
        if not isinstance(idx, slice):
            raise TypeError(
                f"RadixKey indices must be an int or a slice, got " f"{type(idx).__name__}"
            )
        start, stop, step = idx.indices(len(self))
        if step != 1:
            raise ValueError("RadixKey slice step must be 1")
        return RadixKey(
            self.token_ids[start : max(start, stop)], self.extra_key, cache_salt=self.cache_salt
        )

    def page_aligned(self, page_size: int) -> "RadixKey":
        """The key's whole pages."""
        return self if page_size == 1 else self[: len(self) // page_size * page_size]

    def match(self, other: "RadixKey", page_size: int = 1) -> int:
        """How many leading tokens this key shares with `other`, rounded down
        to whole pages; keys of other namespaces do not compare (ValueError)."""
        for tag in ("extra_key", "cache_salt"):
            if getattr(self, tag) != getattr(other, tag, None):
                raise ValueError(
                    f"RadixKey.match needs keys of one {tag}: "
                    f"{getattr(self, tag)!r} != {getattr(other, tag, None)!r}"
                )
        page_size = as_count(page_size, "page_size")
        a, b = self._ids(), list(other)
        n = min(len(a), len(b))
        same = next((i for i in range(n) if a[i] != b[i]), n)
        return same // page_size * page_size

    def __repr__(self) -> str:
        ids = self._ids()
        preview = [int(t) for t in ids[:10]]
        more = "..." if len(ids) > 10 else ""
        return (
            f"RadixKey(extra_key={self.extra_key!r}, cache_salt={self.cache_salt!r}, "
            f"token_ids={preview}{more})"
        )


@dataclasses.dataclass
class MatchPrefixParams:
    key: Any
    cow_mamba: bool = False
    req: Any = None


@dataclasses.dataclass
class InsertParams:
    key: Any = None
    value: Optional[torch.Tensor] = None
    mamba_value: Optional[torch.Tensor] = None
    prev_prefix_len: int = 0
    swa_evicted_seqlen: int = 0
    chunked: bool = False
    priority: int = 0


@dataclasses.dataclass
class InsertResult:
    prefix_len: int
    total_len: int = 0
    last_device_node: Any = None
    mamba_exist: bool = False
    inserted_host_node: Any = None


@dataclasses.dataclass
class EvictParams:
    num_tokens: int = 0
    swa_num_tokens: int = 0
    mamba_num: int = 0


@dataclasses.dataclass
class EvictResult:
    num_tokens_evicted: int = 0
    swa_num_tokens_evicted: int = 0
    mamba_num_evicted: int = 0


class IncLockRefResult(int):
    """The change of evictable_size a lock made: an int, as 0.5.2 and 0.5.9
    return it, with `.delta`, as 0.5.16 and later read it."""

    @property
    def delta(self) -> int:
        return int(self)


DecLockRefResult = IncLockRefResult


class MatchResult(NamedTuple):
    """SGLang's match: `device_indices` (int64 on the cache's device) are the
    slots of the longest cached prefix, whole pages only."""

    device_indices: torch.Tensor
    last_device_node: Any
    last_host_node: Any
    host_hit_length: int = 0
    mamba_branching_seqlen: Optional[int] = None

    # Read by later 0.5.x schedulers; with no host tier they are fixed.
    @property
    def best_match_node(self) -> Any:
        return self.last_host_node

    @property
    def device_prefix_len(self) -> int:
        return len(self.device_indices)

    @property
    def prefix_len(self) -> int:
        """The cached prefix's length (device_prefix_len)."""
        return len(self.device_indices)

    @property
    def swa_host_hit_length(self) -> int:
        return 0

    @property
    def mamba_host_hit_length(self) -> int:
        return 0

    @property
    def cache_protected_len(self) -> Optional[int]:
        return None


def _priority(value: int) -> int:
    """A priority as the native tree keeps it (int32), order kept: SGLang
    gives requests without one sys.maxsize or its negative."""
    return max(-(1 << 31), min(value, (1 << 31) - 1))


def _signed(h: int) -> int:
    """A 64-bit block hash as SGLang publishes it: a signed int64."""
    return h - (1 << 64) if h >= 1 << 63 else h


def _looks_like_init_params(obj) -> bool:
    return all(hasattr(obj, a) for a in ("disable", "page_size", "token_to_kv_pool_allocator"))


def _renamed(err: Exception, names: dict) -> Exception:
    """The native error with its argument names replaced by this API's."""
    text = str(err)
    for native, ours in names.items():
        text = text.replace(native, ours)
    return type(err)(text)


def _length(values, name: str) -> int:
    try:
        return len(values)
    except TypeError:
        raise TypeError(
            f"{name} must be a 1-D sequence or tensor, got " f"{type(values).__name__}"
        ) from None


# The Req fields the per-request calls read (prefix_indices stands in for
# cache_protected_len on releases without it).
_FINISHED_FIELDS = ("req_pool_idx", "origin_input_ids", "output_ids", "last_node", "prefix_indices")
_UNFINISHED_FIELDS = ("req_pool_idx", "last_node", "prefix_indices")

_MATCH_NAMES = {"input_ids": "key"}
_INSERT_NAMES = {"input_ids": "key", "indices": "value"}
_LOCK_NAMES = {"handle": "node"}


class RadixCache:
    """SGLang's RadixCache over one radixkv native tree.

    Construct it as later SGLang 0.5.x does, `RadixCache(params)` with a
    CacheInitParams (SGLang's, or any object with its fields), as early 0.5.x
    did, `RadixCache(req_to_token_pool, token_to_kv_pool_allocator, page_size,
    disable=False, ...)`, by keywords, or with `create_simulated(...)`.
    `max_slots` (radixkv's) refuses slots at or past the KV pool's size.
    `max_namespaces` bounds the extra_key names remembered (least recently
    used forgotten first: its prefixes become a miss, never a wrong hit; see
    radixkv.scheduler.namespaces).
    """

    def __init__(
        self,
        params=None,
        token_to_kv_pool_allocator=None,
        page_size=None,
        disable: bool = False,
        enable_kv_cache_events: bool = False,
        eviction_policy: str = "lru",
        is_eagle: bool = False,
        *,
        req_to_token_pool=None,
        max_slots: Optional[int] = None,
        max_namespaces: int = 1 << 16,
        kv_event_lora_names=None,
        dynamo_kv_event_format: bool = False,
    ):
        if _looks_like_init_params(params):
            p = params
            req_to_token_pool = p.req_to_token_pool
            token_to_kv_pool_allocator = p.token_to_kv_pool_allocator
            page_size = p.page_size
            disable = p.disable
            enable_kv_cache_events = getattr(p, "enable_kv_cache_events", False)
            eviction_policy = getattr(p, "eviction_policy", "lru")
            is_eagle = getattr(p, "is_eagle", False)
            kv_event_lora_names = getattr(p, "kv_event_lora_names", None)
            dynamo_kv_event_format = getattr(p, "dynamo_kv_event_format", False)
        elif params is not None:
            req_to_token_pool = params  # early 0.5.x: the first argument is the pool
        page_size = as_count(1 if page_size is None else page_size, "page_size")
        if is_eagle:
            raise NotImplementedError("is_eagle: bigram keys are not supported by radixkv's tree")
        if dynamo_kv_event_format:
            raise NotImplementedError(
                "dynamo_kv_event_format: radixkv's block hashes are its "
                "page keys, in SGLang's event format only"
            )
        if not isinstance(eviction_policy, str):
            raise TypeError(f"eviction_policy must be a str, got {type(eviction_policy).__name__}")
        policy = check_eviction_policy(eviction_policy.lower(), eviction_policy)
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.page_size = page_size
        self.disable = bool(disable)
        self.is_eagle = False
        self.eviction_policy = policy
        self.enable_kv_cache_events = bool(enable_kv_cache_events) and not self.disable
        self._events: list = []
        self._page_hash: dict = {}  # a cached page's first slot -> its block hash
        self._lora_names = kv_event_lora_names  # SGLang's LoRANameTable: extra_key -> name
        self._ns_tags: dict = {}  # namespace id -> (extra_key, cache_salt), for events
        dev = getattr(token_to_kv_pool_allocator, "device", None)
        self.device = (
            torch.device(dev) if isinstance(dev, (str, torch.device)) else torch.device("cpu")
        )
        self._on_cpu = self.device.type == "cpu"
        self._tree = _core.RadixTree(page_size, as_max_slots(max_slots), policy)
        self._max_namespaces = as_count(max_namespaces, "max_namespaces")
        self.reset()

    @classmethod
    def create_simulated(
        cls, disable: bool = False, mock_allocator=None, page_size: int = 1, **kwargs
    ) -> "RadixCache":
        """A cache without a req-to-token pool (SGLang's, for simulations)."""
        return cls(None, mock_allocator, page_size, disable, **kwargs)

    # ---- keys ----

    def _key(self, key):
        """(token ids, namespace id) of a RadixKey-like key (anything with
        `token_ids`) or of plain token ids (namespace 0, extra_key None)."""
        ids = getattr(key, "token_ids", None)
        if ids is None:
            if key is None:
                raise TypeError("key must be a RadixKey or a sequence of token ids, got None")
            return key, 0
        if getattr(key, "is_bigram", False):
            raise NotImplementedError("key.is_bigram: bigram keys are not supported")
        limit = getattr(key, "limit", None)
        if limit is not None:
            limit = as_count(limit, "key.limit", 0)
            if limit < len(ids):
                ids = ids[:limit]
        extra = getattr(key, "extra_key", None)
        salt = getattr(key, "cache_salt", None)
        if extra is None and salt is None:
            return ids, 0
        return ids, self._namespace_id(extra, salt)

    def _namespace_id(self, extra, salt=None) -> int:
        """The tree's namespace id for an extra_key (and cache_salt)."""
        if not HAS_NAMESPACES:
            raise NotImplementedError(
                f"extra_key={extra!r}: this radixkv build's RadixTree has no namespaces "
                "(match_prefix(..., namespace=)), so only extra_key=None is supported"
            )
        if salt is not None:
            # SGLang's names are str; the pair becomes one bytes name, both parts
            # length-prefixed, so no two pairs and no str name share it.
            Namespaces.check(extra, "extra_key")
            Namespaces.check(salt, "cache_salt")
            parts = [
                repr(bytes(x) if isinstance(x, (bytearray, memoryview)) else x).encode("utf-8")
                for x in (extra, salt)
            ]
            name = b"".join(len(p).to_bytes(8, "little") + p for p in parts)
        else:
            name = extra
        ns = self._namespaces.id(name, "extra_key")
        if self.enable_kv_cache_events:
            self._ns_tags[ns] = (extra, salt)  # ids are reused: at most max_namespaces
        return ns

    def _match(self, ids, ns: int):
        if not self._on_cpu:
            ids = to_host(ids, "key", self.device)
        try:
            if ns:
                return self._tree.match_prefix(ids, namespace=ns)
            return self._tree.match_prefix(ids)
        except (TypeError, ValueError) as e:
            raise _renamed(e, _MATCH_NAMES) from None

    def _insert_ids(self, ids, values, priority: int, ns: int) -> int:
        """The native insert (whole pages of ids; values as long as ids)."""
        if not self._on_cpu:
            ids, values = to_host(ids, "key", self.device), to_host(values, "value", self.device)
        try:
            if ns:
                prefix = self._tree.insert_prefix(ids, values, priority, namespace=ns)
            else:
                prefix = self._tree.insert_prefix(ids, values, priority)
        except (TypeError, ValueError) as e:
            raise _renamed(e, _INSERT_NAMES) from None
        if self.enable_kv_cache_events:
            self._stored(ids, values, prefix, ns)
        return prefix

    def _stored(self, ids, values, prefix: int, ns: int) -> None:
        """One BlockStored per page the insert added (as SGLang records
        them), each page's block hash chained over the pages before it from
        the sequence's start, seeded by its namespace."""
        ps = self.page_size
        pages = len(ids) // ps
        if prefix >= pages * ps:
            return
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        if not self._namespaces.known(ns):  # its name was forgotten: no seed, no events
            return
        keys = _core.page_keys(ids[: pages * ps], ps, self._namespaces.seed(ns, None))
        stored = _event_types()[0]
        extra, salt = self._ns_tags.get(ns, (None, None)) if ns else (None, None)
        tags = {}
        if _has_field(stored, "cache_salt"):  # SGLang's events; radixkv's lack them
            lora = self._lora_names.get(extra) if self._lora_names is not None else None
            tags = {"cache_salt": salt, "lora_name": lora}
        for p in range(prefix // ps, pages):
            h = _signed(block_hash(keys[p]))
            self._queue(
                stored(
                    block_hashes=[h],
                    parent_block_hash=_signed(block_hash(keys[p - 1])) if p else None,
                    token_ids=[int(t) for t in ids[p * ps : (p + 1) * ps]],
                    block_size=ps,
                    lora_id=None,
                    medium=MEDIUM_GPU,
                    **tags,
                )
            )
            self._page_hash[int(values[p * ps])] = h

    def _queue(self, event) -> None:
        """Queues `event`, joining it to the last one where it continues it
        (SGLang 0.5.23 does the same): a BlockStored whose parent is the
        last page of a BlockStored of the same tags, a BlockRemoved after a
        BlockRemoved of the same medium."""
        if self._events:
            tail = self._events[-1]
            if type(tail) is type(event) and tail.medium == event.medium:
                if hasattr(event, "parent_block_hash"):
                    same = all(
                        getattr(tail, f, None) == getattr(event, f, None)
                        for f in ("lora_id", "block_size", "cache_salt", "lora_name")
                    )
                    if (
                        same
                        and tail.block_hashes
                        and event.parent_block_hash == tail.block_hashes[-1]
                    ):
                        tail.block_hashes.extend(event.block_hashes)
                        tail.token_ids.extend(event.token_ids)
                        return
                elif hasattr(event, "block_hashes"):
                    tail.block_hashes.extend(event.block_hashes)
                    return
        self._events.append(event)

    def _device_indices(self, indices: torch.Tensor) -> torch.Tensor:
        # int64, as SGLang's: its kernels read prefix indices through int64 pointers
        if self._on_cpu:
            return indices.long()
        return indices.to(device=self.device, dtype=torch.int64, non_blocking=True)

    # ---- SGLang's public API ----

    def reset(self) -> None:
        self._tree.reset()
        if self.enable_kv_cache_events:
            self._page_hash.clear()
            self._ns_tags.clear()
            self._events.append(_event_types()[2]())
        self._namespaces = Namespaces(self._max_namespaces)
        self.root_node, empty = self._tree.match_prefix([])
        self._empty = self._device_indices(empty)

    def match_prefix(self, params, **kwargs) -> MatchResult:
        """Longest cached prefix of the key (page-aligned), as MatchResult.

        `params` is a MatchPrefixParams (or anything with `.key`), a RadixKey,
        or a plain sequence / 1-D tensor of token ids (extra_key None).
        """
        if self.disable:
            return MatchResult(self._empty, self.root_node, self.root_node)
        ids, ns = self._key(getattr(params, "key", params))
        handle, indices = self._match(ids, ns)
        return MatchResult(self._device_indices(indices), handle, handle)

    def insert(self, params, value=None, chunked: bool = False, priority: int = 0):
        """Cache the key's whole pages that are not cached yet, with `value`
        (their KV slots; the token ids themselves when None, as SGLang does).

        With an InsertParams returns InsertResult(prefix_len); with a key (a
        RadixKey or token ids) and `value` returns prefix_len, as early 0.5.x
        did. prefix_len is how many leading tokens were cached already: the
        caller frees its own slots for those.
        """
        as_params = hasattr(params, "key")
        if self.disable:
            return InsertResult(prefix_len=0) if as_params else 0
        if as_params:
            key, value, priority = params.key, params.value, params.priority
        else:
            key = params
        ids, ns = self._key(key)
        priority = _priority(as_int(priority or 0, "priority"))
        n = _length(ids, "key")
        given = value is not None
        if not given:
            value = ids
        elif _length(value, "value") != n:
            if len(value) < n:
                raise ValueError(f"value has length {len(value)} but key has length {n}")
            value = value[:n]  # SGLang cuts value to the key
        try:
            prefix = self._insert_ids(ids, value, priority, ns)
        except ValueError as e:
            if given or "appears twice" not in str(e):
                raise
            raise ValueError(
                "value=None stands for the key's token ids as slots, and this "
                "key repeats a token: radixkv's tree keeps each slot in one "
                "place; pass value (the key's slots)"
            ) from None
        return InsertResult(prefix_len=prefix) if as_params else prefix

    def evict(self, params) -> EvictResult:
        """Evict at least `num_tokens` (an int or EvictParams.num_tokens), least
        recently used unlocked leaves first, whole nodes, as far as there is
        anything evictable; their slots go to the allocator's `free`."""
        num = params.num_tokens if hasattr(params, "num_tokens") else params
        num = as_int(num, "num_tokens")
        if num < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num}")
        if self.disable:
            return EvictResult()
        num = min(num, self._tree.size_info()[0])
        if num == 0:
            return EvictResult()
        freed = self._tree.evict(num)
        if self.enable_kv_cache_events:
            hashes = [
                h
                for h in map(self._page_hash.pop, freed.tolist(), [None] * len(freed))
                if h is not None
            ]
            if hashes:
                self._queue(_event_types()[1](block_hashes=hashes, medium=MEDIUM_GPU))
        if self.token_to_kv_pool_allocator is not None:
            self.token_to_kv_pool_allocator.free(self._device_indices(freed))
        return EvictResult(num_tokens_evicted=len(freed))

    def _lock(self, node, unlock: bool) -> IncLockRefResult:
        if self.disable:
            return IncLockRefResult(0)
        before = self._tree.size_info()[0]
        try:
            self._tree.lock_handle(node, unlock)
        except (TypeError, ValueError) as e:
            raise _renamed(e, _LOCK_NAMES) from None
        return IncLockRefResult(self._tree.size_info()[0] - before)

    def inc_lock_ref(self, node) -> IncLockRefResult:
        """Protect the path from `node` to the root; returns the change of
        evictable_size (<= 0)."""
        return self._lock(node, False)

    def dec_lock_ref(self, node, params=None) -> DecLockRefResult:
        """Undo one inc_lock_ref of `node`; returns the change of evictable_size (>= 0)."""
        return self._lock(node, True)

    def evictable_size(self) -> int:
        return self._tree.size_info()[0]

    def protected_size(self) -> int:
        return self._tree.size_info()[1]

    def total_size(self) -> int:
        evictable, protected = self._tree.size_info()
        return evictable + protected

    # What SGLang's scheduler asks a plain RadixCache: no sliding-window or
    # mamba state, no fast path, no host tier acks, no KV events.
    def supports_prefix_sharing(self) -> bool:
        return not self.disable

    def is_chunk_cache(self) -> bool:
        return False

    def is_tree_cache(self) -> bool:
        return True

    def supports_swa(self) -> bool:
        return False

    def supports_mamba(self) -> bool:
        return False

    def supports_fast_match_prefix(self) -> bool:
        return False

    def flush_write_through_acks(self) -> None:
        pass

    def take_events(self) -> list:
        """The KV events since the last call (empty unless
        enable_kv_cache_events): SGLang's event types where SGLang is
        installed, radixkv.events' (the same fields) where it is not."""
        events, self._events = self._events, []
        return events

    def available_and_evictable_str(self) -> str:
        available = self.token_to_kv_pool_allocator.available_size()
        evictable = self.evictable_size()
        return (
            f"Available tokens: {available + evictable} "
            f"(available_size={available} + evictable_size={evictable})\n"
        )

    def path_device_indices(self, node) -> torch.Tensor:
        """The slots on the path from the root to `node` (int64, the cache's device)."""
        try:
            return self._device_indices(self._tree.handle_slots(node))
        except (TypeError, ValueError) as e:
            raise _renamed(e, _LOCK_NAMES) from None

    def all_values_flatten(self) -> torch.Tensor:
        """Every cached slot (int64), parents before children."""
        slots = [s for row in self._tree.dump() for s in row.device_slots]
        return torch.tensor(slots, dtype=torch.int64, device=self.device)

    def pretty_print(self) -> None:
        depth: List[int] = []
        for row in self._tree.dump():
            depth.append(0 if row.parent < 0 else depth[row.parent] + 1)
            print(" " * (2 * depth[-1] + 1), len(row.tokens), row.tokens[:10], f"r={row.ref_count}")
        print(f"#tokens: {self.total_size()}")

    def check_integrity(self) -> None:
        """radixkv's full walk of the tree (raises IntegrityError on a violation)."""
        self._tree.check_integrity()

    # ---- per request ----

    def _row(self, req, length: int) -> torch.Tensor:
        rows = self.req_to_token_pool.req_to_token
        idx = req.req_pool_idx
        if idx is None or isinstance(idx, bool):
            raise TypeError(f"req.req_pool_idx must be the request's row, got {idx!r}")
        idx = as_int(idx, "req.req_pool_idx")
        if not 0 <= idx < rows.shape[0]:
            raise ValueError(
                f"req.req_pool_idx is {idx} but req_to_token_pool has " f"{rows.shape[0]} rows"
            )
        return rows[idx, :length]

    def _check_req(self, req, fields: tuple) -> None:
        if self.req_to_token_pool is None or self.token_to_kv_pool_allocator is None:
            raise ValueError(
                "this cache has no req_to_token_pool or token_to_kv_pool_allocator "
                "(create_simulated): it cannot cache requests"
            )
        for field in fields:
            if not hasattr(req, field):
                raise TypeError(f"req has no {field}: SGLang's Req has it")

    @staticmethod
    def _protected_len(req) -> int:
        n = getattr(req, "cache_protected_len", None)
        return len(req.prefix_indices) if n is None else n

    def _free(self, indices: torch.Tensor) -> None:
        if len(indices):
            self.token_to_kv_pool_allocator.free(indices)

    def _req_namespace(self, req) -> int:
        """The namespace the request matched in: its lock's (`req.last_node`,
        which stays right when its name has left the table meanwhile), else
        its extra_key's (a lock on the root of the default namespace)."""
        node = req.last_node
        if isinstance(node, _core.RadixCacheHandle) and node.namespace:
            return node.namespace
        extra = getattr(req, "extra_key", None)
        salt = getattr(req, "cache_salt", None)
        if extra is None and salt is None:
            return 0
        return self._namespace_id(extra, salt)

    def _check_lock(self, req, protected: int, n: int, length_name: str) -> None:
        """What the request holds is checked before anything changes: its
        lock is one of this cache's and held, the part of its row the tree
        owns (`cache_protected_len`) covers its lock's cached prefix and lies
        within the tokens handed over."""
        node = req.last_node
        if node is not None:
            if not isinstance(node, _core.RadixCacheHandle):
                raise TypeError(
                    "req.last_node must be a node from this cache's match_prefix, "
                    f"got {type(node).__name__}"
                )
            if not self._tree.is_valid(node):
                raise ValueError("req.last_node is stale or belongs to another cache")
            if node.lock_count < 1:
                raise ValueError("req.last_node is not locked: inc_lock_ref it after the match")
            if protected < node.cached_len:
                raise ValueError(
                    f"req.cache_protected_len is {protected} but req.last_node "
                    f"covers {node.cached_len} tokens the tree owns"
                )
        if protected < 0 or protected > n:
            raise ValueError(
                f"{length_name} is {n} but req.cache_protected_len is {protected}: "
                "the tree owns the request's first cache_protected_len tokens"
            )

    @staticmethod
    def _request_ids(req):
        """The request's tokens: prompt then output, as SGLang keeps them."""
        ids, out = req.origin_input_ids, req.output_ids
        for name, v in (("req.origin_input_ids", ids), ("req.output_ids", out)):
            if not isinstance(v, (list, tuple, array)):
                raise TypeError(
                    f"{name} must be a list or array of token ids, as SGLang's Req "
                    f"keeps them, got {type(v).__name__}"
                )
        return ids + out if type(ids) is type(out) else list(ids) + list(out)

    def _insert_req(self, req, token_ids, kv_indices, ns: int) -> int:
        # The native tree takes the whole pages of equal-length ids and slots.
        priority = _priority(as_int(getattr(req, "priority", 0) or 0, "req.priority"))
        return self._insert_ids(token_ids, kv_indices, priority, ns)

    def cache_finished_req(
        self, req, is_insert: bool = True, *, kv_len_to_handle: Optional[int] = None, **kwargs
    ) -> None:
        """A finished request hands its KV to the cache.

        Its first `kv_len_to_handle` tokens (default: what `req.
        pop_committed_kv_cache()` returns where the request has it, else
        all tokens but the last, whose KV was never computed) are inserted
        in whole pages; the slots of tokens another request cached meanwhile,
        and of the partial last page, go back to the allocator; the request's
        lock is dropped. Its req-to-token row is the caller's to free.
        """
        self._check_req(req, _FINISHED_FIELDS)
        if kv_len_to_handle is None:
            pop = getattr(req, "pop_committed_kv_cache", None)
            kv_len_to_handle = (
                pop()
                if pop is not None
                else len(req.origin_input_ids) + max(len(req.output_ids) - 1, 0)
            )
        kv_len = as_int(kv_len_to_handle, "kv_len_to_handle")
        if kv_len < 0:
            raise ValueError(f"kv_len_to_handle must be >= 0, got {kv_len}")
        protected = self._protected_len(req)
        if self.disable:
            self._free(self._row(req, kv_len)[protected:])
            return
        token_ids = self._request_ids(req)[:kv_len]
        n = len(token_ids)
        self._check_lock(req, protected, n, "the length handed over (kv_len_to_handle)")
        ns = self._req_namespace(req)
        kv_indices = self._row(req, n)
        aligned = n // self.page_size * self.page_size
        # Not inserted: its whole pages go back as if cached already.
        prefix = self._insert_req(req, token_ids, kv_indices, ns) if is_insert else aligned
        for slots in released_slots(kv_indices, protected, prefix, n, self.page_size, True):
            self._free(slots)
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)

    def cache_unfinished_req(self, req, chunked: bool = False, **kwargs) -> None:
        """A request still running (chunked prefill) caches what it has
        computed: the new whole pages go into the tree, its duplicates go back
        to the allocator, its req-to-token row is pointed at the tree's slots,
        and its lock moves to the new last node (`req.last_node`,
        `req.prefix_indices`, `req.cache_protected_len` are updated)."""
        if self.disable:
            return
        self._check_req(req, _UNFINISHED_FIELDS)
        if not hasattr(req, "fill_ids") and not hasattr(req, "get_fill_ids"):
            raise TypeError("req has neither fill_ids nor get_fill_ids(): SGLang's Req has one")
        get = getattr(req, "get_fill_ids", None)
        token_ids = get() if get is not None else req.fill_ids
        if not isinstance(token_ids, (list, tuple, array, torch.Tensor)):
            raise TypeError(
                f"req.fill_ids must be the request's token ids, got " f"{type(token_ids).__name__}"
            )
        protected = self._protected_len(req)
        self._check_lock(req, protected, len(token_ids), "len(req.fill_ids)")
        ns = self._req_namespace(req)
        kv_indices = self._row(req, len(token_ids))
        prefix = self._insert_req(req, token_ids, kv_indices, ns)
        self._free(
            released_slots(kv_indices, protected, prefix, len(token_ids), self.page_size, False)[0]
        )
        handle, tree_slots = self._match(token_ids, ns)
        new_indices = self._device_indices(tree_slots)
        n = len(new_indices)
        if n > protected:
            self.req_to_token_pool.write(
                (req.req_pool_idx, slice(protected, n)), new_indices[protected:]
            )
        req.cache_protected_len = n
        self.inc_lock_ref(handle)
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)
        req.prefix_indices = (
            torch.cat([new_indices, kv_indices[n:].to(torch.int64)])
            if n < len(kv_indices)
            else new_indices
        )
        req.last_node = handle
