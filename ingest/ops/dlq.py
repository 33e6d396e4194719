"""``dicom-ingest dlq replay``: re-publish dead-lettered work to the source topic after a fix.

The dead-letter topic holds one JSON document per object or bad record given
up on (``ingest/sink/records.py``). Replay reads it from the beginning to the
end it has when replay starts, keeps the documents the selection names (by
reason, by key prefix, by the time they were dead-lettered) and publishes,
for each:

* an object's dead letter: a new AWS-format notification naming just that
  bucket and key (not the original record, which may name other objects
  that succeeded, and may have been cut to 256 KiB in the dead letter). It
  carries no version, ETag or sequencer, so a worker that remembers the
  failure as a finished repeat still takes it, and it reads the object's
  current version, whose outputs are the ones at the object's keys;
* a bad record's dead letter: the original record's bytes, when the dead
  letter holds all of them (otherwise it is counted as not replayable).

Idempotence: after a record's re-publication is acknowledged, replay writes a
marker for it (its DLQ partition and offset) to ``<DLQ topic>.replayed``,
and skips every record with a marker on later runs; running the same replay
twice publishes once. A crash between the two acknowledgements republishes
that record on the next run, which the worker's idempotent outputs absorb
(at least once, as everywhere else). Every replayed message carries the
header ``dicom-ingest-replay-of: <topic>/<partition>/<offset>``.

Raises of this module's functions: ``BrokerError`` when the broker cannot be
read or written within the timeout.
"""

from __future__ import annotations

import base64
import json
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote_plus

import anyio
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError

from ingest.errors import BrokerError
from ingest.settings import Settings
from ingest.source.kafka import client_security, read_records

HEADER = "dicom-ingest-replay-of"
TIMEOUT_S = 120.0


@dataclass(frozen=True, slots=True)
class Selection:
    """Which dead letters to replay; every given condition must hold (none given: all)."""

    reasons: frozenset[str] = frozenset()
    key_prefix: str | None = None
    since: datetime | None = None  # dead-lettered at or after
    until: datetime | None = None  # dead-lettered before

    def wants(self, doc: dict[str, Any]) -> bool:
        if self.reasons and doc.get("reason") not in self.reasons:
            return False
        if self.key_prefix is not None and not str(doc.get("key") or "").startswith(
            self.key_prefix
        ):
            return False
        if self.since is None and self.until is None:
            return True
        when = parse_time(str(doc.get("time", "")))
        if when is None:
            return False
        return (self.since is None or when >= self.since) and (
            self.until is None or when < self.until
        )


@dataclass(slots=True)
class Report:
    replayed: Counter[str] = field(default_factory=Counter)  # by reason
    already: int = 0  # a marker says it was replayed before
    unselected: int = 0
    unreplayable: int = 0  # a cut or unreadable dead letter


def parse_time(text: str) -> datetime | None:
    """An ISO 8601 time; naive times are UTC."""
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def replay_message(doc: dict[str, Any]) -> tuple[bytes, bytes | None] | None:
    """(value, key) to publish for one dead letter; None when it cannot be replayed."""
    if doc.get("bucket") and doc.get("key"):
        record = {
            "eventVersion": "2.1",
            "eventSource": "aws:s3",
            "eventName": "ObjectCreated:Put",
            "eventTime": datetime.now(UTC).isoformat(timespec="milliseconds"),
            "s3": {"bucket": {"name": doc["bucket"]}, "object": {"key": quote_plus(doc["key"])}},
        }
        return json.dumps({"Records": [record]}).encode(), str(doc["key"]).encode()
    original = doc.get("record") or {}
    if original.get("value_truncated") or "value" not in original:
        return None
    value = str(original["value"])
    if original.get("value_encoding") == "base64":
        return base64.b64decode(value), None
    return value.encode(), None


async def replay(settings: Settings, selection: Selection, *, dry_run: bool = False) -> Report:
    """Replay the selected dead letters of ``settings.dlq_topic`` to ``settings.source_topic``.

    Raises:
        BrokerError: the broker could not be read or written within ``TIMEOUT_S``.
    """
    markers_topic = settings.dlq_topic + ".replayed"
    report = Report()
    try:
        with anyio.fail_after(TIMEOUT_S):
            await _ensure_topic(settings, markers_topic)
            done = {r.key.decode() for r in await read_all(settings, markers_topic) if r.key}
            letters = await read_all(settings, settings.dlq_topic)
            if dry_run:
                return _plan(letters, done, selection, report, [])
            producer = AIOKafkaProducer(
                bootstrap_servers=settings.kafka_bootstrap, acks="all", **client_security(settings)
            )
            await producer.start()
            try:
                todo: list[tuple[str, bytes, bytes | None, str]] = []
                _plan(letters, done, selection, report, todo)
                for mark, value, key, reason in todo:
                    headers = [(HEADER, f"{settings.dlq_topic}/{mark}".encode())]
                    await producer.send_and_wait(
                        settings.source_topic, value, key=key, headers=headers
                    )
                    marker = {"replayed_at": datetime.now(UTC).isoformat(), "reason": reason}
                    marker["to"] = settings.source_topic
                    await producer.send_and_wait(
                        markers_topic, json.dumps(marker).encode(), key=mark.encode()
                    )
            finally:
                await producer.stop()
    except (KafkaError, TimeoutError) as exc:
        raise BrokerError(f"dlq replay: {type(exc).__name__}: {exc}") from exc
    return report


def _plan(
    letters: list[Any],
    done: set[str],
    selection: Selection,
    report: Report,
    todo: list[tuple[str, bytes, bytes | None, str]],
) -> Report:
    """Sort the dead letters into the report (and ``todo``: what to publish)."""
    for record in letters:
        mark = f"{record.partition}/{record.offset}"
        try:
            doc = json.loads(record.value)
        except (TypeError, ValueError):
            report.unreplayable += 1
            continue
        if not isinstance(doc, dict) or not selection.wants(doc):
            report.unselected += 1
        elif mark in done:
            report.already += 1
        elif (message := replay_message(doc)) is None:
            report.unreplayable += 1
        else:
            reason = str(doc.get("reason", "error"))
            report.replayed[reason] += 1
            todo.append((mark, message[0], message[1], reason))
    return report


async def read_all(settings: Settings, topic: str) -> list[Any]:
    """Every record of ``topic`` from the beginning to the end it has now (no group); a
    topic not there yet is empty."""
    return await read_records(
        settings.kafka_bootstrap, topic, client=client_security(settings), missing_ok=True
    )


async def _ensure_topic(settings: Settings, topic: str) -> None:
    """Create the markers topic when missing (one partition; replicated as the cluster allows)."""
    admin = AIOKafkaAdminClient(
        bootstrap_servers=settings.kafka_bootstrap, **client_security(settings)
    )
    await admin.start()
    try:
        if topic in await admin.list_topics():
            return
        brokers = len((await admin.describe_cluster()).get("brokers", [])) or 1
        new = NewTopic(topic, num_partitions=1, replication_factor=min(3, brokers))
        await admin.create_topics([new])
    finally:
        await admin.close()
