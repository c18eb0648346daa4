"""A push to a scripted replica and a generation from it (a real process, config-only model)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save

from rollwire.client import Client
from rollwire.common.errors import InvalidArgument
from rollwire.common.fingerprint import model_fingerprint
from rollwire.common.lora import LoraShape
from rollwire.generator.shapes import config_linear_shapes
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


def lora_payload(shapes: dict[str, tuple[int, int]]) -> bytes:
    rng = np.random.default_rng(0)
    return save({k: rng.standard_normal(s).astype(np.float16) for k, s in shapes.items()})


@pytest.mark.integration  # starts a replica process
def test_push_and_generate_on_a_scripted_replica(tmp_path):
    from support.processes import start_generator

    model = tmp_path / "qwen-0.5b-config"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN_05B))
    gen = start_generator(model, tmp_path, "scripted", "--set", "engine=scripted", "--set", "scripted.tokens_per_s=0")
    try:
        with Client(gen.target, timeout=60) as c:
            status = c.get_status()
            assert status.engine == "scripted" and status.model_fingerprint == model_fingerprint(
                model, config_only=True
            )
            lora = {"r": 4, "lora_alpha": 8, "target_modules": list(ALL_LINEAR)}
            shapes = expected_lora_shapes(LoraShape(4, 8, ALL_LINEAR), config_linear_shapes(QWEN_05B))
            payload = lora_payload(shapes)
            assert len(payload) > 3 << 20  # several 1 MiB chunks
            c.push_adapter("policy", 1, payload, lora, status.model_fingerprint, chunk_size=1 << 20)
            result = c.generate([5, 6], n=3, max_new_tokens=4, seed=7, adapter="policy@1")
            assert {s.adapter_version for s in result.samples} == {1}
            assert [len(s.token_ids) for s in result.samples] == [4, 4, 4]
            with pytest.raises(InvalidArgument, match="missing"):
                c.push_adapter(
                    "policy", 2, lora_payload(dict(list(shapes.items())[:-1])), lora, status.model_fingerprint
                )
            assert [a.versions for a in c.get_status().adapters] == [[1]]
    finally:
        gen.stop()
