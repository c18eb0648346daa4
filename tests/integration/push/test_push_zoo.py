"""Pushes of what PEFT writes for real architectures, through a proxy (issue 49, item 2): one
replica of the zoo's gpt2 (GPT-2's Conv1D layers, PEFT's fan_in_fan_out; rollwire.demo.zoo)
behind a proxy, which checks every push against the layers its replica reported in GetStatus,
derived from the model's own modules (generator/shapes.py): the replica's rule and the proxy's
are one.

- PEFT's all-linear adapter, with a rank_pattern, is accepted by the proxy and the replica and
  served as its PeftModel computes it (within 1e-4), where before the proxy refused it
  ("c_attn.lora_A.weight has shape [8, 64]; the base model and r=8 need [8, 192]");
- an adapter with modules_to_save is refused at the proxy by name, and the replica keeps serving.
The engine's numbers over every architecture: tests/unit/generator/test_zoo_models.py.
"""

from __future__ import annotations

import grpc
import pytest
import torch
from support.engines import forward_logprobs
from support.processes import start_generators, start_proxy, stop_all, wait_routable
from support.wire import fingerprint, generate, push
from support.zoo import peft_adapter

from rollwire.demo.zoo import build_model
from rollwire.v1 import generator_pb2 as pb

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def fleet(workdir):
    model = build_model("gpt2", workdir / "gpt2")
    gens = start_generators(model, workdir, ["g1"])
    proxy = start_proxy(workdir, "gp", gens)
    try:
        wait_routable(proxy, gens)
        yield proxy, model
    finally:
        stop_all([proxy, *gens])


def manifest(adapter, target: str, name: str, version: int) -> pb.AdapterManifest:
    m = adapter.manifest(name, version)
    return pb.AdapterManifest(
        name=name,
        version=version,
        base_model_fingerprint=fingerprint(target),
        lora_config=m.lora.to_pb(),
        byte_length=m.byte_length,
        sha256=m.sha256,
    )


def test_a_conv1d_adapter_with_a_rank_pattern_is_pushed_through_the_proxy_and_served_exactly(fleet):
    proxy, model = fleet
    adapter = peft_adapter(model, seed=8, target_modules="all-linear", rank_pattern={"c_attn": 4}, fan_in_fan_out=True)
    push(proxy.target, manifest(adapter, proxy.target, "gpt2-lora", 1), adapter.payload)
    prompt = list(range(20, 40))
    got = generate(proxy.target, prompt, n=3, adapter=("gpt2-lora", 1), seed=4, max_new_tokens=16, temperature=1.0)
    with torch.no_grad():
        for i, ids in got.tokens.items():
            want = forward_logprobs(adapter.model, prompt, ids)
            assert (torch.tensor(got.logprobs[i]) - want).abs().max() < 1e-4, i
        with adapter.model.disable_adapter():
            base = forward_logprobs(adapter.model, prompt, got.tokens[0])
        assert (forward_logprobs(adapter.model, prompt, got.tokens[0]) - base).abs().max() > 1e-2


def test_modules_to_save_is_refused_at_the_proxy_by_name(fleet):
    proxy, model = fleet
    adapter = peft_adapter(model, seed=9, target_modules=["c_attn"], modules_to_save=["lm_head"], fan_in_fan_out=True)
    with pytest.raises(grpc.RpcError) as err:
        push(proxy.target, manifest(adapter, proxy.target, "gpt2-saved", 1), adapter.payload)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "modules_to_save" in (err.value.details() or "") and "lm_head" in (err.value.details() or "")
    assert generate(proxy.target, [20, 21, 22], n=1, seed=1, max_new_tokens=4).finished  # still serving
