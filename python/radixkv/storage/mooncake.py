"""Mooncake Store as the storage backend, and a local master for tests and replays.

Needs `pip install 'radixkv[mooncake]'` (the `mooncake-transfer-engine-non-cuda`
wheel on CPU machines); `mooncake_master` needs Debian's libibverbs1,
librdmacm1 and libnuma1 (`.ci/setup` installs them).
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import List, Optional, Sequence

import torch

from radixkv._checks import as_seconds
from radixkv.kvcache.page_codec import codec_seed
from radixkv.storage.base import TAG_BYTES, StorageBackend

log = logging.getLogger("radixkv")

# What batch_get_into answers for a key the store does not have: a miss, not an error.
_NOT_FOUND = -704
# Clients whose master did not answer when they were closed.
_LEFT_OPEN: list = []
# A keyed store's calls before attach() made the tags' array.
_NO_TAGS = "the keyed store has no page tags yet: attach() a host pool first"


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
    metrics server), on free ports (or those of `ports`: rpc, http, metrics,
    to start one again where a stopped one was); stopped by `stop()` or at
    the end of a `with` block."""

    def __init__(
        self,
        binary: Optional[str] = None,
        start_timeout_s: float = 20.0,
        ports: Optional[tuple] = None,
    ):
        binary = binary or master_binary()
        if binary is None:
            raise RuntimeError("mooncake_master not found: pip install 'radixkv[mooncake]'")
        self.rpc_port, self.http_port, self.metrics_port = (
            ports if ports is not None else (_free_port(), _free_port(), _free_port())
        )
        self._log = tempfile.NamedTemporaryFile(
            prefix="mooncake_master.", suffix=".log", delete=False
        )
        self.log_path = self._log.name
        self.proc = subprocess.Popen(
            [
                binary,
                f"--rpc_port={self.rpc_port}",
                "--rpc_address=127.0.0.1",
                "--enable_http_metadata_server=true",
                "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={self.http_port}",
                "--metrics_host=127.0.0.1",
                f"--metrics_port={self.metrics_port}",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + start_timeout_s
        while not (self._listening(self.rpc_port) and self._listening(self.http_port)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self._end_process()
                with open(self.log_path, errors="replace") as f:
                    tail = f.read()[-2000:]
                self.stop()
                raise RuntimeError(f"mooncake_master did not start:\n{tail}")
            time.sleep(0.05)

    @staticmethod
    def _listening(port: int) -> bool:
        with socket.socket() as s:
            s.settimeout(0.2)
            return s.connect_ex(("127.0.0.1", port)) == 0

    @property
    def ports(self) -> tuple:
        return self.rpc_port, self.http_port, self.metrics_port

    @property
    def master_address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def stop(self) -> None:
        """Stops the master and removes its log (`log_path`: read it before)."""
        self._end_process()
        self._log.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.log_path)

    def _end_process(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> "MooncakeMaster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


_PROBE = """
import os, sys
from mooncake.store import MooncakeDistributedStore
store = MooncakeDistributedStore()
rc = store.setup(sys.argv[1], sys.argv[2], 0, 0, sys.argv[3], "", sys.argv[4])
print(rc, flush=True)
os._exit(0)
"""


def probe_master(
    master_address: str, metadata_server: str, local_hostname: str, protocol: str, timeout_s: float
) -> None:
    """Checks, in a subprocess, that a client can set up against the master
    within `timeout_s`: Mooncake's own setup holds the GIL for as long as a
    hung master keeps it waiting, so it is only called once this passed.
    Raises RuntimeError naming the master otherwise."""
    cmd = [sys.executable, "-c", _PROBE, local_hostname, metadata_server, protocol, master_address]
    try:
        r = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(
            f"Mooncake master {master_address} (metadata {metadata_server}) did "
            f"not answer within {timeout_s:g} s"
        ) from None
    out = r.stdout.strip().splitlines()
    if not out or out[-1] != "0":
        raise RuntimeError(
            f"Mooncake Store setup failed against master {master_address} "
            f"(metadata {metadata_server}): "
            f"{out[-1] if out else r.stderr.strip()[-500:]}"
        )


class MooncakeStorage(StorageBackend):
    """Pages in Mooncake Store: the host pool is registered with the client
    once, and pages move with its batched zero-copy calls
    (`batch_put_from`, `batch_get_into`, `batch_is_exist`). Keys are the
    page keys (seeded by the configuration fingerprint, so configurations
    never share one) under `prefix`; a value whose size is not a page's is a
    miss. The client contributes `segment_bytes` of its memory to the store.
    `fingerprint` (optional) seeds the storage tier's keys when the
    CacheManager is given no `storage_seed`.

    With a `secret` (see StorageBackend) a value is the page followed by its
    authentication tag, moved from and into the host page and a registered
    array of tags in one call (`batch_put_from_multi_buffers`); a value whose
    tag does not check is a miss, counted and removed from the store.

    `codec` (None or "float8"): the host pool must hold its pages with the
    same codec (`host_codec=` of the CacheManager); they move as they are,
    zero-copy, under keys of their own.

    A master that does not answer: setting up checks the master first, in a
    subprocess given `setup_timeout_s` (RuntimeError after it, as for a
    refused setup); existence queries from the scheduler's thread are asked
    with a bound (`blocking_queries`); calls on the storage tier's thread end
    with Mooncake's own RPC timeouts, and the tier leaves a failing store
    alone meanwhile.
    """

    blocking_queries = True
    # Pages move zero-copy from the registered host pool: a codec needs a host
    # pool that holds them encoded (HostKVCache(codec=...)).
    encodes_pages = False
    # Reads and writes beside each other lost reads (the soak with a master
    # paused and restarted read nothing in a third of runs): they take turns,
    # across the process's clients.
    concurrent_calls = False

    def __init__(
        self,
        master_address: str,
        metadata_server: str,
        local_hostname: str = "127.0.0.1",
        protocol: str = "tcp",
        segment_bytes: int = 256 << 20,
        buffer_bytes: int = 64 << 20,
        prefix: str = "radixkv/",
        fingerprint: Optional[bytes] = None,
        *,
        secret: Optional[bytes] = None,
        setup_timeout_s: float = 10.0,
        codec: Optional[str] = None,
    ):
        super().__init__(secret, codec)
        if fingerprint is not None and (
            not isinstance(fingerprint, bytes) or len(fingerprint) != 32
        ):
            raise ValueError("fingerprint must be 32 bytes (radixkv.storage.config_fingerprint)")
        setup_timeout_s = as_seconds(setup_timeout_s, "setup_timeout_s")
        # Encoded pages are another configuration's (see FileStorage).
        self.fingerprint = None if fingerprint is None else codec_seed(fingerprint, self.codec)
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise RuntimeError(
                "Mooncake Store's client is not installed: " "pip install 'radixkv[mooncake]'"
            ) from e
        self.prefix = prefix
        self._closed = True
        self._where = (master_address, metadata_server, local_hostname, protocol)
        self._setup_timeout_s = setup_timeout_s
        probe_master(*self._where, setup_timeout_s)
        self.store = MooncakeDistributedStore()
        rc = self.store.setup(
            local_hostname,
            metadata_server,
            segment_bytes,
            buffer_bytes,
            protocol,
            "",
            master_address,
        )
        if rc != 0:
            raise RuntimeError(
                f"Mooncake Store setup failed (code {rc}): master "
                f"{master_address}, metadata {metadata_server}"
            )
        self._closed = False
        self._tags: Optional[torch.Tensor] = None

    def _attached(self) -> None:
        pool = self.pool
        if pool is None:  # (attach() sets it before it calls this)
            raise RuntimeError("_attached() runs from attach(), once the pool is set")
        self._register(pool.kv_buffer.data_ptr(), pool.nbytes, "host pool")
        if self.keyed:  # one tag per host page, moved with the page
            tags = torch.zeros((pool.num_pages, TAG_BYTES), dtype=torch.uint8)
            self._tags = tags
            self._register(tags.data_ptr(), tags.numel(), "page tags")

    def _register(self, address: int, size: int, what: str) -> None:
        rc = self.store.register_buffer(address, size)
        if rc != 0:
            raise RuntimeError(f"Mooncake Store could not register the {what} (code {rc})")

    def _keys(self, keys: Sequence[str]) -> List[str]:
        return [self.prefix + k for k in keys]

    def _parts(self, host_pages: Sequence[int]):
        """Each page's buffers and sizes: the page, then its tag."""
        page_tags = self._tags
        if page_tags is None:
            raise RuntimeError(_NO_TAGS)
        tags = page_tags.data_ptr()
        ptrs = [[self.page_address(p), tags + p * TAG_BYTES] for p in host_pages]
        return ptrs, [[self.page_bytes, TAG_BYTES]] * len(host_pages)

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
        size = self.page_bytes + (TAG_BYTES if self.keyed else 0)
        try:
            if self.keyed:
                got = self.store.batch_get_into_multi_buffers(
                    self._keys(keys), *self._parts(host_pages)
                )
            else:
                got = self.store.batch_get_into(
                    self._keys(keys), [self.page_address(p) for p in host_pages], [size] * len(keys)
                )
        except Exception:
            self.count_error(len(keys))
            return [False] * len(keys)
        ok = [g == size for g in got]
        if self.keyed:
            tags = self._tags
            if tags is None:
                raise RuntimeError(_NO_TAGS)
            forged = []
            for i, (key, page) in enumerate(zip(keys, host_pages)):
                if ok[i] and not hmac.compare_digest(
                    self.tag(key, self.page_view(page).numpy()), tags[page].numpy().tobytes()
                ):
                    ok[i] = False
                    forged.append(key)
            if forged:  # planted without the secret: counted and removed
                self.count_corrupt(len(forged))
                try:
                    self.store.batch_remove(self._keys(forged), True)
                except Exception:
                    self.count_error()
        bad = sum(1 for g in got if g != size and g > 0)
        if bad:
            self.count_corrupt(bad)
        errors = sum(1 for g in got if g < 0 and g != _NOT_FOUND)
        if errors:
            self.count_error(errors)
        return ok

    def batch_set(self, keys: Sequence[str], host_pages: Sequence[int]) -> List[bool]:
        if not keys:
            return []
        try:
            if self.keyed:
                tags = self._tags
                if tags is None:
                    raise RuntimeError(_NO_TAGS)
                for key, page in zip(keys, host_pages):
                    tags[page] = torch.frombuffer(
                        bytearray(self.tag(key, self.page_view(page).numpy())), dtype=torch.uint8
                    )
                rc = self.store.batch_put_from_multi_buffers(
                    self._keys(keys), *self._parts(host_pages)
                )
            else:
                rc = self.store.batch_put_from(
                    self._keys(keys),
                    [self.page_address(p) for p in host_pages],
                    [self.page_bytes] * len(keys),
                )
        except Exception:
            self.count_error(len(keys))
            return [False] * len(keys)
        ok = [r == 0 for r in rc]
        failed = ok.count(False)
        if failed:
            self.count_error(failed)
        return ok

    def close(self) -> None:
        """Unmounts from the master and closes the client. Mooncake's close
        holds the GIL while it waits for a master that does not answer
        (seconds, for the whole process), so the master is probed first: if
        it does not answer within the setup bound the client is left as it
        is (the master drops its segment when the client's lease runs out)."""
        if self._closed:
            return
        self._closed = True
        try:
            probe_master(*self._where, min(self._setup_timeout_s, 2.0))
        except RuntimeError as e:
            log.warning("radixkv: not closing the Mooncake client: %s", e)
            _LEFT_OPEN.append(self.store)  # never destroyed: its destructor would wait too
            return
        try:
            self.store.close()
        except Exception:
            pass
