"""Recoverable KV events: epochs, snapshots, the medium change of a device
eviction, and a subscriber that stays exact across lost batches and a
publisher killed and restarted mid-stream."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

pytest.importorskip("zmq")
pytest.importorskip("msgpack")

from radixkv.event_index import EventIndex, snapshot_view  # noqa: E402
from radixkv.events import (  # noqa: E402
    MEDIUM_CPU_PINNED,
    MEDIUM_GPU,
    BlockRemoved,
    BlockStored,
    EventPublisher,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from radixkv.scheduler import CacheManager  # noqa: E402

PAGE = 4
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/python: the helpers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(cm, ids):
    ids = torch.as_tensor(ids, dtype=torch.int32)
    h, idx = cm.match_req(ids)
    h, idx = cm.load_back(h)
    own = cm.allocate(len(ids) - h.cached_len)
    cm.free_and_cache_finished_req(h, ids, torch.cat([idx, own]))
    cm.drain()


def requests(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    systems = [
        torch.randint(0, 1000, (3 * PAGE,), generator=g, dtype=torch.int32) for _ in range(3)
    ]
    for i in range(n):
        own = torch.randint(0, 1000, ((1 + i % 3) * PAGE,), generator=g, dtype=torch.int32)
        yield torch.cat([systems[i % 3], own])


class Follower:
    """A plain subscriber keeping every batch it gets."""

    def __init__(self, endpoint):
        import zmq

        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        time.sleep(0.2)  # the slow joiner
        self.batches = []

    def drain(self):
        while self.sub.poll(100):
            _, seq, payload = self.sub.recv_multipart()
            self.batches.append((int.from_bytes(seq, "big"), decode_batch(payload)))

    def close(self):
        self.sub.close(linger=0)
        self.ctx.term()


def replayed(batches):
    """Blocks per medium after applying `batches` in order."""
    blocks = {}
    for _, batch in batches:
        for e in batch.events:
            if isinstance(e, BlockStored):
                blocks.setdefault(e.medium, set()).update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                blocks.get(e.medium, set()).difference_update(e.block_hashes)
            else:
                blocks.pop(MEDIUM_GPU, None)
    return {m: h for m, h in blocks.items() if h}


def test_a_snapshot_is_what_the_events_so_far_add_up_to():
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    pub = EventPublisher(endpoint, bind=True, epoch=77)
    follower = Follower(endpoint)
    cm = CacheManager(24, PAGE, host_num_pages=48, kv_events=pub)
    for ids in requests(40):
        serve(cm, ids)
    snap = cm.kv_snapshot()
    follower.drain()
    assert snap.epoch == 77 and snap.seq == pub.next_seq == len(follower.batches)
    assert [s for s, _ in follower.batches] == list(range(snap.seq))
    assert all(b.epoch == 77 for _, b in follower.batches)
    view = snapshot_view(snap.payload)
    assert view == replayed(follower.batches)
    assert view[MEDIUM_GPU] and view[MEDIUM_CPU_PINNED]
    # Parents before children, tier by tier.
    seen = {}
    for e in decode_batch(snap.payload).events:
        assert isinstance(e, BlockStored)
        if e.parent_block_hash is not None:
            assert e.parent_block_hash in seen.get(e.medium, set())
        seen.setdefault(e.medium, set()).update(e.block_hashes)
    cm.close(), pub.close(), follower.close()


def test_a_device_eviction_of_a_block_held_on_host_is_a_medium_change():
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    pub = EventPublisher(endpoint, bind=True)
    follower = Follower(endpoint)
    cm = CacheManager(8, PAGE, host_num_pages=32, kv_events=pub)
    serve(cm, list(range(100, 116)))  # 4 pages, backed up (write_through)
    follower.drain()
    cm.make_room(8 * PAGE)  # evicts them from the device
    cm.flush_events()
    follower.drain()
    events = follower.batches[-1][1].events
    removed, stored = events[0], events[1]
    assert isinstance(removed, BlockRemoved) and removed.medium == MEDIUM_GPU
    assert isinstance(stored, BlockStored) and stored.medium == MEDIUM_CPU_PINNED
    assert stored.block_hashes == removed.block_hashes and len(removed.block_hashes) == 4
    # A consumer that ignores media sees the blocks stay.
    anywhere = set()
    for e in events:
        if isinstance(e, BlockStored):
            anywhere |= set(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            anywhere -= set(e.block_hashes)
    assert set(removed.block_hashes) <= anywhere
    cm.close(), pub.close(), follower.close()


def test_batches_carry_the_epoch_and_vllms_three_fields_without_one():
    with_epoch = KVEventBatch(1.5, [BlockRemoved([1, 2])], 0, 5)
    assert decode_batch(encode_batch(with_epoch)) == with_epoch
    plain = KVEventBatch(1.5, [BlockRemoved([1, 2])], 0)
    import msgpack

    assert len(msgpack.unpackb(encode_batch(plain))) == 3
    assert len(msgpack.unpackb(encode_batch(with_epoch))) == 4
    assert EventPublisher(f"tcp://127.0.0.1:{free_port()}", bind=True, epoch=False).epoch is None
    a = EventPublisher(f"tcp://127.0.0.1:{free_port()}", bind=True)
    b = EventPublisher(f"tcp://127.0.0.1:{free_port()}", bind=True)
    assert a.epoch != b.epoch and 0 <= a.epoch < 2**63
    with pytest.raises(ValueError, match="epoch"):
        EventPublisher(f"tcp://127.0.0.1:{free_port()}", bind=True, epoch=-1)
    with pytest.raises(RuntimeError, match="kv_events"):
        CacheManager(8, PAGE).kv_snapshot()


def test_a_lost_batch_is_recovered_from_a_snapshot():
    endpoint, replay = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    pub = EventPublisher(endpoint, replay_endpoint=replay, bind=True)
    cm = CacheManager(24, PAGE, host_num_pages=48, kv_events=pub)
    follower = Follower(endpoint)
    index = EventIndex(endpoint, replay)
    stop = threading.Event()

    def engine():  # the scheduler's thread: serves, then keeps flushing
        for ids in requests(30):
            serve(cm, ids)
        while not stop.is_set():
            cm.flush_events()
            time.sleep(0.005)

    t = threading.Thread(target=engine)
    t.start()
    try:
        time.sleep(0.5)
        follower.drain()
        batches = follower.batches
        lost = len(batches) // 2
        for seq, batch in batches:  # batch `lost` never arrives
            if seq != lost:
                index.receive(seq, encode_batch(batch))
        assert index.gaps == 1 and index.resyncs >= 1
        assert index.view() == snapshot_view(cm.kv_snapshot().payload)
    finally:
        stop.set()
        t.join()
        index.close(), follower.close(), cm.close(), pub.close()


def start_engine(endpoint, replay, seed, limit=None, idle=False):
    args = [sys.executable, os.path.join(HERE, "event_engine.py"), endpoint, replay, str(seed)]
    if limit is not None:
        args.append(str(limit))
    if idle:
        args.append("idle")
    p = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    hello = json.loads(p.stdout.readline())
    return p, hello["epoch"]


def test_a_subscriber_recovers_exactly_when_the_publisher_is_killed_and_restarted():
    endpoint, replay = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    first, first_epoch = start_engine(endpoint, replay, seed=1)
    index = EventIndex(endpoint, replay)
    try:
        deadline = time.time() + 60
        while index.applied < 20 and time.time() < deadline:
            index.poll(100)
        assert index.epoch == first_epoch and index.applied >= 20
        os.kill(first.pid, signal.SIGKILL)  # mid-stream: no goodbye
        first.wait()
        second, second_epoch = start_engine(endpoint, replay, seed=2, limit=60)
        assert second_epoch != first_epoch
        t0 = time.time()
        while (
            time.time() - t0 < 1.0
        ):  # the subscriber reconnects (it hears of a restart from a batch)
            index.poll(100)
        second.stdin.write("go\n")
        second.stdin.flush()
        final = json.loads(second.stdout.readline())
        deadline = time.time() + 30
        while time.time() < deadline and not (
            index.epoch == second_epoch and index.next_seq == final["next_seq"]
        ):
            index.poll(100)
        assert index.restarts >= 1 and index.resyncs >= 1, (
            index.applied,
            index.epoch,
            index.next_seq,
            second_epoch,
            final["next_seq"],
            index.gaps,
        )
        assert index.epoch == second_epoch and index.next_seq == final["next_seq"]
        want = {m: set(h) for m, h in final["blocks"].items() if h}
        assert index.view() == want
        second.stdin.close()
        assert second.wait(timeout=30) == 0
    finally:
        for p in (first,):
            if p.poll() is None:
                p.kill()
        index.close()


def test_a_restarted_engine_that_goes_idle_is_seen_without_its_traffic():
    """An engine killed and started again sends one burst while the index is
    not polling (the burst never reaches it) and then flushes nothing, so no
    batch and no snapshot ever comes: the index sees the new publisher when
    it reconnects and builds its state from the batches the replay socket
    keeps."""
    endpoint, replay = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    first, _ = start_engine(endpoint, replay, seed=1)
    second = None
    index = EventIndex(endpoint, replay, resync_timeout_s=3)
    try:
        deadline = time.time() + 60
        while index.applied < 20 and time.time() < deadline:
            index.poll(100)
        assert index.applied >= 20
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        second, second_epoch = start_engine(endpoint, replay, seed=3, limit=25, idle=True)
        final = json.loads(second.stdout.readline())  # the burst is over
        want = {m: set(h) for m, h in final["blocks"].items() if h}
        deadline = time.time() + 15
        while time.time() < deadline and index.epoch != second_epoch:
            index.poll(100)
        index.poll(100)
        assert index.epoch == second_epoch and index.next_seq == final["next_seq"]
        assert index.view() == want and index.restarts == 1
        second.stdin.close()
        assert second.wait(timeout=30) == 0
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.kill()
        index.close()


def test_a_restart_seen_in_a_batch_is_rebuilt_from_the_kept_batches():
    """A batch of a new publisher whose engine then flushes nothing: its
    state comes from the batches its replay socket keeps (from its first),
    not from a snapshot, which would never come."""
    endpoint, replay = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    index = EventIndex(endpoint, replay, resync_timeout_s=2)
    first = EventPublisher(endpoint, replay_endpoint=replay, bind=True)
    follower = Follower(endpoint)
    cm = CacheManager(24, PAGE, host_num_pages=48, kv_events=first)
    for ids in requests(10):
        serve(cm, ids)
    follower.drain()
    for seq, batch in follower.batches:
        index.receive(seq, encode_batch(batch))
    assert index.epoch == first.epoch and index.view()
    cm.close(), first.close(), follower.close()
    second = EventPublisher(endpoint, replay_endpoint=replay, bind=True)
    follower = Follower(endpoint)
    cm = CacheManager(24, PAGE, host_num_pages=48, kv_events=second)
    for ids in requests(6, seed=5):
        serve(cm, ids)  # (drain() flushes; nothing flushes after)
    follower.drain()
    seq, batch = follower.batches[3]
    assert index.receive(seq, encode_batch(batch)) == 0  # covered by the rebuild
    assert index.restarts == 1 and index.resyncs == 1
    assert index.epoch == second.epoch and index.next_seq == second.next_seq
    assert index.view() == snapshot_view(cm.kv_snapshot().payload)
    index.close(), cm.close(), second.close(), follower.close()


def test_an_index_catches_up_with_a_publisher_without_an_epoch():
    endpoint, replay = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    pub = EventPublisher(endpoint, replay_endpoint=replay, bind=True, epoch=False)
    cm = CacheManager(24, PAGE, host_num_pages=48, kv_events=pub)
    index = EventIndex(endpoint, replay, resync_timeout_s=5)
    stop = threading.Event()

    def engine():
        for ids in requests(30):
            serve(cm, ids)
            time.sleep(0.01)
        while not stop.is_set():
            cm.flush_events()
            time.sleep(0.005)

    t = threading.Thread(target=engine)
    try:
        time.sleep(0.3)  # the index joins late: it syncs from a snapshot
        t.start()
        deadline = time.time() + 20
        while time.time() < deadline and index.next_seq != pub.next_seq:
            index.poll(100)
        assert index.epoch is None and index.next_seq == pub.next_seq
        assert index.resyncs <= 2  # batches the snapshot covers do not resync again
        assert index.view() == snapshot_view(cm.kv_snapshot().payload)
    finally:
        stop.set()
        if t.is_alive():
            t.join()
        index.close(), cm.close(), pub.close()


def test_index_arguments_name_themselves():
    with pytest.raises(ValueError, match="resync_timeout_s"):
        EventIndex("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", resync_timeout_s=-1)
    with pytest.raises(TypeError, match="resync_timeout_s"):
        EventIndex("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", resync_timeout_s="10")
    # A ZeroMQ poll takes int milliseconds: 2**31 ms and beyond are refused.
    with pytest.raises(ValueError, match="resync_timeout_s .* below 2.14748e\\+06 s"):
        EventIndex("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", resync_timeout_s=2**31 / 1000)
    with pytest.raises(TypeError, match="topic"):
        EventIndex("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", topic=b"x")
