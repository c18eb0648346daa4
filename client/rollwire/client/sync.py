"""Blocking client of a generator replica or a proxy (both speak GeneratorService).

Every call carries a deadline (the client's `timeout` unless the call gives its own) that
also bounds its retries; every grpc.RpcError leaves as a typed RollwireError. Given several
proxies (or a dns:/// name) the client spreads its calls over them and outlives any one's
death (_failover.py). Safe to share between threads.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from rollwire.client._common import (
    MAX_CHUNK_BYTES,
    Deadline,
    GenerateResult,
    GroupAccumulator,
    LoraShape,
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
    open_channel,
    push_requests,
    push_result_from_pb,
    read_peft_dir,
)
from rollwire.client._failover import CallAttempts, Rotation, parse_targets
from rollwire.common.errors import from_rpc_error
from rollwire.common.keepalive import DEFAULT as DEFAULT_KEEPALIVE
from rollwire.common.keepalive import Keepalive
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
        self._timeout = check_timeout(timeout, 60.0)
        self._metadata = call_metadata(token)
        self._retry = RetryPolicy(max_attempts=max_attempts)
        self._channels = [open_channel(t, tls, grpc, keepalive) for t in self._rotation.targets]
        self._stubs = [generator_pb2_grpc.GeneratorServiceStub(c) for c in self._channels]

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
        lora_config: LoraShape | Mapping[str, Any] | Any,
        base_model_fingerprint: str,
        *,
        chunk_size: int = MAX_CHUNK_BYTES,
        timeout: float | None = None,
    ) -> PushResult:
        """Upload one adapter version (a PEFT safetensors payload); returns once it is served."""
        manifest = build_manifest(name, version, payload, lora_config, base_model_fingerprint)
        check_chunk_size(chunk_size)

        def invoke(stub: generator_pb2_grpc.GeneratorServiceStub, remaining: float) -> pb.PushAdapterResponse:
            requests = push_requests(manifest, payload, chunk_size)  # whole again on every attempt
            return stub.PushAdapter(requests, timeout=remaining, metadata=self._metadata)

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
            lambda stub, remaining: stub.GetStatus(pb.GetStatusRequest(), timeout=remaining, metadata=self._metadata),
            timeout,
        )

    def close(self) -> None:
        for channel in self._channels:
            channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _stream(self, request: pb.GenerateRequest, timeout: float | None) -> Generator[StreamEvent, None, None]:
        attempts = CallAttempts(self._rotation, self._retry, Deadline(check_timeout(timeout, self._timeout)))
        while True:
            stub = self._stubs[attempts.index]
            call = stub.Generate(request, timeout=attempts.deadline.remaining(), metadata=self._metadata)
            received = False
            try:
                for message in call:
                    if not received:
                        received = True
                        attempts.succeeded()
                    yield from events_from_pb(message)
                return
            except grpc.RpcError as exc:
                error = from_rpc_error(exc)
            finally:
                call.cancel()  # frees server work when the caller stops early
            delay = attempts.next(error, received, restartable=True)
            if delay is None:
                raise attempts.final(error)
            if received:
                yield attempts.restarted(error)
            time.sleep(delay)

    def _unary(self, invoke: Callable[[generator_pb2_grpc.GeneratorServiceStub, float], T], timeout: float | None) -> T:
        attempts = CallAttempts(self._rotation, self._retry, Deadline(check_timeout(timeout, self._timeout)))
        while True:
            try:
                reply = invoke(self._stubs[attempts.index], attempts.deadline.remaining())
            except grpc.RpcError as exc:
                error = from_rpc_error(exc)
            else:
                attempts.succeeded()
                return reply
            delay = attempts.next(error, received=False)
            if delay is None:
                raise attempts.final(error)
            time.sleep(delay)
