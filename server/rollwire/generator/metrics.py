"""Prometheus metrics of a generator replica (names listed in docs/metrics.md).

Each process owns one CollectorRegistry and serves it on its metrics port, so tests can
run several services in one process without their series mixing.
"""

from __future__ import annotations

import grpc
from prometheus_client import CollectorRegistry

from rollwire.common.probe import OUTCOMES as PROOF_OUTCOMES
from rollwire.generator.eviction import OUTCOMES
from rollwire.runtime.metrics import MetricFactory
from rollwire.serving.sessions import SessionMetrics

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class GeneratorMetrics:
    """Every metric a generator exports; labels come from fixed sets only."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        m = MetricFactory("rollwire_generator_", self.registry)
        # each group's counters a dashboard rates exist at 0 from the start (Prometheus' advice),
        # so rate() sees the first failure instead of a series that appears at 1
        self._serving(m)
        self._adapters(m)
        self._proofs(m)
        self._prefix_cache(m)

    def _serving(self, m: MetricFactory) -> None:
        """Requests, tokens, batches: what the replica serves."""
        self.requests = m.counter("requests_total", "Generate requests by final gRPC status code.", ["code"])
        self.tokens = m.counter("tokens_total", "Tokens processed, by kind (prompt or completion).", ["kind"])
        self.ttft = m.histogram(
            "time_to_first_token_seconds", "From request arrival to its first token sent.", buckets=LATENCY_BUCKETS
        )
        self.latency = m.histogram(
            "request_duration_seconds", "From request arrival to its last message.", buckets=LATENCY_BUCKETS
        )
        self.in_flight = m.gauge("in_flight_requests", "Generate requests accepted and not yet finished.")
        self.sessions = SessionMetrics(m)
        self.queue_depth = m.gauge("queue_depth", "Groups accepted and waiting for a batch slot.")
        self.running = m.gauge("running_groups", "Groups being generated now.")
        self.forward_passes = m.counter("forward_passes_total", "Model forward passes (prefill or decode).")
        self.kv_budget_tokens = m.gauge(
            "kv_budget_tokens",
            "KV-cache tokens the transformers engine's running groups may reserve together (transformers."
            "max_batch_tokens, or derived from free memory at start).",
        )
        self.kv_reserved_tokens = m.gauge(
            "kv_reserved_tokens",
            "KV-cache tokens the transformers engine's running groups reserve now (n x (prompt + max_new_tokens) each).",
        )
        self.batch_rows = m.histogram(
            "batch_rows",
            "Sequences in one forward pass (a prefill has one per group: its samples share the prompt).",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
        )
        self.score_requests = m.counter("score_requests_total", "Score requests by final gRPC status code.", ["code"])
        self.scored_tokens = m.counter(
            "scored_tokens_total", "Continuation tokens scored (Score), summed over sequences."
        )
        self.score_latency = m.histogram(
            "score_duration_seconds", "From Score request arrival to its answer.", buckets=LATENCY_BUCKETS
        )
        for code in grpc.StatusCode:
            self.requests.labels(code.name)
            self.score_requests.labels(code.name)
        for kind in ("prompt", "completion"):
            self.tokens.labels(kind)

    def _adapters(self, m: MetricFactory) -> None:
        """Adapter versions served and pushes received."""
        self.adapter_version = m.gauge("adapter_version", "Newest loaded version per adapter.", ["adapter"])
        self.served_tokens = m.counter(
            "served_tokens_total",
            "Completion tokens served, by adapter (base for none) and how many versions behind that adapter's newest "
            "servable version here the version that produced them was (0, 1, 2, 3+).",
            ["adapter", "behind"],
        )
        self.served_tokens.labels("base", "0")
        self.follow_switches = m.counter(
            "follow_switches_total", "Running groups moved onto a newly committed version (adapter.follow)."
        )
        self.served_version = m.gauge(
            "served_version", "Adapter version of the tokens this replica served last, per adapter.", ["adapter"]
        )
        self.adapter_versions_loaded = m.gauge(
            "adapter_versions_loaded", "Versions of each adapter loaded.", ["adapter"]
        )
        self.pushes = m.counter("adapter_pushes_total", "Adapter pushes by final gRPC status code.", ["code"])
        self.push_bytes = m.counter("adapter_push_bytes_total", "Adapter payload bytes received.")
        self.push_paths = m.counter(
            "adapter_push_path_total",
            "Relay hops this replica sent, by the path their bytes took (bulk or grpc) and why (connected, no_offer, "
            "refused, timeout, tls, unreachable).",
            ["path", "reason"],
        )
        self.push_slots = m.gauge(
            "push_slots_used",
            "Push slots held now, of limits.max_concurrent_pushes: plain push streams and striped versions being assembled.",
        )
        self.push_latency = m.histogram(
            "adapter_push_duration_seconds",
            "From first push message to the version being served.",
            buckets=LATENCY_BUCKETS,
        )
        self.adapter_slot_decisions = m.counter(
            "adapter_slot_decisions_total",
            "Steps of the LoRA-slot eviction policy before an adapter version is loaded, by outcome (room, quota_own, "
            "full_unowned, full_own, full_other, quota_refused, full_held; generator/eviction.py).",
            ["outcome"],
        )
        for code in grpc.StatusCode:
            self.pushes.labels(code.name)
        for outcome in OUTCOMES:
            self.adapter_slot_decisions.labels(outcome)

    def _proofs(self, m: MetricFactory) -> None:
        """Behavioural proofs of adapter versions before they are served (proof.py)."""
        self.proofs = m.counter(
            "adapter_proofs_total",
            "Behavioural proofs of adapter versions before they are served (generator/proof.py), by outcome (passed, "
            "failed: a signed probe this replica disagrees with; disputed: an unsigned one; unsupported).",
            ["outcome"],
        )
        self.proof_gap = m.gauge(
            "adapter_proof_gap",
            "Largest |logprob - probe| of the last proof of each adapter name on this replica.",
            ["adapter"],
        )
        self.proof_latency = m.histogram(
            "adapter_proof_duration_seconds",
            "Scoring one version's probe before it is served.",
            buckets=LATENCY_BUCKETS,
        )
        for outcome in PROOF_OUTCOMES:
            self.proofs.labels(outcome)

    def _prefix_cache(self, m: MetricFactory) -> None:
        """The transformers engine's prefill and prefix KV cache."""
        self.prefill_tokens = m.counter(
            "prefill_tokens_total",
            "Prompt tokens the transformers engine computed in prefill passes (a prefix reused from its prefix KV cache "
            "is not computed).",
        )
        self.prefix_lookups = m.counter(
            "prefix_cache_lookups_total", "Prefix KV cache lookups by groups being prefilled, by result.", ["result"]
        )
        self.prefix_hit_tokens = m.counter(
            "prefix_cache_hit_tokens_total", "Prompt tokens whose keys and values came from the prefix KV cache."
        )
        self.prefix_entries = m.gauge("prefix_cache_entries", "Token sequences held in the prefix KV cache.")
        self.prefix_tokens = m.gauge("prefix_cache_tokens", "Tokens held in the prefix KV cache (its budget's unit).")
        self.prefix_bytes = m.gauge("prefix_cache_bytes", "Bytes of keys and values held in the prefix KV cache.")
        self.prefix_evictions = m.counter(
            "prefix_cache_evictions_total",
            "Prefix KV cache entries evicted, by cause (ttl, capacity, adapter, superseded).",
            ["cause"],
        )
        for result in ("hit", "miss"):
            self.prefix_lookups.labels(result)
        for cause in ("ttl", "capacity", "adapter", "superseded"):
            self.prefix_evictions.labels(cause)

    def on_forward(self, rows: int) -> None:
        self.forward_passes.inc()
        self.batch_rows.observe(rows)

    def set_adapters(self, loaded: dict[str, list[int]]) -> None:
        for name, versions in loaded.items():
            self.adapter_version.labels(name).set(versions[-1])
            self.adapter_versions_loaded.labels(name).set(len(versions))
