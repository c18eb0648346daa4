"""What the sync and async clients share: requests, channels, retries, results.

Invariants:
- a request is validated here before any byte leaves the process (`RequestError`);
- the only failure ever retried is UNAVAILABLE before the first response message: nothing
  was generated for the caller yet, and a push of the same version and digest is idempotent;
  the one exception, a Generate stream whose connection broke after its first message, is
  started again and announced with `Restarted`, as a proxy does (_failover.py);
- after a `GroupRestarted` every partial sample is discarded, so a complete result never
  mixes tokens of two attempts;
- protos stop here: the clients hand out the plain dataclasses below (status excepted).
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

import grpc

from rollwire.common import kept
from rollwire.common.errors import Internal, RequestError, RollwireError
from rollwire.common.errors import finite_number as _float
from rollwire.common.errors import whole_number as _int
from rollwire.common.keepalive import DEFAULT as DEFAULT_KEEPALIVE
from rollwire.common.keepalive import Keepalive
from rollwire.common.lora import LoraShape
from rollwire.common.manifest import NAME_RULE, name_ok
from rollwire.common.reasons import Reason
from rollwire.common.retries import SDK_RETRIES
from rollwire.common.safetensors_header import HeaderError, read_header
from rollwire.common.writer import MAX_CHUNK, messages
from rollwire.v1 import generator_pb2 as pb

MAX_CHUNK_BYTES = MAX_CHUNK
"""Largest payload chunk of a PushAdapter stream (the contract's limit)."""
MAX_MESSAGE_BYTES = 256 << 20
"""Message size limit of SDK channels: far above any sane prompt, status or chunk."""
DEFAULT_MAX_NEW_TOKENS = 128
_UINT32 = (1 << 32) - 1
_UINT64 = (1 << 64) - 1
_INT32 = (1 << 31) - 1
_FINISH = {pb.FINISH_REASON_EOS: "eos", pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}


def _protocol_error(message: str) -> Internal:
    """The server broke the stream contract; says so instead of returning a wrong result."""
    return Internal(f"the server broke the Generate stream contract: {message}", reason=Reason.STREAM_PROTOCOL)


# ---------------------------------------------------------------- adapters and requests


@dataclass(frozen=True, slots=True)
class AdapterVersion:
    """An adapter name and version; version 0 means "latest" in a selector."""

    name: str
    version: int = 0

    def __str__(self) -> str:
        return f"{self.name}@{self.version or 'latest'}"


def check_adapter_name(name: str) -> str:
    """The name, if a server would accept it (the push protocol's one rule)."""
    if not name_ok(name):
        raise RequestError(f"adapter name {name!r} is invalid: use {NAME_RULE}")
    return name


def parse_adapter(spec: str | AdapterVersion | None) -> AdapterVersion | None:
    """ "name" / "name@latest" -> newest version, "name@3" -> version 3, None -> base model."""
    if spec is None or isinstance(spec, AdapterVersion):
        return spec
    if not isinstance(spec, str):
        raise RequestError(f"adapter must be a string like 'name@3', got {type(spec).__name__}")
    name, sep, version = spec.partition("@")
    check_adapter_name(name)
    if not sep or version == "latest":
        return AdapterVersion(name, 0)
    if not version.isdigit() or int(version) < 1 or int(version) > _UINT64:
        raise RequestError(f"adapter {spec!r}: the version after '@' must be a whole number >= 1 or 'latest'")
    return AdapterVersion(name, int(version))


class GenerateOptions(TypedDict, total=False):
    """Keyword options of `generate` / `generate_stream` besides prompt and n."""

    max_new_tokens: int
    temperature: float | None
    top_p: float | None
    top_k: int | None
    stop: str | Sequence[str]
    seed: int | None
    ignore_eos: bool
    return_kept_tokens: bool
    adapter: str | AdapterVersion | None
    follow: bool
    group_key: str
    request_id: str


def _set_prompt(request: pb.GenerateRequest, prompt: str | Sequence[int]) -> None:
    if isinstance(prompt, str):
        request.text = prompt
        return
    if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, Iterable):
        raise RequestError(f"prompt must be a str or a list of token ids, got {type(prompt).__name__}")
    ids = [_int("prompt token id", token, 0, _INT32) for token in prompt]
    if not ids:
        raise RequestError("prompt token ids must hold at least one id")
    request.token_ids.ids.extend(ids)


def _sampling(
    max_new_tokens: int,
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
    stop: str | Sequence[str],
    seed: int | None,
    ignore_eos: bool,
    return_kept_tokens: bool = False,
) -> pb.SamplingParams:
    params = pb.SamplingParams(max_new_tokens=_int("max_new_tokens", max_new_tokens, 1, _UINT32))
    if temperature is not None:
        if _float("temperature", temperature) < 0:
            raise RequestError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
        params.temperature = temperature
    if top_p is not None:
        if not 0 < _float("top_p", top_p) <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {top_p}")
        params.top_p = top_p
    if top_k is not None:
        params.top_k = _int("top_k", top_k, 0, _UINT32)
    stops = [stop] if isinstance(stop, str) else list(stop)
    if not all(isinstance(s, str) and s for s in stops):
        raise RequestError(f"stop must be non-empty strings, got {stops!r}")
    params.stop.extend(stops)
    if seed is not None:
        params.seed = _int("seed", seed, 0, _UINT64)
    params.ignore_eos = bool(ignore_eos)
    params.return_kept_tokens = bool(return_kept_tokens)
    return params


def build_generate_request(
    prompt: str | Sequence[int],
    n: int = 1,
    *,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    stop: str | Sequence[str] = (),
    seed: int | None = None,
    ignore_eos: bool = False,
    return_kept_tokens: bool = False,
    adapter: str | AdapterVersion | None = None,
    follow: bool = False,
    group_key: str = "",
    request_id: str = "",
) -> pb.GenerateRequest:
    """One validated GenerateRequest; unset optional params stay unset on the wire."""
    request = pb.GenerateRequest(n=_int("n", n, 1, _UINT32))
    _set_prompt(request, prompt)
    request.sampling.CopyFrom(
        _sampling(max_new_tokens, temperature, top_p, top_k, stop, seed, ignore_eos, return_kept_tokens)
    )
    selector = parse_adapter(adapter)
    if selector is not None:
        request.adapter.name, request.adapter.version = selector.name, selector.version
    if follow:
        if selector is None or selector.version:
            raise RequestError("follow=True needs adapter='NAME' or 'NAME@latest': a pinned version cannot be followed")
        request.adapter.follow = True
    if not isinstance(group_key, str) or not isinstance(request_id, str):
        raise RequestError("group_key and request_id must be strings")
    request.group_key, request.request_id = group_key, request_id
    return request


# ---------------------------------------------------------------- channels


@dataclass(frozen=True)
class TlsConfig:
    """TLS for a channel: server roots, optional client cert+key for mutual TLS (PEM bytes)."""

    root_certificates: bytes | None = None
    """PEM roots that sign the server certificate; None trusts the system roots."""
    certificate_chain: bytes | None = None
    """Client certificate for mutual TLS; needs private_key."""
    private_key: bytes | None = None
    server_name: str | None = None
    """Name to check the server certificate against, when it differs from the target host."""

    def __post_init__(self) -> None:
        if (self.certificate_chain is None) != (self.private_key is None):
            raise RequestError("mutual TLS needs both a client certificate and its private key")

    @classmethod
    def from_files(
        cls,
        root: str | Path | None = None,
        cert: str | Path | None = None,
        key: str | Path | None = None,
        server_name: str | None = None,
    ) -> TlsConfig:
        def read(path: str | Path | None) -> bytes | None:
            return None if path is None else Path(path).read_bytes()

        return cls(read(root), read(cert), read(key), server_name)


def check_target(target: str) -> str:
    if not isinstance(target, str) or not target.strip():
        raise RequestError(f"target must be an address like host:port, got {target!r}")
    return target


def open_channel(
    target: str, tls: TlsConfig | bool | None, api: Any = grpc, keepalive: Keepalive = DEFAULT_KEEPALIVE
) -> Any:
    """A channel from `api` (the grpc module, or grpc.aio) with rollwire's options: keepalive
    (a silent server is noticed within `keepalive.bound_s`), quick reconnects, and for a
    `dns:///` target round-robin balancing over every address the name resolves to."""
    check_target(target)
    options: list[tuple[str, int | str]] = [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        *keepalive.channel_options(),
    ]
    if target.startswith("dns:"):
        options.append(("grpc.lb_policy_name", "round_robin"))
    if tls is None or tls is False:
        return api.insecure_channel(target, options=options)
    config = TlsConfig() if tls is True else tls
    if config.server_name:
        options.append(("grpc.ssl_target_name_override", config.server_name))
    credentials = grpc.ssl_channel_credentials(config.root_certificates, config.private_key, config.certificate_chain)
    return api.secure_channel(target, credentials, options=options)


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Metadata sent on every call: the bearer token, when there is one."""
    if not token:
        return ()
    if any(c.isspace() for c in token):
        raise RequestError("the bearer token must not contain whitespace")
    return (("authorization", f"Bearer {token}"),)


def check_timeout(timeout: float | None, default: float) -> float:
    value = default if timeout is None else timeout
    if _float("timeout", value) <= 0:
        raise RequestError(f"timeout must be > 0 seconds, got {value}")
    return float(value)


# ---------------------------------------------------------------- retries


def is_retryable(error: RollwireError, received_response: bool) -> bool:
    """The SDK's one retry predicate: a code in retries.SDK_RETRIES (UNAVAILABLE), and nothing
    received from the server yet (so no work can be duplicated); the why: rollwire.common.retries."""
    return error.code in SDK_RETRIES and not received_response


@dataclass(frozen=True)
class RetryPolicy:
    """Attempts with jittered exponential backoff, inside the call's deadline."""

    max_attempts: int | None = None
    """None: as many as the call's deadline allows (a proxy restarting is waited out)."""
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 1.0

    def __post_init__(self) -> None:
        if self.max_attempts is not None:
            _int("max_attempts", self.max_attempts, 1, 10_000)

    def backoff_s(self, attempt: int, hint_s: float | None = None, rand: Any = random.random) -> float:
        """Delay after failed attempt `attempt` (1-based): half to all of the exponential step."""
        step = min(self.max_backoff_s, self.initial_backoff_s * 2 ** (attempt - 1))
        return max(step * (0.5 + 0.5 * rand()), hint_s or 0.0)


class Deadline:
    """One deadline shared by every attempt of a call, so retries never extend it."""

    def __init__(self, timeout_s: float) -> None:
        self._end = time.monotonic() + timeout_s

    def remaining(self) -> float:
        return max(0.0, self._end - time.monotonic())


# ---------------------------------------------------------------- stream events and results


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
        events.append(Finished(f.sample_index, _FINISH[f.finish_reason], f.prompt_tokens, f.completion_tokens))
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


# ---------------------------------------------------------------- adapter push


LoraSpec = LoraShape
"""The SDK's first name for rollwire.common.lora.LoraShape, kept for existing callers."""


@dataclass(frozen=True)
class PeftAdapter:
    """A PEFT adapter folder read into memory, ready to push."""

    payload: bytes
    """adapter_model.safetensors, byte for byte."""
    lora: LoraShape
    base_model_name_or_path: str | None

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.payload).hexdigest()


def read_peft_dir(path: str | Path) -> PeftAdapter:
    """Read adapter_config.json and adapter_model.safetensors; refuses anything else."""
    root = Path(path)
    config_path, weights_path = root / "adapter_config.json", root / "adapter_model.safetensors"
    if not config_path.is_file():
        raise RequestError(f"{root} has no adapter_config.json; point at a folder saved by PEFT's save_pretrained")
    if not weights_path.is_file():
        raise RequestError(f"{root} has no adapter_model.safetensors; save the adapter with safe_serialization=True")
    try:
        config = json.loads(config_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RequestError(f"{config_path} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise RequestError(f"{config_path} does not hold a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise RequestError(f"{config_path} describes a {config['peft_type']} adapter; only LoRA is served")
    payload = weights_path.read_bytes()
    try:
        read_header(payload)
    except HeaderError as exc:
        raise RequestError(f"{weights_path} is not a valid safetensors file: {exc}") from None
    return PeftAdapter(payload, LoraShape.from_peft(config), config.get("base_model_name_or_path") or None)


def build_manifest(
    name: str,
    version: int,
    payload: bytes,
    lora_config: LoraShape | Mapping[str, Any] | Any,
    base_model_fingerprint: str,
) -> pb.AdapterManifest:
    """The manifest message that opens a push; checks what the server would refuse anyway."""
    if not isinstance(payload, (bytes, bytearray, memoryview)) or not len(payload):
        raise RequestError("the adapter payload must be non-empty bytes (a safetensors file)")
    if not isinstance(base_model_fingerprint, str) or not base_model_fingerprint:
        raise RequestError("base_model_fingerprint is required; take it from GetStatus or model_fingerprint()")
    return pb.AdapterManifest(
        name=check_adapter_name(name),
        version=_int("version", version, 1, _UINT64),
        base_model_fingerprint=base_model_fingerprint,
        lora_config=LoraShape.from_peft(lora_config).to_pb(),
        byte_length=len(payload),
        sha256=hashlib.sha256(payload).hexdigest(),
    )


def check_chunk_size(chunk_size: int) -> int:
    return _int("chunk_size", chunk_size, 1, MAX_CHUNK_BYTES)


def push_requests(
    manifest: pb.AdapterManifest, payload: bytes, chunk_size: int = MAX_CHUNK_BYTES
) -> Iterator[pb.PushAdapterRequest]:
    """The manifest, then the payload in chunks of at most `chunk_size` bytes."""
    yield from messages(manifest, payload, check_chunk_size(chunk_size))


@dataclass(frozen=True, slots=True)
class ReplicaPush:
    """Outcome of a push on one replica behind a proxy."""

    replica: str
    code: str
    """gRPC status code name; "OK" on success."""
    message: str


@dataclass(frozen=True, slots=True)
class PushResult:
    """A confirmed push: the version is loaded and served."""

    name: str
    version: int
    already_loaded: bool
    loaded_versions: list[int]
    replicas: list[ReplicaPush]
    """Filled by a proxy; empty from a replica."""
    peers: list[PeerPush] = field(default_factory=list)
    """Filled by a proxy with peer proxies: whether each one's spool holds the version now."""


@dataclass(frozen=True, slots=True)
class PeerPush:
    """Outcome of sharing a push with one peer proxy (a peer that is behind is named here)."""

    address: str
    code: str
    """gRPC status code name; "OK" when the peer's spool holds the version."""
    reason: str
    """PEER_BEHIND for a peer being caught up, PEER_VERSION_CONFLICT, ...; empty on success."""
    message: str


def push_result_from_pb(message: pb.PushAdapterResponse) -> PushResult:
    replicas = [ReplicaPush(r.replica, r.code, r.message) for r in message.replicas]
    peers = [PeerPush(p.address, p.code, p.reason, p.message) for p in message.peers]
    loaded = list(message.loaded_versions)
    return PushResult(message.name, message.version, message.already_loaded, loaded, replicas, peers)
