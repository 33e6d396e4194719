"""``compose/`` validates with docker-compose and agrees with the worker's settings.

The validator is ``docker-compose`` 1.29 from Debian's package (``apt-get install
docker-compose``; ``.ci/run`` installs it): the same parser and schema check that
``up`` runs, without an engine. It is given the required variable as an operator
gives it (an env file). Then the normalised configuration it prints is checked
against the worker: its environment loads as ``Settings``; the topics the init
container creates, MinIO's notification target, the buckets and the event the
setup container configures, the ports Prometheus scrapes and the health check
calls, and the metric names of the Grafana dashboard all match what the worker
reads, serves and exports.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml

from ingest.ops.metrics import exported_names
from ingest.settings import Settings, load_settings
from tests.paths import ROOT

COMPOSE = ROOT / "compose"
KEY = base64.b64encode(bytes(range(32))).decode()


def docker_compose() -> str:
    found = shutil.which("docker-compose")
    if found is None:
        message = "docker-compose not installed (apt-get install docker-compose; .ci/run does)"
        if os.environ.get("CI"):
            pytest.fail(message)  # CI must validate: never a silent pass
        pytest.skip(message)
    return found


def compose(*args: str, env_file: Path | None) -> subprocess.CompletedProcess[str]:
    """``docker-compose [--env-file F] -f compose/docker-compose.yml ARGS``, clean environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DICOM_INGEST_", "COMPOSE_"))}
    options = ["--env-file", str(env_file)] if env_file else []
    command = [docker_compose(), *options, "-f", str(COMPOSE / "docker-compose.yml"), *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=60, check=False)


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The normalised configuration with the `gpu` profile, as ``config`` prints it."""
    env_file = tmp_path_factory.mktemp("compose") / "operator.env"
    env_file.write_text(f"DICOM_INGEST_AUDIT_KEY={KEY}\n")
    plain = compose("config", env_file=env_file)
    assert plain.returncode == 0, plain.stderr
    gpu = compose("--profile", "gpu", "config", env_file=env_file)
    assert gpu.returncode == 0, gpu.stderr
    document: dict[str, Any] = yaml.safe_load(gpu.stdout)
    return document


def test_compose_refuses_to_start_without_the_audit_key(tmp_path: Path) -> None:
    empty = tmp_path / "empty.env"
    empty.write_text("")
    result = compose("config", env_file=empty)
    assert result.returncode != 0
    assert "DICOM_INGEST_AUDIT_KEY" in result.stderr


def worker_settings(service: dict[str, Any]) -> Settings:
    env = {k: str(v) for k, v in service["environment"].items()}
    assert env["DICOM_INGEST_AUDIT_KEY"] == KEY
    return load_settings(env)


def test_worker_environment_is_valid_and_agrees_with_kafka_and_minio(
    config: dict[str, Any],
) -> None:
    services = config["services"]
    settings = worker_settings(services["worker"])
    kafka = services["kafka"]["environment"]
    assert f"PLAINTEXT://{settings.kafka_bootstrap}" in kafka["KAFKA_ADVERTISED_LISTENERS"]
    # every topic the worker reads or writes is created, the source with room for workers
    created = dict(
        re.findall(r"--topic (\S+) --partitions (\d+)", services["kafka-init"]["command"][0])
    )
    topics = settings.source_topic, settings.results_topic, settings.dlq_topic
    assert set(created) == {*topics, settings.audit_topic}
    assert int(created[settings.source_topic]) >= 6
    # MinIO publishes to the source topic, on the broker the worker reads
    minio = services["minio"]
    notify = minio["environment"]
    assert notify["MINIO_NOTIFY_KAFKA_ENABLE_PRIMARY"] == "on"
    assert notify["MINIO_NOTIFY_KAFKA_TOPIC_PRIMARY"] == settings.source_topic
    assert notify["MINIO_NOTIFY_KAFKA_BROKERS_PRIMARY"] == settings.kafka_bootstrap
    endpoint = urlparse(settings.s3_endpoint_url or "")
    assert (endpoint.hostname, endpoint.port) == ("minio", 9000)  # MinIO's S3 port
    assert "minio" in services
    assert "--address" not in minio["command"]
    # the setup container makes both buckets and the s3:ObjectCreated:* (put) notification
    setup = services["setup"]["command"][0]
    buckets = re.search(r"mc mb --ignore-existing ((?:local/\S+ ?)+)", setup)
    assert buckets is not None
    made = {b.removeprefix("local/") for b in buckets.group(1).split()}
    assert settings.output_bucket in made
    event = re.search(
        r"mc event add --ignore-existing local/(\S+) arn:minio:sqs::(\w+):kafka", setup
    )
    assert event is not None
    assert event.group(1) in made - {settings.output_bucket}  # the source bucket
    assert f"MINIO_NOTIFY_KAFKA_ENABLE_{event.group(2)}" in notify
    assert "--event put" in setup  # put: every s3:ObjectCreated:* event
    assert settings.audit_key == base64.b64decode(KEY)


def test_a_new_group_joins_at_once_with_production_group_timing(config: dict[str, Any]) -> None:
    """The dev Kafka has no initial rebalance delay; the worker keeps its production timing.

    Kafka refuses sessions under ``group.min.session.timeout.ms`` (6 s by default):
    the embedded stack's short session (for Tansu) must not leak in here.
    """
    services = config["services"]
    assert str(services["kafka"]["environment"]["KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS"]) == "0"
    for name in ("worker", "worker-gpu"):
        settings = worker_settings(services[name])
        assert settings.session_timeout_ms >= 6000
        assert settings.heartbeat_interval_ms * 3 <= settings.session_timeout_ms


def test_health_port_is_probed_and_scraped(config: dict[str, Any]) -> None:
    services = config["services"]
    prometheus = yaml.safe_load((COMPOSE / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in prometheus["scrape_configs"]}
    for name in ("worker", "worker-gpu"):
        service = services[name]
        settings = worker_settings(service)
        assert settings.health_port == 8080
        assert f"127.0.0.1:{settings.health_port}/readyz" in " ".join(
            service["healthcheck"]["test"]
        )
        stop = int(service["stop_grace_period"].removesuffix("s"))
        assert stop > settings.shutdown_deadline_s  # the drain finishes before SIGKILL
        scraped = [
            sd
            for job in jobs.values()
            for sd in job.get("dns_sd_configs", [])
            if sd["names"] == [name]
        ]
        assert [(sd["port"], sd["type"]) for sd in scraped] == [(settings.health_port, "A")]
    assert all(job.get("metrics_path", "/metrics") == "/metrics" for job in jobs.values())
    dcgm = jobs["dcgm"]["static_configs"][0]["targets"]
    assert dcgm == ["dcgm-exporter:9400"]
    assert "gpu" in services["dcgm-exporter"]["profiles"]


def test_gpu_profile_is_the_worker_with_cuda_and_a_gpu(config: dict[str, Any]) -> None:
    services = config["services"]
    cpu, gpu = services["worker"], services["worker-gpu"]
    assert gpu["profiles"] == ["gpu"]
    assert "profiles" not in cpu
    assert gpu["environment"] == {**cpu["environment"], "DICOM_INGEST_DEVICE": "cuda"}
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    dockerfile = (COMPOSE / "Dockerfile").read_text()
    stages = set(re.findall(r"^FROM \S+ AS (\w+)$", dockerfile, re.MULTILINE))
    assert {cpu["build"]["target"], gpu["build"]["target"]} == stages == {"cpu", "gpu"}
    assert re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:\S+-runtime-", dockerfile, re.MULTILINE)
    installs = re.findall(
        r'^RUN pip install -c constraints\.txt "\.\[\$\{(\w+)\}\]"', dockerfile, re.M
    )
    assert installs == ["CPU_EXTRAS", "GPU_EXTRAS"]  # both pinned by the constraints file
    assert re.search(r"^ARG GPU_EXTRAS=cuda13,gpl$", dockerfile, re.MULTILINE)
    assert re.search(r"^ARG CPU_EXTRAS=gpl$", dockerfile, re.MULTILINE)
    assert dockerfile.count("COPY pyproject.toml README.md LICENSE constraints.txt ./") == 2


def test_dashboard_and_provisioning_name_only_what_exists(config: dict[str, Any]) -> None:
    services = config["services"]
    mounts = " ".join(services["grafana"]["volumes"])
    assert "/etc/grafana/provisioning" in mounts
    assert "/var/lib/grafana/dashboards" in mounts
    provider = yaml.safe_load(
        (COMPOSE / "grafana/provisioning/dashboards/dicom-ingest.yml").read_text()
    )
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    source = yaml.safe_load(
        (COMPOSE / "grafana/provisioning/datasources/prometheus.yml").read_text()
    )["datasources"][0]
    assert source["url"] == "http://prometheus:9090"
    assert "prometheus" in services
    dashboard = json.loads((COMPOSE / "grafana/dashboards/dicom-ingest.json").read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    assert all(t["datasource"]["uid"] == "${datasource}" for p in panels for t in p["targets"])
    (choice,) = [v for v in dashboard["templating"]["list"] if v["name"] == "datasource"]
    assert choice["current"]["value"] == source["uid"]  # the provisioned one, by default
    used = {n for e in exprs for n in re.findall(r"\bdicom_ingest_[a-z_]+\b", e)}
    assert used <= exported_names(), used - exported_names()
    # the list: throughput, stage latencies, ring, retries, dead letters, lag, GPU
    for name in (
        "dicom_ingest_objects_total",
        "dicom_ingest_source_bytes_total",
        "dicom_ingest_stage_seconds_bucket",
        "dicom_ingest_ring_slots_in_use",
        "dicom_ingest_ring_waits_total",
        "dicom_ingest_ranges_in_flight",
        "dicom_ingest_retries_total",
        "dicom_ingest_dead_letters_total",
        "dicom_ingest_consumer_lag",
        "dicom_ingest_commit_age_seconds",
        "dicom_ingest_gpu_utilization_ratio",
        "dicom_ingest_gpu_memory_used_bytes",
    ):
        assert name in used, name


def test_dashboard_has_variables_and_rate_intervals_on_every_query() -> None:
    """Two deployments on one Prometheus stay apart (namespace and job variables on every
    selector of the worker's families), the data source is a choice, and no rate window
    is fixed: ``$__rate_interval`` follows the scrape interval."""
    dashboard = json.loads((COMPOSE / "grafana/dashboards/dicom-ingest.json").read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("namespace", "job"):
        assert variables[name]["type"] == "query"
        assert "dicom_ingest_build_info" in variables[name]["definition"]
        assert variables[name]["includeAll"]
        assert variables[name]["multi"]
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert exprs
    for expr in exprs:
        assert not re.search(r"\[\d+[smh]\]", expr), expr  # no fixed window
        for selector in re.findall(r"\b(?:dicom_ingest|process)_[a-z_]+(\{[^}]*\})?", expr):
            assert 'namespace=~"$namespace"' in selector, expr
            assert 'job=~"$job"' in selector, expr
    assert any("[$__rate_interval]" in e for e in exprs)


def pinned(image: str) -> bool:
    """An image reference with a version tag or a digest, neither ``latest`` nor absent."""
    if "@sha256:" in image:
        return True
    name, _, tag = image.rpartition(":")
    return bool(name) and "/" not in tag and tag not in ("", "latest")


def test_every_image_is_pinned_to_a_version() -> None:
    """compose/ and compose/k8s/ pull only tagged versions (a floating ``latest`` changed
    under MinIO's users, then vanished); the base images of the Dockerfile too."""
    assert not pinned("minio/minio:latest")
    assert not pinned("minio/minio")
    assert not pinned("localhost:5000/minio")  # a registry port is no tag
    assert pinned("quay.io/minio/minio:RELEASE.2025-09-07T16-13-09Z")
    assert pinned("grafana/grafana@sha256:" + "0" * 64)
    compose_file = yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())
    images = [service["image"] for service in compose_file["services"].values()]
    manifests = [
        doc
        for path in sorted((COMPOSE / "k8s").rglob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    ]
    images += [
        container["image"]
        for doc in manifests
        if doc.get("kind") == "Deployment" and "containers" in doc["spec"]["template"]["spec"]
        for container in doc["spec"]["template"]["spec"]["containers"]
        if "image" in container  # a patch's container names no image
    ]
    dockerfile = (COMPOSE / "Dockerfile").read_text()
    images += re.findall(r"^ARG \w+_IMAGE=(\S+)$", dockerfile, re.MULTILINE)
    assert len(images) >= 10
    assert [image for image in images if not pinned(image)] == []
    assert not any(image.startswith(("minio/", "docker.io/minio/")) for image in images)
