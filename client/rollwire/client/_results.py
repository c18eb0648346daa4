"""Generate streams as the SDK hands them out: events, samples, results, and the fold between them.

Invariants:
- the stream's order is enforced (`started` first, then per-sample tokens and finishes); a
  server that breaks it raises `Internal` (STREAM_PROTOCOL) instead of returning a wrong result;
- after a `Restarted` every partial sample is discarded, so a complete result never mixes
  tokens of two attempts;
- protos stop here: the clients hand out the plain dataclasses below (status excepted).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rollwire.client._requests import AdapterVersion
from rollwire.common import kept
from rollwire.common.errors import Internal
from rollwire.common.reasons import Reason
from rollwire.v1 import generator_pb2 as pb

_FINISH = {pb.FINISH_REASON_EOS: "eos", pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}


def _protocol_error(message: str) -> Internal:
    """The server broke the stream contract; says so instead of returning a wrong result."""
    return Internal(f"the server broke the Generate stream contract: {message}", reason=Reason.STREAM_PROTOCOL)


@dataclass(frozen=True, slots=True)
class Started:
    """First event of a stream (and of every restarted attempt)."""

    request_id: str
    replica: str
    adapter: AdapterVersion | None
    """Adapter in use with "latest" resolved; None for the base model."""
    prompt_token_ids: list[int]


@dataclass(frozen=True, slots=True)
class Tokens:
    """New tokens of one sample, with their behaviour logprobs."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    text: str
    adapter_version: int
    kept_tokens: tuple[tuple[int, ...], ...] = ()
    """With `return_kept_tokens`: per token, the ids top-k/top-p kept when it was sampled
    (empty: the whole vocabulary); rollwire.common.kept."""


@dataclass(frozen=True, slots=True)
class Finished:
    """End of one sample."""

    index: int
    finish_reason: str
    """"eos", "stop" or "length"."""
    prompt_tokens: int
    completion_tokens: int
    routed_experts: RoutedExperts | None = None
    receipt: pb.SampleReceipt | None = None


@dataclass(frozen=True, slots=True)
class RoutedExperts:
    """With `return_routed_experts`: the experts a MoE model routed each forwarded position of a
    sample to (its prompt, then its tokens but the last), `positions` x `layers` x `top_k` ids,
    position-major (pb.RoutedExperts)."""

    positions: int
    layers: int
    top_k: int
    expert_ids: bytes
    """Little-endian uint16 ids; `array()` shapes them."""

    def array(self):
        """A [positions, layers, top_k] numpy uint16 array (needs numpy)."""
        import numpy as np

        return np.frombuffer(self.expert_ids, dtype="<u2").reshape(self.positions, self.layers, self.top_k)

    @staticmethod
    def of(message: pb.RoutedExperts) -> RoutedExperts:
        size = message.positions * message.layers * message.top_k * 2
        if len(message.expert_ids) != size:
            raise _protocol_error(
                f"routed_experts holds {len(message.expert_ids)} bytes; {message.positions} positions x "
                f"{message.layers} layers x {message.top_k} experts need {size}"
            )
        return RoutedExperts(message.positions, message.layers, message.top_k, bytes(message.expert_ids))


@dataclass(frozen=True, slots=True)
class Restarted:
    """The group starts over elsewhere: every partial sample so far is void."""

    attempt: int
    reason: str


StreamEvent = Started | Tokens | Finished | Restarted


def events_from_pb(message: pb.GenerateResponse) -> list[StreamEvent]:
    """The events one GenerateResponse carries, in the order they apply."""
    if message.HasField("restarted"):
        return [Restarted(message.restarted.attempt, message.restarted.reason)]
    events: list[StreamEvent] = []
    if message.HasField("started"):
        s = message.started
        adapter = AdapterVersion(s.adapter.name, s.adapter.version) if s.adapter.name else None
        events.append(Started(s.request_id, s.replica, adapter, list(s.prompt_token_ids)))
    for t in message.tokens:
        events.append(
            Tokens(t.sample_index, list(t.token_ids), list(t.logprobs), t.text, t.adapter_version, _kept_sets(t))
        )
    for f in message.finished:
        if f.finish_reason not in _FINISH:
            raise _protocol_error(f"sample {f.sample_index} finished without a finish reason")
        routed = RoutedExperts.of(f.routed_experts) if f.HasField("routed_experts") else None
        receipt = f.receipt if f.HasField("receipt") else None
        events.append(
            Finished(f.sample_index, _FINISH[f.finish_reason], f.prompt_tokens, f.completion_tokens, routed, receipt)
        )
    if not events:
        raise _protocol_error("a response message carries no event")
    return events


def _kept_sets(chunk: pb.TokenChunk) -> tuple[tuple[int, ...], ...]:
    if not chunk.kept_tokens:
        return ()
    if len(chunk.kept_tokens) != len(chunk.token_ids):
        raise _protocol_error(f"{len(chunk.kept_tokens)} kept-token sets for {len(chunk.token_ids)} tokens")
    try:
        return tuple(tuple(kept.decode(k)) for k in chunk.kept_tokens)
    except ValueError as exc:
        raise _protocol_error(f"a kept-token set is malformed: {exc}") from None


@dataclass(frozen=True, slots=True)
class Sample:
    """One finished completion; token_ids, logprobs and token_versions are parallel."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    adapter_name: str
    """Empty for the base model."""
    adapter_version: int
    """Oldest version among the sample's tokens (the one staleness is counted from)."""
    token_versions: list[int]
    prompt_tokens: int
    completion_tokens: int
    kept_tokens: list[tuple[int, ...]] = field(default_factory=list)
    """With `return_kept_tokens`: parallel to token_ids, each token's kept set (empty: the whole vocabulary)."""
    routed_experts: RoutedExperts | None = None
    """With `return_routed_experts`: the MoE routing of its prompt and tokens (for routing replay)."""
    receipt: pb.SampleReceipt | None = None
    """From a replica with a receipt key: its signed word for this sample (rollwire.common.receipts), which a
    producer attaches to the trajectory it submits (Trajectory.receipts)."""


@dataclass(frozen=True, slots=True)
class GenerateResult:
    """A complete group: every sample of one attempt, sorted by index."""

    request_id: str
    replica: str
    adapter: AdapterVersion | None
    prompt_token_ids: list[int]
    samples: list[Sample]
    restarts: int = 0
    """How many times the group was restarted before this complete attempt."""


@dataclass
class _Partial:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    kept: list[tuple[int, ...]] = field(default_factory=list)


class GroupAccumulator:
    """Folds stream events into complete samples, enforcing the stream's order."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.restarts = 0
        self._reset()

    def _reset(self) -> None:
        self._started: Started | None = None
        self._partial: dict[int, _Partial] = {}
        self._done: dict[int, Sample] = {}

    def add(self, event: StreamEvent) -> Sample | None:
        """Take one event; returns the Sample it completes, if any."""
        if isinstance(event, Restarted):
            self.restarts += 1
            self._reset()
            return None
        if isinstance(event, Started):
            if self._started is not None:
                raise _protocol_error("a second 'started' without 'restarted' before it")
            self._started = event
            return None
        if self._started is None:
            raise _protocol_error("sample events before 'started'")
        if not 0 <= event.index < self.n or event.index in self._done:
            raise _protocol_error(f"event for sample {event.index}, which is out of range or finished")
        if isinstance(event, Tokens):
            self._add_tokens(event)
            return None
        return self._finish(event)

    def _add_tokens(self, event: Tokens) -> None:
        if len(event.logprobs) != len(event.token_ids):
            counts = f"{len(event.logprobs)} logprobs for {len(event.token_ids)} tokens"
            raise _protocol_error(f"sample {event.index}: {counts}")
        part = self._partial.setdefault(event.index, _Partial())
        part.token_ids += event.token_ids
        part.logprobs += event.logprobs
        part.versions += [event.adapter_version] * len(event.token_ids)
        part.text.append(event.text)
        part.kept += event.kept_tokens

    def _finish(self, event: Finished) -> Sample:
        assert self._started is not None
        part = self._partial.pop(event.index, _Partial())
        adapter = self._started.adapter
        version = min(part.versions) if part.versions else (adapter.version if adapter else 0)
        sample = Sample(
            index=event.index,
            token_ids=part.token_ids,
            logprobs=part.logprobs,
            text="".join(part.text),
            finish_reason=event.finish_reason,
            adapter_name=adapter.name if adapter else "",
            adapter_version=version,
            token_versions=part.versions,
            prompt_tokens=event.prompt_tokens,
            completion_tokens=event.completion_tokens,
            kept_tokens=part.kept,
            routed_experts=event.routed_experts,
            receipt=event.receipt,
        )
        self._done[event.index] = sample
        return sample

    def result(self) -> GenerateResult:
        """The complete group; raises Internal when the stream ended early."""
        if self._started is None or len(self._done) != self.n:
            raise _protocol_error(f"the stream ended with {len(self._done)} of {self.n} samples finished")
        s = self._started
        samples = [self._done[i] for i in range(self.n)]
        return GenerateResult(s.request_id, s.replica, s.adapter, s.prompt_token_ids, samples, self.restarts)
