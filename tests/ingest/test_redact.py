"""The log processor that masks patient data and secrets, field by field and in free text."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import sys
from collections.abc import Iterator

import pytest
import structlog
from hypothesis import given
from hypothesis import strategies as st

from ingest.logs import configure_logging, key_digest
from ingest.redact import (
    RedactFilter,
    key_hash,
    redact_event,
    scrub_every_pattern,
    scrub_text,
    set_log_hash_key,
)

SIGNED = (
    "https://s3.example:9000/scans/Doe%5EJane/ct.dcm?X-Amz-Algorithm=AWS4-HMAC-SHA256"
    "&X-Amz-Credential=AKIAEXAMPLE%2F20260101%2Fus-east-1&X-Amz-Signature=deadbeef01"
    "&X-Amz-Security-Token=FQoGZXIvYXdzEXAMPLE"
)


@pytest.fixture(autouse=True)
def lasting_stderr(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``main`` configures logging onto ``sys.stderr``; loggers keep that stream after the
    test, so give them the process's own (captured by fd) and restore the configuration."""
    saved = structlog.get_config()
    monkeypatch.setattr("sys.stderr", sys.__stderr__)
    yield
    structlog.configure(**saved)


def test_fields_named_after_patient_attributes_and_secrets_are_masked() -> None:
    event = redact_event(
        None,
        "info",
        {
            "event": "x",
            "patient_name": "DOE^JANE",
            "PatientID": "12345",
            "accession_number": "A1",
            "birth_date": "19700101",
            "kafka_sasl_password": "hunter2",
            "audit_key": "c2VjcmV0",
            "key": "Doe^Jane/ct.dcm",
            "other": {"patient_id": "777", "token": "t0k"},
            "count": 3,
        },
    )
    assert event["patient_name"] == event["PatientID"] == event["birth_date"] == "[phi]"
    assert event["accession_number"] == "[phi]"
    assert event["kafka_sasl_password"] == event["audit_key"] == "[secret]"
    assert event["other"] == {"patient_id": "[phi]", "token": "[secret]"}
    assert event["key"] == key_digest("Doe^Jane/ct.dcm")  # raw keys hashed,
    assert redact_event(None, "info", {"key": event["key"]})["key"] == event["key"]  # digests kept
    assert event["count"] == 3


@pytest.mark.parametrize(
    ("text", "gone"),
    [
        (f"GET {SIGNED} failed", ["deadbeef01", "AKIAEXAMPLE", "FQoGZXIvYXdzEXAMPLE", "Doe"]),
        ("cannot read s3://scans/Smith John 1970/ct.dcm", ["Smith"]),
        ("bad value for PatientName='DOE^JANE' in header", ["DOE", "JANE"]),
        ("(0010,0020) 'ID-4711' is too long", ["ID-4711"]),
        ("element AccessionNumber: ACC99 invalid", ["ACC99"]),
        ("Referring MUELLER^HANS^^DR", ["MUELLER", "HANS"]),
        ("Authorization: AWS4-HMAC-SHA256 Credential=AKIA/x, Signature=abc", ["abc", "AKIA/x"]),
        ('{"password": "hunter2"}', ["hunter2"]),
    ],
)
def test_free_text_is_scrubbed(text: str, gone: list[str]) -> None:
    clean = scrub_text(text)
    for value in gone:
        assert value not in clean, clean


def test_ordinary_messages_pass_unchanged() -> None:
    for text in (
        "worker started",
        "GET bytes=0-65535: S3 answered 503 SlowDown",
        "JPEG 2000 Image Compression (Lossless Only) is not supported",
        "listening on http://0.0.0.0:8080/",
    ):
        assert scrub_text(text) == text


def test_configured_logging_scrubs_structlog_and_stdlib_lines(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("sys.stderr", sys.__stderr__)  # after capfd's: it outlives the test
    configure_logging(json=True, level=logging.INFO)
    capfd.readouterr()
    log = structlog.get_logger("dicom_ingest.test")
    log.warning("upload failed", url=SIGNED, patient_name="DOE^JANE", detail="see DOE^JANE")
    try:
        raise ValueError("PatientID='P-0815' rejected")  # noqa: TRY301 - a traceback to log
    except ValueError:
        log.exception("internal error")
    err = capfd.readouterr().err
    lines = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    assert [line["event"] for line in lines] == ["upload failed", "internal error"]
    for secret in ("deadbeef01", "DOE", "JANE", "P-0815"):
        assert secret not in err, secret
    assert "ValueError" in lines[1]["exception"]  # the traceback stays, its values do not
    # the standard library's records (aiokafka, botocore) pass the same filter
    root = logging.getLogger().handlers
    assert root
    assert all(any(isinstance(f, RedactFilter) for f in h.filters) for h in root)
    record = logging.LogRecord(
        "aiokafka",
        logging.WARNING,
        __file__,
        1,
        "SASL password=hunter2 for %s",
        ("MUELLER^HANS",),
        None,
    )
    assert RedactFilter().filter(record)
    assert record.getMessage() == "SASL password=[secret] for [phi]"


def test_key_hashes_are_keyed_by_the_deployments_secret() -> None:
    mrn = "scans/1234567/ct.dcm"  # a 7-digit record number: ten million candidates
    plain = hashlib.sha256(mrn.encode()).hexdigest()[:16]
    try:
        set_log_hash_key(b"d" * 32)
        keyed = key_hash(mrn)
        assert keyed != plain  # an unkeyed search over the key space finds nothing
        assert keyed == hmac.new(b"d" * 32, mrn.encode(), hashlib.sha256).hexdigest()[:16]
        assert key_digest(mrn) == keyed  # what the worker's lines carry
        assert redact_event(None, "info", {"key": mrn})["key"] == keyed
        set_log_hash_key(b"e" * 32)
        assert key_hash(mrn) != keyed  # another deployment, another hash
    finally:
        set_log_hash_key(None)


@pytest.mark.parametrize(
    "line",
    [
        "(0010,0020) Patient ID                          LO: 'ID-4711'",
        "bad element (0010, 0030) Patient's Birth Date   DA: '19700101' in header",
        '(0008,0090) Referring Physician\'s Name         PN: "MUELLER"',
        "(0010,1001) Other Patient Names                 PN: [X1, Y2]",
    ],
)
def test_pydicoms_element_format_is_masked(line: str) -> None:
    import pydicom

    scrubbed = scrub_text(line)
    assert "[phi]" in scrubbed
    for gone in ("ID-4711", "19700101", "MUELLER", "X1"):
        assert gone not in scrubbed
    element = pydicom.DataElement(0x00100020, "LO", "MRN-0042")
    for text in (str(element), repr(element)):  # as pydicom itself prints one
        assert "MRN-0042" not in scrub_text(f"cannot use {text}")


# Fragments of what the patterns look for, so that generated texts hit them often
_PIECES = st.sampled_from(
    [
        "Patient",
        "ID",
        "Name",
        "(0010,0010)",
        " LO: ",
        "'Doe^John'",
        "^",
        "=",
        ":",
        "//",
        "https://h/a/b",
        "s3://b/k",
        "X-Amz-Signature=",
        "token",
        "password",
        "Authorization",
        "AccessionNumber",
        "sig=",
        "a",
        "0",
        " ",
        ",",
        "'",
        '"',
        "-",
        ".",
        "PatientID",
    ]
)


@given(st.lists(_PIECES | st.text(max_size=4), max_size=12).map("".join))
def test_the_shortcut_never_changes_what_is_masked(text: str) -> None:
    assert scrub_text(text) == scrub_every_pattern(text)
