"""Events packed natively (radixkv._core.pack_block_stored / pack_block_removed,
radixkv.events.packed_batch) against msgpack-python's encoding of the same
events (radixkv.events.encode_batch): the bytes must be equal."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

msgpack = pytest.importorskip("msgpack")

from radixkv import _core  # noqa: E402
from radixkv.events import (  # noqa: E402
    ALL_BLOCKS_CLEARED,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventPublisher,
    KVEventBatch,
    decode_batch,
    encode_batch,
    pack_event,
    packed_batch,
)
from radixkv.scheduler import CacheManager  # noqa: E402

MEDIA = ["GPU", "CPU_PINNED", "DISK", None, "x" * 31, "y" * 32, "z" * 255, "w" * 256, "é" * 40]
EDGES = [0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1]
TOKEN_EDGES = [0, 127, 128, -1, -32, -33, -128, -129, -32768, -32769, 2**31 - 1, -(2**31)]
LORA = [None, 0, 1, 127, 300, -1, -200, 2**40, -(2**40), 2**63 - 1, -(2**63)]


def random_hash(rng: random.Random) -> int:
    return rng.choice(EDGES) if rng.random() < 0.3 else rng.getrandbits(rng.choice([7, 16, 32, 64]))


def random_event(rng: random.Random):
    kind = rng.random()
    n = rng.choice([0, 1, 2, 15, 16, 17, rng.randint(0, 300)])
    hashes = [random_hash(rng) for _ in range(n)]
    if kind < 0.6:
        tokens = [
            rng.choice(TOKEN_EDGES) if rng.random() < 0.3 else rng.randint(-(2**31), 2**31 - 1)
            for _ in range(rng.choice([0, 1, 16, 17, rng.randint(0, 5000)]))
        ]
        parent = None if rng.random() < 0.3 else random_hash(rng)
        size = rng.choice([1, 16, 128, 255, 256, 70000])
        return BlockStored(hashes, parent, tokens, size, rng.choice(LORA), rng.choice(MEDIA))
    if kind < 0.95:
        return BlockRemoved(hashes, rng.choice(MEDIA))
    return AllBlocksCleared()


@pytest.mark.parametrize("seed", range(20))
def test_packed_events_are_byte_identical_to_encode_batch(seed):
    rng = random.Random(seed)
    events = [random_event(rng) for _ in range(rng.choice([0, 1, 15, 16, 17, 40]))]
    ts = rng.random() * 2e9
    rank = rng.choice([0, 3, 127, 128, 2**31 - 1])
    expected = encode_batch(KVEventBatch(ts, events, rank))
    assert packed_batch(ts, [pack_event(e) for e in events], rank) == expected
    assert decode_batch(expected) == KVEventBatch(ts, events, rank)


def test_a_batch_past_65535_events_has_a_32_bit_header():
    events = [AllBlocksCleared()] * 70000
    assert packed_batch(1.5, [ALL_BLOCKS_CLEARED] * 70000, 0) == encode_batch(
        KVEventBatch(1.5, events, 0)
    )


def test_strided_and_2d_inputs_pack_as_their_values():
    rows = np.zeros(5, dtype=[("hash", "<u8"), ("pad", "u1"), ("tokens", "<i4", (3,))])
    rows["hash"] = [2**64 - 1, 5, 2**40, 0, 300]
    rows["tokens"] = np.arange(-7, 8, dtype=np.int32).reshape(5, 3)
    got = _core.pack_block_stored(rows["hash"][1:4], 9, rows["tokens"][1:4], 3, None, "GPU")
    want = pack_event(BlockStored([5, 2**40, 0], 9, list(range(-4, 5)), 3, None, "GPU"))
    assert got == want
    assert _core.pack_block_removed(rows["hash"][::2], "DISK") == pack_event(
        BlockRemoved([2**64 - 1, 2**40, 300], "DISK")
    )


def test_bad_input_raises_naming_the_argument():
    h = np.array([1], dtype=np.uint64)
    t = np.array([1], dtype=np.int32)
    with pytest.raises(TypeError, match="block_hashes"):
        _core.pack_block_stored(np.array([1], dtype=np.int64), None, t, 1, None, "GPU")
    with pytest.raises(TypeError, match="block_hashes"):
        _core.pack_block_removed([1, 2], "GPU")
    with pytest.raises(TypeError, match="token_ids"):
        _core.pack_block_stored(h, None, np.array([1], dtype=np.int64), 1, None, "GPU")
    with pytest.raises(TypeError, match="token_ids"):
        _core.pack_block_stored(h, None, t.astype(">i4"), 1, None, "GPU")
    with pytest.raises(ValueError, match="parent_block_hash"):
        _core.pack_block_stored(h, -1, t, 1, None, "GPU")
    with pytest.raises(ValueError, match="parent_block_hash"):
        _core.pack_block_stored(h, 2**64, t, 1, None, "GPU")
    with pytest.raises(TypeError, match="parent_block_hash"):
        _core.pack_block_stored(h, "1", t, 1, None, "GPU")
    with pytest.raises(TypeError, match="lora_id"):
        _core.pack_block_stored(h, None, t, 1, "a", "GPU")
    with pytest.raises(TypeError, match="block_size"):
        _core.pack_block_stored(h, None, t, 1.5, None, "GPU")
    with pytest.raises(TypeError, match="medium"):
        _core.pack_block_removed(h, 3)
    with pytest.raises(TypeError, match="event"):
        pack_event(("BlockRemoved", [1], "GPU"))
    # pack_event writes the numbers it is given or refuses them, never a cast of them.
    for bad, error, name in [
        (BlockStored([1], None, [2**31], 1, None, None), ValueError, "token_ids"),
        (BlockStored([1], None, [1.5], 1, None, None), TypeError, "token_ids"),
        (BlockStored([-1], None, [1], 1, None, None), ValueError, "block_hashes"),
        (BlockRemoved([2**64], None), ValueError, "block_hashes"),
        (BlockRemoved([True], None), TypeError, "block_hashes"),
    ]:
        with pytest.raises(error, match=name):
            pack_event(bad)
    edge = BlockStored([2**64 - 1, 0], 2**64 - 1, [-(2**31), 2**31 - 1], 2, None, "GPU")
    assert pack_event(edge) == msgpack.packb(["BlockStored", *edge], use_bin_type=True)


class Recorder(EventPublisher):
    """A publisher without sockets that keeps each payload it would send."""

    def __init__(self, rank: int = 2):  # no sockets
        self.data_parallel_rank = rank
        self._closed = False
        self.payloads: list = []

    def _send(self, payload: bytes):
        self.payloads.append(payload)
        return len(self.payloads) - 1


@pytest.mark.parametrize("host", [False, True])
def test_a_managers_payloads_are_canonical_msgpack(host):
    """Each payload a manager publishes (stores, evictions, backups, host
    evictions, a reset) re-encodes to itself through msgpack-python."""
    page, seq, pool = 4, 64, 6
    rec = Recorder()
    cm = CacheManager(
        num_pages=pool * seq // page,
        page_size=page,
        host_num_pages=2 * pool * seq // page if host else 0,
        manual_copies=False,
        kv_events=rec,
    )
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(-(2**31), 2**31 - 1, (16,), generator=g, dtype=torch.int32)
    for i in range(40):
        rest = torch.randint(0, 2**31 - 1, (seq - 16,), generator=g, dtype=torch.int32)
        ids = torch.cat([shared, rest]) if i % 2 else rest[: seq - 16]
        h, cached = cm.match_req(ids)
        cm.lock(h)
        own = cm.allocate(len(ids) - h.cached_len)
        cm.free_and_cache_finished_req(h, ids, torch.cat([cached, own]))
        cm.writing_check()
    cm.reset()
    assert len(rec.payloads) > 10
    kinds = set()
    for payload in rec.payloads:
        batch = decode_batch(payload)
        assert batch.data_parallel_rank == 2
        assert encode_batch(batch) == payload
        kinds |= {(type(e).__name__, getattr(e, "medium", None)) for e in batch.events}
    want = {("BlockStored", "GPU"), ("BlockRemoved", "GPU"), ("AllBlocksCleared", None)}
    if host:
        want |= {("BlockStored", "CPU_PINNED"), ("BlockRemoved", "CPU_PINNED")}
    assert want <= kinds
