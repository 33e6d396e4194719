"""Kafka record values: good notifications in every format, bad ones that must be
dead-lettered, and skipped ones that announce no new content."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote_plus

from tests.bad_inputs.bases import MIB


@dataclass(frozen=True, slots=True)
class BadNotification:
    """A Kafka record value that is not a usable notification (``None``: a null value)."""

    name: str
    value: bytes | None


def _record(
    bucket: Any, key: Any, *, source: str = "aws:s3", event: Any = "ObjectCreated:Put", **obj: Any
) -> dict[str, Any]:
    return {
        "eventVersion": "2.1",
        "eventSource": source,
        "eventName": event,
        "eventTime": "2026-11-21T00:00:00.000Z",
        "s3": {"bucket": {"name": bucket}, "object": {"key": key, **obj}},
    }


def notification(fmt: str, bucket: str, key: str, event: str = "ObjectCreated:Put") -> bytes:
    """One object-created notification for ``bucket``/``key`` as ``fmt`` sends it."""
    if fmt == "aws":
        doc: dict[str, Any] = {"Records": [_record(bucket, quote_plus(key), event=event)]}
    elif fmt == "minio":
        escaped = quote_plus(key, safe="")  # Go's url.QueryEscape: '/' too
        record = _record(bucket, escaped, source="minio:s3", event=f"s3:{event}")
        doc = {"EventName": f"s3:{event}", "Key": f"{bucket}/{key}", "Records": [record]}
    elif fmt == "ceph":
        doc = {"Records": [_record(bucket, key, source="ceph:s3", event=event)]}  # raw key
    elif fmt == "eventbridge":
        doc = {
            "version": "0",
            "detail-type": "Object Created" if event.startswith("ObjectCreated") else event,
            "source": "aws.s3",
            "time": "2026-11-21T00:00:00Z",
            "detail": {
                "bucket": {"name": bucket},
                "object": {"key": quote_plus(key)},
                "reason": "PutObject",
            },
        }
    else:
        raise ValueError(f"unknown format {fmt!r}")
    return json.dumps(doc).encode()


def aws_records(bucket: str, keys: list[str], **obj: Any) -> bytes:
    """One AWS notification announcing several objects (``obj``: extra object fields)."""
    return _doc({"Records": [_record(bucket, quote_plus(key), **obj) for key in keys]})


def _doc(doc: Any) -> bytes:
    return json.dumps(doc).encode()


def bad_notifications(bucket: str, key: str) -> list[BadNotification]:
    """Records that must be dead-lettered as ``bad_notification``; ``key`` exists in ``bucket``."""
    good = json.loads(notification("aws", bucket, key))
    padded = dict(good, padding="x" * (2 * MIB))  # a valid notification, 2 MiB long
    # a lone surrogate escape in the key: valid JSON, not valid Unicode
    surrogate = _doc({"Records": [_record(bucket, "PLACEHOLDER")]}).replace(
        b"PLACEHOLDER", b"\\ud800.dcm"
    )
    items = [
        ("not-json", b"{not json"),
        ("not-utf8", b"\xff\xfe\x00\x80 binary garbage \xc3\x28"),
        ("empty-value", b""),
        ("null-value", None),
        ("json-array", b"[1, 2, 3]"),
        ("json-string", b'"ObjectCreated:Put"'),
        ("json-null", b"null"),
        ("unknown-format", _doc({"hello": "world"})),
        ("eventbridge-not-s3", _doc({"detail-type": "Object Created", "source": "aws.ec2"})),
        ("records-not-list", _doc({"Records": "x"})),
        ("records-empty", _doc({"Records": []})),
        ("record-not-object", _doc({"Records": [42]})),
        ("event-name-number", b'{"Records": [{"eventName": 42}]}'),
        ("unknown-event-source", _doc({"Records": [_record(bucket, key, source="gcs")]})),
        ("bucket-name-number", _doc({"Records": [_record(123, key)]})),
        ("bucket-name-invalid", _doc({"Records": [_record("Not..A_Bucket!", key)]})),
        ("bucket-name-ip", _doc({"Records": [_record("192.168.1.1", key)]})),
        ("key-number", _doc({"Records": [_record(bucket, 42)]})),
        ("key-missing", _doc({"Records": [_record(bucket, "")]})),
        ("key-bad-utf8-escape", _doc({"Records": [_record(bucket, "a%FF%FEb.dcm")]})),
        ("key-lone-surrogate", surrogate),
        ("key-too-long", _doc({"Records": [_record(bucket, "k" * 1025)]})),
        ("size-string", _doc({"Records": [_record(bucket, key, size="big")]})),
        ("size-negative", _doc({"Records": [_record(bucket, key, size=-1)]})),
        ("size-huge", _doc({"Records": [_record(bucket, key, size=2**64)]})),
        ("size-bool", _doc({"Records": [_record(bucket, key, size=True)]})),
        ("etag-with-space", _doc({"Records": [_record(bucket, key, eTag="a b")]})),
        (
            "mixed-sources",
            _doc({"Records": [_record(bucket, key), _record(bucket, key, source="ceph:s3")]}),
        ),
        # file:// URLs: no roots are configured where these run, and none is plain
        ("file-url-traversal", _doc({"url": "file:///srv/archive/../../etc/passwd"})),
        ("file-url-encoded-dots", _doc({"url": "file:///srv/archive/%2E%2E/secret.dcm"})),
        ("file-url-other-host", _doc({"url": "file://pacs-host/srv/archive/a.dcm"})),
        ("file-url-not-a-string", _doc({"url": ["file:///srv/archive/a.dcm"]})),
        ("file-url-outside-roots", _doc({"url": "file:///etc/passwd"})),
        ("json-deeply-nested", b"[" * 200_000 + b"]" * 200_000),
        ("json-huge-integer", b'{"Records": [' + b"9" * 5000 + b"]}"),
        ("over-1mib", b'{"x": "' + b"y" * MIB + b'"}'),
        ("valid-but-2mib", _doc(padded)),
        # past the consumer's max_partition_fetch_bytes (4 MiB): must not stall the partition
        ("over-4mib-fetch-limit", b'{"x": "' + b"y" * (5 * MIB) + b'"}'),
    ]
    return [BadNotification(name, value) for name, value in items]


def skipped_notifications(bucket: str, key: str) -> list[tuple[str, bytes]]:
    """Records that announce no new content: skipped and counted, never dead-lettered.

    Returns (name, value) pairs; ``key`` exists, so processing one would be visible.
    """
    minio = json.loads(notification("minio", bucket, key))

    def minio_event(event: str) -> bytes:
        doc = json.loads(json.dumps(minio))
        doc["EventName"] = doc["Records"][0]["eventName"] = event
        return _doc(doc)

    return [
        ("aws-object-removed", notification("aws", bucket, key, "ObjectRemoved:Delete")),
        ("aws-restore-completed", notification("aws", bucket, key, "ObjectRestore:Completed")),
        ("minio-object-accessed", minio_event("s3:ObjectAccessed:Get")),
        ("minio-put-tagging", minio_event("s3:ObjectCreated:PutTagging")),
        ("minio-put-retention", minio_event("s3:ObjectCreated:PutRetention")),
        ("eventbridge-object-deleted", notification("eventbridge", bucket, key, "Object Deleted")),
        ("ceph-object-removed", notification("ceph", bucket, key, "ObjectRemoved:Delete")),
        ("s3-test-event", _doc({"Service": "Amazon S3", "Event": "s3:TestEvent"})),
    ]
