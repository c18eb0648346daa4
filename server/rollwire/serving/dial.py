"""How one rollwire server dials another over grpc.aio: channels from a link's credentials.

The settings and their reading live in rollwire.runtime.dialing (DialSection, dial_credentials),
shared with the learner; here a link's credentials become channel credentials, per-call
metadata (the bearer token) and channel options.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from rollwire.common.keepalive import DEFAULT as DEFAULT_KEEPALIVE
from rollwire.common.keepalive import Keepalive, for_pushes
from rollwire.runtime.dialing import DialSection, dial_credentials

MESSAGE_OPTIONS = (
    ("grpc.max_receive_message_length", 8 << 20),
    ("grpc.max_send_message_length", 8 << 20),
)
"""Room for a push's chunks and a GetStatus of many adapters, on every server-to-server link.
Keepalive and reconnect timing come from rollwire.common.keepalive: a peer that restarts at the
same address is dialled again within a second, and one that goes silent without closing its
connection has its streams ended within the keepalive bound."""


@dataclass(frozen=True)
class Dialer:
    """Credentials (None = plaintext), per-call metadata and channel options for one kind of link."""

    credentials: grpc.ChannelCredentials | None = None
    metadata: tuple[tuple[str, str], ...] = ()
    options: list = field(default_factory=lambda: [*MESSAGE_OPTIONS, *DEFAULT_KEEPALIVE.channel_options()])

    @classmethod
    def from_config(
        cls,
        section: DialSection,
        setting: str,
        keepalive: Keepalive = DEFAULT_KEEPALIVE,
        inherit: tuple[DialSection, str] | None = None,
    ) -> Dialer:
        """The link configured as `setting` (runtime.dialing.dial_credentials); raises SystemExit."""
        found = dial_credentials(section, setting, inherit)
        options: list = [*MESSAGE_OPTIONS, *keepalive.channel_options()]
        if found.server_name:
            options.append(("grpc.ssl_target_name_override", found.server_name))
        if not found.tls:
            return cls(None, found.metadata, options)
        credentials = grpc.ssl_channel_credentials(found.root_certificates, found.private_key, found.certificate_chain)
        return cls(credentials, found.metadata, options)

    def channel(self, address: str, bulk: bool = False, interceptors: list | None = None) -> grpc.aio.Channel:
        """A channel to `address`. `bulk` gives it a TCP connection of its own (a local
        subchannel pool) for adapter pushes: megabytes queued in one connection's socket
        buffers delay every frame behind them, so health checks, status calls and rollout
        streams keep a connection that pushes never fill. Its ping deadline is longer
        (keepalive.for_pushes): a ping there waits behind the push bytes already queued.
        `interceptors` see every call (runtime.members.MemberToken swaps a member's credential)."""
        options = [*for_pushes(self.options), ("grpc.use_local_subchannel_pool", 1)] if bulk else self.options
        if self.credentials is None:
            return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
        return grpc.aio.secure_channel(address, self.credentials, options=options, interceptors=interceptors)


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
