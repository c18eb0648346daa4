"""The Kubernetes manifests validate, hang together, and point at what the code really does.
Checked against running processes (the autoscaler's metric, a relayed push):
tests/integration/repo/test_k8s_relay.py."""

from __future__ import annotations

import tomllib
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from rollwire.generator.config import GeneratorConfig
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


@pytest.mark.parametrize("name", kustomization()["resources"])
def test_every_resource_validates_strictly(name):
    for doc in yaml.safe_load_all((K8S / name).read_text()):
        kubernetes_validate.validate(doc, "1.30", strict=True)


def test_references_resolve():
    configmaps, secrets, deployments = by_kind("ConfigMap"), by_kind("Secret"), by_kind("Deployment")
    images = {i["name"] for i in kustomization()["images"]}
    pod_specs = [d["spec"]["template"] for d in deployments.values()] + [
        j["spec"]["template"] for j in by_kind("Job").values()
    ]
    for template in pod_specs:
        for volume in template["spec"]["volumes"]:
            if "configMap" in volume:
                assert volume["configMap"]["name"] in configmaps
            if "secret" in volume:
                assert volume["secret"]["secretName"] in secrets
        for container in template["spec"]["containers"]:
            assert container["image"] in images
    for service in by_kind("Service").values():
        selector = service["spec"]["selector"].items()
        assert any(selector <= d["spec"]["template"]["metadata"]["labels"].items() for d in deployments.values())
    hpa = by_kind("HorizontalPodAutoscaler")["rollwire-generator"]
    assert hpa["spec"]["scaleTargetRef"]["name"] in deployments
    assert by_kind("Service")["rollwire-generator"]["spec"]["clusterIP"] == "None"  # headless, for DNS discovery


def test_generator_config_map_is_a_valid_generator_config(tmp_path):
    text = by_kind("ConfigMap")["rollwire-generator-config"]["data"]["generator.toml"]
    (tmp_path / "generator.toml").write_text(text)
    config = load_config(GeneratorConfig, tmp_path / "generator.toml")
    deployment = by_kind("Deployment")["rollwire-generator"]["spec"]["template"]["spec"]
    container = deployment["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (ports["grpc"], ports["metrics"], ports["health"]) == (
        config.port,
        config.metrics_port,
        config.tls.health_port,
    )
    assert container["readinessProbe"]["grpc"]["port"] == config.tls.health_port
    assert config.grace_seconds < deployment["terminationGracePeriodSeconds"]
    assert tomllib.loads(text)["limits"]["max_queue"] > 0


def test_proxy_config_map_is_a_valid_proxy_config_that_can_reach_the_generators(tmp_path):
    from rollwire.proxy.config import ProxyConfig

    maps = by_kind("ConfigMap")
    (tmp_path / "proxy.toml").write_text(maps["rollwire-proxy-config"]["data"]["proxy.toml"])
    (tmp_path / "generator.toml").write_text(maps["rollwire-generator-config"]["data"]["generator.toml"])
    proxy = load_config(ProxyConfig, tmp_path / "proxy.toml")
    generator = load_config(GeneratorConfig, tmp_path / "generator.toml")
    spec = by_kind("Deployment")["rollwire-proxy"]["spec"]["template"]["spec"]
    container = spec["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (ports["grpc"], ports["metrics"], ports["health"]) == (proxy.port, proxy.metrics_port, proxy.tls.health_port)
    assert container["readinessProbe"]["grpc"]["port"] == proxy.tls.health_port
    assert ports["http"] == proxy.http.port > 0  # the HTTP door, exposed by the Service
    service = {p["name"]: p for p in by_kind("Service")["rollwire-proxy"]["spec"]["ports"]}
    assert (service["http"]["port"], service["http"]["targetPort"]) == (proxy.http.port, "http")
    assert any(proxy.http.model_path.startswith(m["mountPath"]) for m in container["volumeMounts"])
    assert proxy.discover.endswith(f"rollwire-generator.rollwire.svc.cluster.local:{generator.port}")
    # the proxy dials each replica with its own token (its address, signed); the replicas check its grants
    assert proxy.upstream.member_signing_key_file and generator.auth.member_trust_file
    assert proxy.upstream.token_file == generator.auth.grant_tokens_file
    if generator.tls.cert_file:
        assert proxy.upstream.ca_file
    mounts = [m["mountPath"] for m in container["volumeMounts"]]
    assert any(proxy.spool.dir.startswith(m) for m in mounts)
    assert proxy.spool.keep_versions >= generator.adapter_keep
    tokens = by_kind("Secret")["rollwire-proxy-tokens"]["stringData"]
    files = [f for t in proxy.tenants for f in t.token_files().values() if f]
    assert len(proxy.tenants) >= 2 and all(f.rsplit("/", 1)[0] == "/etc/rollwire/tokens" for f in files)
    assert {f.rsplit("/", 1)[1] for f in files} <= set(tokens)  # every tenant's token file is a key of the Secret


def test_learner_config_map_is_a_valid_learner_config(tmp_path):
    from rollwire.learner.config import LearnerConfig

    maps = by_kind("ConfigMap")
    (tmp_path / "learner.toml").write_text(maps["rollwire-learner-config"]["data"]["learner.toml"])
    (tmp_path / "proxy.toml").write_text(maps["rollwire-proxy-config"]["data"]["proxy.toml"])
    learner = load_config(LearnerConfig, tmp_path / "learner.toml")
    from rollwire.proxy.config import ProxyConfig

    proxy = load_config(ProxyConfig, tmp_path / "proxy.toml")
    assert learner.target.endswith(f":{proxy.port}")
    job = by_kind("Job")["rollwire-learner"]["spec"]["template"]["spec"]
    mounts = {m["mountPath"] for m in job["containers"][0]["volumeMounts"]}
    assert learner.run_dir in mounts  # checkpoints survive a pod restart, so --resume continues
    if proxy.auth.admin_tokens_file:
        assert learner.client.token_file
    if proxy.tls.cert_file:
        assert learner.client.ca_file and any(learner.client.ca_file.startswith(m) for m in mounts)


def pod_specs() -> dict[str, dict]:
    workloads = {**by_kind("Deployment"), **by_kind("Job")}
    return {name: w["spec"]["template"]["spec"] for name, w in workloads.items()}


@pytest.mark.parametrize("name", sorted(pod_specs()))
def test_every_container_runs_as_non_root_without_privilege(name):
    spec = pod_specs()[name]
    pod = spec.get("securityContext", {})
    assert pod.get("runAsNonRoot") is True
    assert pod.get("runAsUser", 0) > 0 and pod.get("runAsGroup", 0) > 0
    writable = {v["name"] for v in spec["volumes"] if "emptyDir" in v or "persistentVolumeClaim" in v}
    for container in spec.get("initContainers", []) + spec["containers"]:
        sc = container.get("securityContext", {})
        assert sc.get("runAsNonRoot", True) is True and sc.get("runAsUser", 1) > 0
        assert sc.get("allowPrivilegeEscalation") is False
        assert sc.get("privileged", False) is False
        assert "ALL" in sc.get("capabilities", {}).get("drop", [])
        if sc.get("readOnlyRootFilesystem"):  # then /tmp and $HOME must be writable volumes
            mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
            assert mounts.get("/tmp") in writable and mounts.get("/home/rollwire") in writable


DOCKERFILES = sorted((K8S.parents[0] / "docker").glob("*.Dockerfile"))


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_every_image_runs_as_the_non_root_user_the_manifests_expect(path):
    lines, current = [], ""
    for raw in path.read_text().splitlines():  # join continuation lines, drop comments
        if raw.lstrip().startswith("#"):
            continue
        current += raw.rstrip("\\").strip() + " "
        if not raw.rstrip().endswith("\\"):
            lines.append(current.strip())
            current = ""
    words = [line.split(None, 1) for line in lines if line]
    last_run = max(i for i, w in enumerate(words) if w[0].upper() == "RUN")
    users = [(i, w[1].strip()) for i, w in enumerate(words) if w[0].upper() == "USER"]
    assert users and users[-1][0] > last_run, "USER must come after the last RUN"
    uid, _, gid = users[-1][1].partition(":")
    assert uid.isdigit() and int(uid) > 0, "a numeric non-root uid, so runAsNonRoot can check it"
    assert not gid or (gid.isdigit() and int(gid) > 0)
    for spec in pod_specs().values():
        assert spec["securityContext"]["runAsUser"] == int(uid)


def test_scraped_learner_metrics_bind_all_interfaces(tmp_path):
    from rollwire.learner.config import LearnerConfig
    from rollwire.runtime.security import is_loopback

    (tmp_path / "learner.toml").write_text(by_kind("ConfigMap")["rollwire-learner-config"]["data"]["learner.toml"])
    learner = load_config(LearnerConfig, tmp_path / "learner.toml")
    job = by_kind("Job")["rollwire-learner"]["spec"]["template"]
    if job["metadata"].get("annotations", {}).get("prometheus.io/scrape") == "true":
        assert not is_loopback(learner.metrics_host)  # the default (loopback) would hide it from Prometheus
        assert job["metadata"]["annotations"]["prometheus.io/port"] == str(learner.metrics_port)


def test_two_proxies_share_one_truth_and_survive_a_voluntary_disruption(tmp_path, monkeypatch):
    """Two proxy pods, peers of each other through the headless Service, each with its own id;
    a PodDisruptionBudget keeps one serving; the learner balances over both (docs/deploy.md)."""
    from rollwire.learner.config import LearnerConfig
    from rollwire.proxy.config import ProxyConfig

    deployment = by_kind("Deployment")["rollwire-proxy"]
    assert deployment["spec"]["replicas"] >= 2
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    pdb = by_kind("PodDisruptionBudget")["rollwire-proxy"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert 1 <= pdb["spec"]["minAvailable"] < deployment["spec"]["replicas"]
    env = {e["name"]: e for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["ROLLWIRE_PROXY_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"  # unique per pod

    headless = by_kind("Service")["rollwire-proxy-headless"]
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["selector"].items() <= labels.items()
    maps = by_kind("ConfigMap")
    (tmp_path / "proxy.toml").write_text(maps["rollwire-proxy-config"]["data"]["proxy.toml"])
    (tmp_path / "learner.toml").write_text(maps["rollwire-learner-config"]["data"]["learner.toml"])
    monkeypatch.setenv("ROLLWIRE_PROXY_ID", "rollwire-proxy-abc")
    proxy = load_config(ProxyConfig, tmp_path / "proxy.toml")
    assert proxy.proxy_id == "rollwire-proxy-abc"  # the variable the pod sets is the config key
    name = f"dns:///rollwire-proxy-headless.rollwire.svc.cluster.local:{proxy.port}"
    assert proxy.peers == [name]
    assert load_config(LearnerConfig, tmp_path / "learner.toml").target == name


def test_a_proxy_with_peers_and_no_peer_tokens_refuses_to_start(tmp_path):
    from rollwire.proxy.app import check_peering
    from rollwire.proxy.config import ProxyConfig

    (tmp_path / "proxy.toml").write_text(by_kind("ConfigMap")["rollwire-proxy-config"]["data"]["proxy.toml"])
    shipped = load_config(ProxyConfig, tmp_path / "proxy.toml")
    assert shipped.peers and shipped.auth.peer_tokens_file and shipped.peering.token_file
    check_peering(shipped)  # as shipped: starts
    assert "peer" in by_kind("Secret")["rollwire-proxy-tokens"]["stringData"]
    bare = shipped.model_copy(update={"auth": shipped.auth.model_copy(update={"peer_tokens_file": ""})})
    with pytest.raises(SystemExit, match="peers is set but auth.peer_tokens_file is not"):
        check_peering(bare)


TOKENS_MOUNT = "/etc/rollwire/tokens/"
CONFIGS = {"rollwire-proxy": "proxy", "rollwire-generator": "generator", "rollwire-learner": "learner"}


def _files_read(value: object) -> set[str]:
    """The token files (their Secret keys) a config names anywhere, at any depth."""
    if isinstance(value, str):
        return {value[len(TOKENS_MOUNT) :]} if value.startswith(TOKENS_MOUNT) else set()
    if isinstance(value, dict):
        return set().union(*(_files_read(v) for v in value.values()))
    if isinstance(value, list):
        return set().union(*(_files_read(v) for v in value))
    return set()


def _mounted(spec: dict) -> tuple[str, set[str]]:
    """(the Secret, its keys) mounted at the tokens folder of a pod (items: only those projected)."""
    container = spec["containers"][0]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"].rstrip("/") + "/" == TOKENS_MOUNT]
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    secret = volume["secret"]["secretName"]
    keys = {i["key"] for i in volume["secret"].get("items", [])} or set(by_kind("Secret")[secret]["stringData"])
    return secret, keys


@pytest.mark.parametrize("workload", sorted(CONFIGS))
def test_each_pod_mounts_only_the_credentials_its_own_config_reads(workload):
    """Audit 2026-12-07 S2: one Secret with every token was mounted into every pod. Each pod's tokens
    folder now holds exactly the files its process's config reads, from a Secret no other kind mounts."""
    name = CONFIGS[workload]
    config = tomllib.loads(by_kind("ConfigMap")[f"rollwire-{name}-config"]["data"][f"{name}.toml"])
    secret, keys = _mounted(pod_specs()[workload])
    assert keys == _files_read(config), (
        f"{workload} mounts {sorted(keys)} but its config reads {sorted(_files_read(config))}"
    )
    others = {_mounted(spec)[0] for other, spec in pod_specs().items() if other != workload}
    assert secret not in others  # no Secret is shared between process kinds


def test_replicas_learners_and_peers_each_hold_their_own_role(tmp_path):
    """No replica holds a token that is a role at the proxy or at another replica, the learner holds its
    team's publish token only, each team's tokens are its tenant's (none of the fleet's), and no two
    roles share a Secret key or a placeholder."""
    from rollwire.learner.config import LearnerConfig
    from rollwire.proxy.config import ProxyConfig

    maps = by_kind("ConfigMap")
    for name in CONFIGS.values():
        (tmp_path / f"{name}.toml").write_text(maps[f"rollwire-{name}-config"]["data"][f"{name}.toml"])
    proxy = load_config(ProxyConfig, tmp_path / "proxy.toml")
    generator = load_config(GeneratorConfig, tmp_path / "generator.toml")
    learner = load_config(LearnerConfig, tmp_path / "learner.toml")

    roles = [f for f in (*generator.auth.files().values(),) if f]
    assert roles == [generator.auth.relay_tokens_file]  # a replica: no admin, generate, peer or register token
    accepted = {f for f in proxy.auth.files().values() if f} | {
        f for t in proxy.tenants for f in t.token_files().values() if f
    }
    held_by_replicas = {generator.auth.relay_tokens_file, generator.auth.grant_tokens_file}
    assert not accepted & held_by_replicas  # nothing a replica holds is valid at the proxy
    assert not proxy.auth.generate_tokens_file  # each team samples as its tenant, never as the fleet
    assert learner.client.token_file in {t.publish_tokens_file for t in proxy.tenants}  # its team's, not admin
    assert learner.client.token_file != proxy.auth.admin_tokens_file
    assert proxy.peering.token_file == proxy.auth.peer_tokens_file  # peers: the peer role, proxies only
    secrets = by_kind("Secret")
    assert "peer" not in secrets["rollwire-generator-tokens"]["stringData"]
    proxy_values = [v for k, v in secrets["rollwire-proxy-tokens"]["stringData"].items()]
    assert len(set(proxy_values)) == len(proxy_values)  # every role its own token


def test_the_config_loader_refuses_a_proxy_that_dials_replicas_with_a_token_it_accepts(tmp_path):
    from rollwire.proxy.app import check_own_credentials
    from rollwire.proxy.config import ProxyConfig

    (tmp_path / "admin").write_text("op-1\n")
    (tmp_path / "also").write_text("rep-1\nop-1\n")
    same = {"auth": {"admin_tokens_file": str(tmp_path / "admin")}, "upstream": {"token_file": str(tmp_path / "admin")}}
    with pytest.raises(ValueError, match="upstream.token_file .* the file of auth.admin_tokens_file"):
        ProxyConfig.model_validate(same)
    config = ProxyConfig.model_validate({**same, "upstream": {"token_file": str(tmp_path / "also")}})
    with pytest.raises(SystemExit, match="upstream.token_file holds a token this proxy accepts with the admin role"):
        check_own_credentials(config)
    (tmp_path / "also").write_text("rep-1\n")
    check_own_credentials(config)  # its own token: starts
    discovering = {**same, "upstream": {"token_file": str(tmp_path / "also")}, "discover": "dns:///r.example:50051"}
    with pytest.raises(ValueError, match="discover is set, so upstream.token_file would be sent"):
        ProxyConfig.model_validate(discovering)  # whatever the name resolves to would get the token
    key = {"token_file": str(tmp_path / "also"), "member_signing_key_file": str(tmp_path / "key")}
    ProxyConfig.model_validate({**discovering, "upstream": key})  # each discovered replica: its own token
