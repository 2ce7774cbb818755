"""The cache-manager contract shared by every prefix cache."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import (
    TYPE_CHECKING,
    Generic,
    List,
    NamedTuple,
    Optional,
    Protocol,
    Tuple,
    TypeVar,
    Union,
)

import torch

from radixkv import _core
from radixkv._checks import as_int, per_input, to_host


def fixed_zeros(
    shape: tuple,
    dtype: torch.dtype,
    device="cpu",
    pin_memory: bool = False,
    owners: Optional[list] = None,
) -> torch.Tensor:
    """A zero-filled buffer whose storage cannot be resized: what the pools
    allocate. The copy controller's thread reads and writes their memory
    while the caller holds the tensors, so `untyped_storage().resize_(0)` on
    one must raise instead of freeing memory a copy is using. The memory is
    torch's, held through DLPack, whose tensors have fixed-size storage; the
    tensor that owns it is appended to `owners` (a pool's `memory_owners`),
    which the controller keeps: a storage moved in place (share_memory_())
    then leaves the memory its copies use alive."""
    nbytes = math.prod(shape) * dtype.itemsize
    raw = torch.zeros(nbytes, dtype=torch.uint8, device=device, pin_memory=pin_memory)
    if owners is not None:
        owners.append(raw)
    if raw.device.type in ("cpu", "cuda"):  # (meta tensors have no memory to hold)
        raw = torch.from_dlpack(raw)
    return raw.view(dtype).view(shape)


class SizeInfo(NamedTuple):
    """Cached tokens, split by whether they may be evicted."""

    evictable_size: int
    protected_size: int

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size


class BaseCacheHandle(ABC):
    """The result of a match: names the cached prefix. Opaque but for its length."""

    @property
    @abstractmethod
    def cached_len(self) -> int:
        """Matched tokens."""

    @property
    def host_hit_len(self) -> int:
        """Matched tokens after `cached_len` that only the host tier holds."""
        return 0

    @property
    def namespace(self) -> int:
        """The namespace id the match was made in (0: the default)."""
        return 0


def released_slots(
    indices, owned_from: int, cached_before: int, length: int, page_size: int, finished: bool
) -> list:
    """What a request gives back after `insert_prefix` of its first `length`
    tokens with `indices` (its slots, the cache's before `owned_from`)
    returned `cached_before`: its copies of tokens that were cached already
    (`[owned_from, cached_before)`: another request cached them meanwhile)
    and, once it is finished, the slots past its last whole page. Slices of
    `indices`, possibly empty."""
    out = [indices[owned_from : max(owned_from, cached_before)]]
    if finished:
        out.append(indices[length - length % page_size :])
    return out


class CacheHandle(Protocol):
    """What a manager's handles offer: BaseCacheHandle's contract, which the
    native `_core.RadixCacheHandle` meets too (it is registered as a
    BaseCacheHandle, not derived from it)."""

    @property
    def cached_len(self) -> int: ...

    @property
    def host_hit_len(self) -> int: ...


#: The handle type of a cache manager (its `match_prefix` returns, its `lock_handle` takes).
H = TypeVar("H", bound=CacheHandle)


class BaseCacheManager(ABC, Generic[H]):
    """A prefix cache from token ids to KV slot indices. Lengths are in tokens.
    Generic over its handle type `H`."""

    #: Where the manager's results live (each subclass sets it).
    device: torch.device

    #: The native tree the manager owns (a RadixCacheManager's), which the
    #: tiers behind a CacheManager share; None for managers without one.
    tree: Optional[_core.RadixTree] = None

    @abstractmethod
    def match_prefix(
        self, input_ids, namespace: int = 0, skip_last: bool = False
    ) -> Tuple[H, torch.Tensor]:
        """Longest cached prefix of `input_ids` in whole pages: a handle and its slots (int32).
        Sequences of different namespaces (ints >= 0) never share a prefix. With
        `skip_last` the input is matched without its last token (it must have one)."""

    def match_prefix_batch(
        self, batch, namespace=0, skip_last: bool = False, flat: bool = False
    ) -> Union[List[Tuple[H, torch.Tensor]], Tuple[List[H], torch.Tensor]]:
        """`match_prefix` of each input of a prefill batch, in order. Every
        input is checked before any is matched. `namespace`: one for all, or
        one per input. With `skip_last` each input is matched without its
        last token (each must have one). Returns [(handle, indices), ...], or
        with `flat` ([handle, ...], indices): every match's indices in one
        tensor, back to back."""
        if not isinstance(batch, (list, tuple)):
            raise TypeError(
                "batch must be a list or tuple of token id sequences, got "
                f"{type(batch).__name__}"
            )
        checked = []
        for i, ids in enumerate(batch):
            ids = _core.int32_tensor(to_host(ids, f"batch[{i}]", self.device), f"batch[{i}]")
            if skip_last and ids.shape[0] == 0:
                raise ValueError(f"batch[{i}] must hold at least one token")
            checked.append(ids[:-1] if skip_last else ids)
        spaces = per_input(namespace, len(batch))
        if spaces is None:
            spaces = [namespace] * len(batch)
        out = [self.match_prefix(ids, ns) for ids, ns in zip(checked, spaces)]
        if not flat:
            return out
        if not out:
            return [], torch.empty(0, dtype=torch.int32, device=self.device)
        return [h for h, _ in out], torch.cat([idx for _, idx in out])

    @abstractmethod
    def lock_handle(self, handle: H, unlock: bool = False) -> None:
        """Add (or with `unlock`, remove) one lock on the handle's prefix."""

    @abstractmethod
    def insert_prefix(self, input_ids, indices, priority: int = 0, namespace: int = 0) -> int:
        """Cache what is new of `input_ids`; return how many leading tokens were cached
        already. `priority` matters to the priority eviction policy only."""

    @abstractmethod
    def evict(self, size: int) -> torch.Tensor:
        """Free at least `size` unlocked tokens, least recently used first; return their slots."""

    @abstractmethod
    def is_valid(self, handle: H) -> bool:
        """Whether `handle` came from this manager and still names cached tokens."""

    @abstractmethod
    def reset(self) -> None:
        """Drop everything cached. Earlier handles become invalid."""

    @property
    @abstractmethod
    def size_info(self) -> SizeInfo:
        """Evictable and protected token counts."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Walk all state and raise `radixkv.IntegrityError` on any broken invariant."""

    @abstractmethod
    def handle_slots(self, handle: H) -> torch.Tensor:
        """The slots of `handle`'s match on the device (int32, on the host);
        raises, changing nothing, when they are no longer there."""

    @property
    def num_nodes(self) -> int:
        """Nodes that hold cached tokens (0 for a manager that caches nothing)."""
        return 0

    # -- a request's steps ------------------------------------------------------------
    # What `radixkv.scheduler.CacheManager` calls at a request's end, each one
    # step over the prefix cache and the device pool's pages (`pages`, a
    # `_core.PageAllocator`): every input is checked first (as
    # `radixkv.kvcache.request_inputs` says), and a call that raises changes
    # nothing. Inputs and results are on the host. The radix cache binds the
    # native tree's (`cpp/include/radixkv/request_steps.h`).

    @abstractmethod
    def finish_request(self, old_handle: H, input_ids, indices, pages, priority: int = 0) -> int:
        """A finished request: its whole pages not cached yet join the cache,
        its copies of tokens cached meanwhile and its partial last page are
        freed, `old_handle` is unlocked. Returns the tokens that were cached
        already (as `insert_prefix`)."""

    @abstractmethod
    def finish_requests(self, batch, pages, priority=0) -> List[int]:
        """`finish_request` of each (old_handle, input_ids, indices), all
        checked first and together (no page held by two, no handle finished
        more often than it is locked); `priority` one for all or one each."""

    @abstractmethod
    def finish_requests_flat(
        self, handles, input_ids, indices, pages, priority=0, own=None
    ) -> List[int]:
        """`finish_requests` with the requests' slots back to back in
        `indices` (or their cached parts there and their own pages in `own`)."""

    @abstractmethod
    def cache_request(
        self, old_handle: H, input_ids, indices, pages, priority: int = 0
    ) -> Tuple[H, torch.Tensor, int]:
        """A running request's computed tokens join the cache (chunked
        prefill): returns a new locked handle (`old_handle` is unlocked), the
        indices it goes on with (the cache's slots for its cached part, then
        its own) and the tokens that were cached already."""


# --- the paged KV pool -------------------------------------------------------------

import enum  # noqa: E402


class KVCacheLayout(enum.Enum):
    """How a pool orders its one buffer. Either way `k_cache(layer)` is a
    `[num_pages, page_size, local_kv_heads, head_dim]` view."""

    LayerFirst = "layer_first"
    """Storage `[2, num_layers, num_pages, page_size, H, D]`: each layer's cache is contiguous."""
    PageFirst = "page_first"
    """Storage `[2, num_pages, num_layers, page_size, H, D]`: each page's layers are together."""


class KVCacheType(enum.Enum):
    """What a pool stores per token and layer."""

    MHA = "mha"
    """A key and a value of `[local_kv_heads, head_dim]` per token (MHA and GQA)."""
    MLA = "mla"
    """One latent row of `kv_lora_rank + qk_rope_head_dim` per token (DeepSeek's MLA):
    the value is its first `kv_lora_rank` columns."""


class BaseKVCache(ABC):
    """A preallocated KV pool: per layer, a key and a value cache indexed by token slot."""

    @abstractmethod
    def k_cache(self, index: int) -> torch.Tensor:
        """Layer `index`'s key cache, a view `[num_pages, page_size, local_kv_heads, head_dim]`."""

    @abstractmethod
    def v_cache(self, index: int) -> torch.Tensor:
        """Layer `index`'s value cache: shaped like `k_cache(index)` in an MHA pool,
        a view of its first `kv_lora_rank` columns in an MLA pool."""

    @abstractmethod
    def store_kv(
        self, k: torch.Tensor, v: torch.Tensor, out_loc: torch.Tensor, layer_id: int
    ) -> None:
        """Write `k[i], v[i]` (`[n, local_kv_heads, head_dim]`) to token slot `out_loc[i]`
        of layer `layer_id` (an MLA pool: the two parts of its row, `k_nope` and
        `k_rope`)."""

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """Where the pool lives."""

    @property
    @abstractmethod
    def dtype(self) -> torch.dtype:
        """Element type of the caches."""

    @property
    @abstractmethod
    def num_layers(self) -> int:
        """Layers in the pool."""


class PagedPool(BaseKVCache):
    """What the paged pools (MHAKVCache, MLAKVCache) share: one buffer of
    `num_pages` pages of `page_size` token slots per layer, per-layer views of
    it (`_k_layers`, `_v_layers`), and the host tier's hook that makes
    `k_cache(i)` and `v_cache(i)` wait for loads of layer i."""

    # Set by each pool's __init__ through `_init_pool` (before `_allocate`):
    _num_layers: int
    _num_pages: int
    _page_size: int
    _tp_size: int
    _kv_layout: KVCacheLayout
    _k_layers: tuple
    _v_layers: tuple
    _layer_wait = None

    def _init_pool(self, args) -> None:
        """Takes the checked arguments every paged pool shares
        (`pool_args.check_pool_args`), before `_allocate`."""
        self._num_layers, self._num_pages, self._page_size = args[:3]
        self._tp_size, self._kv_layout = args.tp_size, args.kv_layout

    def _allocate(self, lead: tuple, row: tuple, dtype: torch.dtype, device) -> torch.Tensor:
        """Allocates the pool's buffer, zero-filled, and returns its logical
        view `[*lead, L, P, S, *row]`: stored so with LayerFirst, with pages
        before layers (`[*lead, P, L, S, *row]`) with PageFirst."""
        L, P, S = self._num_layers, self._num_pages, self._page_size
        self.memory_owners: List[torch.Tensor] = []  # what holds the pool's memory
        if self._kv_layout is KVCacheLayout.LayerFirst:
            self._kv_buffer = fixed_zeros(
                (*lead, L, P, S, *row), dtype, device, owners=self.memory_owners
            )
            self._view = self._kv_buffer
        else:
            self._kv_buffer = fixed_zeros(
                (*lead, P, L, S, *row), dtype, device, owners=self.memory_owners
            )
            self._view = self._kv_buffer.transpose(len(lead), len(lead) + 1)
        # A CacheManager's host tier attaches its hook (attach_layer_wait): it waits
        # until loads from host have put layer i in place (CacheManager.wait_layer).
        self._layer_wait = None
        self._device = self._kv_buffer.device
        return self._view

    def _layer(self, index, name: str) -> int:
        if type(index) is not int:  # the common case skips the call
            index = as_int(index, name)
        if not 0 <= index < self._num_layers:
            raise ValueError(f"{name}={index} is out of range for {self._num_layers} layers")
        return index

    def k_cache(self, index: int) -> torch.Tensor:
        index = self._layer(index, "index")
        if self._layer_wait is not None:
            self._layer_wait(index)
        return self._k_layers[index]

    def v_cache(self, index: int) -> torch.Tensor:
        index = self._layer(index, "index")
        if self._layer_wait is not None:
            self._layer_wait(index)
        return self._v_layers[index]

    @property
    def backs_host_tier(self) -> bool:
        """Whether a live CacheManager's host tier copies into this pool."""
        return self._layer_wait is not None and self._layer_wait.alive

    def attach_layer_wait(self, hook) -> None:
        """Makes `k_cache(i)` and `v_cache(i)` call `hook(i)` first: a
        CacheManager's host tier, whose loads must have put layer i in place
        (see CacheManager.wait_layer). `hook.alive` says whether its tier
        still exists. Raises ValueError while another live tier has one."""
        if self.backs_host_tier:
            raise ValueError(
                "kv_cache already backs the host tier of another CacheManager: "
                "its k_cache(layer) waits for that tier's loads"
            )
        self._layer_wait = hook

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        return self._kv_buffer.dtype

    @property
    def num_layers(self) -> int:
        return self._num_layers

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def page_size(self) -> int:
        return self._page_size

    @property
    def num_slots(self) -> int:
        """Token slots per layer: `num_pages * page_size`."""
        return self._num_pages * self._page_size

    @property
    def tp_size(self) -> int:
        return self._tp_size

    @property
    def kv_layout(self) -> KVCacheLayout:
        return self._kv_layout

    @property
    def kv_buffer(self) -> torch.Tensor:
        """The one buffer behind every view, in storage order (see the class doc)."""
        return self._kv_buffer

    @property
    def nbytes(self) -> int:
        """Bytes of the buffer."""
        return self._kv_buffer.numel() * self._kv_buffer.element_size()


class CopyLayout(NamedTuple):
    """Where a pool's rows lie, in bytes from its buffer's first element: row
    (side, layer, slot) starts at `side * side_stride + layer * layer_stride +
    (slot // page_size) * page_stride + (slot % page_size) * row_stride`, for
    `sides` sides (2: K and V; 1: an MLA pool's latent rows). Handed to the
    native copy engine."""

    side_stride: int
    layer_stride: int
    page_stride: int
    row_stride: int
    page_size: int
    num_slots: int
    sides: int = 2


def copy_layout(view: torch.Tensor, page_size: int) -> CopyLayout:
    """The CopyLayout of a pool whose logical view is `[sides, L, P, S, H, D]`
    (each row, `[H, D]`, contiguous)."""
    item = view.element_size()
    if view.stride(5) != 1 or view.stride(4) != view.shape[5]:
        raise ValueError("a pool's rows must be contiguous [heads, head_dim] blocks")
    side, layer, page, row = (view.stride(i) * item for i in range(4))
    return CopyLayout(side, layer, page, row, page_size, view.shape[2] * page_size, view.shape[0])


def side_plane(view: torch.Tensor, page_size: int) -> Tuple[torch.Tensor, CopyLayout, int]:
    """A one-sided plane of rows, `view` being `[L, P, S, *row]` (each row
    contiguous): `(view, CopyLayout, row_bytes)`, as the copy engine takes an
    MLA pool's latent rows and each side buffer's."""
    item = view.element_size()
    layer, page, row = (view.stride(i) * item for i in range(3))
    return (
        view,
        CopyLayout(0, layer, page, row, page_size, view.shape[1] * page_size, 1),
        view[0, 0, 0].numel() * item,
    )


class SideBuffers:
    """Per-token side buffers of a pool: named rows beside the K/V (per-token
    quantization scales, an indexer's keys) stored by the same kernel call as
    the K/V (`store_kv(..., side={name: rows})`).

    A buffer registered as `(name, row_shape, dtype)` holds, for every layer
    and token slot, one row of `row_shape` elements of `dtype`, zero-filled,
    in storage `[num_layers, num_pages, page_size, *row_shape]` whatever the
    pool's layout. Rows are copied as they are (no conversion). The host and
    storage tiers move a page's side rows with its K/V (a `HostKVCache` holds
    a copy of every side buffer, inside each page); register them before the
    pool backs a CacheManager's host tier.
    """

    _SIDE_MAX = 6  # the store kernel writes 8 sides, two of them the K/V

    # What the mixin uses of its host pool (a PagedPool): declared for the
    # type checker only, so the pool's own definitions stay the ones found.
    memory_owners: List[torch.Tensor]
    if TYPE_CHECKING:

        @property
        def num_layers(self) -> int: ...
        @property
        def num_pages(self) -> int: ...
        @property
        def page_size(self) -> int: ...
        @property
        def device(self) -> torch.device: ...
        @property
        def backs_host_tier(self) -> bool: ...
        def _layer(self, index, name: str) -> int: ...

    def _init_side_buffers(self) -> None:
        self._side_buffers: dict = {}  # name -> (buffer, per-layer [num_slots, W] views, row)

    def register_side_buffer(self, name: str, row_shape, dtype: torch.dtype) -> torch.Tensor:
        """Allocate a side buffer `name` of rows `row_shape` (an int or a tuple of
        ints) and `dtype` for every layer and slot; returns it
        (`[num_layers, num_pages, page_size, *row_shape]`). Raises ValueError for
        a name taken or beyond the most a store writes, TypeError for a bad dtype."""
        if not isinstance(name, str) or not name:
            raise TypeError(f"name must be a non-empty str, got {name!r}")
        if name in self._side_buffers:
            raise ValueError(f"name={name!r} is already a side buffer of this pool")
        if self.backs_host_tier:
            raise ValueError(
                "register side buffers before the pool backs a CacheManager's host "
                "tier: its host pool holds a copy of each"
            )
        if len(self._side_buffers) >= self._SIDE_MAX:
            raise ValueError(
                f"a pool has at most {self._SIDE_MAX} side buffers (the store kernel "
                "writes them with the K/V in one call)"
            )
        shape = (row_shape,) if isinstance(row_shape, int) else tuple(row_shape)
        for d in shape:
            if type(d) is not int or d < 1:
                raise ValueError(f"row_shape must be positive ints, got {row_shape!r}")
        if not shape:
            raise ValueError("row_shape must have at least one dimension")
        if not isinstance(dtype, torch.dtype) or dtype.is_complex or dtype == torch.bool:
            raise TypeError(f"dtype must be a real torch dtype, got {dtype!r}")
        buf = fixed_zeros(
            (self.num_layers, self.num_pages, self.page_size) + shape,
            dtype,
            self.device,
            owners=self.memory_owners,
        )
        width = math.prod(shape)
        rows = tuple(
            buf[i].view(self.num_pages * self.page_size, width) for i in range(self.num_layers)
        )
        self._side_buffers[name] = (buf, rows, shape)
        return buf

    def side_buffer(self, name: str, layer: int) -> torch.Tensor:
        """Layer `layer`'s rows of side buffer `name`, `[num_pages, page_size, *row_shape]`."""
        layer = self._layer(layer, "layer")
        try:
            return self._side_buffers[name][0][layer]
        except (KeyError, TypeError):
            raise ValueError(
                f"name={name!r} is not a side buffer of this pool "
                f"(registered: {sorted(self._side_buffers)})"
            ) from None

    @property
    def side_buffer_names(self) -> tuple:
        """Names of the registered side buffers, in registration order."""
        return tuple(self._side_buffers)

    def side_buffer_specs(self) -> tuple:
        """`(name, row_shape, dtype)` of each side buffer, in registration order."""
        return tuple(
            (name, shape, buf.dtype) for name, (buf, _, shape) in self._side_buffers.items()
        )

    def side_copy_layouts(self) -> tuple:
        """`(buffer, CopyLayout, row_bytes)` of each side buffer, in registration
        order: one-sided planes `[L, P, S, row]` for the host tier's copy engine."""
        return tuple(side_plane(buf, self.page_size) for buf, _, _ in self._side_buffers.values())

    def _side_args(self, side, layer: int):
        """`side` ({name: rows}) as the kernel's (name, buffer, source) triples for
        `layer`, each source `[n, W]`; None when there is nothing."""
        if side is None:
            return None
        if not hasattr(side, "items"):
            raise TypeError(f"side must be a mapping of name to rows, got {type(side).__name__}")
        out = []
        for name, rows in side.items():
            entry = self._side_buffers.get(name) if isinstance(name, str) else None
            if entry is None:
                raise ValueError(
                    f"side[{name!r}]: no such side buffer (registered: "
                    f"{sorted(self._side_buffers)})"
                )
            if not isinstance(rows, torch.Tensor):
                raise TypeError(f"side[{name}] must be a torch.Tensor, got {type(rows).__name__}")
            shape = entry[2]
            if rows.dim() != 1 + len(shape) or tuple(rows.shape[1:]) != shape:
                want = ", ".join(str(d) for d in shape)
                raise ValueError(
                    f"side[{name}] must have shape [num_tokens, {want}], got " f"{list(rows.shape)}"
                )
            width = entry[1][layer].shape[1]  # known, so an empty batch reshapes too
            out.append((name, entry[1][layer], rows.reshape(rows.shape[0], width)))
        return tuple(out) or None
