"""Kill the learner mid-run, resume it: versions keep increasing and the replicas accept them.

The learner's own resume rules in-process, against a fake target (a folder with checkpoints
refused without --resume, the step, data position and first version of a resumed run):
tests/unit/learner/test_learner_session.py."""

from __future__ import annotations

import pytest
from support.learner import adapter_versions, learner_args, log_events, run_learner, steps, summary, wait_for_steps
from support.processes import start

from rollwire.learner.run.checkpoint import load_latest

pytestmark = pytest.mark.slow


def test_killed_learner_resumes_with_increasing_versions(stack, taught_model, tmp_path):
    run = tmp_path / "run"
    args = learner_args(
        stack.proxy.target,
        taught_model,
        run,
        "policy-resume",
        "checkpoint.every_steps=3",
        "eval.at_start=false",
        "eval.at_end=false",
    )
    first = start([*args, "max_steps=1000"], tmp_path, "learner-1", timeout=120)
    wait_for_steps(run, 8, first.proc)
    first.kill()  # SIGKILL: no final checkpoint, pushes after the last checkpoint are on the replicas
    before = steps(run)
    saved = load_latest(run / "checkpoints").state
    # The checkpoint's version may still have been on its way when the kill came (the async
    # learner saves right after a step and pushes beside the next one), so the replicas hold
    # versions below it, at it or above it; the resumed run must start above all of them.
    pushed = adapter_versions(stack.proxy.target, "policy-resume")
    assert pushed, "the killed run pushed nothing"

    result = run_learner([*args, "max_steps=4", "--resume"])
    ready = log_events(result.stderr, "learner_ready")[0]
    assert ready["resumed_from"].endswith(f"step-{saved.step:06d}")
    assert ready["data_cursor"] == saved.data_cursor > 0
    s = summary(run)
    # strictly above the checkpoint's and every version the replicas saw (a push cut off by the kill may still land)
    assert s["first_version"] > max(*pushed, saved.version)
    assert s["step"] == saved.step + 4 and s["steps"] == 4
    assert s["served_version"] == s["last_version"] == s["first_version"] + 4  # the replicas accepted every push
    assert not log_events(result.stderr, "push_refused")
    after = steps(run)[len(before) :]
    versions = [line["version"] for line in before + after]
    assert versions == sorted(set(versions)), versions
    assert adapter_versions(stack.proxy.target, "policy-resume")[-1] == s["last_version"]
