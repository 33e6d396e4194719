"""What a dead-letter record says about its failure (pure logic: ``sink/records.py``).

Reported: an object was dead-lettered on the embedded stack and what went wrong
could not be told from the record. Each record now names the error's type, its
reason, the step of the object's way it failed in, its message and the attempts.
"""

from __future__ import annotations

from typing import Any

import pytest

from ingest.errors import (
    STEPS,
    AccessDenied,
    BrokerError,
    IngestError,
    KeyServiceError,
    LimitExceeded,
    MalformedDicom,
    NotificationError,
    ProcessingError,
    SinkError,
    SourceUnavailable,
)
from ingest.sink.records import dead_letter, record_summary
from ingest.source.notifications import ObjectRef
from ingest.worker import internal_error

RECORD = record_summary("t", 0, 7, 1_700_000_000_000, b'{"Records": []}')
REF = ObjectRef("scans", "ct/1.dcm", 1024, None, None, None, "ObjectCreated:Put", None)


def letter(error: IngestError) -> dict[str, Any]:
    return dead_letter(RECORD, REF, error, "w1")


@pytest.mark.parametrize(
    ("error", "step"),
    [
        (NotificationError("not JSON"), "notification"),
        (SourceUnavailable("GET bytes=0-9: ConnectionResetError: ..."), "get"),
        (AccessDenied("GET bytes=0-9: access denied (403)"), "get"),
        (MalformedDicom("the header does not end inside the object"), "parse"),
        (LimitExceeded("DICOM header larger than 16777216 bytes"), "parse"),
        (ProcessingError("the device stage failed"), "decode"),
        (SinkError("upload_part: S3 answered 500 InternalError"), "sink"),
        (BrokerError("produce to dlq: KafkaTimeoutError"), "publish"),
        (KeyServiceError("KMS gave no data key"), "audit"),
    ],
)
def test_the_record_names_type_reason_step_message_and_attempts(
    error: IngestError, step: str
) -> None:
    error.attempts = 3
    document = letter(error)
    assert document["error_type"] == type(error).__name__
    assert document["reason"] == error.reason
    assert document["step"] == step
    assert step in STEPS
    assert document["error"] == str(error)
    assert document["attempts"] == 3
    assert document["retriable"] is error.retriable


def test_a_pixel_data_error_is_the_decode_steps_where_the_pipeline_says_so() -> None:
    error = MalformedDicom("frame 3: a fragment of 6 bytes for a frame of 8192")
    error.step = "decode"  # what ``pipeline.jobs.decoding`` does after the header
    assert letter(error)["step"] == "decode"
    assert MalformedDicom("x").step == "parse"  # the class's own is untouched


def test_an_error_without_a_message_still_says_what_it_is() -> None:
    document = letter(SourceUnavailable())
    assert document["error"] == "A transient S3 failure: server error, throttling, timeout, reset."
    assert (document["error_type"], document["step"]) == ("SourceUnavailable", "get")


def test_an_internal_error_names_its_type_and_place_not_its_message() -> None:
    def buggy() -> None:
        {"PatientName": "DOE^JANE"}["missing"]  # a bug whose message holds a value

    try:
        buggy()
    except KeyError as exc:
        error = internal_error(exc)
    document = letter(error)
    assert document["error_type"] == "ProcessingError"
    assert document["error"].startswith("internal error: KeyError in ")
    assert "test_dead_letters.buggy, line " in document["error"]
    assert "missing" not in document["error"]
    assert "DOE" not in document["error"]
