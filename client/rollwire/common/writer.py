"""Writing a PushAdapter stream: what every sender (the SDK, the proxy, a relaying replica) sends.

Part of the client-facing contract (with `rollwire.common.manifest`): needs no torch and no
server code. Receiving, assembling, checking and forwarding a push live in `rollwire.push`.

Invariants:
- a push stream is one opening message (the manifest, and optionally a relay plan, the
  `stage_only` flag and a stripe), then chunks of at most MAX_CHUNK bytes;
- a striped push (`pb.Stripe`) is S streams per receiver, 2 <= S <= MAX_STRIPES, each
  carrying the chunks j = index mod S of the payload cut at exactly `chunk_bytes`
  (MIN_STRIPE_CHUNK to MAX_CHUNK; `stripe_layout`), always `stage_only`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from rollwire.v1 import generator_pb2 as pb

MAX_CHUNK = 1 << 20
"""Largest payload chunk of a PushAdapter stream (the contract's limit, 1 MiB)."""
MAX_STRIPES = 8
"""Most stripes one push may be dealt over."""
MIN_STRIPE_CHUNK = 64 << 10
"""Smallest chunk a striped push may be cut into (a receiver keeps one entry per chunk)."""


def stripe_layout(byte_length: int, stripe: pb.Stripe) -> list[tuple[int, int]]:
    """(j, size) of every chunk of the payload that `stripe` carries, in order."""
    c = stripe.chunk_bytes
    n = max(1, math.ceil(byte_length / c))
    return [(j, c if j < n - 1 else byte_length - c * (n - 1)) for j in range(stripe.index, n, stripe.count)]


def opening(
    manifest: pb.AdapterManifest,
    *,
    relay: pb.RelayPlan | None = None,
    stage_only: bool = False,
    stripe: pb.Stripe | None = None,
    granted: pb.RelayNode | None = None,
    bulk: bool = False,
) -> pb.PushAdapterRequest:
    """The first message of a push. `granted`: the receiver's own node of a relay plan (set by
    whoever dials it inside a relay tree), which a replica with auth on needs from a relay token;
    `bulk`: the sender can send the bytes over the receiver's bulk endpoint (common.bulk)."""
    message = pb.PushAdapterRequest(manifest=manifest, stage_only=stage_only, bulk=bulk)
    if relay is not None and relay.nodes:
        message.relay.CopyFrom(relay)
    if stripe is not None:
        message.stripe.CopyFrom(stripe)
    if granted is not None and granted.grant:
        message.granted.CopyFrom(granted)
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
    granted: pb.RelayNode | None = None,
) -> Iterator[pb.PushAdapterRequest]:
    """A whole push: the opening message, then the payload in chunks."""
    yield opening(manifest, relay=relay, stage_only=stage_only, granted=granted)
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
