"""The ingestion's provenance and behaviour checks in a real learner over a real replica that signs
a receipt for every sample (the shared replica's receipt_key_file):
- provenance (ingest.receipt_keys_file, ingest/receipts.py; audit S11): a trajectory whose claimed
  behaviour logprob was forged, and one whose token the model never sampled (carrying the true
  logprob Score gives it, which the behaviour check alone would take), are refused with
  BAD_RECEIPT; one without receipts with RECEIPT_MISSING; a receipt already trained on is refused;
- behaviour (ingest.max_logprob_gap, ingest/check.py): a genuinely sampled trajectory whose
  logprobs are not temperature 1's (sampled at T=0.5) is refused with BEHAVIOUR_MISMATCH;
- honest ones (the example producer's, sampled by the same replica at temperature 1, with their
  receipts) are taken and trained.
The checks' own logic: tests/unit/learner/test_ingest/check.py, test_ingest/receipts.py."""

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
def learner(generator, tiny_model, tmp_path_factory, receipt_keys):
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
        f"ingest.receipt_keys_file={receipt_keys / 'trust.json'}",
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
    adapter = f"policy-check@{v}"
    with Client(generator.target, timeout=60) as client:
        prompt, episodes = ingest_producer.play(client, tokenizer, adapter, 12, 30, 4, 2, seed=1)
        hot_prompt, hot = ingest_producer.play(client, tokenizer, adapter, 21, 13, 2, 2, seed=2, temperature=0.5)
        honest = ingest_producer.trajectories("checked", prompt, episodes)
        j = next(i for i, m in enumerate(honest[0].loss_mask) if m)
        forged = copy(honest[0], "forged-logprob")
        forged.logprobs[j] = max(-49.0, forged.logprobs[j] - 0.5)  # within the shape's bounds, off by 0.5
        unsampled = copy(honest[0], "unsampled")  # S11: a token no policy sampled, with its true logprob
        unsampled.token_ids[j] = (unsampled.token_ids[j] + 1) % tokenizer.vocab_size
        rest = list(unsampled.token_ids)
        score = client.score([(list(unsampled.prompt_token_ids), rest)], adapter=adapter)
        unsampled.logprobs[j] = score.logprobs[0][j]
        bare = copy(honest[0], "bare")
        bare.ClearField("receipts")
        tempered = ingest_producer.trajectories("tempered", hot_prompt, hot)[0]
        again = copy(honest[1], "again")  # its receipts trained a moment before, now under another group
        again.group_id = "checked-again"

    assert all(len(t.receipts) == 2 for t in honest)  # the replica signed both model turns of each episode
    answers = ingest_producer.submit(s, [forged, unsampled, bare, tempered, *honest, again], AUTH)
    reasons = [a.status.reason for a in answers]
    assert reasons == [
        Reason.BAD_RECEIPT,
        Reason.BAD_RECEIPT,
        Reason.RECEIPT_MISSING,
        Reason.BEHAVIOUR_MISMATCH,
        "",
        "",
        Reason.BAD_RECEIPT,
    ], answers
    assert all(a.status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] for a in answers[:4])
    assert "logprobs are not those the replica sampled" in answers[0].status.message
    assert "ids are not those the replica sampled" in answers[1].status.message
    assert f"token {j} " in answers[2].status.message
    assert "ingest.max_logprob_gap" in answers[3].status.message
    assert answers[5].group_complete
    assert "already trained on" in answers[6].status.message
    assert svc.proc.wait(timeout=120) == 0, svc.log_path.read_text()[-3000:]
    counts = json.loads((run / "summary.json").read_text())["ingest"]["trajectories"]
    assert counts["accepted"] == counts["trained"] == 2, counts
    assert counts[Reason.BAD_RECEIPT] == 3 and counts[Reason.RECEIPT_MISSING] == 1, counts
    assert counts[Reason.BEHAVIOUR_MISMATCH] == 1, counts


def copy(t: lpb.Trajectory, name: str) -> lpb.Trajectory:
    out = lpb.Trajectory()
    out.CopyFrom(t)
    out.trajectory_id = name
    return out
