"""Mooncake Store as the storage backend, and a local master for tests and replays.

Needs `pip install 'radixkv[mooncake]'` (the `mooncake-transfer-engine-non-cuda`
wheel on CPU machines); `mooncake_master` needs Debian's libibverbs1,
librdmacm1 and libnuma1 (`.ci/setup --test` installs them).
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
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
from radixkv.storage.base import MAX_BATCH, TAG_BYTES, StorageBackend

log = logging.getLogger("radixkv")

# What batch_get_into answers for a key the store does not have: a miss, not an error.
_NOT_FOUND = -704
# Clients whose master did not answer when they were closed.
_LEFT_OPEN: list = []
# A keyed store's calls before attach() made its staging area.
_NO_STAGING = "the keyed store has no staging pages yet: attach() a host pool first"


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
    """A `mooncake_master` on 127.0.0.1 with an HTTP metadata service (and its
    metrics server), on free ports (or those of `ports`: rpc, http, metrics,
    to start one again where a stopped one was); stopped by `stop()` or at
    the end of a `with` block. Every port it opens is bound to 127.0.0.1:
    the metadata service is `radixkv.storage.mooncake_metadata`, as the
    master's own binds every interface whatever it is told."""

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
        self.metadata_proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "radixkv.storage.mooncake_metadata",
                "--host=127.0.0.1",
                f"--port={self.http_port}",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        self.proc = subprocess.Popen(
            [
                binary,
                f"--rpc_port={self.rpc_port}",
                "--rpc_address=127.0.0.1",
                "--metrics_host=127.0.0.1",
                f"--metrics_port={self.metrics_port}",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + start_timeout_s
        while not (self._listening(self.rpc_port) and self._listening(self.http_port)):
            dead = self.proc.poll() is not None or self.metadata_proc.poll() is not None
            if dead or time.monotonic() > deadline:
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

    @property
    def pids(self) -> tuple:
        """The master's and the metadata service's process ids."""
        return self.proc.pid, self.metadata_proc.pid

    def stop(self) -> None:
        """Stops the master and removes its log (`log_path`: read it before)."""
        self._end_process()
        self._log.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.log_path)

    def _end_process(self) -> None:
        for proc in (self.proc, self.metadata_proc):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

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

# Where Mooncake's transfer engine reads the address it advertises to its
# peers (its first network interface's otherwise). It listens on every
# interface whatever this says.
_ADVERTISED = "MC_TCP_BIND_ADDRESS"


def _host_part(hostname: str) -> str:
    """`hostname` without a port (`host`, `host:port`, `[v6]:port`)."""
    if hostname.startswith("["):
        return hostname[1 : hostname.find("]")] if "]" in hostname else hostname[1:]
    if hostname.count(":") == 1:
        return hostname.split(":")[0]
    return hostname


def is_loopback(hostname: str) -> bool:
    """Whether `hostname` (an address or name, with or without a port) names
    this machine's loopback interface only."""
    host = _host_part(hostname)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _advertising(local_hostname: str) -> dict:
    """The environment Mooncake's client is set up in: it advertises
    `local_hostname` to its peers (unless the user chose an address)."""
    env = dict(os.environ)
    env.setdefault(_ADVERTISED, _host_part(local_hostname))
    return env


@contextlib.contextmanager
def _advertised(local_hostname: str):
    """Sets Mooncake's advertised address for a setup in this process, then
    puts the environment back."""
    if _ADVERTISED in os.environ:
        yield
        return
    os.environ[_ADVERTISED] = _host_part(local_hostname)
    try:
        yield
    finally:
        os.environ.pop(_ADVERTISED, None)


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
            cmd,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
            env=_advertising(local_hostname),
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


_WILDCARD = (
    "Mooncake's transfer engine listens on every interface whatever local_hostname says "
    "(its RPC and TCP data ports bind 0.0.0.0 and [::]; no Mooncake setting binds them to "
    "one address, MC_TCP_BIND_ADDRESS only sets the address it advertises), and any peer "
    "that reaches them can read and write the memory registered with it. "
    "local_hostname={!r} asks for loopback only: pass listen_on_all_interfaces=True to "
    "accept the open ports (and keep other networks off them with a firewall)"
)


class MooncakeStorage(StorageBackend):
    """Pages in Mooncake Store, moved with its batched zero-copy calls
    (`batch_put_from`, `batch_get_into`, `batch_is_exist`) to and from memory
    registered with its transfer engine. Keys are the page keys (seeded by
    the configuration fingerprint, so configurations never share one) under
    `prefix`; a value whose size is not a page's is a miss. The client
    contributes `segment_bytes` of its memory to the store. `fingerprint`
    (optional) seeds the storage tier's keys when the CacheManager is given
    no `storage_seed`.

    Registered memory can be read and written by any peer of the transfer
    engine (any process that reaches its ports, secret or not). Without a
    secret the host pool itself is registered and pages move zero-copy: the
    store's peers are trusted with every host page. With a `secret` (see
    StorageBackend) only a staging area of `staging_bytes` is registered: a
    value is the page followed by its authentication tag, and a page read
    is copied out of the staging area into the host pool, which no peer can
    reach, before its tag is checked there; a value whose tag does not check
    is a miss, counted and removed from the store. A write's tag is made
    from the host page, so bytes a peer changes in staging are a miss too.

    The transfer engine listens on every interface (see `_WILDCARD`): a
    loopback `local_hostname` is refused unless `listen_on_all_interfaces`
    accepts that. The client advertises `local_hostname` to its peers
    (Mooncake's `MC_TCP_BIND_ADDRESS`, unless set already).

    `codec` (None or "float8"): the host pool must hold its pages with the
    same codec (`host_codec=` of the CacheManager); they move as they are,
    under keys of their own.

    A master that does not answer: setting up checks the master first, in a
    subprocess given `setup_timeout_s` (RuntimeError after it, as for a
    refused setup); existence queries from the scheduler's thread are asked
    with a bound (`blocking_queries`); calls on the storage tier's thread end
    with Mooncake's own RPC timeouts, and the tier leaves a failing store
    alone meanwhile.
    """

    blocking_queries = True
    # Pages move as the host pool holds them: a codec needs a host pool that
    # holds them encoded (HostKVCache(codec=...)).
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
        staging_bytes: int = 16 << 20,
        listen_on_all_interfaces: bool = False,
    ):
        super().__init__(secret, codec)
        if fingerprint is not None and (
            not isinstance(fingerprint, bytes) or len(fingerprint) != 32
        ):
            raise ValueError("fingerprint must be 32 bytes (radixkv.storage.config_fingerprint)")
        setup_timeout_s = as_seconds(setup_timeout_s, "setup_timeout_s")
        if isinstance(staging_bytes, bool) or not isinstance(staging_bytes, int):
            raise TypeError(f"staging_bytes must be an int, got {type(staging_bytes).__name__}")
        if staging_bytes <= 0:
            raise ValueError(f"staging_bytes must be positive, got {staging_bytes}")
        if not isinstance(local_hostname, str) or not local_hostname:
            raise ValueError(
                f"local_hostname must be a host name or address, got {local_hostname!r}"
            )
        if is_loopback(local_hostname) and not listen_on_all_interfaces:
            raise ValueError(_WILDCARD.format(local_hostname))
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
        self._staging_bytes = staging_bytes
        self._slots: Optional[torch.Tensor] = None
        probe_master(*self._where, setup_timeout_s)
        self.store = MooncakeDistributedStore()
        with _advertised(local_hostname):
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

    def _attached(self) -> None:
        pool = self.pool
        if pool is None:  # (attach() sets it before it calls this)
            raise RuntimeError("_attached() runs from attach(), once the pool is set")
        if not self.keyed:  # the store's peers are trusted: zero-copy
            self._register(pool.kv_buffer.data_ptr(), pool.nbytes, "host pool")
            return
        # Only the staging area is registered: a slot a page and its tag.
        slot = self.page_bytes + TAG_BYTES
        n = max(1, min(MAX_BATCH, pool.num_pages, self._staging_bytes // slot))
        slots = torch.zeros((n, slot), dtype=torch.uint8)
        self._register(slots.data_ptr(), slots.numel(), "staging pages")
        self._slots = slots

    def _register(self, address: int, size: int, what: str) -> None:
        rc = self.store.register_buffer(address, size)
        if rc != 0:
            raise RuntimeError(f"Mooncake Store could not register the {what} (code {rc})")

    def _keys(self, keys: Sequence[str]) -> List[str]:
        return [self.prefix + k for k in keys]

    def _staging_slots(self) -> torch.Tensor:
        slots = self._slots
        if slots is None:
            raise RuntimeError(_NO_STAGING)
        return slots

    @staticmethod
    def _chunks(keys: Sequence[str], host_pages: Sequence[int], n: int):
        for start in range(0, len(keys), n):
            yield keys[start : start + n], host_pages[start : start + n]

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
        if not self.keyed:
            size = self.page_bytes
            try:
                got = self.store.batch_get_into(
                    self._keys(keys), [self.page_address(p) for p in host_pages], [size] * len(keys)
                )
            except Exception:
                self.count_error(len(keys))
                return [False] * len(keys)
            self._count_got(got, size)
            return [g == size for g in got]
        ok: List[bool] = []
        for part in self._chunks(keys, host_pages, len(self._staging_slots())):
            ok += self._get_staged(*part)
        return ok

    def _get_staged(self, keys: Sequence[str], host_pages: Sequence[int]) -> List[bool]:
        """Reads the values of `keys` into the staging slots, then each one's
        page into its host page and checks its tag there (out of the peers'
        reach)."""
        slots = self._staging_slots()
        size = slots.shape[1]
        try:
            got = self.store.batch_get_into(
                self._keys(keys),
                [slots.data_ptr() + i * size for i in range(len(keys))],
                [size] * len(keys),
            )
        except Exception:
            self.count_error(len(keys))
            return [False] * len(keys)
        self._count_got(got, size)
        ok = [g == size for g in got]
        forged = []
        for i, (key, page) in enumerate(zip(keys, host_pages)):
            if not ok[i]:
                continue
            target = self.page_view(page)
            target.copy_(slots[i, : self.page_bytes])
            tag = slots[i, self.page_bytes :].numpy().tobytes()
            if not hmac.compare_digest(self.tag(key, target.numpy()), tag):
                ok[i] = False
                forged.append(key)
        if forged:  # written without the secret: counted and removed
            self.count_corrupt(len(forged))
            try:
                self.store.batch_remove(self._keys(forged), True)
            except Exception:
                self.count_error()
        return ok

    def _count_got(self, got: Sequence[int], size: int) -> None:
        bad = sum(1 for g in got if g != size and g > 0)
        if bad:
            self.count_corrupt(bad)
        errors = sum(1 for g in got if g < 0 and g != _NOT_FOUND)
        if errors:
            self.count_error(errors)

    def batch_set(self, keys: Sequence[str], host_pages: Sequence[int]) -> List[bool]:
        if not keys:
            return []
        if not self.keyed:
            try:
                rc = self.store.batch_put_from(
                    self._keys(keys),
                    [self.page_address(p) for p in host_pages],
                    [self.page_bytes] * len(keys),
                )
            except Exception:
                self.count_error(len(keys))
                return [False] * len(keys)
            return self._put_flags(rc)
        ok: List[bool] = []
        for part in self._chunks(keys, host_pages, len(self._staging_slots())):
            ok += self._set_staged(*part)
        return ok

    def _set_staged(self, keys: Sequence[str], host_pages: Sequence[int]) -> List[bool]:
        """Copies each host page and its tag (made from the host page, so a
        peer's change to the staged bytes makes a value that fails) into a
        staging slot, then writes the slots."""
        slots = self._staging_slots()
        size = slots.shape[1]
        try:
            for i, (key, page) in enumerate(zip(keys, host_pages)):
                source = self.page_view(page)
                tag = self.tag(key, source.numpy())
                slots[i, : self.page_bytes].copy_(source)
                slots[i, self.page_bytes :] = torch.frombuffer(bytearray(tag), dtype=torch.uint8)
            rc = self.store.batch_put_from(
                self._keys(keys),
                [slots.data_ptr() + i * size for i in range(len(keys))],
                [size] * len(keys),
            )
        except Exception:
            self.count_error(len(keys))
            return [False] * len(keys)
        return self._put_flags(rc)

    def _put_flags(self, rc: Sequence[int]) -> List[bool]:
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
