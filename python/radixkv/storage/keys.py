"""Page keys of the storage tier: a SHA-256 chain per page, seeded with a
fingerprint of everything that changes a page's bytes."""

from __future__ import annotations

import hashlib
from typing import List, Optional, Sequence, Tuple, Union

import torch

from radixkv import _core
from radixkv._checks import as_count, as_int


def _field(value) -> bytes:
    data = str(value).encode("utf-8")
    return len(data).to_bytes(8, "little") + data


def config_fingerprint(
    *,
    model: str,
    dtype: Union[torch.dtype, str],
    page_size: int,
    layout: str,
    num_layers: int,
    kv_heads: int,
    head_dim: int,
    tp_rank: int = 0,
    tp_size: int = 1,
    namespace: Optional[str] = None,
    attention: str = "mha",
    side_buffers: Sequence[Tuple[str, Tuple[int, ...], object]] = (),
    kv_lora_rank: Optional[int] = None,
    revision: Optional[str] = None,
) -> bytes:
    """32 bytes naming a configuration's page bytes: the model, the K/V dtype,
    the host layout, the page size, the shape of a page (layers, K/V heads on
    this rank, head dim), the tensor-parallel shard, a user namespace
    (SGLang's extra_key / vLLM's cache_salt) and the attention's page kind
    (`mha`: K and V rows; `mla`: one latent row, `head_dim` wide, whose
    first `kv_lora_rank` columns are the latent). Two
    configurations that differ in any of them get different keys for the same
    tokens, so they never read each other's pages from a shared store. An MLA
    page is the same on every tensor-parallel rank: give `tp_rank=0,
    tp_size=1` on all of them (`pool_fingerprint` does) so they share keys.
    `side_buffers` lists a pool's per-token side buffers as `(name, row_shape,
    dtype)`: their rows are part of each page. `revision` names the weights
    (a hub commit, a checkpoint's hash): pages of another revision of the
    same model are never read (None leaves the keys of earlier versions)."""
    if attention not in ("mha", "mla"):
        raise ValueError(f"attention must be 'mha' or 'mla', got {attention!r}")
    parts = [
        b"radixkv-page-v1",
        _field(model),
        _field(str(dtype).removeprefix("torch.")),
        _field(as_count(page_size, "page_size")),
        _field(layout),
        _field(as_count(num_layers, "num_layers")),
        _field(as_count(kv_heads, "kv_heads")),
        _field(as_count(head_dim, "head_dim")),
        _field(as_int(tp_rank, "tp_rank")),
        _field(as_count(tp_size, "tp_size")),
        b"\x00" if namespace is None else b"\x01" + _field(namespace),
    ]
    if attention == "mla":  # MHA keys stay those of earlier versions
        if kv_lora_rank is None:
            raise ValueError("kv_lora_rank: an MLA page's key names where its latent ends")
        parts.append(_field(f"mla:{as_count(kv_lora_rank, 'kv_lora_rank')}"))
    for name, shape, side_dtype in side_buffers:
        parts.append(_field(f"side:{name}:{tuple(shape)}:{str(side_dtype).removeprefix('torch.')}"))
    if revision is not None:
        if not isinstance(revision, str) or not revision:
            raise ValueError(f"revision must be a non-empty str (or None), got {revision!r}")
        parts.append(_field(f"rev:{revision}"))
    return hashlib.sha256(b"".join(parts)).digest()


def pool_fingerprint(
    pool,
    *,
    model: str,
    layout: str = "page_first",
    tp_rank: int = 0,
    namespace: Optional[str] = None,
    revision: Optional[str] = None,
) -> bytes:
    """`config_fingerprint` of a device pool (an MHAKVCache or MLAKVCache) and
    its host layout: an MHA pool's shard is (`tp_rank`, `pool.tp_size`); an
    MLA pool's pages are the same on every rank, so its key ignores the rank.
    The pool's side buffers are part of it."""
    sides = pool.side_buffer_specs()
    if getattr(pool, "sides", 2) == 1:
        return config_fingerprint(
            model=model,
            dtype=pool.dtype,
            page_size=pool.page_size,
            layout=layout,
            num_layers=pool.num_layers,
            kv_heads=1,
            head_dim=pool.row_shape[1],
            namespace=namespace,
            attention="mla",
            side_buffers=sides,
            kv_lora_rank=pool.kv_lora_rank,
            revision=revision,
        )
    return config_fingerprint(
        model=model,
        dtype=pool.dtype,
        page_size=pool.page_size,
        layout=layout,
        num_layers=pool.num_layers,
        kv_heads=pool.local_kv_heads,
        head_dim=pool.head_dim,
        tp_rank=tp_rank,
        tp_size=pool.tp_size,
        namespace=namespace,
        side_buffers=sides,
        revision=revision,
    )


def page_keys(
    input_ids, page_size: int, seed: Optional[bytes] = None, key: Optional[bytes] = None
) -> List[str]:
    """Hex keys of the whole pages of `input_ids`: key i = SHA256(key i-1 ||
    page i's tokens as little-endian uint32), key -1 being `seed` (32 bytes,
    from `config_fingerprint`). Without a seed the chain is SGLang's page hash
    (`get_hash_str`), so a store SGLang wrote can be read. With `key` (32
    bytes, a backend's `name_key` from its deployment secret) each key is
    then HMAC-SHA-256(key, key i): a name nobody without the secret can
    compute. Computed in C++ (cpp/src/sha256.h: the CPU's SHA
    instructions where it has them)."""
    return _core.page_keys(input_ids, page_size, seed, key=key)
