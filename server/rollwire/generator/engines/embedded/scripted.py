"""The scripted engine: a benchmark engine that emits tokens at a set rate, with no model.

It exists so that benchmarks of the proxy, the wire and adapter pushes measure rollwire and
not a model's forward pass: every sample of a group gets `tokens_per_s` tokens per second,
the n samples advancing together (one event list per step, as a batched engine yields
them). Token ids are a deterministic function of (seed, sample, position), every logprob
is the same constant, samples never stop early (finish reason "length"), a resumed sample
(GroupRequest.resume) goes on from its position (so a continuation is exact), and adapter
load/unload is bookkeeping only: the payload was fully checked by the servicer and is
dropped here; a Score gives every token `logprob`. It needs only the model folder's config.json (vocab_size,
max_position_embeddings); never use it to serve real rollouts.

Invariants: a group's k-th token is due at start + k / tokens_per_s; a consumer that falls
behind gets every due token in one event list instead of a slower clock; at most
`max_concurrent_groups` groups generate at once, the rest wait in FIFO order.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

from rollwire.common.errors import FailedPrecondition
from rollwire.common.manifest import Manifest
from rollwire.generator.engines.base import EngineStats, GroupSlots
from rollwire.generator.types import Event, GroupRequest, SampleDone, ScoreJob, SequenceScore, TokenDelta
from rollwire.push.buffers import Payload

_PRINTABLE = 95  # token id t decodes to chr(32 + t % 95): deterministic, printable text


class ScriptedEngine:
    """Tokens at a fixed rate per sample; see the module docstring."""

    name = "scripted"
    resumes_samples = True
    """Continues samples (GroupRequest.resume): a token is a function of its position, so exactly."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        tokens_per_s: float = 100.0,
        logprob: float = -1.0,
        max_concurrent_groups: int = 256,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.tokens_per_s, self.logprob = tokens_per_s, logprob
        self.vocab_size, self.max_context = 0, 0
        self.adapters: dict[str, int] = {}  # handle -> version: what a real engine would hold
        self._slots = GroupSlots(max_concurrent_groups)

    async def start(self) -> None:
        path = self.model_dir / "config.json"
        if not path.is_file():
            raise FailedPrecondition(
                f"{self.model_dir} has no config.json; the scripted engine reads vocab_size from it"
            )
        config = json.loads(path.read_text())
        self.vocab_size = int(config.get("vocab_size") or 32000)
        self.max_context = int(config.get("max_position_embeddings") or 1 << 30)

    async def close(self) -> None:
        self.adapters.clear()

    def tokenize(self, text: str) -> list[int]:
        return [b % self.vocab_size for b in text.encode()]

    def stats(self) -> EngineStats:
        return self._slots.stats()

    def token(self, seed: int, sample: int, position: int) -> int:
        """The deterministic token id of `sample` at `position` for a group seeded `seed`."""
        return (seed * 1_000_003 + sample * 7_919 + position * 31) % self.vocab_size

    def check(self, group: GroupRequest) -> None:
        """Any group is served: the scripted engine has no KV cache to fill."""

    async def generate(self, group: GroupRequest) -> AsyncIterator[list[Event]]:
        async with self._slots.held():
            async for events in self._steps(group):
                yield events

    @staticmethod
    def _seed_of(group: GroupRequest, seed: int, index: int) -> tuple[int, int]:
        """(seed, sample) sample `index` draws from: its own seed as sample 0 when a proxy merged
        single-sample requests (sampling.sample_seeds), else the group's."""
        own = group.sampling.sample_seeds
        return (own[index], 0) if own else (seed, index)

    async def _steps(self, group: GroupRequest) -> AsyncIterator[list[Event]]:
        """The samples advance together, one step a token; a resumed sample (GroupRequest.resume)
        goes on from its position, so its tokens are those it would have had unsplit."""
        total, seed = group.sampling.max_new_tokens, group.sampling.seed or 0
        prompt_tokens, version = len(group.prompt_ids), group.adapter.version
        have = {i: len(group.resume.get(i, ())) for i in group.indices()}
        longest = total - min(have.values())
        start, sent = time.monotonic(), 0
        while sent < longest:
            due = self._due(start, sent, longest)
            if due <= sent:
                await asyncio.sleep(start + sent / self.tokens_per_s - time.monotonic())
                continue
            events: list[Event] = []
            ended: list[Event] = []
            for i, h in have.items():
                first, last = min(total, h + sent), min(total, h + due)
                if first >= last:
                    continue
                ids = [self.token(*self._seed_of(group, seed, i), p) for p in range(first, last)]
                text = "".join(chr(32 + t % _PRINTABLE) for t in ids)
                events.append(TokenDelta(i, ids, [self.logprob] * len(ids), text, version))
                if last == total:
                    ended.append(SampleDone(i, "length", prompt_tokens, total))
            sent = due
            yield events + ended
            if self.tokens_per_s <= 0:
                await asyncio.sleep(0)  # unthrottled: still one step per event-loop turn

    def _due(self, start: float, sent: int, total: int) -> int:
        """Tokens per sample due by now: token k is due at start + k / tokens_per_s."""
        if self.tokens_per_s <= 0:
            return sent + 1
        return min(total, int((time.monotonic() - start) * self.tokens_per_s) + 1)

    def check_score(self, job: ScoreJob) -> None:
        """Any job is scored: there is no model to run out of memory."""

    async def score(self, job: ScoreJob) -> list[SequenceScore]:
        """Every continuation token at `logprob` (what its samples report), whatever the version:
        a Score (and a version's proof, generator/proof.py) costs the wire and the checks only."""
        await asyncio.sleep(0)
        return [SequenceScore([self.logprob] * len(c), [], []) for _, c in job.sequences]

    async def load_adapter(self, handle: str, manifest: Manifest, payload: Payload) -> None:
        self.adapters[handle] = manifest.version

    async def unload_adapter(self, handle: str) -> None:
        self.adapters.pop(handle, None)
