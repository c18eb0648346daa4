"""Launching an engine server (sglang, vllm) in its own process group and supervising it.

Invariants:
- a launched server runs in a process group this replica started; `stop` ends that group
  (SIGTERM, then SIGKILL after a grace period) and nothing else; it is started with
  PR_SET_PDEATHSIG (Linux), so a replica killed without a word (SIGKILL, OOM) takes it along;
- a crashed server is restarted at most `max_restarts` times within any `restart_window_s`; past
  that, or on any error the supervisor did not expect, the replica is marked failed with the
  reason (`failed`, its health NOT_SERVING, an error log line): supervision never ends silently;
- the supervisor reports the server up only after it answered its health route since its
  last (re)start and `on_ready` (the engine re-loading its adapters) succeeded; while it is
  down, requests are refused at once with UNAVAILABLE and a retry hint, never parked;
- a crash of a launched server is noticed when the process exits (no polling); a server
  given by URL is probed every `health_interval_s`, and at once after a failed call;
- every wait has a deadline: start-up (`startup_timeout_s`), health probes (5 s), shutdown
  (20 s grace).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import re
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

from rollwire.common.errors import DeadlineExceeded, FailedPrecondition, RollwireError, Unavailable
from rollwire.common.reasons import Reason
from rollwire.generator.engines.served.http import ServerHTTP, ServerKind
from rollwire.runtime.logs import get_logger
from rollwire.runtime.waits import wait_at_most

log = get_logger(__name__)
READY_PROBE_S = 0.25  # pause between health probes while a launched server starts


# -- launching -------------------------------------------------------------------------------
PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In the child, before exec: the kernel sends it SIGKILL when the replica that launched it
    dies (Linux; elsewhere a no-op). Only async-signal-safe calls here."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def free_port(host: str) -> int:
    """A port free now on `host` (another process may take it before the server binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


_NO_LORA = re.compile(r"(\w+) does not support LoRA")


def known_cause(label: str, log: str) -> str:
    """A start-up failure's cause named, when the server's log says one rollwire knows (the tail
    quoted after it often shows only the exception that followed); "" otherwise."""
    found = _NO_LORA.search(log)
    if found:
        return (
            f": {label} has no LoRA for this model's class ({found.group(1)}), and rollwire always serves with "
            "LoRA; serve this model with --engine transformers"
        )
    return ""


class ServerProcess:
    """One launched server (a process group) and its log file. `env` is added to this
    process's environment for the child only (the server's own switches, never secrets)."""

    def __init__(self, kind: ServerKind, argv: list[str], log_path: Path, env: Mapping[str, str] | None = None) -> None:
        self.kind, self.argv, self.log_path = kind, argv, log_path
        self.env = {**os.environ, **env} if env else None
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        with self.log_path.open("ab") as log_file:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            log_file.write(f"\n==== rollwire starts {self.kind.label} at {stamp} ====\n".encode())
            log_file.flush()
            self.proc = await asyncio.create_subprocess_exec(
                *self.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log_file,
                stderr=asyncio.subprocess.STDOUT,
                env=self.env,
                start_new_session=True,  # its own process group, so stop() reaches its workers too
                preexec_fn=die_with_parent,
            )
        log.info(f"{self.kind.key}_launched", pid=self.proc.pid, log=str(self.log_path))

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.returncode

    async def wait(self) -> int:
        assert self.proc is not None
        return await self.proc.wait()

    def log_tail(self, chars: int = 2000) -> str:
        try:
            data = self.log_path.read_bytes()[-chars:]
        except OSError:
            return "(no log)"
        return data.decode("utf-8", "replace")

    async def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the group, then SIGKILL it if it has not exited after `grace_s`."""
        if self.proc is None or self.proc.returncode is not None:
            return
        self.signal(signal.SIGTERM)
        if not await wait_at_most(self.proc.wait(), grace_s):
            self.signal(signal.SIGKILL)
            await self.proc.wait()

    def signal(self, sig: int) -> None:
        """Send `sig` to the server's process group (ours alone: start_new_session made it)."""
        assert self.proc is not None, "signalled before start"
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)


# -- supervision -----------------------------------------------------------------------------
class Supervisor:
    """Keeps track of whether the server can serve, and brings it back after a failure.

    `listeners` are called with True/False each time the server comes up or goes down (the
    replica turns its gRPC health with them)."""

    def __init__(
        self,
        kind: ServerKind,
        http: ServerHTTP,
        process: ServerProcess | None,
        *,
        on_ready: Callable[[], Awaitable[None]],
        startup_timeout_s: float,
        health_interval_s: float,
        max_restarts: int,
        restart_window_s: float = 600.0,
    ) -> None:
        self.kind, self.http, self.process, self.on_ready = kind, http, process, on_ready
        self.startup_timeout_s, self.health_interval_s, self.max_restarts = (
            startup_timeout_s,
            health_interval_s,
            max_restarts,
        )
        self.restart_window_s = restart_window_s
        self.up = False
        self.down_reason = f"{kind.label} has not started yet"
        self.failed = ""
        """Why supervision gave up (the replica must be restarted); "" while it supervises."""
        self.restarts = 0
        self._restarted_at: list[float] = []
        self.listeners: list[Callable[[bool], Awaitable[None]]] = []
        self._stopping = False
        self._probe_now = asyncio.Event()
        self._changed = asyncio.Condition()
        self._task: asyncio.Task | None = None
        http.on_transport_error = self._probe_now.set

    async def start(self) -> None:
        """Launch (or reach) the server and wait until it serves; raises with a clear sentence."""
        if self.process is not None:
            await self.process.start()
        await self.wait_healthy()
        await self.on_ready()
        await self._mark_up()
        watch = self._watch_process if self.process is not None else self._watch_url
        self._task = asyncio.get_running_loop().create_task(self._supervise(watch))

    def check_up(self) -> None:
        if not self.up:
            raise Unavailable(
                f"this replica's {self.kind.label} cannot serve right now: {self.down_reason}; retry shortly or on "
                "another replica",
                reason=Reason.ENGINE_SERVER_DOWN,
                retry_after_s=2.0,
            )

    async def wait_healthy(self) -> None:
        """Until the health route answers 200; fails at once if a launched server exits meanwhile."""
        deadline = time.monotonic() + self.startup_timeout_s
        why = "no answer yet"
        while time.monotonic() < deadline:
            self._raise_if_exited()
            ok, why = await self.http.healthy()
            if ok:
                return
            await self._pause(READY_PROBE_S)
        raise DeadlineExceeded(
            f"{self.kind.label} at {self.http.base_url} did not become healthy within {self.startup_timeout_s:g}s "
            f"(last probe: {why}); raise {self.kind.key}.startup_timeout_s for big models{self._log_hint()}",
            reason=Reason.ENGINE_SERVER_START_TIMEOUT,
        )

    def _raise_if_exited(self) -> None:
        if self.process is not None and self.process.returncode is not None:
            cause = known_cause(self.kind.label, self.process.log_tail(64 << 10))
            raise FailedPrecondition(
                f"{self.kind.label} exited with code {self.process.returncode} while starting{cause}; its log "
                f"({self.process.log_path}) ends with:\n{self.process.log_tail()}",
                reason=Reason.ENGINE_SERVER_START_FAILED,
            )

    async def _pause(self, seconds: float) -> None:
        """Wait `seconds`, or less if a launched server exits first."""
        if self.process is None or self.process.proc is None:
            await asyncio.sleep(seconds)
            return
        await wait_at_most(asyncio.shield(self.process.proc.wait()), seconds)

    def _log_hint(self) -> str:
        return f"; see {self.process.log_path}" if self.process is not None else ""

    async def wait_for(self, predicate: Callable[[Supervisor], bool], timeout_s: float) -> None:
        """Until `predicate(self)` holds after some state change (tests and operators)."""
        async with self._changed:
            async with asyncio.timeout(timeout_s):  # not wait_for: see rollwire.runtime.waits
                await self._changed.wait_for(lambda: predicate(self))

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def _tell(self, up: bool) -> None:
        for listener in list(self.listeners):
            try:
                await listener(up)
            except Exception as exc:  # a listener's failure must not stop supervision
                log.warning(f"{self.kind.key}_listener_failed", error=f"{type(exc).__name__}: {exc}")

    async def _mark_up(self) -> None:
        self.up, self.down_reason = True, ""
        log.info(f"{self.kind.key}_up", url=self.http.base_url, restarts=self.restarts)
        await self._notify()
        await self._tell(True)

    async def _mark_down(self, reason: str) -> None:
        was_up = self.up
        if was_up:
            log.error(f"{self.kind.key}_down", url=self.http.base_url, reason=reason)
        self.up, self.down_reason = False, reason
        await self._notify()
        if was_up:
            await self._tell(False)

    async def _supervise(self, watch: Callable[[], Awaitable[None]]) -> None:
        """Run `watch`; whatever ends it but a stop marks the replica failed, with the reason."""
        try:
            await watch()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await self._fail(f"supervising {self.kind.label} failed with {type(exc).__name__}: {exc}")

    async def _fail(self, reason: str) -> None:
        """Give up: the server stays down and the replica says why (its health is NOT_SERVING)."""
        was_up = self.up
        self.failed = self.down_reason = f"{reason}; the replica gave up and must be restarted"
        self.up = False
        log.error(f"{self.kind.key}_supervision_failed", reason=reason)
        await self._notify()
        if was_up:
            await self._tell(False)

    def _budget_spent(self) -> bool:
        """Whether `max_restarts` restarts happened within the last `restart_window_s`."""
        now = time.monotonic()
        self._restarted_at = [t for t in self._restarted_at if now - t < self.restart_window_s]
        return len(self._restarted_at) >= self.max_restarts

    async def _watch_process(self) -> None:
        """Restart a launched server each time it exits, up to max_restarts per restart_window_s."""
        assert self.process is not None, "only a launched server is watched"
        label = self.kind.label
        while True:
            code = await self.process.wait()
            if self._stopping:
                return
            await self._mark_down(f"{label} exited with code {code} and is being restarted")
            if self._budget_spent():
                log.error(f"{self.kind.key}_gave_up", restarts=self.restarts, log=str(self.process.log_path))
                await self._fail(
                    f"{label} exited with code {code} after {len(self._restarted_at)} restarts within "
                    f"{self.restart_window_s:g}s ({self.kind.key}.max_restarts, {self.kind.key}.restart_window_s; "
                    f"see {self.process.log_path})"
                )
                return
            self.restarts += 1
            self._restarted_at.append(time.monotonic())
            try:
                await self.process.start()
                await self.wait_healthy()
                await self.on_ready()
            except RollwireError as err:
                log.error(f"{self.kind.key}_restart_failed", error=err.message)
                await self.process.stop()
                continue
            await self._mark_up()

    async def _watch_url(self) -> None:
        """Probe a server given by URL; re-sync adapters when it comes back."""
        while not self._stopping:
            await wait_at_most(self._probe_now.wait(), self.health_interval_s)
            self._probe_now.clear()
            ok, why = await self.http.healthy()
            if not ok:
                await self._mark_down(f"{self.kind.label} at {self.http.base_url} fails its health check ({why})")
            elif not self.up:
                try:
                    await self.on_ready()
                except RollwireError as err:
                    self.down_reason = f"{self.kind.label} is back but re-loading adapters failed: {err.message}"
                    continue
                await self._mark_up()

    async def stop(self) -> None:
        self._stopping = True
        self.up, self.down_reason = False, "the replica is shutting down"
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.process is not None:
            await self.process.stop()
