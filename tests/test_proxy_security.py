"""The proxy under bearer tokens and TLS: it checks its clients' roles as a replica does,
and reaches a replica that requires tokens and mutual TLS with credentials of its own (the
clients' tokens are never forwarded). The replica joins by itself, over TLS, with a token."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.processes import GENERATOR_ARGS, free_port, start_generator, start_service, wait_until
from support.wire import all_methods, make_adapter, push_messages, request, run_group

from rollwire.runtime.security import METHOD_ROLES
from rollwire.v1 import admin_pb2 as apb
from rollwire.v1 import admin_pb2_grpc, generator_pb2_grpc
from rollwire.v1 import generator_pb2 as pb

TOKENS = {
    "proxy-generate": "p-gen-111",
    "proxy-admin": "p-adm-222",
    "replica-generate": "r-gen-333",
    "replica-admin": "r-adm-444",
}
AUTH_ERRORS = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


@pytest.fixture(scope="module")
def secured(tiny_model, pki, tmp_path_factory):
    work = tmp_path_factory.mktemp("proxy-security")
    for name, token in TOKENS.items():
        (work / f"{name}.token").write_text(token + "\n")
    tls = ["--set", f"tls.cert_file={pki / 'server.pem'}", "--set", f"tls.key_file={pki / 'server.key'}"]
    health_port = free_port()
    proxy = start_service(
        [
            "proxy",
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--set",
            "health.interval_s=0.2",
            *tls,
            "--set",
            f"tls.health_port={health_port}",
            "--set",
            f"auth.generate_tokens_file={work / 'proxy-generate.token'}",
            "--set",
            f"auth.admin_tokens_file={work / 'proxy-admin.token'}",
            "--set",
            f"upstream.token_file={work / 'replica-admin.token'}",
            "--set",
            f"upstream.ca_file={pki / 'ca.pem'}",
            "--set",
            f"upstream.cert_file={pki / 'client.pem'}",
            "--set",
            f"upstream.key_file={pki / 'client.key'}",
        ],
        work,
        "proxy",
        plaintext=False,
    )
    replica = start_generator(
        tiny_model,
        work,
        "replica",
        *GENERATOR_ARGS,
        "--replica-id",
        "secure-replica",
        *tls,
        "--set",
        f"tls.client_ca_file={pki / 'ca.pem'}",
        "--set",
        f"auth.generate_tokens_file={work / 'replica-generate.token'}",
        "--set",
        f"auth.admin_tokens_file={work / 'replica-admin.token'}",
        "--register",
        proxy.target,
        "--register-token-file",
        str(work / "proxy-admin.token"),
        "--register-tls-ca",
        str(pki / "ca.pem"),
        plaintext=False,
    )
    channel = grpc.secure_channel(proxy.target, grpc.ssl_channel_credentials((pki / "ca.pem").read_bytes()))
    admin = admin_pb2_grpc.AdminServiceStub(channel)
    as_admin = (("authorization", f"Bearer {TOKENS['proxy-admin']}"),)
    wait_until(
        lambda: [
            r
            for r in admin.ListGenerators(apb.ListGeneratorsRequest(), metadata=as_admin, timeout=10).replicas
            if r.healthy
        ],
        30,
        "the secured replica registered itself and is routable",
    )
    yield proxy, replica, channel, health_port
    replica.stop()
    channel.close()
    proxy.stop()


def bearer(name: str | None):
    return (("authorization", f"Bearer {TOKENS[name]}"),) if name else ()


def code_of(channel, method: str, desc, token: str | None):
    """Invoke any RPC with an empty request; returns the status code."""
    kind = (desc.client_streaming, desc.server_streaming)
    call = {
        (False, False): channel.unary_unary,
        (False, True): channel.unary_stream,
        (True, False): channel.stream_unary,
        (True, True): channel.stream_stream,
    }[kind](method)
    arg = iter([b""]) if desc.client_streaming else b""
    try:
        reply = call(arg, metadata=bearer(token), timeout=10)
        if desc.server_streaming:
            list(reply)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("method,desc", list(all_methods()), ids=lambda x: x if isinstance(x, str) else "")
def test_the_proxy_enforces_roles_on_every_rpc(secured, method, desc):
    _, _, channel, _ = secured
    assert code_of(channel, method, desc, None) == grpc.StatusCode.UNAUTHENTICATED
    assert code_of(channel, method, desc, "replica-admin") == grpc.StatusCode.UNAUTHENTICATED  # not the proxy's token
    with_generate = code_of(channel, method, desc, "proxy-generate")
    if METHOD_ROLES[method] != "generate":  # admin, or a narrow role (relay, register) admin also has
        assert with_generate == grpc.StatusCode.PERMISSION_DENIED
    else:
        assert with_generate not in AUTH_ERRORS
    assert code_of(channel, method, desc, "proxy-admin") not in AUTH_ERRORS


def test_generate_and_push_cross_tls_and_tokens_on_both_hops(secured, tiny_model):
    proxy, replica, channel, health_port = secured
    stub = generator_pb2_grpc.GeneratorServiceStub(channel)
    adapter = make_adapter(tiny_model, seed=41)
    fingerprint = stub.GetStatus(pb.GetStatusRequest(), metadata=bearer("proxy-generate"), timeout=10).model_fingerprint
    reply = stub.PushAdapter(
        push_messages(adapter.manifest("secure", 1, fingerprint), adapter.payload),
        metadata=bearer("proxy-admin"),
        timeout=60,
    )
    assert [(r.replica, r.code) for r in reply.replicas] == [("secure-replica", "OK")]
    result = run_group(stub, request("over tls", adapter="secure"), metadata=bearer("proxy-generate"))
    assert (result.replica, result.version) == ("secure-replica", 1)
    with grpc.insecure_channel(proxy.target) as plain, pytest.raises(grpc.RpcError) as info:
        generator_pb2_grpc.GeneratorServiceStub(plain).GetStatus(
            pb.GetStatusRequest(), metadata=bearer("proxy-admin"), timeout=5
        )
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # plaintext is refused
    with grpc.insecure_channel(f"127.0.0.1:{health_port}") as plain:  # probes still work in plaintext
        check = health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert check.status == health_pb2.HealthCheckResponse.SERVING
    logs = proxy.log_path.read_text() + replica.log_path.read_text()
    assert not any(token in logs for token in TOKENS.values())


def test_the_replica_leaves_through_tls_with_its_token(secured):
    _, replica, channel, _ = secured
    replica.stop()  # it asks the proxy to drain and deregister it before stopping
    admin = admin_pb2_grpc.AdminServiceStub(channel)
    assert (
        list(admin.ListGenerators(apb.ListGeneratorsRequest(), metadata=bearer("proxy-admin"), timeout=10).replicas)
        == []
    )


pytestmark = pytest.mark.integration  # starts processes or servers: not in make test-fast
