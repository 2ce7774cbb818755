"""The host-memory pool (L2) behind a device KV pool."""

from __future__ import annotations

import math
from typing import Optional

import torch

from radixkv._checks import as_count
from radixkv.kvcache.page_codec import CODEC_DTYPES, check_codec, check_codec_dtype
from radixkv.kvcache.base import CopyLayout, copy_layout, fixed_zeros, side_plane
from radixkv.kvcache.engine_pool import DevicePool, EngineKVPool
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

    `codec` (None, or `"float8"`; `page_first` only) holds each page's K/V
    encoded (`radixkv.kvcache.page_codec`): one byte an element and a float32
    scale per (side, layer, head), in the same bytes a storage backend with
    that codec writes, so a page takes half (16-bit K/V) or a quarter (32-bit)
    of the memory and the storage tier moves it as it is. Backups encode and
    loads decode whole pages in the copy engine; `k_cache` and `v_cache` are
    then the codes (float8_e4m3fn) and `k_scale`/`v_scale` their scales.
    Lossy; side-buffer rows are kept as they are.

    The buffer is zero-filled once; its pages are handed out by the
    CacheManager that owns this pool, and filled by its copy controller.
    """

    def __init__(
        self,
        device_pool: DevicePool,
        num_pages: Optional[int] = None,
        ratio: float = 2.0,
        layout: str = "page_first",
        pin_memory: Optional[bool] = None,
        codec: Optional[str] = None,
    ) -> None:
        if not isinstance(device_pool, (MHAKVCache, MLAKVCache, EngineKVPool)):
            raise TypeError(
                "device_pool must be an MHAKVCache, an MLAKVCache or an EngineKVPool, got "
                f"{type(device_pool).__name__}"
            )
        if layout not in HOST_LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(HOST_LAYOUTS)}, got {layout!r}")
        codec = check_codec(codec)
        if codec is not None and layout != "page_first":
            raise ValueError(f"codec {codec} needs layout='page_first', got {layout!r}")
        check_codec_dtype(codec, device_pool.dtype, f"codec {codec}")
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
        self._codec = codec
        self._scales: Optional[torch.Tensor] = None  # [P, sides, L, H] float32 (codec)
        self._page_bytes: Optional[int] = None  # a page's bytes, where the buffer pads them
        if codec is not None:
            self._carve_encoded(num_pages, specs, pin, own)
        elif layout == "layer_first":
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
        self._copy_buffer = self._buffer if codec is None else self._codes
        # The value of an MLA row is its first kv_lora_rank columns.
        self._value_cols = getattr(device_pool, "kv_lora_rank", None)

    def _carve_encoded(self, num_pages: int, specs, pin: bool, own: list) -> None:
        """The buffer of an encoded pool: each page as the codec writes it
        (scales `[sides * L, H]` float32, codes `[sides, L, S, H, D]`, then
        the rest of the plain page: its side-buffer rows), 16-byte aligned."""
        dev = self._device_pool
        L, S, sides = dev.num_layers, dev.page_size, dev.sides
        H, D = dev.row_shape
        scale_bytes = sides * L * H * 4
        code_bytes = sides * L * S * H * D
        raw_kv = code_bytes * dev.dtype.itemsize
        # Where each side buffer's rows start in the plain page, and its end.
        offsets, end = [], raw_kv
        for _, shape, dtype in specs:
            offsets.append(-(-end // 16) * 16)
            end = offsets[-1] + math.prod((L, S) + shape) * dtype.itemsize
        rest = -(-end // 16) * 16 - raw_kv if specs else 0
        self._page_bytes = scale_bytes + code_bytes + rest
        stride = -(-self._page_bytes // 16) * 16
        self._buffer = fixed_zeros((num_pages, stride), torch.uint8, pin_memory=pin, owners=own)
        self._scales = (
            self._buffer[:, :scale_bytes].view(torch.float32).view(num_pages, sides, L, H)
        )
        self._codes = (
            self._buffer[:, scale_bytes : scale_bytes + code_bytes]
            .view(num_pages, sides, L, S, H, D)
            .permute(1, 2, 0, 3, 4, 5)
        )
        self._view = self._codes.view(torch.float8_e4m3fn)
        shift = scale_bytes + code_bytes - raw_kv  # plain offset -> encoded offset
        for o, (name, shape, dtype) in zip(offsets, specs):
            start = shift + o
            if start % dtype.itemsize:
                raise ValueError(
                    f"side buffer {name!r} ({dtype}) would start at byte {start} of an "
                    f"encoded page, not a multiple of its element size: codec "
                    f"{self._codec} cannot hold it"
                )
            size = math.prod((L, S) + shape) * dtype.itemsize
            self._sides[name] = (
                self._buffer[:, start : start + size]
                .view(dtype)
                .view((num_pages, L, S) + shape)
                .transpose(0, 1)
            )

    def k_cache(self, layer: int) -> torch.Tensor:
        """Keys of `layer`, `[num_pages, page_size, heads, head_dim]` (a view;
        with a codec, the float8 codes)."""
        return self._view[0, layer]

    def k_scale(self, layer: int) -> torch.Tensor:
        """With a codec: the scales of `layer`'s keys, `[num_pages, heads]`
        float32 (a view); a key is its code times its head's scale."""
        return self._scale_of(0, layer)

    def v_scale(self, layer: int) -> torch.Tensor:
        """With a codec: the scales of `layer`'s values, `[num_pages, heads]`."""
        return self._scale_of(0 if self._value_cols is not None else 1, layer)

    def _scale_of(self, side: int, layer: int) -> torch.Tensor:
        if self._scales is None:
            raise ValueError("k_scale() and v_scale() need a pool with a codec")
        return self._scales[:, side, layer]

    def v_cache(self, layer: int) -> torch.Tensor:
        """Values of `layer`, `[num_pages, page_size, heads, head_dim]` (a view;
        with a codec, the float8 codes)."""
        if self._value_cols is not None:
            return self._view[0, layer][..., : self._value_cols]
        return self._view[1, layer]

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (one token, layer and side) on the device."""
        return self._view.shape[4] * self._view.shape[5] * self.dtype.itemsize

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
        if self._page_bytes is not None:
            return self._buffer[index, : self._page_bytes]
        return self._buffer[index]

    @property
    def page_bytes(self) -> int:
        """Bytes of one page (`page_first`: of `page(i)`)."""
        if self._page_bytes is not None:
            return self._page_bytes
        return (
            self._buffer[0].numel() * self._buffer.element_size()
            if self._layout == "page_first"
            else self.nbytes // self._num_pages
        )

    def copy_layout(self) -> CopyLayout:
        """Where the K/V rows lie in `copy_buffer` (with a codec, the codes)."""
        return copy_layout(self._codes if self._codec is not None else self._view, self.page_size)

    @property
    def copy_buffer(self) -> torch.Tensor:
        """The tensor whose first element `copy_layout` counts from."""
        return self._copy_buffer

    def codec_copy(self) -> Optional[tuple]:
        """With a codec, what the copy engine needs of it: `(dtype, heads,
        head_dim, scales, scales_layout)` (a page's scales of (side, layer)
        are one "row" of `heads` float32 at slot `page * page_size`); None
        without."""
        if self._scales is None:
            return None
        dev = self._device_pool
        H, D = dev.row_shape
        sides, L = dev.sides, dev.num_layers
        layout = CopyLayout(
            L * H * 4,
            H * 4,
            self._buffer.stride(0),
            0,
            self.page_size,
            self.num_slots,
            sides,
        )
        scales = self._buffer[:, : sides * L * H * 4]
        return (CODEC_DTYPES[dev.dtype], H, D, scales, list(layout))

    @property
    def codec(self) -> Optional[str]:
        """The codec of the pages (None: as the device holds them)."""
        return self._codec

    @property
    def device_pool(self) -> DevicePool:
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
            f"layout={self._layout}, dtype={self.dtype}, pinned={self.pinned}"
            + (f", codec={self._codec})" if self._codec is not None else ")")
        )


def copy_controller(device_pool: DevicePool, host_pool: HostKVCache, manual: bool = False):
    """The copy controller (`_core.CacheController`) between `device_pool`
    and its host pool: whole pages of every plane, backups and layer-wise
    loads on its own thread (`manual`: when a test says), on the CPU with
    memcpy and on CUDA on copy streams. It keeps the memory both pools'
    copies use, whatever is done to their tensors meanwhile."""
    from radixkv import _core

    keep = (device_pool.memory_owners, host_pool.memory_owners)
    # Each side buffer is a plane of its own, moved with the K/V.
    planes = [
        (dev, list(dl), host, list(hl), rb)
        for (dev, dl, rb), (host, hl, _) in zip(
            device_pool.side_copy_layouts(), host_pool.side_copy_layouts()
        )
    ]
    args = (
        device_pool.kv_buffer,
        list(device_pool.copy_layout()),
        host_pool.copy_buffer,
        list(host_pool.copy_layout()),
        host_pool.row_bytes,
        device_pool.num_layers,
    )
    codec = host_pool.codec_copy()  # (with a codec: the host's scales)
    kind = device_pool.device.type
    if kind == "cpu":
        return _core.CacheController(*args, manual, planes, keep, codec)
    if kind == "cuda":
        from radixkv._native import require_cuda_extension

        # copy streams, events and the transfer kernel
        cuda = require_cuda_extension("a host tier of a CUDA pool")
        engine = cuda.copy_engine(*args, side_planes=planes, codec=codec)
        return _core.CacheController(engine, manual, keep)
    raise TypeError(
        f"kv_cache must be on the CPU or a CUDA device for the host tier's copies, got one "
        f"on {kind}"
    )
