"""GeneratorService on one replica: the wire edge of the engine.

Invariants: every request is validated before the engine sees it (convert.py turns it into
the group the engine runs, or refuses it); every accepted request ends with all its samples
finished or with one status; the in-flight gauge and the adapter lease are released on every
exit path (completion, error, cancellation).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import grpc
import structlog

from rollwire.common.errors import (
    ResourceExhausted,
    RollwireError,
    to_status,
)
from rollwire.common.reasons import Reason
from rollwire.generator.adapters import AdapterRegistry
from rollwire.generator.config import GeneratorConfig
from rollwire.generator.convert import RequestConverter
from rollwire.generator.engines.base import Engine
from rollwire.generator.intake import PushIntake
from rollwire.generator.metrics import GeneratorMetrics
from rollwire.generator.proof import Prover
from rollwire.generator.receipts import Receipts, StreamReceipts
from rollwire.generator.score import Scoring
from rollwire.generator.types import (
    Event,
    GroupRequest,
    TokenDelta,
    by_routed_size,
    coalesce,
    worth_sending,
)
from rollwire.runtime.logs import get_logger, request_id_from
from rollwire.runtime.members import CHALLENGE_KEY, PROOF_KEY, member_proof
from rollwire.runtime.security import TokenAuth, caller_identity
from rollwire.serving import __version__
from rollwire.serving.sessions import SessionStore, Turn, check_turn
from rollwire.v1 import generator_pb2 as pb
from rollwire.v1 import generator_pb2_grpc

log = get_logger(__name__)
FINISH = {"eos": pb.FINISH_REASON_EOS, "stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH}


class GeneratorServicer(generator_pb2_grpc.GeneratorServiceServicer):
    def __init__(
        self,
        config: GeneratorConfig,
        engine: Engine,
        registry: AdapterRegistry,
        metrics: GeneratorMetrics,
        *,
        fingerprint: str,
        base_shapes: dict[str, tuple[int, int]],
        replica: str,
        auth: TokenAuth | None = None,
        port: int = 0,
        prover: Prover | None = None,
    ) -> None:
        self.config, self.engine, self.registry, self.metrics = config, engine, registry, metrics
        self.prover = prover
        """Holds versions to their probes (proof.py); its records are GetStatus's `proofs`."""
        self.fingerprint, self.base_shapes, self.replica = fingerprint, base_shapes, replica
        self.receipts = Receipts.from_file(config.receipt_key_file)
        """This replica's signed word for each sample it finishes (receipts.py); off without a key."""
        self.in_flight = 0
        self._following: dict[str, dict[int, GroupRequest]] = {}
        """Running groups that follow an adapter's newest version, by adapter name."""
        registry.on_servable.append(self._follow)
        self.auth, self.port = auth, port
        """The tokens this replica checks (None: auth off) and the port it serves on."""
        self.intake = PushIntake(
            config,
            registry,
            metrics,
            fingerprint=fingerprint,
            base_shapes=base_shapes,
            auth=auth,
            port=port,
            check_probe=prover.check if prover is not None else None,
        )
        """PushAdapter and CommitAdapter: the push package's intake on this replica."""
        self.member: tuple[bytes, str] | None = None
        """(fleet key, advertised address) when auth.member_key_file is set: GetStatus answers a
        proxy's challenge with a proof for that address (runtime/members.py)."""
        self.sessions = SessionStore(config.sessions, metrics.sessions)
        """Histories of the sessions whose turns are sent to this replica directly (not through a proxy)."""
        self.requests = RequestConverter(config, engine)
        """GenerateRequest -> GroupRequest, validated (convert.py)."""
        self.scoring = Scoring(config, engine, registry, metrics, fingerprint=fingerprint, replica=replica)
        """Score: teacher-forced logprobs under one version (score.py)."""

    # -- Generate ----------------------------------------------------------------------
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        rid = request_id_from(context.invocation_metadata(), request.request_id)
        structlog.contextvars.bind_contextvars(request_id=rid)
        start, code = time.monotonic(), grpc.StatusCode.OK
        selection, turn = None, None
        self.in_flight += 1
        self.metrics.in_flight.inc()
        try:
            check_turn(request)
            group = await self.requests.group(request, rid)
            turn = self._begin_turn(request, group, context)
            self._check(group, turn)
            self._admit()
            selection = await self.registry.take(request.adapter.name, request.adapter.version)
            group.adapter = selection
            if group.follow:
                self._following.setdefault(selection.name, {})[id(group)] = group
            log.info(
                "generate_start",
                n=group.n,
                prompt_tokens=len(group.prompt_ids),
                adapter=selection.name,
                version=selection.version,
                resumed=len(group.resume),
            )
            yield pb.GenerateResponse(
                started=pb.GenerationStarted(
                    request_id=rid,
                    adapter=pb.AdapterRef(name=selection.name, version=selection.version),
                    prompt_token_ids=group.prompt_ids,
                    replica=self.replica,
                    resumed=len(group.resume),
                )
            )
            self.metrics.tokens.labels("prompt").inc(len(group.prompt_ids) * group.rows)
            async with contextlib.aclosing(self._messages(group, turn, start)) as messages:  # pyright: ignore[reportArgumentType]  # the library's annotation is narrower than what it accepts
                async for message in messages:
                    yield message
        except RollwireError as err:
            code = err.code
            log.info("generate_refused", code=code.name, reason=err.reason, error=err.message)
            await context.abort_with_status(to_status(err))  # pyright: ignore[reportAttributeAccessIssue]  # grpc's stubs lack it; it exists at run time
        except (asyncio.CancelledError, GeneratorExit):  # GeneratorExit: gRPC closed the stream at a `yield`
            code = grpc.StatusCode.CANCELLED
            log.info("generate_cancelled")
            raise
        finally:
            if turn is not None:
                turn.close(end=request.session.end)
            if selection is not None:
                self._following.get(selection.name, {}).pop(id(group), None)
                self.registry.release(group.adapter)  # the version it holds now (a follower moved on)
            # the outcome is counted before the request leaves in_flight, so a scrape that
            # sees it gone also sees how it ended (the metrics server reads on its own thread)
            self.metrics.requests.labels(code.name).inc()
            self.metrics.latency.observe(time.monotonic() - start)
            self.in_flight -= 1
            self.metrics.in_flight.dec()
            structlog.contextvars.unbind_contextvars("request_id")

    async def _messages(
        self, group: GroupRequest, turn: Turn | None, start: float
    ) -> AsyncIterator[pb.GenerateResponse]:
        """The engine's events for `group` as response messages, held back until worth one
        (config.stream_interval); a session turn collects its reply and is committed once the
        group ended."""
        name, first = group.adapter.name, True
        receipts = self.receipts.stream(group)
        async with contextlib.aclosing(self.engine.generate(group)) as stream:  # pyright: ignore[reportArgumentType]  # the library's annotation is narrower than what it accepts
            gathered: list = []
            async for events in stream:
                gathered.extend(events)
                if turn is not None:
                    turn.output.extend(t for ev in events if isinstance(ev, TokenDelta) for t in ev.token_ids)
                if worth_sending(gathered, group.stream_interval or self.config.stream_interval):
                    if first:  # the first token the client gets, gathered or not
                        first = False
                        self.metrics.ttft.observe(time.monotonic() - start)
                    for msg in self._to_responses(gathered, name, receipts):
                        yield msg
                    gathered = []
            if gathered:
                for msg in self._to_responses(gathered, name, receipts):
                    yield msg
        if turn is not None:
            turn.commit(group.prompt_ids, turn.output, version=group.adapter.version)

    def _begin_turn(self, request: pb.GenerateRequest, group: GroupRequest, context) -> Turn | None:
        """A session turn (serving/sessions.py): refused before any work when over a bound, else
        the session's whole history followed by this turn's new tokens becomes the prompt."""
        if not request.HasField("session"):
            return None
        caller = caller_identity(context.invocation_metadata(), context.peer(), self.config.auth.enabled())
        turn = self.sessions.begin(
            caller,
            request.session.id,
            len(group.prompt_ids),
            group.sampling.max_new_tokens,
            self.engine.max_context,
            adapter=request.adapter.name,
            max_prompt=self.config.limits.max_prompt_tokens,
            expect=request.session.expect_tokens,
        )
        turn.apply_version(request.adapter)
        group.prompt_ids = [*turn.history, *group.prompt_ids]
        return turn

    def _check(self, group: GroupRequest, turn: Turn | None) -> None:
        """The engine's refusal of a group it can never serve (Engine.check), on the group as it
        will run (a session's history included), before any slot or stream: the caller gets a
        status only, and a refused session turn leaves its session as it was."""
        try:
            self.engine.check(group)
        except RollwireError:
            if turn is not None:
                turn.refuse()
            raise

    def _follow(self, name: str, version: int) -> None:
        """A version of `name` became servable: every group following it takes a lease on it,
        then lets go of the one it had (the engine reads the group's selection once a step, so
        the old version stays loaded until the step that used it ended)."""
        for group in list(self._following.get(name, {}).values()):
            if group.adapter.version >= version:
                continue
            newer = self.registry.acquire(name, version)
            older, group.adapter = group.adapter, newer
            self.registry.release(older)
            self.metrics.follow_switches.inc()

    def _admit(self) -> None:
        stats = self.engine.stats()
        if stats.queued >= self.config.limits.max_queue:
            raise ResourceExhausted(
                f"this replica has {stats.queued} groups waiting (limit {self.config.limits.max_queue}); retry shortly "
                "or add replicas",
                reason=Reason.QUEUE_FULL,
                retry_after_s=1.0,
            )

    def _count_served(self, adapter: str, version: int, tokens: int) -> None:
        """Tokens served per adapter and how stale their version was against the newest here."""
        newest = max(self.registry.newest(adapter), version) if adapter else 0  # per message: no list built
        behind = max(0, newest - version)
        label = adapter or "base"
        self.metrics.served_tokens.labels(label, str(behind) if behind < 3 else "3+").inc(tokens)
        self.metrics.served_version.labels(label).set(version)

    def _to_responses(
        self, events: list, adapter: str = "", receipts: StreamReceipts | None = None
    ) -> list[pb.GenerateResponse]:
        """One message for everything ready together: a chunk per sample, then finishes; a finish
        carrying routed experts that would take the message's routing over MAX_ROUTED_BYTES goes
        in a message of its own, after (so no message nears gRPC's size limit)."""
        msgs = []
        for part in by_routed_size(coalesce(events)):
            msg = pb.GenerateResponse()
            for ev in part:
                self._add_event(msg, ev, adapter, receipts)
            msgs.append(msg)
        return msgs

    def _add_event(self, msg: pb.GenerateResponse, ev: Event, adapter: str, receipts: StreamReceipts | None) -> None:
        """One event into `msg`: a sample's new tokens, or its finish (with its routing and receipt)."""
        if isinstance(ev, TokenDelta):
            if receipts is not None:
                receipts.add(ev)
            self.metrics.tokens.labels("completion").inc(len(ev.token_ids))
            self._count_served(adapter, ev.version, len(ev.token_ids))
            msg.tokens.add(
                sample_index=ev.sample_index,
                token_ids=ev.token_ids,
                logprobs=ev.logprobs,
                text=ev.text,
                adapter_version=ev.version,
                kept_tokens=ev.kept,
            )
        else:
            done = msg.finished.add(
                sample_index=ev.sample_index,
                finish_reason=FINISH[ev.reason],
                prompt_tokens=ev.prompt_tokens,
                completion_tokens=ev.completion_tokens,
            )
            if ev.routed is not None:
                r = ev.routed
                done.routed_experts.CopyFrom(
                    pb.RoutedExperts(positions=r.positions, layers=r.layers, top_k=r.top_k, expert_ids=r.expert_ids)
                )
            if receipts is not None:
                done.receipt.CopyFrom(receipts.finish(ev))

    # -- Score (score.py) ----------------------------------------------------------------
    async def Score(self, request: pb.ScoreRequest, context: grpc.aio.ServicerContext) -> pb.ScoreResponse:
        return await self.scoring.score(request, context)

    # -- PushAdapter, CommitAdapter: the push intake (intake.py) -----------------------
    async def PushAdapter(self, request_iterator, context: grpc.aio.ServicerContext) -> pb.PushAdapterResponse:
        return await self.intake.push(request_iterator, context)

    async def CommitAdapter(self, request: pb.CommitAdapterRequest, context) -> pb.CommitAdapterResponse:
        return await self.intake.commit(request, context)

    async def close(self) -> None:
        """Close the relay channels (at shutdown)."""
        await self.intake.close()

    # -- GetStatus ---------------------------------------------------------------------
    async def GetStatus(self, request: pb.GetStatusRequest, context) -> pb.GetStatusResponse:
        nonce = next((str(v) for k, v in context.invocation_metadata() or () if k == CHALLENGE_KEY), "")
        if nonce and self.member is not None:  # a proxy checks who listens at the address it was given
            key, address = self.member
            await context.send_initial_metadata(((PROOF_KEY, member_proof(key, address, nonce[:128])),))
        return self.status()

    def status(self) -> pb.GetStatusResponse:
        stats = self.engine.stats()
        lim = self.config.limits
        digests, signers = self.registry.digests(), self.registry.signers()
        loaded = self.registry.loaded()
        proofs = self.prover.of(loaded) if self.prover is not None else {}
        return pb.GetStatusResponse(
            role="generator",
            replica=self.replica,
            model_fingerprint=self.fingerprint,
            engine=self.engine.name,
            adapters=[
                pb.LoadedAdapter(
                    name=n, versions=v, digests=digests.get(n, {}), signers=signers.get(n, {}), proofs=proofs.get(n, {})
                )
                for n, v in sorted(loaded.items())
            ],
            in_flight=self.in_flight,
            queue_depth=stats.queued,
            limits=pb.Limits(
                max_n=lim.max_n,
                max_new_tokens=lim.max_new_tokens,
                max_prompt_tokens=lim.max_prompt_tokens,
                max_adapter_bytes=lim.max_adapter_bytes,
                adapter_window=self.config.adapter_window,
                adapter_keep=max(self.config.adapter_keep, self.config.adapter_window),
                max_context=min(self.engine.max_context, (1 << 32) - 1),
            ),
            server_version=__version__,
            base_linear_layers=[
                pb.LinearLayer(module=m, out_features=o, in_features=i)
                for m, (o, i) in sorted(self.base_shapes.items())
            ],
        )
