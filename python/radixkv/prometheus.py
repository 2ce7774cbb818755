"""radixkv's figures in a serving engine's own Prometheus registry.

SGLang and vLLM serve `/metrics` with `prometheus_client`; a
`CacheMetricsCollector` registered with that registry adds a CacheManager's
figures (`CacheManager.metrics`) to what it serves, read afresh at each
scrape. The metric names, kinds and help texts are those of
`CacheMetrics.prometheus()`, the plain text that needs no library.

Needs `prometheus_client` (the `radixkv[prometheus]` extra)::

    from prometheus_client import REGISTRY
    from radixkv.prometheus import CacheMetricsCollector

    CacheMetricsCollector(cm, labels={"instance": "a"}, registry=REGISTRY)

A collector yields its figures in the process it was made in. Where an engine
serves `/metrics` from another process through prometheus_client's
multiprocess mode (`PROMETHEUS_MULTIPROC_DIR`, SGLang's way), a
`CacheMetricsExporter` in the cache's process writes the figures into
prometheus_client's own counters and gauges instead, which that mode
carries to the serving process; call its `update()` now and then.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterator, List, Optional, Union

import time

try:
    from prometheus_client import Counter, Gauge
    from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
    from prometheus_client.registry import REGISTRY, Collector, CollectorRegistry
except ModuleNotFoundError as e:
    if e.name is None or e.name.split(".")[0] != "prometheus_client":
        raise
    raise ModuleNotFoundError(
        "radixkv.prometheus needs prometheus_client: " "pip install 'radixkv[prometheus]'",
        name="prometheus_client",
    ) from e

from radixkv.scheduler.metrics import CacheMetrics, check_labels, check_prefix

MetricsSource = Union[Callable[[], CacheMetrics], object]


class CacheMetricsCollector(Collector):
    """At each scrape, the CacheMetrics of `source` as Prometheus metric
    families: a counter (`<prefix>_<figure>_total`) per counter, a gauge
    (`<prefix>_<figure>`) per size, each sample with `labels`.

    `source` is a CacheManager (its `metrics` is read at each scrape) or a
    callable returning CacheMetrics (say, the snapshot the scheduler loop
    took last, where `/metrics` is served by another thread). The collector
    registers itself with `registry` (prometheus_client's default REGISTRY
    unless told; None: not registered, for `registry.register` later); two
    collectors with the same prefix cannot share a registry (ValueError from
    prometheus_client: the names are taken).
    """

    def __init__(
        self,
        source: MetricsSource,
        *,
        prefix: str = "radixkv",
        labels: Optional[Dict[str, str]] = None,
        registry: Optional[CollectorRegistry] = REGISTRY,
    ) -> None:
        if callable(source):
            self._read = source
        elif hasattr(source, "metrics"):
            self._read = lambda: source.metrics
        else:
            raise TypeError(
                f"source must be a CacheManager or a callable returning "
                f"CacheMetrics, got {type(source).__name__}"
            )
        self._prefix = check_prefix(prefix)
        labels = check_labels(labels)
        self._label_names: List[str] = list(labels)
        self._label_values: List[str] = list(labels.values())
        if registry is not None:
            registry.register(self)

    def _families(self, metrics: CacheMetrics, samples: bool) -> Iterator[Metric]:
        for name, kind, doc, value in metrics.families(self._prefix):
            family: Union[CounterMetricFamily, GaugeMetricFamily]
            if kind == "counter":
                family = CounterMetricFamily(name, doc, labels=self._label_names)
            else:
                family = GaugeMetricFamily(name, doc, labels=self._label_names)
            if samples:
                family.add_metric(self._label_values, value)
            yield family

    def collect(self) -> Iterator[Metric]:
        metrics = self._read()
        if not isinstance(metrics, CacheMetrics):
            raise TypeError(
                f"the collector's source gave {type(metrics).__name__}, " "not CacheMetrics"
            )
        yield from self._families(metrics, samples=True)

    def describe(self) -> Iterator[Metric]:
        """The families without samples: registering reads no figure."""
        yield from self._families(CacheMetrics(), samples=False)


class CacheMetricsExporter:
    """Writes the CacheMetrics of `source` (as CacheMetricsCollector takes
    it) into prometheus_client counters and gauges of the same names, kinds
    and help texts, each with `labels`: what multiprocess mode carries to
    the process that serves `/metrics`. `update()` reads the figures and
    writes them, at most once per `min_interval_s` unless `force`."""

    def __init__(
        self,
        source: MetricsSource,
        *,
        prefix: str = "radixkv",
        labels: Optional[Dict[str, str]] = None,
        registry: Optional[CollectorRegistry] = REGISTRY,
        min_interval_s: float = 1.0,
    ) -> None:
        if callable(source):
            self._read = source
        elif hasattr(source, "metrics"):
            self._read = lambda: source.metrics
        else:
            raise TypeError(
                f"source must be a CacheManager or a callable returning "
                f"CacheMetrics, got {type(source).__name__}"
            )
        labels = check_labels(labels)
        self._labels = labels
        self._prefix = check_prefix(prefix)
        self._min_interval_s = float(min_interval_s)
        self._last = float("-inf")
        self._metrics: Dict[str, Union[Counter, Gauge]] = {}
        self._counted: Dict[str, float] = {}
        for name, kind, doc, _ in CacheMetrics().families(self._prefix):
            if kind == "counter":
                # prometheus_client adds the `_total` itself.
                self._metrics[name] = Counter(
                    name[: -len("_total")], doc, list(labels), registry=registry
                )
            else:
                self._metrics[name] = Gauge(
                    name, doc, list(labels), registry=registry, multiprocess_mode="mostrecent"
                )
            self._counted[name] = 0

    def update(self, force: bool = False) -> bool:
        """Writes the figures now (True), or does nothing within
        `min_interval_s` of the last write (False)."""
        now = time.monotonic()
        if not force and now - self._last < self._min_interval_s:
            return False
        self._last = now
        for name, kind, _, value in self._read().families(self._prefix):
            metric = self._metrics[name]
            child = metric.labels(**self._labels) if self._labels else metric
            if kind == "counter":
                grown = value - self._counted[name]
                if grown > 0:
                    child.inc(grown)
                    self._counted[name] = value
            else:
                child.set(value)  # type: ignore[union-attr]
        return True


__all__ = ["CacheMetricsCollector", "CacheMetricsExporter"]
