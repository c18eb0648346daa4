"""Pushes that cannot brick (issue 11, item 4): real replicas and proxies over real sockets.

Hostile payloads are refused fast by a replica and by the proxy without freezing either;
interrupted pushes (client cancel, client deadline, proxy SIGKILL) never leave a replica
unroutable nor a damaged version in the spool; a version every replica refuses is
quarantined; versions cannot use up a name; uploads time out when idle; replicas bound
concurrent pushes; the learner never publishes non-finite weights.
"""

from __future__ import annotations

import json
import math
import socket
import struct
import threading
import time
from pathlib import Path

import grpc
import pytest
from google.protobuf import json_format
from support.processes import start_generators, start_service, stop_all, wait_routable, wait_until
from support.wire import make_adapter, metric_value, push_messages, request, status

from rollwire.common.bulk import BlockingPush, Offer, parse_offer, token
from rollwire.common.bulk import close as bulk_close
from rollwire.common.bulk import connect as bulk_connect
from rollwire.common.errors import from_rpc_error
from rollwire.common.reasons import Reason
from rollwire.common.writer import opening
from rollwire.v1 import generator_pb2 as pb
from rollwire.v1 import generator_pb2_grpc

IDLE_S = 1.5
BULK_ON = ("--set", "bulk.enabled=true")
"""Every server here listens for bulk bytes too: a push takes the path its client asks for."""
PROXY_ARGS = ("--set", f"spool.upload_idle_timeout_s={IDLE_S}", *BULK_ON)


@pytest.fixture(scope="module")
def replicas(tiny_model, workdir):
    services = start_generators(
        tiny_model,
        workdir,
        ["s1", "s2"],
        "--set",
        f"limits.push_idle_timeout_s={IDLE_S}",
        "--set",
        "limits.max_concurrent_pushes=2",
        *BULK_ON,
    )
    yield services
    stop_all(services)


def start_proxy(workdir: Path, name: str, replicas, spool: Path | None = None, *extra: str):
    args = [
        "proxy",
        "--port",
        "0",
        "--metrics-port",
        "0",
        "--proxy-id",
        name,
        "--set",
        "health.interval_s=0.2",
        *PROXY_ARGS,
    ]
    if spool is not None:
        args += ["--set", f"spool.dir={spool}"]
    for g in replicas:
        args += ["--generator", g.target]
    return start_service(args + list(extra), workdir, name)


@pytest.fixture(scope="module")
def proxy(replicas, workdir):
    svc = start_proxy(workdir, "proxy", replicas, workdir / "spool")
    wait_routable(svc, replicas)
    yield svc
    stop_all([svc])


@pytest.fixture(scope="module")
def adapter(tiny_model):
    return make_adapter(tiny_model, seed=11)


def stub(target: str) -> generator_pb2_grpc.GeneratorServiceStub:
    return generator_pb2_grpc.GeneratorServiceStub(grpc.insecure_channel(target))


def refusal(target: str, manifest: pb.AdapterManifest, payload: bytes, timeout: float = 30, path: str = "grpc"):
    """The push's (code, reason, message), by the given path ("bulk": over the bulk connection
    when the receiver offers one at all, which it does only once it admitted the manifest)."""
    try:
        if path == "grpc":
            stub(target).PushAdapter(push_messages(manifest, payload), timeout=timeout)
        else:
            push = BlockingPush(manifest, payload, 1 << 20, "127.0.0.1", 3.0)
            call = stub(target).PushAdapter.future(push.requests(), timeout=timeout)
            push.attach(call)
            call.result()
    except grpc.RpcError as exc:
        err = from_rpc_error(exc)
        return err.code, err.reason, err.message
    return grpc.StatusCode.OK, "", ""


def raw_safetensors(header: dict | bytes, body: bytes) -> bytes:
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(head)) + head + body


def with_payload(adapter, name: str, version: int, fp: str, payload: bytes, **changes) -> pb.AdapterManifest:
    import hashlib

    return adapter.manifest(
        name, version, fp, byte_length=len(payload), sha256=hashlib.sha256(payload).hexdigest(), **changes
    )


def poisoned(adapter, dtype, value) -> bytes:
    from safetensors.torch import save

    state = {k: v.to(dtype).clone() for k, v in adapter.state_dict.items()}
    last = sorted(state)[-1]
    state[last].view(-1)[-1] = value
    return save(state)


def hostile_cases(adapter, fp: str) -> dict[str, tuple[pb.AdapterManifest, bytes]]:
    import torch

    cases = {}
    for label, dtype, value in [
        ("F32 NaN", torch.float32, math.nan),
        ("F32 +inf", torch.float32, math.inf),
        ("F32 -inf", torch.float32, -math.inf),
        ("BF16 NaN", torch.bfloat16, math.nan),
        ("F16 +inf", torch.float16, math.inf),
        ("F16 -inf", torch.float16, -math.inf),
    ]:
        payload = poisoned(adapter, dtype, value)
        cases[label] = (with_payload(adapter, "hostile", 1, fp, payload), payload)
    for alpha in (math.nan, math.inf, -1.0):
        lora = pb.LoraConfig(r=adapter.r, lora_alpha=alpha, target_modules=list(adapter.targets))
        cases[f"lora_alpha {alpha}"] = (adapter.manifest("hostile", 1, fp, lora_config=lora), adapter.payload)
    huge_dims = raw_safetensors({"x": {"dtype": "F32", "shape": [2**62] * 5000, "data_offsets": [0, 4]}}, b"\0" * 4)
    cases["huge dims"] = (with_payload(adapter, "hostile", 1, fp, huge_dims), huge_dims)
    digits = raw_safetensors(
        b'{"x": {"dtype": "F32", "shape": [' + b"9" * 4200 + b'], "data_offsets": [0, 4]}}', b"\0" * 4
    )
    cases["huge int"] = (with_payload(adapter, "hostile", 1, fp, digits), digits)
    deep = raw_safetensors(b"[" * 200_000 + b"]" * 200_000, b"")
    cases["deep nesting"] = (with_payload(adapter, "hostile", 1, fp, deep), deep)
    n = 17_000
    many = {f"t{i}": {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]} for i in range(n)}
    big = raw_safetensors(many, b"\0" * (4 * n))
    assert len(big) > 1_000_000
    cases["1 MB header"] = (with_payload(adapter, "hostile", 1, fp, big), big)
    return cases


class SmallRequests:
    """A well-behaved client: small Generate calls back to back, each timed."""

    def __init__(self, target: str) -> None:
        self.target, self.seconds, self.errors = target, [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        s = stub(self.target)
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                for _ in s.Generate(request("1+1=", n=1, max_new_tokens=2), timeout=10):
                    pass
            except grpc.RpcError as exc:
                self.errors.append(exc.code())
            self.seconds.append(time.monotonic() - started)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(15)


@pytest.mark.parametrize("path", ["grpc", "bulk"])
@pytest.mark.parametrize("where", ["replica", "proxy"])
def test_hostile_payloads_are_refused_fast_and_nothing_freezes(where, path, proxy, replicas, adapter):
    target = proxy.target if where == "proxy" else replicas[0].target
    fp = status(target).model_fingerprint
    cases = hostile_cases(adapter, fp)
    seen_before = pushes_ended(replicas)
    nonfinite_before = nonfinite_refusals(replicas[0], path)
    with SmallRequests(target) as small:
        time.sleep(0.3)
        for label, (manifest, payload) in cases.items():
            started = time.monotonic()
            code, reason, message = refusal(target, manifest, payload, path=path)
            took = time.monotonic() - started
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (label, code, reason, message)
            assert took < 1.0, (label, took)
            assert len(message) < 1000, label
        time.sleep(0.3)
    assert small.seconds and not small.errors and max(small.seconds) < 2.0, small.seconds
    assert "hostile" not in {a.name for a in status(target).adapters}
    if where == "proxy":  # refused by the proxy itself: nothing spooled, no replica saw these bytes
        assert not (proxy_spool(proxy) / "hostile").exists()
        assert pushes_ended(replicas) == seen_before
    else:  # the same count sees each refusal the replica made itself (the check above can fail)
        want = [seen_before[0] + len(cases), *seen_before[1:]]
        wait_until(lambda: pushes_ended(replicas) == want, 10, f"{len(cases)} pushes ended on {replicas[0].name}")
        # the six poisoned payloads passed the manifest, so their bytes came by the path asked for
        assert nonfinite_refusals(replicas[0], path) == nonfinite_before + 6


def nonfinite_refusals(replica, path: str) -> int:
    """NON_FINITE_WEIGHTS refusals in a replica's log whose bytes came by `path`."""
    return sum(
        1
        for line in replica.log_path.read_text(errors="replace").splitlines()
        if '"adapter_push_refused"' in line and '"NON_FINITE_WEIGHTS"' in line and f'"path": "{path}"' in line
    )


def pushes_ended(replicas) -> list[float]:
    """Each replica's PushAdapter calls ended so far, whatever their code."""
    name = "rollwire_generator_adapter_pushes_total"
    return [
        sum(metric_value(text, name, f'code="{c.name}"') for c in grpc.StatusCode)
        for text in (r.metrics() for r in replicas)
    ]


def proxy_spool(proxy) -> Path:
    return proxy.log_path.parent / "spool"


def test_a_version_at_the_top_of_the_range_is_refused_and_the_name_stays_usable(proxy, replicas, adapter):
    fp = status(proxy.target).model_fingerprint
    for target in (replicas[1].target, proxy.target):
        for version in (2**64 - 1, 2**53 + 1, 1_000_001):
            code, reason, _ = refusal(target, adapter.manifest("top", version, fp), adapter.payload)
            assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, Reason.VERSION_TOO_FAR), (target, version)
    reply = stub(proxy.target).PushAdapter(push_messages(adapter.manifest("top", 1, fp), adapter.payload), timeout=30)
    assert reply.version == 1 and len(reply.replicas) == 2
    assert all(r.code == "OK" for r in reply.replicas), reply.replicas


def test_idle_uploads_time_out_and_replicas_bound_concurrent_pushes(proxy, replicas, adapter):
    fp = status(proxy.target).model_fingerprint
    release = threading.Event()

    def stalled(name: str):
        yield pb.PushAdapterRequest(manifest=adapter.manifest(name, 1, fp))
        release.wait(10)

    results: dict[str, object] = {}

    def run(key: str, target: str, name: str) -> None:
        started = time.monotonic()
        try:
            stub(target).PushAdapter(stalled(name), timeout=20)
            results[key] = ("OK", time.monotonic() - started)
        except grpc.RpcError as exc:
            err = from_rpc_error(exc)
            results[key] = (err.code, err.reason, time.monotonic() - started)

    threads = [
        threading.Thread(target=run, args=(k, t, n))
        for k, t, n in [
            ("proxy", proxy.target, "idle1"),
            ("replica a", replicas[1].target, "idle2"),
            ("replica b", replicas[1].target, "idle3"),
        ]
    ]
    for t in threads:
        t.start()
    time.sleep(0.5)  # both replica slots are taken by stalled uploads: a third push is refused at once
    code, reason, message = refusal(replicas[1].target, adapter.manifest("idle4", 1, fp), adapter.payload)
    assert (code, reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, Reason.TOO_MANY_PUSHES), message
    for t in threads:
        t.join(15)
    release.set()
    for key, (code, reason, took) in results.items():
        assert (code, reason) == (grpc.StatusCode.DEADLINE_EXCEEDED, Reason.PUSH_IDLE), key
        assert IDLE_S - 0.1 < took < IDLE_S + 3, (key, took)
    spool = proxy_spool(proxy)
    assert not list((spool / ".incoming").iterdir())
    # the slots are free again
    reply = stub(replicas[1].target).PushAdapter(
        push_messages(adapter.manifest("idle5", 1, fp), adapter.payload), timeout=30
    )
    assert reply.version == 1


def spool_listing(spool: Path) -> dict[str, list[str]]:
    """Every file in the spool (hidden folders apart from .quarantine included)."""
    return {p.name: sorted(f.name for f in p.iterdir()) for p in sorted(spool.iterdir()) if p.is_dir()}


def assert_only_complete_versions(spool: Path) -> None:
    listing = spool_listing(spool)
    assert listing.get(".incoming", []) == [], listing
    for name, files in listing.items():
        if name.startswith("."):
            continue
        stems = {f.rsplit(".", 1)[0] for f in files}
        assert sorted(files) == sorted([f"{s}.json" for s in stems] + [f"{s}.safetensors" for s in stems]), listing
        for s in stems:  # each manifest parses and its payload has the declared size
            m = json_format.Parse((spool / name / f"{s}.json").read_text(), pb.AdapterManifest())
            assert (spool / name / f"{s}.safetensors").stat().st_size == m.byte_length


def test_interrupted_pushes_never_make_a_replica_unroutable(proxy, replicas, adapter):
    fp = status(proxy.target).model_fingerprint
    spool = proxy_spool(proxy)
    # 1. the client cancels mid-upload
    gate = threading.Event()

    def half():
        yield pb.PushAdapterRequest(manifest=adapter.manifest("cut", 1, fp))
        yield pb.PushAdapterRequest(chunk=adapter.payload[:1000])
        gate.wait(10)

    future = stub(proxy.target).PushAdapter.future(half(), timeout=30)
    # mid-upload: the proxy admitted the manifest and opened the upload's file
    wait_until(lambda: spool_listing(spool).get(".incoming"), 10, "the proxy is receiving the upload")
    future.cancel()
    gate.set()
    # 2. the client's deadline runs out while the proxy validates or fans out
    for version in (1, 2, 3):
        manifest = adapter.manifest("cut", version, fp)
        try:
            stub(proxy.target).PushAdapter(push_messages(manifest, adapter.payload), timeout=0.05 * version)
        except grpc.RpcError as exc:
            assert exc.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED), exc
    wait_routable(proxy, replicas, timeout=15)
    # a cut upload's partial file is removed, and a finished one is committed, after the client gave up
    wait_until(lambda: spool_listing(spool).get(".incoming", []) == [], 10, "no upload is left in .incoming")
    assert_only_complete_versions(spool)
    spooled = sorted(int(f.split(".")[0]) for f in spool_listing(spool).get("cut", []) if f.endswith(".json"))
    if spooled:  # whatever was committed reaches every replica
        wait_until(
            lambda: all(
                r.adapters
                and max((list(a.versions) for a in r.adapters if a.name == "cut"), default=[0])[-1] == spooled[-1]
                for r in status(proxy.target).replicas
            ),
            15,
            "every replica holds the newest committed version",
        )
    wait_routable(proxy, replicas, timeout=5)


def test_a_proxy_killed_mid_upload_restarts_on_a_clean_spool(workdir, replicas, adapter):
    spool = workdir / "killed-spool"
    svc = start_proxy(workdir, "killed", replicas, spool)
    wait_routable(svc, replicas)
    fp = status(svc.target).model_fingerprint
    stub(svc.target).PushAdapter(push_messages(adapter.manifest("kill", 1, fp), adapter.payload), timeout=30)
    gate = threading.Event()

    def slow():
        yield pb.PushAdapterRequest(manifest=adapter.manifest("kill", 2, fp))
        yield pb.PushAdapterRequest(chunk=adapter.payload[:5000])
        gate.wait(10)

    future = stub(svc.target).PushAdapter.future(slow(), timeout=30)
    wait_until(lambda: list((spool / ".incoming").iterdir()), 5, "the upload is in .incoming")
    svc.proc.kill()  # SIGKILL mid-upload
    svc.proc.wait(10)
    gate.set()
    with pytest.raises(grpc.RpcError):
        future.result(timeout=10)
    # what a crash between the steps of a commit can leave
    (spool / "kill" / ".3.json.1234.tmp").write_text("{")
    (spool / "kill" / "4.safetensors").write_bytes(adapter.payload)
    (spool / "kill" / "5.json").write_text(json_format.MessageToJson(adapter.manifest("kill", 5, fp)))
    assert list((spool / ".incoming").iterdir())
    again = start_proxy(workdir, "killed-again", replicas, spool)
    try:
        assert spool_listing(spool)["kill"] == ["1.json", "1.safetensors"]
        assert_only_complete_versions(spool)
        wait_routable(again, replicas, timeout=15)
        assert all(
            1 in {v for a in r.adapters if a.name == "kill" for v in a.versions} for r in status(again.target).replicas
        )
    finally:
        stop_all([again])


def test_a_version_every_replica_refuses_is_quarantined(workdir, replicas, adapter, tiny_model):
    """A well-formed version that does not fit the base model (planted before the proxy
    starts) is refused by every replica: it leaves the spool and the replicas serve."""
    import hashlib

    from safetensors.torch import save

    fp = status(replicas[0].target).model_fingerprint
    spool = workdir / "planted-spool"
    (spool / "planted").mkdir(parents=True)
    good = make_adapter(tiny_model, seed=12)
    bad_state = {k.replace("layers.0.", "layers.77."): v for k, v in good.state_dict.items()}
    bad = save(bad_state)
    for version, payload in ((2, good.payload), (3, bad)):
        m = good.manifest("planted", version, fp, byte_length=len(payload), sha256=hashlib.sha256(payload).hexdigest())
        (spool / "planted" / f"{version}.safetensors").write_bytes(payload)
        (spool / "planted" / f"{version}.json").write_text(json_format.MessageToJson(m))
    svc = start_proxy(workdir, "planted", replicas, spool)
    try:
        wait_routable(svc, replicas, timeout=20)
        assert spool_listing(spool)["planted"] == ["2.json", "2.safetensors"]
        quarantined = sorted(p.suffix for p in (spool / ".quarantine" / "planted").iterdir())
        assert quarantined == [".json", ".safetensors", ".txt"]
        assert metric_value(svc.metrics(), "rollwire_proxy_quarantined_versions_total") == 1
        for r in status(svc.target).replicas:
            assert {v for a in r.adapters if a.name == "planted" for v in a.versions} == {2}, r
        # the number is free again: a good v3 is accepted everywhere
        reply = stub(svc.target).PushAdapter(push_messages(good.manifest("planted", 3, fp), good.payload), timeout=30)
        assert all(x.code == "OK" for x in reply.replicas), reply.replicas
    finally:
        stop_all([svc])


# -- the learner's guard -------------------------------------------------------------------
async def test_the_publisher_never_pushes_non_finite_weights(adapter):
    import torch

    from rollwire.learner.publish.publisher import NonFiniteWeights, Publisher
    from rollwire.learner.rollouts.buffer import Signal

    class Target:
        pushed: list[int] = []

        async def push_adapter(self, name, version, payload, lora, fingerprint):
            self.pushed.append(version)

    target = Target()
    pub = Publisher(target, "policy", "fp", {}, Signal(), 0.01)
    for dtype in (torch.float32, torch.bfloat16):
        with pytest.raises(NonFiniteWeights, match=r"version 7 .* tensor base_model\.model\..*lora_"):
            await pub.publish(7, poisoned(adapter, dtype, math.nan))
    assert target.pushed == []


def test_the_trainer_stops_on_non_finite_weights_naming_tensor_and_step(tiny_model):
    import torch

    from rollwire.learner.config import TrainSection
    from rollwire.learner.publish.publisher import NonFiniteWeights
    from rollwire.learner.train.trainer import Trainer

    trainer = Trainer(tiny_model, TrainSection(), temperature=1.0, seed=0)
    assert trainer.adapter_payload()  # finite: fine
    trainer.last_step = (3, 12)
    _name, param = next((n, p) for n, p in trainer.model.named_parameters() if "lora_B" in n)
    with torch.no_grad():
        param.view(-1)[0] = math.inf
    with pytest.raises(NonFiniteWeights, match=r"lora_B.* after optimiser step 3 .*version 12"):
        trainer.adapter_payload()


pytestmark = pytest.mark.integration  # starts processes or servers: not in make test-fast


class BulkAsk:
    """A push to `target` that asks for the bulk path and stops after its opening: the test
    then drives the bulk connection by hand (`offer`), and `release()` ends the stream."""

    def __init__(self, target: str, manifest: pb.AdapterManifest, *after: pb.PushAdapterRequest) -> None:
        self.manifest, self.release = manifest, threading.Event()

        def requests():
            yield opening(manifest, bulk=True)
            self.release.wait(20)
            yield from after

        self.call = stub(target).PushAdapter.future(requests(), timeout=20)
        offer = parse_offer(self.call.initial_metadata())
        assert offer is not None
        self.offer: Offer = offer

    def connect(self, manifest: pb.AdapterManifest | None = None) -> socket.socket:
        proof = token(self.offer.secret, manifest or self.manifest, None)
        return bulk_connect("127.0.0.1", self.offer, proof, 3.0)

    def refused(self, manifest: pb.AdapterManifest | None = None) -> bool:
        """A connection with this token is closed before the receiver's ACK (not taken)."""
        try:
            self.connect(manifest).close()
        except ConnectionRefusedError:
            return True
        return False

    def outcome(self) -> tuple:
        self.release.set()
        try:
            self.call.result()
        except grpc.RpcError as exc:
            err = from_rpc_error(exc)
            return err.code, err.reason
        return grpc.StatusCode.OK, ""


def closed_by_peer(sock: socket.socket) -> bool:
    """The receiver closed the connection (without a byte) within a few seconds."""
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    finally:
        sock.close()


def test_a_bulk_connection_opens_only_its_own_push_once_and_is_bounded_like_a_stream(replicas, adapter):
    target = replicas[1].target
    fp = status(target).model_fingerprint
    payload = adapter.payload
    # a token made for another version (or a hello that is not one) opens nothing; the push's own does, once
    ask = BulkAsk(target, adapter.manifest("bulk-bound", 1, fp))
    assert ask.refused(adapter.manifest("bulk-bound", 2, fp))
    junk = socket.create_connection(("127.0.0.1", ask.offer.port), timeout=3)
    junk.sendall(b"GET / HTTP/1.1\r\n\r\n" + b"x" * 64)
    assert closed_by_peer(junk)
    sock = ask.connect()
    sock.sendall(payload)
    bulk_close(sock)  # returns once the receiver has every byte
    assert ask.refused()  # the same token a second time, before the push ended
    assert ask.outcome() == (grpc.StatusCode.OK, "")
    assert 1 in {v for a in status(target).adapters if a.name == "bulk-bound" for v in a.versions}
    # bytes that end early are a truncated upload; a connection that goes silent, an idle one
    ask = BulkAsk(target, adapter.manifest("bulk-short", 1, fp))
    sock = ask.connect()
    sock.sendall(payload[: len(payload) // 2])
    bulk_close(sock)
    assert ask.outcome() == (grpc.StatusCode.INVALID_ARGUMENT, Reason.LENGTH_MISMATCH)
    ask = BulkAsk(target, adapter.manifest("bulk-idle", 1, fp))
    sock = ask.connect()
    started = time.monotonic()
    sock.sendall(payload[:1000])
    assert ask.outcome() == (grpc.StatusCode.DEADLINE_EXCEEDED, Reason.PUSH_IDLE)
    assert IDLE_S - 0.1 < time.monotonic() - started < IDLE_S + 3
    sock.close()
    # a chunk on the stream after the bulk bytes is one too many
    ask = BulkAsk(target, adapter.manifest("bulk-extra", 1, fp), pb.PushAdapterRequest(chunk=b"x"))
    sock = ask.connect()
    sock.sendall(payload)
    bulk_close(sock)
    assert ask.outcome() == (grpc.StatusCode.INVALID_ARGUMENT, Reason.LENGTH_MISMATCH)
    assert not {"bulk-short", "bulk-idle", "bulk-extra"} & {a.name for a in status(target).adapters}
