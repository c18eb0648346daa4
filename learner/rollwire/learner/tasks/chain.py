"""The built-in multi-turn task: chained addition, and the episodes that play it.

An episode starts with the single-turn task's question, `"12+30="`; the model answers three
digits (`"042"`, then EOS); the environment turns that answer into the next question,
`"|42+05="`, with one more addend; and so on for `TURNS` turns:

    12+30=042</s>|42+05=047</s>|47+21=068</s>

Every number is at most 99 (the chain's addends are drawn so the running total stays below
100), so each question has the single-turn task's shape and each answer three digits. A turn
is right when its answer is the sum of its own question; the episode succeeds when every turn
is right; its reward is the share of right turns. An answer that is no number below 100 ends
the episode (its remaining turns count as wrong).

Invariants:
- the environment's tokens (every question after the first) are never the model's: the loss
  mask of an episode is true exactly on the model's reply tokens (`Episode.loss_mask`);
- token ids are kept exactly as the replica returned them; only the environment's own text is
  encoded, so no turn re-tokenizes the model's output;
- the held-out split is a pure function of the chain (a hash of its text): no episode the
  producer plays, nor any teaching example, is held out.

Torch-free: the learner's evaluation, the demo's teacher and examples/agent_producer.py share it.
"""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from rollwire.learner.tasks.task import Example, addition_answer, addition_prompt, carry_free_answer, is_held_out

TURNS = 3
SEPARATOR = "|"
MAX_ADDEND = 49
MAX_TOTAL = 99
CHAINS = 20_000
"""Chains in the task (ids 0..CHAINS-1), split into train and held out by hash."""
ANSWER = re.compile(r"\d{3}")


@dataclass(frozen=True)
class Chain:
    """One episode's numbers: the first question's operands, then one addend per later turn."""

    id: int
    a: int
    b: int
    addends: tuple[int, ...]

    @property
    def prompt(self) -> str:
        return addition_prompt(self.a, self.b)

    @property
    def text(self) -> str:
        """The chain's identity for the held-out hash."""
        return self.prompt + ",".join(f"{c:02d}" for c in self.addends)

    def total(self) -> int:
        return self.a + self.b + sum(self.addends)

    def example(self) -> Example:
        return Example(self.id, self.prompt, f"{self.total():03d}", {"chain": [self.a, self.b, *self.addends]})


def chain(chain_id: int, turns: int = TURNS) -> Chain:
    """Chain `chain_id`: addends 0..MAX_ADDEND with a total of at most MAX_TOTAL (a pure function of the id)."""
    rng = random.Random(f"chain/{chain_id}")
    while True:
        numbers = [rng.randint(0, MAX_ADDEND) for _ in range(turns + 1)]
        if sum(numbers) <= MAX_TOTAL:
            return Chain(chain_id, numbers[0], numbers[1], tuple(numbers[2:]))


def from_example(example: Example) -> Chain:
    a, b, *addends = example.meta["chain"]
    return Chain(example.id, a, b, tuple(addends))


def chain_examples(held_out_fraction: float, count: int = CHAINS) -> tuple[list[Example], list[Example]]:
    """(train, held_out) chains as Examples (answer: the final total; meta["chain"]: the numbers)."""
    train, held = [], []
    for i in range(count):
        c = chain(i)
        (held if is_held_out(c.text, held_out_fraction) else train).append(c.example())
    return train, held


def question(previous: int, addend: int) -> str:
    """What the environment says after an answer of `previous`: the next question."""
    return f"{SEPARATOR}{previous:02d}+{addend:02d}="


def read_answer(text: str) -> int | None:
    """The number a reply answers, when it is three digits below 100 (else the episode ends)."""
    stripped = text.strip()
    if not ANSWER.fullmatch(stripped) or int(stripped) > MAX_TOTAL:
        return None
    return int(stripped)


# ---------------------------------------------------------------- teaching text


def teacher_segments(c: Chain, rng: random.Random, accuracy: float) -> list[tuple[str, bool]]:
    """An imperfect teacher's episode as (text, trained) segments (a trained one is an answer,
    which EOS follows): each turn right with
    probability `accuracy`, else carry-free (as task.py's teacher); the environment restates
    whatever the teacher answered, as it would the model's."""
    segments: list[tuple[str, bool]] = [(c.prompt, False)]
    left, right = c.a, c.b
    for turn in range(len(c.addends) + 1):
        answer = addition_answer(left, right) if rng.random() < accuracy else carry_free_answer(left, right)
        segments.append((answer, True))
        if turn == len(c.addends):
            break
        left, right = int(answer), c.addends[turn]
        segments.append((question(left, right), False))
    return segments


# ---------------------------------------------------------------- episodes


@dataclass
class Episode:
    """One played episode: the tokens after the first prompt, which of them are the model's, and its score."""

    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    turns_right: int = 0
    turns: int = 0

    def model_turn(self, token_ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int]) -> None:
        self.token_ids += token_ids
        self.loss_mask += [True] * len(token_ids)
        self.logprobs += logprobs
        self.token_versions += versions

    def environment_turn(self, token_ids: Sequence[int]) -> None:
        self.token_ids += token_ids
        self.loss_mask += [False] * len(token_ids)
        self.logprobs += [0.0] * len(token_ids)  # not the model's: the learner ignores them
        self.token_versions += [0] * len(token_ids)

    @property
    def success(self) -> bool:
        return self.turns > 0 and self.turns_right == self.turns

    @property
    def reward(self) -> float:
        return self.turns_right / self.turns if self.turns else 0.0


@dataclass(frozen=True)
class Play:
    """How episodes are sampled: the adapter ("name@version" or "name@latest"), temperature,
    tokens per reply, and whether later turns go through sessions (client.session) or resend
    the whole history as prompt token ids."""

    adapter: str | None
    temperature: float = 1.0
    max_new_tokens: int = 4
    seed: int | None = None
    sessions: bool = False


async def play_group(
    client, c: Chain, n: int, encode: Callable[[str], list[int]], play: Play
) -> tuple[list[int], list[Episode]]:
    """`n` episodes of chain `c`: the first turn is one group of n; each later turn is a turn
    of the episode's session (its first session turn carries the history so far, the next ones
    only the environment's new tokens) or, without sessions, a request carrying the whole
    history. Returns (prompt token ids, episodes)."""
    first = await client.generate(c.prompt, n, **_options(play, 0, 0))
    prompt = list(first.prompt_token_ids)
    return prompt, list(await asyncio.gather(*(_rest(client, c, prompt, s, encode, play) for s in first.samples)))


async def _rest(client, c: Chain, prompt: list[int], reply, encode: Callable[[str], list[int]], play: Play) -> Episode:
    """The episode of one first-turn sample, played to its end."""
    episode, left, right = Episode(turns=len(c.addends) + 1), c.a, c.b
    session = client.session(**_options(play, 1, reply.index)) if play.sessions else None
    for turn in range(len(c.addends) + 1):
        episode.model_turn(reply.token_ids, reply.logprobs, reply.token_versions)
        answer = read_answer(reply.text)
        episode.turns_right += answer == left + right
        if answer is None or turn == len(c.addends):
            break
        left, right = answer, c.addends[turn]
        new = encode(question(left, right))
        history = prompt + episode.token_ids
        episode.environment_turn(new)
        if session is None:
            reply = (await client.generate(history + new, 1, **_options(play, turn + 1, reply.index))).samples[0]
            continue
        sent = len(session.history)
        reply = await session.turn(history[sent:] + new, end=turn + 1 == len(c.addends))
        if session.history != prompt + episode.token_ids + reply.token_ids:
            raise RuntimeError(f"session {session.id} holds another history than the episode's (chain {c.id})")
    if session is not None:
        await session.close()
    return episode


def _options(play: Play, turn: int, index: int) -> dict:
    seed = None if play.seed is None else play.seed * 1009 + turn * 101 + index
    return dict(max_new_tokens=play.max_new_tokens, temperature=play.temperature, adapter=play.adapter, seed=seed)


async def episode_success(
    client, examples: Sequence[Example], encode: Callable[[str], list[int]], adapter: str | None, concurrency: int
) -> tuple[int, int, int]:
    """Greedy held-out episodes: (succeeded, answered, failed requests)."""
    from rollwire.common.errors import RollwireError

    gate = asyncio.Semaphore(concurrency)
    play = Play(adapter, temperature=0.0)

    async def one(example: Example) -> bool | None:
        async with gate:
            try:
                _, (episode,) = await play_group(client, from_example(example), 1, encode, play)
            except RollwireError:
                return None
            return episode.success

    outcomes = await asyncio.gather(*(one(e) for e in examples))
    answered = [o for o in outcomes if o is not None]
    return sum(answered), len(answered), len(outcomes) - len(answered)
