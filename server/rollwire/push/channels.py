"""The channels a relaying replica dials its children on (push.forward's `stub_for`)."""

from __future__ import annotations

import asyncio

import grpc

from rollwire.serving.dial import Dialer
from rollwire.v1 import generator_pb2_grpc


class ChannelPool:
    """Channels a relaying replica dials its children on, kept for the next push (relay trees
    are planned from the same replicas each time); at most `size`, the oldest closed first.
    Its dialer's keepalive ends the stream of a child that goes silent mid-relay."""

    def __init__(self, dialer: Dialer, size: int = 64) -> None:
        self.dialer, self.size = dialer, size
        self.channels: dict[str, grpc.aio.Channel] = {}
        self._closing: set[asyncio.Task] = set()

    def stub(self, address: str) -> generator_pb2_grpc.GeneratorServiceStub:
        channel = self.channels.pop(address, None) or self.dialer.channel(address)
        self.channels[address] = channel  # most recently used last
        while len(self.channels) > self.size:
            oldest = next(iter(self.channels))
            self._close(self.channels.pop(oldest))
        return generator_pb2_grpc.GeneratorServiceStub(channel)

    def _close(self, channel: grpc.aio.Channel) -> None:
        task = asyncio.ensure_future(channel.close(grace=5.0))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        for channel in self.channels.values():
            self._close(channel)
        self.channels.clear()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
