"""Producer and publisher against fake clients: every failure counted, pushes ordered and bounded."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from rollwire.client._requests import AdapterVersion
from rollwire.client._results import GenerateResult, Sample
from rollwire.common.errors import (
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from rollwire.common.reasons import Reason
from rollwire.common.signing import SigningKey
from rollwire.learner.config import RewardSpec, RolloutSection
from rollwire.learner.publish.publisher import Publisher
from rollwire.learner.rollouts.buffer import Buffer, GroupLedger, Signal
from rollwire.learner.rollouts.producer import Producer
from rollwire.learner.tasks.rewards import build_rewards
from rollwire.learner.tasks.task import DataStream, Example


def result(prompt: str, texts: list[str], version: int = 3) -> GenerateResult:
    samples = [
        Sample(i, [4 + i, 2], [-0.1, -0.2], t, "eos", "policy", version, [version, version], 6, 2)
        for i, t in enumerate(texts)
    ]
    return GenerateResult("r", "replica-1", AdapterVersion("policy", version), [9] * 6, samples)


class FakeGenerator:
    """Answers by prompt: an exception to raise, or the texts of the samples."""

    def __init__(self, answers: dict) -> None:
        self.answers = answers
        self.requests = []

    async def generate(self, prompt, n, **options):
        self.requests.append((prompt, options))
        await asyncio.sleep(0)
        answer = self.answers[prompt]
        if isinstance(answer, Exception):
            raise answer
        return result(prompt, answer)


class Hooks:
    """Admits every request; records the producer's calls for adapters it found missing."""

    def __init__(self) -> None:
        self.missing: list[int] = []

    def may_request(self) -> bool:
        return True

    def adapter_missing(self) -> None:
        self.missing.append(1)

    def scored(self, group, restarts: int) -> None:
        pass

    def reward_failed(self, reward: str) -> None:
        pass


def producer_for(answers: dict, examples: list[Example], rewards=None, in_flight=4):
    ledger = GroupLedger()
    buffer = Buffer(max_staleness=1, keep_zero_variance=False, ledger=ledger)
    hooks = Hooks()
    producer = Producer(
        FakeGenerator(answers),
        DataStream(examples, seed=0),
        build_rewards(rewards or [RewardSpec()]),
        buffer,
        RolloutSection(n=2, groups_in_flight=in_flight, retry_backoff_s=0.01),
        "policy@latest",
        seed=0,
        hooks=hooks,
    )
    return producer, ledger, buffer, hooks.missing


async def run_until(ledger: GroupLedger, producer: Producer, requested: int) -> None:
    producer.start()
    await asyncio.wait_for(ledger.changed.wait_for(lambda: ledger.requested >= requested and ledger.in_flight == 0), 5)
    await producer.stop()


async def test_every_failure_is_dropped_with_its_reason():
    examples = [Example(i, p, "1") for i, p in enumerate(["ok", "long", "down", "busy", "gone", "old", "flaky"])]
    answers = {
        "ok": ["1", "2"],
        "long": InvalidArgument("prompt too long"),
        "down": Unavailable("no replica"),
        "busy": ResourceExhausted("queue full"),
        "gone": NotFound("no adapter"),
        "old": FailedPrecondition("evicted"),
        "flaky": ["1", "2"],
    }
    flaky = RewardSpec(kind="python", name="flaky", function="test_learner_pipeline:_raise_on_flaky")
    producer, ledger, buffer, missing = producer_for(answers, examples, [RewardSpec(), flaky], in_flight=7)
    await run_until(ledger, producer, 7)
    assert len(buffer) == 1
    assert dict(ledger.dropped) == {"refused": 2, "unavailable": 1, "busy": 1, "adapter_missing": 1, "reward_error": 1}
    assert missing == [1]  # the publisher is asked to push the newest version again
    ledger.check()


def _raise_on_flaky(completion, example):
    if example.prompt == "flaky":
        raise RuntimeError("cannot score this one")
    return 0.0


async def test_requests_are_seeded_by_data_position_and_bounded_in_flight():
    examples = [Example(i, f"p{i}", "1") for i in range(3)]
    producer, ledger, _buffer, _ = producer_for({f"p{i}": ["1", "0"] for i in range(3)}, examples, in_flight=2)
    producer.start()
    await asyncio.wait_for(ledger.changed.wait_for(lambda: ledger.buffered == 2), 5)
    # nothing more until the trainer takes a group: the producer's gate (what its loop waits on
    # before each request) is shut while 2 groups wait, instead of a sleep that sees no request
    assert ledger.requested == 2 and not producer._ready()
    await producer.stop()
    seeds = [options["seed"] for _, options in producer.client.requests]
    assert seeds == [0, 1] and all(  # data positions 0 and 1 under seed 0: (0 * 1000003 + cursor)
        options["adapter"] == "policy@latest" for _, options in producer.client.requests
    )
    assert all(options["temperature"] == 1.0 for _, options in producer.client.requests)


class FakeTarget:
    """Records pushes; each push waits for the test to release it."""

    def __init__(self, failures: list[Exception] | None = None) -> None:
        self.pushed: list[int] = []
        self.signed_by: list[str | None] = []
        self.sha256_left: list[bool] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.release = asyncio.Event()
        self.failures = list(failures or [])

    async def push_adapter(
        self, name, version, payload, lora, fingerprint, *, signing_key=None, sha256_by_receiver=False
    ):
        self.signed_by.append(signing_key.key_id if signing_key is not None else None)
        self.sha256_left.append(sha256_by_receiver)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await self.release.wait()
            if self.failures:
                raise self.failures.pop(0)
            self.pushed.append(version)
            return dataclasses.make_dataclass("R", ["replicas", "already_loaded"])([], False)
        finally:
            self.in_flight -= 1


async def test_one_push_in_flight_and_a_newer_version_supersedes_the_pending_one():
    target, records = FakeTarget(), []
    pub = Publisher(target, "policy", "fp", {}, Signal(), 0.01, records.append)
    await pub.publish(1, b"x")
    await asyncio.sleep(0.01)  # v1 is now being pushed
    for v in (2, 3, 4):
        await pub.publish(v, b"x")  # never blocks the trainer
    await asyncio.sleep(0.01)
    target.release.set()
    await pub.close()
    assert target.pushed == [1, 4] and target.max_in_flight == 1
    assert pub.served == 4
    assert [(r.version, r.outcome) for r in records if r.outcome != "ok"] == [(2, "superseded"), (3, "superseded")]


async def test_every_version_is_pushed_signed_with_the_learners_key():
    target, key = FakeTarget(), SigningKey.generate("learner-key")
    pub = Publisher(target, "policy", "fp", {}, Signal(), 0.01, signing_key=key)
    target.release.set()
    await pub.publish(1, b"x", wait=True)
    await pub.publish(2, b"x", wait=True)
    assert target.signed_by == ["learner-key", "learner-key"]
    assert target.sha256_left == [False, False]  # a signature covers the sha256: the learner names it


async def test_an_unsigned_version_leaves_its_sha256_to_the_target():
    target = FakeTarget()
    pub = Publisher(target, "policy", "fp", {}, Signal(), 0.01)
    target.release.set()
    await pub.publish(1, b"x", wait=True)
    assert (target.signed_by, target.sha256_left) == ([None], [True])


async def test_sync_publish_waits_until_served_and_retries_unavailable():
    target = FakeTarget([Unavailable("replica restarting")])
    pub = Publisher(target, "policy", "fp", {}, Signal(), 0.01)
    waiting = asyncio.ensure_future(pub.publish(1, b"x", wait=True))
    await asyncio.sleep(0.02)
    assert not waiting.done()
    target.release.set()
    await asyncio.wait_for(waiting, 2)
    assert target.pushed == [1] and pub.served == 1


async def test_a_refused_push_is_raised_to_the_trainer():
    target = FakeTarget([FailedPrecondition("adapter was trained on another base model")])
    target.release.set()
    pub = Publisher(target, "policy", "fp", {}, Signal(), 0.01)
    with pytest.raises(FailedPrecondition, match="another base model"):
        await pub.publish(1, b"x", wait=True)
    with pytest.raises(FailedPrecondition):
        await pub.publish(2, b"x")


async def test_a_publisher_fault_wakes_the_waiter_with_internal_not_a_hang():
    """A failure that is no refusal (here the client breaks its contract) ends the worker: the
    waiting trainer gets INTERNAL naming it, within its own deadline, and later publishes raise it."""

    class Broken:
        async def push_adapter(self, *args, **kwargs):
            raise TypeError("push_adapter() got an unexpected keyword argument 'signing_key'")

    records = []
    pub = Publisher(Broken(), "policy", "fp", {}, Signal(), 0.01, records.append)
    with pytest.raises(Internal, match=r"version 1 failed inside the learner \(TypeError: .*signing_key"):
        await asyncio.wait_for(pub.publish(1, b"x", wait=True), 5)
    assert [(r.version, r.outcome) for r in records] == [(1, "failed")] and pub.served == 0
    with pytest.raises(Internal):
        await pub.publish(2, b"x")


async def test_start_moves_above_a_version_that_landed_after_the_learner_looked(monkeypatch):
    """A push cut off by a killed learner may reach the replicas after the new run read their versions."""
    from types import SimpleNamespace

    from rollwire.learner.run import session

    target = FakeTarget([FailedPrecondition("v3 is not above v4", reason=Reason.VERSION_NOT_MONOTONIC)])
    target.release.set()
    s = session.Session.__new__(session.Session)
    s.publisher = Publisher(target, "policy", "fp", {}, Signal(), 0.01)
    s.trainer = SimpleNamespace(adapter_payload=lambda: b"x")
    s.cfg, s.client = SimpleNamespace(adapter_name="policy", publish_probe=False), None
    s.buffer = SimpleNamespace(next_train_version=3)
    s.version = s.first_version = 3

    async def versions(client, name):
        return "fp", [2, 3, 4]

    monkeypatch.setattr(session, "target_versions", versions)
    await s.publish_start()
    assert (s.version, s.first_version, s.buffer.next_train_version, target.pushed, s.publisher.served) == (
        5,
        5,
        5,
        [5],
        5,
    )
