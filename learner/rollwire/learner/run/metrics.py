"""Prometheus metrics of the learner (`rollwire_learner_*`), one registry per process.

Labels come from fixed sets only: phase (wait, train, push), outcome, drop reason, reward
name (from the config). Gauges hold the last step's value; counters and histograms
accumulate over the run.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server

from rollwire.common.reasons import Reason
from rollwire.learner.publish.publisher import PushRecord
from rollwire.learner.train.trainer import SKIP_REASONS, StepStats
from rollwire.runtime.metrics import MetricFactory

SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
GROUP_OUTCOMES = ("requested", "trained")
DROP_REASONS = (
    "stale",
    "zero_variance",
    "refused",
    "unavailable",
    "busy",
    "adapter_missing",
    "reward_error",
    "error",
    "shutdown",
)
"""The ledger's drop reasons (buffer.py, producer.drop_reason); another code's name may still appear."""
PUSH_OUTCOMES = ("ok", "superseded", "retried", "failed")
STALENESS = (0, 1, 2, 3, 4, 6, 8, 16, 32)
INGEST_OUTCOMES = (
    "accepted",
    *(
        r.value
        for r in (
            Reason.TRAJECTORY_TOO_LARGE,
            Reason.BAD_TRAJECTORY,
            Reason.BAD_TOKEN_ID,
            Reason.GROUP_MISMATCH,
            Reason.GROUP_CLOSED,
            Reason.UNKNOWN_VERSION,
            Reason.STALE_TRAJECTORY,
            Reason.INGEST_FULL,
            Reason.INGEST_QUOTA,
            Reason.LEARNER_STOPPING,
        )
    ),
)
"""What ingest/intake.py answers a trajectory: accepted, or the refusal's reason."""
INGEST_STATES = ("open", "buffered")


class LearnerMetrics:
    """Every metric the learner exports."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        m = MetricFactory("rollwire_learner_", self.registry)
        # counters a dashboard rates exist at 0 from the start (Prometheus' advice): rate() then
        # sees the first drop or failed push instead of a series that appears at 1
        self._training(m)
        self._groups(m)
        self._ingest(m)

    def _training(self, m: MetricFactory) -> None:
        """The trainer's steps: versions, rewards, staleness, loss terms, phases, throughput."""
        self.steps = m.counter("steps_total", "Optimiser steps taken.")
        self.skipped_steps = m.counter(
            "skipped_steps_total", "Optimiser steps not applied, by reason (a non-finite gradient or loss).", ["reason"]
        )
        for reason in SKIP_REASONS:
            self.skipped_steps.labels(reason)
        self.policy_version = m.gauge("policy_version", "Adapter version of the trainer's current weights.")
        self.served_version = m.gauge("served_version", "Newest adapter version the target confirmed serving.")
        self.reward_mean = m.gauge("reward_mean", "Mean reward of the last step's samples.")
        self.reward_std = m.gauge("reward_std", "Reward standard deviation of the last step's samples.")
        self.accuracy = m.gauge("accuracy", "Share of the last step's samples the task's verifier accepts.")
        self.eval_accuracy = m.gauge("eval_accuracy", "Greedy accuracy on the held-out prompts, last scored.")
        self.staleness = m.histogram(
            "staleness",
            "Versions between a trained group's oldest token and the weights it trained.",
            buckets=STALENESS,
        )
        self.token_staleness = m.gauge(
            "token_staleness",
            "Versions between the last step's completion tokens and the weights they trained (mean, max).",
            ["stat"],
        )
        for stat in ("mean", "max"):
            self.token_staleness.labels(stat)
        self.stale_tokens_masked = m.counter(
            "stale_tokens_masked_total", "Completion tokens left out of the loss by buffer.max_token_staleness."
        )
        self.ratio = m.gauge("importance_ratio", "Importance ratio pi/mu over the last step's tokens.", ["stat"])
        self.clip_fraction = m.gauge("clip_fraction", "Share of the last step's tokens the PPO clip zeroed.")
        self.truncated_fraction = m.gauge(
            "truncated_fraction", "Share of the last step's tokens whose importance weight hit ratio_cap."
        )
        self.kl = m.gauge("kl", "Mean per-token KL to the base model (k3) in the last step.")
        self.loss = m.gauge("loss", "Loss of the last step.")
        self.grad_norm = m.gauge("grad_norm", "Gradient norm before clipping, last step.")
        self.phase = m.histogram("step_phase_seconds", "Time per step phase.", ["phase"], buckets=SECONDS)
        self.tokens = m.counter("tokens_total", "Completion tokens trained on.")
        self.kl_reference_local = m.counter(
            "kl_reference_local_total",
            'Steps with train.kl_reference = "replicas" whose Score failed, so the learner computed the reference.',
        )
        self.tokens_per_second = m.gauge("tokens_per_second", "Completion tokens trained per second of the last step.")

    def _groups(self, m: MetricFactory) -> None:
        """Groups requested, trained and dropped; reward errors; pushes."""
        self.groups = m.counter("groups_total", "Groups by outcome (requested, trained).", ["outcome"])
        self.dropped = m.counter("groups_dropped_total", "Groups dropped, by reason.", ["reason"])
        self.pending = m.gauge("groups_pending", "Groups requested and not yet trained, by state.", ["state"])
        self.restarts = m.counter("group_restarts_total", "Groups the proxy restarted on another replica.")
        self.reward_errors = m.counter("reward_errors_total", "Reward functions that raised, by reward.", ["reward"])
        self.pushes = m.counter(
            "pushes_total", "Adapter pushes by outcome (ok, superseded, retried, failed).", ["outcome"]
        )
        self.push_seconds = m.histogram("push_seconds", "From push start to the version being served.", buckets=SECONDS)
        for outcome in GROUP_OUTCOMES:
            self.groups.labels(outcome)
        for reason in DROP_REASONS:
            self.dropped.labels(reason)
        for outcome in PUSH_OUTCOMES:
            self.pushes.labels(outcome)

    def _ingest(self, m: MetricFactory) -> None:
        """Trajectories submitted to the ingest service."""
        self.ingested = m.counter(
            "ingest_trajectories_total",
            "Submitted trajectories by outcome (accepted, or the refusal's reason).",
            ["outcome"],
        )
        self.ingest_staleness = m.histogram(
            "ingest_staleness",
            "Versions between an accepted trajectory's oldest trained token and the version the next batch trains at.",
            buckets=STALENESS,
        )
        self.ingest_pending = m.gauge(
            "ingest_pending_groups", "Ingested groups being assembled (open) or waiting to train (buffered).", ["state"]
        )
        for outcome in INGEST_OUTCOMES:
            self.ingested.labels(outcome)
        for state in INGEST_STATES:
            self.ingest_pending.labels(state)
        self.ingest_held_bytes = m.gauge(
            "ingest_held_bytes", "Bytes ingested groups hold (reserved while open, taken once complete)."
        )

    def know_rewards(self, names: list[str]) -> None:
        """Create each reward function's error counter at 0 (the names come from the config)."""
        for name in names:
            self.reward_errors.labels(name)

    def serve(self, host: str, port: int) -> int:
        """Start the /metrics endpoint; returns the bound port."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server.server_port

    def on_ledger(self, event: str, reason: str, count: int) -> None:
        if event == "dropped":
            self.dropped.labels(reason).inc(count)
        else:
            self.groups.labels(event).inc(count)

    def on_ingest(self, outcome: str, staleness: int | None) -> None:
        self.ingested.labels(outcome).inc()
        if staleness is not None:
            self.ingest_staleness.observe(staleness)

    def on_push(self, record: PushRecord) -> None:
        self.pushes.labels(record.outcome).inc()
        if record.outcome == "ok":
            self.push_seconds.observe(record.seconds)

    def on_step(self, stats: StepStats, staleness: list[int], version: int) -> None:
        self.policy_version.set(version)
        if stats.skipped:  # not applied: the last applied step's gauges stay
            self.skipped_steps.labels(stats.skipped).inc()
            return
        self.steps.inc()
        self.reward_mean.set(stats.reward_mean)
        self.reward_std.set(stats.reward_std)
        self.accuracy.set(stats.accuracy)
        for value in staleness:
            self.staleness.observe(value)
        self.token_staleness.labels("mean").set(stats.token_staleness_mean)
        self.token_staleness.labels("max").set(stats.token_staleness_max)
        self.stale_tokens_masked.inc(stats.stale_tokens_masked)
        self.ratio.labels("mean").set(stats.ratio_mean)
        self.ratio.labels("min").set(stats.ratio_min)
        self.ratio.labels("max").set(stats.ratio_max)
        self.clip_fraction.set(stats.clip_fraction)
        self.truncated_fraction.set(stats.truncated_fraction)
        self.kl.set(stats.kl)
        self.loss.set(stats.loss)
        self.grad_norm.set(stats.grad_norm)
        self.tokens.inc(stats.tokens)
        self.tokens_per_second.set(stats.tokens / max(stats.seconds, 1e-9))
