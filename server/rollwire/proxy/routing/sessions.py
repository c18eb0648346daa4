"""Session turns at the proxy: the proxy keeps each session's history and routes it sticky.

A turn (GenerateRequest.session) is forwarded to a replica as a plain request whose
`token_ids` are the session's whole history followed by the turn's new tokens, so any
replica can serve any turn: the one that served the previous turn is preferred (its prefix
cache holds the history's KV), and another one rebuilds it by prefill.

Invariants:
- the history lives here only (serving/sessions.py bounds it); a replica never holds a
  session for the proxy, so losing a replica loses no episode: the next attempt or turn
  goes elsewhere with the same tokens;
- a turn goes to the session's replica unless it is overloaded (dispatch.Dispatcher._sticky),
  draining, down (ejected, unhealthy or gone), lacks the version the turn needs, or failed
  this turn; each turn is counted once in rollwire_proxy_session_routes_total by where it ran;
- the history grows only when the turn's one sample finished: what the client was sent,
  started.prompt_token_ids and the sample's tokens of the attempt that completed (tokens of
  an attempt followed by `restarted` are dropped with it; a resumed turn's stream simply goes
  on, its continuation being the plain request forwarded here: failover.py);
- the proxy does not tokenize: a turn after the first must send token_ids (BAD_SESSION).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from rollwire.common.errors import InvalidArgument
from rollwire.common.reasons import Reason
from rollwire.proxy.fleet.replicas import ReplicaSet
from rollwire.proxy.routing.dispatch import Client, Dispatcher
from rollwire.proxy.routing.failover import GroupRun
from rollwire.serving.sessions import SessionStore, Turn, check_turn
from rollwire.v1 import generator_pb2 as pb


class SessionTurns:
    """Runs session turns through the dispatcher with the proxy's SessionStore."""

    def __init__(self, store: SessionStore, dispatcher: Dispatcher) -> None:
        self.store, self.dispatcher = store, dispatcher
        self.replicas: ReplicaSet = dispatcher.replicas
        self.metrics = dispatcher.metrics

    async def events(
        self, request: pb.GenerateRequest, rid: str, caller: str, deadline: float, client: Client | None
    ) -> AsyncIterator[pb.GenerateResponse]:
        """One turn's stream, as a replica would send it (started.prompt_token_ids is the
        whole history); raises RollwireError or PassThrough as GroupRun does."""
        turn = self._begin(request, caller)
        try:
            forward = self._forward(request, turn)
            prefer = turn.session.replica
            cause = self._cause(prefer, forward)
            run = GroupRun(forward, rid, deadline, self.dispatcher, client, prefer=prefer if not cause else "")
            prompt: list[int] = []
            version = 0
            async for message in run.events():
                if message.HasField("restarted"):
                    turn.output.clear()
                if message.HasField("started"):
                    prompt, version = list(message.started.prompt_token_ids), message.started.adapter.version
                turn.output.extend(t for chunk in message.tokens if chunk.sample_index == 0 for t in chunk.token_ids)
                if message.finished and not turn.done:  # the one sample ended: keep the turn before sending it
                    served = run.current.address if run.current is not None else ""
                    turn.commit(prompt, list(turn.output), replica=served, version=version)
                    self.metrics.session_routes.labels(self._outcome(prefer, cause, served, run.failed)).inc()
                yield message
        finally:
            turn.close(end=request.session.end)

    def _begin(self, request: pb.GenerateRequest, caller: str) -> Turn:
        """Checks before any work (serving/sessions.py), against the strictest limits of the
        fleet's routable replicas (replicas.fleet_limits)."""
        sid = check_turn(request)
        kind = request.WhichOneof("prompt")
        session = self.store.get(caller, sid)
        if kind == "text" and session is not None and session.turns:
            raise InvalidArgument(
                f"session {sid!r} is held by a proxy, which does not tokenize: send this turn's new tokens as "
                "token_ids (only a session's first turn may be text)",
                reason=Reason.BAD_SESSION,
            )
        new = len(request.token_ids.ids) if kind == "token_ids" else len(request.text.encode())
        limits = self.replicas.fleet_limits()
        context = min((x.max_context for x in limits if x.max_context), default=0)
        prompt_limit = min((x.max_prompt_tokens for x in limits if x.max_prompt_tokens), default=0)
        turn = self.store.begin(
            caller,
            sid,
            new,
            request.sampling.max_new_tokens,
            context if kind == "token_ids" else 0,  # a text's length in tokens is known only once tokenized
            adapter=request.adapter.name,
            max_prompt=prompt_limit if kind == "token_ids" else 0,
            expect=request.session.expect_tokens,
        )
        turn.apply_version(request.adapter)
        return turn

    def _forward(self, request: pb.GenerateRequest, turn: Turn) -> pb.GenerateRequest:
        """The plain request a replica serves: the whole history, then this turn's new tokens."""
        forward = pb.GenerateRequest()
        forward.CopyFrom(request)
        forward.ClearField("session")
        if request.WhichOneof("prompt") == "token_ids" and turn.history:
            del forward.token_ids.ids[:]
            forward.token_ids.ids.extend([*turn.history, *request.token_ids.ids])
        return forward

    def _cause(self, prefer: str, forward: pb.GenerateRequest) -> str:
        """Why the session's replica cannot take this turn ("" when it can, or there is none)."""
        if not prefer:
            return ""
        replica = self.replicas.get(prefer)
        if replica is None:
            return "down"
        if replica.draining:
            return "draining"
        if not replica.routable():
            return "down"
        name, version = forward.adapter.name, forward.adapter.version or self.replicas.latest(forward.adapter.name)
        if name and version and not replica.holds(name, version):
            return "version"
        return ""

    @staticmethod
    def _outcome(prefer: str, cause: str, served: str, failed: list[str]) -> str:
        if not prefer:
            return "first"
        if served == prefer:
            return "sticky"
        return cause or ("failed" if prefer in failed else "overloaded")
