"""Following the newest version mid-generation (AdapterRef.follow) on a real replica.

Independent computation: a PEFT model holding both versions, decoding the sample's own
tokens step by step with the KV cache it actually had (the prompt and the tokens before the
switch computed under the first version, each later step under the version that produced
its token), as PipelineRL's in-flight updates define it.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from support.wire import fingerprint, make_adapter, push

from rollwire.client import Client, Finished, Restarted, Tokens
from rollwire.client import InvalidArgument as SdkInvalidArgument

pytestmark = pytest.mark.integration
PROMPT = [5, 17, 33, 40, 12]


def two_version_model(tiny_model, adapters):
    """The base model with each adapter loaded under its version's name ("v1", "v2", ...)."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    model = None
    for version, adapter in adapters.items():
        config = LoraConfig(r=adapter.r, lora_alpha=adapter.lora_alpha, target_modules=list(adapter.targets))
        if model is None:
            model = get_peft_model(base, config, adapter_name=f"v{version}")
        else:
            model.add_adapter(f"v{version}", config)
        set_peft_model_state_dict(model, adapter.state_dict, adapter_name=f"v{version}")
    assert model is not None
    return model.eval()


def replayed_logprobs(model, prompt: list[int], tokens: list[list[int]], versions: list[int]) -> list[list[float]]:
    """Each sample's token logprobs from a step-by-step decode of all the samples together,
    as the replica batches them (one prompt prefill shared by every row), step i running
    under versions[i] (a group's rows switch together)."""
    rows = len(tokens)
    out: list[list[float]] = [[] for _ in range(rows)]
    with torch.no_grad():
        model.set_adapter(f"v{versions[0]}")
        step = model(input_ids=torch.tensor([prompt]), use_cache=True)
        cache = step.past_key_values
        cache.batch_repeat_interleave(rows)
        logits = step.logits[:, -1].float().repeat_interleave(rows, 0)
        for i in range(len(tokens[0])):
            logprobs = torch.log_softmax(logits, -1)
            for r in range(rows):
                out[r].append(float(logprobs[r, tokens[r][i]]))
            if i + 1 < len(tokens[0]):
                model.set_adapter(f"v{versions[i + 1]}")
                ids = torch.tensor([[tokens[r][i]] for r in range(rows)])
                step = model(input_ids=ids, past_key_values=cache, use_cache=True)
                cache, logits = step.past_key_values, step.logits[:, -1].float()
    return out


def test_a_following_sample_switches_version_mid_generation_with_its_kv_cache(generator, tiny_model):
    name = "follow-mid"
    fp = fingerprint(generator.target)
    adapters = {v: make_adapter(tiny_model, seed=40 + v, r=2) for v in (1, 2)}
    push(generator.target, adapters[1].manifest(name, 1, fp), adapters[1].payload)
    first_tokens = threading.Event()

    def push_v2() -> None:
        assert first_tokens.wait(30)
        push(generator.target, adapters[2].manifest(name, 2, fp), adapters[2].payload)

    tokens: dict[int, list[int]] = {}
    logprobs: dict[int, list[float]] = {}
    versions: dict[int, list[int]] = {}
    with Client(generator.target, timeout=60) as client, ThreadPoolExecutor(1) as pool:
        pushed = pool.submit(push_v2)
        stream = client.generate_stream(
            PROMPT, 4, max_new_tokens=40, ignore_eos=True, seed=3, adapter=f"{name}@latest", follow=True
        )
        for event in stream:
            assert not isinstance(event, Restarted)
            if isinstance(event, Tokens):
                first_tokens.set()
                # a chunk holds one version by the wire format (TokenChunk.adapter_version is one
                # field); that versions only move forward, per token, is checked below
                tokens.setdefault(event.index, []).extend(event.token_ids)
                logprobs.setdefault(event.index, []).extend(event.logprobs)
                versions.setdefault(event.index, []).extend([event.adapter_version] * len(event.token_ids))
            elif isinstance(event, Finished):
                assert event.completion_tokens == 40
        pushed.result()
    reference = two_version_model(tiny_model, adapters)
    assert all(versions[i] == versions[0] for i in range(4)), "a group's rows switch at the same step"
    expected = replayed_logprobs(reference, PROMPT, [tokens[i] for i in range(4)], versions[0])
    switched = 0
    for i in range(4):
        v = versions[i]
        assert v == sorted(v) and set(v) <= {1, 2}, "versions only move forward"
        switched += set(v) == {1, 2}
        assert logprobs[i] == pytest.approx(expected[i], abs=1e-4)
    assert switched == 4, (
        f"every sample should hold tokens of both versions: {[sorted(set(v)) for v in versions.values()]}"
    )


def test_follow_needs_a_name_and_the_newest_version(generator):
    with Client(generator.target, timeout=30) as client:
        with pytest.raises(SdkInvalidArgument):
            client.generate(PROMPT, 1, max_new_tokens=2, adapter="x@3", follow=True)  # refused by the SDK
    from support.wire import stub

    from rollwire.v1 import generator_pb2 as pb

    request = pb.GenerateRequest(
        n=1, sampling=pb.SamplingParams(max_new_tokens=2), adapter=pb.AdapterRef(name="x", version=3, follow=True)
    )
    request.token_ids.ids.extend(PROMPT)
    import grpc

    with pytest.raises(grpc.RpcError) as err:
        list(stub(generator.target).Generate(request, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "follow" in (err.value.details() or "")


def test_a_push_storm_aborts_no_following_sample(generator, tiny_model):
    """Ten versions land while 32 following groups generate: none is aborted or restarted,
    every sample's versions only move forward, and later samples reach the newer versions."""
    name = "follow-storm"
    fp = fingerprint(generator.target)
    adapters = [make_adapter(tiny_model, seed=60 + v, r=2) for v in range(11)]
    push(generator.target, adapters[0].manifest(name, 1, fp), adapters[0].payload)
    started = threading.Barrier(33, timeout=60)

    def one(seed: int) -> list[list[int]]:
        with Client(generator.target, timeout=120) as client:
            out: dict[int, list[int]] = {}
            stream = client.generate_stream(
                PROMPT, 2, max_new_tokens=60, ignore_eos=True, seed=seed, adapter=f"{name}@latest", follow=True
            )
            waited = False
            for event in stream:
                assert not isinstance(event, Restarted)
                if isinstance(event, Tokens):
                    out.setdefault(event.index, []).extend([event.adapter_version] * len(event.token_ids))
                    if not waited:
                        waited = True
                        started.wait()
            return [out[i] for i in range(2)]

    with ThreadPoolExecutor(33) as pool:
        runs = [pool.submit(one, s) for s in range(32)]
        started.wait()
        for v in range(2, 12):
            push(generator.target, adapters[v - 1].manifest(name, v, fp), adapters[v - 1].payload)
        samples = [s for r in runs for s in r.result()]
    assert len(samples) == 64 and all(len(s) == 60 for s in samples)
    assert all(s == sorted(s) for s in samples)
    assert max(s[-1] for s in samples) > 1, "no sample reached a newer version"
