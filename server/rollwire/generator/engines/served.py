"""What the engines that drive a model server beside the replica share (sglang, vllm).

One place for: the HTTP transport and its error mapping, launching a server in its own
process group, supervising it (readiness, health, restart), adapter folders on disk, and the
engine skeleton (`ServedEngine`) that keeps the registry's adapter versions loaded in the
server. An engine module adds only its server's dialect: the generate call and its stream,
the load/unload bodies and its launch command line. `ServerKind` names the server in every
sentence, log event and error reason, so an SGLang failure reads "SGLang ..." with SGLANG_*
reasons and a vLLM failure "vLLM ..." with ENGINE_SERVER_* reasons.

Invariants:
- a launched server runs in a process group this replica started; `stop` ends that group
  (SIGTERM, then SIGKILL after a grace period) and nothing else;
- the supervisor reports the server up only after it answered its health route since its
  last (re)start and `on_ready` (the engine re-loading its adapters) succeeded; while it is
  down, requests are refused at once with UNAVAILABLE and a retry hint, never parked;
- a crash of a launched server is noticed when the process exits (no polling); a server
  given by URL is probed every `health_interval_s`, and at once after a failed call;
- every wait has a deadline: start-up (`startup_timeout_s`), each call and each stream gap
  (`request_timeout_s`), health probes (5 s), shutdown (20 s grace);
- an adapter version is written to this replica's disk in full (PEFT folder), fsynced and
  renamed into place before the server is asked to load it, under a name never used before
  (adapter, version, the registry's never-reused handle, a per-start nonce); it is unloaded
  from the server before its files are deleted, only when the registry says no request uses
  it, and the engine never holds more adapters than the server was sized for;
- after the server restarts, every adapter the registry still holds is loaded again before
  the replica serves again;
- API keys come from files named in config and travel in headers, never in a log.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import os
import re
import secrets
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import Any, Protocol

import httpx2 as httpx

from rollwire.common.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
    RollwireError,
    Unauthenticated,
    Unavailable,
)
from rollwire.common.manifest import Manifest
from rollwire.common.reasons import Reason
from rollwire.common.safetensors_header import read_header
from rollwire.common.secrets import SecretFileError, read_secret_file
from rollwire.generator.detokenize import TextStream, backend
from rollwire.generator.engines.base import EngineStats, GroupSlots
from rollwire.runtime.durable import atomic_dir, write_synced
from rollwire.runtime.logs import get_logger
from rollwire.runtime.waits import wait_at_most

log = get_logger(__name__)
READY_PROBE_S = 0.25  # pause between health probes while a launched server starts
_SAFE = re.compile(r"[^A-Za-z0-9_-]")  # server-side adapter names stay plain: no dots, colons or slashes


# -- who the server is -----------------------------------------------------------------------
@dataclass(frozen=True)
class ServerReasons:
    """The error reasons an engine server's failures carry (stable wire vocabulary)."""

    unreachable: Reason
    down: Reason
    connection_lost: Reason
    stream_cut: Reason
    timeout: Reason
    start_timeout: Reason
    start_failed: Reason
    by_status: Mapping[int, Reason]  # HTTP status of a refused call -> reason
    other: Reason  # any other HTTP error


@dataclass(frozen=True)
class ServerKind:
    """Names one kind of engine server in sentences (`label`), config keys and log events
    (`key`), error reasons, and the action to suggest per HTTP status (`hints`)."""

    label: str
    key: str
    reasons: ServerReasons
    hints: Mapping[int, str] = field(default_factory=dict)
    health_path: str = "/health"


# -- errors ----------------------------------------------------------------------------------
_CLASS_BY_STATUS: dict[int, type[RollwireError]] = {
    400: InvalidArgument,
    401: Unauthenticated,
    403: PermissionDenied,
    404: FailedPrecondition,
    408: DeadlineExceeded,
    413: InvalidArgument,
    422: InvalidArgument,
    429: ResourceExhausted,
    500: Internal,
    503: Unavailable,
    504: DeadlineExceeded,
}


def status_of(err) -> int:
    """The HTTP status an in-stream error object carries (its `code`), 400 when it has none."""
    code = err.get("code") if isinstance(err, dict) else None
    return code if isinstance(code, int) and 400 <= code < 600 else 400


def server_message(body) -> str:
    """The server's own sentence from any of its error bodies (SGLang's, vLLM's, FastAPI's)."""
    if isinstance(body, dict):
        err = body.get("error", body.get("error_message", body.get("message", body.get("detail"))))
        if isinstance(err, dict):
            err = err.get("message", err)
        if err:
            return str(err)
    return str(body)[:500] if body else "(empty body)"


def error_from_body(kind: ServerKind, status: int, body, what: str) -> RollwireError:
    """A RollwireError for a server's error reply: the server's message, a status, an action."""
    cls = _CLASS_BY_STATUS.get(status, Unavailable if status >= 500 else InvalidArgument)
    reason = kind.reasons.by_status.get(status, kind.reasons.other)
    message = f"{kind.label} {what} failed (HTTP {status} {_phrase(status)}): {server_message(body)}"
    if status in kind.hints:
        message += f"; {kind.hints[status]}"
    retry = 1.0 if cls in (Unavailable, ResourceExhausted) else None
    return cls(message, reason=reason, retry_after_s=retry)


def error_from_reply(kind: ServerKind, status: int, raw: bytes, what: str) -> RollwireError:
    try:
        body = json.loads(raw) if raw else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        body = raw.decode("utf-8", "replace")
    return error_from_body(kind, status, body, what)


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return ""


def transport_error(kind: ServerKind, exc: Exception, url: str, what: str, timeout_s: float) -> RollwireError:
    """The status for a failed connection to the server, with what to do about it."""
    if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
        return Unavailable(
            f"cannot reach {kind.label} at {url} for {what} ({exc}); it is down or restarting, retry shortly",
            reason=kind.reasons.unreachable,
            retry_after_s=2.0,
        )
    if isinstance(exc, httpx.ReadTimeout):
        return DeadlineExceeded(
            f"{kind.label} at {url} sent nothing for {timeout_s:g}s during {what}; it may be overloaded or hung "
            f"(raise {kind.key}.request_timeout_s for very long generations)",
            reason=kind.reasons.timeout,
        )
    return Unavailable(
        f"{kind.label} at {url} dropped the connection during {what} ({type(exc).__name__}: {exc}); it probably "
        "crashed or restarted, so any partial samples are void: retry the whole group",
        reason=kind.reasons.connection_lost,
        retry_after_s=2.0,
    )


# -- transport -------------------------------------------------------------------------------
class ServerHTTP:
    """JSON and event-stream calls to one server, errors mapped to RollwireError."""

    def __init__(
        self, kind: ServerKind, base_url: str, *, api_key: str | None, admin_key: str | None, timeout_s: float
    ) -> None:
        self.kind = kind
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
        # Admin routes take the admin key when one is set, else the API key (SGLang's rule;
        # vLLM has one key).
        key = (self._admin_key or self._api_key) if admin else self._api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    async def get_json(self, path: str, what: str, timeout_s: float | None = None) -> dict:
        with self._mapped(what):
            resp = await self.client.get(path, headers=self._headers(False), timeout=timeout_s or self.timeout_s)
        return self._json_or_raise(resp.status_code, resp.content, what)

    async def post_json(self, path: str, body: dict, what: str, *, admin: bool = False) -> dict:
        with self._mapped(what):
            resp = await self.client.post(path, json=body, headers=self._headers(admin))
        return self._json_or_raise(resp.status_code, resp.content, what)

    @contextlib.asynccontextmanager
    async def stream_lines(self, path: str, body: dict, what: str) -> AsyncIterator[AsyncIterator[str]]:
        """POST and iterate the response's lines; leaving the block closes the connection."""
        with self._mapped(what):
            async with self.client.stream("POST", path, json=body, headers=self._headers(False)) as resp:
                if resp.status_code != 200:
                    raise error_from_reply(self.kind, resp.status_code, await resp.aread(), what)
                yield resp.aiter_lines()

    async def healthy(self) -> tuple[bool, str]:
        """(True, "") when the health route answers 200, else (False, why)."""
        try:
            resp = await self.client.get(self.kind.health_path, timeout=5.0)
        except httpx.HTTPError as exc:
            return False, f"{type(exc).__name__}: {exc}"
        return resp.status_code == 200, f"HTTP {resp.status_code}"

    @contextlib.contextmanager
    def _mapped(self, what: str):
        try:
            yield
        except httpx.TransportError as exc:
            self.on_transport_error()
            raise transport_error(self.kind, exc, self.base_url, what, self.timeout_s) from None

    def _json_or_raise(self, status: int, raw: bytes, what: str) -> dict:
        if status != 200:
            raise error_from_reply(self.kind, status, raw, what)
        try:
            body = json.loads(raw) if raw else {}
        except json.JSONDecodeError:
            body = {"text": raw.decode("utf-8", "replace")}  # vLLM answers a LoRA load in plain text
        if isinstance(body, dict) and body.get("success") is False:
            raise error_from_reply(self.kind, 400, raw, what)
        return body if isinstance(body, dict) else {"value": body}

    async def aclose(self) -> None:
        await self.client.aclose()


def parse_sse_line(line: str, kind: ServerKind):
    """One line of an event stream: a chunk dict, DONE, or None for blank/other lines."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return DONE
    try:
        chunk = json.loads(data)
    except json.JSONDecodeError:
        raise Internal(f"{kind.label} sent a stream line that is not JSON: {data[:200]!r}") from None
    if not isinstance(chunk, dict):
        raise Internal(f"{kind.label} sent a stream chunk that is not an object: {data[:200]!r}")
    return chunk


DONE = object()  # the `data: [DONE]` sentinel


# -- launching -------------------------------------------------------------------------------
def free_port(host: str) -> int:
    """A port free now on `host` (another process may take it before the server binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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
    ) -> None:
        self.kind, self.http, self.process, self.on_ready = kind, http, process, on_ready
        self.startup_timeout_s, self.health_interval_s, self.max_restarts = (
            startup_timeout_s,
            health_interval_s,
            max_restarts,
        )
        self.up = False
        self.down_reason = f"{kind.label} has not started yet"
        self.restarts = 0
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
        self._task = asyncio.get_running_loop().create_task(watch())

    def check_up(self) -> None:
        if not self.up:
            raise Unavailable(
                f"this replica's {self.kind.label} cannot serve right now: {self.down_reason}; retry shortly or on "
                "another replica",
                reason=self.kind.reasons.down,
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
            reason=self.kind.reasons.start_timeout,
        )

    def _raise_if_exited(self) -> None:
        if self.process is not None and self.process.returncode is not None:
            raise FailedPrecondition(
                f"{self.kind.label} exited with code {self.process.returncode} while starting; its log "
                f"({self.process.log_path}) ends with:\n{self.process.log_tail()}",
                reason=self.kind.reasons.start_failed,
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

    async def _watch_process(self) -> None:
        """Restart a launched server each time it exits, up to max_restarts."""
        assert self.process is not None, "only a launched server is watched"
        label = self.kind.label
        while True:
            code = await self.process.wait()
            if self._stopping:
                return
            await self._mark_down(f"{label} exited with code {code} and is being restarted")
            if self.restarts >= self.max_restarts:
                self.down_reason = (
                    f"{label} exited with code {code} after {self.restarts} restarts; the replica gave up "
                    f"(see {self.process.log_path}) and must be restarted"
                )
                log.error(f"{self.kind.key}_gave_up", restarts=self.restarts, log=str(self.process.log_path))
                await self._notify()
                return
            self.restarts += 1
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


# -- adapter files ---------------------------------------------------------------------------
def peft_config(manifest: Manifest, payload: bytes, base_model: str) -> dict:
    """adapter_config.json for a pushed payload, as PEFT writes it and the servers read it.

    Target modules are the ones the tensors really adapt. SGLang scales by lora_alpha / r and
    has no rsLoRA (vLLM follows the file), so an rsLoRA adapter (alpha / sqrt(r)) is written
    with lora_alpha * sqrt(r): the same scaling, exactly, for both.
    """
    modules = sorted({name.split(".lora_")[0].rsplit(".", 1)[-1] for name in read_header(payload) if ".lora_" in name})
    alpha = manifest.lora.lora_alpha * (math.sqrt(manifest.lora.r) if manifest.lora.use_rslora else 1.0)
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": manifest.lora.r,
        "lora_alpha": alpha,
        "target_modules": modules,
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": None,
    }


def write_peft_folder(root: Path, name: str, manifest: Manifest, payload: bytes, base_model: str) -> Path:
    """Write the PEFT folder under a temporary name, fsync it, then rename it into place."""
    final = root / name
    if final.exists():
        raise Internal(f"adapter folder {final} already exists; adapter names are never reused, so it is stale")
    with atomic_dir(final, replace=False) as tmp:
        write_synced(tmp / "adapter_model.safetensors", payload)
        write_synced(
            tmp / "adapter_config.json", json.dumps(peft_config(manifest, payload, base_model), indent=1).encode()
        )
    return final


def read_secret(path: str, key: str) -> str | None:
    """A key from a file named in config (never from the environment, never logged)."""
    if not path:
        return None
    try:
        return read_secret_file(path, key)
    except SecretFileError as exc:
        raise FailedPrecondition(str(exc)) from None


def find_key(tree, key: str):
    """The value of `key` anywhere in nested dicts (SGLang's /server_info nests by version)."""
    if isinstance(tree, dict):
        if key in tree:
            return tree[key]
        for value in tree.values():
            found = find_key(value, key)
            if found is not None:
                return found
    return None


# -- the engine skeleton ---------------------------------------------------------------------
class ServedSettings(Protocol):
    """The settings every served engine's config section has (SGLangSection, VLLMSection)."""

    url: str
    host: str
    port: int
    max_lora_rank: int
    max_loaded_adapters: int
    api_key_file: str
    adapter_dir: str
    adapter_dir_on_server: str
    startup_timeout_s: float
    request_timeout_s: float
    health_interval_s: float
    max_restarts: int
    max_concurrent_groups: int


@dataclass
class ServedAdapter:
    """One adapter version as the server knows it."""

    lora_name: str
    folder: Path  # on this replica's disk
    server_path: str  # the same folder as the server sees it
    label: str  # "name vN" for messages


class ServedEngine:
    """An engine whose model runs in a server beside the replica; see the module docstring.

    Subclasses set `name` and `kind` and provide the server's dialect: `_launch` (command
    line and environment of a launched server), `_after_start` (read what the server says
    about itself), `_server_load` / `_server_unload` (one adapter) and `generate`.
    """

    name = "served"
    kind: ServerKind

    def __init__(self, model_dir: str | Path, settings: ServedSettings, *, adapter_window: int) -> None:
        self.model_dir = Path(model_dir)
        self.settings = settings
        self.max_adapters = settings.max_loaded_adapters or adapter_window + 1
        self.vocab_size = 0
        self.max_context = 0
        self.server_version = ""
        self.supervisor: Supervisor | None = None
        self.http: ServerHTTP | None = None
        self._adapters: dict[str, ServedAdapter] = {}  # registry handle -> server adapter, load order
        self._nonce = secrets.token_hex(3)
        self._rids = itertools.count(1)
        self._slots = GroupSlots(settings.max_concurrent_groups)
        self._aborts: set[asyncio.Task] = set()
        self._own_dir = False
        self.adapter_dir = Path()
        self._work_dir = Path()

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        await asyncio.to_thread(self._load_model_files)
        self._prepare_adapter_dir()
        api_key, admin_key = self._read_keys()
        process, url = None, self.settings.url
        if not url:
            port = self.settings.port or free_port(self.settings.host)
            url = f"http://{self.settings.host}:{port}"
            argv, env = self._launch(port, api_key, admin_key)
            process = ServerProcess(self.kind, argv, self._work_dir / f"{self.kind.key}.log", env)
        self.http = ServerHTTP(
            self.kind, url, api_key=api_key, admin_key=admin_key, timeout_s=self.settings.request_timeout_s
        )
        self.supervisor = Supervisor(
            self.kind,
            self.http,
            process,
            on_ready=self._reload_adapters,
            startup_timeout_s=self.settings.startup_timeout_s,
            health_interval_s=self.settings.health_interval_s,
            max_restarts=self.settings.max_restarts,
        )
        try:
            await self.supervisor.start()
        except BaseException:
            await self.supervisor.stop()
            raise
        await self._after_start()

    def _read_keys(self) -> tuple[str | None, str | None]:
        return read_secret(self.settings.api_key_file, f"{self.kind.key}.api_key_file"), None

    def _launch(self, port: int, api_key: str | None, admin_key: str | None) -> tuple[list[str], dict[str, str]]:
        raise NotImplementedError

    async def _after_start(self) -> None:
        """Read what the server says about itself once it serves (version, limits)."""

    def _load_model_files(self) -> None:
        from transformers import AutoTokenizer

        config_path = self.model_dir / "config.json"
        if not config_path.is_file():
            raise FailedPrecondition(f"{self.model_dir} is not a local Hugging Face model folder (no config.json)")
        config = json.loads(config_path.read_text())
        self.vocab_size = int(config["vocab_size"])
        self.max_context = int(config.get("max_position_embeddings") or 1 << 30)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self._text_backend = backend(self.tokenizer)

    def _prepare_adapter_dir(self) -> None:
        if self.settings.adapter_dir:
            self.adapter_dir = Path(self.settings.adapter_dir)
            self.adapter_dir.mkdir(parents=True, exist_ok=True)
        else:
            self.adapter_dir = Path(tempfile.mkdtemp(prefix=f"rollwire-{self.kind.key}-"))
            self._own_dir = True
        # Adapter names start with a letter or digit, so "_sglang"/"_vllm" never collides with one.
        self._work_dir = self.adapter_dir / f"_{self.kind.key}"
        self._work_dir.mkdir(exist_ok=True, mode=0o700)

    @property
    def api(self) -> ServerHTTP:
        """The server's HTTP client; only a started engine has one."""
        if self.http is None:
            raise RuntimeError(f"the {self.name} engine is not started")
        return self.http

    @property
    def process(self) -> ServerProcess | None:
        """The launched server, or None for a server given by URL (or before start)."""
        return None if self.supervisor is None else self.supervisor.process

    async def close(self) -> None:
        if self.supervisor is not None and self.supervisor.process is None and self.supervisor.up:
            for handle in list(self._adapters):  # a server we did not start outlives us: leave it clean
                await self.unload_adapter(handle)
        if self.supervisor is not None:
            await self.supervisor.stop()
        if self._aborts:
            await asyncio.gather(*list(self._aborts), return_exceptions=True)
        if self.http is not None:
            await self.http.aclose()
        for adapter in self._adapters.values():
            shutil.rmtree(adapter.folder, ignore_errors=True)
        if self._own_dir:
            shutil.rmtree(self.adapter_dir, ignore_errors=True)

    # -- serving ---------------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def stats(self) -> EngineStats:
        return self._slots.stats()

    def check_up(self) -> None:
        """Refuse at once (UNAVAILABLE, retry hint) while the server cannot serve."""
        if self.supervisor is None:
            raise RuntimeError(f"the {self.name} engine is not started")
        self.supervisor.check_up()

    def _text_stream(self) -> TextStream:
        return TextStream(self._text_backend)

    def _lora_name(self, handle: str | None, label: str) -> str | None:
        if handle is None:
            return None
        adapter = self._adapters.get(handle)
        if adapter is None:
            raise Internal(f"adapter {label} is leased but not loaded in {self.kind.label}")
        return adapter.lora_name

    def _abort_later(self, send: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run an abort call in the background; close() waits for the ones still running."""
        if self.http is None:
            return
        task = asyncio.get_running_loop().create_task(send())
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    # -- adapters ----------------------------------------------------------------------------
    async def load_adapter(self, handle: str, manifest: Manifest, payload: bytes) -> None:
        self._check_adapter(manifest)
        label = f"{manifest.name} v{manifest.version}"
        lora_name = f"{_SAFE.sub('_', manifest.name)}-v{manifest.version}-{handle}-{self._nonce}"
        folder = await asyncio.to_thread(
            write_peft_folder, self.adapter_dir, lora_name, manifest, payload, str(self.model_dir)
        )
        adapter = ServedAdapter(lora_name, folder, self._server_path(lora_name), label)
        try:
            self.check_up()
            await self._server_load(adapter)
        except BaseException:
            await asyncio.to_thread(shutil.rmtree, folder, True)
            raise
        self._adapters[handle] = adapter
        log.info(
            f"{self.kind.key}_adapter_loaded", adapter=manifest.name, version=manifest.version, lora_name=lora_name
        )

    def _check_adapter(self, m: Manifest) -> None:
        key = self.kind.key
        if m.lora.r > self.settings.max_lora_rank:
            raise FailedPrecondition(
                f"adapter {m.name!r} v{m.version} has rank r={m.lora.r}, above {key}.max_lora_rank="
                f"{self.settings.max_lora_rank} that {self.kind.label} reserved memory for at start-up; push r<="
                f"{self.settings.max_lora_rank} or restart the replica with a larger {key}.max_lora_rank",
                reason=Reason.LORA_RANK_TOO_LARGE,
            )
        if len(self._adapters) >= self.max_adapters:
            raise ResourceExhausted(
                f"{self.kind.label} already holds {len(self._adapters)} adapter versions (its limit: the window plus "
                "one for the swap) and the oldest still serve in-flight requests; retry the push when they finish, "
                f"or raise {key}.max_loaded_adapters",
                reason=Reason.ADAPTER_SLOTS_FULL,
                retry_after_s=1.0,
            )

    def _server_path(self, lora_name: str) -> str:
        root = self.settings.adapter_dir_on_server or str(self.adapter_dir)
        return f"{root.rstrip('/')}/{lora_name}"

    async def _server_load(self, adapter: ServedAdapter) -> None:
        raise NotImplementedError

    async def _server_unload(self, adapter: ServedAdapter) -> None:
        raise NotImplementedError

    def _already_loaded(self, err: RollwireError) -> bool:
        """Whether a refused load means the server still holds the adapter (it outlived a blip)."""
        return "already" in err.message and "loaded" in err.message

    async def unload_adapter(self, handle: str) -> None:
        adapter = self._adapters.get(handle)
        if adapter is None:
            return
        key = self.kind.key
        try:
            await self._server_unload(adapter)
        except Unavailable as err:  # the server is down: a restarted server will not have it either
            log.warning(f"{key}_unload_skipped", lora_name=adapter.lora_name, error=err.message)
        except RollwireError as err:  # the server keeps it: keep counting it, keep its files
            log.error(f"{key}_unload_failed", lora_name=adapter.lora_name, error=err.message)
            return
        del self._adapters[handle]
        await asyncio.to_thread(shutil.rmtree, adapter.folder, True)
        log.info(f"{key}_adapter_unloaded", lora_name=adapter.lora_name)

    async def _reload_adapters(self) -> None:
        """After the server (re)starts: load every adapter still held, oldest first."""
        for adapter in list(self._adapters.values()):
            try:
                await self._server_load(adapter)
            except RollwireError as err:
                if not self._already_loaded(err):
                    raise
        if self._adapters:
            log.info(f"{self.kind.key}_adapters_reloaded", count=len(self._adapters))
