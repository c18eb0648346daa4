"""Score on one replica: teacher-forced logprobs of given token sequences under one version.

A ScoreRequest is converted here, once (STYLE.md, "Protos stay at the edge"), into the ScoreJob
an engine runs (types.py); the engine computes it (engines/base.Scorer: the transformers engine
batches its sequences into forward passes on its worker thread, transformers_score.py).

Invariants:
- limits before work: the engine's ability, the adapter reference, the counts, top_k and the
  total size are checked before any id is scanned, every id before the engine sees the job,
  the engine's memory bound (`Scorer.check_score`) before an adapter lease is taken;
- a version is resolved and leased exactly as Generate's (AdapterRegistry.take, the same
  refusals), and the lease is released on every exit; the response names the version that
  scored, with the digest and signer GetStatus reports for it;
- logprobs are the model's raw log-softmax: temperature 1, no top-k or top-p truncation.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import structlog

from rollwire.common.errors import InvalidArgument, ResourceExhausted, RollwireError, Unimplemented, to_status
from rollwire.common.manifest import check_name
from rollwire.common.reasons import Reason
from rollwire.generator.adapters import AdapterRegistry
from rollwire.generator.config import GeneratorConfig
from rollwire.generator.engines.base import Engine, Scorer
from rollwire.generator.metrics import GeneratorMetrics
from rollwire.generator.types import AdapterSelection, ScoreJob, SequenceScore
from rollwire.runtime.logs import get_logger, request_id_from
from rollwire.v1 import generator_pb2 as pb

log = get_logger(__name__)


def score_job(req: pb.ScoreRequest, rid: str, config: GeneratorConfig, engine: Engine) -> ScoreJob:
    """The request as the job an engine runs, or a refusal (the module's invariants); the job
    carries no adapter yet: the caller leases the version."""
    lim = config.limits
    if req.adapter.follow:
        raise InvalidArgument(
            "a Score is computed under one version: send it without adapter.follow (version 0 scores under the newest)",
            reason=Reason.BAD_SCORE_REQUEST,
        )
    if req.adapter.name:
        check_name(req.adapter.name)
    count = len(req.sequences)
    if count == 0:
        raise InvalidArgument("the Score names no sequence; give at least one", reason=Reason.BAD_SCORE_REQUEST)
    if count > lim.max_score_sequences:
        raise InvalidArgument(
            f"the Score has {count} sequences; this replica scores at most {lim.max_score_sequences} per request: "
            "split it",
            reason=Reason.SCORE_TOO_LARGE,
        )
    if req.top_k > min(lim.max_score_top_k, engine.vocab_size):
        raise InvalidArgument(
            f"top_k is {req.top_k}; this replica returns at most {min(lim.max_score_top_k, engine.vocab_size)} "
            "(0: none)",
            reason=Reason.BAD_SCORE_TOP_K,
        )
    total = sum(len(s.prompt_token_ids) + len(s.continuation_token_ids) for s in req.sequences)
    if total > lim.max_score_tokens:
        raise InvalidArgument(
            f"the Score holds {total} tokens; this replica takes at most {lim.max_score_tokens} per request: split it",
            reason=Reason.SCORE_TOO_LARGE,
        )
    return ScoreJob(rid, tuple(_sequence(i, s, engine) for i, s in enumerate(req.sequences)), req.top_k)


def _sequence(i: int, s: pb.ScoreSequence, engine: Engine) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """One sequence's (prompt, continuation), each non-empty, within the context and the vocabulary."""
    prompt, continuation = tuple(s.prompt_token_ids), tuple(s.continuation_token_ids)
    if not prompt or not continuation:
        raise InvalidArgument(
            f"sequence {i} has {len(prompt)} prompt and {len(continuation)} continuation tokens; each part needs at "
            "least one (the first token of a text has no logprob: put it in the prompt)",
            reason=Reason.BAD_SCORE_REQUEST,
        )
    if len(prompt) + len(continuation) > engine.max_context:
        raise InvalidArgument(
            f"sequence {i} has {len(prompt) + len(continuation)} tokens; the model attends to at most "
            f"{engine.max_context}",
            reason=Reason.CONTEXT_TOO_LONG,
        )
    vocab = engine.vocab_size
    bad = [t for t in (*prompt, *continuation) if not 0 <= t < vocab]
    if bad:
        raise InvalidArgument(
            f"sequence {i} holds token ids {bad[:5]} outside the vocabulary [0, {vocab})", reason=Reason.BAD_TOKEN_ID
        )
    return prompt, continuation


class Scoring:
    """The Score method of one replica, over its engine, adapter registry and metrics."""

    def __init__(
        self,
        config: GeneratorConfig,
        engine: Engine,
        registry: AdapterRegistry,
        metrics: GeneratorMetrics,
        *,
        fingerprint: str,
        replica: str,
    ) -> None:
        self.config, self.engine, self.registry, self.metrics = config, engine, registry, metrics
        self.fingerprint, self.replica = fingerprint, replica
        self.running = 0
        """Score requests accepted and not yet answered (bounded by limits.max_queue)."""

    async def score(self, request: pb.ScoreRequest, context: grpc.aio.ServicerContext) -> pb.ScoreResponse:
        rid = request_id_from(context.invocation_metadata(), request.request_id)
        structlog.contextvars.bind_contextvars(request_id=rid)
        start, code, selection, self.running = time.monotonic(), grpc.StatusCode.OK, None, self.running + 1
        try:
            scorer = self._scorer()
            job = score_job(request, rid, self.config, self.engine)
            scorer.check_score(job)
            self._admit()
            selection = await self.registry.take(request.adapter.name, request.adapter.version)
            job = ScoreJob(job.request_id, job.sequences, job.top_k, selection)
            scores = await scorer.score(job)
            self.metrics.scored_tokens.inc(job.scored)
            log.info(
                "score_done",
                sequences=len(scores),
                tokens=job.tokens,
                adapter=selection.name,
                version=selection.version,
            )
            return self._response(rid, selection, scores)
        except RollwireError as err:
            code = err.code
            log.info("score_refused", code=code.name, reason=err.reason, error=err.message)
            await context.abort_with_status(to_status(err))  # pyright: ignore[reportAttributeAccessIssue]  # grpc's stubs lack it; it exists at run time
            raise AssertionError("unreachable: abort_with_status raises") from err
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception:
            code = grpc.StatusCode.UNKNOWN
            log.exception("score_failed")
            raise
        finally:
            if selection is not None:
                self.registry.release(selection)
            self.running -= 1
            self.metrics.score_requests.labels(code.name).inc()
            self.metrics.score_latency.observe(time.monotonic() - start)
            structlog.contextvars.unbind_contextvars("request_id")

    def _scorer(self) -> Scorer:
        if not isinstance(self.engine, Scorer):
            raise Unimplemented(
                f"this replica's engine ({self.config.engine}) cannot score sequences; send Score to a replica of the "
                "transformers engine (a proxy routes it there)",
                reason=Reason.SCORE_UNSUPPORTED,
            )
        return self.engine

    def _admit(self) -> None:
        """At most limits.max_queue Score requests open at once (each waits for the engine's worker)."""
        limit = self.config.limits.max_queue
        if self.running > limit:
            raise ResourceExhausted(
                f"this replica has {self.running - 1} Score requests open (limit {limit}); retry shortly or add replicas",
                reason=Reason.QUEUE_FULL,
                retry_after_s=1.0,
            )

    def _response(self, rid: str, selection: AdapterSelection, scores: list[SequenceScore]) -> pb.ScoreResponse:
        name, version = selection.name, selection.version
        digest = self.registry.digests().get(name, {}).get(version, "") if name else ""
        signer = self.registry.signers().get(name, {}).get(version, "") if name else ""
        return pb.ScoreResponse(
            request_id=rid,
            adapter=pb.AdapterRef(name=name, version=version),
            sha256=digest,
            signer=signer,
            model_fingerprint=self.fingerprint,
            replica=self.replica,
            sequences=[
                pb.SequenceScore(
                    logprobs=s.logprobs,
                    top=[
                        pb.TopLogprobs(token_ids=i, logprobs=p) for i, p in zip(s.top_ids, s.top_logprobs, strict=True)
                    ],
                )
                for s in scores
            ],
        )
