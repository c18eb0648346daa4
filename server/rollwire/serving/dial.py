"""How one rollwire server dials another: TLS credentials, a bearer token and channel options.

Three server-to-server links exist: the proxy to its replicas (`upstream`), the proxy to its
peer proxies (`peering`, the upstream settings with two overrides) and a replica to its relay
children (`relay`). All three are built here from the same fields, read once at start: a file
that cannot be read, or a certificate without its key, stops the process with a sentence
naming the setting. Token values are never logged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from pydantic import Field

from rollwire.common.keepalive import DEFAULT as DEFAULT_KEEPALIVE
from rollwire.common.keepalive import Keepalive, for_pushes
from rollwire.runtime.config import Section

MESSAGE_OPTIONS = (
    ("grpc.max_receive_message_length", 8 << 20),
    ("grpc.max_send_message_length", 8 << 20),
)
"""Room for a push's chunks and a GetStatus of many adapters, on every server-to-server link.
Keepalive and reconnect timing come from rollwire.common.keepalive: a peer that restarts at the
same address is dialled again within a second, and one that goes silent without closing its
connection has its streams ended within the keepalive bound."""

NAME_OVERRIDE = "grpc.ssl_target_name_override"


class DialTlsSection(Section):
    """TLS towards other rollwire servers: off unless tls, ca_file or cert_file is set."""

    tls: bool = Field(default=False)
    """Dial over TLS (trusting the system roots unless ca_file is set)."""
    ca_file: str = Field(default="")
    """PEM roots that sign the servers' certificates; implies tls."""
    cert_file: str = Field(default="")
    """PEM client certificate, for servers that require mutual TLS."""
    key_file: str = Field(default="")
    """PEM private key of cert_file."""
    server_name: str = Field(default="")
    """Name to check the servers' certificates against when it differs from their host."""


def bearer(token_file: str) -> tuple[tuple[str, str], ...]:
    """The authorization metadata for the first token in `token_file` (none when it is empty)."""
    if not token_file:
        return ()
    from rollwire.runtime.security import read_tokens

    return (("authorization", f"Bearer {sorted(read_tokens(token_file))[0]}"),)


@dataclass(frozen=True)
class Dialer:
    """Credentials (None = plaintext), per-call metadata and channel options for one kind of link."""

    credentials: grpc.ChannelCredentials | None = None
    metadata: tuple[tuple[str, str], ...] = ()
    options: list = field(default_factory=lambda: [*MESSAGE_OPTIONS, *DEFAULT_KEEPALIVE.channel_options()])

    @classmethod
    def from_config(
        cls, tls: DialTlsSection, setting: str, keepalive: Keepalive = DEFAULT_KEEPALIVE, token_file: str = ""
    ) -> Dialer:
        """`setting` names the config section in errors (e.g. "upstream"); raises SystemExit."""
        options: list = [*MESSAGE_OPTIONS, *keepalive.channel_options()]
        if tls.server_name:
            options.append((NAME_OVERRIDE, tls.server_name))
        metadata = bearer(token_file)
        if not (tls.tls or tls.ca_file or tls.cert_file):
            return cls(None, metadata, options)
        if bool(tls.cert_file) != bool(tls.key_file):
            raise SystemExit(f"{setting}.cert_file and {setting}.key_file go together: give both for mutual TLS")
        try:
            ca, cert, key = (Path(f).read_bytes() if f else None for f in (tls.ca_file, tls.cert_file, tls.key_file))
        except OSError as exc:
            raise SystemExit(f"cannot read {setting} TLS file {exc.filename}: {exc.strerror}") from None
        return cls(grpc.ssl_channel_credentials(ca, key, cert), metadata, options)

    def overridden(self, server_name: str = "", token_file: str = "") -> Dialer:
        """The same link with another certificate name and/or token, where either is given."""
        options = self.options
        if server_name:
            options = [*(o for o in options if o[0] != NAME_OVERRIDE), (NAME_OVERRIDE, server_name)]
        metadata = bearer(token_file) if token_file else self.metadata
        return dataclasses.replace(self, options=options, metadata=metadata)

    def channel(self, address: str, bulk: bool = False) -> grpc.aio.Channel:
        """A channel to `address`. `bulk` gives it a TCP connection of its own (a local
        subchannel pool) for adapter pushes: megabytes queued in one connection's socket
        buffers delay every frame behind them, so health checks, status calls and rollout
        streams keep a connection that pushes never fill. Its ping deadline is longer
        (keepalive.for_pushes): a ping there waits behind the push bytes already queued."""
        options = [*for_pushes(self.options), ("grpc.use_local_subchannel_pool", 1)] if bulk else self.options
        if self.credentials is None:
            return grpc.aio.insecure_channel(address, options=options)
        return grpc.aio.secure_channel(address, self.credentials, options=options)


async def on_each_drop(channel: grpc.aio.Channel, dropped: Callable[[], None]) -> None:
    """Call `dropped` each time the channel leaves READY, until cancelled. A connection that
    drops may come back to a restarted process that lost its state (adapters, a spool), so
    whoever holds the channel checks the peer again before trusting it."""
    ready = grpc.ChannelConnectivity.READY
    state = channel.get_state(try_to_connect=True)
    while True:
        await channel.wait_for_state_change(state)
        new = channel.get_state()
        if state == ready and new != ready:
            dropped()
        state = new
