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

Other keys of the extra config: `max_bytes`, `shared` (a store directory
shared with other users on purpose), `secret` (str or hex via
`secret_hex`), and for `"store": "mooncake"`: `master_address`,
`metadata_server`, `local_hostname`, `protocol`, `segment_bytes`,
`buffer_bytes`. SGLang's page keys (its SHA-256 chain over token pages)
name the pages; radixkv's store prefixes them with a fingerprint of the
model, K/V dtype, page shape and tensor-parallel rank, so two
configurations never read each other's bytes.

Pages move through a small page-first staging pool of radixkv's (SGLang's
flat page is [2, layers, page, heads, head_dim], a radixkv page-first
page): one copy more than a store writing SGLang's host pool in place, in
exchange for every check and format of radixkv's store. MHA models only;
an MLA model is refused at start-up.
"""

from __future__ import annotations

import hashlib
import string
import threading
from types import SimpleNamespace
from typing import Any, List, Optional

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from radixkv.kvcache.host_pool import HostKVCache
from radixkv.kvcache.mha_pool import MHAKVCache
from radixkv.storage import FileStorage, MooncakeStorage, config_fingerprint
from radixkv.storage.health import Health

# SGLang moves at most this many pages per call (STORAGE_BATCH_SIZE).
BATCH_PAGES = 128
_HEX = set(string.hexdigits.lower())


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
        if extra.get("secret_hex") is not None:
            secret = bytes.fromhex(extra["secret_hex"])
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
        self.page_size = host.page_size
        self.dtype = host.dtype
        shape = SimpleNamespace(layers=host.layer_num, heads=host.head_num,
                                head_dim=host.head_dim)
        device = MHAKVCache(shape.heads, shape.layers, shape.head_dim, 1, host.dtype,
                            page_size=host.page_size, device="cpu")
        # Pages [0, BATCH_PAGES) stage reads, the rest writes: SGLang reads
        # and writes from two threads.
        self.staging = HostKVCache(device, num_pages=2 * BATCH_PAGES, layout="page_first",
                                   pin_memory=False)
        cfg = self.config
        fingerprint = config_fingerprint(
            model=cfg.model_name or "", dtype=host.dtype, page_size=host.page_size,
            layout="page_first", num_layers=shape.layers, kv_heads=shape.heads,
            head_dim=shape.head_dim, tp_rank=cfg.tp_rank, tp_size=cfg.tp_size)
        o = self.options
        if self.store == "file":
            backend = FileStorage(o["directory"], fingerprint, o.get("max_bytes"),
                                  shared=bool(o.get("shared", False)), secret=self.secret)
        else:
            backend = MooncakeStorage(
                o["master_address"], o["metadata_server"],
                local_hostname=o.get("local_hostname", "127.0.0.1"),
                protocol=o.get("protocol", "tcp"),
                segment_bytes=int(o.get("segment_bytes", 256 << 20)),
                buffer_bytes=int(o.get("buffer_bytes", 64 << 20)),
                fingerprint=fingerprint, secret=self.secret)
        backend.attach(self.staging)
        self.backend = backend

    @staticmethod
    def _key(key: str) -> str:
        """A radixkv page key (64 hex digits) for SGLang's key: its own when
        it is one, else SHA-256 of it."""
        if len(key) == 64 and set(key) <= _HEX:
            return key
        return hashlib.sha256(key.encode()).hexdigest()

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
        if self.backend is None or not keys:
            return out
        if self.reads.down():
            self.skipped_reads += 1
            return out
        ps = self.page_size
        with self._read_lock:
            for at in range(0, len(keys), BATCH_PAGES):
                chunk = [self._key(k) for k in keys[at:at + BATCH_PAGES]]
                errors = self.backend.thread_errors()
                got = self.backend.batch_get(chunk, list(range(len(chunk))))
                failed = self.backend.thread_errors() > errors
                (self.reads.failed if failed else self.reads.succeeded)()
                for i, ok in enumerate(got):
                    if not ok:
                        return out
                    self.mem_pool_host.set_from_flat_data_page(
                        int(host_indices[(at + i) * ps]), self._flat(i))
                    out[at + i] = True
        return out

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info=None) -> List[bool]:
        out = [False] * len(keys)
        if self.backend is None or not keys:
            return out
        if self.writes.down():
            self.skipped_writes += 1
            return out
        ps = self.page_size
        with self._write_lock:
            for at in range(0, len(keys), BATCH_PAGES):
                chunk = [self._key(k) for k in keys[at:at + BATCH_PAGES]]
                pages = list(range(BATCH_PAGES, BATCH_PAGES + len(chunk)))
                for i, page in enumerate(pages):
                    data = self.mem_pool_host.get_data_page(int(host_indices[(at + i) * ps]),
                                                            flat=True)
                    self._flat(page).copy_(data.reshape(-1))
                errors = self.backend.thread_errors()
                done = self.backend.batch_set(chunk, pages)
                failed = self.backend.thread_errors() > errors
                (self.writes.failed if failed else self.writes.succeeded)()
                out[at:at + len(chunk)] = [bool(d) for d in done]
        return out

    # -- the older calls (flat pages by value) ---------------------------------------------

    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> Optional[torch.Tensor]:
        got = self.batch_get([key], [target_location] if target_location is not None else None)
        return got[0]

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[Optional[torch.Tensor]]:
        out: List[Optional[torch.Tensor]] = [None] * len(keys)
        if self.backend is None or not keys or self.reads.down():
            return out
        with self._read_lock:
            for at in range(0, len(keys), BATCH_PAGES):
                chunk = [self._key(k) for k in keys[at:at + BATCH_PAGES]]
                got = self.backend.batch_get(chunk, list(range(len(chunk))))
                for i, ok in enumerate(got):
                    if not ok:
                        continue
                    page = self._flat(i)
                    dst = None if target_locations is None else target_locations[at + i]
                    if dst is None:
                        out[at + i] = page.clone()
                    else:
                        dst.reshape(-1).copy_(page)
                        out[at + i] = dst
        return out

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Optional[Any] = None,
                  target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        if self.backend is None or not keys or values is None or self.writes.down():
            return False
        ok = True
        with self._write_lock:
            for at in range(0, len(keys), BATCH_PAGES):
                chunk = [self._key(k) for k in keys[at:at + BATCH_PAGES]]
                pages = list(range(BATCH_PAGES, BATCH_PAGES + len(chunk)))
                for i, page in enumerate(pages):
                    self._flat(page).copy_(values[at + i].reshape(-1))
                ok = all(self.backend.batch_set(chunk, pages)) and ok
        return ok

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def close(self) -> None:
        if self.backend is not None:
            self.backend.close()

    def get_stats(self):
        if self.backend is None:
            return None
        errors, corrupt = self.backend.counts()
        return {"errors": errors, "corrupt_pages": corrupt, "skipped_reads": self.skipped_reads,
                "skipped_writes": self.skipped_writes}
