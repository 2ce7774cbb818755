"""An engine's own device K/V pool, described to radixkv's host tier."""

from __future__ import annotations

from typing import List, Sequence, Union

import torch

from radixkv import _core
from radixkv._checks import as_count
from radixkv.kvcache.base import CopyLayout, KVCacheLayout, PagedPool
from radixkv.kvcache.mha_pool import MHAKVCache
from radixkv.kvcache.mla_pool import MLAKVCache

_TYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)


def _planes(layers, name: str) -> tuple:
    if isinstance(layers, torch.Tensor) or not isinstance(layers, Sequence):
        raise TypeError(f"{name} must be a sequence of tensors, one per layer")
    out = tuple(layers)
    if not out:
        raise ValueError(f"{name} must hold at least one layer")
    for i, t in enumerate(out):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}[{i}] must be a torch tensor, got {type(t).__name__}")
    return out


class EngineKVPool(PagedPool):
    """The device K/V an engine allocated itself: one tensor of keys and one
    of values per layer, `k_layers[l]` and `v_layers[l]`, each `[num_slots,
    heads, head_dim]` rows, slot `s` in page `s // page_size`. Each row is
    contiguous; slots follow each other at one stride shared by every plane,
    which may leave room between them (vLLM's CPU blocks `[blocks, 2 (K, V),
    ...]`: a layer's keys are `t[:, 0]`, its values `t[:, 1]`).
    That is how SGLang keeps its pool (`MHATokenToKVPool.k_buffer` and
    `v_buffer`, slot 0's page a padding page it never hands out).

    radixkv allocates nothing here: a CacheManager given this pool as its
    `kv_cache` copies whole pages between these tensors and its host pool
    (the copy engine reads the per-layer tensors through a table of their
    addresses), and the engine keeps writing and reading them as before.
    `k_cache(l)` and `v_cache(l)` are `[num_pages, page_size, heads,
    head_dim]` views of the engine's tensors, and `store_kv` writes rows as
    MHAKVCache's does. The tensors must stay where they are for as long as
    the CacheManager lives.
    """

    def __init__(
        self,
        k_layers: Sequence[torch.Tensor],
        v_layers: Sequence[torch.Tensor],
        page_size: int = 1,
    ) -> None:
        k = _planes(k_layers, "k_layers")
        v = _planes(v_layers, "v_layers")
        if len(k) != len(v):
            raise ValueError(f"k_layers has {len(k)} layers but v_layers has {len(v)}")
        page_size = as_count(page_size, "page_size")
        first = k[0]
        if first.dim() != 3:
            raise ValueError(
                f"k_layers[0] must be [num_slots, heads, head_dim], got shape {tuple(first.shape)}"
            )
        if first.dtype not in _TYPES:
            raise TypeError(f"k_layers must hold floating-point K/V, got {first.dtype}")
        for name, layers in (("k_layers", k), ("v_layers", v)):
            for i, t in enumerate(layers):
                if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                    raise ValueError(
                        f"{name}[{i}] must match k_layers[0] ({tuple(first.shape)}, "
                        f"{first.dtype}, {first.device}), got ({tuple(t.shape)}, {t.dtype}, "
                        f"{t.device})"
                    )
                if t.stride(2) != 1 or t.stride(1) != first.shape[2]:
                    raise ValueError(f"{name}[{i}]'s rows [heads, head_dim] must be contiguous")
                if t.stride(0) != first.stride(0) or t.stride(0) < first.shape[1] * first.shape[2]:
                    raise ValueError(
                        f"{name}[{i}]'s slots must follow each other at k_layers[0]'s stride "
                        f"({first.stride(0)}, at least a row), got {t.stride(0)}"
                    )
                if t.requires_grad:
                    raise ValueError(f"{name}[{i}] requires grad")
        slots, heads, head_dim = first.shape
        if slots == 0 or slots % page_size:
            raise ValueError(
                f"the layers' {slots} slots must be a positive multiple of page_size={page_size}"
            )
        self._num_layers = len(k)
        self._num_pages = slots // page_size
        self._page_size = page_size
        self._tp_size = 1
        self._kv_layout = KVCacheLayout.LayerFirst
        self._heads, self._head_dim = heads, head_dim
        self._planes = k + v
        self._dtype = first.dtype
        self._device = first.device
        self.memory_owners: List[torch.Tensor] = list(self._planes)
        self._slot_stride = first.stride(0)
        pages = (self._num_pages, page_size)
        self._k_layers = tuple(t.unflatten(0, pages) for t in k)
        self._v_layers = tuple(t.unflatten(0, pages) for t in v)
        self._layer_wait = None

    def copy_layout(self) -> CopyLayout:
        """Where this pool's rows lie within each layer's tensor (the side and
        layer strides are unused: `kv_buffer` gives each plane)."""
        slot = self._slot_stride * self._planes[0].element_size()
        return CopyLayout(0, 0, slot * self._page_size, slot, self._page_size, self.num_slots, 2)

    def side_copy_layouts(self) -> tuple:
        return ()

    def side_buffer_specs(self) -> tuple:
        return ()

    def store_kv(self, k, v, out_loc, layer_id: int) -> None:
        """Writes `k[i], v[i]` (`[n, heads, head_dim]`) to token slot
        `out_loc[i]` of layer `layer_id`, as MHAKVCache.store_kv does."""
        i = self._layer(layer_id, "layer_id")
        if self._device.type == "cpu":
            _core.store_cache(self._k_layers[i], self._v_layers[i], out_loc, k, v)
        else:
            from radixkv.kernel import store_cache

            store_cache(self._k_layers[i], self._v_layers[i], out_loc, k, v)

    @property
    def kv_buffer(self) -> tuple:  # type: ignore[override]  # one tensor per plane
        """The planes, keys of every layer then values of every layer (what
        the copy engine reads its table from)."""
        return self._planes

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._planes)

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def sides(self) -> int:
        return 2

    @property
    def row_shape(self) -> tuple:
        return (self._heads, self._head_dim)

    @property
    def local_kv_heads(self) -> int:
        return self._heads

    @property
    def head_dim(self) -> int:
        return self._head_dim

    def __repr__(self) -> str:
        return (
            f"EngineKVPool(num_layers={self._num_layers}, num_pages={self._num_pages}, "
            f"page_size={self._page_size}, heads={self._heads}, head_dim={self._head_dim}, "
            f"dtype={self._dtype}, device={self._device})"
        )


DevicePool = Union[MHAKVCache, MLAKVCache, EngineKVPool]
"""What a host tier can back: radixkv's pools, or an engine's own tensors."""
