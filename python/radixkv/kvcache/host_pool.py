"""The host-memory pool (L2) behind a device KV pool."""

from __future__ import annotations

import math
from typing import Optional, Union

import torch

from radixkv._checks import as_count
from radixkv.kvcache.base import CopyLayout, copy_layout, fixed_zeros, side_plane
from radixkv.kvcache.mha_pool import MHAKVCache
from radixkv.kvcache.mla_pool import MLAKVCache

HOST_LAYOUTS = ("page_first", "layer_first")
"""Host pool layouts: `page_first` keeps each page in one contiguous region
(all layers, keys then values), which is what a storage tier moves;
`layer_first` mirrors the device pool's LayerFirst layout."""


class HostKVCache:
    """Host memory for the K/V pages of `device_pool`, the second tier.

    Holds `num_pages` pages of the device pool's shape and dtype; when
    `num_pages` is None it holds `ratio` times the device pool's pages (2.0,
    as SGLang's default). `layout` is `page_first` (`[P, 2, L, S, H, D]`: a
    page is one contiguous region, the unit a storage tier moves) or
    `layer_first` (`[2, L, P, S, H, D]`). An MLA pool has one side, its
    latent rows (`[P, 1, L, S, 1, R]`, `[1, L, P, S, 1, R]`): `k_cache` is the
    whole row and `v_cache` its first `kv_lora_rank` columns, as on the
    device. The buffer is pinned (page-locked)
    when `pin_memory` is True, or when it is None and CUDA is available, so
    copies to and from the accelerator run asynchronously at full speed.

    The buffer is zero-filled once; its pages are handed out by the
    CacheManager that owns this pool, and filled by its copy controller.
    """

    def __init__(
        self,
        device_pool: Union[MHAKVCache, MLAKVCache],
        num_pages: Optional[int] = None,
        ratio: float = 2.0,
        layout: str = "page_first",
        pin_memory: Optional[bool] = None,
    ) -> None:
        if not isinstance(device_pool, (MHAKVCache, MLAKVCache)):
            raise TypeError(
                "device_pool must be an MHAKVCache or an MLAKVCache, got "
                f"{type(device_pool).__name__}"
            )
        if layout not in HOST_LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(HOST_LAYOUTS)}, got {layout!r}")
        if num_pages is None:
            if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not ratio > 0:
                raise ValueError(f"ratio must be a number > 0, got {ratio!r}")
            num_pages = max(1, int(device_pool.num_pages * ratio))
        num_pages = as_count(num_pages, "num_pages")
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        self._device_pool = device_pool
        self._num_pages = num_pages
        self._layout = layout
        L, S, sides = device_pool.num_layers, device_pool.page_size, device_pool.sides
        H, D = device_pool.row_shape
        pin = bool(pin_memory)
        self.memory_owners: list = []  # what holds the pool's memory (see fixed_zeros)
        own = self.memory_owners
        specs = device_pool.side_buffer_specs()
        self._sides = {}  # name -> [L, P, S, *row_shape] view
        if layout == "layer_first":
            self._buffer = fixed_zeros(
                (sides, L, num_pages, S, H, D), device_pool.dtype, pin_memory=pin, owners=own
            )
            self._view = self._buffer  # [sides, L, P, S, H, D]
            for name, shape, dtype in specs:
                self._sides[name] = fixed_zeros(
                    (L, num_pages, S) + shape, dtype, pin_memory=pin, owners=own
                )
        elif not specs:
            self._buffer = fixed_zeros(
                (num_pages, sides, L, S, H, D), device_pool.dtype, pin_memory=pin, owners=own
            )
            self._view = self._buffer.permute(1, 2, 0, 3, 4, 5)
        else:
            # One byte region per page: its K/V rows, then each side buffer's
            # rows (16-byte aligned), so a storage tier moves a page whole.
            parts = [((sides, L, S, H, D), device_pool.dtype)]
            parts += [((L, S) + shape, dtype) for _, shape, dtype in specs]
            offsets, end = [], 0
            for shape, dtype in parts:
                offsets.append(-(-end // 16) * 16)
                end = offsets[-1] + math.prod(shape) * dtype.itemsize
            self._buffer = fixed_zeros(
                (num_pages, -(-end // 16) * 16), torch.uint8, pin_memory=pin, owners=own
            )
            carved = [
                self._buffer[:, o : o + math.prod(shape) * dtype.itemsize]
                .view(dtype)
                .view((num_pages,) + shape)
                for o, (shape, dtype) in zip(offsets, parts)
            ]
            self._view = carved[0].permute(1, 2, 0, 3, 4, 5)
            for (name, shape, _), part in zip(specs, carved[1:]):
                self._sides[name] = part.transpose(0, 1)  # [L, P, S, *row_shape]
        # The value of an MLA row is its first kv_lora_rank columns.
        self._value_cols = getattr(device_pool, "kv_lora_rank", None)

    def k_cache(self, layer: int) -> torch.Tensor:
        """Keys of `layer`, `[num_pages, page_size, heads, head_dim]` (a view)."""
        return self._view[0, layer]

    def v_cache(self, layer: int) -> torch.Tensor:
        """Values of `layer`, `[num_pages, page_size, heads, head_dim]` (a view)."""
        if self._value_cols is not None:
            return self._view[0, layer][..., : self._value_cols]
        return self._view[1, layer]

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (one token, layer and side)."""
        return self._view.shape[4] * self._view.shape[5] * self._view.element_size()

    def side_buffer(self, name: str, layer: int) -> torch.Tensor:
        """Layer `layer`'s host rows of side buffer `name`, `[num_pages,
        page_size, *row_shape]` (a view)."""
        try:
            return self._sides[name][layer]
        except KeyError:
            raise ValueError(
                f"name={name!r} is not a side buffer of the device pool "
                f"(registered: {sorted(self._sides)})"
            ) from None

    def side_copy_layouts(self) -> tuple:
        """`(buffer, CopyLayout, row_bytes)` of each side buffer's host rows, in
        the device pool's registration order (the copy engine's side planes)."""
        return tuple(side_plane(view, self.page_size) for view in self._sides.values())

    def page(self, index: int) -> torch.Tensor:
        """Page `index` as one contiguous `[sides, L, page_size, H, D]` tensor,
        or with side buffers as its bytes (K/V rows, then each side buffer's)
        (`page_first` only: in `layer_first` a page is scattered)."""
        if self._layout != "page_first":
            raise ValueError("page() needs layout='page_first'")
        return self._buffer[index]

    def copy_layout(self) -> CopyLayout:
        return copy_layout(self._view, self.page_size)

    @property
    def device_pool(self) -> Union[MHAKVCache, MLAKVCache]:
        return self._device_pool

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def page_size(self) -> int:
        return self._device_pool.page_size

    @property
    def num_slots(self) -> int:
        return self._num_pages * self.page_size

    @property
    def layout(self) -> str:
        return self._layout

    @property
    def dtype(self) -> torch.dtype:
        return self._device_pool.dtype

    @property
    def num_layers(self) -> int:
        return self._device_pool.num_layers

    @property
    def pinned(self) -> bool:
        return self._buffer.is_pinned()

    @property
    def kv_buffer(self) -> torch.Tensor:
        """The buffer in storage order (see the class doc)."""
        return self._buffer

    @property
    def nbytes(self) -> int:
        return self._buffer.numel() * self._buffer.element_size()

    def __repr__(self) -> str:
        return (
            f"HostKVCache(num_pages={self._num_pages}, page_size={self.page_size}, "
            f"layout={self._layout}, dtype={self.dtype}, pinned={self.pinned})"
        )
