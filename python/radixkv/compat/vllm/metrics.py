"""The connector's figures in vLLM's own stats and `/metrics`: each half
counts what it sees (the worker its copies, the scheduler its host tier),
vLLM merges the two every step and hands them to the front end, where
`RadixkvPromMetrics` records them as `vllm:radixkv_*` series, labelled by
model and engine as vLLM's other connectors' are."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

# Counters (summed over steps), by name: (series, label name, label value).
COUNTERS = {
    "loaded_host": ("loaded_blocks", "source", "host"),
    "loaded_store": ("loaded_blocks", "source", "store"),
    "saved_host": ("saved_blocks", "tier", "host"),
    "saved_store": ("saved_blocks", "tier", "store"),
    "failed_load": ("failed_blocks", "op", "load"),
    "failed_save": ("failed_blocks", "op", "save"),
    "failed_store_read": ("failed_blocks", "op", "store_read"),
    "failed_store_write": ("failed_blocks", "op", "store_write"),
    "bytes_device_to_host": ("moved_bytes", "direction", "device_to_host"),
    "bytes_host_to_device": ("moved_bytes", "direction", "host_to_device"),
    "bytes_host_to_store": ("moved_bytes", "direction", "host_to_store"),
    "bytes_store_to_host": ("moved_bytes", "direction", "store_to_host"),
    "host_evicted": ("host_evicted_blocks", None, None),
    "prefetch_timeouts": ("prefetch_timeouts", None, None),
}
# Gauges (the latest value): the host tier's blocks and its size.
GAUGES = {"host_blocks": "host_blocks", "host_capacity": "host_capacity_blocks"}
# Seconds per copy: a load from its start to its end, a save's device read.
LATENCIES = {"load_seconds": "load_seconds", "save_seconds": "save_seconds"}
_DOC = {
    "loaded_blocks": "Blocks radixkv loaded into vLLM's KV cache, by where it found them",
    "saved_blocks": "Blocks radixkv saved, by tier",
    "failed_blocks": "Blocks whose copy failed, by operation (none of them is served)",
    "moved_bytes": "Bytes radixkv moved, by direction",
    "host_evicted_blocks": "Blocks radixkv's host tier gave up for others",
    "prefetch_timeouts": "Store reads a request stopped waiting for (its blocks computed instead)",
    "host_blocks": "Blocks radixkv's host tier holds",
    "host_capacity_blocks": "Blocks radixkv's host tier can hold",
    "load_seconds": "Seconds from a load's start to its end",
    "save_seconds": "Seconds from a save's start until its blocks are in host memory",
}


@dataclasses.dataclass
class RadixkvConnectorStats(KVConnectorStats):
    """`data`: counters and gauges by name (COUNTERS, GAUGES) and latency
    samples (LATENCIES); plain str keys and lists, so it pickles and
    travels as vLLM's stats do."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data: Dict[str, Any] = {}

    def count(self, name: str, n: int = 1) -> None:
        if n:
            self.data[name] = self.data.get(name, 0) + n

    def gauge(self, name: str, value: int) -> None:
        self.data[name] = value

    def observe(self, name: str, seconds: float) -> None:
        self.data.setdefault(name, []).append(seconds)

    def is_empty(self) -> bool:
        return not self.data

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in (other.data or {}).items():
            if name in GAUGES:
                self.data[name] = value
            elif isinstance(value, list):
                self.data.setdefault(name, []).extend(value)
            else:
                self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> Dict[str, Any]:
        """What vLLM's log line shows for an interval."""
        out: Dict[str, Any] = {}
        for name, value in self.data.items():
            if isinstance(value, list):
                out[f"{name} (avg)"] = round(sum(value) / len(value), 6) if value else 0
            else:
                out[name] = value
        return out


class RadixkvPromMetrics(KVConnectorPromMetrics):
    """The `vllm:radixkv_*` series of each engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: Dict[type, type],
        labelnames: List[str],
        per_engine_labelvalues: Dict[int, List[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        series: Dict[str, Any] = {}
        for name, label, _ in COUNTERS.values():
            if name not in series:
                extra = [label] if label else []
                series[name] = self._counter_cls(
                    name=f"vllm:radixkv_{name}",
                    documentation=_DOC[name],
                    labelnames=labelnames + extra,
                )
        for name in GAUGES.values():
            series[name] = self._gauge_cls(
                name=f"vllm:radixkv_{name}",
                documentation=_DOC[name],
                labelnames=labelnames,
                multiprocess_mode="mostrecent",
            )
        for name in LATENCIES.values():
            series[name] = self._histogram_cls(
                name=f"vllm:radixkv_{name}",
                documentation=_DOC[name],
                labelnames=labelnames,
                buckets=[1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5, 1.0, 5.0],
            )
        self._series = series

    def _child(self, name: str, engine: int, *extra: str):
        return self._series[name].labels(*self.per_engine_labelvalues[engine], *extra)

    def observe(self, transfer_stats_data: Dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            if key in COUNTERS:
                name, label, label_value = COUNTERS[key]
                extra = [label_value] if label_value is not None else []
                self._child(name, engine_idx, *extra).inc(value)
            elif key in GAUGES:
                self._child(GAUGES[key], engine_idx).set(value)
            elif key in LATENCIES:
                child = self._child(LATENCIES[key], engine_idx)
                for seconds in value:
                    child.observe(seconds)
