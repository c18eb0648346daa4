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

import torch  # noqa: E402
from support.engines import collect, forward_logprobs, manifest_for  # noqa: E402
from support.wire import make_adapter, peft_reference  # noqa: E402

from rollwire.generator.adapters import AdapterRegistry  # noqa: E402
from rollwire.generator.engines.served.sglang_engine import SGLangEngine  # noqa: E402
from rollwire.generator.engines.settings import SGLangSection  # noqa: E402
from rollwire.generator.types import AdapterSelection, GroupRequest, SamplingParams  # noqa: E402

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
