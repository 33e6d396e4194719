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
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlparse

from ingest.errors import ConfigError

PREFIX = "DICOM_INGEST_"
MiB = 1024 * 1024

Device = Literal["auto", "cuda", "cpu"]
OutputDtype = Literal["float32", "float16"]


@dataclass(frozen=True, slots=True)
class Settings:
    """Validated configuration. Field names are the variable names without the prefix."""

    kafka_bootstrap: str
    output_url: str
    audit_key: bytes
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
    source_hash: Literal["sha256", "sha256-tree", "none"] = "sha256"
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
    # Consumer timing. Production defaults suit real Kafka (6 s minimum session).
    session_timeout_ms: int = 30_000
    heartbeat_interval_ms: int = 3_000
    max_poll_interval_ms: int = 300_000
    fetch_max_wait_ms: int = 50  # Tansu answers a fetch only at this deadline
    shutdown_deadline_s: float = 30.0

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


def _parse_endpoint(raw: str) -> str | None:
    if not raw.strip():
        return None
    url = urlparse(raw)
    if url.scheme not in ("http", "https") or not url.netloc:
        raise ConfigError(f"{PREFIX}S3_ENDPOINT_URL: expected http(s)://host:port, got {raw!r}")
    return raw


def _parse_nonempty(name: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if not raw.strip():
            raise ConfigError(f"{PREFIX}{name.upper()}: must not be empty")
        return raw.strip()

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
    "source_hash": _parse_choice("source_hash", ("sha256", "sha256-tree", "none")),
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
    "session_timeout_ms": _parse_int("session_timeout_ms", 1000, 3_600_000),
    "heartbeat_interval_ms": _parse_int("heartbeat_interval_ms", 100, 3_600_000),
    "max_poll_interval_ms": _parse_int("max_poll_interval_ms", 1000, 86_400_000),
    "fetch_max_wait_ms": _parse_int("fetch_max_wait_ms", 1, 60_000),
    "shutdown_deadline_s": _parse_float("shutdown_deadline_s", 0.1, 3600.0),
}
_REQUIRED = ("kafka_bootstrap", "output_url", "audit_key")


def load_settings(
    environ: Mapping[str, str] | None = None, config_file: Path | None = None
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
    for key in _REQUIRED:
        if key not in raw:
            raise ConfigError(f"{PREFIX}{key.upper()}: required but not set")
    values = {key: _PARSERS[key](text) for key, text in raw.items()}
    if not values.get("worker_id"):
        values["worker_id"] = f"{socket.gethostname()}-{os.getpid()}"
    settings = Settings(**values)
    _check_consistency(settings)
    return settings


def _check_consistency(settings: Settings) -> None:
    if settings.part_size % (64 * 1024):
        raise ConfigError(f"{PREFIX}PART_SIZE: must be a multiple of 64 KiB")
    if settings.heartbeat_interval_ms >= settings.session_timeout_ms:
        raise ConfigError(f"{PREFIX}HEARTBEAT_INTERVAL_MS: must be below SESSION_TIMEOUT_MS")
    if settings.ring_slots < 2:
        raise ConfigError(f"{PREFIX}RING_SLOTS: at least 2")


def setting_names() -> list[str]:
    """Every environment variable this module reads, for ``--help`` and docs."""
    return [PREFIX + f.name.upper() for f in fields(Settings)]
