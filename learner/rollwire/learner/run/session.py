"""The named steps of one learner run, which the main loop (loop.py) calls: take a batch,
step, publish, record, checkpoint, evaluate, shut down, summarise.

The run's parts are assembled from the config in wiring.py; which rollouts are requested,
kept and trained is decided in admission.py; what the run writes and exports is report.py's.

Version numbering: the trainer's weights are always some version `version`. The run starts
by publishing its starting weights as `next_version(checkpoint, target)`; a batch taken at
`version` is trained at it (that is the staleness reference) and the result is published
as `version + 1`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from rollwire.client import AsyncClient
from rollwire.common.errors import FailedPrecondition
from rollwire.common.retries import VERSION_TAKEN
from rollwire.learner.config import LearnerConfig
from rollwire.learner.ingest.intake import Ingest
from rollwire.learner.publish.publisher import Publisher, probe_of
from rollwire.learner.rollouts.admission import staleness
from rollwire.learner.rollouts.buffer import Buffer, GroupLedger
from rollwire.learner.rollouts.groups import ScoredGroup
from rollwire.learner.rollouts.producer import Producer
from rollwire.learner.run import checkpoint
from rollwire.learner.run.metrics import LearnerMetrics
from rollwire.learner.run.report import Report
from rollwire.learner.tasks.evaluate import held_out_accuracy, held_out_episodes
from rollwire.learner.tasks.task import DataStream, Example
from rollwire.learner.train.reference import score_reference
from rollwire.learner.train.trainer import StepStats, Trainer
from rollwire.runtime.logs import get_logger
from rollwire.runtime.waits import wait_at_most

log = get_logger(__name__)


async def target_versions(client: AsyncClient, name: str) -> tuple[str, list[int]]:
    """(model fingerprint, every version of `name` the target or its replicas hold)."""
    status = await client.get_status()
    adapters = list(status.adapters) + [a for r in status.replicas for a in r.adapters]
    return status.model_fingerprint, [v for a in adapters if a.name == name for v in a.versions]


@dataclass(eq=False)
class Session:
    """One learner run; `wiring.open_session(cfg, resume)` builds it."""

    cfg: LearnerConfig
    client: AsyncClient
    trainer: Trainer
    stream: DataStream
    buffer: Buffer
    publisher: Publisher
    producer: Producer
    metrics: LearnerMetrics
    report: Report
    checkpoint_dir: Path
    eval_examples: list[Example]
    step: int
    """Optimiser steps taken, over every run of this run folder."""
    version: int
    """The version of the trainer's weights (see the module docstring)."""
    first_version: int = field(init=False)
    steps_this_run: int = 0
    stop_reason: str = ""
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    background: set[asyncio.Task] = field(default_factory=set)
    last_checkpoint_step: int = field(init=False)
    ingest: Ingest | None = None
    """Trajectories from external producers (LearnerService), when ingest.enabled."""
    ingest_server: grpc.aio.Server | None = None
    ingest_port: int = 0
    """The port LearnerService listens on (0: not served)."""

    def __post_init__(self) -> None:
        self.first_version = self.version
        self.last_checkpoint_step = self.step

    @property
    def ledger(self) -> GroupLedger:
        return self.buffer.ledger

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
        self.report.train_started = time.monotonic()
        if self.cfg.max_seconds:
            asyncio.get_running_loop().call_later(self.cfg.max_seconds, self.request_stop, "max_seconds")
        if not self.cfg.ingest.exclusive:
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
        train = self.cfg.train
        replicas = train.kl_coef > 0 and train.kl_reference == "replicas"
        if replicas and not await score_reference(self.client, batch, self.cfg.client.timeout_s):
            self.metrics.kl_reference_local.inc()
        stats = await asyncio.to_thread(self.trainer.step, batch, self.version)
        if self.ingest is not None:
            self.ingest.on_trained(batch, applied=not stats.skipped)
        self.version += 1
        self.step += 1
        self.steps_this_run += 1
        return stats

    async def publish_start(self, attempts: int = 5) -> None:
        """Publish the starting weights and wait until served, with their probe as every later version
        (publish_probe), so the first version is proved on the replicas too.

        A push cut off by a killed learner can still land on the replicas after this run
        looked at their versions; a version refusal then moves the start above what they hold
        (and the probe, seeded by the version, is taken again for the new number).
        """
        for attempt in range(1, attempts + 1):
            payload, probe = await asyncio.to_thread(self._snapshot)
            try:
                return await self.publisher.publish(self.version, payload, wait=True, probe=probe)
            except FailedPrecondition as exc:
                if exc.reason not in VERSION_TAKEN or attempt == attempts:
                    raise
                _, remote = await target_versions(self.client, self.cfg.adapter_name)
                log.warning("start_version_taken", version=self.version, target_versions=remote, error=exc.message)
                self.version = self.first_version = checkpoint.next_version(self.version, remote)
                self.buffer.next_train_version = self.version
                self.publisher.clear_error()

    async def publish(self, *, wait: bool) -> None:
        payload, probe = await asyncio.to_thread(self._snapshot)
        await self.publisher.publish(self.version, payload, wait=wait, probe=probe)

    def _snapshot(self):
        """The weights to push and, with publish_probe, their probe: taken together, before the next step."""
        probe = probe_of(self.trainer.model, self.version) if self.cfg.publish_probe else None
        return self.trainer.adapter_payload(), probe

    @contextlib.contextmanager
    def phase(self, name: str, seconds: dict):
        started = time.monotonic()
        try:
            yield
        finally:
            seconds[name] = time.monotonic() - started
            self.metrics.phase.labels(name).observe(seconds[name])

    def record(self, batch: list[ScoredGroup], stats: StepStats, seconds: dict) -> None:
        """Report the step; checkpoint and start an evaluation when due."""
        stale = [staleness(g, self.version - 1) for g in batch]  # trained at the version before the step
        self.ledger.check()
        self.report.step(self.step, self.version, self.publisher.served, stale, stats, seconds, self.ledger)
        every = self.cfg.checkpoint.every_steps
        if every and self.step % every == 0:
            self.save_checkpoint()
        if self.cfg.eval.every_steps and self.steps_this_run % self.cfg.eval.every_steps == 0:
            task = asyncio.ensure_future(self.evaluate(self.version, "periodic"))  # runs beside training
            self.background.add(task)
            task.add_done_callback(self.background.discard)

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
        adapter = f"{self.cfg.adapter_name}@{version}"
        if self.cfg.task.kind == "chain":
            result = await held_out_episodes(
                self.client, self.eval_examples, self.cfg.base_model, adapter, self.cfg.eval.concurrency
            )
        else:
            result = await held_out_accuracy(
                self.client, self.eval_examples, adapter, self.cfg.rollout.max_new_tokens, self.cfg.eval.concurrency
            )
        return self.report.evaluation(label, version, self.step, result, time.monotonic() - started)

    async def shutdown(self) -> None:
        """Stop producing, count what is left, finish pushing, checkpoint."""
        for task in self.background:
            task.cancel()
        await asyncio.gather(*self.background, return_exceptions=True)
        await self.producer.stop()
        if self.ingest_server is not None:  # no trajectory is accepted after this point
            await self.ingest_server.stop(1.0)
        if self.ingest is not None:
            self.ingest.stop()
        self.buffer.drain("shutdown")
        # Interrupted: the stack is likely going down too, so the last push gets a short chance.
        flush_s = 5.0 if self.stop_reason == "signal" else self.cfg.client.timeout_s
        try:
            if not await wait_at_most(self.publisher.close(), flush_s):
                log.error("final_push_timed_out", version=self.version, waited_s=flush_s)
        finally:
            if self.step > self.last_checkpoint_step or not checkpoint.load_latest(self.checkpoint_dir):
                self.save_checkpoint()
            self.ledger.check(idle=True)

    def summary(self) -> dict:
        summary = self._summary()
        if self.ingest is not None:
            summary["ingest"] = self.ingest.snapshot()
        return summary

    def _summary(self) -> dict:
        return self.report.summary(
            self.ledger,
            steps=self.steps_this_run,
            step=self.step,
            first_version=self.first_version,
            last_version=self.version,
            served_version=self.publisher.served,
            restarts=self.producer.restarts,
            stop_reason=self.stop_reason,
            sync=self.cfg.sync,
        )

    def write_summary(self, summary: dict) -> Path:
        return self.report.write_summary(summary)

    async def close(self) -> None:
        if self.ingest_server is not None:
            await self.ingest_server.stop(0)
        self.report.close()
        await self.client.close()


def _digest(cfg: LearnerConfig) -> str:
    return hashlib.sha256(cfg.model_dump_json().encode()).hexdigest()[:16]
