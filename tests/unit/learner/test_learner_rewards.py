"""Reward functions: built-ins, user functions by import path, failures reported not raised."""

from __future__ import annotations

import pytest

from rollwire.learner.config import RewardSpec
from rollwire.learner.tasks.rewards import build_rewards, exact_match, numeric, score
from rollwire.learner.tasks.task import Example

EX = Example(1, "07+45=", "052")


@pytest.mark.parametrize("text, exact, num", [("052", 1, 1), (" 052\n", 1, 1), ("52", 0, 1), ("053", 0, 0), ("", 0, 0)])
def test_builtins(text, exact, num):
    assert exact_match(text, EX) == exact
    assert numeric(text, EX) == num


def test_weighted_sum_with_a_format_reward():
    rewards = build_rewards([RewardSpec(kind="exact_match"), RewardSpec(kind="regex", pattern=r"\d{3}", weight=0.5)])
    assert score("052", EX, rewards) == (1.5, [])
    assert score("999", EX, rewards) == (0.5, [])
    assert score("x", EX, rewards) == (0.0, [])


def test_user_function_by_module_path_and_by_file(tmp_path):
    module = build_rewards([RewardSpec(kind="python", function="rollwire.learner.tasks.rewards:numeric")])
    assert module[0].name == "python" and module[0].fn("52", EX) == 1.0
    path = tmp_path / "my_reward.py"
    path.write_text("def length(completion, example):\n    return len(completion)\n")
    by_file = build_rewards([RewardSpec(kind="python", name="length", function=f"{path}:length")])
    assert score("abcd", EX, by_file) == (4.0, [])


def test_bad_import_path_fails_at_start_up(tmp_path):
    with pytest.raises(ValueError, match="not a function"):
        build_rewards([RewardSpec(kind="python", function="rollwire.learner.tasks.rewards:nothing_here")])
    with pytest.raises(ValueError, match="does not exist"):
        build_rewards([RewardSpec(kind="python", function=f"{tmp_path}/missing.py:f")])


def test_a_raising_or_non_finite_reward_is_reported_not_raised(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text("def boom(c, e):\n    raise RuntimeError('kaput')\ndef nan(c, e):\n    return float('nan')\n")
    rewards = build_rewards(
        [
            RewardSpec(kind="exact_match"),
            RewardSpec(kind="python", name="boom", function=f"{path}:boom"),
            RewardSpec(kind="python", name="nan", function=f"{path}:nan"),
        ]
    )
    total, failures = score("052", EX, rewards)
    assert total == 1.0
    assert [(f.reward, f.error) for f in failures] == [
        ("boom", "RuntimeError: kaput"),
        ("nan", "ValueError: returned nan"),
    ]
