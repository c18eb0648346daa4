"""Scored-rollout ingestion (LearnerService): a real learner taking trajectories from the
example producer over a real socket, refusing what it must and training every accepted one."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import grpc
import pytest
from support.learner import learner_args
from support.processes import start, wait_until

from rollwire.common.reasons import Reason
from rollwire.v1 import learner_pb2 as lpb
from rollwire.v1 import learner_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
import ingest_producer  # examples/ is not a package

C = grpc.StatusCode


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
