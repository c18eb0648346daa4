"""The sglang engine against the SGLang double: exact requests, stream parsing, errors,
adapter files and ordering through the registry, and recovery when SGLang dies.

tests/support/sglang_double.py is a protocol-level double of SGLang 0.5.23's HTTP API; no real
SGLang runs here (tests/e2e/test_sglang_gpu.py does that where a GPU is present).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
import threading
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
import torch
from support.engines import collect, forward_logprobs, manifest_for
from support.processes import ROOT, start_generator
from support.sglang_double import DoubleModel, DoubleServer, Options
from support.wire import fingerprint, generate, make_adapter, peft_reference, push

from rollwire.common.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    Unimplemented,
)
from rollwire.common.lora import LoraShape
from rollwire.common.manifest import Manifest
from rollwire.common.reasons import Reason
from rollwire.generator.adapters import AdapterRegistry
from rollwire.generator.engines.served.sglang_engine import SGLangEngine, peft_config
from rollwire.generator.engines.served.sglang_protocol import (
    DONE,
    StreamTracker,
    error_from_body,
    generate_body,
    parse_sse_line,
)
from rollwire.generator.engines.settings import SGLangSection
from rollwire.generator.types import (
    AdapterSelection,
    GroupRequest,
    SampleDone,
    SamplingParams,
    ScoreJob,
    TokenDelta,
)

DOUBLE = [sys.executable, str(ROOT / "tests" / "support" / "sglang_double.py")]
_ids = itertools.count()


def options(model, **changes) -> Options:
    base = dict(
        model_path=str(model),
        enable_lora=True,
        max_lora_rank=16,
        lora_target_modules=["all"],
        max_loaded_loras=3,
        max_loras_per_batch=3,
        enable_deterministic_inference=True,
    )
    return Options(**{**base, **changes})


@pytest.fixture(scope="module")
def double_model(tiny_model):
    return DoubleModel(str(tiny_model))


@pytest.fixture
def double(tiny_model):
    server = DoubleServer(options(tiny_model), DoubleModel(str(tiny_model))).start()
    yield server
    server.stop()


async def engine_for(model, server: DoubleServer, tmp_path: Path, window: int = 2, **settings) -> SGLangEngine:
    s = SGLangSection(url=server.url, adapter_dir=str(tmp_path / "adapters"), health_interval_s=0.05, **settings)
    eng = SGLangEngine(model, s, adapter_window=window)
    await eng.start()
    return eng


@pytest_asyncio.fixture
async def engine(tiny_model, double, tmp_path):
    eng = await engine_for(tiny_model, double, tmp_path)
    yield eng
    await eng.close()


def group(prompt, n=1, adapter=None, **sampling) -> GroupRequest:
    sampling.setdefault("max_new_tokens", 8)
    return GroupRequest(f"g{next(_ids)}", list(prompt), n, SamplingParams(**sampling), adapter or AdapterSelection())


# -- the protocol, as pure functions -------------------------------------------------------------
def test_generate_bodies_follow_sglang_for_each_shape():
    params = dict(max_new_tokens=5, temperature=0.5, top_p=0.9, top_k=0, stop=("x",), seed=None)
    one, rids = generate_body(group([1, 2], **params), None, None, "r.1")
    assert one == {
        "return_logprob": True,
        "logprob_start_len": -1,
        "stream": True,
        "input_ids": [1, 2],
        "rid": "r.1",
        "sampling_params": {
            "max_new_tokens": 5,
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": -1,
            "ignore_eos": False,
            "no_stop_trim": True,
            "skip_special_tokens": True,
            "stop": ["x"],
        },
    } and rids == ["r.1"]
    many, rids = generate_body(group([1, 2], n=3, **params), "lora-a", None, "r.2")
    assert many["sampling_params"]["n"] == 3 and many["input_ids"] == [1, 2] and many["lora_path"] == "lora-a"
    assert rids is None  # SGLang names the samples of `n` itself
    seeded, rids = generate_body(group([1, 2], n=2, top_k=4), "lora-a", [11, 12], "r.3")
    assert seeded["input_ids"] == [[1, 2], [1, 2]] and seeded["rid"] == rids == ["r.3-0", "r.3-1"]
    assert [p["sampling_seed"] for p in seeded["sampling_params"]] == [11, 12]
    assert seeded["sampling_params"][0]["top_k"] == 4 and seeded["lora_path"] == ["lora-a", "lora-a"]


def test_sse_lines():
    assert parse_sse_line("data: [DONE]") is DONE
    assert parse_sse_line("") is None and parse_sse_line(": keep-alive") is None
    assert parse_sse_line('data: {"a": 1}') == {"a": 1}
    with pytest.raises(Internal, match="not JSON"):
        parse_sse_line("data: {oops")


def chunk(ids, lps, finish=None, index=None, prompt=2):
    meta = {
        "id": "x",
        "finish_reason": finish,
        "prompt_tokens": prompt,
        "completion_tokens": len(ids),
        "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids, strict=False)],
    }
    out = {"text": "", "output_ids": ids, "meta_info": meta}
    if index is not None:
        out["index"] = index
    return out


class Letters:
    """A stand-in detokenizer for the stream parser: token i is the letter chr(64 + i)."""

    def add(self, ids: list[int]) -> str:
        return "".join(chr(64 + i) for i in ids)


def test_cumulative_and_incremental_streams_give_the_same_events():
    cumulative = [
        chunk([1], [-0.1]),
        chunk([1, 2], [-0.1, -0.2]),
        chunk([1, 2, 3], [-0.1, -0.2, -0.3], {"type": "length"}),
    ]
    incremental = [
        chunk([1], [-0.1]),
        {**chunk([2], [-0.2]), "meta_info": {**chunk([2], [-0.2])["meta_info"], "completion_tokens": 2}},
        {
            **chunk([3], [-0.3]),
            "meta_info": {**chunk([3], [-0.3], {"type": "length"})["meta_info"], "completion_tokens": 3},
        },
    ]
    for stream in (cumulative, incremental):
        t = StreamTracker(group([5, 6]), Letters)
        events = [e for c in stream for e in t.feed(c)]
        assert [e.token_ids for e in events if isinstance(e, TokenDelta)] == [[1], [2], [3]]
        assert "".join(e.text for e in events if isinstance(e, TokenDelta)) == "ABC"
        assert events[-1] == SampleDone(0, "length", 2, 3) and t.complete


def test_finish_reasons_and_broken_streams():
    t = StreamTracker(group([5], n=3), Letters)
    assert t.feed(chunk([2], [-1.0], {"type": "stop", "matched": 2}, index=0))[-1].reason == "eos"
    assert t.feed(chunk([7], [-1.0], {"type": "stop", "matched": "e"}, index=1))[-1].reason == "stop"
    with pytest.raises(Internal, match="output was lost"):
        t.feed(
            {**chunk([9], [-1.0], index=2), "meta_info": {**chunk([9], [-1.0])["meta_info"], "completion_tokens": 2}}
        )
    with pytest.raises(Internal, match="sample index 5"):
        t.feed(chunk([1], [-1.0], index=5))
    with pytest.raises(InvalidArgument, match="top_k must be"):
        t.feed({"error": {"message": "top_k must be -1 (disable) or at least 1, got 0.", "code": 400}})
    with pytest.raises(Unavailable, match="Scheduler is overloaded"):
        t.feed(chunk([4], [-1.0], {"type": "abort", "message": "Scheduler is overloaded", "status_code": 503}, index=2))


@pytest.mark.parametrize(
    "status,cls",
    [
        (400, InvalidArgument),
        (401, Unauthenticated),
        (404, FailedPrecondition),
        (429, ResourceExhausted),
        (500, Internal),
        (503, Unavailable),
        (504, DeadlineExceeded),
    ],
)
def test_http_errors_map_to_statuses_and_keep_sglang_s_message(status, cls):
    err = error_from_body(status, {"error": {"message": "the words SGLang used"}}, "loading adapter a v1")
    assert isinstance(err, cls) and "the words SGLang used" in err.message and "loading adapter a v1" in err.message
    assert (err.retry_after_s is not None) == (cls in (Unavailable, ResourceExhausted))


def test_peft_config_targets_what_the_tensors_adapt_and_folds_rslora(tiny_model):
    adapter = make_adapter(tiny_model, seed=3, r=4, targets=("q_proj", "v_proj"))
    m = Manifest(
        "a", 1, "fp", LoraShape(4, 8.0, ("q_proj", "v_proj"), use_rslora=True), len(adapter.payload), adapter.sha256
    )
    config = peft_config(m, adapter.payload, "/models/tiny")
    assert config["target_modules"] == ["q_proj", "v_proj"] and config["r"] == 4
    assert config["lora_alpha"] == 16.0 and config["use_rslora"] is False  # 8/sqrt(4) == 16/4


# -- the engine against the double -------------------------------------------------------------
async def test_requests_on_the_wire(engine, double, tiny_model):
    adapter = make_adapter(tiny_model, seed=1, r=4)
    await engine.load_adapter("rw1", manifest_for(adapter, "pol", 1), adapter.payload)
    load = [c for c in double.calls if c.path == "/load_lora_adapter"][-1]
    name = load.body["lora_name"]
    assert name.startswith("pol-v1-rw1-") and load.body == {
        "lora_name": name,
        "lora_path": str(engine.adapter_dir / name),
        "pinned": False,
    }
    folder = engine.adapter_dir / name
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert (folder / "adapter_model.safetensors").read_bytes() == adapter.payload
    assert not [p for p in engine.adapter_dir.iterdir() if ".tmp-" in p.name]  # no temporary folder is left
    await collect(engine, group([10, 11], n=3, adapter=AdapterSelection("pol", 1, "rw1"), max_new_tokens=4))
    body = double.generate_calls()[-1]
    assert body["lora_path"] == name and body["sampling_params"]["n"] == 3 and body["input_ids"] == [10, 11]
    assert body["return_logprob"] is True and body["stream"] is True and body["logprob_start_len"] == -1


async def test_seeded_groups_send_one_seed_per_sample(engine, double):
    from rollwire.generator.sampling import sample_seed

    out = await collect(engine, group([10, 11], n=3, seed=9, max_new_tokens=4, ignore_eos=True))
    body = double.generate_calls()[-1]
    assert [p["sampling_seed"] for p in body["sampling_params"]] == [sample_seed(9, i) % (1 << 31) for i in range(3)]
    assert len(out["done"]) == 3 and len({tuple(t) for t in out["tokens"].values()}) > 1


async def test_seeds_are_refused_when_sglang_would_ignore_them(tiny_model, double_model, tmp_path):
    server = DoubleServer(options(tiny_model, enable_deterministic_inference=False), double_model).start()
    eng = await engine_for(tiny_model, server, tmp_path)
    try:
        with pytest.raises(FailedPrecondition, match="enable-deterministic-inference"):
            await collect(eng, group([3], seed=1))
        assert (await collect(eng, group([3], max_new_tokens=2)))["done"][0].completion_tokens <= 2
    finally:
        await eng.close()
        server.stop()


async def test_incremental_streaming_output_gives_the_same_samples(engine, double):
    cumulative = await collect(engine, group([20, 21], n=2, seed=5, max_new_tokens=10, ignore_eos=True))
    double.o.incremental_streaming_output = True
    incremental = await collect(engine, group([20, 21], n=2, seed=5, max_new_tokens=10, ignore_eos=True))
    assert incremental["tokens"] == cumulative["tokens"] and incremental["logprobs"] == cumulative["logprobs"]


async def test_top_k_logprobs_are_sglang_s_untruncated_ones(engine, reference_model):
    """Documented difference: SGLang reports log softmax(logits/T) before top-k/top-p."""
    out = await collect(engine, group([30, 31], n=2, max_new_tokens=8, top_k=5, temperature=0.8))
    for i in range(2):
        expected = forward_logprobs(reference_model, [30, 31], out["tokens"][i], temperature=0.8)
        assert torch.allclose(torch.tensor(out["logprobs"][i]), expected, atol=1e-4)


async def test_sglang_errors_keep_their_message(engine, double):
    double.inject("/generate", 503, {"error": {"message": "Server is overloaded, retry later"}})
    with pytest.raises(Unavailable, match="overloaded, retry later") as err:
        await collect(engine, group([1]))
    assert err.value.retry_after_s
    double.inject("/generate", 400, {"error": "unknown field(s) in /generate body: ['x']"})
    with pytest.raises(InvalidArgument, match="unknown field"):
        await collect(engine, group([1]))


async def test_a_refused_load_leaves_no_files_and_nothing_loaded(engine, double, tiny_model):
    adapter = make_adapter(tiny_model, seed=2, r=4)
    double.inject("/load_lora_adapter", 400, {"success": False, "error_message": "Failed to load: disk on fire"})
    with pytest.raises(InvalidArgument, match="disk on fire"):
        await engine.load_adapter("rw9", manifest_for(adapter, "pol", 1), adapter.payload)
    assert [p.name for p in engine.adapter_dir.iterdir()] == ["_sglang"] and not engine._adapters
    big = make_adapter(tiny_model, seed=2, r=32)
    with pytest.raises(FailedPrecondition, match="max_lora_rank=16"):
        engine.settings.max_lora_rank = 16
        await engine.load_adapter("rw10", manifest_for(big, "pol", 1), big.payload)


async def test_registry_orders_loads_and_unloads_and_never_exceeds_sglang_s_limit(engine, double, tiny_model):
    registry = AdapterRegistry(engine.load_adapter, engine.unload_adapter, window=2)  # engine: window 2 -> 3 slots
    adapters = {v: make_adapter(tiny_model, seed=40 + v, r=4) for v in range(1, 5)}

    async def push_version(v):
        return await registry.push(manifest_for(adapters[v], "pol", v), adapters[v].payload)

    await push_version(1)
    await push_version(2)
    lease = registry.acquire("pol", 1)
    stream = engine.generate(group([5, 6], adapter=lease, max_new_tokens=200, ignore_eos=True))
    await anext(stream)  # v1 is in use
    await push_version(3)  # v1 leaves the window but is leased: it stays loaded
    names = [c.body["lora_name"] for c in double.calls if c.path == "/load_lora_adapter"]
    assert not [c for c in double.calls if c.path == "/unload_lora_adapter"]
    with pytest.raises(ResourceExhausted, match="retry the push"):
        await push_version(4)  # 2 in the window + leased v1 = SGLang's 3 slots
    await stream.aclose()
    registry.release(lease)
    await registry.settle()
    unloads = [c.body["lora_name"] for c in double.calls if c.path == "/unload_lora_adapter"]
    assert unloads == [names[0]] and not (engine.adapter_dir / names[0]).exists()
    await push_version(4)
    assert double.evicted == []  # SGLang's own LRU eviction never had to run
    assert registry.loaded() == {"pol": [3, 4]}


async def test_score_reads_sglang_s_prompt_logprobs_under_the_version(engine, double, tiny_model, reference_model):
    """Score (and so every proof) through SGLang's prefill-only /generate: each continuation token's
    logprob equals an independent teacher-forced pass, under the version's LoRA and under the base
    model; the requests on the wire are SGLang's shape; a refused request fails the Score with
    SGLang's message and leaves the version unleased; a Score with top_k is refused by name."""
    adapter = make_adapter(tiny_model, seed=5, r=4, scale=0.1)
    await engine.load_adapter("rs1", manifest_for(adapter, "pol", 1), adapter.payload)
    name = [c.body["lora_name"] for c in double.calls if c.path == "/load_lora_adapter"][-1]
    seqs = (((10, 11, 12), (13, 14)), ((20,), (21, 22, 23)))
    selection = AdapterSelection("pol", 1, "rs1")
    try:
        under = await engine.score(ScoreJob("sc1", seqs, 0, selection))
        base = await engine.score(ScoreJob("sc2", seqs))
        double.inject("/generate", 400, {"error": {"message": "The following requested LoRA adapters are not loaded"}})
        with pytest.raises(InvalidArgument, match="not loaded"):
            await engine.score(ScoreJob("sc3", seqs, 0, selection))
        assert not engine._in_use  # every request of the failed Score ended with it
    finally:
        await engine.unload_adapter("rs1")
    peft = peft_reference(tiny_model, adapter)
    for (prompt, continuation), v1, v0 in zip(seqs, under, base, strict=True):
        want_v1 = forward_logprobs(peft, list(prompt), list(continuation))
        want_v0 = forward_logprobs(reference_model, list(prompt), list(continuation))
        assert torch.allclose(torch.tensor(v1.logprobs), want_v1, atol=1e-5)
        assert torch.allclose(torch.tensor(v0.logprobs), want_v0, atol=1e-5)
        assert not torch.allclose(want_v1, want_v0, atol=1e-4)  # the adapter really moves them
    bodies = [b for b in double.generate_calls() if b["rid"].startswith(("sc1.", "sc2."))]
    assert len(bodies) == 4 and {b["stream"] for b in bodies} == {False}
    assert {(tuple(b["input_ids"]), b["logprob_start_len"], b.get("lora_path")) for b in bodies} == {
        (tuple(p + c), len(p) - 1, lora) for p, c in seqs for lora in (name, None)
    }
    assert all(b["sampling_params"]["max_new_tokens"] == 0 and b["return_logprob"] for b in bodies)
    with pytest.raises(Unimplemented) as refused:
        engine.check_score(ScoreJob("sc4", seqs, top_k=2))
    assert refused.value.reason == Reason.SCORE_UNSUPPORTED


async def test_a_replica_over_sglang_proves_a_version_and_refuses_one_its_server_computes_wrongly(
    tiny_model, double_model, tmp_path
):
    """Issue 52 on an SGLang-backed replica, over gRPC: a signed version whose probe holds the
    publisher's PEFT numbers passes within the served tolerance (1e-3) through SGLang's prompt
    logprobs; the next version, loaded by an SGLang that computes with other weights (B x 1.05), is
    refused with PROOF_FAILED naming the replica and the gap, and the replica keeps serving v1."""
    from rollwire.client.aio import AsyncClient
    from rollwire.common import probe as probes
    from rollwire.common.fingerprint import model_fingerprint
    from rollwire.common.signing import SigningKey
    from rollwire.generator.app import start_generator
    from rollwire.generator.config import GeneratorConfig

    key = SigningKey.generate("publisher")
    (tmp_path / "trust.json").write_text(json.dumps({"keys": [key.trust_entry()]}))
    server = DoubleServer(options(tiny_model), double_model).start()
    replica = await start_generator(
        GeneratorConfig.model_validate(
            {
                "model": str(tiny_model),
                "engine": "sglang",
                "host": "127.0.0.1",
                "port": 0,
                "metrics_port": 0,
                "replica_id": "sgl-proof",
                "sglang": {"url": server.url, "adapter_dir": str(tmp_path / "adapters")},
                "trust": {"keys_file": str(tmp_path / "trust.json")},
            }
        )
    )
    client = AsyncClient(f"127.0.0.1:{replica.port}", timeout=60)
    tokenize = replica.servicer.engine.tokenize
    seqs = [(tokenize(p), tokenize(c)) for p, c in (("12+34=", "46"), ("abc", "defgh"))]

    async def push_version(version: int):
        adapter = make_adapter(tiny_model, seed=90 + version, r=4, scale=0.1)
        peft = peft_reference(tiny_model, adapter)
        probe = probes.build_probe(seqs, [forward_logprobs(peft, p, c).tolist() for p, c in seqs], seed=version)
        shape = LoraShape(adapter.r, adapter.lora_alpha, adapter.targets)
        return await client.push_adapter(
            "pol", version, adapter.payload, shape, model_fingerprint(tiny_model), signing_key=key, probe=probe
        )

    try:
        await push_version(1)
        proof = replica.servicer.status().adapters[0].proofs[1]
        assert proof.outcome == probes.PASSED and proof.max_abs_gap <= probes.DEFAULT_TOLERANCES["sglang"] == 1e-3
        server.lora_b_scale = 1.05  # SGLang now computes with other weights than the files it is given
        with pytest.raises(FailedPrecondition) as refused:
            await push_version(2)
        assert refused.value.reason == Reason.PROOF_FAILED
        assert "sgl-proof" in refused.value.message and "differ by up to" in refused.value.message
        assert replica.servicer.registry.loaded() == {"pol": [1]}  # it keeps serving what it served
        assert replica.servicer.metrics.proofs.labels("failed")._value.get() == 1
        assert replica.servicer.metrics.proofs.labels("passed")._value.get() == 1
    finally:
        await client.close()
        await replica.stop(0)
        server.stop()


async def test_cancelled_seeded_group_is_aborted_by_request_id(engine, double):
    stream = engine.generate(group([7, 8], n=2, seed=3, max_new_tokens=300, ignore_eos=True))
    await anext(stream)
    await stream.aclose()
    await asyncio.gather(*list(engine._aborts))
    rids = double.generate_calls()[-1]["rid"]
    assert sorted(c.body["rid"] for c in double.calls if c.path == "/abort_request") == sorted(rids)
    assert double.idle.wait(10)


async def test_api_keys_come_from_files_and_are_sent_where_sglang_wants_them(tiny_model, double_model, tmp_path):
    server = DoubleServer(options(tiny_model, api_key="k-gen", admin_api_key="k-admin"), double_model).start()
    (tmp_path / "gen").write_text("k-gen\n")
    (tmp_path / "admin").write_text("k-admin")
    (tmp_path / "wrong").write_text("nope")
    eng = await engine_for(
        tiny_model, server, tmp_path, api_key_file=str(tmp_path / "gen"), admin_api_key_file=str(tmp_path / "admin")
    )
    try:
        adapter = make_adapter(tiny_model, seed=5, r=4)
        await eng.load_adapter("rw1", manifest_for(adapter, "k", 1), adapter.payload)
        await collect(eng, group([1, 2], adapter=AdapterSelection("k", 1, "rw1"), max_new_tokens=2))
        headers = {c.path: c.headers.get("authorization") for c in server.calls}
        assert headers["/load_lora_adapter"] == "Bearer k-admin" and headers["/generate"] == "Bearer k-gen"
    finally:
        await eng.close()
    bad = SGLangEngine(
        tiny_model, SGLangSection(url=server.url, api_key_file=str(tmp_path / "wrong")), adapter_window=2
    )
    with pytest.raises(Unauthenticated, match="api_key_file"):
        await bad.start()
    await bad.close()
    server.stop()


async def test_a_stream_cut_by_a_dying_server_is_an_explicit_error(engine, double):
    double.cut_after_tokens = 3
    with pytest.raises(Unavailable, match="retry the whole group"):
        await collect(engine, group([1, 2], n=2, max_new_tokens=50, ignore_eos=True))


async def test_recovery_after_sglang_at_a_url_dies(tiny_model, double_model, tmp_path):
    first = DoubleServer(options(tiny_model), DoubleModel(str(tiny_model))).start()
    eng = await engine_for(tiny_model, first, tmp_path)
    try:
        adapter = make_adapter(tiny_model, seed=6, r=4)
        await eng.load_adapter("rw1", manifest_for(adapter, "p", 1), adapter.payload)
        first.die()
        await eng.supervisor.wait_for(lambda s: not s.up, 10)
        with pytest.raises(Unavailable, match="cannot serve right now"):
            await collect(eng, group([1]))
        second = DoubleServer(options(tiny_model, port=first.port), double_model).start()
        await eng.supervisor.wait_for(lambda s: s.up, 10)
        assert len(second.loras) == 1  # the adapter was loaded again before serving
        out = await collect(eng, group([1, 2], adapter=AdapterSelection("p", 1, "rw1"), max_new_tokens=3))
        assert out["versions"][0] == {1}
        second.stop()
    finally:
        await eng.close()
        first.stop()


async def test_start_up_failures_say_what_happened(tiny_model, tmp_path):
    failing = SGLangSection(launch_command=DOUBLE, extra_args=["--double-fail-start"], adapter_dir=str(tmp_path / "a"))
    eng = SGLangEngine(tiny_model, failing, adapter_window=2)
    with pytest.raises(FailedPrecondition, match="(?s)exited with code 3.*failing on purpose"):
        await eng.start()
    await eng.close()
    nobody = SGLangSection(url="http://127.0.0.1:9", startup_timeout_s=0.5, adapter_dir=str(tmp_path / "b"))
    eng = SGLangEngine(tiny_model, nobody, adapter_window=2)
    with pytest.raises(DeadlineExceeded, match="did not become healthy within 0.5s"):
        await eng.start()
    await eng.close()


# -- the whole replica: `rollwire generator --engine sglang` launching SGLang (the double) -------------
def test_generator_launches_sglang_serves_and_survives_its_crash(tiny_model, tmp_path):
    import urllib.error
    import urllib.request

    from rollwire.generator.engines.served.sglang_process import free_port

    port = free_port("127.0.0.1")
    svc = start_generator(
        tiny_model,
        tmp_path,
        "sglang-gen",
        "--engine",
        "sglang",
        "--adapter-window",
        "2",
        "--set",
        f"sglang.launch_command={json.dumps(DOUBLE)}",
        "--set",
        f"sglang.port={port}",
        "--set",
        "sglang.deterministic=true",
        "--set",
        f"sglang.adapter_dir={tmp_path / 'adapters'}",
    )
    try:
        adapter = make_adapter(tiny_model, seed=8, r=4)
        push(svc.target, adapter.manifest("live", 1, fingerprint(svc.target)), adapter.payload)
        before = generate(svc.target, "hello", n=2, adapter=("live", 1), max_new_tokens=6, seed=4, ignore_eos=True)
        assert before.started.adapter.version == 1 and len(before.finished) == 2
        state = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/_double/state", timeout=5))
        argv = (tmp_path / "adapters" / "_sglang" / "sglang.log").read_text()
        assert "--enable-lora" in argv and "'--max-loaded-loras', '3'" in argv and len(state["loras"]) == 1
        with pytest.raises(urllib.error.HTTPError) as refused:  # a per-launch key no other process holds
            body = json.dumps({"lora_name": "intruder", "lora_path": str(tmp_path)}).encode()
            urllib.request.urlopen(f"http://127.0.0.1:{port}/load_lora_adapter", body, timeout=5)
        assert refused.value.code == 401 and "keys.json" in argv  # the key is in a private file, not argv
        with pytest.raises(Exception):
            urllib.request.urlopen(
                urllib.request.Request(f"http://127.0.0.1:{port}/_double/die", method="POST"), timeout=5
            )
        after = None
        for _ in range(600):  # bounded: the replica restarts SGLang and reloads the adapter
            try:
                after = generate(
                    svc.target, "hello", n=2, adapter=("live", 1), max_new_tokens=6, seed=4, ignore_eos=True
                )
                break
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.UNAVAILABLE, err.details()
                threading.Event().wait(0.05)
        assert after is not None and after.tokens == before.tokens  # same seed, same adapter, new server
    finally:
        svc.stop()
    log_text = svc.log_path.read_text()
    assert "sglang_down" in log_text and "sglang_adapters_reloaded" in log_text, log_text[-3000:]


pytestmark = pytest.mark.integration  # starts processes or servers: not in make test-fast
