"""Channels to a rollwire server: TLS, channel options, call metadata, timeouts.

Invariants:
- every SDK channel carries rollwire's keepalive (a silent server is noticed within its bound)
  and message limits far above any sane prompt, status or chunk;
- pushes go on channels of their own (`push=True`): a TCP connection that only pushes fill,
  whose ping deadline is the push one (keepalive.for_pushes), so a ping that queues behind
  the push's bytes on a thin uplink does not end the push, and no rollout or status call
  waits behind them;
- a `dns:///` target is balanced round robin over every address the name resolves to;
- the bearer token goes in the metadata of every call, never in a channel option.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from rollwire.common.errors import RequestError
from rollwire.common.errors import finite_number as _float
from rollwire.common.keepalive import DEFAULT as DEFAULT_KEEPALIVE
from rollwire.common.keepalive import Keepalive, for_pushes

MAX_MESSAGE_BYTES = 256 << 20
"""Message size limit of SDK channels: far above any sane prompt, status or chunk."""


@dataclass(frozen=True)
class TlsConfig:
    """TLS for a channel: server roots, optional client cert+key for mutual TLS (PEM bytes)."""

    root_certificates: bytes | None = None
    """PEM roots that sign the server certificate; None trusts the system roots."""
    certificate_chain: bytes | None = None
    """Client certificate for mutual TLS; needs private_key."""
    private_key: bytes | None = None
    server_name: str | None = None
    """Name to check the server certificate against, when it differs from the target host."""

    def __post_init__(self) -> None:
        if (self.certificate_chain is None) != (self.private_key is None):
            raise RequestError("mutual TLS needs both a client certificate and its private key")

    @classmethod
    def from_files(
        cls,
        root: str | Path | None = None,
        cert: str | Path | None = None,
        key: str | Path | None = None,
        server_name: str | None = None,
    ) -> TlsConfig:
        def read(path: str | Path | None) -> bytes | None:
            return None if path is None else Path(path).read_bytes()

        return cls(read(root), read(cert), read(key), server_name)


_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
GRPC_SCHEMES = ("dns", "unix", "unix-abstract", "vsock", "xds")
"""Target schemes gRPC resolves itself; any other `SCHEME://` is a URL, not a gRPC target."""


def check_target(target: str) -> str:
    if not isinstance(target, str) or not target.strip():
        raise RequestError(f"target must be an address like host:port, got {target!r}")
    url = _URL.match(target.strip())
    if url and url[1].lower() not in GRPC_SCHEMES:
        raise RequestError(
            f"target {target!r} is a URL; rollwire's clients speak gRPC: give HOST:PORT of a proxy's or generator's "
            f"gRPC port, without {url[1]}:// (an http:// address is the proxy's HTTP door, for HTTP clients)"
        )
    return target


def open_channel(
    target: str,
    tls: TlsConfig | bool | None,
    api: Any = grpc,
    keepalive: Keepalive = DEFAULT_KEEPALIVE,
    push: bool = False,
) -> Any:
    """A channel from `api` (the grpc module, or grpc.aio) with rollwire's options: keepalive
    (a silent server is noticed within `keepalive.bound_s`), quick reconnects, and for a
    `dns:///` target round-robin balancing over every address the name resolves to. `push`:
    a channel for adapter pushes, on a connection of its own with the push ping deadline."""
    check_target(target)
    pings = keepalive.channel_options()
    options: list[tuple[str, int | str]] = [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        *(for_pushes(pings) if push else pings),
    ]
    if push:
        options.append(("grpc.use_local_subchannel_pool", 1))
    if target.startswith("dns:"):
        options.append(("grpc.lb_policy_name", "round_robin"))
    if tls is None or tls is False:
        return api.insecure_channel(target, options=options)
    config = TlsConfig() if tls is True else tls
    if config.server_name:
        options.append(("grpc.ssl_target_name_override", config.server_name))
    credentials = grpc.ssl_channel_credentials(config.root_certificates, config.private_key, config.certificate_chain)
    return api.secure_channel(target, credentials, options=options)


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Metadata sent on every call: the bearer token, when there is one."""
    if not token:
        return ()
    if any(c.isspace() for c in token):
        raise RequestError("the bearer token must not contain whitespace")
    return (("authorization", f"Bearer {token}"),)


def check_timeout(timeout: float | None, default: float) -> float:
    value = default if timeout is None else timeout
    if _float("timeout", value) <= 0:
        raise RequestError(f"timeout must be > 0 seconds, got {value}")
    return float(value)
