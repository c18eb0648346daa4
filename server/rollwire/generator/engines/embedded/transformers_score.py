"""The transformers engine's Score: teacher-forced logprobs, mixed into TransformersEngine.

How it fits the engine: one worker thread owns the model and runs iteration after iteration
(adapter loads and unloads, then a decode step for every running row and the prefill of admitted
groups). A Score is queued for that thread (`_scores`, under the engine's condition) and run
there between two iterations, ONE forward pass per iteration: a Score that needs several passes
lets the running rows take a decode step between its passes, its passes never overlap a decode
step (one thread; the LoRA route is set per pass), and the event loop only awaits the result.

Batching: the sequences, longest first, are packed into passes of at most `score_batch_tokens`
padded tokens (rows x the longest of them; never above the KV budget), each sequence right-
padded: under a causal mask with positions from 0 a real token never attends to a pad, so its
logits are those of the sequence alone. Every row of a Score uses its one adapter version. Only
the scored positions go through the LM head, in slices of at most LOGIT_SLICE_BYTES of logits,
so a long Score never holds [tokens x vocabulary] at once.

Invariants:
- the logprob of continuation token j is log_softmax(logits)[token] of the position before it,
  in float32, at temperature 1 and untruncated: what Generate reports for a token sampled at
  temperature 1 with no top-k or top-p (the same weights, hooks and head);
- a sequence longer than the KV budget is refused before any work (INVALID_ARGUMENT, KV_BUDGET,
  as Generate's groups); a pass that runs out of memory ends its Score with RESOURCE_EXHAUSTED
  ENGINE_OOM (load: a proxy retries it elsewhere and never counts it against the replica), any
  other failure of the pass with INTERNAL ENGINE_FAILED; the running rows are untouched;
- a Score whose caller went away is dropped at its next pass.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from rollwire.common.errors import Cancelled, Internal, InvalidArgument, ResourceExhausted, RollwireError, Unavailable
from rollwire.common.reasons import Reason
from rollwire.generator.engines.embedded.lora import LoraSet
from rollwire.generator.engines.embedded.transformers_groups import clip_exc, out_of_memory
from rollwire.generator.types import ScoreJob, SequenceScore
from rollwire.runtime.logs import get_logger

log = get_logger("rollwire.generator.engines.embedded.transformers_engine")
LOGIT_SLICE_BYTES = 64 << 20
"""Float32 logits computed at once by the LM head while scoring: positions per slice = this / (4 x vocabulary)."""


@dataclass(eq=False)
class ScoreRun:
    """One Score on its way through the worker: its passes (sequence indices each) and results."""

    job: ScoreJob
    passes: list[list[int]]
    future: Future = field(default_factory=Future)
    results: list[SequenceScore | None] = field(default_factory=list)
    done: int = 0
    """Passes run so far."""
    gone: bool = False
    """The caller stopped waiting: the remaining passes are not run."""


def plan_passes(lengths: list[int], bound: int) -> list[list[int]]:
    """Sequence indices per forward pass, longest first, each pass's rows x its longest at most
    `bound` (a sequence longer than `bound` gets a pass of its own)."""
    passes: list[list[int]] = []
    current: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if current and (len(current) + 1) * lengths[current[0]] > bound:
            passes.append(current)
            current = []
        current.append(i)
    return [*passes, current] if current else passes


class ScoreRules:
    """Score on the engine's worker thread; the engine provides the model and its parts."""

    model: Any
    device: torch.device
    tokenizer: Any
    vocab_size: int
    max_batch_tokens: int
    score_batch_tokens: int
    _lora: LoraSet
    _cv: threading.Condition
    _scores: deque[ScoreRun]
    on_forward: Callable[[int], None]

    # -- event loop side -----------------------------------------------------------------
    def check_score(self, job: ScoreJob) -> None:
        longest = max(len(p) + len(c) for p, c in job.sequences)
        if longest > self.max_batch_tokens:
            raise InvalidArgument(
                f"a sequence of this Score has {longest} tokens, over this replica's KV budget of "
                f"{self.max_batch_tokens} tokens; shorten it or score it on a larger replica",
                reason=Reason.KV_BUDGET,
            )

    async def score(self, job: ScoreJob) -> list[SequenceScore]:
        self.check_score(job)
        bound = max(1, min(self.score_batch_tokens, self.max_batch_tokens))
        lengths = [len(p) + len(c) for p, c in job.sequences]
        run = ScoreRun(job, plan_passes(lengths, bound), results=[None] * len(lengths))
        with self._cv:
            self._scores.append(run)
            self._cv.notify_all()
        try:
            return await asyncio.wrap_future(run.future)
        finally:
            run.gone = True  # a cancelled caller's remaining passes are skipped

    # -- worker thread -------------------------------------------------------------------
    def _score_step(self) -> None:
        """Run one pass of the Score that waited longest, then queue it behind the others when
        it has more (so several Scores and the decode steps take turns)."""
        with self._cv:
            run = self._scores.popleft() if self._scores else None
        if run is None or (run.done == 0 and not run.future.set_running_or_notify_cancel()):
            return
        if run.gone:
            run.future.set_exception(Cancelled("the caller went away"))
            return
        try:
            self._score_pass(run.job, run.passes[run.done], run.results)
        except Exception as exc:
            run.future.set_exception(score_error(run.job, exc))
            return
        run.done += 1
        if run.done < len(run.passes):
            with self._cv:
                self._scores.append(run)
        else:
            run.future.set_result(run.results)

    def _fail_scores(self, message: str) -> None:
        """At shutdown: every queued Score ends with UNAVAILABLE (another replica can run it)."""
        with self._cv:
            runs, self._scores = list(self._scores), deque()
        for run in runs:
            if run.done or run.future.set_running_or_notify_cancel():
                run.future.set_exception(Unavailable(message))

    def _score_pass(self, job: ScoreJob, indices: list[int], results: list[SequenceScore | None]) -> None:
        """One forward pass over the sequences `indices` of `job`; fills their results."""
        seqs = [job.sequences[i] for i in indices]
        rows = [[*p, *c] for p, c in seqs]
        width = max(map(len, rows))
        pad = self.tokenizer.pad_token_id or 0
        ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows], device=self.device)
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], device=self.device)
        where_rows = torch.cat([torch.full((len(c),), k, dtype=torch.long) for k, (_, c) in enumerate(seqs)])
        where_cols = torch.cat([torch.arange(len(p) - 1, len(p) + len(c) - 1) for p, c in seqs])
        targets = torch.tensor([t for _, c in seqs for t in c], device=self.device)
        with self._lora.routed([job.adapter.handle] * len(rows)):
            hidden = self.model.base_model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
            picked = hidden[where_rows.to(self.device), where_cols.to(self.device)]
            del hidden
            logprobs, top_ids, top_lps = self._head(picked, targets, job.top_k)
        self.on_forward(len(rows))
        at = 0
        for i, (_, c) in zip(indices, seqs, strict=True):
            end = at + len(c)
            results[i] = SequenceScore(logprobs[at:end], top_ids[at:end], top_lps[at:end])
            at = end

    def _head(
        self, hidden: torch.Tensor, targets: torch.Tensor, k: int
    ) -> tuple[list[float], list[list[int]], list[list[float]]]:
        """The LM head over the picked positions, in slices: each target's logprob, and the top
        k ids and logprobs per position (empty lists when k is 0)."""
        head = self.model.get_output_embeddings()
        text = self.model.config.get_text_config() if hasattr(self.model.config, "get_text_config") else None
        cap = getattr(text or self.model.config, "final_logit_softcapping", None)  # applied as the model's forward does
        step = max(1, LOGIT_SLICE_BYTES // (4 * self.vocab_size))
        chosen: list[torch.Tensor] = []
        top_v: list[torch.Tensor] = []
        top_i: list[torch.Tensor] = []
        for s in range(0, hidden.shape[0], step):
            logits = head(hidden[s : s + step]).float()
            if cap:
                logits = torch.tanh(logits / cap) * cap
            lsm = torch.log_softmax(logits, -1)
            chosen.append(lsm.gather(1, targets[s : s + step, None])[:, 0])
            if k:
                values, index = lsm.topk(k, -1)
                top_v.append(values)
                top_i.append(index)
        logprobs = torch.cat(chosen).tolist()
        if not k:
            return logprobs, [], []
        return logprobs, torch.cat(top_i).tolist(), torch.cat(top_v).tolist()


def score_error(job: ScoreJob, exc: Exception) -> RollwireError:
    """The status that ends a Score whose pass failed (the module's invariants)."""
    if isinstance(exc, RollwireError):
        return exc
    if out_of_memory(exc):
        log.warning("engine_out_of_memory", where="score", request_id=job.request_id, error=clip_exc(exc))
        return ResourceExhausted(
            f"this replica ran out of memory scoring this request ({job.tokens} tokens); retry it, on another replica "
            "or as smaller requests",
            reason=Reason.ENGINE_OOM,
            retry_after_s=1.0,
        )
    log.exception("score_failed", request_id=job.request_id, exc_info=exc)
    return Internal(
        f"a forward pass of this Score failed on this replica ({clip_exc(exc)}); retry it, on another replica",
        reason=Reason.ENGINE_FAILED,
    )


__all__ = ["LOGIT_SLICE_BYTES", "ScoreRules", "ScoreRun", "plan_passes", "score_error"]
