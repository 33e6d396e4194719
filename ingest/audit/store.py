"""Where a trail is read from: the audit topic (with positions), or an exported file.

The export format, for long retention (the seeds ask for six months at
least: keep the file in object storage with Object Lock or on WORM media), is
JSON lines: a header ``{"format": "dicom-ingest-audit-export", "v": 2, "topic",
"exported_at", "messages", "sha256", "trails"}`` and then one line per message,
in stored order, ``{"partition", "offset", "timestamp", "value"}`` with ``value``
the message as it was on the topic (UTF-8 JSON text). ``audit verify --file``
checks a file as it checks the topic: records, digests and their signatures
travel inside. The header is the export's index: ``sha256`` the running hash
``SHA-256(H || SHA-256(value))`` over the values from 64 zeros, ``trails`` each
trail's ``[worker, trail, messages]``; with a signing key in the exporter's
settings it is signed too (``"signer": {"alg", "key_id", "public_key", "sig"}``,
``sig`` over the canonical JSON of the header with ``signer`` less ``sig``), so
a trail removed from the file later shows even where no later trail names it.
"""

from __future__ import annotations

import base64
import json
import os
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ingest.audit.digest import Signer, canonical
from ingest.audit.verify import index_of
from ingest.errors import ConfigError
from ingest.source.kafka import read_records

FORMAT = "dicom-ingest-audit-export"


@dataclass(frozen=True, slots=True)
class Stored:
    """One audit message and where it was stored."""

    partition: int
    offset: int
    timestamp: int | None
    value: bytes

    @property
    def where(self) -> str:
        return f"partition {self.partition} offset {self.offset}"


async def read_audit_topic(
    bootstrap: str, topic: str, client: dict[str, Any] | None = None, timeout_s: float = 60.0
) -> list[Stored]:
    """Every message of the topic, partition by partition, from the start to its end now.

    Raises:
        BrokerError: the broker could not be read within ``timeout_s``.
    """
    records = await read_records(bootstrap, topic, client=client, timeout_s=timeout_s)
    return [Stored(r.partition, r.offset, r.timestamp, r.value) for r in records]


def _stored_value(m: Stored) -> str:
    return m.value.decode("utf-8", "replace")


def export_header(topic: str, messages: list[Stored]) -> dict[str, Any]:
    """The header ``write_export`` writes for ``messages`` (unsigned)."""
    sha256, trails = index_of([_stored_value(m).encode("utf-8") for m in messages])
    return {
        "format": FORMAT,
        "v": 2,
        "topic": topic,
        "exported_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "messages": len(messages),
        "sha256": sha256,
        "trails": trails,
    }


async def sign_header(header: dict[str, Any], signer: Signer) -> dict[str, Any]:
    """``header`` with its ``signer`` block.

    Raises:
        KeyServiceError: KMS did not sign.
    """
    block = {"alg": signer.alg, "key_id": signer.key_id, "public_key": signer.public_key}
    signature = await signer.sign(canonical(header | {"signer": block}))
    return header | {"signer": block | {"sig": base64.b64encode(signature).decode()}}


def write_export(
    path: Path, topic: str, messages: list[Stored], header: dict[str, Any] | None = None
) -> None:
    """Write an export file (mode 600, then renamed into place); ``header`` as
    ``export_header`` (or ``sign_header``) made it, else an unsigned one."""
    header = header if header is not None else export_header(topic, messages)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(json.dumps(header) + "\n")
        for m in messages:
            line = {"partition": m.partition, "offset": m.offset, "timestamp": m.timestamp}
            out.write(json.dumps(line | {"value": _stored_value(m)}) + "\n")
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)


@dataclass(frozen=True, slots=True)
class Export:
    """An export file: its messages, and what its header says of them."""

    messages: list[Stored]
    declared: int | None  # the header's count of messages
    exported_at: datetime | None
    header: dict[str, Any] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return self.declared == len(self.messages)


def read_export(path: Path) -> Export:
    """The messages of an export file, in stored order, with its header's count and time.

    Raises:
        ConfigError: not an export file (a line that is not what ``write_export`` writes).
    """
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
        header = json.loads(lines[0])
        out = []
        for line in lines[1:]:
            m = json.loads(line)
            value = str(m["value"]).encode("utf-8")
            out.append(Stored(int(m["partition"]), int(m["offset"]), m.get("timestamp"), value))
    except (OSError, ValueError, IndexError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"audit export {path}: {type(exc).__name__}: {exc}") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ConfigError(f"audit export {path}: no {FORMAT} header")
    declared = header.get("messages")
    try:
        at = datetime.fromisoformat(str(header.get("exported_at")))
    except ValueError:
        at = None
    return Export(out, declared if type(declared) is int else None, at, header)
