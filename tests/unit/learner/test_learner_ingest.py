"""Scored-rollout ingestion (LearnerService), in-process: the checks and the loss mask. A real
learner taking trajectories from the example producer: tests/integration/learner/
test_learner_ingest_real.py."""

from __future__ import annotations

import grpc
import pytest
import torch

from rollwire.common.reasons import Reason
from rollwire.learner.config import IngestSection, TrainSection
from rollwire.learner.ingest.intake import Ingest, Trajectory
from rollwire.learner.rollouts.buffer import Buffer, GroupLedger
from rollwire.learner.rollouts.groups import ScoredGroup, ScoredSample
from rollwire.learner.tasks.task import Example
from rollwire.learner.train.trainer import Trainer

C = grpc.StatusCode
VOCAB = 100


def traj(group="g", size=2, reward=0.0, versions=(3, 3, 0, 3), mask=(True, True, False, True), **kw) -> Trajectory:
    fields = dict(
        group_id=group,
        group_size=size,
        prompt_token_ids=[5, 6],
        token_ids=[10, 11, 12, 13][: len(mask)],
        loss_mask=list(mask),
        logprobs=[-0.5] * len(mask),
        token_versions=list(versions),
        reward=reward,
    )
    fields.update(kw)
    return Trajectory(**fields)  # type: ignore[arg-type]


def ingest(newest=3, next_train=3, max_staleness=1, **cfg) -> Ingest:
    buffer = Buffer(max_staleness, keep_zero_variance=False, ledger=GroupLedger())
    buffer.next_train_version = next_train
    return Ingest(IngestSection(enabled=True, **cfg), buffer, lambda: newest, VOCAB)


def refusal(i: Ingest, t: Trajectory) -> tuple[grpc.StatusCode, str]:
    from rollwire.common.errors import RollwireError

    with pytest.raises(RollwireError) as info:
        i.submit(t)
    return info.value.code, info.value.reason


@pytest.mark.parametrize(
    "change,code,reason",
    [
        (dict(loss_mask=[True, True]), C.INVALID_ARGUMENT, Reason.BAD_TRAJECTORY),
        (dict(logprobs=[-1.0]), C.INVALID_ARGUMENT, Reason.BAD_TRAJECTORY),
        (dict(token_versions=[3, 3, 3]), C.INVALID_ARGUMENT, Reason.BAD_TRAJECTORY),
        (dict(loss_mask=[False] * 4), C.INVALID_ARGUMENT, Reason.BAD_TRAJECTORY),
        (dict(reward=float("nan")), C.INVALID_ARGUMENT, Reason.BAD_TRAJECTORY),
        (dict(logprobs=[-0.5, float("-inf"), -0.5, -0.5]), C.INVALID_ARGUMENT, Reason.BAD_TRAJECTORY),
        (dict(logprobs=[-0.5, 0.5, -0.5, -0.5]), C.INVALID_ARGUMENT, Reason.BAD_TRAJECTORY),
        (dict(group_id=""), C.INVALID_ARGUMENT, Reason.BAD_TRAJECTORY),
        (dict(group_size=1), C.INVALID_ARGUMENT, Reason.BAD_TRAJECTORY),
        (dict(token_ids=[10, 11, VOCAB, 13]), C.INVALID_ARGUMENT, Reason.BAD_TOKEN_ID),
        (dict(prompt_token_ids=[-1]), C.INVALID_ARGUMENT, Reason.BAD_TOKEN_ID),
        (dict(token_ids=[1] * 9, loss_mask=[True] * 9, logprobs=[0.0] * 9, token_versions=[3] * 9),
         C.INVALID_ARGUMENT, Reason.TRAJECTORY_TOO_LARGE),
        (dict(token_versions=[3, 4, 0, 3]), C.INVALID_ARGUMENT, Reason.UNKNOWN_VERSION),
        (dict(token_versions=[0, 3, 0, 3]), C.INVALID_ARGUMENT, Reason.UNKNOWN_VERSION),
        (dict(token_versions=[1, 3, 0, 3]), C.FAILED_PRECONDITION, Reason.STALE_TRAJECTORY),
    ],
)  # fmt: skip
def test_a_malformed_unknown_or_stale_trajectory_is_refused_with_its_reason(change, code, reason):
    i = ingest(max_tokens=8)
    assert refusal(i, traj(**change)) == (code, reason)
    assert i.counts[reason] == 1 and not i.open and i.buffer.ledger.requested == 0


def test_an_environment_token_may_carry_any_version_and_logprob():
    """Untrained tokens' versions and logprobs are ignored, and zeroed before the trainer."""
    i = ingest()
    i.submit(traj(logprobs=[-0.5, -0.5, float("nan"), -0.5], token_versions=[3, 3, 99, 3], reward=1))
    sample = i.open["g"].samples[0]
    assert sample.logprobs[2] == 0.0 and sample.token_versions[2] == 0 and list(sample.loss_mask) == [1, 1, 0, 1]


def test_groups_assemble_into_the_buffer_and_the_ledger():
    i = ingest()
    assert i.submit(traj(reward=0)) is False
    assert refusal(i, traj(size=3)) == (C.INVALID_ARGUMENT, Reason.GROUP_MISMATCH)
    assert refusal(i, traj(prompt_token_ids=[5, 7])) == (C.INVALID_ARGUMENT, Reason.GROUP_MISMATCH)
    assert i.submit(traj(reward=1)) is True
    assert len(i.buffer) == 1 and i.buffer.ledger.snapshot()["buffered"] == 1
    assert refusal(i, traj(reward=1)) == (C.FAILED_PRECONDITION, Reason.GROUP_CLOSED)
    group = i.buffer._groups[0]
    assert group.source == "ingest" and group.min_version == 3 and group.rewards == [0, 1]
    i.buffer.ledger.check()
    i.on_trained([group])
    assert i.counts["accepted"] == i.counts["trained"] == 2 and i.groups["trained"] == 1


def test_a_full_learner_pushes_back_with_a_hint_and_takes_the_open_groups_samples():
    i = ingest(max_pending_groups=2, retry_after_s=0.25, producer_share=1)  # one producer: the learner-wide count
    i.submit(traj("a"))
    i.submit(traj("b"))
    from rollwire.common.errors import ResourceExhausted

    with pytest.raises(ResourceExhausted) as info:
        i.submit(traj("c"))
    assert info.value.reason == Reason.INGEST_FULL and info.value.retry_after_s == 0.25
    assert i.submit(traj("a", reward=1)) is True  # a sample of an open group is never pushed back
    assert refusal(i, traj("c")) == (C.RESOURCE_EXHAUSTED, Reason.INGEST_FULL)  # "a" waits in the buffer
    i.buffer.drain("shutdown")
    assert i.submit(traj("c")) is False  # room again: "c" opens


def test_an_incomplete_group_expires_counted():
    now = [0.0]
    i = ingest(group_timeout_s=5)
    i.clock = lambda: now[0]
    i.submit(traj("a"))
    now[0] = 6.0
    assert i.expire() == 1
    assert i.counts["expired"] == 1 and i.groups["expired"] == 1 and not i.open
    assert refusal(i, traj("a")) == (C.FAILED_PRECONDITION, Reason.GROUP_CLOSED)


# -- the loss mask against an independent computation ----------------------------------------
PROMPT = [10, 11, 12, 13]
MASK = [True, True, False, False, False, True, True, False, True]


def masked_groups(env_logprob: float = -1.0, env_version: int = 1) -> list[ScoredGroup]:
    samples = []
    for i in range(4):
        ids = [40 + i, 41, 7, 8, 9, 42 + i, 43, 7, 44]
        logprobs = [-1.0 if m else env_logprob for m in MASK]
        versions = [1 if m else env_version for m in MASK]
        samples.append(ScoredSample(ids, logprobs, versions, "", "eos", float(i % 2 + i), False, loss_mask=list(MASK)))
    return [ScoredGroup(Example(0, "p", "a"), PROMPT, samples, 1)]


def trainer(tiny_model) -> Trainer:
    cfg = TrainSection(lr=1e-2, groups_per_step=1, max_grad_norm=1e9)
    return Trainer(tiny_model, cfg, 1.0, seed=0, max_token_staleness=0)


def grads(t: Trainer) -> list[torch.Tensor]:
    return [p.grad.clone() for p in t.model.parameters() if p.requires_grad and p.grad is not None]


def test_environment_tokens_never_reach_the_loss(tiny_model):
    """The step's gradient equals one computed by hand over the model's tokens only, and does
    not move when environment tokens' logprobs and versions change (or are absurd)."""
    base = trainer(tiny_model)
    stats = base.step(masked_groups(), version=1)
    reference = grads(base)
    assert stats.tokens == 4 * sum(MASK) and stats.stale_tokens_masked == 0
    for env_logprob, env_version in ((-50.0, 1), (1e30, 0), (float("nan"), 7)):
        other = trainer(tiny_model)
        other.step(masked_groups(env_logprob, env_version), version=1)
        for a, b in zip(reference, grads(other), strict=True):
            assert torch.equal(a, b)
    # the independent computation: -sum over the model's tokens of A * d rho / N, rho = exp(logp - mu)
    by_hand = trainer(tiny_model)
    groups = masked_groups()
    rewards = torch.tensor(groups[0].rewards)
    advantages = (rewards - rewards.mean()) / (rewards.std(unbiased=False) + 1e-6)
    trained = sum(MASK) * len(groups[0].samples)
    total = torch.zeros(())
    for s, a in zip(groups[0].samples, advantages, strict=True):
        ids = torch.tensor([PROMPT + s.token_ids])
        logp = torch.log_softmax(by_hand.model(input_ids=ids).logits[0, :-1].float(), -1)
        for j, m in enumerate(MASK):
            if m:
                lp = logp[len(PROMPT) - 1 + j, s.token_ids[j]]
                ratio = torch.exp(lp - s.logprobs[j])
                surrogate = torch.minimum(ratio * a, ratio.clamp(0.8, 1.28) * a)
                if a < 0:
                    surrogate = torch.maximum(surrogate, 4.0 * a)
                total = total - surrogate
    (total / trained).backward()
    for a, b in zip(reference, grads(by_hand), strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)
    # and the mask matters: training on every token gives another gradient
    unmasked = trainer(tiny_model)
    plain = masked_groups()
    for s in plain[0].samples:
        s.loss_mask = []
    unmasked.step(plain, version=1)
    assert any(not torch.allclose(a, b) for a, b in zip(reference, grads(unmasked), strict=True))
