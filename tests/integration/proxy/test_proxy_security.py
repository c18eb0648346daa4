"""The proxy under bearer tokens and TLS: it checks its clients' roles as a replica does,
and reaches a replica that requires tokens and mutual TLS with credentials of its own (the
clients' tokens are never forwarded). The replica joins by itself, over TLS, with a token."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.processes import GENERATOR_ARGS, free_port, start_generator, start_service, wait_until
from support.wire import all_methods, make_adapter, metric_value, push_messages, request, run_group

from rollwire.proxy.fleet.replicas import SERVICE
from rollwire.runtime.members import CHALLENGE_KEY, PROOF_KEY, member_proof
from rollwire.runtime.security import METHOD_ROLES, PEER_ONLY
from rollwire.v1 import admin_pb2 as apb
from rollwire.v1 import admin_pb2_grpc, generator_pb2_grpc
from rollwire.v1 import generator_pb2 as pb

TOKENS = {
    "proxy-generate": "p-gen-111",
    "proxy-admin": "p-adm-222",
    "replica-generate": "r-gen-333",
    "replica-admin": "r-adm-444",
    "proxy-register": "p-reg-555",
    "fleet-key": "fleet-key-0123456789abcdef",
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
            f"auth.register_tokens_file={work / 'proxy-register.token'}",
            "--set",
            f"upstream.member_key_file={work / 'fleet-key.token'}",
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
    with_admin = code_of(channel, method, desc, "proxy-admin")
    if method in PEER_ONLY:  # a peer proxy's lineage map: not even admin may send one
        assert with_admin == grpc.StatusCode.PERMISSION_DENIED
    else:
        assert with_admin not in AUTH_ERRORS


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


class Rogue(generator_pb2_grpc.GeneratorServiceServicer):
    """A member that echoes the fleet's public facts (fingerprint, plausible limits) and answers
    rollouts with tokens of its choice; it records every credential the proxy sends it. With
    `key` it also answers the registration challenge (a compromised key holder)."""

    def __init__(self, fingerprint: str) -> None:
        self.fingerprint, self.key, self.address = fingerprint, b"", ""
        self.seen: list[str] = []
        self.generates = 0

    def _record(self, context) -> dict:
        metadata = dict(context.invocation_metadata())
        self.seen.append(str(metadata.get("authorization", "")))
        return metadata

    def GetStatus(self, request, context):
        nonce = self._record(context).get(CHALLENGE_KEY)
        if nonce and self.key:
            context.send_initial_metadata(((PROOF_KEY, member_proof(self.key, self.address, nonce)),))
        limits = pb.Limits(max_n=1, max_new_tokens=9, max_prompt_tokens=9, max_context=40, adapter_window=1)
        return pb.GetStatusResponse(
            role="generator", replica="rogue", model_fingerprint=self.fingerprint, limits=limits
        )

    def Generate(self, request, context):
        self._record(context)
        self.generates += 1
        yield pb.GenerateResponse(tokens=[pb.TokenChunk(sample_index=0, token_ids=[5, 5, 5], logprobs=[-0.1] * 3)])


def _serve_rogue(rogue: Rogue, pki) -> tuple[grpc.Server, int]:
    from concurrent import futures

    from grpc_health.v1 import health

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    generator_pb2_grpc.add_GeneratorServiceServicer_to_server(rogue, server)
    checks = health.HealthServicer()
    for name in ("", SERVICE):
        checks.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    credentials = grpc.ssl_server_credentials([((pki / "server.key").read_bytes(), (pki / "server.pem").read_bytes())])
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    return server, port


def test_a_registered_member_earns_only_its_own_token_and_serves_after_its_canary(secured, tiny_model, pki, tmp_path):
    """A register token: a rogue that cannot prove its address is refused; one that can (a key
    holder) gets only a token for itself, which the real replicas refuse, fails its canary and never
    serves or moves the fleet's limits; an honest replica that registers itself passes and serves,
    and clients beside them see no failure."""
    proxy, replica, channel, _ = secured
    stub, admin = generator_pb2_grpc.GeneratorServiceStub(channel), admin_pb2_grpc.AdminServiceStub(channel)
    before = stub.GetStatus(pb.GetStatusRequest(), metadata=bearer("proxy-admin"), timeout=10)
    rogue = Rogue(before.model_fingerprint)
    server, port = _serve_rogue(rogue, pki)
    rogue.address = f"127.0.0.1:{port}"
    register = apb.RegisterGeneratorRequest(address=rogue.address, ttl_seconds=60)
    failures, served = [], []

    def clients() -> None:  # well-behaved clients of the same proxy, throughout
        for i in range(2):
            try:
                served.append(run_group(stub, request(f"{i}+1="), metadata=bearer("proxy-generate")).replica)
            except grpc.RpcError as exc:
                failures.append(exc)

    honest = None
    try:
        with pytest.raises(grpc.RpcError) as info:  # another port of the caller's host, no proof
            admin.RegisterGenerator(register, metadata=bearer("proxy-register"), timeout=30)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "did not prove" in (info.value.details() or "") and "member_key_file" in info.value.details()
        rogue.key = TOKENS["fleet-key"].encode()
        assert admin.RegisterGenerator(register, metadata=bearer("proxy-register"), timeout=30).created

        def rogue_refused() -> bool:
            clients()
            listed = admin.ListGenerators(apb.ListGeneratorsRequest(), metadata=bearer("proxy-admin"), timeout=10)
            return any(r.address == rogue.address and "failed the canary" in r.detail for r in listed.replicas)

        wait_until(rogue_refused, 60, "the rogue failed its canary")
        assert rogue.seen and all(seen.startswith("Bearer rwm1.") for seen in rogue.seen), rogue.seen
        assert rogue.generates == 1  # the canary only: no client's prompt reached it
        with grpc.secure_channel(replica.target, _client_tls(pki)) as direct:  # useless on a real replica
            with pytest.raises(grpc.RpcError) as info:
                generator_pb2_grpc.GeneratorServiceStub(direct).GetStatus(
                    pb.GetStatusRequest(), metadata=(("authorization", rogue.seen[0]),), timeout=10
                )
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        after = stub.GetStatus(pb.GetStatusRequest(), metadata=bearer("proxy-admin"), timeout=10)
        assert after.limits == before.limits
        refusals = proxy.metrics()
        assert metric_value(refusals, "rollwire_proxy_member_refusals_total", 'why="canary"') == 1
        assert metric_value(refusals, "rollwire_proxy_member_refusals_total", 'why="unproven"') == 1

        honest = _honest_member(tiny_model, tmp_path, pki, proxy)
        wait_until(lambda: (clients(), "honest-member" in served)[1], 90, "the honest member passed and serves")
        assert failures == [] and rogue.generates == 1
    finally:
        if honest is not None:
            honest.stop()  # it drains and deregisters itself
        admin.DeregisterGenerator(
            apb.DeregisterGeneratorRequest(address=rogue.address), metadata=bearer("proxy-admin"), timeout=10
        )
        server.stop(0)
    assert not any(secret in proxy.log_path.read_text() for secret in TOKENS.values())


def _client_tls(pki) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        (pki / "ca.pem").read_bytes(), (pki / "client.key").read_bytes(), (pki / "client.pem").read_bytes()
    )


def _honest_member(tiny_model, work, pki, proxy):
    for name in ("replica-generate", "replica-admin", "proxy-register", "fleet-key"):
        (work / f"{name}.token").write_text(TOKENS[name] + "\n")
    tls = ["--set", f"tls.cert_file={pki / 'server.pem'}", "--set", f"tls.key_file={pki / 'server.key'}"]
    return start_generator(
        tiny_model,
        work,
        "honest-member",
        *GENERATOR_ARGS,
        *("--replica-id", "honest-member", *tls, "--set", f"tls.client_ca_file={pki / 'ca.pem'}"),
        *("--set", f"auth.generate_tokens_file={work / 'replica-generate.token'}"),
        *("--set", f"auth.admin_tokens_file={work / 'replica-admin.token'}"),
        *("--set", f"auth.member_key_file={work / 'fleet-key.token'}"),
        *("--register", proxy.target, "--register-token-file", str(work / "proxy-register.token")),
        *("--register-tls-ca", str(pki / "ca.pem"), "--register-ttl", "6"),
        plaintext=False,
    )


def test_the_replica_leaves_through_tls_with_its_token(secured):
    _, replica, channel, _ = secured
    replica.stop()  # it asks the proxy to drain and deregister it before stopping
    admin = admin_pb2_grpc.AdminServiceStub(channel)
    assert (
        list(admin.ListGenerators(apb.ListGeneratorsRequest(), metadata=bearer("proxy-admin"), timeout=10).replicas)
        == []
    )


pytestmark = pytest.mark.integration  # starts processes or servers: not in make test-fast
