"""Multi-turn sessions in the SDK: `client.session(...)` keeps an episode's exact token history.

Each `turn(new)` sends only the new tokens (environment or tool output; the first turn: the
prompt) with GenerateRequest.session; the server conditions the model on the whole history
and the reply's exact ids are appended here too, never re-tokenized. Invariants:
- `history`, `loss_mask` and `logprobs` are parallel: every token of the episode in order,
  1 in the mask for the model's tokens and 0 for prompt/environment tokens, whose logprob
  and version are 0;
- each turn tells the server how long a history it expects (`expect_tokens`); a server that
  lost the session (expired, evicted, restarted) refuses with SESSION_LOST and the helper
  sends the whole history again as the session's first turn, so the episode goes on with
  the same tokens;
- a failed turn changes nothing here (nor on the server): the caller may send it again.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from rollwire.client._requests import build_generate_request
from rollwire.client._results import GenerateResult
from rollwire.common.errors import FailedPrecondition, RequestError
from rollwire.common.reasons import Reason
from rollwire.v1 import generator_pb2 as pb


class Sender(Protocol):
    """What a `Session` needs of its client (`Client` is one): a generate call that returns the whole group."""

    def _generate_request(self, request: pb.GenerateRequest, timeout: float | None) -> GenerateResult: ...


class AsyncSender(Protocol):
    """What an `AsyncSession` needs of its client (`AsyncClient` is one)."""

    async def _generate_request(self, request: pb.GenerateRequest, timeout: float | None) -> GenerateResult: ...


@dataclass(frozen=True, slots=True)
class TurnReply:
    """The model's answer to one turn; token_ids, logprobs and token_versions are parallel."""

    token_ids: list[int]
    logprobs: list[float]
    token_versions: list[int]
    text: str
    finish_reason: str
    """"eos", "stop" or "length"."""
    prompt_token_ids: list[int]
    """The whole history the model was conditioned on for this turn."""
    replica: str
    adapter_version: int


@dataclass
class _SessionState:
    """What both helpers share: the id, the options of every turn and the episode so far."""

    id: str
    options: dict[str, Any]
    history: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    closed: bool = False

    def request(self, new: str | Sequence[int], end: bool, resend: bool) -> pb.GenerateRequest:
        """This turn's request; `resend`: the whole history plus `new` as a first turn."""
        if self.closed:
            raise RequestError(f"session {self.id!r} is closed; open another with client.session()")
        if resend:
            if isinstance(new, str):
                raise RequestError(
                    f"the server lost session {self.id!r}; resending it needs token ids, so send this turn as ids"
                )
            new = [*self.history, *new]
        request = build_generate_request(new, 1, **self.options)
        request.session.id, request.session.end = self.id, end
        request.session.expect_tokens = 0 if resend else len(self.history)
        return request

    def absorb(self, result: GenerateResult) -> TurnReply:
        """Append the completed turn: the prompt's new tokens (mask 0), then the reply's (mask 1)."""
        prompt, sample = result.prompt_token_ids, result.samples[0]
        if prompt[: len(self.history)] != self.history:
            raise FailedPrecondition(
                f"the server conditioned session {self.id!r} on another history than this helper keeps; "
                "start a new session",
                reason=Reason.SESSION_LOST,
            )
        new = prompt[len(self.history) :]
        self.history += [*new, *sample.token_ids]
        self.loss_mask += [0] * len(new) + [1] * len(sample.token_ids)
        self.logprobs += [0.0] * len(new) + sample.logprobs
        self.versions += [0] * len(new) + sample.token_versions
        return TurnReply(
            sample.token_ids,
            sample.logprobs,
            sample.token_versions,
            sample.text,
            sample.finish_reason,
            prompt,
            result.replica,
            sample.adapter_version,
        )


def _lost(error: Exception) -> bool:
    return isinstance(error, FailedPrecondition) and error.reason == Reason.SESSION_LOST


class Session:
    """One episode through a blocking `Client` (`client.session(...)`)."""

    def __init__(self, client: Sender, session_id: str | None = None, **options: Any) -> None:
        """`options`: generate's keyword options (max_new_tokens, temperature, seed, adapter,
        follow, ...) for every turn; `n` is always 1. `session_id` defaults to a random uuid."""
        build_generate_request([0], 1, **options)  # the options are checked now
        self._client, self._state = client, _SessionState(session_id or uuid.uuid4().hex, dict(options))

    @property
    def id(self) -> str:
        return self._state.id

    @property
    def history(self) -> list[int]:
        """Every token of the episode so far (prompt, environment and model tokens)."""
        return list(self._state.history)

    @property
    def loss_mask(self) -> list[int]:
        """Parallel to history: 1 for the model's tokens, 0 for prompt and environment tokens."""
        return list(self._state.loss_mask)

    @property
    def logprobs(self) -> list[float]:
        """Parallel to history: each model token's behaviour logprob (0 elsewhere)."""
        return list(self._state.logprobs)

    @property
    def token_versions(self) -> list[int]:
        """Parallel to history: the adapter version of each model token (0 elsewhere)."""
        return list(self._state.versions)

    def turn(self, new: str | Sequence[int], *, end: bool = False, timeout: float | None = None) -> TurnReply:
        """Send this turn's new tokens (or text) and return the model's reply."""
        try:
            result = self._client._generate_request(self._state.request(new, end, False), timeout)
        except FailedPrecondition as err:
            if not _lost(err) or not self._state.history:
                raise
            result = self._client._generate_request(self._state.request(new, end, True), timeout)
        reply = self._state.absorb(result)
        self._state.closed = self._state.closed or end
        return reply

    def close(self, *, timeout: float | None = None) -> None:
        """Forget the episode here; the server forgets it at its next turn with end=True or by TTL."""
        self._state.closed = True


class AsyncSession:
    """One episode through an `AsyncClient` (`client.session(...)`)."""

    def __init__(self, client: AsyncSender, session_id: str | None = None, **options: Any) -> None:
        """As `Session`."""
        build_generate_request([0], 1, **options)
        self._client, self._state = client, _SessionState(session_id or uuid.uuid4().hex, dict(options))

    id = Session.id
    history = Session.history
    loss_mask = Session.loss_mask
    logprobs = Session.logprobs
    token_versions = Session.token_versions

    async def turn(self, new: str | Sequence[int], *, end: bool = False, timeout: float | None = None) -> TurnReply:
        """Send this turn's new tokens (or text) and return the model's reply."""
        try:
            result = await self._client._generate_request(self._state.request(new, end, False), timeout)
        except FailedPrecondition as err:
            if not _lost(err) or not self._state.history:
                raise
            result = await self._client._generate_request(self._state.request(new, end, True), timeout)
        reply = self._state.absorb(result)
        self._state.closed = self._state.closed or end
        return reply

    async def close(self, *, timeout: float | None = None) -> None:
        """As `Session.close`."""
        self._state.closed = True
