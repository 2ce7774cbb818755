"""What the two halves tell each other: the scheduler's plan of a step (its
copies, each with an id) and the worker's reports of the copies that
finished."""

from __future__ import annotations

import dataclasses
from typing import List, Tuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclasses.dataclass
class Load:
    """Host pages -> a request's blocks, `pages[i]` into `block_ids[i]`
    (ready pages, pinned until the worker reports the load). `is_async`:
    vLLM waits for it (`finished_recving`) instead of the step's forward
    waiting layer by layer. `from_store`: how many of its pages the store
    filled for this request (the rest were in the host tier)."""

    op: int
    req_id: str
    pages: List[int]
    block_ids: List[int]
    is_async: bool = False
    from_store: int = 0


@dataclasses.dataclass
class Save:
    """A request's blocks -> host pages (`block_ids[i]` into `pages[i]`),
    then, with `names`, each page on to the store as `names[i]`. `depends`:
    the request's earlier blocks (K/V computed over them is only as good as
    they are)."""

    op: int
    req_id: str
    block_ids: List[int]
    pages: List[int]
    names: List[str] = dataclasses.field(default_factory=list)
    depends: List[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Prefetch:
    """Store -> host pages: `names[i]` into `pages[i]`, before any block is
    offered to vLLM (so a load only ever reads a ready host page)."""

    op: int
    names: List[str]
    pages: List[int]


@dataclasses.dataclass
class RadixkvConnectorMetadata(KVConnectorMetadata):
    loads: List[Load] = dataclasses.field(default_factory=list)
    saves: List[Save] = dataclasses.field(default_factory=list)
    prefetches: List[Prefetch] = dataclasses.field(default_factory=list)
    # Blocks a save in flight reads may be handed out again from this step
    # on (their request finished or was preempted): the worker waits for its
    # device reads before the step's forward.
    flush: bool = False
    # Blocks whose load failed that the scheduler has been told of: vLLM has
    # rolled their requests back, so saves planned from here on are clean.
    seen_errors: List[int] = dataclasses.field(default_factory=list)


# (op, what, one flag per page): what is "filled" (a save's or a prefetch's
# pages landed in the host tier, or failed), "stored" (a save's store writes
# finished) or "loaded" (a load finished).
Report = Tuple[int, str, List[bool]]


@dataclasses.dataclass
class RadixkvWorkerMetadata(KVConnectorWorkerMetadata):
    """Sent every step, even with nothing to report: the scheduler then
    knows a worker is running the copies it plans."""

    reports: List[Report] = dataclasses.field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        # One rank: nothing to combine but the lists.
        if isinstance(other, RadixkvWorkerMetadata):
            self.reports = self.reports + other.reports
        return self
