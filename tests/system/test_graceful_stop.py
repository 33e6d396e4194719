"""SIGTERM on a busy worker process: drain, commit, exit 0; the next worker does exactly the rest.

Like ``tests/ingest/test_worker.py::test_restart_neither_redoes_committed_nor_skips_uncommitted``,
but through the real ``dicom-ingest worker`` process and a real signal. Which
process handled which object is read from the audit trail (``worker`` field).

Leaving the group, on Tansu 0.6: a group's first generation is 0 and aiokafka
sends LeaveGroup only for generations above 0 (``_maybe_leave_group``), so a
worker stopped in the group's first generation used to leave its membership
behind (still listed seconds after the process exited) and the next worker's
join waited on it. ``ingest.source.group`` lets aiokafka leave from generation
0 too: SIGTERM empties the group at once in every generation, and each
hand-over takes about one join (half the session timeout on Tansu).
"""

from __future__ import annotations

import signal
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from aiokafka.admin import AIOKafkaAdminClient

from ingest.audit.verify import object_records, verify_trail
from ingest.embedded.samples import synthetic_ct_series
from ingest.embedded.stack import Stack
from tests import harness
from tests.chaos import WorkerProcess, no_orphans, worker_environment

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.integration,
    pytest.mark.alone,  # its bounds are seconds: nothing else runs beside it
    pytest.mark.timeout(180),
]

DEADLINE_S = 10.0
SLICES = 100
STOP_AFTER = 20


async def group_members(stack: Stack, group: str) -> list[str]:
    admin = AIOKafkaAdminClient(bootstrap_servers=stack.kafka.bootstrap)
    await admin.start()
    try:
        (response,) = await admin.describe_consumer_groups([group])
        (described,) = response.groups
        return [member[0] for member in described[5]]  # (error, group, state, type, proto, members)
    finally:
        await admin.close()


async def success_keys_by_worker(stack: Stack, topic: str) -> tuple[dict[str, list[str]], Any]:
    """Keys of success audit records per worker id, in audit order; and the chain report."""
    trail = verify_trail(
        await harness.read_topic_raw(stack, topic),
        keys={"local-1": harness.AUDIT_KEY},
        trust_on_first_use=True,  # each trail's own key: the tests set no site key
    )
    records = object_records(trail.records)
    per_worker: dict[str, list[str]] = {}
    for record in records:
        if record["outcome"] == "success":
            per_worker.setdefault(record["worker"], []).append(record["key"])
    return per_worker, trail


async def sigterm(worker: WorkerProcess) -> tuple[int | None, float]:
    """SIGTERM; the exit status and the seconds it took (None if not within deadline + 10 s)."""
    stopped = time.monotonic()
    worker.signal(signal.SIGTERM)
    code = await worker.wait(DEADLINE_S + 10)
    return code, time.monotonic() - stopped


async def test_sigterm_drains_commits_leaves_and_hands_over(stack: Stack, tmp_path: Path) -> None:
    names = harness.make_names(f"stop{uuid.uuid4().hex[:8]}")
    harness.prepare(stack, names)
    # 512 x 512 slices (~0.5 MB, 8 ranged GETs at 64 KiB parts): objects are in flight
    # whenever the worker is busy, so SIGTERM finds work to drain
    slices = synthetic_ct_series(SLICES, rows=512, columns=512, seed=7)
    await harness.upload(stack, names.source_bucket, slices)
    keys = [key for key, _ in slices]  # offset i announces keys[i]
    notes = [harness.aws_notification(names.source_bucket, [k]) for k in keys]
    await harness.publish(stack, names.source_topic, notes)

    def worker(worker_id: str) -> WorkerProcess:
        env = worker_environment(
            stack, names, worker_id=worker_id, shutdown_deadline_s=str(DEADLINE_S)
        )
        return WorkerProcess(env, tmp_path / f"{worker_id}.log")

    with no_orphans():
        with worker("first") as first:
            first_assigned = await first.wait_for_partitions(within_s=60)
            assert first_assigned is not None, first.log_tail()
            assert await first.wait_for("processed", STOP_AFTER, within_s=60), first.log_tail()
            at_signal = first.counts["processed"]
            code, first_exit_s = await sigterm(first)
        assert code == 0, first.log_tail()
        assert first_exit_s < DEADLINE_S + 3
        stats = first.last("worker stopped")
        assert stats is not None, first.log_tail()
        lingering = await group_members(stack, names.group)  # generation 0 leaves too
        committed = await harness.committed_offset(stack, names.group, names.source_topic)
        # every record it took was finished within the deadline, and all of it committed
        assert stats["processed"] == stats["objects"] == stats["records"] == committed
        drained = stats["processed"] - at_signal

        with worker("second") as second:
            second_assigned = await second.wait_for_partitions(within_s=60)
            assert second_assigned is not None, second.log_tail()
            assert await second.wait_for("processed", SLICES - committed, within_s=120)
            for _ in range(100):
                if await harness.committed_offset(stack, names.group, names.source_topic) == SLICES:
                    break
            code, second_exit_s = await sigterm(second)
            assert code == 0, second.log_tail()
        members_after_second = await group_members(stack, names.group)

        with worker("third") as third:  # joins a group its predecessor has left
            third_assigned = await third.wait_for_partitions(within_s=60)
            assert third_assigned is not None, third.log_tail()
            code, _ = await sigterm(third)
            assert code == 0, third.log_tail()

    print(
        f"\nSIGTERM after {at_signal} processed: exit 0 in {first_exit_s:.2f} s"
        f" (deadline {DEADLINE_S:.0f} s), {drained} drained; committed {committed}/{SLICES};"
        f" members left by the generation-0 worker: {len(lingering)}."
        f"\nPartitions assigned after spawn: fresh group {first_assigned:.2f} s;"
        f" after the gen-0 SIGTERM {second_assigned:.2f} s;"
        f" after a SIGTERM that sent LeaveGroup {third_assigned:.2f} s."
        f" Second worker's SIGTERM exit {second_exit_s:.2f} s,"
        f" members left {len(members_after_second)}"
    )
    per_worker, chain = await success_keys_by_worker(stack, names.audit_topic)
    assert sorted(per_worker["first"]) == sorted(keys[:committed])  # committed means done
    # the next worker redid nothing committed and skipped nothing uncommitted
    assert sorted(per_worker["second"]) == sorted(keys[committed:])
    assert "third" not in per_worker
    assert await harness.committed_offset(stack, names.group, names.source_topic) == SLICES
    results = await harness.read_json_topic(stack, names.results_topic)
    assert sorted(r["source"]["key"] for r in results) == sorted(keys)  # each exactly once
    assert chain.ok, chain.findings
    assert len(chain.trails) == 3  # the third worker's trail: its start and stop only
    assert lingering == members_after_second == []  # every generation leaves on SIGTERM
    # generous bounds: start-up on a loaded machine dominates; nobody's session to wait out
    assert second_assigned < first_assigned + 3.0
    assert third_assigned < first_assigned + 3.0
