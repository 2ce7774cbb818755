"""The blocks each tier of a CacheManager holds, told as KV events.

The tree returns slots, not blocks: eviction gives back the freed slots, a
copy between tiers names its slots. This ledger keeps, per tier, the block
in each cached page and turns every change the manager applies into
BlockStored / BlockRemoved events, so a consumer replaying them holds exactly
the blocks of each tier: a block is announced stored on a medium once while
it is there (but for a medium change: a device eviction of a block the host
still holds is followed by its BlockStored on CPU_PINNED again), and removed
from it only after it was announced stored. It
exists only when the manager was given a publisher
(`CacheManager(kv_events=...)`).

The device and host tiers' blocks live natively (`_core.BlockLedger`,
cpp/include/radixkv/block_ledger.h): a row per pool page with the block
hash, its parent's hash, its 32-byte page key and its tokens. Each change the
manager applies is one native call that checks it and copies what it reads;
the ledger's own thread then hashes the new pages, records them and packs
the event as msgpack, in order (a flush waits for it). A backup or a load
copies rows from one tier to the other, an eviction reads the hashes of the
freed pages and clears them. An insert below cached pages continues the key chain from its
parent's stored key instead of hashing the prefix again. The rows are
allocated zeroed (the memory is touched only as pages are used): per page,
56 bytes and 4 bytes a token.

The storage tier's pages are announced once each ("DISK"), when a write to
the store finishes with the page there (written, or found there already);
the store does not report its own removals (FileStorage's `max_bytes`
trimming, corrupt pages it drops), and a reset leaves it as it is, so DISK
blocks are never announced removed.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import List, Optional, Tuple, Union

import numpy as np
import torch

from radixkv import _core
from radixkv.scheduler.namespaces import Namespaces
from radixkv.events import MEDIUM_DISK, EventPublisher, KVSnapshot

# Events queued beyond this are published without waiting for the round's end,
# so an engine that never calls a per-round method does not grow the queue.
MAX_PENDING_EVENTS = 4096
# DISK blocks remembered as announced (the store does not report removals).
DISK_MEMORY = 1 << 18


def block_dtype(page_size: int) -> np.dtype:
    """A block as one row: its hash, its parent's hash (where `has_parent`;
    a sequence's first page has none), its tokens and its page key."""
    return np.dtype(
        [
            ("hash", "<u8"),
            ("parent", "<u8"),
            ("has_parent", "?"),
            ("tokens", "<i4", (page_size,)),
            ("key", "u1", (32,)),
        ]
    )


class BlockEvents:
    """Blocks per tier and the events not yet published, for one CacheManager.

    The blocks of the device and host tiers live in `_core.BlockLedger`,
    which hashes, records and packs each change in one native call; the DISK
    blocks (announced once each, from the storage tier's own rows) and the
    publishing stay here."""

    on = True  # (NoEvents: False)

    def __init__(
        self,
        publisher: EventPublisher,
        page_size: int,
        seed: Optional[bytes],
        num_pages: int,
        host_num_pages: int = 0,
        namespaces: Optional[Namespaces] = None,
    ):
        self.publisher = publisher
        self.page_size = page_size
        self.seed = seed
        # Cache namespaces enter the hashes through their seeds (as they do the
        # storage keys): equal tokens of two namespaces are two blocks.
        self.namespaces = namespaces if namespaces is not None else Namespaces()
        self.dtype = block_dtype(page_size)
        self.ledger = _core.BlockLedger(num_pages, host_num_pages, page_size, threaded=True)
        # Hashes announced on DISK, the most recent DISK_MEMORY of them (one
        # older than that may be announced again: a duplicate, never a loss).
        self.disk: "OrderedDict[int, None]" = OrderedDict()
        # DISK events not published yet, each already msgpack; the ledger
        # holds the device and host tiers' own until a flush takes them.
        self.pending: List[bytes] = []

    @property
    def lora_id(self) -> Optional[int]:
        return self.ledger.lora_id

    @lora_id.setter
    def lora_id(self, value: Optional[int]) -> None:
        self.ledger.lora_id = value

    # -- blocks ---------------------------------------------------------------------

    def blocks(self, tokens: np.ndarray, first_page: int, ns: int = 0) -> np.ndarray:
        """The blocks (rows of `block_dtype`) of the whole pages of `tokens`
        (int32, in namespace `ns`) from `first_page` on, the key chain hashed
        from the first page (a page's key covers its prefix): the storage
        tier's rows for what it writes."""
        ps = self.page_size
        n = len(tokens) // ps
        first_page = min(first_page, n)
        chain = _core.page_keys(tokens[: n * ps], ps, self.namespaces.seed(ns, self.seed), True)
        raw = chain[first_page * 32 :]
        prev = (
            int(_block_hashes(chain[first_page * 32 - 32 : first_page * 32])[0])
            if first_page
            else None
        )
        rows = np.empty(n - first_page, dtype=self.dtype)
        rows["key"] = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 32)
        rows["hash"] = _block_hashes(raw)
        rows["parent"][1:] = rows["hash"][:-1]
        rows["has_parent"] = True
        if len(rows):
            rows[0]["parent"] = prev or 0
            rows[0]["has_parent"] = prev is not None
        rows["tokens"] = tokens[first_page * ps : n * ps].reshape(-1, ps)
        return rows

    # -- events -----------------------------------------------------------------------

    def _stored(self, blocks: np.ndarray, medium: str) -> None:
        """One BlockStored per chain of consecutive blocks."""
        n = len(blocks)
        if n == 0:
            return
        hashes = blocks["hash"]
        linked = blocks["has_parent"][1:] & (blocks["parent"][1:] == hashes[:-1])
        cuts = [0, *(np.flatnonzero(~linked) + 1).tolist(), n]
        self.pending += self.ledger.take_events()  # the events keep their order
        for a, b in zip(cuts, cuts[1:]):
            first = blocks[a]
            parent = int(first["parent"]) if first["has_parent"] else None
            self.pending.append(
                _core.pack_block_stored(
                    hashes[a:b],
                    parent,
                    blocks["tokens"][a:b],
                    self.page_size,
                    self.lora_id,
                    medium,
                )
            )
        self._bound()

    def _bound(self) -> None:
        if len(self.pending) + self.ledger.pending < MAX_PENDING_EVENTS:
            return
        # A threaded ledger's count runs ahead of its events (by a change
        # under way, or one that packs none): count the events themselves.
        self.pending += self.ledger.take_events()
        if len(self.pending) >= MAX_PENDING_EVENTS:
            self.flush()

    def flush(self) -> int:
        """Publishes the pending events as one batch (several of at most
        MAX_PENDING_EVENTS when calls went past it); returns how many. Once
        the publisher is closed (its creator's call: a shutdown in any order)
        the events have nowhere to go and are dropped; the manager goes on.
        Then answers the replay clients that asked for a snapshot."""
        n = self._publish()
        if self.publisher.snapshot_wanted and not self.publisher.closed:
            self.publisher.send_snapshot(self.publisher.snapshot_payload(self.ledger.snapshot()))
        return n

    def snapshot(self) -> KVSnapshot:
        """Every block of the device and host tiers as BlockStored events in
        one batch, after the pending events went out (DISK blocks are not
        the tree's: the store keeps no account of its own removals)."""
        self._publish()
        return self.publisher.snapshot_payload(self.ledger.snapshot())

    def _publish(self) -> int:
        events = self.ledger.take_events()
        if self.pending:
            events, self.pending = self.pending + events, []
        if not events or self.publisher.closed:
            return 0
        # A call may add several events past the bound: no batch exceeds it.
        for i in range(0, len(events), MAX_PENDING_EVENTS):
            self.publisher.publish_packed(events[i : i + MAX_PENDING_EVENTS])
        return len(events)

    # -- the device tier ---------------------------------------------------------------

    def device_inserted(
        self,
        tokens: torch.Tensor,
        slots: torch.Tensor,
        start: int,
        end: int,
        known: int,
        ns: int = 0,
        pages: bool = False,
    ) -> None:
        """tokens[start:end) (whole pages; on the CPU; namespace `ns`) joined
        the tree on the device, with `slots[start:end)`; `slots[:known]` are
        the tree's slots of the tokens before them. Pages of a namespace
        forgotten since the request matched are not announced: no request
        can hit them any more (a name coming back gets a new id). With
        `pages` (here and below) the slots are page ids, one a page."""
        if not self.namespaces.known(ns):
            return
        seed = self.seed if ns == 0 else self.namespaces.seed(ns, self.seed)
        self.ledger.device_inserted(tokens, slots, start, end, known, seed, pages)
        self._bound()

    def announcer(self, ns: int) -> Tuple[Optional[_core.BlockLedger], Optional[bytes]]:
        """(ledger, seed) for a tree call that announces the BlockStored of
        what it caches itself (a single request's step), in namespace `ns`;
        (None, None) for a namespace forgotten since the match (see
        `device_inserted`). Then `announced()`."""
        if not self.namespaces.known(ns):
            return None, None
        return self.ledger, self.seed if ns == 0 else self.namespaces.seed(ns, self.seed)

    def announced(self) -> None:
        """A tree call announced its BlockStored (with `announcer`'s)."""
        self._bound()

    def request_cached(
        self, ids, indices, in_cache: int, handle, page_size: int, pages: bool = False
    ) -> None:
        """A request step cached the whole pages of `ids` beyond the first
        `in_cache` tokens (checked host inputs, `indices` the request's
        slots, or with `pages` its page ids, `handle` its match): their
        BlockStored."""
        n = ids.shape[0] if isinstance(ids, torch.Tensor) else len(ids)
        full = n - n % page_size
        if in_cache < full:  # (the ledger reads the host inputs as they are)
            self.device_inserted(
                ids, indices, in_cache, full, handle.cached_len, handle.namespace, pages
            )

    def device_evicted(self, slots: torch.Tensor, pages: bool = False) -> None:
        self.ledger.device_evicted(slots, pages)
        self._bound()

    def device_loaded(
        self, host_slots: torch.Tensor, device_slots: torch.Tensor, pages: bool = False
    ) -> None:
        """Pages loaded from host joined the device with `device_slots`."""
        self.ledger.device_loaded(host_slots, device_slots, pages)
        self._bound()

    # -- the host tier -----------------------------------------------------------------

    def host_backed_up(
        self,
        device_slots: torch.Tensor,
        host_slots: torch.Tensor,
        rejected: torch.Tensor,
        pages: bool = False,
    ) -> None:
        """A backup landed: the pages of `host_slots` not in `rejected` are the
        host copies of the device pages at the same positions."""
        self.ledger.host_backed_up(device_slots, host_slots, rejected, pages)
        self._bound()

    def host_evicted(self, slots: torch.Tensor, pages: bool = False) -> None:
        self.ledger.host_evicted(slots, pages)
        self._bound()

    def host_inserted(
        self,
        tokens: torch.Tensor,
        start: int,
        host_slots: torch.Tensor,
        rejected: torch.Tensor,
        ns: int = 0,
    ) -> None:
        """Pages read from storage joined the tree: `host_slots` hold
        tokens[start:) of namespace `ns`, those in `rejected` were not taken.
        Pages of a namespace forgotten meanwhile are not announced (nor, as
        they are never recorded, ever removed)."""
        if not self.namespaces.known(ns):
            return
        seed = self.namespaces.seed(ns, self.seed)
        self.ledger.host_inserted(tokens, start, host_slots, rejected, seed)
        self._bound()

    # -- the storage tier --------------------------------------------------------------

    def disk_stored(self, blocks: np.ndarray) -> None:
        """`blocks` are in the store: announce those not announced yet."""
        disk = self.disk
        new = np.array([h not in disk for h in blocks["hash"].tolist()], dtype=bool)
        blocks = blocks[new]
        for h in blocks["hash"].tolist():
            disk[h] = None
        while len(disk) > DISK_MEMORY:
            disk.popitem(last=False)
        self._stored(blocks, MEDIUM_DISK)

    # -- reset ---------------------------------------------------------------------------

    def reset(self) -> None:
        """The device and host tiers were emptied: the host blocks are
        removed one by one, the device's by AllBlocksCleared."""
        self.ledger.reset()
        self._bound()


class NoEvents:
    """KV events off (`CacheManager(kv_events=None)`): BlockEvents' calls,
    each doing nothing, so the tiers tell their changes without asking
    whether anyone listens."""

    publisher: Optional[EventPublisher] = None
    on = False

    def flush(self) -> int:
        return 0

    def snapshot(self) -> KVSnapshot:
        raise RuntimeError("kv_snapshot needs KV events (CacheManager(kv_events=...))")

    def device_inserted(
        self, tokens, slots, start: int, end: int, known: int, ns: int = 0, pages: bool = False
    ):
        pass

    def device_evicted(self, slots: torch.Tensor, pages: bool = False) -> None:
        pass

    def request_cached(
        self, ids, indices, in_cache: int, handle, page_size: int, pages: bool = False
    ) -> None:
        pass

    def announcer(self, ns: int) -> Tuple[None, None]:
        return None, None

    def announced(self) -> None:
        pass

    def device_loaded(self, host_slots, device_slots, pages: bool = False) -> None:
        pass

    def host_backed_up(self, device_slots, host_slots, rejected, pages: bool = False) -> None:
        pass

    def host_evicted(self, slots: torch.Tensor, pages: bool = False) -> None:
        pass

    def host_inserted(self, tokens, start: int, host_slots, rejected, ns: int = 0) -> None:
        pass

    def disk_stored(self, blocks: np.ndarray) -> None:
        pass

    def reset(self) -> None:
        pass


Events = Union[BlockEvents, NoEvents]
"""A manager's KV-event ledger, on or off."""


def _block_hashes(keys: bytes) -> np.ndarray:
    """The block hashes (uint64) of concatenated 32-byte page keys: each
    key's last 8 bytes, big-endian (radixkv.events.block_hash)."""
    return np.frombuffer(keys, dtype=">u8")[3::4].astype(np.uint64)
