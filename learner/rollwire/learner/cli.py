"""`rollwire model` and `rollwire learner`: argument parsing only, imports stay light (no torch).

Registered as the `model` and `learner` entry points of the `rollwire.commands` group
(pyproject.toml).
"""

from __future__ import annotations

import argparse
import sys


def register_model(subparsers) -> None:
    """Add `rollwire model` (building local models)."""
    p = subparsers.add_parser("model", help="build local models", description="Build models locally, without a hub.")
    sub = p.add_subparsers(dest="model_command", required=True)
    tiny = sub.add_parser(
        "tiny",
        help="build the tiny Llama with its character tokenizer",
        description="Build the tiny Llama. With --teach it is then taught the built-in addition task to a "
        "partial skill (about a minute on 2 cores; reused when OUT_DIR already holds the same build).",
    )
    tiny.add_argument("out_dir", help="folder to write (created if missing)")
    tiny.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    tiny.add_argument("--teach", action="store_true", help="teach the built-in task (partial skill) after building")
    tiny.add_argument("--teach-steps", type=int, default=None, help="supervised steps when teaching (default 1000)")
    tiny.set_defaults(func=run_model_tiny)


def register(subparsers) -> None:
    """Add `rollwire learner` (imports the config model only: pydantic, no torch)."""
    from rollwire.learner.config import LearnerConfig
    from rollwire.runtime.config import add_process_command

    p = add_process_command(
        subparsers,
        "learner",
        LearnerConfig,
        help="train a LoRA adapter with asynchronous GRPO",
        description="Train a LoRA adapter with GRPO on rollouts from a proxy or generator, pushing each new version.",
        example="train.lr=5e-4",
        file_help="TOML or YAML file (see rollwire.learner.config)",
    )
    p.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="more overrides, the same as --set (applied before --set)"
    )
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in run_dir, if any")
    p.set_defaults(func=run_learner)


def run_model_tiny(args: argparse.Namespace) -> int:
    from rollwire.common.fingerprint import model_fingerprint
    from rollwire.demo.tiny_model import TinyModelSpec, build_tiny_model

    if not args.teach:
        out = build_tiny_model(args.out_dir, TinyModelSpec(seed=args.seed))
        print(f"built {out} (fingerprint {model_fingerprint(out)})")
        return 0
    import dataclasses

    from rollwire.demo.teach import TeachSpec, build_taught_model, describe

    spec = TeachSpec()
    spec = dataclasses.replace(spec, model=dataclasses.replace(spec.model, seed=args.seed))
    if args.teach_steps is not None:
        spec = dataclasses.replace(spec, steps=args.teach_steps)
    out = build_taught_model(args.out_dir, spec, log=lambda line: print(line, flush=True))
    print(f"taught {describe(out)} (fingerprint {model_fingerprint(out)})")
    return 0


def run_learner(args: argparse.Namespace) -> int:
    from rollwire.learner.config import LearnerConfig
    from rollwire.runtime.config import config_for_command

    config = config_for_command(LearnerConfig, args, args.overrides)
    if isinstance(config, int):
        return config
    import asyncio

    from rollwire.learner.loop import run_learner as run
    from rollwire.learner.publisher import NonFiniteWeights
    from rollwire.learner.wiring import LearnerError
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
