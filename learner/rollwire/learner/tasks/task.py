"""The built-in verifiable task and the data streams the learner reads.

Task: two-digit addition with zero-padded operands and a three-digit answer,
`"07+45="` -> `"052"` (then EOS). Zero padding keeps every digit at a fixed position,
which a two-layer character model learns in a few hundred steps.

Invariants:
- the held-out split is a pure function of the prompt text (a hash), so no training
  example, teaching example or rollout ever uses a held-out prompt, on any machine;
- the order of training examples is a pure function of (seed, cursor): a learner that
  resumes at a cursor sees exactly the examples it would have seen without stopping.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Example:
    """One prompt with its verifiable answer; `id` is stable across runs."""

    id: int
    prompt: str
    answer: str
    meta: dict = field(default_factory=dict, compare=False, hash=False)


def is_held_out(prompt: str, fraction: float) -> bool:
    """True for the held-out share of prompts; stable because it hashes only the text."""
    digest = hashlib.sha256(prompt.encode()).digest()
    return int.from_bytes(digest[:4], "big") < fraction * 2**32


def is_correct(completion: str, answer: str) -> bool:
    """The task's verifier: the completion, stripped, is exactly the answer."""
    return completion.strip() == answer


# ---------------------------------------------------------------- addition


def addition_prompt(a: int, b: int) -> str:
    return f"{a:02d}+{b:02d}="


def addition_answer(a: int, b: int) -> str:
    return f"{a + b:03d}"


def carry_free_answer(a: int, b: int) -> str:
    """What a solver that forgets every carry writes: each column mod 10, no carry out."""
    units, tens = (a % 10 + b % 10) % 10, (a // 10 + b // 10) % 10
    return f"0{tens}{units}"


def addition_examples(held_out_fraction: float) -> tuple[list[Example], list[Example]]:
    """All 10,000 problems a+b with 0 <= a, b <= 99, split into (train, held_out)."""
    train, held = [], []
    for a in range(100):
        for b in range(100):
            prompt = addition_prompt(a, b)
            ex = Example(a * 100 + b, prompt, addition_answer(a, b), {"a": a, "b": b})
            (held if is_held_out(prompt, held_out_fraction) else train).append(ex)
    return train, held


# ---------------------------------------------------------------- JSONL datasets


def read_jsonl(path: str | Path) -> list[Example]:
    """Examples from a JSON-lines file of {"prompt": ..., "answer": ...} objects."""
    examples = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            prompt, answer = item["prompt"], str(item["answer"])
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f'{path}:{number}: expected {{"prompt": ..., "answer": ...}} ({exc})') from None
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{path}:{number}: prompt must be a non-empty string")
        examples.append(Example(int(item.get("id", number)), prompt, answer, item.get("meta") or {}))
    if not examples:
        raise ValueError(f"{path} holds no examples")
    return examples


def write_jsonl(path: str | Path, examples: Sequence[Example]) -> None:
    lines = [json.dumps({"id": e.id, "prompt": e.prompt, "answer": e.answer}) for e in examples]
    Path(path).write_text("\n".join(lines) + "\n")


# ---------------------------------------------------------------- streams


class DataStream:
    """Training examples in a reshuffled order per epoch; the cursor is the whole state."""

    def __init__(self, examples: Sequence[Example], seed: int, cursor: int = 0) -> None:
        if not examples:
            raise ValueError("the training set is empty")
        self.examples = list(examples)
        self.seed = seed
        self.cursor = cursor
        self._epoch, self._order = -1, [0]

    def next(self) -> Example:
        epoch, index = divmod(self.cursor, len(self.examples))
        if epoch != self._epoch:
            self._order = list(range(len(self.examples)))
            random.Random(f"{self.seed}/{epoch}").shuffle(self._order)
            self._epoch = epoch
        self.cursor += 1
        return self.examples[self._order[index]]


def eval_subset(held_out: Sequence[Example], size: int, seed: int = 0) -> list[Example]:
    """A fixed sample of the held-out set (all of it when size is 0 or larger)."""
    if size <= 0 or size >= len(held_out):
        return list(held_out)
    return random.Random(seed).sample(list(held_out), size)
