"""Prometheus metrics of a generator replica (names listed in docs/metrics.md).

Each process owns one CollectorRegistry and serves it on its metrics port, so tests can
run several services in one process without their series mixing.
"""

from __future__ import annotations

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class GeneratorMetrics:
    """Every metric a generator exports; labels come from fixed sets only."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        p = "rollwire_generator_"
        self.requests = Counter(
            p + "requests_total", "Generate requests by final gRPC status code.", ["code"], registry=r
        )
        self.tokens = Counter(
            p + "tokens_total", "Tokens processed, by kind (prompt or completion).", ["kind"], registry=r
        )
        self.ttft = Histogram(
            p + "time_to_first_token_seconds",
            "From request arrival to its first token.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.latency = Histogram(
            p + "request_duration_seconds",
            "From request arrival to its last message.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(p + "in_flight_requests", "Generate requests accepted and not yet finished.", registry=r)
        self.queue_depth = Gauge(p + "queue_depth", "Groups accepted and waiting for a batch slot.", registry=r)
        self.running = Gauge(p + "running_groups", "Groups being generated now.", registry=r)
        self.forward_passes = Counter(
            p + "forward_passes_total", "Model forward passes (prefill or decode).", registry=r
        )
        self.batch_rows = Histogram(
            p + "batch_rows", "Sequences in one forward pass.", buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r
        )
        self.adapter_version = Gauge(
            p + "adapter_version", "Newest loaded version per adapter.", ["adapter"], registry=r
        )
        self.adapter_versions_loaded = Gauge(
            p + "adapter_versions_loaded", "Versions of each adapter loaded.", ["adapter"], registry=r
        )
        self.pushes = Counter(
            p + "adapter_pushes_total", "Adapter pushes by final gRPC status code.", ["code"], registry=r
        )
        self.push_bytes = Counter(p + "adapter_push_bytes_total", "Adapter payload bytes received.", registry=r)
        self.push_latency = Histogram(
            p + "adapter_push_duration_seconds",
            "From first push message to the version being served.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

        # counters a dashboard rates exist at 0 from the start (Prometheus' advice), so rate()
        # sees the first failure instead of a series that appears at 1
        for code in grpc.StatusCode:
            self.requests.labels(code.name)
            self.pushes.labels(code.name)
        for kind in ("prompt", "completion"):
            self.tokens.labels(kind)

    def on_forward(self, rows: int) -> None:
        self.forward_passes.inc()
        self.batch_rows.observe(rows)

    def set_adapters(self, loaded: dict[str, list[int]]) -> None:
        for name, versions in loaded.items():
            self.adapter_version.labels(name).set(versions[-1])
            self.adapter_versions_loaded.labels(name).set(len(versions))
