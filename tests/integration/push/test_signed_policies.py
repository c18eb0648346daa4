"""Signed policies with real processes (issue 37, item 3; docs/security.md): with trusted keys
set, an unsigned version, one signed by a key nobody trusts and a valid signature replayed over
other bytes are refused on every route that admits a version, and nothing of them is served;
a signed version flows as before, and GetStatus names its digest and signer.

One fleet for the module (2 cores): replicas sg1 (trusts keys A and B: mid-rotation) and sg2
(trusts A; joins late), proxy sp1 (trusts A; HTTP door; spool on disk; peers sp1, sp2), and a
proxy sp2 that trusts nothing, standing for whoever holds an admin credential but not the key
(audit A1): its spool is seeded with the three bad versions, which it catches the replicas up
with and shares with sp1 as a peer, and it publishes a version signed by B through a chain, so
sg2 meets it as a push relayed by sg1.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import grpc
import pytest
import requests
from google.protobuf import json_format
from support.peft_folders import peft_folder
from support.processes import (
    FAST_STOP,
    free_port,
    rollwire_cmd,
    start_generators,
    start_proxy,
    stop_all,
    wait_routable,
    wait_until,
)
from support.wire import fingerprint, make_adapter, push, push_messages, status, stub

from rollwire.client import Client
from rollwire.client._push import build_manifest, read_peft_dir
from rollwire.common.errors import from_rpc_error
from rollwire.common.reasons import Reason
from rollwire.common.signing import SignatureFile, SigningKey, sign
from rollwire.proxy.publish.peers import PEER_KEY
from rollwire.v1 import generator_pb2 as pb

pytestmark = pytest.mark.integration

A, B, C = (SigningKey.generate(i) for i in ("key-a", "key-b", "key-c"))


@pytest.fixture(scope="module")
def fleet(tiny_model, tmp_path_factory):
    work = tmp_path_factory.mktemp("signed")
    (work / "adapters").mkdir()
    A.save(work / "a.key")
    for name, keys in (("trust-a.json", [A]), ("trust-ab.json", [A, B])):
        (work / name).write_text(json.dumps({"keys": [k.trust_entry() for k in keys]}))
    ports = {n: free_port() for n in ("sp1", "sp2")}
    # sg1 sorts first among sp2's targets, so its chain is sp2 -> sg1 -> sg2: sg2 is a relay child
    ports["sg1"], ports["sg2"] = sorted((free_port(), free_port()), key=lambda p: f"127.0.0.1:{p}")
    peers = json.dumps([f"127.0.0.1:{ports['sp1']}", f"127.0.0.1:{ports['sp2']}"])
    state: dict = {"work": work, "model": tiny_model, "ports": ports, "peers": peers, "services": []}
    try:
        (sg1,) = start_generators(
            tiny_model, work, ["sg1"], "--port", str(ports["sg1"]), "--set", f"trust.keys_file={work / 'trust-ab.json'}"
        )
        state["services"].append(sg1)
        sp1 = start_proxy(
            work,
            "sp1",
            [sg1],
            *("--generator", f"127.0.0.1:{ports['sg2']}", "--port", str(ports["sp1"])),
            *("--set", f"trust.keys_file={work / 'trust-a.json'}", "--set", f"spool.dir={work / 'sp1-spool'}"),
            *("--http-port", "0", "--http-model", str(tiny_model), "--http-adapter-root", str(work / "adapters")),
            *("--set", f"peers={peers}", "--set", "peering.interval_s=0.2"),
        )
        state["services"].append(sp1)
        wait_routable(sp1, [sg1])
        state.update(sg1=sg1, sp1=sp1, fp=fingerprint(sg1.target))
        yield state
    finally:
        stop_all(state["services"])


def held(service, name: str) -> dict[int, tuple[str, str]]:
    """(digest, signer) of each version of `name` the service's GetStatus lists."""
    entry = next((a for a in status(service.target).adapters if a.name == name), None)
    if entry is None:
        return {}
    return {v: (entry.digests.get(v, ""), entry.signers.get(v, "")) for v in entry.versions}


def bad_versions(model: Path, fp: str, name: str, first: int) -> list[tuple[str, pb.AdapterManifest, bytes]]:
    """(what, manifest, payload): unsigned, signed by C (trusted nowhere), and A's valid
    signature of other bytes (same name and version) replayed over these."""
    mine, other = make_adapter(model, seed=first), make_adapter(model, seed=first + 100)
    unsigned = mine.manifest(name, first, fp)
    by_c = sign(mine.manifest(name, first + 1, fp), C)
    replayed = mine.manifest(name, first + 2, fp)
    SignatureFile.of(sign(other.manifest(name, first + 2, fp), A)).apply(replayed)
    return [
        ("unsigned", unsigned, mine.payload),
        ("signed by another key", by_c, mine.payload),
        ("replayed signature", replayed, mine.payload),
    ]


REASONS = {
    "unsigned": Reason.UNSIGNED_ADAPTER,
    "signed by another key": Reason.BAD_SIGNATURE,
    "replayed signature": Reason.BAD_SIGNATURE,
}


def test_a_signed_version_flows_and_every_status_names_its_digest_and_signer(fleet):
    adapter = make_adapter(fleet["model"], seed=7)
    with Client(fleet["sp1"].target, timeout=60) as client:
        reply = client.push_adapter("sp", 1, adapter.payload, adapter.shape, fleet["fp"], signing_key=A)
        assert reply.version == 1 and not reply.already_loaded
        served = client.generate("1+1=", adapter="sp@1", max_new_tokens=3)
        assert served.adapter is not None and served.adapter.version == 1
    assert held(fleet["sg1"], "sp") == {1: (adapter.sha256, "key-a")}  # the replica's own report
    assert held(fleet["sp1"], "sp") == {1: (adapter.sha256, "key-a")}  # the proxy's summary, from its spool


@pytest.mark.parametrize("to", ["sp1", "sg1"])
def test_bad_versions_are_refused_through_the_proxy_and_directly_and_nothing_is_kept(fleet, to):
    first = 10 if to == "sp1" else 20
    for what, manifest, payload in bad_versions(fleet["model"], fleet["fp"], "sp", first):
        with pytest.raises(grpc.RpcError) as caught:
            push(fleet[to].target, manifest, payload)
        err = from_rpc_error(caught.value)
        assert (err.code, err.reason) == (grpc.StatusCode.FAILED_PRECONDITION, REASONS[what]), what
        assert "sign" in err.message and "nothing was applied" in err.message, err.message
    assert sorted(held(fleet["sg1"], "sp")) == [1]  # nothing served
    assert sorted(held(fleet["sp1"], "sp")) == [1]
    assert sorted(p.name for p in (fleet["work"] / "sp1-spool" / "sp").iterdir()) == ["1.json", "1.safetensors"]


def load(fleet, folder: Path, lora_name: str) -> requests.Response:
    body = {"lora_name": lora_name, "lora_path": str(folder)}
    return requests.post(fleet["sp1"].http_url + "/v1/load_lora_adapter", json=body, timeout=60)


def signature_file(folder: Path, name: str, version: int, fp: str, key: SigningKey) -> str:
    adapter = read_peft_dir(folder)
    manifest = sign(build_manifest(name, version, adapter.payload, adapter.lora, fp), key)
    return SignatureFile.of(manifest).to_json()


def test_http_loads_need_a_signature_file_a_trusted_key_signed_for_these_bytes(fleet):
    root, fp = fleet["work"] / "adapters", fleet["fp"]
    unsigned = root / "unsigned"
    peft_folder(fleet["model"], unsigned, seed=31)  # as TRL writes it: no signature file
    reply = load(fleet, unsigned, "hp-v1")
    assert reply.status_code == 400 and reply.json()["error"]["reason"] == "UNSIGNED_ADAPTER"
    assert "rollwire keys sign" in reply.json()["error"]["message"]

    other_key = root / "other-key"
    peft_folder(fleet["model"], other_key, seed=32)
    (other_key / "rollwire-signature.json").write_text(signature_file(other_key, "hp", 1, fp, C))
    reply = load(fleet, other_key, "hp-v1")
    assert reply.status_code == 400 and reply.json()["error"]["reason"] == "BAD_SIGNATURE"

    good = root / "good"
    peft_folder(fleet["model"], good, seed=33)
    signed = subprocess.run(  # the CLI a person runs next to TRL
        rollwire_cmd(
            *("keys", "sign", "--signing-key", str(fleet["work"] / "a.key"), "--name", "hp", "--version", "1"),
            *("--base-fingerprint", fp, str(good)),
        ),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert signed.returncode == 0, signed.stderr
    replay = root / "replay"
    peft_folder(fleet["model"], replay, seed=34)
    (replay / "rollwire-signature.json").write_text((good / "rollwire-signature.json").read_text())
    reply = load(fleet, replay, "hp-v1")  # A's signature of good's bytes, over replay's
    assert reply.status_code == 400 and reply.json()["error"]["reason"] == "BAD_SIGNATURE"
    assert held(fleet["sg1"], "hp") == {} and not (fleet["work"] / "sp1-spool" / "hp").exists()

    reply = load(fleet, good, "hp")  # a bare name: the version is the signed one
    assert reply.status_code == 200, reply.text
    assert (reply.json()["version"], reply.json()["signer"]) == (1, "key-a")
    digest = read_peft_dir(good).sha256
    wait_until(lambda: held(fleet["sg1"], "hp") == {1: (digest, "key-a")}, 30, "sg1 serves the signed load")


def test_a_replica_that_joins_late_is_caught_up_with_signed_versions_only(fleet):
    (sg2,) = start_generators(
        fleet["model"],
        fleet["work"],
        ["sg2"],
        *("--port", str(fleet["ports"]["sg2"]), "--set", f"trust.keys_file={fleet['work'] / 'trust-a.json'}"),
        *FAST_STOP,
    )
    fleet["services"].append(sg2)
    fleet["sg2"] = sg2
    wait_routable(fleet["sp1"], [fleet["sg1"], sg2])
    wait_until(lambda: sorted(held(sg2, "sp")) == [1] and sorted(held(sg2, "hp")) == [1], 30, "sg2 caught up")
    assert held(sg2, "sp")[1][1] == "key-a" and held(sg2, "hp")[1][1] == "key-a"


def seed_spool(folder: Path, versions: list[tuple[str, pb.AdapterManifest, bytes]]) -> None:
    """Versions as a proxy that trusts no key spooled them (a commit's two files)."""
    for _, manifest, payload in versions:
        (folder / manifest.name).mkdir(parents=True, exist_ok=True)
        (folder / manifest.name / f"{manifest.version}.safetensors").write_bytes(payload)
        (folder / manifest.name / f"{manifest.version}.json").write_text(json_format.MessageToJson(manifest))


def events(service, event: str) -> list[dict]:
    lines = service.log_path.read_text().splitlines()
    return [e for e in (json.loads(x) for x in lines if x.startswith("{")) if e.get("event") == event]


def test_a_proxy_without_the_key_gets_nothing_served_by_catch_up_peer_share_or_relay(fleet):
    """sp2 trusts no key: what it spooled (three bad versions) reaches the replicas as catch-up,
    all refused and quarantined by sp2; sent to sp1 as a peer share, refused; a version signed by
    B reaches sg2 (which trusts only A) through sp2's chain, refused; nothing served anywhere."""
    if "sg2" not in fleet:
        pytest.skip("needs the late replica of the previous test")
    work, sg1, sg2, sp1 = fleet["work"], fleet["sg1"], fleet["sg2"], fleet["sp1"]
    seed_spool(work / "sp2-spool", bad_versions(fleet["model"], fleet["fp"], "rogue", 1))
    sp2 = start_proxy(
        work,
        "sp2",
        [sg1, sg2],
        *("--port", str(fleet["ports"]["sp2"]), "--set", f"spool.dir={work / 'sp2-spool'}"),
        *("--set", f"peers={fleet['peers']}", "--set", "peering.interval_s=0.2"),
        *("--set", "push.fanout=1", "--set", "push.stripes=1"),  # a chain: one replica relays to the other
    )
    fleet["services"].append(sp2)
    quarantine = work / "sp2-spool" / ".quarantine" / "rogue"
    wait_until(lambda: len(list(quarantine.glob("*.why.txt"))) == 3, 60, "sp2 quarantined the 3 versions (catch-up)")
    for service in (sg1, sg2, sp1):
        assert held(service, "rogue") == {}, service.name

    # a peer's share: the same versions as sp2 sends them to a peer proxy (PEER_KEY), refused by sp1
    for what, manifest, payload in bad_versions(fleet["model"], fleet["fp"], "rogue", 1):
        with pytest.raises(grpc.RpcError) as caught:
            stub(sp1.target).PushAdapter(push_messages(manifest, payload), metadata=((PEER_KEY, "sp2"),), timeout=60)
        assert from_rpc_error(caught.value).reason == REASONS[what], what
    assert held(sp1, "rogue") == {} and not (work / "sp1-spool" / "rogue").exists()

    # relay: B is trusted by sg1 (mid-rotation) but not sg2, so sg2 refuses what the chain brings it
    wait_routable(sp2, [sg1, sg2])
    adapter = make_adapter(fleet["model"], seed=51)
    manifest = sign(adapter.manifest("rot", 1, fleet["fp"]), B)
    before = len(events(sg2, "adapter_push_refused"))
    try:
        results = list(push(sp2.target, manifest, adapter.payload).replicas)
    except grpc.RpcError:
        results = []
    outcome = {r.replica: r for r in results}
    if "sg2" in outcome:
        assert outcome["sg2"].reason == Reason.BAD_SIGNATURE, outcome["sg2"]
    assert held(sg2, "rot") == {}  # nothing served on the replica that does not trust B
    assert not (work / "sp1-spool" / "rot").exists()  # sp2 shared it with sp1 as a peer: refused
    refused = [e["reason"] for e in events(sg2, "adapter_push_refused")][before:]
    assert refused and set(refused) == {Reason.BAD_SIGNATURE}, refused
    relayed = [e["relayed_to"] for e in events(sg1, "adapter_staged") if e.get("adapter") == "rot"]
    assert relayed == [1]  # sg1 took it (it trusts B) and relayed it to sg2, which refused it
