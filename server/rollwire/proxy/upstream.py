"""How the proxy dials its replicas: TLS credentials and a bearer token, read once at start.

The proxy checks its own clients' tokens (security.py) and never forwards them: towards the
replicas it speaks with its own token, which needs the admin role because the proxy pushes
adapters. Token values are never logged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import grpc
from pydantic import Field

from rollwire.common.config import Section
from rollwire.common.keepalive import DEFAULT as DEFAULT_KEEPALIVE
from rollwire.common.keepalive import Keepalive
from rollwire.serving.security import read_tokens

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 8 << 20),
    ("grpc.max_send_message_length", 8 << 20),
]
"""Besides keepalive and reconnect timing (rollwire.common.keepalive): a replica that restarts at
the same address is dialled again within a second, and one that goes silent without closing its
connection has its streams ended within the keepalive bound, even between two health checks."""


def channel_options(keepalive: Keepalive = DEFAULT_KEEPALIVE) -> list:
    return [*CHANNEL_OPTIONS, *keepalive.channel_options()]


class UpstreamSection(Section):
    """Credentials for replicas that require tokens or TLS."""

    token_file: str = Field(
        default="", description="File holding the bearer token sent to replicas (admin role: the proxy pushes)."
    )
    tls: bool = Field(
        default=False, description="Dial replicas over TLS (trusting the system roots unless ca_file is set)."
    )
    ca_file: str = Field(default="", description="PEM roots that sign the replicas' certificates; implies tls.")
    cert_file: str = Field(default="", description="PEM client certificate for replicas that require mutual TLS.")
    key_file: str = Field(default="", description="PEM private key of cert_file.")
    server_name: str = Field(
        default="", description="Name to check replica certificates against when it differs from their host."
    )


@dataclass(frozen=True)
class Upstream:
    credentials: grpc.ChannelCredentials | None = None
    metadata: tuple[tuple[str, str], ...] = ()
    options: list = field(default_factory=channel_options)

    @classmethod
    def from_config(cls, section: UpstreamSection, keepalive: Keepalive = DEFAULT_KEEPALIVE) -> Upstream:
        metadata = ()
        if section.token_file:
            token = sorted(read_tokens(section.token_file))[0]
            metadata = (("authorization", f"Bearer {token}"),)
        options = channel_options(keepalive)
        if section.server_name:
            options.append(("grpc.ssl_target_name_override", section.server_name))
        if not (section.tls or section.ca_file or section.cert_file):
            return cls(None, metadata, options)
        if bool(section.cert_file) != bool(section.key_file):
            raise SystemExit("upstream.cert_file and upstream.key_file go together: give both for mutual TLS")
        try:
            read = {
                k: Path(v).read_bytes() if v else None
                for k, v in (("ca", section.ca_file), ("cert", section.cert_file), ("key", section.key_file))
            }
        except OSError as exc:
            raise SystemExit(f"cannot read upstream TLS file {exc.filename}: {exc.strerror}") from None
        return cls(grpc.ssl_channel_credentials(read["ca"], read["key"], read["cert"]), metadata, options)

    def channel(self, address: str) -> grpc.aio.Channel:
        if self.credentials is None:
            return grpc.aio.insecure_channel(address, options=self.options)
        return grpc.aio.secure_channel(address, self.credentials, options=self.options)
