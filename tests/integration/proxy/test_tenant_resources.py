"""Work in progress is charged to its tenant (issue 51, item 2; audit 2026-12-07 S1, S3, S4, S10),
each attack beside the other tenants' and the fleet's own work, which must succeed during it:

- S1: uploads in flight count against their tenant's spool quota and share from the manifest
  on (no bulk buffer is mapped for what the tenant may not hold), and every upload has a total
  deadline, so neither a held manifest nor a trickle keeps the spool from anyone else;
- S3: a tenant's half-sent pushes take at most all but one of a replica's push slots;
- S4: an HTTP upload larger than its tenant could be given is refused before its body is read,
  and the door's budget bounds the bytes uploads hold together;
- S10: a Score is charged to the tenant's tokens/s quota like a Generate.

One proxy (auth on, three tenants, bulk, the door, short upload deadlines) over the session's
shared replica (`generator`); the pure rules are tests/unit/proxy/test_tenant_reservations.py
and tests/unit/push/test_push_slot_shares.py."""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import time
from pathlib import Path

import grpc
import pytest
import requests
from support.peft_folders import peft_folder
from support.processes import start_proxy, stop_all, wait_until
from support.wire import make_adapter, metric_value, push_messages

from rollwire.common.bulk import parse_offer
from rollwire.common.errors import from_rpc_error
from rollwire.common.writer import opening
from rollwire.v1 import generator_pb2 as pb
from rollwire.v1 import generator_pb2_grpc

pytestmark = pytest.mark.integration

MiB = 1 << 20
SPOOL_BYTES, QUOTA_BYTES = 4 * MiB, 1 * MiB
UPLOAD_TIMEOUT_S = 3.0
"""spool.upload_timeout_s: an upload of N bytes may take this plus N at 1 MiB/s."""
UPLOAD_BUDGET = 2 * MiB
"""http.max_upload_bytes_in_flight: one tenant's uploads hold at most half of it."""
TOKENS = {
    "admin": "tr-admin-51a",
    "a-pub": "tr-a-pub-51b",
    "b-pub": "tr-b-pub-51c",
    "c-gen": "tr-c-gen-51d",
    "c-pub": "tr-c-pub-51e",
}


def meta(who: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {TOKENS[who]}"),)


@pytest.fixture(scope="module")
def fleet(tiny_model, generator, tmp_path_factory):
    work = tmp_path_factory.mktemp("tenant-resources")
    for who, token in TOKENS.items():
        (work / f"{who}.token").write_text(token + "\n")
    tenants = [
        {"name": "team-a", "publish_tokens_file": str(work / "a-pub.token"), "quotas": {"max_spool_bytes": QUOTA_BYTES}},
        {"name": "team-b", "publish_tokens_file": str(work / "b-pub.token")},
        {"name": "team-c", "generate_tokens_file": str(work / "c-gen.token"), "publish_tokens_file": str(work / "c-pub.token"), "quotas": {"max_tokens_per_s": 5}},
    ]  # fmt: skip
    settings = {
        "auth.admin_tokens_file": work / "admin.token",
        "tenants": json.dumps(tenants),
        "bulk.enabled": "true",
        "spool.max_bytes": SPOOL_BYTES,
        "spool.max_adapter_bytes": 2 * MiB,
        "spool.upload_timeout_s": UPLOAD_TIMEOUT_S,
        "spool.min_upload_bytes_per_s": MiB,
        "http.max_upload_bytes_in_flight": UPLOAD_BUDGET,
        "http.load_answer": "committed",
    }
    sets = [a for k, v in settings.items() for a in ("--set", f"{k}={v}")]
    proxy = start_proxy(work, "tres", [generator], "--http-port", "0", "--http-model", str(tiny_model), *sets)
    try:
        stub = generator_pb2_grpc.GeneratorServiceStub(grpc.insecure_channel(proxy.target))
        wait_until(
            lambda: any(r.healthy for r in stub.GetStatus(pb.GetStatusRequest(), metadata=meta("admin")).replicas),
            30,
            "the proxy routes to its replica",
        )
        fp = stub.GetStatus(pb.GetStatusRequest(), metadata=meta("admin"), timeout=10).model_fingerprint
        yield {"proxy": proxy, "gen": generator, "stub": stub, "model": tiny_model, "fp": fp, "work": work}
    finally:
        stop_all([proxy])


def outcome(call) -> tuple[grpc.StatusCode, str]:
    try:
        call.result()
    except grpc.RpcError as exc:
        err = from_rpc_error(exc)
        return err.code, err.reason
    return grpc.StatusCode.OK, ""


def push(fleet, who: str, name: str, seed: int, version: int = 1) -> pb.PushAdapterResponse:
    """A well-behaved push of a small real adapter (~85 KB), its reply (raises on a refusal)."""
    adapter = make_adapter(fleet["model"], seed, r=4)
    messages = push_messages(adapter.manifest(name, version, fleet["fp"]), adapter.payload)
    return fleet["stub"].PushAdapter(messages, metadata=meta(who), timeout=30)


def declared(fleet, name: str, size: int) -> pb.AdapterManifest:
    """A manifest for `size` bytes no one will send (the audit's p1_reserve)."""
    return pb.AdapterManifest(
        name=name,
        version=1,
        base_model_fingerprint=fleet["fp"],
        lora_config=pb.LoraConfig(r=4, lora_alpha=8.0, target_modules=["q_proj"]),
        byte_length=size,
        sha256=hashlib.sha256(name.encode()).hexdigest(),
    )


class Hog:
    """A push that sends its manifest (asking for the bulk path) and then nothing."""

    def __init__(self, fleet, who: str, manifest: pb.AdapterManifest, release: threading.Event) -> None:
        def messages():
            yield opening(manifest, bulk=True)
            release.wait(60)

        self.channel = grpc.insecure_channel(fleet["proxy"].target)
        stub = generator_pb2_grpc.GeneratorServiceStub(self.channel)
        self.call = stub.PushAdapter.future(messages(), metadata=meta(who), timeout=60)
        self.admitted = parse_offer(self.call.initial_metadata()) is not None  # an offer: its buffer is taken


def proxy_rss(fleet) -> int:
    status = Path(f"/proc/{fleet['proxy'].proc.pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1]) * 1024


def test_uploads_in_flight_are_their_tenants_and_end_by_their_deadline_while_others_publish(fleet):
    """S1: team-a (quota 1 MiB) opens four 1 MiB manifests and team-b (no quota) two of 2 MiB,
    filling the 4 MiB spool as the audit did; only what each may hold is admitted (team-a's
    first, team-b's first: half the spool), the rest refused at once, before any buffer; team-c's
    and the fleet's real pushes succeed beside them; the admitted ones end at their total
    deadline, not at a per-message idle timeout, and so does a 1 byte/0.25 s trickle."""
    release, rss = threading.Event(), proxy_rss(fleet)
    hogs: list[Hog] = []
    try:
        hogs = [Hog(fleet, "a-pub", declared(fleet, f"hog{i}", QUOTA_BYTES), release) for i in range(4)]
        hogs += [Hog(fleet, "b-pub", declared(fleet, f"hog{i}", 2 * MiB), release) for i in range(2)]
        opened = time.monotonic()
        assert [h.admitted for h in hogs] == [True, False, False, False, True, False]
        refusals = {outcome(h.call) for h in hogs if not h.admitted}
        assert refusals == {(grpc.StatusCode.RESOURCE_EXHAUSTED, "TENANT_QUOTA")}
        assert proxy_rss(fleet) - rss < 32 * MiB  # the admitted ones' buffers (3 MiB), not the declared 8

        # collateral: another tenant's and the fleet's pushes, while the hogs hold what they were given
        assert push(fleet, "c-pub", "beside", seed=11).name == "beside"
        assert push(fleet, "admin", "fleet-beside", seed=12).name == "fleet-beside"

        # the admitted ones end by their deadline (3 s + 1 or 2 s at 1 MiB/s), freeing their reservations
        for hog in (h for h in hogs if h.admitted):
            assert outcome(hog.call) == (grpc.StatusCode.DEADLINE_EXCEEDED, "PUSH_TOO_SLOW")
        assert time.monotonic() - opened < UPLOAD_TIMEOUT_S + 2 + 3  # not the 30 s idle timeout
        assert push(fleet, "a-pub", "after", seed=13).name == "after"  # team-a's reservation is free again
    finally:
        release.set()
        for hog in hogs:
            hog.channel.close()

    adapter = make_adapter(fleet["model"], 14, r=4)

    def trickle():
        yield pb.PushAdapterRequest(manifest=adapter.manifest("trickle", 1, fleet["fp"]))
        for i in range(200):  # 1 byte per 0.25 s: never idle for the 30 s idle timeout
            yield pb.PushAdapterRequest(chunk=adapter.payload[i : i + 1])
            time.sleep(0.25)

    start = time.monotonic()
    call = fleet["stub"].PushAdapter.future(trickle(), metadata=meta("a-pub"), timeout=60)
    assert outcome(call) == (grpc.StatusCode.DEADLINE_EXCEEDED, "PUSH_TOO_SLOW")
    assert time.monotonic() - start < UPLOAD_TIMEOUT_S + 3


def test_a_tenants_stalled_pushes_leave_a_replica_slot_for_another_tenant(fleet):
    """S3: team-a's two pushes send half their bytes (the header passed: the relay holds a
    replica's push stream) and stall; the replica (max_concurrent_pushes 2) gives team-a one
    slot, so team-b's push is staged, committed and served meanwhile."""
    gen, release = fleet["gen"], threading.Event()
    slots = lambda: metric_value(gen.metrics(), "rollwire_generator_push_slots_used")  # noqa: E731
    log_start = gen.log_path.stat().st_size

    def half(adapter, name):
        yield pb.PushAdapterRequest(manifest=adapter.manifest(name, 1, fleet["fp"]))
        yield pb.PushAdapterRequest(chunk=adapter.payload[: len(adapter.payload) // 2])
        release.wait(60)

    calls = []
    try:
        for i in range(2):
            adapter = make_adapter(fleet["model"], 20 + i, r=8)
            stub = generator_pb2_grpc.GeneratorServiceStub(grpc.insecure_channel(fleet["proxy"].target))
            calls.append(stub.PushAdapter.future(half(adapter, f"stall{i}"), metadata=meta("a-pub"), timeout=60))
        wait_until(
            lambda: slots() >= 2 or (slots() == 1 and "TOO_MANY_PUSHES" in gen.log_path.read_text()[log_start:]),
            10,
            "both stalled pushes reached the replica (held a slot, or were refused one)",
        )
        assert slots() == 1, "team-a's stalled pushes hold every push slot of the replica"
        reply = push(fleet, "b-pub", "victim", seed=23)
        assert [r.code for r in reply.replicas] == ["OK"], reply
        req = pb.GenerateRequest(n=1, sampling=pb.SamplingParams(max_new_tokens=3, temperature=0.0))
        req.token_ids.ids.extend([5, 17, 33])
        req.adapter.name = "victim"
        started = next(m.started for m in fleet["stub"].Generate(req, metadata=meta("b-pub"), timeout=30))
        assert (started.adapter.name, started.adapter.version) == ("victim", 1)
    finally:
        release.set()
    assert {outcome(c)[1] for c in calls} <= {"PUSH_TOO_SLOW", "LENGTH_MISMATCH", "TOO_MANY_PUSHES", ""}


def upload_head(fleet, who: str, length: int) -> socket.socket:
    """An upload's request line and headers declaring `length` bytes, and its first bytes."""
    boundary = "b51"
    first = (f'--{boundary}\r\nContent-Disposition: form-data; name="adapter_model.safetensors"\r\n\r\n').encode()
    head = (
        f"POST /v1/upload_lora_adapter HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKENS[who]}\r\n"
        f"Content-Type: multipart/form-data; boundary={boundary}\r\nContent-Length: {length}\r\n\r\n"
    ).encode()
    s = socket.create_connection(("127.0.0.1", fleet["proxy"].http_port), timeout=10)
    s.sendall(head + first + b"\0" * 4096)
    return s


def answer(s: socket.socket, within: float = 5.0) -> int:
    """The status of the answer that comes while the body is still owed."""
    s.settimeout(within)
    data = s.recv(65536)
    return int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else 0


def test_http_uploads_are_bounded_by_the_tenants_room_and_the_doors_budget_before_they_are_held(fleet):
    """S4: team-a (quota 1 MiB) declares 1.5 MiB uploads: refused (429) before their bodies are
    read, and a second 600 KiB upload while one is held (the door's count is the tenant's); team-b declares two of 0.75 MiB (the door's budget: 2 MiB, a tenant's 1 MiB): the
    second is refused (429 UPLOADS_FULL) while the first is held unsent; meanwhile the fleet's
    own upload of a real adapter is published; the proxy's memory grows by less than one upload."""
    rss, held = proxy_rss(fleet), []
    try:
        for _ in range(4):
            s = upload_head(fleet, "a-pub", 3 * MiB // 2)
            held.append(s)
            assert answer(s) == 429
        # within its quota: counted whole from its Content-Length as its route starts, which is before
        # the next connection's can (that one is accepted, then read, in later turns of the proxy's loop)
        held.append(upload_head(fleet, "a-pub", 600 << 10))
        s = upload_head(fleet, "a-pub", 600 << 10)  # with the one held, over team-a's 1 MiB
        held.append(s)
        assert answer(s) == 429
        first = upload_head(fleet, "b-pub", 3 * MiB // 4)
        held.append(first)
        second = upload_head(fleet, "b-pub", 3 * MiB // 4)
        held.append(second)
        assert answer(second) == 429
        folder = peft_folder(fleet["model"], fleet["work"] / "uploaded", seed=31)
        files = {
            f: (fleet["work"] / "uploaded" / f).read_bytes()
            for f in ("adapter_config.json", "adapter_model.safetensors")
        }
        assert folder.payload == files["adapter_model.safetensors"]
        reply = requests.post(
            f"{fleet['proxy'].http_url}/v1/upload_lora_adapter",
            data={"lora_name": "uploaded-beside"},
            files=files,
            headers={"Authorization": f"Bearer {TOKENS['admin']}"},
            timeout=30,
        )
        assert reply.status_code == 200, reply.text
        assert proxy_rss(fleet) - rss < 16 * MiB
    finally:
        for s in held:
            s.close()


def test_a_score_is_charged_to_its_tenants_tokens_per_second(fleet):
    """S10: team-c may start 5 tokens of work per second (a 50-token window): a Score of 40
    tokens passes, the next is refused TENANT_QUOTA, where both passed before."""
    req = pb.ScoreRequest()
    for _ in range(4):
        seq = req.sequences.add()
        seq.prompt_token_ids.extend([5, 6, 7, 8, 9])
        seq.continuation_token_ids.extend([10, 11, 12, 13, 14])
    fleet["stub"].Score(req, metadata=meta("c-gen"), timeout=30)
    with pytest.raises(grpc.RpcError) as info:
        fleet["stub"].Score(req, metadata=meta("c-gen"), timeout=30)
    err = from_rpc_error(info.value)
    assert (err.code, err.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "TENANT_QUOTA")
    assert "a Score's tokens" in err.message
