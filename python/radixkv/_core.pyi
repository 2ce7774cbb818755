"""Type stubs of the private native module radixkv._core."""

from typing import Any, Final, List, Literal, Optional, Sequence, Tuple, Union, final, overload

import numpy as np
import torch
from _typeshed import structseq

from radixkv.kvcache.base import BaseCacheHandle

_Ids = Union[torch.Tensor, np.ndarray, Sequence[int]]

class OutOfCapacityError(RuntimeError): ...
class IntegrityError(RuntimeError): ...

EVICTION_POLICIES: Tuple[str, ...]

def first_mismatch(a: _Ids, b: _Ids) -> int: ...
def int32_tensor(values: _Ids, name: str = "values") -> torch.Tensor: ...
def crc32c(data: object, value: int = 0) -> int: ...
def encode_float8_page(
    page: object,
    out: object,
    planes: int,
    rows: int,
    heads: int,
    head_dim: int,
    dtype: str,
    rest_bytes: int = 0,
) -> None: ...
def decode_float8_page(
    data: object,
    page: object,
    planes: int,
    rows: int,
    heads: int,
    head_dim: int,
    dtype: str,
    rest_bytes: int = 0,
) -> None: ...
def float8_page_bytes(
    planes: int, rows: int, heads: int, head_dim: int, dtype: str, rest_bytes: int = 0
) -> int: ...

# Hex keys (a list of str), or with `raw` the 32-byte keys back to back (bytes).
@overload
def page_keys(
    input_ids: _Ids,
    page_size: int,
    seed: Optional[bytes] = None,
    raw: Literal[False] = False,
    key: Optional[bytes] = None,
) -> List[str]: ...
@overload
def page_keys(
    input_ids: _Ids,
    page_size: int,
    seed: Optional[bytes],
    raw: Literal[True],
    key: Optional[bytes] = None,
) -> bytes: ...
@overload
def page_keys(
    input_ids: _Ids,
    page_size: int,
    seed: Optional[bytes] = None,
    *,
    raw: Literal[True],
    key: Optional[bytes] = None,
) -> bytes: ...
@overload
def page_keys(
    input_ids: _Ids,
    page_size: int,
    seed: Optional[bytes] = None,
    raw: bool = False,
    key: Optional[bytes] = None,
) -> Union[List[str], bytes]: ...
def keyed_page_keys(raw_keys: object, key: bytes) -> List[str]: ...
def hmac_sha256(key: bytes, parts: Sequence[object]) -> bytes: ...
def pack_block_stored(
    block_hashes: object,
    parent_block_hash: Optional[int],
    token_ids: object,
    block_size: int,
    lora_id: Optional[int],
    medium: Optional[str],
) -> bytes: ...
def pack_block_removed(block_hashes: object, medium: Optional[str]) -> bytes: ...
@final
class shielded:
    """Calls `fn` with every signal whose handler is a Python callable (but a
    fault's) held back until it returns."""

    __wrapped__: Any
    def __new__(cls, fn: Any) -> shielded: ...
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...
    def __get__(self, instance: Any, owner: Any = None, /) -> Any: ...

def check_ids(values: _Ids, name: str) -> int: ...
def check_slots(values: _Ids, name: str, limit: int = -1) -> int: ...

# A float8 store's scale: a number or a one-element floating tensor.
_Scale = Union[float, torch.Tensor, None]
# Side buffers a store also writes: (name, buffer [num_slots, W], source [n, W]).
_Sides = Optional[Sequence[Tuple[str, torch.Tensor, torch.Tensor]]]

def store_cache(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pool_views: bool = False,
    k_scale: _Scale = None,
    v_scale: _Scale = None,
    side: _Sides = None,
) -> None: ...
def store_mla(
    kv_cache: torch.Tensor,
    out_loc: torch.Tensor,
    k_nope: torch.Tensor,
    k_rope: torch.Tensor,
    kv_lora_rank: int,
    pool_views: bool = False,
    k_scale: _Scale = None,
    side: _Sides = None,
) -> None: ...
def first_mismatch_batched(
    query: torch.Tensor, keys: torch.Tensor, key_lens: Optional[torch.Tensor], out: torch.Tensor
) -> None: ...

# radixkv.kvcache registers it as a BaseCacheHandle (BaseCacheHandle.register),
# which `import radixkv` always does.
@final
class RadixCacheHandle(BaseCacheHandle):
    @property
    def cached_len(self) -> int: ...
    @property
    def lock_count(self) -> int: ...
    @property
    def host_hit_len(self) -> int: ...
    @property
    def namespace(self) -> int: ...

# Struct sequences: tuples whose fields also have names.
@final
class TierCopy(structseq[int], Tuple[int, int, int, int]):
    """A copy between the tiers: the tokens at depths [start, end) of the path that
    ends at node node_id, whose incarnation (bumped only when its id is freed) it was."""

    __match_args__: Final = ("node_id", "incarnation", "start", "end")
    @property
    def node_id(self) -> int: ...
    @property
    def incarnation(self) -> int: ...
    @property
    def start(self) -> int: ...
    @property
    def end(self) -> int: ...

@final
class TierSizes(structseq[int], Tuple[int, int, int, int, int, int, int]):
    """Token counts of the two tiers."""

    __match_args__: Final = (
        "device_evictable",
        "device_protected",
        "host",
        "host_only",
        "backing_up",
        "loading",
        "storage_writing",
    )
    @property
    def device_evictable(self) -> int: ...
    @property
    def device_protected(self) -> int: ...
    @property
    def host(self) -> int: ...
    @property
    def host_only(self) -> int: ...
    @property
    def backing_up(self) -> int: ...
    @property
    def loading(self) -> int: ...
    @property
    def storage_writing(self) -> int: ...

@final
class DumpRow(structseq[Any], Tuple[int, List[int], List[int], int, int]):
    """A node in dump(); its namespace is a field by name only."""

    __match_args__: Final = ("parent", "tokens", "device_slots", "ref_count", "timestamp")
    @property
    def parent(self) -> int: ...
    @property
    def tokens(self) -> List[int]: ...
    @property
    def device_slots(self) -> List[int]: ...
    @property
    def ref_count(self) -> int: ...
    @property
    def timestamp(self) -> int: ...
    @property
    def namespace(self) -> int: ...

@final
class DumpRowNs(structseq[Any], Tuple[int, List[int], List[int], int, int, int]):
    """A node in dump(namespaces=True)."""

    __match_args__: Final = (
        "parent",
        "tokens",
        "device_slots",
        "ref_count",
        "timestamp",
        "namespace",
    )
    @property
    def parent(self) -> int: ...
    @property
    def tokens(self) -> List[int]: ...
    @property
    def device_slots(self) -> List[int]: ...
    @property
    def ref_count(self) -> int: ...
    @property
    def timestamp(self) -> int: ...
    @property
    def namespace(self) -> int: ...

@final
class TierDumpRow(structseq[Any], Tuple[int, List[int], List[int], List[int], int, int]):
    """A node in dump(tiers=True); its namespace is a field by name only."""

    __match_args__: Final = (
        "parent",
        "tokens",
        "device_slots",
        "host_slots",
        "ref_count",
        "timestamp",
    )
    @property
    def parent(self) -> int: ...
    @property
    def tokens(self) -> List[int]: ...
    @property
    def device_slots(self) -> List[int]: ...
    @property
    def host_slots(self) -> List[int]: ...
    @property
    def ref_count(self) -> int: ...
    @property
    def timestamp(self) -> int: ...
    @property
    def namespace(self) -> int: ...

@final
class TierDumpRowNs(structseq[Any], Tuple[int, List[int], List[int], List[int], int, int, int]):
    """A node in dump(tiers=True, namespaces=True)."""

    __match_args__: Final = (
        "parent",
        "tokens",
        "device_slots",
        "host_slots",
        "ref_count",
        "timestamp",
        "namespace",
    )
    @property
    def parent(self) -> int: ...
    @property
    def tokens(self) -> List[int]: ...
    @property
    def device_slots(self) -> List[int]: ...
    @property
    def host_slots(self) -> List[int]: ...
    @property
    def ref_count(self) -> int: ...
    @property
    def timestamp(self) -> int: ...
    @property
    def namespace(self) -> int: ...

# What calls that take a copy back accept: a TierCopy, or any tuple
# (node_id, incarnation, start, end).
_Copy = Union[TierCopy, Tuple[int, int, int, int]]

@final
class RadixTree:
    def __new__(
        cls,
        page_size: int = 1,
        max_slots: int = -1,
        eviction_policy: str = "lru",
        tel_safe_tokens: int = 0,
        aligned_pages: bool = False,
    ) -> RadixTree: ...
    @property
    def page_size(self) -> int: ...
    @property
    def max_slots(self) -> int: ...
    @property
    def eviction_policy(self) -> str: ...
    @property
    def num_nodes(self) -> int: ...
    @property
    def host_pins(self) -> int: ...
    @property
    def claimed_size(self) -> int: ...
    def claim(
        self, handle: RadixCacheHandle, host: bool = False, priority: int = 0
    ) -> Tuple[TierCopy, int]: ...
    def claim_cost(self, handle: RadixCacheHandle, host: bool = False) -> int: ...
    def prefix_claim_cost(self, input_ids: _Ids, namespace: int = 0, host: bool = False) -> int: ...
    def release_claim(self, claim: _Copy) -> int: ...
    def claimed_path(self, handle: RadixCacheHandle) -> List[int]: ...
    def locked_beyond_claims(self) -> int: ...
    def storage_hit_len(self, handle: RadixCacheHandle) -> int: ...
    def match_prefix(
        self, input_ids: _Ids, namespace: int = 0, skip_last: bool = False
    ) -> Tuple[RadixCacheHandle, torch.Tensor]: ...
    @overload
    def match_prefix_batch(
        self,
        batch: Sequence[_Ids],
        namespace: Union[int, List[int], Tuple[int, ...]] = 0,
        skip_last: bool = False,
        flat: Literal[False] = False,
    ) -> List[Tuple[RadixCacheHandle, torch.Tensor]]: ...
    @overload
    def match_prefix_batch(
        self,
        batch: Sequence[_Ids],
        namespace: Union[int, List[int], Tuple[int, ...]] = 0,
        skip_last: bool = False,
        *,
        flat: Literal[True],
    ) -> Tuple[List[RadixCacheHandle], torch.Tensor]: ...
    def insert_prefix(
        self, input_ids: _Ids, indices: _Ids, priority: int = 0, namespace: int = 0
    ) -> int: ...
    def lock_handle(self, handle: RadixCacheHandle, unlock: bool = False) -> None: ...
    def evict(self, size: int) -> torch.Tensor: ...
    def reset(self) -> None: ...
    def size_info(self) -> Tuple[int, int]: ...
    def evictable_size(self) -> int: ...
    def protected_size(self) -> int: ...
    def check_integrity(self) -> None: ...
    @overload
    def dump(
        self, tiers: Literal[False] = False, namespaces: Literal[False] = False
    ) -> List[DumpRow]: ...
    @overload
    def dump(
        self, tiers: Literal[False] = False, *, namespaces: Literal[True]
    ) -> List[DumpRowNs]: ...
    @overload
    def dump(self, tiers: Literal[False], namespaces: Literal[True]) -> List[DumpRowNs]: ...
    @overload
    def dump(
        self, tiers: Literal[True], namespaces: Literal[False] = False
    ) -> List[TierDumpRow]: ...
    @overload
    def dump(self, tiers: Literal[True], namespaces: Literal[True]) -> List[TierDumpRowNs]: ...
    @overload
    def dump(
        self, tiers: bool = False, namespaces: bool = False
    ) -> Union[List[DumpRow], List[DumpRowNs], List[TierDumpRow], List[TierDumpRowNs]]: ...
    def is_valid(self, handle: RadixCacheHandle) -> bool: ...
    def handle_slots(self, handle: RadixCacheHandle) -> torch.Tensor: ...
    # The page forms (a tree made with aligned_pages): page ids where the
    # calls above take or give slots.
    def match_pages(
        self, input_ids: _Ids, namespace: int = 0, skip_last: bool = False
    ) -> Tuple[RadixCacheHandle, torch.Tensor]: ...
    def handle_pages(self, handle: RadixCacheHandle) -> torch.Tensor: ...
    def evict_pages(self, size: int) -> torch.Tensor: ...
    def evict_host_pages(self, size: int) -> torch.Tensor: ...
    def start_backup_pages(
        self,
        input_ids: _Ids,
        host_pages: PageAllocator,
        min_hits: int = 0,
        through_partial: bool = False,
        namespace: int = 0,
    ) -> Optional[
        Union[Tuple[TierCopy, torch.Tensor, torch.Tensor], Tuple[TierCopy, None, None]]
    ]: ...
    def finish_backup_pages(
        self,
        copy: _Copy,
        host_page_ids: _Ids,
        ok: bool = True,
        host_pages: Optional[PageAllocator] = None,
    ) -> torch.Tensor: ...
    def finish_request_pages(
        self,
        old_handle: RadixCacheHandle,
        input_ids: _Ids,
        page_ids: _Ids,
        pages: PageAllocator,
        priority: int = 0,
        ledger: Optional[BlockLedger] = None,
        seed: Optional[bytes] = None,
    ) -> int: ...
    def cache_request_pages(
        self,
        old_handle: RadixCacheHandle,
        input_ids: _Ids,
        page_ids: _Ids,
        pages: PageAllocator,
        priority: int = 0,
        ledger: Optional[BlockLedger] = None,
        seed: Optional[bytes] = None,
    ) -> Tuple[RadixCacheHandle, torch.Tensor, int]: ...
    def finish_requests_pages(
        self,
        batch: Sequence[Tuple[RadixCacheHandle, _Ids, _Ids]],
        pages: PageAllocator,
        priority: Union[int, Sequence[int]] = 0,
    ) -> List[int]: ...
    def finish_requests_flat_pages(
        self,
        handles: Sequence[RadixCacheHandle],
        input_ids: Sequence[_Ids],
        page_ids: _Ids,
        pages: PageAllocator,
        priority: Union[int, Sequence[int]] = 0,
        own: Optional[_Ids] = None,
    ) -> List[int]: ...
    def start_load_pages(
        self, handle: RadixCacheHandle, device_pages: PageAllocator
    ) -> Optional[
        Union[
            Tuple[TierCopy, RadixCacheHandle, torch.Tensor, torch.Tensor],
            Tuple[TierCopy, None, None, None],
        ]
    ]: ...
    def finish_load_pages(self, copy: _Copy, device_page_ids: _Ids, ok: bool = True) -> bool: ...
    # The host tier (see CacheManager): state changes only in finish_*.
    def tier_sizes(self) -> TierSizes: ...
    def evict_host(self, size: int) -> torch.Tensor: ...
    def find_backup(
        self, input_ids: _Ids, min_hits: int = 0, through_partial: bool = False, namespace: int = 0
    ) -> Optional[TierCopy]: ...
    def begin_backup(self, copy: _Copy) -> torch.Tensor: ...
    def start_backup(
        self,
        input_ids: _Ids,
        host_pages: PageAllocator,
        min_hits: int = 0,
        through_partial: bool = False,
        namespace: int = 0,
    ) -> Optional[
        Union[Tuple[TierCopy, torch.Tensor, torch.Tensor], Tuple[TierCopy, None, None]]
    ]: ...
    def finish_backup(
        self,
        copy: _Copy,
        host_slots: _Ids,
        ok: bool = True,
        host_pages: Optional[PageAllocator] = None,
    ) -> torch.Tensor: ...
    def finish_request(
        self,
        old_handle: RadixCacheHandle,
        input_ids: _Ids,
        indices: _Ids,
        pages: PageAllocator,
        priority: int = 0,
        ledger: Optional[BlockLedger] = None,
        seed: Optional[bytes] = None,
    ) -> int: ...
    def cache_request(
        self,
        old_handle: RadixCacheHandle,
        input_ids: _Ids,
        indices: _Ids,
        pages: PageAllocator,
        priority: int = 0,
        ledger: Optional[BlockLedger] = None,
        seed: Optional[bytes] = None,
    ) -> Tuple[RadixCacheHandle, torch.Tensor, int]: ...
    def finish_requests(
        self,
        batch: Sequence[Tuple[RadixCacheHandle, _Ids, _Ids]],
        pages: PageAllocator,
        priority: Union[int, Sequence[int]] = 0,
    ) -> List[int]: ...
    def finish_requests_flat(
        self,
        handles: Sequence[RadixCacheHandle],
        input_ids: Sequence[_Ids],
        indices: _Ids,
        pages: PageAllocator,
        priority: Union[int, Sequence[int]] = 0,
        own: Optional[_Ids] = None,
    ) -> List[int]: ...
    def start_load(
        self, handle: RadixCacheHandle, device_pages: PageAllocator
    ) -> Optional[
        Union[
            Tuple[TierCopy, RadixCacheHandle, torch.Tensor, torch.Tensor],
            Tuple[TierCopy, None, None, None],
        ]
    ]: ...
    def find_load(self, handle: RadixCacheHandle) -> TierCopy: ...
    def begin_load(self, copy: _Copy) -> Tuple[RadixCacheHandle, torch.Tensor, torch.Tensor]: ...
    def begin_load_pages(
        self, copy: _Copy
    ) -> Tuple[RadixCacheHandle, torch.Tensor, torch.Tensor]: ...
    def finish_load(self, copy: _Copy, device_slots: _Ids, ok: bool = True) -> bool: ...
    def eviction_candidates_without_host(
        self, size: int, namespace: Optional[int] = None
    ) -> List[TierCopy]: ...
    def copy_namespace(self, copy: _Copy) -> Optional[int]: ...
    def set_quota(self, namespace: int, device: Optional[int], host: Optional[int]) -> None: ...
    def quotas(self) -> List[Tuple[int, int, int, int, int]]: ...
    def over_quota(self) -> List[Tuple[int, int, int, int, int]]: ...
    def evict_namespace(self, namespace: int, size: int) -> torch.Tensor: ...
    def evict_host_namespace(self, namespace: int, size: int) -> torch.Tensor: ...
    def begin_storage_write(
        self, backup: _Copy
    ) -> Optional[Tuple[TierCopy, torch.Tensor, torch.Tensor, int]]: ...
    def finish_storage_write(self, copy: _Copy) -> None: ...
    def storage_prefix_end(self, input_ids: _Ids, namespace: int = 0) -> Tuple[int, bool]: ...
    def pin_host(self, input_ids: _Ids, namespace: int = 0) -> Optional[TierCopy]: ...
    def unpin_host(self, pin: _Copy) -> None: ...
    def insert_host(
        self, input_ids: _Ids, start: int, host_slots: _Ids, namespace: int = 0
    ) -> torch.Tensor: ...

# pybind11's classes have its metaclass (pybind11_builtins.pybind11_type).
class _pybind11_type(type): ...

class PageAllocator(metaclass=_pybind11_type):
    def __init__(self, num_pages: int, page_size: int = 1) -> None: ...
    @property
    def num_pages(self) -> int: ...
    @property
    def page_size(self) -> int: ...
    @property
    def num_free_pages(self) -> int: ...
    def allocate(self, num_tokens: int) -> torch.Tensor: ...
    def allocate_pages(self, num_tokens: int) -> torch.Tensor: ...
    def free(self, indices: _Ids, tree: Optional[RadixTree] = None, host: bool = False) -> None: ...
    def free_pages(
        self, page_ids: _Ids, tree: Optional[RadixTree] = None, host: bool = False
    ) -> None: ...
    def check_owned(
        self, indices: _Ids, name: str, tree: Optional[RadixTree] = None, host: bool = False
    ) -> None: ...
    def check_disjoint(self, tree: Optional[RadixTree] = None, host: bool = False) -> None: ...

class BlockLedger(metaclass=_pybind11_type):
    def __init__(
        self, device_pages: int, host_pages: int, page_size: int, threaded: bool = False
    ) -> None: ...
    @property
    def page_size(self) -> int: ...
    @property
    def threaded(self) -> bool: ...
    @property
    def pending(self) -> int: ...
    @property
    def device_blocks(self) -> int: ...
    @property
    def host_blocks(self) -> int: ...
    @property
    def lora_id(self) -> Optional[int]: ...
    @lora_id.setter
    def lora_id(self, value: Optional[int]) -> None: ...
    def device_inserted(
        self,
        tokens: _Ids,
        slots: _Ids,
        start: int,
        end: int,
        known: int,
        seed: Optional[bytes] = None,
        page_ids: bool = False,
    ) -> None: ...
    def device_evicted(self, slots: _Ids, page_ids: bool = False) -> None: ...
    def device_loaded(
        self, host_slots: _Ids, device_slots: _Ids, page_ids: bool = False
    ) -> None: ...
    def host_backed_up(
        self, device_slots: _Ids, host_slots: _Ids, rejected: _Ids, page_ids: bool = False
    ) -> None: ...
    def host_evicted(self, slots: _Ids, page_ids: bool = False) -> None: ...
    def host_inserted(
        self,
        tokens: _Ids,
        start: int,
        host_slots: _Ids,
        rejected: _Ids,
        seed: Optional[bytes] = None,
    ) -> None: ...
    def reset(self) -> None: ...
    def take_events(self) -> List[bytes]: ...
    def snapshot(self) -> List[bytes]: ...

class CacheController(metaclass=_pybind11_type):
    # side_planes: (device, device_layout, host, host_layout, row_bytes) of each side
    # buffer copied with the rows; keep: an object the controller holds while it lives;
    # codec: (dtype, heads, head_dim, scales, scales_layout) of a float8 host pool.
    # device: one buffer, or one tensor per (side, layer) plane (an engine's own).
    @overload
    def __init__(
        self,
        device: Union[torch.Tensor, Sequence[torch.Tensor]],
        device_layout: Sequence[int],
        host: torch.Tensor,
        host_layout: Sequence[int],
        row_bytes: int,
        layers: int,
        manual: bool = False,
        side_planes: Optional[Sequence[Tuple[Any, ...]]] = None,
        keep: object = None,
        codec: Optional[Tuple[str, int, int, torch.Tensor, Sequence[int]]] = None,
    ) -> None: ...
    @overload
    def __init__(self, layers: int, manual: bool = False) -> None: ...
    @overload
    def __init__(self, engine: Any, manual: bool = False, keep: object = None) -> None: ...
    def backup(self, device_slots: _Ids, host_slots: _Ids, page_size: int = 1) -> int: ...
    def load(self, host_slots: _Ids, device_slots: _Ids, page_size: int = 1) -> int: ...
    def start_loading(self) -> None: ...
    def wait_layer(self, layer: int) -> None: ...
    def drain(self) -> None: ...
    def wait_loads(self) -> None: ...
    def take_backup_acks(self) -> List[Tuple[int, bool]]: ...
    def take_load_acks(self) -> List[Tuple[int, bool]]: ...
    def complete(self, id: int, ok: bool = True) -> bool: ...
    @property
    def in_flight(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    def waiting(self) -> List[int]: ...

def transfer_rows(
    src: Union[torch.Tensor, Sequence[torch.Tensor]],
    src_layout: Sequence[int],
    dst: Union[torch.Tensor, Sequence[torch.Tensor]],
    dst_layout: Sequence[int],
    row_bytes: int,
    layers: int,
    src_slots: _Ids,
    dst_slots: _Ids,
    layer_begin: int = 0,
    layer_end: int = -1,
) -> int: ...
