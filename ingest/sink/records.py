"""Pure builders of the JSON documents the worker emits (their fields: docs/output.md).

The sidecar and the result event are the same document. The dead-letter
record carries the original Kafka record so nothing is lost: its value as
UTF-8 text when it is text, else base64, cut to ``MAX_DLQ_VALUE`` bytes (with
the full length and SHA-256) so a huge bad message cannot make a huge DLQ
message.
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from ingest.audit.records import AuditEvent
from ingest.dicom.codec import conversions
from ingest.dicom.header import DicomHeader
from ingest.errors import IngestError
from ingest.fetch.digest import Digests
from ingest.fetch.s3 import ObjectHead
from ingest.source.notifications import ObjectRef

MAX_DLQ_VALUE = 256 * 1024


@dataclass(slots=True)
class Timings:
    first_get_s: float = 0.0  # the first GET (it also tells size and ETag: no HEAD)
    parse_s: float = 0.0  # until the reads can start (a large object's layout)
    device_s: float = 0.0  # the Pixel Data's reads, device work and outputs
    total_s: float = 0.0
    started_at: float = 0.0  # perf_counter() as this read of the object began (this process)


@dataclass(slots=True)
class Processed:
    """What the worker needs to write the sidecar, the result event and the audit record."""

    ref: ObjectRef
    head: ObjectHead
    header: DicomHeader
    digests: Digests  # of the source bytes, under ``source_hash``
    backend: str
    output_key: str
    sidecar_key: str
    timings: Timings = field(default_factory=Timings)
    layout: str = "npy"  # of ``output_key``: "npy", or "ome-zarr" (a slide's image root)


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def sidecar(
    done: Processed, window: tuple[float, float] | None, dtype: str, written: bool = True
) -> dict[str, Any]:
    """The sidecar JSON, also published on the results topic (``output`` null with no sink)."""
    h = done.header
    t = done.timings
    g = h.geometry
    return {
        "source": {
            "bucket": done.ref.bucket,
            "key": done.ref.key,
            "version_id": done.head.version_id,
            "etag": done.head.etag,
            "size": done.head.size,
            "sha256": done.digests.sha256,
            "sha256_tree": done.digests.sha256_tree,
            "crc64nvme": done.digests.crc64nvme,
        },
        "output": _outputs(done) if written else None,
        "study_instance_uid": h.study_instance_uid,
        "series_instance_uid": h.series_instance_uid,
        "sop_instance_uid": h.sop_instance_uid,
        "modality": h.modality,
        "transfer_syntax_uid": h.transfer_syntax_uid,
        "photometric_interpretation": h.photometric_interpretation,
        # what turned the stored samples into pixel_array's values (empty: none needed)
        "conversions": list(conversions(h.codec)) if h.codec is not None else [],
        "slide": h.slide.as_json() if h.slide is not None else None,
        "geometry": h.geometry.as_json() if h.geometry is not None else None,
        "instance": {  # where the object sits in its series (what a series assembly reads)
            "instance_number": g.instance_number if g else None,
            "acquisition_number": g.acquisition_number if g else None,
            "images_in_acquisition": g.images_in_acquisition if g else None,
            "number_of_slices": g.number_of_slices if g else None,
            "number_of_time_slices": g.number_of_time_slices if g else None,
            "number_of_time_slots": g.number_of_time_slots if g else None,
        },
        "shape": list(h.pixel.shape),
        "dtype": dtype,
        "window": list(window) if window else None,
        "rescale": {
            "applied": h.rescale,
            "slopes": list(h.transform_slopes),
            "intercepts": list(h.transform_intercepts),
        },
        "backend": done.backend,
        "timings": {
            "first_get_s": round(t.first_get_s, 6),
            "parse_s": round(t.parse_s, 6),
            "device_s": round(t.device_s, 6),
            "total_s": round(t.total_s, 6),
        },
    }


def _outputs(done: Processed) -> dict[str, str | None]:
    zarr = done.layout == "ome-zarr"
    return {
        "npy": None if zarr else done.output_key,
        "zarr": done.output_key if zarr else None,
        "json": done.sidecar_key,
    }


def record_summary(
    topic: str, partition: int, offset: int, timestamp: int | None, value: bytes | None
) -> dict[str, Any]:
    """The original Kafka record, as the DLQ carries it."""
    raw = value or b""
    shown = raw[:MAX_DLQ_VALUE]
    try:
        text, encoding = shown.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        text, encoding = base64.b64encode(shown).decode(), "base64"
    return {
        "topic": topic,
        "partition": partition,
        "offset": offset,
        "timestamp": timestamp,
        "value": text,
        "value_encoding": encoding,
        "value_bytes": len(raw),
        "value_truncated": len(raw) > MAX_DLQ_VALUE,
        "value_sha256": hashlib.sha256(raw).hexdigest(),
    }


def dead_letter(
    record: dict[str, Any], ref: ObjectRef | None, error: IngestError, worker: str
) -> dict[str, Any]:
    """The dead-letter document: original record, object, and what went wrong: the error's
    type, reason, step (``errors.STEPS``), message (the type's description when it has
    none) and the attempts made."""
    return {
        "record": record,
        "bucket": ref.bucket if ref else None,
        "key": ref.key if ref else None,
        "version_id": ref.version_id if ref else None,
        "etag": ref.etag if ref else None,
        "error_type": type(error).__name__,
        "reason": error.reason,
        "step": error.step,
        "error": str(error) or _first_line(type(error).__doc__) or type(error).__name__,
        "retriable": error.retriable,
        "attempts": error.attempts,
        "worker": worker,
        "time": _now(),
    }


def _first_line(text: str | None) -> str:
    return (text or "").strip().split("\n", 1)[0]


def success_event(done: Processed) -> AuditEvent:
    h = done.header
    return AuditEvent(
        event="object.processed",
        outcome="success",
        bucket=done.ref.bucket,
        key=done.ref.key,
        etag=done.head.etag,
        version_id=done.head.version_id,
        study_instance_uid=h.study_instance_uid,
        series_instance_uid=h.series_instance_uid,
        sop_instance_uid=h.sop_instance_uid,
        sop_class_uid=h.sop_class_uid,
        patient_id=h.patient_id,
        outputs=(done.output_key, done.sidecar_key),
    )


def failure_event(ref: ObjectRef | None, error: IngestError) -> AuditEvent:
    return AuditEvent(
        event="object.dead_lettered" if ref else "notification.dead_lettered",
        outcome="failure",
        bucket=ref.bucket if ref else "",
        key=ref.key if ref else "",
        etag=ref.etag if ref else None,
        version_id=ref.version_id if ref else None,
        reason=error.reason,
        error=type(error).__name__,
        attempts=error.attempts,
    )
