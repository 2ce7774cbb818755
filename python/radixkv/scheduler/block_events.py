"""The blocks each tier of a CacheManager holds, told as KV events.

The tree returns slots, not blocks: eviction gives back the freed slots, a
copy between tiers names its slots. This ledger keeps, per tier, the block
in each cached page and turns every change the manager applies into
BlockStored / BlockRemoved events, so a consumer replaying them holds exactly
the blocks of each tier: a block is announced stored on a medium once while
it is there, and removed from it only after it was announced stored. It
exists only when the manager was given a publisher
(`CacheManager(kv_events=...)`).

A tier's blocks are a structured array indexed by page number (the pool's
pages), a row per page: the block hash, its parent's hash, its tokens and
its 32-byte page key, and beside it whether the page holds a block. Every
update is a few vectorized numpy operations per call, not a Python object
per page: a backup or a load copies rows from one tier's array to the
other's, an eviction reads the hashes of the freed pages and clears them.
An insert below cached pages continues the key chain from its parent's
stored key instead of hashing the prefix again. The arrays are allocated
zeroed (the memory is touched only as pages are used): per page, 50 bytes
and 4 bytes a token.

The storage tier's pages are announced once each ("DISK"), when a write to
the store finishes with the page there (written, or found there already);
the store does not report its own removals (FileStorage's `max_bytes`
trimming, corrupt pages it drops), and a reset leaves it as it is, so DISK
blocks are never announced removed.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import List, Optional, Tuple

import numpy as np
import torch

from radixkv import _core
from radixkv.scheduler.namespaces import Namespaces
from radixkv.events import (
    ALL_BLOCKS_CLEARED,
    MEDIUM_CPU_PINNED,
    MEDIUM_DISK,
    MEDIUM_GPU,
    EventPublisher,
)

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


class TierBlocks:
    """The block in each page of one pool: `rows[page]`, valid where
    `present[page]`."""

    def __init__(self, num_pages: int, page_size: int):
        self.present = np.zeros(num_pages, dtype=bool)
        self.rows = np.zeros(num_pages, dtype=block_dtype(page_size))

    def put(self, pages: np.ndarray, blocks: np.ndarray) -> None:
        self.present[pages] = True
        self.rows[pages] = blocks

    def get(self, pages: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """Which of `pages` hold a block (a mask), and their blocks in order."""
        held = self.present[pages]
        return held, self.rows[pages[held]]

    def remove(self, pages: np.ndarray) -> np.ndarray:
        """Clears `pages`; returns the hashes (uint64) of those that held a block."""
        pages = pages[self.present[pages]]
        self.present[pages] = False
        return self.rows["hash"][pages]

    def hashes(self) -> np.ndarray:
        return self.rows["hash"][self.present]

    def clear(self) -> None:
        self.present[:] = False


class BlockEvents:
    """Blocks per tier and the events not yet published, for one CacheManager."""

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
        self.lora_id: Optional[int] = None
        self.dtype = block_dtype(page_size)
        self.device = TierBlocks(num_pages, page_size)
        self.host = TierBlocks(host_num_pages, page_size)
        # Hashes announced on DISK, the most recent DISK_MEMORY of them (one
        # older than that may be announced again: a duplicate, never a loss).
        self.disk: "OrderedDict[int, None]" = OrderedDict()
        # The events not published yet, each already msgpack (packed natively).
        self.pending: List[bytes] = []

    # -- blocks ---------------------------------------------------------------------

    def blocks(
        self, tokens: np.ndarray, first_page: int, parent_page: int = -1, ns: int = 0
    ) -> np.ndarray:
        """The blocks (rows of `block_dtype`) of the whole pages of `tokens`
        (int32, in namespace `ns`) from `first_page` on. The key chain is
        hashed from the first page (a page's key covers its prefix), or
        continued from the device block in `parent_page` (the block of page
        `first_page - 1`) when it holds one."""
        ps = self.page_size
        n = len(tokens) // ps
        first_page = min(first_page, n)
        dev = self.device
        if parent_page >= 0 and dev.present[parent_page]:
            parent = dev.rows[parent_page]
            raw = _core.page_keys(
                tokens[first_page * ps : n * ps], ps, parent["key"].tobytes(), True
            )
            prev: Optional[int] = int(parent["hash"])
        else:
            seed = self.namespaces.seed(ns, self.seed)
            chain = _core.page_keys(tokens[: n * ps], ps, seed, True)
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

    def _pages(self, slots) -> np.ndarray:
        """The pages of whole-page slots (a CPU tensor or an array)."""
        if isinstance(slots, torch.Tensor):
            slots = slots.numpy()
        return slots[:: self.page_size] // self.page_size

    # -- events -----------------------------------------------------------------------

    def _stored(self, blocks: np.ndarray, medium: str) -> None:
        """One BlockStored per chain of consecutive blocks."""
        n = len(blocks)
        if n == 0:
            return
        hashes = blocks["hash"]
        linked = blocks["has_parent"][1:] & (blocks["parent"][1:] == hashes[:-1])
        cuts = [0, *(np.flatnonzero(~linked) + 1).tolist(), n]
        for a, b in zip(cuts, cuts[1:]):
            first = blocks[a]
            parent = int(first["parent"]) if first["has_parent"] else None
            self._add(
                _core.pack_block_stored(
                    hashes[a:b],
                    parent,
                    blocks["tokens"][a:b],
                    self.page_size,
                    self.lora_id,
                    medium,
                )
            )

    def _add(self, event: bytes) -> None:
        self.pending.append(event)
        if len(self.pending) >= MAX_PENDING_EVENTS:
            self.flush()

    def flush(self) -> int:
        """Publishes the pending events as one batch; returns how many. Once
        the publisher is closed (its creator's call: a shutdown in any order)
        the events have nowhere to go and are dropped; the manager goes on."""
        n = len(self.pending)
        if n:
            events, self.pending = self.pending, []
            if self.publisher.closed:
                return 0
            self.publisher.publish_packed(events)
        return n

    # -- the device tier ---------------------------------------------------------------

    def device_inserted(
        self,
        tokens: torch.Tensor,
        slots: torch.Tensor,
        start: int,
        end: int,
        known: int,
        ns: int = 0,
    ) -> None:
        """tokens[start:end) (whole pages; int32 on the CPU; namespace `ns`)
        joined the tree on the device, with `slots[start:end)`; `slots[:known]`
        are the tree's slots of the tokens before them. Pages of a namespace
        forgotten since the request matched are not announced: no request
        can hit them any more (a name coming back gets a new id)."""
        if not self.namespaces.known(ns):
            return
        ps = self.page_size
        ids, slot_ids = np.asarray(tokens.numpy(), dtype=np.int32), slots.numpy()
        parent_page = int(slot_ids[start - ps]) // ps if 0 < start <= known else -1
        blocks = self.blocks(ids[:end], start // ps, parent_page, ns)
        if len(blocks) == 0:
            return
        self.device.put(slot_ids[start:end:ps] // ps, blocks)
        first = blocks[0]
        parent = int(first["parent"]) if first["has_parent"] else None
        self._add(
            _core.pack_block_stored(
                blocks["hash"], parent, ids[start:end], ps, self.lora_id, MEDIUM_GPU
            )
        )

    def device_evicted(self, slots: torch.Tensor) -> None:
        hashes = self.device.remove(self._pages(slots))
        if len(hashes):
            self._add(_core.pack_block_removed(hashes, MEDIUM_GPU))

    def device_loaded(self, host_slots: torch.Tensor, device_slots: torch.Tensor) -> None:
        """Pages loaded from host joined the device with `device_slots`."""
        held, blocks = self.host.get(self._pages(host_slots))
        self.device.put(self._pages(device_slots)[held], blocks)
        self._stored(blocks, MEDIUM_GPU)

    # -- the host tier -----------------------------------------------------------------

    def host_backed_up(
        self, device_slots: torch.Tensor, host_slots: torch.Tensor, rejected: torch.Tensor
    ) -> None:
        """A backup landed: the pages of `host_slots` not in `rejected` are the
        host copies of the device pages at the same positions."""
        dp, hp = self._pages(device_slots), self._pages(host_slots)
        if len(rejected):
            taken = ~np.isin(hp, self._pages(rejected))
            dp, hp = dp[taken], hp[taken]
        held, blocks = self.device.get(dp)
        self.host.put(hp[held], blocks)
        self._stored(blocks, MEDIUM_CPU_PINNED)

    def host_evicted(self, slots: torch.Tensor) -> None:
        hashes = self.host.remove(self._pages(slots))
        if len(hashes):
            self._add(_core.pack_block_removed(hashes, MEDIUM_CPU_PINNED))

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
        hp = self._pages(host_slots)
        blocks = self.blocks(tokens.to(torch.int32).numpy(), start // self.page_size, -1, ns)
        if len(rejected):
            taken = ~np.isin(hp, self._pages(rejected))
            hp, blocks = hp[taken], blocks[taken]
        self.host.put(hp, blocks)
        self._stored(blocks, MEDIUM_CPU_PINNED)

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
        hashes = self.host.hashes()
        if len(hashes):
            self._add(_core.pack_block_removed(hashes, MEDIUM_CPU_PINNED))
        self._add(ALL_BLOCKS_CLEARED)
        self.device.clear()
        self.host.clear()


def _block_hashes(keys: bytes) -> np.ndarray:
    """The block hashes (uint64) of concatenated 32-byte page keys: each
    key's last 8 bytes, big-endian (radixkv.events.block_hash)."""
    return np.frombuffer(keys, dtype=">u8")[3::4].astype(np.uint64)
