"""The one place that reads configuration: environment first, then a TOML file.

Every key is ``DICOM_INGEST_<NAME>`` in the environment, or ``<name>`` in lower
case in the file given with ``--config``; the environment wins. Values are
validated here, once, and the frozen ``Settings`` is passed down; nothing else
reads the environment. A bad value raises ``ConfigError`` whose message names
the variable, so start-up fails with one clear line.
"""

from __future__ import annotations

import base64
import binascii
import os
import socket
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlparse

from ingest.errors import ConfigError

PREFIX = "DICOM_INGEST_"
MiB = 1024 * 1024

Device = Literal["auto", "cuda", "cpu"]
OutputDtype = Literal["float32", "float16"]
KafkaProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
SaslMechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"]


@dataclass(frozen=True, slots=True)
class Settings:
    """Validated configuration. Field names are the variable names without the prefix."""

    kafka_bootstrap: str = ""  # both required by the worker (``_REQUIRED``), not by `audit`
    output_url: str = ""
    audit_key: bytes = field(default=b"", repr=False)  # a secret: never in a repr or a log
    source_topic: str = "s3-events"
    group_id: str = "dicom-ingest"
    results_topic: str = "dicom-ingest.results"
    dlq_topic: str = "dicom-ingest.dlq"
    audit_topic: str = "dicom-ingest.audit"
    s3_endpoint_url: str | None = None
    window: tuple[float, float] | None = None
    output_dtype: OutputDtype = "float32"
    device: Device = "auto"
    audit_key_id: str = "local-1"
    sink: Literal["s3", "none"] = "s3"
    source_hash: Literal["crc64nvme", "sha256", "sha256-tree", "none"] = "crc64nvme"
    hook: str | None = None
    # Tuning: byte ranges, the pinned ring, concurrency and batching.
    part_size: int = 32 * MiB  # docs/configuration.md says why (measured)
    ring_slots: int = 24
    fetch_concurrency: int = 16
    max_objects_in_flight: int = 64  # docs/configuration.md says why (measured)
    batch_max_objects: int = 16
    batch_max_bytes: int = 128 * MiB  # docs/configuration.md says why (measured)
    batch_wait_ms: float = 0.0
    gil_switch_ms: float = 0.5  # sys.setswitchinterval (Python: 5 ms); docs/configuration.md
    max_attempts: int = 5
    retry_max_wait_s: float = 10.0
    read_timeout_s: float = 30.0
    max_header_bytes: int = 16 * MiB
    stage_buffer: int = 16
    sink_parts_in_flight: int = 4  # docs/configuration.md says why (measured)
    # Processes decoding compressed frames (pydicom's plugins hold the GIL); 0: one a core
    decode_processes: int = 0
    # auto: a CUDA device decodes the frames it can (nvImageCodec), the CPU the rest
    gpu_decode: Literal["auto", "off"] = "auto"
    worker_id: str = ""
    health_port: int = 0
    health_host: str = "0.0.0.0"  # probes come from outside the container
    log_format: Literal["auto", "json", "console"] = "auto"  # auto: console on a terminal
    # Consumer timing. Production defaults suit real Kafka (6 s minimum session).
    session_timeout_ms: int = 30_000
    heartbeat_interval_ms: int = 3_000
    max_poll_interval_ms: int = 300_000
    fetch_max_wait_ms: int = 50  # Tansu answers a fetch only at this deadline
    shutdown_deadline_s: float = 30.0
    # Security (docs/security.md). Audit keys: AUDIT_KEY (one static key), a keyring file
    # or KMS; data keys rotate after a count or an age, far below GCM's 2**32 nonces.
    audit_keyring_file: Path | None = None
    audit_kms_key_id: str | None = None
    audit_kms_endpoint_url: str | None = None
    audit_rotate_records: int = 1_000_000
    audit_rotate_s: float = 86_400.0
    audit_signing_key_file: Path | None = None  # Ed25519 PEM; unset: one key per trail
    audit_digest_records: int = 1000
    audit_digest_s: float = 60.0
    audit_spool_dir: Path | None = None  # unset: no spool, the audit topic is waited for
    audit_spool_max_bytes: int = 64 * MiB
    audit_ack_timeout_s: float = 10.0  # then a record goes to the spool
    audit_kafka_bootstrap: str | None = None  # unset: the worker's brokers
    kafka_security_protocol: KafkaProtocol = "PLAINTEXT"
    kafka_ssl_cafile: Path | None = None
    kafka_ssl_certfile: Path | None = None
    kafka_ssl_keyfile: Path | None = None
    kafka_ssl_key_password: str | None = field(default=None, repr=False)
    kafka_sasl_mechanism: SaslMechanism = "PLAIN"
    kafka_sasl_username: str | None = None
    kafka_sasl_password: str | None = field(default=None, repr=False)
    s3_ca_bundle: Path | None = None  # unset: AWS_CA_BUNDLE, else the system's CAs
    output_sse: Literal["none", "AES256", "aws:kms"] = "none"
    output_sse_kms_key_id: str | None = None

    @property
    def slot_size(self) -> int:
        """One ring slot holds one byte range."""
        return self.part_size

    @property
    def output_bucket(self) -> str:
        return urlparse(self.output_url).netloc

    @property
    def output_prefix(self) -> str:
        return urlparse(self.output_url).path.lstrip("/")


def _parse_int(name: str, low: int, high: int) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        try:
            value = int(raw.replace("_", ""), 0)
        except ValueError:
            raise ConfigError(f"{PREFIX}{name.upper()}: not an integer: {raw!r}") from None
        if not low <= value <= high:
            raise ConfigError(f"{PREFIX}{name.upper()}: {value} is outside [{low}, {high}]")
        return value

    return parse


def _parse_float(name: str, low: float, high: float) -> Callable[[str], float]:
    def parse(raw: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            raise ConfigError(f"{PREFIX}{name.upper()}: not a number: {raw!r}") from None
        if not low <= value <= high:
            raise ConfigError(f"{PREFIX}{name.upper()}: {value} is outside [{low}, {high}]")
        return value

    return parse


def _parse_choice(name: str, choices: tuple[str, ...]) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.strip().lower()
        if value not in choices:
            raise ConfigError(f"{PREFIX}{name.upper()}: {raw!r} is not one of {', '.join(choices)}")
        return value

    return parse


def parse_window(raw: str) -> tuple[float, float] | None:
    """``none`` or ``CENTER,WIDTH`` with WIDTH >= 1 (DICOM C.11.2.1.2)."""
    text = raw.strip().lower()
    if text in ("", "none"):
        return None
    parts = text.split(",")
    bad = ConfigError(f"{PREFIX}WINDOW: expected 'none' or 'CENTER,WIDTH', got {raw!r}")
    if len(parts) != 2:
        raise bad
    try:
        center, width = float(parts[0]), float(parts[1])
    except ValueError:
        raise bad from None
    if width < 1:
        raise ConfigError(f"{PREFIX}WINDOW: width must be >= 1, got {width}")
    return center, width


def parse_audit_key(raw: str) -> bytes:
    try:
        key = base64.b64decode(raw.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise ConfigError(f"{PREFIX}AUDIT_KEY: not valid base64") from None
    if len(key) != 32:
        raise ConfigError(f"{PREFIX}AUDIT_KEY: must decode to 32 bytes, got {len(key)}")
    return key


def _parse_output_url(raw: str) -> str:
    url = urlparse(raw)
    if url.scheme != "s3" or not url.netloc:
        raise ConfigError(f"{PREFIX}OUTPUT_URL: expected s3://bucket/prefix/, got {raw!r}")
    return raw if raw.endswith("/") else raw + "/"


def _parse_endpoint(raw: str, name: str = "S3_ENDPOINT_URL") -> str | None:
    if not raw.strip():
        return None
    url = urlparse(raw)
    if url.scheme not in ("http", "https") or not url.netloc:
        raise ConfigError(f"{PREFIX}{name}: expected http(s)://host:port, got {raw!r}")
    return raw


def _parse_nonempty(name: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if not raw.strip():
            raise ConfigError(f"{PREFIX}{name.upper()}: must not be empty")
        return raw.strip()

    return parse


_OUTPUT_SSE = {"": "none", "none": "none", "aes256": "AES256", "aws:kms": "aws:kms"}


def _bad_sse(raw: str) -> str:
    raise ConfigError(f"{PREFIX}OUTPUT_SSE: {raw!r} is not one of none, AES256, aws:kms")


def _parse_path(name: str) -> Callable[[str], Path | None]:
    """A file that must exist when set (keys, certificates): a typo fails at start-up."""

    def parse(raw: str) -> Path | None:
        if not raw.strip():
            return None
        path = Path(raw.strip()).expanduser()
        if not path.is_file():
            raise ConfigError(f"{PREFIX}{name.upper()}: no such file: {raw.strip()!r}")
        return path

    return parse


def _parse_upper(name: str, choices: tuple[str, ...]) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.strip().upper()
        if value not in choices:
            raise ConfigError(f"{PREFIX}{name.upper()}: {raw!r} is not one of {', '.join(choices)}")
        return value

    return parse


_PARSERS: dict[str, Callable[[str], Any]] = {
    "kafka_bootstrap": _parse_nonempty("kafka_bootstrap"),
    "output_url": _parse_output_url,
    "audit_key": parse_audit_key,
    "source_topic": _parse_nonempty("source_topic"),
    "group_id": _parse_nonempty("group_id"),
    "results_topic": _parse_nonempty("results_topic"),
    "dlq_topic": _parse_nonempty("dlq_topic"),
    "audit_topic": _parse_nonempty("audit_topic"),
    "s3_endpoint_url": _parse_endpoint,
    "window": parse_window,
    "output_dtype": _parse_choice("output_dtype", ("float32", "float16")),
    "device": _parse_choice("device", ("auto", "cuda", "cpu")),
    "audit_key_id": _parse_nonempty("audit_key_id"),
    "sink": _parse_choice("sink", ("s3", "none")),
    "source_hash": _parse_choice("source_hash", ("crc64nvme", "sha256", "sha256-tree", "none")),
    "hook": lambda raw: raw.strip() or None,
    "part_size": _parse_int("part_size", 64 * 1024, 1024 * MiB),
    "ring_slots": _parse_int("ring_slots", 2, 4096),
    "decode_processes": _parse_int("decode_processes", 0, 1024),
    "gpu_decode": _parse_choice("gpu_decode", ("auto", "off")),
    "fetch_concurrency": _parse_int("fetch_concurrency", 1, 512),
    "max_objects_in_flight": _parse_int("max_objects_in_flight", 1, 4096),
    "batch_max_objects": _parse_int("batch_max_objects", 1, 1024),
    "batch_max_bytes": _parse_int("batch_max_bytes", MiB, 16 * 1024 * MiB),
    "batch_wait_ms": _parse_float("batch_wait_ms", 0.0, 10_000.0),
    "max_attempts": _parse_int("max_attempts", 1, 100),
    "retry_max_wait_s": _parse_float("retry_max_wait_s", 0.0, 600.0),
    "read_timeout_s": _parse_float("read_timeout_s", 0.1, 3600.0),
    "gil_switch_ms": _parse_float("gil_switch_ms", 0.1, 100.0),
    "max_header_bytes": _parse_int("max_header_bytes", 4096, 1024 * MiB),
    "stage_buffer": _parse_int("stage_buffer", 1, 4096),
    "sink_parts_in_flight": _parse_int("sink_parts_in_flight", 1, 256),
    "worker_id": str,
    "health_port": _parse_int("health_port", 0, 65535),
    "health_host": _parse_nonempty("health_host"),
    "log_format": _parse_choice("log_format", ("auto", "json", "console")),
    "session_timeout_ms": _parse_int("session_timeout_ms", 1000, 3_600_000),
    "heartbeat_interval_ms": _parse_int("heartbeat_interval_ms", 100, 3_600_000),
    "max_poll_interval_ms": _parse_int("max_poll_interval_ms", 1000, 86_400_000),
    "fetch_max_wait_ms": _parse_int("fetch_max_wait_ms", 1, 60_000),
    "shutdown_deadline_s": _parse_float("shutdown_deadline_s", 0.1, 3600.0),
    # security: docs/security.md
    "audit_keyring_file": _parse_path("audit_keyring_file"),
    "audit_kms_key_id": lambda raw: raw.strip() or None,
    "audit_kms_endpoint_url": lambda raw: _parse_endpoint(raw, "AUDIT_KMS_ENDPOINT_URL"),
    "audit_rotate_records": _parse_int("audit_rotate_records", 1, 1 << 28),
    "audit_rotate_s": _parse_float("audit_rotate_s", 1.0, 366 * 86_400.0),
    "audit_signing_key_file": _parse_path("audit_signing_key_file"),
    "audit_digest_records": _parse_int("audit_digest_records", 1, 1_000_000),
    "audit_digest_s": _parse_float("audit_digest_s", 0.05, 86_400.0),
    "audit_spool_dir": lambda raw: Path(raw.strip()) if raw.strip() else None,
    "audit_spool_max_bytes": _parse_int("audit_spool_max_bytes", 64 * 1024, 1 << 40),
    "audit_ack_timeout_s": _parse_float("audit_ack_timeout_s", 0.1, 3600.0),
    "audit_kafka_bootstrap": lambda raw: raw.strip() or None,
    "kafka_security_protocol": _parse_upper(
        "kafka_security_protocol", ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
    ),
    "kafka_ssl_cafile": _parse_path("kafka_ssl_cafile"),
    "kafka_ssl_certfile": _parse_path("kafka_ssl_certfile"),
    "kafka_ssl_keyfile": _parse_path("kafka_ssl_keyfile"),
    "kafka_ssl_key_password": lambda raw: raw or None,
    "kafka_sasl_mechanism": _parse_upper(
        "kafka_sasl_mechanism", ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
    ),
    "kafka_sasl_username": lambda raw: raw.strip() or None,
    "kafka_sasl_password": lambda raw: raw or None,
    "s3_ca_bundle": _parse_path("s3_ca_bundle"),
    "output_sse": lambda raw: _OUTPUT_SSE.get(raw.strip().lower()) or _bad_sse(raw),
    "output_sse_kms_key_id": lambda raw: raw.strip() or None,
}
_REQUIRED = ("kafka_bootstrap", "output_url")


def load_settings(
    environ: Mapping[str, str] | None = None,
    config_file: Path | None = None,
    required: tuple[str, ...] = _REQUIRED,
) -> Settings:
    """Build ``Settings`` from a TOML file (optional) overlaid by the environment.

    Raises:
        ConfigError: a value is invalid, a required one is missing, the file
            cannot be read, or it holds a key we do not know.
    """
    env = os.environ if environ is None else environ
    raw: dict[str, str] = {}
    if config_file is not None:
        try:
            data = tomllib.loads(config_file.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"--config {config_file}: {exc}") from exc
        for key, value in data.items():
            if key not in _PARSERS:
                raise ConfigError(f"--config {config_file}: unknown key {key!r}")
            raw[key] = ",".join(map(str, value)) if isinstance(value, list) else str(value)
    for key in _PARSERS:
        name = PREFIX + key.upper()
        if name in env:
            raw[key] = env[name]
    for key in required:
        if key not in raw:
            raise ConfigError(f"{PREFIX}{key.upper()}: required but not set")
    values = {key: _PARSERS[key](text) for key, text in raw.items()}
    if not values.get("worker_id"):
        values["worker_id"] = f"{socket.gethostname()}-{os.getpid()}"
    settings = Settings(**values)
    _check_consistency(settings)
    if "output_url" in required:  # the worker's settings; `audit` reads a trail only
        _check_security(settings)
    return settings


def _check_consistency(settings: Settings) -> None:
    if settings.part_size % (64 * 1024):
        raise ConfigError(f"{PREFIX}PART_SIZE: must be a multiple of 64 KiB")
    if settings.heartbeat_interval_ms >= settings.session_timeout_ms:
        raise ConfigError(f"{PREFIX}HEARTBEAT_INTERVAL_MS: must be below SESSION_TIMEOUT_MS")
    if settings.ring_slots < 2:
        raise ConfigError(f"{PREFIX}RING_SLOTS: at least 2")


def _check_security(s: Settings) -> None:
    sources = [bool(s.audit_key), s.audit_keyring_file is not None, s.audit_kms_key_id is not None]
    if sum(sources) != 1:
        raise ConfigError(
            f"{PREFIX}AUDIT_KEY: set exactly one of AUDIT_KEY, AUDIT_KEYRING_FILE, AUDIT_KMS_KEY_ID"
        )
    if s.kafka_security_protocol.startswith("SASL") and not (
        s.kafka_sasl_username and s.kafka_sasl_password
    ):
        raise ConfigError(f"{PREFIX}KAFKA_SASL_USERNAME: SASL needs a username and a password")
    if (s.kafka_ssl_certfile is None) != (s.kafka_ssl_keyfile is None):
        raise ConfigError(f"{PREFIX}KAFKA_SSL_KEYFILE: a client certificate needs its key file")
    if s.output_sse_kms_key_id and s.output_sse != "aws:kms":
        raise ConfigError(f"{PREFIX}OUTPUT_SSE_KMS_KEY_ID: needs OUTPUT_SSE=aws:kms")


def setting_names() -> list[str]:
    """Every environment variable this module reads, for ``--help`` and docs."""
    return [PREFIX + f.name.upper() for f in fields(Settings)]
