"""The connector's scheduler half: which blocks radixkv's host tier holds
(a `HostPageIndex` over block names), what each step copies, and what the
worker reported.

A block is offered to vLLM only from a ready host page, pinned from the
match to the end of its load, so a load fails only on a failed copy: blocks
the store holds are first read into host pages (`Prefetch`), the request
waiting (`get_num_new_matched_tokens` answers None) until the worker
reports them. Saves copy a request's full blocks to host pages after the
step that computed them and, with a store, write those pages on to it; the
pages stay pinned until the writes end. Copies finish on the worker's
threads and are reported through vLLM's worker metadata; while any is
outstanding the engine keeps stepping (`has_pending_push_work`)."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from radixkv.compat.vllm.config import BlockLayout, Seeds, Settings, request_namespace
from radixkv.compat.vllm.metadata import (
    Load,
    Prefetch,
    RadixkvConnectorMetadata,
    RadixkvWorkerMetadata,
    Save,
)
from radixkv.compat.vllm.metrics import RadixkvConnectorStats
from radixkv.kvcache.host_pages import HostPageIndex
from radixkv.storage import page_keys
from radixkv.storage.staged import StoreQueries

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("vllm.radixkv")

# How long a request waits for its blocks' store read before it is offered
# what is ready (the rest computed); the read's pages are freed when it ends.
PREFETCH_WAIT_S = 10.0


@dataclass
class _Req:
    """What the scheduler half knows of one request."""

    request: Any
    names: List[str]  # one per full block of the prompt
    group: Optional[str]  # its quota group (cache_salt)
    block_ids: List[int] = field(default_factory=list)
    saved: int = 0  # blocks [0, saved) are in the host tier or store, or on their way
    start: int = 0  # the first block vLLM did not have at the last match
    claim: List[int] = field(default_factory=list)  # pinned ready pages offered from `start`
    claim_from_store: int = 0  # how many of them the store filled for it
    prefetching: Optional[int] = None  # the op reading its blocks from the store
    prefetch_since: float = 0.0  # when that read was planned
    prefetched: List[int] = field(default_factory=list)  # pages that read filled, pinned
    tried_store: bool = False  # the store was asked since the last allocation
    is_async: bool = False  # the last offer was an asynchronous load
    saves: int = 0  # save ops whose device reads have not been reported


# What BlockStored carries of a block: its vLLM hash, its parent's, its tokens.
BlockEvent = Tuple[Any, Any, List[int]]


@dataclass
class _Op:
    kind: str  # "save", "load" or "prefetch"
    pages: List[int]
    req_id: Optional[str] = None
    names: List[str] = field(default_factory=list)
    stores: bool = False  # a save whose pages go on to the store
    # per page: (vLLM's block hash, its parent's, its tokens), None if unknown
    events: List[Optional[BlockEvent]] = field(default_factory=list)


class SchedulerSide:
    def __init__(self, vllm_config: Any, kv_cache_config: Any, settings: Settings) -> None:
        self.settings = settings
        self.block_size = vllm_config.cache_config.block_size
        layout = BlockLayout.from_config(vllm_config, kv_cache_config)
        self.host_pages = layout.host_pages(settings)
        self.index: Optional[HostPageIndex] = (
            HostPageIndex(self.host_pages, settings.host_eviction_policy, settings.host_quotas)
            if self.host_pages
            else None
        )
        model = settings.namespace or vllm_config.model_config.model
        self.seeds = Seeds(model, layout, self.block_size, settings.host_codec)
        self.store: Optional[StoreQueries] = (
            StoreQueries.open(settings.storage, self.seeds(None), settings.host_codec)
            if settings.storage is not None
            else None
        )
        # With vLLM's async scheduling a step is planned before the last one's
        # output comes back: a synchronous load that failed would have been
        # computed over (and its blocks shared) already. Every load is then
        # asynchronous: its blocks join vLLM's cache only once they landed.
        self.async_only = bool(getattr(vllm_config.scheduler_config, "async_scheduling", False))
        events = getattr(vllm_config, "kv_events_config", None)
        self.events_on = bool(events is not None and events.enable_kv_cache_events)
        self._events: List[Any] = []
        self._reqs: Dict[str, _Req] = {}
        self._ops: Dict[int, _Op] = {}
        self._op_ids = itertools.count(1)
        self._loads: List[Load] = []  # planned since the last step's metadata
        self._prefetches: List[Prefetch] = []
        self._flush = False
        self._seen_errors: List[int] = []
        self._worker_seen = False  # a worker has reported: copies planned get done
        self._page_hash: Dict[int, int] = {}  # ready page -> its block's vLLM hash (events)
        self.stats = RadixkvConnectorStats()
        self._reported_capacity = False

    # -- names ----------------------------------------------------------------------------

    def _names(self, request: "Request") -> List[str]:
        """Store names of the prompt's full blocks; none for a prompt whose
        token ids do not say all it holds (images, embeddings)."""
        if (
            getattr(request, "mm_features", None)
            or getattr(request, "prompt_embeds", None) is not None
        ):
            return []
        namespace, _ = request_namespace(request)
        ids = list(request.prompt_token_ids or [])
        key = self.store.name_key if self.store is not None else None
        return page_keys(ids, self.block_size, self.seeds(namespace), key=key)

    def _state(self, request: "Request") -> _Req:
        st = self._reqs.get(request.request_id)
        if st is None:
            _, group = request_namespace(request)
            st = self._reqs[request.request_id] = _Req(request, self._names(request), group)
        return st

    # -- matching -------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: "Request", num_computed_tokens: int
    ) -> Tuple[Optional[int], bool]:
        if getattr(request, "skip_reading_prefix_cache", False):
            return 0, False
        st = self._state(request)
        if st.prefetching is not None:
            if time.monotonic() - st.prefetch_since < PREFETCH_WAIT_S:
                return None, False  # its blocks are being read from the store
            # A store that does not answer: offer what is ready, and let the
            # late report release its pages.
            st.prefetching = None
            self.stats.count("prefetch_timeouts", 1)
        index = self.index
        if index is None or not st.names:
            return 0, False
        self._release_claim(st)
        bs = self.block_size
        # At least one prompt token is left to compute (it gives the logits).
        usable = min((request.num_prompt_tokens - 1) // bs, len(st.names))
        start = num_computed_tokens // bs
        st.start = start
        have = index.run(st.names)  # ready host pages from the first block
        st.saved = max(st.saved, have)
        # The store is asked about the blocks neither vLLM nor the host has
        # (on the scheduler's thread: a chain vLLM holds costs nothing).
        first = max(have, start)
        if self.store is not None and first < usable and not st.tried_store:
            st.tried_store = True
            more = self.store.exists(st.names[first:], bounded=True)  # waits a bounded time
            if more:
                if first == have:
                    st.saved = max(st.saved, have + more)
                if self._prefetch(st, first, first + more, usable):
                    return None, False
        # Offer the ready pages from `start` on.
        pages: List[int] = []
        for name in st.names[start:usable]:
            page = index.get(name)
            if page is None:
                break
            index.pin(page)
            pages.append(page)
        index.used_chain(st.names[: start + len(pages)])
        st.claim = pages
        st.claim_from_store = sum(1 for p in pages if p in st.prefetched)
        self._unpin(st.prefetched)  # the claim holds what it offers
        st.prefetched = []
        st.is_async = self.async_only or len(pages) >= self.settings.async_load_blocks
        return len(pages) * bs, st.is_async and bool(pages)

    def _prefetch(self, st: _Req, first: int, end: int, usable: int) -> bool:
        """Plans reading blocks [first, min(end, usable)) the host tier lacks
        from the store into host pages; whether any read was planned."""
        index = self.index
        assert index is not None
        names, pages = [], []
        for name in st.names[first : min(end, usable)]:
            if index.page(name) is not None:
                continue  # held (ready, or being filled)
            page = index.take(name, st.group)
            if page is None:
                break  # no page to be had: offer what there is
            names.append(name)
            pages.append(page)
        self._count_evictions()  # the pages' old names go before their new ones come
        if not pages:
            return False
        op = next(self._op_ids)
        self._ops[op] = _Op(
            "prefetch", pages, st.request.request_id, names, events=self._block_events(st, names)
        )
        self._prefetches.append(Prefetch(op, names, pages))
        st.prefetching = op
        st.prefetch_since = time.monotonic()
        return True

    def _release_claim(self, st: _Req) -> None:
        self._unpin(st.claim)
        st.claim = []

    def _unpin(self, pages: List[int]) -> None:
        if pages and self.index is not None:
            self.index.unpin(pages)

    def update_state_after_alloc(
        self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int
    ) -> None:
        st = self._reqs.get(request.request_id)
        if st is None:
            return
        st.tried_store = False  # a request vLLM takes back later is matched afresh
        count = num_external_tokens // self.block_size
        if count <= 0:
            self._release_claim(st)
            return
        block_ids = list(blocks.get_block_ids()[0])
        pages, rest = st.claim[:count], st.claim[count:]
        self._unpin(rest)
        st.claim = []
        op = next(self._op_ids)
        self._ops[op] = _Op("load", pages, request.request_id)
        from_store = min(st.claim_from_store, count)
        self._loads.append(
            Load(
                op,
                request.request_id,
                pages,
                block_ids[st.start : st.start + count],
                st.is_async,
                from_store,
            )
        )
        st.saved = max(st.saved, st.start + count)

    # -- a step's plan --------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> RadixkvConnectorMetadata:
        meta = RadixkvConnectorMetadata(loads=self._loads, prefetches=self._prefetches)
        self._loads, self._prefetches = [], []
        steps = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                continue
            st.block_ids = list(new.block_ids[0])
            self._plan_saves(st, new.num_computed_tokens, steps.get(new.req_id, 0), meta)
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", ()) or ()
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            added = cached.new_block_ids[i]
            if req_id in resumed:
                st.block_ids = list(added[0]) if added is not None else []
            elif added is not None:
                st.block_ids += added[0]
            self._plan_saves(st, cached.num_computed_tokens[i], steps.get(req_id, 0), meta)
        preempted = getattr(scheduler_output, "preempted_req_ids", None) or ()
        if any(self._reqs[r].saves for r in preempted if r in self._reqs):
            self._flush = True
        meta.flush, self._flush = self._flush, False
        meta.seen_errors, self._seen_errors = self._seen_errors, []
        return meta

    def _plan_saves(
        self, st: _Req, computed: int, scheduled: int, meta: RadixkvConnectorMetadata
    ) -> None:
        """The save of the blocks this step completes (`computed` tokens
        before it, `scheduled` in it)."""
        index = self.index
        # Fewer computed tokens than saved blocks: vLLM rolled the request
        # back (a block failed to load): its blocks are saved again once
        # recomputed.
        st.saved = min(st.saved, computed // self.block_size)
        full = min((computed + scheduled) // self.block_size, len(st.names), len(st.block_ids))
        if index is None or full <= st.saved:
            return
        names, blocks, pages = [], [], []
        for i in range(st.saved, full):
            page = index.take(st.names[i], st.group)
            if page is not None:  # (None: held already, or no page to be had)
                names.append(st.names[i])
                blocks.append(st.block_ids[i])
                pages.append(page)
        index.used_chain(st.names[:full])
        self._count_evictions()  # the pages' old names go before their new ones come
        # Every block before the save's end: a block vLLM shares with another
        # request may have failed that request's load in this very step.
        depends = st.block_ids[:full]
        st.saved = full
        if not pages:
            return
        op = next(self._op_ids)
        stores = self.store is not None
        self._ops[op] = _Op(
            "save", pages, st.request.request_id, names, stores, self._block_events(st, names)
        )
        st.saves += 1
        meta.saves.append(
            Save(op, st.request.request_id, blocks, pages, names if stores else [], depends)
        )

    # -- the worker's reports -------------------------------------------------------------

    def update_connector_output(self, connector_output: Any) -> None:
        invalid = getattr(connector_output, "invalid_block_ids", None) or ()
        self._seen_errors += invalid
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, RadixkvWorkerMetadata):
            self._worker_seen = True
            for op, what, oks in meta.reports:
                self._report(op, what, oks)
        self._count_evictions()

    def _report(self, op_id: int, what: str, oks: List[bool]) -> None:
        op = self._ops.get(op_id)
        index = self.index
        if op is None or index is None:
            return
        st = self._reqs.get(op.req_id) if op.req_id is not None else None
        if what == "filled":
            names: List[Optional[str]] = list(op.names) or [None] * len(op.pages)
            for page, ok, event, name in zip(
                op.pages, oks, op.events or [None] * len(op.pages), names
            ):
                index.filled(page, ok)
                # (a reset forgets names whose fill was in flight: no event for them)
                if ok and event is not None and index.name_of(page) == name:
                    self._stored(page, event, "CPU")
            if op.kind == "save":
                if st is not None:
                    st.saves -= 1
                if not op.stores:
                    self._done(op_id)
            else:  # a prefetch: what filled stays pinned for its request
                good = [p for p, ok in zip(op.pages, oks) if ok]
                bad = [p for p, ok in zip(op.pages, oks) if not ok]
                self._unpin(bad)
                if st is not None and st.prefetching == op_id:
                    st.prefetching = None
                    st.prefetched += good
                else:
                    self._unpin(good)
                del self._ops[op_id]
        elif what == "stored":
            if self.events_on:
                for page, ok, event in zip(op.pages, oks, op.events or [None] * len(op.pages)):
                    if ok and event is not None:
                        self._stored(page, event, "STORAGE", remember=False)
            self._done(op_id)
        elif what == "loaded":
            self._done(op_id)

    def _done(self, op_id: int) -> None:
        op = self._ops.pop(op_id)
        self._unpin(op.pages)

    # -- events ---------------------------------------------------------------------------

    def _block_events(self, st: _Req, names: List[str]) -> List[Optional[BlockEvent]]:
        """Per block of `names` (in `st`'s prompt): its vLLM hash, its
        parent's, its tokens (what BlockStored carries), when events are on."""
        if not self.events_on:
            return []
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        hashes = list(getattr(st.request, "block_hashes", None) or [])
        where = {n: i for i, n in enumerate(st.names)}
        ids = list(st.request.prompt_token_ids or [])
        bs, out = self.block_size, []  # type: int, List[Optional[BlockEvent]]
        for name in names:
            i = where[name]
            if i >= len(hashes):
                out.append(None)
                continue
            parent = maybe_convert_block_hash(hashes[i - 1]) if i else None
            out.append((maybe_convert_block_hash(hashes[i]), parent, ids[i * bs : (i + 1) * bs]))
        return out

    def _stored(self, page: int, event, medium: str, remember: bool = True) -> None:
        from vllm.distributed.kv_events import BlockStored

        block_hash, parent, tokens = event
        if remember:
            self._page_hash[page] = block_hash
        self._events.append(
            BlockStored(
                block_hashes=[block_hash],
                parent_block_hash=parent,
                token_ids=tokens,
                block_size=self.block_size,
                lora_id=None,
                medium=medium,
                lora_name=None,
            )
        )

    def _removed(self, pages: List[int]) -> None:
        hashes = [h for h in (self._page_hash.pop(p, None) for p in pages) if h is not None]
        if hashes and self.events_on:
            from vllm.distributed.kv_events import BlockRemoved

            self._events.append(BlockRemoved(block_hashes=hashes, medium="CPU"))

    def _count_evictions(self) -> None:
        if self.index is None:
            return
        evicted = self.index.take_evicted()
        if evicted:
            self.stats.count("host_evicted", len(evicted))
            self._removed(evicted)

    def take_events(self):
        self._count_evictions()
        events, self._events = self._events, []
        return events

    # -- the rest of vLLM's calls ---------------------------------------------------------

    def request_finished(
        self, request: "Request", block_ids: List[int]
    ) -> Tuple[bool, Optional[dict]]:
        st = self._reqs.pop(request.request_id, None)
        if st is not None:
            self._release_claim(st)
            self._unpin(st.prefetched)
            st.prefetched = []
            if st.saves:  # its blocks may be handed out before the saves read them
                self._flush = True
            if st.prefetching is not None:  # the read finishes; nobody claims it
                op = self._ops.get(st.prefetching)
                if op is not None:
                    op.req_id = None
        return False, None  # the blocks are free to go: see `flush`

    def has_pending_push_work(self) -> bool:
        """Copies the worker has not reported: the engine steps on until it
        has (only once a worker has reported at all)."""
        return self._worker_seen and bool(self._ops)

    def reset_cache(self) -> bool:
        """Empties the host tier (the store is shared and stays)."""
        if self.index is not None:
            self._count_evictions()
            self._removed(self.index.clear())
        return True

    def get_stats(self) -> Optional[RadixkvConnectorStats]:
        index = self.index
        if index is not None:
            self._count_evictions()
            self.stats.gauge("host_blocks", index.ready_pages)
            self.stats.gauge("host_capacity", index.num_pages)
        if self.stats.is_empty():
            return None
        out, self.stats = self.stats, RadixkvConnectorStats()
        return out

    def shutdown(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None
