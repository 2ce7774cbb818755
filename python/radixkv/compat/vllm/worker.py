"""The connector's worker half: vLLM's per-layer KV caches described to
radixkv's copy engine (`EngineKVPool`, one slot per block), radixkv's host
pool (one page per block of every layer) and the copy controller's thread
between them, and the store's reads and writes of host pages in place on a
thread of their own (`HostPageIO`). The scheduler plans every copy; this
half starts them and reports them as they finish.

- Loads: a step's synchronous loads start before its forward, which waits
  for each layer (`wait_for_layer_load`); asynchronous ones start after it
  and vLLM learns of them through `finished_recving`. A failed load's
  blocks go to `get_block_ids_with_load_errors`, never served.
- Saves start after the forward (`wait_for_save`) and finish on the copy
  thread while the next step is planned and run; the scheduler asks for a
  flush (`handle_preemptions`, before the forward) when blocks a save still
  reads may have been handed out again.
- Prefetches: store -> host pages, on the store's thread."""

from __future__ import annotations

import collections
import logging
import time
from typing import Any, Dict, List, Optional, Set, Tuple

import torch

from radixkv.compat.vllm.config import BlockLayout, Seeds, Settings
from radixkv.compat.vllm.metadata import (
    Load,
    RadixkvConnectorMetadata,
    RadixkvWorkerMetadata,
    Report,
    Save,
)
from radixkv.compat.vllm.metrics import RadixkvConnectorStats
from radixkv.kvcache.engine_pool import EngineKVPool
from radixkv.kvcache.host_pool import HostKVCache, copy_controller
from radixkv.storage.staged import HostPageIO

log = logging.getLogger("vllm.radixkv")


def _planes(
    name: str, t: torch.Tensor, num_blocks: int, heads: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Layer `name`'s K and V as `[blocks, heads, elements]` views of vLLM's
    tensor (a block is one slot of the copy engine): `[2 (K, V), blocks,
    ...]` (its CUDA backends) or `[blocks, 2, ...]` (its CPU backend, K and
    V halves of each block)."""
    if t.dim() >= 3 and t.shape[0] == 2 and t.shape[1] == num_blocks:
        k, v = t[0], t[1]
    elif t.dim() >= 3 and t.shape[0] == num_blocks and t.shape[1] == 2:
        k, v = t[:, 0], t[:, 1]
    else:
        raise ValueError(
            f"radixkv's vLLM connector: layer {name}'s KV cache {tuple(t.shape)} is neither "
            f"[2 (K, V), {num_blocks} blocks, ...] nor [{num_blocks} blocks, 2 (K, V), ...]; "
            "this attention backend's layout is not served"
        )
    try:
        return k.view(num_blocks, heads, -1), v.view(num_blocks, heads, -1)
    except RuntimeError:
        raise ValueError(
            f"radixkv's vLLM connector: layer {name}'s KV cache {tuple(t.shape)} (strides "
            f"{t.stride()}) does not keep each block's keys and values in one piece"
        ) from None


class WorkerSide:
    def __init__(self, vllm_config: Any, kv_cache_config: Any, settings: Settings) -> None:
        self.settings = settings
        self.layout = BlockLayout.from_config(vllm_config, kv_cache_config)
        self.num_blocks = kv_cache_config.num_blocks
        self.host_pages = self.layout.host_pages(settings)
        model = settings.namespace or vllm_config.model_config.model
        self.seed = Seeds(
            model, self.layout, vllm_config.cache_config.block_size, settings.host_codec
        )(None)
        self.pool: Optional[EngineKVPool] = None
        self.host: Optional[HostKVCache] = None
        self.controller: Any = None  # the copy controller, once the caches are known
        self.io: Optional[HostPageIO] = None
        self.layer_index: Dict[str, int] = {}
        # copy id -> (the plan's copy, when it started)
        self._loads: Dict[int, Tuple[Load, float]] = {}
        self._backups: Dict[int, Tuple[Save, float]] = {}
        self._io_ops: Dict[int, str] = {}  # store op -> "read" or "write"
        self._sync_loading = False
        self._reports: List[Report] = []
        self._recved: Set[str] = set()  # asynchronous loads that finished
        self._load_errors: Set[int] = set()  # this step's, for vLLM
        # Blocks whose load failed -> their request, until the scheduler has
        # seen them: a save planned before that may read K/V computed over them.
        self._poisoned: Dict[int, str] = {}
        self.moved: "collections.Counter[str]" = collections.Counter()
        self.stats = RadixkvConnectorStats()
        self.page_bytes = 0

    # -- the caches -----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]) -> None:
        if not self.host_pages:
            return  # nothing to copy to
        names = list(kv_caches)
        try:
            from vllm.model_executor.models.utils import extract_layer_index

            names.sort(key=extract_layer_index)
        except Exception:  # noqa: BLE001  (an unnumbered name: vLLM's order)
            pass
        ks, vs = [], []
        for name in names:
            k, v = _planes(name, kv_caches[name], self.num_blocks, self.layout.heads)
            ks.append(k)
            vs.append(v)
        expected = self.layout.heads * self.layout.row
        if len(ks) != self.layout.layers or ks[0][0].numel() != expected:
            raise ValueError(
                f"radixkv's vLLM connector: the layers' blocks ({len(ks)} layers of "
                f"{ks[0][0].numel()} elements a side) differ from vLLM's KV cache spec "
                f"({self.layout.layers} of {expected})"
            )
        self.pool = pool = EngineKVPool(ks, vs, page_size=1)
        self.host = HostKVCache(
            pool, num_pages=self.host_pages, layout="page_first", codec=self.settings.host_codec
        )
        self.page_bytes = self.host.page_bytes
        self.controller = copy_controller(pool, self.host)
        self.layer_index = {name: i for i, name in enumerate(names)}
        if self.settings.storage is not None:
            self.io = HostPageIO.open_for(
                self.settings.storage, self.seed, self.host, self.settings.host_codec
            )

    # -- a step ---------------------------------------------------------------------------

    def handle_preemptions(self, meta: Any) -> None:
        if isinstance(meta, RadixkvConnectorMetadata) and meta.flush and self._backups:
            self.controller.drain()  # the saves' device reads, before blocks are reused
            self._collect()

    def start_load_kv(self, meta: RadixkvConnectorMetadata) -> None:
        for block in meta.seen_errors:  # vLLM rolled them back
            self._poisoned.pop(block, None)
        ctl = self.controller
        sync = [load for load in meta.loads if not load.is_async]
        if sync:
            if ctl is None:
                raise RuntimeError("radixkv's vLLM connector: a load before register_kv_caches")
            now = time.perf_counter()
            for load in sync:
                self._loads[ctl.load(load.pages, load.block_ids)] = (load, now)
            ctl.start_loading()
            self._sync_loading = True
        for fetch in meta.prefetches:
            if self.io is None:
                raise RuntimeError("radixkv's vLLM connector: a store read without a store")
            self._io_ops[fetch.op] = "read"
            self.io.read(fetch.op, fetch.names, fetch.pages)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._sync_loading:
            self.controller.wait_layer(self.layer_index[layer_name])

    def wait_for_save(self, meta: RadixkvConnectorMetadata) -> None:
        ctl = self.controller
        if self._sync_loading:  # every layer is in place once the forward ran
            ctl.wait_loads()
            self._sync_loading = False
        self._collect()  # a failed load of this step is known before its saves start
        failed = set(self._poisoned.values())
        now = time.perf_counter()
        for save in meta.saves:
            # Blocks that failed to load, or computed over such blocks (of
            # this request or of another it shares them with): recomputed,
            # then saved.
            if save.req_id in failed or any(
                b in self._poisoned for b in save.depends + save.block_ids
            ):
                self._report_save(save, [False] * len(save.pages))
                continue
            self._backups[ctl.backup(save.block_ids, save.pages)] = (save, now)
        started = False
        for load in meta.loads:
            if load.is_async:
                self._loads[ctl.load(load.pages, load.block_ids)] = (load, now)
                started = True
        if started:
            ctl.start_loading()

    def _report_save(self, save: Save, oks: List[bool]) -> None:
        self._reports.append((save.op, "filled", oks))
        if save.names:
            self._reports.append((save.op, "stored", [False] * len(oks)))
        self.stats.count("failed_save", oks.count(False))

    # -- what finished --------------------------------------------------------------------

    def _collect(self) -> None:
        ctl = self.controller
        if ctl is None:
            return
        now = time.perf_counter()
        pb = self.page_bytes
        for cid, ok in ctl.take_backup_acks():
            save, start = self._backups.pop(cid)
            n = len(save.pages)
            self._reports.append((save.op, "filled", [ok] * n))
            if ok:
                self.moved["saved to host"] += n
                self.stats.count("saved_host", n)
                self.stats.count("bytes_device_to_host", n * pb)
                self.stats.observe("save_seconds", now - start)
            else:
                self.stats.count("failed_save", n)
            if save.names:
                if ok and self.io is not None:
                    self._io_ops[save.op] = "write"
                    self.io.write(save.op, save.names, save.pages)
                else:
                    self._reports.append((save.op, "stored", [False] * n))
        for cid, ok in ctl.take_load_acks():
            load, start = self._loads.pop(cid)
            n = len(load.pages)
            self._reports.append((load.op, "loaded", [ok] * n))
            if ok:
                self.moved["loaded from host"] += n - load.from_store
                self.moved["loaded from store"] += load.from_store
                if load.is_async:
                    self.moved["loaded asynchronously"] += n
                self.stats.count("loaded_host", n - load.from_store)
                self.stats.count("loaded_store", load.from_store)
                self.stats.count("bytes_host_to_device", n * pb)
                self.stats.observe("load_seconds", now - start)
            else:
                self.moved["failed to load"] += n
                self.stats.count("failed_load", n)
                self._load_errors.update(load.block_ids)
                self._poisoned.update((b, load.req_id) for b in load.block_ids)
            if load.is_async:
                self._recved.add(load.req_id)
        if self.io is not None:
            for op, oks in self.io.take_done():
                kind = self._io_ops.pop(op)
                good = sum(oks)
                if kind == "read":
                    self._reports.append((op, "filled", oks))
                    self.moved["read from store"] += good
                    self.moved["store reads failed"] += len(oks) - good
                    self.stats.count("bytes_store_to_host", good * pb)
                    self.stats.count("failed_store_read", len(oks) - good)
                else:
                    self._reports.append((op, "stored", oks))
                    self.moved["saved to store"] += good
                    self.stats.count("saved_store", good)
                    self.stats.count("bytes_host_to_store", good * pb)
                    self.stats.count("failed_store_write", len(oks) - good)

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[set], Optional[set]]:
        self._collect()
        recved, self._recved = self._recved, set()
        return None, (recved or None)

    def get_block_ids_with_load_errors(self) -> Set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_worker_meta(self) -> RadixkvWorkerMetadata:
        self._collect()
        reports, self._reports = self._reports, []
        return RadixkvWorkerMetadata(reports)

    def get_stats(self) -> Optional[RadixkvConnectorStats]:
        if self.stats.is_empty():
            return None
        out, self.stats = self.stats, RadixkvConnectorStats()
        return out

    def shutdown(self) -> None:
        if self.controller is not None:
            self.controller.drain()
        if self.io is not None:
            self.io.close()
            self.io = None
        if self.moved:
            log.info(
                "radixkv connector: blocks %s",
                ", ".join(f"{what} {count}" for what, count in sorted(self.moved.items())),
            )
