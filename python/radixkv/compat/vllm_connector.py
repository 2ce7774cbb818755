"""radixkv's storage tier behind vLLM: a KV connector (vLLM's
`KVConnectorBase_V1`, vLLM 0.32) that writes each full block of a prompt
to radixkv's file store or Mooncake Store once it is computed, and loads
the blocks a new request finds there into the blocks vLLM gave it, so a
prefix computed once serves every later request of every instance sharing
the store, after vLLM's own prefix cache has dropped it or restarted.

    --kv-transfer-config '{"kv_connector": "RadixkvConnector",
        "kv_connector_module_path": "radixkv.compat.vllm_connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"store": "file", "directory": "/var/cache/kv"}}'

The extra config takes the store options of `radixkv.compat.staged_store`
and `namespace` (a name for the model's weights: vLLM's model name may be
only a path or an alias). vLLM's scheduler asks the store which blocks it
holds on its own thread: a store whose queries may block (Mooncake) is
waited for at most `query_timeout_s` (0.05 s), and a late answer is a miss.

A block's name chains SHA-256 over the prompt's blocks (radixkv's page
keys) from a seed that covers the model (and `namespace`), the K/V dtype,
the block size, vLLM's per-layer block shape, the layers and the request's `cache_salt` and LoRA adapter:
configurations and tenants never read each other's blocks. With a secret
every name is an HMAC under a key derived from it.

Loads and saves are synchronous (in `start_load_kv` before the forward
pass, in `wait_for_save` after it): simple, and on a CPU, where a copy
competes with the model for the same cores, no slower. A block that fails
to load (missing, corrupt, a store in back-off) is reported through
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
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from radixkv.compat.staged_store import StagedStore, store_options
from radixkv.storage import config_fingerprint, page_keys

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


@dataclasses.dataclass
class BlockMoves:
    """Blocks of one request to load or save: `names[i]` <-> `block_ids[i]`."""

    req_id: str
    names: List[str]
    block_ids: List[int]
    # A save's earlier blocks: K/V computed over them is only as good as they are.
    depends: List[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class RadixkvConnectorMetadata(KVConnectorMetadata):
    loads: List[BlockMoves] = dataclasses.field(default_factory=list)
    saves: List[BlockMoves] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Req:
    """The scheduler's view of one running request."""

    request: Any
    names: List[str]          # one per full block of the prompt
    block_ids: List[int] = dataclasses.field(default_factory=list)
    saved: int = 0            # blocks [0, saved) are in the store or on their way
    start: int = 0            # the first block vLLM did not have at the last match
    load: Optional[BlockMoves] = None


class RadixkvConnector(KVConnectorBase_V1):
    """vLLM's KV connector over radixkv's FileStorage or MooncakeStorage."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.options = store_options(self._kv_transfer_config.kv_connector_extra_config)
        self.block_size = vllm_config.cache_config.block_size
        par = vllm_config.parallel_config
        if par.tensor_parallel_size != 1 or par.pipeline_parallel_size != 1:
            # The scheduler names blocks for every rank alike; a rank's shard
            # of a block would need its own name.
            raise ValueError("radixkv's vLLM connector serves one rank (tensor_parallel_size "
                             "and pipeline_parallel_size 1) in this version")
        if getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute") != "recompute":
            # Under "fail" a block evicted from the store between the match
            # and the load fails its request: radixkv's store is a cache.
            raise ValueError('radixkv\'s vLLM connector needs "kv_load_failure_policy": '
                             '"recompute" in --kv-transfer-config (a block that fails to load '
                             'is recomputed)')
        model = vllm_config.model_config
        self.model = self.options.get("namespace") or model.model
        # What else decides a block's bytes: the weights' revision and
        # quantization, and the K/V cache dtype as configured (fp8 variants
        # share one torch dtype).
        self.variant = (f"revision={getattr(model, 'revision', None)} "
                        f"quantization={getattr(model, 'quantization', None)} "
                        f"cache_dtype={vllm_config.cache_config.cache_dtype}")
        self.store: Optional[StagedStore] = None
        self._seeds: "collections.OrderedDict[Optional[str], bytes]" = collections.OrderedDict()
        # scheduler side
        self._reqs: Dict[str, _Req] = {}
        # worker side
        self._layers: List[Tuple[torch.Tensor, int]] = []
        self._load_errors: set = set()
        self._failed_reqs: set = set()  # requests whose load failed this step
        if role == KVConnectorRole.SCHEDULER:
            self._open(*self._page_from_config(kv_cache_config))

    # -- the page: one block of every layer -----------------------------------------------

    def _page_from_config(self, kv_cache_config) -> Tuple[str, int, int, torch.dtype]:
        """(layout, layers, elements, dtype) of a page, from vLLM's KV cache
        config: what the scheduler knows before any tensor exists."""
        groups = list(getattr(kv_cache_config, "kv_cache_groups", []) or [])
        if len(groups) != 1:
            raise ValueError(f"radixkv's vLLM connector serves models with one KV cache group "
                             f"(full attention); this one has {len(groups)}")
        spec = groups[0].kv_cache_spec
        if type(spec).__name__ != "FullAttentionSpec":
            raise ValueError(f"radixkv's vLLM connector serves full attention; this model's KV "
                             f"cache is {type(spec).__name__}")
        layers = len(groups[0].layer_names)
        dtype = spec.dtype
        per_layer = spec.page_size_bytes // torch.empty(0, dtype=dtype).element_size()
        layout = (f"vllm:{type(spec).__name__} heads={spec.num_kv_heads} "
                  f"head={spec.head_size} {self.variant}")
        return layout, layers, layers * per_layer, dtype

    def _open(self, layout: str, layers: int, page_elems: int, dtype: torch.dtype) -> None:
        self.layout, self.num_layers, self.dtype = layout, layers, dtype
        self.store = StagedStore(self.options, self._seed(None), page_elems, dtype)

    def _seed(self, namespace: Optional[str]) -> bytes:
        """The fingerprint that starts a request's chain of block names."""
        seed = self._seeds.get(namespace)
        if seed is None:
            seed = config_fingerprint(model=self.model, dtype=self.dtype,
                                      page_size=self.block_size, layout=self.layout,
                                      num_layers=self.num_layers, kv_heads=1, head_dim=1,
                                      namespace=namespace)
            self._seeds[namespace] = seed
            if len(self._seeds) > 4096:  # salts come from clients: keep a bounded few
                self._seeds.popitem(last=False)
        else:
            self._seeds.move_to_end(namespace)
        return seed

    def _names(self, request: "Request") -> List[str]:
        """Store names of the prompt's full blocks; none for a prompt whose
        token ids do not say all it holds (images, embeddings)."""
        if getattr(request, "mm_features", None) or \
                getattr(request, "prompt_embeds", None) is not None:
            return []
        salt = getattr(request, "cache_salt", None)
        lora = getattr(request, "lora_request", None)
        namespace = None
        if salt or lora is not None:
            lora_id = None if lora is None else [lora.lora_name, lora.lora_int_id,
                                                 getattr(lora, "lora_path", None)]
            namespace = json.dumps({"salt": salt, "lora": lora_id})  # fields kept apart
        ids = list(request.prompt_token_ids or [])
        return page_keys(ids, self.block_size, self._seed(namespace), key=self.store.name_key)

    # -- scheduler side ---------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> Tuple[int, bool]:
        st = self._reqs.get(request.request_id)
        if st is None:
            st = self._reqs[request.request_id] = _Req(request, self._names(request))
        # At least one prompt token is left to compute (it gives the logits).
        usable = (request.num_prompt_tokens - 1) // self.block_size
        start = num_computed_tokens // self.block_size
        # The blocks the store holds from the first: the rest are saved once
        # computed, also those vLLM had (they may hold an earlier turn's
        # output, which no prompt saved).
        have = self.store.exists(st.names, bounded=True)  # vLLM's scheduler thread waits
        if have is None:  # the store did not answer in time: no promise, no rewrites
            st.start, st.saved = start, max(st.saved, start)
            return 0, False
        st.start, st.saved = start, have
        return max(0, min(have, usable) - start) * self.block_size, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is None or num_external_tokens <= 0:
            return
        block_ids = list(blocks.get_block_ids()[0])
        start = st.start
        count = num_external_tokens // self.block_size
        st.load = BlockMoves(request.request_id, st.names[start:start + count],
                             block_ids[start:start + count])
        st.saved = max(st.saved, start + count)

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
        return meta

    def _plan(self, st: _Req, computed: int, scheduled: int,
              meta: RadixkvConnectorMetadata) -> None:
        """This step's load of `st` and the save of the blocks the step
        completes (`computed` tokens before it, `scheduled` in it)."""
        if st.load is not None:
            meta.loads.append(st.load)
            st.load = None
        # Fewer computed tokens than saved blocks: vLLM rolled the request
        # back (a block failed to load): its blocks are saved again once
        # recomputed.
        st.saved = min(st.saved, computed // self.block_size)
        full = min((computed + scheduled) // self.block_size, len(st.names),
                   len(st.block_ids))
        if full > st.saved:
            meta.saves.append(BlockMoves(st.request.request_id, st.names[st.saved:full],
                                         st.block_ids[st.saved:full], st.block_ids[:st.saved]))
            st.saved = full

    def request_finished(self, request: "Request",
                         block_ids: List[int]) -> Tuple[bool, Optional[dict]]:
        self._reqs.pop(request.request_id, None)
        return False, None  # saves are done within their step: the blocks are free to go

    # -- worker side ------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]) -> None:
        num_blocks = self._kv_cache_config.num_blocks
        layers, dtypes = [], set()
        for name, t in kv_caches.items():
            dims = [d for d in range(t.dim()) if t.shape[d] == num_blocks]
            if t.dim() >= 2 and t.shape[0] == 2 and 1 in dims:
                dims = [1]  # vLLM's [2 (K, V), blocks, ...]
            if len(dims) != 1:
                raise ValueError(f"radixkv's vLLM connector cannot find the block dimension of "
                                 f"layer {name}'s cache {tuple(t.shape)} ({num_blocks} blocks)")
            layers.append((t, dims[0]))
            dtypes.add(t.dtype)
        if len(dtypes) != 1:
            raise ValueError(f"radixkv's vLLM connector needs one K/V dtype, got {dtypes}")
        self._layers = layers
        page_elems = sum(t.select(d, 0).numel() for t, d in layers)
        layout = self._page_from_config(self._kv_cache_config)[0]
        self._open(layout, len(layers), page_elems, dtypes.pop())

    def _block(self, b: int):
        """Block b of every layer, as views."""
        return [t.select(d, b) for t, d in self._layers]

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        for load in getattr(meta, "loads", ()):
            done = [False] * len(load.block_ids)

            def take(i: int, page: Optional[torch.Tensor], load=load, done=done) -> bool:
                if page is None:
                    return False
                at = 0
                for view in self._block(load.block_ids[i]):
                    view.copy_(page[at:at + view.numel()].view(view.shape))
                    at += view.numel()
                done[i] = True
                return True

            self.store.read(load.names, take)
            if not all(done):  # a block not loaded, and every one after it, is recomputed
                first = done.index(False)
                self._load_errors.update(load.block_ids[first:])
                self._failed_reqs.add(load.req_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads finish in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # whole blocks of every layer are saved in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        failed, self._failed_reqs = self._failed_reqs, set()
        for save in getattr(meta, "saves", ()):
            # This step computed these blocks over blocks that failed to load
            # (its own, or another request's it shares): vLLM recomputes
            # them, and only then are they saved.
            if save.req_id in failed or not self._load_errors.isdisjoint(save.depends):
                continue

            def fill(i: int, page: torch.Tensor, save=save) -> None:
                at = 0
                for view in self._block(save.block_ids[i]):
                    page[at:at + view.numel()].view(view.shape).copy_(view)
                    at += view.numel()

            self.store.write(save.names, fill)

    def get_block_ids_with_load_errors(self) -> set:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None

    def counts(self) -> dict:
        """radixkv's store counts (errors, corrupt pages, skipped calls)."""
        return self.store.counts() if self.store is not None else {}
