"""``compose/k8s/`` validates offline and agrees with the worker's settings.

The manifests are what ``kubectl apply -k compose/k8s`` sends (``kubectl
kustomize``: the settings' ConfigMap is generated from ``worker.env`` with a hash
in its name), with and without the ``secure-kafka`` component. Core kinds are
checked by ``kubernetes-validate`` (Kubernetes' own JSON schemas, shipped in its
PyPI package, strict: unknown fields are errors); the custom resources (KEDA's
ScaledObject and TriggerAuthentication, the Prometheus Operator's ServiceMonitor
and PrometheusRule) against the schemas in ``compose/k8s/schemas/`` (subsets of
their CRDs; that folder's README says what they leave out).
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from ingest.settings import PREFIX, load_settings
from tests.paths import ROOT

K8S = ROOT / "compose" / "k8s"
KUBERNETES = "1.31"  # a release still supported by the clouds' managed Kubernetes
CUSTOM = {
    ("keda.sh/v1alpha1", "ScaledObject"): "scaledobject-keda.sh-v1alpha1.json",
    ("keda.sh/v1alpha1", "TriggerAuthentication"): "triggerauthentication-keda.sh-v1alpha1.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-monitoring.coreos.com-v1.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrule-monitoring.coreos.com-v1.json",
}
SECURE_LINE = "# components: [secure-kafka]"


def kustomize(folder: Path) -> list[dict[str, Any]]:
    """What ``kubectl apply -k folder`` would send (``kubectl kustomize``); skipped where
    kubectl is not installed, as the runbook's kubectl commands are."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed here")
    done = subprocess.run(
        [kubectl, "kustomize", str(folder)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def by_kind(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    for doc in docs:
        assert doc["kind"] not in found, doc["kind"]
        found[doc["kind"]] = doc
    return found


def env_file(path: Path) -> dict[str, str]:
    """A kustomize ``envs`` file: ``VAR=value`` lines, ``#`` comment lines."""
    pairs = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, sep, value = line.partition("=")
            assert sep, line
            pairs[name.strip()] = value
    return pairs


def manifests() -> dict[str, dict[str, Any]]:
    """kind -> each manifest kustomization.yaml applies (one of each kind), the ConfigMap
    its generator makes (named here without kustomize's hash suffix, which it adds to the
    Deployment's reference too), and the Secret whose form secret.example.yaml gives."""
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    docs = [
        doc
        for name in kustomization["resources"]
        for doc in yaml.safe_load_all((K8S / name).read_text())
    ]
    for generated in kustomization["configMapGenerator"]:
        data: dict[str, str] = {}
        for name in generated["envs"]:
            data |= env_file(K8S / name)
        metadata = {"name": generated["name"], "labels": generated["options"]["labels"]}
        docs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data})
    docs += list(yaml.safe_load_all((K8S / "secret.example.yaml").read_text()))
    return by_kind(docs)


def secure(tmp: Path) -> dict[str, dict[str, Any]]:
    """The manifests with the secure-kafka component on, as an operator turns it on."""
    copy_of = tmp / "k8s"
    shutil.copytree(K8S, copy_of)
    kustomization = copy_of / "kustomization.yaml"
    text = kustomization.read_text()
    assert SECURE_LINE in text
    kustomization.write_text(text.replace(SECURE_LINE, SECURE_LINE.removeprefix("# ")))
    docs = kustomize(copy_of)
    docs += list(yaml.safe_load_all((K8S / "secure-kafka" / "secret.example.yaml").read_text()))
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in docs}


def validate(doc: dict[str, Any]) -> None:
    """Raise when ``doc`` does not validate (or has no schema here)."""
    schema_file = CUSTOM.get((doc["apiVersion"], doc["kind"]))
    if schema_file is None:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)  # SchemaNotFoundError too
        return
    schema = json.loads((K8S / "schemas" / schema_file).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.Draft202012Validator(schema).validate(doc)


KINDS = [
    "ConfigMap",
    "Secret",
    "Deployment",
    "Service",
    "ServiceMonitor",
    "ScaledObject",
    "PodDisruptionBudget",
    "PrometheusRule",
]


@pytest.mark.parametrize("kind", KINDS)
def test_manifest_validates(kind: str) -> None:
    validate(manifests()[kind])


def test_every_manifest_is_one_of_those_validated() -> None:
    assert sorted(manifests()) == sorted(KINDS)


def test_the_validators_refuse_broken_manifests() -> None:
    docs = manifests()
    for kind, path, bad in (
        ("Deployment", ("spec", "replicas"), "one"),
        ("Deployment", ("spec", "template", "spec", "containers", 0, "livenessProbe", "x"), 1),
        ("ScaledObject", ("spec", "maxReplicaCount"), 0),
        ("ScaledObject", ("spec", "triggers", 0, "metadata", "lagThreshold"), 200),
        ("ServiceMonitor", ("spec", "endpoints", 0, "interval"), "15 seconds"),
        ("PrometheusRule", ("spec", "groups", 0, "rules", 0, "for"), "five minutes"),
        ("PrometheusRule", ("spec", "groups", 0, "rules", 0, "severity"), "critical"),
        ("PodDisruptionBudget", ("spec", "maxUnavailable"), [1]),
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
        "production",
        True,
        "aws:kms",
    )

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


def test_a_settings_edit_rolls_the_pods(tmp_path: Path) -> None:
    """The ConfigMap's name carries a hash of worker.env and the pod template names it, so
    an edit there changes the template: the next ``kubectl apply -k`` rolls the pods."""
    before = by_kind(kustomize(K8S))
    copy_of = tmp_path / "k8s"
    shutil.copytree(K8S, copy_of)
    env = copy_of / "worker.env"
    env.write_text(env.read_text().replace("SHUTDOWN_DEADLINE_S=30", "SHUTDOWN_DEADLINE_S=20"))
    after = by_kind(kustomize(copy_of))

    def config_ref(docs: dict[str, dict[str, Any]]) -> str:
        (container,) = docs["Deployment"]["spec"]["template"]["spec"]["containers"]
        name: str = container["envFrom"][0]["configMapRef"]["name"]
        assert name == docs["ConfigMap"]["metadata"]["name"]
        return name

    assert re.fullmatch(r"dicom-ingest-[a-z0-9]{10}", config_ref(before))
    assert config_ref(after) != config_ref(before)
    assert after["ConfigMap"]["data"]["DICOM_INGEST_SHUTDOWN_DEADLINE_S"] == "20"


def test_the_disruption_budget_covers_the_workers_one_at_a_time() -> None:
    docs = manifests()
    pdb = docs["PodDisruptionBudget"]["spec"]
    labels = docs["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert pdb["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["maxUnavailable"] == 1


def test_secure_kafka_gives_keda_and_the_worker_the_same_login(tmp_path: Path) -> None:
    """With the secure-kafka component, KEDA's scaler authenticates through a
    TriggerAuthentication to the secret the worker logs in with; every manifest validates
    and the settings load as the worker's."""
    docs = secure(tmp_path)
    for doc in docs.values():
        validate(doc)
    auth = docs["TriggerAuthentication/dicom-ingest-kafka"]
    secret = docs["Secret/dicom-ingest-kafka"]
    refs = {r["parameter"]: (r["name"], r["key"]) for r in auth["spec"]["secretTargetRef"]}
    assert set(refs) == {"sasl", "username", "password", "tls", "ca"}
    assert {name for name, _ in refs.values()} == {secret["metadata"]["name"]}
    assert {key for _, key in refs.values()} <= set(secret["stringData"])
    assert secret["stringData"]["sasl"] == "scram_sha512"
    assert secret["stringData"]["tls"] == "enable"
    (trigger,) = docs["ScaledObject/dicom-ingest"]["spec"]["triggers"]
    assert trigger["authenticationRef"] == {"name": auth["metadata"]["name"]}

    deployment = docs["Deployment/dicom-ingest"]["spec"]["template"]["spec"]
    (container,) = deployment["containers"]
    from_secret = {
        e["name"]: e["valueFrom"]["secretKeyRef"]
        for e in container["env"]
        if "secretKeyRef" in e.get("valueFrom", {})
    }
    assert from_secret["DICOM_INGEST_KAFKA_SASL_USERNAME"] == {
        "name": "dicom-ingest-kafka",
        "key": "username",
    }
    assert from_secret["DICOM_INGEST_KAFKA_SASL_PASSWORD"]["key"] == "password"
    (config,) = [d for k, d in docs.items() if k.startswith("ConfigMap/")]
    env = dict(config["data"])
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "kafka-tls"]
    cafile = Path(env["DICOM_INGEST_KAFKA_SSL_CAFILE"])
    assert cafile.parent == Path(mount["mountPath"])
    (volume,) = [v for v in deployment["volumes"] if v["name"] == "kafka-tls"]
    assert volume["secret"]["items"] == [{"key": refs["ca"][1], "path": cafile.name}]
    stand_in = tmp_path / cafile.name  # the mounted file, here
    stand_in.write_text(secret["stringData"]["ca.crt"])
    env |= {
        "DICOM_INGEST_KAFKA_SSL_CAFILE": str(stand_in),
        "DICOM_INGEST_KAFKA_SASL_USERNAME": "u",
        "DICOM_INGEST_KAFKA_SASL_PASSWORD": "p",
    }
    settings = load_settings({k: v for k, v in env.items() if k.startswith("DICOM_INGEST_")})
    assert settings.kafka_security_protocol == "SASL_SSL"
    keda_names = {"SCRAM-SHA-512": "scram_sha512", "SCRAM-SHA-256": "scram_sha256"}
    assert keda_names[settings.kafka_sasl_mechanism] == secret["stringData"]["sasl"]


def test_alert_rules_are_one_set_and_name_only_what_the_worker_exports() -> None:
    """compose/prometheus/alerts.yml (Prometheus) and the PrometheusRule (the Operator) hold
    the same groups; every rule names metrics the worker exports, has a severity and a
    summary, and the alerts the operating guide lists are there."""
    from ingest.ops.metrics import exported_names

    compose_rules = yaml.safe_load((ROOT / "compose/prometheus/alerts.yml").read_text())
    operator_rules = manifests()["PrometheusRule"]["spec"]
    assert compose_rules == operator_rules
    prometheus = yaml.safe_load((ROOT / "compose/prometheus/prometheus.yml").read_text())
    assert prometheus["rule_files"] == ["/etc/prometheus/alerts.yml"]
    compose_file = (ROOT / "compose/docker-compose.yml").read_text()
    assert "./prometheus/alerts.yml:/etc/prometheus/alerts.yml:ro" in compose_file
    rules = [r for group in compose_rules["groups"] for r in group["rules"]]
    exported = exported_names() | {"up"}
    for rule in rules:
        named = set(re.findall(r"\b(dicom_ingest_[a-z_]+|up)\b(?=\s*[{\[)]|\s*==)", rule["expr"]))
        assert named, rule
        assert named <= exported, named - exported
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"]
        assert rule["expr"].count("(") == rule["expr"].count(")")
    assert {r["alert"] for r in rules} == {
        "DicomIngestWorkerDown",
        "DicomIngestNotReady",
        "DicomIngestConsumerLagGrowing",
        "DicomIngestCommitStalled",
        "DicomIngestDeadLetters",
        "DicomIngestDeviceThreadStalled",
    }


def test_the_secure_kafka_component_validates_without_kubectl() -> None:
    """Its own manifests validate, its settings are the worker's, and the base leaves it
    off (commented out), so a PLAINTEXT broker works as shipped."""
    component = K8S / "secure-kafka"
    kustomization = yaml.safe_load((component / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Component"
    for name in kustomization["resources"]:
        for doc in yaml.safe_load_all((component / name).read_text()):
            validate(doc)
    validate(yaml.safe_load((component / "secret.example.yaml").read_text()))
    (merged,) = kustomization["configMapGenerator"]
    assert merged["behavior"] == "merge"
    settings = env_file(component / merged["envs"][0])
    assert all(name.startswith(PREFIX) for name in settings)
    assert settings[PREFIX + "KAFKA_SECURITY_PROTOCOL"] == "SASL_SSL"
    assert "secure-kafka" not in yaml.safe_load((K8S / "kustomization.yaml").read_text()).get(
        "components", []
    )
    assert SECURE_LINE in (K8S / "kustomization.yaml").read_text()


def test_the_settings_are_generated_with_a_hash_suffix_without_kubectl() -> None:
    """Where kubectl is missing, what makes the roll: the ConfigMap comes from kustomize's
    generator (named with a hash of its contents unless told not to), and the Deployment
    refers to it by the generator's name, which kustomize rewrites to the hashed one."""
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    (generated,) = kustomization["configMapGenerator"]
    assert not kustomization.get("generatorOptions", {}).get("disableNameSuffixHash", False)
    assert not generated.get("options", {}).get("disableNameSuffixHash", False)
    assert "configmap.yaml" not in kustomization["resources"]
    (container,) = manifests()["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert container["envFrom"][0]["configMapRef"]["name"] == generated["name"]
