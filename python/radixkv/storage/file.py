"""The embedded storage backend: one file per page under a directory."""

from __future__ import annotations

import collections
import os
import struct
from typing import List, Optional, Sequence

from radixkv._core import crc32c
from radixkv.storage.base import StorageBackend

MAGIC = b"RKVPAGE2"
# magic, key (32 raw bytes), configuration fingerprint (32), payload length, CRC-32C
HEADER = struct.Struct("<8s32s32sQI")


class FileStorage(StorageBackend):
    """Pages as files `directory/<fingerprint[:16]>/<key[:2]>/<key>.page`, each a header (magic, the
    page key, the configuration fingerprint, the payload length and its
    CRC-32C) and the page's bytes. A write goes to a temporary name and is
    renamed into place, so a reader sees a whole page or none. A read checks
    every header field and the checksum before the page counts: a corrupt,
    truncated or foreign file is a miss (`corrupt_pages`), never wrong K/V.

    `max_bytes` bounds what this process knows of (the pages it wrote, and
    those found when it started): past it, the least recently used of them
    (written or read) are removed, at start too. Several processes may share
    the directory; each keeps its own order and bound (so two together may
    hold twice `max_bytes`), and a page removed under a reader is a miss.
    """

    def __init__(self, directory: str, fingerprint: bytes, max_bytes: Optional[int] = None):
        super().__init__()
        if not isinstance(fingerprint, bytes) or len(fingerprint) != 32:
            raise ValueError("fingerprint must be 32 bytes (radixkv.storage.config_fingerprint)")
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1 or None, got {max_bytes}")
        # Each configuration's pages in a directory of their own: one never
        # takes another's file for its page, and never skips a write for it.
        self.directory = os.path.join(os.path.abspath(directory), fingerprint.hex()[:16])
        self.fingerprint = fingerprint
        self._made: set = set()  # subdirectories known to exist
        self.max_bytes = max_bytes
        os.makedirs(self.directory, exist_ok=True)
        self._lru: "collections.OrderedDict[str, int]" = collections.OrderedDict()
        self._total = 0
        self.removed_pages = 0
        if max_bytes is not None:
            self._scan()

    def _scan(self) -> None:
        found = []
        for sub in os.scandir(self.directory):
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub.path):
                if entry.name.endswith(".page"):
                    st = entry.stat()
                    found.append((st.st_mtime_ns, entry.path, st.st_size))
        for _, path, size in sorted(found):
            self._lru[path] = size
            self._total += size
        self._trim()

    def path(self, key: str) -> str:
        return os.path.join(self.directory, key[:2], key + ".page")

    def batch_exists(self, keys: Sequence[str]) -> int:
        for i, key in enumerate(keys):
            if not os.path.exists(self.path(key)):
                return i
        return len(keys)

    def batch_get(self, keys: Sequence[str], host_pages: Sequence[int]) -> List[bool]:
        return [self._get(k, p) for k, p in zip(keys, host_pages)]

    def _get(self, key: str, page: int) -> bool:
        path = self.path(key)
        view = memoryview(self.page_view(page).numpy())
        try:
            with open(path, "rb") as f:
                header = f.read(HEADER.size)
                if len(header) != HEADER.size:
                    return self._corrupt(path)
                magic, raw_key, fingerprint, length, crc = HEADER.unpack(header)
                if (magic != MAGIC or raw_key != bytes.fromhex(key)
                        or fingerprint != self.fingerprint or length != self.page_bytes):
                    return self._corrupt(path)
                if f.readinto(view) != length or f.read(1):
                    return self._corrupt(path)
        except FileNotFoundError:
            if path in self._lru:  # removed by another process
                self._total -= self._lru.pop(path)
            return False
        except OSError:
            self.count_error()
            return False
        if crc32c(view) != crc:
            return self._corrupt(path)
        if path in self._lru:
            self._lru.move_to_end(path)
        return True

    def _corrupt(self, path: str) -> bool:
        """A page that failed its checks is a miss, and is removed: the next
        write of it puts a good one in its place."""
        with self._lock:
            self.corrupt_pages += 1
        try:
            os.unlink(path)
        except OSError:
            pass
        if path in self._lru:
            self._total -= self._lru.pop(path)
        return False

    def batch_set(self, keys: Sequence[str], host_pages: Sequence[int]) -> List[bool]:
        return [self._set(k, p) for k, p in zip(keys, host_pages)]

    def _set(self, key: str, page: int) -> bool:
        path = self.path(key)
        view = memoryview(self.page_view(page).numpy())
        header = HEADER.pack(MAGIC, bytes.fromhex(key), self.fingerprint, self.page_bytes,
                             crc32c(view))
        tmp = f"{path}.{os.getpid()}.{id(view):x}.tmp"
        try:
            sub = os.path.dirname(path)
            if sub not in self._made:
                os.makedirs(sub, exist_ok=True)
                self._made.add(sub)
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(view)
            os.replace(tmp, path)
        except OSError:
            self.count_error()
            self._made.discard(os.path.dirname(path))  # removed under us? made again next time
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return False
        if self.max_bytes is not None:
            self._account(path, HEADER.size + self.page_bytes)
        return True

    def _account(self, path: str, size: int) -> None:
        if path in self._lru:
            self._total -= self._lru.pop(path)
        self._lru[path] = size
        self._total += size
        self._trim(keep=1)

    def _trim(self, keep: int = 0) -> None:
        while self._total > self.max_bytes and len(self._lru) > keep:
            old, old_size = self._lru.popitem(last=False)
            self._total -= old_size
            try:
                os.unlink(old)
                self.removed_pages += 1
            except OSError:
                pass
