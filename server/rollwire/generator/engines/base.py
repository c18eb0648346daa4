"""The engine interface: what a generator replica needs from a model backend.

An engine owns the weights and the batching; the servicer owns the wire, validation
(convert.py), adapter bookkeeping (adapters.py) and metrics. Adding a backend is one module, in
embedded/ or served/, and one line in the registry (engines/__init__.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from rollwire.common.manifest import Manifest
from rollwire.generator.types import Event, GroupRequest, ScoreJob, SequenceScore
from rollwire.push.buffers import Payload


@dataclass(frozen=True)
class EngineStats:
    """Load as the engine sees it: groups generating now and groups waiting."""

    running: int
    queued: int


class GroupSlots:
    """At most `size` groups generate at once; the others wait here, counted as queued.
    For engines whose backend takes whole groups (scripted, sglang); the transformers engine
    batches rows itself."""

    def __init__(self, size: int) -> None:
        self._free = asyncio.Semaphore(size)
        self.running = self.queued = 0

    @contextlib.asynccontextmanager
    async def held(self) -> AsyncIterator[None]:
        """Wait for a slot, hold it for the body, give it back however the body ends."""
        self.queued += 1
        try:
            await self._free.acquire()
        finally:
            self.queued -= 1
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
            self._free.release()

    def stats(self) -> EngineStats:
        return EngineStats(running=self.running, queued=self.queued)


class Engine(Protocol):
    """A model backend. `generate` yields events; closing the iterator cancels the group."""

    name: str
    vocab_size: int
    max_context: int  # prompt + generated tokens the model can attend to

    async def start(self) -> None:
        """Load the model and get ready to serve; raises with a clear sentence on failure."""

    async def close(self) -> None:
        """Stop generating and free resources."""

    def tokenize(self, text: str) -> list[int]:
        """Prompt text to token ids, as the model's tokenizer does it."""
        ...

    def check(self, group: GroupRequest) -> None:
        """Refuse, with a RollwireError, a group this engine can never serve (too big for its KV
        budget, kept tokens it cannot report). The servicer calls it before it admits the
        request or begins a session turn, so such a caller gets a status and no stream that
        starts and then fails; `generate` calls it too, for callers that use an engine directly."""

    def generate(self, group: GroupRequest) -> AsyncIterator[list[Event]]:
        """Generate `group.n` samples, yielding the events ready together; each sample ends
        with one SampleDone. Closing the iterator cancels the group and frees its rows."""
        ...

    async def load_adapter(self, handle: str, manifest: Manifest, payload: Payload) -> None:
        """Load a checked LoRA payload under a fresh handle."""

    async def unload_adapter(self, handle: str) -> None:
        """Free a handle no request uses any more."""

    def stats(self) -> EngineStats:
        """Current load."""
        ...


@runtime_checkable
class Scorer(Protocol):
    """An engine that scores (Score): teacher-forced logprobs of given sequences under one version.
    Engines without it refuse Score with UNIMPLEMENTED (the servicer decides, score.py)."""

    def check_score(self, job: ScoreJob) -> None:
        """Refuse, with a RollwireError, a job this engine can never run (a sequence over its
        memory budget); called before the job takes an adapter lease or any slot."""

    async def score(self, job: ScoreJob) -> list[SequenceScore]:
        """The job's scores, in its sequences' order; the forward passes run off the event loop."""
        ...
