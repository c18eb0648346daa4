"""Peering holds one truth (issue 23, item 5), with real processes: the peer marker comes only
from a peer proxy's token, a peer holding other bytes under a version fences it (never "OK"),
the push reply names every peer that is behind, a proxy whose peers' sender never committed a
version brings its replicas to it itself (so "latest" never goes backwards across proxies),
and a proxy that would share its id with a running peer refuses to start."""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import pytest
from support.processes import free_port, start_generators, start_service, stop_all, wait_routable, wait_until
from support.wire import fingerprint, make_adapter, metric_value

from rollwire.client import Client
from rollwire.common import writer
from rollwire.common.errors import FailedPrecondition, from_rpc_error
from rollwire.common.reasons import Reason
from rollwire.proxy.publish.peers import PEER_KEY
from rollwire.v1 import generator_pb2 as pb
from rollwire.v1 import generator_pb2_grpc

NAME = "trusted"


def proxy_args(workdir, name: str, port: int, replica, peers: list[str], *extra: str) -> list[str]:
    args = ["proxy", "--port", str(port), "--metrics-port", "0", "--proxy-id", name, "--generator", replica.target]
    args += ["--spool-dir", str(workdir / f"{name}-spool"), "--set", "health.interval_s=0.2"]
    return [*args, "--set", "peers=" + json.dumps(peers), "--set", "peering.interval_s=0.2", *extra]


def spooled(workdir, proxy: str) -> list[int]:
    return sorted(int(f.stem) for f in (workdir / f"{proxy}-spool" / NAME).glob("*.json"))


def push_raw(target: str, adapter, version: int, fp: str, metadata) -> grpc.RpcError | None:
    """A PushAdapter with chosen metadata (the SDK never sends the peer marker)."""
    with grpc.insecure_channel(target) as channel:
        try:
            generator_pb2_grpc.GeneratorServiceStub(channel).PushAdapter(
                writer.messages(adapter.manifest(NAME, version, fp), adapter.payload), timeout=60, metadata=metadata
            )
        except grpc.RpcError as exc:
            return exc
    return None


def reason_of(exc: grpc.RpcError) -> str:
    return from_rpc_error(exc).reason  # pyright: ignore[reportArgumentType]


def healthy_members(proxy, token: str) -> set[str]:
    with grpc.insecure_channel(proxy.target) as channel:
        status = generator_pb2_grpc.GeneratorServiceStub(channel).GetStatus(
            pb.GetStatusRequest(), timeout=5, metadata=[("authorization", f"Bearer {token}")]
        )
    return {r.address for r in status.replicas if r.healthy}


def test_the_peer_marker_needs_the_peer_role(tiny_model, tmp_path):
    (replica,) = start_generators(tiny_model, tmp_path, ["r1"])
    for role in ("admin", "peer"):
        (tmp_path / f"{role}.token").write_text(f"{role}-token\n")
    auth = ["--set", f"auth.admin_tokens_file={tmp_path / 'admin.token'}"]
    auth += ["--set", f"auth.peer_tokens_file={tmp_path / 'peer.token'}"]
    auth += ["--set", f"peering.token_file={tmp_path / 'peer.token'}"]
    port = free_port()
    proxy = start_service(proxy_args(tmp_path, "a", port, replica, [f"127.0.0.1:{free_port()}"], *auth), tmp_path, "a")
    try:
        wait_until(lambda: replica.target in healthy_members(proxy, "admin-token"), 60, "the replica joined")
        fp, adapter = fingerprint(replica.target), make_adapter(tiny_model, seed=5)
        bearer = {role: ("authorization", f"Bearer {role}-token") for role in ("admin", "peer")}
        marked = (PEER_KEY, "mallory")
        # an admin cannot slip a version into this proxy's spool alone (no fan-out, no peers)
        refused = push_raw(proxy.target, adapter, 1, fp, [bearer["admin"], marked])
        assert refused is not None and refused.code() == grpc.StatusCode.PERMISSION_DENIED
        assert reason_of(refused) == Reason.WRONG_ROLE and "peer" in (refused.details() or "")
        # a peer token publishes nothing: without the marker it is refused too
        refused = push_raw(proxy.target, adapter, 1, fp, [bearer["peer"]])
        assert refused is not None and refused.code() == grpc.StatusCode.PERMISSION_DENIED
        assert spooled(tmp_path, "a") == []
        # the peer's copy, with the peer role: spooled, not fanned out
        assert push_raw(proxy.target, adapter, 1, fp, [bearer["peer"], marked]) is None
        assert spooled(tmp_path, "a") == [1]
        pushes = metric_value(
            proxy.metrics(), "rollwire_proxy_replica_pushes_total", f'replica="{replica.target}",code="OK"'
        )
        assert pushes == 0
    finally:
        stop_all([proxy, replica])


def test_conflicts_fence_the_version_and_the_reply_names_peers_behind(tiny_model, tmp_path):
    r1, r2 = start_generators(tiny_model, tmp_path, ["r1", "r2"])
    a_port, b_port = free_port(), free_port()
    b_address = f"127.0.0.1:{b_port}"
    services = [r1, r2]
    try:
        fp = fingerprint(r1.target)
        x, y = make_adapter(tiny_model, seed=1), make_adapter(tiny_model, seed=2)
        # b, peered with nobody, is given other bytes under v2 than a will be; then it is down
        b = start_service(proxy_args(tmp_path, "b", b_port, r2, []), tmp_path, "b")
        services.append(b)
        wait_routable(b, [r2])
        with Client(b.target, timeout=60) as to_b:
            to_b.push_adapter(NAME, 2, x.payload, x.shape, fp)
        b.stop()

        a = start_service(proxy_args(tmp_path, "a", a_port, r1, [b_address]), tmp_path, "a")
        services.append(a)
        wait_routable(a, [r1])
        with Client(a.target, timeout=60) as to_a:
            reply = to_a.push_adapter(NAME, 1, x.payload, x.shape, fp)  # b is down: named, not hidden behind OK
        assert [(p.address, p.code, p.reason) for p in reply.peers] == [(b_address, "UNAVAILABLE", Reason.PEER_BEHIND)]

        b = start_service(proxy_args(tmp_path, "b", b_port, r2, []), tmp_path, "b")  # back, on its spool
        services.append(b)
        wait_routable(b, [r2])
        wait_until(
            lambda: metric_value(a.metrics(), "rollwire_proxy_peer_synced", f'peer="{b_address}"') == 1,
            30,
            "a synced b",
        )
        assert spooled(tmp_path, "b") == [2]  # a's v1 is below b's newest: taken as delivered, not resent forever

        with Client(a.target, timeout=60) as to_a, pytest.raises(FailedPrecondition) as refused:
            to_a.push_adapter(NAME, 2, y.payload, y.shape, fp)
        assert refused.value.reason == Reason.PEER_VERSION_CONFLICT and b_address in refused.value.message
        assert spooled(tmp_path, "a") == [1]  # fenced: out of a's spool, so no catch-up serves it
        assert metric_value(a.metrics(), "rollwire_proxy_peer_version_conflicts_total", f'peer="{b_address}"') == 1
        with Client(a.target, timeout=60) as to_a:
            assert to_a.generate("x", adapter=NAME, max_new_tokens=2).adapter.version == 1  # never v2 of y's bytes
    finally:
        stop_all(services)


def test_a_version_its_sender_never_committed_is_served_not_skipped(tiny_model, tmp_path):
    """b got v1 from a (peer copy) but a's replicas are not b's; b's latest must not stay behind:
    after peering.hold_s it brings its own replica to v1 itself, while requests wait."""
    r1, r2 = start_generators(tiny_model, tmp_path, ["r1", "r2"])
    a_port, b_port = free_port(), free_port()
    both = [f"127.0.0.1:{a_port}", f"127.0.0.1:{b_port}"]
    slow = ("--set", "health.status_every_s=120", "--set", "peering.hold_s=0.5")
    a = start_service(proxy_args(tmp_path, "a", a_port, r1, both), tmp_path, "a")
    b = start_service(proxy_args(tmp_path, "b", b_port, r2, both, *slow), tmp_path, "b")
    services = [r1, r2, a, b]
    try:
        wait_routable(a, [r1])
        wait_routable(b, [r2])
        wait_until(
            lambda: metric_value(a.metrics(), "rollwire_proxy_peer_synced", f'peer="{both[1]}"') == 1, 30, "a synced b"
        )
        fp, adapter = fingerprint(r1.target), make_adapter(tiny_model, seed=9)
        with Client(a.target, timeout=60) as to_a:
            reply = to_a.push_adapter(NAME, 1, adapter.payload, adapter.shape, fp)
        assert [(p.address, p.code) for p in reply.peers] == [(both[1], "OK")]
        with Client(b.target, timeout=60) as to_b:
            assert to_b.generate("x", adapter=NAME, max_new_tokens=2).adapter.version == 1
    finally:
        stop_all(services)


def test_a_proxy_refuses_to_start_with_a_running_peers_id(tiny_model, tmp_path):
    (replica,) = start_generators(tiny_model, tmp_path, ["r1"])
    a_port = free_port()
    peers = [f"127.0.0.1:{a_port}"]
    a = start_service(proxy_args(tmp_path, "a", a_port, replica, peers), tmp_path, "a")
    try:
        args = proxy_args(tmp_path, "a", free_port(), replica, peers)  # the same id again
        done = subprocess.run(
            [sys.executable, "-m", "rollwire.client.cli", *args], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 2
        assert "already goes by this proxy's id 'a'" in done.stderr
    finally:
        stop_all([a, replica])


pytestmark = pytest.mark.integration  # starts processes: not in make test-fast
