"""Which machine a host names: IP addresses parsed, resolved and compared by one rule.

Two checks rest on it. A replica refuses to relay a push to itself (its own port on a host
that resolves to one of its addresses), and a proxy lets a `register` token act only on an
address whose host resolves to the caller's own IP. Both compare IPs without an IPv6 zone
(`%eth0`): the zone names an interface, not a machine, and a gRPC peer string omits it.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket

IP = ipaddress.IPv4Address | ipaddress.IPv6Address


def parse_ip(text: str) -> IP | None:
    """The IP address `text` spells (brackets and an IPv6 zone dropped), or None for a name."""
    try:
        return ipaddress.ip_address(text.strip().strip("[]").split("%", 1)[0])
    except ValueError:
        return None


def peer_ip(peer: str) -> IP | None:
    """The IP address of a gRPC peer string ("ipv4:1.2.3.4:5", "ipv6:[::1]:5"), or None
    (a unix socket, or anything else)."""
    kind, _, rest = peer.partition(":")
    return parse_ip(rest.rpartition(":")[0]) if kind in ("ipv4", "ipv6") else None


async def resolve_ips(host: str) -> set[IP]:
    """Every IP address `host` (a name or an IP literal) resolves to, off the event loop's
    thread; empty when it resolves to nothing (the dial that follows fails and says so)."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host.strip("[]"), None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return set()
    return {ip for info in infos if (ip := parse_ip(str(info[4][0]))) is not None}


def is_local_ip(ip: IP) -> bool:
    """An address of this machine: loopback, unspecified, or one a socket can bind (a bind to
    port 0 is immediate and takes nothing)."""
    if ip.is_loopback or ip.is_unspecified:
        return True
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((str(ip), 0))
    except OSError:
        return False
    return True


__all__ = ["IP", "is_local_ip", "parse_ip", "peer_ip", "resolve_ips"]
