"""The embedded engine: a Hugging Face causal LM with PEFT LoRA adapters, on CPU or GPU.

One worker thread owns the model. It runs a continuous-batching loop: each iteration it
applies adapter loads/unloads, admits waiting groups (one prefill for all of them, one
row per group, whose KV cache and first logits are then copied for each of its samples,
left-padded and merged into the running batch), then runs one decode step for every
running row. Rows of different groups, different sampling params and different
adapters share every forward pass (each row its own LoRA, all adapters' deltas in one
batched apply: lora.py). Finished and cancelled rows leave the batch at once.

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
pass itself (a device error), which no row can be blamed for, ends the groups in that pass
with INTERNAL, reason ENGINE_FAILED: that one is a replica fault. A failed prefill ends only
the groups being admitted; the running batch keeps decoding.

Memory is load, never a fault: admission by KV-token budget (kv_memory.py) and what ends
when memory still runs out (transformers_memory.py). A Score runs on the same thread, one forward
pass between two iterations (transformers_score.py).

Prefix KV reuse (prefix_cache.py): before a prefill, each group looks up the longest prefix
of its prompt whose keys and values were computed recently under the same adapter version;
the prefill then computes only the rest (kv_batch.prefill_inputs seeds the prefixes into its
cache). The engine stores every prefilled prompt's KV, and a finished one-sample group's
prompt plus tokens but the last (the next turn of an episode extends them). A row that
switched versions mid-sample (follow) is never stored: its KV mixes versions. Sampling is
untouched by reuse (the same uniforms per row), so tokens and logprobs equal those of a full
prefill up to float rounding of the attention sums.

Modules: transformers_groups.py (groups, the mailbox, failure statuses), kv_batch.py (the
batch's KV cache surgery), prefix_cache.py.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rollwire.common.errors import FailedPrecondition, Unavailable
from rollwire.common.manifest import Manifest
from rollwire.generator.detokenize import backend
from rollwire.generator.engines.base import EngineStats
from rollwire.generator.engines.embedded import kv_batch, kv_memory
from rollwire.generator.engines.embedded.kv_batch import Batch
from rollwire.generator.engines.embedded.lora import LoraSet
from rollwire.generator.engines.embedded.prefix_cache import AdapterKey, PrefixCache, PrefixCacheSettings
from rollwire.generator.engines.embedded.routing import RoutingRules, RoutingTap
from rollwire.generator.engines.embedded.transformers_groups import END as _END
from rollwire.generator.engines.embedded.transformers_groups import Group as _Group
from rollwire.generator.engines.embedded.transformers_groups import Mailbox as _Mailbox
from rollwire.generator.engines.embedded.transformers_groups import (
    NonFinite,
    check_fits,
    deliver,
    eos_ids,
    fail_engine,
    group_seeds,
    kv_tokens,
    new_rows,
    prefill_units,
    row_error,
)
from rollwire.generator.engines.embedded.transformers_groups import Row as _Row
from rollwire.generator.engines.embedded.transformers_memory import MemoryRules
from rollwire.generator.engines.embedded.transformers_prefix import PrefixRules
from rollwire.generator.engines.embedded.transformers_sampling import sample, sample_by_group
from rollwire.generator.engines.embedded.transformers_score import ScoreRules, ScoreRun
from rollwire.generator.sampling import row_uniforms
from rollwire.generator.types import Event, GroupRequest, SampleDone, TokenDelta
from rollwire.push.buffers import Payload, as_bytes
from rollwire.runtime.logs import get_logger

if TYPE_CHECKING:
    from rollwire.generator.metrics import GeneratorMetrics

log = get_logger(__name__)
__all__ = ["TransformersEngine", "_Mailbox"]


class TransformersEngine(MemoryRules, ScoreRules, RoutingRules, PrefixRules):
    """Engine over transformers, LoRA adapters by forward hooks (lora.py); see the module
    docstring for the batching loop."""

    name = "transformers"
    returns_kept_tokens = True
    """Reports each token's kept set when a request asks (SamplingParams.return_kept)."""
    follows_versions = True
    """Switches a following group's rows to its new selection at their next decode step (GroupRequest.follow)."""
    resumes_samples = True
    """Continues samples from their tokens so far, exactly (GroupRequest.resume; transformers_groups.new_rows)."""
    _lora: LoraSet  # set by _load, with the model

    def __init__(
        self,
        model_dir: str | Path,
        *,
        max_batch_rows: int = 64,
        max_batch_tokens: int | None = None,
        kv_memory_fraction: float = 0.5,
        threads: int = 0,
        device: str = "cpu",
        on_forward: Callable[[int], None] = lambda rows: None,
        prefix_cache: PrefixCacheSettings | None = None,
        metrics: GeneratorMetrics | None = None,
        score_batch_tokens: int = 4096,
    ):
        self.model_dir = Path(model_dir)
        self.on_forward = on_forward
        self.max_batch_rows, self.score_batch_tokens = max_batch_rows, score_batch_tokens
        self.configured_tokens = max_batch_tokens  # None: derived from free memory at start (kv_memory.py)
        self.kv_memory_fraction = kv_memory_fraction
        self.max_batch_tokens = max_batch_tokens or 0  # the budget in force, set by _load
        self.kv_budget: kv_memory.KvBudget | None = None
        self.threads = threads
        self.device = torch.device(device)
        self.metrics = metrics
        self.prefix_cache = PrefixCache(prefix_cache or PrefixCacheSettings(), metrics)
        self._cv = threading.Condition()
        self._pending: deque[_Group] = deque()
        self._scores: deque[ScoreRun] = deque()  # Score requests, one pass per iteration (transformers_score.py)
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
        free = None if self.configured_tokens else kv_memory.free_memory(self.device)  # before the weights
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        model: Any = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)  # stubs lack .to()
        self.model = model.to(self.device).eval()
        self.vocab_size = int(self.model.config.vocab_size)
        self.max_context = int(getattr(self.model.config, "max_position_embeddings", 0) or 1 << 30)
        self.eos_ids = eos_ids(self.model.config, self.tokenizer)
        self._text_backend = backend(self.tokenizer)
        self._lora = LoraSet(self.model)
        self._routing = RoutingTap(self.model)
        if self.prefix_cache.enabled and not kv_batch.plain_layers(self.model.config):
            log.warning("prefix_cache_off", why="this model's cache has sliding-window or recurrent layers")
            self.prefix_cache = PrefixCache(PrefixCacheSettings(max_tokens=0), self.metrics)
        self.kv_budget = kv_memory.budget(
            self.model,
            self.device,
            self.configured_tokens,
            self.kv_memory_fraction,
            free,
            self.prefix_cache.settings.max_tokens,
        )
        self.max_batch_tokens = self.kv_budget.tokens
        if self.metrics is not None:
            self.metrics.kv_budget_tokens.set(self.max_batch_tokens)
        log.info(
            "engine_loaded",
            engine=self.name,
            model=str(self.model_dir),
            vocab=self.vocab_size,
            prefix_cache_tokens=self.prefix_cache.settings.max_tokens,
        )

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

    def check(self, group: GroupRequest) -> None:
        check_fits(group, self.max_batch_rows, self.max_batch_tokens)
        if group.routed_experts:
            self._check_routed(group)

    async def generate(self, group: GroupRequest) -> AsyncIterator[list[Event]]:
        self.check(group)
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

    async def load_adapter(self, handle: str, manifest: Manifest, payload: Payload) -> None:
        from safetensors.torch import load as load_safetensors

        tensors = await asyncio.to_thread(lambda: load_safetensors(as_bytes(payload)))
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
        batch: Batch | None = None
        with torch.inference_mode():
            while True:
                with self._cv:
                    while not (self._stop or self._ops or self._pending or self._scores or batch is not None):
                        self._cv.wait()
                    if self._stop:
                        break
                    ops, self._ops = self._ops, []
                    admitted = self._take_pending(batch)
                self._apply_ops(ops)
                self._score_step()
                try:
                    batch = self._step(batch, admitted)
                except Exception as exc:  # a bug or OOM must fail the requests, not hang them
                    groups = {id(r.group): r.group for r in (batch.rows if batch else [])}
                    groups.update({id(g): g for g in admitted})
                    batch = None  # its memory goes with it
                    fail_engine(list(groups.values()), exc)
                running = {id(r.group): r.group for r in batch.rows} if batch else {}
                with self._cv:
                    self._running_groups = len(running)
                if self.metrics is not None:
                    self.metrics.kv_reserved_tokens.set(sum(kv_tokens(g.req) for g in running.values()))
        self._fail_all("the generator is shutting down; retry on another replica")

    def _take_pending(self, batch: Batch | None) -> list[_Group]:
        """Waiting groups, in order, while their rows and their KV-token reservations fit
        beside the running ones (a group's reservation lasts while any of its rows runs)."""
        running = {id(r.group): r.group for r in batch.rows} if batch else {}
        used_rows = len(batch.rows) if batch else 0
        used_tokens = sum(kv_tokens(g.req) for g in running.values())
        admitted = []
        while self._pending:
            g = self._pending[0]
            if g.cancelled:
                self._pending.popleft()
                continue
            if used_rows + g.req.rows > self.max_batch_rows or used_tokens + kv_tokens(g.req) > self.max_batch_tokens:
                break
            admitted.append(self._pending.popleft())
            used_rows, used_tokens = used_rows + g.req.rows, used_tokens + kv_tokens(g.req)
        return admitted

    def _fail_all(self, message: str) -> None:
        with self._cv:
            pending, self._pending = list(self._pending), deque()
        self._fail_scores(message)
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
                    self.prefix_cache.drop_handle(op[1])  # its KV cannot be reused by anything else
                fut.set_result(None)
            except Exception as exc:
                fut.set_exception(exc)

    def _forward(self, adapters: list[str | None], *, routed: bool = False, **inputs):
        """One forward pass whose row i uses adapter handle `adapters[i]`; with `routed` the MoE
        layers' routing of every position it computes is kept in `self._recorded` (routing.py)."""
        assert self._routing is not None
        wanted = routed and self._routing.available
        with self._lora.routed(adapters), self._routing.recording(wanted) as rec:
            out = self.model(**inputs, use_cache=True)
        self.on_forward(len(adapters))
        self._recorded = rec
        return out

    def _step(self, batch: Batch | None, admitted: list[_Group]) -> Batch | None:
        """One iteration: a decode step for every running row, then prefill of admitted groups."""
        if batch is not None:
            batch = self._drop_rows(batch, [i for i, r in enumerate(batch.rows) if r.group.cancelled])
            batch = self._decode_within_memory(batch) if batch.rows else None
        if admitted:
            self._admissions += 1
            for g in admitted:
                g.admitted_at = self._admissions
            batch = self._admit_within_memory(batch, admitted)
        return batch

    def _decode(self, batch: Batch) -> Batch | None:
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
            routed=any(r.routes is not None for r in batch.rows),
            input_ids=tokens,
            attention_mask=mask,
            position_ids=positions,
            cache=batch.cache,
        )
        routes = self._recorded.take(len(batch.rows), 1)
        for i, r in enumerate(batch.rows):
            r.position += 1
            if routes is not None and r.routes is not None:
                r.routes.append(routes[i])  # the position just fed: the row's last token
        return self._sample_and_emit(Batch(batch.rows, out.cache, mask), out.logits[:, -1, :])

    def _prefill(self, groups: list[_Group]) -> tuple[Batch, torch.Tensor]:
        """One forward pass for the admitted groups (one row each, its prefix reused from the
        prefix cache when one is held), then each group's row copied for its n samples: the
        batch of their rows and its logits, to sample their first tokens from. A resumed
        group (GroupRequest.resume) has one row per sample it continues instead, whose prompt
        is the group's followed by the sample's tokens so far (transformers_groups.prefill_units,
        new_rows: such a sample goes on exactly as unsplit). Sends nothing, so it can be redone."""
        units = prefill_units(groups)  # each group's selection read once: a following group may switch meanwhile
        keys: list[AdapterKey] = [u[1] for u in units]
        prompts = [u[2] for u in units]
        routed = [u[0].req.routed_experts for u in units]
        # a group asking for its routing computes its whole prompt: reused KV has no routing
        hits = [None if r else self.prefix_cache.lookup(k, p) for k, p, r in zip(keys, prompts, routed, strict=True)]
        pad = self.tokenizer.pad_token_id or 0
        inputs = kv_batch.prefill_inputs(
            prompts, [h.layers() if h else None for h in hits], pad, self.model.config, self.device
        )
        out = self._forward(
            [k[2] for k in keys],
            routed=any(routed),
            input_ids=inputs.ids,
            attention_mask=inputs.mask,
            position_ids=inputs.positions,
            cache=inputs.cache,
            logits_to_keep=1,
        )
        if self.metrics is not None:
            self.metrics.prefill_tokens.inc(inputs.computed)
        for k, (key, prompt) in enumerate(zip(keys, prompts, strict=True)):
            self._remember(key, prompt, out.cache, inputs.mask, k)
        seeds = {id(g): group_seeds(g) for g in groups}
        rows = [r for g, key, _, indices in units for r in new_rows(g, key, indices, seeds[id(g)], self._text_backend)]
        if any(routed):
            self._route_prompts(units, rows, inputs.ids.shape[1])
        for g in groups:
            g.open_rows = g.req.rows
        # The n samples of a group share its prompt: its KV cache and first logits are computed
        # once and copied n times (a row's values do not depend on the other rows of the pass).
        samples = torch.tensor([len(u[3]) for u in units], device=self.device)
        batch = kv_batch.repeat_rows(Batch(rows, out.cache, inputs.mask), samples)
        return batch, out.logits[:, -1, :].repeat_interleave(samples, 0)

    def _sample_and_emit(self, batch: Batch, logits: torch.Tensor) -> Batch | None:
        """Sample one token for every row at once, emit each group's events, drop finished rows.

        A group whose sampling fails (see the module docstring) is ended with its own status
        and all its rows are dropped; the others are unaffected."""
        rows = batch.rows
        params = [r.group.req.sampling for r in rows]
        uniforms = row_uniforms(params, [r.generator for r in rows])  # drawn once: a retry reuses them
        failed: dict[int, Exception] = {}
        try:
            tokens, chosen, broken, kept_sets = sample(logits, params, uniforms)
        except Exception:  # find the group to blame: redo the step group by group
            tokens, chosen, broken, kept_sets = sample_by_group(rows, logits, params, uniforms, failed)
        for i, where in enumerate(broken):
            if where is not None:
                failed.setdefault(id(rows[i].group), NonFinite(where))
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
            outbox[key] = (group, [row_error(group, exc), _END])
            group.open_rows = 0
            group.cancelled = True  # nothing more is sent to it
        for key, (group, events) in outbox.items():
            if group.open_rows == 0 and key not in failed:
                events.append(_END)
        deliver(self._mailboxes, outbox)
        self._remember_finished(batch, [i for i in done if id(rows[i].group) not in failed])
        batch = self._drop_rows(batch, done)
        return batch if batch.rows else None

    def _advance(self, row: _Row, token: int, logprob: float, kept_set: bytes = b"") -> tuple[list, bool]:
        """Append one sampled token to a row: its events and whether the sample finished."""
        group = row.group
        row.generated += 1
        row.last_token = token
        row.tokens.append(token)
        delta = TokenDelta(row.index, [token], [logprob], row.text.add(token), row.version)
        events: list = [delta]
        if group.req.sampling.return_kept:
            delta.kept.append(kept_set)
        reason = self._finish_reason(row, token, delta.text)
        if reason is None:
            return events, False
        delta.text += row.text.finish()  # the sample's text is now its tokens' whole decode
        events.append(SampleDone(row.index, reason, len(group.req.prompt_ids), row.generated, self._routes(row)))
        group.open_rows -= 1
        return events, True

    def _finish_reason(self, row: _Row, token: int, delta: str) -> str | None:
        params = row.group.req.sampling
        if token in self.eos_ids and not params.ignore_eos:
            return "eos"
        if params.stop and row.text.found(params.stop, delta):
            return "stop"
        if row.generated >= params.max_new_tokens:
            return "length"
        return None

    def _drop_rows(self, batch: Batch, drop: list[int]) -> Batch:
        if not drop:
            return batch
        gone = set(drop)
        return kv_batch.select_rows(batch, [i for i in range(len(batch.rows)) if i not in gone], self.device)
