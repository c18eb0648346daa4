"""The rollout producer: keeps a bounded number of groups in flight through the target.

Invariants:
- at most `groups_in_flight` groups are pending (generating or buffered), so the producer
  never runs further ahead of the trainer than configured;
- a request starts only when the version it will be served with can still be trained on
  (`Hooks.may_request`, admission.may_request): in the synchronous mode that means after the
  previous push is served;
- every request ends in the ledger exactly once: scored into the buffer, or dropped with a
  reason — refused (the target said INVALID_ARGUMENT/OUT_OF_RANGE/...), unavailable,
  busy, adapter_missing, reward_error, error, or shutdown. Nothing is retried blindly: a
  refused prompt is skipped, an unavailable target is asked again after a pause.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

import grpc

from rollwire.common.errors import RollwireError
from rollwire.learner.config import RolloutSection
from rollwire.learner.rollouts.buffer import Buffer
from rollwire.learner.rollouts.groups import ScoredGroup, ScoredSample
from rollwire.learner.tasks.rewards import Reward, score
from rollwire.learner.tasks.task import DataStream, Example, is_correct
from rollwire.runtime.logs import get_logger

log = get_logger(__name__)
BACK_OFF = {"unavailable", "busy", "adapter_missing"}


def drop_reason(exc: BaseException) -> str:
    """The ledger's reason for a request that failed with `exc`."""
    if not isinstance(exc, RollwireError):
        return "error"
    return {
        grpc.StatusCode.INVALID_ARGUMENT: "refused",
        grpc.StatusCode.OUT_OF_RANGE: "refused",
        grpc.StatusCode.FAILED_PRECONDITION: "refused",
        grpc.StatusCode.UNAVAILABLE: "unavailable",
        grpc.StatusCode.DEADLINE_EXCEEDED: "unavailable",
        grpc.StatusCode.RESOURCE_EXHAUSTED: "busy",
        grpc.StatusCode.NOT_FOUND: "adapter_missing",
    }.get(exc.code, exc.code.name.lower())


def request_seed(seed: int, cursor: int) -> int:
    """Sampling seed of the request for data position `cursor` (reproducible across restarts)."""
    return (seed * 1_000_003 + cursor) % (2**63 - 1)


class Hooks(Protocol):
    """What the producer asks of the run around it (wiring.RunHooks in a learner run)."""

    def may_request(self) -> bool:
        """Whether a request may start now (admission.may_request); asked again on every change."""
        ...

    def adapter_missing(self) -> None:
        """A replica did not hold the adapter a request asked for: push it again."""
        ...

    def scored(self, group: ScoredGroup, restarts: int) -> None:
        """A group was scored (before the buffer decides on it); `restarts` by the proxy."""
        ...

    def reward_failed(self, reward: str) -> None:
        """Reward function `reward` raised on a sample; its group is dropped as reward_error."""
        ...


class Producer:
    """Requests groups, scores them and hands them to the buffer."""

    def __init__(
        self,
        client,
        stream: DataStream,
        rewards: list[Reward],
        buffer: Buffer,
        cfg: RolloutSection,
        adapter: str,
        seed: int,
        hooks: Hooks,
    ) -> None:
        self.client, self.stream, self.rewards, self.buffer = client, stream, rewards, buffer
        self.ledger = buffer.ledger
        self.cfg, self.adapter, self.seed, self.hooks = cfg, adapter, seed, hooks
        self.restarts = 0
        self._tasks: set[asyncio.Task] = set()
        self._runner: asyncio.Task | None = None
        self._paused_until = 0.0
        self._stopping = False

    def start(self) -> None:
        self._runner = asyncio.create_task(self._run(), name="rollwire-producer")

    async def stop(self) -> None:
        """Stop requesting; cancel what is in flight (counted as shutdown)."""
        self._stopping = True
        self.ledger.changed.notify()
        tasks = list(self._tasks) + ([self._runner] if self._runner else [])
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _ready(self) -> bool:
        return self._stopping or (
            self.ledger.pending < self.cfg.groups_in_flight
            and time.monotonic() >= self._paused_until
            and self.hooks.may_request()
        )

    async def _run(self) -> None:
        while True:
            await self.ledger.changed.wait_for(self._ready)
            if self._stopping:
                return
            cursor = self.stream.cursor
            example = self.stream.next()
            self.ledger.request()
            task = asyncio.create_task(self._one(example, request_seed(self.seed, cursor)))
            self._tasks.add(task)
            task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task) -> None:
        """A request cancelled at any point (even before it ran) is counted once, as shutdown."""
        self._tasks.discard(task)
        if task.cancelled():
            self._end("shutdown")

    async def _one(self, example: Example, seed: int) -> None:
        try:
            result = await self.client.generate(
                example.prompt,
                self.cfg.n,
                max_new_tokens=self.cfg.max_new_tokens,
                temperature=self.cfg.temperature,
                top_p=self.cfg.top_p,
                top_k=self.cfg.top_k,
                return_kept_tokens=self.cfg.exact_truncated_ratio and (self.cfg.top_p < 1 or self.cfg.top_k > 0),
                seed=seed,
                adapter=self.adapter,
                follow=self.cfg.follow,
                group_key=str(example.id),
            )
        except Exception as exc:  # every failure is counted with a reason, none is fatal
            self._failed(example, exc)
            return
        self.restarts += result.restarts
        group, failures = self._score(example, result)
        self.ledger.generated()
        if failures:
            for failure in failures:
                self.hooks.reward_failed(failure.reward)
            log.warning(
                "reward_failed",
                example=example.id,
                prompt=example.prompt,
                failures=[f"{f.reward}: {f.error}" for f in failures[:3]],
            )
            self.ledger.drop("reward_error")
            return
        self.hooks.scored(group, result.restarts)
        self.buffer.put(group)

    def _score(self, example: Example, result):
        samples, failures = [], []
        for s in result.samples:
            reward, failed = score(s.text, example, self.rewards)
            failures += failed
            samples.append(
                ScoredSample(
                    s.token_ids,
                    s.logprobs,
                    s.token_versions,
                    s.text,
                    s.finish_reason,
                    reward,
                    is_correct(s.text, example.answer),
                    [list(k) for k in s.kept_tokens],
                )
            )
        version = result.adapter.version if result.adapter else 0
        return ScoredGroup(example, list(result.prompt_token_ids), samples, version, result.replica), failures

    def _failed(self, example: Example, exc: BaseException) -> None:
        reason = drop_reason(exc)
        fields = dict(example=example.id, reason=reason, error=str(exc))
        if reason == "error":
            log.error("rollout_failed", **fields, exc_info=exc)
        else:
            log.warning("rollout_dropped", **fields, prompt=example.prompt[:80])
        if reason in BACK_OFF:
            self._pause()
        if reason == "adapter_missing":
            self.hooks.adapter_missing()
        self._end(reason)

    def _end(self, reason: str) -> None:
        self.ledger.generated()
        self.ledger.drop(reason)

    def _pause(self) -> None:
        """Ask the target again only after a pause, so an outage is not hammered."""
        self._paused_until = time.monotonic() + self.cfg.retry_backoff_s
        asyncio.get_running_loop().call_later(self.cfg.retry_backoff_s, self.ledger.changed.notify)
