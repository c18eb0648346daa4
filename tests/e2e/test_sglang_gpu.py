"""The sglang engine against a REAL SGLang server on a GPU (marked `gpu`).

Skipped, with the reason, unless the `sglang` package and a CUDA device are present:
run it in the SGLang environment (`pip install 'rollwire[sglang]'`, see docs/engines.md),
    pytest -m gpu tests/e2e/test_sglang_gpu.py
The tiny model runs in float32 with SGLang's torch-native attention so the logprobs can be
held to a teacher-forced pass of the same weights; tolerances are looser than the double's
because SGLang's kernels accumulate in a different order.
"""

from __future__ import annotations

import importlib.util
import itertools

import pytest
import pytest_asyncio

pytestmark = pytest.mark.gpu


def _why_skip() -> str | None:
    if importlib.util.find_spec("sglang") is None:
        return "sglang is not installed: install rollwire[sglang] in its own environment (docs/engines.md)"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device: SGLang needs a GPU"
    return None


if (_reason := _why_skip()) is not None:
    pytest.skip(_reason, allow_module_level=True)

import dataclasses  # noqa: E402

import torch  # noqa: E402
from safetensors.torch import load as load_safetensors  # noqa: E402
from safetensors.torch import save as save_safetensors  # noqa: E402
from support.engines import collect, forward_logprobs, manifest_for  # noqa: E402
from support.wire import make_adapter, peft_reference  # noqa: E402

from rollwire.common import probe as probes  # noqa: E402
from rollwire.common.errors import FailedPrecondition  # noqa: E402
from rollwire.common.reasons import Reason  # noqa: E402
from rollwire.generator.adapters import AdapterRegistry  # noqa: E402
from rollwire.generator.engines.served.sglang_engine import SGLangEngine  # noqa: E402
from rollwire.generator.engines.settings import SGLangSection  # noqa: E402
from rollwire.generator.metrics import GeneratorMetrics  # noqa: E402
from rollwire.generator.proof import Prover  # noqa: E402
from rollwire.generator.types import AdapterSelection, GroupRequest, SamplingParams, ScoreJob  # noqa: E402

ATOL = 2e-3
_ids = itertools.count()


@pytest_asyncio.fixture(scope="module")
async def engine(tiny_model, tmp_path_factory):
    settings = SGLangSection(
        adapter_dir=str(tmp_path_factory.mktemp("sglang-gpu")),
        max_lora_rank=16,
        lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        deterministic=True,
        startup_timeout_s=900,
        extra_args=[
            "--dtype",
            "float32",
            "--attention-backend",
            "torch_native",
            "--disable-cuda-graph",
            "--mem-fraction-static",
            "0.3",
            "--lora-backend",
            "triton",
        ],
    )
    eng = SGLangEngine(tiny_model, settings, adapter_window=2)
    await eng.start()
    yield eng
    await eng.close()


def group(prompt, n=1, adapter=None, **sampling) -> GroupRequest:
    sampling.setdefault("max_new_tokens", 16)
    return GroupRequest(f"gpu{next(_ids)}", list(prompt), n, SamplingParams(**sampling), adapter or AdapterSelection())


async def test_real_sglang_reports_its_version(engine):
    assert engine.server_version, "SGLang's /server_info had no version"
    assert engine.honours_seeds


async def test_base_logprobs_match_a_teacher_forced_pass(engine, reference_model):
    prompt = engine.tokenize("The cat sat")
    out = await collect(engine, group(prompt, n=4, max_new_tokens=24))
    assert sorted(out["done"]) == [0, 1, 2, 3]
    for i in range(4):
        expected = forward_logprobs(reference_model, prompt, out["tokens"][i])
        assert torch.allclose(torch.tensor(out["logprobs"][i]), expected, atol=ATOL), i


async def test_seeded_groups_reproduce_on_real_sglang(engine):
    prompt = engine.tokenize("seeded")
    a = await collect(engine, group(prompt, n=3, seed=7, ignore_eos=True))
    b = await collect(engine, group(prompt, n=3, seed=7, ignore_eos=True))
    assert a["tokens"] == b["tokens"] and a["tokens"][0] != a["tokens"][1]


async def test_pushed_adapter_versions_serve_and_retire(engine, tiny_model):
    registry = AdapterRegistry(engine.load_adapter, engine.unload_adapter, window=2)
    adapters = {v: make_adapter(tiny_model, seed=70 + v, r=8) for v in (1, 2, 3)}
    for v in (1, 2, 3):
        await registry.push(manifest_for(adapters[v], "gpu", v), adapters[v].payload)
    await registry.settle()
    assert registry.loaded() == {"gpu": [2, 3]} and len(engine._adapters) == 2
    sel = registry.acquire("gpu", 3)
    try:
        prompt = engine.tokenize("adapt")
        out = await collect(engine, group(prompt, n=2, adapter=sel))
        reference = peft_reference(tiny_model, adapters[3])
        for i in range(2):
            assert out["versions"][i] == {3}
            expected = forward_logprobs(reference, prompt, out["tokens"][i])
            assert torch.allclose(torch.tensor(out["logprobs"][i]), expected, atol=ATOL)
    finally:
        registry.release(sel)


async def test_closing_a_stream_aborts_it_on_real_sglang(engine):
    prompt = engine.tokenize("cancel")
    stream = engine.generate(group(prompt, n=4, max_new_tokens=200, ignore_eos=True))
    await anext(stream)
    await stream.aclose()
    assert engine.stats().running == 0
    out = await collect(engine, group(prompt, max_new_tokens=3, ignore_eos=True))
    assert out["done"][0].completion_tokens == 3


async def test_real_sglang_scores_and_proves_a_version_and_refuses_other_weights(engine, tiny_model, reference_model):
    """Score through real SGLang's prompt logprobs (/generate, max_new_tokens 0, logprob_start_len,
    meta_info.input_token_logprobs) against a teacher-forced pass, then a version's proof: the
    publisher's PEFT numbers pass; the same engine given another file (B x 1.05) is refused
    PROOF_FAILED. Held to ATOL, the tolerance this file holds SGLang's kernels to; the served
    default (1e-3) is what the double and vLLM in float32 meet: the honest gap is printed."""
    seqs = ((tuple(engine.tokenize("The cat")), tuple(engine.tokenize(" sat on"))), ((5, 6), (7, 8, 9)))
    base = await engine.score(ScoreJob("gpu-score", seqs))
    for (prompt, continuation), got in zip(seqs, base, strict=True):
        want = forward_logprobs(reference_model, list(prompt), list(continuation))
        assert torch.allclose(torch.tensor(got.logprobs), want, atol=ATOL)
    adapter = make_adapter(tiny_model, seed=71, r=8, scale=0.1)
    peft = peft_reference(tiny_model, adapter)
    probe = probes.build_probe(list(seqs), [forward_logprobs(peft, list(p), list(c)).tolist() for p, c in seqs])
    prover = Prover(engine, GeneratorMetrics(), tolerance=ATOL, trusted=True, replica="gpu")
    honest = dataclasses.replace(manifest_for(adapter, "gpu-proof", 1), signer="publisher", probe=probe)
    await engine.load_adapter("gpu-proof-1", honest, adapter.payload)
    try:
        await prover.prove("gpu-proof-1", honest)
    finally:
        await engine.unload_adapter("gpu-proof-1")
    proof = prover.proofs[("gpu-proof", 1)]
    print(
        f"real SGLang's honest proof gap: {proof.max_abs_gap:.3g} (served default {probes.DEFAULT_TOLERANCES['sglang']})"
    )
    assert proof.outcome == probes.PASSED
    other = save_safetensors(
        {k: v * 1.05 if "lora_B" in k else v for k, v in load_safetensors(adapter.payload).items()}
    )
    wrong = dataclasses.replace(honest, version=2)
    await engine.load_adapter("gpu-proof-2", wrong, other)
    try:
        with pytest.raises(FailedPrecondition) as refused:
            await prover.prove("gpu-proof-2", wrong)
    finally:
        await engine.unload_adapter("gpu-proof-2")
    assert refused.value.reason == Reason.PROOF_FAILED
