"""KV events: which blocks a cache holds, published over ZeroMQ for KV-aware routers.

The wire format is vLLM's, so a router that consumes vLLM's events (NVIDIA
Dynamo's, for one) consumes radixkv's unchanged:

- a batch is the msgpack array `[ts, events, data_parallel_rank]` (a float,
  a list, an int), one per scheduling round, and from a publisher with an
  epoch `[ts, events, data_parallel_rank, epoch]`: the publisher's
  incarnation, an int a restarted publisher draws anew (vLLM's decoder, a
  msgspec array-like struct, ignores a trailing element);
- an event is a msgpack array whose first element is its tag, the fields
  following in this order (what msgspec writes for vLLM's `array_like`,
  `tag=True` structs; no field is omitted):
  `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium]`, `["BlockRemoved", block_hashes, medium]`,
  `["AllBlocksCleared"]`;
- each batch goes out on a PUB socket as three frames: the topic (UTF-8),
  the batch's sequence number (8 bytes, big-endian, from 0, one per batch)
  and the msgpack payload. A gap in the numbers is a batch lost (a
  subscriber too slow for the socket's high-water mark); the replay socket
  (ROUTER, optional) sends the last `buffer_steps` batches again from a
  number a client asks for, as vLLM's does. Asked for number 2^64 - 1
  (eight 0xff bytes), it sends a snapshot instead: one batch of BlockStored
  events for every block the cache's tiers hold, framed with the number of
  the first batch it does not cover (see `radixkv.event_index`, a
  subscriber that keeps exact per-medium state across lost batches and
  publisher restarts); asked for 2^64 - 2, the publisher's status: an empty
  batch of its epoch framed with its next batch's number.

The newest vLLM releases write each event as a map tagged `"type"` instead
of an array; consumers (Dynamo's among them) read both, and so does
`decode_batch`. The array form is the one every consumer of vLLM's events
reads, and the smaller.

Block hashes. A block is one page of `page_size` tokens. Its 32-byte key is
the storage tier's SHA-256 page chain (`radixkv.storage.page_keys`: key i =
SHA256(key i-1 || page i's tokens as little-endian u32), seeded with the
storage tier's configuration fingerprint when there is one), so a page has
the same key on every tier and in every instance of one configuration. The
block hash is that key's low 64 bits, read big-endian: an unsigned 64-bit
int (`int.from_bytes(key, "big") & (2**64 - 1)`, what vLLM publishes when its
block hashes are ints), which Dynamo takes as its `u64` block hash. A chain
of 64-bit hashes collides with probability about n^2 / 2^65 for n distinct
pages.

Media: "GPU" for the device pool's pages (whatever the device), "CPU_PINNED"
for the host tier's, "DISK" for pages in the storage tier. `AllBlocksCleared`
says that every "GPU" block is gone (a router applies it to the device tier).

`pyzmq` and `msgpack` (the `radixkv[events]` extra) are imported only when a
publisher is made or a batch is encoded: `import radixkv` never needs them.
"""

from __future__ import annotations

import secrets
import struct
import threading
import time
from collections import deque
from typing import List, NamedTuple, Optional, Sequence, Union

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"
"""Where a publisher binds by default: loopback only (the events carry prompts' token ids)."""

MEDIUM_GPU = "GPU"
MEDIUM_CPU_PINNED = "CPU_PINNED"
MEDIUM_DISK = "DISK"


def block_hash(key: Union[bytes, str]) -> int:
    """The block hash of a 32-byte page key (bytes, or hex as `page_keys`
    gives it): its low 64 bits, read big-endian."""
    if isinstance(key, str):
        return int(key[-16:], 16)
    return int.from_bytes(key[-8:], "big")


class BlockStored(NamedTuple):
    """Pages that entered a tier: a chain of consecutive pages of one
    sequence, `parent_block_hash` the page before the first (None: the first
    page of the sequence), `token_ids` their tokens (`block_size` a page)."""

    block_hashes: List[int]
    parent_block_hash: Optional[int]
    token_ids: List[int]
    block_size: int
    lora_id: Optional[int] = None
    medium: Optional[str] = MEDIUM_GPU


class BlockRemoved(NamedTuple):
    """Pages that left a tier."""

    block_hashes: List[int]
    medium: Optional[str] = MEDIUM_GPU


class AllBlocksCleared(NamedTuple):
    """Every block on the device is gone (the cache was reset)."""


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class KVEventBatch(NamedTuple):
    """The events of one scheduling round, in the order they happened, and
    the epoch of the publisher that sent them (None: it has none)."""

    ts: float
    events: List[KVEvent]
    data_parallel_rank: Optional[int] = 0
    epoch: Optional[int] = None


class KVSnapshot(NamedTuple):
    """Every block a cache's tiers hold, as one batch (`payload`, in the wire
    format, BlockStored events only) of publisher `epoch`, covering every
    batch numbered below `seq`."""

    epoch: Optional[int]
    seq: int
    payload: bytes


SNAPSHOT_REQUEST = b"\xff" * 8
"""What a replay client sends for a snapshot instead of a start number."""

STATUS_REQUEST = b"\xff" * 7 + b"\xfe"
"""What a replay client sends to learn who the publisher is now: the replay
thread answers at once (the engine's thread need not flush) with an empty
batch of the publisher's epoch framed with the number its next batch will
get, then the end marker."""


def _wire(event: KVEvent) -> list:
    if isinstance(event, BlockStored):
        return [
            "BlockStored",
            event.block_hashes,
            event.parent_block_hash,
            event.token_ids,
            event.block_size,
            event.lora_id,
            event.medium,
        ]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", event.block_hashes, event.medium]
    if isinstance(event, AllBlocksCleared):
        return ["AllBlocksCleared"]
    raise TypeError(
        f"events must hold BlockStored, BlockRemoved or AllBlocksCleared, got "
        f"{type(event).__name__}"
    )


def encode_batch(batch: KVEventBatch) -> bytes:
    """The msgpack payload of `batch`, byte for byte what vLLM's encoder
    writes for the same values."""
    import msgpack

    if not isinstance(batch, KVEventBatch):
        raise TypeError(f"batch must be a KVEventBatch, got {type(batch).__name__}")
    fields = [float(batch.ts), [_wire(e) for e in batch.events], batch.data_parallel_rank]
    if batch.epoch is not None:
        fields.append(batch.epoch)
    return msgpack.packb(fields, use_bin_type=True)


def pack_event(event: KVEvent) -> bytes:
    """One event's msgpack, natively: what `encode_batch` writes for it inside
    a batch (its block hashes uint64, its tokens int32). A batch of packed
    events goes out through `EventPublisher.publish_packed`."""
    import numpy as np

    from radixkv import _core

    def ints(values, dtype, name: str) -> "np.ndarray":
        # Exactly the values given: a float, a bool or one out of the type's
        # range is refused, where a cast would write another number.
        info = np.iinfo(dtype)
        values = list(values)
        for v in values:
            if not isinstance(v, (int, np.integer)) or isinstance(v, (bool, np.bool_)):
                raise TypeError(f"{name} must hold ints, got {type(v).__name__}")
            if not info.min <= v <= info.max:
                raise ValueError(f"{name} must hold ints in [{info.min}, {info.max}], got {v}")
        return np.array(values, dtype=dtype)

    if isinstance(event, BlockStored):
        return _core.pack_block_stored(
            ints(event.block_hashes, np.uint64, "block_hashes"),
            event.parent_block_hash,
            ints(event.token_ids, np.int32, "token_ids"),
            event.block_size,
            event.lora_id,
            event.medium,
        )
    if isinstance(event, BlockRemoved):
        return _core.pack_block_removed(
            ints(event.block_hashes, np.uint64, "block_hashes"), event.medium
        )
    if isinstance(event, AllBlocksCleared):
        return ALL_BLOCKS_CLEARED
    raise TypeError(
        f"event must be a BlockStored, BlockRemoved or AllBlocksCleared, got "
        f"{type(event).__name__}"
    )


ALL_BLOCKS_CLEARED = b"\x91\xb0AllBlocksCleared"
"""The msgpack of `["AllBlocksCleared"]`."""


def packed_batch(
    ts: float,
    events: Sequence[bytes],
    data_parallel_rank: Optional[int],
    epoch: Optional[int] = None,
) -> bytes:
    """The payload of a batch whose events are already msgpack (`pack_event`,
    or the cache's own): byte for byte `encode_batch` of the same events."""
    import msgpack

    n = len(events)
    if n < 16:
        head = bytes((0x90 | n,))
    elif n <= 0xFFFF:
        head = b"\xdc" + n.to_bytes(2, "big")
    else:
        head = b"\xdd" + n.to_bytes(4, "big")
    return b"".join(
        (
            b"\x93\xcb" if epoch is None else b"\x94\xcb",
            struct.pack(">d", float(ts)),
            head,
            *events,
            msgpack.packb(data_parallel_rank),
            b"" if epoch is None else msgpack.packb(epoch),
        )
    )


def decode_batch(payload: bytes) -> KVEventBatch:
    """A payload of vLLM's format (array- or map-encoded events) back as a
    KVEventBatch; fields past the ones named here are ignored. Raises
    ValueError for anything else."""
    import msgpack

    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as e:
        raise ValueError(f"payload is not msgpack: {e}") from None
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise ValueError("payload must be a msgpack array [ts, events, data_parallel_rank]")
    events = [_event_from_wire(e) for e in raw[1]]
    epoch = raw[3] if len(raw) > 3 else None
    if epoch is not None and (isinstance(epoch, bool) or not isinstance(epoch, int)):
        raise ValueError(f"a batch's epoch must be an int, got {epoch!r}")
    return KVEventBatch(raw[0], events, raw[2] if len(raw) > 2 else None, epoch)


_FIELDS = {
    "BlockStored": BlockStored._fields,
    "BlockRemoved": BlockRemoved._fields,
    "AllBlocksCleared": (),
}
_TYPES = {
    "BlockStored": BlockStored,
    "BlockRemoved": BlockRemoved,
    "AllBlocksCleared": AllBlocksCleared,
}


def _event_from_wire(raw) -> KVEvent:
    if isinstance(raw, dict):
        tag = raw.get("type")
    elif isinstance(raw, list) and raw:
        tag = raw[0]
    else:
        raise ValueError(f"an event must be a tagged array or map, got {raw!r}")
    if not isinstance(tag, str) or tag not in _TYPES:
        raise ValueError(f"unknown event tag {tag!r}")
    fields = _FIELDS[tag]
    if isinstance(raw, dict):
        values = [raw.get(f) for f in fields]
    else:
        values = list(raw[1 : 1 + len(fields)])
        values += [None] * (len(fields) - len(values))
    return _TYPES[tag](*values)


def _check_endpoint(endpoint, name: str) -> str:
    if not isinstance(endpoint, str):
        raise TypeError(
            f"{name} must be a ZeroMQ endpoint string, got " f"{type(endpoint).__name__}"
        )
    if not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(f"{name} must start with tcp://, ipc:// or inproc://, got {endpoint!r}")
    port = endpoint.rpartition(":")[2] if endpoint.startswith("tcp://") else "*"
    if port != "*" and not (port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"{name} must end with a port in [1, 65535] or *, got {endpoint!r}")
    return endpoint


def _check_count(value, name: str, minimum: int, maximum: int = 2**31 - 1) -> int:
    """An int in [minimum, maximum] (by default what ZeroMQ's int options
    and msgpack's integers hold)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not minimum <= value <= maximum:
        raise ValueError(f"{name} must be in [{minimum}, {maximum}], got {value}")
    return value


class EventPublisher:
    """Publishes KV event batches on a ZeroMQ PUB socket (vLLM's framing).

    `endpoint`: by default (None) the socket is bound on the loopback
    interface, `tcp://127.0.0.1:5557` (DEFAULT_ENDPOINT): the events carry
    the token ids of users' prompts, so only processes of this machine may
    read them unless the deployment says otherwise. An endpoint given binds
    when it has a wildcard (`tcp://*:5557`, every interface: only on a
    network you trust; or `tcp://127.0.0.1:*` for any free port), `::`, or
    is ipc:// or inproc://, and connects otherwise (`tcp://router-host:5557`),
    as vLLM does; `bind=True` (or False) says which instead. `endpoint` (the
    property) is where it was bound, port included. `replay_endpoint`
    (bound, optional): a ROUTER socket where a client (DEALER or REQ) sends
    a start sequence number (8 bytes, big-endian) and gets back, for every
    kept batch from it on, `[topic, seq, payload]`, then `[b"", -1 as 8
    signed big-endian bytes, b""]`. `buffer_steps` batches are kept for it.
    Two numbers are requests instead: SNAPSHOT_REQUEST (answered at the
    cache's next flush) and STATUS_REQUEST (answered at once).

    `publish()` encodes the batch and hands it to ZeroMQ on the caller's
    thread (tens of microseconds): a PUB socket never blocks, ZeroMQ's own
    thread does the network. `epoch` names this publisher's incarnation in
    every batch: True (the default) draws a random 63-bit int, so a restarted
    engine's batches are told from the old one's; an int is that epoch (it
    must differ for each incarnation: a subscriber takes two publishers with
    one epoch for one);
    False sends none (three-element batches, exactly vLLM's). A subscriber
    that falls `hwm` batches behind
    loses the oldest, which it sees as a gap in the sequence numbers (and
    may fill from the replay socket). Only the replay socket has a thread of
    its own, which waits for requests. Several threads may publish through
    one publisher (a lock orders them). `close()` closes the sockets after
    what was sent has gone out (up to a second). Usable as a context
    manager.

    `context`: the ZeroMQ context of the sockets. By default the publisher
    has one of its own, so an inproc:// endpoint is reachable only through
    that; give `zmq.Context.instance()` (say) to reach it from other sockets
    of the process. A context given stays open at `close()`.
    """

    END_SEQ = (-1).to_bytes(8, "big", signed=True)
    # What a subclass that makes no sockets (a recorder in a test) starts with.
    epoch: Optional[int] = None
    _next_seq = 0
    _snapshot_clients: List[bytes] = []  # (never appended to: each publisher makes its own)

    def __init__(
        self,
        endpoint: Optional[str] = None,
        *,
        replay_endpoint: Optional[str] = None,
        topic: str = "",
        data_parallel_rank: int = 0,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        context=None,
        bind: Optional[bool] = None,
        epoch: Union[bool, int] = True,
    ):
        if endpoint is None:
            if bind is False:
                raise ValueError(
                    "bind=False connects to an endpoint: give endpoint (where the "
                    "router listens)"
                )
            endpoint, bind = DEFAULT_ENDPOINT, True
        endpoint = _check_endpoint(endpoint, "endpoint")
        if bind is not None and not isinstance(bind, bool):
            raise TypeError(f"bind must be True, False or None, got {type(bind).__name__}")
        if replay_endpoint is not None:
            replay_endpoint = _check_endpoint(replay_endpoint, "replay_endpoint")
        if not isinstance(topic, str):
            raise TypeError(f"topic must be a str, got {type(topic).__name__}")
        self.data_parallel_rank = _check_count(data_parallel_rank, "data_parallel_rank", 0)
        if epoch is True:
            self.epoch: Optional[int] = secrets.randbits(63)
        elif epoch is False:
            self.epoch = None
        else:
            self.epoch = _check_count(epoch, "epoch", 0, 2**63 - 1)
        buffer_steps = _check_count(buffer_steps, "buffer_steps", 0, 2**29)
        hwm = _check_count(hwm, "hwm", 0)
        try:
            import msgpack  # noqa: F401
            import zmq
        except ImportError as e:
            raise ImportError(
                f"KV events need pyzmq and msgpack (pip install " f"'radixkv[events]'): {e}"
            ) from None
        if context is not None and not isinstance(context, zmq.Context):
            raise TypeError(f"context must be a zmq.Context, got {type(context).__name__}")
        self._zmq = zmq
        self._topic = topic.encode("utf-8")
        self._own_ctx = context is None
        self._ctx = zmq.Context() if context is None else context
        pub = replay = None
        try:
            pub = self._ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.SNDHWM, hwm)
            self.endpoint = self._open(pub, endpoint, "endpoint", zmq, bind)
            if replay_endpoint is not None:
                replay = self._ctx.socket(zmq.ROUTER)
                # Room for a whole replay and its end marker.
                replay.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
                self.replay_endpoint: Optional[str] = self._bind(
                    replay, replay_endpoint, "replay_endpoint", zmq
                )
            else:
                self.replay_endpoint = None
        except BaseException:
            self._close_sockets(pub, replay)
            raise
        self._pub, self._replay = pub, replay  # the PUB socket always, the ROUTER if asked
        self._lock = threading.Lock()  # the PUB socket, the numbers and the kept batches
        self._buffer: deque = deque(maxlen=buffer_steps)  # (seq bytes, payload), immutable
        self._next_seq = 0
        # Batches ZeroMQ refused outright; a PUB socket drops silently past a
        # subscriber's high-water mark, which only the subscriber sees (a gap).
        self.dropped = 0
        self._closed = False
        # Replay clients waiting for a snapshot (the cache's thread builds it
        # at its next flush), and snapshots built for the replay thread to send.
        self._snapshot_clients: List[bytes] = []
        self._snapshots_out: deque = deque()
        self._thread = None
        if self._replay is not None:
            self._thread = threading.Thread(
                target=self._serve_replays, name="radixkv-kv-events-replay", daemon=True
            )
            self._thread.start()

    # -- sockets ---------------------------------------------------------------------

    @classmethod
    def _open(cls, sock, endpoint: str, name: str, zmq, bind: Optional[bool] = None) -> str:
        if bind is None:
            bind = (
                "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
            )
        if bind:
            return cls._bind(sock, endpoint, name, zmq)
        try:
            sock.connect(endpoint)
        except zmq.ZMQError as e:
            raise ValueError(f"{name}={endpoint!r}: cannot connect: {e}") from None
        return endpoint

    @staticmethod
    def _bind(sock, endpoint: str, name: str, zmq) -> str:
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as e:
            raise OSError(f"{name}={endpoint!r}: cannot bind: {e}") from None
        return sock.getsockopt(zmq.LAST_ENDPOINT).decode()

    def _close_sockets(self, *socks) -> None:
        """Closes `socks` (None for one never opened), then the context if it is ours."""
        for sock in socks:
            if sock is not None:
                sock.close(linger=1000)  # what was sent reaches connected subscribers
        if self._own_ctx:
            self._ctx.term()

    def _serve_replays(self) -> None:
        # The replay socket is this thread's alone; the kept batches are
        # copied under the lock (their bytes are never changed).
        zmq, sock = self._zmq, self._replay
        if sock is None:
            raise RuntimeError("the replay thread needs the replay socket (replay_endpoint)")
        while not self._closed:
            while self._snapshots_out:
                clients, seq_bytes, payload = self._snapshots_out.popleft()
                for client in clients:
                    sock.send_multipart((client, b"", self._topic, seq_bytes, payload))
                    sock.send_multipart((client, b"", b"", self.END_SEQ, b""))
            if not sock.poll(20):
                continue
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:
                continue
            if len(frames) != 3 or len(frames[2]) != 8:
                continue  # not a replay request: [client, b"", start seq]
            client, _, start = frames
            if start == SNAPSHOT_REQUEST:
                with self._lock:
                    self._snapshot_clients.append(client)
                continue
            if start == STATUS_REQUEST:
                status = packed_batch(time.time(), [], self.data_parallel_rank, self.epoch)
                seq_bytes = self._next_seq.to_bytes(8, "big")  # (an int, whole under the GIL)
                sock.send_multipart((client, b"", self._topic, seq_bytes, status))
                sock.send_multipart((client, b"", b"", self.END_SEQ, b""))
                continue
            first = int.from_bytes(start, "big")
            with self._lock:
                kept = list(self._buffer)
            for seq_bytes, payload in kept:
                if int.from_bytes(seq_bytes, "big") >= first:
                    sock.send_multipart((client, b"", self._topic, seq_bytes, payload))
            sock.send_multipart((client, b"", b"", self.END_SEQ, b""))

    # -- publishing -------------------------------------------------------------------

    def publish(self, events: List[KVEvent]) -> Optional[int]:
        """Sends one batch of `events`, stamped now with this publisher's
        data parallel rank. Returns its sequence number, or None when ZeroMQ
        refused it (counted in `dropped`; the number stays used, so
        subscribers see the gap)."""
        if not isinstance(events, (list, tuple)):
            raise TypeError(f"events must be a list of KV events, got {type(events).__name__}")
        if self._closed:
            raise RuntimeError("the EventPublisher is closed")
        payload = encode_batch(
            KVEventBatch(time.time(), events, self.data_parallel_rank, self.epoch)
        )
        return self._send(payload)

    def publish_packed(self, events: Sequence[bytes]) -> Optional[int]:
        """`publish` for events already in msgpack (`pack_event`, or a cache's
        own): the same batch on the wire, numbered, kept and counted as
        `publish`'s."""
        if not isinstance(events, (list, tuple)):
            raise TypeError(f"events must be a list of bytes, got {type(events).__name__}")
        if self._closed:
            raise RuntimeError("the EventPublisher is closed")
        return self._send(packed_batch(time.time(), events, self.data_parallel_rank, self.epoch))

    def snapshot_payload(self, events: Sequence[bytes]) -> KVSnapshot:
        """A snapshot of packed BlockStored `events` (every block the cache
        holds, after its last batch went out) as this publisher's batch,
        covering every batch numbered below `next_seq`."""
        seq = self._next_seq  # (read once: an int, whole under the GIL)
        payload = packed_batch(time.time(), events, self.data_parallel_rank, self.epoch)
        return KVSnapshot(self.epoch, seq, payload)

    @property
    def snapshot_wanted(self) -> bool:
        """Whether replay clients wait for a snapshot (the next
        `send_snapshot` answers them)."""
        return bool(self._snapshot_clients)

    def send_snapshot(self, snapshot: KVSnapshot) -> int:
        """Answers the replay clients waiting for a snapshot with `snapshot`
        (sent by the replay thread); returns how many were waiting."""
        with self._lock:
            clients, self._snapshot_clients = self._snapshot_clients, []
        if clients:
            self._snapshots_out.append((clients, snapshot.seq.to_bytes(8, "big"), snapshot.payload))
        return len(clients)

    def _send(self, payload: bytes) -> Optional[int]:
        with self._lock:
            if self._closed:
                raise RuntimeError("the EventPublisher is closed")
            seq = self._next_seq
            self._next_seq += 1
            seq_bytes = seq.to_bytes(8, "big")
            self._buffer.append((seq_bytes, payload))
            try:
                self._pub.send_multipart((self._topic, seq_bytes, payload), self._zmq.NOBLOCK)
            except self._zmq.Again:
                self.dropped += 1
                return None
        return seq

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def next_seq(self) -> int:
        """The sequence number the next batch will get."""
        return self._next_seq

    def close(self) -> None:
        """Stops the replay thread and closes the sockets."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            self._close_sockets(self._pub, self._replay)

    def __enter__(self) -> "EventPublisher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
