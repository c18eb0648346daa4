"""Forwarding a push down a relay tree: one PushAdapter stream per child, fed as bytes arrive.

The proxy (root of the tree) and every relaying replica use this, so a chunk crosses each
hop the moment it arrived there (cut-through), whatever the depth.

Invariants:
- each child has its own stream and a queue of at most `queue_chunks` chunks; a chunk is
  queued by reference (the `bytes` received, never copied here);
- a full queue is normal backpressure (the child's link is the slowest) and the sender waits
  for room; a child that took no chunk for `stall_s` while its siblings kept taking theirs
  (or one with no sibling) is stalled: cut off (its call cancelled) and reported, so it never
  holds up the sender's upstream or its siblings for longer. When every child is as slow (the
  sender's own uplink is thin), none is stalled, and the push deadline bounds the wait; a
  child whose call ended early is skipped at once;
- every child call has a deadline (what is left of the sender's own, less a margin for the
  reply), so `results()` always returns, with one outcome for every replica of the subtree:
  a child's own verdict, what it reported of its subtree, or "not reached" and why;
- once a child took the sender's last chunk, it has `settle_s` per level of its subtree, plus
  one, to verify, stage and answer; one that did not is cut off like a stalled one. A node waits
  longer than any node below it, so a replica that hangs after taking every byte is cut off
  by its own parent, and costs its ancestors neither their subtrees nor the push deadline;
- a child's outcome passes on only what a rollwire replica decided (its status carries a
  rollwire ErrorInfo): anything else (a refused connection, a TLS failure, a service that is
  no replica) is reported as UNAVAILABLE with one fixed sentence, its text only in this
  node's log, so a push's reply says nothing about what listens at an address.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

import grpc

from rollwire.common import bulk as wire
from rollwire.common.errors import ERROR_DOMAIN, Unavailable, from_rpc_error, status_detail
from rollwire.common.reasons import Reason
from rollwire.common.writer import opening
from rollwire.push.bulk import BulkDial, BulkLane
from rollwire.push.pipe import Pipe
from rollwire.push.plan import Child
from rollwire.push.results import result, results_from_error
from rollwire.runtime.logs import get_logger
from rollwire.v1 import generator_pb2 as pb
from rollwire.v1 import generator_pb2_grpc

log = get_logger(__name__)
REPLY_MARGIN = 0.1
"""Share of the time left that a child's deadline leaves for its reply to travel back (at most 1 s)."""


REFUSAL_GRACE_S = 1.0
"""How long a sender whose bulk connection broke waits for the child's answer: a child that refused
the bytes (and so closed it) reports its own verdict; one that does not answer is cut off."""

FAIR_TURNS = 4
"""Chunks each sibling takes while a child takes none, before that child counts as stalled
(at most the queue's length: that is all a sibling can take while the sender waits). A chunk
counts as taken when gRPC pulls it into the child's stream buffers, not when it crosses the
link, so this rule is only as sharp as FAIR_TURNS chunks are large against a stream's
flow-control window (4 MiB of 1 MiB chunks; 256 KiB of 64 KiB ones can vanish into a window
while a busy receiver reads nothing for a moment), and stall_s must stay above scheduling
hiccups (seconds by default)."""


def child_timeout(remaining: float) -> float:
    """A child's deadline from the sender's remaining time: a little less, so the sender
    still hears and reports a child that ran out of time before its own deadline passes."""
    return max(0.05, remaining - min(1.0, REPLY_MARGIN * remaining))


class ChildLink:
    """The stream to one child: its opening message, then whatever the sender queues."""

    def __init__(
        self,
        child: Child,
        manifest: pb.AdapterManifest,
        stage_only: bool,
        stub: generator_pb2_grpc.GeneratorServiceStub,
        metadata: Sequence[tuple[str, str]],
        timeout: float,
        queue_chunks: int,
        turns: list[int],
        stripe: pb.Stripe | None = None,
        bulk: tuple[BulkDial, float] | None = None,
    ) -> None:
        self.child, self.pipe = child, Pipe(queue_chunks)
        self.stripe, self.bulk = stripe, bulk
        """`bulk`: how to reach the child's bulk endpoint and each send's deadline (None: gRPC chunks only)."""
        self.path = "grpc"
        """How its bytes went: "bulk" once its bulk connection is up."""
        self.turns = turns
        """Chunks taken by all the sender's children together, one shared counter."""
        self.mark = 0
        """`turns` when this child last took a chunk."""
        self.height = child.height()
        granted = pb.RelayNode(address=child.address, name=child.name, grant=child.grant)
        self.first = opening(
            manifest, relay=child.plan, stage_only=stage_only, stripe=stripe, granted=granted, bulk=bulk is not None
        )
        self.manifest = self.first.manifest
        """The manifest as this child was opened with (a copy): its bulk token's, whatever the
        sender's own copy learns later (a sha256 its verdict names: push.digests)."""
        self.cut_reason, self.cut_code, self.cut_tag = "", grpc.StatusCode.OK, ""
        self.sent = 0
        self.took_at = time.monotonic()
        """When the child last took a chunk (gRPC pulled it from the queue); before its first,
        when its stream was opened."""
        self.pace_s = 0.0
        """The longest time it took between two chunks so far (its first chunk, which waits for
        the connection, aside): how slow its link has legitimately been."""
        self.drained_at: float | None = None
        """When the child took the sender's last chunk: its settle time counts from here."""
        self.done_at: float | None = None
        """When its call ended (it answered, failed or was cut): its bytes are off the link."""
        self.loop = asyncio.get_running_loop()
        self.lane: BulkLane | None = None
        self.lane_ready = asyncio.Event()
        """Set once its bulk lane is up, or known not to be (`lane` None: gRPC chunks)."""
        self.direct = False
        """Its bytes come from the receiver's reading thread (`feed`), not through `pipe`."""
        self.failed = False
        """Its bulk connection broke."""
        self.call = stub.PushAdapter(self._requests(), timeout=timeout, metadata=tuple(metadata))
        self.task = asyncio.ensure_future(self._wait())

    async def _requests(self):
        yield self.first
        lane = None
        if self.bulk is not None:
            dial, send_timeout = self.bulk
            lane = await BulkLane.open(dial, self.call, self.child.address, self.manifest, self.stripe, send_timeout)
            self.path = "grpc" if lane is None else "bulk"
        self.lane = lane
        self.lane_ready.set()
        try:
            while (chunk := await self.pipe.pop()) is not None:
                self._took(len(chunk))
                if lane is None:
                    yield pb.PushAdapterRequest(chunk=chunk if isinstance(chunk, bytes) else bytes(chunk))
                    continue
                try:
                    await lane.send(chunk)  # pyright: ignore[reportArgumentType]  # sendall takes a view too
                except OSError as exc:
                    await self._lane_failed(exc)
                    return
        except BaseException:
            if lane is not None:
                lane.abort()
            raise
        if lane is not None:
            lane.abort() if self.failed else lane.close()
        self.drained_at = time.monotonic()

    def _took(self, size: int) -> None:
        """The child took `size` more bytes now (the stall rule's bookkeeping)."""
        now = time.monotonic()
        if self.sent:
            self.pace_s = max(self.pace_s, now - self.took_at)
        self.sent += size
        self.took_at = now
        self.turns[0] += 1
        self.mark = self.turns[0]

    def feed(self, piece: bytes | memoryview) -> None:
        """On the receiver's reading thread, for a `direct` child: send it `piece` over its bulk
        lane (sendall of the very view received, with the lane's deadline). A failed send fails
        this child only: its own verdict if it refused the bytes, else it is cut off."""
        if self.failed or self.cut_reason or self.task.done() or self.lane is None:
            return
        self._took(len(piece))
        try:
            wire.send(self.lane.sock, piece)
        except OSError as exc:
            self.failed = True
            asyncio.run_coroutine_threadsafe(self._lane_failed(exc), self.loop)

    async def _lane_failed(self, exc: OSError) -> None:
        """The child stopped taking bytes: its own refusal (it answers), else a broken hop, cut off."""
        self.failed = True
        await asyncio.wait({self.task}, timeout=REFUSAL_GRACE_S)
        if not self.task.done():  # no verdict of its own: this hop fails, as a stalled one does
            why = f"its bulk connection failed ({type(exc).__name__}: {exc})"[:300]
            self.cut(why, grpc.StatusCode.UNAVAILABLE, Reason.RELAY_STALLED)
        if self.lane is not None:
            self.lane.abort()

    async def _wait(self):
        try:
            return await self.call
        finally:
            self.done_at = time.monotonic()

    @property
    def live(self) -> bool:
        return not self.task.done() and not self.cut_reason

    def end(self) -> None:
        """The sender has no more chunks: the child's stream ends once its queue is drained."""
        self.pipe.close()

    def cut(self, why: str, code: grpc.StatusCode, tag: str) -> None:
        """Cancel the child's call (it stages nothing from a cancelled stream)."""
        if not self.task.done() and not self.cut_reason:
            self.cut_reason, self.cut_code, self.cut_tag = why, code, tag
            self.call.cancel()
        self.pipe.close()

    def outcome(self) -> list[pb.ReplicaPushResult]:
        """This child's verdict and what it reported of its subtree (call after `task` ended)."""
        c = self.child
        if self.cut_reason or self.task.cancelled():
            why = self.cut_reason or "its stream was cancelled"
            own = result(
                c.address,
                c.name,
                self.cut_code if self.cut_reason else grpc.StatusCode.CANCELLED,
                why,
                self.cut_tag or Reason.RELAY_ABORTED,
            )
            return [own, *unreached(c, f"its parent {c.name or c.address} was cut off: {why}")]
        exc = self.task.exception()
        if exc is None:
            reply: pb.PushAdapterResponse = self.task.result()
            own = result(
                c.address, c.name, grpc.StatusCode.OK, staged=reply.staged, stripe_pending=reply.stripe_pending
            )
            reported = {r.address for r in reply.replicas}
            missing = [(a, n) for a, n in c.subtree() if a not in reported]
            return [own, *reply.replicas, *unreached_list(missing, f"{c.name or c.address} did not report it")]
        if isinstance(exc, grpc.RpcError):
            err = from_rpc_error(exc)
            if not _from_rollwire(exc):
                log.warning("relay_child_unreachable", child=c.address, code=err.code.name, error=err.message[:300])
                err = Unavailable(NOT_A_REPLICA)
            own = result(c.address, c.name, err.code, err.message, err.reason)
            reported = results_from_error(exc) or []
            seen = {r.address for r in reported}
            why = f"its parent {c.name or c.address} failed with {err.code.name}: {err.message[:200]}"
            return [own, *reported, *unreached_list([(a, n) for a, n in c.subtree() if a not in seen], why)]
        log.warning("relay_child_unreachable", child=c.address, error=repr(exc)[:300])
        own = result(c.address, c.name, grpc.StatusCode.UNAVAILABLE, NOT_A_REPLICA)
        return [own, *unreached(c, f"its parent {c.name or c.address} could not be reached")]


NOT_A_REPLICA = "could not push to it: no rollwire replica answered there (the relaying node's log says why)"


def _from_rollwire(exc: grpc.RpcError) -> bool:
    """Whether a status was decided by a rollwire server (it carries rollwire's ErrorInfo)."""
    from google.rpc import error_details_pb2

    info = status_detail(exc, error_details_pb2.ErrorInfo)
    return info is not None and info.domain == ERROR_DOMAIN


def unreached(child: Child, why: str) -> list[pb.ReplicaPushResult]:
    return unreached_list(child.subtree(), why)


def unreached_list(nodes: Sequence[tuple[str, str]], why: str) -> list[pb.ReplicaPushResult]:
    return [
        result(a, n, grpc.StatusCode.UNAVAILABLE, f"not reached: {why}", Reason.RELAY_NOT_REACHED) for a, n in nodes
    ]


class Forwarder:
    """Feeds one push to every child of a relay node while the node receives it.

    `stub_for(address)` gives the stub to reach a child; `metadata` travels on every child
    call (the caller's authorization and request id); `deadline` is a time.monotonic()
    instant; `stripe`, when the push is striped, is the stripe every child stream carries.
    Call `send` for each chunk, then `end` (upload complete) or `abort` (failed), then
    `results`."""

    def __init__(
        self,
        children: Sequence[Child],
        manifest: pb.AdapterManifest,
        *,
        stage_only: bool,
        stub_for: Callable[[str], generator_pb2_grpc.GeneratorServiceStub],
        metadata: Sequence[tuple[str, str]],
        deadline: float,
        queue_chunks: int,
        stall_s: float,
        settle_s: float,
        stripe: pb.Stripe | None = None,
        bulk: BulkDial | None = None,
    ) -> None:
        self.stall_s, self.settle_s = stall_s, settle_s
        lane = (
            (bulk, max(stall_s, settle_s)) if bulk is not None else None
        )  # a send's deadline: as long as a child may pause
        self.ended_at: float | None = None
        self.turns = [0]
        self.fair_turns = min(FAIR_TURNS, queue_chunks)  # a sibling can take no more while the sender waits
        timeout = child_timeout(deadline - time.monotonic())
        self.links = [
            ChildLink(
                c, manifest, stage_only, stub_for(c.address), metadata, timeout, queue_chunks, self.turns, stripe, lane
            )
            for c in children
        ]

    def stalled(self, link: ChildLink) -> str:
        """Why `link` counts as stalled now, or "" when it does not. A child that took no chunk
        for `stall_s` is stalled when its siblings that still take chunks each took
        `fair_turns` meanwhile; with no sibling left on the link (none, or every one answered),
        when it took none since it was alone for `stall_s` or twice its own slowest pace so far,
        whichever is longer (a child that was slow beside its siblings, say on a thin link they
        shared, may still drain at that pace once they are done: one chunk of it alone may take
        longer than `stall_s`). Where its siblings are as slow (a
        sender whose own uplink is thin, shared by all its children), it is not stalled: that is
        the link's speed, not the child's fault, and the push deadline still bounds the wait.
        Before its first chunk the child's call is still being set up (a connection to dial, a
        busy replica to accept the stream): that is its answer time, not its link's pace, so it
        is judged against the longer of `stall_s` and `settle_s`."""
        now = time.monotonic()
        if not link.sent:
            waited = now - link.took_at  # since its stream was opened
            limit = max(self.stall_s, self.settle_s)
            return f"it took no chunk in the {waited:.1f} s since its stream was opened" if waited >= limit else ""
        if now - link.took_at < self.stall_s:
            return ""
        others = [o for o in self.links if o is not link and not o.cut_reason]
        taking = [o for o in others if o.drained_at is None and not o.task.done()]
        if taking:
            turns = self.turns[0] - link.mark
            if turns < self.fair_turns * len(taking):
                return ""
            return f"it took no chunk for {now - link.took_at:.1f} s while its siblings took {turns}"
        if any(o.done_at is None for o in others):
            return ""  # a sibling's last bytes may still hold the link: judge once it answered
        alone = now - max([link.took_at, *(o.done_at for o in others if o.done_at is not None)])
        return f"it took no chunk for {alone:.1f} s" if alone >= max(self.stall_s, 2 * link.pace_s) else ""

    async def _put(self, link: ChildLink, chunk: bytes | memoryview) -> None:
        """Queue a chunk once the child has room; cuts the child off if it stalls meanwhile."""
        while link.pipe.full():
            room = asyncio.ensure_future(link.pipe.wait_room())
            done, _ = await asyncio.wait({room, link.task}, timeout=self.stall_s, return_when=asyncio.FIRST_COMPLETED)
            if room in done:
                break
            room.cancel()
            if link.task.done():
                return
            if why := self.stalled(link):
                why = f"{why} (a stalled link or replica), so its sender cut it off"
                link.cut(why, grpc.StatusCode.DEADLINE_EXCEEDED, Reason.RELAY_STALLED)
                return
        link.pipe.push(chunk)

    def _due(self, link: ChildLink) -> tuple[float, str]:
        """When to cut off a child that has not answered, once the sender ended, and why ("" =
        look again then): while it drains its queue, when it is `stalled`; once it took the
        last chunk, `settle_s` per level of its subtree (plus one) after that. Counting from
        the child's own last chunk, not the sender's, keeps a child behind a slow shared link
        from being cut off for the time its queue takes to cross it."""
        now = time.monotonic()
        if link.drained_at is None:
            if why := self.stalled(link):
                return now, f"{why} (a stalled link or replica)"
            return max(link.took_at + self.stall_s, now + min(self.stall_s, 1.0)), ""
        settle = self.settle_s * (link.height + 1)
        return link.drained_at + settle, f"it did not answer within {settle:g} s of its last chunk"

    async def send(self, chunk: bytes | memoryview) -> None:
        """Queue `chunk` for every live child; waits only while some child's queue is full, and
        cuts off a child that is `stalled` meanwhile."""
        slow = []
        for link in self.links:
            if not link.live or link.direct:
                continue
            if link.pipe.full():
                slow.append(link)
            else:
                link.pipe.push(chunk)
        if slow:
            await asyncio.gather(*(self._put(link, chunk) for link in slow))

    async def send_last(self, piece: bytes | memoryview) -> None:
        """`piece` to every live child, the `direct` ones too (their lanes' sends off the event
        loop): for a holder that kept the payload's last piece back until it had checked the
        whole (the proxy's gate), after its reading thread fed them everything before it."""
        direct = [link for link in self.links if link.direct and link.live]
        if direct:
            await asyncio.to_thread(lambda: [link.feed(piece) for link in direct])
        await self.send(piece)

    async def direct(self, timeout: float) -> list[ChildLink]:
        """The children whose bulk lanes are up (each decided within `timeout`), handed to the
        caller's reading thread: from now on it sends them every piece (`ChildLink.feed`) and
        `send` queues chunks only for the others (gRPC chunks, the fallback)."""
        loop, pending = asyncio.get_running_loop(), [link for link in self.links if link.bulk is not None]
        end = loop.time() + timeout
        while (pending := [p for p in pending if not p.lane_ready.is_set() and not p.task.done()]) and (
            left := end - loop.time()
        ) > 0:
            waits = {asyncio.ensure_future(p.lane_ready.wait()) for p in pending}
            await asyncio.wait(waits | {p.task for p in pending}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            for w in waits:
                w.cancel()
        out = [link for link in self.links if link.lane_ready.is_set() and link.lane is not None and link.live]
        for link in out:
            link.direct = True
        return out

    def end(self) -> None:
        self.ended_at = time.monotonic()
        for link in self.links:
            link.end()

    def abort(self, why: str) -> None:
        """The sender's upload failed: cancel every child stream (a partial push stages nothing)."""
        for link in self.links:
            link.cut(why, grpc.StatusCode.CANCELLED, Reason.RELAY_ABORTED)

    async def results(self) -> list[pb.ReplicaPushResult]:
        """One outcome per replica of the subtree, once every child call ended: by itself, at
        its settle time after `end` (cut off), or at its deadline."""
        pending = {link for link in self.links if not link.task.done()}
        while pending:
            now = time.monotonic()
            if self.ended_at is not None:
                due = {link: self._due(link) for link in pending if not link.cut_reason}
                for link, (at, why) in due.items():
                    if why and now >= at:
                        link.cut(why, grpc.StatusCode.DEADLINE_EXCEEDED, Reason.RELAY_STALLED)
                waiting = [at for link, (at, _) in due.items() if not link.cut_reason]
                wait = max(0.0, min(waiting) - now) if waiting else None  # the cut end with their cancellation
            else:
                wait = None  # aborted or never ended: every call ends by its cancellation or deadline
            await asyncio.wait({link.task for link in pending}, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
            pending = {link for link in pending if not link.task.done()}
        out: list[pb.ReplicaPushResult] = []
        for link in self.links:
            out += link.outcome()
        return out
