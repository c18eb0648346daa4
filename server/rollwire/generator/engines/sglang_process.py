"""The SGLang server behind a replica: HTTP transport, launch, readiness, health, restart.

Invariants:
- a launched SGLang runs in a process group this replica started; `stop` ends that group and
  nothing else;
- the supervisor reports SGLang up only after it answered /health since its last (re)start
  and `on_ready` (the engine re-loading its adapters) succeeded; while it is down, requests
  are refused at once with UNAVAILABLE and a retry hint, never parked behind a restart;
- a crash of a launched SGLang is noticed when the process exits (no polling); an SGLang
  given by URL is probed every `health_interval_s`, and at once after a failed call;
- API keys travel in headers and, for a launched server, in a private config file passed
  with `--config`, so they never appear in a command line or a log.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpx2 as httpx

from rollwire.common.errors import DeadlineExceeded, FailedPrecondition, RollwireError, Unavailable
from rollwire.common.logs import get_logger
from rollwire.common.reasons import Reason
from rollwire.common.waits import wait_at_most
from rollwire.generator.engines.sglang_protocol import error_from_reply

log = get_logger(__name__)
READY_PROBE_S = 0.25  # pause between /health probes while a launched SGLang starts


# -- transport -----------------------------------------------------------------------------
class SGLangHTTP:
    """JSON and event-stream calls to one SGLang server, errors mapped to RollwireError."""

    def __init__(self, base_url: str, *, api_key: str | None, admin_key: str | None, timeout_s: float) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._api_key, self._admin_key = api_key, admin_key
        self.on_transport_error: Callable[[], None] = lambda: None
        self.client = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
            trust_env=False,  # no proxy or netrc taken from the environment
        )

    def _headers(self, admin: bool) -> dict[str, str]:
        # SGLang: admin routes take the admin key when one is set, else the API key.
        key = (self._admin_key or self._api_key) if admin else self._api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    async def get_json(self, path: str, what: str, timeout_s: float | None = None) -> dict:
        with self._mapped(what):
            resp = await self.client.get(path, headers=self._headers(False), timeout=timeout_s or self.timeout_s)
        return _json_or_raise(resp.status_code, resp.content, what)

    async def post_json(self, path: str, body: dict, what: str, *, admin: bool = False) -> dict:
        with self._mapped(what):
            resp = await self.client.post(path, json=body, headers=self._headers(admin))
        return _json_or_raise(resp.status_code, resp.content, what)

    @contextlib.asynccontextmanager
    async def stream_lines(self, path: str, body: dict, what: str) -> AsyncIterator[AsyncIterator[str]]:
        """POST and iterate the response's lines; leaving the block closes the connection."""
        with self._mapped(what):
            async with self.client.stream("POST", path, json=body, headers=self._headers(False)) as resp:
                if resp.status_code != 200:
                    raise error_from_reply(resp.status_code, await resp.aread(), what)
                yield resp.aiter_lines()

    async def healthy(self) -> tuple[bool, str]:
        """(True, "") when /health answers 200, else (False, why)."""
        try:
            resp = await self.client.get("/health", timeout=5.0)
        except httpx.HTTPError as exc:
            return False, f"{type(exc).__name__}: {exc}"
        return resp.status_code == 200, f"HTTP {resp.status_code}"

    @contextlib.contextmanager
    def _mapped(self, what: str):
        try:
            yield
        except httpx.TransportError as exc:
            self.on_transport_error()
            raise transport_error(exc, self.base_url, what, self.timeout_s) from None

    async def aclose(self) -> None:
        await self.client.aclose()


def _json_or_raise(status: int, raw: bytes, what: str) -> dict:
    if status != 200:
        raise error_from_reply(status, raw, what)
    try:
        body = json.loads(raw) if raw else {}
    except json.JSONDecodeError:
        body = {"text": raw.decode("utf-8", "replace")}
    if isinstance(body, dict) and body.get("success") is False:
        raise error_from_reply(400, raw, what)
    return body if isinstance(body, dict) else {"value": body}


def transport_error(exc: Exception, url: str, what: str, timeout_s: float) -> RollwireError:
    """The status for a failed connection to SGLang, with what to do about it."""
    if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
        return Unavailable(
            f"cannot reach SGLang at {url} for {what} ({exc}); it is down or restarting, retry shortly",
            reason=Reason.SGLANG_UNREACHABLE,
            retry_after_s=2.0,
        )
    if isinstance(exc, httpx.ReadTimeout):
        return DeadlineExceeded(
            f"SGLang at {url} sent nothing for {timeout_s:g}s during {what}; it may be overloaded or hung "
            "(raise sglang.request_timeout_s for very long generations)",
            reason=Reason.SGLANG_TIMEOUT,
        )
    return Unavailable(
        f"SGLang at {url} dropped the connection during {what} ({type(exc).__name__}: {exc}); it probably "
        "crashed or restarted, so any partial samples are void: retry the whole group",
        reason=Reason.SGLANG_CONNECTION_LOST,
        retry_after_s=2.0,
    )


# -- launching -----------------------------------------------------------------------------
def free_port(host: str) -> int:
    """A port free now on `host` (another process may take it before SGLang binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def launch_argv(
    *,
    command: list[str],
    model: str,
    host: str,
    port: int,
    max_lora_rank: int,
    target_modules: list[str],
    max_loaded: int,
    deterministic: bool,
    random_seed: int | None,
    config_file: Path | None,
    extra_args: list[str],
) -> list[str]:
    """SGLang's command line: LoRA on, its rank and adapter limits sized for the window.

    `--max-loaded-loras` is the window plus one for the swap; the engine never loads more,
    so SGLang's own LRU eviction (which would unload a version still being served) never runs.
    """
    argv = [*(command or [sys.executable, "-m", "sglang.launch_server"])]
    argv += ["--model-path", model, "--host", host, "--port", str(port)]
    argv += ["--enable-lora", "--max-lora-rank", str(max_lora_rank), "--lora-target-modules", *target_modules]
    argv += ["--max-loras-per-batch", str(max_loaded), "--max-loaded-loras", str(max_loaded)]
    if deterministic:
        argv.append("--enable-deterministic-inference")
    if random_seed is not None:
        argv += ["--random-seed", str(random_seed)]
    if config_file is not None:
        argv += ["--config", str(config_file)]
    return argv + list(extra_args)


def write_key_config(path: Path, api_key: str | None, admin_key: str | None) -> Path | None:
    """A private SGLang `--config` file holding the keys (JSON is valid YAML); None if no key."""
    keys = {k: v for k, v in (("api_key", api_key), ("admin_api_key", admin_key)) if v}
    if not keys:
        return None
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(keys, fh)
    return path


class SGLangProcess:
    """One launched SGLang server (a process group) and its log file."""

    def __init__(self, argv: list[str], log_path: Path) -> None:
        self.argv, self.log_path = argv, log_path
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        with self.log_path.open("ab") as log_file:
            log_file.write(f"\n==== rollwire starts SGLang at {time.strftime('%Y-%m-%d %H:%M:%S')} ====\n".encode())
            log_file.flush()
            self.proc = await asyncio.create_subprocess_exec(
                *self.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log_file,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,  # its own process group, so stop() reaches its workers too
            )
        log.info("sglang_launched", pid=self.proc.pid, log=str(self.log_path))

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
        self._signal(signal.SIGTERM)
        if not await wait_at_most(self.proc.wait(), grace_s):
            self._signal(signal.SIGKILL)
            await self.proc.wait()

    def _signal(self, sig: int) -> None:
        assert self.proc is not None, "signalled before start"
        try:
            os.killpg(self.proc.pid, sig)  # the group start_new_session created: ours alone
        except ProcessLookupError:
            pass


# -- supervision ---------------------------------------------------------------------------
class Supervisor:
    """Keeps track of whether SGLang can serve, and brings it back after a failure."""

    def __init__(
        self,
        http: SGLangHTTP,
        process: SGLangProcess | None,
        *,
        on_ready: Callable[[], Awaitable[None]],
        startup_timeout_s: float,
        health_interval_s: float,
        max_restarts: int,
    ) -> None:
        self.http, self.process, self.on_ready = http, process, on_ready
        self.startup_timeout_s, self.health_interval_s, self.max_restarts = (
            startup_timeout_s,
            health_interval_s,
            max_restarts,
        )
        self.up = False
        self.down_reason = "SGLang has not started yet"
        self.restarts = 0
        self._stopping = False
        self._probe_now = asyncio.Event()
        self._changed = asyncio.Condition()
        self._task: asyncio.Task | None = None
        http.on_transport_error = self._probe_now.set

    async def start(self) -> None:
        """Launch (or reach) SGLang and wait until it serves; raises with a clear sentence."""
        if self.process is not None:
            await self.process.start()
        await self.wait_healthy()
        await self.on_ready()
        await self._mark_up()
        watch = self._watch_process if self.process is not None else self._watch_url
        self._task = asyncio.get_running_loop().create_task(watch())

    def check_up(self) -> None:
        if not self.up:
            raise Unavailable(
                f"this replica's SGLang cannot serve right now: {self.down_reason}; retry shortly or on another replica",
                reason=Reason.SGLANG_DOWN,
                retry_after_s=2.0,
            )

    async def wait_healthy(self) -> None:
        """Until /health answers 200; fails at once if a launched SGLang exits meanwhile."""
        deadline = time.monotonic() + self.startup_timeout_s
        why = "no answer yet"
        while time.monotonic() < deadline:
            self._raise_if_exited()
            ok, why = await self.http.healthy()
            if ok:
                return
            await self._pause(READY_PROBE_S)
        raise DeadlineExceeded(
            f"SGLang at {self.http.base_url} did not become healthy within {self.startup_timeout_s:g}s "
            f"(last probe: {why}); raise sglang.startup_timeout_s for big models{self._log_hint()}",
            reason=Reason.SGLANG_START_TIMEOUT,
        )

    def _raise_if_exited(self) -> None:
        if self.process is not None and self.process.returncode is not None:
            raise FailedPrecondition(
                f"SGLang exited with code {self.process.returncode} while starting; its log "
                f"({self.process.log_path}) ends with:\n{self.process.log_tail()}",
                reason=Reason.SGLANG_START_FAILED,
            )

    async def _pause(self, seconds: float) -> None:
        """Wait `seconds`, or less if a launched SGLang exits first."""
        if self.process is None or self.process.proc is None:
            await asyncio.sleep(seconds)
            return
        await wait_at_most(asyncio.shield(self.process.proc.wait()), seconds)

    def _log_hint(self) -> str:
        return f"; see {self.process.log_path}" if self.process is not None else ""

    async def wait_for(self, predicate: Callable[[Supervisor], bool], timeout_s: float) -> None:
        """Until `predicate(self)` holds after some state change (tests and operators)."""
        async with self._changed:
            async with asyncio.timeout(timeout_s):  # not wait_for: see rollwire.common.waits
                await self._changed.wait_for(lambda: predicate(self))

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def _mark_up(self) -> None:
        self.up, self.down_reason = True, ""
        log.info("sglang_up", url=self.http.base_url, restarts=self.restarts)
        await self._notify()

    async def _mark_down(self, reason: str) -> None:
        if self.up:
            log.error("sglang_down", url=self.http.base_url, reason=reason)
        self.up, self.down_reason = False, reason
        await self._notify()

    async def _watch_process(self) -> None:
        """Restart a launched SGLang each time it exits, up to max_restarts."""
        assert self.process is not None, "only a launched SGLang is watched"
        while True:
            code = await self.process.wait()
            if self._stopping:
                return
            await self._mark_down(f"SGLang exited with code {code} and is being restarted")
            if self.restarts >= self.max_restarts:
                self.down_reason = (
                    f"SGLang exited with code {code} after {self.restarts} restarts; the replica gave up "
                    f"(see {self.process.log_path}) and must be restarted"
                )
                log.error("sglang_gave_up", restarts=self.restarts, log=str(self.process.log_path))
                await self._notify()
                return
            self.restarts += 1
            try:
                await self.process.start()
                await self.wait_healthy()
                await self.on_ready()
            except RollwireError as err:
                log.error("sglang_restart_failed", error=err.message)
                await self.process.stop()
                continue
            await self._mark_up()

    async def _watch_url(self) -> None:
        """Probe an SGLang given by URL; re-sync adapters when it comes back."""
        while not self._stopping:
            await wait_at_most(self._probe_now.wait(), self.health_interval_s)
            self._probe_now.clear()
            ok, why = await self.http.healthy()
            if not ok:
                await self._mark_down(f"SGLang at {self.http.base_url} fails its health check ({why})")
            elif not self.up:
                try:
                    await self.on_ready()
                except RollwireError as err:
                    self.down_reason = f"SGLang is back but re-loading adapters failed: {err.message}"
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
