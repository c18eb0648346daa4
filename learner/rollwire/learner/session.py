"""Everything one learner run holds, assembled from the config, and the named steps the
main loop calls (take a batch, step, publish, record, checkpoint, evaluate, summarise).

Version numbering: the trainer's weights are always some version `version`. The run starts
by publishing its starting weights as `next_version(checkpoint, target)`; a batch taken at
`version` is trained at it (that is the staleness reference) and the result is published
as `version + 1`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import sys
import time
from pathlib import Path

from rollwire.client import AsyncClient
from rollwire.client._common import TlsConfig
from rollwire.common.errors import FailedPrecondition
from rollwire.common.fingerprint import model_fingerprint
from rollwire.common.logs import get_logger
from rollwire.learner import checkpoint
from rollwire.learner.buffer import Buffer, GroupLedger, ScoredGroup, staleness
from rollwire.learner.config import LearnerConfig
from rollwire.learner.evaluate import held_out_accuracy
from rollwire.learner.metrics import LearnerMetrics
from rollwire.learner.producer import Producer
from rollwire.learner.publisher import Publisher, PushRecord
from rollwire.learner.rewards import build_rewards
from rollwire.learner.task import DataStream, addition_examples, eval_subset, is_held_out, read_jsonl
from rollwire.learner.trainer import StepStats, Trainer

log = get_logger(__name__)
VERSION_REFUSALS = {"VERSION_NOT_MONOTONIC", "VERSION_CONFLICT"}


class LearnerError(RuntimeError):
    """A run that cannot start or continue; the message says what to change."""


def load_task(cfg: LearnerConfig):
    """(train, held_out) examples for the configured task."""
    t = cfg.task
    if t.kind == "addition":
        return addition_examples(t.held_out_fraction)
    train = read_jsonl(t.train_path)
    if t.held_out_path:
        return train, read_jsonl(t.held_out_path)
    return (
        [e for e in train if not is_held_out(e.prompt, t.held_out_fraction)],
        [e for e in train if is_held_out(e.prompt, t.held_out_fraction)],
    )


def make_client(cfg: LearnerConfig) -> AsyncClient:
    c = cfg.client
    token = Path(c.token_file).read_text().strip() if c.token_file else None
    tls = None
    if c.tls_ca_file or c.tls_cert_file:
        tls = TlsConfig.from_files(
            c.tls_ca_file or None, c.tls_cert_file or None, c.tls_key_file or None, c.tls_server_name or None
        )
    return AsyncClient(cfg.target, timeout=c.timeout_s, token=token, tls=tls, max_attempts=c.max_attempts)


async def target_versions(client: AsyncClient, name: str) -> tuple[str, list[int]]:
    """(model fingerprint, every version of `name` the target or its replicas hold)."""
    status = await client.get_status()
    adapters = list(status.adapters) + [a for r in status.replicas for a in r.adapters]
    return status.model_fingerprint, [v for a in adapters if a.name == name for v in a.versions]


class Session:
    """One learner run; build it with `await Session.open(cfg, resume)`."""

    @classmethod
    async def open(cls, cfg: LearnerConfig, resume: bool) -> Session:
        self = cls()
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.checkpoint_dir = self.run_dir / "checkpoints"
        saved = checkpoint.load_latest(self.checkpoint_dir)
        if saved is not None and not resume:
            raise LearnerError(
                f"{self.checkpoint_dir} holds checkpoints of an earlier run: pass --resume to continue "
                f"it, or set run_dir to a new folder"
            )
        self.metrics = LearnerMetrics()
        self.ledger = GroupLedger()
        self.ledger.observers.append(self.metrics.on_ledger)
        self.buffer = Buffer(cfg.buffer.max_staleness, cfg.buffer.keep_zero_variance, self.ledger)
        train, held = load_task(cfg)
        self.eval_examples = eval_subset(held, cfg.task.eval_size, cfg.seed)
        self.stream = DataStream(train, cfg.seed)
        self.client = make_client(cfg)
        self.fingerprint = await asyncio.to_thread(model_fingerprint, cfg.base_model)
        served_fp, remote = await target_versions(self.client, cfg.adapter_name)
        if served_fp and served_fp != self.fingerprint:
            raise LearnerError(
                f"the target serves base model {served_fp}, but base_model {cfg.base_model} is "
                f"{self.fingerprint}: point both at the same model files"
            )
        self.trainer = await asyncio.to_thread(Trainer, cfg.base_model, cfg.train, cfg.rollout.temperature, cfg.seed)
        self.step, saved_version = 0, 0
        if saved is not None:
            self._restore(saved)
            saved_version = saved.state.version
        self.version = checkpoint.next_version(saved_version, remote)
        self.first_version = self.version
        self.buffer.next_train_version = self.version
        self.publisher = Publisher(
            self.client,
            cfg.adapter_name,
            self.fingerprint,
            self.trainer.lora_spec,
            self.ledger.changed,
            cfg.rollout.retry_backoff_s,
            self._on_push,
        )
        self.producer = Producer(
            self.client,
            self.stream,
            build_rewards(cfg.rewards),
            self.buffer,
            self.ledger,
            cfg.rollout,
            f"{cfg.adapter_name}@latest",
            cfg.seed,
            self._admit,
            self.publisher.republish,
            on_group=self._on_group,
            on_reward_error=lambda name: self.metrics.reward_errors.labels(name).inc(),
        )
        self.steps_log = (self.run_dir / "steps.jsonl").open("a")
        self.started = time.monotonic()
        self.train_started = None
        self.steps_this_run = 0
        self.staleness_seen: list[int] = []
        self.ratios_fresh: list[float] = []
        self.push_latencies: list[float] = []
        self.evals: list[dict] = []
        self.scored: list[tuple[float, bool]] = []  # (reward, correct) of every sample scored since the last step
        self.stop_reason = ""
        self.stopping = asyncio.Event()
        self.background: set[asyncio.Task] = set()
        self.last_checkpoint_step = self.step
        log.info(
            "learner_ready",
            target=cfg.target,
            base_model=cfg.base_model,
            fingerprint=self.fingerprint,
            resumed_from=str(saved.path) if saved else None,
            step=self.step,
            version=self.version,
            data_cursor=self.stream.cursor,
            sync=cfg.sync,
        )
        return self

    def _restore(self, saved: checkpoint.Checkpoint) -> None:
        import torch

        self.trainer.load_adapter(saved.adapter)
        self.trainer.optimizer.load_state_dict(saved.trainer["optimizer"])
        torch.set_rng_state(saved.trainer["torch_rng"])
        checkpoint.restore_python_rng(saved.state.python_rng)
        self.stream.cursor = saved.state.data_cursor
        self.step = saved.state.step

    # -- the loop's named steps ------------------------------------------------------------
    def _admit(self) -> bool:
        """Start a request only if its version can still be trained on when its batch comes.

        With `pending` groups ahead of it, a new group lands in the batch trained at about
        buffer.next_train_version + pending // groups_per_step; it is sampled at `served` or newer.
        """
        ahead = self.ledger.pending // self.cfg.train.groups_per_step
        return self.publisher.served >= self.buffer.next_train_version + ahead - self.cfg.buffer.max_staleness

    def request_stop(self, reason: str) -> None:
        if not self.stopping.is_set():
            self.stop_reason = reason
            log.info("stopping", reason=reason)
            self.stopping.set()

    def should_stop(self) -> bool:
        if self.cfg.max_steps and self.steps_this_run >= self.cfg.max_steps:
            self.request_stop("max_steps")
        return self.stopping.is_set()

    def start_producing(self) -> None:
        self.train_started = time.monotonic()
        if self.cfg.max_seconds:
            asyncio.get_running_loop().call_later(self.cfg.max_seconds, self.request_stop, "max_seconds")
        self.producer.start()

    async def next_batch(self) -> list[ScoredGroup] | None:
        """The next batch for `self.version`, or None when the run is stopping."""
        take = asyncio.ensure_future(self.buffer.take(self.cfg.train.groups_per_step, self.version))
        stop = asyncio.ensure_future(self.stopping.wait())
        started = time.monotonic()
        while not (await asyncio.wait({take, stop}, timeout=30, return_when=asyncio.FIRST_COMPLETED))[0]:
            log.warning(
                "waiting_for_rollouts",
                seconds=round(time.monotonic() - started),
                version=self.version,
                served=self.publisher.served,
                groups=self.ledger.snapshot(),
            )
        stop.cancel()
        if not take.done():
            take.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await take
            return None
        return take.result()

    async def train_step(self, batch: list[ScoredGroup]) -> StepStats:
        stats = await asyncio.to_thread(self.trainer.step, batch, self.version)
        self.version += 1
        self.step += 1
        self.steps_this_run += 1
        return stats

    async def publish_start(self, attempts: int = 5) -> None:
        """Publish the starting weights and wait until served.

        A push cut off by a killed learner can still land on the replicas after this run
        looked at their versions; a version refusal then moves the start above what they hold.
        """
        payload = await asyncio.to_thread(self.trainer.adapter_payload)
        for attempt in range(1, attempts + 1):
            try:
                return await self.publisher.publish(self.version, payload, wait=True)
            except FailedPrecondition as exc:
                if exc.reason not in VERSION_REFUSALS or attempt == attempts:
                    raise
                _, remote = await target_versions(self.client, self.cfg.adapter_name)
                log.warning("start_version_taken", version=self.version, target_versions=remote, error=exc.message)
                self.version = self.first_version = checkpoint.next_version(self.version, remote)
                self.buffer.next_train_version = self.version
                self.publisher.clear_error()

    async def publish(self, *, wait: bool) -> None:
        payload = await asyncio.to_thread(self.trainer.adapter_payload)
        await self.publisher.publish(self.version, payload, wait=wait)

    @contextlib.contextmanager
    def phase(self, name: str, seconds: dict):
        started = time.monotonic()
        try:
            yield
        finally:
            seconds[name] = time.monotonic() - started
            self.metrics.phase.labels(name).observe(seconds[name])

    def record(self, batch: list[ScoredGroup], stats: StepStats, seconds: dict) -> None:
        """Metrics, the steps.jsonl line, the progress line; checkpoint and evaluation when due."""
        trained_at = self.version - 1
        stale = [staleness(g, trained_at) for g in batch]
        self.staleness_seen += stale
        if stats.ratio_mean_fresh is not None:
            self.ratios_fresh.append(stats.ratio_mean_fresh)
        self.metrics.on_step(stats, stale, self.version)
        self.metrics.served_version.set(self.publisher.served)
        self.metrics.pending.labels("in_flight").set(self.ledger.in_flight)
        self.metrics.pending.labels("buffered").set(self.ledger.buffered)
        self.ledger.check()
        scored, self.scored = self.scored, []
        rollout = {
            "rollout_reward_mean": sum(r for r, _ in scored) / len(scored) if scored else None,
            "rollout_accuracy": sum(c for _, c in scored) / len(scored) if scored else None,
        }
        line = {
            "step": self.step,
            "version": self.version,
            "served": self.publisher.served,
            **rollout,
            "elapsed_s": round(time.monotonic() - self.started, 3),
            "staleness_mean": sum(stale) / len(stale),
            "staleness_max": max(stale),
            "phase_seconds": {k: round(v, 4) for k, v in seconds.items()},
            "groups": self.ledger.snapshot(),
            **{k: _round(v) for k, v in vars(stats).items()},
        }
        self.steps_log.write(json.dumps(line) + "\n")
        self.steps_log.flush()
        log.info(
            "step",
            **{
                k: line[k]
                for k in ("step", "version", "reward_mean", "accuracy", "staleness_mean", "ratio_mean", "loss")
            },
        )
        self._progress(line)
        every = self.cfg.checkpoint.every_steps
        if every and self.step % every == 0:
            self.save_checkpoint()
        if self.cfg.eval.every_steps and self.steps_this_run % self.cfg.eval.every_steps == 0:
            task = asyncio.ensure_future(self.evaluate(self.version, "periodic"))  # runs beside training
            self.background.add(task)
            task.add_done_callback(self.background.discard)

    def _progress(self, line: dict) -> None:
        if self.cfg.progress and sys.stdout.isatty():
            print(
                f"\rstep {line['step']:5d}  v{line['version']}  reward {line['reward_mean']:.3f}  "
                f"acc {line['accuracy']:.3f}  staleness {line['staleness_mean']:.2f}  "
                f"ratio {line['ratio_mean']:.4f}  dropped {sum(line['groups']['dropped'].values())}",
                end="",
                flush=True,
            )

    def save_checkpoint(self) -> None:
        state = checkpoint.LearnerState(
            self.step, self.version, self.stream.cursor, checkpoint.python_rng_state(), _digest(self.cfg)
        )
        path = checkpoint.save(
            self.checkpoint_dir,
            state,
            self.trainer.adapter_payload(),
            self.trainer.optimizer.state_dict(),
            self.cfg.checkpoint.keep,
        )
        self.last_checkpoint_step = self.step
        log.info("checkpoint_saved", path=str(path), step=self.step, version=self.version)

    async def evaluate(self, version: int, label: str) -> float | None:
        """Greedy held-out accuracy of adapter `version` (which must be served)."""
        if not self.eval_examples:
            return None
        await self.publisher.wait_served(version)
        started = time.monotonic()
        result = await held_out_accuracy(
            self.client,
            self.eval_examples,
            f"{self.cfg.adapter_name}@{version}",
            self.cfg.rollout.max_new_tokens,
            self.cfg.eval.concurrency,
        )
        record = {
            "label": label,
            "version": version,
            "step": self.step,
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
        log.info("evaluated", seconds=round(time.monotonic() - started, 2), **record)
        return result.accuracy

    async def shutdown(self) -> None:
        """Stop producing, count what is left, finish pushing, checkpoint."""
        for task in self.background:
            task.cancel()
        await asyncio.gather(*self.background, return_exceptions=True)
        await self.producer.stop()
        self.buffer.drain("shutdown")
        # Interrupted: the stack is likely going down too, so the last push gets a short chance.
        flush_s = 5.0 if self.stop_reason == "signal" else self.cfg.client.timeout_s
        try:
            await asyncio.wait_for(self.publisher.close(), timeout=flush_s)
        except TimeoutError:
            log.error("final_push_timed_out", version=self.version, waited_s=flush_s)
        finally:
            if self.step > self.last_checkpoint_step or not checkpoint.load_latest(self.checkpoint_dir):
                self.save_checkpoint()
            self.ledger.check(idle=True)

    def summary(self) -> dict:
        elapsed = (time.monotonic() - self.train_started) if self.train_started else 0.0
        before = next((e["accuracy"] for e in self.evals if e["label"] == "before"), None)
        after = next((e["accuracy"] for e in reversed(self.evals) if e["label"] == "after"), None)
        stale = self.staleness_seen
        return {
            "accuracy_before": before,
            "accuracy_after": after,
            "steps": self.steps_this_run,
            "step": self.step,
            "first_version": self.first_version,
            "last_version": self.version,
            "served_version": self.publisher.served,
            "groups_per_s": self.ledger.trained / elapsed if elapsed else 0.0,
            "staleness_mean": sum(stale) / len(stale) if stale else None,
            "staleness_max": max(stale) if stale else None,
            "push_latency_s": sum(self.push_latencies) / len(self.push_latencies) if self.push_latencies else None,
            "push_latency_max_s": max(self.push_latencies) if self.push_latencies else None,
            "ratio_mean_staleness0": sum(self.ratios_fresh) / len(self.ratios_fresh) if self.ratios_fresh else None,
            "ratio_max_dev_staleness0": max((abs(r - 1) for r in self.ratios_fresh), default=None),
            "training_seconds": elapsed,
            "groups": self.ledger.snapshot(),
            "restarts": self.producer.restarts,
            "stop_reason": self.stop_reason,
            "evals": self.evals,
            "sync": self.cfg.sync,
        }

    def write_summary(self, summary: dict) -> Path:
        path = self.run_dir / "summary.json"
        tmp = path.with_name(".summary.json.tmp")
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
        os.replace(tmp, path)
        return path

    async def close(self) -> None:
        self.steps_log.close()
        await self.client.close()

    def _on_group(self, group: ScoredGroup, restarts: int) -> None:
        self.metrics.restarts.inc(restarts)
        self.scored += [(s.reward, s.correct) for s in group.samples]

    def _on_push(self, record: PushRecord) -> None:
        self.metrics.on_push(record)
        if record.outcome == "ok":
            self.push_latencies.append(record.seconds)
            self.metrics.served_version.set(record.version)


def _round(value):
    return round(value, 6) if isinstance(value, float) else value


def _digest(cfg: LearnerConfig) -> str:
    return hashlib.sha256(cfg.model_dump_json().encode()).hexdigest()[:16]
