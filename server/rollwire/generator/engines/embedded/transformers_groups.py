"""The transformers engine's groups on their way through the worker thread: a group and its
event queue, the mailbox that hands each step's events to an event loop, the KV-token
reservation a group is admitted by, and the statuses that end groups when something fails
(see transformers_engine.py's docstring for the blast radius of each).

Invariant: the worker thread never blocks on an event loop; it posts and moves on, and a
loop that is gone marks its groups cancelled (nobody is listening).
"""

from __future__ import annotations

import asyncio
import errno
import random
import re
import secrets
import threading
from dataclasses import dataclass, field

import torch

from rollwire.common.errors import FailedPrecondition, Internal, InvalidArgument, ResourceExhausted
from rollwire.common.reasons import Reason
from rollwire.generator.detokenize import TextStream
from rollwire.generator.engines.embedded.prefix_cache import AdapterKey
from rollwire.generator.sampling import sample_seeds, skip_draws
from rollwire.generator.types import GroupRequest
from rollwire.runtime.logs import get_logger

log = get_logger("rollwire.generator.engines.embedded.transformers_engine")
_MAX_ERROR_CHARS = 200  # an exception's text as a status message may echo it

END = object()
"""The last item of a group's queue."""


@dataclass
class Group:
    req: GroupRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    cancelled: bool = False
    open_rows: int = 0
    admitted_at: int = 0  # the prefill that admitted it (among equal reservations, earlier ones go first on OOM)

    def send(self, items: list) -> None:
        try:
            self.loop.call_soon_threadsafe(_put_all, self.events, items)
        except RuntimeError:  # the caller's event loop is gone; nobody is listening
            self.cancelled = True


@dataclass
class Row:
    """One sample being generated: a row of the running batch."""

    group: Group
    index: int
    generator: random.Random
    position: int  # position id of the next token fed to the model
    adapter: str | None  # engine handle; None = the base model
    version: int  # the adapter version `adapter` stands for: what the row's next tokens are tagged with
    text: TextStream
    key: AdapterKey  # the selection its prompt was prefilled under (prefix cache)
    generated: int = 0  # tokens sampled so far
    last_token: int = -1
    tokens: list[int] = field(default_factory=list)  # sampled so far
    routes: list | None = None  # GroupRequest.routed_experts: [positions, layers, top_k] chunks, oldest first


_STOP_TAIL = 64  # characters of a sample's text kept for stop strings (at most 64 characters each)


def prefill_units(groups: list[Group]) -> list[tuple[Group, AdapterKey, list[int], list[int]]]:
    """A prefill's rows: (group, adapter key, tokens to prefill, the sample indices that share
    them): a group's prompt for all its n samples, or, resumed (GroupRequest.resume), each
    continued sample's prompt + tokens so far for it alone (the prefix cache may hold the
    prompt). Each group's selection is read once (a following group may switch meanwhile)."""
    units = []
    for g in groups:
        sel = g.req.adapter
        key: AdapterKey = (sel.name, sel.version, sel.handle)
        if not g.req.resume:
            units.append((g, key, g.req.prompt_ids, list(range(g.req.n))))
        for i in g.req.indices() if g.req.resume else ():
            units.append((g, key, [*g.req.prompt_ids, *g.req.resume[i]], [i]))
    return units


def group_seeds(g: Group) -> list[int]:
    """The seed of each of a group's n samples: (seed, i), the sample's own seed when a proxy
    merged single-sample requests (see sampling.py), or fresh ones when unseeded."""
    s, n = g.req.sampling, g.req.n
    return sample_seeds(s.seed, s.sample_seeds, n) or sample_seeds(secrets.randbits(62), (), n) or []


def new_rows(g: Group, key: AdapterKey, indices: list[int], seeds: list[int], text_backend) -> list[Row]:
    """Rows for samples `indices` of a group, each with its own seeded generator. A resumed
    sample (GroupRequest.resume) starts where it stopped: its tokens so far are its own
    (counted, fed, spelled into its TextStream, so text deltas and a stop string that spans
    the seam come out as unsplit), and its generator has skipped the draws they took
    (sampling.skip_draws), so its next tokens are those of an uninterrupted run."""
    s = g.req.sampling
    keep = _STOP_TAIL if s.stop else 0
    rows = []
    for i in indices:
        have = g.req.resume.get(i, [])
        text = TextStream(text_backend, keep)
        if have:
            text.add(have)  # already sent, by the replica that spelled them
        generator = skip_draws(s, random.Random(seeds[i]), len(have))
        row = Row(g, i, generator, len(g.req.prompt_ids) + len(have), key[2], key[1], text, key)
        row.generated, row.tokens = len(have), list(have)
        row.last_token = have[-1] if have else -1
        rows.append(row)
    return rows


def _put_all(queue: asyncio.Queue, items: list) -> None:
    for item in items:
        queue.put_nowait(item)


class Mailbox:
    """Events on their way from the worker to one event loop.

    The worker posts each step's events and wakes the loop only when no wake-up is already
    pending, so a loop that falls behind takes several steps' events in one callback (and
    each group's stream sends them as one message) instead of being woken once per step.
    Order is kept: events go out in the order they were posted."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[Group, list]] = []
        self._due = False

    def post(self, deliveries: list[tuple[Group, list]]) -> bool:
        """False when the loop is gone (nobody is listening)."""
        with self._lock:
            self._items.extend(deliveries)
            if self._due:
                return True
            self._due = True
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:
            return False
        return True

    def _drain(self) -> None:
        with self._lock:
            items, self._items, self._due = self._items, [], False
        for group, events in items:
            _put_all(group.events, events)


def deliver(mailboxes: dict[asyncio.AbstractEventLoop, Mailbox], outbox: dict[int, tuple[Group, list]]) -> None:
    """Hand one step's events to their event loops' mailboxes (created on first use, dropped
    with their groups marked cancelled when the loop is gone)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Group, list]]] = {}
    for group, items in outbox.values():
        by_loop.setdefault(group.loop, []).append((group, items))
    for loop, deliveries in by_loop.items():
        box = mailboxes.get(loop)
        if box is None:
            box = mailboxes[loop] = Mailbox(loop)
        if not box.post(deliveries):
            del mailboxes[loop]
            for group, _ in deliveries:
                group.cancelled = True


class NonFinite(Exception):
    """A group's sampling met NaN or +inf; the argument says where."""


def row_error(group: Group, exc: Exception):
    """The status that ends one group whose sampling failed (see the module docstring); a
    failure to allocate memory is the replica's load (ENGINE_OOM), not the request's fault."""
    rid = group.req.request_id
    if out_of_memory(exc):
        log.warning("engine_out_of_memory", where="sampling", groups=1, request_id=rid, error=clip_exc(exc))
        return oom_status(group, "sampling")
    if isinstance(exc, NonFinite):
        log.warning("group_non_finite", request_id=rid, where=str(exc))
        return FailedPrecondition(
            f"the model produced NaN or infinite values in {exc} of this request (adapter "
            f"{group.req.adapter.name or 'base'} v{group.req.adapter.version}); nothing can be sampled from "
            "them. Check the adapter's weights (a diverged run produces them) or sample from another version",
            reason=Reason.NON_FINITE_LOGITS,
        )
    log.exception("group_sampling_failed", request_id=rid, exc_info=exc)
    return Internal(
        f"sampling this request failed on this replica ({clip_exc(exc)}); the other requests were not "
        "affected. Report it with the request id",
        reason=Reason.ROW_FAILED,
    )


def kv_tokens(req: GroupRequest) -> int:
    """The KV-cache tokens a group may come to hold: its rows (n, or the samples it resumes) x
    (prompt + max_new_tokens); a resumed sample's tokens so far are part of its max_new_tokens."""
    return req.rows * (len(req.prompt_ids) + req.sampling.max_new_tokens)


def oom_victim(groups: list[Group]) -> Group:
    """The group a step that ran out of memory ends: the largest KV reservation, ties by the
    earliest admission (why: transformers_engine._decode_within_memory)."""
    return max(groups, key=lambda g: (kv_tokens(g.req), -g.admitted_at))


_ALLOCATION_FAILED = re.compile(
    r"out of memory"  # CUDA/HIP/XPU/MPS "... out of memory", "CUDA error: out of memory", c10 "Out of Memory"
    r"|not enough memory"  # DefaultCPUAllocator in some torch versions
    r"|(?:can't|cannot|could not|unable to) allocate memory"  # DefaultCPUAllocator, ENOMEM's strerror, c10
    r"|_ALLOC_FAILED\b",  # CUBLAS_/CUSOLVER_/CUSPARSE_/CUDNN_STATUS_ALLOC_FAILED, CUFFT_ALLOC_FAILED
    re.IGNORECASE,
)


def out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` is a failure to allocate memory: the replica's load, never its fault.

    The one place this is decided. torch raises torch.OutOfMemoryError from its CUDA caching
    allocator, but a plain RuntimeError from the CPU allocator ("DefaultCPUAllocator: can't
    allocate memory: you tried to allocate N bytes. Error code 12 (Cannot allocate memory)"),
    from CUDA calls outside the allocator ("CUDA error: out of memory") and from the CUDA
    libraries' own allocations ("CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate(handle)"),
    so RuntimeErrors are matched by those messages. Every other error (a device fault, a bug,
    CUBLAS_STATUS_EXECUTION_FAILED, an illegal memory access) is not."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    if isinstance(exc, OSError):
        return exc.errno == errno.ENOMEM
    return isinstance(exc, RuntimeError) and _ALLOCATION_FAILED.search(str(exc)) is not None


def oom_status(g: Group, where: str, why: str = "") -> ResourceExhausted:
    """RESOURCE_EXHAUSTED ENGINE_OOM for one group, with a retry hint."""
    because = f"; {why}" if why else ""
    return ResourceExhausted(
        f"this replica ran out of memory in {where} while serving this request ({g.req.n} samples, "
        f"{len(g.req.prompt_ids)} prompt tokens, up to {g.req.sampling.max_new_tokens} new){because}; retry, or ask "
        "for fewer samples or tokens",
        reason=Reason.ENGINE_OOM,
        retry_after_s=1.0,
    )


def fail_out_of_memory(groups: list[Group], where: str, why: str = "") -> None:
    """Groups ended because memory ran out in `where`: RESOURCE_EXHAUSTED with a retry hint,
    the replica's load, never its fault (faults.py: the proxy retries it elsewhere)."""
    log.warning("engine_out_of_memory", where=where, groups=len(groups), why=why)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    for g in groups:
        g.send([oom_status(g, where, why), END])


def fail_engine(groups: list[Group], exc: Exception) -> None:
    """A step failed with no row to blame: end every group in it. A replica fault (INTERNAL
    ENGINE_FAILED), unless memory ran out (ENGINE_OOM, the replica's load).

    Never raises into the worker loop: when reporting the failure fails too (memory can run
    out while a traceback is formatted), each group still gets a status, so the engine thread
    lives on and no caller waits on a group nobody will end."""
    try:
        _fail_engine(groups, exc)
    except Exception as again:
        memory = out_of_memory(exc) or out_of_memory(again)
        for g in groups:
            failed = Internal(
                "generation failed on this replica; retry on another replica", reason=Reason.ENGINE_FAILED
            )
            g.send([oom_status(g, "a batch step") if memory else failed, END])


def _fail_engine(groups: list[Group], exc: Exception) -> None:
    if out_of_memory(exc):
        fail_out_of_memory(groups, "a batch step", clip_exc(exc))
        return
    log.exception("engine_step_failed", groups=len(groups), exc_info=exc)
    for g in groups:
        g.send(
            [
                Internal(
                    f"generation failed on this replica ({clip_exc(exc)}); retry on another replica",
                    reason=Reason.ENGINE_FAILED,
                ),
                END,
            ]
        )


def clip_exc(exc: Exception) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= _MAX_ERROR_CHARS else text[:_MAX_ERROR_CHARS] + "..."


def check_fits(req: GroupRequest, max_rows: int, max_tokens: int) -> None:
    """Refuse up front a group that could never be admitted (its rows or its KV-token reservation)."""
    if req.rows > max_rows:
        raise InvalidArgument(f"n={req.rows} exceeds this engine's batch of {max_rows} rows")
    if kv_tokens(req) > max_tokens:
        raise InvalidArgument(
            f"this group would hold {kv_tokens(req)} tokens of KV cache (n {req.rows} x (prompt "
            f"{len(req.prompt_ids)} + max_new_tokens {req.sampling.max_new_tokens})), more than this replica's "
            f"budget of {max_tokens}; ask for fewer samples or fewer new tokens per request (the replica's operator "
            "raises the budget with transformers.max_batch_tokens, or transformers.kv_memory_fraction when it is "
            "derived from free memory)",
            reason=Reason.KV_BUDGET,
        )


def eos_ids(config, tokenizer) -> set[int]:
    ids = config.eos_token_id if config.eos_token_id is not None else tokenizer.eos_token_id
    return set(ids if isinstance(ids, list) else [ids]) - {None}
