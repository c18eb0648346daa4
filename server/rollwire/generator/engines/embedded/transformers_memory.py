"""What the transformers engine ends when memory runs out, mixed into TransformersEngine.

Memory is load, never a fault. Groups are admitted while their KV-token reservations
(n x (prompt + max_new_tokens)) fit the budget (kv_memory.py); one that could never fit is
refused up front (KV_BUDGET). When an allocation still fails (transformers_groups.
out_of_memory: torch's OOM, the CPU allocator's and the CUDA libraries' allocation failures),
whether in a decode step, in a prefill or while new rows join the batch, one group at a time
ends with RESOURCE_EXHAUSTED, reason ENGINE_OOM (the proxy retries it elsewhere and never
counts it against the replica): the largest reservation among the groups involved, ties by
the earliest admission (transformers_groups.oom_victim); the rest try again until the step
fits, each with exactly the tokens it would have had.

Invariant: a failed try leaves the running batch valid (a decode step's cache is cut back,
kv_batch.merge puts the batch back, a prefill sends nothing before it succeeds), so nothing is
sent twice and no group is left without an answer.
"""

from __future__ import annotations

import torch

from rollwire.generator.engines.embedded import kv_batch
from rollwire.generator.engines.embedded.kv_batch import Batch
from rollwire.generator.engines.embedded.transformers_groups import (
    Group,
    fail_engine,
    fail_out_of_memory,
    kv_tokens,
    oom_victim,
    out_of_memory,
)


class MemoryRules:
    """The engine's steps within memory; the engine provides the four steps they wrap."""

    def _decode(self, batch: Batch) -> Batch | None:
        raise NotImplementedError

    def _prefill(self, groups: list[Group]) -> tuple[Batch, torch.Tensor]:
        raise NotImplementedError

    def _sample_and_emit(self, batch: Batch, logits: torch.Tensor) -> Batch | None:
        raise NotImplementedError

    def _drop_rows(self, batch: Batch, drop: list[int]) -> Batch:
        raise NotImplementedError

    def _decode_within_memory(self, batch: Batch | None) -> Batch | None:
        """A decode step; when it runs out of memory, the cache is cut back to where it was
        before the step, the group holding the largest KV reservation (ties: the one admitted
        first) is ended with RESOURCE_EXHAUSTED ENGINE_OOM, and the others step again, one
        eviction per failed try, up to the last group standing.

        Why by reservation and not by admission: every group was admitted because its
        reservation fitted the budget, so when memory still runs out it is the groups that
        grew toward large reservations that hold it, and ending one of them frees the most.
        Ending the newest instead let one long, large group admitted earlier end every group
        admitted after it, each retried elsewhere as busy, while it went on holding the memory.
        Among equals the oldest goes: its real keys and values reach furthest back, so the
        batch's padding columns shrink with it."""
        while batch is not None:
            kv_len = batch.mask.shape[1]
            try:
                return self._decode(batch)
            except Exception as exc:
                if not out_of_memory(exc):
                    raise
                kv_batch.cut_cache(batch.cache, kv_len)
                batch, _ = self._end_largest("a decode step", batch, [])
        return None

    def _admit_within_memory(self, batch: Batch | None, admitted: list[Group]) -> Batch | None:
        """Prefill the admitted groups and join their rows to the running batch, by the decode
        step's rule when memory runs out: in the prefill's pass (before any token is sent, so
        it can be redone) or while the rows join (kv_batch.merge puts the batch back), the
        largest reservation among the running and the joining groups ends, and the rest try
        again. A newcomer that holds more than the running groups goes first; a small one
        does not pay for a large group that holds the memory. Any other failure of the pass
        ends only the groups being admitted (the running batch's cache is untouched)."""
        joining = list(admitted)
        while joining:
            try:
                fresh, logits = self._prefill(joining)
            except Exception as exc:
                if not out_of_memory(exc):
                    fail_engine(joining, exc)
                    return batch
                batch, victim = self._end_largest("a prefill", batch, joining)
                joining = [g for g in joining if g is not victim]
                continue
            return self._join_within_memory(batch, self._sample_and_emit(fresh, logits))  # first tokens sent
        return batch

    def _join_within_memory(self, batch: Batch | None, fresh: Batch | None) -> Batch | None:
        while batch is not None and fresh is not None:
            try:
                return kv_batch.merge(batch, fresh)
            except Exception as exc:
                if not out_of_memory(exc):
                    raise
                joining = list({id(r.group): r.group for r in fresh.rows}.values())
                batch, victim = self._end_largest("new groups joining the batch", batch, joining)
                fresh = self._without(fresh, victim)
        return fresh if batch is None else batch

    def _end_largest(self, where: str, batch: Batch | None, others: list[Group]) -> tuple[Batch | None, Group]:
        """End the group with the largest KV reservation among the batch's and `others`
        (transformers_groups.oom_victim) with ENGINE_OOM; the batch without its rows, and it."""
        running = [r.group for r in batch.rows] if batch is not None else []
        groups = list({id(g): g for g in [*running, *others]}.values())
        victim = oom_victim(groups)
        held = sum(kv_tokens(g.req) for g in groups)
        fail_out_of_memory(
            [victim],
            where,
            f"it held the largest KV reservation of the {len(groups)} groups involved "
            f"({kv_tokens(victim.req)} of {held} tokens reserved)",
        )
        victim.cancelled = True  # nothing more is sent to it
        return (self._without(batch, victim) if batch is not None else None), victim

    def _without(self, batch: Batch, group: Group) -> Batch | None:
        batch = self._drop_rows(batch, [i for i, r in enumerate(batch.rows) if r.group is group])
        return batch if batch.rows else None


__all__ = ["MemoryRules"]
