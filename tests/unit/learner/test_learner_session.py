"""Whole learner runs in this process, against a fake of the learner's target
(support/fake_target.py, given to wiring.open_session as its client), on the tiny model.

What the learner itself decides is checked here: a run folder's checkpoints are never
overwritten without --resume; a resumed run continues at the checkpoint's step and data
position, above every version the target holds; the loop accounts for every group it asked for,
whatever failed. The same run over real processes and sockets:
tests/integration/learner/test_learner_resume.py (a learner SIGKILLed mid-run and resumed
against real replicas) and test_learner_faults.py (a replica killed mid-run).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import cast

import pytest
from support.fake_target import FakeTarget

from rollwire.client import AsyncClient
from rollwire.common.errors import InvalidArgument, Unavailable
from rollwire.common.fingerprint import model_fingerprint
from rollwire.common.reasons import Reason
from rollwire.learner.config import LearnerConfig
from rollwire.learner.run import checkpoint
from rollwire.learner.run.loop import train
from rollwire.learner.run.wiring import LearnerError, open_session
from rollwire.learner.tasks.task import Example, write_jsonl
from rollwire.runtime.config import load_config

EXAMPLES = [Example(i, f"q{i}", str(i % 7)) for i in range(40)]
ANSWERS = {e.prompt: e.answer for e in EXAMPLES}


def right_and_wrong(prompt: str) -> list[str]:
    """One right completion and one wrong: every group has reward variance, so every one trains."""
    return [ANSWERS[prompt], "wrong"]


def config(tiny_model, tmp_path, *overrides: str) -> LearnerConfig:
    write_jsonl(tmp_path / "train.jsonl", EXAMPLES)
    return load_config(
        LearnerConfig,
        None,
        [
            f"base_model={tiny_model}",
            "target=127.0.0.1:1",  # never dialled: the session is given the fake as its client
            f"run_dir={tmp_path / 'run'}",
            "adapter_name=policy",
            "seed=3",
            "task.kind=jsonl",
            f"task.train_path={tmp_path / 'train.jsonl'}",
            "train.threads=1",
            "train.groups_per_step=2",
            "rollout.n=2",
            "rollout.groups_in_flight=2",
            "rollout.retry_backoff_s=0.01",
            "eval.at_start=false",
            "eval.at_end=false",
            *overrides,
        ],
    )


async def run(cfg: LearnerConfig, target: FakeTarget, *, resume: bool = False) -> dict:
    session = await open_session(cfg, resume, client=as_client(target))
    try:
        return await train(session)
    finally:
        await session.close()


def as_client(target: FakeTarget) -> AsyncClient:
    """The fake in the client's place: it answers the calls a learner makes (support/fake_target.py)."""
    return cast(AsyncClient, target)


def latest_state(cfg: LearnerConfig) -> checkpoint.LearnerState:
    saved = checkpoint.load_latest(Path(cfg.run_dir) / "checkpoints")
    assert saved is not None, "no checkpoint written"
    return saved.state


def steps_written(cfg: LearnerConfig) -> list[dict]:
    return [json.loads(line) for line in (Path(cfg.run_dir) / "steps.jsonl").read_text().splitlines()]


@pytest.fixture
def fingerprint(tiny_model) -> str:
    return model_fingerprint(tiny_model)


async def test_a_resumed_run_continues_at_the_checkpoint_above_every_version_the_target_holds(
    tiny_model, tmp_path, fingerprint
):
    cfg = config(tiny_model, tmp_path, "max_steps=2")
    target = FakeTarget(fingerprint, right_and_wrong)
    first = await run(cfg, target)
    assert target.pushed == [1, 2, 3] and first["served_version"] == first["last_version"] == 3
    saved = latest_state(cfg)  # written at the run's end
    assert (saved.step, saved.version) == (2, 3) and saved.data_cursor > 0

    # Without --resume the folder is refused, before anything is dialled or written.
    with pytest.raises(LearnerError, match="--resume"):
        await open_session(cfg, False, client=as_client(target))
    assert latest_state(cfg) == saved

    # Pushes cut off by a kill may land after the checkpoint: the target holds 4 and 5.
    target.versions += [4, 5]
    session = await open_session(cfg, True, client=as_client(target))
    assert (session.step, session.version, session.stream.cursor) == (2, 6, saved.data_cursor)
    await session.close()

    second = await run(cfg, target, resume=True)
    assert (second["step"], second["steps"], second["first_version"], second["last_version"]) == (4, 2, 6, 8)
    assert second["served_version"] == 8 and target.pushed == [1, 2, 3, 6, 7, 8]
    versions = [line["version"] for line in steps_written(cfg)]
    assert versions == sorted(set(versions)) == [2, 3, 7, 8]


def _boom_raises(completion, example):
    if completion == "boom":
        raise ZeroDivisionError("this reward cannot score 'boom'")
    return 0.0


async def test_every_group_asked_for_is_trained_or_dropped_with_its_reason(tiny_model, tmp_path, fingerprint):
    """The fake refuses the 2nd request (a prompt over the limit), finds no replica for the 3rd,
    and answers the 4th with a completion a reward cannot score; the rest train."""
    asked: list[str] = []

    def answer(prompt: str):
        asked.append(prompt)
        if len(asked) == 2:
            return InvalidArgument("prompt is 40 tokens, the limit is 16", reason=Reason.PROMPT_TOO_LONG)
        if len(asked) == 3:
            return Unavailable("no replica is ready")
        if len(asked) == 4:
            return ["boom", "wrong"]
        return right_and_wrong(prompt)

    reward = '{"kind": "python", "name": "boom", "function": "test_learner_session:_boom_raises"}'
    cfg = config(tiny_model, tmp_path, "max_steps=3", f'rewards=[{{"kind": "exact_match"}}, {reward}]')
    target = FakeTarget(fingerprint, answer)
    s = await run(cfg, target)

    groups = s["groups"]
    assert groups["dropped"].get("refused") == 1 and groups["dropped"].get("unavailable") == 1
    assert groups["dropped"].get("reward_error") == 1
    assert groups["trained"] == 3 * 2 and s["steps"] == 3
    assert groups["requested"] >= len(asked)  # a request cancelled at the stop never reached the target
    assert groups["requested"] == groups["trained"] + sum(groups["dropped"].values())  # nothing silently lost
    assert s["served_version"] == s["last_version"] == s["first_version"] + 3
