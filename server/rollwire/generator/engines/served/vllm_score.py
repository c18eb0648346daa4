"""Score on a vLLM server: teacher-forced logprobs read from `prompt_logprobs` (vllm_engine.py's Score).

vLLM 0.32 computes a request's prompt logprobs as the raw float32 log-softmax of the prompt's
logits (gpu_model_runner, Sampler.compute_logprobs), whatever `--logprobs-mode` the server runs
with, so they are what score.py promises: temperature 1, untruncated. With `prompt_logprobs: 0`
each prompt position p >= 1 carries one entry keyed by the id of the token at p (as a string in
JSON), its logprob given the tokens before it; position 0 has none. A Score's sequences go as
one request of several token-id prompts (one choice each, `index` = the prompt's place).

vLLM 0.32's CPU LoRA path (punica_cpu.add_lora_logits) indexes the prompt positions' hidden
states with the batch's per-request LoRA indices: a step that holds a prompt-logprobs request
beside any other request of a LoRA kills the engine core (an einsum shape error, every request
fails, measured here 2026-12-07). So a Score is one sequence per request, one request at a time,
and never beside this replica's own generation: `ScoreGate` lets a Score in only once no
segment streams, and holds new segments back while it runs (a writer-preferring lock; a proof
waits at most for the groups running when it came).

Invariants: a continuation token's logprob is read by its own id from its own position, never
from a neighbour's; a reply with a position or an id missing fails the Score (INTERNAL
ENGINE_FAILED, naming what vLLM left out) instead of scoring with a gap; no Score request is
in vLLM while a generation request of this replica is.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from rollwire.common.errors import Internal
from rollwire.common.reasons import Reason
from rollwire.generator.types import ScoreJob, SequenceScore


class ScoreGate:
    """Segments share the server; a Score has it alone (the module docstring says why)."""

    def __init__(self) -> None:
        self._cv = asyncio.Condition()
        self._segments = 0
        self._scoring = self._waiting = 0

    @contextlib.asynccontextmanager
    async def segment(self) -> AsyncIterator[None]:
        async with self._cv:
            await self._cv.wait_for(lambda: not self._scoring and not self._waiting)
            self._segments += 1
        try:
            yield
        finally:
            async with self._cv:
                self._segments -= 1
                self._cv.notify_all()

    @contextlib.asynccontextmanager
    async def score(self) -> AsyncIterator[None]:
        async with self._cv:
            self._waiting += 1
            try:
                await self._cv.wait_for(lambda: not self._segments and not self._scoring)
            finally:
                self._waiting -= 1
            self._scoring = 1
        try:
            yield
        finally:
            async with self._cv:
                self._scoring = 0
                self._cv.notify_all()


def score_body(prompt: tuple[int, ...], continuation: tuple[int, ...], model: str, rid: str) -> dict:
    """The /v1/completions body that scores one sequence: it as the prompt, one token generated."""
    return {
        "model": model,
        "prompt": [*prompt, *continuation],
        "max_tokens": 1,
        "temperature": 0.0,
        "prompt_logprobs": 0,
        "stream": False,
        "request_id": rid,
    }


def read_score(job: ScoreJob, i: int, reply: dict) -> SequenceScore:
    """Sequence `i`'s continuation logprobs from vLLM's reply (the module's invariants)."""
    prompt, continuation = job.sequences[i]
    choices = [c for c in reply.get("choices") or [] if isinstance(c, dict)]
    entries = choices[0].get("prompt_logprobs") if choices else None
    if not isinstance(entries, list) or len(entries) < len(prompt) + len(continuation):
        raise _missing(job, f"the prompt logprobs of sequence {i}")
    logprobs = []
    for k, token in enumerate(continuation):
        entry = entries[len(prompt) + k]
        value = entry.get(str(token)) if isinstance(entry, dict) else None
        if not isinstance(value, dict) or not isinstance(value.get("logprob"), (int, float)):
            raise _missing(job, f"token {token}'s logprob at position {len(prompt) + k} of sequence {i}")
        logprobs.append(float(value["logprob"]))
    return SequenceScore(logprobs)


def _missing(job: ScoreJob, what: str) -> Internal:
    return Internal(
        f"vLLM's reply to Score {job.request_id} lacks {what}; retry it, on another replica",
        reason=Reason.ENGINE_FAILED,
    )
