"""The ingestion's behaviour check (ingest.max_logprob_gap, ingest/check.py) in a real learner
over a real replica: a trajectory whose claimed behaviour logprob was forged is refused with
BEHAVIOUR_MISMATCH, honest ones (the example producer's, sampled by the same replica at
temperature 1) are taken and trained. The check's own logic: tests/unit/learner/test_ingest_check.py."""

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

pytestmark = pytest.mark.integration
ADMIN = "ingest-check-admin-secret"
AUTH = [("authorization", f"Bearer {ADMIN}")]


@pytest.fixture(scope="module")
def learner(generator, tiny_model, tmp_path_factory):
    work = tmp_path_factory.mktemp("ingest-check")
    (work / "admin.tokens").write_text(ADMIN + "\n")
    run = work / "run"
    args = learner_args(generator.target, tiny_model, run, "policy-check", "max_steps=1", "seed=4")
    args += [
        "train.groups_per_step=1",
        "buffer.keep_zero_variance=true",
        "eval.at_start=false",
        "eval.at_end=false",
        "ingest.enabled=true",
        "ingest.port=0",
        "ingest.exclusive=true",
        "ingest.max_logprob_gap=0.001",
        f"ingest.auth.admin_tokens_file={work / 'admin.tokens'}",
    ]
    svc = start(args, work, "learner", timeout=120)
    yield svc, run
    svc.stop()


def test_a_forged_trajectory_is_refused_and_honest_ones_are_trained(learner, generator, tiny_model):
    from transformers import AutoTokenizer

    from rollwire.client import Client

    svc, run = learner
    s = learner_pb2_grpc.LearnerServiceStub(grpc.insecure_channel(svc.target))
    status = wait_until(
        lambda: (
            (st := s.GetIngestStatus(lpb.GetIngestStatusRequest(), metadata=AUTH, timeout=10)).newest_version and st
        ),
        90,
        "the learner's first push",
    )
    v = status.newest_version
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    with Client(generator.target, timeout=60) as client:
        prompt, episodes = ingest_producer.play(client, tokenizer, f"policy-check@{v}", 12, 30, 4, 2, seed=1)
    honest = ingest_producer.trajectories("checked", prompt, episodes)
    forged = lpb.Trajectory()
    forged.CopyFrom(honest[0])
    j = next(i for i, m in enumerate(forged.loss_mask) if m)
    forged.logprobs[j] = max(-49.0, forged.logprobs[j] - 0.5)  # within the shape's bounds, off by 0.5

    answers = ingest_producer.submit(s, [forged, *honest], AUTH)
    assert [a.status.reason for a in answers] == [Reason.BEHAVIOUR_MISMATCH, "", ""], answers
    assert answers[0].status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert f"token {j} " in answers[0].status.message and "ingest.max_logprob_gap" in answers[0].status.message
    assert answers[2].group_complete
    assert svc.proc.wait(timeout=120) == 0, svc.log_path.read_text()[-3000:]
    counts = json.loads((run / "summary.json").read_text())["ingest"]["trajectories"]
    assert counts["accepted"] == counts["trained"] == 2 and counts[Reason.BEHAVIOUR_MISMATCH] == 1, counts
