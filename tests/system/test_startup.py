"""Start-up as users run it: ``dicom-ingest worker`` with the embedded stack's environment.

A worker with default settings has its first object's output within
3 s of its start on the embedded stack, and the group timing that the stack
gives its workers (``GROUP_TIMING``: Tansu holds a join for half the session
timeout) does not cost a healthy, busy worker its membership.

The worker is the real process (``python -m ingest.cli worker``, the same
entry point as the ``dicom-ingest`` script), its environment the user's shell
less ``DICOM_INGEST_*`` plus what ``dicom-ingest stack`` prints; only the topic,
bucket and group names are this test's own, since the session's stack is shared.
``python -m ingest.bench.diagnostics.startup`` takes the same figure over many runs.
"""

from __future__ import annotations

import base64
import os
import time
import uuid
from pathlib import Path

import anyio
import pytest
from aiokafka import AIOKafkaProducer

from ingest.embedded.samples import example_bytes, synthetic_ct_series
from ingest.embedded.stack import Stack
from ingest.settings import PREFIX
from tests import harness
from tests.chaos import WorkerProcess, no_orphans

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.integration,
    pytest.mark.alone,  # its bounds are seconds: nothing else runs beside it
    pytest.mark.timeout(120),
]

FIRST_OUTPUT_S = 3.0  # the bound, from the process's start to its first result
BUSY_S = 8.0  # four session timeouts of the stack's GROUP_TIMING
BUSY_RATE = 40  # notifications a second while busy


def user_environment(stack: Stack, names: harness.Names) -> dict[str, str]:
    """The user's shell (less our variables) plus what ``dicom-ingest stack`` prints."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(PREFIX)}
    env |= stack.endpoints.environment()
    env |= {
        PREFIX + "OUTPUT_URL": f"s3://{names.output_bucket}/processed/",
        PREFIX + "AUDIT_KEY": base64.b64encode(os.urandom(32)).decode(),
        PREFIX + "SOURCE_TOPIC": names.source_topic,
        PREFIX + "RESULTS_TOPIC": names.results_topic,
        PREFIX + "DLQ_TOPIC": names.dlq_topic,
        PREFIX + "AUDIT_TOPIC": names.audit_topic,
        PREFIX + "GROUP_ID": names.group,
        "PYTHONUNBUFFERED": "1",
    }
    return env


def prepared(stack: Stack) -> harness.Names:
    names = harness.make_names(f"up{uuid.uuid4().hex[:8]}")
    harness.prepare(stack, names, partitions=4)  # as `dicom-ingest stack` makes its topics
    return names


def seconds_to(worker: WorkerProcess, event: str) -> float | None:
    seen = worker.first_seen.get(event)
    return None if seen is None else seen - worker.started_at


async def test_default_worker_gives_its_first_output_within_3_s(
    stack: Stack, tmp_path: Path
) -> None:
    names = prepared(stack)
    key = "ct/CT_small.dcm"
    await harness.upload(stack, names.source_bucket, [(key, example_bytes("CT_small.dcm"))])
    producer = AIOKafkaProducer(bootstrap_servers=stack.kafka.bootstrap, acks="all")
    await producer.start()
    try:
        with no_orphans(), WorkerProcess(user_environment(stack, names), tmp_path / "w.log") as w:
            # published at the worker's start, as an object arriving while it starts
            await producer.send_and_wait(
                names.source_topic, harness.aws_notification(names.source_bucket, [key])
            )
            first_output = await w.wait_for("processed", within_s=60)
            assert first_output is not None, w.log_tail()
            started, joined = seconds_to(w, "worker started"), w.assigned_after_s()
    finally:
        await producer.stop()
    print(
        f"\nfrom spawn: worker started {started:.2f} s, partitions assigned {joined:.2f} s,"
        f" first output {first_output:.2f} s (bound {FIRST_OUTPUT_S:.0f} s)"
    )
    (result,) = await harness.read_json_topic(stack, names.results_topic)
    assert result["source"]["key"] == key
    npy = await harness.get_object(
        stack, names.output_bucket, f"processed/{names.source_bucket}/{key}.npy"
    )
    assert harness.load_npy(npy).shape == (1, 128, 128)
    assert first_output < FIRST_OUTPUT_S, w.log_tail()


async def test_stack_group_timing_keeps_a_busy_worker_in_its_group(
    stack: Stack, tmp_path: Path
) -> None:
    names = prepared(stack)
    slices = synthetic_ct_series(int(BUSY_S * BUSY_RATE), rows=128, columns=128, seed=3)
    await harness.upload(stack, names.source_bucket, slices)
    producer = AIOKafkaProducer(bootstrap_servers=stack.kafka.bootstrap, acks="all")
    await producer.start()
    try:
        with no_orphans(), WorkerProcess(user_environment(stack, names), tmp_path / "w.log") as w:
            assert await w.wait_for_partitions(within_s=30) is not None, w.log_tail()
            busy_from = time.monotonic()
            for i, (key, _) in enumerate(slices):  # a steady stream for BUSY_S seconds
                note = harness.aws_notification(names.source_bucket, [key])
                await producer.send_and_wait(names.source_topic, note)
                await anyio.sleep(max(0.0, busy_from + (i + 1) / BUSY_RATE - time.monotonic()))
            assert await w.wait_for("processed", len(slices), within_s=60), w.log_tail()
            busy_s = time.monotonic() - busy_from
            assignments = [f for _, f in w.events if f["event"] == "partitions assigned"]
    finally:
        await producer.stop()
    print(f"\n{len(slices)} objects over {busy_s:.1f} s; assignments: {len(assignments)}")
    assert busy_s >= BUSY_S
    # one join, never a second: the member was not evicted nor the group rebalanced
    assert [a["partitions"] for a in assignments] == [[0, 1, 2, 3]], w.log_tail()
