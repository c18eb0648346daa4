"""The SDK's Score (rollwire.client._score, score_cli): requests refused before any byte is
sent, replies turned into plain Python, and the CLI's sequence files. The calls over gRPC are
in tests/integration/proxy/test_score.py."""

from __future__ import annotations

import json

import pytest

from rollwire.client import RequestError
from rollwire.client._score import build_score_request, score_result_from_pb
from rollwire.client.score_cli import read_sequences
from rollwire.v1 import generator_pb2 as pb


def test_a_request_carries_the_pairs_the_adapter_and_top_k():
    req = build_score_request([([1, 2], [3]), ((4,), (5, 6))], adapter="pol@7", top_k=4, request_id="r1")
    assert [(list(s.prompt_token_ids), list(s.continuation_token_ids)) for s in req.sequences] == [
        ([1, 2], [3]),
        ([4], [5, 6]),
    ]
    assert (req.adapter.name, req.adapter.version, req.top_k, req.request_id) == ("pol", 7, 4, "r1")
    assert not build_score_request([([1], [2])]).HasField("adapter")


@pytest.mark.parametrize(
    ("sequences", "options"),
    [
        ([], {}),
        ("12", {}),
        ([([1], [])], {}),
        ([([], [1])], {}),
        ([([1], [2], [3])], {}),
        ([([1], [-2])], {}),
        ([([1], [2**31])], {}),
        ([([1], ["x"])], {}),
        ([([1], [2.5])], {}),
        ([([1], [True])], {}),
        ([([1], [2])], {"top_k": -1}),
        ([([1], [2])], {"adapter": "bad name@1"}),
        ([([1], [2])], {"adapter": "pol@0"}),
    ],
)
def test_a_bad_request_is_refused_before_it_is_sent(sequences, options):
    with pytest.raises(RequestError):
        build_score_request(sequences, **options)


def test_a_reply_is_plain_python():
    reply = pb.ScoreResponse(
        request_id="r",
        adapter=pb.AdapterRef(name="pol", version=3),
        sha256="ab" * 32,
        signer="k1",
        replica="g1",
        sequences=[pb.SequenceScore(logprobs=[-0.5, -1.25], top=[pb.TopLogprobs(token_ids=[4], logprobs=[-0.25])] * 2)],
    )
    result = score_result_from_pb(reply)
    assert result.logprobs == [[-0.5, -1.25]] and type(result.logprobs[0]) is list
    assert (result.adapter, result.version, result.sha256, result.signer) == ("pol", 3, "ab" * 32, "k1")
    assert result.top_ids == [[[4], [4]]] and result.top_logprobs == [[[-0.25], [-0.25]]]


def test_the_cli_reads_objects_or_pairs_and_names_what_is_wrong(tmp_path):
    path = tmp_path / "seqs.json"
    path.write_text(json.dumps([{"prompt": [1], "continuation": [2, 3]}, [[4], [5]]]))
    assert read_sequences(str(path), ValueError) == [([1], [2, 3]), ([4], [5])]
    for bad in ([], [{"prompt": [1]}], {"prompt": [1]}):
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match="seqs.json"):
            read_sequences(str(path), ValueError)
    with pytest.raises(ValueError, match="cannot read"):
        read_sequences(str(tmp_path / "absent.json"), ValueError)
