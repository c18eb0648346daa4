"""Held-out accuracy through the target: greedy decoding of one sample per prompt.

Greedy (temperature 0) measures what the policy does by default, not what it can sample.
A prompt whose request fails is counted as unanswered, never as right or wrong.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence
from dataclasses import dataclass

from rollwire.common.errors import RollwireError
from rollwire.learner.tasks.task import Example, is_correct
from rollwire.runtime.logs import get_logger

log = get_logger(__name__)


@dataclass(frozen=True)
class EvalResult:
    accuracy: float | None
    """Right / answered; None when nothing was answered."""
    answered: int
    failed: int


async def held_out_accuracy(
    client, examples: Sequence[Example], adapter: str | None, max_new_tokens: int, concurrency: int = 32
) -> EvalResult:
    """Greedy accuracy of `adapter` ("name@version", or None for the base model)."""
    gate = asyncio.Semaphore(concurrency)

    async def one(example: Example) -> bool | None:
        async with gate:
            try:
                result = await client.generate(
                    example.prompt,
                    1,
                    max_new_tokens=max_new_tokens,
                    temperature=0.0,
                    adapter=adapter,
                    group_key=str(example.id),
                )
            except RollwireError as exc:
                log.warning("eval_request_failed", example=example.id, error=str(exc))
                return None
            return is_correct(result.samples[0].text, example.answer)

    outcomes = await asyncio.gather(*(one(e) for e in examples))
    answered = [o for o in outcomes if o is not None]
    accuracy = sum(answered) / len(answered) if answered else None
    return EvalResult(accuracy, len(answered), len(outcomes) - len(answered))


@functools.cache
def _encoder(base_model: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_model)
    return lambda text: tokenizer.encode(text, add_special_tokens=False)


async def held_out_episodes(
    client, examples: Sequence[Example], base_model: str, adapter: str | None, concurrency: int = 32
) -> EvalResult:
    """Greedy episode success of the multi-turn chain task (chain.py): the share of held-out
    episodes whose every turn is right; an episode whose request fails is unanswered."""
    from rollwire.learner.tasks.chain import episode_success

    encode = await asyncio.to_thread(_encoder, base_model)
    succeeded, answered, failed = await episode_success(client, examples, encode, adapter, concurrency)
    return EvalResult(succeeded / answered if answered else None, answered, failed)
