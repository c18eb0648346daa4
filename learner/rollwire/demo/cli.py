"""`rollwire model`: building the demo's local models (the tiny Llama, taught or not), without a
hub. Argument parsing only; torch is imported when a model is built.

Registered as the `model` entry point of the `rollwire.commands` group (pyproject.toml).
"""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
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
