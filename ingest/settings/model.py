"""Every setting the worker reads, each declared once: a field of ``Settings``.

A field's name is its variable's without the ``DICOM_INGEST_`` prefix, its type
is its value's, and ``contract``, ``tuning`` or ``security`` (``kinds.py``) give
its default, the kind of its value (how it is parsed, its bounds or choices)
and what it does, for the loader (``ingest/settings/__init__.py``) and
docs/configuration.md (``ingest/ops/config_doc.py``). Fields are listed in the
documentation in the order they are declared here.
"""

# Each default is a dataclasses.Field made by contract(), tuning() or security(), whose
# own default is immutable; ruff cannot see through those helpers.
# ruff: noqa: RUF009

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Final, Literal
from urllib.parse import urlparse

from ingest.settings.kinds import (
    AES_KEY,
    ANY_TEXT,
    ENDPOINT,
    FILE,
    FILE_ROOTS,
    FLAG,
    FOLDER,
    METADATA,
    OPTIONAL_TEXT,
    S3_URL,
    SECRET_TEXT,
    TEXT,
    WINDOW,
    Setting,
    contract,
    integer,
    number,
    one_of,
    security,
    tuning,
)

PREFIX: Final = "DICOM_INGEST_"
KiB: Final = 1024
MiB: Final = 1024 * KiB
GiB: Final = 1024 * MiB

Device = Literal["auto", "cuda", "cpu"]
OutputDtype = Literal["float32", "float16", "exact"]
Sink = Literal["s3", "none"]
Series = Literal["off", "volume"]
SeriesSlices = Literal["write", "hold"]
SeriesFormat = Literal["npy", "nifti", "both"]
SlideLayout = Literal["tiles", "ome-zarr"]
SourceHash = Literal["crc64nvme", "sha256", "sha256-tree", "none"]
GpuDecode = Literal["auto", "off"]
GpuJpegDecoder = Literal["auto", "hardware", "cuda"]
FileReader = Literal["auto", "kvikio", "posix"]
LogFormat = Literal["auto", "json", "console"]
KafkaProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
SaslMechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"]
OutputSse = Literal["none", "AES256", "aws:kms"]
Posture = Literal["development", "production"]


@dataclass(frozen=True, slots=True)
class Settings:
    """Validated configuration. Field names are the variable names without the prefix."""

    kafka_bootstrap: str = contract("", TEXT, "bootstrap servers, comma separated", required=True)
    output_url: str = contract("", S3_URL, "`s3://bucket/prefix/` for outputs", required=True)
    audit_key: bytes = contract(
        b"",
        AES_KEY,
        (
            "base64 of a 32-byte AES key used directly (development, `make demo`); exactly one of"
            " `AUDIT_KEY`, `AUDIT_KEYRING_FILE`, `AUDIT_KMS_KEY_ID` must be set"
        ),
        secret=True,
    )
    source_topic: str = contract("s3-events", TEXT, "topic of S3 notifications")
    group_id: str = contract("dicom-ingest", TEXT, "consumer group")
    results_topic: str = contract("dicom-ingest.results", TEXT, "one message per processed object")
    dlq_topic: str = contract("dicom-ingest.dlq", TEXT, "one message per object given up on")
    audit_topic: str = contract("dicom-ingest.audit", TEXT, "encrypted audit events")
    s3_endpoint_url: str | None = contract(None, ENDPOINT, "S3 endpoint; unset means AWS")
    window: tuple[float, float] | None = contract(
        None, WINDOW, "`none`, or `CENTER,WIDTH` (width >= 1)"
    )
    output_dtype: OutputDtype = contract(
        "float32",
        one_of(OutputDtype),
        (
            "`float32`, `float16`, or `exact`: each object's values in the narrowest type that"
            " holds them exactly (8-bit stays `uint8`, CT `int16`; docs/output.md)"
        ),
    )
    slide_layout: SlideLayout = contract(
        "tiles",
        one_of(SlideLayout),
        (
            "how a tiled whole-slide image is written: `tiles`, its frames as one `.npy` like"
            " any object's; `ome-zarr`, its whole matrix as an OME-Zarr image (NGFF 0.4, Zarr"
            " v2; level 0, a chunk a tile) at `.zarr` in place of the `.npy` (docs/output.md)."
            " `tiles` by default: what today's consumers read, in fewer requests to S3"
        ),
    )
    series: Series = contract(
        "off",
        one_of(Series),
        (
            "`volume` also writes each series' slices as one volume with its affine, once the"
            " data says the series is complete or after `SERIES_QUIET_S` (docs/output.md);"
            " `off` by default: it reads every slice back and writes it again"
        ),
    )
    series_quiet_s: float = contract(
        60.0,
        number(0.1, 86400.0),
        "seconds after a series' last slice before its volume is written without a count",
    )
    series_slices: SeriesSlices = contract(
        "write",
        one_of(SeriesSlices),
        (
            "with `SERIES=volume`: `write` writes every slice's own `.npy` as well (the"
            " default: each slice stays an output of its own); `hold` keeps a series' slices"
            " in memory and writes only its volume, their offsets committed once it is"
            " durable (docs/output.md)"
        ),
    )
    series_format: SeriesFormat = contract(
        "npy",
        one_of(SeriesFormat),
        "a series volume as `npy` (+ JSON sidecar), `nifti` (`.nii.gz`, RAS affine) or `both`",
    )
    series_memory: int = contract(
        1 * GiB,
        integer(0, 1024 * GiB),
        (
            "bytes of slices a worker keeps in memory for its series' volumes (written from"
            " there, not read back); a slice past it is written (and read back) as without it"
        ),
    )
    device: Device = contract("auto", one_of(Device), "`auto`, `cuda`, `cpu`")
    file_roots: tuple[tuple[str, str], ...] = contract(
        (),
        FILE_ROOTS,
        (
            "folders of a mounted file system that `file://` notifications may name, as "
            "`NAME=PATH,...`; a file's outputs are keyed as if NAME were its bucket and its path "
            "below PATH its key; a path outside every root is refused (docs/operations.md)"
        ),
    )
    audit_key_id: str = tuning("local-1", TEXT, "the `kid` written into every audit envelope")
    sink: Sink = tuning(
        "s3",
        one_of(Sink),
        "`s3` writes `.npy` + sidecar; `none` writes nothing (a hook has the arrays)",
    )
    source_hash: SourceHash = tuning(
        "crc64nvme",
        one_of(SourceHash),
        (
            "the digest of the source bytes in the sidecar's `source`: `crc64nvme` (the CRC64NVME"
            " S3 stores), `sha256`, `sha256-tree` (S3 Glacier's tree hash) or `none`"
        ),
    )
    hook: str | None = tuning(
        None,
        OPTIONAL_TEXT,
        ("`module:callable` given every output chunk on the device thread (see `ingest/hooks.py`)"),
    )
    file_reader: FileReader = tuning(
        "auto",
        one_of(FileReader),
        (
            "how files are read into the ring: `kvikio` (KvikIO, GPUDirect Storage where the "
            "file system and driver support it), `posix` (`preadv` in the read threads), `auto`:"
            " `kvikio` on a CUDA device with KvikIO installed, else `posix`"
        ),
    )
    series_hook: str | None = tuning(
        None,
        OPTIONAL_TEXT,
        (
            "`module:callable` given each series volume on the device thread, a slab of"
            " slices at a time (`SERIES=volume`; see `ingest/hooks.py`)"
        ),
    )
    part_size: int = tuning(
        32 * MiB, integer(64 * KiB, GiB), "byte-range size and ring slot size (multiple of 64 KiB)"
    )
    ring_slots: int = tuning(
        24,
        integer(2, 4096),
        "slots in the pinned ring; host memory = slots x part size (768 MiB by default)",
    )
    fetch_concurrency: int = tuning(
        16,
        integer(1, 512),
        (
            "ranged GETs in flight, all objects together: the GET threads, each of which takes "
            "the next queued range as it finishes one. A GET of up to 1 MiB (a slice, a "
            "header probe, a short last range) runs on the event loop instead, where as many "
            "may be under way besides"
        ),
    )
    max_objects_in_flight: int = tuning(
        64,
        integer(1, 4096),
        (
            "objects processed at once (backpressure on Kafka); each holds a ring slot (or a 1 "
            "MiB small slot) while it is read, so the ring bounds the bytes"
        ),
    )
    batch_max_objects: int = tuning(16, integer(1, 1024), "chunks per device batch")
    batch_max_bytes: int = tuning(
        128 * MiB,
        integer(MiB, 16 * GiB),
        "source bytes per device batch (a larger chunk goes alone)",
    )
    batch_wait_ms: float = tuning(
        0.0,
        number(0.0, 10_000.0),
        (
            "extra time a batch waits to fill after its first chunk. With 0 it leaves as soon as "
            "the device thread can take it, and batches fill while the device is busy; a fixed "
            "wait only delays the device"
        ),
    )
    gil_switch_ms: float = tuning(
        0.5,
        number(0.1, 100.0),
        (
            "`sys.setswitchinterval` of the worker process: how long a thread waiting for the GIL"
            " (the device thread between CUDA calls, the GET threads between reads) may wait for "
            "its holder"
        ),
    )
    max_attempts: int = tuning(5, integer(1, 100), "tries per S3/Kafka call before giving up")
    retry_max_wait_s: float = tuning(
        10.0, number(0.0, 600.0), "cap of the exponential backoff (full jitter)"
    )
    read_timeout_s: float = tuning(
        30.0, number(0.1, 3600.0), "per-call and per-read timeout towards S3"
    )
    max_header_bytes: int = tuning(
        16 * MiB, integer(4 * KiB, GiB), "largest DICOM header read before Pixel Data"
    )
    stage_buffer: int = tuning(16, integer(1, 4096), "bound of the stream into the device stage")
    sink_parts_in_flight: int = tuning(
        4,
        integer(1, 256),
        (
            "output parts (8 MiB) of one object uploading at once; the sink holds at most this "
            "many plus one of an object's output"
        ),
    )
    decode_processes: int = tuning(
        0,
        integer(0, 1024),
        (
            "processes that decode compressed frames (JPEG, JPEG-LS, JPEG 2000, HTJ2K), shared by"
            " all objects; 0 means one per core the worker may use"
        ),
    )
    gpu_decode: GpuDecode = tuning(
        "auto",
        one_of(GpuDecode),
        (
            "`auto`: on a CUDA device with nvImageCodec installed (extra `cuda`), JPEG Baseline, "
            "JPEG 2000 and HTJ2K Lossless frames decode on the GPU; `off`: every frame decodes on"
            " the CPU"
        ),
    )
    gpu_jpeg_decoder: GpuJpegDecoder = tuning(
        "auto",
        one_of(GpuJpegDecoder),
        (
            "which of nvImageCodec's decoders takes JPEG Baseline frames first: `hardware`, the"
            " GPU's JPEG engines (the least CPU a frame for one process); `cuda`, the CUDA"
            " decoder (where several processes share a GPU they contend for its engines); the"
            " other takes the frames the first refuses. `auto`: `cuda` for the workers of"
            " `--processes` when more than one shares a GPU, else `hardware`. Set `cuda` where"
            " separately started workers share a GPU"
        ),
    )
    worker_id: str = tuning(
        "",
        ANY_TEXT,
        (
            "worker identity in audit records and logs, stable across restarts (each trail names"
            " the previous trail of its worker id); unset: the host name (a pod's name)"
        ),
    )
    health_port: int = tuning(
        0,
        integer(0, 65535),
        (
            "port of `/healthz`, `/readyz` and `/metrics` (Prometheus; docs/operations.md lists "
            "the metrics); 0 serves none"
        ),
    )
    health_host: str = tuning("0.0.0.0", TEXT, "address the health endpoints bind")
    device_stall_s: float = tuning(
        300.0,
        number(1.0, 86_400.0),
        (
            "`/healthz` answers 503 (the liveness probe restarts the worker) once one work item"
            " has run this long on the device thread: a hung GPU call"
        ),
    )
    log_format: LogFormat = tuning(
        "auto",
        one_of(LogFormat),
        (
            "`json`: one JSON object a line (for log shippers); `console`: aligned, coloured "
            "lines for people; `auto`: `console` when stderr is a terminal, else `json`"
        ),
    )
    session_timeout_ms: int = tuning(
        30_000,
        integer(1000, 3_600_000),
        (
            "Kafka group session timeout: how long a member that stopped answering (crashed, "
            "stalled) keeps its partitions"
        ),
    )
    heartbeat_interval_ms: int = tuning(
        3_000,
        integer(100, 3_600_000),
        "Kafka heartbeat interval (at most a third of the session timeout)",
    )
    max_poll_interval_ms: int = tuning(
        300_000, integer(1000, 86_400_000), "Kafka max poll interval"
    )
    kafka_connect_timeout_s: float = tuning(
        10.0,
        number(0.5, 600.0),
        (
            "how long a Kafka client's start may take (connect, versions, metadata) before the "
            "worker gives up on a broker that does not answer; connections refused or closed "
            "(a broker restarting) are tried again for the first half of it"
        ),
    )
    fetch_max_wait_ms: int = tuning(
        50, integer(1, 60_000), "longest a Kafka fetch waits for records"
    )
    shutdown_deadline_s: float = tuning(
        30.0, number(0.1, 3600.0), "how long SIGTERM waits for in-flight objects"
    )
    audit_keyring_file: Path | None = security(
        None,
        FILE,
        (
            "a local keyring (`audit keygen --keyring FILE`, mode 600) whose current key wraps "
            "each trail's data keys; for the embedded stack and sites without KMS "
            "(docs/security.md)"
        ),
    )
    audit_kms_key_id: str | None = security(
        None,
        OPTIONAL_TEXT,
        (
            "KMS key whose `GenerateDataKey` gives the audit data keys (envelope encryption: each"
            " envelope carries the wrapped key as `edk`); docs/security.md"
        ),
    )
    audit_kms_endpoint_url: str | None = security(
        None, ENDPOINT, "KMS endpoint (a VPC endpoint, or a test server); unset means AWS's"
    )
    audit_rotate_records: int = security(
        1_000_000,
        integer(1, 1 << 28),
        (
            "audit records sealed under one data key before a new one is made (far below "
            "AES-GCM's limit for random nonces)"
        ),
    )
    audit_rotate_s: float = security(
        86_400.0,
        number(1.0, 366 * 86_400.0),
        "age in seconds after which a new audit data key is made",
    )
    audit_signing_key_file: Path | None = security(
        None,
        FILE,
        (
            "the site's Ed25519 private key (PKCS#8 PEM, mode 600, `audit keygen --signing-key "
            "FILE`) that signs the digests; unset, and no `AUDIT_SIGNING_KMS_KEY_ID`: each trail "
            "makes one and announces it (development only)"
        ),
    )
    audit_signing_kms_key_id: str | None = security(
        None,
        OPTIONAL_TEXT,
        (
            "asymmetric KMS key (ECC_NIST_P256, SIGN_VERIFY) whose `kms:Sign` signs the digests: "
            "the private key never leaves KMS; at `AUDIT_KMS_ENDPOINT_URL` when set"
        ),
    )
    audit_digest_records: int = security(
        1000,
        integer(1, 1_000_000),
        'audit records between two signed chain heads (`"type": "digest"` messages)',
    )
    audit_digest_s: float = security(
        60.0,
        number(0.05, 86_400.0),
        "seconds between two signed chain heads when fewer records came",
    )
    audit_spool_dir: Path | None = security(
        None,
        FOLDER,
        (
            "directory of the local audit spool (a folder per worker id): records the audit topic"
            " did not acknowledge in time wait there and are forwarded in order; unset: no spool,"
            " the worker waits for the audit topic"
        ),
    )
    audit_spool_max_bytes: int = security(
        64 * MiB,
        integer(64 * KiB, 1 << 40),
        (
            "largest size of the audit spool; past three quarters of it the worker stops taking "
            "notifications"
        ),
    )
    audit_ack_timeout_s: float = security(
        10.0,
        number(0.1, 3600.0),
        (
            "how long an audit record waits for the broker's acknowledgement before it goes to "
            "the spool (with `AUDIT_SPOOL_DIR`)"
        ),
    )
    audit_kafka_bootstrap: str | None = security(
        None,
        OPTIONAL_TEXT,
        (
            "brokers of the audit topic when it lives on a cluster of its own; unset: the "
            "worker's brokers"
        ),
    )
    posture: Posture = security(
        "development",
        one_of(Posture),
        (
            "`production`: `REQUIRE_TLS`, and an audit trail an auditor can trust (a signing "
            "key outside the writer, a keyring or KMS, `AUDIT_SPOOL_DIR`) or no start"
        ),
    )
    require_tls: bool = security(
        False,
        FLAG,
        (
            "refuse plaintext: Kafka without TLS (`PLAINTEXT`, `SASL_PLAINTEXT`) and `http://` "
            "S3 and KMS endpoints"
        ),
    )
    kafka_security_protocol: KafkaProtocol = security(
        "PLAINTEXT",
        one_of(KafkaProtocol),
        "how the worker talks to Kafka (TLS with `SSL`, SASL with `SASL_*`)",
    )
    kafka_ssl_cafile: Path | None = security(
        None, FILE, "CA certificates that sign the brokers' certificates"
    )
    kafka_ssl_certfile: Path | None = security(None, FILE, "client certificate for mutual TLS")
    kafka_ssl_keyfile: Path | None = security(None, FILE, "private key of the client certificate")
    kafka_ssl_key_password: str | None = security(
        None, SECRET_TEXT, "password of that private key", secret=True
    )
    kafka_sasl_mechanism: SaslMechanism = security(
        "PLAIN", one_of(SaslMechanism), "SASL mechanism with `SASL_*` protocols"
    )
    kafka_sasl_username: str | None = security(None, OPTIONAL_TEXT, "SASL user name")
    kafka_sasl_password: str | None = security(
        None,
        SECRET_TEXT,
        "SASL password (put it in a secret, not in a file in the repository)",
        secret=True,
    )
    s3_ca_bundle: Path | None = security(
        None,
        FILE,
        (
            "CA certificates every S3 connection verifies against (the client and the data "
            "threads); unset: `AWS_CA_BUNDLE`, else the system's CAs. Verification cannot be "
            "turned off"
        ),
    )
    output_sse: OutputSse = security(
        "none",
        one_of(OutputSse, empty="none"),
        (
            "server-side encryption of the outputs S3 is asked for: `AES256` (S3-managed keys) or"
            " `aws:kms`"
        ),
    )
    output_sse_kms_key_id: str | None = security(
        None, OPTIONAL_TEXT, "KMS key of `OUTPUT_SSE=aws:kms`; unset: the bucket's default key"
    )
    log_hash_key: bytes = security(
        b"",
        AES_KEY,
        (
            "base64 of 32 random bytes: the deployment's secret key of the hashes (HMAC-SHA-256)"
            " that stand for object keys in logs; unset: a key made by each process"
        ),
        secret=True,
    )

    @property
    def slot_size(self) -> int:
        """One ring slot holds one byte range."""
        return self.part_size

    @property
    def jpeg_decoder(self) -> Literal["hardware", "cuda"]:
        """The JPEG decoder this worker tries first: ``auto`` is ``hardware`` for a worker
        of its own (``--processes`` sets ``cuda`` in workers that share a GPU)."""
        return "cuda" if self.gpu_jpeg_decoder == "cuda" else "hardware"

    @property
    def output_bucket(self) -> str:
        return urlparse(self.output_url).netloc

    @property
    def output_prefix(self) -> str:
        return urlparse(self.output_url).path.lstrip("/")


# Every setting's declaration, by field name, in the order of the fields
SETTINGS: Final[Mapping[str, Setting]] = {f.name: f.metadata[METADATA] for f in fields(Settings)}
