"""The built-in task: deterministic data, a held-out split no one trains on, resumable streams.
Batched greedy completions of the taught model: tests/integration/learner/test_learner_task_taught.py."""

from __future__ import annotations

import pytest

from rollwire.demo.teach import TeachSpec, lr_factor
from rollwire.learner.tasks.task import (
    DataStream,
    Example,
    addition_examples,
    carry_free_answer,
    eval_subset,
    is_held_out,
    read_jsonl,
    write_jsonl,
)


def test_addition_split_is_disjoint_deterministic_and_about_a_tenth():
    train, held = addition_examples(0.1)
    assert len(train) + len(held) == 10_000
    assert 800 < len(held) < 1200
    assert not {e.prompt for e in train} & {e.prompt for e in held}
    assert addition_examples(0.1) == (train, held)
    assert all(is_held_out(e.prompt, 0.1) for e in held)


def test_prompt_answer_and_the_teachers_carry_free_mistake():
    train, held = addition_examples(0.1)
    ex = next(e for e in train + held if e.prompt == "07+45=")
    assert ex.answer == "052"
    assert carry_free_answer(7, 45) == "042"  # forgets the units carry
    assert carry_free_answer(62, 51) == "013"  # forgets the carry out of the tens
    assert carry_free_answer(12, 34) == "046"  # no carry: same as the right answer


def test_stream_resumes_exactly_from_its_cursor():
    train, _ = addition_examples(0.1)
    straight = DataStream(train, seed=3)
    expected = [straight.next().id for _ in range(len(train) + 50)]  # crosses an epoch boundary
    first = DataStream(train, seed=3)
    head = [first.next().id for _ in range(1234)]
    resumed = DataStream(train, seed=3, cursor=first.cursor)
    tail = [resumed.next().id for _ in range(len(expected) - 1234)]
    assert head + tail == expected
    assert sorted(expected[: len(train)]) == sorted(e.id for e in train)  # an epoch is a permutation


def test_eval_subset_is_fixed_and_unbiased():
    _, held = addition_examples(0.1)
    a, b = eval_subset(held, 200, seed=0), eval_subset(held, 200, seed=0)
    assert a == b and len(a) == 200
    assert max(e.meta["a"] for e in a) > 80  # not just the first prompts in order


def test_jsonl_round_trip_and_errors(tmp_path):
    path = tmp_path / "d.jsonl"
    write_jsonl(path, [Example(1, "1+1=", "2"), Example(2, "2+2=", "4")])
    assert [e.answer for e in read_jsonl(path)] == ["2", "4"]
    path.write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match="d.jsonl:1"):
        read_jsonl(path)


def test_teach_key_changes_with_the_spec_and_schedule_shape():
    assert TeachSpec().key() == TeachSpec().key()
    assert TeachSpec(steps=10).key() != TeachSpec().key()
    spec = TeachSpec(steps=100, warmup_steps=10, decay_fraction=0.3)
    assert lr_factor(spec, 0) == pytest.approx(0.1)
    assert lr_factor(spec, 50) == 1.0
    assert lr_factor(spec, 85) == pytest.approx(0.5)
    assert lr_factor(spec, 100) == 0.0
