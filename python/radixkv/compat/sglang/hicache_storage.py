"""radixkv's storage tier as SGLang HiCache's L3: stock SGLang keeps its
own tree and host tier (L2) and writes pages to, and prefetches them from,
radixkv's file store or Mooncake Store, with radixkv's page integrity
checks (CRC-32C, or an HMAC tag with a deployment secret), per-direction
back-off and stores shared by many instances.

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "radixkv",
        "module_path": "radixkv.compat.sglang.hicache_storage",
        "class_name": "RadixkvHiCacheStorage", "interface_v1": 1,
        "backend": "file", "directory": "/var/cache/kv"}'

Other keys of the extra config: `namespace` (a name for the model's
weights: SGLang's model name is only the served alias), `max_bytes`,
`shared` (a store directory shared with other users on purpose), `secret`
or `secret_file` (a file holding it: a command line is visible to every
user), and for `"backend": "mooncake"`: `master_address`, `metadata_server`,
`local_hostname`, `protocol`, `segment_bytes`, `buffer_bytes`.

A page's name is SHA-256 of a fingerprint and SGLang's page key (its
SHA-256 chain over token pages; with a secret, an HMAC under a key derived
from it, so nobody without it can name or probe a page). The fingerprint
covers the model (and `namespace`), the K/V dtype, SGLang's host layout
(its flat page's byte order), the page shape, and the tensor-, pipeline-
and context-parallel shard: two configurations never read each other's
bytes, in a shared directory or one Mooncake master alike.

Pages move through a small staging pool of radixkv's: one copy more than a
store writing SGLang's host pool in place, in exchange for every check and
format of radixkv's store. Plain MHA host pools with a float K/V dtype
only; MLA models, float8 K/V caches, other host pools and extra pools
(SGLang's v2 pool transfers) are refused at start-up.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, List, Optional

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from radixkv import _core
from radixkv.storage.staged import StagedStorage, storage_options
from radixkv.storage import config_fingerprint

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class RadixkvHiCacheStorage(HiCacheStorage):
    """SGLang's HiCacheStorage (interface v1 and the older calls) over
    radixkv's FileStorage or MooncakeStorage."""

    def __init__(self, storage_config, kwargs: Optional[dict] = None) -> None:
        self.config = storage_config
        self.options = storage_options(storage_config.extra_config)
        if storage_config.is_mla_model:
            raise ValueError("radixkv's SGLang L3 adapter serves MHA models; this model is MLA")
        # Made when SGLang registers its host pool (the page shape).
        self.storage: Optional[StagedStorage] = None

    # -- the host pool and the store -----------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        host = mem_pool_host
        kind = type(host).__name__
        if kind != "MHATokenToKVPoolHost":
            raise ValueError(
                f"radixkv's SGLang L3 adapter serves SGLang's MHATokenToKVPoolHost; "
                f"this model's host pool is {kind}"
            )
        if host.dtype not in _FLOAT_DTYPES:
            raise ValueError(
                f"radixkv's SGLang L3 adapter serves float16, bfloat16 and float32 "
                f"K/V; this host pool holds {host.dtype} (a float8 K/V cache)"
            )
        self.page_size = host.page_size
        cfg, o = self.config, self.options
        shard = (
            f"pp{cfg.pp_rank}/{cfg.pp_size} cp{cfg.attn_cp_rank}/{cfg.attn_cp_size} "
            f"dcp{cfg.dcp_rank}/{cfg.dcp_size}"
        )
        namespace = o.get("namespace")
        self.fingerprint = config_fingerprint(
            model=cfg.model_name or "",
            dtype=host.dtype,
            page_size=host.page_size,
            layout=f"sglang:{host.layout}",
            num_layers=host.layer_num,
            kv_heads=host.head_num,
            head_dim=host.head_dim,
            tp_rank=cfg.tp_rank,
            tp_size=cfg.tp_size,
            namespace=shard if namespace is None else f"{shard} {namespace}",
            revision=o.get("revision"),
        )
        # A page's bytes are SGLang's flat page, in its host layout's order
        # (which the fingerprint names).
        page_elems = 2 * host.layer_num * host.page_size * host.head_num * host.head_dim
        self.storage = StagedStorage(o, self.fingerprint, page_elems, host.dtype)

    def on_host_pools_registered(self) -> None:
        extra = sorted(
            str(name) for name in getattr(self, "registered_pools", {}) if str(name) != "kv"
        )
        if extra:
            raise ValueError(
                "radixkv's SGLang L3 adapter moves the K/V pool only (interface "
                f"v1); this model also registers {', '.join(extra)}"
            )

    def _key(self, key: str) -> str:
        """The store's name for SGLang's page key: SHA-256 of the
        fingerprint and the key, or with a secret an HMAC under the key
        derived from it."""
        parts = [self.fingerprint, key.encode()]
        store = self.storage
        if store is None:
            raise RuntimeError(
                "radixkv's SGLang L3 adapter has no store yet: SGLang registers its "
                "host pool (register_mem_pool_host) first"
            )
        name_key = store.name_key
        if name_key is not None:
            return _core.hmac_sha256(name_key, parts).hex()
        return hashlib.sha256(b"".join(parts)).hexdigest()

    # -- interface v1 ---------------------------------------------------------------------

    def batch_exists(self, keys: List[str], extra_info=None) -> int:
        if self.storage is None or not keys:
            return 0
        return self.storage.exists([self._key(k) for k in keys])

    def batch_get_v1(
        self, keys: List[str], host_indices: torch.Tensor, extra_info=None
    ) -> List[bool]:
        """Reads pages into SGLang's host pool at `host_indices` (a page's
        first slot every `page_size`); a page after a missing one is not
        read (SGLang takes the pages before the first miss)."""
        out = [False] * len(keys)

        def take(i: int, page: Optional[torch.Tensor]) -> bool:
            if page is None:
                return False
            self.mem_pool_host.set_from_flat_data_page(int(host_indices[i * self.page_size]), page)
            out[i] = True
            return True

        self._read(keys, take)
        return out

    def batch_set_v1(
        self, keys: List[str], host_indices: torch.Tensor, extra_info=None
    ) -> List[bool]:
        return self._write(
            keys,
            lambda i: self.mem_pool_host.get_data_page(
                int(host_indices[i * self.page_size]), flat=True
            ),
        )

    # -- the older calls (flat pages by value) ---------------------------------------------

    def get(
        self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None
    ) -> Optional[torch.Tensor]:
        got = self.batch_get([key], [target_location] if target_location is not None else None)
        return got[0]

    def batch_get(
        self,
        keys: List[str],
        target_locations: Optional[Any] = None,
        target_sizes: Optional[Any] = None,
    ) -> List[Optional[torch.Tensor]]:
        out: List[Optional[torch.Tensor]] = [None] * len(keys)

        def take(i: int, page: Optional[torch.Tensor]) -> bool:
            dst = None if target_locations is None else target_locations[i]
            if page is not None:
                if dst is None:
                    out[i] = page.clone()
                else:
                    out[i] = dst.copy_(page.reshape(dst.shape))
            return True

        self._read(keys, take)
        return out

    def set(
        self,
        key: str,
        value: Optional[Any] = None,
        target_location: Optional[Any] = None,
        target_sizes: Optional[Any] = None,
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: List[str],
        values: Optional[Any] = None,
        target_locations: Optional[Any] = None,
        target_sizes: Optional[Any] = None,
    ) -> bool:
        if values is None:
            return False
        return all(self._write(keys, lambda i: values[i]))

    # -- through the staging pages --------------------------------------------------------

    def _read(self, keys: List[str], take: Callable[[int, Optional[torch.Tensor]], bool]) -> None:
        if self.storage is not None:
            self.storage.read([self._key(k) for k in keys], take)

    def _write(self, keys: List[str], page_of: Callable[[int], torch.Tensor]) -> List[bool]:
        if self.storage is None:
            return [False] * len(keys)
        return self.storage.write(
            [self._key(k) for k in keys], lambda i, page: page.copy_(page_of(i).reshape(-1))
        )

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def close(self) -> None:
        if self.storage is not None:
            self.storage.close()

    def get_stats(self):
        """None: SGLang's metrics take its own StorageMetrics type; radixkv's
        counts are `counts()`."""
        return None

    def counts(self) -> dict:
        if self.storage is None:
            return {"errors": 0, "corrupt_pages": 0, "skipped_reads": 0, "skipped_writes": 0}
        return self.storage.counts()
