"""create_kvcache: a KV pool of either kind (MHA or MLA) from one set of arguments."""

from __future__ import annotations

from typing import Optional, Union

import torch

from radixkv._checks import as_count as _count
from radixkv.kvcache.base import BaseKVCache, KVCacheLayout, KVCacheType
from radixkv.kvcache.mha_pool import MHAKVCache
from radixkv.kvcache.mla_pool import MLAKVCache
from radixkv.kvcache.pool_args import DTypeLike


def create_kvcache(
    num_layers: int,
    num_kv_heads: int,
    num_pages: int,
    head_dim: int,
    dtype: DTypeLike,
    device: Union[torch.device, str] = "cpu",
    page_size: int = 1,
    cache_layout: KVCacheLayout = KVCacheLayout.LayerFirst,
    cache_type: KVCacheType = KVCacheType.MHA,
    tp_size: Optional[int] = None,
    *,
    check_bounds: bool = True,
    kv_lora_rank: Optional[int] = None,
    qk_rope_head_dim: Optional[int] = None,
) -> BaseKVCache:
    """A KV pool of `cache_type` laid out as `cache_layout`.

    `KVCacheType.MHA`: an MHAKVCache of the other arguments. `KVCacheType.MLA`:
    an MLAKVCache of `kv_lora_rank` and `qk_rope_head_dim` (both required);
    its row is one head of `kv_lora_rank + qk_rope_head_dim`, which
    `num_kv_heads` (1) and `head_dim` (the sum) must agree with (ValueError).
    """
    try:
        cache_type = KVCacheType(cache_type)
    except ValueError:
        raise ValueError(f"cache_type must be a KVCacheType, got {cache_type!r}") from None
    if cache_type is KVCacheType.MHA:
        for name, value in (("kv_lora_rank", kv_lora_rank), ("qk_rope_head_dim", qk_rope_head_dim)):
            if value is not None:
                raise ValueError(f"{name} is an MLA size; cache_type is {cache_type}")
        return MHAKVCache(
            num_kv_heads=num_kv_heads,
            num_layers=num_layers,
            head_dim=head_dim,
            num_pages=num_pages,
            dtype=dtype,
            kv_layout=cache_layout,
            device=device,
            page_size=page_size,
            tp_size=tp_size,
            check_bounds=check_bounds,
        )
    if kv_lora_rank is None or qk_rope_head_dim is None:
        name = "kv_lora_rank" if kv_lora_rank is None else "qk_rope_head_dim"
        raise ValueError(f"{name} is required for cache_type {cache_type}")
    row = _count(kv_lora_rank, "kv_lora_rank") + _count(qk_rope_head_dim, "qk_rope_head_dim")
    if _count(num_kv_heads, "num_kv_heads") != 1:
        raise ValueError(f"num_kv_heads={num_kv_heads}: an MLA pool stores one latent head")
    if _count(head_dim, "head_dim") != row:
        raise ValueError(
            f"head_dim={head_dim} must be kv_lora_rank + qk_rope_head_dim = {row} "
            "for an MLA pool"
        )
    return MLAKVCache(
        kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=qk_rope_head_dim,
        num_layers=num_layers,
        num_pages=num_pages,
        dtype=dtype,
        kv_layout=cache_layout,
        device=device,
        page_size=page_size,
        tp_size=tp_size,
        check_bounds=check_bounds,
    )
