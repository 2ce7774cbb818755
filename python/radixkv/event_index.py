"""A router's view of one KV events publisher: the blocks each medium holds,
kept exact across lost batches and publisher restarts.

A router that follows an engine's events loses track when a batch is lost (a
subscriber slower than the socket's high-water mark) or when the engine
restarts (its cache is empty again, its batches are numbered from 0 again).
`EventIndex` applies batches in order and notices both: a number other than
the next one within an epoch is a gap, another epoch is a restart. After a
gap it asks the publisher's replay socket for a snapshot (every block the
cache's tiers hold, as one batch covering every batch below a number), puts
it in place of what it had, and goes on from that number, dropping the
batches the snapshot covers. The snapshot is made on the engine's thread at
its next flush of events (once per scheduling round). After a restart it
first asks the replay socket for the new publisher's kept batches: when they
reach back to its first,
what they add up to is its state, with no wait for the engine (a publisher
restarted recently keeps them all); only when they do not is a snapshot
asked for.

A restarted engine may send nothing the index receives: a burst before the
subscriber reconnected, then nothing while it is idle. So the index does not
wait for traffic: whenever its subscriber connects (at first, and after
every reconnect: a publisher restarted) it asks the replay socket for the
publisher's status (its epoch and next batch number, answered by the replay
thread at once), and again a second later, once the subscription has surely
reached the publisher. Another epoch is a restart; the same one with batches
the index has not had fetches them from the replay socket. A status request
that gets no answer within a second (a publisher gone again) is let go: the
next connection asks again.

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

import math
import time
from typing import Dict, List, Optional, Set, Tuple

from radixkv._checks import as_seconds
from radixkv.events import (
    SNAPSHOT_REQUEST,
    STATUS_REQUEST,
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
    `replay_endpoint` (its replay socket) for snapshots, kept batches and
    its status. `blocks[medium]` is the set of block hashes on each medium
    ("GPU", "CPU_PINNED", "DISK"). `poll()` applies what has arrived and
    checks the publisher when the subscriber (re)connected; `epoch` and
    `next_seq` say where the index is; `gaps`, `restarts` and `resyncs`
    (states put in place, from a snapshot or from kept batches) count what
    happened. Not thread-safe: one thread polls. Usable as a context
    manager."""

    # A connection is checked again this long after it was made: batches the
    # publisher sent before the subscription reached it were not received.
    RECHECK_S = 1.0
    # The longest wait for a status answer (the replay thread answers at once).
    STATUS_TIMEOUT_S = 1.0

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
        # (a ZeroMQ poll takes int milliseconds)
        resync_timeout_s = as_seconds(
            resync_timeout_s, "resync_timeout_s", positive=True, below=2**31 / 1000
        )
        self._zmq = zmq
        self._own_ctx = context is None
        self._ctx = zmq.Context() if context is None else context
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
        # Each connection of the subscriber (the first, and each reconnect).
        self._monitor = self._sub.get_monitor_socket(zmq.EVENT_CONNECTED)
        self._sub.connect(endpoint)
        self._poller = zmq.Poller()
        self._poller.register(self._sub, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._check_at: Optional[float] = None  # when to check the publisher again
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
        for the first; returns how many were applied. When the subscriber
        has connected since (a publisher started or restarted), checks the
        publisher first (`check_publisher`), and once more `RECHECK_S`
        later."""
        zmq, n = self._zmq, 0
        end = time.monotonic() + timeout_ms / 1000
        while True:
            now = time.monotonic()
            if self._check_at is not None and now >= self._check_at:
                self._check_at = None
                self.check_publisher()
            wait = 0.0 if n else end - now
            if self._check_at is not None:
                wait = min(wait, self._check_at - now)
            ready = dict(self._poller.poll(max(0, math.ceil(wait * 1000))))
            if self._monitor in ready and self._connected():
                self.check_publisher()
                self._check_at = time.monotonic() + self.RECHECK_S
            if self._sub in ready:
                frames = self._sub.recv_multipart(zmq.NOBLOCK)
                if len(frames) == 3:
                    _, seq_bytes, payload = frames
                    n += self.receive(int.from_bytes(seq_bytes, "big"), payload)
            elif not ready and (n or time.monotonic() >= end):
                return n

    def _connected(self) -> bool:
        """Whether the subscriber connected since the last call (reads the
        monitor's events)."""
        from zmq.utils.monitor import recv_monitor_message

        connected = False
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor, self._zmq.NOBLOCK)
            connected |= event["event"] == self._zmq.EVENT_CONNECTED
        return connected

    def check_publisher(self) -> None:
        """Asks the replay socket for the publisher's epoch and next batch
        number and catches up at once, without waiting for its next batch:
        another epoch (or, without epochs, a number below the index's) is a
        restart, whose state is put in place (`restarts`, `resyncs`); the
        same epoch with batches the index has not had fetches them. Nothing
        to do for an index that has applied nothing while the publisher has
        sent nothing, or for a publisher that does not answer the request
        (within `STATUS_TIMEOUT_S`, or at all)."""
        wait_ms = min(self._resync_timeout_ms, int(self.STATUS_TIMEOUT_S * 1000))
        try:
            got = self._ask(STATUS_REQUEST, "status", wait_ms)
        except ResyncTimeout:
            return  # gone again: its next connection asks again
        if not got:
            return  # a replay socket that took it for a start number
        next_seq, payload = got[-1]
        epoch = decode_batch(payload).epoch
        if self.next_seq is None:
            if next_seq:
                self._restart(epoch, next_seq)
            return
        if epoch != self.epoch or (epoch is None and next_seq < self.next_seq):
            self.restarts += 1
            self._restart(epoch, next_seq)
        elif next_seq > self.next_seq:
            self._fetch(self.next_seq, next_seq)

    def _restart(self, epoch: Optional[int], upto: int) -> None:
        """Puts a new publisher's state in place (its batches below `upto`
        at least): from its kept batches when they reach back to its first,
        else from a snapshot."""
        if not self._rebuild(epoch, upto):
            self.resync()

    def _rebuild(self, epoch: Optional[int], upto: int) -> bool:
        """Replaces the state with what the publisher's kept batches add up
        to, when they are its batches from 0 on, all of `epoch` and at least
        `upto` of them (none for a publisher that has sent none); False,
        changing nothing, when they are not."""
        got = self._ask((0).to_bytes(8, "big"), "replay")
        batches = [(seq, decode_batch(payload)) for seq, payload in got]
        if len(batches) < upto or any(
            seq != i or batch.epoch != epoch for i, (seq, batch) in enumerate(batches)
        ):
            return False
        disk = self.blocks.get(MEDIUM_DISK, set())
        self.blocks = {MEDIUM_DISK: disk} if disk else {}
        for _, batch in batches:
            apply_events(self.blocks, batch.events)
        self.epoch, self.next_seq = epoch, len(batches)
        self._just_synced = True
        self.resyncs += 1
        return True

    def _fetch(self, start: int, upto: int) -> None:
        """Applies the batches from `start` (the index's next) to `upto` (at
        least) that the replay socket keeps; a resync when it no longer keeps
        them all."""
        got = self._ask(start.to_bytes(8, "big"), "replay")
        if not got or got[0][0] != start or got[-1][0] + 1 < upto:
            self.resync()
            return
        for seq, payload in got:
            batch = decode_batch(payload)
            if seq != self.next_seq or batch.epoch != self.epoch:
                self.resync()
                return
            self._apply(seq, batch)
        # The subscriber may yet receive them: they are covered, as a
        # snapshot's are, even from a publisher without an epoch.
        self._just_synced = True

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
        if self.next_seq is not None and (batch.epoch != self.epoch or seq < self.next_seq):
            self._restart(batch.epoch, seq)  # a new publisher: its batches up to this one
        else:
            self.resync()
        if batch.epoch == self.epoch and seq == self.next_seq:
            return self._apply(seq, batch)
        return 0

    def resync(self) -> None:
        """Replaces the state with a snapshot of the publisher's blocks."""
        got = self._ask(SNAPSHOT_REQUEST, "snapshot")
        if not got:
            raise ResyncTimeout(f"{self._replay_endpoint} answered without a snapshot")
        seq, payload = got[-1]
        snapshot = decode_batch(payload)
        disk = self.blocks.get(MEDIUM_DISK, set())
        self.blocks = {MEDIUM_DISK: disk} if disk else {}
        apply_events(self.blocks, snapshot.events)
        self.epoch, self.next_seq = snapshot.epoch, seq
        self._just_synced = True
        self.resyncs += 1

    def _ask(
        self, request: bytes, what: str, wait_ms: Optional[int] = None
    ) -> List[Tuple[int, bytes]]:
        """Sends `request` (a start number, or a request for a snapshot or
        the status) to the replay socket; returns the (number, payload) of
        each batch of the answer, up to its end marker. Raises
        ResyncTimeout when nothing comes for `wait_ms` (None: the resync
        timeout)."""
        zmq = self._zmq
        wait_ms = self._resync_timeout_ms if wait_ms is None else wait_ms
        sock = self._ctx.socket(zmq.DEALER)
        got: List[Tuple[int, bytes]] = []
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self._replay_endpoint)
            sock.send_multipart((b"", request))
            while True:
                if not sock.poll(wait_ms):
                    made = " (it is made at the engine's next flush of events)"
                    raise ResyncTimeout(
                        f"no {what} from {self._replay_endpoint} within "
                        f"{wait_ms / 1000:g} s{made if what == 'snapshot' else ''}"
                    )
                frames = sock.recv_multipart()
                if len(frames) != 4:
                    continue
                _, _, seq_bytes, payload = frames
                if seq_bytes == EventPublisher.END_SEQ:
                    return got
                got.append((int.from_bytes(seq_bytes, "big"), payload))
        finally:
            sock.close()

    def _apply(self, seq: int, batch: KVEventBatch) -> int:
        apply_events(self.blocks, batch.events)
        self.next_seq = seq + 1
        self._just_synced = False
        self.applied += 1
        return 1

    def view(self) -> Dict[str, Set[int]]:
        """The blocks per medium, empty media left out."""
        return _view(self.blocks)

    # -- closing ----------------------------------------------------------------

    def close(self) -> None:
        self._sub.disable_monitor()
        self._monitor.close(linger=0)
        self._sub.close(linger=0)
        if self._own_ctx:
            self._ctx.term()

    def __enter__(self) -> "EventIndex":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def apply_events(blocks: Dict[str, Set[int]], events) -> None:
    """Applies `events` to `blocks` (the block hashes per medium): the one
    reading of a batch, for the index's batches and snapshots and for
    `snapshot_view`."""
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
    return _view(blocks)


def _view(blocks: Dict[str, Set[int]]) -> Dict[str, Set[int]]:
    """A copy of `blocks`, empty media left out."""
    return {medium: set(hashes) for medium, hashes in blocks.items() if hashes}
