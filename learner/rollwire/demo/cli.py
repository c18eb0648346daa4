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
    zoo = sub.add_parser(
        "zoo",
        help="build tiny random models of common architectures with a byte-level BPE tokenizer",
        description="Build tiny random models (llama, qwen2, qwen3, mistral, gemma2, gemma3_text, phi3, olmo2, gpt2, "
        "gpt_neox, qwen3_moe, mixtral) into OUT_DIR/<arch>, sharing one byte-level BPE tokenizer trained locally "
        "with a ChatML chat template: to try an architecture, its adapters and its tokenization without a hub.",
    )
    zoo.add_argument("out_dir", help="folder to write (created if missing); each model in OUT_DIR/<arch>")
    zoo.add_argument("--arch", action="append", default=None, help="one architecture (repeatable; default: all)")
    zoo.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    zoo.set_defaults(func=run_model_zoo)


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


def run_model_zoo(args: argparse.Namespace) -> int:
    from rollwire.common.fingerprint import model_fingerprint
    from rollwire.demo.zoo import ARCHITECTURES, build_zoo

    unknown = sorted(set(args.arch or ()) - set(ARCHITECTURES))
    if unknown:
        print(f"unknown architecture {', '.join(unknown)}; the zoo has {', '.join(ARCHITECTURES)}")
        return 2
    for arch, out in build_zoo(args.out_dir, args.arch, args.seed).items():
        print(f"built {arch}: {out} (fingerprint {model_fingerprint(out)})")
    return 0
