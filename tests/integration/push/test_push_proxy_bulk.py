"""The proxy's intake of a client's bulk upload (issue 36): one reading thread, the gate's rules kept.

Real replicas and a real proxy over real sockets, and an adapter of several 1 MiB pieces (so the
header passes in the first and the relay carries pieces while later ones still arrive). Two
replicas listen for bulk bytes and one does not (`bulk.enabled` false: it offers nothing, so the
proxy sends it gRPC chunks from its event loop while its reading thread feeds the other two);
the proxy plans a star (`push.fanout=3`), so every replica is the proxy's own child.

Checked, each against what the replicas themselves count and log: a good upload reaches both
kinds of child and every replica serves the same weights; a header the proxy refuses opens no
replica's stream; a payload whose digest the proxy refuses never arrives whole at any replica
(the last piece is held until the proxy's verdict; each replica's byte counter stays below the
payload's size) and is staged nowhere; a client that goes away mid-upload (its bulk connection
closed, or its call cancelled) stages nothing, leaves nothing in the spool, and the same version
then publishes.
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
from pathlib import Path

import grpc
import pytest
from blake3 import blake3
from support.processes import start_generators, start_proxy, stop_all, wait_routable, wait_until
from support.wire import bulk_push, generate, make_adapter, metric_value, status

from rollwire.common import writer
from rollwire.common.bulk import connect as bulk_connect
from rollwire.common.bulk import parse_offer, token
from rollwire.common.reasons import Reason
from rollwire.common.writer import opening
from rollwire.push.reader import DIRECT_PIECE
from rollwire.v1 import generator_pb2_grpc

pytestmark = pytest.mark.integration  # starts processes: not in make test-fast

BULK_ON = ("--set", "bulk.enabled=true")
IDLE_S = 3.0
BYTES = "rollwire_generator_adapter_push_bytes_total"
PUSHES = "rollwire_generator_adapter_pushes_total"


@pytest.fixture(scope="module")
def replicas(tiny_model, workdir):
    services = start_generators(tiny_model, workdir, ["b1", "b2"], *BULK_ON)
    try:
        services += start_generators(tiny_model, workdir, ["c1"])  # no bulk endpoint: gRPC chunks
    except BaseException:
        stop_all(services)
        raise
    yield services
    stop_all(services)


@pytest.fixture(scope="module")
def spool(workdir) -> Path:
    return workdir / "spool"


@pytest.fixture(scope="module")
def proxy(replicas, workdir, spool):
    settings = (
        "push.fanout=3",
        "health.push_timeout_s=60",
        f"spool.upload_idle_timeout_s={IDLE_S}",
        f"spool.dir={spool}",
    )
    svc = start_proxy(workdir, "bulk-proxy", replicas, *BULK_ON, *(a for s in settings for a in ("--set", s)))
    wait_routable(svc, replicas)
    yield svc
    stop_all([svc])


@pytest.fixture(scope="module")
def big(tiny_model):
    """A real LoRA adapter of ten 1 MiB pieces (rank 512 on the tiny model): half of it is more
    than a replica's own bulk piece when it has no gRPC-chunk child (`reader.DIRECT_PIECE`)."""
    adapter = make_adapter(tiny_model, seed=36, r=512)
    assert len(adapter.payload) // 2 > DIRECT_PIECE + writer.MAX_CHUNK
    return adapter


def stub(target: str) -> generator_pb2_grpc.GeneratorServiceStub:
    return generator_pb2_grpc.GeneratorServiceStub(grpc.insecure_channel(target))


def counters(replicas) -> list[tuple[float, float]]:
    """Each replica's (payload bytes received, PushAdapter calls ended), from its own metrics."""
    out = []
    for r in replicas:
        text = r.metrics()
        ended = sum(metric_value(text, PUSHES, f'code="{c.name}"', default=0) for c in grpc.StatusCode)
        out.append((metric_value(text, BYTES, default=0), ended))
    return out


def holds(target: str, name: str) -> bool:
    return name in {a.name for a in status(target).adapters}


def staged(replica, name: str) -> list[dict]:
    lines = replica.log_path.read_text(errors="replace").splitlines()
    events = [json.loads(x) for x in lines if '"adapter_staged"' in x]
    return [e for e in events if e.get("adapter") == name]


def spool_has_nothing_of(spool: Path, name: str) -> bool:
    return not (spool / name).exists() and not list((spool / ".incoming").iterdir())


def test_a_bulk_upload_reaches_bulk_and_chunk_children_alike(proxy, replicas, big):
    """The proxy's reading thread feeds the two bulk lanes; the child without one gets gRPC
    chunks through the event loop; every replica counts exactly the payload's bytes."""
    fp = status(proxy.target).model_fingerprint
    before = counters(replicas)
    m = big.manifest("mixed", 1, fp, blake3=blake3(big.payload).hexdigest())
    assert bulk_push(proxy.target, m, big.payload) == (grpc.StatusCode.OK, "")
    after = counters(replicas)
    assert [a[0] - b[0] for a, b in zip(after, before, strict=True)] == [len(big.payload)] * 3
    assert [[e["path"] for e in staged(r, "mixed")] for r in replicas] == [["bulk"], ["bulk"], ["grpc"]]
    metrics = proxy.metrics()
    assert metric_value(metrics, "rollwire_proxy_push_path_total", 'path="bulk",reason="connected"') == 2
    assert metric_value(metrics, "rollwire_proxy_push_path_total", 'path="grpc",reason="no_offer"') == 1
    received = [e for e in _events(proxy.log_path, "adapter_upload_received") if e["adapter"] == "mixed"]
    assert [e["path"] for e in received] == ["bulk"]
    samples = [generate(r.target, "3+4=", n=2, adapter=("mixed", 1), max_new_tokens=6, seed=5) for r in replicas]
    assert samples[0].tokens == samples[1].tokens == samples[2].tokens


@pytest.mark.parametrize("digest", ["sha256", "blake3", "blake3 alone"])
def test_no_replica_receives_all_of_a_payload_whose_digest_the_proxy_refuses(digest, proxy, spool, replicas, big):
    """The sha256 wrong beside a right BLAKE3 (which is all a replica verifies then), or the reverse,
    or a wrong BLAKE3 with the sha256 left to the proxy: the proxy verifies both (names the
    sha256 only of bytes the BLAKE3 verified), and holds the completing piece back until it has
    (a striped relay: test_push_relay)."""
    fp = status(proxy.target).model_fingerprint
    wrong = hashlib.sha256(b"other bytes").hexdigest()  # 64 hex digits, as a BLAKE3's
    name = f"wrong-{digest.replace(' ', '-')}"
    b3 = blake3(big.payload).hexdigest() if digest == "sha256" else wrong
    sha256 = {"sha256": wrong, "blake3": big.sha256, "blake3 alone": ""}[digest]
    m = big.manifest(name, 1, fp, blake3=b3, sha256=sha256)
    before = counters(replicas)
    assert bulk_push(proxy.target, m, big.payload) == (grpc.StatusCode.INVALID_ARGUMENT, Reason.DIGEST_MISMATCH)
    # the header passed: every replica's stream opened and took pieces, then was cancelled
    wait_until(
        lambda: all(a[1] > b[1] for a, b in zip(counters(replicas), before, strict=True)),
        15,
        "each replica's push ended",
    )
    got = [a[0] - b[0] for a, b in zip(counters(replicas), before, strict=True)]
    assert all(0 < n < len(big.payload) for n in got), got  # never the whole: the last piece was held
    assert sum(got) > len(big.payload)  # several pieces each, not one: the relay ran while the bytes came
    assert not any(holds(r.target, name) or staged(r, name) for r in replicas)
    assert spool_has_nothing_of(spool, name)


def test_the_proxy_names_a_sha256_its_client_left_out_and_every_replica_serves_under_it(proxy, spool, replicas, big):
    """The SDK's bulk push leaves the sha256 to the proxy (`sha256_by_receiver`): the proxy hashes
    the bytes the BLAKE3 verified, spools and answers that sha256, and commits each replica's copy
    (staged by its BLAKE3, over either path) under it; each is hashlib's digest of the payload.
    The version is then known by its BLAKE3 too: the same bytes again are an idempotent success,
    other bytes under that version a conflict, refused before any byte is spooled."""
    from rollwire.client import Client
    from rollwire.common.errors import FailedPrecondition

    fp = status(proxy.target).model_fingerprint
    digest = hashlib.sha256(big.payload).hexdigest()
    with Client(proxy.target) as client:
        result = client.push_adapter("left", 1, big.payload, big.shape, fp, bulk=True)
        assert (result.sha256, result.already_loaded) == (digest, False)
        assert sorted((r.replica, r.code) for r in result.replicas) == [("b1", "OK"), ("b2", "OK"), ("c1", "OK")]
        assert [[e["path"] for e in staged(r, "left")] for r in replicas] == [["bulk"], ["bulk"], ["grpc"]]
        assert [dict(a.digests) for r in replicas for a in status(r.target).adapters if a.name == "left"] == [
            {1: digest}
        ] * 3
        assert [dict(a.digests) for a in status(proxy.target).adapters if a.name == "left"] == [{1: digest}]
        assert json.loads((spool / "left" / "1.json").read_text())["sha256"] == digest
        again = client.push_adapter("left", 1, big.payload, big.shape, fp, bulk=True)
        assert (again.already_loaded, again.sha256) == (True, digest)
        other = bytearray(big.payload)
        other[-1] ^= 1  # the last byte of the last tensor: still a valid file, other bytes
        with pytest.raises(FailedPrecondition) as err:
            client.push_adapter("left", 1, bytes(other), big.shape, fp, bulk=True)
        assert err.value.reason == Reason.VERSION_CONFLICT
    assert list((spool / ".incoming").iterdir()) == []
    samples = [generate(r.target, "3+4=", n=2, adapter=("left", 1), max_new_tokens=6, seed=5) for r in replicas]
    assert samples[0].tokens == samples[1].tokens == samples[2].tokens


@pytest.mark.parametrize("header", ["foreign tensor", "header of 2 pieces"])
def test_a_header_the_proxy_refuses_opens_no_replica_stream(header, proxy, spool, replicas, big):
    """A tensor no LoRA of this base has, in a header of one piece or of two (the proxy forwards
    nothing of the pieces before the header is complete and checked)."""
    import torch
    from safetensors.torch import save

    state = dict(big.state_dict)
    first = sorted(state)[0]
    state[first.replace("lora_A", "lora_Z")] = state.pop(first)
    if header == "header of 2 pieces":  # 40,000 more tensor names: a header of ~2.6 MB
        state |= {f"t{i}": torch.zeros(1) for i in range(40_000)}
    payload = save(state)
    head = int.from_bytes(payload[:8], "little")
    assert (head > writer.MAX_CHUNK) == (header == "header of 2 pieces") and len(payload) > head + 8
    fp = status(proxy.target).model_fingerprint
    m = big.manifest("bad-header", 1, fp, byte_length=len(payload), sha256=hashlib.sha256(payload).hexdigest())
    before = counters(replicas)
    code, _ = bulk_push(proxy.target, m, payload)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert counters(replicas) == before  # no stream opened, no byte sent
    assert spool_has_nothing_of(spool, "bad-header")


@pytest.mark.parametrize("how", ["closed", "cancelled"])
def test_a_client_gone_mid_bulk_upload_stages_nothing_and_leaves_no_file(how, proxy, spool, replicas, big):
    """Half the bytes over the bulk connection (the relay is open and carrying pieces), then the
    client closes that connection, or cancels its call with the connection still open."""
    fp = status(proxy.target).model_fingerprint
    name, payload = f"gone-{how}", big.payload
    m = big.manifest(name, 1, fp)
    before = counters(replicas)
    release = threading.Event()

    def requests():
        yield opening(m, bulk=True)
        release.wait(30)

    call = stub(proxy.target).PushAdapter.future(requests(), timeout=60)
    offer = parse_offer(call.initial_metadata())
    assert offer is not None
    sock = bulk_connect("127.0.0.1", offer, token(offer.secret, m, None), 3.0)
    sock.sendall(payload[: len(payload) // 2])
    # the relay carries pieces before the client goes: each replica received some
    wait_until(
        lambda: all(a[0] > b[0] for a, b in zip(counters(replicas), before, strict=True)), 15, "replicas receive pieces"
    )
    if how == "closed":
        sock.shutdown(socket.SHUT_RDWR)
        sock.close()
    else:
        call.cancel()
    release.set()
    with pytest.raises(grpc.RpcError if how == "closed" else grpc.FutureCancelledError):
        call.result(timeout=30)
    wait_until(
        lambda: all(a[1] > b[1] for a, b in zip(counters(replicas), before, strict=True)),
        15,
        "each replica's push ended",
    )
    wait_until(lambda: spool_has_nothing_of(spool, name), 10, "nothing of it is left in the spool")
    got = [a[0] - b[0] for a, b in zip(counters(replicas), before, strict=True)]
    assert all(0 < n < len(payload) for n in got), got
    assert not any(holds(r.target, name) or staged(r, name) for r in replicas)
    if how == "cancelled":
        sock.close()
    # the name is free again and the same version publishes: nothing was left half done
    assert bulk_push(proxy.target, m, payload) == (grpc.StatusCode.OK, "")
    assert all(holds(r.target, name) for r in replicas)


def _events(path: Path, event: str) -> list[dict]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if f'"{event}"' in line:
            record = json.loads(line)
            if record.get("event") == event:
                out.append(record)
    return out
