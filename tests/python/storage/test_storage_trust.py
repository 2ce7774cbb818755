"""Who may read, plant or probe pages: file and directory modes, a store that
others can write to, pages of another user, a deployment secret that keys
page names and authenticates page bytes (file and Mooncake), and KV events
bound to loopback by default."""

import contextlib
import ipaddress
import json
import os
import socket
import stat
import subprocess
import sys
import urllib.parse
import urllib.request

import pytest
import torch

import radixkv
from radixkv.events import DEFAULT_ENDPOINT, EventPublisher, decode_batch
from radixkv.kvcache import MHAKVCache
from radixkv.scheduler import CacheManager
from radixkv.storage import FileStorage, MooncakeMaster, MooncakeStorage, page_keys
from radixkv.storage.file import HEADER, MAGIC, NO_PARENT, file_system_type
from storage_env import (
    KV,
    NOBODY,
    PAGE,
    Instance,
    fingerprint,
    host_pool,
    needs_mooncake,
    prompt,
)

SECRET = b"a deployment secret shared by the instances"


def mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def test_a_private_store_is_made_0700_with_pages_0600(tmp_path):
    old = os.umask(0o022)
    try:
        a = Instance(FileStorage(str(tmp_path / "store"), fingerprint()))
        ids = prompt(1, 2)
        a.serve(ids)
        backend = a.cm._tiers.storage.backend
        page = backend.path(a.cm._tiers.storage.keys_of(ids)[0])
        assert mode(tmp_path / "store") == 0o700
        assert mode(backend.directory) == 0o700
        assert mode(os.path.dirname(page)) == 0o700
        assert mode(page) == 0o600
        a.close()
        shared = Instance(FileStorage(str(tmp_path / "shared"), fingerprint(), shared=True))
        shared.serve(ids)
        backend = shared.cm._tiers.storage.backend
        page = backend.path(shared.cm._tiers.storage.keys_of(ids)[0])
        # The umask does not take the group's access away.
        assert mode(tmp_path / "shared") == mode(backend.directory) == 0o770
        assert mode(os.path.dirname(page)) == 0o770 and mode(page) == 0o640
        shared.close()
    finally:
        os.umask(old)


@pytest.mark.parametrize("bits", [0o777, 0o770, 0o1777])
def test_a_store_directory_others_can_write_to_is_refused_unless_shared(tmp_path, bits):
    d = tmp_path / "open"
    d.mkdir()
    os.chmod(d, bits)
    with pytest.raises(PermissionError, match="writable by others.*shared=True"):
        FileStorage(str(d), fingerprint())
    FileStorage(str(d), fingerprint(), shared=True)  # on purpose: accepted


@pytest.mark.parametrize("shared", [False, True])
def test_directories_made_above_the_store_get_its_mode_whatever_the_umask(tmp_path, shared):
    """Under umask 000 the missing parents of a store's directory are made
    with the store's own mode, never open to everyone."""
    old = os.umask(0)
    try:
        FileStorage(str(tmp_path / "made/by/radixkv/store"), fingerprint(), shared=shared)
    finally:
        os.umask(old)
    want = 0o770 if shared else 0o700
    for d in ("made", "made/by", "made/by/radixkv", "made/by/radixkv/store"):
        assert mode(tmp_path / d) == want, d


def test_the_cli_leaves_its_store_directory_to_the_store_whatever_the_umask(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "radixkv", "replay", "--limit", "2", "--storage", "file"]
        + ["--storage-dir", str(tmp_path / "made/store")],
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=lambda: os.umask(0),
    )
    assert r.returncode == 0, r.stderr
    assert mode(tmp_path / "made") == mode(tmp_path / "made/store") == 0o700


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another group needs root")
def test_a_setgid_shared_store_keeps_its_group_on_every_directory_and_page(tmp_path):
    d = tmp_path / "shared"
    d.mkdir()
    os.chown(d, -1, NOBODY)
    os.chmod(d, 0o2770)
    a = Instance(FileStorage(str(d), fingerprint(), shared=True))
    ids = prompt(3, 1)
    a.serve(ids)
    backend = a.cm._tiers.storage.backend
    page = backend.path(a.cm._tiers.storage.keys_of(ids)[0])
    for p in (backend.directory, os.path.dirname(page)):
        assert os.stat(p).st_gid == NOBODY and os.stat(p).st_mode & stat.S_ISGID, p
        assert mode(p) & 0o777 == 0o770
    assert os.stat(page).st_gid == NOBODY
    a.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_store_or_page_of_another_user_is_not_trusted(tmp_path):
    d = tmp_path / "theirs"
    d.mkdir(mode=0o755)
    os.chown(d, 65534, 65534)
    with pytest.raises(PermissionError, match="belongs to uid 65534"):
        FileStorage(str(d), fingerprint())
    # A page file another user planted in our store: a miss, counted, removed.
    a = Instance(FileStorage(str(tmp_path / "ours"), fingerprint()))
    ids = prompt(2, 3)
    a.serve(ids)
    b = Instance(FileStorage(str(tmp_path / "ours"), fingerprint()))
    path = b.cm._tiers.storage.backend.path(b.cm._tiers.storage.keys_of(ids)[1])
    os.chown(path, 65534, 65534)
    assert b.serve(ids)[2] == PAGE  # the page before it only
    assert b.cm.storage_counters.corrupt_pages == 1
    assert os.stat(path).st_uid == os.geteuid()  # replaced by b's own write
    # In a store shared on purpose, another user's page is read.
    c = Instance(FileStorage(str(tmp_path / "ours"), fingerprint(), shared=True))
    os.chown(path, 65534, 65534)
    assert c.serve(ids)[2] == 3 * PAGE
    a.close(), b.close(), c.close()


def _forge(path, key, fp, page_bytes):
    """A page file under `key` with a valid header and checksum (the file
    format without a secret) but K/V of the forger's choosing."""
    forged = bytes([0x5A]) * page_bytes
    raw = bytes.fromhex(key)
    header = HEADER.pack(MAGIC, raw, NO_PARENT, fp, page_bytes, radixkv._core.crc32c(forged))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(header + forged)


def test_without_a_secret_anyone_who_can_write_the_store_can_plant_pages(tmp_path):
    """What the secret is for: the unkeyed format trusts whoever writes."""
    a = Instance(FileStorage(str(tmp_path), fingerprint()))
    ids = prompt(3, 2)
    key = a.cm._tiers.storage.keys_of(ids)[0]
    assert key == page_keys(ids, PAGE, fingerprint())[0]  # computable from the prompt
    backend = a.cm._tiers.storage.backend
    _forge(backend.path(key), key, fingerprint(), backend.page_bytes)
    op = a.cm.prefetch(ids)
    assert a.cm.wait_prefetch(op) == PAGE  # the forged page joined the tree
    a.close()


def test_with_a_secret_a_planted_page_is_never_served_and_is_removed(tmp_path):
    a = Instance(FileStorage(str(tmp_path), fingerprint(), secret=SECRET))
    ids = prompt(4, 3)
    a.serve(ids)  # writes the 3 pages, keyed and tagged
    b = Instance(FileStorage(str(tmp_path), fingerprint(), secret=SECRET))
    names = b.cm._tiers.storage.keys_of(ids)
    assert names != page_keys(ids, PAGE, fingerprint())  # names nobody without it computes
    backend = b.cm._tiers.storage.backend
    # The forger knows a name (it can list the directory) and writes a page
    # with a valid checksum, in both formats.
    _forge(backend.path(names[1]), names[1], fingerprint(), backend.page_bytes)
    assert b.serve(ids)[2] == PAGE  # the page before it only: never the forged one
    assert b.cm.storage_counters.corrupt_pages == 1
    b.evict_everything()
    assert b.serve(ids)[2] == 3 * PAGE  # replaced by b's own write, which checks
    # A page copied from another name (a valid tag, the wrong key) is refused too.
    with open(backend.path(names[0]), "rb") as f:
        data = f.read()
    with open(backend.path(names[2]), "wb") as f:
        f.write(data)
    b.evict_everything()
    assert b.serve(ids)[2] == 2 * PAGE
    a.close(), b.close()


def test_without_the_secret_a_prompt_cannot_be_probed_for(tmp_path):
    a = Instance(FileStorage(str(tmp_path), fingerprint(), secret=SECRET))
    ids = prompt(5, 3)
    a.serve(ids)
    pool = host_pool()
    probe = FileStorage(str(tmp_path), fingerprint())  # the same store, no secret
    probe.attach(pool)
    assert probe.batch_exists(page_keys(ids, PAGE, fingerprint())) == 0
    other = FileStorage(str(tmp_path), fingerprint(), secret=b"another secret, another tenant")
    other.attach(pool)
    tier = a.cm._tiers.storage
    assert other.batch_exists(page_keys(ids, PAGE, fingerprint(), key=other.name_key)) == 0
    assert probe.batch_exists(tier.keys_of(ids)) == 0  # the header, not the name, says keyed
    a.close()


def test_a_secret_is_bytes_of_some_length(tmp_path):
    with pytest.raises(TypeError, match="secret"):
        FileStorage(str(tmp_path), fingerprint(), secret="text")
    with pytest.raises(ValueError, match="secret must be at least 16 bytes"):
        FileStorage(str(tmp_path), fingerprint(), secret=b"short")


def test_events_keep_the_unkeyed_chain_which_says_nothing_of_the_secret(tmp_path):
    zmq = pytest.importorskip("zmq")
    ctx = zmq.Context()

    def blocks(secret):
        name = f"inproc://trust-events-{secret is None}"
        pub = EventPublisher(name, context=ctx)
        sub = ctx.socket(zmq.SUB)
        sub.connect(name)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        pool = MHAKVCache(KV.num_kv_heads, KV.num_layers, KV.head_dim, 12, KV.dtype, page_size=PAGE)
        store = FileStorage(str(tmp_path / str(secret is None)), fingerprint(), secret=secret)
        cm = CacheManager(
            12,
            page_size=PAGE,
            host_num_pages=24,
            kv_cache=pool,
            storage=store,
            storage_seed=fingerprint(),
            kv_events=pub,
        )
        ids = prompt(6, 2)
        h, _ = cm.match_req(ids)
        cm.lock(h)
        cm.free_and_cache_finished_req(h, ids, cm.allocate(len(ids)))
        cm.drain()
        out = []
        while sub.poll(200):
            out += decode_batch(sub.recv_multipart()[2]).events
        cm.close()
        sub.close()
        pub.close()
        return [(e.medium, e.block_hashes) for e in out]

    try:
        plain, keyed = blocks(None), blocks(SECRET)
    finally:
        ctx.term()
    assert plain == keyed and {m for m, _ in plain} == {"GPU", "CPU_PINNED", "DISK"}


@needs_mooncake
def test_mooncake_with_a_secret_refuses_and_removes_a_planted_value():
    with MooncakeMaster() as m:

        def backend(secret=SECRET):
            return MooncakeStorage(
                m.master_address,
                m.metadata_server,
                listen_on_all_interfaces=True,
                segment_bytes=32 << 20,
                buffer_bytes=16 << 20,
                secret=secret,
            )

        a = Instance(backend())
        ids = prompt(7, 3)
        a.serve(ids)
        b = Instance(backend())
        assert b.serve(ids)[2] == 3 * PAGE  # keyed, tagged, read back whole
        store = b.cm._tiers.storage.backend
        name = b.cm._tiers.storage.keys_of(ids)[1]
        # Overwrite the value with page-sized bytes and a made-up tag.
        raw = torch.full((store.page_bytes + 32,), 0x5A, dtype=torch.uint8)
        store.store.remove(store.prefix + name, True)
        assert store.store.put(store.prefix + name, raw.numpy().tobytes()) == 0
        c = Instance(backend())
        assert c.serve(ids)[2] == PAGE
        assert c.cm.storage_counters.corrupt_pages == 1
        plain = Instance(backend(secret=None))  # no secret: finds none of the keyed pages
        assert plain.serve(ids)[2] == 0
        a.close(), b.close(), c.close(), plain.close()


def _other_address():
    """An address of this machine that is not loopback (None if it has none)."""
    try:
        out = subprocess.run(
            ["ip", "-4", "-o", "addr"], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        addr = line.split()[3].split("/")[0]
        if not addr.startswith("127."):
            return addr
    return None


def test_events_bind_loopback_by_default():
    pytest.importorskip("zmq")
    other = _other_address()
    if other is None:
        pytest.skip("this machine has no address but loopback to connect from")
    port = 5557
    with EventPublisher() as pub:
        assert pub.endpoint == DEFAULT_ENDPOINT == f"tcp://127.0.0.1:{port}"
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # reachable on loopback
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((other, port), timeout=5).close()
    with EventPublisher("tcp://127.0.0.1:*", bind=True) as pub:
        assert pub.endpoint.startswith("tcp://127.0.0.1:")
    with pytest.raises(TypeError, match="bind"):
        EventPublisher("tcp://127.0.0.1:*", bind="yes")
    with pytest.raises(ValueError, match="endpoint"):
        EventPublisher(bind=False)  # connect, but to where?


def test_the_file_system_type_is_read_from_the_mount_table(tmp_path):
    kind = file_system_type(str(tmp_path))
    assert kind  # /proc/self/mountinfo names it
    assert not FileStorage(str(tmp_path), fingerprint()).blocking_queries or kind.startswith(
        ("nfs", "fuse", "cifs", "9p")
    )
    assert FileStorage(str(tmp_path), fingerprint(), bounded_queries=True).blocking_queries


# A process without the secret that plants through Mooncake's transfer
# engine: it lists the master's segments, reads each one's descriptor from
# the metadata service (it names every buffer the client registered) and
# writes all of them with transfer_sync_write.
_PEER_WRITES_EVERYTHING = r"""
import ctypes, json, sys, urllib.parse, urllib.request
from mooncake.engine import TransferEngine
metrics, metadata = sys.argv[1], sys.argv[2]
names = urllib.request.urlopen(metrics + "/get_all_segments", timeout=10).read().decode().split()
engine = TransferEngine()
assert engine.initialize("127.0.0.1", metadata, "tcp", "") == 0
chunk = 1 << 20
forged = (ctypes.c_char * chunk)(*([0x3C] * chunk))
assert engine.register_memory(ctypes.addressof(forged), chunk) == 0
written = 0
for name in names:
    url = metadata + "?key=" + urllib.parse.quote("mooncake/ram/" + name, safe="")
    desc = json.loads(urllib.request.urlopen(url, timeout=10).read())
    for buf in desc["buffers"]:
        for at in range(0, buf["length"], chunk):
            n = min(chunk, buf["length"] - at)
            if engine.transfer_sync_write(name, ctypes.addressof(forged), buf["addr"] + at, n) == 0:
                written += n
print("written", written, flush=True)
"""


@needs_mooncake
def test_a_mooncake_peer_writing_every_registered_buffer_plants_nothing_with_a_secret():
    with MooncakeMaster() as m:

        def backend():
            return MooncakeStorage(
                m.master_address,
                m.metadata_server,
                listen_on_all_interfaces=True,
                segment_bytes=16 << 20,
                buffer_bytes=16 << 20,
                secret=SECRET,
            )

        victim = Instance(backend())
        prompts = [prompt(30 + i, 3) for i in range(3)]
        for ids in prompts:
            victim.serve(ids)  # on the device, backed up to host, written to the store
        r = subprocess.run(
            [
                sys.executable,
                "-c",
                _PEER_WRITES_EVERYTHING,
                f"http://127.0.0.1:{m.metrics_port}",
                m.metadata_server,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr[-2000:]
        assert int(r.stdout.split()[-1]) >= 32 << 20  # the attack did write
        # The device forgets: the pages come back from the host pool, which
        # no peer can reach; serve() checks every row it is handed.
        cm = victim.cm
        cm.drain()
        cm.make_room(cm.num_pages * PAGE)
        for ids in prompts:
            device, host, _ = victim.serve(ids)
            assert device == 0 and host == 3 * PAGE
        # A second instance reads them from the store: a forged value is a
        # miss, never served (serve() checks the rows again).
        reader = Instance(backend())
        for ids in prompts:
            reader.serve(ids)
        victim.close(), reader.close()


def _listening(pid):
    """The (address, port) of every TCP socket process `pid` listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table, width in (("tcp", 4), ("tcp6", 16)):
        with open(f"/proc/{pid}/net/{table}") as f:
            next(f)
            for line in f:
                cols = line.split()
                if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                    continue
                hexaddr, hexport = cols[1].split(":")
                raw = bytes.fromhex(hexaddr)
                # /proc prints each 32-bit word in host (little-endian) order.
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, width, 4))
                found.append((str(ipaddress.ip_address(raw)), int(hexport, 16)))
    return found


@needs_mooncake
def test_mooncake_binds_loopback_when_asked_or_refuses_naming_why():
    with MooncakeMaster() as m:
        for pid in m.pids:  # the master and its metadata service
            ports = _listening(pid)
            assert ports and all(addr == "127.0.0.1" for addr, _ in ports), ports
        # The transfer engine cannot bind one address: refused on loopback...
        with pytest.raises(ValueError, match="every interface.*listen_on_all_interfaces=True"):
            MooncakeStorage(m.master_address, m.metadata_server)
        with pytest.raises(ValueError, match="listen_on_all_interfaces"):
            MooncakeStorage(m.master_address, m.metadata_server, local_hostname="localhost:1234")
        # ... and, accepted, it advertises the address it was given.
        store = MooncakeStorage(
            m.master_address,
            m.metadata_server,
            listen_on_all_interfaces=True,
            segment_bytes=16 << 20,
            buffer_bytes=16 << 20,
        )
        try:
            name = store.store.get_hostname()
            url = m.metadata_server + "?key=" + urllib.parse.quote("mooncake/ram/" + name, safe="")
            desc = json.loads(urllib.request.urlopen(url, timeout=10).read())
            assert desc.get("tcp_data_host", "127.0.0.1") == "127.0.0.1", desc
        finally:
            store.close()
