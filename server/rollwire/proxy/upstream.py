"""How the proxy dials its replicas: the `upstream` section, built into a Dialer (serving/dial.py).

The proxy checks its own clients' tokens (security.py) and never forwards them: towards the
replicas it speaks with its own token, which needs the admin role because the proxy pushes
adapters. Peer proxies are dialled with the same settings (peers.py may override the token
and the certificate name).
"""

from __future__ import annotations

from pydantic import Field

from rollwire.common.keepalive import DEFAULT as DEFAULT_KEEPALIVE
from rollwire.common.keepalive import Keepalive
from rollwire.serving.dial import Dialer, DialTlsSection


class UpstreamSection(DialTlsSection):
    """Credentials for replicas that require tokens or TLS."""

    token_file: str = Field(default="")
    """File holding the bearer token sent to replicas (admin role: the proxy pushes)."""


def upstream_dialer(section: UpstreamSection, keepalive: Keepalive = DEFAULT_KEEPALIVE) -> Dialer:
    """The proxy's link to its replicas; raises SystemExit naming a setting it cannot use."""
    return Dialer.from_config(section, "upstream", keepalive, token_file=section.token_file)
