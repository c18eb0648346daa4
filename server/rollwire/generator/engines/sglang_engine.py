"""The sglang engine: generation and LoRA adapters served by a real SGLang server.

The replica keeps everything rollwire promises (versions, the window, leases, statuses) and
SGLang does the batching on the accelerator. SGLang is launched as a child process with LoRA
enabled (sglang_process.py) or reached by URL; this module speaks its native HTTP API
(sglang_protocol.py holds the exact bodies and the stream parser).

Invariants:
- an adapter version is written to this replica's disk in full (PEFT folder:
  adapter_config.json + adapter_model.safetensors), fsynced and renamed into place before
  SGLang is asked to load it, under a name never used before (adapter, version, the
  registry's never-reused handle and a per-start nonce), so no cache entry of an old policy
  is ever served under a new version, even by an SGLang that outlived a replica restart;
- an adapter is unloaded from SGLang before its files are deleted, and only when the
  registry says no request uses it; the engine never holds more adapters than the limit
  SGLang was started with, so SGLang's own LRU eviction never unloads a servable version;
- after SGLang restarts, every adapter the registry still holds is loaded again before the
  replica serves again;
- closing a generate stream closes the HTTP stream and aborts its SGLang requests.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import re
import secrets
import shutil
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from rollwire.common.durable import atomic_dir, write_synced
from rollwire.common.errors import FailedPrecondition, Internal, ResourceExhausted, RollwireError, Unavailable
from rollwire.common.logs import get_logger
from rollwire.common.reasons import Reason
from rollwire.common.safetensors_header import read_header
from rollwire.common.secrets import SecretFileError, read_secret_file
from rollwire.generator.adapters import Manifest
from rollwire.generator.config import GeneratorConfig, SGLangSection
from rollwire.generator.detokenize import TextStream, backend
from rollwire.generator.engines.base import EngineStats, GroupSlots
from rollwire.generator.engines.sglang_process import (
    SGLangHTTP,
    SGLangProcess,
    Supervisor,
    free_port,
    launch_argv,
    write_key_config,
)
from rollwire.generator.engines.sglang_protocol import (
    DONE,
    TARGET_VERSION,
    StreamTracker,
    abort_body,
    generate_body,
    load_lora_body,
    parse_sse_line,
    unload_lora_body,
)
from rollwire.generator.types import Event, GroupRequest

log = get_logger(__name__)
_SAFE = re.compile(r"[^A-Za-z0-9_-]")  # SGLang's names stay plain: no dots, colons or slashes


@dataclass
class _Adapter:
    """One adapter version as SGLang knows it."""

    lora_name: str
    folder: Path  # on this replica's disk
    server_path: str  # the same folder as SGLang sees it
    label: str  # "name vN" for messages


class SGLangEngine:
    """Engine over an SGLang server; see the module docstring for the invariants."""

    name = "sglang"

    def __init__(self, model_dir: str | Path, settings: SGLangSection, *, adapter_window: int) -> None:
        self.model_dir = Path(model_dir)
        self.settings = settings
        self.max_adapters = settings.max_loaded_adapters or adapter_window + 1
        self.vocab_size = 0
        self.max_context = 0
        self.honours_seeds = settings.deterministic
        self.server_version = ""
        self.supervisor: Supervisor | None = None
        self.http: SGLangHTTP | None = None
        self._adapters: dict[str, _Adapter] = {}  # registry handle -> SGLang adapter, load order
        self._nonce = secrets.token_hex(3)
        self._rids = itertools.count(1)
        self._slots = GroupSlots(settings.max_concurrent_groups)
        self._aborts: set[asyncio.Task] = set()
        self._own_dir = False
        self.adapter_dir = Path()

    @classmethod
    def from_config(cls, config: GeneratorConfig) -> SGLangEngine:
        return cls(config.model, config.sglang, adapter_window=config.adapter_window)

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        await asyncio.to_thread(self._load_model_files)
        self._prepare_adapter_dir()
        api_key, admin_key = (
            _read_secret(self.settings.api_key_file, "sglang.api_key_file"),
            _read_secret(self.settings.admin_api_key_file, "sglang.admin_api_key_file"),
        )
        process, url = None, self.settings.url
        if not url:
            port = self.settings.port or free_port(self.settings.host)
            url = f"http://{self.settings.host}:{port}"
            process = SGLangProcess(self._launch_argv(port, api_key, admin_key), self._work_dir / "sglang.log")
        self.http = SGLangHTTP(url, api_key=api_key, admin_key=admin_key, timeout_s=self.settings.request_timeout_s)
        self.supervisor = Supervisor(
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
        await self._read_server_info()

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
            self.adapter_dir, self._own_dir = Path(tempfile.mkdtemp(prefix="rollwire-sglang-")), True
        # Adapter names start with a letter or digit, so "_sglang" never collides with one.
        self._work_dir = self.adapter_dir / "_sglang"
        self._work_dir.mkdir(exist_ok=True, mode=0o700)

    def _launch_argv(self, port: int, api_key: str | None, admin_key: str | None) -> list[str]:
        s = self.settings
        return launch_argv(
            command=s.launch_command,
            model=str(self.model_dir),
            host=s.host,
            port=port,
            max_lora_rank=s.max_lora_rank,
            target_modules=s.lora_target_modules,
            max_loaded=self.max_adapters,
            deterministic=s.deterministic,
            random_seed=s.random_seed,
            config_file=write_key_config(self._work_dir / "keys.json", api_key, admin_key),
            extra_args=s.extra_args,
        )

    @property
    def api(self) -> SGLangHTTP:
        """The SGLang HTTP client; only a started engine has one."""
        if self.http is None:
            raise RuntimeError("the sglang engine is not started")
        return self.http

    async def _read_server_info(self) -> None:
        info = await self.api.get_json("/server_info", "reading /server_info")
        self.server_version = str(info.get("version", ""))
        deterministic = _find_key(info, "enable_deterministic_inference")
        if deterministic is not None:
            self.honours_seeds = bool(deterministic)
        if self.server_version and self.server_version != TARGET_VERSION:
            log.warning("sglang_version_untested", version=self.server_version, tested=TARGET_VERSION)
        log.info(
            "engine_loaded",
            engine=self.name,
            url=self.api.base_url,
            sglang=self.server_version,
            seeds=self.honours_seeds,
            max_adapters=self.max_adapters,
            adapter_dir=str(self.adapter_dir),
        )

    async def close(self) -> None:
        if self.supervisor is not None and self.supervisor.process is None and self.supervisor.up:
            for handle in list(self._adapters):  # an SGLang we did not start outlives us: leave it clean
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

    async def generate(self, group: GroupRequest) -> AsyncIterator[list[Event]]:
        self.supervisor.check_up()  # pyright: ignore[reportOptionalMemberAccess]  # set by start()
        seeds = self._seeds(group)
        lora = self._lora_name(group)
        rid = f"{group.request_id}.{next(self._rids)}"
        body, rids = generate_body(group, lora, seeds, rid)
        tracker = StreamTracker(group, self._text_stream)
        async with self._slots.held():
            try:
                async with self.api.stream_lines("/generate", body, f"generation of {rid}") as lines:
                    async for line in lines:
                        item = parse_sse_line(line)
                        if item is DONE:
                            break
                        if isinstance(item, dict) and (events := tracker.feed(item)):
                            yield events
                if not tracker.complete:
                    raise Unavailable(
                        f"SGLang ended the stream of {rid} before all {group.n} samples finished; "
                        "the partial samples are void, retry the group",
                        reason=Reason.SGLANG_STREAM_CUT,
                        retry_after_s=1.0,
                    )
            finally:
                if not tracker.complete:
                    self._abort(rids or sorted(tracker.rids))

    def _seeds(self, group: GroupRequest) -> list[int] | None:
        if group.sampling.seed is None:
            return None
        if not self.honours_seeds:
            raise FailedPrecondition(
                "this replica's SGLang runs without --enable-deterministic-inference, so it would ignore the "
                "request's seed; drop the seed or start the replica with sglang.deterministic=true",
                reason=Reason.SEED_UNSUPPORTED,
            )
        from rollwire.generator.sampling import sample_seed  # one definition of per-sample seeds

        return [sample_seed(group.sampling.seed, i) % (1 << 31) for i in range(group.n)]

    def _lora_name(self, group: GroupRequest) -> str | None:
        if group.adapter.handle is None:
            return None
        adapter = self._adapters.get(group.adapter.handle)
        if adapter is None:
            raise Internal(
                f"adapter {group.adapter.name!r} v{group.adapter.version} is leased but not loaded in SGLang"
            )
        return adapter.lora_name

    def _text_stream(self) -> TextStream:
        return TextStream(self._text_backend)

    def _abort(self, rids: list[str]) -> None:
        """Ask SGLang to stop the given requests now (closing the stream stops them too, later)."""
        if not rids or self.http is None:
            return
        task = asyncio.get_running_loop().create_task(self._send_aborts(rids))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def _send_aborts(self, rids: list[str]) -> None:
        for rid in rids:
            try:
                await self.api.post_json("/abort_request", abort_body(rid), f"aborting {rid}", admin=True)
            except RollwireError as err:
                log.info("sglang_abort_failed", rid=rid, error=err.message)

    # -- adapters ----------------------------------------------------------------------------
    async def load_adapter(self, handle: str, manifest: Manifest, payload: bytes) -> None:
        self._check_adapter(manifest)
        label = f"{manifest.name} v{manifest.version}"
        lora_name = f"{_SAFE.sub('_', manifest.name)}-v{manifest.version}-{handle}-{self._nonce}"
        folder = await asyncio.to_thread(
            write_peft_folder, self.adapter_dir, lora_name, manifest, payload, str(self.model_dir)
        )
        adapter = _Adapter(lora_name, folder, self._server_path(lora_name), label)
        try:
            self.supervisor.check_up()  # pyright: ignore[reportOptionalMemberAccess]  # set by start()
            await self._sglang_load(adapter)
        except BaseException:
            await asyncio.to_thread(shutil.rmtree, folder, True)
            raise
        self._adapters[handle] = adapter
        log.info("sglang_adapter_loaded", adapter=manifest.name, version=manifest.version, lora_name=lora_name)

    def _check_adapter(self, m: Manifest) -> None:
        if m.lora.r > self.settings.max_lora_rank:
            raise FailedPrecondition(
                f"adapter {m.name!r} v{m.version} has rank r={m.lora.r}, above sglang.max_lora_rank="
                f"{self.settings.max_lora_rank} that SGLang reserved memory for at start-up; push r<="
                f"{self.settings.max_lora_rank} or restart the replica with a larger sglang.max_lora_rank",
                reason=Reason.LORA_RANK_TOO_LARGE,
            )
        if len(self._adapters) >= self.max_adapters:
            raise ResourceExhausted(
                f"SGLang already holds {len(self._adapters)} adapter versions (its limit: the window plus one "
                "for the swap) and the oldest still serve in-flight requests; retry the push when they finish, "
                "or raise sglang.max_loaded_adapters",
                reason=Reason.ADAPTER_SLOTS_FULL,
                retry_after_s=1.0,
            )

    def _server_path(self, lora_name: str) -> str:
        root = self.settings.adapter_dir_on_server or str(self.adapter_dir)
        return f"{root.rstrip('/')}/{lora_name}"

    async def _sglang_load(self, adapter: _Adapter) -> None:
        await self.api.post_json(
            "/load_lora_adapter",
            load_lora_body(adapter.lora_name, adapter.server_path),
            f"loading adapter {adapter.label}",
            admin=True,
        )

    async def unload_adapter(self, handle: str) -> None:
        adapter = self._adapters.get(handle)
        if adapter is None:
            return
        try:
            await self.api.post_json(
                "/unload_lora_adapter",
                unload_lora_body(adapter.lora_name),
                f"unloading adapter {adapter.label}",
                admin=True,
            )
        except Unavailable as err:  # SGLang is down: a restarted SGLang will not have it either
            log.warning("sglang_unload_skipped", lora_name=adapter.lora_name, error=err.message)
        except RollwireError as err:  # SGLang keeps it: keep counting it, keep its files
            log.error("sglang_unload_failed", lora_name=adapter.lora_name, error=err.message)
            return
        del self._adapters[handle]
        await asyncio.to_thread(shutil.rmtree, adapter.folder, True)
        log.info("sglang_adapter_unloaded", lora_name=adapter.lora_name)

    async def _reload_adapters(self) -> None:
        """After SGLang (re)starts: load every adapter still held, oldest first."""
        for adapter in list(self._adapters.values()):
            try:
                await self._sglang_load(adapter)
            except RollwireError as err:
                if "already loaded" not in err.message:  # an SGLang that outlived a blip still has it
                    raise
        if self._adapters:
            log.info("sglang_adapters_reloaded", count=len(self._adapters))


# -- adapter files ---------------------------------------------------------------------------
def peft_config(manifest: Manifest, payload: bytes, base_model: str) -> dict:
    """adapter_config.json for a pushed payload, as PEFT writes it and SGLang reads it.

    Target modules are the ones the tensors really adapt. SGLang scales by lora_alpha / r
    and has no rsLoRA, so an rsLoRA adapter (alpha / sqrt(r)) is written with
    lora_alpha * sqrt(r): the same scaling, exactly.
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


def _read_secret(path: str, key: str) -> str | None:
    """A key from a file named in config (never from the environment, never logged)."""
    if not path:
        return None
    try:
        return read_secret_file(path, key)
    except SecretFileError as exc:
        raise FailedPrecondition(str(exc)) from None


def _find_key(tree, key: str):
    """The value of `key` anywhere in nested dicts (SGLang's /server_info nests by version)."""
    if isinstance(tree, dict):
        if key in tree:
            return tree[key]
        for value in tree.values():
            found = _find_key(value, key)
            if found is not None:
                return found
    return None
