"""Prometheus metrics of the routing proxy, prefixed `rollwire_proxy_`.

Labels come from fixed sets only: the replica address (members of the replica set; their
series are removed when a replica leaves), the policy name, gRPC code names, adapter names,
per-client limit names. Never request ids or client identities (unbounded).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
PREFIX = "rollwire_proxy_"


class ProxyMetrics:
    def __init__(self, policy: str, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.policy = policy

        def counter(name, text, labels=()):
            return Counter(PREFIX + name, text, list(labels), registry=r)

        def gauge(name, text, labels=()):
            return Gauge(PREFIX + name, text, list(labels), registry=r)

        def histogram(name, text, labels=()):
            return Histogram(PREFIX + name, text, list(labels), buckets=LATENCY_BUCKETS, registry=r)

        self.requests = counter(
            "requests_total", "Generate requests by routing policy and final gRPC code.", ["policy", "code"]
        )
        self.latency = histogram("request_duration_seconds", "From request arrival to its last message.", ["policy"])
        self.queue_wait = histogram("queue_wait_seconds", "Time a request waited for a replica slot.")
        self.queue_depth = gauge("queue_depth", "Requests waiting for a replica slot.")
        self.refused = counter("refused_total", "Requests refused by backpressure (RESOURCE_EXHAUSTED).")
        self.client_errors = counter(
            "client_errors_total",
            "Generate requests ended by a status the client caused (relayed refusals, per-client limits), by code.",
            ["code"],
        )
        self.client_limited = counter(
            "client_limited_total",
            "Requests refused or cut off by a per-client limit: in_flight, queued_tokens or slow_reader.",
            ["limit"],
        )
        self.clients = gauge("clients", "Client identities with requests open or queued at the proxy.")
        self.attempts = counter(
            "replica_attempts_total", "Attempts sent to each replica, by outcome code.", ["replica", "code"]
        )
        self.retries = counter(
            "retries_total",
            "Attempts that failed before the first token and were redone invisibly, by replica.",
            ["replica"],
        )
        self.restarts = counter(
            "restarts_total", "Groups restarted elsewhere after failing mid-stream, by replica.", ["replica"]
        )
        self.ejections = counter("ejections_total", "Circuit-breaker ejections of each replica.", ["replica"])
        self.in_flight = gauge("in_flight_requests", "Groups the proxy runs on each replica now.", ["replica"])
        self.healthy = gauge("replica_healthy", "1 when the replica passes health checks.", ["replica"])
        self.routable = gauge("replica_routable", "1 when the replica takes new work.", ["replica"])
        self.versions = gauge("replica_adapter_version", "Newest adapter version confirmed.", ["replica", "adapter"])
        self.pushes = counter(
            "replica_pushes_total", "Adapter pushes (fan-out and catch-up) by code.", ["replica", "code"]
        )
        self.catchup_pushes = counter(
            "catchup_pushes_total", "Versions pushed to a replica to bring it up to date.", ["replica"]
        )
        self.quarantined = counter(
            "quarantined_versions_total", "Spooled adapter versions every replica refused, moved out of the spool."
        )
        self.fanout_latency = histogram(
            "push_fanout_duration_seconds", "From a spooled push to every healthy replica answering."
        )
        self.replicas = gauge("replicas", "Replicas known to the proxy.")

    def forget_replica(self, address: str) -> None:
        """Drop every series of a replica that left, so dashboards do not show ghosts."""
        for metric in (
            self.attempts,
            self.retries,
            self.restarts,
            self.ejections,
            self.in_flight,
            self.healthy,
            self.routable,
            self.versions,
            self.pushes,
            self.catchup_pushes,
        ):
            for labels in list(metric._metrics):  # prometheus_client keeps children by label tuple
                if labels and labels[0] == address:
                    metric.remove(*labels)
