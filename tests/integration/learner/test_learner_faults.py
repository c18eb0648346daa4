"""Faults the learner reports and survives: a raising reward, a refused prompt, a replica that dies."""

from __future__ import annotations

import random

import pytest
from support.learner import learner_args, log_events, steps, summary, wait_for_steps
from support.processes import FAST_STOP, start, start_stack

from rollwire.common.reasons import Reason
from rollwire.learner.tasks.task import Example, addition_examples, write_jsonl

pytestmark = pytest.mark.slow

FLAKY_REWARD = """
def flaky(completion, example):
    if example.prompt.startswith("1"):
        raise ZeroDivisionError("this reward cannot score prompts starting with 1")
    return 0.0
"""


def test_faults_are_counted_and_survived(taught_model, tmp_path):
    stack = start_stack(
        taught_model, tmp_path / "stack", 2, generator_args=(*FAST_STOP, "--set", "limits.max_prompt_tokens=16")
    )
    try:
        train, held = addition_examples(0.1)
        long_prompt = Example(99_999, "1" * 40 + "+1=", "x")  # over the replicas' 16-token prompt limit
        write_jsonl(tmp_path / "train.jsonl", [long_prompt, *random.Random(0).sample(train, 60)])
        write_jsonl(tmp_path / "held.jsonl", held[:100])
        (tmp_path / "flaky.py").write_text(FLAKY_REWARD)
        flaky = f"{tmp_path / 'flaky.py'}:flaky"
        run = tmp_path / "run"
        args = learner_args(
            stack.proxy.target,
            taught_model,
            run,
            "policy-faults",
            "max_steps=14",
            "task.kind=jsonl",
            f"task.train_path={tmp_path / 'train.jsonl'}",
            f"task.held_out_path={tmp_path / 'held.jsonl'}",
            f'rewards=[{{"kind": "exact_match"}}, {{"kind": "python", "name": "flaky", "function": "{flaky}"}}]',
            "eval.at_start=false",
        )
        learner = start(args, tmp_path, "learner", timeout=120)
        wait_for_steps(run, 4, learner.proc)
        stack.replicas[0].kill()  # mid-run: the proxy moves its work to the other replica
        assert learner.proc.wait(180) == 0, learner.log_path.read_text()[-3000:]
        log = learner.log_path.read_text()
        s = summary(run)
    finally:
        stack.stop()

    dropped = s["groups"]["dropped"]
    assert dropped.get("refused", 0) >= 1, dropped  # the long prompt: skipped, counted
    assert any(
        Reason.PROMPT_TOO_LONG in e["error"] or "prompt" in e["error"] for e in log_events(log, "rollout_dropped")
    )
    assert dropped.get("reward_error", 0) >= 1, dropped  # groups with a prompt starting with 1
    assert any("ZeroDivisionError" in f for e in log_events(log, "reward_failed") for f in e["failures"])
    assert s["steps"] == 14 and s["served_version"] == s["last_version"]  # trained and pushed through it all
    assert s["groups"]["requested"] == s["groups"]["trained"] + sum(dropped.values())  # nothing silently lost
    assert s["accuracy_after"] is not None
    assert len(steps(run)) == 14
