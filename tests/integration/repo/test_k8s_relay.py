"""The shipped Kubernetes configs against running processes: the autoscaler's metric is one a
replica exports, and replicas and a proxy started from the shipped configs relay a push
between replicas over TLS."""

from __future__ import annotations

import json
import secrets
import subprocess
from pathlib import Path

import pytest
import yaml
from support.wire import metric_value

from rollwire.runtime.config import load_config

K8S = Path(__file__).resolve().parents[3] / "ops" / "k8s"


def kustomization() -> dict:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


def resources() -> list[dict]:
    docs = []
    for name in kustomization()["resources"]:
        docs += [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]
    return docs


def by_kind(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in resources() if d["kind"] == kind}


def _shipped_pki(folder: Path) -> None:
    """tls.crt/tls.key/ca.crt as the rollwire-tls Secret holds them: one certificate for the
    names the shipped configs check (the generators' and the proxies' Services) and 127.0.0.1."""

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)

    key = ("-newkey", "rsa:2048", "-nodes")
    run("req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=rollwire-test-ca")
    run("req", *key, "-keyout", "tls.key", "-out", "tls.csr", "-subj", "/CN=rollwire")
    names = "DNS:rollwire-generator.rollwire.svc,DNS:rollwire-proxy.rollwire.svc,IP:127.0.0.1"
    (folder / "san.ext").write_text(f"subjectAltName={names}\n")
    run(
        *("x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial"),
        *("-out", "tls.crt", "-days", "2", "-extfile", "san.ext"),
    )


def _shipped_credentials(key) -> dict[str, str]:
    """Every token Secret's keys with stand-ins: a key of one name holds one value in every Secret
    (their placeholders say "the same ... as"), the member signing key is a real key and its trust
    file its public half. All processes here share one folder, each reading only its own config's."""
    files = {
        "member-signing-key": json.dumps({"id": key.key_id, "private_key": _private_b64(key)}) + "\n",
        "member-trust": json.dumps({"keys": [key.trust_entry()]}) + "\n",
    }
    for name, secret in by_kind("Secret").items():
        if name.endswith("-tokens"):
            for field, value in secret["stringData"].items():
                lines = [f"{field}-{i}-{secrets.token_hex(8)}" for i, line in enumerate(value.splitlines()) if line]
                files.setdefault(field, "\n".join(lines) + "\n")
    return files


def _private_b64(key) -> str:
    import base64

    return base64.b64encode(key.private.private_bytes_raw()).decode()


def _one_replica_cannot_act_as_another(generators, root: Path, signing, credentials) -> None:
    """Audit 2026-12-07 S6, hostile: k8s-a compromised, with every file its pod holds (relay, grant,
    member-trust) and the member token the proxy sends it. None of them lets it call k8s-b as a member
    (before: one fleet key minted every replica's token, and a direct push was served to every tenant);
    the proxy's signature of k8s-a's own address still works on k8s-a (the control)."""
    import grpc

    from rollwire.runtime.members import signed_member_token
    from rollwire.v1 import generator_pb2 as pb
    from rollwire.v1 import generator_pb2_grpc

    a, b = generators
    held = {name: (root / "tokens" / name).read_text().split()[0] for name in ("relay", "grant")}
    sent_to_a = signed_member_token(signing, a.target)
    options = [("grpc.ssl_target_name_override", "rollwire-generator.rollwire.svc")]

    def status(target: str, token: str) -> grpc.StatusCode:
        with grpc.secure_channel(target, credentials, options=options) as channel:
            try:
                stub = generator_pb2_grpc.GeneratorServiceStub(channel)
                stub.GetStatus(pb.GetStatusRequest(), timeout=10, metadata=(("authorization", f"Bearer {token}"),))
            except grpc.RpcError as exc:
                return exc.code()
        return grpc.StatusCode.OK

    assert status(a.target, sent_to_a) == grpc.StatusCode.OK  # the control: its own, from the proxy
    assert status(b.target, sent_to_a) == grpc.StatusCode.UNAUTHENTICATED  # bound to a's address
    assert status(b.target, held["grant"]) == grpc.StatusCode.UNAUTHENTICATED  # grants no role
    assert status(b.target, held["relay"]) == grpc.StatusCode.PERMISSION_DENIED  # stages a granted push only
    forged = sent_to_a.rsplit(".", 1)[0] + "." + sent_to_a.rsplit(".", 1)[1][::-1]
    assert status(b.target, forged) == grpc.StatusCode.UNAUTHENTICATED


def _relay_hops(log_path: Path, adapter: str) -> int:
    """Children a replica relayed `adapter` to, by its log (staged or stripe events)."""
    hops = 0
    for line in log_path.read_text(errors="replace").splitlines():
        if f'"{adapter}"' in line and '"relayed_to"' in line:
            hops += json.loads(line).get("relayed_to", 0)
    return hops


@pytest.mark.integration
def test_the_shipped_configs_relay_a_push_between_replicas_over_tls(tmp_path, tiny_model):
    """The generator and proxy ConfigMaps as shipped (TLS on every port, each process its own
    credentials: the replicas hold no admin token and are dialled with the proxy's signature of
    their address),
    their /etc/rollwire files stood in by a local CA and the Secret's keys: a push through the
    proxy, reached as the learner's ConfigMap reaches it, is relayed from replica to replica,
    and no replica has to be healed; a second proxy, peered as the shipped config peers them (the
    `peer` token both ways), has the version in its spool before the push returns."""
    import grpc
    from support.processes import GENERATOR_ARGS, Service, start_service, stop_all, wait_until
    from support.wire import make_adapter

    from rollwire.common import writer
    from rollwire.common.fingerprint import model_fingerprint
    from rollwire.common.signing import SigningKey
    from rollwire.learner.config import LearnerConfig
    from rollwire.v1 import generator_pb2 as pb
    from rollwire.v1 import generator_pb2_grpc

    root = tmp_path / "etc" / "rollwire"
    (root / "tls").mkdir(parents=True)
    (root / "tokens").mkdir()
    _shipped_pki(root / "tls")
    signing = SigningKey.generate("proxy-2026-12")
    for key, text in _shipped_credentials(signing).items():  # a file per key, as each pod mounts its own Secret's
        (root / "tokens" / key).write_text(text)
    admin = (root / "tokens" / "admin").read_text().split()[0]
    maps = by_kind("ConfigMap")
    for name in ("generator", "proxy", "learner"):
        text = maps[f"rollwire-{name}-config"]["data"][f"{name}.toml"].replace("/etc/rollwire/", f"{root}/")
        # no cluster DNS here: the proxy is given the replicas by address, and its peer (below)
        text = "\n".join(line for line in text.splitlines() if not line.startswith(("discover =", "peers =")))
        (tmp_path / f"{name}.toml").write_text(text)
    proxy_toml = (tmp_path / "proxy.toml").read_text()
    learner = load_config(LearnerConfig, tmp_path / "learner.toml")
    local = ["--set", "host=127.0.0.1", "--set", "tls.health_port=0", "--set", "grace_seconds=1"]
    generators, proxy, peer = [], None, None
    try:
        for name in ("k8s-a", "k8s-b"):
            generators.append(
                start_service(
                    [
                        *("generator", "--config", str(tmp_path / "generator.toml"), "--model", str(tiny_model)),
                        *("--port", "0", "--metrics-port", "0", "--replica-id", name, *GENERATOR_ARGS, *local),
                        *("--set", "transformers.device=cpu"),
                    ],
                    tmp_path,
                    name,
                    plaintext=False,
                )
            )
        members = [x for g in generators for x in ("--generator", g.target)]

        def start_proxy(name: str, config: str) -> Service:
            return start_service(
                [
                    *("proxy", "--config", config, "--port", "0", "--metrics-port", "0", *local),
                    *("--set", f"spool.dir={tmp_path / name}", "--set", "health.interval_s=0.2"),
                    *("--set", "http.port=0", "--set", f"http.model_path={tiny_model}"),  # the door, on a free port
                    *("--proxy-id", name, *members),
                ],
                tmp_path,
                name,
                plaintext=False,
            )

        peer = start_proxy("k8s-peer", str(tmp_path / "proxy.toml"))
        (tmp_path / "peered.toml").write_text(f'peers = ["{peer.target}"]\n' + proxy_toml)
        proxy = start_proxy("k8s-proxy", str(tmp_path / "peered.toml"))
        credentials = grpc.ssl_channel_credentials(Path(learner.client.ca_file).read_bytes())
        options = [("grpc.ssl_target_name_override", learner.client.server_name)]
        metadata = (("authorization", f"Bearer {admin}"),)
        with grpc.secure_channel(proxy.target, credentials, options=options) as channel:
            stub = generator_pb2_grpc.GeneratorServiceStub(channel)

            def routable() -> list:
                replicas = stub.GetStatus(pb.GetStatusRequest(), timeout=5, metadata=metadata).replicas
                healthy = [r for r in replicas if r.healthy]
                return healthy if len(healthy) == len(generators) else []

            wait_until(routable, 60, "the proxy routes to both replicas over TLS")
            fp = model_fingerprint(tiny_model)
            adapter = make_adapter(tiny_model, seed=10)
            messages = writer.messages(adapter.manifest("shipped", 1, fp), adapter.payload)
            reply = stub.PushAdapter(messages, timeout=120, metadata=metadata)
        assert sorted((r.replica, r.code) for r in reply.replicas) == [("k8s-a", "OK"), ("k8s-b", "OK")], reply
        assert [(p.address, p.code) for p in reply.peers] == [(peer.target, "OK")], reply  # the peer role, shipped
        assert [f.name for f in (tmp_path / "k8s-peer" / "shipped").glob("*.json")] == ["1.json"]
        assert sum(_relay_hops(g.log_path, "shipped") for g in generators) >= 1  # a hop over TLS, relay token
        heals = sum(
            metric_value(proxy.metrics(), "rollwire_proxy_push_heals_total", f'replica="{g.target}"')
            for g in generators
        )
        assert heals == 0
        _one_replica_cannot_act_as_another(generators, root, signing, credentials)
        with grpc.secure_channel(proxy.target, credentials, options=options) as channel:  # collateral: pushes go on
            messages = writer.messages(adapter.manifest("shipped", 2, fp), adapter.payload)
            again = generator_pb2_grpc.GeneratorServiceStub(channel).PushAdapter(
                messages, timeout=120, metadata=metadata
            )
        assert sorted((r.replica, r.code) for r in again.replicas) == [("k8s-a", "OK"), ("k8s-b", "OK")], again
    finally:
        stop_all([*generators, *(p for p in (proxy, peer) if p is not None)])


def test_autoscaler_targets_a_metric_generators_export(generator):
    hpa = by_kind("HorizontalPodAutoscaler")["rollwire-generator"]
    metric = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    exported = generator.metrics()
    assert f"# TYPE {metric} gauge" in exported
    assert metric_value(exported, metric) >= 0
    rules = yaml.safe_load(by_kind("ConfigMap")["rollwire-prometheus-adapter-rules"]["data"]["config.yaml"])
    assert any(rule["name"]["as"] == metric for rule in rules["rules"])
