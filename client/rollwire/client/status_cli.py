"""`rollwire status`: what a generator or proxy serves and how busy it is, and the last proof of each
version on each replica (docs/protocol.md, "Proof"); `--prove` has a proxy re-check them first."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any


def add_status(
    commands: Any,
    add_connection_args: Callable[..., None],
    client_from_args: Callable[[argparse.Namespace], Any],
    connection_of: Callable[[argparse.Namespace], tuple[Any, str | None]],
) -> None:
    """Add `rollwire status`; `connection_of(args)` is the CLI's (TLS, token) of the connection arguments."""
    p = commands.add_parser("status", help="show what a generator or proxy serves and how busy it is")
    add_connection_args(p, timeout=10.0)
    p.add_argument("--json", action="store_true", help="print the GetStatusResponse as JSON")
    p.add_argument(
        "--prove",
        action="store_true",
        help="first have the proxy re-check every version's probe on every replica now (AdminService.ProveAdapters; "
        "needs an admin token; docs/protocol.md, 'Proof')",
    )
    p.set_defaults(func=lambda args: cmd_status(args, client_from_args, connection_of))


def cmd_status(
    args: argparse.Namespace,
    client_from_args: Callable[[argparse.Namespace], Any],
    connection_of: Callable[[argparse.Namespace], tuple[Any, str | None]],
) -> int:
    if args.prove:
        _prove(args, *connection_of(args))
    with client_from_args(args) as client:
        status = client.get_status()
    if args.json:
        from google.protobuf.json_format import MessageToDict

        data = MessageToDict(status, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
        print(json.dumps(numbers_as_numbers(status, data), indent=2))
    else:
        print(format_status(status))
    return 0


def _prove(args: argparse.Namespace, tls: Any, token: str | None) -> None:
    """ProveAdapters on the proxy at --target (the first of several), within --timeout."""
    import grpc

    from rollwire.client._channels import call_metadata, open_channel
    from rollwire.common.errors import from_rpc_error
    from rollwire.v1 import admin_pb2, admin_pb2_grpc

    channel = open_channel(str(args.target).split(",")[0], tls)
    try:
        stub = admin_pb2_grpc.AdminServiceStub(channel)
        metadata = call_metadata(token)
        stub.ProveAdapters(admin_pb2.ProveAdaptersRequest(), timeout=args.timeout, metadata=metadata)
    except grpc.RpcError as exc:
        raise from_rpc_error(exc) from None  # type: ignore[arg-type]  # a call's error is also its status
    finally:
        channel.close()


def numbers_as_numbers(message: Any, data: Any) -> Any:
    """`data` (MessageToDict of `message`) with its 64-bit integers as JSON numbers, not the
    strings protobuf's JSON mapping writes for them (versions, byte counts), for jq."""
    from google.protobuf.descriptor import FieldDescriptor as F

    wide = (F.CPPTYPE_INT64, F.CPPTYPE_UINT64)
    for field in message.DESCRIPTOR.fields:
        if field.name not in data:
            continue
        value, repeated = getattr(message, field.name), field.is_repeated
        if field.cpp_type in wide:
            data[field.name] = [int(v) for v in value] if repeated else int(value)
        elif field.cpp_type == F.CPPTYPE_MESSAGE and not field.message_type.GetOptions().map_entry:
            items = zip(value, data[field.name], strict=True) if repeated else [(value, data[field.name])]
            for sub, sub_data in items:
                numbers_as_numbers(sub, sub_data)
    return data


def format_status(status: Any) -> str:
    """A GetStatusResponse as a readable report."""
    lim = status.limits
    proxy = status.role == "proxy"
    rows = [
        ["role", status.role],
        ["proxy id" if proxy else "replica", status.replica],
        ["engines" if proxy else "engine", status.engine],
        ["server version", status.server_version],
        ["model fingerprint", status.model_fingerprint],
        ["in flight", str(status.in_flight)],
        ["queue depth", str(status.queue_depth)],
        [
            "limits",
            f"max_n={lim.max_n} max_new_tokens={lim.max_new_tokens} max_prompt_tokens={lim.max_prompt_tokens} "
            f"max_context={lim.max_context or '?'} "
            f"max_adapter_bytes={lim.max_adapter_bytes} adapter_window={lim.adapter_window}",
        ],
    ]
    parts = [table(None, rows), "", "adapters:"]
    adapters = [[a.name, _versions(a.versions), _signers(a.versions, a.signers)] for a in status.adapters]
    parts.append(_indent(table(["NAME", "VERSIONS", "SIGNED BY"], adapters)) if adapters else "  (none)")
    if proxy and not status.replicas:
        parts += ["", "replicas: (listed for an admin token only)"]
    if status.replicas:
        header = ["ADDRESS", "REPLICA", "HEALTHY", "DRAINING", "IN FLIGHT", "ADAPTERS", "DETAIL"]
        replicas = [
            [
                r.address,
                r.replica,
                _yes(r.healthy),
                _yes(r.draining),
                str(r.in_flight),
                " ".join(f"{a.name}@{_versions(a.versions)}" for a in r.adapters) or "-",
                r.detail,
            ]
            for r in status.replicas
        ]
        parts += ["", "replicas:", _indent(table(header, replicas))]
    proofs = _proof_rows(status)
    if proofs:
        header = [
            "REPLICA",
            "ADAPTER",
            "VERSION",
            "DIGEST",
            "SIGNER",
            "PROOF",
            "MAX |DLOGPROB|",
            "WHERE",
            "PROVED",
            "AGAINST",
        ]
        parts += ["", "proofs:", _indent(table(header, proofs))]
    return "\n".join(parts)


def _proof_rows(status: Any) -> list[list[str]]:
    """The last proof of each version, per replica (a replica's own at commit; a proxy's re-checks),
    with the version's digest and signer (a proxy's from its spool)."""
    import time

    digests = {(a.name, v): d for a in status.adapters for v, d in a.digests.items()}
    signers = {(a.name, v): k for a in status.adapters for v, k in a.signers.items()}
    owners = [(r.replica or r.address, r.adapters) for r in status.replicas] or [(status.replica, status.adapters)]
    rows = []
    for owner, adapters in owners:
        for a in adapters:
            for v, p in sorted(a.proofs.items()):
                age = max(0.0, time.time() - p.proved_at)
                rows.append(
                    [
                        owner,
                        a.name,
                        str(v),
                        (a.digests.get(v) or digests.get((a.name, v), ""))[:12] or "-",
                        a.signers.get(v) or signers.get((a.name, v), "") or "-",
                        p.outcome,
                        f"{p.max_abs_gap:.3g} (tol {p.tolerance:g})",
                        p.where or "-",
                        f"{age:.0f}s ago",
                        p.reference or "-",
                    ]
                )
    return rows


def _versions(versions: Iterable[int]) -> str:
    return ",".join(map(str, versions)) or "-"


def _signers(versions: Iterable[int], signers: Mapping[int, str]) -> str:
    """Who signed which version (docs/security.md): the key when one key signed every version,
    else "v:key" for each signed one; "-" when none is signed."""
    keys = {signers.get(v, "") for v in versions}
    if len(keys) == 1 and "" not in keys:
        return keys.pop()
    return ",".join(f"{v}:{k}" for v, k in sorted(signers.items())) or "-"


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())


def table(header: list[str] | None, rows: list[list[str]]) -> str:
    all_rows = ([header] if header else []) + rows
    widths = [max(len(row[i]) for row in all_rows) for i in range(len(all_rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in all_rows)
