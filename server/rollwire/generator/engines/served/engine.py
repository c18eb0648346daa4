"""The engine skeleton the engines that drive a model server beside the replica share (sglang, vllm).

`ServedEngine` keeps the registry's adapter versions loaded in the server and runs every
group as a chain of segments (follow.py): one request normally, continuations under
the new version when a following group switches. The parts live beside it: http.py
(who the server is, its errors, HTTP), process.py (launch and supervision),
files.py (adapter folders and keys on disk). An engine module adds only its server's
dialect: the generation call (`_call`), its abort, the load/unload bodies and its launch
command line.

Invariants (with those of the parts):
- an adapter version is loaded under a name never used before (adapter, version, the
  registry's never-reused handle, a per-start nonce); it is unloaded from the server before
  its files are deleted, only when the registry says no request uses it and no segment of
  this engine still streams from it (a follower's old version is released by the servicer
  at the switch, a chunk before the segment that used it is closed), and the engine never
  holds more adapters than the server was sized for;
- after the server restarts, every adapter the registry still holds is loaded again before
  the replica serves again;
- a segment that ends before all its samples finished is closed and aborted in the server;
  a stream that ends early fails the group with the server's STREAM_CUT reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import re
import secrets
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

from rollwire.common.errors import (
    FailedPrecondition,
    Internal,
    ResourceExhausted,
    RollwireError,
    Unavailable,
    Unimplemented,
)
from rollwire.common.manifest import Manifest
from rollwire.common.reasons import Reason
from rollwire.generator.detokenize import TextStream, backend
from rollwire.generator.engines.base import EngineStats, GroupSlots
from rollwire.generator.engines.served.files import find_key, peft_config, read_secret, write_peft_folder
from rollwire.generator.engines.served.follow import FollowRun, Segments
from rollwire.generator.engines.served.http import (
    DONE,
    ServerHTTP,
    ServerKind,
    error_from_body,
    error_from_reply,
    parse_sse_line,
    server_message,
    status_of,
)
from rollwire.generator.engines.served.process import ServerProcess, Supervisor, free_port
from rollwire.generator.engines.settings import ServedSection
from rollwire.generator.types import Event, GroupRequest, ScoreJob
from rollwire.push.buffers import Payload
from rollwire.runtime.logs import get_logger

log = get_logger(__name__)
_SAFE = re.compile(r"[^A-Za-z0-9_-]")  # server-side adapter names stay plain: no dots, colons or slashes


class Tracker(Protocol):
    """Turns one generation request's streamed chunks into events (the server's dialect)."""

    @property
    def complete(self) -> bool: ...

    def feed(self, chunk: dict) -> list[Event]: ...


@dataclass
class ServerCall:
    """One generation request in the server's dialect: where to send it, the body, its
    tracker and the request ids to abort it by."""

    path: str
    body: dict
    tracker: Tracker
    abort_ids: Callable[[], list[str]]


class _NoText:
    """A tracker's detokenizer when FollowRun makes the text (one stream per sample over all its segments)."""

    def add(self, ids) -> str:
        return ""

    def finish(self) -> str:
        return ""


NO_TEXT = cast(Callable[[], TextStream], _NoText)


# -- the engine skeleton ---------------------------------------------------------------------
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
    about itself), `_server_load` / `_server_unload` (one adapter), `_call` (one generation
    request) and `_send_abort`; `check` refuses what the server cannot honour.
    """

    name = "served"
    kind: ServerKind
    follows_versions = True
    serves_patterns = False
    """Whether the server reads PEFT's rank_pattern / alpha_pattern from adapter_config.json (vLLM's
    PEFTHelper does; SGLang 0.5.23's LoRA config keeps one r and alpha per adapter)."""
    """Follows by continuation (follow.py): a switch costs a prefill of prompt + generated tokens."""
    resumes_samples = True
    """Continues samples by continuation too (follow.py): same version and distribution, not token-exact."""

    def __init__(self, model_dir: str | Path, settings: ServedSection, *, adapter_window: int) -> None:
        self.model_dir = Path(model_dir)
        self.settings = settings
        self.max_adapters = settings.max_loaded_adapters or settings.adapter_names * (adapter_window + 1)
        """The server's LoRA slots: the registry evicts to stay within them (adapters.py, max_loaded)."""
        self.vocab_size = 0
        self.max_context = 0
        self.server_version = ""
        self.supervisor: Supervisor | None = None
        self.http: ServerHTTP | None = None
        self._adapters: dict[str, ServedAdapter] = {}  # registry handle -> server adapter, load order
        self._nonce = secrets.token_hex(3)
        self._rids = itertools.count(1)
        self._slots = GroupSlots(settings.max_concurrent_groups)
        self._aborts: set[asyncio.Task] = set()  # background calls (aborts, deferred unloads)
        self._in_use: dict[str, int] = {}  # registry handle -> segments streaming from it now
        self._unload_deferred: set[str] = set()
        self.eos_ids: frozenset[int] = frozenset()
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
            api_key = api_key or secrets.token_urlsafe(32)  # per launch: no other local process can drive it
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
            restart_window_s=self.settings.restart_window_s,
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
        self.eos_ids = frozenset(_eos_ids(self.model_dir, self.tokenizer))

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

    def check(self, group: GroupRequest) -> None:
        """Refuse, before any work, what this server cannot honour (FAILED_PRECONDITION)."""

    def check_score(self, job: ScoreJob) -> None:
        """Both servers give each prompt token's own logprob (vLLM's `prompt_logprobs`, SGLang's
        `input_token_logprobs`); a Score's top-k is not read from either."""
        if job.top_k:
            raise Unimplemented(
                f"this replica's {self.kind.label} engine scores sequences without top_k; send the Score with "
                "top_k 0, or to a transformers replica (a proxy routes it there)",
                reason=Reason.SCORE_UNSUPPORTED,
            )

    def _call(self, segment: GroupRequest, lora: str | None, rid: str) -> ServerCall:
        raise NotImplementedError

    async def _send_abort(self, ids: list[str]) -> None:
        raise NotImplementedError

    async def generate(self, group: GroupRequest) -> AsyncIterator[list[Event]]:
        """The group's events: one segment, or a chain of them when it follows (follow.py)."""
        self.check_up()
        self.check(group)
        run = FollowRun(group, self._text_stream, self.eos_ids)
        async with self._slots.held():
            while not run.complete:
                async with Segments(self._segment) as segments:
                    for key, segment in run.segments():
                        segments.start(key, segment)
                    while not run.complete:
                        item = await segments.next()
                        if item is None:
                            raise Internal(f"{self.kind.label}'s requests ended before every sample of the group did")
                        if events := run.take(*item):
                            yield events
                        segments.stop_where(run.ended)
                        if run.switched():  # after one chunk at least: every segment makes progress
                            break
                if not run.complete and (events := self._switch(run)):
                    yield events

    def _switch(self, run: FollowRun) -> list[Event]:
        before = run.adapter.version
        events = run.switch()
        log.info(
            f"{self.kind.key}_follow_continued",
            adapter=run.adapter.name,
            version=run.adapter.version,
            previous=before,
            samples=sum(not s.done for s in run.samples),
            reprefill_tokens=sum(len(run.group.prompt_ids) + len(s.tokens) for s in run.samples if not s.done),
        )
        return events

    async def _segment(self, segment: GroupRequest) -> AsyncIterator[list[Event]]:
        """One request to the server, its chunks as events; closed and aborted when left unfinished."""
        label = self.kind.label
        lora = self._lora_name(segment.adapter.handle, f"{segment.adapter.name!r} v{segment.adapter.version}")
        rid = f"{segment.request_id}.{next(self._rids)}.{self._nonce}"
        call = self._call(segment, lora, rid)
        with self._using(segment.adapter.handle):
            try:
                async with self.api.stream_lines(call.path, call.body, f"generation of {rid}") as lines:
                    async for line in lines:
                        item = parse_sse_line(line, self.kind)
                        if item is DONE:
                            break
                        if isinstance(item, dict) and (events := call.tracker.feed(item)):
                            yield events
                if not call.tracker.complete:
                    raise Unavailable(
                        f"{label} ended the stream of {rid} before all {segment.n} samples finished; "
                        "the partial samples are void, retry the group",
                        reason=Reason.ENGINE_SERVER_STREAM_CUT,
                        retry_after_s=1.0,
                    )
            finally:
                if not call.tracker.complete and (ids := call.abort_ids()):
                    self._in_background(lambda: self._send_abort(ids))

    @contextlib.contextmanager
    def _using(self, handle: str | None) -> Iterator[None]:
        """Count a segment streaming from `handle`; an unload deferred meanwhile runs once none does."""
        if handle is None:
            yield
            return
        self._in_use[handle] = self._in_use.get(handle, 0) + 1
        try:
            yield
        finally:
            self._in_use[handle] -= 1
            if not self._in_use[handle]:
                del self._in_use[handle]
                if handle in self._unload_deferred:
                    self._unload_deferred.discard(handle)
                    self._in_background(lambda: self.unload_adapter(handle))

    def _in_background(self, send: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run a call in the background (an abort, a deferred unload); close() waits for the ones still running."""
        if self.http is None:
            return
        task = asyncio.get_running_loop().create_task(send())
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    # -- adapters ----------------------------------------------------------------------------
    async def load_adapter(self, handle: str, manifest: Manifest, payload: Payload) -> None:
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
        if (m.lora.rank_pattern or m.lora.alpha_pattern) and not self.serves_patterns:
            raise FailedPrecondition(
                f"adapter {m.name!r} v{m.version} has a rank_pattern or alpha_pattern, which {self.kind.label} "
                "cannot load (one rank and alpha per adapter); push it to a transformers or vllm replica, or train "
                "with one r and lora_alpha",
                reason=Reason.LORA_CONFIG_UNSUPPORTED,
            )
        if max(m.lora.ranks) > self.settings.max_lora_rank:
            raise FailedPrecondition(
                f"adapter {m.name!r} v{m.version} has rank r={max(m.lora.ranks)}, above {key}.max_lora_rank="
                f"{self.settings.max_lora_rank} that {self.kind.label} reserved memory for at start-up; push r<="
                f"{self.settings.max_lora_rank} or restart the replica with a larger {key}.max_lora_rank",
                reason=Reason.LORA_RANK_TOO_LARGE,
            )
        if len(self._adapters) >= self.max_adapters:
            raise ResourceExhausted(
                f"{self.kind.label} already holds {len(self._adapters)} adapter versions (its limit: "
                f"{key}.adapter_names x (the window plus one for the swap)) and every one serves in-flight requests; "
                f"retry the push when they finish, or raise {key}.adapter_names or {key}.max_loaded_adapters",
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
        if handle in self._in_use:  # a follower's segment still streams from it: unload when it ends
            self._unload_deferred.add(handle)
            log.info(f"{key}_unload_deferred", lora_name=adapter.lora_name)
            return
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


def _eos_ids(model_dir: Path, tokenizer) -> set[int]:
    """The ids that end a sample: the tokenizer's EOS and generation_config.json's (as the servers read them)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    path = model_dir / "generation_config.json"
    if path.is_file():
        value = json.loads(path.read_text()).get("eos_token_id")
        ids |= set(value) if isinstance(value, list) else {value} if isinstance(value, int) else set()
    return ids


__all__ = [
    "DONE",
    "NO_TEXT",
    "ServedAdapter",
    "ServedEngine",
    "ServerCall",
    "ServerHTTP",
    "ServerKind",
    "ServerProcess",
    "Supervisor",
    "error_from_body",
    "error_from_reply",
    "find_key",
    "free_port",
    "parse_sse_line",
    "peft_config",
    "read_secret",
    "server_message",
    "status_of",
    "write_peft_folder",
]
