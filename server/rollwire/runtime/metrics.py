"""Declaring Prometheus metrics the same way in every process: each layer names its series
`rollwire_<layer>_...` (docs/metrics.md) in a registry of its own, so several services can run
in one process (the tests) without their series mixing.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class MetricFactory:
    """Builds metrics named `prefix + name` in `registry`; labels come from fixed sets only."""

    def __init__(self, prefix: str, registry: CollectorRegistry) -> None:
        self.prefix, self.registry = prefix, registry

    def counter(self, name: str, text: str, labels: Sequence[str] = ()) -> Counter:
        return Counter(self.prefix + name, text, list(labels), registry=self.registry)

    def gauge(self, name: str, text: str, labels: Sequence[str] = ()) -> Gauge:
        return Gauge(self.prefix + name, text, list(labels), registry=self.registry)

    def histogram(self, name: str, text: str, labels: Sequence[str] = (), *, buckets: Sequence[float]) -> Histogram:
        return Histogram(self.prefix + name, text, list(labels), buckets=buckets, registry=self.registry)
