"""DNS discovery of replicas: `dns:///NAME:PORT` (common/addresses.py), re-resolved periodically.

Every address the name resolves to is a replica (a Kubernetes headless service resolves to
its ready pods). Invariant: a failed resolution changes nothing, so a DNS hiccup never
empties the replica set; an address that stops resolving is drained, then removed.
"""

from __future__ import annotations

import asyncio
import socket

from rollwire.common.addresses import format_address, parse_dns_target
from rollwire.runtime.logs import get_logger

log = get_logger(__name__)


class DnsDiscovery:
    def __init__(self, target: str, interval_s: float, on_resolved) -> None:
        self.host, self.port = parse_dns_target(target)
        self.interval_s, self.on_resolved = interval_s, on_resolved

    async def resolve(self) -> set[str]:
        infos = await asyncio.get_running_loop().getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        return {format_address(str(info[4][0]), self.port) for info in infos}

    async def run(self) -> None:
        while True:
            try:
                addresses = await self.resolve()
            except OSError as exc:
                log.warning("dns_resolution_failed", name=self.host, error=str(exc))
            else:
                self.on_resolved(addresses)
            await asyncio.sleep(self.interval_s)
