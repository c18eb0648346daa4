"""asyncio client of a generator replica or a proxy, on grpc.aio; same API as `Client`.

Cancelling the caller's task cancels the RPC, so the server stops the work. The channel is
opened on first use, inside the running event loop, so an AsyncClient may be built anywhere.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
import grpc.aio

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
    check_target,
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


class AsyncClient:
    """asyncio rollwire client; use it as an async context manager or await close()."""

    def __init__(
        self,
        target: str,
        *,
        timeout: float = 60.0,
        token: str | None = None,
        tls: TlsConfig | bool | None = None,
        max_attempts: int = 3,
    ) -> None:
        self._target, self._tls = check_target(target), tls
        self._timeout = check_timeout(timeout, 60.0)
        self._metadata = call_metadata(token)
        self._retry = RetryPolicy(max_attempts=max_attempts)
        self._channel: grpc.aio.Channel | None = None
        self._stub_cache: generator_pb2_grpc.GeneratorServiceStub | None = None

    async def generate(
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
        stream = self._stream(request, timeout)
        try:
            async for event in stream:
                group.add(event)
        finally:
            await stream.aclose()
        return group.result()

    def generate_stream(
        self,
        prompt: str | Sequence[int],
        n: int = 1,
        *,
        timeout: float | None = None,
        **options: Unpack[GenerateOptions],
    ) -> AsyncIterator[StreamEvent]:
        """The raw events (Started, Tokens, Finished, Restarted) as they arrive.

        The request is validated now. Leaving the loop early cancels the RPC once the
        generator is closed (`contextlib.aclosing` makes that immediate).
        """
        return self._stream(build_generate_request(prompt, n, **options), timeout)

    async def push_adapter(
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

        def invoke(remaining: float) -> Any:
            requests = push_requests(manifest, payload, chunk_size)
            return self._stub().PushAdapter(requests, timeout=remaining, metadata=self._metadata)

        return push_result_from_pb(await self._unary(invoke, timeout))

    async def push_adapter_dir(
        self,
        peft_dir: str | Path,
        name: str,
        version: int,
        base_model_fingerprint: str,
        *,
        chunk_size: int = MAX_CHUNK_BYTES,
        timeout: float | None = None,
    ) -> PushResult:
        """Push a folder written by PEFT's save_pretrained; the folder is read off the loop."""
        adapter = await asyncio.to_thread(read_peft_dir, peft_dir)
        return await self.push_adapter(
            name, version, adapter.payload, adapter.lora, base_model_fingerprint, chunk_size=chunk_size, timeout=timeout
        )

    async def get_status(self, *, timeout: float | None = None) -> pb.GetStatusResponse:
        """The service's GetStatusResponse message, as sent (a report for people and tools)."""
        return await self._unary(
            lambda remaining: self._stub().GetStatus(pb.GetStatusRequest(), timeout=remaining, metadata=self._metadata),
            timeout,
        )

    async def close(self) -> None:
        if self._channel is not None:
            channel, self._channel, self._stub_cache = self._channel, None, None
            await channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _stub(self) -> generator_pb2_grpc.GeneratorServiceStub:
        if self._stub_cache is None:
            self._channel = open_channel(self._target, self._tls, grpc.aio)
            self._stub_cache = generator_pb2_grpc.GeneratorServiceStub(self._channel)
        return self._stub_cache

    async def _stream(self, request: pb.GenerateRequest, timeout: float | None) -> AsyncGenerator[StreamEvent, None]:
        deadline = Deadline(check_timeout(timeout, self._timeout))
        for attempt in itertools.count(1):
            call = self._stub().Generate(request, timeout=deadline.remaining(), metadata=self._metadata)
            received = False
            try:
                async for message in call:
                    received = True
                    for event in events_from_pb(message):
                        yield event
                return
            except grpc.RpcError as exc:
                error = from_rpc_error(exc)
            finally:
                call.cancel()  # caller cancelled or stopped early: free the server's work
            await self._wait_or_raise(error, attempt, received, deadline)

    async def _unary(self, invoke: Callable[[float], Awaitable[T]], timeout: float | None) -> T:
        deadline = Deadline(check_timeout(timeout, self._timeout))
        for attempt in itertools.count(1):
            call = invoke(deadline.remaining())
            try:
                return await call
            except grpc.RpcError as exc:
                error = from_rpc_error(exc)
            except asyncio.CancelledError:
                call.cancel()  # type: ignore[attr-defined]
                raise
            await self._wait_or_raise(error, attempt, False, deadline)
        raise AssertionError("unreachable")

    async def _wait_or_raise(self, error: RollwireError, attempt: int, received: bool, deadline: Deadline) -> None:
        delay = next_delay(self._retry, error, attempt=attempt, received=received, deadline=deadline)
        if delay is None:
            raise error
        await asyncio.sleep(delay)
