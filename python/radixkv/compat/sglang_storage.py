"""radixkv's storage tier as SGLang HiCache's L3: stock SGLang keeps its
own tree and host tier (L2) and writes pages to, and prefetches them from,
radixkv's file store or Mooncake Store, with radixkv's page integrity
checks (CRC-32C, or an HMAC tag with a deployment secret), per-direction
back-off and stores shared by many instances.

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "radixkv",
        "module_path": "radixkv.compat.sglang_storage",
        "class_name": "RadixkvHiCacheStorage", "interface_v1": 1,
        "store": "file", "directory": "/var/cache/kv"}'

Other keys of the extra config: `namespace` (a name for the model's
weights: SGLang's model name is only the served alias), `max_bytes`,
`shared` (a store directory shared with other users on purpose), `secret`
or `secret_file` (a file holding it: a command line is visible to every
user), and for `"store": "mooncake"`: `master_address`, `metadata_server`,
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

import contextlib
import hashlib
import threading
from types import SimpleNamespace
from typing import Any, Callable, List, Optional

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from radixkv import _core
from radixkv.kvcache.host_pool import HostKVCache
from radixkv.kvcache.mha_pool import MHAKVCache
from radixkv.storage import FileStorage, MooncakeStorage, config_fingerprint
from radixkv.storage.health import Health

# Pages staged per direction; SGLang's calls (up to 128 pages) go in chunks.
BATCH_PAGES = 32
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class RadixkvHiCacheStorage(HiCacheStorage):
    """SGLang's HiCacheStorage (interface v1 and the older calls) over
    radixkv's FileStorage or MooncakeStorage."""

    def __init__(self, storage_config, kwargs: Optional[dict] = None) -> None:
        self.config = storage_config
        extra = dict(storage_config.extra_config or {})
        self.store = extra.get("store", "file")
        if self.store not in ("file", "mooncake"):
            raise ValueError(f"extra_config store must be 'file' or 'mooncake', got "
                             f"{self.store!r}")
        if self.store == "file" and not extra.get("directory"):
            raise ValueError("extra_config directory: the file store's directory is required")
        if storage_config.is_mla_model:
            raise ValueError("radixkv's SGLang L3 adapter serves MHA models; this model is MLA")
        self.options = extra
        secret = extra.get("secret")
        if extra.get("secret_file") is not None:
            with open(extra["secret_file"], "rb") as f:
                secret = f.read().strip()
        self.secret = secret.encode() if isinstance(secret, str) else secret
        policy = SimpleNamespace(failures_in_a_row=int(extra.get("failures_in_a_row", 3)),
                                 retry_after_s=float(extra.get("retry_after_s", 1.0)),
                                 max_retry_after_s=float(extra.get("max_retry_after_s", 30.0)))
        self.reads, self.writes = Health(policy), Health(policy)
        self.backend = None  # made when SGLang registers its host pool (the page shape)
        self._read_lock, self._write_lock = threading.Lock(), threading.Lock()
        self.skipped_reads = self.skipped_writes = 0

    # -- the host pool and the store -----------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        host = mem_pool_host
        kind = type(host).__name__
        if kind != "MHATokenToKVPoolHost":
            raise ValueError(f"radixkv's SGLang L3 adapter serves SGLang's MHATokenToKVPoolHost; "
                             f"this model's host pool is {kind}")
        if host.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"radixkv's SGLang L3 adapter serves float16, bfloat16 and float32 "
                             f"K/V; this host pool holds {host.dtype} (a float8 K/V cache)")
        self.page_size = host.page_size
        self.dtype = host.dtype
        device = MHAKVCache(host.head_num, host.layer_num, host.head_dim, 1, host.dtype,
                            page_size=host.page_size, device="cpu")
        # Pages [0, BATCH_PAGES) stage reads, the rest writes: SGLang reads
        # and writes from two threads. A page's bytes are SGLang's flat page,
        # in its host layout's order (which the fingerprint names).
        self.staging = HostKVCache(device, num_pages=2 * BATCH_PAGES, layout="page_first",
                                   pin_memory=False)
        cfg, o = self.config, self.options
        shard = (f"pp{cfg.pp_rank}/{cfg.pp_size} cp{cfg.attn_cp_rank}/{cfg.attn_cp_size} "
                 f"dcp{cfg.dcp_rank}/{cfg.dcp_size}")
        namespace = o.get("namespace")
        self.fingerprint = config_fingerprint(
            model=cfg.model_name or "", dtype=host.dtype, page_size=host.page_size,
            layout=f"sglang:{host.layout}", num_layers=host.layer_num, kv_heads=host.head_num,
            head_dim=host.head_dim, tp_rank=cfg.tp_rank, tp_size=cfg.tp_size,
            namespace=shard if namespace is None else f"{shard} {namespace}")
        if self.store == "file":
            backend = FileStorage(o["directory"], self.fingerprint, o.get("max_bytes"),
                                  shared=bool(o.get("shared", False)), secret=self.secret)
        else:
            backend = MooncakeStorage(
                o["master_address"], o["metadata_server"],
                local_hostname=o.get("local_hostname", "127.0.0.1"),
                protocol=o.get("protocol", "tcp"),
                segment_bytes=int(o.get("segment_bytes", 256 << 20)),
                buffer_bytes=int(o.get("buffer_bytes", 64 << 20)),
                fingerprint=self.fingerprint, secret=self.secret)
        backend.attach(self.staging)
        # SGLang reads and writes from two threads: one at a time where the
        # backend needs it.
        self._one_at_a_time = backend.call_lock() or contextlib.nullcontext()
        self.backend = backend

    def on_host_pools_registered(self) -> None:
        extra = sorted(str(name) for name in getattr(self, "registered_pools", {})
                       if str(name) != "kv")
        if extra:
            raise ValueError("radixkv's SGLang L3 adapter moves the K/V pool only (interface "
                             f"v1); this model also registers {', '.join(extra)}")

    def _key(self, key: str) -> str:
        """The store's name for SGLang's page key: SHA-256 of the
        fingerprint and the key, or with a secret an HMAC under the key
        derived from it."""
        parts = [self.fingerprint, key.encode()]
        if self.backend.name_key is not None:
            return _core.hmac_sha256(self.backend.name_key, parts).hex()
        return hashlib.sha256(b"".join(parts)).hexdigest()

    def _flat(self, page: int) -> torch.Tensor:
        return self.backend.page_view(page).view(self.dtype)

    # -- interface v1 ---------------------------------------------------------------------

    def batch_exists(self, keys: List[str], extra_info=None) -> int:
        if self.backend is None or not keys or self.reads.down():
            return 0
        return int(self.backend.batch_exists([self._key(k) for k in keys]))

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info=None) -> List[bool]:
        """Reads pages into SGLang's host pool at `host_indices` (a page's
        first slot every `page_size`); a page after a missing one is not
        read (SGLang takes the pages before the first miss)."""
        out = [False] * len(keys)

        def take(i: int, page: Optional[torch.Tensor]) -> bool:
            if page is None:
                return False
            self.mem_pool_host.set_from_flat_data_page(int(host_indices[i * self.page_size]),
                                                       page)
            out[i] = True
            return True

        if self._ready(keys, self.reads):
            self._read(keys, take)
        return out

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info=None) -> List[bool]:
        if not self._ready(keys, self.writes):
            return [False] * len(keys)
        return self._write(keys, lambda i: self.mem_pool_host.get_data_page(
            int(host_indices[i * self.page_size]), flat=True))

    # -- the older calls (flat pages by value) ---------------------------------------------

    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> Optional[torch.Tensor]:
        got = self.batch_get([key], [target_location] if target_location is not None else None)
        return got[0]

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[Optional[torch.Tensor]]:
        out: List[Optional[torch.Tensor]] = [None] * len(keys)

        def take(i: int, page: Optional[torch.Tensor]) -> bool:
            dst = None if target_locations is None else target_locations[i]
            if page is not None and dst is None:
                out[i] = page.clone()
            elif page is not None:
                out[i] = dst.copy_(page.reshape(dst.shape))
            return True

        if self._ready(keys, self.reads):
            self._read(keys, take)
        return out

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Optional[Any] = None,
                  target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        if values is None or not self._ready(keys, self.writes):
            return False
        return all(self._write(keys, lambda i: values[i]))

    # -- through the staging pages --------------------------------------------------------

    def _ready(self, keys: List[str], health: Health) -> bool:
        """Whether a call of this direction goes to the store now."""
        if self.backend is None or not keys:
            return False
        if health.down():
            if health is self.reads:
                self.skipped_reads += 1
            else:
                self.skipped_writes += 1
            return False
        return True

    def _read(self, keys: List[str], take: Callable[[int, Optional[torch.Tensor]], bool]) -> None:
        """Reads `keys` a staging chunk at a time, handing `take(i, page)`
        each page (None: not read) in order until it returns False."""
        with self._read_lock:
            for at in range(0, len(keys), BATCH_PAGES):
                chunk = [self._key(k) for k in keys[at:at + BATCH_PAGES]]
                got = self._moved(self.reads, self.backend.batch_get, chunk,
                                  list(range(len(chunk))))
                for i, ok in enumerate(got):
                    if not take(at + i, self._flat(i) if ok else None):
                        return

    def _write(self, keys: List[str], page_of: Callable[[int], torch.Tensor]) -> List[bool]:
        """Writes page_of(i) under keys[i], a staging chunk at a time."""
        out: List[bool] = []
        with self._write_lock:
            for at in range(0, len(keys), BATCH_PAGES):
                chunk = [self._key(k) for k in keys[at:at + BATCH_PAGES]]
                pages = list(range(BATCH_PAGES, BATCH_PAGES + len(chunk)))
                for i, page in enumerate(pages):
                    self._flat(page).copy_(page_of(at + i).reshape(-1))
                out += [bool(d) for d in self._moved(self.writes, self.backend.batch_set,
                                                     chunk, pages)]
        return out

    def _moved(self, health: Health, fn, keys, pages) -> List[bool]:
        """One backend call; its direction's back-off learns how it went."""
        errors = self.backend.thread_errors()
        with self._one_at_a_time:
            done = fn(keys, pages)
        (health.failed if self.backend.thread_errors() > errors else health.succeeded)()
        return done

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def close(self) -> None:
        if self.backend is not None:
            self.backend.close()

    def get_stats(self):
        """None: SGLang's metrics take its own StorageMetrics type; radixkv's
        counts are `counts()`."""
        return None

    def counts(self) -> dict:
        errors, corrupt = self.backend.counts() if self.backend is not None else (0, 0)
        return {"errors": errors, "corrupt_pages": corrupt, "skipped_reads": self.skipped_reads,
                "skipped_writes": self.skipped_writes}
