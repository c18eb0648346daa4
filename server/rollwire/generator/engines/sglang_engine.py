"""The sglang engine: generation and LoRA adapters served by a real SGLang server.

The replica keeps everything rollwire promises (versions, the window, leases, statuses) and
SGLang does the batching on the accelerator. SGLang is launched as a child process with LoRA
enabled (sglang_process.py) or reached by URL; this module speaks its native HTTP API
(sglang_protocol.py holds the exact bodies and the stream parser). Supervision, adapter
folders and the adapter bookkeeping are shared with the vllm engine (served.py).

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

from collections.abc import AsyncIterator
from pathlib import Path

from rollwire.common.errors import FailedPrecondition, RollwireError, Unavailable
from rollwire.common.reasons import Reason
from rollwire.generator.config import GeneratorConfig, SGLangSection
from rollwire.generator.engines.served import (
    ServedAdapter,
    ServedEngine,
    find_key,
    peft_config,
    read_secret,
    write_peft_folder,
)
from rollwire.generator.engines.sglang_process import launch_argv, write_key_config
from rollwire.generator.engines.sglang_protocol import (
    DONE,
    SGLANG,
    TARGET_VERSION,
    StreamTracker,
    abort_body,
    generate_body,
    load_lora_body,
    parse_sse_line,
    unload_lora_body,
)
from rollwire.generator.types import Event, GroupRequest
from rollwire.runtime.logs import get_logger

log = get_logger(__name__)


class SGLangEngine(ServedEngine):
    """Engine over an SGLang server; see the module docstring for the invariants."""

    name = "sglang"
    kind = SGLANG
    settings: SGLangSection

    def __init__(self, model_dir: str | Path, settings: SGLangSection, *, adapter_window: int) -> None:
        super().__init__(model_dir, settings, adapter_window=adapter_window)
        self.honours_seeds = settings.deterministic

    @classmethod
    def from_config(cls, config: GeneratorConfig) -> SGLangEngine:
        return cls(config.model, config.sglang, adapter_window=config.adapter_window)

    # -- lifecycle -------------------------------------------------------------------------
    def _read_keys(self) -> tuple[str | None, str | None]:
        return (
            read_secret(self.settings.api_key_file, "sglang.api_key_file"),
            read_secret(self.settings.admin_api_key_file, "sglang.admin_api_key_file"),
        )

    def _launch(self, port: int, api_key: str | None, admin_key: str | None) -> tuple[list[str], dict[str, str]]:
        s = self.settings
        argv = launch_argv(
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
        return argv, {}

    async def _after_start(self) -> None:
        info = await self.api.get_json("/server_info", "reading /server_info")
        self.server_version = str(info.get("version", ""))
        deterministic = find_key(info, "enable_deterministic_inference")
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

    # -- serving ---------------------------------------------------------------------------
    async def generate(self, group: GroupRequest) -> AsyncIterator[list[Event]]:
        self.check_up()
        seeds = self._seeds(group)
        lora = self._lora_name(group.adapter.handle, f"{group.adapter.name!r} v{group.adapter.version}")
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

    def _abort(self, rids: list[str]) -> None:
        """Ask SGLang to stop the given requests now (closing the stream stops them too, later)."""
        if rids:
            self._abort_later(lambda: self._send_aborts(rids))

    async def _send_aborts(self, rids: list[str]) -> None:
        for rid in rids:
            try:
                await self.api.post_json("/abort_request", abort_body(rid), f"aborting {rid}", admin=True)
            except RollwireError as err:
                log.info("sglang_abort_failed", rid=rid, error=err.message)

    # -- adapters ----------------------------------------------------------------------------
    async def _server_load(self, adapter: ServedAdapter) -> None:
        await self.api.post_json(
            "/load_lora_adapter",
            load_lora_body(adapter.lora_name, adapter.server_path),
            f"loading adapter {adapter.label}",
            admin=True,
        )

    async def _server_unload(self, adapter: ServedAdapter) -> None:
        await self.api.post_json(
            "/unload_lora_adapter",
            unload_lora_body(adapter.lora_name),
            f"unloading adapter {adapter.label}",
            admin=True,
        )

    def _already_loaded(self, err: RollwireError) -> bool:
        return "already loaded" in err.message  # an SGLang that outlived a blip still has it


__all__ = ["SGLangEngine", "peft_config", "write_peft_folder"]
