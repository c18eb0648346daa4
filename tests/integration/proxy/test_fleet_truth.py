"""One truth across the fleet (issue 23): real replicas and proxies over real sockets.

**One base model.** A replica of another base model (same shapes, another fingerprint: a
mis-configured pod, a canary) that answers a restarted proxy first costs nothing: the spool
is intact, the right replicas serve and take pushes, the wrong one is refused membership by
name (status, log, metric, and its registration heartbeat), and its BASE_MODEL_MISMATCH
refusals never count towards quarantine. A declared base model quarantines spooled versions
of another at start; a spool of two base models with none declared refuses the start.

**One digest per version.** A replica that holds (name, N) with other bytes than the spool's
(pushed to it behind the proxy's back) reports them in GetStatus; the proxy never routes it
that version, logs and counts the conflict, the push reply names it, and catch-up treats
VERSION_CONFLICT as a fault, never as "already held".

**A fleet fault is not multiplied by every client.** The SDK tries a proxy's
ATTEMPTS_EXHAUSTED or NO_REPLICA once more at most, and a client's server-decided retries draw
on a token bucket, so N calls during an outage cost the proxy about N requests, not N x
(deadline / backoff).

**A refusal that is not for good is decided.** A replica that fails a catch-up for now (here:
busy, its only push slot held) is retried `health.catch_up_attempts` times, then routed what
it holds instead of being kept out for as long as the failure lasts.

**No slot one caller can hold.** Stripe streams that deliver their stripe and leave (with a
28-hour deadline) hold a replica's push slots only while a stream is open, then for
`limits.stripe_linger_s` at most; a plain push (a heal, a catch-up) takes such a slot at once.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import grpc
import pytest
from google.protobuf import json_format
from support.processes import free_port, start_generators, start_proxy, stop_all, wait_routable, wait_until
from support.wire import admin, generate, make_adapter, metric_value, push, status

from rollwire.common import writer
from rollwire.common.errors import from_rpc_error
from rollwire.common.reasons import Reason
from rollwire.common.retries import push_refused_for_good
from rollwire.common.writer import stripe_messages
from rollwire.push.plan import grant_key, grant_plan, plan_from_parents
from rollwire.v1 import admin_pb2 as apb
from rollwire.v1 import admin_pb2_grpc, generator_pb2_grpc
from rollwire.v1 import generator_pb2 as pb

pytestmark = pytest.mark.integration  # starts processes: not in make test-fast
LINGER_S = 1.5


@pytest.fixture(scope="module")
def other_model(tiny_model, tmp_path_factory) -> Path:
    """The tiny model with one more config key: the same shapes, another fingerprint."""
    folder = tmp_path_factory.mktemp("other-model") / "tiny"
    shutil.copytree(tiny_model, folder)
    config = json.loads((folder / "config.json").read_text())
    config["rollwire_test_variant"] = "another base model"
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def right(tiny_model, workdir):
    services = start_generators(tiny_model, workdir, ["right1", "right2"])
    yield services
    stop_all(services)


@pytest.fixture(scope="module")
def wrong(other_model, workdir):
    services = start_generators(other_model, workdir, ["wrong"])
    yield services[0]
    stop_all(services)


@pytest.fixture(scope="module")
def slots(tiny_model, workdir):
    """A replica with the default two push slots and a short stripe linger."""
    services = start_generators(tiny_model, workdir, ["slots"], "--set", f"limits.stripe_linger_s={LINGER_S}")
    yield services[0]
    stop_all(services)


@pytest.fixture(scope="module")
def adapter(tiny_model):
    return make_adapter(tiny_model, seed=23)


def refusal(call) -> tuple[grpc.StatusCode, str, str]:
    try:
        call()
    except grpc.RpcError as exc:
        err = from_rpc_error(exc)
        return err.code, err.reason, err.message
    return grpc.StatusCode.OK, "", ""


def replica_status(proxy, address: str) -> pb.ReplicaStatus | None:
    return next((r for r in status(proxy.target).replicas if r.address == address), None)


def spooled(spool: Path, name: str) -> list[str]:
    return sorted(p.name for p in (spool / name).iterdir()) if (spool / name).is_dir() else []


def quarantined(spool: Path) -> list[str]:
    folder = spool / ".quarantine"
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else []


def settled(proxy, address: str) -> bool:
    """The proxy has judged the replica: it routes to it, or it refused it membership."""
    r = replica_status(proxy, address)
    return r is not None and (r.healthy or "refused membership" in r.detail)


def log_events(path: Path, event: str) -> list[dict]:
    records = []
    for line in path.read_text(errors="replace").splitlines():
        if f'"{event}"' in line:
            records.append(json.loads(line))
    return records


def plant(spool: Path, adapter, name: str, version: int, fp: str) -> None:
    """A version written into a spool folder as a proxy would have committed it."""
    (spool / name).mkdir(parents=True, exist_ok=True)
    (spool / name / f"{version}.safetensors").write_bytes(adapter.payload)
    (spool / name / f"{version}.json").write_text(json_format.MessageToJson(adapter.manifest(name, version, fp)))


def test_a_wrong_model_replica_answering_a_restarted_proxy_first_costs_nothing(workdir, right, wrong, adapter):
    fp, other = status(right[0].target).model_fingerprint, status(wrong.target).model_fingerprint
    assert fp != other
    spool = workdir / "spool-restart"
    first = start_proxy(workdir, "first", right, "--set", f"spool.dir={spool}")
    try:
        wait_routable(first, right)
        for version in (1, 2):
            push(first.target, adapter.manifest("pol", version, fp), adapter.payload)
    finally:
        stop_all([first])
    # the proxy restarts on its spool with the wrong replica alone: it answers first
    again = start_proxy(workdir, "again", [wrong], "--set", f"spool.dir={spool}")
    try:
        wait_until(lambda: settled(again, wrong.target), 20, "the proxy judged the wrong replica")
        assert spooled(spool, "pol") == ["1.json", "1.safetensors", "2.json", "2.safetensors"]
        assert quarantined(spool) == []
        for r in right:
            admin(again.target).RegisterGenerator(apb.RegisterGeneratorRequest(address=r.target), timeout=10)
        wait_routable(again, right, timeout=30)
        # the spool is intact, nothing counted towards quarantine, the right replicas serve v2
        assert spooled(spool, "pol") == ["1.json", "1.safetensors", "2.json", "2.safetensors"]
        assert quarantined(spool) == []
        metrics = again.metrics()
        assert metric_value(metrics, "rollwire_proxy_quarantined_versions_total") == 0
        assert status(again.target).model_fingerprint == fp
        for r in right:
            held = replica_status(again, r.target)
            assert (
                held is not None
                and held.healthy
                and 2 in {v for a in held.adapters if a.name == "pol" for v in a.versions}
            )
            assert metric_value(metrics, "rollwire_proxy_replica_foreign_base_model", f'replica="{r.target}"') == 0
        # the wrong one is refused membership, by name, with both base models
        w = replica_status(again, wrong.target)
        assert w is not None and not w.healthy
        assert "refused membership" in w.detail and "wrong" in w.detail and other in w.detail and fp in w.detail
        assert metric_value(metrics, "rollwire_proxy_replica_foreign_base_model", f'replica="{wrong.target}"') == 1
        assert '"replica_refused_membership"' in again.log_path.read_text()
        # pushes of the fleet's base model land on the right replicas only; another base model is refused
        reply = push(again.target, adapter.manifest("pol", 3, fp), adapter.payload)
        codes = {x.address: x.code for x in reply.replicas}
        assert codes[right[0].target] == codes[right[1].target] == "OK" and codes[wrong.target] != "OK", codes
        code, reason, _ = refusal(lambda: push(again.target, adapter.manifest("pol", 4, other), adapter.payload))
        assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, Reason.BASE_MODEL_MISMATCH)
        # and no group is ever placed on the wrong replica
        for seed in range(4):
            g = generate(again.target, "3+4=", n=2, adapter=("pol", 0), max_new_tokens=3, seed=seed)
            assert g.started.adapter.version == 3 and g.started.replica in ("right1", "right2")
        assert (
            metric_value(
                again.metrics(), "rollwire_proxy_replica_attempts_total", f'code="OK",replica="{wrong.target}"'
            )
            == 0
        )
    finally:
        stop_all([again])


def test_a_declared_base_model_quarantines_other_versions_and_refuses_a_wrong_registration(
    workdir, right, wrong, adapter
):
    fp, other = status(right[0].target).model_fingerprint, status(wrong.target).model_fingerprint
    spool = workdir / "spool-declared"
    plant(spool, adapter, "pol", 1, fp)
    plant(spool, adapter, "stray", 1, other)  # another base model's version: no replica here could serve it
    proxy = start_proxy(workdir, "declared", right[:1], "--set", f"spool.dir={spool}", "--set", f"base_model={fp}")
    try:
        assert spooled(spool, "pol") == ["1.json", "1.safetensors"] and spooled(spool, "stray") == []
        notes = [p for p in (spool / ".quarantine" / "stray").iterdir() if p.suffix == ".txt"]
        assert len(notes) == 1 and "declares" in notes[0].read_text() and other in notes[0].read_text()
        wait_routable(proxy, right[:1])
        # a replica of another base model registers itself: judged, then its heartbeat is refused by name
        stub = admin(proxy.target)
        stub.RegisterGenerator(apb.RegisterGeneratorRequest(address=wrong.target, ttl_seconds=30), timeout=10)
        wait_until(
            lambda: "refused membership" in (replica_status(proxy, wrong.target) or pb.ReplicaStatus()).detail,
            20,
            "the proxy refused the wrong replica membership",
        )
        beat = apb.RegisterGeneratorRequest(address=wrong.target, ttl_seconds=30)
        code, reason, message = refusal(lambda: stub.RegisterGenerator(beat, timeout=10))
        assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, Reason.BASE_MODEL_MISMATCH)
        assert "wrong" in message and wrong.target in message and other in message
        assert wrong.target not in {r.address for r in status(proxy.target).replicas}
        assert {r.address for r in status(proxy.target).replicas if r.healthy} == {right[0].target}
    finally:
        stop_all([proxy])


def test_a_spool_of_two_base_models_with_none_declared_refuses_the_start(tmp_path, adapter):
    from rollwire.common.errors import FailedPrecondition
    from rollwire.proxy.fleet.basemodel import BaseModel
    from rollwire.proxy.spool import Spool

    a, b = "sha256:" + "a" * 32, "sha256:" + "b" * 32
    plant(tmp_path, adapter, "one", 1, a)
    plant(tmp_path, adapter, "two", 1, b)
    spool = Spool(tmp_path, max_bytes=1 << 30, keep_versions=3, max_adapter_bytes=1 << 30)
    with pytest.raises(FailedPrecondition, match=r"2 base models .*base_model") as caught:
        BaseModel("", spool)
    assert a in str(caught.value) and b in str(caught.value)
    assert BaseModel(a, spool).fingerprint == a  # declared: the other one is quarantined instead
    assert [n for n in spool.names()] == ["one"]


def test_base_model_mismatch_judges_the_receiver_never_the_bytes():
    assert not push_refused_for_good(grpc.StatusCode.FAILED_PRECONDITION, Reason.BASE_MODEL_MISMATCH)
    assert push_refused_for_good(grpc.StatusCode.INVALID_ARGUMENT, Reason.DIGEST_MISMATCH)


def test_a_malformed_declared_base_model_is_refused_by_its_key():
    from pydantic import ValidationError

    from rollwire.proxy.config import ProxyConfig

    with pytest.raises(ValidationError, match="base_model"):
        ProxyConfig(base_model="tiny")


# -- one digest per version ------------------------------------------------------------------
def test_a_version_held_with_other_bytes_is_never_routed_and_is_reported(workdir, right, tiny_model, adapter):
    fp = status(right[0].target).model_fingerprint
    other = make_adapter(tiny_model, seed=24)
    proxy = start_proxy(workdir, "digests", right, "--set", f"spool.dir={workdir / 'spool-digests'}")
    try:
        wait_routable(proxy, right)
        push(proxy.target, adapter.manifest("dig", 1, fp), adapter.payload)
        # behind the proxy's back, right2 gets other bytes as v2; GetStatus says which
        push(right[1].target, other.manifest("dig", 2, fp), other.payload)
        held = next(a for a in status(right[1].target).adapters if a.name == "dig")
        assert dict(held.digests) == {1: adapter.sha256, 2: other.sha256}
        # the fleet's v2: the reply names the replica that holds other bytes, never OK for it
        reply = push(proxy.target, adapter.manifest("dig", 2, fp), adapter.payload)
        results = {x.address: x for x in reply.replicas}
        assert results[right[0].target].code == "OK"
        assert (results[right[1].target].code, results[right[1].target].reason) == (
            "FAILED_PRECONDITION",
            Reason.VERSION_CONFLICT,
        )

        def conflicts() -> float:
            return metric_value(
                proxy.metrics(), "rollwire_proxy_replica_digest_conflicts", f'replica="{right[1].target}"'
            )

        wait_until(lambda: conflicts() == 1, 10, "the proxy counts right2's conflict", every=0.2)
        r2 = replica_status(proxy, right[1].target)
        assert r2 is not None and 2 not in {v for a in r2.adapters if a.name == "dig" for v in a.versions}
        assert "dig v2 with other bytes" in r2.detail, r2.detail
        logged = [e for e in log_events(proxy.log_path, "replica_digest_conflict") if e["adapter"] == "dig"]
        assert {e["replica"] for e in logged} == {right[1].target} and logged[-1]["version"] == 2
        # v2, latest or pinned, is only ever served by the replica that holds the spool's bytes
        for seed in range(6):
            for version in (0, 2):
                g = generate(proxy.target, "3+4=", n=1, adapter=("dig", version), max_new_tokens=2, seed=seed)
                assert (g.started.adapter.version, g.started.replica) == (2, "right1")
        # a newer version lands everywhere; right2 serves it, still never v2
        reply = push(proxy.target, adapter.manifest("dig", 3, fp), adapter.payload)
        assert {x.code for x in reply.replicas} == {"OK"}, reply.replicas
        wait_routable(proxy, right, timeout=15)
        r2 = replica_status(proxy, right[1].target)
        assert r2 is not None and {v for a in r2.adapters if a.name == "dig" for v in a.versions} == {1, 3}
        assert conflicts() == 1
    finally:
        stop_all([proxy])


# -- no slot one caller can hold -------------------------------------------------------------
def test_abandoned_stripe_streams_hold_no_slot_past_the_servers_bound(slots, adapter):
    target, payload = slots.target, adapter.payload
    fp = status(target).model_fingerprint

    def used() -> float:
        return metric_value(slots.metrics(), "rollwire_generator_push_slots_used")

    def first_stripe(name: str, version: int, index: int = 0, deadline_s: float = 10):
        stripe = pb.Stripe(index=index, count=2, chunk_bytes=64 << 10)
        messages = stripe_messages(adapter.manifest(name, version, fp), payload, stripe)
        return stub.PushAdapter(messages, timeout=deadline_s)

    with grpc.insecure_channel(target) as channel:
        stub = generator_pb2_grpc.GeneratorServiceStub(channel)
        # two callers with a 28-hour deadline deliver stripe 0 of 2 and leave at once: both slots taken
        for version in (1, 2):
            assert first_stripe("orphan", version, deadline_s=28 * 3600).stripe_pending
        left = time.monotonic()
        assert used() == 2
        # a heal or a catch-up (a plain push) finds a slot at once: the oldest assembly gives its up
        reply = stub.PushAdapter(writer.messages(adapter.manifest("plain", 1, fp), payload), timeout=10)
        assert reply.version == 1 and not reply.stripe_pending
        # the other is dropped within the server's bound, with nobody asking for its slot
        wait_until(lambda: used() == 0, LINGER_S + 5, "every push slot is free", every=0.2)
        assert time.monotonic() - left < LINGER_S + 3
        drops = {e["version"]: e["why"] for e in log_events(slots.log_path, "stripe_assembly_dropped")}
        assert "needed its slot" in drops[1] and f"within {LINGER_S:g}s" in drops[2], drops
        # a missing stripe that comes late starts a new assembly: pending, never a verdict on half a payload
        late = first_stripe("orphan", 2, index=1)
        assert late.stripe_pending and not late.staged
        wait_until(lambda: used() == 0, LINGER_S + 5, "the late stripe's slot is free again", every=0.2)


# -- a fleet fault is not multiplied by every client -----------------------------------------
def test_the_sdk_does_not_multiply_a_fleet_fault(workdir):
    from rollwire.client import Client
    from rollwire.common.errors import Unavailable

    proxy = start_proxy(
        workdir,
        "no-fleet",
        [],
        "--generator",
        "127.0.0.1:1",  # nothing listens there: no replica will ever be routable
        "--set",
        "routing.no_replica_wait_s=0.05",
        "--set",
        "routing.retry_after_s=0.05",
    )

    def requests() -> float:
        labels = 'code="UNAVAILABLE",policy="least-loaded"'
        return metric_value(proxy.metrics(), "rollwire_proxy_requests_total", labels)

    try:
        with Client(proxy.target, timeout=8) as client:
            started = time.monotonic()
            with pytest.raises(Unavailable) as caught:
                client.generate("3+4=", n=1, max_new_tokens=2)
            assert caught.value.reason == Reason.NO_REPLICA
            assert requests() == 2 and time.monotonic() - started < 4  # one more try, not until the deadline
            for _ in range(19):
                with pytest.raises(Unavailable):
                    client.generate("3+4=", n=1, max_new_tokens=2)
            # 20 calls: 20 requests and the budget's few retries (10 tokens, none below half)
            assert requests() == 22
    finally:
        stop_all([proxy])


# -- a refusal that is not for good is decided -------------------------------------------------
def test_a_replica_failing_catch_up_for_now_is_decided_within_the_bound(workdir, tiny_model, right, adapter):
    fp = status(right[0].target).model_fingerprint
    (slotted,) = start_generators(
        tiny_model,
        workdir,
        ["slotted"],
        "--set",
        "limits.max_concurrent_pushes=1",
        "--set",
        "limits.push_idle_timeout_s=60",
    )
    gate = threading.Event()

    def hold():  # a push that keeps the replica's only slot: every catch-up gets TOO_MANY_PUSHES
        yield pb.PushAdapterRequest(manifest=adapter.manifest("holder", 1, fp))
        yield pb.PushAdapterRequest(chunk=adapter.payload[:1000])
        gate.wait(60)

    channel = grpc.insecure_channel(slotted.target)
    held = generator_pb2_grpc.GeneratorServiceStub(channel).PushAdapter.future(hold(), timeout=90)
    spool = workdir / "spool-busy"
    plant(spool, adapter, "busy", 1, fp)
    proxy = None
    try:
        wait_until(
            lambda: metric_value(slotted.metrics(), "rollwire_generator_push_slots_used") == 1, 10, "the slot is held"
        )
        proxy = start_proxy(
            workdir,
            "decides",
            [right[0], slotted],
            "--set",
            f"spool.dir={spool}",
            "--set",
            "health.catch_up_attempts=3",
        )
        # 3 health rounds of 0.2 s, not as long as the slot stays held (60 s here)
        wait_routable(proxy, [right[0], slotted], timeout=15)
        metrics = proxy.metrics()
        assert metric_value(metrics, "rollwire_proxy_catchup_gave_up_total", f'replica="{slotted.target}"') == 1
        assert metric_value(metrics, "rollwire_proxy_quarantined_versions_total") == 0  # busy says nothing of the bytes
        assert spooled(spool, "busy") == ["1.json", "1.safetensors"]
        s = replica_status(proxy, slotted.target)
        assert s is not None and s.healthy and "lacks busy v1" in s.detail, s
        gave_up = log_events(proxy.log_path, "catch_up_gave_up")
        assert [(e["replica"], e["adapter"], e["attempts"], e["code"]) for e in gave_up] == [
            (slotted.target, "busy", 3, "RESOURCE_EXHAUSTED")
        ]
        # it is routed what it holds: "busy" v1 only ever lands where it is held
        for seed in range(4):
            g = generate(proxy.target, "3+4=", n=1, adapter=("busy", 0), max_new_tokens=2, seed=seed)
            assert (g.started.adapter.version, g.started.replica) == (1, "right1")
    finally:
        gate.set()
        held.cancel()
        channel.close()
        stop_all([p for p in (proxy, slotted) if p is not None])


# -- relay plans: only the members a proxy planned --------------------------------------------
ADMIN_TOKEN, RELAY_TOKEN, REGISTER_TOKEN, GENERATE_TOKEN = "admin-23", "relay-23", "register-23", "generate-23"
OPERATOR_TOKEN = "operator-23"
"""A proxy's own admin token where the replicas' (ADMIN_TOKEN) is what it dials them with: never one
token for both (proxy.app.check_own_credentials)."""


def bearer_of(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


@pytest.fixture(scope="module")
def tokens(workdir) -> dict[str, Path]:
    files = {}
    for role, token in (
        ("admin", ADMIN_TOKEN),
        ("relay", RELAY_TOKEN),
        ("register", REGISTER_TOKEN),
        ("generate", GENERATE_TOKEN),
        ("operator", OPERATOR_TOKEN),
    ):
        files[role] = workdir / f"{role}-23.token"
        files[role].write_text(token + "\n")
    return files


@pytest.fixture(scope="module")
def guarded(tiny_model, workdir, tokens):
    """Two replicas with auth on: admin, relay and generate tokens."""
    auth = [
        *("--set", f"auth.admin_tokens_file={tokens['admin']}"),
        *("--set", f"auth.relay_tokens_file={tokens['relay']}"),
        *("--set", f"auth.generate_tokens_file={tokens['generate']}"),
    ]
    services = start_generators(tiny_model, workdir, ["guard1", "guard2"], *auth)
    yield services
    stop_all(services)


class Listener:
    """A gRPC server that is no replica: it records the authorization each call carries and
    fails it with a text of its own (what a port scan through a relay would read)."""

    BANNER = "secret-banner-of-an-internal-service"

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.calls = threading.Event()

        def refuse(request_iterator, context):
            self.seen += [v for k, v in context.invocation_metadata() if k == "authorization"] or [""]
            self.calls.set()
            context.abort(grpc.StatusCode.INTERNAL, self.BANNER)

        handler = grpc.method_handlers_generic_handler(
            "rollwire.v1.GeneratorService", {"PushAdapter": grpc.stream_unary_rpc_method_handler(refuse)}
        )
        from concurrent.futures import ThreadPoolExecutor

        self.server = grpc.server(ThreadPoolExecutor(2), handlers=[handler])
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.address = f"127.0.0.1:{self.port}"


def granted(nodes: list[str], manifest: pb.AdapterManifest, token: str = ADMIN_TOKEN) -> pb.RelayPlan:
    """A plan of `nodes` under the receiver, each granted as a proxy holding `token` grants it."""
    import hashlib

    plan = plan_from_parents([(a, a, 0) for a in nodes])
    grant_plan(plan, grant_key(hashlib.sha256(token.encode()).digest()), manifest)
    return plan


def test_a_replica_relays_only_to_members_its_proxy_planned(workdir, guarded, tokens, adapter):
    """A plan nobody planned is refused before any dial; a plan back to the replica (an alias of
    its address) is refused; a granted node that is no replica is reported by code, in one
    sentence, whatever answers there; no admin token travels down a relay; a relay token can
    only stage. A proxy with a relay token relays over the replicas with nothing healed."""
    a = guarded[0]
    channel = grpc.insecure_channel(a.target)
    stub = generator_pb2_grpc.GeneratorServiceStub(channel)
    fp = stub.GetStatus(pb.GetStatusRequest(), timeout=10, metadata=bearer_of(ADMIN_TOKEN)).model_fingerprint
    listener = Listener()
    closed = f"127.0.0.1:{free_port()}"

    def relayed(
        version: int,
        plan: pb.RelayPlan | None,
        token: str = ADMIN_TOKEN,
        stage_only: bool = True,
        granted: pb.RelayNode | None = None,
    ):
        m = adapter.manifest("planned", version, fp)
        messages = writer.messages(m, adapter.payload, relay=plan, stage_only=stage_only, granted=granted)
        return lambda: stub.PushAdapter(messages, timeout=30, metadata=bearer_of(token))

    def own_grant(version: int, sha256: str = "", token: str = ADMIN_TOKEN) -> pb.RelayNode:
        """The receiver's node as a proxy holding `token` plans it for ("planned", version[, digest])."""
        m = adapter.manifest("planned", version, fp)
        if sha256:
            m.sha256 = sha256
        return granted([a.target], m, token).nodes[0]

    try:
        # 1. a plan naming an address no proxy granted: refused, and nobody is dialled
        plain = plan_from_parents([(listener.address, "x", 0)])
        code, reason, message = refusal(relayed(1, plain))
        assert (code, reason) == (grpc.StatusCode.PERMISSION_DENIED, Reason.RELAY_NOT_PLANNED), message
        assert listener.address in message
        forged = granted([listener.address], adapter.manifest("planned", 1, fp), token="not-the-admin-token")
        assert refusal(relayed(1, forged))[:2] == (grpc.StatusCode.PERMISSION_DENIED, Reason.RELAY_NOT_PLANNED)
        reused = granted([listener.address], adapter.manifest("planned", 99, fp))  # a grant for another push
        assert refusal(relayed(1, reused))[:2] == (grpc.StatusCode.PERMISSION_DENIED, Reason.RELAY_NOT_PLANNED)
        assert not listener.calls.is_set()
        # 2. the replica itself, under an alias of its address: refused before any slot or dial
        port = a.target.rsplit(":", 1)[1]
        for alias in (f"localhost:{port}", f"0.0.0.0:{port}"):
            plan = granted([alias], adapter.manifest("planned", 1, fp))
            code, reason, message = refusal(relayed(1, plan))
            assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, Reason.RELAY_LOOP), (alias, message)
        # 3. granted nodes that are no replica: a closed port and a service with a banner read alike
        m = adapter.manifest("planned", 2, fp)
        reply = relayed(2, granted([closed, listener.address], m))()
        rows = {r.address: r for r in reply.replicas}
        assert {rows[closed].code, rows[listener.address].code} == {"UNAVAILABLE"}
        assert rows[closed].message == rows[listener.address].message, rows
        assert Listener.BANNER not in str(reply) and "refused" not in str(reply).lower()
        assert listener.calls.wait(10)
        assert ADMIN_TOKEN not in " ".join(listener.seen)  # an admin caller's token is never passed on
        # a relay token's push is taken only with the receiver's own grant for that very version
        # and digest (a relaying parent can pass on nothing but what the proxy planned) ...
        plan3 = granted([listener.address], adapter.manifest("planned", 3, fp))
        calls = len(listener.seen)
        for bad in (
            None,  # no grant
            own_grant(2),  # the grant of another version
            own_grant(3, sha256="0" * 64),  # the grant of other bytes under this version
            own_grant(3, token="not-the-admin-token"),  # a grant nobody's admin key made
        ):
            code, reason, message = refusal(relayed(3, plan3, RELAY_TOKEN, granted=bad))
            assert (code, reason) == (grpc.StatusCode.PERMISSION_DENIED, Reason.RELAY_NOT_PLANNED), message
        assert len(listener.seen) == calls  # refused before any dial
        # ... and is then passed on with the relay token, never more
        reply = relayed(3, plan3, RELAY_TOKEN, granted=own_grant(3))()
        assert listener.seen[-1] == f"Bearer {RELAY_TOKEN}" and reply.staged
        # 4. a relay token can only stage: no serving push, no commit, no generate
        code, reason, _ = refusal(relayed(4, None, RELAY_TOKEN, stage_only=False))
        assert (code, reason) == (grpc.StatusCode.PERMISSION_DENIED, Reason.WRONG_ROLE)
        commit = pb.CommitAdapterRequest(name="planned", version=3, sha256=adapter.sha256)
        assert refusal(lambda: stub.CommitAdapter(commit, timeout=10, metadata=bearer_of(RELAY_TOKEN)))[0] == (
            grpc.StatusCode.PERMISSION_DENIED
        )
        group = pb.GenerateRequest(text="1+1=", n=1)
        code, _, _ = refusal(
            lambda: list(stub.Generate(group, timeout=10, metadata=bearer_of(RELAY_TOKEN)))  # a stream
        )
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert "planned" not in [
            x.name for x in stub.GetStatus(pb.GetStatusRequest(), timeout=10, metadata=bearer_of(ADMIN_TOKEN)).adapters
        ]
    finally:
        listener.server.stop(0)
        channel.close()
    # 5. the proxy's own relay: granted plans, the relay token, a chain over both, nothing healed
    proxy = start_proxy(
        workdir,
        "planner",
        guarded,
        *("--set", f"upstream.token_file={tokens['admin']}", "--set", f"upstream.relay_token_file={tokens['relay']}"),
        *("--set", "push.fanout=1", "--set", f"auth.admin_tokens_file={tokens['operator']}"),
    )
    try:
        wait_routable_with(proxy, guarded, OPERATOR_TOKEN)
        proxy_stub = generator_pb2_grpc.GeneratorServiceStub(grpc.insecure_channel(proxy.target))
        m = adapter.manifest("chain", 1, fp)
        operator = bearer_of(OPERATOR_TOKEN)
        reply = proxy_stub.PushAdapter(writer.messages(m, adapter.payload), timeout=60, metadata=operator)
        assert sorted((r.replica, r.code) for r in reply.replicas) == [("guard1", "OK"), ("guard2", "OK")], reply
        relayed_to = sorted(
            next(e["relayed_to"] for e in log_events(s.log_path, "adapter_staged") if e["adapter"] == "chain")
            for s in guarded
        )
        assert relayed_to == [0, 1]  # one replica relayed to the other
        heals = sum(
            metric_value(proxy.metrics(), "rollwire_proxy_push_heals_total", f'replica="{s.target}"') for s in guarded
        )
        assert heals == 0
    finally:
        stop_all([proxy])


def wait_routable_with(proxy, replicas, token: str = ADMIN_TOKEN, timeout: float = 60) -> None:
    """wait_routable for a proxy whose GetStatus needs a token."""
    stub = generator_pb2_grpc.GeneratorServiceStub(grpc.insecure_channel(proxy.target))

    def ready() -> bool:
        members = stub.GetStatus(pb.GetStatusRequest(), timeout=5, metadata=bearer_of(token)).replicas
        return {r.address for r in members if r.healthy} >= {s.target for s in replicas}

    wait_until(ready, timeout, "every replica is routable")


# -- who may register ------------------------------------------------------------------------
def test_a_register_token_registers_only_its_own_address_for_a_bounded_time(workdir, tiny_model, tokens):
    """A `register` token registers, drains and removes only its own address, with a ttl in
    1..registration.max_ttl_s (never for good), up to registration.max_members replicas, and
    can do nothing else; a new address only when what listens there proves it (MEMBER_UNPROVEN);
    a replica holding the fleet key joins and leaves with one. The proxy's status shows its
    replicas to an admin only."""
    key = workdir / "fleet.key"
    key.write_text("fleet-key-of-the-doorman-test\n")
    proxy = start_proxy(
        workdir,
        "doorman",
        [],
        *(
            "--set",
            f"auth.admin_tokens_file={tokens['admin']}",
            "--set",
            f"auth.register_tokens_file={tokens['register']}",
        ),
        *(
            "--set",
            f"auth.generate_tokens_file={tokens['generate']}",
            "--set",
            f"upstream.token_file={tokens['operator']}",  # the replicas' admin, none of this proxy's
        ),
        *("--set", "registration.max_ttl_s=60", "--set", "registration.max_members=3"),
        *("--set", f"upstream.member_key_file={key}"),
    )
    channel = grpc.insecure_channel(proxy.target)
    stub = admin_stub = admin_pb2_grpc.AdminServiceStub(channel)
    gen = generator_pb2_grpc.GeneratorServiceStub(channel)

    def register(address: str, ttl: int, token: str = REGISTER_TOKEN):
        request = apb.RegisterGeneratorRequest(address=address, ttl_seconds=ttl)
        return refusal(lambda: stub.RegisterGenerator(request, timeout=10, metadata=bearer_of(token)))

    def members() -> set[str]:
        listed = admin_stub.ListGenerators(apb.ListGeneratorsRequest(), timeout=10, metadata=bearer_of(ADMIN_TOKEN))
        return {r.address for r in listed.replicas}

    replica = None
    try:
        # another host's address, or for good, or past the bound: refused, nothing added
        assert register("192.0.2.7:50051", 30)[:2] == (grpc.StatusCode.PERMISSION_DENIED, Reason.NOT_OWN_ADDRESS)
        assert register("127.0.0.1:1234", 0)[:2] == (grpc.StatusCode.INVALID_ARGUMENT, Reason.BAD_TTL)
        assert register("127.0.0.1:1234", 61)[:2] == (grpc.StatusCode.INVALID_ARGUMENT, Reason.BAD_TTL)
        assert members() == set()
        # its own host but nothing there proves the address: refused; an admin may register anything
        code, reason, message = register("127.0.0.1:1234", 30)
        assert (code, reason) == (grpc.StatusCode.PERMISSION_DENIED, Reason.MEMBER_UNPROVEN), message
        assert "did not prove" in message
        assert register("127.0.0.1:1234", 30, ADMIN_TOKEN)[0] == grpc.StatusCode.OK
        assert register("localhost:1235", 30, ADMIN_TOKEN)[0] == grpc.StatusCode.OK
        assert register("127.0.0.1:1236", 0, ADMIN_TOKEN)[0] == grpc.StatusCode.OK
        # the cap: a fourth is refused
        code, reason, message = register("127.0.0.1:1237", 30)
        assert (code, reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, Reason.TOO_MANY_MEMBERS), message
        # hostile (audit S9): a register token refreshes, drains or removes only what it added itself; an
        # admin's member on its very host (as a static or discovered one) is not its own, and to it an
        # address it did not add is NOT_FOUND in a sentence naming no member
        code, reason, message = register("127.0.0.1:1234", 30)  # a refresh would give it a ttl to lapse
        assert (code, reason) == (grpc.StatusCode.PERMISSION_DENIED, Reason.NOT_OWN_ADDRESS), message
        for address in ("127.0.0.1:1234", "localhost:1235", "127.0.0.1:1236", "127.0.0.1:1"):
            for call in (stub.DeregisterGenerator, stub.DrainGenerator):
                request = (
                    apb.DeregisterGeneratorRequest(address=address)
                    if call is stub.DeregisterGenerator
                    else apb.DrainGeneratorRequest(address=address, deregister=True)
                )
                code, reason, message = refusal(
                    lambda call=call, request=request: call(request, timeout=10, metadata=bearer_of(REGISTER_TOKEN))
                )
                assert (code, reason) == (grpc.StatusCode.NOT_FOUND, Reason.UNKNOWN_REPLICA), message
                assert "1236" not in message.replace(address, "")  # no member listed
        assert members() == {"127.0.0.1:1234", "localhost:1235", "127.0.0.1:1236"}  # collateral: none touched
        # nothing else: another's removal, the list, sampling
        remove = apb.DeregisterGeneratorRequest(address="192.0.2.7:50051")
        code, reason, _ = refusal(
            lambda: stub.DeregisterGenerator(remove, timeout=10, metadata=bearer_of(REGISTER_TOKEN))
        )
        assert (code, reason) == (grpc.StatusCode.PERMISSION_DENIED, Reason.NOT_OWN_ADDRESS)
        listing = apb.ListGeneratorsRequest()
        assert refusal(lambda: stub.ListGenerators(listing, timeout=10, metadata=bearer_of(REGISTER_TOKEN)))[0] == (
            grpc.StatusCode.PERMISSION_DENIED
        )
        group = pb.GenerateRequest(text="1+1=", n=1)
        assert refusal(lambda: list(gen.Generate(group, timeout=10, metadata=bearer_of(REGISTER_TOKEN))))[0] == (
            grpc.StatusCode.PERMISSION_DENIED
        )
        # the topology is an admin's: a generate token sees the fleet as one replica
        assert not gen.GetStatus(pb.GetStatusRequest(), timeout=10, metadata=bearer_of(GENERATE_TOKEN)).replicas
        assert len(gen.GetStatus(pb.GetStatusRequest(), timeout=10, metadata=bearer_of(ADMIN_TOKEN)).replicas) == 3
        for address in ("127.0.0.1:1234", "localhost:1235"):
            request = apb.DeregisterGeneratorRequest(address=address)
            stub.DeregisterGenerator(request, timeout=10, metadata=bearer_of(ADMIN_TOKEN))
        # a real replica joins with a register token and leaves (drained) with it
        replica = start_generators(
            tiny_model,
            workdir,
            ["joiner"],
            *("--register", proxy.target, "--set", f"registration.token_file={tokens['register']}"),
            *("--set", f"auth.admin_tokens_file={tokens['admin']}", "--set", f"auth.member_key_file={key}"),
        )[0]
        wait_until(lambda: replica.target in members(), 30, "the replica registered itself")
        stop_all([replica])
        replica = None
        assert members() == {"127.0.0.1:1236"}  # it left through DrainGenerator with its register token
    finally:
        channel.close()
        stop_all([proxy] + ([replica] if replica is not None else []))
