"""The queue between a relay node and one child's request stream (push.forward.ChildLink).

Invariant: at most `capacity` chunks wait (the sender waits for room: backpressure), each
queued by reference, never copied; `close` ends the stream once the queue is drained.
"""

from __future__ import annotations

import asyncio
from collections import deque


class Pipe:
    """A bounded FIFO of chunks between the sender and one child's request stream."""

    def __init__(self, capacity: int) -> None:
        self.items: deque[bytes | memoryview] = deque()
        self.capacity = capacity
        self.closed = False
        self.readable = asyncio.Event()
        self.room = asyncio.Event()

    def full(self) -> bool:
        return len(self.items) >= self.capacity

    def push(self, chunk: bytes | memoryview) -> None:
        self.items.append(chunk)
        self.readable.set()

    def close(self) -> None:
        self.closed = True
        self.readable.set()

    async def pop(self) -> bytes | memoryview | None:
        while not self.items:
            if self.closed:
                return None
            self.readable.clear()
            await self.readable.wait()
        chunk = self.items.popleft()
        self.room.set()
        return chunk

    async def wait_room(self) -> None:
        while self.full():
            self.room.clear()
            await self.room.wait()
