"""Per-tenant LoRA slots on one real replica (issue 35, item 3; the policy's unit tests:
tests/unit/generator/test_tenant_slots.py): tenant A pushing and using more adapters than its
`tenant_slots` never unloads tenant B's adapter, A's own least recently used version goes, and
a load of A's while each of its versions serves a request is refused with TENANT_SLOTS_FULL.

The replica runs the scripted engine (a real replica process, registry and gRPC server; its
engine makes tokens at a set rate from config.json alone), so a long generation holds its
version for as long as the test needs it, and a short one ends at once. Names are qualified
(`team-a:x`) and pushed with the admin token, as a proxy pushes its tenants' versions.

Which versions the engine holds is read from the replica's own counter of slot decisions:
a request naming a version still loaded loads nothing (no new `room` decision), a request
naming one that was unloaded loads it again (one `room`, and `quota_own` when its tenant is
at its quota)."""

from __future__ import annotations

import hashlib
import json

import grpc
import numpy as np
import pytest
from safetensors.numpy import save
from support.processes import start_generator
from support.wire import metric_value, push_messages, stub

from rollwire.common.errors import from_rpc_error
from rollwire.common.lora import LoraShape
from rollwire.generator.shapes import config_linear_shapes
from rollwire.push.checks import expected_lora_shapes
from rollwire.v1 import generator_pb2 as pb

pytestmark = pytest.mark.integration
ADMIN = "admin-token-for-tenant-slots"
AUTH = [("authorization", f"Bearer {ADMIN}")]
CONFIG = {  # a tiny Llama: the scripted engine needs its config.json only
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 256,
    "max_position_embeddings": 2048,
}
LORA = LoraShape(2, 4.0, ("q_proj",))
HOLD_TOKENS = 1000  # at 10 tokens/s: 100 s, far longer than the test; cancelled at its end


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    work = tmp_path_factory.mktemp("tenant-slots")
    model = work / "tiny-llama-config"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(CONFIG))
    (work / "admin.tokens").write_text(f"{ADMIN}\n")
    svc = start_generator(
        model,
        work,
        "tenant-slots",
        *("--set", "engine=scripted", "--set", "scripted.tokens_per_s=10"),
        *("--set", f"auth.admin_tokens_file={work / 'admin.tokens'}"),
        *("--set", "tenant_slots.default=2", "--set", 'tenant_slots.tenants={"team-c": 1}'),
        *("--set", "limits.max_new_tokens=1024"),
    )
    yield svc
    svc.stop()


def push(target: str, name: str, version: int, fingerprint: str) -> None:
    rng = np.random.default_rng(version)
    shapes = expected_lora_shapes(LORA, config_linear_shapes(CONFIG))
    payload = save({k: rng.standard_normal(s).astype(np.float16) for k, s in shapes.items()})
    manifest = pb.AdapterManifest(
        name=name,
        version=version,
        base_model_fingerprint=fingerprint,
        lora_config=LORA.to_pb(),
        byte_length=len(payload),
        sha256=hashlib.sha256(payload).hexdigest(),
    )
    stub(target).PushAdapter(push_messages(manifest, payload), metadata=AUTH, timeout=60)


def request(name: str, tokens: int) -> pb.GenerateRequest:
    req = pb.GenerateRequest(n=1, sampling=pb.SamplingParams(max_new_tokens=tokens, ignore_eos=True))
    req.token_ids.ids.extend([5, 6, 7])
    req.adapter.name = name
    return req


def generate(target: str, name: str) -> None:
    """One short generation with `name`'s newest version, to its end."""
    finished = [f for msg in stub(target).Generate(request(name, 1), metadata=AUTH, timeout=30) for f in msg.finished]
    assert len(finished) == 1


def hold(target: str, name: str):
    """A long generation with `name`, read up to its `started` (the version is taken: held)."""
    call = stub(target).Generate(request(name, HOLD_TOKENS), metadata=AUTH, timeout=120)
    first = next(call)
    assert first.HasField("started") and first.started.adapter.name == name
    return call


def decisions(svc) -> dict[str, float]:
    text = svc.metrics()
    outcomes = ("room", "quota_own", "full_other", "quota_refused")
    name = "rollwire_generator_adapter_slot_decisions_total"
    return {o: metric_value(text, name, f'outcome="{o}"') for o in outcomes}


def test_a_tenant_beyond_its_slots_gives_up_its_own_oldest_and_never_another_tenants(replica):
    target = replica.target
    fp = stub(target).GetStatus(pb.GetStatusRequest(), metadata=AUTH, timeout=10).model_fingerprint
    push(target, "team-b:policy", 1, fp)
    for name in ("team-a:x", "team-a:y"):
        push(target, name, 1, fp)
    start = decisions(replica)
    for name in ("team-a:z", "team-a:w"):  # a at its 2 slots: each push unloads a's least recently used
        push(target, name, 1, fp)
    after = decisions(replica)
    assert after["quota_own"] - start["quota_own"] == 2 and after["full_other"] == start["full_other"] == 0
    status = stub(target).GetStatus(pb.GetStatusRequest(), metadata=AUTH, timeout=10)
    assert {"team-b:policy", "team-a:x", "team-a:y", "team-a:z", "team-a:w"} <= {a.name for a in status.adapters}

    generate(target, "team-b:policy")  # b's version is still in the engine: nothing is loaded for it
    generate(target, "team-a:z")
    generate(target, "team-a:w")
    assert decisions(replica)["room"] == after["room"]
    generate(target, "team-a:x")  # a's oldest was unloaded (its bytes kept): loaded again, in place of a's own
    again = decisions(replica)
    assert (again["room"] - after["room"], again["quota_own"] - after["quota_own"]) == (1, 1)

    held = [hold(target, "team-a:w"), hold(target, "team-a:x")]  # a's two loaded versions, both in use
    try:
        for attempt in (lambda: generate(target, "team-a:y"), lambda: push(target, "team-a:v", 1, fp)):
            with pytest.raises(grpc.RpcError) as refused:
                attempt()
            err = from_rpc_error(refused.value)
            assert (err.code, err.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "TENANT_SLOTS_FULL")
            assert "tenant_slots.default = 2" in err.message and "'team-a'" in err.message
        push(target, "team-b:other", 1, fp)  # b is not held back by a's quota
        generate(target, "team-b:policy")
        end = decisions(replica)
        assert end["quota_refused"] - again["quota_refused"] == 2 and end["full_other"] == 0
        assert end["room"] - again["room"] == 1  # team-b:other only: team-b:policy stayed loaded throughout
    finally:
        for call in held:
            call.cancel()
