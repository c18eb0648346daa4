"""Bearer-token roles on every RPC, TLS and mutual TLS, against real generator processes."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.processes import free_port, start_generator
from support.wire import all_methods

from rollwire.client import Client, TlsConfig
from rollwire.common.errors import PermissionDenied, Unauthenticated, Unavailable
from rollwire.runtime.security import METHOD_ROLES, PEER_ONLY

GENERATE_TOKEN, ADMIN_TOKEN = "gen-secret-123", "admin-secret-456"


def test_every_rpc_has_a_role():
    assert {name for name, _ in all_methods()} == set(METHOD_ROLES)


@pytest.fixture(scope="module")
def secured(tiny_model, tmp_path_factory):
    work = tmp_path_factory.mktemp("auth")
    (work / "generate.tokens").write_text(f"# generate role\n{GENERATE_TOKEN}\n")
    (work / "admin.tokens").write_text(f"{ADMIN_TOKEN}\n")
    svc = start_generator(
        tiny_model,
        work,
        "secured",
        "--set",
        f"auth.generate_tokens_file={work / 'generate.tokens'}",
        "--set",
        f"auth.admin_tokens_file={work / 'admin.tokens'}",
    )
    yield svc
    svc.stop()


def call(target: str, method: str, desc, token: str | None):
    """Invoke any RPC with an empty request; returns the status code."""
    channel = grpc.insecure_channel(target)
    metadata = [("authorization", f"Bearer {token}")] if token else []
    kind = (desc.client_streaming, desc.server_streaming)
    try:
        if kind == (False, False):
            channel.unary_unary(method)(b"", metadata=metadata, timeout=10)
        elif kind == (False, True):
            list(channel.unary_stream(method)(b"", metadata=metadata, timeout=10))
        elif kind == (True, False):
            channel.stream_unary(method)(iter([b""]), metadata=metadata, timeout=10)
        else:
            list(channel.stream_stream(method)(iter([b""]), metadata=metadata, timeout=10))
    except grpc.RpcError as exc:
        return exc.code()
    finally:
        channel.close()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("method,desc", list(all_methods()), ids=lambda x: x if isinstance(x, str) else "")
def test_missing_wrong_and_wrong_role_tokens_are_refused(secured, method, desc):
    assert call(secured.target, method, desc, None) == grpc.StatusCode.UNAUTHENTICATED
    assert call(secured.target, method, desc, "not-a-token") == grpc.StatusCode.UNAUTHENTICATED
    with_generate = call(secured.target, method, desc, GENERATE_TOKEN)
    if METHOD_ROLES[method] != "generate":  # admin, or a narrow role (relay, register) admin also has
        assert with_generate == grpc.StatusCode.PERMISSION_DENIED
    else:
        assert with_generate not in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
    with_admin = call(secured.target, method, desc, ADMIN_TOKEN)
    if method in PEER_ONLY:  # a peer proxy's lineage map: not even admin may send one
        assert with_admin == grpc.StatusCode.PERMISSION_DENIED
    else:
        assert with_admin not in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


def test_roles_through_the_sdk(secured):
    with Client(secured.target, token=GENERATE_TOKEN, timeout=30) as c:
        assert c.generate("ok", max_new_tokens=2, ignore_eos=True).samples[0].completion_tokens == 2
        with pytest.raises(PermissionDenied, match="admin role"):
            c.push_adapter("x", 1, b"\0" * 16, {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}, "sha256:0")
    with Client(secured.target, timeout=30) as c, pytest.raises(Unauthenticated, match="bearer token"):
        c.get_status()
    assert GENERATE_TOKEN not in secured.log_path.read_text() and ADMIN_TOKEN not in secured.log_path.read_text()


@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mtls"])
def test_tls_round_trip_and_plaintext_refused(tiny_model, pki, tmp_path, mutual):
    args = ["--set", f"tls.cert_file={pki / 'server.pem'}", "--set", f"tls.key_file={pki / 'server.key'}"]
    health_port = free_port()
    args += ["--set", f"tls.health_port={health_port}"]
    if mutual:
        args += ["--set", f"tls.client_ca_file={pki / 'ca.pem'}"]
    svc = start_generator(tiny_model, tmp_path, "tls", *args, plaintext=False)
    try:
        client_tls = TlsConfig.from_files(
            pki / "ca.pem", pki / "client.pem" if mutual else None, pki / "client.key" if mutual else None
        )
        with Client(svc.target, tls=client_tls, timeout=30, max_attempts=1) as c:
            assert c.generate("secure", max_new_tokens=3, ignore_eos=True).samples[0].completion_tokens == 3
        with Client(svc.target, timeout=5, max_attempts=1) as c, pytest.raises(Unavailable):
            c.get_status()  # plaintext is refused when TLS is on
        if mutual:
            with Client(svc.target, tls=TlsConfig.from_files(pki / "ca.pem"), timeout=5, max_attempts=1) as c:
                with pytest.raises(Unavailable):
                    c.get_status()  # no client certificate under mTLS
        with grpc.insecure_channel(f"127.0.0.1:{health_port}") as ch:  # probes still work in plaintext
            check = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert check.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        svc.stop()


pytestmark = pytest.mark.integration  # starts processes or servers: not in make test-fast
