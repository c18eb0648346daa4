"""The KL term's base-model logprobs, scored by the replicas (train.kl_reference = "replicas").

With a KL term to the base model, the learner would run a second forward pass per step with
its adapter disabled. The replicas hold the base model already, and `Score` returns exactly
those logprobs (teacher-forced, temperature 1, untruncated: config.py allows "replicas" only
for rollouts sampled that way), so the learner asks them instead, before each step.

Invariants:
- a sample gets `ref_logprobs` parallel to its token_ids, or none at all; the trainer uses the
  replicas' values only when every sample of the step has them, and otherwise computes the
  reference itself, so a Score that fails costs a local forward pass, never a wrong or a zero
  reference, and never the run (counted and logged once per failure);
- each request stays within a replica's default Score limits (MAX_SEQUENCES sequences,
  MAX_TOKENS tokens); the requests of one step are sent concurrently.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from rollwire.client import AsyncClient
from rollwire.learner.rollouts.groups import ScoredGroup, ScoredSample
from rollwire.runtime.logs import get_logger

log = get_logger(__name__)
MAX_SEQUENCES = 32
"""Sequences per Score request (a replica's limits.max_score_sequences is 64 by default)."""
MAX_TOKENS = 16384
"""Prompt and completion tokens per Score request (limits.max_score_tokens is 32768 by default)."""


def packed(samples: Sequence[tuple[Sequence[int], ScoredSample]]) -> list[list[tuple[Sequence[int], ScoredSample]]]:
    """The samples in request-sized chunks, in order."""
    chunks: list[list[tuple[Sequence[int], ScoredSample]]] = [[]]
    tokens = 0
    for prompt, sample in samples:
        size = len(prompt) + len(sample.token_ids)
        if chunks[-1] and (len(chunks[-1]) >= MAX_SEQUENCES or tokens + size > MAX_TOKENS):
            chunks.append([])
            tokens = 0
        chunks[-1].append((prompt, sample))
        tokens += size
    return [c for c in chunks if c]


async def score_reference(client: AsyncClient, groups: list[ScoredGroup], timeout: float) -> bool:
    """Fill every sample's ref_logprobs with the base model's logprobs from the replicas; True
    when every sample has them (else none is left with them: the trainer computes its own)."""
    samples = [(g.prompt_ids, s) for g in groups for s in g.samples if len(s.token_ids)]
    chunks = packed(samples)
    try:
        results = await asyncio.gather(
            *(
                client.score([(list(p), list(s.token_ids)) for p, s in chunk], adapter=None, timeout=timeout)
                for chunk in chunks
            )
        )
        for chunk, result in zip(chunks, results, strict=True):
            for (_, sample), logprobs in zip(chunk, result.logprobs, strict=True):
                if len(logprobs) != len(sample.token_ids):
                    raise ValueError(f"Score returned {len(logprobs)} logprobs for {len(sample.token_ids)} tokens")
                sample.ref_logprobs = logprobs
    except Exception as exc:  # any failure: the trainer computes the reference itself this step
        for _, sample in samples:
            sample.ref_logprobs = ()
        log.warning("kl_reference_scored_locally", reason=str(exc)[:300], samples=len(samples))
        return False
    return True
