"""Notification parsing: every producer's format, bad input, repeats and order."""

from __future__ import annotations

import copy
import json
from typing import Any
from urllib.parse import quote_plus

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ingest.errors import NotificationError
from ingest.source.notifications import (
    MAX_KEY_BYTES,
    Notification,
    ObjectRef,
    RecentObjects,
    parse_notification,
)

# -- samples, shaped as each producer sends them --------------------------------

AWS_RECORD: dict[str, Any] = {
    "eventVersion": "2.1",
    "eventSource": "aws:s3",
    "awsRegion": "eu-west-1",
    "eventTime": "2024-05-02T10:11:12.345Z",
    "eventName": "ObjectCreated:Put",
    "userIdentity": {"principalId": "AWS:AIDAJDPLRKLG7UEXAMPLE"},
    "requestParameters": {"sourceIPAddress": "172.16.0.1"},
    "responseElements": {
        "x-amz-request-id": "C3D13FE58DE4C810",
        "x-amz-id-2": "FMyUVURIY8/IgAtTv8xRjskZQpcIZ9KG4V5Wp6S7S/JRWeUWerMUE5JgHvANOjpD",
    },
    "s3": {
        "s3SchemaVersion": "1.0",
        "configurationId": "dicom-ingest",
        "bucket": {
            "name": "pacs-archive",
            "ownerIdentity": {"principalId": "A3NL1KOZZKExample"},
            "arn": "arn:aws:s3:::pacs-archive",
        },
        "object": {
            "key": "studies/1.2.840.1/CT+slice+001.dcm",
            "size": 524288,
            "eTag": "d41d8cd98f00b204e9800998ecf8427e",
            "versionId": "096fKKXTRTtl3on89fVO.nfljtsv6qko",
            "sequencer": "0055AED6DCD90281E5",
        },
    },
}

MINIO_MESSAGE: dict[str, Any] = {
    "EventName": "s3:ObjectCreated:Put",
    "Key": "pacs/studies/ct 1.dcm",
    "Records": [
        {
            "eventVersion": "2.0",
            "eventSource": "minio:s3",
            "awsRegion": "",
            "eventTime": "2024-05-02T10:11:12.345Z",
            "eventName": "s3:ObjectCreated:Put",
            "userIdentity": {"principalId": "minioadmin"},
            "requestParameters": {
                "principalId": "minioadmin",
                "region": "",
                "sourceIPAddress": "172.18.0.1",
            },
            "responseElements": {
                "x-amz-id-2": "dd9025bab4ad464b049177c95eb6ebf374d3b3fd1af9251148b658df7ac2e3e8",
                "x-amz-request-id": "17CB4F5E2A3B1C9D",
                "x-minio-deployment-id": "2c1d6a1e-8f3b-4b8e-9f57-1d2f0c6a7b3e",
                "x-minio-origin-endpoint": "http://172.18.0.3:9000",
            },
            "s3": {
                "s3SchemaVersion": "1.0",
                "configurationId": "Config",
                "bucket": {
                    "name": "pacs",
                    "ownerIdentity": {"principalId": "minioadmin"},
                    "arn": "arn:aws:s3:::pacs",
                },
                "object": {
                    "key": "studies%2Fct+1.dcm",
                    "size": 524288,
                    "eTag": "3b8a1f0e5c2d4e6f8a9b0c1d2e3f4a5b",
                    "contentType": "application/dicom",
                    "userMetadata": {"content-type": "application/dicom"},
                    "sequencer": "17CB4F5E2A60A5D4",
                },
            },
            "source": {
                "host": "172.18.0.1",
                "port": "",
                "userAgent": "MinIO (linux; amd64) minio-go/v7.0.70",
            },
        }
    ],
}

EVENTBRIDGE_EVENT: dict[str, Any] = {
    "version": "0",
    "id": "17793124-05d4-b198-2fde-7ededc63b103",
    "detail-type": "Object Created",
    "source": "aws.s3",
    "account": "111122223333",
    "time": "2024-05-02T10:11:12Z",
    "region": "ca-central-1",
    "resources": ["arn:aws:s3:::pacs-archive"],
    "detail": {
        "version": "0",
        "bucket": {"name": "pacs-archive"},
        "object": {
            "key": "wsi/slide+7.dcm",
            "size": 5576,
            "etag": "b1946ac92492d2347c6235b4d2611184",
            "version-id": "IYV3p45BT0ac8hjHg1houSdS1a.Mro8e",
            "sequencer": "00617F08299329D189",
        },
        "request-id": "N4N7GDK58NMKJ12R",
        "requester": "123456789012",
        "source-ip-address": "1.2.3.4",
        "reason": "PutObject",
    },
}

CEPH_RECORD: dict[str, Any] = {
    "eventVersion": "2.1",
    "eventSource": "ceph:s3",
    "awsRegion": "zonegroup1",
    "eventTime": "2019-11-22T13:47:35.124724Z",
    "eventName": "ObjectCreated:Put",
    "userIdentity": {"principalId": "tester"},
    "requestParameters": {"sourceIPAddress": ""},
    "responseElements": {
        "x-amz-request-id": "503a4c37-85eb-47cd-8681-2817e80b4281.5330.903595",
        "x-amz-id-2": "14d2-zone1-zonegroup1",
    },
    "s3": {
        "s3SchemaVersion": "1.0",
        "configurationId": "mynotif1",
        "bucket": {
            "name": "mybucket1",
            "ownerIdentity": {"principalId": "tester"},
            "arn": "arn:aws:s3:zonegroup1::mybucket1",
            "id": "503a4c37-85eb-47cd-8681-2817e80b4281.5332.38",
        },
        "object": {
            "key": "series 2/img+1.dcm",
            "size": 1024,
            "eTag": "37b51d194a7513e45b56f6524f2d51f2",
            "versionId": "",
            "sequencer": "F7E6D75DC742D108",
            "metadata": [],
            "tags": [],
        },
    },
    "eventId": "1574430455.124724.37b51d194a7513e45b56f6524f2d51f2",
    "opaqueData": "me@example.com",
}

TEST_EVENT = {
    "Service": "Amazon S3",
    "Event": "s3:TestEvent",
    "Time": "2024-05-02T10:11:12.000Z",
    "Bucket": "pacs-archive",
    "RequestId": "5582815E1AEA5ADF",
    "HostId": "8cLeGAmw098X5cv4Zkwcmo8vvZa3eH3eKxsPzbB9wrR+YstdA6Knx4Ip8EXAMPLE",
}


def encode(doc: Any) -> bytes:
    return json.dumps(doc).encode("utf-8")


def aws(*records: dict[str, Any]) -> bytes:
    return encode({"Records": list(records)})


def aws_record(key: str = "a.dcm", **object_fields: Any) -> dict[str, Any]:
    record = copy.deepcopy(AWS_RECORD)
    record["s3"]["object"]["key"] = key
    record["s3"]["object"].update(object_fields)
    return record


# -- each format -------------------------------------------------------------------


def test_aws_record() -> None:
    n = parse_notification(aws(AWS_RECORD))
    assert n == Notification(
        format="aws",
        objects=(
            ObjectRef(
                bucket="pacs-archive",
                key="studies/1.2.840.1/CT slice 001.dcm",
                size=524288,
                etag="d41d8cd98f00b204e9800998ecf8427e",
                version_id="096fKKXTRTtl3on89fVO.nfljtsv6qko",
                sequencer="0055AED6DCD90281E5",
                event_name="ObjectCreated:Put",
                event_time="2024-05-02T10:11:12.345Z",
                format="aws",
            ),
        ),
        skipped=0,
    )


def test_minio_message() -> None:
    n = parse_notification(encode(MINIO_MESSAGE))
    assert n.format == "minio"
    (ref,) = n.objects
    assert (ref.bucket, ref.key) == ("pacs", "studies/ct 1.dcm")
    assert ref.event_name == "ObjectCreated:Put"
    assert ref.version_id is None
    assert ref.sequencer == "17CB4F5E2A60A5D4"


def test_minio_metadata_changes_are_skipped() -> None:
    msg = copy.deepcopy(MINIO_MESSAGE)
    msg["Records"][0]["eventName"] = msg["EventName"] = "s3:ObjectCreated:PutTagging"
    assert parse_notification(encode(msg)) == Notification("minio", (), 1)


def test_eventbridge_object_created() -> None:
    n = parse_notification(encode(EVENTBRIDGE_EVENT))
    assert n.format == "eventbridge"
    assert n.skipped == 0
    (ref,) = n.objects
    assert ref == ObjectRef(
        bucket="pacs-archive",
        key="wsi/slide 7.dcm",
        size=5576,
        etag="b1946ac92492d2347c6235b4d2611184",
        version_id="IYV3p45BT0ac8hjHg1houSdS1a.Mro8e",
        sequencer="00617F08299329D189",
        event_name="ObjectCreated:Put",
        event_time="2024-05-02T10:11:12Z",
        format="eventbridge",
    )


def test_eventbridge_other_detail_types_are_skipped() -> None:
    event = copy.deepcopy(EVENTBRIDGE_EVENT)
    event["detail-type"] = "Object Deleted"
    event["detail"]["reason"] = "DeleteObject"
    assert parse_notification(encode(event)) == Notification("eventbridge", (), 1)


def test_ceph_record_key_is_not_url_decoded() -> None:
    n = parse_notification(aws(CEPH_RECORD))
    assert n.format == "ceph"
    (ref,) = n.objects
    # RGW writes the raw object name: "+" is a plus, not a space.
    assert ref.key == "series 2/img+1.dcm"
    assert ref.version_id is None  # RGW sends "" for unversioned buckets
    assert ref.etag == "37b51d194a7513e45b56f6524f2d51f2"


def test_ceph_variants_lowercase_etag_and_string_size() -> None:
    record = copy.deepcopy(CEPH_RECORD)
    obj = record["s3"]["object"]
    obj["etag"] = obj.pop("eTag")
    obj["size"] = "1024"
    record["eventName"] = "s3:ObjectCreated:CompleteMultipartUpload"
    (ref,) = parse_notification(aws(record)).objects
    assert (ref.etag, ref.size, ref.event_name) == (
        "37b51d194a7513e45b56f6524f2d51f2",
        1024,
        "ObjectCreated:CompleteMultipartUpload",
    )


def test_s3_test_event_is_skipped() -> None:
    assert parse_notification(encode(TEST_EVENT)) == Notification("test-event", (), 0)


def test_several_records_and_non_create_events_counted() -> None:
    removed = aws_record("gone.dcm", eTag=None)
    removed["eventName"] = "ObjectRemoved:Delete"
    restored = aws_record("cold.dcm")
    restored["eventName"] = "ObjectRestore:Completed"
    copied = aws_record("b.dcm")
    copied["eventName"] = "ObjectCreated:Copy"
    n = parse_notification(aws(aws_record("a.dcm"), removed, copied, restored))
    assert [r.key for r in n.objects] == ["a.dcm", "b.dcm"]
    assert n.skipped == 2


def test_mixed_event_sources_are_rejected() -> None:
    with pytest.raises(NotificationError, match="more than one event source"):
        parse_notification(aws(AWS_RECORD, CEPH_RECORD))


# -- keys and etags ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("encoded", "decoded"),
    [
        ("a+b.dcm", "a b.dcm"),
        ("a%2Bb.dcm", "a+b.dcm"),
        ("a%20b.dcm", "a b.dcm"),
        ("caf%C3%A9/r%C3%A9sum%C3%A9.dcm", "café/résumé.dcm"),
        ("%E6%82%A3%E8%80%85/1.dcm", "患者/1.dcm"),
        ("dir%2Fsub%2Fx.dcm", "dir/sub/x.dcm"),
        ("100%25.dcm", "100%.dcm"),
        ("raw-é.dcm", "raw-é.dcm"),
    ],
)
def test_url_encoded_keys(encoded: str, decoded: str) -> None:
    (ref,) = parse_notification(aws(aws_record(encoded))).objects
    assert ref.key == decoded


@pytest.mark.parametrize(
    ("etag", "expected"),
    [
        ('"d41d8cd98f00b204e9800998ecf8427e"', "d41d8cd98f00b204e9800998ecf8427e"),
        ('"9b2cf535f27731c974343645a3985328-12"', "9b2cf535f27731c974343645a3985328-12"),
        ("d41d8cd98f00b204e9800998ecf8427e", "d41d8cd98f00b204e9800998ecf8427e"),
        ('""', None),
        ("", None),
    ],
)
def test_etag_quotes_are_stripped(etag: str, expected: str | None) -> None:
    (ref,) = parse_notification(aws(aws_record(eTag=etag))).objects
    assert ref.etag == expected


def test_key_of_exactly_1024_bytes_is_accepted() -> None:
    key = "é" * (MAX_KEY_BYTES // 2)
    (ref,) = parse_notification(aws(aws_record(quote_plus(key)))).objects
    assert ref.key == key


# -- bad input ------------------------------------------------------------------------


DELETE = object()


def _with(path: str, value: Any) -> bytes:
    """AWS_RECORD with one field replaced (or removed, for the DELETE marker)."""
    record = copy.deepcopy(AWS_RECORD)
    *parents, last = path.split(".")
    node = record
    for part in parents:
        node = node[part]
    if value is DELETE:
        del node[last]
    else:
        node[last] = value
    return aws(record)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (None, "empty"),
        (b"", "empty"),
        (b"\xff\xfe{}", "not UTF-8"),
        (b"{nope", "not JSON"),
        (b'{"Records": [{"s3": {"object": {"size": 1' + b"0" * 5000 + b"}}}]}", "not JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b"[1, 2]", "not an object"),
        (b'"Records"', "not an object"),
        (b"{}", "unknown notification format"),
        (b'{"Records": []}', "Records: not a non-empty list"),
        (b'{"Records": {}}', "Records: not a non-empty list"),
        (b'{"Records": [1]}', r"Records\[0\]: not an object"),
        (b'{"detail-type": "Object Created", "source": "aws.ec2"}', "not from aws.s3"),
        (aws({**AWS_RECORD, "eventSource": "rustfs:s3"}), "unknown event source"),
        (_with("eventName", 7), "eventName: not a string"),
        (_with("s3.object.size", "abc"), "size: not an integer"),
        (_with("s3.object.size", 1.5), "size: not an integer"),
        (_with("s3.object.size", True), "size: not an integer"),
        (_with("s3.object.size", -1), "size: negative"),
        (_with("s3.object.size", 1 << 64), "larger than any S3 object"),
        (_with("s3.bucket", DELETE), "bucket: missing or not an object"),
        (_with("s3.bucket.name", DELETE), "name: missing or empty"),
        (_with("s3.bucket.name", "ab"), "not a valid S3 bucket name"),
        (_with("s3.bucket.name", "has space"), "not a valid S3 bucket name"),
        (_with("s3.bucket.name", "a/b"), "not a valid S3 bucket name"),
        (_with("s3.bucket.name", "-lead"), "not a valid S3 bucket name"),
        (_with("s3.bucket.name", "a..b"), "not a valid S3 bucket name"),
        (_with("s3.bucket.name", "192.168.1.1"), "not a valid S3 bucket name"),
        (_with("s3.bucket.name", "x" * 256), "not a valid S3 bucket name"),
        (_with("s3.object.key", 12), "key: not a string"),
        (_with("s3.object.key", ""), "key: missing or empty"),
        (_with("s3.object.key", DELETE), "key: missing or empty"),
        (_with("s3.object.key", "a" * 1025), "longer than 1024 bytes"),
        (_with("s3.object.key", "%C3%A9" * 513), "longer than 1024 bytes"),
        (_with("s3.object.key", "bad%FF.dcm"), "not UTF-8 once URL-decoded"),
        (_with("s3.object.key", "\ud800.dcm"), "key: not valid Unicode"),
        (_with("s3.object.eTag", "ab\r\nX-Injected: 1"), "eTag: not a printable ASCII token"),
        (_with("s3.object.versionId", ["v"]), "versionId: not a string"),
        (_with("s3.object.sequencer", "x" * 1025), "sequencer: not a printable ASCII token"),
    ],
)
def test_bad_input_raises_notification_error(value: bytes | None, message: str) -> None:
    with pytest.raises(NotificationError, match=message):
        parse_notification(value)


def test_oversize_value_is_refused_before_parsing() -> None:
    # Not even JSON: the length check has to come first to report this.
    with pytest.raises(NotificationError, match="exceeds 100"):
        parse_notification(b"x" * 101, max_bytes=100)


def test_error_messages_do_not_echo_keys() -> None:
    secret = "Doe^Jane-1970-01-01"
    with pytest.raises(NotificationError) as info:
        parse_notification(_with("s3.object.key", secret + "%FF"))
    assert secret not in str(info.value)


# -- properties ----------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)

FIELD_PATHS = [
    "Records",
    "eventSource",
    "eventName",
    "eventTime",
    "s3",
    "s3.bucket",
    "s3.bucket.name",
    "s3.object",
    "s3.object.key",
    "s3.object.size",
    "s3.object.eTag",
    "s3.object.versionId",
    "s3.object.sequencer",
]


def _parses_or_refuses(value: bytes) -> None:
    try:
        result = parse_notification(value)
    except NotificationError:
        return
    assert isinstance(result, Notification)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=512))
def test_arbitrary_bytes_parse_or_raise_notification_error(value: bytes) -> None:
    _parses_or_refuses(value)


@settings(max_examples=200, deadline=None)
@given(json_values)
def test_arbitrary_json_parses_or_raises_notification_error(doc: Any) -> None:
    _parses_or_refuses(encode(doc))


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(FIELD_PATHS), json_values, st.booleans())
def test_mutated_records_parse_or_raise_notification_error(
    path: str, value: Any, wrap: bool
) -> None:
    raw = _with(path, value) if path != "Records" else encode({"Records": value})
    if wrap:  # the same record inside MinIO's envelope
        raw = encode({"EventName": "s3:ObjectCreated:Put", "Key": "k", **json.loads(raw)})
    _parses_or_refuses(raw)


keys = st.text(min_size=1).filter(lambda k: len(k.encode("utf-8")) <= MAX_KEY_BYTES)


@settings(max_examples=200, deadline=None)
@given(keys, st.sampled_from(["/", ""]))
def test_url_encoded_key_round_trips(key: str, safe: str) -> None:
    (ref,) = parse_notification(aws(aws_record(quote_plus(key, safe=safe)))).objects
    assert ref.key == key


@settings(max_examples=200, deadline=None)
@given(keys)
def test_ceph_raw_key_round_trips(key: str) -> None:
    record = copy.deepcopy(CEPH_RECORD)
    record["s3"]["object"]["key"] = key
    (ref,) = parse_notification(aws(record)).objects
    assert ref.key == key


# -- RecentObjects -------------------------------------------------------------------


def ref(
    key: str = "k.dcm",
    *,
    version_id: str | None = None,
    etag: str | None = "e1",
    sequencer: str | None = None,
    fmt: str = "aws",
) -> ObjectRef:
    return ObjectRef(
        bucket="pacs",
        key=key,
        size=1,
        etag=etag,
        version_id=version_id,
        sequencer=sequencer,
        event_name="ObjectCreated:Put",
        event_time=None,
        format=fmt,
    )


def test_repeats_are_seen() -> None:
    recent = RecentObjects()
    assert not recent.seen(ref())
    assert recent.seen(ref())
    assert not recent.seen(ref(etag="e2"))  # new content under the same key
    assert not recent.seen(ref(version_id="v1"))
    assert recent.seen(ref(version_id="v1", etag="other"))  # version id wins


def test_refs_without_identity_are_never_repeats() -> None:
    recent = RecentObjects()
    bare = ref(etag=None)
    assert not recent.seen(bare)
    assert not recent.seen(bare)


def test_lru_evicts_least_recently_used() -> None:
    recent = RecentObjects(capacity=2)
    recent.seen(ref("a"))
    recent.seen(ref("b"))
    recent.seen(ref("a"))  # touch: "b" is now the oldest
    recent.seen(ref("c"))
    assert len(recent) == 2
    assert recent.seen(ref("a"))
    assert not recent.seen(ref("b"))


def test_stale_compares_sequencers_as_zero_padded_hex() -> None:
    recent = RecentObjects()
    assert not recent.stale(ref(sequencer="0055AED6DCD90281E5"))
    recent.seen(ref(sequencer="0055AED6DCD90281E5"))
    assert recent.stale(ref(etag="old", sequencer="55AED6DCD90281E4"))  # shorter, earlier
    assert not recent.stale(ref(etag="new", sequencer="0055AED6DCD90281F0"))
    assert not recent.stale(ref(etag="same", sequencer="55aed6dcd90281e5"))  # equal is not stale
    assert not recent.stale(ref("other.dcm", sequencer="00"))  # another key
    assert not recent.stale(ref(sequencer=None))
    assert not recent.stale(ref(sequencer="not-hex"))


def test_later_sequencer_replaces_earlier_and_not_the_reverse() -> None:
    recent = RecentObjects()
    recent.seen(ref(etag="b", sequencer="0B"))
    recent.seen(ref(etag="a", sequencer="0A"))  # late arrival of an older write
    assert recent.stale(ref(etag="a", sequencer="0A"))
    assert not recent.stale(ref(etag="b", sequencer="0B"))


def test_ceph_sequencers_are_not_ordered() -> None:
    recent = RecentObjects()
    recent.seen(ref(sequencer="FFFFFFFFFFFFFFFF", fmt="ceph"))
    assert not recent.stale(ref(etag="x", sequencer="0000000000000001", fmt="ceph"))
    assert recent.tracked_keys == 0


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="capacity"):
        RecentObjects(capacity=0)


@settings(max_examples=200, deadline=None)
@given(
    st.integers(min_value=1, max_value=8),
    st.lists(
        st.tuples(
            st.sampled_from("abcdefghij"),
            st.none() | st.sampled_from(["e1", "e2", "e3"]),
            st.none() | st.text("0123456789ABCDEF", min_size=1, max_size=4),
        ),
        max_size=60,
    ),
)
def test_recent_objects_stays_within_capacity(
    capacity: int, events: list[tuple[str, str | None, str | None]]
) -> None:
    recent = RecentObjects(capacity)
    for key, etag, sequencer in events:
        recent.stale(ref(key, etag=etag, sequencer=sequencer))
        recent.seen(ref(key, etag=etag, sequencer=sequencer))
        assert len(recent) <= capacity
        assert recent.tracked_keys <= capacity


# -- file:// notifications -------------------------------------------------------

ROOTS = (("archive", "/mnt/lustre/archive"), ("hot", "/mnt/lustre/archive/hot"))


def _file(url: str, **fields: Any) -> bytes:
    return json.dumps({"url": url, **fields}).encode()


def test_file_url_names_its_root_and_the_path_below_it() -> None:
    note = parse_notification(
        _file(
            "file:///mnt/lustre/archive/ct/CT%20slice%2B1%C3%A9.dcm",
            size=525312,
            etag="1a-2b-3c",
            time="2026-11-27T03:00:00Z",
        ),
        roots=ROOTS,
    )
    assert note.format == "file"
    assert note.objects == (
        ObjectRef(
            "archive",
            "ct/CT slice+1é.dcm",  # percent-decoded, and "+" stays a plus
            525312,
            "1a-2b-3c",
            None,
            None,
            "ObjectCreated:Put",
            "2026-11-27T03:00:00Z",
            format="file",
        ),
    )
    hot = _file("file://localhost/mnt/lustre/archive/hot/x.dcm")
    deepest = parse_notification(hot, roots=ROOTS)
    assert (deepest.objects[0].bucket, deepest.objects[0].key) == ("hot", "x.dcm")


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("file:///etc/passwd", "outside the configured file roots"),
        ("file:///mnt/lustre/archive", "outside the configured file roots"),  # the root itself
        ("file:///mnt/lustre/archive-2/x.dcm", "outside the configured file roots"),
        ("file:///mnt/lustre/archive/../../../etc/passwd", "plain segments"),
        ("file:///mnt/lustre/archive/%2E%2E/secret.dcm", "plain segments"),  # encoded ..
        ("file:///mnt/lustre/archive/ct/./a.dcm", "plain segments"),
        ("file:///mnt/lustre/archive//a.dcm", "plain segments"),
        ("file:///mnt/lustre/archive/a%00.dcm", "plain segments"),
        ("file:///mnt/lustre/archive/ct/", "plain segments"),
        ("file://other-host/mnt/lustre/archive/a.dcm", "of this host"),
        ("s3://bucket/key.dcm", "of this host"),
        ("file:///mnt/lustre/archive/a.dcm?x=1", "no query"),
        ("file:///mnt/lustre/archive/%FF.dcm", "not UTF-8"),
        ("file:///mnt/lustre/archive/" + "a" * 4100, "longer than"),
        ("file:mnt/lustre/archive/a.dcm", "plain segments"),
    ],
)
def test_file_urls_outside_the_roots_or_not_plain_are_refused(url: str, problem: str) -> None:
    with pytest.raises(NotificationError, match=problem) as raised:
        parse_notification(_file(url), roots=ROOTS)
    assert "lustre" not in str(raised.value)  # the message names the field, not the path


def test_file_urls_are_refused_without_roots() -> None:
    with pytest.raises(NotificationError, match="outside the configured file roots"):
        parse_notification(_file("file:///mnt/lustre/archive/a.dcm"))
