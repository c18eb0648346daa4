"""Score's limits before work on a replica, as plain functions: a ScoreRequest -> the ScoreJob
its engine runs (rollwire.generator.score), each refusal with its status code and reason;
generated hostile requests never get anything else. The proxy's own check of the same limits:
tests/unit/proxy/test_score_limits.py.

The engine is the real scripted engine over a config-only model folder (no model, no process);
an engine that cannot score (a stand-in without Score's methods) is refused with UNIMPLEMENTED. The numbers of a real Score are checked
in test_engine_score.py (in-process) and tests/integration/proxy/test_score.py (over gRPC).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollwire.common.errors import InvalidArgument, RollwireError
from rollwire.common.reasons import Reason
from rollwire.generator.config import GeneratorConfig, Limits
from rollwire.generator.engines.embedded.scripted import ScriptedEngine
from rollwire.generator.metrics import GeneratorMetrics
from rollwire.generator.score import Scoring, score_job
from rollwire.v1 import generator_pb2 as pb

VOCAB, CONTEXT = 1000, 64
LIMITS = {"max_score_sequences": 4, "max_score_tokens": 100, "max_score_top_k": 5}


@pytest.fixture
async def engine(tmp_path) -> ScriptedEngine:
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": VOCAB, "max_position_embeddings": CONTEXT}))
    eng = ScriptedEngine(tmp_path)
    await eng.start()
    return eng


@pytest.fixture
def config(tmp_path) -> GeneratorConfig:
    return GeneratorConfig(model=str(tmp_path), engine="scripted", limits=Limits(**LIMITS))


def seq(prompt, continuation) -> pb.ScoreSequence:
    return pb.ScoreSequence(prompt_token_ids=prompt, continuation_token_ids=continuation)


def score(*sequences, **kw) -> pb.ScoreRequest:
    return pb.ScoreRequest(sequences=list(sequences), **kw)


def test_a_request_becomes_the_job_its_engine_runs(engine, config):
    job = score_job(score(seq([1, 2], [3]), seq([4], [5, VOCAB - 1]), top_k=5), "rid", config, engine)
    assert job.request_id == "rid" and job.top_k == 5
    assert job.sequences == (((1, 2), (3,)), ((4,), (5, VOCAB - 1)))
    assert (job.tokens, job.scored) == (6, 3)
    assert job.adapter.name == "" and job.adapter.handle is None  # the servicer leases the version


HOSTILE = [
    (score(), Reason.BAD_SCORE_REQUEST),
    (score(seq([], [1])), Reason.BAD_SCORE_REQUEST),
    (score(seq([1], [])), Reason.BAD_SCORE_REQUEST),
    (score(seq([1], [2]), adapter=pb.AdapterRef(name="a", follow=True)), Reason.BAD_SCORE_REQUEST),
    (score(*[seq([1], [2])] * 5), Reason.SCORE_TOO_LARGE),
    (score(seq([1] * 60, [2] * 41)), Reason.SCORE_TOO_LARGE),
    (score(seq([1], [2]), top_k=6), Reason.BAD_SCORE_TOP_K),
    (score(seq([1], [2]), adapter=pb.AdapterRef(name="bad name!")), Reason.BAD_ADAPTER_NAME),
]
REPLICA_ONLY = [
    (score(seq([1] * 40, [2] * 25)), Reason.CONTEXT_TOO_LONG),
    (score(seq([1], [VOCAB])), Reason.BAD_TOKEN_ID),
    (score(seq([-1], [2])), Reason.BAD_TOKEN_ID),
]


@pytest.mark.parametrize(("request_", "reason"), HOSTILE + REPLICA_ONLY)
def test_each_problem_is_refused_by_the_replica_with_its_own_reason(engine, config, request_, reason):
    with pytest.raises(InvalidArgument) as refused:
        score_job(request_, "r", config, engine)
    assert refused.value.reason == reason and refused.value.message


ids = st.lists(st.integers(-(2**31), 2**31 - 1), max_size=70)
sequences = st.lists(st.builds(seq, ids, ids), max_size=6)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sequences=sequences, top_k=st.integers(0, 2**32 - 1))
def test_generated_hostile_requests_are_taken_whole_or_refused_as_invalid(engine, config, sequences, top_k):
    request_ = score(*sequences, top_k=top_k)
    try:
        job = score_job(request_, "r", config, engine)
    except InvalidArgument as err:
        assert err.reason in {r for _, r in HOSTILE + REPLICA_ONLY} and err.message
        return
    # accepted: every bound held
    assert 1 <= len(job.sequences) <= LIMITS["max_score_sequences"] and job.top_k <= LIMITS["max_score_top_k"]
    assert job.tokens <= LIMITS["max_score_tokens"]
    for prompt, continuation in job.sequences:
        assert prompt and continuation and len(prompt) + len(continuation) <= CONTEXT
        assert all(0 <= t < VOCAB for t in (*prompt, *continuation))


def test_an_engine_that_cannot_score_refuses_with_unimplemented(config):
    no_score = SimpleNamespace(name="scripted", vocab_size=VOCAB, max_context=CONTEXT)  # no check_score / score
    scoring = Scoring(config, no_score, registry=None, metrics=GeneratorMetrics(), fingerprint="fp", replica="r")  # type: ignore[arg-type]  # never reached
    with pytest.raises(RollwireError) as refused:
        scoring._scorer()
    assert refused.value.code == grpc.StatusCode.UNIMPLEMENTED
    assert refused.value.reason == Reason.SCORE_UNSUPPORTED and "scripted" in refused.value.message
