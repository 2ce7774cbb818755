"""radixkv's storage tier for an engine that hands pages as tensors: a file
store or Mooncake Store behind a small staging pool, with radixkv's page
integrity checks, per-direction back-off and stores shared by many
instances. The SGLang L3 adapter and the vLLM connector both stand on it.

Options (an engine's extra config, a dict): `backend` ("file" or "mooncake"),
`directory`, `max_bytes` and `shared` for the file store; `master_address`,
`metadata_server`, `local_hostname`, `listen_on_all_interfaces`, `protocol`,
`segment_bytes` and `buffer_bytes` for Mooncake (see MooncakeStorage); `secret` or `secret_file` (a file holding it);
`failures_in_a_row`, `retry_after_s` and `max_retry_after_s` for the back-off;
`query_timeout_s` (0.05) bounds an existence query to a store whose queries
may block (Mooncake, a network file system) when it is asked from an
engine's scheduler thread (`exists(..., bounded=True)`).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, List, Literal, Optional, overload

import torch

from radixkv.kvcache.host_pool import HostKVCache
from radixkv.kvcache.mha_pool import MHAKVCache
from radixkv.scheduler.storage_tier import StorageFaultPolicy
from radixkv.storage.threads import BoundedQuery
from radixkv.storage import FileStorage, MooncakeStorage, StorageBackend
from radixkv.storage.health import Health

# Pages staged per direction; longer calls go in chunks.
BATCH_PAGES = 32
_FAULT_OPTIONS = ("failures_in_a_row", "retry_after_s", "max_retry_after_s", "query_timeout_s")


def storage_options(options: Optional[dict]) -> dict:
    """`options` checked for what every store needs, with its secret read."""
    options = dict(options or {})
    if "store" in options:  # the key's old name: refused, never read as a file store
        raise ValueError(
            "extra_config store: the key is 'backend' now ('file', 'mooncake' or, for vLLM, "
            "'none')"
        )
    backend = options.setdefault("backend", "file")
    if backend not in ("file", "mooncake"):
        raise ValueError(f"extra_config backend must be 'file' or 'mooncake', got {backend!r}")
    if backend == "file" and not options.get("directory"):
        raise ValueError("extra_config directory: the file store's directory is required")
    secret = options.get("secret")
    if options.get("secret_file") is not None:
        with open(options.pop("secret_file"), "rb") as f:  # read once
            secret = f.read().strip()
    options["secret"] = secret.encode() if isinstance(secret, str) else secret
    return options


def open_backend(options: dict, fingerprint: bytes, codec: Optional[str] = None) -> StorageBackend:
    """The FileStorage or MooncakeStorage that `options` (checked by
    `storage_options`) name, its pages keyed under `fingerprint`."""
    o = options
    if o["backend"] == "file":
        return FileStorage(
            o["directory"],
            fingerprint,
            o.get("max_bytes"),
            shared=bool(o.get("shared", False)),
            secret=o["secret"],
            codec=codec,
        )
    return MooncakeStorage(
        o["master_address"],
        o["metadata_server"],
        local_hostname=o.get("local_hostname", "127.0.0.1"),
        listen_on_all_interfaces=bool(o.get("listen_on_all_interfaces", False)),
        protocol=o.get("protocol", "tcp"),
        segment_bytes=int(o.get("segment_bytes", 256 << 20)),
        buffer_bytes=int(o.get("buffer_bytes", 64 << 20)),
        fingerprint=fingerprint,
        secret=o["secret"],
        codec=codec,
    )


class StagedStorage:
    """A FileStorage or MooncakeStorage whose pages are `page_elems` elements
    of `dtype`, moved through a staging pool: reads and writes each have
    their own staging pages and lock (engines read and write from two
    threads), and their own back-off."""

    def __init__(
        self, options: dict, fingerprint: bytes, page_elems: int, dtype: torch.dtype
    ) -> None:
        o = storage_options(options)
        if page_elems <= 0 or page_elems % 2:
            raise ValueError(f"page_elems must be a positive even count, got {page_elems}")
        self.dtype = dtype
        # The back-off and the query bound of radixkv's own storage tier, with
        # its defaults and checks.
        self.faults = StorageFaultPolicy(**{k: o[k] for k in _FAULT_OPTIONS if k in o})
        self.reads, self.writes = Health(self.faults), Health(self.faults)
        self.skipped_reads = self.skipped_writes = 0
        # Pages [0, BATCH_PAGES) stage reads, the rest writes. A page is a
        # flat run of elements: the pool's shape only gives it its size.
        shape = MHAKVCache(
            1, 1, page_elems // 2, 1, dtype, page_size=1, device="cpu", tp_size=1
        )  # whole pages: no shard of the engine's world
        self.staging = HostKVCache(
            shape, num_pages=2 * BATCH_PAGES, layout="page_first", pin_memory=False
        )
        backend = open_backend(o, fingerprint)
        backend.attach(self.staging)
        self._one_at_a_time = backend.call_lock() or contextlib.nullcontext()
        self._read_lock, self._write_lock = threading.Lock(), threading.Lock()
        self.backend = backend
        self.query_timeouts = 0
        self._asker = (
            BoundedQuery(self.exists, backend.count_error) if backend.blocking_queries else None
        )

    @property
    def name_key(self) -> Optional[bytes]:
        """The key page names are HMACs under (from the secret), or None."""
        return self.backend.name_key

    def _flat(self, page: int) -> torch.Tensor:
        return self.backend.page_view(page).view(self.dtype)

    def _ready(self, names: List[str], health: Health) -> bool:
        """Whether a call of this direction goes to the store now."""
        if not names:
            return False
        if health.down():
            if health is self.reads:
                self.skipped_reads += 1
            else:
                self.skipped_writes += 1
            return False
        return True

    @overload
    def exists(self, names: List[str], bounded: Literal[False] = False) -> int: ...
    @overload
    def exists(self, names: List[str], bounded: bool) -> Optional[int]: ...

    def exists(self, names: List[str], bounded: bool = False) -> Optional[int]:
        """How many of `names`, from the first, the store holds. `bounded`:
        a store whose queries may block is asked on a thread and waited for
        at most `query_timeout_s`; None when it did not answer in time (or an
        earlier query still has not), which counts as a failed read."""
        if not names or self.reads.down():
            return 0
        if not bounded or self._asker is None:
            with self._one_at_a_time:  # Mooncake: not beside a read or a write
                return int(self.backend.batch_exists(names))
        hits, why = self._asker.ask(names, self.faults.query_timeout_s)
        if why:
            self.query_timeouts += why == "timeout"
            self.reads.failed()
            return None
        return 0 if hits is None else int(hits)

    def read(self, names: List[str], take: Callable[[int, Optional[torch.Tensor]], bool]) -> None:
        """Reads `names` a staging chunk at a time, handing `take(i, page)`
        each page (a flat tensor of the staging pool; None: not read) in
        order until it returns False. A store in back-off reads nothing."""
        if not self._ready(names, self.reads):
            return
        with self._read_lock:
            for at in range(0, len(names), BATCH_PAGES):
                chunk = names[at : at + BATCH_PAGES]
                got = self._moved(
                    self.reads, self.backend.batch_get, chunk, list(range(len(chunk)))
                )
                for i, ok in enumerate(got):
                    if not take(at + i, self._flat(i) if ok else None):
                        return

    def write(self, names: List[str], fill: Callable[[int, torch.Tensor], object]) -> List[bool]:
        """Writes page i under names[i], `fill(i, page)` having filled the
        flat staging page (what it returns is not used); which pages were
        stored."""
        if not self._ready(names, self.writes):
            return [False] * len(names)
        out: List[bool] = []
        with self._write_lock:
            for at in range(0, len(names), BATCH_PAGES):
                chunk = names[at : at + BATCH_PAGES]
                pages = list(range(BATCH_PAGES, BATCH_PAGES + len(chunk)))
                for i, page in enumerate(pages):
                    fill(at + i, self._flat(page))
                out += [
                    bool(d) for d in self._moved(self.writes, self.backend.batch_set, chunk, pages)
                ]
        return out

    def _moved(self, health: Health, fn, names, pages) -> List[bool]:
        """One backend call; its direction's back-off learns how it went."""
        errors = self.backend.thread_errors()
        with self._one_at_a_time:
            done = fn(names, pages)
        (health.failed if self.backend.thread_errors() > errors else health.succeeded)()
        return done

    def counts(self) -> dict:
        errors, corrupt = self.backend.counts()
        return {
            "errors": errors,
            "corrupt_pages": corrupt,
            "skipped_reads": self.skipped_reads,
            "skipped_writes": self.skipped_writes,
            "query_timeouts": self.query_timeouts,
        }

    def close(self) -> None:
        if self._asker is not None:
            self._asker.stop()
        self.backend.close()
