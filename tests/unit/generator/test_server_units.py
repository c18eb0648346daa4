"""Pure parts of the generator: the sampling transform, coalescing, adapter checks, the registry."""

from __future__ import annotations

import hashlib
import math
import random

import numpy as np
import pytest
import torch
from safetensors.numpy import save

from rollwire.common.errors import FailedPrecondition, InvalidArgument, NotFound
from rollwire.common.lora import LoraShape
from rollwire.common.manifest import Manifest, check_manifest
from rollwire.generator.adapters import AdapterRegistry
from rollwire.generator.sampling import draw, sample_generator, sample_seed, sampling_logprobs
from rollwire.generator.types import SampleDone, SamplingParams, TokenDelta, coalesce
from rollwire.push.checks import check_payload, expected_lora_shapes


def test_top_k_and_top_p_by_hand():
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.15), math.log(0.05)]])
    # top_p=0.75: keep 0.5 and 0.3 (mass before the third token is 0.8 >= 0.75), renormalise.
    lp = sampling_logprobs(logits, SamplingParams(1, top_p=0.75)).exp()[0]
    assert torch.allclose(lp, torch.tensor([0.625, 0.375, 0.0, 0.0]), atol=1e-6)
    # top_k=3 then renormalise over 0.95.
    lp = sampling_logprobs(logits, SamplingParams(1, top_k=3)).exp()[0]
    assert torch.allclose(lp, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95, atol=1e-6)
    # temperature 2: softmax(log p / 2) is proportional to sqrt(p).
    lp = sampling_logprobs(logits, SamplingParams(1, temperature=2.0)).exp()[0]
    root = torch.tensor([0.5, 0.3, 0.15, 0.05]).sqrt()
    assert torch.allclose(lp, root / root.sum(), atol=1e-6)
    # top_p smaller than the top token's mass keeps exactly that token.
    lp = sampling_logprobs(logits, SamplingParams(1, top_p=0.1)).exp()[0]
    assert torch.allclose(lp, torch.tensor([1.0, 0, 0, 0]))


def test_greedy_reports_untempered_logprob_and_draw_is_seeded():
    logits = torch.tensor([[0.0, 2.0, 1.0]])
    params = SamplingParams(1, temperature=0.0)
    lp = sampling_logprobs(logits, params)
    assert int(draw(lp, params, [random.Random(0)])[0]) == 1
    assert torch.allclose(lp, torch.log_softmax(logits, -1))
    params = SamplingParams(1)
    lp = sampling_logprobs(torch.zeros(1, 50), params)
    a = [int(draw(lp, params, [sample_generator(7, 0)])[0]) for _ in range(3)]
    assert len(set(a)) == 1
    assert sample_seed(7, 0) != sample_seed(7, 1) != sample_seed(8, 0)


def test_per_sample_seeds_are_the_documented_numbers():
    """docs/protocol.md's literal examples of `(s * 1000003 + i) mod (2^63 - 1)` and of the
    continuation seed, so neither the code nor the docs can drift alone (the engines' seed
    tests compare against sample_seed itself)."""
    from rollwire.generator.engines.served.follow import continuation_seed

    assert sample_seed(42, 3) == 42000129
    assert sample_seed(2**64 - 1, 0) == 1000003  # mod 2^63 would give 9223372036853775805
    assert sample_seed(2**63, 5) == 1000008  # mod 2^63 would give 5
    assert continuation_seed(42, 3, 10) == 42000255000398
    assert random.Random(sample_seed(42, 3)).random() == sample_generator(42, 3).random()


def test_coalesce_merges_per_sample_and_keeps_finish_last():
    events = [
        TokenDelta(0, [1], [-0.1], "a", 2),
        TokenDelta(1, [5], [-0.5], "x", 2),
        TokenDelta(0, [2], [-0.2], "b", 2),
        SampleDone(0, "length", 3, 2),
        TokenDelta(1, [6], [-0.6], "y", 2),
    ]
    out = coalesce(events)
    assert out[0] == TokenDelta(0, [1, 2], [-0.1, -0.2], "ab", 2)
    assert out[1] == TokenDelta(1, [5, 6], [-0.5, -0.6], "xy", 2)
    assert out[2] == SampleDone(0, "length", 3, 2)


BASE = {"model.layers.0.self_attn.q_proj": (64, 32), "model.layers.0.mlp.down_proj": (32, 128)}


def lora_payload(r: int, shapes=BASE, drop: str | None = None) -> bytes:
    tensors = {}
    for module, (out_f, in_f) in shapes.items():
        tensors[f"base_model.model.{module}.lora_A.weight"] = np.zeros((r, in_f), np.float32)
        tensors[f"base_model.model.{module}.lora_B.weight"] = np.zeros((out_f, r), np.float32)
    tensors.pop(drop, None)
    return save(tensors)


def manifest(payload: bytes, r=4, targets=("q_proj", "down_proj"), **kw) -> Manifest:
    fields = dict(
        name="a",
        version=1,
        base_model_fingerprint="fp",
        lora=LoraShape(r, 8.0, targets),
        byte_length=len(payload),
        sha256=hashlib.sha256(payload).hexdigest(),
    )
    fields.update(kw)
    return Manifest(**fields)


def test_expected_shapes_follow_peft_matching():
    lora = LoraShape(4, 8.0, ("q_proj",))
    assert expected_lora_shapes(lora, BASE) == {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": (4, 32),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": (64, 4),
    }
    assert len(expected_lora_shapes(LoraShape(4, 8.0, ("all-linear",)), BASE)) == 4
    assert expected_lora_shapes(LoraShape(4, 8.0, ("proj",)), BASE) == {}  # suffix match is per dotted name


def test_payload_checks():
    good = lora_payload(4)
    check_payload(manifest(good), good, BASE)
    with pytest.raises(InvalidArgument, match="shape"):
        check_payload(manifest(good, r=8), good, BASE)
    missing = lora_payload(4, drop="base_model.model.model.layers.0.mlp.down_proj.lora_B.weight")
    with pytest.raises(InvalidArgument, match="1 missing"):
        check_payload(manifest(missing), missing, BASE)
    with pytest.raises(InvalidArgument, match="match no linear layer"):
        check_payload(manifest(good, targets=("nothing",)), good, BASE)
    with pytest.raises(InvalidArgument, match="truncated"):
        check_payload(manifest(good), good[:-4], BASE)


def test_manifest_checks():
    good = lora_payload(4)
    check_manifest(manifest(good), fingerprint="fp", max_bytes=1 << 20)
    with pytest.raises(FailedPrecondition, match="base model"):
        check_manifest(manifest(good), fingerprint="other", max_bytes=1 << 20)
    with pytest.raises(InvalidArgument, match="version"):
        check_manifest(manifest(good, version=0), fingerprint="fp", max_bytes=1 << 20)
    with pytest.raises(Exception, match="exceeds"):
        check_manifest(manifest(good), fingerprint="fp", max_bytes=10)


class EngineLog:
    """Records the engine calls the registry makes (the registry is what is under test)."""

    def __init__(self):
        self.calls: list[tuple[str, str]] = []

    async def load(self, handle, manifest, payload):
        self.calls.append(("load", handle))

    async def unload(self, handle):
        self.calls.append(("unload", handle))


async def test_registry_window_leases_and_handles():
    engine = EngineLog()
    reg = AdapterRegistry(engine.load, engine.unload, window=2)
    payload = lora_payload(4)

    def m(v, data=payload):
        return manifest(data, version=v)

    assert not (await reg.push(m(1), payload)).already_loaded
    held = reg.acquire("a", 1)  # a request pinned to v1 is running
    await reg.push(m(2), payload)
    assert (await reg.push(m(2), payload)).already_loaded
    await reg.push(m(3), payload)  # v1 leaves the window but is still in use
    await reg.settle()
    assert reg.loaded() == {"a": [2, 3]}
    assert ("unload", held.handle) not in engine.calls
    with pytest.raises(FailedPrecondition, match="older than the 2 newest versions this replica keeps"):
        reg.acquire("a", 1)
    reg.release(held)  # the last request on v1 ends: now it is unloaded
    await reg.settle()
    assert ("unload", held.handle) in engine.calls
    handles = [h for op, h in engine.calls if op == "load"]
    assert len(handles) == len(set(handles)) == 3  # never reused
    with pytest.raises(FailedPrecondition, match="only increase"):
        await reg.push(m(1), payload)
    with pytest.raises(NotFound):
        reg.acquire("a", 7)
    with pytest.raises(NotFound):
        reg.acquire("b", 0)
    assert reg.acquire("a", 0).version == 3


async def test_the_window_is_a_cache_of_the_versions_a_caller_may_name():
    """window 2 loaded, keep 4 servable: an older kept version is loaded again (a fresh
    handle) when taken and unloaded when its last request ends; beyond keep it is gone;
    beyond keep_bytes the oldest outside the window go first."""
    engine = EngineLog()
    payload = lora_payload(4)
    reg = AdapterRegistry(engine.load, engine.unload, window=2, keep=4, keep_bytes=10 * len(payload))
    for v in range(1, 6):
        await reg.push(manifest(payload, version=v), payload)
    await reg.settle()
    assert reg.loaded() == {"a": [2, 3, 4, 5]} and sorted(reg.digests()["a"]) == [2, 3, 4, 5]
    loaded = {h for op, h in engine.calls if op == "load"} - {h for op, h in engine.calls if op == "unload"}
    assert len(loaded) == 2  # only the window is in the engine
    with pytest.raises(FailedPrecondition, match="kept but not loaded"):
        reg.acquire("a", 2)
    first = await reg.take("a", 2)
    second = await reg.take("a", 2)  # a second request shares the load
    assert first.version == 2 and first.handle == second.handle and first.handle not in loaded
    assert [op for op, h in engine.calls if h == first.handle] == ["load"]
    reg.release(first)
    reg.release(second)
    await reg.settle()
    assert [op for op, h in engine.calls if h == first.handle] == ["load", "unload"]
    assert reg.loaded() == {"a": [2, 3, 4, 5]}  # still servable: kept as bytes
    assert (await reg.push(manifest(payload, version=3), payload)).already_loaded  # a kept version is held
    with pytest.raises(FailedPrecondition, match="older than the 4 newest") as info:
        await reg.take("a", 1)
    assert info.value.reason == "ADAPTER_VERSION_EVICTED"
    tight = AdapterRegistry(EngineLog().load, EngineLog().unload, window=1, keep=4, keep_bytes=2 * len(payload))
    for v in range(1, 5):
        await tight.push(manifest(payload, version=v), payload)
    assert tight.loaded() == {"a": [3, 4]}  # two payloads' worth of bytes: the oldest went first


def test_request_ids_are_kept_only_when_safe_to_forward_and_log():
    from rollwire.runtime.logs import request_id_from

    assert request_id_from([("x-request-id", "abc-123")], "field") == "abc-123"
    assert request_id_from([], "from-field") == "from-field"
    for bad in ("\x1f", "has space", "x" * 65, ""):
        rid = request_id_from([("x-request-id", bad)], bad)
        assert rid != bad and len(rid) == 16


def test_a_proxy_bound_to_every_address_names_itself_after_its_host():
    """Peers that share an id take each other for themselves (peers.py): the default id of
    pods that all bind 0.0.0.0 on one port must differ per host."""
    import socket

    from rollwire.proxy.app import default_proxy_id

    assert default_proxy_id("0.0.0.0", 50050) == f"proxy@{socket.gethostname()}:50050"
    assert default_proxy_id("::", 50050) == f"proxy@{socket.gethostname()}:50050"
    assert default_proxy_id("10.0.0.5", 50050) == "proxy@10.0.0.5:50050"
