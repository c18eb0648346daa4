"""The embedded engine: a Hugging Face causal LM with PEFT LoRA adapters, on CPU or GPU.

One worker thread owns the model. It runs a continuous-batching loop: each iteration it
applies adapter loads/unloads, admits waiting groups (one prefill for all of them, one
row per group, whose KV cache and first logits are then copied for each of its samples,
left-padded and merged into the running batch), then runs one decode step for every
running row. Rows of different groups, different sampling params and different
adapters share every forward pass (LoRA deltas per adapter sub-batch, lora.py). Finished
and cancelled rows leave the batch at once.

Per step, everything after the forward pass is done for the whole batch at once: one
sampling transform over every row (sampling.py: each row with its own params), one draw
(row i of a group takes its uniforms from its own generator seeded from (seed, i), so a
seeded sample does not depend on what else is batched), one transfer of the tokens and
logprobs to Python, a DecodeStream step per row (detokenize.py), and one hand-off of every
group's events to the event loop (`_Mailbox`: at most one wake-up per step, none while the
loop has not yet taken the previous step's events).

Failure isolation (blast radius): a row's failure ends its own group, never the batch.
When the distribution a row would sample from holds NaN or +inf (or the chosen token's
logprob is not finite) its group ends with FAILED_PRECONDITION, reason NON_FINITE_LOGITS
(the model or the request's adapter produced values nothing can be sampled from; no client
should retry it unchanged); the check is per row, so its neighbours are untouched. If
sampling the whole batch raises, the step is redone group by group with the same uniforms,
so the group that raises is found and every other group gets exactly the tokens it would
have had; any exception while sampling or emitting a group ends that group with INTERNAL,
reason ROW_FAILED (a bug tied to that request). Either way its rows leave the batch and
every other row continues. The proxy must
classify by reason: neither of these means the replica is sick. Only a failure of a forward
pass itself (OOM, a device error), which no row can be blamed for, ends the groups in that
pass with INTERNAL, reason ENGINE_FAILED: that one is a replica fault. A failed prefill
ends only the groups being admitted; the running batch keeps decoding.
"""

from __future__ import annotations

import asyncio
import random
import secrets
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rollwire.common import kept
from rollwire.common.errors import FailedPrecondition, Internal, InvalidArgument, ResourceExhausted
from rollwire.common.logs import get_logger
from rollwire.common.manifest import Manifest
from rollwire.common.reasons import Reason
from rollwire.generator.detokenize import TextStream, backend
from rollwire.generator.engines.base import EngineStats
from rollwire.generator.engines.lora import LoraSet
from rollwire.generator.sampling import inverse_cdf, nonfinite_rows, row_uniforms, sample_generator, sampling_logprobs
from rollwire.generator.types import Event, GroupRequest, SampleDone, SamplingParams, TokenDelta

log = get_logger(__name__)
_MAX_ERROR_CHARS = 200  # an exception's text as a status message may echo it
_STOP_TAIL = 64  # characters of a sample's text kept for stop strings (at most 64 characters each)


@dataclass
class _Group:
    req: GroupRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    cancelled: bool = False
    open_rows: int = 0
    admitted_at: int = 0  # the prefill that admitted it (later ones are the first to go when memory runs out)

    def send(self, items: list) -> None:
        try:
            self.loop.call_soon_threadsafe(_put_all, self.events, items)
        except RuntimeError:  # the caller's event loop is gone; nobody is listening
            self.cancelled = True


def _put_all(queue: asyncio.Queue, items: list) -> None:
    for item in items:
        queue.put_nowait(item)


class _Mailbox:
    """Events on their way from the worker to one event loop.

    The worker posts each step's events and wakes the loop only when no wake-up is already
    pending, so a loop that falls behind takes several steps' events in one callback (and
    each group's stream sends them as one message) instead of being woken once per step.
    Order is kept: events go out in the order they were posted."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[_Group, list]] = []
        self._due = False

    def post(self, deliveries: list[tuple[_Group, list]]) -> bool:
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


_END = object()


@dataclass
class _Row:
    group: _Group
    index: int
    generator: random.Random
    position: int  # position id of the next token fed to the model
    adapter: str | None  # engine handle; None = the base model
    version: int  # the adapter version `adapter` stands for: what the row's next tokens are tagged with
    text: TextStream
    generated: int = 0  # tokens sampled so far
    last_token: int = -1


@dataclass
class _Batch:
    rows: list[_Row]
    cache: Any  # transformers DynamicCache, rows in the same order
    mask: torch.Tensor  # [rows, kv_len] 1 = real token


class TransformersEngine:
    """Engine over transformers, LoRA adapters by forward hooks (lora.py); see the module
    docstring for the batching loop."""

    name = "transformers"
    returns_kept_tokens = True
    """Reports each token's kept set when a request asks (SamplingParams.return_kept)."""
    follows_versions = True
    """Switches a following group's rows to its new selection at their next decode step (GroupRequest.follow)."""
    _lora: LoraSet  # set by _load, with the model

    def __init__(
        self,
        model_dir: str | Path,
        *,
        max_batch_rows: int = 64,
        max_batch_tokens: int = 1 << 20,
        threads: int = 0,
        device: str = "cpu",
        on_forward: Callable[[int], None] = lambda rows: None,
    ):
        self.model_dir = Path(model_dir)
        self.on_forward = on_forward
        self.max_batch_rows = max_batch_rows
        self.max_batch_tokens = max_batch_tokens
        self.threads = threads
        self.device = torch.device(device)
        self._cv = threading.Condition()
        self._pending: deque[_Group] = deque()
        self._ops: list[tuple[Future, object]] = []
        self._running_groups = 0
        self._admissions = 0  # prefills so far: a group's admitted_at
        self._stop = False
        self._thread: threading.Thread | None = None
        self._mailboxes: dict[asyncio.AbstractEventLoop, _Mailbox] = {}  # touched by the worker only

    # -- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        await asyncio.to_thread(self._load)
        self._thread = threading.Thread(target=self._worker, name="rollwire-engine", daemon=True)
        self._thread.start()

    def _load(self) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if self.threads:
            torch.set_num_threads(self.threads)
        if not (self.model_dir / "config.json").is_file():
            raise FailedPrecondition(f"{self.model_dir} is not a local Hugging Face model folder (no config.json)")
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        model: Any = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)  # stubs lack .to()
        self.model = model.to(self.device).eval()
        self.vocab_size = int(self.model.config.vocab_size)
        self.max_context = int(getattr(self.model.config, "max_position_embeddings", 0) or 1 << 30)
        self.eos_ids = _eos_ids(self.model.config, self.tokenizer)
        self._text_backend = backend(self.tokenizer)
        self._lora = LoraSet(self.model)
        log.info("engine_loaded", engine=self.name, model=str(self.model_dir), vocab=self.vocab_size)

    async def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread:
            await asyncio.to_thread(self._thread.join, 30)

    # -- public API (event loop side) --------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def stats(self) -> EngineStats:
        with self._cv:
            return EngineStats(running=self._running_groups, queued=len(self._pending))

    async def generate(self, group: GroupRequest) -> AsyncIterator[list[Event]]:
        if group.n > self.max_batch_rows:
            raise InvalidArgument(f"n={group.n} exceeds this engine's batch of {self.max_batch_rows} rows")
        if _kv_tokens(group) > self.max_batch_tokens:
            raise InvalidArgument(
                f"this group would hold {_kv_tokens(group)} tokens of KV cache (n {group.n} x (prompt "
                f"{len(group.prompt_ids)} + max_new_tokens {group.sampling.max_new_tokens})), more than this replica's "
                f"budget of {self.max_batch_tokens}; ask for fewer samples or fewer new tokens per request",
                reason=Reason.KV_BUDGET,
            )
        g = _Group(group, asyncio.get_running_loop(), asyncio.Queue())
        with self._cv:
            self._pending.append(g)
            self._cv.notify_all()
        try:
            while True:
                ready = [await g.events.get()]
                while not g.events.empty():
                    ready.append(g.events.get_nowait())
                events = [e for e in ready if e is not _END and not isinstance(e, Exception)]
                if events:
                    yield events
                for item in ready:
                    if isinstance(item, Exception):
                        raise item
                if ready[-1] is _END:
                    return
        finally:
            with self._cv:
                g.cancelled = True
                if g in self._pending:
                    self._pending.remove(g)

    async def load_adapter(self, handle: str, manifest: Manifest, payload: bytes) -> None:
        from safetensors.torch import load as load_safetensors

        tensors = await asyncio.to_thread(load_safetensors, payload)
        await self._call(("load", handle, manifest, tensors))

    async def unload_adapter(self, handle: str) -> None:
        await self._call(("unload", handle))

    async def _call(self, op) -> None:
        fut: Future = Future()
        with self._cv:
            self._ops.append((fut, op))
            self._cv.notify_all()
        await asyncio.wrap_future(fut)

    # -- worker thread -------------------------------------------------------------------
    def _worker(self) -> None:
        batch: _Batch | None = None
        with torch.inference_mode():
            while True:
                with self._cv:
                    while not self._stop and not self._ops and not self._pending and batch is None:
                        self._cv.wait()
                    if self._stop:
                        break
                    ops, self._ops = self._ops, []
                    admitted = self._take_pending(batch)
                self._apply_ops(ops)
                try:
                    batch = self._step(batch, admitted)
                except Exception as exc:  # a bug or OOM must fail the requests, not hang them
                    groups = {id(r.group): r.group for r in (batch.rows if batch else [])}
                    groups.update({id(g): g for g in admitted})
                    _fail_engine(list(groups.values()), exc)
                    batch = None
                with self._cv:
                    self._running_groups = len({id(r.group) for r in batch.rows}) if batch else 0
        self._fail_all("the generator is shutting down; retry on another replica")

    def _take_pending(self, batch: _Batch | None) -> list[_Group]:
        """Waiting groups, in order, while their rows and their KV-token reservations fit
        beside the running ones (a group's reservation lasts while any of its rows runs)."""
        running = {id(r.group): r.group for r in batch.rows} if batch else {}
        used_rows = len(batch.rows) if batch else 0
        used_tokens = sum(_kv_tokens(g.req) for g in running.values())
        admitted = []
        while self._pending:
            g = self._pending[0]
            if g.cancelled:
                self._pending.popleft()
                continue
            if used_rows + g.req.n > self.max_batch_rows or used_tokens + _kv_tokens(g.req) > self.max_batch_tokens:
                break
            admitted.append(self._pending.popleft())
            used_rows, used_tokens = used_rows + g.req.n, used_tokens + _kv_tokens(g.req)
        return admitted

    def _fail_all(self, message: str) -> None:
        with self._cv:
            pending, self._pending = list(self._pending), deque()
        from rollwire.common.errors import Unavailable

        for g in pending:
            g.send([Unavailable(message), _END])

    def _apply_ops(self, ops) -> None:
        """Adapter loads/unloads between steps. A caller that went away (its future was
        cancelled) is skipped; nothing here may raise into the worker loop."""
        for fut, op in ops:
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                if op[0] == "load":
                    _, handle, manifest, tensors = op
                    self._lora.load(handle, manifest.lora, tensors)
                else:
                    self._lora.unload(op[1])
                fut.set_result(None)
            except Exception as exc:
                fut.set_exception(exc)

    def _forward(self, adapters: list[str | None], **inputs):
        """One forward pass whose row i uses adapter handle `adapters[i]`."""
        with self._lora.routed(adapters):
            out = self.model(**inputs, use_cache=True)
        self.on_forward(len(adapters))
        return out

    def _step(self, batch: _Batch | None, admitted: list[_Group]) -> _Batch | None:
        """One iteration: a decode step for every running row, then prefill of admitted groups."""
        if batch is not None:
            batch = self._drop_rows(batch, [i for i, r in enumerate(batch.rows) if r.group.cancelled])
            batch = self._decode_within_memory(batch) if batch.rows else None
        if admitted:
            self._admissions += 1
            for g in admitted:
                g.admitted_at = self._admissions
            try:
                fresh = self._prefill(admitted)
            except Exception as exc:  # the running batch's cache is untouched: it keeps decoding
                if not _out_of_memory(exc):
                    _fail_engine(admitted, exc)
                    return batch
                _fail_out_of_memory(admitted, "its prefill")
                return batch
            batch = fresh if batch is None else _merge(batch, fresh)
        return batch

    def _decode_within_memory(self, batch: _Batch) -> _Batch | None:
        """A decode step; when it runs out of memory, the groups admitted last are ended with
        RESOURCE_EXHAUSTED (they are what grew the batch), the cache is cut back to where it
        was before the step, and the others step again (up to the last group standing)."""
        while True:
            kv_len = batch.mask.shape[1]
            try:
                return self._decode(batch)
            except Exception as exc:
                if not _out_of_memory(exc):
                    raise
                _cut_cache(batch.cache, kv_len)
                newest = max(r.group.admitted_at for r in batch.rows)
                victims = {id(r.group): r.group for r in batch.rows if r.group.admitted_at == newest}
                _fail_out_of_memory(list(victims.values()), "a decode step")
                batch = self._drop_rows(batch, [i for i, r in enumerate(batch.rows) if id(r.group) in victims])
                if not batch.rows:
                    return None

    def _decode(self, batch: _Batch) -> _Batch | None:
        for r in batch.rows:
            if r.group.req.follow:  # the servicer swaps in each newly committed version (read once a step)
                selection = r.group.req.adapter
                r.adapter, r.version = selection.handle, selection.version
        tokens = torch.tensor([[r.last_token] for r in batch.rows], device=self.device)
        ones = torch.ones(len(batch.rows), 1, dtype=batch.mask.dtype, device=self.device)
        mask = torch.cat([batch.mask, ones], 1)
        positions = torch.tensor([[r.position] for r in batch.rows], device=self.device)
        out = self._forward(
            [r.adapter for r in batch.rows],
            input_ids=tokens,
            attention_mask=mask,
            position_ids=positions,
            cache=batch.cache,
        )
        for r in batch.rows:
            r.position += 1
        return self._sample_and_emit(_Batch(batch.rows, out.cache, mask), out.logits[:, -1, :])

    def _prefill(self, groups: list[_Group]) -> _Batch | None:
        from transformers import DynamicCache

        rows = []
        selections = [g.req.adapter for g in groups]  # read once: a following group may switch meanwhile
        for g, sel in zip(groups, selections, strict=True):
            seed = g.req.sampling.seed if g.req.sampling.seed is not None else secrets.randbits(62)
            keep = _STOP_TAIL if g.req.sampling.stop else 0
            for i in range(g.req.n):
                text = TextStream(self._text_backend, keep)
                position = len(g.req.prompt_ids)
                rows.append(_Row(g, i, sample_generator(seed, i), position, sel.handle, sel.version, text))
            g.open_rows = g.req.n
        width = max(len(g.req.prompt_ids) for g in groups)
        ids = torch.full((len(groups), width), self.tokenizer.pad_token_id or 0, dtype=torch.long)
        mask = torch.zeros((len(groups), width), dtype=torch.long)
        for k, g in enumerate(groups):  # one left-padded row per group
            ids[k, width - len(g.req.prompt_ids) :] = torch.tensor(g.req.prompt_ids)
            mask[k, width - len(g.req.prompt_ids) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        out = self._forward(
            [sel.handle for sel in selections],
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            cache=cache,
            logits_to_keep=1,
        )
        # The n samples of a group share its prompt: its KV cache and first logits are computed
        # once and copied n times (a row's values do not depend on the other rows of the pass).
        samples = torch.tensor([g.req.n for g in groups], device=self.device)
        for layer in out.cache.layers:
            layer.keys = layer.keys.repeat_interleave(samples, 0)
            layer.values = layer.values.repeat_interleave(samples, 0)
        logits = out.logits[:, -1, :].repeat_interleave(samples, 0)
        return self._sample_and_emit(_Batch(rows, out.cache, mask.repeat_interleave(samples, 0)), logits)

    def _sample_and_emit(self, batch: _Batch, logits: torch.Tensor) -> _Batch | None:
        """Sample one token for every row at once, emit each group's events, drop finished rows.

        A group whose sampling fails (see the module docstring) is ended with its own status
        and all its rows are dropped; the others are unaffected."""
        rows = batch.rows
        params = [r.group.req.sampling for r in rows]
        uniforms = row_uniforms(params, [r.generator for r in rows])  # drawn once: a retry reuses them
        failed: dict[int, Exception] = {}
        try:
            tokens, chosen, broken, kept_sets = _sample(logits, params, uniforms)
        except Exception:  # find the group to blame: redo the step group by group
            tokens, chosen, broken, kept_sets = self._sample_by_group(rows, logits, params, uniforms, failed)
        for i, where in enumerate(broken):
            if where is not None:
                failed.setdefault(id(rows[i].group), _NonFinite(where))
        outbox: dict[int, tuple[_Group, list]] = {}
        done: list[int] = []
        for i, row in enumerate(rows):
            group = row.group
            if id(group) in failed:
                continue
            try:
                events, finished = self._advance(row, tokens[i], chosen[i], kept_sets[i])
            except Exception as exc:
                failed[id(group)] = exc
                continue
            outbox.setdefault(id(group), (group, []))[1].extend(events)
            if finished:
                done.append(i)
        for i, row in enumerate(rows):
            if id(row.group) in failed:
                done.append(i)
        for key, exc in failed.items():
            group = next(r.group for r in rows if id(r.group) == key)
            outbox[key] = (group, [_row_error(group, exc), _END])
            group.open_rows = 0
            group.cancelled = True  # nothing more is sent to it
        for key, (group, events) in outbox.items():
            if group.open_rows == 0 and key not in failed:
                events.append(_END)
        self._deliver(outbox)
        batch = self._drop_rows(batch, done)
        return batch if batch.rows else None

    def _deliver(self, outbox: dict[int, tuple[_Group, list]]) -> None:
        """Hand one step's events to their event loops' mailboxes."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Group, list]]] = {}
        for group, items in outbox.values():
            by_loop.setdefault(group.loop, []).append((group, items))
        for loop, deliveries in by_loop.items():
            box = self._mailboxes.get(loop)
            if box is None:
                box = self._mailboxes[loop] = _Mailbox(loop)
            if not box.post(deliveries):
                del self._mailboxes[loop]
                for group, _ in deliveries:
                    group.cancelled = True

    def _sample_by_group(
        self, rows: list[_Row], logits: torch.Tensor, params: list, uniforms: torch.Tensor, failed: dict
    ) -> tuple[list[int], list[float], list[str | None], list[bytes]]:
        """The whole-batch sampling raised: sample each group alone (same uniforms, so the
        groups that do not raise get the tokens they would have had), and record the ones
        that raise in `failed`."""
        tokens, chosen = [0] * len(rows), [0.0] * len(rows)
        broken: list[str | None] = [None] * len(rows)
        kept_sets = [b""] * len(rows)
        by_group: dict[int, list[int]] = {}
        for i, r in enumerate(rows):
            by_group.setdefault(id(r.group), []).append(i)
        for key, idxs in by_group.items():
            index = torch.tensor(idxs, device=logits.device)
            try:
                t, c, b, ks = _sample(logits[index], [params[i] for i in idxs], uniforms[idxs])
            except Exception as exc:
                failed[key] = exc
                continue
            for k, i in enumerate(idxs):
                tokens[i], chosen[i], broken[i], kept_sets[i] = t[k], c[k], b[k], ks[k]
        return tokens, chosen, broken, kept_sets

    def _advance(self, row: _Row, token: int, logprob: float, kept_set: bytes = b"") -> tuple[list, bool]:
        """Append one sampled token to a row: its events and whether the sample finished."""
        group = row.group
        row.generated += 1
        row.last_token = token
        events: list = [TokenDelta(row.index, [token], [logprob], row.text.add(token), row.version)]
        if group.req.sampling.return_kept:
            events[0].kept.append(kept_set)
        reason = self._finish_reason(row, token)
        if reason is None:
            return events, False
        events.append(SampleDone(row.index, reason, len(group.req.prompt_ids), row.generated))
        group.open_rows -= 1
        return events, True

    def _finish_reason(self, row: _Row, token: int) -> str | None:
        params = row.group.req.sampling
        if token in self.eos_ids and not params.ignore_eos:
            return "eos"
        if params.stop and any(row.text.tail.endswith(s) for s in params.stop if s):
            return "stop"
        if row.generated >= params.max_new_tokens:
            return "length"
        return None

    def _drop_rows(self, batch: _Batch, drop: list[int]) -> _Batch:
        if not drop:
            return batch
        gone = set(drop)
        keep = [i for i in range(len(batch.rows)) if i not in gone]
        rows = [batch.rows[i] for i in keep]
        if not rows:
            return _Batch([], None, batch.mask[:0])
        index = torch.tensor(keep, device=self.device)
        batch.cache.batch_select_indices(index)
        return _trim(_Batch(rows, batch.cache, batch.mask[index]))


class _NonFinite(Exception):
    """A group's sampling met NaN or +inf; the argument says where."""


def _sample(
    logits: torch.Tensor, params: list[SamplingParams], uniforms: torch.Tensor
) -> tuple[list[int], list[float], list[str | None], list[bytes]]:
    """One token per row: the tokens, their logprobs, per row None or where it met NaN/+inf,
    and each row's kept set (`_kept_sets`).

    Pure (the uniforms are drawn before), so a retry of some of the rows gives them the
    same tokens."""
    logprobs = sampling_logprobs(logits, params)
    bad_distribution = nonfinite_rows(logprobs)
    tokens = inverse_cdf(logprobs, params, uniforms)
    chosen = logprobs.gather(-1, tokens[:, None])[:, 0]
    bad_token = ~torch.isfinite(chosen)
    broken: list[str | None] = [None] * len(tokens)
    if bool(bad_distribution.any()) or bool(bad_token.any()):
        for i, (dist, tok) in enumerate(zip(bad_distribution.tolist(), bad_token.tolist(), strict=True)):
            if dist:
                broken[i] = "the sampling distribution"
            elif tok:
                broken[i] = "the sampled token's logprob"
    return tokens.tolist(), chosen.tolist(), broken, _kept_sets(logprobs, params)


def _kept_sets(logprobs: torch.Tensor, params: list[SamplingParams]) -> list[bytes]:
    """Per row that asked for it (return_kept) and was truncated (top-k or top-p, not greedy):
    the ids its distribution kept (finite logprobs), encoded; b"" otherwise (the whole vocabulary)."""
    out = [b""] * len(params)
    for i, p in enumerate(params):
        if p.return_kept and p.temperature > 0 and (p.top_k or p.top_p < 1.0):
            out[i] = kept.encode(torch.isfinite(logprobs[i]).nonzero()[:, 0].tolist())
    return out


def _row_error(group: _Group, exc: Exception):
    """The status that ends one group whose sampling failed (see the module docstring)."""
    rid = group.req.request_id
    if isinstance(exc, _NonFinite):
        log.warning("group_non_finite", request_id=rid, where=str(exc))
        return FailedPrecondition(
            f"the model produced NaN or infinite values in {exc} of this request (adapter "
            f"{group.req.adapter.name or 'base'} v{group.req.adapter.version}); nothing can be sampled from "
            "them. Check the adapter's weights (a diverged run produces them) or sample from another version",
            reason=Reason.NON_FINITE_LOGITS,
        )
    log.exception("group_sampling_failed", request_id=rid, exc_info=exc)
    return Internal(
        f"sampling this request failed on this replica ({_clip_exc(exc)}); the other requests were not "
        "affected. Report it with the request id",
        reason=Reason.ROW_FAILED,
    )


def _kv_tokens(req: GroupRequest) -> int:
    """The KV-cache tokens a group may come to hold: n x (prompt + max_new_tokens)."""
    return req.n * (len(req.prompt_ids) + req.sampling.max_new_tokens)


def _out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, (torch.OutOfMemoryError, MemoryError))


def _cut_cache(cache: Any, kv_len: int) -> None:
    """Undo a step that failed part-way: every layer's keys and values back to `kv_len`
    tokens (layers the step reached had appended its token, the others had not)."""
    for layer in cache.layers:
        if getattr(layer, "keys", None) is not None and layer.keys.shape[-2] > kv_len:
            layer.keys = layer.keys[..., :kv_len, :]
            layer.values = layer.values[..., :kv_len, :]


def _fail_out_of_memory(groups: list[_Group], where: str) -> None:
    """Groups ended because memory ran out in `where`: RESOURCE_EXHAUSTED with a retry hint,
    the replica's load, never its fault (faults.py: the proxy retries it elsewhere)."""
    log.warning("engine_out_of_memory", where=where, groups=len(groups))
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    for g in groups:
        g.send(
            [
                ResourceExhausted(
                    f"this replica ran out of memory in {where} of this request ({g.req.n} samples, "
                    f"{len(g.req.prompt_ids)} prompt tokens, up to {g.req.sampling.max_new_tokens} new); retry, or ask "
                    "for fewer samples or tokens",
                    reason=Reason.ENGINE_OOM,
                    retry_after_s=1.0,
                ),
                _END,
            ]
        )


def _fail_engine(groups: list[_Group], exc: Exception) -> None:
    """A forward pass failed (no row to blame): end every group in it, a replica fault."""
    log.exception("engine_step_failed", groups=len(groups), exc_info=exc)
    for g in groups:
        g.send(
            [
                Internal(
                    f"generation failed on this replica ({_clip_exc(exc)}); retry on another replica",
                    reason=Reason.ENGINE_FAILED,
                ),
                _END,
            ]
        )


def _clip_exc(exc: Exception) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= _MAX_ERROR_CHARS else text[:_MAX_ERROR_CHARS] + "..."


def _merge(a: _Batch, b: _Batch | None) -> _Batch:
    """Concatenate two batches, left-padding the shorter KV cache with masked zeros."""
    if b is None or not b.rows:
        return a
    if not a.rows:
        return b
    width = max(a.mask.shape[1], b.mask.shape[1])
    for la, lb in zip(a.cache.layers, b.cache.layers, strict=False):
        la.keys = torch.cat([_pad_left(la.keys, width), _pad_left(lb.keys, width)], 0)
        la.values = torch.cat([_pad_left(la.values, width), _pad_left(lb.values, width)], 0)
    mask = torch.cat([_pad_left(a.mask, width), _pad_left(b.mask, width)], 0)
    return _Batch(a.rows + b.rows, a.cache, mask)


def _pad_left(t: torch.Tensor, width: int) -> torch.Tensor:
    """Pad the sequence axis (dim -2 for KV [B,H,T,D], dim -1 for masks [B,T]) on the left."""
    axis = -1 if t.dim() == 2 else -2
    missing = width - t.shape[axis]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[axis] = missing
    return torch.cat([torch.zeros(shape, dtype=t.dtype, device=t.device), t], axis)


def _trim(batch: _Batch) -> _Batch:
    """Cut KV columns that are padding for every remaining row."""
    real = batch.mask.any(0).nonzero()
    start = int(real[0]) if len(real) else 0
    if start == 0:
        return batch
    for layer in batch.cache.layers:
        layer.keys = layer.keys[:, :, start:]
        layer.values = layer.values[:, :, start:]
    return _Batch(batch.rows, batch.cache, batch.mask[:, start:])


def _eos_ids(config, tokenizer) -> set[int]:
    ids = config.eos_token_id if config.eos_token_id is not None else tokenizer.eos_token_id
    return set(ids if isinstance(ids, list) else [ids]) - {None}
