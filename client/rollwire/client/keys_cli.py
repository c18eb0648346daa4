"""`rollwire keys`: signing keys for adapter versions (rollwire.common.signing, docs/security.md).

- `generate`: a new Ed25519 key in a file readable by its owner only, and its trust-file entry
  (printed, or added to `--trust-file`);
- `sign`: the signature file of a PEFT folder for a version loaded through the HTTP door
  (`rollwire-signature.json` beside adapter_config.json): the door builds the manifest itself;
- `verify`: does a folder's signature file verify under a trust file, for the manifest the door
  would build? The SDK's pushes sign with `signing_key=`, the CLI's with `push-adapter --signing-key`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rollwire.common.signing import SIGNATURE_FILE, KeyFileError, SignatureFile, SigningKey, TrustedKeys


def add_keys(commands: Any, usage_error: type[Exception], positive: Any) -> None:
    """Add `rollwire keys` and its subcommands; `usage_error` is the CLI's exit-2 error."""
    p = commands.add_parser("keys", help="make signing keys and sign adapter folders (docs/security.md)")
    sub = p.add_subparsers(dest="keys_command", metavar="KEYS_COMMAND", required=True)
    g = sub.add_parser("generate", help="write a new signing key and print its trust-file entry")
    g.add_argument("--id", required=True, help="the key's id, as receivers' trust files name it (1-64 characters)")
    g.add_argument("--out", required=True, metavar="FILE", help="the new key file (never overwritten; mode 0600)")
    g.add_argument(
        "--trust-file", metavar="FILE", help="also add the public key to this trust file (created if absent)"
    )
    s = sub.add_parser("sign", help="write PEFT_DIR/rollwire-signature.json for an HTTP load of NAME-vV")
    _manifest_args(s, positive)
    s.add_argument("--signing-key", required=True, metavar="FILE", help="the key file (`rollwire keys generate`)")
    v = sub.add_parser("verify", help="check PEFT_DIR's signature file against a trust file")
    _manifest_args(v, positive, signed=False)
    v.add_argument("--trust-file", required=True, metavar="FILE", help="trusted keys, as receivers' trust.keys_file")
    for parser, run in ((g, _generate), (s, _sign), (v, _verify)):
        parser.set_defaults(func=lambda args, run=run: _guard(run, args, usage_error))


def _manifest_args(p: argparse.ArgumentParser, positive: Any, *, signed: bool = True) -> None:
    if signed:
        p.add_argument("--name", required=True, help="the adapter name the version is published under")
        p.add_argument("--version", required=True, type=positive(int), metavar="V", help="the version, >= 1")
    base = p.add_mutually_exclusive_group(required=True)
    base.add_argument("--base-model", metavar="DIR", help="local base model folder to fingerprint")
    base.add_argument("--base-fingerprint", metavar="FP", help="the fleet's base model fingerprint (`rollwire status`)")
    p.add_argument("peft_dir", metavar="PEFT_DIR", help="folder written by PEFT's save_pretrained")


def _guard(run: Any, args: argparse.Namespace, usage_error: type[Exception]) -> int:
    try:
        return run(args)
    except KeyFileError as exc:
        raise usage_error(str(exc)) from None


def _generate(args: argparse.Namespace) -> int:
    key = SigningKey.generate(args.id)
    try:
        key.save(args.out)
    except FileExistsError:
        raise KeyFileError(f"{args.out!r} exists; a key file is never overwritten, choose another path") from None
    entry = key.trust_entry()
    if args.trust_file:
        path = Path(args.trust_file)
        doc = json.loads(path.read_text()) if path.exists() else {"keys": []}
        if any(k.get("id") == key.key_id for k in doc.get("keys", [])):
            raise KeyFileError(f"{args.trust_file!r} already trusts a key with id {key.key_id!r}; choose another id")
        doc.setdefault("keys", []).append(entry)
        path.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"key {key.key_id!r} written to {args.out}; its public key added to {args.trust_file}")
    else:
        print(json.dumps(entry))
    return 0


def _manifest(args: argparse.Namespace, name: str, version: int) -> Any:
    from rollwire.client._push import build_manifest, read_peft_dir
    from rollwire.common.fingerprint import model_fingerprint

    adapter = read_peft_dir(args.peft_dir)
    fingerprint = args.base_fingerprint or model_fingerprint(args.base_model)
    manifest = build_manifest(name, version, adapter.payload, adapter.lora, fingerprint)
    manifest.blake3 = ""  # a signature file covers what a proxy's HTTP upload rebuilds: no BLAKE3 (docs/protocol.md)
    return manifest


def _sign(args: argparse.Namespace) -> int:
    from rollwire.common.signing import sign

    manifest = sign(_manifest(args, args.name, args.version), SigningKey.load(args.signing_key))
    out = Path(args.peft_dir) / SIGNATURE_FILE
    out.write_text(SignatureFile.of(manifest).to_json())
    print(
        f"{out}: {manifest.name} v{manifest.version} (sha256 {manifest.sha256[:12]}...) signed by {manifest.signer!r}"
    )
    return 0


def _verify(args: argparse.Namespace) -> int:
    signed = SignatureFile.parse((Path(args.peft_dir) / SIGNATURE_FILE).read_bytes())
    manifest = signed.apply(_manifest(args, signed.name, signed.version))
    TrustedKeys.load(args.trust_file).check(manifest, holder="trust file")
    print(f"{manifest.name} v{manifest.version} (sha256 {manifest.sha256[:12]}...) is signed by {manifest.signer!r}")
    return 0
