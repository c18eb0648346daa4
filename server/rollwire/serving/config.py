"""What every rollwire server process's config shares: where it binds, logs, shutdown, auth, TLS
and keepalive. GeneratorConfig and ProxyConfig extend it with their ports and their own sections,
so a setting both servers have is declared, described and bounded once."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from rollwire.common.signing import KeyFileError, TrustedKeys
from rollwire.runtime.config import ConfigError, Section
from rollwire.runtime.security import AuthSection, TlsSection
from rollwire.serving.keepalive import KeepaliveSection
from rollwire.serving.sessions import SessionSection

PROMPT_BYTES_PER_TOKEN = 32
"""A text prompt may have this many UTF-8 bytes per token a prompt may have, checked before any tokenizing: by a
replica and by the proxy for a text prompt (serving.sizes), by the proxy's HTTP door for a chat's messages before it
renders them."""


def port_field(default: int, what: str) -> Any:
    """A TCP port setting; each server gives its own default (GeneratorConfig, ProxyConfig)."""
    return Field(default=default, ge=0, le=65535, description=f"{what} port; 0 picks a free one.")


class TrustSection(Section):
    """Signed adapter versions (rollwire.common.signing): which publishers' keys a receiver trusts."""

    keys_file: str = Field(default="")
    """A JSON file of trusted Ed25519 public keys, each with an id ({"keys": [{"id": ..., "public_key": BASE64}]},
    `rollwire keys generate` prints an entry). When set, every version that reaches this server (push, relay, heal,
    catch-up, peer share, HTTP load) must be signed by one of them, or it is refused before its bytes are read. Several
    keys may be listed at once to rotate. Empty: a signature is carried when present, never required."""

    def trusted(self) -> TrustedKeys:
        """The keys, read now (at start); ConfigError naming the setting and the file when they cannot be."""
        try:
            return TrustedKeys.from_file(self.keys_file)
        except KeyFileError as exc:
            raise ConfigError(f"trust.keys_file: {exc}") from None


class BulkSection(Section):
    """The bulk path of pushes (rollwire.push.bulk, rollwire.common.bulk): push bytes over a TCP
    connection of their own per hop, the gRPC stream staying the control plane. A server is a
    receiver (it listens, when `enabled`) and, on a relay tree or the proxy, a sender (it asks a
    receiver for its endpoint only when its own sender asked). A sender whose bulk connection
    fails sends the same bytes as gRPC chunks (rollwire_push_path_total{path="grpc"})."""

    enabled: bool = Field(default=False)
    """Listen for push bytes on `port` (TLS with the server's [tls] certificates when set), and offer it to senders."""
    port: int = Field(default=0, ge=0, le=65535)
    """TCP port of the bulk listener, on the server's host; 0 picks a free one."""
    send: bool = Field(default=True)
    """As a sender, ask receivers for their bulk endpoint (false: always gRPC chunks)."""
    connect_timeout_s: float = Field(default=3.0, gt=0)
    """How long a sender waits for a bulk connection before it falls back to gRPC chunks; also how long a receiver's
    offer stays open."""
    max_connections: int = Field(default=64, ge=1, le=4096)
    """Bulk connections a receiver holds at once (open, or in their hello); more are closed at once."""
    reuse_bytes: int = Field(default=1 << 30, ge=0)
    """Bytes of bulk receive buffers no payload uses any more that a receiver keeps, to take a later push of the same
    size without faulting fresh memory in (rollwire.push.buffers.BufferPool); 0: every push maps a fresh buffer."""


class ConnectionsSection(Section):
    """The gRPC port's connections (serving.scaffold): a budget and a handshake deadline, so
    connections that never speak cannot take the process's file descriptors (audit S5)."""

    max_connections: int = Field(default=1024, ge=1, le=1_000_000)
    """Connections the gRPC server holds at once, from all peers, and never more than a quarter of the process's soft
    RLIMIT_NOFILE (read at start); one more is closed as soon as it is accepted (a client's channel retries). Calls on
    connections already open are never refused by it."""
    handshake_timeout_s: float = Field(default=5.0, gt=0, le=120)
    """Seconds a new connection has to complete its handshake (TLS, and HTTP/2's preface and settings); then it is
    closed and its slot freed (gRPC's own default is 120 s)."""


class ServerConfig(Section):
    """A gRPC server process."""

    host: str = Field(default="127.0.0.1")
    """Address the gRPC server binds; 0.0.0.0 to accept remote clients."""
    port: int = port_field(0, "gRPC")
    metrics_port: int = port_field(0, "Prometheus /metrics")
    log_level: str = Field(default="info")
    """debug, info, warning or error."""
    grace_seconds: float = Field(default=10.0, ge=0)
    """On shutdown, how long in-flight requests may finish."""
    auth: AuthSection = Field(default_factory=AuthSection)
    tls: TlsSection = Field(default_factory=TlsSection)
    keepalive: KeepaliveSection = Field(default_factory=KeepaliveSection)
    sessions: SessionSection = Field(default_factory=SessionSection)
    """Multi-turn sessions this server keeps the history of (GenerateRequest.session, docs/sessions.md)."""
    trust: TrustSection = Field(default_factory=TrustSection)
    """Signing keys whose adapter versions this server accepts (docs/security.md, signed versions)."""
    bulk: BulkSection = Field(default_factory=BulkSection)
    """The bulk path of pushes this server receives and sends (docs/protocol.md, "The bulk path")."""
    connections: ConnectionsSection = Field(default_factory=ConnectionsSection)
    """The gRPC port's connection budget and handshake deadline (docs/security.md, "Listeners")."""


def push_idle_field() -> Any:
    """The idle deadline of an incoming push (replica: limits.push_idle_timeout_s, proxy:
    spool.upload_idle_timeout_s): the same bound on both servers, declared here once."""
    return Field(
        default=30.0,
        gt=0,
        description="A push that sends no message for this long is cancelled with DEADLINE_EXCEEDED.",
    )


class PushLimits(Section):
    """What an incoming push may carry, checked alike by the proxy (spool) and every replica (limits)."""

    max_adapter_bytes: int = Field(default=1 << 30, ge=1)
    """Largest adapter payload accepted; a larger one is refused before any byte."""
    max_version_step: int = Field(default=1_000_000, ge=1)
    """A pushed version may be at most this far above the newest of its name (0 for a new name)."""
    upload_timeout_s: float = Field(default=60.0, gt=0, le=86400)
    """The total deadline of an incoming push, from its manifest to its last byte, is this plus its size at
    `min_upload_bytes_per_s`; past it the push is refused (DEADLINE_EXCEEDED, PUSH_TOO_SLOW) and what it held (spool
    room, push slots, its relay's streams) is freed, however steadily it trickles."""
    min_upload_bytes_per_s: float = Field(default=1 << 20, gt=0)
    """The slowest rate an incoming push may keep on average (see upload_timeout_s); 1 MiB/s by default, so a 1 GiB
    adapter has 60 s + 17 min."""

    def upload_deadline_s(self, size: int) -> float:
        """How long a push of `size` bytes may take in all, from its manifest."""
        return self.upload_timeout_s + size / self.min_upload_bytes_per_s


class ForwardSection(Section):
    """How a node of a relay tree feeds its children (push/forward.py): the proxy at the root
    (push.*) and every relaying replica (relay.*). A child cut off is healed by the proxy."""

    queue_chunks: int = Field(default=8, ge=1)
    """Chunks queued per child before the sender waits for it."""
    stall_timeout_s: float = Field(default=3.0, gt=0)
    """A child that takes no chunk for this long is cut off; the proxy sends its subtree the bytes again (healing),
    within health.push_timeout_s. Before its first chunk (its call still being set up) the limit is the longer of this
    and settle_timeout_s."""
    settle_timeout_s: float = Field(default=10.0, gt=0)
    """Per level of its subtree (plus one): how long after the last chunk a child may take to verify, stage and answer
    before it is cut off and healed (a replica's relay.settle_timeout_s should not exceed the proxy's
    push.settle_timeout_s)."""
