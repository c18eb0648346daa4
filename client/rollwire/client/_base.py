"""What the blocking `Client` (sync.py) and the asyncio `AsyncClient` (aio.py) share: all that
does no I/O — the constructor's checks, the addresses and their channels, call metadata, the
requests of each call and the bookkeeping of its attempts (_failover.py). The two subclasses
keep only what blocks or awaits: the calls themselves and the waits between attempts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from rollwire.client._channels import TlsConfig, call_metadata, check_timeout, open_channel
from rollwire.client._failover import CallAttempts, RetryBudget, Rotation, parse_targets
from rollwire.client._push import check_chunk_size, push_requests
from rollwire.client._retries import Deadline, RetryPolicy
from rollwire.common.keepalive import DEFAULT as DEFAULT_KEEPALIVE
from rollwire.common.keepalive import Keepalive
from rollwire.v1 import generator_pb2 as pb
from rollwire.v1.generator_pb2_grpc import GeneratorServiceStub

Invoke = Callable[[GeneratorServiceStub, float], Any]
"""One attempt of a unary call: (stub, seconds left) -> the reply (its awaitable on grpc.aio)."""


class ClientBase:
    """A client's state and its I/O-free steps."""

    _grpc: ClassVar[Any]
    """The module whose channels the client drives: grpc or grpc.aio."""
    _open_at_init: ClassVar[bool]
    """Open the channels in __init__, else on first use (`_stub_for`)."""

    def __init__(
        self,
        target: str | Sequence[str],
        *,
        timeout: float = 60.0,
        token: str | None = None,
        tls: TlsConfig | bool | None = None,
        max_attempts: int | None = None,
        keepalive: Keepalive = DEFAULT_KEEPALIVE,
    ) -> None:
        """`target`: "host:port", several ("a:1,b:2" or a list), or "dns:///name:port".
        `max_attempts`: None retries connection failures for as long as the deadline allows."""
        self._rotation = Rotation(parse_targets(target))
        self._tls, self._keepalive = tls, keepalive
        self._timeout = check_timeout(timeout, 60.0)
        self._metadata = call_metadata(token)
        self._retry = RetryPolicy(max_attempts=max_attempts)
        self._budget = RetryBudget()
        """Shared by every call of this client (_failover.RetryBudget)."""
        self._channels: list[Any] = []
        self._stubs: list[GeneratorServiceStub] = []
        self._push_channels: list[Any] = []
        """Every address's channel for pushes (open_channel's `push`), opened by the first push."""
        self._push_stubs: list[GeneratorServiceStub] = []
        if self._open_at_init:
            self._open_channels()

    def _open_channels(self) -> None:
        """A channel and a stub for every address."""
        self._channels = [open_channel(t, self._tls, self._grpc, self._keepalive) for t in self._rotation.targets]
        self._stubs = [GeneratorServiceStub(c) for c in self._channels]

    def _stub_for(self, attempts: CallAttempts, push: bool = False) -> GeneratorServiceStub:
        """The stub of the current attempt's address (on its push channel for a push); opens
        the channels on first use."""
        if push:
            if not self._push_stubs:
                targets = self._rotation.targets
                self._push_channels = [open_channel(t, self._tls, self._grpc, self._keepalive, True) for t in targets]
                self._push_stubs = [GeneratorServiceStub(c) for c in self._push_channels]
            return self._push_stubs[attempts.index]
        if not self._stubs:
            self._open_channels()
        return self._stubs[attempts.index]

    def _take_channels(self) -> list[Any]:
        """Every open channel, forgotten (close() closes them; a later call opens new ones)."""
        channels = [*self._channels, *self._push_channels]
        self._channels, self._stubs, self._push_channels, self._push_stubs = [], [], [], []
        return channels

    def _attempts(self, timeout: float | None) -> CallAttempts:
        """The attempts of one call, all inside its deadline (`timeout`, or the client's)."""
        deadline = Deadline(check_timeout(timeout, self._timeout))
        return CallAttempts(self._rotation, self._retry, deadline, budget=self._budget)

    def _generate_call(self, request: pb.GenerateRequest, attempts: CallAttempts) -> Any:
        """The current attempt's Generate call: an iterator of responses that `cancel()` stops."""
        stub = self._stub_for(attempts)
        return stub.Generate(request, timeout=attempts.deadline.remaining(), metadata=self._metadata)

    def _push_invoke(self, manifest: pb.AdapterManifest, payload: bytes, chunk_size: int) -> Invoke:
        """A push's attempt; the chunk size is checked now, before any I/O."""
        check_chunk_size(chunk_size)

        def invoke(stub: GeneratorServiceStub, remaining: float) -> Any:
            requests = push_requests(manifest, payload, chunk_size)  # whole again on every attempt
            return stub.PushAdapter(requests, timeout=remaining, metadata=self._metadata)

        return invoke

    def _score_invoke(self, request: pb.ScoreRequest) -> Invoke:
        """A Score attempt (read-only, so any attempt may be redone)."""

        def invoke(stub: GeneratorServiceStub, remaining: float) -> Any:
            return stub.Score(request, timeout=remaining, metadata=self._metadata)

        return invoke

    def _get_status(self, stub: GeneratorServiceStub, remaining: float) -> Any:
        """A GetStatus attempt (an `Invoke`)."""
        return stub.GetStatus(pb.GetStatusRequest(), timeout=remaining, metadata=self._metadata)
