"""What a learner run tells people, and the numbers behind it.

Per step: one line in `run_dir/steps.jsonl`, a `step` log event, the progress line on a
terminal, and the learner's Prometheus gauges. Per evaluation: one line in `evals.jsonl`.
At the end: `summary.json`. The JSON-lines files are only appended to, so a resumed run
continues them; `summary.json` is replaced atomically, so a reader never sees half of it.
Nothing here decides anything about training: it observes the run and writes.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from rollwire.learner.publish.publisher import PushRecord
from rollwire.learner.rollouts.buffer import GroupLedger
from rollwire.learner.rollouts.groups import ScoredGroup
from rollwire.learner.run.metrics import LearnerMetrics
from rollwire.learner.tasks.evaluate import EvalResult
from rollwire.learner.train.trainer import StepStats
from rollwire.runtime.durable import write_atomic
from rollwire.runtime.logs import get_logger

log = get_logger(__name__)


class Report:
    """Gathers the run's observations as they happen and writes them out."""

    def __init__(self, run_dir: Path, metrics: LearnerMetrics, progress: bool) -> None:
        self.run_dir, self.metrics, self.progress = run_dir, metrics, progress
        self.steps_log = (run_dir / "steps.jsonl").open("a")
        self.started = time.monotonic()
        self.train_started: float | None = None
        self.staleness_seen: list[int] = []
        self.token_staleness: list[tuple[float, int, int]] = []
        """Per step: (mean, max) versions between its tokens and the trained weights, and its token count."""
        self.ratios_fresh: list[float] = []
        self.push_latencies: list[float] = []
        self.evals: list[dict] = []
        self.scored: list[tuple[float, bool]] = []  # (reward, correct) of every sample scored since the last step

    # -- observers ---------------------------------------------------------------------------
    def on_group(self, group: ScoredGroup, restarts: int) -> None:
        self.metrics.restarts.inc(restarts)
        self.scored += [(s.reward, s.correct) for s in group.samples]

    def on_reward_error(self, reward: str) -> None:
        self.metrics.reward_errors.labels(reward).inc()

    def on_push(self, record: PushRecord) -> None:
        self.metrics.on_push(record)
        if record.outcome == "ok":
            self.push_latencies.append(record.seconds)
            self.metrics.served_version.set(record.version)

    # -- writers -----------------------------------------------------------------------------
    def step(
        self,
        step: int,
        version: int,
        served: int,
        stale: list[int],
        stats: StepStats,
        seconds: dict,
        ledger: GroupLedger,
    ) -> dict:
        """Record a step trained into `version` from groups `stale` versions old; returns the steps.jsonl line."""
        self.staleness_seen += stale
        self.token_staleness.append((stats.token_staleness_mean, stats.token_staleness_max, stats.tokens))
        if stats.ratio_mean_fresh is not None:
            self.ratios_fresh.append(stats.ratio_mean_fresh)
        self.metrics.on_step(stats, stale, version)
        self.metrics.served_version.set(served)
        self.metrics.pending.labels("in_flight").set(ledger.in_flight)
        self.metrics.pending.labels("buffered").set(ledger.buffered)
        scored, self.scored = self.scored, []
        line = {
            "step": step,
            "version": version,
            "served": served,
            "rollout_reward_mean": _mean([r for r, _ in scored]),
            "rollout_accuracy": _mean([c for _, c in scored]),
            "elapsed_s": round(time.monotonic() - self.started, 3),
            "staleness_mean": sum(stale) / len(stale),
            "staleness_max": max(stale),
            "phase_seconds": {k: round(v, 4) for k, v in seconds.items()},
            "groups": ledger.snapshot(),
            **{k: _round(v) for k, v in vars(stats).items()},
        }
        self.steps_log.write(json.dumps(line) + "\n")
        self.steps_log.flush()
        keys = ("step", "version", "reward_mean", "accuracy", "staleness_mean", "ratio_mean", "loss")
        log.info("step", **{k: line[k] for k in keys})
        if self.progress and sys.stdout.isatty():
            print("\r" + progress_line(line), end="", flush=True)
        return line

    def evaluation(self, label: str, version: int, step: int, result: EvalResult, seconds: float) -> float | None:
        """Record the held-out evaluation of `version`; returns its accuracy."""
        record = {
            "label": label,
            "version": version,
            "step": step,
            "accuracy": result.accuracy,
            "answered": result.answered,
            "failed": result.failed,
            "elapsed_s": round(time.monotonic() - self.started, 3),
        }
        self.evals.append(record)
        with (self.run_dir / "evals.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")
        if result.accuracy is not None:
            self.metrics.eval_accuracy.set(result.accuracy)
        log.info("evaluated", seconds=round(seconds, 2), **record)
        return result.accuracy

    def summary(
        self,
        ledger: GroupLedger,
        *,
        steps: int,
        step: int,
        first_version: int,
        last_version: int,
        served_version: int,
        restarts: int,
        stop_reason: str,
        sync: bool,
    ) -> dict:
        """The run's summary.json: the facts the session passes, among what this report measured."""
        elapsed = (time.monotonic() - self.train_started) if self.train_started else 0.0
        stale, pushes, ratios = self.staleness_seen, self.push_latencies, self.ratios_fresh
        return {
            "accuracy_before": next((e["accuracy"] for e in self.evals if e["label"] == "before"), None),
            "accuracy_after": next((e["accuracy"] for e in reversed(self.evals) if e["label"] == "after"), None),
            "steps": steps,
            "step": step,
            "first_version": first_version,
            "last_version": last_version,
            "served_version": served_version,
            "groups_per_s": ledger.trained / elapsed if elapsed else 0.0,
            "staleness_mean": _mean(stale),
            "staleness_max": max(stale) if stale else None,
            "token_staleness_mean": _weighted(self.token_staleness),
            "token_staleness_max": max((m for _, m, _ in self.token_staleness), default=None),
            "push_latency_s": _mean(pushes),
            "push_latency_max_s": max(pushes) if pushes else None,
            "ratio_mean_staleness0": _mean(ratios),
            "ratio_max_dev_staleness0": max((abs(r - 1) for r in ratios), default=None),
            "training_seconds": elapsed,
            "groups": ledger.snapshot(),
            "restarts": restarts,
            "stop_reason": stop_reason,
            "evals": self.evals,
            "sync": sync,
        }

    def write_summary(self, summary: dict) -> Path:
        path = self.run_dir / "summary.json"
        write_atomic(path, (json.dumps(summary, indent=2) + "\n").encode())
        return path

    def close(self) -> None:
        self.steps_log.close()


def progress_line(line: dict) -> str:
    """The one-line view of a steps.jsonl line, rewritten in place on a terminal."""
    return (
        f"step {line['step']:5d}  v{line['version']}  reward {line['reward_mean']:.3f}  "
        f"acc {line['accuracy']:.3f}  staleness {line['staleness_mean']:.2f}  "
        f"ratio {line['ratio_mean']:.4f}  dropped {sum(line['groups']['dropped'].values())}"
    )


def _mean(values: list) -> float | None:
    return sum(values) / len(values) if values else None


def _round(value):
    return round(value, 6) if isinstance(value, float) else value


def _weighted(steps: list[tuple[float, int, int]]) -> float | None:
    """The token-weighted mean of per-step means."""
    tokens = sum(n for _, _, n in steps)
    return sum(mean * n for mean, _, n in steps) / tokens if tokens else None
