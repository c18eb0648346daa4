"""Engines, routing policies and losses are named once: the config type, the CLI choices, the
factories and the docs all read the same registry. That `rollwire` finds its subcommands
without torch (a fresh interpreter): tests/integration/client/test_registries_cli.py."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import pytest

from rollwire.client import cli
from rollwire.generator.config import GeneratorConfig
from rollwire.generator.engines import ENGINES
from rollwire.learner.config import LearnerConfig, TrainSection
from rollwire.learner.losses import LOSSES
from rollwire.proxy.config import ProxyConfig, RoutingSection
from rollwire.proxy.policies import POLICIES, Affinity, Candidate, PrefixAware, make_policy
from rollwire.runtime.config import ConfigError, load_config
from rollwire.runtime.registry import Registry

ROOT = Path(__file__).resolve().parents[3]


def subcommand(name: str) -> argparse.ArgumentParser:
    parser = cli.build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


def choices(command: str, flag: str) -> tuple[str, ...]:
    action = next(a for a in subcommand(command)._actions if flag in a.option_strings)
    return tuple(action.choices)


# ---------------------------------------------------------------- the registry itself


def test_a_name_is_registered_once_and_a_path_is_imported_only_when_loaded():
    reg: Registry = Registry("widget")
    reg.register("lazy", "rollwire_no_such_module.anywhere:build", "never imported unless loaded")
    assert reg.names() == ("lazy",) and "lazy" in reg and reg.check("lazy") == "lazy"
    assert "rollwire_no_such_module" not in sys.modules
    with pytest.raises(ModuleNotFoundError):
        reg.load("lazy")
    with pytest.raises(ValueError, match="registered twice"):
        reg.register("lazy", len, "again")
    with pytest.raises(ValueError, match="package.module:attribute"):
        reg.register("bad", "no_colon", "a path needs module:attribute")
    with pytest.raises(ValueError, match="unknown widget 'other'; choose one of lazy"):
        reg.check("other")


def test_registered_factories_resolve_to_the_real_implementations():
    from rollwire.learner.train.grpo import clipped_loss

    assert LOSSES.load("clipped") is clipped_loss
    assert ENGINES.names()[0] == GeneratorConfig().engine  # the default is the first registered
    assert POLICIES.names()[0] == ProxyConfig().policy
    assert LOSSES.names()[0] == TrainSection().loss
    assert [e.name for e in ENGINES if not e.traits.get("runs_model", True)] == ["scripted"]


# ---------------------------------------------------------------- CLI choices and config types


def test_cli_choices_are_the_registries():
    assert choices("generator", "--engine") == ENGINES.names()
    assert choices("proxy", "--policy") == POLICIES.names()


def test_a_policy_registered_at_run_time_is_valid_config_a_cli_choice_and_buildable():
    class Last:
        name = "last"

        def choose(self, candidates, key):
            return candidates[-1]

    with pytest.raises(ConfigError, match="policy: .*unknown routing policy 'last'"):
        load_config(ProxyConfig, overrides=["policy=last"])
    POLICIES.register("last", lambda routing: Last(), "the last candidate (test only)")
    try:
        assert load_config(ProxyConfig, overrides=["policy=last"]).policy == "last"
        assert "last" in choices("proxy", "--policy")
        cands = [Candidate("a:1"), Candidate("b:1")]
        assert make_policy("last", RoutingSection()).choose(cands, b"") == cands[-1]
    finally:
        POLICIES.unregister("last")
    with pytest.raises(ValueError, match="unknown routing policy 'last'"):
        ProxyConfig(policy="last")


def test_an_engine_registered_by_path_is_valid_config_without_importing_it(tmp_path):
    ENGINES.register("elsewhere", "rollwire_no_such_engine:build", "an engine module not installed (test only)")
    try:
        config = load_config(GeneratorConfig, flags={"engine": "elsewhere", "model": str(tmp_path)})
        assert config.engine == "elsewhere" and "elsewhere" in choices("generator", "--engine")
        assert "rollwire_no_such_engine" not in sys.modules
        from rollwire.generator.app import make_engine
        from rollwire.generator.metrics import GeneratorMetrics

        with pytest.raises(ModuleNotFoundError, match="rollwire_no_such_engine"):
            make_engine(config, GeneratorMetrics())  # imported only when a replica builds it
    finally:
        ENGINES.unregister("elsewhere")
    with pytest.raises(ConfigError, match="engine: .*unknown engine 'elsewhere'; choose one of transformers"):
        load_config(GeneratorConfig, flags={"engine": "elsewhere"})


def test_a_loss_registered_at_run_time_is_valid_config():
    with pytest.raises(ConfigError, match=r"train\.loss: .*unknown loss 'mine'; choose one of clipped"):
        load_config(LearnerConfig, overrides=["base_model=/m", "train.loss=mine"])
    LOSSES.register("mine", "rollwire.learner.train.grpo:clipped_loss", "the default under another name (test only)")
    try:
        assert load_config(LearnerConfig, overrides=["base_model=/m", "train.loss=mine"]).train.loss == "mine"
    finally:
        LOSSES.unregister("mine")


def test_make_policy_tunes_the_policies_from_the_routing_section():
    policy = make_policy("affinity", RoutingSection(affinity_load_factor=2.0, affinity_min_gap=0))
    assert isinstance(policy, Affinity) and (policy.load_factor, policy.min_gap) == (2.0, 0)
    prefix = make_policy("prefix", RoutingSection(prefix_block=8, prefix_index_entries=100, affinity_min_gap=7))
    assert isinstance(prefix, PrefixAware) and (prefix.block, prefix.max_entries, prefix.min_gap) == (8, 100, 7)


# ---------------------------------------------------------------- the loss seam


def test_the_default_loss_is_policy_loss_with_the_runs_settings():
    import torch

    from rollwire.learner.losses import LossBatch
    from rollwire.learner.train.grpo import clipped_loss, policy_loss

    gen = torch.Generator().manual_seed(0)
    logp, behaviour = -torch.rand(2, 5, generator=gen), -torch.rand(2, 5, generator=gen)
    adv, ref = torch.tensor([[1.0] * 5, [-2.0] * 5]), -torch.rand(2, 5, generator=gen)
    mask = torch.tensor([[1.0, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    cfg = TrainSection(clip_low=0.1, clip_high=0.3, ratio_cap=3.0, kl_coef=0.2)
    got = clipped_loss(LossBatch(logp, behaviour, adv, mask, ref, 11.0), cfg)
    want = policy_loss(
        logp,
        behaviour,
        adv,
        mask,
        clip_low=0.1,
        clip_high=0.3,
        ratio_cap=3.0,
        ref_logp=ref,
        kl_coef=0.2,
        normaliser=11.0,
    )
    assert float(got.loss) == float(want.loss)
    assert (got.tokens, got.clipped, got.truncated, got.kl_sum) == (
        want.tokens,
        want.clipped,
        want.truncated,
        want.kl_sum,
    )


def test_the_trainer_steps_with_the_loss_named_in_its_config(tiny_model):
    from rollwire.learner.rollouts.groups import ScoredGroup, ScoredSample
    from rollwire.learner.tasks.task import Example
    from rollwire.learner.train.grpo import clipped_loss
    from rollwire.learner.train.trainer import Trainer

    calls = []

    def recorded(batch, cfg):
        calls.append(batch.normaliser)
        return clipped_loss(batch, cfg)

    def batch():
        samples = [
            ScoredSample([40 + i, 41, 2], [-1.0] * 3, [1, 1, 1], "x", "eos", float(i % 2), False) for i in range(4)
        ]
        return [ScoredGroup(Example(0, "p", "a"), [10, 11, 12], samples, 1)]

    LOSSES.register("recorded", recorded, "the default loss, recording its calls (test only)")
    try:
        stats = {}
        for loss in ("clipped", "recorded"):
            cfg = TrainSection(lr=1e-2, groups_per_step=1, loss=loss)
            stats[loss] = Trainer(tiny_model, cfg, 1.0, seed=0).step(batch(), version=1)
    finally:
        LOSSES.unregister("recorded")
    assert calls == [12.0]  # one micro-batch, normalised by the step's 4 x 3 completion tokens
    assert stats["recorded"].loss == stats["clipped"].loss and stats["recorded"].grad_norm == stats["clipped"].grad_norm


# ---------------------------------------------------------------- the docs list what is registered


def table_names(text: str, header: str) -> list[str]:
    """The `name` cells of the markdown table whose header row starts with `| header |`."""
    rows = text.split(f"| {header} |", 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    return [re.match(r"\| `([^`]+)`", row).group(1) for row in rows]


def test_the_docs_list_exactly_the_registered_names():
    engines = (ROOT / "docs/engines.md").read_text()
    assert table_names(engines, "engine") == list(ENGINES.names())
    learner = (ROOT / "docs/learner.md").read_text()
    assert table_names(learner, "train.loss") == list(LOSSES.names())
    deploy = (ROOT / "docs/deploy.md").read_text()
    assert table_names(deploy, "policy") == list(POLICIES.names())
    readme = (ROOT / "README.md").read_text()
    listed = re.search(r"--policy ([a-z\\|-]+)\]", readme).group(1).split("\\|")
    assert listed == list(POLICIES.names())


# ---------------------------------------------------------------- subcommands from entry points


def test_subcommands_come_from_entry_points_and_the_sdk_names_no_server_module():
    assert {ep.name for ep in cli.command_entry_points()} >= {"generator", "proxy", "model", "learner"}
    parser = cli.build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert {"generate", "push-adapter", "status", "generator", "proxy", "model", "learner"} <= set(action.choices)
    source = (ROOT / "client/rollwire/client/cli.py").read_text()
    assert not re.search(r"rollwire\.(generator|proxy|learner|demo|serving)\b", source)
