"""KV events: a real ZeroMQ subscriber reads what a CacheManager publishes and
checks the framing, the encoding (against msgspec structs shaped as vLLM's),
and that replaying the events gives exactly the blocks each tier holds."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time

import msgpack
import msgspec
import pytest
import torch
import zmq

from radixkv import _core
from radixkv.events import (
    ALL_BLOCKS_CLEARED,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventPublisher,
    KVEventBatch,
    block_hash,
    decode_batch,
    encode_batch,
)
from radixkv.kvcache import MHAKVCache
from radixkv.scheduler import CacheManager
from radixkv.storage import FileStorage, config_fingerprint, page_keys

TOPIC = "kv@test"


# vLLM's event structs as its array_like msgspec encoder and decoder see them.
class _Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class VStored(_Event, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class VRemoved(_Event, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class VCleared(_Event, tag="AllBlocksCleared"):
    pass


class VBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[VStored | VRemoved | VCleared]
    data_parallel_rank: int | None = None


class Subscriber:
    """A SUB socket on the publisher, past ZeroMQ's slow-joiner window."""

    def __init__(self, publisher: EventPublisher, topic: str = TOPIC):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sock.connect(publisher.endpoint)
        self.publisher = publisher
        self.last_seq = -1
        # Empty batches until one arrives: from then on nothing is lost.
        deadline = time.monotonic() + 20
        while True:
            publisher.publish([])
            if self.sock.poll(50):
                break
            if time.monotonic() > deadline:
                raise TimeoutError("the subscription never reached the publisher")
        self.frames = []
        self.receive()
        self.frames = []  # what the tests publish comes after
        self.start_seq = self.publisher.next_seq

    def receive(self, timeout_s: float = 20.0):
        """The batches published since the last call: (topic, seq, payload)s."""
        last = self.publisher.next_seq - 1
        got = []
        deadline = time.monotonic() + timeout_s
        while self.last_seq < last:
            if not self.sock.poll(100):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"batches up to {last} never arrived")
                continue
            frames = self.sock.recv_multipart()
            assert len(frames) == 3, frames
            got.append(tuple(frames))
            self.last_seq = int.from_bytes(frames[1], "big")
        self.frames += got
        return got

    def close(self):
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def publisher():
    pub = EventPublisher(
        "tcp://127.0.0.1:*", topic=TOPIC, data_parallel_rank=3, replay_endpoint="tcp://127.0.0.1:*"
    )
    yield pub
    pub.close()


@pytest.fixture
def subscriber(publisher):
    sub = Subscriber(publisher)
    yield sub
    sub.close()


def decode_frames(frames, first_seq):
    """Checks the framing and decodes each payload both ways (ours and
    msgspec's as vLLM's structs); returns the batches."""
    batches = []
    for i, (topic, seq, payload) in enumerate(frames):
        assert topic == TOPIC.encode()
        assert len(seq) == 8 and int.from_bytes(seq, "big") == first_seq + i
        ours = decode_batch(payload)
        theirs = msgspec.msgpack.decode(payload, type=VBatch)
        assert theirs.data_parallel_rank == ours.data_parallel_rank == 3
        assert theirs.ts == ours.ts and abs(ours.ts - time.time()) < 600
        assert len(theirs.events) == len(ours.events)
        for a, b in zip(ours.events, theirs.events):
            assert type(a).__name__ == type(b).__struct_config__.tag
            if isinstance(a, BlockStored):
                assert (
                    a.block_hashes,
                    a.parent_block_hash,
                    a.token_ids,
                    a.block_size,
                    a.lora_id,
                    a.medium,
                ) == (
                    b.block_hashes,
                    b.parent_block_hash,
                    b.token_ids,
                    b.block_size,
                    b.lora_id,
                    b.medium,
                )
            elif isinstance(a, BlockRemoved):
                assert (a.block_hashes, a.medium) == (b.block_hashes, b.medium)
        batches.append(ours)
    return batches


class Model:
    """What a router learns from the events: the blocks on each medium."""

    def __init__(self):
        self.media = {"GPU": set(), "CPU_PINNED": set(), "DISK": set()}
        self.tokens = {}  # block hash -> its tokens, as announced

    # The blocks the event before removed from GPU: a BlockStored on
    # CPU_PINNED of blocks there already, right after, is a medium change.
    moved: frozenset = frozenset()

    def apply(self, event, page_size):
        moved = self.moved
        if not (
            isinstance(event, BlockStored)
            and event.medium == "CPU_PINNED"
            and set(event.block_hashes) <= moved
        ):
            self.moved = frozenset()  # a medium change's chains follow its removal at once
        if isinstance(event, BlockStored):
            blocks = self.media[event.medium]
            assert event.block_size == page_size and event.lora_id is None
            assert len(event.token_ids) == page_size * len(event.block_hashes)
            assert len(set(event.block_hashes)) == len(event.block_hashes)
            if event.medium != "DISK":
                # Both tiers are root-closed: a page's parent is on its tier.
                assert event.parent_block_hash is None or event.parent_block_hash in blocks
            parent = event.parent_block_hash
            if event.medium == "CPU_PINNED" and set(event.block_hashes) <= moved:
                # The device evicted them; the host still holds them.
                assert set(event.block_hashes) <= blocks, "a medium change to where they are not"
                return
            for i, h in enumerate(event.block_hashes):
                assert h not in blocks, f"{h} stored twice on {event.medium}"
                assert 0 <= h < 2**64
                blocks.add(h)
                tokens = event.token_ids[i * page_size : (i + 1) * page_size]
                assert self.tokens.setdefault(h, (parent, tokens)) == (parent, tokens)
                parent = h
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                assert h in self.media[event.medium], f"{h} removed from {event.medium} unseen"
                self.media[event.medium].remove(h)
            if event.medium == "GPU":
                self.moved = frozenset(event.block_hashes) & self.media["CPU_PINNED"]
        else:
            assert isinstance(event, AllBlocksCleared)
            self.media["GPU"].clear()


def tier_blocks(cm: CacheManager, seed):
    """The blocks each tier holds, from the tree itself: (device, host)."""
    ps = cm.page_size
    paths, device, host = [], set(), set()
    for parent, tokens, dslots, hslots, _, _ in cm._tree.dump(True):
        path = (paths[parent] if parent >= 0 else []) + list(tokens)
        paths.append(path)
        first = (len(path) - len(tokens)) // ps
        hashes = [block_hash(k) for k in page_keys(torch.tensor(path), ps, seed)][first:]
        if len(dslots):
            device.update(hashes)
        if len(hslots):
            host.update(hashes)
    return device, host


def disk_blocks(store: FileStorage):
    found = set()
    for sub in os.scandir(store.directory):
        for entry in os.scandir(sub.path):
            if entry.name.endswith(".page"):
                found.add(block_hash(entry.name[: -len(".page")]))
    return found


def test_a_request_is_one_block_stored_encoded_as_vllm_does(publisher, subscriber):
    ps = 4
    cm = CacheManager(num_pages=16, page_size=ps, kv_events=publisher)
    assert cm.kv_events is publisher
    assert cm._tiers.events.ledger.threaded  # hashed and packed off the scheduler's thread
    ids = torch.arange(100, 114)  # 3 whole pages and 2 tokens
    h, cached = cm.match_req(ids)
    cm.lock(h)
    cm.free_and_cache_finished_req(h, ids, cm.allocate(len(ids)))
    assert cm.flush_events() == 1
    assert cm.flush_events() == 0  # nothing new: no batch
    frames = subscriber.receive()
    assert len(frames) == 1
    (batch,) = decode_frames(frames, subscriber.start_seq)
    (event,) = batch.events
    keys = _core.page_keys(ids[:12].to(torch.int32), ps, None)
    assert event == BlockStored(
        [block_hash(k) for k in keys], None, list(range(100, 112)), ps, None, "GPU"
    )
    assert [block_hash(k) for k in keys] == [int(k, 16) & (2**64 - 1) for k in keys]
    # Byte for byte what msgspec writes for vLLM's structs.
    payload = frames[0][2]
    again = msgspec.msgpack.encode(VBatch(batch.ts, [VStored(*event)], 3))
    # ... with the publisher's epoch after vLLM's three fields (which
    # msgspec's decoder of vLLM's struct ignores: decode_frames reads it so).
    assert batch.epoch == publisher.epoch is not None
    assert payload == b"\x94" + again[1:] + msgpack.packb(publisher.epoch)
    assert encode_batch(batch) == payload
    assert encode_batch(batch._replace(epoch=None)) == again

    # A request sharing two pages adds only its own, chained to the shared ones.
    ids2 = torch.cat([ids[:8], torch.arange(500, 509)])
    h, cached = cm.match_req(ids2)
    assert h.cached_len == 8
    cm.lock(h)
    cm.free_and_cache_finished_req(h, ids2, torch.cat([cached, cm.allocate(len(ids2) - 8)]))
    cm.make_room(16 * ps)  # evicts every page: the two leaves, then the shared part
    cm.writing_check()  # a per-round call publishes too
    (batch,) = decode_frames(subscriber.receive(), subscriber.start_seq + 1)
    keys2 = [block_hash(k) for k in _core.page_keys(ids2[:16].to(torch.int32), ps, None)]
    stored, removed = batch.events
    assert stored == BlockStored(keys2[2:], keys2[1], list(range(500, 508)), ps, None, "GPU")
    assert removed.medium == "GPU"
    assert sorted(removed.block_hashes) == sorted(set(keys2) | {block_hash(k) for k in keys})
    assert len(removed.block_hashes) == 5
    # Leaves go before the pages they hang from.
    assert removed.block_hashes.index(keys2[0]) > removed.block_hashes.index(keys2[3])


def check_tiers(cm, model, subscriber, store, seed):
    """Replays every batch published so far into `model` and compares it
    with what the tree and the store hold."""
    first = subscriber.start_seq + len(subscriber.frames)
    for batch in decode_frames(subscriber.receive(), first):
        for event in batch.events:
            model.apply(event, cm.page_size)
    device, host = tier_blocks(cm, seed)
    assert model.media["GPU"] == device
    assert model.media["CPU_PINNED"] == host
    if store is not None:
        assert model.media["DISK"] == disk_blocks(store)
    assert len(device) * cm.page_size == cm.manager.size_info.total_size
    if cm.host_size_info is not None:
        assert len(host) * cm.page_size == cm.host_size_info.cached


def serve(cm, ids, rng):
    """One request: prefetch, match, load back, compute (chunked or not), cache."""
    ps = cm.page_size
    cm.wait_prefetch(cm.prefetch(ids))
    h, _ = cm.match_req(ids)
    h, cached = cm.load_back(h)
    indices = torch.cat([cached, cm.allocate(len(ids) - h.cached_len)])
    chunk = (len(ids) // 2) // ps * ps
    if chunk > h.cached_len and rng.random() < 0.4:  # chunked prefill: cache the first part
        h, head = cm.cache_unfinished_req(h, ids[:chunk], indices[:chunk])
        indices = torch.cat([head, indices[chunk:]])
    cm.free_and_cache_finished_req(h, ids, indices)
    cm.writing_check()
    assert cm.loading_check() == []
    cm.storage_check()


def cache_new(cm, ids):
    """A request over `ids` (none of them cached) computed and cached."""
    h, _ = cm.match_req(ids)
    cm.lock(h)
    cm.free_and_cache_finished_req(h, ids, cm.allocate(len(ids)))


@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
def test_replayed_events_are_exactly_the_blocks_of_each_tier(
    tmp_path, publisher, subscriber, write_policy
):
    ps = 4
    seed = config_fingerprint(
        model="events",
        dtype=torch.float32,
        page_size=ps,
        layout="page_first",
        num_layers=1,
        kv_heads=1,
        head_dim=8,
    )
    pool = MHAKVCache(
        num_kv_heads=1, num_layers=1, head_dim=8, num_pages=12, dtype=torch.float32, page_size=ps
    )
    store = FileStorage(str(tmp_path), seed)
    cm = CacheManager(
        num_pages=12,
        page_size=ps,
        kv_cache=pool,
        host_num_pages=20,
        write_policy=write_policy,
        storage=store,
        storage_seed=seed,
        prefetch_policy="wait_complete",
        kv_events=publisher,
    )
    rng = random.Random(7)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(8, 24))] for _ in range(4)]
    model = Model()

    def workload(steps):
        for step in range(steps):
            base = rng.choice(prefixes)
            ids = base[: rng.randrange(4, len(base) + 1)]
            ids = ids + [rng.randrange(1000, 2000) for _ in range(rng.randrange(1, 14))]
            serve(cm, torch.tensor(ids), rng)
            if step % 8 == 7:
                cm.drain()
                check_tiers(cm, model, subscriber, store, seed)
                cm.check_integrity()
        cm.drain()
        check_tiers(cm, model, subscriber, store, seed)

    workload(48)
    # Every path was taken: device and host evictions, loads, reads from storage.
    metrics = cm.metrics
    assert metrics.evicted_tokens and metrics.host_evicted_tokens
    assert metrics.loaded_back_tokens and metrics.storage_prefetched_tokens
    assert metrics.storage_written_pages
    assert model.media["GPU"] and model.media["CPU_PINNED"]
    on_disk = set(model.media["DISK"])

    # A reset empties both tiers; the store keeps its pages.
    cm.reset()
    cm.check_integrity()
    assert cm._tree.num_nodes == 0 and cm.free_pages == 12
    check_tiers(cm, model, subscriber, store, seed)
    assert not model.media["GPU"] and not model.media["CPU_PINNED"]
    assert model.media["DISK"] == on_disk
    last = decode_batch(subscriber.frames[-1][2]).events
    assert [type(e) for e in last] == [BlockRemoved, AllBlocksCleared]
    assert last[0].medium == "CPU_PINNED"

    # After it the manager serves (and announces) as before; pages written
    # again are not announced on DISK twice (Model.apply checks).
    workload(16)
    assert model.media["GPU"]
    cm.close()
    check_tiers(cm, model, subscriber, store, seed)


@pytest.mark.parametrize(
    "ps, policy", [(2, "write_through"), (1, "write_back"), (3, "write_through_selective")]
)
def test_failed_copies_announce_nothing(publisher, subscriber, ps, policy):
    """Backups and loads that fail (the test decides which) change no tier,
    so they announce nothing; the events still match the tree."""
    cm = CacheManager(
        num_pages=30 // ps,
        page_size=ps,
        host_num_pages=36 // ps,
        manual_copies=True,
        write_policy=policy,
        kv_events=publisher,
    )
    rng = random.Random(11)
    prefixes = [[rng.randrange(100) for _ in range(rng.randrange(4, 12))] for _ in range(3)]
    model = Model()
    aborted = 0
    for step in range(150):
        base = rng.choice(prefixes)
        ids = base[: rng.randrange(2, len(base) + 1)]
        ids = torch.tensor(ids + [rng.randrange(100, 200) for _ in range(rng.randrange(1, 6))])
        h, _ = cm.match_req(ids)
        h, cached = cm.load_back(h)
        own = cm.allocate(len(ids) - h.cached_len)
        for op in cm.controller.waiting():  # this round's backups and load
            cm.controller.complete(op, rng.random() < 0.6)
        cm.writing_check()
        failed = cm.loading_check()
        if failed:  # the load failed: the request gives up its lock and pages
            assert failed == [h]
            cm.unlock(h)
            cm.free(own)
            aborted += 1
        else:
            cm.free_and_cache_finished_req(h, ids, torch.cat([cached, own]))
        if step % 10 == 9:
            for op in cm.controller.waiting():
                cm.controller.complete(op, rng.random() < 0.6)
            cm.writing_check()
            check_tiers(cm, model, subscriber, None, None)
            cm.check_integrity()
    counters = cm.tier_counters
    assert aborted and counters.failed_copies and counters.backed_up and counters.loaded_back
    assert cm.metrics.evicted_tokens


def test_replay_socket_sends_kept_batches_again(publisher, subscriber):
    cm = CacheManager(num_pages=8, page_size=2, kv_events=publisher)
    for base in (0, 100, 200):
        ids = torch.arange(base, base + 5)
        h, _ = cm.match_req(ids)
        cm.lock(h)
        cm.free_and_cache_finished_req(h, ids, cm.allocate(5))
        cm.flush_events()
    sent = subscriber.receive()
    assert len(sent) == 3
    ctx = zmq.Context()
    client = ctx.socket(zmq.DEALER)
    client.connect(publisher.replay_endpoint)
    try:
        start = subscriber.start_seq + 1
        client.send_multipart([b"", start.to_bytes(8, "big")])
        replayed = []
        while True:
            assert client.poll(20_000), "no answer from the replay socket"
            frames = client.recv_multipart()
            assert frames[0] == b"" and len(frames) == 4
            if frames[2] == (-1).to_bytes(8, "big", signed=True):
                assert frames[1:] == [b"", EventPublisher.END_SEQ, b""]
                break
            replayed.append(tuple(frames[1:]))
        assert replayed == sent[1:]  # the same frames, from the sequence number asked for
    finally:
        client.close(linger=0)
        ctx.term()


def test_reset_refuses_while_a_request_holds_a_lock(publisher, subscriber):
    cm = CacheManager(num_pages=8, page_size=2, kv_events=publisher, host_num_pages=8)
    ids = torch.arange(7)
    h, _ = cm.match_req(ids)
    cm.lock(h)
    cm.free_and_cache_finished_req(h, ids, cm.allocate(7))
    cm.drain()
    h, _ = cm.match_req(ids)
    cm.lock(h)
    before, seq = cm.manager.size_info, publisher.next_seq
    with pytest.raises(RuntimeError, match="locks on 6 cached tokens"):
        cm.reset()
    assert cm.manager.size_info == before and publisher.next_seq == seq
    cm.unlock(h)
    cm.reset()
    cm.check_integrity()
    batches = decode_frames(subscriber.receive(), subscriber.start_seq)
    events = [e for b in batches for e in b.events]
    assert [(type(e), getattr(e, "medium", None)) for e in events] == [
        (BlockStored, "GPU"),
        (BlockStored, "CPU_PINNED"),
        (BlockRemoved, "CPU_PINNED"),
        (AllBlocksCleared, None),
    ]
    assert events[0].block_hashes == events[1].block_hashes == events[2].block_hashes


def test_an_inproc_endpoint_on_a_shared_context_reaches_other_sockets():
    ctx = zmq.Context()
    with pytest.raises(TypeError, match="context must be a zmq.Context"):
        EventPublisher("inproc://kv-shared", context="ctx")
    publisher = EventPublisher("inproc://kv-shared", context=ctx, topic=TOPIC, data_parallel_rank=3)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect("inproc://kv-shared")
    deadline = time.monotonic() + 20
    while not sub.poll(50):  # until the subscription reached the publisher
        assert time.monotonic() < deadline
        publisher.publish([])
    while sub.poll(50):
        sub.recv_multipart()
    cm = CacheManager(num_pages=8, page_size=2, kv_events=publisher)
    cache_new(cm, torch.arange(5))
    seq = publisher.next_seq
    cm.flush_events()
    (batch,) = decode_frames([tuple(sub.recv_multipart())], seq)
    assert [len(e.block_hashes) for e in batch.events] == [2]
    sub.close(linger=0)
    publisher.close()
    assert not ctx.closed  # the caller's to close
    ctx.term()


def test_a_manager_goes_on_without_events_once_its_publisher_is_closed():
    """A shutdown that closes the publisher first: the manager's calls,
    reset and the bound's flushes included, work as with events off."""
    from radixkv.scheduler.block_events import MAX_PENDING_EVENTS

    publisher = EventPublisher("tcp://127.0.0.1:*")
    cm = CacheManager(num_pages=8, page_size=2, kv_events=publisher, host_num_pages=8)
    cache_new(cm, torch.arange(7))
    publisher.close()
    assert cm.drain() == [] and cm.flush_events() == 0
    for k in range(MAX_PENDING_EVENTS // 2 + 1):  # past the bound: flushes from inside calls
        cache_new(cm, torch.arange(100 + 10 * k, 107 + 10 * k))
        cm.make_room(8 * 2)
    cm.reset()
    cm.check_integrity()
    assert cm.held_pages == 0 and cm.flush_events() == 0
    cm.close()


def test_events_past_the_bound_are_published_without_waiting(publisher, subscriber, monkeypatch):
    from radixkv.scheduler import block_events

    monkeypatch.setattr(block_events, "MAX_PENDING_EVENTS", 3)
    cm = CacheManager(num_pages=64, page_size=2, kv_events=publisher)
    for base in range(0, 700, 100):  # 7 requests, 7 events, no per-round call
        ids = torch.arange(base, base + 5)
        h, _ = cm.match_req(ids)
        cm.lock(h)
        cm.free_and_cache_finished_req(h, ids, cm.allocate(5))
    batches = decode_frames(subscriber.receive(), subscriber.start_seq)
    assert [len(b.events) for b in batches] == [3, 3]
    assert cm.flush_events() == 1

    # One call past the bound (a reset's two events after two pending): no
    # batch above it either.
    class Sent(EventPublisher):
        def __init__(self):  # no sockets
            self._closed, self.batches = False, []

        def publish_packed(self, events):
            self.batches.append(list(events))

    sent = Sent()
    ledger = block_events.BlockEvents(sent, 2, None, num_pages=4, host_num_pages=4)
    slots = torch.arange(4, dtype=torch.int32)
    ledger.device_inserted(torch.arange(4), slots, 0, 4, 0)
    ledger.host_backed_up(slots, slots, torch.empty(0, dtype=torch.int32))
    ledger.reset()
    assert [len(b) for b in sent.batches] == [3, 1]
    assert sent.batches[1] == [ALL_BLOCKS_CLEARED]

    # A threaded ledger's count may run ahead of its events (by the change
    # under way, or one that packs none): a batch goes out at the bound of
    # events, never early on the count alone.
    class Ahead:
        def __init__(self, ledger):
            self.ledger = ledger

        @property
        def pending(self):
            return self.ledger.pending + 1

        def __getattr__(self, name):
            return getattr(self.ledger, name)

    sent = Sent()
    ledger = block_events.BlockEvents(sent, 2, None, num_pages=8, host_num_pages=0)
    ledger.ledger = Ahead(ledger.ledger)
    for page in range(5):
        slots = torch.arange(2 * page, 2 * page + 2, dtype=torch.int32)
        ledger.device_inserted(torch.arange(10 * page, 10 * page + 2), slots, 0, 2, 0)
    assert [len(b) for b in sent.batches] == [3]
    assert ledger.flush() == 2 and [len(b) for b in sent.batches] == [3, 2]


def test_map_encoded_events_decode_too():
    """Newer vLLM writes events as maps tagged with "type"; decode_batch reads both."""

    class MStored(msgspec.Struct, tag="BlockStored", omit_defaults=True):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None = None

    class MBatch(msgspec.Struct, array_like=True):
        ts: float
        events: list[MStored]
        data_parallel_rank: int | None

    payload = msgspec.msgpack.encode(
        MBatch(2.5, [MStored([7, 8], 6, [1, 2, 3, 4], 2, None, "CPU_PINNED")], 1)
    )
    assert decode_batch(payload) == KVEventBatch(
        2.5, [BlockStored([7, 8], 6, [1, 2, 3, 4], 2, None, "CPU_PINNED")], 1
    )
    with pytest.raises(ValueError, match="payload"):
        decode_batch(b"\x93\x01")
    import msgpack

    for event in ([[1]], {"type": [1]}, [{"type": "BlockStored"}], ["Unknown", 1]):
        with pytest.raises(ValueError, match="unknown event tag"):
            decode_batch(msgpack.packb([0.0, [event], 0]))


def test_bad_configuration_raises_naming_the_argument(publisher):
    with pytest.raises(TypeError, match="endpoint"):
        EventPublisher(5557)
    with pytest.raises(ValueError, match="endpoint must start with tcp://"):
        EventPublisher("http://127.0.0.1:5557")
    for bad in ("tcp://127.0.0.1:99999", "tcp://127.0.0.1:0", "tcp://router:55x"):
        with pytest.raises(ValueError, match="endpoint must end with a port"):
            EventPublisher(bad)
    with pytest.raises(TypeError, match="events must be a list"):
        publisher.publish(None)
    with pytest.raises(ValueError, match="replay_endpoint"):
        EventPublisher("tcp://127.0.0.1:*", replay_endpoint="127.0.0.1:9")
    with pytest.raises(TypeError, match="topic"):
        EventPublisher("tcp://127.0.0.1:*", topic=b"kv")
    for rank in (-1, 2**64):  # the second would fail every publish
        with pytest.raises(ValueError, match=r"data_parallel_rank must be in \[0, "):
            EventPublisher("tcp://127.0.0.1:*", data_parallel_rank=rank)
    with pytest.raises(TypeError, match="data_parallel_rank"):
        EventPublisher("tcp://127.0.0.1:*", data_parallel_rank=True)
    with pytest.raises(TypeError, match="buffer_steps"):
        EventPublisher("tcp://127.0.0.1:*", buffer_steps="10")
    for hwm in (-1, 2**31):
        with pytest.raises(ValueError, match=r"hwm must be in \[0, "):
            EventPublisher("tcp://127.0.0.1:*", hwm=hwm)
    with pytest.raises(ValueError, match="buffer_steps"):
        EventPublisher("tcp://127.0.0.1:*", buffer_steps=2**30)
    with pytest.raises(OSError, match="replay_endpoint=.*cannot bind"):
        EventPublisher("tcp://127.0.0.1:*", replay_endpoint=publisher.endpoint)
    with pytest.raises(TypeError, match="kv_events must be a radixkv.events.EventPublisher"):
        CacheManager(num_pages=8, kv_events="tcp://*:5557")
    with pytest.raises(TypeError, match="events must hold"):
        encode_batch(KVEventBatch(0.0, ["BlockStored"], 0))
    with pytest.raises(TypeError, match="batch must be a KVEventBatch"):
        encode_batch([0.0, [], 0])
    closed = EventPublisher("inproc://closed-publisher")
    closed.close()
    with pytest.raises(RuntimeError, match="closed"):
        closed.publish([])


def test_events_off_make_no_publisher_and_import_no_zmq(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a publisher was made with events off")

    monkeypatch.setattr(EventPublisher, "__init__", refuse)
    pool = MHAKVCache(
        num_kv_heads=1, num_layers=1, head_dim=8, num_pages=4, dtype=torch.float32, page_size=2
    )
    cm = CacheManager(num_pages=4, page_size=2, kv_cache=pool, host_num_pages=8)
    for base in (0, 100, 200, 0):
        ids = torch.arange(base, base + 5)
        h, _ = cm.match_req(ids)
        h, cached = cm.load_back(h)
        cm.free_and_cache_finished_req(h, ids, torch.cat([cached, cm.allocate(5 - h.cached_len)]))
        cm.drain()
    cm.reset()
    assert cm.kv_events is None and not cm._events.on and not cm._tiers.host.events.on
    assert cm.flush_events() == 0
    # A fresh interpreter serving without events never imports pyzmq or msgpack.
    code = (
        "import sys, torch\n"
        "from radixkv.scheduler import CacheManager\n"
        "cm = CacheManager(num_pages=4, page_size=2, host_num_pages=8)\n"
        "h, _ = cm.match_req(torch.arange(5)); cm.lock(h)\n"
        "cm.free_and_cache_finished_req(h, torch.arange(5), cm.allocate(5))\n"
        "cm.make_room(8); cm.drain(); cm.reset()\n"
        "assert 'zmq' not in sys.modules and 'msgpack' not in sys.modules, 'imported'\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=300)


FORKED = """
import os, sys, torch
from radixkv.events import EventPublisher
from radixkv.scheduler import CacheManager

def serve(cm, base):
    ids = torch.arange(base, base + 14)
    h, cached = cm.match_req(ids)
    cm.lock(h)
    cm.free_and_cache_finished_req(h, ids, torch.cat([cached, cm.allocate(14 - h.cached_len)]))

cm = CacheManager(num_pages=16, page_size=4, kv_events=EventPublisher("tcp://127.0.0.1:*"))
serve(cm, 0)
assert cm.flush_events() == 1
serve(cm, 100)  # its BlockStored queued on the ledger's thread when the fork comes
child = os.fork()
if child == 0:
    if sys.argv[1] == "use":
        serve(cm, 200)
        assert cm.flush_events() == 2, "the child's flush"
        assert cm._tiers.events.ledger.device_blocks == 9
    sys.exit(0)  # the manager goes at the interpreter's exit
_, status = os.waitpid(child, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
serve(cm, 300)
assert cm.flush_events() == 2, "the parent's flush"
assert cm._tiers.events.ledger.device_blocks == 9
cm.kv_events.close()
"""


@pytest.mark.parametrize("child", ["use", "exit"])
def test_a_forked_child_serves_and_exits_with_the_ledger_thread_left_behind(child):
    """The ledger's thread stays in the parent at a fork(): the fork waits
    for the changes queued, and a child that serves starts a thread of its
    own; one that only exits does not wait for the parent's."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, "-c", FORKED, child], check=True, env=env, timeout=120)


def test_namespaces_are_distinct_blocks(publisher, subscriber):
    """Equal tokens of two namespaces are two blocks to a router: each
    namespace's hashes are its storage keys' (seeded by its name)."""
    from radixkv.scheduler.namespaces import Namespaces

    ps = 4
    cm = CacheManager(num_pages=16, page_size=ps, kv_events=publisher)
    ids = torch.arange(100, 109)
    for name in ("a", "b", None):
        h, _ = cm.match_req(ids, namespace=name)
        assert h.cached_len == 0
        cm.lock(h)
        cm.free_and_cache_finished_req(h, ids, cm.allocate(len(ids)))
    cm.flush_events()
    (batch,) = decode_frames(subscriber.receive(), subscriber.start_seq)
    stored = [e.block_hashes for e in batch.events]
    spaces = Namespaces()
    want = [
        [
            block_hash(k)
            for k in page_keys(ids[:8].to(torch.int32), ps, spaces.seed(spaces.id(name), None))
        ]
        for name in ("a", "b", None)
    ]
    assert stored == want and len({tuple(x) for x in stored}) == 3
    cm.make_room(16 * ps)
    cm.flush_events()
    (batch,) = decode_frames(subscriber.receive(), subscriber.start_seq + 1)
    (removed,) = batch.events
    assert sorted(removed.block_hashes) == sorted(h for x in want for h in x)


@pytest.mark.parametrize("chunked", [False, True])
def test_a_request_whose_namespace_was_forgotten_finishes(publisher, subscriber, chunked):
    """Its name leaves the table while the request runs: the request still
    caches and frees as it would with events off; its pages, which no
    request can hit any more, are not announced."""
    ps = 4
    cm = CacheManager(num_pages=32, page_size=ps, max_namespaces=1, kv_events=publisher)
    ids = torch.arange(20, dtype=torch.int32)
    h, _ = cm.match_req(ids, namespace="a")
    cm.lock(h)
    own = cm.allocate(len(ids))
    cm.match_req(torch.arange(3), namespace="b")  # "a" is forgotten
    if chunked:  # a first chunk cached before the rest
        h, idx = cm.cache_unfinished_req(h, ids[:12], own[:12])
        own = torch.cat([idx, own[12:]])
    cm.free_and_cache_finished_req(h, ids, own)
    cm.check_integrity()
    assert cm.held_pages == 0
    cm.flush_events()
    batches = decode_frames(subscriber.receive(), subscriber.start_seq)
    assert not any(isinstance(e, VStored) for b in batches for e in b.events)


def test_namespaced_pages_have_one_hash_on_every_medium(tmp_path, publisher, subscriber):
    from radixkv.kvcache import MHAKVCache
    from radixkv.scheduler.namespaces import Namespaces
    from radixkv.storage import pool_fingerprint

    pool = MHAKVCache(1, 1, 8, 8, torch.float32, page_size=2)
    fp = pool_fingerprint(pool, model="m")
    cm = CacheManager(
        8,
        2,
        host_num_pages=8,
        kv_cache=pool,
        storage=FileStorage(str(tmp_path), fingerprint=fp),
        kv_events=publisher,
    )
    ids = torch.arange(100, 105)
    h, _ = cm.match_req(ids, namespace="tenant")
    cm.lock(h)
    cm.free_and_cache_finished_req(h, ids, cm.allocate(5))
    cm.drain()
    spaces = Namespaces()
    want = [
        block_hash(k)
        for k in page_keys(ids[:4].to(torch.int32), 2, spaces.seed(spaces.id("tenant"), fp))
    ]
    media = {}
    for batch in decode_frames(subscriber.receive(), subscriber.start_seq):
        for e in batch.events:
            media.setdefault(e.medium, []).extend(e.block_hashes)
    assert media == {"GPU": want, "CPU_PINNED": want, "DISK": want}
    # The pages were written under the namespace's keys (the events' chain).
    keys = page_keys(ids[:4].to(torch.int32), 2, spaces.seed(spaces.id("tenant"), fp))
    assert FileStorage(str(tmp_path), fingerprint=fp).batch_exists(keys) == 2
    cm.close()


@pytest.mark.parametrize("threaded", [False, True])
def test_the_native_ledger_refuses_bad_input_naming_it_and_changes_nothing(threaded):
    """A threaded ledger too: its calls check their input on the caller's
    thread before anything is queued."""
    ledger = _core.BlockLedger(4, 2, 2, threaded)
    assert ledger.threaded is threaded
    tokens, slots = torch.arange(4, dtype=torch.int32), torch.arange(4, dtype=torch.int32)
    ledger.device_inserted(tokens, slots, 0, 4, 0)
    ledger.take_events()
    cases = [
        (
            ValueError,
            "seed must be 32 bytes",
            lambda: ledger.device_inserted(tokens, slots, 0, 4, 0, b"x"),
        ),
        (
            TypeError,
            "seed must be bytes",
            lambda: ledger.device_inserted(tokens, slots, 0, 4, 0, "s"),
        ),
        (ValueError, "end", lambda: ledger.device_inserted(tokens, slots, 0, 6, 0)),
        (ValueError, "whole pages", lambda: ledger.device_inserted(tokens, slots, 1, 4, 0)),
        (ValueError, "slots\\[2\\] = 8", lambda: ledger.device_evicted(torch.tensor([0, 1, 8, 9]))),
        (ValueError, "slots\\[0\\] = -2", lambda: ledger.device_evicted(torch.tensor([-2, -1]))),
        (TypeError, "slots", lambda: ledger.device_evicted(torch.zeros(2))),
        (ValueError, "same length", lambda: ledger.device_loaded(slots, slots[:2])),
        (ValueError, "host_slots\\[2\\] = 4", lambda: ledger.host_backed_up(slots, slots + 2, [])),
        (ValueError, "rejected\\[0\\] = 9", lambda: ledger.host_backed_up(slots, slots, [9])),
        # Indices name the place in the argument, past the cached part too.
        (
            ValueError,
            "slots\\[2\\] = 99",
            lambda: ledger.device_inserted(tokens, [0, 1, 99, 3], 2, 4, 0),
        ),
        (
            ValueError,
            "slots\\[2\\] = 99",  # the page before start: its block goes on
            lambda: ledger.device_inserted(torch.arange(6), [0, 1, 99, 3, 4, 5], 4, 6, 4),
        ),
        (ValueError, "name 1 pages", lambda: ledger.host_inserted(tokens, 0, slots[:2], [])),
    ]
    for error, message, call in cases:
        with pytest.raises(error, match=message):
            call()
        assert ledger.pending == 0
        assert (ledger.device_blocks, ledger.host_blocks) == (2, 0)
    for bad, error in ((True, TypeError), (2**63, ValueError), ("5", TypeError)):
        with pytest.raises(error, match="lora_id"):
            ledger.lora_id = bad
        assert ledger.lora_id is None
    ledger.lora_id = 5
    assert ledger.lora_id == 5
    ledger.lora_id = None
    # What they would have done, done right.
    ledger.host_backed_up(slots, slots, [])
    ledger.device_evicted(slots)  # still on the host: stored there, a medium change
    assert (ledger.device_blocks, ledger.host_blocks) == (0, 2) and ledger.pending == 3
