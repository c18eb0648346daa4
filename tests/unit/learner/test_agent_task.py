"""The multi-turn chain task (learner/tasks/chain.py), pure checks of the environment: chains,
the held-out split, questions, answers and the teacher's segments. Real episodes through a
replica and producers feeding a learner: tests/e2e/test_agent_task_runs.py."""

from __future__ import annotations

import random

from rollwire.learner.tasks.chain import (
    MAX_TOTAL,
    TURNS,
    chain,
    chain_examples,
    from_example,
    question,
    read_answer,
    teacher_segments,
)
from rollwire.learner.tasks.task import is_held_out


def test_chains_keep_every_number_below_100_and_the_split_is_disjoint():
    train, held = chain_examples(0.1, count=2000)
    assert {e.id for e in train}.isdisjoint({e.id for e in held}) and len(train) + len(held) == 2000
    assert 0.05 < len(held) / 2000 < 0.15
    for example in train[:300] + held:
        c = from_example(example)
        assert c == chain(example.id) and len(c.addends) == TURNS - 1 and c.total() <= MAX_TOTAL
        assert is_held_out(c.text, 0.1) == (example in held)


def test_the_teacher_writes_what_the_environment_would_answer():
    rng = random.Random(3)
    c = chain(11)
    for accuracy in (0.0, 1.0):
        segments = teacher_segments(c, rng, accuracy)
        answers = [text for text, trained in segments if trained]
        questions = [text for text, trained in segments[1:] if not trained]
        assert len(answers) == TURNS and segments[0] == (c.prompt, False)
        assert questions == [question(int(a), c.addends[i]) for i, a in enumerate(answers[:-1])]
        if accuracy == 1.0:
            assert int(answers[-1]) == c.total()
    assert read_answer(" 042") == 42 and read_answer("142") is None and read_answer("42") is None
