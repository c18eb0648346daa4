"""Proof that every replica serves the policy that was published (issue 52), over real sockets:
two transformers replicas and a proxy started in this process (so a test can reach into one
replica's engine, as a bug would), every call over gRPC through the SDK and the admin stub.

- a replica whose engine serves other weights than the published ones (its loads go through a
  double that scales the adapter's B matrices) refuses a signed, probed version at commit: the
  push names it with PROOF_FAILED and the gap; the other replica serves the version, this one
  keeps what it served, and the proxy's status and the replicas' GetStatus say so;
- a drift injected after commit (the version's adapter evicted from the engine and rebuilt
  wrongly under its handle) is caught by the next re-check (ProveAdapters): the drifted replica
  fails it, named, counted, and is no longer routed that version; the honest one passes;
- a version pushed without a probe gets the proxy's own, made on the first replica that
  committed it, and the other is held to it.
"""

from __future__ import annotations

import asyncio
import json

import grpc
import httpx2 as httpx
import pytest
import pytest_asyncio
from safetensors.torch import load, save
from support.engines import forward_logprobs
from support.wire import make_adapter, peft_reference

from rollwire.client.aio import AsyncClient
from rollwire.client.cli import format_status
from rollwire.common import probe as probes
from rollwire.common.fingerprint import model_fingerprint
from rollwire.common.lora import LoraShape
from rollwire.common.signing import SigningKey
from rollwire.generator.app import start_generator
from rollwire.generator.config import GeneratorConfig
from rollwire.proxy.app import start_proxy
from rollwire.proxy.config import ProxyConfig
from rollwire.push.buffers import as_bytes
from rollwire.v1 import admin_pb2 as apb
from rollwire.v1 import admin_pb2_grpc
from rollwire.v1 import generator_pb2 as pb

pytestmark = pytest.mark.integration

KEY = SigningKey.generate("publisher")
TOLERANCE = 1e-4  # the transformers engine's documented default


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet(tiny_model, tmp_path_factory):
    work = tmp_path_factory.mktemp("proof")
    trust = work / "trust.json"
    trust.write_text(json.dumps({"keys": [KEY.trust_entry()]}))
    common = {"model": str(tiny_model), "host": "127.0.0.1", "port": 0, "metrics_port": 0}
    replicas = [
        await start_generator(
            GeneratorConfig.model_validate(
                {
                    **common,
                    "replica_id": f"proof-{i}",
                    "transformers": {"threads": 1},
                    "trust": {"keys_file": str(trust)},
                }
            )
        )
        for i in (1, 2)
    ]
    proxy = await start_proxy(
        ProxyConfig.model_validate(
            {
                "host": "127.0.0.1",
                "port": 0,
                "metrics_port": 0,
                "generators": [f"127.0.0.1:{r.port}" for r in replicas],
                "health": {"interval_s": 0.2},
                "trust": {"keys_file": str(trust)},
                "proof": {"recheck_interval_s": 0},
                "http": {"port": 0, "model_path": str(tiny_model)},
            }
        )
    )
    target = f"127.0.0.1:{proxy.port}"
    client = AsyncClient(target, timeout=60)
    for _ in range(300):  # both replicas routable: the proxy's health rounds (0.2 s) have no event to await
        if len(proxy.replicas.routable()) == 2:
            break
        await asyncio.sleep(0.1)
    assert len(proxy.replicas.routable()) == 2
    channel = grpc.aio.insecure_channel(target)
    yield {
        "replicas": replicas,
        "proxy": proxy,
        "client": client,
        "admin": admin_pb2_grpc.AdminServiceStub(channel),
        "fingerprint": model_fingerprint(tiny_model),
    }
    await channel.close()
    await client.close()
    await proxy.stop(0)
    for r in replicas:
        await r.stop(0)


def probe_of(tiny_model, adapter, engine) -> pb.AdapterProbe:
    """The publisher's probe: fixed sequences and its own PEFT model's logprobs for them."""
    peft = peft_reference(tiny_model, adapter)
    seqs = [(engine.tokenize(p), engine.tokenize(c)) for p, c in (("12+34=", "46"), ("abc", "defgh"))]
    return probes.build_probe(seqs, [forward_logprobs(peft, p, c).tolist() for p, c in seqs], seed=1)


def scaled(payload, factor: float) -> bytes:
    tensors = load(as_bytes(payload))
    return save({k: v * factor if "lora_B" in k else v for k, v in tensors.items()})


async def push(fleet, adapter, version: int, probe: pb.AdapterProbe | None):
    return await fleet["client"].push_adapter(
        "proof",
        version,
        adapter.payload,
        LoraShape(adapter.r, adapter.lora_alpha, adapter.targets),
        fleet["fingerprint"],
        signing_key=KEY,
        probe=probe,
    )


def proxy_replica(fleet, i: int):
    return fleet["proxy"].replicas.get(f"127.0.0.1:{fleet['replicas'][i].port}")


@pytest.mark.asyncio(loop_scope="module")
async def test_a_replica_serving_other_weights_is_refused_at_commit_and_named(fleet, tiny_model):
    r1, r2 = fleet["replicas"]
    engine = r2.servicer.engine
    registry = r2.servicer.registry
    honest_load = registry._load

    async def scaling_load(handle, m, payload):  # the double: this replica's engine gets other weights
        await honest_load(handle, m, scaled(payload, 1.05))

    registry._load = scaling_load
    try:
        a = make_adapter(tiny_model, seed=61, r=4, scale=0.1)
        result = await push(fleet, a, 1, probe_of(tiny_model, a, engine))
    finally:
        registry._load = honest_load
    by_replica = {p.replica: p for p in result.replicas}
    assert by_replica["proof-1"].code == "OK"
    refused = by_replica["proof-2"]
    assert refused.code == "FAILED_PRECONDITION"
    assert "proof-2" in refused.message and "differ by up to" in refused.message and "signed probe" in refused.message
    assert r2.servicer.registry.loaded().get("proof") is None  # it keeps serving what it served
    assert r1.servicer.registry.loaded()["proof"] == [1]
    own = r1.servicer.status().adapters[0].proofs[1]
    assert own.outcome == "passed" and own.max_abs_gap <= TOLERANCE
    assert r2.servicer.metrics.proofs.labels("failed")._value.get() == 1
    assert not proxy_replica(fleet, 1).holds("proof", 1)


@pytest.mark.asyncio(loop_scope="module")
async def test_a_drift_after_commit_is_caught_by_the_next_recheck(fleet, tiny_model):
    r1 = fleet["replicas"][0]
    a = make_adapter(tiny_model, seed=62, r=4, scale=0.1)
    result = await push(fleet, a, 2, probe_of(tiny_model, a, r1.servicer.engine))
    assert all(p.code == "OK" for p in result.replicas), result.replicas
    checked = await fleet["admin"].ProveAdapters(apb.ProveAdaptersRequest(name="proof"))
    before = {r.replica: r.adapters[0].proofs[2] for r in checked.replicas}
    assert {p.outcome for p in before.values()} == {"passed"}
    # the drift: r1's adapter evicted and rebuilt wrongly under the same handle
    selection = r1.servicer.registry.acquire("proof", 2)
    r1.servicer.registry.release(selection)
    m = r1.servicer.registry._versions["proof"][-1].manifest
    await r1.servicer.engine.unload_adapter(selection.handle)
    await r1.servicer.engine.load_adapter(selection.handle, m, scaled(a.payload, 0.9))
    checked = await fleet["admin"].ProveAdapters(apb.ProveAdaptersRequest(name="proof"))
    after = {r.replica: r for r in checked.replicas}
    drifted = after["proof-1"].adapters[0].proofs[2]
    assert drifted.outcome == "failed" and drifted.max_abs_gap > 10 * TOLERANCE and drifted.reference == "publisher"
    assert after["proof-2"].adapters[0].proofs[2].outcome == "passed"
    assert not proxy_replica(fleet, 0).holds("proof", 2)  # no longer routed that version
    assert proxy_replica(fleet, 1).holds("proof", 2)
    report = format_status(await fleet["client"].get_status())  # what `rollwire status` prints
    row = next(line for line in report.splitlines() if line.strip().startswith("proof-1") and " failed " in line)
    assert "proof" in row and m.sha256[:12] in row and "publisher" in row and f"{drifted.max_abs_gap:.3g}" in row
    metrics = fleet["proxy"].servicer.state.metrics
    assert metrics.proofs.labels(f"127.0.0.1:{r1.port}", "failed")._value.get() == 1
    assert metrics.proof_gap.labels(f"127.0.0.1:{r1.port}", "proof")._value.get() == pytest.approx(drifted.max_abs_gap)
    door = f"http://127.0.0.1:{fleet['proxy'].http_port}"  # the HTTP door says the same, vLLM-checker-shaped
    async with httpx.AsyncClient(timeout=30) as http:
        info = (await http.get(f"{door}/weight_info")).json()
        listed = (await http.get(f"{door}/v1/models")).json()["data"]
    assert info["match"] is False and "proof-1:proof:v2" in info["mismatches"]
    row = next(a for r in info["replicas"] if r["replica"] == "proof-1" for a in r["adapters"] if a["version"] == 2)
    assert row["proof"]["outcome"] == "failed" and row["sha256"] == m.sha256 and row["signer"] == "publisher"
    entry = next(e for e in listed if e.get("rollwire", {}).get("version") == 2)
    assert entry["rollwire"]["proofs"]["outcomes"]["failed"] == 1
    # the honest weights back under the handle: the next re-check passes, and routing follows the replica's status
    await r1.servicer.engine.unload_adapter(selection.handle)
    await r1.servicer.engine.load_adapter(selection.handle, m, a.payload)
    checked = await fleet["admin"].ProveAdapters(apb.ProveAdaptersRequest(name="proof"))
    assert {r.replica: r.adapters[0].proofs[2].outcome for r in checked.replicas}["proof-1"] == "passed"
    assert proxy_replica(fleet, 0).holds("proof", 2)


@pytest.mark.asyncio(loop_scope="module")
async def test_an_unprobed_version_is_held_to_the_first_replica_that_committed_it(fleet, tiny_model):
    book = fleet["proxy"].servicer.state.fanout.proofs
    rounds = book.runs
    a = make_adapter(tiny_model, seed=63, r=4, scale=0.1)
    await push(fleet, a, 3, None)
    await book.wait_rounds(rounds + 1, 60)
    proofs = {r.name: r.proofs[("proof", 3)] for r in fleet["proxy"].replicas.all() if ("proof", 3) in r.proofs}
    assert len(proofs) == 2
    (reference,) = {p.reference for p in proofs.values()}  # one replica's numbers, both held to them
    first = reference.removeprefix("replica ")
    assert first in proofs and proofs[first].max_abs_gap == 0.0
    assert all(p.outcome == "passed" and p.max_abs_gap <= TOLERANCE for p in proofs.values())
