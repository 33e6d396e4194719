"""Settings: defaults, validation with one clear line naming the variable, TOML + env."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from ingest.errors import ConfigError
from ingest.settings import load_settings, parse_window

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
    assert s.worker_id  # defaults to host-pid


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
