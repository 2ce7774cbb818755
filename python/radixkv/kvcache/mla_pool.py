"""The MLA KV pool: one latent row per token and layer, the value a view of its head."""

from __future__ import annotations

import functools
from typing import Optional, Union

import torch

from radixkv import _core
from radixkv._checks import as_count as _count
from radixkv.kernel import store_mla
from radixkv.kvcache.base import CopyLayout, KVCacheLayout, PagedPool, SideBuffers, side_plane
from radixkv.kvcache.pool_args import DTypeLike, check_pool_args


class MLAKVCache(SideBuffers, PagedPool):
    """The latent K/V of multi-head latent attention (DeepSeek's MLA) for every
    layer in one preallocated, zero-filled buffer, as SGLang's
    MLATokenToKVPool stores it.

    Each token and layer has one row of `row_dim = kv_lora_rank +
    qk_rope_head_dim` elements: the compressed latent (which is also the
    value) then the rotary part of the key. Storage is `[num_layers,
    num_pages, page_size, 1, row_dim]` (LayerFirst) or `[num_pages,
    num_layers, page_size, 1, row_dim]` (PageFirst). `k_cache(layer)` is the
    layer's `[num_pages, page_size, 1, row_dim]` view and `v_cache(layer)` the
    view of its first `kv_lora_rank` columns (the same memory, no copy).
    Token slot `s` is row `s % page_size` of page `s // page_size`.

    The latent is the same on every tensor-parallel rank, so the pool is the
    same whatever `tp_size` (kept for the caller's bookkeeping).

    `store_kv(k_nope, k_rope, out_loc, layer)` writes both parts of each row in
    one kernel call (`radixkv.kernel.store_mla`): the native CPU kernel on
    the CPU, the CUDA kernel on CUDA. A float8 pool also takes float32,
    float16 or bfloat16 parts, divided by `k_scale` and rounded in the kernel.
    Side buffers (`register_side_buffer`, see SideBuffers) are written by the
    same call: `store_kv(..., side={name: rows})`.
    """

    def __init__(
        self,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        num_layers: int,
        num_pages: int,
        dtype: DTypeLike,
        kv_layout: KVCacheLayout = KVCacheLayout.LayerFirst,
        device: Union[torch.device, str] = "cpu",
        page_size: int = 1,
        tp_size: Optional[int] = None,
        *,
        check_bounds: bool = True,
    ) -> None:
        self._kv_lora_rank = _count(kv_lora_rank, "kv_lora_rank")
        self._qk_rope_head_dim = _count(qk_rope_head_dim, "qk_rope_head_dim")
        args = check_pool_args(num_layers, num_pages, page_size, tp_size, kv_layout, dtype)
        self._init_pool(args)

        view = self._allocate((), (1, self.row_dim), args.dtype, device)  # [L, P, S, 1, R]
        self._k_layers = view.unbind(0)
        self._v_layers = tuple(k[..., : self._kv_lora_rank] for k in self._k_layers)
        self._init_side_buffers()
        if self._device.type == "cpu":
            self._store = None  # the native kernel, called directly
        else:
            self._store = functools.partial(store_mla, check_bounds=check_bounds)

    def store_kv(
        self,
        k_nope: torch.Tensor,
        k_rope: torch.Tensor,
        out_loc: torch.Tensor,
        layer_id: int,
        k_scale=None,
        side=None,
    ) -> None:
        """Write `k_nope[i]` (`[n, 1, kv_lora_rank]` or `[n, kv_lora_rank]`) and
        `k_rope[i]` (`[n, 1, qk_rope_head_dim]` or `[n, qk_rope_head_dim]`) into
        the row of token slot `out_loc[i]` of layer `layer_id`, side by side, in
        one kernel call. Their rows may be strided (slices of a fused
        projection). A float8 pool fed float32/float16/bfloat16 writes
        `(x.float() / k_scale).to(dtype)` for both parts. `side` ({name: rows
        of [n, *row_shape]}) writes registered side buffers in the same call."""
        i = self._layer(layer_id, "layer_id")
        sides = None if side is None else self._side_args(side, i)
        if self._store is None:
            # This pool's own view (no grad, no lazy negation): pool_views.
            _core.store_mla(
                self._k_layers[i],
                out_loc,
                k_nope,
                k_rope,
                self._kv_lora_rank,
                True,
                k_scale,
                sides,
            )
        else:
            self._store(
                self._k_layers[i],
                out_loc,
                k_nope,
                k_rope,
                self._kv_lora_rank,
                k_scale=k_scale,
                side=sides,
            )

    def copy_layout(self) -> CopyLayout:
        """Where this pool's rows lie, for the copy engine of a host tier: one
        side (`sides == 1`) of `row_bytes` per layer and slot."""
        return side_plane(self._view, self._page_size)[1]

    @property
    def sides(self) -> int:
        """Rows a token has per layer: 1, its latent row (the value is a view of it)."""
        return 1

    @property
    def row_shape(self) -> tuple:
        """The shape of one row: `(1, kv_lora_rank + qk_rope_head_dim)`."""
        return (1, self.row_dim)

    @property
    def kv_lora_rank(self) -> int:
        """Columns of the compressed latent (the value), first in each row."""
        return self._kv_lora_rank

    @property
    def qk_rope_head_dim(self) -> int:
        """Columns of the rotary part of the key, last in each row."""
        return self._qk_rope_head_dim

    @property
    def row_dim(self) -> int:
        """Elements per row: `kv_lora_rank + qk_rope_head_dim`."""
        return self._kv_lora_rank + self._qk_rope_head_dim

    @property
    def row_bytes(self) -> int:
        """Bytes per row."""
        return self.row_dim * self._kv_buffer.element_size()

    def __repr__(self) -> str:
        return (
            f"MLAKVCache(num_layers={self._num_layers}, num_pages={self._num_pages}, "
            f"page_size={self._page_size}, kv_lora_rank={self._kv_lora_rank}, "
            f"qk_rope_head_dim={self._qk_rope_head_dim}, dtype={self.dtype}, "
            f"kv_layout={self._kv_layout.name}, device={self._device})"
        )
