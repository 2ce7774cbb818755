"""The MHA KV pool: one preallocated buffer, a paged key and value view per layer."""

from __future__ import annotations

import functools
from typing import Optional, Union

import torch

from radixkv import _core
from radixkv._checks import as_count as _count
from radixkv.kernel import store_cache
from radixkv.kvcache.base import CopyLayout, KVCacheLayout, PagedPool, SideBuffers, copy_layout

# The arguments every pool shares, checked; re-exported here, where they lived first.
from radixkv.kvcache.pool_args import (  # noqa: F401
    SUPPORTED_DTYPES,
    DTypeLike,
    as_dtype,
    as_layout,
    check_pool_args,
    resolve_tp_rank,
    resolve_tp_size,
)


def local_kv_heads(num_kv_heads: int, tp_size: Optional[int] = None) -> int:
    """KV heads held by one tensor-parallel rank: `num_kv_heads // tp_size`, which
    must divide evenly (ValueError otherwise)."""
    num_kv_heads = _count(num_kv_heads, "num_kv_heads")
    tp = resolve_tp_size(tp_size)
    if num_kv_heads % tp != 0:
        raise ValueError(
            f"num_kv_heads={num_kv_heads} does not divide evenly over tp_size={tp} ranks"
        )
    return num_kv_heads // tp


def kv_bytes_per_page(
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: DTypeLike,
    page_size: int = 1,
    tp_size: Optional[int] = None,
) -> int:
    """Bytes one page takes in an MHA pool on one rank: keys and values of
    `page_size` tokens in every layer."""
    heads = local_kv_heads(num_kv_heads, tp_size)
    item = as_dtype(dtype).itemsize
    return (
        2
        * _count(num_layers, "num_layers")
        * _count(page_size, "page_size")
        * heads
        * _count(head_dim, "head_dim")
        * item
    )


def num_pages_for_memory(
    memory_bytes: int,
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: DTypeLike,
    page_size: int = 1,
    tp_size: Optional[int] = None,
) -> int:
    """The most pages an MHA pool can have within `memory_bytes` on one rank
    (for example the free accelerator memory times a fraction, minus what the
    model needs). Raises ValueError when not even one page fits."""
    memory_bytes = _count(memory_bytes, "memory_bytes", minimum=0)
    per_page = kv_bytes_per_page(
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        page_size=page_size,
        tp_size=tp_size,
    )
    pages = memory_bytes // per_page
    if pages < 1:
        raise ValueError(f"memory_bytes={memory_bytes} cannot hold one page of {per_page} bytes")
    return pages


class MHAKVCache(SideBuffers, PagedPool):
    """Keys and values of every layer in one preallocated, zero-filled buffer.

    Storage is `[2, num_layers, num_pages, page_size, H, D]` (LayerFirst) or
    `[2, num_pages, num_layers, page_size, H, D]` (PageFirst), with
    `H = local_kv_heads = num_kv_heads // tp_size`; `tp_size=None` takes the
    `torch.distributed` world size when a process group is initialised, else 1.
    Token slot `s` is row `s % page_size` of page `s // page_size`.

    `store_kv` runs the native CPU kernel on the CPU and the CUDA kernel on CUDA
    (torch indexing elsewhere); see `radixkv.kernel.store_cache`. A slot out of
    range or used twice raises, with nothing written; on CUDA that check costs
    one synchronization a call, which `check_bounds=False` skips (the kernel
    then skips out-of-range slots silently).

    Side buffers (`register_side_buffer`, see SideBuffers) are per-token rows
    beside the K/V that `store_kv(..., side={name: rows})` writes in the same
    kernel call.
    """

    def __init__(
        self,
        num_kv_heads: int,
        num_layers: int,
        head_dim: int,
        num_pages: int,
        dtype: DTypeLike,
        kv_layout: KVCacheLayout = KVCacheLayout.LayerFirst,
        device: Union[torch.device, str] = "cpu",
        page_size: int = 1,
        tp_size: Optional[int] = None,
        *,
        check_bounds: bool = True,
    ) -> None:
        self._num_kv_heads = _count(num_kv_heads, "num_kv_heads")
        self._head_dim = _count(head_dim, "head_dim")
        args = check_pool_args(num_layers, num_pages, page_size, tp_size, kv_layout, dtype)
        self._init_pool(args)
        self._local_kv_heads = local_kv_heads(self._num_kv_heads, self._tp_size)

        view = self._allocate((2,), (self._local_kv_heads, self._head_dim), args.dtype, device)
        self._k_layers = view[0].unbind(0)  # view: [2, L, P, S, H, D] whatever the layout
        self._v_layers = view[1].unbind(0)
        self._init_side_buffers()
        if self._device.type == "cpu":
            self._store = _core.store_cache
        else:
            self._store = functools.partial(store_cache, check_bounds=check_bounds)

    def copy_layout(self) -> CopyLayout:
        """Where this pool's rows lie, for the copy engine of a host tier."""
        return copy_layout(self._view, self._page_size)

    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        out_loc: torch.Tensor,
        layer_id: int,
        k_scale=None,
        v_scale=None,
        side=None,
    ) -> None:
        """Write `k[i], v[i]` (`[n, local_kv_heads, head_dim]`) to token slot
        `out_loc[i]` of layer `layer_id`. A float8 pool also takes float32,
        float16 or bfloat16 k and v, written as `(k.float() / k_scale).to(dtype)`
        (and v with `v_scale`) in the kernel; see `radixkv.kernel.store_cache`.
        `side` ({name: rows of [n, *row_shape]}) writes registered side buffers
        in the same kernel call."""
        i = self._layer(layer_id, "layer_id")
        if self._store is _core.store_cache:
            # The caches are this pool's own views (no grad, no lazy negation):
            # the kernel checks only k, v and out_loc (pool_views, positional).
            if k_scale is None and v_scale is None and side is None:  # the common call
                _core.store_cache(self._k_layers[i], self._v_layers[i], out_loc, k, v, True)
            else:
                _core.store_cache(
                    self._k_layers[i],
                    self._v_layers[i],
                    out_loc,
                    k,
                    v,
                    True,
                    k_scale,
                    v_scale,
                    None if side is None else self._side_args(side, i),
                )
            return
        sides = None if side is None else self._side_args(side, i)
        self._store(
            self._k_layers[i],
            self._v_layers[i],
            out_loc,
            k,
            v,
            k_scale=k_scale,
            v_scale=v_scale,
            side=sides,
        )

    @property
    def num_kv_heads(self) -> int:
        """KV heads of the whole model (all ranks)."""
        return self._num_kv_heads

    @property
    def local_kv_heads(self) -> int:
        """KV heads stored on this rank."""
        return self._local_kv_heads

    @property
    def head_dim(self) -> int:
        return self._head_dim

    @property
    def sides(self) -> int:
        """Rows a token has per layer: 2, its key and its value."""
        return 2

    @property
    def row_shape(self) -> tuple:
        """The shape of one row: `(local_kv_heads, head_dim)`."""
        return (self._local_kv_heads, self._head_dim)

    def __repr__(self) -> str:
        return (
            f"MHAKVCache(num_layers={self._num_layers}, num_pages={self._num_pages}, "
            f"page_size={self._page_size}, local_kv_heads={self._local_kv_heads}, "
            f"head_dim={self._head_dim}, dtype={self.dtype}, "
            f"kv_layout={self._kv_layout.name}, device={self._device})"
        )
