"""``compose/k8s/`` validates offline and agrees with the worker's settings.

Core kinds are checked by ``kubernetes-validate`` (Kubernetes' own JSON schemas,
shipped in its PyPI package, strict: unknown fields are errors); the two custom
resources (KEDA's ScaledObject, the Prometheus Operator's ServiceMonitor)
against the schemas in ``compose/k8s/schemas/`` (subsets of their CRDs; that
folder's README says what they leave out).
"""

from __future__ import annotations

import copy
import json
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from ingest.settings import load_settings
from tests.paths import ROOT

K8S = ROOT / "compose" / "k8s"
KUBERNETES = "1.31"  # a release still supported by the clouds' managed Kubernetes
CUSTOM = {
    ("keda.sh/v1alpha1", "ScaledObject"): "scaledobject-keda.sh-v1alpha1.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-monitoring.coreos.com-v1.json",
}


def manifests() -> dict[str, dict[str, Any]]:
    """kind -> the manifest (one of each kind here), kustomization.yaml aside."""
    found: dict[str, dict[str, Any]] = {}
    for path in sorted(K8S.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            for doc in yaml.safe_load_all(path.read_text()):
                assert doc["kind"] not in found, doc["kind"]
                found[doc["kind"]] = doc
    return found


def validate(doc: dict[str, Any]) -> None:
    """Raise when ``doc`` does not validate (or has no schema here)."""
    schema_file = CUSTOM.get((doc["apiVersion"], doc["kind"]))
    if schema_file is None:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)  # SchemaNotFoundError too
        return
    schema = json.loads((K8S / "schemas" / schema_file).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.Draft202012Validator(schema).validate(doc)


@pytest.mark.parametrize(
    "kind", ["ConfigMap", "Secret", "Deployment", "Service", "ServiceMonitor", "ScaledObject"]
)
def test_manifest_validates(kind: str) -> None:
    validate(manifests()[kind])


def test_the_validators_refuse_broken_manifests() -> None:
    docs = manifests()
    for kind, path, bad in (
        ("Deployment", ("spec", "replicas"), "one"),
        ("Deployment", ("spec", "template", "spec", "containers", 0, "livenessProbe", "x"), 1),
        ("ScaledObject", ("spec", "maxReplicaCount"), 0),
        ("ScaledObject", ("spec", "triggers", 0, "metadata", "lagThreshold"), 200),
        ("ServiceMonitor", ("spec", "endpoints", 0, "interval"), "15 seconds"),
    ):
        doc = copy.deepcopy(docs[kind])
        parent: Any = doc
        for step in path[:-1]:
            parent = parent[step]
        parent[path[-1]] = bad
        with pytest.raises(jsonschema.ValidationError):
            validate(doc)


def test_kustomization_applies_every_manifest_but_the_secret_example() -> None:
    listed = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    present = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(listed) == sorted(present - {"secret.example.yaml"})


def test_manifests_agree_with_the_worker() -> None:
    docs = manifests()
    env = dict(docs["ConfigMap"]["data"])
    secret = docs["Secret"]["stringData"]
    assert set(secret) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}  # audit keys in KMS
    settings = load_settings(env)
    assert settings.device == "cuda"
    assert (settings.posture, settings.require_tls, settings.output_sse) == (
        "production", True, "aws:kms")  # fmt: skip

    pod = docs["Deployment"]["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1  # one worker per GPU
    refs = [next(iter(source.values()))["name"] for source in container["envFrom"]]
    assert refs == [docs["ConfigMap"]["metadata"]["name"], docs["Secret"]["metadata"]["name"]]
    (port,) = container["ports"]
    assert port["containerPort"] == settings.health_port
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": port["name"]}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": port["name"]}
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(settings.health_port)
    assert pod["metadata"]["annotations"]["prometheus.io/path"] == "/metrics"
    assert pod["spec"]["terminationGracePeriodSeconds"] > settings.shutdown_deadline_s

    labels = pod["metadata"]["labels"]
    service = docs["Service"]["spec"]
    assert service["selector"].items() <= labels.items()
    assert [p["targetPort"] for p in service["ports"]] == [port["name"]]
    monitor = docs["ServiceMonitor"]["spec"]
    assert (
        monitor["selector"]["matchLabels"].items() <= docs["Service"]["metadata"]["labels"].items()
    )
    assert [(e["port"], e["path"]) for e in monitor["endpoints"]] == [
        (service["ports"][0]["name"], "/metrics")
    ]

    scaled = docs["ScaledObject"]["spec"]
    assert scaled["scaleTargetRef"]["name"] == docs["Deployment"]["metadata"]["name"]
    (trigger,) = scaled["triggers"]
    assert trigger["type"] == "kafka"
    meta = trigger["metadata"]
    assert meta["bootstrapServers"] == settings.kafka_bootstrap
    assert meta["consumerGroup"] == settings.group_id
    assert meta["topic"] == settings.source_topic
    assert meta["allowIdleConsumers"] == "false"
    assert scaled["maxReplicaCount"] <= 6  # the source topic's partitions (compose/kafka-init)
