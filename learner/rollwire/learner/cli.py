"""`rollwire model` (and later `rollwire learner`): argument parsing only, imports stay light."""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    p = subparsers.add_parser("model", help="build local models", description="Build models locally, without a hub.")
    sub = p.add_subparsers(dest="model_command", required=True)
    tiny = sub.add_parser("tiny", help="build the tiny Llama with its character tokenizer")
    tiny.add_argument("out_dir", help="folder to write (created if missing)")
    tiny.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    tiny.set_defaults(func=run_model_tiny)


def run_model_tiny(args: argparse.Namespace) -> int:
    from rollwire.common.fingerprint import model_fingerprint
    from rollwire.learner.tiny_model import TinyModelSpec, build_tiny_model

    out = build_tiny_model(args.out_dir, TinyModelSpec(seed=args.seed))
    print(f"built {out} (fingerprint {model_fingerprint(out)})")
    return 0
