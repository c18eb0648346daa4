"""What a group's client was sent so far, per sample: enough to continue it on another replica.

When the replica running a group fails after its client saw tokens, failover.py continues
the group elsewhere instead of restarting it: the continuation is the same request (same
prompt, the version the group resolved, or the newest for a group that follows; same
sampling settings and seeds) with `resume` listing each unfinished sample and the tokens it
has (GenerateRequest.resume). The replica runs only those samples, each from where it
stopped, under its own index and seed, for max_new_tokens less what it has; on the
transformers engine a seeded sample's continuation is exactly its uninterrupted run.

Invariants:
- `tokens` holds exactly the token ids of every chunk relayed to the client, per sample, in
  order (with a caller's own `resume` prefix before them), and `finished` the samples whose
  end was relayed; nothing else, so a continuation conditions each sample on what its client
  holds, and a finished sample is never run again;
- bounded by the request's own limits: a sample holds at most max_new_tokens ids (a replica
  refuses more), so a group costs the proxy at most n x max_new_tokens ints; a replica that
  sends more makes the group unresumable (restarted, cause "limits": metrics.RESTART_CAUSES);
- only token ids are kept: the client already holds the logprobs and text, and the replica
  that continues spells the text again from the ids (its TextStream is primed with them, so
  text deltas and stop strings across the seam come out as unsplit);
- after a restart (`reset`) the group is back to what the caller asked for.
"""

from __future__ import annotations

from collections.abc import Iterable

from rollwire.v1 import generator_pb2 as pb


class Progress:
    """One group's samples as its client holds them (see the module docstring).

    Nothing here is sized by the request's `n` until a replica has started the group (which
    bounds n by its limits): a hostile n of 2**32 - 1 costs nothing before it is refused."""

    def __init__(self, request: pb.GenerateRequest) -> None:
        self.limit = request.sampling.max_new_tokens
        self.n = request.n
        self._asked = {e.sample_index: list(e.token_ids) for e in request.resume}
        """A caller's own `resume` (it runs only those samples, from those tokens)."""
        self.tokens: dict[int, list[int]] = {}
        self.finished: set[int] = set()
        self.shown = False
        """Whether the client was sent anything of the group (a `started` included)."""
        self.reset()

    def runs(self) -> Iterable[int]:
        """The samples this group runs (only read once the group has started)."""
        return sorted(self._asked) if self._asked else range(self.n)

    def reset(self) -> None:
        """Back to what the caller asked for: after a restart the client discards every partial sample."""
        self.tokens = {i: list(t) for i, t in self._asked.items()}
        self.finished = set()

    def observe(self, message: pb.GenerateResponse) -> None:
        """Record one message relayed to the client."""
        self.shown = True
        for chunk in message.tokens:
            self.tokens.setdefault(chunk.sample_index, []).extend(chunk.token_ids)
        for done in message.finished:
            self.finished.add(done.sample_index)

    def unfinished(self) -> list[int]:
        """The samples not yet finished; [] before the group was shown (nothing to continue)."""
        if not self.shown:
            return []
        return [i for i in self.runs() if i not in self.finished]

    def over_limit(self) -> bool:
        """A sample holds as many tokens as its max_new_tokens, or more, yet did not finish."""
        return any(len(self.tokens.get(i, ())) >= self.limit for i in self.unfinished())

    def sent(self) -> int:
        """Tokens the client was sent in this group (beyond a caller's own prefixes)."""
        return sum(len(t) for t in self.tokens.values()) - sum(len(t) for t in self._asked.values())

    def continuation(self, request: pb.GenerateRequest) -> pb.GenerateRequest:
        """`request` continuing every unfinished sample from its tokens so far."""
        out = pb.GenerateRequest()
        out.CopyFrom(request)
        del out.resume[:]
        for i in self.unfinished():
            out.resume.add(sample_index=i, token_ids=self.tokens.get(i, ()))
        return out
