"""One contract every registered engine passes, built through the registry as a replica builds it.

The engines come from `rollwire.generator.engines.ENGINES`, so an engine registered there is
in this suite without further edits: each is built by `make_engine` from a GeneratorConfig over
the tiny model. The sglang engine is pointed at the SGLang double (tests/support/sglang_double.py), a
protocol-level double of SGLang's HTTP API backed by the tiny model, so these tests check its
requests, stream parsing and adapter handling end to end, and its numbers against an
independent teacher-forced pass; a real SGLang server is exercised only by
tests/e2e/test_sglang_gpu.py. An engine registered with `runs_model=False` (the scripted
benchmark engine) emits scripted tokens: it passes the structural half of the contract and
the tests that compare numbers with the model skip it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from dataclasses import replace

import pytest
import pytest_asyncio
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from support.engines import collect, forward_logprobs, manifest_for
from support.sglang_double import DoubleModel, DoubleServer, Options
from support.wire import make_adapter, peft_reference

from rollwire.common import probe as probes
from rollwire.common.errors import FailedPrecondition
from rollwire.common.reasons import Reason
from rollwire.generator.app import make_engine
from rollwire.generator.config import GeneratorConfig
from rollwire.generator.engines import ENGINES
from rollwire.generator.engines.settings import SGLangSection
from rollwire.generator.metrics import GeneratorMetrics
from rollwire.generator.proof import Prover
from rollwire.generator.types import AdapterSelection, GroupRequest, SamplingParams

_ids = itertools.count()


@pytest_asyncio.fixture(scope="module", params=ENGINES.names())
async def engine(request, tiny_model, tmp_path_factory):
    config = GeneratorConfig(model=str(tiny_model), engine=request.param)
    double = None
    if request.param == "sglang":  # the one engine that needs a server beside it
        options = Options(
            model_path=str(tiny_model),
            enable_lora=True,
            max_lora_rank=16,
            lora_target_modules=["all"],
            max_loaded_loras=4,
            max_loras_per_batch=4,
            enable_deterministic_inference=True,
        )
        double = DoubleServer(options, DoubleModel(str(tiny_model))).start()
        config.sglang = SGLangSection(url=double.url, adapter_dir=str(tmp_path_factory.mktemp("sglang-adapters")))
    if request.param == "vllm":  # the run's one vLLM server (support.vllm), reached by url
        from support.vllm import vllm_section

        server = request.getfixturevalue("vllm_server")
        config.vllm = vllm_section(tmp_path_factory.mktemp("vllm-adapters"), url=server.url)
    eng = make_engine(config, GeneratorMetrics())
    assert eng.name == request.param
    try:
        await eng.start()
        eng.double = double
        yield eng
    finally:
        await eng.close()  # stops a launched server's process group even when start-up failed
    if double is not None:
        double.stop()


def needs_model(engine) -> None:
    """Skip a test that compares numbers with the model for an engine that runs none."""
    if not ENGINES.entry(engine.name).traits.get("runs_model", True):
        pytest.skip(f"the {engine.name} engine runs no model: its tokens and logprobs are scripted")


def group(prompt: list[int], n: int = 1, adapter: AdapterSelection | None = None, **sampling) -> GroupRequest:
    sampling.setdefault("max_new_tokens", 16)
    return GroupRequest(f"contract-{next(_ids)}", prompt, n, SamplingParams(**sampling), adapter or AdapterSelection())


async def eventually(condition, timeout_s: float = 10.0) -> bool:
    """Bounded wait for a state an engine reaches on its own thread (no event to await)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        if loop.time() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


def prompt_of(engine, text: str) -> list[int]:
    return engine.tokenize(text)


async def test_every_sample_finishes_once_with_counts(engine):
    prompt = prompt_of(engine, "The cat sat")
    out = await collect(engine, group(prompt, n=4, max_new_tokens=24))
    assert sorted(out["done"]) == [0, 1, 2, 3]
    for i, done in out["done"].items():
        assert done.reason in ("eos", "length", "stop")
        assert done.prompt_tokens == len(prompt)
        assert done.completion_tokens == len(out["tokens"][i]) == len(out["logprobs"][i])
        assert (done.reason == "length") == (done.completion_tokens == 24 and done.reason != "eos")
        assert out["versions"][i] == {0}


async def test_base_logprobs_equal_a_teacher_forced_pass(engine, reference_model):
    needs_model(engine)
    prompt = prompt_of(engine, "Logprobs of")
    out = await collect(engine, group(prompt, n=3, max_new_tokens=20))
    for i in range(3):
        expected = forward_logprobs(reference_model, prompt, out["tokens"][i])
        assert torch.allclose(torch.tensor(out["logprobs"][i]), expected, atol=1e-4), i


async def test_tempered_logprobs_equal_a_teacher_forced_pass(engine, reference_model):
    needs_model(engine)
    prompt = prompt_of(engine, "warm")
    out = await collect(engine, group(prompt, n=2, max_new_tokens=12, temperature=0.7))
    for i in range(2):
        expected = forward_logprobs(reference_model, prompt, out["tokens"][i], temperature=0.7)
        assert torch.allclose(torch.tensor(out["logprobs"][i]), expected, atol=1e-4)


async def test_greedy_equals_hf_generate(engine, reference_model):
    needs_model(engine)
    prompt = prompt_of(engine, "greedy")
    out = await collect(engine, group(prompt, n=2, max_new_tokens=12, temperature=0.0, ignore_eos=True))
    with torch.no_grad():
        ref = reference_model.generate(
            torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0
        )[0, len(prompt) :].tolist()
    assert out["tokens"][0] == out["tokens"][1] == ref
    assert all(d.reason == "length" for d in out["done"].values())


async def test_seeds_reproduce_and_samples_of_a_group_differ(engine):
    prompt = prompt_of(engine, "seeded")
    a = await collect(engine, group(prompt, n=3, max_new_tokens=16, seed=42, ignore_eos=True))
    b = await collect(engine, group(prompt, n=3, max_new_tokens=16, seed=42, ignore_eos=True))
    c = await collect(engine, group(prompt, n=3, max_new_tokens=16, seed=43, ignore_eos=True))
    assert a["tokens"] == b["tokens"] != c["tokens"]
    assert a["tokens"][0] != a["tokens"][1]


async def test_stop_strings_end_samples_with_reason_stop(engine):
    needs_model(engine)
    prompt = prompt_of(engine, "abc")
    # seeded, and 16 samples: about a third of unseeded 4-sample groups of the tiny model had no stop
    out = await collect(engine, group(prompt, n=16, max_new_tokens=60, seed=9, stop=("e",)))
    for i, done in out["done"].items():
        if done.reason == "stop":
            assert out["text"][i].endswith("e") and "e" not in out["text"][i][:-1]
        else:
            assert "e" not in out["text"][i]
    # the branch above is taken: a stop string ended a sample
    assert [d.reason for d in out["done"].values()].count("stop") >= 1, {i: out["text"][i] for i in out["text"]}


async def test_closing_the_stream_cancels_the_group(engine):
    prompt = prompt_of(engine, "cancel me")
    stream = engine.generate(group(prompt, n=4, max_new_tokens=200, ignore_eos=True))
    first = await anext(stream)
    assert first and await eventually(lambda: engine.stats().running == 1)
    await stream.aclose()
    assert await eventually(lambda: engine.stats().running == 0)  # the transformers worker drops rows next step
    out = await collect(engine, group(prompt, max_new_tokens=3, ignore_eos=True))
    assert out["done"][0].completion_tokens == 3
    double = getattr(engine, "double", None)
    if double is not None:  # the server stopped generating for the closed stream too
        assert double.idle.wait(10)
        with contextlib.suppress(AttributeError):
            assert all(c.path != "/abort_request" or c.body["rid"] for c in double.calls)


# Adapter tests last: the transformers engine cannot serve after its active adapter is deleted
# (see the xfail below), and the module-scoped engine is shared.
async def test_adapter_logprobs_equal_a_local_peft_model(engine, tiny_model):
    needs_model(engine)
    adapter = make_adapter(tiny_model, seed=7, r=8)
    await engine.load_adapter("c-load-1", manifest_for(adapter, "contract", 1), adapter.payload)
    try:
        reference = peft_reference(tiny_model, adapter)
        prompt = prompt_of(engine, "adapt")
        sel = AdapterSelection("contract", 1, "c-load-1")
        out = await collect(engine, group(prompt, n=3, adapter=sel, max_new_tokens=16))
        for i in range(3):
            assert out["versions"][i] == {1}
            expected = forward_logprobs(reference, prompt, out["tokens"][i])
            assert torch.allclose(torch.tensor(out["logprobs"][i]), expected, atol=1e-4)
        greedy = await collect(engine, group(prompt, adapter=sel, max_new_tokens=16, temperature=0.0, ignore_eos=True))
        base = await collect(engine, group(prompt, max_new_tokens=16, temperature=0.0, ignore_eos=True))
        assert greedy["tokens"][0] != base["tokens"][0]  # the adapter really changes the policy
    finally:
        await engine.unload_adapter("c-load-1")


async def test_a_published_version_is_proved_and_one_given_other_weights_is_refused(engine, tiny_model):
    """The proof (generator/proof.py) through each engine's own Score: an honest engine passes a
    signed probe of the publisher's PEFT numbers within its documented tolerance; the same engine
    given another file (the adapter's B matrices x 1.05) is refused with PROOF_FAILED. Every engine
    that runs a model scores (sglang: SGLang's prompt logprobs, here the double's real forward), so
    none of them serves a probed version "unsupported"."""
    needs_model(engine)
    scores = callable(getattr(engine, "score", None))  # engines/base.Scorer, as proof.py asks
    assert scores, f"the {engine.name} engine runs a model but cannot score, so cannot prove a version"
    adapter = make_adapter(tiny_model, seed=71, r=8, scale=0.1)  # small weights: float32 sums stay exact
    peft = peft_reference(tiny_model, adapter)
    seqs = [(prompt_of(engine, p), prompt_of(engine, c)) for p, c in (("12+34=", "46"), ("abc", "defgh"))]
    probe = probes.build_probe(seqs, [forward_logprobs(peft, p, c).tolist() for p, c in seqs])
    prover = Prover(engine, GeneratorMetrics(), trusted=True, replica="contract")
    honest = replace(manifest_for(adapter, "proof", 1), signer="publisher", probe=probe)
    await engine.load_adapter("c-proof-1", honest, adapter.payload)
    try:
        await prover.prove("c-proof-1", honest)
    finally:
        await engine.unload_adapter("c-proof-1")
    proof = prover.proofs[("proof", 1)]
    assert proof.outcome == probes.PASSED and proof.max_abs_gap <= probes.DEFAULT_TOLERANCES[engine.name]
    tensors = load_safetensors(adapter.payload)
    other = save_safetensors({k: v * 1.05 if "lora_B" in k else v for k, v in tensors.items()})
    wrong = replace(honest, version=2)
    await engine.load_adapter("c-proof-2", wrong, other)
    try:
        with pytest.raises(FailedPrecondition) as refused:
            await prover.prove("c-proof-2", wrong)
    finally:
        await engine.unload_adapter("c-proof-2")
    assert refused.value.reason == Reason.PROOF_FAILED and "contract" in refused.value.message
    assert prover.proofs[("proof", 2)].max_abs_gap > 4 * proof.tolerance  # 2e-2 and more, measured


async def test_unload_then_load_a_new_version(engine, tiny_model):
    needs_model(engine)
    a1, a2 = make_adapter(tiny_model, seed=11, r=4), make_adapter(tiny_model, seed=12, r=4)
    await engine.load_adapter("c-uv-1", manifest_for(a1, "cycle", 1), a1.payload)
    await engine.unload_adapter("c-uv-1")
    await engine.load_adapter("c-uv-2", manifest_for(a2, "cycle", 2), a2.payload)
    try:
        prompt = prompt_of(engine, "again")
        out = await collect(engine, group(prompt, adapter=AdapterSelection("cycle", 2, "c-uv-2"), max_new_tokens=8))
        assert out["versions"][0] == {2}
        expected = forward_logprobs(peft_reference(tiny_model, a2), prompt, out["tokens"][0])
        assert torch.allclose(torch.tensor(out["logprobs"][0]), expected, atol=1e-4)
    finally:
        await engine.unload_adapter("c-uv-2")


async def test_transformers_engine_survives_a_push_whose_caller_went_away(tiny_model):
    """A learner killed mid-push cancels the load's future; the worker must skip it and go on."""
    from concurrent.futures import Future

    from rollwire.generator.engines.embedded.transformers_engine import TransformersEngine

    engine = TransformersEngine(tiny_model, threads=1)
    await engine.start()
    try:
        adapter = make_adapter(tiny_model, seed=41, r=4)
        gone: Future = Future()
        gone.cancel()
        engine._apply_ops([(gone, ("load", "gone-1", manifest_for(adapter, "gone", 1), {}))])
        await engine.load_adapter("kept-1", manifest_for(adapter, "kept", 1), adapter.payload)
        out = await collect(
            engine,
            group(
                prompt_of(engine, "alive"),
                adapter=AdapterSelection("kept", 1, "kept-1"),
                max_new_tokens=4,
                ignore_eos=True,
            ),
        )
        assert out["done"][0].completion_tokens == 4
    finally:
        await engine.close()


pytestmark = pytest.mark.integration  # starts processes or servers: not in make test-fast
