"""Following the newest adapter version on an engine server, by continuation (sglang, vllm).

Neither vLLM nor SGLang can switch a running request to another LoRA adapter: the adapter
is fixed when the request is admitted. So a following group (GroupRequest.follow) runs as
a chain of *segments*: the first is the group's ordinary request under the version current
at its start; when the servicer moves the group onto a newer version (it assigns
`group.adapter`), the engine stops every unfinished sample at a token boundary and goes on
with one new request per sample whose prompt is the group's prompt followed by the tokens
that sample already has, under the new adapter, with `max_new_tokens` less what it has, the
same sampling parameters and a derived seed (`continuation_seed`).

The price is a prefill of prompt + generated tokens per switch (the server's prefix cache
may still hold the prompt's KV under the old adapter, but a LoRA changes the keys and
values, so the servers key their prefix caches by adapter and re-prefill all of it). That
KV is the new version's own view of the prefix, so a continued token's logprob is exactly a
teacher-forced forward pass of the new version over prompt + every earlier token; unlike
the transformers engine (and PipelineRL), no KV computed by the old version is kept.

Invariants:
- every token forwarded belongs to exactly one segment, whose adapter version it carries
  (TokenDelta.version), and a segment never mixes versions; a sample's versions only rise;
- a segment forwards at least the chunk that revealed the switch, so every segment makes
  progress however often versions land; tokens the server produced after the last chunk
  forwarded are never read (the request is closed and aborted), never counted;
- a sample ends exactly once, with the reason it would have had unsplit: a length that the
  tokens already reached, an EOS already sampled or a stop string already spelled ends it
  without a new request, and a stop string that spans the seam (begun before it, completed
  after it, which the server cannot see since it matches only its own output) ends it at
  the token that completes it;
- the text of each sample comes from one TextStream over all its segments, so text deltas
  are the same whether or not it was split.

A resumed group (GroupRequest.resume: a proxy continuing a group whose replica failed) is
the same chain begun mid-way: each sample it lists starts as if a switch had just happened
after its tokens so far (its TextStream spelled with them, the seam at their end), so it is
continued by one request of prompt + those tokens under the group's version, and the samples
it does not list are not run. Like a follow switch, that is the same version and
distribution, not the same tokens: the server draws from its own seeded generator.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

from rollwire.generator.detokenize import TextStream
from rollwire.generator.sampling import sample_seed
from rollwire.generator.types import AdapterSelection, Event, GroupRequest, SampleDone, TokenDelta

Key = tuple[int, ...]
"""The samples one segment generates (their indices in the group)."""


def continuation_seed(seed: int, index: int, have: int) -> int:
    """The seed of sample `index`'s continuation after `have` tokens (stable, documented)."""
    return sample_seed(sample_seed(seed, index), have + 1)


@dataclass
class _Sample:
    index: int
    text: TextStream
    tokens: list[int] = field(default_factory=list)
    out: str = ""  # the text sent so far
    seam: int | None = None  # characters of `out` before the current continuation; None: not continued
    done: bool = False


class FollowRun:
    """The samples of one group across its segments: remaps each segment's events onto the
    group's samples, checks stop strings across seams, and says when to switch."""

    def __init__(self, group: GroupRequest, text_stream: Callable[[], TextStream], eos_ids: frozenset[int]) -> None:
        self.group = group
        self.adapter: AdapterSelection = group.adapter  # the version the running segments use
        self.samples = [_Sample(i, text_stream()) for i in range(group.n)]
        self.eos_ids = eos_ids
        self.switches = 0
        self._stop_len = max((len(s) for s in group.sampling.stop), default=0)
        for s in self.samples:  # a resumed group: its listed samples go on from their tokens, the rest are not run
            have = group.resume.get(s.index)
            if group.resume and have is None:
                s.done = True
            elif have:
                s.tokens, s.out = list(have), s.text.add(have)
                s.seam = len(s.out)

    @property
    def split(self) -> bool:
        """Whether the samples run as continuations (after a switch, or resumed)."""
        return self.switches > 0 or bool(self.group.resume)

    @property
    def complete(self) -> bool:
        return all(s.done for s in self.samples)

    def ended(self, key: Key) -> bool:
        """Whether every sample of a segment ended."""
        return all(self.samples[i].done for i in key)

    def switched(self) -> bool:
        """Whether the servicer moved a following group onto another version since the segments began."""
        return self.group.follow and self.group.adapter.version != self.adapter.version

    def segments(self) -> list[tuple[Key, GroupRequest]]:
        """The requests to run now: the whole group at first, then one continuation per unfinished sample."""
        if not self.split:
            return [(tuple(range(self.group.n)), replace(self.group, adapter=self.adapter))]
        return [((s.index,), self._continuation(s)) for s in self.samples if not s.done]

    def _continuation(self, s: _Sample) -> GroupRequest:
        g, sampling = self.group, self.group.sampling
        if sampling.sample_seeds:  # a proxy's merged single-sample requests: each its own seed, as sample 0
            seed = continuation_seed(sampling.sample_seeds[s.index], 0, len(s.tokens))
        else:
            seed = None if sampling.seed is None else continuation_seed(sampling.seed, s.index, len(s.tokens))
        left = sampling.max_new_tokens - len(s.tokens)
        return GroupRequest(
            f"{g.request_id}/{s.index}",
            [*g.prompt_ids, *s.tokens],
            1,
            replace(sampling, max_new_tokens=left, seed=seed, sample_seeds=()),
            self.adapter,
        )

    def switch(self) -> list[Event]:
        """Move onto the group's current version; end the samples that are already complete."""
        self.adapter = self.group.adapter
        self.switches += 1
        events: list[Event] = []
        for s in self.samples:
            reason = None if s.done else self._ended(s)
            if reason is not None:
                events += self._done(s, reason, None, events)
            elif not s.done:
                s.seam = len(s.out)
        return events

    def _ended(self, s: _Sample) -> str | None:
        sampling = self.group.sampling
        if len(s.tokens) >= sampling.max_new_tokens:
            return "length"
        if s.tokens and not sampling.ignore_eos and s.tokens[-1] in self.eos_ids:
            return "eos"
        if any(stop in s.out for stop in sampling.stop):
            return "stop"
        return None

    def take(self, key: Key, events: list[Event]) -> list[Event]:
        """The group's events for one segment's events (samples renumbered, text from the
        sample's own stream); events of a sample that already ended are dropped."""
        out: list[Event] = []
        for ev in events:
            s = self.samples[key[ev.sample_index]]
            if s.done:
                continue
            if isinstance(ev, SampleDone):
                out += self._done(s, ev.reason, None if self.split else ev.prompt_tokens, out)
            elif s.seam is not None and self._stop_len and len(s.out) - s.seam < self._stop_len:
                out += self._across_seam(s, ev)
            else:
                out.append(self._tokens(s, ev, len(ev.token_ids)))
        return out

    def _tokens(self, s: _Sample, ev: TokenDelta, count: int) -> TokenDelta:
        ids = ev.token_ids[:count]
        text = s.text.add(ids)
        s.tokens += ids
        s.out += text
        return TokenDelta(s.index, ids, ev.logprobs[:count], text, ev.version, ev.kept[:count])

    def _across_seam(self, s: _Sample, ev: TokenDelta) -> list[Event]:
        """Token by token while a stop string could still span the seam."""
        out: list[Event] = []
        for i in range(len(ev.token_ids)):
            one = TokenDelta(
                s.index, ev.token_ids[i : i + 1], ev.logprobs[i : i + 1], "", ev.version, ev.kept[i : i + 1]
            )
            out.append(self._tokens(s, one, 1))
            assert s.seam is not None
            window = s.out[max(0, s.seam - self._stop_len + 1) :]
            if any(stop in window for stop in self.group.sampling.stop):
                out += self._done(s, "stop", None, out)
                break
        return out

    def _done(self, s: _Sample, reason: str, prompt_tokens: int | None, before: list[Event]) -> list[Event]:
        """The sample's end, after `before` (the events going out with it): the rest of its text
        (TextStream.finish, on its last TokenDelta there, else a delta of text alone), then SampleDone."""
        s.done = True
        prompt = len(self.group.prompt_ids) if prompt_tokens is None else prompt_tokens
        end: list[Event] = [SampleDone(s.index, reason, prompt, len(s.tokens))]
        rest = s.text.finish()
        if rest:
            s.out += rest
            last = before[-1] if before else None
            if isinstance(last, TokenDelta) and last.sample_index == s.index:
                last.text += rest
            else:
                end.insert(0, TokenDelta(s.index, [], [], rest, self.adapter.version))
        return end


_END = object()


class Segments:
    """Segment streams, each pumped by its own task (so its HTTP stream is opened, read and
    closed in one task), merged in arrival order through a bounded queue (the server is not
    read ahead of the client by more than `depth` chunks). Leaving the block cancels every
    pump: a segment's own `finally` closes and aborts its request."""

    def __init__(self, open_segment: Callable[[GroupRequest], AsyncIterator[list[Event]]], depth: int = 8) -> None:
        self._open = open_segment
        self._queue: asyncio.Queue = asyncio.Queue(depth)
        self._tasks: dict[Key, asyncio.Task] = {}
        self._stopped: set[Key] = set()
        self._live = 0

    async def __aenter__(self) -> Segments:
        return self

    async def __aexit__(self, *exc) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    def start(self, key: Key, segment: GroupRequest) -> None:
        self._live += 1
        self._tasks[key] = asyncio.get_running_loop().create_task(self._pump(key, segment))

    def stop_where(self, ended: Callable[[Key], bool]) -> None:
        """Stop the segments whose samples all `ended` (on this side, or the server finished them)."""
        for key in list(self._tasks):
            if ended(key):
                self.stop(key)

    def stop(self, key: Key) -> None:
        """Stop one segment (its samples ended on this side); its queued chunks are dropped."""
        task = self._tasks.get(key)
        if task is not None and not task.done() and key not in self._stopped:
            self._stopped.add(key)
            task.cancel()
            self._live -= 1  # a running pump has not queued its end yet, and now never will

    async def _pump(self, key: Key, segment: GroupRequest) -> None:
        try:
            async with contextlib.aclosing(self._open(segment)) as stream:  # pyright: ignore[reportArgumentType]
                async for events in stream:
                    await self._queue.put((key, events))
        except Exception as exc:  # the consumer raises it: the group fails with the segment's status
            await self._queue.put((key, exc))
            return
        await self._queue.put((key, _END))

    async def next(self) -> tuple[Key, list[Event]] | None:
        """The next chunk's events of any running segment; None once every segment ended.
        Raises a segment's error."""
        while self._live > 0:
            key, item = await self._queue.get()
            if key in self._stopped:
                continue
            if item is _END:
                self._live -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                return key, item
        return None
