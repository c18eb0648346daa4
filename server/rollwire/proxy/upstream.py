"""How the proxy dials its replicas: the `upstream` section (a DialSection), built into a Dialer (serving/dial.py).

The proxy checks its own clients' tokens (security.py) and never forwards them: towards the
replicas it speaks with its own token, which needs the admin role because the proxy pushes
adapters. The streams of a relay tree carry `relay_token_file`'s token instead when it is set
(the `relay` role: it can only stage), so the replicas pass on a token that can do nothing
but relay, and every node of a plan carries the proxy's grant, keyed from its admin token
(push.plan.relay_grant), so a replica relays only to the members this proxy planned. Peer proxies
are dialled with the same settings, each one the `peering` section sets taking precedence.
A replica that registered itself with a `register` token is never sent token_file's (admin) token:
it gets its member token (runtime/members.py) instead; with member_signing_key_file no member is:
each gets the proxy's signature of its own address.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from pydantic import Field

from rollwire.common.keepalive import DEFAULT as DEFAULT_KEEPALIVE
from rollwire.common.keepalive import Keepalive
from rollwire.push.plan import grant_key
from rollwire.runtime.dialing import DialSection, bearer, read_token
from rollwire.serving.dial import Dialer


class UpstreamSection(DialSection):
    """Credentials for replicas that require tokens or TLS; the token needs the admin role (the proxy pushes)."""

    relay_token_file: str = Field(default="")
    """File holding the token the proxy's relayed (stage_only) pushes carry: the `relay` role on the replicas, which
    they pass on down the tree; empty = token_file, which the replicas then do not pass on (set relay.token_file
    on them, or this)."""
    member_key_file: str = Field(default="")
    """The fleet key (the replicas' auth.member_key_file): a replica proves its address with it to register, and
    without member_signing_key_file, a replica a `register` token adds is dialled with a token derived from it and its
    own address, never token_file's; empty = this proxy refuses registrations by `register` tokens."""
    member_signing_key_file: str = Field(default="")
    """An Ed25519 signing key file (`rollwire keys generate`; its public key in the replicas' auth.member_trust_file):
    every member, static, discovered and registered alike, is dialled with its own token, this key's signature of its
    HOST:PORT, never token_file's, and a replica holding only the public key can mint no other's (docs/deploy.md,
    Credentials); empty = static and discovered members get token_file's, registered ones a fleet-key token."""


def upstream_dialer(section: UpstreamSection, keepalive: Keepalive = DEFAULT_KEEPALIVE) -> Dialer:
    """The proxy's link to its replicas; raises SystemExit naming a setting it cannot use."""
    return Dialer.from_config(section, "upstream", keepalive)


def peer_dialer(peering: DialSection, upstream: UpstreamSection, keepalive: Keepalive = DEFAULT_KEEPALIVE) -> Dialer:
    """The proxy's link to its peer proxies: each dial setting the peering section leaves empty is upstream's."""
    return Dialer.from_config(peering, "peering", keepalive, inherit=(upstream, "upstream"))


@dataclass(frozen=True)
class RelayCredentials:
    """What the proxy's relay trees carry: the streams' metadata and the key of its grants."""

    metadata: tuple[tuple[str, str], ...] = ()
    grant_key: bytes | None = None
    """None where the proxy has no admin token (its replicas have auth off and check no grant)."""


def relay_credentials(section: UpstreamSection) -> RelayCredentials:
    """Read at start, like the dialer: a token file that cannot be read stops the proxy."""
    admin = read_token(section.token_file, "upstream.token_file")
    key = grant_key(hashlib.sha256(admin.encode()).digest()) if admin else None
    return RelayCredentials(bearer(read_token(section.relay_token_file, "upstream.relay_token_file") or admin), key)
