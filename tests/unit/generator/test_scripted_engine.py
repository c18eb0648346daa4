"""The scripted benchmark engine and config-only model folders, in-process. A push to a
scripted replica: tests/integration/generator/test_scripted_replica.py."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from rollwire.common.fingerprint import model_fingerprint
from rollwire.common.lora import LoraShape
from rollwire.common.manifest import Manifest
from rollwire.common.safetensors_header import read_file_header
from rollwire.generator.engines.embedded.scripted import ScriptedEngine
from rollwire.generator.shapes import base_linear_shapes, config_linear_shapes
from rollwire.generator.types import AdapterSelection, GroupRequest, SampleDone, SamplingParams, TokenDelta
from rollwire.push.checks import expected_lora_shapes

QWEN_05B = {  # the public config.json of Qwen2.5-0.5B, the fields the shapes need
    "model_type": "qwen2",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
}
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def group(n=4, tokens=6, seed=1, version=0) -> GroupRequest:
    return GroupRequest(
        "t", [1, 2, 3], n, SamplingParams(max_new_tokens=tokens, seed=seed), AdapterSelection("a", version, None)
    )


async def engine_for(tmp_path, **kw) -> ScriptedEngine:
    (tmp_path / "config.json").write_text(json.dumps(QWEN_05B))
    eng = ScriptedEngine(tmp_path, **kw)
    await eng.start()
    return eng


async def run(eng, g) -> list[list]:
    return [events async for events in eng.generate(g)]


async def test_samples_advance_together_with_deterministic_tokens(tmp_path):
    eng = await engine_for(tmp_path, tokens_per_s=0, logprob=-0.5)
    steps = await run(eng, group(n=4, tokens=6, version=3))
    assert len(steps) == 6
    for k, events in enumerate(steps):
        deltas = [e for e in events if isinstance(e, TokenDelta)]
        assert [d.sample_index for d in deltas] == [0, 1, 2, 3]
        assert all(d.token_ids == [eng.token(1, d.sample_index, k)] and d.logprobs == [-0.5] for d in deltas)
        assert all(d.version == 3 and len(d.text) == 1 for d in deltas)
    done = [e for e in steps[-1] if isinstance(e, SampleDone)]
    assert [(d.sample_index, d.reason, d.prompt_tokens, d.completion_tokens) for d in done] == [
        (i, "length", 3, 6) for i in range(4)
    ]
    assert await run(eng, group(n=4, tokens=6)) == [
        [TokenDelta(e.sample_index, e.token_ids, e.logprobs, e.text, 0) if isinstance(e, TokenDelta) else e for e in s]
        for s in steps
    ]
    assert all(0 <= t < eng.vocab_size for t in eng.tokenize("héllo"))
    assert (eng.vocab_size, eng.max_context) == (151936, 32768)


async def test_rate_is_kept_and_a_slow_reader_gets_due_tokens_together(tmp_path):
    eng = await engine_for(tmp_path, tokens_per_s=200)
    start = time.monotonic()
    steps = await run(eng, group(n=2, tokens=11))
    assert time.monotonic() - start >= 10 / 200 * 0.9  # token k is due at k / rate
    assert sum(len(s[0].token_ids) for s in steps) == 11

    slow = []
    async for events in eng.generate(group(n=2, tokens=11)):
        slow.append(events)
        await asyncio.sleep(0.02)  # 4 tokens' worth per read
    assert len(slow) < 11 and sum(len(s[0].token_ids) for s in slow) == 11


async def test_concurrency_limit_queues_and_closing_frees_the_slot(tmp_path):
    eng = await engine_for(tmp_path, tokens_per_s=50, max_concurrent_groups=1)
    first = eng.generate(group(tokens=100))
    await first.__anext__()
    waiting = asyncio.create_task(run(eng, group(tokens=2)))
    await asyncio.sleep(0.05)
    assert (eng.stats().running, eng.stats().queued) == (1, 1)
    await first.aclose()  # cancels the first group
    assert len(await asyncio.wait_for(waiting, 5)) >= 1
    assert (eng.stats().running, eng.stats().queued) == (0, 0)


async def test_adapters_are_bookkeeping_only(tmp_path):
    eng = await engine_for(tmp_path)
    m = Manifest("a", 2, "fp", LoraShape(16, 32, ALL_LINEAR), 10, "0" * 64)
    await eng.load_adapter("rw1", m, b"0123456789")
    assert eng.adapters == {"rw1": 2}
    await eng.unload_adapter("rw1")
    assert eng.adapters == {}


def test_config_shapes_equal_the_weight_headers(tiny_model):
    from_headers = base_linear_shapes(tiny_model)
    config = json.loads((tiny_model / "config.json").read_text())
    assert config_linear_shapes(config) == from_headers
    names = {n for path in tiny_model.glob("*.safetensors") for n in read_file_header(path)}
    assert {f"{m}.weight" for m in from_headers} <= names


def test_qwen_config_gives_the_reference_lora_size():
    shapes = expected_lora_shapes(LoraShape(16, 32, ALL_LINEAR), config_linear_shapes(QWEN_05B))
    assert len(shapes) == 24 * 7 * 2
    assert sum(a * b for a, b in shapes.values()) * 2 == 17_596_416  # bf16: the 17.6 MB of FACTS.md
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        config_linear_shapes({"model_type": "gpt2"})


def test_config_only_folders_need_the_flag(tmp_path, tiny_model):
    (tmp_path / "config.json").write_text(json.dumps(QWEN_05B))
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        model_fingerprint(tmp_path)
    assert base_linear_shapes(tmp_path) == {}
    assert len(base_linear_shapes(tmp_path, config_only=True)) == 24 * 7
    fp = model_fingerprint(tmp_path, config_only=True)
    assert fp.startswith("sha256:") and fp == model_fingerprint(tmp_path, config_only=True)
    assert model_fingerprint(tiny_model, config_only=True) == model_fingerprint(tiny_model)
