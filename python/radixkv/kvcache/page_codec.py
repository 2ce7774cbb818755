"""Page codecs: how a host pool holds a page, or a storage backend writes
it, in fewer bytes than the device's.

`float8`: each (side, layer, head) of the page's K/V as float8 e4m3fn with
its own float32 scale (its largest finite magnitude / 448), the scales
travelling with the page; side-buffer rows as they are. A page of 16- or
32-bit K/V takes half or a quarter of the bytes. Lossy: a store with a codec
names its pages apart from one without (`codec_seed`), so neither reads the
other's. The conversions are exactly torch's (`page_codec.h`). A host pool
with a codec (`HostKVCache(codec=...)`) holds its pages in the very bytes a
backend with the same codec writes, so that backend stores them as they are."""

from __future__ import annotations

import hashlib
from typing import Optional

import torch

from radixkv import _core

CODECS = ("float8",)
"""The page codecs a host pool and a storage backend take (None: pages as
they are)."""

CODEC_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
"""The K/V dtypes a codec encodes, with the names the native codec takes."""


def check_codec(codec) -> Optional[str]:
    """`codec` if it is None or one of CODECS; ValueError otherwise."""
    if codec is not None and codec not in CODECS:
        raise ValueError(f"codec must be None or one of {', '.join(CODECS)}, got {codec!r}")
    return codec


def check_codec_dtype(codec, dtype: torch.dtype, what: str, error=ValueError, of: str = "") -> str:
    """The native codec's name of `dtype` (one of CODEC_DTYPES) when
    `codec` is given; otherwise `error` ("{what} encodes float32, float16 or
    bfloat16 K/V, not {of}{dtype}"). The one check of what a codec takes."""
    name = CODEC_DTYPES.get(dtype)
    if codec is not None and name is None:
        raise error(f"{what} encodes float32, float16 or bfloat16 K/V, not {of}{dtype}")
    return name or ""


def codec_seed(seed: bytes, codec: Optional[str]) -> bytes:
    """The key seed (or fingerprint) of pages written with `codec`: `seed`
    itself without one, else a hash of both, so encoded pages are never
    taken for pages as they are, nor pages of one codec for another's."""
    if codec is None:
        return seed
    return hashlib.sha256(b"radixkv-codec-v1\x00" + codec.encode() + b"\x00" + seed).digest()


class Float8PageCodec:
    """The float8 codec of one host pool's pages (`page_first`)."""

    def __init__(self, pool) -> None:
        if pool.layout != "page_first":
            raise ValueError(f"codec float8 needs a page_first host pool, got {pool.layout}")
        dtype = check_codec_dtype("float8", pool.dtype, "codec float8")
        dev = pool.device_pool
        heads, head_dim = dev.row_shape
        self._shape = (dev.sides * pool.num_layers, pool.page_size, heads, head_dim, dtype)
        kv_bytes = (
            dev.sides * pool.num_layers * pool.page_size * heads * head_dim * pool.dtype.itemsize
        )
        self.rest_bytes = pool.page_bytes - kv_bytes
        self.encoded_bytes = _core.float8_page_bytes(*self._shape, self.rest_bytes)

    def encode(self, page, out) -> None:
        """Encodes host page bytes `page` into `out` (`encoded_bytes`)."""
        _core.encode_float8_page(page, out, *self._shape, self.rest_bytes)

    def decode(self, data, page) -> None:
        """Decodes `data` (`encoded_bytes`) into host page bytes `page`."""
        _core.decode_float8_page(data, page, *self._shape, self.rest_bytes)
