"""Pure parsing of S3 object notifications carried by Kafka records.

One topic may carry JSON from four producers; ``parse_notification`` turns the
bytes of one record value into the objects it announces, or raises
``NotificationError`` (and nothing else) so the worker can dead-letter it.
``RecentObjects`` drops repeats and late, superseded notifications.

Facts this module relies on, and the choices made where producers differ:

- AWS S3 (``eventSource: aws:s3``) form-encodes object keys: space is ``+``,
  ``+`` is ``%2B``, UTF-8 bytes are ``%XX``; decoded with ``unquote_plus``.
- MinIO (``minio:s3``, top-level ``EventName``/``Key``) prefixes event names
  with ``s3:`` and encodes keys with Go's ``url.QueryEscape`` (``/`` becomes
  ``%2F`` too), which ``unquote_plus`` also undoes. MinIO files tag, retention
  and legal-hold changes under ``ObjectCreated:*``; they create no new content
  and are skipped.
- EventBridge (``source: aws.s3``, ``detail-type: Object Created``): AWS's docs
  do not state the key encoding; AWS's own Lambda Powertools decodes
  ``detail.object.key`` with ``unquote_plus``, so we do the same. This is the
  least certain of these facts; check it against a real event.
- Ceph RGW (``ceph:s3``) writes ``s3.object.key`` as the raw object name
  (``rgw_pubsub_s3_event::dump`` encodes ``obj->get_name()`` unescaped), so
  Ceph keys are NOT URL-decoded: decoding would corrupt keys holding ``+`` or
  ``%``. Some releases spell ``eTag`` as ``etag``; its docs show ``size`` as a
  string. Its ``sequencer`` is the hex of a little-endian ``utime_t``, which
  does not sort by time, so Ceph sequencers are never used for ordering.
- ``file://`` notifications (``{"url": "file:///mnt/archive/ct/1.dcm", ...}``, our own
  format, written by ``dicom-ingest backfill`` and by users' scripts) name a file on
  a mounted file system. Its URL path is percent-encoded (RFC 8089); the file must
  lie under one of the configured roots (``NAME=PATH``) by its path's words alone:
  no ``.``, ``..`` or empty segment, and a root's path as a prefix. The object is
  then ``NAME`` (as its bucket) and the path below the root (as its key). Where
  its symbolic links lead is checked when it is opened (``ingest/fetch/files.py``).
- Error messages name the field, never its value: keys may hold patient data.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, unquote_plus, urlsplit

from ingest.errors import NotificationError

MAX_NOTIFICATION_BYTES = 1 << 20
MAX_KEY_BYTES = 1024  # S3's limit on a key, in UTF-8 bytes
MAX_OBJECT_SIZE = (1 << 63) - 1  # beyond any S3 object; keeps sizes in int64
MAX_TOKEN_CHARS = 1024
MAX_PATH_BYTES = 4096  # Linux's PATH_MAX
FILE_FORMAT = "file"  # ``ObjectRef.format`` of an object on a file system

# Legacy us-east-1 names (up to 255 of letters, digits, '.', '_', '-') are a
# superset of today's DNS-style rules; old buckets still exist, so accept them.
_BUCKET_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{2,254}")
_IPV4_RE = re.compile(r"[0-9]{1,3}(?:\.[0-9]{1,3}){3}")
# ETags, version ids and sequencers end up in HTTP headers and query strings:
# printable ASCII without space, quote or backslash.
_TOKEN_RE = re.compile(r"[\x21\x23-\x5b\x5d-\x7e]+")
_HEX_RE = re.compile(r"[0-9A-Fa-f]+")
_DIGITS_RE = re.compile(r"[0-9]{1,19}")

_RECORD_SOURCES = {"aws:s3": "aws", "minio:s3": "minio", "ceph:s3": "ceph"}
_METADATA_ONLY = frozenset(
    f"ObjectCreated:{what}"
    for what in ("PutTagging", "DeleteTagging", "PutRetention", "PutLegalHold")
)
_EVENTBRIDGE_REASONS = {
    "PutObject": "Put",
    "POST Object": "Post",
    "CopyObject": "Copy",
    "CompleteMultipartUpload": "CompleteMultipartUpload",
}


@dataclass(frozen=True, slots=True)
class ObjectRef:
    """One object version a notification announces; the key is decoded."""

    bucket: str
    key: str
    size: int | None
    etag: str | None  # without quotes
    version_id: str | None
    sequencer: str | None
    event_name: str  # normalised: "ObjectCreated:Put", never with the "s3:" prefix
    event_time: str | None
    format: str = "aws"  # the producer (``FILE_FORMAT``: a file system; bucket = root name)


@dataclass(frozen=True, slots=True)
class Notification:
    """What one Kafka record announced."""

    format: str  # "aws" | "minio" | "eventbridge" | "ceph" | "file" | "test-event"
    objects: tuple[ObjectRef, ...]
    skipped: int  # records that were not object-created events


def parse_notification(
    value: bytes | None,
    *,
    max_bytes: int = MAX_NOTIFICATION_BYTES,
    roots: tuple[tuple[str, str], ...] = (),
) -> Notification:
    """Read one Kafka record value as an object notification; ``roots`` are the
    (name, path) pairs ``file://`` URLs may lie under (none: every one is refused).

    Raises:
        NotificationError: for anything that is not a well-formed notification
            of a known format; no other exception escapes, whatever the bytes.
    """
    doc = _load(value, max_bytes)
    if "Records" in doc:
        return _parse_records(doc)
    if "detail-type" in doc:
        return _parse_eventbridge(doc)
    if "url" in doc:
        return _parse_file(doc, roots)
    if doc.get("Event") == "s3:TestEvent":
        return Notification("test-event", (), 0)
    raise _error("", "unknown notification format")


def _load(value: object, max_bytes: int) -> dict[str, Any]:
    if not isinstance(value, bytes | bytearray) or not value:
        raise _error("", "record value is missing or empty")
    if len(value) > max_bytes:  # before decoding: memory stays bounded
        raise _error("", f"record value of {len(value)} bytes exceeds {max_bytes}")
    try:
        text = bytes(value).decode("utf-8")
    except UnicodeDecodeError:
        raise _error("", "record value is not UTF-8") from None
    try:
        doc = json.loads(text)
    except RecursionError:
        raise _error("", "JSON nested too deeply") from None
    except ValueError:  # JSONDecodeError, or an integer past int's digit limit
        raise _error("", "record value is not JSON") from None
    if not isinstance(doc, dict):
        raise _error("", "JSON is not an object")
    return doc


def _parse_records(doc: dict[str, Any]) -> Notification:
    records = doc["Records"]
    if not isinstance(records, list) or not records:
        raise _error("Records", "not a non-empty list")
    sources: set[str] = set()
    for i, record in enumerate(records):
        if not isinstance(record, dict):
            raise _error(f"Records[{i}]", "not an object")
        source = _req_str(record, "eventSource", f"Records[{i}]")
        if source not in _RECORD_SOURCES:
            raise _error(f"Records[{i}].eventSource", "unknown event source")
        sources.add(_RECORD_SOURCES[source])
    if len(sources) > 1:
        raise _error("Records", "records from more than one event source")
    fmt = sources.pop()
    if fmt == "aws" and "EventName" in doc:
        fmt = "minio"  # MinIO-compatible servers that call themselves aws:s3
    objects = []
    for i, record in enumerate(records):
        path = f"Records[{i}]"
        name = _req_str(record, "eventName", path).removeprefix("s3:")
        if name.startswith("ObjectCreated:") and name not in _METADATA_ONLY:
            objects.append(_record_object(record, path, fmt, name))
    return Notification(fmt, tuple(objects), len(records) - len(objects))


def _record_object(record: dict[str, Any], path: str, fmt: str, name: str) -> ObjectRef:
    s3 = _req_obj(record, "s3", path)
    bucket = _req_obj(s3, "bucket", f"{path}.s3")
    obj = _req_obj(s3, "object", f"{path}.s3")
    opath = f"{path}.s3.object"
    etag_field = "etag" if fmt == "ceph" and "eTag" not in obj else "eTag"
    return ObjectRef(
        bucket=_bucket(bucket, f"{path}.s3.bucket"),
        key=_key(obj, opath, url_encoded=fmt != "ceph"),
        size=_opt_size(obj, opath),
        etag=_opt_token(obj, etag_field, opath, etag=True),
        version_id=_opt_token(obj, "versionId", opath),
        sequencer=_opt_token(obj, "sequencer", opath),
        event_name=name,
        event_time=_opt_str(record, "eventTime", path),
        format=fmt,
    )


def _parse_eventbridge(doc: dict[str, Any]) -> Notification:
    if doc.get("source") != "aws.s3":
        raise _error("source", "EventBridge event not from aws.s3")
    if _req_str(doc, "detail-type", "") != "Object Created":
        return Notification("eventbridge", (), 1)
    detail = _req_obj(doc, "detail", "")
    obj = _req_obj(detail, "object", "detail")
    reason = _opt_str(detail, "reason", "detail")
    ref = ObjectRef(
        bucket=_bucket(_req_obj(detail, "bucket", "detail"), "detail.bucket"),
        key=_key(obj, "detail.object", url_encoded=True),
        size=_opt_size(obj, "detail.object"),
        etag=_opt_token(obj, "etag", "detail.object", etag=True),
        version_id=_opt_token(obj, "version-id", "detail.object"),
        sequencer=_opt_token(obj, "sequencer", "detail.object"),
        event_name="ObjectCreated:" + _EVENTBRIDGE_REASONS.get(reason or "", "*"),
        event_time=_opt_str(doc, "time", ""),
        format="eventbridge",
    )
    return Notification("eventbridge", (ref,), 0)


def _parse_file(doc: dict[str, Any], roots: tuple[tuple[str, str], ...]) -> Notification:
    bucket, key = file_object(_req_str(doc, "url", ""), roots)
    ref = ObjectRef(
        bucket=bucket,
        key=key,
        size=_opt_size(doc, ""),
        etag=_opt_token(doc, "etag", ""),
        version_id=None,
        sequencer=None,
        event_name="ObjectCreated:Put",
        event_time=_opt_str(doc, "time", ""),
        format=FILE_FORMAT,
    )
    return Notification(FILE_FORMAT, (ref,), 0)


def file_object(url: str, roots: tuple[tuple[str, str], ...]) -> tuple[str, str]:
    """(root name, path below the root) of a ``file://`` URL, by its words alone.

    Raises:
        NotificationError: not a ``file://`` URL of an absolute, plain path (no ``.``,
            ``..`` or empty segment, no NUL) under one of ``roots``.
    """
    parts = urlsplit(url)
    if parts.scheme != "file" or parts.netloc not in ("", "localhost"):
        raise _error("url", "not a file:// URL of this host")
    if parts.query or parts.fragment:
        raise _error("url", "a file:// URL has no query or fragment")
    try:
        path = unquote(parts.path, errors="strict")
        size = len(path.encode("utf-8"))
    except UnicodeError:
        raise _error("url", "not UTF-8 once percent-decoded") from None
    if size > MAX_PATH_BYTES:
        raise _error("url", f"path longer than {MAX_PATH_BYTES} bytes")
    segments = path.split("/")
    if segments[0] or "\x00" in path or any(s in ("", ".", "..") for s in segments[1:]):
        raise _error("url", "not an absolute path of plain segments")
    for name, root in sorted(roots, key=lambda r: -len(r[1])):  # the deepest root first
        prefix = root.rstrip("/") + "/"
        if path.startswith(prefix):
            key = path[len(prefix) :]
            if len(key.encode("utf-8")) > MAX_KEY_BYTES:
                raise _error("url", f"path below its root longer than {MAX_KEY_BYTES} bytes")
            return name, key
    raise _error("url", "outside the configured file roots")


# -- field readers: each names the field it rejects, never the value ----------


def _error(path: str, problem: str) -> NotificationError:
    return NotificationError(f"{path}: {problem}" if path else problem)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _req_obj(parent: dict[str, Any], name: str, path: str) -> dict[str, Any]:
    value = parent.get(name)
    if not isinstance(value, dict):
        raise _error(_join(path, name), "missing or not an object")
    return value


def _req_str(parent: dict[str, Any], name: str, path: str) -> str:
    value = _opt_str(parent, name, path)
    if value is None:
        raise _error(_join(path, name), "missing or empty")
    return value


def _opt_str(parent: dict[str, Any], name: str, path: str) -> str | None:
    """A string field; absent, null and "" all mean None (Ceph sends "" for unset)."""
    value = parent.get(name)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise _error(_join(path, name), "not a string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates from a JSON \uD800 escape
        raise _error(_join(path, name), "not valid Unicode") from None
    return value


def _opt_token(parent: dict[str, Any], name: str, path: str, *, etag: bool = False) -> str | None:
    value = _opt_str(parent, name, path)
    if etag and value is not None and len(value) >= 2 and value[0] == value[-1] == '"':
        value = value[1:-1] or None
    if value is not None and (len(value) > MAX_TOKEN_CHARS or not _TOKEN_RE.fullmatch(value)):
        raise _error(_join(path, name), "not a printable ASCII token")
    return value


def _opt_size(parent: dict[str, Any], path: str) -> int | None:
    value = parent.get("size")
    if value is None:
        return None
    if isinstance(value, str) and _DIGITS_RE.fullmatch(value):
        value = int(value)  # Ceph's documentation shows the size as a string
    if isinstance(value, bool) or not isinstance(value, int):
        raise _error(f"{path}.size", "not an integer")
    if value < 0:
        raise _error(f"{path}.size", "negative")
    if value > MAX_OBJECT_SIZE:
        raise _error(f"{path}.size", "larger than any S3 object")
    return value


def _bucket(parent: dict[str, Any], path: str) -> str:
    name = _req_str(parent, "name", path)
    if not _BUCKET_RE.fullmatch(name) or ".." in name or _IPV4_RE.fullmatch(name):
        raise _error(f"{path}.name", "not a valid S3 bucket name")
    return name


def _key(parent: dict[str, Any], path: str, *, url_encoded: bool) -> str:
    raw = _req_str(parent, "key", path)
    try:
        key = unquote_plus(raw, errors="strict") if url_encoded else raw
        size = len(key.encode("utf-8"))
    except UnicodeError:
        raise _error(f"{path}.key", "not UTF-8 once URL-decoded") from None
    if size > MAX_KEY_BYTES:
        raise _error(f"{path}.key", f"longer than {MAX_KEY_BYTES} bytes of UTF-8")
    return key


# -- repeats and order ---------------------------------------------------------


def object_identity(ref: ObjectRef) -> tuple[str, str, str, str] | None:
    """(bucket, key, kind, token) naming one object version; None when nothing names it."""
    for kind, token in (("v", ref.version_id), ("e", ref.etag), ("s", ref.sequencer)):
        if token is not None:
            return (ref.bucket, ref.key, kind, token)
    return None


def _sequencer_order(ref: ObjectRef) -> int | None:
    """AWS: left-pad the shorter sequencer with zeros, then compare as strings.

    For hex digits of one case that is the order of the values, so compare
    ``int(s, 16)``; the regex keeps ``int`` from taking "0x", "_" or spaces.
    MinIO's sequencer (hex of the event's UnixNano) orders the same way.
    """
    seq = ref.sequencer
    if seq is None or ref.format == "ceph" or not _HEX_RE.fullmatch(seq):
        return None
    return int(seq, 16)


class RecentObjects:
    """Bounded memory of object versions this worker has already handled, to drop repeats
    (S3 notifications can repeat and arrive out of order). LRU with a fixed capacity.

    Call ``stale`` before ``seen``: ``seen`` records the object, ``stale`` only asks.
    Both the identities and the latest sequencer per (bucket, key) are capped at
    ``capacity`` entries, least recently used first out.
    """

    def __init__(self, capacity: int = 100_000) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self._capacity = capacity
        self._seen: OrderedDict[tuple[str, str, str, str], None] = OrderedDict()
        self._latest: OrderedDict[tuple[str, str], int] = OrderedDict()

    @property
    def tracked_keys(self) -> int:
        """How many (bucket, key) pairs have a latest sequencer remembered."""
        return len(self._latest)

    def __len__(self) -> int:
        return len(self._seen)

    def seen(self, ref: ObjectRef) -> bool:
        """True if this object version was recorded before; records it otherwise.

        The identity is (bucket, key, version_id or etag or sequencer). A ref
        with none of the three cannot be told from another write of the same
        key, so it is never called a repeat (outputs are idempotent anyway).
        """
        self._note_sequencer(ref)
        ident = object_identity(ref)
        if ident is None:
            return False
        if ident in self._seen:
            self._seen.move_to_end(ident)
            return True
        self._seen[ident] = None
        if len(self._seen) > self._capacity:
            self._seen.popitem(last=False)
        return False

    def contains(self, ref: ObjectRef) -> bool:
        """True if this version was recorded; records nothing (notes its sequencer)."""
        self._note_sequencer(ref)
        ident = object_identity(ref)
        return ident is not None and ident in self._seen

    def stale(self, ref: ObjectRef) -> bool:
        """True when a later sequencer for the same bucket/key was already recorded."""
        order = _sequencer_order(ref)
        if order is None:
            return False
        latest = self._latest.get((ref.bucket, ref.key))
        return latest is not None and latest > order

    def _note_sequencer(self, ref: ObjectRef) -> None:
        order = _sequencer_order(ref)
        if order is None:
            return
        where = (ref.bucket, ref.key)
        previous = self._latest.get(where)
        if previous is None or order > previous:
            self._latest[where] = order
        self._latest.move_to_end(where)
        if len(self._latest) > self._capacity:
            self._latest.popitem(last=False)
