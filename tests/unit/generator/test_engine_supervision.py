"""Supervision of a launched engine server (engines/served/process.py), with stand-ins for the process and
its HTTP API: the restart budget counts per time window, and anything unexpected marks the
replica failed with the reason (never a silent end). That a launched server dies with its
replica (real processes): tests/integration/generator/test_engine_supervision_process.py."""

from __future__ import annotations

import asyncio

import pytest

from rollwire.common.errors import Unavailable
from rollwire.generator.engines.served.process import Supervisor
from rollwire.generator.engines.served.sglang_protocol import SGLANG


class FakeHTTP:
    on_transport_error = None
    base_url = "http://127.0.0.1:1"

    async def healthy(self) -> tuple[bool, str]:
        return True, ""


class FakeProcess:
    """A server that exits when told (`crash`), and whose restart may raise `start_error`."""

    log_path = "fake.log"

    def __init__(self) -> None:
        self.starts, self.start_error = 0, None
        self._exited: asyncio.Future | None = None

    async def start(self) -> None:
        if self.start_error is not None and self.starts:
            raise self.start_error
        self.starts += 1
        self._exited = asyncio.get_running_loop().create_future()

    @property
    def returncode(self) -> int | None:
        return self._exited.result() if self._exited is not None and self._exited.done() else None

    @property
    def proc(self):
        return None

    async def wait(self) -> int:
        assert self._exited is not None
        return await asyncio.shield(self._exited)

    def crash(self, code: int = 9) -> None:
        assert self._exited is not None
        self._exited.set_result(code)

    async def stop(self, grace_s: float = 20.0) -> None:
        if self._exited is not None and not self._exited.done():
            self._exited.set_result(-15)

    def log_tail(self, chars: int = 2000) -> str:
        return ""


async def supervised(process: FakeProcess, max_restarts: int, window_s: float) -> Supervisor:
    async def ready() -> None:
        return None

    supervisor = Supervisor(
        SGLANG,
        FakeHTTP(),  # pyright: ignore[reportArgumentType]
        process,  # pyright: ignore[reportArgumentType]
        on_ready=ready,
        startup_timeout_s=5,
        health_interval_s=1,
        max_restarts=max_restarts,
        restart_window_s=window_s,
    )
    await supervisor.start()
    return supervisor


async def crash_and_settle(supervisor: Supervisor, process: FakeProcess) -> None:
    starts = process.starts
    process.crash()
    await supervisor.wait_for(lambda s: s.failed != "" or (s.up and process.starts > starts), 5)


async def test_the_restart_budget_counts_within_a_window_not_a_life():
    process = FakeProcess()
    supervisor = await supervised(process, max_restarts=2, window_s=0.3)
    try:
        for _ in range(4):  # crashes spread out: each window sees one, so it is restarted every time
            await crash_and_settle(supervisor, process)
            await asyncio.sleep(0.35)
        assert supervisor.up and supervisor.failed == "" and process.starts == 5
        for _ in range(3):  # three crashes within one window: over max_restarts, it gives up
            await crash_and_settle(supervisor, process)
        assert not supervisor.up and "restarts within 0.3s" in supervisor.failed
        with pytest.raises(Unavailable, match="gave up and must be restarted"):
            supervisor.check_up()
    finally:
        await supervisor.stop()


async def test_an_unexpected_error_while_restarting_marks_the_replica_failed_with_the_reason():
    process = FakeProcess()
    supervisor = await supervised(process, max_restarts=5, window_s=60)
    told: list[bool] = []

    async def listener(up: bool) -> None:
        told.append(up)

    supervisor.listeners.append(listener)
    try:
        process.start_error = OSError(24, "Too many open files")
        process.crash()
        await supervisor.wait_for(lambda s: s.failed != "", 5)
        assert "OSError" in supervisor.failed and "Too many open files" in supervisor.failed
        assert not supervisor.up and told == [False]  # its gRPC health follows: NOT_SERVING
        with pytest.raises(Unavailable, match="Too many open files"):
            supervisor.check_up()
    finally:
        await supervisor.stop()
