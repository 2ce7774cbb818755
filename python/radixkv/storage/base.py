"""The storage backend interface: whole pages between a host pool and a store."""

from __future__ import annotations

import inspect
import threading
from abc import ABC, abstractmethod
from typing import List, Optional, Sequence

import torch

from radixkv import _core
from radixkv.kvcache.host_pool import HostKVCache
from radixkv.kvcache.page_codec import Float8PageCodec, check_codec

MAX_BATCH = 128
"""Pages per backend call: the storage tier splits longer runs."""

TAG_BYTES = 32
"""Bytes of a page's authentication tag (HMAC-SHA-256) in a store with a secret."""


def _secret(secret) -> Optional[bytes]:
    if secret is None:
        return None
    if not isinstance(secret, (bytes, bytearray)):
        raise TypeError(
            f"secret must be bytes (a deployment secret) or None, got " f"{type(secret).__name__}"
        )
    if len(secret) < 16:
        raise ValueError(f"secret must be at least 16 bytes, got {len(secret)}")
    return bytes(secret)


def takes_parents(backend: "StorageBackend") -> bool:
    """Whether `backend.batch_set` takes `parents=` (a subclass that
    overrides it without the argument does not)."""
    try:
        return "parents" in inspect.signature(backend.batch_set).parameters
    except (TypeError, ValueError):
        return False


_CALL_LOCKS: dict = {}

_NOT_ATTACHED = "the storage backend has no host pool yet: attach() one first"


class StorageBackend(ABC):
    """A store of K/V pages addressed by page key, shared by many instances.

    Pages move straight between the store and the pages of the host pool
    given to `attach` (layout `page_first`: a page is one contiguous region of
    `page_bytes`). Calls come from the storage tier's thread, one at a time;
    `batch_get` and `batch_set` take at most MAX_BATCH pages and report one
    success flag per page. A page is in the store only if its own write
    succeeded; a read of a corrupt, truncated or foreign page fails (a miss),
    never fills the host page with someone else's bytes as if it were ours.
    Failures are counted in `errors`, not raised: the cache keeps serving.
    `batch_exists` may also be called from another thread while a call runs
    on the tier's thread: backends make that safe.

    `fingerprint` (32 bytes, `config_fingerprint`) names the configuration
    whose pages the backend holds; the storage tier seeds its keys with it
    unless given a seed of its own.

    `secret` (bytes, at least 16; None: none) is a deployment secret shared
    by the instances that share the store. With it a page's name in the store
    is keyed (HMAC-SHA-256 of its key, so nobody without the secret can name
    the page of a prompt: neither plant one nor probe for one) and every page
    carries an authentication tag over its key and bytes, checked on read: a
    page written without the secret is a miss, counted and removed.
    KV events keep the unkeyed chain, which says nothing of the secret.

    `codec` (None, or one of `page_codec.CODECS`) is what the backend writes
    in place of a page (`page_data`) and decodes on read (`page_target`,
    `page_landed`); `page_bytes` is then the encoded page's size. Pages
    written with a codec have keys of their own (`page_codec.codec_seed`). A
    host pool with a codec must be attached to a backend with the same one,
    which then moves its pages as they are (no second encoding).

    `blocking_queries`: whether `batch_exists` may block for long (a remote
    store, a network file system). The storage tier then asks it from the
    scheduler's thread on a thread of its own, waiting a bounded time.
    `concurrent_calls`: whether reads and writes may run at once (the
    tier reads and writes on a thread each); otherwise `call_lock()` makes
    them take turns. A backend whose `batch_set` takes `parents=` (the key
    of the page each page extends, None for the first of a chain or one not
    known) gets it from the storage tier (see `takes_parents`): a bounded
    store uses it to give up suffixes before their prefixes.
    """

    blocking_queries = False
    # Whether the backend can encode a plain host page with its codec (in a
    # staging buffer); one that moves pages zero-copy needs a host pool that
    # holds them encoded already.
    encodes_pages = True
    # Whether a read and a write may run at once (the storage tier reads and
    # writes on two threads); a backend that says no gets them one at a time.
    concurrent_calls = False

    def __init__(self, secret: Optional[bytes] = None, codec: Optional[str] = None) -> None:
        self.fingerprint: Optional[bytes] = None
        self.pool: Optional[HostKVCache] = None
        self.page_bytes = 0
        self.codec = check_codec(codec)
        self._codec: Optional[Float8PageCodec] = None
        self._staging = threading.local()  # a thread's buffer for encoded pages
        self._bytes: Optional[torch.Tensor] = None
        self._lock = threading.Lock()
        self.errors = 0  # failed calls or pages
        self.corrupt_pages = 0  # pages read back that failed their checks (or bad entries)
        self._local = threading.local()  # errors counted by the calling thread
        secret = _secret(secret)
        # Keys derived from the secret, one per use; None without a secret.
        self.name_key = self._derive(secret, b"radixkv page name v1")
        self.tag_key = self._derive(secret, b"radixkv page tag v1")

    @staticmethod
    def _derive(secret: Optional[bytes], label: bytes) -> Optional[bytes]:
        if secret is None:
            return None
        return _core.hmac_sha256(secret, [label])

    @property
    def keyed(self) -> bool:
        """Whether pages carry a name and tag keyed by a deployment secret."""
        return self.tag_key is not None

    def tag(self, key: str, data) -> bytes:
        """The authentication tag of page `key` (hex) holding `data`."""
        tag_key = self.tag_key
        if tag_key is None:  # callers tag only when `keyed`
            raise RuntimeError("tag() needs a keyed backend (one given a secret)")
        return _core.hmac_sha256(tag_key, [bytes.fromhex(key), data])

    def attach(self, pool: HostKVCache) -> None:
        """Pages move to and from `pool` (its `page_first` buffer)."""
        if not isinstance(pool, HostKVCache):
            raise TypeError(f"pool must be a HostKVCache, got {type(pool).__name__}")
        if pool.layout != "page_first":
            raise ValueError(
                "a storage backend moves whole pages: the host pool must be "
                f"page_first, got {pool.layout}"
            )
        if pool.codec is not None and self.codec != pool.codec:
            raise ValueError(
                f"the host pool holds {pool.codec} pages: give the storage backend "
                f"codec={pool.codec!r} too, so its keys name the codec"
            )
        if self.codec is not None and pool.codec is None and not self.encodes_pages:
            raise ValueError(
                f"{type(self).__name__} moves pages as the host pool holds them: for "
                f"codec={self.codec!r} give the host pool the codec (host_codec=)"
            )
        # A host pool with the backend's codec holds pages as they are written.
        codec = None if self.codec is None or pool.codec is not None else Float8PageCodec(pool)
        self.pool = pool
        self._bytes = pool.kv_buffer.view(torch.uint8).reshape(pool.num_pages, -1)[
            :, : pool.page_bytes
        ]
        self._codec = codec
        self._staging = threading.local()
        self.page_bytes = pool.page_bytes if codec is None else codec.encoded_bytes
        self._attached()

    def _attached(self) -> None:
        """Hook for backends that register the pool's memory."""

    def page_view(self, page: int) -> torch.Tensor:
        """Host page `page` as `page_bytes` uint8 (a view)."""
        pages = self._bytes
        if pages is None:
            raise RuntimeError(_NOT_ATTACHED)
        return pages[page]

    def _staged(self) -> memoryview:
        """This thread's buffer of one encoded page."""
        buf = getattr(self._staging, "buf", None)
        if buf is None or len(buf) != self.page_bytes:
            buf = self._staging.buf = memoryview(bytearray(self.page_bytes))
        return buf

    def page_data(self, page: int) -> memoryview:
        """What is written for host page `page` (`page_bytes`): its bytes, or
        with a codec their encoding (in this thread's buffer, valid until
        the thread's next call)."""
        view = self.page_view(page).numpy().data
        codec = self._codec
        if codec is None:
            return view
        out = self._staged()
        codec.encode(view, out)
        return out

    def page_target(self, page: int) -> memoryview:
        """Where a read of host page `page` puts the stored bytes
        (`page_bytes`): the page itself, or with a codec this thread's
        buffer, decoded into the page by `page_landed` once checked."""
        if self._codec is None:
            return self.page_view(page).numpy().data
        return self._staged()

    def page_landed(self, page: int, target: memoryview) -> None:
        """The bytes read into `target` (`page_target`) checked out: with a
        codec they are decoded into host page `page`."""
        codec = self._codec
        if codec is not None:
            codec.decode(target, self.page_view(page).numpy().data)

    def page_address(self, page: int) -> int:
        pages = self._bytes
        if pages is None:
            raise RuntimeError(_NOT_ATTACHED)
        return pages.data_ptr() + page * pages.stride(0)

    def call_lock(self) -> Optional[threading.Lock]:
        """None where reads and writes may run at once; else the lock they
        take turns on, one for every backend of this class in the process
        (Mooncake's clients in one process share their transfer engine)."""
        if self.concurrent_calls:
            return None
        return _CALL_LOCKS.setdefault(type(self), threading.Lock())

    def count_error(self, n: int = 1) -> None:
        with self._lock:
            self.errors += n
        self._local.errors = self.thread_errors() + n

    def count_corrupt(self, n: int = 1) -> None:
        with self._lock:
            self.corrupt_pages += n

    def counts(self):
        """(errors, corrupt pages) so far: what the storage tier reports."""
        return self.errors, self.corrupt_pages

    def thread_errors(self) -> int:
        """Errors counted so far by calls from the calling thread."""
        return getattr(self._local, "errors", 0)

    @abstractmethod
    def batch_exists(self, keys: Sequence[str]) -> int:
        """How many of `keys`, from the first, the store has (consecutive hits)."""

    @abstractmethod
    def batch_get(self, keys: Sequence[str], host_pages: Sequence[int]) -> List[bool]:
        """Reads page `keys[i]` into host page `host_pages[i]`; one flag per page."""

    @abstractmethod
    def batch_set(self, keys: Sequence[str], host_pages: Sequence[int]) -> List[bool]:
        """Writes host page `host_pages[i]` as `keys[i]`; one flag per page."""

    def close(self) -> None:
        """Releases what the backend holds (connections, registrations)."""
