"""The one exception tree of dicom-ingest.

Every failure the pipeline knows about is an ``IngestError``. Each class says
whether trying again can help (``retriable``) and carries a short ``reason``
code that ends up in the dead-letter record and the audit event, and the
``step`` of an object's way where it happened (``STEPS``), which the
dead-letter record carries too: each class names its usual step, and the
pipeline marks the DICOM errors and limits it meets in the Pixel Data, after
the header, as ``decode`` (``ingest/pipeline/jobs.py``, ``decoding``). Foreign
exceptions (botocore, aiokafka, pydicom) are translated into this tree in one
place each (``fetch.translate_s3_error``, ``dicom.parse_header``), always with
``raise ... from``, so nothing outside those places looks at foreign types.

::

    IngestError
    ├── ConfigError                  bad settings; fails start-up
    ├── NotificationError            a Kafka record that is not a notification
    ├── SourceError                  reading the object from S3
    │   ├── SourceUnavailable        5xx, throttling, timeouts, resets    (retriable)
    │   │   └── TruncatedBody        fewer bytes than the range asked for (retriable)
    │   ├── ObjectNotFound           404 / NoSuchKey / NoSuchBucket
    │   ├── AccessDenied             403
    │   └── ObjectChanged            412: the ETag moved under us
    ├── DicomError                   the bytes are not DICOM we can process
    │   ├── NotDicom                 no DICOM preamble/meta, unparseable
    │   ├── MalformedDicom           lengths or sizes that lie
    │   └── UnsupportedDicom         a valid file we do not handle (yet)
    │       ├── DeflatedDataSet      parse_header's word for a Deflated object: inflate first
    │       └── MissingDecoder       its syntax's decoder is not installed (names the package)
    ├── LimitExceeded                the input asks for more than our bounds allow
    ├── ProcessingError              the GPU/CPU preprocessing stage failed
    ├── SinkError                    writing outputs / results        (retriable)
    │   └── LayoutRefused            the object cannot take the output layout asked for
    ├── BrokerError                  Kafka unreachable, timing out    (retriable)
    │   └── BrokerRejected           Kafka refused for good (size, authorization)
    └── KeyServiceError              KMS or the keyring gave no data key  (retriable)
        └── KeyRefused               refused for good: denied, wrong context, unknown key
"""

from __future__ import annotations

from typing import ClassVar, Final

STEPS: Final = ("notification", "get", "parse", "decode", "sink", "publish", "audit", "config")
"""Where an error happened: reading the Kafka record, a GET from the source, the
header, the Pixel Data (decoding and the device's preprocessing), writing outputs,
producing results or dead letters, the audit trail (keys), the settings."""


class IngestError(Exception):
    """Base of every error dicom-ingest raises on purpose."""

    retriable: ClassVar[bool] = False
    reason: ClassVar[str] = "error"
    step: str = "decode"  # one of STEPS: the class's usual one, or what the pipeline saw
    attempts: int = 1  # set by the retry policy when it gives up


class ConfigError(IngestError):
    """A setting is missing or invalid; the message names the variable."""

    reason = "config"
    step = "config"


class NotificationError(IngestError):
    """A Kafka record could not be read as an S3 object notification."""

    reason = "bad_notification"
    step = "notification"


class SourceError(IngestError):
    """Reading the source object failed."""

    reason = "source"
    step = "get"


class SourceUnavailable(SourceError):
    """A transient S3 failure: server error, throttling, timeout, reset."""

    retriable = True
    reason = "source_unavailable"


class TruncatedBody(SourceUnavailable):
    """A ranged GET returned fewer bytes than asked for; never taken as data."""

    reason = "truncated_body"


class ObjectNotFound(SourceError):
    """The bucket or key does not exist (404)."""

    reason = "not_found"


class AccessDenied(SourceError):
    """The credentials may not read the object (403)."""

    reason = "access_denied"


class ObjectChanged(SourceError):
    """The object's ETag changed while we were reading it (412 on If-Match)."""

    reason = "object_changed"


class DicomError(IngestError):
    """The object is not DICOM this worker can process."""

    reason = "dicom"
    step = "parse"


class NotDicom(DicomError):
    """The bytes do not parse as DICOM at all."""

    reason = "not_dicom"


class MalformedDicom(DicomError):
    """The header parses but contradicts itself or the object (lengths, sizes)."""

    reason = "malformed_dicom"


class UnsupportedDicom(DicomError):
    """Valid DICOM that this version does not process (e.g. a compressed syntax)."""

    reason = "unsupported_dicom"


class MissingDecoder(UnsupportedDicom):
    """The object's transfer syntax decodes with a plugin this installation leaves out
    (``pylibjpeg-libjpeg``, GPL-3.0, is the extra ``gpl``): the message names the package;
    once installed, ``dicom-ingest dlq replay --reason missing_decoder`` redoes them."""

    reason = "missing_decoder"


class DeflatedDataSet(UnsupportedDicom):
    """A Deflated Explicit VR Little Endian object, told apart by ``parse_header`` from its
    file meta: the stored bytes from ``data_set_offset`` on are one deflate stream, which
    that parser of stored bytes does not read. ``ingest/pipeline/inflated.py`` inflates
    them and reads the header of what comes out; a caller that does not inflate
    dead-letters the object as unsupported."""

    def __init__(self, message: str, data_set_offset: int) -> None:
        super().__init__(message)
        self.data_set_offset = data_set_offset

    def __reduce__(self) -> tuple[type[DeflatedDataSet], tuple[str, int]]:
        return type(self), (str(self), self.data_set_offset)  # picklable with its offset


class LimitExceeded(IngestError):
    """The input asks for more memory or work than the configured bounds allow."""

    reason = "limit_exceeded"
    step = "parse"


class ProcessingError(IngestError):
    """The preprocessing stage (GPU or its NumPy twin) failed."""

    reason = "processing"
    step = "decode"


class SinkError(IngestError):
    """Writing an output object, sidecar or result event failed."""

    retriable = True
    reason = "sink"
    step = "sink"


class LayoutRefused(SinkError):
    """The object cannot be written in the output layout the settings ask for (a slide
    whose tiles do not make one grid, as ``SLIDE_LAYOUT=ome-zarr`` needs); the message
    says why. Trying again gives the same answer; with another layout it would be written."""

    retriable = False
    reason = "layout_refused"


class BrokerError(IngestError):
    """Producing to or committing on Kafka failed."""

    retriable = True
    reason = "broker"
    step = "publish"


class BrokerRejected(BrokerError):
    """The broker answered with a non-retriable error (message too large, not authorized)."""

    retriable = False
    reason = "broker_rejected"


class KeyServiceError(IngestError):
    """The key service (KMS or the keyring) did not give or unwrap a data key."""

    retriable = True
    reason = "audit_key_service"
    step = "audit"


class KeyRefused(KeyServiceError):
    """The key service refused for good: access denied, a wrong context, an unknown key."""

    retriable = False
    reason = "audit_key_refused"
