"""radixkv's host and storage tiers behind vLLM: a KV connector (vLLM's
`KVConnectorBase_V1`, vLLM 0.32) that copies each full block of a prompt,
once computed, into radixkv's host tier and writes it through to radixkv's
file store or Mooncake Store, and loads the blocks a new request finds there
into the blocks vLLM gave it, so a prefix computed once serves every later
request of every instance sharing the store, after vLLM's own prefix cache
has dropped it or restarted.

    --kv-transfer-config '{"kv_connector": "RadixkvConnector",
        "kv_connector_module_path": "radixkv.compat.vllm_connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"host_bytes": 4294967296,
                                      "backend": "file", "directory": "/var/cache/kv"}}'

The extra config takes `host_bytes` (host memory for the host tier; 0, the
default: none), the storage options of `radixkv.compat.staged_storage`
(`"backend": "none"`: the host tier alone) and `namespace` (a name for the model's
weights: vLLM's model name may be only a path or an alias). vLLM's scheduler
asks the store which blocks it holds on its own thread: a store whose
queries may block (Mooncake) is waited for at most `query_timeout_s` (0.05
s), and a late answer is a miss.

The host tier's index (`HostPageIndex`: block names -> host pages, exact
LRU) lives in the scheduler's connector, its memory (`HostBlocks`: flat host
pages, one block of every layer each) in the worker's; each step's metadata
names the host pages to copy from and to. A page the step names is pinned
while the step is planned; the worker runs a step's loads before its saves
and each step before the next, so a page evicted for a later save is read
first. A host page whose fill failed is marked bad in the worker (a load
from it fails, never serves) and forgotten by the scheduler when the load
error comes back.

A block's name chains SHA-256 over the prompt's blocks (radixkv's page
keys) from a seed that covers the model (and `namespace`), the K/V dtype,
the block size, vLLM's per-layer block shape, the layers and the request's
`cache_salt` and LoRA adapter: configurations and tenants never read each
other's blocks. With a secret every name is an HMAC under a key derived from it.

Loads and saves are synchronous (in `start_load_kv` before the forward
pass, in `wait_for_save` after it): simple, and on a CPU, where a copy
competes with the model for the same cores, no slower. A block that fails
to load (missing, corrupt, a store in back-off, a bad host page) is reported through
`get_block_ids_with_load_errors`, with every block after it, and never
served: with `"kv_load_failure_policy": "recompute"` vLLM recomputes them,
with vLLM's default ("fail") the request fails. One rank (no tensor or
pipeline parallelism), full-attention models with one KV cache group of one
dtype; anything else is refused at start-up.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from radixkv._checks import as_count
from radixkv.compat.host_pages import HostBlocks, HostPageIndex
from radixkv.compat.staged_storage import StagedStorage, storage_options
from radixkv.storage import config_fingerprint, page_keys

logger = logging.getLogger("vllm.radixkv")  # under vLLM's logger: shown in its log

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


def _lacks(what: str) -> RuntimeError:
    """A step's moves need `what`, which this worker does not have."""
    return RuntimeError(
        f"radixkv's vLLM connector: a step's moves need {what}, which this worker lacks"
    )


@dataclasses.dataclass
class BlockMoves:
    """Blocks of one request to load or save: `names[i]` <-> `block_ids[i]`
    <-> host page `pages[i]` (-1: none; a load then reads the store straight
    into the block, a save writes the block straight to the store)."""

    req_id: str
    names: List[str]
    block_ids: List[int]
    pages: List[int]
    # A load's blocks the host holds (the rest are read from the store).
    in_host: List[bool] = dataclasses.field(default_factory=list)
    # A save's earlier blocks: K/V computed over them is only as good as they are.
    depends: List[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class RadixkvConnectorMetadata(KVConnectorMetadata):
    loads: List[BlockMoves] = dataclasses.field(default_factory=list)
    saves: List[BlockMoves] = dataclasses.field(default_factory=list)
    # Blocks whose load failed that the scheduler has been told of: vLLM has
    # rolled their requests back, so saves planned from here on are clean.
    seen_errors: List[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Req:
    """The scheduler's view of one running request."""

    request: Any
    names: List[str]  # one per full block of the prompt
    block_ids: List[int] = dataclasses.field(default_factory=list)
    saved: int = 0  # blocks [0, saved) are in the store or on their way
    start: int = 0  # the first block vLLM did not have at the last match
    load: Optional[BlockMoves] = None
    loaded: List[int] = dataclasses.field(default_factory=list)  # its blocks loaded via host


class RadixkvConnector(KVConnectorBase_V1):
    """vLLM's KV connector over radixkv's host tier and its FileStorage or
    MooncakeStorage."""

    def __init__(
        self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: Any = None
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.host_bytes = as_count(extra.pop("host_bytes", 0), "extra_config host_bytes", minimum=0)
        if extra.get("backend") == "none":  # the host tier alone
            if not self.host_bytes:
                raise ValueError(
                    'extra_config backend "none" needs host_bytes > 0 (the host '
                    "tier is then the only one)"
                )
            self.options: Optional[dict] = None
        else:
            self.options = storage_options(extra)
        self.block_size = vllm_config.cache_config.block_size
        par = vllm_config.parallel_config
        if par.tensor_parallel_size != 1 or par.pipeline_parallel_size != 1:
            # The scheduler names blocks for every rank alike; a rank's shard
            # of a block would need its own name.
            raise ValueError(
                "radixkv's vLLM connector serves one rank (tensor_parallel_size "
                "and pipeline_parallel_size 1) in this version"
            )
        if getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute") != "recompute":
            # Under "fail" a block evicted from the store between the match
            # and the load fails its request: radixkv's store is a cache.
            raise ValueError(
                'radixkv\'s vLLM connector needs "kv_load_failure_policy": '
                '"recompute" in --kv-transfer-config (a block that fails to load '
                "is recomputed)"
            )
        model = vllm_config.model_config
        self.model = extra.get("namespace") or model.model
        # What else decides a block's bytes: the weights' revision and
        # quantization, and the K/V cache dtype as configured (fp8 variants
        # share one torch dtype).
        self.variant = (
            f"revision={getattr(model, 'revision', None)} "
            f"quantization={getattr(model, 'quantization', None)} "
            f"cache_dtype={vllm_config.cache_config.cache_dtype}"
        )
        self.storage: Optional[StagedStorage] = None
        self._seeds: "collections.OrderedDict[Optional[str], bytes]" = collections.OrderedDict()
        # scheduler side
        self._reqs: Dict[str, _Req] = {}
        self.index: Optional[HostPageIndex] = None
        self._pinned: List[int] = []  # host pages the step being planned names
        # block -> (request, name, page, the page's fills) of a load through a host page
        self._via_host: Dict[int, Tuple[str, str, int, int]] = {}
        self._seen_errors: List[int] = []
        self._fills: collections.Counter = collections.Counter()  # page -> saves planned
        # worker side
        self.blocks: Optional[HostBlocks] = None  # the layers' blocks and the host pages
        self._valid: Optional[bytearray] = None  # host pages holding good bytes
        self._load_errors: set = set()  # this step's, for vLLM
        # Blocks whose load failed -> their request, kept until the scheduler
        # has seen them: steps planned before that (vLLM's async scheduling
        # plans one ahead) would save bytes computed over them.
        self._poisoned: Dict[int, str] = {}
        self.moved: "collections.Counter[str]" = collections.Counter()
        if role == KVConnectorRole.SCHEDULER:
            self._open(*self._page_from_config(kv_cache_config))
            if self.host_pages:
                self.index = HostPageIndex(self.host_pages)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any = None) -> bool:
        """No (vLLM 0.33 asks): sleep mode moves the KV caches, and the worker
        keeps views of the ones it registered."""
        return False

    # -- the page: one block of every layer -----------------------------------------------

    def _page_from_config(self, kv_cache_config) -> Tuple[str, int, int, torch.dtype]:
        """(layout, layers, elements, dtype) of a page, from vLLM's KV cache
        config: what the scheduler knows before any tensor exists."""
        groups = list(getattr(kv_cache_config, "kv_cache_groups", []) or [])
        if len(groups) != 1:
            raise ValueError(
                f"radixkv's vLLM connector serves models with one KV cache group "
                f"(full attention); this one has {len(groups)}"
            )
        spec = groups[0].kv_cache_spec
        if type(spec).__name__ != "FullAttentionSpec":
            raise ValueError(
                f"radixkv's vLLM connector serves full attention; this model's KV "
                f"cache is {type(spec).__name__}"
            )
        layers = len(groups[0].layer_names)
        dtype = spec.dtype
        per_layer = spec.page_size_bytes // torch.empty(0, dtype=dtype).element_size()
        layout = (
            f"vllm:{type(spec).__name__} heads={spec.num_kv_heads} "
            f"head={spec.head_size} {self.variant}"
        )
        return layout, layers, layers * per_layer, dtype

    def _open(self, layout: str, layers: int, page_elems: int, dtype: torch.dtype) -> None:
        self.layout, self.num_layers, self.dtype = layout, layers, dtype
        self.page_elems = page_elems
        page_bytes = page_elems * torch.empty(0, dtype=dtype).element_size()
        self.host_pages = self.host_bytes // page_bytes
        if self.host_bytes and not self.host_pages:
            raise ValueError(
                f"extra_config host_bytes ({self.host_bytes}) holds no block of "
                f"this model ({page_bytes} bytes)"
            )
        if self.options is not None:
            self.storage = StagedStorage(self.options, self._seed(None), page_elems, dtype)

    def _seed(self, namespace: Optional[str]) -> bytes:
        """The fingerprint that starts a request's chain of block names."""
        seed = self._seeds.get(namespace)
        if seed is None:
            seed = config_fingerprint(
                model=self.model,
                dtype=self.dtype,
                page_size=self.block_size,
                layout=self.layout,
                num_layers=self.num_layers,
                kv_heads=1,
                head_dim=1,
                namespace=namespace,
            )
            self._seeds[namespace] = seed
            if len(self._seeds) > 4096:  # salts come from clients: keep a bounded few
                self._seeds.popitem(last=False)
        else:
            self._seeds.move_to_end(namespace)
        return seed

    def _names(self, request: "Request") -> List[str]:
        """Store names of the prompt's full blocks; none for a prompt whose
        token ids do not say all it holds (images, embeddings)."""
        if (
            getattr(request, "mm_features", None)
            or getattr(request, "prompt_embeds", None) is not None
        ):
            return []
        salt = getattr(request, "cache_salt", None)
        lora = getattr(request, "lora_request", None)
        namespace = None
        if salt or lora is not None:
            lora_id = (
                None
                if lora is None
                else [lora.lora_name, lora.lora_int_id, getattr(lora, "lora_path", None)]
            )
            namespace = json.dumps({"salt": salt, "lora": lora_id})  # fields kept apart
        ids = list(request.prompt_token_ids or [])
        key = self.storage.name_key if self.storage is not None else None
        return page_keys(ids, self.block_size, self._seed(namespace), key=key)

    # -- scheduler side ---------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: "Request", num_computed_tokens: int
    ) -> Tuple[int, bool]:
        st = self._reqs.get(request.request_id)
        if st is None:
            st = self._reqs[request.request_id] = _Req(request, self._names(request))
        # At least one prompt token is left to compute (it gives the logits).
        usable = (request.num_prompt_tokens - 1) // self.block_size
        start = num_computed_tokens // self.block_size
        # The blocks the host holds from the first, then those the store
        # holds after them: the rest are saved once computed, also those vLLM
        # had (they may hold an earlier turn's output, which no prompt saved).
        have = self.index.run(st.names) if self.index is not None else 0
        if self.storage is not None and have < len(st.names):
            more = self.storage.exists(st.names[have:], bounded=True)  # vLLM's thread waits
            if more is None:  # the store did not answer in time: no rewrites
                st.start, st.saved = start, max(st.saved, start, have)
                return max(0, min(have, usable) - start) * self.block_size, False
            have += more
        st.start, st.saved = start, have
        return max(0, min(have, usable) - start) * self.block_size, False

    def update_state_after_alloc(
        self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int
    ) -> None:
        st = self._reqs.get(request.request_id)
        if st is None or num_external_tokens <= 0:
            return
        if st.load is not None and self.index is not None:  # planned again, never sent
            self.index.unpin(p for p in st.load.pages if p >= 0)
        self._forget_loads(st)  # a resumed request's old blocks are not its own any more
        block_ids = list(blocks.get_block_ids()[0])
        start = st.start
        count = num_external_tokens // self.block_size
        names = st.names[start : start + count]
        load = BlockMoves(
            request.request_id,
            names,
            block_ids[start : start + count],
            [-1] * count,
            [False] * count,
        )
        if self.index is not None:
            # The host's blocks first (pinned, so that room made for the
            # store's below never takes them), then host pages for the rest.
            for i, name in enumerate(names):
                page = self.index.get(name)
                if page is not None:
                    self.index.pin(page)
                    load.pages[i], load.in_host[i] = page, True
            for i, name in enumerate(names):
                if not load.in_host[i]:
                    load.pages[i] = (
                        -1 if self.storage is None else self._or_none(self.index.take(name))
                    )
            for i, page in enumerate(load.pages):
                if page >= 0:
                    self._via_host[load.block_ids[i]] = (
                        st.request.request_id,
                        names[i],
                        page,
                        self._fills[page],
                    )
            st.loaded = [b for b, p in zip(load.block_ids, load.pages) if p >= 0]
        st.load = load
        st.saved = max(st.saved, start + count)

    @staticmethod
    def _or_none(page: Optional[int]) -> int:
        return -1 if page is None else page

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = RadixkvConnectorMetadata()
        steps = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                continue
            st.block_ids = list(new.block_ids[0])
            self._plan(st, new.num_computed_tokens, steps.get(new.req_id, 0), meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            added = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                st.block_ids = list(added[0]) if added is not None else []
            elif added is not None:
                st.block_ids += added[0]
            self._plan(st, cached.num_computed_tokens[i], steps.get(req_id, 0), meta)
        if self.index is not None:  # the worker runs this step's moves before the next's
            self.index.unpin(self._pinned)
        self._pinned = []
        meta.seen_errors, self._seen_errors = self._seen_errors, []
        return meta

    def _plan(
        self, st: _Req, computed: int, scheduled: int, meta: RadixkvConnectorMetadata
    ) -> None:
        """This step's load of `st` and the save of the blocks the step
        completes (`computed` tokens before it, `scheduled` in it)."""
        if st.load is not None:
            meta.loads.append(st.load)
            self._pinned += [p for p in st.load.pages if p >= 0]
            st.load = None
        # Fewer computed tokens than saved blocks: vLLM rolled the request
        # back (a block failed to load): its blocks are saved again once
        # recomputed.
        st.saved = min(st.saved, computed // self.block_size)
        full = min((computed + scheduled) // self.block_size, len(st.names), len(st.block_ids))
        if full > st.saved:
            names = st.names[st.saved : full]
            pages = [-1] * len(names)
            if self.index is not None:
                pages = [self._or_none(self.index.take(name)) for name in names]
                self._pinned += [p for p in pages if p >= 0]
                self._fills.update(p for p in pages if p >= 0)
            meta.saves.append(
                BlockMoves(
                    st.request.request_id,
                    names,
                    st.block_ids[st.saved : full],
                    pages,
                    depends=st.block_ids[: st.saved],
                )
            )
            st.saved = full

    def update_connector_output(self, connector_output: Any) -> None:
        """A block that failed to load through a host page: the page's name
        is forgotten, unless a save planned since refills the page (vLLM's
        recompute, planned before this news came)."""
        invalid = getattr(connector_output, "invalid_block_ids", None) or ()
        self._seen_errors += invalid
        for block in invalid:
            via = self._via_host.pop(block, None)
            if via is not None and self.index is not None and self._fills[via[2]] == via[3]:
                self.index.drop(via[1], via[2])

    def _forget_loads(self, st: _Req) -> None:
        for block in st.loaded:
            via = self._via_host.get(block)
            if via is not None and via[0] == st.request.request_id:
                del self._via_host[block]
        st.loaded = []

    def request_finished(
        self, request: "Request", block_ids: List[int]
    ) -> Tuple[bool, Optional[dict]]:
        st = self._reqs.pop(request.request_id, None)
        if st is not None:
            self._forget_loads(st)
            if st.load is not None and self.index is not None:  # planned, never sent
                self.index.unpin(p for p in st.load.pages if p >= 0)
        return False, None  # moves are done within their step: the blocks are free to go

    # -- worker side ------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]) -> None:
        try:
            blocks = HostBlocks(kv_caches, self._kv_cache_config.num_blocks)
        except ValueError as e:  # vLLM's log names the connector that refused
            raise ValueError(f"radixkv's vLLM connector: {e}") from None
        layout, _, planned, _ = self._page_from_config(self._kv_cache_config)
        if blocks.page_elems != planned:  # the scheduler numbers host pages of this size
            raise ValueError(
                f"radixkv's vLLM connector: the layers' blocks hold "
                f"{blocks.page_elems} elements, vLLM's KV cache spec says {planned}"
            )
        self._open(layout, len(blocks.layers), blocks.page_elems, blocks.dtype)
        if self.host_pages:
            blocks.open_host(self.host_pages)
            self._valid = bytearray(self.host_pages)
        self.blocks = blocks

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        for block in getattr(connector_metadata, "seen_errors", ()):  # vLLM rolled them back
            self._poisoned.pop(block, None)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        loads = list(getattr(meta, "loads", ()))
        # Host pages (and their marks) exist only with a host tier; a step
        # names one only then.
        blocks, valid = self.blocks, self._valid
        rows = None if blocks is None else blocks.rows
        # First every store read of the step (into host pages where it has
        # them), then every copy from host pages: a load planned after
        # another took a page for the store may read that page.
        done = [[False] * len(load.block_ids) for load in loads]
        for load, got in zip(loads, done):
            stored = [i for i, host in enumerate(load.in_host) if not host]
            for i in stored:  # pages taken for the store's blocks: good once read
                if load.pages[i] >= 0:
                    if valid is None:
                        raise _lacks("host pages")
                    valid[load.pages[i]] = 0
            if stored and self.storage is not None:

                def take(
                    j: int, page: Optional[torch.Tensor], load=load, got=got, stored=stored
                ) -> bool:
                    i = stored[j]
                    hp = load.pages[i]
                    if page is None:
                        return False
                    if hp >= 0:
                        if rows is None or valid is None:
                            raise _lacks("host pages")
                        rows[hp].copy_(page)
                        valid[hp] = 1
                    else:
                        if blocks is None:
                            raise _lacks("the layers' blocks (register_kv_caches)")
                        blocks.copy_in(page, load.block_ids[i])
                    got[i] = True
                    return True

                self.storage.read([load.names[i] for i in stored], take)
        for load, got in zip(loads, done):
            for i, page in enumerate(load.pages):
                if not got[i] and page >= 0:
                    if valid is None:
                        raise _lacks("host pages")
                    got[i] = valid[page] == 1
            ok = len(got) if all(got) else got.index(False)
            via = [i for i in range(ok) if load.pages[i] >= 0]
            if via:
                if blocks is None:
                    raise _lacks("the layers' blocks (register_kv_caches)")
                blocks.from_host([load.pages[i] for i in via], [load.block_ids[i] for i in via])
            self.moved["loaded from host"] += sum(load.in_host[:ok])
            self.moved["loaded from store"] += ok - sum(load.in_host[:ok])
            if ok < len(got):  # a block not loaded, and every one after it, is recomputed
                self.moved["failed to load"] += len(got) - ok
                self._load_errors.update(load.block_ids[ok:])
                self._poisoned.update((b, load.req_id) for b in load.block_ids[ok:])

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads finish in start_load_kv

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # whole blocks of every layer are saved in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        failed = set(self._poisoned.values())
        blocks, valid = self.blocks, self._valid  # valid, rows: None without a host tier
        rows = None if blocks is None else blocks.rows
        for save in getattr(meta, "saves", ()):
            hosted = [i for i, p in enumerate(save.pages) if p >= 0]
            # Blocks that failed to load, or computed over such blocks (of
            # this request or of another it shares them with) in a step vLLM
            # planned before it rolled them back: recomputed, then saved.
            if save.req_id in failed or any(
                b in self._poisoned for b in save.depends + save.block_ids
            ):
                for i in hosted:
                    if valid is None:
                        raise _lacks("host pages")
                    valid[save.pages[i]] = 0
                continue
            if hosted:
                if blocks is None:
                    raise _lacks("the layers' blocks (register_kv_caches)")
                if valid is None:
                    raise _lacks("host pages")
                blocks.to_host([save.block_ids[i] for i in hosted], [save.pages[i] for i in hosted])
                for i in hosted:
                    valid[save.pages[i]] = 1
                self.moved["saved to host"] += len(hosted)
            if self.storage is None:
                continue

            def fill(i: int, page: torch.Tensor, save=save) -> None:
                if save.pages[i] >= 0:
                    if rows is None:
                        raise _lacks("host pages")
                    page.copy_(rows[save.pages[i]])
                else:
                    if blocks is None:
                        raise _lacks("the layers' blocks (register_kv_caches)")
                    blocks.copy_out(save.block_ids[i], page)

            self.moved["saved to store"] += sum(self.storage.write(save.names, fill))

    def get_block_ids_with_load_errors(self) -> set:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self.moved:
            logger.info(
                "radixkv connector: blocks %s",
                ", ".join(f"{what} {count}" for what, count in sorted(self.moved.items())),
            )
        if self.storage is not None:
            self.storage.close()
            self.storage = None

    def counts(self) -> dict:
        """radixkv's store counts (errors, corrupt pages, skipped calls)."""
        return self.storage.counts() if self.storage is not None else {}
