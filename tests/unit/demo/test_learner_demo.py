"""The demo's pieces that need no processes: run folders, the PNG, summary.json, the table, the
placement of processes on cores, and the flags a vLLM-backed replica gets (read back through
the generator's own --dry-run, in this process). Processes placed for real:
tests/integration/demo/test_learner_demo_processes.py; replicas launching vLLM from .venv-vllm
for real: tests/e2e/test_vllm_engine.py."""

from __future__ import annotations

import json
import struct
import sys
import tomllib
from types import SimpleNamespace

import pytest

from rollwire.demo.plot import Series, line_chart
from rollwire.demo.run import SUMMARY_KEYS, finish, new_run_folder, print_table, progress_line

try:  # matplotlib's first import on a machine runs fc-list to build its font cache: here, at collection,
    import matplotlib.font_manager  # noqa: F401  # not inside a unit test, where starting a process fails it
except ImportError:  # the tests that draw skip without it
    pass

LEARNER_SUMMARY = {
    "accuracy_before": 0.3,
    "accuracy_after": 0.9,
    "steps": 5,
    "groups_per_s": 12.5,
    "staleness_mean": 0.8,
    "staleness_max": 1,
    "push_latency_s": 0.05,
    "push_latency_max_s": 0.2,
    "first_version": 1,
    "last_version": 6,
    "ratio_mean_staleness0": 1.0,
    "groups": {"trained": 40, "dropped": {"stale": 2}},
    "evals": [{"step": 0, "accuracy": 0.3}, {"step": 5, "accuracy": 0.9}],
}
"""What the learner writes to summary.json, as far as the demo reads it."""


def test_run_folders_and_the_latest_link(tmp_path):
    first = new_run_folder(tmp_path)
    assert (tmp_path / "latest").resolve() == first.resolve()
    second = new_run_folder(tmp_path)
    assert second != first and (tmp_path / "latest").resolve() == second.resolve()
    assert first.is_dir()


def test_line_chart_is_a_valid_png(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    path = line_chart(
        tmp_path / "c.png",
        [
            Series("reward", [0, 1, 2], [0.2, 0.5, 0.9], (0, 0, 255)),
            Series("held-out", [0, 2], [0.3, 0.95], (255, 128, 0), True),
        ],
        "t",
        "step",
        width=200,
        height=120,
    )
    assert path is not None
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    _length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and struct.unpack(">II", data[16:24]) == (200, 120)
    rgb = imread(path)[..., :3]
    assert rgb.shape == (120, 200, 3)
    assert ((rgb[..., 2] > 0.9) & (rgb[..., :2].max(axis=-1) < 0.1)).any()  # the reward line is drawn


def test_without_matplotlib_the_chart_is_skipped_with_a_note(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # `import` now raises ImportError
    assert line_chart(tmp_path / "c.png", [Series("reward", [0, 1], [0.2, 0.5], (0, 0, 255))], "t", "step") is None
    assert not (tmp_path / "c.png").exists()
    learner = tmp_path / "learner"
    learner.mkdir()
    (learner / "steps.jsonl").write_text(json.dumps({"step": 1, "rollout_reward_mean": 0.5}) + "\n")
    (learner / "summary.json").write_text(json.dumps(LEARNER_SUMMARY))
    out = finish(tmp_path, SimpleNamespace(budget_s=60, replicas=2, engine="transformers"))
    assert out["reward_curve"] is None and json.loads((tmp_path / "summary.json").read_text())["reward_curve"] is None
    print_table(out, tmp_path)
    assert "skipped: matplotlib is not installed" in capsys.readouterr().out


def test_finish_writes_summary_and_curve_and_the_table_prints(tmp_path, capsys):
    learner = tmp_path / "learner"
    learner.mkdir()
    steps = [{"step": i, "rollout_reward_mean": 0.3 + 0.1 * i} for i in range(1, 6)]
    (learner / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    summary = LEARNER_SUMMARY
    (learner / "summary.json").write_text(json.dumps(summary))
    out = finish(tmp_path, SimpleNamespace(budget_s=60, replicas=2, engine="transformers"))
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert all(saved[k] == summary[k] for k in SUMMARY_KEYS)
    assert (tmp_path / "reward_curve.png").read_bytes().startswith(b"\x89PNG")
    print_table(out, tmp_path)
    text = capsys.readouterr().out
    assert "30.0% -> 90.0%  (+60.0 points, greedy)" in text and "stale 2" in text


def test_progress_line_reads_a_steps_record():
    line = progress_line(
        12.0,
        120,
        {
            "step": 7,
            "version": 8,
            "rollout_reward_mean": 0.5,
            "rollout_accuracy": 0.5,
            "staleness_mean": 1.0,
            "ratio_mean": 1.0,
            "groups": {"trained": 56, "dropped": {"zero_variance": 3}},
        },
        {"accuracy": 0.42},
    )
    assert "step    7" in line and "held-out  42.0%" in line and "dropped 3" in line


# -- where the local stack's processes run --------------------------------------------------
@pytest.mark.parametrize(
    ("cores", "replicas", "learner", "serving"),
    [
        ({0, 1}, 1, {0}, {1}),  # this machine: 3 processes on 2 cores
        ({4, 7}, 1, {4}, {7}),  # the cores this process may use, not 0..n-1
        ({0, 1, 2}, 2, {0}, {1, 2}),
        ({0, 1, 2}, 1, set(), set()),  # a core for each: the scheduler is left alone
        ({0, 1, 2, 3}, 2, set(), set()),
        ({0}, 1, set(), set()),  # nothing to split
    ],
)
def test_the_learner_gets_a_core_of_its_own_only_when_the_processes_outnumber_the_cores(
    cores, replicas, learner, serving
):
    from rollwire.demo.stack import local_placement

    placement = local_placement(replicas, cores)
    assert placement.learner == learner
    assert placement.replicas == placement.proxy == serving


def test_vllm_backed_replicas_launch_vllm_from_its_own_environment(tmp_path, capsys):
    """`make demo ENGINE=vllm`: the flags the demo gives a replica resolve to a vLLM launched
    from .venv-vllm with the CPU settings (the generator's own --dry-run)."""
    from rollwire.client import cli
    from rollwire.demo.run import engine_args, parse_args
    from rollwire.demo.stack import VLLM_CPU_ENV, generator_args

    python = tmp_path / "venv" / "bin" / "python"
    with pytest.raises(SystemExit, match="make .venv-vllm"):
        engine_args(parse_args(["--engine", "vllm", "--vllm-python", str(python)]))
    python.parent.mkdir(parents=True)
    python.symlink_to(sys.executable)  # a venv's python: a link that must not be resolved away
    flags, timeout = engine_args(parse_args(["--engine", "vllm", "--vllm-python", str(python)]))
    assert timeout >= 300 and engine_args(parse_args([])) == ((), 120.0)
    capsys.readouterr()  # only the dry run's TOML is read below
    assert cli.main([*generator_args(tmp_path, *flags), "--dry-run"]) == 0
    config = tomllib.loads(capsys.readouterr().out)
    assert config["engine"] == "vllm" and config["vllm"]["dtype"] == "float32"
    assert config["vllm"]["launch_command"] == [str(python), "-m", "vllm.entrypoints.openai.api_server"]
    assert config["vllm"]["env"] == VLLM_CPU_ENV
