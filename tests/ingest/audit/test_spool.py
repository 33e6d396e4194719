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

from ingest.audit.digest import Previous
from ingest.audit.publish import AuditPublisher
from ingest.audit.records import AuditTrail
from ingest.audit.spool import Spool, TrailState, orphans
from ingest.audit.verify import verify_trail
from ingest.errors import ConfigError
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
        AuditTrail(KEY, "k1", "w1"),
        topic,  # type: ignore[arg-type]
        "audit",
        "w1",
        settings=settings(),
        spool=spool,
    )
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
    report = verify_trail(topic.messages, keys={"k1": KEY}, strict=False)  # no signer here
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


class KeyedTopic(MemoryPublisher):
    """The in-memory topic, keeping each message's key (the worker id) too."""

    def __init__(self) -> None:
        super().__init__()
        self.keys: list[bytes | None] = []

    async def enqueue(self, topic: str, value: bytes, key: bytes | None) -> asyncio.Future[Any]:
        self.keys.append(key)
        return await super().enqueue(topic, value, key)


async def test_a_restarted_worker_forwards_a_former_worker_ids_spool(tmp_path: Path) -> None:
    root = tmp_path / "spool"
    # a worker of the former default id (host-PID) spooled two records and died
    gone = AuditTrail(KEY, "k1", "host-4242")
    left = [gone.seal(OK), gone.seal(DEAD)]
    former = Spool(root / "host-4242", 64 * 1024)
    for message in left:
        await former.append(message)
    former.let_go()  # the process ended: its lock is gone with it
    # a running worker's spool is left alone
    running = Spool(root / "busy", 64 * 1024)
    await running.append(b"not mine")
    found = orphans(root, "host", 64 * 1024)
    assert [s.name for s in found] == ["host-4242"]
    topic = KeyedTopic()
    audit = AuditPublisher(
        AuditTrail(KEY, "k1", "host"),
        topic,  # type: ignore[arg-type]
        "audit",
        "host",
        settings=settings(),
        spool=Spool(root / "host", 64 * 1024),
        orphaned=found,
    )
    async with anyio.create_task_group() as group:
        await group.start(audit.run)
        await wait_until(lambda: len(topic.messages) == 2)
        group.cancel_scope.cancel()
    assert topic.messages == left  # in their order, keyed as their worker's
    assert topic.keys == [b"host-4242", b"host-4242"]
    assert not list((root / "host-4242").glob("*.msg"))
    assert len(running) == 1
    report = verify_trail(topic.messages, keys={"k1": KEY}, strict=False)
    assert report.ok, report.findings


def test_a_spool_is_held_by_one_process_and_kept_private(tmp_path: Path) -> None:
    root = tmp_path / "spool"
    root.mkdir(mode=0o777)
    root.chmod(0o777)  # a directory someone made world-writable before the worker came
    (root / "w1").mkdir(mode=0o777)
    (root / "w1").chmod(0o777)
    first = Spool(root / "w1", 64 * 1024)
    assert root.stat().st_mode & 0o777 == 0o700
    assert (root / "w1").stat().st_mode & 0o777 == 0o700
    with pytest.raises(ConfigError, match="held by a running process"):
        Spool(root / "w1", 64 * 1024)  # a second worker with the same worker id
    first.let_go()
    Spool(root / "w1", 64 * 1024)


def test_the_trail_state_names_where_the_last_trail_got_to(tmp_path: Path) -> None:
    state = TrailState(tmp_path)
    assert state.previous() == Previous()
    state.save(Previous("t1", "ab" * 32, 7, "cd" * 32))
    assert state.previous() == Previous("t1", "ab" * 32, 7, "cd" * 32)
    assert (tmp_path / "trail.json").stat().st_mode & 0o777 == 0o600
    (tmp_path / "trail.json").write_text("{")  # torn by a crash: a new chain, not no start
    assert state.previous() == Previous()
