"""One learner run assembled from its config: task, client, trainer, rewards, buffer and
ledger, publisher, producer, metrics, report and checkpoint state, joined into a Session.

Invariants checked before anything trains:
- a run folder that holds an earlier run's checkpoints is continued only with `resume`;
- the target serves the same base model (by content fingerprint) as `base_model`;
- the first version this run publishes is above the checkpoint's and every version the
  target or its replicas hold (checkpoint.next_version), so a replica never sees a version
  number reused for other weights.

`open_session` takes the target's client, so that the learner's own logic (resume, the loop's
accounting) is tested in this process against a fake of the calls it makes (get_status,
generate, push_adapter, score, close: tests/support/fake_target.py); over real sockets it is
tested with real processes (tests/integration/learner/).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

from rollwire.client import AsyncClient, TlsConfig
from rollwire.common.fingerprint import model_fingerprint
from rollwire.common.signing import KeyFileError, SigningKey
from rollwire.learner.config import LearnerConfig
from rollwire.learner.ingest.intake import Ingest
from rollwire.learner.publish.publisher import Publisher
from rollwire.learner.rollouts.admission import may_request
from rollwire.learner.rollouts.buffer import Buffer, GroupLedger
from rollwire.learner.rollouts.groups import ScoredGroup
from rollwire.learner.rollouts.producer import Producer
from rollwire.learner.run import checkpoint
from rollwire.learner.run.metrics import LearnerMetrics
from rollwire.learner.run.report import Report
from rollwire.learner.run.session import Session, target_versions
from rollwire.learner.tasks.chain import chain_examples
from rollwire.learner.tasks.rewards import build_rewards
from rollwire.learner.tasks.task import DataStream, addition_examples, eval_subset, is_held_out, read_jsonl
from rollwire.learner.train.trainer import Trainer
from rollwire.runtime.dialing import dial_credentials
from rollwire.runtime.logs import get_logger

log = get_logger(__name__)


class LearnerError(RuntimeError):
    """A run that cannot start or continue; the message says what to change."""


def load_task(cfg: LearnerConfig):
    """(train, held_out) examples for the configured task."""
    t = cfg.task
    if t.kind == "addition":
        return addition_examples(t.held_out_fraction)
    if t.kind == "chain":
        return chain_examples(t.held_out_fraction)
    train = read_jsonl(t.train_path)
    if t.held_out_path:
        return train, read_jsonl(t.held_out_path)
    return (
        [e for e in train if not is_held_out(e.prompt, t.held_out_fraction)],
        [e for e in train if is_held_out(e.prompt, t.held_out_fraction)],
    )


def make_client(cfg: LearnerConfig) -> AsyncClient:
    c, found = cfg.client, dial_credentials(cfg.client, "client")  # files read and checked once, at start
    tls = None
    if found.tls:
        tls = TlsConfig(found.root_certificates, found.certificate_chain, found.private_key, found.server_name or None)
    return AsyncClient(
        cfg.target, timeout=c.timeout_s, token=found.token or None, tls=tls, max_attempts=c.max_attempts or None
    )


@dataclass
class RunHooks:
    """The producer's view of the run (producer.Hooks): admission, re-pushes, observations."""

    cfg: LearnerConfig
    buffer: Buffer
    publisher: Publisher
    report: Report

    def may_request(self) -> bool:
        return may_request(
            served=self.publisher.served,
            next_train_version=self.buffer.next_train_version,
            pending=self.buffer.ledger.pending,
            groups_per_step=self.cfg.train.groups_per_step,
            max_staleness=self.cfg.buffer.max_staleness,
        )

    def adapter_missing(self) -> None:
        self.publisher.republish()

    def scored(self, group: ScoredGroup, restarts: int) -> None:
        self.report.on_group(group, restarts)

    def reward_failed(self, reward: str) -> None:
        self.report.on_reward_error(reward)


def _open_run_dir(cfg: LearnerConfig, resume: bool) -> tuple[Path, Path, checkpoint.Checkpoint | None]:
    """(run_dir, its checkpoint folder, the latest checkpoint there); an earlier run's
    checkpoints without `resume` are refused rather than overwritten."""
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    checkpoint_dir = run_dir / "checkpoints"
    saved = checkpoint.load_latest(checkpoint_dir)
    if saved is not None and not resume:
        raise LearnerError(
            f"{checkpoint_dir} holds checkpoints of an earlier run: pass --resume to continue it, or set run_dir to a new folder"
        )
    return run_dir, checkpoint_dir, saved


async def _check_base_model(cfg: LearnerConfig, client: AsyncClient) -> tuple[str, list[int]]:
    """(base_model's fingerprint, the versions of the adapter the target serves); refuses a
    target that serves another base model."""
    fingerprint = await asyncio.to_thread(model_fingerprint, cfg.base_model)
    served_fp, remote = await target_versions(client, cfg.adapter_name)
    if served_fp and served_fp != fingerprint:
        raise LearnerError(
            f"the target serves base model {served_fp}, but base_model {cfg.base_model} is "
            f"{fingerprint}: point both at the same model files"
        )
    return fingerprint, remote


def _signing_key(cfg: LearnerConfig) -> SigningKey | None:
    """The key of signing_key_file (read at start), or None; LearnerError naming the setting."""
    if not cfg.signing_key_file:
        return None
    try:
        return SigningKey.load(cfg.signing_key_file)
    except KeyFileError as exc:
        raise LearnerError(f"signing_key_file: {exc}") from None


async def open_session(cfg: LearnerConfig, resume: bool, client: AsyncClient | None = None) -> Session:
    """Build every part of the run; raises LearnerError when it cannot start as configured.
    `client`: the target (None dials cfg.target); in-process tests give a fake of its calls."""
    signing_key = _signing_key(cfg)  # a bad key file fails before any work
    run_dir, checkpoint_dir, saved = _open_run_dir(cfg, resume)
    metrics = LearnerMetrics()
    ledger = GroupLedger()
    ledger.observers.append(metrics.on_ledger)
    buffer = Buffer(cfg.buffer.max_staleness, cfg.buffer.keep_zero_variance, ledger)
    train, held = load_task(cfg)
    stream = DataStream(train, cfg.seed)
    client = client if client is not None else make_client(cfg)
    fingerprint, remote = await _check_base_model(cfg, client)
    trainer = await asyncio.to_thread(
        Trainer,
        cfg.base_model,
        cfg.train,
        cfg.rollout.temperature,
        cfg.seed,
        max_token_staleness=cfg.buffer.max_token_staleness,
    )
    step = restore(saved, trainer, stream) if saved is not None else 0
    version = checkpoint.next_version(saved.state.version if saved is not None else 0, remote)
    buffer.next_train_version = version
    report = Report(run_dir, metrics, cfg.progress)
    publisher = Publisher(
        client,
        cfg.adapter_name,
        fingerprint,
        trainer.lora_shape,
        ledger.changed,
        cfg.rollout.retry_backoff_s,
        report.on_push,
        signing_key=signing_key,
    )
    rewards = build_rewards(cfg.rewards)
    metrics.know_rewards([r.name for r in rewards])
    hooks = RunHooks(cfg, buffer, publisher, report)
    producer = Producer(client, stream, rewards, buffer, cfg.rollout, f"{cfg.adapter_name}@latest", cfg.seed, hooks)
    session = Session(
        cfg=cfg,
        client=client,
        trainer=trainer,
        stream=stream,
        buffer=buffer,
        publisher=publisher,
        producer=producer,
        metrics=metrics,
        report=report,
        checkpoint_dir=checkpoint_dir,
        eval_examples=eval_subset(held, cfg.task.eval_size, cfg.seed),
        step=step,
        version=version,
    )
    if cfg.ingest.enabled:
        await open_ingest(session, fingerprint)
    _log_ready(session, fingerprint, saved)
    return session


def _log_ready(session: Session, fingerprint: str, saved: checkpoint.Checkpoint | None) -> None:
    cfg = session.cfg
    log.info(
        "learner_ready",
        target=cfg.target,
        base_model=cfg.base_model,
        fingerprint=fingerprint,
        resumed_from=str(saved.path) if saved else None,
        step=session.step,
        version=session.version,
        data_cursor=session.stream.cursor,
        sync=cfg.sync,
    )


async def open_ingest(session: Session, fingerprint: str) -> None:
    """Serve LearnerService into the session's buffer (ingest.enabled)."""
    from rollwire.common.signing import TrustedKeys
    from rollwire.learner.ingest.check import BehaviourCheck
    from rollwire.learner.ingest.receipts import ReceiptCheck
    from rollwire.learner.ingest.service import LearnerServicer, serve_ingest

    cfg = session.cfg
    vocab_size = int(session.trainer.model.config.vocab_size)
    session.ingest = ingest = Ingest(cfg.ingest, session.buffer, lambda: session.publisher.served, vocab_size)
    ingest.on_outcome = session.metrics.on_ingest
    ingest.on_group = lambda group: session.report.on_group(group, 0)  # its rewards reach steps.jsonl
    session.metrics.ingest_pending.labels("open").set_function(lambda: len(ingest.open))
    session.metrics.ingest_pending.labels("buffered").set_function(lambda: ingest.pending() - len(ingest.open))
    session.metrics.ingest_held_bytes.set_function(lambda: ingest.room.held)
    gap = cfg.ingest.max_logprob_gap
    check = BehaviourCheck(gap, session.client.score, cfg.adapter_name) if gap else None
    receipts = None
    if cfg.ingest.receipt_keys_file:
        keys = TrustedKeys.load(cfg.ingest.receipt_keys_file)
        receipts = ReceiptCheck(keys, cfg.adapter_name, cfg.ingest.receipt_max_age_s, cfg.ingest.max_closed_ids)
    servicer = LearnerServicer(session.ingest, cfg.adapter_name, fingerprint, check, receipts)
    session.ingest_server, session.ingest_port = await serve_ingest(cfg.ingest, servicer)


def restore(saved: checkpoint.Checkpoint, trainer: Trainer, stream: DataStream) -> int:
    """Put the checkpoint's adapter, optimiser, RNGs and data cursor back; returns its step."""
    import torch

    trainer.load_adapter(saved.adapter)
    trainer.optimizer.load_state_dict(saved.trainer["optimizer"])
    torch.set_rng_state(saved.trainer["torch_rng"])
    checkpoint.restore_python_rng(saved.state.python_rng)
    stream.cursor = saved.state.data_cursor
    return saved.state.step
