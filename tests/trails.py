"""The audit trail's test material: a key, a site signing key, two events, an in-memory
publisher, and the command line and settings as the audit tests call them."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ingest.audit.digest import LocalSigner, public_key_text
from ingest.audit.records import AuditEvent
from ingest.cli import main
from ingest.settings import load_settings

KEY = bytes(range(32))
# The site's digest signing key (AUDIT_SIGNING_KEY_FILE's), and its public half as pinned
SITE_KEY = Ed25519PrivateKey.from_private_bytes(bytes(range(32, 64)))
SITE_PUBLIC = public_key_text(
    SITE_KEY.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
)


def site_signer() -> LocalSigner:
    return LocalSigner(SITE_KEY)


def write_site_key(path: Path) -> Path:
    """The site key as ``audit keygen --signing-key`` writes it (mode 600, ``.pub`` beside)."""
    pem = SITE_KEY.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    path.write_bytes(pem)
    path.chmod(0o600)
    public = SITE_KEY.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    path.with_name(path.name + ".pub").write_bytes(public)
    return path


OK = AuditEvent(
    "object.processed",
    "success",
    "scans",
    "ct/1.dcm",
    '"abc"',
    "v1",
    study_instance_uid="1.2.3",
    series_instance_uid="1.2.3.4",
    sop_instance_uid="1.2.3.4.5",
    outputs=("out/scans/ct/1.dcm.npy", "out/scans/ct/1.dcm.json"),
)
DEAD = AuditEvent(
    "object.dead_lettered",
    "failure",
    "scans",
    "x.dcm",
    None,
    None,
    reason="not_dicom",
    error="NotDicom",
)


class MemoryPublisher:
    """The in-memory twin of ``source.kafka.Publisher``: every message acknowledged at once."""

    def __init__(self) -> None:
        self.messages: list[bytes] = []

    async def enqueue(self, topic: str, value: bytes, key: bytes | None) -> asyncio.Future[Any]:
        self.messages.append(value)
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

    async def confirm(self, delivery: Any, topic: str, value: bytes, key: bytes | None) -> None:
        await delivery


def cli(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> int:
    """``main(argv)`` logging to the process's stderr: pytest swaps a capture stream into
    ``sys.stderr`` for each test phase and closes it after, and loggers keep their stream."""
    monkeypatch.setattr("sys.stderr", sys.__stderr__)
    return main(argv)


def settings_for(tmp_path: Path, **extra: str) -> Any:
    env = {
        "DICOM_INGEST_KAFKA_BOOTSTRAP": "127.0.0.1:1",
        "DICOM_INGEST_OUTPUT_URL": "s3://out/",
        "DICOM_INGEST_WORKER_ID": "w1",
    }
    env |= {f"DICOM_INGEST_{k.upper()}": v for k, v in extra.items()}
    return load_settings(env)
