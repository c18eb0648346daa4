"""Bounded waits on the event loop, in one place.

`asyncio.timeout`, never `asyncio.wait_for`: on Python 3.11, `wait_for` swallows a cancellation
that arrives just as the awaited thing finishes, so a loop that waits an interval and checks a
flag never sees its task cancelled and shutdown hangs (a proxy stuck on SIGTERM was this).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable


async def wait_at_most(awaitable: Awaitable[object], seconds: float) -> bool:
    """Await `awaitable` for at most `seconds` (<= 0: a single look); True if it finished in
    time, False at the limit. A cancellation of the caller always propagates."""
    try:
        async with asyncio.timeout(max(seconds, 0.0)):
            await awaitable
    except TimeoutError:
        return False
    return True
