"""The learner's main loop: request rollouts, take a batch, step, publish, record.

The synchronous baseline (`buffer.max_staleness = 0`) is this same loop: the producer then
only requests with the newest weights and the push is awaited before the next batch.
The named steps are session.py's; wiring.py builds the run, admission.py decides which
rollouts are requested and trained, report.py writes what the run tells people, and
buffer.py / publisher.py / producer.py state their invariants.
"""

from __future__ import annotations

import asyncio
import os
import signal

from rollwire.learner.config import LearnerConfig
from rollwire.learner.run.session import Session
from rollwire.learner.run.wiring import open_session
from rollwire.runtime.durable import write_ready_file
from rollwire.runtime.logs import get_logger

log = get_logger(__name__)


async def train(s: Session) -> dict:
    """Run until max_steps, max_seconds or a stop request; returns the summary."""
    await s.publish_start()  # the starting weights, so "latest" is ours from the first request
    if s.cfg.eval.at_start:
        await s.evaluate(s.version, "before")
    s.start_producing()
    try:
        while not s.should_stop():
            seconds: dict[str, float] = {}
            with s.phase("wait", seconds):
                batch = await s.next_batch()
            if batch is None:
                break
            with s.phase("train", seconds):
                stats = await s.train_step(batch)
            with s.phase("push", seconds):
                await s.publish(wait=s.cfg.sync)
            s.record(batch, stats, seconds)
    finally:
        await s.shutdown()
    if s.cfg.eval.at_end and s.stop_reason != "signal":
        await s.evaluate(s.publisher.served, "after")
    summary = s.summary()
    s.write_summary(summary)
    return summary


async def run_learner(cfg: LearnerConfig, *, resume: bool = False, ready_file: str | None = None) -> dict:
    """Open a session, serve metrics, stop cleanly on SIGINT/SIGTERM, train."""
    session = await open_session(cfg, resume)
    try:
        metrics_port = session.metrics.serve(cfg.metrics_host, cfg.metrics_port)
        loop, main = asyncio.get_running_loop(), asyncio.current_task()

        def on_signal() -> None:  # the first signal stops cleanly (checkpoint), a second one at once
            if session.stopping.is_set() and main is not None:
                main.cancel()
            session.request_stop("signal")

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        if ready_file:
            write_ready_file(
                ready_file, {"port": session.ingest_port, "metrics_port": metrics_port, "pid": os.getpid()}
            )
        log.info("learner_serving_metrics", port=metrics_port)
        summary = await train(session)
        log.info("learner_done", **{k: v for k, v in summary.items() if k != "evals"})
        return summary
    finally:
        await session.close()
