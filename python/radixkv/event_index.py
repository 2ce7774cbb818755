"""A router's view of one KV events publisher: the blocks each medium holds,
kept exact across lost batches and publisher restarts.

A router that follows an engine's events loses track when a batch is lost (a
subscriber slower than the socket's high-water mark) or when the engine
restarts (its cache is empty again, its batches are numbered from 0 again).
`EventIndex` applies batches in order and notices both: a number other than
the next one within an epoch is a gap, another epoch is a restart. Either
way it asks the publisher's replay socket for a snapshot (every block the
cache's tiers hold, as one batch covering every batch below a number), puts
it in place of what it had, and goes on from that number, dropping the
batches the snapshot covers. The snapshot is made on the engine's thread at
its next flush of events (once per scheduling round).

A publisher without an epoch (`EventPublisher(epoch=False)`) restarts
unseen but for its numbers going back. Right after a snapshot, batches
numbered below it are taken as the ones it covers; once a batch after it
was applied, a number going back is a restart. (A restart within that
window is seen at the next gap.) An epoch given as an int must differ for
each incarnation: two with one epoch are one publisher to the index.

DISK blocks are not in a snapshot (the store keeps no account of its own
removals); an index keeps the DISK blocks it was told of across a resync.
"""

from __future__ import annotations

from typing import Dict, Optional, Set

from radixkv._checks import as_seconds
from radixkv.events import (
    SNAPSHOT_REQUEST,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventPublisher,
    KVEventBatch,
    MEDIUM_DISK,
    MEDIUM_GPU,
    decode_batch,
)


class ResyncTimeout(TimeoutError):
    """The publisher did not answer a snapshot request in time."""


class EventIndex:
    """Follows the publisher at `endpoint` (its PUB socket) and asks
    `replay_endpoint` (its replay socket) for snapshots. `blocks[medium]` is
    the set of block hashes on each medium ("GPU", "CPU_PINNED", "DISK").
    `poll()` applies what has arrived; `epoch` and `next_seq` say where the
    index is; `gaps`, `restarts` and `resyncs` count what happened. Not
    thread-safe: one thread polls. Usable as a context manager."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str,
        *,
        topic: str = "",
        resync_timeout_s: float = 10.0,
        context=None,
    ) -> None:
        import zmq

        if not isinstance(topic, str):
            raise TypeError(f"topic must be a str, got {type(topic).__name__}")
        resync_timeout_s = as_seconds(resync_timeout_s, "resync_timeout_s", positive=True)
        if resync_timeout_s >= 2**31 / 1000:
            raise ValueError(
                f"resync_timeout_s must be > 0 and below 2**31 ms, got {resync_timeout_s!r}"
            )
        self._zmq = zmq
        self._own_ctx = context is None
        self._ctx = zmq.Context() if context is None else context
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
        self._sub.connect(endpoint)
        self._replay_endpoint = replay_endpoint
        self._resync_timeout_ms = int(resync_timeout_s * 1000)
        self.blocks: Dict[str, Set[int]] = {}
        self.epoch: Optional[int] = None
        self.next_seq: Optional[int] = None  # None: nothing applied yet
        self.gaps = self.restarts = self.resyncs = self.applied = 0
        # No batch applied since the last snapshot: batches numbered below it
        # are the ones it covers, even from a publisher without an epoch.
        self._just_synced = False

    # -- following --------------------------------------------------------------

    def poll(self, timeout_ms: int = 0) -> int:
        """Applies every batch that has arrived, waiting up to `timeout_ms`
        for the first; returns how many were applied."""
        zmq, n = self._zmq, 0
        while self._sub.poll(timeout_ms if n == 0 else 0):
            frames = self._sub.recv_multipart(zmq.NOBLOCK)
            if len(frames) != 3:
                continue
            _, seq_bytes, payload = frames
            n += self.receive(int.from_bytes(seq_bytes, "big"), payload)
        return n

    def receive(self, seq: int, payload: bytes) -> int:
        """One batch as it came (number, payload): applied in order, dropped
        if a snapshot covers it, or a resync first if it does not follow.
        Returns 1 if it was applied."""
        batch = decode_batch(payload)
        if self.next_seq is not None and batch.epoch == self.epoch:
            if seq == self.next_seq:
                return self._apply(seq, batch)
            if seq < self.next_seq and (batch.epoch is not None or self._just_synced):
                return 0  # covered by the snapshot in place
            # Later: batches were lost. Earlier without an epoch: the
            # publisher may have restarted (or the snapshot covers it).
            if seq > self.next_seq:
                self.gaps += 1
            else:
                self.restarts += 1
        elif self.next_seq is not None:
            self.restarts += 1
        elif seq == 0:
            # The first batch of a publisher: nothing came before it.
            self.epoch = batch.epoch
            return self._apply(seq, batch)
        self.resync()
        if batch.epoch == self.epoch and seq == self.next_seq:
            return self._apply(seq, batch)
        return 0

    def resync(self) -> None:
        """Replaces the state with a snapshot of the publisher's blocks."""
        zmq = self._zmq
        sock = self._ctx.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self._replay_endpoint)
            sock.send_multipart((b"", SNAPSHOT_REQUEST))
            got = None
            while True:
                if not sock.poll(self._resync_timeout_ms):
                    raise ResyncTimeout(
                        f"no snapshot from {self._replay_endpoint} within "
                        f"{self._resync_timeout_ms / 1000:g} s (it is made at the engine's next "
                        "flush of events)"
                    )
                frames = sock.recv_multipart()
                if len(frames) != 4:
                    continue
                _, _, seq_bytes, payload = frames
                if seq_bytes == EventPublisher.END_SEQ:
                    break
                got = (int.from_bytes(seq_bytes, "big"), payload)
        finally:
            sock.close()
        if got is None:
            raise ResyncTimeout(f"{self._replay_endpoint} answered without a snapshot")
        seq, payload = got
        snapshot = decode_batch(payload)
        disk = self.blocks.get(MEDIUM_DISK, set())
        self.blocks = {MEDIUM_DISK: disk} if disk else {}
        self._events(snapshot)
        self.epoch, self.next_seq = snapshot.epoch, seq
        self._just_synced = True
        self.resyncs += 1

    def _apply(self, seq: int, batch: KVEventBatch) -> int:
        self._events(batch)
        self.next_seq = seq + 1
        self._just_synced = False
        self.applied += 1
        return 1

    def _events(self, batch: KVEventBatch) -> None:
        apply_events(self.blocks, batch.events)

    def view(self) -> Dict[str, Set[int]]:
        """The blocks per medium, empty media left out."""
        return {medium: set(hashes) for medium, hashes in self.blocks.items() if hashes}

    # -- closing ----------------------------------------------------------------

    def close(self) -> None:
        self._sub.close(linger=0)
        if self._own_ctx:
            self._ctx.term()

    def __enter__(self) -> "EventIndex":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def apply_events(blocks: Dict[str, Set[int]], events) -> None:
    """Applies `events` to `blocks` (the block hashes per medium)."""
    for e in events:
        if isinstance(e, BlockStored):
            blocks.setdefault(e.medium or MEDIUM_GPU, set()).update(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            blocks.get(e.medium or MEDIUM_GPU, set()).difference_update(e.block_hashes)
        elif isinstance(e, AllBlocksCleared):
            blocks.pop(MEDIUM_GPU, None)


def snapshot_view(payload: bytes) -> Dict[str, Set[int]]:
    """The blocks per medium of a snapshot's payload (`CacheManager.kv_snapshot`)."""
    blocks: Dict[str, Set[int]] = {}
    apply_events(blocks, decode_batch(payload).events)
    return blocks
