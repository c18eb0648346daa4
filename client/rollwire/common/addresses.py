"""Addresses of rollwire processes, one rule for every one of them: HOST:PORT, or
dns:///NAME:PORT where a name stands for every address it resolves to.

HOST is a DNS name or an IPv4 address (letters, digits, `_`, `.` and `-`, at most 253
characters) or an IPv6 address in brackets; PORT is 1 to 65535. The proxy's replicas, peers
and discovery target, the addresses replicas register, and the nodes of the relay plans a
push carries are all checked here, and an address made from a resolved IP is written here,
so an address one process writes is one every other accepts.
"""

from __future__ import annotations

import re

DNS_PREFIX = "dns:///"
_ADDRESS = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]{1,253}):([0-9]{1,5})")


def is_address(text: str) -> bool:
    """Whether `text` is HOST:PORT (or [v6]:PORT) with a port of 1 to 65535."""
    match = _ADDRESS.fullmatch(text)
    return match is not None and 0 < int(match[2]) < 65536


def check_address(address: str) -> str:
    """`address` if it is HOST:PORT; raises ValueError with a sentence otherwise."""
    if not is_address(address):
        raise ValueError(f"{address!r} is not a HOST:PORT address (e.g. 10.0.0.5:50051 or [::1]:50051)")
    return address


def split_address(address: str) -> tuple[str, int]:
    """HOST:PORT -> (HOST without brackets, PORT); raises ValueError like check_address."""
    host, port = check_address(address).rsplit(":", 1)
    return host.strip("[]"), int(port)


def format_address(host: str, port: int) -> str:
    """HOST:PORT of a name or IP address and a port (an IPv6 address in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_dns_target(target: str) -> tuple[str, int]:
    """`dns:///NAME:PORT` -> (NAME, PORT); raises ValueError with a sentence otherwise."""
    if not target.startswith(DNS_PREFIX):
        raise ValueError(f"{target!r} must look like dns:///NAME:PORT, e.g. dns:///generators.default.svc:50051")
    return split_address(target[len(DNS_PREFIX) :])


def check_target(entry: str) -> str:
    """`entry` if it is HOST:PORT or dns:///NAME:PORT; raises ValueError with a sentence otherwise."""
    if entry.startswith("dns:"):
        parse_dns_target(entry)
        return entry
    return check_address(entry)


__all__ = [
    "DNS_PREFIX",
    "check_address",
    "check_target",
    "format_address",
    "is_address",
    "parse_dns_target",
    "split_address",
]
