"""The sglang engine: generation and LoRA adapters served by a real SGLang server.

The replica keeps everything rollwire promises (versions, the window, leases, statuses) and
SGLang does the batching on the accelerator. SGLang is launched as a child process with LoRA
enabled (sglang_process.py) or reached by URL; this module speaks its native HTTP API
(sglang_protocol.py holds the exact bodies and the stream parser). Supervision, adapter
folders and the adapter bookkeeping are shared with the vllm engine (engine.py).

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
- closing a generate stream closes the HTTP stream and aborts its SGLang requests;
- a following group switches by continuation (follow.py): SGLang fixes a request's
  LoRA at admission, so each unfinished sample goes on as a new request under the new one;
- Score (and so the proof of a version, generator/proof.py) reads SGLang's prompt logprobs: one
  prefill-only /generate request per sequence (sglang_protocol.py, "scoring"), under the
  version's own LoRA name, all of a Score's requests ended (answered or cancelled) before it
  returns, and the version counted as in use meanwhile, so it is never unloaded under a Score.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from rollwire.common.errors import FailedPrecondition, RollwireError
from rollwire.common.reasons import Reason
from rollwire.generator.engines.served.engine import NO_TEXT, ServedAdapter, ServedEngine, ServerCall
from rollwire.generator.engines.served.files import find_key, peft_config, read_secret, write_peft_folder
from rollwire.generator.engines.served.sglang_process import launch_argv, write_key_config
from rollwire.generator.engines.served.sglang_protocol import (
    SGLANG,
    TARGET_VERSION,
    StreamTracker,
    abort_body,
    generate_body,
    load_lora_body,
    read_score,
    score_body,
    unload_lora_body,
)
from rollwire.generator.engines.settings import SGLangSection
from rollwire.generator.types import GroupRequest, ScoreJob, SequenceScore
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
    def check(self, group: GroupRequest) -> None:
        self._seeds(group)

    def _call(self, segment: GroupRequest, lora: str | None, rid: str) -> ServerCall:
        body, rids = generate_body(segment, lora, self._seeds(segment), rid)
        tracker = StreamTracker(segment, NO_TEXT)
        return ServerCall("/generate", body, tracker, lambda: rids or sorted(tracker.rids))

    def _seeds(self, group: GroupRequest) -> list[int] | None:
        if group.sampling.seed is None and not group.sampling.sample_seeds:
            return None
        if not self.honours_seeds:
            raise FailedPrecondition(
                "this replica's SGLang runs without --enable-deterministic-inference, so it would ignore the "
                "request's seed; drop the seed or start the replica with sglang.deterministic=true",
                reason=Reason.SEED_UNSUPPORTED,
            )
        from rollwire.generator.sampling import sample_seeds  # one definition of per-sample seeds

        seeds = sample_seeds(group.sampling.seed, group.sampling.sample_seeds, group.n) or []
        return [s % (1 << 31) for s in seeds]

    async def score(self, job: ScoreJob) -> list[SequenceScore]:
        """The job's sequences as prefill-only /generate requests with their input logprobs, one per sequence,
        sent together (SGLang batches them); each continuation token's logprob is read back by id (sglang_protocol.py)."""
        self.check_up()
        self.check_score(job)
        lora = self._lora_name(job.adapter.handle, f"{job.adapter.name!r} v{job.adapter.version}")

        async def one(i: int) -> SequenceScore:
            prompt, continuation = job.sequences[i]
            rid = f"{job.request_id}.{i}.{next(self._rids)}.{self._nonce}"
            reply = await self.api.post_json(
                "/generate", score_body(prompt, continuation, lora, rid), f"scoring {job.request_id}"
            )
            return read_score(job, i, reply)

        with self._using(job.adapter.handle):
            calls = [asyncio.ensure_future(one(i)) for i in range(len(job.sequences))]
            try:
                return list(await asyncio.gather(*calls))
            finally:  # one failed (or the caller went away): the others end here, not after the version's unload
                for call in calls:
                    call.cancel()
                await asyncio.gather(*calls, return_exceptions=True)

    async def _send_abort(self, ids: list[str]) -> None:
        """Ask SGLang to stop the given requests now (closing the stream stops them too, later)."""
        for rid in ids:
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
