"""`rollwire learner`: argument parsing only, imports stay light (no torch).

Registered as the `learner` entry point of the `rollwire.commands` group (pyproject.toml); the
demo's `rollwire model` is rollwire.demo.cli.
"""

from __future__ import annotations

import argparse
import sys

SUMMARY = "train a LoRA adapter with asynchronous GRPO"
"""Its line in `rollwire --help`, which lists it without importing its config model."""


def register(subparsers) -> None:
    """Add `rollwire learner` (imports the config model only: pydantic, no torch)."""
    from rollwire.learner.config import LearnerConfig
    from rollwire.runtime.config import add_process_command

    p = add_process_command(
        subparsers,
        "learner",
        LearnerConfig,
        help=SUMMARY,
        description="Train a LoRA adapter with GRPO on rollouts from a proxy or generator, pushing each new version.",
        example="train.lr=5e-4",
        file_help="TOML or YAML file (see rollwire.learner.config)",
    )
    p.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="more overrides, the same as --set (applied before --set)"
    )
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in run_dir, if any")
    p.set_defaults(func=run_learner)


def run_learner(args: argparse.Namespace) -> int:
    from rollwire.learner.config import LearnerConfig
    from rollwire.runtime.config import config_for_command

    config = config_for_command(LearnerConfig, args, args.overrides)
    if isinstance(config, int):
        return config
    import asyncio

    from rollwire.learner.publish.publisher import NonFiniteWeights
    from rollwire.learner.run.loop import run_learner as run
    from rollwire.learner.run.wiring import LearnerError
    from rollwire.runtime.logs import setup_logging

    setup_logging("learner", config.log_level)
    try:
        summary = asyncio.run(run(config, resume=args.resume, ready_file=args.ready_file))
    except (LearnerError, NonFiniteWeights) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except asyncio.CancelledError:  # a second Ctrl-C: stopped without waiting for the last push
        print("learner: stopped", file=sys.stderr)
        return 130
    if config.progress and sys.stdout.isatty():
        print()
    before, after = summary["accuracy_before"], summary["accuracy_after"]
    print(
        f"learner: {summary['steps']} steps, versions {summary['first_version']}..{summary['last_version']}, "
        f"held-out accuracy {_pct(before)} -> {_pct(after)}; summary in {config.run_dir}/summary.json"
    )
    return 0


def _pct(value) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"
