"""A PROTOCOL-LEVEL DOUBLE of SGLang's native HTTP API (SGLang 0.5.23), for tests only.

It is not SGLang and shares no code with rollwire: it answers the routes rollwire uses the
way SGLang 0.5.23 answers them (python/sglang/srt/entrypoints/http_server.py and
managers/tokenizer_manager.py), backed by the tiny model through transformers + PEFT, so
the logprobs it streams are real numbers a test can check against a teacher-forced pass.

What it reproduces, because rollwire depends on it:
- POST /generate prefill-only (`max_new_tokens: 0`, `stream: false`, how rollwire scores): one JSON
  reply whose `meta_info.input_token_logprobs` holds [logprob, token_id, null] for each position
  from `logprob_start_len` on, the first with a null logprob (SGLang's alignment, read in its
  schedule_batch.py and scheduler_output_processor_mixin.py), computed from a real forward of
  the tiny model under the named LoRA; other unstreamed requests are refused;
- POST /generate with `stream: true`: `data: {...}` chunks then `data: [DONE]`; cumulative
  `output_ids`, `text` and `meta_info.output_token_logprobs` ([logprob, token_id, null])
  by default, deltas with --incremental-streaming-output; `index` on batch and `n` outputs;
  `n` expands to samples with server-made request ids; errors raised while streaming come
  as a `data: {"error": {...}}` chunk; unknown body fields are refused with HTTP 400;
- SGLang's logprob: log softmax(logits / T) of the untruncated distribution (top-k/top-p
  only restrict what is sampled); greedy (T=0) is top_k=1 with log_softmax(logits);
- `sampling_seed` is honoured only with --enable-deterministic-inference, and the same seed
  gives the same sample (SGLang hashes seed and position);
- /load_lora_adapter and /unload_lora_adapter over PEFT folders with SGLang's checks and
  messages (LoRA disabled, name already loaded, rank above --max-lora-rank, LRU eviction
  above --max-loaded-loras), unload waiting for requests that use the adapter;
- /health, /health_generate, /model_info, /server_info, /abort_request, and SGLang's
  --api-key / --admin-api-key rules (401 {"error": "Unauthorized"}).

For tests it records every request, can inject an error reply or cut a stream, can compute with
other weights than the files it loads (`lora_b_scale`: a server that serves another policy than
the published one, which a version's proof must catch), and can die:
in a thread (`DoubleServer.die`, connections reset) or as a process (`POST /_double/die`,
exit code 17). Run as a process it takes SGLang's launch flags:
    python tests/sglang_double.py --model-path DIR --port P --enable-lora ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

VERSION = "0.5.23"
GENERATE_FIELDS = {
    "text",
    "input_ids",
    "sampling_params",
    "rid",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "stream",
    "lora_path",
    "return_text_in_logprobs",
    "log_metrics",
    "custom_labels",
    "priority",
    "extra_key",
}
SAMPLING_FIELDS = {
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "no_stop_trim",
    "n",
    "sampling_seed",
    "spaces_between_special_tokens",
    "min_new_tokens",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
}
ADMIN_ROUTES = {"/load_lora_adapter", "/unload_lora_adapter", "/abort_request"}


@dataclass
class Options:
    """The subset of SGLang's server arguments the double understands."""

    model_path: str
    host: str = "127.0.0.1"
    port: int = 0
    enable_lora: bool = False
    max_lora_rank: int | None = None
    lora_target_modules: list[str] = field(default_factory=list)
    max_loras_per_batch: int = 8
    max_loaded_loras: int | None = None
    enable_deterministic_inference: bool = False
    incremental_streaming_output: bool = False
    random_seed: int | None = None
    api_key: str | None = None
    admin_api_key: str | None = None


@dataclass
class Call:
    """One HTTP request the double received."""

    method: str
    path: str
    headers: dict
    body: object


class GenerateError(ValueError):
    """SGLang raises ValueError inside a stream; it becomes an error chunk."""


# -- the model -----------------------------------------------------------------------------
class DoubleModel:
    """The tiny model with PEFT adapters; one forward at a time (PEFT's active adapter is global)."""

    def __init__(self, model_dir: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        eos = self.base.config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        self.vocab_size = int(self.base.config.vocab_size)
        self.peft = None
        self.lock = threading.Lock()

    def load(self, name: str, folder: str, b_scale: float = 1.0) -> None:
        """Load a PEFT folder; `b_scale` != 1 multiplies its B matrices (a server computing with other weights)."""
        from peft import PeftModel

        name = _peft_name(name)
        with self.lock:
            if self.peft is None:
                self.peft = PeftModel.from_pretrained(self.base, folder, adapter_name=name).eval()
            else:
                self.peft.load_adapter(folder, adapter_name=name)
                self.peft.eval()
            if b_scale != 1.0:
                with self.torch.no_grad():
                    for key, param in self.peft.named_parameters():
                        if f".lora_B.{name}." in key:
                            param.mul_(b_scale)

    def unload(self, name: str) -> None:
        name = _peft_name(name)
        with self.lock:
            if self.peft is not None and len(self.peft.peft_config) > 1:
                self.peft.delete_adapter(name)  # PEFT cannot drop its last adapter; it then stays unused

    def last_logits(self, rows: list[list[int]], lora: str | None):
        """Logits of the next token for rows of equal length: a full forward, no cache."""
        return self._logits(rows, lora)[:, -1, :]

    def input_logprobs(self, ids: list[int], lora: str | None, temperature: float = 1.0) -> list[float]:
        """Entry p (p >= 1): the logprob of ids[p] given ids[:p], log softmax(logits / T) as SGLang's
        input logprobs are (T = 1 for a Score); entry 0 has none and is left out."""
        torch = self.torch
        lsm = torch.log_softmax(self._logits([ids], lora)[0, :-1] / temperature, -1)
        return lsm.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()

    def _logits(self, rows: list[list[int]], lora: str | None):
        torch = self.torch
        with self.lock, torch.no_grad():
            ids = torch.tensor(rows)
            if self.peft is None:
                return self.base(input_ids=ids).logits.float()
            if lora is None:
                with self.peft.disable_adapter():
                    return self.peft(input_ids=ids).logits.float()
            self.peft.set_adapter(_peft_name(lora))
            return self.peft(input_ids=ids).logits.float()


def _peft_name(name: str) -> str:
    """PEFT refuses '.' in adapter names; SGLang does not, so the double maps them."""
    return name.replace(".", "__dot__")


@dataclass
class Row:
    """One sample being generated."""

    rid: str
    index: int
    prompt: list[int]
    params: dict
    generator: object
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    sent: int = 0
    finish: dict | None = None


# -- the server ----------------------------------------------------------------------------
class DoubleServer:
    """The HTTP double; start it in a thread (`start`) or run it as a process (`main`)."""

    def __init__(self, options: Options, model: DoubleModel | None = None) -> None:
        self.o = options
        self.model = model
        self.calls: list[Call] = []
        self.loras: OrderedDict[str, dict] = OrderedDict()  # name -> {"path", "r", "uses"}
        self.evicted: list[str] = []
        self.aborted: set[str] = set()
        self.injected: dict[str, list[tuple[int, object]]] = {}
        self.cut_after_tokens: int | None = None
        self.lora_b_scale = 1.0
        """Test only: loads multiply the adapter's B matrices by this, as a server that loaded another file would."""
        self.hold_at_tokens: int | None = None
        """Once a row of a request has this many tokens, that request waits for `release` (once)."""
        self.release = threading.Event()
        self.active_rows = 0
        self.idle = threading.Event()
        self.idle.set()
        self.port = options.port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._unloaded = None  # asyncio.Condition, made on the loop
        self._thread: threading.Thread | None = None

    # -- running -----------------------------------------------------------------------
    def start(self) -> DoubleServer:
        """Serve from a background thread; returns once listening."""
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run_thread, args=(ready,), daemon=True, name="sglang-double")
        self._thread.start()
        if not ready.wait(30):
            raise RuntimeError("the SGLang double did not start")
        return self

    def _run_thread(self, ready: threading.Event) -> None:
        asyncio.run(self._serve(ready))

    async def _serve(self, ready: threading.Event | asyncio.Event | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._unloaded = asyncio.Condition()
        self._server = await asyncio.start_server(self._handle, self.o.host, self.o.port)
        self.port = self._server.sockets[0].getsockname()[1]
        if ready is not None:
            ready.set()
        async with self._server:
            try:
                await self._server.serve_forever()
            except asyncio.CancelledError:
                pass

    @property
    def url(self) -> str:
        return f"http://{self.o.host}:{self.port}"

    def die(self) -> None:
        """Stop listening and reset every open connection, as a crashed server would."""
        fut = asyncio.run_coroutine_threadsafe(self._die(), self._loop)
        fut.result(10)

    async def _die(self) -> None:
        self._server.close()
        for w in list(self._writers):
            w.transport.abort()
        self._writers.clear()

    def stop(self) -> None:
        if self._loop is not None and self._server is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._server.close)
            for w in list(self._writers):
                self._loop.call_soon_threadsafe(w.transport.abort)
        if self._thread is not None:
            self._thread.join(10)

    def inject(self, path: str, status: int, body: object, times: int = 1) -> None:
        """The next `times` requests to `path` get this reply instead of being served."""
        self.injected.setdefault(path, []).extend([(status, body)] * times)

    def generate_calls(self) -> list[dict]:
        return [c.body for c in self.calls if c.path == "/generate"]

    # -- HTTP ----------------------------------------------------------------------------
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            method, path, headers, body = await _read_request(reader)
            self.calls.append(Call(method, path, headers, body))
            await self._route(method, path, headers, body, writer)
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _route(self, method, path, headers, body, writer) -> None:
        if not self._authorized(path, headers.get("authorization")):
            return await _reply(writer, 401, {"error": "Unauthorized"})
        if self.injected.get(path):
            status, reply = self.injected[path].pop(0)
            return await _reply(writer, status, reply)
        if path == "/_double/die":
            os._exit(17)
        if path in ("/health", "/ready") or path == "/health_generate":
            return await _reply(writer, 200 if self.model is not None else 503, None)
        if self.model is None:
            return await _reply(writer, 503, {"error": {"message": "The server is starting"}})
        handler = {
            "/generate": self._generate,
            "/load_lora_adapter": self._load_lora,
            "/unload_lora_adapter": self._unload_lora,
            "/abort_request": self._abort,
            "/model_info": self._model_info,
            "/server_info": self._server_info,
            "/_double/state": self._state,
        }.get(path)
        if handler is None:
            return await _reply(writer, 404, {"detail": "Not Found"})
        await handler(body or {}, writer)

    def _authorized(self, path: str, header: str | None) -> bool:
        if path.startswith(("/health", "/ready", "/metrics", "/_double")):
            return True
        key = (self.o.admin_api_key or self.o.api_key) if path in ADMIN_ROUTES else self.o.api_key
        return key is None or header == f"Bearer {key}"

    async def _model_info(self, body, writer) -> None:
        await _reply(writer, 200, {"model_path": self.o.model_path, "is_generation": True, "weight_version": "default"})

    async def _server_info(self, body, writer) -> None:
        info = {
            "version": VERSION,
            "model_path": self.o.model_path,
            "enable_lora": self.o.enable_lora,
            "max_lora_rank": self.o.max_lora_rank,
            "max_loaded_loras": self.o.max_loaded_loras,
            "max_loras_per_batch": self.o.max_loras_per_batch,
            "enable_deterministic_inference": self.o.enable_deterministic_inference,
            "incremental_streaming_output": self.o.incremental_streaming_output,
        }
        await _reply(writer, 200, info)

    async def _state(self, body, writer) -> None:
        await _reply(
            writer,
            200,
            {
                "active_rows": self.active_rows,
                "loras": list(self.loras),
                "evicted": self.evicted,
                "calls": [[c.method, c.path, c.body] for c in self.calls],
            },
        )

    async def _abort(self, body, writer) -> None:
        self.aborted.add(body.get("rid", ""))
        await _reply(writer, 200, None)

    # -- LoRA ----------------------------------------------------------------------------
    async def _load_lora(self, body, writer) -> None:
        try:
            result = await self._do_load(body["lora_name"], body["lora_path"])
        except (ValueError, KeyError, OSError) as exc:
            return await _reply(writer, 400, {"success": False, "error_message": str(exc), "loaded_adapters": None})
        await _reply(writer, 200, result)

    async def _do_load(self, name: str, path: str) -> dict:
        if not self.o.enable_lora:
            raise ValueError("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        if name in self.loras:
            raise ValueError(f"Failed to load LoRA adapter {name} because it is already loaded")
        config = json.loads((Path(path) / "adapter_config.json").read_text())
        targets = set(self.o.lora_target_modules) - {"all"}
        if (self.o.max_lora_rank and config["r"] > self.o.max_lora_rank) or (
            targets and not set(config["target_modules"]) <= targets
        ):
            raise ValueError(
                f"LoRA adapter {name} with rank {config['r']} is incompatible with the current LoRA memory pool "
                "configuration. Please ensure that the LoRA adapter's rank is within the configured `--max-lora-rank` "
                "and that the target modules are included in `--lora-target-modules`."
            )
        await asyncio.to_thread(self.model.load, name, path, self.lora_b_scale)
        self.loras[name] = {"path": path, "uses": 0}
        while self.o.max_loaded_loras is not None and len(self.loras) > self.o.max_loaded_loras:
            victim = next(iter(self.loras))  # SGLang unloads the least recently used adapter
            self.evicted.append(victim)
            await self._do_unload(victim)
        return {
            "success": True,
            "error_message": None,
            "loaded_adapters": {n: v["path"] for n, v in self.loras.items()},
        }

    async def _unload_lora(self, body, writer) -> None:
        name = body.get("lora_name", "")
        if name not in self.loras:
            return await _reply(
                writer,
                400,
                {
                    "success": False,
                    "error_message": f"LoRA with name {name} does not exist. Loaded LoRAs: {list(self.loras)}",
                },
            )
        await self._do_unload(name)
        await _reply(
            writer,
            200,
            {"success": True, "error_message": None, "loaded_adapters": {n: v["path"] for n, v in self.loras.items()}},
        )

    async def _do_unload(self, name: str) -> None:
        entry = self.loras.pop(name)
        async with self._unloaded:  # SGLang unloads only after the requests using it finish
            await self._unloaded.wait_for(lambda: entry["uses"] == 0)
        await asyncio.to_thread(self.model.unload, name)

    # -- generation ----------------------------------------------------------------------
    async def _generate(self, body, writer) -> None:
        unknown = set(body) - GENERATE_FIELDS
        if unknown:
            return await _reply(writer, 400, {"error": f"unknown field(s) in /generate body: {sorted(unknown)}"})
        if not body.get("stream"):
            return await self._prefill_only(body, writer)
        await _start_stream(writer)
        rows: list[Row] = []
        loras: list[dict] = []
        try:
            rows, lora_names = self._rows(body)
            for name in set(lora_names) - {None}:
                if name not in self.loras:
                    raise GenerateError(
                        f"The following requested LoRA adapters are not loaded: {name}\nLoaded adapters: {list(self.loras)}"
                    )
            loras = [self.loras[n] for n in set(lora_names) - {None}]
            for entry in loras:
                entry["uses"] += 1
                self.loras.move_to_end(next(k for k, v in self.loras.items() if v is entry))
            await self._run(rows, lora_names, writer)
        except GenerateError as exc:
            await _chunk(
                writer,
                {"error": {"message": str(exc), "type": "invalid_request_error", "code": 400, "retryable": False}},
            )
        except (ConnectionError, RuntimeError):
            return  # the client went away; SGLang aborts the request
        finally:
            for entry in loras:
                entry["uses"] -= 1
            async with self._unloaded:
                self._unloaded.notify_all()
        await _chunk(writer, "[DONE]")
        await _end_stream(writer)

    async def _prefill_only(self, body, writer) -> None:
        """A request answered whole: only prefill-only ones (max_new_tokens 0, how rollwire scores), one
        sequence each, with SGLang's input logprobs from `logprob_start_len` s on: one [logprob, id, null]
        per position from s, the entry at s carrying none (SGLang reports a token's logprob given the ones
        before it and starts computing at s)."""
        ids, params = body.get("input_ids"), body.get("sampling_params") or {}
        try:
            if not ids or not isinstance(ids, list) or isinstance(ids[0], list):
                raise GenerateError("the double answers one token-id sequence per whole (unstreamed) request")
            if not isinstance(params, dict) or params.get("max_new_tokens") != 0:
                raise GenerateError("the double streams generation; only a prefill-only request is answered whole")
            self._check_params(params)
            start = body.get("logprob_start_len", -1)
            if start >= len(ids):
                raise GenerateError(f"logprob_start_len ({start}) must be smaller than the prompt length ({len(ids)}).")
            lora = body.get("lora_path")
            if lora is not None and lora not in self.loras:
                raise GenerateError(
                    f"The following requested LoRA adapters are not loaded: {lora}\nLoaded adapters: {list(self.loras)}"
                )
        except GenerateError as exc:
            return await _reply(writer, 400, {"error": {"message": str(exc)}})
        entry = self.loras.get(lora) if lora is not None else None
        if entry is not None:
            entry["uses"] += 1
            self.loras.move_to_end(lora)
        try:
            entries = []
            if body.get("return_logprob") and start >= 0:
                temperature = params.get("temperature", 1.0)
                logprobs = await asyncio.to_thread(self.model.input_logprobs, ids, lora, temperature)
                entries = [[None, ids[start], None]] + [
                    [logprobs[p - 1], ids[p], None] for p in range(start + 1, len(ids))
                ]
        finally:
            if entry is not None:
                entry["uses"] -= 1
                async with self._unloaded:
                    self._unloaded.notify_all()
        meta = {
            "id": body.get("rid") or uuid.uuid4().hex,
            "finish_reason": {"type": "length", "length": 0},
            "prompt_tokens": len(ids),
            "weight_version": "default",
            "completion_tokens": 0,
            "cached_tokens": 0,
            "input_token_logprobs": entries,
            "output_token_logprobs": [],
        }
        await _reply(writer, 200, {"text": "", "output_ids": [], "meta_info": meta})

    def _rows(self, body) -> tuple[list[Row], list[str | None]]:
        ids, params, rid, lora = (
            body.get("input_ids"),
            body.get("sampling_params") or {},
            body.get("rid"),
            body.get("lora_path"),
        )
        if not ids:
            raise GenerateError("input_ids cannot be empty.")
        batch = isinstance(ids[0], list)
        prompts = ids if batch else [ids]
        plist = params if isinstance(params, list) else [params] * len(prompts)
        for p in plist:
            self._check_params(p)
        n = plist[0].get("n", 1)
        rids = (
            rid
            if isinstance(rid, list)
            else ([rid or uuid.uuid4().hex] if not batch else [f"{rid}_{i}" for i in range(len(prompts))])
        )
        loras = lora if isinstance(lora, list) else [lora] * len(prompts)
        rows, names = [], []
        for i, prompt in enumerate(prompts):
            for _j in range(n):  # `n`: SGLang expands the samples under fresh request ids
                sample_rid = uuid.uuid4().hex if n > 1 else rids[i]
                rows.append(Row(sample_rid, len(rows), list(prompt), plist[i], self._generator(plist[i])))
                names.append(loras[i])
        return rows, names

    def _check_params(self, p: dict) -> None:
        unknown = set(p) - SAMPLING_FIELDS
        if unknown:
            raise GenerateError(f"unknown sampling params {sorted(unknown)}")
        top_k = p.get("top_k", -1)
        if top_k != -1 and top_k < 1:
            raise GenerateError(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
        if not 0.0 < p.get("top_p", 1.0) <= 1.0:
            raise GenerateError(f"top_p must be in (0, 1], got {p.get('top_p')}.")

    def _generator(self, p: dict):
        torch = self.model.torch
        gen = torch.Generator()
        seed = p.get("sampling_seed")
        if self.o.enable_deterministic_inference and seed is not None:
            gen.manual_seed(int(seed))
        else:
            gen.manual_seed(int.from_bytes(os.urandom(7), "little"))
        return gen

    def _row_count(self, delta: int) -> None:
        self.active_rows += delta
        if self.active_rows == 0:
            self.idle.set()
        else:
            self.idle.clear()

    async def _run(self, rows: list[Row], lora_names: list[str | None], writer) -> None:
        self._row_count(len(rows))
        live = list(range(len(rows)))
        emitted = 0
        try:
            while live:
                await self._hold([rows[i] for i in live])
                groups: dict[tuple, list[int]] = {}
                for i in live:
                    groups.setdefault((len(rows[i].out), lora_names[i]), []).append(i)
                for (_, lora), idxs in groups.items():
                    seqs = [rows[i].prompt + rows[i].out for i in idxs]
                    logits = await asyncio.to_thread(self.model.last_logits, seqs, lora)
                    for k, i in enumerate(idxs):
                        self._sample(rows[i], logits[k])
                for i in list(live):
                    row = rows[i]
                    if row.rid in self.aborted:
                        row.finish = {"type": "abort", "message": "Abort in waiting queue", "status_code": None}
                    if self.cut_after_tokens is not None and emitted >= self.cut_after_tokens:
                        self.cut_after_tokens = None
                        writer.transport.abort()  # the server dies mid-stream
                        raise ConnectionError("cut")
                    await _chunk(writer, self._out(row, len(rows) > 1))
                    emitted += 1
                    if row.finish is not None:
                        live.remove(i)
                        self._row_count(-1)
        finally:
            self._row_count(-len(live))

    async def _hold(self, rows: list[Row]) -> None:
        if self.hold_at_tokens is not None and any(len(r.out) >= self.hold_at_tokens for r in rows):
            self.hold_at_tokens = None
            if not await asyncio.to_thread(self.release.wait, 60):
                raise RuntimeError("the test never released the held request")

    def _sample(self, row: Row, logits) -> None:
        torch = self.model.torch
        p = row.params
        temperature = p.get("temperature", 1.0)
        top_k = p.get("top_k", -1)
        if temperature < 1e-6:  # SGLang: greedy is top_k=1 at temperature 1
            temperature, top_k = 1.0, 1
        probs = torch.softmax(logits / temperature, -1)
        logprobs = torch.log(probs)  # reported: the untruncated, tempered distribution
        sorted_p, order = probs.sort(descending=True)
        keep = (sorted_p.cumsum(-1) - sorted_p) <= p.get("top_p", 1.0)
        if top_k != -1:
            keep &= torch.arange(len(sorted_p)) < top_k
        kept = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
        token = int(order[torch.multinomial(kept / kept.sum(), 1, generator=row.generator)[0]])
        row.out.append(token)
        row.logprobs.append(float(logprobs[token]))
        row.finish = self._finish_reason(row, token)

    def _finish_reason(self, row: Row, token: int) -> dict | None:
        p = row.params
        if token in self.model.eos_ids and not p.get("ignore_eos", False):
            return {"type": "stop", "matched": token}
        text = self.model.tokenizer.decode(row.out, skip_special_tokens=True)
        for stop in p.get("stop") or []:
            if text.endswith(stop):
                return {"type": "stop", "matched": stop}
        if len(row.out) >= p.get("max_new_tokens", 128):
            return {"type": "length", "length": len(row.out)}
        return None

    def _out(self, row: Row, indexed: bool) -> dict:
        start = row.sent if self.o.incremental_streaming_output else 0
        row.sent = len(row.out)
        meta = {
            "id": row.rid,
            "finish_reason": row.finish,
            "prompt_tokens": len(row.prompt),
            "weight_version": "default",
            "completion_tokens": len(row.out),
            "cached_tokens": 0,
            "output_token_logprobs": [
                [lp, t, None] for lp, t in zip(row.logprobs[start:], row.out[start:], strict=False)
            ],
        }
        text = self.model.tokenizer.decode(row.out, skip_special_tokens=True)
        out = {"text": text, "output_ids": row.out[start:], "meta_info": meta}
        if indexed:
            out["index"] = row.index
        return out


# -- HTTP/1.1 plumbing (Connection: close, chunked event streams) ----------------------------
async def _read_request(reader: asyncio.StreamReader):
    line = (await reader.readline()).decode()
    if not line:
        raise ConnectionError("no request")
    method, target, _ = line.split(" ", 2)
    headers = {}
    while (h := (await reader.readline()).decode()) not in ("\r\n", "\n", ""):
        k, v = h.split(":", 1)
        headers[k.strip().lower()] = v.strip()
    raw = await reader.readexactly(int(headers.get("content-length", 0)))
    return method, target.split("?")[0], headers, json.loads(raw) if raw else None


async def _reply(writer: asyncio.StreamWriter, status: int, body) -> None:
    data = b"" if body is None else json.dumps(body).encode()
    head = f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {len(data)}\r\nconnection: close\r\n\r\n"
    writer.write(head.encode() + data)
    await writer.drain()


async def _start_stream(writer) -> None:
    writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n"
    )
    await writer.drain()


async def _chunk(writer, payload) -> None:
    data = b"data: " + (payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()) + b"\n\n"
    if writer.is_closing():
        raise ConnectionError("client gone")
    writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
    await writer.drain()


async def _end_stream(writer) -> None:
    writer.write(b"0\r\n\r\n")
    await writer.drain()


# -- process mode ------------------------------------------------------------------------------
def parse_args(argv: list[str]) -> Options:
    """SGLang's flags that rollwire passes; any other flag is an error, as in SGLang."""
    p = argparse.ArgumentParser(prog="sglang_double")
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--enable-lora", action="store_true")
    p.add_argument("--max-lora-rank", type=int)
    p.add_argument("--lora-target-modules", nargs="*", default=[])
    p.add_argument("--max-loras-per-batch", type=int, default=8)
    p.add_argument("--max-loaded-loras", type=int)
    p.add_argument("--enable-deterministic-inference", action="store_true")
    p.add_argument("--incremental-streaming-output", action="store_true")
    p.add_argument("--random-seed", type=int)
    p.add_argument("--config")
    p.add_argument("--double-fail-start", action="store_true", help="test only: exit at once, as a broken SGLang would")
    a = p.parse_args(argv)
    if a.double_fail_start:
        print("sglang_double: failing on purpose (--double-fail-start)", flush=True)
        sys.exit(3)
    keys = json.loads(Path(a.config).read_text()) if a.config else {}
    return Options(
        model_path=a.model_path,
        host=a.host,
        port=a.port,
        enable_lora=a.enable_lora,
        max_lora_rank=a.max_lora_rank,
        lora_target_modules=a.lora_target_modules,
        max_loras_per_batch=a.max_loras_per_batch,
        max_loaded_loras=a.max_loaded_loras,
        enable_deterministic_inference=a.enable_deterministic_inference,
        incremental_streaming_output=a.incremental_streaming_output,
        random_seed=a.random_seed,
        api_key=keys.get("api_key"),
        admin_api_key=keys.get("admin_api_key"),
    )


async def _main(options: Options) -> None:
    server = DoubleServer(options)
    listening = asyncio.Event()
    serving = asyncio.create_task(server._serve(listening))
    await listening.wait()
    print(f"sglang_double listening on {server.url}; loading {options.model_path}", flush=True)
    server.model = await asyncio.to_thread(DoubleModel, options.model_path)  # /health says 503 until then
    print("The server is fired up and ready to roll!", flush=True)
    await serving


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    started = time.monotonic()
    options = parse_args(sys.argv[1:] if argv is None else argv)
    print(
        f"sglang_double {VERSION} args={sys.argv[1:] if argv is None else argv} ({time.monotonic() - started:.2f}s)",
        flush=True,
    )
    asyncio.run(_main(options))


if __name__ == "__main__":
    main()
