"""Scored-rollout ingestion (LearnerService): the checks, the loss mask, and a real learner
taking trajectories from the example producer over a real socket."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import grpc
import pytest
import torch
from support.learner import learner_args
from support.processes import start, wait_until

from rollwire.common.reasons import Reason
from rollwire.learner.buffer import Buffer, GroupLedger
from rollwire.learner.config import IngestSection, TrainSection
from rollwire.learner.groups import ScoredGroup, ScoredSample
from rollwire.learner.ingest import Ingest, Trajectory
from rollwire.learner.task import Example
from rollwire.learner.trainer import Trainer
from rollwire.v1 import learner_pb2 as lpb
from rollwire.v1 import learner_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import ingest_producer  # examples/ is not a package

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


# -- a real learner, the example producer, a real socket ------------------------------------
ADMIN, GENERATE = "ingest-admin-secret", "ingest-generate-secret"
OTHER = "ingest-other-producer-secret"
"""A second producer's admin token: ingest.producer_share counts each token as one producer."""


@pytest.fixture(scope="module")
def learner(generator, tiny_model, tmp_path_factory):
    work = tmp_path_factory.mktemp("ingest")
    (work / "admin.tokens").write_text(f"{ADMIN}\n{OTHER}\n")
    (work / "generate.tokens").write_text(GENERATE + "\n")
    run = work / "run"
    args = learner_args(generator.target, tiny_model, run, "policy-ingest", "max_steps=2", "seed=3")
    args += [
        "train.groups_per_step=2",
        "rollout.groups_in_flight=4",
        "buffer.max_staleness=0",
        "buffer.keep_zero_variance=true",
        "eval.at_start=false",
        "eval.at_end=false",
        "ingest.enabled=true",
        "ingest.port=0",
        "ingest.exclusive=true",
        "ingest.max_pending_groups=2",  # and ingest.producer_share 0.5: one group per producer
        "ingest.retry_after_s=0.2",
        f"ingest.auth.admin_tokens_file={work / 'admin.tokens'}",
        f"ingest.auth.generate_tokens_file={work / 'generate.tokens'}",
    ]
    svc = start(args, work, "learner", timeout=120)
    yield svc, run
    svc.stop()


def stub(svc) -> learner_pb2_grpc.LearnerServiceStub:
    return learner_pb2_grpc.LearnerServiceStub(grpc.insecure_channel(svc.target))


AUTH = [("authorization", f"Bearer {ADMIN}")]
AUTH_OTHER = [("authorization", f"Bearer {OTHER}")]


def one(s, t: lpb.Trajectory, metadata=AUTH) -> lpb.SubmitTrajectoriesResponse:
    (answer,) = s.SubmitTrajectories(iter([lpb.SubmitTrajectoriesRequest(trajectory=t)]), metadata=metadata, timeout=30)
    return answer


@pytest.mark.integration  # starts processes: not in make test-fast
def test_a_real_learner_ingests_refuses_and_trains_every_accepted_trajectory(learner, generator, tiny_model):
    svc, run = learner
    s = stub(svc)
    status = wait_until(
        lambda: (
            (st := s.GetIngestStatus(lpb.GetIngestStatusRequest(), metadata=AUTH, timeout=10)).newest_version and st
        ),
        90,
        "the learner's first push",
    )
    v = status.newest_version
    assert status.oldest_version == v and status.adapter_name == "policy-ingest" and status.vocab_size > 0

    # unauthorized: no token, a wrong one, a token of the generate role
    good = lpb.Trajectory(
        group_id="probe", group_size=2, prompt_token_ids=[1, 2], token_ids=[3, 4], loss_mask=[True, False],
        logprobs=[-1.0, 0.0], token_versions=[v, 0], reward=1.0,
    )  # fmt: skip
    for metadata, code in (([], C.UNAUTHENTICATED), ([("authorization", "Bearer nope")], C.UNAUTHENTICATED)):
        with pytest.raises(grpc.RpcError) as info:
            one(s, good, metadata)
        assert info.value.code() == code
    with pytest.raises(grpc.RpcError) as info:
        one(s, good, [("authorization", f"Bearer {GENERATE}")])
    assert info.value.code() == C.PERMISSION_DENIED

    # malformed and unknown versions, in one stream: each answered in order, the stream goes on
    def bad(**change):
        t = lpb.Trajectory()
        t.CopyFrom(good)
        for k, value in change.items():
            t.ClearField(k)
            getattr(t, k).extend(value) if isinstance(value, list) else setattr(t, k, value)
        return lpb.SubmitTrajectoriesRequest(trajectory=t)

    requests = [
        bad(loss_mask=[True]),
        bad(token_ids=[3, status.vocab_size]),
        bad(token_versions=[v + 1, 0]),
        lpb.SubmitTrajectoriesRequest(),
        # numbers that would overflow the learner's float32 arithmetic (issue 32: A3)
        bad(logprobs=[-1000.0, 0.0]),
        bad(reward=1e39),
        bad(reward=float("nan")),
    ]
    answers = list(s.SubmitTrajectories(iter(requests), metadata=AUTH_OTHER, timeout=30))
    assert [(a.index, a.status.code, a.status.reason) for a in answers] == [
        (0, C.INVALID_ARGUMENT.value[0], Reason.BAD_TRAJECTORY),
        (1, C.INVALID_ARGUMENT.value[0], Reason.BAD_TOKEN_ID),
        (2, C.INVALID_ARGUMENT.value[0], Reason.UNKNOWN_VERSION),
        (3, C.INVALID_ARGUMENT.value[0], Reason.BAD_TRAJECTORY),
        *((i, C.INVALID_ARGUMENT.value[0], Reason.BAD_TRAJECTORY) for i in (4, 5, 6)),
    ]
    assert "ingest.min_logprob" in answers[4].status.message and "ingest.max_abs_reward" in answers[5].status.message

    # real two-turn episodes from the example; a third group waits for room (pushback)
    from transformers import AutoTokenizer

    from rollwire.client import Client

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    with Client(generator.target, timeout=60) as client:
        played = [
            ingest_producer.play(client, tokenizer, f"policy-ingest@{v}", 12, 30 + g, 4, 2, seed=g) for g in range(3)
        ]
    batches = [ingest_producer.trajectories(f"chain-{g}", *played[g]) for g in range(3)]

    def submit(trajectories, metadata):
        requests = (lpb.SubmitTrajectoriesRequest(trajectory=t) for t in trajectories)
        return list(s.SubmitTrajectories(requests, metadata=metadata, timeout=30))

    # one producer opens its share (one group) and is pushed back past it; the other is not locked
    # out, and opens the learner's second group; a third group finds the learner full
    answers = submit([batches[0][0], batches[1][0]], AUTH)
    assert [a.status.reason for a in answers] == ["", Reason.INGEST_QUOTA]
    assert answers[1].status.code == C.RESOURCE_EXHAUSTED.value[0] and answers[1].status.retry_after_ms == 200
    assert "ingest.producer_share" in answers[1].status.message
    answers = submit([batches[1][0], batches[2][0]], AUTH_OTHER)
    assert [a.status.reason for a in answers] == ["", Reason.INGEST_FULL]
    assert answers[1].status.code == C.RESOURCE_EXHAUSTED.value[0] and answers[1].status.retry_after_ms == 200
    environment = len(tokenizer.encode("+04=", add_special_tokens=False))
    for _, episodes in played:
        assert all(e.loss_mask.count(False) == environment for e in episodes)
    rest = ingest_producer.submit(s, [batches[0][1], batches[1][1]], AUTH)
    assert [a.status.code for a in rest] == [0, 0] and all(a.group_complete for a in rest)

    # the step trains at v and, in the synchronous mode, publishes v + 1: a sample at v is now stale
    wait_until(lambda: s.GetIngestStatus(lpb.GetIngestStatusRequest(), metadata=AUTH).newest_version > v, 90, "a push")
    late = ingest_producer.submit(s, batches[2], AUTH)
    assert [a.status.reason for a in late] == [Reason.STALE_TRAJECTORY] * 2
    assert late[0].status.code == C.FAILED_PRECONDITION.value[0] and late[0].oldest_version == v + 1

    # one more group from each producer, at the newest version: the second step, then the run ends
    for token, seed in ((ADMIN, 5), (OTHER, 6)):
        produced = list(
            ingest_producer.produce(generator.target, svc.target, tiny_model, 1, n=2, token=token, seed=seed)
        )
        assert all(a.status.code == 0 for _, answers in produced for a in answers)
    assert svc.proc.wait(timeout=120) == 0, svc.log_path.read_text()[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    counts = summary["ingest"]["trajectories"]
    assert counts["accepted"] == counts["trained"] == 8 and "expired" not in counts, summary  # 4 groups of 2
    assert summary["ingest"]["groups"] == {"completed": 4, "trained": 4}
    assert summary["groups"]["trained"] == 4 and summary["groups"]["requested"] == 4
    assert counts[Reason.STALE_TRAJECTORY] == 2 and counts[Reason.INGEST_FULL] == counts[Reason.INGEST_QUOTA] == 1
    assert (
        counts[Reason.BAD_TRAJECTORY] == 4 and summary["ingest"]["held_bytes"] == 0
    )  # the empty request is not counted
