"""Blocking client of a generator replica or a proxy (both speak GeneratorService).

Every call carries a deadline (the client's `timeout` unless the call gives its own) that
also bounds its retries; every grpc.RpcError leaves as a typed RollwireError. Given several
proxies (or a dns:/// name) the client spreads its calls over them and outlives any one's
death (_failover.py). Safe to share between threads.
"""

from __future__ import annotations

import contextlib
import ssl
import time
from collections.abc import Generator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from rollwire.client._base import ClientBase, Invoke
from rollwire.client._channels import TlsConfig
from rollwire.client._push import MAX_CHUNK_BYTES, PushResult, build_manifest, push_result_from_pb, read_peft_dir
from rollwire.client._requests import AdapterVersion, build_generate_request
from rollwire.client._results import GenerateResult, GroupAccumulator, StreamEvent, events_from_pb
from rollwire.client._score import ScoreResult, ScoreSequence, build_score_request, score_result_from_pb
from rollwire.client._session import Session
from rollwire.common.addresses import split_address
from rollwire.common.bulk import BlockingPush
from rollwire.common.errors import from_rpc_error
from rollwire.common.lora import LoraShape
from rollwire.common.signing import SigningKey
from rollwire.v1 import generator_pb2 as pb

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from rollwire.client._requests import GenerateOptions


class Client(ClientBase):
    """Blocking rollwire client; use it as a context manager or call close()."""

    _grpc = grpc
    _open_at_init = True  # before any of the threads that may share the client

    def generate(
        self,
        prompt: str | Sequence[int],
        n: int = 1,
        *,
        timeout: float | None = None,
        **options: Unpack[GenerateOptions],
    ) -> GenerateResult:
        """Sample one group of `n`; restarts are absorbed, only the complete attempt is returned."""
        return self._generate_request(build_generate_request(prompt, n, **options), timeout)

    def session(self, session_id: str | None = None, **options: Unpack[GenerateOptions]) -> Session:
        """A multi-turn session (an agent's episode) through this client: each `turn(new)` sends
        only the new tokens and the server keeps the history (_session.py)."""
        return Session(self, session_id, **options)

    def _generate_request(self, request: pb.GenerateRequest, timeout: float | None) -> GenerateResult:
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
        signing_key: SigningKey | None = None,
        bulk: bool = False,
        sha256_by_receiver: bool | None = None,
        probe: pb.AdapterProbe | None = None,
    ) -> PushResult:
        """Upload one adapter version (a PEFT safetensors payload); returns once it is served.
        With `signing_key` (SigningKey.load(FILE)) the manifest is signed: required by receivers
        that set trust.keys_file (docs/security.md). `probe`: the version's behavioural proof, which
        every replica holds its engine to before serving it (build_manifest; docs/protocol.md, "Proof"). With `bulk`, the bytes go over the
        receiver's bulk endpoint when it offers one (and so do its relay hops'), else as chunks
        (rollwire.common.bulk); a client with mutual TLS always sends chunks.
        `sha256_by_receiver` (default: with `bulk` and no `signing_key`): the manifest carries
        the BLAKE3 alone and the receiver names the sha256 (`PushResult.sha256`), so the bytes
        start after one fast hash, not two (build_manifest)."""
        if sha256_by_receiver is None:
            sha256_by_receiver = bulk and signing_key is None
        manifest = build_manifest(
            name, version, payload, lora_config, base_model_fingerprint, signing_key, sha256_by_receiver, probe
        )
        invoke = self._push_invoke(manifest, payload, chunk_size)
        if bulk and not (isinstance(self._tls, TlsConfig) and self._tls.certificate_chain):
            invoke = self._bulk_push_invoke(manifest, payload, chunk_size)
        return push_result_from_pb(self._unary(invoke, timeout, push=True), manifest.sha256)

    def _bulk_push_invoke(self, manifest: pb.AdapterManifest, payload: bytes, chunk_size: int) -> Invoke:
        def invoke(stub: Any, remaining: float) -> Any:
            target = self._rotation.targets[self._push_stubs.index(stub)]
            host = split_address(target.removeprefix("dns:///"))[0]
            tls = self._tls if isinstance(self._tls, TlsConfig) else TlsConfig() if self._tls else None
            context = None
            if tls is not None:
                context = ssl.create_default_context()
                if tls.root_certificates:
                    context.load_verify_locations(cadata=tls.root_certificates.decode())
            push = BlockingPush(
                manifest, payload, chunk_size, host, min(3.0, remaining), context, tls.server_name if tls else None
            )
            call = stub.PushAdapter.future(push.requests(), timeout=remaining, metadata=self._metadata)
            push.attach(call)
            return call.result()

        return invoke

    def push_adapter_dir(
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
        """Push a folder written by PEFT's save_pretrained (safetensors)."""
        adapter = read_peft_dir(peft_dir)
        return self.push_adapter(
            name,
            version,
            adapter.payload,
            adapter.lora,
            base_model_fingerprint,
            chunk_size=chunk_size,
            timeout=timeout,
            signing_key=signing_key,
        )

    def score(
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
        return score_result_from_pb(self._unary(self._score_invoke(request), timeout))

    def get_status(self, *, timeout: float | None = None) -> pb.GetStatusResponse:
        """The service's GetStatusResponse message, as sent (a report for people and tools)."""
        return self._unary(self._get_status, timeout)

    def close(self) -> None:
        for channel in self._take_channels():
            channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _stream(self, request: pb.GenerateRequest, timeout: float | None) -> Generator[StreamEvent, None, None]:
        attempts = self._attempts(timeout)
        while True:
            call = self._generate_call(request, attempts)
            try:
                for message in call:
                    attempts.responded()
                    yield from events_from_pb(message)
                return
            except grpc.RpcError as exc:
                error = from_rpc_error(exc)
            finally:
                call.cancel()  # frees server work when the caller stops early
            delay, restarted = attempts.retry(error, restartable=True)
            if restarted:
                yield restarted
            time.sleep(delay)

    def _unary(self, invoke: Invoke, timeout: float | None, push: bool = False) -> Any:
        attempts = self._attempts(timeout)
        while True:
            try:
                reply = invoke(self._stub_for(attempts, push), attempts.deadline.remaining())
            except grpc.RpcError as exc:
                error = from_rpc_error(exc)
            else:
                attempts.responded()
                return reply
            time.sleep(attempts.retry(error)[0])
