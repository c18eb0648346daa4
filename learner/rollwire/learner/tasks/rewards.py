"""Reward functions: built-ins, user functions by import path, and scoring a group.

A reward function is `fn(completion: str, example: Example) -> float`. A sample's reward
is the weighted sum of every configured function. A function that raises (or returns a
non-finite number) never stops the learner: the failure is returned to the caller, which
counts it and drops the group with the reason `reward_error` (a partly scored group would
bias its advantages).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from rollwire.learner.config import RewardSpec
from rollwire.learner.tasks.task import Example, is_correct

RewardFn = Callable[[str, Example], float]
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


def exact_match(completion: str, example: Example) -> float:
    """1 when the stripped completion is exactly the answer."""
    return 1.0 if is_correct(completion, example.answer) else 0.0


def numeric(completion: str, example: Example) -> float:
    """1 when the first number in the completion equals the answer as a number ("052" == 52)."""
    found = _NUMBER.search(completion)
    if found is None:
        return 0.0
    try:
        return 1.0 if math.isclose(float(found.group()), float(example.answer), abs_tol=1e-9) else 0.0
    except ValueError:
        return 0.0


def regex(pattern: str) -> RewardFn:
    """A format reward: 1 when the stripped completion fully matches `pattern`."""
    compiled = re.compile(pattern)
    return lambda completion, example: 1.0 if compiled.fullmatch(completion.strip()) else 0.0


def load_function(spec: str) -> RewardFn:
    """'package.module:function' or 'path/to/file.py:function' -> the function."""
    where, _, name = spec.rpartition(":")
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise ValueError(f"reward function file {path} does not exist")
        module_spec = importlib.util.spec_from_file_location(f"rollwire_user_reward_{path.stem}", path)
        if module_spec is None or module_spec.loader is None:
            raise ValueError(f"reward function file {path} cannot be imported as a Python module")
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"{spec}: {name!r} is not a function of {where}")
    return cast(RewardFn, fn)


@dataclass(frozen=True)
class Reward:
    """A named, weighted reward function."""

    name: str
    weight: float
    fn: RewardFn


def build_rewards(specs: Sequence[RewardSpec]) -> list[Reward]:
    """The configured reward functions; a bad import path fails here, at start-up."""
    rewards = []
    for spec in specs:
        if spec.kind == "exact_match":
            fn = exact_match
        elif spec.kind == "numeric":
            fn = numeric
        elif spec.kind == "regex":
            fn = regex(spec.pattern)
        else:
            fn = load_function(spec.function)
        rewards.append(Reward(spec.name or spec.kind, spec.weight, fn))
    return rewards


@dataclass(frozen=True)
class RewardFailure:
    """One reward function that failed on one completion."""

    reward: str
    error: str


def score(completion: str, example: Example, rewards: Sequence[Reward]) -> tuple[float, list[RewardFailure]]:
    """The weighted sum for one completion, and every function that failed on it."""
    total, failures = 0.0, []
    for reward in rewards:
        try:
            value = float(reward.fn(completion, example))
            if not math.isfinite(value):
                raise ValueError(f"returned {value}")
        except Exception as exc:  # a user function may raise anything; it is reported, never fatal
            failures.append(RewardFailure(reward.name, f"{type(exc).__name__}: {exc}"))
            continue
        total += reward.weight * value
    return total, failures
