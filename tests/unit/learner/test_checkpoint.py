"""Checkpoint round trip, atomic `latest`, and the resume version rule."""

from __future__ import annotations

import random

import pytest
import torch

from rollwire.learner.config import TrainSection
from rollwire.learner.rollouts.groups import ScoredGroup, ScoredSample
from rollwire.learner.run import checkpoint
from rollwire.learner.tasks.task import Example
from rollwire.learner.train.trainer import Trainer


def batch(prompt=(20, 21, 22), n=4) -> list[ScoredGroup]:
    samples = [
        ScoredSample([30 + i, 31, 2], [-1.0, -1.5, -0.5], [1, 1, 1], "x", "eos", float(i % 2), i % 2 == 1)
        for i in range(n)
    ]
    return [ScoredGroup(Example(0, "p", "a"), list(prompt), samples, 1)]


@pytest.fixture
def trained(tiny_model):
    trainer = Trainer(tiny_model, TrainSection(lr=1e-2, groups_per_step=1, micro_batch_groups=1), 1.0, seed=0)
    trainer.step(batch(), version=1)
    return trainer


def test_round_trip_restores_adapter_optimiser_counters_and_rng(tiny_model, trained, tmp_path):
    random.seed(123)
    torch.manual_seed(7)
    state = checkpoint.LearnerState(step=3, version=4, data_cursor=57, python_rng=checkpoint.python_rng_state())
    checkpoint.save(tmp_path, state, trained.adapter_payload(), trained.optimizer.state_dict())
    expected_py, expected_torch = random.random(), torch.rand(3)
    random.seed(0)
    torch.manual_seed(0)

    loaded = checkpoint.load_latest(tmp_path)
    assert (loaded.state.step, loaded.state.version, loaded.state.data_cursor) == (3, 4, 57)
    fresh = Trainer(tiny_model, TrainSection(lr=1e-2, groups_per_step=1, micro_batch_groups=1), 1.0, seed=1)
    assert fresh.adapter_payload() != trained.adapter_payload()
    fresh.load_adapter(loaded.adapter)
    fresh.optimizer.load_state_dict(loaded.trainer["optimizer"])
    assert fresh.adapter_payload() == trained.adapter_payload()
    # same optimiser moments: one more identical step gives identical weights
    trained.step(batch(), version=2)
    fresh.step(batch(), version=2)
    assert fresh.adapter_payload() == trained.adapter_payload()
    checkpoint.restore_python_rng(loaded.state.python_rng)
    torch.set_rng_state(loaded.trainer["torch_rng"])
    assert random.random() == expected_py
    assert torch.equal(torch.rand(3), expected_torch)


def test_latest_names_the_newest_complete_checkpoint_and_old_ones_go(tmp_path, trained):
    payload, opt = trained.adapter_payload(), trained.optimizer.state_dict()
    for step in (5, 10, 15):
        checkpoint.save(
            tmp_path, checkpoint.LearnerState(step, step + 1, step * 8, [3, [1], None]), payload, opt, keep=2
        )
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000010", "step-000015"]
    assert checkpoint.load_latest(tmp_path).state.step == 15
    assert not list(tmp_path.glob(".*tmp*"))


def test_no_checkpoint_is_none(tmp_path):
    assert checkpoint.load_latest(tmp_path / "nothing") is None


@pytest.mark.parametrize(
    "saved, on_target, expected",
    [
        (0, [], 1),  # fresh run, fresh replicas
        (7, [], 8),  # replicas restarted empty
        (7, [5, 6, 7], 8),  # replicas hold exactly what was checkpointed
        (7, [8, 9, 10], 11),  # pushes after the checkpoint: still strictly above them
        (0, [3], 4),  # a fresh run against replicas that served an earlier run of the same name
    ],
)
def test_resume_version_is_above_everything_seen(saved, on_target, expected):
    assert checkpoint.next_version(saved, on_target) == expected
