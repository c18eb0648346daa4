"""Single-sample requests for one prompt, served as one group: one prefill, one placement.

TRL's rollout worker (and many OpenAI-style callers) sends a GRPO group as n concurrent
requests with n = 1 each, the same prompt, adapter and sampling settings, and a random seed
each. The replica would prefill the prompt n times; the proxy would route, lease and relay n
groups. The coalescer gathers such requests that arrive within `routing.coalesce_window_ms`
of the first and runs them as one group of n samples on one replica.

Invariants:
- only requests with n = 1, no session, no follow, no resume and the same everything else (prompt,
  adapter selector, sampling settings, group key) are merged; the key is the request with
  its request id and seed cleared, so nothing a request asked for differs in the group;
- a seeded request draws exactly the tokens it draws alone: the merged group carries one
  seed per sample (`sampling.sample_seeds`; sample i draws as sample 0 of a request with that
  seed would). Seeded requests are merged only while every routable replica's engine honours
  per-sample seeds (transformers, sglang, scripted); unseeded ones always;
- no request waits longer than the window for its group to start: the window opens with the
  group's first request, and a group that reaches `coalesce_max_n` starts at once;
- each request keeps its own answer (its sample, re-indexed 0, its request id in `started`),
  its own deadline (DEADLINE_EXCEEDED for it alone), its own cancellation (a caller that goes
  away ends only its own stream; the group is cancelled when the last one went), and its own
  per-client limits (each was admitted before it got here); a failure of the group is the
  answer of each request in it.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from rollwire.common.errors import DeadlineExceeded
from rollwire.common.reasons import Reason
from rollwire.runtime.logs import get_logger
from rollwire.v1 import generator_pb2 as pb

log = get_logger(__name__)
SEEDING_ENGINES = frozenset({"transformers", "sglang", "scripted"})
"""Engines that draw each sample of a group from its own seed (sampling.sample_seeds)."""
_END = object()

Run = Callable[[pb.GenerateRequest, float], AsyncIterator[pb.GenerateResponse]]
"""Runs one group until `deadline` (failover.GroupRun, under the first request's client)."""


@dataclass(eq=False)
class _Member:
    request: pb.GenerateRequest
    deadline: float
    run: Run
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    gone: bool = False


@dataclass(eq=False)
class _Batch:
    members: list[_Member] = field(default_factory=list)
    task: asyncio.Task | None = None
    timer: asyncio.TimerHandle | None = None


class Coalescer:
    """Gathers mergeable requests per key for a short window; see the module docstring."""

    def __init__(
        self,
        window_s: float,
        max_n: Callable[[], int],
        engines: Callable[[], set[str]],
        on_merged: Callable[[int], None] = lambda n: None,
    ) -> None:
        """`max_n`: the most requests one group may take now; `engines`: those of the routable
        replicas; `on_merged(k)`: k requests were merged into one group."""
        self.window_s, self.max_n, self.engines, self.on_merged = window_s, max_n, engines, on_merged
        self._open: dict[bytes, _Batch] = {}

    def accepts(self, request: pb.GenerateRequest) -> bool:
        """A request this coalescer may merge (n = 1, no session, no follow, no resume), when it is on."""
        if self.window_s <= 0 or request.n != 1 or request.HasField("session") or request.adapter.follow:
            return False
        if request.resume:  # a caller's continuation of its own sample: its tokens are its own
            return False
        return not request.sampling.HasField("seed") or self.engines() <= SEEDING_ENGINES

    async def events(
        self, request: pb.GenerateRequest, deadline: float, run: Run
    ) -> AsyncIterator[pb.GenerateResponse]:
        """This request's stream: its own sample of the group it joined, as if run alone."""
        member = _Member(request, deadline, run)
        batch = self._join(member)
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DeadlineExceeded(
                        "the request's deadline passed before its sample finished", reason=Reason.DEADLINE
                    )
                try:
                    async with asyncio.timeout(left):
                        item = await member.queue.get()
                except TimeoutError:
                    continue
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            member.gone = True
            if batch.task is not None and all(m.gone for m in batch.members):
                batch.task.cancel()

    def _join(self, member: _Member) -> _Batch:
        key = _key(member.request)
        batch = self._open.get(key)
        if batch is None:
            batch = self._open[key] = _Batch()
            batch.timer = asyncio.get_running_loop().call_later(self.window_s, self._start, key, batch)
        batch.members.append(member)
        if len(batch.members) >= max(1, self.max_n()):
            self._start(key, batch)
        return batch

    def _start(self, key: bytes, batch: _Batch) -> None:
        if self._open.get(key) is batch:
            del self._open[key]
        if batch.timer is not None:
            batch.timer.cancel()
        if batch.task is None:
            batch.task = asyncio.get_running_loop().create_task(self._run(batch))

    async def _run(self, batch: _Batch) -> None:
        """Run the group and hand each member its own messages; every member gets an end."""
        members = batch.members
        first = members[0]
        request = first.request if len(members) == 1 else self._merged(members)
        deadline = max(m.deadline for m in members)
        try:
            async with contextlib.aclosing(first.run(request, deadline)) as stream:  # pyright: ignore[reportArgumentType]  # an async generator has aclose
                async for message in stream:
                    for i, m in enumerate(members):
                        part = message if len(members) == 1 else _part(message, i, m.request.request_id)
                        if part is not None and not m.gone:
                            m.queue.put_nowait(part)
            for m in members:
                m.queue.put_nowait(_END)
        except asyncio.CancelledError:
            for m in members:
                m.queue.put_nowait(_END)
            raise
        except BaseException as exc:  # the group's failure is each request's answer
            for m in members:
                m.queue.put_nowait(exc)

    def _merged(self, members: list[_Member]) -> pb.GenerateRequest:
        merged = pb.GenerateRequest()
        merged.CopyFrom(members[0].request)
        merged.n = len(members)
        merged.request_id = f"{members[0].request.request_id}+{len(members) - 1}"
        seeded = [m.request.sampling.HasField("seed") for m in members]
        merged.sampling.ClearField("seed")
        if any(seeded):  # an unseeded member draws from a fresh seed, as it would alone
            merged.sampling.sample_seeds.extend(
                m.request.sampling.seed if s else secrets.randbits(63) for m, s in zip(members, seeded, strict=True)
            )
        self.on_merged(len(members))
        # debug, not info: a merge is one line per request on a hot path (a flood of identical
        # single-sample requests would be a flood of lines); rollwire_proxy_coalesced_requests_total counts them
        log.debug("requests_coalesced", requests=len(members), request_id=merged.request_id)
        return merged


def _key(request: pb.GenerateRequest) -> bytes:
    """What must be equal for two requests to share a group: all but the id and the seed."""
    same = pb.GenerateRequest()
    same.CopyFrom(request)
    same.ClearField("request_id")
    same.sampling.ClearField("seed")
    return same.SerializeToString(deterministic=True)


def _part(message: pb.GenerateResponse, index: int, request_id: str) -> pb.GenerateResponse | None:
    """Sample `index`'s share of a message of the merged group, as its own request would get it
    (sample index 0); None when the message holds nothing of it."""
    out = pb.GenerateResponse()
    if message.HasField("started"):
        out.started.CopyFrom(message.started)
        out.started.request_id = request_id or message.started.request_id
    if message.HasField("restarted"):
        out.restarted.CopyFrom(message.restarted)
    for chunk in message.tokens:
        if chunk.sample_index == index:
            out.tokens.add().CopyFrom(chunk)
            out.tokens[-1].sample_index = 0
    for done in message.finished:
        if done.sample_index == index:
            out.finished.add().CopyFrom(done)
            out.finished[-1].sample_index = 0
    return out if out.ByteSize() else None
