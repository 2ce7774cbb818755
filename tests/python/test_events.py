"""KV events: a real ZeroMQ subscriber reads what a CacheManager publishes and
checks the framing, the encoding (against msgspec structs shaped as vLLM's),
and that replaying the events gives exactly the blocks each tier holds."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time

import msgspec
import pytest
import torch
import zmq

from radixkv import _core
from radixkv.events import (
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
        self.start_seq = self.publisher.next_seq

    def receive(self, timeout_s: float = 20.0):
        """Every batch published so far: a list of (topic, seq, payload)."""
        last = self.publisher.next_seq - 1
        got = []
        deadline = time.monotonic() + timeout_s
        while not got or int.from_bytes(got[-1][1], "big") < last:
            if not self.sock.poll(100):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"batches up to {last} never arrived")
                continue
            frames = self.sock.recv_multipart()
            assert len(frames) == 3, frames
            got.append(tuple(frames))
        self.frames += got
        return got

    def close(self):
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def publisher():
    pub = EventPublisher("tcp://127.0.0.1:*", topic=TOPIC, data_parallel_rank=3,
                         replay_endpoint="tcp://127.0.0.1:*")
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
                assert (a.block_hashes, a.parent_block_hash, a.token_ids, a.block_size,
                        a.lora_id, a.medium) == (b.block_hashes, b.parent_block_hash,
                                                 b.token_ids, b.block_size, b.lora_id, b.medium)
            elif isinstance(a, BlockRemoved):
                assert (a.block_hashes, a.medium) == (b.block_hashes, b.medium)
        batches.append(ours)
    return batches


class Model:
    """What a router learns from the events: the blocks on each medium."""

    def __init__(self):
        self.media = {"GPU": set(), "CPU_PINNED": set(), "DISK": set()}
        self.tokens = {}  # block hash -> its tokens, as announced

    def apply(self, event, page_size):
        if isinstance(event, BlockStored):
            blocks = self.media[event.medium]
            assert event.block_size == page_size and event.lora_id is None
            assert len(event.token_ids) == page_size * len(event.block_hashes)
            assert len(set(event.block_hashes)) == len(event.block_hashes)
            if event.medium != "DISK":
                # Both tiers are root-closed: a page's parent is on its tier.
                assert event.parent_block_hash is None or event.parent_block_hash in blocks
            parent = event.parent_block_hash
            for i, h in enumerate(event.block_hashes):
                assert h not in blocks, f"{h} stored twice on {event.medium}"
                assert 0 <= h < 2**64
                blocks.add(h)
                tokens = event.token_ids[i * page_size:(i + 1) * page_size]
                assert self.tokens.setdefault(h, (parent, tokens)) == (parent, tokens)
                parent = h
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                assert h in self.media[event.medium], f"{h} removed from {event.medium} unseen"
                self.media[event.medium].remove(h)
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
                found.add(block_hash(entry.name[:-len(".page")]))
    return found


def test_a_request_is_one_block_stored_encoded_as_vllm_does(publisher, subscriber):
    ps = 4
    cm = CacheManager(num_pages=16, page_size=ps, kv_events=publisher)
    assert cm.kv_events is publisher
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
    assert event == BlockStored([block_hash(k) for k in keys], None, list(range(100, 112)), ps,
                                None, "GPU")
    assert [block_hash(k) for k in keys] == [int(k, 16) & (2**64 - 1) for k in keys]
    # Byte for byte what msgspec writes for vLLM's structs.
    payload = frames[0][2]
    again = msgspec.msgpack.encode(VBatch(batch.ts, [VStored(*event)], 3))
    assert payload == again
    assert encode_batch(batch) == payload

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
