"""A CacheManager's figures: counters since it was made and the pools' sizes now,
readable in Python and as Prometheus text (radixkv.prometheus puts them in a
prometheus_client registry)."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any, Callable, Dict, List, Optional, Tuple

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")

# name: (kind, help); the counters get Prometheus' `_total` suffix.
_DOC = {
    "queries": ("counter", "Requests matched against the cache (match_req)."),
    "query_tokens": ("counter", "Tokens those requests asked about (all but each last one)."),
    "hit_tokens": ("counter", "Tokens matched on any tier (device + host + storage hits)."),
    "device_hit_tokens": ("counter", "Tokens matched on the device."),
    "host_hit_tokens": (
        "counter",
        "Tokens matched in host memory from host copies of device pages (to be loaded back).",
    ),
    "storage_hit_tokens": (
        "counter",
        "Tokens matched in host memory whose pages were read from storage and not on the "
        "device since (to be loaded back).",
    ),
    "evicted_tokens": ("counter", "Tokens evicted from the device pool."),
    "backed_up_tokens": ("counter", "Tokens copied from the device to host memory."),
    "loaded_back_tokens": ("counter", "Tokens copied from host memory back to the device."),
    "host_evicted_tokens": ("counter", "Tokens whose host copy was dropped."),
    "storage_written_pages": ("counter", "Pages written to the storage tier."),
    "storage_prefetched_tokens": ("counter", "Tokens read from the storage tier into host."),
    "storage_errors": ("counter", "Failed storage calls and pages."),
    "storage_corrupt_pages": (
        "counter",
        "Pages read from storage that failed their checks "
        "(and entries there that were not pages), removed.",
    ),
    "storage_skipped_reads": (
        "counter",
        "Prefetches not tried while reads were left alone " "(or a query was unanswered).",
    ),
    "storage_skipped_writes": (
        "counter",
        "Writes to storage not tried while writes were " "left alone.",
    ),
    "storage_query_timeouts": (
        "counter",
        "Existence queries to storage that did not answer " "within the bound.",
    ),
    "retain_claims_made": ("counter", "Retention claims made (retain)."),
    "retain_claims_refused": ("counter", "Retention claims refused by a retain budget."),
    "retain_claims_expired": ("counter", "Retention claims ended by their deadline."),
    "device_capacity_tokens": ("gauge", "Slots of the device pool."),
    "device_free_tokens": ("gauge", "Free slots of the device pool."),
    "device_cached_tokens": ("gauge", "Device slots the cache holds (resident)."),
    "device_locked_tokens": (
        "gauge",
        "Of the cached device slots, those locked (by requests, retention claims or copies in "
        "flight) or kept until they have a host copy: not evictable.",
    ),
    "device_held_tokens": ("gauge", "Device slots requests hold (allocated, not yet cached)."),
    "device_loading_tokens": ("gauge", "Device slots loads from host in flight own."),
    "host_capacity_tokens": ("gauge", "Slots of the host pool."),
    "host_free_tokens": ("gauge", "Free slots of the host pool."),
    "host_cached_tokens": ("gauge", "Host slots the cache holds (resident)."),
    "host_only_tokens": ("gauge", "Of the cached host slots, those not on the device."),
    "host_backing_up_tokens": ("gauge", "Host slots backups from the device in flight own."),
    "host_reading_tokens": ("gauge", "Host slots reads from storage in flight own."),
    "host_storage_writing_tokens": (
        "gauge",
        "Of the cached host slots, those being written to storage.",
    ),
    "retain_claims": ("gauge", "Retention claims held now."),
    "retained_tokens": ("gauge", "Cached tokens at least one retention claim holds."),
}


class Counters:
    """The counters a CacheManager keeps itself (its tiers keep theirs):
    requests matched, the tokens they asked about, the hits by the tier
    serving them, the tokens evicted from the device. Named as CacheMetrics'
    fields."""

    __slots__ = (
        "queries",
        "query_tokens",
        "hit_tokens",
        "device_hit_tokens",
        "host_hit_tokens",
        "storage_hit_tokens",
        "evicted_tokens",
    )

    def __init__(self) -> None:
        self.queries = self.query_tokens = self.hit_tokens = 0
        self.device_hit_tokens = self.host_hit_tokens = self.storage_hit_tokens = 0
        self.evicted_tokens = 0

    def matched(self, tokens: int, handles, storage_hit_len: Callable[[Any], int]) -> None:
        """Requests asking about `tokens` tokens in all were matched to
        `handles`. Each hit is the tier's that serves it, decided now: a
        handle's host part is the storage tier's as far as
        `storage_hit_len(handle)` says (pages read from storage and not on
        the device since), the host tier's beyond."""
        device = host = 0
        for handle in handles:
            device += handle.cached_len
            host += handle.host_hit_len
        self.queries += len(handles)
        self.query_tokens += tokens
        self.device_hit_tokens += device
        self.hit_tokens += device + host
        if host:
            for handle in handles:
                if handle.host_hit_len:
                    storage = storage_hit_len(handle)
                    self.storage_hit_tokens += storage
                    self.host_hit_tokens += handle.host_hit_len - storage

    def figures(self) -> Dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


@dataclass(frozen=True)
class CacheMetrics:
    """What `CacheManager.metrics` returns: a snapshot. Counters only grow;
    the host and storage ones stay 0 without those tiers."""

    queries: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    storage_hit_tokens: int = 0
    evicted_tokens: int = 0
    backed_up_tokens: int = 0
    loaded_back_tokens: int = 0
    host_evicted_tokens: int = 0
    storage_written_pages: int = 0
    storage_prefetched_tokens: int = 0
    storage_errors: int = 0
    storage_corrupt_pages: int = 0
    storage_skipped_reads: int = 0
    storage_skipped_writes: int = 0
    storage_query_timeouts: int = 0
    retain_claims_made: int = 0
    retain_claims_refused: int = 0
    retain_claims_expired: int = 0
    device_capacity_tokens: int = 0
    device_free_tokens: int = 0
    device_cached_tokens: int = 0
    device_locked_tokens: int = 0
    device_held_tokens: int = 0
    device_loading_tokens: int = 0
    host_capacity_tokens: int = 0
    host_free_tokens: int = 0
    host_cached_tokens: int = 0
    host_only_tokens: int = 0
    host_backing_up_tokens: int = 0
    host_reading_tokens: int = 0
    host_storage_writing_tokens: int = 0
    retain_claims: int = 0
    retained_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        """Tokens matched (on any tier) over the tokens asked about."""
        return self.hit_tokens / max(1, self.query_tokens)

    def families(self, prefix: str = "radixkv") -> List[Tuple[str, str, str, int]]:
        """(name, kind, help, value) of each figure as Prometheus names it:
        `prefix_` before the field's name, `_total` after a counter's. The
        names, kinds and help texts of `prometheus()` and of
        `radixkv.prometheus.CacheMetricsCollector`."""
        check_prefix(prefix)
        out = []
        for f in fields(self):
            kind, doc = _DOC[f.name]
            name = f"{prefix}_{f.name}" + ("_total" if kind == "counter" else "")
            out.append((name, kind, doc, getattr(self, f.name)))
        return out

    def prometheus(self, prefix: str = "radixkv", labels: Optional[Dict[str, str]] = None) -> str:
        """The figures in Prometheus' text exposition format (version 0.0.4):
        `# HELP` and `# TYPE` lines, then one sample per metric, with
        `labels` (say, the instance's name) on every sample. Written here,
        without prometheus_client; an engine that serves its own `/metrics`
        registers `radixkv.prometheus.CacheMetricsCollector` instead."""
        check_prefix(prefix)
        labels = check_labels(labels)
        label = ""
        if labels:
            parts = []
            for key, label_value in labels.items():
                text = label_value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
                parts.append(f'{key}="{text}"')
            label = "{" + ",".join(parts) + "}"
        lines = []
        for name, kind, doc, value in self.families(prefix):
            lines += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}", f"{name}{label} {value}"]
        return "\n".join(lines) + "\n"


def check_prefix(prefix: str) -> str:
    """`prefix`, a Prometheus metric name (ValueError otherwise)."""
    if not isinstance(prefix, str) or not _METRIC_NAME.fullmatch(prefix):
        raise ValueError(f"prefix must be a Prometheus metric name, got {prefix!r}")
    return prefix


def check_labels(labels: Optional[Dict[str, str]]) -> Dict[str, str]:
    """`labels` (None: none) as label names to string values; TypeError when
    not a dict, ValueError naming a key that is not a Prometheus label name."""
    if labels is None:
        return {}
    if not isinstance(labels, dict):
        raise TypeError(
            f"labels must be a dict of label names to values, got " f"{type(labels).__name__}"
        )
    for key in labels:
        if not isinstance(key, str) or not _LABEL_NAME.fullmatch(key) or key.startswith("__"):
            raise ValueError(f"labels: {key!r} is not a Prometheus label name")
    return {key: str(value) for key, value in labels.items()}
