"""Settings: defaults, validation with one clear line naming the variable, TOML + env."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from ingest.errors import ConfigError
from ingest.settings import load_settings, parse_window, plaintext

KEY = base64.b64encode(b"k" * 32).decode()
BASE = {
    "DICOM_INGEST_KAFKA_BOOTSTRAP": "127.0.0.1:9092",
    "DICOM_INGEST_OUTPUT_URL": "s3://out/prefix",
    "DICOM_INGEST_AUDIT_KEY": KEY,
}


def test_defaults_follow_the_contract() -> None:
    s = load_settings(BASE)
    assert s.source_topic == "s3-events"
    assert s.group_id == "dicom-ingest"
    assert s.results_topic == "dicom-ingest.results"
    assert s.dlq_topic == "dicom-ingest.dlq"
    assert s.audit_topic == "dicom-ingest.audit"
    assert s.window is None
    assert s.output_dtype == "float32"
    assert s.device == "auto"
    assert s.s3_endpoint_url is None
    assert s.output_url == "s3://out/prefix/"
    assert (s.output_bucket, s.output_prefix) == ("out", "prefix/")
    assert s.audit_key == b"k" * 32
    assert s.worker_id  # defaults to the host name


@pytest.mark.parametrize(
    ("name", "value", "needle"),
    [
        ("DICOM_INGEST_WINDOW", "40", "DICOM_INGEST_WINDOW"),
        ("DICOM_INGEST_WINDOW", "40,0", "DICOM_INGEST_WINDOW"),
        ("DICOM_INGEST_OUTPUT_DTYPE", "int8", "DICOM_INGEST_OUTPUT_DTYPE"),
        ("DICOM_INGEST_DEVICE", "tpu", "DICOM_INGEST_DEVICE"),
        ("DICOM_INGEST_AUDIT_KEY", "c2hvcnQ=", "DICOM_INGEST_AUDIT_KEY"),
        ("DICOM_INGEST_AUDIT_KEY", "***", "DICOM_INGEST_AUDIT_KEY"),
        ("DICOM_INGEST_OUTPUT_URL", "/tmp/out", "DICOM_INGEST_OUTPUT_URL"),
        ("DICOM_INGEST_S3_ENDPOINT_URL", "ftp://x", "DICOM_INGEST_S3_ENDPOINT_URL"),
        ("DICOM_INGEST_PART_SIZE", "1000", "DICOM_INGEST_PART_SIZE"),
        ("DICOM_INGEST_RING_SLOTS", "many", "DICOM_INGEST_RING_SLOTS"),
        ("DICOM_INGEST_FILE_ROOTS", "/mnt/archive", "DICOM_INGEST_FILE_ROOTS"),  # no name
        ("DICOM_INGEST_FILE_ROOTS", "a=relative/path", "DICOM_INGEST_FILE_ROOTS"),
        ("DICOM_INGEST_FILE_ROOTS", "-a=/mnt/a", "DICOM_INGEST_FILE_ROOTS"),
        ("DICOM_INGEST_FILE_ROOTS", "a=/mnt/a,a=/mnt/b", "DICOM_INGEST_FILE_ROOTS"),
        ("DICOM_INGEST_FILE_ROOTS", "a=/mnt/a,b=/mnt/a/", "DICOM_INGEST_FILE_ROOTS"),
        ("DICOM_INGEST_FILE_READER", "mmap", "DICOM_INGEST_FILE_READER"),
    ],
)
def test_bad_values_name_the_variable(name: str, value: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle) as info:
        load_settings({**BASE, name: value})
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("missing", sorted(BASE))
def test_required_variables(missing: str) -> None:
    env = {k: v for k, v in BASE.items() if k != missing}
    with pytest.raises(ConfigError, match=missing):
        load_settings(env)


def test_file_roots_are_named_absolute_normalised_paths() -> None:
    s = load_settings(
        {**BASE, "DICOM_INGEST_FILE_ROOTS": " archive=/mnt/lustre//archive/ , hot=/nvme"}
    )
    assert s.file_roots == (("archive", "/mnt/lustre/archive"), ("hot", "/nvme"))
    assert load_settings(BASE).file_roots == ()
    assert load_settings(BASE).file_reader == "auto"


def test_window_parsing() -> None:
    assert parse_window("none") is None
    assert parse_window(" 40, 400 ") == (40.0, 400.0)


def test_toml_file_and_environment_precedence(tmp_path: Path) -> None:
    config = tmp_path / "worker.toml"
    config.write_text('source_topic = "from-file"\ngroup_id = "file-group"\nwindow = "40,400"\n')
    s = load_settings({**BASE, "DICOM_INGEST_GROUP_ID": "env-group"}, config)
    assert (s.source_topic, s.group_id, s.window) == ("from-file", "env-group", (40.0, 400.0))


def test_unknown_toml_key_is_an_error(tmp_path: Path) -> None:
    config = tmp_path / "worker.toml"
    config.write_text("sourc_topic = 'typo'\n")
    with pytest.raises(ConfigError, match="sourc_topic"):
        load_settings(BASE, config)


TLS = {
    **BASE,
    "DICOM_INGEST_REQUIRE_TLS": "true",
    "DICOM_INGEST_KAFKA_SECURITY_PROTOCOL": "SSL",
    "DICOM_INGEST_S3_ENDPOINT_URL": "https://s3.example:443",
}


@pytest.mark.parametrize(
    ("name", "value", "needle"),
    [
        ("DICOM_INGEST_KAFKA_SECURITY_PROTOCOL", "PLAINTEXT", "KAFKA_SECURITY_PROTOCOL"),
        ("DICOM_INGEST_KAFKA_SECURITY_PROTOCOL", "SASL_PLAINTEXT", "KAFKA_SECURITY_PROTOCOL"),
        ("DICOM_INGEST_S3_ENDPOINT_URL", "http://s3.example:80", "S3_ENDPOINT_URL"),
        ("DICOM_INGEST_AUDIT_KMS_ENDPOINT_URL", "http://kms:4566", "AUDIT_KMS_ENDPOINT_URL"),
    ],
)
def test_require_tls_refuses_plaintext(name: str, value: str, needle: str) -> None:
    assert load_settings(TLS).require_tls
    env = {**TLS, name: value}
    if "SASL" in value:  # SASL PLAIN without TLS: the password on the wire
        env |= {"DICOM_INGEST_KAFKA_SASL_USERNAME": "u", "DICOM_INGEST_KAFKA_SASL_PASSWORD": "p"}
    with pytest.raises(ConfigError, match=needle):
        load_settings(env)
    load_settings({**env, "DICOM_INGEST_REQUIRE_TLS": "false"})  # the development posture


def test_production_needs_a_trail_an_auditor_can_trust(tmp_path: Path) -> None:
    keyring = tmp_path / "keyring.json"
    keyring.write_text("{}")
    env = {k: v for k, v in TLS.items() if k != "DICOM_INGEST_AUDIT_KEY"}
    env |= {"DICOM_INGEST_POSTURE": "production", "DICOM_INGEST_REQUIRE_TLS": "false"}
    env |= {"DICOM_INGEST_AUDIT_KEYRING_FILE": str(keyring)}
    with pytest.raises(ConfigError, match="signing key outside the worker"):
        load_settings(env)
    env["DICOM_INGEST_AUDIT_SIGNING_KMS_KEY_ID"] = "alias/audit-digests"
    with pytest.raises(ConfigError, match="AUDIT_SPOOL_DIR"):
        load_settings(env)
    env["DICOM_INGEST_AUDIT_SPOOL_DIR"] = str(tmp_path / "spool")
    assert load_settings(env).posture == "production"
    with pytest.raises(ConfigError, match="KAFKA_SECURITY_PROTOCOL"):  # TLS comes with it
        load_settings({**env, "DICOM_INGEST_KAFKA_SECURITY_PROTOCOL": "PLAINTEXT"})


def test_an_endpoint_with_a_password_is_refused_without_echoing_it() -> None:
    url = "https://ingest:hunter2@s3.example"
    with pytest.raises(ConfigError, match="S3_ENDPOINT_URL") as info:
        load_settings({**BASE, "DICOM_INGEST_S3_ENDPOINT_URL": url})
    assert "hunter2" not in str(info.value)


def test_the_default_worker_id_outlives_the_process() -> None:
    import socket

    assert load_settings(BASE).worker_id == socket.gethostname()  # a pod's name in k8s


def test_plaintext_connections_are_named_in_the_development_posture() -> None:
    env = {**BASE, "DICOM_INGEST_S3_ENDPOINT_URL": "http://minio:9000"}
    env |= {"DICOM_INGEST_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT"}
    env |= {"DICOM_INGEST_KAFKA_SASL_USERNAME": "u", "DICOM_INGEST_KAFKA_SASL_PASSWORD": "p"}
    found = plaintext(load_settings(env))  # the worker logs each at start
    assert found == [
        "DICOM_INGEST_KAFKA_SECURITY_PROTOCOL: SASL_PLAINTEXT with SASL PLAIN (the password in "
        "the clear) is plaintext",
        "DICOM_INGEST_S3_ENDPOINT_URL: http is plaintext",
    ]
    assert plaintext(load_settings(TLS)) == []


@pytest.mark.parametrize(
    ("name", "suggestion"),
    [
        ("DICOM_INGEST_PARTSIZE", "DICOM_INGEST_PART_SIZE"),
        ("DICOM_INGEST_KAFKA_BOOTSTRAP_SERVERS", "DICOM_INGEST_KAFKA_BOOTSTRAP"),
        ("DICOM_INGEST_OUTPUT_DTYP", "DICOM_INGEST_OUTPUT_DTYPE"),
    ],
)
def test_an_unknown_prefixed_variable_is_refused_with_the_nearest_name(
    name: str, suggestion: str
) -> None:
    with pytest.raises(ConfigError) as raised:
        load_settings({**BASE, name: "1"})
    assert str(raised.value) == f"{name}: not a setting; did you mean {suggestion}?"


def test_an_unknown_variable_far_from_every_name_is_refused_too() -> None:
    with pytest.raises(ConfigError, match=r"^DICOM_INGEST_QQQQQQQQQQQQQQQQQ: not a setting"):
        load_settings({**BASE, "DICOM_INGEST_QQQQQQQQQQQQQQQQQ": "1"})
    # variables of other programs are none of ours
    assert load_settings({**BASE, "DICOM_INGESTION": "1", "AWS_REGION": "x"}).part_size


def test_an_unknown_config_file_key_gets_the_nearest_name(tmp_path: Path) -> None:
    config = tmp_path / "worker.toml"
    config.write_text("partsize = 1\n")
    with pytest.raises(ConfigError, match="unknown key 'partsize'; did you mean part_size"):
        load_settings(BASE, config_file=config)
