"""vLLM's /pause and /resume at the door, per tenant: a publisher's pause holds its own new requests.

A trainer that syncs its weights (TRL's AsyncGRPOTrainer: pause, save the adapter, load it,
resume) calls /pause so that the server stops producing samples of the policy it is about to
replace while it saves and publishes the next. vLLM stops its whole engine. The door does the
same for the caller's tenant only: its new generation requests wait at the door until /resume,
and nothing of another tenant's is held. Measured (docs/benchmarks.md §12): a door that ignored
the pause kept the one serving core busy through every sync with samples TRL then dropped as
stale (9 in 10 at 4 generations and batch 8), and its load of the next version, queued behind
them, made TRL's weight sync 1.7x vLLM's.

Invariants:
- a pause holds only requests that have not reached the core: the ones in flight finish on the
  version they named (vLLM's "keep" freezes them instead; "wait" waits for them here too, and
  "abort" is taken as "keep": an in-flight rollwire request is never cut short by another call);
- every hold has a deadline: a pause lapses by itself after `http.pause_max_s` (a publisher
  that died between its pause and its resume holds its tenant for at most that long, logged),
  and a held request never waits past its own deadline (it then fails DEADLINE_EXCEEDED, saying
  why);
- pause, resume and holding are O(1) on the event loop; the held requests wait on one event.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from rollwire.common.errors import DeadlineExceeded
from rollwire.common.reasons import Reason
from rollwire.runtime.logs import get_logger

log = get_logger(__name__)

MODES = ("abort", "wait", "keep")
"""vLLM's pause modes (its default is abort); how the door takes each is in the module docstring."""


@dataclass
class _Tenant:
    resumed: asyncio.Event = field(default_factory=asyncio.Event)
    """Set while the tenant is not paused: what held requests wait on."""
    until: float = 0.0
    """When the current pause lapses by itself (monotonic seconds)."""
    running: int = 0
    """The tenant's door requests in the core now (a pause in mode "wait" waits for 0)."""
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    """Set while `running` is 0."""

    def __post_init__(self) -> None:
        self.resumed.set()
        self.idle.set()


class Pauses:
    """Each tenant's pause state, on the proxy's event loop."""

    def __init__(self, max_s: float, held_counter=None) -> None:
        self.max_s = max_s
        self._tenants: dict[str, _Tenant] = {}
        self._held = held_counter

    def _of(self, tenant: str) -> _Tenant:
        state = self._tenants.get(tenant)
        if state is None:
            state = self._tenants[tenant] = _Tenant()
        return state

    def paused(self, tenant: str) -> bool:
        state = self._tenants.get(tenant)
        if state is None or state.resumed.is_set():
            return False
        if time.monotonic() >= state.until:
            self._lapse(tenant, state)
            return False
        return True

    async def pause(self, tenant: str, mode: str = "keep") -> None:
        """Hold the tenant's new requests until resume() or `max_s`; in mode "wait", also
        return only once its requests in flight have ended (within `max_s`)."""
        state = self._of(tenant)
        state.resumed.clear()
        state.until = time.monotonic() + self.max_s
        if mode == "wait":
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(state.idle.wait(), self.max_s)

    def resume(self, tenant: str) -> None:
        state = self._tenants.get(tenant)
        if state is not None:
            state.resumed.set()
            self._forget(tenant, state)

    async def hold(self, tenant: str, deadline: float) -> None:
        """Return at once unless the tenant is paused; else when it resumes or the pause lapses.
        DeadlineExceeded if the request's own `deadline` (monotonic) comes first."""
        if not self.paused(tenant):
            return
        state = self._tenants[tenant]
        if self._held is not None:
            self._held.inc()
        wait_s = min(state.until, deadline) - time.monotonic()
        try:
            await asyncio.wait_for(state.resumed.wait(), max(wait_s, 0.0))
        except TimeoutError:
            if time.monotonic() < deadline - 1e-3 or not self.paused(tenant):
                return  # the pause lapsed (paused() logged it): the request goes on
            raise DeadlineExceeded(
                "the request waited for its tenant's /pause to end until its deadline; the publisher that paused "
                "must call /resume (a pause lapses by itself after http.pause_max_s)",
                reason=Reason.PAUSED,
            ) from None

    @contextlib.contextmanager
    def running(self, tenant: str) -> Iterator[None]:
        """Around a request's time in the core: what a pause in mode "wait" waits for."""
        state = self._of(tenant)
        state.running += 1
        state.idle.clear()
        try:
            yield
        finally:
            state.running -= 1
            if state.running == 0:
                state.idle.set()
                self._forget(tenant, state)

    def _lapse(self, tenant: str, state: _Tenant) -> None:
        log.warning(
            "http_pause_lapsed",
            tenant=tenant,
            after_s=self.max_s,
            note="no /resume came within http.pause_max_s; the tenant's requests go on",
        )
        state.resumed.set()
        self._forget(tenant, state)

    def _forget(self, tenant: str, state: _Tenant) -> None:
        """Drop a tenant's entry once it holds nothing (the map stays as small as the tenants paused or busy)."""
        if state.resumed.is_set() and state.running == 0 and self._tenants.get(tenant) is state:
            del self._tenants[tenant]
