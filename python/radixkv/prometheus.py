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

A collector yields its figures in the process it was made in: where an engine
runs prometheus_client's multiprocess mode (`PROMETHEUS_MULTIPROC_DIR`), make
it in the process that serves `/metrics`, or read the figures there.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterator, List, Optional, Union

try:
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


__all__ = ["CacheMetricsCollector"]
