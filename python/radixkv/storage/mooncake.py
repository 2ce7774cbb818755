"""Mooncake Store as the storage backend, and a local master for tests and replays.

Needs `pip install 'radixkv[mooncake]'` (the `mooncake-transfer-engine-non-cuda`
wheel on CPU machines); `mooncake_master` needs Debian's libibverbs1,
librdmacm1 and libnuma1 (`.ci/setup` installs them).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from typing import List, Optional, Sequence

from radixkv.storage.base import StorageBackend


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def master_binary() -> Optional[str]:
    """The `mooncake_master` executable of the installed wheel, or None."""
    try:
        import mooncake
    except ImportError:
        return None
    inside = os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")
    if os.access(inside, os.X_OK):
        return inside
    return shutil.which("mooncake_master")


class MooncakeMaster:
    """A `mooncake_master` on 127.0.0.1 with its HTTP metadata server (and its
    metrics server), on free ports; stopped by `stop()` or at the end of a
    `with` block."""

    def __init__(self, binary: Optional[str] = None, start_timeout_s: float = 20.0):
        binary = binary or master_binary()
        if binary is None:
            raise RuntimeError("mooncake_master not found: pip install 'radixkv[mooncake]'")
        self.rpc_port, self.http_port, self.metrics_port = _free_port(), _free_port(), _free_port()
        self._log = tempfile.NamedTemporaryFile(prefix="mooncake_master.", suffix=".log",
                                                delete=False)
        self.log_path = self._log.name
        self.proc = subprocess.Popen(
            [binary, f"--rpc_port={self.rpc_port}", "--rpc_address=127.0.0.1",
             "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
             f"--http_metadata_server_port={self.http_port}", "--metrics_host=127.0.0.1",
             f"--metrics_port={self.metrics_port}"],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + start_timeout_s
        while not (self._listening(self.rpc_port) and self._listening(self.http_port)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                with open(self.log_path, errors="replace") as f:
                    tail = f.read()[-2000:]
                raise RuntimeError(f"mooncake_master did not start:\n{tail}")
            time.sleep(0.05)

    @staticmethod
    def _listening(port: int) -> bool:
        with socket.socket() as s:
            s.settimeout(0.2)
            return s.connect_ex(("127.0.0.1", port)) == 0

    @property
    def master_address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> "MooncakeMaster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class MooncakeStorage(StorageBackend):
    """Pages in Mooncake Store: the host pool is registered with the client
    once, and pages move with its batched zero-copy calls
    (`batch_put_from`, `batch_get_into`, `batch_is_exist`). Keys are the
    page keys (seeded by the configuration fingerprint, so configurations
    never share one) under `prefix`; a value whose size is not a page's is a
    miss. The client contributes `segment_bytes` of its memory to the store.
    `fingerprint` (optional) seeds the storage tier's keys when the
    CacheManager is given no `storage_seed`.
    """

    def __init__(self, master_address: str, metadata_server: str,
                 local_hostname: str = "127.0.0.1", protocol: str = "tcp",
                 segment_bytes: int = 256 << 20, buffer_bytes: int = 64 << 20,
                 prefix: str = "radixkv/", fingerprint: Optional[bytes] = None):
        super().__init__()
        if fingerprint is not None and (not isinstance(fingerprint, bytes)
                                        or len(fingerprint) != 32):
            raise ValueError("fingerprint must be 32 bytes (radixkv.storage.config_fingerprint)")
        self.fingerprint = fingerprint
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise RuntimeError("Mooncake Store's client is not installed: "
                               "pip install 'radixkv[mooncake]'") from e
        self.prefix = prefix
        self.store = MooncakeDistributedStore()
        rc = self.store.setup(local_hostname, metadata_server, segment_bytes, buffer_bytes,
                              protocol, "", master_address)
        if rc != 0:
            raise RuntimeError(f"Mooncake Store setup failed (code {rc}): master "
                               f"{master_address}, metadata {metadata_server}")
        self._closed = False

    def _attached(self) -> None:
        rc = self.store.register_buffer(self._bytes.data_ptr(),
                                        self.page_bytes * self.pool.num_pages)
        if rc != 0:
            raise RuntimeError(f"Mooncake Store could not register the host pool (code {rc})")

    def _keys(self, keys: Sequence[str]) -> List[str]:
        return [self.prefix + k for k in keys]

    def batch_exists(self, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        try:
            found = self.store.batch_is_exist(self._keys(keys))
        except Exception:
            self.count_error()
            return 0
        n = 0
        for f in found:
            if f != 1:
                if f < 0:
                    self.count_error()
                break
            n += 1
        return n

    def batch_get(self, keys: Sequence[str], host_pages: Sequence[int]) -> List[bool]:
        if not keys:
            return []
        size = self.page_bytes
        try:
            got = self.store.batch_get_into(self._keys(keys),
                                            [self.page_address(p) for p in host_pages],
                                            [size] * len(keys))
        except Exception:
            self.count_error(len(keys))
            return [False] * len(keys)
        ok = [g == size for g in got]
        bad = sum(1 for g in got if g != size and g > 0)
        if bad:
            with self._lock:
                self.corrupt_pages += bad
        errors = sum(1 for g in got if g < 0)
        if errors:
            self.count_error(errors)
        return ok

    def batch_set(self, keys: Sequence[str], host_pages: Sequence[int]) -> List[bool]:
        if not keys:
            return []
        try:
            rc = self.store.batch_put_from(self._keys(keys),
                                           [self.page_address(p) for p in host_pages],
                                           [self.page_bytes] * len(keys))
        except Exception:
            self.count_error(len(keys))
            return [False] * len(keys)
        ok = [r == 0 for r in rc]
        failed = ok.count(False)
        if failed:
            self.count_error(failed)
        return ok

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self.store.close()
            except Exception:
                pass
