"""GenerateRequest -> GroupRequest, once, in one place: the replica's wire edge converts a request
here, and everything behind it (the servicer's admission, the sessions, the engines) works on the
internal dataclasses of types.py (STYLE.md, "Protos stay at the edge").

Invariants: every request is validated before the engine sees it, each problem with its own
sentence and reason (INVALID_ARGUMENT, or FAILED_PRECONDITION for what this replica's engine
cannot honour); limits before work: every cheap check (counts, sizes, sampling bounds, string
lengths) runs first, the prompt's size is checked before it is scanned or tokenized, and a long
text is tokenized off the event loop.
"""

from __future__ import annotations

import asyncio
import math

from rollwire.common.errors import FailedPrecondition, InvalidArgument
from rollwire.common.manifest import check_name
from rollwire.common.reasons import Reason
from rollwire.generator.config import GeneratorConfig
from rollwire.generator.engines.base import Engine
from rollwire.generator.types import MAX_TEMPERATURE, MIN_TEMPERATURE, GroupRequest, SamplingParams
from rollwire.serving.sizes import check_group_key, check_prompt_size  # before tokenizing
from rollwire.v1 import generator_pb2 as pb

MAX_STREAM_INTERVAL = 4096
"""The largest GenerateRequest.stream_interval (generator.stream_interval's bound too)."""
# Generate's bounds on client strings (docs/protocol.md lists them with the Limits section):
INLINE_TOKENIZE_CHARS = 2048  # longer texts are tokenized on a worker thread, not the event loop
MAX_STOP_CHARS = 64  # longest stop string


class RequestConverter:
    """Converts the GenerateRequests of one replica: its limits (config.limits) and what its
    engine takes (context, vocabulary, tokenizer, following, kept tokens)."""

    def __init__(self, config: GeneratorConfig, engine: Engine) -> None:
        self.config, self.engine = config, engine

    async def group(self, req: pb.GenerateRequest, rid: str) -> GroupRequest:
        """The request as the group the engine runs, or a refusal (limits before work: the module's
        docstring). The group carries no adapter yet: the servicer selects the version."""
        lim = self.config.limits
        if not 1 <= req.n <= lim.max_n:
            raise InvalidArgument(f"n is {req.n}; it must be between 1 and {lim.max_n}", reason=Reason.BAD_N)
        params = self._sampling(req.sampling, req.n)
        if req.adapter.name:
            check_name(req.adapter.name)
        check_group_key(req)
        resume = self._resume(req, params.max_new_tokens)  # bounded by n x max_new_tokens: before tokenizing
        prompt = await self._prompt(req)
        if len(prompt) + params.max_new_tokens > self.engine.max_context:
            raise InvalidArgument(
                f"prompt ({len(prompt)} tokens) plus max_new_tokens ({params.max_new_tokens}) exceeds the model's "
                f"context of {self.engine.max_context} tokens",
                reason=Reason.CONTEXT_TOO_LONG,
            )
        if req.stream_interval > MAX_STREAM_INTERVAL:
            raise InvalidArgument(
                f"stream_interval is {req.stream_interval}; it must be at most {MAX_STREAM_INTERVAL} (0: the server's)",
                reason=Reason.BAD_STREAM_INTERVAL,
            )
        return GroupRequest(
            rid,
            prompt,
            req.n,
            params,
            follow=self._follows(req.adapter),
            stream_interval=req.stream_interval,
            resume=resume,
            routed_experts=self._routed_experts(req.return_routed_experts),
        )

    def _resume(self, req: pb.GenerateRequest, max_new_tokens: int) -> dict[int, list[int]]:
        """GenerateRequest.resume as sample index -> tokens so far, or a refusal: counts and
        lengths first, then each id against the vocabulary (at most n x max_new_tokens ids)."""
        if not req.resume:
            return {}
        if req.HasField("session"):
            raise InvalidArgument(
                "resume cannot continue a session turn: a proxy resumes a turn as the plain request it forwards; "
                "send the turn without resume",
                reason=Reason.BAD_RESUME,
            )
        if len(req.resume) > req.n:
            raise InvalidArgument(
                f"resume lists {len(req.resume)} samples for a group of n = {req.n}; list each sample at most once",
                reason=Reason.BAD_RESUME,
            )
        out: dict[int, list[int]] = {}
        for entry in req.resume:
            i, have = entry.sample_index, len(entry.token_ids)
            if i >= req.n or i in out:
                why = f"is not below n = {req.n}" if i >= req.n else "is listed twice"
                raise InvalidArgument(f"resume's sample_index {i} {why}", reason=Reason.BAD_RESUME)
            if have >= max_new_tokens:
                raise InvalidArgument(
                    f"resume gives sample {i} {have} tokens, but a sample has at most max_new_tokens "
                    f"({max_new_tokens}) and one that has them all is finished; list only unfinished samples",
                    reason=Reason.BAD_RESUME,
                )
            out[i] = list(entry.token_ids)
        vocab = self.engine.vocab_size
        for i, ids in out.items():
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise InvalidArgument(
                    f"resume's token ids {bad[:5]} of sample {i} are outside the vocabulary [0, {vocab})",
                    reason=Reason.BAD_RESUME,
                )
        if not getattr(self.engine, "resumes_samples", False):
            raise FailedPrecondition(
                f"this replica's engine ({self.config.engine}) cannot continue samples from their tokens; "
                "send the request without resume",
                reason=Reason.RESUME_UNSUPPORTED,
            )
        return out

    async def _prompt(self, req: pb.GenerateRequest) -> list[int]:
        """The prompt's token ids; sizes are checked before any scan or tokenizing."""
        lim = self.config.limits
        kind = req.WhichOneof("prompt")
        # a text's bound: the tokens it may become here (a longer prompt is refused anyway)
        check_prompt_size(
            req, min(lim.max_prompt_tokens, self.engine.max_context) if kind == "text" else lim.max_prompt_tokens
        )
        if kind == "text":
            text = req.text
            if len(text) > INLINE_TOKENIZE_CHARS:
                prompt = await asyncio.to_thread(self.engine.tokenize, text)
            else:
                prompt = self.engine.tokenize(text) if text else []
        elif kind == "token_ids":
            prompt = list(req.token_ids.ids)
            bad = [t for t in prompt if not 0 <= t < self.engine.vocab_size]
            if bad:
                raise InvalidArgument(
                    f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.engine.vocab_size})",
                    reason=Reason.BAD_TOKEN_ID,
                )
        else:
            prompt = []
        if not prompt:
            raise InvalidArgument(
                "the prompt is empty: set `text` or `token_ids` to at least one token", reason=Reason.EMPTY_PROMPT
            )
        if len(prompt) > lim.max_prompt_tokens:
            raise InvalidArgument(
                f"the prompt has {len(prompt)} tokens; this replica accepts at most {lim.max_prompt_tokens}",
                reason=Reason.PROMPT_TOO_LONG,
            )
        return prompt

    def _sampling(self, s: pb.SamplingParams, n: int) -> SamplingParams:
        """Sampling params within the documented bounds (types.SamplingParams), or a refusal."""
        lim = self.config.limits
        if not 1 <= s.max_new_tokens <= lim.max_new_tokens:
            raise InvalidArgument(
                f"sampling.max_new_tokens is {s.max_new_tokens}; it must be between 1 and {lim.max_new_tokens}",
                reason=Reason.BAD_MAX_NEW_TOKENS,
            )
        temperature = s.temperature if s.HasField("temperature") else 1.0
        if not (temperature == 0 or MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE):  # NaN fails both
            raise InvalidArgument(
                f"sampling.temperature is {temperature}; use 0 for greedy decoding or a value from "
                f"{MIN_TEMPERATURE} to {MAX_TEMPERATURE:g}",
                reason=Reason.BAD_TEMPERATURE,
            )
        top_p = s.top_p if s.HasField("top_p") else 1.0
        if not (math.isfinite(top_p) and 0 < top_p <= 1):
            raise InvalidArgument(
                f"sampling.top_p is {top_p}; it must be in (0, 1] (1 disables nucleus sampling)",
                reason=Reason.BAD_TOP_P,
            )
        top_k = s.top_k if s.HasField("top_k") else 0
        if top_k > self.engine.vocab_size:
            raise InvalidArgument(
                f"sampling.top_k is {top_k}; it must be at most the vocabulary size {self.engine.vocab_size} "
                "(0 disables it)",
                reason=Reason.BAD_TOP_K,
            )
        if len(s.stop) > lim.max_stop_strings or any(not 1 <= len(x) <= MAX_STOP_CHARS for x in s.stop):
            raise InvalidArgument(
                f"give at most {lim.max_stop_strings} stop strings of 1 to {MAX_STOP_CHARS} characters "
                f"(got {len(s.stop)}" + (f", the longest {max(len(x) for x in s.stop)} characters)" if s.stop else ")"),
                reason=Reason.BAD_STOP,
            )
        return SamplingParams(
            max_new_tokens=s.max_new_tokens,
            temperature=0.0 if temperature == 0 else temperature,  # -0.0 is greedy too
            top_p=top_p,
            top_k=top_k,
            stop=tuple(s.stop),
            seed=s.seed if s.HasField("seed") else None,
            sample_seeds=self._sample_seeds(s, n),
            ignore_eos=s.ignore_eos,
            return_kept=self._kept_tokens(s.return_kept_tokens),
        )

    def _follows(self, adapter: pb.AdapterRef) -> bool:
        """AdapterRef.follow, refused where it cannot be honoured."""
        if not adapter.follow:
            return False
        if not adapter.name or adapter.version:
            raise InvalidArgument(
                "adapter.follow needs an adapter name and version 0 (the newest): a pinned version cannot be followed",
                reason=Reason.BAD_FOLLOW,
            )
        if not getattr(self.engine, "follows_versions", False):
            raise FailedPrecondition(
                f"this replica's engine ({self.config.engine}) cannot switch running samples to a new version; "
                "send the request without adapter.follow",
                reason=Reason.FOLLOW_UNSUPPORTED,
            )
        return True

    @staticmethod
    def _sample_seeds(s: pb.SamplingParams, n: int) -> tuple[int, ...]:
        """sampling.sample_seeds: none, or exactly one per sample with `seed` unset."""
        if s.sample_seeds and (len(s.sample_seeds) != n or s.HasField("seed")):
            raise InvalidArgument(
                f"sampling.sample_seeds holds {len(s.sample_seeds)} seeds for n = {n}"
                + (" and sampling.seed is set" if s.HasField("seed") else "")
                + "; give exactly one per sample and no seed (or only seed)",
                reason=Reason.BAD_SEED,
            )
        return tuple(s.sample_seeds)

    def _routed_experts(self, asked: bool) -> bool:
        """The request's `return_routed_experts`, refused when this replica cannot report routing
        (the engine's own check refuses a dense model and a sample too large to carry it)."""
        if asked and not getattr(self.engine, "reports_routed_experts", False):
            raise FailedPrecondition(
                f"return_routed_experts: this replica ({self.config.engine} engine) cannot report MoE routing: only "
                "the transformers engine does, on a model with MoE layers; send the request without it",
                reason=Reason.ROUTED_EXPERTS_UNSUPPORTED,
            )
        return asked

    def _kept_tokens(self, asked: bool) -> bool:
        """The request's `return_kept_tokens`, refused when this replica's engine cannot honour it."""
        if asked and not getattr(self.engine, "returns_kept_tokens", False):
            raise FailedPrecondition(
                f"this replica's engine ({self.config.engine}) cannot return kept-token sets; send the request without "
                "return_kept_tokens, or to a transformers or vllm replica",
                reason=Reason.KEPT_TOKENS_UNSUPPORTED,
            )
        return asked
