"""The broadcast (issue 10): a push relayed down a tree of real replicas, staged, then committed.

Three tiny-model replicas and real proxies over real sockets. A hostile peer (a small
GeneratorService written here with the shared push module: it joins a proxy as if it were a
replica, relays pushes, and may alter the bytes it forwards, lie about the outcome, or hold
its reply) stands in for a hop that misbehaves at the protocol level.

Checked: with fan-out 1 (a chain) and 2 the replicas relay to each other and end with the same
verified bytes (same version, same sampled tokens and logprobs, pinned to that version); a
replica SIGKILLed while it relays does not keep the others from serving the version within
the push deadline, and holds it once restarted; bytes altered by a hop are refused by the
replica below and healed (by the proxy's heal round, or, when the hop lies about it, by the
failed commit and a catch-up); a staged version is never served before the commit; replicas
relay to each other over mutual TLS with the proxy's token; a malformed plan is refused; a
striped bulk push of many chunks a stripe (each stripe read on its own thread into the
version's one buffer) reaches every replica with no heal, an altered byte in it is refused and
healed, a stripe stream cut mid-way frees its slot, and stripes by both paths assemble one version.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import secrets
import socket
import struct
import threading
import time
from datetime import datetime
from pathlib import Path

import grpc
import pytest
from blake3 import blake3
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from support.processes import (
    GENERATOR_ARGS,
    Service,
    free_port,
    start_generator,
    start_generators,
    start_proxy,
    stop_all,
    wait_routable,
    wait_until,
)
from support.wire import bulk_push, generate, make_adapter, metric_value, status

from rollwire.common import writer
from rollwire.common.bulk import BlockingPush, Offer
from rollwire.common.errors import from_rpc_error
from rollwire.common.reasons import Reason
from rollwire.common.writer import chunks, opening, stripe_messages
from rollwire.push.bulk import BulkDial, BulkListener
from rollwire.push.forward import Forwarder
from rollwire.push.plan import Child, plan_from_parents, split_plan
from rollwire.push.reader import PushReader
from rollwire.runtime.security import TlsSection
from rollwire.serving.config import BulkSection
from rollwire.v1 import generator_pb2 as pb
from rollwire.v1 import generator_pb2_grpc

pytestmark = pytest.mark.integration  # starts processes or servers: not in make test-fast

PUSH_DEADLINE_S = 30
BULK_ON = ("--set", "bulk.enabled=true")
"""Every server of this module listens for bulk bytes too: a push takes the path its client asks for."""
PROXY_ARGS = ("--set", f"health.push_timeout_s={PUSH_DEADLINE_S}", "--set", "push.stall_timeout_s=10", *BULK_ON)
PATHS = ["grpc", "bulk"]
"""The two paths of a push's bytes (rollwire.push.bulk): the push contract holds on both."""
SERVICE = pb.DESCRIPTOR.services_by_name["GeneratorService"].full_name


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("relay")


@pytest.fixture(scope="module")
def replicas(tiny_model, workdir):
    services = start_generators(tiny_model, workdir, ["q1", "q2", "q3"], *BULK_ON)
    yield services
    stop_all(services)


@pytest.fixture(scope="module")
def adapter(tiny_model):
    return make_adapter(tiny_model, seed=21)


def log_events(path: Path, event: str) -> list[dict]:
    """The JSON log lines of one event in a service's log."""
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if f'"{event}"' in line:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record.get("event") == event:
                out.append(record)
    return out


def holds(target: str, name: str, version: int) -> bool:
    return version in {v for a in status(target).adapters if a.name == name for v in a.versions}


def sampled(target: str, name: str, version: int):
    """A seeded group pinned to the version: its tokens and logprobs depend on every weight."""
    g = generate(target, "3+4=", n=2, adapter=(name, version), max_new_tokens=6, seed=5, temperature=1.0)
    assert g.started.adapter.version == version
    return g.tokens, {i: [round(x, 5) for x in lp] for i, lp in g.logprobs.items()}


def pinned_refusal(target: str, name: str, version: int) -> grpc.StatusCode:
    try:
        generate(target, "3+4=", n=1, adapter=(name, version), max_new_tokens=2)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def push_via(target: str, manifest: pb.AdapterManifest, payload: bytes, path: str = "grpc") -> pb.PushAdapterResponse:
    """A push by the given path: "bulk" asks the receiver (and so every hop) for the bulk path and
    checks the bytes took it."""
    with grpc.insecure_channel(target) as channel:
        stub = generator_pb2_grpc.GeneratorServiceStub(channel)
        if path == "grpc":
            return stub.PushAdapter(writer.messages(manifest, payload), timeout=PUSH_DEADLINE_S + 10)
        push = BlockingPush(manifest, payload, writer.MAX_CHUNK, "127.0.0.1", 3.0)
        call = stub.PushAdapter.future(push.requests(), timeout=PUSH_DEADLINE_S + 10)
        push.attach(call)
        reply = call.result()
        assert (push.path, push.reason) == ("bulk", "connected")
        return reply


def hops_by_path(service, name: str) -> list[str]:
    """The path of every push of `name` a replica received and kept (its log)."""
    return [e["path"] for e in log_events(service.log_path, "adapter_staged") if e["adapter"] == name]


def low_port() -> int:
    """A free port whose address sorts first: the proxy plans replicas in address order (the
    trusted ones first), so a peer here is the first hop of a chain. support's free_port comes
    from below the ephemeral range, where the replicas' own ports (bound to 0) never are, and a
    five-digit port below 32768 sorts before every one of them."""
    return free_port()


def closed_port() -> int:
    """A port where nothing listens (a connection to it is refused)."""
    return free_port()


# -- a protocol-level hostile peer ----------------------------------------------------------
class HostilePeer(generator_pb2_grpc.GeneratorServiceServicer):
    """A GeneratorService that joins a proxy as a replica (its GetStatus is a real replica's,
    under another name) and relays pushes with the shared push module, but misbehaves:
    `corrupt` flips one bit of the first tensor value it forwards (a finite value stays
    finite: only the digest can tell; in a striped push, the stripe that carries the first
    chunk), `lie` reports every replica below it as staged
    whatever they said, `hold` keeps its reply until `release` is set, `stall` reads nothing
    after the first message until then, `refuse` fails every push at once (UNAVAILABLE). It stages nothing itself and answers every commit
    with OK. It takes a push's bytes by the path its sender asks for, with a real bulk listener;
    `blocked` offers instead a port where nothing listens (a firewalled bulk port)."""

    def __init__(self, real: str, *, corrupt=False, lie=False, hold=False, stall=False, refuse=False, blocked=False):
        self.real, self.corrupt, self.lie, self.hold, self.stall = real, corrupt, lie, hold, stall
        self.refuse, self.blocked = refuse, blocked
        self.bulk: BulkListener | None = None
        self.release = threading.Event()
        self.ended = threading.Event()
        """Set once a push's stream ended here (its parent had sent everything)."""
        self.accepted: dict[str, list[int]] = {}
        self.pushes = 0
        self.channels: dict[str, grpc.aio.Channel] = {}

    async def GetStatus(self, request, context):
        async with grpc.aio.insecure_channel(self.real) as channel:
            reply = await generator_pb2_grpc.GeneratorServiceStub(channel).GetStatus(request, timeout=5)
        reply.replica = "hostile-peer"
        del reply.adapters[:]
        reply.adapters.extend(pb.LoadedAdapter(name=n, versions=v) for n, v in self.accepted.items())
        return reply

    def _stub(self, address: str):
        if address not in self.channels:
            self.channels[address] = grpc.aio.insecure_channel(address)
        return generator_pb2_grpc.GeneratorServiceStub(self.channels[address])

    async def PushAdapter(self, request_iterator, context):
        self.pushes += 1
        reader = PushReader(request_iterator, 30, "hostile peer", keep_chunks=True)
        first = await reader.open()
        if self.refuse:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the hostile peer takes no push")
        if self.stall:
            await asyncio.to_thread(self.release.wait, 60)
        if self.blocked and first.bulk:
            await context.send_initial_metadata(Offer(closed_port(), secrets.token_bytes(32)).metadata())
        else:
            await reader.agree(first, self.bulk, context.send_initial_metadata)
        children = split_plan(first.relay, max_children=64) if first.relay.nodes else []
        forward = Forwarder(
            children,
            first.manifest,
            stage_only=first.stage_only,
            stub_for=self._stub,
            metadata=[],
            deadline=time.monotonic() + 20,
            queue_chunks=8,
            stall_s=5,
            settle_s=5,
            stripe=first.stripe,
            bulk=BulkDial(3.0) if first.bulk else None,
        )
        flipped = not self.corrupt
        if first.stripe is not None:  # a stripe: the chunks it carries, by their place in the payload
            source = reader.stripe_chunks(first.stripe)
        else:
            source = ((j, c) async for j, c in _numbered(reader.chunks()))
        async for j, chunk in source:
            if not flipped and j == 0:
                at = 8 + struct.unpack("<Q", chunk[:8])[0]  # the first tensor's first (lowest) byte
                chunk = bytes(chunk[:at]) + bytes([chunk[at] ^ 1]) + bytes(chunk[at + 1 :])
                flipped = True
            await forward.send(chunk)
        forward.end()
        self.ended.set()
        if first.stripe is None:
            await reader.finish_chunks()
        results = await forward.results()
        if self.hold:
            await asyncio.to_thread(self.release.wait, 30)
        if self.lie:
            results = [
                pb.ReplicaPushResult(replica=r.replica, address=r.address, code="OK", staged=True) for r in results
            ]
        m = first.manifest
        self.accepted.setdefault(m.name, []).append(m.version)
        return pb.PushAdapterResponse(
            name=m.name, version=m.version, staged=first.stage_only, loaded_versions=[m.version], replicas=results
        )

    async def CommitAdapter(self, request, context):
        return pb.CommitAdapterResponse(name=request.name, version=request.version, loaded_versions=[request.version])


async def _numbered(chunks):
    j = 0
    async for chunk in chunks:
        yield j, chunk
        j += 1


class PeerServer:
    """The hostile peer served on its own event loop in a thread of the test process."""

    def __init__(self, peer: HostilePeer) -> None:
        self.peer, self.port = peer, low_port()
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    async def _start(self) -> None:
        self.peer.bulk = BulkListener("127.0.0.1", BulkSection(enabled=True), TlsSection())
        self.server = grpc.aio.server()
        generator_pb2_grpc.add_GeneratorServiceServicer_to_server(self.peer, self.server)
        checks = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(checks, self.server)
        self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        await self.server.start()
        await checks.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.peer.release.set()
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(10)
        if self.peer.bulk is not None:
            self.peer.bulk.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def peer_proxy(replicas, workdir, request):
    """A hostile peer and a proxy over it and the real replicas; the peer plans first."""
    behaviour, fanout, *extra = request.param
    peer = PeerServer(HostilePeer(replicas[0].target, **behaviour))
    args = ["--generator", peer.target, "--set", f"push.fanout={fanout}", *PROXY_ARGS, *extra]
    settings = "".join(f"-{e.replace('=', '').replace('.', '')}" for e in extra if e != "--set")
    proxy = start_proxy(workdir, f"peer-proxy-{'-'.join(behaviour) or 'plain'}-{fanout}{settings}", replicas, *args)
    wait_until(lambda: len([r for r in status(proxy.target).replicas if r.healthy]) == 4, 30, "all four are routable")
    yield proxy, peer
    stop_all([proxy])
    peer.stop()


@pytest.fixture(scope="module")
def proxies(replicas, workdir):
    """Proxies over the module's replicas, one per setting, started when first asked for and kept
    for the module: the tests run over both paths (PATHS) through the same proxy."""
    started: dict[str, Service] = {}

    def get(name: str, *args: str) -> Service:
        if name not in started:
            started[name] = start_proxy(workdir, name, replicas, *args, *PROXY_ARGS)
            wait_routable(started[name], replicas)
        return started[name]

    yield get
    stop_all(list(started.values()))


# -- the tests --------------------------------------------------------------------------------
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fanout", [1, 2])
def test_a_relayed_push_gives_every_replica_the_same_verified_bytes(fanout, path, replicas, proxies, adapter):
    proxy = proxies(f"relay-proxy-{fanout}", "--set", f"push.fanout={fanout}")
    name = f"relay{fanout}{path}"
    fp = status(proxy.target).model_fingerprint
    reply = push_via(proxy.target, adapter.manifest(name, 1, fp), adapter.payload, path)
    assert sorted((r.replica, r.code) for r in reply.replicas) == [("q1", "OK"), ("q2", "OK"), ("q3", "OK")]
    planned = log_events(proxy.log_path, "adapter_relay_planned")[-1]
    assert (planned["fanout"], len(planned["children"])) == (fanout, fanout)
    # each replica forwarded to its subtree while receiving: a chain 2, 1, 0; a 2-ary tree 1, 0, 0
    relayed = sorted(
        next(e["relayed_to"] for e in log_events(r.log_path, "adapter_staged") if e["adapter"] == name)
        for r in replicas
    )
    assert relayed == ([0, 1, 2] if fanout == 1 else [0, 0, 1])
    assert all(holds(r.target, name, 1) for r in replicas)
    samples = [sampled(r.target, name, 1) for r in replicas]
    assert samples[0] == samples[1] == samples[2]
    base = generate(replicas[0].target, "3+4=", n=2, max_new_tokens=6, seed=5, temperature=1.0)
    assert samples[0][1] != {i: [round(x, 5) for x in lp] for i, lp in base.logprobs.items()}
    assert metric_value(proxy.metrics(), "rollwire_proxy_push_heals_total", f'replica="{replicas[0].target}"') == 0
    assert [hops_by_path(r, name) for r in replicas] == [[path]] * 3  # every hop took the path asked for


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("stripes", [2, 3])
def test_a_striped_push_gives_every_replica_the_same_verified_bytes(stripes, path, replicas, proxies, adapter):
    proxy = proxies(f"stripe-proxy-{stripes}", "--set", f"push.stripes={stripes}")
    name = f"striped{stripes}{path}"
    fp = status(proxy.target).model_fingerprint
    reply = push_via(proxy.target, adapter.manifest(name, 1, fp), adapter.payload, path)
    assert sorted((r.replica, r.code) for r in reply.replicas) == [("q1", "OK"), ("q2", "OK"), ("q3", "OK")]
    planned = log_events(proxy.log_path, "adapter_relay_planned")[-1]
    chunk = planned["chunk_bytes"]
    assert planned["stripes"] == stripes and len(planned["children"]) == stripes
    assert len(set(planned["children"])) == stripes  # each tree starts at another replica
    for r in replicas:
        # one stream per stripe: the one that completed the payload staged it, the others only delivered
        pending = [e for e in log_events(r.log_path, "adapter_stripe_received") if e["adapter"] == name]
        staged = [e for e in log_events(r.log_path, "adapter_staged") if e["adapter"] == name]
        assert (len(pending), len(staged)) == (stripes - 1, 1), r.name
        assert staged[0]["stripes"] == stripes and staged[0]["bytes"] == len(adapter.payload)
    # every tree holds every replica: each relayed its stripe to the replicas below it
    relayed = sum(
        e["relayed_to"]
        for r in replicas
        for event in ("adapter_stripe_received", "adapter_staged")
        for e in log_events(r.log_path, event)
        if e["adapter"] == name
    )
    assert relayed == stripes * (len(replicas) - 1)
    assert -(-len(adapter.payload) // chunk) >= stripes  # every stripe carried bytes
    samples = [sampled(r.target, name, 1) for r in replicas]
    assert samples[0] == samples[1] == samples[2]
    assert all(
        metric_value(proxy.metrics(), "rollwire_proxy_push_heals_total", f'replica="{r.target}"') == 0 for r in replicas
    )
    assert [hops_by_path(r, name) for r in replicas] == [[path]] * 3


def test_a_replica_assembles_stripes_from_their_own_streams_and_refuses_broken_ones(replicas, adapter):
    target = replicas[0].target
    fp = status(target).model_fingerprint
    payload, chunk = adapter.payload, 64 << 10

    def stripe(index: int, count: int = 2) -> pb.Stripe:
        return pb.Stripe(index=index, count=count, chunk_bytes=chunk)

    def refusal(messages, timeout=10) -> tuple[grpc.StatusCode, str]:
        try:
            stub.PushAdapter(iter(messages), timeout=timeout)
        except grpc.RpcError as exc:
            err = from_rpc_error(exc)
            return err.code, err.reason
        return grpc.StatusCode.OK, ""

    with grpc.insecure_channel(target) as channel:
        stub = generator_pb2_grpc.GeneratorServiceStub(channel)
        m = adapter.manifest("by-stripes", 1, fp)
        # broken stripes: refused with a reason, before or as the bytes come
        plain = list(stripe_messages(m, payload, stripe(0)))
        not_staged = [opening(m, stripe=stripe(0)), *plain[1:]]
        too_many = list(stripe_messages(m, payload, stripe(0, 9)))
        odd_chunk = [plain[0], pb.PushAdapterRequest(chunk=plain[1].chunk[:-1]), *plain[2:]]
        truncated = plain[:-1]
        bad = grpc.StatusCode.INVALID_ARGUMENT
        assert refusal(not_staged) == (bad, "BAD_STRIPE")
        assert refusal(too_many) == (bad, "BAD_STRIPE")
        assert refusal(odd_chunk) == (bad, "BAD_STRIPE")
        assert refusal(truncated) == (bad, "LENGTH_MISMATCH")
        # the stripes on their own streams: the first to end is not a verdict, the last one stages
        first = stub.PushAdapter(stripe_messages(m, payload, stripe(0)), timeout=10)
        assert (first.stripe_pending, first.staged) == (True, False)
        assert not holds(target, "by-stripes", 1)
        last = stub.PushAdapter(stripe_messages(m, payload, stripe(1)), timeout=10)
        assert (last.stripe_pending, last.staged) == (False, True)
        assert pinned_refusal(target, "by-stripes", 1) == grpc.StatusCode.NOT_FOUND  # staged, not served
        stub.CommitAdapter(pb.CommitAdapterRequest(name="by-stripes", version=1, sha256=m.sha256), timeout=10)
        stub.PushAdapter(writer.messages(adapter.manifest("whole", 1, fp), payload), timeout=10)
        assert sampled(target, "by-stripes", 1) == sampled(target, "whole", 1)  # the same weights, bit for bit
        # stripes whose partners never come hold no slot a plain push needs (their bound: test_fleet_truth)
        for version in (2, 3):
            orphan = stub.PushAdapter(
                stripe_messages(adapter.manifest("by-stripes", version, fp), payload, stripe(0)), timeout=3
            )
            assert orphan.stripe_pending
        assert refusal(writer.messages(adapter.manifest("whole", 2, fp), payload)) == (grpc.StatusCode.OK, "")
        # a stripe of another cut than the one being assembled is refused, and spoils nothing
        m4 = adapter.manifest("by-stripes", 4, fp)
        assert stub.PushAdapter(stripe_messages(m4, payload, stripe(0)), timeout=10).stripe_pending
        assert refusal(stripe_messages(m4, payload, stripe(1, 3))) == (
            grpc.StatusCode.FAILED_PRECONDITION,
            "STRIPE_CONFLICT",
        )
        assert stub.PushAdapter(stripe_messages(m4, payload, stripe(1)), timeout=10).staged


@pytest.mark.parametrize("peer_proxy", [({"hold": True}, 0, "--set", "push.settle_timeout_s=60")], indirect=True)
def test_a_staged_version_is_never_served_before_the_commit(peer_proxy, replicas, adapter):
    proxy, peer = peer_proxy
    fp = status(proxy.target).model_fingerprint
    box: dict = {}

    def run() -> None:
        box["reply"] = push_via(proxy.target, adapter.manifest("unseen", 1, fp), adapter.payload)

    pusher = threading.Thread(target=run)
    pusher.start()
    try:
        # every real replica has verified and staged the bytes; the peer holds the commit back
        wait_until(
            lambda: all(
                any(e["adapter"] == "unseen" for e in log_events(r.log_path, "adapter_staged")) for r in replicas
            ),
            20,
            "every replica staged the version",
        )
        for r in replicas:
            assert pinned_refusal(r.target, "unseen", 1) == grpc.StatusCode.NOT_FOUND
            assert not holds(r.target, "unseen", 1)
        assert "reply" not in box
    finally:
        peer.peer.release.set()
        pusher.join(PUSH_DEADLINE_S + 15)
    assert all(r.code == "OK" for r in box["reply"].replicas), box["reply"].replicas
    for r in replicas:
        assert pinned_refusal(r.target, "unseen", 1) == grpc.StatusCode.OK


STALL_S = 1.5


@pytest.mark.parametrize(
    "peer_proxy",
    [({"stall": True}, 0, "--set", f"push.stall_timeout_s={STALL_S}", "--set", f"push.settle_timeout_s={STALL_S}")],
    indirect=True,
)
def test_a_child_that_stalls_is_cut_off_without_holding_up_the_others(peer_proxy, replicas, adapter):
    proxy, peer = peer_proxy
    fp = status(proxy.target).model_fingerprint
    manifest = adapter.manifest("stalled", 1, fp)
    # small chunks, so the stalled peer's flow-control window and queue fill up
    started, wall = time.monotonic(), time.time()
    with grpc.insecure_channel(proxy.target) as channel:
        reply = generator_pb2_grpc.GeneratorServiceStub(channel).PushAdapter(
            writer.messages(manifest, adapter.payload, 1024), timeout=PUSH_DEADLINE_S + 10
        )
    took = time.monotonic() - started
    outcomes = {r.address: (r.code, r.reason) for r in reply.replicas}
    assert all(outcomes[r.target] == ("OK", "") for r in replicas), outcomes
    assert outcomes[peer.target] == ("DEADLINE_EXCEEDED", "RELAY_STALLED")
    # the relay, the heal relay and the direct heal each gave up on it after STALL_S, no more
    assert took < 3 * STALL_S + 10, took
    # and its siblings waited for it once, at most STALL_S: they staged long before the end
    for r in replicas:
        staged = next(e["timestamp"] for e in log_events(r.log_path, "adapter_staged") if e["adapter"] == "stalled")
        delay = datetime.fromisoformat(staged.replace("Z", "+00:00")).timestamp() - wall
        assert delay < STALL_S + 4, (r.name, delay)
        assert holds(r.target, "stalled", 1)


def test_a_stripe_call_cancelled_after_its_stripe_arrived_leaves_the_version_to_complete(replicas, adapter):
    """Stripe 0 reaches a replica with a relay plan whose one child (the hostile peer) holds its
    answer, so the replica's call waits for it; the caller gives up on that call once the child
    saw the stripe end (its parent had taken the whole stripe by then). The replica keeps the
    stripe: stripe 1, on its own stream, completes and stages the version."""
    target = replicas[0].target
    fp = status(target).model_fingerprint
    peer = PeerServer(HostilePeer(target, hold=True))
    try:
        m = adapter.manifest("kept-stripe", 1, fp)
        plan = plan_from_parents([(peer.target, "hostile-peer", 0)])
        stripe = [pb.Stripe(index=i, count=2, chunk_bytes=64 << 10) for i in (0, 1)]
        with grpc.insecure_channel(target) as channel:
            stub = generator_pb2_grpc.GeneratorServiceStub(channel)
            held = stub.PushAdapter.future(stripe_messages(m, adapter.payload, stripe[0], relay=plan), timeout=30)
            assert peer.peer.ended.wait(15), "the child never saw stripe 0 end"
            held.cancel()
            last = stub.PushAdapter(stripe_messages(m, adapter.payload, stripe[1]), timeout=10)
            assert (last.stripe_pending, last.staged) == (False, True)
    finally:
        peer.stop()


@pytest.mark.parametrize("peer_proxy", [({"refuse": True}, "auto")], indirect=True)
def test_a_replica_that_failed_a_striped_push_hangs_under_the_proxy_in_every_tree_next_time(
    peer_proxy, replicas, adapter
):
    proxy, peer = peer_proxy
    fp = status(proxy.target).model_fingerprint
    for version in (1, 2):
        reply = push_via(proxy.target, adapter.manifest("doubted", version, fp), adapter.payload)
        outcomes = {r.address: r.code for r in reply.replicas}
        assert [outcomes[r.target] for r in replicas] == ["OK"] * 3 and outcomes[peer.target] == "UNAVAILABLE"
    first, second = [e for e in log_events(proxy.log_path, "adapter_relay_planned") if "stripes" in e]
    assert (first["version"], second["version"]) == (1, 2)
    # it plans first, so it headed stripe 0's tree and failed its whole subtree; a suspect since:
    # right under the proxy in both trees, a leaf, and the two trees are over the real replicas
    assert first["children"][0] == peer.target and peer.target not in first["children"][1:]
    assert second["stripes"] == 2 and second["children"].count(peer.target) == 2
    assert {c for c in second["children"] if c != peer.target} <= {r.target for r in replicas}
    healing = [e for e in log_events(proxy.log_path, "adapter_relay_healing") if e["version"] == 2]
    assert healing and all(e["replicas"] == [peer.target] for e in healing)  # no real replica missed v2


@pytest.mark.parametrize("digest", ["sha256", "blake3"])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "peer_proxy", [({"corrupt": True}, 1), ({"corrupt": True}, 1, "--set", "push.stripes=2")], indirect=True
)
def test_bytes_a_hop_alters_are_refused_below_it_and_healed(peer_proxy, path, digest, replicas, adapter):
    """Every hop below the altering one refuses its bytes, whichever digest it verifies: the
    sha256, or the BLAKE3 the manifest carries beside it (rollwire.push.digests)."""
    proxy, peer = peer_proxy
    fp = status(proxy.target).model_fingerprint
    earlier = len(log_events(proxy.log_path, "adapter_relay_planned"))  # the same proxy's log, for the other path
    refused_before = {
        r.name: len([e for e in log_events(r.log_path, "adapter_push_refused") if e["reason"] == "DIGEST_MISMATCH"])
        for r in replicas
    }
    name, digests = (
        ("altered", {}) if digest == "sha256" else ("altered-b3", {"blake3": blake3(adapter.payload).hexdigest()})
    )
    reply = push_via(proxy.target, adapter.manifest(name, 1, fp, **digests), adapter.payload, path)
    planned = log_events(proxy.log_path, "adapter_relay_planned")[earlier:]
    striped = "stripes" in planned[0]
    assert planned[0]["children"][0] == peer.target  # the chain, or stripe 0's tree, starts at the hostile hop
    refused = [
        r.name
        for r in replicas
        if len([e for e in log_events(r.log_path, "adapter_push_refused") if e["reason"] == "DIGEST_MISMATCH"])
        > refused_before[r.name]
    ]
    # below the hostile hop: the whole chain, or stripe 0's tree, which it heads (only that
    # stripe carries the altered chunk: stripe 1's copies were right, but the payloads were not)
    assert len(refused) == 3, refused
    if striped:
        assert planned[0]["stripes"] == 2 and planned[0]["children"][1] != peer.target
    codes = {r.address: r.code for r in reply.replicas}
    assert all(codes[r.target] == "OK" for r in replicas), reply.replicas
    heals = sum(
        metric_value(proxy.metrics(), "rollwire_proxy_push_heals_total", f'replica="{r.target}"') for r in replicas
    )
    assert heals == len(refused)  # each replica that refused got the bytes again; the others were never touched
    samples = [sampled(r.target, name, 1) for r in replicas]
    assert samples[0] == samples[1] == samples[2]
    assert all(set(hops_by_path(r, name)) <= {"grpc", "bulk"} for r in replicas)
    if path == "bulk":  # the relay and the heal both went by the bulk path: no hop fell back
        paths = proxy.metrics()
        assert metric_value(paths, "rollwire_proxy_push_path_total", 'path="bulk",reason="connected"') >= 2
        assert metric_value(paths, "rollwire_proxy_push_path_total", 'path="grpc",reason="refused"', default=0) == 0


@pytest.mark.parametrize("peer_proxy", [({"corrupt": True}, 1)], indirect=True)
def test_a_bulk_upload_of_many_pieces_is_healed_from_the_proxys_kept_views(peer_proxy, replicas, big):
    """The proxy took the upload on its reading thread and keeps it as views of one buffer, 1 MiB
    each: the replicas below the altering hop refuse its bytes and are healed from those views
    (over their bulk lanes), and serve what a plain push of the same weights gives."""
    proxy, peer = peer_proxy
    assert len(big.payload) > 4 * writer.MAX_CHUNK
    fp = status(proxy.target).model_fingerprint
    heals_before = sum(
        metric_value(proxy.metrics(), "rollwire_proxy_push_heals_total", f'replica="{r.target}"', default=0)
        for r in replicas
    )
    earlier = len(log_events(proxy.log_path, "adapter_relay_planned"))
    reply = push_via(proxy.target, big.manifest("healed-big", 1, fp), big.payload, "bulk")
    assert all(r.code == "OK" for r in reply.replicas), reply.replicas
    assert log_events(proxy.log_path, "adapter_relay_planned")[earlier]["children"] == [peer.target]
    received = [
        e["path"] for e in log_events(proxy.log_path, "adapter_upload_received") if e["adapter"] == "healed-big"
    ]
    assert received == ["bulk"]
    heals = sum(
        metric_value(proxy.metrics(), "rollwire_proxy_push_heals_total", f'replica="{r.target}"') for r in replicas
    )
    assert heals - heals_before == 3  # every replica was below the altering hop, refused, and was healed
    assert all(hops_by_path(r, "healed-big")[-1] == "bulk" for r in replicas)
    samples = [sampled(r.target, "healed-big", 1) for r in replicas]
    push_via(replicas[0].target, big.manifest("plain-big", 1, fp), big.payload)  # the same weights, no relay
    assert samples[0] == samples[1] == samples[2] == sampled(replicas[0].target, "plain-big", 1)


# -- a striped push over the bulk path: each stripe read on its own thread into one buffer ------
@pytest.fixture(scope="module")
def big(tiny_model):
    """A 10.5 MB adapter: a striped push of it has several chunks in every stripe."""
    return make_adapter(tiny_model, seed=23, r=512, scale=0.01)


@pytest.mark.parametrize("sha256", ["named", "left to the proxy"])
def test_a_striped_bulk_push_of_many_chunks_a_stripe_reaches_every_replica_with_no_heal(sha256, replicas, proxies, big):
    """Each replica reads each stripe's chunks straight into their places in the version's one
    buffer on that stripe's thread, checks them in payload order as the prefix fills, and sends
    them down the stripe's tree: a chunk put in the wrong place, or hashed out of order or twice,
    would fail a replica's BLAKE3 and be healed, which the heal counter would show. A manifest
    that leaves its sha256 to the proxy: the replicas assemble and stage it by its BLAKE3, and
    every one serves it under the sha256 of the bytes (hashlib's, here) that the proxy answers."""
    proxy = proxies("stripe-proxy-2", "--set", "push.stripes=2")
    fp = status(proxy.target).model_fingerprint
    name = "striped-big" if sha256 == "named" else "striped-big-left"
    digest = hashlib.sha256(big.payload).hexdigest()
    m = big.manifest(name, 1, fp, blake3=blake3(big.payload).hexdigest(), sha256=digest if sha256 == "named" else "")
    reply = push_via(proxy.target, m, big.payload, "bulk")
    assert sorted((r.address, r.code) for r in reply.replicas) == sorted((r.target, "OK") for r in replicas)
    assert reply.sha256 == digest
    assert [dict(a.digests) for r in replicas for a in status(r.target).adapters if a.name == name] == [{1: digest}] * 3
    planned = [e for e in log_events(proxy.log_path, "adapter_relay_planned") if "stripes" in e][-1]  # not a heal's
    assert planned["stripes"] == 2
    assert len(big.payload) // planned["chunk_bytes"] >= 2 * 4  # at least 4 chunks in every stripe
    for r in replicas:
        pending = [e for e in log_events(r.log_path, "adapter_stripe_received") if e["adapter"] == name]
        staged = [e for e in log_events(r.log_path, "adapter_staged") if e["adapter"] == name]
        assert [e["path"] for e in pending + staged] == ["bulk", "bulk"], r.name  # both stripes by bulk
    heals = [
        metric_value(proxy.metrics(), "rollwire_proxy_push_heals_total", f'replica="{r.target}"') for r in replicas
    ]
    assert heals == [0, 0, 0]
    samples = [sampled(r.target, name, 1) for r in replicas]
    assert samples[0] == samples[1] == samples[2]


def test_no_replica_receives_all_of_a_striped_bulk_upload_whose_sha256_the_proxy_refuses(replicas, proxies, big):
    """The proxy's reading thread deals each stripe's chunks to the trees' bulk lanes itself, and
    holds back the payload's last chunk until the proxy's verdict (dealt chunk by chunk in
    tests/unit/push/test_striped.py): with the sha256 wrong beside a right BLAKE3 (all a replica
    verifies), every replica took several chunks but none the whole payload, and none staged it."""
    proxy = proxies("stripe-proxy-2", "--set", "push.stripes=2")
    fp = status(proxy.target).model_fingerprint
    m = big.manifest("striped-wrong", 1, fp, blake3=blake3(big.payload).hexdigest(), sha256="0" * 64)
    took = "rollwire_generator_adapter_push_bytes_total"
    before = [metric_value(r.metrics(), took, default=0) for r in replicas]
    assert bulk_push(proxy.target, m, big.payload) == (grpc.StatusCode.INVALID_ARGUMENT, Reason.DIGEST_MISMATCH)
    planned = [e for e in log_events(proxy.log_path, "adapter_relay_planned") if e["adapter"] == "striped-wrong"]
    assert [e["stripes"] for e in planned] == [2]
    got = [metric_value(r.metrics(), took, default=0) - b for r, b in zip(replicas, before, strict=True)]
    assert all(2 * planned[0]["chunk_bytes"] <= n < len(big.payload) for n in got), got
    assert not any(e["adapter"] == "striped-wrong" for r in replicas for e in log_events(r.log_path, "adapter_staged"))


@pytest.mark.parametrize("peer_proxy", [({"corrupt": True}, 1, "--set", "push.stripes=2")], indirect=True)
def test_a_byte_altered_in_a_striped_bulk_push_of_many_chunks_is_refused_below_and_healed(peer_proxy, replicas, big):
    """The hostile peer heads stripe 0's tree (it plans first) and alters a byte of chunk 0: every
    replica below it reads that stripe by bulk into its version's buffer, and refuses the whole
    payload on its BLAKE3; the proxy heals each once."""
    proxy, peer = peer_proxy

    def refusals() -> dict[str, int]:  # the replicas' logs are the module's: count what this push adds
        return {
            r.name: len(
                [
                    e
                    for e in log_events(r.log_path, "adapter_push_refused")
                    if (e["reason"], e["path"]) == ("DIGEST_MISMATCH", "bulk")
                ]
            )
            for r in replicas
        }

    before = refusals()
    fp = status(proxy.target).model_fingerprint
    m = big.manifest("altered-big", 1, fp, blake3=blake3(big.payload).hexdigest())
    reply = push_via(proxy.target, m, big.payload, "bulk")
    planned = [e for e in log_events(proxy.log_path, "adapter_relay_planned") if e["adapter"] == "altered-big"]
    assert planned[0]["stripes"] == 2 and planned[0]["children"][0] == peer.target  # then the heal's plan
    assert len(big.payload) // planned[0]["chunk_bytes"] >= 2 * 4
    after = refusals()
    assert all(after[r.name] == before[r.name] + 1 for r in replicas), (before, after)
    assert all({r.address: r.code for r in reply.replicas}[r.target] == "OK" for r in replicas), reply.replicas
    heals = sum(
        metric_value(proxy.metrics(), "rollwire_proxy_push_heals_total", f'replica="{r.target}"') for r in replicas
    )
    assert heals == 3
    samples = [sampled(r.target, "altered-big", 1) for r in replicas]
    assert samples[0] == samples[1] == samples[2]


async def _send_stripe(target: str, m: pb.AdapterManifest, payload: bytes, stripe: pb.Stripe, bulk: bool, cut=None):
    """One stripe's stream to a replica, sent as a relaying parent sends it (push.forward: over its
    bulk lane when `bulk`, else as gRPC chunks); `cut` (k, wait): after k chunks, `wait()` in a
    thread, then the stream is aborted. The replica's outcome."""
    async with grpc.aio.insecure_channel(target) as channel:
        forward = Forwarder(
            [Child(target, "", pb.RelayPlan())],
            m,
            stage_only=True,
            stub_for=lambda _: generator_pb2_grpc.GeneratorServiceStub(channel),
            metadata=[],
            deadline=time.monotonic() + 30,
            queue_chunks=4,
            stall_s=10,
            settle_s=10,
            stripe=stripe,
            bulk=BulkDial(3.0) if bulk else None,
        )
        for k, (j, size) in enumerate(writer.stripe_layout(len(payload), stripe)):
            if cut is not None and k == cut[0]:
                await asyncio.to_thread(cut[1])
                forward.abort("the test cut this stripe's stream")
                break
            await forward.send(payload[j * stripe.chunk_bytes : j * stripe.chunk_bytes + size])
        forward.end()
        return (await forward.results())[0]


def test_a_stripe_cut_mid_way_fails_its_version_and_frees_the_slot_and_stripes_by_both_paths_assemble_it(replicas, big):
    """A bulk stripe's stream aborted after 5 of its chunks were read: the replica gives its
    version up (no assembly left, its slot free) and serves nothing. The same version sent again,
    stripe 0 over the bulk path and stripe 1 as gRPC chunks at the same time, meets in one buffer
    and stages the exact bytes (the replica's BLAKE3 of them, and the weights it samples with)."""
    target = replicas[0]
    fp = status(target.target).model_fingerprint
    m = big.manifest("cut-stripe", 1, fp, blake3=blake3(big.payload).hexdigest())
    stripes = [pb.Stripe(index=i, count=2, chunk_bytes=256 << 10) for i in (0, 1)]
    slots = "rollwire_generator_push_slots_used"
    before = metric_value(target.metrics(), "rollwire_generator_adapter_push_bytes_total")

    def five_chunks_in() -> None:
        wait_until(
            lambda: (
                metric_value(target.metrics(), "rollwire_generator_adapter_push_bytes_total")
                >= before + 5 * (256 << 10)
            ),
            15,
            "the replica read five chunks of the stripe",
        )
        assert metric_value(target.metrics(), slots) == 1  # the assembly holds one slot while it is open

    cut = asyncio.run(_send_stripe(target.target, m, big.payload, stripes[0], True, cut=(5, five_chunks_in)))
    assert cut.code != "OK"
    # freed by the failure itself, well before limits.stripe_linger_s (10 s) would reclaim it
    wait_until(lambda: metric_value(target.metrics(), slots) == 0, 3, "the cut stripe's slot is free")
    assert not holds(target.target, "cut-stripe", 1)

    async def both() -> list[pb.ReplicaPushResult]:
        return list(
            await asyncio.gather(
                _send_stripe(target.target, m, big.payload, stripes[0], True),
                _send_stripe(target.target, m, big.payload, stripes[1], False),
            )
        )

    outcomes = asyncio.run(both())
    assert sorted((r.code, r.stripe_pending, r.staged) for r in outcomes) == [("OK", False, True), ("OK", True, False)]
    ended = [e for e in log_events(target.log_path, "adapter_stripe_received") if e["adapter"] == "cut-stripe"]
    staged = [e for e in log_events(target.log_path, "adapter_staged") if e["adapter"] == "cut-stripe"]
    assert sorted(e["path"] for e in ended + staged) == ["bulk", "grpc"]
    assert metric_value(target.metrics(), slots) == 0
    with grpc.insecure_channel(target.target) as channel:
        stub = generator_pb2_grpc.GeneratorServiceStub(channel)
        stub.CommitAdapter(pb.CommitAdapterRequest(name="cut-stripe", version=1, sha256=m.sha256), timeout=10)
        stub.PushAdapter(writer.messages(big.manifest("cut-whole", 1, fp), big.payload), timeout=30)
    assert sampled(target.target, "cut-stripe", 1) == sampled(target.target, "cut-whole", 1)


@pytest.mark.parametrize("peer_proxy", [({"blocked": True}, 1)], indirect=True)
def test_a_push_whose_bulk_port_is_blocked_completes_over_grpc_chunks_and_says_so(peer_proxy, replicas, adapter):
    proxy, peer = peer_proxy
    fp = status(proxy.target).model_fingerprint
    reply = push_via(proxy.target, adapter.manifest("blocked", 1, fp), adapter.payload, "bulk")
    assert sorted(r.code for r in reply.replicas) == ["OK"] * 4, reply.replicas
    # the chain starts at the peer, whose bulk port refuses: that hop went as gRPC chunks, the rest by bulk
    assert log_events(proxy.log_path, "adapter_relay_planned")[-1]["children"] == [peer.target]
    metrics = proxy.metrics()
    assert metric_value(metrics, "rollwire_proxy_push_path_total", 'path="grpc",reason="refused"') == 1
    assert metric_value(metrics, "rollwire_proxy_push_path_total", 'path="bulk",reason="connected"', default=0) == 0
    fallback = log_events(proxy.log_path, "push_bulk_fallback")
    assert [(e["child"], e["reason"]) for e in fallback] == [(peer.target, "refused")]
    assert [hops_by_path(r, "blocked") for r in replicas] == [["bulk"]] * 3
    assert all(metric_value(metrics, "rollwire_proxy_push_heals_total", f'replica="{r.target}"') == 0 for r in replicas)
    samples = [sampled(r.target, "blocked", 1) for r in replicas]
    assert samples[0] == samples[1] == samples[2]


@pytest.mark.parametrize("peer_proxy", [({"corrupt": True, "lie": True}, 1)], indirect=True)
def test_a_hop_that_alters_bytes_and_lies_is_caught_by_the_commit(peer_proxy, replicas, adapter):
    proxy, _peer = peer_proxy
    fp = status(proxy.target).model_fingerprint
    reply = push_via(proxy.target, adapter.manifest("lied", 1, fp), adapter.payload)
    # the replicas below never staged the altered bytes, so the commit the lie asked for fails
    outcomes = {r.address: (r.code, r.reason) for r in reply.replicas}
    assert all(outcomes[r.target] == ("FAILED_PRECONDITION", "NOT_STAGED") for r in replicas), outcomes
    # out of rotation, then caught up from the spool: the right bytes, verified by each replica
    wait_until(lambda: all(holds(r.target, "lied", 1) for r in replicas), 20, "the replicas caught up")
    wait_routable(proxy, replicas, timeout=20)
    samples = [sampled(r.target, "lied", 1) for r in replicas]
    assert samples[0] == samples[1] == samples[2]


@pytest.mark.parametrize(("setting", "path"), [("push.fanout=1", "grpc"), ("push.stripes=2", "bulk")])
def test_a_replica_killed_mid_relay_stops_nobody_and_rejoins_with_the_version(
    setting, path, replicas, workdir, adapter, tiny_model
):
    proxy = start_proxy(workdir, f"kill-proxy-{setting}", replicas, "--set", setting, *PROXY_ARGS)
    try:
        wait_routable(proxy, replicas)
        fp = status(proxy.target).model_fingerprint
        name = f"survive-{setting.split('.')[1].split('=')[0]}"
        manifest = adapter.manifest(name, 1, fp)
        half = len(adapter.payload) // 2
        killed = threading.Event()

        def upload():  # slow enough to be caught mid-relay: small chunks, the second half after the kill
            # asking for the bulk path, the client's own hop falls back at its first chunk; the relay's go by bulk
            yield opening(manifest, bulk=path == "bulk")
            for i in range(0, half, 1024):
                yield pb.PushAdapterRequest(chunk=adapter.payload[i : min(i + 1024, half)])
            killed.wait(30)
            for i in range(half, len(adapter.payload), 1024):
                yield pb.PushAdapterRequest(chunk=adapter.payload[i : i + 1024])

        channel = grpc.insecure_channel(proxy.target)
        future = generator_pb2_grpc.GeneratorServiceStub(channel).PushAdapter.future(
            upload(), timeout=PUSH_DEADLINE_S + 10
        )
        planned = wait_until(lambda: log_events(proxy.log_path, "adapter_relay_planned"), 15, "the relay is planned")
        first = next(r for r in replicas if r.target == planned[-1]["children"][0])
        wait_until(
            lambda: metric_value(first.metrics(), "rollwire_generator_adapter_push_bytes_total") > 0,
            15,
            "the first hop receives the push",
        )
        first.proc.kill()  # SIGKILL while it relays to the rest of the chain
        first.proc.wait(10)
        started = time.monotonic()
        killed.set()
        reply = future.result(timeout=PUSH_DEADLINE_S + 10)
        assert time.monotonic() - started < PUSH_DEADLINE_S
        channel.close()
        codes = {r.address: r.code for r in reply.replicas}
        others = [r for r in replicas if r is not first]
        assert [codes[r.target] for r in others] == ["OK", "OK"], reply.replicas
        assert codes[first.target] != "OK"
        assert all(set(hops_by_path(r, name)) == {path} for r in others)  # relay and heal alike
        for r in others:
            assert sampled(r.target, name, 1)
        # it comes back on its port and is caught up before it takes work
        again = start_generator(
            tiny_model,
            workdir,
            f"q-again-{path}",
            *GENERATOR_ARGS,
            *BULK_ON,
            "--replica-id",
            "q-again",
            "--port",
            str(first.port),
        )
        replicas[replicas.index(first)] = again
        wait_until(lambda: holds(again.target, name, 1), 30, "the restarted replica caught up")
        wait_routable(proxy, replicas, timeout=30)
        assert sampled(again.target, name, 1) == sampled(others[0].target, name, 1)
    finally:
        stop_all([proxy])


def test_a_replica_refuses_a_bad_relay_plan_before_it_dials_anyone(replicas, adapter):
    fp = status(replicas[0].target).model_fingerprint
    bad_plans = {
        "parent after child": plan_from_parents([("127.0.0.1:1", "a", 2), ("127.0.0.1:2", "b", 0)]),
        "same address twice": plan_from_parents([("127.0.0.1:1", "a", 0), ("127.0.0.1:1", "b", 1)]),
        "not an address": plan_from_parents([("http://x", "a", 0)]),
        "too many children": plan_from_parents([(f"127.0.0.1:{1000 + i}", "", 0) for i in range(17)]),
    }
    for case, plan in bad_plans.items():
        messages = writer.messages(adapter.manifest("plans", 1, fp), adapter.payload, relay=plan, stage_only=True)
        with pytest.raises(grpc.RpcError) as info:
            generator_pb2_grpc.GeneratorServiceStub(grpc.insecure_channel(replicas[0].target)).PushAdapter(
                messages, timeout=10
            )
        err = from_rpc_error(info.value)
        assert (err.code, err.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "BAD_RELAY_PLAN"), case
    assert not holds(replicas[0].target, "plans", 1)


def test_replicas_relay_to_each_other_over_mutual_tls_with_the_proxys_relay_token(tiny_model, pki, workdir, adapter):
    """The relay hop speaks what the proxy's hop speaks: TLS with a client certificate (the
    replicas require one), and the proxy's relay token (never its admin token), which the
    first replica passes on. On both paths: the bulk connections are TLS too, with the same
    certificates (a bulk hop without them could not connect, and would fall back)."""
    from support.processes import start_service

    (workdir / "admin.token").write_text("relay-admin-777\n")
    (workdir / "relay.token").write_text("relay-only-777\n")
    tls = ["--set", f"tls.cert_file={pki / 'server.pem'}", "--set", f"tls.key_file={pki / 'server.key'}"]

    def client_side(section: str) -> list[str]:  # how `section` dials a replica: mutual TLS
        files = {"ca_file": "ca.pem", "cert_file": "client.pem", "key_file": "client.key"}
        return [x for key, f in files.items() for x in ("--set", f"{section}.{key}={pki / f}")]

    secured = [
        start_generator(
            tiny_model,
            workdir,
            name,
            *GENERATOR_ARGS,
            "--replica-id",
            name,
            *tls,
            "--set",
            f"tls.client_ca_file={pki / 'ca.pem'}",
            "--set",
            f"auth.admin_tokens_file={workdir / 'admin.token'}",
            "--set",
            f"auth.relay_tokens_file={workdir / 'relay.token'}",
            *client_side("relay"),
            *BULK_ON,
            plaintext=False,
        )
        for name in ("tls1", "tls2")
    ]
    proxy = start_service(
        ["proxy", "--port", "0", "--metrics-port", "0", "--set", "health.interval_s=0.2", "--set", "push.fanout=1"]
        + ["--set", f"upstream.token_file={workdir / 'admin.token'}", *client_side("upstream")]
        + ["--set", f"upstream.relay_token_file={workdir / 'relay.token'}"]
        + [x for s in secured for x in ("--generator", s.target)]
        + list(BULK_ON),
        workdir,
        "tls-proxy",
    )
    try:
        wait_routable(proxy, secured)
        fp = status(proxy.target).model_fingerprint
        for path in PATHS:  # one fleet, both paths
            name = f"sealed-{path}"
            reply = push_via(proxy.target, adapter.manifest(name, 1, fp), adapter.payload, path)
            assert sorted((r.replica, r.code) for r in reply.replicas) == [("tls1", "OK"), ("tls2", "OK")], reply
            relayed = sorted(
                next(e["relayed_to"] for e in log_events(s.log_path, "adapter_staged") if e["adapter"] == name)
                for s in secured
            )
            assert relayed == [0, 1]  # the first hop relayed to the second, over TLS, with the token
            assert [hops_by_path(s, name) for s in secured] == [[path]] * 2
            assert (
                sum(
                    metric_value(proxy.metrics(), "rollwire_proxy_push_heals_total", f'replica="{s.target}"')
                    for s in secured
                )
                == 0
            )
        assert metric_value(proxy.metrics(), "rollwire_proxy_push_path_total", 'path="bulk",reason="connected"') == 1
    finally:
        stop_all([proxy, *secured])


async def _slow_door(host: str, port: int, hold_s: float) -> asyncio.Server:
    """A TCP relay to a real replica that holds each new connection `hold_s` before passing
    bytes either way: a child slow to open its stream (a slow dial, a busy replica)."""

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(1 << 16):
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(hold_s)
        up_reader, up_writer = await asyncio.open_connection(host, port)
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer), return_exceptions=True)

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def test_a_child_slow_to_open_its_stream_is_not_cut_off_as_stalled(replicas, adapter):
    """Until a child takes its first chunk its call is being set up: that time is judged
    against the settle timeout, not the stall timeout (push/forward.py, Forwarder.stalled).
    Here the connection is held 0.5 s, five times the stall limit, while the sender's queue
    for it is full; the child is not cut off and serves the version."""
    target = replicas[0]
    manifest = adapter.manifest("slow-door", 1, status(target.target).model_fingerprint)
    host, port = target.target.rsplit(":", 1)

    async def push() -> list[pb.ReplicaPushResult]:
        door = await _slow_door(host, int(port), hold_s=0.5)
        address = f"127.0.0.1:{door.sockets[0].getsockname()[1]}"
        async with door, grpc.aio.insecure_channel(address) as channel:
            forward = Forwarder(
                [Child(address, "slow-door", pb.RelayPlan())],
                manifest,
                stage_only=False,
                stub_for=lambda _: generator_pb2_grpc.GeneratorServiceStub(channel),
                metadata=[],
                deadline=time.monotonic() + 30,
                queue_chunks=2,
                stall_s=0.1,
                settle_s=5,
            )
            for piece in chunks(adapter.payload, 1024):  # the queue is full long before the door opens
                await forward.send(piece)
            forward.end()
            return await forward.results()

    results = asyncio.run(push())
    assert [(r.code, r.reason) for r in results] == [("OK", "")], results
    assert holds(target.target, "slow-door", 1)


def test_a_relaying_replica_sends_bulk_to_one_child_and_grpc_chunks_to_one_whose_port_is_blocked(replicas, adapter):
    """A replica taking bulk bytes forwards each piece from its reading thread to the child whose
    bulk lane is up, and through its event loop as gRPC chunks to the child that fell back: both
    verify the same bytes (the peer's reader checks the digest), and the fallback is counted."""
    peer = PeerServer(HostilePeer(replicas[0].target, blocked=True))
    try:
        fp = status(replicas[0].target).model_fingerprint
        m = adapter.manifest("mixed", 1, fp, blake3=blake3(adapter.payload).hexdigest())
        plan = plan_from_parents([(replicas[1].target, "q2", 0), (peer.target, "hostile-peer", 0)])
        push = BlockingPush(m, adapter.payload, writer.MAX_CHUNK, "127.0.0.1", 3.0)

        def requests():
            messages = push.requests()
            first = next(messages)
            first.relay.CopyFrom(plan)
            yield first
            yield from messages

        with grpc.insecure_channel(replicas[0].target) as channel:
            call = generator_pb2_grpc.GeneratorServiceStub(channel).PushAdapter.future(requests(), timeout=60)
            push.attach(call)
            reply = call.result()
        assert (push.path, push.reason) == ("bulk", "connected")
        assert {r.address: r.code for r in reply.replicas} == {replicas[1].target: "OK", peer.target: "OK"}
        assert peer.peer.accepted == {"mixed": [1]}
        served = [
            [e["path"] for e in log_events(r.log_path, "adapter_pushed") if e["adapter"] == "mixed"] for r in replicas
        ]
        assert served[:2] == [["bulk"], ["bulk"]]  # a plain push: served at once
        fallback = log_events(replicas[0].log_path, "push_bulk_fallback")
        assert [(e["child"], e["reason"]) for e in fallback if e["adapter"] == "mixed"] == [(peer.target, "refused")]
        assert sampled(replicas[0].target, "mixed", 1) == sampled(replicas[1].target, "mixed", 1)
    finally:
        peer.stop()


def test_a_bulk_connection_the_receiver_does_not_take_falls_back_to_grpc_chunks(replicas, adapter):
    """A receiver past `bulk.max_connections` proved connections closes a new one before its
    ACK: the sender sends the same bytes as gRPC chunks on the stream instead of failing the hop.
    (A connection that proves nothing holds no such place: it gives way to the push's, below.)"""
    peer = PeerServer(HostilePeer(replicas[0].target))
    squatter = None
    try:
        old = peer.peer.bulk
        assert old is not None
        peer.peer.bulk = BulkListener("127.0.0.1", BulkSection(enabled=True, max_connections=1), TlsSection())
        old.close()
        assert peer.peer.bulk._open.acquire(blocking=False)  # the one push place, as another push holds it
        squatter = socket.create_connection(("127.0.0.1", peer.peer.bulk.port))  # a hello place, says nothing
        m = adapter.manifest("untaken", 1, status(replicas[0].target).model_fingerprint)
        push = BlockingPush(m, adapter.payload, writer.MAX_CHUNK, "127.0.0.1", 3.0)
        with grpc.insecure_channel(peer.target) as channel:
            call = generator_pb2_grpc.GeneratorServiceStub(channel).PushAdapter.future(push.requests(), timeout=30)
            push.attach(call)
            reply = call.result()
        assert (push.path, push.reason) == ("grpc", "refused")
        assert reply.name == "untaken" and peer.peer.accepted == {"untaken": [1]}  # its reader verified the bytes
    finally:
        if squatter is not None:
            squatter.close()
        peer.stop()


@pytest.mark.parametrize("bulk", [False, True])
def test_the_blocking_client_sends_its_bytes_by_the_path_it_asks_for(bulk, replicas, adapter):
    """The SDK's blocking `Client.push_adapter(bulk=...)`: with bulk, the replica took the bytes
    over its bulk endpoint (its log says which path each push came by), without, as chunks;
    either way the version is served and answers as the same weights do."""
    from rollwire.client import Client

    target = replicas[0].target
    fp = status(target).model_fingerprint
    name = f"sync-{'bulk' if bulk else 'grpc'}"
    with Client(target) as client:
        result = client.push_adapter(name, 1, adapter.payload, adapter.shape, fp, bulk=bulk)
    assert (result.name, result.version, result.already_loaded) == (name, 1, False)
    # with bulk the SDK left the sha256 to the replica, which named it from the bytes it verified
    assert result.sha256 == hashlib.sha256(adapter.payload).hexdigest()
    assert [dict(a.digests) for a in status(target).adapters if a.name == name] == [{1: result.sha256}]
    pushed = [e["path"] for e in log_events(replicas[0].log_path, "adapter_pushed") if e["adapter"] == name]
    assert pushed == ["bulk" if bulk else "grpc"]  # a push straight to a replica: no staging
    assert holds(target, name, 1)


def test_a_bulk_push_of_many_pieces_reaches_a_whole_chain_byte_for_byte(replicas, proxies, tiny_model):
    """A payload of several of the bulk path's pieces (reader.DIRECT_PIECE, the last one partial)
    down a chain: each hop receives, verifies and forwards piece by piece on one thread, so a
    piece cut or sent out of place anywhere would fail a hop's BLAKE3. Every replica stages the
    same version and answers with the same weights."""
    from rollwire.push.reader import DIRECT_PIECE

    big = make_adapter(tiny_model, seed=23, r=512, scale=0.01)  # 10.5 MB: 2.5 pieces of 4 MiB
    assert 2 * DIRECT_PIECE < len(big.payload) < 3 * DIRECT_PIECE
    proxy = proxies("relay-proxy-1", "--set", "push.fanout=1")
    fp = status(proxy.target).model_fingerprint
    reply = push_via(proxy.target, big.manifest("pieces", 1, fp), big.payload, "bulk")
    assert sorted((r.address, r.code) for r in reply.replicas) == sorted((r.target, "OK") for r in replicas)
    relayed = sorted(
        next(e["relayed_to"] for e in log_events(r.log_path, "adapter_staged") if e["adapter"] == "pieces")
        for r in replicas
    )
    assert relayed == [0, 1, 2]  # a chain: two replicas forwarded every piece
    assert [hops_by_path(r, "pieces") for r in replicas] == [["bulk"]] * 3
    heals = [
        metric_value(proxy.metrics(), "rollwire_proxy_push_heals_total", f'replica="{r.target}"') for r in replicas
    ]
    assert heals == [0, 0, 0]  # every hop's bytes were right the first time: none was sent again
    samples = [sampled(r.target, "pieces", 1) for r in replicas]
    assert samples[0] == samples[1] == samples[2]
