"""Blocking client of a generator replica or a proxy (both speak GeneratorService).

Every call carries a deadline (the client's `timeout` unless the call gives its own) that
also bounds its retries; every grpc.RpcError leaves as a typed RollwireError.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from rollwire.client._common import (
    MAX_CHUNK_BYTES,
    Deadline,
    GenerateResult,
    GroupAccumulator,
    LoraSpec,
    PushResult,
    RetryPolicy,
    StreamEvent,
    TlsConfig,
    build_generate_request,
    build_manifest,
    call_metadata,
    check_chunk_size,
    check_timeout,
    events_from_pb,
    next_delay,
    open_channel,
    push_requests,
    push_result_from_pb,
    read_peft_dir,
)
from rollwire.common.errors import RollwireError, from_rpc_error
from rollwire.v1 import generator_pb2 as pb
from rollwire.v1 import generator_pb2_grpc

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from rollwire.client._common import GenerateOptions

T = TypeVar("T")


class Client:
    """Blocking rollwire client; use it as a context manager or call close()."""

    def __init__(
        self,
        target: str,
        *,
        timeout: float = 60.0,
        token: str | None = None,
        tls: TlsConfig | bool | None = None,
        max_attempts: int = 3,
    ) -> None:
        self._timeout = check_timeout(timeout, 60.0)
        self._metadata = call_metadata(token)
        self._retry = RetryPolicy(max_attempts=max_attempts)
        self._channel = open_channel(target, tls, grpc)
        self._stub = generator_pb2_grpc.GeneratorServiceStub(self._channel)

    def generate(
        self,
        prompt: str | Sequence[int],
        n: int = 1,
        *,
        timeout: float | None = None,
        **options: Unpack[GenerateOptions],
    ) -> GenerateResult:
        """Sample one group of `n`; restarts are absorbed, only the complete attempt is returned."""
        request = build_generate_request(prompt, n, **options)
        group = GroupAccumulator(request.n)
        with contextlib.closing(self._stream(request, timeout)) as events:  # cancels the RPC on any error
            for event in events:
                group.add(event)
        return group.result()

    def generate_stream(
        self,
        prompt: str | Sequence[int],
        n: int = 1,
        *,
        timeout: float | None = None,
        **options: Unpack[GenerateOptions],
    ) -> Iterator[StreamEvent]:
        """The raw events (Started, Tokens, Finished, Restarted) as they arrive.

        The request is validated now; closing the iterator early cancels the RPC. After a
        Restarted event the caller must drop what it kept (GroupAccumulator does).
        """
        return self._stream(build_generate_request(prompt, n, **options), timeout)

    def push_adapter(
        self,
        name: str,
        version: int,
        payload: bytes,
        lora_config: LoraSpec | Mapping[str, Any] | Any,
        base_model_fingerprint: str,
        *,
        chunk_size: int = MAX_CHUNK_BYTES,
        timeout: float | None = None,
    ) -> PushResult:
        """Upload one adapter version (a PEFT safetensors payload); returns once it is served."""
        manifest = build_manifest(name, version, payload, lora_config, base_model_fingerprint)
        check_chunk_size(chunk_size)

        def invoke(remaining: float) -> pb.PushAdapterResponse:
            requests = push_requests(manifest, payload, chunk_size)
            return self._stub.PushAdapter(requests, timeout=remaining, metadata=self._metadata)

        return push_result_from_pb(self._unary(invoke, timeout))

    def push_adapter_dir(
        self,
        peft_dir: str | Path,
        name: str,
        version: int,
        base_model_fingerprint: str,
        *,
        chunk_size: int = MAX_CHUNK_BYTES,
        timeout: float | None = None,
    ) -> PushResult:
        """Push a folder written by PEFT's save_pretrained (safetensors)."""
        adapter = read_peft_dir(peft_dir)
        return self.push_adapter(
            name, version, adapter.payload, adapter.lora, base_model_fingerprint, chunk_size=chunk_size, timeout=timeout
        )

    def get_status(self, *, timeout: float | None = None) -> pb.GetStatusResponse:
        """The service's GetStatusResponse message, as sent (a report for people and tools)."""
        return self._unary(
            lambda remaining: self._stub.GetStatus(pb.GetStatusRequest(), timeout=remaining, metadata=self._metadata),
            timeout,
        )

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _stream(self, request: pb.GenerateRequest, timeout: float | None) -> Iterator[StreamEvent]:
        deadline = Deadline(check_timeout(timeout, self._timeout))
        for attempt in itertools.count(1):
            call = self._stub.Generate(request, timeout=deadline.remaining(), metadata=self._metadata)
            received = False
            try:
                for message in call:
                    received = True
                    yield from events_from_pb(message)
                return
            except grpc.RpcError as exc:
                error = from_rpc_error(exc)
            finally:
                call.cancel()  # frees server work when the caller stops early
            self._wait_or_raise(error, attempt, received, deadline)

    def _unary(self, invoke: Callable[[float], T], timeout: float | None) -> T:
        deadline = Deadline(check_timeout(timeout, self._timeout))
        for attempt in itertools.count(1):
            try:
                return invoke(deadline.remaining())
            except grpc.RpcError as exc:
                error = from_rpc_error(exc)
            self._wait_or_raise(error, attempt, False, deadline)
        raise AssertionError("unreachable")

    def _wait_or_raise(self, error: RollwireError, attempt: int, received: bool, deadline: Deadline) -> None:
        delay = next_delay(self._retry, error, attempt=attempt, received=received, deadline=deadline)
        if delay is None:
            raise error
        time.sleep(delay)
