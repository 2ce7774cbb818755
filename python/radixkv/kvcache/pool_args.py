"""What every KV pool's arguments share, checked: the element types a pool may
store, the layouts, the tensor-parallel size and rank. The MHA and the MLA
pool (and the factory) build on it; it imports neither."""

from __future__ import annotations

from typing import NamedTuple, Optional, Union, cast

import torch

from radixkv._checks import as_count as _count
from radixkv._checks import as_int
from radixkv.kvcache.base import KVCacheLayout

_FLOAT8 = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16) + tuple(
    getattr(torch, name) for name in _FLOAT8 if hasattr(torch, name)
)
"""Element types a pool may store: float32, float16, bfloat16 and the float8 kinds torch has."""

DTypeLike = Union[torch.dtype, str]


def as_dtype(dtype: DTypeLike) -> torch.dtype:
    """`dtype` (a torch.dtype or its name) checked against SUPPORTED_DTYPES (TypeError)."""
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."), dtype)
    if dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise TypeError(f"dtype must be one of {names}, got {dtype!r}")
    return cast(torch.dtype, dtype)  # one of SUPPORTED_DTYPES


def as_layout(kv_layout) -> KVCacheLayout:
    """`kv_layout` as a KVCacheLayout (ValueError naming the choices)."""
    try:
        return KVCacheLayout(kv_layout)
    except ValueError:
        choices = ", ".join(f"KVCacheLayout.{m.name}" for m in KVCacheLayout)
        raise ValueError(f"kv_layout must be one of {choices}, got {kv_layout!r}") from None


def resolve_tp_size(tp_size: Optional[int] = None) -> int:
    """`tp_size`, or when it is None the `torch.distributed` world size if a
    process group is initialised, else 1."""
    if tp_size is not None:
        return _count(tp_size, "tp_size")
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


class PoolArgs(NamedTuple):
    """What every paged pool's constructor takes, checked (`check_pool_args`)."""

    num_layers: int
    num_pages: int
    page_size: int
    tp_size: int
    kv_layout: KVCacheLayout
    dtype: torch.dtype


def check_pool_args(num_layers, num_pages, page_size, tp_size, kv_layout, dtype) -> PoolArgs:
    """The arguments every paged pool (MHA, MLA) shares, checked in this
    order: counts, the tensor-parallel size, the layout, the element type."""
    return PoolArgs(
        _count(num_layers, "num_layers"),
        _count(num_pages, "num_pages"),
        _count(page_size, "page_size"),
        resolve_tp_size(tp_size),
        as_layout(kv_layout),
        as_dtype(dtype),
    )


def resolve_tp_rank(tp_rank: Optional[int] = None) -> int:
    """`tp_rank`, or when it is None the `torch.distributed` rank if a process
    group is initialised, else 0."""
    if tp_rank is not None:
        rank = as_int(tp_rank, "tp_rank")
        if rank < 0:
            raise ValueError(f"tp_rank must be >= 0, got {rank}")
        return rank
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return 0
