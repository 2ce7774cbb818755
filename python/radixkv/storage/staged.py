"""radixkv's storage tier for an engine that moves pages itself: a file
store or Mooncake Store with radixkv's page integrity checks,
per-direction back-off and stores shared by many instances.

- `StoreQueries`: how many of a chain of names a store holds, asked from an
  engine's scheduler thread (bounded for a store whose queries may block).
- `HostPageIO`: reads and writes of a host pool's own pages (no staging
  copy) on a thread of their own, their results taken when the engine
  looks (the vLLM connector's worker).
- `StagedStorage`: pages handed as tensors through a small staging pool
  (SGLang's L3 interface).

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
import queue
import threading
from typing import Callable, List, Literal, Optional, Tuple, overload

import torch

from radixkv._checks import as_count
from radixkv.kvcache.host_pool import HostKVCache
from radixkv.kvcache.mha_pool import MHAKVCache
from radixkv.storage.base import StorageBackend
from radixkv.storage.file import FileStorage
from radixkv.storage.health import Health, StorageFaultPolicy
from radixkv.storage.mooncake import MooncakeStorage
from radixkv.storage.threads import BoundedQuery, drop_queued, serving

# Pages staged per direction; longer calls go in chunks.
BATCH_PAGES = 32
_FAULT_OPTIONS = ("failures_in_a_row", "retry_after_s", "max_retry_after_s", "query_timeout_s")
# The options that belong to one backend only.
_OWN_OPTIONS = {
    "file": ("directory", "max_bytes", "shared"),
    "mooncake": (
        "master_address",
        "metadata_server",
        "local_hostname",
        "listen_on_all_interfaces",
        "protocol",
        "segment_bytes",
        "buffer_bytes",
    ),
}
# Every option a store takes (`storage_options`, `open_backend`).
STORAGE_OPTIONS = (
    "backend",
    "directory",
    "max_bytes",
    "shared",
    "master_address",
    "metadata_server",
    "local_hostname",
    "listen_on_all_interfaces",
    "protocol",
    "segment_bytes",
    "buffer_bytes",
    "secret",
    "secret_file",
    *_FAULT_OPTIONS,
)


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
    other = sorted(set(options) & set(_OWN_OPTIONS["mooncake" if backend == "file" else "file"]))
    if other:
        raise ValueError(
            f"extra_config {', '.join(other)}: options of the other backend than {backend!r}"
        )
    if backend == "file" and not options.get("directory"):
        raise ValueError("extra_config directory: the file store's directory is required")
    for key in ("master_address", "metadata_server") if backend == "mooncake" else ():
        if not isinstance(options.get(key), str) or not options[key]:
            raise ValueError(f"extra_config {key}: Mooncake's {key} is required (a string)")
    for key in ("shared", "listen_on_all_interfaces"):
        if key in options and not isinstance(options[key], bool):
            raise TypeError(f"extra_config {key} must be true or false, got {options[key]!r}")
    for key, minimum in (("max_bytes", 1), ("segment_bytes", 1), ("buffer_bytes", 1)):
        if options.get(key) is not None:
            options[key] = as_count(options[key], f"extra_config {key}", minimum=minimum)
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
            shared=o.get("shared", False),
            secret=o["secret"],
            codec=codec,
        )
    return MooncakeStorage(
        o["master_address"],
        o["metadata_server"],
        local_hostname=o.get("local_hostname", "127.0.0.1"),
        listen_on_all_interfaces=o.get("listen_on_all_interfaces", False),
        protocol=o.get("protocol", "tcp"),
        segment_bytes=o.get("segment_bytes") or 256 << 20,
        buffer_bytes=o.get("buffer_bytes") or 64 << 20,
        fingerprint=fingerprint,
        secret=o["secret"],
        codec=codec,
    )


def fault_policy(options: dict) -> StorageFaultPolicy:
    """The back-off and query bound `options` give (radixkv's storage tier's
    defaults and checks)."""
    return StorageFaultPolicy(**{k: options[k] for k in _FAULT_OPTIONS if k in options})


class StoreQueries:
    """A store and the back-off of its two directions; how many of a chain
    of names it holds (`exists`)."""

    def __init__(self, backend: StorageBackend, faults: StorageFaultPolicy) -> None:
        self.backend = backend
        self.faults = faults
        self.reads, self.writes = Health(faults), Health(faults)
        self.skipped_reads = self.skipped_writes = 0
        self.query_timeouts = 0
        self._one_at_a_time = backend.call_lock() or contextlib.nullcontext()
        self._asker = (
            BoundedQuery(self._exists, backend.count_error) if backend.blocking_queries else None
        )

    @classmethod
    def open(cls, options: dict, fingerprint: bytes, codec: Optional[str] = None) -> "StoreQueries":
        """The store `options` name (checked by `storage_options`)."""
        o = storage_options(options)
        return cls(open_backend(o, fingerprint, codec), fault_policy(o))

    @property
    def name_key(self) -> Optional[bytes]:
        """The key page names are HMACs under (from the secret), or None."""
        return self.backend.name_key

    def _exists(self, names: List[str]) -> int:
        with self._one_at_a_time:  # Mooncake: not beside a read or a write
            return int(self.backend.batch_exists(names))

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
            return self._exists(names)
        hits, why = self._asker.ask(names, self.faults.query_timeout_s)
        if why:
            self.query_timeouts += why == "timeout"
            self.reads.failed()
            return None
        return 0 if hits is None else int(hits)

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


class HostPageIO(StoreQueries):
    """Reads and writes of a host pool's own pages (the store's backend
    attached to the pool: no staging copy), in the order they are asked, on
    a thread of their own. `read(op, names, pages)` and `write(...)` queue
    a call and return; `take_done()` gives `(op, one flag per page)` of the
    calls that finished. A direction in back-off finishes its calls at once,
    every page failed (a read: counted in `skipped_reads`)."""

    def __init__(self, backend: StorageBackend, faults: StorageFaultPolicy, pool) -> None:
        super().__init__(backend, faults)
        backend.attach(pool)
        self._calls: "queue.SimpleQueue" = queue.SimpleQueue()
        self._done: List[Tuple[int, List[bool]]] = []
        self._lock = threading.Lock()
        self._pending = 0
        self._thread = threading.Thread(
            target=self._serve, name="radixkv-host-page-io", daemon=True
        )
        self._thread.start()

    @classmethod
    def open_for(
        cls, options: dict, fingerprint: bytes, pool, codec: Optional[str] = None
    ) -> "HostPageIO":
        o = storage_options(options)
        return cls(open_backend(o, fingerprint, codec), fault_policy(o), pool)

    @property
    def in_flight(self) -> int:
        """Calls queued or running."""
        with self._lock:
            return self._pending

    def read(self, op: int, names: List[str], pages: List[int]) -> None:
        self._queue(op, self.reads, names, pages)

    def write(self, op: int, names: List[str], pages: List[int]) -> None:
        self._queue(op, self.writes, names, pages)

    def _queue(self, op: int, health: Health, names: List[str], pages: List[int]) -> None:
        if len(names) != len(pages):
            raise ValueError(f"names ({len(names)}) and pages ({len(pages)}) must pair up")
        with self._lock:
            self._pending += 1
        self._calls.put((op, health, list(names), list(pages)))

    def take_done(self) -> List[Tuple[int, List[bool]]]:
        with self._lock:
            done, self._done = self._done, []
        return done

    def _serve(self) -> None:
        with serving(self._calls):
            while True:
                call = self._calls.get()
                if call is None:
                    return
                op, health, names, pages = call
                ok = [False] * len(names)
                try:
                    if self._ready(names, health):
                        fn = (
                            self.backend.batch_get
                            if health is self.reads
                            else self.backend.batch_set
                        )
                        ok = []
                        for at in range(0, len(names), BATCH_PAGES):
                            part = slice(at, at + BATCH_PAGES)
                            ok += [
                                bool(x) for x in self._moved(health, fn, names[part], pages[part])
                            ]
                except Exception:  # noqa: BLE001  (a backend's own failure: pages not moved)
                    self.backend.count_error()
                    health.failed()
                    ok = [False] * len(names)
                with self._lock:
                    self._done.append((op, ok))
                    self._pending -= 1

    def close(self) -> None:
        """Waits for the calls queued so far, then closes the store."""
        self._calls.put(None)
        self._thread.join(self.faults.close_timeout_s)
        if self._thread.is_alive():  # a call that hangs: its pages are never reused
            drop_queued(self._calls)
        else:
            super().close()


class StagedStorage(StoreQueries):
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
        super().__init__(backend, fault_policy(o))
        self._read_lock, self._write_lock = threading.Lock(), threading.Lock()

    def _flat(self, page: int) -> torch.Tensor:
        return self.backend.page_view(page).view(self.dtype)

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
