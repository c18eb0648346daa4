"""`rollwire score`: teacher-forced logprobs of token sequences under a base or adapter version.

Reads the sequences as JSON (a file, or '-' for stdin): a list whose items are
`{"prompt": [ids], "continuation": [ids]}` or `[[prompt ids], [continuation ids]]`, and prints
one JSON object: the version that scored (name, version, sha256, signer), the replica, and per
sequence the logprob of each continuation token (with `--top-k`, the top tokens per position).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def add_score(
    commands: Any,
    usage_error: type[Exception],
    add_connection_args: Callable[..., None],
    client_from_args: Callable[[argparse.Namespace], Any],
    adapter_arg: Callable[[str], Any],
) -> None:
    """Add `rollwire score`; `usage_error` is the CLI's exit-2 error."""
    p = commands.add_parser(
        "score",
        help="teacher-forced logprobs of token sequences under a version",
        description="Print the logprob of each continuation token of each sequence (the model's raw log-softmax, "
        "temperature 1, untruncated) under the base model or an adapter version, as JSON.",
    )
    add_connection_args(p, timeout=120.0)
    p.add_argument(
        "sequences",
        metavar="FILE",
        help='JSON list of {"prompt": [ids], "continuation": [ids]} (or [prompt, continuation] pairs); - for stdin',
    )
    p.add_argument("--adapter", type=adapter_arg, metavar="NAME[@V]", help="adapter version (default: base model)")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="also print the K most likely tokens per position")

    def run(args: argparse.Namespace) -> int:
        sequences = read_sequences(args.sequences, usage_error)
        with client_from_args(args) as client:
            result = client.score(sequences, adapter=args.adapter, top_k=args.top_k)
        out: dict[str, Any] = {
            "adapter": result.adapter,
            "version": result.version,
            "sha256": result.sha256,
            "signer": result.signer,
            "replica": result.replica,
            "logprobs": result.logprobs,
        }
        if args.top_k:
            out["top_ids"], out["top_logprobs"] = result.top_ids, result.top_logprobs
        print(json.dumps(out))
        return 0

    p.set_defaults(func=run)


def read_sequences(path: str, usage_error: type[Exception]) -> list[tuple[list[int], list[int]]]:
    """The (prompt, continuation) pairs of a JSON file (or stdin); usage_error naming what is wrong."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
        data = json.loads(text)
    except OSError as exc:
        raise usage_error(f"cannot read {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise usage_error(f"{path} is not JSON: {exc}") from None
    if not isinstance(data, list) or not data:
        raise usage_error(f"{path} must hold a non-empty JSON list of sequences")
    pairs = []
    for i, item in enumerate(data):
        if isinstance(item, dict) and set(item) == {"prompt", "continuation"}:
            pairs.append((item["prompt"], item["continuation"]))
        elif isinstance(item, list) and len(item) == 2:
            pairs.append((item[0], item[1]))
        else:
            raise usage_error(
                f'sequence {i} of {path} is neither {{"prompt": [...], "continuation": [...]}} nor a pair'
            )
    return pairs
