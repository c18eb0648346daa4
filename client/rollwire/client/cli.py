"""The `rollwire` command: one console script, a subcommand per process.

Startup imports grpc and the stubs only. The SDK's own commands (generate, push-adapter,
status) are here, `keys`, `score` and `status` in keys_cli.py, score_cli.py and status_cli.py; every other command comes from an entry point in the
`rollwire.commands` group (pyproject.toml's `[project.entry-points."rollwire.commands"]`):
a `register(subparsers)` function that imports nothing heavy, so `--help` answers fast and
never imports torch, and the SDK names no server or learner module; its module may declare
SUMMARY, its line in `rollwire --help`, which then lists it without registering it. Every subcommand is
`func(args) -> int`. Exit codes: 0 done, 1 an error status (printed as
`error: CODE: message`), 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from importlib import import_module
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Any, TextIO

from rollwire.client._channels import TlsConfig
from rollwire.client._push import PeftAdapter, PushResult, read_peft_dir
from rollwire.client._requests import DEFAULT_MAX_NEW_TOKENS, GenerateOptions, build_generate_request, parse_adapter
from rollwire.client._results import GenerateResult, GroupAccumulator, Restarted, Started, StreamEvent, Tokens
from rollwire.client.keys_cli import add_keys
from rollwire.client.score_cli import add_score
from rollwire.client.status_cli import add_status, format_status, numbers_as_numbers, table
from rollwire.client.sync import Client
from rollwire.common.errors import RequestError, RollwireError
from rollwire.common.secrets import SecretFileError, read_secret_file
from rollwire.common.signing import KeyFileError, SigningKey

COMMANDS_GROUP = "rollwire.commands"
"""Entry-point group whose `register(subparsers)` functions add the other packages' commands."""


class UsageError(Exception):
    """Bad usage found after parsing (a missing file, no fingerprint); exits 2."""


# ---------------------------------------------------------------- entry point


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, dispatch to `args.func`, and map failures to exit codes."""
    words = sys.argv[1:] if argv is None else argv
    args = build_parser(_entry_point_named(words), summaries=list(words[:1]) in (["-h"], ["--help"])).parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RequestError as exc:  # refused before sending: the usage was wrong
        print(f"error: {exc.code.name}: {exc.message}", file=sys.stderr)
        return 2
    except RollwireError as exc:
        print(f"error: {exc.code.name}: {exc.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def build_parser(command: str | None = None, *, summaries: bool = False) -> argparse.ArgumentParser:
    """Every command, or with `command` (an entry point's name) the SDK's own and that one alone:
    registering a command builds its config model, which the process that runs another command
    never needs (`rollwire proxy` would build the generator's and the learner's). With
    `summaries` (for `rollwire --help`, which runs no command), an entry point whose module
    names its help line as SUMMARY is listed by it without being registered."""
    parser = argparse.ArgumentParser(prog="rollwire", description="rollout serving for asynchronous GRPO with LoRA")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_generate(commands)
    _add_push_adapter(commands)
    add_status(commands, add_connection_args, client_from_args, lambda args: (_tls(args), _read_token(args.token_file)))
    add_score(commands, UsageError, add_connection_args, client_from_args, _adapter_arg)
    add_keys(commands, UsageError, _positive)
    for entry_point in command_entry_points():
        if summaries and isinstance(summary := getattr(import_module(entry_point.module), "SUMMARY", None), str):
            commands.add_parser(entry_point.name, help=summary)
        elif command is None or entry_point.name == command:
            entry_point.load()(commands)
    return parser


def _entry_point_named(argv: Sequence[str]) -> str | None:
    """The entry point's command that `argv` runs, if it names one first (else None: a typo,
    an SDK command or a top-level --help is answered with every command registered)."""
    if argv and argv[0] in {entry_point.name for entry_point in command_entry_points()}:
        return argv[0]
    return None


def command_entry_points() -> list[EntryPoint]:
    """The installed `rollwire.commands` entry points, one per name (the first installed wins).

    Loading one imports only its command module; an ImportError inside it is a bug that must
    show, so it is not caught.
    """
    chosen: dict[str, EntryPoint] = {}
    for entry_point in entry_points(group=COMMANDS_GROUP):
        chosen.setdefault(entry_point.name, entry_point)
    return list(chosen.values())


# ---------------------------------------------------------------- shared arguments


def add_connection_args(parser: argparse.ArgumentParser, *, timeout: float) -> None:
    """--target, --timeout, --token-file and TLS flags, read back by `client_from_args`."""
    group = parser.add_argument_group("connection")
    group.add_argument(
        "--target",
        required=True,
        metavar="HOST:PORT",
        help="generator or proxy address; several proxies comma-separated (a:1,b:2), or dns:///NAME:PORT",
    )
    group.add_argument(
        "--timeout",
        type=_positive(float),
        default=timeout,
        metavar="SECONDS",
        help="deadline of the call, retries included (default %(default)g)",
    )
    group.add_argument("--token-file", metavar="FILE", help="file holding the bearer token to send")
    group.add_argument("--tls", action="store_true", help="use TLS, trusting the system roots")
    group.add_argument("--tls-ca", metavar="PEM", help="use TLS, trusting these root certificates")
    group.add_argument("--tls-cert", metavar="PEM", help="client certificate for mutual TLS")
    group.add_argument("--tls-key", metavar="PEM", help="client private key for mutual TLS")


def client_from_args(args: argparse.Namespace) -> Client:
    return Client(args.target, timeout=args.timeout, token=_read_token(args.token_file), tls=_tls(args))


def _read_token(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        return read_secret_file(path, "--token-file")
    except SecretFileError as exc:
        raise UsageError(str(exc)) from None


def _tls(args: argparse.Namespace) -> TlsConfig | None:
    if not (args.tls or args.tls_ca or args.tls_cert or args.tls_key):
        return None
    try:
        return TlsConfig.from_files(args.tls_ca, args.tls_cert, args.tls_key)
    except OSError as exc:
        raise UsageError(f"cannot read {exc.filename}: {exc.strerror}") from None


def _positive(kind: type) -> Any:
    def convert(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text} must be > 0")
        return value

    return convert


def _adapter_arg(text: str) -> Any:
    try:
        return parse_adapter(text)
    except RequestError as exc:
        raise argparse.ArgumentTypeError(exc.message) from None


# ---------------------------------------------------------------- generate


def _add_generate(commands: Any) -> None:
    p = commands.add_parser(
        "generate",
        help="sample completions of one prompt",
        description="Sample n completions of PROMPT and print them as they arrive.",
    )
    add_connection_args(p, timeout=300.0)
    p.add_argument("prompt", metavar="PROMPT", help="prompt text, '-' to read stdin, or ids with --token-ids")
    p.add_argument("-n", type=_positive(int), default=1, help="samples in the group (default %(default)s)")
    p.add_argument(
        "--max-new-tokens",
        type=_positive(int),
        metavar="N",
        help=f"most tokens per sample (default {DEFAULT_MAX_NEW_TOKENS}, or what the server's limits leave for this "
        "prompt when that is less: its max_new_tokens, and its context less the prompt)",
    )
    p.add_argument("--temperature", type=float, metavar="T", help="0 is greedy (server default 1.0)")
    p.add_argument("--top-p", type=float, metavar="P", help="nucleus mass in (0, 1]")
    p.add_argument("--top-k", type=int, metavar="K", help="keep the K most likely tokens; 0 disables")
    p.add_argument("--seed", type=int, metavar="S", help="reproducible sampling")
    p.add_argument("--stop", action="append", default=[], metavar="STR", help="stop string; repeat for several")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence")
    p.add_argument(
        "--kept-tokens",
        dest="return_kept_tokens",
        action="store_true",
        help="with --json: each token's kept set under top-k/top-p (kept_token_ids, parallel to token_ids)",
    )
    p.add_argument(
        "--routed-experts",
        dest="return_routed_experts",
        action="store_true",
        help="with --json: a MoE model's routing of each sample (routed_experts: positions x layers x top_k ids)",
    )
    p.add_argument(
        "--adapter",
        type=_adapter_arg,
        metavar="NAME@VERSION",
        help="adapter to sample from: NAME, NAME@latest or NAME@3 (default: base model)",
    )
    p.add_argument(
        "--follow",
        action="store_true",
        help="with --adapter NAME@latest: running samples switch to each newly committed version (token_versions in --json)",
    )
    p.add_argument("--group-key", default="", help="affinity routing key at a proxy")
    p.add_argument("--request-id", default="", help="id for logs across services")
    p.add_argument("--token-ids", action="store_true", help="PROMPT is token ids separated by commas or spaces")
    p.add_argument("--json", action="store_true", help="print one JSON object once the group is complete")
    p.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    prompt = _prompt(args.prompt, args.token_ids)
    # every keyword option of generate has a flag of that name (_add_generate)
    options: dict[str, Any] = {key: getattr(args, key) for key in GenerateOptions.__annotations__}
    if args.max_new_tokens is None:  # the caller's own mistakes first, before the server is asked anything
        build_generate_request(prompt, args.n, **{**options, "max_new_tokens": 1})
    with client_from_args(args) as client:
        if args.max_new_tokens is None:
            options["max_new_tokens"] = fitting_max_new_tokens(client, prompt)
        if args.json:
            print(json.dumps(result_to_json(client.generate(prompt, args.n, **options))))
        else:
            print_stream(client.generate_stream(prompt, args.n, **options), args.n, sys.stdout, sys.stderr)
    return 0


def fitting_max_new_tokens(client: Client, prompt: str | list[int]) -> int:
    """The default max_new_tokens, within what the server serves (GetStatus limits): its
    per-sample limit, and its context less the prompt (a text's tokens counted as at most its
    UTF-8 bytes, plus two for special tokens). DEFAULT_MAX_NEW_TOKENS when it does not say."""
    try:
        limits = client.get_status().limits
    except RollwireError:
        return DEFAULT_MAX_NEW_TOKENS
    most = min(DEFAULT_MAX_NEW_TOKENS, limits.max_new_tokens or DEFAULT_MAX_NEW_TOKENS)
    if limits.max_context:
        length = len(prompt) if isinstance(prompt, list) else len(prompt.encode()) + 2
        most = min(most, limits.max_context - length)
    return max(1, most)


def _prompt(text: str, as_ids: bool) -> str | list[int]:
    if text == "-":
        text = sys.stdin.read()
    if not as_ids:
        return text
    try:
        return [int(part) for part in text.replace(",", " ").split()]
    except ValueError:
        raise UsageError("with --token-ids, PROMPT must be whole numbers separated by commas or spaces") from None


def print_stream(events: Iterable[StreamEvent], n: int, out: TextIO, info: TextIO) -> GenerateResult:
    """Print a group as it arrives: one sample streams token by token, several print as they end."""
    group = GroupAccumulator(n)
    for event in events:
        sample = group.add(event)
        if isinstance(event, Started):
            print(f"[request {event.request_id} on {event.replica or '?'}, {_adapter_text(event.adapter)}]", file=info)
        elif isinstance(event, Restarted):
            out.write("\n" if n == 1 else "")
            print(f"[group restarted (attempt {event.attempt}): {event.reason}; partial output discarded]", file=info)
        elif isinstance(event, Tokens) and n == 1:
            out.write(event.text)
            out.flush()
        if sample is None:
            continue
        summary = f"{sample.finish_reason}, {sample.completion_tokens} tokens, adapter version {sample.adapter_version}"
        if n == 1:
            out.write("\n")
            print(f"[{summary}]", file=info)
        else:
            print(f"--- sample {sample.index} ({summary}) ---\n{sample.text}", file=out, flush=True)
    return group.result()


def _adapter_text(adapter: Any) -> str:
    return f"adapter {adapter}" if adapter else "base model"


def result_to_json(result: GenerateResult) -> dict[str, Any]:
    """The --json form of a complete group."""
    adapter = {"name": result.adapter.name, "version": result.adapter.version} if result.adapter else None
    samples = [
        {
            "index": s.index,
            "text": s.text,
            "token_ids": s.token_ids,
            "logprobs": s.logprobs,
            "finish_reason": s.finish_reason,
            "adapter_version": s.adapter_version,
            "token_versions": s.token_versions,
            **({"kept_token_ids": [list(k) for k in s.kept_tokens]} if s.kept_tokens else {}),
            **({"routed_experts": s.routed_experts.array().tolist()} if s.routed_experts else {}),
        }
        for s in result.samples
    ]
    return {
        "request_id": result.request_id,
        "replica": result.replica,
        "adapter": adapter,
        "prompt_token_ids": result.prompt_token_ids,
        "samples": samples,
    }


# ---------------------------------------------------------------- push-adapter


def _add_push_adapter(commands: Any) -> None:
    p = commands.add_parser(
        "push-adapter",
        help="upload a PEFT LoRA adapter as a new version",
        description="Push the adapter saved in PEFT_DIR (adapter_config.json + "
        "adapter_model.safetensors) as version V of NAME.",
    )
    add_connection_args(p, timeout=300.0)
    p.add_argument("--name", required=True, help="adapter name")
    p.add_argument("--version", required=True, type=_positive(int), metavar="V", help="version, >= 1, increasing")
    base = p.add_mutually_exclusive_group()
    base.add_argument("--base-model", metavar="DIR", help="local base model folder to fingerprint")
    base.add_argument("--base-fingerprint", metavar="FP", help="base model fingerprint, as GetStatus reports it")
    p.add_argument("--signing-key", metavar="FILE", help="sign the version with this key (`rollwire keys generate`)")
    p.add_argument("--bulk", action="store_true", help="the bytes by the receiver's bulk endpoint where offered")
    p.add_argument(
        "--probe",
        action="store_true",
        help="attach the version's behavioural proof: this adapter's own logprobs of 4 fixed sequences over the base "
        "model folder, which every replica checks before it serves the version (needs torch, transformers, peft)",
    )
    p.add_argument("peft_dir", metavar="PEFT_DIR", help="folder written by PEFT's save_pretrained")
    p.set_defaults(func=cmd_push_adapter)


def cmd_push_adapter(args: argparse.Namespace) -> int:
    adapter = read_peft_dir(args.peft_dir)
    fingerprint = base_fingerprint(adapter, args.base_model, args.base_fingerprint)
    try:
        key = SigningKey.load(args.signing_key) if args.signing_key else None
    except KeyFileError as exc:
        raise UsageError(str(exc)) from None
    probe = None
    if args.probe:
        from rollwire.client.probes import peft_probe

        probe = peft_probe(base_folder(adapter, args.base_model), args.peft_dir, args.version)
    with client_from_args(args) as client:
        result = client.push_adapter(
            args.name,
            args.version,
            adapter.payload,
            adapter.lora,
            fingerprint,
            signing_key=key,
            bulk=args.bulk,
            probe=probe,
        )
    print(format_push(result))
    if probe is not None:
        print(f"probe: {len(probe.sequences)} sequences, proved by every replica that took the version")
    return 0


def base_fingerprint(adapter: PeftAdapter, base_model: str | None, fingerprint: str | None) -> str:
    """The flag's fingerprint, else that of --base-model, else of the config's local base folder."""
    from rollwire.common.fingerprint import model_fingerprint

    if fingerprint:
        return fingerprint
    try:
        return model_fingerprint(base_folder(adapter, base_model, "or --base-fingerprint FP"))
    except FileNotFoundError as exc:
        raise UsageError(str(exc)) from None


def base_folder(adapter: PeftAdapter, base_model: str | None, other: str = "") -> str:
    """--base-model, else the config's base_model_name_or_path when it is a local folder."""
    folder = base_model
    if folder is None and adapter.base_model_name_or_path and Path(adapter.base_model_name_or_path).is_dir():
        folder = adapter.base_model_name_or_path
    if folder is None:
        raise UsageError(
            "cannot tell which base model the adapter belongs to: its base_model_name_or_path "
            f"({adapter.base_model_name_or_path!r}) is not a local folder; pass --base-model DIR {other}".rstrip()
        )
    return folder


def format_push(result: PushResult) -> str:
    state = "was already loaded" if result.already_loaded else "is loaded"
    lines = [
        f"adapter {result.name} version {result.version} {state}",
        f"loaded versions: {', '.join(map(str, result.loaded_versions)) or '-'}",
        *([f"sha256: {result.sha256}"] if result.sha256 else []),  # named by the receiver when the push left it
    ]
    if result.replicas:
        lines.append(table(["REPLICA", "CODE", "MESSAGE"], [[r.replica, r.code, r.message] for r in result.replicas]))
    return "\n".join(lines)


__all__ = ["build_parser", "format_status", "main", "numbers_as_numbers"]

if __name__ == "__main__":
    sys.exit(main())
