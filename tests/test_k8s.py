"""The Kubernetes manifests validate, hang together, and point at what the code really does."""

from __future__ import annotations

import tomllib
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from helpers import metric_value
from rollwire.common.config import load_config
from rollwire.server.config import GeneratorConfig

K8S = Path(__file__).resolve().parents[1] / "ops" / "k8s"


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
    pod_specs = [d["spec"]["template"] for d in deployments.values()] + [j["spec"]["template"] for j in by_kind("Job").values()]
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
    assert (ports["grpc"], ports["metrics"], ports["health"]) == (config.port, config.metrics_port, config.tls.health_port)
    assert container["readinessProbe"]["grpc"]["port"] == config.tls.health_port
    assert config.grace_seconds < deployment["terminationGracePeriodSeconds"]
    assert tomllib.loads(text)["limits"]["max_queue"] > 0


def test_autoscaler_targets_a_metric_generators_export(generator):
    hpa = by_kind("HorizontalPodAutoscaler")["rollwire-generator"]
    metric = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    exported = generator.metrics()
    assert f"# TYPE {metric} gauge" in exported
    assert metric_value(exported, metric) >= 0
    rules = yaml.safe_load(by_kind("ConfigMap")["rollwire-prometheus-adapter-rules"]["data"]["config.yaml"])
    assert any(rule["name"]["as"] == metric for rule in rules["rules"])


def test_proxy_config_map_is_a_valid_proxy_config_that_can_reach_the_generators(tmp_path):
    from rollwire.server.proxy.config import ProxyConfig

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
    assert proxy.discover.endswith(f"rollwire-generator.rollwire.svc.cluster.local:{generator.port}")
    if generator.auth.admin_tokens_file:  # the proxy pushes adapters: it needs an admin token
        assert proxy.upstream.token_file == generator.auth.admin_tokens_file
    if generator.tls.cert_file:
        assert proxy.upstream.ca_file
    mounts = [m["mountPath"] for m in container["volumeMounts"]]
    assert any(proxy.spool.dir.startswith(m) for m in mounts)
    assert proxy.spool.keep_versions >= generator.adapter_window


def test_learner_config_map_is_a_valid_learner_config(tmp_path):
    from rollwire.learner.config import LearnerConfig

    maps = by_kind("ConfigMap")
    (tmp_path / "learner.toml").write_text(maps["rollwire-learner-config"]["data"]["learner.toml"])
    (tmp_path / "proxy.toml").write_text(maps["rollwire-proxy-config"]["data"]["proxy.toml"])
    learner = load_config(LearnerConfig, tmp_path / "learner.toml")
    from rollwire.server.proxy.config import ProxyConfig

    proxy = load_config(ProxyConfig, tmp_path / "proxy.toml")
    assert learner.target.endswith(f":{proxy.port}")
    job = by_kind("Job")["rollwire-learner"]["spec"]["template"]["spec"]
    mounts = {m["mountPath"] for m in job["containers"][0]["volumeMounts"]}
    assert learner.run_dir in mounts  # checkpoints survive a pod restart, so --resume continues
    if proxy.auth.admin_tokens_file:
        assert learner.client.token_file
    if proxy.tls.cert_file:
        assert learner.client.tls_ca_file and any(learner.client.tls_ca_file.startswith(m) for m in mounts)
