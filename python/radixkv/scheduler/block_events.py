"""The blocks each tier of a CacheManager holds, told as KV events.

The tree returns slots, not blocks: eviction gives back the freed slots, a
copy between tiers names its slots. This ledger keeps, per tier, the block
in each cached page (keyed by the page's number in that tier's pool) and
turns every change the manager applies into BlockStored / BlockRemoved
events, so a consumer replaying them holds exactly the blocks of each tier:
every block announced as stored on a medium is announced removed from it at
most once, and only after it was announced stored. It exists only when the
manager was given a publisher (`CacheManager(kv_events=...)`).

A block is `(hash, parent hash, its tokens as int32 bytes)`, one tuple
shared by the tiers that hold the page: a backup or a load moves the same
tuple to the other tier's map, so no hash is computed twice and the tokens
are kept once. The storage tier's pages are announced once each ("DISK"),
when a write to the store finishes with the page there (written, or found
there already); the store never tells of removals, and a reset leaves it as
it is, so they are never removed.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Set, Tuple

import numpy as np
import torch

from radixkv import _core
from radixkv.events import (
    MEDIUM_CPU_PINNED,
    MEDIUM_DISK,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventPublisher,
)

Block = Tuple[int, Optional[int], bytes]  # (hash, parent hash, tokens as int32 bytes)

# Events queued beyond this are published without waiting for the round's end,
# so an engine that never calls a per-round method does not grow the queue.
MAX_PENDING_EVENTS = 4096


class BlockEvents:
    """Blocks per tier and the events not yet published, for one CacheManager."""

    def __init__(self, publisher: EventPublisher, page_size: int, seed: Optional[bytes]):
        self.publisher = publisher
        self.page_size = page_size
        self.seed = seed
        # A cache namespace (or LoRA adapter) would enter BlockStored here, and
        # into the hashes through `seed`; the tree has none yet.
        self.lora_id: Optional[int] = None
        self.device: Dict[int, Block] = {}  # device page -> its block
        self.host: Dict[int, Block] = {}    # host page -> its block
        self.disk: Set[int] = set()         # hashes announced on DISK
        self.pending: List = []

    # -- blocks ---------------------------------------------------------------------

    def blocks(self, tokens: torch.Tensor, first_page: int) -> List[Block]:
        """The blocks of `tokens`' whole pages from `first_page` on (the chain
        is hashed from the first page: a block's hash covers its prefix)."""
        ps = self.page_size
        n = len(tokens) // ps
        if first_page >= n:
            return []
        ids = tokens[:n * ps].to(torch.int32).contiguous()
        raw = _core.page_keys(ids, ps, self.seed, True)
        hashes = np.frombuffer(raw, dtype=">u8").reshape(n, 4)[:, 3].tolist()
        data = ids.numpy().tobytes()
        size = ps * 4
        return [(hashes[k], hashes[k - 1] if k else None, data[k * size:(k + 1) * size])
                for k in range(first_page, n)]

    def _pages(self, slots: torch.Tensor) -> List[int]:
        return slots[::self.page_size].div(self.page_size, rounding_mode="floor").tolist()

    # -- events -----------------------------------------------------------------------

    def _stored(self, blocks: List[Block], medium: str) -> None:
        """One BlockStored per chain of consecutive blocks."""
        start = 0
        for i in range(1, len(blocks) + 1):
            if i == len(blocks) or blocks[i][1] != blocks[i - 1][0]:
                run = blocks[start:i]
                tokens = np.frombuffer(b"".join(b[2] for b in run), dtype=np.int32).tolist()
                self._add(BlockStored([b[0] for b in run], run[0][1], tokens, self.page_size,
                                      self.lora_id, medium))
                start = i

    def _removed(self, tier: Dict[int, Block], slots: torch.Tensor, medium: str) -> None:
        hashes = []
        for page in self._pages(slots):
            block = tier.pop(page, None)
            if block is not None:
                hashes.append(block[0])
        if hashes:
            self._add(BlockRemoved(hashes, medium))

    def _add(self, event) -> None:
        self.pending.append(event)
        if len(self.pending) >= MAX_PENDING_EVENTS:
            self.flush()

    def flush(self) -> int:
        """Publishes the pending events as one batch; returns how many."""
        n = len(self.pending)
        if n:
            events, self.pending = self.pending, []
            self.publisher.publish(events)
        return n

    # -- the device tier ---------------------------------------------------------------

    def device_inserted(self, tokens: torch.Tensor, slots: torch.Tensor, start: int,
                        end: int) -> None:
        """tokens[start:end) (whole pages) joined the tree on the device, with
        `slots[start:end)`."""
        ps = self.page_size
        blocks = self.blocks(tokens[:end], start // ps)
        if not blocks:
            return
        for page, block in zip(self._pages(slots[start:end]), blocks):
            self.device[page] = block
        self._add(BlockStored([b[0] for b in blocks], blocks[0][1],
                              tokens[start:end].tolist(), ps, self.lora_id, MEDIUM_GPU))

    def device_evicted(self, slots: torch.Tensor) -> None:
        self._removed(self.device, slots, MEDIUM_GPU)

    def device_loaded(self, host_slots: torch.Tensor, device_slots: torch.Tensor) -> None:
        """Pages loaded from host joined the device with `device_slots`."""
        blocks = []
        for hp, dp in zip(self._pages(host_slots), self._pages(device_slots)):
            block = self.host.get(hp)
            if block is not None:
                self.device[dp] = block
                blocks.append(block)
        self._stored(blocks, MEDIUM_GPU)

    # -- the host tier -----------------------------------------------------------------

    def host_backed_up(self, device_slots: torch.Tensor, host_slots: torch.Tensor,
                       rejected: torch.Tensor) -> None:
        """A backup landed: the pages of `host_slots` not in `rejected` are the
        host copies of the device pages at the same positions."""
        taken = ~torch.isin(host_slots[::self.page_size], rejected) if len(rejected) else None
        blocks = []
        pages = zip(self._pages(device_slots), self._pages(host_slots))
        for i, (dp, hp) in enumerate(pages):
            if taken is not None and not taken[i]:
                continue
            block = self.device.get(dp)
            if block is not None:
                self.host[hp] = block
                blocks.append(block)
        self._stored(blocks, MEDIUM_CPU_PINNED)

    def host_evicted(self, slots: torch.Tensor) -> None:
        self._removed(self.host, slots, MEDIUM_CPU_PINNED)

    def host_inserted(self, tokens: torch.Tensor, start: int, host_slots: torch.Tensor,
                      rejected: torch.Tensor) -> None:
        """Pages read from storage joined the tree: `host_slots` hold
        tokens[start:), those in `rejected` were not taken."""
        taken = ~torch.isin(host_slots[::self.page_size], rejected) if len(rejected) else None
        blocks = []
        for i, (hp, block) in enumerate(zip(self._pages(host_slots),
                                            self.blocks(tokens, start // self.page_size))):
            if taken is None or taken[i]:
                self.host[hp] = block
                blocks.append(block)
        self._stored(blocks, MEDIUM_CPU_PINNED)

    # -- the storage tier --------------------------------------------------------------

    def disk_stored(self, blocks: List[Block]) -> None:
        """`blocks` are in the store: announce those not announced yet."""
        new = [b for b in blocks if b[0] not in self.disk]
        self.disk.update(b[0] for b in new)
        self._stored(new, MEDIUM_DISK)

    # -- reset ---------------------------------------------------------------------------

    def reset(self) -> None:
        """The device and host tiers were emptied: the host blocks are
        removed one by one, the device's by AllBlocksCleared."""
        if self.host:
            self._add(BlockRemoved([b[0] for b in self.host.values()], MEDIUM_CPU_PINNED))
        self._add(AllBlocksCleared())
        self.device.clear()
        self.host.clear()
