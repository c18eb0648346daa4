"""The proxy's own Score limits (rollwire.proxy.routing.score.check_score), checked before any
routing with the replica's reasons for the same problems (the replica's: tests/unit/generator/
test_score_convert.py); generated requests are taken whole or refused as invalid."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollwire.common.errors import InvalidArgument
from rollwire.common.reasons import Reason
from rollwire.proxy.config import ScoreSection
from rollwire.proxy.routing.score import check_score
from rollwire.v1 import generator_pb2 as pb

PROXY = ScoreSection(max_sequences=4, max_tokens=100, max_top_k=5)


def seq(prompt, continuation) -> pb.ScoreSequence:
    return pb.ScoreSequence(prompt_token_ids=prompt, continuation_token_ids=continuation)


def score(*sequences, **kw) -> pb.ScoreRequest:
    return pb.ScoreRequest(sequences=list(sequences), **kw)


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


@pytest.mark.parametrize(("request_", "reason"), HOSTILE)
def test_each_problem_is_refused_before_routing_with_the_replicas_reason(request_, reason):
    with pytest.raises(InvalidArgument) as refused:
        check_score(request_, PROXY)
    assert refused.value.reason == reason and refused.value.message


def test_an_accepted_request_counts_the_tokens_it_routes():
    assert check_score(score(seq([1, 2], [3]), seq([4], [5, 6])), PROXY) == 6


ids = st.lists(st.integers(0, 1000), max_size=70)


@settings(max_examples=150, deadline=None)
@given(sequences=st.lists(st.builds(seq, ids, ids), max_size=6), top_k=st.integers(0, 2**32 - 1))
def test_generated_requests_are_taken_within_the_limits_or_refused_as_invalid(sequences, top_k):
    try:
        total = check_score(score(*sequences, top_k=top_k), PROXY)
    except InvalidArgument as err:
        assert err.reason in {r for _, r in HOSTILE}
        return
    assert 1 <= len(sequences) <= 4 and top_k <= 5 and total <= 100
    assert all(s.prompt_token_ids and s.continuation_token_ids for s in sequences)
