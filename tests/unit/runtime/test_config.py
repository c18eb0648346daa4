"""Config through pydantic-settings: one precedence (flags > --set > environment > file >
defaults), one override syntax for every command, errors that name the key, flags whose help
is the field's description, and --dry-run TOML that loads back to the same config."""

from __future__ import annotations

import argparse
import tomllib

import pytest

from rollwire.client import cli
from rollwire.generator import cli as generator_cli
from rollwire.generator.config import GeneratorConfig
from rollwire.learner.config import LearnerConfig
from rollwire.proxy import cli as proxy_cli
from rollwire.proxy.config import ProxyConfig
from rollwire.runtime.config import ConfigError, dump_config, field_info, load_config


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    """No ROLLWIRE_* variable of the surrounding shell reaches these tests."""
    import os

    for name in list(os.environ):
        if name.upper().startswith("ROLLWIRE_"):
            monkeypatch.delenv(name)


def test_each_source_wins_over_the_ones_below_it(tmp_path, monkeypatch):
    path = tmp_path / "generator.toml"
    path.write_text("port = 1\nreplica_id = 'file'\n[limits]\nmax_n = 5\nmax_queue = 7\n")
    assert load_config(GeneratorConfig).port == 50051
    assert load_config(GeneratorConfig, path).port == 1
    monkeypatch.setenv("ROLLWIRE_PORT", "2")
    monkeypatch.setenv("ROLLWIRE_LIMITS__MAX_N", "6")
    assert load_config(GeneratorConfig, path).port == 2
    assert load_config(GeneratorConfig, path, ["port=3", "port=33"]).port == 33  # later --set wins
    config = load_config(GeneratorConfig, path, ["port=3"], {"port": 4, "replica_id": None})
    assert config.port == 4
    assert config.replica_id == "file"  # a flag not given (None) hides nothing
    assert (config.limits.max_n, config.limits.max_queue) == (6, 7)  # sections merge key by key
    assert type(config) is GeneratorConfig and config == GeneratorConfig(
        port=4, replica_id="file", limits={"max_n": 6, "max_queue": 7}
    )


def test_environment_values_json_lists_sections_and_null(monkeypatch):
    monkeypatch.setenv("ROLLWIRE_GENERATORS", '["10.0.0.1:50051", "10.0.0.2:50051"]')
    monkeypatch.setenv("ROLLWIRE_ROUTING", '{"max_queue": 9}')
    monkeypatch.setenv("ROLLWIRE_ROUTING__MAX_ATTEMPTS", "5")
    monkeypatch.setenv("rollwire_health__interval_s", "0.5")  # names are case-insensitive
    proxy = load_config(ProxyConfig)
    assert proxy.generators == ["10.0.0.1:50051", "10.0.0.2:50051"]
    assert (proxy.routing.max_queue, proxy.routing.max_attempts, proxy.health.interval_s) == (9, 5, 0.5)
    monkeypatch.setenv("ROLLWIRE_SGLANG__RANDOM_SEED", "null")
    assert load_config(GeneratorConfig).sglang.random_seed is None


def test_unknown_environment_keys_inside_a_section_are_errors_top_level_ones_are_ignored(monkeypatch):
    monkeypatch.setenv("ROLLWIRE_TRAIN__LRR", "1")  # a learner key: no generator section "train"
    monkeypatch.setenv("ROLLWIRE_BASE_MODEL", "/m")
    assert load_config(GeneratorConfig).port == 50051
    with pytest.raises(ConfigError, match=r"train\.lrr: Extra inputs are not permitted"):
        load_config(LearnerConfig)
    monkeypatch.delenv("ROLLWIRE_TRAIN__LRR")
    monkeypatch.setenv("ROLLWIRE_TRAIN__LR", "-1")
    with pytest.raises(ConfigError, match=r"train\.lr: Input should be greater than 0"):
        load_config(LearnerConfig)
    monkeypatch.setenv("ROLLWIRE_TRAIN", "{not json")
    with pytest.raises(ConfigError, match="train"):
        load_config(LearnerConfig)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["limits.max_nn=3"], r"limits\.max_nn: Extra inputs are not permitted"),
        (["limits.max_n=0"], r"limits\.max_n: Input should be greater than or equal to 1"),
        (["port"], "override 'port' must look like key.sub=value"),
        (["=3"], "must look like key.sub=value"),
        (["port=1", "port.x=2"], r"port\.x: port is not a section"),
        (["engine=nope"], "engine: .*unknown engine 'nope'; choose one of transformers, sglang, vllm, scripted"),
        (["Port=1"], "Port: Extra inputs are not permitted"),  # keys are exact in files and overrides
    ],
)
def test_override_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(GeneratorConfig, None, overrides)


def test_file_errors_name_the_file_and_the_key(tmp_path):
    with pytest.raises(ConfigError, match="config file .*missing.toml does not exist"):
        load_config(GeneratorConfig, tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("port = = 1\n")
    with pytest.raises(ConfigError, match="bad.toml is not valid TOML"):
        load_config(GeneratorConfig, bad)
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("[limits]\nmax_nn = 1\n")
    with pytest.raises(ConfigError, match=r"limits\.max_nn: Extra inputs are not permitted"):
        load_config(GeneratorConfig, unknown)
    listed = tmp_path / "list.yaml"
    listed.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="list.yaml must hold a mapping of keys"):
        load_config(LearnerConfig, listed)
    broken = tmp_path / "broken.yaml"
    broken.write_text("a: [1\n")
    with pytest.raises(ConfigError, match="broken.yaml is not valid YAML"):
        load_config(LearnerConfig, broken)


@pytest.mark.parametrize(
    "argv, model",
    [
        (
            [
                "generator",
                "--model",
                "/models/m",
                "--engine",
                "scripted",
                "--port",
                "0",
                "--register",
                "10.0.0.9:50050",
                "--set",
                "sglang.random_seed=7",
                "--set",
                'sglang.extra_args=["--mem-fraction-static", "0.5"]',
                "--set",
                "limits.max_n=16",
                "--set",
                'replica_id=a "quoted" name\\',
            ],
            GeneratorConfig,
        ),
        (
            ["proxy", "--generator", "10.0.0.1:1", "--generator", "10.0.0.2:1", "--policy", "affinity"],
            ProxyConfig,
        ),
        (
            [
                "learner",
                "base_model=/m",
                "--set",
                'rewards=[{"kind": "regex", "pattern": "[0-9]+"}, {"kind": "numeric"}]',
            ],
            LearnerConfig,
        ),
    ],
)
def test_dry_run_prints_toml_that_loads_back_to_the_same_config(argv, model, tmp_path, capsys):
    assert cli.main([*argv, "--dry-run"]) == 0
    out = capsys.readouterr().out
    tomllib.loads(out)  # plain TOML
    path = tmp_path / "resolved.toml"
    path.write_text(out)
    parser = cli.build_parser()
    args = parser.parse_args(argv)
    from rollwire.runtime.config import flag_values

    expected = load_config(model, None, [*getattr(args, "overrides", []), *args.set], flag_values(args))
    assert load_config(model, path) == expected
    assert dump_config(load_config(model, path)) == out


def test_dry_run_of_a_bad_key_exits_2_naming_it(capsys):
    assert cli.main(["proxy", "--dry-run", "--set", "routing.max_queue=-1"]) == 2
    assert "routing.max_queue" in capsys.readouterr().err  # errors go to stderr, as every command does


@pytest.mark.parametrize(
    "command, module, model", [("generator", generator_cli, GeneratorConfig), ("proxy", proxy_cli, ProxyConfig)]
)
def test_flags_and_their_help_come_from_the_fields(command, module, model):
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    by_dest = {a.dest: a for a in sub._actions}
    for flag in module.FLAGS:
        action = by_dest[flag.dest]
        info = field_info(model, flag.key)
        assert flag.flag in action.option_strings
        assert action.help.startswith(info.description.replace("%", "%%")), flag.key
        assert f"[{flag.key}" in action.help
        kind = int if info.annotation is int else float if info.annotation is float else str
        assert action.type is kind, flag.key


def test_the_learner_takes_the_same_set_syntax_as_the_servers(capsys):
    assert cli.main(["learner", "--dry-run", "--set", "base_model=/m", "--set", "train.lr=0.5"]) == 0
    assert tomllib.loads(capsys.readouterr().out)["train"]["lr"] == 0.5
