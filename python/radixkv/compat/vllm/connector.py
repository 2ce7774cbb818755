"""radixkv's host and storage tiers behind vLLM: a KV connector (vLLM 0.32's
`KVConnectorBase_V1`) that keeps each full block of a prompt, once
computed, in radixkv's host tier and writes it through to radixkv's file
store or Mooncake Store, and loads the blocks a new request finds there
into the blocks vLLM gave it: a prefix computed once serves every later
request of every instance sharing the store, after vLLM's own prefix
cache has dropped it or restarted.

    --kv-transfer-config '{"kv_connector": "RadixkvConnector",
        "kv_connector_module_path": "radixkv.compat.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"host_bytes": 4294967296,
                                      "backend": "file", "directory": "/var/cache/kv"}}'

This class only dispatches: the scheduler half (`scheduler.SchedulerSide`)
plans, the worker half (`worker.WorkerSide`) copies; `config` reads the
extra config (its keys: `config.KEYS`), `metrics` gives vLLM the
figures. One rank (no tensor or pipeline parallelism), full-attention
models with one KV cache group; anything else is refused at start-up.
Under vLLM's default `kv_load_failure_policy` ("fail") a load can fail only
on a failed copy: blocks are offered from pinned, ready host pages only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Optional, Set, Tuple

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from radixkv.compat.vllm.config import Settings, check_parallel
from radixkv.compat.vllm.metadata import RadixkvConnectorMetadata
from radixkv.compat.vllm.metrics import RadixkvConnectorStats, RadixkvPromMetrics
from radixkv.compat.vllm.scheduler import SchedulerSide
from radixkv.compat.vllm.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


class RadixkvConnector(KVConnectorBase_V1):
    """vLLM's KV connector over radixkv's host tier and its FileStorage or
    MooncakeStorage."""

    def __init__(
        self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: Any = None
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        check_parallel(vllm_config)
        settings = Settings.parse(self._kv_transfer_config.kv_connector_extra_config)
        self.scheduler: Optional[SchedulerSide] = None
        self.worker: Optional[WorkerSide] = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = SchedulerSide(vllm_config, kv_cache_config, settings)
        else:
            self.worker = WorkerSide(vllm_config, kv_cache_config, settings)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: Dict[str, Any]) -> bool:
        """Loads inside the step wait layer by layer (`wait_for_layer_load`),
        which a replayed full CUDA graph would skip."""
        return True

    # A best-effort cache: a preempted request's output need not be kept for us.
    @property
    def requires_kv_delivery(self) -> bool:
        return False

    def _scheduler(self) -> SchedulerSide:
        if self.scheduler is None:
            raise RuntimeError("radixkv's vLLM connector: a scheduler call on a worker's connector")
        return self.scheduler

    def _worker(self) -> WorkerSide:
        if self.worker is None:
            raise RuntimeError(
                "radixkv's vLLM connector: a worker call on the scheduler's connector"
            )
        return self.worker

    # -- scheduler half -------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: "Request", num_computed_tokens: int
    ) -> Tuple[Optional[int], bool]:
        return self._scheduler().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int
    ) -> None:
        self._scheduler().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self._scheduler().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler().update_connector_output(connector_output)

    def request_finished(
        self, request: "Request", block_ids: List[int]
    ) -> Tuple[bool, Optional[dict]]:
        return self._scheduler().request_finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        return self._scheduler().has_pending_push_work()

    def take_events(self) -> Iterable[Any]:
        return self._scheduler().take_events()

    def reset_cache(self) -> Optional[bool]:
        return self.scheduler.reset_cache() if self.scheduler is not None else None

    # -- worker half ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]) -> None:
        self._worker().register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        self._worker().handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker().start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker().wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # whole blocks of every layer are saved after the forward

    def wait_for_save(self) -> None:
        self._worker().wait_for_save(self._meta())

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[set], Optional[set]]:
        return self._worker().get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> Set[int]:
        return self._worker().get_block_ids_with_load_errors()

    def build_connector_worker_meta(self):
        return self._worker().build_worker_meta()

    def _meta(self) -> RadixkvConnectorMetadata:
        meta = self._get_connector_metadata()
        if not isinstance(meta, RadixkvConnectorMetadata):
            raise TypeError(
                f"radixkv's vLLM connector: the step's metadata is {type(meta).__name__}, "
                "not the scheduler half's"
            )
        return meta

    # -- both -----------------------------------------------------------------------------

    def get_kv_connector_stats(self) -> Optional[RadixkvConnectorStats]:
        half = self.scheduler or self._worker()
        return half.get_stats()

    @classmethod
    def build_kv_connector_stats(
        cls, data: Optional[dict] = None
    ) -> Optional[RadixkvConnectorStats]:
        return RadixkvConnectorStats(data=data) if data is not None else RadixkvConnectorStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: "VllmConfig",
        metric_types: Dict[type, type],
        labelnames: List[str],
        per_engine_labelvalues: Dict[int, List[object]],
    ) -> RadixkvPromMetrics:
        return RadixkvPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        half = self.scheduler or self.worker
        if half is not None:
            half.shutdown()

    @property
    def moved(self):
        """The worker half's count of blocks per move (its shutdown logs it)."""
        return self.worker.moved if self.worker is not None else {}
