"""asyncio client of a generator replica or a proxy, on grpc.aio; same API as `Client`.

Cancelling the caller's task cancels the RPC, so the server stops the work. The channels are
opened on first use, inside the running event loop, so an AsyncClient may be built anywhere.
Given several proxies (or a dns:/// name) it spreads its calls over them and outlives any
one's death, with the same rules as `Client` (_failover.py).
"""

from __future__ import annotations

import asyncio
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


class AsyncClient:
    """asyncio rollwire client; use it as an async context manager or await close()."""

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
        self._channels: list[grpc.aio.Channel] = []
        self._stub_cache: list[generator_pb2_grpc.GeneratorServiceStub] = []

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
        lora_config: LoraShape | Mapping[str, Any] | Any,
        base_model_fingerprint: str,
        *,
        chunk_size: int = MAX_CHUNK_BYTES,
        timeout: float | None = None,
    ) -> PushResult:
        """Upload one adapter version (a PEFT safetensors payload); returns once it is served."""
        manifest = build_manifest(name, version, payload, lora_config, base_model_fingerprint)
        check_chunk_size(chunk_size)

        def invoke(stub: generator_pb2_grpc.GeneratorServiceStub, remaining: float) -> Any:
            requests = push_requests(manifest, payload, chunk_size)  # whole again on every attempt
            return stub.PushAdapter(requests, timeout=remaining, metadata=self._metadata)

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
            lambda stub, remaining: stub.GetStatus(pb.GetStatusRequest(), timeout=remaining, metadata=self._metadata),
            timeout,
        )

    async def close(self) -> None:
        channels, self._channels, self._stub_cache = self._channels, [], []
        for channel in channels:
            await channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _stub(self, index: int) -> generator_pb2_grpc.GeneratorServiceStub:
        if not self._stub_cache:
            self._channels = [open_channel(t, self._tls, grpc.aio, self._keepalive) for t in self._rotation.targets]
            self._stub_cache = [generator_pb2_grpc.GeneratorServiceStub(c) for c in self._channels]
        return self._stub_cache[index]

    async def _stream(self, request: pb.GenerateRequest, timeout: float | None) -> AsyncGenerator[StreamEvent, None]:
        attempts = CallAttempts(self._rotation, self._retry, Deadline(check_timeout(timeout, self._timeout)))
        while True:
            stub = self._stub(attempts.index)
            call = stub.Generate(request, timeout=attempts.deadline.remaining(), metadata=self._metadata)
            received = False
            try:
                async for message in call:
                    if not received:
                        received = True
                        attempts.succeeded()
                    for event in events_from_pb(message):
                        yield event
                return
            except grpc.RpcError as exc:
                error = from_rpc_error(exc)
            finally:
                call.cancel()  # caller cancelled or stopped early: free the server's work
            delay = attempts.next(error, received, restartable=True)
            if delay is None:
                raise attempts.final(error)
            if received:
                yield attempts.restarted(error)
            await asyncio.sleep(delay)

    async def _unary(
        self, invoke: Callable[[generator_pb2_grpc.GeneratorServiceStub, float], Awaitable[T]], timeout: float | None
    ) -> T:
        attempts = CallAttempts(self._rotation, self._retry, Deadline(check_timeout(timeout, self._timeout)))
        while True:
            call = invoke(self._stub(attempts.index), attempts.deadline.remaining())
            try:
                reply = await call
            except grpc.RpcError as exc:
                error = from_rpc_error(exc)
            except asyncio.CancelledError:
                call.cancel()  # type: ignore[attr-defined]
                raise
            else:
                attempts.succeeded()
                return reply
            delay = attempts.next(error, received=False)
            if delay is None:
                raise attempts.final(error)
            await asyncio.sleep(delay)
