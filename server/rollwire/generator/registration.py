"""A generator's membership at a proxy (`rollwire generator --register PROXY_ADDR`).

The replica registers itself with a TTL and heartbeats at a third of it, so the proxy
forgets it soon after it dies without a word. Invariants: a heartbeat never blocks serving
(a failure is logged and the next beat retries); on shutdown the replica asks the proxy to
drain and deregister it before its server stops, so no group the proxy placed on it is cut off.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc

from rollwire.runtime.logs import get_logger
from rollwire.runtime.waits import wait_at_most
from rollwire.serving.dial import Dialer
from rollwire.v1 import admin_pb2 as apb
from rollwire.v1 import admin_pb2_grpc

log = get_logger(__name__)


@dataclass(frozen=True)
class Registration:
    """Where to register and as what."""

    proxy: str
    """The proxy's HOST:PORT."""
    address: str = ""
    """HOST:PORT the proxy dials to reach this replica; empty = the bind address and port."""
    ttl_s: int = 15
    """The registration lapses this long after the last heartbeat."""
    dialer: Dialer = field(default_factory=Dialer)
    """How to reach the proxy (the `registration` section's TLS and token: the register role, or admin)."""


class Heartbeat:
    def __init__(self, registration: Registration, address: str) -> None:
        self.registration, self.address = registration, address
        # its keepalive dials a proxy that comes back again within a second
        self.channel = registration.dialer.channel(registration.proxy)
        self.metadata = registration.dialer.metadata
        self.admin = admin_pb2_grpc.AdminServiceStub(self.channel)
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        interval, registered = max(1.0, self.registration.ttl_s / 3), False
        request = apb.RegisterGeneratorRequest(address=self.address, ttl_seconds=self.registration.ttl_s)
        while not self._stop.is_set():
            try:
                await self.admin.RegisterGenerator(request, timeout=interval, metadata=self.metadata)
                if not registered:
                    log.info("registered_with_proxy", proxy=self.registration.proxy, address=self.address)
                registered = True
            except grpc.aio.AioRpcError as exc:
                log.warning(
                    "heartbeat_failed", proxy=self.registration.proxy, code=exc.code().name, error=exc.details()
                )
                registered = False
            await wait_at_most(self._stop.wait(), interval)

    async def leave(self, timeout_s: float) -> None:
        """Stop heartbeats, then have the proxy drain and forget this replica."""
        self._stop.set()
        if self._task is not None:
            await self._task
        try:
            await self.admin.DrainGenerator(
                apb.DrainGeneratorRequest(address=self.address, deregister=True),
                timeout=max(1.0, timeout_s),
                metadata=self.metadata,
            )
            log.info("left_proxy", proxy=self.registration.proxy)
        except grpc.aio.AioRpcError as exc:
            log.warning("leave_failed", proxy=self.registration.proxy, code=exc.code().name, error=exc.details())
        await self.channel.close()
