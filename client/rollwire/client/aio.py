"""asyncio client of a generator replica or a proxy, on grpc.aio; same API as `Client`.

Cancelling the caller's task cancels the RPC, so the server stops the work. The channels are
opened on first use, inside the running event loop, so an AsyncClient may be built anywhere.
Given several proxies (or a dns:/// name) it spreads its calls over them and outlives any
one's death, with the same rules as `Client` (_failover.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import grpc.aio

from rollwire.client._base import ClientBase, Invoke
from rollwire.client._push import MAX_CHUNK_BYTES, PushResult, build_manifest, push_result_from_pb, read_peft_dir
from rollwire.client._requests import AdapterVersion, build_generate_request
from rollwire.client._results import GenerateResult, GroupAccumulator, StreamEvent, events_from_pb
from rollwire.client._score import ScoreResult, ScoreSequence, build_score_request, score_result_from_pb
from rollwire.client._session import AsyncSession
from rollwire.common.errors import from_rpc_error
from rollwire.common.lora import LoraShape
from rollwire.common.signing import SigningKey
from rollwire.v1 import generator_pb2 as pb

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from rollwire.client._requests import GenerateOptions


class AsyncClient(ClientBase):
    """asyncio rollwire client; use it as an async context manager or await close()."""

    _grpc = grpc.aio
    _open_at_init = False  # grpc.aio channels belong to the running loop: opened on first use

    async def generate(
        self,
        prompt: str | Sequence[int],
        n: int = 1,
        *,
        timeout: float | None = None,
        **options: Unpack[GenerateOptions],
    ) -> GenerateResult:
        """Sample one group of `n`; restarts are absorbed, only the complete attempt is returned."""
        return await self._generate_request(build_generate_request(prompt, n, **options), timeout)

    def session(self, session_id: str | None = None, **options: Unpack[GenerateOptions]) -> AsyncSession:
        """A multi-turn session (an agent's episode) through this client: each `await turn(new)`
        sends only the new tokens and the server keeps the history (_session.py)."""
        return AsyncSession(self, session_id, **options)

    async def _generate_request(self, request: pb.GenerateRequest, timeout: float | None) -> GenerateResult:
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
        signing_key: SigningKey | None = None,
        sha256_by_receiver: bool = False,
        probe: pb.AdapterProbe | None = None,
    ) -> PushResult:
        """Upload one adapter version (a PEFT safetensors payload); returns once it is served.
        With `signing_key` (SigningKey.load(FILE)) the manifest is signed: required by receivers
        that set trust.keys_file (docs/security.md). `probe`: the version's behavioural proof, which
        every replica holds its engine to before serving it (build_manifest; docs/protocol.md, "Proof"). `sha256_by_receiver`: the manifest carries
        the BLAKE3 alone and the receiver names the sha256 (`PushResult.sha256`; build_manifest)."""
        # the digests read every byte (about 1 s per GiB): off the caller's event loop
        manifest = await asyncio.to_thread(
            build_manifest,
            name,
            version,
            payload,
            lora_config,
            base_model_fingerprint,
            signing_key,
            sha256_by_receiver,
            probe,
        )
        invoke = self._push_invoke(manifest, payload, chunk_size)
        return push_result_from_pb(await self._unary(invoke, timeout, push=True), manifest.sha256)

    async def push_adapter_dir(
        self,
        peft_dir: str | Path,
        name: str,
        version: int,
        base_model_fingerprint: str,
        *,
        chunk_size: int = MAX_CHUNK_BYTES,
        timeout: float | None = None,
        signing_key: SigningKey | None = None,
    ) -> PushResult:
        """Push a folder written by PEFT's save_pretrained; the folder is read off the loop."""
        adapter = await asyncio.to_thread(read_peft_dir, peft_dir)
        return await self.push_adapter(
            name,
            version,
            adapter.payload,
            adapter.lora,
            base_model_fingerprint,
            chunk_size=chunk_size,
            timeout=timeout,
            signing_key=signing_key,
        )

    async def score(
        self,
        sequences: Sequence[ScoreSequence],
        *,
        adapter: str | AdapterVersion | None = None,
        top_k: int = 0,
        request_id: str = "",
        timeout: float | None = None,
    ) -> ScoreResult:
        """Teacher-forced logprobs of each (prompt ids, continuation ids) pair's continuation under
        `adapter` ("name@3", "name" for the newest, None for the base model): the model's raw
        log-softmax at temperature 1, untruncated, with the top_k most likely tokens per position
        when asked, and the version (and its digest) that scored them. Plain Python lists."""
        request = build_score_request(sequences, adapter=adapter, top_k=top_k, request_id=request_id)
        return score_result_from_pb(await self._unary(self._score_invoke(request), timeout))

    async def get_status(self, *, timeout: float | None = None) -> pb.GetStatusResponse:
        """The service's GetStatusResponse message, as sent (a report for people and tools)."""
        return await self._unary(self._get_status, timeout)

    async def close(self) -> None:
        for channel in self._take_channels():
            await channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _stream(self, request: pb.GenerateRequest, timeout: float | None) -> AsyncGenerator[StreamEvent, None]:
        attempts = self._attempts(timeout)
        while True:
            call = self._generate_call(request, attempts)
            try:
                async for message in call:
                    attempts.responded()
                    for event in events_from_pb(message):
                        yield event
                return
            except grpc.RpcError as exc:
                error = from_rpc_error(exc)
            finally:
                call.cancel()  # caller cancelled or stopped early: free the server's work
            delay, restarted = attempts.retry(error, restartable=True)
            if restarted:
                yield restarted
            await asyncio.sleep(delay)

    async def _unary(self, invoke: Invoke, timeout: float | None, push: bool = False) -> Any:
        attempts = self._attempts(timeout)
        while True:
            call = invoke(self._stub_for(attempts, push), attempts.deadline.remaining())
            try:
                reply = await call
            except grpc.RpcError as exc:
                error = from_rpc_error(exc)
            except asyncio.CancelledError:
                call.cancel()
                raise
            else:
                attempts.responded()
                return reply
            await asyncio.sleep(attempts.retry(error)[0])
