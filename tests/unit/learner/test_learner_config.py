"""The learner's typed config: files, overrides, errors that name keys, and `rollwire learner
--dry-run` (the command line's own main, in this process). The command in a fresh interpreter:
tests/integration/client/test_registries_cli.py (`learner --help` without torch) and every
learner that tests/integration/learner/ starts."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import yaml

from rollwire.client import cli
from rollwire.learner.config import LearnerConfig
from rollwire.runtime.config import ConfigError, dump_config, load_config

ROOT = Path(__file__).resolve().parents[3]


def load_learner_config(path: str | None, overrides: list[str] | None = None) -> LearnerConfig:
    return load_config(LearnerConfig, path, overrides or [])


def test_defaults_are_the_asynchronous_mode_with_one_exact_match_reward():
    cfg = load_learner_config(None, ["base_model=/m"])
    assert cfg.buffer.max_staleness == 1 and not cfg.sync
    assert [r.kind for r in cfg.rewards] == ["exact_match"]
    assert cfg.rollout.temperature == 1.0


def test_toml_file_then_overrides(tmp_path):
    path = tmp_path / "learner.toml"
    path.write_text('base_model = "/m"\n[train]\nlr = 0.5\n[[rewards]]\nkind = "regex"\npattern = "[0-9]+"\n')
    cfg = load_learner_config(str(path), ["train.lr=0.25", "buffer.max_staleness=0"])
    assert cfg.train.lr == 0.25 and cfg.sync
    assert cfg.rewards[0].pattern == "[0-9]+"


def test_yaml_file_with_overrides(tmp_path):
    path = tmp_path / "learner.yaml"
    path.write_text(yaml.safe_dump({"base_model": "/m", "train": {"lr": 0.5}, "rewards": [{"kind": "numeric"}]}))
    cfg = load_learner_config(str(path), ["train.groups_per_step=4"])
    assert (cfg.train.lr, cfg.train.groups_per_step, cfg.rewards[0].kind) == (0.5, 4, "numeric")


@pytest.mark.parametrize(
    "overrides, names",
    [
        ([], "base_model"),
        (["base_model=/m", "train.lrr=1"], "train.lrr"),
        (["base_model=/m", "train.lr=-1"], "train.lr"),
        (["base_model=/m", "train.micro_batch_groups=9"], "train.micro_batch_groups"),
        (["base_model=/m", "rollout.groups_in_flight=2"], "rollout.groups_in_flight"),
        (["base_model=/m", 'rewards=[{"kind": "python"}]'], "function"),
        (["base_model=/m", "task.kind=jsonl"], "task.train_path"),
    ],
)
def test_errors_name_the_key(overrides, names):
    with pytest.raises(ConfigError, match=names.replace(".", r"\.")):
        load_learner_config(None, overrides)


def test_every_field_has_help():
    def walk(model):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"
            annotation = field.annotation
            if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
                walk(annotation)

    walk(LearnerConfig)


def test_the_kubernetes_learner_config_is_valid(tmp_path):
    docs = [d for d in yaml.safe_load_all((ROOT / "ops/k8s/configmaps.yaml").read_text()) if d]
    toml_text = next(d["data"]["learner.toml"] for d in docs if "learner.toml" in d.get("data", {}))
    path = tmp_path / "learner.toml"
    path.write_text(toml_text)
    assert load_learner_config(str(path)).target.endswith(":50050")


def test_dump_round_trips_defaults():
    cfg = load_learner_config(None, ["base_model=/m"])
    assert "max_staleness = 1" in dump_config(cfg)


def test_dry_run_prints_toml_that_reads_back(tmp_path, capsys):
    argv = ["learner", "--dry-run", "base_model=/m", "train.lr=0.003", "--set", "rollout.n=4"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "lr = 0.003" in out and [r["kind"] for r in tomllib.loads(out)["rewards"]] == ["exact_match"]
    path = tmp_path / "resolved.toml"
    path.write_text(out)
    assert load_learner_config(str(path)) == load_learner_config(
        None, ["base_model=/m", "train.lr=0.003", "rollout.n=4"]
    )
