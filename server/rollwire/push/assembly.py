"""Putting a striped push back together: the stripes of one version, from their separate streams.

Invariants:
- a striped push is always `stage_only` and its stripe fields are in range (`check_stripe`);
- chunks are fed to one `Sink` (sha256, buffer, inspector) strictly in payload order,
  whatever order the stripes deliver them in, so the payload is hashed and checked once, as
  for any push; chunks that arrive ahead wait (at most the payload's size, which the
  receiver admitted);
- each stripe joins once; the stream whose end completes the payload takes the verdict,
  exactly once; bytes that fail a check fail every stripe's stream;
- a receiver's push slots (`PushSlots`) bound the pushes it takes in at once: one per plain
  push stream, one per striped version being assembled (its stripes' streams share it). A
  slot belongs to open streams: an assembly none of whose streams is open keeps its slot for
  `linger_s` at most, and gives it up at once to a push that finds none free. A caller's
  deadline never extends it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from rollwire.common.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, RollwireError
from rollwire.common.reasons import Reason
from rollwire.common.writer import MAX_CHUNK, MAX_STRIPES, MIN_STRIPE_CHUNK
from rollwire.push.buffers import Payload
from rollwire.push.digests import Digests
from rollwire.push.sink import Inspector, Sink, verdict
from rollwire.runtime.logs import get_logger
from rollwire.v1 import generator_pb2 as pb

log = get_logger(__name__)


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
        self.sink = Sink(
            manifest.byte_length, None, 8 * MAX_CHUNK, inspector, False, digests=Digests(manifest), flat=True
        )
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

    async def finish(self) -> Payload:
        """The verified payload (length, digest, tensors), after `end` returned True."""
        assert self.completed
        async with self.feeding:
            pass  # every chunk was fed: each add returned after its feed ran
        payload = await verdict(self.manifest, self.sink, sync=False)
        assert not isinstance(payload, list)
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


class PushSlots:
    """The push slots of one receiver and the striped versions it is assembling, by (name,
    version, sha256). `admit` takes a slot for a plain push (`free` gives it back); a striped
    version's first stream takes one with `admit` and hands it to its assembly (`assemble`),
    which holds it until `release`. Streams `attach` to the assembly while open and `detach`
    when they end."""

    def __init__(self, limit: int, linger_s: float, on_count: Callable[[int], None], holder: str = "replica") -> None:
        self.limit, self.linger_s, self.on_count, self.holder = limit, linger_s, on_count, holder
        self.active = 0
        """Slots taken now (at most `limit`, but for a moment while one is handed over)."""
        self.assemblies: dict[tuple[str, int, str], Assembly] = {}

    def admit(self) -> None:
        """Take a slot: a free one, else the slot of an assembly none of whose stripes'
        streams is open, else RESOURCE_EXHAUSTED (TOO_MANY_PUSHES)."""
        if self.active >= self.limit and not self._reclaim():
            raise ResourceExhausted(
                f"this {self.holder} is receiving {self.active} pushes already (limit {self.limit}); retry shortly",
                reason=Reason.TOO_MANY_PUSHES,
                retry_after_s=1.0,
            )
        self._count(1)

    def free(self) -> None:
        """Give back the slot of a plain push."""
        self._count(-1)

    def _count(self, change: int) -> None:
        self.active += change
        self.on_count(self.active)

    def assembly_of(self, manifest: pb.AdapterManifest) -> Assembly | None:
        """The assembly of this exact version (name, version, digest), if one is under way."""
        return self.assemblies.get((manifest.name, manifest.version, manifest.sha256))

    def assemble(self, manifest: pb.AdapterManifest, stripe: pb.Stripe, inspector: Inspector | None) -> Assembly:
        """A new assembly for a striped version; it holds the slot its first stream took (`admit`)
        until it completes or fails, or until no stream of its stripes has been open for
        `linger_s` (a stripe that never came), or until a push needs the slot while none is open."""
        assembly = Assembly(manifest, stripe, inspector)
        self.assemblies[(manifest.name, manifest.version, manifest.sha256)] = assembly
        return assembly

    def attach(self, assembly: Assembly) -> None:
        """A stream of one of its stripes is open: the assembly keeps its slot while it is."""
        assembly.open_streams += 1
        if assembly.linger is not None:
            assembly.linger.cancel()
            assembly.linger = None

    def detach(self, assembly: Assembly) -> None:
        """A stream of its stripes ended; with none left open, the assembly waits for a missing
        stripe's stream `linger_s` at most."""
        assembly.open_streams -= 1
        if assembly.open_streams or assembly.completed or not self._registered(assembly):
            return
        assembly.orphaned_at = time.monotonic()
        assembly.linger = asyncio.get_running_loop().call_later(
            self.linger_s, self._drop, assembly, f"no stream of its missing stripes came within {self.linger_s:g}s"
        )

    def _reclaim(self) -> bool:
        """Free the slot of the assembly that has waited longest with no stream open; False if none."""
        waiting = [a for a in self.assemblies.values() if not a.open_streams and not a.completed]
        if not waiting:
            return False
        self._drop(min(waiting, key=lambda a: a.orphaned_at), "another push needed its slot")
        return True

    def _drop(self, assembly: Assembly, why: str) -> None:
        """Give up an incomplete assembly with no stream open; its stripes must be sent again."""
        if assembly.open_streams or not self._registered(assembly):
            return
        log.warning(
            "stripe_assembly_dropped",
            adapter=assembly.manifest.name,
            version=assembly.manifest.version,
            stripes=sorted(assembly.ended),
            of=assembly.count,
            why=why,
        )
        self.release(assembly)

    def _registered(self, assembly: Assembly) -> bool:
        return self.assembly_of(assembly.manifest) is assembly

    def release(self, assembly: Assembly | None) -> None:
        """Forget an assembly and free its slot (idempotent). Streams still holding it go on
        forwarding their stripe; they answer `stripe_pending` (or its failure)."""
        if assembly is None:
            return
        if assembly.linger is not None:
            assembly.linger.cancel()
            assembly.linger = None
        if self._registered(assembly):
            m = assembly.manifest
            del self.assemblies[(m.name, m.version, m.sha256)]
            self._count(-1)
            if not assembly.completed:
                assembly.fail(None)
