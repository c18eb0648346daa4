"""Putting a striped push back together: the stripes of one version, from their separate streams.

Invariants:
- a striped push is always `stage_only` and its stripe fields are in range (`check_stripe`);
- the stripes of a version land in one buffer of the payload's admitted size, allocated once,
  off the event loop: chunk j at j x chunk_bytes, written once, by one thread (a bulk stripe's
  reading thread by `recv_into`, the assembly's worker for a chunk that came on the stream):
  stripes cover disjoint regions, so no byte is copied twice and no lock is held over bytes;
- the payload is hashed and checked once, strictly in payload order, as its prefix fills
  (`push.frontier.Frontier`), whatever order the stripes deliver in, and whichever path each
  stripe came by;
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
import mmap
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from rollwire.common.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, RollwireError
from rollwire.common.manifest import TENANT_SEPARATOR, identity
from rollwire.common.reasons import Reason
from rollwire.common.writer import MAX_CHUNK, MAX_STRIPES, MIN_STRIPE_CHUNK
from rollwire.push.buffers import BufferPool, Payload, payload_buffer
from rollwire.push.digests import Digests
from rollwire.push.frontier import Frontier
from rollwire.push.sink import Inspector
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
    """The stripes of one version, from their separate streams, put back into one buffer.

    Invariants: the payload's one buffer (`payload`: from the bulk listener's pool, else mapped;
    off the event loop) holds chunk j at j x chunk_bytes; a stripe over the bulk path is read
    straight into its chunks' places by its stream's reading thread (`landed`), a stripe over
    gRPC chunks copies each chunk there on the assembly's worker (`add`), so stripes of both
    paths meet in the same buffer and each byte is written once, by one thread, into a region
    no other stripe writes. The `Frontier` hashes and inspects the landed prefix in payload
    order, whatever order the stripes deliver in. Each stripe joins once; the stream whose end
    completes the payload (every stripe `ended`) takes the verdict, exactly once. An assembly
    that never completes is dropped by its owner."""

    def __init__(
        self,
        manifest: pb.AdapterManifest,
        stripe: pb.Stripe,
        inspector: Inspector | None,
        pool: BufferPool | None = None,
        backlog_bytes: int = 8 * MAX_CHUNK,
    ) -> None:
        self.manifest, self.pool, self.backlog = manifest, pool, backlog_bytes
        self.count, self.chunk_bytes = stripe.count, stripe.chunk_bytes
        self.frontier = Frontier(manifest.byte_length, stripe.chunk_bytes, Digests(manifest), inspector)
        self.buffer: bytearray | mmap.mmap | None = None
        self._allocating = threading.Lock()
        self._worker: ThreadPoolExecutor | None = None
        self._copies: deque[tuple[asyncio.Future, int]] = deque()
        self._copy_bytes = 0
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

    def payload(self) -> bytearray | mmap.mmap:
        """The payload's buffer, allocated by the first caller (a thread: never the event loop)."""
        with self._allocating:
            if self.buffer is None:
                size = self.manifest.byte_length
                self.buffer = self.pool.take(size) if self.pool is not None else payload_buffer(size)
            return self.buffer

    async def ready(self) -> bytearray | mmap.mmap:
        """The payload's buffer, allocated off the event loop: a bulk stripe's, before its offer."""
        return await asyncio.to_thread(self.payload)

    def landed(self, j: int, buffer: bytearray | mmap.mmap) -> None:
        """On the thread that wrote chunk j into `buffer` (the payload's): hash and inspect up to
        the new frontier. Raises the bytes' refusal (and fails the assembly with it)."""
        try:
            self.frontier.landed(j, buffer)
        except RollwireError as err:
            self.error = self.error or err
            raise

    async def add(self, j: int, chunk: bytes) -> None:
        """Chunk j of a stripe over gRPC chunks: copied into its place on the assembly's worker
        (at most `backlog` bytes behind). Raises the first failed check of the bytes; does
        nothing once the assembly failed."""
        if self.closed:
            return
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stripe-copy")
        copy = asyncio.get_running_loop().run_in_executor(self._worker, self._copy, j, chunk)
        self._copies.append((copy, len(chunk)))
        self._copy_bytes += len(chunk)
        while self._copy_bytes > self.backlog:
            await self._settle_one()
        if self.frontier.error is not None:
            self.fail(self.frontier.error)
            raise self.frontier.error

    def _copy(self, j: int, chunk: bytes) -> None:
        if self.closed:
            return
        buffer = self.payload()
        at = j * self.chunk_bytes
        memoryview(buffer)[at : at + len(chunk)] = chunk  # its size was checked against its place
        try:
            self.landed(j, buffer)
        except RollwireError:
            pass  # recorded (`error`): the stream's next add, or the verdict, raises it

    async def _settle_one(self) -> None:
        """Wait for the oldest copy (several streams may wait for the same one)."""
        copy, size = self._copies[0]
        await copy
        if self._copies and self._copies[0][0] is copy:  # another stream's wait may have taken it off
            self._copies.popleft()
            self._copy_bytes -= size

    async def settle(self) -> None:
        """Every chunk handed to `add` so far is in its place (and past the frontier's look)."""
        while self._copies:
            await self._settle_one()

    def end(self, index: int) -> bool:
        """Stripe `index` delivered all its chunks; True for the one call that completes the
        payload (then `finish`). Raises the bytes' refusal if they were refused; False while a
        stripe is missing, or for good once a stripe's stream broke."""
        self.ended.add(index)
        if (error := self.error or self.frontier.error) is not None:
            raise error
        if self.closed or len(self.ended) < self.count:
            return False
        self.completed = True
        return True

    async def finish(self) -> Payload:
        """The verified payload (length, digest, tensors), after `end` returned True: every
        stripe's chunks landed and the frontier hashed them all (the digest is checked before
        the inspector's refusal, as `sink.verdict` does)."""
        assert self.completed
        await self.settle()
        if self._worker is not None:
            self._worker.shutdown(wait=False)
        frontier, buffer = self.frontier, self.buffer
        if not frontier.whole or buffer is None:
            raise InvalidArgument(
                f"the stripes ended with chunk {frontier.next} of {frontier.count} not received; push again",
                reason=Reason.LENGTH_MISMATCH,
            )
        refusal = None
        if frontier.inspector is not None:
            try:
                await asyncio.to_thread(frontier.inspector.finish, buffer)
            except RollwireError as exc:
                refusal = exc
        frontier.digests.check()
        if refusal is not None:
            raise refusal
        self.buffer = None  # the payload's holder keeps it from here
        return buffer

    def fail(self, err: RollwireError | None) -> None:
        """The version cannot complete here: `err` when its bytes failed a check, None when a
        stripe's stream broke or the assembly was given up. Frees what it held (a stripe's
        thread still reading holds the buffer until it stops)."""
        if self.error is None and err is not None and not self.completed:
            self.error = err
        self.closed = True
        if not self.completed:
            self.frontier.stop()
            self.buffer = None
            if self._worker is not None:
                self._worker.shutdown(wait=False)  # a copy still queued finds it closed and does nothing


class PushSlots:
    """The push slots of one receiver and the striped versions it is assembling, by (name,
    version, `identity`: its sha256, or its BLAKE3 while the sha256 is left to the commit). `admit` takes a slot for a plain push (`free` gives it back); a striped
    version's first stream takes one with `admit` and hands it to its assembly (`assemble`),
    which holds it until `release`. Streams `attach` to the assembly while open and `detach`
    when they end.

    A tenant's pushes (its adapters' qualified names, `TENANT:NAME`) hold at most `share` of
    the slots (all but one, when there are two or more), so a tenant whose pushes stall cannot
    take every slot from another tenant's or the fleet's own (which are bounded by `limit` alone)."""

    def __init__(self, limit: int, linger_s: float, on_count: Callable[[int], None], holder: str = "replica") -> None:
        self.limit, self.linger_s, self.on_count, self.holder = limit, linger_s, on_count, holder
        self.active = 0
        """Slots taken now (at most `limit`, but for a moment while one is handed over)."""
        self.share = max(1, limit - 1)
        """Slots one owner's pushes may hold at once."""
        self.by_owner: Counter[str] = Counter()
        self.assemblies: dict[tuple[str, int, str], Assembly] = {}

    def admit(self, name: str = "") -> None:
        """Take a slot for a push of adapter `name`: a free one within its owner's share, else
        the slot of an assembly none of whose stripes' streams is open, else RESOURCE_EXHAUSTED
        (TOO_MANY_PUSHES)."""
        owner = slot_owner(name)
        if owner and self.by_owner[owner] >= self.share and not self._reclaim(owner):
            raise ResourceExhausted(
                f"this {self.holder} is receiving {self.by_owner[owner]} pushes of tenant {owner}'s adapters already "
                f"(at most {self.share} of its {self.limit} push slots go to one tenant's); retry when one ends",
                reason=Reason.TOO_MANY_PUSHES,
                retry_after_s=1.0,
            )
        if self.active >= self.limit and not self._reclaim():
            raise ResourceExhausted(
                f"this {self.holder} is receiving {self.active} pushes already (limit {self.limit}); retry shortly",
                reason=Reason.TOO_MANY_PUSHES,
                retry_after_s=1.0,
            )
        self._count(1, owner)

    def free(self, name: str = "") -> None:
        """Give back the slot of a plain push of adapter `name`."""
        self._count(-1, slot_owner(name))

    def _count(self, change: int, owner: str) -> None:
        self.active += change
        self.by_owner[owner] += change
        if self.by_owner[owner] <= 0:
            del self.by_owner[owner]
        self.on_count(self.active)

    def assembly_of(self, manifest: pb.AdapterManifest) -> Assembly | None:
        """The assembly of this exact version (name, version, digest), if one is under way."""
        return self.assemblies.get((manifest.name, manifest.version, identity(manifest)))

    def assemble(
        self, manifest: pb.AdapterManifest, stripe: pb.Stripe, inspector: Inspector | None, pool: BufferPool | None
    ) -> Assembly:
        """A new assembly for a striped version (its buffer from `pool` when given: the bulk
        listener's); it holds the slot its first stream took (`admit`)
        until it completes or fails, or until no stream of its stripes has been open for
        `linger_s` (a stripe that never came), or until a push needs the slot while none is open."""
        assembly = Assembly(manifest, stripe, inspector, pool)
        self.assemblies[(manifest.name, manifest.version, identity(manifest))] = assembly
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

    def _reclaim(self, owner: str | None = None) -> bool:
        """Free the slot of the assembly (of `owner`'s, when given) that has waited longest with
        no stream open; False if none."""
        waiting = [
            a
            for a in self.assemblies.values()
            if not a.open_streams and not a.completed and owner in (None, slot_owner(a.manifest.name))
        ]
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
            del self.assemblies[(m.name, m.version, identity(m))]
            self._count(-1, slot_owner(m.name))
            if not assembly.completed:
                assembly.fail(None)


def slot_owner(name: str) -> str:
    """Whose push slots a push of adapter `name` takes: its tenant (`TENANT:NAME`), or "" (the fleet's)."""
    tenant, sep, _ = name.partition(TENANT_SEPARATOR)
    return tenant if sep else ""
