"""The PushAdapter protocol in one place: what every sender writes and every receiver reads.

The SDK writes pushes; the proxy reads a client's upload and writes it on to replicas; a
replica reads it and, given a relay plan, writes it on to its children. All of them use
this module, which needs no torch and no server code.

Invariants:
- a push stream is one opening message (the manifest, and optionally a relay plan and the
  `stage_only` flag), then chunks of at most MAX_CHUNK bytes, never more bytes in all than
  the manifest's `byte_length`; a receiver checks each message as it arrives and refuses
  with the same codes and reasons wherever it runs;
- every receiver hashes the payload once, incrementally, while it arrives (`PushReader`: a
  worker thread per push, so hashing overlaps receiving and never runs on the event loop);
  length and digest are checked when the stream ends, before anything may use the payload;
- `PushReader.chunks()` hands each chunk on as the very `bytes` object received, before the
  upload ends, so a relay forwards it at once; the receiver's own copy (one buffer, and a
  file when asked) is written by the same worker, so a host holds the payload once; a file
  that cannot be written ends the upload with RESOURCE_EXHAUSTED (DISK_FULL) when its disk
  is full, else UNAVAILABLE (STORE_FAILED) (durable.storage_error);
- one adapter-name rule (`NAME_RE`) for the SDK, the proxy and the replica, and one set of
  manifest rules (`check_manifest`, `check_push_version`);
- a relay plan is a flat list in which every node follows its parent, so a receiver checks
  it in one pass, with bounded size and no recursion; a node's children and their subtrees
  come from `split_plan`, every node keeping the grant its proxy signed it with
  (`relay_grant`: bound to the push's name, version, digest and the node's address), so a
  replica with auth on relays only to the members its proxy planned (`unplanned`);
- a striped push (`Stripe`) is S streams per receiver, each carrying the chunks j = index mod
  S of the payload cut at exactly `chunk_bytes` (`stripe_layout`, checked chunk by chunk by
  `PushReader.stripe_chunks`); an `Assembly` feeds them to one sink in payload order, so the
  payload is hashed and checked once, as for any push, and exactly one stream (the one whose
  end completes it) takes the verdict.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import io
import math
import os
import re
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import grpc

from rollwire.common.durable import storage_error
from rollwire.common.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    RollwireError,
    clip,
    status_detail,
    to_status,
)
from rollwire.common.lora import LoraShape
from rollwire.common.reasons import Reason
from rollwire.v1 import generator_pb2 as pb

MAX_CHUNK = 1 << 20
"""Largest payload chunk of a PushAdapter stream (the contract's limit, 1 MiB)."""
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
"""Adapter names: always used with fullmatch (a `$` would let a final newline through)."""
NAME_RULE = "1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"
MAX_VERSION = 1 << 53
"""Largest adapter version: exact in JSON and in a double, so every tool reads it right."""
DEFAULT_MAX_VERSION_STEP = 1_000_000
"""A version may be at most newest + this (newest = 0 for a new name), so no single push can
use up a name's version range; pushing 2**53 takes 9e9 pushes."""
MAX_LORA_R = 4096
MAX_TARGET_MODULES = 256
MAX_TARGET_MODULE_CHARS = 256
MAX_PLAN_NODES = 8192
"""Most replicas in one relay plan (a plan of 8192 nodes is ~300 KB on the wire)."""
ADDRESS_RE = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]{1,253}):[0-9]{1,5}")
_SUBMIT_BYTES = 256 << 10  # small chunks are handed to the worker thread in batches of this size
_DIGEST_RE = re.compile(r"[0-9a-f]{64}")


# -- names and manifests -------------------------------------------------------------------
def name_ok(name: object) -> bool:
    return isinstance(name, str) and NAME_RE.fullmatch(name) is not None


def check_name(name: object) -> str:
    """The adapter name, or INVALID_ARGUMENT (reason BAD_ADAPTER_NAME) with the rule."""
    if not name_ok(name):
        raise InvalidArgument(
            f"adapter name {clip(str(name))} is invalid: use {NAME_RULE}", reason=Reason.BAD_ADAPTER_NAME
        )
    return name  # type: ignore[return-value]


@dataclass(frozen=True)
class Manifest:
    """What a push declares before its bytes arrive."""

    name: str
    version: int
    base_model_fingerprint: str
    lora: LoraShape
    byte_length: int
    sha256: str


def manifest_from_pb(m: pb.AdapterManifest) -> Manifest:
    """The wire AdapterManifest as a Manifest (the digest as sent: only lowercase hex is valid)."""
    return Manifest(
        m.name, m.version, m.base_model_fingerprint, LoraShape.from_pb(m.lora_config), m.byte_length, m.sha256
    )


def check_manifest(m: Manifest, *, fingerprint: str | None, max_bytes: int, holder: str = "replica") -> None:
    """Refuse a manifest before any byte is read; each failure has its own sentence.
    `fingerprint=None` skips the base-model check (a spool reload, before any replica is known)."""
    check_name(m.name)
    check_version_number(m.version)
    if fingerprint is not None and m.base_model_fingerprint != fingerprint:
        raise FailedPrecondition(
            f"adapter {m.name!r} v{m.version} was trained on base model {m.base_model_fingerprint[:80] or '(none given)'}, "
            f"but the base model served here is {fingerprint}; push an adapter of this base model",
            reason=Reason.BASE_MODEL_MISMATCH,
        )
    lora = m.lora
    modules = lora.target_modules
    if (
        not 1 <= lora.r <= MAX_LORA_R
        or not math.isfinite(lora.lora_alpha)
        or not lora.lora_alpha > 0
        or not 1 <= len(modules) <= MAX_TARGET_MODULES
        or not all(1 <= len(t) <= MAX_TARGET_MODULE_CHARS for t in modules)
    ):
        raise InvalidArgument(
            f"lora_config needs 1 <= r <= {MAX_LORA_R}, a finite lora_alpha > 0 and 1 to {MAX_TARGET_MODULES} target "
            f"modules of 1 to {MAX_TARGET_MODULE_CHARS} characters (got r={lora.r}, lora_alpha={lora.lora_alpha}, "
            f"{len(modules)} target modules)",
            reason=Reason.BAD_LORA_CONFIG,
        )
    check_digest(m.sha256)
    if m.byte_length < 1:
        raise InvalidArgument("byte_length must be > 0", reason=Reason.BAD_LENGTH)
    if m.byte_length > max_bytes:
        raise ResourceExhausted(
            f"adapter of {m.byte_length} bytes exceeds this {holder}'s limit of {max_bytes} bytes",
            reason=Reason.ADAPTER_TOO_LARGE,
        )


def check_push_version(
    m, newest: int, held_sha256: str | None, holder: str, max_step: int = DEFAULT_MAX_VERSION_STEP
) -> bool:
    """The version rule shared by replicas and the proxy's spool: True when this exact
    version is already held (an idempotent re-push); raises when it may not be pushed.
    `m` is a Manifest or the wire AdapterManifest: only name, version and sha256 are read.
    A version above 2**53 or more than `max_step` above the newest (0 for a new name) is
    refused, so no push can use up the range of a name."""
    if m.version > MAX_VERSION or m.version > newest + max_step:
        raise InvalidArgument(
            f"adapter {m.name!r} v{m.version} is too far ahead: a version may be at most {max_step} above the newest "
            f"(v{newest} on this {holder}) and at most 2**53; push v{newest + 1}",
            reason=Reason.VERSION_TOO_FAR,
        )
    if held_sha256 is not None:
        if held_sha256 == m.sha256:
            return True
        raise FailedPrecondition(
            f"adapter {m.name!r} v{m.version} is already loaded with a different digest; "
            f"versions are immutable, push it as v{newest + 1}",
            reason=Reason.VERSION_CONFLICT,
        )
    if m.version <= newest:
        raise FailedPrecondition(
            f"adapter {m.name!r} v{m.version} is not above the newest version v{newest} this {holder} has "
            f"accepted; versions only increase, push v{newest + 1} or higher",
            reason=Reason.VERSION_NOT_MONOTONIC,
        )
    return False


def check_commit(name: str, version: int, sha256: str) -> None:
    """The fields of a CommitAdapterRequest; INVALID_ARGUMENT with a sentence."""
    check_name(name)
    check_version_number(version)
    check_digest(sha256, "of the staged payload")


def check_version_number(version: int) -> None:
    """The one range rule of versions, for manifests and commits: 1 to MAX_VERSION (2**53);
    INVALID_ARGUMENT with the reason a client acts on otherwise."""
    if version < 1:
        raise InvalidArgument(f"adapter version must be >= 1 (got {version})", reason=Reason.BAD_ADAPTER_VERSION)
    if version > MAX_VERSION:
        raise InvalidArgument(
            f"adapter version {version} is above the largest version, 2**53 ({MAX_VERSION})",
            reason=Reason.VERSION_TOO_FAR,
        )


def check_digest(sha256: str, of: str = "of the payload") -> None:
    """A sha256 as sent on the wire: exactly 64 lowercase hex digits; INVALID_ARGUMENT otherwise."""
    if not _DIGEST_RE.fullmatch(sha256):
        raise InvalidArgument(f"sha256 must be the 64 lowercase hex digits {of}", reason=Reason.BAD_DIGEST)


# -- relay plans -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Child:
    """A direct child of a relay node: where to dial it and the plan it forwards in turn."""

    address: str
    name: str
    plan: pb.RelayPlan

    def subtree(self) -> list[tuple[str, str]]:
        """(address, name) of every replica below this child."""
        return [(n.address, n.name) for n in self.plan.nodes]

    def height(self) -> int:
        """Levels of replicas below this child (0 for a leaf); parents come first in a plan."""
        level: list[int] = []
        for n in self.plan.nodes:
            level.append(1 if n.parent == 0 else level[n.parent - 1] + 1)
        return max(level, default=0)


def plan_from_parents(nodes: Sequence[tuple[str, str, int] | tuple[str, str, int, bytes]]) -> pb.RelayPlan:
    """A RelayPlan from (address, name, parent[, grant]) rows, parent 0 = the receiver, i = row i-1."""
    return pb.RelayPlan(
        nodes=[pb.RelayNode(address=r[0], name=r[1], parent=r[2], grant=r[3] if len(r) > 3 else b"") for r in nodes]
    )


GRANT_CONTEXT = b"rollwire relay grant v1"


def grant_key(admin_token_digest: bytes) -> bytes:
    """The key relay grants are signed and checked with, derived from the sha256 of an admin
    token: the proxy hashes the token it dials replicas with, a replica holds only digests."""
    return hmac.new(admin_token_digest, GRANT_CONTEXT, hashlib.sha256).digest()


def relay_grant(key: bytes, manifest: pb.AdapterManifest, address: str) -> bytes:
    """The proxy's grant to relay this push (name, version, digest) to `address`."""
    message = f"{manifest.name}\0{manifest.version}\0{manifest.sha256}\0{address}".encode()
    return hmac.new(key, message, hashlib.sha256).digest()


def grant_plan(plan: pb.RelayPlan, key: bytes, manifest: pb.AdapterManifest) -> None:
    """Sign every node of `plan` for this push (the proxy, for the plans it sends)."""
    for node in plan.nodes:
        node.grant = relay_grant(key, manifest, node.address)


def unplanned(plan: pb.RelayPlan, keys: Sequence[bytes], manifest: pb.AdapterManifest) -> str | None:
    """The first node whose grant no key verifies (its address), or None when all verify."""
    for node in plan.nodes:
        if not any(hmac.compare_digest(node.grant, relay_grant(k, manifest, node.address)) for k in keys):
            return node.address
    return None


def split_plan(plan: pb.RelayPlan, *, max_children: int, max_nodes: int = MAX_PLAN_NODES) -> list[Child]:
    """The receiver's children, each with its own subtree re-indexed; INVALID_ARGUMENT for a
    plan that is too large, names a parent after its child, repeats an address, gives a
    bad address, or gives the receiver more than `max_children` children. One pass."""
    nodes = plan.nodes
    if len(nodes) > max_nodes:
        raise InvalidArgument(
            f"the relay plan has {len(nodes)} replicas; at most {max_nodes}", reason=Reason.BAD_RELAY_PLAN
        )
    owner: list[int] = []  # for node i: the index of the direct child whose subtree holds it
    rows: dict[int, list[tuple[str, str, int, bytes]]] = {}
    position: list[int] = []  # node i's 1-based index inside its owner's plan (0 for the owner itself)
    seen: set[str] = set()
    for i, node in enumerate(nodes):
        if not ADDRESS_RE.fullmatch(node.address) or not 0 < int(node.address.rsplit(":", 1)[1]) < 65536:
            raise InvalidArgument(
                f"relay plan node {i} has address {clip(node.address)}; use HOST:PORT", reason=Reason.BAD_RELAY_PLAN
            )
        if node.address in seen:
            raise InvalidArgument(f"relay plan names {node.address} twice", reason=Reason.BAD_RELAY_PLAN)
        seen.add(node.address)
        if len(node.name) > 256:
            raise InvalidArgument(f"relay plan node {i} has a name over 256 characters", reason=Reason.BAD_RELAY_PLAN)
        if node.parent > i:
            raise InvalidArgument(
                f"relay plan node {i} names parent {node.parent}, which does not come before it",
                reason=Reason.BAD_RELAY_PLAN,
            )
        if node.parent == 0:
            owner.append(i)
            position.append(0)
            rows[i] = []
            if len(rows) > max_children:
                raise InvalidArgument(
                    f"the relay plan gives this replica more than {max_children} children (relay.max_children); "
                    "plan a smaller fan-out",
                    reason=Reason.BAD_RELAY_PLAN,
                )
            continue
        parent = node.parent - 1
        top = owner[parent]
        owner.append(top)
        rows[top].append((node.address, node.name, position[parent], node.grant))
        position.append(len(rows[top]))
    return [Child(nodes[i].address, nodes[i].name, plan_from_parents(rows[i])) for i in rows]


# -- writing ---------------------------------------------------------------------------------
def opening(
    manifest: pb.AdapterManifest,
    *,
    relay: pb.RelayPlan | None = None,
    stage_only: bool = False,
    stripe: pb.Stripe | None = None,
) -> pb.PushAdapterRequest:
    """The first message of a push."""
    message = pb.PushAdapterRequest(manifest=manifest, stage_only=stage_only)
    if relay is not None and relay.nodes:
        message.relay.CopyFrom(relay)
    if stripe is not None:
        message.stripe.CopyFrom(stripe)
    return message


def chunks(payload: bytes | bytearray | memoryview, chunk_bytes: int = MAX_CHUNK) -> Iterator[bytes]:
    """The payload in pieces of at most `chunk_bytes` (1..MAX_CHUNK)."""
    if not 1 <= chunk_bytes <= MAX_CHUNK:
        raise ValueError(f"chunk_bytes must be between 1 and {MAX_CHUNK}, got {chunk_bytes}")
    view = memoryview(payload)
    for start in range(0, len(view), chunk_bytes):
        yield bytes(view[start : start + chunk_bytes])


def messages(
    manifest: pb.AdapterManifest,
    payload: bytes | bytearray | memoryview,
    chunk_bytes: int = MAX_CHUNK,
    *,
    relay: pb.RelayPlan | None = None,
    stage_only: bool = False,
) -> Iterator[pb.PushAdapterRequest]:
    """A whole push: the opening message, then the payload in chunks."""
    yield opening(manifest, relay=relay, stage_only=stage_only)
    for piece in chunks(payload, chunk_bytes):
        yield pb.PushAdapterRequest(chunk=piece)


def stripe_messages(
    manifest: pb.AdapterManifest,
    payload: bytes | bytearray | memoryview,
    stripe: pb.Stripe,
    *,
    relay: pb.RelayPlan | None = None,
) -> Iterator[pb.PushAdapterRequest]:
    """One stripe's stream of a striped push (always `stage_only`): its opening, then the
    payload's chunks that `stripe_layout` gives it."""
    yield opening(manifest, relay=relay, stage_only=True, stripe=stripe)
    view = memoryview(payload)
    for j, size in stripe_layout(len(view), stripe):
        start = j * stripe.chunk_bytes
        yield pb.PushAdapterRequest(chunk=bytes(view[start : start + size]))


# -- reading ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Opening:
    """The first message of a push, read but not judged: the caller checks the manifest
    against its own base model, limits and versions before it asks for the chunks."""

    manifest: pb.AdapterManifest
    relay: pb.RelayPlan
    stage_only: bool
    stripe: pb.Stripe | None = None


async def idle_bounded(messages: AsyncIterable, idle_s: float, holder: str):
    """The messages of a push stream; DEADLINE_EXCEEDED when none arrives for `idle_s`, so a
    stalled sender cannot hold an upload slot (and its buffered bytes) until its deadline."""
    it = aiter(messages)
    while True:
        try:
            async with asyncio.timeout(idle_s):  # not wait_for: see rollwire.common.waits
                msg = await anext(it)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise DeadlineExceeded(
                f"the push sent no message for {idle_s:g} s, so this {holder} cancelled it; send the chunks without "
                "pausing and push again",
                reason=Reason.PUSH_IDLE,
            ) from None
        yield msg


@dataclass(eq=False)
class PushReader:
    """Reads one PushAdapter stream: `open()`, then `chunks()`, then `finish()` (the payload
    as one `bytes`) or `finish_chunks()` (the chunks as received, nothing copied: for a
    holder that only forwards them); `close()` on every exit. The payload is hashed, copied
    into one buffer (unless `keep_chunks`) and written to `store` (if given) by one worker
    thread, at most `backlog_bytes` behind the network."""

    messages: AsyncIterable[pb.PushAdapterRequest]
    idle_s: float
    holder: str
    keep_chunks: bool = False
    backlog_bytes: int = 8 * MAX_CHUNK
    received: int = 0
    manifest: pb.AdapterManifest | None = None
    _stream: AsyncIterator | None = field(default=None, repr=False)
    _sink: _Sink | None = field(default=None, repr=False)

    async def open(self) -> Opening:
        self._stream = aiter(idle_bounded(self.messages, self.idle_s, self.holder))
        try:
            first = await anext(self._stream)
        except StopAsyncIteration:
            raise InvalidArgument(
                "the upload was empty: send a manifest, then the chunks", reason=Reason.NO_MANIFEST
            ) from None
        if first.WhichOneof("part") != "manifest":
            raise InvalidArgument("the first PushAdapter message must be the manifest", reason=Reason.NO_MANIFEST)
        self.manifest = first.manifest
        return Opening(
            first.manifest, first.relay, first.stage_only, first.stripe if first.HasField("stripe") else None
        )

    async def chunks(self, store: Path | None = None, inspector: Inspector | None = None) -> AsyncIterator[bytes]:
        """Each chunk as received, after its checks; call once the manifest was accepted.
        `store`: a file the payload is written to as well; `inspector`: more checks of the
        payload's content, run on the worker as it arrives (a failure ends the upload)."""
        assert self._stream is not None and self.manifest is not None, "open() first"
        declared = self.manifest.byte_length
        self._sink = _Sink(declared, store, self.backlog_bytes, inspector, self.keep_chunks)
        async for msg in self._stream:
            chunk = _chunk_of(msg)
            self.received += len(chunk)
            if self.received > declared:
                raise InvalidArgument(
                    f"received more than the {declared} bytes the manifest declared", reason=Reason.LENGTH_MISMATCH
                )
            await self._sink.absorb(chunk)
            self._sink.raise_inspection()
            yield chunk

    async def stripe_chunks(self, stripe: pb.Stripe) -> AsyncIterator[tuple[int, bytes]]:
        """(j, chunk j of the payload) for each chunk of a striped stream (`check_stripe`
        first), each of exactly the size its place in the payload gives it; the stream must
        end after the stripe's last chunk. Nothing is hashed or kept here: an `Assembly`
        puts the stripes back together."""
        assert self._stream is not None and self.manifest is not None, "open() first"
        expected = iter(stripe_layout(self.manifest.byte_length, stripe))
        async for msg in self._stream:
            chunk = _chunk_of(msg)
            j, size = next(expected, (-1, 0))
            if len(chunk) != size:
                raise InvalidArgument(
                    f"stripe {stripe.index} of {stripe.count} carries chunk {j} of {size} bytes, got {len(chunk)}"
                    if j >= 0
                    else f"stripe {stripe.index} of {stripe.count} sent more chunks than the payload has for it",
                    reason=Reason.BAD_STRIPE,
                )
            self.received += size
            yield j, chunk
        if (j := next(expected, (-1, 0))[0]) >= 0:
            raise InvalidArgument(
                f"stripe {stripe.index} of {stripe.count} ended before chunk {j}; the upload was truncated",
                reason=Reason.LENGTH_MISMATCH,
            )

    async def finish(self, sync: bool = True) -> bytes:
        """The payload once the stream ended: length, digest, then the inspector's checks;
        the store is flushed (and fsynced unless `sync` is false: then the caller syncs it
        before relying on it, e.g. off the critical path)."""
        assert not self.keep_chunks, "finish_chunks() keeps the chunks"
        payload = await self._finish(sync)
        assert isinstance(payload, bytes)
        return payload

    async def finish_chunks(self, sync: bool = True) -> list[bytes]:
        """As `finish`, but the payload is the list of chunks as received."""
        assert self.keep_chunks, "finish() buffers the payload"
        payload = await self._finish(sync)
        assert isinstance(payload, list)
        return payload

    async def _finish(self, sync: bool) -> bytes | list[bytes]:
        assert self.manifest is not None and self._sink is not None, "chunks() first"
        m = self.manifest
        if self.received != m.byte_length:
            raise InvalidArgument(
                f"upload ended after {self.received} of the {m.byte_length} bytes the manifest declared; "
                "the upload was truncated or the manifest is wrong",
                reason=Reason.LENGTH_MISMATCH,
            )
        return await _verdict(m, self._sink, sync)

    def close(self) -> None:
        """Stop the worker and close the store; idempotent, safe on every exit."""
        if self._sink is not None:
            self._sink.close()


def _chunk_of(msg: pb.PushAdapterRequest) -> bytes:
    """The chunk of a message after the first, which must carry a chunk and nothing else."""
    if msg.WhichOneof("part") != "chunk":
        raise InvalidArgument("only the first PushAdapter message may be a manifest", reason=Reason.SECOND_MANIFEST)
    if msg.HasField("relay") or msg.stage_only or msg.HasField("stripe"):
        raise InvalidArgument(
            "relay, stage_only and stripe may be set on the first PushAdapter message only",
            reason=Reason.MISPLACED_FIELD,
        )
    chunk = msg.chunk
    if len(chunk) > MAX_CHUNK:
        raise InvalidArgument(
            f"a chunk of {len(chunk)} bytes exceeds the 1 MiB ({MAX_CHUNK} bytes) chunk limit; "
            "split the payload into smaller chunks",
            reason=Reason.CHUNK_TOO_LARGE,
        )
    return chunk


async def _verdict(m: pb.AdapterManifest, sink: _Sink, sync: bool) -> bytes | list[bytes]:
    """The payload of a sink that took every byte: digest, then the inspector's checks."""
    digest, payload, refusal = await sink.finish(sync)
    if digest != m.sha256:
        raise InvalidArgument(
            f"payload sha256 is {digest} but the manifest declared {m.sha256}; the bytes were corrupted or the "
            "manifest is stale",
            reason=Reason.DIGEST_MISMATCH,
        )
    if refusal is not None:
        raise refusal
    return payload


# -- stripes ---------------------------------------------------------------------------------
MAX_STRIPES = 8
"""Most stripes one push may be dealt over."""
MIN_STRIPE_CHUNK = 64 << 10
"""Smallest chunk a striped push may be cut into (a receiver keeps one entry per chunk)."""


def stripe_layout(byte_length: int, stripe: pb.Stripe) -> list[tuple[int, int]]:
    """(j, size) of every chunk of the payload that `stripe` carries, in order."""
    c = stripe.chunk_bytes
    n = max(1, math.ceil(byte_length / c))
    return [(j, c if j < n - 1 else byte_length - c * (n - 1)) for j in range(stripe.index, n, stripe.count)]


def check_stripe(stripe: pb.Stripe, *, stage_only: bool) -> None:
    """INVALID_ARGUMENT (BAD_STRIPE) unless the stripe's fields are in range; a striped push
    is always `stage_only` (its verdict comes from whichever stream completes the payload,
    so only a commit that follows every verdict may serve it)."""
    if not 2 <= stripe.count <= MAX_STRIPES or stripe.index >= stripe.count:
        raise InvalidArgument(
            f"stripe {stripe.index} of {stripe.count}: a push has 2 to {MAX_STRIPES} stripes, numbered from 0",
            reason=Reason.BAD_STRIPE,
        )
    if not MIN_STRIPE_CHUNK <= stripe.chunk_bytes <= MAX_CHUNK:
        raise InvalidArgument(
            f"stripe chunk_bytes is {stripe.chunk_bytes}; use {MIN_STRIPE_CHUNK} to {MAX_CHUNK}",
            reason=Reason.BAD_STRIPE,
        )
    if not stage_only:
        raise InvalidArgument("a striped push must be stage_only", reason=Reason.BAD_STRIPE)


class Assembly:
    """The stripes of one version, from their separate streams, put back in payload order.

    Invariants: chunks are fed to one sink (sha256, buffer, inspector) strictly in payload
    order, whatever order the stripes deliver them in; chunks that arrive ahead wait here
    (at most the payload's size in all, which the receiver admitted); each stripe joins
    once; the stream whose end completes the payload (every stripe `ended`) takes the
    verdict, exactly once. An assembly that never completes is dropped by its owner."""

    def __init__(self, manifest: pb.AdapterManifest, stripe: pb.Stripe, inspector: Inspector | None) -> None:
        self.manifest = manifest
        self.count, self.chunk_bytes = stripe.count, stripe.chunk_bytes
        self.sink = _Sink(manifest.byte_length, None, 8 * MAX_CHUNK, inspector, keep_chunks=False)
        self.ahead: dict[int, bytes] = {}
        self.next = 0
        self.feeding = asyncio.Lock()
        self.joined: set[int] = set()
        self.ended: set[int] = set()
        self.closed = False
        self.completed = False
        self.error: RollwireError | None = None
        """Why its bytes were refused, if they were: every stripe's stream refuses with it."""
        self.open_streams = 0
        """Streams of its stripes open now (its owner's count: it bounds the assembly's life)."""
        self.orphaned_at = 0.0
        """When its last open stream ended (monotonic)."""
        self.linger: asyncio.TimerHandle | None = None
        """Its owner's timer that drops it while no stream is open."""

    def join(self, stripe: pb.Stripe) -> None:
        """FAILED_PRECONDITION (STRIPE_CONFLICT) for a stripe of another cut, or one that joined already."""
        if (stripe.count, stripe.chunk_bytes) != (self.count, self.chunk_bytes) or stripe.index in self.joined:
            raise FailedPrecondition(
                f"stripe {stripe.index} of {stripe.count} ({stripe.chunk_bytes}-byte chunks) does not fit the stripes "
                f"of this version being received ({sorted(self.joined)} of {self.count}, {self.chunk_bytes}-byte "
                "chunks); push again once it ended",
                reason=Reason.STRIPE_CONFLICT,
            )
        self.joined.add(stripe.index)

    async def add(self, j: int, chunk: bytes) -> None:
        """Chunk j: fed to the sink now if it is next in payload order, else when it is. Raises
        the first failed check of the bytes; does nothing once the assembly failed."""
        if self.closed:
            return
        self.ahead[j] = chunk
        async with self.feeding:
            while not self.closed and self.next in self.ahead:
                await self.sink.absorb(self.ahead.pop(self.next))
                self.next += 1
            try:
                self.sink.raise_inspection()
            except RollwireError as err:
                self.fail(err)
                raise

    def end(self, index: int) -> bool:
        """Stripe `index` delivered all its chunks; True for the one call that completes the
        payload (then `finish`). Raises the bytes' refusal if they were refused; False while a
        stripe is missing, or for good once a stripe's stream broke."""
        self.ended.add(index)
        if self.error is not None:
            raise self.error
        if self.closed or len(self.ended) < self.count:
            return False
        self.completed = True
        return True

    async def finish(self) -> bytes:
        """The verified payload (length, digest, tensors), after `end` returned True."""
        assert self.completed
        async with self.feeding:
            pass  # every chunk was fed: each add returned after its feed ran
        payload = await _verdict(self.manifest, self.sink, sync=False)
        assert isinstance(payload, bytes)
        return payload

    def fail(self, err: RollwireError | None) -> None:
        """The version cannot complete here: `err` when its bytes failed a check, None when a
        stripe's stream broke or the assembly was given up. Frees what it held."""
        if self.error is None and err is not None and not self.completed:
            self.error = err
        self.closed = True
        self.ahead.clear()
        if not self.completed:
            self.sink.close()


class Inspector(Protocol):
    """Checks of a payload's content that can run while it arrives (adapters.PayloadInspector)."""

    error: RollwireError | None
    """The first failure seen so far, if any."""

    def feed(self, chunk: bytes) -> None:
        """The next chunk, in order; called on the reader's worker thread."""

    def finish(self, payload: bytes | list[bytes]) -> None:
        """After the last chunk, with the whole payload (or its chunks); raises the first failure."""


class _Sink:
    """The worker thread of one push: sha256, the in-memory copy, and the optional file.

    The event loop only queues references to received chunks; hashing (which releases the
    GIL) and copying run on the worker, in order. `absorb` waits when the worker is more than
    `backlog_bytes` behind, so memory stays bounded when the disk is slow."""

    def __init__(
        self, size: int, store: Path | None, backlog_bytes: int, inspector: Inspector | None, keep_chunks: bool
    ) -> None:
        self.size, self.backlog, self.inspector = size, backlog_bytes, inspector
        self.digest = hashlib.sha256()
        # BytesIO grows in place and getvalue() hands over its buffer without a copy, so the
        # payload costs its size once, not twice as a list of chunks plus their join would.
        self.buffer: io.BytesIO | None = None if keep_chunks else io.BytesIO()
        self.kept: list[bytes] | None = [] if keep_chunks else None
        self.store = store
        try:
            self.file = store.open("wb") if store is not None else None
        except OSError as exc:
            raise self.store_error(exc) from None
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="push-sink")
        self.pending: list[bytes] = []
        self.pending_bytes = 0
        self.inflight: deque[tuple[asyncio.Future, int]] = deque()
        self.inflight_bytes = 0
        self.closed = False

    async def absorb(self, chunk: bytes) -> None:
        if self.kept is not None:
            self.kept.append(chunk)
        self.pending.append(chunk)
        self.pending_bytes += len(chunk)
        if self.pending_bytes >= _SUBMIT_BYTES:
            self._submit()
        while self.inflight_bytes > self.backlog:
            await self._settle_oldest()

    def _submit(self) -> None:
        if not self.pending:
            return
        batch, size = self.pending, self.pending_bytes
        self.pending, self.pending_bytes = [], 0
        future = asyncio.get_running_loop().run_in_executor(self.pool, self._write, batch)
        self.inflight.append((future, size))
        self.inflight_bytes += size

    async def _settle_oldest(self) -> None:
        future, size = self.inflight[0]
        try:
            await future
        except OSError as exc:
            raise self.store_error(exc) from None
        self.inflight.popleft()
        self.inflight_bytes -= size

    def store_error(self, exc: OSError) -> RollwireError:
        """A failed write of the store: DISK_FULL when its disk is full, else STORE_FAILED."""
        where = f"the upload's file {self.store}" if self.store is not None else "the upload's buffer"
        return storage_error(exc, where)

    def _write(self, batch: list[bytes]) -> None:
        for chunk in batch:
            self.digest.update(chunk)
            if self.buffer is not None:
                self.buffer.write(chunk)
            if self.file is not None:
                self.file.write(chunk)
            if self.inspector is not None:
                self.inspector.feed(chunk)

    def raise_inspection(self) -> None:
        if self.inspector is not None and self.inspector.error is not None:
            raise self.inspector.error

    def _seal(self, sync: bool) -> tuple[str, bytes | list[bytes], RollwireError | None]:
        if self.file is not None:
            self.file.flush()
            if sync:
                os.fsync(self.file.fileno())
            self.file.close()
            self.file = None
        payload: bytes | list[bytes]
        if self.buffer is not None:
            payload, self.buffer = self.buffer.getvalue(), None
        else:
            assert self.kept is not None
            payload, self.kept = self.kept, None
        refusal = None
        if self.inspector is not None:
            try:
                self.inspector.finish(payload)
            except RollwireError as exc:
                refusal = exc
        return self.digest.hexdigest(), payload, refusal

    async def finish(self, sync: bool) -> tuple[str, bytes | list[bytes], RollwireError | None]:
        self._submit()
        while self.inflight:
            await self._settle_oldest()
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, self._seal, sync)
        except OSError as exc:
            raise self.store_error(exc) from None
        finally:
            self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for future, _ in self.inflight:
            future.cancel()
        file, self.file = self.file, None
        if file is not None:
            self.pool.submit(file.close)  # after any write still running: FIFO, one worker
        self.pool.shutdown(wait=False, cancel_futures=False)
        self.buffer = self.kept = None


# -- results of a relayed push ---------------------------------------------------------------
def result(
    address: str,
    name: str,
    code: grpc.StatusCode,
    message: str = "",
    reason: str = "",
    staged: bool = False,
    stripe_pending: bool = False,
) -> pb.ReplicaPushResult:
    """One replica's outcome, as PushAdapterResponse.replicas lists it."""
    return pb.ReplicaPushResult(
        replica=name or address,
        address=address,
        code=code.name,
        message=message,
        reason=reason,
        staged=staged,
        stripe_pending=stripe_pending,
    )


def status_with_results(err: RollwireError, results: Sequence[pb.ReplicaPushResult]) -> grpc.Status:
    """The refusal of a relaying replica, carrying its subtree's outcomes as a
    PushAdapterResponse detail beside the ErrorInfo, so the parent learns them anyway."""
    return to_status(err, pb.PushAdapterResponse(replicas=list(results))) if results else to_status(err)


def results_from_error(exc: grpc.RpcError) -> list[pb.ReplicaPushResult] | None:
    """The subtree outcomes a relaying replica attached to its refusal, if any."""
    reply = status_detail(exc, pb.PushAdapterResponse)
    return list(reply.replicas) if reply is not None else None
