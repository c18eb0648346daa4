"""Score as the SDK builds and returns it: a validated ScoreRequest, and plain Python results.

Invariants: a request is validated here before any byte leaves the process (`RequestError`);
a result holds only lists, ints, floats and strings (no protobuf), one entry per sequence in
the order given.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from rollwire.client._requests import INT32, UINT32, AdapterVersion, parse_adapter
from rollwire.common.errors import RequestError
from rollwire.common.errors import whole_number as _int
from rollwire.v1 import generator_pb2 as pb

ScoreSequence = tuple[Sequence[int], Sequence[int]]
"""(prompt token ids, continuation token ids): the continuation's tokens are scored."""


@dataclass(frozen=True)
class ScoreResult:
    """Teacher-forced logprobs of each sequence's continuation, and the version that scored them.

    `logprobs[i][j]` is log p(continuation_i[j] | prompt_i, continuation_i[:j]): the model's raw
    log-softmax (temperature 1, no truncation). With top_k, `top_ids[i][j]` and
    `top_logprobs[i][j]` are the k most likely tokens at that position, most likely first."""

    logprobs: list[list[float]]
    adapter: str
    """Adapter name; "" for the base model."""
    version: int
    """The version that scored ("latest" resolved); 0 for the base model."""
    sha256: str
    """That version's payload digest as GetStatus reports it; "" for the base model."""
    signer: str = ""
    model_fingerprint: str = ""
    replica: str = ""
    request_id: str = ""
    top_ids: list[list[list[int]]] = field(default_factory=list)
    top_logprobs: list[list[list[float]]] = field(default_factory=list)


def _ids(what: str, tokens: object) -> list[int]:
    if isinstance(tokens, (str, bytes, bytearray)) or not isinstance(tokens, Iterable):
        raise RequestError(f"{what} must be a list of token ids, got {type(tokens).__name__}")
    ids = [_int(f"{what} token id", t, 0, INT32) for t in tokens]
    if not ids:
        raise RequestError(f"{what} must hold at least one token id")
    return ids


def build_score_request(
    sequences: Sequence[ScoreSequence],
    *,
    adapter: str | AdapterVersion | None = None,
    top_k: int = 0,
    request_id: str = "",
) -> pb.ScoreRequest:
    """One validated ScoreRequest: `sequences` of (prompt ids, continuation ids) pairs."""
    if isinstance(sequences, (str, bytes)) or not isinstance(sequences, Sequence) or not sequences:
        raise RequestError("sequences must be a non-empty list of (prompt ids, continuation ids) pairs")
    request = pb.ScoreRequest(top_k=_int("top_k", top_k, 0, UINT32))
    for i, pair in enumerate(sequences):
        if not isinstance(pair, Sequence) or isinstance(pair, (str, bytes)) or len(pair) != 2:
            raise RequestError(f"sequence {i} must be a (prompt ids, continuation ids) pair")
        request.sequences.add(
            prompt_token_ids=_ids(f"sequence {i}'s prompt", pair[0]),
            continuation_token_ids=_ids(f"sequence {i}'s continuation", pair[1]),
        )
    selector = parse_adapter(adapter)
    if selector is not None:
        request.adapter.name, request.adapter.version = selector.name, selector.version
    if not isinstance(request_id, str):
        raise RequestError("request_id must be a string")
    request.request_id = request_id
    return request


def score_result_from_pb(reply: pb.ScoreResponse) -> ScoreResult:
    """The reply as plain Python."""
    return ScoreResult(
        logprobs=[list(s.logprobs) for s in reply.sequences],
        adapter=reply.adapter.name,
        version=reply.adapter.version,
        sha256=reply.sha256,
        signer=reply.signer,
        model_fingerprint=reply.model_fingerprint,
        replica=reply.replica,
        request_id=reply.request_id,
        top_ids=[[list(t.token_ids) for t in s.top] for s in reply.sequences],
        top_logprobs=[[list(t.logprobs) for t in s.top] for s in reply.sequences],
    )


__all__ = ["ScoreResult", "ScoreSequence", "build_score_request", "score_result_from_pb"]
