"""The learner's typed config through the command line: `rollwire learner --dry-run` prints
TOML that reads back as the same config."""

from __future__ import annotations

import subprocess
import sys
import tomllib

from rollwire.learner.config import LearnerConfig
from rollwire.runtime.config import load_config


def load_learner_config(path: str | None, overrides: list[str] | None = None) -> LearnerConfig:
    return load_config(LearnerConfig, path, overrides or [])


def test_dry_run_prints_toml_that_reads_back(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollwire.client.cli",
            "learner",
            "--dry-run",
            "base_model=/m",
            "train.lr=0.003",
            "--set",
            "rollout.n=4",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "lr = 0.003" in out and [r["kind"] for r in tomllib.loads(out)["rewards"]] == ["exact_match"]
    path = tmp_path / "resolved.toml"
    path.write_text(out)
    assert load_learner_config(str(path)) == load_learner_config(
        None, ["base_model=/m", "train.lr=0.003", "rollout.n=4"]
    )
