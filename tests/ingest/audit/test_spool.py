"""The audit spool's forwarder against an in-memory topic twin (no broker, no timing luck).

``tests/ingest/audit/test_publish.py`` runs the spool with a real audit broker that is killed and
restarted; there, the race below showed as a timeout now and then (more often on a
busy machine): the forwarder emptied the spool while a record was being appended
behind it, slept, and nothing woke it again. Here that interleaving is made to
happen every time by holding the append's file write.
"""

from __future__ import annotations

import asyncio
import base64
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest

from ingest.audit.publish import AuditPublisher
from ingest.audit.records import AuditTrail
from ingest.audit.spool import Spool
from ingest.audit.verify import verify_trail
from ingest.settings import Settings, load_settings
from tests.trails import DEAD, KEY, OK, MemoryPublisher

pytestmark = pytest.mark.anyio

ACK_TIMEOUT_S = 0.1


def settings() -> Settings:
    return load_settings(
        {
            "DICOM_INGEST_KAFKA_BOOTSTRAP": "127.0.0.1:9092",
            "DICOM_INGEST_OUTPUT_URL": "s3://out/",
            "DICOM_INGEST_AUDIT_KEY": base64.b64encode(KEY).decode(),
            "DICOM_INGEST_AUDIT_ACK_TIMEOUT_S": str(ACK_TIMEOUT_S),
        }
    )


class SwitchedTopic(MemoryPublisher):
    """An audit topic that is away (nothing is ever acknowledged) until ``up``."""

    def __init__(self) -> None:
        super().__init__()
        self.up = False

    async def enqueue(self, topic: str, value: bytes, key: bytes | None) -> asyncio.Future[Any]:
        if self.up:
            return await super().enqueue(topic, value, key)
        return asyncio.get_running_loop().create_future()  # never acknowledged


class HeldSpool(Spool):
    """A spool whose file writes wait while ``release`` is clear (a slow disk);
    ``held`` is set once a write waits."""

    def __init__(self, directory: Path, max_bytes: int) -> None:
        super().__init__(directory, max_bytes)
        self.release = threading.Event()
        self.release.set()
        self.held = threading.Event()

    def _write(self, number: int, message: bytes) -> None:
        if not self.release.is_set():
            self.held.set()
        assert self.release.wait(10), "the test never released the write"
        super()._write(number, message)


async def wait_until(condition: Any, seconds: float = 10.0) -> None:
    with anyio.fail_after(seconds):
        while not condition():  # noqa: ASYNC110 - state of a twin that nothing signals
            await anyio.sleep(0.005)


async def test_a_record_spooled_while_the_forwarder_empties_the_spool_is_forwarded(
    tmp_path: Path,
) -> None:
    topic = SwitchedTopic()
    spool = HeldSpool(tmp_path / "spool", 64 * 1024)
    audit = AuditPublisher(
        AuditTrail(KEY, "k1", "w1"), topic, "audit", "w1",  # type: ignore[arg-type]
        settings=settings(), spool=spool,
    )  # fmt: skip
    async with anyio.create_task_group() as group:
        await group.start(audit.run)
        await audit.record(OK)  # not acknowledged in time: spooled
        assert len(spool) == 1
        spool.release.clear()
        # the next record queues behind the first (the spool holds one), in a write held
        # until the forwarder has emptied the spool
        group.start_soon(audit.record, DEAD)
        await wait_until(spool.held.is_set)
        topic.up = True
        await wait_until(lambda: len(topic.messages) == 1 and len(spool) == 0)
        spool.release.set()  # the second record lands in a spool the forwarder left empty
        await wait_until(lambda: len(topic.messages) == 2 and len(spool) == 0)
        group.cancel_scope.cancel()
    report = verify_trail(topic.messages, keys={"k1": KEY})
    assert report.ok, report.findings
    assert [r["seq"] for r in report.records] == [0, 1]  # in the chain's order


async def test_the_forwarder_sleeps_only_while_the_spool_is_empty(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool", 1024)
    got: list[bytes] = []

    async def forward() -> None:
        got.append(await spool.next_to_forward())

    async with anyio.create_task_group() as group:
        group.start_soon(forward)
        await anyio.sleep(0.01)
        assert got == []  # nothing to send: it waits
        await spool.append(b"first")
    assert got == [b"first"]
    assert await spool.next_to_forward() == b"first"  # still there until dropped
    spool.drop_oldest()
    assert len(spool) == 0
